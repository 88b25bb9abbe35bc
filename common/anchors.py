#!/usr/bin/env python3
"""PyTorch anchors: what the chapters are measured against, on the very same fp16 inputs.

  torch_flash      torch SDPA, FLASH_ATTENTION backend (FlashAttention-2)
  torch_cudnn      torch SDPA, CUDNN_ATTENTION backend
  torch_efficient  torch SDPA, EFFICIENT_ATTENTION backend (memory-efficient, xformers)
  torch_eager      plain fp16 PyTorch: scores = q @ kᵀ * scale in fp16, causal mask by
                   masked_fill(-inf) with a mask built once per shape, softmax computed in
                   fp32 (softmax(dim=-1, dtype=float32)) and cast back to fp16, then @ v

Inputs and references come from the binaries' cache (<cache>/b{B}_h{H}_n{N}_d{D}_seed0),
created with common/reference.py when missing. Timing: CUDA events around each of `iters`
runs after `warmup` runs, median ms. A backend that is missing, has no kernel for the
shape or runs out of memory gives a SKIP row with its reason. Status is PASS when rel_l2
is within the fp16 tensor-core tolerance (3e-3, docs/design.md), else FAIL.

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


def backend_context(impl):
    """The sdpa_kernel context that forces impl's backend (a no-op for eager)."""
    if impl == "torch_eager":
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
    make = eager_forward if impl == "torch_eager" else sdpa_forward
    out_of_memory = getattr(torch.cuda, "OutOfMemoryError", MemoryError)
    reason, caught = None, []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with backend_context(impl):
                forward = make(torch, q, k, v, shape["causal"], scale)
                rel = rel_l2_of(torch, forward(), *ref)
                ms = median_ms(torch, forward, warmup, iters)
    except out_of_memory as exc:
        reason = "out of memory: " + first_line(exc)
    except (RuntimeError, ImportError) as exc:
        reason = first_line(exc, caught)
    if reason:  # outside the except block, so the traceback no longer holds tensors
        torch.cuda.empty_cache()
        return make_row(impl, shape, "SKIP", note=reason)
    status = "PASS" if rel <= REL_L2_TOL else "FAIL"
    return make_row(impl, shape, status, round(ms, 4), round(forward_tflops(shape, ms), 2),
               float(f"{rel:.3e}"))


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
