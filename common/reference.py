#!/usr/bin/env python3
"""NumPy float64 reference for attention: the ground truth every chapter is checked against.

    O = softmax(Q K^T * scale [+ causal mask]) V,   LSE = log sum_j exp(s_ij)   (natural log)

computed in float64 from the very fp16 inputs the chapters get. Only NumPy is used.

  reference.py prepare --out DIR (--batch B --heads H --seqlen N --headdim D --seed S | --input SRC)
                       --scale F [--causal] [--no-ref]
      Write DIR/q.npy, k.npy, v.npy (generated inputs, unless --input gives them), then
      DIR/ref_<tag>_rows.npy, _o.npy, _lse.npy with tag = c<causal>_s<F>. Files that already
      exist are kept (the cache), new ones are written atomically.
      --fp8-floor QR KR [R] also writes DIR/ref_<tag>_fp8floor<QR>x<KR>[r<R>].npy: [rel L2 of
      O, max abs error of LSE] that quantising Q, K, V to e4m3 alone causes, with one scale per
      QR rows of Q and per KR rows of K and V in each (b, h), Q and K scaled to |x| <= R
      (default 448, e4m3's largest; V always to 448), as the FP8 chapter quantises (the harness
      passes the chapter's tiles and range): what it is measured against.
  reference.py inputs --out DIR --batch B --heads H --seqlen N --headdim D --seed S [--qk-std X]
                      [--outliers F]
      Only write inputs; --qk-std scales Q and K so that logits grow like X^2; --outliers
      sets a fraction F of the entries of Q and K to +-U(10, 100).
  reference.py floor --input DIR [--causal] [--scale F] [--q-rows R] [--kv-rows R] [--qk-range R]
      Print the e4m3 input-quantisation floor of DIR's inputs, scales per (b, h) and per tile
      (R rows of Q, of K and V, Q and K to |x| <= R; default the FP8 chapter's).

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
FP8_Q_ROWS = 128                   # the FP8 chapter's scale granularity as built by default: one
FP8_KV_ROWS = {64: 128, 128: 256}  # scale per 128 rows of Q and one per key tile of K and of V (by
                                   # head dim), in each (b, h)
FP8_QK_RANGE = {64: 448, 128: 16}  # and the |e4m3| Q and K are scaled to (16 where it keeps S in fp16)


def make_inputs(batch, heads, seqlen, headdim, seed, qk_std=1.0, outliers=0.0):
    """Q, K, V ~ N(0, 1) (Q and K times qk_std), rounded to fp16. Same seed, same inputs.
    outliers: that fraction of the entries of Q and of K become +-U(10, 100)."""
    rng = np.random.default_rng(seed)
    shape = (batch, heads, seqlen, headdim)
    q = rng.standard_normal(shape, dtype=np.float32) * qk_std
    k = rng.standard_normal(shape, dtype=np.float32) * qk_std
    v = rng.standard_normal(shape, dtype=np.float32)
    if outliers > 0:
        for x in (q, k):
            hit = rng.random(shape) < outliers
            x[hit] = rng.choice([-1.0, 1.0], hit.sum()) * rng.uniform(10, 100, hit.sum())
    return q.astype(np.float16), k.astype(np.float16), v.astype(np.float16)


# --- FP8 e4m3, emulated: 1 sign, 4 exponent (bias 7), 3 mantissa bits ---------------------
E4M3_MAX = 448.0        # 1.75 * 2^8; 0x7f and 0xff are NaN, there is no infinity
E4M3_MIN_EXP = -6       # smallest normal exponent; below 2^-6 subnormals step by 2^-9
E4M3_MANTISSA_BITS = 3


def e4m3_round(x):
    """x rounded to e4m3 as cvt.rn.satfinite does it: to nearest, ties to even, on 3 mantissa
    bits (2^-9 steps among the subnormals), +-Inf and anything beyond 448 to +-448, NaN kept."""
    x = np.asarray(x, dtype=np.float64)
    mag = np.abs(x)
    finite = np.isfinite(mag) & (mag > 0)
    exponent = np.full(mag.shape, float(E4M3_MIN_EXP))
    exponent[finite] = np.maximum(np.floor(np.log2(mag[finite])), E4M3_MIN_EXP)
    quantum = np.exp2(exponent - E4M3_MANTISSA_BITS)
    rounded = np.where(finite, np.round(mag / quantum) * quantum, mag)  # np.round: half to even
    rounded = np.where(np.isinf(mag), E4M3_MAX, np.minimum(rounded, E4M3_MAX))
    return np.copysign(rounded, x)


def e4m3_decode(codes):
    """The float64 value of each e4m3 code (uint8)."""
    codes = np.asarray(codes, dtype=np.uint8).astype(np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 0x7
    value = np.where(exponent == 0, mantissa * 2.0 ** (E4M3_MIN_EXP - E4M3_MANTISSA_BITS),
                     (1 + mantissa / 8.0) * np.exp2(exponent - 7.0))
    value = np.where((exponent == 0xF) & (mantissa == 0x7), np.nan, value)
    return sign * value


def e4m3_encode(x):
    """The e4m3 code (uint8) of each value of x after e4m3_round; NaN becomes 0x7f."""
    rounded = e4m3_round(x)
    mag = np.abs(rounded)
    normal = mag >= 2.0 ** E4M3_MIN_EXP
    safe = np.where(normal, mag, 1.0)
    exponent = np.where(normal, np.floor(np.log2(safe)) + 7, 0)
    mantissa = np.where(normal, (safe / np.exp2(exponent - 7) - 1) * 8, mag / 2.0 ** (E4M3_MIN_EXP - 3))
    mantissa = np.where(np.isnan(rounded), 0, mantissa)
    codes = (np.signbit(rounded).astype(np.int64) << 7) | (exponent.astype(np.int64) << 3) | \
        np.rint(mantissa).astype(np.int64)
    return np.where(np.isnan(rounded), 0x7F, codes).astype(np.uint8)


def quantize_e4m3(x, block_rows=None, to=E4M3_MAX):
    """x [B, H, N, D] through e4m3 and back, as FP8 chapters quantise it: scale = to / amax
    (to: 448, e4m3's largest, unless a chapter keeps its values smaller) per (b, h) (or per
    block of block_rows rows), x * scale in float32, rounded to e4m3; returns the float64
    values the e4m3 codes stand for (code / scale)."""
    batch, heads, seqlen, headdim = x.shape
    rows = block_rows or seqlen
    blocks = -(-seqlen // rows)
    padded = np.zeros((batch, heads, blocks * rows, headdim), np.float32)
    padded[:, :, :seqlen] = x
    blocked = padded.reshape(batch, heads, blocks, rows * headdim)
    amax = np.abs(blocked).max(axis=-1, keepdims=True)
    scale = np.where(amax > 0, np.float32(to) / np.where(amax > 0, amax, 1), np.float32(1))
    codes = e4m3_round(blocked * scale.astype(np.float32))
    out = (codes / scale.astype(np.float64)).reshape(batch, heads, blocks * rows, headdim)
    return out[:, :, :seqlen]


def fp8_floor(q, k, v, rows, causal, scale, ref_o, ref_lse, q_rows=None, kv_rows=None, qk_range=E4M3_MAX):
    """[rel L2 of O, max abs error of LSE] of exact attention on e4m3-quantised inputs against
    exact attention on the inputs themselves: the error no FP8 kernel can go below. Scales per
    q_rows rows of Q and kv_rows rows of K and V (None: one per (b, h)), Q and K scaled to
    |x| <= qk_range, V to 448."""
    quantized = [quantize_e4m3(q, q_rows, qk_range), quantize_e4m3(k, kv_rows, qk_range),
                 quantize_e4m3(v, kv_rows)]
    o, lse = attention_reference(*quantized, rows, causal, scale)
    rel = np.linalg.norm(o - ref_o) / max(np.linalg.norm(ref_o), np.finfo(np.float64).tiny)
    return np.array([rel, np.abs(lse - ref_lse).max()], dtype=np.float64)


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


def fp8_floor_part(q_rows, kv_rows, qk_range=int(E4M3_MAX)):
    """The floor file's part of the name (the harness builds the same from the chapter's tiles
    and range; a range of 448 is not named)."""
    return f"fp8floor{q_rows}x{kv_rows}" + (f"r{qk_range}" if qk_range != int(E4M3_MAX) else "")


def ref_paths(folder, causal, scale_text, floor_rows=None):
    """The reference files of a tag; with floor_rows (Q's, K's and V's rows per scale), the floor's."""
    tag = f"c{int(causal)}_s{scale_text}"
    parts = ("rows", "o", "lse") + ((fp8_floor_part(*floor_rows),) if floor_rows else ())
    return {part: os.path.join(folder, f"ref_{tag}_{part}.npy") for part in parts}


def write_inputs(folder, args, qk_std=1.0, outliers=0.0):
    names = [os.path.join(folder, f"{n}.npy") for n in ("q", "k", "v")]
    if all(os.path.exists(n) for n in names):
        return
    arrays = make_inputs(args.batch, args.heads, args.seqlen, args.headdim, args.seed, qk_std, outliers)
    for name, array in zip(names, arrays):
        save_atomic(name, array)


def prepare(args):
    os.makedirs(args.out, exist_ok=True)
    if args.input is None:
        write_inputs(args.out, args)
    if args.no_ref:
        return
    paths = ref_paths(args.out, args.causal, args.scale, args.fp8_floor)
    floor_path = args.fp8_floor and paths[fp8_floor_part(*args.fp8_floor)]
    have_ref = all(os.path.exists(paths[p]) for p in ("rows", "o", "lse"))
    if have_ref and (not floor_path or os.path.exists(floor_path)):
        return
    q, k, v = load_inputs(args.input or args.out)
    if have_ref:
        rows, o, lse = (np.load(paths[p]) for p in ("rows", "o", "lse"))
    else:
        rows = sample_rows(*q.shape[:3])
        o, lse = attention_reference(q, k, v, rows, args.causal, float(args.scale))
    if args.fp8_floor:
        floor = fp8_floor(q, k, v, rows, args.causal, float(args.scale), o, lse, *args.fp8_floor)
        save_atomic(floor_path, floor)
    if not have_ref:
        save_atomic(paths["o"], o)
        save_atomic(paths["lse"], lse)
        save_atomic(paths["rows"], rows)  # last: its presence means the set is complete


def print_floor(args):
    """The e4m3 floor of a folder's inputs, per (b, h) scales and per tile of rows."""
    q, k, v = load_inputs(args.input)
    scale = float(args.scale) if args.scale else 1 / math.sqrt(q.shape[-1])
    rows = sample_rows(*q.shape[:3])
    o, lse = attention_reference(q, k, v, rows, args.causal, scale)
    kv_rows = args.kv_rows or FP8_KV_ROWS.get(q.shape[-1], 128)
    qk_range = args.qk_range or FP8_QK_RANGE.get(q.shape[-1], int(E4M3_MAX))
    for label, tiles in (("per (b, h)", (None, None, int(E4M3_MAX))),
                         (f"per {args.q_rows} rows of Q, {kv_rows} of K and V, Q and K to |x| <= {qk_range}",
                          (args.q_rows, kv_rows, qk_range))):
        rel, lse_err = fp8_floor(q, k, v, rows, args.causal, scale, o, lse, *tiles)
        print(f"e4m3 input floor, scales {label}: rel L2 of O {rel:.3e}, LSE max abs {lse_err:.3e}")


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("floor")
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
    prep.add_argument("--fp8-floor", nargs="+", type=positive_int, metavar="Q_ROWS KV_ROWS [QK_RANGE]",
                      help="also the e4m3 input-quantisation floor, scales per Q_ROWS rows of Q, KV_ROWS of K "
                           "and V, Q and K to |x| <= QK_RANGE (default 448)")
    sub.choices["inputs"].add_argument("--qk-std", type=float, default=1.0)
    sub.choices["inputs"].add_argument("--outliers", type=float, default=0.0,
                                       help="fraction of Q and K entries set to +-U(10, 100)")
    floor = sub.choices["floor"]
    floor.add_argument("--input", required=True)
    floor.add_argument("--causal", action="store_true")
    floor.add_argument("--scale", help="softmax scale (default 1/sqrt(D))")
    floor.add_argument("--q-rows", type=positive_int, default=FP8_Q_ROWS)
    floor.add_argument("--kv-rows", type=positive_int, help="default: the FP8 chapter's key tile at this head dim")
    floor.add_argument("--qk-range", type=positive_int, help="default: the FP8 chapter's at this head dim")
    args = parser.parse_args(argv)
    if args.command == "floor":
        return args
    generated = args.command == "inputs" or args.input is None
    if generated and None in (args.batch, args.heads, args.seqlen, args.headdim):
        parser.error("give --batch, --heads, --seqlen and --headdim (or --input)")
    if args.command == "prepare":
        if args.fp8_floor and len(args.fp8_floor) not in (2, 3):
            parser.error(f"--fp8-floor takes Q_ROWS KV_ROWS [QK_RANGE], got {len(args.fp8_floor)} numbers")
        if args.fp8_floor and len(args.fp8_floor) == 2:
            args.fp8_floor.append(int(E4M3_MAX))
        scale = float(args.scale)
        if not (scale > 0 and math.isfinite(scale)):
            parser.error(f"--scale must be a positive number, got {args.scale}")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "prepare":
            prepare(args)
        elif args.command == "floor":
            print_floor(args)
        else:
            os.makedirs(args.out, exist_ok=True)
            write_inputs(args.out, args, args.qk_std, args.outliers)
    except (OSError, ValueError) as exc:
        print(f"reference.py: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
