// 02_tiling: the two matrix products of 01, tiled through shared memory.
//
//   S = Q K^T * scale   scores_kernel    a block computes a 64 x 64 tile of S from Q and K slices
//                                        staged in shared memory; each thread owns a 4 x 4 patch
//   P = softmax(S)      softmax_kernel   unchanged: one warp per row, three passes over S
//   O = P V             pv_kernel        a block computes a 64 x 64 tile of O from P and V slices
//                                        staged in shared memory; each thread owns a 4 x 4 patch
//
// S and P still live in device memory (B*H*N*N floats). Math is fp32 on CUDA cores.
#include "../common/harness.h"

#define TILE 64      // output tile edge: 64 x 64 elements per block
#define TILE_K 32    // reduction slice staged per step (head dims for S, keys for O)
#define THREADS 256  // 16 x 16 threads, each a 4 x 4 patch of the tile
#define PATCH 4      // TILE / 16
// EXERCISE 02.pad BEGIN: pad the shared rows so that the staging stores of a warp spread over the banks
//   kind: speed
//   gate: 1.05x
//   shape: headline
//   hint: In the staging stores the 32 lanes of a warp write one column of a [TILE_K][TILE + PAD] tile: 32
//     rows, TILE + PAD floats apart. Work out each lane's bank (4-byte banks, 32 of them) for a few values of
//     PAD; it must stay a multiple of 4 (the float4 reads).
//   stub: not timed: with PAD 0 every staging store of S's operands and of P is a 32-way bank conflict, 8
//     times the wavefronts of PAD 4's 4-way
#define PAD 4  // floats of padding per shared row: fewer bank conflicts, float4-aligned
// EXERCISE 02.pad STUB
// #define PAD 0  // floats of padding per shared row (a multiple of 4: rows stay float4-aligned)
// EXERCISE END
#define SOFTMAX_WARPS 4  // softmax_kernel: rows handled per 128-thread block
#define WARP_SIZE 32

// Outer product of a 4-vector slice of A and of B, accumulated into the thread's patch.
__device__ void patch_fma(float acc[PATCH][PATCH], float4 a, float4 b) {
    // EXERCISE 02.patch_fma BEGIN: the outer product of a and b added into the 4 x 4 patch: 16 FMAs from 8 floats
    //   kind: correctness
    //   hint: Unpack a and b into 4 floats each and add av[i] * bv[j] into acc[i][j] for all 16 (i, j): each
    //     of the 8 values read from shared memory feeds 4 multiply-adds.
    float av[PATCH] = {a.x, a.y, a.z, a.w}, bv[PATCH] = {b.x, b.y, b.z, b.w};
    for (int i = 0; i < PATCH; i++)
        for (int j = 0; j < PATCH; j++) acc[i][j] += av[i] * bv[j];
    // EXERCISE END
}

// --- S = Q K^T * scale (causal: -inf above the diagonal) -------------------------------
__global__ void __launch_bounds__(THREADS)
    scores_kernel(const __half *q, const __half *k, float *scores, int seqlen, int head_dim, float scale, int causal) {
    __shared__ __align__(16) float q_tile[TILE_K][TILE + PAD];  // [dim][query]: transposed
    __shared__ __align__(16) float k_tile[TILE_K][TILE + PAD];  // [dim][key]
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int key0 = blockIdx.x * TILE, query0 = blockIdx.y * TILE;
    const size_t head = blockIdx.z;
    const __half *q_head = q + head * seqlen * head_dim, *k_head = k + head * seqlen * head_dim;

    float acc[PATCH][PATCH] = {};
    for (int d0 = 0; d0 < head_dim; d0 += TILE_K) {
        // Stage a 64 x 32 slice of Q and of K; consecutive threads read consecutive dims.
        for (int e = threadIdx.x; e < TILE * TILE_K; e += THREADS) {
            int row = e / TILE_K, d = e % TILE_K;
            q_tile[d][row] =
                query0 + row < seqlen ? __half2float(q_head[(size_t)(query0 + row) * head_dim + d0 + d]) : 0.0f;
            k_tile[d][row] =
                key0 + row < seqlen ? __half2float(k_head[(size_t)(key0 + row) * head_dim + d0 + d]) : 0.0f;
        }
        __syncthreads();
        // Each staged value now feeds 4 multiply-adds of this thread (and 64 of the block).
        for (int d = 0; d < TILE_K; d++)
            patch_fma(acc, *(const float4 *)&q_tile[d][ty * PATCH], *(const float4 *)&k_tile[d][tx * PATCH]);
        __syncthreads();
    }
    for (int i = 0; i < PATCH; i++) {
        int query = query0 + ty * PATCH + i;
        if (query >= seqlen) continue;
        for (int j = 0; j < PATCH; j++) {
            int key = key0 + tx * PATCH + j;
            if (key < seqlen)
                scores[(head * seqlen + query) * seqlen + key] =
                    (causal && key > query) ? -INFINITY : acc[i][j] * scale;
        }
    }
}

// --- P = softmax(S), row by row, in place; LSE = max + log(sum) ------------------------------
__device__ float warp_max(float x) {
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, offset));
    return x;
}

__device__ float warp_sum(float x) {
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffff, x, offset);
    return x;
}

__global__ void softmax_kernel(float *scores, float *lse, int seqlen, long long rows) {
    long long row = (long long)blockIdx.x * SOFTMAX_WARPS + threadIdx.x / WARP_SIZE;
    int lane = threadIdx.x % WARP_SIZE;
    if (row >= rows) return;
    float *s_row = scores + row * seqlen;

    float row_max = -INFINITY;  // pass 1: the maximum, so exp never overflows
    for (int j = lane; j < seqlen; j += WARP_SIZE) row_max = fmaxf(row_max, s_row[j]);
    row_max = warp_max(row_max);

    float row_sum = 0.0f;  // pass 2: the normaliser
    for (int j = lane; j < seqlen; j += WARP_SIZE) row_sum += expf(s_row[j] - row_max);
    row_sum = warp_sum(row_sum);

    float inv_sum = 1.0f / row_sum;
    for (int j = lane; j < seqlen; j += WARP_SIZE)  // pass 3: the probabilities
        s_row[j] = expf(s_row[j] - row_max) * inv_sum;
    if (lane == 0) lse[row] = row_max + logf(row_sum);
}

// --- O = P V ---------------------------------------------------------------------------------
__global__ void __launch_bounds__(THREADS)
    pv_kernel(const float *probs, const __half *v, __half *o, int seqlen, int head_dim) {
    __shared__ __align__(16) float p_tile[TILE_K][TILE + PAD];  // [key][query]: transposed
    __shared__ __align__(16) float v_tile[TILE_K][TILE + PAD];  // [key][dim]
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int query0 = blockIdx.x * TILE, dim0 = blockIdx.y * TILE;
    const size_t head = blockIdx.z;
    const float *p_head = probs + head * seqlen * seqlen;
    const __half *v_head = v + head * seqlen * head_dim;

    float acc[PATCH][PATCH] = {};
    for (int key0 = 0; key0 < seqlen; key0 += TILE_K) {
        // Stage 64 rows x 32 keys of P and 32 keys x 64 dims of V, reading along rows.
        for (int e = threadIdx.x; e < TILE * TILE_K; e += THREADS) {
            int row = e / TILE_K, key = e % TILE_K;
            p_tile[key][row] = query0 + row < seqlen && key0 + key < seqlen
                                   ? p_head[(size_t)(query0 + row) * seqlen + key0 + key]
                                   : 0.0f;
            int vkey = e / TILE, d = e % TILE;
            v_tile[vkey][d] =
                key0 + vkey < seqlen ? __half2float(v_head[(size_t)(key0 + vkey) * head_dim + dim0 + d]) : 0.0f;
        }
        __syncthreads();
        for (int key = 0; key < TILE_K; key++)
            patch_fma(acc, *(const float4 *)&p_tile[key][ty * PATCH], *(const float4 *)&v_tile[key][tx * PATCH]);
        __syncthreads();
    }
    for (int i = 0; i < PATCH; i++) {
        int query = query0 + ty * PATCH + i;
        if (query >= seqlen) continue;
        for (int j = 0; j < PATCH; j++)
            o[(head * seqlen + query) * head_dim + dim0 + tx * PATCH + j] = __float2half(acc[i][j]);
    }
}

// --- Launcher --------------------------------------------------------------------------------
static size_t workspace_bytes(const AttnShape *s) {
    return (size_t)s->batch * s->heads * s->seqlen * s->seqlen * sizeof(float);  // S, then P
}

static cudaError_t forward(const AttnArgs *args, cudaStream_t stream) {
    const AttnShape *s = &args->shape;
    int n = s->seqlen, heads = s->batch * s->heads;
    float *scores = (float *)args->workspace;

    dim3 score_grid(ceil_div(n, TILE), ceil_div(n, TILE), heads);
    scores_kernel<<<score_grid, THREADS, 0, stream>>>(args->q, args->k, scores, n, s->headdim, s->scale, s->causal);
    RETURN_IF_ERROR(cudaGetLastError());

    long long rows = (long long)heads * n;
    softmax_kernel<<<(unsigned)((rows + SOFTMAX_WARPS - 1) / SOFTMAX_WARPS), SOFTMAX_WARPS * WARP_SIZE, 0, stream>>>(
        scores, args->lse, n, rows);
    RETURN_IF_ERROR(cudaGetLastError());

    pv_kernel<<<dim3(ceil_div(n, TILE), s->headdim / TILE, heads), THREADS, 0, stream>>>(scores, args->v, args->o, n,
                                                                                         s->headdim);
    return cudaGetLastError();
}

const Chapter chapter = {
    "02_tiling",
    "shared-memory tiling of both matmuls (data reuse through SRAM); S still in device memory",
    PRECISION_FP32,
    75,
    0,  // oldest and newest GPU it runs on (0: no newest)
    workspace_bytes,
    NULL,  // nothing to prepare before the forward
    forward,
};
