// float32 accuracy at TF32 speed (LIK_REFINE: float32 wgmma tiles). The tile's similarities come
// from TF32 wgmma, each within E = C * |q| * |d| of its exact value (TF32 keeps 10 of float32's 23
// mantissa bits of each operand: < 2^-10 relative each, so < 2^-9 * sum_k |q_k d_k| for the
// product, which Cauchy-Schwarz bounds by |q| |d|; C adds 2^-12 for the tensor cores' float32
// accumulation, whose error stays below 2^-13 for the dims one-shot tiles take). A row's max can
// only be a similarity whose TF32 value is within E of the best lower bound L seen so far, so only
// those are recomputed from the float32 tiles still in shared memory, each product split exactly
// into two floats and summed without rounding loss (about 2^-44 of the terms' magnitude), by the
// four lanes of the row's quad; the row keeps the exact best in float64. So the max is float64's
// max rounded once to float32, and the argmax float64's (the lower index on a tie, the first NaN
// on a NaN) wherever the two best similarities differ by more than that residue. After the first tile or two a document's
// L sits near its max and a tile has no candidate at all: the warp skips it after one vote.
//
// |d| is bounded per tile: each thread sums the squares of its share of the tile's rows, the warps'
// maxima go through shared memory, and the bound is the sum over the row parts of their maxima
// (every row's norm is at most that). |q| per row is summed once per CTA from the query tile.
// A row with E = 0 (a zero query token, or a tile of zero documents) has exact TF32 values already.
#pragma once
#include "fwd/config.cuh"

namespace lik {

LIK_FWD_TEMPLATE
struct LIK_FWD::Refine {
    const T* const& sQ;
    float* const& tnorm;  // [STAGES][WARPS]: each warp's largest partial squared norm of the slot's rows
    const int &wrow0, &lane, &warp;
    float (&best)[MT][2];
    int (&bidx)[MT][2];
    const bool (&rv)[MT][2];
    double (&xbest)[2];  // the rows' exact maxima so far (-inf: none)
    float (&lo)[2];      // the rows' lower bounds L
    float (&cq)[2];      // C * |q| per row; negative until computed

    static constexpr float C = 0x1p-9f + 0x1p-12f;
    static constexpr int P = NT >= BN ? NT / BN : 1;  // threads (parts of the dim) per row

    __device__ void reset() const {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            xbest[h] = -__longlong_as_double(0x7ff0000000000000ll);
            lo[h] = LIK_NEG_INF;
            best[0][h] = LIK_NEG_INF;
            bidx[0][h] = -1;
        }
    }

    // This warp's rows' C * |q| (once per CTA: the query tile is in place from the first stage on).
    __device__ void query_norms() const {
        const int g = lane >> 2, tq = lane & 3;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = wrow0 + g + 8 * h;
            float s = 0.f;
            for (int k = tq; k < DP; k += 4) {
                const float x = sQ[soff(r, k, BM)];
                s = fmaf(x, x, s);
            }
            s += __shfl_xor_sync(0xffffffffu, s, 1);
            s += __shfl_xor_sync(0xffffffffu, s, 2);
            cq[h] = C * sqrtf(s) * (1.f + 0x1p-16f);  // the sum's own rounding, well inside C's margin
        }
    }

    // An upper bound on the norm of every row of the tile in `sD` (ring slot `slot`); a named
    // barrier over the CTA's threads publishes the warps' parts.
    __device__ float tile_norm(const T* sD, int slot) const {
        float s = 0.f;
        if constexpr (NT >= BN) {
            const int t = threadIdx.x;
            if (t < P * BN) {
                const int r = t % BN, part = t / BN;
                for (int k = part * (DP / P); k < (part + 1) * (DP / P); ++k) {
                    const float x = sD[soff(r, k, BN)];
                    s = fmaf(x, x, s);
                }
            }
        } else {
            for (int r = threadIdx.x; r < BN; r += NT) {
                float rs = 0.f;
                for (int k = 0; k < DP; ++k) {
                    const float x = sD[soff(r, k, BN)];
                    rs = fmaf(x, x, rs);
                }
                s = fmaxf(s, rs);
            }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) s = fmaxf(s, __shfl_xor_sync(0xffffffffu, s, off));
        if (lane == 0) tnorm[slot * WARPS + warp] = s;
        named_sync(1, NT);
        // Warps of one part (NT >= BN: warp w holds rows of part w * 32 / BN) share its maximum.
        float part_max[P];
#pragma unroll
        for (int p = 0; p < P; ++p) part_max[p] = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const int p = NT >= BN ? min(w * 32 / BN, P - 1) : 0;
            part_max[p] = fmaxf(part_max[p], tnorm[slot * WARPS + w]);
        }
        float total = 0.f;
#pragma unroll
        for (int p = 0; p < P; ++p) total += part_max[p];
        return sqrtf(total) * (1.f + 0x1p-16f);
    }

    // Lane tq's part of the exact similarity of tile row r and slot row c: every fourth 16-byte
    // chunk of the rows, each product exact as hi + lo (fmaf), summed with error-free additions
    // (TwoSum), so the four parts carry the dot product to about 2^-44 of its terms' magnitude.
    __device__ float2 exact_part(const T* sD, int r, int c, int tq) const {
        float s = 0.f, e = 0.f;
#pragma unroll 4
        for (int kc = tq; kc < DP / 4; kc += 4) {
            const float4 a = *reinterpret_cast<const float4*>(sQ + soff(r, 4 * kc, BM));
            const float4 b = *reinterpret_cast<const float4*>(sD + soff(c, 4 * kc, BN));
            two_sum_product(s, e, a.x, b.x);
            two_sum_product(s, e, a.y, b.y);
            two_sum_product(s, e, a.z, b.z);
            two_sum_product(s, e, a.w, b.w);
        }
        return float2{s, e};
    }
    // s + e += a * b, the product split exactly (fmaf) and its high part added by TwoSum.
    static __device__ __forceinline__ void two_sum_product(float& s, float& e, float a, float b) {
        const float p = a * b, pl = fmaf(a, b, -p);
        const float t = s + p, bp = t - s;
        e += ((s - (t - bp)) + (p - bp)) + pl;
        s = t;
    }

    // Whether exact value x at token tok beats the row's (xb, ix): larger, or equal at a lower
    // token; a NaN beats any number, the first NaN stays.
    static __device__ __forceinline__ bool beats(double x, int tok, double xb, int ix) {
        if (ix < 0) return true;
        if (x != x) return xb == xb || tok < ix;
        if (xb != xb) return false;
        return x > xb || (x == xb && tok < ix);
    }

    __device__ void take(int h, double x, int tok) const {
        if (beats(x, tok, xbest[h], bidx[0][h])) {
            xbest[h] = x;
            best[0][h] = (float)x;
            bidx[0][h] = tok;
        }
    }

    // Fold the tile in acc (document tokens tok0 .. tok0 + BN - 1 of a document of `len` tokens with
    // mask `dm`, staged in slot `slot`) into the rows' exact maxima.
    __device__ void fold(A (&acc)[MT][NN][4], const T* sD, int slot, int tok0, int len, const u8* dm) const {
        if (cq[0] < 0.f) query_norms();
        const float mnorm = tile_norm(sD, slot);
        const int g = lane >> 2, tq = lane & 3;
        const bool full = !dm && tok0 + BN <= len;
        float e[2];
        bool use[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            e[h] = cq[h] * mnorm;
            use[h] = rv[0][h];
        }
        // Pass 1: the tile's largest TF32 value per row (over the quad), which raises L by v - E.
        float tmax[2] = {LIK_NEG_INF, LIK_NEG_INF};
        bool tnan[2] = {false, false};
#pragma unroll
        for (int n = 0; n < NN; ++n)
#pragma unroll
            for (int x = 0; x < 2; ++x) {
                const int tok = tok0 + n * 8 + 2 * tq + x;
                const bool ok = full || (tok < len && (!dm || dm[tok]));
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float v = acc[0][n][2 * h + x];
                    if (ok) {
                        tmax[h] = fmaxf(tmax[h], v);
                        tnan[h] |= v != v;
                    }
                }
            }
        unsigned long long cand = 0;  // this lane's candidates: bit (n * 2 + x) * 2 + h
        bool any = false;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float m = tmax[h];
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
            const float lb = fmaxf(lo[h], fmaxf(m - e[h], (float)xbest[h]));
            lo[h] = lb;
            tmax[h] = lb - e[h];  // the threshold a candidate's TF32 value must reach
            any |= use[h] && (tnan[h] || m >= tmax[h]);
        }
        if (!__any_sync(0xffffffffu, any)) return;
        // Pass 2: this lane's candidates. E = 0: the TF32 values are exact (zero products).
#pragma unroll
        for (int n = 0; n < NN; ++n)
#pragma unroll
            for (int x = 0; x < 2; ++x) {
                const int tok = tok0 + n * 8 + 2 * tq + x;
                const bool ok = full || (tok < len && (!dm || dm[tok]));
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float v = acc[0][n][2 * h + x];
                    if (!(ok && use[h] && !(v < tmax[h]))) continue;
                    if (e[h] == 0.f) take(h, (double)v, tok);
                    else cand |= 1ull << ((n * 2 + x) * 2 + h);
                }
            }
        // Each quad recomputes its own lanes' candidates (its own rows) one at a time, the quads side
        // by side; the quad's four lanes take a quarter of the dim each and all keep the result.
        for (;;) {
            const unsigned lanes = __ballot_sync(0xffffffffu, cand != 0);
            if (!lanes) break;
            const unsigned mine = (lanes >> (lane & ~3)) & 0xFu;  // this quad's lanes with candidates
            const int src = (lane & ~3) + (mine ? __ffs(mine) - 1 : 0);
            const int bit = __shfl_sync(0xffffffffu, cand ? __ffsll((long long)cand) - 1 : 0, src);
            if (mine && lane == src) cand &= cand - 1;
            const int h = bit & 1, x = (bit >> 1) & 1, n = bit >> 2;
            const int c = n * 8 + 2 * (src & 3) + x;
            float2 p = mine ? exact_part(sD, wrow0 + g + 8 * h, c, tq) : float2{0.f, 0.f};
#pragma unroll
            for (int off = 1; off <= 2; off <<= 1) {
                const float os = __shfl_xor_sync(0xffffffffu, p.x, off), oe = __shfl_xor_sync(0xffffffffu, p.y, off);
                const float t = p.x + os, bp = t - p.x;
                p.y += ((p.x - (t - bp)) + (os - bp)) + oe;
                p.x = t;
            }
            if (mine) {
                const double v = (double)p.x + (double)p.y;
                if (h) take(1, v, tok0 + c);
                else take(0, v, tok0 + c);
            }
        }
    }
};

}  // namespace lik
