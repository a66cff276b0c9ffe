"""Compile, ahead of the first request, the kernels a service will use."""

from __future__ import annotations

import numpy as np

from .. import _dispatch as dispatch
from .._base import env
from .._base.device import check_ordinal, device_properties, gpu_available, present
from .kernels import FORWARD, QUANTIZE


def warmup(dims=(128,), dtypes=("float16", "bfloat16"), query_lengths=(32, 1024), argmax=(False,), device=None,
           precision=None) -> int:
    """Compile and load the forward kernels for these problem classes on ``device``.

    Args:
        dims: embedding dims the service will see.
        dtypes: any of "float16", "bfloat16", "float32", "int8", "float8_e4m3fn" (a scaled type also loads
            its on-device quantiser for float16/bfloat16/float32 queries).
        query_lengths: typical query lengths (each picks its tile shape).
        argmax: which of (False, True) to prepare.
        device: CUDA ordinal; default the current CuPy device.
        precision: the float32 kernels to prepare, "fp32" or "tf32" (``lik_cupy.precision``); None:
            the process default (``set_precision``, ``LIK_PRECISION``), else "fp32". A framework's
            own switch is read by each call, not here: pass the precision a service's calls get.

    Returns:
        The number of distinct kernels now loaded. Later calls reuse them from
        memory, and later processes from the on-disk cache.

    Raises:
        RuntimeError: no CUDA GPU is visible (or CuPy is missing); the CPU path needs no warm-up.
        ValueError: an argument out of its range, or a ``device`` this machine lacks.
    """
    from .._dispatch.precision import checked, default

    x3 = checked(precision or default() or "fp32", "precision") == "fp32"
    dims, dtypes, query_lengths, argmax = _checked_args(dims, dtypes, query_lengths, argmax, device)
    if not gpu_available():
        raise RuntimeError("lik_cupy.warmup: no CUDA GPU is visible (CuPy could not find one, or is not installed); "
                           "warmup compiles GPU kernels, and the CPU path (backend='cpu') needs none")
    import cupy

    from .launch import tma_usable
    from .nvrtc import get_module

    dev = cupy.cuda.runtime.getDevice() if device is None else present(device)
    cc = device_properties(dev).cc
    arch = dispatch.arch_of(cc)
    wgmma = not env.wgmma_disabled()  # as a call chooses (launch.prepare)
    names = set()
    for dim in dims:
        for dtype in dtypes:
            spec = dispatch.elem_spec(dtype)
            for lq in query_lengths:
                for am in argmax:
                    for vec in {(dim * spec.bytes) % 16 == 0, False}:
                        try:
                            cfg = dispatch.choose_forward(cc, dtype, dim, lq, am, vec, wgmma,
                                                          tma=vec and wgmma and tma_usable(), x3=x3)
                        except ValueError:
                            # Unaligned operands of a type whose mma.sync this GPU emulates (FP8 on
                            # sm_90): no kernel takes them and such calls are refused, so none to load.
                            if vec or arch not in spec.emulated_mma:
                                raise
                            continue
                        if cfg.name not in names:
                            get_module(FORWARD.file, cfg.defines(), cfg.target(arch), dev)
                            names.add(cfg.name)
    for spec in map(dispatch.elem_spec, dtypes):
        if spec.quantiser_kernel:
            for defines in QUANTIZE.variants:
                get_module(QUANTIZE.file, defines, arch, dev, entry=spec.quantiser_kernel)
                names.add(QUANTIZE.row_name(spec.quantiser_kernel, defines))
    return len(names)


def _checked_args(dims, dtypes, query_lengths, argmax, device) -> tuple:
    """Each argument's type and range, before a GPU is looked for (as a scoring call checks its
    arguments first); the four collections come back as tuples. A string (iterated by character)
    or a bare int reached the kernel selection as dims "1", "2", "8" (a TypeError of string
    formatting) or as "'int' object is not iterable"; a dtype name is one of the kernels' element types."""
    out = []
    kinds = [e.name for e in dispatch.ELEMS]
    for name, values, want, ok in (("dims", dims, "embedding dims, ints >= 1", _count),
                                   ("dtypes", dtypes, f"dtype names ({', '.join(kinds)})",
                                    lambda v: isinstance(v, str) and v in kinds),
                                   ("query_lengths", query_lengths, "ints >= 1", _count),
                                   ("argmax", argmax, "bools", lambda v: isinstance(v, (bool, np.bool_)))):
        try:
            if isinstance(values, (str, bytes)):
                raise TypeError
            values = tuple(values)
        except TypeError:
            raise TypeError(f"{name} must be a tuple or list of {want}, got {values!r}") from None
        bad = [v for v in values if not ok(v)]
        if bad:
            raise ValueError(f"{name} holds {bad[0]!r}; expected {want}")
        out.append(values)
    check_ordinal(device, " or None")
    return tuple(out)


def _count(v) -> bool:
    """An int >= 1 (bools are not counts)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) and v >= 1
