// Exact MaxSim forward on mma.sync tensor cores (sm_80+).
//
//   score[i, j] = sum_s  valid_q(i, s) * max_{t valid in doc j} <Q[i, s], D[j, t]>
//
// One CTA owns a tile of BM query tokens and a run of documents. The tile is
// either BM tokens of one query or, for short queries scored against shared
// documents, several whole queries (so each document tile read from memory
// feeds all of them). Documents are padded [Nd, Ld, d] (lengths, or masks with
// the spans masks.cu derives from them) or packed [T, d] with int64 offsets.
// The query tile stays on chip (registers when it fits); document tiles of BN
// tokens stream through a cp.async ring of STAGES shared-memory buffers. Wide
// embeddings (split-d) stream both sides in chunks of the dim instead, so shared
// memory does not grow with d. Each BM x BN similarity tile lives only in mma
// accumulators: it is folded into a running per-row max and dropped, so nothing
// of size Lq x Ld ever reaches memory.
//
// A query longer than BM is split over several CTAs (so the grid fills the GPU);
// each writes a partial score and lik_sum_partials adds them in a fixed order,
// which keeps the result bitwise reproducible (no float atomics anywhere).
//
// Zero-vector padding (d_zero_pad, uint8 per document row of D, as its length is indexed; null:
// none): PyLate's and colpali-engine's torch paths score a padding token as a zero vector, so a
// flagged document's row maxima are floored at 0 where they are final (Finish, and after a token
// split's merge), NaN kept; where the floor wins the row's argmax is -1 (no token: the backward
// gives it no gradient). The padding itself is skipped by the length or mask, never multiplied.
// INT8, candidate-id and PLAID residual tiles compile it out; the host passes it only to fp16, bf16
// and fp32 calls of maxsim and maxsim_varlen.
//
// This file is the NVRTC entry point: the extern "C" kernels and Fwd::run, the kernel's body. The
// rest lives in fwd/, split by role the way FlashAttention-3's hopper/ splits its kernels:
// fwd/config.cuh (the -D flags, types, constants and struct Fwd's index), fwd/tile_scheduler.cuh
// (which CTA takes which query tile, documents or token shares), fwd/mainloop.cuh (the query
// tile, the cp.async / TMA ring and the mma / wgmma tile loop), fwd/epilogue.cuh (row-max fold,
// argmax, score writes, the token split's merge), fwd/refine.cuh (float32 accuracy from TF32
// tiles: the rows' exact maxima, LIK_REFINE) and fwd/refine_m.cuh (the same with the document
// tokens on M: the columns' exact maxima at each document's end, LIK_REFINE with LIK_TOKM).
//
// run keeps the CTA's steps in order and builds small role objects whose member functions it calls:
// one for each lambda (or run of lambdas) of the single function this was, and one for each step
// moved out of it. An object's fields are references to exactly the parameters and locals its
// functions use (for a lambda, those it captured), and run builds it where the lambda was defined
// or the step ran. That keeps the generated code identical (SASS, registers, spills; checked with
// NVRTC on every flag combination). Coarser objects changed it, because what a call in run's body
// can reach before it is inlined steers the early optimisation: one object referring to all of
// run's state, or one that a call passes referring to more than that call's lambda captured, moved
// code and renumbered registers, and copies of the __restrict__ pointers (instead of references to
// run's) lost their ld.global.nc loads. Keep to that when editing: a new function goes in the
// object whose lambda it would have been, an object gets only what it uses, and a change that
// regroups them is checked the same way (compile before and after, compare the SASS).
#include "fwd/config.cuh"
#include "fwd/tile_scheduler.cuh"
#include "fwd/mainloop.cuh"
#include "fwd/residual.cuh"
#include "fwd/epilogue.cuh"
#include "fwd/refine.cuh"
#include "fwd/refine_m.cuh"

namespace lik {

LIK_FWD_TEMPLATE
__device__ void LIK_FWD::run(const T* __restrict__ Q, const T* __restrict__ D, const float* __restrict__ q_scale,
                             const float* __restrict__ d_scale, const int* __restrict__ q_len,
                             const u8* __restrict__ q_mask, const int* __restrict__ d_len,
                             const u8* __restrict__ d_mask, const Offsets d_off, i64 ntok,
                             float* __restrict__ out,
                             int* __restrict__ amax, int Nq, int Nd, int Lq, int Ld, int dim, int n_qt, int qb,
                             int docs_per_cta, int dl_qstride, const u8* __restrict__ d_zero_pad, void* split_buf,
                             unsigned split_epoch, const TmaDesc* tmd, const TmaDesc* tms, const TmaDesc* tmq
#if LIK_RESIDUAL
                             , const ResidualSrc& rsrc
#endif
#if LIK_CAND
                             , const CandSrc& csrc
#endif
) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ int piece_info[TSPLIT ? 6 : 1];  // token split: complete_pieces' info
    PieceCounts{split_buf, split_epoch, piece_info}.start();
    // Shared memory: the query tile, the ring, INT8 scales, reduction buffers, tokens-on-M query
    // multipliers and TMA barriers (SmemLayout, mainloop.cuh).
    T *sQ, *ring;
    float *sS, *red, *qmul;
    unsigned long long* mbar;
#if LIK_RESIDUAL
    u8* rbuf;
    float* rtab;
    int* rcode;
    SmemLayout{smem_raw, sQ, ring, sS, red, qmul, mbar, rbuf, rtab, rcode}.carve();
#else
    SmemLayout{smem_raw, sQ, ring, sS, red, qmul, mbar}.carve();
#endif

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, tq = lane & 3;
    const int qt = blockIdx.x % n_qt;
    if (!MULTI) qb = 1;
    const int qi0 = (blockIdx.x / n_qt) * qb;  // first query of this tile
    if (qi0 >= Nq) return;
    // qb > 1: the tile holds whole queries qi0 .. qi0+nqb-1, Lq rows each, so every
    // document tile staged is scored against all of them (n_qt is then 1).
    // qb == 1: the tile holds rows s0 .. s0+BM-1 of query qi0.
    const int nqb = MULTI && qb > 1 ? min(qb, Nq - qi0) : 1;
    const int span = MULTI && qb > 1 ? Lq : BM;  // tile rows per query
    const int s0 = qt * BM;

    // The query tile (its first row, its rows) and, with packed documents, its copies sent
    // first, to land while the CTA finds its documents (a tile past its query's length loads
    // it unused and returns below). Padded ones load it later, as before: loaded here, six
    // kernels spilled (compile check).
    QueryTile qtile{Q, qi0, Lq, s0, dim, qb, nqb};
    constexpr bool EARLY_Q = PACKED && !SPLIT;
    if (EARLY_Q) load_rows<BM>(sQ, qtile.query_tile(), qtile.query_rows(), dim, dim);

    const TileCount lt{};
    DocRange range{d_off, ntok
#if LIK_CAND
                   , csrc
#endif
    };
    Docs docs{Ld, range, d_len, d_mask, lt};
    // Documents of this CTA: a run of docs_per_cta, or for packed documents the
    // documents whose work position (shares) falls in this CTA's equal share of the work
    // (ragged corpora then balance by work, not by document count).
    int j0, j1;
    // With a token split, head_tiles of j0 were scored before this CTA's share and tail_tiles
    // of j1 - 1 end it (Shares, tile_scheduler.cuh).
    int head_tiles = 0, tail_tiles = 0x7fffffff;
    Shares sh{d_off, ntok, Nd, docs_per_cta, split_buf, j0, j1, head_tiles, tail_tiles, piece_info, range, docs};
    sh.assign();
    if (j0 >= j1) {
        if (EARLY_Q) cp_async_wait<0>();
        return;
    }

    auto query_len = [&](int qi) { return Fwd::query_len(q_len, qi, Lq); };
    const i64 doc0 = (i64)qi0 * dl_qstride;  // linear index of this tile's document 0

    float* outp = out + (n_qt > 1 ? (i64)qt * Nq * Nd : 0) + (i64)qi0 * Nd;
    LastTiles last{lt, j1, tail_tiles};
    DocTiles dt{last, docs, doc0};
    FirstTiles first{j0, head_tiles};

    // Tile entirely past the query length: contributes 0, argmax -1.
    if (qb == 1 && s0 >= query_len(qi0)) {
        EmptyTile{j0, j1, outp, Lq, s0, amax, qi0, Nd
#if LIK_CAND
                  , range, doc0
#endif
        }.write();
        if (EARLY_Q) cp_async_wait<0>();
        return;
    }

    const int wrow0 = warp * MT * 16;
#if LIK_HAS_WGMMA
    const u32 qlo = QLO_HELD ? query_desc_lo(sQ, wrow0) : 0;
#else
    const u32 qlo = 0;
#endif
    int rq[MT][2], rs[MT][2];
    bool rv[MT][2];
    tile_rows(qi0, s0, nqb, span, Lq, q_len, q_mask, rq, rs, rv);
    const RowTerm term{q_scale, qi0, rq, rs, Lq};

    const T* Qt = qtile.query_tile();
    const int q_rows = qtile.query_rows();
    QueryStage{sQ, Qt, q_rows, dim
#if LIK_HAS_WGMMA
               , mbar
#endif
    }.stage();
    if constexpr (TOKM && SCALED) {  // visible to every warp after the first stage's block barrier
        const int ql = query_len(qi0);
        for (int c = threadIdx.x; c < BM; c += NT) {
            const int s = s0 + c;
            float qm = -1.f;
            if (s < ql && (!q_mask || q_mask[(i64)qi0 * Lq + s])) {
                const float sq = q_scale[(i64)qi0 * Lq + s];
                qm = sq >= 0.f ? sq * 0x1p49f : __int_as_float(0x7fffffff);
            }
            qmul[c] = qm;
        }
    }
    const int nk = SPLIT ? (dim + DP - 1) / DP : 1;  // chunks of the dim per tile

    // The producer cursor (Cursor, mainloop.cuh, says how it runs): first stage the first tile.
    int pj = j0, pk = 0, pt = first.first_tile(j0), pnt = 0, prem = 0;
    i64 prow = 0;
    Cursor cur{pj, j1, pnt, dt, docs, doc0, last, prow, pt, prem, lt};
    cur.enter();
    while (pj < j1 && cur.staged_all()) {
        ++pj;
        pt = 0;
        cur.enter();
    }
#if LIK_RESIDUAL
    int creg[ResidualLoader::CREG];
    ResidualLoader res{rsrc, dim, rbuf, rtab, rcode, creg, ring};
    res.init_table();
#endif
    Producer prod{pj, j1, pk, prem, docs, doc0, pt, prow, ring,
#if LIK_HAS_WGMMA
                  mbar, tmq, qi0, Lq, s0, tmd, tms,
#endif
                  Qt, q_rows, dim, D, sS, d_scale, nk, cur
#if LIK_RESIDUAL
                  , res
#endif
    };
#if LIK_RESIDUAL
    prod.prefetch_codes();  // the first tile's (published by its issue)
#endif
#pragma unroll
    for (int s = 0; s < AHEAD; ++s) prod.issue(s);

    u32 qf[QREG ? MT : 1][QREG ? NK : 1][4];
    bool q_ready = !QREG;
    int cons = 0;  // stages consumed so far

    // The running max (and argmax) of this thread's rows over the current document.
    float best[MT][2];
    int bidx[MT][2];
    // Tokens on M: the running max of each of this thread's 32 query rows (columns n * 8 + 2 * tq + e).
    float bq[TOKM ? NN : 1][2];
    RowMax rowmax{best, bidx, bq, warp, g, sS, tq};
    double xbest[2] = {0.0, 0.0};  // refined tiles: the rows' exact maxima (Finish hands them to the pieces)
#if LIK_REFINE
    // float32 accuracy from TF32 tiles (fwd/refine.cuh): its per-slot norm parts follow the barriers.
    float* const tnorm = reinterpret_cast<float*>(mbar + 2 * STAGES);
    float lo[2], a1[2] = {-1.f, -1.f}, a2[2], pu[2][Refine::KEEP];
    int ptok[2][Refine::KEEP];
    bool defer;
    const Refine refine{sQ, D, tnorm, wrow0, lane, warp, best, bidx, rv, xbest, lo, a1, a2, pu, ptok, defer};
    // Tokens on M (fwd/refine_m.cuh): per column the best two TF32 values and their tokens, the third best.
    float m1[REFINE_M ? 2 * NN : 1], m2[REFINE_M ? 2 * NN : 1], m3[REFINE_M ? 2 * NN : 1], tn[2];
    int i1[REFINE_M ? 2 * NN : 1], i2[REFINE_M ? 2 * NN : 1];
    float nmax;
    bool any, cols_ready = false;
    const int qlen = query_len(qi0);
    const RefineM refm{sQ, D, red, qmul, outp, lane, warp, qi0, Lq, s0, qlen, q_mask, m1, i1, m2, i2, m3, nmax, any, cols_ready};
#endif
    Consumer consumer{cons, qf, q_ready, sQ, wrow0, lane, prod
#if LIK_HAS_WGMMA
                      , mbar
#endif
    };
    DocMask mask{d_mask, d_len, doc0, Ld
#if LIK_CAND
                 , range
#endif
    };
    PieceRole pr{j0, head_tiles, j1, tail_tiles};
    SumRows sr{red, warp, nqb, span, lane, outp, Nd};
    int pending = -1;  // MULTI: a document whose row maxima wait to be summed after the next barrier
    Flush flush{pending, sr};
    Finish fin{bq, lane, j0, red, warp, g, tq, qmul, outp, j1, best, bidx, wrow0, rv, term,
               rq, amax, qi0, Nd, Lq, rs, dt, pending, sr, pr, split_buf, d_zero_pad, xbest};

    int held = -1;  // REFINE_M: the ring slot of the document's last tile, released after its score
    for (int j = j0; j < j1; ++j) {
        i64 begin;
        const int len = docs.doc_span(doc0 + j, begin);
        const int nt = last.tiles_of(j, len);
        const u8* dm = mask.dmask(j);
        const bool zp = X3 && !MULTI && fin.zero_pad(j);  // zero-vector padding (Finish::finish says why here)
#if LIK_REFINE
        if constexpr (REFINE_M) refm.reset();
        else refine.reset(nt - first.first_tile(j));
#else
        rowmax.reset();
#endif
        for (int t = first.first_tile(j); t < nt; ++t) {
            // (Tokens-on-M tiles leave theirs unwritten: their first wgmma overwrites them, and a
            // write here made ptxas serialize their wgmma instructions, C7520. So do INT8's one-shot
            // scores-only wgmma tiles, whose packed and several-query TMA forms serialized the same
            // way; left unwritten in the split-d and argmax ones, registers spilled instead.)
            A acc[MT][NN][4];
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int n = 0; n < NN; ++n)
#pragma unroll
                    for (int r = 0; r < 4; ++r)
                        if (!TOKM && !(WG && E::kInt && !SPLIT && !ARGMAX)) acc[m][n][r] = 0;
            int slot = 0;
            for (int kc = 0; kc < nk; ++kc) {
                slot = consumer.next_stage();
                // The previous document's row sums (MULTI; every warp has passed next_stage's
                // barrier since its rows were written): before this tile's MMA for 16-bit
                // tiles, after it for INT8, the faster place for each on an H100 (32 queries
                // of 32 tokens against 180-token documents: fp16 3% faster than after, INT8
                // 5% faster than before).
                if (!SCALED) flush.flush_sums();
                const T* st = ring + slot * STAGE;
#if LIK_REFINE
                tile_mma(acc, qf, sQ, st, wrow0, lane, false, qlo, REFINE_M ? tn : tnorm + slot * WARPS);
#else
                tile_mma(acc, qf, SPLIT ? st : sQ, st + (SPLIT ? QR * LDS : 0), wrow0, lane, kc > 0, qlo);
#endif
            }
            if (SCALED) flush.flush_sums();
#if LIK_HAS_WGMMA
            if (WG_CHAIN) wgmma_wait<0>();
#endif
#if LIK_REFINE
            if constexpr (REFINE_M) refm.fold(acc, tn, t * BN, len, dm);
            else refine.fold(acc, ring + slot * STAGE, slot, t * BN, len, dm);
#else
            rowmax.fold(acc, slot, t * BN, len, dm, TMA && SCALED ? (int)(begin & 3) : 0);
#endif
            // (Refined tokens-on-M tiles keep the document's last slot: finish stages its exact work there.)
            if (!REFINE_M || t + 1 < nt) consumer.release_slot(slot);
            else held = slot;
        }
#if LIK_REFINE
        if constexpr (REFINE_M) {
            refm.finish(j, begin, nt, len, dm, fin.zero_pad(j), held >= 0 ? ring + held * STAGE : nullptr);
            if (held >= 0) consumer.release_slot(held);
            held = -1;
        } else {
            refine.resolve(begin);
            fin.finish(j, zp);
        }
#else
        fin.finish(j, zp);
#endif
    }
    cp_async_wait<0>();
    // The rest needs only kernel parameters and shared memory, so nothing else stays live
    // through the tile loop for it.
    if constexpr (TSPLIT)
        if (split_buf) complete_pieces(piece_info, split_buf, split_epoch, out, amax, Nq, Nd, Lq, n_qt, q_len, q_mask,
                                        q_scale, d_zero_pad, dl_qstride);
}

}  // namespace lik

typedef lik::Fwd<LIK_ELEM, LIK_DP, LIK_WARPS, LIK_MT, LIK_BN, LIK_STAGES, LIK_QREG != 0, LIK_ARGMAX != 0, LIK_VEC != 0,
                  LIK_WGMMA != 0, LIK_MULTI != 0, LIK_PACKED != 0, LIK_SPLIT != 0, LIK_TMA != 0, LIK_QHALF != 0,
                  LIK_TOKM != 0>
    LikFwdCfg;

// d_off (packed documents): int32 or int64 offsets; d_off_flags bit 0 says int64, bit 1 that they
// run from 0 to ntok (the CTAs then split the tokens without first reading where they end).
// LIK_STRIDED kernels read no offsets (d_off null): ntok is Nd * Ld, and a query's candidates
// start at document (query) * dl_qstride of D (their tiles hold one query: blockIdx.x / n_qt).
extern "C" __global__ void __launch_bounds__(LIK_WARPS * 32, LIK_MIN_BLOCKS)
    LIK_NAME(const void* Q, const void* D, const float* q_scale, const float* d_scale, const int* q_len, const u8* q_mask, const int* d_len, const u8* d_mask,
             const void* d_off, int d_off_flags, long long ntok, float* out, int* amax, int Nq, int Nd, int Lq, int Ld, int dim,
             int n_qt, int qb, int docs_per_cta, int dl_qstride, const u8* d_zero_pad, void* split_buf,
             unsigned split_epoch
#if LIK_TMA
             , const __grid_constant__ TmaDesc tmd  // documents as [rows, dim * esize] bytes
             , const __grid_constant__ TmaDesc tms  // INT8 document scales [rows] (a copy of tmd otherwise)
             , const __grid_constant__ TmaDesc tmq  // split-d: queries as [Nq * Lq, dim * esize] bytes (tmd otherwise)
#endif
#if LIK_RESIDUAL
             , const __grid_constant__ lik::ResidualSrc rsrc  // PLAID residual documents (D is unused)
#endif
#if LIK_CAND
             , const __grid_constant__ lik::CandSrc csrc  // the documents each query scores
#endif
    ) {
#if LIK_TMA
    const TmaDesc *pd = &tmd, *ps = &tms, *pq = &tmq;
#else
    const TmaDesc *pd = nullptr, *ps = nullptr, *pq = nullptr;
#endif
    LikFwdCfg::run(static_cast<const LikFwdCfg::T*>(Q), static_cast<const LikFwdCfg::T*>(D), q_scale, d_scale, q_len, q_mask, d_len, d_mask,
                   Offsets{d_off, d_off_flags & 1, (d_off_flags >> 1) & 1, Ld, LIK_STRIDED ? (long long)(blockIdx.x / n_qt) * dl_qstride : 0}, ntok, out, amax, Nq, Nd, Lq, Ld, dim, n_qt, qb, docs_per_cta, dl_qstride,
                   d_zero_pad, split_buf, split_epoch, pd, ps, pq
#if LIK_RESIDUAL
                   , rsrc
#endif
#if LIK_CAND
                   , csrc
#endif
    );
}

// Deterministic sum of the per-query-tile partial scores: out[x] = sum_q part[q][x], q ascending.
extern "C" __global__ void lik_sum_partials(const float* __restrict__ part, float* __restrict__ out, long long n,
                                            int n_qt) {
    for (long long x = blockIdx.x * (long long)blockDim.x + threadIdx.x; x < n; x += (long long)gridDim.x * blockDim.x) {
        float s = part[x];
        for (int q = 1; q < n_qt; ++q) s += part[q * n + x];
        out[x] = s;
    }
}
