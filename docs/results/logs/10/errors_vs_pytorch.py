#!/usr/bin/env python3
"""The backward's max abs errors against float64, beside PyTorch's own fp16 backward's (SDPA, flash), on
the same N(0, 1) inputs: FlashAttention's rule is that a kernel's error be at most twice PyTorch's.

    python3 docs/results/logs/10/errors_vs_pytorch.py [--build build] [BUILD ...]

Runs each build (default: 09_backward and 10_backward_hopper, the default and the deterministic mode)
with --backward --input/--output at a few shapes, and prints one row a shape and build: the max abs
error of dQ, dK and dV against float64 (computed here, NumPy), PyTorch's, and their ratio. Needs the
builds, a GPU, NumPy and PyTorch."""
import argparse
import math
import os
import subprocess
import sys
import tempfile

import numpy as np

SHAPES = [(1, 4, 1024, 128, False), (1, 4, 1024, 128, True), (2, 3, 200, 64, True), (1, 2, 129, 128, False),
          (1, 4, 1024, 64, False)]
GRADS = ("dq", "dk", "dv")


def float64_grads(q, k, v, do, causal):
    """dQ, dK, dV of L = sum(O * dO) in float64, from the formula."""
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    scale = 1 / math.sqrt(q.shape[-1])
    s = np.einsum("bhid,bhjd->bhij", q, k) * scale
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bhij,bhjd->bhid", p, v)
    ds = p * (np.einsum("bhid,bhjd->bhij", do, v) - (do * o).sum(-1, keepdims=True))
    return (np.einsum("bhij,bhjd->bhid", ds, k) * scale, np.einsum("bhij,bhid->bhjd", ds, q) * scale,
            np.einsum("bhij,bhid->bhjd", p, do))


def torch_errors(q, k, v, do, causal, want):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    leaves = [torch.from_numpy(x).cuda().requires_grad_() for x in (q, k, v)]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        o = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
    o.backward(torch.from_numpy(do).cuda())
    return [float(np.abs(x.grad.double().cpu().numpy() - w).max()) for x, w in zip(leaves, want)]


def build_errors(binary, flags, folder, causal, want):
    with tempfile.TemporaryDirectory() as out:
        cmd = [binary, "--backward", "--input", folder, "--output", out, "--warmup", "0", "--iters", "1", *flags]
        proc = subprocess.run(cmd + (["--causal"] if causal else []), capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            sys.exit(f"{' '.join(cmd)}: exit {proc.returncode}\n{proc.stdout[-800:]}{proc.stderr[-800:]}")
        return [float(np.abs(np.load(os.path.join(out, f"{g}.npy")).astype(np.float64) - w).max())
                for g, w in zip(GRADS, want)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build", default="build")
    parser.add_argument("builds", nargs="*", default=["09_backward", "10_backward_hopper"])
    args = parser.parse_args()
    print("B H N D mask build mode | max abs error dQ dK dV | PyTorch's dQ dK dV | ratio dQ dK dV")
    for b, h, n, d, causal in SHAPES:
        rng = np.random.default_rng(4048 + n + d)
        q, k, v, do = (rng.standard_normal((b, h, n, d)).astype(np.float16) for _ in range(4))
        want = float64_grads(q, k, v, do, causal)
        theirs = torch_errors(q, k, v, do, causal, want)
        with tempfile.TemporaryDirectory() as folder:
            for name, x in zip(("q", "k", "v", "do"), (q, k, v, do)):
                np.save(os.path.join(folder, f"{name}.npy"), x)
            for build in args.builds:
                for mode, flags in (("default", []), ("deterministic", ["--deterministic"])):
                    mine = build_errors(os.path.join(args.build, build), flags, folder, causal, want)
                    print(f"{b} {h} {n} {d} {'causal' if causal else 'none'} {build} {mode} | "
                          + " ".join(f"{e:.3e}" for e in mine) + " | " + " ".join(f"{e:.3e}" for e in theirs)
                          + " | " + " ".join(f"{m / t:.2f}" for m, t in zip(mine, theirs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
