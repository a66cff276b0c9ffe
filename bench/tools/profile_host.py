"""Where a small call's host time goes, on one GPU.

A one-query call scores 1,000 ragged documents in about 0.04 ms of GPU time, so the Python
around the launch decides how many calls a second a service gets. This times, for the
ragged single-query shape of ``bench_corpus.py`` (torch and CuPy inputs):

- ``loop_ms``: back-to-back calls, then one synchronisation (what a loop of calls pays);
- ``device_ms``: one call at a time behind a queued sleep, so the host runs ahead (GPU time,
  plus whatever the call waits for inside);
- for checked calls, how long they wait for their checks and how long they take after them;
- a cProfile of the loop (top functions by own time), the time inside each piece of the library
  (validation, interop, choice, launch), and the cost of the CUDA and interop primitives a call
  is built from.

Writes ``profile_host_<gpu>.json`` to $OUT (or bench/results) and prints a table last.

    python bench/tools/profile_host.py
"""

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import lik_cupy  # noqa: E402
from lik_cupy._runtime.device import device_properties  # noqa: E402

from bench.lib.forcing import rebind  # noqa: E402
from bench.lib.results import out_dir, write_result  # noqa: E402
from bench.lib.timing import padded_call_ms  # noqa: E402

N_LOOP = 400


def inputs(framework: str, nq: int = 1, lq: int = 32, nd: int = 1000, d: int = 128, seed: int = 303):
    rng = np.random.default_rng(seed)
    lens = rng.integers(16, 513, size=nd).astype(np.int32)
    off = np.zeros(nd + 1, np.int64)
    off[1:] = np.cumsum(lens)
    T, lmax = int(off[-1]), 512
    q = rng.standard_normal((nq, lq, d), dtype=np.float32).astype(np.float16)
    tok = rng.standard_normal((T, d), dtype=np.float32).astype(np.float16)
    pad = np.zeros((nd, lmax, d), np.float16)
    mask = np.arange(lmax)[None, :] < lens[:, None]
    pad[mask] = tok
    host = dict(Q=q, Dt=tok, off=off.astype(np.int32), off64=off, Dp=pad, mask=mask, lens=lens)
    if framework == "torch":
        return {k: torch.from_numpy(v).cuda() for k, v in host.items()}
    return {k: cp.asarray(v) for k, v in host.items()}


def calls(s):
    m = lik_cupy
    return {
        "varlen": lambda: m.maxsim_varlen(s["Q"], s["Dt"], s["off"]),
        "varlen_int64_offsets": lambda: m.maxsim_varlen(s["Q"], s["Dt"], s["off64"]),
        "varlen_unchecked": lambda: m.maxsim_varlen(s["Q"], s["Dt"], s["off"], validate_offsets=False),
        "padded_d_mask": lambda: m.maxsim(s["Q"], s["Dp"], d_mask=s["mask"]),
        "padded_d_lengths": lambda: m.maxsim(s["Q"], s["Dp"], d_lengths=s["lens"]),
        "padded": lambda: m.maxsim(s["Q"], s["Dp"]),
    }


def device_ms(fn, reps=200, pad_cycles=500_000):
    """Median ms between events around one call, each call behind its own queued sleep (as
    ``bench_corpus.py`` times): a call that waits for the GPU inside shows that wait here."""
    fn()
    return float(np.median(padded_call_ms(torch, lambda i: fn(), reps, pad_cycles)))


def loop_ms(fn, n=N_LOOP):
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) * 1e3 / n)
    return best


def profile(fn, n=N_LOOP, top=22):
    fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def after_checks_us(fn, n=200):
    """Mean microseconds a checked call spends waiting for its checks, and after them until it
    returns (the part not hidden under the scoring kernel)."""
    from lik_cupy._runtime import device_checks as checks

    wait = checks.DeviceChecks._wait
    marks = []

    def timed(self):
        t = time.perf_counter()
        out = wait(self)
        marks.append((t, time.perf_counter()))
        return out

    checks.DeviceChecks._wait = timed
    try:
        waits, afters = [], []
        for _ in range(n):
            torch.cuda._sleep(500_000)
            fn()
            end = time.perf_counter()
            t0, t1 = marks[-1]
            waits.append(t1 - t0)
            afters.append(end - t1)
        torch.cuda.synchronize()
    finally:
        checks.DeviceChecks._wait = wait
    return float(np.median(waits)) * 1e6, float(np.median(afters)) * 1e6


def stages(fn, n=N_LOOP):
    """Mean microseconds per call inside each named piece of the library (inclusive; the pieces
    are wrapped with timers, so nested ones overlap), the launch itself included. A piece is wrapped
    wherever lik_cupy binds it (``rebind``); one this version of lik_cupy lacks is left out, and named."""
    import contextlib
    import functools

    from lik_cupy import _dispatch as dispatch
    from lik_cupy import _interop as interop
    from lik_cupy import _validate as validate
    from lik_cupy._runtime import device, launch, operands
    from lik_cupy._runtime import device_checks as checks

    acc: dict[str, float] = {}

    def timed(name, f):
        @functools.wraps(f)
        def w(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[name] = acc.get(name, 0.0) + time.perf_counter() - t
        return w

    stream = interop.caller_stream

    @contextlib.contextmanager
    def timed_stream(*a, **k):
        t = time.perf_counter()
        with stream(*a, **k):
            acc["caller_stream enter"] = acc.get("caller_stream enter", 0.0) + time.perf_counter() - t
            yield
            t = time.perf_counter()
        acc["caller_stream exit"] = acc.get("caller_stream exit", 0.0) + time.perf_counter() - t

    pieces = [
        (validate, "check_varlen", "validate (check_varlen / check_call)"),
        (validate, "check_call", "validate (check_varlen / check_call)"),
        (interop, "device_array", "inputs to CuPy (device_array)"),
        (operands, "device_offsets", "device_offsets"),
        (operands, "device_valid", "device_valid"),
        (launch, "launch", "launch (all of it)"),
        (device, "empty", "output buffers (device.empty)"),
        (interop, "caller_results", "results to the caller"),
        (launch, "_launch_forward", "kernel launch (driver call)"),
        (dispatch, "choose_forward", "choose_forward (cached)"),
        (dispatch, "plan_launch", "plan_launch (cached)"),
        (checks.DeviceChecks, "verify", "checks.verify"),
    ]
    missing = [f"{getattr(m, '__name__', m)}.{a}" for m, a, _ in pieces if not hasattr(m, a)]
    if missing:
        print(f"not timed (not in this lik_cupy): {', '.join(missing)}", flush=True)
    patches = [(m, a, timed(label, getattr(m, a))) for m, a, label in pieces if hasattr(m, a)]
    patches.append((interop, "caller_stream", timed_stream))
    saved = []
    for m, a, f in patches:
        saved.append((m, a, rebind(m, a, f)))
    try:
        fn()
        torch.cuda.synchronize()
        acc.clear()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        total = time.perf_counter() - t
        torch.cuda.synchronize()
    finally:
        for m, a, f in reversed(saved):
            rebind(m, a, f)
    out = {k: v * 1e6 / n for k, v in sorted(acc.items(), key=lambda kv: -kv[1])}
    out["whole call"] = total * 1e6 / n
    return out


def primitives(s):
    """Per-call microseconds of the pieces a call is made of."""
    t = s["Q"]
    c = cp.asarray(np.zeros(1000, np.float32))
    ev = cp.cuda.Event(disable_timing=True)
    pinned = np.frombuffer(cp.cuda.alloc_pinned_memory(96), np.int64)
    kern = cp.RawKernel(r'extern "C" __global__ void k(float* x) { if (threadIdx.x == 0) x[0] = 1.f; }', "k")
    stream = cp.cuda.get_current_stream()
    ext = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)

    def ext_enter():
        with ext:
            pass

    out = {
        "torch_current_stream": lambda: torch.cuda.current_stream(),
        "cupy_from_dlpack(torch)": lambda: cp.from_dlpack(t),
        "torch_from_dlpack(cupy)": lambda: torch.from_dlpack(c),
        "cupy.cuda.Device(0) enter": lambda: cp.cuda.Device(0).__enter__(),
        "cupy external stream enter/exit": ext_enter,
        "cupy.empty(1000, f32)": lambda: cp.empty(1000, cp.float32),
        "torch.empty(4000, u8)": lambda: torch.empty(4000, dtype=torch.uint8, device="cuda"),
        "rawkernel launch (1 block)": lambda: kern((1,), (32,), (c,)),
        "event record": lambda: ev.record(stream),
        "event record + synchronize": lambda: (ev.record(stream), ev.synchronize()),
        "copy 96 B to pinned + event sync": lambda: (c.data.copy_to_host_async(pinned.ctypes.data, 96, stream),
                                                      ev.record(stream), ev.synchronize()),
        "getDevice": lambda: cp.cuda.runtime.getDevice(),
        "astype int32->int64 (1001)": lambda: s["off_cp"].astype(cp.int64),
    }
    res = {}
    for name, fn in out.items():
        fn()
        n = 2000
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        res[name] = (time.perf_counter() - t0) * 1e6 / n
        torch.cuda.synchronize()
    return res


def main():
    out = out_dir()
    props = device_properties(0)
    rows, profiles, pieces = [], {}, {}
    for fw in ("torch", "cupy"):
        s = inputs(fw)
        for name, fn in calls(s).items():
            lp = loop_ms(fn)
            dv = device_ms(fn)
            rows.append({"framework": fw, "call": name, "loop_ms": lp, "device_ms": dv})
            print(f"{fw:6s} {name:22s} loop {lp:7.4f} ms  device {dv:7.4f} ms", flush=True)
        for name in ("varlen", "padded_d_lengths"):
            w, a = after_checks_us(calls(s)[name])
            rows.append({"framework": fw, "call": name, "check_wait_us": w, "after_checks_us": a})
            print(f"{fw:6s} {name:22s} waits {w:6.1f} us for its checks, returns {a:6.1f} us after", flush=True)
        for name in ("varlen", "varlen_unchecked", "padded_d_mask"):
            profiles[f"{fw} {name}"] = profile(calls(s)[name])
        for name in ("varlen", "varlen_unchecked", "padded"):
            pieces[f"{fw} {name}"] = stages(calls(s)[name])
    s = inputs("torch")
    s["off_cp"] = cp.asarray(s["off"].cpu().numpy())
    prims = primitives(s)
    write_result(out, "profile_host", props, rows=rows, primitives_us=prims, pieces_us=pieces, profiles=profiles)
    for k, v in profiles.items():
        print(f"\n---- cProfile {k} ({N_LOOP} calls)\n{v}")
    for k, v in pieces.items():
        print(f"\n---- {k}: microseconds per call in each piece (timed, inclusive)")
        for name, us in v.items():
            print(f"  {name:40s} {us:8.2f}")
    print("\nprimitives (us per call):")
    for k, v in prims.items():
        print(f"  {k:40s} {v:8.2f}")
    print(f"\n{'framework':9s} {'call':22s} {'loop ms':>8s} {'device ms':>9s}")
    for r in rows:
        if "loop_ms" in r:
            print(f"{r['framework']:9s} {r['call']:22s} {r['loop_ms']:8.4f} {r['device_ms']:9.4f}")
    for r in rows:
        if "check_wait_us" in r:
            print(f"{r['framework']:9s} {r['call']:22s} waits {r['check_wait_us']:6.1f} us for its checks, "
                  f"returns {r['after_checks_us']:6.1f} us after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
