// 09_backward, step 6 of 8: at D=128, FlashAttention-2's split of the warps over each product, P^T
// and dS^T passed between the products through shared memory. The rest is step 5's.
//
// The backward pass, FlashAttention-2's, on 07's datapath (mma.sync m16n8k16, ldmatrix, a cp.async
// ring, operands repacked in registers); the forward is 07's (forward.h).
//
// Three kernels: (1) D = rowsum(dO * O) per query row into the workspace, and the fp32 dQ
// accumulator zeroed; (2) one block per (key tile, b*h), eight warps, 256 keys at D=64 (two m16
// tiles per warp) and 128 at D=128, K and V in shared memory for the whole loop, Q, dO, LSE and D
// streamed through a cp.async ring, 64 queries at a time; each warp owns its keys' dK and dV
// accumulators (at D=128, FlashAttention-2's split of the warps, below). It recomputes S^T = K Q^T
// and P^T = exp(S^T * scale - LSE), then dV += P^T dO, dP^T = V dO^T, dS^T = P^T * (dP^T - D), dK +=
// dS^T Q, and adds dQ += dS K into the fp32 accumulator (atomics); (3) dQ to fp16.
#include "../common/harness.h"
#include "forward.h"

// --- Configuration -------------------------------------------------------------------------
// Eight warps per block: with 16 keys per warp (D=128) they hold 128 keys, FlashAttention-2's
// block, so each Q and dO tile is read, and each dQ row summed before its atomics, once per 128 keys.
#define BWD_WARPS 8
// A warp's rows come in m16 tiles: 16 keys or 16 queries. At D=128 one per warp in the main
// kernel: two, as 07's forward has, would need 2 x 16 x D fp32 accumulators for each of dK and
// dV, 256 registers per lane before any score.
#define BWD_WARP_ROWS MMA_M
// At D=64, two m16 tiles of keys per warp (128 registers of dK and dV), so that each fragment of
// Q and dO read from shared memory feeds two MMAs: eight warps hold 256 keys, a query tile is
// taken in two parts of 32 (S^T and dP^T stay 64 registers), and K and V are re-read at every step.
#define BWD_KEY_TILES_D64 2
#define BWD_BLOCK_Q 64       // queries per step of the main kernel's loop
#define BWD_STAGES 2         // (Q, dO, LSE, D) tiles in the main kernel's ring
#define WORKSPACE_ALIGN 256  // bytes: the dQ accumulator starts aligned for 16-byte accesses

static_assert(BWD_BLOCK_Q % MMA_K == 0, "whole k16 steps of queries");

template <int HEAD_DIM>
struct BwdConfig {
    static constexpr int BLOCK_WARPS = BWD_WARPS;
    static constexpr int BLOCK_THREADS = BLOCK_WARPS * WARP_SIZE;
    static constexpr int KEY_TILES = HEAD_DIM == 64 ? BWD_KEY_TILES_D64 : 1;  // m16 tiles of keys per warp
    static constexpr int WARP_KEYS = KEY_TILES * BWD_WARP_ROWS;
    static constexpr int BLOCK_KV = BLOCK_WARPS * WARP_KEYS;  // keys per block: 256 at D=64, 128 at D=128
    static constexpr int QUERY_PARTS = KEY_TILES;             // a query tile in parts, S^T's registers the same
    // Eight warps per SM at up to 255 registers each fill its 64 K registers: one block of eight.
    static constexpr int MIN_BLOCKS = 8 / BLOCK_WARPS;
    // dQ += dS K of a query tile: warp w takes the 16 queries of m16 tile w % DQ_ROW_TILES, against
    // every key of the block, for DQ_WARP_DIMS of the dims (half of them with eight warps).
    static constexpr int DQ_ROW_TILES = BWD_BLOCK_Q / MMA_M;  // 4
    static constexpr int DQ_WARP_DIMS = HEAD_DIM * DQ_ROW_TILES / BLOCK_WARPS;
    static constexpr int STRIDE = HEAD_DIM + PAD;  // halves per row, as the forward's tiles
    static constexpr int KV_HALVES = BLOCK_KV * STRIDE, Q_HALVES = BWD_BLOCK_Q * STRIDE;
    // A [key][query] tile of the block (dS^T, P^T).
    static constexpr int DS_STRIDE = BWD_BLOCK_Q + PAD, KEY_QUERY_HALVES = BLOCK_KV * DS_STRIDE;
    // Main kernel: the LSE and D ring (floats), K and V, the Q and dO ring, dS^T.
    static constexpr int RING_BYTES = 2 * BWD_STAGES * BWD_BLOCK_Q * (int)sizeof(float) +
                                      (2 * KV_HALVES + 2 * BWD_STAGES * Q_HALVES) * (int)sizeof(__half);
    static constexpr int SMEM_BYTES = RING_BYTES + KEY_QUERY_HALVES * (int)sizeof(__half);
    // At D=128 the split kernel, with P^T and dS^T both in shared memory: 173 KiB, more than
    // sm_80's 163 KiB per block, where the kernel above runs instead. Not at
    // D=64, which has two tiles of keys per warp instead (NOTES.md).
    static constexpr bool SPLIT = HEAD_DIM == 128;
    static constexpr int SPLIT_SMEM_BYTES = RING_BYTES + 2 * KEY_QUERY_HALVES * (int)sizeof(__half);
    // A warp's K and V rows, the A operands that are the same at every step, take HEAD_DIM / 2
    // registers per lane and m16 tile for the two. At D=64 with one m16 tile of keys they would
    // stay in registers; with two, or at D=128, where the fp32 accumulators of dK and dV hold 128
    // registers already, they are re-read from shared memory at every step.
    static constexpr bool A_IN_REGISTERS = HEAD_DIM == 64 && KEY_TILES == 1;
    static_assert(KEY_TILES == 1 || KEY_TILES == 2, "one or two m16 tiles of keys per warp");
    static_assert(DQ_WARP_DIMS % (2 * MMA_N) == 0, "a warp's dims of dQ are whole pairs of n8 tiles");
};

// --- Fragments of the backward's products ---------------------------------------------------
// The A fragments of k16 step `ks` of a warp's 16 rows of a [row][dim] tile (07's load_q_step
// for one m16 tile). Lane l gives row l % 16, in chunk l / 16 of the step.
template <int HEAD_DIM>
__device__ void load_a_step(unsigned frag[A_REGS], const __half *tile, int row0, int ks) {
    const int lane = threadIdx.x % WARP_SIZE;
    ldmatrix_x4(frag, tile + tile_offset<HEAD_DIM>(row0 + lane % MMA_M, ks * STEP_CHUNKS + lane / MMA_M));
}

// The same from a [key][query] tile (P^T, dS^T: DS_STRIDE halves per row), k16 step ks over queries.
template <int HEAD_DIM>
__device__ void load_a_step_key_query(unsigned frag[A_REGS], const __half *tile, int row0, int ks) {
    const int lane = threadIdx.x % WARP_SIZE;
    ldmatrix_x4(frag, tile + (row0 + lane % MMA_M) * BwdConfig<HEAD_DIM>::DS_STRIDE +
                          (ks * STEP_CHUNKS + lane / MMA_M) * CHUNK_HALVES);
}

// The B fragments of two n8 tiles of columns (16 dims, dims 16dp..) at k16 step kk of a
// [row][dim] tile whose rows are the k dimension (07's V in O += P V): ldmatrix.trans.
// Lane l gives row 16kk + l % 8 + 8 * (l / 8 % 2), in chunk 2dp + l / 16.
template <int HEAD_DIM>
__device__ void load_trans_pair(unsigned frag[2 * B_REGS], const __half *tile, int kk, int dp) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int row = kk * MMA_K + lane % LDM_ROWS + lane / LDM_ROWS % 2 * LDM_ROWS;
    ldmatrix_x4_trans(frag, tile + tile_offset<HEAD_DIM>(row, dp * 2 + lane / (2 * LDM_ROWS)));
}

// A tile's LSE and D, one float per query: threads 0..63 copy LSE, 64..127 D, the others (eight
// warps) none (4-byte copies: a head's rows start at any float). Rows past seqlen are zero-filled
// (their scores are masked).
__device__ void load_rows_async(float *lse_tile, float *delta_tile, const float *lse, const float *delta, int row0,
                                int seqlen) {
    if (threadIdx.x >= 2 * BWD_BLOCK_Q) return;
    const int row = threadIdx.x % BWD_BLOCK_Q;
    const bool is_lse = threadIdx.x < BWD_BLOCK_Q, valid = row0 + row < seqlen;  // is_lse: the same per warp
    const float *from = is_lse ? lse : delta;
    __pipeline_memcpy_async((is_lse ? lse_tile : delta_tile) + row, valid ? from + row0 + row : from, sizeof(float),
                            valid ? 0 : sizeof(float));
}

// The main kernel's ring slot of query tile `tile`: Q, dO, LSE and D (one commit group).
template <int HEAD_DIM>
__device__ void load_query_tile_async(__half *q_ring, __half *do_ring, float *lse_ring, float *delta_ring,
                                      const __half *q_head, const __half *do_head, const float *lse_head,
                                      const float *delta_head, int slot, int query0, int seqlen) {
    constexpr int Q_HALVES = BwdConfig<HEAD_DIM>::Q_HALVES, BLOCK_THREADS = BwdConfig<HEAD_DIM>::BLOCK_THREADS;
    load_tile_async<HEAD_DIM, BWD_BLOCK_Q, BLOCK_THREADS>(q_ring + slot * Q_HALVES, q_head, query0, seqlen);
    load_tile_async<HEAD_DIM, BWD_BLOCK_Q, BLOCK_THREADS>(do_ring + slot * Q_HALVES, do_head, query0, seqlen);
    load_rows_async(lse_ring + slot * BWD_BLOCK_Q, delta_ring + slot * BWD_BLOCK_Q, lse_head, delta_head, query0,
                    seqlen);
}

// -inf wherever the key is past the end, the query is past the end, or (causal) the key comes
// after the query, in S^T: element [nt][2r+e] is key key0 + 8r, query query0 + 8nt + e (the
// lane's first: key0 = first key + l / 4, query0 = first query + 2 (l % 4)). Only on the tiles
// that need it.
template <int COL_TILES>
__device__ void mask_tile(float score[COL_TILES][ACC_REGS], int key0, int query0, int seqlen, int causal) {
#pragma unroll
    for (int r = 0; r < ACC_ROWS; r++) {
        const int key = key0 + r * ACC_ROW_STEP;
#pragma unroll
        for (int nt = 0; nt < COL_TILES; nt++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int query = query0 + nt * MMA_N + e;
                if (key >= seqlen || query >= seqlen || (causal && key > query)) score[nt][2 * r + e] = -INFINITY;
            }
    }
}

// P^T = exp(S^T * scale - LSE) in place of S^T, for one m16 tile of keys against COL_TILES n8
// tiles of queries from col0 on. LSE is the forward's: no running max, no sum. The columns are
// queries, so each of a lane's columns has its own LSE (shared memory, broadcast).
template <int COL_TILES>
__device__ void p_from_scores(float score[COL_TILES][ACC_REGS], const float *lse_tile, int col0, float scale_log2) {
    const int quad_lane = threadIdx.x % QUAD_LANES;
#pragma unroll
    for (int nt = 0; nt < COL_TILES; nt++) {
        const float2 col_lse = *(const float2 *)&lse_tile[col0 + nt * MMA_N + 2 * quad_lane];
#pragma unroll
        for (int r = 0; r < ACC_ROWS; r++) {
            score[nt][2 * r] = exp2_approx(fmaf(score[nt][2 * r], scale_log2, -col_lse.x * LOG2E));
            score[nt][2 * r + 1] = exp2_approx(fmaf(score[nt][2 * r + 1], scale_log2, -col_lse.y * LOG2E));
        }
    }
}

// dS^T = P^T * (dP^T - D) in place of dP^T, for one m16 tile of keys against COL_TILES n8 tiles of
// the query tile's queries from col0 on; D per column (query), as LSE is in P^T. Masked entries
// have P = 0, so dS = 0 there whatever dP is.
template <int COL_TILES>
__device__ void ds_from_dp(float ds[COL_TILES][ACC_REGS], const float score[COL_TILES][ACC_REGS],
                           const float *delta_tile, int col0) {
    const int quad_lane = threadIdx.x % QUAD_LANES;
#pragma unroll
    for (int nt = 0; nt < COL_TILES; nt++) {
        const float2 row_delta = *(const float2 *)&delta_tile[col0 + nt * MMA_N + 2 * quad_lane];
#pragma unroll
        for (int r = 0; r < ACC_ROWS; r++) {
            ds[nt][2 * r] = score[nt][2 * r] * (ds[nt][2 * r] - row_delta.x);
            ds[nt][2 * r + 1] = score[nt][2 * r + 1] * (ds[nt][2 * r + 1] - row_delta.y);
        }
    }
}

// Two n8 accumulator tiles (16 columns) of one m16 tile, as the A operand of a k16 step over
// those columns (07's repacking of P), rounded to fp16.
__device__ void pack_a(unsigned frag[A_REGS], const float lo[ACC_REGS], const float hi[ACC_REGS]) {
    frag[0] = pack_half2(lo[0], lo[1]);
    frag[1] = pack_half2(lo[2], lo[3]);
    frag[2] = pack_half2(hi[0], hi[1]);
    frag[3] = pack_half2(hi[2], hi[3]);
}

// dK = scale * dS^T Q and dV of one m16 tile of keys from key_row0 on, DIM_TILES n8 tiles of
// dims from dim0 on: each row written once, as fp16.
template <int HEAD_DIM, int DIM_TILES>
__device__ void store_dk_dv(__half *dk_head, __half *dv_head, const float dk_acc[DIM_TILES][ACC_REGS],
                            const float dv_acc[DIM_TILES][ACC_REGS], int key_row0, int dim0, int seqlen, float scale) {
    const int group = threadIdx.x % WARP_SIZE / QUAD_LANES, quad_lane = threadIdx.x % QUAD_LANES;
#pragma unroll
    for (int r = 0; r < ACC_ROWS; r++) {
        const int key = key_row0 + group + r * ACC_ROW_STEP;
        if (key >= seqlen) continue;
        __half *dk_row = dk_head + key * HEAD_DIM + dim0 + 2 * quad_lane;
        __half *dv_row = dv_head + key * HEAD_DIM + dim0 + 2 * quad_lane;
#pragma unroll
        for (int nt = 0; nt < DIM_TILES; nt++) {
            *(unsigned *)&dk_row[nt * MMA_N] = pack_half2(dk_acc[nt][2 * r] * scale, dk_acc[nt][2 * r + 1] * scale);
            *(unsigned *)&dv_row[nt * MMA_N] = pack_half2(dv_acc[nt][2 * r], dv_acc[nt][2 * r + 1]);
        }
    }
}

// A warp's dQ partial (n8 tiles of dims from dim0, rows row0 and row0 + 8 of the lane's group)
// added into the fp32 accumulator. sm_90 has vector reductions (red.global.add.v4.f32): the two
// lanes of a quad pair swap half their values so that the even lane holds four adjacent dims of
// the first row and the odd lane four of the second, one 16-byte RED each instead of four 4-byte
// ones. Older GPUs add each float alone.
template <int HEAD_DIM, int DIM_TILES>
__device__ void add_dq_partial(float *dq_head, const float part[DIM_TILES][ACC_REGS], int row0, int dim0, int seqlen) {
    const int quad_lane = threadIdx.x % QUAD_LANES;
#if __CUDA_ARCH__ >= 900
    const bool odd = quad_lane % 2;
    const int row = row0 + (odd ? ACC_ROW_STEP : 0), col = dim0 + 2 * (quad_lane - quad_lane % 2);
    float4 four[DIM_TILES];  // every swap first, then the REDs from one address, under one branch
#pragma unroll
    for (int nt = 0; nt < DIM_TILES; nt++) {
        const float give_x = odd ? part[nt][0] : part[nt][2], give_y = odd ? part[nt][1] : part[nt][3];
        const float got_x = __shfl_xor_sync(0xffffffff, give_x, 1), got_y = __shfl_xor_sync(0xffffffff, give_y, 1);
        four[nt] = odd ? make_float4(got_x, got_y, part[nt][2], part[nt][3])
                       : make_float4(part[nt][0], part[nt][1], got_x, got_y);
    }
    if (row < seqlen) {
        float *dq_row = dq_head + (size_t)row * HEAD_DIM + col;
#pragma unroll
        for (int nt = 0; nt < DIM_TILES; nt++) atomicAdd((float4 *)(dq_row + nt * MMA_N), four[nt]);
    }
#else
#pragma unroll
    for (int r = 0; r < ACC_ROWS; r++) {
        const int row = row0 + r * ACC_ROW_STEP;
        if (row >= seqlen) continue;
        float *dq_row = dq_head + (size_t)row * HEAD_DIM + dim0 + 2 * quad_lane;
#pragma unroll
        for (int nt = 0; nt < DIM_TILES; nt++) {
            atomicAdd(dq_row + nt * MMA_N, part[nt][2 * r]);
            atomicAdd(dq_row + nt * MMA_N + 1, part[nt][2 * r + 1]);
        }
    }
#endif
}

// dQ += dS K for the query tile at query0, dS^T from shared memory ([key][query]): warp w takes
// WARP_ROW_TILES m16 tiles of queries (the warps side by side over the tile's queries,
// QUERY_WARPS of them, w % QUERY_WARPS) against every key of the block, for its DQ_WARP_DIMS
// dims, and adds that partial into the fp32 accumulator in device memory. One m16 tile per warp
// is the first kernel's (16 queries x 64 dims at D=128: the whole dS row, half of K); the split
// kernel takes two (32 queries x 32 dims: FlashAttention-2's, a quarter of K, four fewer
// ldmatrix per step). In passes of at most 8 n8 tiles (64 dims): with four warps at D=128, the
// whole 16 x 128 partial beside dK and dV made sm_80's ptxas spill.
template <int HEAD_DIM, int WARP_ROW_TILES>
__device__ void add_dq_of_tile(float *dq_head, const __half *ds_tile, const __half *k_tile, int query0, int seqlen) {
    constexpr int BLOCK_KV = BwdConfig<HEAD_DIM>::BLOCK_KV, DS_STRIDE = BwdConfig<HEAD_DIM>::DS_STRIDE;
    constexpr int QUERY_WARPS = BwdConfig<HEAD_DIM>::DQ_ROW_TILES / WARP_ROW_TILES;
    constexpr int DQ_WARP_DIMS = HEAD_DIM * QUERY_WARPS / BwdConfig<HEAD_DIM>::BLOCK_WARPS;
    constexpr int KEY_STEPS = BLOCK_KV / MMA_K;                                        // k16 steps of dS K
    constexpr int DQ_DIM_TILES = DQ_WARP_DIMS / MMA_N > 8 ? 8 : DQ_WARP_DIMS / MMA_N;  // n8 tiles per pass
    static_assert(DQ_WARP_DIMS % (2 * MMA_N) == 0, "a warp's dims of dQ are whole pairs of n8 tiles");
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE, group = lane / QUAD_LANES;
    const int warp_row0 = warp % QUERY_WARPS * WARP_ROW_TILES * MMA_M, dim0 = warp / QUERY_WARPS * DQ_WARP_DIMS;
#pragma unroll
    for (int pass = 0; pass < DQ_WARP_DIMS / MMA_N / DQ_DIM_TILES; pass++) {
        float dq_part[WARP_ROW_TILES][DQ_DIM_TILES][ACC_REGS] = {};
#pragma unroll
        for (int kk = 0; kk < KEY_STEPS; kk++) {
            // dS as the A operand from dS^T: ldmatrix.trans; matrix l / 8 holds queries
            // + 8 (l / 8 % 2) and keys + 8 (l / 16): lane l gives key row 16kk + 8 (l / 16) + l % 8.
            unsigned ds_a[WARP_ROW_TILES][A_REGS];
            const int key = kk * MMA_K + lane / (2 * LDM_ROWS) * LDM_ROWS + lane % LDM_ROWS;
#pragma unroll
            for (int mt = 0; mt < WARP_ROW_TILES; mt++)
                ldmatrix_x4_trans(ds_a[mt],
                                  ds_tile + key * DS_STRIDE + warp_row0 + mt * MMA_M + lane / LDM_ROWS % 2 * LDM_ROWS);
#pragma unroll
            for (int dp = 0; dp < DQ_DIM_TILES / 2; dp++) {
                unsigned k_frag[2 * B_REGS];
                load_trans_pair<HEAD_DIM>(k_frag, k_tile, kk, dim0 / (2 * MMA_N) + pass * DQ_DIM_TILES / 2 + dp);
#pragma unroll
                for (int mt = 0; mt < WARP_ROW_TILES; mt++) {
                    mma_16x8x16(dq_part[mt][2 * dp], ds_a[mt], k_frag[0], k_frag[1]);
                    mma_16x8x16(dq_part[mt][2 * dp + 1], ds_a[mt], k_frag[2], k_frag[3]);
                }
            }
        }
#pragma unroll
        for (int mt = 0; mt < WARP_ROW_TILES; mt++)
            add_dq_partial<HEAD_DIM, DQ_DIM_TILES>(dq_head, dq_part[mt], query0 + warp_row0 + mt * MMA_M + group,
                                                   dim0 + pass * DQ_DIM_TILES * MMA_N, seqlen);
    }
}

// (1) D_i = sum_d dO[i, d] * O[i, d] in fp32, and row i of the dQ accumulator zeroed. Grid:
// (row tiles, b*h); CHUNKS lanes per row, each with 8 of its D elements.
template <int HEAD_DIM>
__global__ void __launch_bounds__(THREADS)
    backward_preprocess_kernel(const __half *o, const __half *d_o, float *delta, float *dq_acc, int seqlen) {
    constexpr int CHUNKS = HEAD_DIM / CHUNK_HALVES, ROWS = THREADS / CHUNKS;
    static_assert(WARP_SIZE % CHUNKS == 0, "a row's lanes are in one warp");
    const int row = blockIdx.x * ROWS + threadIdx.x / CHUNKS, chunk = threadIdx.x % CHUNKS;
    const bool valid = row < seqlen;
    const size_t at = ((size_t)blockIdx.y * seqlen + (valid ? row : 0)) * HEAD_DIM + chunk * CHUNK_HALVES;
    float sum = 0.0f;
    if (valid) {
        const uint4 o_raw = *(const uint4 *)(o + at), do_raw = *(const uint4 *)(d_o + at);
        const __half2 *o2 = (const __half2 *)&o_raw, *do2 = (const __half2 *)&do_raw;
#pragma unroll
        for (int i = 0; i < CHUNK_HALVES / 2; i++) {
            const float2 a = __half22float2(o2[i]), b = __half22float2(do2[i]);
            sum = fmaf(a.x, b.x, fmaf(a.y, b.y, sum));
        }
    }
#pragma unroll
    for (int offset = CHUNKS / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
    if (!valid) return;
    if (chunk == 0) delta[(size_t)blockIdx.y * seqlen + row] = sum;
    float4 *to = (float4 *)(dq_acc + at);
    to[0] = to[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

// The first query of step `step` of the main kernel's loop, which starts at query tile first_tile
// and wraps round past the last of the query_tiles (first_tile + step < 2 query_tiles).
__device__ int step_query0(int first_tile, int step, int query_tiles) {
    const int tile = first_tile + step;
    return (tile < query_tiles ? tile : tile - query_tiles) * BWD_BLOCK_Q;
}

// (2) dK and dV of one tile of BLOCK_KV keys (and its share of dQ).
template <int HEAD_DIM>
__device__ void backward_key_block(const __half *q, const __half *k, const __half *v, const __half *d_o,
                                   const float *lse, const float *delta, float *dq_acc, __half *dk, __half *dv,
                                   int seqlen, float scale, float scale_log2, int causal, int key_tile, size_t head) {
    constexpr int KV_HALVES = BwdConfig<HEAD_DIM>::KV_HALVES, Q_HALVES = BwdConfig<HEAD_DIM>::Q_HALVES;
    constexpr int BLOCK_KV = BwdConfig<HEAD_DIM>::BLOCK_KV, BLOCK_THREADS = BwdConfig<HEAD_DIM>::BLOCK_THREADS;
    constexpr bool A_IN_REGISTERS = BwdConfig<HEAD_DIM>::A_IN_REGISTERS;
    constexpr int KEY_TILES = BwdConfig<HEAD_DIM>::KEY_TILES;      // m16 tiles of keys per warp: 2 (D=64), 1
    constexpr int QUERY_PARTS = BwdConfig<HEAD_DIM>::QUERY_PARTS;  // parts of a query tile: as many
    constexpr int PART_QUERIES = BWD_BLOCK_Q / QUERY_PARTS;        // queries per part: 32 (D=64), 64
    constexpr int QUERY_TILES = PART_QUERIES / MMA_N;              // n8 tiles of S^T per m16 tile and part: 4, 8
    constexpr int DIM_TILES = HEAD_DIM / MMA_N;                    // n8 tiles of dK, dV
    constexpr int K_STEPS = HEAD_DIM / MMA_K;                      // k16 steps of S^T = K Q^T and dP^T = V dO^T
    constexpr int Q_STEPS = PART_QUERIES / MMA_K;                  // k16 steps of dV += P^T dO and dK += dS^T Q
    extern __shared__ __align__(128) unsigned char smem[];
    float *lse_ring = (float *)smem;                                     // [BWD_STAGES][BWD_BLOCK_Q]
    float *delta_ring = lse_ring + BWD_STAGES * BWD_BLOCK_Q;             // [BWD_STAGES][BWD_BLOCK_Q]
    __half *k_tile = (__half *)(delta_ring + BWD_STAGES * BWD_BLOCK_Q);  // [BLOCK_KV][STRIDE]
    __half *v_tile = k_tile + KV_HALVES;                                 // [BLOCK_KV][STRIDE]
    __half *q_ring = v_tile + KV_HALVES;                                 // [BWD_STAGES][BWD_BLOCK_Q][STRIDE]
    __half *do_ring = q_ring + BWD_STAGES * Q_HALVES;                    // [BWD_STAGES][BWD_BLOCK_Q][STRIDE]

    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int group = lane / QUAD_LANES, quad_lane = lane % QUAD_LANES;  // accumulator row and column pair
    const int key0 = key_tile * BLOCK_KV, warp_row0 = warp * BwdConfig<HEAD_DIM>::WARP_KEYS;  // in the key tile
    const __half *q_head = q + head * seqlen * HEAD_DIM, *do_head = d_o + head * seqlen * HEAD_DIM;
    const float *lse_head = lse + head * seqlen, *delta_head = delta + head * seqlen;

    // The loop starts at the query tile that holds query key0 (the diagonal). Causal: the queries
    // before it see none of this block's keys, so the loop ends at the last tile. Otherwise it
    // wraps round to tile 0 and ends before the diagonal: the blocks of a head start at different
    // query tiles, so they do not add into the same dQ rows at the same time.
    const int query_tiles = ceil_div(seqlen, BWD_BLOCK_Q);
    const int first_tile = key0 / BWD_BLOCK_Q;
    const int q_tiles = causal ? query_tiles - first_tile : query_tiles;  // >= 1: key0 < seqlen

    // K and V of the block join the first commit group; then the first BWD_STAGES - 1 query tiles.
    load_tile_async<HEAD_DIM, BLOCK_KV, BLOCK_THREADS>(k_tile, k + head * seqlen * HEAD_DIM, key0, seqlen);
    load_tile_async<HEAD_DIM, BLOCK_KV, BLOCK_THREADS>(v_tile, v + head * seqlen * HEAD_DIM, key0, seqlen);
    for (int t = 0; t < BWD_STAGES - 1; t++) {
        if (t < q_tiles)
            load_query_tile_async<HEAD_DIM>(q_ring, do_ring, lse_ring, delta_ring, q_head, do_head, lse_head,
                                            delta_head, t, step_query0(first_tile, t, query_tiles), seqlen);
        __pipeline_commit();
    }

    // On chip for the whole loop: the warp's 16 x HEAD_DIM dK and dV accumulators (per m16 tile of keys).
    float dk_acc[KEY_TILES][DIM_TILES][ACC_REGS] = {}, dv_acc[KEY_TILES][DIM_TILES][ACC_REGS] = {};
    unsigned k_regs[A_IN_REGISTERS ? K_STEPS : 1][A_REGS], v_regs[A_IN_REGISTERS ? K_STEPS : 1][A_REGS];
    __half *ds_tile = do_ring + BWD_STAGES * Q_HALVES;  // [BLOCK_KV][DS_STRIDE]: dS^T of the last tile
    float *dq_head = dq_acc + head * seqlen * HEAD_DIM;

    for (int tile = 0; tile < q_tiles; tile++) {
        // 07's ring: tile `tile` has landed once at most BWD_STAGES-2 younger groups are in flight.
        __pipeline_wait_prior(BWD_STAGES - 2);
        __syncthreads();  // ...for every thread's copies; the slot refilled next is consumed; dS^T is in
        const int next = tile + BWD_STAGES - 1;
        if (next < q_tiles)
            load_query_tile_async<HEAD_DIM>(q_ring, do_ring, lse_ring, delta_ring, q_head, do_head, lse_head,
                                            delta_head, next % BWD_STAGES, step_query0(first_tile, next, query_tiles),
                                            seqlen);
        __pipeline_commit();  // possibly empty: keeps one group per tile
        // The last tile's dQ, now that the barrier above has made its dS^T every warp's.
        if (tile > 0)
            add_dq_of_tile<HEAD_DIM, 1>(dq_head, ds_tile, k_tile, step_query0(first_tile, tile - 1, query_tiles),
                                        seqlen);
        const int slot = tile % BWD_STAGES, query0 = step_query0(first_tile, tile, query_tiles);
        const __half *q_tile = q_ring + slot * Q_HALVES, *do_tile = do_ring + slot * Q_HALVES;
        const float *lse_tile = lse_ring + slot * BWD_BLOCK_Q, *delta_tile = delta_ring + slot * BWD_BLOCK_Q;

        if constexpr (A_IN_REGISTERS) {  // K and V landed with the first tile
            if (tile == 0)
                for (int ks = 0; ks < K_STEPS; ks++) {
                    load_a_step<HEAD_DIM>(k_regs[ks], k_tile, warp_row0, ks);
                    load_a_step<HEAD_DIM>(v_regs[ks], v_tile, warp_row0, ks);
                }
        }

        // A tile's queries in QUERY_PARTS parts (two of 32 at D=64; one, the whole tile, at D=128),
        // each through every product.
#pragma unroll
        for (int part = 0; part < QUERY_PARTS; part++) {
            const int part0 = part * PART_QUERIES;  // the part's first query in the tile
            const __half *q_part = q_tile + tile_offset<HEAD_DIM>(part0, 0);
            const __half *do_part = do_tile + tile_offset<HEAD_DIM>(part0, 0);

            // S^T = K Q^T: the warp's keys (16 per m16 tile) x the part's queries. Q [query][dim] is the "col"
            // B operand as K is in the forward, so 07's load_k_step loads it.
            float score[KEY_TILES][QUERY_TILES][ACC_REGS] = {};
#pragma unroll
            for (int ks = 0; ks < K_STEPS; ks++) {
                unsigned a_frag[KEY_TILES][A_REGS], q_frag[QUERY_TILES / 2][2 * B_REGS];
                if constexpr (!A_IN_REGISTERS)
                    for (int mt = 0; mt < KEY_TILES; mt++)
                        load_a_step<HEAD_DIM>(a_frag[mt], k_tile, warp_row0 + mt * MMA_M, ks);
                load_k_step<HEAD_DIM, QUERY_TILES>(q_frag, q_part, ks);
#pragma unroll
                for (int mt = 0; mt < KEY_TILES; mt++) {
                    const unsigned *k_frag = A_IN_REGISTERS ? k_regs[ks] : a_frag[mt];
#pragma unroll
                    for (int np = 0; np < QUERY_TILES / 2; np++) {
                        mma_16x8x16(score[mt][2 * np], k_frag, q_frag[np][0], q_frag[np][1]);
                        mma_16x8x16(score[mt][2 * np + 1], k_frag, q_frag[np][2], q_frag[np][3]);
                    }
                }
            }

            // The mask: only on a diagonal tile (causal), a ragged last query tile, the last key tile.
            if (query0 + BWD_BLOCK_Q > seqlen || key0 + BLOCK_KV > seqlen || (causal && key0 + BLOCK_KV - 1 > query0)) {
#pragma unroll
                for (int mt = 0; mt < KEY_TILES; mt++)
                    mask_tile<QUERY_TILES>(score[mt], key0 + warp_row0 + mt * MMA_M + group,
                                           query0 + part0 + 2 * quad_lane, seqlen, causal);
            }
#pragma unroll
            for (int mt = 0; mt < KEY_TILES; mt++)
                p_from_scores<QUERY_TILES>(score[mt], lse_tile, part0, scale_log2);  // P^T, from the forward's LSE

                // dV += P^T dO: P^T repacked as the A operand (07's P), dO through ldmatrix.trans (07's V).
#pragma unroll
            for (int kk = 0; kk < Q_STEPS; kk++) {
                unsigned p_frag[KEY_TILES][A_REGS];
#pragma unroll
                for (int mt = 0; mt < KEY_TILES; mt++) pack_a(p_frag[mt], score[mt][2 * kk], score[mt][2 * kk + 1]);
#pragma unroll
                for (int dp = 0; dp < DIM_TILES / 2; dp++) {
                    unsigned do_frag[2 * B_REGS];
                    load_trans_pair<HEAD_DIM>(do_frag, do_part, kk, dp);
#pragma unroll
                    for (int mt = 0; mt < KEY_TILES; mt++) {
                        mma_16x8x16(dv_acc[mt][2 * dp], p_frag[mt], do_frag[0], do_frag[1]);
                        mma_16x8x16(dv_acc[mt][2 * dp + 1], p_frag[mt], do_frag[2], do_frag[3]);
                    }
                }
            }

            // dP^T = V dO^T, the same shape as S^T: V's rows as A, dO as the "col" B operand.
            float ds[KEY_TILES][QUERY_TILES][ACC_REGS] = {};
#pragma unroll
            for (int ks = 0; ks < K_STEPS; ks++) {
                unsigned a_frag[KEY_TILES][A_REGS], do_frag[QUERY_TILES / 2][2 * B_REGS];
                if constexpr (!A_IN_REGISTERS)
                    for (int mt = 0; mt < KEY_TILES; mt++)
                        load_a_step<HEAD_DIM>(a_frag[mt], v_tile, warp_row0 + mt * MMA_M, ks);
                load_k_step<HEAD_DIM, QUERY_TILES>(do_frag, do_part, ks);
#pragma unroll
                for (int mt = 0; mt < KEY_TILES; mt++) {
                    const unsigned *v_frag = A_IN_REGISTERS ? v_regs[ks] : a_frag[mt];
#pragma unroll
                    for (int np = 0; np < QUERY_TILES / 2; np++) {
                        mma_16x8x16(ds[mt][2 * np], v_frag, do_frag[np][0], do_frag[np][1]);
                        mma_16x8x16(ds[mt][2 * np + 1], v_frag, do_frag[np][2], do_frag[np][3]);
                    }
                }
            }

            // dS^T = P^T * (dP^T - D), in place of dP^T.
            unsigned ds_frag[KEY_TILES][Q_STEPS][A_REGS];  // dS^T as the A operand of dK += dS^T Q
#pragma unroll
            for (int mt = 0; mt < KEY_TILES; mt++) {
                ds_from_dp<QUERY_TILES>(ds[mt], score[mt], delta_tile, part0);
#pragma unroll
                for (int kk = 0; kk < Q_STEPS; kk++) pack_a(ds_frag[mt][kk], ds[mt][2 * kk], ds[mt][2 * kk + 1]);
            }

            // dK += dS^T Q (the scale is applied once, at the end): Q through ldmatrix.trans.
#pragma unroll
            for (int kk = 0; kk < Q_STEPS; kk++)
#pragma unroll
                for (int dp = 0; dp < DIM_TILES / 2; dp++) {
                    unsigned q_frag[2 * B_REGS];
                    load_trans_pair<HEAD_DIM>(q_frag, q_part, kk, dp);
#pragma unroll
                    for (int mt = 0; mt < KEY_TILES; mt++) {
                        mma_16x8x16(dk_acc[mt][2 * dp], ds_frag[mt][kk], q_frag[0], q_frag[1]);
                        mma_16x8x16(dk_acc[mt][2 * dp + 1], ds_frag[mt][kk], q_frag[2], q_frag[3]);
                    }
                }

            // dQ_i += dS K. A warp holds dS^T for its own keys, but dQ of a query sums over all
            // the keys of the block: dS^T goes to shared memory ([key][query], 4-byte stores of
            // adjacent queries, conflict-free with the padded rows), and the next tile's barrier
            // makes it every warp's: add_dq_of_tile runs there (or after the loop, for the last tile),
            // so that one barrier serves the ring and dS^T. Every key tile adds to the same rows:
            // atomics (RED).
            constexpr int DS_STRIDE = BwdConfig<HEAD_DIM>::DS_STRIDE;
            if (part == 0) __syncthreads();  // every warp has read the last tile's dS^T
#pragma unroll
            for (int mt = 0; mt < KEY_TILES; mt++)
#pragma unroll
                for (int kk = 0; kk < Q_STEPS; kk++)
#pragma unroll
                    for (int i = 0; i < A_REGS; i++) {  // A register i: row + 8 (i % 2), columns + 8 (i / 2)
                        const int key = warp_row0 + mt * MMA_M + group + i % 2 * ACC_ROW_STEP;
                        const int query = part0 + kk * MMA_K + i / 2 * MMA_N + 2 * quad_lane;
                        *(unsigned *)&ds_tile[key * DS_STRIDE + query] = ds_frag[mt][kk][i];
                    }
        }
    }
    __syncthreads();  // every warp's dS^T rows of the last tile are in
    add_dq_of_tile<HEAD_DIM, 1>(dq_head, ds_tile, k_tile, step_query0(first_tile, q_tiles - 1, query_tiles), seqlen);
    __pipeline_wait_prior(0);  // no copy may outlive the block (the trailing groups are empty)

    __half *dk_head = dk + head * seqlen * HEAD_DIM, *dv_head = dv + head * seqlen * HEAD_DIM;
#pragma unroll
    for (int mt = 0; mt < KEY_TILES; mt++)
        store_dk_dv<HEAD_DIM, DIM_TILES>(dk_head, dv_head, dk_acc[mt], dv_acc[mt], key0 + warp_row0 + mt * MMA_M, 0,
                                         seqlen, scale);
}

// (2) The main kernel: one key tile per block, grid (key tiles, b*h); causal (b*h, key tiles), the
// first (heaviest: most query tiles see them) key tiles first.
template <int HEAD_DIM>
__global__ void __launch_bounds__(BwdConfig<HEAD_DIM>::BLOCK_THREADS, BwdConfig<HEAD_DIM>::MIN_BLOCKS)
    flash_attention_backward_kernel(const __half *q, const __half *k, const __half *v, const __half *d_o,
                                    const float *lse, const float *delta, float *dq_acc, __half *dk, __half *dv,
                                    int seqlen, float scale, float scale_log2, int causal) {
    const int key_tile = causal ? blockIdx.y : blockIdx.x;
    const size_t head = causal ? blockIdx.x : blockIdx.y;
    backward_key_block<HEAD_DIM>(q, k, v, d_o, lse, delta, dq_acc, dk, dv, seqlen, scale, scale_log2, causal, key_tile,
                                 head);
}

// --- FlashAttention-2's warp split at D=128 -------------------------------------------------
// Above, at D=128, every warp multiplies its own 16 keys by all 64 queries of the tile: the eight warps
// each read the whole Q and dO tile (128 dims) twice per tile, 184 ldmatrix per warp and tile
// against 320 mma.sync. Here the warps split each product 4 x 2 instead, and pass P^T and dS^T
// through shared memory from the products that make them to those that use them:
//   S^T, dP^T (keys x queries): warp w takes keys 32 (w % 4).., queries 32 (w / 4)..
//   dV, dK (keys x dims):       keys 32 (w % 4).., dims 64 (w / 4)..
//   dQ (queries x dims):        queries 32 (w % 2).., dims 32 (w / 2)..  (add_dq_of_tile<.., 2>)
// 144 ldmatrix per warp and tile, and 32 4-byte stores of P^T and dS^T.
#define SPLIT_KEY_WARPS 4                           // warps side by side over the block's keys
#define SPLIT_WARP_KEYS (2 * MMA_M)                 // keys per warp: two m16 tiles
#define SPLIT_WARP_QUERIES (BWD_BLOCK_Q / 2)        // queries per warp in S^T, dP^T: 32
#define SPLIT_WARP_DIMS 64                          // dims per warp in dK, dV (D=128 / 2)
#define SPLIT_M_TILES (SPLIT_WARP_KEYS / MMA_M)     // 2
#define SPLIT_Q_TILES (SPLIT_WARP_QUERIES / MMA_N)  // n8 tiles of queries: 4
#define SPLIT_D_TILES (SPLIT_WARP_DIMS / MMA_N)     // n8 tiles of dims: 8
static_assert(SPLIT_KEY_WARPS * SPLIT_WARP_KEYS == 128, "four warps of 32 keys: the block's 128");

// acc += A B^T over the HEAD_DIM dims, A's rows a_row0.. (M m16 tiles) and B's rows b_row0..
// (N n8 tiles) both [row][dim] tiles in shared memory: S^T = K Q^T, dP^T = V dO^T.
template <int HEAD_DIM, int M, int N>
__device__ void rows_times_rows(float acc[M][N][ACC_REGS], const __half *a_tile, int a_row0, const __half *b_tile,
                                int b_row0) {
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / MMA_K; ks++) {
        unsigned a_frag[M][A_REGS], b_frag[N / 2][2 * B_REGS];
#pragma unroll
        for (int mt = 0; mt < M; mt++) load_a_step<HEAD_DIM>(a_frag[mt], a_tile, a_row0 + mt * MMA_M, ks);
        load_k_step<HEAD_DIM, N>(b_frag, b_tile + tile_offset<HEAD_DIM>(b_row0, 0), ks);
#pragma unroll
        for (int mt = 0; mt < M; mt++)
#pragma unroll
            for (int np = 0; np < N / 2; np++) {
                mma_16x8x16(acc[mt][2 * np], a_frag[mt], b_frag[np][0], b_frag[np][1]);
                mma_16x8x16(acc[mt][2 * np + 1], a_frag[mt], b_frag[np][2], b_frag[np][3]);
            }
    }
}

// acc += A B over the tile's BWD_BLOCK_Q queries: A's rows a_row0.. (M m16 tiles) of a
// [key][query] tile (P^T or dS^T), B the dims dim0.. (N n8 tiles) of a [query][dim] tile (dO or
// Q) through ldmatrix.trans: dV += P^T dO, dK += dS^T Q.
template <int HEAD_DIM, int M, int N>
__device__ void keys_times_queries(float acc[M][N][ACC_REGS], const __half *a_tile, int a_row0, const __half *b_tile,
                                   int dim0) {
#pragma unroll
    for (int kk = 0; kk < BWD_BLOCK_Q / MMA_K; kk++) {
        unsigned a_frag[M][A_REGS];
#pragma unroll
        for (int mt = 0; mt < M; mt++) load_a_step_key_query<HEAD_DIM>(a_frag[mt], a_tile, a_row0 + mt * MMA_M, kk);
#pragma unroll
        for (int dp = 0; dp < N / 2; dp++) {
            unsigned b_frag[2 * B_REGS];
            load_trans_pair<HEAD_DIM>(b_frag, b_tile, kk, dim0 / (2 * MMA_N) + dp);
#pragma unroll
            for (int mt = 0; mt < M; mt++) {
                mma_16x8x16(acc[mt][2 * dp], a_frag[mt], b_frag[0], b_frag[1]);
                mma_16x8x16(acc[mt][2 * dp + 1], a_frag[mt], b_frag[2], b_frag[3]);
            }
        }
    }
}

// A warp's keys x queries accumulators, rounded to fp16, into a [key][query] tile: 4-byte stores
// of a lane's two adjacent queries (32 different banks over the warp, rows DS_STRIDE apart).
template <int HEAD_DIM, int M, int N>
__device__ void store_key_query(__half *tile, const float acc[M][N][ACC_REGS], int key0, int query0) {
    const int lane = threadIdx.x % WARP_SIZE, group = lane / QUAD_LANES, quad_lane = lane % QUAD_LANES;
#pragma unroll
    for (int mt = 0; mt < M; mt++)
#pragma unroll
        for (int r = 0; r < ACC_ROWS; r++) {
            __half *row = tile + (key0 + mt * MMA_M + group + r * ACC_ROW_STEP) * BwdConfig<HEAD_DIM>::DS_STRIDE;
#pragma unroll
            for (int nt = 0; nt < N; nt++)
                *(unsigned *)&row[query0 + nt * MMA_N + 2 * quad_lane] =
                    pack_half2(acc[mt][nt][2 * r], acc[mt][nt][2 * r + 1]);
        }
}

// (2') One key tile with the split: the same grid, ring, loop order and dQ atomics.
template <int HEAD_DIM>
__device__ void split_key_block(const __half *q, const __half *k, const __half *v, const __half *d_o, const float *lse,
                                const float *delta, float *dq_acc, __half *dk, __half *dv, int seqlen, float scale,
                                float scale_log2, int causal, int key_tile, size_t head) {
    constexpr int KV_HALVES = BwdConfig<HEAD_DIM>::KV_HALVES, Q_HALVES = BwdConfig<HEAD_DIM>::Q_HALVES;
    constexpr int BLOCK_KV = BwdConfig<HEAD_DIM>::BLOCK_KV, BLOCK_THREADS = BwdConfig<HEAD_DIM>::BLOCK_THREADS;
    constexpr int KEY_QUERY_HALVES = BwdConfig<HEAD_DIM>::KEY_QUERY_HALVES;
    static_assert(BwdConfig<HEAD_DIM>::BLOCK_WARPS == 8 && HEAD_DIM == 2 * SPLIT_WARP_DIMS, "eight warps, D=128");
    extern __shared__ __align__(128) unsigned char smem[];
    float *lse_ring = (float *)smem;                                     // [BWD_STAGES][BWD_BLOCK_Q]
    float *delta_ring = lse_ring + BWD_STAGES * BWD_BLOCK_Q;             // [BWD_STAGES][BWD_BLOCK_Q]
    __half *k_tile = (__half *)(delta_ring + BWD_STAGES * BWD_BLOCK_Q);  // [BLOCK_KV][STRIDE]
    __half *v_tile = k_tile + KV_HALVES;                                 // [BLOCK_KV][STRIDE]
    __half *q_ring = v_tile + KV_HALVES;                                 // [BWD_STAGES][BWD_BLOCK_Q][STRIDE]
    __half *do_ring = q_ring + BWD_STAGES * Q_HALVES;                    // [BWD_STAGES][BWD_BLOCK_Q][STRIDE]
    __half *pt_tile = do_ring + BWD_STAGES * Q_HALVES;                   // [BLOCK_KV][DS_STRIDE]: P^T
    __half *ds_tile = pt_tile + KEY_QUERY_HALVES;                        // [BLOCK_KV][DS_STRIDE]: dS^T

    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int group = lane / QUAD_LANES, quad_lane = lane % QUAD_LANES;
    const int warp_key0 = warp % SPLIT_KEY_WARPS * SPLIT_WARP_KEYS;       // in S^T, dP^T, dK, dV
    const int warp_query0 = warp / SPLIT_KEY_WARPS * SPLIT_WARP_QUERIES;  // in S^T, dP^T
    const int warp_dim0 = warp / SPLIT_KEY_WARPS * SPLIT_WARP_DIMS;       // in dK, dV
    const int key0 = key_tile * BLOCK_KV;
    const __half *q_head = q + head * seqlen * HEAD_DIM, *do_head = d_o + head * seqlen * HEAD_DIM;
    const float *lse_head = lse + head * seqlen, *delta_head = delta + head * seqlen;

    // The loop's query tiles, as the kernel above: from the diagonal, wrapping round unless causal.
    const int query_tiles = ceil_div(seqlen, BWD_BLOCK_Q);
    const int first_tile = key0 / BWD_BLOCK_Q;
    const int q_tiles = causal ? query_tiles - first_tile : query_tiles;

    load_tile_async<HEAD_DIM, BLOCK_KV, BLOCK_THREADS>(k_tile, k + head * seqlen * HEAD_DIM, key0, seqlen);
    load_tile_async<HEAD_DIM, BLOCK_KV, BLOCK_THREADS>(v_tile, v + head * seqlen * HEAD_DIM, key0, seqlen);
    for (int t = 0; t < BWD_STAGES - 1; t++) {
        if (t < q_tiles)
            load_query_tile_async<HEAD_DIM>(q_ring, do_ring, lse_ring, delta_ring, q_head, do_head, lse_head,
                                            delta_head, t, step_query0(first_tile, t, query_tiles), seqlen);
        __pipeline_commit();
    }

    float dk_acc[SPLIT_M_TILES][SPLIT_D_TILES][ACC_REGS] = {}, dv_acc[SPLIT_M_TILES][SPLIT_D_TILES][ACC_REGS] = {};
    float *dq_head = dq_acc + head * seqlen * HEAD_DIM;

    for (int tile = 0; tile < q_tiles; tile++) {
        __pipeline_wait_prior(BWD_STAGES - 2);
        __syncthreads();  // the tile has landed; every warp is done with the last tile's P^T and dS^T
        const int next = tile + BWD_STAGES - 1;
        if (next < q_tiles)
            load_query_tile_async<HEAD_DIM>(q_ring, do_ring, lse_ring, delta_ring, q_head, do_head, lse_head,
                                            delta_head, next % BWD_STAGES, step_query0(first_tile, next, query_tiles),
                                            seqlen);
        __pipeline_commit();
        const int slot = tile % BWD_STAGES, query0 = step_query0(first_tile, tile, query_tiles);
        const __half *q_tile = q_ring + slot * Q_HALVES, *do_tile = do_ring + slot * Q_HALVES;
        const float *lse_tile = lse_ring + slot * BWD_BLOCK_Q, *delta_tile = delta_ring + slot * BWD_BLOCK_Q;

        // S^T = K Q^T and P^T = exp(S^T * scale - LSE): the warp's 32 keys x 32 queries.
        float score[SPLIT_M_TILES][SPLIT_Q_TILES][ACC_REGS] = {};
        rows_times_rows<HEAD_DIM, SPLIT_M_TILES, SPLIT_Q_TILES>(score, k_tile, warp_key0, q_tile, warp_query0);
        if (query0 + BWD_BLOCK_Q > seqlen || key0 + BLOCK_KV > seqlen || (causal && key0 + BLOCK_KV - 1 > query0)) {
#pragma unroll
            for (int mt = 0; mt < SPLIT_M_TILES; mt++)
                mask_tile<SPLIT_Q_TILES>(score[mt], key0 + warp_key0 + mt * MMA_M + group,
                                         query0 + warp_query0 + 2 * quad_lane, seqlen, causal);
        }
#pragma unroll
        for (int mt = 0; mt < SPLIT_M_TILES; mt++)
            p_from_scores<SPLIT_Q_TILES>(score[mt], lse_tile, warp_query0, scale_log2);
        store_key_query<HEAD_DIM, SPLIT_M_TILES, SPLIT_Q_TILES>(pt_tile, score, warp_key0, warp_query0);

        // dP^T = V dO^T, then dS^T = P^T * (dP^T - D), D per query (column), as LSE.
        float ds[SPLIT_M_TILES][SPLIT_Q_TILES][ACC_REGS] = {};
        rows_times_rows<HEAD_DIM, SPLIT_M_TILES, SPLIT_Q_TILES>(ds, v_tile, warp_key0, do_tile, warp_query0);
#pragma unroll
        for (int mt = 0; mt < SPLIT_M_TILES; mt++)
            ds_from_dp<SPLIT_Q_TILES>(ds[mt], score[mt], delta_tile, warp_query0);
        store_key_query<HEAD_DIM, SPLIT_M_TILES, SPLIT_Q_TILES>(ds_tile, ds, warp_key0, warp_query0);
        __syncthreads();  // P^T and dS^T of the whole block are in

        // dV += P^T dO and dK += dS^T Q: the warp's 32 keys x 64 dims, over the tile's 64 queries.
        keys_times_queries<HEAD_DIM, SPLIT_M_TILES, SPLIT_D_TILES>(dv_acc, pt_tile, warp_key0, do_tile, warp_dim0);
        keys_times_queries<HEAD_DIM, SPLIT_M_TILES, SPLIT_D_TILES>(dk_acc, ds_tile, warp_key0, q_tile, warp_dim0);
        add_dq_of_tile<HEAD_DIM, 2>(dq_head, ds_tile, k_tile, query0, seqlen);  // dQ += dS K, atomics
    }
    __pipeline_wait_prior(0);  // no copy may outlive the block (the trailing groups are empty)

    __half *dk_head = dk + head * seqlen * HEAD_DIM, *dv_head = dv + head * seqlen * HEAD_DIM;
#pragma unroll
    for (int mt = 0; mt < SPLIT_M_TILES; mt++)  // dK (scaled) and dV, as fp16
        store_dk_dv<HEAD_DIM, SPLIT_D_TILES>(dk_head, dv_head, dk_acc[mt], dv_acc[mt], key0 + warp_key0 + mt * MMA_M,
                                             warp_dim0, seqlen, scale);
}

template <int HEAD_DIM>
__global__ void __launch_bounds__(BwdConfig<HEAD_DIM>::BLOCK_THREADS, 1)
    flash_attention_backward_split_kernel(const __half *q, const __half *k, const __half *v, const __half *d_o,
                                          const float *lse, const float *delta, float *dq_acc, __half *dk, __half *dv,
                                          int seqlen, float scale, float scale_log2, int causal) {
    const int key_tile = causal ? blockIdx.y : blockIdx.x;
    const size_t head = causal ? blockIdx.x : blockIdx.y;
    split_key_block<HEAD_DIM>(q, k, v, d_o, lse, delta, dq_acc, dk, dv, seqlen, scale, scale_log2, causal, key_tile,
                              head);
}

// (3) dQ = scale * the fp32 accumulator, as fp16. Grid as (1):
// CHUNKS lanes per row.
template <int HEAD_DIM>
__global__ void __launch_bounds__(THREADS) convert_dq_kernel(const float *dq_acc, __half *dq, int seqlen, float scale) {
    constexpr int CHUNKS = HEAD_DIM / CHUNK_HALVES, ROWS = THREADS / CHUNKS;
    const int row = blockIdx.x * ROWS + threadIdx.x / CHUNKS, chunk = threadIdx.x % CHUNKS;
    if (row >= seqlen) return;
    const size_t at = ((size_t)blockIdx.y * seqlen + row) * HEAD_DIM + chunk * CHUNK_HALVES;
    const float4 lo = *(const float4 *)(dq_acc + at), hi = *(const float4 *)(dq_acc + at + 4);
    uint4 out;
    out.x = pack_half2(lo.x * scale, lo.y * scale);
    out.y = pack_half2(lo.z * scale, lo.w * scale);
    out.z = pack_half2(hi.x * scale, hi.y * scale);
    out.w = pack_half2(hi.z * scale, hi.w * scale);
    *(uint4 *)(dq + at) = out;
}

// --- The backward's launcher -----------------------------------------------------------------
// The workspace: D, one float per query row, then the fp32 dQ accumulator, B*H*N*D floats, from a
// WORKSPACE_ALIGN boundary.
static size_t delta_bytes(const AttnShape *s) {
    size_t bytes = (size_t)s->batch * s->heads * s->seqlen * sizeof(float);
    return (bytes + WORKSPACE_ALIGN - 1) / WORKSPACE_ALIGN * WORKSPACE_ALIGN;
}

static size_t backward_workspace_bytes(const AttnShape *s, int /* deterministic: not offered */) {
    return delta_bytes(s) + (size_t)s->batch * s->heads * s->seqlen * s->headdim * sizeof(float);
}

// The main kernel: the split one at D=128 where the GPU gives a block its shared memory (allowed here).
template <int HEAD_DIM>
static cudaError_t main_kernel_of(decltype(&flash_attention_backward_kernel<HEAD_DIM>) *kernel, int *smem) {
    int device = 0, smem_optin = 0;
    RETURN_IF_ERROR(cudaGetDevice(&device));
    RETURN_IF_ERROR(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    *kernel = flash_attention_backward_kernel<HEAD_DIM>;
    *smem = BwdConfig<HEAD_DIM>::SMEM_BYTES;
    if constexpr (BwdConfig<HEAD_DIM>::SPLIT) {
        if (smem_optin >= BwdConfig<HEAD_DIM>::SPLIT_SMEM_BYTES) {
            *kernel = flash_attention_backward_split_kernel<HEAD_DIM>;
            *smem = BwdConfig<HEAD_DIM>::SPLIT_SMEM_BYTES;
        }
    }
    return cudaFuncSetAttribute(*kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, *smem);
}

template <int HEAD_DIM>
static cudaError_t launch_backward(const BackwardArgs *args, cudaStream_t stream) {
    const AttnShape *s = &args->shape;
    const int heads = s->batch * s->heads, key_tiles = ceil_div(s->seqlen, BwdConfig<HEAD_DIM>::BLOCK_KV);
    const float scale = s->scale, scale_log2 = s->scale * LOG2E;
    decltype(&flash_attention_backward_kernel<HEAD_DIM>) main_kernel;
    int smem = 0;
    RETURN_IF_ERROR(main_kernel_of<HEAD_DIM>(&main_kernel, &smem));
    float *delta = (float *)args->workspace;
    float *dq_acc = (float *)((char *)args->workspace + delta_bytes(s));
    const dim3 row_grid(ceil_div(s->seqlen, THREADS / (HEAD_DIM / CHUNK_HALVES)), heads);

    backward_preprocess_kernel<HEAD_DIM>
        <<<row_grid, THREADS, 0, stream>>>(args->o, args->d_o, delta, dq_acc, s->seqlen);
    RETURN_IF_ERROR(cudaGetLastError());

    dim3 grid = s->causal ? dim3(heads, key_tiles) : dim3(key_tiles, heads);
    main_kernel<<<grid, BwdConfig<HEAD_DIM>::BLOCK_THREADS, smem, stream>>>(
        args->q, args->k, args->v, args->d_o, args->lse, delta, dq_acc, args->dk, args->dv, s->seqlen, scale,
        scale_log2, s->causal);
    RETURN_IF_ERROR(cudaGetLastError());

    convert_dq_kernel<HEAD_DIM><<<row_grid, THREADS, 0, stream>>>(dq_acc, args->dq, s->seqlen, scale);
    return cudaGetLastError();
}

static cudaError_t backward(const BackwardArgs *args, cudaStream_t stream) {
    return backward_for_head_dim(args, stream, launch_backward<64>, launch_backward<128>);
}

static const Backward backward_pass = {backward_workspace_bytes, backward, 0};  // no deterministic mode: 09.8's

const Chapter chapter = {
    "09.6",
    "FlashAttention-2's split of the warps at D=128, P^T and dS^T through shared memory",
    PRECISION_FP16_TC,
    80,
    0,     // oldest and newest GPU it runs on (0: no newest)
    NULL,  // the forward needs no workspace (the backward's is its own, below)
    NULL,  // nothing to prepare before the forward
    forward,
    NULL,  // not an FP8 chapter
    &backward_pass,
};
