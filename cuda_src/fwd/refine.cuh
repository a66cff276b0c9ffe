// float32 accuracy at TF32 speed (LIK_REFINE: one-shot float32 wgmma tiles).
//
// The tile's similarities come from TF32 wgmma, which reads each float32 operand as its TF32 part x~
// (its top 19 bits; rounding instead of truncating would only err less). With dx = x - x~, a
// product's TF32 value misses its exact one by at most
//     E = |dq| |d| + |q~| |dd| + A |q| |d|
// (two Cauchy-Schwarz bounds of sum_k dq_k d_k + q~_k dd_k, and A = 2^-13 for the tensor cores'
// float32 accumulation of at most 512 exact TF32 products, each rounding step below 2^-23 of the
// running magnitude). Each |dx_k| is below 2^-10 |x_k| (a normal x keeps 10 of its 23 fraction
// bits) or 2^-136 (a subnormal one), so |dd| <= 2^-10 |d| + 2^-136 sqrt(DP), and
//     E <= (|dq| + 2^-10 |q~| + A |q|) |d| + 2^-132 |q~|            (DP <= 128).
// The query's norms are summed once per CTA from the query tile; |d| is bounded per tile by the sum
// over the row parts of the parts' largest squared sums, which tile_mma has the threads take while
// the tensor cores multiply (norm_part). Squares below float32's range round to multiples of 2^-149,
// so each float32 norm n of at most 128 elements bounds the true one by n (1 + 2^-16) + 2^-71:
// without that slack, documents or queries of elements below about 2^-63 would get a vanishing E.
// A zero query row (its largest |x| 0) has exact similarities. A tile of zeros keeps the slack (its
// zeros are candidates where they reach L - E): telling it apart cost the norm pass a max per
// element, 0.3-2.8% of the refined default's time on an H200, for a case that is slow only where a
// row has seen no positive similarity.
//
// A row's max is then at least L, the best v - E or exact value seen, and only similarities whose
// TF32 value v reaches L - E can be it: the candidates. Exact values are summed from the float32
// operands: each product split exactly into two floats (fmaf) and summed by error-free additions, to
// about 2^-44 of the terms' magnitude, by the four lanes of the row's quad while the other quads do
// theirs; the row keeps its exact best in float64. So a row's max is float64's max rounded once to
// float32, and its argmax float64's (the lower index on a tie, the first NaN on a NaN) wherever the
// two best similarities differ by more than that residue.
//
// Most candidates are a running maximum that a later tile beats by more than 2E, so their exact
// values are not taken at once: a row keeps up to KEEP pending candidates (an upper bound v + E of
// the exact value, and the token), drops those that L rises above, and sums the survivors at the
// document's end from D itself (resolve), the quads side by side. A candidate that finds no free
// place, or a NaN, is summed at once from the tile still in shared memory (in the same order, so to
// the same value). A lane looks for candidates only when its own largest value reaches L - E, and
// the warp skips the rest after one vote. Rows with E = 0 (a zero query token) have exact TF32
// values already.
#pragma once
#include "fwd/config.cuh"

namespace lik {

LIK_FWD_TEMPLATE
struct LIK_FWD::Refine {
    static constexpr int KEEP = 2;  // pending candidates per row

    const T* const& sQ;
    const T* const __restrict__& D;  // the documents in global memory (pending candidates are summed from there)
    float* const& tnorm;  // [STAGES][WARPS]: each warp's largest part of |d|^2 (norm_part)
    const int &wrow0, &lane, &warp;
    float (&best)[MT][2];
    int (&bidx)[MT][2];
    const bool (&rv)[MT][2];
    double (&xbest)[2];  // the rows' exact maxima so far (-inf: none)
    float (&lo)[2];      // the rows' lower bounds L
    float (&a1)[2];      // per row |dq| + 2^-10 |q~| + A |q| (the weight of |d| in E; 0 for a zero row); negative until computed
    float (&a2)[2];      // per row 2^-132 |q~| (E's term for subnormal document elements)
    float (&pu)[2][KEEP];  // pending candidates: upper bounds of their exact values (-inf: none)
    int (&ptok)[2][KEEP];  // and their tokens
    bool& defer;           // this document keeps candidates pending (reset)

    static constexpr float ACC = 0x1p-13f;
    static constexpr float UP = 1.f + 0x1p-16f;  // covers the float32 rounding of the norms' sums
    static constexpr float FLOOR = 0x1p-71f;     // and the squares that fall below float32's range
    static constexpr int P = NT >= BN ? NT / BN : 1;  // threads (parts of the dim) per row

    static __device__ __forceinline__ float tf32_part(float x) { return __uint_as_float(__float_as_uint(x) & 0xFFFFE000u); }

    // A new document, of which this CTA scores `tiles` tiles. Pending candidates pay off over three or
    // more: on fewer the sums at the end, from D, cost more than the candidates later tiles rule out
    // (32 queries of 32 tokens against documents of 180, two tiles: 10% slower on an H200).
    __device__ void reset(int tiles) const {
        defer = tiles >= 3;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            xbest[h] = -__longlong_as_double(0x7ff0000000000000ll);
            lo[h] = LIK_NEG_INF;
            best[0][h] = LIK_NEG_INF;
            bidx[0][h] = -1;
#pragma unroll
            for (int k = 0; k < KEEP; ++k) pu[h][k] = LIK_NEG_INF;
        }
    }

    // This warp's rows' error weights (once per CTA: the query tile is in place from the first stage on).
    __device__ void query_norms() const {
        const int g = lane >> 2, tq = lane & 3;
#pragma unroll
        for (int h = 0; h < 2; ++h) weights(sQ, wrow0 + g + 8 * h, tq, a1[h], a2[h]);
    }

    // Query row r's error weights (a1: |dq| + 2^-10 |q~| + A |q|, 0 for a zero row; a2: 2^-132 |q~|),
    // the four lanes of a quad summing a quarter of the dim each (every lane of the warp calls it).
    static __device__ __forceinline__ void weights(const T* sQ, int r, int tq, float& a1, float& a2) {
        float s = 0.f, rr = 0.f, tt = 0.f, mx = 0.f;
        for (int k = tq; k < DP; k += 4) {
            const float x = sQ[soff(r, k, BM)], t = tf32_part(x), dx = x - t;
            s = fmaf(x, x, s);
            rr = fmaf(dx, dx, rr);
            tt = fmaf(t, t, tt);
            mx = fmaxf(mx, fabsf(x));
        }
#pragma unroll
        for (int off = 1; off <= 2; off <<= 1) {
            s += __shfl_xor_sync(0xffffffffu, s, off);
            rr += __shfl_xor_sync(0xffffffffu, rr, off);
            tt += __shfl_xor_sync(0xffffffffu, tt, off);
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        }
        const bool nz = mx != 0.f;  // (fmaxf skips NaN: zeros and NaN take the exact path, NaN already)
        a1 = nz ? (sqrtf(rr) + 0x1p-10f * sqrtf(tt) + ACC * sqrtf(s) + 3.f * FLOOR) * UP : 0.f;
        a2 = nz ? 0x1p-132f * (sqrtf(tt) + FLOOR) * UP : 0.f;
    }

    // This thread's part of the tile's squared row norms |d|^2 (called by tile_mma while the tile's
    // wgmma runs): the largest of its rows' sums over its part of the dim (CPP consecutive 16-byte
    // chunks of the row), the warp's largest in tn[warp]. The swizzle only permutes a block's chunks
    // and a sum of squares does not care, so the thread reads chunk c at position (c & 7) ^ (r & 7)
    // of its block: the eight lanes of each load phase hit eight different chunks, and the part
    // (warp-uniform) is a constant in the copy of the loop that reads it, so the offsets are few.
    static __device__ __forceinline__ void norm_part(const T* sD, float* tn) {
        constexpr int CPP = DP / BLK * 8 / P;  // chunks per part
        static_assert(CPP % 2 == 0, "norm_part reads a part's chunks in pairs");
        float s = 0.f;
        const int t = threadIdx.x;
        for (int r = NT >= BN ? t % BN : t; r < BN && (NT < BN || t < P * BN); r += NT) {
            const int part = NT >= BN ? t / BN : 0, r7 = r & 7;
            const T* row = sD + r * BLK;
            float r0 = 0.f, r1 = 0.f;  // two chains
#pragma unroll
            for (int p = 0; p < P; ++p)
                if (p == part) {
#pragma unroll
                    for (int c = p * CPP; c < (p + 1) * CPP; c += 2) {
                        const float4 x = *reinterpret_cast<const float4*>(row + (c >> 3) * BN * BLK + ((c & 7) ^ r7) * EPC);
                        const float4 y = *reinterpret_cast<const float4*>(row + ((c + 1) >> 3) * BN * BLK + (((c + 1) & 7) ^ r7) * EPC);
                        r0 = fmaf(x.x, x.x, fmaf(x.y, x.y, fmaf(x.z, x.z, fmaf(x.w, x.w, r0))));
                        r1 = fmaf(y.x, y.x, fmaf(y.y, y.y, fmaf(y.z, y.z, fmaf(y.w, y.w, r1))));
                    }
                }
            s = fmaxf(s, r0 + r1);
            if (NT >= BN) break;
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) s = fmaxf(s, __shfl_xor_sync(0xffffffffu, s, off));
        if ((threadIdx.x & 31) == 0) tn[threadIdx.x >> 5] = s;
    }

    // An upper bound of |d| over the rows of the tile in slot `slot`, once every warp has written its
    // parts (a named barrier over the CTA's threads).
    __device__ float tile_norm(int slot) const {
        named_sync(1, NT);
        // Warps of one part (NT >= BN: warp w holds rows of part w * 32 / BN) share its maximum.
        float ps[P];
#pragma unroll
        for (int p = 0; p < P; ++p) ps[p] = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const int p = NT >= BN ? min(w * 32 / BN, P - 1) : 0;
            ps[p] = fmaxf(ps[p], tnorm[slot * WARPS + w]);
        }
        float s = 0.f;
#pragma unroll
        for (int p = 0; p < P; ++p) s += ps[p];
        return (sqrtf(s) + FLOOR) * UP;
    }

    // s + e += a * b: the product split exactly (fmaf), its high part added by TwoSum.
    static __device__ __forceinline__ void two_sum_product(float& s, float& e, float a, float b) {
        const float p = a * b, pl = fmaf(a, b, -p);
        const float t = s + p, bp = t - s;
        e += ((s - (t - bp)) + (p - bp)) + pl;
        s = t;
    }

    // Lane tq's part of the exact similarity of tile row r and a document token, as s + e: chunks tq
    // and tq + 4 of each 128-byte block of the two rows (dq(kb, half): the token's chunk tq + 4 * half
    // of block kb), in four independent chains (one per float of a chunk) merged at the end. The
    // swizzle puts chunk k of query row r at k ^ (r & 7), so the row takes two offsets, its blocks a
    // constant stride apart. The same order wherever the token is read from, so the same value.
    template <class Doc>
    __device__ float2 exact_part(int r, int tq, const Doc& dq) const { return exact_part(sQ, r, tq, dq); }
    template <class Doc>
    static __device__ __forceinline__ float2 exact_part(const T* sQ, int r, int tq, const Doc& dq) {
        const T* q = sQ + r * BLK;
        const int q0 = (tq ^ (r & 7)) * EPC, q1 = q0 ^ (4 * EPC);
        float s[4] = {0.f, 0.f, 0.f, 0.f}, e[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int kb = 0; kb < DP / BLK; ++kb)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const float4 a = *reinterpret_cast<const float4*>(q + kb * BM * BLK + (half ? q1 : q0));
                const float4 b = dq(kb, half);
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

    // The quad's four parts summed (every lane of the warp takes part), as a float64.
    static __device__ __forceinline__ double quad_sum(float2 p) {
#pragma unroll
        for (int off = 1; off <= 2; off <<= 1) {
            const float os = __shfl_xor_sync(0xffffffffu, p.x, off), oe = __shfl_xor_sync(0xffffffffu, p.y, off);
            const float t = p.x + os, bp = t - p.x;
            p.y += ((p.x - (t - bp)) + (os - bp)) + oe;
            p.x = t;
        }
        return (double)p.x + (double)p.y;
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
    // mask `dm`, staged in slot `slot`) into the rows' exact maxima and pending candidates (fold_tile:
    // valid(tok) says whether token tok counts).
    __device__ void fold(A (&acc)[MT][NN][4], const T* sD, int slot, int tok0, int len, const u8* dm) const {
        if (a1[0] < 0.f) query_norms();
        const float dn = tile_norm(slot);
        // Tiles whose every token counts (warp-uniform) take a copy with no per-token test: the tests,
        // shared by the passes, were otherwise kept as bit masks built on every tile.
        if (!dm && tok0 + BN <= len) fold_tile(acc, sD, tok0, dn, [](int) { return true; });
        else fold_tile(acc, sD, tok0, dn, [&](int tok) { return tok < len && (!dm || dm[tok]); });
    }

    template <class Valid>
    __device__ __forceinline__ void fold_tile(A (&acc)[MT][NN][4], const T* sD, int tok0, float dn, const Valid& valid) const {
        const int g = lane >> 2, tq = lane & 3;
        // Pass 1: this lane's largest TF32 value per row (NaN if any), then the quad's.
        float lm[2] = {LIK_NEG_INF, LIK_NEG_INF};
#pragma unroll
        for (int n = 0; n < NN; ++n)
#pragma unroll
            for (int x = 0; x < 2; ++x) {
                const bool ok = valid(tok0 + n * 8 + 2 * tq + x);
#pragma unroll
                for (int h = 0; h < 2; ++h) lm[h] = max_nan(lm[h], ok ? acc[0][n][2 * h + x] : LIK_NEG_INF);
            }
        float thr[2], err[2];
        bool use[2], exact[2], mine = false;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float m = max_nan(lm[h], __shfl_xor_sync(0xffffffffu, lm[h], 1));
            m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, 2));
            const float e = fmaf(a1[h], dn, a2[h]);
            // L, NaN-free (a NaN is a candidate whatever L is)
            const float lb = fmaxf(lo[h], fmaxf(m - e, (float)xbest[h]));
            lo[h] = lb;
            thr[h] = lb - e;
            err[h] = e;
            const bool reach = rv[0][h] && !(m < thr[h]);
            use[h] = reach && e != 0.f;
            exact[h] = reach && e == 0.f;
            mine |= use[h] && !(lm[h] < thr[h]);  // this lane holds a candidate of row h
#pragma unroll
            for (int k = 0; k < KEEP; ++k)
                if (pu[h][k] < lb) pu[h][k] = LIK_NEG_INF;  // ruled out: below the max
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
        if (!__any_sync(0xffffffffu, mine)) return;
        // Pass 2, in the lanes that hold one: their candidates, whose TF32 value reaches the threshold
        // (or is NaN), bit h * 32 + n * 2 + x.
        unsigned long long cand = 0;
        if (mine) {
            unsigned c[2] = {0u, 0u};
#pragma unroll
            for (int n = 0; n < NN; ++n)
#pragma unroll
                for (int x = 0; x < 2; ++x) {
                    const bool ok = valid(tok0 + n * 8 + 2 * tq + x);
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        if (ok && !(acc[0][n][2 * h + x] < thr[h])) c[h] |= 1u << (n * 2 + x);
                }
            cand = (use[0] ? c[0] : 0u) | (use[1] ? (unsigned long long)c[1] << 32 : 0ull);
        }
        // Each quad takes its own lanes' candidates (its own rows) one at a time, the quads side by
        // side: into a free pending place, with the bound v + E from the finding lane's largest
        // value v; else (or a NaN) its exact value now, the quad's four lanes a quarter of the dim each.
        for (;;) {
            const unsigned lanes = __ballot_sync(0xffffffffu, cand != 0);
            if (!lanes) break;
            const unsigned quad = (lanes >> (lane & ~3)) & 0xFu;  // this quad's lanes with candidates
            const int src = (lane & ~3) + (quad ? __ffs(quad) - 1 : 0);
            const int bit = __shfl_sync(0xffffffffu, cand ? __ffsll((long long)cand) - 1 : 0, src);
            const int h = bit >> 5, x = bit & 1, n = (bit & 31) >> 1;
            const float v = __shfl_sync(0xffffffffu, h ? lm[1] : lm[0], src);
            if (quad && lane == src) cand &= cand - 1;
            const int c = n * 8 + 2 * (src & 3) + x;
            bool now = quad != 0 && v != v, placed = false;
#pragma unroll
            for (int hh = 0; hh < 2; ++hh)
#pragma unroll
                for (int k = 0; k < KEEP; ++k)
                    if (quad && defer && !now && !placed && hh == h && pu[hh][k] == LIK_NEG_INF) {
                        pu[hh][k] = v + err[hh];
                        ptok[hh][k] = tok0 + c;
                        placed = true;
                    }
            now |= quad != 0 && !placed;
            if (!__any_sync(0xffffffffu, now)) continue;
            const T* d = sD + c * BLK;
            const int d0 = (tq ^ (c & 7)) * EPC, d1 = d0 ^ (4 * EPC);
            const float2 p = now ? exact_part(wrow0 + g + 8 * h, tq,
                                              [&](int kb, int half) {
                                                  return *reinterpret_cast<const float4*>(d + kb * BN * BLK + (half ? d1 : d0));
                                              })
                                 : float2{0.f, 0.f};
            const double xv = quad_sum(p);
            if (now) {
                if (h) take(1, xv, tok0 + c);
                else take(0, xv, tok0 + c);
            }
        }
    }

    // The document's pending candidates that L has not ruled out, summed from D (its rows from
    // `begin`): each quad its own, loads first. Called once the document's last tile is folded.
    __device__ void resolve(i64 begin) const {
        const int g = lane >> 2, tq = lane & 3;
        constexpr int NB = 2 * (DP / BLK);  // chunks a lane reads per token
#pragma unroll
        for (int k = 0; k < KEEP; ++k) {
            bool has[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) has[h] = pu[h][k] != LIK_NEG_INF && !(pu[h][k] < lo[h]);
            if (!__any_sync(0xffffffffu, has[0] || has[1])) continue;
            float4 b[2][NB];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const T* row = D + (begin + (has[h] ? ptok[h][k] : 0)) * DP + tq * EPC;
#pragma unroll
                for (int i = 0; i < NB; ++i)
                    b[h][i] = has[h] ? __ldg(reinterpret_cast<const float4*>(row + (i >> 1) * BLK + (i & 1) * 4 * EPC))
                                     : float4{0.f, 0.f, 0.f, 0.f};
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float2 p = exact_part(wrow0 + g + 8 * h, tq, [&](int kb, int half) { return b[h][2 * kb + half]; });
                const double xv = quad_sum(p);
                if (has[h]) take(h, xv, ptok[h][k]);
            }
        }
    }
};

}  // namespace lik
