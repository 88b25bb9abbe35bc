#!/usr/bin/env python3
"""NumPy float64 reference for attention: the ground truth every chapter is checked against.

    O = softmax(Q K^T * scale [+ causal mask]) V,   LSE = log sum_j exp(s_ij)   (natural log)

computed in float64 from the very fp16 inputs the chapters get. Only NumPy is used.

  reference.py prepare --out DIR (--batch B --heads H --seqlen N --headdim D --seed S | --input SRC)
                       --scale F [--causal] [--no-ref]
      Write DIR/q.npy, k.npy, v.npy (generated inputs, unless --input gives them), then
      DIR/ref_<tag>_rows.npy, _o.npy, _lse.npy with tag = c<causal>_s<F>. Files that already
      exist are kept (the cache), new ones are written atomically.
  reference.py inputs --out DIR --batch B --heads H --seqlen N --headdim D --seed S [--qk-std X]
      Only write inputs; --qk-std scales Q and K so that logits grow like X^2.

Small shapes are checked on every query row. Above FULL_PAIRS (query, key) pairs a
deterministic sample of rows per (b, h) is used, so an N = 16k reference takes seconds.
"""
import argparse
import math
import os
import sys

import numpy as np

FULL_PAIRS = 1 << 26      # B*H*N*N up to this: every query row is checked
MIN_SAMPLED_ROWS = 8      # rows per (b, h) at the least when sampling
CHUNK_BYTES = 256 << 20   # float64 scores held at once while computing the reference


def make_inputs(batch, heads, seqlen, headdim, seed, qk_std=1.0):
    """Q, K, V ~ N(0, 1) (Q and K times qk_std), rounded to fp16. Same seed, same inputs."""
    rng = np.random.default_rng(seed)
    shape = (batch, heads, seqlen, headdim)
    q = (rng.standard_normal(shape, dtype=np.float32) * qk_std).astype(np.float16)
    k = (rng.standard_normal(shape, dtype=np.float32) * qk_std).astype(np.float16)
    v = rng.standard_normal(shape, dtype=np.float32).astype(np.float16)
    return q, k, v


def sample_rows(batch, heads, seqlen):
    """The query rows checked in every (b, h): all of them for small shapes, else a sample
    that always holds the first and last row (the causal extremes)."""
    pairs = batch * heads * seqlen * seqlen
    if pairs <= FULL_PAIRS:
        return np.arange(seqlen, dtype=np.int64)
    count = max(MIN_SAMPLED_ROWS, FULL_PAIRS // (batch * heads * seqlen))
    if count >= seqlen:
        return np.arange(seqlen, dtype=np.int64)
    rng = np.random.default_rng([seqlen, batch, heads])
    picked = rng.choice(np.arange(1, seqlen - 1), size=count - 2, replace=False)
    return np.unique(np.concatenate([[0, seqlen - 1], picked])).astype(np.int64)


def attention_reference(q, k, v, rows, causal, scale):
    """float64 O [B, H, R, D] and LSE [B, H, R] for the query rows `rows` of every (b, h)."""
    batch, heads, seqlen, headdim = q.shape
    q = q.reshape(batch * heads, seqlen, headdim)
    k = k.reshape(batch * heads, seqlen, headdim)
    v = v.reshape(batch * heads, seqlen, headdim)
    out = np.empty((batch * heads, len(rows), headdim), dtype=np.float64)
    lse = np.empty((batch * heads, len(rows)), dtype=np.float64)
    masked = np.arange(seqlen)[None, :] > rows[:, None] if causal else None
    per_head = len(rows) * seqlen * 8
    chunk = max(1, CHUNK_BYTES // max(per_head, 1))
    for h0 in range(0, batch * heads, chunk):
        h1 = min(h0 + chunk, batch * heads)
        s = np.matmul(q[h0:h1, rows].astype(np.float64),
                      k[h0:h1].astype(np.float64).transpose(0, 2, 1)) * scale
        if causal:
            s[:, masked] = -np.inf
        row_max = s.max(axis=-1, keepdims=True)
        p = np.exp(s - row_max)
        row_sum = p.sum(axis=-1, keepdims=True)
        out[h0:h1] = np.matmul(p, v[h0:h1].astype(np.float64)) / row_sum
        lse[h0:h1] = (row_max + np.log(row_sum))[..., 0]
    return (out.reshape(batch, heads, len(rows), headdim),
            lse.reshape(batch, heads, len(rows)))


def save_atomic(path, array):
    """Write an .npy so that a reader never sees half a file (write, then rename)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


def load_inputs(folder):
    arrays = []
    for name in ("q", "k", "v"):
        a = np.load(os.path.join(folder, f"{name}.npy"))
        if a.dtype != np.float16 or a.ndim != 4:
            raise ValueError(f"{folder}/{name}.npy: want a 4-D float16 array, got {a.ndim}-D {a.dtype}")
        arrays.append(a)
    if not arrays[0].shape == arrays[1].shape == arrays[2].shape:
        raise ValueError(f"{folder}: q, k, v shapes differ")
    return arrays


def ref_paths(folder, causal, scale_text):
    tag = f"c{int(causal)}_s{scale_text}"
    return {part: os.path.join(folder, f"ref_{tag}_{part}.npy") for part in ("rows", "o", "lse")}


def write_inputs(folder, args, qk_std=1.0):
    names = [os.path.join(folder, f"{n}.npy") for n in ("q", "k", "v")]
    if all(os.path.exists(n) for n in names):
        return
    arrays = make_inputs(args.batch, args.heads, args.seqlen, args.headdim, args.seed, qk_std)
    for name, array in zip(names, arrays):
        save_atomic(name, array)


def prepare(args):
    os.makedirs(args.out, exist_ok=True)
    if args.input is None:
        write_inputs(args.out, args)
    if args.no_ref:
        return
    paths = ref_paths(args.out, args.causal, args.scale)
    if all(os.path.exists(p) for p in paths.values()):
        return
    q, k, v = load_inputs(args.input or args.out)
    rows = sample_rows(*q.shape[:3])
    o, lse = attention_reference(q, k, v, rows, args.causal, float(args.scale))
    save_atomic(paths["o"], o)
    save_atomic(paths["lse"], lse)
    save_atomic(paths["rows"], rows)  # last: its presence means the set is complete


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("prepare", "inputs"):
        p = sub.add_parser(name)
        p.add_argument("--out", required=True)
        p.add_argument("--batch", type=positive_int)
        p.add_argument("--heads", type=positive_int)
        p.add_argument("--seqlen", type=positive_int)
        p.add_argument("--headdim", type=positive_int)
        p.add_argument("--seed", type=int, default=0)
    prep = sub.choices["prepare"]
    prep.add_argument("--input", help="folder with q.npy, k.npy, v.npy to use instead of generating")
    prep.add_argument("--scale", required=True, help="softmax scale, as text (it names the files)")
    prep.add_argument("--causal", action="store_true")
    prep.add_argument("--no-ref", action="store_true", help="only the inputs")
    sub.choices["inputs"].add_argument("--qk-std", type=float, default=1.0)
    args = parser.parse_args(argv)
    generated = args.command == "inputs" or args.input is None
    if generated and None in (args.batch, args.heads, args.seqlen, args.headdim):
        parser.error("give --batch, --heads, --seqlen and --headdim (or --input)")
    if args.command == "prepare":
        scale = float(args.scale)
        if not (scale > 0 and math.isfinite(scale)):
            parser.error(f"--scale must be a positive number, got {args.scale}")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "prepare":
            prepare(args)
        else:
            os.makedirs(args.out, exist_ok=True)
            write_inputs(args.out, args, args.qk_std)
    except (OSError, ValueError) as exc:
        print(f"reference.py: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
