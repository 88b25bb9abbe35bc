// 09_backward: the backward pass, FlashAttention-2's, on 07's datapath (mma.sync m16n8k16,
// ldmatrix, a cp.async ring, operands repacked in registers). The forward is 07's, copied.
//
// Backward, three kernels: (1) D = rowsum(dO * O) per query row into the workspace (and the fp32
// dQ accumulator zeroed); (2) one block per (key tile, b*h), eight warps, 256 keys at D=64 and
// 128 at D=128, K and V in shared memory for the whole loop, Q, dO, LSE and D streamed through a
// cp.async ring, one tile of 64 queries at a time; each warp owns its keys' dK, dV accumulators
// (registers; at D=128 FlashAttention-2's split of the warps, below). It recomputes
// S^T = K Q^T and P^T = exp(S^T * scale - LSE), then dV += P^T dO, dP^T = V dO^T,
// dS^T = P^T * (dP^T - D), dK += dS^T Q, and adds dQ += dS K into the fp32 workspace (atomics);
// (3) dQ to fp16. DETERMINISTIC_DQ=1: each block of a head takes several key tiles in turn and
// adds into a workspace copy of its own, and (3) sums the copies in order; BWD_DQ_KERNEL=1 replaces
// the main kernel's dQ and (3) by a kernel over query tiles.
#include <cuda_pipeline_primitives.h>

#include "../common/harness.h"

#define WARP_SIZE 32
#define WARPS 4
#define THREADS (WARPS * WARP_SIZE)
// The tensor-core instruction, mma.sync m16n8k16: A is MMA_M x MMA_K, B is MMA_K x MMA_N.
#define MMA_M 16
#define MMA_N 8
#define MMA_K 16
#define WARP_Q 32                 // forward: query rows per warp
#define M_TILES (WARP_Q / MMA_M)  // m16 tiles per warp: 2
#define BLOCK_Q (WARPS * WARP_Q)  // query rows per block: 128
// The forward's keys per streamed tile and (K, V) tiles in its ring, per head dim (07's).
#ifndef BLOCK_KV_D64
#define BLOCK_KV_D64 64
#endif
#ifndef BLOCK_KV_D128
#define BLOCK_KV_D128 64
#endif
#ifndef STAGES_D64
#define STAGES_D64 3
#endif
#ifndef STAGES_D128
#define STAGES_D128 2
#endif
// Tiles move in 16-byte chunks: one cp.async, one row of an 8x8 matrix of ldmatrix.
#define CHUNK_BYTES 16
#define CHUNK_HALVES (CHUNK_BYTES / (int)sizeof(__half))  // 8
#define LDM_ROWS 8                                        // rows of an ldmatrix matrix, one lane's address each
// Halves of padding per row: one chunk, so 8 consecutive rows start in 8 different banks, and
// ldmatrix is conflict-free.
#define PAD CHUNK_HALVES
#define STEP_CHUNKS (MMA_K / CHUNK_HALVES)  // chunks per row of a k16 step: 2
// Registers per lane: the fp32 accumulator, and the A and B operands (two halves per register).
#define ACC_REGS (MMA_M * MMA_N / WARP_SIZE)    // 4
#define A_REGS (MMA_M * MMA_K / 2 / WARP_SIZE)  // 4
#define B_REGS (MMA_K * MMA_N / 2 / WARP_SIZE)  // 2
// The accumulator layout: the QUAD_LANES lanes of a quad share a row; lane l holds rows l / 4
// and l / 4 + ACC_ROW_STEP (ACC_ROWS of them), columns 2 * (l % 4) and 2 * (l % 4) + 1.
#define QUAD_LANES 4
#define ACC_ROW_STEP (WARP_SIZE / QUAD_LANES)  // 8
#define ACC_ROWS (MMA_M / ACC_ROW_STEP)        // 2
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

static_assert(WARP_Q % MMA_M == 0, "a warp's rows are whole m16 tiles");
static_assert(ACC_REGS == 4 && A_REGS == 4 && B_REGS == 2, "the operands that mma_16x8x16's PTX names");
static_assert(LDM_ROWS == CHUNK_HALVES, "a row of an ldmatrix matrix is one chunk");
static_assert(MMA_M == 2 * LDM_ROWS && MMA_K == 2 * LDM_ROWS && MMA_N == LDM_ROWS,
              "an A operand is four ldmatrix matrices (2 x 2), a B operand two (k16 x n8)");
static_assert(MMA_K == 2 * MMA_N, "the accumulators of two n8 score tiles are the A operand of one k16 step");
static_assert(ACC_ROWS * 2 == ACC_REGS && QUAD_LANES * 2 == MMA_N, "a lane holds two adjacent columns per row");

template <int HEAD_DIM>
struct Config {
    static constexpr int BLOCK_KV = HEAD_DIM == 128 ? BLOCK_KV_D128 : BLOCK_KV_D64;
    static constexpr int STAGES = HEAD_DIM == 128 ? STAGES_D128 : STAGES_D64;
    static constexpr int STRIDE = HEAD_DIM + PAD;  // halves per row of every tile
    static constexpr int Q_HALVES = BLOCK_Q * STRIDE, KV_HALVES = BLOCK_KV * STRIDE;
    static constexpr int SMEM_BYTES = (Q_HALVES + 2 * STAGES * KV_HALVES) * (int)sizeof(__half);
    // A warp's Q fragments take HEAD_DIM registers per thread. At 64 they stay in registers for
    // the whole loop; at 128 the 32 x 128 fp32 output accumulator already holds 128 of a thread's
    // 255 registers, so Q is re-read from shared memory at every tile.
    static constexpr bool Q_IN_REGISTERS = HEAD_DIM == 64;
};

// Where chunk `chunk` (8 halves, 16 bytes) of row `row` of a tile lives in shared memory.
template <int HEAD_DIM>
__device__ int tile_offset(int row, int chunk) {
    return row * Config<HEAD_DIM>::STRIDE + chunk * CHUNK_HALVES;
}

// --- The tensor-core instructions, as the PTX ISA documents them ---------------------------
// Four 8x8 b16 matrices from shared memory; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ void ldmatrix_x4(unsigned frag[4], const __half *row_address) {
    unsigned addr = (unsigned)__cvta_generic_to_shared(row_address);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(frag[0]), "=r"(frag[1]), "=r"(frag[2]), "=r"(frag[3])
                 : "r"(addr));
}

// The same, each matrix transposed on the way (V is stored [key][dim], the MMA wants [dim][key]).
__device__ void ldmatrix_x4_trans(unsigned frag[4], const __half *row_address) {
    unsigned addr = (unsigned)__cvta_generic_to_shared(row_address);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(frag[0]), "=r"(frag[1]), "=r"(frag[2]), "=r"(frag[3])
                 : "r"(addr));
}

// acc (16x8, fp32) += a (16x16, fp16, row-major) * b (16x8, fp16, column-major).
// Lane l holds acc rows l/4 (elements 0, 1) and l/4 + 8 (elements 2, 3), columns 2*(l%4) + {0, 1}.
__device__ void mma_16x8x16(float acc[ACC_REGS], const unsigned a[A_REGS], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ unsigned pack_half2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *(unsigned *)&h;
}

// The A fragments of k16 step `ks` for a warp's WARP_Q query rows (M_TILES m16 tiles). Lane l
// gives row l % 16 of the m16 tile, in chunk l / 16 of the step.
template <int HEAD_DIM>
__device__ void load_q_step(unsigned frag[M_TILES][A_REGS], const __half *q_tile, int warp_row0, int ks) {
    const int lane = threadIdx.x % WARP_SIZE;
#pragma unroll
    for (int mt = 0; mt < M_TILES; mt++)
        ldmatrix_x4(frag[mt], q_tile + tile_offset<HEAD_DIM>(warp_row0 + mt * MMA_M + lane % MMA_M,
                                                             ks * STEP_CHUNKS + lane / MMA_M));
}

// The B fragments of k16 step `ks` for every key of the tile, two n8 tiles (16 keys) per ldmatrix.
// Lane l gives key l % 8 of n8 tile l / 16 of the pair, in chunk l / 8 % 2 of the step.
template <int HEAD_DIM, int KEY_TILES>
__device__ void load_k_step(unsigned frag[KEY_TILES / 2][2 * B_REGS], const __half *k_tile, int ks) {
    const int lane = threadIdx.x % WARP_SIZE;
#pragma unroll
    for (int np = 0; np < KEY_TILES / 2; np++) {
        const int key = np * (2 * MMA_N) + lane % LDM_ROWS + lane / (STEP_CHUNKS * LDM_ROWS) * MMA_N;
        ldmatrix_x4(frag[np], k_tile + tile_offset<HEAD_DIM>(key, ks * STEP_CHUNKS + lane / LDM_ROWS % STEP_CHUNKS));
    }
}

// --- The pipeline: rows of a tile copied to shared memory asynchronously (cp.async) ---------
// Thread t of BLOCK_THREADS copies chunk t % CHUNKS of rows t / CHUNKS, + ROWS_PER_PASS, ...: a
// fixed number of 16-byte copies whose addresses differ by constants. Rows past seqlen are zero-filled.
template <int HEAD_DIM, int TILE_ROWS, int BLOCK_THREADS = THREADS>
__device__ void load_tile_async(__half *tile, const __half *src, int row0, int seqlen) {
    constexpr int CHUNKS = HEAD_DIM / CHUNK_HALVES, ROWS_PER_PASS = BLOCK_THREADS / CHUNKS;
    static_assert(TILE_ROWS % ROWS_PER_PASS == 0, "every thread copies the same number of chunks");
    const int row = threadIdx.x / CHUNKS, chunk = threadIdx.x % CHUNKS;
    const __half *from = src + (size_t)(row0 + row) * HEAD_DIM + chunk * CHUNK_HALVES;
    if (row0 + TILE_ROWS <= seqlen) {  // a whole tile (all but the last): no checks
#pragma unroll
        for (int i = 0; i < TILE_ROWS / ROWS_PER_PASS; i++)
            __pipeline_memcpy_async(&tile[tile_offset<HEAD_DIM>(row + i * ROWS_PER_PASS, chunk)],
                                    from + i * ROWS_PER_PASS * HEAD_DIM, CHUNK_BYTES);
    } else {
#pragma unroll
        for (int i = 0; i < TILE_ROWS / ROWS_PER_PASS; i++) {
            bool valid = row0 + row + i * ROWS_PER_PASS < seqlen;
            __pipeline_memcpy_async(&tile[tile_offset<HEAD_DIM>(row + i * ROWS_PER_PASS, chunk)],
                                    valid ? from + i * ROWS_PER_PASS * HEAD_DIM : src, CHUNK_BYTES,
                                    valid ? 0 : CHUNK_BYTES);
        }
    }
}

// --- Online softmax on the score accumulators ----------------------------------------------
// 2^x as one MUFU instruction. exp2f() adds fix-ups for results below 2^-126, which a
// probability can lose (they flush to 0): four instructions per score instead of one.
__device__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// -inf wherever the causal mask or the end of the sequence hides the key. Lane element
// [mt][nt][2r+e] holds query row0 + 16mt + 8r and key key0 + 8nt + e (row0, key0: the lane's first).
// Called only for the tiles that need it: on the diagonal, or past the end of the sequence.
template <int KEY_TILES>
__device__ void mask_scores(float score[M_TILES][KEY_TILES][ACC_REGS], int row0, int key0, int seqlen, int causal) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; mt++)
#pragma unroll
        for (int r = 0; r < ACC_ROWS; r++) {
            int query = row0 + mt * MMA_M + r * ACC_ROW_STEP;
            int key_limit = causal ? min(seqlen, query + 1) : seqlen;  // first hidden key
#pragma unroll
            for (int nt = 0; nt < KEY_TILES; nt++)
#pragma unroll
                for (int e = 0; e < 2; e++)
                    if (key0 + nt * MMA_N + e >= key_limit) score[mt][nt][2 * r + e] = -INFINITY;
        }
}

// Max over the QUAD_LANES lanes that share a row of an MMA accumulator: shuffles 1 and 2 apart.
__device__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}

__device__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffff, x, 1);
    return x + __shfl_xor_sync(0xffffffff, x, 2);
}

template <int HEAD_DIM>
__global__ void __launch_bounds__(THREADS, 2)
    flash_attention_kernel(const __half *q, const __half *k, const __half *v, __half *o, float *lse, int seqlen,
                           float scale_log2, int causal) {
    constexpr int BLOCK_KV = Config<HEAD_DIM>::BLOCK_KV, STAGES = Config<HEAD_DIM>::STAGES;
    constexpr int Q_HALVES = Config<HEAD_DIM>::Q_HALVES, KV_HALVES = Config<HEAD_DIM>::KV_HALVES;
    constexpr bool Q_IN_REGISTERS = Config<HEAD_DIM>::Q_IN_REGISTERS;
    constexpr int KEY_TILES = BLOCK_KV / MMA_N;  // n8 tiles of scores per m16 tile
    constexpr int DIM_TILES = HEAD_DIM / MMA_N;  // n8 tiles of output per m16 tile
    constexpr int K_STEPS = HEAD_DIM / MMA_K;    // k16 steps of S = Q K^T
    extern __shared__ __align__(128) unsigned char smem[];
    __half *q_tile = (__half *)smem;               // [BLOCK_Q][STRIDE]
    __half *k_ring = q_tile + Q_HALVES;            // [STAGES][BLOCK_KV][STRIDE]
    __half *v_ring = k_ring + STAGES * KV_HALVES;  // [STAGES][BLOCK_KV][STRIDE]

    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int group = lane / QUAD_LANES, quad_lane = lane % QUAD_LANES;  // accumulator row and column pair
    // Causal work grows with the query tile, so the causal grid is (b*h, tiles) and hands out
    // the last (heaviest) tiles first: light ones fill the gaps at the end instead of a heavy one
    // running alone. Non-causal keeps 04's (tiles, b*h): neighbours share K and V in L2.
    const int query_tile = causal ? gridDim.y - 1 - blockIdx.y : blockIdx.x;
    const int query0 = query_tile * BLOCK_Q;
    const size_t head = causal ? blockIdx.x : blockIdx.y;
    const __half *q_head = q + head * seqlen * HEAD_DIM;
    const __half *k_head = k + head * seqlen * HEAD_DIM;
    const __half *v_head = v + head * seqlen * HEAD_DIM;
    const int warp_row0 = warp * WARP_Q;

    // Causal: keys past this tile's last query are masked for every row: skip those tiles.
    const int key_end = causal ? min(seqlen, query0 + BLOCK_Q) : seqlen;
    const int kv_tiles = ceil_div(key_end, BLOCK_KV);

    // Fill the ring: Q and the first STAGES-1 (K, V) tiles, one commit group per tile.
    load_tile_async<HEAD_DIM, BLOCK_Q>(q_tile, q_head, query0, seqlen);
    for (int t = 0; t < STAGES - 1; t++) {
        if (t < kv_tiles) {
            load_tile_async<HEAD_DIM, BLOCK_KV>(k_ring + t * KV_HALVES, k_head, t * BLOCK_KV, seqlen);
            load_tile_async<HEAD_DIM, BLOCK_KV>(v_ring + t * KV_HALVES, v_head, t * BLOCK_KV, seqlen);
        }
        __pipeline_commit();
    }

    // On chip for the whole loop: per row, the running max (log2 units) and this lane's share
    // of the sum; per warp, the 32 x HEAD_DIM output accumulator. [m16 tile][row g or g+8].
    float row_max[M_TILES][ACC_ROWS], row_sum[M_TILES][ACC_ROWS], o_acc[M_TILES][DIM_TILES][ACC_REGS] = {};
    unsigned q_regs[Q_IN_REGISTERS ? K_STEPS : 1][M_TILES][A_REGS];  // [k16 step][m16 tile]: Q, if it fits
    for (int mt = 0; mt < M_TILES; mt++)
        for (int r = 0; r < ACC_ROWS; r++) {
            row_max[mt][r] = -INFINITY;
            row_sum[mt][r] = 0.0f;
        }

    for (int tile = 0; tile < kv_tiles; tile++) {
        // Tile `tile` has landed once at most STAGES-2 younger groups are still in flight.
        __pipeline_wait_prior(STAGES - 2);
        __syncthreads();  // ...for every thread's copies; and the slot refilled next is consumed
        const int next = tile + STAGES - 1;
        if (next < kv_tiles) {
            load_tile_async<HEAD_DIM, BLOCK_KV>(k_ring + next % STAGES * KV_HALVES, k_head, next * BLOCK_KV, seqlen);
            load_tile_async<HEAD_DIM, BLOCK_KV>(v_ring + next % STAGES * KV_HALVES, v_head, next * BLOCK_KV, seqlen);
        }
        __pipeline_commit();  // possibly empty: keeps one group per tile
        const __half *k_tile = k_ring + tile % STAGES * KV_HALVES;
        const __half *v_tile = v_ring + tile % STAGES * KV_HALVES;
        const int key0 = tile * BLOCK_KV;

        if constexpr (Q_IN_REGISTERS) {  // Q has landed with the first tile
            if (tile == 0)
                for (int ks = 0; ks < K_STEPS; ks++) load_q_step<HEAD_DIM>(q_regs[ks], q_tile, warp_row0, ks);
        }

        // S = Q K^T: per m16 tile, KEY_TILES accumulators of 16 x 8 scores. The fragments of
        // k-step ks+1 are loaded (ldmatrix) while the MMAs of step ks run: two register buffers.
        float score[M_TILES][KEY_TILES][ACC_REGS] = {};
        unsigned q_frag[2][M_TILES][A_REGS], k_frag[2][KEY_TILES / 2][2 * B_REGS];  // [buffer][...]
        if constexpr (!Q_IN_REGISTERS) load_q_step<HEAD_DIM>(q_frag[0], q_tile, warp_row0, 0);
        load_k_step<HEAD_DIM, KEY_TILES>(k_frag[0], k_tile, 0);
#pragma unroll
        for (int ks = 0; ks < K_STEPS; ks++) {
            const int cur = ks % 2, nxt = (ks + 1) % 2;
            if (ks + 1 < K_STEPS) {
                if constexpr (!Q_IN_REGISTERS) load_q_step<HEAD_DIM>(q_frag[nxt], q_tile, warp_row0, ks + 1);
                load_k_step<HEAD_DIM, KEY_TILES>(k_frag[nxt], k_tile, ks + 1);
            }
            unsigned(*q_step)[A_REGS];  // this step's Q fragments, [m16 tile]
            if constexpr (Q_IN_REGISTERS) q_step = q_regs[ks];
            else q_step = q_frag[cur];
#pragma unroll
            for (int np = 0; np < KEY_TILES / 2; np++)
#pragma unroll
                for (int mt = 0; mt < M_TILES; mt++) {
                    mma_16x8x16(score[mt][2 * np], q_step[mt], k_frag[cur][np][0], k_frag[cur][np][1]);
                    mma_16x8x16(score[mt][2 * np + 1], q_step[mt], k_frag[cur][np][2], k_frag[cur][np][3]);
                }
        }

        // Only the tiles on the diagonal (and a ragged last tile) need the mask.
        if (key0 + BLOCK_KV > seqlen || (causal && key0 + BLOCK_KV - 1 > query0))
            mask_scores<KEY_TILES>(score, query0 + warp_row0 + group, key0 + 2 * quad_lane, seqlen, causal);

        // Online softmax in registers: lane holds rows g and g+8 of each m16 tile, 2 keys per n8 tile.
        unsigned p_frag[M_TILES][KEY_TILES / 2][A_REGS];  // P as the A operand of the next MMA
#pragma unroll
        for (int mt = 0; mt < M_TILES; mt++) {
#pragma unroll
            for (int r = 0; r < ACC_ROWS; r++) {
                float tile_max = -INFINITY;
#pragma unroll
                for (int nt = 0; nt < KEY_TILES; nt++)
                    tile_max = fmaxf(tile_max, fmaxf(score[mt][nt][2 * r], score[mt][nt][2 * r + 1]));
                float new_max = fmaxf(row_max[mt][r], quad_max(tile_max) * scale_log2);
                float base = new_max == -INFINITY ? 0.0f : new_max;  // a row with no key yet stays empty
                float rescale = exp2_approx(row_max[mt][r] - base);
                row_max[mt][r] = new_max;
                row_sum[mt][r] *= rescale;
                // Rescale O only if some row of the warp found a new max. At HEAD_DIM 64 the 64
                // multiplies cost less than the vote (measured), so they are always done.
                if (HEAD_DIM == 64 || __any_sync(0xffffffff, rescale != 1.0f))
#pragma unroll
                    for (int nt = 0; nt < DIM_TILES; nt++) {
                        o_acc[mt][nt][2 * r] *= rescale;
                        o_acc[mt][nt][2 * r + 1] *= rescale;
                    }
#pragma unroll
                for (int nt = 0; nt < KEY_TILES; nt++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        float *x = &score[mt][nt][2 * r + e];
                        *x = exp2_approx(fmaf(*x, scale_log2, -base));
                        row_sum[mt][r] += *x;
                    }
            }
            // The accumulator layout of two n8 score tiles is the A layout of one k16 step.
#pragma unroll
            for (int kk = 0; kk < KEY_TILES / 2; kk++) {
                p_frag[mt][kk][0] = pack_half2(score[mt][2 * kk][0], score[mt][2 * kk][1]);
                p_frag[mt][kk][1] = pack_half2(score[mt][2 * kk][2], score[mt][2 * kk][3]);
                p_frag[mt][kk][2] = pack_half2(score[mt][2 * kk + 1][0], score[mt][2 * kk + 1][1]);
                p_frag[mt][kk][3] = pack_half2(score[mt][2 * kk + 1][2], score[mt][2 * kk + 1][3]);
            }
        }

        // O += P V: V fragments through ldmatrix.trans, P straight from registers.
#pragma unroll
        for (int kk = 0; kk < KEY_TILES / 2; kk++) {
#pragma unroll
            for (int dp = 0; dp < DIM_TILES / 2; dp++) {  // two n8 tiles (16 dims) per ldmatrix
                // Lane l gives key l % 8 + 8 * (l / 8 % 2) of the k16 step, in chunk l / 16 of the pair.
                const int key = kk * MMA_K + lane % LDM_ROWS + lane / LDM_ROWS % 2 * LDM_ROWS;
                unsigned v_frag[2 * B_REGS];
                ldmatrix_x4_trans(v_frag, v_tile + tile_offset<HEAD_DIM>(key, dp * 2 + lane / (2 * LDM_ROWS)));
#pragma unroll
                for (int mt = 0; mt < M_TILES; mt++) {
                    mma_16x8x16(o_acc[mt][2 * dp], p_frag[mt][kk], v_frag[0], v_frag[1]);
                    mma_16x8x16(o_acc[mt][2 * dp + 1], p_frag[mt][kk], v_frag[2], v_frag[3]);
                }
            }
        }
    }
    __pipeline_wait_prior(0);  // no copy may outlive the block (the trailing groups are empty)

    // O = accumulator / sum, LSE = ln(sum) + max, each written once.
#pragma unroll
    for (int mt = 0; mt < M_TILES; mt++) {
#pragma unroll
        for (int r = 0; r < ACC_ROWS; r++) {
            const int query = query0 + warp_row0 + mt * MMA_M + group + r * ACC_ROW_STEP;
            float sum = quad_sum(row_sum[mt][r]), inv_sum = 1.0f / sum;
            if (query >= seqlen) continue;
            __half *o_row = o + (head * seqlen + query) * HEAD_DIM + 2 * quad_lane;
#pragma unroll
            for (int nt = 0; nt < DIM_TILES; nt++)
                *(unsigned *)&o_row[nt * MMA_N] =
                    pack_half2(o_acc[mt][nt][2 * r] * inv_sum, o_acc[mt][nt][2 * r + 1] * inv_sum);
            if (quad_lane == 0) lse[head * seqlen + query] = (row_max[mt][r] + log2f(sum)) * LN2;
        }
    }
}

// --- The backward pass ---------------------------------------------------------------------
// dQ bitwise the same on every run (DETERMINISTIC_DQ): a head's dQ workspace has a copy for each
// block of the main kernel on that head, and each such block takes its key tiles one after the
// other, so that every copy has one writer, whose sums come in program order; the convert kernel
// adds the copies in order (FlashAttention-2's deterministic mode). Memory for speed: copies x
// B*H*N*D floats (dq_copies, at the launcher).
#ifndef DETERMINISTIC_DQ
#define DETERMINISTIC_DQ 0  // dQ bitwise repeatable: each block of a head adds into a copy of its own (0: atomics)
#endif
// The other way to a repeatable dQ (BWD_DQ_KERNEL): none in the main kernel; a kernel of its own
// over query tiles recomputes S, P, dP and dS for dQ += dS K in registers. No dQ workspace, two
// more products per tile.
#ifndef BWD_DQ_KERNEL
#define BWD_DQ_KERNEL 0  // dQ by a kernel of its own over query tiles, bitwise repeatable (0: by the main kernel)
#endif
#define DQ_BY_KERNEL BWD_DQ_KERNEL                      // dQ is the dQ kernel's
#define DQ_COPIES (DETERMINISTIC_DQ && !BWD_DQ_KERNEL)  // the main kernel's, a workspace copy per block of a head
// Warps of the main kernel, per head dim. With 16 keys per warp (D=128), eight warps hold 128
// keys (FlashAttention-2's block): each Q and dO tile is read, and each dQ row summed before its
// atomics, once per 128 keys instead of once per 64. Four (64 keys, two blocks per SM) was this
// chapter's first arrangement: -DBWD_WIDE_BLOCK=0 builds it again (or BWD_WARPS_D64/D128 per head dim).
#ifndef BWD_WIDE_BLOCK
#define BWD_WIDE_BLOCK 1  // eight warps, 128 keys per block at D=128 (0: four warps, half the keys)
#endif
#ifndef BWD_WARPS_D64
#define BWD_WARPS_D64 (4 + 4 * BWD_WIDE_BLOCK)
#endif
#ifndef BWD_WARPS_D128
#define BWD_WARPS_D128 (4 + 4 * BWD_WIDE_BLOCK)
#endif
// At D=128 with eight warps, FlashAttention-2's split: S^T and dP^T by 4 x 2 warps over (keys,
// queries), dK and dV by 4 x 2 over (keys, dims), dQ by 2 x 4 over (queries, dims), P^T and dS^T
// passed between them through shared memory; each warp reads half the Q and dO it read before.
#ifndef BWD_SPLIT
#define BWD_SPLIT 1  // FlashAttention-2's warp split at D=128, P^T and dS^T in shared memory (0: 16 keys a warp)
#endif
// The blocks of a head run side by side; from the same query tile they would add into the same
// dQ rows at the same time, and atomics on one address wait for each other in L2.
#ifndef BWD_STAGGER
#define BWD_STAGGER 1  // non-causal blocks start at their diagonal query tile too, and wrap round (0: at tile 0)
#endif
// A warp's rows come in m16 tiles: 16 keys or 16 queries. At D=128 one per warp in the main
// kernel: two, as 07's forward has, would need 2 x 16 x D fp32 accumulators for each of dK and
// dV, 256 registers per lane before any score.
#define BWD_WARP_ROWS MMA_M
// At D=64, two m16 tiles of keys per warp (128 registers of dK and dV), so that each fragment of
// Q and dO read from shared memory feeds two MMAs: eight warps hold 256 keys, a query tile is
// taken in two parts of 32 (S^T and dP^T stay 64 registers), and K and V are re-read at every
// step. 1.21x the one-tile kernel at B4 H16 N4096 (09_backward/NOTES.md).
#ifndef BWD_KEY_TILES_D64
#define BWD_KEY_TILES_D64 2  // m16 tiles of keys per warp in the first kernel at D=64 (1: 16 keys a warp)
#endif
#define BWD_BLOCK_Q 64  // queries per step of the main kernel's loop
// BWD_DQ_KERNEL's dQ kernel: each warp's queries in DQ_WARP_TILES m16 tiles, so that each K and
// V fragment feeds as many MMAs; its key tiles as short as keep S and dP at 32 registers each.
#ifndef DQ_WARP_TILES
#define DQ_WARP_TILES 2  // m16 tiles of queries per warp in the dQ kernel (1: 16 queries, 64-key tiles)
#endif
#ifndef DQ_BLOCK_KV
#define DQ_BLOCK_KV (64 / DQ_WARP_TILES)  // keys per streamed tile of the dQ kernel
#endif
#define DQ_BLOCK_Q (WARPS * DQ_WARP_TILES * MMA_M)  // queries per block of the dQ kernel: 128
#ifndef BWD_STAGES
#define BWD_STAGES 2  // (Q, dO, LSE, D) tiles in the main kernel's ring; (K, V) in the dQ kernel's
#endif
// At D=128 on sm_90 the split kernel stages each tile's dQ partial in shared memory and reads it
// back a row at a time: from registers, the lanes' 16-byte REDs each cover 16 rows x 32 bytes of
// the workspace; read back by rows, one whole row, 512 bytes, which L2 takes 1.6x faster
// (docs/results/logs/09/red_layout2_h200.txt). The reads wait for the next tile's first barrier.
#ifndef BWD_DQ_STAGE
#define BWD_DQ_STAGE 1  // the split kernel's dQ tile staged, added a whole row per RED on sm_90 (0: from registers)
#endif
#define DQ_STAGE_STRIDE (128 + 8)  // floats per row of the staged partial: 16-byte rows, 8-byte stores 8 banks apart
#define WORKSPACE_ALIGN 256        // bytes: the dQ accumulator starts aligned for 16-byte accesses

static_assert(BWD_BLOCK_Q % MMA_K == 0 && DQ_BLOCK_KV % MMA_K == 0, "whole k16 steps of queries and keys");
static_assert(DQ_WARP_TILES == 1 || DQ_WARP_TILES == 2, "one or two m16 tiles of queries per warp");

template <int HEAD_DIM>
struct BwdConfig {
    static constexpr int BLOCK_WARPS = HEAD_DIM == 128 ? BWD_WARPS_D128 : BWD_WARPS_D64;  // main kernel
    static constexpr int BLOCK_THREADS = BLOCK_WARPS * WARP_SIZE;
    static constexpr int KEY_TILES = HEAD_DIM == 64 ? BWD_KEY_TILES_D64 : 1;  // m16 tiles of keys per warp
    static constexpr int WARP_KEYS = KEY_TILES * BWD_WARP_ROWS;
    static constexpr int BLOCK_KV = BLOCK_WARPS * WARP_KEYS;  // keys per block: 256 at D=64, 128 at D=128
    static constexpr int QUERY_PARTS = KEY_TILES;             // a query tile in parts, S^T's registers the same
    // Eight warps per SM at up to 255 registers each fill its 64 K registers: two blocks of four or one of eight.
    static constexpr int MIN_BLOCKS = 8 / BLOCK_WARPS;
    // dQ += dS K of a query tile: warp w takes the 16 queries of m16 tile w % DQ_ROW_TILES, against
    // every key of the block, for DQ_WARP_DIMS of the dims (all of them with four warps, half with eight).
    static constexpr int DQ_ROW_TILES = BWD_BLOCK_Q / MMA_M;  // 4
    static constexpr int DQ_WARP_DIMS = HEAD_DIM * DQ_ROW_TILES / BLOCK_WARPS;
    static constexpr int STRIDE = HEAD_DIM + PAD;  // halves per row, as the forward's tiles
    static constexpr int KV_HALVES = BLOCK_KV * STRIDE, Q_HALVES = BWD_BLOCK_Q * STRIDE;
    // A [key][query] tile of the block (dS^T, P^T); dS^T for dQ += dS K (not with the dQ kernel).
    static constexpr int DS_STRIDE = BWD_BLOCK_Q + PAD, KEY_QUERY_HALVES = BLOCK_KV * DS_STRIDE;
    static constexpr int DS_HALVES = DQ_BY_KERNEL ? 0 : KEY_QUERY_HALVES;
    // Main kernel: the LSE and D ring (floats), K and V, the Q and dO ring, dS^T.
    static constexpr int RING_BYTES = 2 * BWD_STAGES * BWD_BLOCK_Q * (int)sizeof(float) +
                                      (2 * KV_HALVES + 2 * BWD_STAGES * Q_HALVES) * (int)sizeof(__half);
    static constexpr int SMEM_BYTES = RING_BYTES + DS_HALVES * (int)sizeof(__half);
    // BWD_SPLIT (D=128, eight warps): the split kernel, with P^T and dS^T both in shared memory:
    // 173 KiB (207 with the staged dQ tile of BWD_DQ_STAGE), more than sm_80's 163 KiB per block,
    // where the kernel above runs instead. Not at
    // D=64: split there (32 rows each), the one-tile kernel, whose warps hold their 16 rows of K and
    // V in registers, read fewer bytes of shared memory but ran 4-5% slower on the H200; D=64 has
    // two tiles of keys per warp instead (09_backward/NOTES.md).
    static constexpr bool SPLIT = BWD_SPLIT && HEAD_DIM == 128 && BLOCK_WARPS == 8;
    static constexpr int DQ_STAGE_BYTES = BWD_DQ_STAGE && !DQ_BY_KERNEL ? BWD_BLOCK_Q * DQ_STAGE_STRIDE * 4 : 0;
    static constexpr int SPLIT_SMEM_BYTES = RING_BYTES + 2 * KEY_QUERY_HALVES * (int)sizeof(__half) + DQ_STAGE_BYTES;
    // dQ kernel: Q and dO, and a ring of (K, V) tiles of DQ_BLOCK_KV keys.
    static constexpr int DQ_Q_HALVES = DQ_BLOCK_Q * STRIDE, DQ_KV_HALVES = DQ_BLOCK_KV * STRIDE;
    static constexpr int DQ_SMEM_BYTES = (2 * DQ_Q_HALVES + 2 * BWD_STAGES * DQ_KV_HALVES) * (int)sizeof(__half);
    // The A operands that are the same at every step (a warp's K and V rows in the main kernel,
    // its Q and dO rows in the dQ kernel) take HEAD_DIM / 2 registers per lane and m16 tile for
    // the two. In the main kernel at D=64 with one m16 tile of keys they stay in registers; with
    // two, or at D=128, where the fp32 accumulators of dK and dV hold 128 registers already, they
    // are re-read from shared memory at every step. The dQ kernel keeps them at D=64 (its dQ
    // accumulator 64 registers), not at 128 (128).
    static constexpr bool A_IN_REGISTERS = HEAD_DIM == 64 && KEY_TILES == 1;
    static constexpr bool DQ_A_IN_REGISTERS = HEAD_DIM == 64;
    static_assert(BLOCK_WARPS == 4 || BLOCK_WARPS == 8, "four warps or eight");
    static_assert(KEY_TILES == 1 || KEY_TILES == 2, "one or two m16 tiles of keys per warp");
    static_assert(DQ_WARP_DIMS % (2 * MMA_N) == 0, "a warp's dims of dQ are whole pairs of n8 tiles");
};

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
// after the query. Element [nt][2r+e] is row row0 + 8r, column col0 + 8nt + e (the lane's
// first: row0 = first row + l / 4, col0 = first column + 2 (l % 4)); the rows are keys in the
// main kernel (ROWS_ARE_KEYS, S^T), queries in the dQ kernel (S). Only on the tiles that need it.
template <int COL_TILES, bool ROWS_ARE_KEYS>
__device__ void mask_tile(float score[COL_TILES][ACC_REGS], int row0, int col0, int seqlen, int causal) {
#pragma unroll
    for (int r = 0; r < ACC_ROWS; r++) {
        const int row = row0 + r * ACC_ROW_STEP;
#pragma unroll
        for (int nt = 0; nt < COL_TILES; nt++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int col = col0 + nt * MMA_N + e;
                const int key = ROWS_ARE_KEYS ? row : col, query = ROWS_ARE_KEYS ? col : row;
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
    // EXERCISE 09.ds BEGIN: dS^T = P^T * (dP^T - D) in place of dP^T in ds, each element with its query's D
    //   kind: correctness
    //   pass: backward
    //   hint: P^T is in score, dP^T in ds, both in the accumulator layout: element [nt][2r + e] of lane l
    //     is key row0 + l / 4 + 8r (row0: the m16 tile's first key), query col0 + 8nt + 2 (l % 4) + e of
    //     the tile. delta_tile holds D of the tile's 64 queries. Compute ds[nt][2r + e] = score[nt][2r + e]
    //     * (ds[nt][2r + e] - D) in place: D is that of the element's query (the column, as LSE is in P^T),
    //     never of its key; a lane's two queries col0 + 8nt + 2 (l % 4) and the next are adjacent, one
    //     float2 of delta_tile. Both main kernels call this (at D=128 the split one). dV never sees dS: a
    //     wrong dS shows in dQ and dK alone. The formula is in docs/concepts.md, "Log-sum-exp, and why LSE
    //     is an output".
    //   wrong old: score[nt][2 * r] * (ds[nt][2 * r] - row_delta.x)
    //   wrong new: score[nt][2 * r] * ds[nt][2 * r]
#pragma unroll
    for (int nt = 0; nt < COL_TILES; nt++) {
        const float2 row_delta = *(const float2 *)&delta_tile[col0 + nt * MMA_N + 2 * quad_lane];
#pragma unroll
        for (int r = 0; r < ACC_ROWS; r++) {
            ds[nt][2 * r] = score[nt][2 * r] * (ds[nt][2 * r] - row_delta.x);
            ds[nt][2 * r + 1] = score[nt][2 * r + 1] * (ds[nt][2 * r + 1] - row_delta.y);
        }
    }
    // EXERCISE 09.ds STUB
    // EXERCISE_TODO("09.ds");
    // (void)ds, (void)score, (void)delta_tile, (void)col0, (void)quad_lane;  // only the code cut here reads them
    // EXERCISE END
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
    // EXERCISE 09.dq_red BEGIN: add the partial with one 16-byte RED per lane and n8 tile on sm_90, not one per float
    //   kind: speed
    //   pass: backward
    //   gate: 1.05x
    //   shape: headline_d64
    //   hint: The stub adds each float of the partial alone: 2 x ACC_ROWS x DIM_TILES 4-byte atomicAdds per lane
    //     per pass, each a RED of its own. sm_90 adds four adjacent floats in one RED (atomicAdd on a float4,
    //     16-byte aligned: red.global.add.v4.f32), but a lane holds only two adjacent dims of each of its two
    //     rows. Pair the lanes of a quad (l and l ^ 1, __shfl_xor_sync): the even lane gives its second row's
    //     two floats and takes its partner's first-row pair, so that it holds four adjacent dims of the first
    //     row, and the odd lane four of the second; then one float4 atomicAdd each per n8 tile. Keep the
    //     scalar loop for older GPUs, under #if __CUDA_ARCH__ >= 900 ... #else ... #endif: the build makes
    //     sm_80 code too, where float4 atomics do not exist.
    //   stub: measured: the chapter's backward with this scalar reduction took 2.64 ms at B=4 H=16 N=4096
    //     D=64, with the vector one 2.38 ms, 1.11x, and 1.39 against 1.26 ms at B=8 N=2048, 1.10x
    //     (docs/results/logs/09/dqadd2_h200.txt: dq_red_stub against new). At D=128 on sm_90 the split
    //     kernel stages its partials and reads them back by rows instead (BWD_DQ_STAGE); with its partials
    //     added here (-DBWD_DQ_STAGE=0), 6.33 against 5.06 ms, 1.25x (split_h200.txt)
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
    // EXERCISE 09.dq_red STUB
    // #pragma unroll
    // for (int r = 0; r < ACC_ROWS; r++) {
    //     const int row = row0 + r * ACC_ROW_STEP;
    //     if (row >= seqlen) continue;
    //     float *dq_row = dq_head + (size_t)row * HEAD_DIM + dim0 + 2 * quad_lane;
    // #pragma unroll
    //     for (int nt = 0; nt < DIM_TILES; nt++) {
    //         atomicAdd(dq_row + nt * MMA_N, part[nt][2 * r]);
    //         atomicAdd(dq_row + nt * MMA_N + 1, part[nt][2 * r + 1]);
    //     }
    // }
    // EXERCISE END
}

// BWD_DQ_STAGE (the split kernel on sm_90): a warp's partial of one m16 tile, rows row0.. of the
// tile, stored as float2 to the block's staged tile ([query][DQ_STAGE_STRIDE]) instead of added.
template <int DIM_TILES>
__device__ void stage_dq_partial(float *dq_stage, const float part[DIM_TILES][ACC_REGS], int row0, int dim0) {
    const int quad_lane = threadIdx.x % QUAD_LANES;
#pragma unroll
    for (int r = 0; r < ACC_ROWS; r++) {
        float *row = dq_stage + (row0 + r * ACC_ROW_STEP) * DQ_STAGE_STRIDE;
#pragma unroll
        for (int nt = 0; nt < DIM_TILES; nt++)
            *(float2 *)&row[dim0 + nt * MMA_N + 2 * quad_lane] = make_float2(part[nt][2 * r], part[nt][2 * r + 1]);
    }
}

// dQ += dS K for the query tile at query0, dS^T from shared memory ([key][query]): warp w takes
// WARP_ROW_TILES m16 tiles of queries (the warps side by side over the tile's queries,
// QUERY_WARPS of them, w % QUERY_WARPS) against every key of the block, for its DQ_WARP_DIMS
// dims, and adds that partial into the fp32 accumulator in device memory. One m16 tile per warp
// is the first kernel's (16 queries x 64 dims at D=128: the whole dS row, half of K); the split
// kernel takes two (32 queries x 32 dims: FlashAttention-2's, a quarter of K, four fewer
// ldmatrix per step). In passes of at most 8 n8 tiles (64 dims): with four warps at D=128, the
// whole 16 x 128 partial beside dK and dV made sm_80's ptxas spill.
template <int HEAD_DIM, int WARP_ROW_TILES, bool STAGED = false>
__device__ void add_dq_of_tile(float *dq_head, const __half *ds_tile, const __half *k_tile, int query0, int seqlen,
                               float *dq_stage = NULL) {
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
        for (int mt = 0; mt < WARP_ROW_TILES; mt++) {
            if constexpr (STAGED)
                stage_dq_partial<DQ_DIM_TILES>(dq_stage, dq_part[mt], warp_row0 + mt * MMA_M + group, dim0);
            else
                add_dq_partial<HEAD_DIM, DQ_DIM_TILES>(dq_head, dq_part[mt], query0 + warp_row0 + mt * MMA_M + group,
                                                       dim0 + pass * DQ_DIM_TILES * MMA_N, seqlen);
        }
    }
}

// (1) D_i = sum_d dO[i, d] * O[i, d] in fp32, and row i of each of the dQ accumulator's copies
// zeroed. Grid: (row tiles, b*h); CHUNKS lanes per row, each with 8 of its D elements.
template <int HEAD_DIM>
__global__ void __launch_bounds__(THREADS) backward_preprocess_kernel(const __half *o, const __half *d_o, float *delta,
                                                                      float *dq_acc, int copies, int seqlen) {
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
    const size_t copy_floats = (size_t)gridDim.y * seqlen * HEAD_DIM;
    for (int copy = 0; copy < copies; copy++) {
        float4 *to = (float4 *)(dq_acc + copy * copy_floats + at);
        to[0] = to[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
}

// The first query of step `step` of the main kernel's loop, which starts at query tile first_tile
// and wraps round past the last of the query_tiles (first_tile + step < 2 query_tiles).
__device__ int step_query0(int first_tile, int step, int query_tiles) {
    const int tile = first_tile + step;
    return (tile < query_tiles ? tile : tile - query_tiles) * BWD_BLOCK_Q;
}

// The main kernel's blocks. Atomic: one key tile each, grid (key tiles, b*h); causal (b*h, key
// tiles), the first (heaviest: most query tiles see them) key tiles first. DQ_COPIES: grid
// (copies, b*h); block `copy` of a head takes one of every `copies` key tiles, one after the other,
// back and forth (copy, then 2 copies - 1 - copy, ...) so that causal's long and short key tiles
// even out over the copies, and adds its dQ into copy `copy` of the workspace. round_key_tile:
// the key tile of the block's round `round`, -1 past its last.
__device__ int round_key_tile(int round, int key_tiles, int causal) {
#if DQ_COPIES
    const int copies = gridDim.x, copy = blockIdx.x;
    const int key_tile = round * copies + (round % 2 ? copies - 1 - copy : copy);
    return key_tile < key_tiles ? key_tile : -1;
#else
    return round > 0 ? -1 : (int)(causal ? blockIdx.y : blockIdx.x);
#endif
}

__device__ size_t block_head(int causal) { return DQ_COPIES || !causal ? blockIdx.y : blockIdx.x; }

template <int HEAD_DIM>
__device__ float *block_dq_copy(float *dq_acc, int seqlen) {
#if DQ_COPIES
    return dq_acc + (size_t)blockIdx.x * gridDim.y * seqlen * HEAD_DIM;
#else
    return dq_acc;
#endif
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
    // before it see none of this block's keys, so the loop ends at the last tile. Otherwise
    // (BWD_STAGGER) it wraps round to tile 0 and ends before the diagonal.
    const int query_tiles = ceil_div(seqlen, BWD_BLOCK_Q);
    const int first_tile = causal || BWD_STAGGER ? key0 / BWD_BLOCK_Q : 0;
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
#if !DQ_BY_KERNEL
    __half *ds_tile = do_ring + BWD_STAGES * Q_HALVES;  // [BLOCK_KV][DS_STRIDE]: dS^T of the last tile
    float *dq_head = dq_acc + head * seqlen * HEAD_DIM;
#endif

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
#if !DQ_BY_KERNEL
        // The last tile's dQ, now that the barrier above has made its dS^T every warp's.
        if (tile > 0)
            add_dq_of_tile<HEAD_DIM, 1>(dq_head, ds_tile, k_tile, step_query0(first_tile, tile - 1, query_tiles),
                                        seqlen);
#endif
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
                    mask_tile<QUERY_TILES, true>(score[mt], key0 + warp_row0 + mt * MMA_M + group,
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

#if !DQ_BY_KERNEL
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
#endif
        }
    }
#if !DQ_BY_KERNEL
    __syncthreads();  // every warp's dS^T rows of the last tile are in
    add_dq_of_tile<HEAD_DIM, 1>(dq_head, ds_tile, k_tile, step_query0(first_tile, q_tiles - 1, query_tiles), seqlen);
#else
    // BWD_DQ_KERNEL: dQ is the dQ kernel's
    (void)dq_acc;
#endif
    __pipeline_wait_prior(0);  // no copy may outlive the block (the trailing groups are empty)

    __half *dk_head = dk + head * seqlen * HEAD_DIM, *dv_head = dv + head * seqlen * HEAD_DIM;
#pragma unroll
    for (int mt = 0; mt < KEY_TILES; mt++)
        store_dk_dv<HEAD_DIM, DIM_TILES>(dk_head, dv_head, dk_acc[mt], dv_acc[mt], key0 + warp_row0 + mt * MMA_M, 0,
                                         seqlen, scale);
}

template <int HEAD_DIM>
__global__ void __launch_bounds__(BwdConfig<HEAD_DIM>::BLOCK_THREADS, BwdConfig<HEAD_DIM>::MIN_BLOCKS)
    flash_attention_backward_kernel(const __half *q, const __half *k, const __half *v, const __half *d_o,
                                    const float *lse, const float *delta, float *dq_acc, __half *dk, __half *dv,
                                    int seqlen, float scale, float scale_log2, int causal) {
    const int key_tiles = ceil_div(seqlen, BwdConfig<HEAD_DIM>::BLOCK_KV);
    for (int round = 0, key_tile; (key_tile = round_key_tile(round, key_tiles, causal)) >= 0; round++) {
        if (round > 0) __syncthreads();  // every warp is done with the last key tile's K, V and dS^T
        backward_key_block<HEAD_DIM>(q, k, v, d_o, lse, delta, block_dq_copy<HEAD_DIM>(dq_acc, seqlen), dk, dv, seqlen,
                                     scale, scale_log2, causal, key_tile, block_head(causal));
    }
}

// --- BWD_SPLIT: FlashAttention-2's warp split at D=128 --------------------------------------
// Above, at D=128, every warp multiplies its own 16 keys by all 64 queries of the tile: the eight warps
// each read the whole Q and dO tile (128 dims) twice per tile, 184 ldmatrix per warp and tile
// against 320 mma.sync. Here the warps split each product 4 x 2 instead, and pass P^T and dS^T
// through shared memory from the products that make them to those that use them:
//   S^T, dP^T (keys x queries): warp w takes keys 32 (w % 4).., queries 32 (w / 4)..
//   dV, dK (keys x dims):       keys 32 (w % 4).., dims 64 (w / 4)..
//   dQ (queries x dims):        queries 32 (w % 2).., dims 32 (w / 2)..  (add_dq_of_tile<.., 2>;
//                               on sm_90 staged (<.., 2, true>), then add_staged_dq by whole rows)
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

#if __CUDA_ARCH__ >= 900 && BWD_DQ_STAGE && !DQ_BY_KERNEL
#define SPLIT_DQ_STAGED 1
// The staged tile added into the workspace rows from query0, after a barrier: warp w whole rows
// 8w.. of the block's tile, lane l dims 4l.., every load first, then one 16-byte RED per row.
__device__ void add_staged_dq(float *dq_head, const float *dq_stage, int query0, int seqlen) {
    constexpr int WARP_ROWS = BWD_BLOCK_Q / BwdConfig<128>::BLOCK_WARPS;  // 8
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int row0 = warp * WARP_ROWS, col = 4 * lane;
    float4 four[WARP_ROWS];
#pragma unroll
    for (int k = 0; k < WARP_ROWS; k++) four[k] = *(const float4 *)&dq_stage[(row0 + k) * DQ_STAGE_STRIDE + col];
#pragma unroll
    for (int k = 0; k < WARP_ROWS; k++) {
        const int row = query0 + row0 + k;
        if (row < seqlen) atomicAdd((float4 *)(dq_head + (size_t)row * 128 + col), four[k]);
    }
}
#else
#define SPLIT_DQ_STAGED 0
#endif

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
    const int first_tile = causal || BWD_STAGGER ? key0 / BWD_BLOCK_Q : 0;
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
#if !DQ_BY_KERNEL
    float *dq_head = dq_acc + head * seqlen * HEAD_DIM;
#else
    // BWD_DQ_KERNEL: dQ is the dQ kernel's
    (void)dq_acc;
#endif
#if SPLIT_DQ_STAGED
    float *dq_stage = (float *)(ds_tile + KEY_QUERY_HALVES);  // [BWD_BLOCK_Q][DQ_STAGE_STRIDE]: the dQ partial
#endif

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
#if SPLIT_DQ_STAGED  // the last tile's dQ, staged: every warp's part is in
        if (tile > 0) add_staged_dq(dq_head, dq_stage, step_query0(first_tile, tile - 1, query_tiles), seqlen);
#endif

        // S^T = K Q^T and P^T = exp(S^T * scale - LSE): the warp's 32 keys x 32 queries.
        float score[SPLIT_M_TILES][SPLIT_Q_TILES][ACC_REGS] = {};
        rows_times_rows<HEAD_DIM, SPLIT_M_TILES, SPLIT_Q_TILES>(score, k_tile, warp_key0, q_tile, warp_query0);
        if (query0 + BWD_BLOCK_Q > seqlen || key0 + BLOCK_KV > seqlen || (causal && key0 + BLOCK_KV - 1 > query0)) {
#pragma unroll
            for (int mt = 0; mt < SPLIT_M_TILES; mt++)
                mask_tile<SPLIT_Q_TILES, true>(score[mt], key0 + warp_key0 + mt * MMA_M + group,
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
#if SPLIT_DQ_STAGED
        add_dq_of_tile<HEAD_DIM, 2, true>(dq_head, ds_tile, k_tile, query0, seqlen, dq_stage);  // added at the next top
#elif !DQ_BY_KERNEL
        add_dq_of_tile<HEAD_DIM, 2>(dq_head, ds_tile, k_tile, query0, seqlen);  // dQ += dS K, atomics
#endif
    }
    __pipeline_wait_prior(0);  // no copy may outlive the block (the trailing groups are empty)
#if SPLIT_DQ_STAGED
    __syncthreads();  // every warp's part of the last tile is in
    add_staged_dq(dq_head, dq_stage, step_query0(first_tile, q_tiles - 1, query_tiles), seqlen);
#endif

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
    const int key_tiles = ceil_div(seqlen, BwdConfig<HEAD_DIM>::BLOCK_KV);
    for (int round = 0, key_tile; (key_tile = round_key_tile(round, key_tiles, causal)) >= 0; round++) {
        if (round > 0) __syncthreads();  // every warp is done with the last key tile's K, V and staged dQ
        split_key_block<HEAD_DIM>(q, k, v, d_o, lse, delta, block_dq_copy<HEAD_DIM>(dq_acc, seqlen), dk, dv, seqlen,
                                  scale, scale_log2, causal, key_tile, block_head(causal));
    }
}

#if !DQ_BY_KERNEL
// (3) dQ = scale * the fp32 accumulator (the sum of its copies, in order), as fp16. Grid as (1):
// CHUNKS lanes per row.
template <int HEAD_DIM>
__global__ void __launch_bounds__(THREADS)
    convert_dq_kernel(const float *dq_acc, int copies, __half *dq, int seqlen, float scale) {
    constexpr int CHUNKS = HEAD_DIM / CHUNK_HALVES, ROWS = THREADS / CHUNKS;
    const int row = blockIdx.x * ROWS + threadIdx.x / CHUNKS, chunk = threadIdx.x % CHUNKS;
    if (row >= seqlen) return;
    const size_t at = ((size_t)blockIdx.y * seqlen + row) * HEAD_DIM + chunk * CHUNK_HALVES;
    const size_t copy_floats = (size_t)gridDim.y * seqlen * HEAD_DIM;
    float4 lo = *(const float4 *)(dq_acc + at), hi = *(const float4 *)(dq_acc + at + 4);
    for (int copy = 1; copy < copies; copy++) {
        const float4 lo_c = *(const float4 *)(dq_acc + copy * copy_floats + at);
        const float4 hi_c = *(const float4 *)(dq_acc + copy * copy_floats + at + 4);
        lo = make_float4(lo.x + lo_c.x, lo.y + lo_c.y, lo.z + lo_c.z, lo.w + lo_c.w);
        hi = make_float4(hi.x + hi_c.x, hi.y + hi_c.y, hi.z + hi_c.z, hi.w + hi_c.w);
    }
    uint4 out;
    out.x = pack_half2(lo.x * scale, lo.y * scale);
    out.y = pack_half2(lo.z * scale, lo.w * scale);
    out.z = pack_half2(hi.x * scale, hi.y * scale);
    out.w = pack_half2(hi.z * scale, hi.w * scale);
    *(uint4 *)(dq + at) = out;
}
#else
// BWD_DQ_KERNEL: dQ without the main kernel. One block per (DQ_BLOCK_Q-query tile, b*h), as the
// forward's grid; warp w owns DQ_WARP_TILES m16 tiles of queries from 32w (07's warp); Q and dO
// stay in shared memory (and in registers at D=64), K and V stream through 07's ring. Per key
// tile it recomputes S = Q K^T, P, dP = dO V^T and dS, and accumulates dQ += dS K in registers,
// over the key tiles in order: the same sums in the same order on every run. The price: S, P, dP
// and dS computed twice (once here, once in the main kernel).
template <int HEAD_DIM>
__global__ void __launch_bounds__(THREADS, 2)
    flash_attention_dq_kernel(const __half *q, const __half *k, const __half *v, const __half *d_o, const float *lse,
                              const float *delta, __half *dq, int seqlen, float scale, float scale_log2, int causal) {
    constexpr int KV_HALVES = BwdConfig<HEAD_DIM>::DQ_KV_HALVES, Q_HALVES = BwdConfig<HEAD_DIM>::DQ_Q_HALVES;
    constexpr bool A_IN_REGISTERS = BwdConfig<HEAD_DIM>::DQ_A_IN_REGISTERS;
    constexpr int ROW_TILES = DQ_WARP_TILES;        // m16 tiles of queries per warp: 2
    constexpr int KEY_TILES = DQ_BLOCK_KV / MMA_N;  // n8 tiles of scores per m16 tile: 4
    constexpr int DIM_TILES = HEAD_DIM / MMA_N;     // n8 tiles of dQ
    constexpr int K_STEPS = HEAD_DIM / MMA_K;       // k16 steps of S = Q K^T and dP = dO V^T
    constexpr int KEY_STEPS = DQ_BLOCK_KV / MMA_K;  // k16 steps of dQ += dS K
    extern __shared__ __align__(128) unsigned char smem[];
    __half *q_tile = (__half *)smem;                   // [DQ_BLOCK_Q][STRIDE]
    __half *do_tile = q_tile + Q_HALVES;               // [DQ_BLOCK_Q][STRIDE]
    __half *k_ring = do_tile + Q_HALVES;               // [BWD_STAGES][DQ_BLOCK_KV][STRIDE]
    __half *v_ring = k_ring + BWD_STAGES * KV_HALVES;  // [BWD_STAGES][DQ_BLOCK_KV][STRIDE]

    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int group = lane / QUAD_LANES, quad_lane = lane % QUAD_LANES;
    const int query_tile = causal ? gridDim.y - 1 - blockIdx.y : blockIdx.x;  // heaviest causal tiles first
    const size_t head = causal ? blockIdx.x : blockIdx.y;
    const int query0 = query_tile * DQ_BLOCK_Q, warp_row0 = warp * ROW_TILES * MMA_M;
    const int warp_last_query = query0 + warp_row0 + ROW_TILES * MMA_M - 1;
    const __half *k_head = k + head * seqlen * HEAD_DIM, *v_head = v + head * seqlen * HEAD_DIM;
    const int key_end = causal ? min(seqlen, query0 + DQ_BLOCK_Q) : seqlen;
    const int kv_tiles = ceil_div(key_end, DQ_BLOCK_KV);

    load_tile_async<HEAD_DIM, DQ_BLOCK_Q>(q_tile, q + head * seqlen * HEAD_DIM, query0, seqlen);
    load_tile_async<HEAD_DIM, DQ_BLOCK_Q>(do_tile, d_o + head * seqlen * HEAD_DIM, query0, seqlen);
    for (int t = 0; t < BWD_STAGES - 1; t++) {
        if (t < kv_tiles) {
            load_tile_async<HEAD_DIM, DQ_BLOCK_KV>(k_ring + t * KV_HALVES, k_head, t * DQ_BLOCK_KV, seqlen);
            load_tile_async<HEAD_DIM, DQ_BLOCK_KV>(v_ring + t * KV_HALVES, v_head, t * DQ_BLOCK_KV, seqlen);
        }
        __pipeline_commit();
    }

    // Each lane's two rows per m16 tile: their LSE (log2 units) and D, 0 past the end (masked rows).
    float row_lse[ROW_TILES][ACC_ROWS], row_delta[ROW_TILES][ACC_ROWS];
#pragma unroll
    for (int mt = 0; mt < ROW_TILES; mt++)
#pragma unroll
        for (int r = 0; r < ACC_ROWS; r++) {
            const int query = query0 + warp_row0 + mt * MMA_M + group + r * ACC_ROW_STEP;
            row_lse[mt][r] = query < seqlen ? lse[head * seqlen + query] * LOG2E : 0.0f;
            row_delta[mt][r] = query < seqlen ? delta[head * seqlen + query] : 0.0f;
        }
    float dq_acc[ROW_TILES][DIM_TILES][ACC_REGS] = {};
    unsigned q_regs[A_IN_REGISTERS ? K_STEPS : 1][ROW_TILES][A_REGS];
    unsigned do_regs[A_IN_REGISTERS ? K_STEPS : 1][ROW_TILES][A_REGS];

    for (int tile = 0; tile < kv_tiles; tile++) {
        __pipeline_wait_prior(BWD_STAGES - 2);
        __syncthreads();
        const int next = tile + BWD_STAGES - 1;
        if (next < kv_tiles) {
            load_tile_async<HEAD_DIM, DQ_BLOCK_KV>(k_ring + next % BWD_STAGES * KV_HALVES, k_head, next * DQ_BLOCK_KV,
                                                   seqlen);
            load_tile_async<HEAD_DIM, DQ_BLOCK_KV>(v_ring + next % BWD_STAGES * KV_HALVES, v_head, next * DQ_BLOCK_KV,
                                                   seqlen);
        }
        __pipeline_commit();
        const __half *k_tile = k_ring + tile % BWD_STAGES * KV_HALVES;
        const __half *v_tile = v_ring + tile % BWD_STAGES * KV_HALVES;
        const int key0 = tile * DQ_BLOCK_KV;
        if constexpr (A_IN_REGISTERS) {  // Q and dO landed with the first tile
            if (tile == 0)
                for (int ks = 0; ks < K_STEPS; ks++)
                    for (int mt = 0; mt < ROW_TILES; mt++) {
                        load_a_step<HEAD_DIM>(q_regs[ks][mt], q_tile, warp_row0 + mt * MMA_M, ks);
                        load_a_step<HEAD_DIM>(do_regs[ks][mt], do_tile, warp_row0 + mt * MMA_M, ks);
                    }
        }
        if (causal && key0 > warp_last_query) continue;  // every key of the tile after the warp's queries

        // S = Q K^T and dP = dO V^T: the warp's queries x the tile's keys, each.
        float score[ROW_TILES][KEY_TILES][ACC_REGS] = {}, ds[ROW_TILES][KEY_TILES][ACC_REGS] = {};
#pragma unroll
        for (int ks = 0; ks < K_STEPS; ks++) {
            unsigned a_frag[ROW_TILES][A_REGS], b_frag[KEY_TILES / 2][2 * B_REGS];
            if constexpr (!A_IN_REGISTERS)
                for (int mt = 0; mt < ROW_TILES; mt++)
                    load_a_step<HEAD_DIM>(a_frag[mt], q_tile, warp_row0 + mt * MMA_M, ks);
            load_k_step<HEAD_DIM, KEY_TILES>(b_frag, k_tile, ks);
#pragma unroll
            for (int mt = 0; mt < ROW_TILES; mt++) {
                const unsigned *q_frag = A_IN_REGISTERS ? q_regs[ks][mt] : a_frag[mt];
#pragma unroll
                for (int np = 0; np < KEY_TILES / 2; np++) {
                    mma_16x8x16(score[mt][2 * np], q_frag, b_frag[np][0], b_frag[np][1]);
                    mma_16x8x16(score[mt][2 * np + 1], q_frag, b_frag[np][2], b_frag[np][3]);
                }
            }
        }
#pragma unroll
        for (int ks = 0; ks < K_STEPS; ks++) {
            unsigned a_frag[ROW_TILES][A_REGS], b_frag[KEY_TILES / 2][2 * B_REGS];
            if constexpr (!A_IN_REGISTERS)
                for (int mt = 0; mt < ROW_TILES; mt++)
                    load_a_step<HEAD_DIM>(a_frag[mt], do_tile, warp_row0 + mt * MMA_M, ks);
            load_k_step<HEAD_DIM, KEY_TILES>(b_frag, v_tile, ks);
#pragma unroll
            for (int mt = 0; mt < ROW_TILES; mt++) {
                const unsigned *do_frag = A_IN_REGISTERS ? do_regs[ks][mt] : a_frag[mt];
#pragma unroll
                for (int np = 0; np < KEY_TILES / 2; np++) {
                    mma_16x8x16(ds[mt][2 * np], do_frag, b_frag[np][0], b_frag[np][1]);
                    mma_16x8x16(ds[mt][2 * np + 1], do_frag, b_frag[np][2], b_frag[np][3]);
                }
            }
        }
        if (query0 + DQ_BLOCK_Q > seqlen || key0 + DQ_BLOCK_KV > seqlen ||
            (causal && key0 + DQ_BLOCK_KV - 1 > query0)) {
#pragma unroll
            for (int mt = 0; mt < ROW_TILES; mt++)
                mask_tile<KEY_TILES, false>(score[mt], query0 + warp_row0 + mt * MMA_M + group, key0 + 2 * quad_lane,
                                            seqlen, causal);
        }

        // P = exp(S * scale - LSE), dS = P * (dP - D): per row now, as the forward's layout.
        unsigned ds_frag[ROW_TILES][KEY_STEPS][A_REGS];
#pragma unroll
        for (int mt = 0; mt < ROW_TILES; mt++) {
#pragma unroll
            for (int nt = 0; nt < KEY_TILES; nt++)
#pragma unroll
                for (int i = 0; i < ACC_REGS; i++) {
                    const float p = exp2_approx(fmaf(score[mt][nt][i], scale_log2, -row_lse[mt][i / 2]));
                    ds[mt][nt][i] = p * (ds[mt][nt][i] - row_delta[mt][i / 2]);
                }
#pragma unroll
            for (int kk = 0; kk < KEY_STEPS; kk++) pack_a(ds_frag[mt][kk], ds[mt][2 * kk], ds[mt][2 * kk + 1]);
        }

        // dQ += dS K: K [key][dim] with keys as the k dimension, ldmatrix.trans (07's V); each K
        // fragment feeds every m16 tile of the warp's queries.
#pragma unroll
        for (int kk = 0; kk < KEY_STEPS; kk++)
#pragma unroll
            for (int dp = 0; dp < DIM_TILES / 2; dp++) {
                unsigned k_frag[2 * B_REGS];
                load_trans_pair<HEAD_DIM>(k_frag, k_tile, kk, dp);
#pragma unroll
                for (int mt = 0; mt < ROW_TILES; mt++) {
                    mma_16x8x16(dq_acc[mt][2 * dp], ds_frag[mt][kk], k_frag[0], k_frag[1]);
                    mma_16x8x16(dq_acc[mt][2 * dp + 1], ds_frag[mt][kk], k_frag[2], k_frag[3]);
                }
            }
    }
    __pipeline_wait_prior(0);

#pragma unroll
    for (int mt = 0; mt < ROW_TILES; mt++)
#pragma unroll
        for (int r = 0; r < ACC_ROWS; r++) {
            const int query = query0 + warp_row0 + mt * MMA_M + group + r * ACC_ROW_STEP;
            if (query >= seqlen) continue;
            __half *dq_row = dq + (head * seqlen + query) * HEAD_DIM + 2 * quad_lane;
#pragma unroll
            for (int nt = 0; nt < DIM_TILES; nt++)
                *(unsigned *)&dq_row[nt * MMA_N] =
                    pack_half2(dq_acc[mt][nt][2 * r] * scale, dq_acc[mt][nt][2 * r + 1] * scale);
        }
}
#endif
// --- Launcher --------------------------------------------------------------------------------
template <int HEAD_DIM>
static cudaError_t launch(const AttnArgs *args, cudaStream_t stream) {
    const AttnShape *s = &args->shape;
    int smem = Config<HEAD_DIM>::SMEM_BYTES;
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

// --- The backward's launcher -------------------------------------------------------------------
// The workspace: D, one float per query row, then the fp32 dQ accumulator's copies (dq_copies:
// one, or DETERMINISTIC_DQ's, or none for the dQ kernel), B*H*N*D floats each, from a
// WORKSPACE_ALIGN boundary.
static size_t delta_bytes(const AttnShape *s) {
    size_t bytes = (size_t)s->batch * s->heads * s->seqlen * sizeof(float);
    return (bytes + WORKSPACE_ALIGN - 1) / WORKSPACE_ALIGN * WORKSPACE_ALIGN;
}

// The main kernel: the split one where BWD_SPLIT builds it and the GPU gives a block its shared
// memory (allowed here), and how many of its blocks the GPU holds at once.
template <int HEAD_DIM>
static cudaError_t main_kernel_of(decltype(&flash_attention_backward_kernel<HEAD_DIM>) *kernel, int *smem,
                                  int *resident) {
    int device = 0, smem_optin = 0, sms = 0, per_sm = 0;
    RETURN_IF_ERROR(cudaGetDevice(&device));
    RETURN_IF_ERROR(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    *kernel = flash_attention_backward_kernel<HEAD_DIM>;
    *smem = BwdConfig<HEAD_DIM>::SMEM_BYTES;
    if constexpr (BwdConfig<HEAD_DIM>::SPLIT) {
        if (smem_optin >= BwdConfig<HEAD_DIM>::SPLIT_SMEM_BYTES) {
            *kernel = flash_attention_backward_split_kernel<HEAD_DIM>;
            *smem = BwdConfig<HEAD_DIM>::SPLIT_SMEM_BYTES;
        }
    }
    RETURN_IF_ERROR(cudaFuncSetAttribute(*kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, *smem));
    RETURN_IF_ERROR(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, *kernel, BwdConfig<HEAD_DIM>::BLOCK_THREADS, *smem));
    *resident = per_sm * sms;
    return cudaSuccess;
}

// Copies of the fp32 dQ workspace: 1 (atomics), 0 (the dQ kernel's), or with DQ_COPIES the
// blocks per head: the fewest that take the heads' key tiles in the least time, counted as
// (rounds of the GPU's resident blocks) x (key tiles per block). B*H = 64 heads of 32 key tiles
// on 132 SMs: 2 copies, 128 blocks of 16 tiles each.
static int dq_copies(int heads, int key_tiles, int resident) {
    if (!DQ_COPIES) return DQ_BY_KERNEL ? 0 : 1;
    int best = 1;
    long long best_time = -1;
    for (int copies = 1; copies <= key_tiles; copies++) {
        const long long blocks = (long long)heads * copies, per_block = ceil_div(key_tiles, copies);
        const long long time = (blocks + resident - 1) / resident * per_block;
        if (best_time < 0 || time < best_time) best = copies, best_time = time;
    }
    return best;
}

template <int HEAD_DIM>
static cudaError_t dq_copies_of(const AttnShape *s, int *copies) {
    decltype(&flash_attention_backward_kernel<HEAD_DIM>) kernel;
    int smem = 0, resident = 0;
    RETURN_IF_ERROR(main_kernel_of<HEAD_DIM>(&kernel, &smem, &resident));
    if (resident < 1) return cudaErrorInvalidConfiguration;  // the kernel fits no SM
    *copies = dq_copies(s->batch * s->heads, ceil_div(s->seqlen, BwdConfig<HEAD_DIM>::BLOCK_KV), resident);
    return cudaSuccess;
}

static size_t backward_workspace_bytes(const AttnShape *s, int) {
    const size_t dq_acc = (size_t)s->batch * s->heads * s->seqlen * s->headdim * sizeof(float);
    int copies = 1;
    if (s->headdim == 64 ? dq_copies_of<64>(s, &copies) : dq_copies_of<128>(s, &copies))
        copies = 1;  // an error here is the launch's to report
    return delta_bytes(s) + copies * dq_acc;
}

template <int HEAD_DIM>
static cudaError_t launch_backward(const BackwardArgs *args, cudaStream_t stream) {
    const AttnShape *s = &args->shape;
    const int heads = s->batch * s->heads, key_tiles = ceil_div(s->seqlen, BwdConfig<HEAD_DIM>::BLOCK_KV);
    const float scale = s->scale, scale_log2 = s->scale * LOG2E;
    decltype(&flash_attention_backward_kernel<HEAD_DIM>) main_kernel;
    int smem = 0, resident = 0, copies = 1;
    RETURN_IF_ERROR(main_kernel_of<HEAD_DIM>(&main_kernel, &smem, &resident));
    RETURN_IF_ERROR(dq_copies_of<HEAD_DIM>(s, &copies));
    float *delta = (float *)args->workspace;
    float *dq_acc = copies ? (float *)((char *)args->workspace + delta_bytes(s)) : NULL;
    const dim3 row_grid(ceil_div(s->seqlen, THREADS / (HEAD_DIM / CHUNK_HALVES)), heads);

    backward_preprocess_kernel<HEAD_DIM>
        <<<row_grid, THREADS, 0, stream>>>(args->o, args->d_o, delta, dq_acc, copies, s->seqlen);
    RETURN_IF_ERROR(cudaGetLastError());

    dim3 grid = DQ_COPIES ? dim3(copies, heads) : s->causal ? dim3(heads, key_tiles) : dim3(key_tiles, heads);
    main_kernel<<<grid, BwdConfig<HEAD_DIM>::BLOCK_THREADS, smem, stream>>>(
        args->q, args->k, args->v, args->d_o, args->lse, delta, dq_acc, args->dk, args->dv, s->seqlen, scale,
        scale_log2, s->causal);
    RETURN_IF_ERROR(cudaGetLastError());

#if !DQ_BY_KERNEL
    convert_dq_kernel<HEAD_DIM><<<row_grid, THREADS, 0, stream>>>(dq_acc, copies, args->dq, s->seqlen, scale);
#else
    smem = BwdConfig<HEAD_DIM>::DQ_SMEM_BYTES;
    RETURN_IF_ERROR(
        cudaFuncSetAttribute(flash_attention_dq_kernel<HEAD_DIM>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const int query_tiles = ceil_div(s->seqlen, DQ_BLOCK_Q);
    grid = s->causal ? dim3(heads, query_tiles) : dim3(query_tiles, heads);
    flash_attention_dq_kernel<HEAD_DIM><<<grid, THREADS, smem, stream>>>(
        args->q, args->k, args->v, args->d_o, args->lse, delta, args->dq, s->seqlen, scale, scale_log2, s->causal);
#endif
    return cudaGetLastError();
}

static cudaError_t backward(const BackwardArgs *args, cudaStream_t stream) {
    switch (args->shape.headdim) {
    case 64: return launch_backward<64>(args, stream);
    case 128: return launch_backward<128>(args, stream);
    default: return cudaErrorInvalidValue;
    }
}

static const Backward backward_pass = {backward_workspace_bytes, backward};

const Chapter chapter = {
    "09_backward",
    "the backward pass: dQ, dK, dV recomputing P per tile, K and V resident, dQ by atomics",
    PRECISION_FP16_TC,
    80,
    0,     // oldest and newest GPU it runs on (0: no newest)
    NULL,  // the forward needs no workspace (the backward's is its own, below)
    NULL,  // nothing to prepare before the forward
    forward,
    NULL,  // not an FP8 chapter
    &backward_pass,
};
