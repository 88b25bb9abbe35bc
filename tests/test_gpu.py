"""The GPU matrix: every chapter, on shapes that stress the edges, against the reference.

Runs the native build (BUILD/NN_name) and the repo's input/reference cache (.cache, or
$FA_CACHE), so that references are made once and shared by every chapter. Cases of one
shape form one group, run in order by one worker: the first run makes that shape's cache
folder, the others reuse it, and no two workers ever make the same folder at once.

  matrix        chapter x D {64,128} x causal x N {1,17,64,127,128,1000,2048} (08 also 384 and
                385: its 192-key tiles) at (B,H) = (2,3), and (1,1) where N <= 17: exit 0 and
                status PASS
  large_logits  chapter x D x causal on `reference.py inputs --qk-std 4.5` (logits ~100)
  huge_logits   FP8 chapters x causal, D = 128, on `--qk-std 20` (logits ~2000): past what one fp16
                HFMA2 holds, where 08's softmax on fp16 scores recentres them first
  one_hot       FP8 chapters x causal, D = 128: q = k = 1000 e_(i mod 128), logits ~1.3e5 (log2)
                at matching keys and 0 elsewhere: O must be the mean of those keys' v (through
                --output, checked here; the LSE within fp16's rounding of the scale)
  outliers      chapter x causal on `reference.py inputs --outliers 0.001` (0.1% of Q and K
                entries +-U(10, 100)): the case FP8's per-(b, h) scales must survive
  output        chapter: --output's o.npy/lse.npy against float64 computed here
  step          08's step builds (BUILD/08_fp8.step1 ... step4): a lean matrix (both D, masks,
                ragged N, large logits) under each step's precision
  twice_torch   fp16 tensor-core chapters (06, 07, 08.1-08.3): max abs error of O against float64
                at most twice that of PyTorch's fp16 flash attention on the same inputs (skipped
                without PyTorch)

FP8 chapters (08) pass within 1.5x the e4m3 input-quantisation floor (+3e-3), capped at 6e-2
on the generated N(0, 1) inputs; the harness reads the floor from common/reference.py, and
the output case recomputes it here.
  backward      chapters with a backward pass (09) x D x causal x N x (B,H), --backward: each of
                dQ, dK, dV within the harness's rel L2 rule; the same lean matrix on the
                DETERMINISTIC_DQ build; large logits; --output's gradients against float64
                computed here and at most twice PyTorch's fp16 backward's max abs error; dK, dV
                (and with DETERMINISTIC_DQ, dQ too) bitwise the same in two runs
  scratch       chapters with B*H*N^2 scratch: a shape whose scratch cannot fit is refused (exit 2)
"""
import csv
import math
import os
import re
import unittest

import numpy as np

from reference import FP8_KV_ROWS, FP8_Q_ROWS, FP8_QK_RANGE, quantize_e4m3
from results import HARNESS_FIELDS
from test_cpu_backward_cli import has_backward
from test_cpu_cli import WORKSPACE

SUITE = "gpu"
# Cases at once: each is a short binary run plus its check in NumPy (CPU work), so as many as the
# machine has cores, and at least 8 (the GPU runs them side by side; a case waits on it little).
PARALLEL = max(8, os.cpu_count() or 1)

DIMS = (64, 128)
# 2048: many whole tiles of every size but 08's 192; 1000: many, the last one ragged
SEQLENS = (1, 17, 64, 127, 128, 1000, 2048)
# 384 = 2 x 192: 08's key tiles at D=128 with none masked, 385 one key past. The other chapters'
# tiles (32 to 128 rows) take the same paths at 128 and 127, 2048 and 1000; and each case is a
# process of its own, of which the H200 runs about five a second however many are started at once
# (docs/results/logs/common/process_cost_h200.txt).
TILE_192_SEQLENS = (384, 385)
BATCH_HEADS = ((1, 1), (2, 3))
ONE_HEAD_MAX_N = 17  # (1, 1) runs only up to this N: beyond it (2, 3) takes every path (1, 1) takes, and more


def matrix_seqlens(ctx, chapter):
    """The matrix's N for a chapter: SEQLENS, and TILE_192_SEQLENS for the FP8 chapter."""
    return SEQLENS + (TILE_192_SEQLENS if ctx.chapter_number(chapter) in FP8 else ())


def batch_heads(n):
    """The (B, H) pairs of the matrix at sequence length n, heavier first."""
    return tuple(bh for bh in reversed(BATCH_HEADS) if bh != (1, 1) or n <= ONE_HEAD_MAX_N)
# By chapter number: relative L2 error of O (fp32 math, fp16 tensor cores); FP8 below.
REL_L2_TOL = {1: 1e-3, 2: 1e-3, 3: 1e-3, 4: 1e-3, 5: 1e-3, 6: 3e-3, 7: 3e-3, 9: 3e-3}
LSE_TOL = 1e-3
FP8 = {8}                                  # tolerance: FP8_FLOOR_FACTOR x the e4m3 floor + slack
FP8_FLOOR_FACTOR = 1.5
SINGLE_KERNEL_NO_WORKSPACE = {4, 5, 6, 7, 9}  # fused from 04 on: one launch, no N^2 scratch
FP8_KERNELS = 2                            # 08: quantize, attention
N2_WORKSPACE = {1, 2, 3}                   # S (and P) in device memory: B*H*N*N floats
OUTPUT_SHAPES = [(2, 3, 200, 64, True), (1, 2, 129, 128, False)]  # (B, H, N, D, causal)
FIELDS = list(HARNESS_FIELDS)  # the binary's --csv columns
RUN_TIMEOUT_S = 600


def shape_args(b, h, n, d, causal):
    return ["--batch", str(b), "--heads", str(h), "--seqlen", str(n), "--headdim", str(d)] + \
        (["--causal"] if causal else [])


def run_csv(ctx, chapter, args, env=None, build_name=None):
    """Run the native binary (the chapter's, or another build of it, build_name) with --csv:
    (CompletedProcess, row dict or None). Exit 77 skips."""
    binary = ctx.require_binary(build_name or chapter, native=True)
    cmd = [binary, *args, "--warmup", "0", "--iters", "1", "--csv"]
    proc = ctx.run(cmd, env=env, timeout=RUN_TIMEOUT_S)
    if proc.returncode == 77:
        raise unittest.SkipTest(proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else f"{chapter}: exit 77")
    row = None
    for line in proc.stdout.splitlines():
        if line.startswith(chapter + ","):
            values = next(csv.reader([line]))
            if len(values) == len(FIELDS):
                row = dict(zip(FIELDS, values))
    return proc, row


def describe(proc, row):
    if row:
        text = (f"exit {proc.returncode}, status {row['status']}, rel_l2 {row['rel_l2']}, "
                f"lse_err {row['lse_err']}, max_abs {row['max_abs']}")
    else:
        text = f"exit {proc.returncode}, no CSV row of {len(FIELDS)} fields on stdout {proc.stdout.strip()[-300:]!r}"
    err = proc.stderr.strip()
    return text + (f"\nstderr: {err[-1500:]}" if err else "")


def check_shape_echoed(row, shown, b, h, n, d, causal):
    """The CSV row reports the shape that was run."""
    echoed = tuple(int(row[k]) for k in ("batch", "heads", "seqlen", "headdim", "causal"))
    assert echoed == (b, h, n, d, int(causal)), f"{shown}: the CSV row reports shape {echoed}, expected {(b, h, n, d, int(causal))}"


def check_row(ctx, chapter, proc, row, shown, b, h, n, d, causal):
    assert proc.returncode == 0 and row and row["status"] == "PASS", f"{shown}: expected PASS, got {describe(proc, row)}"
    check_shape_echoed(row, shown, b, h, n, d, causal)
    number = ctx.chapter_number(chapter)
    if number in SINGLE_KERNEL_NO_WORKSPACE:
        assert row["kernels"] == "1", f"{shown}: {row['kernels']} kernels per forward, expected 1 (fused from 04 on)"
        assert row["workspace_bytes"] == "0", f"{shown}: workspace {row['workspace_bytes']} bytes, expected 0"
    if number in N2_WORKSPACE:
        want = b * h * n * n * 4
        assert row["workspace_bytes"] == str(want), f"{shown}: workspace {row['workspace_bytes']} bytes, expected B*H*N*N*4 = {want}"
    # Device memory: exactly the buffers (Q, K, V, O fp16, LSE fp32, the workspace).
    buffers = 4 * b * h * n * d * 2 + b * h * n * 4 + int(row["workspace_bytes"])
    assert row["device_bytes"] == str(buffers), (
        f"{shown}: device_bytes {row['device_bytes']}, expected the {buffers} bytes of its buffers")
    if number in FP8:
        assert row["dtype"] == "fp8", f"{shown}: dtype {row['dtype']!r}, expected 'fp8'"
        assert row["kernels"] == str(FP8_KERNELS), f"{shown}: {row['kernels']} kernels per forward, expected {FP8_KERNELS}"
        want = WORKSPACE[number](b, h, n, d)
        assert row["workspace_bytes"] == str(want), f"{shown}: workspace {row['workspace_bytes']} bytes, expected {want}"
        floor = float(row["rel_l2_floor"] or "nan")
        assert floor > 0, f"{shown}: no e4m3 floor in the CSV row ({row['rel_l2_floor']!r})"
        for part in ("prepare_ms", "attend_ms"):
            assert float(row[part] or "nan") > 0, f"{shown}: {part} is {row[part]!r}, expected a time"
        return f"rel_l2 {row['rel_l2']} = {float(row['rel_l2']) / floor:.2f}x the floor {floor:.3e}"
    return f"rel_l2 {row['rel_l2']}"


def fp8_floor_attention(q, k, v, causal, d):
    """float64 O and LSE of exact attention on Q, K, V quantised as the FP8 chapter quantises them
    (scales per tile, Q and K to its range): the check's floor."""
    kv_rows, qk_range = FP8_KV_ROWS[d], FP8_QK_RANGE[d]
    quantized = (quantize_e4m3(x, rows, to) for x, rows, to in
                 ((q, FP8_Q_ROWS, qk_range), (k, kv_rows, qk_range), (v, kv_rows, 448.0)))
    return attention64(*quantized, causal, 1 / math.sqrt(d))


def scores64(q, k, causal, scale):
    """float64 S = Q K^T * scale, -inf above the diagonal when causal."""
    s = np.einsum("bhid,bhjd->bhij", q.astype(np.float64), k.astype(np.float64)) * scale
    if causal:
        n = s.shape[-1]
        s = np.where(np.triu(np.ones((n, n), bool), 1), -np.inf, s)
    return s


def attention64(q, k, v, causal, scale):
    """float64 O and LSE straight from the formula (shifted exp), independent of common/."""
    s = scores64(q, k, causal, scale)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    total = e.sum(-1, keepdims=True)
    return np.einsum("bhij,bhjd->bhid", e, v.astype(np.float64)) / total, (m + np.log(total))[..., 0]


# --- the matrix --------------------------------------------------------------------------------
def matrix_case(chapter, b, h, n, d, causal):
    def case(ctx):
        proc, row = run_csv(ctx, chapter, shape_args(b, h, n, d, causal))
        shown = f"{chapter} B={b} H={h} N={n} D={d}{' causal' if causal else ''}"
        return check_row(ctx, chapter, proc, row, shown, b, h, n, d, causal)
    return case


# --- large logits ------------------------------------------------------------------------------
def large_logit_inputs(ctx, d, qk_std="4.5", least=50, grad=False):
    """B=1 H=2 N=300 inputs with logits of at least `least`; grad: dO too (reference.py inputs --grad)."""
    def make():
        out = ctx.tmpdir() / f"qk_std_{qk_std}_d{d}{'_grad' if grad else ''}"
        proc = ctx.run([ctx.python, ctx.root / "common" / "reference.py", "inputs", "--qk-std", qk_std,
                        "--batch", "1", "--heads", "2", "--seqlen", "300", "--headdim", str(d), "--seed", "7",
                        "--out", out] + (["--grad"] if grad else []), timeout=300)
        assert proc.returncode == 0, f"reference.py inputs --qk-std {qk_std} failed: {proc.stderr.strip()}"
        q, k = (np.load(out / f"{x}.npy").astype(np.float64) for x in "qk")
        biggest = np.abs(np.einsum("bhid,bhjd->bhij", q, k)).max() / math.sqrt(d)
        assert biggest >= least, f"qk_std {qk_std} inputs reach |logit| {biggest:.1f} only: expected >= {least}"
        return out
    return ctx.once(("large_logit_inputs", d, qk_std, grad), make)


def large_logit_case(chapter, d, causal, qk_std="4.5", least=50):
    def case(ctx):
        folder = large_logit_inputs(ctx, d, qk_std, least)
        proc, row = run_csv(ctx, chapter, ["--input", str(folder)] + (["--causal"] if causal else []))
        shown = f"{chapter} --input <qk-std {qk_std}, B=1 H=2 N=300 D={d}>{' --causal' if causal else ''}"
        return check_row(ctx, chapter, proc, row, shown, 1, 2, 300, d, causal)
    return case


# --- outliers in Q and K -----------------------------------------------------------------------
OUTLIER_SHAPE = (1, 2, 1000, 128)  # B, H, N, D


def outlier_inputs(ctx):
    def make():
        b, h, n, d = OUTLIER_SHAPE
        out = ctx.tmpdir() / "outliers"
        proc = ctx.run([ctx.python, ctx.root / "common" / "reference.py", "inputs", "--outliers", "0.001",
                        "--batch", b, "--heads", h, "--seqlen", n, "--headdim", d, "--seed", "11", "--out", out],
                       timeout=300)
        assert proc.returncode == 0, f"reference.py inputs --outliers failed: {proc.stderr.strip()}"
        q = np.load(out / "q.npy")
        assert np.abs(q).max() >= 10 and (np.abs(q) >= 10).mean() < 0.01, "expected a few |q| >= 10"
        return out
    return ctx.once("outlier_inputs", make)


def outlier_case(chapter, causal):
    def case(ctx):
        folder = outlier_inputs(ctx)
        proc, row = run_csv(ctx, chapter, ["--input", str(folder)] + (["--causal"] if causal else []))
        shown = f"{chapter} --input <0.1% outliers in Q, K, B=1 H=2 N=1000 D=128>{' --causal' if causal else ''}"
        return check_row(ctx, chapter, proc, row, shown, *OUTLIER_SHAPE, causal)
    return case


# --- one-hot logits near 10^5 -----------------------------------------------------------------
ONE_HOT_SHAPE = (1, 2, 300, 128)  # B, H, N, D
ONE_HOT_SIZE = 1000.0  # q = k = ONE_HOT_SIZE e_(i mod D): matching logits 1000^2 / sqrt(128) ~ 88388


def one_hot_inputs(ctx):
    def make():
        b, h, n, d = ONE_HOT_SHAPE
        folder = ctx.tmpdir() / "one_hot"
        folder.mkdir()
        qk = np.zeros((b, h, n, d), np.float16)
        qk[..., np.arange(n), np.arange(n) % d] = ONE_HOT_SIZE
        np.save(folder / "q.npy", qk)
        np.save(folder / "k.npy", qk)
        np.save(folder / "v.npy", np.random.default_rng(5).standard_normal((b, h, n, d)).astype(np.float16))
        return folder
    return ctx.once(("one_hot_inputs",), make)


def one_hot_case(chapter, causal):
    """Row i's logits are ~1.3e5 (log2 units) at keys j = i mod 128 and 0 elsewhere: softmax
    picks those keys evenly, and O is the mean of their v. Q and K quantise exactly (each row's
    one value becomes 16), so O's floor is V's e4m3 rounding. The LSE carries the scale
    as the kernel rounds it to fp16 for S in fp16, 2^-11 relative; it must be within 2^-10."""
    def case(ctx):
        b, h, n, d = ONE_HOT_SHAPE
        folder, out = one_hot_inputs(ctx), ctx.tmpdir() / "one_hot_out"
        proc, _ = run_csv(ctx, chapter, ["--input", str(folder), "--output", str(out), "--no-check"] +
                          (["--causal"] if causal else []))
        shown = f"{chapter} --input <one-hot Q = K, logits ~1.3e5 log2, B={b} H={h} N={n} D={d}>" \
                f"{' --causal' if causal else ''}"
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
        return f"rel_l2 {rel:.2e} (floor {floor:.2e}), LSE relative error {lse_rel:.1e}"
    return case


# --- --output against float64 computed here ----------------------------------------------------
def output_inputs(ctx, b, h, n, d, grad=False):
    """A folder of N(0, 1) fp16 q, k, v (and with grad, do) .npy files of shape [b, h, n, d]."""
    def make():
        folder = ctx.tmpdir() / f"{'grad' if grad else 'out'}_inputs_b{b}_h{h}_n{n}_d{d}"
        folder.mkdir()
        rng = np.random.default_rng((4048 if grad else 2024) + n + d)
        for name in ("q", "k", "v", "do") if grad else ("q", "k", "v"):
            np.save(folder / f"{name}.npy", rng.standard_normal((b, h, n, d)).astype(np.float16))
        return folder
    return ctx.once(("output_inputs", b, h, n, d, grad), make)


def output_case(chapter, b, h, n, d, causal):
    def case(ctx):
        number = ctx.chapter_number(chapter)
        folder = output_inputs(ctx, b, h, n, d)
        out = ctx.tmpdir() / "out"
        proc, row = run_csv(ctx, chapter, ["--input", str(folder), "--output", str(out)] +
                            (["--causal"] if causal else []))
        shown = f"{chapter} --output, B={b} H={h} N={n} D={d}{' causal' if causal else ''}"
        check_row(ctx, chapter, proc, row, shown, b, h, n, d, causal)
        for name in ("o.npy", "lse.npy"):
            assert (out / name).is_file(), f"{shown}: {name} not written"
        o, lse = np.load(out / "o.npy"), np.load(out / "lse.npy")
        assert o.dtype == np.float16 and o.shape == (b, h, n, d), f"{shown}: o.npy is {o.dtype} {o.shape}, expected float16 {(b, h, n, d)}"
        assert lse.dtype == np.float32 and lse.shape == (b, h, n), f"{shown}: lse.npy is {lse.dtype} {lse.shape}, expected float32 {(b, h, n)}"
        bad_o, bad_lse = np.count_nonzero(~np.isfinite(o)), np.count_nonzero(~np.isfinite(lse))
        assert not bad_o and not bad_lse, f"{shown}: {bad_o} non-finite O and {bad_lse} non-finite LSE elements"
        if number not in REL_L2_TOL and number not in FP8:
            raise unittest.SkipTest(f"{chapter}: no tolerance fixed for chapter {number:02d} in test_gpu.REL_L2_TOL")
        q, k, v = (np.load(folder / f"{x}.npy") for x in "qkv")
        want_o, want_lse = attention64(q, k, v, causal, 1 / math.sqrt(d))
        rel = float(np.linalg.norm(o.astype(np.float64) - want_o) / np.linalg.norm(want_o))
        lse_err = float(np.abs(lse.astype(np.float64) - want_lse).max())
        tol, lse_tol = REL_L2_TOL.get(number), LSE_TOL
        if number in FP8:  # the floor: exact attention on the e4m3-quantised inputs
            floor_o, floor_lse = fp8_floor_attention(q, k, v, causal, d)
            floor = float(np.linalg.norm(floor_o - want_o) / np.linalg.norm(want_o))
            tol = FP8_FLOOR_FACTOR * floor + REL_L2_TOL[7]
            lse_tol = FP8_FLOOR_FACTOR * float(np.abs(floor_lse - want_lse).max()) + LSE_TOL
        assert rel <= tol, f"{shown}: o.npy relative L2 error {rel:.3e} against float64 here, expected <= {tol:.2e}"
        assert lse_err <= lse_tol, f"{shown}: lse.npy max abs error {lse_err:.3e}, expected <= {lse_tol:.2e}"
        return f"rel_l2 {rel:.2e} (tol {tol:.2e}), lse max abs {lse_err:.2e} (tol {lse_tol:.2e})"
    return case


# --- no worse than twice PyTorch's own fp16 error (fp16 tensor-core chapters) ----------------------
TORCH_RULE_SHAPES = [(2, 3, 200, 64, True), (1, 2, 129, 128, False), (1, 4, 1024, 128, True)]  # (B, H, N, D, causal)
FP16_TC = {6, 7, 9}  # chapters on fp16 tensor cores; 08's steps on fp16 operands are checked beside them


def torch_flash():
    """(torch, a function running PyTorch's SDPA on its flash backend), or None without PyTorch or
    a CUDA device for it."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None

    def attend(q, k, v, causal):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return torch, attend


def torch_fp16_error(q, k, v, causal, want_o):
    """Max abs error of PyTorch's fp16 flash attention against float64 on the same inputs; None
    without PyTorch or a CUDA device for it."""
    if not (found := torch_flash()):
        return None
    torch, attend = found
    o = attend(*(torch.from_numpy(x).cuda() for x in (q, k, v)), causal)
    return float(np.abs(o.float().cpu().numpy().astype(np.float64) - want_o).max())


def torch_rule_case(name, b, h, n, d, causal, build_name=None):
    """FlashAttention's own test rule: the max abs error of O against float64 is at most twice that
    of PyTorch's fp16 attention (flash backend) on the same inputs. Skipped without PyTorch."""
    def case(ctx):
        folder, out = output_inputs(ctx, b, h, n, d), ctx.tmpdir() / "out"
        proc, _ = run_csv(ctx, name, ["--input", str(folder), "--output", str(out), "--no-check"] +
                          (["--causal"] if causal else []), build_name=build_name)
        shown = f"{name} B={b} H={h} N={n} D={d}{' causal' if causal else ''}"
        assert proc.returncode == 0, f"{shown}: exit {proc.returncode}: {proc.stderr.strip()[-300:]}"
        q, k, v = (np.load(folder / f"{x}.npy") for x in "qkv")
        want_o, _ = attention64(q, k, v, causal, 1 / math.sqrt(d))
        torch_error = ctx.once(("torch_fp16_error", b, h, n, d, causal), lambda: torch_fp16_error(q, k, v, causal, want_o))
        if torch_error is None:
            raise unittest.SkipTest("PyTorch with CUDA not importable: its fp16 error is not measured here")
        error = float(np.abs(np.load(out / "o.npy").astype(np.float64) - want_o).max())
        assert error <= 2 * torch_error, (f"{shown}: max abs error of O {error:.3e}, more than twice PyTorch's fp16 "
                                          f"attention's {torch_error:.3e} on the same inputs")
        return f"max abs {error:.2e} against PyTorch's {torch_error:.2e} ({error / torch_error:.2f}x)"
    return case


# --- scratch that cannot fit -------------------------------------------------------------------
def scratch_case(chapter):
    b, h, n, d = 1, 64, 65536, 64  # B*H*N*N*4 = 1 TiB of scratch

    def case(ctx):
        binary = ctx.require_binary(chapter, native=True)
        args = shape_args(b, h, n, d, False) + ["--no-check", "--warmup", "0", "--iters", "1"]
        proc = ctx.run([binary, *args], env={"FA_CACHE": ctx.tmpdir()}, timeout=120)
        shown = f"{chapter} {' '.join(args)} (1 TiB of scratch)"
        if proc.returncode == 77:
            raise unittest.SkipTest(proc.stdout.strip())
        message = proc.stderr.strip()
        assert proc.returncode == 2, f"{shown}: expected exit 2 (will not fit), got {proc.returncode}: {message!r}"
        assert re.search(r"memory", message, re.I) and re.search(r"(lower|reduce|smaller)", message, re.I), (
            f"{shown}: the message should say the memory does not fit and what to lower: {message!r}")
    return case


# --- 08's steps (BUILD/08_fp8.step1 ... step4; step 5 is the chapter, in the matrix above) ---------
STEP_BUILDS = [("08.1", "08_fp8.step1", "fp16"), ("08.2", "08_fp8.step2", "fp16"), ("08.3", "08_fp8.step3", "fp16"),
               ("08.4", "08_fp8.step4", "fp8")]
STEP_KEY_TILE = {"08.4": {64: 128, 128: 192}}  # FP8 steps' key tiles, where they differ from the chapter's
STEP_SEQLENS = (1, 127, 385, 1000)  # one key, ragged tiles, past 2 x 192 keys, many tiles
STEP_BATCH_HEADS = (2, 3)


def step_row_checks(step, dtype, row, shown, b, h, n, d):
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


def step_case(step, build_name, dtype, b, h, n, d, causal, inputs=None):
    """One step of 08 at a shape (or on the large-logit inputs): PASS under its precision's rule."""
    def case(ctx):
        if inputs:
            folder = large_logit_inputs(ctx, d)
            args = ["--input", str(folder)] + (["--causal"] if causal else [])
        else:
            args = shape_args(b, h, n, d, causal)
        proc, row = run_csv(ctx, step, args, build_name=build_name)
        shown = f"{step} ({build_name}) {'<qk-std 4.5> ' if inputs else ''}B={b} H={h} N={n} D={d}" \
                f"{' causal' if causal else ''}"
        assert proc.returncode == 0 and row and row["status"] == "PASS", f"{shown}: expected PASS, got {describe(proc, row)}"
        check_shape_echoed(row, shown, b, h, n, d, causal)
        step_row_checks(step, dtype, row, shown, b, h, n, d)
        return f"rel_l2 {row['rel_l2']}"
    return case


# --- the backward pass (--backward) ----------------------------------------------------------------
BACKWARD_SEQLENS = (1, 17, 64, 127, 128, 1000, 2048)
BACKWARD_TOL = 1e-3  # each gradient's rel L2 (common/harness.cu's BACKWARD_REL_L2_TOL)
BACKWARD_VARIANTS = ("deterministic",)  # BUILD/<chapter>.<variant>: the Makefile's VARIANT_BUILDS
BACKWARD_LEAN_SEQLENS = (1, 127, 1000)
# (B, H, N) with more blocks than a GPU holds at once: the deterministic build's blocks of a head
# then take several key tiles each, in turn (128 heads of 4 or 8 key tiles).
BACKWARD_MANY_HEADS = (8, 16, 1000)
BACKWARD_OUTPUT_SHAPES = [(2, 3, 200, 64, True), (1, 2, 129, 128, False), (1, 4, 1024, 128, True)]
GRADS = ("dq", "dk", "dv")


def backward_chapters(ctx):
    return [chapter for chapter in ctx.chapters if has_backward(ctx, chapter)]


def check_backward_row(proc, row, shown, b, h, n, d, causal):
    assert proc.returncode == 0 and row and row["status"] == "PASS", f"{shown}: expected PASS, got {describe(proc, row)}"
    check_shape_echoed(row, shown, b, h, n, d, causal)
    errors = [float(row[f"{g}_rel_l2"] or "nan") for g in GRADS]
    assert all(e <= BACKWARD_TOL for e in errors), f"{shown}: dQ, dK, dV rel L2 {errors}, expected <= {BACKWARD_TOL}"
    # Device memory: Q, K, V, O, dO, dQ, dK, dV fp16, LSE fp32 and the backward's workspace.
    buffers = 8 * b * h * n * d * 2 + b * h * n * 4 + int(row["workspace_bytes"])
    assert row["device_bytes"] == str(buffers), f"{shown}: device_bytes {row['device_bytes']}, expected {buffers}"
    return "dq/dk/dv rel_l2 " + " ".join(f"{e:.2e}" for e in errors)


def backward_case(chapter, b, h, n, d, causal, variant=None):
    def case(ctx):
        build_name = f"{chapter}.{variant}" if variant else None
        proc, row = run_csv(ctx, chapter, shape_args(b, h, n, d, causal) + ["--backward"], build_name=build_name)
        shown = f"{build_name or chapter} --backward B={b} H={h} N={n} D={d}{' causal' if causal else ''}"
        return check_backward_row(proc, row, shown, b, h, n, d, causal)
    return case


def backward_large_logit_case(chapter, d, causal):
    def case(ctx):
        folder = large_logit_inputs(ctx, d, grad=True)
        proc, row = run_csv(ctx, chapter, ["--input", str(folder), "--backward"] + (["--causal"] if causal else []))
        shown = f"{chapter} --backward --input <qk-std 4.5, B=1 H=2 N=300 D={d}>{' --causal' if causal else ''}"
        return check_backward_row(proc, row, shown, 1, 2, 300, d, causal)
    return case


def attention64_grads(q, k, v, do, causal, scale):
    """float64 dQ, dK, dV of L = sum(O * dO), straight from the formula, independent of common/."""
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    s = scores64(q, k, causal, scale)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bhij,bhjd->bhid", p, v)
    dp = np.einsum("bhid,bhjd->bhij", do, v)
    ds = p * (dp - (do * o).sum(-1, keepdims=True))
    return (np.einsum("bhij,bhjd->bhid", ds, k) * scale, np.einsum("bhij,bhid->bhjd", ds, q) * scale,
            np.einsum("bhij,bhid->bhjd", p, do))


def torch_grad_errors(q, k, v, do, causal, want):
    """Max abs error of each of PyTorch's fp16 flash-attention gradients against float64; None without it."""
    if not (found := torch_flash()):
        return None
    torch, attend = found
    q, k, v = (torch.from_numpy(x).cuda().requires_grad_() for x in (q, k, v))
    o = attend(q, k, v, causal)
    o.backward(torch.from_numpy(do).cuda())
    return [float(np.abs(x.grad.float().cpu().numpy().astype(np.float64) - w).max()) for x, w in zip((q, k, v), want)]


def backward_output(ctx, chapter, folder, out, causal, build_name=None):
    proc, row = run_csv(ctx, chapter, ["--input", str(folder), "--output", str(out), "--backward"] +
                        (["--causal"] if causal else []), build_name=build_name)
    grads = {}
    if proc.returncode == 0:
        for g in GRADS:
            assert (out / f"{g}.npy").is_file(), f"{build_name or chapter} --backward --output: {g}.npy not written"
            grads[g] = np.load(out / f"{g}.npy")
    return proc, row, grads


def backward_output_case(chapter, b, h, n, d, causal):
    """--output's dQ, dK, dV against float64 computed here, every row; and FlashAttention's own rule on
    gradients: max abs error at most twice that of PyTorch's fp16 backward (skipped without PyTorch)."""
    def case(ctx):
        folder, out = output_inputs(ctx, b, h, n, d, grad=True), ctx.tmpdir() / "out"
        shown = f"{chapter} --backward --output, B={b} H={h} N={n} D={d}{' causal' if causal else ''}"
        proc, row, grads = backward_output(ctx, chapter, folder, out, causal)
        check_backward_row(proc, row, shown, b, h, n, d, causal)
        q, k, v, do = (np.load(folder / f"{x}.npy") for x in ("q", "k", "v", "do"))
        want = attention64_grads(q, k, v, do, causal, 1 / math.sqrt(d))
        notes = []
        errors = []
        for g, w in zip(GRADS, want):
            x = grads[g]
            assert x.dtype == np.float16 and x.shape == (b, h, n, d), f"{shown}: {g}.npy is {x.dtype} {x.shape}"
            x = x.astype(np.float64)
            assert np.isfinite(x).all(), f"{shown}: {np.count_nonzero(~np.isfinite(x))} non-finite {g} elements"
            rel = float(np.linalg.norm(x - w) / np.linalg.norm(w))
            assert rel <= BACKWARD_TOL, f"{shown}: {g}.npy relative L2 error {rel:.3e} over every row, expected <= {BACKWARD_TOL}"
            errors.append(float(np.abs(x - w).max()))
            notes.append(f"{g} {rel:.2e}")
        torch_errors = ctx.once(("torch_grad_errors", b, h, n, d, causal), lambda: torch_grad_errors(q, k, v, do, causal, want))
        if torch_errors is not None:
            for g, mine, theirs in zip(GRADS, errors, torch_errors):
                assert mine <= 2 * theirs, (f"{shown}: max abs error of {g} {mine:.3e}, more than twice PyTorch's fp16 "
                                            f"backward's {theirs:.3e} on the same inputs")
            notes.append("max abs vs PyTorch " + " ".join(f"{m / t:.2f}x" for m, t in zip(errors, torch_errors)))
        return ", ".join(notes)
    return case


def backward_repeat_case(chapter, variant, b, h, n, d, causal):
    """Two runs on the same inputs: dK and dV bitwise the same (each key block sums its own); dQ too
    where it is summed in a fixed order (the DETERMINISTIC_DQ build)."""
    def case(ctx):
        build_name = f"{chapter}.{variant}" if variant else None
        folder = output_inputs(ctx, b, h, n, d, grad=True)
        shown = f"{build_name or chapter} --backward twice, B={b} H={h} N={n} D={d}{' causal' if causal else ''}"
        runs = []
        for i in range(2):
            proc, row, grads = backward_output(ctx, chapter, folder, ctx.tmpdir() / f"out{i}", causal, build_name)
            check_backward_row(proc, row, shown, b, h, n, d, causal)
            runs.append(grads)
        same = {g: bool(np.array_equal(runs[0][g].view(np.uint16), runs[1][g].view(np.uint16))) for g in GRADS}
        must = GRADS if variant == "deterministic" else ("dk", "dv")
        differ = [g for g in must if not same[g]]
        assert not differ, f"{shown}: {', '.join(differ)} differ between the two runs, expected bitwise the same"
        return "bitwise the same: " + ", ".join(g for g in GRADS if same[g])
    return case


def backward_cases(ctx):
    out = []
    for chapter in backward_chapters(ctx):
        for n in sorted(BACKWARD_SEQLENS, reverse=True):
            for b, h in batch_heads(n):
                for d in DIMS:
                    for causal in (False, True):
                        name = f"backward[{chapter} D={d}{' causal' if causal else ''} N={n} B={b} H={h}]"
                        out.append((name, backward_case(chapter, b, h, n, d, causal), ("shape", b, h, n, d)))
        for variant in BACKWARD_VARIANTS:
            for b, h, n in [(2, 3, n) for n in BACKWARD_LEAN_SEQLENS] + [BACKWARD_MANY_HEADS]:
                for d in DIMS:
                    for causal in (False, True):
                        name = f"backward[{chapter}.{variant} D={d}{' causal' if causal else ''} N={n} B={b} H={h}]"
                        out.append((name, backward_case(chapter, b, h, n, d, causal, variant), ("shape", b, h, n, d)))
        for d in DIMS:
            for causal in (False, True):
                name = f"backward_large_logits[{chapter} D={d}{' causal' if causal else ''}]"
                out.append((name, backward_large_logit_case(chapter, d, causal), ("grad_large_logits", d)))
        for b, h, n, d, causal in BACKWARD_OUTPUT_SHAPES:
            shape = f"B={b} H={h} N={n} D={d}{' causal' if causal else ''}"
            out.append((f"backward_output[{chapter} {shape}]", backward_output_case(chapter, b, h, n, d, causal),
                        ("grad_output", b, h, n, d)))
        for variant in (None,) + BACKWARD_VARIANTS:
            name = f"backward_repeat[{chapter}{'.' + variant if variant else ''} B=1 H=4 N=1024 D=128 causal]"
            out.append((name, backward_repeat_case(chapter, variant, 1, 4, 1024, 128, True), ("grad_output", 1, 4, 1024, 128)))
        for variant in BACKWARD_VARIANTS:  # more heads than the GPU's blocks: blocks that take key tiles in turn
            name = f"backward_repeat[{chapter}.{variant} B=4 H=16 N=1024 D=128 causal]"
            out.append((name, backward_repeat_case(chapter, variant, 4, 16, 1024, 128, True),
                        ("grad_output", 4, 16, 1024, 128)))
    return out


def cases(ctx):
    out = backward_cases(ctx)
    for step, build_name, dtype in STEP_BUILDS:  # a lean matrix per step: both D, masks, ragged N, large logits
        b, h = STEP_BATCH_HEADS
        for d in DIMS:
            for causal in (False, True):
                for n in STEP_SEQLENS:
                    name = f"step[{step} D={d}{' causal' if causal else ''} N={n} B={b} H={h}]"
                    out.append((name, step_case(step, build_name, dtype, b, h, n, d, causal), ("shape", b, h, n, d)))
                name = f"step_large_logits[{step} D={d}{' causal' if causal else ''}]"
                out.append((name, step_case(step, build_name, dtype, 1, 2, 300, d, causal, inputs="large"),
                            ("large_logits", d)))
    for n in sorted(SEQLENS + TILE_192_SEQLENS, reverse=True):  # the heaviest groups first
        for b, h in batch_heads(n):
            for d in DIMS:
                group = ("shape", b, h, n, d)
                for causal in (False, True):
                    for chapter in [c for c in ctx.chapters if n in matrix_seqlens(ctx, c)]:
                        name = f"matrix[{chapter} D={d}{' causal' if causal else ''} N={n} B={b} H={h}]"
                        out.append((name, matrix_case(chapter, b, h, n, d, causal), group))
    for d in DIMS:
        for causal in (False, True):
            for chapter in ctx.chapters:
                name = f"large_logits[{chapter} D={d}{' causal' if causal else ''}]"
                out.append((name, large_logit_case(chapter, d, causal), ("large_logits", d)))
    for causal in (False, True):
        for chapter in ctx.chapters:
            if ctx.chapter_number(chapter) in FP8:
                name = f"huge_logits[{chapter} D=128{' causal' if causal else ''}]"
                out.append((name, large_logit_case(chapter, 128, causal, "20", 1500), ("large_logits", 128, "20")))
                name = f"one_hot[{chapter} D=128{' causal' if causal else ''}]"
                out.append((name, one_hot_case(chapter, causal), ("one_hot",)))
    for causal in (False, True):
        for chapter in ctx.chapters:
            name = f"outliers[{chapter}{' causal' if causal else ''}]"
            out.append((name, outlier_case(chapter, causal), ("outliers",)))
    for b, h, n, d, causal in OUTPUT_SHAPES:
        for chapter in ctx.chapters:
            name = f"output[{chapter} B={b} H={h} N={n} D={d}{' causal' if causal else ''}]"
            out.append((name, output_case(chapter, b, h, n, d, causal), ("output", b, h, n, d)))
    for b, h, n, d, causal in TORCH_RULE_SHAPES:
        shape = f"B={b} H={h} N={n} D={d}{' causal' if causal else ''}"
        for chapter in ctx.chapters:
            if ctx.chapter_number(chapter) in FP16_TC:
                out.append((f"twice_torch[{chapter} {shape}]", torch_rule_case(chapter, b, h, n, d, causal),
                            ("output", b, h, n, d)))
        for step, build_name, dtype in STEP_BUILDS:
            if dtype == "fp16":
                out.append((f"twice_torch[{step} {shape}]", torch_rule_case(step, b, h, n, d, causal, build_name),
                            ("output", b, h, n, d)))
    for chapter in ctx.chapters:
        if ctx.chapter_number(chapter) in N2_WORKSPACE:
            out.append((f"scratch_too_large[{chapter}]", scratch_case(chapter), ("scratch", chapter)))
    return out
