// The harness's --kv-cache e4m3 quantisation of a decoding pool, host code in a header of its own so
// that a test program (tests/fixtures/kv_cache_e4m3.cu) compiles the very same function.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <math.h>
#include <stddef.h>

// A pool [pages][kv_heads][run] (run = P x D, one KV head's rows of a page) as e4m3 codes. Per KV head
// h, scale_h = max |x| over h's rows of every page / 448 (e4m3's largest; 1 where they are all zero),
// and each x becomes the e4m3 of x / scale_h, both in float32, rounded to nearest even and saturated
// (common/reference.py quantize_cache_e4m3 does the same, bit for bit).
static void quantize_pool_e4m3(const __half *pool, long long pages, int kv_heads, size_t run, __nv_fp8_storage_t *codes,
                               float *scales) {
    for (int h = 0; h < kv_heads; h++) {
        float amax = 0.0f;
        for (long long page = 0; page < pages; page++) {
            const __half *x = pool + ((size_t)page * kv_heads + h) * run;
            for (size_t i = 0; i < run; i++) amax = fmaxf(amax, fabsf(__half2float(x[i])));
        }
        scales[h] = amax > 0.0f ? amax / 448.0f : 1.0f;
        for (long long page = 0; page < pages; page++) {
            const size_t at = ((size_t)page * kv_heads + h) * run;
            for (size_t i = 0; i < run; i++)
                codes[at + i] =
                    __nv_cvt_float_to_fp8(__half2float(pool[at + i]) / scales[h], __NV_SATFINITE, __NV_E4M3);
        }
    }
}
