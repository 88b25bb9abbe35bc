// 10.2, step 2 of 10_backward_hopper: warp specialisation. A producer warpgroup only issues the
// TMA copies; two consumer warpgroups of 64 keys each share every Q and dO tile, so a block holds
// 128 keys and reads each query tile once for them. Otherwise 10.1.
//
// Three kernels, as 09: (1) D = rowsum(dO * O) and the fp32 dQ accumulator zeroed; (2) one block per
// (128-key tile, b*h): the producer brings K and V once and Q and dO of each 64-query tile through a
// ring of two stages (full and empty mbarriers); consumer c owns keys 64c..64c+63. Per query tile,
// each consumer: S^T = K Q^T and dP^T = V dO^T, P^T = exp(S^T * scale - LSE), dS^T = P^T * (dP^T - D),
// dS^T to shared memory, dV += P^T dO and dK += dS^T Q; then, once both consumers' dS^T are in, dQ +=
// dS K over the block's 128 keys, its 64-dim passes shared between the consumers, added into the fp32
// accumulator by atomics; (3) dQ to fp16. The forward is 07's (09's forward.h).
#include <stdio.h>

#include "../common/harness.h"
#include "../08_fp8/hopper.h"
#include "../09_backward/forward.h"

// --- Configuration -------------------------------------------------------------------------
#define WG_THREADS 128                                // threads of a warpgroup
#define WG_ROWS 64                                    // wgmma's M: a consumer's keys, and a query tile
#define CONSUMERS 2                                   // consumer warpgroups, 64 keys each
#define BLOCK_THREADS ((CONSUMERS + 1) * WG_THREADS)  // the producer, then the consumers
#define PRODUCER_REGISTERS 24                         // setmaxnreg: the producer keeps few registers
#define CONSUMER_REGISTERS 240                        // and the consumers take the rest
#define DS_BARRIER 1                                  // named barrier: both consumers' dS^T stored
#define BWD_STAGES 2                                  // (Q, dO) tiles in the ring
#define ELEMENT_BYTES 2                               // fp16
#define KSTEP_BYTES 32                                // of the reduced dimension per wgmma
#define WG_K (KSTEP_BYTES / ELEMENT_BYTES)            // 16 elements
#define SLICE_BYTES 128                               // rows are stored as 128-byte slices (the 128-byte swizzle)
#define SLICE_ELEMENTS (SLICE_BYTES / ELEMENT_BYTES)  // 64
#define WORKSPACE_ALIGN 256

template <int HEAD_DIM>
struct BwdConfig {
    static constexpr int TILE_KV = CONSUMERS * WG_ROWS, TILE_Q = WG_ROWS;  // keys per block, queries per step
    static constexpr int SLICES = HEAD_DIM / SLICE_ELEMENTS;               // 1 or 2
    static constexpr int Q_SLICE_STRIDE = TILE_Q * SLICE_BYTES;            // bytes of one slice of a query tile
    static constexpr int KV_SLICE_STRIDE = TILE_KV * SLICE_BYTES;          // of the block's K or V
    static constexpr int Q_TILE_BYTES = SLICES * Q_SLICE_STRIDE;           // a 64 x HEAD_DIM tile
    static constexpr int KV_TILE_BYTES = SLICES * KV_SLICE_STRIDE;         // a 128 x HEAD_DIM tile
    static constexpr int DS_BYTES = TILE_KV * TILE_Q * ELEMENT_BYTES;      // dS^T, [key][query]
    static constexpr int BARRIERS = 2 + 2 * BWD_STAGES;                    // K/V full and empty, each stage's
    static constexpr int COLUMN_FLOATS = CONSUMERS * 2 * 2 * TILE_Q;       // LSE and D, 2 buffers a consumer
    static constexpr int SMEM_BYTES = 1024 + 2 * KV_TILE_BYTES + 2 * BWD_STAGES * Q_TILE_BYTES + 2 * DS_BYTES +
                                      COLUMN_FLOATS * (int)sizeof(float) + BARRIERS * 8;
    static constexpr int SCORE_REGS = TILE_Q / 2;    // a thread's share of a 64 x 64 accumulator
    static constexpr int ACC_REGS_D = HEAD_DIM / 2;  // of a 64 x HEAD_DIM one
    static constexpr int DQ_PASSES = SLICES;         // dQ in passes of 64 dims: 32 registers each
    static_assert(HEAD_DIM % SLICE_ELEMENTS == 0, "whole 128-byte slices");
    static_assert(Q_TILE_BYTES % 1024 == 0 && KV_TILE_BYTES % 1024 == 0 && DS_BYTES % 1024 == 0,
                  "tiles 1024-byte aligned, as the swizzle needs");
    static_assert(SMEM_BYTES <= 227 * 1024, "the block's tiles exceed the 227 KiB of shared memory a block can have");
    static_assert(PRODUCER_REGISTERS * WG_THREADS + CONSUMERS * CONSUMER_REGISTERS * WG_THREADS <= 65536,
                  "the register file holds both roles");
};

// --- Shared memory ---------------------------------------------------------------------------
struct Smem {
    unsigned char *k_tile, *v_tile;   // [slice][key][128 bytes], swizzled as TMA writes them
    unsigned char *q_ring, *do_ring;  // [stage][slice][query][128 bytes]
    unsigned char *ds_tiles;          // two dS^T [key][query], one 128-byte row per key, swizzled by hand
    float *columns;                   // [consumer][buffer][LSE, D][query]: a query tile's LSE and D
    uint64_t *kv_full, *kv_empty;     // K and V landed; the consumers are done with them
    uint64_t *q_full, *q_empty;       // stage s's Q and dO landed; the consumers are done with stage s
};

template <int HEAD_DIM>
__device__ Smem smem_layout(unsigned char *raw) {
    typedef BwdConfig<HEAD_DIM> Cfg;
    Smem smem;
    smem.k_tile = (unsigned char *)(((uintptr_t)raw + 1023) & ~(uintptr_t)1023);
    smem.v_tile = smem.k_tile + Cfg::KV_TILE_BYTES;
    smem.q_ring = smem.v_tile + Cfg::KV_TILE_BYTES;
    smem.do_ring = smem.q_ring + BWD_STAGES * Cfg::Q_TILE_BYTES;
    smem.ds_tiles = smem.do_ring + BWD_STAGES * Cfg::Q_TILE_BYTES;
    smem.columns = (float *)(smem.ds_tiles + 2 * Cfg::DS_BYTES);
    smem.kv_full = (uint64_t *)(smem.columns + Cfg::COLUMN_FLOATS);
    smem.kv_empty = smem.kv_full + 1;
    smem.q_full = smem.kv_empty + 1;
    smem.q_empty = smem.q_full + BWD_STAGES;
    return smem;
}

// Writes by threads (dS^T) made visible to wgmma, which reads shared memory through the async proxy.
__device__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// --- TMA: tiles of 64-row boxes, slice by slice ---------------------------------------------
// `rows` rows (64 or 128) from row0 into a tile whose slices are slice_stride bytes apart.
template <int HEAD_DIM>
__device__ void load_tile(unsigned char *tile, int slice_stride, int rows, const CUtensorMap *map, uint64_t *barrier,
                          int row0, int head) {
    for (int slice = 0; slice < BwdConfig<HEAD_DIM>::SLICES; slice++)
        for (int box = 0; box < rows / WG_ROWS; box++)
            tma_load(tile + slice * slice_stride + box * WG_ROWS * SLICE_BYTES, map, barrier, slice * SLICE_BYTES,
                     row0 + box * WG_ROWS, head);
}

// Q and dO of the ring's tile `ring_tile` (query0 on) into its stage.
template <int HEAD_DIM>
__device__ void load_query_tile(const Smem &smem, const CUtensorMap *q_map, const CUtensorMap *do_map, int ring_tile,
                                int query0, int head) {
    typedef BwdConfig<HEAD_DIM> Cfg;
    const int stage = ring_tile % BWD_STAGES;
    mbarrier_arrive_expect_bytes(&smem.q_full[stage], 2 * Cfg::Q_TILE_BYTES);
    load_tile<HEAD_DIM>(smem.q_ring + stage * Cfg::Q_TILE_BYTES, Cfg::Q_SLICE_STRIDE, WG_ROWS, q_map,
                        &smem.q_full[stage], query0, head);
    load_tile<HEAD_DIM>(smem.do_ring + stage * Cfg::Q_TILE_BYTES, Cfg::Q_SLICE_STRIDE, WG_ROWS, do_map,
                        &smem.q_full[stage], query0, head);
}

// --- The products ----------------------------------------------------------------------------
// Where k-step ks (32 bytes of every row) of a K-major tile starts: in slice ks * 32 / 128.
__device__ unsigned kstep_address(const unsigned char *tile, int slice_stride, int ks) {
    return smem_address(tile) + ks * KSTEP_BYTES / SLICE_BYTES * slice_stride + ks * KSTEP_BYTES % SLICE_BYTES;
}

// acc (64 rows of `rows_tile` x 64 rows of `cols_tile`) = rows_tile cols_tile^T, both [row][dim]
// (K-major): S^T = K Q^T and dP^T = V dO^T, the keys a consumer's 64 rows of the block's K or V.
// Issued, not committed.
template <int HEAD_DIM>
__device__ void issue_transposed_scores(float (&acc)[32], const unsigned char *rows_tile,
                                        const unsigned char *cols_tile) {
    typedef BwdConfig<HEAD_DIM> Cfg;
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / WG_K; ks++)
        wgmma_m64n64k16_f16_ss(acc, smem_descriptor_at(kstep_address(rows_tile, Cfg::KV_SLICE_STRIDE, ks), SLICE_BYTES),
                               smem_descriptor_at(kstep_address(cols_tile, Cfg::Q_SLICE_STRIDE, ks), SLICE_BYTES),
                               ks > 0);
}

// acc (64 keys x HEAD_DIM) += a (64 keys x 64 queries, from registers) tile (64 queries x HEAD_DIM,
// [query][dim]: read MN-major): dV += P^T dO and dK += dS^T Q. Issued, not committed.
template <int HEAD_DIM>
__device__ void issue_key_gradient(float (&acc)[HEAD_DIM / 2], const unsigned (&a)[WG_ROWS / WG_K][4],
                                   const unsigned char *tile) {
#pragma unroll
    for (int kk = 0; kk < WG_ROWS / WG_K; kk++) {
        const uint64_t b =
            smem_descriptor_mn_major(tile + kk * WG_K * SLICE_BYTES, BwdConfig<HEAD_DIM>::Q_SLICE_STRIDE);
        if constexpr (HEAD_DIM == 128) wgmma_m64n128k16_f16_rs(acc, a[kk], b);
        else wgmma_m64n64k16_f16_rs(acc, a[kk], b);
    }
}

// dq (64 queries x the 64 dims of slice `slice`) = dS K over the block's 128 keys: dS read MN-major
// from dS^T [key][query], K read MN-major from [key][dim]. Issued, not committed.
template <int HEAD_DIM>
__device__ void issue_dq(float (&dq)[32], const unsigned char *ds_tile, const unsigned char *k_tile, int slice) {
    typedef BwdConfig<HEAD_DIM> Cfg;
#pragma unroll
    for (int kk = 0; kk < Cfg::TILE_KV / WG_K; kk++)
        wgmma_m64n64k16_f16_ss_mn_major(
            dq, smem_descriptor_mn_major(ds_tile + kk * WG_K * SLICE_BYTES, Cfg::DS_BYTES),
            smem_descriptor_mn_major(k_tile + slice * Cfg::KV_SLICE_STRIDE + kk * WG_K * SLICE_BYTES,
                                     Cfg::KV_SLICE_STRIDE),
            kk > 0);
}

// --- The softmax gradient on the accumulators ---------------------------------------------------
// Accumulator element 4c + 2r + e of thread t of its warpgroup: row 16 (t / 32) + t % 32 / 4 + 8r (a
// key), column 8c + 2 (t % 4) + e (a query).
__device__ int wg_thread() { return threadIdx.x % WG_THREADS; }
__device__ int acc_row(int r) { return wg_thread() / 32 * 16 + wg_thread() % 32 / 4 + 8 * r; }
__device__ int acc_col(int c, int e) { return 8 * c + 2 * (wg_thread() % 4) + e; }

// P^T = exp(S^T * scale - LSE), masked entries (key past the end, query past the end, or, causal,
// key after query) 0; then dS^T = P^T * (dP^T - D) in place of dP^T. LSE and D per column.
__device__ void softmax_gradient(float (&s)[32], float (&dp)[32], const float *lse_tile, const float *delta_tile,
                                 int key0, int query0, int seqlen, int causal, bool masked, float scale_log2) {
#pragma unroll
    for (int c = 0; c < 8; c++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int col = acc_col(c, e), query = query0 + col;
            const float lse_log2 = lse_tile[col] * LOG2E, delta = delta_tile[col];
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int i = 4 * c + 2 * r + e, key = key0 + acc_row(r);
                float p = exp2_approx(fmaf(s[i], scale_log2, -lse_log2));
                if (masked && (key >= seqlen || query >= seqlen || (causal && key > query))) p = 0.0f;
                s[i] = p;
                dp[i] = p * (dp[i] - delta);
            }
        }
}

// A 64 x 64 accumulator as the A operand of four k16 steps, fp16 (08's pack_p): register i of
// step kk holds chunk 2kk + i / 2, row + 8 (i % 2).
__device__ void pack_operand(unsigned (&a)[4][4], const float (&acc)[32]) {
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int chunk = 2 * kk + i / 2, r = i % 2;
            a[kk][i] = pack_half2(acc[4 * chunk + 2 * r], acc[4 * chunk + 2 * r + 1]);
        }
}

// A consumer's dS^T (as packed for dK) into its 64 rows of ds_tile, [key][query], each key's 64
// queries one 128-byte row in the 128-byte swizzle (16-byte chunk c of row k at c XOR k % 8), as wgmma
// reads it MN-major.
__device__ void store_ds(unsigned char *ds_tile, const unsigned (&ds)[4][4]) {
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int key = acc_row(i % 2), chunk = 2 * kk + i / 2;
            *(unsigned *)(ds_tile + key * SLICE_BYTES + (chunk ^ key % 8) * 16 + 4 * (wg_thread() % 4)) = ds[kk][i];
        }
}

// This pass's dQ partial (64 queries x 64 dims from dim0) added into the fp32 accumulator, two
// floats per atomic.
template <int HEAD_DIM>
__device__ void add_dq(float *dq_head, const float (&dq)[32], int query0, int dim0, int seqlen) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int query = query0 + acc_row(r);
        if (query >= seqlen) continue;
#pragma unroll
        for (int c = 0; c < 8; c++)
            atomicAdd((float2 *)(dq_head + (size_t)query * HEAD_DIM + dim0 + acc_col(c, 0)),
                      make_float2(dq[4 * c + 2 * r], dq[4 * c + 2 * r + 1]));
    }
}

// dK = scale * dS^T Q and dV, each key row written once, as fp16.
template <int HEAD_DIM>
__device__ void store_dk_dv(__half *dk_head, __half *dv_head, const float (&dk)[HEAD_DIM / 2],
                            const float (&dv)[HEAD_DIM / 2], int key0, int seqlen, float scale) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int key = key0 + acc_row(r);
        if (key >= seqlen) continue;
#pragma unroll
        for (int c = 0; c < HEAD_DIM / 8; c++) {
            const size_t at = (size_t)key * HEAD_DIM + acc_col(c, 0);
            *(unsigned *)&dk_head[at] = pack_half2(dk[4 * c + 2 * r] * scale, dk[4 * c + 2 * r + 1] * scale);
            *(unsigned *)&dv_head[at] = pack_half2(dv[4 * c + 2 * r], dv[4 * c + 2 * r + 1]);
        }
    }
}

// --- The kernels -------------------------------------------------------------------------------
// (1) D_i = sum_d dO[i, d] * O[i, d] in fp32, and row i of each copy of the dQ accumulator zeroed
// (09's). Grid: (row tiles, b*h); CHUNKS lanes per row, each with 8 of its D elements.
template <int HEAD_DIM>
__global__ void __launch_bounds__(THREADS) backward_preprocess_kernel(const __half *o, const __half *d_o, float *delta,
                                                                      float *dq_acc, int copies, int seqlen) {
    constexpr int CHUNKS = HEAD_DIM / CHUNK_HALVES, ROWS = THREADS / CHUNKS;
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

// What a block works on, and where its tiles come from.
struct Work {
    const CUtensorMap *q_map, *k_map, *v_map, *do_map;
    const float *lse_head, *delta_head;
    float *dq_head;  // the block's dQ accumulator (deterministic: its own copy)
    __half *dk_head, *dv_head;
    int head, seqlen, causal;
    float scale, scale_log2;
};

// The query tiles of the block's key tile `key_tile`: from the first whose queries see any of its keys
// (causal: the tile holding query key0), to the last.
template <int HEAD_DIM>
__device__ int first_query_tile(const Work &w, int key_tile) {
    return w.causal ? key_tile * BwdConfig<HEAD_DIM>::TILE_KV / BwdConfig<HEAD_DIM>::TILE_Q : 0;
}

// (2a) The producer (one thread): K and V of each key tile the block takes, and Q and dO of its query
// tiles through the ring, each stage refilled once the consumers have released it. `loaded`: the
// ring's tiles so far, over every key tile before (each stage's barriers complete once per tile).
template <int HEAD_DIM>
__device__ void produce_key_block(const Smem &smem, const Work &w, int key_tile, int round, int &loaded) {
    typedef BwdConfig<HEAD_DIM> Cfg;
    const int first_tile = first_query_tile<HEAD_DIM>(w, key_tile);
    const int q_tiles = ceil_div(w.seqlen, Cfg::TILE_Q) - first_tile;
    if (round > 0) mbarrier_wait(smem.kv_empty, (round - 1) % 2);  // the consumers are done with the last K, V
    mbarrier_arrive_expect_bytes(smem.kv_full, 2 * Cfg::KV_TILE_BYTES);
    load_tile<HEAD_DIM>(smem.k_tile, Cfg::KV_SLICE_STRIDE, Cfg::TILE_KV, w.k_map, smem.kv_full, key_tile * Cfg::TILE_KV,
                        w.head);
    load_tile<HEAD_DIM>(smem.v_tile, Cfg::KV_SLICE_STRIDE, Cfg::TILE_KV, w.v_map, smem.kv_full, key_tile * Cfg::TILE_KV,
                        w.head);
    for (int step = 0; step < q_tiles; step++) {
        const int ring_tile = loaded + step;
        if (ring_tile >= BWD_STAGES)
            mbarrier_wait(&smem.q_empty[ring_tile % BWD_STAGES], (ring_tile / BWD_STAGES - 1) % 2);
        load_query_tile<HEAD_DIM>(smem, w.q_map, w.do_map, ring_tile, (first_tile + step) * Cfg::TILE_Q, w.head);
    }
    loaded += q_tiles;
}

// A consumer is done with a barrier's resource: each of its warps arrives once.
__device__ void release(uint64_t *barrier) {
    __syncwarp();
    if (threadIdx.x % 32 == 0) mbarrier_arrive(barrier);
    __syncwarp();
}

// The query tile's LSE (threads 0-63 of the consumer) and D (64-127) into the consumer's buffer;
// past the end 0 (those queries are masked). Then the consumer's warps wait for each other.
template <int HEAD_DIM>
__device__ float *load_columns(const Smem &smem, const Work &w, int consumer, int ring_tile, int query0) {
    constexpr int TILE_Q = BwdConfig<HEAD_DIM>::TILE_Q;
    float *columns = smem.columns + (consumer * 2 + ring_tile % 2) * 2 * TILE_Q;  // [LSE, D][query]
    const int col = wg_thread() % TILE_Q, query = query0 + col;
    const float *from = wg_thread() < TILE_Q ? w.lse_head : w.delta_head;
    columns[wg_thread()] = query < w.seqlen ? from[query] : 0.0f;
    bar_sync<WG_THREADS>(2 + consumer);  // (two buffers: every warp is past the tile before last's reads)
    return columns;
}

// (2b) Consumer `consumer`: dK and dV of keys 64 consumer.. of the key tile, and its share of dQ.
template <int HEAD_DIM>
__device__ void consume_key_block(const Smem &smem, const Work &w, int consumer, int key_tile, int round, int &loaded) {
    typedef BwdConfig<HEAD_DIM> Cfg;
    const int key0 = key_tile * Cfg::TILE_KV + consumer * WG_ROWS;  // this consumer's keys
    const int first_tile = first_query_tile<HEAD_DIM>(w, key_tile);
    const int q_tiles = ceil_div(w.seqlen, Cfg::TILE_Q) - first_tile;
    const unsigned char *k_rows = smem.k_tile + consumer * WG_ROWS * SLICE_BYTES;
    const unsigned char *v_rows = smem.v_tile + consumer * WG_ROWS * SLICE_BYTES;

    // On chip for the whole loop: dK and dV of the consumer's 64 keys.
    float dk_acc[Cfg::ACC_REGS_D], dv_acc[Cfg::ACC_REGS_D];
    for (int i = 0; i < Cfg::ACC_REGS_D; i++) dk_acc[i] = dv_acc[i] = 0.0f;
    mbarrier_wait(smem.kv_full, round % 2);

    for (int step = 0; step < q_tiles; step++) {
        const int ring_tile = loaded + step, stage = ring_tile % BWD_STAGES;
        const int query0 = (first_tile + step) * Cfg::TILE_Q;
        const unsigned char *q_tile = smem.q_ring + stage * Cfg::Q_TILE_BYTES;
        const unsigned char *do_tile = smem.do_ring + stage * Cfg::Q_TILE_BYTES;
        unsigned char *ds_tile = smem.ds_tiles + ring_tile % 2 * Cfg::DS_BYTES;  // two: one barrier a tile
        const float *columns = load_columns<HEAD_DIM>(smem, w, consumer, ring_tile, query0);
        mbarrier_wait(&smem.q_full[stage], ring_tile / BWD_STAGES % 2);

        // S^T = K Q^T and dP^T = V dO^T, both 64 keys x 64 queries.
        float s[Cfg::SCORE_REGS], dp[Cfg::SCORE_REGS];
        wgmma_fence();
        issue_transposed_scores<HEAD_DIM>(s, k_rows, q_tile);
        issue_transposed_scores<HEAD_DIM>(dp, v_rows, do_tile);
        wgmma_commit();
        wgmma_wait<0>();
        hold_registers(s);
        hold_registers(dp);

        // P^T and dS^T; the mask only on a ragged tile or (causal) one that reaches past the diagonal.
        const bool masked =
            query0 + Cfg::TILE_Q > w.seqlen || key0 + WG_ROWS > w.seqlen || (w.causal && key0 + WG_ROWS - 1 > query0);
        softmax_gradient(s, dp, columns, columns + Cfg::TILE_Q, key0, query0, w.seqlen, w.causal, masked, w.scale_log2);
        unsigned p_frag[4][4], ds_frag[4][4];
        pack_operand(p_frag, s);
        pack_operand(ds_frag, dp);
        store_ds(ds_tile + consumer * WG_ROWS * SLICE_BYTES, ds_frag);  // before the wgmmas below read ds_frag
        fence_proxy_async();

        // dV += P^T dO and dK += dS^T Q, from registers.
        wgmma_fence();
        issue_key_gradient<HEAD_DIM>(dv_acc, p_frag, do_tile);
        issue_key_gradient<HEAD_DIM>(dk_acc, ds_frag, q_tile);
        wgmma_commit();
        bar_sync<CONSUMERS * WG_THREADS>(DS_BARRIER);  // both consumers' dS^T are in

        // dQ += dS K over the block's 128 keys, 64 dims a pass: pass k of the tile goes to consumer
        // (tile's passes + k) % 2 (D = 128: one pass each; D = 64: the tiles in turn).
#pragma unroll
        for (int pass = 0; pass < Cfg::DQ_PASSES; pass++) {
            if ((ring_tile * Cfg::DQ_PASSES + pass) % CONSUMERS != consumer) continue;
            float dq[32];
            wgmma_fence();
            issue_dq<HEAD_DIM>(dq, ds_tile, smem.k_tile, pass);
            wgmma_commit();
            wgmma_wait<0>();
            hold_registers(dq);
            add_dq<HEAD_DIM>(w.dq_head, dq, query0, pass * SLICE_ELEMENTS, w.seqlen);
        }
        wgmma_wait<0>();
        hold_registers(dv_acc);
        hold_registers(dk_acc);
        hold_registers(p_frag);
        hold_registers(ds_frag);
        release(&smem.q_empty[stage]);  // this stage's Q and dO are read
    }
    loaded += q_tiles;
    release(smem.kv_empty);  // K and V are read (the last dQ pass was waited for)
    store_dk_dv<HEAD_DIM>(w.dk_head, w.dv_head, dk_acc, dv_acc, key0, w.seqlen, w.scale);
}

// The key tile of a block's round `round`, -1 past its last. Default: one round, the block's own
// key tile (grid (key tiles, b*h); causal (b*h, key tiles), the heaviest first). Deterministic
// (09.8's): grid (copies, b*h); block `copy` takes one of every `copies` key tiles, one after the
// other, back and forth (copy, 2 copies - 1 - copy, ...), into a dQ copy that no other block
// writes. An address of it is added to by one thread per round, the rounds ordered by the consumers'
// named barrier (at D = 64 the two consumers take a round's dQ in turn), and the convert kernel sums
// the copies in order, so dQ comes out the same on every run.
template <bool DETERMINISTIC>
__device__ int round_key_tile(int round, int key_tiles, int causal) {
    if constexpr (!DETERMINISTIC) return round > 0 ? -1 : (int)(causal ? blockIdx.y : blockIdx.x);
    const int copies = gridDim.x, copy = blockIdx.x;
    const int key_tile = round * copies + (round % 2 ? copies - 1 - copy : copy);
    return key_tile < key_tiles ? key_tile : -1;
}

template <int HEAD_DIM, bool DETERMINISTIC>
__global__ void __launch_bounds__(BLOCK_THREADS, 1)
    backward_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                    const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap do_map,
                    const float *lse, const float *delta, float *dq_acc, __half *dk, __half *dv, int seqlen,
                    float scale, float scale_log2, int causal) {
    extern __shared__ unsigned char raw_smem[];
    const Smem smem = smem_layout<HEAD_DIM>(raw_smem);
    const int head = DETERMINISTIC || !causal ? blockIdx.y : blockIdx.x;
    const int heads = DETERMINISTIC || !causal ? gridDim.y : gridDim.x;
    const size_t head_elements = (size_t)head * seqlen * HEAD_DIM;
    Work w = {&q_map,
              &k_map,
              &v_map,
              &do_map,
              lse + (size_t)head * seqlen,
              delta + (size_t)head * seqlen,
              dq_acc + head_elements,
              dk + head_elements,
              dv + head_elements,
              head,
              seqlen,
              causal,
              scale,
              scale_log2};
    if constexpr (DETERMINISTIC) w.dq_head += (size_t)blockIdx.x * heads * seqlen * HEAD_DIM;  // the block's copy

    constexpr int CONSUMER_WARPS = CONSUMERS * WG_THREADS / 32;
    if (threadIdx.x == 0) {
        mbarrier_init(smem.kv_full, 1);
        mbarrier_init(smem.kv_empty, CONSUMER_WARPS);
        for (int s = 0; s < BWD_STAGES; s++) {
            mbarrier_init(&smem.q_full[s], 1);
            mbarrier_init(&smem.q_empty[s], CONSUMER_WARPS);
        }
        fence_mbarrier_init();
    }
    __syncthreads();  // the barriers are initialised before anyone waits on them
    const int key_tiles = ceil_div(seqlen, BwdConfig<HEAD_DIM>::TILE_KV);
    const int warpgroup = threadIdx.x / WG_THREADS;
    int loaded = 0;
    // Warp specialisation: warpgroup 0 only copies, with few registers; the consumers only compute.
    if (warpgroup == 0) {
        setmaxnreg_dec<PRODUCER_REGISTERS>();
        if (threadIdx.x != 0) return;
        for (int round = 0, key_tile; (key_tile = round_key_tile<DETERMINISTIC>(round, key_tiles, causal)) >= 0;
             round++)
            produce_key_block<HEAD_DIM>(smem, w, key_tile, round, loaded);
    } else {
        setmaxnreg_inc<CONSUMER_REGISTERS>();
        for (int round = 0, key_tile; (key_tile = round_key_tile<DETERMINISTIC>(round, key_tiles, causal)) >= 0;
             round++)
            consume_key_block<HEAD_DIM>(smem, w, warpgroup - 1, key_tile, round, loaded);
    }
}

// (3) dQ = scale * the fp32 accumulator (the sum of its copies, in order), as fp16 (09's).
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
        const float4 l = *(const float4 *)(dq_acc + copy * copy_floats + at);
        const float4 h = *(const float4 *)(dq_acc + copy * copy_floats + at + 4);
        lo = make_float4(lo.x + l.x, lo.y + l.y, lo.z + l.z, lo.w + l.w);
        hi = make_float4(hi.x + h.x, hi.y + h.y, hi.z + h.z, hi.w + h.w);
    }
    uint4 out;
    out.x = pack_half2(lo.x * scale, lo.y * scale);
    out.y = pack_half2(lo.z * scale, lo.w * scale);
    out.z = pack_half2(hi.x * scale, hi.y * scale);
    out.w = pack_half2(hi.z * scale, hi.w * scale);
    *(uint4 *)(dq + at) = out;
}

// --- The backward's launcher -----------------------------------------------------------------
// The workspace: D, one float per query row, then the fp32 dQ accumulator's copies (one with
// atomics), from a 256-byte boundary.
static size_t delta_bytes(const AttnShape *s) {
    size_t bytes = (size_t)s->batch * s->heads * s->seqlen * sizeof(float);
    return (bytes + WORKSPACE_ALIGN - 1) / WORKSPACE_ALIGN * WORKSPACE_ALIGN;
}

// Copies of the dQ accumulator in the deterministic mode (09's rule): the fewest blocks per head
// that take the heads' key tiles in the least time, counted as (rounds of the GPU's resident
// blocks) x (key tiles per block).
static int dq_copies(int heads, int key_tiles, int resident) {
    int best = 1;
    long long best_time = -1;
    for (int copies = 1; copies <= key_tiles; copies++) {
        const long long blocks = (long long)heads * copies, per_block = ceil_div(key_tiles, copies);
        const long long time = (blocks + resident - 1) / resident * per_block;
        if (best_time < 0 || time < best_time) best = copies, best_time = time;
    }
    return best;
}

// The copies of dQ that a run takes (1 with atomics); the kernel's shared memory attribute set.
template <int HEAD_DIM, bool DETERMINISTIC>
static cudaError_t plan_backward(const AttnShape *s, int *copies) {
    typedef BwdConfig<HEAD_DIM> Cfg;
    RETURN_IF_ERROR(cudaFuncSetAttribute(backward_kernel<HEAD_DIM, DETERMINISTIC>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::SMEM_BYTES));
    *copies = 1;
    if (!DETERMINISTIC) return cudaSuccess;
    int device = 0, sms = 0, per_sm = 0;
    RETURN_IF_ERROR(cudaGetDevice(&device));
    RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, backward_kernel<HEAD_DIM, DETERMINISTIC>,
                                                                  BLOCK_THREADS, Cfg::SMEM_BYTES));
    if (per_sm < 1) return cudaErrorInvalidConfiguration;  // the kernel fits no SM
    *copies = dq_copies(s->batch * s->heads, ceil_div(s->seqlen, Cfg::TILE_KV), per_sm * sms);
    return cudaSuccess;
}

static size_t backward_workspace_bytes(const AttnShape *s, int deterministic) {
    const size_t dq_acc = (size_t)s->batch * s->heads * s->seqlen * s->headdim * sizeof(float);
    int copies = 1;
    cudaError_t err = cudaSuccess;
    if (deterministic)
        err = s->headdim == 64 ? plan_backward<64, true>(s, &copies) : plan_backward<128, true>(s, &copies);
    if (err != cudaSuccess) copies = 1;  // the launch reports it
    return delta_bytes(s) + copies * dq_acc;
}

template <int HEAD_DIM, bool DETERMINISTIC>
static cudaError_t launch_backward(const BackwardArgs *args, cudaStream_t stream) {
    typedef BwdConfig<HEAD_DIM> Cfg;
    const AttnShape *s = &args->shape;
    const int heads = s->batch * s->heads, key_tiles = ceil_div(s->seqlen, Cfg::TILE_KV);
    const int row_bytes = HEAD_DIM * ELEMENT_BYTES;
    int copies = 1;
    RETURN_IF_ERROR((plan_backward<HEAD_DIM, DETERMINISTIC>(s, &copies)));
    CUtensorMap q_map, k_map, v_map, do_map;
    RETURN_IF_ERROR(
        make_tensor_map(&q_map, (void *)args->q, row_bytes, s->seqlen, heads, SLICE_BYTES, WG_ROWS, chapter.name));
    RETURN_IF_ERROR(
        make_tensor_map(&k_map, (void *)args->k, row_bytes, s->seqlen, heads, SLICE_BYTES, WG_ROWS, chapter.name));
    RETURN_IF_ERROR(
        make_tensor_map(&v_map, (void *)args->v, row_bytes, s->seqlen, heads, SLICE_BYTES, WG_ROWS, chapter.name));
    RETURN_IF_ERROR(
        make_tensor_map(&do_map, (void *)args->d_o, row_bytes, s->seqlen, heads, SLICE_BYTES, WG_ROWS, chapter.name));
    float *delta = (float *)args->workspace;
    float *dq_acc = (float *)((char *)args->workspace + delta_bytes(s));
    const dim3 row_grid(ceil_div(s->seqlen, THREADS / (HEAD_DIM / CHUNK_HALVES)), heads);

    backward_preprocess_kernel<HEAD_DIM>
        <<<row_grid, THREADS, 0, stream>>>(args->o, args->d_o, delta, dq_acc, copies, s->seqlen);
    RETURN_IF_ERROR(cudaGetLastError());
    const dim3 grid = DETERMINISTIC ? dim3(copies, heads) : s->causal ? dim3(heads, key_tiles) : dim3(key_tiles, heads);
    backward_kernel<HEAD_DIM, DETERMINISTIC><<<grid, BLOCK_THREADS, Cfg::SMEM_BYTES, stream>>>(
        q_map, k_map, v_map, do_map, args->lse, delta, dq_acc, args->dk, args->dv, s->seqlen, s->scale,
        s->scale * LOG2E, s->causal);
    RETURN_IF_ERROR(cudaGetLastError());
    convert_dq_kernel<HEAD_DIM><<<row_grid, THREADS, 0, stream>>>(dq_acc, copies, args->dq, s->seqlen, s->scale);
    return cudaGetLastError();
}

static cudaError_t backward(const BackwardArgs *args, cudaStream_t stream) {
    if (args->deterministic)
        return backward_for_head_dim(args, stream, launch_backward<64, true>, launch_backward<128, true>);
    return backward_for_head_dim(args, stream, launch_backward<64, false>, launch_backward<128, false>);
}

static const Backward backward_pass = {backward_workspace_bytes, backward, 1};  // 1: it has a deterministic mode

const Chapter chapter = {
    "10.2",
    "the backward on Hopper's datapath: wgmma for the five products, their tiles by TMA from a producer warpgroup",
    PRECISION_FP16_TC,
    90,
    90,    // sm_90 only: wgmma is an sm_90a feature
    NULL,  // the forward needs no workspace
    NULL,  // nothing to prepare
    forward,
    NULL,  // not an FP8 chapter
    &backward_pass,
};
