"""MaxSim forward: ``maxsim`` and ``maxsim_pairs``.

Each call is validate (``validate.check_call``), choose (``dispatch``),
launch (``_launch`` below), or the NumPy path (``cpu.maxsim_numpy``).
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
import warnings
from dataclasses import replace

import numpy as np

from . import cpu, dispatch, interop, tma, token_split
from .device import allocating, device_properties, empty, gpu_available
from .checks import DeviceChecks, queue_or_verify
from .masks import mask_spans
from .validate import Problem, check_32bit, check_call, check_length_values, check_offset_values, check_varlen

_BACKENDS = ("auto", "gpu", "cpu")
# Tests set LIK_CUPY_POISON=1 so every output buffer starts as garbage and an
# element the kernel forgot to write cannot pass as a plausible value.
_POISON = os.environ.get("LIK_CUPY_POISON") == "1"


def maxsim(Q, D, q_mask=None, d_mask=None, *, q_lengths=None, d_lengths=None, return_argmax=False, backend="auto"):
    """Late-interaction score ``sum_s max_t <Q[i, s], D[j, t]>`` without the ``[Nq, Nd, Lq, Ld]`` tensor.

    Args:
        Q: ``[Nq, Lq, d]`` or ``[Lq, d]`` query token embeddings.
        D: ``[Nd, Ld, d]`` documents scored against every query -> scores ``[Nq, Nd]``;
            ``[Nq, K, Ld, d]`` a candidate set per query (reranking) -> ``[Nq, K]``;
            ``[Ld, d]`` one document -> ``[Nq]``. A 2-D ``Q`` drops the leading axis.
            Q and D share a dtype: float16, bfloat16 or float32 (float32 runs on
            TF32 tensor cores, about 1e-3 relative error), and a framework: NumPy,
            CuPy, PyTorch (CUDA or CPU), JAX, or any DLPack producer.
        q_mask: bool ``Q.shape[:-1]``, True = valid token. Masked query tokens add nothing.
        d_mask: bool ``D.shape[:-1]``. Masked document tokens never win the max.
        q_lengths: int ``Q.shape[:-2]``: the first ``q_lengths[i]`` tokens are valid (instead of q_mask).
        d_lengths: int ``D.shape[:-2]``: likewise for documents (instead of d_mask).
        return_argmax: also return int32 ``scores.shape + (Lq,)``: the winning document
            token per query token (lowest index on ties), -1 for masked query tokens and
            empty documents.
        backend: "auto" (GPU for device arrays, and for host arrays when a GPU is
            present), "gpu", or "cpu" (exact NumPy path).

    Returns:
        float32 scores (and the argmax) in the caller's framework, on the caller's
        device. A document with no valid token scores -inf; a query with no valid
        token scores 0 (also against an empty document); a NaN in any unmasked
        similarity makes that score NaN. Device work runs on the caller's current
        CuPy or PyTorch stream without a host synchronisation, except that a call with
        device-resident lengths waits for their range check (a small kernel on a stream
        of its own, beside the scoring kernel) before it returns.
    """
    return _run(Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax, backend, pairs=False)


def maxsim_pairs(Q, D, q_mask=None, d_mask=None, *, q_lengths=None, d_lengths=None, return_argmax=False,
                 backend="auto"):
    """Diagonal MaxSim: ``score[b] = maxsim(Q[b], D[b])``.

    Args:
        Q: ``[B, Lq, d]``; D: ``[B, Ld, d]``; masks ``[B, Lq]`` / ``[B, Ld]`` or lengths ``[B]``.
        Other arguments as in :func:`maxsim`.

    Returns:
        float32 ``[B]`` (and int32 argmax ``[B, Lq]`` if asked).
    """
    return _run(Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax, backend, pairs=True)


def maxsim_varlen(Q, D_tokens, d_offsets, q_mask=None, *, q_lengths=None, q_offsets=None, return_argmax=False,
                  validate_offsets=True, backend="auto"):
    """MaxSim against packed (ragged) documents: no work is spent on padding.

    Args:
        Q: ``[Nq, Lq, d]`` or ``[Lq, d]`` padded queries (with ``q_mask`` / ``q_lengths``
            as in :func:`maxsim`), or packed query tokens ``[Tq, d]`` with ``q_offsets``.
        D_tokens: ``[T, d]`` the documents' tokens back to back, same dtype and
            framework/device as Q (float16, bfloat16 or float32).
        d_offsets: int32 or int64 ``[Nd + 1]``: document j is ``D_tokens[d_offsets[j]:d_offsets[j + 1]]``
            (FlashAttention's ``cu_seqlens``). Must start at 0, never decrease and end at T;
            equal neighbours are empty documents (score -inf). Device offsets are checked by
            one small kernel running beside the scoring kernel, never copied to the host; the
            call waits for the check (not for the scores) before it returns.
        q_offsets: int32 or int64 ``[Nq + 1]`` for packed queries (read on the host:
            the longest query sets the argmax width).
        return_argmax: also return int32 ``[Nq, Nd, Lq]`` document-local token indices
            (``Lq`` = the longest query for packed queries), -1 for masked/absent query
            tokens and empty documents.
        validate_offsets: False skips the device check of ``d_offsets`` (and the wait for it) in
            a hot loop over offsets already known good. The kernel clamps every document
            to ``[0, T)``, so bad offsets then give wrong scores but never touch memory
            outside ``D_tokens``.

    Returns:
        float32 ``[Nq, Nd]`` (``[Nd]`` for a 2-D padded Q), in the caller's framework
        and device; semantics as in :func:`maxsim`.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    p = check_varlen(Q, D_tokens, d_offsets, q_mask, q_lengths, q_offsets)
    on_gpu = _use_gpu(p, backend)
    if on_gpu:
        scores, amax = _gpu_varlen(p, Q, D_tokens, d_offsets, q_mask, q_lengths, q_offsets, return_argmax,
                                   validate_offsets)
    else:
        scores, amax = _cpu_varlen(p, Q, D_tokens, d_offsets, q_mask, q_lengths, q_offsets, return_argmax)
    return (scores, amax) if return_argmax else scores


def _use_gpu(p: Problem, backend: str) -> bool:
    on_gpu = backend == "gpu" or (backend == "auto" and (p.device is not None or gpu_available()))
    if on_gpu and not gpu_available():
        raise RuntimeError("backend='gpu' but no CUDA GPU is visible (CuPy could not find one)")
    if on_gpu and p.dtype == "int8" and not dispatch.int8_dim_ok(p.dim):
        raise ValueError(f"Q and D have dim {p.dim}; the INT8 kernels need a multiple of 16 up to "
                         f"{dispatch.MAX_DIM_INT8} (backend='cpu' takes any dim)")
    if on_gpu and p.dim > dispatch.MAX_DIM:
        raise ValueError(f"Q and D have dim {p.dim}; the GPU kernels support dim up to {dispatch.MAX_DIM} (backend='cpu' has no limit)")
    return on_gpu


def _run(Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax, backend, *, pairs):
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    p = check_call(Q, D, q_mask, d_mask, q_lengths, d_lengths, pairs=pairs)
    if _use_gpu(p, backend):
        scores, amax = _gpu(p, Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax)
    else:
        scores, amax = _cpu(p, Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax)
    return (scores, amax) if return_argmax else scores


# ---------------------------------------------------------------- CPU


def _host(x, fw):
    if isinstance(x, (list, tuple, int, np.integer)):
        return np.asarray(x)
    return interop.to_numpy(x, fw)


def valid_host(mask, lengths, rows: int, length: int, name: str, fw: str) -> np.ndarray:
    """One side's valid tokens on the host: bool [rows, length] from a mask, range-checked
    lengths, or all True."""
    if mask is not None:
        return _host(mask, fw).reshape(rows, length).astype(bool, copy=False)
    if lengths is not None:
        lens = _host(lengths, fw).reshape(rows).astype(np.int64)
        if lens.size:
            check_length_values(name, int(lens.min()), int(lens.max()), length)
        return np.arange(length)[None, :] < lens[:, None]
    return np.ones((rows, length), bool)


def _cpu(p: Problem, Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax):
    fw = p.framework
    q = _host(Q, fw).reshape(p.nq, p.lq, p.dim)
    nrows = p.nq * p.nd if p.candidates else p.nd
    d = _host(D, fw).reshape(nrows, p.ld, p.dim)
    qv = valid_host(q_mask, q_lengths, p.nq, p.lq, "q_lengths", fw)
    dv = valid_host(d_mask, d_lengths, nrows, p.ld, "d_lengths", fw)
    s, a = cpu.maxsim_numpy(q, d, qv, dv, candidates=p.candidates, nd=p.nd, return_argmax=return_argmax)
    s = s.reshape(p.scores_shape)
    a = a.reshape(p.argmax_shape) if a is not None else None
    return _host_result(s, p), (_host_result(a, p) if a is not None else None)


def host_offsets(off: np.ndarray, total: int, name: str) -> np.ndarray:
    """int64 copy of host offsets after the value checks."""
    off = np.ascontiguousarray(off, dtype=np.int64).reshape(-1)
    check_offset_values(name, int(off[0]), int(off[-1]), bool((np.diff(off) < 0).any()), total)
    return off


def _cpu_varlen(p: Problem, Q, D, d_offsets, q_mask, q_lengths, q_offsets, return_argmax):
    fw = p.framework
    d = _host(D, fw).reshape(p.ntok, p.dim)
    doff = host_offsets(_host(d_offsets, fw), p.ntok, "d_offsets")
    if q_offsets is not None:
        qt = _host(Q, fw).reshape(-1, p.dim)
        q, qv = cpu.unpack(qt, host_offsets(_host(q_offsets, fw), qt.shape[0], "q_offsets"))
    else:
        q = _host(Q, fw).reshape(p.nq, p.lq, p.dim)
        qv = valid_host(q_mask, q_lengths, p.nq, p.lq, "q_lengths", fw)
    s, a = cpu.maxsim_packed_numpy(q, qv, d, doff, return_argmax=return_argmax)
    lq = q.shape[1]
    s = s.reshape(p.scores_shape)
    a = a.reshape(p.scores_shape + (lq,)) if a is not None else None
    return _host_result(s, p), (_host_result(a, p) if a is not None else None)


def _host_result(a: np.ndarray, p: Problem | interop.Info):  # anything with .device and .framework
    if p.device is None:
        return interop.from_numpy(a, p.framework)
    import cupy  # device inputs forced onto the CPU path: hand results back on their device

    with cupy.cuda.Device(p.device):
        return interop.from_cupy(cupy.asarray(a), p.framework, on_host=False)


# ---------------------------------------------------------------- GPU


def _dev_array(x, fw, on_host: bool):
    import cupy

    if isinstance(x, (list, tuple, int, np.integer)):
        return cupy.asarray(np.asarray(x))
    if not on_host:
        return interop.to_cupy(x, fw)
    h = interop.to_numpy(x, fw)
    with allocating(f"host array {list(h.shape)} {h.dtype} copied to the GPU", h.nbytes,
                    "pass device arrays, or split the call"):
        return cupy.asarray(h)


def _name(p: Problem) -> str:
    """The public function a problem came from, for error messages."""
    return "maxsim" + ("_int8" if p.dtype == "int8" else "") + ("_varlen" if p.d_packed else "")


def _gpu(p: Problem, Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax):
    import cupy

    fw = p.framework
    on_host = p.device is None
    device = p.device if p.device is not None else cupy.cuda.runtime.getDevice()
    with DeviceChecks() as checks:
        with interop.caller_stream(fw, device):
            q = _dev_array(Q, fw, on_host)
            d = _dev_array(D, fw, on_host)
            if p.dtype == "bfloat16":
                q, d = q.view(cupy.uint16), d.view(cupy.uint16)
            nrows = p.nq * p.nd if p.candidates else p.nd
            qm, ql = device_valid(q_mask, q_lengths, p.nq, p.lq, "q_lengths", fw, on_host, checks)
            dm, dl = device_valid(d_mask, d_lengths, nrows, p.ld, "d_lengths", fw, on_host, checks)
            scores, amax = _launch(p, q, d, qm, dm, ql, dl, return_argmax, device)
            results = _caller_results(p, scores, amax, on_host)
        checks.verify()  # last, while the scoring kernel runs (checks.py)
    return results


def device_valid(mask, lengths, rows: int, length: int, name: str, fw: str, on_host: bool, checks=None):
    """One side's valid tokens on the device: (uint8 mask [rows, length] or None,
    range-checked int32 lengths [rows] or None). With ``checks`` (a ``DeviceChecks``) the
    range check is queued there for the caller to verify; without, it is verified here."""
    import cupy

    m = None if mask is None else _dev_array(mask, fw, on_host).view(cupy.uint8).reshape(rows, length)
    n = None
    if lengths is not None:
        a = cupy.ascontiguousarray(_dev_array(lengths, fw, on_host).reshape(rows))
        if rows:
            queue_or_verify(checks, "lengths", a, length, name)
        n = a if a.dtype == np.int32 else a.astype(cupy.int32)
    return m, n


def _caller_results(p: Problem, scores, amax, on_host: bool):
    """Scores (and argmax) in the caller's framework and shapes."""
    scores = interop.from_cupy(scores.reshape(p.scores_shape), p.framework, on_host)
    if amax is not None:
        amax = interop.from_cupy(amax.reshape(p.argmax_shape), p.framework, on_host)
    return scores, amax


def device_offsets(off, total: int, name: str, check: bool = True, checks=None, *, wide: bool = False):
    """Contiguous device offsets, int32 kept as given (the forward kernel reads either width)
    and int64 otherwise, or always int64 with ``wide``. ``check`` runs the value checks on the
    device (no copy of the array): queued on ``checks`` (a ``DeviceChecks``) for the caller to
    verify, or verified here."""
    import cupy

    off = off.reshape(-1)
    off = cupy.ascontiguousarray(off, dtype=cupy.int64 if wide or off.dtype != np.int32 else cupy.int32)
    if check:
        queue_or_verify(checks, "offsets", off, total, name)
    return off


def _gpu_varlen(p: Problem, Q, D, d_offsets, q_mask, q_lengths, q_offsets, return_argmax, validate: bool):
    import cupy

    fw = p.framework
    on_host = p.device is None
    device = p.device if p.device is not None else cupy.cuda.runtime.getDevice()
    with DeviceChecks() as checks:
        with interop.caller_stream(fw, device):
            q = _dev_array(Q, fw, on_host)
            d = _dev_array(D, fw, on_host).reshape(p.ntok, p.dim)
            if p.dtype == "bfloat16":
                q, d = q.view(cupy.uint16), d.view(cupy.uint16)
            doff = device_offsets(_dev_array(d_offsets, fw, on_host), p.ntok, "d_offsets", validate, checks)
            qm = None
            if q_offsets is not None:
                q, ql = _unpack_queries(q.reshape(-1, p.dim), _dev_array(q_offsets, fw, on_host), p.nq)
                p = replace(p, lq=q.shape[1], argmax_shape=p.scores_shape + (q.shape[1],))
            else:
                q = q.reshape(p.nq, p.lq, p.dim)
                qm, ql = device_valid(q_mask, q_lengths, p.nq, p.lq, "q_lengths", fw, on_host, checks)
            ld_hint = -(-p.ntok // max(1, p.nd))
            scores, amax = _launch(p, q, d, qm, None, ql, None, return_argmax, device, d_off=doff, ld_hint=ld_hint)
            results = _caller_results(p, scores, amax, on_host)
        checks.verify()  # last, while the scoring kernel runs (checks.py)
    return results


def _unpack_queries(qt, q_offsets, nq: int):
    """Packed queries [Tq, d] -> padded [nq, Lq_max, d] plus int32 lengths (queries are small;
    their offsets are read on the host to size the tile)."""
    import cupy

    off = host_offsets(cupy.asnumpy(q_offsets), qt.shape[0], "q_offsets")
    lens = np.diff(off)
    lq = int(lens.max()) if nq else 0
    if lq == 0 or qt.shape[0] == 0:
        return cupy.zeros((nq, lq, qt.shape[1]), qt.dtype), cupy.zeros(nq, cupy.int32)
    rows = np.minimum(off[:-1, None] + np.arange(lq)[None, :], qt.shape[0] - 1)  # rows past a length are masked
    q = qt[cupy.asarray(rows)]
    return cupy.ascontiguousarray(q), cupy.asarray(lens.astype(np.int32))


def _wgmma_enabled() -> bool:
    return os.environ.get("LIK_CUPY_DISABLE_WGMMA", "") not in ("1", "true", "yes")


def tma_usable() -> bool:
    """Whether Hopper tiles may stage documents by TMA here (not turned off, and the driver
    can build tensor maps); dispatch decides which tiles do."""
    return os.environ.get("LIK_CUPY_DISABLE_TMA", "") not in ("1", "true", "yes") and tma.available()


_wgmma_warned = False


def _warn_wgmma_once(err: Exception) -> None:
    global _wgmma_warned
    if not _wgmma_warned:
        _wgmma_warned = True
        warnings.warn(f"lik_cupy: the Hopper (sm_90a) kernel failed to build, using the portable kernel instead: {err}",
                      RuntimeWarning, stacklevel=4)


# (device, kernel name) -> (module, the kernel's CUfunction handle on that device): spares each
# call the cache-key building; its size is bounded by the configurations dispatch can return.
_kernels: dict = {}


def _kernel(cfg, arch: int, device: int):
    """The loaded module of ``cfg`` and its kernel's driver handle on ``device`` (the current one)."""
    from .compile import get_module

    hit = _kernels.get((device, cfg.name))
    if hit is None:
        mod = get_module("maxsim_fwd.cu", cfg.defines(), cfg.target(arch), device)
        kern = mod.get_function(cfg.name)
        if cfg.smem_bytes > 48 * 1024:
            kern.max_dynamic_shared_size_bytes = cfg.smem_bytes
        hit = _kernels[(device, cfg.name)] = (mod, kern.kernel.ptr)
    return hit


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
    parameter ``values`` (as ``_FWD_SIGNATURE``) and TMA ``maps`` (tma.TensorMap; none for
    kernels without them)."""
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


def _launch(p: Problem, q, d, qm, dm, ql, dl, return_argmax: bool, device: int, *, d_off=None, ld_hint=None,
            d_off_whole=True, out=None, q_scale=None, d_scale=None, caller=None):
    """Choose the kernel configuration and launch it on the current CuPy stream.

    q: [nq, lq, dim] (bfloat16 as uint16); d: padded [rows, ld, dim], or packed
    tokens [T, dim] when ``d_off`` (int32 or int64 [nd + 1] device offsets) is given.
    ``d_off_whole``: the offsets run from 0 to T (not a slice of them), so CTAs split the
    tokens without reading where they start and end (a hint: scores never depend on it).
    ``out``: optional float32 buffer of nq * nd elements for the scores.
    ``p.dtype == "int8"``: q and d are int8 and ``q_scale`` (float32 [nq * lq], non-negative)
    and ``d_scale`` (float32 [rows * ld] or [T]) are their contiguous per-token scales.
    ``caller`` names the public function in error messages (default: the one ``p`` came from).
    """
    import cupy

    from .compile import CompileError

    fn, split = caller or _name(p), "split the call over fewer queries or documents"
    scores = out.reshape(p.nq, p.nd) if out is not None else empty((p.nq, p.nd), np.float32, f"{fn}: scores", split)
    amax = empty((p.nq, p.nd, p.lq), np.int32, f"{fn}: argmax",
                 f"return_argmax=False needs no argmax buffer; or {split}") if return_argmax else None
    if _POISON:
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
    vec = (p.dim * esize) % 16 == 0 and q.data.ptr % 16 == 0 and d.data.ptr % 16 == 0
    shared = 1 if p.candidates else p.nq
    ld = ld_hint if ld_hint is not None else p.ld
    arch = dispatch.arch_of(props.cc)

    if dm is not None and dl is None:  # the kernel then skips each document's padding (masks.py)
        dl = mask_spans(dm, device)
    rows = d.size // p.dim  # D as [rows, dim] (padded, candidate or packed layout)
    use_tma = (tma_usable() and vec and max(rows, p.nq * p.lq) <= tma.MAX_ROWS
               and (d_scale is None or d_scale.data.ptr % 16 == 0))

    def choose(wgmma: bool):
        return dispatch.choose_forward(props.cc, p.dtype, p.dim, p.lq, return_argmax, vec, wgmma, shared, ld,
                                       d_off is not None, use_tma and wgmma)

    cfg = choose(_wgmma_enabled())
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
        off_flags, d.shape[0] if d_off is not None else 0, part.data.ptr, _ptr(amax),
        p.nq, p.nd, p.lq, p.ld, p.dim, plan.n_qt, plan.qb, plan.docs_per_cta, p.nd if p.candidates else 0,
    )
    maps = ()
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
