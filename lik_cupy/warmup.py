"""Compile, ahead of the first request, the kernels a service will use."""

from __future__ import annotations

from . import dispatch
from .device import device_properties


def warmup(dims=(128,), dtypes=("float16", "bfloat16"), query_lengths=(32, 1024), argmax=(False,), device=None) -> int:
    """Compile and load the forward kernels for these problem classes on ``device``.

    Args:
        dims: embedding dims the service will see.
        dtypes: any of "float16", "bfloat16", "float32".
        query_lengths: typical query lengths (each picks its tile shape).
        argmax: which of (False, True) to prepare.
        device: CUDA ordinal; default the current CuPy device.

    Returns:
        The number of distinct kernels now loaded. Later calls reuse them from
        memory, and later processes from the on-disk cache.
    """
    import cupy

    from .compile import get_module

    dev = cupy.cuda.runtime.getDevice() if device is None else int(device)
    cc = device_properties(dev).cc
    arch = dispatch.arch_of(cc)
    names = set()
    for dim in dims:
        for dtype in dtypes:
            for lq in query_lengths:
                for am in argmax:
                    for vec in {(dim * (4 if dtype == "float32" else 2)) % 16 == 0, False}:
                        cfg = dispatch.choose_forward(cc, dtype, dim, lq, am, vec)
                        if cfg.name not in names:
                            get_module("maxsim_fwd.cu", cfg.defines(), cfg.target(arch), dev)
                            names.add(cfg.name)
    return len(names)
