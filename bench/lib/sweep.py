"""What a tile sweep starts from and writes: ``--out``, the device, a seeded CuPy generator; device time per
call with a configuration forced; ``<name>_<gpu>.json``."""

from __future__ import annotations

import argparse

from .forcing import forcing
from .results import out_dir, write_result
from .timing import per_call_ms


def sweep_setup():
    """The output directory (``--out``, default ``$OUT`` or ``bench/results``), this GPU's properties
    (lik_cupy's) and a seeded CuPy generator."""
    import cupy

    from lik_cupy._base.device import device_properties

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(out_dir()))
    args = ap.parse_args()
    return args.out, device_properties(cupy.cuda.runtime.getDevice()), cupy.random.default_rng(0)


def time_ms(fn):
    """Device ms per call (a spin kernel queued first hides launch overhead; CuPy and torch
    share the legacy default stream)."""
    import torch

    return per_call_ms(torch, fn, 20, spin_cycles=20_000_000)


def forced(cfg, fn):
    """Device ms per call of ``fn`` with ``cfg`` forced."""
    with forcing(cfg):
        return time_ms(fn)


def write_sweep(out: str, name: str, props, rows: list) -> str:
    """Write ``out/<name>_<gpu>.json`` (GPU, compute capability, rows); returns its path."""
    return write_result(out, name, props, rows=rows)
