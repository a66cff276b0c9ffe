// float32 accuracy at TF32 speed (LIK_REFINE: one-shot float32 wgmma tiles).
//
// The tile's similarities come from TF32 wgmma, which reads each float32 operand as its TF32 part x~
// (its top 19 bits; rounding instead of truncating would only err less). With dx = x - x~, a
// product's TF32 value misses its exact one by at most
//     E = |dq| |d| + |q~| |dd| + A |q| |d|
// (two Cauchy-Schwarz bounds of sum_k dq_k d_k + q~_k dd_k, and A = 2^-13 for the tensor cores'
// float32 accumulation of at most 512 exact TF32 products, each rounding step below 2^-23 of the
// running magnitude). |dq| and |q~| are summed once per CTA from the query tile; |d| and |dd| are
// bounded per tile by the sum over the row parts of the parts' largest squared sums, which
// tile_mma has the threads take while the tensor cores multiply (norm_part).
//
// A row's max is then at least L, the best v - E or exact value seen, and only similarities whose
// TF32 value reaches L - E can be it. Those candidates are recomputed from the float32 tiles still in
// shared memory: each product split exactly into two floats (fmaf) and summed by error-free
// additions, to about 2^-44 of the terms' magnitude, by the four lanes of the row's quad while the
// other quads do theirs. The row keeps its exact best in float64. So a row's max is float64's max
// rounded once to float32, and its argmax float64's (the lower index on a tie, the first NaN on a
// NaN) wherever the two best similarities differ by more than that residue. After a document's first
// tiles L sits near its max, and most tiles have no candidate: the warp skips them after one vote.
// Rows with E = 0 (a zero query token, or a tile of zero rows) have exact TF32 values already.
#pragma once
#include "fwd/config.cuh"

namespace lik {

LIK_FWD_TEMPLATE
struct LIK_FWD::Refine {
    const T* const& sQ;
    float* const& tnorm;  // [STAGES][WARPS][2]: each warp's largest part of |d|^2 and |dd|^2 (norm_part)
    const int &wrow0, &lane, &warp;
    float (&best)[MT][2];
    int (&bidx)[MT][2];
    const bool (&rv)[MT][2];
    double (&xbest)[2];  // the rows' exact maxima so far (-inf: none)
    float (&lo)[2];      // the rows' lower bounds L
    float (&a1)[2];      // per row |dq| + A |q|; negative until computed
    float (&a2)[2];      // per row |q~|

    static constexpr float ACC = 0x1p-13f;
    static constexpr float UP = 1.f + 0x1p-16f;  // covers the float32 rounding of the norms' sums
    static constexpr int P = NT >= BN ? NT / BN : 1;  // threads (parts of the dim) per row

    static __device__ __forceinline__ float tf32_part(float x) { return __uint_as_float(__float_as_uint(x) & 0xFFFFE000u); }

    __device__ void reset() const {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            xbest[h] = -__longlong_as_double(0x7ff0000000000000ll);
            lo[h] = LIK_NEG_INF;
            best[0][h] = LIK_NEG_INF;
            bidx[0][h] = -1;
        }
    }

    // This warp's rows' error weights (once per CTA: the query tile is in place from the first stage on).
    __device__ void query_norms() const {
        const int g = lane >> 2, tq = lane & 3;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = wrow0 + g + 8 * h;
            float s = 0.f, rr = 0.f, tt = 0.f;
            for (int k = tq; k < DP; k += 4) {
                const float x = sQ[soff(r, k, BM)], t = tf32_part(x), dx = x - t;
                s = fmaf(x, x, s);
                rr = fmaf(dx, dx, rr);
                tt = fmaf(t, t, tt);
            }
#pragma unroll
            for (int off = 1; off <= 2; off <<= 1) {
                s += __shfl_xor_sync(0xffffffffu, s, off);
                rr += __shfl_xor_sync(0xffffffffu, rr, off);
                tt += __shfl_xor_sync(0xffffffffu, tt, off);
            }
            a1[h] = (sqrtf(rr) + ACC * sqrtf(s)) * UP;
            a2[h] = sqrtf(tt) * UP;
        }
    }

    // This thread's part of the tile's squared row norms, |d|^2 and |dd|^2 (called by tile_mma while
    // the tile's wgmma runs): the largest of its rows' sums over its part of the dim, the warp's
    // largest in tn[2 * warp], tn[2 * warp + 1]. A row's 128-byte blocks are read chunk by chunk in
    // an order rotated by the row (the swizzle only permutes a block's chunks, and a sum of squares
    // does not care), so the eight lanes of each load phase hit eight different chunks.
    static __device__ __forceinline__ void norm_part(const T* sD, float* tn) {
        constexpr int KB = DP / BLK, CH = KB * 8;  // 128-byte blocks and 16-byte chunks of a row
        float s = 0.f, rr = 0.f;
        const int t = threadIdx.x;
        for (int r = NT >= BN ? t % BN : t; r < BN && (NT < BN || t < P * BN); r += NT) {
            const int part = NT >= BN ? t / BN : 0;
            float rs = 0.f, rd = 0.f;
#pragma unroll 4
            for (int i = part * (CH / P); i < (part + 1) * (CH / P); ++i) {
                const int kb = i >> 3, ch = (i + r) & 7;
                const float4 x = *reinterpret_cast<const float4*>(sD + (kb * BN + r) * BLK + ch * EPC);
                const float dx = x.x - tf32_part(x.x), dy = x.y - tf32_part(x.y), dz = x.z - tf32_part(x.z),
                            dw = x.w - tf32_part(x.w);
                rs = fmaf(x.x, x.x, fmaf(x.y, x.y, fmaf(x.z, x.z, fmaf(x.w, x.w, rs))));
                rd = fmaf(dx, dx, fmaf(dy, dy, fmaf(dz, dz, fmaf(dw, dw, rd))));
            }
            s = fmaxf(s, rs);
            rr = fmaxf(rr, rd);
            if (NT >= BN) break;
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            s = fmaxf(s, __shfl_xor_sync(0xffffffffu, s, off));
            rr = fmaxf(rr, __shfl_xor_sync(0xffffffffu, rr, off));
        }
        if ((threadIdx.x & 31) == 0) {
            tn[2 * (threadIdx.x >> 5)] = s;
            tn[2 * (threadIdx.x >> 5) + 1] = rr;
        }
    }

    // Upper bounds of |d| and |dd| over the rows of the tile in slot `slot`, once every warp has
    // written its parts (a named barrier over the CTA's threads).
    __device__ float2 tile_norms(int slot) const {
        named_sync(1, NT);
        // Warps of one part (NT >= BN: warp w holds rows of part w * 32 / BN) share its maximum.
        float ps[P], pr[P];
#pragma unroll
        for (int p = 0; p < P; ++p) ps[p] = pr[p] = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const int p = NT >= BN ? min(w * 32 / BN, P - 1) : 0;
            const float2 v = *reinterpret_cast<const float2*>(tnorm + (slot * WARPS + w) * 2);
            ps[p] = fmaxf(ps[p], v.x);
            pr[p] = fmaxf(pr[p], v.y);
        }
        float s = 0.f, r = 0.f;
#pragma unroll
        for (int p = 0; p < P; ++p) {
            s += ps[p];
            r += pr[p];
        }
        return float2{sqrtf(s) * UP, sqrtf(r) * UP};
    }

    // s + e += a * b: the product split exactly (fmaf), its high part added by TwoSum.
    static __device__ __forceinline__ void two_sum_product(float& s, float& e, float a, float b) {
        const float p = a * b, pl = fmaf(a, b, -p);
        const float t = s + p, bp = t - s;
        e += ((s - (t - bp)) + (p - bp)) + pl;
        s = t;
    }

    // Lane tq's part of the exact similarity of tile row r and slot row c (every fourth 16-byte chunk),
    // as s + e, in four independent chains (one per float of a chunk) merged at the end.
    __device__ float2 exact_part(const T* sD, int r, int c, int tq) const {
        float s[4] = {0.f, 0.f, 0.f, 0.f}, e[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
        for (int kc = tq; kc < DP / 4; kc += 4) {
            const float4 a = *reinterpret_cast<const float4*>(sQ + soff(r, 4 * kc, BM));
            const float4 b = *reinterpret_cast<const float4*>(sD + soff(c, 4 * kc, BN));
            two_sum_product(s[0], e[0], a.x, b.x);
            two_sum_product(s[1], e[1], a.y, b.y);
            two_sum_product(s[2], e[2], a.z, b.z);
            two_sum_product(s[3], e[3], a.w, b.w);
        }
        two_sum_product(s[0], e[0], s[1], 1.f);
        two_sum_product(s[2], e[2], s[3], 1.f);
        two_sum_product(s[0], e[0], s[2], 1.f);
        return float2{s[0], e[0] + e[1] + e[2] + e[3]};
    }

    // Whether exact value x at token tok beats the row's (xb, ix): larger, or equal at a lower token;
    // a NaN beats any number, the first NaN stays.
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
        if (a1[0] < 0.f) query_norms();
        const float2 dn = tile_norms(slot);
        const int g = lane >> 2, tq = lane & 3;
        const bool full = !dm && tok0 + BN <= len;
        auto valid = [&](int tok) { return full || (tok < len && (!dm || dm[tok])); };
        // Pass 1: the tile's largest TF32 value per row (NaN if any), over the quad.
        float m[2] = {LIK_NEG_INF, LIK_NEG_INF};
        if (full) {
#pragma unroll
            for (int n = 0; n < NN; ++n)
#pragma unroll
                for (int h = 0; h < 2; ++h) m[h] = max_nan(m[h], max_nan(acc[0][n][2 * h], acc[0][n][2 * h + 1]));
        } else {
#pragma unroll
            for (int n = 0; n < NN; ++n)
#pragma unroll
                for (int x = 0; x < 2; ++x) {
                    const bool ok = valid(tok0 + n * 8 + 2 * tq + x);
#pragma unroll
                    for (int h = 0; h < 2; ++h) m[h] = max_nan(m[h], ok ? acc[0][n][2 * h + x] : LIK_NEG_INF);
                }
        }
        float thr[2];
        bool use[2], exact[2], any = false;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            m[h] = max_nan(m[h], __shfl_xor_sync(0xffffffffu, m[h], 1));
            m[h] = max_nan(m[h], __shfl_xor_sync(0xffffffffu, m[h], 2));
            const float e = a1[h] * dn.x + a2[h] * dn.y;
            // L, NaN-free (a NaN is a candidate whatever L is)
            const float lb = fmaxf(lo[h], fmaxf(m[h] - e, (float)xbest[h]));
            lo[h] = lb;
            thr[h] = lb - e;
            const bool reach = rv[0][h] && !(m[h] < thr[h]);
            use[h] = reach && e != 0.f;
            exact[h] = reach && e == 0.f;
            any |= use[h];
        }
        if (__any_sync(0xffffffffu, exact[0] || exact[1])) {
            // E = 0: the TF32 values are the exact ones (tokens in increasing order: '>' keeps the first)
#pragma unroll
            for (int n = 0; n < NN; ++n)
#pragma unroll
                for (int x = 0; x < 2; ++x) {
                    const int tok = tok0 + n * 8 + 2 * tq + x;
                    const bool ok = valid(tok);
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const float v = acc[0][n][2 * h + x];
                        if (exact[h] && ok &&
                            (bidx[0][h] < 0 || v > best[0][h] || (v != v && best[0][h] == best[0][h]))) {
                            best[0][h] = v;
                            bidx[0][h] = tok;
                            xbest[h] = v;
                        }
                    }
                }
        }
        if (!__any_sync(0xffffffffu, any)) return;
        // Pass 2: this lane's candidates, whose TF32 value reaches the threshold (or is NaN).
        unsigned long long cand = 0;  // bit (n * 2 + x) * 2 + h
#pragma unroll
        for (int n = 0; n < NN; ++n)
#pragma unroll
            for (int x = 0; x < 2; ++x) {
                const bool ok = valid(tok0 + n * 8 + 2 * tq + x);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float v = acc[0][n][2 * h + x];
                    if (ok && use[h] && !(v < thr[h])) cand |= 1ull << ((n * 2 + x) * 2 + h);
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
