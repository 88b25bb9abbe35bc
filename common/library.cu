// The chapters as libraries: common/library.h's C ABI over one chapter's `chapter`, linked with its
// attention.cu into BUILD/lib/NN_name.so (`make lib`). No command line, no allocation, no
// synchronisation, no output: what the harness (common/harness.cu) does around a chapter's launchers
// is the caller's, except the checks, which are the harness's own (common/shape.h) and answer a code
// and a line (fa_last_error) instead of exiting.
#define HARNESS_SOURCE  // harness.h: the exercise stub's variable and reader belong to the chapter
#include "harness.h"
#include "library.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>

static_assert(sizeof(FaShape) == 6 * 4, "FaShape is six 4-byte fields, as common/library.h documents");
static_assert(sizeof(FaDecodeShape) == 40, "FaDecodeShape: six ints, a long long, an int and a float (torch_op.py)");
static_assert((int)FA_PRECISION_FP32 == (int)PRECISION_FP32 && (int)FA_PRECISION_FP16_TC == (int)PRECISION_FP16_TC &&
                  (int)FA_PRECISION_FP8_TC == (int)PRECISION_FP8_TC,
              "fa_precision() answers the harness's Precision");

static thread_local char last_error[1024];

// Record "<chapter>: <function>: <what>" as this thread's last error and return code.
static int fail(int code, const char *function, const char *fmt, ...) {
    int n = snprintf(last_error, sizeof last_error, "%s: %s: ", chapter.name, function);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof last_error) vsnprintf(last_error + n, sizeof last_error - n, fmt, ap);
    va_end(ap);
    return code;
}

// The shape (NULL, its dimensions, its scale), as the command line checks it.
static int check_shape(const char *function, const FaShape *shape) {
    char problem[256];
    if (!shape) return fail(FA_ERR_INVALID_ARGUMENT, function, "shape is NULL");
    if (shape_problem(shape, problem, sizeof problem) || scale_problem(shape->scale, problem, sizeof problem))
        return fail(FA_ERR_INVALID_ARGUMENT, function, "%s", problem);
    return FA_OK;
}

// A device pointer a call needs: not NULL, FA_ALIGNMENT-byte aligned.
static int check_pointer(const char *function, const char *name, const void *p) {
    if (!p) return fail(FA_ERR_INVALID_ARGUMENT, function, "%s is NULL: a device pointer is needed", name);
    if ((uintptr_t)p % FA_ALIGNMENT)
        return fail(FA_ERR_INVALID_ARGUMENT, function,
                    "%s (%p) is not %d-byte aligned: the kernels load %d bytes at once (cudaMalloc'd memory is)", name,
                    p, FA_ALIGNMENT, FA_ALIGNMENT);
    return FA_OK;
}

// The workspace a call was given against what it needs (sizer: the function that says how much): *use
// is what the chapter gets (NULL when it needs none, as the harness passes).
static int check_workspace(const char *function, const char *sizer, size_t need, void *workspace, size_t bytes,
                           void **use) {
    *use = NULL;
    if (!need) return FA_OK;
    if (!workspace)
        return fail(FA_ERR_INVALID_ARGUMENT, function, "workspace is NULL: this shape needs %zu bytes of it", need);
    if (bytes < need)
        return fail(FA_ERR_INVALID_ARGUMENT, function,
                    "workspace too small: %zu bytes given, this shape needs %zu (%s)", bytes, need, sizer);
    int code = check_pointer(function, "workspace", workspace);
    if (code == FA_OK) *use = workspace;
    return code;
}

// The current device: one there (FA_ERR_NO_GPU otherwise) whose compute capability the chapter runs
// on (FA_ERR_UNSUPPORTED_GPU), as the harness's require_gpu skips.
static int check_gpu(const char *function) {
    int device = 0, major = 0, minor = 0;
    const char *call = "cudaGetDevice";
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) {
        call = "cudaDeviceGetAttribute";
        err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
        if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    }
    if (err != cudaSuccess) {
        (void)cudaGetLastError();  // reported here, not left for the caller's next check
        const char *why = err == cudaErrorInsufficientDriver
                              ? "no CUDA driver found: this machine has no NVIDIA GPU, or its driver is older than "
                                "this CUDA runtime needs"
                          : err == cudaErrorNoDevice ? "the driver sees no device (CUDA_VISIBLE_DEVICES?)"
                                                     : "the device cannot be queried";
        return fail(FA_ERR_NO_GPU, function, "no usable CUDA GPU: %s (%s: %s)", why, call, cudaGetErrorString(err));
    }
    const int sm = major * 10 + minor;
    if (sm < chapter.min_sm || (chapter.max_sm && sm > chapter.max_sm)) {
        if (chapter.max_sm == chapter.min_sm)
            return fail(FA_ERR_UNSUPPORTED_GPU, function,
                        "needs an sm_%d GPU (its sm_%da code runs on no other), device %d is sm_%d", chapter.min_sm,
                        chapter.min_sm, device, sm);
        if (chapter.max_sm)
            return fail(FA_ERR_UNSUPPORTED_GPU, function, "needs sm_%d to sm_%d, device %d is sm_%d", chapter.min_sm,
                        chapter.max_sm, device, sm);
        return fail(FA_ERR_UNSUPPORTED_GPU, function, "needs sm_%d or newer, device %d is sm_%d", chapter.min_sm,
                    device, sm);
    }
    return FA_OK;
}

// What enqueueing answered: err from the chapter's launchers (`part` names the one that failed), else
// the launches' own error (cudaGetLastError, as the harness's run_pass reads it).
static int enqueued(const char *function, cudaError_t err, const char *part) {
    if (err == cudaSuccess) err = cudaGetLastError(), part = "a launch of the pass";
    else (void)cudaGetLastError();  // reported here, not left for the caller's next check
    if (err == cudaSuccess) return FA_OK;
    if (err == cudaErrorNoKernelImageForDevice)
        return fail(FA_ERR_UNSUPPORTED_GPU, function,
                    "this library has no kernel for this GPU: rebuild it for its architecture (make lib ARCH=sm_XY)");
    return fail(FA_ERR_CUDA, function, "CUDA error in %s: %s", part, cudaGetErrorString(err));
}

// Return a check's code from the enclosing function unless it is FA_OK.
#define CHECK(call)                       \
    do {                                  \
        int code_ = (call);               \
        if (code_ != FA_OK) return code_; \
    } while (0)

// One new token of one KV head a block, 16 bytes of its K row and of its V row a thread: into row
// pos % P of page block_table[b][pos / P], pos = lengths[b] - Nq + j.
static __global__ void append_kernel(FaDecodeShape s, const uint4 *k_new, const uint4 *v_new, const int *block_table,
                                     const int *lengths, uint4 *k_pool, uint4 *v_pool) {
    const int j = blockIdx.x, head = blockIdx.y, b = blockIdx.z, chunks = s.headdim / 8;  // 8 halves = 16 bytes
    const int pos = lengths[b] - s.new_tokens + j;
    if (pos < 0 || pos >= s.max_pages * s.page_size) return;  // lengths out of range: nothing written
    const long long page = block_table[(long long)b * s.max_pages + pos / s.page_size];
    if (page < 0 || page >= s.pages) return;  // a table entry outside the pool: nothing written
    const long long from = (((long long)b * s.kv_heads + head) * s.new_tokens + j) * chunks + threadIdx.x;
    const long long to = ((page * s.kv_heads + head) * s.page_size + pos % s.page_size) * chunks + threadIdx.x;
    k_pool[to] = k_new[from];
    v_pool[to] = v_new[from];
}

extern "C" {

FA_API int fa_abi_version(void) { return FA_ABI_VERSION; }
FA_API const char *fa_chapter_name(void) { return chapter.name; }
FA_API int fa_precision(void) { return (int)chapter.precision; }
FA_API int fa_has_backward(void) { return chapter.backward && chapter.backward->backward; }
FA_API int fa_has_decode(void) { return chapter.decode && chapter.decode->decode; }
FA_API int fa_min_sm(void) { return chapter.min_sm; }
FA_API int fa_max_sm(void) { return chapter.max_sm; }
FA_API const char *fa_last_error(void) { return last_error; }

FA_API int fa_workspace_bytes(const FaShape *shape, size_t *bytes) {
    const char *function = "fa_workspace_bytes";
    CHECK(check_shape(function, shape));
    if (!bytes) return fail(FA_ERR_INVALID_ARGUMENT, function, "bytes is NULL");
    *bytes = chapter.workspace_bytes ? chapter.workspace_bytes(shape) : 0;
    return FA_OK;
}

// No backward comes first, before anything about the arguments, as the command line says it.
static int check_backward(const char *function) {
    if (!chapter.backward)
        return fail(FA_ERR_NO_BACKWARD, function,
                    "this chapter has no backward pass: call it on a chapter that registers one (fa_has_backward)");
    if (!chapter.backward->backward)
        return fail(FA_ERR_NO_BACKWARD, function, "the chapter's Backward has no backward function");
    return FA_OK;
}

// The backward's mode: 0 or 1, as the shape's causal is; 1 only where the backward has that mode.
static int check_deterministic(const char *function, int deterministic) {
    if (deterministic != 0 && deterministic != 1)
        return fail(FA_ERR_INVALID_ARGUMENT, function, "deterministic = %d: expected 0 or 1", deterministic);
    if (deterministic && !chapter.backward->deterministic)
        return fail(FA_ERR_INVALID_ARGUMENT, function,
                    "this backward has no deterministic mode: pass 0, or call the chapter's library");
    return FA_OK;
}

// The backward's scratch for a shape in a mode, both already checked.
static size_t backward_need(const FaShape *shape, int deterministic) {
    return chapter.backward->workspace_bytes ? chapter.backward->workspace_bytes(shape, deterministic) : 0;
}

FA_API int fa_backward_workspace_bytes(const FaShape *shape, int deterministic, size_t *bytes) {
    const char *function = "fa_backward_workspace_bytes";
    CHECK(check_backward(function));
    CHECK(check_shape(function, shape));
    CHECK(check_deterministic(function, deterministic));
    if (!bytes) return fail(FA_ERR_INVALID_ARGUMENT, function, "bytes is NULL");
    *bytes = backward_need(shape, deterministic);
    return FA_OK;
}

FA_API int fa_forward(const FaShape *shape, const void *q, const void *k, const void *v, void *o, float *lse,
                      void *workspace, size_t workspace_bytes, void *stream) {
    const char *function = "fa_forward";
    CHECK(check_shape(function, shape));
    const char *names[5] = {"q", "k", "v", "o", "lse"};
    const void *pointers[5] = {q, k, v, o, lse};
    for (int i = 0; i < 5; i++) CHECK(check_pointer(function, names[i], pointers[i]));
    const size_t need = chapter.workspace_bytes ? chapter.workspace_bytes(shape) : 0;
    AttnArgs args = {*shape, (const __half *)q, (const __half *)k, (const __half *)v, (__half *)o, lse, NULL};
    CHECK(check_workspace(function, "fa_workspace_bytes", need, workspace, workspace_bytes, &args.workspace));
    CHECK(check_gpu(function));
    cudaStream_t s = (cudaStream_t)stream;
    cudaError_t err = chapter.prepare ? chapter.prepare(&args, s) : cudaSuccess;
    if (err != cudaSuccess) return enqueued(function, err, "the chapter's prepare");
    return enqueued(function, chapter.forward(&args, s), "the chapter's forward");
}

FA_API int fa_backward(const FaShape *shape, int deterministic, const void *q, const void *k, const void *v,
                       const void *o, const float *lse, const void *d_o, void *dq, void *dk, void *dv, void *workspace,
                       size_t workspace_bytes, void *stream) {
    const char *function = "fa_backward";
    CHECK(check_backward(function));
    CHECK(check_shape(function, shape));
    CHECK(check_deterministic(function, deterministic));
    const char *names[9] = {"q", "k", "v", "o", "lse", "d_o", "dq", "dk", "dv"};
    const void *pointers[9] = {q, k, v, o, lse, d_o, dq, dk, dv};
    for (int i = 0; i < 9; i++) CHECK(check_pointer(function, names[i], pointers[i]));
    BackwardArgs args = {*shape, (const __half *)q,   (const __half *)k, (const __half *)v, (const __half *)o,
                         lse,    (const __half *)d_o, (__half *)dq,      (__half *)dk,      (__half *)dv,
                         NULL,   deterministic};
    CHECK(check_workspace(function, "fa_backward_workspace_bytes", backward_need(shape, deterministic), workspace,
                          workspace_bytes, &args.workspace));
    CHECK(check_gpu(function));
    return enqueued(function, chapter.backward->backward(&args, (cudaStream_t)stream), "the chapter's backward");
}

// --- Decoding ---------------------------------------------------------------------------------------
// No decoding pass comes first, as for the backward.
static int check_decode(const char *function) {
    if (!chapter.decode || !chapter.decode->decode)
        return fail(FA_ERR_NO_DECODE, function,
                    "this chapter has no decoding pass: call it on 11_decode's library (fa_has_decode)");
    return FA_OK;
}

// The decoding shape and its longest sequence, as the command line checks them (the lengths themselves
// are on the device: their range is the caller's).
static int check_decode_shape(const char *function, const FaDecodeShape *shape, int max_length) {
    char problem[256];
    if (!shape) return fail(FA_ERR_INVALID_ARGUMENT, function, "shape is NULL");
    if (decode_shape_problem(shape, problem, sizeof problem) || scale_problem(shape->scale, problem, sizeof problem))
        return fail(FA_ERR_INVALID_ARGUMENT, function, "%s", problem);
    const long long capacity = (long long)shape->max_pages * shape->page_size;
    if (max_length < shape->new_tokens || max_length > capacity)
        return fail(FA_ERR_INVALID_ARGUMENT, function,
                    "max_length = %d: expected Nq = %d to the capacity of %lld tokens (%d pages of %d)", max_length,
                    shape->new_tokens, capacity, shape->max_pages, shape->page_size);
    return FA_OK;
}

// An int32 array in device memory: not NULL, 4-byte aligned.
static int check_int_pointer(const char *function, const char *name, const int *p) {
    if (!p) return fail(FA_ERR_INVALID_ARGUMENT, function, "%s is NULL: a device pointer is needed", name);
    if ((uintptr_t)p % sizeof(int))
        return fail(FA_ERR_INVALID_ARGUMENT, function, "%s (%p) is not 4-byte aligned: it holds int32", name, p);
    return FA_OK;
}

static size_t decode_need(const FaDecodeShape *shape, int max_length) {
    return chapter.decode->workspace_bytes ? chapter.decode->workspace_bytes(shape, max_length) : 0;
}

FA_API int fa_decode_workspace_bytes(const FaDecodeShape *shape, int max_length, size_t *bytes) {
    const char *function = "fa_decode_workspace_bytes";
    CHECK(check_decode(function));
    CHECK(check_decode_shape(function, shape, max_length));
    if (!bytes) return fail(FA_ERR_INVALID_ARGUMENT, function, "bytes is NULL");
    *bytes = decode_need(shape, max_length);
    return FA_OK;
}

FA_API int fa_decode(const FaDecodeShape *shape, int max_length, const void *q, const void *k_pool, const void *v_pool,
                     const int *block_table, const int *lengths, void *o, float *lse, void *workspace,
                     size_t workspace_bytes, void *stream) {
    const char *function = "fa_decode";
    CHECK(check_decode(function));
    CHECK(check_decode_shape(function, shape, max_length));
    const char *names[5] = {"q", "k_pool", "v_pool", "o", "lse"};
    const void *pointers[5] = {q, k_pool, v_pool, o, lse};
    for (int i = 0; i < 5; i++) CHECK(check_pointer(function, names[i], pointers[i]));
    CHECK(check_int_pointer(function, "block_table", block_table));
    CHECK(check_int_pointer(function, "lengths", lengths));
    DecodeArgs args = {*shape,
                       (const __half *)q,
                       (const __half *)k_pool,
                       (const __half *)v_pool,
                       block_table,
                       lengths,
                       max_length,
                       (__half *)o,
                       lse,
                       NULL};
    CHECK(check_workspace(function, "fa_decode_workspace_bytes", decode_need(shape, max_length), workspace,
                          workspace_bytes, &args.workspace));
    CHECK(check_gpu(function));
    return enqueued(function, chapter.decode->decode(&args, (cudaStream_t)stream), "the chapter's decode");
}

FA_API int fa_decode_append(const FaDecodeShape *shape, const void *k_new, const void *v_new, const int *block_table,
                            const int *lengths, void *k_pool, void *v_pool, void *stream) {
    const char *function = "fa_decode_append";
    CHECK(check_decode(function));
    CHECK(check_decode_shape(function, shape, shape ? shape->new_tokens : 0));
    const char *names[4] = {"k_new", "v_new", "k_pool", "v_pool"};
    const void *pointers[4] = {k_new, v_new, k_pool, v_pool};
    for (int i = 0; i < 4; i++) CHECK(check_pointer(function, names[i], pointers[i]));
    CHECK(check_int_pointer(function, "block_table", block_table));
    CHECK(check_int_pointer(function, "lengths", lengths));
    CHECK(check_gpu(function));
    append_kernel<<<dim3(shape->new_tokens, shape->kv_heads, shape->batch), shape->headdim / 8, 0,
                    (cudaStream_t)stream>>>(*shape, (const uint4 *)k_new, (const uint4 *)v_new, block_table, lengths,
                                            (uint4 *)k_pool, (uint4 *)v_pool);
    return enqueued(function, cudaGetLastError(), "the append's launch");
}

}  // extern "C"
