"""The run context of the suites that time through torch (forward, corpus, backward): torch and CuPy on one
allocator, the sleep kernel calibrated, the device described once."""

from __future__ import annotations

import gc
import time

from .results import short_err, slugify, versions
from .timing import calibrate_sleep


class Ctx:
    """Holds lazily imported modules and device facts."""

    def __init__(self, args):
        self.args = args
        import torch
        self.torch = torch
        self.cupy = None
        self.cupy_err = None
        self.cycles_per_ms = None
        self.pad_cycles = 0
        self.t0 = time.time()

    def over_budget(self):
        b = self.args.time_budget
        return b is not None and (time.time() - self.t0) > b


# --------------------------------------------------------------------------- cupy <-> torch allocator

def unit_tokens(torch, *shape, dtype=None, generator=None, device="cuda"):
    """Random unit-norm tokens ``shape`` on ``device`` (the GPU by default): float32 normal draws (from
    ``generator``, else torch's default) over their last axis's norm, then ``dtype`` (float16 by default)."""
    x = torch.randn(*shape, device=device, dtype=torch.float32, generator=generator)
    x = x / x.norm(dim=-1, keepdim=True)
    return x.to(dtype or torch.float16)


def setup_cupy(ctx):
    """CuPy allocates through torch's caching allocator from here on (one peak-memory counter for both);
    ``ctx.cupy`` is CuPy, or None with the reason in ``ctx.cupy_err``."""
    try:
        import cupy
    except Exception as e:  # noqa: BLE001
        ctx.cupy_err = short_err(e)
        return
    torch = ctx.torch

    def torch_alloc(size):
        # One allocator for both frameworks: the torch tensor owns the memory and
        # is kept alive by the UnownedMemory's owner reference.
        t = torch.empty(max(int(size), 1), dtype=torch.uint8, device="cuda")
        mem = cupy.cuda.UnownedMemory(t.data_ptr(), int(size), t)
        return cupy.cuda.MemoryPointer(mem, 0)

    try:
        cupy.cuda.set_allocator(torch_alloc)
        ctx.cupy = cupy
    except Exception as e:  # noqa: BLE001
        ctx.cupy_err = short_err(e)


def cupy_stream(ctx):
    """Context manager running CuPy work on torch's current stream."""
    from lik_cupy._base.device import external_stream

    s = ctx.torch.cuda.current_stream()
    return ctx.cupy.cuda.Stream.null if s.cuda_stream == 0 else external_stream(s.cuda_stream, s.device.index)


def safe_cleanup(torch):
    """gc + empty_cache that never raises (the context may be poisoned by a failed kernel)."""
    gc.collect()
    for f in (torch.cuda.synchronize, torch.cuda.empty_cache):
        try:
            f()
        except Exception:  # noqa: BLE001
            pass


# --------------------------------------------------------------------------- the start of a run

def start(args):
    """The start every torch-timed suite shares: torch imported, CuPy on torch's allocator (before anything
    allocates through CuPy), the sleep kernel calibrated, the device read into ``ctx.props``, ``ctx.gpu``,
    ``ctx.slug``, ``ctx.l2`` and ``ctx.total_memory``. Prints the device and the versions; returns ``(ctx,
    meta)``, ``meta`` holding the GPU, its slug, compute capability, SMs, memory, L2 and the versions."""
    ctx = Ctx(args)
    torch = ctx.torch
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device visible to torch")
    setup_cupy(ctx)
    torch.cuda.init()
    props = torch.cuda.get_device_properties(0)
    ctx.props, ctx.gpu = props, torch.cuda.get_device_name(0)
    ctx.slug = slugify(ctx.gpu)
    ctx.l2 = int(getattr(props, "L2_cache_size", 0) or 50 << 20)
    ctx.total_memory = int(props.total_memory)
    calibrate_sleep(ctx)
    meta = {
        "gpu": ctx.gpu, "gpu_slug": ctx.slug,
        "compute_capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "total_memory_bytes": int(props.total_memory),
        "l2_bytes": ctx.l2,
        "versions": versions(ctx),
    }
    print(f"GPU: {ctx.gpu} (cc {meta['compute_capability']}, {props.multi_processor_count} SMs, "
          f"L2 {ctx.l2 / 2**20:.0f} MiB, {props.total_memory / 2**30:.0f} GiB)", flush=True)
    print("versions: " + ", ".join(f"{k}={v}" for k, v in meta["versions"].items()), flush=True)
    return ctx, meta


def warm_up_ours(meta, **kwargs):
    """``lik_cupy.warmup(**kwargs)`` (kernels compiled before anything is timed); its time or its error goes
    into ``meta``."""
    try:
        import lik_cupy
        t0 = time.time()
        lik_cupy.warmup(**kwargs)
        meta["ours_warmup_s"] = time.time() - t0
    except Exception as e:  # noqa: BLE001
        meta["ours_warmup_error"] = short_err(e)
