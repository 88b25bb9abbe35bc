// The contract between the shared harness (common/harness.cu) and a chapter.
//
// A chapter's attention.cu includes this header and defines one `Chapter`
// named `chapter`: its name, the idea it adds, its precision, the oldest GPU it
// runs on, how much scratch memory a shape needs, the forward launcher, and for
// a chapter with one, its backward pass.
// The harness owns everything else: CLI, inputs, device memory, checking
// against the NumPy reference, timing and the report.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stddef.h>

#include "shape.h"  // AttnShape: B, H, N, D, causal, scale (plain C: the libraries' ABI uses it too)

typedef struct {
    AttnShape shape;
    const __half *q, *k, *v;  // [B, H, N, D], contiguous, D fastest
    __half *o;                // [B, H, N, D]
    float *lse;               // [B, H, N]: natural-log sum of exp of each scaled score row
    void *workspace;          // chapter.workspace_bytes(shape) bytes, NULL when 0
} AttnArgs;

// What a backward pass gets (Chapter.backward, below): the forward's inputs and its output O and
// LSE (the chapter's own forward computed them, on these inputs), dO, and where dQ, dK, dV go.
typedef struct {
    AttnShape shape;
    const __half *q, *k, *v;  // [B, H, N, D], contiguous, D fastest (as the forward's)
    const __half *o;          // the forward's output, [B, H, N, D]
    const float *lse;         // the forward's LSE, [B, H, N], natural log
    const __half *d_o;        // dO, the gradient of the loss with respect to O, [B, H, N, D]
    __half *dq, *dk, *dv;     // [B, H, N, D]: every element written by every call
    void *workspace;          // chapter.backward->workspace_bytes(shape, deterministic) bytes, NULL when 0
    // 1: dQ, dK, dV bitwise the same on every call with the same inputs (a chapter's backward must
    // honour it; one that is always deterministic may ignore it). 0: any order of summation.
    int deterministic;
} BackwardArgs;

// Internal precision of a chapter: selects its tolerances and how the check reads them
// (common/harness.cu, precision_rule).
typedef enum { PRECISION_FP32 = 0, PRECISION_FP16_TC = 1, PRECISION_FP8_TC = 2 } Precision;

typedef struct {
    const char *name;  // the chapter directory, e.g. "04_fused"
    const char *adds;  // one line: the idea this chapter adds
    Precision precision;
    int min_sm, max_sm;  // compute capabilities it runs on, e.g. 80 for sm_80; max_sm 0: no upper
                         // bound (08 runs on sm_90 only: its sm_90a code runs on no other GPU)
    // Device scratch the forward needs (the harness allocates it; chapters never allocate).
    // NULL: none.
    size_t (*workspace_bytes)(const AttnShape *shape);
    // Optional (NULL: none): work on the inputs that `forward` needs done first, such as 08's
    // quantisation to FP8. Part of every timed forward, and also timed on its own.
    cudaError_t (*prepare)(const AttnArgs *args, cudaStream_t stream);
    // Enqueue one forward pass on `stream`; return the first CUDA error met.
    cudaError_t (*forward)(const AttnArgs *args, cudaStream_t stream);
    // FP8 chapters: how they quantise (below), so that the check's floor quantises as they do.
    // NULL for every other chapter.
    const struct Fp8Scaling *fp8 = NULL;
    // A chapter with a backward pass (below; `--backward` runs it): NULL for every other chapter.
    const struct Backward *backward = NULL;
    // A chapter that decodes (`--decode`: DecodeShape, common/shape.h): NULL for every chapter that
    // solves the forward problem only, which refuses --decode before any GPU work.
    const struct Decode *decode = NULL;
} Chapter;

// How an FP8 chapter quantises Q, K and V to e4m3, by head dim. The check's floor (common/
// reference.py) quantises the inputs the same way; without it (fp8 NULL) the floor assumes one
// scale per 128 rows of each tensor and e4m3's whole range.
struct Fp8Scaling {
    int (*scale_rows)(int headdim, int which);  // rows per scale of Q (which 0), of K and of V (1)
    int (*qk_range)(int headdim);               // the largest |e4m3| Q and K are scaled to (V's: 448)
};

// A chapter's backward pass: dQ, dK, dV of L = sum(O * dO) (common/reference.py backward). `--backward`
// runs the chapter's forward once for O and LSE (untimed), then this, checked and timed alone (CUDA
// events, the median of --iters, after --warmup runs) on the same buffers each time. So each call must
// compute dQ, dK and dV from nothing: it writes every element of them, and zeroes on `stream`, as part
// of the call, anything it accumulates into (dQ partial sums in the workspace, say), since the harness
// clears neither the workspace nor dQ, dK, dV between calls (before the checked call they are NaN).
// `--backward --deterministic` runs it with BackwardArgs.deterministic = 1: a run-time mode, not a build,
// of a backward that has it (`deterministic` below; a chapter's does, a step before it may not).
struct Backward {
    // Device scratch the backward needs in that mode (BackwardArgs.deterministic, which may need more;
    // the harness allocates it; chapters never allocate). NULL: none.
    size_t (*workspace_bytes)(const AttnShape *shape, int deterministic);
    // Enqueue one backward pass on `stream` alone (no other stream, no synchronisation: it is captured
    // into a graph to count its kernels); return the first CUDA error met.
    cudaError_t (*backward)(const BackwardArgs *args, cudaStream_t stream);
    // 1: it honours BackwardArgs.deterministic; 0: it has no such mode, and --deterministic is refused.
    int deterministic;
};

// A chapter's decoding pass (`--decode`, DecodeShape in common/shape.h): O and LSE of each sequence's
// Nq new queries against its paged KV cache, checked against common/reference.py decode and timed
// (CUDA events, the median of --iters after --warmup), GB/s of K and V read. The harness fills O and
// LSE with NaN before the checked call and clears nothing between calls.
typedef struct {
    DecodeShape shape;
    const __half *q;                // [B, Hq, Nq, D]
    const __half *k_pool, *v_pool;  // [pages, Hkv, P, D]
    const int *block_table;         // [B, max_pages]: entry i of sequence b is the page holding its tokens P·i ..
    const int *lengths;             // [B]: tokens cached per sequence, its Nq new ones the last
    int max_length;                 // the longest of them (the host's copy, for the grid)
    __half *o;                      // [B, Hq, Nq, D]
    float *lse;                     // [B, Hq, Nq], natural log
    void *workspace;                // decode->workspace_bytes(shape, max_length) bytes, NULL when 0
    // --kv-cache e4m3 (a Decode with e4m3_cache): the cache as e4m3 (DecodeE4m3, a host struct of device
    // pointers), k_pool and v_pool then NULL; NULL for an fp16 cache. One pointer, not the four: a kernel
    // that takes DecodeArgs by value compiles differently as the struct grows (11.4's split kernel: 128
    // registers on sm_90 with this, 135 with the four).
    const struct DecodeE4m3 *e4m3 = NULL;
} DecodeArgs;

// An e4m3 KV cache: the pools as e4m3 codes, [pages, Hkv, P, D] each, a value being its code times its
// KV head's scale.
struct DecodeE4m3 {
    const __nv_fp8_e4m3 *k_pool, *v_pool;
    const float *k_scale, *v_scale;  // [Hkv]
};

struct Decode {
    // Device scratch for a shape whose longest sequence caches max_length tokens. NULL: none.
    size_t (*workspace_bytes)(const DecodeShape *shape, int max_length);
    // Enqueue one decoding step on `stream` alone; return the first CUDA error met.
    cudaError_t (*decode)(const DecodeArgs *args, cudaStream_t stream);
    // 1: it reads an e4m3 cache too (DecodeArgs.e4m3: --kv-cache e4m3, sm_89 on); 0: fp16 only, and
    // --kv-cache e4m3 is refused.
    int e4m3_cache = 0;
};

extern const Chapter chapter;

// A chapter's launcher instantiated for each head dimension (kernels that take it as a
// template parameter): call the one for this shape. The harness has refused any other D.
typedef cudaError_t (*Launcher)(const AttnArgs *args, cudaStream_t stream);

static inline cudaError_t launch_for_head_dim(const AttnArgs *args, cudaStream_t stream, Launcher for_64,
                                              Launcher for_128) {
    switch (args->shape.headdim) {
    case 64: return for_64(args, stream);
    case 128: return for_128(args, stream);
    default: return cudaErrorInvalidValue;
    }
}

// The same for a backward pass's launcher.
typedef cudaError_t (*BackwardLauncher)(const BackwardArgs *args, cudaStream_t stream);

static inline cudaError_t backward_for_head_dim(const BackwardArgs *args, cudaStream_t stream, BackwardLauncher for_64,
                                                BackwardLauncher for_128) {
    switch (args->shape.headdim) {
    case 64: return for_64(args, stream);
    case 128: return for_128(args, stream);
    default: return cudaErrorInvalidValue;
    }
}

// Return the error of a CUDA call from the enclosing function if it failed.
#define RETURN_IF_ERROR(call)                 \
    do {                                      \
        cudaError_t err_ = (call);            \
        if (err_ != cudaSuccess) return err_; \
    } while (0)

static inline __host__ __device__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Exercises (`make exercise`, common/exercise_copy.py): a student copy of a chapter has each part left
// to write replaced by EXERCISE_TODO("NN.name") in device code. It compiles and runs; a kernel that
// reaches the stub records the name, and the harness then fails the run with "TODO: exercise
// NN.name is not written yet". The variable and its reader are the chapter's own (the harness
// includes this header with HARNESS_SOURCE defined), so the harness reads the chapter's copy.
#ifndef HARNESS_SOURCE
static __device__ const char *exercise_todo_name;  // the stub a kernel reached; NULL: none
#define EXERCISE_TODO(name) ((void)(exercise_todo_name = (name)))

// The name of the EXERCISE_TODO a kernel reached, or NULL: read after the harness's checked run.
const char *exercise_todo(void) {
    static char name[64];
    const char *at = NULL;
    if (cudaMemcpyFromSymbol(&at, exercise_todo_name, sizeof at) != cudaSuccess || !at) return NULL;
    size_t n = 0;  // the name is in device memory: copied a byte at a time, up to its end
    for (; n + 1 < sizeof name; n++)
        if (cudaMemcpy(&name[n], at + n, 1, cudaMemcpyDeviceToHost) != cudaSuccess || !name[n]) break;
    name[n] = 0;
    return name;
}
#else
const char *exercise_todo(void);
#endif
