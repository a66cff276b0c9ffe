"""lik_cupy.jax under jax.jit on a CUDA device: wall time per call, calls queued back to back.

One query (32 tokens) against 1,000 documents (300 tokens), d = 128, float16, on the GPU:

  jit              jax.jit(lambda q, d: lik_cupy.jax.maxsim(q, d)): the kernel on XLA's stream
  jit_lengths      the same with q_lengths and d_lengths (device arrays, never read on the host)
  eager            lik_cupy.jax.maxsim(q, d) not jitted (each call dispatches its own staged computation)
  eager_lengths    the same with lengths
  toplevel         lik_cupy.maxsim(q, d) on the same JAX arrays (the framework-agnostic entry: it
                   synchronises before handing the result to JAX)
  cupy             lik_cupy.maxsim on CuPy arrays, CuPy's stream (the library without JAX)
  cupy_lengths     the same with device lengths (their range check waits on the host)

Each row: ``--calls`` calls back to back with one ``block_until_ready`` (CuPy: one stream
synchronisation) at the end, wall time / calls; the best of ``--rounds`` rounds (the median
beside it), after one untimed call that compiles. Each row's scores are checked against the
NumPy path (float64 argmax) once.

Writes ``jax_<gpu-slug>.json`` (the GPU's name, jax's version, every row) to ``--out``.

    python3 bench/suites/bench_jax.py --out /tmp/bench
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
from bench.lib.results import out_dir as default_out_dir  # noqa: E402
from bench.lib.results import short_err, write_result  # noqa: E402

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before jax is imported: CuPy needs its room


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output directory (default $OUT, else bench/results)")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--docs", type=int, default=1000)
    ap.add_argument("--doc-tokens", type=int, default=300)
    ap.add_argument("--query-tokens", type=int, default=32)
    args = ap.parse_args(argv)

    import cupy
    import jax
    import numpy as np

    import lik_cupy
    import lik_cupy.jax as lj
    from lik_cupy._base.device import device_properties

    gpu = jax.devices("gpu")[0]
    dim = 128
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, args.query_tokens, dim)).astype(np.float16)
    d = rng.standard_normal((args.docs, args.doc_tokens, dim)).astype(np.float16)
    ql = np.array([args.query_tokens - 3], np.int32)
    dl = rng.integers(1, args.doc_tokens + 1, args.docs).astype(np.int32)
    Q, D, QL, DL = (jax.device_put(x, gpu) for x in (q, d, ql, dl))
    want = lik_cupy.maxsim(q, d, backend="cpu")
    want_len = lik_cupy.maxsim(q, d, q_lengths=ql, d_lengths=dl, backend="cpu")

    plain = jax.jit(lambda a, b: lj.maxsim(a, b))
    with_lengths = jax.jit(lambda a, b, x, y: lj.maxsim(a, b, q_lengths=x, d_lengths=y))
    cq, cd, cql, cdl = (cupy.asarray(x) for x in (q, d, ql, dl))

    def jax_rows():
        yield "jit", lambda: plain(Q, D), want
        yield "jit_lengths", lambda: with_lengths(Q, D, QL, DL), want_len
        yield "eager", lambda: lj.maxsim(Q, D), want
        yield "eager_lengths", lambda: lj.maxsim(Q, D, q_lengths=QL, d_lengths=DL), want_len
        yield "toplevel", lambda: lik_cupy.maxsim(Q, D), want

    rows = []
    for name, fn, ref in jax_rows():
        rows.append(_row(name, fn, ref, args, lambda outs: jax.block_until_ready(outs), np))
    def sync(outs):
        cupy.cuda.get_current_stream().synchronize()

    rows.append(_row("cupy", lambda: lik_cupy.maxsim(cq, cd), want, args, sync, np, to_host=cupy.asnumpy))
    rows.append(_row("cupy_lengths", lambda: lik_cupy.maxsim(cq, cd, q_lengths=cql, d_lengths=cdl), want_len, args,
                     sync, np, to_host=cupy.asnumpy))

    props = device_properties(int(getattr(gpu, "local_hardware_id", 0) or 0))
    versions = {"python": platform.python_version(), "jax": jax.__version__, "cupy": cupy.__version__,
                "lik_cupy": getattr(lik_cupy, "__version__", "?"), "jax_device": str(gpu)}
    out = default_out_dir(args.out)
    path = write_result(out, "jax", props, case={"queries": 1, "query_tokens": args.query_tokens, "docs": args.docs,
                                                 "doc_tokens": args.doc_tokens, "dim": dim, "dtype": "float16",
                                                 "calls": args.calls, "rounds": args.rounds},
                        versions=versions, rows=rows)
    width = max(len(r["impl"]) for r in rows)
    print(f"{props.name}: 1 query x {args.docs} docs ({args.query_tokens} x {args.doc_tokens} tokens, d={dim}, fp16), "
          f"{args.calls} calls back to back, best of {args.rounds}")
    for r in rows:
        timing = f"{r['us_per_call']:9.1f} us/call (median {r['us_per_call_median']:.1f})" if "us_per_call" in r \
            else r.get("error", "")
        print(f"  {r['impl']:<{width}}  {timing}  max rel err {r.get('max_rel_err', float('nan')):.2e}")
    print(f"wrote {path}")
    return 0


def _row(name, fn, ref, args, wait, np, to_host=None):
    """Time ``fn`` (``args.calls`` calls, one ``wait`` at the end; best and median of the rounds) and
    check its result against ``ref``."""
    try:
        first = fn()
        wait([first])
        got = np.asarray(to_host(first) if to_host else first, np.float64)
        err = float(np.max(np.abs(got - ref) / np.maximum(np.abs(ref), 1e-30)))
        times = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            outs = [fn() for _ in range(args.calls)]
            wait(outs)
            times.append((time.perf_counter() - t0) / args.calls * 1e6)
            del outs
        return {"impl": name, "us_per_call": min(times), "us_per_call_median": statistics.median(times),
                "rounds_us": times, "max_rel_err": err}
    except Exception as e:  # noqa: BLE001 - a failing row is recorded and the run goes on
        return {"impl": name, "error": short_err(e)}


if __name__ == "__main__":
    sys.exit(main())
