"""10's backward beside 09's and PyTorch's cuDNN and flash (FlashAttention-2) backward at N = 8192 and
16384, D = 128 (the bench's shapes: 16k tokens, 16 heads), causal and not, one run: medians of 20 after
5 warm-up runs, CUDA events; PyTorch's calls queued (torch.autograd.grad), ours by the harness, unchecked.
Prints: shape,causal,cudnn_ms,fa2_ms,10_ms,10det_ms,09_ms,10_vs_cudnn,10_vs_09,10_vs_fa2"""
import os
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(ROOT, "common"))
from runner import run_case, shape_args  # noqa: E402

WARMUP, ITERS = 5, 20


def torch_ms(backend, b, h, n, d, causal):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()
    with sdpa_kernel([backend]):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        for _ in range(WARMUP):
            torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(ITERS)]
        for start, end in events:
            start.record()
            torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
            end.record()
        torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def ours(build, flags, b, h, n, d, causal):
    args = shape_args((b, h, n, d, causal)) + ["--backward", "--no-check", "--warmup", str(WARMUP), "--iters",
                                               str(ITERS), *flags]
    status, row, note = run_case(os.path.join(ROOT, "build", build), build, args)
    return float("nan") if row is None or row["ms"] is None else row["ms"]


print("shape,causal,cudnn_ms,fa2_ms,10_ms,10det_ms,09_ms,10_vs_cudnn,10_vs_09,10_vs_fa2", flush=True)
for b, h, n, d in [(2, 16, 8192, 128), (1, 16, 16384, 128)]:
    for causal in (False, True):
        cudnn = torch_ms(SDPBackend.CUDNN_ATTENTION, b, h, n, d, causal)
        fa2 = torch_ms(SDPBackend.FLASH_ATTENTION, b, h, n, d, causal)
        t10 = ours("10_backward_hopper", (), b, h, n, d, causal)
        t10d = ours("10_backward_hopper", ("--deterministic",), b, h, n, d, causal)
        t09 = ours("09_backward", (), b, h, n, d, causal)
        print(f"B{b}H{h}N{n}D{d},{int(causal)},{cudnn:.3f},{fa2:.3f},{t10:.3f},{t10d:.3f},{t09:.3f},"
              f"{cudnn / t10:.2f},{t09 / t10:.2f},{fa2 / t10:.2f}", flush=True)
