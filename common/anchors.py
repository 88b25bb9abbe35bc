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

The backward (run_anchors(..., "backward"), the rows of <gpu>.backward.csv), for the four PyTorch
anchors (cuDNN's FP8 attention has none here): one forward on Q, K, V that require their gradient,
then the backward alone, torch.autograd.grad(o, (q, k, v), dO, retain_graph=True) between CUDA
events, median of `iters` after `warmup`; TFLOP/s with 2.5x the forward's FLOPs. dO and the float64
gradients are the harness's own (`reference.py backward` in the same cache folder: do.npy, and dQ,
dK, dV at their sampled rows); each gradient's rel L2 over those rows of every head (as the harness
measures a chapter's), PASS when each is within 3e-3 (the forward anchors' bound; a chapter's own
backward bound is 1e-3). device_bytes: the peak allocation through one forward and backward beyond
what was allocated before it (O, what autograd keeps, the backward's scratch, dQ, dK, dV), plus Q, K,
V and dO: everything the harness counts for a chapter's backward.

  anchors.py [--batch B --heads H --seqlen N --headdim D] [--causal] [--warmup W] [--iters K]
             [--cache DIR] [--backward]   prints the anchor rows as CSV (default: the headline shape)

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
from results import (ANCHOR_REL_L2_TOL, ANCHORS, BACKWARD_ANCHORS, BACKWARD_CSV_FIELDS, CSV_FIELDS,  # noqa: E402
                     GRAD_FIELDS, backward_tflops, forward_tflops, make_row, shape_label)
BACKENDS = {"torch_flash": "FLASH_ATTENTION", "torch_cudnn": "CUDNN_ATTENTION",
            "torch_efficient": "EFFICIENT_ATTENTION"}
REL_L2_TOL = ANCHOR_REL_L2_TOL
GRADS = ("dq", "dk", "dv")
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


def reference_args(cache_dir, shape, command="prepare"):
    """(folder, the reference.py command line) that makes a shape's inputs and references in the
    binaries' cache, as the harness runs it: "prepare" (the forward's), or "backward" (dO and the
    float64 gradients too)."""
    folder = shape_folder(cache_dir, shape)
    return folder, [command, "--out", folder, "--batch", str(shape["batch"]), "--heads", str(shape["heads"]),
                    "--seqlen", str(shape["seqlen"]), "--headdim", str(shape["headdim"]), "--seed", str(SEED),
                    "--scale", scale_text(shape["headdim"])] + (["--causal"] if shape["causal"] else [])


def prepare(cache_dir, shape, command="prepare"):
    """Make sure the inputs and reference exist (command "backward": the gradients' too); return the
    folder and the forward's reference file paths."""
    folder, argv = reference_args(cache_dir, shape, command)
    if reference.main(argv) != 0:
        raise RuntimeError(f"reference.py {command} failed for {folder}")
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


def median_ms(torch, forward, warmup, iters, flush=None):
    """Median ms of `iters` runs, each between its own CUDA events, after `warmup` runs; flush (where
    given) runs before each timed run, outside its events (l2_flusher)."""
    for _ in range(warmup):
        forward()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    stops = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, stop in zip(starts, stops):
        if flush:
            flush()
        start.record()
        forward()
        stop.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(stop) for start, stop in zip(starts, stops))


def l2_flusher(torch):
    """A write of twice the GPU's L2 (the harness's --flush-l2): what runs next reads its inputs from
    device memory."""
    buffer = torch.empty(2 * torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size,
                         dtype=torch.uint8, device="cuda")
    return lambda: buffer.fill_(1)


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


def attempt(torch, impl, run, lenient=False):
    """run() under impl's backend, torch's warnings recorded: (its result, None), or (None, the reason)
    when it cannot run: out of memory, or a RuntimeError or ImportError (no kernel for the shape, a
    missing backend); lenient: any exception (the cuDNN frontend raises its own types)."""
    out_of_memory = getattr(torch.cuda, "OutOfMemoryError", MemoryError)
    reason, caught = None, []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with backend_context(impl):
                return run(), None
    except out_of_memory as exc:
        reason = "out of memory: " + first_line(exc)
    except Exception as exc:
        if not lenient and not isinstance(exc, (RuntimeError, ImportError)):
            raise
        reason = first_line(exc, caught)
    torch.cuda.empty_cache()  # outside the except block, so the traceback no longer holds tensors
    return None, reason


def measure(torch, impl, shape, tensors, ref, warmup, iters, flush=None):
    """One anchor at one shape: a PASS/FAIL row, or a SKIP row when it cannot run (flush: median_ms's)."""
    q, k, v = tensors
    scale = float(scale_of(shape["headdim"]))
    make = {"torch_eager": eager_forward, "cudnn_fp8": cudnn_fp8_forward}.get(impl, sdpa_forward)
    fp8 = impl == "cudnn_fp8"

    def run():
        forward = make(torch, q, k, v, shape["causal"], scale)
        forward, decode = forward if fp8 else (forward, lambda out: out)
        rel = rel_l2_of(torch, decode(forward()), *ref)
        device_bytes = None if fp8 else peak_bytes(torch, forward, tensors)
        return rel, device_bytes, median_ms(torch, forward, warmup, iters, flush)
    done, reason = attempt(torch, impl, run, lenient=fp8)
    if reason:
        return make_row(impl, shape, "SKIP", note=reason)
    rel, device_bytes, ms = done
    status = "PASS" if rel <= (FP8_REL_L2_TOL if fp8 else REL_L2_TOL) else "FAIL"
    return make_row(impl, shape, status, round(ms, 4), round(forward_tflops(shape, ms), 2),
                    float(f"{rel:.3e}"), dtype="fp8" if fp8 else "fp16", device_bytes=device_bytes)


def tensor_bytes(tensors):
    """The bytes of some tensors' elements."""
    return sum(t.numel() * t.element_size() for t in tensors)


def measure_backward(torch, impl, shape, tensors, ref, warmup, iters):
    """One anchor's backward at one shape (tensors: q, k, v, dO; ref: GRADS' (rows, float64 values)):
    a PASS/FAIL row with each gradient's error, or a SKIP row when it cannot run."""
    q, k, v, d_o = tensors
    scale = float(scale_of(shape["headdim"]))
    make = eager_forward if impl == "torch_eager" else sdpa_forward

    def run():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]  # the same memory, now autograd leaves
        forward = make(torch, *leaves, shape["causal"], scale)
        # Memory first: one forward and backward, from what is allocated now (the inputs, eager's mask)
        # to the peak, which holds O, what autograd keeps for the backward, its scratch, dQ, dK and dV.
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        grads = torch.autograd.grad(forward(), leaves, d_o)
        torch.cuda.synchronize()
        device_bytes = torch.cuda.max_memory_allocated() - before + tensor_bytes(tensors)
        errors = [rel_l2_of(torch, grad, *ref[name]) for grad, name in zip(grads, GRADS)]
        del grads
        out = forward()  # kept, with its graph, for the timed backward passes
        ms = median_ms(torch, lambda: torch.autograd.grad(out, leaves, d_o, retain_graph=True), warmup, iters)
        return errors, device_bytes, ms
    done, reason = attempt(torch, impl, run)
    if reason:
        return make_row(impl, shape, "SKIP", note=reason, grads=(None,) * 3)
    errors, device_bytes, ms = done
    status = "PASS" if all(e <= REL_L2_TOL for e in errors) else "FAIL"  # a NaN fails
    worst = float("nan") if any(e != e for e in errors) else max(errors)  # as the harness's rel_l2: the largest
    return make_row(impl, shape, status, round(ms, 4), round(backward_tflops(shape, ms), 2), float(f"{worst:.3e}"),
                    device_bytes=device_bytes, grads=tuple(float(f"{e:.3e}") for e in errors))


def load_shape(torch, cache_dir, shape, backward=False):
    """Device q, k, v and the reference (rows, o) of a shape; backward: q, k, v and dO, and each
    gradient's reference {"dq": (rows, values), "dk": ..., "dv": ...}."""
    folder, paths = prepare(cache_dir, shape, "backward" if backward else "prepare")
    arrays = reference.load_inputs(folder)
    if not backward:
        return tuple(torch.from_numpy(a).cuda() for a in arrays), (np.load(paths["rows"]), np.load(paths["o"]))
    arrays.append(reference.load_grad_output(folder, arrays[0].shape))
    grad = reference.grad_paths(folder, shape["causal"], scale_text(shape["headdim"]))
    ref = {name: (np.load(grad["dq_rows" if name == "dq" else "dkv_rows"]), np.load(grad[name])) for name in GRADS}
    return tuple(torch.from_numpy(a).cuda() for a in arrays), ref


def progress(row):
    """One progress line of an anchor's row."""
    if row["status"] == "SKIP":
        return f"  {row['impl']:<16} SKIP  {row['note']}"
    grads = "".join(f"  {name} {row[field]:.1e}" for name, field in zip(GRADS, GRAD_FIELDS) if row.get(field) is not None)
    return (f"  {row['impl']:<16} {row['status']:<5} {row['ms']:9.4f} ms {row['tflops']:7.1f} TFLOP/s  "
            f"rel_l2 {row['rel_l2']:.1e}{grads}")


def run_anchors(shapes, cache_dir, warmup=3, iters=10, pass_="forward"):
    """Rows of every anchor on every shape (dicts with batch, heads, seqlen, headdim, causal): of the
    forward, or with pass_ "backward" of the backward (BACKWARD_ANCHORS: PyTorch's four)."""
    try:
        import torch
    except ImportError:
        print("PyTorch not found: anchor rows skipped", flush=True)
        return []
    backward = pass_ == "backward"
    impls, timer = (BACKWARD_ANCHORS, measure_backward) if backward else (ANCHORS, measure)
    grads = (None,) * 3 if backward else None
    rows = []
    for shape in shapes:
        print(f"anchors{' (backward)' if backward else ''} {shape_label(shape)}", flush=True)
        try:
            tensors, ref = load_shape(torch, cache_dir, shape, backward)
        except (RuntimeError, OSError, ValueError) as exc:
            torch.cuda.empty_cache()
            rows += [make_row(impl, shape, "SKIP", note=first_line(exc), grads=grads) for impl in impls]
            print(f"  inputs unavailable: {first_line(exc)}", flush=True)
            continue
        for impl in impls:
            result = timer(torch, impl, shape, tensors, ref, warmup, iters)
            rows.append(result)
            print(progress(result), flush=True)
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
    parser.add_argument("--backward", action="store_true", help="the backward pass (PyTorch's four anchors)")
    parser.add_argument("--cache", default=os.environ.get("FA_CACHE") or os.path.join(os.path.dirname(HERE), ".cache"))
    args = parser.parse_args(argv)
    shape = {"batch": args.batch, "heads": args.heads, "seqlen": args.seqlen, "headdim": args.headdim,
             "causal": int(args.causal)}
    rows = run_anchors([shape], args.cache, args.warmup, args.iters, "backward" if args.backward else "forward")
    fields = BACKWARD_CSV_FIELDS if args.backward else CSV_FIELDS
    writer = csv.writer(sys.stdout, lineterminator="\n")
    writer.writerow(fields + ("note",))
    for r in rows:
        writer.writerow(["" if r.get(f) is None else r.get(f) for f in fields + ("note",)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
