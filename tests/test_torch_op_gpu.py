"""The chapters as a PyTorch op (common/torch_op.py) on the GPU. Skipped, in one line, without PyTorch or
a CUDA device it sees. The libraries it loads are `make lib`'s (make test builds them first).

  forward    06, 07, 08, 08.3, 09 x D {64, 128} x causal: O and LSE against float64 (helpers.attention64)
             within the chapter's precision's tolerance (FP8: 1.5x the e4m3 floor + 3e-3)
  gradients  07, 08 (FP8: O and LSE recomputed by 09's forward), 09 forward, 09 backward, on the
             backward's output shapes: dQ, dK, dV within BACKWARD_TOL of float64 and at most twice the
             max abs error of PyTorch's own fp16 backward (flash) on the same inputs; once with a
             non-contiguous dO (autograd's, which the op makes contiguous)
  opcheck    torch.library.opcheck of both ops (schema, autograd registration, fake tensors, AOT
             dispatch with dynamic shapes), on 09's backward in its deterministic mode (deterministic=True)
             so that eager and compiled gradients are bitwise comparable
  compile    torch.compile(fullgraph=True) of a function calling the op, aot_eager and inductor:
             the same O and gradients as eager
  repeat     deterministic=True: dQ, dK, dV bitwise the same in two backward calls on the same inputs
  decode     11's decoding through the op (grouped heads, ragged lengths, pages of 1 and 16) against float64,
             and through a DecodePlan (bitwise the op's);
             make generate's paged cache (a prompt written at once, then a token at a time) against its
             contiguous one
  errors     each refusal: its exception type and words
  training   50 steps of common/train.py's model with the op: finite losses that fall, from where the
             same run with SDPA starts, as far as it within a tenth of its fall; common/train.py end to
             end (its CSV, its summary, its saved models), then common/generate.py on a model it saved
"""
import math
import os
import re

import numpy as np
import pytest

import reference
import torch_op
from chapters import runs_on
from helpers import (BACKWARD_OUTPUT_SHAPES, BACKWARD_TOL, FP8_FLOOR_FACTOR, LSE_TOL, REL_L2_TOL, attention64,
                     attention64_grads, fp8_floor_attention, torch_grad_errors)

pytestmark = pytest.mark.gpu

FORWARD_CHAPTERS = ("06", "07", "08", "08.3", "08.4", "09")
GRADIENT_CHAPTERS = ("07", "08", "09")
FORWARD_SHAPE = (2, 3, 257)  # B, H, N (ragged: not a multiple of any tile)
DIMS = (64, 128)
TOLERANCE_OF = {torch_op.FA_PRECISION_FP32: REL_L2_TOL[1], torch_op.FA_PRECISION_FP16_TC: REL_L2_TOL[7]}
TRAIN_STEPS, TRAIN_BATCH = 50, 8


@pytest.fixture(scope="module")
def op(repo, torch):
    """torch, with torch_op loading the build folder's libraries (make lib)."""
    os.environ["FA_BUILD"] = str(repo.build)
    return torch


def runs_here(torch, *chapters):
    """Skip unless every named chapter's library is built and runs on this GPU."""
    major, minor = torch.cuda.get_device_capability()
    for chapter in chapters:
        if not os.path.isfile(torch_op.library_path(chapter)):
            pytest.skip(f"{torch_op.library_path(chapter)} is not built: run make lib")
        lib = torch_op.library(chapter)
        if not lib.runs_on(major * 10 + minor):
            pytest.skip(f"{lib.name} runs on {runs_on({'min_sm': lib.min_sm, 'max_sm': lib.max_sm})}, "
                        f"this GPU is sm_{major}{minor}")


def random_inputs(b, h, n, d, seed, names="qkv"):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((b, h, n, d)).astype(np.float16) for _ in names]


def rel_l2(got, want):
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def to_numpy(t):
    return t.detach().float().cpu().numpy().astype(np.float64)


def shown_shape(chapter, b, h, n, d, causal):
    return f"{chapter} B={b} H={h} N={n} D={d}{' causal' if causal else ''}"


# --- The forward -------------------------------------------------------------------------------------
def forward_tolerances(lib, q, k, v, causal, want_o, want_lse):
    """(rel L2 of O, LSE max abs): the harness's rule of the library's precision."""
    if lib.precision != torch_op.FA_PRECISION_FP8_TC:
        return TOLERANCE_OF[lib.precision], LSE_TOL
    floor_o, floor_lse = fp8_floor_attention(q, k, v, causal, q.shape[-1])
    return (FP8_FLOOR_FACTOR * rel_l2(floor_o, want_o) + REL_L2_TOL[7],
            FP8_FLOOR_FACTOR * float(np.abs(floor_lse - want_lse).max()) + LSE_TOL)


@pytest.mark.parametrize("chapter", FORWARD_CHAPTERS)
@pytest.mark.parametrize("causal", (False, True), ids=["", "causal"])
@pytest.mark.parametrize("d", DIMS, ids=lambda d: f"D={d}")
def test_forward(op, chapter, d, causal):
    torch = op
    runs_here(torch, chapter)
    b, h, n = FORWARD_SHAPE
    q, k, v = random_inputs(b, h, n, d, seed=n + d + causal)
    o, lse = torch_op.attention(*(torch.from_numpy(x).cuda() for x in (q, k, v)), causal=causal, chapter=chapter,
                                backward=None, return_lse=True)
    shown = shown_shape(chapter, b, h, n, d, causal)
    assert o.dtype == torch.float16 and tuple(o.shape) == (b, h, n, d), f"{shown}: O is {o.dtype} {tuple(o.shape)}"
    assert lse.dtype == torch.float32 and tuple(lse.shape) == (b, h, n), f"{shown}: LSE is {lse.dtype} {tuple(lse.shape)}"
    want_o, want_lse = attention64(q, k, v, causal, 1 / math.sqrt(d))
    got_o, got_lse = to_numpy(o), to_numpy(lse)
    assert np.isfinite(got_o).all() and np.isfinite(got_lse).all(), f"{shown}: non-finite O or LSE"
    tol, lse_tol = forward_tolerances(torch_op.library(chapter), q, k, v, causal, want_o, want_lse)
    rel, lse_err = rel_l2(got_o, want_o), float(np.abs(got_lse - want_lse).max())
    assert rel <= tol, f"{shown}: O relative L2 error {rel:.3e} against float64, expected <= {tol:.2e}"
    assert lse_err <= lse_tol, f"{shown}: LSE max abs error {lse_err:.3e}, expected <= {lse_tol:.2e}"


# --- The gradients ------------------------------------------------------------------------------------
def check_gradients(shown, grads, want, torch_errors):
    """Each of dQ, dK, dV within BACKWARD_TOL (rel L2) of float64 and at most twice PyTorch's max abs error."""
    notes = []
    for name, got, w, theirs in zip(("dq", "dk", "dv"), grads, want, torch_errors):
        got = to_numpy(got)
        assert np.isfinite(got).all(), f"{shown}: non-finite {name}"
        rel, mine = rel_l2(got, w), float(np.abs(got - w).max())
        assert rel <= BACKWARD_TOL, f"{shown}: {name} relative L2 error {rel:.3e} against float64, expected <= {BACKWARD_TOL}"
        assert mine <= 2 * theirs, (f"{shown}: max abs error of {name} {mine:.3e}, more than twice PyTorch's fp16 "
                                    f"backward's {theirs:.3e} on the same inputs")
        notes.append(f"{name} {rel:.1e} ({mine / theirs:.2f}x PyTorch's max abs)")
    return ", ".join(notes)


GRADIENT_PARAMS = [pytest.param(chapter, *shape, False, id=f"{chapter} B={shape[0]} H={shape[1]} N={shape[2]} "
                                f"D={shape[3]}{' causal' if shape[4] else ''}")
                   for chapter in GRADIENT_CHAPTERS for shape in BACKWARD_OUTPUT_SHAPES]
GRADIENT_PARAMS.append(pytest.param("07", *BACKWARD_OUTPUT_SHAPES[0], True, id="07 dO not contiguous"))


@pytest.mark.parametrize("chapter,b,h,n,d,causal,transposed_grad", GRADIENT_PARAMS)
def test_gradients(op, repo, chapter, b, h, n, d, causal, transposed_grad):
    torch = op
    runs_here(torch, chapter, "09")
    q, k, v, do = random_inputs(b, h, n, d, seed=7 * n + d, names="qkvo")
    leaves = [torch.from_numpy(x).cuda().requires_grad_() for x in (q, k, v)]
    o = torch_op.attention(*leaves, causal=causal, chapter=chapter, backward="09")
    grad = torch.from_numpy(do).cuda()
    if transposed_grad:  # dO's values, its memory laid out [B, N, H, D]: autograd hands the op that layout
        arrived = []
        o.register_hook(lambda g: arrived.append(g.is_contiguous()))
        (o.float() * grad.transpose(1, 2).contiguous().transpose(1, 2).float()).sum().backward()
        assert arrived == [False], f"the op's dO was contiguous ({arrived}): the case tests nothing"
    else:
        o.backward(grad)
    want = attention64_grads(q, k, v, do, causal, 1 / math.sqrt(d))
    theirs = repo.once(("torch_op_grad_errors", b, h, n, d, causal), lambda: torch_grad_errors(q, k, v, do, causal, want))
    shown = shown_shape(chapter, b, h, n, d, causal) + (" (dO not contiguous)" if transposed_grad else "")
    check_gradients(shown, [x.grad for x in leaves], want, theirs)


# --- opcheck and torch.compile ----------------------------------------------------------------------------
@pytest.mark.parametrize("chapter,d,causal", [("07", 64, True), ("09", 128, False), ("08", 128, True)],
                         ids=["07 D=64 causal", "09 D=128", "08 D=128 causal"])
def test_opcheck(op, chapter, d, causal):
    torch = op
    runs_here(torch, chapter, "09")
    b, h, n = 1, 2, 200
    q, k, v, do = (torch.from_numpy(x).cuda() for x in random_inputs(b, h, n, d, seed=3, names="qkvo"))
    scale = 1 / math.sqrt(d)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    torch.library.opcheck(torch.ops.fa_tutorial.attention.default, (*leaves, causal, scale, chapter, "09", True))
    o, lse = torch.ops.fa_tutorial.attention(q, k, v, causal, scale, chapter, "", False)
    torch.library.opcheck(torch.ops.fa_tutorial.attention_backward.default,
                          (q, k, v, o, lse, do, causal, scale, chapter, "09", True))


@pytest.mark.parametrize("backend", ("aot_eager", "inductor"))
def test_compile(op, backend):
    torch = op
    runs_here(torch, "07", "09")
    q, k, v, do = (torch.from_numpy(x).cuda() for x in random_inputs(2, 3, 300, 64, seed=5, names="qkvo"))

    def loss(q, k, v):
        o = torch_op.attention(q, k, v, causal=True, chapter="07", backward="09", deterministic=True)
        return o, (o.float() * do.float()).sum()

    results = []
    for fn in (loss, torch.compile(loss, backend=backend, fullgraph=True)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o, total = fn(*leaves)
        total.backward()
        results.append([o.detach()] + [x.grad for x in leaves])
    for name, eager, compiled in zip(("O", "dQ", "dK", "dV"), *results):
        assert torch.equal(eager, compiled), (
            f"torch.compile(backend={backend!r}): {name} differs from eager by up to "
            f"{(eager.float() - compiled.float()).abs().max().item():.3e}")


def test_deterministic_repeats_bitwise(op):
    """deterministic=True: two backward calls through the op on the same inputs give bitwise the same dQ, dK
    and dV, each within BACKWARD_TOL of float64 (test_gpu repeats the binary's on more shapes)."""
    torch = op
    runs_here(torch, "09")
    b, h, n, d, causal = 1, 4, 1024, 128, True
    q, k, v, do = random_inputs(b, h, n, d, seed=11, names="qkvo")
    want = attention64_grads(q, k, v, do, causal, 1 / math.sqrt(d))
    runs = []
    for _ in range(2):
        leaves = [torch.from_numpy(x).cuda().requires_grad_() for x in (q, k, v)]
        torch_op.attention(*leaves, causal=causal, chapter="09", backward="09", deterministic=True).backward(
            torch.from_numpy(do).cuda())
        runs.append([x.grad for x in leaves])
    shown = shown_shape("09", b, h, n, d, causal) + " deterministic=True, twice"
    for name, first, second, w in zip(("dQ", "dK", "dV"), *runs, want):
        error = rel_l2(to_numpy(first), w)
        assert error <= BACKWARD_TOL, f"{shown}: {name} relative L2 error {error:.3e}, expected <= {BACKWARD_TOL}"
        assert torch.equal(first.view(torch.int16), second.view(torch.int16)), (
            f"{shown}: {name} differs between the two calls, expected bitwise the same")


# --- The refusals ---------------------------------------------------------------------------------------
def error_cases(torch):
    """(label, call, exception type, pattern of its message)."""
    cuda = torch.device("cuda")
    base = torch.randn(1, 2, 64, 64, device=cuda, dtype=torch.float16)
    misaligned = torch.empty(base.numel() + 1, device=cuda, dtype=torch.float16)[1:].view(base.shape)
    attend = torch_op.attention
    return [
        ("cpu tensors", lambda: attend(base.cpu(), base.cpu(), base.cpu()), ValueError, r"q is on cpu.*CUDA device"),
        ("float32", lambda: attend(base.float(), base.float(), base.float()), TypeError, r"torch\.float32.*float16"),
        ("bfloat16 k", lambda: attend(base, base.bfloat16(), base), TypeError, r"k is torch\.bfloat16"),
        ("head dim 96", lambda: attend(*(torch.randn(1, 2, 64, 96, device=cuda, dtype=torch.float16),) * 3),
         ValueError, r"head dimension D = 96.*64 or 128"),
        ("k of another N", lambda: attend(base, base[:, :, :32], base[:, :, :32]), ValueError, r"expected one shape"),
        ("3 dimensions", lambda: attend(base[0], base[0], base[0]), ValueError, r"\(2, 64, 64\).*\[B, H, N, D\]"),
        ("not contiguous", lambda: attend(base.transpose(1, 2), base.transpose(1, 2), base.transpose(1, 2)),
         ValueError, r"q is not contiguous.*\.contiguous\(\)"),
        ("misaligned", lambda: attend(misaligned, base, base), ValueError, r"q's data .* not 16-byte aligned"),
        ("no such chapter", lambda: attend(base, base, base, chapter="42"), ValueError, r"chapter '42': no such chapter"),
        ("no such step", lambda: attend(base, base, base, chapter="08.9"), ValueError, r"steps are 08\.1 \.\.\. 08\.6"),
        ("deterministic as a build", lambda: backward_through(torch, "09.deterministic"), ValueError,
         r"no build 'deterministic'.*deterministic=True"),
        ("B*H too large", lambda: attend(*(torch.randn(1, 65536, 1, 64, device=cuda, dtype=torch.float16),) * 3),
         RuntimeError, r"B\*H = 65536: at most 65535.*FA_ERR_INVALID_ARGUMENT"),
        ("backward=None", lambda: backward_through(torch, None), RuntimeError, r"no backward chapter was given"),
        ("backward=07", lambda: backward_through(torch, "07"), RuntimeError, r"07_async_pipeline has no backward pass"),
    ]


def backward_through(torch, backward):
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    torch_op.attention(q, q.detach(), q.detach(), backward=backward).sum().backward()


# --- Decoding -----------------------------------------------------------------------------------------------
# (B, Hq, Hkv, Nq, D, page size, the sequences' cached lengths): grouped heads, ragged lengths, pages of 1 and 16
DECODE_CASES = [(3, 8, 2, 1, 128, 16, (1, 77, 300)), (2, 16, 4, 4, 64, 1, (4, 1000))]


@pytest.mark.parametrize("b, hq, hkv, nq, d, page, lengths", DECODE_CASES,
                         ids=[f"B={c[0]} Hq={c[1]} Hkv={c[2]} Nq={c[3]} D={c[4]} P={c[5]}" for c in DECODE_CASES])
def test_decode(op, b, hq, hkv, nq, d, page, lengths):
    """fa_tutorial::decode on 11's library: O and LSE against the float64 reference on the gathered cache
    (common/reference.py decode_reference), within 11's rule; max_length given, then read from the device."""
    torch = op
    runs_here(torch, "11")
    q, k_pool, v_pool, table, lens = reference.make_decode_inputs(b, hq, hkv, nq, d, page, list(lengths), seed=0)
    scale = 1 / math.sqrt(d)
    k_cache, v_cache = (reference.gather_cache(pool, table, lens).astype(np.float64) for pool in (k_pool, v_pool))
    want_o, want_lse = reference.decode_reference(q.astype(np.float64), k_cache, v_cache, lens, scale)
    cuda = [torch.from_numpy(np.ascontiguousarray(x)).cuda() for x in
            (q, k_pool, v_pool, np.maximum(table, 0).astype(np.int32), lens.astype(np.int32))]  # -1: never read
    shown = f"decode B={b} Hq={hq} Hkv={hkv} Nq={nq} D={d} P={page} lengths {lengths}"
    torch.library.opcheck(torch.ops.fa_tutorial.decode, (*cuda, max(lengths), scale, "11"))  # schema, fake, dispatch
    for max_length in (max(lengths), None):
        o, lse = torch_op.decode(*cuda, max_length=max_length)
        assert o.dtype == torch.float16 and tuple(o.shape) == q.shape, f"{shown}: O is {o.dtype} {tuple(o.shape)}"
        rel, lse_err = rel_l2(to_numpy(o), want_o), float(np.abs(to_numpy(lse) - want_lse).max())
        assert rel <= REL_L2_TOL[11], f"{shown}: O relative L2 error {rel:.3e}, expected <= {REL_L2_TOL[11]}"
        assert lse_err <= LSE_TOL, f"{shown}: LSE max abs error {lse_err:.3e}, expected <= {LSE_TOL}"
    # The same call planned once and run twice (generate's path): bitwise the op's O and LSE.
    plan = torch_op.DecodePlan(*cuda, max(lengths))
    for _ in range(2):
        planned = plan.run(*cuda[:3])
        assert all(torch.equal(a, b) for a, b in zip(planned, (o, lse))), f"{shown}: DecodePlan.run differs from the op"
    # Appended by the plan (fa_decode_append): the new tokens' K and V taken out of copies of the pools
    # (their rows set to 7) and given as k_new, v_new: both pools come back bitwise whole (each row where
    # fa_decode reads it, nothing else written), and O and LSE are the op's.
    where = [(s, j, int(table[s, (lengths[s] - nq + j) // page]), (lengths[s] - nq + j) % page)
             for s in range(b) for j in range(nq)]
    news, holes = [], []
    for pool in cuda[1:3]:
        new, hole = pool.new_empty((b, hkv, nq, d)), pool.clone()
        for s, j, at, row in where:
            new[s, :, j] = pool[at, :, row]
            hole[at, :, row] = 7.0
        news.append(new)
        holes.append(hole)
    appended = plan.run(cuda[0], *holes, k_new=news[0], v_new=news[1])
    for name, hole, pool in (("K", holes[0], cuda[1]), ("V", holes[1], cuda[2])):
        assert torch.equal(hole, pool), f"{shown}: the appended {name} pool differs from the whole one"
    assert all(torch.equal(a, b) for a, b in zip(appended, (o, lse))), f"{shown}: O or LSE after the append differs"
    with pytest.raises(ValueError, match=r"k_new and v_new: both or neither"):
        plan.run(*cuda[:3], k_new=news[0])
    with pytest.raises(ValueError, match=r"k_new: .*the plan was made for"):
        plan.run(*cuda[:3], k_new=cuda[0], v_new=cuda[0])
    with pytest.raises(ValueError, match=r"q: .*the plan was made for"):
        plan.run(cuda[0][:, :, :1].contiguous() if nq > 1 else torch.cat([cuda[0]] * 2, 2), *cuda[1:3])
    with pytest.raises(TypeError, match=r"q is torch.float32: the plan takes torch.float16"):
        plan.run(cuda[0].float(), *cuda[1:3])


@pytest.mark.parametrize("page", (1, 7, 16))
def test_generate_paged_cache(op, page):
    """make generate's PagedCache against its ContiguousCache: a prompt of 25 tokens written at once (a
    scatter), then 40 tokens one at a time, each appended and attended to by one DecodePlan run (11):
    at every step within 11's rule of float64 attention over what the contiguous cache holds, and at
    the end every position's K and V, read through the block table, bitwise the contiguous cache's."""
    torch = op
    runs_here(torch, "11")
    import generate
    train = training_module()
    paged, contiguous = generate.PagedCache(1, page, "cuda", seed=1), generate.ContiguousCache(1, "cuda")
    shape = (1, train.HEADS, 1, train.HEAD_DIM)
    generator = torch.Generator(device="cuda").manual_seed(0)
    start = 0
    for count in [25] + [1] * 40:
        q, k, v = (torch.randn((*shape[:2], count, shape[3]), device="cuda", dtype=torch.float16, generator=generator)
                   for _ in range(3))
        for cache in (paged, contiguous):
            cache.begin(start, count)
        start += count
        if count > 1:
            paged.write(0, k, v)
            contiguous.write(0, k, v)
            continue
        ours = paged.step(0, q, k, v, "11")
        contiguous.step(0, q, k, v)
        keys, values = (to_numpy(t[0][:, :, :start]) for t in (contiguous.k, contiguous.v))
        want, _ = reference.decode_reference(to_numpy(q), keys, values, np.array([start]), 1 / math.sqrt(shape[3]))
        rel = rel_l2(to_numpy(ours), want)
        assert rel <= REL_L2_TOL[11], (f"pages of {page}, {start} tokens cached: relative L2 {rel:.3e} from float64 "
                                       f"over the contiguous cache")
    positions = torch.arange(start, device="cuda")
    pages, rows = paged.table[0, positions // page].long(), positions % page
    for name, pool, flat in (("K", paged.k[0], contiguous.k[0]), ("V", paged.v[0], contiguous.v[0])):
        assert torch.equal(pool[pages, :, rows], flat[0, :, :start].transpose(0, 1)), f"pages of {page}: {name} differs"


def test_errors(op):
    torch = op
    runs_here(torch, "07", "09")
    wrong = []
    cases = error_cases(torch)
    for label, call, kind, pattern in cases:
        try:
            call()
            wrong.append(f"{label}: no exception, expected {kind.__name__} matching {pattern!r}")
        except Exception as exc:  # the type and words are what is checked
            text = str(exc)
            if not isinstance(exc, kind) or not re.search(pattern, text) or "\n" in text:
                wrong.append(f"{label}: {type(exc).__name__}: {text!r}, expected one line of {kind.__name__} "
                             f"matching {pattern!r}")
    assert not wrong, f"{len(wrong)} of {len(cases)} refusals wrong:\n" + "\n".join(wrong)


# --- Training ---------------------------------------------------------------------------------------------
def training_module():
    import train
    return train


def test_training_run_learns(op):
    """TRAIN_STEPS steps with the op (07 forward, 09 backward) and with SDPA, from one seed."""
    runs_here(op, "07", "09")
    train = training_module()
    corpus = train.load_corpus("cuda")
    runs = {}
    for run, attend in (("07", train.chapter_attention("07", "09")), ("sdpa", train.sdpa_attention)):
        runs[run], _ = train.train_run(run, attend, corpus, TRAIN_STEPS, TRAIN_BATCH, eval_every=TRAIN_STEPS // 2,
                                       eval_batches=2, progress=False)
    rows = runs["07"]
    losses = [r["val_loss"] for r in rows] + [r["train_loss"] for r in rows[1:]]
    assert all(math.isfinite(x) for x in losses), f"non-finite losses: {rows}"
    first, last = rows[0]["val_loss"], rows[-1]["val_loss"]
    assert last < 0.9 * first, f"validation loss {first:.3f} at step 0, {last:.3f} after {TRAIN_STEPS} steps: expected a fall"
    assert rows[-1]["train_loss"] < rows[1]["train_loss"], f"training loss did not fall: {rows}"
    # The same model from the same seed: at step 0 the two runs differ by the forwards' rounding
    # only. After it the loss falls steeply (about 0.02 a step here), and the runs part by their
    # gradients' rounding (and the order of both backwards' dQ atomics), so what must agree is how
    # far each has fallen: within a tenth of SDPA's fall. A wrong gradient stalls or slows the fall.
    sdpa_first, other = runs["sdpa"][0]["val_loss"], runs["sdpa"][-1]["val_loss"]
    assert abs(first - sdpa_first) < 1e-2, f"validation loss at step 0: {first:.4f} with the op, {sdpa_first:.4f} with SDPA"
    fall, sdpa_fall = first - last, sdpa_first - other
    assert abs(fall - sdpa_fall) < 0.1 * sdpa_fall, (
        f"after {TRAIN_STEPS} steps: validation loss {first:.4f} -> {last:.4f} with the op, {sdpa_first:.4f} -> "
        f"{other:.4f} with SDPA: falls of {fall:.4f} and {sdpa_fall:.4f} differ by more than a tenth of SDPA's")


def test_train_script(op, repo, tmp_path):
    """common/train.py end to end, briefly: SDPA, 07 and 07 with the deterministic backward, from two
    initialisation seeds; the CSV, every run of every seed on the same batches, and the summary table."""
    runs_here(op, "07", "09")
    out = tmp_path / "train.csv"
    proc = repo.run([repo.python, repo.root / "common" / "train.py", "--chapter", "07,07@deterministic", "--seeds", "0,1",
                     "--steps", "20", "--eval-every", "10", "--eval-batches", "1", "--batch", "4", "--out", out,
                     "--build", repo.build, "--no-build"], timeout=600)
    assert proc.returncode == 0, f"train.py: exit {proc.returncode}:\n{(proc.stdout + proc.stderr).strip()[-2000:]}"
    train = training_module()
    rows = train.read_csv(out)
    runs = ("sdpa", "07_async_pipeline", "07_async_pipeline@deterministic")
    assert [(r["seed"], r["run"], r["step"]) for r in rows] == [(seed, run, s) for seed in (0, 1) for run in runs
                                                                for s in (0, 10, 20)], f"{out.name}: rows {rows}"
    # Step 0 is the initial weights: one seed, one loss up to the forwards' rounding; two seeds, two losses.
    first = {(r["seed"], r["run"]): r["val_loss"] for r in rows if r["step"] == 0}
    assert all(abs(first[(seed, run)] - first[(seed, "sdpa")]) < 1e-2 for seed in (0, 1) for run in runs), first
    assert first[(0, "sdpa")] != first[(1, "sdpa")], f"seeds 0 and 1 start from the same weights: {first}"
    assert len({r["gpu"] for r in rows}) == 1 and rows[0]["gpu"], f"{out.name}: the GPU of each row: {rows}"
    table = train.summary_table(rows)
    assert table in proc.stdout, f"train.py's summary is not the table of its CSV:\n{proc.stdout}\n---\n{table}"
    saved = re.search(r"^the trained models \(make generate loads one\): (.*)$", proc.stdout, re.M)
    paths = [repo.root / p for p in saved.group(1).split(", ")] if saved else []
    assert len(paths) == 6 and all(p.is_file() for p in paths), f"train.py's models: {saved and saved.group(0)}"
    # make generate on one of them: the prompt by 07, each next token by 11 from a paged cache, beside SDPA.
    tokens = 24
    proc = repo.run([repo.python, repo.root / "common" / "generate.py", "--model", paths[1], "--tokens", tokens,
                     "--page-size", "7", "--build", repo.build, "--no-build"], timeout=600)
    assert proc.returncode == 0, f"generate.py: exit {proc.returncode}:\n{(proc.stdout + proc.stderr).strip()[-2000:]}"
    verdicts = re.findall(r"^(SDPA[\w ]*): (the same (\d+) tokens|they differ first at .*)$", proc.stdout, re.M)
    assert [v[0] for v in verdicts] == ["SDPA", "SDPA flash", "SDPA cuDNN", "SDPA efficient"][:len(verdicts)] and verdicts, (
        f"generate.py printed no verdict per SDPA backend:\n{proc.stdout}")
    for name, verdict, count in verdicts:
        steps = re.search(r"the chapter's gap \S+, ([\d.]+) fp16 rounding steps", verdict)
        assert count == str(tokens) or (steps and float(steps.group(1)) <= 4), (
            f"{name}: {verdict}: expected the same {tokens} tokens, or a choice between logits within a few fp16 steps")
    assert re.search(r"^decoding, tokens/s: 11_decode \d+", proc.stdout, re.M), f"no rates:\n{proc.stdout}"
