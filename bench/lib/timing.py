"""Event timing shared by the bench scripts (torch CUDA events on the current stream), and the ceilings a
suite's rates are compared with (cuBLAS fp16 matmul, HBM copy)."""

from __future__ import annotations

import statistics
import time

from .results import short_err

CEIL_MATMUL_N = 8192          # cuBLAS fp16 ceiling: n^3 torch.matmul
CEIL_COPY_BYTES = 1 << 30     # HBM ceiling: device-to-device copy of this many bytes (read + write counted)


def per_call_ms(torch, fn, n, *, rounds=3, spin_cycles=0):
    """Median over ``rounds`` of (time of ``n`` back-to-back calls) / n, after one warm-up call.

    ``spin_cycles`` > 0 queues a spin kernel before each round so the host runs ahead and
    launch overhead stays hidden (device time); 0 times what a loop of calls pays, host
    included. CuPy work on the legacy default stream is ordered with torch's.
    """
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if spin_cycles:
            torch.cuda._sleep(spin_cycles)
        s.record()
        for _ in range(n):
            fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / n)
    return statistics.median(times)


def wall_ms(torch, fn, n, *, rounds=3, sync=None):
    """Best of ``rounds`` of (wall time of ``n`` back-to-back calls, one synchronisation after them) / n,
    after one warm-up call: what a loop of calls pays, host included. ``sync``: the synchronisation
    (default ``torch.cuda.synchronize``; a smoke run on the CPU passes one that does nothing)."""
    sync = sync or torch.cuda.synchronize
    fn()
    sync()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t) * 1e3 / n)
    return best


def queued_call_ms(torch, fn, calls: int, wall: float, cycles_per_ms: float | None = None) -> float:
    """GPU time per call: ``per_call_ms`` with the calls queued behind a spin kernel that outlasts
    twice their host time (``wall`` ms each; ``cycles_per_ms`` of the spin, from ``calibrate_sleep``,
    else 2 GHz). Calls of over 0.1 ms (training steps: several launches each) are timed 50 at a time,
    which CUDA's launch queue holds: a longer queue blocks the host until the GPU drains it, and host
    time shows."""
    n = calls if wall < 0.1 else min(calls, 50)
    return per_call_ms(torch, fn, n, spin_cycles=max(40_000_000, int(2 * n * wall * (cycles_per_ms or 2e6))))


def padded_call_ms(torch, fn, reps, pad_cycles):
    """Per-call ms of ``fn(i)`` for i in range(reps): events around each call, each call behind
    its own queued sleep of ``pad_cycles`` (0: none) so the host runs ahead and the call's launch
    overhead stays hidden, while a call that waits inside is charged the wait."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda.synchronize()
    for i in range(reps):
        if pad_cycles:
            torch.cuda._sleep(pad_cycles)
        starts[i].record()
        fn(i)
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def count_mismatches(cp, variants, apply, call, label):
    """For each variant in turn, ``apply(variant)`` then ``call()`` (a tuple result: its first
    array); count and print the variants whose result is not bit for bit the first variant's.
    ``label(variant)`` names a variant in the printed line."""
    ref, mismatches = None, 0
    for v in variants:
        apply(v)
        got = call()
        got = got[0] if isinstance(got, tuple) else got
        if ref is None:
            ref = got
        elif not bool(cp.array_equal(got, ref)):
            mismatches += 1
            print(f"MISMATCH {label(v)}", flush=True)
    return mismatches


# --------------------------------------------------------------------------- the suites' timing (a gpu.Ctx)

def calibrate_sleep(ctx):
    """Measure ``torch.cuda._sleep``'s cycles per ms into ``ctx.cycles_per_ms`` and set ``ctx.pad_cycles`` to
    about 250 us of them (the host's head start before each timed call)."""
    torch = ctx.torch
    if not hasattr(torch.cuda, "_sleep"):
        return
    try:
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        n = 2_000_000
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.cuda._sleep(n)
        e.record()
        torch.cuda.synchronize()
        ms = s.elapsed_time(e)
        if ms > 0:
            ctx.cycles_per_ms = n / ms
            ctx.pad_cycles = int(0.25 * ctx.cycles_per_ms)  # ~250 us of host head start
    except Exception:  # noqa: BLE001
        ctx.pad_cycles = 0


def time_device(ctx, fn, sets, reps):
    """Per-call device ms over ``reps`` calls rotating through ``sets`` (host overhead hidden by a
    spin pad before each call)."""
    n = len(sets)
    return padded_call_ms(ctx.torch, lambda i: fn(sets[i % n]), reps, ctx.pad_cycles)


def time_e2e(ctx, fn, sets, reps):
    """Mean ms of back-to-back calls (includes host overhead if host-bound)."""
    torch = ctx.torch
    n = len(sets)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    s.record()
    for i in range(reps):
        fn(sets[i % n])
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


# --------------------------------------------------------------------------- ceilings

def measure_ceilings(ctx):
    """cuBLAS fp16 TF/s (an n^3 matmul), HBM GB/s (a device-to-device copy, read + write) and their ratio."""
    torch = ctx.torch
    out = {}
    try:
        n = CEIL_MATMUL_N
        g = torch.Generator(device="cuda").manual_seed(1)
        a = torch.randn(n, n, device="cuda", dtype=torch.float16, generator=g)
        b = torch.randn(n, n, device="cuda", dtype=torch.float16, generator=g)
        c = torch.empty(n, n, device="cuda", dtype=torch.float16)
        fn = lambda _s: torch.matmul(a, b, out=c)  # noqa: E731
        t_end = time.time() + 0.5  # let clocks ramp up
        while time.time() < t_end:
            fn(None)
            torch.cuda.synchronize()
        ms = statistics.median(time_device(ctx, fn, [None], 50))
        out["matmul_fp16_ms"] = ms
        out["matmul_fp16_n"] = n
        out["cublas_fp16_tflops"] = 2 * n ** 3 / (ms * 1e-3) / 1e12
        del a, b, c
    except Exception as e:  # noqa: BLE001
        out["cublas_fp16_error"] = short_err(e)
    try:
        nbytes = CEIL_COPY_BYTES
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)
        dst = torch.empty_like(src)
        fn = lambda _s: dst.copy_(src)  # noqa: E731
        for _ in range(3):
            fn(None)
        ms = statistics.median(time_device(ctx, fn, [None], 30))
        out["d2d_copy_ms"] = ms
        out["d2d_copy_bytes"] = nbytes
        out["hbm_gbs"] = 2 * nbytes / (ms * 1e-3) / 1e9  # read + write
        del src, dst
    except Exception as e:  # noqa: BLE001
        out["hbm_error"] = short_err(e)
    torch.cuda.empty_cache()
    if "cublas_fp16_tflops" in out and "hbm_gbs" in out:
        out["ridge_flop_per_byte"] = out["cublas_fp16_tflops"] * 1e12 / (out["hbm_gbs"] * 1e9)
    return out


def run_ceilings(ctx, meta):
    """The ceilings (none with ``--no-ceilings``), stored in ``meta["ceilings"]`` and printed."""
    out = {} if ctx.args.no_ceilings else measure_ceilings(ctx)
    meta["ceilings"] = out
    print("ceilings: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in out.items()), flush=True)
    return out


def ceiling_fraction(bound, tflops, gbs, ceilings):
    """The rate as a fraction of its ceiling: TF/s of cuBLAS's when compute-bound, GB/s of HBM's when
    memory-bound; None without that ceiling."""
    if bound == "compute" and ceilings.get("cublas_fp16_tflops"):
        return tflops / ceilings["cublas_fp16_tflops"]
    if bound == "memory" and ceilings.get("hbm_gbs"):
        return gbs / ceilings["hbm_gbs"]
    return None
