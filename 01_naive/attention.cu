// 01_naive: attention exactly as the formula reads, one step per kernel.
//
//   S = Q K^T * scale   scores_kernel    one thread per score; S is B*H*N*N floats in device memory
//   P = softmax(S)      softmax_kernel   one warp per row: a max pass, a sum pass, a normalise pass
//   O = P V             pv_kernel        one thread per output element
//
// Every operand is read straight from device memory: nothing is staged in shared memory.
// Math is fp32 on CUDA cores; inputs and output are fp16.
#include "../common/harness.h"

#define SCORE_BLOCK 16   // scores_kernel: 16 x 16 threads, one per element of S
#define SOFTMAX_WARPS 4  // softmax_kernel: rows handled per 128-thread block
#define WARP_SIZE 32

// --- S = Q K^T * scale (causal: -inf above the diagonal) -------------------------------
__global__ void scores_kernel(const __half *q, const __half *k, float *scores, int seqlen, int head_dim, float scale,
                              int causal) {
    int key = blockIdx.x * SCORE_BLOCK + threadIdx.x;
    int query = blockIdx.y * SCORE_BLOCK + threadIdx.y;
    size_t head = blockIdx.z;
    if (query >= seqlen || key >= seqlen) return;
    const __half *q_row = q + (head * seqlen + query) * head_dim;
    const __half *k_row = k + (head * seqlen + key) * head_dim;
    float dot = 0.0f;
    for (int d = 0; d < head_dim; d++) dot += __half2float(q_row[d]) * __half2float(k_row[d]);
    scores[(head * seqlen + query) * seqlen + key] = (causal && key > query) ? -INFINITY : dot * scale;
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
    // EXERCISE 01.softmax BEGIN: one warp per row of S: P = softmax(S) in place, and the row's LSE
    //   kind: correctness
    //   hint: Each warp takes one row: row = blockIdx.x * SOFTMAX_WARPS + threadIdx.x / WARP_SIZE, and the
    //     warp returns if row >= rows. Make three passes over the row, the lanes striding by WARP_SIZE: the
    //     max (combine the lanes with warp_max), the sum of expf(s - max) (warp_sum), then
    //     P = expf(s - max) * (1 / sum) in place. Lane 0 writes lse[row] = max + logf(sum).
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
    // EXERCISE END
}

// --- O = P V ---------------------------------------------------------------------------------
__global__ void pv_kernel(const float *probs, const __half *v, __half *o, int seqlen, int head_dim) {
    // EXERCISE 01.pv_columns BEGIN: map threads to output elements so that a warp's loads coalesce
    //   kind: speed
    //   gate: 1.10x
    //   shape: B=1 H=16 N=2048 D=128
    //   hint: In the stub a warp's lanes take 32 queries of one column: each load of P touches 32 rows (32
    //     sectors) while every lane reads the same V element. Give thread d = threadIdx.x of block (query
    //     blockIdx.x, head blockIdx.y) column d: V loads coalesce and p_row[key] is one address for the whole
    //     warp.
    //   stub: not timed: it reads P as scores_kernel reads K (a row per lane), and scores_kernel takes 5.7x
    //     pv_kernel's time for the same FLOPs
    int d = threadIdx.x;  // blockDim.x == head_dim
    int query = blockIdx.x;
    size_t head = blockIdx.y;
    const float *p_row = probs + (head * seqlen + query) * seqlen;
    const __half *v_head = v + head * seqlen * head_dim;
    float acc = 0.0f;
    for (int key = 0; key < seqlen; key++) acc += p_row[key] * __half2float(v_head[(size_t)key * head_dim + d]);
    o[(head * seqlen + query) * head_dim + d] = __float2half(acc);
    // EXERCISE 01.pv_columns STUB
    // // Lanes along the queries: element e = blockIdx.x * head_dim + threadIdx.x of the head's
    // // outputs, taken column by column (query = e % seqlen, d = e / seqlen).
    // int e = blockIdx.x * head_dim + threadIdx.x;
    // int query = e % seqlen, d = e / seqlen;
    // size_t head = blockIdx.y;
    // const float *p_row = probs + (head * seqlen + query) * seqlen;
    // const __half *v_head = v + head * seqlen * head_dim;
    // float acc = 0.0f;
    // for (int key = 0; key < seqlen; key++) acc += p_row[key] * __half2float(v_head[(size_t)key * head_dim + d]);
    // o[(head * seqlen + query) * head_dim + d] = __float2half(acc);
    // EXERCISE END
}

// --- Launcher --------------------------------------------------------------------------------
static size_t workspace_bytes(const AttnShape *s) {
    return (size_t)s->batch * s->heads * s->seqlen * s->seqlen * sizeof(float);  // S, then P
}

static cudaError_t forward(const AttnArgs *args, cudaStream_t stream) {
    const AttnShape *s = &args->shape;
    int n = s->seqlen, heads = s->batch * s->heads;
    float *scores = (float *)args->workspace;

    dim3 score_grid(ceil_div(n, SCORE_BLOCK), ceil_div(n, SCORE_BLOCK), heads);
    scores_kernel<<<score_grid, dim3(SCORE_BLOCK, SCORE_BLOCK), 0, stream>>>(args->q, args->k, scores, n, s->headdim,
                                                                             s->scale, s->causal);
    RETURN_IF_ERROR(cudaGetLastError());

    long long rows = (long long)heads * n;
    softmax_kernel<<<(unsigned)((rows + SOFTMAX_WARPS - 1) / SOFTMAX_WARPS), SOFTMAX_WARPS * WARP_SIZE, 0, stream>>>(
        scores, args->lse, n, rows);
    RETURN_IF_ERROR(cudaGetLastError());

    pv_kernel<<<dim3(n, heads), s->headdim, 0, stream>>>(scores, args->v, args->o, n, s->headdim);
    return cudaGetLastError();
}

const Chapter chapter = {
    "01_naive",
    "textbook attention: S = QK^T, softmax, PV as separate kernels, S and P in device memory",
    PRECISION_FP32,
    75,
    0,  // oldest and newest GPU it runs on (0: no newest)
    workspace_bytes,
    NULL,  // nothing to prepare before the forward
    forward,
};
