// 06_tensorcore_wmma: 05's kernel with both matrix products on tensor cores, through WMMA.
//
// Grid: one block per (64-query tile, b*h), heaviest causal tiles first (as 05).
// Block: 4 warps; warp w owns query rows 16w..16w+15 of the tile. Q, K and V tiles live in
// shared memory as fp16 (no more conversion to fp32). A warp keeps its 16 x HEAD_DIM output
// accumulator in WMMA fragments, in registers. S = Q K^T leaves the tensor cores as fp32
// fragments whose element-to-(row, col) map is opaque, so each warp stores its 16 x 64 S tile
// to shared memory, runs the online softmax on it in fp32, and writes P over it as fp16 for
// the second product, O += P V. Three blocks share an SM (12 warps), which is what the
// register and shared-memory budgets below are sized for.
#include <mma.h>

#include "../common/harness.h"

using namespace nvcuda;

#define BLOCK_Q 64   // query rows per block: 4 warps x 16
#define BLOCK_KV 64  // keys per streamed tile
#define WARPS 4
#define THREADS (WARPS * 32)
#define FRAG 16          // WMMA shape: 16 x 16 x 16, fp16 in, fp32 accumulate
#define BLOCKS_PER_SM 3  // 168 registers per thread at most, 75 KiB of shared memory
// Halves of padding per fp16 row: rows stay 16-byte aligned and every 16th row (where a WMMA
// fragment starts) 32-byte aligned, and 8 consecutive rows start in 8 different banks.
#define PAD 8
// Floats per row of the S tile: a half-warp's 64-bit fragment stores and float4 reads cover 4
// consecutive rows, which +8 starts 8 banks apart: conflict-free (+4 starts them 4 apart: 2-way
// conflicts, 5% slower).
#define S_STRIDE (BLOCK_KV + 8)
#define P_STRIDE (BLOCK_KV + PAD)  // halves per row of P, packed over the warp's S rows
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

typedef wmma::fragment<wmma::matrix_a, FRAG, FRAG, FRAG, __half, wmma::row_major> FragA;
typedef wmma::fragment<wmma::matrix_b, FRAG, FRAG, FRAG, __half, wmma::col_major> FragKT;  // K^T
typedef wmma::fragment<wmma::matrix_b, FRAG, FRAG, FRAG, __half, wmma::row_major> FragV;
typedef wmma::fragment<wmma::accumulator, FRAG, FRAG, FRAG, float> FragAcc;

// Shared memory of one block, in bytes: the Q, K and V tiles, the S tile (P is written over it)
// and one factor per row. 69.25 KiB (70,912 bytes) at D=128: three blocks fit in an SM's 228 KiB.
template <int HEAD_DIM>
struct Smem {
    static constexpr int STRIDE = HEAD_DIM + PAD;  // halves per row of the Q, K, V tiles
    static constexpr int Q_BYTES = BLOCK_Q * STRIDE * 2, S_BYTES = BLOCK_Q * S_STRIDE * 4;
    static constexpr int KV_BYTES = BLOCK_KV * STRIDE * 2;
    static constexpr int TOTAL = Q_BYTES + S_BYTES + 2 * KV_BYTES + BLOCK_Q * 4;
};

// TILE_ROWS rows of HEAD_DIM halves into a padded shared tile (zero rows past seqlen). Thread t
// moves 16-byte chunk t % CHUNKS of rows t / CHUNKS, + ROWS_PER_PASS, ...: a fixed number of
// copies at constant offsets, four loads in flight before their four stores.
template <int HEAD_DIM, int TILE_ROWS>
__device__ void load_tile(__half *tile, const __half *src, int row0, int seqlen) {
    // EXERCISE 06.load_tile BEGIN: copy the tile with a fixed number of 16-byte loads per thread, several in flight
    //   kind: speed
    //   gate: 1.03x
    //   shape: headline causal
    //   hint: The stub's trip count depends on threadIdx.x, and each 16-byte chunk is bounds-checked and
    //     stored before the next is loaded. Give every thread the same chunks at constant offsets (rows
    //     t / CHUNKS + k * THREADS / CHUNKS), load four before storing four, and check bounds only on a tile
    //     that crosses seqlen.
    //   stub: measured (the chapter's earlier loads): 1.546 ms against 1.434 causal, 1.078x, and 1.067x
    //     non-causal (docs/results/logs/07/variants_06_07_run4.csv)
    constexpr int CHUNKS = HEAD_DIM / 8, ROWS_PER_PASS = THREADS / CHUNKS, PASSES = TILE_ROWS / ROWS_PER_PASS;
    constexpr int STRIDE = Smem<HEAD_DIM>::STRIDE;
    static_assert(PASSES % 4 == 0, "every thread moves a multiple of four chunks");
    const int row = threadIdx.x / CHUNKS, d0 = threadIdx.x % CHUNKS * 8;
    const __half *from = src + (size_t)(row0 + row) * HEAD_DIM + d0;
    __half *to = tile + row * STRIDE + d0;
    if (row0 + TILE_ROWS <= seqlen) {  // a whole tile (all but the last): no checks
#pragma unroll
        for (int i0 = 0; i0 < PASSES; i0 += 4) {
            uint4 raw[4];
#pragma unroll
            for (int i = 0; i < 4; i++) raw[i] = *(const uint4 *)(from + (i0 + i) * ROWS_PER_PASS * HEAD_DIM);
#pragma unroll
            for (int i = 0; i < 4; i++) *(uint4 *)(to + (i0 + i) * ROWS_PER_PASS * STRIDE) = raw[i];
        }
    } else {
#pragma unroll
        for (int i = 0; i < PASSES; i++)
            *(uint4 *)(to + i * ROWS_PER_PASS * STRIDE) = row0 + row + i * ROWS_PER_PASS < seqlen
                                                              ? *(const uint4 *)(from + i * ROWS_PER_PASS * HEAD_DIM)
                                                              : make_uint4(0, 0, 0, 0);
    }
    // EXERCISE 06.load_tile STUB
    // constexpr int CHUNKS = HEAD_DIM / 8, STRIDE = Smem<HEAD_DIM>::STRIDE;
    // for (int c = threadIdx.x; c < TILE_ROWS * CHUNKS; c += THREADS) {  // chunk c: row c / CHUNKS
    //     int row = c / CHUNKS, d0 = c % CHUNKS * 8;
    //     uint4 raw = row0 + row < seqlen ? *(const uint4 *)(src + (size_t)(row0 + row) * HEAD_DIM + d0)
    //                                     : make_uint4(0, 0, 0, 0);
    //     *(uint4 *)(tile + row * STRIDE + d0) = raw;
    // }
    // EXERCISE END
}

// WMMA does not say which (row, col) each accumulator element holds, but all accumulator
// fragments of one type share one layout. Loading a matrix whose entries are their own row
// numbers reveals the row of every element: what rescaling O in registers needs.
__device__ void accumulator_rows(int frag_row[FragAcc::num_elements], float *scratch) {
    for (int e = threadIdx.x % 32; e < FRAG * FRAG; e += 32) scratch[e] = (float)(e / FRAG);
    __syncwarp();
    FragAcc ids;
    wmma::load_matrix_sync(ids, scratch, FRAG, wmma::mem_row_major);
    for (int e = 0; e < FragAcc::num_elements; e++) frag_row[e] = (int)ids.x[e];
    __syncwarp();
}

// 2^x as one MUFU instruction. exp2f() adds fix-ups for results below 2^-126, which a
// probability can lose (they flush to 0): four instructions per score instead of one.
__device__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// A raw score, or -inf where the causal mask or the end of the sequence hides the key.
__device__ float masked_score(float score, int key, int query, int seqlen, int causal, bool needs_mask) {
    return needs_mask && (key >= seqlen || (causal && key > query)) ? -INFINITY : score;
}

template <int HEAD_DIM>
__global__ void __launch_bounds__(THREADS, BLOCKS_PER_SM)
    flash_attention_kernel(const __half *q, const __half *k, const __half *v, __half *o, float *lse, int seqlen,
                           float scale_log2, int causal) {
    constexpr int STRIDE = Smem<HEAD_DIM>::STRIDE, DFRAGS = HEAD_DIM / FRAG;
    constexpr int Q_BYTES = Smem<HEAD_DIM>::Q_BYTES, S_BYTES = Smem<HEAD_DIM>::S_BYTES;
    extern __shared__ __align__(128) unsigned char smem[];
    __half *q_tile = (__half *)smem;                            // [BLOCK_Q][STRIDE]
    float *s_tile = (float *)(smem + Q_BYTES);                  // [BLOCK_Q][S_STRIDE], P over it
    __half *k_tile = (__half *)(smem + Q_BYTES + S_BYTES);      // [BLOCK_KV][STRIDE]
    __half *v_tile = k_tile + BLOCK_KV * STRIDE;                // [BLOCK_KV][STRIDE]
    float *row_factor = (float *)(v_tile + BLOCK_KV * STRIDE);  // [BLOCK_Q]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // Causal work grows with the query tile, so the causal grid is (b*h, tiles) and hands out
    // the last (heaviest) tiles first: light ones fill the gaps at the end instead of a heavy one
    // running alone. Non-causal keeps 04's (tiles, b*h): neighbours share K and V in L2.
    const int query_tile = causal ? gridDim.y - 1 - blockIdx.y : blockIdx.x;
    const int query0 = query_tile * BLOCK_Q;
    const size_t head = causal ? blockIdx.x : blockIdx.y;
    const __half *q_head = q + head * seqlen * HEAD_DIM;
    const __half *k_head = k + head * seqlen * HEAD_DIM;
    const __half *v_head = v + head * seqlen * HEAD_DIM;
    const int warp_row0 = warp * FRAG;  // this warp's first row in the tile
    float *s_warp = s_tile + warp_row0 * S_STRIDE;
    __half *p_warp = (__half *)s_warp;  // [16][P_STRIDE]
    float *factor_warp = row_factor + warp_row0;

    load_tile<HEAD_DIM, BLOCK_Q>(q_tile, q_head, query0, seqlen);
    int frag_row[FragAcc::num_elements];
    accumulator_rows(frag_row, (float *)p_warp);

    // On chip for the whole loop: the output accumulator (fragments) and, for the softmax, two
    // lanes per row: lane 2r and 2r+1 hold row r's running max (log2 units) and partial sum.
    FragAcc o_acc[DFRAGS];
    for (int c = 0; c < DFRAGS; c++) wmma::fill_fragment(o_acc[c], 0.0f);
    const int row = lane / 2, pair_lane = lane % 2;
    const int query = query0 + warp_row0 + row;
    float row_max = -INFINITY, row_sum = 0.0f;

    // Causal: keys past this tile's last query are masked for every row: skip those tiles.
    const int key_end = causal ? min(seqlen, query0 + BLOCK_Q) : seqlen;
    for (int key0 = 0; key0 < key_end; key0 += BLOCK_KV) {
        __syncthreads();  // the previous K and V tiles are consumed
        load_tile<HEAD_DIM, BLOCK_KV>(k_tile, k_head, key0, seqlen);
        load_tile<HEAD_DIM, BLOCK_KV>(v_tile, v_head, key0, seqlen);
        __syncthreads();

        // S = Q K^T on tensor cores: four 16 x 16 accumulators make this warp's 16 x 64 scores.
        // Q's fragments are re-read from shared memory at every tile, one k-slice at a time: held
        // in registers for the whole loop they would take 64 more per thread and allow only two
        // blocks per SM (measured: 28% slower).
        FragAcc s_frag[BLOCK_KV / FRAG];
        for (int n = 0; n < BLOCK_KV / FRAG; n++) wmma::fill_fragment(s_frag[n], 0.0f);
        for (int c = 0; c < DFRAGS; c++) {
            FragA q_frag;
            wmma::load_matrix_sync(q_frag, q_tile + warp_row0 * STRIDE + c * FRAG, STRIDE);
            for (int n = 0; n < BLOCK_KV / FRAG; n++) {
                FragKT k_frag;
                wmma::load_matrix_sync(k_frag, k_tile + n * FRAG * STRIDE + c * FRAG, STRIDE);
                wmma::mma_sync(s_frag[n], q_frag, k_frag, s_frag[n]);
            }
        }
        for (int n = 0; n < BLOCK_KV / FRAG; n++)
            wmma::store_matrix_sync(s_warp + n * FRAG, s_frag[n], S_STRIDE, wmma::mem_row_major);
        __syncwarp();

        // EXERCISE 06.softmax_rows BEGIN: online softmax on the warp's S rows (two lanes a row), P over S as fp16
        //   kind: correctness
        //   hint: Lanes 2r and 2r + 1 of the warp share row r (pair_lane says which of the two a lane is).
        //     Each reads its 32 scores, the float4 columns 4 * (2i + pair_lane), through masked_score on the
        //     tiles that need the mask (ragged: key0 + BLOCK_KV > seqlen; causal, the diagonal:
        //     key0 + BLOCK_KV - 1 > query0). Take the row max over the pair with __shfl_xor_sync(..., 1),
        //     times scale_log2, and rescale = exp2_approx(row_max - base). After a __syncwarp(), write
        //     P = exp2_approx(score * scale_log2 - base) over the row as fp16; lane 0 of the pair stores
        //     factor_warp[row] = rescale.
        // Only the tile on the diagonal (and a ragged last tile) needs the mask.
        const bool needs_mask = key0 + BLOCK_KV > seqlen || (causal && key0 + BLOCK_KV - 1 > query0);

        // Online softmax on this warp's S rows. Each of the two lanes of a row (`pair_lane` 0, 1) reads
        // the float4 columns 4*(2i + pair_lane) (the two read different banks) into registers, once.
        const float *s_row = s_warp + row * S_STRIDE;
        float score[BLOCK_KV / 2];
        float tile_max = -INFINITY;
        for (int i = 0; i < BLOCK_KV / 8; i++) {
            int col = 4 * (2 * i + pair_lane);
            float4 x = *(const float4 *)&s_row[col];
            float xs[4] = {x.x, x.y, x.z, x.w};
            for (int j = 0; j < 4; j++) {
                score[4 * i + j] = masked_score(xs[j], key0 + col + j, query, seqlen, causal, needs_mask);
                tile_max = fmaxf(tile_max, score[4 * i + j]);
            }
        }
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, 1)) * scale_log2;
        float new_max = fmaxf(row_max, tile_max);
        float base = new_max == -INFINITY ? 0.0f : new_max;  // a row with no key yet stays empty
        float rescale = exp2_approx(row_max - base);
        row_max = new_max;
        row_sum *= rescale;  // this lane's share of the row sum; the pair is added at the end
        for (int i = 0; i < BLOCK_KV / 2; i++) {
            score[i] = exp2_approx(score[i] * scale_log2 - base);
            row_sum += score[i];
        }
        __syncwarp();  // every lane has read its scores: P may overwrite S
        __half *p_row = p_warp + row * P_STRIDE;
        for (int i = 0; i < BLOCK_KV / 8; i++) {
            __half2 lo = __floats2half2_rn(score[4 * i], score[4 * i + 1]);
            __half2 hi = __floats2half2_rn(score[4 * i + 2], score[4 * i + 3]);
            *(uint2 *)&p_row[4 * (2 * i + pair_lane)] = make_uint2(*(unsigned *)&lo, *(unsigned *)&hi);
        }
        if (pair_lane == 0) factor_warp[row] = rescale;
        // EXERCISE END
        __syncwarp();

        // Rescale O in registers: element e of every accumulator fragment sits in row frag_row[e].
        for (int e = 0; e < FragAcc::num_elements; e++) {
            float r = factor_warp[frag_row[e]];
            for (int c = 0; c < DFRAGS; c++) o_acc[c].x[e] *= r;
        }

        // O += P V on tensor cores.
        // Two k-slices per loop trip: fully unrolled, the V fragments loaded ahead push the
        // kernel past its 168 registers (spills).
#pragma unroll 2
        for (int kk = 0; kk < BLOCK_KV / FRAG; kk++) {
            FragA p_frag;
            wmma::load_matrix_sync(p_frag, p_warp + kk * FRAG, P_STRIDE);
            for (int c = 0; c < DFRAGS; c++) {
                FragV v_frag;
                wmma::load_matrix_sync(v_frag, v_tile + kk * FRAG * STRIDE + c * FRAG, STRIDE);
                wmma::mma_sync(o_acc[c], p_frag, v_frag, o_acc[c]);
            }
        }
    }

    // O = accumulator / sum, LSE = ln(sum) + max, each written once.
    float sum = row_sum + __shfl_xor_sync(0xffffffff, row_sum, 1);
    __syncwarp();  // every lane has read the last tile's factors
    if (pair_lane == 0) {
        factor_warp[row] = 1.0f / sum;
        if (query < seqlen) lse[head * seqlen + query] = (row_max + log2f(sum)) * LN2;
    }
    __syncwarp();
    for (int e = 0; e < FragAcc::num_elements; e++) {
        float r = factor_warp[frag_row[e]];
        for (int c = 0; c < DFRAGS; c++) o_acc[c].x[e] *= r;
    }
    // Each 16 x 16 block of O goes through the warp's S rows to 16-byte fp16 stores.
    for (int c = 0; c < DFRAGS; c++) {
        wmma::store_matrix_sync(s_warp, o_acc[c], S_STRIDE, wmma::mem_row_major);
        __syncwarp();
        if (query < seqlen) {
            const float *src = s_warp + row * S_STRIDE + pair_lane * 8;
            __half2 h[4];
            for (int j = 0; j < 4; j++) h[j] = __floats2half2_rn(src[2 * j], src[2 * j + 1]);
            *(uint4 *)&o[(head * seqlen + query) * HEAD_DIM + c * FRAG + pair_lane * 8] = *(uint4 *)h;
        }
        __syncwarp();
    }
}

// --- Launcher --------------------------------------------------------------------------------
template <int HEAD_DIM>
static cudaError_t launch(const AttnArgs *args, cudaStream_t stream) {
    const AttnShape *s = &args->shape;
    int smem = Smem<HEAD_DIM>::TOTAL;
    RETURN_IF_ERROR(
        cudaFuncSetAttribute(flash_attention_kernel<HEAD_DIM>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    int heads = s->batch * s->heads, tiles = ceil_div(s->seqlen, BLOCK_Q);
    dim3 grid = s->causal ? dim3(heads, tiles) : dim3(tiles, heads);
    flash_attention_kernel<HEAD_DIM><<<grid, THREADS, smem, stream>>>(args->q, args->k, args->v, args->o, args->lse,
                                                                      s->seqlen, s->scale * LOG2E, s->causal);
    return cudaGetLastError();
}

static cudaError_t forward(const AttnArgs *args, cudaStream_t stream) {
    return launch_for_head_dim(args, stream, launch<64>, launch<128>);
}

const Chapter chapter = {
    "06_tensorcore_wmma",
    "QK^T and PV on tensor cores through WMMA (fp16 in, fp32 accumulate)",
    PRECISION_FP16_TC,
    80,
    0,     // oldest and newest GPU it runs on (0: no newest)
    NULL,  // no workspace: S and P stay on chip
    NULL,  // nothing to prepare before the forward
    forward,
};
