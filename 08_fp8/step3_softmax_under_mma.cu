// 08.3, step 3 of 08_fp8: the softmax under the tensor cores. The consumer warpgroups take turns
// issuing their products (ping-pong, named barriers), and each issues the P V of tile j-1 right
// behind the Q K^T of tile j, so that it runs during tile j's softmax. Otherwise 08.2: a TMA
// producer warpgroup, consumers on wgmma (hopper.h), fp16 operands.
//
// attention_kernel: one block per (query tile, b*h), heaviest causal tiles first (as 05), a
// producer warpgroup and one consumer warpgroup per 64 query rows. Shared memory: the Q tile and a
// ring of STAGES (K, V) tile pairs of BLOCK_KV keys, in the swizzled layout TMA writes and wgmma
// reads. Registers: per consumer the 64 x BLOCK_KV scores, the 64 x HEAD_DIM output accumulator, P
// (of the tile before, while its P V runs) as the A operand of P V, each row's running max and sum.
#include <stdio.h>

#include "../common/harness.h"
#include "hopper.h"

// --- Configuration -------------------------------------------------------------------------
#define WARPGROUP_THREADS 128
#define WARPGROUP_ROWS 64  // query rows per consumer warpgroup: wgmma's M
#define STAGES_D128 3      // (K, V) tile pairs in flight, by head dim: chosen by a sweep
#define STAGES_D64 4
#define ELEMENT_BYTES 2                      // of an operand: fp16
#define KSTEP_BYTES 32                       // of the reduced dimension per wgmma, for every type
#define MMA_K (KSTEP_BYTES / ELEMENT_BYTES)  // elements of it: 16 fp16
#define SLICE_BYTES 128                      // the widest swizzle: longer rows are stored as 128-byte slices
#define P_SCALE_LOG2 8.0f                    // P is stored as 256 p: small p stay normal numbers
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
#define PRODUCER_REGISTERS 24  // setmaxnreg: the producer keeps few registers (the consumers' share is in Config)

template <int HEAD_DIM>
struct Config {
    static constexpr int CONSUMERS = 2;
    static constexpr int BLOCK_Q = CONSUMERS * WARPGROUP_ROWS;  // query rows per block
    // Keys per tile (wgmma's N for Q K^T): as many as the score registers allow, by measurement.
    static constexpr int BLOCK_KV = 128;
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
    static constexpr bool SOFTMAX_UNDER_PV = false;
    static constexpr int SCORE_REGS = BLOCK_KV / 2;  // a thread's, for 64 x BLOCK_KV
    static constexpr int Q_BYTES = BLOCK_Q * HEAD_DIM * ELEMENT_BYTES;
    static constexpr int K_BYTES = BLOCK_KV * HEAD_DIM * ELEMENT_BYTES;
    static constexpr int V_BYTES = HEAD_DIM * BLOCK_KV * ELEMENT_BYTES;
    // Rows of Q and K (HEAD_DIM elements) are stored in slices of at most 128 bytes, each slice a
    // [rows][slice] tile in its swizzle: one TMA box each.
    static constexpr int QK_SLICE = HEAD_DIM * ELEMENT_BYTES < SLICE_BYTES ? HEAD_DIM * ELEMENT_BYTES : SLICE_BYTES;
    static constexpr int QK_SLICES = HEAD_DIM * ELEMENT_BYTES / QK_SLICE;
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
    wgmma_m64n128k16_f16_ss(score, q_desc, k_desc, accumulate);
}

template <int HEAD_DIM>
__device__ void wgmma_pv(float (&o_acc)[HEAD_DIM / 2], const unsigned (&p)[4], uint64_t v_desc) {
    if constexpr (HEAD_DIM == 128) wgmma_m64n128k16_f16_rs(o_acc, p, v_desc);
    else wgmma_m64n64k16_f16_rs(o_acc, p, v_desc);
}

// --- The block's shared memory and work ---------------------------------------------------
struct Smem {
    unsigned char *q_tile;  // [BLOCK_Q][HEAD_DIM]
    unsigned char *k_ring;  // [STAGES][BLOCK_KV][HEAD_DIM]
    unsigned char *v_ring;  // [STAGES][BLOCK_KV][HEAD_DIM]
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
    int head, query0, kv_tiles, seqlen, causal;
};

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
    // V in K's layout: [slice][key][128 bytes of dims]
    for (int slice = 0; slice < Cfg::QK_SLICES; slice++)
        tma_load(smem.v_ring + stage * Cfg::V_BYTES + slice * Cfg::BLOCK_KV * Cfg::QK_SLICE, w.v_map,
                 &smem.kv_full[stage], slice * Cfg::QK_SLICE, tile * Cfg::BLOCK_KV, w.head);
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

// O += P V: P from registers, V from shared memory (MN-major: as it lies in memory); issued.
template <int HEAD_DIM>
__device__ void issue_pv(float (&o_acc)[HEAD_DIM / 2], const unsigned (&p_frag)[Config<HEAD_DIM>::BLOCK_KV / MMA_K][4],
                         const unsigned char *v_tile) {
    typedef Config<HEAD_DIM> Cfg;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Cfg::BLOCK_KV / MMA_K; kk++)
        wgmma_pv<HEAD_DIM>(
            o_acc, p_frag[kk],
            smem_descriptor_mn_major(v_tile + kk * MMA_K * Cfg::QK_SLICE, Cfg::BLOCK_KV * Cfg::QK_SLICE));
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

__device__ unsigned pack_half2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *(unsigned *)&h;
}

// P to fp16, in the A-operand layout, which for 16-bit types is the accumulator's own: per 16
// keys (n8 chunks c, c + 1), rows g and g + 8 of keys 2t, 2t+1 of each chunk. V keeps key order.
template <int SCORES>
__device__ void pack_p(const float (&score)[SCORES], unsigned (&p_frag)[2 * SCORES / MMA_K][4]) {
#pragma unroll
    for (int kk = 0; kk < 2 * SCORES / MMA_K; kk++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int chunk = 2 * kk + i / 2, r = i % 2;  // n8 chunk `chunk`, row g + 8r
            p_frag[kk][i] = pack_half2(score[4 * chunk + 2 * r], score[4 * chunk + 2 * r + 1]);
        }
}

// O times each row's rescale, before the next P V.
template <int HEAD_DIM, typename Warpgroup>
__device__ void rescale_output(Warpgroup &wg) {
    const float factor[2] = {wg.rescale[0], wg.rescale[1]};
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
template <int HEAD_DIM>
struct Consumer {
    float o_acc[HEAD_DIM / 2];                               // O, unnormalised
    float score[Config<HEAD_DIM>::SCORE_REGS];               // S, then 2^8 p
    unsigned p_frag[Config<HEAD_DIM>::BLOCK_KV / MMA_K][4];  // P, the A operand of P V
    float row_max[2], row_sum[2], rescale[2];
    const unsigned char *q_rows;  // the warpgroup's 64 rows of the Q tile
    int group, group_query0, row0;
    float score_scale_log2;  // the softmax scale in log2 units
};

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
    const float scale_log2 = wg.score_scale_log2;
    softmax_tile(wg.score, wg.row_max, wg.row_sum, wg.rescale, scale_log2);
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
    for (int i = 0; i < HEAD_DIM / 2; i++) wg.o_acc[i] = 0.0f;
    for (int r = 0; r < 2; r++) {
        wg.row_max[r] = -INFINITY;
        wg.row_sum[r] = 0.0f;
    }
    mbarrier_wait(smem.q_full, 0);
    if (group == Cfg::CONSUMERS - 1) pass_turn(group, Cfg::CONSUMERS);  // warpgroup 0 goes first

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

    // O = accumulator / sum, LSE = ln(sum) + max (p was scaled by 2^8), once each.
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int query = wg.row0 + 8 * r;
        const float sum = quad_sum(wg.row_sum[r]), scale_out = 1.0f / sum;
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

    const float score_scale_log2 = scale_log2e;  // (descales: NULL, fp16 operands have none)

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
        consume<HEAD_DIM, Consumer<HEAD_DIM>>(smem, w, warpgroup - 1, score_scale_log2, o, lse);
    }
}

// --- Launchers -------------------------------------------------------------------------------
// What the attention kernel reads: on fp16 operands, the inputs themselves.
typedef struct {
    float *descales;
    unsigned char *q, *k, *v;
    int seqlen_padded;
} Workspace;

static Workspace workspace_layout(const AttnArgs *args) {  // nothing to prepare: the kernel reads the inputs
    Workspace w;
    w.descales = NULL;
    w.q = (unsigned char *)args->q;
    w.k = (unsigned char *)args->k;
    w.v = (unsigned char *)args->v;
    w.seqlen_padded = args->shape.seqlen;
    return w;
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
    RETURN_IF_ERROR(
        make_tensor_map(&v_map, w.v, row_bytes, shape->seqlen, heads, Cfg::QK_SLICE, Cfg::BLOCK_KV, chapter.name));
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

// The step's name, the idea it adds and its precision (08_fp8/attention.cu is the last step).
const Chapter chapter = {
    "08.3",  "the softmax under the tensor cores: ping-pong and intra-warpgroup overlap", PRECISION_FP16_TC, 90,
    90,    // sm_90 only: wgmma is an sm_90a feature, and sm_90a code runs on no other GPU
    NULL,  // no workspace
    NULL,  // nothing to prepare
    forward,
};
