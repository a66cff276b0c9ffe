// Streaming top-k: merge a chunk of scores into each query's running top-k.
//
// One CTA per query row. The candidates are the row's running list (k_run
// entries, already ranked, document indices below `base`) followed by the
// chunk's n_chunk scores (documents base, base+1, ...). The order is score
// descending, NaN below everything (even -inf), ties to the lower document
// index; scanning candidates in position order visits tied documents in
// increasing index, which is what makes the tie rule cheap.
//
//   1. Radix select (4 passes of 8 bits over order-preserving uint32 keys)
//      finds the key of the k-th best candidate and how many candidates with
//      exactly that key make the cut.
//   2. One ordered pass collects every candidate above that key and the first
//      such ties in position order into shared memory.
//   3. A bitonic sort of those k candidates (padded to a power of two) writes
//      the new ranked list.
// Reads of the chunk are the only global traffic besides the k outputs, so a
// merge costs about 4-5 reads of the chunk's scores. A row of at most `cache_keys`
// candidates (every slice of a two-launch merge, and its second launch while the
// running list and the slice winners number that few) is read once: the first
// pass keeps its keys in shared memory, the later passes wait on that, not on L2.
//
// A long chunk is merged in two launches (lik_cupy/retrieval.py) so that more than one CTA
// works on each query: the first splits each row into `groups` slices of `slice` scores and
// ranks each slice's best k on its own (rows = queries x groups, no running list); the second
// merges the running list with the queries' slice winners, read with their own document
// indices (`chunk_i`). Ties still go to the lower index: within a key, slices follow in document
// order and each winner list in index order, so position order is index order.
#include "common.cuh"

namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;

// Larger key = better rank. NaN maps to 0, below -inf (0x007fffff). -0.0 takes +0.0's key (f + 0),
// so the two tie and go by index, as on the CPU path.
__device__ __forceinline__ u32 order_key(float f) {
    if (f != f) return 0u;
    const u32 b = __float_as_uint(f + 0.0f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key_score(u32 k) {
    if (k == 0u) return __int_as_float(0x7fc00000);
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

struct Row {
    const float* run_s;
    const i64* run_i;
    int k_run;
    const float* chunk;
    const i64* chunk_i;  // the chunk's document indices, or null: base, base + 1, ...
    int n_chunk;
    i64 base;
    __device__ __forceinline__ int size() const { return k_run + n_chunk; }
    __device__ __forceinline__ u32 key(int p) const { return order_key(p < k_run ? run_s[p] : chunk[p - k_run]); }
    __device__ __forceinline__ i64 index(int p) const {
        return p < k_run ? run_i[p] : chunk_i ? chunk_i[p - k_run] : base + (p - k_run);
    }
};

// a ranks before b
__device__ __forceinline__ bool before(u32 ka, i64 ia, u32 kb, i64 ib) { return ka > kb || (ka == kb && ia < ib); }

}  // namespace

// One CTA per output row: query q = row / groups, slice g = row % groups.
// run_s/run_i: [nq, k_run] (k_run may be 0; groups must then be 1); chunk: [nq, chunk_stride], of
// which slice g is the n_chunk_total scores from g * slice on (at most `slice` of them), documents
// base + g * slice, ... (or chunk_i[q, g * slice + ...] when chunk_i is not null).
// out_s/out_i: [nq * groups, k_out], k_out <= k_run + slice; a row with fewer candidates than
// k_out ends with (NaN, INT64_MAX) entries, which rank after every real one. Dynamic shared
// memory: kp * (4 + 8) bytes, kp = the power of two >= k_out, and cache_keys * 4 more: room to
// keep the keys of a row with at most cache_keys candidates (0: no cache). ids (or null): int64
// [n_ids], written to out_i in place of each document index below n_ids (a corpus's own ids, by
// the last launch of a merge; the order is still decided by the indices).
extern "C" __global__ void __launch_bounds__(kThreads, 1)
    lik_topk_merge(const float* __restrict__ run_s, const i64* __restrict__ run_i, int k_run,
                   const float* __restrict__ chunk, const i64* __restrict__ chunk_i, long long chunk_stride,
                   int n_chunk_total, int groups, int slice, long long base,
                   float* __restrict__ out_s, i64* __restrict__ out_i, int k_out, int kp, int cache_keys,
                   const i64* __restrict__ ids, long long n_ids) {
    extern __shared__ __align__(16) unsigned char smem[];
    i64* c_idx = reinterpret_cast<i64*>(smem);
    u32* c_key = reinterpret_cast<u32*>(c_idx + kp);
    u32* cache = c_key + kp;  // [cache_keys]: the row's keys, written by the first pass
    __shared__ u32 hist[256];
    __shared__ int s_warp[kWarps];
    __shared__ u32 s_digit;
    __shared__ int s_want;
    __shared__ int s_ngt, s_eq_seen;

    const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int q = row / groups, g = row - q * groups;
    const i64 off = (i64)q * chunk_stride + (i64)g * slice;
    const int n_chunk = max(0, min(slice, n_chunk_total - g * slice));
    Row r{run_s + (i64)q * k_run, run_i + (i64)q * k_run, k_run, chunk + off, chunk_i ? chunk_i + off : nullptr,
          n_chunk, base + (i64)g * slice};
    const int n = r.size();
    const int k_row = min(k_out, n);  // real entries of this row; the rest are padding
    const bool cached = n <= cache_keys;
    // The key of candidate p < n: read on the first pass (and kept, when cached), then from the cache.
    auto key_at = [&](int p, bool first) -> u32 {
        if (!cached) return r.key(p);
        if (!first) return cache[p];
        const u32 k = r.key(p);
        cache[p] = k;  // each thread re-reads only the positions it wrote
        return k;
    };

    // 1. Radix select: want = rank (1-based, among candidates matching prefix) of the k-th best.
    u32 prefix = 0, pmask = 0;
    int want = k_row;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = tid; b < 256; b += kThreads) hist[b] = 0;
        __syncthreads();
        for (int base_p = 0; base_p < n; base_p += kThreads) {
            const int p = base_p + tid;
            const u32 key = p < n ? key_at(p, shift == 24) : 0u;
            const bool in = p < n && (key & pmask) == prefix;
            const u32 digit = (key >> shift) & 255u;
            // Warp-aggregated: one shared atomic per distinct digit per warp, since
            // scores cluster and most lanes share the top digits.
            const u32 act = __ballot_sync(0xffffffffu, in);
            if (in) {
                const u32 peers = __match_any_sync(act, digit);
                if (lane == __ffs(peers) - 1) atomicAdd(&hist[digit], (u32)__popc(peers));
            }
        }
        __syncthreads();
        if (warp == 0) {
            // Lane l owns digits 8l..8l+7; suffix sums over lanes find the digit holding rank `want`.
            u32 c = 0;
            for (int b = 0; b < 8; ++b) c += hist[lane * 8 + b];
            u32 above = c;  // inclusive suffix sum: digits >= 8*lane
            for (int off = 1; off < 32; off <<= 1) {
                const u32 o = __shfl_down_sync(0xffffffffu, above, off);
                if (lane + off < 32) above += o;
            }
            const u32 strictly = above - c;  // digits >= 8*(lane+1)
            if (strictly < (u32)want && (u32)want <= above) {
                u32 acc = strictly;
                for (int b = 7; b >= 0; --b) {
                    const u32 h = hist[lane * 8 + b];
                    if (acc + h >= (u32)want) {
                        s_digit = lane * 8 + b;
                        s_want = want - (int)acc;
                        break;
                    }
                    acc += h;
                }
            }
        }
        __syncthreads();
        prefix |= s_digit << shift;
        pmask |= 255u << shift;
        want = s_want;
        __syncthreads();  // s_digit/s_want are rewritten next pass
    }
    const u32 kth = prefix;
    const int need_eq = want;            // candidates equal to kth that make the cut
    const int n_gt = k_row - need_eq;    // candidates strictly better than kth

    // 2. Collect: all keys above kth (any order) and the first need_eq ties in position order.
    for (int i = tid; i < kp; i += kThreads) {
        c_key[i] = 0u;
        c_idx[i] = 0x7fffffffffffffffll;  // padding sorts last
    }
    if (tid == 0) {
        s_ngt = 0;
        s_eq_seen = 0;
    }
    __syncthreads();
    for (int base_p = 0; base_p < n; base_p += kThreads) {
        const int p = base_p + tid;
        const u32 key = p < n ? key_at(p, false) : 0u;
        const bool gt = p < n && key > kth;
        const bool eq = p < n && key == kth;
        if (gt) {
            const int slot = atomicAdd(&s_ngt, 1);
            c_key[slot] = key;
            c_idx[slot] = r.index(p);
        }
        const u32 bal = __ballot_sync(0xffffffffu, eq);
        if (lane == 0) s_warp[warp] = __popc(bal);
        __syncthreads();
        int before_w = 0;
        for (int w = 0; w < warp; ++w) before_w += s_warp[w];
        const int rank = s_eq_seen + before_w + __popc(bal & ((1u << lane) - 1u));
        if (eq && rank < need_eq) {
            c_key[n_gt + rank] = key;
            c_idx[n_gt + rank] = r.index(p);
        }
        __syncthreads();
        if (tid == kThreads - 1) s_eq_seen += before_w + __popc(bal);
        __syncthreads();
    }

    // 3. Bitonic sort of kp candidates, best first.
    for (int size = 2; size <= kp; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = tid; i < kp; i += kThreads) {
                const int j = i ^ stride;
                if (j > i) {
                    const bool asc = (i & size) == 0;  // this half ends up best-first
                    const u32 ki = c_key[i], kj = c_key[j];
                    const i64 ii = c_idx[i], ij = c_idx[j];
                    if (before(kj, ij, ki, ii) == asc) {
                        c_key[i] = kj;
                        c_key[j] = ki;
                        c_idx[i] = ij;
                        c_idx[j] = ii;
                    }
                }
            }
            __syncthreads();
        }
    }
    for (int i = tid; i < k_out; i += kThreads) {
        out_s[(i64)row * k_out + i] = key_score(c_key[i]);
        const i64 at = c_idx[i];
        out_i[(i64)row * k_out + i] = ids != nullptr && at >= 0 && at < n_ids ? ids[at] : at;
    }
}
