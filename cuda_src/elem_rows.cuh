// The element type of the row kernels built once per -D LIK_ELEM (maxsim_bwd.cu, hidden.cu):
// 0 fp16 and 1 bf16, both as their 16-bit patterns, 2 fp32. to_f widens an element to float32;
// from_f rounds a float32 to nearest even (a NaN stays NaN).
#pragma once
#include "common.cuh"

#ifndef LIK_ELEM
#error "LIK_ELEM is set by the launch (lik_cupy._runtime)"
#endif

namespace lik_rows {

#if LIK_ELEM == 2
typedef float T;
__device__ __forceinline__ float to_f(T x) { return x; }
__device__ __forceinline__ T from_f(float x) { return x; }
#else
typedef u16 T;
__device__ __forceinline__ float to_f(T x) { return LIK_ELEM == 0 ? f16_bits_to_f32(x) : bf16_bits_to_f32(x); }
__device__ __forceinline__ T from_f(float x) {
    u16 r;
#if LIK_ELEM == 0
    asm("{ .reg .b16 h; cvt.rn.f16.f32 h, %1; mov.b16 %0, h; }" : "=h"(r) : "f"(x));
#else
    asm("{ .reg .b16 h; cvt.rn.bf16.f32 h, %1; mov.b16 %0, h; }" : "=h"(r) : "f"(x));
#endif
    return r;
}
#endif

}  // namespace lik_rows
