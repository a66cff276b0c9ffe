// Spans of boolean document masks, so that the forward kernel stages no padding after a
// document's last valid token and reads no mask for a document whose valid tokens come first
// (the usual attention mask of a padded batch).
//
//   lik_mask_spans: row r of mask [rows, L] (one byte per token, nonzero = valid) gives
//   out[r] = n when its valid tokens are exactly its first n (0 for none), else ~n (negative),
//   n one past its last valid token. One warp per row. `masked` (null: not wanted) gets, per row,
//   1 where a token is masked: the zero-vector padding flag of PyLate's and colpali-engine's masks
//   (maxsim_fwd.cu), made here so that a masked call queues no kernel of its own for it.
#include "common.cuh"

extern "C" __global__ void lik_mask_spans(const u8* __restrict__ mask, long long rows, int L, int* __restrict__ out,
                                          u8* __restrict__ masked) {
    const int lane = threadIdx.x & 31;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
        const u8* m = mask + r * L;
        int last = -1, count = 0;
        for (int t = lane; t < L; t += 32) {
            if (m[t]) {
                last = t;
                ++count;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            last = max(last, __shfl_xor_sync(0xffffffffu, last, o));
            count += __shfl_xor_sync(0xffffffffu, count, o);
        }
        if (lane == 0) {
            out[r] = count == last + 1 ? count : ~(last + 1);
            if (masked) masked[r] = count != L;
        }
    }
}
