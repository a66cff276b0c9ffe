"""The repeat-call path: a call whose signature was seen before does only what the call changed.

A signature is what validation, dispatch, the kernel lookup and the grid plan read: the kind of
call, its flags, and each array's shape, dtype, device, layout and 16-byte alignment. The first
call of a signature runs the whole path (``lik_cupy._maxsim_calls``) and leaves here a
:class:`PreparedCall`; every later call with that signature reads the arrays' addresses and the
caller's stream, allocates its results in the caller's framework and queues the kernels: no
validation, no DLPack round trip, no CuPy array of the caller's data, no host synchronisation.

Only C-contiguous PyTorch CUDA tensors and CuPy arrays take this path, with masks, lengths and
offsets (if any) on the device in the same framework; everything else (host arrays, lists of
lengths, other frameworks, float64, strict validation, empty problems) runs the whole path each
time. The cache is bounded (the oldest stored goes first; a hit moves nothing, so lookups take no
lock) and safe to share between threads: a prepared call holds no per-call state.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from typing import NamedTuple

from .._interop import CALLBACK_BUFFERS, REPEAT_CALLS
from .candidates import CandidateParam
from .device_checks import Checked, mark_invalid, strict
from .._base.env import poison_outputs
from .masks import queue_mask_spans
from .raw_launch import launch_raw, signature

__all__ = ["call_key", "lookup", "find", "store", "PreparedCall", "PreparedSearch", "PreparedBackward", "ResidentDocs",
           "clear", "MAX_CALLS"]

MAX_CALLS = 512  # signatures kept per process
_ADAPTERS = {**REPEAT_CALLS, **CALLBACK_BUFFERS}  # a call's own, or the buffers it is rebound to
_calls: OrderedDict = OrderedDict()
_lock = threading.Lock()


_BY_TYPE: dict = {}  # array type -> its adapter module, or None


def _adapter(x):
    t = type(x)
    try:
        return _BY_TYPE[t]
    except KeyError:
        mod = t.__module__.split(".")[0]
        a = _BY_TYPE[t] = REPEAT_CALLS.get(mod)  # (keyed by FRAMEWORK, the name of its arrays' top module)
        return a


def call_key(kind: str, flags: tuple, Q, arrays: tuple, *, precision: bool = True):
    """The signature of a call, or None when it cannot take the repeat path. ``flags``: the call's
    non-array arguments, ``validate`` first and ``precision`` last; ``arrays``: its other array
    arguments (None where absent); ``precision``: a float32 call resolves its precision."""
    a = _adapter(Q)
    if a is None or strict(flags[0]):
        return None
    sig = a.signature
    try:
        key = [kind, flags, sig(Q)]
        for x in arrays:
            if x is None:
                key.append(None)
            elif _adapter(x) is a:
                key.append(sig(x))
            else:
                return None
    except (RuntimeError, ValueError, NotImplementedError):  # no storage (torch's sparse, nested, meta): validation says so
        return None
    if precision and a.is_float32(Q):  # the precision the call resolves to is part of what it runs
        from .._dispatch.precision import fp32_accurate

        key.append(fp32_accurate(flags[-1], a.FRAMEWORK, "float32"))
    return tuple(key)


def lookup(key):
    """The prepared call of ``key`` (None: none), or None."""
    return find(_calls, key)


def find(calls: dict, key):
    """The current prepared call of ``key`` in ``calls`` (this module's, or a ``Corpus``'s own), or None:
    none kept, a stale one, or a key that cannot be hashed."""
    if key is None:
        return None
    try:
        call = calls.get(key)
    except TypeError:  # an option of no hashable value (backend=["cpu"]): the whole path's checks name it
        return None
    if call is not None and call.current():
        return call
    return None


def store(key, call: PreparedCall) -> None:
    with _lock:
        _calls[key] = call
        _calls.move_to_end(key)
        while len(_calls) > MAX_CALLS:
            _calls.popitem(last=False)


def clear() -> None:
    """Forget every prepared call."""
    with _lock:
        _calls.clear()


class PreparedCall:
    """One signature's call, ready to run: the forward launch (``launch.ForwardLaunch``) and how each
    argument reaches it.

    ``wide``: whether (q_lengths, d_lengths, d_offsets) are int64; the kernels read them as they are
    (int64 query lengths narrowed first), and so does the NaN pass. ``mark``: queue that pass after
    the kernel. ``docs``: a :class:`lik_cupy.Corpus`'s documents, which every call scores (its D,
    d_mask, d_lengths and d_offsets are then None), and ``cand_wide``: its candidate ids (the
    ``cand`` of a call, ``[Nq, K]``) are int64, else int32.
    """

    def __init__(self, fw: str, p, device: int, fwd, argmax: bool, wide: tuple, mark: bool, caller: str,
                 docs: ResidentDocs | None = None, cand_wide: bool = False):
        self.a = _ADAPTERS[fw]
        self.docs, self.cand_wide = docs, cand_wide
        self.p, self.device, self.fwd, self.argmax = p, device, fwd, argmax
        self.q_wide, self.d_wide, self.off_wide = (int(w) for w in wide)
        # int64 document lengths go as they are, their address tagged (launch.lengths_ptr), where the
        # tile reads them so (ForwardLaunch.tagged_doc_lengths); else, like query lengths, narrowed
        self.d_tagged = self.d_wide and fwd.tagged_doc_lengths
        self.d_narrowed = self.d_wide and not fwd.tagged_doc_lengths
        self.mark = mark
        self.rows = p.nq * p.nd if p.candidates else p.nd  # document rows of padded D
        self.caller = caller  # the public function, for error messages

    def current(self) -> bool:
        return self.fwd.current()

    def rebound(self, framework: str) -> PreparedCall:
        """This call for the buffers of a framework's callback (``lik_cupy._interop.CALLBACK_BUFFERS``)."""
        twin = copy.copy(self)
        twin.a = _ADAPTERS[framework]
        return twin

    def __call__(self, Q, D, q_mask, d_mask, q_lengths, d_lengths, d_offsets, zero_pad=None, cand=None, out=None):
        """Queue the call; returns its results, new arrays, or ``out`` (scores, or with argmax
        (scores, argmax), the caller's arrays of the result's shape and dtype) written."""
        if _device() != self.device:
            import cupy

            with cupy.cuda.Device(self.device):
                return self(Q, D, q_mask, d_mask, q_lengths, d_lengths, d_offsets, zero_pad, cand, out)
        a, p, dev = self.a, self.p, self.device
        stream = a.stream_handle(dev)
        scores = amax = None
        try:
            if out is not None:
                scores, amax = out if self.argmax else (out, None)
            else:
                scores = a.new_empty(p.scores_shape, "float32", dev)
                amax = a.new_empty(p.argmax_shape, "int32", dev) if self.argmax else None
        except Exception:
            fn, split = self.caller, "split the call over fewer queries or documents"
            if scores is None:
                _named_oom(f"{fn}: scores {list(p.scores_shape)} float32", 4 * p.nq * p.nd, split)
            _named_oom(f"{fn}: argmax {list(p.argmax_shape)} int32", 4 * p.nq * p.nd * p.lq,
                       f"return_argmax=False needs no argmax buffer; or {split}")
        if poison_outputs():
            a.fill(scores, -1.2345e33)
            if amax is not None:
                a.fill(amax, -77)
        s_ptr, a_ptr = a.address(scores), (a.address(amax) if amax is not None else 0)
        q32 = q_lengths if q_lengths is None or not self.q_wide else a.to_int32(q_lengths)  # int32 in every tile
        ql = 0 if q32 is None else a.address(q32)
        masked = isinstance(zero_pad, str)  # masks.MASKED: the flags come with the mask's spans
        zp = 0 if zero_pad is None or masked else a.address(zero_pad)
        if self.docs is None:
            d, dm, dl, off, flags, _keep = self._documents(a, stream, D, d_mask, d_lengths, d_offsets, masked)
            zp = zp or flags
            by_value = ()
        else:
            d, dm, dl, off, n_docs = self.docs
            by_value = () if cand is None else (CandidateParam(a.address(cand), n_docs, self.cand_wide),)
        fwd = self.fwd
        part = a.new_empty((fwd.partials,), "float32", dev) if fwd.partials else None
        fwd.run(stream, a.address(Q), d, 0, 0, ql, 0 if q_mask is None else a.address(q_mask), dl, dm, off,
                s_ptr, a_ptr, 0 if part is None else a.address(part), by_value, zero_pad=zp)
        if self.mark and (q_lengths is not None or d_lengths is not None or d_offsets is not None):
            mark_invalid(stream, dev, s_ptr, a_ptr, p.nq, p.nd, p.lq, p.candidates,
                         q_len=None if q_lengths is None else Checked(a.address(q_lengths), self.q_wide, p.lq),
                         d_len=None if d_lengths is None else Checked(a.address(d_lengths), self.d_wide, p.ld),
                         d_off=None if d_offsets is None else Checked(a.address(d_offsets), self.off_wide, p.ntok))
        return (scores, amax) if self.argmax else scores

    def _documents(self, a, stream: int, D, d_mask, d_lengths, d_offsets, masked: bool) -> tuple:
        """The call's documents as the kernel reads them: addresses of (D, d_mask, its lengths or
        the mask's spans, d_offsets, with ``masked`` the mask's zero-padding flags (else 0)), and the
        arrays made for them (alive until the launch)."""
        d_in = a.to_int32(d_lengths) if self.d_narrowed else d_lengths
        dl = 0 if d_in is None else a.address(d_in) | self.d_tagged
        spans, flags = None, 0
        if d_mask is not None:  # the kernel skips each document's padding (masks.py)
            # int32 spans [rows], then (masked) uint8 flags [rows]: one buffer
            spans = a.new_empty((self.rows + (-(-self.rows // 4) if masked else 0),), "int32", self.device)
            dl = a.address(spans)
            flags = dl + 4 * self.rows if masked else 0
            queue_mask_spans(stream, self.device, a.address(d_mask), self.rows, self.p.ld, dl, flags)
        return (a.address(D), 0 if d_mask is None else a.address(d_mask), dl,
                0 if d_offsets is None else a.address(d_offsets), flags, (d_in, spans))


class PreparedSearch:
    """A repeat of ``Corpus.search`` whose whole corpus was scored in one chunk: the scores by their
    :class:`PreparedCall`, then ranked by ``topk.PreparedTopK``, both queued on the caller's stream
    (``squeeze``: a 2-D Q, whose results drop the query axis). The scores and their ranking are the
    streamed search's (the same kernel, and the same merge launches for one chunk)."""

    def __init__(self, scores: PreparedCall, top, squeeze: bool):
        self.scores, self.top, self.squeeze = scores, top, squeeze

    def current(self) -> bool:
        return self.scores.current()

    def __call__(self, Q, q_mask, q_lengths):
        """``(scores, ids)`` in Q's framework, as ``Corpus.search`` returns them."""
        dev = self.scores.device
        if _device() != dev:
            import cupy

            with cupy.cuda.Device(dev):
                return self(Q, q_mask, q_lengths)
        a = self.scores.a
        s = self.scores(Q, None, q_mask, None, q_lengths, None, None)
        out_s, out_i = self.top(a, dev, a.stream_handle(dev), s)
        return (out_s[0], out_i[0]) if self.squeeze else (out_s, out_i)


class ResidentDocs(NamedTuple):
    """A :class:`lik_cupy.Corpus`'s checked documents as its prepared calls read them: device
    addresses (0: none) of the tokens, the uint8 mask, the int32 lengths (a mask's spans) and the
    offsets, and the number of documents (which bounds candidate ids)."""

    tokens: int
    mask: int
    lengths: int
    offsets: int
    n_docs: int


_DQ_PARAMS = signature("pppppppiiiiiiq")  # lik_bwd_dq (cuda_src/maxsim_bwd.cu)
_CAST_PARAMS = signature("ppq")  # lik_bwd_cast


class PreparedBackward:
    """One signature's ``maxsim_backward`` with the atomic method: dQ and the fp32 dD in one pass,
    then dD cast to D's dtype (``lik_cupy.backward``); float32 dD takes the atomics itself, with the
    same bits and no copy or cast. ``dq``, ``cast``: the kernels' handles (``module``: what owns
    them, held so that the compile cache dropping it cannot unload them); ``dims``: (Nq, Nd, Lq, Ld,
    dim, candidates, rows); grids as the general path plans them."""

    def __init__(self, fw: str, p, device: int, dq: int, cast: int, dq_grid, cast_grid, threads: int, dims: tuple,
                 shapes: tuple, dtype: str, module=None):
        self.a = _ADAPTERS[fw]
        self._module = module  # the kernels' module, kept loaded while its handles are used
        self.device, self.dq, self.cast = device, dq, cast
        self.dq_grid, self.cast_grid, self.threads, self.dims = dq_grid, cast_grid, threads, dims
        self.q_shape, self.d_shape = shapes
        self.dtype = dtype

    @staticmethod
    def current() -> bool:
        return True  # its kernels are chosen by no table

    def __call__(self, g, Q, D, argmax, d_offsets):
        import cupy

        if _device() != self.device:
            with cupy.cuda.Device(self.device):
                return self(g, Q, D, argmax, d_offsets)
        a, dev = self.a, self.device
        stream = a.stream_handle(dev)
        nq, nd, lq, ld, dim, cand, rows = self.dims
        try:
            dq = a.new_empty(self.q_shape, self.dtype, dev)
            dd = a.new_empty(self.d_shape, self.dtype, dev)
        except Exception:
            _named_oom(f"maxsim_backward: dQ and dD {list(self.q_shape)}, {list(self.d_shape)} {self.dtype}",
                       (nq * lq + rows) * dim * (4 if self.dtype == "float32" else 2), "split the call")
        direct = self.dtype == "float32"
        try:
            dd32 = dd if direct else a.new_empty((rows * dim,), "float32", dev)
        except Exception:
            _named_oom(f"maxsim_backward: the atomic method's fp32 dD [{rows}, {dim}] float32", rows * dim * 4,
                       "method='csr' needs no fp32 copy of dD; or split the call over fewer documents")
        dd32_ptr = a.address(dd32)
        cupy.cuda.runtime.memsetAsync(dd32_ptr, 0, rows * dim * 4, stream)
        launch_raw(self.dq, self.dq_grid, self.threads, 0, stream, _DQ_PARAMS,
                   (a.address(Q), a.address(D), a.address(g), a.address(argmax),
                    0 if d_offsets is None else a.address(d_offsets), a.address(dq), dd32_ptr,
                    nq, nd, lq, ld, dim, cand, rows))
        if not direct:
            launch_raw(self.cast, self.cast_grid, self.threads, 0, stream, _CAST_PARAMS,
                       (dd32_ptr, a.address(dd), rows * dim))
        return dq, dd


def _device() -> int:
    """The current CUDA device (bound at the first call: CuPy is imported only then)."""
    global _device
    import cupy

    _device = cupy.cuda.runtime.getDevice
    return _device()


def _named_oom(buffer: str, nbytes: int, hint: str) -> None:
    """Inside an ``except``: the error being handled, as ``device.allocating`` names an out-of-memory
    error (a ``DeviceMemoryError`` naming ``buffer``), or re-raised as it is."""
    from .._base.device import allocating

    with allocating(buffer, nbytes, hint):
        raise
