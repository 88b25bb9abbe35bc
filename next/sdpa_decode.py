"""PyTorch SDPA's decode at the 11_decode README's shapes: D = 128, 32 query heads, one new query, a dense
cache of L tokens per sequence and KV head (grouped query heads broadcast, enable_gqa=True); each backend
alone, timed as the bench times its anchors (common/anchors.py's median_ms: 5 warm-up calls, then 20
queued back to back, an event pair around each, the median); GB/s of K and V read.
Run from the repository's root: python3 docs/results/logs/11/sdpa_decode.py
Prints: sdpa_<backend> b<B> hkv<H> L<L> ms,GB/s"""
import sys

import torch

sys.path.insert(0, "common")
from anchors import backend_context, median_ms  # noqa: E402

SHAPES = [(1, 8, 32768), (1, 8, 131072), (16, 8, 8192), (64, 8, 4096), (8, 32, 32768)]
D, HQ = 128, 32

for batch, kv_heads, length in SHAPES:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.float16, generator=gen)
    k = torch.randn(batch, kv_heads, length, D, device="cuda", dtype=torch.float16, generator=gen)
    v = torch.randn(batch, kv_heads, length, D, device="cuda", dtype=torch.float16, generator=gen)
    nbytes = 2 * k.numel() * k.element_size()
    for name in ("flash", "cudnn"):
        with backend_context(f"torch_{name}"):
            ms = median_ms(torch, lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                           warmup=5, iters=20)
        print(f"sdpa_{name} b{batch} hkv{kv_heads} L{length} {ms:.4f},{nbytes / ms / 1e6:.1f}", flush=True)
