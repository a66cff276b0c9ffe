// Hopper warpgroup MMA (sm_90a only): D[64 x N] (+)= A[64 x 32 bytes] * B[N x 32 bytes]^T with
// both operands K-major in 128-byte-swizzled shared memory, accumulators Elem<ELEM>::Acc.
// Shapes: N = 64, 96, 128 and 256; fp16 (ELEM 0) and bf16 (ELEM 1) k = 16, float32 on TF32
// (ELEM 2) k = 8, INT8 (ELEM 3) k = 32 with int32 accumulators, FP8 e4m3 (ELEM 4) k = 32; each
// specialisation lists its N/2 accumulator registers per thread. Every form takes 32 bytes of K
// per instruction.
#pragma once
#include "common.cuh"

// A tensor map as a kernel parameter (declared everywhere so signatures need no #if).
struct __align__(64) TmaDesc {
    unsigned long long v[16];  // the driver's opaque CUtensorMap, built by lik_cupy/_runtime/tma.py
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LIK_HAS_WGMMA 1

// Shared-memory matrix descriptor for a K-major operand in 128B-swizzle layout:
// 8-row x 128-byte core groups, 1024 bytes apart (stride byte offset).
// The low word holds the address (byte address / 16, 14 bits) and the leading byte offset, the
// high word constants, so a k step's descriptor is its tile's low word plus an offset / 16 (the
// address field never carries: shared memory ends below 2^18 bytes).
__device__ __forceinline__ u32 wgmma_desc_lo(u32 smem_byte_addr) {
    return ((smem_byte_addr & 0x3FFFF) >> 4) | (1u << 16);  // leading byte offset: unused for swizzled K-major
}
__device__ __forceinline__ unsigned long long wgmma_desc_at(u32 lo) {
    // stride byte offset 1024 (bits 32-45), 128-byte swizzle (bit 62)
    return (unsigned long long)lo | ((unsigned long long)((1024 >> 4) | (1u << 30)) << 32);
}
// The lane-0 copy of a value every lane of the warp holds (a descriptor's low word): the compiler
// then knows it is warp-uniform and keeps descriptors in uniform registers, stepping them with
// one uniform add per k step instead of moving each from vector registers before every wgmma.
__device__ __forceinline__ u32 warp_uniform(u32 x) { return __shfl_sync(0xffffffffu, x, 0); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Generic-proxy writes (cp.async, st.shared) must be made visible to the async proxy before wgmma reads them.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// D[64 x N] (+)= A[64 x 32 bytes] * B[N x 32 bytes]^T, both K-major in shared memory, accumulators
// Elem<ELEM>::Acc: every element type's instruction takes 32 bytes of K, so descriptors step alike.
template <int ELEM, int N>
__device__ __forceinline__ void wgmma_m64(typename Elem<ELEM>::Acc* d, unsigned long long da, unsigned long long db,
                                          int acc);

// The accumulator operands d[i] .. d[i + 7] with constraint C ("+f" fp32, "+r" int32), read and
// written by the instruction; LIK_ACC<n>(C) lists the first n.
#define LIK_ACC8(C, i) C(d[i]), C(d[(i) + 1]), C(d[(i) + 2]), C(d[(i) + 3]), C(d[(i) + 4]), C(d[(i) + 5]), C(d[(i) + 6]), C(d[(i) + 7])
#define LIK_ACC32(C) LIK_ACC8(C, 0), LIK_ACC8(C, 8), LIK_ACC8(C, 16), LIK_ACC8(C, 24)
#define LIK_ACC48(C) LIK_ACC32(C), LIK_ACC8(C, 32), LIK_ACC8(C, 40)
#define LIK_ACC64(C) LIK_ACC32(C), LIK_ACC8(C, 32), LIK_ACC8(C, 40), LIK_ACC8(C, 48), LIK_ACC8(C, 56)
#define LIK_ACC128(C) LIK_ACC64(C), LIK_ACC8(C, 64), LIK_ACC8(C, 72), LIK_ACC8(C, 80), LIK_ACC8(C, 88), LIK_ACC8(C, 96), LIK_ACC8(C, 104), LIK_ACC8(C, 112), LIK_ACC8(C, 120)

// The accumulators' operand lists, %0 .. %(n - 1).
#define LIK_REGS32 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
#define LIK_REGS48 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47"
#define LIK_REGS64 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
#define LIK_REGS128 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"

// One specialisation per (type, N): N/2 accumulator registers %0..%(N/2 - 1), then the two
// descriptors (%IA, %IB) and the accumulate flag (%IP); the rest of the asm is shared. KTY: the
// instruction's K and types; IMM: its trailing immediates (scale-a, scale-b, and for the 16-bit
// forms the two transposes; TF32 takes no transposes, INT8 no immediates).
#define LIK_WGMMA_SPEC(ELEM, KTY, IMM, N, REGS, IA, IB, IP, ...)                                             \
    template <>                                                                                              \
    __device__ __forceinline__ void wgmma_m64<ELEM, N>(Elem<ELEM>::Acc * d, unsigned long long da,           \
                                                       unsigned long long db, int acc) {                     \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IP ", 0;\n"                                        \
                     "wgmma.mma_async.sync.aligned.m64n" #N KTY " {" REGS "}, %" #IA ", %" #IB                 \
                     ", p" IMM ";\n}\n"                                                                        \
                     : __VA_ARGS__                                                                            \
                     : "l"(da), "l"(db), "r"(acc));                                                           \
    }
// Every element type at one N, ACC its accumulator list (LIK_ACC<N/2>). float32 (ELEM 2) on TF32:
// the tensor cores read the float32 tile as it lies in shared memory and use each value's top 19
// bits (its TF32 part). INT8 (ELEM 3) accumulates in int32; FP8 (ELEM 4) takes TF32's immediates.
#define LIK_WGMMA_SPECS(N, REGS, ACC, IA, IB, IP)                                                 \
    LIK_WGMMA_SPEC(0, "k16.f32.f16.f16", ", 1, 1, 0, 0", N, REGS, IA, IB, IP, ACC("+f"))       \
    LIK_WGMMA_SPEC(1, "k16.f32.bf16.bf16", ", 1, 1, 0, 0", N, REGS, IA, IB, IP, ACC("+f"))     \
    LIK_WGMMA_SPEC(2, "k8.f32.tf32.tf32", ", 1, 1", N, REGS, IA, IB, IP, ACC("+f"))            \
    LIK_WGMMA_SPEC(3, "k32.s32.s8.s8", "", N, REGS, IA, IB, IP, ACC("+r"))                      \
    LIK_WGMMA_SPEC(4, "k32.f32.e4m3.e4m3", ", 1, 1", N, REGS, IA, IB, IP, ACC("+f"))

LIK_WGMMA_SPECS(64, LIK_REGS32, LIK_ACC32, 32, 33, 34)
LIK_WGMMA_SPECS(96, LIK_REGS48, LIK_ACC48, 48, 49, 50)
LIK_WGMMA_SPECS(128, LIK_REGS64, LIK_ACC64, 64, 65, 66)
LIK_WGMMA_SPECS(256, LIK_REGS128, LIK_ACC128, 128, 129, 130)

// Tensor-memory-accelerator (TMA) loads: a box of a tensor map built on the host
// (lik_cupy/_runtime/tma.py) lands in shared memory, swizzled as the map says, and completes as a
// byte count on an mbarrier. One thread issues a whole tile; no thread computes addresses.
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Barrier initialisation must be visible to the async proxy before a TMA completes on it.
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// One arrival that also tells the barrier to wait for `bytes` more of TMA transfers.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// One arrival (a consumer releasing a slot).
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Wait until the barrier's phase with this parity has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred p;\nLIK_MBAR_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra LIK_MBAR_WAIT;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void tma_load_2d(u32 dst, const TmaDesc* map, int c0, int c1, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void tma_load_1d(u32 dst, const TmaDesc* map, int c0, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.1d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2}], [%3];\n" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(bar)
        : "memory");
}

#else
#define LIK_HAS_WGMMA 0
#endif
