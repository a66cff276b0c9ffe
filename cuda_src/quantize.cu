// Per-token symmetric INT8 quantisation, the device half of lik_cupy/quantize.py:
//
//   scale = max_k |x[k]| / 127,   q[k] = rint(x[k] / scale)   (q in [-127, 127])
//
// in IEEE float32 (NVRTC's default division is correctly rounded), so the result is
// bitwise that of the NumPy path. An all-zero token (padding) gets scale 0 and q 0. A
// token holding NaN or inf gets scale NaN and q 0, so every score against it is NaN,
// and sets *bad (the caller decides whether that is an error; no host sync here).
//
// -D flags: LIK_ELEM 0 fp16, 1 bf16 (both as 16-bit patterns), 2 fp32: the input's type.
#include "common.cuh"

#ifndef LIK_ELEM
#error "LIK_ELEM is set by lik_cupy._runtime.quantize"
#endif

#if LIK_ELEM == 2
typedef float T;
__device__ __forceinline__ float to_f(T x) { return x; }
#else
typedef u16 T;
__device__ __forceinline__ float to_f(T x) { return LIK_ELEM == 0 ? f16_bits_to_f32(x) : bf16_bits_to_f32(x); }
#endif

// max_k |x[k]| of one token's row (NaN if any is NaN), on every lane of the warp that reads it.
__device__ __forceinline__ float row_absmax(const T* xr, int dim, int lane) {
    float m = 0.f;
    for (int k = lane; k < dim; k += 32) m = max_nan(m, fabsf(to_f(xr[k])));
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, off));
    return m;
}

// One warp per token: the absmax in two passes over the row (the second read hits L1).
extern "C" __global__ void lik_quantize_int8(const T* __restrict__ x, signed char* __restrict__ q,
                                             float* __restrict__ scale, long long rows, int dim, int* bad) {
    const int lane = threadIdx.x & 31;
    const long long nwarps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long r = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += nwarps) {
        const T* xr = x + r * dim;
        const float m = row_absmax(xr, dim, lane);
        const bool finite = m <= 3.402823466e38f;  // false for NaN and inf
        const float s = finite ? m / 127.f : __int_as_float(0x7fffffff);
        signed char* qr = q + r * dim;
        for (int k = lane; k < dim; k += 32) {
            float v = 0.f;
            if (finite && s > 0.f) v = fminf(fmaxf(rintf(to_f(xr[k]) / s), -127.f), 127.f);  // s, not m: m / 127 may underflow
            qr[k] = (signed char)(int)v;
        }
        if (lane == 0) {
            scale[r] = s;
            if (!finite) *bad = 1;
        }
    }
}

// Symmetric FP8 e4m3 quantisation, the device half of lik_cupy.quantize_fp8:
//
//   scale = max_k |x[k]| / 448,   q[k] = e4m3(x[k] / scale)   (round to nearest even)
//
// per token, or with `fixed` one scale for every token (per tensor: the host passes the largest
// per-token scale of a first pass, which is the tensor's max |x| / 448 since a correctly rounded
// division by 448 keeps the order). IEEE float32 division and the hardware's e4m3 rounding give
// the bytes of the NumPy path (ml_dtypes) and of torch's float8_e4m3fn cast. Zero, NaN and inf
// tokens as in lik_quantize_int8 (q 0; scale 0, or NaN and *bad set). e4m3 conversion needs sm_89.
extern "C" __global__ void lik_quantize_fp8(const T* __restrict__ x, u8* __restrict__ q, float* __restrict__ scale,
                                            long long rows, int dim, int* bad, const float* __restrict__ fixed) {
    const int lane = threadIdx.x & 31;
    const long long nwarps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long r = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += nwarps) {
        const T* xr = x + r * dim;
        const float m = row_absmax(xr, dim, lane);
        const bool finite = m <= 3.402823466e38f;  // false for NaN and inf
        const float s = fixed ? *fixed : finite ? m / 448.f : LIK_NAN;
        const bool ok = finite && s > 0.f && s <= 3.402823466e38f;
        u8* qr = q + r * dim;
        for (int k = lane; k < dim; k += 32) {
            u16 pair = 0;
#if __CUDA_ARCH__ >= 890
            if (ok) asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.f), "f"(to_f(xr[k]) / s));
#else
            if (ok) __trap();  // no e4m3 conversion: the host refuses FP8 below sm_89 before launching
#endif
            qr[k] = (u8)(pair & 0xff);  // the second source is the low byte
        }
        if (lane == 0) {
            scale[r] = s;
            if (!finite) *bad = 1;
        }
    }
}
