// float32 accuracy at TF32 speed, decided once per document (LIK_REFINE 2: one-shot float32 wgmma
// tiles; LIK_REFINE 1, fwd/refine.cuh, decides tile by tile instead).
//
// A product's TF32 value v (operands cut to their TF32 parts x~, x = x~ + dx) misses the exact one by
//     q d - q~ d~ = dq . d + q~ . dd,   |dd| <= 2^-10 |d| (a TF32 part keeps 10 mantissa bits),
// so by at most E = (|dq| + (2^-10 (1 + 2^-11) + A + K) |q|) Dn with Dn the document's largest token
// norm, A = 2^-13 the tensor cores' float32 accumulation (fwd/refine.cuh) and K = 2^-15 the keys'
// cut bits (below) and the threshold's rounding. The row weight is summed from the query tile and Dn
// once per document: every thread keeps the largest part of a tile row's |d|^2 it summed
// while the tensor cores multiplied (norm_max), and the warps pool theirs at the document's end.
//
// Only a token whose v reaches M - 2E, M the row's largest v, can be the row's exact max. The tile
// loop keeps per thread and row two v as keys (v with its low five mantissa bits replaced by its slot
// in the thread's accumulators, so that a float max keeps the value and where it came from) and a
// bound of the rest: three float ops a similarity take the tile's largest and second largest; the
// tile's largest joins the two kept, with its tile's first token, if it beats one of them, and the
// tile's second and whatever drops out raise the bound. At the document's end the quad takes M, and
// each lane's kept tokens that reach M - 2E are recomputed exactly from D (L2 holds the document
// just staged), as fwd/refine.cuh does from shared memory. Where a lane's bound reaches M - 2E too
// (near ties three deep in one lane's columns, or two in one tile's, as duplicates make), the whole
// warp scans that lane's columns of the row: each token's float32 similarity (within 2^-18 |q| |d|)
// against M - 2E, and the exact one for those that reach it. A row whose bound is unusable is
// scanned exactly in full: a NaN or infinity in its query row or in the document's tiles (norm_max
// makes Dn infinite), squares that underflow, or a bound so large that a similarity could overflow.
// A query row of zeros scores 0 at its first valid token.
//
// The row's max is float64's max rounded once, its argmax float64's (the lower token on a tie, the
// first NaN on a NaN) wherever the two best similarities differ by more than the exact sums' 2^-44
// residue: the contract of fwd/refine.cuh. On random unit vectors a row recomputes about 1.1 tokens
// per document of 300 or 1,024 tokens (its max, and at times one within 2E), and 0.4-0.6% of rows
// scan a quarter of their columns in float32 (bench/sweeps/sweep_refine.py models the counts).
#pragma once
#include "fwd/config.cuh"

namespace lik {

LIK_FWD_TEMPLATE
struct LIK_FWD::RefineDeferred {
    const T* const& sQ;
    float* const& tnorm;  // [2][WARPS]: each warp's largest part of |d|^2 over a document (two documents apart)
    const int &wrow0, &lane, &warp;
    float (&best)[MT][2];
    int (&bidx)[MT][2];
    const bool (&rv)[MT][2];
    float (&key)[3][2];  // per row the two largest keys of this thread's columns, and a bound of the others
    int (&ktile)[2][2];  // the first token of the tile of key[0] and key[1]
    float& dn2;          // this thread's largest part of a tile row's |d|^2 over the document (norm_max)

    static constexpr float ACC = 0x1p-13f;
    static constexpr float UP = 1.f + 0x1p-16f;  // covers the float32 rounding of the norms' sums
    static constexpr float W = 0x1p-10f * (1.f + 0x1p-11f) + ACC + 0x1p-15f;  // |q|'s weight in E
    static constexpr float TINY = 0x1p-100f;  // squared norms below it may have underflowed: no bound
    static constexpr u32 SLOT = 31u;          // a key's slot bits
    static constexpr int P = NT / BN;         // threads (parts of the dim) per tile row in norm_max
    static constexpr int KP = DP / 16;        // 16-byte chunks in a quarter row (a lane's part of an exact sum)
    // The next candidate's quarter rows load while the current one is summed, where registers allow: not
    // in two-warpgroup tiles of two CTAs an SM (128 registers a thread), where that buffer spilled.
#if defined(LIK_MIN_BLOCKS) && LIK_MIN_BLOCKS > 1
    static constexpr bool LOAD_AHEAD = NT * LIK_MIN_BLOCKS <= 256;
#else
    static constexpr bool LOAD_AHEAD = true;
#endif
    static_assert(NT >= BN && BN % 32 == 0 && 2 * NN <= 32 && DP % 16 == 0,
                  "deferred refinement: tiles of 32 to 128 tokens, rows of whole 64-byte quarters");

    static __device__ __forceinline__ float tf32_part(float x) { return __uint_as_float(__float_as_uint(x) & 0xFFFFE000u); }
    static __device__ __forceinline__ float key_of(float v, int slot) {
        return __uint_as_float((__float_as_uint(v) & ~SLOT) | (u32)slot);
    }
    // Document token of a key kept from the tile starting at token `tile` (slot n * 2 + x: column n * 8 + 2 tq + x).
    static __device__ __forceinline__ int token_of(float k, int tile, int tq) {
        const int slot = (int)(__float_as_uint(k) & SLOT);
        return tile + (slot >> 1) * 8 + 2 * tq + (slot & 1);
    }

    __device__ void reset() const {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int i = 0; i < 3; ++i) key[i][h] = LIK_NEG_INF;
            ktile[0][h] = ktile[1][h] = 0;
            best[0][h] = LIK_NEG_INF;
            bidx[0][h] = -1;
        }
    }

    // This warp's rows' error weights (E = erow Dn): 0 for a row of zeros. Taken again per document:
    // kept through the tile loop, they spilled two-warpgroup tiles of 128 tokens (compile check).
    __device__ void query_norms(float (&erow)[2]) const {
        const int g = lane >> 2, tq = lane & 3;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = wrow0 + g + 8 * h;
            float s = 0.f, rr = 0.f;
            u32 nz = 0;
            for (int k = tq; k < DP; k += 4) {
                const float x = sQ[soff(r, k, BM)], dx = x - tf32_part(x);
                s = fmaf(x, x, s);
                rr = fmaf(dx, dx, rr);
                nz |= __float_as_uint(x) << 1;  // any bit but the sign
            }
#pragma unroll
            for (int off = 1; off <= 2; off <<= 1) {
                s += __shfl_xor_sync(0xffffffffu, s, off);
                rr += __shfl_xor_sync(0xffffffffu, rr, off);
                nz |= __shfl_xor_sync(0xffffffffu, nz, off);
            }
            // (a NaN stays NaN: the row is then scanned exactly, finish)
            erow[h] = nz == 0 ? 0.f : s < TINY ? __int_as_float(0x7f800000) : (sqrtf(rr) + W * sqrtf(s)) * UP;
        }
    }

    // This thread's part of the tile's squared row norms into dn2 (called by tile_mma while the tile's
    // wgmma runs): thread t sums part t / BN of row t % BN, a row's 128-byte blocks read chunk by chunk
    // in an order rotated by the row so that the eight lanes of each load phase hit eight chunks.
    static __device__ __forceinline__ void norm_max(const T* sD, float& dn2) {
        constexpr int KB = DP / BLK, CH = KB * 8;  // 128-byte blocks and 16-byte chunks of a row
        const int t = threadIdx.x, r = t % BN, part = t / BN;
        if (part >= P) return;
        float rs = 0.f;
#pragma unroll 4
        for (int i = part * (CH / P); i < (part + 1) * (CH / P); ++i) {
            const int kb = i >> 3, ch = (i + r) & 7;
            const float4 x = *reinterpret_cast<const float4*>(sD + (kb * BN + r) * BLK + ch * EPC);
            rs = fmaf(x.x, x.x, fmaf(x.y, x.y, fmaf(x.z, x.z, fmaf(x.w, x.w, rs))));
        }
        dn2 = fmaxf(dn2, rs <= 3.4028235e38f ? rs : __int_as_float(0x7f800000));  // NaN too: infinite
    }

    // Upper bound of the document's token norms: the sum over the row parts of the parts' largest
    // squared sums (a named barrier over the CTA's threads; buffer `par` is rewritten two documents on,
    // after every warp has passed the next document's barrier). Infinite where they may have underflowed.
    __device__ float doc_norm(int par) const {
        float s = dn2;
        dn2 = 0.f;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) s = fmaxf(s, __shfl_xor_sync(0xffffffffu, s, off));
        if (lane == 0) tnorm[par * WARPS + warp] = s;
        named_sync(1, NT);
        float ps[P];
#pragma unroll
        for (int p = 0; p < P; ++p) ps[p] = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {  // warp w holds rows of part w * 32 / BN
            const int p = min(w * 32 / BN, P - 1);
            ps[p] = fmaxf(ps[p], tnorm[par * WARPS + w]);
        }
        s = 0.f;
#pragma unroll
        for (int p = 0; p < P; ++p) s += ps[p];
        return s < TINY ? __int_as_float(0x7f800000) : sqrtf(s) * UP;
    }

    // Fold the tile in acc (document tokens tok0 .. tok0 + BN - 1 of a document of `len` tokens with
    // mask `dm`) into the rows' kept keys.
    __device__ void fold(A (&acc)[MT][NN][4], int tok0, int len, const u8* dm) const {
        const int tq = lane & 3;
        const bool full = !dm && tok0 + BN <= len;
        float k[2][2];  // the tile's largest key per row, and its second: a bound of the tile's others
#pragma unroll
        for (int h = 0; h < 2; ++h) k[0][h] = k[1][h] = LIK_NEG_INF;
#pragma unroll
        for (int n = 0; n < NN; ++n)
#pragma unroll
            for (int x = 0; x < 2; ++x) {
                const int tok = tok0 + n * 8 + 2 * tq + x;
                const bool ok = full || (tok < len && (!dm || dm[tok]));
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float kv = ok ? key_of(acc[0][n][2 * h + x], n * 2 + x) : LIK_NEG_INF;
                    k[1][h] = fmaxf(k[1][h], fminf(k[0][h], kv));
                    k[0][h] = fmaxf(k[0][h], kv);
                }
            }
        // The tile's largest joins the document's two if it beats one of them; the one it pushes out,
        // or itself, and the tile's second only bound the others (key[2]).
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const bool c = k[0][h] > key[0][h], c2 = k[0][h] > key[1][h];
            const float out = c || c2 ? key[1][h] : k[0][h];
            key[2][h] = fmaxf(key[2][h], fmaxf(k[1][h], out));
            if (c) {
                key[1][h] = key[0][h];
                ktile[1][h] = ktile[0][h];
                key[0][h] = k[0][h];
                ktile[0][h] = tok0;
            } else if (c2) {
                key[1][h] = k[0][h];
                ktile[1][h] = tok0;
            }
        }
    }

    // s + e += a * b: the product split exactly (fmaf), its high part added by TwoSum (__fmul_rn: never
    // contracted into the sum, so every inlined copy rounds alike).
    static __device__ __forceinline__ void two_sum_product(float& s, float& e, float a, float b) {
        const float p = __fmul_rn(a, b), pl = fmaf(a, b, -p);
        const float t = s + p, bp = t - s;
        e += ((s - (t - bp)) + (p - bp)) + pl;
        s = t;
    }

    // Quarter k0 of document row drow (in D): its 16-byte chunks k0, k0 + 4, ...
    static __device__ __forceinline__ void load_part(const T* drow, int k0, float4 (&b)[KP]) {
#pragma unroll
        for (int i = 0; i < KP; ++i) b[i] = __ldg(reinterpret_cast<const float4*>(drow) + k0 + 4 * i);
    }

    // Quarter k0 of the exact similarity of tile row r and the document row in b, as s + e: four chains
    // (one per float of a chunk) merged at the end.
    __device__ float2 exact_part(const float4 (&b)[KP], int r, int k0) const {
        float s[4] = {0.f, 0.f, 0.f, 0.f}, e[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int i = 0; i < KP; ++i) {
            const float4 a = *reinterpret_cast<const float4*>(sQ + soff(r, 4 * (k0 + 4 * i), BM));
            two_sum_product(s[0], e[0], a.x, b[i].x);
            two_sum_product(s[1], e[1], a.y, b[i].y);
            two_sum_product(s[2], e[2], a.z, b[i].z);
            two_sum_product(s[3], e[3], a.w, b[i].w);
        }
        two_sum_product(s[0], e[0], s[1], 1.f);
        two_sum_product(s[2], e[2], s[3], 1.f);
        two_sum_product(s[0], e[0], s[2], 1.f);
        return float2{s[0], e[0] + e[1] + e[2] + e[3]};
    }

    // a + b, the rounding error of the high parts' sum (TwoSum) added to the low parts.
    static __device__ __forceinline__ float2 add_parts(float2 a, float2 b) {
        const float t = a.x + b.x, bp = t - a.x;
        return float2{t, a.y + b.y + ((a.x - (t - bp)) + (b.x - bp))};
    }
    // The four parts' sum in one fixed order: every lane, and the scans' single lanes, get the same bits
    // for the same vectors, so equal similarities stay equal (the lower token wins them).
    static __device__ __forceinline__ double sum_parts(float2 p0, float2 p1, float2 p2, float2 p3) {
        const float2 p = add_parts(add_parts(p0, p1), add_parts(p2, p3));
        return (double)p.x + (double)p.y;
    }

    // The exact similarity from the quad's four quarters (lane tq's in p).
    __device__ double quad_sum(float2 p) const {
        float2 q[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
            q[i] = float2{__shfl_sync(0xffffffffu, p.x, (lane & ~3) + i), __shfl_sync(0xffffffffu, p.y, (lane & ~3) + i)};
        return sum_parts(q[0], q[1], q[2], q[3]);
    }

    // The same by one lane, quarter by quarter.
    __device__ double exact_lane(const T* drow, int r) const {
        float2 p[4];
#pragma unroll
        for (int k0 = 0; k0 < 4; ++k0) {
            float4 b[KP];
            load_part(drow, k0, b);
            p[k0] = exact_part(b, r, k0);
        }
        return sum_parts(p[0], p[1], p[2], p[3]);
    }

    // The float32 similarity by one lane: within 2^-18 |q| |d| of the exact one, well inside E.
    __device__ float dot_lane(const T* drow, int r) const {
        float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
        for (int kc = 0; kc < DP / 4; ++kc) {
            const float4 a = *reinterpret_cast<const float4*>(sQ + soff(r, 4 * kc, BM));
            const float4 b = __ldg(reinterpret_cast<const float4*>(drow) + kc);
            s[0] = fmaf(a.x, b.x, s[0]);
            s[1] = fmaf(a.y, b.y, s[1]);
            s[2] = fmaf(a.z, b.z, s[2]);
            s[3] = fmaf(a.w, b.w, s[3]);
        }
        return (s[0] + s[1]) + (s[2] + s[3]);
    }

    // Whether exact value x at token tok beats the row's (xb, ix): larger, or equal at a lower token;
    // a NaN beats any number, the first NaN stays.
    static __device__ __forceinline__ bool beats(double x, int tok, double xb, int ix) {
        if (ix < 0) return true;
        if (x != x) return xb == xb || tok < ix;
        if (xb != xb) return false;
        return x > xb || (x == xb && tok < ix);
    }

    template <int H>
    __device__ __forceinline__ void take(double (&xb)[2], double x, int tok) const {
        if (beats(x, tok, xb[H], bidx[0][H])) {
            xb[H] = x;
            bidx[0][H] = tok;
        }
    }

    // Document j's row maxima (and argmax) from the kept keys: tokens tok_lo .. tok_hi - 1 of its `len`
    // (mask dm) were this CTA's tiles; D's rows from `begin` are the document's tokens.
    __device__ void finish(int j, const T* D, i64 begin, int tok_lo, int tok_hi, int len, const u8* dm) const {
        const float dn = doc_norm(j & 1);
        if (tok_lo >= tok_hi) return;
        const int g = lane >> 2, tq = lane & 3;
        float erow[2];
        query_norms(erow);
        auto valid = [&](int tok) { return tok < len && (!dm || dm[tok]); };
        auto drow = [&](int tok) { return D + (begin + tok) * DP; };
        const double NEG = -__longlong_as_double(0x7ff0000000000000ll);
        double xb[2] = {NEG, NEG};
        unsigned cand = 0;  // bit 2h + i: this lane's key i of row h is a candidate
        bool over[2], zero[2];
        float thr[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float m = key[0][h];
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
            // A NaN or infinity in the query row or the document's tiles, or a bound so large that a
            // similarity might overflow: every similarity is recomputed exactly.
            const float e = erow[h] * dn;
            const bool bad = !(e < 0x1p100f);
            // (no valid token: nothing to do; a finite value's key is above -inf)
            const bool some = rv[0][h] && (bad || m != LIK_NEG_INF);
            zero[h] = some && !bad && erow[h] == 0.f;
            thr[h] = bad ? LIK_NEG_INF : m - 2.f * e;
            // This lane's columns need a scan: its third key reaches the threshold too (or E is NaN).
            over[h] = some && !zero[h] && (bad || !(key[2][h] < thr[h]));
            if (some && !zero[h] && !over[h]) {
                if (key[0][h] >= thr[h]) cand |= 1u << (2 * h);
                if (key[1][h] >= thr[h]) cand |= 2u << (2 * h);
            }
        }
        // The candidates: each quad recomputes its lanes' one at a time, the quads side by side (LOAD_AHEAD:
        // the next one's quarter rows of D loading while this one is summed). pick takes the quad's next (its
        // row bit and token; a quad without one reads the document's first row and takes nothing).
        auto pick = [&](int& bit, int& tok, bool& mine) {
            const unsigned lanes = __ballot_sync(0xffffffffu, cand != 0);
            const unsigned quad = (lanes >> (lane & ~3)) & 0xFu;  // this quad's lanes with candidates
            const int src = (lane & ~3) + (quad ? __ffs(quad) - 1 : 0);
            const int b = cand ? __ffs(cand) - 1 : 0;
            int t = 0;
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int i = 0; i < 2; ++i)
                    if (b == 2 * h + i) t = token_of(key[i][h], ktile[i][h], tq);
            bit = __shfl_sync(0xffffffffu, b, src);
            t = __shfl_sync(0xffffffffu, t, src);
            if (quad && lane == src) cand &= cand - 1;
            mine = quad != 0;
            tok = mine ? t : tok_lo;
            return lanes != 0;
        };
        int bit, tok;
        bool mine;
        bool more = pick(bit, tok, mine);
        float4 next[KP];  // (unused without LOAD_AHEAD)
        if (LOAD_AHEAD && more) load_part(drow(tok), tq, next);
        while (more) {
            const int h = bit >> 1, t = tok;
            const bool m = mine;
            float4 cur[KP];
            if constexpr (LOAD_AHEAD) {
#pragma unroll
                for (int i = 0; i < KP; ++i) cur[i] = next[i];
            } else {
                load_part(drow(tok), tq, cur);
            }
            more = pick(bit, tok, mine);
            if (LOAD_AHEAD && more) load_part(drow(tok), tq, next);
            const double x = quad_sum(exact_part(cur, wrow0 + g + 8 * h, tq));
            if (m) {
                if (h) take<1>(xb, x, t);
                else take<0>(xb, x, t);
            }
        }
        // Scans, one row at a time by the whole warp: the columns of the lanes that flagged it, each
        // token's float32 similarity against the threshold, the exact one for those that reach it.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            unsigned ov = __ballot_sync(0xffffffffu, over[h]);
            while (ov) {
                const int qd = (__ffs(ov) - 1) >> 2;
                const unsigned cls = (ov >> (4 * qd)) & 0xFu;  // the lanes (column classes) to scan
                ov &= ~(0xFu << (4 * qd));
                const float t = __shfl_sync(0xffffffffu, thr[h], 4 * qd);
                const int r = wrow0 + qd + 8 * h;
                double xw = NEG;
                int iw = -1;
                for (int tok = tok_lo + lane; tok < tok_hi; tok += 32) {
                    if (!((cls >> ((tok & 7) >> 1)) & 1u) || !valid(tok)) continue;
                    if (dot_lane(drow(tok), r) < t) continue;
                    const double x = exact_lane(drow(tok), r);
                    if (beats(x, tok, xw, iw)) {
                        xw = x;
                        iw = tok;
                    }
                }
#pragma unroll
                for (int off = 16; off > 0; off >>= 1) {
                    const double ox = __shfl_xor_sync(0xffffffffu, xw, off);
                    const int oi = __shfl_xor_sync(0xffffffffu, iw, off);
                    if (oi >= 0 && beats(ox, oi, xw, iw)) {
                        xw = ox;
                        iw = oi;
                    }
                }
                if (g == qd && iw >= 0) {
                    if (h) take<1>(xb, xw, iw);
                    else take<0>(xb, xw, iw);
                }
            }
        }
        // Rows of zeros: every similarity is 0 (a NaN or infinity in D was scanned above).
        int first = tok_lo;
        if (__any_sync(0xffffffffu, zero[0] || zero[1]))
            while (first < tok_hi && !valid(first)) ++first;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (zero[h]) {
                best[0][h] = 0.f;
                bidx[0][h] = first;
            } else {
                best[0][h] = (float)xb[h];
            }
        }
    }
};

}  // namespace lik
