"""MaxSim forward: ``maxsim`` and ``maxsim_pairs``.

Each call is validate (``validate.check_call``), choose (``dispatch``),
launch (``_launch`` below), or the NumPy path (``cpu.maxsim_numpy``).
"""

from __future__ import annotations

import os
import warnings

import numpy as np

from . import cpu, dispatch, interop
from .device import device_properties, gpu_available
from .validate import Problem, check_call, check_length_values

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
        CuPy or PyTorch stream without a host synchronisation (except reading the
        range of device-resident length arrays).
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


def _run(Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax, backend, *, pairs):
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    p = check_call(Q, D, q_mask, d_mask, q_lengths, d_lengths, pairs=pairs)
    on_gpu = backend == "gpu" or (backend == "auto" and (p.device is not None or gpu_available()))
    if on_gpu and not gpu_available():
        raise RuntimeError("backend='gpu' but no CUDA GPU is visible (CuPy could not find one)")
    if on_gpu and p.dim > dispatch.MAX_DIM:
        raise ValueError(f"Q and D have dim {p.dim}; the GPU kernels support dim up to {dispatch.MAX_DIM} (backend='cpu' has no limit)")
    if on_gpu:
        scores, amax = _gpu(p, Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax)
    else:
        scores, amax = _cpu(p, Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax)
    return (scores, amax) if return_argmax else scores


# ---------------------------------------------------------------- CPU


def _host(x, fw):
    if isinstance(x, (list, tuple, int, np.integer)):
        return np.asarray(x)
    return interop.to_numpy(x, fw)


def _valid_host(mask, lengths, rows: int, length: int, name: str) -> np.ndarray:
    if mask is not None:
        return mask.reshape(rows, length).astype(bool, copy=False)
    if lengths is not None:
        lens = lengths.reshape(rows).astype(np.int64)
        if lens.size:
            check_length_values(name, int(lens.min()), int(lens.max()), length)
        return np.arange(length)[None, :] < lens[:, None]
    return np.ones((rows, length), bool)


def _cpu(p: Problem, Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax):
    fw = p.framework
    q = _host(Q, fw).reshape(p.nq, p.lq, p.dim)
    nrows = p.nq * p.nd if p.candidates else p.nd
    d = _host(D, fw).reshape(nrows, p.ld, p.dim)
    qv = _valid_host(None if q_mask is None else _host(q_mask, fw), None if q_lengths is None else _host(q_lengths, fw),
                     p.nq, p.lq, "q_lengths")
    dv = _valid_host(None if d_mask is None else _host(d_mask, fw), None if d_lengths is None else _host(d_lengths, fw),
                     nrows, p.ld, "d_lengths")
    s, a = cpu.maxsim_numpy(q, d, qv, dv, candidates=p.candidates, nd=p.nd, return_argmax=return_argmax)
    s = s.reshape(p.scores_shape)
    a = a.reshape(p.argmax_shape) if a is not None else None
    return _host_result(s, p), (_host_result(a, p) if a is not None else None)


def _host_result(a: np.ndarray, p: Problem):
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
    return cupy.asarray(interop.to_numpy(x, fw)) if on_host else interop.to_cupy(x, fw)


def _gpu(p: Problem, Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax):
    import cupy

    fw = p.framework
    on_host = p.device is None
    device = p.device if p.device is not None else cupy.cuda.runtime.getDevice()
    with interop.caller_stream(fw, device):
        q = _dev_array(Q, fw, on_host)
        d = _dev_array(D, fw, on_host)
        if p.dtype == "bfloat16":
            q, d = q.view(cupy.uint16), d.view(cupy.uint16)
        nrows = p.nq * p.nd if p.candidates else p.nd
        qm = dm = ql = dl = None
        if q_mask is not None:
            qm = _dev_array(q_mask, fw, on_host).view(cupy.uint8).reshape(p.nq, p.lq)
        if d_mask is not None:
            dm = _dev_array(d_mask, fw, on_host).view(cupy.uint8).reshape(nrows, p.ld)
        if q_lengths is not None:
            ql = _lengths(_dev_array(q_lengths, fw, on_host), p.nq, p.lq, "q_lengths")
        if d_lengths is not None:
            dl = _lengths(_dev_array(d_lengths, fw, on_host), nrows, p.ld, "d_lengths")
        scores, amax = _launch(p, q, d, qm, dm, ql, dl, return_argmax, device)
        scores = interop.from_cupy(scores.reshape(p.scores_shape), fw, on_host)
        if amax is not None:
            amax = interop.from_cupy(amax.reshape(p.argmax_shape), fw, on_host)
    return scores, amax


def _lengths(a, rows: int, limit: int, name: str):
    import cupy

    a = a.reshape(rows)
    if rows:
        lo, hi = (int(v) for v in cupy.stack([a.min(), a.max()]).get())  # the one sync: a range check
        check_length_values(name, lo, hi, limit)
    return cupy.ascontiguousarray(a, dtype=cupy.int32)


def _wgmma_enabled() -> bool:
    return os.environ.get("LIK_CUPY_DISABLE_WGMMA", "") not in ("1", "true", "yes")


_wgmma_warned = False


def _warn_wgmma_once(err: Exception) -> None:
    global _wgmma_warned
    if not _wgmma_warned:
        _wgmma_warned = True
        warnings.warn(f"lik_cupy: the Hopper (sm_90a) kernel failed to build, using the portable kernel instead: {err}",
                      RuntimeWarning, stacklevel=4)


def _launch(p: Problem, q, d, qm, dm, ql, dl, return_argmax: bool, device: int):
    """Choose the kernel configuration and launch it on the current CuPy stream."""
    import cupy

    from .compile import CompileError, get_module

    scores = cupy.empty((p.nq, p.nd), cupy.float32)
    amax = cupy.empty((p.nq, p.nd, p.lq), cupy.int32) if return_argmax else None
    if _POISON:
        scores.fill(np.float32(-1.2345e33))
        if amax is not None:
            amax.fill(-77)
    if p.nq == 0 or p.nd == 0:
        return scores, amax
    if p.lq == 0:  # no query token: empty sums
        scores.fill(0)
        return scores, amax
    if p.ld == 0:
        scores.fill(-np.inf)
        return scores, amax

    props = device_properties(device)
    esize = 4 if p.dtype == "float32" else 2
    vec = (p.dim * esize) % 16 == 0 and q.data.ptr % 16 == 0 and d.data.ptr % 16 == 0
    cfg = dispatch.choose_forward(props.cc, p.dtype, p.dim, p.lq, return_argmax, vec, wgmma=_wgmma_enabled())
    arch = dispatch.arch_of(props.cc)
    try:
        mod = get_module("maxsim_fwd.cu", cfg.defines(), cfg.target(arch), device)
    except CompileError as e:
        if not cfg.wgmma:
            raise
        _warn_wgmma_once(e)
        cfg = dispatch.choose_forward(props.cc, p.dtype, p.dim, p.lq, return_argmax, vec, wgmma=False)
        mod = get_module("maxsim_fwd.cu", cfg.defines(), cfg.target(arch), device)
    plan = dispatch.plan_launch(cfg, props.cc, props.num_sms, p.nq, p.nd, p.lq)
    for n, v in (("Nq", p.nq), ("Nd", p.nd), ("Lq", p.lq), ("Ld", p.ld), ("grid", plan.grid[0])):
        if v >= 2**31:
            raise ValueError(f"{n} = {v} does not fit the kernel's 32-bit index; split the call")

    kern = mod.get_function(cfg.name)
    if cfg.smem_bytes > 48 * 1024:
        kern.max_dynamic_shared_size_bytes = cfg.smem_bytes
    out = scores if plan.n_qt == 1 else cupy.empty((plan.n_qt, p.nq, p.nd), cupy.float32)
    null = np.uint64(0)  # NULL pointer argument
    args = (
        q, d,
        ql if ql is not None else null, qm if qm is not None else null,
        dl if dl is not None else null, dm if dm is not None else null,
        out, amax if amax is not None else null,
        np.int32(p.nq), np.int32(p.nd), np.int32(p.lq), np.int32(p.ld), np.int32(p.dim),
        np.int32(plan.n_qt), np.int32(plan.docs_per_cta), np.int32(p.nd if p.candidates else 0),
    )
    try:
        kern(plan.grid, (cfg.threads, 1, 1), args, shared_mem=cfg.smem_bytes)
        if plan.n_qt > 1:
            n = p.nq * p.nd
            threads = 256
            blocks = min(-(-n // threads), 65535)
            mod.get_function("lik_sum_partials")((blocks,), (threads,), (out, scores, np.int64(n), np.int32(plan.n_qt)))
    except cupy.cuda.driver.CUDADriverError as e:
        raise RuntimeError(
            f"{cfg.name} failed to launch (grid {plan.grid}, Nq={p.nq}, Nd={p.nd}, Lq={p.lq}, Ld={p.ld}, d={p.dim}): {e}"
        ) from e
    return scores, amax
