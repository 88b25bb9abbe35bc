"""Where a generation step's attention time goes, per call, at make generate's shape
(B 1, H 6, D 64, one new query, a cache of 256 tokens in pages of 16): the wall time a call costs the CPU (calls
queued back to back, one synchronisation at the end; the GPU is mostly idle at this size) for
  sdpa        SDPA on a contiguous cache (each backend)
  op          torch_op.decode (the registered op: dispatcher, checks, allocation, ctypes, two kernels)
  impl        torch_op.decode_impl (the same without the dispatcher)
  plan run    a torch_op.DecodePlan's run (the checks of q and the pools, two outputs, fa_decode)
  plan append+run   the same, the step's new K and V appended first (fa_decode_append)
  raw         the library's fa_decode through ctypes alone, outputs and workspace allocated once
  write       a step's cache write: the paged cache's index_put, and the contiguous cache's slice copy
Run: python3 docs/results/logs/11/decode_overhead.py (from the repo root, after make lib; the
H100 run of 2026-12-06 at 2c934b2: decode_overhead_h100.txt)."""
import sys, time
sys.path.insert(0, "common")
import torch, torch_op
from torch.nn.attention import sdpa_kernel, SDPBackend

H, D, L, P, N = 6, 64, 256, 16, 2000
dev = "cuda"
q = torch.randn(1, H, 1, D, device=dev, dtype=torch.float16)
pages = 512 // P
k_pool, v_pool = (torch.randn(pages, H, P, D, device=dev, dtype=torch.float16) for _ in range(2))
table = torch.randperm(pages).to(torch.int32).view(1, pages).to(dev)
lengths = torch.full((1,), L, dtype=torch.int32, device=dev)
k_c, v_c = (torch.randn(1, H, 512, D, device=dev, dtype=torch.float16) for _ in range(2))


def per_call(f, n=N):
    for _ in range(50): f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n): f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


rows = []
for name, be in (("sdpa default", None), ("sdpa flash", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION),
                 ("sdpa efficient", SDPBackend.EFFICIENT_ATTENTION)):
    kk, vv = k_c[:, :, :L], v_c[:, :, :L]
    try:
        if be is None:
            rows.append((name, per_call(lambda: torch.nn.functional.scaled_dot_product_attention(q, kk, vv))))
        else:
            with sdpa_kernel(be):
                rows.append((name, per_call(lambda: torch.nn.functional.scaled_dot_product_attention(q, kk, vv))))
    except RuntimeError as exc:
        rows.append((name, f"failed: {str(exc).splitlines()[0][:60]}"))
scale = D ** -0.5
rows.append(("op", per_call(lambda: torch_op.decode(q, k_pool, v_pool, table, lengths, max_length=L, chapter="11"))))
rows.append(("impl", per_call(lambda: torch_op.decode_impl(q, k_pool, v_pool, table, lengths, L, scale, "11"))))
plan = torch_op.DecodePlan(q, k_pool, v_pool, table, lengths, L)
rows.append(("plan run", per_call(lambda: plan.run(q, k_pool, v_pool))))
kv_new = torch.randn(1, H, 1, D, device=dev, dtype=torch.float16)
rows.append(("plan append+run", per_call(lambda: plan.run(q, k_pool, v_pool, k_new=kv_new, v_new=kv_new))))
lib = torch_op.library("11")
shape = torch_op.decode_shape_of(q, k_pool, table, scale)
o, lse = torch.empty_like(q), torch.empty(1, H, 1, dtype=torch.float32, device=dev)
size = lib.decode_workspace_bytes(shape, L)
ws = torch.empty(max(size, 1), dtype=torch.uint8, device=dev)
stream = torch.cuda.current_stream().cuda_stream
args = (q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), table.data_ptr(), lengths.data_ptr(), o.data_ptr(), lse.data_ptr(),
        ws.data_ptr(), size, stream)
rows.append(("raw", per_call(lambda: lib.decode(shape, L, *args))))
rows.append(("checks only", per_call(lambda: torch_op.check_decode_inputs(q, k_pool, v_pool, table, lengths))))
kv = torch.randn(1, H, 1, D, device=dev, dtype=torch.float16)
where = (table[0, torch.tensor([L - 1], device=dev) // P].long(), torch.tensor([L - 1], device=dev) % P)
def paged_write():
    k_pool[where[0], :, where[1]] = kv[0].transpose(0, 1)
    v_pool[where[0], :, where[1]] = kv[0].transpose(0, 1)
def slice_write():
    k_c[:, :, L - 1:L] = kv
    v_c[:, :, L - 1:L] = kv
rows.append(("write paged", per_call(paged_write)))
rows.append(("write slice", per_call(slice_write)))
ref = torch.nn.functional.scaled_dot_product_attention(q, k_c[:, :, :L], v_c[:, :, :L])
print(f"{torch.cuda.get_device_name()}; per call, microseconds of wall (B 1, H {H}, D {D}, cache {L}, pages of {P}; {N} calls queued)")
for name, us in rows:
    print(f"  {name:16s} {us:8.1f}" if isinstance(us, float) else f"  {name:16s} {us}")
