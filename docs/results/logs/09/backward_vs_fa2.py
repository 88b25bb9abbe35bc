"""Time 09's backward (both builds) beside PyTorch's flash-attention backward (FlashAttention-2's
kernels) on the same shapes, in one run: medians of 30 after 5 warm-up runs, CUDA events.

  python3 docs/results/logs/09/backward_vs_fa2.py [K]     (K: only the first K shapes)

Prints one CSV line per shape and mask (ms; speedup = FA2's time / ours). Needs PyTorch and a GPU,
and `make` first (build/09_backward, build/09_backward.deterministic).
"""
import os
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "common"))
from runner import run_case, shape_args  # noqa: E402

SHAPES = [(4, 16, 4096, 128), (4, 16, 4096, 64), (8, 16, 2048, 128), (8, 16, 2048, 64), (2, 16, 8192, 128)]
BUILDS = ("09_backward", "09_backward.deterministic")
WARMUP, ITERS = 5, 30


def torch_backward_ms(b, h, n, d, causal):
    """Median ms of PyTorch's flash backward (dQ, dK, dV of one forward's O) on N(0, 1) fp16 inputs."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    times = []
    for i in range(WARMUP + ITERS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
        end.record()
        torch.cuda.synchronize()
        if i >= WARMUP:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def ours(build, b, h, n, d, causal):
    """(ms or nan, the row's status and gradient errors, or what went wrong) of one build, unchecked."""
    args = shape_args((b, h, n, d, causal)) + ["--backward", "--no-check", "--warmup", str(WARMUP), "--iters", str(ITERS)]
    status, row, note = run_case(os.path.join(ROOT, "build", build), "09_backward", args)
    if row is None or row["ms"] is None:
        return float("nan"), f"{status} {note}"
    errors = " ".join("" if row[g] is None else f"{row[g]:.3e}" for g in ("dq_rel_l2", "dk_rel_l2", "dv_rel_l2"))
    return row["ms"], f"{status} {errors}"


def main():
    shapes = SHAPES[:int(sys.argv[1])] if len(sys.argv) > 1 else SHAPES
    print("shape,causal,torch_ms,ours_ms,det_ms,speedup,det_speedup,status,rel")
    for b, h, n, d in shapes:
        for causal in (False, True):
            fa2 = torch_backward_ms(b, h, n, d, causal)
            (atomic, said), (deterministic, _) = (ours(build, b, h, n, d, causal) for build in BUILDS)
            print(f"B{b}H{h}N{n}D{d},{int(causal)},{fa2:.3f},{atomic:.3f},{deterministic:.3f},"
                  f"{fa2 / atomic:.2f},{fa2 / deterministic:.2f},{said}", flush=True)


if __name__ == "__main__":
    main()
