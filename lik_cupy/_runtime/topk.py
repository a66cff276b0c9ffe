"""The streaming top-k's merge launch (``cuda_src/topk.cu``): a running top-k list merged with a
chunk of scores, on the GPU; and :class:`PreparedTopK`, a whole corpus's scores ranked by a
repeat of ``Corpus.search``."""

from __future__ import annotations

from .kernels import TOPK
from .nvrtc import get_function
from .raw_launch import launch_raw, signature

__all__ = ["MAX_K", "MERGE_SLICE", "split_merge", "merge_topk", "PreparedTopK"]

MAX_K = 4096  # the merge kernel ranks up to this many candidates in shared memory
# Scores per CTA in the first of a long chunk's two merge launches (one CTA per query spent
# 0.34 ms on 32 x 100,000 scores on an H100, against 8.4 ms for the scoring itself), taken
# while k is at most a quarter of it (the winners then stay a fraction of the chunk).
MERGE_SLICE = 4096
_MERGE_CACHE = 4096  # candidates of a row whose keys the merge kernel keeps in shared memory
_THREADS = 1024
_PARAMS = signature("ppippqiiiqppiiipq")  # lik_topk_merge
_handles: dict = {}  # device -> the merge kernel's handle, its dynamic shared memory limit raised


def split_merge(k: int) -> bool:
    """Whether chunks of more than ``MERGE_SLICE`` documents take the two-launch merge for this ``k``."""
    return 4 * k <= MERGE_SLICE


def _kernel(device: int) -> int:
    h = _handles.get(device)
    if h is None:
        kern = get_function(TOPK.file, "lik_topk_merge", device)
        # (the most any launch takes: set once, where each launch used to set its own)
        kern.max_dynamic_shared_size_bytes = MAX_K * 12 + _MERGE_CACHE * 4
        h = _handles[device] = kern.kernel.ptr
    return h


def _launches(nq: int, k_run: int, nd: int, k: int) -> list[tuple]:
    """A merge's launches, in order: (rows, k_run, n, groups, slice, k_out, kp, cache_keys, smem,
    what it reads, what it writes), the last two "chunk"/"run"/"winners"/"out" (see merge_topk)."""
    def one(rows, k_run, n, groups, slice_, k_out, reads, writes):
        kp = 1 << max(0, (k_out - 1).bit_length())
        cache = _MERGE_CACHE if k_run + min(n, slice_) <= _MERGE_CACHE else 0  # every row's keys fit the cache
        return rows, k_run, n, groups, slice_, k_out, kp, cache, kp * 12 + cache * 4, reads, writes

    k_out = min(k, k_run + nd)
    groups = -(-nd // MERGE_SLICE)
    if groups > 1 and split_merge(k):
        # One CTA per query walks the whole chunk several times; first rank each slice's
        # best k on its own CTA, then merge the running list with the slice winners.
        return [one(nq * groups, 0, nd, groups, MERGE_SLICE, k, "chunk", "winners"),
                one(nq, k_run, groups * k, 1, groups * k, k_out, "winners", "out")]
    return [one(nq, k_run, nd, 1, nd, k_out, "chunk", "out")]


def _queue(func: int, stream: int, launch: tuple, run: tuple, chunk: tuple, winners: tuple, out: tuple, base: int,
           ids: tuple) -> None:
    """One launch of ``_launches``: ``run``, ``chunk``, ``winners`` and ``out`` are (scores address,
    indices address, row stride), ``ids`` (address, count) or (0, 0)."""
    rows, k_run, n, groups, slice_, k_out, kp, cache, smem, reads, writes = launch
    src = chunk if reads == "chunk" else winners
    dst = winners if writes == "winners" else out
    last = writes == "out"
    launch_raw(func, (rows, 1, 1), _THREADS, smem, stream, _PARAMS,
               (run[0], run[1], k_run, src[0], src[1], src[2], n, groups, slice_, base if reads == "chunk" else 0,
                dst[0], dst[1], k_out, kp, cache) + (ids if last else (0, 0)))


def merge_topk(device: int, run_s, run_i, s, nd: int, base: int, k: int):
    """The best ``min(k, k_run + nd)`` of each row of the running list (``run_s`` float32 and
    ``run_i`` int64 [nq, k_run], best first) and of a chunk's scores ``s`` (float32 [nq, nd], its
    documents numbered from ``base``), queued on the current stream: (scores, indices)."""
    import cupy

    nq, k_run = run_s.shape
    plan = _launches(nq, k_run, nd, k)
    out_s = cupy.empty((nq, plan[-1][5]), cupy.float32)
    out_i = cupy.empty((nq, plan[-1][5]), cupy.int64)
    if not nq:
        return out_s, out_i
    func, stream = _kernel(device), cupy.cuda.get_current_stream().ptr
    win = (0, 0, 0)
    if len(plan) > 1:
        win_s = cupy.empty((plan[0][0], k), cupy.float32)
        win_i = cupy.empty((plan[0][0], k), cupy.int64)
        win = (win_s.data.ptr, win_i.data.ptr, plan[1][2])
    run = (run_s.data.ptr, run_i.data.ptr, 0)
    for launch in plan:
        _queue(func, stream, launch, run, (s.data.ptr, 0, nd), win, (out_s.data.ptr, out_i.data.ptr, 0), base,
               (0, 0))
    return out_s, out_i


class PreparedTopK:
    """The best ``k`` of each row of a whole corpus's scores ``[nq, nd]`` (no running list), queued by
    kernel handle into arrays of a repeat-call framework (``a``, an adapter of
    ``lik_cupy._interop.REPEAT_CALLS``): ``Corpus.search``'s repeat path. ``ids``: the corpus's
    integer ids on the device (int64 ``[nd]``) to return in place of positions, or None."""

    def __init__(self, device: int, nq: int, nd: int, k: int, ids=None):
        self.func = _kernel(device)
        self.plan = _launches(nq, 0, nd, k)
        self.nq, self.nd, self.k_out = nq, nd, self.plan[-1][5]
        self.ids = (0, 0) if ids is None else (ids.data.ptr, nd)
        self._ids = ids  # held while its address is used

    def __call__(self, a, device: int, stream: int, scores):
        """``(scores, indices)`` of the ``k`` best, float32 and int64 ``[nq, k']``, queued on ``stream``
        after the scores (``a``'s array, ``[nq, nd]`` or ``[nd]``, C-contiguous)."""
        out_s = a.new_empty((self.nq, self.k_out), "float32", device)
        out_i = a.new_empty((self.nq, self.k_out), "int64", device)
        win = (0, 0, 0)
        if len(self.plan) > 1:
            rows, k = self.plan[0][0], self.plan[0][5]
            win_s, win_i = a.new_empty((rows, k), "float32", device), a.new_empty((rows, k), "int64", device)
            win = (a.address(win_s), a.address(win_i), self.plan[1][2])
        chunk, out = (a.address(scores), 0, self.nd), (a.address(out_s), a.address(out_i), 0)
        for launch in self.plan:
            _queue(self.func, stream, launch, (0, 0, 0), chunk, win, out, 0, self.ids)
        return out_s, out_i
