"""The streaming top-k's merge launch (``cuda_src/topk.cu``): a running top-k list merged with a
chunk of scores, on the GPU."""

from __future__ import annotations

import numpy as np

from .kernels import TOPK
from .nvrtc import get_function

__all__ = ["MAX_K", "MERGE_SLICE", "split_merge", "merge_topk"]

MAX_K = 4096  # the merge kernel ranks up to this many candidates in shared memory
# Scores per CTA in the first of a long chunk's two merge launches (one CTA per query spent
# 0.34 ms on 32 x 100,000 scores on an H100, against 8.4 ms for the scoring itself), taken
# while k is at most a quarter of it (the winners then stay a fraction of the chunk).
MERGE_SLICE = 4096
_MERGE_CACHE = 4096  # candidates of a row whose keys the merge kernel keeps in shared memory


def split_merge(k: int) -> bool:
    """Whether chunks of more than ``MERGE_SLICE`` documents take the two-launch merge for this ``k``."""
    return 4 * k <= MERGE_SLICE


def merge_topk(device: int, run_s, run_i, s, nd: int, base: int, k: int):
    """The best ``min(k, k_run + nd)`` of each row of the running list (``run_s`` float32 and
    ``run_i`` int64 [nq, k_run], best first) and of a chunk's scores ``s`` (float32 [nq, nd], its
    documents numbered from ``base``), queued on the current stream: (scores, indices)."""
    import cupy

    nq, k_run = run_s.shape
    k_out = min(k, k_run + nd)
    out_s = cupy.empty((nq, k_out), cupy.float32)
    out_i = cupy.empty((nq, k_out), cupy.int64)
    if not nq:
        return out_s, out_i
    kern = get_function(TOPK.file, "lik_topk_merge", device)
    null = np.uint64(0)

    def merge_kernel(rows, run_s, run_i, k_run, chunk, chunk_i, stride, n, groups, slice_, base, o_s, o_i, k):
        kp = 1 << max(0, (k - 1).bit_length())
        cache = k_run + min(n, slice_) <= _MERGE_CACHE  # every row's keys fit the kernel's cache
        smem = kp * 12 + (_MERGE_CACHE * 4 if cache else 0)
        if smem > 40 * 1024:
            kern.max_dynamic_shared_size_bytes = smem
        kern((rows,), (1024,), (run_s, run_i, np.int32(k_run), chunk, chunk_i, np.int64(stride), np.int32(n),
                                np.int32(groups), np.int32(slice_), np.int64(base), o_s, o_i, np.int32(k),
                                np.int32(kp), np.int32(_MERGE_CACHE if cache else 0)), shared_mem=smem)

    groups = -(-nd // MERGE_SLICE)
    if groups > 1 and split_merge(k):
        # One CTA per query walks the whole chunk several times; first rank each slice's
        # best k on its own CTA, then merge the running list with the slice winners.
        win_s = cupy.empty((nq * groups, k), cupy.float32)
        win_i = cupy.empty((nq * groups, k), cupy.int64)
        merge_kernel(nq * groups, null, null, 0, s, null, nd, nd, groups, MERGE_SLICE, base, win_s, win_i, k)
        merge_kernel(nq, run_s, run_i, k_run, win_s, win_i, groups * k, groups * k, 1, groups * k, 0, out_s, out_i,
                     k_out)
    else:
        merge_kernel(nq, run_s, run_i, k_run, s, null, nd, nd, 1, nd, base, out_s, out_i, k_out)
    return out_s, out_i
