// The chapters as libraries: the C ABI of BUILD/lib/NN_name.so (`make lib`), one chapter's forward
// (and backward, and decoding, where it has them) with no command line, no allocation and no
// synchronisation.
// Plain C, no CUDA header: device pointers and the stream are void * (a cudaStream_t; NULL: the
// legacy default stream). docs/design.md, "The chapters as libraries", states the contract.
//
// Tensors are what the harness gives a chapter (common/harness.h): Q, K, V, O, dO, dQ, dK, dV fp16
// [B, H, N, D] contiguous (D fastest), LSE fp32 [B, H, N] (natural log), all in device memory of
// the current device and FA_ALIGNMENT-byte aligned, as is the workspace. Every call returns FA_OK
// or one of the codes below, and never prints or exits; after a failure fa_last_error() says what
// failed, in one line.
#pragma once

#include <stddef.h>

#include "shape.h"  // AttnShape, the harness's own: B, H, N, D, causal, scale

#ifdef __cplusplus
extern "C" {
#endif

#define FA_ABI_VERSION 4  // fa_abi_version() of a library built from this header (3: decoding; 4: its append)
#define FA_ALIGNMENT 16   // bytes: every device pointer (the kernels load 16 bytes at once; TMA)

typedef AttnShape FaShape;          // scale: positive and normal (the CLI's 1/sqrt(D) is not implied)
typedef DecodeShape FaDecodeShape;  // decoding's shape (shape.h), its scale as FaShape's

enum {
    FA_OK = 0,
    FA_ERR_INVALID_ARGUMENT = 1,  // the shape (the CLI's rules), a NULL or misaligned pointer, a small workspace,
                                  // a `deterministic` other than 0 or 1
    FA_ERR_NO_BACKWARD = 2,       // fa_backward*: this chapter has no backward pass
    FA_ERR_NO_GPU = 3,            // no usable CUDA GPU (no driver, no device visible)
    FA_ERR_UNSUPPORTED_GPU = 4,   // this GPU's compute capability is outside fa_min_sm() .. fa_max_sm()
    FA_ERR_CUDA = 5,              // a CUDA error while enqueueing (message: cudaGetErrorString and where)
    FA_ERR_NO_DECODE = 6,         // fa_decode*: this chapter has no decoding pass
};

enum { FA_PRECISION_FP32 = 0, FA_PRECISION_FP16_TC = 1, FA_PRECISION_FP8_TC = 2 };  // fa_precision()

#if defined(__GNUC__)
#define FA_API __attribute__((visibility("default")))
#else
#define FA_API
#endif

FA_API int fa_abi_version(void);
FA_API const char *fa_chapter_name(void);  // the chapter's folder, e.g. "07_async_pipeline", or a step "08.3"
FA_API int fa_precision(void);             // FA_PRECISION_*: how it computes inside (its tolerances)
FA_API int fa_has_backward(void);          // 1: fa_backward runs; 0: it answers FA_ERR_NO_BACKWARD
FA_API int fa_has_decode(void);            // 1: fa_decode runs; 0: it answers FA_ERR_NO_DECODE
FA_API int fa_min_sm(void);                // the compute capabilities it runs on, e.g. 80 for sm_80 ...
FA_API int fa_max_sm(void);                // ... up to this one; 0: no upper bound

// The device scratch fa_forward (fa_backward, in its mode: see below) needs for this shape, into *bytes
// (0: none; pass any workspace then, NULL too). Checks the shape as fa_forward does; needs no GPU.
FA_API int fa_workspace_bytes(const FaShape *shape, size_t *bytes);
FA_API int fa_backward_workspace_bytes(const FaShape *shape, int deterministic, size_t *bytes);

// One forward on `stream`: the chapter's prepare (08: quantisation to FP8, into the workspace), then
// its forward, writing every element of O and LSE: exactly the harness's whole forward. Enqueued
// only: no allocation, no synchronisation.
FA_API int fa_forward(const FaShape *shape, const void *q, const void *k, const void *v, void *o, float *lse,
                      void *workspace, size_t workspace_bytes, void *stream);

// One backward on `stream`: dQ, dK, dV (every element written) of L = sum(O * dO), from Q, K, V and
// the O and LSE that this library's fa_forward made of them, and dO. Enqueued only, as above.
// deterministic 1: dQ, dK, dV bitwise the same on every call with the same inputs (the workspace is
// fa_backward_workspace_bytes's for that mode); 0: the chapter's fastest order of summation.
FA_API int fa_backward(const FaShape *shape, int deterministic, const void *q, const void *k, const void *v,
                       const void *o, const float *lse, const void *d_o, void *dq, void *dk, void *dv, void *workspace,
                       size_t workspace_bytes, void *stream);

// Decoding (11_decode): O [B, Hq, Nq, D] and LSE [B, Hq, Nq] of each sequence's Nq new queries q
// [B, Hq, Nq, D] against its paged cache: k_pool and v_pool [pages, Hkv, P, D] fp16, block_table
// [B, max_pages] and lengths [B] int32 in device memory (4-byte aligned), the new tokens already the
// last Nq of each sequence's lengths[b]. max_length is the longest length (the caller's host copy: it
// sizes the grid and the workspace; a smaller one than the device's longest misses keys and reads past
// the workspace); the lengths and the block table are read on the device and are the caller's to keep
// in range (the command line checks them: common/shape.h decode_cache_problem).
// Enqueued only, as above.
FA_API int fa_decode_workspace_bytes(const FaDecodeShape *shape, int max_length, size_t *bytes);
FA_API int fa_decode(const FaDecodeShape *shape, int max_length, const void *q, const void *k_pool, const void *v_pool,
                     const int *block_table, const int *lengths, void *o, float *lse, void *workspace,
                     size_t workspace_bytes, void *stream);

// Appending to the cache: each sequence's Nq new keys and values k_new, v_new [B, Hkv, Nq, D] fp16
// written into its pages as its last Nq tokens (positions lengths[b] - Nq .. lengths[b] - 1: the
// lengths already count them), where fa_decode then reads them; one small kernel on `stream`, so that
// a generation step appends and decodes a layer in two calls and no copies of its own. The block table
// and the lengths as fa_decode's (a position or a page out of range is not written). Enqueued only.
FA_API int fa_decode_append(const FaDecodeShape *shape, const void *k_new, const void *v_new, const int *block_table,
                            const int *lengths, void *k_pool, void *v_pool, void *stream);

// The last failure of this thread's calls, in one line ("" before any): "<chapter>: <function>: <what>".
FA_API const char *fa_last_error(void);

#ifdef __cplusplus
}
#endif
