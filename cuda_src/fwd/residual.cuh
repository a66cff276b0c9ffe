// The forward's loader for PLAID-compressed documents (LIK_RESIDUAL = nbits): each document token
// is a centroid code and nbits residual bits per dim, packed as fast-plaid and ColBERTv2 pack them
// (ResidualLoader::decompress says how). Its embedding is centroids[code] + weights[bucket] per
// dim, scaled to unit length (ResidualSrc::normalize), and exists only in a ring slot: nothing of
// size T x d is ever written to memory. Per tile, one stage apart:
//   gather      (Producer::issue) cp.async copies the tile's centroid rows, found by its codes,
//               into the slot's fp16 tile, and its residual bytes beside it;
//   decompress  (Consumer::next_stage) once they land, every thread turns a row's 16-dim
//               pairs into centroid + bucket value in fp32, the row's lanes add up its squared
//               norm, and the scaled values go back into the same place as fp16 or bf16: the
//               tile the tensor cores read, one tile before the MMA reads it.
// A tile's codes are read into registers while the tile before it is scored (prefetch), and
// written to shared memory before the block barrier that precedes its gather (publish), so no
// thread waits on a code load.
#pragma once
#include "fwd/config.cuh"

namespace lik {

// Two fp16 bit patterns (low half first) to floats.
__device__ __forceinline__ float2 half2_bits_to_float2(u32 x) {
    float2 f;
    asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %2; cvt.f32.f16 %0, lo; cvt.f32.f16 %1, hi; }"
        : "=f"(f.x), "=f"(f.y)
        : "r"(x));
    return f;
}

// Two floats to fp16 (ELEM 0) or bf16 (ELEM 1) bit patterns, rounded to nearest, a in the low half.
template <int ELEM>
__device__ __forceinline__ u32 pack2(float a, float b) {
    u32 r;
    if constexpr (ELEM == 0) asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
    else asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
    return r;
}

// A residual row's bits as one stream: bit p of the result is bit p of the stream that packs
// dim j's bucket in bits j * nbits .. j * nbits + nbits - 1, least significant first, each byte
// filled from its most significant bit (numpy's packbits order, as ColBERTv2's binarize and
// fast-plaid's packbits write them). `w` holds four stream bytes, the first in its low byte.
__device__ __forceinline__ u32 bit_stream(u32 w) { return __byte_perm(__brev(w), 0, 0x0123); }

LIK_FWD_TEMPLATE
struct LIK_FWD::ResidualLoader {
    static constexpr int CREG = (BN + NT - 1) / NT;  // codes of a tile per thread
    static constexpr int CPR8 = DP / 8;              // 8-dim (16-byte) chunks per padded row
    static constexpr int PPR = DP / 16;              // 16-dim pairs of chunks per padded row
    // Lanes per row when decompressing: the power of two at or above the pairs (at most 32:
    // DP <= 512), so a row's lanes reduce its norm with log2(LPR) shuffles inside the warp.
    static constexpr int LPR = PPR <= 1 ? 1 : PPR <= 2 ? 2 : PPR <= 4 ? 4 : PPR <= 8 ? 8 : PPR <= 16 ? 16 : 32;
    static_assert(PPR <= 32, "residual tiles hold at most 512 dims");
    static constexpr int RPP = NT / LPR;  // rows decompressed per pass of the CTA
    // Bucket values of two neighbouring dims per entry for nbits 1 and 2 (4 and 16 float2: the
    // 16 entries fill the 32 banks once, so any lanes' picks are conflict-free), one per entry for
    // nbits 4 (16 floats).
    static constexpr bool PAIRS = RES <= 2;
    static constexpr int TAB = PAIRS ? 1 << (2 * RES) : 16;

    const ResidualSrc& rs;
    const int& dim;
    u8* const& rbuf;     // [STAGES][RBYTES] residual bytes
    float* const& rtab;  // bucket value table
    int* const& rcode;   // [2][BN] codes of the next tiles to gather, then [STAGES] byte shifts
    int (&creg)[CREG];   // the next tile's codes, in flight
    T* const& ring;

    // The bucket table, from the caller's weights (visible to all after the first block barrier).
    __device__ void init_table() const {
        constexpr int MASK = (1 << RES) - 1;
        for (int e = threadIdx.x; e < TAB; e += NT) {
            if constexpr (PAIRS)
                reinterpret_cast<float2*>(rtab)[e] = float2{rs.weights[e & MASK], rs.weights[e >> RES]};
            else
                rtab[e] = rs.weights[e];
        }
    }

    // Start loading the codes of the tile whose rows are row0 .. row0 + rows - 1 (thread t holds
    // rows t, t + NT, ...); out-of-range codes become 0.
    __device__ void prefetch(i64 row0, int rows) const {
#pragma unroll
        for (int i = 0; i < CREG; ++i) {
            const int r = threadIdx.x + i * NT;
            int c = 0;
            if (r < rows) {
                const i64 x = rs.codes_wide ? static_cast<const i64*>(rs.codes)[row0 + r]
                                            : static_cast<const int*>(rs.codes)[row0 + r];
                c = x >= 0 && x < rs.n_cent ? (int)x : 0;
            }
            creg[i] = c;
        }
    }

    // The prefetched codes into the buffer `stage`'s gather reads (before a block barrier).
    __device__ void publish(int stage) const {
        int* dst = rcode + (stage & 1) * BN;
#pragma unroll
        for (int i = 0; i < CREG; ++i) {
            const int r = threadIdx.x + i * NT;
            if (r < BN) dst[r] = creg[i];
        }
    }

    // Copy stage `stage`'s tile into ring slot `slot`: the centroid rows of its codes (columns past
    // dim and rows past `rows` zero-filled) and its residual bytes (from the 16-byte boundary at or
    // before the first; the offset of the first row's byte is kept for decompress).
    __device__ void gather(T* st, int slot, int stage, i64 row0, int rows) const {
        const int* code = rcode + (stage & 1) * BN;
        const u16* cen = rs.centroids;
        constexpr int RS = NT / CPR8;  // rows a pass of the CTA copies, when its threads tile them evenly
        if constexpr (NT % CPR8 == 0 && BN % RS == 0) {
            // Each thread keeps one chunk column and steps through rows RS apart.
            const int r0 = threadIdx.x / CPR8, k = (threadIdx.x - r0 * CPR8) * 8;
            const bool kok = k < dim;
            const u32 d0 = smem_addr(st + r0 * LDS + k);
#pragma unroll
            for (int i = 0; i < BN / RS; ++i) {
                const int r = r0 + i * RS;
                cp_async_16_or_zero(d0 + i * RS * LDS * ESIZE, cen + (i64)code[r] * dim + k, kok && r < rows);
            }
        } else {
            for (int c = threadIdx.x; c < BN * CPR8; c += NT) {
                const int r = c / CPR8, k = (c - r * CPR8) * 8;
                cp_async_16_or_zero(smem_addr(st + r * LDS + k), cen + (i64)code[r] * dim + k, r < rows && k < dim);
            }
        }
        const i64 b0 = row0 * rs.rbytes, b1 = b0 + (i64)rows * rs.rbytes, a0 = b0 & ~(i64)15;
        const int n16 = (int)((b1 - a0 + 15) >> 4);
        u8* rb = rbuf + slot * RBYTES;
        for (int c = threadIdx.x; c < n16; c += NT) {
            const i64 a = a0 + 16 * (i64)c;
            cp_async_16(smem_addr(rb + 16 * c), rs.bits + a, (int)min((i64)16, b1 - a));
        }
        if (threadIdx.x == 0) rcode[2 * BN + slot] = (int)(b0 & 15);
    }

    // Slot `slot`'s centroid rows and residual bytes (landed, and visible to every thread) into
    // the tile the MMA reads, in place: each lane of a row's LPR holds one 16-dim pair in fp32.
    // Rows past the tile's end decompress whatever the slot holds, into columns fold masks.
    __device__ void decompress(int slot) const {
        T* st = ring + slot * STAGE;
        const u8* rb = rbuf + slot * RBYTES;
        const u32* rw = reinterpret_cast<const u32*>(rb);
        // & 15: a slot no tile was gathered into (a CTA with fewer tiles than stages) holds no
        // shift of its own, and its garbage must not steer the reads below out of the slot.
        const int sh = rcode[2 * BN + slot] & 15, rbytes = rs.rbytes;
        const int p = threadIdx.x % LPR;                 // this lane's pair
        const bool real = p < PPR && p * 16 < dim;       // dims past dim (whole chunks: dim % 8 == 0)
        const bool second = p * 16 + 8 < dim;            // its second chunk is within dim
        const float2* tab2 = reinterpret_cast<const float2*>(rtab);
#pragma unroll 2
        for (int r = threadIdx.x / LPR; r < BN; r += RPP) {
            float v[16];
            u32 c[8];
            const uint4* src = reinterpret_cast<const uint4*>(st + r * LDS + p * 16);
            if (p < PPR) {
                const uint4 c0 = src[0], c1 = src[1];
                c[0] = c0.x; c[1] = c0.y; c[2] = c0.z; c[3] = c0.w;
                c[4] = c1.x; c[5] = c1.y; c[6] = c1.z; c[7] = c1.w;
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) c[i] = 0;
            }
            // This pair's 16 * nbits bits start at byte o of the slot's bytes (lanes past the row's
            // pairs read the first pair's).
            const int o = sh + r * rbytes + (p < PPR ? p : 0) * 2 * RES, wi = o >> 2, bs = (o & 3) * 8;
            const u32 s0 = bit_stream(__funnelshift_r(rw[wi], rw[wi + 1], bs));
            const u32 s1 = PAIRS ? 0 : bit_stream(__funnelshift_r(rw[wi + 1], rw[wi + 2], bs));
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float2 cf = half2_bits_to_float2(c[i]);
                float2 w;
                if constexpr (PAIRS) {
                    w = tab2[(s0 >> (2 * RES * i)) & (TAB - 1)];
                } else {
                    const u32 s = i < 4 ? s0 : s1;
                    w = float2{rtab[(s >> (8 * (i & 3))) & 15], rtab[(s >> (8 * (i & 3) + 4)) & 15]};
                }
                v[2 * i] = cf.x + w.x;
                v[2 * i + 1] = cf.y + w.y;
            }
            float ss = 0.f;
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                if (!real || (i >= 8 && !second)) v[i] = 0.f;
                ss = fmaf(v[i], v[i], ss);
            }
#pragma unroll
            for (int m = 1; m < LPR; m <<= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
            // As torch's normalize: x / max(|x|, 1e-12).
            const float inv = rs.normalize ? rsqrtf(fmaxf(ss, 1e-24f)) : 1.f;
            if (p < PPR) {
                uint4 o0, o1;
                o0.x = pack2<ELEM>(v[0] * inv, v[1] * inv);
                o0.y = pack2<ELEM>(v[2] * inv, v[3] * inv);
                o0.z = pack2<ELEM>(v[4] * inv, v[5] * inv);
                o0.w = pack2<ELEM>(v[6] * inv, v[7] * inv);
                o1.x = pack2<ELEM>(v[8] * inv, v[9] * inv);
                o1.y = pack2<ELEM>(v[10] * inv, v[11] * inv);
                o1.z = pack2<ELEM>(v[12] * inv, v[13] * inv);
                o1.w = pack2<ELEM>(v[14] * inv, v[15] * inv);
                uint4* dst = reinterpret_cast<uint4*>(st + r * LDS + p * 16);
                dst[0] = o0;
                dst[1] = o1;
            }
        }
    }
};

}  // namespace lik
