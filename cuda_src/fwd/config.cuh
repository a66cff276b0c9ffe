// The MaxSim forward's compile-time configuration and struct Fwd: its constants and the index of
// its parts, by role:
//   fwd/tile_scheduler.cuh  which query tile and which documents (or token shares) a CTA takes
//   fwd/mainloop.cuh        the query tile, the cp.async / TMA ring and the mma / wgmma tile loop
//   fwd/epilogue.cuh        the row-max fold, argmax, score writes and the token split's merge
// maxsim_fwd.cu, the NVRTC entry point, holds Fwd::run, the kernel's body, which runs the CTA's
// steps in order through the role objects declared below.
//
// Compile-time configuration comes from -D flags chosen by lik_cupy/_dispatch/ (FwdConfig.defines):
//   LIK_ELEM    the element type, whose traits (Elem<>, elements.cuh) the kernel reads: 0 fp16,
//               1 bf16 (m16n8k16), 2 fp32 inputs on tf32 (m16n8k8, or wgmma k8 from the float32
//               tile in shared memory), 3 INT8 (m16n8k32 or wgmma k32, int32 accumulators) and
//               4 FP8 e4m3 (m16n8k32 on sm_89+, or wgmma k32, float32 accumulators), both with
//               per-token float scales: each document token's scale multiplies its dot products
//               before the max (one multiply per similarity, no dequantised copy of D anywhere),
//               each query token's scale multiplies the max (scales are non-negative, so the max
//               commutes with it)
//   LIK_X3      1 (fp32 only): float32 accuracy from tf32 tensor cores. Each operand x splits into
//               hi = tf32(x) and lo = tf32(x - hi), and a product is accumulated as lo*hi + hi*lo +
//               hi*hi (the lo*lo term, ~2^-22 of it, is dropped): three mma per tile instead of one,
//               relative error ~1e-6 instead of ~1e-3. Query fragments are re-read from shared
//               memory (LIK_QREG 0): holding hi and lo in registers would double them
//   LIK_REFINE  1 (fp32 one-shot wgmma tiles): float32 accuracy at TF32 speed. The tile runs on TF32
//               wgmma, and the similarities within the TF32 error bound of a row's best lower bound
//               are recomputed exactly from the float32 tiles in shared memory (fwd/refine.cuh); with
//               LIK_TOKM, the document tokens on the M side and the exact work at each document's
//               end only (fwd/refine_m.cuh)
//   LIK_DP      embedding dim padded to a multiple of 16 (32 for one-byte types; pad lanes are zero)
//   LIK_WARPS   warps per CTA; each owns LIK_MT*16 query rows
//   LIK_MT      16-row mma tiles per warp
//   LIK_BN      document tokens per pipeline stage
//   LIK_STAGES  cp.async ring depth
//   LIK_QREG    1: query fragments held in registers; 0: re-read from shared memory
//   LIK_ARGMAX  1: also write the winning document token per query token
//   LIK_VEC     1: 16-byte copies (dim and base pointers 16-byte aligned)
//   LIK_WGMMA   1: Hopper warpgroup MMA (sm_90a; needs LIK_MT 1, LIK_WARPS 4 or 8 (one or two
//               warpgroups of 64 query rows), rows of LIK_DP elements a multiple of 128 bytes):
//               tiles are stored 128B-swizzled and read by the tensor cores straight from
//               shared memory
//   LIK_MULTI   1: a tile may hold several whole queries (qb > 1); 0 keeps the
//               leaner single-query reduction (qb must be 1)
//   LIK_PACKED  1: documents are packed tokens with offsets; 0: padded
//   LIK_TMA     1 (sm_90; one-shot tiles with rows a multiple of 128 bytes, or split-d wgmma tiles):
//               document tiles arrive by TMA from a tensor map passed as a kernel parameter, one
//               thread issuing each stage and an mbarrier per ring slot counting its bytes, instead
//               of every thread issuing 16-byte cp.async copies (16-bit one-shot tiles of one query
//               also free slots through a second mbarrier per slot, see RELEASE). Split-d stages take
//               their query chunk by TMA too, from a map of Q. INT8 scales come by TMA, from a 1D
//               map: boxes must start 16-byte aligned, so each box starts at the aligned token at or
//               below the tile's first and carries 4 scales more
//   LIK_SPLIT   1: split-d: LIK_DP is a chunk of the embedding dim, and each pipeline
//               stage holds a BM x DP query chunk and a BN x DP document chunk; the
//               similarity tile accumulates over ceil(dim / DP) stages before its
//               max-epilogue, so any dim fits in a fixed amount of shared memory
//   LIK_QHALF   1 (split-d, one warpgroup, cp.async, one query of at most 32 tokens): each stage
//               holds 32 query rows, not 64; the wgmma reads its other 32 A rows from whatever
//               follows (the next chunk or the document rows), finite or not, into result rows
//               that are never read. A stage is 12 KB instead of 16 at BN = 64, so more stages
//               and more CTAs fit on an SM
//   LIK_TOKM    1 (INT8, two warpgroups, TMA, 128 x 128 tiles, no argmax, one query per tile; or refined
//               float32, one warpgroup, 64 x 64 tiles: fwd/refine_m.cuh):
//               tokens on the wgmma M side. Each warpgroup multiplies 64 document tokens (A) by
//               the tile's 128 query rows (B), so a thread's accumulators hold 2 tokens x 32 query
//               rows and its two token scales sit in registers, instead of 32 column scales read
//               from shared memory per tile. Accumulators start at 2^22, which makes the int32
//               dot product x, read as a float, the denormal (x + 2^22) * 2^-149; one fused
//               multiply-add by (s * 2^100, -s * 2^-27) gives x * s * 2^-49 rounded once (exact
//               for scales in [2^-77, 2^28)), and a masked token gets (0, -inf). So a similarity
//               costs an FFMA and a max instead of an IADD, FADD, FMUL, max and a share of the
//               scale loads. The per-query-row max over the 8 lanes and 8 warps that share a row
//               is taken once per document
//   LIK_STRIDED 1 (with LIK_PACKED, token-split tiles only): padded documents [Nd, Ld, d] (lengths,
//               masks, per-query candidates) scored by the packed path's token split, with no
//               offsets array: the CTAs share out padded token positions (document j at j * Ld,
//               in the query's own set of candidates), and each document's rows and tokens are
//               the padded layout's (its length, its mask). Few long documents then fill the GPU
//               instead of one CTA scoring each whole
//   LIK_DOC_COST packed documents: tokens of work each document counts for beside its own when
//               the CTAs share the corpus out (see shares)
//   LIK_RESIDUAL 1, 2 or 4: documents are PLAID-compressed (fast-plaid / ColBERTv2): per token a
//               centroid code and that many residual bits per dim. The loader gathers each
//               token's centroid row and residual bits into the ring slot by cp.async and
//               decompresses them there, in place, into the fp16 / bf16 tile the tensor cores
//               read (fwd/residual.cuh); 0: documents are embeddings
//   LIK_CAND    1 (one query per tile, no TMA, no token split): query i scores the documents whose
//               ids are row i of a candidate array (CandSrc), in place, instead of all of them: packed
//               documents by their offsets, padded ones as rows of D (their lengths or masks too),
//               PLAID residual ones either way (a rerank). Tile j of query i is candidate
//               doc0 + j of the array; an id outside [0, n_docs) reads nothing and scores NaN
//   LIK_NAME    entry point name
#pragma once
#include "common.cuh"
#include "wgmma.cuh"

#ifndef LIK_MULTI
#define LIK_MULTI 0
#endif
#ifndef LIK_PACKED
#define LIK_PACKED 0
#endif
#ifndef LIK_SPLIT
#define LIK_SPLIT 0
#endif
#ifndef LIK_TMA
#define LIK_TMA 0
#endif
#ifndef LIK_QHALF
#define LIK_QHALF 0
#endif
#ifndef LIK_TOKM
#define LIK_TOKM 0
#endif
#ifndef LIK_X3
#define LIK_X3 0
#endif
#ifndef LIK_DOC_COST
#define LIK_DOC_COST 0
#endif
#ifndef LIK_RESIDUAL
#define LIK_RESIDUAL 0
#endif
#ifndef LIK_REFINE
#define LIK_REFINE 0
#endif
// CTAs per SM the launch plan counts on (dispatch sets 2 for Hopper tiles whose shared memory lets
// two share an SM, one's epilogue running under the other's MMA; that caps registers at 128 per
// thread).
#ifndef LIK_MIN_BLOCKS
#define LIK_MIN_BLOCKS 1
#endif
// Document lengths as the caller gave them (length_at, common.cuh), except in scaled (INT8) and
// multi-query argmax tiles, which read int32 ones (the host narrows int64 lengths for them: launch.py,
// tagged_doc_lengths): the tag's registers spilled them at 255 (nvrtc.check_all). Query lengths
// are int32 everywhere: the tag in the rows' validity test spilled multi-query argmax tiles.
__device__ __forceinline__ int fwd_length(const int* p, i64 i) {
    if constexpr (LIK_ARGMAX && (Elem<LIK_ELEM>::kScaled || LIK_MULTI)) return p[i];
    else return length_at(p, i);
}

#ifndef LIK_CAND
#define LIK_CAND 0
#endif
#ifndef LIK_STRIDED
#define LIK_STRIDED 0
#endif

#ifndef LIK_WGMMA
#define LIK_WGMMA 0
#endif
#if (LIK_WGMMA || LIK_TMA) && !LIK_HAS_WGMMA
#error "LIK_WGMMA kernels must be compiled for sm_90a (the sm_90a feature set is not enabled)"
#endif

#ifndef LIK_NAME
#error "LIK_NAME and the tile macros are set by lik_cupy._dispatch (FwdConfig.defines)"
#endif

namespace lik {

// PLAID-compressed documents (LIK_RESIDUAL): where the loader reads them, a kernel parameter.
struct ResidualSrc {
    const void* codes;        // int32 or int64 [rows]: each document token's centroid
    const u8* bits;           // uint8 [rows, rbytes]: its residual buckets, nbits per dim
    const u16* centroids;     // float16 [n_cent, dim]
    const float* weights;     // float32 [2^nbits]: the value each bucket adds
    int n_cent;               // codes outside [0, n_cent) read centroid 0
    int rbytes;               // dim * nbits / 8
    int codes_wide;           // 1: int64 codes
    int normalize;            // 1: each decompressed token is scaled to unit length
};

// Candidate ids (LIK_CAND): the documents each query scores, a kernel parameter.
struct CandSrc {
    const void* ids;  // int32 or int64 [Nq, K]: query i scores documents ids[i, 0..K)
    i64 n_docs;       // documents of D (padded rows, or the offsets' documents); other ids score NaN
    int wide;         // 1: int64 ids
};

template <int ELEM, int DP, int WARPS, int MT, int BN, int STAGES, bool QREG, bool ARGMAX, bool VEC, bool WG,
          bool MULTI, bool PACKED, bool SPLIT, bool TMA, bool QHALF, bool TOKM>
struct Fwd {
    typedef Elem<ELEM> E;  // the element type's traits (elements.cuh)
    typedef typename E::T T;
    typedef typename E::Acc A;
    enum : bool { SCALED = E::kScaled, TF32 = E::kTf32 };  // float32 scales per token (SCL below); TF32 tiles
    static constexpr bool X3 = LIK_X3 != 0;  // fp32 by three tf32 products (see LIK_X3)
    static constexpr int ESIZE = sizeof(T);
    static constexpr int EPC = 16 / ESIZE;      // elements per 16-byte chunk
    static constexpr int BLK = 128 / ESIZE;     // elements per 128-byte swizzle row (wgmma)
    // Tiles are 128B-swizzled for wgmma (which reads them so) and for TMA (which writes them so;
    // the swizzle keeps ldmatrix conflict-free too); other tiles pad each row instead.
    static constexpr bool SWZ = WG || TMA;
    static constexpr int LDS = SWZ ? DP : DP + EPC;  // row stride: padded rows keep ldmatrix / lds conflict-free
    static constexpr int KSTEP = E::kK;         // 32 bytes of K per mma
    static constexpr int NK = DP / KSTEP;
    static constexpr int BM = WARPS * MT * 16;
    static constexpr int NT = WARPS * 32;
    static constexpr int NN = BN / 8;           // n8 accumulator tiles per row block
    static constexpr int CPR = DP / EPC;        // 16-byte chunks per row
    static_assert(DP % 16 == 0, "DP must be a multiple of 16");
    static_assert(BN % 16 == 0, "BN must be a multiple of 16");
    static_assert(STAGES >= 2, "need at least two stages");
    static_assert(!WG || (MT == 1 && (WARPS == 4 || WARPS == 8) && DP * ESIZE % 128 == 0 && !X3 && !QREG), "wgmma tile shape");
    static_assert(!SPLIT || !QREG, "split-d re-reads query chunks from shared memory");
    static_assert(DP % KSTEP == 0, "tiles (and split-d chunks) hold whole k steps");
    static_assert(!X3 || (TF32 && !QREG), "3xTF32 takes fp32 tiles and re-reads query fragments");
    static_assert(!LIK_REFINE || (TF32 && WG && !SPLIT && MT == 1 && BN <= 128 && !X3),
                  "refined TF32 takes one-shot float32 wgmma tiles of at most 128 tokens");
    static_assert(!TMA || ((!TF32 || WG) && DP * ESIZE % 128 == 0 && (!SPLIT || WG)),
                  "TMA feeds one-shot 16-bit and INT8 tiles, float32 wgmma tiles and split-d wgmma tiles");
    static_assert(!QHALF || (SPLIT && WG && !TMA && !MULTI && WARPS == 4), "half query stages: one-warpgroup split-d tiles");
    static constexpr int QR = QHALF ? 32 : BM;  // query rows staged per split-d stage
    static constexpr int STAGE = SPLIT ? (QR + BN) * LDS : BN * LDS;  // elements per ring stage
    // Document token scales staged per ring stage (floats); TMA boxes of BN + 4 in slots of
    // 128-byte multiples.
    static constexpr int SCL = SCALED ? (TMA ? BN + 32 : BN) : 0;
    static_assert(!(TMA && SCALED) || BN + 4 <= 256, "a TMA box holds at most 256 scales");
    // INT8 dot products stay below 2^22 in magnitude while DP * 128 * 128 does, and then
    // convert with two full-rate ops instead of one quarter-rate I2F.
    // Split-d dot products span the whole dim, so they take the exact conversion.
    static constexpr bool SMALL_DOT = !SPLIT && DP * 128 * 128 < (1 << 22);
    // Stages loading ahead of the one consumed. Hopper split-d leaves one chunk's wgmma in
    // flight while the next is issued, so the slot it reads is not refilled yet.
    static constexpr bool WG_CHAIN = WG && SPLIT;
    static constexpr int AHEAD = WG_CHAIN ? STAGES - 2 : STAGES - 1;
    // 16-bit TMA tiles of one query free each ring slot by per-warp arrivals on an "empty"
    // mbarrier instead of a block barrier per tile: 5-6% faster at Lq = 200..1024 on an H100
    // (bench/results/archive/ab_tma_release_nvidia-h100-80gb-hbm3.json). Several short queries per tile
    // measured 7-10% slower that way (two tiles per document, and a block barrier per document
    // anyway), INT8 0-3% slower (its per-similarity arithmetic, not the barrier, holds it).
    // Split-d keeps a chunk's wgmma in flight past the next stage, so its slots go back by the
    // block barrier.
    static constexpr bool RELEASE = TMA && !MULTI && (!SCALED || TOKM) && !SPLIT;
    static_assert(!(MULTI && RELEASE), "several queries per tile sum a document's rows after the next stage's block barrier");
    static_assert(AHEAD >= 1, "split-d wgmma needs at least three stages");
    static_assert(!TOKM || (E::kInt && WG && TMA && SMALL_DOT && WARPS == 8 && BM == 128 && BN == 128 && !ARGMAX && !MULTI) ||
                      (LIK_REFINE && WG && TMA && WARPS == 4 && BM == 64 && BN == 64 && !ARGMAX && !MULTI && !LIK_CAND),
                  "tokens on M: INT8 two-warpgroup TMA tiles of 128 x 128, or refined float32 one-warpgroup TMA "
                  "tiles of 64 x 64; one query, no argmax");
    // Refined float32 tiles with the document tokens on M (fwd/refine_m.cuh).
    static constexpr bool REFINE_M = TOKM && LIK_REFINE;
    static constexpr int TOKM_OFFSET = 1 << 22;  // added to each dot product x: x + 2^22 is in (0, 2^23) while |x| < 2^22
    // Shared floats for a document's reduction, per buffer: the tokens-on-M row maxima of every
    // warp, several queries' row maxima, or per-warp sums.
    static constexpr int RED = TOKM ? WARPS * BM : MULTI ? BM : WARPS;
    // Floats after the reduction buffers: INT8 tokens-on-M tiles' query multipliers [BM]; refined ones'
    // column weights [2][BM] and their warps' exact jobs [WARPS][16][2] (ints; their two reduction
    // buffers hold the warps' bounds and column maxima).
    static constexpr int QMUL = REFINE_M ? 2 * BM + WARPS * 32 : TOKM ? BM : 0;
    // Packed single-query one-shot tiles of 16-bit or INT8 elements, and float32 wgmma tiles, may
    // split documents over CTAs (piece_role); FwdConfig.token_split says which. Not the mma.sync
    // fp32 tiles: with it the compile check found some of them spilling or over the registers their
    // launch plan assumes.
    static constexpr bool TSPLIT = PACKED && !MULTI && !TOKM && !SPLIT && (!TF32 || WG) && !LIK_RESIDUAL &&
                                   !LIK_CAND;
    // Refined argmax tiles split documents with each piece's residues (split_res), so that the merge
    // decides between pieces on exact values as a whole document's tile does.
    static constexpr bool EXACT_PIECES = LIK_REFINE && TSPLIT && ARGMAX;
    // Padded documents through the token split (LIK_STRIDED): Docs and DocMask read them as padded
    // kernels do, the shares place them at j * Ld (Offsets::stride).
    static constexpr bool STRIDED = LIK_STRIDED != 0;
    static_assert(!STRIDED || TSPLIT, "strided documents take the token split's tiles");
    // PLAID residual documents (fwd/residual.cuh): nbits per dim, or 0. The loader writes each
    // slot's tile itself after its copies land, one tile ahead of the MMA, so it needs a ring of
    // three stages at least; it reads whole 16-byte centroid chunks (VEC) into padded mma.sync tiles.
    static constexpr int RES = LIK_RESIDUAL;
    static constexpr bool CAND = LIK_CAND != 0;
    static_assert(RES == 0 || RES == 1 || RES == 2 || RES == 4, "LIK_RESIDUAL is 0 or nbits 1, 2 or 4");
    static_assert(!RES || (ESIZE == 2 && !WG && !TMA && !SPLIT && VEC && STAGES >= 3),
                  "residual tiles: fp16 or bf16 mma.sync one-shot tiles, 16-byte copies, three stages at least");
    static_assert(!CAND || (!MULTI && !TMA && !STRIDED), "candidate ids: one query per tile, cp.async, no token split");
    // Bytes of a slot's residual bits: BN rows of at most DP * RES / 8 bytes, copied from the
    // 16-byte boundary at or before the first (up to 15 bytes early), and read as whole words
    // (up to 12 bytes past the last).
    static constexpr int RBYTES = BN * DP * RES / 8 + 32;
#if LIK_HAS_WGMMA
    // The wgmma descriptor's low word of this warp's query rows in sQ (a warpgroup's 64 rows; tokens
    // on M: all BM rows), warp-uniform. Made once per CTA and held through the tile loop (QLO_HELD),
    // except by split-d, whose query chunks move with the stages, and by scaled (INT8) argmax tiles, whose
    // two-warpgroup tiles spilled holding it (compile check): those make it per tile.
    static constexpr bool QLO_HELD = WG && !SPLIT && !(SCALED && ARGMAX);
#endif

    // The kernel's body (maxsim_fwd.cu).
    static __device__ void run(const T* __restrict__ Q, const T* __restrict__ D, const float* __restrict__ q_scale,
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
    );

    // The role objects run builds, in the order it builds them (see the note in maxsim_fwd.cu): each
    // refers to the parameters and locals of run that its functions use.
    // fwd/tile_scheduler.cuh
    struct PieceCounts;  // token split: the scratch's counts for the next launch, no piece noted yet
    struct TileCount;    // BN-token tiles of a document of len tokens
    struct DocRange;     // a packed document's bounds from its offsets
    struct Docs;         // where a document starts in D, its tokens and tiles
    struct Shares;       // packed documents: the CTA's share of the corpus (and its pieces)
    struct LastTiles;    // the end of the tiles this CTA scores of a document of len tokens
    struct FirstTiles;   // the first of them
    struct DocTiles;     // the end of the tiles this CTA scores of its document j
    struct PieceRole;    // token split: whether a document is a piece, and which
    struct DocMask;      // a padded document's mask, if it has holes
    // fwd/mainloop.cuh
    struct SmemLayout;   // the dynamic shared memory's carve-up
    struct QueryTile;    // the query tile's first row and rows
    struct QueryStage;   // the query tile's copies and the TMA barriers
    struct Cursor;       // the producer's next (document, tile)
    struct Producer;     // stages the next tile into the ring
    struct Consumer;     // waits for a staged tile and refills the slot freed last
    // fwd/residual.cuh
    struct ResidualLoader;  // PLAID residual documents: gathers and decompresses a slot's tile
    // fwd/refine.cuh
    struct Refine;       // float32 accuracy from TF32 tiles: the rows' exact maxima
    // fwd/refine_m.cuh
    struct RefineM;      // the same with the document tokens on M: each column's exact maximum, per document
    // fwd/epilogue.cuh
    struct EmptyTile;    // a tile past its query's length: scores 0, argmax -1
    struct RowTerm;      // a query row's score term
    struct RowMax;       // the running row maxima and their fold
    struct SumRows;      // several queries' scores from their row maxima
    struct Flush;        // the pending document's row sums
    struct Finish;       // a document's score

    // ---- tile scheduler (fwd/tile_scheduler.cuh)
    static __device__ __forceinline__ int doc_len(const int* d_len, bool masked, i64 doclin, int Ld);
    static __device__ __forceinline__ i64 offset(const Offsets& off, i64 j);
    static __device__ __forceinline__ void first_docs_at(const Offsets& off, int n, i64 first, i64 work, i64 k, i64 x0,
                                                         i64 x1, int& j0, int& j1);
    static __device__ __forceinline__ void shares(const Offsets& off, i64 ntok, int Nd, i64 k, i64& t0, i64& work,
                                                  i64& per);

    // ---- mainloop (fwd/mainloop.cuh)
    static __device__ __forceinline__ int soff(int r, int k, int nrows);
    template <int NROWS>
    static __device__ __forceinline__ void load_rows(T* dst, const T* src, int avail, int stride, int cols);
    static __device__ __forceinline__ void load_a(u32 (&a)[4], const T* sQ, int row0, int kk, int lane);
    static __device__ __forceinline__ void load_a_x3(u32 (&hi)[4], u32 (&lo)[4], const T* sQ, int row0, int kk, int lane);
#if LIK_HAS_WGMMA
    static __device__ __forceinline__ u32 query_desc_lo(const T* sQ, int wrow0);
#endif
    static __device__ __forceinline__ void tile_mma(A (&acc)[MT][NN][4], const u32 (&qf)[QREG ? MT : 1][QREG ? NK : 1][4],
                                                    const T* sQ, const T* sD, int wrow0, int lane, bool add, u32 qlo,
                                                    float* tn = nullptr);

    // ---- epilogue (fwd/epilogue.cuh)
    template <int HALF>
    static __device__ __forceinline__ void scatter_max(float (&v)[TOKM ? NN : 1][2], int lane);
    static __device__ __forceinline__ void quad_max(float& v, int& ix);
    static __device__ __forceinline__ void quad_max(float& v, int& ix, float& r);
    static __device__ __forceinline__ void zero_floor(float& v, int& ix);
    static __device__ __forceinline__ float sim(A a, float sc);
    static __device__ __forceinline__ int query_len(const int* q_len, int qi, int Lq);
    static __device__ __forceinline__ void tile_rows(int qi0, int s0, int nqb, int span, int Lq, const int* q_len,
                                                     const u8* q_mask, int (&rq)[MT][2], int (&rs)[MT][2],
                                                     bool (&rv)[MT][2]);
    template <class Term>
    static __device__ __forceinline__ void score_single(const float (&best)[MT][2], const int (&bidx)[MT][2],
                                                        const float (&res)[MT][2], const bool (&rv)[MT][2],
                                                        const int (&rs)[MT][2], Term term,
                                                        float* rb, bool whole, bool zero_pad, float* out_j, int* amax_j,
                                                        void* split_buf, int role);
    static __device__ __noinline__ void complete_pieces(const int* info, void* split_buf, unsigned epoch, float* out,
                                                        int* amax, int Nq, int Nd, int Lq, int n_qt, const int* q_len,
                                                        const u8* q_mask, const float* q_scale, const u8* d_zero_pad,
                                                        int dl_qstride);
};

// The head of an out-of-class member definition: LIK_FWD_TEMPLATE ... LIK_FWD::name(...).
#define LIK_FWD_TEMPLATE                                                                                          \
    template <int ELEM, int DP, int WARPS, int MT, int BN, int STAGES, bool QREG, bool ARGMAX, bool VEC, bool WG, \
              bool MULTI, bool PACKED, bool SPLIT, bool TMA, bool QHALF, bool TOKM>
#define LIK_FWD Fwd<ELEM, DP, WARPS, MT, BN, STAGES, QREG, ARGMAX, VEC, WG, MULTI, PACKED, SPLIT, TMA, QHALF, TOKM>

}  // namespace lik
