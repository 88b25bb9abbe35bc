// How fast L2 takes 09's dQ reductions, by the shape of one warp's RED instruction: the question
// behind "fewer L2 requests per RED" in 09_backward/NOTES.md. The grid is the split kernel's at
// B4 H16 N4096 D128 (32 key blocks per head, 64 heads, eight warps), each block adding a 64 x 128
// fp32 partial into the rows of each of its 64 query tiles, from its diagonal (BWD_STAGGER), with
// nothing else to do: the reductions' own ceiling. Warp w adds rows 32 (w % 2).., dims 32 (w / 2)..
// as the split kernel's dQ warps do, in one of these instruction shapes:
//   quad:   the kernel's (add_dq_partial): 16-byte REDs, one instruction 16 rows x 32 bytes
//   rows:   16-byte REDs, one instruction 4 rows x 128 bytes (a lane's four dims of one row)
//   row:    16-byte REDs, one instruction one whole row, 512 bytes (warp w rows 8w.. of the tile)
//   scalar: 4-byte REDs, one instruction 8 rows x 16 bytes (the 09.dq_red exercise's stub)
//   fixed:  8-byte integer REDs into an int64 workspace (fixed point, which sums in any order to the
//           same bits; commit faf181e), one instruction 256 bytes of a row
//   bulk:   the partial through shared memory (rows 528 bytes apart), then one bulk reduction
//           (cp.reduce.async.bulk .add.f32) of 512 bytes per row by warp 0's lanes, two each
//   bulk1:  the same, one bulk reduction of the whole 32 KiB tile (rows unpadded)
// Each checks its sum, then prints ms per pass and REDs and bytes per second.
//
//   nvcc -O3 -arch=sm_90 -o build/red_layout docs/results/logs/09/red_layout.cu && build/red_layout
#include <cstdio>
#include <cstdlib>
#include <cuda/ptx>

#define CHECK(call)                                                                          \
    do {                                                                                     \
        cudaError_t status_ = (call);                                                        \
        if (status_ != cudaSuccess) {                                                        \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(status_)); \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)

#define HEADS 64
#define SEQLEN 4096
#define HEAD_DIM 128
#define KEY_BLOCKS 32   // 128 keys per block
#define QUERY_TILES 64  // 64 queries per tile
#define WARPS 8

enum Layout { QUAD, ROWS, ROW, SCALAR, BULK, BULK1, FIXED };
#define STAGE_STRIDE (HEAD_DIM + 4)  // floats per row of the bulk variant's tile: 16-byte rows, no bank conflicts

// The bulk variants: each warp stores its 32 x 32 part of the tile to shared memory, then warp 0
// reduces the tile into L2 from there, the next tile's stores waiting until the engine has read it.
template <Layout LAYOUT>
__device__ void add_through_shared(float *tile_rows, float *stage, float value, int step) {
    namespace ptx = cuda::ptx;
    constexpr int STRIDE = LAYOUT == BULK ? STAGE_STRIDE : HEAD_DIM;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int warp_row0 = warp % 2 * 32, dim0 = warp / 2 * 32;
    if (warp == 0 && step > 0) ptx::cp_async_bulk_wait_group_read(ptx::n32_t<0>());
    __syncthreads();
    const float4 four = make_float4(value, value, value, value);
    for (int k = 0; k < 8; k++)
        *(float4 *)&stage[(warp_row0 + 4 * k + lane / 8) * STRIDE + dim0 + 4 * (lane % 8)] = four;
    ptx::fence_proxy_async(ptx::space_shared);
    __syncthreads();
    if (warp == 0) {
        if (LAYOUT == BULK) {
            for (int row = lane; row < 64; row += 32)
                ptx::cp_reduce_async_bulk(ptx::space_global, ptx::space_shared, ptx::op_add, tile_rows + row * HEAD_DIM,
                                          stage + row * STRIDE, HEAD_DIM * sizeof(float));
        } else if (lane == 0) {
            ptx::cp_reduce_async_bulk(ptx::space_global, ptx::space_shared, ptx::op_add, tile_rows, stage,
                                      64 * HEAD_DIM * sizeof(float));
        }
        ptx::cp_async_bulk_commit_group();
    }
}

template <Layout LAYOUT>
__global__ void __launch_bounds__(WARPS * 32) add_partials(float *dq_acc, float value) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = lane / 4, quad_lane = lane % 4;
    const int head = blockIdx.x / KEY_BLOCKS, key_block = blockIdx.x % KEY_BLOCKS;
    const int warp_row0 = warp % 2 * 32, dim0 = warp / 2 * 32;
    extern __shared__ __align__(128) float stage[];
    for (int step = 0; step < QUERY_TILES; step++) {
        const int tile = (2 * key_block + step) % QUERY_TILES;  // from the diagonal, wrapping round
        if (LAYOUT == BULK || LAYOUT == BULK1) {
            add_through_shared<LAYOUT>(dq_acc + ((size_t)head * SEQLEN + tile * 64) * HEAD_DIM, stage, value, step);
            continue;
        }
        float *rows = dq_acc + ((size_t)head * SEQLEN + tile * 64 + warp_row0) * HEAD_DIM + dim0;
        const float4 four = make_float4(value, value, value, value);
        if (LAYOUT == QUAD) {  // per (m16 tile, n8 tile): rows 16 mt + l / 4 + 8 (l % 2), dims 8 nt + 4 (l % 4 / 2)
            for (int mt = 0; mt < 2; mt++)
                for (int nt = 0; nt < 4; nt++)
                    atomicAdd((float4 *)&rows[(mt * 16 + group + 8 * (quad_lane % 2)) * HEAD_DIM + nt * 8 +
                                              4 * (quad_lane / 2)],
                              four);
        } else if (LAYOUT == ROW) {  // per instruction k: row 8w + k of the tile, dims 4l
            float *tile_rows = dq_acc + ((size_t)head * SEQLEN + tile * 64) * HEAD_DIM;
            for (int k = 0; k < 8; k++) atomicAdd((float4 *)&tile_rows[(8 * warp + k) * HEAD_DIM + 4 * lane], four);
        } else if (LAYOUT == FIXED) {  // per row 8w + k, four instructions: lane l dims l + 32j
            unsigned long long *tile_rows = (unsigned long long *)dq_acc + ((size_t)head * SEQLEN + tile * 64) * HEAD_DIM;
            for (int k = 0; k < 8; k++)
                for (int j = 0; j < 4; j++) atomicAdd(&tile_rows[(8 * warp + k) * HEAD_DIM + lane + 32 * j], 1ull);
        } else if (LAYOUT == ROWS) {  // per instruction k: rows 4k + l / 8, dims 4 (l % 8)
            for (int k = 0; k < 8; k++)
                atomicAdd((float4 *)&rows[(4 * k + lane / 8) * HEAD_DIM + 4 * (lane % 8)], four);
        } else {  // the scalar stub: rows 16 mt + l / 4 + 8 r, dims 8 nt + 2 (l % 4) + e
            for (int mt = 0; mt < 2; mt++)
                for (int r = 0; r < 2; r++)
                    for (int nt = 0; nt < 4; nt++)
                        for (int e = 0; e < 2; e++)
                            atomicAdd(&rows[(mt * 16 + group + 8 * r) * HEAD_DIM + nt * 8 + 2 * quad_lane + e], value);
        }
    }
    if (LAYOUT == BULK || LAYOUT == BULK1) cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<0>());
}

template <Layout LAYOUT>
static void measure(const char *name, float *dq_acc, size_t floats, int reps) {
    const int blocks = HEADS * KEY_BLOCKS;
    const int smem = LAYOUT == BULK ? 64 * STAGE_STRIDE * sizeof(float) : LAYOUT == BULK1 ? 64 * HEAD_DIM * sizeof(float) : 0;
    CHECK(cudaFuncSetAttribute(add_partials<LAYOUT>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CHECK(cudaMemset(dq_acc, 0, floats * (LAYOUT == FIXED ? 2 : 1) * sizeof(float)));
    add_partials<LAYOUT><<<blocks, WARPS * 32, smem>>>(dq_acc, 1.0f);  // warm-up, and the sum to check
    CHECK(cudaGetLastError());
    float first = 0.0f, last = 0.0f;
    if (LAYOUT == FIXED) {  // int64 elements, twice the bytes
        unsigned long long first_fixed = 0, last_fixed = 0;
        CHECK(cudaMemcpy(&first_fixed, dq_acc, sizeof(first_fixed), cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(&last_fixed, (unsigned long long *)dq_acc + floats - 1, sizeof(last_fixed),
                         cudaMemcpyDeviceToHost));
        first = (float)first_fixed, last = (float)last_fixed;
    } else {
        CHECK(cudaMemcpy(&first, dq_acc, sizeof(float), cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(&last, dq_acc + floats - 1, sizeof(float), cudaMemcpyDeviceToHost));
    }
    if (first != KEY_BLOCKS || last != KEY_BLOCKS) {
        fprintf(stderr, "%s: dq_acc[0] = %g, dq_acc[last] = %g, want %d\n", name, first, last, KEY_BLOCKS);
        exit(1);
    }
    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    CHECK(cudaEventRecord(start));
    for (int i = 0; i < reps; i++) add_partials<LAYOUT><<<blocks, WARPS * 32, smem>>>(dq_acc, 1.0f);
    CHECK(cudaEventRecord(stop));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    ms /= reps;
    const double floats_added = (double)blocks * QUERY_TILES * 64 * HEAD_DIM;
    const double reds = floats_added / (LAYOUT == SCALAR || LAYOUT == FIXED ? 1.0 : 4.0);
    printf("%-7s %7.3f ms per pass  %6.1f G RED/s  %6.0f GB/s of RED payload\n", name, ms, reds / ms / 1e6,
           reds * (LAYOUT == SCALAR ? 4 : LAYOUT == FIXED ? 8 : 16) / ms / 1e6);
    CHECK(cudaEventDestroy(start));
    CHECK(cudaEventDestroy(stop));
}

int main() {
    const size_t floats = (size_t)HEADS * SEQLEN * HEAD_DIM;  // 128 MiB, the headline's dQ accumulator
    float *dq_acc = NULL;
    CHECK(cudaMalloc(&dq_acc, 2 * floats * sizeof(float)));  // the fixed layout's int64
    printf("the split kernel's dQ reductions alone, B4 H16 N4096 D128 (%d blocks of %d warps, %d query tiles each)\n",
           HEADS * KEY_BLOCKS, WARPS, QUERY_TILES);
    measure<QUAD>("quad", dq_acc, floats, 5);
    measure<ROWS>("rows", dq_acc, floats, 5);
    measure<ROW>("row", dq_acc, floats, 5);
    measure<SCALAR>("scalar", dq_acc, floats, 3);
    measure<BULK>("bulk", dq_acc, floats, 5);
    measure<BULK1>("bulk1", dq_acc, floats, 5);
    measure<FIXED>("fixed", dq_acc, floats, 5);
    CHECK(cudaFree(dq_acc));
    return 0;
}
