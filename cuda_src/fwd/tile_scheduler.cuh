// The forward's tile scheduler: which query tile a CTA takes (blockIdx.x) and which documents
// (blockIdx.y): a run of docs_per_cta padded documents, or for packed documents an equal share of
// the corpus's work, found by a CTA-wide search of the offsets (first_docs_at). With a token split
// (split_buf set) a document crossing a share's edge is scored in pieces of whole tiles by several
// CTAs; the scratch helpers here say where the pieces go (epilogue.cuh merges them). The structs
// are run's role objects (see maxsim_fwd.cu); their fields are references to run's locals.
#pragma once
#include "fwd/config.cuh"

namespace lik {

// Scratch of a token-split launch (split_buf), one buffer per stream (lik_cupy/_runtime/token_split.py):
// two arrays of LIK_SPLIT_COUNTS u32 arrival counts (one per launch parity, epoch & 1), then per
// (query tile, share, role) BM row maxima, then as many argmax indices (and refined tiles'
// residues). A launch counts in the array of its parity and zeroes the other for the next launch on
// the stream, so every count starts at zero whatever an earlier launch (or offsets that did not add
// up) left. The layout is fixed at compile time, so the tile loop finds a piece's slot from the
// kernel parameter alone.
#define LIK_SPLIT_COUNTS 4096  // = dispatch.SPLIT_MAX_CTAS: CTAs of one token-split launch at most
__device__ __forceinline__ unsigned* split_counts(void* buf, unsigned parity) {
    return static_cast<unsigned*>(buf) + parity * LIK_SPLIT_COUNTS;
}
__device__ __forceinline__ float* split_vals(void* buf) {
    return reinterpret_cast<float*>(static_cast<unsigned*>(buf) + 2 * LIK_SPLIT_COUNTS);
}
__device__ __forceinline__ int* split_idx(void* buf, int bm) {
    return reinterpret_cast<int*>(split_vals(buf) + (long long)gridDim.x * gridDim.y * 2 * bm);
}
// Refined TF32 argmax tiles (LIK_REFINE) only: then as many residues, each row max's exact float64
// value minus the float32 it is (fwd/refine.cuh), so that pieces whose maxima round to one float
// still merge to float64's argmax.
__device__ __forceinline__ float* split_res(void* buf, int bm) {
    return reinterpret_cast<float*>(split_idx(buf, bm) + (long long)gridDim.x * gridDim.y * 2 * bm);
}

// Slot `role` of share y's CTA of this query tile (row maxima of bm rows).
__device__ __forceinline__ long long piece_slot(int y, int role, int bm) {
    return (((long long)blockIdx.x * gridDim.y + y) * 2 + role) * bm;
}

// Add one arrival; returns the count before it. Release: this CTA's rows, written before the
// block barrier that precedes the call, are visible to whoever acquires the count; acquire: the
// rows of the CTAs counted before are visible to this CTA after the barrier that follows.
__device__ __forceinline__ unsigned arrive(unsigned* c) {
    unsigned old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(c) : "memory");
    return old;
}

// A padded document's tokens: the caller's length (clamped to [0, Ld]), or beside a mask
// (`masked`) the span lik_mask_spans derived from it: l >= 0 when the mask is l leading valid
// tokens (then not read at all), ~l when it has holes within its first l tokens.
LIK_FWD_TEMPLATE
__device__ __forceinline__ int LIK_FWD::doc_len(const int* d_len, bool masked, i64 doclin, int Ld) {
    if (!d_len) return Ld;
    int l = fwd_length(d_len, doclin);
    if (masked && l < 0) l = ~l;
    return l < 0 ? 0 : (l > Ld ? Ld : l);
}

// Document j's offset: its first token, or for strided (padded) documents its padded position.
LIK_FWD_TEMPLATE
__device__ __forceinline__ i64 LIK_FWD::offset(const Offsets& off, i64 j) {
    return STRIDED ? j * off.stride : off[j];
}

// The first documents in [0, n] whose work position off[j] + k * j (its first token, plus k
// for each document before it: see shares) is >= x0 and >= x1 (n if none), found by the whole
// CTA together. The first round tests the NT documents around where x would fall if the work
// were spread evenly over the documents (work runs from `first` for `work`), which settles it
// in one round unless lengths drift along the corpus; each later round tests one sample of
// each interval per thread, so ceil(log_NT(n)) rounds of loads replace two chains of log2(n)
// dependent ones (which every CTA waited through before its first tile: several microseconds
// on a one-query call). Offsets that decrease (an unchecked call) still give some j in [0, n].
LIK_FWD_TEMPLATE
__device__ __forceinline__ void LIK_FWD::first_docs_at(const Offsets& off, int n, i64 first, i64 work, i64 k, i64 x0,
                                                       i64 x1, int& j0, int& j1) {
    int lo0 = 0, hi0 = n, lo1 = 0, hi1 = n;
    auto below = [&](int i, i64 x) { return offset(off, i) + k * i < x; };  // document i's work position
    {
        auto window = [&](i64 x) -> int {
            const i64 t = min(max(x, first), first + work) - first;
            const int g = work > 0 ? (int)((float)t / (float)work * n) : 0;
            return min(max(g - NT / 2, 0), max(n - NT, 0));
        };
        const int w0 = window(x0), w1 = window(x1), wn = min(NT, n);
        const int i0 = w0 + (int)threadIdx.x, i1 = w1 + (int)threadIdx.x;
        const bool in = (int)threadIdx.x < wn;
        const bool p0 = in && below(i0, x0), p1 = in && below(i1, x1);
        const int c0 = __syncthreads_count(p0), c1 = __syncthreads_count(p1);
        // Window entries 0..c-1 lie below x, entry c (if any) does not.
        if (c0) lo0 = w0 + c0;
        if (c0 < wn) hi0 = w0 + c0;
        if (c1) lo1 = w1 + c1;
        if (c1 < wn) hi1 = w1 + c1;
    }
    while (lo0 < hi0 || lo1 < hi1) {  // CTA-uniform: every bound comes from block-wide counts
        const int st0 = (hi0 - lo0 + NT - 1) / NT, st1 = (hi1 - lo1 + NT - 1) / NT;
        const int i0 = lo0 + (int)threadIdx.x * st0, i1 = lo1 + (int)threadIdx.x * st1;
        const bool p0 = i0 < hi0 && below(i0, x0), p1 = i1 < hi1 && below(i1, x1);
        const int c0 = __syncthreads_count(p0), c1 = __syncthreads_count(p1);
        // Samples 0..c-1 lie below x, sample c (if any) does not.
        if (lo0 < hi0) {
            hi0 = min(hi0, lo0 + c0 * st0);
            lo0 = c0 ? lo0 + (c0 - 1) * st0 + 1 : lo0;
        }
        if (lo1 < hi1) {
            hi1 = min(hi1, lo1 + c1 * st1);
            lo1 = c1 ? lo1 + (c1 - 1) * st1 + 1 : lo1;
        }
    }
    j0 = lo0;
    j1 = lo1;
}

// Packed documents split into gridDim.y equal shares of work: a document's tokens plus k more
// (LIK_DOC_COST, or 0 to split tokens alone), for the padding of its last tile and its score
// cost a CTA about that much again whatever its length. Returned: where the work starts (the
// first token), all of it, and each share's (at least a tile, so every share between a
// document's first and last tile holds one of its tiles).
LIK_FWD_TEMPLATE
__device__ __forceinline__ void LIK_FWD::shares(const Offsets& off, i64 ntok, int Nd, i64 k, i64& t0, i64& work,
                                                i64& per) {
    const bool whole = STRIDED || off.whole;
    t0 = whole ? 0 : offset(off, 0);
    work = (whole ? ntok : offset(off, Nd)) - t0 + k * Nd;
    per = max((i64)BN, (work + gridDim.y - 1) / gridDim.y);
}

// Token split, at the start: no piece noted yet, and the other parity's counts zeroed for the next
// launch on this stream (all CTAs together).
LIK_FWD_TEMPLATE
struct LIK_FWD::PieceCounts {
    void* const& split_buf;
    const unsigned& split_epoch;
    int* piece_info;

    __device__ __forceinline__ void start() const {
        if (TSPLIT && split_buf) {
            if (threadIdx.x == 0) piece_info[0] = piece_info[1] = -1;
            // Zero the other parity's counts for the next launch on this stream (all CTAs together).
            unsigned* other = split_counts(split_buf, (split_epoch & 1) ^ 1);
            const int ctas = gridDim.x * gridDim.y, me = blockIdx.x * gridDim.y + blockIdx.y;
            for (int i = me + threadIdx.x * ctas; i < LIK_SPLIT_COUNTS; i += NT * ctas) other[i] = 0;
        }
    }
};

LIK_FWD_TEMPLATE
struct LIK_FWD::TileCount {  // no state: as the captureless lambda it was
    // BN-token tiles of a document of len tokens (in 64 bits: a packed document may hold up
    // to 2^31 - 1 tokens; 32-bit unsigned division spilled a split-d tile on sm_80).
    __device__ int len_tiles(int len) const { return (int)(((i64)len + BN - 1) / BN); }
};

// A packed document's bounds in D from its offsets, and its tiles starting before a token; with
// candidate ids, which document of D a candidate is.
LIK_FWD_TEMPLATE
struct LIK_FWD::DocRange {
    const Offsets& d_off;
    const i64& ntok;
#if LIK_CAND
    const CandSrc& cs;  // the candidate ids
#endif

    // Packed documents are clamped to [0, ntok): offsets the caller chose not to
    // validate can give wrong scores but never reach outside D.
    __device__ i64 doc_begin(i64 dl) const {
#if LIK_CAND
        const i64 id = cand_doc(dl);
        const i64 s = id < 0 ? 0 : d_off[id];
#else
        const i64 s = offset(d_off, dl);
#endif
        return s < 0 ? 0 : (s > ntok ? ntok : s);
    }
#if LIK_CAND
    __device__ i64 doc_end(i64 dl) const {
        const i64 id = cand_doc(dl);
        return id < 0 ? 0 : min(d_off[id + 1], ntok);
    }
    // Candidate dl's document in D, or -1 for an id outside its documents (nothing of it is
    // read, and Finish scores it NaN).
    __device__ i64 cand_doc(i64 dl) const {
        const i64 id = cs.wide ? static_cast<const i64*>(cs.ids)[dl] : static_cast<const int*>(cs.ids)[dl];
        return id >= 0 && id < cs.n_docs ? id : -1;
    }
#else
    __device__ i64 doc_end(i64 dl) const { return min(offset(d_off, dl + 1), ntok); }
#endif
    // Tiles of document dl starting before token x.
    __device__ int tiles_before(i64 dl, i64 x) const {
        const i64 n = x - doc_begin(dl);
        return n <= 0 ? 0 : (int)min((n + BN - 1) / BN, (i64)0x7fffffff);
    }
};

// Where a document starts in D and its tokens (padded, strided included: its length or mask
// span), and its tiles. dl: the document's index in D (a candidate's: doc0 + j; with candidate
// ids, the entry of the id array that names it).
LIK_FWD_TEMPLATE
struct LIK_FWD::Docs {
    const int& Ld;
    const DocRange& range;
    const int* __restrict__ const& d_len;
    const u8* __restrict__ const& d_mask;
    const TileCount& lt;

    __device__ i64 dstart(i64 dl) const {
#if LIK_CAND
        if (!PACKED) return max(range.cand_doc(dl), (i64)0) * Ld;
#endif
        if (!PACKED || STRIDED) return dl * Ld;
        return range.doc_begin(dl);
    }
    // Document dl's first row in D (begin) and its tokens, from one read of its offsets or
    // length (once per document: see the producer cursor, mainloop.cuh).
    __device__ int doc_span(i64 dl, i64& begin) const {
#if LIK_CAND
        if (!PACKED) {  // candidate dl is row id of D (an id outside D: no token)
            const i64 id = range.cand_doc(dl);
            begin = max(id, (i64)0) * Ld;
            return id < 0 ? 0 : doc_len(d_len, d_mask != nullptr, id, Ld);
        }
#endif
        begin = dstart(dl);
        if (!PACKED || STRIDED) return doc_len(d_len, d_mask != nullptr, dl, Ld);
        const i64 l = range.doc_end(dl) - begin;
        return l < 0 ? 0 : (l > 0x7fffffff ? 0x7fffffff : (int)l);
    }
    __device__ int dlength(i64 dl) const {
        i64 begin;
        return doc_span(dl, begin);
    }
    __device__ int doc_tiles(i64 dl) const { return lt.len_tiles(dlength(dl)); }
};

// Packed documents: the CTA's documents, those whose work position (shares) falls in its equal
// share of the work (ragged corpora then balance by work, not by document count).
// Token split (split_buf set): each CTA scores the document tiles whose first token lies
// in its share, so a document crossing a share's edge is scored in pieces of whole tiles by
// several CTAs, and the last of them to finish merges the pieces' row maxima (complete_pieces).
// Otherwise every document is scored whole by the CTA whose share holds its first token.
// head_tiles: tiles of document j0 scored before this share; tail_tiles: tiles of document
// j1 - 1 up to this share's end (two ints rather than the share's 64-bit bounds: registers
// are tight in the tile loop). Strided documents: j counts in the query's set of candidates
// (Offsets::base + j in D), as the work positions do.
LIK_FWD_TEMPLATE
struct LIK_FWD::Shares {
    const Offsets& d_off;
    const i64& ntok;
    const int &Nd, &docs_per_cta;
    void* const& split_buf;
    int &j0, &j1, &head_tiles, &tail_tiles;
    int* piece_info;
    const DocRange& range;
    const Docs& docs;

    // Tiles of the CTA's document j.
    __device__ __forceinline__ int tiles_of(int j) const { return docs.doc_tiles(STRIDED ? d_off.base + j : j); }

    __device__ __forceinline__ void assign() const {
        if (PACKED && !CAND) {  // candidate ids: runs of docs_per_cta, as padded documents
            // A token split places tiles by their first token, so its shares are of tokens alone.
            const i64 kdoc = TSPLIT && split_buf ? 0 : LIK_DOC_COST;
            i64 t0, work, per;
            shares(d_off, ntok, Nd, kdoc, t0, work, per);
            // The first CTA starts at document 0 and the last ends at Nd, whatever the offsets say.
            const i64 lowest = -0x7fffffffffffffffLL - 1, highest = 0x7fffffffffffffffLL;
            const i64 lo = blockIdx.y == 0 ? lowest : t0 + (i64)blockIdx.y * per;
            const i64 hi = blockIdx.y + 1 == gridDim.y ? highest : t0 + (i64)(blockIdx.y + 1) * per;
            first_docs_at(d_off, Nd, t0, work, kdoc, lo, hi, j0, j1);
            if (TSPLIT && split_buf) {
                // A split document's first and last share (those of its first tile's and its
                // last tile's first token), for complete_pieces.
                auto note = [&](int at, int j, int n) {
                    auto share = [&](i64 t) -> int {
                        const i64 y = t < t0 ? 0 : (t - t0) / per;
                        return (int)(y >= gridDim.y ? gridDim.y - 1 : y);
                    };
                    const i64 b = range.doc_begin(j);
                    piece_info[at] = j;
                    piece_info[2 + 2 * at] = share(b);
                    piece_info[3 + 2 * at] = share(b + (i64)(n - 1) * BN);
                };
                // The document begun in an earlier share, if one of its tiles starts in this one.
                if (j0 > 0 && blockIdx.y > 0) {
                    const int k = range.tiles_before(j0 - 1, lo), n = tiles_of(j0 - 1);
                    if (k < n) {
                        --j0;
                        head_tiles = k;
                        if (threadIdx.x == 0) note(0, j0, n);
                    }
                }
                if (j0 < j1 && blockIdx.y + 1 < gridDim.y) {
                    const int k = range.tiles_before(j1 - 1, hi), n = tiles_of(j1 - 1);
                    if (k < n) {  // otherwise whole here
                        tail_tiles = k;
                        // A CTA inside one document counts it once, as its head.
                        if (threadIdx.x == 0 && !(head_tiles > 0 && j1 - 1 == j0)) note(1, j1 - 1, n);
                    }
                }
            }
        } else {
            j0 = blockIdx.y * docs_per_cta;
            j1 = min(Nd, j0 + docs_per_cta);
        }
    }
};

// The end of the tiles this CTA scores of a document (a token split's tail piece ends early).
LIK_FWD_TEMPLATE
struct LIK_FWD::LastTiles {
    const TileCount& lt;
    const int &j1, &tail_tiles;

    // The end of document j's tiles in this CTA (its first: first_tile).
    __device__ int tiles_of(int j, int len) const {
        const int n = lt.len_tiles(len);
        return TSPLIT && j == j1 - 1 ? min(n, tail_tiles) : n;
    }
};

// The first tile this CTA scores of a document (a token split's head piece starts late).
LIK_FWD_TEMPLATE
struct LIK_FWD::FirstTiles {
    const int &j0, &head_tiles;

    __device__ int first_tile(int j) const { return TSPLIT && j == j0 ? head_tiles : 0; }
};

// The end of the tiles this CTA scores of its document j.
LIK_FWD_TEMPLATE
struct LIK_FWD::DocTiles {
    const LastTiles& last;
    const Docs& docs;
    const i64& doc0;

    __device__ int tiles(int j) const { return last.tiles_of(j, docs.dlength(doc0 + j)); }
};

// Token split: whether this CTA scores only some of a document's tiles, and which end.
LIK_FWD_TEMPLATE
struct LIK_FWD::PieceRole {
    const int &j0, &head_tiles, &j1, &tail_tiles;

    // Token split: a document whose tiles this CTA scores only some of is a piece (role 0: it
    // began in an earlier share, 1: it runs on past this one; a CTA has at most one of each).
    // Its rows go to this CTA's slot of the scratch instead of a score, and complete_pieces
    // merges them after the tile loop. -1: whole (always without a token split).
    __device__ int piece_role(int j) const {
        if (!TSPLIT) return -1;
        return j == j0 && head_tiles > 0 ? 0 : j == j1 - 1 && tail_tiles != 0x7fffffff ? 1 : -1;
    }
};

// A padded document's mask, when it has holes.
LIK_FWD_TEMPLATE
struct LIK_FWD::DocMask {
    const u8* __restrict__ const& d_mask;
    const int* __restrict__ const& d_len;
    const i64& doc0;
    const int& Ld;
#if LIK_CAND
    const DocRange& range;  // candidate j's row of D
#endif

    // Document j's mask, or null when every token of its span counts (INT8 argmax tiles read
    // it anyway: the test spilled their two-warpgroup tiles past 128 registers).
    __device__ const u8* dmask(int j) const {
#if LIK_CAND
        const i64 r = PACKED ? -1 : range.cand_doc(doc0 + j);  // an id outside D has no token to mask
        if (r < 0 || !d_mask || (!(SCALED && ARGMAX) && d_len && d_len[r] >= 0)) return nullptr;
        return d_mask + r * Ld;
#else
        if ((PACKED && !STRIDED) || !d_mask || (!(SCALED && ARGMAX) && d_len && d_len[doc0 + j] >= 0)) return nullptr;
        return d_mask + (doc0 + j) * Ld;
#endif
    }
};

}  // namespace lik
