// 11.11, step 11 of 11_decode: K and V through shared memory, two steps ahead. Through 11.10 a
// thread loaded a step's K and V rows into registers and then used them: while it computed, it had
// nothing on its way from memory, and at four blocks an SM (its registers allow no more) the SM's
// bytes in flight fell to zero between the steps. Now each thread copies its 16 bytes of each key's
// K and V with cp.async into a ring of its own in shared memory, STAGES steps deep: it starts the
// copies of the step two ahead, then waits for this step's, so two steps' bytes are always on their
// way while it computes. The ring is the same shared memory the groups' states use once the keys
// are read. Otherwise 11.10.
//
// Two kernels: (1) one block per (split of keys_per_split keys, KV head, sequence): the g x Nq query
// rows of the KV head, QUERY_CHUNK at a time; groups of HEAD_DIM / 8 threads each copy the K and V
// rows of KEYS_IN_FLIGHT keys a step, 8 elements a thread a row, through the block table into their
// ring, then use them one after another; each group keeps an online softmax per row over the keys
// it reads, and the block combines its groups' states in shared memory into the split's partial per
// row; (2) per (query head, sequence), the splits' partials merged into O and LSE by MERGE_THREADS
// threads.
#include <cuda_fp8.h>
#include <cuda_pipeline_primitives.h>
#include <stdio.h>

#include "../common/harness.h"
#include "../09_backward/forward.h"

// --- Configuration -------------------------------------------------------------------------
#define DECODE_THREADS 128
#define KEYS_PER_STEP 256   // a split's fewest keys (11.3's split): the workspace holds max_length / 256 splits
#define BLOCK_COST_KEYS 64  // a split block's fixed cost (queries, combine, partials) counted in keys read
#define QUERY_CHUNK 4       // query rows a thread keeps state for at once (g x Nq rows: passes over the keys)
#define DIMS_PER_THREAD 8   // of a K or V row: one load, 16 bytes of fp16 or 8 of e4m3
#define KEYS_IN_FLIGHT 4  // keys a group takes a step: 4 x 32 (e4m3: 16) bytes of K and V a thread, a stage of its ring
#define PAIRS (KEYS_IN_FLIGHT * QUERY_CHUNK)  // a step's (key, row) scores: pair x = key i x QUERY_CHUNK + row j
#define STAGES 3                              // steps in a thread's ring: the one in use and the two on their way
#define MERGE_THREADS 512  // the merge's block: HEAD_DIM dims x (MERGE_THREADS / HEAD_DIM) parts of the splits

template <int HEAD_DIM>
struct DecodeConfig {
    static constexpr int LANES_PER_KEY = HEAD_DIM / DIMS_PER_THREAD;     // 16 (D = 128) or 8 threads a key
    static constexpr int KEYS_AT_ONCE = DECODE_THREADS / LANES_PER_KEY;  // 8 or 16 keys a step
    static constexpr int STATE_FLOATS = QUERY_CHUNK * (HEAD_DIM + 2);    // a group's (O, max, sum) per query
    static constexpr int STATE_BYTES = KEYS_AT_ONCE * STATE_FLOATS * (int)sizeof(float);
    static constexpr int PER_LANE = PAIRS / LANES_PER_KEY;    // the step's scores a lane finishes: 1 or 2
    static constexpr int ROW_LANES = QUERY_CHUNK / PER_LANE;  // lane distance between a row's pairs: 4 or 2
    static_assert(LANES_PER_KEY <= 32 && 32 % LANES_PER_KEY == 0, "a key's lanes lie in one warp");
};

// A split's partial for one query: its max (log2 domain), its sum and its unnormalised O.
__host__ __device__ inline size_t partial_index(int batch_head, int query, int new_tokens, int split, int splits) {
    return (((size_t)batch_head * new_tokens + query) * splits + split);
}

// --- (1) a split of one sequence's keys, for the query heads of one KV head ----------------
// A cache's element: a thread's DIMS_PER_THREAD elements of a row as one load (16 bytes of fp16, 8 of
// e4m3), and the scale a KV head's values carry (fp16: none, a constant 1 the compiler folds away).
template <typename Elem>
struct CacheLoad;
template <>
struct CacheLoad<__half> {
    typedef uint4 Raw;
    static __device__ float scale(const float *, int) { return 1.0f; }
};
template <>
struct CacheLoad<__nv_fp8_e4m3> {
    typedef uint2 Raw;
    static __device__ float scale(const float *scales, int kv_head) { return scales[kv_head]; }
};

// Where key t's row of KV head kv_head lies in a pool, its page (from the block table) known.
struct PageDiv { unsigned mul; int shift; int size; };
static PageDiv page_div(int size) {
    int shift = 0;
    while ((1 << shift) < size) shift++;
    PageDiv d = {(unsigned)(((1ull << 32) * ((1ull << shift) - size)) / size + 1), shift, size};
    return d;
}
#if VAR_DIVMOD
__device__ int page_index(int t, PageDiv d) { return (int)((__umulhi((unsigned)t, d.mul) + (unsigned)t) >> d.shift); }
#else
__device__ int page_index(int t, PageDiv d) { return t / d.size; }
#endif
__device__ size_t cache_row(int page, int t, int kv_heads, int kv_head, PageDiv d, int head_dim) {
    return (((size_t)page * kv_heads + kv_head) * d.size + (t - page_index(t, d) * d.size)) * head_dim;
}

// The split block's shared memory: a ring of K and V while its keys are read (each thread's slots for
// STAGES steps of KEYS_IN_FLIGHT keys: 48 KiB of fp16, 24 of e4m3), then its groups' states.
template <int HEAD_DIM, typename Elem>
struct SplitSmem {
    static constexpr int RING_BYTES =
        STAGES * 2 * KEYS_IN_FLIGHT * DECODE_THREADS * (int)sizeof(typename CacheLoad<Elem>::Raw);
    static constexpr int STATE_BYTES = DecodeConfig<HEAD_DIM>::STATE_BYTES;
    static constexpr int BYTES = RING_BYTES > STATE_BYTES ? RING_BYTES : STATE_BYTES;
    static_assert(BYTES <= 48 * 1024, "more dynamic shared memory than a launch gets without opting in");
};

// This thread's slot for key i's K (kv 0) or V (kv 1) in a stage: neighbouring threads' slots adjacent,
// so that a warp's copies and reads meet every bank once.
__device__ int ring_slot(int stage, int kv, int i) {
    return ((stage * 2 + kv) * KEYS_IN_FLIGHT + i) * DECODE_THREADS + threadIdx.x;
}

// The pages of this thread's keys of the step from step0 (a key past the split's end: the split's last).
template <int HEAD_DIM>
__device__ void pages_of(int (&pages)[KEYS_IN_FLIGHT], const int *seq_table, int step0, int key_end, PageDiv page_size) {
    const int group = threadIdx.x / DecodeConfig<HEAD_DIM>::LANES_PER_KEY;
#pragma unroll
    for (int i = 0; i < KEYS_IN_FLIGHT; i++)
        pages[i] = seq_table[page_index(min(step0 + i * DecodeConfig<HEAD_DIM>::KEYS_AT_ONCE + group, key_end - 1), page_size)];
}

// This thread's 8 elements of K and V of the step's keys copied into its slots of a stage, not waited
// for: one group of copies, committed also where the split has no such step, since a thread counts its
// own groups and its wait for "all but the newest STAGES - 1" must mean this step.
template <int HEAD_DIM, typename Elem>
__device__ void copy_step(typename CacheLoad<Elem>::Raw *ring, int stage, const Elem *k_pool, const Elem *v_pool,
                          const int (&pages)[KEYS_IN_FLIGHT], int step0, int key_end, const DecodeShape &s,
                          int kv_head, PageDiv pd) {
    typedef DecodeConfig<HEAD_DIM> Cfg;
    constexpr int RAW_BYTES = sizeof(typename CacheLoad<Elem>::Raw);
    const int group = threadIdx.x / Cfg::LANES_PER_KEY, dim0 = threadIdx.x % Cfg::LANES_PER_KEY * DIMS_PER_THREAD;
    if (step0 < key_end) {
#pragma unroll
        for (int i = 0; i < KEYS_IN_FLIGHT; i++) {
            const int t = min(step0 + i * Cfg::KEYS_AT_ONCE + group, key_end - 1);
            const size_t row = cache_row(pages[i], t, s.kv_heads, kv_head, pd, HEAD_DIM) + dim0;
            __pipeline_memcpy_async(&ring[ring_slot(stage, 0, i)], k_pool + row, RAW_BYTES);
            __pipeline_memcpy_async(&ring[ring_slot(stage, 1, i)], v_pool + row, RAW_BYTES);
        }
    }
    __pipeline_commit();
}

__device__ void unpack8(const uint4 raw, float (&x)[DIMS_PER_THREAD]) {
    const __half2 *h = (const __half2 *)&raw;
#pragma unroll
    for (int i = 0; i < DIMS_PER_THREAD / 2; i++) {
        const float2 f = __half22float2(h[i]);
        x[2 * i] = f.x, x[2 * i + 1] = f.y;
    }
}

// The same from e4m3: four pairs, each one e4m3x2 -> f16x2 conversion (an instruction from sm_89; the
// sm_80 build has cuda_fp8.h's software conversion, never run: the harness skips e4m3 there).
__device__ void unpack8(const uint2 raw, float (&x)[DIMS_PER_THREAD]) {
    const __nv_fp8x2_storage_t *pairs = (const __nv_fp8x2_storage_t *)&raw;
#pragma unroll
    for (int i = 0; i < DIMS_PER_THREAD / 2; i++) {
        const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3)));
        x[2 * i] = f.x, x[2 * i + 1] = f.y;
    }
}

// The step's PAIRS partial dot products of this lane, summed over the key's LANES lanes as a transpose:
// at each level a lane sends half of what it holds to its partner and adds the partner's half to the
// other, so that lane l ends with the whole sums of pairs l x PER_LANE ... in v[0 .. PER_LANE - 1].
template <int LANES, int HALF = PAIRS / 2>
__device__ void sum_as_transpose(float (&v)[PAIRS], int lane) {
    constexpr int PER_LANE = PAIRS / LANES, PARTNER = HALF / PER_LANE;  // the partner lane: PARTNER away
    const bool upper = lane & PARTNER;
#pragma unroll
    for (int x = 0; x < HALF; x++) {
        const float send = upper ? v[x] : v[x + HALF], keep = upper ? v[x + HALF] : v[x];
        v[x] = keep + __shfl_xor_sync(0xffffffff, send, PARTNER);
    }
    // The next level as a template of its own, not a loop: every index stays a constant (in a loop the
    // compiler put v in local memory once the ring's code was in the kernel).
    if constexpr (HALF / 2 >= PER_LANE) sum_as_transpose<LANES, HALF / 2>(v, lane);
}

// Over the lanes holding the other keys of this lane's row (ROW_LANES apart): the max, and the sum.
template <int LANES, int ROW_LANES>
__device__ float row_max_of(float x) {
#pragma unroll
    for (int offset = ROW_LANES; offset < LANES; offset *= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, offset));
    return x;
}
template <int LANES, int ROW_LANES>
__device__ float row_sum_of(float x) {
#pragma unroll
    for (int offset = ROW_LANES; offset < LANES; offset *= 2) x += __shfl_xor_sync(0xffffffff, x, offset);
    return x;
}

#if VAR_FUSED
// One row's splits (sequence, query head, query) merged by one warp into O and LSE: the max by shuffles,
// then each lane sums its HEAD_DIM / 32 dims over every split, UNROLL splits' loads in flight.
template <int HEAD_DIM>
__device__ void merge_row_by_warp(const DecodeArgs &args, const float *part_o, const float *part_max,
                                  const float *part_sum, int used, size_t first, size_t row) {
    constexpr int DIMS = HEAD_DIM / 32;
    const int lane = threadIdx.x % 32;
    float merged_max = -INFINITY;
    for (int split = lane; split < used; split += 32) merged_max = fmaxf(merged_max, __ldcg(&part_max[first + split]));
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2)
        merged_max = fmaxf(merged_max, __shfl_xor_sync(0xffffffff, merged_max, offset));
    float sum = 0.0f, value[DIMS];
#pragma unroll
    for (int d = 0; d < DIMS; d++) value[d] = 0.0f;
#pragma unroll 8
    for (int split = 0; split < used; split++) {
        const float weight = exp2f(__ldcg(&part_max[first + split]) - merged_max);  // a split that saw no key: 0
        sum += __ldcg(&part_sum[first + split]) * weight;
#pragma unroll
        for (int d = 0; d < DIMS; d++) value[d] += __ldcg(&part_o[(first + split) * HEAD_DIM + lane * DIMS + d]) * weight;
    }
#pragma unroll
    for (int d = 0; d < DIMS; d++) args.o[row * HEAD_DIM + lane * DIMS + d] = __float2half_rn(value[d] / sum);
    if (lane == 0) args.lse[row] = (merged_max + log2f(sum)) * LN2;
}
#endif

template <int HEAD_DIM, typename Elem>
__global__ void __launch_bounds__(DECODE_THREADS, 4)
    split_kernel(DecodeArgs args, const Elem *k_pool, const Elem *v_pool, const float *k_scale, const float *v_scale,
                 float *part_o, float *part_max, float *part_sum, int splits, int keys_per_split, float scale_log2, PageDiv pd,
                 int *counters) {
#if VAR_PDL && __CUDA_ARCH__ >= 900
    cudaTriggerProgrammaticLaunchCompletion();
#endif
    typedef DecodeConfig<HEAD_DIM> Cfg;
    typedef typename CacheLoad<Elem>::Raw Raw;
    extern __shared__ __align__(128) unsigned char smem[];  // the ring, then the states (SplitSmem)
    Raw *ring = (Raw *)smem;                                // [stage][K, V][key of the step][thread]
    float *states = (float *)smem;                          // [group][row of the chunk][HEAD_DIM O, max, sum]
    const DecodeShape &s = args.shape;
    const int split = blockIdx.x, kv_head = blockIdx.y, seq = blockIdx.z;
    const int group_size = s.q_heads / s.kv_heads, rows = group_size * s.new_tokens, length = args.lengths[seq];
    const int key0 = split * keys_per_split, key_end = min(length, key0 + keys_per_split);
    if (key0 >= length) return;  // past this sequence's cache: the merge reads only its own splits
    const int group = threadIdx.x / Cfg::LANES_PER_KEY, lane = threadIdx.x % Cfg::LANES_PER_KEY;
    const int dim0 = lane * DIMS_PER_THREAD;
    const float q_scale = scale_log2 * CacheLoad<Elem>::scale(k_scale, kv_head);
    const float o_scale = CacheLoad<Elem>::scale(v_scale, kv_head);

    // Row r of the KV head: query head kv_head * g + r / Nq, its new query r % Nq.
    for (int chunk0 = 0; chunk0 < rows; chunk0 += QUERY_CHUNK) {
        // This thread's 8 dims of each row of the chunk, pre-scaled to the log2 domain and by K's scale.
        float q[QUERY_CHUNK][DIMS_PER_THREAD], o[QUERY_CHUNK][DIMS_PER_THREAD];
#pragma unroll
        for (int j = 0; j < QUERY_CHUNK; j++) {
            const int row = min(chunk0 + j, rows - 1);  // a chunk's missing rows repeat the last
            const int head = kv_head * group_size + row / s.new_tokens, query = row % s.new_tokens;
            unpack8(
                *(const uint4 *)(args.q + (((size_t)seq * s.q_heads + head) * s.new_tokens + query) * HEAD_DIM + dim0),
                q[j]);
#pragma unroll
            for (int d = 0; d < DIMS_PER_THREAD; d++) q[j][d] *= q_scale, o[j][d] = 0.0f;
        }
        // The rows of the pairs this lane finishes (pair x: row x % QUERY_CHUNK), the same at every step: the
        // last key each sees (its query's position: length - Nq + query), and its running max and sum.
        float own_max[Cfg::PER_LANE], own_sum[Cfg::PER_LANE];
        int own_last[Cfg::PER_LANE];
#pragma unroll
        for (int r = 0; r < Cfg::PER_LANE; r++) {
            const int row = min(chunk0 + (lane * Cfg::PER_LANE + r) % QUERY_CHUNK, rows - 1);
            own_last[r] = length - s.new_tokens + row % s.new_tokens;
            own_max[r] = -INFINITY, own_sum[r] = 0.0f;
        }
        // The group's keys: key0 + group, then every KEYS_AT_ONCE-th; every group takes the same number
        // of steps (a key past the split's end reads the split's last key again and counts for nothing),
        // so that the lanes of a warp meet at each shuffle. The first STAGES - 1 steps' copies start now;
        // each step then starts the copies of the step STAGES - 1 ahead, into the stage the step before
        // read, and loads the page numbers of the one after that, before it waits for its own keys.
        const int *seq_table = args.block_table + (size_t)seq * s.max_pages;
        const int step_keys = KEYS_IN_FLIGHT * Cfg::KEYS_AT_ONCE;
        int pages[KEYS_IN_FLIGHT];  // of the next step to copy
#pragma unroll
        for (int ahead = 0; ahead < STAGES - 1; ahead++) {
            pages_of<HEAD_DIM>(pages, seq_table, key0 + ahead * step_keys, key_end, pd);
            copy_step<HEAD_DIM>(ring, ahead, k_pool, v_pool, pages, key0 + ahead * step_keys, key_end, s, kv_head, pd);
        }
        pages_of<HEAD_DIM>(pages, seq_table, key0 + (STAGES - 1) * step_keys, key_end, pd);
        int stage = 0;  // this step's
        for (int step0 = key0; step0 < key_end; step0 += step_keys, stage = (stage + 1) % STAGES) {
            const int ahead0 = step0 + (STAGES - 1) * step_keys;
            copy_step<HEAD_DIM>(ring, (stage + STAGES - 1) % STAGES, k_pool, v_pool, pages, ahead0, key_end, s,
                                kv_head, pd);
            pages_of<HEAD_DIM>(pages, seq_table, ahead0 + step_keys, key_end, pd);
            __pipeline_wait_prior(STAGES - 1);  // this step's copies have landed (all but the newest two groups)
            asm volatile("" ::: "memory");      // the wait is no compiler barrier: no read of the ring moves above it
            float v[PAIRS];  // the step's partial dot products, then (the first PER_LANE) this lane's scores
#pragma unroll
            for (int i = 0; i < KEYS_IN_FLIGHT; i++) {
                float k[DIMS_PER_THREAD];
                unpack8(ring[ring_slot(stage, 0, i)], k);
#pragma unroll
                for (int j = 0; j < QUERY_CHUNK; j++) {
                    v[i * QUERY_CHUNK + j] = 0.0f;
#pragma unroll
                    for (int d = 0; d < DIMS_PER_THREAD; d++)
                        v[i * QUERY_CHUNK + j] = fmaf(q[j][d], k[d], v[i * QUERY_CHUNK + j]);
                }
            }
            sum_as_transpose<Cfg::LANES_PER_KEY>(v, lane);
            // This lane's pairs: masked, then one online-softmax update of their rows with the rows' other lanes.
            float rescale[Cfg::PER_LANE], prob[Cfg::PER_LANE];
#pragma unroll
            for (int r = 0; r < Cfg::PER_LANE; r++) {
                const int t = step0 + (lane * Cfg::PER_LANE + r) / QUERY_CHUNK * Cfg::KEYS_AT_ONCE + group;
                const float score = (t >= key_end || t > own_last[r]) ? -INFINITY : v[r];
                const float new_max = fmaxf(own_max[r], row_max_of<Cfg::LANES_PER_KEY, Cfg::ROW_LANES>(score));
                rescale[r] = new_max == -INFINITY ? 1.0f : exp2f(own_max[r] - new_max);
                prob[r] = new_max == -INFINITY ? 0.0f : exp2f(score - new_max);
                own_sum[r] = own_sum[r] * rescale[r] + row_sum_of<Cfg::LANES_PER_KEY, Cfg::ROW_LANES>(prob[r]);
                own_max[r] = new_max;
            }
            // Every lane's O: each row rescaled once, then the step's probabilities times V, each from its lane.
#pragma unroll
            for (int j = 0; j < QUERY_CHUNK; j++) {
                const float row_rescale =
                    __shfl_sync(0xffffffff, rescale[j % Cfg::PER_LANE], j / Cfg::PER_LANE, Cfg::LANES_PER_KEY);
#pragma unroll
                for (int d = 0; d < DIMS_PER_THREAD; d++) o[j][d] *= row_rescale;
            }
#pragma unroll
            for (int i = 0; i < KEYS_IN_FLIGHT; i++) {
                float vv[DIMS_PER_THREAD];
                unpack8(ring[ring_slot(stage, 1, i)], vv);
#pragma unroll
                for (int j = 0; j < QUERY_CHUNK; j++) {
                    const int x = i * QUERY_CHUNK + j;
                    const float p =
                        __shfl_sync(0xffffffff, prob[x % Cfg::PER_LANE], x / Cfg::PER_LANE, Cfg::LANES_PER_KEY);
#pragma unroll
                    for (int d = 0; d < DIMS_PER_THREAD; d++) o[j][d] = fmaf(p, vv[d], o[j][d]);
                }
            }
        }
        __pipeline_wait_prior(0);
        __syncthreads();  // every thread's last reads of the ring are done: the states take its place
        // The groups' states into shared memory, then the split's partial: thread d < HEAD_DIM combines dim d,
        // its O times V's scale.
        float *mine = states + group * Cfg::STATE_FLOATS;
#pragma unroll
        for (int j = 0; j < QUERY_CHUNK; j++) {
#pragma unroll
            for (int d = 0; d < DIMS_PER_THREAD; d++) mine[j * (HEAD_DIM + 2) + dim0 + d] = o[j][d];
            if (lane == j / Cfg::PER_LANE)  // the lane of pair j (key 0, row j) holds row j's max and sum
                mine[j * (HEAD_DIM + 2) + HEAD_DIM] = own_max[j % Cfg::PER_LANE],
                                          mine[j * (HEAD_DIM + 2) + HEAD_DIM + 1] = own_sum[j % Cfg::PER_LANE];
        }
        __syncthreads();
        for (int item = threadIdx.x; item < QUERY_CHUNK * HEAD_DIM; item += DECODE_THREADS) {
            const int j = item / HEAD_DIM, d = item % HEAD_DIM, row = chunk0 + j;
            if (row >= rows) continue;
            const int head = kv_head * group_size + row / s.new_tokens, query = row % s.new_tokens;
            const int batch_head = seq * s.q_heads + head;
            float block_max = -INFINITY;
            for (int g = 0; g < Cfg::KEYS_AT_ONCE; g++)
                block_max = fmaxf(block_max, states[g * Cfg::STATE_FLOATS + j * (HEAD_DIM + 2) + HEAD_DIM]);
            float sum = 0.0f, value = 0.0f;
            for (int g = 0; g < Cfg::KEYS_AT_ONCE && block_max > -INFINITY; g++) {  // none seen: (-inf, 0, 0)
                const float *state = states + g * Cfg::STATE_FLOATS + j * (HEAD_DIM + 2);
                const float weight = exp2f(state[HEAD_DIM] - block_max);
                sum += state[HEAD_DIM + 1] * weight;
                value += state[d] * weight;
            }
            const size_t at = partial_index(batch_head, query, s.new_tokens, split, splits);
            part_o[at * HEAD_DIM + d] = value * o_scale;
            if (d == 0) part_max[at] = block_max, part_sum[at] = sum;
        }
        __syncthreads();  // the states are read before the next chunk writes them
    }
#if VAR_FUSED
    // Every partial of this block written; the last of its (sequence, KV head)'s splits to arrive merges
    // them: each warp a row of the KV head's g x Nq rows at a time.
    __threadfence();
    __syncthreads();
    int arrived = 0;
    if (threadIdx.x == 0) arrived = atomicAdd(&counters[seq * s.kv_heads + kv_head], 1) + 1;
    const int used = min(ceil_div(length, keys_per_split), splits);
    if (!__syncthreads_or(arrived == used)) return;
    __threadfence();
    for (int row = threadIdx.x / 32; row < rows; row += DECODE_THREADS / 32) {
        const int head = kv_head * group_size + row / s.new_tokens, query = row % s.new_tokens;
        const int batch_head = seq * s.q_heads + head;
        merge_row_by_warp<HEAD_DIM>(args, part_o, part_max, part_sum, used,
                                    partial_index(batch_head, query, s.new_tokens, 0, splits),
                                    (size_t)batch_head * s.new_tokens + query);
    }
#else
    (void)counters;
#endif
}

// --- (2) the splits merged: O and LSE ------------------------------------------------------
// One block per (query head, sequence) of MERGE_THREADS threads: HEAD_DIM dims x PARTS parts, part p
// summing splits p, p + PARTS, ... so that many partials are read at once; the parts then added in
// shared memory. The splits' common max first, by the whole block.
// The largest x of the block: each warp's by shuffles, then the warps' through shared memory.
__device__ float block_max(float x, float *scratch) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, offset));
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
    __syncthreads();
    x = -INFINITY;
    for (int w = 0; w < MERGE_THREADS / 32; w++) x = fmaxf(x, scratch[w]);
    return x;
}

template <int HEAD_DIM>
__global__ void __launch_bounds__(MERGE_THREADS)
    merge_kernel(DecodeArgs args, const float *part_o, const float *part_max, const float *part_sum, int splits,
                 int keys_per_split) {
    constexpr int PARTS = MERGE_THREADS / HEAD_DIM;
    __shared__ float scratch[MERGE_THREADS / 32], values[PARTS][HEAD_DIM], sums[PARTS];
    const DecodeShape &s = args.shape;
    const int head = blockIdx.x, seq = blockIdx.y, d = threadIdx.x % HEAD_DIM, part = threadIdx.x / HEAD_DIM;
    const int batch_head = seq * s.q_heads + head;
    const int used = ceil_div(args.lengths[seq], keys_per_split);  // this sequence's splits
#if VAR_PDL && __CUDA_ARCH__ >= 900
    cudaGridDependencySynchronize();  // the split kernel's partials, complete and visible
#endif
    for (int query = 0; query < s.new_tokens; query++) {
        const size_t first = partial_index(batch_head, query, s.new_tokens, 0, splits);
        float mine = -INFINITY;
        for (int split = threadIdx.x; split < used; split += MERGE_THREADS) mine = fmaxf(mine, part_max[first + split]);
        const float merged_max = block_max(mine, scratch);
        float sum = 0.0f, value = 0.0f;
#pragma unroll 4
        for (int split = part; split < used; split += PARTS) {
            const float weight = exp2f(part_max[first + split] - merged_max);  // a split that saw no key: 0
            sum += part_sum[first + split] * weight;
            value += part_o[(first + split) * HEAD_DIM + d] * weight;
        }
        values[part][d] = value;
        if (d == 0) sums[part] = sum;
        __syncthreads();
        if (part == 0) {
            for (int p = 1; p < PARTS; p++) value += values[p][d], sum += sums[p];
            const size_t row = (size_t)batch_head * s.new_tokens + query;
            args.o[row * HEAD_DIM + d] = __float2half_rn(value / sum);
            if (d == 0) args.lse[row] = (merged_max + log2f(sum)) * LN2;
        }
        __syncthreads();  // scratch, values and sums are read before the next query writes them
    }
}

// --- Launcher ----------------------------------------------------------------------------------
// The partials: O (HEAD_DIM floats), max and sum for each (sequence, head, query, split), sized for
// the most splits a run can take (KEYS_PER_STEP keys each), whatever the rule below chooses.
static size_t partials_bytes(const DecodeShape *shape, int max_length) {
    const size_t partials =
        (size_t)shape->batch * shape->q_heads * shape->new_tokens * ceil_div(max_length, KEYS_PER_STEP);
    return partials * (shape->headdim + 2) * sizeof(float);
}
static size_t decode_workspace_bytes(const DecodeShape *shape, int max_length) {
#if VAR_FUSED
    return partials_bytes(shape, max_length) + (size_t)shape->batch * shape->kv_heads * sizeof(int);
#else
    return partials_bytes(shape, max_length);
#endif
}

// The split blocks this GPU holds at once (SMs x blocks an SM), asked of the runtime once per device and
// kept: decode runs at every layer of every generated token, and the answer does not change. First the
// split kernel asks for the most shared memory an SM can give (on an H100, four blocks of 48 KiB rings:
// 192 KiB of 228), so this runs before its first launch on a device.
#define MAX_DEVICES 64
template <int HEAD_DIM, typename Elem>
static cudaError_t resident_blocks(int *blocks) {
    static int known[MAX_DEVICES];  // 0: not asked yet (read and written atomically: any host thread may decode)
    int device = 0, sms = 0, per_sm = 0;
    RETURN_IF_ERROR(cudaGetDevice(&device));
    const int slot = device < MAX_DEVICES ? device : -1;
    if (slot >= 0 && (*blocks = __atomic_load_n(&known[slot], __ATOMIC_RELAXED))) return cudaSuccess;
    RETURN_IF_ERROR(cudaFuncSetAttribute(split_kernel<HEAD_DIM, Elem>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                         cudaSharedmemCarveoutMaxShared));
    RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, split_kernel<HEAD_DIM, Elem>, DECODE_THREADS,
                                                                  SplitSmem<HEAD_DIM, Elem>::BYTES));
    *blocks = sms * per_sm;
    if (slot >= 0) __atomic_store_n(&known[slot], *blocks, __ATOMIC_RELAXED);
    return cudaSuccess;
}

// Keys per split: the count of splits that takes the least time by a simple model, waves x (keys a
// split + BLOCK_COST_KEYS), the waves those of the blocks (splits x KV heads x sequences, every sequence
// counted as the longest) over the blocks this GPU holds at once; a split a whole number of steps of
// its groups' keys, and at least KEYS_PER_STEP keys. KEYS_PER_STEP where a block passes over its keys
// more than once (g x Nq rows over QUERY_CHUNK), so that the later passes find the split's keys still in L2.
template <int HEAD_DIM>
static int plan_splits(const DecodeShape *s, int max_length, int resident) {
    int keys_per_split = KEYS_PER_STEP;
    if (s->q_heads / s->kv_heads * s->new_tokens > QUERY_CHUNK) return keys_per_split;
    if (resident < 1) return keys_per_split;  // the kernel fits no SM: its launch reports it
    const long long heads = (long long)s->batch * s->kv_heads;
    const int step_keys = KEYS_IN_FLIGHT * DecodeConfig<HEAD_DIM>::KEYS_AT_ONCE;
    long long best = -1;
    for (int wanted = 1; wanted <= ceil_div(max_length, KEYS_PER_STEP); wanted++) {
        const int keys = max(KEYS_PER_STEP, ceil_div(ceil_div(max_length, wanted), step_keys) * step_keys);
        const long long blocks = heads * ceil_div(max_length, keys);  // more, never fewer, as wanted grows
        // Past here even perfectly packed waves cost more than the best: stop (3-97 steps at the
        // README's shapes, where a step for every 256 keys would be up to 512, on every decoding call).
        if (best >= 0 && (heads * max_length + blocks * BLOCK_COST_KEYS) / resident >= best) break;
        const long long cost = (blocks + resident - 1) / resident * (keys + BLOCK_COST_KEYS);
        if (best < 0 || cost < best) best = cost, keys_per_split = keys;
    }
    return keys_per_split;
}

// The split kernel on the pools of this cache's element (fp16: DecodeArgs' k_pool, v_pool and no scales;
// e4m3: DecodeE4m3's pools and scales).
template <int HEAD_DIM, typename Elem>
static cudaError_t launch_decode(const DecodeArgs *args, const Elem *k_pool, const Elem *v_pool, const float *k_scale,
                                 const float *v_scale, cudaStream_t stream) {
    const DecodeShape *s = &args->shape;
    int resident = 0;
    RETURN_IF_ERROR((resident_blocks<HEAD_DIM, Elem>(&resident)));
#ifdef FORCE_KEYS
    static_assert(FORCE_KEYS >= KEYS_PER_STEP, "the workspace holds splits of KEYS_PER_STEP keys or more");
    const int keys_per_split = FORCE_KEYS;
    (void)resident;
#else
    const int keys_per_split = plan_splits<HEAD_DIM>(s, args->max_length, resident);
#endif
    const int splits = ceil_div(args->max_length, keys_per_split);
    const size_t partials = (size_t)s->batch * s->q_heads * s->new_tokens * splits;
    float *part_o = (float *)args->workspace, *part_max = part_o + partials * HEAD_DIM, *part_sum = part_max + partials;
    int *counters = (int *)((char *)args->workspace + partials_bytes(s, args->max_length));
#if VAR_FUSED
    RETURN_IF_ERROR(cudaMemsetAsync(counters, 0, (size_t)s->batch * s->kv_heads * sizeof(int), stream));
#endif
    split_kernel<HEAD_DIM, Elem>
        <<<dim3(splits, s->kv_heads, s->batch), DECODE_THREADS, SplitSmem<HEAD_DIM, Elem>::BYTES, stream>>>(
            *args, k_pool, v_pool, k_scale, v_scale, part_o, part_max, part_sum, splits, keys_per_split,
            s->scale * LOG2E, page_div(s->page_size), counters);
    RETURN_IF_ERROR(cudaGetLastError());
#if VAR_FUSED
    return cudaSuccess;
#endif
#if VAR_PDL
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(s->q_heads, s->batch);
    config.blockDim = dim3(MERGE_THREADS);
    config.stream = stream;
    cudaLaunchAttribute attribute;
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    config.attrs = &attribute;
    config.numAttrs = 1;
    RETURN_IF_ERROR(cudaLaunchKernelEx(&config, merge_kernel<HEAD_DIM>, *args, (const float *)part_o,
                                       (const float *)part_max, (const float *)part_sum, splits, keys_per_split));
#else
    merge_kernel<HEAD_DIM><<<dim3(s->q_heads, s->batch), MERGE_THREADS, 0, stream>>>(*args, part_o, part_max, part_sum,
                                                                                     splits, keys_per_split);
#endif
    return cudaGetLastError();
}

// By head dim and by the cache's element: an e4m3 cache is one that DecodeArgs.e4m3 gives.
static cudaError_t decode(const DecodeArgs *args, cudaStream_t stream) {
    const DecodeE4m3 *c = args->e4m3;
    switch (args->shape.headdim) {
    case 64:
        return c ? launch_decode<64>(args, c->k_pool, c->v_pool, c->k_scale, c->v_scale, stream)
                 : launch_decode<64>(args, args->k_pool, args->v_pool, (const float *)NULL, (const float *)NULL,
                                     stream);
    case 128:
        return c ? launch_decode<128>(args, c->k_pool, c->v_pool, c->k_scale, c->v_scale, stream)
                 : launch_decode<128>(args, args->k_pool, args->v_pool, (const float *)NULL, (const float *)NULL,
                                      stream);
    default: return cudaErrorInvalidValue;
    }
}

static const Decode decode_pass = {decode_workspace_bytes, decode, 1};  // 1: it reads an e4m3 cache too

const Chapter chapter = {
    "v12",
    "decoding: a few new queries against a paged KV cache (fp16 or e4m3), its keys split across blocks and merged",
    PRECISION_FP16_TC,
    80,
    0,     // no upper bound
    NULL,  // the forward needs no workspace
    NULL,  // nothing to prepare
    forward,
    NULL,  // not an FP8 chapter
    NULL,  // no backward pass
    &decode_pass,
};
