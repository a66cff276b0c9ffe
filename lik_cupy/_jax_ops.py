"""One public lik_cupy function as a step of a JAX computation (``lik_cupy.jax`` builds on this).

``call`` stages a call of ``lik_cupy.<fn>`` into the traced computation, for the platform XLA
lowers it for (``jax.lax.platform_dependent``):

- CUDA: a ``jax.experimental.buffer_callback`` (jax >= 0.7). When XLA reaches it, XLA's input
  and output buffers are viewed as CuPy arrays (no copy), the public function runs on them
  on XLA's stream (CuPy's view of it, ``_cupy_stream``), and each result is copied device to device
  on that stream into XLA's output buffer (the public functions have no ``out=``). A repeat run
  of ``maxsim`` or ``maxsim_varlen`` with the buffers' shapes, dtypes and alignment takes the
  forward's repeat-call path instead: its prepared call, rebound to XLA's buffers
  (``_interop/xla_buffers.py``), reads their addresses and writes the scores (and argmax) into
  XLA's outputs; no CuPy array, no copy. The host queues work and returns: it never waits for
  the device. Masks and lengths reach the kernels without host-side value checks
  (``_device_arguments``).
- anything else (CPU): a ``jax.pure_callback`` running the NumPy path (``backend="cpu"``).

Both take ``vmap_method="expand_dims"``, and ``lik_cupy._batched_calls`` folds the batch axes
into one call of the public function where the shapes allow.
"""

from __future__ import annotations

import functools
import importlib
import math

import jax
import numpy as np

from ._batched_calls import CallSpec, plan, run_batched

__all__ = ["call", "compile_ahead", "BUFFER_CALLBACK_JAX"]

BUFFER_CALLBACK_JAX = "0.7"  # the first jax whose buffer_callback API this module uses


def call(fn: str, arrays: dict, outs: list, kwargs: dict, backend: str, warm=None) -> tuple:
    """Stage ``lik_cupy.<fn>(**arrays, **kwargs)``; returns its results as JAX arrays shaped and
    typed as ``outs`` (``jax.ShapeDtypeStruct``). ``backend``: "cpu", "gpu" or "auto" (by the
    platform XLA lowers for). ``warm``: called when the CUDA form is traced (compile ahead)."""
    names = tuple(arrays)
    values = tuple(arrays.values())

    def on_cpu(*xs):
        return _host_call(fn, dict(zip(names, xs)), outs, kwargs)

    def on_gpu(*xs):
        return _device_call(fn, dict(zip(names, xs)), outs, kwargs, warm)

    if backend == "cpu":
        return on_cpu(*values)
    if _buffer_callback() is None:
        if backend == "gpu" or jax.default_backend() == "gpu":
            raise RuntimeError(_needs_newer_jax())
        return on_cpu(*values)
    if backend == "gpu":
        return on_gpu(*values)
    return tuple(jax.lax.platform_dependent(*values, cuda=on_gpu, default=on_cpu))


def _spec(fn: str, arrays: dict, kwargs: dict) -> CallSpec:
    return CallSpec(fn, tuple(arrays), tuple(a.ndim for a in arrays.values()), tuple(sorted(kwargs.items())))


@functools.cache
def _public(fn: str):
    return getattr(importlib.import_module("lik_cupy"), fn)


# ---------------------------------------------------------------- CPU: the NumPy path in jax.pure_callback


def _host_call(fn: str, arrays: dict, outs: list, kwargs: dict) -> tuple:
    spec = _spec(fn, arrays, {**kwargs, "backend": "cpu"})
    meta = tuple((tuple(o.shape), np.dtype(o.dtype)) for o in outs)
    return tuple(jax.pure_callback(functools.partial(_host_callback, spec, meta), tuple(outs), *arrays.values(),
                                   vmap_method="expand_dims"))


def _host_callback(spec: CallSpec, meta: tuple, *xs):
    xs = [np.asarray(x) for x in xs]
    k = xs[0].ndim - spec.ranks[0]
    batch = tuple(max(x.shape[i] for x in xs) for i in range(k))
    outs = [np.empty(batch + shape, dtype) for shape, dtype in meta]
    run_batched(spec, functools.partial(_public(spec.fn), **dict(spec.kwargs)), xs, outs, _host_write, np)
    return tuple(outs)


def _host_write(out: np.ndarray, result) -> None:
    out[...] = np.asarray(result).reshape(out.shape)


# ---------------------------------------------------------------- CUDA: jax.experimental.buffer_callback


def _buffer_callback():
    try:
        from jax.experimental.buffer_callback import buffer_callback
    except ImportError:
        return None
    return buffer_callback


def _needs_newer_jax() -> str:
    return (f"lik_cupy.jax on a CUDA device needs jax >= {BUFFER_CALLBACK_JAX} (jax.experimental.buffer_callback, "
            f"which runs the kernels on XLA's stream); this is jax {jax.__version__}. Upgrade jax, or pass "
            "backend='cpu' to score through the NumPy path (a copy to the host and back)")


def _device_call(fn: str, arrays: dict, outs: list, kwargs: dict, warm) -> tuple:
    arrays, kwargs = _device_arguments(fn, arrays, kwargs)
    if warm is not None:
        warm()
    spec = _spec(fn, arrays, {**kwargs, "backend": "gpu"})
    staged = _buffer_callback()(_device_callback(spec), tuple(outs), vmap_method="expand_dims")
    return tuple(staged(*arrays.values()))


def _device_arguments(fn: str, arrays: dict, kwargs: dict) -> tuple[dict, dict]:
    """Arguments of a public function called inside the callback: ``validate=False``, as lik_cupy.jax
    has clamped the lengths and offsets (and marked what they touch NaN) already."""
    return arrays, dict(kwargs, validate=False)


_LEAN = frozenset({"maxsim", "maxsim_varlen"})  # the functions with a repeat-call path (lik_cupy.forward)
_MAX_LEAN = 64  # prepared calls kept per callback


@functools.cache
def _device_callback(spec: CallSpec):
    function = functools.partial(_public(spec.fn), **dict(spec.kwargs))
    # (device, each buffer's shape, dtype and 16-byte alignment) -> the forward's prepared call
    # rebound to XLA's buffers: a repeat run reads their addresses and writes XLA's outputs directly
    lean: dict = {}

    def callback(ctx, outs, *buffers):
        import cupy

        device = _device_of(buffers + tuple(outs))  # first: it names a host buffer's problem
        stream = ctx.stream() if callable(ctx.stream) else ctx.stream  # a method in some jax releases
        key = (device,) + tuple((b.shape, b.dtype, not _interface(b)["data"][0] & 15) for b in buffers) \
            if spec.fn in _LEAN else None
        call = lean.get(key)
        with cupy.cuda.Device(device), _cupy_stream(int(stream), device):
            if call is not None and call.current():
                by = dict(zip(spec.names, buffers))
                call(by["Q"], by.get("D", by.get("D_tokens")), by.get("q_mask"), by.get("d_mask"), by.get("q_lengths"),
                     by.get("d_lengths"), by.get("d_offsets"), out=tuple(outs) if len(outs) > 1 else outs[0])
                return
            views = [_cupy_view(b, device) for b in buffers]
            run_batched(spec, function, views, [_cupy_view(o, device) for o in outs], _device_write, cupy)
            if key is not None and (key in lean or len(lean) < _MAX_LEAN):
                call = _rebound(spec, views)
                if call is not None:
                    lean[key] = call

    return callback


def _rebound(spec: CallSpec, views: list):
    """The prepared call (``lik_cupy._runtime.prepared_calls``) of a one-call run of ``spec`` just
    made on CuPy views of XLA's buffers, rebound to the buffers themselves; None for a batched
    run, or one the repeat path does not take."""
    from ._maxsim_calls import prepared_call

    args = dict(zip(spec.names, views))
    if plan(spec, args) != "single":
        return None
    k = views[0].ndim - spec.ranks[0]
    call = prepared_call(spec.fn, **{n: a.reshape(a.shape[k:]) for n, a in args.items()}, **dict(spec.kwargs))
    return None if call is None else call.rebound("jax")


@functools.lru_cache(maxsize=64)
def _cupy_stream(ptr: int, device: int):
    """CuPy's non-owning view of XLA's stream ``ptr``, built once (a handle XLA reuses for a new
    stream is the same stream to CuPy)."""
    from ._base.device import external_stream

    return external_stream(ptr, device)


def _interface(buffer) -> dict:
    try:
        return buffer.__cuda_array_interface__
    except (AttributeError, RuntimeError):  # a host buffer (jax raises JaxRuntimeError): XLA runs on the CPU
        raise RuntimeError("lik_cupy.jax with backend='gpu' needs the computation on a CUDA device, but XLA "
                           "runs it on the CPU; use backend='auto' or 'cpu' there") from None


def _device_of(buffers) -> int:
    import cupy

    for b in buffers:
        ptr = _interface(b)["data"][0]
        if ptr:
            return int(cupy.cuda.runtime.pointerGetAttributes(ptr).device)
    return cupy.cuda.runtime.getDevice()


def _cupy_view(buffer, device: int):
    """An XLA buffer as a C-contiguous CuPy array (bfloat16 as ml_dtypes' bfloat16), no copy."""
    import cupy

    cai = _interface(buffer)
    shape, dtype = tuple(cai["shape"]), np.dtype(buffer.dtype)
    strides = cai.get("strides")
    if strides is not None and tuple(strides) != _c_strides(shape, dtype.itemsize):
        raise RuntimeError(f"XLA passed a buffer of shape {list(shape)} with strides {list(strides)}; "
                           "lik_cupy.jax expects the default row-major layout")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return cupy.ndarray(shape, dtype)
    mem = cupy.cuda.UnownedMemory(cai["data"][0], nbytes, buffer, device)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0))


def _c_strides(shape: tuple, itemsize: int) -> tuple:
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _device_write(out, result) -> None:
    """Copy ``result`` into XLA's ``out`` on the current (XLA's) stream."""
    import cupy

    if out.size == 0:
        return
    result = result.reshape(out.shape)
    if result.dtype != out.dtype:
        result = result.astype(out.dtype)
    if not result.flags.c_contiguous:
        result = cupy.ascontiguousarray(result)
    out.data.copy_from_device_async(result.data, out.nbytes)


def compile_ahead(dtype: str, dim: int, lq: int, argmax: bool, precision: str | None) -> None:
    """Compile and load the forward kernels a call of this class takes (``lik_cupy.warmup``), so the
    first run does not hold XLA's stream while NVRTC works. Skipped where jax's default device is
    not a GPU: the CUDA form is traced for every platform, and lowered only for CUDA."""
    from ._base.device import gpu_available
    from ._dispatch import elem_spec, kernel_dtype
    from ._runtime.warmup import warmup

    default = jax.config.jax_default_device
    on_gpu = jax.default_backend() == "gpu" and (default is None or getattr(default, "platform", default) == "gpu")
    kernel = kernel_dtype(dtype)
    if on_gpu and lq >= 1 and dim >= 1 and elem_spec(kernel).dim_ok(dim) and gpu_available():
        warmup(dims=(dim,), dtypes=(kernel,), query_lengths=(lq,), argmax=(argmax,), precision=precision)
