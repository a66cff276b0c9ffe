"""The forward launch: a validated problem and its device operands in, the chosen kernel
configuration compiled (or found), its grid planned and the kernel queued on the caller's stream.

``launch`` is the one place every GPU scoring path (``maxsim``, the INT8 and packed forms,
``retrieve``) launches the forward kernel.
"""

from __future__ import annotations

import ctypes
import struct
import threading
import warnings

import numpy as np

from .. import _dispatch as dispatch
from .._validate import Problem, check_32bit
from . import env, tma, token_split
from .cache import DeviceCache
from .device import device_properties, empty
from .masks import mask_spans

__all__ = ["launch", "tma_usable", "caller_name"]


def caller_name(p: Problem) -> str:
    """The public function a problem came from, for error messages."""
    return "maxsim" + ("_int8" if p.dtype == "int8" else "") + ("_varlen" if p.d_packed else "")


def tma_usable() -> bool:
    """Whether Hopper tiles may stage documents by TMA here (not turned off, and the driver
    can build tensor maps); dispatch decides which tiles do."""
    return not env.tma_disabled() and tma.available()


_wgmma_warned = False


def _warn_wgmma_once(err: Exception) -> None:
    global _wgmma_warned
    if not _wgmma_warned:
        _wgmma_warned = True
        warnings.warn(f"lik_cupy: the Hopper (sm_90a) kernel failed to build, using the portable kernel instead: {err}",
                      RuntimeWarning, stacklevel=4)


# (device, kernel name) -> (module, the kernel's CUfunction handle on that device): spares each
# call the cache-key building; its size is bounded by the configurations dispatch can return.
_kernels = DeviceCache(4096)


def _kernel(cfg, arch: int, device: int):
    """The loaded module of ``cfg`` and its kernel's driver handle on ``device`` (the current one)."""
    return _kernels.lookup(device, cfg.name) or _kernels.get(device, cfg.name, lambda: _load_kernel(cfg, arch, device))


def _load_kernel(cfg, arch: int, device: int):
    from .nvrtc import get_module

    mod = get_module("maxsim_fwd.cu", cfg.defines(), cfg.target(arch), device)
    kern = mod.get_function(cfg.name)
    if cfg.smem_bytes > 48 * 1024:
        kern.max_dynamic_shared_size_bytes = cfg.smem_bytes
    return mod, kern.kernel.ptr


# The forward kernel's parameters in order, by C type: p pointer, i int, u unsigned, q long long (the TMA
# descriptors follow as their own 128-byte buffers). Each value gets an 8-byte slot of one buffer
# packed in a single call, and the driver is handed the slots' addresses: CuPy's own argument
# conversion took a sixth of a one-query call's host time.
_FWD_SIGNATURE = "pppppppppiqppiiiiiiiiipu"
_FWD_PARAMS = struct.Struct("<" + "".join({"p": "Q", "i": "i4x", "u": "I4x", "q": "q"}[c] for c in _FWD_SIGNATURE))
_params = threading.local()


def _ptr(a) -> int:
    """A device array's address, or 0 (NULL) for None."""
    return a.data.ptr if a is not None else 0


def _launch_forward(func: int, grid, threads: int, smem: int, stream: int, values: tuple, maps: tuple) -> None:
    """Launch the forward kernel ``func`` (a CUfunction handle) on ``stream`` (a handle) with
    parameter ``values`` (as ``_FWD_SIGNATURE``) and the parameters after them, each an object
    whose ``address`` holds its bytes: TMA ``maps`` (tma.TensorMap), the residual kernel's
    ``ResidualSrc``, the candidate ids' ``CandSrc`` (none for other kernels)."""
    import cupy

    slots = getattr(_params, "slots", None)
    if slots is None:  # one buffer per thread: the driver copies the values at the launch
        buf = ctypes.create_string_buffer(_FWD_PARAMS.size)
        base = ctypes.addressof(buf)
        addrs = (ctypes.c_void_p * (len(_FWD_SIGNATURE) + 3))(*[base + 8 * i for i in range(len(_FWD_SIGNATURE))])
        slots = _params.slots = (buf, addrs)
    buf, addrs = slots
    _FWD_PARAMS.pack_into(buf, 0, *values)
    for i, m in enumerate(maps):
        addrs[len(_FWD_SIGNATURE) + i] = m.address
    cupy.cuda.driver.launchKernel(func, grid[0], grid[1], grid[2], threads, 1, 1, smem, stream,
                                  ctypes.addressof(addrs), 0)


def _padded_split(cfg, func, plan, p: Problem, props, arch: int, device: int, shared: int, stream):
    """(cfg, func, plan, ntok) for padded documents: ``cfg``'s tile on the token split
    (``FwdConfig.strided_tile``: ``ntok`` is then one query's documents' padded tokens) where
    the launch plan splits them and the stream is not being captured (token_split.py), else the
    arguments as they came (ntok 0)."""
    from ..errors import CompileError

    strided = cfg.strided_tile
    if strided is None or p.ld < dispatch.padded_split_min_ld(strided):
        return cfg, func, plan, 0
    ntok = p.nd * p.ld
    split = dispatch.plan_launch(strided, props.cc, props.num_sms, p.nq, p.nd, p.lq, shared, ntok)
    if not split.token_split or stream.is_capturing():
        return cfg, func, plan, 0
    try:
        _, sfunc = _kernel(strided, arch, device)
    except CompileError as e:  # the sm_90a build of this variant failed: whole documents, as planned
        if not (strided.wgmma or strided.tma):
            raise
        _warn_wgmma_once(e)
        return cfg, func, plan, 0
    return strided, sfunc, split, ntok


def launch(p: Problem, q, d, qm, dm, ql, dl, return_argmax: bool, device: int, *, d_off=None, ld_hint=None,
           d_off_whole=True, out=None, q_scale=None, d_scale=None, caller=None, x3=False, residual=None, cand=None):
    """Choose the kernel configuration and launch it on the current CuPy stream.

    q: [nq, lq, dim] (bfloat16 as uint16); d: padded [rows, ld, dim], or packed
    tokens [T, dim] when ``d_off`` (int32 or int64 [nd + 1] device offsets) is given.
    ``d_off_whole``: the offsets run from 0 to T (not a slice of them), so CTAs split the
    tokens without reading where they start and end (a hint: scores never depend on it).
    ``out``: optional float32 buffer of nq * nd elements for the scores.
    ``p.dtype == "int8"``: q and d are int8 and ``q_scale`` (float32 [nq * lq], non-negative)
    and ``d_scale`` (float32 [rows * ld] or [T]) are their contiguous per-token scales.
    ``caller`` names the public function in error messages (default: the one ``p`` came from).
    ``x3``: float32 at float32 accuracy (``lik_cupy.precision``), for float32 q and d.
    ``residual`` (a ``lik_cupy._runtime.residual.ResidualOperands``): the documents are
    PLAID-compressed and ``d`` is their codes ([rows] or, padded, [rows, ld]); the kernel's tile
    loader decompresses them (``p.dtype``, float16 or bfloat16, is the tile's dtype).
    ``cand`` (a ``lik_cupy._runtime.candidates.CandidateIds`` [nq, p.nd], with ``p.candidates``):
    query i scores the documents of ``d`` its row of ids names, in place (an id outside the
    corpus scores NaN).
    """
    import cupy

    from ..errors import CompileError

    fn, split = caller or caller_name(p), "split the call over fewer queries or documents"
    scores = out.reshape(p.nq, p.nd) if out is not None else empty((p.nq, p.nd), np.float32, f"{fn}: scores", split)
    amax = empty((p.nq, p.nd, p.lq), np.int32, f"{fn}: argmax",
                 f"return_argmax=False needs no argmax buffer; or {split}") if return_argmax else None
    if env.poison_outputs():
        scores.fill(np.float32(-1.2345e33))
        if amax is not None:
            amax.fill(-77)
    if p.nq == 0 or p.nd == 0:
        return scores, amax
    if p.lq == 0:  # no query token: empty sums
        scores.fill(0)
        return scores, amax
    if d.shape[0] == 0 or (d_off is None and p.ld == 0):  # every document empty: -inf, or 0 for an empty query
        valid = (ql > 0) if ql is not None else qm.any(axis=1) if qm is not None else cupy.ones(p.nq, bool)
        scores[...] = cupy.where(valid.reshape(p.nq, 1), np.float32(-np.inf), np.float32(0))
        if amax is not None:
            amax.fill(-1)
        return scores, amax

    props = device_properties(device)
    esize = q.dtype.itemsize
    if residual is not None and q.data.ptr % 16:  # the residual tiles copy 16-byte query chunks
        q = q.copy()
    vec = (p.dim * esize) % 16 == 0 and q.data.ptr % 16 == 0 and (residual is not None or d.data.ptr % 16 == 0)
    shared = 1 if p.candidates else p.nq
    ld = ld_hint if ld_hint is not None else p.ld
    arch = dispatch.arch_of(props.cc)

    if dm is not None and dl is None:  # the kernel then skips each document's padding (masks.py)
        dl = mask_spans(dm, device)
    rows = d.size // p.dim  # D as [rows, dim] (padded, candidate or packed layout)
    use_tma = (residual is None and tma_usable() and vec and max(rows, p.nq * p.lq) <= tma.MAX_ROWS
               and (d_scale is None or d_scale.data.ptr % 16 == 0))

    def choose(wgmma: bool):
        if residual is not None:
            return dispatch.choose_residual(props.cc, p.dtype, p.dim, p.lq, residual.nbits, return_argmax, shared,
                                            d_off is not None, cand is not None)
        return dispatch.choose_forward(props.cc, p.dtype, p.dim, p.lq, return_argmax, vec, wgmma, shared, ld,
                                       d_off is not None, use_tma and wgmma, x3, cand is not None)

    cfg = choose(not env.wgmma_disabled())
    try:
        mod, func = _kernel(cfg, arch, device)
    except CompileError as e:
        if not (cfg.wgmma or cfg.tma):  # only the sm_90a builds have a fallback
            raise
        _warn_wgmma_once(e)
        cfg = choose(False)
        mod, func = _kernel(cfg, arch, device)
    ntok = d.shape[0] if d_off is not None else 0
    plan = dispatch.plan_launch(cfg, props.cc, props.num_sms, p.nq, p.nd, p.lq, shared, ntok)
    stream = cupy.cuda.get_current_stream()
    if plan.token_split and stream.is_capturing():  # see token_split.py
        plan = dispatch.plan_launch(cfg, props.cc, props.num_sms, p.nq, p.nd, p.lq, shared)
    if d_off is None:  # few long padded documents: the same tile on the token split (strided)
        cfg, func, plan, ntok = _padded_split(cfg, func, plan, p, props, arch, device, shared, stream)
    # Packed documents: the CTAs' search of the offsets samples up to one block (1,024 threads at
    # most) past Nd in 32-bit ints.
    searched = p.nd + 1024 if d_off is not None else 0
    if max(p.nq, p.nd, p.lq, p.ld, plan.grid[0], searched) >= 2**31:
        check_32bit(Nq=p.nq, Nd=p.nd, Lq=p.lq, Ld=p.ld, grid=plan.grid[0], **{"packed Nd + 1024": searched})

    part = scores if plan.n_qt == 1 else empty((plan.n_qt, p.nq, p.nd), np.float32,
                                               f"{fn}: partial scores of the long queries' tiles", split)
    off_flags = (1 if d_off is None or d_off.dtype == np.int64 else 0) | (2 if d_off_whole else 0)
    values = (
        q.data.ptr, d.data.ptr, _ptr(q_scale), _ptr(d_scale), _ptr(ql), _ptr(qm), _ptr(dl), _ptr(dm), _ptr(d_off),
        off_flags, ntok, part.data.ptr, _ptr(amax),
        p.nq, p.nd, p.lq, p.ld, p.dim, plan.n_qt, plan.qb, plan.docs_per_cta, p.nd if p.candidates else 0,
    )
    # The by-value parameters after the fixed ones: the residual kernel's, then the candidate ids'.
    maps = (() if residual is None else (residual,)) + (() if cand is None else (cand,))
    if cfg.tma:
        dmap = tma.tile_map(d.data.ptr, rows, p.dim * esize, cfg.bn)
        smap = tma.scale_map(d_scale.data.ptr, rows, cfg.bn + 4) if d_scale is not None else dmap
        qmap = tma.tile_map(q.data.ptr, p.nq * p.lq, p.dim * esize, cfg.bm) if cfg.split else dmap
        maps = (dmap, smap, qmap)
    try:
        if plan.token_split:
            size = token_split.nbytes(plan.grid[0] * plan.grid[1], cfg.bm, return_argmax)
            token_split.launch(device, stream, size, lambda split: _launch_forward(
                func, plan.grid, cfg.threads, cfg.smem_bytes, stream.ptr, values + split, maps))
        else:
            _launch_forward(func, plan.grid, cfg.threads, cfg.smem_bytes, stream.ptr, values + (0, 0), maps)
        if plan.n_qt > 1:
            n = p.nq * p.nd
            threads = 256
            blocks = min(-(-n // threads), 65535)
            mod.get_function("lik_sum_partials")((blocks,), (threads,), (part, scores, np.int64(n), np.int32(plan.n_qt)))
    except cupy.cuda.driver.CUDADriverError as e:
        raise RuntimeError(
            f"{cfg.name} failed to launch (grid {plan.grid}, Nq={p.nq}, Nd={p.nd}, Lq={p.lq}, Ld={p.ld}, d={p.dim}): {e}"
        ) from e
    return scores, amax
