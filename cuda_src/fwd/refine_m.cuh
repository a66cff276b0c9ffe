// float32 accuracy at TF32 speed with the document tokens on the wgmma M side (LIK_REFINE with
// LIK_TOKM: one warpgroup, 64 query rows x 64 document tokens, one query, no argmax).
//
// The error bound is fwd/refine.cuh's: a TF32 similarity v misses its exact value by at most
// E = a1 |d| + a2, a1 and a2 the query row's weights (Refine::weights). Here the query rows are the
// accumulator columns and each thread sees two tokens of every tile (rows r0 and r0 + 8), so over a
// document a thread keeps, per column, its two largest TF32 values m1 >= m2 with their tokens and
// its third largest m3 (a NaN m1 sticks), and the largest |d|^2 of its tokens, which its quad sums
// while the tensor cores multiply (token_norms). Nothing is recomputed during the tiles.
//
// At the document's end (finish) each thread's E bounds the error of its own tokens, so a column's
// max is at least L, the largest m1 - E over the CTA's threads (the warps exchange it in shared
// memory), and only a token with v >= L - E can be it. A thread's candidates are m1's token and
// m2's where they reach that; where m3 reaches it too (three near ties), or E or m1 is NaN (a NaN
// or infinite element), every one of its tokens is recomputed. A zero query row (E = 0) has exact
// TF32 values. The exact values are Refine::exact_part's, each by the four lanes of a quad, so each
// equals the queries-on-M refined tile's, and a column's max rounded to float32 is the same: the
// score (summed in score_single's order) has the same bits. A warp's jobs are spread over its
// eight quads, two each a round, their tokens' rows copied from D into the ring slot the
// document's last tile held (kept back from the TMA until the score is written), all the copies of
// a round in flight at once. One job after another by the quad that found it, reading D directly,
// took 0.080 ms against 0.067 for one 32-token query and 1,000 documents of 300 tokens on an H200
// (0.050 with no exact work at all).
#pragma once
#include "fwd/config.cuh"
#include "fwd/refine.cuh"

namespace lik {

LIK_FWD_TEMPLATE
struct LIK_FWD::RefineM {
    static constexpr int NC = REFINE_M ? NN * 2 : 1;  // columns per thread: n * 8 + 2 * tq + e, flat index 2 * n + e

    const T* const& sQ;
    const T* const __restrict__& D;
    float* const& red;  // [2][WARPS][BM]: the warps' lower bounds L, then their column maxima
    float* const& cw;   // [2][BM]: each column's a1 (-1: the column does not count) and a2; then (QMUL)
                        // [WARPS][16] int2: each warp's exact jobs of a round
    float* const& outp;
    const int &lane, &warp, &qi0, &Lq, &s0, &qlen;
    const u8* __restrict__ const& q_mask;
    float (&m1)[NC];  // per column: the best TF32 value, its token,
    int (&i1)[NC];
    float (&m2)[NC];  // the second best (a tie: the same value), its token,
    int (&i2)[NC];
    float (&m3)[NC];  // and the third best
    float& nmax;  // the largest |d|^2 of this thread's tokens of the document
    bool& any;    // this thread saw a token of the document
    bool& ready;  // cw is written

    // Squared norms of this thread's two tokens of the tile in sD (rows r0 and r0 + 8) into tn[0..1],
    // the quad's lanes summing two 16-byte chunks of each 128-byte block (positions tq + 4 (g & 1) and
    // that ^ 4: the eight lanes of a load phase hit eight different chunks; a sum of squares does not
    // care about the swizzle's order).
    static __device__ __forceinline__ void token_norms(const T* sD, float* tn) {
        const int ln = threadIdx.x & 31, g = ln >> 2, tq = ln & 3;
        const int r0 = ((threadIdx.x >> 5) & 3) * 16 + g, p0 = (tq + 4 * (g & 1)) * EPC;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const T* row = sD + (r0 + 8 * h) * BLK;
            float s0 = 0.f, s1 = 0.f;
#pragma unroll
            for (int kb = 0; kb < DP / BLK; ++kb) {
                const float4 x = *reinterpret_cast<const float4*>(row + kb * BN * BLK + p0);
                const float4 y = *reinterpret_cast<const float4*>(row + kb * BN * BLK + (p0 ^ (4 * EPC)));
                s0 = fmaf(x.x, x.x, fmaf(x.y, x.y, fmaf(x.z, x.z, fmaf(x.w, x.w, s0))));
                s1 = fmaf(y.x, y.x, fmaf(y.y, y.y, fmaf(y.z, y.z, fmaf(y.w, y.w, s1))));
            }
            float s = s0 + s1;
            s += __shfl_xor_sync(0xffffffffu, s, 1);
            s += __shfl_xor_sync(0xffffffffu, s, 2);
            tn[h] = s;
        }
    }

    // Columns of the tile that exist in the query (a warp-uniform bound for the loops).
    __device__ int qcols() const { return min(max(qlen - s0, 0), BM); }

    // A new document.
    __device__ void reset() const {
#pragma unroll
        for (int k = 0; k < NC; ++k) {
            m1[k] = m2[k] = m3[k] = LIK_NEG_INF;
            i1[k] = i2[k] = 0;
        }
        nmax = 0.f;
        any = false;
    }

    // Fold the tile in acc (tokens tok0 .. tok0 + BN - 1 of a document of `len` tokens with mask dm;
    // tn: this thread's tokens' squared norms) into the columns' three best and nmax.
    __device__ void fold(A (&acc)[MT][NN][4], const float* tn, int tok0, int len, const u8* dm) const {
        const int r0 = (warp & 3) * 16 + (lane >> 2);
        const int t0 = tok0 + r0, t1 = t0 + 8;
        const int nq = qcols();
        if (!dm && tok0 + BN <= len) {  // every token counts (warp-uniform): no per-token select
            nmax = max_nan(nmax, max_nan(tn[0], tn[1]));
            any = true;
            fold_tile(acc, nq, t0, t1, true, true);
        } else {
            const bool ok0 = t0 < len && (!dm || dm[t0]), ok1 = t1 < len && (!dm || dm[t1]);
            if (ok0) nmax = max_nan(nmax, tn[0]);
            if (ok1) nmax = max_nan(nmax, tn[1]);
            any |= ok0 || ok1;
            fold_tile(acc, nq, t0, t1, ok0, ok1);
        }
    }

    // Value v of token t into column k's three best (the first of equal values keeps its place; a NaN
    // best sticks).
    __device__ __forceinline__ void take(int k, float v, int t) const {
        const float b1 = max_nan(m1[k], v), l1 = fminf(v, m1[k]);
        const float b2 = fmaxf(m2[k], l1);
        m3[k] = fmaxf(m3[k], fminf(l1, m2[k]));
        if (b1 != m1[k]) {
            i2[k] = i1[k];
            i1[k] = t;
        } else if (b2 != m2[k]) {
            i2[k] = t;
        }
        m1[k] = b1;
        m2[k] = b2;
    }

    __device__ __forceinline__ void fold_tile(A (&acc)[MT][NN][4], int nq, int t0, int t1, bool ok0, bool ok1) const {
#pragma unroll
        for (int n = 0; n < NN; ++n)
            if (n * 8 < nq)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int k = 2 * n + e;
                    take(k, ok0 ? acc[0][n][e] : LIK_NEG_INF, t0);
                    take(k, ok1 ? acc[0][n][2 + e] : LIK_NEG_INF, t1);
                }
    }

    // Each column's weights and whether it counts, into cw (once per CTA, at the first document's end).
    // Quad (warp, g) takes columns quad and quad + 32.
    __device__ void columns() const {
        // The query tile's copies are awaited at the first stage, which a CTA whose first document has
        // no tile here has not reached: the weights wait for them too.
        cp_async_wait<0>();
        named_sync(1, NT);
        const int quad = warp * 8 + (lane >> 2), tq = lane & 3;
#pragma unroll
        for (int k = 0; k < BM / (WARPS * 8); ++k) {
            const int c = quad + k * WARPS * 8, s = s0 + c;
            float a1, a2;
            Refine::weights(sQ, c, tq, a1, a2);
            const bool ok = s < qlen && (!q_mask || q_mask[(i64)qi0 * Lq + s]);
            if (tq == 0) {
                cw[c] = ok ? a1 : -1.f;
                cw[BM + c] = a2;
            }
        }
        named_sync(1, NT);
        ready = true;
    }

    // One halving exchange of a reduce-scatter over the eight lanes that share tq (lanes X apart, X in
    // 16, 8, 4): each keeps the max of half of the first 2H entries of v, in entries 0 .. H - 1.
    template <int X, int H, bool NAN_MAX>
    static __device__ __forceinline__ void scatter(float (&v)[NC], int ln) {
        const bool up = ln & X;
#pragma unroll
        for (int i = 0; i < H; ++i) {
            const float o = __shfl_xor_sync(0xffffffffu, up ? v[i] : v[i + H], X);
            const float m = up ? v[i + H] : v[i];
            v[i] = NAN_MAX ? max_nan(m, o) : fmaxf(m, o);
        }
    }
    // After scatter3 (scatter<16, 8>, <8, 4>, <4, 2>), lane (g, tq) holds flat entries 2g and 2g + 1:
    // columns g * 8 + 2 * tq + {0, 1}; scatter_store puts the maxima (NaN-free) in row `warp` of buf.
    template <bool NAN_MAX>
    __device__ __forceinline__ void scatter3(float (&v)[NC]) const {
        static_assert(NC == 16, "a thread holds 16 columns (BM = 64)");
        scatter<16, 8, NAN_MAX>(v, lane);
        scatter<8, 4, NAN_MAX>(v, lane);
        scatter<4, 2, NAN_MAX>(v, lane);
    }
    __device__ __forceinline__ void scatter_store(float (&v)[NC], float* buf) const {
        scatter3<false>(v);
        *reinterpret_cast<float2*>(buf + warp * BM + (lane >> 2) * 8 + 2 * (lane & 3)) = float2{v[0], v[1]};
    }

    // The largest over the warps of columns c and c + 1 in buf (scatter_store's rows).
    static __device__ __forceinline__ float2 across_warps(const float* buf, int c) {
        float2 m = *reinterpret_cast<const float2*>(buf + c);
#pragma unroll
        for (int w = 1; w < WARPS; ++w) {
            const float2 o = *reinterpret_cast<const float2*>(buf + w * BM + c);
            m.x = fmaxf(m.x, o.x);
            m.y = fmaxf(m.y, o.y);
        }
        return m;
    }

    // The position of set bit n (from 0, lowest first) of mask.
    static __device__ __forceinline__ int nth_bit(unsigned mask, int n) {
        for (; n > 0; --n) mask &= mask - 1;
        return __ffs(mask) - 1;
    }

    // A float as an unsigned integer of the same order (a NaN above everything), and back: column
    // maxima taken by atomicMax.
    static __device__ __forceinline__ unsigned ordered(float x) {
        const unsigned u = __float_as_uint(x);
        return x != x ? 0xffffffffu : (u & 0x80000000u) ? ~u : u | 0x80000000u;
    }
    static __device__ __forceinline__ float from_ordered(unsigned e) {
        return e == 0xffffffffu ? LIK_NAN : __uint_as_float((e & 0x80000000u) ? e & 0x7fffffffu : ~e);
    }

    // Document j's score (its rows from `begin` of D, nt tiles, len tokens, mask dm; zp: zero-vector
    // padding floors each column's max at 0; hold: the ring slot of its last tile, its staging space).
    // Every thread of the CTA calls it; the last warp writes the score.
    __device__ void finish(int j, i64 begin, int nt, int len, const u8* dm, bool zp, T* hold) const {
        if (!ready) columns();
        const int g = lane >> 2, tq = lane & 3, r0 = (warp & 3) * 16 + g;
        const int nq = qcols();
        const float dn = (sqrtf(nmax) + Refine::FLOOR) * Refine::UP;  // NaN or inf with such an element
        // 1. L: every thread's m1 - E (NaN-free), the largest over the CTA, in red's first half.
        float v[NC];
#pragma unroll
        for (int k = 0; k < NC; ++k) {
            const int c = (k >> 1) * 8 + 2 * tq + (k & 1);
            v[k] = fmaxf(m1[k] - fmaf(cw[c], dn, cw[BM + c]), LIK_NEG_INF);
        }
        scatter_store(v, red);
        named_sync(1, NT);
        // 2. The columns' jobs: cm, their candidates (bit k: m1's token of column k reaches L - E, bit
        // 16 + k: m2's too); fm, the columns whose every token is recomputed (m3 reaches it as well, or
        // E or m1 is NaN). v[k] becomes the column's max over this thread's tokens (-inf: none).
        static_assert(NC <= 16, "two candidate bits per column in 32");
        unsigned cm = 0, fm = 0;
#pragma unroll
        for (int n = 0; n < NN; ++n) {
            const int c = n * 8 + 2 * tq;
            const float2 lb = across_warps(red, c);
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int k = 2 * n + e;
                v[k] = LIK_NEG_INF;
                const float a1 = cw[c + e];
                if (n * 8 >= nq || a1 < 0.f || !any) continue;
                const float er = fmaf(a1, dn, cw[BM + c + e]);
                const float th = (e ? lb.y : lb.x) - er;
                if (m1[k] == m1[k] && er == 0.f) v[k] = m1[k];  // a zero query row: exact TF32 products
                else if (m1[k] != m1[k] || er != er || !(m3[k] < th)) fm |= 1u << k;
                else cm |= (m1[k] < th ? 0u : 1u << k) | (m2[k] < th ? 0u : 1u << (16 + k));
            }
        }
        // 3. The jobs, sixteen a warp a round: quad g recomputes the warp's jobs 2g and 2g + 1 of the
        // round (listed in shared memory by the lanes that own them) from two rows of the slot that
        // held the document's last tile (`hold`, kept from the TMA until the score is written), where
        // its lanes copy their parts of each token's row first. The exact values go into this warp's
        // row of column maxima (red's second half, as ordered integers), which starts from the
        // threads' own (E = 0 columns, or none).
        unsigned* colmax = reinterpret_cast<unsigned*>(red + WARPS * BM) + warp * BM;
        {
            float w[NC];
#pragma unroll
            for (int k = 0; k < NC; ++k) w[k] = v[k];
            scatter3<true>(w);
            *reinterpret_cast<uint2*>(colmax + g * 8 + 2 * tq) = uint2{ordered(w[0]), ordered(w[1])};
            __syncwarp();
        }
        constexpr int NB = 2 * (DP / BLK);  // 16-byte chunks of a token a lane reads
        T* row2 = hold + (warp * 8 + g) * 2 * DP;  // this quad's two staging rows
        int2* list = reinterpret_cast<int2*>(cw + 2 * BM) + warp * 16;  // this warp's jobs of the round: (column, token)
        // This lane's jobs: its candidates (cm's bits in order), then each whole column's 2 nt token
        // positions; the warp's are numbered in lane order (excl: this lane's first).
        const int ncand = __popc(cm), njobs = ncand + __popc(fm) * 2 * nt;
        int excl = njobs;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const int o = __shfl_up_sync(0xffffffffu, excl, off);
            if (lane >= off) excl += o;
        }
        const int total = __shfl_sync(0xffffffffu, excl, 31);
        excl -= njobs;
        for (int base = 0; base < total; base += 16) {
            for (int m = max(base - excl, 0); m < min(njobs, base + 16 - excl); ++m) {
                int k, t;
                if (m < ncand) {
                    const int bit = nth_bit(cm, m);
                    k = bit & 15;
                    t = 0;
#pragma unroll
                    for (int kk = 0; kk < NC; ++kk)
                        if (kk == k) t = bit < 16 ? i1[kk] : i2[kk];
                } else {
                    const int w = m - ncand, p = w % (2 * nt);
                    k = nth_bit(fm, w / (2 * nt));
                    t = (p >> 1) * BN + r0 + 8 * (p & 1);
                    if (t >= len || (dm && !dm[t])) t = -1;  // not a token of the document: no job
                }
                list[excl + m - base] = int2{t < 0 ? -1 : (k >> 1) * 8 + 2 * tq + (k & 1), t};
            }
            __syncwarp();
            int jc[2], jt[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int2 e = base + 2 * g + h < total ? list[2 * g + h] : int2{-1, 0};
                jc[h] = e.x;
                jt[h] = e.y;
                if (jc[h] >= 0) {
                    const T* src = D + (begin + jt[h]) * DP + tq * EPC;
#pragma unroll
                    for (int i = 0; i < NB; ++i) {
                        const int o = (i >> 1) * BLK + (i & 1) * 4 * EPC;
                        cp_async_16(smem_addr(row2 + h * DP + tq * EPC + o), src + o, 16);
                    }
                }
            }
            __syncwarp();  // the list is read before the next round writes it
            cp_async_commit();
            cp_async_wait<0>();  // each lane reads back only the chunks it copied
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if (!__any_sync(0xffffffffu, jc[h] >= 0)) continue;
                const T* r = row2 + h * DP + tq * EPC;
                const float2 p = Refine::exact_part(sQ, max(jc[h], 0), tq, [&](int kb, int half) {
                    return *reinterpret_cast<const float4*>(r + kb * BLK + half * 4 * EPC);
                });
                // The quad's four sums differ in their last bits at most; the queries-on-M tile keeps
                // the largest (its quad_max), and so does this.
                float x = (float)Refine::quad_sum(p);
                x = max_nan(x, __shfl_xor_sync(0xffffffffu, x, 1));
                x = max_nan(x, __shfl_xor_sync(0xffffffffu, x, 2));
                if (jc[h] >= 0 && tq == 0) atomicMax(colmax + jc[h], ordered(x));
            }
        }
        fence_proxy_async();  // the staging writes before the slot's next TMA fill
        // 4. The column maxima over the CTA, summed by the last warp in score_single's order: per
        // group of 16 columns, ((0 + v[g]) + v[g + 8]) for the columns that count, the eight pairs by
        // a butterfly, then the groups in order.
        named_sync(1, NT);
        if (warp != WARPS - 1) return;
        const unsigned* res = reinterpret_cast<const unsigned*>(red + WARPS * BM);
        float grp[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int c = lane + 32 * h;
            unsigned e = res[c];
#pragma unroll
            for (int w = 1; w < WARPS; ++w) e = max(e, res[w * BM + c]);
            float m = from_ordered(e);
            if (zp && m < 0.f) m = 0.f;
            const bool ok = c < nq && cw[c] >= 0.f;
            const float m8 = __shfl_down_sync(0xffffffffu, m, 8);
            const bool ok8 = __shfl_down_sync(0xffffffffu, ok, 8);
            float s = 0.f;
            if (ok) s += m;
            if (ok8) s += m8;
#pragma unroll
            for (int off = 1; off <= 4; off <<= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
            grp[h] = s;  // lanes 0 and 16: groups 2h and 2h + 1
        }
        float sum = 0.f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            sum += __shfl_sync(0xffffffffu, grp[h], 0);
            sum += __shfl_sync(0xffffffffu, grp[h], 16);
        }
        if (lane == 0) outp[j] = sum;
    }
};

}  // namespace lik
