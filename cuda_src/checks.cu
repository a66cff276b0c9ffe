// Value checks of length and offset arrays, one small kernel each, so that validating them
// costs one launch and (with every other check of the call) one 24-byte-per-check read,
// instead of a chain of array reductions.
//
// Each kernel runs as ONE block (blockDim.x a multiple of 32, at most 1024) and writes three
// int64 slots, so the caller needs no zeroed buffer (the slots may be page-locked host memory,
// which the GPU writes directly):
//   lik_check_range_*: out = {min, max, 0} of v[0 .. n)      (n >= 1)
//   lik_check_offsets_*: out = {off[0], off[n-1], 1 if some off[i+1] < off[i] else 0}   (n >= 1)
// The caller turns these into its error message (strict mode, validate=True).
//
// By default a call reads no check on the host. lik_nan_invalid instead runs after the scoring
// kernel, on its stream, and writes NaN into exactly the scores an invalid value touches (and -1
// into their argmax rows). The scoring kernels clamp every length to [0, L] and every document
// to [0, T), so those values were never read out of bounds; this pass only marks what they gave.
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

// An int32 or int64 entry of a caller's array, widened.
__device__ __forceinline__ i64 entry_at(const void* p, int wide, i64 i) {
    return wide ? static_cast<const i64*>(p)[i] : static_cast<i64>(static_cast<const int*>(p)[i]);
}

// One warp per document row r (a column j of the scores, or with per_cell a single cell r =
// i * nd + j: per-query candidates and pairs). A row is invalid when
//   d_len[r] is outside [0, d_limit];
//   d_off (packed documents, shared by every query): d_off[j] < 0, d_off[j + 1] < d_off[j],
//     d_off[j + 1] > ntok, or the whole array, off_all [nd_all + 1], does not run from 0 to ntok
//     (d_off may be a slice of it: retrieve's chunks);
//   d_scale (INT8): a scale of one of its valid tokens is negative, NaN or infinite (padded rows: tokens
//     r * ld .. r * ld + ld, the first d_len[r] or those d_mask keeps; packed: d_off[j] ..
//     d_off[j + 1]).
// A cell (i, j) is invalid when its row is, or when q_len[i] is outside [0, q_limit].
// Invalid cells get NaN scores and an argmax row of -1 (lq entries, when amax is given).
extern "C" __global__ void lik_nan_invalid(float* __restrict__ scores, int* __restrict__ amax, long long nq,
                                           long long nd, int lq, int per_cell,
                                           const void* q_len, int q_wide, long long q_limit,
                                           const void* d_len, int d_wide, long long d_limit,
                                           const void* d_off, int off_wide, long long ntok,
                                           const float* __restrict__ d_scale, const u8* __restrict__ d_mask,
                                           long long ld, const void* off_all, long long nd_all) {
    const int lane = threadIdx.x & 31;
    const long long rows = per_cell ? nq * nd : nd;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    bool whole_bad = false;
    if (d_off) whole_bad = entry_at(off_all, off_wide, 0) != 0 || entry_at(off_all, off_wide, nd_all) != ntok;
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
        const long long j = per_cell ? r % nd : r;
        bool bad = whole_bad;
        long long lo = r * ld, hi = r * ld + ld;  // the row's scale tokens (padded)
        if (d_len) {
            const i64 v = entry_at(d_len, d_wide, r);
            bad |= v < 0 || v > d_limit;
            hi = lo + (v < 0 ? 0 : v > ld ? ld : v);
        }
        if (d_off) {
            lo = entry_at(d_off, off_wide, j);
            hi = entry_at(d_off, off_wide, j + 1);
            bad |= lo < 0 || hi < lo || hi > ntok;
        }
        if (d_scale && !bad) {
            bool neg = false;
            for (long long t = lo + lane; t < hi; t += 32)
                neg |= (!d_mask || d_mask[t]) && !(d_scale[t] >= 0.f && d_scale[t] <= 3.40282347e38f);  // NaN, < 0 or inf
            bad = __any_sync(0xffffffffu, neg);
        }
        // Cells of this row: one (per_cell) or a column of nq, lanes taking queries in turn.
        const long long i0 = per_cell ? r / nd : lane, step = per_cell ? 1 : 32;
        const long long i1 = per_cell ? (lane == 0 ? i0 + 1 : i0) : nq;
        for (long long i = i0; i < i1; i += step) {
            bool cell_bad = bad;
            if (q_len) {
                const i64 v = entry_at(q_len, q_wide, i);
                cell_bad |= v < 0 || v > q_limit;
            }
            if (cell_bad) {
                const long long c = i * nd + j;
                scores[c] = __int_as_float(0x7fc00000);
                if (amax)
                    for (int s = 0; s < lq; ++s) amax[c * lq + s] = -1;
            }
        }
    }
}
