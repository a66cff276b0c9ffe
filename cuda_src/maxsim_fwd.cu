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
// Compile-time configuration comes from -D flags chosen by lik_cupy/dispatch.py:
//   LIK_ELEM    0 fp16, 1 bf16 (m16n8k16), 2 fp32 inputs on tf32 m16n8k8, 3 INT8 (m16n8k32
//               or wgmma k32, int32 accumulators) with per-token float scales: each document
//               token's scale multiplies its int32 dot products before the max (one multiply
//               per similarity, no dequantised copy of D anywhere), each query token's scale
//               multiplies the max (scales are non-negative, so the max commutes with it)
//   LIK_DP      embedding dim padded to a multiple of 16 (32 for INT8; pad lanes are zero)
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
//   LIK_TOKM    1 (INT8, two warpgroups, TMA, 128 x 128 tiles, no argmax, one query per tile):
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
//   LIK_DOC_COST packed documents: tokens of work each document counts for beside its own when
//               the CTAs share the corpus out (see shares)
//   LIK_NAME    entry point name
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
#ifndef LIK_DOC_COST
#define LIK_DOC_COST 0
#endif

#ifndef LIK_WGMMA
#define LIK_WGMMA 0
#endif
#if (LIK_WGMMA || LIK_TMA) && !LIK_HAS_WGMMA
#error "LIK_WGMMA kernels must be compiled for sm_90a (the sm_90a feature set is not enabled)"
#endif

#ifndef LIK_NAME
#error "LIK_NAME and the tile macros are set by lik_cupy.dispatch"
#endif

namespace lik {

// Scratch of a token-split launch (split_buf), one buffer per stream (lik_cupy/token_split.py):
// two arrays of LIK_SPLIT_COUNTS u32 arrival counts (one per launch parity, epoch & 1), then per
// (query tile, share, role) BM row maxima, then as many argmax indices. A launch counts in the
// array of its parity and zeroes the other for the next launch on the stream, so every count
// starts at zero whatever an earlier launch (or offsets that did not add up) left. The layout is
// fixed at compile time, so the tile loop finds a piece's slot from the kernel parameter alone.
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

template <int ELEM>
struct Elem;
template <>
struct Elem<0> { typedef u16 T; };
template <>
struct Elem<1> { typedef u16 T; };
template <>
struct Elem<2> { typedef float T; };
template <>
struct Elem<3> { typedef i8 T; };

template <bool I8>
struct Acc { typedef float T; };
template <>
struct Acc<true> { typedef int T; };  // INT8 mma accumulates in int32

template <int ELEM, int DP, int WARPS, int MT, int BN, int STAGES, bool QREG, bool ARGMAX, bool VEC, bool WG,
          bool MULTI, bool PACKED, bool SPLIT, bool TMA, bool QHALF, bool TOKM>
struct Fwd {
    typedef typename Elem<ELEM>::T T;
    static constexpr bool I8 = ELEM == 3;
    typedef typename Acc<I8>::T A;
    static constexpr int ESIZE = sizeof(T);
    static constexpr int EPC = 16 / ESIZE;      // elements per 16-byte chunk
    static constexpr int BLK = 128 / ESIZE;     // elements per 128-byte swizzle row (wgmma)
    // Tiles are 128B-swizzled for wgmma (which reads them so) and for TMA (which writes them so;
    // the swizzle keeps ldmatrix conflict-free too); other tiles pad each row instead.
    static constexpr bool SWZ = WG || TMA;
    static constexpr int LDS = SWZ ? DP : DP + EPC;  // row stride: padded rows keep ldmatrix / lds conflict-free
    static constexpr int KSTEP = ELEM == 2 ? 8 : I8 ? 32 : 16;  // 32 bytes of K per mma (16 for tf32)
    static constexpr int NK = DP / KSTEP;
    static constexpr int BM = WARPS * MT * 16;
    static constexpr int NT = WARPS * 32;
    static constexpr int NN = BN / 8;           // n8 accumulator tiles per row block
    static constexpr int CPR = DP / EPC;        // 16-byte chunks per row
    static_assert(DP % 16 == 0, "DP must be a multiple of 16");
    static_assert(BN % 16 == 0, "BN must be a multiple of 16");
    static_assert(STAGES >= 2, "need at least two stages");
    static_assert(!WG || (MT == 1 && (WARPS == 4 || WARPS == 8) && DP * ESIZE % 128 == 0 && ELEM != 2 && !QREG), "wgmma tile shape");
    static_assert(!SPLIT || !QREG, "split-d re-reads query chunks from shared memory");
    static_assert(!I8 || (!SPLIT && DP % 32 == 0), "INT8 runs one-shot with DP a multiple of 32");
    static_assert(!TMA || (ELEM != 2 && DP * ESIZE % 128 == 0 && (!SPLIT || WG)),
                  "TMA feeds one-shot 16-bit and INT8 tiles and split-d wgmma tiles");
    static_assert(!QHALF || (SPLIT && WG && !TMA && !MULTI && WARPS == 4), "half query stages: one-warpgroup split-d tiles");
    static constexpr int QR = QHALF ? 32 : BM;  // query rows staged per split-d stage
    static constexpr int STAGE = SPLIT ? (QR + BN) * LDS : BN * LDS;  // elements per ring stage
    // Document token scales staged per ring stage (floats); TMA boxes of BN + 4 in slots of
    // 128-byte multiples.
    static constexpr int SCL = I8 ? (TMA ? BN + 32 : BN) : 0;
    static_assert(!(TMA && I8) || BN + 4 <= 256, "a TMA box holds at most 256 scales");
    // INT8 dot products stay below 2^22 in magnitude while DP * 128 * 128 does, and then
    // convert with two full-rate ops instead of one quarter-rate I2F.
    static constexpr bool SMALL_DOT = DP * 128 * 128 < (1 << 22);
    // Stages loading ahead of the one consumed. Hopper split-d leaves one chunk's wgmma in
    // flight while the next is issued, so the slot it reads is not refilled yet.
    static constexpr bool WG_CHAIN = WG && SPLIT;
    static constexpr int AHEAD = WG_CHAIN ? STAGES - 2 : STAGES - 1;
    // 16-bit TMA tiles of one query free each ring slot by per-warp arrivals on an "empty"
    // mbarrier instead of a block barrier per tile: 5-6% faster at Lq = 200..1024 on an H100
    // (bench/results/ab_tma_release_nvidia-h100-80gb-hbm3.json). Several short queries per tile
    // measured 7-10% slower that way (two tiles per document, and a block barrier per document
    // anyway), INT8 0-3% slower (its per-similarity arithmetic, not the barrier, holds it).
    // Split-d keeps a chunk's wgmma in flight past the next stage, so its slots go back by the
    // block barrier.
    static constexpr bool RELEASE = TMA && !MULTI && (!I8 || TOKM) && !SPLIT;
    static_assert(!(MULTI && RELEASE), "several queries per tile sum a document's rows after the next stage's block barrier");
    static_assert(AHEAD >= 1, "split-d wgmma needs at least three stages");
    static_assert(!TOKM || (I8 && WG && TMA && SMALL_DOT && WARPS == 8 && BM == 128 && BN == 128 && !ARGMAX && !MULTI),
                  "tokens on M: INT8 two-warpgroup TMA tiles of 128 x 128, one query, no argmax");
    static constexpr int TOKM_OFFSET = 1 << 22;  // accumulator start: x + 2^22 is in (0, 2^23) while |x| < 2^22
    // Shared floats for a document's reduction, per buffer: the tokens-on-M row maxima of every
    // warp, several queries' row maxima, or per-warp sums.
    static constexpr int RED = TOKM ? WARPS * BM : MULTI ? BM : WARPS;
    // Packed single-query one-shot tiles of 16-bit elements may split documents over CTAs
    // (piece_role); dispatch.FwdConfig.token_split says which. Not fp32 (tf32) or INT8 tiles:
    // with it the compile check found some of them spilling or over the registers their launch
    // plan assumes.
    static constexpr bool TSPLIT = PACKED && !MULTI && !TOKM && !SPLIT && (ELEM == 0 || ELEM == 1);

    // Element offset of (row r, column k) in a staged tile of `nrows` rows. The
    // wgmma layout splits the row into 128-byte column blocks and XORs the
    // 16-byte chunk index with the row, the 128B swizzle the descriptors in
    // wgmma.cuh declare.
    static __device__ __forceinline__ int soff(int r, int k, int nrows) {
        if (!SWZ) return r * LDS + k;
        const int kb = k / BLK, c = (k / EPC) & 7;
        return kb * nrows * BLK + r * BLK + ((c ^ (r & 7)) * EPC) + (k % EPC);
    }

    // Stage NROWS rows of `cols` elements (row stride `stride` in global) into a
    // shared tile of DP columns; rows >= avail and columns >= cols become zero, so
    // padded lanes never inject NaN/inf into the dot products.
    template <int NROWS>
    static __device__ __forceinline__ void load_rows(T* dst, const T* src, int avail, int stride, int cols) {
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
                // INT8 tiles keep the address select: the ignore-src form took their padded
                // one-warpgroup tile to 132 registers, past the 128 of four CTAs per SM.
                if constexpr (I8) cp_async_16(d0 + i * RS * (SWZ ? BLK : LDS) * ESIZE, ok ? s : src, ok ? 16 : 0);
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
    static __device__ __forceinline__ void load_a(u32 (&a)[4], const T* sQ, int row0, int kk, int lane) {
        if (ELEM == 2) {
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

#if LIK_HAS_WGMMA
    // The wgmma descriptor's low word of this warp's query rows in sQ (a warpgroup's 64 rows; tokens
    // on M: all BM rows), warp-uniform. Made once per CTA and held through the tile loop (QLO_HELD),
    // except by split-d, whose query chunks move with the stages, and by INT8 argmax tiles, whose
    // two-warpgroup tiles spilled holding it (compile check): those make it per tile.
    static constexpr bool QLO_HELD = WG && !SPLIT && !(I8 && ARGMAX);
    static __device__ __forceinline__ u32 query_desc_lo(const T* sQ, int wrow0) {
        return warp_uniform(wgmma_desc_lo(smem_addr(sQ) + (TOKM ? 0 : (wrow0 & ~63) * 128)));
    }
#endif

    // acc[m][n] (+)= Q_tile(warp rows) . D_tile^T over DP columns; `add` = 0 overwrites
    // (the wgmma path; the mma.sync path always adds to zeroed accumulators). With
    // WG_CHAIN the wgmma may still run on return (the previous one has finished).
    // qlo: query_desc_lo(sQ, wrow0) when QLO_HELD.
    static __device__ __forceinline__ void tile_mma(A (&acc)[MT][NN][4], const u32 (&qf)[QREG ? MT : 1][QREG ? NK : 1][4],
                                                    const T* sQ, const T* sD, int wrow0, int lane, bool add, u32 qlo) {
#if LIK_HAS_WGMMA
        if (WG) {
            A* d = &acc[0][0][0];
            if constexpr (TOKM) {
                // The warpgroup's 64 document tokens against all BM query rows, onto the offset.
                const u32 dd0 = warp_uniform(wgmma_desc_lo(smem_addr(sD) + (threadIdx.x >> 7) * 64 * 128)),
                          dq0 = QLO_HELD ? qlo : query_desc_lo(sQ, wrow0);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < NK; ++kk) {
                    const u32 ko = (kk & 3) * 32;
                    wgmma_s8_m64k32<BM>(d, wgmma_desc_at(dd0 + (((kk >> 2) * BN * 128 + ko) >> 4)),
                                        wgmma_desc_at(dq0 + (((kk >> 2) * BM * 128 + ko) >> 4)), 1);
                }
                wgmma_commit();
                wgmma_wait<0>();
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
                if constexpr (I8) wgmma_s8_m64k32<BN>(d, dq, dd, kk > 0 || add);
                else wgmma_m64k16<ELEM, BN>(d, dq, dd, kk > 0 || add);
            }
            wgmma_commit();
            // Split-d keeps this chunk's wgmma running while the next is staged; the caller waits
            // for the last one after its chunk loop (unconditionally, so ptxas sees it).
            if (WG_CHAIN) wgmma_wait<1>();
            else wgmma_wait<0>();
            return;
        }
#endif
        // Register-resident query fragments need every k step unrolled. Wide tf32 tiles that
        // re-read them from shared memory (48+ k steps of 8) spilled on sm_90 fully unrolled.
#pragma unroll(QREG || ELEM != 2 ? NK : 16)
        for (int kk = 0; kk < NK; ++kk) {
            u32 a[MT][4];
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                if (QREG) {
#pragma unroll
                    for (int r = 0; r < 4; ++r) a[m][r] = qf[QREG ? m : 0][QREG ? kk : 0][r];
                } else {
                    load_a(a[m], sQ, wrow0 + m * 16, kk, lane);
                }
            }
            if constexpr (ELEM == 2) {
                const float* d = reinterpret_cast<const float*>(sD);
                const int g = lane >> 2, t = lane & 3, k = kk * KSTEP + t;
#pragma unroll
                for (int n = 0; n < NN; ++n) {
                    const u32 b0 = to_tf32(d[(n * 8 + g) * LDS + k]);
                    const u32 b1 = to_tf32(d[(n * 8 + g) * LDS + k + 4]);
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
                        if constexpr (I8) {
                            mma_s8(acc[m][2 * np], a[m], b[0], b[1]);
                            mma_s8(acc[m][2 * np + 1], a[m], b[2], b[3]);
                        } else {
                            mma<ELEM>(acc[m][2 * np], a[m], b[0], b[1]);
                            mma<ELEM>(acc[m][2 * np + 1], a[m], b[2], b[3]);
                        }
                    }
                }
            }
        }
    }

    // One halving exchange of a tokens-on-M reduce-scatter: lanes HALF apart swap halves of the
    // first 2 * HALF flat entries of v (v[n][e] is entry 2n + e) and keep the max of the half
    // they hold: the lane with bit HALF set keeps the upper one, in entries 0 .. HALF - 1.
    template <int HALF>
    static __device__ __forceinline__ void scatter_max(float (&v)[TOKM ? NN : 1][2], int lane) {
        const bool up = lane & HALF;
#pragma unroll
        for (int i = 0; i < HALF; ++i) {
            const float lo = v[i / 2][i % 2], hi = v[(i + HALF) / 2][(i + HALF) % 2];
            v[i / 2][i % 2] = max_nan(up ? hi : lo, __shfl_xor_sync(0xffffffffu, up ? lo : hi, HALF));
        }
    }

    // A padded document's tokens: the caller's length (clamped to [0, Ld]), or beside a mask
    // (`masked`) the span lik_mask_spans derived from it: l >= 0 when the mask is l leading valid
    // tokens (then not read at all), ~l when it has holes within its first l tokens.
    static __device__ __forceinline__ int doc_len(const int* d_len, bool masked, i64 doclin, int Ld) {
        if (!d_len) return Ld;
        int l = d_len[doclin];
        if (masked && l < 0) l = ~l;
        return l < 0 ? 0 : (l > Ld ? Ld : l);
    }

    // Max (and argmax) across the four lanes of a quad, which share an accumulator row.
    static __device__ __forceinline__ void quad_max(float& v, int& ix) {
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

    // The first documents in [0, n] whose work position off[j] + k * j (its first token, plus k
    // for each document before it: see shares) is >= x0 and >= x1 (n if none), found by the whole
    // CTA together. The first round tests the NT documents around where x would fall if the work
    // were spread evenly over the documents (work runs from `first` for `work`), which settles it
    // in one round unless lengths drift along the corpus; each later round tests one sample of
    // each interval per thread, so ceil(log_NT(n)) rounds of loads replace two chains of log2(n)
    // dependent ones (which every CTA waited through before its first tile: several microseconds
    // on a one-query call). Offsets that decrease (an unchecked call) still give some j in [0, n].
    static __device__ __forceinline__ void first_docs_at(const Offsets& off, int n, i64 first, i64 work, i64 k, i64 x0,
                                                         i64 x1, int& j0, int& j1) {
        int lo0 = 0, hi0 = n, lo1 = 0, hi1 = n;
        auto below = [&](int i, i64 x) { return off[i] + k * i < x; };  // document i's work position
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

    // A similarity from its accumulator: the float itself, or for INT8 the integer dot product
    // times its document token's scale `sc`.
    static __device__ __forceinline__ float sim(A a, float sc) {
        if constexpr (I8) return (SMALL_DOT ? i2f_small(a) : __int2float_rn(a)) * sc;
        else return a;
    }

    // Packed documents split into gridDim.y equal shares of work: a document's tokens plus k more
    // (LIK_DOC_COST, or 0 to split tokens alone), for the padding of its last tile and its score
    // cost a CTA about that much again whatever its length. Returned: where the work starts (the
    // first token), all of it, and each share's (at least a tile, so every share between a
    // document's first and last tile holds one of its tiles).
    static __device__ __forceinline__ void shares(const Offsets& off, i64 ntok, int Nd, i64 k, i64& t0, i64& work,
                                                  i64& per) {
        t0 = off.whole ? 0 : off[0];
        work = (off.whole ? ntok : off[Nd]) - t0 + k * Nd;
        per = max((i64)BN, (work + gridDim.y - 1) / gridDim.y);
    }

    // Query qi's length: its q_len entry clamped to [0, Lq], or Lq without lengths.
    static __device__ __forceinline__ int query_len(const int* q_len, int qi, int Lq) {
        if (!q_len) return Lq;
        const int l = q_len[qi];
        return l < 0 ? 0 : (l > Lq ? Lq : l);
    }

    // The 2*MT tile rows this thread reduces, of a tile whose rows start at row s0 of query qi0
    // and hold nqb whole queries of `span` rows (MULTI) or rows of one query: their query
    // (relative to qi0), token (-1: padding row past the queries) and validity.
    static __device__ __forceinline__ void tile_rows(int qi0, int s0, int nqb, int span, int Lq, const int* q_len,
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
    template <class Term>
    static __device__ __forceinline__ void score_single(const float (&best)[MT][2], const int (&bidx)[MT][2],
                                                        const bool (&rv)[MT][2], const int (&rs)[MT][2], Term term,
                                                        float* rb, bool whole, float* out_j, int* amax_j, void* split_buf,
                                                        int role) {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
        float part = 0.f;
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float v = best[m][h];
                int ix = bidx[m][h];
                quad_max(v, ix);
                if (rv[m][h]) part += term(v, m, h);
                if (tq == 0) {
                    if (ARGMAX && whole && rs[m][h] >= 0) amax_j[rs[m][h]] = rv[m][h] ? ix : -1;
                    if (TSPLIT && !whole) {
                        const i64 at = piece_slot(blockIdx.y, role, BM) + warp * MT * 16 + m * 16 + g + 8 * h;
                        split_vals(split_buf)[at] = v;
                        if (ARGMAX) split_idx(split_buf, BM)[at] = ix;
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
    // scores a whole document (same code, same order: the bits of an unsplit run). Out of line,
    // so the tile loop's registers do not grow with it.
    static __device__ __noinline__ void complete_pieces(const int* info, void* split_buf, unsigned epoch, float* out,
                                                        int* amax, int Nq,
                                                        int Nd, int Lq, int n_qt, const int* q_len, const u8* q_mask) {
        static_assert(TSPLIT && !I8, "only 16-bit single-query tiles split documents: a score term is the row max");
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
        auto term = [](float v, int, int) { return v; };  // as run's term for 16-bit tiles
        // Both documents' pieces first, then their scores (the loads are not held up by the
        // scores' block barriers).
        float best[2][MT][2];
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
                    float v = LIK_NEG_INF;
                    int ix = -1;
#pragma unroll 4
                    for (int y = y0; y <= y1; ++y) {
                        const i64 at = piece_slot(y, y == y0 ? 1 : 0, BM) + row;
                        const float pv = __ldcg(vals + at);  // L2: other SMs wrote it
                        if (ARGMAX) argmax_merge(v, ix, pv, __ldcg(idx + at));
                        else v = max_nan(v, pv);
                    }
                    best[role][m][h] = v;
                    bidx[role][m][h] = ix;
                }
        }
#pragma unroll
        for (int role = 0; role < 2; ++role) {
            if (!last[role]) continue;
            const int j = info[role];
            score_single(best[role], bidx[role], rv, rs, term, rb[role], true, outp + j,
                         ARGMAX ? amax + ((i64)qi0 * Nd + j) * Lq : nullptr, nullptr, 0);
        }
    }

    static __device__ void run(const T* __restrict__ Q, const T* __restrict__ D, const float* __restrict__ q_scale,
                               const float* __restrict__ d_scale, const int* __restrict__ q_len,
                               const u8* __restrict__ q_mask, const int* __restrict__ d_len,
                               const u8* __restrict__ d_mask, const Offsets d_off, i64 ntok,
                               float* __restrict__ out,
                               int* __restrict__ amax, int Nq, int Nd, int Lq, int Ld, int dim, int n_qt, int qb,
                               int docs_per_cta, int dl_qstride, void* split_buf, unsigned split_epoch, const TmaDesc* tmd,
                               const TmaDesc* tms, const TmaDesc* tmq) {
        extern __shared__ __align__(16) unsigned char smem_raw[];
        __shared__ int piece_info[TSPLIT ? 6 : 1];  // token split: complete_pieces' info
        if (TSPLIT && split_buf) {
            if (threadIdx.x == 0) piece_info[0] = piece_info[1] = -1;
            // Zero the other parity's counts for the next launch on this stream (all CTAs together).
            unsigned* other = split_counts(split_buf, (split_epoch & 1) ^ 1);
            const int ctas = gridDim.x * gridDim.y, me = blockIdx.x * gridDim.y + blockIdx.y;
            for (int i = me + threadIdx.x * ctas; i < LIK_SPLIT_COUNTS; i += NT * ctas) other[i] = 0;
        }
        // Swizzled tiles need 1024-byte alignment; the host adds that slack to the size.
        unsigned char* smem_base = SWZ ? smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023) : smem_raw;
        // One-shot: the query tile, then the ring of document tiles. Split-d: the ring
        // only, each stage a query chunk followed by a document chunk.
        T* sQ = reinterpret_cast<T*>(smem_base);
        T* ring = sQ + (SPLIT ? 0 : BM * LDS);
        float* sS = reinterpret_cast<float*>(ring + STAGES * STAGE);  // [STAGES][SCL] INT8 document scales
        float* red = sS + STAGES * SCL;  // [2][RED]
        // TMA: [STAGES] "full" barriers (the slot's bytes landed), then [STAGES] "empty" ones (every
        // warp is done with the slot, so it may be refilled).
        // Tokens on M: [BM] per query row of the tile, 2^49 (undoing the conversion's scale) times
        // its INT8 scale (NaN for a negative scale), or -1 for a row that does not count.
        float* qmul = red + 2 * RED;
        unsigned long long* mbar = reinterpret_cast<unsigned long long*>(qmul + (TOKM ? BM : 0));

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
        auto query_tile = [&]() { return Q + ((i64)qi0 * Lq + s0) * dim; };
        auto query_rows = [&]() { return qb > 1 ? nqb * Lq : min(BM, Lq - s0); };
        constexpr bool EARLY_Q = PACKED && !SPLIT;
        if (EARLY_Q) load_rows<BM>(sQ, query_tile(), query_rows(), dim, dim);

        // Packed documents are clamped to [0, ntok): offsets the caller chose not to
        // validate can give wrong scores but never reach outside D.
        auto doc_begin = [&](i64 dl) -> i64 {
            const i64 s = d_off[dl];
            return s < 0 ? 0 : (s > ntok ? ntok : s);
        };
        auto doc_end = [&](i64 dl) -> i64 { return min(d_off[dl + 1], ntok); };
        auto dstart = [&](i64 dl) -> i64 {
            if (!PACKED) return dl * Ld;
            return doc_begin(dl);
        };
        // Document dl's first row in D (begin) and its tokens, from one read of its offsets or
        // length (once per document: see the producer cursor below).
        auto doc_span = [&](i64 dl, i64& begin) -> int {
            begin = dstart(dl);
            if (!PACKED) return doc_len(d_len, d_mask != nullptr, dl, Ld);
            const i64 l = doc_end(dl) - begin;
            return l < 0 ? 0 : (l > 0x7fffffff ? 0x7fffffff : (int)l);
        };
        auto dlength = [&](i64 dl) -> int {
            i64 begin;
            return doc_span(dl, begin);
        };
        // BN-token tiles of a document of len tokens (in 64 bits: a packed document may hold up
        // to 2^31 - 1 tokens; 32-bit unsigned division spilled a split-d tile on sm_80).
        auto len_tiles = [](int len) { return (int)(((i64)len + BN - 1) / BN); };
        auto doc_tiles = [&](i64 dl) { return len_tiles(dlength(dl)); };
        // Documents of this CTA: a run of docs_per_cta, or for packed documents the
        // documents whose work position (shares) falls in this CTA's equal share of the work
        // (ragged corpora then balance by work, not by document count).
        int j0, j1;
        // Token split (split_buf set): each CTA scores the document tiles whose first token lies
        // in its share, so a document crossing a share's edge is scored in pieces of whole tiles by
        // several CTAs, and the last of them to finish merges the pieces' row maxima (complete_pieces).
        // Otherwise every document is scored whole by the CTA whose share holds its first token.
        // head_tiles: tiles of document j0 scored before this share; tail_tiles: tiles of document
        // j1 - 1 up to this share's end (two ints rather than the share's 64-bit bounds: registers
        // are tight in the tile loop).
        int head_tiles = 0, tail_tiles = 0x7fffffff;
        // Tiles of document dl starting before token x.
        auto tiles_before = [&](i64 dl, i64 x) -> int {
            const i64 n = x - doc_begin(dl);
            return n <= 0 ? 0 : (int)min((n + BN - 1) / BN, (i64)0x7fffffff);
        };
        if (PACKED) {
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
                    const i64 b = doc_begin(j);
                    piece_info[at] = j;
                    piece_info[2 + 2 * at] = share(b);
                    piece_info[3 + 2 * at] = share(b + (i64)(n - 1) * BN);
                };
                // The document begun in an earlier share, if one of its tiles starts in this one.
                if (j0 > 0 && blockIdx.y > 0) {
                    const int k = tiles_before(j0 - 1, lo), n = doc_tiles(j0 - 1);
                    if (k < n) {
                        --j0;
                        head_tiles = k;
                        if (threadIdx.x == 0) note(0, j0, n);
                    }
                }
                if (j0 < j1 && blockIdx.y + 1 < gridDim.y) {
                    const int k = tiles_before(j1 - 1, hi), n = doc_tiles(j1 - 1);
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
        if (j0 >= j1) {
            if (EARLY_Q) cp_async_wait<0>();
            return;
        }

        auto query_len = [&](int qi) { return Fwd::query_len(q_len, qi, Lq); };
        const i64 doc0 = (i64)qi0 * dl_qstride;  // linear index of this tile's document 0

        float* outp = out + (n_qt > 1 ? (i64)qt * Nq * Nd : 0) + (i64)qi0 * Nd;
        // The end of document j's tiles in this CTA (its first: first_tile).
        auto tiles_of = [&](int j, int len) {
            const int n = len_tiles(len);
            return TSPLIT && j == j1 - 1 ? min(n, tail_tiles) : n;
        };
        auto tiles = [&](int j) { return tiles_of(j, dlength(doc0 + j)); };
        auto first_tile = [&](int j) { return TSPLIT && j == j0 ? head_tiles : 0; };

        // Tile entirely past the query length: contributes 0, argmax -1.
        if (qb == 1 && s0 >= query_len(qi0)) {
            for (int j = j0 + threadIdx.x; j < j1; j += NT) outp[j] = 0.f;
            if (ARGMAX) {
                const int rows = min(BM, Lq - s0);
                for (i64 e = threadIdx.x; e < (i64)(j1 - j0) * rows; e += NT) {
                    const int j = j0 + (int)(e / rows), r = (int)(e % rows);
                    amax[((i64)qi0 * Nd + j) * Lq + s0 + r] = -1;
                }
            }
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
        // A valid row's score term: its max, times the query token's scale for INT8 (read per
        // document from L1 rather than held in registers; an empty document's -inf stays -inf
        // even against a zero-scale padding token). The max commutes with the scale only when
        // it is >= 0: a negative (or NaN) scale gives NaN rather than a wrong number.
        auto term = [&](float v, int m, int h) {
            if (!I8 || v == LIK_NEG_INF) return v;
            const float sq = q_scale[(i64)(qi0 + rq[m][h]) * Lq + rs[m][h]];
            return v * (sq >= 0.f ? sq : __int_as_float(0x7fffffff));
        };

        const T* Qt = query_tile();
        const int q_rows = query_rows();
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
        if constexpr (TOKM) {  // visible to every warp after the first stage's block barrier
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

        // Producer cursor: next (document tile, dim chunk) to stage. It crosses
        // document boundaries so the ring stays full across short documents.
        // Padded documents: tile pt of document pj's pnt, its row and rows computed per tile.
        // Packed documents instead keep prow (the row of D and of the INT8 scales where the next
        // tile starts) and prem (the rows of pj this CTA stages from there on), from the
        // document's offsets read once per document: reading and clamping both offsets in 64 bits
        // per tile was a third of a one-query tile's instructions on 64-token documents, whose
        // pace the issue of those instructions sets, not HBM (Nsight Compute, bench/NOTES.md).
        // Padded documents keep the per-tile form, 2.6% faster there
        // (multi-query tiles, H100); prow and prem in place of pt and pnt cost packed tiles one
        // register (holding a start and length beside pt and pnt spilled some).
        int pj = j0, pk = 0, pt = first_tile(j0), pnt = 0, prem = 0;
        i64 prow = 0;
        auto enter = [&]() {  // document pj, from tile pt
            if (pj >= j1) return;
            if (!PACKED) {
                pnt = tiles(pj);
                return;
            }
            i64 begin;
            const int len = doc_span(doc0 + pj, begin), n = tiles_of(pj, len);
            prow = begin + (i64)pt * BN;
            prem = (n < len_tiles(len) ? n * BN : len) - pt * BN;  // a piece ends at whole tiles
        };
        auto staged_all = [&]() { return PACKED ? prem <= 0 : pt >= pnt; };  // of document pj
        enter();
        while (pj < j1 && staged_all()) {
            ++pj;
            pt = 0;
            enter();
        }
        // Stage `stage` (counted from 0 over the whole run) goes to ring slot stage % STAGES, as
        // that slot's fill number stage / STAGES.
        auto issue = [&](int stage) {
            const int slot = stage % STAGES;
            if (pj < j1) {
                const int k0 = pk * DP, rows = min(BN, PACKED ? prem : dlength(doc0 + pj) - pt * BN);
                const i64 row0 = PACKED ? prow : dstart(doc0 + pj) + (i64)pt * BN;  // the tile's first row
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
                        mbar_arrive_expect_tx(bar, (SPLIT ? BM + BN : BN) * DP * ESIZE + (I8 ? (BN + 4) * 4 : 0));
#pragma unroll
                        for (int kb = 0; kb < DP / BLK; ++kb) {
                            if (SPLIT) tma_load_2d(smem_addr(st + kb * BM * BLK), tmq, col + kb * 128, qi0 * Lq + s0, bar);
                            tma_load_2d(smem_addr(sd + kb * BN * BLK), tmd, col + kb * 128, row, bar);
                        }
                        if constexpr (I8) tma_load_1d(smem_addr(sS + slot * SCL), tms, row & ~3, bar);
                    }
#endif
                } else {
                    if (SPLIT) load_rows<QR>(st, Qt + k0, q_rows, dim, dim - k0);
                    load_rows<BN>(st + (SPLIT ? QR * LDS : 0), D + row0 * dim + k0, rows, dim,
                                  dim - k0);
                }
                if constexpr (I8 && !TMA) {
                    const float* src = d_scale + row0;
                    for (int c = threadIdx.x; c < BN; c += NT)
                        cp_async_4(smem_addr(sS + slot * SCL + c), c < rows ? src + c : d_scale, c < rows ? 4 : 0);
                }
                if (++pk == nk) {
                    pk = 0;
                    ++pt;
                    prow += BN;
                    prem -= BN;
                    while (pj < j1 && staged_all()) {
                        ++pj;
                        pt = 0;
                        enter();
                    }
                }
            }
            if (!TMA) cp_async_commit();  // one group per call, possibly empty: keeps wait_group counts exact
        };
#pragma unroll
        for (int s = 0; s < AHEAD; ++s) issue(s);

        u32 qf[QREG ? MT : 1][QREG ? NK : 1][4];
        bool q_ready = !QREG;
        int cons = 0;  // stages consumed so far

        // The running max (and argmax) of this thread's rows over the current document.
        float best[MT][2];
        int bidx[MT][2];
        // Tokens on M: the running max of each of this thread's 32 query rows (columns n * 8 + 2 * tq + e).
        float bq[TOKM ? NN : 1][2];
        auto reset = [&]() {
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h) { best[m][h] = LIK_NEG_INF; bidx[m][h] = -1; }
            if constexpr (TOKM) {
#pragma unroll
                for (int n = 0; n < NN; ++n) bq[n][0] = bq[n][1] = LIK_NEG_INF;
            }
        };
        // Wait for the next staged tile, start the refill of a freed slot, return the tile's slot.
        auto next_stage = [&]() -> int {
            // The barrier also tells the issuing threads that every warp is done with the slot they
            // refill (the one consumed last). RELEASE: each warp releases its slots (release_slot),
            // so only the query tile's copies need one barrier, before the first stage.
            if (!RELEASE || cons == 0) {
                if (TMA) cp_async_wait<0>();
                else cp_async_wait<AHEAD - 1>();
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
            issue(cons + AHEAD);
#if LIK_HAS_WGMMA
            if (TMA) mbar_wait(smem_addr(mbar + cons % STAGES), (cons / STAGES) & 1);
#endif
            return cons++ % STAGES;
        };
        // RELEASE: this warp is done with the tile in `slot` (its MMA waited for, its scales read).
        auto release_slot = [&](int slot) {
#if LIK_HAS_WGMMA
            if (RELEASE) {
                __syncwarp();
                if (lane == 0) mbar_arrive(smem_addr(mbar + STAGES + slot));
            }
#endif
        };
        // Document j's mask, or null when every token of its span counts (INT8 argmax tiles read
        // it anyway: the test spilled their two-warpgroup tiles past 128 registers).
        auto dmask = [&](int j) -> const u8* {
            if (PACKED || !d_mask || (!(I8 && ARGMAX) && d_len && d_len[doc0 + j] >= 0)) return nullptr;
            return d_mask + (doc0 + j) * Ld;
        };

        // Fold the similarity tile in `acc` (document tokens tok0 .. tok0 + BN - 1 of a document of
        // `len` tokens with mask `dm`, staged in ring slot `slot`, INT8 scales `sh` floats into
        // the slot) into best / bidx.
        auto fold = [&](A (&acc)[MT][NN][4], int slot, int tok0, int len, const u8* dm, int sh) {
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
                if constexpr (I8 && TMA) return float2{ss[n * 8], ss[n * 8 + 1]};  // sh may be odd
                else if constexpr (I8) return *reinterpret_cast<const float2*>(ss + n * 8);
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
            if (MULTI && !ARGMAX && !dm && !I8) {
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
            if (ARGMAX && full) {
                // Every token counts: a strict '>' per token in increasing order keeps the
                // lowest index on ties, with no validity test. A NaN anywhere in the thread's
                // tile sends it on through the exact loop below, which then lands on the first
                // NaN whatever this pass chose (a NaN beats any number there).
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
        };

        // MULTI: one warp per query sums document j's row maxima from shared memory, in a fixed order.
        auto sum_rows = [&](int j) {
            const float* rowv = red + (j & 1) * BM;
            for (int qq = warp; qq < nqb; qq += WARPS) {
                const float* rp = rowv + qq * span;
                float sum = 0.f;
                for (int r = lane; r < span; r += 32) sum += rp[r];
#pragma unroll
                for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
                if (lane == 0) outp[(i64)qq * Nd + j] = sum;
            }
        };
        int pending = -1;  // MULTI: a document whose row maxima wait to be summed after the next barrier
        auto flush_sums = [&]() {
            if (MULTI && pending >= 0) {
                sum_rows(pending);
                pending = -1;
            }
        };

        // Token split: a document whose tiles this CTA scores only some of is a piece (role 0: it
        // began in an earlier share, 1: it runs on past this one; a CTA has at most one of each).
        // Its rows go to this CTA's slot of the scratch instead of a score, and complete_pieces
        // merges them after the tile loop. -1: whole (always without a token split).
        auto piece_role = [&](int j) -> int {
            if (!TSPLIT) return -1;
            return j == j0 && head_tiles > 0 ? 0 : j == j1 - 1 && tail_tiles != 0x7fffffff ? 1 : -1;
        };

        // Document j's score (and argmax) from best / bidx.
        auto finish = [&](int j) {
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
                // Query row c's max over the 8 warps times its multiplier (qmul); rows summed in a
                // fixed order.
                float sum = 0.f;
#pragma unroll
                for (int c = lane; c < BM; c += 32) {
                    float m = rw[c];
#pragma unroll
                    for (int w = 1; w < WARPS; ++w) m = max_nan(m, rw[w * BM + c]);
                    const float qm = qmul[c];
                    if (!(qm < 0.f)) sum += m == LIK_NEG_INF ? m : m * qm;
                }
#pragma unroll
                for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
                if (lane == 0) outp[j] = sum;
                if (j + 2 < j1) named_arrive(3 + b, NT);
            }
        } else if (MULTI) {
            // Row max across the quad that shares each row, into shared memory (0 for rows that do
            // not count). Double-buffered by document: the rows are summed after the next tile's
            // block barrier (one barrier per document fewer), or after one here when no tile of
            // this CTA follows.
            float* rowv = red + (j & 1) * BM;
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float v = best[m][h];
                    int ix = bidx[m][h];
                    quad_max(v, ix);
                    if (tq == 0) {
                        rowv[wrow0 + m * 16 + g + 8 * h] = rv[m][h] ? term(v, m, h) : 0.f;
                        if (ARGMAX && rs[m][h] >= 0)
                            amax[((i64)(qi0 + rq[m][h]) * Nd + j) * Lq + rs[m][h]] = rv[m][h] ? ix : -1;
                    }
                }
            if (j + 1 < j1 && tiles(j + 1) > 0) {
                pending = j;
                return;
            }
            __syncthreads();
            sum_rows(j);
        } else {
            const int role = piece_role(j);
            score_single(best, bidx, rv, rs, term, red + (j & 1) * WARPS,  // double buffer: an empty next doc skips the loop barrier
                         role < 0, outp + j, ARGMAX ? amax + ((i64)qi0 * Nd + j) * Lq : nullptr, split_buf, role);
        }
        };

        for (int j = j0; j < j1; ++j) {
            i64 begin;
            const int len = doc_span(doc0 + j, begin);
            const int nt = tiles_of(j, len);
            const u8* dm = dmask(j);
            reset();
            for (int t = first_tile(j); t < nt; ++t) {
                A acc[MT][NN][4];
#pragma unroll
                for (int m = 0; m < MT; ++m)
#pragma unroll
                    for (int n = 0; n < NN; ++n)
#pragma unroll
                        for (int r = 0; r < 4; ++r) acc[m][n][r] = TOKM ? TOKM_OFFSET : 0;
                int slot = 0;
                for (int kc = 0; kc < nk; ++kc) {
                    slot = next_stage();
                    // The previous document's row sums (MULTI; every warp has passed next_stage's
                    // barrier since its rows were written): before this tile's MMA for 16-bit
                    // tiles, after it for INT8, the faster place for each on an H100 (32 queries
                    // of 32 tokens against 180-token documents: fp16 3% faster than after, INT8
                    // 5% faster than before).
                    if (!I8) flush_sums();
                    const T* st = ring + slot * STAGE;
                    tile_mma(acc, qf, SPLIT ? st : sQ, st + (SPLIT ? QR * LDS : 0), wrow0, lane, kc > 0, qlo);
                }
                if (I8) flush_sums();
#if LIK_HAS_WGMMA
                if (WG_CHAIN) wgmma_wait<0>();
#endif
                fold(acc, slot, t * BN, len, dm, TMA && I8 ? (int)(begin & 3) : 0);
                release_slot(slot);
            }
            finish(j);
        }
        cp_async_wait<0>();
        // The rest needs only kernel parameters and shared memory, so nothing else stays live
        // through the tile loop for it.
        if constexpr (TSPLIT)
            if (split_buf) complete_pieces(piece_info, split_buf, split_epoch, out, amax, Nq, Nd, Lq, n_qt, q_len, q_mask);
    }
};

}  // namespace lik

typedef lik::Fwd<LIK_ELEM, LIK_DP, LIK_WARPS, LIK_MT, LIK_BN, LIK_STAGES, LIK_QREG != 0, LIK_ARGMAX != 0, LIK_VEC != 0,
                  LIK_WGMMA != 0, LIK_MULTI != 0, LIK_PACKED != 0, LIK_SPLIT != 0, LIK_TMA != 0, LIK_QHALF != 0,
                  LIK_TOKM != 0>
    LikFwdCfg;

// LIK_MIN_BLOCKS: CTAs per SM the launch plan counts on (dispatch sets 2 for Hopper tiles
// whose shared memory lets two share an SM, one's epilogue running under the other's MMA;
// that caps registers at 128 per thread).
#ifndef LIK_MIN_BLOCKS
#define LIK_MIN_BLOCKS 1
#endif
// d_off (packed documents): int32 or int64 offsets; d_off_flags bit 0 says int64, bit 1 that they
// run from 0 to ntok (the CTAs then split the tokens without first reading where they end).
extern "C" __global__ void __launch_bounds__(LIK_WARPS * 32, LIK_MIN_BLOCKS)
    LIK_NAME(const void* Q, const void* D, const float* q_scale, const float* d_scale, const int* q_len, const u8* q_mask, const int* d_len, const u8* d_mask,
             const void* d_off, int d_off_flags, long long ntok, float* out, int* amax, int Nq, int Nd, int Lq, int Ld, int dim,
             int n_qt, int qb, int docs_per_cta, int dl_qstride, void* split_buf, unsigned split_epoch
#if LIK_TMA
             , const __grid_constant__ TmaDesc tmd  // documents as [rows, dim * esize] bytes
             , const __grid_constant__ TmaDesc tms  // INT8 document scales [rows] (a copy of tmd otherwise)
             , const __grid_constant__ TmaDesc tmq  // split-d: queries as [Nq * Lq, dim * esize] bytes (tmd otherwise)
#endif
    ) {
#if LIK_TMA
    const TmaDesc *pd = &tmd, *ps = &tms, *pq = &tmq;
#else
    const TmaDesc *pd = nullptr, *ps = nullptr, *pq = nullptr;
#endif
    LikFwdCfg::run(static_cast<const LikFwdCfg::T*>(Q), static_cast<const LikFwdCfg::T*>(D), q_scale, d_scale, q_len, q_mask, d_len, d_mask,
                   Offsets{d_off, d_off_flags & 1, (d_off_flags >> 1) & 1}, ntok, out, amax, Nq, Nd, Lq, Ld, dim, n_qt, qb, docs_per_cta, dl_qstride,
                   split_buf, split_epoch, pd, ps, pq);
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
