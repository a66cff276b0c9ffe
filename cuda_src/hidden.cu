// The fused projection head's normalisation (lik_cupy/_runtime/hidden.py, lik_cupy/fused_head.py):
// projected tokens D [rows, dim] L2-normalised in place, and the normalisation's gradient. One warp
// per row: the row's float32 sum of squares by a butterfly, then each element once more (the
// second read hits L1). A row of 128 16-bit elements is 256 bytes, so the pair of passes reads and
// writes D once each from memory, where CuPy's row reduction and its broadcast elementwise kernel
// took 279 and 182 us for 300,000 rows on an H200 (0.04 ms is the HBM floor).
//
//   normalize:  y = (x + bias) / max(|x + bias|, eps), the row's sum of squares |x + bias|^2 kept
//               in ss[row] for the backward (F.normalize's arithmetic, with the bias added in float32);
//   grad:       g = keep ? (g - y <y, g>) / |x| : 0 where |x| >= eps (torch's clamp_min passes the
//               gradient at eps itself), g / eps below
//               (then y's norm is not 1 and <y, g> does not enter).
//
// -D flags: LIK_ELEM 0 fp16, 1 bf16 (both as 16-bit patterns), 2 fp32: the rows' type (elem_rows.cuh).
#include "elem_rows.cuh"

namespace lik_hidden {

using lik_rows::T;
using lik_rows::to_f;
using lik_rows::from_f;

__device__ __forceinline__ float warp_sum(float s) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    return s;
}

}  // namespace lik_hidden

using namespace lik_hidden;

// bias: float32 [dim], or null. ss: float32 [rows], or null.
extern "C" __global__ void lik_hidden_normalize(T* __restrict__ D, const float* __restrict__ bias,
                                                float* __restrict__ ss, long long rows, int dim, float eps) {
    const int lane = threadIdx.x & 31;
    const long long nwarps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long r = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += nwarps) {
        T* x = D + r * dim;
        float s = 0.f;
        for (int k = lane; k < dim; k += 32) {
            const float v = to_f(x[k]) + (bias ? bias[k] : 0.f);
            s = fmaf(v, v, s);
        }
        s = warp_sum(s);
        const float n = fmaxf(sqrtf(s), eps);
        for (int k = lane; k < dim; k += 32) x[k] = from_f((to_f(x[k]) + (bias ? bias[k] : 0.f)) / n);
        if (ss && lane == 0) ss[r] = s;
    }
}

// Y: the normalised rows; G: their gradient, overwritten with the unnormalised rows' gradient.
// ss: the rows' sums of squares from lik_hidden_normalize, or null (no normalisation: G masked
// only). keep: uint8 [rows], or null (every row).
extern "C" __global__ void lik_hidden_normalize_grad(const T* __restrict__ Y, T* __restrict__ G,
                                                     const float* __restrict__ ss, const unsigned char* __restrict__ keep,
                                                     long long rows, int dim, float eps) {
    const int lane = threadIdx.x & 31;
    const long long nwarps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long r = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += nwarps) {
        const T* y = Y + r * dim;
        T* g = G + r * dim;
        if (keep && !keep[r]) {
            for (int k = lane; k < dim; k += 32) g[k] = from_f(0.f);
            continue;
        }
        if (!ss) continue;  // the gradient as it is
        float dot = 0.f;
        for (int k = lane; k < dim; k += 32) dot = fmaf(to_f(y[k]), to_f(g[k]), dot);
        dot = warp_sum(dot);
        const float n = sqrtf(ss[r]), c = n >= eps ? dot : 0.f, den = fmaxf(n, eps);
        for (int k = lane; k < dim; k += 32) g[k] = from_f((to_f(g[k]) - to_f(y[k]) * c) / den);
    }
}
