"""09_backward's tile loops emulated in NumPy, lane by lane, in float64, against the float64
backward of common/reference.py: the index arithmetic of the kernels checked without a GPU.

The emulation is of the chapter's kernel (09_backward/attention.cu, its constants read from the
source), on each kind of GPU it runs on: eight warps; the first kernel at D=64, two m16 tiles of keys per warp (a
query tile in two parts); at D=128 on sm_90 the split kernel (FlashAttention-2's 4 x 2 warps, P^T
and dS^T through shared memory) with its dQ tile staged and added a whole row per 16-byte RED, and
on sm_80 and sm_89, whose blocks cannot have the split kernel's shared memory, the first kernel
with one m16 tile of keys per warp. The first kernel's dQ atomics as each GPU does them: sm_90's
16-byte REDs (add_dq_partial's two lanes of a quad pair swapping halves), one float at a time before.
Both dQ modes: atomics into one fp32 accumulator (the default), and the deterministic mode's
workspace copies (each block of a head takes its key tiles in rounds, back and forth, into a copy
of its own; the convert kernel sums the copies in order), with dq_copies' choice of copies.

What is followed: the grids and how a block finds its key tile and head, the order of its query
tiles (from the diagonal, wrapping round), the ring's slots, the zero fill of rows past N, the
mask and the tiles that take it, the causal tiles skipped, and every fragment: which lane gives
which ldmatrix row address, what ldmatrix (.trans or not) and mma.sync m16n8k16 then hold (the
register layouts of the PTX ISA), the repacking of accumulators into A operands, dS^T's (and
P^T's) round trip through shared memory, and the dQ atomics, in the kernel's order. Each product
is the kernel's mma.sync on those fragments, in float64 (no fp16 rounding; the k16 steps summed
at once), so the emulation must agree with the reference to rounding error. Shared memory starts
as NaN: a read of anything the kernel did not write shows as a non-finite gradient. It also
checks what the kernel relies on without computing it: that no tile left unmasked needed a mask,
that the skipped tiles and the rows whose atomics are skipped would have added zero, that every
(query, key) pair is visited exactly once, that the ldmatrix reads and the 4- and 8-byte stores
and 16-byte loads hit 32 different banks, and that the 16-byte REDs are aligned. The emulated
expressions are checked to be the kernel's, word for word (KERNEL_EXPRESSIONS).
"""
import functools
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import reference
from claims import strip_comments

CHAPTER = Path(__file__).resolve().parent.parent / "09_backward"
SOURCE = CHAPTER / "attention.cu"  # which includes forward.h, 07's vocabulary (MMA_M, PAD, ...)
LANES = np.arange(32)
GROUP, QUAD = LANES // 4, LANES % 4  # accumulator row (l / 4) and column pair (l % 4)
R_OF, E_OF = np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1])  # accumulator element 2r + e: row + 8r, column + e
ARCHES = ("sm_90", "sm_80")  # sm_80 stands for sm_89 too: neither gives a block the split kernel's shared memory
OPTIN_SMEM = {"sm_80": 163 * 1024, "sm_89": 99 * 1024, "sm_90": 227 * 1024}  # bytes per block (CUDA's guide)
# The emulations of a shape and its reference are computed once (functools.cache) and shared by
# the tests: the module runs on one worker.
pytestmark = pytest.mark.xdist_group("backward_tiling")


def constants():
    """The integer #defines of attention.cu and forward.h that the emulation uses, evaluated (those
    that are arithmetic on others too)."""
    text = (CHAPTER / "forward.h").read_text() + SOURCE.read_text()
    raw = dict(re.findall(r"^#define (\w+) (.+?)\s*(?://.*)?$", text, re.M))
    out = {}

    def value(name):
        if name not in out:
            expr = raw[name].replace("(int)sizeof(__half)", "2").replace("(int)sizeof(float)", "4").replace("/", "//")
            expr = re.sub(r"\b[A-Z_][A-Z0-9_]*\b", lambda m: str(value(m.group(0))), expr)
            out[name] = int(eval(expr, {"__builtins__": {}}))  # integer arithmetic on literals only
        return out[name]

    for name in ("MMA_M", "MMA_N", "MMA_K", "PAD", "CHUNK_HALVES", "BWD_WARP_ROWS", "BWD_WARPS", "BWD_KEY_TILES_D64",
                 "BWD_BLOCK_Q", "BWD_STAGES", "SPLIT_KEY_WARPS", "SPLIT_WARP_KEYS", "SPLIT_WARP_QUERIES",
                 "SPLIT_WARP_DIMS", "DQ_STAGE_STRIDE"):
        value(name)
    return out


C = constants()
BQ, STAGES, PAD = C["BWD_BLOCK_Q"], C["BWD_STAGES"], C["PAD"]
DQ_ROW_TILES = BQ // 16  # m16 tiles of queries per step (BwdConfig::DQ_ROW_TILES)


def ceil_div(a, b):
    return (a + b - 1) // b


class Geometry:
    """BwdConfig<d>, and which main kernel runs on `arch`."""

    def __init__(self, d, arch):
        self.d, self.arch = d, arch
        self.warps = C["BWD_WARPS"]
        self.key_tiles = C["BWD_KEY_TILES_D64"] if d == 64 else 1  # KEY_TILES, and QUERY_PARTS
        self.block_kv = self.warps * C["BWD_WARP_ROWS"] * self.key_tiles
        self.split = d == 128 and self.warps == 8 and split_smem_bytes() <= OPTIN_SMEM[arch]  # main_kernel_of
        self.stride, self.ds_stride = d + PAD, BQ + PAD
        # the kernel's shared memory past the LSE and D rings, in halves: K, V, the Q and dO ring, (P^T,) dS^T
        self.k_base, self.v_base = 0, self.block_kv * self.stride
        self.q_ring = 2 * self.block_kv * self.stride
        self.do_ring = self.q_ring + STAGES * BQ * self.stride
        self.pt_base = self.do_ring + STAGES * BQ * self.stride
        self.ds_base = self.pt_base + (self.block_kv * self.ds_stride if self.split else 0)
        self.halves = self.ds_base + self.block_kv * self.ds_stride


def split_smem_bytes():
    """BwdConfig<128>::SPLIT_SMEM_BYTES with eight warps: the rings, K, V, P^T, dS^T, the staged dQ tile."""
    stride, block_kv = 128 + PAD, 8 * C["BWD_WARP_ROWS"]
    ring = 2 * STAGES * BQ * 4 + (2 * block_kv * stride + 2 * STAGES * BQ * stride) * 2
    return ring + 2 * block_kv * (BQ + PAD) * 2 + BQ * C["DQ_STAGE_STRIDE"] * 4


# --- ldmatrix and mma.sync as the PTX ISA documents them ----------------------------------------
def _inverse(flat_positions):
    order = np.argsort(flat_positions.ravel())
    assert np.array_equal(flat_positions.ravel()[order], np.arange(flat_positions.size)), "not a permutation"
    return order


REG, HALF = np.arange(4)[:, None], np.arange(2)
# A (16 x 16) from lane registers [32][4][2]: a0 (g, 2c), a1 (g+8, 2c), a2 (g, 2c+8), a3 (g+8, 2c+8).
A_FROM = _inverse((GROUP[:, None, None] + 8 * (REG % 2)) * 16 + 2 * QUAD[:, None, None] + HALF + 8 * (REG // 2))
# Two B operands (k16 x n8) from one x4 fragment [32][4][2]: registers 0, 1 the first (b0: k 2c, 2c+1;
# b1: k 2c+8, +9; n g), 2, 3 the second.
B_PAIR_FROM = _inverse(REG // 2 * 128 + (2 * QUAD[:, None, None] + HALF + 8 * (REG % 2)) * 8 + GROUP[:, None, None])
# The accumulator [32][4] of a 16 x 8 tile: c0, c1 (g, 2c, +1), c2, c3 (g+8, ...).
ACC_AT = ((GROUP[:, None] + 8 * R_OF) * 8 + 2 * QUAD[:, None] + E_OF).ravel()


def a_matrix(frag):
    """[..., 32, 4, 2] lane registers of an A operand -> [..., 16, 16]."""
    return frag.reshape(frag.shape[:-3] + (256,))[..., A_FROM].reshape(frag.shape[:-3] + (16, 16))


def b_pair(frag):
    """[..., 32, 4, 2] of an x4 ldmatrix -> its two B operands [..., 2, 16, 8]."""
    return frag.reshape(frag.shape[:-3] + (256,))[..., B_PAIR_FROM].reshape(frag.shape[:-3] + (2, 16, 8))


def b_tiles(frag):
    """[..., P, 32, 4, 2] fragments of pairs of n8 tiles -> [..., 2P, 16, 8], tile 2p + i."""
    pairs = b_pair(frag)
    return pairs.reshape(pairs.shape[:-4] + (-1, 16, 8))


def to_acc(m):
    """[..., 16, 8] -> the accumulator's lane registers [..., 32, 4]."""
    return m.reshape(m.shape[:-2] + (128,))[..., ACC_AT].reshape(m.shape[:-2] + (32, 4))


def pack_a(acc):
    """The kernel's pack_a over pairs of n8 accumulators [..., 2K, 32, 4] -> A operands [..., K, 32, 4, 2]."""
    lo, hi = acc[..., 0::2, :, :], acc[..., 1::2, :, :]
    return np.stack([lo[..., 0:2], lo[..., 2:4], hi[..., 0:2], hi[..., 2:4]], axis=-2)


def distinct(values, what):
    """Each row of values [..., n] holds n different values."""
    ordered = np.sort(values, axis=-1)
    bad = np.nonzero(np.any(np.diff(ordered, axis=-1) == 0, axis=-1))
    assert not bad[0].size, f"{what}: {values[tuple(i[0] for i in bad)].tolist()}"


def ldmatrix_x4(mem, addrs, trans=False):
    """addrs [..., 32] half offsets, lanes 8i..8i+7 the rows of matrix i. Returns [..., 32, 4, 2]:
    lane l's register i holds row l/4, columns 2(l%4), +1 of matrix i (of its transpose with .trans)."""
    assert np.all(addrs % 8 == 0), "ldmatrix rows are 16-byte aligned"
    phases = addrs.reshape(addrs.shape[:-1] + (4, 8))  # one matrix per phase: 8 rows in 8 groups of 4 banks
    distinct(phases * 2 // 16 % 8, "ldmatrix bank conflict: 16-byte groups of a matrix's rows")
    mats = mem[addrs[..., None] + np.arange(8)].reshape(addrs.shape[:-1] + (4, 8, 8))  # [..][matrix][row][col]
    if trans:
        mats = mats.swapaxes(-1, -2)
    return mats[..., GROUP[:, None], 2 * QUAD[:, None] + HALF].swapaxes(-3, -2)


def store_words(mem, addrs, pairs):
    """Lanes' 4-byte stores (two halves each): addrs [..., 32], pairs [..., 32, 2]; 32 different banks."""
    assert np.all(addrs % 2 == 0), "4-byte stores are 4-byte aligned"
    distinct(addrs // 2 % 32, "4-byte store bank conflict: banks")
    mem[addrs] = pairs[..., 0]
    mem[addrs + 1] = pairs[..., 1]


def lanes(x):
    """x with a trailing lane axis to broadcast against."""
    return np.asarray(x)[..., None]


# --- the kernel's helpers: where each lane's row address points -----------------------------------
def tile_offset(stride, row, chunk):
    return row * stride + chunk * 8


def a_step_addrs(base, stride, row0, ks):  # load_a_step: row row0 + l % 16, chunk 2ks + l / 16
    return base + tile_offset(stride, lanes(row0) + LANES % 16, lanes(ks) * 2 + LANES // 16)


def k_step_addrs(base, stride, pair, ks):  # load_k_step (07's): key 16np + l % 8 + 8 (l / 16), chunk 2ks + l / 8 % 2
    return base + tile_offset(stride, lanes(pair) * 16 + LANES % 8 + LANES // 16 * 8, lanes(ks) * 2 + LANES // 8 % 2)


def trans_pair_addrs(base, stride, kk, dp):  # load_trans_pair: row 16kk + l % 8 + 8 (l / 8 % 2), chunk 2dp + l / 16
    return base + tile_offset(stride, lanes(kk) * 16 + LANES % 8 + LANES // 8 % 2 * 8, lanes(dp) * 2 + LANES // 16)


def key_query_step_addrs(base, ds_stride, row0, kk):  # load_a_step_key_query: [key][query] rows
    return base + (lanes(row0) + LANES % 16) * ds_stride + (lanes(kk) * 2 + LANES // 16) * 8


def load_tile(mem, base, stride, src, row0, rows, seqlen):
    """load_tile_async: rows row0.. of src [N, D] at base, zero-filled past seqlen (the padding untouched)."""
    index = row0 + np.arange(rows)
    block = np.where((index < seqlen)[:, None], src[np.minimum(index, seqlen - 1)], 0.0)
    mem[base + np.arange(rows)[:, None] * stride + np.arange(src.shape[1])] = block


def mask_needed(query0, key0, seqlen, causal, block_kv):
    return query0 + BQ > seqlen or key0 + block_kv > seqlen or (causal and key0 + block_kv - 1 > query0)


def hidden(key, query, seqlen, causal):  # mask_tile's predicate
    return (key >= seqlen) | (query >= seqlen) | (causal & (key > query))


def element_rows(row0):
    """The rows of a lane's accumulator elements [..., 32, 4]: row0 + l / 4 + 8r (mask_tile's row0 + r * 8)."""
    return lanes(row0)[..., None] + GROUP[:, None] + 8 * R_OF


def element_cols(col0, tiles):
    """The columns of a lane's elements of n8 tiles [..., tiles, 32, 4]: col0 + 8nt + 2 (l % 4) + e."""
    return (np.asarray(col0)[..., None, None, None] + 8 * np.arange(tiles)[:, None, None] + 2 * QUAD[:, None]
            + E_OF)


class Block:
    """One block of the main kernel: its shared memory (NaN until written, kept across its rounds), its
    LSE and D ring, and the head's tensors, dQ accumulator (its copy) and outputs it writes."""

    def __init__(self, g, run, head, dq_acc):
        self.g, self.run, self.head, self.dq_acc = g, run, head, dq_acc
        self.mem = np.full(g.halves, np.nan)
        self.lse_ring, self.delta_ring = np.full((STAGES, BQ), np.nan), np.full((STAGES, BQ), np.nan)
        self.stage = np.full((BQ, C["DQ_STAGE_STRIDE"]), np.nan)  # the split kernel's staged dQ tile (sm_90)
        self.seqlen, self.causal = run.seqlen, run.causal

    def fill(self, slot, query0):
        """load_query_tile_async: Q, dO, LSE and D of the tile at query0 into ring slot `slot`."""
        g, run, h = self.g, self.run, self.head
        load_tile(self.mem, g.q_ring + slot * BQ * g.stride, g.stride, run.q[h], query0, BQ, self.seqlen)
        load_tile(self.mem, g.do_ring + slot * BQ * g.stride, g.stride, run.do[h], query0, BQ, self.seqlen)
        rows = query0 + np.arange(BQ)
        ok, at = rows < self.seqlen, np.minimum(rows, self.seqlen - 1)
        self.lse_ring[slot] = np.where(ok, run.lse[h][at], 0.0)
        self.delta_ring[slot] = np.where(ok, run.delta[h][at], 0.0)

    def visit(self, keys, queries, hide):
        """The (query, key) pairs a product's unmasked elements stand for, counted."""
        keys, queries, hide = np.broadcast_arrays(keys, queries, hide)
        np.add.at(self.run.visits[self.head], (queries[~hide], keys[~hide]), 1)

    def masked(self, score, keys, queries, masked_here, what):
        """mask_tile where the kernel calls it; where it does not, no element needed it."""
        hide = hidden(keys, queries, self.seqlen, self.causal)
        self.visit(keys, queries, hide)
        if masked_here:
            return np.where(hide, -np.inf, score)
        assert not hide.any(), f"{what} needed the mask it skips"
        return score

    def key_block(self, key_tile):
        """backward_key_block (or split_key_block): one key tile's dK and dV, its share of dQ."""
        g = self.g
        key0 = key_tile * g.block_kv
        query_tiles = ceil_div(self.seqlen, BQ)
        first_tile = key0 // BQ  # the diagonal, causal or not
        n_tiles = query_tiles - first_tile if self.causal else query_tiles
        assert n_tiles >= 1
        if self.causal and first_tile > 0:  # the skipped query tiles: every key of the block after every query
            assert first_tile * BQ - 1 < key0

        def step_query0(step):  # the loop's query tiles: from first_tile on, wrapping round
            tile = first_tile + step
            assert tile < 2 * query_tiles
            return (tile if tile < query_tiles else tile - query_tiles) * BQ

        load_tile(self.mem, g.k_base, g.stride, self.run.k[self.head], key0, g.block_kv, self.seqlen)
        load_tile(self.mem, g.v_base, g.stride, self.run.v[self.head], key0, g.block_kv, self.seqlen)
        for t in range(STAGES - 1):
            if t < n_tiles:
                self.fill(t, step_query0(t))
        loop = self.split_loop if g.split else self.first_loop
        dk_acc, dv_acc, key_row0, dim0 = loop(key0, n_tiles, step_query0)
        self.store_dk_dv(dk_acc, dv_acc, key_row0, dim0)

    # --- the first kernel (backward_key_block) ----------------------------------------------------
    def first_loop(self, key0, n_tiles, step_query0):
        g, d, mem = self.g, self.g.d, self.mem
        kt, parts = g.key_tiles, g.key_tiles  # m16 tiles of keys per warp; parts of a query tile
        part_queries = BQ // parts
        q_tiles_n8, k_steps, q_steps, dim_tiles = part_queries // 8, d // 16, part_queries // 16, d // 8
        row0 = np.arange(g.warps)[:, None] * 16 * kt + np.arange(kt) * 16  # [warp][mt]: warp_row0 + mt * 16
        part0 = np.arange(parts) * part_queries
        dk_acc, dv_acc = np.zeros((g.warps, kt, dim_tiles, 32, 4)), np.zeros((g.warps, kt, dim_tiles, 32, 4))
        log2e = 1 / np.log(2)
        ks, kk = np.arange(k_steps), np.arange(q_steps)
        for tile in range(n_tiles):
            nxt = tile + STAGES - 1
            if nxt < n_tiles:
                self.fill(nxt % STAGES, step_query0(nxt))
            if tile > 0:  # the last tile's dQ, after the barrier at the top
                self.add_dq_of_tile(step_query0(tile - 1), 1)
            slot, query0 = tile % STAGES, step_query0(tile)
            q_part = (g.q_ring + slot * BQ * g.stride + part0 * g.stride)[:, None, None, None]  # [part]
            do_part = (g.do_ring + slot * BQ * g.stride + part0 * g.stride)[:, None, None, None]

            def rows_by_parts(a_base, b_part):  # K Q^T or V dO^T: [warp][mt][part][n8 tile][lane][4]
                a = a_matrix(ldmatrix_x4(mem, a_step_addrs(a_base, g.stride, row0[..., None], ks)))
                b = b_tiles(ldmatrix_x4(mem, k_step_addrs(b_part, g.stride, np.arange(q_tiles_n8 // 2),
                                                          ks[:, None])))
                return to_acc(np.einsum("wtkab,pknbc->wtpnac", a, b))

            def add_keys_by_dims(acc, a_frags, b_part):  # acc += P^T dO or dS^T Q over the parts' queries
                b = b_tiles(ldmatrix_x4(mem, trans_pair_addrs(b_part, g.stride, kk[:, None],
                                                              np.arange(dim_tiles // 2)), trans=True))
                acc += to_acc(np.einsum("wtpkab,pkdbc->wtdac", a_matrix(a_frags), b))

            keys = element_rows(key0 + row0)[:, :, None, None]  # [warp][mt][1][1][lane][4]
            queries = element_cols(query0 + part0, q_tiles_n8)  # [part][n8 tile][lane][4]
            score = self.masked(rows_by_parts(g.k_base, q_part), keys, queries,
                                mask_needed(query0, key0, self.seqlen, self.causal, g.block_kv),
                                f"tile (keys {key0}, queries {query0})")
            cols = element_cols(part0, q_tiles_n8)  # p_from_scores, ds_from_dp: the tile's column (query)
            p = np.exp2(score * self.run.scale_log2 - self.lse_ring[slot][cols] * log2e)  # P^T
            add_keys_by_dims(dv_acc, pack_a(p), do_part)  # dV += P^T dO
            ds = p * (rows_by_parts(g.v_base, do_part) - self.delta_ring[slot][cols])  # dS^T = P^T (dP^T - D)
            ds_frag = pack_a(ds)  # [warp][mt][part][kk][lane][4][2]
            add_keys_by_dims(dk_acc, ds_frag, q_part)  # dK += dS^T Q
            # dS^T to shared memory, after a barrier (every warp has read the last tile's), over it:
            # A register i of (mt, kk) is key + 8 (i % 2), queries + 8 (i / 2)
            i = np.arange(4)[:, None]
            key = row0[:, :, None, None, None, None] + GROUP + i % 2 * 8
            query = part0[:, None, None, None] + kk[:, None, None] * 16 + i // 2 * 8 + 2 * QUAD
            store_words(mem, g.ds_base + key * g.ds_stride + query, ds_frag.swapaxes(-3, -2))
        self.add_dq_of_tile(step_query0(n_tiles - 1), 1)  # the last tile's dQ, after the loop
        return dk_acc, dv_acc, key0 + row0, np.zeros_like(row0)

    # --- the split kernel (split_key_block, D=128, sm_90) -------------------------------------------
    def split_loop(self, key0, n_tiles, step_query0):
        g, mem = self.g, self.mem
        key_warps, warp_keys, warp_queries, warp_dims = (C[n] for n in ("SPLIT_KEY_WARPS", "SPLIT_WARP_KEYS",
                                                                           "SPLIT_WARP_QUERIES", "SPLIT_WARP_DIMS"))
        m_tiles, q_tiles, d_tiles = warp_keys // 16, warp_queries // 8, warp_dims // 8
        w = np.arange(8)
        kw0, qw0, dw0 = w % key_warps * warp_keys, w // key_warps * warp_queries, w // key_warps * warp_dims
        mt_row0 = kw0[:, None] + np.arange(m_tiles) * 16  # [warp][mt]
        ks, kk = np.arange(g.d // 16), np.arange(BQ // 16)
        dk_acc, dv_acc = np.zeros((8, m_tiles, d_tiles, 32, 4)), np.zeros((8, m_tiles, d_tiles, 32, 4))
        log2e = 1 / np.log(2)

        def rows_times_rows(a_base, b_base):  # [warp][mt][nt][lane][4] += A B^T over the dims
            a = a_matrix(ldmatrix_x4(mem, a_step_addrs(a_base, g.stride, mt_row0[..., None], ks)))
            b = b_tiles(ldmatrix_x4(mem, k_step_addrs(b_base + qw0[:, None, None, None] * g.stride, g.stride,
                                                      np.arange(q_tiles // 2), ks[:, None])))
            return to_acc(np.einsum("wmkab,wknbc->wmnac", a, b))

        def keys_times_queries(acc, a_base, b_base):  # acc += A B over the tile's queries
            a = a_matrix(ldmatrix_x4(mem, key_query_step_addrs(a_base, g.ds_stride, mt_row0[..., None], kk)))
            dp = (dw0 // 16)[:, None, None] + np.arange(d_tiles // 2)  # [warp][1][dp]
            b = b_tiles(ldmatrix_x4(mem, trans_pair_addrs(b_base, g.stride, kk[:, None], dp), trans=True))
            acc += to_acc(np.einsum("wmkab,wkdbc->wmdac", a, b))

        def store_key_query(base, acc):  # [warp][mt][nt][lane][4] as fp16 pairs, one store per (mt, r, nt)
            r = np.arange(2)[:, None, None]
            key = mt_row0[:, :, None, None, None] + GROUP + 8 * r  # [warp][mt][r][1][lane]
            query = qw0[:, None, None, None, None] + np.arange(q_tiles)[:, None] * 8 + 2 * QUAD  # [warp][..][nt][lane]
            pairs = np.stack([acc[..., 0:2], acc[..., 2:4]], axis=2)  # [warp][mt][r][nt][lane][2]
            store_words(mem, base + key * g.ds_stride + query, pairs)

        for tile in range(n_tiles):
            nxt = tile + STAGES - 1
            if nxt < n_tiles:
                self.fill(nxt % STAGES, step_query0(nxt))
            slot, query0 = tile % STAGES, step_query0(tile)
            q_tile, do_tile = g.q_ring + slot * BQ * g.stride, g.do_ring + slot * BQ * g.stride
            if tile > 0:  # the last tile's dQ, staged: every warp's part is in
                self.add_staged_dq(step_query0(tile - 1))
            keys = element_rows(key0 + mt_row0)[:, :, None]  # [warp][mt][1][lane][4]
            queries = element_cols(query0 + qw0, q_tiles)[:, None]  # [warp][1][nt][lane][4]
            score = self.masked(rows_times_rows(g.k_base, q_tile), keys, queries,
                                mask_needed(query0, key0, self.seqlen, self.causal, g.block_kv),
                                f"split tile (keys {key0}, queries {query0})")
            cols = element_cols(qw0, q_tiles)[:, None]
            p = np.exp2(score * self.run.scale_log2 - self.lse_ring[slot][cols] * log2e)
            store_key_query(g.pt_base, p)
            ds = p * (rows_times_rows(g.v_base, do_tile) - self.delta_ring[slot][cols])
            store_key_query(g.ds_base, ds)
            # __syncthreads: P^T and dS^T of the whole block are in
            keys_times_queries(dv_acc, g.pt_base, do_tile)
            keys_times_queries(dk_acc, g.ds_base, q_tile)
            self.add_dq_of_tile(query0, 2, staged=True)  # added at the next tile's top
        self.add_staged_dq(step_query0(n_tiles - 1))
        return dk_acc, dv_acc, key0 + mt_row0, np.repeat(dw0[:, None], m_tiles, axis=1)

    # --- dQ -------------------------------------------------------------------------------------
    def add_dq_of_tile(self, query0, row_tiles, staged=False):
        """dQ += dS K from dS^T in shared memory: warp w takes `row_tiles` m16 tiles of queries
        (w % query_warps) against every key of the block, for its dims (w / query_warps), in passes
        of <= 8 n8 tiles; then add_dq_partial (or, staged, stage_dq_partial) of each m16 tile."""
        g = self.g
        query_warps = DQ_ROW_TILES // row_tiles
        warp_dims = g.d * query_warps // g.warps  # DQ_WARP_DIMS
        dim_tiles = min(warp_dims // 8, 8)  # DQ_DIM_TILES
        passes = warp_dims // 8 // dim_tiles
        w = np.arange(g.warps)
        warp_row0, dim0 = w % query_warps * row_tiles * 16, w // query_warps * warp_dims
        kk = np.arange(g.block_kv // 16)
        key = lanes(kk) * 16 + LANES // 16 * 8 + LANES % 8  # dS from dS^T: lane l gives key 16kk + 8 (l / 16) + l % 8
        rows = warp_row0[:, None, None, None] + np.arange(row_tiles)[:, None, None] * 16 + LANES // 8 % 2 * 8
        ds_a = a_matrix(ldmatrix_x4(self.mem, g.ds_base + key * g.ds_stride + rows, trans=True))  # [w][mt][kk]
        dp = (dim0[:, None, None] // 16 + np.arange(passes)[:, None] * dim_tiles // 2 + np.arange(dim_tiles // 2))
        k_b = b_tiles(ldmatrix_x4(self.mem, trans_pair_addrs(g.k_base, g.stride, kk[:, None, None],
                                                             dp[:, None]), trans=True))  # [w][kk][pass][nt]
        part = to_acc(np.einsum("wmkab,wkpnbc->wmpnac", ds_a, k_b))  # [warp][mt][pass][nt][lane][4]
        row0 = warp_row0[:, None] + np.arange(row_tiles) * 16  # [warp][mt]: the m16 tile's first query
        if staged:  # stage_dq_partial at dim0 in every pass (there is one)
            for pas in range(passes):
                self.stage_dq_partial(part[:, :, pas], row0, dim0)
        elif g.arch == "sm_90":
            self.add_dq_partial_red4(part, query0 + row0, dim0[:, None] + np.arange(passes) * dim_tiles * 8)
        else:
            self.add_dq_partial_scalar(part, query0 + row0, dim0[:, None] + np.arange(passes) * dim_tiles * 8)

    def add_dq_partial_red4(self, part, row0, dim0):
        """add_dq_partial on sm_90: the lanes of a quad pair swap half their values, then each adds
        four adjacent dims of one row (red.global.add.v4.f32), rows past N skipped."""
        odd = (QUAD % 2 == 1)[:, None]
        give = np.where(odd, part[..., 0:2], part[..., 2:4])
        got = give[..., LANES ^ 1, :]
        four = np.where(odd, np.concatenate([got, part[..., 2:4]], -1), np.concatenate([part[..., 0:2], got], -1))
        row = lanes(row0)[:, :, None, None] + GROUP + np.where(odd[:, 0], 8, 0)  # [warp][mt][1][1][lane]
        col = lanes(dim0)[:, None, :, None] + np.arange(part.shape[3])[:, None] * 8 + 2 * (QUAD - QUAD % 2)
        assert np.all(col % 4 == 0), "a 16-byte RED's address is not 16-byte aligned"
        self.atomic_add(row[..., None], col[..., None] + np.arange(4), four)

    def add_dq_partial_scalar(self, part, row0, dim0):
        """add_dq_partial before sm_90: each float alone, rows row0 + l / 4 + 8r, past N skipped."""
        row = element_rows(row0)[:, :, None, None]  # [warp][mt][1][1][lane][4]
        col = lanes(dim0)[:, None, :, None, None] + np.arange(part.shape[3])[:, None, None] * 8 + 2 * QUAD[:, None]
        self.atomic_add(row, col + E_OF, part)

    def atomic_add(self, row, col, values):
        row, col, values = np.broadcast_arrays(row, col, values)
        ok = row < self.seqlen
        assert np.all(values[~ok] == 0), "a skipped atomic (query past N) was not zero"
        np.add.at(self.dq_acc[self.head], (row[ok], col[ok]), values[ok])

    def stage_dq_partial(self, part, row0, dim0):
        """stage_dq_partial: a warp's m16 tile of partial, rows row0 + l / 4 (+ 8), dims dim0 + 8nt +
        2 (l % 4), as float2 stores to the staged tile: a half-warp's 32 words in 32 banks."""
        r = np.arange(2)[:, None, None]
        row = row0[:, :, None, None, None] + GROUP + 8 * r  # [warp][mt][r][1][lane]
        col = dim0[:, None, None, None, None] + np.arange(part.shape[2])[:, None] * 8 + 2 * QUAD  # [..][nt][lane]
        words = row * C["DQ_STAGE_STRIDE"] + col
        halves = words.reshape(words.shape[:-1] + (2, 16))
        distinct(((halves[..., None] + HALF) % 32).reshape(halves.shape[:-1] + (32,)),
                 "staged dQ store bank conflict: banks")
        values = np.stack([part[..., 0:2], part[..., 2:4]], axis=2)  # [warp][mt][r][nt][lane][2]
        row, col = np.broadcast_arrays(row, col)
        self.stage[row, col], self.stage[row, col + 1] = values[..., 0], values[..., 1]

    def add_staged_dq(self, query0):
        """add_staged_dq: after a barrier, warp w adds the staged tile's whole rows 8w.. into the
        accumulator, lane l four dims 4l.. per row, one 16-byte RED each; the stage is then stale."""
        warp_rows = BQ // 8
        row = np.arange(8)[:, None] * warp_rows + np.arange(warp_rows)  # [warp][k]
        words = row[..., None] * C["DQ_STAGE_STRIDE"] + 4 * LANES
        assert np.all(words % 4 == 0), "a staged row's 16-byte load is not aligned"
        quarters = words.reshape(words.shape[:-1] + (4, 8))  # a 16-byte load's phase: 8 lanes, 32 banks
        distinct(((quarters[..., None] + np.arange(4)) % 32).reshape(quarters.shape[:-1] + (32,)),
                 "staged dQ load bank conflict: banks")
        four = self.stage[row[..., None, None], 4 * LANES[:, None] + np.arange(4)]  # [warp][k][lane][4]
        assert not np.isnan(four).any(), "add_staged_dq read a part of the stage no warp wrote for this tile"
        self.atomic_add(query0 + row[..., None, None], 4 * LANES[:, None] + np.arange(4), four)
        self.stage[:] = np.nan

    def store_dk_dv(self, dk_acc, dv_acc, key_row0, dim0):
        """store_dk_dv of each m16 tile [warp][mt]: rows key_row0 + l / 4 + 8r, dims dim0 + 8nt + 2 (l % 4) + e."""
        key = element_rows(key_row0)[:, :, None]  # [warp][mt][1][lane][4]
        col = element_cols(dim0, dk_acc.shape[2])  # [warp][mt][nt][lane][4]
        key, col = np.broadcast_arrays(key, col)
        ok = key < self.seqlen
        run, h = self.run, self.head
        at = key[ok] * self.g.d + col[ok]
        assert np.unique(at).size == at.size and np.all(np.isnan(run.dk[h].flat[at])), \
            "a dK or dV element written twice"
        run.dk[h][key[ok], col[ok]] = dk_acc[ok] * run.scale
        run.dv[h][key[ok], col[ok]] = dv_acc[ok]


# --- the grid ------------------------------------------------------------------------------------
def round_key_tile(rnd, key_tiles, causal, grid, bx, by, copies):
    """The kernel's round_key_tile: the key tile of block (bx, by)'s round `rnd`, -1 past its last.
    With the deterministic mode's copies (grid (copies, b*h)) one of every `copies` tiles, back and forth."""
    if copies:
        key_tile = rnd * grid[0] + (grid[0] - 1 - bx if rnd % 2 else bx)
        return key_tile if key_tile < key_tiles else -1
    return -1 if rnd > 0 else (by if causal else bx)


def main_kernel_blocks(heads, key_tiles, causal, copies):
    """(head, copy, [key tiles of its rounds]) of each block of the main kernel, in its grid's order:
    grid (copies, b*h) in the deterministic mode (copies > 0), else (key tiles, b*h), causal (b*h, key
    tiles), and copy 0 (block_head, block_dq_copy)."""
    grid = (copies, heads) if copies else ((heads, key_tiles) if causal else (key_tiles, heads))
    for by in range(grid[1]):
        for bx in range(grid[0]):
            rounds = []
            while (key_tile := round_key_tile(len(rounds), key_tiles, causal, grid, bx, by, copies)) >= 0:
                rounds.append(key_tile)
            yield by if copies or not causal else bx, bx if copies else 0, rounds


def main_kernel_key_tiles(heads, key_tiles, causal, copies):
    """(head, copy, key tile) of the main kernel in the order its blocks and their rounds run."""
    for head, copy, rounds in main_kernel_blocks(heads, key_tiles, causal, copies):
        for key_tile in rounds:
            yield head, copy, key_tile


def dq_copies(heads, key_tiles, resident):
    """The launcher's dq_copies in the deterministic mode: the fewest blocks per head that take the heads'
    key tiles in the least (rounds of `resident` blocks) x (key tiles per block)."""
    best, best_time = 1, -1
    for copies in range(1, key_tiles + 1):
        time = ceil_div(heads * copies, resident) * ceil_div(key_tiles, copies)
        if best_time < 0 or time < best_time:
            best, best_time = copies, time
    return best


class Run:
    """One backward of one shape: the inputs (float64, [heads][N][D]), the forward's LSE, D, what
    the kernels write, and which (query, key) pairs they visited."""

    def __init__(self, inputs, o, lse, causal, scale):
        self.q, self.k, self.v, self.do = inputs
        heads, self.seqlen, d = self.q.shape
        self.lse, self.causal, self.scale, self.scale_log2 = lse, causal, scale, scale / np.log(2)
        self.delta = np.sum(self.do * o, axis=-1)  # (1) preprocess: D = rowsum(dO * O)
        self.dk, self.dv = np.full((heads, self.seqlen, d), np.nan), np.full((heads, self.seqlen, d), np.nan)
        self.visits = np.zeros((heads, self.seqlen, self.seqlen), dtype=np.int64)


def emulate_backward(inputs, o, lse, causal, scale, arch, copies=0):
    """dQ, dK, dV [heads, N, D] and D [heads, N] as 09's kernels compute them on `arch` (float64);
    copies > 0: the deterministic mode's main kernel, `copies` blocks per head, each into its own copy."""
    run = Run(inputs, o, lse, causal, scale)
    heads, seqlen, d = run.q.shape
    g = Geometry(d, arch)
    dq_acc_copies = np.zeros((max(copies, 1), heads, seqlen, d))  # (1) the workspace's copies, zeroed
    for head, copy, rounds in main_kernel_blocks(heads, ceil_div(seqlen, g.block_kv), causal, copies):  # (2)
        block = Block(g, run, head, dq_acc_copies[copy])
        for key_tile in rounds:
            block.key_block(key_tile)
    want = np.tril(np.ones((seqlen, seqlen), np.int64)) if causal else np.ones((seqlen, seqlen), np.int64)
    assert np.array_equal(run.visits, np.broadcast_to(want, run.visits.shape)), \
        "a (query, key) pair visited not exactly once"
    dq = dq_acc_copies[0].copy()  # (3) convert: the copies summed in order, scaled
    for extra in dq_acc_copies[1:]:
        dq += extra
    return dq * scale, run.dk, run.dv, run.delta


# --- the checks ----------------------------------------------------------------------------------
@functools.cache
def reference_backward(heads, seqlen, d, causal):
    """The inputs (float64 [heads][N][D]), O, LSE and the reference's dQ, dK, dV, D of one shape."""
    q, k, v = reference.make_inputs(1, heads, seqlen, d, 0)
    do = reference.make_grad_output(1, heads, seqlen, d, 0)
    scale, rows = 1 / np.sqrt(d), np.arange(seqlen, dtype=np.int64)
    o, lse = reference.attention_reference(q, k, v, rows, causal, scale)
    want = [w[0] for w in reference.attention_backward(q, k, v, do, rows, rows, causal, scale)]
    return tuple(x[0].astype(np.float64) for x in (q, k, v, do)), o[0], lse[0], scale, want


@functools.cache
def emulated(heads, seqlen, d, causal, arch, copies=0):
    """The emulation of one shape, checked against the reference (to 1e-10 relative)."""
    inputs, o, lse, scale, want = reference_backward(heads, seqlen, d, causal)
    got = emulate_backward(inputs, o, lse, causal, scale, arch, copies)
    for name, g, w in zip(("dQ", "dK", "dV", "D"), got, want):
        what = f"{name} at H={heads} N={seqlen} D={d} causal={causal} on {arch} copies={copies}"
        assert np.all(np.isfinite(g)), f"{what}: {np.count_nonzero(~np.isfinite(g))} non-finite values"
        err = np.linalg.norm(g - w) / max(np.linalg.norm(w), 1.0)
        assert err < 1e-10, f"{what}: relative error {err:.2e}"
    return got


# (heads, N, D, causal): N = 1; one key tile with a ragged query tile; whole tiles, no mask at all;
# several key tiles with a ragged last one and a ragged last query tile (D=64: 256 keys a block,
# D=128: 128), causal diagonal tiles across several query tiles, wrapping round (not causal), two heads.
SHAPES = [(1, 1, 64, False), (1, 1, 128, True), (2, 77, 64, True), (1, 128, 128, False), (1, 300, 64, True),
          (1, 300, 64, False), (1, 300, 128, False), (2, 300, 128, True)]
CASES = [(*shape, arch) for shape in SHAPES for arch in ARCHES]


def case_id(heads, n, d, causal, *rest):
    return f"H{heads}-N{n}-D{d}-{'causal' if causal else 'full'}" + "".join(f"-{x}" for x in rest)


def test_tile_constants_read_from_the_source():
    """The source's constants are within what the emulation follows."""
    assert (C["MMA_M"], C["MMA_N"], C["MMA_K"], C["CHUNK_HALVES"], C["BWD_WARP_ROWS"]) == (16, 8, 16, 8, 16), C
    assert C["BWD_WARPS"] == 8 and C["BWD_KEY_TILES_D64"] in (1, 2), C
    assert BQ % 16 == 0 and STAGES >= 2, C
    assert C["SPLIT_KEY_WARPS"] * C["SPLIT_WARP_KEYS"] == 128 and C["SPLIT_WARP_DIMS"] * 2 == 128, C


def test_split_kernel_runs_where_its_shared_memory_fits():
    """main_kernel_of runs the split kernel where a block may have SPLIT_SMEM_BYTES: sm_90, not
    sm_80 or sm_89 (which run the first kernel at D=128, as the emulation does)."""
    need = split_smem_bytes()
    fits = {arch: need <= optin for arch, optin in OPTIN_SMEM.items()}
    assert fits == {"sm_80": False, "sm_89": False, "sm_90": True}, \
        f"the split kernel's {need} bytes of shared memory fit {fits}; the emulation runs it on sm_90 alone"
    assert [Geometry(128, arch).split for arch in ARCHES] == [True, False]


@pytest.mark.parametrize("heads, n, d, causal, arch", CASES, ids=[case_id(*case) for case in CASES])
def test_default_build_matches_reference(heads, n, d, causal, arch):
    """The atomic build, lane by lane: dQ, dK, dV and D to rounding error, every pair once."""
    emulated(heads, n, d, causal, arch)


# The deterministic mode's copies: (heads, N, D, causal, copies): one block taking two key tiles in turn
# (D=64), two copies of three key tiles (D=128: the second takes two, back and forth) not causal
# and causal with two heads.
COPIES_CASES = [(1, 300, 64, True, 1, "sm_90"), (1, 300, 128, False, 2, "sm_90"), (2, 300, 128, True, 2, "sm_90"),
                (1, 300, 128, False, 2, "sm_80")]


@pytest.mark.parametrize("heads, n, d, causal, copies, arch", COPIES_CASES,
                         ids=[case_id(h, n, d, c, f"{k}copies", a) for h, n, d, c, k, a in COPIES_CASES])
def test_workspace_copies_match_reference_and_atomics(heads, n, d, causal, copies, arch):
    det = emulated(heads, n, d, causal, arch, copies)
    atom = emulated(heads, n, d, causal, arch)
    # the same dK and dV as the atomic build: each key tile's work is the same, only where its dQ goes differs
    assert np.array_equal(det[1], atom[1]) and np.array_equal(det[2], atom[2]), \
        f"copies={copies}: dK or dV differ from the atomic build's"


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
    "BLOCK_WARPS = BWD_WARPS",  # Geometry
    "first_tile = key0 / BWD_BLOCK_Q",
    "q_tiles = causal ? query_tiles - first_tile : query_tiles",
    "return (tile < query_tiles ? tile : tile - query_tiles) * BWD_BLOCK_Q",  # step_query0
    "if (tile > 0) add_dq_of_tile<HEAD_DIM, 1>(dq_head, ds_tile, k_tile,"
    " step_query0(first_tile, tile - 1, query_tiles)",
    "add_dq_of_tile<HEAD_DIM, 1>(dq_head, ds_tile, k_tile, step_query0(first_tile, q_tiles - 1, query_tiles), seqlen)",
    "if constexpr (!DETERMINISTIC) return round > 0 ? -1 : (int)(causal ? blockIdx.y : blockIdx.x);",
    "const int key_tile = round * copies + (round % 2 ? copies - 1 - copy : copy);",
    "return key_tile < key_tiles ? key_tile : -1;",
    "return DETERMINISTIC || !causal ? blockIdx.y : blockIdx.x;",  # block_head
    "return DETERMINISTIC ? dq_acc + (size_t)blockIdx.x * gridDim.y * seqlen * HEAD_DIM : dq_acc;",  # block_dq_copy
    "dim3(copies, heads) : s->causal ? dim3(heads, key_tiles) : dim3(key_tiles, heads)",  # the grid
    "*copies = DETERMINISTIC ? dq_copies(s->batch * s->heads, key_tiles, resident) : 1;",
    "(blocks + resident - 1) / resident * per_block",  # dq_copies
    "if (best_time < 0 || time < best_time) best = copies, best_time = time;",
    "for (int copy = 1; copy < copies; copy++)",  # convert_dq_kernel: the copies summed in order
    "QUERY_WARPS = BwdConfig<HEAD_DIM>::DQ_ROW_TILES / WARP_ROW_TILES",  # add_dq_of_tile
    "DQ_WARP_DIMS = HEAD_DIM * QUERY_WARPS / BwdConfig<HEAD_DIM>::BLOCK_WARPS",
    "warp_row0 = warp % QUERY_WARPS * WARP_ROW_TILES * MMA_M, dim0 = warp / QUERY_WARPS * DQ_WARP_DIMS",
    "ds_tile + key * DS_STRIDE + warp_row0 + mt * MMA_M +",
    "DQ_DIM_TILES = DQ_WARP_DIMS / MMA_N > 8 ? 8 : DQ_WARP_DIMS / MMA_N",
    "dim0 / (2 * MMA_N) + pass * DQ_DIM_TILES / 2 + dp",
    "add_dq_partial<HEAD_DIM, DQ_DIM_TILES>(dq_head, dq_part[mt], query0 + warp_row0 + mt * MMA_M + group,",
    "dim0 + pass * DQ_DIM_TILES * MMA_N, seqlen)",
    # add_dq_partial: sm_90's quad pairs and 16-byte REDs, the scalar atomics before
    "const int row = row0 + (odd ? ACC_ROW_STEP : 0), col = dim0 + 2 * (quad_lane - quad_lane % 2);",
    "const float give_x = odd ? part[nt][0] : part[nt][2], give_y = odd ? part[nt][1] : part[nt][3];",
    "got_x = __shfl_xor_sync(0xffffffff, give_x, 1), got_y = __shfl_xor_sync(0xffffffff, give_y, 1);",
    "four[nt] = odd ? make_float4(got_x, got_y, part[nt][2], part[nt][3])"
    " : make_float4(part[nt][0], part[nt][1], got_x, got_y);",
    "atomicAdd((float4 *)(dq_row + nt * MMA_N), four[nt])",
    "float *dq_row = dq_head + (size_t)row * HEAD_DIM + dim0 + 2 * quad_lane;",
    "atomicAdd(dq_row + nt * MMA_N, part[nt][2 * r]);",
    "atomicAdd(dq_row + nt * MMA_N + 1, part[nt][2 * r + 1]);",
    # which main kernel runs: the split one where its shared memory fits (main_kernel_of)
    "SPLIT = HEAD_DIM == 128",
    "if (smem_optin >= BwdConfig<HEAD_DIM>::SPLIT_SMEM_BYTES)",
    "SPLIT_SMEM_BYTES = RING_BYTES + 2 * KEY_QUERY_HALVES * (int)sizeof(__half) + DQ_STAGE_BYTES",
    "RING_BYTES = 2 * BWD_STAGES * BWD_BLOCK_Q * (int)sizeof(float) +"
    " (2 * KV_HALVES + 2 * BWD_STAGES * Q_HALVES) * (int)sizeof(__half)",
    "DQ_STAGE_BYTES = BWD_BLOCK_Q * DQ_STAGE_STRIDE * 4",
    "KV_HALVES = BLOCK_KV * STRIDE, Q_HALVES = BWD_BLOCK_Q * STRIDE",
    "DS_STRIDE = BWD_BLOCK_Q + PAD, KEY_QUERY_HALVES = BLOCK_KV * DS_STRIDE",
    "#if __CUDA_ARCH__ >= 900",
    # the split kernel (split_key_block)
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
    "lse_tile[col0 + nt * MMA_N + 2 * quad_lane]",  # p_from_scores
    "p_from_scores<QUERY_TILES>(score[mt], lse_tile, part0, scale_log2)",
    "p_from_scores<SPLIT_Q_TILES>(score[mt], lse_tile, warp_query0, scale_log2)",
    "delta_tile[col0 + nt * MMA_N + 2 * quad_lane]",  # ds_from_dp
    "ds_from_dp<QUERY_TILES>(ds[mt], score[mt], delta_tile, part0)",
    "ds_from_dp<SPLIT_Q_TILES>(ds[mt], score[mt], delta_tile, warp_query0)",
    "key0 + warp_key0 + mt * MMA_M + group,",
    "query0 + warp_query0 + 2 * quad_lane, seqlen, causal",
    "key = key_row0 + group + r * ACC_ROW_STEP",  # store_dk_dv
    "dk_row = dk_head + key * HEAD_DIM + dim0 + 2 * quad_lane",
    "dk_acc[mt], dv_acc[mt], key0 + warp_row0 + mt * MMA_M, 0,",
    "dk_acc[mt], dv_acc[mt], key0 + warp_key0 + mt * MMA_M, warp_dim0, seqlen, scale",
    # the split kernel's staged dQ (stage_dq_partial, add_staged_dq)
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
    """Each transcribed expression is in the kernel's code, attention.cu and the forward.h it includes
    (comments, such as an exercise's stub, left out)."""
    squeeze = lambda s: re.sub(r"\s+", "", s)
    code = squeeze(strip_comments((CHAPTER / "forward.h").read_text() + SOURCE.read_text()))
    missing = [e for e in KERNEL_EXPRESSIONS if squeeze(e) not in code]
    assert not missing, f"attention.cu (or forward.h) no longer has what the emulation transcribes: {missing}"
