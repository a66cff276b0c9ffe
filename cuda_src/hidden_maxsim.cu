// The fused projection head's forward in one pass on Hopper (sm_90a; lik_cupy/_runtime/hidden_maxsim.py).
// Documents come as hidden states H [R = Nd * Ld, h] (16-bit, row-major); each CTA tile of 64 rows a
// warpgroup is projected by W [128, h] on wgmma (TMA stages of 64 hidden elements of the tile's rows
// and of W), rounded to the element type as the unfused pipeline stores it, the bias added and the
// row L2-normalised in float32 in registers, rounded again, and multiplied by the queries
// Q [QR = Nq * Lq, 128] with the projected rows as the wgmma's register operand: the projected
// tokens never leave the SM, so H is read once and nothing of the size of H @ W.T is written.
//
// Each document's max over its tokens, per query row, with the first token that reaches it, is
// merged across warps and CTAs by a 64-bit atomicMax on keys [QR, Nd] (zeroed by the caller):
// the float's order-preserving bits above, the complement of the token below, so the larger value
// wins, a NaN over any number, and the lower token on ties. lik_hidden_maxsim_finish sums each
// query's rows in token order into float32 scores (-inf for a document with no unmasked token)
// and writes the argmax (-1 there).
//
// -D flags: LIK_ELEM 0 fp16 / 1 bf16; LIK_QN the queries' rows as the second wgmma's N (32 or 64,
// at least QR); LIK_STAGES the TMA ring's depth; LIK_WG the warpgroups of a CTA.
#include "elem_rows.cuh"
#include "wgmma.cuh"

#ifndef LIK_QN
#error "LIK_QN is set by the launch (lik_cupy._runtime.hidden_maxsim)"
#endif
#if !defined(LIK_STAGES) || !defined(LIK_WG)
#error "LIK_STAGES and LIK_WG are set by the launch (lik_cupy._runtime.hidden_maxsim)"
#endif

namespace lik_hm {

using lik_rows::to_f;

constexpr int kDim = 128;                     // projected width: the projection's N, the scoring's K
constexpr int kGroups = LIK_WG;               // warpgroups, 64 rows of H each in a CTA tile
constexpr int kRows = 64 * kGroups;
constexpr int kThreads = 128 * kGroups;
constexpr int kQN = LIK_QN;
constexpr int kStages = LIK_STAGES;
constexpr u32 kHBytes = kRows * 128;          // one stage of H: kRows rows x 64 16-bit elements
constexpr u32 kWBytes = kDim * 128;           // one stage of W
constexpr u32 kStageBytes = kHBytes + kWBytes;
constexpr u32 kQBytes = 2 * kQN * 128;        // the queries, two 128-byte column blocks

// Order-preserving key of a similarity and its token (see the file's comment); 0 is "no token".
__device__ __forceinline__ unsigned long long key_of(float v, int t) {
    u32 b = __float_as_uint(v);
    if (v != v) b = 0x7fc00000u;  // every NaN above +inf
    const u32 o = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((unsigned long long)o << 32) | (u32)(~(u32)t);
}
__device__ __forceinline__ float value_of(unsigned long long k) {
    const u32 o = (u32)(k >> 32);
    return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}
// Two floats rounded to the element type (to nearest even) as one register, lo in the low half; and back.
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
#if LIK_ELEM == 0
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}
__device__ __forceinline__ float lo_f(u32 p) { return to_f((u16)(p & 0xffffu)); }
__device__ __forceinline__ float hi_f(u32 p) { return to_f((u16)(p >> 16)); }

__device__ __forceinline__ unsigned long long umax64(unsigned long long a, unsigned long long b) {
    return a > b ? a : b;
}

// One step of a transposing max-reduction over lanes: of its N keys a lane keeps the half its lane
// bit MASK selects (the upper half where set), maxed with the partner's (lane ^ MASK) copy of that
// half, in k[0 .. N / 2); the other half goes to the partner.
template <int N, int MASK>
__device__ __forceinline__ void butterfly(unsigned long long (&k)[LIK_QN / 4], int lane) {
    const bool upper = lane & MASK;
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
        const unsigned long long keep = upper ? k[N / 2 + j] : k[j], give = upper ? k[j] : k[N / 2 + j];
        k[j] = umax64(keep, __shfl_xor_sync(0xffffffffu, give, MASK));
    }
}

#if LIK_HAS_WGMMA
// D[64 x N] (+)= A[64 x 16] * B[N x 16]^T with A in registers (four 16-bit pairs a thread, the layout
// of the accumulators of a 64 x 16 wgmma, so a projected tile feeds the next product as it is) and
// B K-major in 128-byte-swizzled shared memory.
template <int N>
__device__ __forceinline__ void wgmma_rs(float* d, const u32 (&a)[4], unsigned long long db, int acc);

#define LIK_HM_RS(N, REGS, ACC, A0, A1, A2, A3, IB, IP)                                                           \
    template <>                                                                                                \
    __device__ __forceinline__ void wgmma_rs<N>(float* d, const u32(&a)[4], unsigned long long db, int acc) {  \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IP ", 0;\n"                                         \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." LIK_HM_TY "." LIK_HM_TY " {" REGS       \
                     "}, {%" #A0 ", %" #A1 ", %" #A2 ", %" #A3 "}, %" #IB ", p, 1, 1, 0;\n}\n"                \
                     : ACC("+f")                                                                               \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc));                       \
    }
#if LIK_ELEM == 0
#define LIK_HM_TY "f16"
#else
#define LIK_HM_TY "bf16"
#endif
#define LIK_HM_ACC16(C) LIK_ACC8(C, 0), LIK_ACC8(C, 8)
#define LIK_HM_REGS16 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
LIK_HM_RS(32, LIK_HM_REGS16, LIK_HM_ACC16, 16, 17, 18, 19, 20, 21)
LIK_HM_RS(64, LIK_REGS32, LIK_ACC32, 32, 33, 34, 35, 36, 37)
#endif

}  // namespace lik_hm

using namespace lik_hm;

// bias: float32 [128] or null; dmask: uint8 [R] or null (0: the token is not scored); kchunks: h / 64.
// tmh: H as [R rows, h * 2 bytes], boxes of a tile's rows x 128 bytes; tmw: W as [128, h * 2 bytes],
// boxes of its 128 rows x 128 bytes; tmq: Q as [QR, 256 bytes], boxes of QN rows x 128 bytes (rows past QR
// read as zeros).
extern "C" __global__ void __launch_bounds__(kThreads, 1)
lik_hidden_maxsim(const float* __restrict__ bias, const unsigned char* __restrict__ dmask,
                  unsigned long long* __restrict__ keys, int R, int Ld, int Nd, int QR, int kchunks,
                  int normalize, float eps, const __grid_constant__ TmaDesc tmh, const __grid_constant__ TmaDesc tmw,
                  const __grid_constant__ TmaDesc tmq) {
#if LIK_HAS_WGMMA
    extern __shared__ __align__(1024) unsigned char smem[];
    unsigned char* stages = smem;
    unsigned char* sq = smem + kStages * kStageBytes;
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(sq + kQBytes);
    float* sbias = reinterpret_cast<float*>(bars + 2 * kStages + 1);
    const u32 full0 = smem_addr(bars), empty0 = full0 + kStages * 8, qbar = full0 + 2 * kStages * 8;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2, wq = warp & 3;
    const int ntiles = (R + kRows - 1) / kRows;  // (R < 2^31 - kRows: every row index below fits an int)
    const int mine = (int)blockIdx.x < ntiles ? (ntiles - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    const int total = mine * kchunks;  // stages this CTA loads, in order; load n goes to slot n % kStages

    // Thread 0 loads: the next load's slot, its tile (of this CTA's) and its chunk of the hidden states.
    int issued = 0, ptile = 0, pkc = 0;
    u32 pslot = 0;
    auto issue = [&]() {
        const u32 bar = full0 + pslot * 8;
        unsigned char* st = stages + pslot * kStageBytes;
        const int row = ((int)blockIdx.x + ptile * (int)gridDim.x) * kRows;
        mbar_arrive_expect_tx(bar, kStageBytes);
        tma_load_2d(smem_addr(st), &tmh, pkc * 128, row, bar);
        tma_load_2d(smem_addr(st + kHBytes), &tmw, pkc * 128, 0, bar);
        if (++pkc == kchunks) pkc = 0, ++ptile;
        if (++pslot == kStages) pslot = 0;
        ++issued;
    };
    if (tid == 0) {
        for (int s = 0; s < kStages; ++s) {
            mbar_init(full0 + s * 8, 1);
            mbar_init(empty0 + s * 8, 4 * kGroups);  // one arrival per warp
        }
        mbar_init(qbar, 1);
        mbar_init_fence();
        mbar_arrive_expect_tx(qbar, kQBytes);
        tma_load_2d(smem_addr(sq), &tmq, 0, 0, qbar);
        tma_load_2d(smem_addr(sq + kQN * 128), &tmq, 128, 0, qbar);
        while (issued < total && issued < kStages) issue();
    }
    if (tid < kDim) sbias[tid] = bias ? bias[tid] : 0.f;
    __syncthreads();
    mbar_wait(qbar, 0);

    // Each stage's products are issued before the last stage's are waited for; a stage is handed back (and
    // refilled by thread 0 once every warp has) as soon as its products are done. slot, phase: the stage read
    // next and its barriers' parity.
    u32 slot = 0, phase = 0;
    auto release = [&](u32 done_slot, u32 done_phase) {
        __syncwarp();
        if (lane == 0) mbar_arrive(empty0 + done_slot * 8);
        if (tid == 0 && issued < total) {
            mbar_wait(empty0 + done_slot * 8, done_phase);
            issue();
        }
        __syncwarp();
    };
    const u32 q_lo = warp_uniform(wgmma_desc_lo(smem_addr(sq)));
    const int quad = lane & 3, r8 = lane >> 2;
    float acc[64];
    for (int i = 0; i < mine; ++i) {
        const int row0 = ((int)blockIdx.x + i * (int)gridDim.x) * kRows + wg * 64;
        u32 prev_slot = 0, prev_phase = 0;
        for (int kc = 0; kc < kchunks; ++kc) {
            mbar_wait(full0 + slot * 8, phase);
            const u32 st = smem_addr(stages + slot * kStageBytes);
            const u32 a_lo = warp_uniform(wgmma_desc_lo(st + wg * 64 * 128));
            const u32 b_lo = warp_uniform(wgmma_desc_lo(st + kHBytes));
            wgmma_fence();
#pragma unroll
            for (int j = 0; j < 4; ++j)
                wgmma_m64<LIK_ELEM, 128>(acc, wgmma_desc_at(a_lo + 2 * j), wgmma_desc_at(b_lo + 2 * j),
                                         kc > 0 || j > 0);
            wgmma_commit();
            if (kc > 0) {
                wgmma_wait<1>();
                release(prev_slot, prev_phase);
            }
            prev_slot = slot, prev_phase = phase;
            if (++slot == kStages) slot = 0, phase ^= 1u;
        }
        wgmma_wait<0>();
        release(prev_slot, prev_phase);

        // The projected rows r8 and r8 + 8 of this warp's 16: columns 8 n + 2 quad + {0, 1} in acc[4 n + {0, 1}]
        // and acc[4 n + {2, 3}]. Stored as the pipeline stores them (a pair at a time), the bias added in float32.
        float ssa = 0.f, ssb = 0.f;
#pragma unroll
        for (int n = 0; n < 16; ++n) {
            const float2 b = *reinterpret_cast<const float2*>(sbias + 8 * n + 2 * quad);
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float& x0 = acc[4 * n + 2 * r];
                float& x1 = acc[4 * n + 2 * r + 1];
                if (normalize) {
                    const u32 p = pack2(x0, x1);
                    x0 = lo_f(p) + b.x;
                    x1 = hi_f(p) + b.y;
                } else {
                    x0 += b.x;
                    x1 += b.y;
                }
                float& ss = r ? ssb : ssa;
                ss = fmaf(x1, x1, fmaf(x0, x0, ss));
            }
        }
        // The rows' scales: 1 / max(norm, eps), one rounding from the division the pipeline makes per element.
        float inva = 1.f, invb = 1.f;
        if (normalize) {
            ssa += __shfl_xor_sync(0xffffffffu, ssa, 1);
            ssa += __shfl_xor_sync(0xffffffffu, ssa, 2);
            ssb += __shfl_xor_sync(0xffffffffu, ssb, 1);
            ssb += __shfl_xor_sync(0xffffffffu, ssb, 2);
            inva = __frcp_rn(fmaxf(sqrtf(ssa), eps));
            invb = __frcp_rn(fmaxf(sqrtf(ssb), eps));
        }
        u32 a[8][4];
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
#pragma unroll
            for (int h = 0; h < 4; ++h) {  // h: the register, acc[8 kk + 2 h + {0, 1}]; odd h are the rows + 8
                const float inv = (h & 1) ? invb : inva;
                a[kk][h] = pack2(acc[8 * kk + 2 * h] * inv, acc[8 * kk + 2 * h + 1] * inv);
            }
        }

        // Similarities of the 64 rows with the queries: rows r8, r8 + 8, query rows 8 n + 2 quad + {0, 1}.
        float s[kQN / 2];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 8; ++kk)
            wgmma_rs<kQN>(s, a[kk], wgmma_desc_at(q_lo + (kk >> 2) * (kQN * 128 >> 4) + 2 * (kk & 3)), kk > 0);
        wgmma_commit();
        wgmma_wait<0>();

        const int g0 = row0 + 16 * wq;  // this warp's first row
        if (g0 < R) {
            const u32 ga = g0 + r8, gb = ga + 8, ul = Ld;
            const int da = ga / ul, db = gb / ul, ta = ga - da * ul, tb = gb - db * ul;
            const bool oka = (int)ga < R && (!dmask || dmask[ga]), okb = (int)gb < R && (!dmask || dmask[gb]);
            const int dlo = (u32)g0 / ul, dhi = (u32)(g0 + 15 < R ? g0 + 15 : R - 1) / ul;
            for (int doc = dlo; doc <= dhi; ++doc) {
                const bool ua = oka && da == doc, ub = okb && db == doc;
                if (!__any_sync(0xffffffffu, ua || ub)) continue;
                // The quad's kQN / 4 query rows (8 n + 2 quad + c at index 2 n + c), max over the eight lanes
                // that hold them for other rows of H: a transposing butterfly halves the indices a lane keeps at
                // each step (lane bit 4, then 3, then 2), so each lane ends with kQN / 32 of them whole.
                unsigned long long k[kQN / 4];
#pragma unroll
                for (int j = 0; j < kQN / 4; ++j) {  // the larger of the two rows (a NaN; on ties row r8's lower token)
                    const float va = s[4 * (j >> 1) + (j & 1)], vb = s[4 * (j >> 1) + 2 + (j & 1)];
                    const bool pick_b = ub && (!ua || vb > va || (vb != vb && va == va));
                    k[j] = (ua || ub) ? key_of(pick_b ? vb : va, pick_b ? tb : ta) : 0ull;
                }
                butterfly<kQN / 4, 16>(k, lane);
                butterfly<kQN / 8, 8>(k, lane);
                butterfly<kQN / 16, 4>(k, lane);
#pragma unroll
                for (int j = 0; j < kQN / 32; ++j) {  // the lane keeps index ((lane >> 2) & 7) * kQN / 32 + j
                    const int idx = ((lane >> 2) & 7) * (kQN / 32) + j;
                    const int q = 8 * (idx >> 1) + 2 * quad + (idx & 1);
                    if (k[j] && q < QR) atomicMax(keys + (long long)q * Nd + doc, k[j]);
                }
            }
        }
    }
#endif
}

// scores [Nq, Nd] float32 and argmax [Nq, Nd, Lq] int32 (or null) from the keys [Nq * Lq, Nd].
extern "C" __global__ void lik_hidden_maxsim_finish(const unsigned long long* __restrict__ keys,
                                                    float* __restrict__ scores, int* __restrict__ amax, int Nq, int Lq,
                                                    int Nd) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= (long long)Nq * Nd) return;
    const int q = (int)(i / Nd), doc = (int)(i - (long long)q * Nd);
    float s = 0.f;
    bool empty = false;
    for (int k = 0; k < Lq; ++k) {
        const unsigned long long key = keys[((long long)q * Lq + k) * Nd + doc];
        empty |= key == 0ull;
        if (key) s += value_of(key);
        if (amax) amax[i * Lq + k] = key ? (int)~(u32)key : -1;
    }
    scores[i] = empty ? LIK_NEG_INF : s;
}
