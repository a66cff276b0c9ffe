// MaxSim backward from the forward's argmax (no similarity tensor is rebuilt):
//
//   dQ[i, s]   = sum_j g[i, j] * D[row(i, j, a[i, j, s])]                 (a gather)
//   dD[row]    = sum over (i, j, s) with row(i, j, a[i, j, s]) = row of g[i, j] * Q[i, s]   (a scatter)
//
// where a is the int32 argmax [Nq, Nd, Lq] (-1: masked query token or empty document,
// contributes nothing) and row() maps a document-local token to its row of D:
//   in-batch  D [Nd, Ld, d]:        j * Ld + a
//   candidates D [Nq, Nd, Ld, d]:   (i * Nd + j) * Ld + a
//   packed    D [T, d] + offsets:   off[j] + a
// An entry that is neither -1 nor a token of its document (row outside [0, rows) included) makes
// dQ[i, s] NaN and adds nothing to dD: unchecked input never writes outside dD (strict mode
// checks the argmax on the host first).
//
// Every kernel gives one warp a (row, 128-column chunk): each lane owns 4 columns, keeps
// its fp32 sums in registers and writes them once. dQ has a single writer per row and adds
// in a fixed order (deterministic). dD is either
//   * fused into the dQ pass with fp32 atomics into a float buffer (fast, order varies), or
//   * built from a CSR map of the argmax: entries sorted by (row, i, j, s) and one warp per
//     row of dD summing them in that order (bitwise reproducible).
//
// -D flags: LIK_ELEM 0 fp16, 1 bf16, 2 fp32; LIK_VEC 1 when dim % 4 == 0 and rows are
// aligned for 4-element loads.
#include "elem_rows.cuh"
#ifndef LIK_VEC
#define LIK_VEC 0
#endif

namespace lik_bwd {

using lik_rows::T;
using lik_rows::to_f;
using lik_rows::from_f;

// 4 consecutive elements starting at column k (k < dim); columns >= dim read as 0.
__device__ __forceinline__ void load4(float (&v)[4], const T* row, int k, int dim) {
#if LIK_VEC
    if (k + 3 < dim) {
#if LIK_ELEM == 2
        const float4 x = *reinterpret_cast<const float4*>(row + k);
        v[0] = x.x; v[1] = x.y; v[2] = x.z; v[3] = x.w;
#else
        const uint2 x = *reinterpret_cast<const uint2*>(row + k);
        v[0] = to_f((T)(x.x & 0xffff)); v[1] = to_f((T)(x.x >> 16));
        v[2] = to_f((T)(x.y & 0xffff)); v[3] = to_f((T)(x.y >> 16));
#endif
        return;
    }
#endif
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = k + e < dim ? to_f(row[k + e]) : 0.f;
}

__device__ __forceinline__ void store4(T* row, int k, int dim, const float (&v)[4]) {
#pragma unroll
    for (int e = 0; e < 4; ++e)
        if (k + e < dim) row[k + e] = from_f(v[e]);
}

__device__ __forceinline__ void atomic_add4(float* p, int k, int dim, const float (&v)[4]) {
#if __CUDA_ARCH__ >= 900
    if (k + 3 < dim && ((reinterpret_cast<unsigned long long>(p + k) & 15) == 0)) {
        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p + k), "f"(v[0]), "f"(v[1]), "f"(v[2]),
                     "f"(v[3])
                     : "memory");
        return;
    }
#endif
#pragma unroll
    for (int e = 0; e < 4; ++e)
        if (k + e < dim) atomicAdd(p + k + e, v[e]);
}

// Document row of (query i, document j, local token a); -1 when outside [0, rows).
__device__ __forceinline__ i64 doc_row(const i64* d_off, int i, int j, int a, int Nd, int Ld, bool cand, i64 rows) {
    i64 r;
    if (d_off) {
        const i64 s = d_off[j], e = d_off[j + 1];
        if (a >= e - s) return -1;
        r = s + a;
    } else {
        if (a >= Ld) return -1;
        r = ((cand ? (i64)i * Nd : 0) + j) * Ld + a;
    }
    return r >= 0 && r < rows ? r : -1;
}

}  // namespace lik_bwd

using namespace lik_bwd;

// One warp per (query token (i, s), 128-column chunk): dQ row, and with dD32 != NULL the
// atomic scatter of g[i, j] * Q[i, s] into dD32 (fp32 [rows, dim], zeroed by the host).
// The warp reads 32 documents' argmax entries, rows and g at once (a lane each), then gathers
// their D rows GATHER at a time with the loads in flight together: one document at a time waited
// on two dependent loads each. The sums still run over j in order, so dQ keeps its bits.
// GATHER 4 or 8 was faster on grids of few warps but slower on large ones (fewer warps fit).
constexpr int GATHER = 2;
extern "C" __global__ void __launch_bounds__(256) lik_bwd_dq(const T* __restrict__ Q, const T* __restrict__ D,
                                                          const float* __restrict__ g, const int* __restrict__ amax,
                                                          const i64* __restrict__ d_off, T* __restrict__ dQ,
                                                          float* __restrict__ dD32, int Nq, int Nd, int Lq, int Ld,
                                                          int dim, int cand, long long rows) {
    const int lane = threadIdx.x & 31;
    const i64 tok = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (tok >= (i64)Nq * Lq) return;  // whole warps: every lane below takes part in the shuffles
    const int i = (int)(tok / Lq), s = (int)(tok - (i64)i * Lq);
    const int k = blockIdx.y * 128 + lane * 4;
    float acc[4] = {0.f, 0.f, 0.f, 0.f}, q[4];
    if (dD32) load4(q, Q + tok * dim, k < dim ? k : 0, k < dim ? dim : 0);
    const int* ap = amax + (i64)i * Nd * Lq + s;
    const float* gp = g + (i64)i * Nd;
    bool invalid = false;
    for (unsigned j0 = 0; j0 < (unsigned)Nd; j0 += 32) {  // (unsigned: Nd near 2^31 would wrap an int)
        const unsigned uj = j0 + lane;  // (compared unsigned: past 2^31 - 1 an int would wrap negative)
        const int j = (int)uj;
        i64 r = -1;
        float gj = 0.f;
        bool bad = false;
        if (uj < (unsigned)Nd) {
            const int a = ap[(i64)j * Lq];
            if (a != -1) {
                r = a < 0 ? -1 : doc_row(d_off, i, j, a, Nd, Ld, cand != 0, rows);
                bad = r < 0;
                if (!bad) gj = gp[j];
            }
        }
        invalid |= __any_sync(0xffffffffu, bad);
        unsigned live = __ballot_sync(0xffffffffu, r >= 0);  // the documents that add, lowest j first
        while (live) {
            i64 rr[GATHER];
            float gg[GATHER], v[GATHER][4];
            bool has[GATHER];
#pragma unroll
            for (int u = 0; u < GATHER; ++u) {
                has[u] = live != 0;
                const int b = has[u] ? __ffs(live) - 1 : 0;
                live &= live - 1;
                rr[u] = __shfl_sync(0xffffffffu, r, b);
                gg[u] = __shfl_sync(0xffffffffu, gj, b);
                if (has[u] && k < dim) load4(v[u], D + rr[u] * dim, k, dim);
            }
#pragma unroll
            for (int u = 0; u < GATHER; ++u) {
                if (!has[u] || k >= dim) continue;
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[e] += gg[u] * v[u][e];
                if (dD32) {
                    float w[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) w[e] = gg[u] * q[e];
                    atomic_add4(dD32 + rr[u] * dim, k, dim, w);
                }
            }
        }
    }
    if (invalid) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[e] = __int_as_float(0x7fc00000);
    }
    if (k < dim) store4(dQ + tok * dim, k, dim, acc);
}

// CSR keys: key[e] = row * M + e for the entry e = (i * Nd + j) * Lq + s of the argmax, or
// rows * M (sorted last, never read) when it contributes nothing. M = Nq * Nd * Lq.
extern "C" __global__ void lik_bwd_keys(const int* __restrict__ amax, const i64* __restrict__ d_off,
                                        long long* __restrict__ key, int Nq, int Nd, int Lq, int Ld, int cand,
                                        long long rows) {
    const i64 M = (i64)Nq * Nd * Lq;
    for (i64 e = blockIdx.x * (i64)blockDim.x + threadIdx.x; e < M; e += (i64)gridDim.x * blockDim.x) {
        const int a = amax[e];
        i64 r = -1;
        if (a >= 0) {
            const i64 ij = e / Lq;
            const int i = (int)(ij / Nd), j = (int)(ij - (i64)i * Nd);
            r = doc_row(d_off, i, j, a, Nd, Ld, cand != 0, rows);
        }
        key[e] = (r < 0 ? rows : r) * M + e;
    }
}

// One warp per (row of D, 128-column chunk): dD[row] = sum of g[i, j] * Q[i, s] over the
// row's entries in sorted-key order. start [rows + 1] delimits each row's run of keys.
extern "C" __global__ void __launch_bounds__(256) lik_bwd_dd_csr(const T* __restrict__ Q, const float* __restrict__ g,
                                                              const long long* __restrict__ key,
                                                              const long long* __restrict__ start,
                                                              T* __restrict__ dD, int Nq, int Nd, int Lq, int dim,
                                                              long long rows) {
    const int lane = threadIdx.x & 31;
    const i64 row = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const int k = blockIdx.y * 128 + lane * 4;
    if (k >= dim) return;
    const i64 M = (i64)Nq * Nd * Lq;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (i64 p = start[row]; p < start[row + 1]; ++p) {
        const i64 e = key[p] - row * M;
        const i64 ij = e / Lq;
        const int s = (int)(e - ij * Lq), i = (int)(ij / Nd);
        const float gij = g[ij];
        float v[4];
        load4(v, Q + ((i64)i * Lq + s) * dim, k, dim);
#pragma unroll
        for (int x = 0; x < 4; ++x) acc[x] += gij * v[x];
    }
    store4(dD + row * dim, k, dim, acc);
}

// fp32 -> input dtype, for the atomic path's dD buffer.
extern "C" __global__ void lik_bwd_cast(const float* __restrict__ src, T* __restrict__ dst, long long n) {
    for (i64 x = blockIdx.x * (i64)blockDim.x + threadIdx.x; x < n; x += (i64)gridDim.x * blockDim.x)
        dst[x] = from_f(src[x]);
}
