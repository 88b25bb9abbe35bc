"""Time PyTorch's flash-attention backward (FlashAttention-2's kernels) beside build/09_backward."""
import subprocess, sys, statistics, torch
from torch.nn.attention import SDPBackend, sdpa_kernel
F = torch.nn.functional
def torch_bwd_ms(b, h, n, d, causal, iters=30):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(4))
    for x in (q, k, v): x.requires_grad_()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    times = []
    for i in range(iters + 5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); torch.autograd.grad(o, (q, k, v), do, retain_graph=True); e.record(); torch.cuda.synchronize()
        if i >= 5: times.append(s.elapsed_time(e))
    return statistics.median(times)
def ours_ms(binary, b, h, n, d, causal):
    cmd = [binary, "--backward", "--batch", str(b), "--heads", str(h), "--seqlen", str(n), "--headdim", str(d),
           "--csv", "--no-check", "--warmup", "5", "--iters", "30"] + (["--causal"] if causal else [])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    rows = [l for l in p.stdout.splitlines() if l.startswith("09_backward,")]
    if p.returncode or not rows: return None, p.stdout[-300:] + p.stderr[-300:]
    return rows[-1], None
hdr = None
print("shape,causal,torch_ms,ours_ms,det_ms,speedup,det_speedup,status,rel")
SHAPES = [(4, 16, 4096, 128), (4, 16, 4096, 64), (8, 16, 2048, 128), (8, 16, 2048, 64), (2, 16, 8192, 128)]
for b, h, n, d in SHAPES[:int(sys.argv[1])] if len(sys.argv) > 1 else SHAPES:
    for causal in (False, True):
        t = torch_bwd_ms(b, h, n, d, causal)
        out = []
        for binary in ("build/09_backward", "build/09_backward.deterministic"):
            row, err = ours_ms(binary, b, h, n, d, causal)
            out.append((row, err))
        def ms(r):
            return float(r[0].split(",")[7]) if r[0] else float("nan")
        r0 = out[0][0] or ""
        print(f"B{b}H{h}N{n}D{d},{int(causal)},{t:.3f},{ms(out[0]):.3f},{ms(out[1]):.3f},{t/ms(out[0]):.2f},{t/ms(out[1]):.2f},"
              f"{' '.join(r0.split(',')[i] for i in (10, -3, -2, -1)) if r0 else out[0][1]}", flush=True)
