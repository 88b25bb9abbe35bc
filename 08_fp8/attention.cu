// 08_fp8 (08.6, the last of its six steps): at D = 128, Q K^T accumulates S in fp16 (half the
// registers: 256-key tiles) and the softmax works on half2, some of its exponentials on the FMA
// units beside the special-function unit. Otherwise 08.5: e4m3 copies with a scale per tile
// (quantize_kernel), both products on e4m3 wgmma (hopper.h) fed by TMA through an mbarrier ring,
// a producer warpgroup, consumers taking turns, P V under the softmax; at D = 64 three consumers.
//
// attention_kernel: one block per (query tile, b*h), heaviest causal tiles first (as 05), a
// producer warpgroup and one consumer warpgroup per 64 query rows. Shared memory: the Q tile and a
// ring of STAGES (K, Vt) tile pairs of BLOCK_KV keys, in e4m3, in the swizzled layout TMA writes
// and wgmma reads. Registers: per consumer the 64 x BLOCK_KV scores (D = 128: in fp16), the 64 x
// HEAD_DIM output accumulator (in V's e4m3 units), P as the A operand of P V, each row's running
// max and sum.
#include <cuda_fp8.h>
#include <stdio.h>

#include "../common/harness.h"
#include "hopper.h"

// --- Configuration -------------------------------------------------------------------------
#define WARPGROUP_THREADS 128
#define WARPGROUP_ROWS 64  // query rows per consumer warpgroup: wgmma's M
#define STAGES_D128 3      // (K, V) tile pairs in flight, by head dim: chosen by a sweep
#define STAGES_D64 4
#define ELEMENT_BYTES 1                      // of an operand: e4m3
#define KSTEP_BYTES 32                       // of the reduced dimension per wgmma, for every type
#define MMA_K (KSTEP_BYTES / ELEMENT_BYTES)  // elements of it: 32 e4m3
#define SLICE_BYTES 128                      // the widest swizzle: longer rows are stored as 128-byte slices
#define P_SCALE_LOG2 8.0f                    // P is stored as 256 p: small p stay normal numbers (e4m3: p >= 2^-14)
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
#define PRODUCER_REGISTERS 24  // setmaxnreg: the producer keeps few registers (the consumers' share is in Config)
#define Q_SCALE_ROWS 128       // rows of Q per quantisation scale, whatever a block's query tile
#define E4M3_MAX 448.0f        // the largest finite e4m3 value
#define QK_RANGE_F16 16        // with fp16 scores: |q|, |k| <= 16, so |S| <= 128 * 16 * 16
#define EXP2_FMA_PERIOD 5      // one 8-key chunk in this many has its exponentials on the FMA units (a sweep)

template <bool FP16>
struct ScoreType {
    typedef float T;
};
template <>
struct ScoreType<true> {
    typedef unsigned T;  // two fp16 scores, adjacent columns of a row
};

template <int HEAD_DIM>
struct Config {
    static constexpr int CONSUMERS = HEAD_DIM == 128 ? 2 : 3;   // consumer warpgroups per block: measured
    static constexpr int BLOCK_Q = CONSUMERS * WARPGROUP_ROWS;  // query rows per block
    // Keys per tile (wgmma's N for Q K^T): as many as the score registers allow, by measurement.
    static constexpr int BLOCK_KV = HEAD_DIM == 128 ? 256 : 128;         // fp16 scores: half the registers
    static constexpr int THREADS = (CONSUMERS + 1) * WARPGROUP_THREADS;  // the producer, then the consumers
    // setmaxnreg: the consumers get the rest of the 64K registers, in steps of 8 (2: 240, 3: 160).
    static constexpr int CONSUMER_REGISTERS = (65536 / WARPGROUP_THREADS - PRODUCER_REGISTERS) / CONSUMERS / 8 * 8;
    static_assert(PRODUCER_REGISTERS * WARPGROUP_THREADS + CONSUMER_REGISTERS * CONSUMERS * WARPGROUP_THREADS <= 65536,
                  "the register file holds both roles");
    static constexpr int CONSUMER_WARPS = CONSUMERS * WARPGROUP_THREADS / 32;
    static constexpr int STAGES = HEAD_DIM == 128 ? STAGES_D128 : STAGES_D64;
    // Where a consumer waits for its own P V of tile j-1: true, at the top of the next loop
    // iteration, so tile j's softmax runs under it; false, after tile j's softmax, where ptxas
    // schedules that wait before the softmax. Chosen by measurement.
    static constexpr bool SOFTMAX_UNDER_PV = HEAD_DIM == 64;
    // S in fp16 (FP8 at D = 128): half the score registers, two scores an instruction in the softmax.
    static constexpr bool SCORES_ARE_FP16 = HEAD_DIM == 128;
    static constexpr int SCORE_REGS = SCORES_ARE_FP16 ? BLOCK_KV / 4 : BLOCK_KV / 2;  // a thread's, for 64 x BLOCK_KV
    static constexpr float QK_RANGE = SCORES_ARE_FP16 ? QK_RANGE_F16 : E4M3_MAX;      // Q, K quantised to |x| <= this
    static constexpr int Q_BYTES = BLOCK_Q * HEAD_DIM * ELEMENT_BYTES;
    static constexpr int K_BYTES = BLOCK_KV * HEAD_DIM * ELEMENT_BYTES;
    static constexpr int V_BYTES = HEAD_DIM * BLOCK_KV * ELEMENT_BYTES;
    // Rows of Q and K (HEAD_DIM elements) are stored in slices of at most 128 bytes, each slice a
    // [rows][slice] tile in its swizzle: one TMA box each.
    static constexpr int QK_SLICE = HEAD_DIM * ELEMENT_BYTES < SLICE_BYTES ? HEAD_DIM * ELEMENT_BYTES : SLICE_BYTES;
    static constexpr int QK_SLICES = HEAD_DIM * ELEMENT_BYTES / QK_SLICE;
    // Vt's rows (BLOCK_KV keys) likewise, in slices of 128 or 64 bytes.
    static constexpr int V_SLICE = BLOCK_KV * ELEMENT_BYTES % SLICE_BYTES == 0 ? SLICE_BYTES : 64;
    static constexpr int V_SLICES = BLOCK_KV * ELEMENT_BYTES / V_SLICE;
    static_assert(BLOCK_KV % 64 == 0, "Vt's rows are whole 64-byte slices");
    static_assert(Q_SCALE_ROWS <= BLOCK_KV, "the quantisation's block, sized for a key tile, holds Q's scale tile");
    static constexpr int BARRIERS = 1 + 2 * STAGES;  // Q full, K/V full and empty
    static constexpr int SMEM_BYTES = 1024 + Q_BYTES + STAGES * (K_BYTES + V_BYTES) + BARRIERS * 8;
    static_assert(SMEM_BYTES <= 227 * 1024, "Q and the ring exceed the 227 KiB of shared memory a block can have");
    static_assert(HEAD_DIM % MMA_K == 0 && BLOCK_KV % MMA_K == 0 && BLOCK_KV <= 256, "whole wgmma k-steps; N <= 256");
    static_assert(Q_BYTES % 1024 == 0 && K_BYTES % 1024 == 0 && V_BYTES % 1024 == 0,
                  "every tile starts 1024-byte aligned, as the 128-byte swizzle needs");
};

// --- The instructions of the two products (hopper.h) -------------------------------------
// S (64 x BLOCK_KV, SCORES = BLOCK_KV / 2 a thread) [+]= Q K^T's k-step.
template <int SCORES>
__device__ void wgmma_qk(float (&score)[SCORES], uint64_t q_desc, uint64_t k_desc, int accumulate) {
    wgmma_m64n128k32_e4m3_ss(score, q_desc, k_desc, accumulate);
}

template <int REGS>
__device__ void wgmma_qk(unsigned (&score)[REGS], uint64_t q_desc, uint64_t k_desc, int accumulate) {
    static_assert(REGS == 64, "a wgmma of Q K^T in fp16 for 256 keys");
    wgmma_m64n256k32_f16_e4m3_ss(score, q_desc, k_desc, accumulate);
}

template <int HEAD_DIM>
__device__ void wgmma_pv(float (&o_acc)[HEAD_DIM / 2], const unsigned (&p)[4], uint64_t v_desc) {
    if constexpr (HEAD_DIM == 128) wgmma_m64n128k32_e4m3_rs(o_acc, p, v_desc);
    else wgmma_m64n64k32_e4m3_rs(o_acc, p, v_desc);
}

// --- The block's shared memory and work ---------------------------------------------------
struct Smem {
    unsigned char *q_tile;  // [BLOCK_Q][HEAD_DIM]
    unsigned char *k_ring;  // [STAGES][BLOCK_KV][HEAD_DIM]
    unsigned char *v_ring;  // Vt: [STAGES][HEAD_DIM][BLOCK_KV]
    uint64_t *q_full, *kv_full, *kv_empty;
};

template <int HEAD_DIM>
__device__ Smem smem_layout(unsigned char *raw) {
    typedef Config<HEAD_DIM> Cfg;
    Smem smem;
    smem.q_tile = (unsigned char *)(((uintptr_t)raw + 1023) & ~(uintptr_t)1023);
    smem.k_ring = smem.q_tile + Cfg::Q_BYTES;
    smem.v_ring = smem.k_ring + Cfg::STAGES * Cfg::K_BYTES;
    smem.q_full = (uint64_t *)(smem.v_ring + Cfg::STAGES * Cfg::V_BYTES);
    smem.kv_full = smem.q_full + 1;
    smem.kv_empty = smem.kv_full + Cfg::STAGES;
    return smem;
}

// What a block works on, and where its copies come from.
struct Work {
    const CUtensorMap *k_map, *v_map;
    const float *k_descales, *v_descales;  // one per key tile of this (b, h)
    int head, query0, kv_tiles, seqlen, causal;
};

// A tile's descale: what its e4m3 values are multiplied by to give the fp16 inputs back.
__device__ float descale_at(const float *descales, int tile) { return __ldg(&descales[tile]); }

// --- The producer: TMA copies into the ring -------------------------------------------------
// The K and V tiles of `tile` into their ring stage; its full barrier completes once all bytes
// have landed.
template <int HEAD_DIM>
__device__ void load_kv_tile(const Smem &smem, const Work &w, int tile) {
    typedef Config<HEAD_DIM> Cfg;
    const int stage = tile % Cfg::STAGES;
    mbarrier_arrive_expect_bytes(&smem.kv_full[stage], Cfg::K_BYTES + Cfg::V_BYTES);
    for (int slice = 0; slice < Cfg::QK_SLICES; slice++)
        tma_load(smem.k_ring + stage * Cfg::K_BYTES + slice * Cfg::BLOCK_KV * Cfg::QK_SLICE, w.k_map,
                 &smem.kv_full[stage], slice * Cfg::QK_SLICE, tile * Cfg::BLOCK_KV, w.head);
    // Vt: [slice][dim][128 bytes of keys]
    for (int slice = 0; slice < Cfg::V_SLICES; slice++)
        tma_load(smem.v_ring + stage * Cfg::V_BYTES + slice * HEAD_DIM * Cfg::V_SLICE, w.v_map, &smem.kv_full[stage],
                 tile * Cfg::BLOCK_KV * ELEMENT_BYTES + slice * Cfg::V_SLICE, 0, w.head);
}

// The producer warpgroup's one thread: every (K, V) tile pair, each into a stage once it is empty.
template <int HEAD_DIM>
__device__ void produce(const Smem &smem, const Work &w) {
    constexpr int STAGES = Config<HEAD_DIM>::STAGES;
    for (int tile = STAGES; tile < w.kv_tiles; tile++) {  // the first STAGES are loaded with Q
        mbarrier_wait(&smem.kv_empty[tile % STAGES], (tile / STAGES - 1) % 2);
        load_kv_tile<HEAD_DIM>(smem, w, tile);
    }
}

// A consumer is done with the stage of `tile`: each of its warps arrives on the stage's empty
// barrier.
template <int HEAD_DIM>
__device__ void release_stage(const Smem &smem, const Work &w, int tile) {
    constexpr int STAGES = Config<HEAD_DIM>::STAGES;
    __syncwarp();
    if (threadIdx.x % 32 == 0) mbarrier_arrive(&smem.kv_empty[tile % STAGES]);
    __syncwarp();
}

// --- The consumers: scores, softmax, P, P V -------------------------------------------------
// Where k-step ks (32 bytes of every row) of a tile starts: in slice ks * 32 / slice_bytes,
// each slice being slice_stride bytes (all the tile's rows) long.
__device__ int kstep_offset(int slice_stride, int slice_bytes, int ks) {
    return ks * KSTEP_BYTES / slice_bytes * slice_stride + ks * KSTEP_BYTES % slice_bytes;
}

__device__ const unsigned char *kstep(const unsigned char *tile, int slice_stride, int slice_bytes, int ks) {
    return tile + kstep_offset(slice_stride, slice_bytes, ks);
}

// S = Q K^T for the warpgroup's 64 rows: HEAD_DIM / MMA_K wgmmas, issued, not waited for.
template <int HEAD_DIM, typename Score>
__device__ void issue_qk(Score (&score)[Config<HEAD_DIM>::SCORE_REGS], const unsigned char *q_rows,
                         const unsigned char *k_tile) {
    typedef Config<HEAD_DIM> Cfg;
    unsigned q_address = smem_address(q_rows);
    // Q's descriptors are the same every tile. With fp16 scores they are rebuilt here from one
    // 32-bit address, rather than held in eight registers through the softmax, where 256 scores
    // and the overlap leave none to spare (the empty asm keeps them from being hoisted).
    if (Cfg::SCORES_ARE_FP16) asm volatile("" : "+r"(q_address));
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / MMA_K; ks++)
        wgmma_qk(score,
                 smem_descriptor_at(q_address + kstep_offset(Cfg::BLOCK_Q * Cfg::QK_SLICE, Cfg::QK_SLICE, ks),
                                    Cfg::QK_SLICE),
                 smem_descriptor(kstep(k_tile, Cfg::BLOCK_KV * Cfg::QK_SLICE, Cfg::QK_SLICE, ks), Cfg::QK_SLICE),
                 ks > 0);
    wgmma_commit();
}

// O += P V: P from registers, Vt from shared memory (K-major: 8-bit operands have no transpose); issued.
template <int HEAD_DIM>
__device__ void issue_pv(float (&o_acc)[HEAD_DIM / 2], const unsigned (&p_frag)[Config<HEAD_DIM>::BLOCK_KV / MMA_K][4],
                         const unsigned char *v_tile) {
    typedef Config<HEAD_DIM> Cfg;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Cfg::BLOCK_KV / MMA_K; kk++)
        wgmma_pv<HEAD_DIM>(o_acc, p_frag[kk],
                           smem_descriptor(kstep(v_tile, HEAD_DIM * Cfg::V_SLICE, Cfg::V_SLICE, kk), Cfg::V_SLICE));
    wgmma_commit();
}

// Online softmax on the accumulators (as 07), in log2 units.
__device__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}

__device__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffff, x, 1);
    return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// Accumulator element j of a thread: row row0 + 8 (j%4/2), column col0 + 8 (j/4) + j%2.
template <int SCORES>
__device__ void mask_scores(float (&score)[SCORES], int row0, int col0, int seqlen, int causal) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int query = row0 + 8 * r;
        const int key_limit = causal ? min(seqlen, query + 1) : seqlen;  // first hidden key
#pragma unroll
        for (int chunk = 0; chunk < SCORES / 4; chunk++)
#pragma unroll
            for (int e = 0; e < 2; e++)
                if (col0 + 8 * chunk + e >= key_limit) score[4 * chunk + 2 * r + e] = -INFINITY;
    }
}

// One score tile: the new row max, the factor that rescales the old sum and O (O is the
// caller's: it may still be in flight), and the scores turned into 2^8 p.
template <int SCORES>
__device__ void softmax_tile(float (&score)[SCORES], float (&row_max)[2], float (&row_sum)[2], float (&rescale)[2],
                             float scale_log2) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        // Two running maxima and two running sums per row, not one: shorter dependency chains.
        float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int chunk = 0; chunk < SCORES / 4; chunk++)
#pragma unroll
            for (int e = 0; e < 2; e++) tile_max[e] = fmaxf(tile_max[e], score[4 * chunk + 2 * r + e]);
        const float new_max = fmaxf(row_max[r], quad_max(fmaxf(tile_max[0], tile_max[1])) * scale_log2);
        const float base = new_max == -INFINITY ? 0.0f : new_max;  // a row with no key yet stays empty
        rescale[r] = exp2_approx(row_max[r] - base);
        row_max[r] = new_max;
        float tile_sum[2] = {0.0f, 0.0f};
#pragma unroll
        for (int chunk = 0; chunk < SCORES / 4; chunk++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float *x = &score[4 * chunk + 2 * r + e];
                *x = exp2_approx(fmaf(*x, scale_log2, P_SCALE_LOG2 - base));
                tile_sum[e] += *x;
            }
        row_sum[r] = row_sum[r] * rescale[r] + (tile_sum[0] + tile_sum[1]);
    }
}

__device__ __half2 as_half2(unsigned bits) { return *(__half2 *)&bits; }
__device__ unsigned as_bits(__half2 h) { return *(unsigned *)&h; }

// The same on fp16 scores: register i holds row 8 (i % 2), columns 8 (i / 2) and the one after.
template <int REGS>
__device__ void mask_scores(unsigned (&score)[REGS], int row0, int col0, int seqlen, int causal) {
    const __half minus_inf = __ushort_as_half(0xfc00);
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int query = row0 + 8 * r;
        const int key_limit = causal ? min(seqlen, query + 1) : seqlen;
#pragma unroll
        for (int chunk = 0; chunk < REGS / 2; chunk++) {
            __half2 x = as_half2(score[2 * chunk + r]);
            if (col0 + 8 * chunk >= key_limit) x.x = minus_inf;
            if (col0 + 8 * chunk + 1 >= key_limit) x.y = minus_inf;
            score[2 * chunk + r] = as_bits(x);
        }
    }
}

// 2^x of two halves: two MUFU.EX2.F16 (cuda_fp16's h2exp2 goes through fp32 on sm_90).
__device__ __half2 exp2_approx_h2(__half2 x) {
    unsigned y;
    asm("ex2.approx.f16x2 %0, %1;\n" : "=r"(y) : "r"(as_bits(x)));
    return as_half2(y);
}

// 2^x of two halves on the FMA units, for when the MUFU unit (16 ex2 a cycle per SM) is the
// limit: x = j + f, 2^f by a cubic in half2 (relative error 6e-4, fp16's own rounding is 5e-4),
// times 2^j made in the exponent bits. Adding 1536 (1.5 * 2^10) leaves x rounded to the integer
// j in the low mantissa bits of each half, 0x6600 + j, and (bits - 0x65F1) << 10 is then the
// half 2^j (exponent field j + 15) in both lanes at once. x <= -15 gives 0 (exponent field 0):
// e4m3's P holds nothing that small (2^-15 of p's 2^8 scale) anyway.
__device__ __half2 exp2_fma_h2(__half2 x) {
    const __half2 rounder = as_half2(0x66006600u);  // 1536
    x = __hmax2(x, as_half2(0xcb80cb80u));          // -15
    const __half2 shifted = __hadd2(x, rounder);
    const __half2 f = __hsub2(x, __hsub2(shifted, rounder));               // in [-1/2, 1/2]
    __half2 p = __hfma2(as_half2(0x2b0d2b0du), f, as_half2(0x33c333c3u));  // 0.05509 f + 0.2426
    p = __hfma2(p, f, as_half2(0x398c398cu));                              // ... + 0.6934
    p = __hfma2(p, f, as_half2(0x3c003c00u));                              // ... + 1
    const unsigned two_to_j = (as_bits(shifted) - 0x65f165f1u) << 10;
    return __hmul2(p, as_half2(two_to_j));
}

// Whether the exponentials of 8-key chunk `chunk` go to the FMA units: one chunk in EXP2_FMA_PERIOD.
__device__ constexpr bool exp2_on_fma(int chunk) { return (chunk + 1) % EXP2_FMA_PERIOD == 0; }

// The exponent s * scale + (8 - max) as one HFMA2 needs the offset 8 - max in fp16 to within 1
// (|max| < 2^11 in log2 units) and a finite scale.
#define HALF_MAX_LIMIT 2000.0f
#define HALF_SCALE_LIMIT 32768.0f

// The largest score of row r (0: row0, 1: row0 + 8) of the quad's fp16 tile.
template <int REGS>
__device__ float row_top(const unsigned (&score)[REGS], int r) {
    __half2 tile_max[2] = {as_half2(0xfc00fc00u), as_half2(0xfc00fc00u)};
#pragma unroll
    for (int chunk = 0; chunk < REGS / 2; chunk++)
        tile_max[chunk % 2] = __hmax2(tile_max[chunk % 2], as_half2(score[2 * chunk + r]));
    const __half2 both = __hmax2(tile_max[0], tile_max[1]);
    return quad_max(fmaxf(__low2float(both), __high2float(both)));
}

// Logits past HALF_MAX_LIMIT (rare): each row's scores minus a max, in place, in their own
// units, so that the offset stays small. That max is the tile's own (exact: an fp16 score) where
// it leads the row, otherwise the row's reference so far (row_max) in this tile's units rounded
// down, the remainder going into the offset. The row's reference never drifts. Both sides of the
// comparison are in the units the HFMA2 computes, the scale rounded to fp16: a max taken with
// the fp32 scale differs from them by up to 2^-11 of it, which past ~10^4 is enough to push the
// whole tile's p out of fp16's range.
template <int REGS>
__device__ void recentre_scores(unsigned (&score)[REGS], const float (&row_max)[2], __half scale_h, __half (&offset)[2],
                                float (&reference)[2]) {
    const float scale = __half2float(scale_h);
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const float top = row_top(score, r);                // again: the rare way keeps no registers for it
        const bool tile_leads = top * scale >= row_max[r];  // or the row starts here (row_max -inf)
        const float earlier = fminf(fmaxf(row_max[r] / scale, -65504.0f), 65504.0f);
        const __half max_scores =
            tile_leads ? __float2half_rn(top == -INFINITY ? 0.0f : top) : __float2half_rd(earlier);  // empty: 0
        const float gap = tile_leads ? 0.0f : row_max[r] - __half2float(max_scores) * scale;
        offset[r] = __float2half_rn(P_SCALE_LOG2 - gap);
        reference[r] = tile_leads ? __half2float(max_scores) * scale : row_max[r];
#pragma unroll
        for (int chunk = 0; chunk < REGS / 2; chunk++)
            score[2 * chunk + r] = as_bits(__hsub2(as_half2(score[2 * chunk + r]), __half2half2(max_scores)));
    }
}

// The same on fp16 scores, two keys an instruction: the row max on half2, 2^x as two
// MUFU.EX2.F16 (SPLIT_EXP2: in one 8-key chunk of EXP2_FMA_PERIOD, a cubic on the FMA units
// instead, which runs beside the special-function unit), the sums on half2 (two chains). The
// exponent is one HFMA2, s * scale + offset, with the offset 8 - max rounded to fp16 downwards;
// that rounded value becomes the row's reference (row_max), so p stays <= 2^8 and the sums and O
// agree with it. For logits past ~1400 (natural units), where fp16 cannot hold that offset
// closely, a warp first recentres its scores (above); only WIDE_LOGITS warpgroups, whose inputs
// can reach that far, check for it (a branch here, between the waits for Q K^T and for P V,
// costs 5%). The scale is capped at 32768, about what fp16 holds safely: only inputs with |q|
// and |k| in the thousands reach it, and their softmax is then computed with the capped scale.
template <bool WIDE_LOGITS, int REGS>
__device__ void softmax_tile(unsigned (&score)[REGS], float (&row_max)[2], float (&row_sum)[2], float (&rescale)[2],
                             float scale_log2) {
    const float scale = fminf(scale_log2, HALF_SCALE_LIMIT);  // the scores' scale from here on
    const __half scale_h = __float2half_rn(scale);
    float new_max[2], reference[2];  // the row's max logit; the reference p is taken against
    __half offset[2];
    bool recentre = false;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        new_max[r] = fmaxf(row_max[r], row_top(score, r) * scale);
        const float max_here = new_max[r] == -INFINITY ? 0.0f : new_max[r];  // an empty row stays empty
        offset[r] = __float2half_rd(P_SCALE_LOG2 - max_here);
        reference[r] = P_SCALE_LOG2 - __half2float(offset[r]);
        recentre |= fabsf(max_here) > HALF_MAX_LIMIT;
    }
    if (WIDE_LOGITS && __any_sync(0xffffffff, recentre)) recentre_scores(score, row_max, scale_h, offset, reference);
    const __half2 scale2 = __half2half2(scale_h);
#pragma unroll
    for (int r = 0; r < 2; r++) {
        rescale[r] = exp2_approx(row_max[r] - reference[r]);
        row_max[r] = new_max[r] == -INFINITY ? new_max[r] : reference[r];
        const __half2 offset2 = __half2half2(offset[r]);
        __half2 sum[2] = {};
#pragma unroll
        for (int chunk = 0; chunk < REGS / 2; chunk++) {
            const __half2 x = __hfma2(as_half2(score[2 * chunk + r]), scale2, offset2);
            const __half2 p = exp2_on_fma(chunk) ? exp2_fma_h2(x) : exp2_approx_h2(x);
            score[2 * chunk + r] = as_bits(p);
            sum[chunk % 2] = __hadd2(sum[chunk % 2], p);
        }
        float tile_sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 2; i++) tile_sum += __low2float(sum[i]) + __high2float(sum[i]);
        row_sum[r] = row_sum[r] * rescale[r] + tile_sum;
    }
}

__device__ unsigned pack_half2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *(unsigned *)&h;
}

// Four fp32 values to four e4m3 bytes, the first in the lowest byte.
__device__ unsigned pack_e4m3x4(float a, float b, float c, float d) {
    unsigned lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
    unsigned hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
    return lo | hi << 16;
}

// P to e4m3, in the A-operand layout: per 32 keys, rows g and g+8 of keys 2t, 2t+1, 2t+8, 2t+9
// of each 16, which Vt's key_slot order turns into positions 4t..4t+3.
template <int SCORES>
__device__ void pack_p(const float (&score)[SCORES], unsigned (&p_frag)[2 * SCORES / MMA_K][4]) {
    // EXERCISE 08.pack_p BEGIN: P into the e4m3 A-operand registers of P V from fp32 scores (D = 64 only), in place, in Vt's key_slot order
    //   kind: correctness
    //   dims: 64
    //   hint: This pack_p, for fp32 scores, runs at D = 64 only: at D = 128 the chapter keeps S in fp16 and
    //     packs P with the other pack_p, below it, so the grade runs the D = 64 half of the matrix. The Q K^T
    //     accumulator gives this thread, per 8-key chunk c, keys 8c + 2t and 8c + 2t + 1 of rows g and g + 8
    //     (score[4c + 2r + e], t = lane % 4). Register i of k32 step kk takes the two pairs of chunks
    //     c = 4 kk + 2 (i / 2) and c + 1 of row g + 8 (i % 2), packed by pack_e4m3x4: key_slot stored Vt so
    //     that these are the A operand's positions 4t..4t+3.
    //   wrong old: pack_e4m3x4(score[4 * chunk + 2 * r], score[4 * chunk + 2 * r + 1],
    //   wrong new: pack_e4m3x4(score[4 * chunk + 2 * r + 1], score[4 * chunk + 2 * r],
#pragma unroll
    for (int kk = 0; kk < 2 * SCORES / MMA_K; kk++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int chunk = 4 * kk + 2 * (i / 2), r = i % 2;  // n8 chunks chunk, chunk + 1; row g + 8r
            p_frag[kk][i] = pack_e4m3x4(score[4 * chunk + 2 * r], score[4 * chunk + 2 * r + 1],
                                        score[4 * chunk + 4 + 2 * r], score[4 * chunk + 4 + 2 * r + 1]);
        }
    // EXERCISE END
}

// The same from fp16 scores: fp32 chunks c and c + 1 of row r are registers 2c + r and 2c + 2 + r.
template <int REGS>
__device__ void pack_p(const unsigned (&score)[REGS], unsigned (&p_frag)[4 * REGS / MMA_K][4]) {
#pragma unroll
    for (int kk = 0; kk < 4 * REGS / MMA_K; kk++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int chunk = 4 * kk + 2 * (i / 2), r = i % 2;
            const __half2_raw lo = *(const __half2_raw *)&score[2 * chunk + r];
            const __half2_raw hi = *(const __half2_raw *)&score[2 * chunk + 2 + r];
            p_frag[kk][i] = (unsigned)__nv_cvt_halfraw2_to_fp8x2(lo, __NV_SATFINITE, __NV_E4M3) |
                            (unsigned)__nv_cvt_halfraw2_to_fp8x2(hi, __NV_SATFINITE, __NV_E4M3) << 16;
        }
}

// O times each row's rescale and the change of V's units (next_v_units), before the next P V.
template <int HEAD_DIM, typename Warpgroup>
__device__ void rescale_output(Warpgroup &wg) {
    const float v_units = next_v_units(wg);
    const float factor[2] = {wg.rescale[0] * v_units, wg.rescale[1] * v_units};
#pragma unroll
    for (int chunk = 0; chunk < HEAD_DIM / 8; chunk++)
#pragma unroll
        for (int j = 0; j < 4; j++) wg.o_acc[4 * chunk + j] *= factor[j / 2];
}

// Ping-pong: consumer warpgroup g issues its matrix products only after the one before it (g - 1,
// in a ring) has issued its own (named barrier 1 + g: g's 128 threads wait, that one's 128
// arrive), so that one warpgroup's softmax runs while the others' products keep the tensor cores
// busy.
__device__ void wait_turn(int group) { bar_sync<2 * WARPGROUP_THREADS>(1 + group); }

__device__ void pass_turn(int group, int consumers) {
    const int next = consumers == 2 ? 1 - group : (group + 1) % consumers;  // the next warpgroup in the ring
    bar_arrive<2 * WARPGROUP_THREADS>(1 + next);
}

// What a consumer warpgroup keeps on chip; thread t holds rows row0 and row0 + 8 of each.
template <int HEAD_DIM, bool WIDE>  // WIDE: its softmax checks every tile for logits past one HFMA2's reach
struct Consumer {
    static constexpr bool WIDE_LOGITS = WIDE;
    float o_acc[HEAD_DIM / 2];  // O, unnormalised, in V's e4m3 units
    typename ScoreType<Config<HEAD_DIM>::SCORES_ARE_FP16>::T score[Config<HEAD_DIM>::SCORE_REGS];  // S, then 2^8 p
    unsigned p_frag[Config<HEAD_DIM>::BLOCK_KV / MMA_K][4];  // P, the A operand of P V
    float row_max[2], row_sum[2], rescale[2];
    const unsigned char *q_rows;  // the warpgroup's 64 rows of the Q tile
    int group, group_query0, row0;
    float score_scale_log2;  // the softmax scale in log2 units, times Q's descale (K's is per tile)
    float v_descale;         // O is kept in the units of the last V tile it accumulated
    float next_v_descale;    // V's descale of the tile whose scores were computed last
};

// Each V tile has its own scale: before P V of `tile` adds in that tile's units, O moves to them.
template <typename Warpgroup>
__device__ float next_v_units(Warpgroup &wg) {
    const float ratio = wg.v_descale / wg.next_v_descale;
    wg.v_descale = wg.next_v_descale;
    return ratio;
}

// Whether a tile's scores are masked: decided here at run time, or by the caller's loop. With a
// P V in flight the caller decides: a branch between the two waits makes ptxas wait for the P V
// at its join, before the softmax it should overlap.
enum MaskMode { MASK_IF_NEEDED, MASK_NONE, MASK_ALL };

// Tile `tile` up to its probabilities: wait for its copy and for our turn, issue Q K^T (and, with
// PV_IN_FLIGHT, P V of the previous tile right behind it), pass the turn, mask, softmax.
template <int HEAD_DIM, bool PV_IN_FLIGHT, MaskMode MASK = MASK_IF_NEEDED, typename Warpgroup>
__device__ void scores_and_softmax(Warpgroup &wg, const Smem &smem, const Work &w, int tile) {
    typedef Config<HEAD_DIM> Cfg;
    const int key0 = tile * Cfg::BLOCK_KV;
    const float k_descale = descale_at(w.k_descales, tile);
    const float *v_descales = w.v_descales;
    if (Cfg::SCORES_ARE_FP16) {  // V's descales found from K's, one pointer fewer through the softmax (Q K^T)
        int heads_tiles = (w.causal ? gridDim.x : gridDim.y) * ceil_div(w.seqlen, Cfg::BLOCK_KV);
        asm volatile("" : "+r"(heads_tiles));
        v_descales = w.k_descales + heads_tiles;
    }
    wg.next_v_descale = descale_at(v_descales, tile);  // with K's, long before O needs it
    mbarrier_wait(&smem.kv_full[tile % Cfg::STAGES], tile / Cfg::STAGES % 2);
    wait_turn(wg.group);
    issue_qk<HEAD_DIM>(wg.score, wg.q_rows, smem.k_ring + tile % Cfg::STAGES * Cfg::K_BYTES);
    if (PV_IN_FLIGHT) issue_pv<HEAD_DIM>(wg.o_acc, wg.p_frag, smem.v_ring + (tile - 1) % Cfg::STAGES * Cfg::V_BYTES);
    // Every wait_turn has its pass_turn: the last warpgroup passed one turn before the loop.
    const bool last_group = Cfg::CONSUMERS == 2 ? wg.group != 0 : wg.group == Cfg::CONSUMERS - 1;
    if (!last_group || tile < w.kv_tiles - 1) pass_turn(wg.group, Cfg::CONSUMERS);
    if (PV_IN_FLIGHT) wgmma_wait<1>();  // S is in (groups complete in order); P V may still run
    else wgmma_wait<0>();
    hold_registers(wg.score);
    const bool needs_mask = key0 + Cfg::BLOCK_KV > w.seqlen || (w.causal && key0 + Cfg::BLOCK_KV - 1 > wg.group_query0);
    if (MASK == MASK_ALL || (MASK == MASK_IF_NEEDED && needs_mask))
        mask_scores(wg.score, wg.row0, key0 + 2 * (threadIdx.x % 4), w.seqlen, w.causal);
    const float scale_log2 = wg.score_scale_log2 * k_descale;  // K's descale is the tile's
    if constexpr (Cfg::SCORES_ARE_FP16)
        softmax_tile<Warpgroup::WIDE_LOGITS>(wg.score, wg.row_max, wg.row_sum, wg.rescale, scale_log2);
    else softmax_tile(wg.score, wg.row_max, wg.row_sum, wg.rescale, scale_log2);
}

// O += P V for the tile whose P is in registers, waited for, then its stage released.
template <int HEAD_DIM, typename Warpgroup>
__device__ void finish_pv(Warpgroup &wg, const Smem &smem, const Work &w, int tile) {
    issue_pv<HEAD_DIM>(wg.o_acc, wg.p_frag, smem.v_ring + tile % Config<HEAD_DIM>::STAGES * Config<HEAD_DIM>::V_BYTES);
    wgmma_wait<0>();
    hold_registers(wg.o_acc);
    hold_registers(wg.p_frag);
    release_stage<HEAD_DIM>(smem, w, tile);
}

// EXERCISE 08.intra_overlap BEGIN: issue the P V of tile j-1 behind the Q K^T of tile j: it runs during j's softmax
//   kind: speed
//   shape: headline
//   timed: attend_ms
//   hint: Peel tile 0: its Q K^T and softmax alone (scores_and_softmax<HEAD_DIM, false>), then rescale O and
//     pack its P. Then, for each tile j from 1: issue the Q K^T of j and the P V of j-1 in one turn
//     (scores_and_softmax<HEAD_DIM, true>, which waits for Q K^T alone); only after j's softmax wait for that
//     P V (wgmma_wait<0>) and release its stage (release_stage of j-1); rescale O and pack the P of j. After
//     the loop, issue and finish the last P V (finish_pv of tile w.kv_tiles - 1). What speed needs: the wait
//     for P V must come after the softmax in program order, and where ptxas cannot move it up: in the
//     softmax's own basic block it may schedule the wait before the softmax, while at the top of the next
//     iteration it stays after it (make sass CH=08 shows where the WARPGROUP.DEPBAR went); and no branch
//     between the two waits, or ptxas waits at the join: decide the mask by loop (MASK_NONE for the tiles
//     that need none, MASK_ALL for the rest), and do not put the second product under an if (tile > 0).
//   stub: measured: the chapter without the overlap (its switch off, in the ablation of commit d0df0f8), its
//     attention kernel 0.587 ms against 0.565 at
//     B=4 H=16 N=4096 D=128, 1.04x, and 1.05x at D=64, within a shared GPU's noise for a gate
//     (docs/results/logs/08/ablation_08.csv)
//   ptx: \bwgmma\.wait_group\.sync\.aligned\s+1\s*;
//   ptx shown: wgmma.wait_group.sync.aligned 1
//   ptx found: \bwgmma\.wait_group\.sync\.aligned\s+\d+
//   ptx means: a wait for all but the latest group of warpgroup products: with the P V of tile j-1 issued
//     behind the Q K^T of tile j, it waits for Q K^T alone and lets P V run on during tile j's softmax
//   ptx todo: Issue the P V of tile j-1 in the same turn as the Q K^T of tile j
//     (scores_and_softmax<HEAD_DIM, true>), as the hint says
// Tile tile-1's probabilities into the A operand of its P V, once the P V before it (tile-2,
// if any) is done and O is rescaled.
template <int HEAD_DIM, typename Warpgroup>
__device__ void previous_p_ready(Warpgroup &wg, const Smem &smem, const Work &w, int tile) {
    wgmma_wait<0>();
    hold_registers(wg.o_acc);
    hold_registers(wg.p_frag);
    if (tile >= 2) release_stage<HEAD_DIM>(smem, w, tile - 2);
    rescale_output<HEAD_DIM>(wg);
    pack_p(wg.score, wg.p_frag);
}

// One tile of the overlapped loop: tile's Q K^T and tile-1's P V issued together, tile's softmax,
// and P of tile ready for the next P V. SOFTMAX_UNDER_PV: the wait for tile-1's P V comes first in
// the body (P of tile-1 is made ready at the top), where ptxas cannot move it above the softmax;
// after the softmax in the same block, ptxas schedules it early, before the softmax.
template <int HEAD_DIM, MaskMode MASK, typename Warpgroup>
__device__ void overlapped_tile(Warpgroup &wg, const Smem &smem, const Work &w, int tile) {
    constexpr bool UNDER_PV = Config<HEAD_DIM>::SOFTMAX_UNDER_PV;
    if (UNDER_PV) previous_p_ready<HEAD_DIM>(wg, smem, w, tile);
    scores_and_softmax<HEAD_DIM, true, MASK>(wg, smem, w, tile);
    if (!UNDER_PV) previous_p_ready<HEAD_DIM>(wg, smem, w, tile + 1);
}
// EXERCISE END

// A consumer warpgroup: its 64 query rows against every key tile, then O and LSE.
template <int HEAD_DIM, typename Warpgroup>
__device__ void consume(const Smem &smem, const Work &w, int group, float score_scale_log2, __half *o, float *lse) {
    typedef Config<HEAD_DIM> Cfg;
    const int lane = threadIdx.x % 32;
    Warpgroup wg;
    wg.group = group;
    wg.group_query0 = w.query0 + group * WARPGROUP_ROWS;
    wg.row0 = wg.group_query0 + threadIdx.x / 32 % 4 * 16 + lane / 4;
    wg.q_rows = smem.q_tile + group * WARPGROUP_ROWS * Cfg::QK_SLICE;  // in every slice
    wg.score_scale_log2 = score_scale_log2;
    wg.v_descale = descale_at(w.v_descales, 0);
    for (int i = 0; i < HEAD_DIM / 2; i++) wg.o_acc[i] = 0.0f;
    for (int r = 0; r < 2; r++) {
        wg.row_max[r] = -INFINITY;
        wg.row_sum[r] = 0.0f;
    }
    mbarrier_wait(smem.q_full, 0);
    if (group == Cfg::CONSUMERS - 1) pass_turn(group, Cfg::CONSUMERS);  // warpgroup 0 goes first

    // EXERCISE 08.intra_overlap BEGIN
    // P V of tile j-1 is issued right behind Q K^T of tile j, in the same turn; O is rescaled
    // once it is done, before the next P V. The tiles that need no mask come first, [0,
    // unmasked_tiles), then the masked ones (the diagonal, the end of the sequence), each
    // kind in its own loop.
    const int unmasked_tiles = min(w.seqlen, w.causal ? wg.group_query0 + 1 : w.seqlen) / Cfg::BLOCK_KV;
    constexpr bool UNDER_PV = Cfg::SOFTMAX_UNDER_PV;
    scores_and_softmax<HEAD_DIM, false>(wg, smem, w, 0);
    if (!UNDER_PV) previous_p_ready<HEAD_DIM>(wg, smem, w, 1);
    for (int tile = 1; tile < unmasked_tiles; tile++) overlapped_tile<HEAD_DIM, MASK_NONE>(wg, smem, w, tile);
    for (int tile = max(1, unmasked_tiles); tile < w.kv_tiles; tile++)
        overlapped_tile<HEAD_DIM, MASK_ALL>(wg, smem, w, tile);
    if (UNDER_PV) previous_p_ready<HEAD_DIM>(wg, smem, w, w.kv_tiles);
    finish_pv<HEAD_DIM>(wg, smem, w, w.kv_tiles - 1);
    // EXERCISE 08.intra_overlap STUB
    // for (int tile = 0; tile < w.kv_tiles; tile++) {
    //     scores_and_softmax<HEAD_DIM, false>(wg, smem, w, tile);
    //     rescale_output<HEAD_DIM>(wg);
    //     pack_p(wg.score, wg.p_frag);
    //     finish_pv<HEAD_DIM>(wg, smem, w, tile);
    // }
    // EXERCISE END

    // O = accumulator times V's descale / sum, LSE = ln(sum) + max (p was scaled by 2^8), once each.
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int query = wg.row0 + 8 * r;
        const float sum = quad_sum(wg.row_sum[r]), scale_out = wg.v_descale / sum;
        if (query >= w.seqlen) continue;
        __half *o_row = o + ((size_t)w.head * w.seqlen + query) * HEAD_DIM + 2 * (lane % 4);
#pragma unroll
        for (int j = 0; j < HEAD_DIM / 8; j++)
            *(unsigned *)&o_row[8 * j] =
                pack_half2(wg.o_acc[4 * j + 2 * r] * scale_out, wg.o_acc[4 * j + 2 * r + 1] * scale_out);
        if (lane % 4 == 0) lse[(size_t)w.head * w.seqlen + query] = (wg.row_max[r] + log2f(sum) - P_SCALE_LOG2) * LN2;
    }
}

// --- The kernel ----------------------------------------------------------------------------
// Whether a consumer's logits can pass HALF_MAX_LIMIT: |S| <= HEAD_DIM * QK_RANGE^2 in e4m3 units,
// times its Q descale (in score_scale_log2, with the softmax scale) and the largest K descale
// among the block's key tiles. The same in every lane of a warpgroup.
template <int HEAD_DIM>
__device__ bool logits_may_be_wide(const Work &w, float score_scale_log2) {
    float k_descale = 0.0f;
    for (int tile = threadIdx.x % 32; tile < w.kv_tiles; tile += 32)
        k_descale = fmaxf(k_descale, descale_at(w.k_descales, tile));
    for (int offset = 16; offset > 0; offset /= 2)
        k_descale = fmaxf(k_descale, __shfl_xor_sync(0xffffffff, k_descale, offset));
    const float reach = HEAD_DIM * Config<HEAD_DIM>::QK_RANGE * Config<HEAD_DIM>::QK_RANGE;
    return reach * score_scale_log2 * k_descale > HALF_MAX_LIMIT;
}

// A consumer whose logits may pass one HFMA2's reach runs the loop that checks every tile for them.
template <int HEAD_DIM>
__device__ void consume_by_reach(const Smem &smem, const Work &w, int group, float score_scale_log2, __half *o,
                                 float *lse, bool wide) {
    if (!wide) consume<HEAD_DIM, Consumer<HEAD_DIM, false>>(smem, w, group, score_scale_log2, o, lse);
    else if constexpr (Config<HEAD_DIM>::SCORES_ARE_FP16)
        consume<HEAD_DIM, Consumer<HEAD_DIM, true>>(smem, w, group, score_scale_log2, o, lse);
}

template <int HEAD_DIM>
__global__ void __launch_bounds__(Config<HEAD_DIM>::THREADS, 1)
    attention_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                     const __grid_constant__ CUtensorMap v_map, const float *descales, __half *o, float *lse,
                     int seqlen, int heads, float scale_log2e, int causal) {
    typedef Config<HEAD_DIM> Cfg;
    extern __shared__ unsigned char smem_raw[];
    const Smem smem = smem_layout<HEAD_DIM>(smem_raw);
    const int query_tile = causal ? gridDim.y - 1 - blockIdx.y : blockIdx.x;
    Work w;
    w.k_map = &k_map;
    w.v_map = &v_map;
    w.head = causal ? blockIdx.x : blockIdx.y;
    w.query0 = query_tile * Cfg::BLOCK_Q;
    w.seqlen = seqlen;
    w.causal = causal;
    w.kv_tiles =
        ceil_div(causal ? min(seqlen, w.query0 + Cfg::BLOCK_Q) : seqlen, Cfg::BLOCK_KV);  // causal: to the diagonal

    // The descales, Q's [b*h][Q scale tile] then K's and V's [b*h][key tile], fold into the softmax
    // scale (Q per consumer warpgroup, K per tile) and into O (V per tile).
    const int q_scale_tiles = ceil_div(seqlen, Q_SCALE_ROWS), key_tiles = ceil_div(seqlen, Cfg::BLOCK_KV);
    const int consumer = max(0, (int)(threadIdx.x / WARPGROUP_THREADS) - 1);
    const int q_scale_tile = Cfg::BLOCK_Q == Q_SCALE_ROWS
                                 ? query_tile  // the block's query tile is Q's scale tile
                                 : min((w.query0 + consumer * WARPGROUP_ROWS) / Q_SCALE_ROWS, q_scale_tiles - 1);
    const float *kv_descales = descales + heads * q_scale_tiles;
    const float score_scale_log2 = scale_log2e * descales[w.head * q_scale_tiles + q_scale_tile];
    w.k_descales = kv_descales + w.head * key_tiles;
    w.v_descales = kv_descales + (heads + w.head) * key_tiles;
    // Whether a consumer's logits may pass one HFMA2's reach, which picks its loop. Asked before
    // the setup, its loads overlap it (asked after it, ptxas spills in the loop); the producer
    // does not ask, so thread 0 loads Q and fills the ring at once.
    bool wide = false;
    if constexpr (Cfg::SCORES_ARE_FP16)
        if (!1 || threadIdx.x >= WARPGROUP_THREADS) wide = logits_may_be_wide<HEAD_DIM>(w, score_scale_log2);

    if (threadIdx.x == 0) {
        mbarrier_init(smem.q_full, 1);
        for (int i = 0; i < Cfg::STAGES; i++) {
            mbarrier_init(&smem.kv_full[i], 1);
            mbarrier_init(&smem.kv_empty[i], Cfg::CONSUMER_WARPS);
        }
        fence_mbarrier_init();
        mbarrier_arrive_expect_bytes(smem.q_full, Cfg::Q_BYTES);
        for (int slice = 0; slice < Cfg::QK_SLICES; slice++)
            tma_load(smem.q_tile + slice * Cfg::BLOCK_Q * Cfg::QK_SLICE, &q_map, smem.q_full, slice * Cfg::QK_SLICE,
                     w.query0, w.head);
        // The ring's first tiles, at once; the producer refills it.
        for (int tile = 0; tile < min(Cfg::STAGES, w.kv_tiles); tile++) load_kv_tile<HEAD_DIM>(smem, w, tile);
    }
    __syncthreads();  // the barriers are initialised before anyone waits on them

    const int warpgroup = threadIdx.x / WARPGROUP_THREADS;
    // Warp specialisation: warpgroup 0 only copies and gives most of its registers to the
    // consumer warpgroups, which only compute.
    if (warpgroup == 0) {
        setmaxnreg_dec<PRODUCER_REGISTERS>();
        if (threadIdx.x == 0) produce<HEAD_DIM>(smem, w);
    } else {
        setmaxnreg_inc<Cfg::CONSUMER_REGISTERS>();
        consume_by_reach<HEAD_DIM>(smem, w, warpgroup - 1, score_scale_log2, o, lse, wide);
    }
}

// --- Quantisation: e4m3 copies, one scale per tile of each (b, h) and tensor ----------------
// A scale per tile rather than per (b, h) makes the quantisation one pass: a block reads its
// tile once, finds its max |x|, and writes the e4m3 copy and the descale. It is also finer: one
// outlier costs the resolution of its tile, not of the whole head. Q's tile is Q_SCALE_ROWS
// rows (a consumer warpgroup's 64 rows lie in one), K's and V's the key tile of one iteration
// (BLOCK_KV rows): the kernel applies each descale once per tile. A block of BLOCK_KV * HEAD_DIM /
// 128 threads quantises a tile, each thread up to 16 vectors of 8 halves (a key tile fills them all).
#define KEY_GROUP 16         // V's keys are permuted within groups of 16 (key_slot)
#define VECTORS_A_THREAD 16  // of 8 halves, in the quantisation

// x * scale maps |x| <= amax onto [-range, range] (e4m3's whole range: 448); the descale undoes it.
__host__ __device__ float e4m3_scale(float amax, float range) { return amax > 0 ? range / amax : 1.0f; }
__host__ __device__ float e4m3_descale(float amax, float range) { return amax > 0 ? amax / range : 1.0f; }

// Two floats, times scale, to two e4m3 bytes (cvt.rn.satfinite: round to nearest even, clamp at 448).
__device__ unsigned to_e4m3x2(float a, float b, float scale) {
    return __nv_cvt_float2_to_fp8x2(make_float2(a * scale, b * scale), __NV_SATFINITE, __NV_E4M3);
}

// 8 halves to 8 e4m3 bytes.
__device__ uint2 to_e4m3x8(uint4 halves, float scale) {
    const __half2 *pairs = (const __half2 *)&halves;
    unsigned packed[4];
    for (int j = 0; j < 4; j++) {
        float2 f = __half22float2(pairs[j]);
        packed[j] = to_e4m3x2(f.x, f.y, scale);
    }
    return make_uint2(packed[0] | packed[1] << 16, packed[2] | packed[3] << 16);
}

__device__ float half_at(const uint4 &halves, int i) { return __half2float(((const __half *)&halves)[i]); }

// Max |x| over the block's tile, which its threads hold in registers as 8-half vectors.
template <int BLOCK_THREADS, int VECTORS>
__device__ float tile_amax(const uint4 (&tile)[VECTORS]) {
    __shared__ float warp_max[BLOCK_THREADS / 32];
    __half2 largest = __float2half2_rn(0.0f);
    for (int i = 0; i < VECTORS; i++)
        for (int j = 0; j < 4; j++) largest = __hmax2(largest, __habs2(((const __half2 *)&tile[i])[j]));
    float m = fmaxf(__low2float(largest), __high2float(largest));
    for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, offset));
    if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
    __syncthreads();
    m = warp_max[0];
    for (int w = 1; w < BLOCK_THREADS / 32; w++) m = fmaxf(m, warp_max[w]);
    return m;
}

// Where key k of a 16-key group goes in Vt. The QK^T accumulator gives a thread, of each row,
// keys {2t, 2t+1, 2t+8, 2t+9} of every 16 (t = lane % 4); the A operand of PV wants it to hold
// positions {4t..4t+3}. Storing key 8h + 2t + e at position 4t + 2h + e makes the two agree:
// the permutation is folded into V once, and P never moves between registers.
__host__ __device__ constexpr int key_slot(int key) {
    const int k = key % KEY_GROUP, half_of_16 = k / 8, pair = k / 2 % 4, odd = k % 2;
    return key - k + 4 * pair + 2 * half_of_16 + odd;
}

// Q or K: the tile's rows in the same layout, in e4m3. Thread t holds vectors t, t + threads, ...
template <int HEAD_DIM, int BLOCK_THREADS>
__device__ void quantize_rows(const uint4 *src, uint2 *dst, int rows, uint4 (&tile)[VECTORS_A_THREAD], float *descale) {
    constexpr int VECTORS_PER_ROW = HEAD_DIM / 8;
    for (int i = 0; i < VECTORS_A_THREAD; i++) {
        const int vector = threadIdx.x + i * BLOCK_THREADS;
        tile[i] = vector < rows * VECTORS_PER_ROW ? src[vector] : make_uint4(0, 0, 0, 0);
    }
    const float range = Config<HEAD_DIM>::QK_RANGE;
    const float amax = tile_amax<BLOCK_THREADS>(tile), scale = e4m3_scale(amax, range);
    if (threadIdx.x == 0) *descale = e4m3_descale(amax, range);
    for (int i = 0; i < VECTORS_A_THREAD; i++) {
        const int vector = threadIdx.x + i * BLOCK_THREADS;
        if (vector < rows * VECTORS_PER_ROW) dst[vector] = to_e4m3x8(tile[i], scale);
    }
}

// V, transposed: wgmma's 8-bit B operand must be K-major (keys fastest). Thread t takes one
// 16-key group (t % groups) of 8 dimensions (t / groups): 16 row loads in, 8 rows of 16 keys out, each
// one 16-byte store with the keys in key_slot order: the transpose happens in registers.
template <int HEAD_DIM, int BLOCK_THREADS>
__device__ void quantize_transposed(const uint4 *src, unsigned char *vt_tile, int rows, int keys_padded,
                                    int seqlen_padded, uint4 (&tile)[VECTORS_A_THREAD], float *descale) {
    constexpr int VECTORS_PER_ROW = HEAD_DIM / 8, GROUPS = BLOCK_THREADS / VECTORS_PER_ROW;
    static_assert(VECTORS_A_THREAD == KEY_GROUP, "one (group, 8 dims) a thread");
    const int group = threadIdx.x % GROUPS, dim0 = threadIdx.x / GROUPS * 8, key0 = group * KEY_GROUP;
    for (int i = 0; i < KEY_GROUP; i++)
        tile[i] = key0 + i < rows ? src[(key0 + i) * VECTORS_PER_ROW + dim0 / 8] : make_uint4(0, 0, 0, 0);
    const float amax = tile_amax<BLOCK_THREADS>(tile), scale = e4m3_scale(amax, E4M3_MAX);
    if (threadIdx.x == 0) *descale = e4m3_descale(amax, E4M3_MAX);
    if (key0 >= keys_padded) return;  // Vt's row ends before this group
#pragma unroll
    for (int d = 0; d < 8; d++) {
        __align__(16) unsigned short pairs[KEY_GROUP / 2];  // keys 2p, 2p+1 land side by side in key_slot order
#pragma unroll
        for (int p = 0; p < KEY_GROUP / 2; p++)
            pairs[key_slot(2 * p) / 2] = to_e4m3x2(half_at(tile[2 * p], d), half_at(tile[2 * p + 1], d), scale);
        *(uint4 *)(vt_tile + (size_t)(dim0 + d) * seqlen_padded + key0) = *(const uint4 *)pairs;
    }
}

// One tile of Q (blockIdx.z 0: a query tile, BLOCK_Q rows), K (1) or V (2: key tiles, BLOCK_KV
// rows; V transposed to [b*h][HEAD_DIM][seqlen_padded], zeros past seqlen), read once, and its
// descale into Q's [b*h][query tiles] or K's and V's [b*h][key tiles] after them. A block has the
// threads a key tile needs; a query tile, no larger, leaves some of their vector slots empty.
template <int HEAD_DIM>
__global__ void __launch_bounds__(Config<HEAD_DIM>::BLOCK_KV *HEAD_DIM / 128)
    quantize_kernel(const __half *q, const __half *k, const __half *v, float *descales, unsigned char *q8,
                    unsigned char *k8, unsigned char *vt8, int seqlen, int seqlen_padded) {
    constexpr int BLOCK_KV = Config<HEAD_DIM>::BLOCK_KV, BLOCK_THREADS = BLOCK_KV * HEAD_DIM / 128;
    static_assert(BLOCK_THREADS * VECTORS_A_THREAD * 8 == BLOCK_KV * HEAD_DIM,
                  "16 vectors a thread: all of a key tile");
    const int tensor = blockIdx.z, tile_rows = tensor ? BLOCK_KV : Q_SCALE_ROWS, heads = gridDim.y;
    const int query_tiles = gridDim.x, key_tiles = ceil_div(seqlen, BLOCK_KV);
    if (tensor && blockIdx.x >= key_tiles) return;  // the grid spans the query tiles, which are more
    const int row0 = blockIdx.x * tile_rows, rows = min(tile_rows, seqlen - row0);
    const size_t head = blockIdx.y, first = (head * seqlen + row0) * HEAD_DIM;  // the tile's first element
    float *descale = tensor ? &descales[heads * query_tiles + ((tensor - 1) * heads + head) * key_tiles + blockIdx.x]
                            : &descales[head * query_tiles + blockIdx.x];
    uint4 tile[VECTORS_A_THREAD];
    if (tensor < 2)
        quantize_rows<HEAD_DIM, BLOCK_THREADS>((const uint4 *)((tensor ? k : q) + first),
                                               (uint2 *)((tensor ? k8 : q8) + first), rows, tile, descale);
    else
        quantize_transposed<HEAD_DIM, BLOCK_THREADS>((const uint4 *)(v + first),
                                                     vt8 + head * HEAD_DIM * seqlen_padded + row0, rows,
                                                     seqlen_padded - row0, seqlen_padded, tile, descale);
}

// --- Launchers -------------------------------------------------------------------------------
// What the attention kernel reads: the workspace, which holds the descales (Q's [b*h][query
// tiles], then K's and V's [2][b*h][key tiles]), then Q and K in e4m3 ([b*h][N][D]), then Vt
// ([b*h][D][N_padded]).
typedef struct {
    float *descales;
    unsigned char *q, *k, *v;  // v is Vt
    int seqlen_padded;         // Vt's rows are padded to 16 keys, since TMA needs row strides of 16 bytes
} Workspace;

// The key tile of a head dim (the harness has refused any other).
static int key_tile(int headdim) { return headdim == 64 ? Config<64>::BLOCK_KV : Config<128>::BLOCK_KV; }

static size_t descale_bytes(const AttnShape *shape) {
    const size_t count =
        (size_t)shape->batch * shape->heads *
        (ceil_div(shape->seqlen, Q_SCALE_ROWS) + 2 * ceil_div(shape->seqlen, key_tile(shape->headdim)));
    return (count * sizeof(float) + 255) / 256 * 256;  // the e4m3 copies start 256-byte aligned
}

static Workspace workspace_layout(const AttnArgs *args) {
    const AttnShape *shape = &args->shape;
    const size_t qk_bytes = (size_t)shape->batch * shape->heads * shape->seqlen * shape->headdim;
    Workspace w;
    w.seqlen_padded = ceil_div(shape->seqlen, 16) * 16;
    w.descales = (float *)args->workspace;
    w.q = (unsigned char *)args->workspace + descale_bytes(shape);
    w.k = w.q + qk_bytes;
    w.v = w.k + qk_bytes;
    return w;
}

static size_t workspace_bytes(const AttnShape *shape) {
    const size_t heads = (size_t)shape->batch * shape->heads;
    const size_t vt_bytes = heads * shape->headdim * (ceil_div(shape->seqlen, 16) * 16);
    return descale_bytes(shape) + 2 * heads * shape->seqlen * shape->headdim + vt_bytes;
}

template <int HEAD_DIM>
static cudaError_t quantize(const AttnArgs *args, cudaStream_t stream) {
    const AttnShape *shape = &args->shape;
    const Workspace w = workspace_layout(args);
    dim3 grid(ceil_div(shape->seqlen, Q_SCALE_ROWS), shape->batch * shape->heads, 3);  // as many as key tiles, or more
    quantize_kernel<HEAD_DIM><<<grid, Config<HEAD_DIM>::BLOCK_KV * HEAD_DIM / 128, 0, stream>>>(
        args->q, args->k, args->v, w.descales, w.q, w.k, w.v, shape->seqlen, w.seqlen_padded);
    return cudaGetLastError();
}

// The chapter's prepare step: the e4m3 copies of Q, K, V and their descales, in one kernel.
static cudaError_t prepare(const AttnArgs *args, cudaStream_t stream) {
    return launch_for_head_dim(args, stream, quantize<64>, quantize<128>);
}

template <int HEAD_DIM>
static cudaError_t launch(const AttnArgs *args, cudaStream_t stream) {
    typedef Config<HEAD_DIM> Cfg;
    const AttnShape *shape = &args->shape;
    const Workspace w = workspace_layout(args);
    const int heads = shape->batch * shape->heads, tiles = ceil_div(shape->seqlen, Cfg::BLOCK_Q);
    const int row_bytes = HEAD_DIM * ELEMENT_BYTES;
    CUtensorMap q_map, k_map, v_map;
    RETURN_IF_ERROR(
        make_tensor_map(&q_map, w.q, row_bytes, shape->seqlen, heads, Cfg::QK_SLICE, Cfg::BLOCK_Q, chapter.name));
    RETURN_IF_ERROR(
        make_tensor_map(&k_map, w.k, row_bytes, shape->seqlen, heads, Cfg::QK_SLICE, Cfg::BLOCK_KV, chapter.name));
    RETURN_IF_ERROR(make_tensor_map(&v_map, w.v, w.seqlen_padded * ELEMENT_BYTES, HEAD_DIM, heads, Cfg::V_SLICE,
                                    HEAD_DIM, chapter.name));
    RETURN_IF_ERROR(
        cudaFuncSetAttribute(attention_kernel<HEAD_DIM>, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::SMEM_BYTES));
    dim3 grid = shape->causal ? dim3(heads, tiles) : dim3(tiles, heads);
    attention_kernel<HEAD_DIM><<<grid, Cfg::THREADS, Cfg::SMEM_BYTES, stream>>>(
        q_map, k_map, v_map, w.descales, args->o, args->lse, shape->seqlen, heads, shape->scale * LOG2E, shape->causal);
    return cudaGetLastError();
}

static cudaError_t forward(const AttnArgs *args, cudaStream_t stream) {
    return launch_for_head_dim(args, stream, launch<64>, launch<128>);
}

// The check's scale tiles, as the quantisation makes them: Q per Q_SCALE_ROWS rows (which 0), K
// and V per key tile of the head dim (1).
static int fp8_scale_rows(int headdim, int which) { return which == 0 ? Q_SCALE_ROWS : key_tile(headdim); }

// The largest |e4m3| Q and K are scaled to, by head dim (V's is always 448).
static int fp8_qk_range(int headdim) { return (int)(headdim == 128 ? Config<128>::QK_RANGE : Config<64>::QK_RANGE); }

static const Fp8Scaling fp8_scaling = {fp8_scale_rows, fp8_qk_range};  // for the check's floor

// The chapter's name, what it adds and its precision (its steps before it: step1_*.cu ... step5_*.cu).
const Chapter chapter = {
    "08_fp8",
    "FP8 e4m3 with per-tile scales on Hopper's wgmma fed by TMA: warp-specialised, softmax under the MMAs",
    PRECISION_FP8_TC,
    90,
    90,  // sm_90 only: wgmma is an sm_90a feature, and sm_90a code runs on no other GPU
    workspace_bytes,
    prepare,  // quantise Q, K, V to e4m3 (timed with the forward and on its own)
    forward,
    &fp8_scaling,  // one scale per 128 rows of Q and per key tile of K and of V; Q, K to |x| <= 16 at D = 128
};
