// The forward's mainloop: the query tile (held in shared memory, or as mma fragments in
// registers), the ring of STAGES shared-memory slots that document tiles (split-d: query and
// document chunks) stream through by cp.async or TMA, and the mma.sync / wgmma product of one
// tile. The producer's cursor crosses document boundaries so the ring stays full across short
// documents; the consumer waits for a slot, refills the one freed last and multiplies. The
// structs are run's role objects (see maxsim_fwd.cu); their fields are references to run's locals.
#pragma once
#include "fwd/config.cuh"
#include "fwd/tile_scheduler.cuh"

namespace lik {

// Element offset of (row r, column k) in a staged tile of `nrows` rows. The
// wgmma layout splits the row into 128-byte column blocks and XORs the
// 16-byte chunk index with the row, the 128B swizzle the descriptors in
// wgmma.cuh declare.
LIK_FWD_TEMPLATE
__device__ __forceinline__ int LIK_FWD::soff(int r, int k, int nrows) {
    if (!SWZ) return r * LDS + k;
    const int kb = k / BLK, c = (k / EPC) & 7;
    return kb * nrows * BLK + r * BLK + ((c ^ (r & 7)) * EPC) + (k % EPC);
}

// Stage NROWS rows of `cols` elements (row stride `stride` in global) into a
// shared tile of DP columns; rows >= avail and columns >= cols become zero, so
// padded lanes never inject NaN/inf into the dot products.
LIK_FWD_TEMPLATE
template <int NROWS>
__device__ __forceinline__ void LIK_FWD::load_rows(T* dst, const T* src, int avail, int stride, int cols) {
    // When the threads tile the rows evenly, each thread keeps one column and steps
    // through rows RS apart: no division and one address add per 16-byte copy (the
    // copy issue, not the bytes, bounds the memory-bound shapes).
    constexpr int RS = NT / CPR;
    constexpr bool EVEN = VEC && NT % CPR == 0 && (NROWS * CPR) % NT == 0 && (!SWZ || RS % 8 == 0);
    if constexpr (EVEN) {
        const int r0 = threadIdx.x / CPR, k = (threadIdx.x - r0 * CPR) * EPC;
        const bool kok = k < cols;
        const T* s = src + (i64)r0 * stride + k;
        const u32 d0 = smem_addr(dst + soff(r0, k, NROWS));
        const i64 step = (i64)RS * stride;
#pragma unroll
        for (int i = 0; i < NROWS * CPR / NT; ++i) {
            const bool ok = kok && r0 + i * RS < avail;
            // Scaled tiles keep the address select (measured on INT8's): the ignore-src form took their padded
            // one-warpgroup tile to 132 registers, past the 128 of four CTAs per SM.
            if constexpr (SCALED) cp_async_16(d0 + i * RS * (SWZ ? BLK : LDS) * ESIZE, ok ? s : src, ok ? 16 : 0);
            else cp_async_16_or_zero(d0 + i * RS * (SWZ ? BLK : LDS) * ESIZE, s, ok);
            s += step;
        }
    } else if (VEC) {
        for (int c = threadIdx.x; c < NROWS * CPR; c += NT) {
            const int r = c / CPR, k = (c - r * CPR) * EPC;
            const bool ok = r < avail && k < cols;
            const T* s = ok ? src + (i64)r * stride + k : src;
            cp_async_16(smem_addr(dst + soff(r, k, NROWS)), s, ok ? 16 : 0);
        }
    } else {
        for (int e = threadIdx.x; e < NROWS * DP; e += NT) {
            const int r = e / DP, k = e - r * DP;
            T v = T(0);
            if (r < avail && k < cols) v = src[(i64)r * stride + k];
            dst[soff(r, k, NROWS)] = v;
        }
    }
}

// A fragments (16 query rows x one k step) for the tile rows starting at row0.
LIK_FWD_TEMPLATE
__device__ __forceinline__ void LIK_FWD::load_a(u32 (&a)[4], const T* sQ, int row0, int kk, int lane) {
    if (TF32) {
        const float* q = reinterpret_cast<const float*>(sQ);
        const int g = lane >> 2, t = lane & 3, k = kk * KSTEP + t;
        a[0] = to_tf32(q[(row0 + g) * LDS + k]);
        a[1] = to_tf32(q[(row0 + g + 8) * LDS + k]);
        a[2] = to_tf32(q[(row0 + g) * LDS + k + 4]);
        a[3] = to_tf32(q[(row0 + g + 8) * LDS + k + 4]);
    } else {
        const int r = row0 + (lane & 15), k = kk * KSTEP + (lane >> 4) * EPC;
        ldmatrix_x4(a, smem_addr(sQ + soff(r, k, BM)));
    }
}

// The same fp32 fragments split into their tf32 hi and lo parts (split_tf32), for 3xTF32.
LIK_FWD_TEMPLATE
__device__ __forceinline__ void LIK_FWD::load_a_x3(u32 (&hi)[4], u32 (&lo)[4], const T* sQ, int row0, int kk,
                                                   int lane) {
    const float* q = reinterpret_cast<const float*>(sQ);
    const int g = lane >> 2, t = lane & 3, k = kk * KSTEP + t;
    split_tf32(q[(row0 + g) * LDS + k], hi[0], lo[0]);
    split_tf32(q[(row0 + g + 8) * LDS + k], hi[1], lo[1]);
    split_tf32(q[(row0 + g) * LDS + k + 4], hi[2], lo[2]);
    split_tf32(q[(row0 + g + 8) * LDS + k + 4], hi[3], lo[3]);
}

#if LIK_HAS_WGMMA
LIK_FWD_TEMPLATE
__device__ __forceinline__ u32 LIK_FWD::query_desc_lo(const T* sQ, int wrow0) {
    return warp_uniform(wgmma_desc_lo(smem_addr(sQ) + (TOKM ? 0 : (wrow0 & ~63) * 128)));
}
#endif

// acc[m][n] (+)= Q_tile(warp rows) . D_tile^T over DP columns; `add` = 0 overwrites
// (the wgmma path; the mma.sync path always adds to zeroed accumulators). With
// WG_CHAIN the wgmma may still run on return (the previous one has finished). tn: refined TF32
// tiles' norm parts of this slot.
// qlo: query_desc_lo(sQ, wrow0) when QLO_HELD.
LIK_FWD_TEMPLATE
__device__ __forceinline__ void LIK_FWD::tile_mma(A (&acc)[MT][NN][4], const u32 (&qf)[QREG ? MT : 1][QREG ? NK : 1][4],
                                                  const T* sQ, const T* sD, int wrow0, int lane, bool add, u32 qlo,
                                                  float* tn) {
#if LIK_HAS_WGMMA
    if (WG) {
        A* d = &acc[0][0][0];
        if constexpr (TOKM) {
            // The warpgroup's 64 document tokens against all BM query rows, the first k step
            // overwriting the accumulators, then the offset added (the same integers as
            // accumulating onto it, which made ptxas serialize the wgmma instructions, C7520).
            const u32 dd0 = warp_uniform(wgmma_desc_lo(smem_addr(sD) + (threadIdx.x >> 7) * 64 * 128)),
                      dq0 = QLO_HELD ? qlo : query_desc_lo(sQ, wrow0);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < NK; ++kk) {
                const u32 ko = (kk & 3) * 32;
                wgmma_m64<ELEM, BM>(d, wgmma_desc_at(dd0 + (((kk >> 2) * BN * 128 + ko) >> 4)),
                                   wgmma_desc_at(dq0 + (((kk >> 2) * BM * 128 + ko) >> 4)), kk > 0);
            }
            wgmma_commit();
            // Refined float32: the squared norms of this thread's two tokens while the tensor cores
            // multiply (tn: two floats, fwd/refine_m.cuh).
#if LIK_REFINE
            RefineM::token_norms(sD, tn);
#endif
            wgmma_wait<0>();
            if constexpr (E::kInt) {
#pragma unroll
                for (int i = 0; i < MT * NN * 4; ++i) d[i] += TOKM_OFFSET;
            }
            return;
        }
        // The warpgroup's 64 query rows against all BN document rows, 32 bytes of K per instruction.
        // Each k step's descriptors: the tiles' low words plus a constant (wgmma_desc_lo), in
        // uniform registers (warp_uniform).
        const u32 dq0 = QLO_HELD ? qlo : query_desc_lo(sQ, wrow0), dd0 = warp_uniform(wgmma_desc_lo(smem_addr(sD)));
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < NK; ++kk) {
            const u32 ko = (kk & 3) * 32;  // byte offset of this k step inside a 128-byte row
            const unsigned long long dq = wgmma_desc_at(dq0 + (((kk >> 2) * (SPLIT ? QR : BM) * 128 + ko) >> 4));
            const unsigned long long dd = wgmma_desc_at(dd0 + (((kk >> 2) * BN * 128 + ko) >> 4));
            wgmma_m64<ELEM, BN>(d, dq, dd, kk > 0 || add);
        }
        wgmma_commit();
        // Refined TF32 tiles: the tile's row norms while the tensor cores multiply (tn: the slot's
        // per-warp parts, fwd/refine.cuh).
#if LIK_REFINE
        Refine::norm_part(sD, tn);
#endif
        // Split-d keeps this chunk's wgmma running while the next is staged; the caller waits
        // for the last one after its chunk loop (unconditionally, so ptxas sees it).
        if (WG_CHAIN) wgmma_wait<1>();
        else wgmma_wait<0>();
        return;
    }
#endif
    // Register-resident query fragments need every k step unrolled. Wide tf32 tiles that
    // re-read them from shared memory (48+ k steps of 8) spilled on sm_90 fully unrolled.
#pragma unroll(QREG || !TF32 ? NK : 16)
    for (int kk = 0; kk < NK; ++kk) {
        u32 a[MT][4], alo[X3 ? MT : 1][4];
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            if (QREG) {
#pragma unroll
                for (int r = 0; r < 4; ++r) a[m][r] = qf[QREG ? m : 0][QREG ? kk : 0][r];
            } else if (X3) {
                load_a_x3(a[m], alo[X3 ? m : 0], sQ, wrow0 + m * 16, kk, lane);
            } else {
                load_a(a[m], sQ, wrow0 + m * 16, kk, lane);
            }
        }
        if constexpr (TF32) {
            const float* d = reinterpret_cast<const float*>(sD);
            const int g = lane >> 2, t = lane & 3, k = kk * KSTEP + t;
#pragma unroll
            for (int n = 0; n < NN; ++n) {
                u32 b0, b1;
                if constexpr (X3) {
                    // The small products first, then hi * hi: lo * hi + hi * lo + hi * hi.
                    u32 l0, l1;
                    split_tf32(d[(n * 8 + g) * LDS + k], b0, l0);
                    split_tf32(d[(n * 8 + g) * LDS + k + 4], b1, l1);
#pragma unroll
                    for (int m = 0; m < MT; ++m) {
                        mma<ELEM>(acc[m][n], alo[X3 ? m : 0], b0, b1);
                        mma<ELEM>(acc[m][n], a[m], l0, l1);
                    }
                } else {
                    b0 = to_tf32(d[(n * 8 + g) * LDS + k]);
                    b1 = to_tf32(d[(n * 8 + g) * LDS + k + 4]);
                }
#pragma unroll
                for (int m = 0; m < MT; ++m) mma<ELEM>(acc[m][n], a[m], b0, b1);
            }
        } else {
            const int nr = (lane & 7) + ((lane >> 4) << 3), kc = kk * KSTEP + ((lane >> 3) & 1) * EPC;
#pragma unroll
            for (int np = 0; np < NN / 2; ++np) {
                u32 b[4];
                ldmatrix_x4(b, smem_addr(sD + soff(np * 16 + nr, kc, BN)));
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    mma<ELEM>(acc[m][2 * np], a[m], b[0], b[1]);
                    mma<ELEM>(acc[m][2 * np + 1], a[m], b[2], b[3]);
                }
            }
        }
    }
}

// Carves the dynamic shared memory.
LIK_FWD_TEMPLATE
struct LIK_FWD::SmemLayout {
    unsigned char* smem_raw;
    T*& sQ;
    T*& ring;
    float*& sS;
    float*& red;
    float*& qmul;
    unsigned long long*& mbar;
#if LIK_RESIDUAL
    u8*& rbuf;
    float*& rtab;
    int*& rcode;
#endif

    __device__ __forceinline__ void carve() const {
        // Swizzled tiles need 1024-byte alignment; the host adds that slack to the size.
        unsigned char* smem_base = SWZ ? smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023) : smem_raw;
        // One-shot: the query tile, then the ring of document tiles. Split-d: the ring
        // only, each stage a query chunk followed by a document chunk.
        sQ = reinterpret_cast<T*>(smem_base);
        ring = sQ + (SPLIT ? 0 : BM * LDS);
        sS = reinterpret_cast<float*>(ring + STAGES * STAGE);  // [STAGES][SCL] document token scales (scaled types)
        red = sS + STAGES * SCL;  // [2][RED]
        // TMA: [STAGES] "full" barriers (the slot's bytes landed), then [STAGES] "empty" ones (every
        // warp is done with the slot, so it may be refilled).
        // Tokens on M: [BM] per query row of the tile, 2^49 (undoing the conversion's scale) times
        // its INT8 scale (NaN for a negative scale), or -1 for a row that does not count; refined
        // float32 ones: QMUL floats of their own (fwd/refine_m.cuh).
        qmul = red + 2 * RED;
        mbar = reinterpret_cast<unsigned long long*>(qmul + QMUL);
#if LIK_RESIDUAL
        // Residual documents (fwd/residual.cuh), from the next 16-byte boundary: the bucket table
        // (128 bytes), the codes of the next two tiles to gather and each slot's byte shift, then
        // each slot's residual bytes.
        const int at = ((int)(reinterpret_cast<unsigned char*>(qmul) - smem_base) + 15) & ~15;
        rtab = reinterpret_cast<float*>(smem_base + at);
        rcode = reinterpret_cast<int*>(smem_base + at + 128);
        rbuf = smem_base + at + 128 + (((2 * BN + STAGES) * 4 + 15) & ~15);
#endif
    }
};

// The query tile: its first row in Q and its rows.
LIK_FWD_TEMPLATE
struct LIK_FWD::QueryTile {
    const T* __restrict__ const& Q;
    const int &qi0, &Lq, &s0, &dim;
    int& qb;
    const int& nqb;

    // The query tile (its first row, its rows) and, with packed documents, its copies sent
    // first, to land while the CTA finds its documents (a tile past its query's length loads
    // it unused and returns below). Padded ones load it later, as before: loaded here, six
    // kernels spilled (compile check).
    __device__ const T* query_tile() const { return Q + ((i64)qi0 * Lq + s0) * dim; }
    __device__ int query_rows() const { return qb > 1 ? nqb * Lq : min(BM, Lq - s0); }
};

// The query tile's copies (one-shot tiles that did not send them early), and the TMA barriers.
LIK_FWD_TEMPLATE
struct LIK_FWD::QueryStage {
    T* const& sQ;
    const T* const& Qt;
    const int &q_rows, &dim;
#if LIK_HAS_WGMMA
    unsigned long long* const& mbar;
#endif

    __device__ __forceinline__ void stage() const {
        constexpr bool EARLY_Q = PACKED && !SPLIT;
        if (!SPLIT && !EARLY_Q) load_rows<BM>(sQ, Qt, q_rows, dim, dim);
#if LIK_HAS_WGMMA
        if (TMA) {
            cp_async_commit();  // the query tile: its own group, awaited at the first stage
            if (threadIdx.x == 0) {
                for (int s = 0; s < STAGES; ++s) {
                    mbar_init(smem_addr(mbar + s), 1);
                    mbar_init(smem_addr(mbar + STAGES + s), WARPS);
                }
                mbar_init_fence();
            }
            __syncthreads();
        }
#endif
    }
};

// Producer cursor: next (document tile, dim chunk) to stage. It crosses
// document boundaries so the ring stays full across short documents.
// Padded documents: tile pt of document pj's pnt, its row and rows computed per tile.
// Packed documents instead keep prow (the row of D and of the INT8 scales where the next
// tile starts) and prem (the rows of pj this CTA stages from there on), from the
// document's offsets read once per document: reading and clamping both offsets in 64 bits
// per tile was a third of a one-query tile's instructions on 64-token documents, whose
// pace the issue of those instructions sets, not HBM (Nsight Compute, docs/kernels.md).
// Padded documents keep the per-tile form, 2.6% faster there
// (multi-query tiles, H100); prow and prem in place of pt and pnt cost packed tiles one
// register (holding a start and length beside pt and pnt spilled some).
LIK_FWD_TEMPLATE
struct LIK_FWD::Cursor {
    int& pj;
    const int& j1;
    int& pnt;
    const DocTiles& dt;
    const Docs& docs;
    const i64& doc0;
    const LastTiles& last;
    i64& prow;
    int &pt, &prem;
    const TileCount& lt;

    __device__ void enter() const {  // document pj, from tile pt
        if (pj >= j1) return;
        if (!PACKED) {
            pnt = dt.tiles(pj);
            return;
        }
        i64 begin;
        const int len = docs.doc_span(doc0 + pj, begin), n = last.tiles_of(pj, len);
        prow = begin + (i64)pt * BN;
        prem = (n < lt.len_tiles(len) ? n * BN : len) - pt * BN;  // a piece ends at whole tiles
    }
    __device__ bool staged_all() const { return PACKED ? prem <= 0 : pt >= pnt; }
};

// Stages the next (document tile, dim chunk) into its ring slot and moves the cursor on.
LIK_FWD_TEMPLATE
struct LIK_FWD::Producer {
    int& pj;
    const int& j1;
    int &pk, &prem;
    const Docs& docs;
    const i64& doc0;
    int& pt;
    i64& prow;
    T* const& ring;
#if LIK_HAS_WGMMA
    unsigned long long* const& mbar;  // TMA: [STAGES] "full" barriers, then [STAGES] "empty" ones
    const TmaDesc* const& tmq;
    const int &qi0, &Lq, &s0;
    const TmaDesc* const& tmd;
    const TmaDesc* const& tms;
#endif
    const T* const& Qt;
    const int &q_rows, &dim;
    const T* __restrict__ const& D;
    float* const& sS;  // document token scales (scaled types), per ring slot
    const float* __restrict__ const& d_scale;
    const int& nk;  // chunks of the dim per tile
    const Cursor& cur;
#if LIK_RESIDUAL
    const ResidualLoader& res;
#endif

    // Stage `stage` (counted from 0 over the whole run) goes to ring slot stage % STAGES, as
    // that slot's fill number stage / STAGES.
    __device__ void issue(int stage) const {
        const int slot = stage % STAGES;
#if LIK_RESIDUAL
        // The first stages' codes: published here, each behind a block barrier (later stages'
        // are published in next_stage, before the barrier it has anyway).
        if (stage < AHEAD) {
            res.publish(stage);
            __syncthreads();
        }
#endif
        if (pj < j1) {
            const int k0 = pk * DP, rows = min(BN, PACKED ? prem : docs.dlength(doc0 + pj) - pt * BN);
            const i64 row0 = PACKED ? prow : docs.dstart(doc0 + pj) + (i64)pt * BN;  // the tile's first row
            T* st = ring + slot * STAGE;
            if (TMA) {
#if LIK_HAS_WGMMA
                // Whole BN-row boxes: rows past this document's end are the next document's
                // tokens (or zeros past the tensor's end) and are masked in fold, as are
                // their scales. The map covers fewer than 2^31 rows (the host checks).
                if (threadIdx.x == 0) {
                    // The slot's previous fill must be released by every warp first.
                    if (RELEASE && stage >= STAGES) mbar_wait(smem_addr(mbar + STAGES + slot), (stage / STAGES - 1) & 1);
                    const u32 bar = smem_addr(mbar + slot);
                    const int row = (int)row0;
                    // Split-d: the stage is this chunk of the query tile, then of the document
                    // tile. Query rows past the tile's queries are other queries' tokens (or
                    // zeros past Q's end): their rows of the result are never read. Columns
                    // past dim are zeros (the maps end there).
                    const int col = k0 * ESIZE;
                    T* sd = st + (SPLIT ? BM * LDS : 0);
                    mbar_arrive_expect_tx(bar, (SPLIT ? BM + BN : BN) * DP * ESIZE + (SCALED ? (BN + 4) * 4 : 0));
#pragma unroll
                    for (int kb = 0; kb < DP / BLK; ++kb) {
                        if (SPLIT) tma_load_2d(smem_addr(st + kb * BM * BLK), tmq, col + kb * 128, qi0 * Lq + s0, bar);
                        tma_load_2d(smem_addr(sd + kb * BN * BLK), tmd, col + kb * 128, row, bar);
                    }
                    if constexpr (SCALED) tma_load_1d(smem_addr(sS + slot * SCL), tms, row & ~3, bar);
                }
#endif
            } else {
                if (SPLIT) load_rows<QR>(st, Qt + k0, q_rows, dim, dim - k0);
#if LIK_RESIDUAL
                res.gather(st, slot, stage, row0, rows);
#else
                load_rows<BN>(st + (SPLIT ? QR * LDS : 0), D + row0 * dim + k0, rows, dim,
                              dim - k0);
#endif
            }
            if constexpr (SCALED && !TMA) {
                const float* src = d_scale + row0;
                for (int c = threadIdx.x; c < BN; c += NT)
                    cp_async_4(smem_addr(sS + slot * SCL + c), c < rows ? src + c : d_scale, c < rows ? 4 : 0);
            }
            if (++pk == nk) {
                pk = 0;
                ++pt;
                prow += BN;
                prem -= BN;
                while (pj < j1 && cur.staged_all()) {
                    ++pj;
                    pt = 0;
                    cur.enter();
                }
#if LIK_RESIDUAL
                prefetch_codes();
#endif
            }
        }
        if (!TMA) cp_async_commit();  // one group per call, possibly empty: keeps wait_group counts exact
    }
#if LIK_RESIDUAL
    // Start loading the codes of the tile the cursor is at (the next one to stage).
    __device__ void prefetch_codes() const {
        if (pj < j1)
            res.prefetch(PACKED ? prow : docs.dstart(doc0 + pj) + (i64)pt * BN,
                         min(BN, PACKED ? prem : docs.dlength(doc0 + pj) - pt * BN));
    }
#endif
};

// Waits for the next staged tile and starts the refill of the slot freed last (next_stage); with
// RELEASE each warp hands a slot back itself (release_slot).
LIK_FWD_TEMPLATE
struct LIK_FWD::Consumer {
    int& cons;  // stages consumed so far
    u32 (&qf)[QREG ? MT : 1][QREG ? NK : 1][4];  // query fragments (QREG)
    bool& q_ready;
    T* const& sQ;
    const int &wrow0, &lane;
    const Producer& prod;
#if LIK_HAS_WGMMA
    unsigned long long* const& mbar;
#endif

    // Wait for the next staged tile, start the refill of a freed slot, return the tile's slot.
    __device__ int next_stage() const {
        // The barrier also tells the issuing threads that every warp is done with the slot they
        // refill (the one consumed last). RELEASE: each warp releases its slots (release_slot),
        // so only the query tile's copies need one barrier, before the first stage.
        if (!RELEASE || cons == 0) {
#if LIK_RESIDUAL
            // Residual tiles are decompressed one stage ahead of the MMA (fwd/residual.cuh): the
            // first tile here, behind a barrier of its own; then the one after this, once its
            // copies land (this barrier also publishes the tile decompressed last, and the codes
            // of the tile issued below).
            if (cons == 0) {
                cp_async_wait<AHEAD - 1>();
                __syncthreads();
                prod.res.decompress(0);
            }
            prod.res.publish(cons + AHEAD);
            cp_async_wait<AHEAD - 2>();
#else
            if (TMA) cp_async_wait<0>();
            else cp_async_wait<AHEAD - 1>();
#endif
#if LIK_HAS_WGMMA
            if (WG) fence_proxy_async();
#endif
            __syncthreads();
        }
        if (QREG && !q_ready) {
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int kk = 0; kk < NK; ++kk) load_a(qf[QREG ? m : 0][QREG ? kk : 0], sQ, wrow0 + m * 16, kk, lane);
            q_ready = true;
        }
        prod.issue(cons + AHEAD);
#if LIK_RESIDUAL
        prod.res.decompress((cons + 1) % STAGES);
#endif
#if LIK_HAS_WGMMA
        if (TMA) mbar_wait(smem_addr(mbar + cons % STAGES), (cons / STAGES) & 1);
#endif
        return cons++ % STAGES;
    }
    // RELEASE: this warp is done with the tile in `slot` (its MMA waited for, its scales read).
    __device__ void release_slot(int slot) const {
#if LIK_HAS_WGMMA
        if (RELEASE) {
            __syncwarp();
            if (lane == 0) mbar_arrive(smem_addr(mbar + STAGES + slot));
        }
#endif
    }
};

}  // namespace lik
