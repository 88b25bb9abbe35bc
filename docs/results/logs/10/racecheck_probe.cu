// Does compute-sanitizer's racecheck follow a ring stage's reuse when the
// stage is written by cp.async.bulk and read by generic loads, released through an mbarrier?
// One producer thread (warp 0) bulk-copies 512 bytes a tile into a two-stage ring; 8 consumer warps
// wait on the stage's full barrier, read it, and release it through its empty barrier:
//   0: lane 0 of each warp arrives after __syncwarp (10.3-10.5's release; count 8)
//   1: every consumer thread arrives (count 256)
//   2: the consumers meet at a named barrier, then one thread arrives (count 1)
//   3: as 0, but the producer writes the stage with st.shared instead of the bulk copy
// Usage: racecheck_probe VARIANT   (prints the sum, which the host checks)
#include <stdio.h>
#include <stdlib.h>
#include <cuda_runtime.h>
#include "../../../../08_fp8/hopper.h"

#define TILES 6
#define STAGES 2
#define FLOATS 128  // 512 bytes a stage
#define CONSUMER_THREADS 256

__device__ void bulk_load(void *dst, const void *src, int bytes, uint64_t *barrier) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     smem_address(dst)), "l"(src), "r"(bytes), "r"(smem_address(barrier)) : "memory");
}

__global__ void probe(const float *src, float *out, int variant) {
    __shared__ alignas(128) float ring[STAGES][FLOATS];
    __shared__ alignas(8) uint64_t full[STAGES], empty[STAGES];
    const int counts[4] = {CONSUMER_THREADS / 32, CONSUMER_THREADS, 1, CONSUMER_THREADS / 32};
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) mbarrier_init(&full[s], 1), mbarrier_init(&empty[s], counts[variant]);
        fence_mbarrier_init();
    }
    __syncthreads();
    if (threadIdx.x < 32) {  // the producer warp: one thread
        if (threadIdx.x != 0) return;
        for (int t = 0; t < TILES; t++) {
            const int s = t % STAGES;
            if (t >= STAGES) mbarrier_wait(&empty[s], (t / STAGES - 1) % 2);
            if (variant == 3) {
                for (int i = 0; i < FLOATS; i++) ring[s][i] = src[t * FLOATS + i];
                mbarrier_arrive(&full[s]);
            } else {
                mbarrier_arrive_expect_bytes(&full[s], FLOATS * 4);
                bulk_load(ring[s], src + t * FLOATS, FLOATS * 4, &full[s]);
            }
        }
        return;
    }
    const int c = threadIdx.x - 32;  // consumer thread 0..255
    float sum = 0.0f;
    for (int t = 0; t < TILES; t++) {
        const int s = t % STAGES;
        mbarrier_wait(&full[s], t / STAGES % 2);
        sum += ring[s][c % FLOATS];
        if (variant == 1) {
            mbarrier_arrive(&empty[s]);
        } else if (variant == 2) {
            asm volatile("bar.sync 1, %0;\n" ::"r"(CONSUMER_THREADS) : "memory");
            if (c == 0) mbarrier_arrive(&empty[s]);
        } else {
            __syncwarp();
            if (c % 32 == 0) mbarrier_arrive(&empty[s]);
            __syncwarp();
        }
    }
    out[c] = sum;
}

int main(int argc, char **argv) {
    const int variant = argc > 1 ? atoi(argv[1]) : 0;
    if (variant < 0 || variant > 3) { fprintf(stderr, "variant 0-3\n"); return 2; }
    float host[TILES * FLOATS], got[CONSUMER_THREADS];
    for (int i = 0; i < TILES * FLOATS; i++) host[i] = (float)(i % 7);
    float *src, *out;
    if (cudaMalloc(&src, sizeof host) || cudaMalloc(&out, sizeof got)) { fprintf(stderr, "cudaMalloc\n"); return 1; }
    cudaMemcpy(src, host, sizeof host, cudaMemcpyHostToDevice);
    probe<<<1, 32 + CONSUMER_THREADS>>>(src, out, variant);
    cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess) { fprintf(stderr, "%s\n", cudaGetErrorString(err)); return 1; }
    cudaMemcpy(got, out, sizeof got, cudaMemcpyDeviceToHost);
    int bad = 0;
    for (int c = 0; c < CONSUMER_THREADS; c++) {
        float want = 0.0f;
        for (int t = 0; t < TILES; t++) want += host[t * FLOATS + c % FLOATS];
        bad += got[c] != want;
    }
    printf("variant %d: %s\n", variant, bad ? "WRONG" : "sums right");
    return bad != 0;
}
