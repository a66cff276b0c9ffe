// Value checks of length and offset arrays, one small kernel each, so that validating them
// costs one launch and (with every other check of the call) one 24-byte-per-check read,
// instead of a chain of array reductions.
//
// Each kernel runs as ONE block (blockDim.x a multiple of 32, at most 1024) and writes three
// int64 slots, so the caller needs no zeroed buffer (the slots may be page-locked host memory,
// which the GPU writes directly):
//   lik_check_range_*: out = {min, max, 0} of v[0 .. n)      (n >= 1)
//   lik_check_offsets_*: out = {off[0], off[n-1], 1 if some off[i+1] < off[i] else 0}   (n >= 1)
// The caller turns these into its error message.
#include "common.cuh"

#define LIK_I64_MAX 0x7fffffffffffffffLL

template <typename I>
__device__ __forceinline__ void range_block(const I* __restrict__ v, long long n, i64* out) {
    __shared__ i64 smin[32], smax[32];
    i64 lo = LIK_I64_MAX, hi = -LIK_I64_MAX - 1;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) {
        const i64 x = (i64)v[i];
        lo = x < lo ? x : lo;
        hi = x > hi ? x : hi;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const i64 a = __shfl_xor_sync(0xffffffffu, lo, o), b = __shfl_xor_sync(0xffffffffu, hi, o);
        lo = a < lo ? a : lo;
        hi = b > hi ? b : hi;
    }
    const int warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if ((threadIdx.x & 31) == 0) {
        smin[warp] = lo;
        smax[warp] = hi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < nw; ++w) {
            lo = smin[w] < lo ? smin[w] : lo;
            hi = smax[w] > hi ? smax[w] : hi;
        }
        out[0] = lo;
        out[1] = hi;
        out[2] = 0;
    }
}

extern "C" __global__ void lik_check_range_i32(const int* __restrict__ v, long long n, i64* out) {
    range_block(v, n, out);
}

extern "C" __global__ void lik_check_range_i64(const i64* __restrict__ v, long long n, i64* out) {
    range_block(v, n, out);
}

template <typename I>
__device__ __forceinline__ void offsets_block(const I* __restrict__ off, long long n, i64* out) {
    bool dec = false;
    for (long long i = threadIdx.x; i + 1 < n; i += blockDim.x) dec |= off[i + 1] < off[i];
    dec = __syncthreads_or(dec);
    if (threadIdx.x == 0) {
        out[0] = (i64)off[0];
        out[1] = (i64)off[n - 1];
        out[2] = dec ? 1 : 0;
    }
}

extern "C" __global__ void lik_check_offsets_i32(const int* __restrict__ off, long long n, i64* out) {
    offsets_block(off, n, out);
}

extern "C" __global__ void lik_check_offsets_i64(const i64* __restrict__ off, long long n, i64* out) {
    offsets_block(off, n, out);
}
