#ifndef VAR_TWO_WRITERS
#define VAR_TWO_WRITERS 0
#endif
#ifndef VAR_NOWAIT
#define VAR_NOWAIT 0
#endif
#ifndef VAR_NOFENCE
#define VAR_NOFENCE 0
#endif
#ifndef VAR_NOTURN
#define VAR_NOTURN 0
#endif
// 10.11, step 11 of 10_backward_hopper: the deterministic mode's adds in order, into one accumulator.
// Through 10.10 that mode gave each block a copy of dQ of its own, added the copies in order at the
// end, and had each block take several key tiles one after another; the copies, 256 MiB at B4 H16
// N4096 against a 50 MiB L2, cost 11 GB of DRAM traffic (Nsight Compute on 10.9). Now both modes
// run the same grid, one key tile a block, into one accumulator; in the deterministic mode the
// writer warp waits, for each (query tile, pass) of dQ, until a counter says that every block
// before it in a fixed order has added, adds, and moves the counter on once its add is complete.
// The order: ascending key tiles without the mask (every block starts at query tile 0, so block j
// trails block j - 1 by one add); descending under it, where blocks start at their diagonal and the
// higher key tiles reach a tile first, and the grid then takes a head's key tiles highest first, so
// that a block only ever waits for blocks dispatched before it. Otherwise 10.10.
//
// Three kernels, as 09: (1) D = rowsum(dO * O), each query tile's LSE and D as one 512-byte column
// block; (2) one block per (128-key tile, b*h): the producer brings K and V once and Q, dO and the
// column block of each 64-query tile through a ring of two stages (full and empty mbarriers);
// consumer c owns keys 64c..64c+63. Per query tile, each consumer: S^T = K Q^T and dP^T = V dO^T,
// P^T = exp(S^T * scale - LSE), dS^T = P^T * (dP^T - D), dS^T to shared memory, dV += P^T dO and
// dK += dS^T Q; then, once both consumers' dS^T are in, dQ += dS K over the block's 128 keys, its
// 64-dim passes shared between the consumers, each pass staged in shared memory and added into the
// fp32 accumulator by a bulk reduction; (3) dQ to fp16. The accumulator is zeroed before (2). The
// forward is 07's (09's forward.h).
#include <cuda/atomic>
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
#define DQ_FULL_BARRIER 2                             // 2 + c: consumer c's dQ partial is in its stage
#define DQ_EMPTY_BARRIER 4                            // 4 + c: the writer has read consumer c's stage
#define STAGE_PAIR_THREADS (WG_THREADS + 32)          // a consumer and the writer warp, at those two
#define BWD_STAGES 2                                  // (Q, dO) tiles in the ring
#define ELEMENT_BYTES 2                               // fp16
#define KSTEP_BYTES 32                                // of the reduced dimension per wgmma
#define WG_K (KSTEP_BYTES / ELEMENT_BYTES)            // 16 elements
#define SLICE_BYTES 128                               // rows are stored as 128-byte slices (the 128-byte swizzle)
#define SLICE_ELEMENTS (SLICE_BYTES / ELEMENT_BYTES)  // 64
#define WORKSPACE_ALIGN 256
#define COLUMN_FLOATS (2 * WG_ROWS)                 // a query tile's LSE, then its D
#define COLUMN_BYTES (COLUMN_FLOATS * 4)            // 512: one bulk copy a tile
#define DQ_CHUNK_FLOATS (WG_ROWS * SLICE_ELEMENTS)  // a pass's partial: 64 queries x 64 dims
#define DQ_CHUNK_BYTES (DQ_CHUNK_FLOATS * 4)        // 16 KiB: one bulk reduction

template <int HEAD_DIM>
struct BwdConfig {
    static constexpr int TILE_KV = CONSUMERS * WG_ROWS, TILE_Q = WG_ROWS;  // keys per block, queries per step
    static constexpr int SLICES = HEAD_DIM / SLICE_ELEMENTS;               // 1 or 2
    static constexpr int Q_SLICE_STRIDE = TILE_Q * SLICE_BYTES;            // bytes of one slice of a query tile
    static constexpr int KV_SLICE_STRIDE = TILE_KV * SLICE_BYTES;          // of the block's K or V
    static constexpr int Q_TILE_BYTES = SLICES * Q_SLICE_STRIDE;           // a 64 x HEAD_DIM tile
    static constexpr int KV_TILE_BYTES = SLICES * KV_SLICE_STRIDE;         // a 128 x HEAD_DIM tile
    static constexpr int DS_BYTES = TILE_KV * TILE_Q * ELEMENT_BYTES;      // dS^T, [key][query]
    static constexpr int BARRIERS = 1 + 2 * BWD_STAGES;                    // K/V full, each stage's full and empty
    static constexpr int SMEM_BYTES = 1024 + 2 * KV_TILE_BYTES + 2 * BWD_STAGES * Q_TILE_BYTES + 2 * DS_BYTES +
                                      CONSUMERS * DQ_CHUNK_BYTES + BWD_STAGES * COLUMN_BYTES + BARRIERS * 8;
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
    float *dq_stages;                 // [consumer][DQ_CHUNK_FLOATS]: a dQ partial on its way out
    float *column_ring;               // [stage][LSE, D][query]: the stage's query tile's LSE and D
    uint64_t *kv_full;                // K and V landed
    uint64_t *q_full, *q_empty;       // stage s's Q and dO landed; the consumers are done with stage s
};

template <int HEAD_DIM>
__device__ Smem smem_layout(unsigned char *raw) {
    typedef BwdConfig<HEAD_DIM> Cfg;
    Smem smem;
    // Rounded up to 1024 bytes (the 128-byte swizzle's period) as a pointer: the compiler then knows
    // every pointer below for shared memory, which an integer round trip would hide from it.
    smem.k_tile = raw + (1024 - smem_address(raw) % 1024) % 1024;
    smem.v_tile = smem.k_tile + Cfg::KV_TILE_BYTES;
    smem.q_ring = smem.v_tile + Cfg::KV_TILE_BYTES;
    smem.do_ring = smem.q_ring + BWD_STAGES * Cfg::Q_TILE_BYTES;
    smem.ds_tiles = smem.do_ring + BWD_STAGES * Cfg::Q_TILE_BYTES;
    smem.dq_stages = (float *)(smem.ds_tiles + 2 * Cfg::DS_BYTES);
    smem.column_ring = smem.dq_stages + CONSUMERS * DQ_CHUNK_FLOATS;
    smem.kv_full = (uint64_t *)(smem.column_ring + BWD_STAGES * COLUMN_FLOATS);
    smem.q_full = smem.kv_full + 1;
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

// `bytes` (a multiple of 16) from global to shared memory by the bulk-copy engine, completing on barrier.
__device__ void bulk_load(void *dst, const void *src, int bytes, uint64_t *barrier) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     smem_address(dst)),
                 "l"(src), "r"(bytes), "r"(smem_address(barrier))
                 : "memory");
}

// Q, dO and the LSE and D columns of the ring's tile `ring_tile` (query0 on) into its stage.
template <int HEAD_DIM>
__device__ void load_query_tile(const Smem &smem, const CUtensorMap *q_map, const CUtensorMap *do_map,
                                const float *columns_head, int ring_tile, int query0, int head) {
    typedef BwdConfig<HEAD_DIM> Cfg;
    const int stage = ring_tile % BWD_STAGES;
    mbarrier_arrive_expect_bytes(&smem.q_full[stage], 2 * Cfg::Q_TILE_BYTES + COLUMN_BYTES);
    bulk_load(smem.column_ring + stage * COLUMN_FLOATS, columns_head + query0 / Cfg::TILE_Q * COLUMN_FLOATS,
              COLUMN_BYTES, &smem.q_full[stage]);
    load_tile<HEAD_DIM>(smem.q_ring + stage * Cfg::Q_TILE_BYTES, Cfg::Q_SLICE_STRIDE, WG_ROWS, q_map,
                        &smem.q_full[stage], query0, head);
    load_tile<HEAD_DIM>(smem.do_ring + stage * Cfg::Q_TILE_BYTES, Cfg::Q_SLICE_STRIDE, WG_ROWS, do_map,
                        &smem.q_full[stage], query0, head);
}

// --- The products ----------------------------------------------------------------------------
// Where k-step ks (32 bytes of every row) of a K-major tile starts, from the tile's start: in slice
// ks * 32 / 128.
__host__ __device__ constexpr unsigned kstep_offset(int slice_stride, int ks) {
    return ks * KSTEP_BYTES / SLICE_BYTES * slice_stride + ks * KSTEP_BYTES % SLICE_BYTES;
}

// A descriptor `bytes` further on in shared memory (a non-negative multiple of 16): its start-address
// field (bits 0-13, the address >> 4) plus bytes >> 4, one add. No carry leaves the field: every tile
// lies below 256 KiB.
__device__ uint64_t descriptor_plus(uint64_t descriptor, unsigned bytes) { return descriptor + (bytes >> 4); }

// acc (64 rows of `rows_tile` x 64 rows of `cols_tile`) = rows_tile cols_tile^T, both [row][dim]
// (K-major): S^T = K Q^T and dP^T = V dO^T, the keys a consumer's 64 rows of the block's K or V.
// Issued, not committed.
template <int HEAD_DIM>
__device__ void issue_transposed_scores(float (&acc)[32], const unsigned char *rows_tile,
                                        const unsigned char *cols_tile) {
    typedef BwdConfig<HEAD_DIM> Cfg;
    const uint64_t rows = smem_descriptor(rows_tile, SLICE_BYTES), cols = smem_descriptor(cols_tile, SLICE_BYTES);
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / WG_K; ks++)
        wgmma_m64n64k16_f16_ss(acc, descriptor_plus(rows, kstep_offset(Cfg::KV_SLICE_STRIDE, ks)),
                               descriptor_plus(cols, kstep_offset(Cfg::Q_SLICE_STRIDE, ks)), ks > 0);
}

// acc (64 keys x HEAD_DIM) += a (64 keys x 64 queries, from registers) tile (64 queries x HEAD_DIM,
// [query][dim]: read MN-major): dV += P^T dO and dK += dS^T Q. Issued, not committed.
template <int HEAD_DIM>
__device__ void issue_key_gradient(float (&acc)[HEAD_DIM / 2], const unsigned (&a)[WG_ROWS / WG_K][4],
                                   const unsigned char *tile) {
    const uint64_t b = smem_descriptor_mn_major(tile, BwdConfig<HEAD_DIM>::Q_SLICE_STRIDE);
#pragma unroll
    for (int kk = 0; kk < WG_ROWS / WG_K; kk++) {
        if constexpr (HEAD_DIM == 128) wgmma_m64n128k16_f16_rs(acc, a[kk], descriptor_plus(b, kk * WG_K * SLICE_BYTES));
        else wgmma_m64n64k16_f16_rs(acc, a[kk], descriptor_plus(b, kk * WG_K * SLICE_BYTES));
    }
}

// dq (64 queries x the 64 dims of slice `slice`) = dS K over the block's 128 keys: dS read MN-major
// from dS^T [key][query], K read MN-major from [key][dim]. Issued, not committed.
template <int HEAD_DIM>
__device__ void issue_dq(float (&dq)[32], const unsigned char *ds_tile, const unsigned char *k_tile, int slice) {
    typedef BwdConfig<HEAD_DIM> Cfg;
    const uint64_t ds = smem_descriptor_mn_major(ds_tile, Cfg::DS_BYTES);
    // The pass's slice added to the descriptor too: from the pointer (k_tile + slice * stride), ptxas built
    // the D = 64 kernel's descriptors in vector registers and moved each to the uniform ones (R2UR).
    const uint64_t k = smem_descriptor_mn_major(k_tile, Cfg::KV_SLICE_STRIDE);
#pragma unroll
    for (int kk = 0; kk < Cfg::TILE_KV / WG_K; kk++)
        wgmma_m64n64k16_f16_ss_mn_major(dq, descriptor_plus(ds, kk * WG_K * SLICE_BYTES),
                                        descriptor_plus(k, slice * Cfg::KV_SLICE_STRIDE + kk * WG_K * SLICE_BYTES),
                                        kk > 0);
}

// --- The softmax gradient on the accumulators ---------------------------------------------------
// Accumulator element 4c + 2r + e of thread t of its warpgroup: row 16 (t / 32) + t % 32 / 4 + 8r (a
// key), column 8c + 2 (t % 4) + e (a query).
__device__ int wg_thread() { return threadIdx.x % WG_THREADS; }
__device__ int acc_row(int r) { return wg_thread() / 32 * 16 + wg_thread() % 32 / 4 + 8 * r; }
__device__ int acc_col(int c, int e) { return 8 * c + 2 * (wg_thread() % 4) + e; }

// P^T = exp(S^T * scale - LSE) in place of S^T, LSE per column: a thread's columns 8c + 2 (t % 4) and
// the next, one 8-byte load.
__device__ void probabilities(float (&s)[32], const float *lse_tile, float scale_log2) {
#pragma unroll
    for (int c = 0; c < 8; c++) {
        const float2 lse = *(const float2 *)(lse_tile + acc_col(c, 0));
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const float lse_log2 = (e ? lse.y : lse.x) * LOG2E;
#pragma unroll
            for (int r = 0; r < 2; r++)
                s[4 * c + 2 * r + e] = exp2_approx(fmaf(s[4 * c + 2 * r + e], scale_log2, -lse_log2));
        }
    }
}

// P^T's masked entries 0: a key past the end, a query past the end, or, causal, a key after its query.
__device__ void mask_probabilities(float (&p)[32], int key0, int query0, int seqlen, int causal) {
#pragma unroll
    for (int c = 0; c < 8; c++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int query = query0 + acc_col(c, e);
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int key = key0 + acc_row(r);
                if (key >= seqlen || query >= seqlen || (causal && key > query)) p[4 * c + 2 * r + e] = 0.0f;
            }
        }
}

// dS^T = P^T * (dP^T - D) in place of dP^T. D per column.
__device__ void score_gradient(float (&dp)[32], const float (&p)[32], const float *delta_tile) {
#pragma unroll
    for (int c = 0; c < 8; c++) {
        const float2 delta = *(const float2 *)(delta_tile + acc_col(c, 0));
#pragma unroll
        for (int e = 0; e < 2; e++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int i = 4 * c + 2 * r + e;
                dp[i] = p[i] * (dp[i] - (e ? delta.y : delta.x));
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

// The dQ accumulator's layout: per head, per 64-query tile, per 64-dim pass, one 16 KiB chunk in the
// order the partial leaves the registers: float4 j of thread t (its accumulator elements 4j..4j+3)
// at float 512 j + 4 t. The threads' stores into shared memory are then conflict-free, and the
// chunk goes out in one contiguous bulk reduction; the convert kernel reads it back (dq_chunk_index).
__device__ int dq_chunk_index(int query, int dim) {  // query, dim within the chunk (0..63)
    const int warp = query / 16, lane = query % 8 * 4 + dim % 8 / 2, t = warp * 32 + lane;
    return dim / 8 * 512 + t * 4 + query % 16 / 8 * 2 + dim % 2;
}

// Lane 0 of the writer warp: the bulk reductions it issued have read their source (.read), or are
// complete (their adds made).
__device__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// This pass's dQ partial into the consumer's stage, for the writer warp to add: once the writer has
// read the stage's last partial, the threads' float4s written, made visible to the async proxy, and
// the writer told, without waiting for it.
__device__ void hand_dq(float *stage, const float (&dq)[32], int consumer) {
    bar_sync<STAGE_PAIR_THREADS>(DQ_EMPTY_BARRIER + consumer);
#pragma unroll
    for (int j = 0; j < 8; j++)
        *(float4 *)(stage + 512 * j + 4 * wg_thread()) =
            make_float4(dq[4 * j], dq[4 * j + 1], dq[4 * j + 2], dq[4 * j + 3]);
    fence_proxy_async();
    bar_arrive<STAGE_PAIR_THREADS>(DQ_FULL_BARRIER + consumer);
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
// (1) D_i = sum_d dO[i, d] * O[i, d] in fp32, written beside LSE_i into the query tile's column block
// ([tile][LSE, D][64], 0 past the end). Grid: (row tiles over the padded rows, b*h); CHUNKS lanes per
// row, each with 8 of its D elements.
template <int HEAD_DIM>
__global__ void __launch_bounds__(THREADS)
    backward_preprocess_kernel(const __half *o, const __half *d_o, const float *lse, float *columns, int seqlen) {
    constexpr int CHUNKS = HEAD_DIM / CHUNK_HALVES, ROWS = THREADS / CHUNKS;
    const int row = blockIdx.x * ROWS + threadIdx.x / CHUNKS, chunk = threadIdx.x % CHUNKS;
    const int padded_rows = ceil_div(seqlen, WG_ROWS) * WG_ROWS;  // the grid's rows (a multiple of ROWS)
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
    float *column = columns + ((size_t)blockIdx.y * padded_rows + row) / WG_ROWS * COLUMN_FLOATS + row % WG_ROWS;
    if (chunk == 0) column[0] = valid ? lse[(size_t)blockIdx.y * seqlen + row] : 0.0f, column[WG_ROWS] = sum;
}

// What a block works on, and where its tiles come from.
struct Work {
    const CUtensorMap *q_map, *k_map, *v_map, *do_map;
    const float *columns_head;  // the head's [query tile][LSE, D][64]
    float *dq_head;             // the head's dQ chunks, [query tile][pass]
    int *turns_head;            // deterministic: the adds made so far to each chunk, [query tile][pass]
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

// (2a) The producer (one thread): K and V of the block's key tile, and Q and dO of its query tiles
// through the ring, each stage refilled once the consumers have released it.
template <int HEAD_DIM>
__device__ void produce_key_block(const Smem &smem, const Work &w, int key_tile) {
    typedef BwdConfig<HEAD_DIM> Cfg;
    const int first_tile = first_query_tile<HEAD_DIM>(w, key_tile);
    const int q_tiles = ceil_div(w.seqlen, Cfg::TILE_Q) - first_tile;
    mbarrier_arrive_expect_bytes(smem.kv_full, 2 * Cfg::KV_TILE_BYTES);
    load_tile<HEAD_DIM>(smem.k_tile, Cfg::KV_SLICE_STRIDE, Cfg::TILE_KV, w.k_map, smem.kv_full, key_tile * Cfg::TILE_KV,
                        w.head);
    load_tile<HEAD_DIM>(smem.v_tile, Cfg::KV_SLICE_STRIDE, Cfg::TILE_KV, w.v_map, smem.kv_full, key_tile * Cfg::TILE_KV,
                        w.head);
    for (int step = 0; step < q_tiles; step++) {
        const int ring_tile = step;
        if (ring_tile >= BWD_STAGES)
            mbarrier_wait(&smem.q_empty[ring_tile % BWD_STAGES], (ring_tile / BWD_STAGES - 1) % 2);
        load_query_tile<HEAD_DIM>(smem, w.q_map, w.do_map, w.columns_head, ring_tile, (first_tile + step) * Cfg::TILE_Q,
                                  w.head);
    }
}

// A consumer is done with a barrier's resource: each of its threads arrives, so that each thread's own
// reads of the stage (LSE and D) are released by its own arrive, the order racecheck can follow.
__device__ void release(uint64_t *barrier) { mbarrier_arrive(barrier); }

// The dQ pass of ring tile `ring_tile` that falls to consumer `consumer`, -1 if none: pass k of the
// tile goes to consumer (tile's passes + k) % 2 (D = 128: pass c to consumer c; D = 64: the tiles in turn).
template <int HEAD_DIM>
__device__ int dq_pass(int ring_tile, int consumer) {
#pragma unroll
    for (int pass = 0; pass < BwdConfig<HEAD_DIM>::DQ_PASSES; pass++)
        if ((ring_tile * BwdConfig<HEAD_DIM>::DQ_PASSES + pass) % CONSUMERS == consumer) return pass;
    return -1;
}

// (2b) Consumer `consumer`: dK and dV of keys 64 consumer.. of the key tile, and its share of dQ.
template <int HEAD_DIM>
__device__ void consume_key_block(const Smem &smem, const Work &w, int consumer, int key_tile) {
    typedef BwdConfig<HEAD_DIM> Cfg;
    const int key0 = key_tile * Cfg::TILE_KV + consumer * WG_ROWS;  // this consumer's keys
    const int first_tile = first_query_tile<HEAD_DIM>(w, key_tile);
    const int q_tiles = ceil_div(w.seqlen, Cfg::TILE_Q) - first_tile;
    const unsigned char *k_rows = smem.k_tile + consumer * WG_ROWS * SLICE_BYTES;
    const unsigned char *v_rows = smem.v_tile + consumer * WG_ROWS * SLICE_BYTES;

    // On chip for the whole loop: dK and dV of the consumer's 64 keys.
    float dk_acc[Cfg::ACC_REGS_D], dv_acc[Cfg::ACC_REGS_D];
    for (int i = 0; i < Cfg::ACC_REGS_D; i++) dk_acc[i] = dv_acc[i] = 0.0f;
    mbarrier_wait(smem.kv_full, 0);

    for (int step = 0; step < q_tiles; step++) {
        const int ring_tile = step, stage = ring_tile % BWD_STAGES;
        const int query0 = (first_tile + step) * Cfg::TILE_Q;
        const unsigned char *q_tile = smem.q_ring + stage * Cfg::Q_TILE_BYTES;
        const unsigned char *do_tile = smem.do_ring + stage * Cfg::Q_TILE_BYTES;
        unsigned char *ds_tile = smem.ds_tiles + ring_tile % 2 * Cfg::DS_BYTES;  // two: one barrier a tile
        const float *columns = smem.column_ring + stage * COLUMN_FLOATS;         // [LSE, D][query], with Q and dO
        mbarrier_wait(&smem.q_full[stage], ring_tile / BWD_STAGES % 2);

        // S^T = K Q^T, then dP^T = V dO^T (64 keys x 64 queries each), committed apart: P^T is computed
        // from S^T while dP^T is still on the tensor cores.
        float s[Cfg::SCORE_REGS], dp[Cfg::SCORE_REGS];
        wgmma_fence();
        issue_transposed_scores<HEAD_DIM>(s, k_rows, q_tile);
        wgmma_commit();
        issue_transposed_scores<HEAD_DIM>(dp, v_rows, do_tile);
        wgmma_commit();
        wgmma_wait<1>();
        hold_registers(s);
        probabilities(s, columns, w.scale_log2);
        // Only a ragged tile or (causal) one that reaches past the diagonal has entries to zero: a branch
        // the whole warpgroup takes alike, so that no other tile issues the mask's comparisons.
        if (query0 + Cfg::TILE_Q > w.seqlen || key0 + WG_ROWS > w.seqlen || (w.causal && key0 + WG_ROWS - 1 > query0))
            mask_probabilities(s, key0, query0, w.seqlen, w.causal);
        wgmma_wait<0>();
        hold_registers(dp);
        score_gradient(dp, s, columns + Cfg::TILE_Q);
        unsigned p_frag[4][4], ds_frag[4][4];
        pack_operand(p_frag, s);
        pack_operand(ds_frag, dp);
        store_ds(ds_tile + consumer * WG_ROWS * SLICE_BYTES, ds_frag);  // before the wgmmas below read ds_frag
        fence_proxy_async();

        // dV += P^T dO; then, once both consumers' dS^T are in, this consumer's dQ pass if the tile has one
        // for it (dQ = dS K over the block's 128 keys, 64 dims: D = 128, pass c to consumer c; D = 64, the
        // tiles to the consumers in turn); then dK += dS^T Q. Each wait lets the last product issued run
        // on: dK is issued once dV is done (P^T's registers free), and the dQ partial goes out while dK
        // is computed.
        const int pass = dq_pass<HEAD_DIM>(ring_tile, consumer);
        // D = 128: a pass for each consumer in every tile, known at compile time, so that no branch
        // surrounds its wgmmas (around one, ptxas serialises every wgmma of the kernel: no registers left).
        const bool has_pass = Cfg::DQ_PASSES == CONSUMERS || pass >= 0;
        float dq[32];
        wgmma_fence();
        issue_key_gradient<HEAD_DIM>(dv_acc, p_frag, do_tile);
        wgmma_commit();
        bar_sync<CONSUMERS * WG_THREADS>(DS_BARRIER);  // both consumers' dS^T are in
        // The group committed on each path: one commit after the branch would close the dQ group inside
        // it and add an empty one behind (D = 64's SASS), so that "dV done" would wait for dQ too. Where
        // the tile has no pass for this consumer, the group is empty: the waits below are the same.
        if (has_pass) {
            issue_dq<HEAD_DIM>(dq, ds_tile, smem.k_tile, pass);
            wgmma_commit();
        } else {
            wgmma_commit();
        }
        wgmma_wait<1>();  // dV done
        hold_registers(dv_acc);
        hold_registers(p_frag);
        issue_key_gradient<HEAD_DIM>(dk_acc, ds_frag, q_tile);
        wgmma_commit();
        wgmma_wait<1>();  // dQ done; dK still running
        if (has_pass) {
            hold_registers(dq);
            hand_dq(smem.dq_stages + consumer * DQ_CHUNK_FLOATS, dq, consumer);
        }
        wgmma_wait<0>();
        hold_registers(dk_acc);
        hold_registers(ds_frag);
        release(&smem.q_empty[stage]);  // this stage's Q and dO are read
    }
    store_dk_dv<HEAD_DIM>(w.dk_head, w.dv_head, dk_acc, dv_acc, key0, w.seqlen, w.scale);
}

// The block's key tile: grid (key tiles, b*h), a head's blocks side by side. In the deterministic
// mode under the mask, a head's highest key tile first: the order of its adds (add_rank).
template <bool DETERMINISTIC>
__device__ int block_key_tile(int key_tiles, int causal) {
    return DETERMINISTIC && causal ? key_tiles - 1 - (int)blockIdx.x : (int)blockIdx.x;
}

// The deterministic order of the adds into query tile `query_tile`'s chunks: the key tiles that add
// there, ascending without the mask; under it, from the diagonal's key tile down, the order in which
// blocks that start at their diagonals reach the tile. This block's place in it.
template <int HEAD_DIM>
__device__ int add_rank(const Work &w, int key_tile, int query_tile) {
    typedef BwdConfig<HEAD_DIM> Cfg;
    return w.causal ? query_tile * Cfg::TILE_Q / Cfg::TILE_KV - key_tile : key_tile;
}

// Lane 0 of the writer warp, deterministic mode: wait until `rank` adds into a chunk are complete
// (a counter in global memory, read with acquire), then order them before this block's own bulk add
// (a proxy fence: the adds are the bulk-copy engine's, the counter the threads'); and, once its own
// add is complete, the same fence and one more on the counter, with release.
__device__ void wait_turn(int *turn, int rank) {
    cuda::atomic_ref<int, cuda::thread_scope_device> count(*turn);
#if !VAR_NOWAIT
    while (count.load(cuda::memory_order_acquire) != rank) __nanosleep(32);
#else
    (void)rank;
#endif
#if !VAR_NOFENCE
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
#endif
}
__device__ void pass_turn(int *turn) {
#if !VAR_NOFENCE
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
#endif
    cuda::atomic_ref<int, cuda::thread_scope_device>(*turn).fetch_add(1, cuda::memory_order_release);
}

// (2c) The dQ writer, warp 1 of the producer warpgroup: for each consumer's pass, in the consumers'
// order of tiles, it waits until the partial is in the stage, has lane 0 add it into its chunk of the
// accumulator (one bulk reduction), and hands the stage back once the reduction has read it, except
// after the consumer's last pass, which no consumer waits for. Deterministic: lane 0 first waits for
// its turn at the chunk, and passes the turn on once the add is complete. (Waiting for the add to be
// complete, not only read, costs nothing more: both waits are the same DEPBAR in the SASS.)
template <int HEAD_DIM, bool DETERMINISTIC>
__device__ void write_dq(const Smem &smem, const Work &w, int key_tile, int only = -1) {
    typedef BwdConfig<HEAD_DIM> Cfg;
    const bool leader = threadIdx.x % 32 == 0;
    const int first_tile = first_query_tile<HEAD_DIM>(w, key_tile);
    const int q_tiles = ceil_div(w.seqlen, Cfg::TILE_Q) - first_tile;
    int passes_left[CONSUMERS];
    for (int c = 0; c < CONSUMERS; c++) {
        passes_left[c] = 0;
        if (only >= 0 && c != only) continue;
        for (int ring_tile = 0; ring_tile < q_tiles; ring_tile++)
            passes_left[c] += dq_pass<HEAD_DIM>(ring_tile, c) >= 0;
        if (passes_left[c] > 0) bar_arrive<STAGE_PAIR_THREADS>(DQ_EMPTY_BARRIER + c);  // the stage starts free
    }
    for (int step = 0; step < q_tiles; step++) {
        const int query_tile = first_tile + step;
        for (int c = 0; c < CONSUMERS; c++) {
            const int pass = dq_pass<HEAD_DIM>(step, c);
            if (pass < 0 || (only >= 0 && c != only)) continue;
            bar_sync<STAGE_PAIR_THREADS>(DQ_FULL_BARRIER + c);
            if (leader) {
                const size_t at = (size_t)query_tile * Cfg::DQ_PASSES + pass;  // the chunk, and its turn
                if constexpr (DETERMINISTIC && !VAR_NOTURN) wait_turn(w.turns_head + at, add_rank<HEAD_DIM>(w, key_tile, query_tile));
                asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(
                                 w.dq_head + at * DQ_CHUNK_FLOATS),
                             "r"(smem_address(smem.dq_stages + c * DQ_CHUNK_FLOATS)), "n"(DQ_CHUNK_BYTES)
                             : "memory");
                asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
                if constexpr (DETERMINISTIC) {
                    bulk_wait();  // the add made
                    if (!VAR_NOTURN) pass_turn(w.turns_head + at);
                } else {
                    bulk_wait_read();  // the stage read
                }
            }
            __syncwarp();
            if (--passes_left[c] > 0) bar_arrive<STAGE_PAIR_THREADS>(DQ_EMPTY_BARRIER + c);
        }
    }
    if (leader) bulk_wait();  // the adds made before the block exits
    __syncwarp();
}

template <int HEAD_DIM, bool DETERMINISTIC>
__global__ void __launch_bounds__(BLOCK_THREADS, 1)
    backward_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                    const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap do_map,
                    const float *columns, float *dq_acc, int *turns, __half *dk, __half *dv, int seqlen, float scale,
                    float scale_log2, int causal) {
    extern __shared__ unsigned char raw_smem[];
    const Smem smem = smem_layout<HEAD_DIM>(raw_smem);
    const int head = blockIdx.y;
    const int query_tiles = ceil_div(seqlen, WG_ROWS);
    const size_t head_elements = (size_t)head * seqlen * HEAD_DIM;
    const size_t head_acc_floats = (size_t)query_tiles * WG_ROWS * HEAD_DIM;  // whole query tiles
    Work w = {&q_map,
              &k_map,
              &v_map,
              &do_map,
              columns + (size_t)head * query_tiles * COLUMN_FLOATS,
              dq_acc + head * head_acc_floats,
              turns + (size_t)head * query_tiles * BwdConfig<HEAD_DIM>::DQ_PASSES,
              dk + head_elements,
              dv + head_elements,
              head,
              seqlen,
              causal,
              scale,
              scale_log2};

    constexpr int CONSUMER_THREADS = CONSUMERS * WG_THREADS;
    if (threadIdx.x == 0) {
        mbarrier_init(smem.kv_full, 1);
        for (int s = 0; s < BWD_STAGES; s++) {
            mbarrier_init(&smem.q_full[s], 1);
            mbarrier_init(&smem.q_empty[s], CONSUMER_THREADS);
        }
        fence_mbarrier_init();
    }
    __syncthreads();  // the barriers are initialised before anyone waits on them
    const int key_tile = block_key_tile<DETERMINISTIC>(ceil_div(seqlen, BwdConfig<HEAD_DIM>::TILE_KV), causal);
    // Read from lane 0, the warpgroup is a value ptxas knows is the same across the warp: D = 64's branch
    // around a consumer's dQ wgmmas is then not divergent to it (from threadIdx.x directly, it serialises
    // every wgmma of the kernel, ptxas's C7520).
    const int warpgroup = __shfl_sync(0xffffffff, threadIdx.x / WG_THREADS, 0);
    // Warp specialisation: warpgroup 0 copies (its thread 0) and adds dQ (its warp 1), with few
    // registers; the consumers only compute.
    if (warpgroup == 0) {
        setmaxnreg_dec<PRODUCER_REGISTERS>();
#if VAR_TWO_WRITERS
        if (threadIdx.x / 32 == 1 || threadIdx.x / 32 == 2)
            write_dq<HEAD_DIM, DETERMINISTIC>(smem, w, key_tile, threadIdx.x / 32 - 1);  // warp 1 + c: consumer c's
#else
        if (threadIdx.x / 32 == 1) write_dq<HEAD_DIM, DETERMINISTIC>(smem, w, key_tile);
#endif
        if (threadIdx.x != 0) return;
        produce_key_block<HEAD_DIM>(smem, w, key_tile);
    } else {
        setmaxnreg_inc<CONSUMER_REGISTERS>();
        consume_key_block<HEAD_DIM>(smem, w, warpgroup - 1, key_tile);
    }
}

// (3) dQ = scale * the fp32 accumulator, as fp16: 8 dims of a row a thread, read from their chunk
// (dq_chunk_index), two floats at a time.
template <int HEAD_DIM>
__global__ void __launch_bounds__(THREADS) convert_dq_kernel(const float *dq_acc, __half *dq, int seqlen, float scale) {
    constexpr int CHUNKS = HEAD_DIM / CHUNK_HALVES, ROWS = THREADS / CHUNKS;
    constexpr int PASSES = HEAD_DIM / SLICE_ELEMENTS;
    const int row = blockIdx.x * ROWS + threadIdx.x / CHUNKS, dim0 = threadIdx.x % CHUNKS * CHUNK_HALVES;
    if (row >= seqlen) return;
    const size_t head_acc_floats = (size_t)ceil_div(seqlen, WG_ROWS) * WG_ROWS * HEAD_DIM;
    const float *chunk = dq_acc + blockIdx.y * head_acc_floats +
                         ((size_t)row / WG_ROWS * PASSES + dim0 / SLICE_ELEMENTS) * DQ_CHUNK_FLOATS;
    unsigned out[CHUNK_HALVES / 2];
#pragma unroll
    for (int k = 0; k < CHUNK_HALVES / 2; k++) {
        const float2 sum = *(const float2 *)(chunk + dq_chunk_index(row % WG_ROWS, dim0 % SLICE_ELEMENTS + 2 * k));
        out[k] = pack_half2(sum.x * scale, sum.y * scale);
    }
    *(uint4 *)(dq + ((size_t)blockIdx.y * seqlen + row) * HEAD_DIM + dim0) = make_uint4(out[0], out[1], out[2], out[3]);
}

// --- The backward's launcher -----------------------------------------------------------------
// The workspace: the column blocks, LSE and D of each 64-query tile; then the fp32 dQ accumulator, of
// whole query tiles; then the deterministic mode's turns, an int per (head, query tile, pass); each
// from a 256-byte boundary. The accumulator and the turns are zeroed together before each run.
static size_t aligned(size_t bytes) { return (bytes + WORKSPACE_ALIGN - 1) / WORKSPACE_ALIGN * WORKSPACE_ALIGN; }
static size_t columns_bytes(const AttnShape *s) {
    return aligned((size_t)s->batch * s->heads * ceil_div(s->seqlen, WG_ROWS) * COLUMN_BYTES);
}
static size_t dq_acc_bytes(const AttnShape *s) {
    return aligned((size_t)s->batch * s->heads * ceil_div(s->seqlen, WG_ROWS) * WG_ROWS * s->headdim * sizeof(float));
}
static size_t turns_bytes(const AttnShape *s) {
    return aligned((size_t)s->batch * s->heads * ceil_div(s->seqlen, WG_ROWS) * (s->headdim / SLICE_ELEMENTS) *
                   sizeof(int));
}

static size_t backward_workspace_bytes(const AttnShape *s, int deterministic) {
    (void)deterministic;  // the same in both modes
    return columns_bytes(s) + dq_acc_bytes(s) + turns_bytes(s);
}

template <int HEAD_DIM, bool DETERMINISTIC>
static cudaError_t launch_backward(const BackwardArgs *args, cudaStream_t stream) {
    typedef BwdConfig<HEAD_DIM> Cfg;
    const AttnShape *s = &args->shape;
    const int heads = s->batch * s->heads, key_tiles = ceil_div(s->seqlen, Cfg::TILE_KV);
    const int row_bytes = HEAD_DIM * ELEMENT_BYTES;
    RETURN_IF_ERROR(cudaFuncSetAttribute(backward_kernel<HEAD_DIM, DETERMINISTIC>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::SMEM_BYTES));
    CUtensorMap q_map, k_map, v_map, do_map;
    RETURN_IF_ERROR(
        make_tensor_map(&q_map, (void *)args->q, row_bytes, s->seqlen, heads, SLICE_BYTES, WG_ROWS, chapter.name));
    RETURN_IF_ERROR(
        make_tensor_map(&k_map, (void *)args->k, row_bytes, s->seqlen, heads, SLICE_BYTES, WG_ROWS, chapter.name));
    RETURN_IF_ERROR(
        make_tensor_map(&v_map, (void *)args->v, row_bytes, s->seqlen, heads, SLICE_BYTES, WG_ROWS, chapter.name));
    RETURN_IF_ERROR(
        make_tensor_map(&do_map, (void *)args->d_o, row_bytes, s->seqlen, heads, SLICE_BYTES, WG_ROWS, chapter.name));
    float *columns = (float *)args->workspace;
    float *dq_acc = (float *)((char *)args->workspace + columns_bytes(s));
    int *turns = (int *)((char *)dq_acc + dq_acc_bytes(s));
    const int rows_per_block = THREADS / (HEAD_DIM / CHUNK_HALVES);
    const dim3 row_grid(ceil_div(s->seqlen, rows_per_block), heads);
    const dim3 padded_grid(ceil_div(ceil_div(s->seqlen, WG_ROWS) * WG_ROWS, rows_per_block), heads);

    RETURN_IF_ERROR(cudaMemsetAsync(dq_acc, 0, dq_acc_bytes(s) + turns_bytes(s), stream));
    backward_preprocess_kernel<HEAD_DIM>
        <<<padded_grid, THREADS, 0, stream>>>(args->o, args->d_o, args->lse, columns, s->seqlen);
    RETURN_IF_ERROR(cudaGetLastError());
    backward_kernel<HEAD_DIM, DETERMINISTIC><<<dim3(key_tiles, heads), BLOCK_THREADS, Cfg::SMEM_BYTES, stream>>>(
        q_map, k_map, v_map, do_map, columns, dq_acc, turns, args->dk, args->dv, s->seqlen, s->scale, s->scale * LOG2E,
        s->causal);
    RETURN_IF_ERROR(cudaGetLastError());
    convert_dq_kernel<HEAD_DIM><<<row_grid, THREADS, 0, stream>>>(dq_acc, args->dq, s->seqlen, s->scale);
    return cudaGetLastError();
}

static cudaError_t backward(const BackwardArgs *args, cudaStream_t stream) {
    if (args->deterministic)
        return backward_for_head_dim(args, stream, launch_backward<64, true>, launch_backward<128, true>);
    return backward_for_head_dim(args, stream, launch_backward<64, false>, launch_backward<128, false>);
}

static const Backward backward_pass = {backward_workspace_bytes, backward, 1};  // 1: it has a deterministic mode

const Chapter chapter = {
    "10_backward_hopper",
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
