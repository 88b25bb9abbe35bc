"""09_backward's tile loops emulated in NumPy, lane by lane, in float64, against the float64
backward of common/reference.py: the index arithmetic of the kernels checked without a GPU.

The emulation follows attention.cu: its tile sizes and warps per head dim (read from the source;
the four-warp arrangement that -DBWD_WARPS_D128=4 -DBWD_WARPS_D64=4 builds, without BWD_STAGGER,
emulated too), its grids and how a block finds its key (or query) tile and head, the order of its
query tiles (from the diagonal, wrapping round), the ring's slots, the zero fill of rows past N,
the mask and the tiles that take it, the causal tiles skipped, and every fragment: which lane
gives which ldmatrix row address, what ldmatrix (.trans or not) and mma.sync m16n8k16 then hold
(the register layouts of the PTX ISA), the repacking of accumulators into A operands, dS^T's
round trip through shared memory (one buffer: a tile's dQ is added at the next tile's top) and
the atomics into the fp32 dQ accumulator, in the kernel's order. Each product is the kernel's own sequence of mma.sync on those fragments, in float64
(no fp16 rounding), so the emulation must agree with the reference to rounding error. It also
checks what the kernel relies on without computing it: that no tile left unmasked needed a
mask, that the skipped tiles and the rows whose atomics are skipped would have added zero,
that every (query, key) pair is visited exactly once, and that the ldmatrix reads and dS^T's
4-byte stores hit 32 different banks.
"""
import re
import sys
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "common"))
import reference  # noqa: E402

SOURCE = ROOT / "09_backward" / "attention.cu"
LANES = np.arange(32)
GROUP, QUAD = LANES // 4, LANES % 4  # accumulator row (l / 4) and column pair (l % 4)


def constants():
    """The integer #defines of attention.cu, evaluated (those that are arithmetic on others)."""
    text = SOURCE.read_text()
    raw = dict(re.findall(r"^#define (\w+) (.+?)\s*(?://.*)?$", text, re.M))
    out = {}

    def value(name, depth=0):
        if name in out:
            return out[name]
        expr = raw[name].replace("(int)sizeof(__half)", "2").replace("(int)sizeof(float)", "4").replace("/", "//")
        expr = re.sub(r"\b[A-Z_][A-Z0-9_]*\b", lambda m: str(value(m.group(0), depth + 1)), expr)
        out[name] = int(eval(expr, {"__builtins__": {}}))  # integer arithmetic on literals only
        return out[name]

    for name in ("WARPS", "MMA_M", "MMA_N", "MMA_K", "PAD", "BWD_WARP_ROWS", "BWD_WARPS_D64", "BWD_WARPS_D128",
                 "BWD_STAGGER", "BWD_SPLIT", "BWD_KEY_TILES_D64", "BWD_BLOCK_Q", "DQ_WARP_TILES", "DQ_BLOCK_KV", "DQ_BLOCK_Q",
                 "BWD_STAGES", "CHUNK_HALVES",
                 "SPLIT_KEY_WARPS", "SPLIT_WARP_KEYS", "SPLIT_WARP_QUERIES", "SPLIT_WARP_DIMS", "BWD_DQ_STAGE",
                 "DQ_STAGE_STRIDE"):
        value(name)
    return out


C = constants()
DQ_WARPS, ROWS, BQ, STAGES, PAD = (C[n] for n in ("WARPS", "BWD_WARP_ROWS", "BWD_BLOCK_Q", "BWD_STAGES", "PAD"))
DQ_TILES, DQ_BKV = C["DQ_WARP_TILES"], C["DQ_BLOCK_KV"]  # the dQ kernel's m16 tiles per warp, keys per tile
DQ_ROW_TILES = BQ // 16  # m16 tiles of queries per step: warp w of the main kernel adds dQ of tile w % 4


def main_warps(d):
    """The main kernel's warps at head dim d, as the source's defaults say (BwdConfig::BLOCK_WARPS)."""
    return C[f"BWD_WARPS_D{d}"]


def ceil_div(a, b):
    return (a + b - 1) // b


# --- shared memory, ldmatrix and mma.sync as the PTX ISA documents them -------------------------
class Shared:
    """A flat array of halves (float64 here) with bank-conflict checks on every access."""

    def __init__(self, halves):
        self.mem = np.zeros(halves)

    def ldmatrix_x4(self, addrs, trans=False):
        """addrs: 32 half offsets, lanes 8i..8i+7 the rows of matrix i. Returns [32, 4, 2]: lane l's
        register i holds row l/4, columns 2(l%4), +1 of matrix i (of its transpose with .trans)."""
        addrs = np.asarray(addrs)
        assert np.all(addrs % 8 == 0), "ldmatrix rows are 16-byte aligned"
        for i in range(4):  # one matrix per phase: its 8 rows in 8 different groups of 4 banks
            groups = (addrs[8 * i:8 * i + 8] * 2 // 16) % 8
            assert len(set(groups.tolist())) == 8, f"ldmatrix bank conflict: rows at {addrs[8 * i:8 * i + 8]}"
        mats = self.mem[addrs[:, None] + np.arange(8)].reshape(4, 8, 8)  # [matrix][row][col]
        if trans:
            mats = mats.transpose(0, 2, 1)
        return mats[:, GROUP[:, None], 2 * QUAD[:, None] + np.arange(2)].transpose(1, 0, 2)

    def store_words(self, addrs, pairs):
        """32 lanes' 4-byte stores (two halves each): 32 different banks."""
        addrs = np.asarray(addrs)
        assert np.all(addrs % 2 == 0)
        assert len(set((addrs // 2 % 32).tolist())) == 32, "4-byte store bank conflict"
        self.mem[addrs] = pairs[:, 0]
        self.mem[addrs + 1] = pairs[:, 1]


def a_matrix(a):
    """A (16 x 16) from lane registers a[32, 4, 2]: a0 (g, 2c), a1 (g+8, 2c), a2 (g, 2c+8), a3 (g+8, 2c+8)."""
    m = np.zeros((16, 16))
    cols = 2 * QUAD[:, None] + np.arange(2)
    for i in range(4):
        m[GROUP[:, None] + 8 * (i % 2), cols + 8 * (i // 2)] = a[:, i]
    return m


def b_matrix(b0, b1):
    """B (16 x 8) from b0 (k 2c, 2c+1; n g) and b1 (k 2c+8, +9; n g), each [32, 2]."""
    m = np.zeros((16, 8))
    rows = 2 * QUAD[:, None] + np.arange(2)
    m[rows, GROUP[:, None]] = b0
    m[rows + 8, GROUP[:, None]] = b1
    return m


def acc_matrix(acc):
    """[32, 4] accumulator -> 16 x 8: c0, c1 (g, 2c, +1), c2, c3 (g+8, ...)."""
    m = np.zeros((16, 8))
    cols = 2 * QUAD[:, None] + np.arange(2)
    m[GROUP[:, None], cols] = acc[:, 0:2]
    m[GROUP[:, None] + 8, cols] = acc[:, 2:4]
    return m


def mma(acc, a, b0, b1):
    """acc [32, 4] += A B, as mma.sync.m16n8k16 does (float64 here)."""
    c = acc_matrix(acc) + a_matrix(a) @ b_matrix(b0, b1)
    cols = 2 * QUAD[:, None] + np.arange(2)
    acc[:, 0:2] = c[GROUP[:, None], cols]
    acc[:, 2:4] = c[GROUP[:, None] + 8, cols]


def pack_a(lo, hi):
    """Two n8 accumulators [32, 4] as one A operand [32, 4, 2] (the kernel's pack_a)."""
    return np.stack([lo[:, 0:2], lo[:, 2:4], hi[:, 0:2], hi[:, 2:4]], axis=1)


# --- the kernel's helpers, lane by lane ----------------------------------------------------------
def tile_offset(stride, row, chunk):
    return row * stride + chunk * 8


def load_a_step(smem, base, stride, row0, ks):
    return smem.ldmatrix_x4(base + tile_offset(stride, row0 + LANES % 16, ks * 2 + LANES // 16))


def load_k_step(smem, base, stride, key_tiles, ks):
    out = []
    for np_ in range(key_tiles // 2):
        key = np_ * 16 + LANES % 8 + LANES // 16 * 8
        out.append(smem.ldmatrix_x4(base + tile_offset(stride, key, ks * 2 + LANES // 8 % 2)))
    return out


def load_trans_pair(smem, base, stride, kk, dp):
    row = kk * 16 + LANES % 8 + LANES // 8 % 2 * 8
    return smem.ldmatrix_x4(base + tile_offset(stride, row, dp * 2 + LANES // 16), trans=True)


def load_tile(smem, base, stride, src, row0, seqlen, rows, d):
    """load_tile_async: rows row0.. of src [N, D], zero-filled past seqlen."""
    for r in range(rows):
        at = base + r * stride
        smem.mem[at:at + d] = src[row0 + r] if row0 + r < seqlen else 0.0


def mask_needed(query0, key0, seqlen, causal, bkv, bq=None):
    bq = BQ if bq is None else bq  # the query tile's rows: BWD_BLOCK_Q, or DQ_BLOCK_Q in the dQ kernel
    return query0 + bq > seqlen or key0 + bkv > seqlen or (causal and key0 + bkv - 1 > query0)


def hidden(key, query, seqlen, causal):
    return (key >= seqlen) | (query >= seqlen) | (causal & (key > query))


def tile_hidden(rows, cols, rows_are_keys, seqlen, causal):
    """mask_tile's predicate for a lane's elements [nt][2r+e]: rows [32, 2] (r), cols [32, tiles, 2] (e)."""
    r = rows[:, None, :, None]
    c = cols[:, :, None, :]
    key, query = (r, c) if rows_are_keys else (c, r)
    return hidden(key, query, seqlen, causal).reshape(32, cols.shape[1], 4)  # [lane][nt][2r+e]


def lane_rows(row0):
    return row0 + GROUP[:, None] + 8 * np.arange(2)  # [32, 2]: rows g and g+8


def lane_cols(col0, tiles):
    return col0 + 2 * QUAD[:, None, None] + 8 * np.arange(tiles)[None, :, None] + np.arange(2)  # [32, tiles, 2]


# --- the kernels -----------------------------------------------------------------------------
def round_key_tile(rnd, key_tiles, causal, grid, bx, by, copies):
    """The kernel's round_key_tile: the key tile of block (bx, by)'s round `rnd`, -1 past its last.
    With DETERMINISTIC_DQ's copies (grid (copies, b*h)) one of every `copies` tiles, back and forth."""
    if copies:
        key_tile = rnd * grid[0] + (grid[0] - 1 - bx if rnd % 2 else bx)
        return key_tile if key_tile < key_tiles else -1
    return -1 if rnd > 0 else (by if causal else bx)


def main_kernel_key_tiles(heads, key_tiles, causal, copies):
    """(head, copy, key tile) of the main kernel in the order its blocks and their rounds run:
    grid (copies, b*h) with DETERMINISTIC_DQ (copies > 0), else (key tiles, b*h), causal (b*h, key
    tiles), and copy 0 (block_head, block_dq_copy)."""
    grid = (copies, heads) if copies else ((heads, key_tiles) if causal else (key_tiles, heads))
    for by in range(grid[1]):
        for bx in range(grid[0]):
            head, rnd = by if copies or not causal else bx, 0
            while (key_tile := round_key_tile(rnd, key_tiles, causal, grid, bx, by, copies)) >= 0:
                yield head, bx if copies else 0, key_tile
                rnd += 1


def dq_copies(heads, key_tiles, resident):
    """The launcher's dq_copies under DETERMINISTIC_DQ: the fewest blocks per head that take the heads'
    key tiles in the least (rounds of `resident` blocks) x (key tiles per block)."""
    best, best_time = 1, -1
    for copies in range(1, key_tiles + 1):
        time = ceil_div(heads * copies, resident) * ceil_div(key_tiles, copies)
        if best_time < 0 or time < best_time:
            best, best_time = copies, time
    return best


def emulate_backward(q, k, v, do, o, lse, causal, scale, deterministic, warps=None, stagger=None, split=None,
                     warp_key_tiles=None, dq_stage=None, copies=0):
    """dQ, dK, dV [BH, N, D] and D [BH, N] as 09's kernels compute them (float64), with the main
    kernel's `warps` (default: the source's, per head dim), BWD_STAGGER, BWD_SPLIT (default: the
    source's; the split kernel runs at D=128 with eight warps, BwdConfig::SPLIT) and warp_key_tiles,
    the first kernel's m16 tiles of keys per warp (BWD_KEY_TILES_D64; 1 at D=128), and dq_stage, how
    the split kernel adds its dQ partials on sm_90 (BWD_DQ_STAGE: 1 staged in shared memory and read
    back a whole row per RED, 0 from registers). deterministic: dQ by the dQ kernel (BWD_DQ_KERNEL);
    copies > 0: DETERMINISTIC_DQ's main kernel, `copies` blocks per head, each into its own copy."""
    heads, seqlen, d = q.shape
    dq_stage = bool(C["BWD_DQ_STAGE"]) if dq_stage is None else dq_stage
    warps = main_warps(d) if warps is None else warps
    stagger = bool(C["BWD_STAGGER"]) if stagger is None else stagger
    split = (bool(C["BWD_SPLIT"]) if split is None else split) and d == 128 and warps == 8
    if warp_key_tiles is None or d != 64:  # BwdConfig::KEY_TILES
        warp_key_tiles = C["BWD_KEY_TILES_D64"] if d == 64 else 1
    parts = warp_key_tiles  # BwdConfig::QUERY_PARTS: a query tile in parts of BQ / parts queries
    bkv = warps * ROWS * warp_key_tiles  # BwdConfig::BLOCK_KV
    dq_warp_dims = d * DQ_ROW_TILES // warps  # BwdConfig::DQ_WARP_DIMS
    stride, ds_stride = d + PAD, BQ + PAD
    k_steps, q_tiles_n8, q_steps, dim_tiles = d // 16, BQ // parts // 8, BQ // parts // 16, d // 8
    log2e = 1 / np.log(2)
    scale_log2 = scale * log2e
    visits = np.zeros((heads, seqlen, seqlen), dtype=np.int64)

    # (1) preprocess: D = rowsum(dO * O); the dQ accumulator's copies zeroed (the workspace).
    delta = np.sum(do * o, axis=-1)
    dq_acc_copies = np.zeros((max(copies, 1), heads, seqlen, d))
    dk, dv = np.zeros((heads, seqlen, d)), np.zeros((heads, seqlen, d))

    # (2) the main kernel, block by block in its grid's order, each block's key tiles in turn.
    key_tiles = ceil_div(seqlen, bkv)
    query_tiles = ceil_div(seqlen, BQ)
    for head, copy, key_tile in main_kernel_key_tiles(heads, key_tiles, causal, copies):
        dq_acc = dq_acc_copies[copy]  # the block's copy of the workspace (the one copy without DETERMINISTIC_DQ)
        key0 = key_tile * bkv
        first_tile = key0 // BQ if causal or stagger else 0
        n_tiles = query_tiles - first_tile if causal else query_tiles
        assert n_tiles >= 1

        def step_query0(step):  # the loop's query tiles: from first_tile on, wrapping round
            tile = first_tile + step
            assert tile < 2 * query_tiles
            return (tile if tile < query_tiles else tile - query_tiles) * BQ

        if causal and first_tile > 0:  # the skipped query tiles: every key of the block after every query
            assert first_tile * BQ - 1 < key0
        # shared memory: LSE/D ring (floats, kept apart here), K, V, the Q/dO ring, (P^T,) dS^T
        k_base, v_base = 0, bkv * stride
        q_ring, do_ring = 2 * bkv * stride, 2 * bkv * stride + STAGES * BQ * stride
        pt_base = do_ring + STAGES * BQ * stride  # the split kernel's P^T
        ds_base = pt_base + (bkv * ds_stride if split else 0)
        smem = Shared(ds_base + bkv * ds_stride)
        lse_ring, delta_ring = np.zeros((STAGES, BQ)), np.zeros((STAGES, BQ))

        def fill(slot, t):
            query0 = step_query0(t)
            load_tile(smem, q_ring + slot * BQ * stride, stride, q[head], query0, seqlen, BQ, d)
            load_tile(smem, do_ring + slot * BQ * stride, stride, do[head], query0, seqlen, BQ, d)
            rows = query0 + np.arange(BQ)
            ok = rows < seqlen
            lse_ring[slot] = np.where(ok, lse[head][np.minimum(rows, seqlen - 1)], 0.0)
            delta_ring[slot] = np.where(ok, delta[head][np.minimum(rows, seqlen - 1)], 0.0)

        def add_dq_of_tile(query0, row_tiles=1, stage=None):
            """dQ += dS K from dS^T in shared memory: warp w takes `row_tiles` m16 tiles of queries
            (w % query_warps) against every key of the block, for dims dq_warp_dims (w / query_warps)..,
            in passes of <= 8 n8 tiles: one tile, 16 queries, in the first kernel; two in the split one.
            With `stage` (BWD_DQ_STAGE, add_dq_of_tile<128, 2, true>) each partial is stored to that
            [query][DQ_STAGE_STRIDE] tile as float2 (stage_dq_partial) instead of added."""
            query_warps = DQ_ROW_TILES // row_tiles
            dq_warp_dims = d * query_warps // warps  # add_dq_of_tile's DQ_WARP_DIMS
            dq_dim_tiles = min(dq_warp_dims // 8, 8)
            for w in range(warps):
                row0, dim0 = w % query_warps * row_tiles * ROWS, w // query_warps * dq_warp_dims
                for pas, mt in [(pas, mt) for pas in range(dq_warp_dims // 8 // dq_dim_tiles) for mt in range(row_tiles)]:
                    part = np.zeros((dq_dim_tiles, 32, 4))
                    for kk in range(bkv // 16):
                        key = kk * 16 + LANES // 16 * 8 + LANES % 8
                        dsa = smem.ldmatrix_x4(ds_base + key * ds_stride + row0 + mt * 16 + LANES // 8 % 2 * 8,
                                               trans=True)
                        for dp in range(dq_dim_tiles // 2):
                            kf = load_trans_pair(smem, k_base, stride, kk, dim0 // 16 + pas * dq_dim_tiles // 2 + dp)
                            mma(part[2 * dp], dsa, kf[:, 0], kf[:, 1])
                            mma(part[2 * dp + 1], dsa, kf[:, 2], kf[:, 3])
                    if stage is not None:
                        stage_dq_partial(stage, part, row0 + mt * 16, dim0 + pas * dq_dim_tiles * 8)
                        continue
                    # add_dq_partial's sm_90 path: the lanes of a quad pair swap half their
                    # values, then each adds four adjacent dims of one row (red.global.add.v4.f32).
                    odd = QUAD % 2 == 1
                    partner = LANES ^ 1
                    query = query0 + row0 + mt * 16 + GROUP + np.where(odd, 8, 0)  # [32]
                    ok = query < seqlen
                    for nt in range(dq_dim_tiles):
                        give = np.where(odd[:, None], part[nt][:, 0:2], part[nt][:, 2:4])
                        got = give[partner]
                        four = np.where(odd[:, None], np.concatenate([got, part[nt][:, 2:4]], 1),
                                        np.concatenate([part[nt][:, 0:2], got], 1))
                        for e in range(4):
                            col = dim0 + pas * dq_dim_tiles * 8 + nt * 8 + 4 * (QUAD // 2) + e
                            assert np.all(four[~ok, e] == 0), "a skipped atomic (query past N) was not zero"
                            np.add.at(dq_acc[head], (query[ok], col[ok]), four[ok, e])  # the vector atomicAdd

        def stage_dq_partial(stage, part, row0, dim0):
            """A warp's m16 tile of partial, rows row0 + l / 4 (+ 8), dims dim0 + 8nt + 2 (l % 4), as
            float2 stores to the staged tile: a half-warp's 32 words in 32 banks."""
            for r in range(2):
                row = row0 + GROUP + r * 8
                for nt in range(len(part)):
                    col = dim0 + nt * 8 + 2 * QUAD
                    words = row * stage.shape[1] + col
                    for half in (slice(0, 16), slice(16, 32)):
                        banks = (words[half, None] + np.arange(2)) % 32
                        assert len(set(banks.ravel().tolist())) == 32, "staged dQ store bank conflict"
                    stage[row, col] = part[nt][:, 2 * r]
                    stage[row, col + 1] = part[nt][:, 2 * r + 1]

        def stage_and_add_dq(query0, row_tiles=2):
            """The split kernel's dQ with BWD_DQ_STAGE: add_dq_of_tile's partials staged, then (after
            the next tile's first barrier) add_staged_dq: warp w adds the tile's whole rows 8w.. into
            the accumulator, lane l four dims 4l.. per row, one 16-byte RED each."""
            stage = np.full((BQ, C["DQ_STAGE_STRIDE"]), np.nan)  # what no warp stores is never read
            add_dq_of_tile(query0, row_tiles, stage)
            for w in range(warps):
                for kr in range(BQ // warps):
                    row = w * (BQ // warps) + kr
                    words = row * stage.shape[1] + 4 * LANES
                    for quarter in range(4):  # a 16-byte load's phase: 8 lanes, 32 banks
                        banks = (words[8 * quarter:8 * quarter + 8, None] + np.arange(4)) % 32
                        assert len(set(banks.ravel().tolist())) == 32, "staged dQ load bank conflict"
                    four = stage[row, 4 * LANES[:, None] + np.arange(4)]
                    assert not np.isnan(four).any()
                    if query0 + row < seqlen:
                        dq_acc[head][query0 + row, 4 * LANES[:, None] + np.arange(4)] += four
                    else:
                        assert np.all(four == 0), "a skipped row (query past N) was not zero"

        load_tile(smem, k_base, stride, k[head], key0, seqlen, bkv, d)
        load_tile(smem, v_base, stride, v[head], key0, seqlen, bkv, d)
        for t in range(STAGES - 1):
            if t < n_tiles:
                fill(t, t)
        if split:
            split_block(smem, (k_base, v_base, q_ring, do_ring, pt_base, ds_base), fill, step_query0,
                        stage_and_add_dq if dq_stage else add_dq_of_tile, (lse_ring, delta_ring),
                        (head, key0, n_tiles, seqlen, causal),
                        scale_log2, deterministic, visits, dk, dv, scale)
            continue
        dk_acc = [[np.zeros((dim_tiles, 32, 4)) for _ in range(warp_key_tiles)] for _ in range(warps)]
        dv_acc = [[np.zeros((dim_tiles, 32, 4)) for _ in range(warp_key_tiles)] for _ in range(warps)]
        pq = BQ // parts  # queries per part
        for tile in range(n_tiles):
            nxt = tile + STAGES - 1
            if nxt < n_tiles:
                fill(nxt % STAGES, nxt)
            if not deterministic and tile > 0:  # the last tile's dQ, after the barrier at the top
                add_dq_of_tile(step_query0(tile - 1))
            slot, query0 = tile % STAGES, step_query0(tile)
            q_tile, do_tile = q_ring + slot * BQ * stride, do_ring + slot * BQ * stride
            masked_here = mask_needed(query0, key0, seqlen, causal, bkv)
            ds_frags = []  # (row0, part0, dS^T A fragments) of every warp, m16 tile and part
            units = [(w, part, mt) for w in range(warps) for part in range(parts) for mt in range(warp_key_tiles)]
            for w, part, mt in units:
                row0, part0 = w * ROWS * warp_key_tiles + mt * ROWS, part * pq
                q_part, do_part = q_tile + part0 * stride, do_tile + part0 * stride
                score = np.zeros((q_tiles_n8, 32, 4))
                for ks in range(k_steps):
                    kf = load_a_step(smem, k_base, stride, row0, ks)
                    qf = load_k_step(smem, q_part, stride, q_tiles_n8, ks)
                    for np_ in range(q_tiles_n8 // 2):
                        mma(score[2 * np_], kf, qf[np_][:, 0], qf[np_][:, 1])
                        mma(score[2 * np_ + 1], kf, qf[np_][:, 2], qf[np_][:, 3])
                score = score.transpose(1, 0, 2)  # [lane][nt][4]
                cols_of = lane_cols(query0 + part0, q_tiles_n8)
                hide = tile_hidden(lane_rows(key0 + row0), cols_of, True, seqlen, causal)
                if masked_here:
                    score = np.where(hide, -np.inf, score)
                else:
                    assert not hide.any(), f"tile (keys {key0}, queries {query0}) needed the mask it skips"
                # visits: the pairs this warp's elements stand for, unmasked
                keys, queries = np.broadcast_arrays(lane_rows(key0 + row0)[:, None, :, None], cols_of[:, :, None, :])
                seen = ~hide.reshape(keys.shape)
                np.add.at(visits[head], (queries[seen], keys[seen]), 1)
                # P^T = exp2(S^T * scale_log2 - LSE * log2e): LSE of column part0 + nt*8 + 2c + e
                cols = part0 + (np.arange(q_tiles_n8)[None, :, None] * 8 + 2 * QUAD[:, None, None] + np.arange(2))
                lse_l = lse_ring[slot][cols]  # [32, nt, 2]
                lse_l = np.concatenate([lse_l, lse_l], axis=-1)  # [2r + e] -> e
                p = np.exp2(score * scale_log2 - lse_l * log2e)
                p = p.transpose(1, 0, 2)  # [nt][lane][4]
                for kk in range(q_steps):
                    pf = pack_a(p[2 * kk], p[2 * kk + 1])
                    for dp in range(dim_tiles // 2):
                        df = load_trans_pair(smem, do_part, stride, kk, dp)
                        mma(dv_acc[w][mt][2 * dp], pf, df[:, 0], df[:, 1])
                        mma(dv_acc[w][mt][2 * dp + 1], pf, df[:, 2], df[:, 3])
                dsv = np.zeros((q_tiles_n8, 32, 4))
                for ks in range(k_steps):
                    vf = load_a_step(smem, v_base, stride, row0, ks)
                    of = load_k_step(smem, do_part, stride, q_tiles_n8, ks)
                    for np_ in range(q_tiles_n8 // 2):
                        mma(dsv[2 * np_], vf, of[np_][:, 0], of[np_][:, 1])
                        mma(dsv[2 * np_ + 1], vf, of[np_][:, 2], of[np_][:, 3])
                dl = delta_ring[slot][cols]
                dl = np.concatenate([dl, dl], axis=-1).transpose(1, 0, 2)
                dsv = p * (dsv - dl)
                dsf = [pack_a(dsv[2 * kk], dsv[2 * kk + 1]) for kk in range(q_steps)]
                for kk in range(q_steps):
                    for dp in range(dim_tiles // 2):
                        qf2 = load_trans_pair(smem, q_part, stride, kk, dp)
                        mma(dk_acc[w][mt][2 * dp], dsf[kk], qf2[:, 0], qf2[:, 1])
                        mma(dk_acc[w][mt][2 * dp + 1], dsf[kk], qf2[:, 2], qf2[:, 3])
                ds_frags.append((row0, part0, dsf))
            if deterministic:
                continue
            # dS^T to shared memory, after a barrier (every warp has read the last tile's), over it
            for row0, part0, dsf in ds_frags:
                for kk in range(q_steps):
                    for i in range(4):
                        key = row0 + GROUP + i % 2 * 8
                        query = part0 + kk * 16 + i // 2 * 8 + 2 * QUAD
                        smem.store_words(ds_base + key * ds_stride + query, dsf[kk][:, i])
        if not deterministic:  # the last tile's dQ, after the loop
            add_dq_of_tile(step_query0(n_tiles - 1))
        for w in range(warps):
            for mt in range(warp_key_tiles):
                for r in range(2):
                    key = key0 + w * ROWS * warp_key_tiles + mt * ROWS + GROUP + 8 * r
                    ok = key < seqlen
                    for nt in range(dim_tiles):
                        for e in range(2):
                            col = nt * 8 + 2 * QUAD + e
                            dk[head][key[ok], col[ok]] = dk_acc[w][mt][nt][ok, 2 * r + e] * scale
                            dv[head][key[ok], col[ok]] = dv_acc[w][mt][nt][ok, 2 * r + e]

    want = np.tril(np.ones((seqlen, seqlen), dtype=np.int64)) if causal else np.ones((seqlen, seqlen), np.int64)
    assert np.array_equal(visits, np.broadcast_to(want, visits.shape)), "a (query, key) pair visited not exactly once"
    if deterministic:
        dq = emulate_dq_kernel(q, k, v, do, lse, delta, causal, scale)
    else:  # (3) convert: the copies summed in order, scaled
        dq = dq_acc_copies[0].copy()
        for extra in dq_acc_copies[1:]:
            dq += extra
        dq *= scale
    return dq, dk, dv, delta


def split_block(smem, bases, fill, step_query0, add_dq_of_tile, rings, block, scale_log2, deterministic, visits,
                dk, dv, scale):
    """One block of flash_attention_backward_split_kernel (D=128, eight warps): S^T and dP^T by
    warps 4 x 2 over (keys, queries), P^T and dS^T stored to shared memory, a barrier, dV and dK by
    4 x 2 over (keys, dims), dQ by 2 x 4 over (queries, dims). Writes dK, dV; adds into visits."""
    k_base, v_base, q_ring, do_ring, pt_base, ds_base = bases
    lse_ring, delta_ring = rings
    head, key0, n_tiles, seqlen, causal = block
    d, stride, ds_stride, bkv = 128, 128 + PAD, BQ + PAD, 128
    key_warps, warp_keys, warp_queries, warp_dims = (C[n] for n in ("SPLIT_KEY_WARPS", "SPLIT_WARP_KEYS",
                                                                       "SPLIT_WARP_QUERIES", "SPLIT_WARP_DIMS"))
    m_tiles, q_tiles, d_tiles = warp_keys // 16, warp_queries // 8, warp_dims // 8
    log2e = 1 / np.log(2)
    dk_acc = np.zeros((8, m_tiles, d_tiles, 32, 4))
    dv_acc = np.zeros((8, m_tiles, d_tiles, 32, 4))

    def rows_times_rows(a_base, a_row0, b_base, b_row0):  # acc[mt][nt] += A B^T over the dims
        acc = np.zeros((m_tiles, q_tiles, 32, 4))
        for ks in range(d // 16):
            af = [load_a_step(smem, a_base, stride, a_row0 + mt * 16, ks) for mt in range(m_tiles)]
            bf = load_k_step(smem, b_base + b_row0 * stride, stride, q_tiles, ks)
            for mt in range(m_tiles):
                for np_ in range(q_tiles // 2):
                    mma(acc[mt][2 * np_], af[mt], bf[np_][:, 0], bf[np_][:, 1])
                    mma(acc[mt][2 * np_ + 1], af[mt], bf[np_][:, 2], bf[np_][:, 3])
        return acc

    def keys_times_queries(acc, a_base, a_row0, b_base, dim0):  # acc[mt][nt] += A B over the queries
        for kk in range(BQ // 16):
            af = [smem.ldmatrix_x4(a_base + (a_row0 + mt * 16 + LANES % 16) * ds_stride + (kk * 2 + LANES // 16) * 8)
                  for mt in range(m_tiles)]
            for dp in range(d_tiles // 2):
                bf = load_trans_pair(smem, b_base, stride, kk, dim0 // 16 + dp)
                for mt in range(m_tiles):
                    mma(acc[mt][2 * dp], af[mt], bf[:, 0], bf[:, 1])
                    mma(acc[mt][2 * dp + 1], af[mt], bf[:, 2], bf[:, 3])

    def store_key_query(base, acc, row0, col0):  # [mt][nt][lane][4] as fp16 pairs, one store per (mt, r, nt)
        for mt in range(m_tiles):
            for r in range(2):
                for nt in range(q_tiles):
                    key = row0 + mt * 16 + GROUP + 8 * r
                    query = col0 + nt * 8 + 2 * QUAD
                    smem.store_words(base + key * ds_stride + query, acc[mt][nt][:, 2 * r:2 * r + 2])

    for tile in range(n_tiles):
        nxt = tile + STAGES - 1
        if nxt < n_tiles:
            fill(nxt % STAGES, nxt)
        slot, query0 = tile % STAGES, step_query0(tile)
        q_tile, do_tile = q_ring + slot * BQ * stride, do_ring + slot * BQ * stride
        masked_here = mask_needed(query0, key0, seqlen, causal, bkv)
        for w in range(8):
            kw0, qw0 = w % key_warps * warp_keys, w // key_warps * warp_queries
            score = rows_times_rows(k_base, kw0, q_tile, qw0)
            p = np.zeros_like(score)
            cols = qw0 + np.arange(q_tiles)[None, :, None] * 8 + 2 * QUAD[:, None, None] + np.arange(2)
            lse_l = np.tile(lse_ring[slot][cols], 2)  # [lane][nt][2r + e]: the column's (query's) LSE
            dl = np.tile(delta_ring[slot][cols], 2)
            for mt in range(m_tiles):
                s = score[mt].transpose(1, 0, 2)  # [lane][nt][4]
                rows = lane_rows(key0 + kw0 + mt * 16)
                hide = tile_hidden(rows, lane_cols(query0 + qw0, q_tiles), True, seqlen, causal)
                if masked_here:
                    s = np.where(hide, -np.inf, s)
                else:
                    assert not hide.any(), f"split tile (keys {key0}, queries {query0}) needed the mask it skips"
                keys, queries = np.broadcast_arrays(rows[:, None, :, None], lane_cols(query0 + qw0, q_tiles)[:, :, None, :])
                seen = ~hide.reshape(keys.shape)
                np.add.at(visits[head], (queries[seen], keys[seen]), 1)
                p[mt] = np.exp2(s * scale_log2 - lse_l * log2e).transpose(1, 0, 2)
            store_key_query(pt_base, p, kw0, qw0)
            dpt = rows_times_rows(v_base, kw0, do_tile, qw0)
            ds = p * (dpt - dl.transpose(1, 0, 2)[None])
            store_key_query(ds_base, ds, kw0, qw0)
        # __syncthreads: P^T and dS^T of the whole block are in
        for w in range(8):
            kw0, dw0 = w % key_warps * warp_keys, w // key_warps * warp_dims
            keys_times_queries(dv_acc[w], pt_base, kw0, do_tile, dw0)
            keys_times_queries(dk_acc[w], ds_base, kw0, q_tile, dw0)
        if not deterministic:
            add_dq_of_tile(query0, row_tiles=2)  # or staged (BWD_DQ_STAGE): the same tile's rows
    for w in range(8):
        kw0, dw0 = w % key_warps * warp_keys, w // key_warps * warp_dims
        for mt in range(m_tiles):
            for r in range(2):
                key = key0 + kw0 + mt * 16 + GROUP + 8 * r
                ok = key < seqlen
                for nt in range(d_tiles):
                    for e in range(2):
                        col = dw0 + nt * 8 + 2 * QUAD + e
                        dk[head][key[ok], col[ok]] = dk_acc[w][mt][nt][ok, 2 * r + e] * scale
                        dv[head][key[ok], col[ok]] = dv_acc[w][mt][nt][ok, 2 * r + e]


def emulate_dq_kernel(q, k, v, do, lse, delta, causal, scale, row_tiles=None, bkv=None):
    """DETERMINISTIC_DQ's dQ kernel: per query tile, the key tiles in order, dQ in registers.
    row_tiles: m16 tiles of queries per warp (DQ_WARP_TILES), bkv: keys per tile (DQ_BLOCK_KV)."""
    row_tiles = DQ_TILES if row_tiles is None else row_tiles
    bkv = (DQ_BKV if row_tiles == DQ_TILES else 64 // row_tiles) if bkv is None else bkv
    bq = DQ_WARPS * row_tiles * 16  # DQ_BLOCK_Q
    heads, seqlen, d = q.shape
    stride = d + PAD
    k_steps, key_tiles_n8, key_steps, dim_tiles = d // 16, bkv // 8, bkv // 16, d // 8
    log2e = 1 / np.log(2)
    dq = np.zeros((heads, seqlen, d))
    visits = np.zeros((heads, seqlen, seqlen), dtype=np.int64)
    query_tiles = ceil_div(seqlen, bq)
    grid = (heads, query_tiles) if causal else (query_tiles, heads)
    for by in range(grid[1]):
        for bx in range(grid[0]):
            query_tile, head = (grid[1] - 1 - by, bx) if causal else (bx, by)
            query0 = query_tile * bq
            key_end = min(seqlen, query0 + bq) if causal else seqlen
            kv_tiles = ceil_div(key_end, bkv)
            q_base, do_base, k_ring = 0, bq * stride, 2 * bq * stride
            v_ring = k_ring + STAGES * bkv * stride
            smem = Shared(v_ring + STAGES * bkv * stride)
            load_tile(smem, q_base, stride, q[head], query0, seqlen, bq, d)
            load_tile(smem, do_base, stride, do[head], query0, seqlen, bq, d)

            def fill(slot, t):
                load_tile(smem, k_ring + slot * bkv * stride, stride, k[head], t * bkv, seqlen, bkv, d)
                load_tile(smem, v_ring + slot * bkv * stride, stride, v[head], t * bkv, seqlen, bkv, d)

            for t in range(STAGES - 1):
                if t < kv_tiles:
                    fill(t, t)
            units = [(w, mt) for w in range(DQ_WARPS) for mt in range(row_tiles)]  # (warp, m16 tile)
            acc = {u: np.zeros((dim_tiles, 32, 4)) for u in units}
            rows_of = {(w, mt): lane_rows(query0 + w * row_tiles * 16 + mt * 16) for w, mt in units}
            for tile in range(kv_tiles):
                nxt = tile + STAGES - 1
                if nxt < kv_tiles:
                    fill(nxt % STAGES, nxt)
                k_tile, v_tile = k_ring + tile % STAGES * bkv * stride, v_ring + tile % STAGES * bkv * stride
                key0 = tile * bkv
                for w in range(DQ_WARPS):
                    warp_last_query = query0 + w * row_tiles * 16 + row_tiles * 16 - 1
                    if causal and key0 > warp_last_query:  # the warp skips the tile: all of it hidden
                        for mt in range(row_tiles):
                            rows = rows_of[w, mt]
                            assert tile_hidden(rows, lane_cols(key0, key_tiles_n8), False, seqlen, causal).all()
                        continue
                    for mt in range(row_tiles):
                        row0 = w * row_tiles * 16 + mt * 16
                        rows = rows_of[w, mt]
                        ok = rows < seqlen
                        row_lse = np.where(ok, lse[head][np.minimum(rows, seqlen - 1)] * log2e, 0.0)  # [32, 2]
                        row_delta = np.where(ok, delta[head][np.minimum(rows, seqlen - 1)], 0.0)
                        score, dsv = np.zeros((key_tiles_n8, 32, 4)), np.zeros((key_tiles_n8, 32, 4))
                        for ks in range(k_steps):
                            qf = load_a_step(smem, q_base, stride, row0, ks)
                            kf = load_k_step(smem, k_tile, stride, key_tiles_n8, ks)
                            for np_ in range(key_tiles_n8 // 2):
                                mma(score[2 * np_], qf, kf[np_][:, 0], kf[np_][:, 1])
                                mma(score[2 * np_ + 1], qf, kf[np_][:, 2], kf[np_][:, 3])
                        for ks in range(k_steps):
                            of = load_a_step(smem, do_base, stride, row0, ks)
                            vf = load_k_step(smem, v_tile, stride, key_tiles_n8, ks)
                            for np_ in range(key_tiles_n8 // 2):
                                mma(dsv[2 * np_], of, vf[np_][:, 0], vf[np_][:, 1])
                                mma(dsv[2 * np_ + 1], of, vf[np_][:, 2], vf[np_][:, 3])
                        score = score.transpose(1, 0, 2)
                        hide = tile_hidden(rows, lane_cols(key0, key_tiles_n8), False, seqlen, causal)
                        if mask_needed(query0, key0, seqlen, causal, bkv, bq):
                            score = np.where(hide, -np.inf, score)
                        else:
                            assert not hide.any(), f"dQ tile (queries {query0}, keys {key0}) needed the mask it skips"
                        queries, keys = np.broadcast_arrays(rows[:, None, :, None],
                                                            lane_cols(key0, key_tiles_n8)[:, :, None, :])
                        seen = ~hide.reshape(keys.shape)
                        np.add.at(visits[head], (queries[seen], keys[seen]), 1)
                        i_row = np.array([0, 0, 1, 1])  # element i of an accumulator: row i / 2
                        p = np.exp2(score * scale * log2e - row_lse[:, None, i_row])
                        dsv = (p * (dsv.transpose(1, 0, 2) - row_delta[:, None, i_row])).transpose(1, 0, 2)
                        for kk in range(key_steps):
                            dsf = pack_a(dsv[2 * kk], dsv[2 * kk + 1])
                            for dp in range(dim_tiles // 2):
                                kf = load_trans_pair(smem, k_tile, stride, kk, dp)
                                mma(acc[w, mt][2 * dp], dsf, kf[:, 0], kf[:, 1])
                                mma(acc[w, mt][2 * dp + 1], dsf, kf[:, 2], kf[:, 3])
            if causal and kv_tiles * bkv < seqlen:  # the key tiles skipped: after every query of the tile
                assert kv_tiles * bkv > query0 + bq - 1
            for u in units:
                rows = rows_of[u]
                for r in range(2):
                    ok = rows[:, r] < seqlen
                    for nt in range(dim_tiles):
                        for e in range(2):
                            col = nt * 8 + 2 * QUAD + e
                            dq[head][rows[ok, r], col[ok]] = acc[u][nt][ok, 2 * r + e] * scale
    want = np.tril(np.ones((seqlen, seqlen), dtype=np.int64)) if causal else np.ones((seqlen, seqlen), np.int64)
    assert np.array_equal(visits, np.broadcast_to(want, visits.shape)), "dQ kernel: a pair not visited exactly once"
    return dq


# --- the checks ----------------------------------------------------------------------------------
def check_shape(heads, seqlen, d, causal, deterministic, seed=0, warps=None, stagger=None, split=None,
                warp_key_tiles=None, dq_stage=None, copies=0):
    q, k, v = reference.make_inputs(1, heads, seqlen, d, seed)
    do = reference.make_grad_output(1, heads, seqlen, d, seed)
    scale = 1 / np.sqrt(d)
    rows = np.arange(seqlen, dtype=np.int64)
    o, lse = reference.attention_reference(q, k, v, rows, causal, scale)
    want = reference.attention_backward(q, k, v, do, rows, rows, causal, scale)
    f64 = [x[0].astype(np.float64) for x in (q, k, v, do)]
    got = emulate_backward(*f64, o[0], lse[0], causal, scale, deterministic, warps, stagger, split, warp_key_tiles,
                           dq_stage, copies)
    for name, g, w in zip(("dQ", "dK", "dV", "D"), got, want):
        w = w[0]
        assert np.all(np.isfinite(g)), f"{name}: non-finite values"
        err = np.linalg.norm(g - w) / max(np.linalg.norm(w), 1.0)
        assert err < 1e-10, (f"{name} at H={heads} N={seqlen} D={d} causal={causal} "
                             f"deterministic={deterministic} warps={warps} stagger={stagger} split={split} "
                             f"warp_key_tiles={warp_key_tiles} dq_stage={dq_stage} copies={copies}: "
                             f"relative error {err:.2e}")
    return got


SHAPES = [  # (heads, N, D, causal): N = 1, a ragged tile, whole tiles, ragged and causal, wrapping round
    (1, 1, 64, False), (1, 1, 128, True), (1, 77, 64, True), (2, 77, 128, False),
    (1, 128, 64, True), (1, 130, 128, True), (1, 200, 64, False), (1, 260, 64, False),
]
# The other arrangements the source builds (-DBWD_WIDE_BLOCK=, -DBWD_STAGGER=, -DBWD_SPLIT=):
# (warps, stagger, split), each on a few shapes. Four warps without BWD_STAGGER is the chapter's
# first kernel; the split applies at D=128 with eight warps only.
ARRANGEMENTS = [(4, False, False), (4, True, False), (8, False, True), (8, True, False), (8, False, False)]
ARRANGEMENT_SHAPES = [(1, 77, 128, True), (1, 200, 64, False)]


def test_tile_constants_read_from_the_source():
    assert all(main_warps(d) in (4, 8) for d in (64, 128)) and C["BWD_STAGGER"] in (0, 1), C
    assert C["BWD_SPLIT"] in (0, 1) and C["SPLIT_KEY_WARPS"] * C["SPLIT_WARP_KEYS"] == 128, C
    assert DQ_WARPS * DQ_TILES * 16 == C["DQ_BLOCK_Q"] and BQ % 16 == 0 and DQ_BKV % 16 == 0 and STAGES >= 2, C
    return (f"main kernel: {main_warps(64)} warps at D=64, {main_warps(128)} at D=128; BWD_STAGGER "
            f"{C['BWD_STAGGER']}, BWD_SPLIT {C['BWD_SPLIT']}")


def test_atomic_version_matches_reference():
    for heads, n, d, causal in SHAPES:
        check_shape(heads, n, d, causal, deterministic=False)
    return f"{len(SHAPES)} shapes, lane-level, every pair visited once, no bank conflicts"


def test_deterministic_version_matches_reference_and_atomics():
    for heads, n, d, causal in SHAPES:
        det = check_shape(heads, n, d, causal, deterministic=True)
        # the same dK and dV as the atomic build (the main kernel is the same but for dQ)
        atom = check_shape(heads, n, d, causal, deterministic=False)
        assert np.array_equal(det[1], atom[1]) and np.array_equal(det[2], atom[2])
    return f"{len(SHAPES)} shapes"


# DETERMINISTIC_DQ's copies: (heads, N, D, causal, copies), blocks that take two or three key
# tiles in turn (N = 700: 3 key tiles of 256 at D=64, 6 of 128 at D=128), and more copies than a
# head's key tiles divide evenly.
COPIES_SHAPES = [(2, 700, 64, True, 1), (1, 700, 128, False, 2), (1, 700, 128, True, 4), (2, 260, 128, True, 2)]


def test_workspace_copies_match_reference_and_atomics():
    for heads, n, d, causal, copies in COPIES_SHAPES:
        det = check_shape(heads, n, d, causal, deterministic=False, copies=copies)
        atom = check_shape(heads, n, d, causal, deterministic=False)
        # the same dK and dV as the atomic build: each key tile's work is the same, only where its dQ goes differs
        assert np.array_equal(det[1], atom[1]) and np.array_equal(det[2], atom[2]), (heads, n, d, causal, copies)
    return f"{len(COPIES_SHAPES)} shapes, 1 to 4 copies"


def test_copies_take_every_key_tile_once_and_even_out():
    """Each key tile of each head in one block's rounds, one block per (copy, head); dq_copies's
    choices at shapes of the bench (132 resident blocks, an H200's SMs at one block each), and the
    causal work of the copies of a head within 7% of each other (back and forth) where they take
    whole pairs of rounds."""
    for heads, key_tiles, resident, want in ((64, 32, 132, 2), (32, 64, 132, 4), (256, 8, 132, 1), (4, 8, 132, 8),
                                             (1, 1, 132, 1), (128, 16, 132, 1), (48, 32, 132, 8)):
        copies = dq_copies(heads, key_tiles, resident)
        assert copies == want, f"dq_copies({heads}, {key_tiles}, {resident}) = {copies}, expected {want}"
        for causal in (False, True):
            seen = Counter((h, t) for h, _, t in main_kernel_key_tiles(heads, key_tiles, causal, copies))
            assert seen == Counter({(h, t): 1 for h in range(heads) for t in range(key_tiles)}), (heads, key_tiles)
        work = Counter()  # causal: a key tile of 128 keys sees 2 (key_tiles - tile) query tiles of 64
        for h, c, t in main_kernel_key_tiles(1, key_tiles, True, copies):
            work[c] += key_tiles - t
        if copies > 1 and key_tiles % (2 * copies) == 0:  # whole pairs of rounds, there and back
            assert max(work.values()) <= 1.07 * min(work.values()), f"{heads} {key_tiles} {copies}: {dict(work)}"
    return "7 shapes"


def test_other_arrangements_match_reference():
    for warps, stagger, split in ARRANGEMENTS:
        for heads, n, d, causal in ARRANGEMENT_SHAPES:
            for deterministic in (False, True):
                check_shape(heads, n, d, causal, deterministic, warps=warps, stagger=stagger, split=split)
    return f"(warps, stagger, split) {ARRANGEMENTS}, {len(ARRANGEMENT_SHAPES)} shapes each, both dQ modes"


# -DBWD_KEY_TILES_D64=1 (D=64: 16 keys per warp, 128 per block, K and V fragments in registers,
# the chapter's kernel before two tiles per warp), beside the default of two: one key block and
# several, ragged, causal (a block whose diagonal spans four query tiles), wrapping.
KEY_TILE_SHAPES = [(1, 1, 64, False), (1, 77, 64, True), (2, 260, 64, False), (1, 300, 64, True),
                   (1, 600, 64, False)]


def test_key_tiles_per_warp_match_reference():
    other = 3 - C["BWD_KEY_TILES_D64"]  # the source's default is checked everywhere above
    for heads, n, d, causal in KEY_TILE_SHAPES:
        for deterministic in (False, True):
            check_shape(heads, n, d, causal, deterministic, warp_key_tiles=other)
    return f"{len(KEY_TILE_SHAPES)} shapes at D=64 with {other} m16 tile(s) of keys per warp, both dQ modes"


# The split kernel's other way of adding dQ (-DBWD_DQ_STAGE= the other value): ragged, causal,
# wrapping round, a tail of rows past N in the staged tile.
DQ_STAGE_SHAPES = [(1, 77, 128, True), (1, 200, 128, False), (2, 300, 128, True)]


def test_dq_stage_other_way_matches_reference():
    other = not C["BWD_DQ_STAGE"]
    for heads, n, d, causal in DQ_STAGE_SHAPES:
        check_shape(heads, n, d, causal, deterministic=False, dq_stage=other)
    return f"{len(DQ_STAGE_SHAPES)} shapes at D=128 with BWD_DQ_STAGE={int(other)} (the source's: {C['BWD_DQ_STAGE']})"


# The dQ kernel's other arrangement, -DDQ_WARP_TILES=1 (16 queries per warp, 64 per block, key
# tiles of 64: the chapter's first dQ kernel), beside the default: ragged, causal, several tiles.
DQ_ARRANGEMENT_SHAPES = [(1, 1, 128, True), (2, 77, 64, True), (1, 200, 128, False), (1, 300, 64, True)]


def test_dq_kernel_arrangements_match_reference():
    other = 3 - DQ_TILES
    for heads, n, d, causal in DQ_ARRANGEMENT_SHAPES:
        q, k, v = reference.make_inputs(1, heads, n, d, 0)
        do = reference.make_grad_output(1, heads, n, d, 0)
        scale, rows = 1 / np.sqrt(d), np.arange(n, dtype=np.int64)
        o, lse = reference.attention_reference(q, k, v, rows, causal, scale)
        want = reference.attention_backward(q, k, v, do, rows, rows, causal, scale)[0][0]
        f64 = [x[0].astype(np.float64) for x in (q, k, v, do)]
        delta = np.sum(f64[3] * o[0], axis=-1)
        for row_tiles in (DQ_TILES, other):
            got = emulate_dq_kernel(*f64, lse[0], delta, causal, scale, row_tiles=row_tiles)
            err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1.0)
            assert err < 1e-10, f"dQ kernel, {row_tiles} m16 tile(s) per warp, H={heads} N={n} D={d}: {err:.2e}"
    return f"{len(DQ_ARRANGEMENT_SHAPES)} shapes, DQ_WARP_TILES {DQ_TILES} and {other}"


def test_workspace_bytes_formula_in_source():
    """workspace_bytes: D rounded up to WORKSPACE_ALIGN, then B*H*N*D floats per copy of dQ's."""
    text = SOURCE.read_text()
    assert re.search(r"return delta_bytes\(s\) \+ copies \* dq_acc;", text)
    assert re.search(r"\(size_t\)s->batch \* s->heads \* s->seqlen \* s->headdim \* sizeof\(float\)", text)


# The kernel's expressions that the emulation above transcribes (in Python's spelling there): if
# one of them changes in attention.cu, this fails until the emulation is changed with it.
KERNEL_EXPRESSIONS = [
    "row0 + lane % MMA_M, ks * STEP_CHUNKS + lane / MMA_M",  # load_a_step
    "np * (2 * MMA_N) + lane % LDM_ROWS + lane / (STEP_CHUNKS * LDM_ROWS) * MMA_N",  # load_k_step (07's)
    "ks * STEP_CHUNKS + lane / LDM_ROWS % STEP_CHUNKS",
    "kk * MMA_K + lane % LDM_ROWS + lane / LDM_ROWS % 2 * LDM_ROWS",  # load_trans_pair
    "dp * 2 + lane / (2 * LDM_ROWS)",
    "kk * MMA_K + lane / (2 * LDM_ROWS) * LDM_ROWS + lane % LDM_ROWS",  # dS from dS^T
    "lane / LDM_ROWS % 2 * LDM_ROWS);",
    "warp_row0 + mt * MMA_M + group + i % 2 * ACC_ROW_STEP",  # dS^T's stores
    "part0 + kk * MMA_K + i / 2 * MMA_N + 2 * quad_lane",
    "KEY_TILES = HEAD_DIM == 64 ? BWD_KEY_TILES_D64 : 1",  # key_tiles
    "BLOCK_KV = BLOCK_WARPS * WARP_KEYS",
    "QUERY_PARTS = KEY_TILES",
    "warp_row0 = warp * BwdConfig<HEAD_DIM>::WARP_KEYS",
    "part0 = part * PART_QUERIES",
    "q_part = q_tile + tile_offset<HEAD_DIM>(part0, 0)",
    "do_part = do_tile + tile_offset<HEAD_DIM>(part0, 0)",
    "load_a_step<HEAD_DIM>(a_frag[mt], k_tile, warp_row0 + mt * MMA_M, ks)",
    "load_a_step<HEAD_DIM>(a_frag[mt], v_tile, warp_row0 + mt * MMA_M, ks)",
    "load_k_step<HEAD_DIM, QUERY_TILES>(q_frag, q_part, ks)",
    "load_k_step<HEAD_DIM, QUERY_TILES>(do_frag, do_part, ks)",
    "load_trans_pair<HEAD_DIM>(do_frag, do_part, kk, dp)",
    "load_trans_pair<HEAD_DIM>(q_frag, q_part, kk, dp)",
    "query0 + part0 + 2 * quad_lane, seqlen, causal",
    "key >= seqlen || query >= seqlen || (causal && key > query)",  # mask_tile
    "query0 + BWD_BLOCK_Q > seqlen || key0 + BLOCK_KV > seqlen || (causal && key0 + BLOCK_KV - 1 > query0)",
    "query0 + DQ_BLOCK_Q > seqlen || key0 + DQ_BLOCK_KV > seqlen || (causal && key0 + DQ_BLOCK_KV - 1 > query0)",
    "BLOCK_WARPS = HEAD_DIM == 128 ? BWD_WARPS_D128 : BWD_WARPS_D64",  # main_warps
    "first_tile = causal || BWD_STAGGER ? key0 / BWD_BLOCK_Q : 0",
    "q_tiles = causal ? query_tiles - first_tile : query_tiles",
    "return (tile < query_tiles ? tile : tile - query_tiles) * BWD_BLOCK_Q",  # step_query0
    "if (tile > 0) add_dq_of_tile<HEAD_DIM, 1>(dq_head, ds_tile, k_tile, step_query0(first_tile, tile - 1, query_tiles)",
    "add_dq_of_tile<HEAD_DIM, 1>(dq_head, ds_tile, k_tile, step_query0(first_tile, q_tiles - 1, query_tiles), seqlen)",
    "return round > 0 ? -1 : (int)(causal ? blockIdx.y : blockIdx.x);",  # round_key_tile
    "const int key_tile = round * copies + (round % 2 ? copies - 1 - copy : copy);",
    "return key_tile < key_tiles ? key_tile : -1;",
    "return DQ_COPIES || !causal ? blockIdx.y : blockIdx.x;",  # block_head
    "dim3(copies, heads) : s->causal ? dim3(heads, key_tiles) : dim3(key_tiles, heads)",  # the grid
    "(blocks + resident - 1) / resident * per_block",  # dq_copies
    "if (best_time < 0 || time < best_time) best = copies, best_time = time;",
    "query_tile = causal ? gridDim.y - 1 - blockIdx.y : blockIdx.x",
    "key_end = causal ? min(seqlen, query0 + DQ_BLOCK_Q) : seqlen",  # the dQ kernel
    "query0 = query_tile * DQ_BLOCK_Q, warp_row0 = warp * ROW_TILES * MMA_M",
    "warp_last_query = query0 + warp_row0 + ROW_TILES * MMA_M - 1",
    "if (causal && key0 > warp_last_query) continue;",
    "query0 + warp_row0 + mt * MMA_M + group, key0 + 2 * quad_lane,",
    "load_a_step<HEAD_DIM>(a_frag[mt], q_tile, warp_row0 + mt * MMA_M, ks)",
    "load_a_step<HEAD_DIM>(a_frag[mt], do_tile, warp_row0 + mt * MMA_M, ks)",
    "mma_16x8x16(dq_acc[mt][2 * dp], ds_frag[mt][kk], k_frag[0], k_frag[1])",
    "query_tiles = ceil_div(s->seqlen, DQ_BLOCK_Q)",
    "QUERY_WARPS = BwdConfig<HEAD_DIM>::DQ_ROW_TILES / WARP_ROW_TILES",  # add_dq_of_tile
    "DQ_WARP_DIMS = HEAD_DIM * QUERY_WARPS / BwdConfig<HEAD_DIM>::BLOCK_WARPS",
    "warp_row0 = warp % QUERY_WARPS * WARP_ROW_TILES * MMA_M, dim0 = warp / QUERY_WARPS * DQ_WARP_DIMS",
    "ds_tile + key * DS_STRIDE + warp_row0 + mt * MMA_M +",
    "query0 + warp_row0 + mt * MMA_M + group",
    # the split kernel (split_block)
    "SPLIT = BWD_SPLIT && HEAD_DIM == 128 && BLOCK_WARPS == 8",
    "warp_key0 = warp % SPLIT_KEY_WARPS * SPLIT_WARP_KEYS",
    "warp_query0 = warp / SPLIT_KEY_WARPS * SPLIT_WARP_QUERIES",
    "warp_dim0 = warp / SPLIT_KEY_WARPS * SPLIT_WARP_DIMS",
    "load_k_step<HEAD_DIM, N>(b_frag, b_tile + tile_offset<HEAD_DIM>(b_row0, 0), ks)",
    "(row0 + lane % MMA_M) * BwdConfig<HEAD_DIM>::DS_STRIDE +",
    "(ks * STEP_CHUNKS + lane / MMA_M) * CHUNK_HALVES",
    "load_trans_pair<HEAD_DIM>(b_frag, b_tile, kk, dim0 / (2 * MMA_N) + dp)",
    "(key0 + mt * MMA_M + group + r * ACC_ROW_STEP) * BwdConfig<HEAD_DIM>::DS_STRIDE",
    "row[query0 + nt * MMA_N + 2 * quad_lane]",
    "pt_tile, score, warp_key0, warp_query0",
    "ds_tile, ds, warp_key0, warp_query0",
    "(dv_acc, pt_tile, warp_key0, do_tile, warp_dim0)",
    "(dk_acc, ds_tile, warp_key0, q_tile, warp_dim0)",
    "add_dq_of_tile<HEAD_DIM, 2>(dq_head, ds_tile, k_tile, query0, seqlen)",
    "lse_tile[col0 + nt * MMA_N + 2 * quad_lane]",  # p_from_scores
    "p_from_scores<QUERY_TILES>(score[mt], lse_tile, part0, scale_log2)",
    "p_from_scores<SPLIT_Q_TILES>(score[mt], lse_tile, warp_query0, scale_log2)",
    "delta_tile[col0 + nt * MMA_N + 2 * quad_lane]",  # ds_from_dp
    "ds_from_dp<QUERY_TILES>(ds[mt], score[mt], delta_tile, part0)",
    "ds_from_dp<SPLIT_Q_TILES>(ds[mt], score[mt], delta_tile, warp_query0)",
    "key0 + warp_key0 + mt * MMA_M + group,",
    "query0 + warp_query0 + 2 * quad_lane, seqlen, causal",
    "key = key_row0 + group + r * ACC_ROW_STEP",  # store_dk_dv
    "dk_acc[mt], dv_acc[mt], key0 + warp_row0 + mt * MMA_M, 0,",
    "dk_acc[mt], dv_acc[mt], key0 + warp_key0 + mt * MMA_M, warp_dim0, seqlen, scale",
    "DQ_DIM_TILES = DQ_WARP_DIMS / MMA_N > 8 ? 8 : DQ_WARP_DIMS / MMA_N",
    "dim0 / (2 * MMA_N) + pass * DQ_DIM_TILES / 2 + dp",
    "dim0 + pass * DQ_DIM_TILES * MMA_N",
    "dim3(heads, key_tiles) : dim3(key_tiles, heads)",
    # the split kernel's staged dQ (stage_and_add_dq)
    "float *row = dq_stage + (row0 + r * ACC_ROW_STEP) * DQ_STAGE_STRIDE",
    "stage_dq_partial<DQ_DIM_TILES>(dq_stage, dq_part[mt], warp_row0 + mt * MMA_M + group, dim0)",
    "*(float2 *)&row[dim0 + nt * MMA_N + 2 * quad_lane]",
    "WARP_ROWS = BWD_BLOCK_Q / BwdConfig<128>::BLOCK_WARPS",
    "row0 = warp * WARP_ROWS, col = 4 * lane",
    "(row0 + k) * DQ_STAGE_STRIDE + col",
    "row = query0 + row0 + k",
    "if (row < seqlen) atomicAdd((float4 *)(dq_head + (size_t)row * 128 + col), four[k])",
    "add_dq_of_tile<HEAD_DIM, 2, true>(dq_head, ds_tile, k_tile, query0, seqlen, dq_stage);",
    "if (tile > 0) add_staged_dq(dq_head, dq_stage, step_query0(first_tile, tile - 1, query_tiles), seqlen);",
    "add_staged_dq(dq_head, dq_stage, step_query0(first_tile, q_tiles - 1, query_tiles), seqlen);",
]


def test_emulated_expressions_are_the_kernels():
    squeeze = lambda s: re.sub(r"\s+", "", s)
    source = squeeze(SOURCE.read_text())
    missing = [e for e in KERNEL_EXPRESSIONS if squeeze(e) not in source]
    assert not missing, f"attention.cu no longer has what the emulation transcribes: {missing}"
    return f"{len(KERNEL_EXPRESSIONS)} expressions"
