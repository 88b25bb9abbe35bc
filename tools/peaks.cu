// peaks: the ceilings that docs/design.md quotes, measured on your own GPU.
//
//   fp32 FFMA on the CUDA cores                        what 01-05 compute with
//   fp16 mma.sync m16n8k16, fp32 accumulate            the warp-level tensor-core instruction of 06-07
//   fp16 wgmma m64n256k16, fp32 accumulate (sm_90a)    Hopper's warpgroup instruction, as 08 on fp16
//   e4m3 wgmma m64n256k32, fp32 accumulate (sm_90a)    the same in FP8, as 08
//   device-to-device copy                              the HBM bandwidth, bytes read + written
//
// Each kernel keeps its operands in registers or shared memory and issues its instruction back to
// back on independent accumulators, so that it measures the unit, not memory. One wave of blocks
// (as many as fit on the GPU at once), the loop trip count chosen so that one run takes about
// TARGET_MS; CUDA events around each run, WARMUP runs first, the median of RUNS. Inputs are random
// and non-zero. Usage: peaks [LOG_DIR] (also writes LOG_DIR/peaks_<gpu name>.log). Exit 0, 1 on a
// CUDA error, 77 when there is no GPU.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../common/gpu_files.h"

#define WARMUP 2
#define RUNS 7
#define TARGET_MS 25.0

#define CUDA_CHECK(call)                                                                        \
    do {                                                                                        \
        cudaError_t err_ = (call);                                                              \
        if (err_ != cudaSuccess) {                                                              \
            fprintf(stderr, "peaks: CUDA error in %s (%s:%d): %s\n", #call, __FILE__, __LINE__, \
                    cudaGetErrorString(err_));                                                  \
            exit(1);                                                                            \
        }                                                                                       \
    } while (0)

// --- fp32 FFMA: FFMA_CHAINS independent a = a * b + c per thread --------------------------------
#define FFMA_THREADS 256
#define FFMA_CHAINS 8
#define FFMA_UNROLL 16

__global__ void __launch_bounds__(FFMA_THREADS) ffma_kernel(const float *in, float *out, int iters) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const float b = in[t % 64], c = in[64 + t % 64] * 1e-3f;  // |b| < 1: the chains stay finite
    float a[FFMA_CHAINS];
    for (int j = 0; j < FFMA_CHAINS; j++) a[j] = in[128 + (t + j) % 64];
    for (int i = 0; i < iters; i++) {
#pragma unroll
        for (int u = 0; u < FFMA_UNROLL; u++)
#pragma unroll
            for (int j = 0; j < FFMA_CHAINS; j++) a[j] = fmaf(a[j], b, c);
    }
    float sum = 0.0f;
    for (int j = 0; j < FFMA_CHAINS; j++) sum += a[j];
    out[t] = sum;
}

// --- fp16 mma.sync m16n8k16, fp32 accumulate: MMA_CHAINS accumulators per warp ---------------------
#define MMA_THREADS 256
#define MMA_CHAINS 8
#define MMA_UNROLL 4

__device__ void mma_16x8x16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__global__ void __launch_bounds__(MMA_THREADS) mma_sync_kernel(const unsigned *in, float *out, int iters) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned a[4], b[2];  // a lane's share of A (16 x 16) and B (16 x 8), fp16 pairs
    for (int i = 0; i < 4; i++) a[i] = in[(t * 6 + i) % 256];
    for (int i = 0; i < 2; i++) b[i] = in[(t * 6 + 4 + i) % 256];
    float d[MMA_CHAINS][4] = {};
    for (int i = 0; i < iters; i++) {
#pragma unroll
        for (int u = 0; u < MMA_UNROLL; u++)
#pragma unroll
            for (int c = 0; c < MMA_CHAINS; c++) mma_16x8x16(d[c], a, b);
    }
    float sum = 0.0f;
    for (int c = 0; c < MMA_CHAINS; c++) sum += d[c][0] + d[c][1] + d[c][2] + d[c][3];
    out[t] = sum;
}

// --- wgmma (sm_90a): one warpgroup per block, a 64 x 256 fp32 accumulator (128 registers a thread)
// A (64 rows) and B (256 rows) stay in shared memory, K-major, rows of 128 bytes in the 128-byte
// swizzle: 64 fp16 or 128 e4m3 per row, so one tile holds WG_KSTEPS k-steps of 32 bytes each.
#define WG_THREADS 128
#define WG_M 64
#define WG_N 256
#define WG_ROW_BYTES 128
#define WG_KSTEPS (WG_ROW_BYTES / 32)
#define WG_A_BYTES (WG_M * WG_ROW_BYTES)
#define WG_B_BYTES (WG_N * WG_ROW_BYTES)
#define WG_SMEM (WG_A_BYTES + WG_B_BYTES + 1024)  // + room to align the tiles to the 1024-byte swizzle atom
#define WG_REPEAT 4                               // passes over the tile's k-steps per commit group

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define HAVE_WGMMA 1
#else
#define HAVE_WGMMA 0
#endif

// A shared-memory operand: start address, leading byte offset (unused by swizzled K-major tiles:
// 1), stride byte offset (8 rows, one swizzle atom), 128-byte swizzle (mode 1); addresses >> 4.
__device__ uint64_t wgmma_descriptor(unsigned address) {
    return (uint64_t)(address & 0x3FFFF) >> 4 | 1ull << 16 | (uint64_t)(8 * WG_ROW_BYTES >> 4) << 32 | 1ull << 62;
}

#define ACC8(i)                                                                                                 \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
        "+f"(d[i + 7])
#define ACC32(i) ACC8(i), ACC8(i + 8), ACC8(i + 16), ACC8(i + 24)
#define REGS128                                                                                    \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                       \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "             \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "             \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "             \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "             \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "             \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

// d (64 x 256, fp32) += A (64 x k) B (k x 256), both from shared memory: k = 16 fp16 or 32 e4m3.
// Operands: the 128 accumulators, then the two descriptors (%128, %129); scale-d is the predicate
// p, true (accumulate); then scale-a and scale-b (1: no negation) and, for fp16, A and B not
// transposed (0: K-major).
__device__ void wgmma_fp16(float (&d)[128], uint64_t a_desc, uint64_t b_desc) {
#if HAVE_WGMMA
    asm volatile(
        "{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {" REGS128 "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
        : ACC32(0), ACC32(32), ACC32(64), ACC32(96)
        : "l"(a_desc), "l"(b_desc));
#endif
}

__device__ void wgmma_e4m3(float (&d)[128], uint64_t a_desc, uint64_t b_desc) {
#if HAVE_WGMMA
    asm volatile(
        "{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
        "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 {" REGS128 "}, %128, %129, p, 1, 1;\n}\n"
        : ACC32(0), ACC32(32), ACC32(64), ACC32(96)
        : "l"(a_desc), "l"(b_desc));
#endif
}

__device__ void wgmma_fence() {
#if HAVE_WGMMA
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ void wgmma_commit() {
#if HAVE_WGMMA
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
__device__ void wgmma_wait_1() {  // at most one group still running
#if HAVE_WGMMA
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
#endif
}
__device__ void wgmma_wait_0() {
#if HAVE_WGMMA
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#endif
}

// The block copies random bytes into its A and B tiles, then issues WG_REPEAT x WG_KSTEPS wgmmas
// per commit group, iters groups, keeping one group in flight while it issues the next.
// out[0] = 1 says that the wgmmas ran (the kernel was built for sm_90a).
template <int FP8>
__global__ void __launch_bounds__(WG_THREADS) wgmma_kernel(const uint4 *in, float *out, int iters) {
    extern __shared__ unsigned char smem_raw[];
    unsigned char *tiles = (unsigned char *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    for (int i = threadIdx.x; i < (WG_A_BYTES + WG_B_BYTES) / 16; i += blockDim.x) ((uint4 *)tiles)[i] = in[i % 4096];
    __syncthreads();
    const unsigned a_address = (unsigned)__cvta_generic_to_shared(tiles);
    const uint64_t a_desc = wgmma_descriptor(a_address), b_desc = wgmma_descriptor(a_address + WG_A_BYTES);
    float d[128];
    for (int i = 0; i < 128; i++) d[i] = 0.0f;
    for (int i = 0; i < iters; i++) {
        wgmma_fence();
#pragma unroll
        for (int r = 0; r < WG_REPEAT; r++)
#pragma unroll
            for (int k = 0; k < WG_KSTEPS; k++) {  // the next 32 bytes of each row: + 2 in the descriptor
                if (FP8) wgmma_e4m3(d, a_desc + 2 * k, b_desc + 2 * k);
                else wgmma_fp16(d, a_desc + 2 * k, b_desc + 2 * k);
            }
        wgmma_commit();
        wgmma_wait_1();
    }
    wgmma_wait_0();
    float sum = 0.0f;
    for (int i = 0; i < 128; i++) sum += d[i];
    out[1 + blockIdx.x * blockDim.x + threadIdx.x] = sum;
    if (blockIdx.x == 0 && threadIdx.x == 0) out[0] = HAVE_WGMMA;
}

// --- the host side -----------------------------------------------------------------------------
static unsigned long long rng_state = 0x9E3779B97F4A7C15ull;
static double uniform(void) {  // in [0, 1)
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) / 9007199254740992.0;
}
static float random_nonzero(void) {  // |x| in [0.25, 1), random sign
    float x = (float)(0.25 + 0.75 * uniform());
    return uniform() < 0.5 ? -x : x;
}

static int compare_floats(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

typedef void (*Launch)(int blocks, int iters, void *arg);

// Median ms of RUNS runs (after WARMUP) of launch(blocks, iters), each between its own events.
static float time_median(Launch launch, int blocks, int iters, void *arg) {
    cudaEvent_t start, stop;
    float ms[RUNS];
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
    for (int i = 0; i < WARMUP + RUNS; i++) {
        CUDA_CHECK(cudaEventRecord(start));
        launch(blocks, iters, arg);
        CUDA_CHECK(cudaGetLastError());
        CUDA_CHECK(cudaEventRecord(stop));
        CUDA_CHECK(cudaEventSynchronize(stop));
        if (i >= WARMUP) CUDA_CHECK(cudaEventElapsedTime(&ms[i - WARMUP], start, stop));
    }
    CUDA_CHECK(cudaEventDestroy(start));
    CUDA_CHECK(cudaEventDestroy(stop));
    qsort(ms, RUNS, sizeof ms[0], compare_floats);
    return ms[RUNS / 2];
}

// The trip count that makes one run last about TARGET_MS, from a short run; then the median ms.
static float time_calibrated(Launch launch, int blocks, int *iters, void *arg) {
    int trial = 64;
    for (;;) {
        float ms = time_median(launch, blocks, trial, arg);
        if (ms >= 2.0f || trial >= (1 << 24)) {
            double scaled = trial * (TARGET_MS / ms);
            *iters = scaled < 1 ? 1 : scaled > 2e9 ? 2000000000 : (int)scaled;
            return time_median(launch, blocks, *iters, arg);
        }
        trial *= 8;
    }
}

static float *d_floats, *d_out;
static unsigned *d_words;
static uint4 *d_fp16_tile, *d_e4m3_tile;

static void launch_ffma(int blocks, int iters, void *arg) {
    (void)arg;
    ffma_kernel<<<blocks, FFMA_THREADS>>>(d_floats, d_out, iters);
}
static void launch_mma(int blocks, int iters, void *arg) {
    (void)arg;
    mma_sync_kernel<<<blocks, MMA_THREADS>>>(d_words, d_out, iters);
}
static void launch_wgmma_fp16(int blocks, int iters, void *arg) {
    (void)arg;
    wgmma_kernel<0><<<blocks, WG_THREADS, WG_SMEM>>>(d_fp16_tile, d_out, iters);
}
static void launch_wgmma_e4m3(int blocks, int iters, void *arg) {
    (void)arg;
    wgmma_kernel<1><<<blocks, WG_THREADS, WG_SMEM>>>(d_e4m3_tile, d_out, iters);
}
typedef struct {
    void *dst, *src;
    size_t bytes;
} Copy;
static void launch_copy(int blocks, int iters, void *arg) {
    (void)blocks;
    const Copy *c = (const Copy *)arg;
    for (int i = 0; i < iters; i++) CUDA_CHECK(cudaMemcpyAsync(c->dst, c->src, c->bytes, cudaMemcpyDeviceToDevice));
}

// One wave: as many blocks as fit on the GPU at once.
static int one_wave(const void *kernel, int threads, size_t smem, int sms) {
    int per_sm = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
    if (per_sm < 1) {
        fprintf(stderr, "peaks: a block of %d threads and %zu bytes of shared memory does not fit on an SM\n", threads,
                smem);
        exit(1);
    }
    return per_sm * sms;
}

static char report[4096];
static size_t report_len;
static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    va_start(ap, fmt);
    if (report_len < sizeof report) report_len += vsnprintf(report + report_len, sizeof report - report_len, fmt, ap);
    va_end(ap);
    fflush(stdout);
}

int main(int argc, char **argv) {
    if (argc > 2 || (argc == 2 && (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")))) {
        printf(
            "usage: %s [LOG_DIR]\nMeasures the GPU's fp32 FFMA, fp16 mma.sync, wgmma (sm_90a) and copy ceilings;\n"
            "with LOG_DIR, also writes the table to LOG_DIR/peaks_<gpu name>.log.\n",
            argv[0]);
        return argc > 2 ? 2 : 0;
    }
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        printf("peaks: skipped: no CUDA GPU available\n");
        return 77;
    }
    cudaDeviceProp prop;
    int clock_khz = 0, device = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device));
    const int sms = prop.multiProcessorCount, cc = prop.major * 10 + prop.minor;
    int driver = 0, runtime = 0;
    CUDA_CHECK(cudaDriverGetVersion(&driver));
    CUDA_CHECK(cudaRuntimeGetVersion(&runtime));

    // Random non-zero inputs: floats for FFMA, fp16 pairs for mma.sync, fp16 and e4m3 tiles for wgmma.
    float h_floats[192];
    unsigned h_words[256];
    for (int i = 0; i < 192; i++) h_floats[i] = random_nonzero();
    for (int i = 0; i < 64; i++) h_floats[i] *= 0.999f;  // the multipliers b: |b| < 1
    for (int i = 0; i < 256; i++) {
        __half2 pair = __floats2half2_rn(random_nonzero(), random_nonzero());
        memcpy(&h_words[i], &pair, sizeof pair);
    }
    static unsigned char h_fp16_tile[4096 * 16], h_e4m3_tile[4096 * 16];
    for (int i = 0; i < 4096 * 8; i++) {
        __half x = __float2half_rn(random_nonzero());
        memcpy(&h_fp16_tile[2 * i], &x, sizeof x);
    }
    for (int i = 0; i < 4096 * 16; i++)
        h_e4m3_tile[i] = (unsigned char)__nv_cvt_float_to_fp8(random_nonzero(), __NV_SATFINITE, __NV_E4M3);

    const int out_count = 1 + 64 * 1024 * 1024 / 4;  // more than any wave's threads
    CUDA_CHECK(cudaMalloc(&d_floats, sizeof h_floats));
    CUDA_CHECK(cudaMalloc(&d_words, sizeof h_words));
    CUDA_CHECK(cudaMalloc(&d_fp16_tile, sizeof h_fp16_tile));
    CUDA_CHECK(cudaMalloc(&d_e4m3_tile, sizeof h_e4m3_tile));
    CUDA_CHECK(cudaMalloc(&d_out, out_count * sizeof(float)));
    CUDA_CHECK(cudaMemcpy(d_floats, h_floats, sizeof h_floats, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_words, h_words, sizeof h_words, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_fp16_tile, h_fp16_tile, sizeof h_fp16_tile, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_e4m3_tile, h_e4m3_tile, sizeof h_e4m3_tile, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemset(d_out, 0, out_count * sizeof(float)));

    say("peaks on %s (sm_%d, %d SMs, SM clock %d MHz), CUDA driver %d.%d, runtime %d.%d\n", prop.name, cc, sms,
        clock_khz / 1000, driver / 1000, driver % 1000 / 10, runtime / 1000, runtime % 1000 / 10);
    say("one wave of blocks, one run ~%.0f ms, median of %d runs after %d warm-up runs\n\n", TARGET_MS, RUNS, WARMUP);
    say("%-44s %12s  %s\n", "ceiling", "measured", "counted");

    int iters, blocks = one_wave((const void *)ffma_kernel, FFMA_THREADS, 0, sms);
    float ms = time_calibrated(launch_ffma, blocks, &iters, NULL);
    double flops = 2.0 * FFMA_CHAINS * FFMA_UNROLL * (double)iters * blocks * FFMA_THREADS;
    say("%-44s %7.1f TFLOP/s  2 FLOP per FFMA\n", "fp32 FFMA (CUDA cores)", flops / ms / 1e9);

    blocks = one_wave((const void *)mma_sync_kernel, MMA_THREADS, 0, sms);
    ms = time_calibrated(launch_mma, blocks, &iters, NULL);
    flops = 2.0 * 16 * 8 * 16 * MMA_CHAINS * MMA_UNROLL * (double)iters * blocks * (MMA_THREADS / 32);
    say("%-44s %7.1f TFLOP/s  2*16*8*16 FLOP per mma (a warp)\n", "fp16 mma.sync m16n8k16, fp32 accumulate",
        flops / ms / 1e9);

    if (cc == 90) {
        CUDA_CHECK(cudaFuncSetAttribute(wgmma_kernel<0>, cudaFuncAttributeMaxDynamicSharedMemorySize, WG_SMEM));
        CUDA_CHECK(cudaFuncSetAttribute(wgmma_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, WG_SMEM));
        blocks = one_wave((const void *)wgmma_kernel<0>, WG_THREADS, WG_SMEM, sms);
        ms = time_calibrated(launch_wgmma_fp16, blocks, &iters, NULL);
        float ran = 0;
        CUDA_CHECK(cudaMemcpy(&ran, d_out, sizeof ran, cudaMemcpyDeviceToHost));
        if (ran != 1) {
            say("%-44s %12s  this build is not sm_90a (make peaks builds it so on sm_90)\n", "wgmma", "skipped");
        } else {
            flops = 2.0 * WG_M * WG_N * 16 * WG_KSTEPS * WG_REPEAT * (double)iters * blocks;
            say("%-44s %7.1f TFLOP/s  2*64*256*16 FLOP per wgmma (a warpgroup)\n",
                "fp16 wgmma m64n256k16, fp32 accumulate", flops / ms / 1e9);
            ms = time_calibrated(launch_wgmma_e4m3, blocks, &iters, NULL);
            flops = 2.0 * WG_M * WG_N * 32 * WG_KSTEPS * WG_REPEAT * (double)iters * blocks;
            say("%-44s %7.1f TFLOP/s  2*64*256*32 FLOP per wgmma (a warpgroup)\n",
                "e4m3 wgmma m64n256k32, fp32 accumulate", flops / ms / 1e9);
        }
    } else {
        say("%-44s %12s  sm_90a only (Hopper: H100, H200); this GPU is sm_%d\n", "wgmma fp16 and e4m3", "skipped", cc);
    }

    size_t free_bytes = 0, total_bytes = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    Copy copy;
    copy.bytes = (size_t)1 << 30;  // 1 GiB each way, far past any L2; less on a small GPU
    while (copy.bytes > free_bytes / 4 && copy.bytes > ((size_t)1 << 24)) copy.bytes /= 2;
    CUDA_CHECK(cudaMalloc(&copy.src, copy.bytes));
    CUDA_CHECK(cudaMalloc(&copy.dst, copy.bytes));
    CUDA_CHECK(cudaMemset(copy.src, 0x3C, copy.bytes));  // non-zero: fp16 1.0 in every half
    ms = time_calibrated(launch_copy, 0, &iters, &copy);
    say("%-44s %7.2f TB/s    bytes read + written, %zu MiB each way\n", "device-to-device copy (cudaMemcpyAsync)",
        2.0 * copy.bytes * iters / ms / 1e9, copy.bytes >> 20);
    CUDA_CHECK(cudaFree(copy.src));
    CUDA_CHECK(cudaFree(copy.dst));

    CUDA_CHECK(cudaFree(d_floats));
    CUDA_CHECK(cudaFree(d_words));
    CUDA_CHECK(cudaFree(d_fp16_tile));
    CUDA_CHECK(cudaFree(d_e4m3_tile));
    CUDA_CHECK(cudaFree(d_out));

    if (argc == 2) {  // LOG_DIR/peaks_<gpu name>.log, named as docs/results names a GPU's files
        char name[256], path[1024];
        gpu_file_name(prop.name, name, sizeof name);
        snprintf(path, sizeof path, "%s/peaks_%s.log", argv[1], name);
        FILE *f = fopen(path, "w");
        if (!f || fwrite(report, 1, report_len, f) != report_len || fclose(f) != 0) {
            fprintf(stderr, "peaks: cannot write %s\n", path);
            return 1;
        }
        printf("\nwritten to %s\n", path);
    }
    return 0;
}
