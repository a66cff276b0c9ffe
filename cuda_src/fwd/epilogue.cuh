// The forward's epilogue: each similarity tile folded into a running max (and argmax) per query
// row as it leaves the accumulators (fold), and per document the rows' maxima reduced to a score
// (finish): across a quad, a warp and the warps in a fixed order, so the result is bitwise
// reproducible. Token split: pieces of a document write their rows to the scratch instead, and the
// last CTA to finish one merges them (complete_pieces). The structs are run's role objects (see
// maxsim_fwd.cu); their fields are references to run's locals.
#pragma once
#include "fwd/config.cuh"
#include "fwd/tile_scheduler.cuh"

#ifndef LIK_TREE_GROUP
#define LIK_TREE_GROUP -1  // the argmax trees' width (RowMax::GROUP); -1: by the tile, as below
#endif
namespace lik {

// One halving exchange of a tokens-on-M reduce-scatter: lanes HALF apart swap halves of the
// first 2 * HALF flat entries of v (v[n][e] is entry 2n + e) and keep the max of the half
// they hold: the lane with bit HALF set keeps the upper one, in entries 0 .. HALF - 1.
LIK_FWD_TEMPLATE
template <int HALF>
__device__ __forceinline__ void LIK_FWD::scatter_max(float (&v)[TOKM ? NN : 1][2], int lane) {
    const bool up = lane & HALF;
#pragma unroll
    for (int i = 0; i < HALF; ++i) {
        const float lo = v[i / 2][i % 2], hi = v[(i + HALF) / 2][(i + HALF) % 2];
        v[i / 2][i % 2] = max_nan(up ? hi : lo, __shfl_xor_sync(0xffffffffu, up ? lo : hi, HALF));
    }
}

// Max (and argmax) across the four lanes of a quad, which share an accumulator row.
LIK_FWD_TEMPLATE
__device__ __forceinline__ void LIK_FWD::quad_max(float& v, int& ix) {
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, off);
        if (ARGMAX) {
            const int oi = __shfl_xor_sync(0xffffffffu, ix, off);
            argmax_merge(v, ix, ov, oi);
        } else {
            v = max_nan(v, ov);
        }
    }
}

// argmax_merge (common.cuh) of rows whose maxima carry residues r (exact value minus the float,
// EXACT_PIECES): equal floats are ordered by their residues before their tokens.
__device__ __forceinline__ void argmax_merge_exact(float& v, float& r, int& i, float ov, float orr, int oi) {
    if (oi >= 0 && i >= 0 && ov == v) {  // equal and not NaN
        if (orr > r || (orr == r && oi < i)) {
            r = orr;
            i = oi;
        }
        return;
    }
    const int had = i;
    argmax_merge(v, i, ov, oi);
    if (i != had) r = orr;
}

// quad_max of rows with residues (EXACT_PIECES).
LIK_FWD_TEMPLATE
__device__ __forceinline__ void LIK_FWD::quad_max(float& v, int& ix, float& r) {
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, off), orr = __shfl_xor_sync(0xffffffffu, r, off);
        argmax_merge_exact(v, r, ix, ov, orr, __shfl_xor_sync(0xffffffffu, ix, off));
    }
}

// Zero-vector padding (see maxsim_fwd.cu): a final row max of a document with zero-vector padding
// is at least 0, the padding's similarity (NaN stays NaN); where 0 wins, no token does (argmax -1).
LIK_FWD_TEMPLATE
__device__ __forceinline__ void LIK_FWD::zero_floor(float& v, int& ix) {
    if (v < 0.f) {
        v = 0.f;
        ix = -1;
    }
}

// Whether document row base + j has zero-vector padding (false where flags is null: no flags). One
// predicated load in volatile asm, its address computed inside it, so that it stays where its caller
// puts it and costs no branch: a plain load moved into the document's tile loop with its address held
// through it, and a branch around the load moved code, each spilling tiles at 254-255 registers
// (split-d fp16, INT8 argmax wgmma, 3xTF32 argmax; compile check).
__device__ __forceinline__ bool zero_pad_flag(const u8* flags, i64 base, int j) {
    unsigned v;
    asm volatile(
        "{\n\t.reg .u64 a, b;\n\t.reg .pred p;\n\tsetp.ne.u64 p, %1, 0;\n\tmov.u32 %0, 0;\n\t"
        "cvt.s64.s32 b, %3;\n\tadd.s64 a, %1, %2;\n\tadd.s64 a, a, b;\n\t"
        "@p ld.global.nc.u8 %0, [a];\n\t}"
        : "=r"(v)
        : "l"(flags), "l"(base), "r"(j));
    return v != 0;
}

// A similarity from its accumulator: the float itself, or for a scaled type the dot product
// (integer ones converted first) times its document token's scale `sc`.
LIK_FWD_TEMPLATE
__device__ __forceinline__ float LIK_FWD::sim(A a, float sc) {
    if constexpr (E::kInt) return (SMALL_DOT ? i2f_small(a) : __int2float_rn(a)) * sc;
    else if constexpr (SCALED) return a * sc;
    else return a;
}

// Query qi's length: its q_len entry clamped to [0, Lq], or Lq without lengths.
LIK_FWD_TEMPLATE
__device__ __forceinline__ int LIK_FWD::query_len(const int* q_len, int qi, int Lq) {
    if (!q_len) return Lq;
    const int l = q_len[qi];  // int32 (the host narrows int64 query lengths)
    return l < 0 ? 0 : (l > Lq ? Lq : l);
}

// The 2*MT tile rows this thread reduces, of a tile whose rows start at row s0 of query qi0
// and hold nqb whole queries of `span` rows (MULTI) or rows of one query: their query
// (relative to qi0), token (-1: padding row past the queries) and validity.
LIK_FWD_TEMPLATE
__device__ __forceinline__ void LIK_FWD::tile_rows(int qi0, int s0, int nqb, int span, int Lq, const int* q_len,
                                                   const u8* q_mask, int (&rq)[MT][2], int (&rs)[MT][2],
                                                   bool (&rv)[MT][2]) {
    const int wrow0 = (threadIdx.x >> 5) * MT * 16, g = (threadIdx.x & 31) >> 2;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = wrow0 + m * 16 + g + 8 * h;
            // Single-query tiles skip the division: with it the whole kernel ran 10% slower
            // at Lq=512 on an H200 (same tile-loop instructions, scheduled differently).
            const int qq = MULTI ? row / span : 0, s = MULTI ? s0 + row - qq * span : s0 + row;
            const bool exists = qq < nqb && s < Lq;
            const int qi = qi0 + qq;
            rq[m][h] = qq;
            rs[m][h] = exists ? s : -1;
            rv[m][h] = exists && s < query_len(q_len, qi, Lq) && (!q_mask || q_mask[(i64)qi * Lq + s]);
        }
}

// A single-query tile's score of one document from this thread's rows' maxima (and argmax):
// the max across each quad, the valid rows' terms summed per thread, across the warp, then
// across warps in order (rb: WARPS floats of shared memory). Not `whole`: the document is a
// piece, whose rows go to `stash` (and `stash_idx`: its slot of the scratch) instead of a score.
// `zero_pad` (whole documents only): its rows' maxima are floored at 0 (zero_floor).
LIK_FWD_TEMPLATE
template <class Term>
__device__ __forceinline__ void LIK_FWD::score_single(const float (&best)[MT][2], const int (&bidx)[MT][2],
                                                      const float (&res)[MT][2], const bool (&rv)[MT][2],
                                                      const int (&rs)[MT][2], Term term,
                                                      float* rb, bool whole, bool zero_pad, float* out_j, int* amax_j,
                                                      void* split_buf, int role) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    float part = 0.f;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float v = best[m][h], r = res[m][h];
            int ix = bidx[m][h];
            if (EXACT_PIECES) quad_max(v, ix, r);
            else quad_max(v, ix);
            if (zero_pad) zero_floor(v, ix);
            if (rv[m][h]) part += term(v, m, h);
            if (tq == 0) {
                if (ARGMAX && whole && rs[m][h] >= 0) amax_j[rs[m][h]] = rv[m][h] ? ix : -1;
                if (TSPLIT && !whole) {
                    const i64 at = piece_slot(blockIdx.y, role, BM) + warp * MT * 16 + m * 16 + g + 8 * h;
                    split_vals(split_buf)[at] = v;
                    if (ARGMAX) split_idx(split_buf, BM)[at] = ix;
                    if (EXACT_PIECES) split_res(split_buf, BM)[at] = r;
                }
            }
        }
    if (tq != 0) part = 0.f;
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) part += __shfl_xor_sync(0xffffffffu, part, off);
    if (lane == 0) rb[warp] = part;
    __syncthreads();
    if (threadIdx.x == 0) {
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) sum += rb[w];
        if (whole) *out_j = sum;
    }
}

// Token split, after the tile loop: count this CTA's pieces in (info: the head and tail
// documents, -1 for none, then each one's first and last share); for each document whose
// count this completes, merge every piece's rows in token order and score it as score_single
// scores a whole document (same code, same order: the bits of an unsplit run; zero-vector padding,
// d_zero_pad, floors the merged maxima). Out of line, so the tile loop's registers do not grow with it.
LIK_FWD_TEMPLATE
__device__ __noinline__ void LIK_FWD::complete_pieces(const int* info, void* split_buf, unsigned epoch, float* out,
                                                      int* amax, int Nq, int Nd, int Lq, int n_qt, const int* q_len,
                                                      const u8* q_mask, const float* q_scale, const u8* d_zero_pad,
                                                      int dl_qstride) {
    static_assert(TSPLIT, "only token-split tiles leave pieces");
    __shared__ int last[2];
    __shared__ float rb[2][WARPS];  // one per document: a warp may start the second before thread 0 reads the first
    // The block barrier after the pieces' rows were written (score_single's, or this one's)
    // lets one thread's release publish them all.
    __syncthreads();
    if (info[0] < 0 && info[1] < 0) return;  // CTA-uniform
    const float* vals = split_vals(split_buf);
    const int* idx = split_idx(split_buf, BM);
    // The two counts in parallel, by threads of different warps.
    unsigned* counts = split_counts(split_buf, epoch & 1) + (i64)blockIdx.x * gridDim.y;
    if (threadIdx.x == 0) last[0] = info[0] >= 0 && arrive(counts + info[2]) == (unsigned)(info[3] - info[2]);
    if (threadIdx.x == NT - 1) last[1] = info[1] >= 0 && arrive(counts + info[4]) == (unsigned)(info[5] - info[4]);
    __syncthreads();
    if (!last[0] && !last[1]) return;
    const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
    const int qi0 = blockIdx.x / n_qt, s0 = blockIdx.x % n_qt * BM;
    float* outp = out + (n_qt > 1 ? (i64)(blockIdx.x % n_qt) * Nq * Nd : 0) + (i64)qi0 * Nd;
    int rq[MT][2], rs[MT][2];
    bool rv[MT][2];
    tile_rows(qi0, s0, 1, BM, Lq, q_len, q_mask, rq, rs, rv);
    const RowTerm term{q_scale, qi0, rq, rs, Lq};  // run's term: the row max, times the query token's INT8 scale
    // Both documents' pieces first, then their scores (the loads are not held up by the
    // scores' block barriers).
    float best[2][MT][2], res[2][MT][2];
    int bidx[2][MT][2];
#pragma unroll
    for (int role = 0; role < 2; ++role) {
        if (!last[role]) continue;
        const int y0 = info[2 + 2 * role], y1 = info[3 + 2 * role];
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = warp * MT * 16 + m * 16 + g + 8 * h;
                float v = LIK_NEG_INF, r = 0.f;
                int ix = -1;
#pragma unroll 4
                for (int y = y0; y <= y1; ++y) {
                    const i64 at = piece_slot(y, y == y0 ? 1 : 0, BM) + row;
                    const float pv = __ldcg(vals + at);  // L2: other SMs wrote it
                    if (EXACT_PIECES)
                        argmax_merge_exact(v, r, ix, pv, __ldcg(split_res(split_buf, BM) + at), __ldcg(idx + at));
                    else if (ARGMAX) argmax_merge(v, ix, pv, __ldcg(idx + at));
                    else v = max_nan(v, pv);
                }
                best[role][m][h] = v;
                res[role][m][h] = r;
                bidx[role][m][h] = ix;
            }
    }
#pragma unroll
    for (int role = 0; role < 2; ++role) {
        if (!last[role]) continue;
        const int j = info[role];
        const bool zp = zero_pad_flag(d_zero_pad, (i64)qi0 * dl_qstride, j);
        score_single(best[role], bidx[role], res[role], rv, rs, term, rb[role], true, zp, outp + j,
                     ARGMAX ? amax + ((i64)qi0 * Nd + j) * Lq : nullptr, nullptr, 0);
    }
}

// A tile past its query's length: each document's score 0 (NaN for a candidate id outside the
// corpus) and each row's argmax -1.
LIK_FWD_TEMPLATE
struct LIK_FWD::EmptyTile {
    const int &j0, &j1;
    float* const& outp;
    const int &Lq, &s0;
    int* __restrict__ const& amax;
    const int &qi0, &Nd;
#if LIK_CAND
    const DocRange& range;
    const i64& doc0;
#endif

    __device__ __forceinline__ void write() const {
#if LIK_CAND
        for (int j = j0 + threadIdx.x; j < j1; j += NT) outp[j] = range.cand_doc(doc0 + j) < 0 ? LIK_NAN : 0.f;
#else
        for (int j = j0 + threadIdx.x; j < j1; j += NT) outp[j] = 0.f;
#endif
        if (ARGMAX) {
            const int rows = min(BM, Lq - s0);
            for (i64 e = threadIdx.x; e < (i64)(j1 - j0) * rows; e += NT) {
                const int j = j0 + (int)(e / rows), r = (int)(e % rows);
                amax[((i64)qi0 * Nd + j) * Lq + s0 + r] = -1;
            }
        }
    }
};

// A valid query row's score term (several functions take it as their Term).
LIK_FWD_TEMPLATE
struct LIK_FWD::RowTerm {
    const float* __restrict__ const& q_scale;
    const int& qi0;
    int (&rq)[MT][2];
    int (&rs)[MT][2];
    const int& Lq;

    // A valid row's score term: its max, times the query token's scale for INT8 (read per
    // document from L1 rather than held in registers; an empty document's -inf stays -inf
    // even against a zero-scale padding token). The max commutes with the scale only when
    // it is >= 0: a negative (or NaN) scale gives NaN rather than a wrong number.
    __device__ float operator()(float v, int m, int h) const {
        if (!SCALED || v == LIK_NEG_INF) return v;
        const float sq = q_scale[(i64)(qi0 + rq[m][h]) * Lq + rs[m][h]];
        return v * (sq >= 0.f ? sq : __int_as_float(0x7fffffff));
    }
};

// The running max (and argmax) of this thread's rows over the current document; tokens on M: bq,
// the running max of each of the thread's 32 query rows (columns n * 8 + 2 * tq + e).
LIK_FWD_TEMPLATE
struct LIK_FWD::RowMax {
    float (&best)[MT][2];
    int (&bidx)[MT][2];
    float (&bq)[TOKM ? NN : 1][2];
    const int &warp, &g;
    float* const& sS;
    const int& tq;

    __device__ void reset() const {
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) { best[m][h] = LIK_NEG_INF; bidx[m][h] = -1; }
        if constexpr (TOKM) {
#pragma unroll
            for (int n = 0; n < NN; ++n) bq[n][0] = bq[n][1] = LIK_NEG_INF;
        }
    }
    // The argmax fold of a tile without a mask (FULL: every token counts; else this thread's
    // column c, token tok0 + 2 tq + c, counts where c < rem). Each row's 2 NN columns (k = 2 n + e,
    // c = 8 n + e, in token order) reduce GROUP at a time in trees whose merges keep the left
    // (lower) token unless the right one is strictly larger, and the trees' winners then merge
    // in order: a scan's winner, lowest token on ties, in three instructions a column. A scan (a
    // running max, then a compare and two selects against best) took four or five, in one chain
    // 2 NN steps long (scored with the argmax, fp16 ColPali took 1.77x the scores alone, 1.32x
    // with the trees). Columns past the document are -inf and lie right of every counted one,
    // so they never win one. The tile's winner meets best the same way (earlier tokens on the
    // left), and a row with no winner yet (all -inf so far) takes its first counted token.
    // max.NaN carries a NaN to the root: such a row is left as it was and false returned, for
    // the exact loop to fold the tile again and land on the first NaN (rows folded here hold
    // none, and its strict '>' leaves them be).
    // Columns a tree reduces at once; 0: no trees, whole tiles are scanned (fold). 64 spilled
    // FP8's 256-token tiles; 16 spilled two-warpgroup tiles held to 128 registers (two CTAs an SM)
    // with packed documents or several queries a tile, which take 4 (no spill) unless scaled
    // (INT8's spilled at every width); their padded token-split form (STRIDED) and 3xTF32's tiles
    // spilled at every width too (nvrtc compile check).
    static constexpr bool TIGHT = WG && WARPS == 8 && LIK_MIN_BLOCKS > 1 && (PACKED || MULTI);
    static constexpr int GROUP = LIK_TREE_GROUP >= 0 ? LIK_TREE_GROUP
                                 : STRIDED || X3 || (TIGHT && SCALED) ? 0
                                 : TIGHT ? 4 : 16;
    template <bool FULL, class Scales>
    __device__ __forceinline__ bool tree_fold(A (&acc)[MT][NN][4], const Scales& scales, int tok0, int rem) const {
        float v[MT][2];
        int w[MT][2];
#pragma unroll
        for (int k0 = 0; k0 < 2 * NN; k0 += GROUP) {
            float2 sc[GROUP / 2];  // the group's token scales, read once for all rows
#pragma unroll
            for (int i = 0; i < GROUP / 2 && k0 / 2 + i < NN; ++i) sc[i] = scales(k0 / 2 + i);
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float tv[GROUP];
                    int ti[GROUP];
#pragma unroll
                    for (int i = 0; i < GROUP && k0 + i < 2 * NN; ++i) {
                        const int k = k0 + i;
                        const float x = sim(acc[m][k >> 1][2 * h + (k & 1)], k & 1 ? sc[i >> 1].y : sc[i >> 1].x);
                        tv[i] = FULL || (k >> 1) * 8 + (k & 1) < rem ? x : LIK_NEG_INF;
                        ti[i] = k;
                    }
#pragma unroll
                    for (int s = 1; s < GROUP; s *= 2)
#pragma unroll
                        for (int i = 0; i + s < GROUP && k0 + i + s < 2 * NN; i += 2 * s) {
                            ti[i] = tv[i + s] > tv[i] ? ti[i + s] : ti[i];
                            tv[i] = max_nan(tv[i], tv[i + s]);
                        }
                    if (k0 == 0) {
                        v[m][h] = tv[0];
                        w[m][h] = ti[0];
                    } else {
                        w[m][h] = tv[0] > v[m][h] ? ti[0] : w[m][h];
                        v[m][h] = max_nan(v[m][h], tv[0]);
                    }
                }
        }
        bool nan = false;
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int c = (w[m][h] >> 1) * 8 + (w[m][h] & 1);
                if (v[m][h] != v[m][h]) {
                    nan = true;
                } else if ((FULL || c < rem) && (bidx[m][h] < 0 || v[m][h] > best[m][h])) {
                    best[m][h] = v[m][h];
                    bidx[m][h] = tok0 + 2 * tq + c;
                }
            }
        return !nan;
    }
    // Fold the similarity tile in `acc` (document tokens tok0 .. tok0 + BN - 1 of a document of
    // `len` tokens with mask `dm`, staged in ring slot `slot`, INT8 scales `sh` floats into
    // the slot) into best / bidx.
    __device__ void fold(A (&acc)[MT][NN][4], int slot, int tok0, int len, const u8* dm, int sh) const {
        if constexpr (TOKM) {
            // This thread's tokens: tile rows r0 and r0 + 8 (accumulators [2 * h + e]).
            const int r0 = (warp >> 2) * 64 + (warp & 3) * 16 + g;
            float mul[2], add[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int tok = tok0 + r0 + 8 * h;
                const float sc = sS[slot * SCL + sh + r0 + 8 * h];
                const bool ok = tok < len && (!dm || dm[tok]);
                mul[h] = ok ? sc * 0x1p100f : 0.f;
                add[h] = ok ? sc * -0x1p-27f : LIK_NEG_INF;
            }
#pragma unroll
            for (int n = 0; n < NN; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    bq[n][e] = max_nan(bq[n][e], max_nan(fmaf(__int_as_float(acc[0][n][e]), mul[0], add[0]),
                                                         fmaf(__int_as_float(acc[0][n][2 + e]), mul[1], add[1])));
            return;
        }
        const bool full = !dm && tok0 + BN <= len;
        // INT8: columns n * 8 + 2 * tq + {0, 1} of this thread take their document token
        // scales from the stage just consumed (read before the next loop-top barrier lets the
        // producer refill it); one 8-byte load per column pair serves all 2 * MT rows.
        const float* ss = sS + slot * SCL + sh + 2 * tq;
        auto scales = [&](int n) {
            if constexpr (SCALED && TMA) return float2{ss[n * 8], ss[n * 8 + 1]};  // sh may be odd
            else if constexpr (SCALED) return *reinterpret_cast<const float2*>(ss + n * 8);
            else return float2{1.f, 1.f};
        };
        if (!ARGMAX && full) {
            // Every token of the tile counts: one max per accumulator, no select (the
            // epilogue's instruction count, not the MMA, bounds short-document tiles).
#pragma unroll
            for (int n = 0; n < NN; ++n) {
                const float2 sc = scales(n);
#pragma unroll
                for (int m = 0; m < MT; ++m)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        best[m][h] = max_nan(best[m][h], max_nan(sim(acc[m][n][2 * h], sc.x),
                                                                 sim(acc[m][n][2 * h + 1], sc.y)));
            }
            return;
        }
        if (MULTI && !ARGMAX && !dm && !SCALED) {
            // A document's last, partial tile: its whole 8-column blocks take the one-op fold,
            // the block the document ends in is masked, later blocks are skipped. rem is the
            // same across the warp, so the branches do not diverge. (INT8 stays on the select
            // below: there each block's scale loads wait behind its branch, 2% slower on 32
            // queries x 32 tokens against 180-token documents, H100. Single-query tiles take
            // the select too: this fold cost their one-warpgroup wgmma tiles up to 20
            // registers, past the 128 that four CTAs per SM allow, for no measured gain.)
            const int rem = len - tok0;
#pragma unroll
            for (int n = 0; n < NN; ++n) {
                if (n * 8 + 8 <= rem) {
                    const float2 sc = scales(n);
#pragma unroll
                    for (int m = 0; m < MT; ++m)
#pragma unroll
                        for (int h = 0; h < 2; ++h)
                            best[m][h] = max_nan(best[m][h], max_nan(sim(acc[m][n][2 * h], sc.x),
                                                                     sim(acc[m][n][2 * h + 1], sc.y)));
                } else if (n * 8 < rem) {
                    const float2 sc = scales(n);
                    const bool ok0 = n * 8 + 2 * tq < rem, ok1 = n * 8 + 2 * tq + 1 < rem;
#pragma unroll
                    for (int m = 0; m < MT; ++m)
#pragma unroll
                        for (int h = 0; h < 2; ++h)
                            best[m][h] = max_nan(best[m][h], max_nan(ok0 ? sim(acc[m][n][2 * h], sc.x) : LIK_NEG_INF,
                                                                     ok1 ? sim(acc[m][n][2 * h + 1], sc.y) : LIK_NEG_INF));
                }
            }
            return;
        }
        if constexpr (ARGMAX && GROUP > 0)
            if (!dm && (full ? tree_fold<true>(acc, scales, tok0, 0)
                             : tree_fold<false>(acc, scales, tok0, len - tok0 - 2 * tq)))
                return;
        if (ARGMAX && GROUP == 0 && full) {
            // Tiles without trees scan a whole tile: a strict '>' per token in increasing order
            // keeps the lowest index on ties, with no validity test. A NaN anywhere in the
            // thread's tile sends it on through the exact loop below, which then lands on the
            // first NaN whatever this pass chose (a NaN beats any number there).
            float tmax = LIK_NEG_INF;
#pragma unroll
            for (int n = 0; n < NN; ++n) {
                const float2 sc = scales(n);
#pragma unroll
                for (int e = 0; e < 2; ++e)
#pragma unroll
                    for (int m = 0; m < MT; ++m)
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const float v = sim(acc[m][n][2 * h + e], e ? sc.y : sc.x);
                            tmax = max_nan(tmax, v);
                            if (v > best[m][h]) { best[m][h] = v; bidx[m][h] = tok0 + n * 8 + 2 * tq + e; }
                        }
            }
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    if (bidx[m][h] < 0) {  // all -inf so far: the first token
                        best[m][h] = sim(acc[m][0][2 * h], scales(0).x);
                        bidx[m][h] = tok0 + 2 * tq;
                    }
            if (tmax == tmax) return;
        }
#pragma unroll
        for (int n = 0; n < NN; ++n) {
            const float2 sc = scales(n);
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int tok = tok0 + n * 8 + 2 * tq + e;
                const bool ok = full || (tok < len && (!dm || dm[tok]));
#pragma unroll
                for (int m = 0; m < MT; ++m)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const float v = sim(acc[m][n][2 * h + e], e ? sc.y : sc.x);
                        if (ARGMAX) {
                            // Tokens arrive in increasing order per thread, so a strict
                            // '>' keeps the lowest index on ties; the first NaN sticks.
                            const float b = best[m][h];
                            if (ok && (bidx[m][h] < 0 || v > b || (v != v && b == b))) {
                                best[m][h] = v;
                                bidx[m][h] = tok;
                            }
                        } else {
                            best[m][h] = max_nan(best[m][h], ok ? v : LIK_NEG_INF);
                        }
                    }
            }
        }
    }
};

// MULTI: several whole queries' scores of a document from its row maxima in shared memory.
LIK_FWD_TEMPLATE
struct LIK_FWD::SumRows {
    float* const& red;
    const int &warp, &nqb, &span, &lane;
    float* const& outp;
    const int& Nd;

    // MULTI: one warp per query sums document j's row maxima from shared memory, in score_single's
    // order for one-m-tile warps (wgmma tiles): per 16 rows, each quad's rows g and g + 8, a butterfly
    // over the quads, and the groups in order. A query scored with others then has the bits it has
    // scored alone (a server's batches, lik_cupy.serving); rows that do not count hold 0. On wgmma
    // tiles lanes 8c .. 8c + 7 hold group c's eight pairs, four groups a pass: the butterfly over
    // them (xor 1, 2, 4) adds what score_single's over the quads (xor 4, 8, 16) adds, in the same
    // tree (4-5% faster on an H200 than a group a pass). mma.sync tiles keep a group a pass, the
    // quads' first lanes loading: the four-group pass spilled 20 bytes in the split-d float32
    // argmax tile of several queries on sm_86 and sm_89 (compile check).
    __device__ void sum_rows(int j) const {
        const float* rowv = red + (j & 1) * BM;
        for (int qq = warp; qq < nqb; qq += WARPS) {
            const float* rp = rowv + qq * span;
            float sum = 0.f;
            if constexpr (WG) {
                const int c = lane >> 3, g = lane & 7;
                for (int k0 = 0; k0 < span; k0 += 64) {
                    const int k = k0 + 16 * c;
                    float part = 0.f;
                    if (k + g < span) part += rp[k + g];
                    if (k + g + 8 < span) part += rp[k + g + 8];
#pragma unroll
                    for (int off = 1; off < 8; off <<= 1) part += __shfl_xor_sync(0xffffffffu, part, off);
#pragma unroll
                    for (int cc = 0; cc < 4; ++cc)
                        if (k0 + 16 * cc < span) sum += __shfl_sync(0xffffffffu, part, 8 * cc);
                }
            } else {
                const int g = lane >> 2, tq = lane & 3;
                for (int k = 0; k < span; k += 16) {
                    float part = 0.f;
                    if (tq == 0) {
                        if (k + g < span) part += rp[k + g];
                        if (k + g + 8 < span) part += rp[k + g + 8];
                    }
#pragma unroll
                    for (int off = 4; off < 32; off <<= 1) part += __shfl_xor_sync(0xffffffffu, part, off);
                    sum += part;
                }
            }
            if (lane == 0) outp[(i64)qq * Nd + j] = sum;
        }
    }
};

// MULTI: the row sums of the document left pending by finish, after the next block barrier.
LIK_FWD_TEMPLATE
struct LIK_FWD::Flush {
    int& pending;  // MULTI: a document whose row maxima wait to be summed after the next barrier
    const SumRows& sr;

    __device__ void flush_sums() const {
        if (MULTI && pending >= 0) {
            sr.sum_rows(pending);
            pending = -1;
        }
    }
};

// A document's score (and argmax) from the thread's row maxima, once its last tile is folded.
LIK_FWD_TEMPLATE
struct LIK_FWD::Finish {
    float (&bq)[TOKM ? NN : 1][2];
    const int &lane, &j0;
    float* const& red;
    const int &warp, &g, &tq;
    float* const& qmul;
    float* const& outp;
    const int& j1;
    float (&best)[MT][2];
    int (&bidx)[MT][2];
    const int& wrow0;
    bool (&rv)[MT][2];
    const RowTerm& term;
    int (&rq)[MT][2];
    int* __restrict__ const& amax;
    const int &qi0, &Nd, &Lq;
    int (&rs)[MT][2];
    const DocTiles& dt;
    int& pending;
    const SumRows& sr;
    const PieceRole& pr;
    void* const& split_buf;
    const u8* __restrict__ const& d_zero_pad;
    const double (&xbest)[2];  // refined tiles: the rows' exact maxima (fwd/refine.cuh)

    // Document j's zero-vector padding flag (false without flags, and in INT8, candidate-id and PLAID
    // residual tiles, which are never given flags).
    __device__ bool zero_pad(int j) const { return !SCALED && !CAND && !RES && zero_pad_flag(d_zero_pad, dt.doc0, j); }

    // Document j's score (and argmax) from best / bidx. Its zero-vector padding flag is read here,
    // where the row maxima are final, except by single-query 3xTF32 tiles, whose run reads it as the
    // document starts (`zp`): read here, it spilled their 250-register argmax tile on sm_90, and read
    // there, it cost other tiles registers through the tile loop (compile check).
    __device__ void finish(int j, bool zp) const {
        if (TOKM) {
            // Reduce-scatter over the 8 lanes sharing tq: three halving exchanges leave lane
            // (g, tq) the maxima of flat indices 4g .. 4g + 3 (n = 2g + k / 2, e = k % 2).
            scatter_max<16>(bq, lane);
            scatter_max<8>(bq, lane);
            scatter_max<4>(bq, lane);
            // Every warp's maxima go to buffer b = (j - j0) & 1 and the last warp reduces them, with
            // named barriers instead of a block barrier so the other warps go on to the next
            // document: FULL[b] (ids 1, 2) the buffer is written, FREE[b] (ids 3, 4) the last warp
            // has read it (each buffer is reused two documents later).
            const int b = (j - j0) & 1;
            float* rw = red + b * RED;  // [WARPS][BM]
            const bool reducer = warp == WARPS - 1;  // not warp 0, whose thread 0 issues the TMA stages
            if (!reducer && j - j0 >= 2) named_sync(3 + b, NT);
#pragma unroll
            for (int k = 0; k < 4; k += 2)
                *reinterpret_cast<float2*>(rw + warp * BM + (2 * g + k / 2) * 8 + 2 * tq) = float2{bq[k / 2][0], bq[k / 2][1]};
            if (!reducer) {
                named_arrive(1 + b, NT);
            } else {
                named_sync(1 + b, NT);
                // Query row c's max over the 8 warps times its multiplier (qmul), summed in
                // score_single's order, so that the queries-on-M tile a token split takes instead
                // has the same bits: in each group of 16 rows, rows g and g + 8 from 0, the eight
                // pairs by a butterfly, then the groups in order. Lane (k, q) has group k's pairs
                // g = 2q, 2q + 1.
                static_assert(!TOKM || BM == 8 * 16, "tokens-on-M tiles hold 128 query rows");
                const int k = lane >> 2, q = lane & 3;
                float grp = 0.f;
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float pair = 0.f;
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int c = k * 16 + 2 * q + e + 8 * h;
                        float m = rw[c];
#pragma unroll
                        for (int w = 1; w < WARPS; ++w) m = max_nan(m, rw[w * BM + c]);
                        const float qm = qmul[c];
                        if (!(qm < 0.f)) pair += m == LIK_NEG_INF ? m : m * qm;
                    }
                    grp = e ? grp + pair : pair;
                }
                grp += __shfl_xor_sync(0xffffffffu, grp, 1);
                grp += __shfl_xor_sync(0xffffffffu, grp, 2);
                float sum = 0.f;
#pragma unroll
                for (int g8 = 0; g8 < 8; ++g8) sum += __shfl_sync(0xffffffffu, grp, 4 * g8);
                if (lane == 0) outp[j] = sum;
                if (j + 2 < j1) named_arrive(3 + b, NT);
            }
        } else if (MULTI) {
            // Row max across the quad that shares each row, into shared memory (0 for rows that do
            // not count). Double-buffered by document: the rows are summed after the next tile's
            // block barrier (one barrier per document fewer), or after one here when no tile of
            // this CTA follows.
            float* rowv = red + (j & 1) * BM;
            const bool zp = zero_pad(j);
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float v = best[m][h];
                    int ix = bidx[m][h];
                    quad_max(v, ix);
                    if (zp) zero_floor(v, ix);
                    if (tq == 0) {
                        rowv[wrow0 + m * 16 + g + 8 * h] = rv[m][h] ? term(v, m, h) : 0.f;
                        if (ARGMAX && rs[m][h] >= 0)
                            amax[((i64)(qi0 + rq[m][h]) * Nd + j) * Lq + rs[m][h]] = rv[m][h] ? ix : -1;
                    }
                }
            if (j + 1 < j1 && dt.tiles(j + 1) > 0) {
                pending = j;
                return;
            }
            __syncthreads();
            sr.sum_rows(j);
        } else {
            const int role = pr.piece_role(j);
            float res[MT][2];  // EXACT_PIECES: each row max's residue (a NaN or infinite max: 0)
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float r = EXACT_PIECES ? (float)(xbest[h] - (double)best[m][h]) : 0.f;
                    res[m][h] = r == r ? r : 0.f;
                }
            score_single(best, bidx, res, rv, rs, term, red + (j & 1) * WARPS,  // double buffer: an empty next doc skips the loop barrier
                         role < 0, role < 0 && (X3 ? zp : zero_pad(j)), outp + j,
                         ARGMAX ? amax + ((i64)qi0 * Nd + j) * Lq : nullptr, split_buf, role);
#if LIK_CAND
            // A candidate id outside the corpus was scored as a document without tokens: its score
            // is NaN instead (the thread that wrote the sum).
            if (threadIdx.x == 0 && dt.docs.range.cand_doc(dt.doc0 + j) < 0) outp[j] = LIK_NAN;
#endif
        }
    }
};

}  // namespace lik
