"""How many documents each CTA streams (``dispatch.tables.DOCS_PER_CTA``), on one GPU.

A CTA fills its ring, streams a run of documents and drains; a longer run pays that less
often, a shorter one leaves a smaller last wave. This forces each target in turn (None: one
wave, every resident CTA streams an equal share) for corpus, single-query and ColPali shapes,
targets alternated over several rounds, with a sleep queued first so host overhead stays
hidden, and checks that the scores do not change (they must be bitwise equal: a document's
score never depends on which CTA computes it).

Writes ``sweep_docs_per_cta_<gpu>.json`` to $OUT (or bench/results) and prints a table.

    python bench/sweeps/sweep_docs_per_cta.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import lik_cupy  # noqa: E402
from lik_cupy import _dispatch as dispatch  # noqa: E402
from lik_cupy._base.device import device_properties  # noqa: E402

from bench.lib.forcing import rebind  # noqa: E402
from bench.lib.results import out_dir, write_result  # noqa: E402
from bench.lib.timing import count_mismatches, per_call_ms  # noqa: E402

TARGETS = [32, 8, 16, 64, 128, None]  # the first is the reference


def set_target(t):
    rebind(dispatch.tables, "DOCS_PER_CTA", t if t is not None else 1 << 40)
    dispatch.clear_caches()


def cases(rng, d=128):
    h = lambda *shape: rng.standard_normal(shape, dtype=cp.float32).astype(cp.float16)  # noqa: E731
    q32, q1, q1024 = h(32, 32, d), h(32, d), h(1024, d)
    big = h(100_000, 180, d)
    out = [
        ("32q x 32 vs 1024 x 180", lambda: lik_cupy.maxsim(q32, big[:1024]), 2 * 32 * 32 * 1024 * 180 * d, 20),
        ("32q x 32 vs 20000 x 180", lambda: lik_cupy.maxsim(q32, big[:20000]), 2 * 32 * 32 * 20000 * 180 * d, 10),
        ("32q x 32 vs 100000 x 180", lambda: lik_cupy.maxsim(q32, big), 2 * 32 * 32 * 100_000 * 180 * d, 4),
        ("top-100, 32q x 32 vs 100000 x 180", lambda: lik_cupy.retrieve(q32, big, 100), 2 * 32 * 32 * 100_000 * 180 * d,
         4),
        ("1q x 32 vs 100000 x 180", lambda: lik_cupy.maxsim(q1, big), 2 * 32 * 100_000 * 180 * d, 10),
    ]
    d512 = h(5000, 512, d)
    out.append(("32q x 32 vs 5000 x 512", lambda: lik_cupy.maxsim(q32, d512), 2 * 32 * 32 * 5000 * 512 * d, 10))
    d1024 = h(1000, 1024, d)
    out.append(("1q x 1024 vs 1000 x 1024", lambda: lik_cupy.maxsim(q1024, d1024), 2 * 1024 * 1000 * 1024 * d, 20))
    lens = np.random.default_rng(0).integers(16, 513, 1000)
    off = cp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
    tok = h(int(lens.sum()), d)
    out.append(("packed 32q x 32 vs 1000 x 16..512",
                lambda: lik_cupy.maxsim_varlen(q32, tok, off, validate_offsets=False), 2 * 32 * 32 * int(lens.sum()) * d,
                20))
    return out


def main():
    out = out_dir()
    props = device_properties(0)
    saved = dispatch.tables.DOCS_PER_CTA
    rows, mismatches = [], 0
    for name, fn, flops, n in cases(cp.random.default_rng(0)):
        times = {t: [] for t in TARGETS}
        # results first: every target gives the same scores
        mismatches += count_mismatches(cp, TARGETS, set_target, fn, lambda t: f"{name} target {t}")
        for _ in range(3):
            for t in TARGETS:
                set_target(t)
                times[t].append(per_call_ms(torch, fn, n, rounds=1, spin_cycles=100_000_000))
        base = float(np.median(times[TARGETS[0]]))
        for t in TARGETS:
            ms = float(np.median(times[t]))
            rows.append({"case": name, "docs_per_cta": t, "ms": ms, "runs": times[t], "tflops": flops / ms / 1e9,
                         "vs_first": ms / base})
            print(f"{name:36s} docs/CTA {str(t):>5s}: {ms:8.4f} ms {flops / ms / 1e9:6.1f} TF/s  {ms / base:.3f}x",
                  flush=True)
    set_target(saved)
    write_result(out, "sweep_docs_per_cta", props, targets=TARGETS, rows=rows, mismatches=mismatches)
    print(f"score mismatches: {mismatches}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
