// hopper.h: the Hopper (sm_90a) instructions every step of 08 is written with, each a small named
// function over the PTX the ISA documents. A step file includes it after the harness; the README's
// first section introduces them, with the figures of the swizzle, the ring and the fragments.
//
//   mbarrier      a 64-bit barrier in shared memory that counts arrivals and bytes (phases, parity)
//   TMA           the bulk tensor copy engine: one thread asks for a whole box of a tensor map
//   wgmma         warpgroup MMA: 128 threads, operands described in shared memory (or A in
//                 registers), accumulators in registers, issued asynchronously
//   setmaxnreg    a warpgroup hands registers back to the SM or takes more
//   named barrier bar.sync / bar.arrive on barriers 1-15: some warps wait while others only arrive
#ifndef HOPPER_H
#define HOPPER_H

#include <cuda.h>  // CUtensorMap and its enums (types only: the driver is reached at run time)
#include <cudaTypedefs.h>
#include <stdint.h>
#include <stdio.h>

// --- Shared memory addresses ---------------------------------------------------------------
// The 32-bit shared-memory address that PTX's .shared instructions take.
__device__ unsigned smem_address(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }

// --- mbarrier ------------------------------------------------------------------------------
// An mbarrier completes a phase once `count` threads have arrived and every byte announced with
// expect_tx has landed; waiters name the phase parity they wait for.
__device__ void mbarrier_init(uint64_t *barrier, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(barrier)), "r"(count));
}

// Makes the initialised barriers visible to the copy engine before any copy names them.
__device__ void fence_mbarrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

// Arrive, and announce `bytes` more that TMA copies will deliver before the phase completes.
__device__ void mbarrier_arrive_expect_bytes(uint64_t *barrier, int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_address(barrier)), "r"(bytes)
                 : "memory");
}

__device__ void mbarrier_arrive(uint64_t *barrier) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_address(barrier)) : "memory");
}

// Wait until the phase of parity `phase` has completed (try_wait suspends the thread a while).
__device__ void mbarrier_wait(uint64_t *barrier, int phase) {
    unsigned done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(smem_address(barrier)), "r"(phase)
            : "memory");
    } while (!done);
}

// --- TMA -----------------------------------------------------------------------------------
// Copy the box at (x, y, z) of a tensor map into shared memory; its bytes count towards the
// barrier's transaction. Rows outside the tensor arrive as zeros.
__device__ void tma_load(void *dst, const CUtensorMap *map, uint64_t *barrier, int x, int y, int z) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
        "[%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(smem_address(dst)),
        "l"(map), "r"(smem_address(barrier)), "r"(x), "r"(y), "r"(z)
        : "memory");
}

// cuTensorMapEncodeTiled from the driver, found at run time (the program links no libcuda).
static PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder(void) {
    static PFN_cuTensorMapEncodeTiled_v12000 encode = NULL;
    if (!encode) {
        void *found = NULL;
        cudaDriverEntryPointQueryResult status;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &found, 12000, cudaEnableDefault, &status) ==
                cudaSuccess &&
            status == cudaDriverEntryPointSuccess)
            encode = (PFN_cuTensorMapEncodeTiled_v12000)found;
    }
    return encode;
}

// A tensor map over the bytes of [heads][rows][row_bytes] whose boxes are box_rows x box_bytes,
// swizzled by the box row length (64 or 128 bytes), the layout wgmma's descriptors name. `who`
// names the program in an error message.
static cudaError_t make_tensor_map(CUtensorMap *map, void *base, int row_bytes, int rows, int heads, int box_bytes,
                                   int box_rows, const char *who) {
    PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
    if (!encode) {
        fprintf(stderr, "%s: the driver offers no cuTensorMapEncodeTiled (needs CUDA 12 or newer)\n", who);
        return cudaErrorNotSupported;
    }
    cuuint64_t dims[3] = {(cuuint64_t)row_bytes, (cuuint64_t)rows, (cuuint64_t)heads};
    cuuint64_t strides[2] = {(cuuint64_t)row_bytes, (cuuint64_t)row_bytes * rows};  // of dims 1, 2 in bytes
    cuuint32_t box[3] = {(cuuint32_t)box_bytes, (cuuint32_t)box_rows, 1}, element_strides[3] = {1, 1, 1};
    CUresult result =
        encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, base, dims, strides, box, element_strides,
               CU_TENSOR_MAP_INTERLEAVE_NONE, box_bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (result != CUDA_SUCCESS) {
        fprintf(stderr, "%s: cuTensorMapEncodeTiled failed (CUresult %d)\n", who, (int)result);
        return cudaErrorInvalidValue;
    }
    return cudaSuccess;
}

// --- wgmma operands in shared memory ---------------------------------------------------------
// A K-major tile whose rows are row_bytes (64 or 128) long, swizzled as TMA wrote it. Fields:
// start address, leading byte offset (unused by swizzled K-major tiles: 1), stride byte offset
// (8 rows, one swizzle atom), swizzle mode; all >> 4.
__device__ uint64_t smem_descriptor_at(unsigned address, int row_bytes) {
    const uint64_t mode = row_bytes == 128 ? 1 : 2;  // 128-byte or 64-byte swizzle
    return (uint64_t)(address & 0x3FFFF) >> 4 | 1ull << 16 | (uint64_t)(8 * row_bytes >> 4) << 32 | mode << 62;
}

__device__ uint64_t smem_descriptor(const void *tile, int row_bytes) {
    return smem_descriptor_at(smem_address(tile), row_bytes);
}

// A 16-bit operand read MN-major (wgmma's transpose bit): rows of 128 bytes swizzled as TMA wrote
// them, 8-row groups 1024 bytes apart (stride byte offset), column blocks block_bytes apart
// (leading byte offset).
__device__ uint64_t smem_descriptor_mn_major(const void *tile, int block_bytes) {
    return (uint64_t)(smem_address(tile) & 0x3FFFF) >> 4 | (uint64_t)(block_bytes >> 4) << 16 |
           (uint64_t)(8 * 128 >> 4) << 32 | 1ull << 62;
}

// --- wgmma: fence, commit, wait ------------------------------------------------------------
// wgmma runs asynchronously: fence (operand registers ready), issue, commit, wait.
__device__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int PENDING>  // wait until at most PENDING committed groups are still running
__device__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(PENDING) : "memory");
}

// Keeps the compiler from moving reads or writes of wgmma operands across the async region.
template <int COUNT>
__device__ void hold_registers(float (&acc)[COUNT]) {
#pragma unroll
    for (int i = 0; i < COUNT; i++) asm volatile("" : "+f"(acc[i])::"memory");
}

template <int COUNT>
__device__ void hold_registers(unsigned (&acc)[COUNT]) {
#pragma unroll
    for (int i = 0; i < COUNT; i++) asm volatile("" : "+r"(acc[i])::"memory");
}

template <int FRAGS>
__device__ void hold_registers(unsigned (&frag)[FRAGS][4]) {
#pragma unroll
    for (int i = 0; i < FRAGS; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) asm volatile("" : "+r"(frag[i][j])::"memory");
}

// --- wgmma: the instructions ---------------------------------------------------------------
// d (64 x N) [+]= A (64 x K) * B (K x N), K = 32 bytes of the reduced dimension (16 fp16, 32
// e4m3). Thread t of the warpgroup holds d rows 16 (t/32) + t%32/4 (+8), columns 8c + 2 (t%4) (+1);
// an fp16 accumulator packs those two columns in one register. "ss": A and B in shared memory
// (descriptors); "rs": A in registers (4 x 4 bytes a thread), B in shared memory. The trailing
// immediates: with A in registers, scale-d (1: accumulate) first; then scale-a and scale-b (1: no
// negation), and for 16-bit types whether A (ss only) and B are transposed (1: B read MN-major).
#define ACC8(d, i)                                                                                              \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
        "+f"(d[i + 7])
#define ACC32(d, i) ACC8(d, i), ACC8(d, i + 8), ACC8(d, i + 16), ACC8(d, i + 24)
#define ACCH8(d, i)                                                                                             \
    "+r"(d[i]), "+r"(d[i + 1]), "+r"(d[i + 2]), "+r"(d[i + 3]), "+r"(d[i + 4]), "+r"(d[i + 5]), "+r"(d[i + 6]), \
        "+r"(d[i + 7])
#define ACCH32(d, i) ACCH8(d, i), ACCH8(d, i + 8), ACCH8(d, i + 16), ACCH8(d, i + 24)
#define REGS32                                                               \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define REGS64                                                                      \
    REGS32                                                                          \
    ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, " \
    "%47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define REGS96                                                                           \
    REGS64                                                                               \
    ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"

// fp16 operands, fp32 accumulators: Q K^T (A, B K-major), and P V with V read MN-major.
__device__ void wgmma_m64n128k16_f16_ss(float (&d)[64], uint64_t a_desc, uint64_t b_desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred acc;\nsetp.ne.b32 acc, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {" REGS64 "}, %64, %65, acc, 1, 1, 0, 0;\n}\n"
        : ACC32(d, 0), ACC32(d, 32)
        : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}

__device__ void wgmma_m64n64k16_f16_ss(float (&d)[32], uint64_t a_desc, uint64_t b_desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred acc;\nsetp.ne.b32 acc, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" REGS32 "}, %32, %33, acc, 1, 1, 0, 0;\n}\n"
        : ACC32(d, 0)
        : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}

// Both operands read MN-major (A's rows and B's columns contiguous in shared memory).
__device__ void wgmma_m64n64k16_f16_ss_mn_major(float (&d)[32], uint64_t a_desc, uint64_t b_desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred acc;\nsetp.ne.b32 acc, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" REGS32 "}, %32, %33, acc, 1, 1, 1, 1;\n}\n"
        : ACC32(d, 0)
        : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}

__device__ void wgmma_m64n128k16_f16_rs(float (&d)[64], const unsigned (&a)[4], uint64_t b_desc) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {" REGS64
                 "}, {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
                 : ACC32(d, 0), ACC32(d, 32)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc));
}

__device__ void wgmma_m64n64k16_f16_rs(float (&d)[32], const unsigned (&a)[4], uint64_t b_desc) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" REGS32
                 "}, {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
                 : ACC32(d, 0)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc));
}

// e4m3 operands (both K-major: 8-bit types have no transpose), fp32 accumulators.
__device__ void wgmma_m64n128k32_e4m3_ss(float (&d)[64], uint64_t a_desc, uint64_t b_desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred acc;\nsetp.ne.b32 acc, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" REGS64 "}, %64, %65, acc, 1, 1;\n}\n"
        : ACC32(d, 0), ACC32(d, 32)
        : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}

__device__ void wgmma_m64n192k32_e4m3_ss(float (&d)[96], uint64_t a_desc, uint64_t b_desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred acc;\nsetp.ne.b32 acc, %98, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k32.f32.e4m3.e4m3 {" REGS96 "}, %96, %97, acc, 1, 1;\n}\n"
        : ACC32(d, 0), ACC32(d, 32), ACC32(d, 64)
        : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}

__device__ void wgmma_m64n128k32_e4m3_rs(float (&d)[64], const unsigned (&a)[4], uint64_t b_desc) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" REGS64
                 "}, {%64, %65, %66, %67}, %68, 1, 1, 1;\n"
                 : ACC32(d, 0), ACC32(d, 32)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc));
}

__device__ void wgmma_m64n64k32_e4m3_rs(float (&d)[32], const unsigned (&a)[4], uint64_t b_desc) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {" REGS32
                 "}, {%32, %33, %34, %35}, %36, 1, 1, 1;\n"
                 : ACC32(d, 0)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc));
}

// e4m3 operands, fp16 accumulators (two adjacent columns a register): half the registers of fp32.
__device__ void wgmma_m64n256k32_f16_e4m3_ss(unsigned (&d)[64], uint64_t a_desc, uint64_t b_desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred acc;\nsetp.ne.b32 acc, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k32.f16.e4m3.e4m3 {" REGS64 "}, %64, %65, acc, 1, 1;\n}\n"
        : ACCH32(d, 0), ACCH32(d, 32)
        : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}

// --- setmaxnreg ----------------------------------------------------------------------------
// A warpgroup gives registers back to the SM (dec) or takes more (inc): each thread's count.
template <int REGISTERS>
__device__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGISTERS));
}

template <int REGISTERS>
__device__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGISTERS));
}

// --- Named barriers ------------------------------------------------------------------------
// Barrier `id` (1-15; 0 is __syncthreads') completes once THREADS threads have reached it:
// bar_sync waits for that, bar_arrive counts this thread and goes on.
template <int THREADS>
__device__ void bar_sync(int id) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(THREADS) : "memory");
}

template <int THREADS>
__device__ void bar_arrive(int id) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(THREADS) : "memory");
}

#endif  // HOPPER_H
