"""Time 09's backward (both modes) beside PyTorch's flash-attention backward (FlashAttention-2's
kernels) on the same shapes, in one run: medians of 30 after 5 warm-up runs, CUDA events.

  python3 docs/results/logs/09/backward_vs_fa2.py [K] [--build LABEL=BINARY[@deterministic] ...]

K: only the first K shapes. --build (repeatable): time these binaries instead of the chapter in its
two modes, each under its label, in the order given (a step, build/09_backward.step1; @deterministic
runs it with --deterministic). Prints one CSV line per shape and mask (ms; speedup = FA2's time /
ours): the columns torch_ms, then LABEL_ms and LABEL_speedup of each build, then the status and
gradient errors of the first. Needs PyTorch and a GPU, and `make` first (build/09_backward).
(Until 2026-12-06 the deterministic mode was a build of its own, build/09_backward.deterministic.)
The CSVs in this folder were timed one PyTorch call at a time, a synchronisation after each, which
put PyTorch's dispatch of the backward (0.15-0.2 ms on an H100) into every FA2 time; since
2026-12-06 the calls are queued back to back, as the bench (common/anchors.py) and the harness time.
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
BUILDS = (("ours", os.path.join(ROOT, "build", "09_backward"), ()),
          ("det", os.path.join(ROOT, "build", "09_backward"), ("--deterministic",)))
WARMUP, ITERS = 5, 30


def torch_backward_ms(b, h, n, d, causal):
    """Median ms of PyTorch's flash backward (dQ, dK, dV of one forward's O) on N(0, 1) fp16 inputs."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    for _ in range(WARMUP):
        torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(ITERS)]
    for start, end in events:  # queued: the GPU never waits for Python between two backward passes
        start.record()
        torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def ours(binary, flags, b, h, n, d, causal):
    """(ms or nan, the row's status and gradient errors, or what went wrong) of one binary, unchecked."""
    args = shape_args((b, h, n, d, causal)) + ["--backward", "--no-check", "--warmup", str(WARMUP), "--iters",
                                               str(ITERS), *flags]
    status, row, note = run_case(binary, "09_backward", args)
    if row is None or row["ms"] is None:
        return float("nan"), f"{status} {note}"
    errors = " ".join("" if row[g] is None else f"{row[g]:.3e}" for g in ("dq_rel_l2", "dk_rel_l2", "dv_rel_l2"))
    return row["ms"], f"{status} {errors}"


def arguments(argv):
    """(shapes, [(label, binary, flags)]) from [K] [--build LABEL=BINARY[@deterministic] ...]."""
    count, builds, rest = None, [], list(argv)
    while rest:
        arg = rest.pop(0)
        if arg == "--build" and rest and "=" in rest[0]:
            label, binary = rest.pop(0).split("=", 1)
            binary, mode = binary.split("@", 1) if "@" in binary else (binary, "")
            builds.append((label, os.path.abspath(binary), ("--deterministic",) if mode == "deterministic" else ()))
        elif arg.isdigit() and count is None:
            count = int(arg)
        else:
            sys.exit(f"usage: backward_vs_fa2.py [K] [--build LABEL=BINARY[@deterministic] ...] (got {arg!r})")
    return SHAPES[:count] if count else SHAPES, builds or list(BUILDS)


def main():
    shapes, builds = arguments(sys.argv[1:])
    labels = [label for label, _, _ in builds]
    print(",".join(["shape", "causal", "torch_ms"] + [f"{x}_ms" for x in labels] + [f"{x}_speedup" for x in labels] +
                   ["status", "rel"]))
    for b, h, n, d in shapes:
        for causal in (False, True):
            fa2 = torch_backward_ms(b, h, n, d, causal)
            runs = [ours(binary, flags, b, h, n, d, causal) for _, binary, flags in builds]
            said = runs[0][1]
            print(",".join([f"B{b}H{h}N{n}D{d}", str(int(causal)), f"{fa2:.3f}"] + [f"{ms:.3f}" for ms, _ in runs] +
                           [f"{fa2 / ms:.2f}" for ms, _ in runs] + [said]), flush=True)


if __name__ == "__main__":
    main()
