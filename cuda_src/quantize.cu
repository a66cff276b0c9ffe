// Per-token symmetric INT8 quantisation, the device half of lik_cupy/quantize.py:
//
//   scale = max_k |x[k]| / 127,   q[k] = rint(x[k] / scale)   (q in [-127, 127])
//
// in IEEE float32 (NVRTC's default division is correctly rounded), so the result is
// bitwise that of the NumPy path. An all-zero token (padding) gets scale 0 and q 0. A
// token holding NaN or inf gets scale NaN and q 0, so every score against it is NaN,
// and sets *bad (the caller decides whether that is an error; no host sync here).
//
// -D flags: LIK_ELEM 0 fp16, 1 bf16 (both as 16-bit patterns), 2 fp32.
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

// One warp per token: the absmax in two passes over the row (the second read hits L1).
extern "C" __global__ void lik_quantize_int8(const T* __restrict__ x, signed char* __restrict__ q,
                                             float* __restrict__ scale, long long rows, int dim, int* bad) {
    const int lane = threadIdx.x & 31;
    const long long nwarps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long r = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += nwarps) {
        const T* xr = x + r * dim;
        float m = 0.f;
        for (int k = lane; k < dim; k += 32) m = max_nan(m, fabsf(to_f(xr[k])));
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, off));
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
