#!/usr/bin/env python3
"""PyTorch anchors: what the chapters are measured against, on the very same fp16 inputs.

  torch_flash      torch SDPA, FLASH_ATTENTION backend (FlashAttention-2)
  torch_cudnn      torch SDPA, CUDNN_ATTENTION backend
  torch_efficient  torch SDPA, EFFICIENT_ATTENTION backend (memory-efficient, xformers)
  torch_eager      plain fp16 PyTorch: scores = q @ kᵀ * scale in fp16, causal mask by
                   masked_fill(-inf) with a mask built once per shape, softmax computed in
                   fp32 (softmax(dim=-1, dtype=float32)) and cast back to fp16, then @ v
  cudnn_fp8        cuDNN's FP8 attention (cuDNN frontend, graph.sdpa_fp8): Q, K, V in e4m3
                   with one scale per tensor, quantised once before the timed calls (as when
                   the previous layer writes FP8), O in e4m3 (all Hopper allows), its scale
                   from the amax of a first call (delayed scaling). Optional: skipped with a
                   one-line note when `import cudnn` (pip install nvidia-cudnn-frontend) fails.

Inputs and references come from the binaries' cache (<cache>/b{B}_h{H}_n{N}_d{D}_seed0),
created with common/reference.py when missing. Timing: CUDA events around each of `iters`
runs after `warmup` runs, median ms. A backend that is missing, has no kernel for the
shape or runs out of memory gives a SKIP row with its reason. Status is PASS when rel_l2
is within the fp16 tensor-core tolerance (3e-3, docs/design.md), else FAIL; for cudnn_fp8
within FP8_REL_L2_TOL (e4m3 inputs and an e4m3 output: ~6e-2 on N(0, 1) inputs).

  anchors.py [--batch B --heads H --seqlen N --headdim D] [--causal] [--warmup W] [--iters K]
             [--cache DIR]      prints the anchor rows as CSV (default: the headline shape)

PyTorch is imported inside the functions: importing this module needs only NumPy.
"""
import argparse
import contextlib
import csv
import os
import statistics
import sys
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import reference  # noqa: E402  (common/reference.py, NumPy only)
from results import ANCHORS, CSV_FIELDS, forward_tflops, make_row, shape_label  # noqa: E402
BACKENDS = {"torch_flash": "FLASH_ATTENTION", "torch_cudnn": "CUDNN_ATTENTION",
            "torch_efficient": "EFFICIENT_ATTENTION"}
REL_L2_TOL = 3e-3
FP8_REL_L2_TOL = 8e-2  # the e4m3 input floor (~4.7e-2 at D=128) plus O rounded to e4m3 (~2.6e-2)
E4M3_MAX = 448.0
SEED = 0


def scale_of(headdim):
    """The harness's default scale, 1/sqrtf(D) in float32."""
    return np.float32(1.0) / np.sqrt(np.float32(headdim))


def scale_text(headdim):
    """The scale as the reference file names print it (C's %.9g)."""
    return f"{float(scale_of(headdim)):.9g}"


def shape_folder(cache_dir, shape):
    """The binaries' cache folder of a shape (seed 0)."""
    return os.path.join(cache_dir, f"b{shape['batch']}_h{shape['heads']}_n{shape['seqlen']}"
                                   f"_d{shape['headdim']}_seed{SEED}")


def prepare(cache_dir, shape):
    """Make sure the inputs and reference exist; return the reference file paths."""
    folder = shape_folder(cache_dir, shape)
    argv = ["prepare", "--out", folder, "--batch", str(shape["batch"]), "--heads", str(shape["heads"]),
            "--seqlen", str(shape["seqlen"]), "--headdim", str(shape["headdim"]), "--seed", str(SEED),
            "--scale", scale_text(shape["headdim"])] + (["--causal"] if shape["causal"] else [])
    if reference.main(argv) != 0:
        raise RuntimeError(f"reference.py prepare failed for {folder}")
    return folder, reference.ref_paths(folder, shape["causal"], scale_text(shape["headdim"]))


def eager_forward(torch, q, k, v, causal, scale):
    """Typical eager attention in fp16, softmax in fp32."""
    n = q.shape[-2]
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1) if causal else None
    def forward():
        scores = q @ k.transpose(-1, -2) * scale
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
    return forward


def sdpa_forward(torch, q, k, v, causal, scale):
    """torch SDPA; the backend is chosen by the context it runs in."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return lambda: sdpa(q, k, v, is_causal=bool(causal), scale=scale)


def cudnn_frontend(torch):
    """The cuDNN frontend module, made to load the libcudnn PyTorch already loaded (it looks in
    LD_LIBRARY_PATH first), or ImportError with what is missing."""
    torch.backends.cudnn.version()  # loads PyTorch's libcudnn
    with open("/proc/self/maps") as maps:
        loaded = [line.split()[-1] for line in maps if "/libcudnn.so" in line]
    paths = os.environ.get("LD_LIBRARY_PATH", "")
    if loaded and os.path.dirname(loaded[0]) not in paths.split(os.pathsep):  # once, not once per shape
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([os.path.dirname(loaded[0]), paths])
    try:
        import cudnn
    except ImportError as exc:
        raise ImportError(f"cuDNN frontend not importable ({exc}): pip install nvidia-cudnn-frontend") from None
    return cudnn


def to_e4m3(torch, x):
    """x in e4m3 with one scale for the tensor, 448 / amax, and the descale amax / 448."""
    amax = float(x.abs().max())
    scale = E4M3_MAX / amax if amax > 0 else 1.0
    return (x.float() * scale).to(torch.float8_e4m3fn), 1.0 / scale


def cudnn_fp8_forward(torch, q, k, v, causal, scale):
    """cuDNN's FP8 attention on e4m3 copies of q, k, v; returns (forward, decode): forward runs
    the graph alone, decode turns its e4m3 O into float."""
    cudnn = cudnn_frontend(torch)
    handle = cudnn.create_handle()
    cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
    e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=fp32, compute_data_type=fp32, handle=handle)
    inputs = [to_e4m3(torch, x) for x in (q, k, v)]
    q_node, k_node, v_node = (graph.tensor(name=name, dim=list(x.shape), stride=list(x.stride()), data_type=e4m3)
                              for name, (x, _) in zip("QKV", inputs))
    names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
    scalars = {name: graph.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=fp32) for name in names}
    o_node, _, amax_s_node, amax_o_node = graph.sdpa_fp8(
        q=q_node, k=k_node, v=v_node, **scalars, attn_scale=scale, use_causal_mask=bool(causal),
        generate_stats=False, name="sdpa_fp8")
    o = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=q.device)
    o_node.set_output(True).set_dim(list(o.shape)).set_stride(list(o.stride())).set_data_type(e4m3)
    amax_s, amax_o = (torch.zeros(1, 1, 1, 1, dtype=torch.float32, device=q.device) for _ in range(2))
    for node in (amax_s_node, amax_o_node):
        node.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(fp32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    # P (in [0, 1]) is stored as 448 p; O's scale starts at 1 and is set from a first call's amax.
    values = dict(zip(names, (inputs[0][1], inputs[1][1], inputs[2][1], 1 / E4M3_MAX, E4M3_MAX, 1.0)))
    buffers = {name: torch.full((1, 1, 1, 1), value, dtype=torch.float32, device=q.device)
               for name, value in values.items()}
    pack = {q_node: inputs[0][0], k_node: inputs[1][0], v_node: inputs[2][0], o_node: o, amax_s_node: amax_s,
            amax_o_node: amax_o, **{scalars[name]: buffers[name] for name in names}}
    workspace = torch.empty(max(graph.get_workspace_size(), 1), dtype=torch.uint8, device=q.device)

    def forward():
        graph.execute(pack, workspace, handle=handle)
        return o
    forward()
    amax = float(amax_o)
    buffers["scale_o"].fill_(E4M3_MAX / amax if amax > 0 else 1.0)
    return forward, lambda out: out.float() / buffers["scale_o"]


def backend_context(impl):
    """The sdpa_kernel context that forces impl's backend (a no-op for eager and cuDNN FP8)."""
    if impl in ("torch_eager", "cudnn_fp8"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, BACKENDS[impl], None)
    if backend is None:
        raise RuntimeError(f"this PyTorch has no SDPBackend.{BACKENDS[impl]}")
    return sdpa_kernel(backend)


def median_ms(torch, forward, warmup, iters):
    """Median ms of `iters` runs, each between its own CUDA events, after `warmup` runs."""
    for _ in range(warmup):
        forward()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    stops = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, stop in zip(starts, stops):
        start.record()
        forward()
        stop.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(stop) for start, stop in zip(starts, stops))


def peak_bytes(torch, forward, inputs):
    """Device memory of one forward as the chapters count theirs: the inputs, plus the peak of
    everything the call allocates (scores, probabilities, output, workspace)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    forward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before + sum(t.numel() * t.element_size() for t in inputs)


def rel_l2_of(torch, out, rows, ref_o):
    """||o[:, :, rows] - ref|| / ||ref|| in float64."""
    got = out[:, :, torch.as_tensor(rows, device=out.device)].double().cpu().numpy()
    return float(np.linalg.norm(got - ref_o) / max(np.linalg.norm(ref_o), 1e-300))


def first_line(exc, caught=()):
    """A short reason: the exception's first line, plus what torch's warnings said."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    said = " ".join(" ".join(str(w.message).split()) for w in list(caught)[:3])
    return (text + (f" ({said})" if said else ""))[:300]


def measure(torch, impl, shape, tensors, ref, warmup, iters):
    """One anchor at one shape: a PASS/FAIL row, or a SKIP row when it cannot run."""
    q, k, v = tensors
    scale = float(scale_of(shape["headdim"]))
    make = {"torch_eager": eager_forward, "cudnn_fp8": cudnn_fp8_forward}.get(impl, sdpa_forward)
    fp8 = impl == "cudnn_fp8"
    out_of_memory = getattr(torch.cuda, "OutOfMemoryError", MemoryError)
    reason, caught = None, []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with backend_context(impl):
                forward = make(torch, q, k, v, shape["causal"], scale)
                forward, decode = forward if fp8 else (forward, lambda out: out)
                rel = rel_l2_of(torch, decode(forward()), *ref)
                device_bytes = None if fp8 else peak_bytes(torch, forward, tensors)
                ms = median_ms(torch, forward, warmup, iters)
    except out_of_memory as exc:
        reason = "out of memory: " + first_line(exc)
    except Exception as exc:  # the cuDNN frontend raises its own types; elsewhere only these mean "cannot run"
        if not fp8 and not isinstance(exc, (RuntimeError, ImportError)):
            raise
        reason = first_line(exc, caught)
    if reason:  # outside the except block, so the traceback no longer holds tensors
        torch.cuda.empty_cache()
        return make_row(impl, shape, "SKIP", note=reason)
    status = "PASS" if rel <= (FP8_REL_L2_TOL if fp8 else REL_L2_TOL) else "FAIL"
    return make_row(impl, shape, status, round(ms, 4), round(forward_tflops(shape, ms), 2),
                    float(f"{rel:.3e}"), dtype="fp8" if fp8 else "fp16", device_bytes=device_bytes)


def load_shape(torch, cache_dir, shape):
    """Device q, k, v and the reference (rows, o) of a shape."""
    folder, paths = prepare(cache_dir, shape)
    q, k, v = (torch.from_numpy(a).cuda() for a in reference.load_inputs(folder))
    return (q, k, v), (np.load(paths["rows"]), np.load(paths["o"]))


def run_anchors(shapes, cache_dir, warmup=3, iters=10):
    """Rows of every anchor on every shape (dicts with batch, heads, seqlen, headdim, causal)."""
    try:
        import torch
    except ImportError:
        print("PyTorch not found: anchor rows skipped", flush=True)
        return []
    rows = []
    for shape in shapes:
        print(f"anchors {shape_label(shape)}", flush=True)
        try:
            tensors, ref = load_shape(torch, cache_dir, shape)
        except (RuntimeError, OSError, ValueError) as exc:
            torch.cuda.empty_cache()
            rows += [make_row(impl, shape, "SKIP", note=first_line(exc)) for impl in ANCHORS]
            print(f"  inputs unavailable: {first_line(exc)}", flush=True)
            continue
        for impl in ANCHORS:
            result = measure(torch, impl, shape, tensors, ref, warmup, iters)
            rows.append(result)
            if result["status"] == "SKIP":
                print(f"  {impl:<16} SKIP  {result['note']}", flush=True)
            else:
                print(f"  {impl:<16} {result['status']:<5} {result['ms']:9.4f} ms "
                      f"{result['tflops']:7.1f} TFLOP/s  rel_l2 {result['rel_l2']:.1e}", flush=True)
        del tensors
        torch.cuda.empty_cache()
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--cache", default=os.environ.get("FA_CACHE") or os.path.join(os.path.dirname(HERE), ".cache"))
    args = parser.parse_args(argv)
    shape = {"batch": args.batch, "heads": args.heads, "seqlen": args.seqlen, "headdim": args.headdim,
             "causal": int(args.causal)}
    rows = run_anchors([shape], args.cache, args.warmup, args.iters)
    fields = CSV_FIELDS
    writer = csv.writer(sys.stdout, lineterminator="\n")
    writer.writerow(fields + ("note",))
    for r in rows:
        writer.writerow(["" if r.get(f) is None else r.get(f) for f in fields + ("note",)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
