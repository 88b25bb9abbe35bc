"""The GPU matrix: every chapter, on shapes that stress the edges, against the float64 reference.

The binaries are the build folder's; the harness caches each shape's inputs and reference (in .cache,
or $FA_CACHE), so that references are made once and shared by every chapter. The tests of one shape
form one xdist group, run in turn by one worker: the first run makes that shape's cache folder, the
others reuse it, and no two workers ever make the same folder at once.

  matrix          chapter x D {64, 128} x causal x N {1, 17, 64, 127, 128, 1000, 2048} (08 also 384 and
                  385: its 192-key tiles) at (B, H) = (2, 3), and (1, 1) at N = 17: exit 0, PASS,
                  and the row's kernels, workspace and device memory are the chapter's promise
  large_logits    chapter x D x causal on `reference.py inputs --qk-std 4.5` (logits ~100)
  huge_logits     FP8 chapters x causal, D = 128, on `--qk-std 20` (logits ~2000): past what one fp16
                  HFMA2 holds, where 08's softmax on fp16 scores recentres them first
  one_hot         FP8 chapters x causal, D = 128: q = k = 1000 e_(i mod 128), logits ~1.3e5 (log2) at
                  matching keys and 0 elsewhere: O must be the mean of those keys' v
  outliers        chapter x causal on `reference.py inputs --outliers 0.001` (0.1% of Q and K entries
                  +-U(10, 100)): the case FP8's per-(b, h) scales must survive
  output          chapter: --output's o.npy and lse.npy against float64 computed here
  twice_torch     fp16 tensor-core chapters (06, 07, 09, and 08's fp16 steps): max abs error of O at
                  most twice that of PyTorch's fp16 flash attention on the same inputs (FlashAttention's
                  own rule; skipped without PyTorch)
  step            the step builds (BUILD/08_fp8.step1 ... step5, BUILD/09_backward.step1 ... step7):
                  a lean matrix (both D, masks, ragged N, large logits), 08's under each step's
                  precision, 09's with --backward (the forward they share is the chapter's)
  scratch         chapters with B*H*N^2 scratch: a shape whose scratch cannot fit is refused (exit 2)
  backward        chapters with a backward pass (09) x D x causal x N x (B, H), --backward: dQ, dK, dV
                  each within the rel L2 bound; a lean matrix in the deterministic mode (--backward
                  --deterministic, its row's impl 09_backward.deterministic), and a shape with more blocks
                  than the GPU holds at once; large logits; --output's gradients against float64 and at
                  most twice PyTorch's fp16 backward's max abs error; dK, dV (and in the deterministic
                  mode, dQ too) bitwise the same in two runs

FP8 chapters (08) pass within 1.5x the e4m3 input-quantisation floor (+3e-3), at most 6e-2 on the
generated N(0, 1) inputs; the harness reads the floor from common/reference.py, and the output test
recomputes it here.
"""
import csv
import math
import re

import numpy as np
import pytest

from helpers import (BACKWARD_CHAPTERS, BACKWARD_OUTPUT_SHAPES, BACKWARD_TOL, CHAPTERS, FP8,
                     FP8_FLOOR_FACTOR, LSE_TOL, REL_L2_TOL, STEP_BUILDS, WORKSPACE, attention64, attention64_grads,
                     fp8_floor_attention, shape_args, torch_fp16_error, torch_grad_errors)
from reference import FP8_Q_ROWS
from results import HARNESS_FIELDS

pytestmark = pytest.mark.gpu

DIMS = (64, 128)
MASKS = (False, True)
# 2048: many whole tiles of every size but 08's 192; 1000: many, the last one ragged
SEQLENS = (1, 17, 64, 127, 128, 1000, 2048)
# 384 = 2 x 192: 08's key tiles at D=128 with none masked, 385 one key past. The other chapters'
# tiles (32 to 128 rows) take the same paths at 128 and 127, 2048 and 1000.
TILE_192_SEQLENS = (384, 385)
ONE_HEAD_N = 17  # (1, 1) runs at this N alone: one head's indexing; at every other N (2, 3) takes its paths, and more
SINGLE_KERNEL_NO_WORKSPACE = {4, 5, 6, 7, 9, 10, 11}  # fused from 04 on: one launch, no N^2 scratch
FP8_KERNELS = 2                               # 08: quantize, attention
N2_WORKSPACE = {1, 2, 3}                      # S (and P) in device memory: B*H*N*N floats
FP16_TC = {6, 7, 9, 10, 11}                     # fp16 tensor-core chapters (and 08's fp16 steps)
OUTPUT_SHAPES = [(2, 3, 200, 64, True), (1, 2, 129, 128, False)]  # (B, H, N, D, causal)
TORCH_RULE_SHAPES = OUTPUT_SHAPES + [(1, 4, 1024, 128, True)]
RUN_TIMEOUT_S = 600
GRADS = ("dq", "dk", "dv")


def number(chapter):
    return int(chapter[:2])


def masked(causal):
    return " causal" if causal else ""


def batch_heads(n):
    """The (B, H) pairs of the matrix at sequence length n, heavier first."""
    return [(2, 3)] + ([(1, 1)] if n == ONE_HEAD_N else [])


def shape_group(b, h, n, d):
    """The xdist group of the runs that share one shape's cached inputs and reference."""
    return pytest.mark.xdist_group(f"shape_b{b}_h{h}_n{n}_d{d}")


# --- running a binary and reading its row ------------------------------------------------------------
def run_csv(repo, chapter, args, build=None):
    """Run the chapter's binary (or another build of it) with --csv: (CompletedProcess, row dict or None; its
    impl the chapter's, <chapter>.deterministic with --deterministic). Exit 77 skips the test with the
    binary's line."""
    binary = repo.require_binary(build or chapter)
    proc = repo.run([binary, *args, "--warmup", "0", "--iters", "1", "--csv"], timeout=RUN_TIMEOUT_S)
    if proc.returncode == 77:
        pytest.skip(proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else f"{chapter}: exit 77")
    impl = chapter + (".deterministic" if "--deterministic" in args else "")  # the row names the mode
    row = None
    for line in proc.stdout.splitlines():
        if line.startswith(impl + ","):
            values = next(csv.reader([line]))
            if len(values) == len(HARNESS_FIELDS):
                row = dict(zip(HARNESS_FIELDS, values))
    return proc, row


def describe(proc, row):
    if row:
        text = (f"exit {proc.returncode}, status {row['status']}, rel_l2 {row['rel_l2']}, "
                f"lse_err {row['lse_err']}, max_abs {row['max_abs']}")
    else:
        text = f"exit {proc.returncode}, no CSV row of {len(HARNESS_FIELDS)} fields on stdout {proc.stdout.strip()[-300:]!r}"
    err = proc.stderr.strip()
    return text + (f"\nstderr: {err[-1500:]}" if err else "")


def check_passed(proc, row, shown, b, h, n, d, causal):
    """Exit 0, PASS, and the row reports the shape that was run."""
    assert proc.returncode == 0 and row and row["status"] == "PASS", f"{shown}: expected PASS, got {describe(proc, row)}"
    echoed = tuple(int(row[k]) for k in ("batch", "heads", "seqlen", "headdim", "causal"))
    assert echoed == (b, h, n, d, int(causal)), f"{shown}: the CSV row reports shape {echoed}, expected {(b, h, n, d, int(causal))}"


def check_row(chapter, proc, row, shown, b, h, n, d, causal):
    """PASS, and the kernels, workspace and device memory the chapter promises."""
    check_passed(proc, row, shown, b, h, n, d, causal)
    if number(chapter) in SINGLE_KERNEL_NO_WORKSPACE:
        assert row["kernels"] == "1", f"{shown}: {row['kernels']} kernels per forward, expected 1 (fused from 04 on)"
        assert row["workspace_bytes"] == "0", f"{shown}: workspace {row['workspace_bytes']} bytes, expected 0"
    if number(chapter) in N2_WORKSPACE:
        want = b * h * n * n * 4
        assert row["workspace_bytes"] == str(want), f"{shown}: workspace {row['workspace_bytes']} bytes, expected B*H*N*N*4 = {want}"
    # Device memory: exactly the buffers (Q, K, V, O fp16, LSE fp32, the workspace).
    buffers = 4 * b * h * n * d * 2 + b * h * n * 4 + int(row["workspace_bytes"])
    assert row["device_bytes"] == str(buffers), f"{shown}: device_bytes {row['device_bytes']}, expected the {buffers} bytes of its buffers"
    if number(chapter) in FP8:
        assert row["dtype"] == "fp8", f"{shown}: dtype {row['dtype']!r}, expected 'fp8'"
        assert row["kernels"] == str(FP8_KERNELS), f"{shown}: {row['kernels']} kernels per forward, expected {FP8_KERNELS}"
        want = WORKSPACE[number(chapter)](b, h, n, d)
        assert row["workspace_bytes"] == str(want), f"{shown}: workspace {row['workspace_bytes']} bytes, expected {want}"
        assert float(row["rel_l2_floor"] or "nan") > 0, f"{shown}: no e4m3 floor in the CSV row ({row['rel_l2_floor']!r})"
        for part in ("prepare_ms", "attend_ms"):
            assert float(row[part] or "nan") > 0, f"{shown}: {part} is {row[part]!r}, expected a time"


# --- inputs made once per worker -------------------------------------------------------------------------
def reference_inputs(repo, d, qk_std="4.5", least=50, grad=False):
    """B=1 H=2 N=300 inputs from `reference.py inputs --qk-std` with logits of at least `least`
    (grad: dO too)."""
    def make():
        out = repo.tmpdir() / f"qk_std_{qk_std}_d{d}{'_grad' if grad else ''}"
        proc = repo.run([repo.python, repo.root / "common" / "reference.py", "inputs", "--qk-std", qk_std,
                         *shape_args(1, 2, 300, d, False), "--seed", "7", "--out", out] + (["--grad"] if grad else []))
        assert proc.returncode == 0, f"reference.py inputs --qk-std {qk_std} failed: {proc.stderr.strip()}"
        q, k = (np.load(out / f"{x}.npy").astype(np.float64) for x in "qk")
        biggest = np.abs(np.einsum("bhid,bhjd->bhij", q, k)).max() / math.sqrt(d)
        assert biggest >= least, f"qk_std {qk_std} inputs reach |logit| {biggest:.1f} only: expected >= {least}"
        return out
    return repo.once(("large_logit_inputs", d, qk_std, grad), make)


def random_inputs(repo, b, h, n, d, grad=False):
    """A folder of N(0, 1) fp16 q, k, v (and with grad, do) .npy files of shape [b, h, n, d]."""
    def make():
        folder = repo.tmpdir()
        rng = np.random.default_rng((4048 if grad else 2024) + n + d)
        for name in ("q", "k", "v", "do") if grad else ("q", "k", "v"):
            np.save(folder / f"{name}.npy", rng.standard_normal((b, h, n, d)).astype(np.float16))
        return folder
    return repo.once(("random_inputs", b, h, n, d, grad), make)


# --- the matrix ------------------------------------------------------------------------------------------
def matrix_params():
    for n in sorted(SEQLENS + TILE_192_SEQLENS, reverse=True):  # the heaviest groups first
        for b, h in batch_heads(n):
            for d in DIMS:
                for causal in MASKS:
                    for chapter in CHAPTERS:
                        if n in SEQLENS or number(chapter) in FP8:
                            yield pytest.param(chapter, b, h, n, d, causal, marks=shape_group(b, h, n, d),
                                               id=f"{chapter} D={d}{masked(causal)} N={n} B={b} H={h}")


@pytest.mark.parametrize("chapter,b,h,n,d,causal", list(matrix_params()))
def test_matrix(repo, chapter, b, h, n, d, causal):
    proc, row = run_csv(repo, chapter, shape_args(b, h, n, d, causal))
    check_row(chapter, proc, row, f"{chapter} B={b} H={h} N={n} D={d}{masked(causal)}", b, h, n, d, causal)


# --- large logits, outliers, one-hot logits ------------------------------------------------------------
@pytest.mark.parametrize("chapter", CHAPTERS)
@pytest.mark.parametrize("causal", MASKS, ids=["", "causal"])
@pytest.mark.parametrize("d", DIMS, ids=lambda d: f"D={d}")
def test_large_logits(repo, chapter, d, causal):
    folder = reference_inputs(repo, d)
    proc, row = run_csv(repo, chapter, ["--input", str(folder)] + (["--causal"] if causal else []))
    shown = f"{chapter} --input <qk-std 4.5, B=1 H=2 N=300 D={d}>{masked(causal)}"
    check_row(chapter, proc, row, shown, 1, 2, 300, d, causal)


FP8_CHAPTERS = [c for c in CHAPTERS if number(c) in FP8]


@pytest.mark.parametrize("chapter", FP8_CHAPTERS)
@pytest.mark.parametrize("causal", MASKS, ids=["", "causal"])
def test_huge_logits(repo, chapter, causal):
    folder = reference_inputs(repo, 128, qk_std="20", least=1500)
    proc, row = run_csv(repo, chapter, ["--input", str(folder)] + (["--causal"] if causal else []))
    check_row(chapter, proc, row, f"{chapter} --input <qk-std 20, B=1 H=2 N=300 D=128>{masked(causal)}",
              1, 2, 300, 128, causal)


OUTLIER_SHAPE = (1, 2, 1000, 128)  # B, H, N, D


def outlier_inputs(repo):
    def make():
        out = repo.tmpdir() / "outliers"
        proc = repo.run([repo.python, repo.root / "common" / "reference.py", "inputs", "--outliers", "0.001",
                         *shape_args(*OUTLIER_SHAPE, False), "--seed", "11", "--out", out])
        assert proc.returncode == 0, f"reference.py inputs --outliers failed: {proc.stderr.strip()}"
        q = np.load(out / "q.npy")
        assert np.abs(q).max() >= 10 and (np.abs(q) >= 10).mean() < 0.01, "expected a few |q| >= 10"
        return out
    return repo.once("outlier_inputs", make)


@pytest.mark.xdist_group("outliers")
@pytest.mark.parametrize("chapter", CHAPTERS)
@pytest.mark.parametrize("causal", MASKS, ids=["", "causal"])
def test_outliers(repo, chapter, causal):
    proc, row = run_csv(repo, chapter, ["--input", str(outlier_inputs(repo))] + (["--causal"] if causal else []))
    shown = f"{chapter} --input <0.1% outliers in Q, K, B=1 H=2 N=1000 D=128>{masked(causal)}"
    check_row(chapter, proc, row, shown, *OUTLIER_SHAPE, causal)


ONE_HOT_SHAPE = (1, 2, 300, 128)  # B, H, N, D
ONE_HOT_SIZE = 1000.0  # q = k = ONE_HOT_SIZE e_(i mod D): matching logits 1000^2 / sqrt(128) ~ 88388


def one_hot_inputs(repo):
    def make():
        b, h, n, d = ONE_HOT_SHAPE
        folder = repo.tmpdir()
        qk = np.zeros((b, h, n, d), np.float16)
        qk[..., np.arange(n), np.arange(n) % d] = ONE_HOT_SIZE
        np.save(folder / "q.npy", qk)
        np.save(folder / "k.npy", qk)
        np.save(folder / "v.npy", np.random.default_rng(5).standard_normal((b, h, n, d)).astype(np.float16))
        return folder
    return repo.once("one_hot_inputs", make)


@pytest.mark.parametrize("chapter", FP8_CHAPTERS)
@pytest.mark.parametrize("causal", MASKS, ids=["", "causal"])
def test_one_hot_logits(repo, chapter, causal):
    """Row i's logits are ~1.3e5 (log2 units) at keys j = i mod 128 and 0 elsewhere: softmax picks
    those keys evenly, and O is the mean of their v. Q and K quantise exactly (each row's one value
    becomes 16), so O's floor is V's e4m3 rounding. The LSE carries the scale as the kernel rounds it
    to fp16 for S in fp16, 2^-11 relative; it must be within 2^-10."""
    b, h, n, d = ONE_HOT_SHAPE
    folder, out = one_hot_inputs(repo), repo.tmpdir()
    proc, _ = run_csv(repo, chapter, ["--input", str(folder), "--output", str(out), "--no-check"] +
                      (["--causal"] if causal else []))
    shown = f"{chapter} --input <one-hot Q = K, logits ~1.3e5 log2, B={b} H={h} N={n} D={d}>{masked(causal)}"
    assert proc.returncode == 0, f"{shown}: exit {proc.returncode}: {proc.stderr.strip()[-300:]}"
    o, lse = np.load(out / "o.npy").astype(np.float64), np.load(out / "lse.npy").astype(np.float64)
    q, k, v = (np.load(folder / f"{x}.npy") for x in "qkv")
    want_o, want_lse = attention64(q, k, v, causal, 1 / math.sqrt(d))
    floor_o, _ = fp8_floor_attention(q, k, v, causal, d)
    floor = float(np.linalg.norm(floor_o - want_o) / np.linalg.norm(want_o))
    rel = float(np.linalg.norm(o - want_o) / np.linalg.norm(want_o))
    tol = FP8_FLOOR_FACTOR * floor + REL_L2_TOL[7]
    assert np.isfinite(o).all() and rel <= tol, f"{shown}: O relative L2 error {rel:.3e}, expected <= {tol:.2e}"
    lse_rel = float(np.abs(lse / want_lse - 1).max())
    assert lse_rel <= 2.0 ** -10, f"{shown}: LSE relative error {lse_rel:.2e}, expected <= {2.0 ** -10:.2e}"


# --- --output against float64 computed here ----------------------------------------------------------
@pytest.mark.parametrize("chapter", CHAPTERS)
@pytest.mark.parametrize("b,h,n,d,causal", [pytest.param(*s, marks=pytest.mark.xdist_group(f"output_{s}"),
                                                         id=f"B={s[0]} H={s[1]} N={s[2]} D={s[3]}{masked(s[4])}")
                                            for s in OUTPUT_SHAPES])
def test_output_files_match_float64(repo, chapter, b, h, n, d, causal):
    folder, out = random_inputs(repo, b, h, n, d), repo.tmpdir()
    proc, row = run_csv(repo, chapter, ["--input", str(folder), "--output", str(out)] + (["--causal"] if causal else []))
    shown = f"{chapter} --output, B={b} H={h} N={n} D={d}{masked(causal)}"
    check_row(chapter, proc, row, shown, b, h, n, d, causal)
    for name in ("o.npy", "lse.npy"):
        assert (out / name).is_file(), f"{shown}: {name} not written"
    o, lse = np.load(out / "o.npy"), np.load(out / "lse.npy")
    assert o.dtype == np.float16 and o.shape == (b, h, n, d), f"{shown}: o.npy is {o.dtype} {o.shape}, expected float16 {(b, h, n, d)}"
    assert lse.dtype == np.float32 and lse.shape == (b, h, n), f"{shown}: lse.npy is {lse.dtype} {lse.shape}, expected float32 {(b, h, n)}"
    bad_o, bad_lse = np.count_nonzero(~np.isfinite(o)), np.count_nonzero(~np.isfinite(lse))
    assert not bad_o and not bad_lse, f"{shown}: {bad_o} non-finite O and {bad_lse} non-finite LSE elements"
    assert number(chapter) in REL_L2_TOL or number(chapter) in FP8, f"{chapter}: no tolerance fixed in helpers.REL_L2_TOL"
    q, k, v = (np.load(folder / f"{x}.npy") for x in "qkv")
    want_o, want_lse = attention64(q, k, v, causal, 1 / math.sqrt(d))
    rel = float(np.linalg.norm(o.astype(np.float64) - want_o) / np.linalg.norm(want_o))
    lse_err = float(np.abs(lse.astype(np.float64) - want_lse).max())
    tol, lse_tol = REL_L2_TOL.get(number(chapter)), LSE_TOL
    if number(chapter) in FP8:  # the floor: exact attention on the e4m3-quantised inputs
        floor_o, floor_lse = fp8_floor_attention(q, k, v, causal, d)
        tol = FP8_FLOOR_FACTOR * float(np.linalg.norm(floor_o - want_o) / np.linalg.norm(want_o)) + REL_L2_TOL[7]
        lse_tol = FP8_FLOOR_FACTOR * float(np.abs(floor_lse - want_lse).max()) + LSE_TOL
    assert rel <= tol, f"{shown}: o.npy relative L2 error {rel:.3e} against float64 here, expected <= {tol:.2e}"
    assert lse_err <= lse_tol, f"{shown}: lse.npy max abs error {lse_err:.3e}, expected <= {lse_tol:.2e}"


# --- no worse than twice PyTorch's own fp16 error -------------------------------------------------------
def torch_rule_params():
    builds = [(c, None) for c in CHAPTERS if number(c) in FP16_TC]
    builds += [(step, build) for step, build, dtype in STEP_BUILDS if dtype == "fp16"]
    for b, h, n, d, causal in TORCH_RULE_SHAPES:
        for name, build in builds:
            yield pytest.param(name, build, b, h, n, d, causal, marks=pytest.mark.xdist_group(f"output_{(b, h, n, d, causal)}"),
                               id=f"{name} B={b} H={h} N={n} D={d}{masked(causal)}")


@pytest.mark.parametrize("name,build,b,h,n,d,causal", list(torch_rule_params()))
def test_error_at_most_twice_pytorch_fp16(repo, name, build, b, h, n, d, causal):
    """FlashAttention's own test rule: the max abs error of O against float64 is at most twice that of
    PyTorch's fp16 attention (flash backend) on the same inputs."""
    folder, out = random_inputs(repo, b, h, n, d), repo.tmpdir()
    q, k, v = (np.load(folder / f"{x}.npy") for x in "qkv")
    want_o, _ = attention64(q, k, v, causal, 1 / math.sqrt(d))
    torch_error = repo.once(("torch_fp16_error", b, h, n, d, causal), lambda: torch_fp16_error(q, k, v, causal, want_o))
    if torch_error is None:
        pytest.skip("PyTorch with CUDA not importable: its fp16 error is not measured here")
    proc, _ = run_csv(repo, name, ["--input", str(folder), "--output", str(out), "--no-check"] +
                      (["--causal"] if causal else []), build=build)
    shown = f"{name} B={b} H={h} N={n} D={d}{masked(causal)}"
    assert proc.returncode == 0, f"{shown}: exit {proc.returncode}: {proc.stderr.strip()[-300:]}"
    error = float(np.abs(np.load(out / "o.npy").astype(np.float64) - want_o).max())
    assert error <= 2 * torch_error, (f"{shown}: max abs error of O {error:.3e}, more than twice PyTorch's fp16 "
                                      f"attention's {torch_error:.3e} on the same inputs")


# --- scratch that cannot fit ---------------------------------------------------------------------------
@pytest.mark.parametrize("chapter", [c for c in CHAPTERS if number(c) in N2_WORKSPACE])
def test_scratch_that_cannot_fit_is_refused(repo, chapter):
    b, h, n, d = 1, 64, 65536, 64  # B*H*N*N*4 = 1 TiB of scratch
    args = shape_args(b, h, n, d, False) + ["--no-check", "--warmup", "0", "--iters", "1"]
    proc = repo.run([repo.require_binary(chapter), *args], env={"FA_CACHE": repo.tmpdir()}, timeout=120)
    if proc.returncode == 77:
        pytest.skip(proc.stdout.strip())
    shown, message = f"{chapter} {' '.join(args)} (1 TiB of scratch)", proc.stderr.strip()
    assert proc.returncode == 2, f"{shown}: expected exit 2 (will not fit), got {proc.returncode}: {message!r}"
    assert re.search(r"memory", message, re.I) and re.search(r"(lower|reduce|smaller)", message, re.I), (
        f"{shown}: the message should say the memory does not fit and what to lower: {message!r}")


# --- the steps (BUILD/08_fp8.step1 ... step5, BUILD/09_backward.step1 ... step7; the last step is the ----
# chapter, in the matrix above); 09's steps differ in their backward alone, so they run with --backward
STEP_KEY_TILE = {"08.4": {64: 128, 128: 128}, "08.5": {64: 128, 128: 192}}  # the FP8 steps' key tiles
STEP_SEQLENS = (1, 127, 385, 1000)  # one key, ragged tiles, past 2 x 192 keys (08's steps alone), many tiles


def check_step_row(step, dtype, row, shown, b, h, n, d):
    """What a step's row must say beyond PASS: its dtype, its kernels, its workspace (fp16 steps read
    the inputs: one kernel, none; the FP8 step quantises first: two, the e4m3 copies)."""
    assert row["dtype"] == dtype, f"{shown}: dtype {row['dtype']!r}, expected {dtype!r}"
    if dtype == "fp8":
        kv_rows = STEP_KEY_TILE[step][d]
        descales = (-(-b * h * (-(-n // FP8_Q_ROWS) + 2 * -(-n // kv_rows)) * 4 // 256)) * 256
        want = (FP8_KERNELS, descales + 2 * b * h * n * d + b * h * d * (-(-n // 16) * 16))
        assert float(row["rel_l2_floor"] or "nan") > 0, f"{shown}: no e4m3 floor in the CSV row"
    else:
        want = (1, 0)
    got = (int(row["kernels"]), int(row["workspace_bytes"]))
    assert got == want, f"{shown}: {got[0]} kernels and {got[1]} bytes of workspace, expected {want[0]} and {want[1]}"
    buffers = 4 * b * h * n * d * 2 + b * h * n * 4 + want[1]
    assert row["device_bytes"] == str(buffers), f"{shown}: device_bytes {row['device_bytes']}, expected {buffers}"


def step_params():
    for step, build, dtype in STEP_BUILDS:
        for d in DIMS:
            for causal in MASKS:
                for n in [n for n in STEP_SEQLENS if n != 385 or step.startswith("08")] + [None]:  # None: large logits
                    group = shape_group(2, 3, n, d) if n else pytest.mark.xdist_group(f"large_logits_{d}")
                    yield pytest.param(step, build, dtype, n, d, causal, marks=group,
                                       id=f"{step} D={d}{masked(causal)} " + (f"N={n} B=2 H=3" if n else "qk-std 4.5"))


@pytest.mark.parametrize("step,build,dtype,n,d,causal", list(step_params()))
def test_step(repo, step, build, dtype, n, d, causal):
    """One step at a shape (or, n None, on the large-logit inputs): PASS under its precision's rule (08), or
    its backward's gradients within the bound (09)."""
    backward = build.split(".")[0] in BACKWARD_CHAPTERS
    if n is None:
        b, h, n = 1, 2, 300
        args = ["--input", str(reference_inputs(repo, d, grad=backward))] + (["--causal"] if causal else [])
    else:
        b, h = 2, 3
        args = shape_args(b, h, n, d, causal)
    proc, row = run_csv(repo, step, args + (["--backward"] if backward else []), build=build)
    shown = f"{step} ({build}){' --backward' if backward else ''} B={b} H={h} N={n} D={d}{masked(causal)}"
    if backward:
        check_backward_row(proc, row, shown, b, h, n, d, causal)
    else:
        check_passed(proc, row, shown, b, h, n, d, causal)
        check_step_row(step, dtype, row, shown, b, h, n, d)


# --- the backward pass (--backward) -------------------------------------------------------------------------
BACKWARD_SEQLENS = (1, 17, 64, 127, 128, 1000, 2048)
BACKWARD_LEAN_SEQLENS = (1, 127, 1000)
# (B, H, N) with more blocks than a GPU holds at once: in the deterministic mode a head's blocks may
# then take several key tiles each, in turn (128 heads of 4 or 8 key tiles).
BACKWARD_MANY_HEADS = (8, 16, 1000)


def check_backward_row(proc, row, shown, b, h, n, d, causal):
    check_passed(proc, row, shown, b, h, n, d, causal)
    errors = [float(row[f"{g}_rel_l2"] or "nan") for g in GRADS]
    assert all(e <= BACKWARD_TOL for e in errors), f"{shown}: dQ, dK, dV rel L2 {errors}, expected <= {BACKWARD_TOL}"
    # Device memory: Q, K, V, O, dO, dQ, dK, dV fp16, LSE fp32 and the backward's workspace.
    buffers = 8 * b * h * n * d * 2 + b * h * n * 4 + int(row["workspace_bytes"])
    assert row["device_bytes"] == str(buffers), f"{shown}: device_bytes {row['device_bytes']}, expected {buffers}"


def backward_params():
    for chapter in BACKWARD_CHAPTERS:
        for n in sorted(BACKWARD_SEQLENS, reverse=True):
            for b, h in batch_heads(n):
                for d in DIMS:
                    for causal in MASKS:
                        yield pytest.param(chapter, False, b, h, n, d, causal, marks=shape_group(b, h, n, d),
                                           id=f"{chapter} D={d}{masked(causal)} N={n} B={b} H={h}")
        for b, h, n in [(2, 3, n) for n in BACKWARD_LEAN_SEQLENS] + [BACKWARD_MANY_HEADS]:
            for d in DIMS:
                for causal in MASKS:
                    # the many heads' references take a minute to make: their group is sent first (conftest.py)
                    group = pytest.mark.xdist_group(f"many_heads_d{d}") if (b, h, n) == BACKWARD_MANY_HEADS \
                        else shape_group(b, h, n, d)
                    yield pytest.param(chapter, True, b, h, n, d, causal, marks=group,
                                       id=f"{chapter} --deterministic D={d}{masked(causal)} N={n} B={b} H={h}")


def backward_flags(deterministic):
    return ["--backward"] + (["--deterministic"] if deterministic else [])


@pytest.mark.parametrize("chapter,deterministic,b,h,n,d,causal", list(backward_params()))
def test_backward(repo, chapter, deterministic, b, h, n, d, causal):
    flags = backward_flags(deterministic)
    proc, row = run_csv(repo, chapter, shape_args(b, h, n, d, causal) + flags)
    check_backward_row(proc, row, f"{chapter} {' '.join(flags)} B={b} H={h} N={n} D={d}{masked(causal)}",
                       b, h, n, d, causal)


@pytest.mark.parametrize("chapter", BACKWARD_CHAPTERS)
@pytest.mark.parametrize("causal", MASKS, ids=["", "causal"])
@pytest.mark.parametrize("d", DIMS, ids=lambda d: f"D={d}")
def test_backward_large_logits(repo, chapter, d, causal):
    folder = reference_inputs(repo, d, grad=True)
    proc, row = run_csv(repo, chapter, ["--input", str(folder), "--backward"] + (["--causal"] if causal else []))
    check_backward_row(proc, row, f"{chapter} --backward --input <qk-std 4.5, B=1 H=2 N=300 D={d}>{masked(causal)}",
                       1, 2, 300, d, causal)


def backward_output(repo, chapter, folder, out, causal, deterministic=False):
    flags = backward_flags(deterministic)
    proc, row = run_csv(repo, chapter, ["--input", str(folder), "--output", str(out), *flags] +
                        (["--causal"] if causal else []))
    grads = {}
    if proc.returncode == 0:
        for g in GRADS:
            assert (out / f"{g}.npy").is_file(), f"{chapter} {' '.join(flags)} --output: {g}.npy not written"
            grads[g] = np.load(out / f"{g}.npy")
    return proc, row, grads


@pytest.mark.parametrize("chapter", BACKWARD_CHAPTERS)
@pytest.mark.parametrize("b,h,n,d,causal", [pytest.param(*s, marks=pytest.mark.xdist_group(f"grad_output_{s}"),
                                                         id=f"B={s[0]} H={s[1]} N={s[2]} D={s[3]}{masked(s[4])}")
                                            for s in BACKWARD_OUTPUT_SHAPES])
def test_backward_output_files(repo, chapter, b, h, n, d, causal):
    """--output's dQ, dK, dV against float64 computed here, every row; and FlashAttention's own rule on
    gradients: max abs error at most twice that of PyTorch's fp16 backward (where PyTorch is here)."""
    folder, out = random_inputs(repo, b, h, n, d, grad=True), repo.tmpdir()
    shown = f"{chapter} --backward --output, B={b} H={h} N={n} D={d}{masked(causal)}"
    proc, row, grads = backward_output(repo, chapter, folder, out, causal)
    check_backward_row(proc, row, shown, b, h, n, d, causal)
    q, k, v, do = (np.load(folder / f"{x}.npy") for x in ("q", "k", "v", "do"))
    want = attention64_grads(q, k, v, do, causal, 1 / math.sqrt(d))
    errors = []
    for g, w in zip(GRADS, want):
        x = grads[g]
        assert x.dtype == np.float16 and x.shape == (b, h, n, d), f"{shown}: {g}.npy is {x.dtype} {x.shape}"
        x = x.astype(np.float64)
        assert np.isfinite(x).all(), f"{shown}: {np.count_nonzero(~np.isfinite(x))} non-finite {g} elements"
        rel = float(np.linalg.norm(x - w) / np.linalg.norm(w))
        assert rel <= BACKWARD_TOL, f"{shown}: {g}.npy relative L2 error {rel:.3e} over every row, expected <= {BACKWARD_TOL}"
        errors.append(float(np.abs(x - w).max()))
    torch_errors = repo.once(("torch_grad_errors", b, h, n, d, causal), lambda: torch_grad_errors(q, k, v, do, causal, want))
    if torch_errors is not None:
        for g, mine, theirs in zip(GRADS, errors, torch_errors):
            assert mine <= 2 * theirs, (f"{shown}: max abs error of {g} {mine:.3e}, more than twice PyTorch's fp16 "
                                        f"backward's {theirs:.3e} on the same inputs")


# (deterministic, B, H, N, D, causal); the last: more heads than the GPU's blocks, key tiles in turn
REPEAT_SHAPES = [(False, 1, 4, 1024, 128, True), (True, 1, 4, 1024, 128, True), (True, 4, 16, 1024, 128, True)]


@pytest.mark.parametrize("chapter", BACKWARD_CHAPTERS)
@pytest.mark.parametrize("deterministic,b,h,n,d,causal", [
    pytest.param(*s, marks=pytest.mark.xdist_group(f"grad_output_{s[1:]}"),
                 id=f"{'--deterministic' if s[0] else 'default'} B={s[1]} H={s[2]} N={s[3]} D={s[4]}{masked(s[5])}")
    for s in REPEAT_SHAPES])
def test_backward_repeats_bitwise(repo, chapter, deterministic, b, h, n, d, causal):
    """Two runs on the same inputs: dK and dV bitwise the same (each key block sums its own); dQ too
    in the deterministic mode (--deterministic: summed in a fixed order)."""
    folder = random_inputs(repo, b, h, n, d, grad=True)
    shown = f"{chapter} {' '.join(backward_flags(deterministic))} twice, B={b} H={h} N={n} D={d}{masked(causal)}"
    runs = []
    for _ in range(2):
        proc, row, grads = backward_output(repo, chapter, folder, repo.tmpdir(), causal, deterministic)
        check_backward_row(proc, row, shown, b, h, n, d, causal)
        runs.append(grads)
    same = {g: bool(np.array_equal(runs[0][g].view(np.uint16), runs[1][g].view(np.uint16))) for g in GRADS}
    must = GRADS if deterministic else ("dk", "dv")
    differ = [g for g in must if not same[g]]
    assert not differ, f"{shown}: {', '.join(differ)} differ between the two runs, expected bitwise the same"
