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
                      [--outliers F] [--grad]
      Only write inputs; --qk-std scales Q and K so that logits grow like X^2; --outliers
      sets a fraction F of the entries of Q and K to +-U(10, 100); --grad also writes
      DIR/do.npy, dO ~ N(0, 1) in fp16 from a stream of the seed of its own (Q, K, V unchanged).
  reference.py backward (prepare's options)
      prepare's files, DIR/do.npy as inputs --grad writes it (with --input: SRC/do.npy, fp16 of
      Q's shape, is read), and the float64 gradients of L = sum(O * dO), same tag, same cache:
        ref_<tag>_dq_rows.npy   int64   [RQ]            the query rows of dQ, sorted
        ref_<tag>_dq.npy        float64 [B, H, RQ, D]   [b, h, i] is dQ[b, h, dq_rows[i]]
        ref_<tag>_dkv_rows.npy  int64   [RK]            the key rows of dK and dV, sorted
        ref_<tag>_dk.npy        float64 [B, H, RK, D]   [b, h, i] is dK[b, h, dkv_rows[i]]
        ref_<tag>_dv.npy        float64 [B, H, RK, D]   and dV's
        ref_<tag>_delta.npy     float64 [B, H, N]       Delta = rowsum(dO * O), every row
      The rows are the same in every (b, h) and every row (0 .. N-1) where the forward checks
      every row; _dkv_rows.npy is written last, so its presence means the set is complete.
      float64, as O and LSE are: the reference adds no rounding of its own. Sampled rows are
      stored packed with their indices, as the forward's are, not NaN-padded to [B, H, N, D]:
      a checker walks the listed rows as it does O's (4.5 MB a tensor at B=1 H=16 N=16k D=128,
      not 256 MB). dO is not in the tag: like Q, K and V, a folder holds one.
  reference.py floor --input DIR [--causal] [--scale F] [--q-rows R] [--kv-rows R] [--qk-range R]
      Print the e4m3 input-quantisation floor of DIR's inputs, scales per (b, h) and per tile
      (R rows of Q, of K and V, Q and K to |x| <= R; default the FP8 chapter's).
  reference.py decode --out DIR --batch B --heads HQ --kv-heads HKV --new NQ --headdim D
                      --page-size P --lengths L[,L...] [--seed S] --scale F [--no-ref] [--kv-cache e4m3]
      The decoding problem's inputs, DIR/q.npy, k_pool.npy, v_pool.npy, block_table.npy and
      lengths.npy (make_decode_inputs), then its float64 reference DIR/ref_decode_s<F>_o.npy and
      _lse.npy (decode_paths), each kept where it exists. --kv-cache e4m3 also writes the
      reference of the cache quantised to e4m3 as the harness's --kv-cache e4m3 quantises it
      (quantize_cache_e4m3: a scale per KV head), DIR/ref_decode_s<F>_e4m3_o.npy and _lse.npy.
  reference.py decode --input SRC --out DIR --scale F [--kv-cache e4m3]
      The reference alone (with --kv-cache e4m3, the e4m3 cache's too), of the inputs in SRC
      (those five files, a folder of one's own: the table and lengths int32 or int64), into DIR;
      a folder that does not fit together is refused (load_decode_inputs).

Small shapes are checked on every query row. Above FULL_PAIRS (query, key) pairs a
deterministic sample of rows per (b, h) is used, so an N = 16k reference takes seconds.
The gradients sample query rows (dQ) and key rows (dK, dV) the same way, and also take the
rows either side of 64- and 128-row tile edges (where a causal mask cuts a tile). They are
exact: a key row's dK and dV need P and dS over every query, so LSE and Delta are computed
for every row, blockwise (O(N^2 D) work per (b, h), O(tile N) memory): about 6 s per (b, h)
at N = 16k, D = 128 on two cores (3.5 s causal), some 300 MB beside the inputs.

decode_reference(q, k_cache, v_cache, lengths, scale) is the decoding problem (docs/design.md):
a few new queries per sequence against a ragged KV cache, grouped-query heads; the harness's
decode mode (--decode) runs the decode command for it.
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


# --- decoding: a few new queries against a KV cache -----------------------------------------
def decode_reference(q, k_cache, v_cache, lengths, scale):
    """float64 O [B, Hq, Nq, D] and LSE [B, Hq, Nq] of Nq new queries per sequence against its KV
    cache. q: [B, Hq, Nq, D]; k_cache, v_cache: [B, Hkv, capacity, D], of which sequence b uses its
    first lengths[b] positions; the Nq new tokens are already written as its last Nq, so query j of
    sequence b is position lengths[b] - Nq + j and sees keys 0 .. lengths[b] - Nq + j (causal among
    the new tokens, as speculative decoding's verify step needs; Nq = 1 sees the whole cache). Query
    head h reads KV head h // (Hq // Hkv): grouped-query attention, Hq a multiple of Hkv.
    ValueError for shapes that do not fit together."""
    batch, q_heads, new, headdim = q.shape
    kv_batch, kv_heads, capacity, kv_dim = k_cache.shape
    lengths = np.asarray(lengths)
    if v_cache.shape != k_cache.shape or kv_batch != batch or kv_dim != headdim:
        raise ValueError(f"q {q.shape}, k_cache {k_cache.shape}, v_cache {v_cache.shape}: expected [B, Hq, Nq, D] "
                         f"and two caches [B, Hkv, capacity, D]")
    if kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads over {kv_heads} KV heads: Hq must be a multiple of Hkv")
    if lengths.shape != (batch,) or (lengths < new).any() or (lengths > capacity).any():
        raise ValueError(f"lengths {lengths.tolist()}: expected one per sequence, each from Nq = {new} to the "
                         f"capacity {capacity}")
    group = q_heads // kv_heads
    out = np.empty((batch, q_heads, new, headdim), dtype=np.float64)
    lse = np.empty((batch, q_heads, new), dtype=np.float64)
    for b in range(batch):
        length = int(lengths[b])
        k = k_cache[b, :, :length].astype(np.float64)                        # [Hkv, L, D]
        v = v_cache[b, :, :length].astype(np.float64)
        qb = q[b].astype(np.float64).reshape(kv_heads, group, new, headdim)  # head h = kv * group + g
        s = np.einsum("hgnd,hld->hgnl", qb, k) * scale
        hidden = np.arange(length)[None, :] > (length - new + np.arange(new))[:, None]  # [Nq, L]
        s[:, :, hidden] = -np.inf
        row_max = s.max(axis=-1, keepdims=True)
        p = np.exp(s - row_max)
        row_sum = p.sum(axis=-1, keepdims=True)
        out[b] = (np.einsum("hgnl,hld->hgnd", p, v) / row_sum).reshape(q_heads, new, headdim)
        lse[b] = (row_max + np.log(row_sum))[..., 0].reshape(q_heads, new)
    return out, lse


# --- decoding's inputs: a paged KV cache ------------------------------------------------------
DECODE_SEED_STREAM = 2  # q and the cache come from default_rng([seed, 2])
DECODE_INPUTS = ("q", "k_pool", "v_pool", "block_table", "lengths")  # written in this order: lengths last
# What each file of a decoding folder may be (--input: a user's own): its ndim and dtypes.
DECODE_FILE_TYPES = {"q": (4, "float16"), "k_pool": (4, "float16"), "v_pool": (4, "float16"),
                     "block_table": (2, "int32 or int64"), "lengths": (1, "int32 or int64")}


def decode_pages(lengths, page_size):
    """Pages each sequence uses (ceil(length / P)), the pool's pages (their sum) and the block table's
    width (the most any sequence uses)."""
    used = [-(-int(n) // page_size) for n in lengths]
    return used, sum(used), max(used)


def make_decode_inputs(batch, q_heads, kv_heads, new, headdim, page_size, lengths, seed):
    """q [B, Hq, Nq, D] and a paged cache holding `lengths` tokens per sequence: k_pool, v_pool
    [pages, Hkv, P, D] (fp16 N(0, 1)), block_table [B, max_pages] int64 (each sequence's pages, in a
    seeded random order of the pool, so that no sequence's pages lie in order; -1 past its last) and
    lengths [B] int64."""
    rng = np.random.default_rng([seed, DECODE_SEED_STREAM])
    used, pages, max_pages = decode_pages(lengths, page_size)
    q = rng.standard_normal((batch, q_heads, new, headdim)).astype(np.float16)
    k_pool = rng.standard_normal((pages, kv_heads, page_size, headdim)).astype(np.float16)
    v_pool = rng.standard_normal((pages, kv_heads, page_size, headdim)).astype(np.float16)
    order = rng.permutation(pages)
    table = np.full((batch, max_pages), -1, np.int64)
    at = 0
    for b, n in enumerate(used):
        table[b, :n] = order[at:at + n]
        at += n
    return q, k_pool, v_pool, table, np.asarray(lengths, np.int64)


def gather_cache(pool, table, lengths):
    """The contiguous caches [B, Hkv, capacity, D] that a paged pool [pages, Hkv, P, D] holds: sequence
    b's pages in its block table's order, zeros past its length."""
    batch, max_pages = table.shape
    _, kv_heads, page_size, headdim = pool.shape
    out = np.zeros((batch, kv_heads, max_pages * page_size, headdim), pool.dtype)
    for b in range(batch):
        for i in range(-(-int(lengths[b]) // page_size)):
            out[b, :, i * page_size:(i + 1) * page_size] = pool[table[b, i]]
    return out


def decode_paths(folder, scale_text, kv_cache="fp16"):
    """The reference files of decoding at a scale, of the fp16 cache or of the e4m3 one: O and LSE (written in
    that order)."""
    tag = "" if kv_cache == "fp16" else f"_{kv_cache}"
    return {part: os.path.join(folder, f"ref_decode_s{scale_text}{tag}_{part}.npy") for part in ("o", "lse")}


def quantize_cache_e4m3(pool):
    """An fp16 pool [pages, Hkv, P, D] as the harness's --kv-cache e4m3 quantises it: per KV head h, scale_h =
    max |x| over h's rows of every page / 448 (1 where they are all zero), then e4m3_round(x / scale_h), both
    in float32. Returns the e4m3 values (float64, before the scale) and the scales (float32 [Hkv])."""
    x = np.asarray(pool).astype(np.float32)
    amax = np.abs(x).max(axis=(0, 2, 3))
    scales = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1)).astype(np.float32)
    return e4m3_round(x / scales[None, :, None, None]), scales


def dequantize_cache(pool, kv_cache):
    """The values a cache of this format holds for an fp16 pool: the pool itself (fp16), or its e4m3 values
    times their KV head's scale, in float64 (e4m3)."""
    if kv_cache == "fp16":
        return pool
    values, scales = quantize_cache_e4m3(pool)
    return values * scales.astype(np.float64)[None, :, None, None]


def load_decode_inputs(folder):
    """A decoding folder's five files (DECODE_INPUTS), checked to fit together: q float16 [B, Hq, Nq, D],
    k_pool and v_pool float16 [pages, Hkv, P, D] (q's D), block_table [B, max_pages] and lengths [B], int32 or
    int64, each length from Nq to the capacity max_pages * P, and the table entries a sequence uses (its first
    ceil(length / P)) pages of the pool. ValueError naming the file otherwise (Hq over Hkv: decode_reference's)."""
    paths = {name: os.path.join(folder, f"{name}.npy") for name in DECODE_INPUTS}
    q, k_pool, v_pool, table, lengths = arrays = [np.load(paths[name]) for name in DECODE_INPUTS]
    for name, a in zip(DECODE_INPUTS, arrays):
        ndim, words = DECODE_FILE_TYPES[name]
        if a.dtype.name not in words.split(" or ") or a.ndim != ndim:
            raise ValueError(f"{paths[name]}: want a {ndim}-D {words} array, got {a.ndim}-D {a.dtype}")
    if 0 in q.shape + k_pool.shape + table.shape:
        raise ValueError(f"{folder}: q {q.shape}, k_pool {k_pool.shape}, block_table {table.shape}: every dimension "
                         f"at least 1")
    batch, _, new, headdim = q.shape
    _, _, page_size, pool_dim = k_pool.shape
    if v_pool.shape != k_pool.shape or pool_dim != headdim:
        raise ValueError(f"{folder}: q {q.shape}, k_pool {k_pool.shape}, v_pool {v_pool.shape}: expected [B, Hq, Nq, "
                         f"D] and two pools [pages, Hkv, P, D] of one shape, q's D")
    if table.shape[0] != batch or lengths.shape != (batch,):
        raise ValueError(f"{folder}: q {q.shape}, block_table {table.shape}, lengths {lengths.shape}: expected "
                         f"[B, max_pages] and [B], q's B")
    capacity = table.shape[1] * page_size
    if (lengths < new).any() or (lengths > capacity).any():
        raise ValueError(f"{paths['lengths']}: {lengths.tolist()[:8]}: expected each from Nq = {new} to the capacity "
                         f"{capacity} ({table.shape[1]} pages of {page_size})")
    for b, used in enumerate(decode_pages(lengths, page_size)[0]):
        past = np.flatnonzero((table[b, :used] < 0) | (table[b, :used] >= k_pool.shape[0]))
        if past.size:
            raise ValueError(f"{paths['block_table']}: sequence {b}: entry {past[0]} names page "
                             f"{table[b, past[0]]}, past the pool of {k_pool.shape[0]} pages")
    return q, k_pool, v_pool, table, lengths


def write_decode_reference(folder, out, scale_text, reuse=False, kv_cache="fp16"):
    """decode_reference of the decoding folder `folder` (its pages, as the cache format kv_cache holds them,
    gathered into caches) as O and LSE in `out` (decode_paths); reuse: not where they are there already (out
    holds that folder's inputs: the generated path's cache)."""
    paths = decode_paths(out, scale_text, kv_cache)
    if reuse and all(os.path.exists(path) for path in paths.values()):
        return
    q, k_pool, v_pool, table, lengths = load_decode_inputs(folder)
    k_pool, v_pool = dequantize_cache(k_pool, kv_cache), dequantize_cache(v_pool, kv_cache)
    o, lse = decode_reference(q, gather_cache(k_pool, table, lengths), gather_cache(v_pool, table, lengths), lengths,
                              float(scale_text))
    os.makedirs(out, exist_ok=True)
    save_atomic(paths["o"], o)
    save_atomic(paths["lse"], lse)  # last: its presence means the set is complete


def decode(args):
    """Decoding's inputs in args.out (generated once) and its float64 reference O and LSE (with --kv-cache e4m3,
    the e4m3 cache's too); with args.input, the reference alone, of that folder's inputs, in args.out."""
    caches = ("fp16", "e4m3") if args.kv_cache == "e4m3" else ("fp16",)
    if args.input is not None:
        for kv_cache in caches:
            write_decode_reference(args.input, args.out, args.scale, kv_cache=kv_cache)
        return
    os.makedirs(args.out, exist_ok=True)
    inputs = {name: os.path.join(args.out, f"{name}.npy") for name in DECODE_INPUTS}
    if not all(os.path.exists(path) for path in inputs.values()):
        arrays = make_decode_inputs(args.batch, args.heads, args.kv_heads, args.new, args.headdim, args.page_size,
                                    args.lengths, args.seed)
        for name, array in zip(DECODE_INPUTS, arrays):
            save_atomic(inputs[name], array)
    for kv_cache in caches if not args.no_ref else ():
        write_decode_reference(args.out, args.out, args.scale, reuse=True, kv_cache=kv_cache)


# --- the backward pass: gradients of O given dO ----------------------------------------------
GRAD_SEED_STREAM = 1        # dO comes from default_rng([seed, 1]): Q, K, V stay make_inputs'
GRAD_TILE_EDGES = (64, 128)  # the chapters' query and key tiles: the rows either side of the first and
GRAD_EDGE_PICKS = 4          # last edge of each are sampled, and of this many random 64-row edges
GRAD_LIVE_SCORES = 3         # float64 [tile, N] arrays alive at once in a backward step


def make_grad_output(batch, heads, seqlen, headdim, seed):
    """dO ~ N(0, 1) rounded to fp16, from a stream of the seed of its own (same seed, same dO;
    Q, K and V are make_inputs' whether or not dO is drawn)."""
    rng = np.random.default_rng([seed, GRAD_SEED_STREAM])
    return rng.standard_normal((batch, heads, seqlen, headdim), dtype=np.float32).astype(np.float16)


def tile_edge_rows(seqlen, rng):
    """The rows either side of the edges of GRAD_TILE_EDGES tiles: the first and the last edge
    of each tile size and GRAD_EDGE_PICKS random edges of the smallest (where a causal mask
    starts and ends a diagonal tile)."""
    edges = []
    for tile in GRAD_TILE_EDGES:
        edges += [tile, (seqlen - 1) // tile * tile]
    smallest = GRAD_TILE_EDGES[0]
    count = (seqlen - 1) // smallest
    if count > 0:
        edges += list(rng.choice(np.arange(1, count + 1), size=min(GRAD_EDGE_PICKS, count), replace=False) * smallest)
    rows = np.array([r for e in edges if e > 0 for r in (e - 1, e)], dtype=np.int64)
    return rows[rows < seqlen]


def sample_grad_rows(batch, heads, seqlen, which):
    """The rows of the gradients checked in every (b, h): of dQ (which="q", query rows) or of dK
    and dV (which="kv", key rows). All of them where the forward checks all (B*H*N*N up to
    FULL_PAIRS), else as many as the forward samples plus the rows at tile edges, always with
    the first and last row (for causal: the key every query sees, the one only the last sees).
    Seeded by the shape and `which` alone, as sample_rows is: the same for causal or not."""
    if batch * heads * seqlen * seqlen <= FULL_PAIRS:
        return np.arange(seqlen, dtype=np.int64)
    count = max(MIN_SAMPLED_ROWS, FULL_PAIRS // (batch * heads * seqlen))
    if count >= seqlen:
        return np.arange(seqlen, dtype=np.int64)
    rng = np.random.default_rng([seqlen, batch, heads, ("q", "kv").index(which) + 1])
    picked = rng.choice(np.arange(1, seqlen - 1), size=count - 2, replace=False)
    return np.unique(np.concatenate([[0, seqlen - 1], tile_edge_rows(seqlen, rng), picked])).astype(np.int64)


def grad_tile_rows(seqlen):
    """Query rows per backward step: GRAD_LIVE_SCORES float64 [rows, N] arrays in CHUNK_BYTES."""
    return max(1, min(seqlen, CHUNK_BYTES // (GRAD_LIVE_SCORES * 8 * seqlen)))


def check_row_set(rows, seqlen, what):
    rows = np.asarray(rows, dtype=np.int64)
    if rows.ndim != 1 or np.any(np.diff(rows) <= 0) or (rows.size and (rows[0] < 0 or rows[-1] >= seqlen)):
        raise ValueError(f"{what}: want sorted, distinct rows in [0, {seqlen}), got {rows[:8].tolist()}...")
    return rows


def tile_probabilities(q_tile, k_seen, first_row, causal, scale):
    """P = exp(S - LSE) [G, T, J] of a tile of T query rows (the first one first_row) against
    the J keys they can see (causal: J = first_row + T)."""
    p = np.matmul(q_tile * scale, k_seen.transpose(0, 2, 1))
    if causal:  # only the diagonal block [first_row, J) holds keys after a row: -inf added there
        p[:, :, first_row:] += np.triu(np.full((p.shape[1], p.shape[1]), -np.inf), 1)
    row_max = p.max(axis=-1, keepdims=True)
    p -= row_max
    np.exp(p, out=p)
    row_sum = p.sum(axis=-1, keepdims=True)
    p /= row_sum
    return p


def score_grads(p, do_rows, v_cols, delta_rows):
    """dS = P * (dP - Delta) with dP = dO V^T, for the rows and columns p holds."""
    ds = np.matmul(do_rows, v_cols.transpose(0, 2, 1))
    ds -= delta_rows[..., None]
    ds *= p
    return ds


def attention_backward(q, k, v, do, q_rows, kv_rows, causal, scale, tile=None):
    """float64 gradients of O = softmax(Q K^T * scale [+ causal mask]) V given dO (all [B, H, N, D]):
    dQ [B, H, RQ, D] at the query rows q_rows, dK and dV [B, H, RK, D] at the key rows kv_rows
    (each sorted and distinct), and Delta [B, H, N] = rowsum(dO * O) of every row.

    One pass over tiles of `tile` query rows (default grad_tile_rows), each against the keys it
    can see (causal: those up to its last row): its P = exp(S - LSE), O = P V and Delta; dS of
    its rows at the key rows kv_rows gives their dK += scale dS^T Q and dV += P^T dO, dS of its
    rows in q_rows over all keys their dQ = scale dS K (where kv_rows hold half the keys or
    more, dS over every key serves both). Memory: a few [tile, N] arrays per (b, h) at a time
    (several heads at once while they fit in CHUNK_BYTES), the inputs and the outputs."""
    batch, heads, seqlen, headdim = q.shape
    q_rows = check_row_set(q_rows, seqlen, "q_rows")
    kv_rows = check_row_set(kv_rows, seqlen, "kv_rows")
    tile = tile or grad_tile_rows(seqlen)
    # Half the keys or more: dS over every key (it serves dQ too), the key rows picked at the end.
    every_key = 2 * len(kv_rows) >= seqlen
    key_rows = np.arange(seqlen, dtype=np.int64) if every_key else kv_rows
    q, k, v, do = (x.reshape(batch * heads, seqlen, headdim) for x in (q, k, v, do))
    dq = np.zeros((batch * heads, len(q_rows), headdim))
    dk = np.zeros((batch * heads, len(key_rows), headdim))
    dv = np.zeros((batch * heads, len(key_rows), headdim))
    delta = np.empty((batch * heads, seqlen))
    group = max(1, CHUNK_BYTES // (GRAD_LIVE_SCORES * 8 * tile * seqlen))  # heads per step
    for h0 in range(0, batch * heads, group):
        hs = slice(h0, min(h0 + group, batch * heads))
        qh, kh, vh, doh = (x[hs].astype(np.float64) for x in (q, k, v, do))
        for i0 in range(0, seqlen, tile):
            i1 = min(i0 + tile, seqlen)
            seen = i1 if causal else seqlen  # keys past the tile's last row are masked for all its rows
            q_t, do_t = qh[:, i0:i1], doh[:, i0:i1]
            p = tile_probabilities(q_t, kh[:, :seen], i0, causal, scale)
            delta_t = np.sum(do_t * np.matmul(p, vh[:, :seen]), axis=-1)
            delta[hs, i0:i1] = delta_t
            cols = np.searchsorted(key_rows, seen)  # key_rows[:cols] are seen by some row of the tile
            keys = slice(0, seen) if every_key else key_rows[:cols]
            p_keys = p if every_key else p[:, :, keys]
            ds = score_grads(p_keys, do_t, vh[:, keys], delta_t)
            dk[hs, :cols] += scale * np.matmul(ds.transpose(0, 2, 1), q_t)
            dv[hs, :cols] += np.matmul(p_keys.transpose(0, 2, 1), do_t)
            lo, hi = np.searchsorted(q_rows, [i0, i1])
            if hi == lo:
                continue
            local = slice(None) if hi - lo == i1 - i0 else q_rows[lo:hi] - i0
            if every_key:  # dQ of all the tile's rows (a [T, D] product), those in q_rows kept
                dq[hs, lo:hi] = scale * np.matmul(ds, kh[:, :seen])[:, local]
            else:
                row_ds = score_grads(p[:, local], do_t[:, local], vh[:, :seen], delta_t[:, local])
                dq[hs, lo:hi] = scale * np.matmul(row_ds, kh[:, :seen])
    if len(key_rows) > len(kv_rows):
        dk, dv = dk[:, kv_rows], dv[:, kv_rows]
    shape = (batch, heads)
    return (dq.reshape(*shape, len(q_rows), headdim), dk.reshape(*shape, len(kv_rows), headdim),
            dv.reshape(*shape, len(kv_rows), headdim), delta.reshape(*shape, seqlen))


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


GRAD_PARTS = ("dq", "dk", "dv", "delta", "dq_rows", "dkv_rows")  # written in this order: the rows last


def grad_paths(folder, causal, scale_text):
    """The gradient reference files of a tag (the forward's: c<causal>_s<F>)."""
    tag = f"c{int(causal)}_s{scale_text}"
    return {part: os.path.join(folder, f"ref_{tag}_{part}.npy") for part in GRAD_PARTS}


def load_grad_output(folder, shape):
    """folder/do.npy, refused unless it is float16 of Q's shape [B, H, N, D]."""
    path = os.path.join(folder, "do.npy")
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such file; the gradients need dO (reference.py inputs --grad writes one)")
    do = np.load(path)
    if do.dtype != np.float16 or do.ndim != 4:
        raise ValueError(f"{path}: want a 4-D float16 array, got {do.ndim}-D {do.dtype}")
    if do.shape != tuple(shape):
        raise ValueError(f"{path}: shape {do.shape}, but q, k, v have {tuple(shape)}: dO must have their shape")
    return do


def write_grad_output(folder, args):
    path = os.path.join(folder, "do.npy")
    if not os.path.exists(path):
        save_atomic(path, make_grad_output(args.batch, args.heads, args.seqlen, args.headdim, args.seed))


def backward(args):
    """prepare's files, dO (generated unless --input gives it), then the gradient set."""
    os.makedirs(args.out, exist_ok=True)
    if args.input is None:
        write_inputs(args.out, args)
        write_grad_output(args.out, args)
    if args.no_ref:
        return
    paths = grad_paths(args.out, args.causal, args.scale)
    q, k, v = load_inputs(args.input or args.out)
    do = load_grad_output(args.input or args.out, q.shape)
    prepare(args)
    if all(os.path.exists(path) for path in paths.values()):
        return
    rows = {"dq_rows": sample_grad_rows(*q.shape[:3], "q"), "dkv_rows": sample_grad_rows(*q.shape[:3], "kv")}
    grads = attention_backward(q, k, v, do, rows["dq_rows"], rows["dkv_rows"], args.causal, float(args.scale))
    for part, array in zip(GRAD_PARTS, (*grads, rows["dq_rows"], rows["dkv_rows"])):
        save_atomic(paths[part], array)  # the rows last: their presence means the set is complete


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


DECODE_SHAPE_OPTIONS = ("--batch", "--heads", "--kv-heads", "--new", "--headdim", "--page-size", "--lengths")


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("floor")
    for name in ("prepare", "inputs", "backward"):
        p = sub.add_parser(name)
        p.add_argument("--out", required=True)
        p.add_argument("--batch", type=positive_int)
        p.add_argument("--heads", type=positive_int)
        p.add_argument("--seqlen", type=positive_int)
        p.add_argument("--headdim", type=positive_int)
        p.add_argument("--seed", type=int, default=0)
    for prep in (sub.choices["prepare"], sub.choices["backward"]):
        prep.add_argument("--input", help="folder with q.npy, k.npy, v.npy (backward: and do.npy) to use "
                                          "instead of generating")
        prep.add_argument("--scale", required=True, help="softmax scale, as text (it names the files)")
        prep.add_argument("--causal", action="store_true")
        prep.add_argument("--no-ref", action="store_true", help="only the inputs")
        prep.add_argument("--fp8-floor", nargs="+", type=positive_int, metavar="Q_ROWS KV_ROWS [QK_RANGE]",
                          help="also the e4m3 input-quantisation floor, scales per Q_ROWS rows of Q, KV_ROWS of K "
                               "and V, Q and K to |x| <= QK_RANGE (default 448)")
    sub.choices["inputs"].add_argument("--grad", action="store_true", help="also dO (do.npy), N(0, 1) from the seed")
    sub.choices["inputs"].add_argument("--qk-std", type=float, default=1.0)
    sub.choices["inputs"].add_argument("--outliers", type=float, default=0.0,
                                       help="fraction of Q and K entries set to +-U(10, 100)")
    dec = sub.add_parser("decode")
    dec.add_argument("--out", required=True)
    dec.add_argument("--input", help="a decoding folder of one's own (q, k_pool, v_pool, block_table, lengths .npy, "
                                     "as this command writes them): its reference alone, into --out")
    for name in DECODE_SHAPE_OPTIONS[:-1]:
        dec.add_argument(name, type=positive_int)
    dec.add_argument("--lengths", type=lambda text: [positive_int(n) for n in text.split(",")],
                     help="tokens cached per sequence, comma-separated, B of them")
    dec.add_argument("--seed", type=int, default=0)
    dec.add_argument("--scale", required=True, help="softmax scale, as text (it names the files)")
    dec.add_argument("--no-ref", action="store_true", help="only the inputs")
    dec.add_argument("--kv-cache", choices=("fp16", "e4m3"), default="fp16",
                     help="e4m3: also the reference of the cache quantised to e4m3, a scale per KV head")
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
    if args.command == "decode":
        given = [name for name in DECODE_SHAPE_OPTIONS if getattr(args, name[2:].replace("-", "_")) is not None]
        if args.input is not None and given:
            parser.error(f"{given[0]} with --input: the folder gives the shape; drop it")
        if args.input is not None and args.no_ref:
            parser.error("--no-ref with --input: the reference is all that --input writes")
        if args.no_ref and args.kv_cache == "e4m3":
            parser.error("--kv-cache e4m3 with --no-ref: the e4m3 cache changes only the reference")
        if args.input is not None:
            return args
        if len(given) < len(DECODE_SHAPE_OPTIONS):
            parser.error(f"give {', '.join(DECODE_SHAPE_OPTIONS)} (or --input)")
        if len(args.lengths) != args.batch:
            parser.error(f"--lengths gives {len(args.lengths)} lengths for --batch {args.batch}")
        return args
    generated = args.command == "inputs" or args.input is None
    if generated and None in (args.batch, args.heads, args.seqlen, args.headdim):
        parser.error("give --batch, --heads, --seqlen and --headdim (or --input)")
    if args.command in ("prepare", "backward"):
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
        elif args.command == "backward":
            backward(args)
        elif args.command == "floor":
            print_floor(args)
        elif args.command == "decode":
            decode(args)
        else:
            os.makedirs(args.out, exist_ok=True)
            write_inputs(args.out, args, args.qk_std, args.outliers)
            if args.grad:
                write_grad_output(args.out, args)
    except (OSError, ValueError) as exc:
        print(f"reference.py: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
