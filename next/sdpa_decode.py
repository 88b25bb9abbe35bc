"""PyTorch SDPA's decode at the 11_decode README's shapes: D = 128, 32 query heads, one new query, a dense
cache of L tokens per sequence and KV head (grouped query heads broadcast, enable_gqa=True); each backend
alone; 5 warm-up calls, then 20 calls queued back to back, an event pair around each, the median; GB/s of K
and V read. Prints: sdpa_<backend> b<B> hkv<H> L<L> ms,GB/s"""
import statistics
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [(1, 8, 32768), (1, 8, 131072), (16, 8, 8192), (64, 8, 4096), (8, 32, 32768)]
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
D, HQ = 128, 32

for batch, kv_heads, length in SHAPES:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.float16, generator=gen)
    k = torch.randn(batch, kv_heads, length, D, device="cuda", dtype=torch.float16, generator=gen)
    v = torch.randn(batch, kv_heads, length, D, device="cuda", dtype=torch.float16, generator=gen)
    nbytes = 2 * k.numel() * k.element_size()
    for name, backend in BACKENDS.items():
        with sdpa_kernel(backend):
            for _ in range(5):
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(20)]
            for start, end in events:
                start.record()
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                end.record()
            torch.cuda.synchronize()
            ms = statistics.median(s.elapsed_time(e) for s, e in events)
        print(f"sdpa_{name} b{batch} hkv{kv_heads} L{length} {ms:.4f},{nbytes / ms / 1e6:.1f}", flush=True)
