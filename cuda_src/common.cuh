// Inline-PTX building blocks shared by the kernel families (sm_80+).
// No CUDA headers are included: NVRTC must compile these from a pip-only
// install, so half/bfloat16 data is handled as raw 16-bit patterns and fed
// straight to the tensor cores.
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;
typedef signed char i8;

#include "elements.cuh"

#define LIK_NEG_INF __int_as_float(0xff800000)
#define LIK_NAN __int_as_float(0x7fffffff)

// Segment offsets of packed data as the caller gave them, int32 (FlashAttention's cu_seqlens)
// or int64, so that a call needs no conversion launch before the kernel.
struct Offsets {
    const void* p;
    int wide;   // 1: int64 entries, 0: int32
    int whole;  // 1: they run from 0 to the kernel's ntok (the caller's whole array, not a slice)
    // Padded documents on the packed path (the forward's LIK_STRIDED kernels, which read no array):
    // document j's work position is j * stride, and it is document base + j of D (a query's
    // candidates; 0 for a corpus every query shares).
    i64 stride, base;
    __device__ __forceinline__ i64 operator[](i64 j) const {
        return wide ? static_cast<const i64*>(p)[j] : static_cast<i64>(static_cast<const int*>(p)[j]);
    }
};

// Entry i of a lengths array as the caller gave it: int32, or int64 when the low bit of its address
// is set (arrays are at least 4-byte aligned, so the bit is free), so that int64 lengths need no
// conversion launch. An int64 length's low word is its value for every length in [0, 2^31); an
// invalid one reads as some int32 the kernels clamp, and the NaN pass (checks.cu) marks its scores.
__device__ __forceinline__ int length_at(const int* p, i64 i) {
    const unsigned long long a = reinterpret_cast<unsigned long long>(p);
    return reinterpret_cast<const int*>(a & ~1ull)[i << (a & 1)];  // branch-free: no registers held across
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// 16-byte global->shared copy; src_bytes == 0 zero-fills without reading.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// 16-byte global->shared copy of src, or (ok false) 16 zero bytes without reading src, which may
// then point anywhere: cp.async's ignore-src form, which spares the caller an address select.
__device__ __forceinline__ void cp_async_16_or_zero(u32 dst, const void* src, bool ok) {
    asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, %2, 0;\ncp.async.cg.shared.global [%0], [%1], 16, p;\n}\n" ::"r"(dst),
                 "l"(src), "r"((u32)ok));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// D = A * B + D, accumulators Elem<ELEM>::Acc: fp16 / bf16 m16n8k16, tf32 m16n8k8, int8 and e4m3 m16n8k32.
template <int ELEM>
__device__ __forceinline__ void mma(typename Elem<ELEM>::Acc (&c)[4], const u32 (&a)[4], u32 b0, u32 b1);

template <>
__device__ __forceinline__ void mma<0>(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma<1>(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma<2>(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// fp16 / bf16 bit patterns to float (exact).
__device__ __forceinline__ float f16_bits_to_f32(u16 x) {
    float f;
    asm("{ .reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "h"(x));
    return f;
}
__device__ __forceinline__ float bf16_bits_to_f32(u16 x) { return __int_as_float(((u32)x) << 16); }

// int32 accumulators of the INT8 mma: D = A * B + D with A 16x32 and B 32x8 int8 (the same
// register layout, in bytes, as the 16-bit m16n8k16, so the ldmatrix paths serve both).
template <>
__device__ __forceinline__ void mma<3>(int (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// FP8 e4m3 (sm_89+): A 16x32 and B 32x8 e4m3, float32 accumulators; the INT8 form's register
// layout, in bytes.
template <>
__device__ __forceinline__ void mma<4>(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// int32 -> float, exact for |x| < 2^22, as an integer add and a float subtract: the bits of
// 1.5 * 2^23 + x are those of 0x4B400000 + x. Both run at full rate, unlike the I2F conversion.
__device__ __forceinline__ float i2f_small(int x) { return __int_as_float(x + 0x4B400000) - 12582912.f; }

// 4-byte global->shared copy (the per-token INT8 scales); src_bytes == 0 zero-fills.
__device__ __forceinline__ void cp_async_4(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ u32 to_tf32(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
}

// x as hi + lo, both tf32: hi = tf32(x) and lo = tf32(x - hi) (x - hi is exact in fp32). An
// infinite or NaN x gets lo = 0, so hi * y carries it as the one-product path does (x - hi would
// be NaN for an infinite x).
__device__ __forceinline__ void split_tf32(float x, u32& hi, u32& lo) {
    hi = to_tf32(x);
    const float r = x - __uint_as_float(hi);
    lo = to_tf32(r == r ? r : 0.f);
}

// Named CTA barriers (id 1..15; 0 is __syncthreads): arrive signals without waiting (and
// releases this thread's earlier shared-memory writes), sync waits for `threads` arrivals.
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// max that propagates NaN (fmaxf would drop it and hide a broken embedding).
__device__ __forceinline__ float max_nan(float a, float b) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// (value, index) merge for argmax: NaN wins over numbers, then larger value,
// then lower index; index < 0 means "no candidate yet".
__device__ __forceinline__ void argmax_merge(float& v, int& i, float ov, int oi) {
    if (oi < 0) return;
    bool take;
    if (i < 0) {
        take = true;
    } else {
        const bool vn = v != v, on = ov != ov;
        if (vn || on) take = on && (!vn || oi < i);
        else take = ov > v || (ov == v && oi < i);
    }
    if (take) { v = ov; i = oi; }
}
