// 05_causal: 04's kernel with causal attention done right: tiles above the diagonal are never
// loaded or computed, only the diagonal tile is masked, and the heaviest query tiles start first.
//
// Grid: one block per (64-query tile, b*h). A block keeps its Q tile in shared memory, streams
// K and V tiles of 64 keys through shared memory, and keeps, per query row, the running max,
// the running sum and the output accumulator in registers (the online softmax of 03, now per
// tile). O and LSE are written once at the end; S and P exist only as 64 x 64 tiles on chip.
// Block: 128 threads as 8 x 16; thread (ty, tx) owns 8 query rows, 4 keys of each score tile
// and HEAD_DIM/16 output columns. Math is fp32 on CUDA cores.
#include "../common/harness.h"

#define BLOCK_Q 64   // query rows per block
#define BLOCK_KV 64  // keys per streamed tile
// The block's threads as THREAD_ROWS x THREAD_COLS: ty along the queries, tx along the keys of a
// score tile and the columns of the output.
#define THREAD_ROWS 8
#define THREAD_COLS 16
#define THREADS (THREAD_ROWS * THREAD_COLS)
#define ROWS_PER_THREAD (BLOCK_Q / THREAD_ROWS)   // query rows per thread: 8
#define KEYS_PER_THREAD (BLOCK_KV / THREAD_COLS)  // keys per thread in a score tile: 4
#define VEC 4                                     // floats per float4: rows, keys and columns go in fours
#define ROW_STEP (THREAD_ROWS * VEC)              // from a thread's first float4 of rows to its second: 32 rows
#define COL_STEP (THREAD_COLS * VEC)              // from a thread's float4 of output columns to its next: 64
#define CHUNK_HALVES 8                            // halves per 16-byte load (a uint4)
#define PAD 4                                     // floats of padding per row of the P tile
#define P_STRIDE (BLOCK_Q + PAD)                  // row stride of the P tile: float4-aligned; P stores 4-way conflicted
#define WARP_SIZE 32
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

static_assert(BLOCK_Q % THREAD_ROWS == 0 && BLOCK_KV % THREAD_COLS == 0, "every thread has as many rows and keys");
static_assert(ROWS_PER_THREAD == 2 * VEC, "a thread's rows are two float4 of rows (row_of)");
static_assert(KEYS_PER_THREAD == VEC, "a thread's keys of a score tile are one float4");
static_assert(WARP_SIZE % THREAD_COLS == 0, "the threads of a row are in one warp (row_group_max)");
static_assert(CHUNK_HALVES * sizeof(__half) == sizeof(uint4), "a 16-byte load holds CHUNK_HALVES halves");
static_assert(PAD % VEC == 0, "rows of the P tile stay float4-aligned");

// Row `i` of a thread: rows ty*4..ty*4+3 and 32+ty*4..32+ty*4+3, two float4 of rows: the layout
// of q_t and p_t, which a row's 16 threads read as one broadcast float4 each.
__device__ int row_of(int ty, int i) { return (i / VEC) * ROW_STEP + ty * VEC + i % VEC; }

// TILE_ROWS rows of HEAD_DIM halves from device memory into shared memory as fp32, transposed to
// [dim][row] (zero rows past seqlen). Consecutive threads take consecutive rows: no conflicts.
template <int HEAD_DIM, int TILE_ROWS>
__device__ void load_transposed(float *tile_t, const __half *src, int row0, int seqlen) {
    static_assert(THREADS % TILE_ROWS == 0, "the threads cover the rows a whole number of times");
    int row = threadIdx.x % TILE_ROWS;
    bool valid = row0 + row < seqlen;
    const __half *src_row = src + (size_t)(row0 + row) * HEAD_DIM;
    for (int d0 = threadIdx.x / TILE_ROWS * CHUNK_HALVES; d0 < HEAD_DIM; d0 += THREADS / TILE_ROWS * CHUNK_HALVES) {
        uint4 raw = valid ? *(const uint4 *)(src_row + d0) : make_uint4(0, 0, 0, 0);
        const __half2 *pairs = (const __half2 *)&raw;
        for (int e = 0; e < CHUNK_HALVES / 2; e++) {
            float2 f = __half22float2(pairs[e]);
            tile_t[(d0 + 2 * e) * TILE_ROWS + row] = f.x;
            tile_t[(d0 + 2 * e + 1) * TILE_ROWS + row] = f.y;
        }
    }
}

// TILE_ROWS rows of HEAD_DIM halves into shared memory as fp32, row-major [row][dim].
template <int HEAD_DIM, int TILE_ROWS>
__device__ void load_rows(float *tile, const __half *src, int row0, int seqlen) {
    static_assert(CHUNK_HALVES == 2 * VEC, "a 16-byte chunk of halves becomes two float4");
    constexpr int CHUNKS = HEAD_DIM / CHUNK_HALVES;  // 16-byte chunks per row
    for (int c = threadIdx.x; c < TILE_ROWS * CHUNKS; c += THREADS) {
        int row = c / CHUNKS, d0 = c % CHUNKS * CHUNK_HALVES;
        uint4 raw =
            row0 + row < seqlen ? *(const uint4 *)(src + (size_t)(row0 + row) * HEAD_DIM + d0) : make_uint4(0, 0, 0, 0);
        const __half2 *pairs = (const __half2 *)&raw;
        float2 a = __half22float2(pairs[0]), b = __half22float2(pairs[1]);
        float2 c2 = __half22float2(pairs[2]), d = __half22float2(pairs[3]);
        *(float4 *)&tile[row * HEAD_DIM + d0] = make_float4(a.x, a.y, b.x, b.y);
        *(float4 *)&tile[row * HEAD_DIM + d0 + VEC] = make_float4(c2.x, c2.y, d.x, d.y);
    }
}

// Max over the THREAD_COLS threads that share a row (one half-warp).
__device__ float row_group_max(float x) {
    for (int offset = THREAD_COLS / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, offset));
    return x;
}

__device__ float row_group_sum(float x) {
    for (int offset = THREAD_COLS / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffff, x, offset);
    return x;
}

template <int HEAD_DIM>
__global__ void __launch_bounds__(THREADS, 2)
    flash_attention_kernel(const __half *q, const __half *k, const __half *v, __half *o, float *lse, int seqlen,
                           float scale_log2, int causal) {
    constexpr int COLS_PER_THREAD = HEAD_DIM / THREAD_COLS;  // output columns per thread
    static_assert(COLS_PER_THREAD % VEC == 0, "a thread's output columns are whole float4");
    extern __shared__ __align__(16) float smem[];
    float *q_t = smem;                      // [HEAD_DIM][BLOCK_Q]: the Q tile, transposed
    float *kv = q_t + HEAD_DIM * BLOCK_Q;   // K as [HEAD_DIM][BLOCK_KV], then V as [BLOCK_KV][HEAD_DIM]
    float *p_t = kv + BLOCK_KV * HEAD_DIM;  // [BLOCK_KV][P_STRIDE]: probabilities, transposed

    const int tx = threadIdx.x % THREAD_COLS, ty = threadIdx.x / THREAD_COLS;
    // Causal work grows with the query tile, so the causal grid is (b*h, tiles) and hands out
    // the last (heaviest) tiles first: light ones fill the gaps at the end instead of a heavy one
    // running alone. Non-causal keeps 04's (tiles, b*h): neighbours share K and V in L2.
    const int query_tile = causal ? gridDim.y - 1 - blockIdx.y : blockIdx.x;
    const int query0 = query_tile * BLOCK_Q;
    const size_t head = causal ? blockIdx.x : blockIdx.y;
    const __half *q_head = q + head * seqlen * HEAD_DIM;
    const __half *k_head = k + head * seqlen * HEAD_DIM;
    const __half *v_head = v + head * seqlen * HEAD_DIM;
    load_transposed<HEAD_DIM, BLOCK_Q>(q_t, q_head, query0, seqlen);

    // On chip for the whole loop: per row, the running max (log2 units), sum and output.
    float row_max[ROWS_PER_THREAD], row_sum[ROWS_PER_THREAD], o_acc[ROWS_PER_THREAD][COLS_PER_THREAD] = {};
    for (int i = 0; i < ROWS_PER_THREAD; i++) {
        row_max[i] = -INFINITY;
        row_sum[i] = 0.0f;
    }

    // Causal: keys past this tile's last query are masked for every row: skip those tiles.
    // EXERCISE 05.key_end BEGIN: causal: end the key loop after the diagonal tile
    //   kind: speed
    //   gate: 1.10x
    //   shape: headline causal
    //   hint: The rows of query tile query0 see keys up to query0 + BLOCK_Q - 1. The stub loops over every
    //     key tile and masks the ones above the diagonal; stop after the diagonal tile (and never past
    //     seqlen).
    //   stub: measured as 04 causal (every tile computed, the upper ones masked): 16.4 ms against 8.12, 2.0x
    //     (docs/results/NVIDIA_H200.csv)
    const int key_end = causal ? min(seqlen, query0 + BLOCK_Q) : seqlen;
    // EXERCISE 05.key_end STUB
    // const int key_end = seqlen;  // every key tile, as 04: the mask hides the keys after the query
    // EXERCISE END
    for (int key0 = 0; key0 < key_end; key0 += BLOCK_KV) {
        __syncthreads();  // the previous tile's V and P are consumed
        load_transposed<HEAD_DIM, BLOCK_KV>(kv, k_head, key0, seqlen);
        __syncthreads();

        // S tile = Q K^T: each thread an 8 x 4 patch, from float4 reads of Q and K columns.
        float score[ROWS_PER_THREAD][KEYS_PER_THREAD] = {};
#pragma unroll 4
        for (int d = 0; d < HEAD_DIM; d++) {
            float4 qa = *(const float4 *)&q_t[d * BLOCK_Q + ty * VEC];
            float4 qb = *(const float4 *)&q_t[d * BLOCK_Q + ROW_STEP + ty * VEC];
            float4 kk = *(const float4 *)&kv[d * BLOCK_KV + tx * KEYS_PER_THREAD];
            float qv[ROWS_PER_THREAD] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
            float kvv[KEYS_PER_THREAD] = {kk.x, kk.y, kk.z, kk.w};
            for (int i = 0; i < ROWS_PER_THREAD; i++)
                for (int j = 0; j < KEYS_PER_THREAD; j++) score[i][j] += qv[i] * kvv[j];
        }

        // The mask: keys past the end, and (causal) keys after the query. Only the tile on the
        // diagonal (and a ragged last tile) needs it.
        // EXERCISE 05.diagonal_mask BEGIN: on the tiles that need it, -inf for keys past the end or after the query
        //   kind: correctness
        //   hint: Which tiles can hold a hidden key? A ragged last tile (key0 + BLOCK_KV > seqlen) and,
        //     causal, the diagonal one (key0 + BLOCK_KV - 1 > query0): test that, the same for the whole
        //     block. Inside: key = key0 + tx * KEYS_PER_THREAD + j, query = query0 + row_of(ty, i).
        if (key0 + BLOCK_KV > seqlen || (causal && key0 + BLOCK_KV - 1 > query0))
            for (int i = 0; i < ROWS_PER_THREAD; i++)
                for (int j = 0; j < KEYS_PER_THREAD; j++) {
                    int key = key0 + tx * KEYS_PER_THREAD + j, query = query0 + row_of(ty, i);
                    if (key >= seqlen || (causal && key > query)) score[i][j] = -INFINITY;
                }
        // EXERCISE END

        // Online softmax on the tile: new max, rescale what was accumulated, exponentiate.
        for (int i = 0; i < ROWS_PER_THREAD; i++) {
            float tile_max = -INFINITY;
            for (int j = 0; j < KEYS_PER_THREAD; j++) {
                score[i][j] *= scale_log2;
                tile_max = fmaxf(tile_max, score[i][j]);
            }
            float new_max = fmaxf(row_max[i], row_group_max(tile_max));
            float base = new_max == -INFINITY ? 0.0f : new_max;  // a row with no key yet stays empty
            float rescale = exp2f(row_max[i] - base);
            row_max[i] = new_max;
            row_sum[i] *= rescale;  // this thread's share of the row sum; reduced at the end
            for (int c = 0; c < COLS_PER_THREAD; c++) o_acc[i][c] *= rescale;
            for (int j = 0; j < KEYS_PER_THREAD; j++) {
                score[i][j] = exp2f(score[i][j] - base);
                row_sum[i] += score[i][j];
            }
        }
        // P to shared memory, transposed, so every thread can read the probabilities of its rows.
        for (int j = 0; j < KEYS_PER_THREAD; j++) {
            float *dst = &p_t[(tx * KEYS_PER_THREAD + j) * P_STRIDE + ty * VEC];
            *(float4 *)dst = make_float4(score[0][j], score[1][j], score[2][j], score[3][j]);
            *(float4 *)(dst + ROW_STEP) = make_float4(score[4][j], score[5][j], score[6][j], score[7][j]);
        }
        __syncthreads();  // K is consumed, P is visible
        load_rows<HEAD_DIM, BLOCK_KV>(kv, v_head, key0, seqlen);
        __syncthreads();

        // O += P V: each thread an 8 x COLS_PER_THREAD patch.
#pragma unroll 2
        for (int key = 0; key < BLOCK_KV; key++) {
            float4 pa = *(const float4 *)&p_t[key * P_STRIDE + ty * VEC];
            float4 pb = *(const float4 *)&p_t[key * P_STRIDE + ROW_STEP + ty * VEC];
            float pv[ROWS_PER_THREAD] = {pa.x, pa.y, pa.z, pa.w, pb.x, pb.y, pb.z, pb.w};
            float vv[COLS_PER_THREAD];
            for (int c4 = 0; c4 < COLS_PER_THREAD / VEC; c4++) {
                float4 x = *(const float4 *)&kv[key * HEAD_DIM + c4 * COL_STEP + tx * VEC];
                vv[c4 * VEC] = x.x;
                vv[c4 * VEC + 1] = x.y;
                vv[c4 * VEC + 2] = x.z;
                vv[c4 * VEC + 3] = x.w;
            }
            for (int i = 0; i < ROWS_PER_THREAD; i++)
                for (int c = 0; c < COLS_PER_THREAD; c++) o_acc[i][c] += pv[i] * vv[c];
        }
    }

    // O = accumulator / sum, LSE = ln(sum) + max, each written once.
    for (int i = 0; i < ROWS_PER_THREAD; i++) {
        float sum = row_group_sum(row_sum[i]), inv_sum = 1.0f / sum;
        int query = query0 + row_of(ty, i);
        if (query >= seqlen) continue;
        __half *o_row = o + (head * seqlen + query) * HEAD_DIM;
        for (int c4 = 0; c4 < COLS_PER_THREAD / VEC; c4++) {
            __half2 lo = __floats2half2_rn(o_acc[i][c4 * VEC] * inv_sum, o_acc[i][c4 * VEC + 1] * inv_sum);
            __half2 hi = __floats2half2_rn(o_acc[i][c4 * VEC + 2] * inv_sum, o_acc[i][c4 * VEC + 3] * inv_sum);
            *(__half2 *)&o_row[c4 * COL_STEP + tx * VEC] = lo;
            *(__half2 *)&o_row[c4 * COL_STEP + tx * VEC + 2] = hi;
        }
        if (tx == 0) lse[head * seqlen + query] = (row_max[i] + log2f(sum)) * LN2;
    }
}

// --- Launcher --------------------------------------------------------------------------------
template <int HEAD_DIM>
static cudaError_t launch(const AttnArgs *args, cudaStream_t stream) {
    const AttnShape *s = &args->shape;
    size_t smem = (HEAD_DIM * BLOCK_Q + BLOCK_KV * HEAD_DIM + BLOCK_KV * P_STRIDE) * sizeof(float);
    RETURN_IF_ERROR(
        cudaFuncSetAttribute(flash_attention_kernel<HEAD_DIM>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
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
    "05_causal",
    "causal done right: fully masked tiles skipped, only diagonal tiles masked, heaviest tiles first",
    PRECISION_FP32,
    80,
    0,     // oldest and newest GPU it runs on (0: no newest)
    NULL,  // no workspace: S and P stay on chip
    NULL,  // nothing to prepare before the forward
    forward,
};
