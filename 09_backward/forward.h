// forward.h: 07's forward pass, which every step of 09 runs first (for O and the LSE its backward
// reads), and the vocabulary the backward is written in: mma.sync m16n8k16 and ldmatrix as the PTX
// ISA documents them, tiles of 16-byte chunks in padded rows, the cp.async copy of a tile, the
// accumulator layout. The same code as 07_async_pipeline/attention.cu with its ablation switches
// at their defaults; 07's README explains it. A step file includes it after the harness.
#ifndef FORWARD_H
#define FORWARD_H

#include <cuda_pipeline_primitives.h>

#define WARP_SIZE 32
#define WARPS 4
#define THREADS (WARPS * WARP_SIZE)
// The tensor-core instruction, mma.sync m16n8k16: A is MMA_M x MMA_K, B is MMA_K x MMA_N.
#define MMA_M 16
#define MMA_N 8
#define MMA_K 16
#define WARP_Q 32                 // query rows per warp
#define M_TILES (WARP_Q / MMA_M)  // m16 tiles per warp: 2
#define BLOCK_Q (WARPS * WARP_Q)  // query rows per block: 128
// The forward's keys per streamed tile and (K, V) tiles in its ring, per head dim (07's).
#define BLOCK_KV_D64 64
#define BLOCK_KV_D128 64
#define STAGES_D64 3
#define STAGES_D128 2
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
static __device__ void ldmatrix_x4(unsigned frag[4], const __half *row_address) {
    unsigned addr = (unsigned)__cvta_generic_to_shared(row_address);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(frag[0]), "=r"(frag[1]), "=r"(frag[2]), "=r"(frag[3])
                 : "r"(addr));
}

// The same, each matrix transposed on the way (V is stored [key][dim], the MMA wants [dim][key]).
static __device__ void ldmatrix_x4_trans(unsigned frag[4], const __half *row_address) {
    unsigned addr = (unsigned)__cvta_generic_to_shared(row_address);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(frag[0]), "=r"(frag[1]), "=r"(frag[2]), "=r"(frag[3])
                 : "r"(addr));
}

// acc (16x8, fp32) += a (16x16, fp16, row-major) * b (16x8, fp16, column-major).
// Lane l holds acc rows l/4 (elements 0, 1) and l/4 + 8 (elements 2, 3), columns 2*(l%4) + {0, 1}.
static __device__ void mma_16x8x16(float acc[ACC_REGS], const unsigned a[A_REGS], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

static __device__ unsigned pack_half2(float lo, float hi) {
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
static __device__ float exp2_approx(float x) {
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
static __device__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}

static __device__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffff, x, 1);
    return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// --- The forward kernel: 07's ------------------------------------------------------------------
// The Makefile compiles it once per build folder (forward.cu: BUILD/common/forward.o) and links it into
// every build of 09, 10 and 11, which it compiles with FORWARD_ELSEWHERE, so that their thirty-odd builds
// do not each compile it again (09's README). Anything else that includes this header (a student's copy,
// a variant) gets the kernel here.
#ifdef FORWARD_ELSEWHERE
cudaError_t forward(const AttnArgs *args, cudaStream_t stream);
#else
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

cudaError_t forward(const AttnArgs *args, cudaStream_t stream) {
    return launch_for_head_dim(args, stream, launch<64>, launch<128>);
}
#endif  // FORWARD_ELSEWHERE

#endif  // FORWARD_H
