"""Where a small call's host time goes, on one GPU.

A one-query call scores 1,000 ragged documents in about 0.04 ms of GPU time, so the Python
around the launch decides how many calls a second a service gets. This times, for the
ragged single-query shape of ``bench_corpus.py`` (torch and CuPy inputs):

- ``loop_ms``: back-to-back calls, then one synchronisation (what a loop of calls pays);
- ``device_ms``: one call at a time behind a queued sleep, so the host runs ahead (GPU time,
  plus whatever the call waits for inside);
- a cProfile of the loop (top functions by own time), the host microseconds of a repeat call and
  of each step it takes (``lik_cupy._runtime.prepared_calls``: signature, lookup, the caller's
  stream, the results buffer, the launch), and the cost of the CUDA and interop primitives a call
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
from lik_cupy._base.device import device_properties  # noqa: E402

from bench.lib.results import out_dir, write_result  # noqa: E402
from bench.lib.timing import padded_call_ms, wall_ms  # noqa: E402

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
        "varlen_unchecked": lambda: m.maxsim_varlen(s["Q"], s["Dt"], s["off"], validate=False),
        "padded_d_mask": lambda: m.maxsim(s["Q"], s["Dp"], d_mask=s["mask"]),
        "padded_d_lengths": lambda: m.maxsim(s["Q"], s["Dp"], d_lengths=s["lens"]),
        "padded": lambda: m.maxsim(s["Q"], s["Dp"]),
    }


def device_ms(fn, reps=200, pad_cycles=500_000):
    """Median ms between events around one call, each call behind its own queued sleep (as
    ``bench_corpus.py`` times): a call that waits for the GPU inside shows that wait here."""
    fn()
    return float(np.median(padded_call_ms(torch, lambda i: fn(), reps, pad_cycles)))


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


def best_us(fn, n=2000, rounds=5):
    """Fastest of ``rounds`` mean host microseconds of ``n`` back-to-back ``fn()`` (a GPU sync between rounds)."""
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter_ns() - t) / n / 1e3)
        torch.cuda.synchronize()
    return best


def repeat_path(fw: str):
    """Host microseconds of a repeat call and of each step it takes (``lik_cupy._runtime.prepared_calls``),
    for a one-query call against 100 documents (a 4 us kernel, so the GPU keeps up with the host)."""
    from lik_cupy._runtime import prepared_calls as pc
    from lik_cupy._maxsim_calls import maxsim_key as _maxsim_key

    rng = np.random.default_rng(5)
    q, d = (rng.standard_normal(s, dtype=np.float32).astype(np.float16) for s in ((1, 32, 128), (100, 180, 128)))
    Q, D = (torch.from_numpy(x).cuda() for x in (q, d)) if fw == "torch" else (cp.asarray(x) for x in (q, d))
    lik_cupy.maxsim(Q, D)
    args = (Q, D, None, None, None, None, False, "auto", None, None)  # maxsim(Q, D)'s, as forward keys them
    key = _maxsim_key(*args)
    call = pc.lookup(key)
    a, fwd = call.a, call.fwd
    scores = a.new_empty((1, 100), "float32", 0)
    qp, dp, sp, st = a.address(Q), a.address(D), a.address(scores), a.stream_handle(0)
    return {
        "whole call (lik_cupy.maxsim)": best_us(lambda: lik_cupy.maxsim(Q, D)),
        "signature (call_key)": best_us(lambda: _maxsim_key(*args)),
        "lookup": best_us(lambda: pc.lookup(key)),
        "prepared call (all that follows)": best_us(lambda: call(Q, D, None, None, None, None, None)),
        "  caller's stream": best_us(lambda: a.stream_handle(0)),
        "  scores buffer (caller's framework)": best_us(lambda: a.new_empty((1, 100), "float32", 0)),
        "  ForwardLaunch.run (pack + driver launch)": best_us(
            lambda: fwd.run(st, qp, dp, 0, 0, 0, 0, 0, 0, 0, sp, 0, 0)),
    }


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
            lp = wall_ms(torch, fn, N_LOOP)
            dv = device_ms(fn)
            rows.append({"framework": fw, "call": name, "loop_ms": lp, "device_ms": dv})
            print(f"{fw:6s} {name:22s} loop {lp:7.4f} ms  device {dv:7.4f} ms", flush=True)
        for name in ("varlen", "padded_d_mask"):
            profiles[f"{fw} {name}"] = profile(calls(s)[name])
        pieces[f"{fw} repeat call"] = repeat_path(fw)
    s = inputs("torch")
    s["off_cp"] = cp.asarray(s["off"].cpu().numpy())
    prims = primitives(s)
    write_result(out, "profile_host", props, rows=rows, primitives_us=prims, pieces_us=pieces, profiles=profiles)
    for k, v in profiles.items():
        print(f"\n---- cProfile {k} ({N_LOOP} calls)\n{v}")
    for k, v in pieces.items():
        print(f"\n---- {k}: host microseconds per call, and of each step alone")
        for name, us in v.items():
            print(f"  {name:40s} {us:8.2f}")
    print("\nprimitives (us per call):")
    for k, v in prims.items():
        print(f"  {k:40s} {v:8.2f}")
    print(f"\n{'framework':9s} {'call':22s} {'loop ms':>8s} {'device ms':>9s}")
    for r in rows:
        if "loop_ms" in r:
            print(f"{r['framework']:9s} {r['call']:22s} {r['loop_ms']:8.4f} {r['device_ms']:9.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
