// Hopper warpgroup MMA (sm_90a only): D[64 x N] (+)= A[64 x 16] * B[N x 16]^T with
// both operands K-major in 128-byte-swizzled shared memory, fp32 accumulators.
// Shapes: N = 64, 96, 128 and 256, fp16 (ELEM 0) and bf16 (ELEM 1); each specialisation
// lists its N/2 accumulator registers per thread.
#pragma once
#include "common.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LIK_HAS_WGMMA 1

// Shared-memory matrix descriptor for a K-major operand in 128B-swizzle layout:
// 8-row x 128-byte core groups, 1024 bytes apart (stride byte offset).
__device__ __forceinline__ unsigned long long wgmma_desc(u32 smem_byte_addr) {
    unsigned long long d = 0;
    d |= (unsigned long long)((smem_byte_addr & 0x3FFFF) >> 4);
    d |= (unsigned long long)1 << 16;             // leading byte offset: unused for swizzled K-major
    d |= (unsigned long long)(1024 >> 4) << 32;   // stride byte offset
    d |= (unsigned long long)1 << 62;             // 128-byte swizzle
    return d;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Generic-proxy writes (cp.async, st.shared) must be made visible to the async proxy before wgmma reads them.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

template <int ELEM, int N>
__device__ __forceinline__ void wgmma_m64k16(float* d, unsigned long long da, unsigned long long db, int acc);

// The accumulator operands d[i] .. d[i + 7], read and written by the instruction.
#define LIK_D8(i) "+f"(d[i]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), "+f"(d[(i) + 4]), "+f"(d[(i) + 5]), "+f"(d[(i) + 6]), "+f"(d[(i) + 7])
#define LIK_D32 LIK_D8(0), LIK_D8(8), LIK_D8(16), LIK_D8(24)
#define LIK_D48 LIK_D32, LIK_D8(32), LIK_D8(40)
#define LIK_D64 LIK_D32, LIK_D8(32), LIK_D8(40), LIK_D8(48), LIK_D8(56)
#define LIK_D128 LIK_D64, LIK_D8(64), LIK_D8(72), LIK_D8(80), LIK_D8(88), LIK_D8(96), LIK_D8(104), LIK_D8(112), LIK_D8(120)

// One specialisation per (type, N): N/2 accumulator registers %0..%(N/2 - 1), then the two
// descriptors (%IA, %IB) and the accumulate flag (%IP); the rest of the asm is shared.
#define LIK_WGMMA_SPEC(ELEM, TY, N, REGS, IA, IB, IP, ...)                                                    \
    template <>                                                                                              \
    __device__ __forceinline__ void wgmma_m64k16<ELEM, N>(float* d, unsigned long long da, unsigned long long db, \
                                                         int acc) {                                            \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IP ", 0;\n"                                        \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY " {" REGS "}, %" #IA ", %" #IB        \
                     ", p, 1, 1, 0, 0;\n}\n"                                                                   \
                     : __VA_ARGS__                                                                            \
                     : "l"(da), "l"(db), "r"(acc));                                                           \
    }
#define LIK_WGMMA_FP16_BF16(N, REGS, IA, IB, IP, ...)                      \
    LIK_WGMMA_SPEC(0, "f16.f16", N, REGS, IA, IB, IP, __VA_ARGS__)         \
    LIK_WGMMA_SPEC(1, "bf16.bf16", N, REGS, IA, IB, IP, __VA_ARGS__)

LIK_WGMMA_FP16_BF16(64, "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31", 32, 33, 34, LIK_D32)
LIK_WGMMA_FP16_BF16(96, "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47", 48, 49, 50, LIK_D48)
LIK_WGMMA_FP16_BF16(128, "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63", 64, 65, 66, LIK_D64)
LIK_WGMMA_FP16_BF16(256, "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127", 128, 129, 130, LIK_D128)

#else
#define LIK_HAS_WGMMA 0
#endif
