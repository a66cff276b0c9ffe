"""Packed corpora: how much work a document counts for beside its tokens (FwdConfig.doc_cost), on one GPU.

CTAs share a packed corpus out in equal shares of work, a document's work being its tokens plus
``doc_cost`` (maxsim_fwd.cu, ``shares``): a document of 16 tokens still costs a CTA a whole tile
and a score. This times ``doc_cost`` = 0 (tokens alone) and 1, 1.5, 2 and 3 tiles, alternated over
rounds with a sleep queued first, for one query (beside flash-maxsim's packed kernel) and for 32
queries of 32 tokens, on:

- the ragged corpus of bench_corpus.py (1,000 documents of 16..512 tokens);
- 500 documents of 16 tokens, then 500 of 512 (lengths that drift along the corpus);
- 4,000 documents of 16 tokens and 250 of 1,024, shuffled;
- 1,000 documents of 0..1,024 tokens, 30% of them empty;
- 20,000 passages of 100..180 tokens;

and checks that every variant gives the same scores bit for bit (a document is scored whole by
one CTA whichever it is).

Writes ``sweep_doc_cost_<gpu>.json`` to $OUT (or bench/results) and prints a table last; the committed H100
runs are in tests/data/ (tests/test_compile.py checks ``FwdConfig.doc_cost`` against them).

    python bench/sweeps/sweep_doc_cost.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import lik_cupy  # noqa: E402
from lik_cupy import _dispatch as dispatch  # noqa: E402
from lik_cupy._runtime import launch  # noqa: E402
from lik_cupy._base.device import device_properties  # noqa: E402

from bench.lib import baselines  # noqa: E402
from bench.lib.forcing import rebind  # noqa: E402
from bench.lib.results import out_dir, write_result  # noqa: E402
from bench.lib.timing import count_mismatches, per_call_ms  # noqa: E402

TILES = (0, 1, 1.5, 2, 3)  # doc_cost in tiles of the kernel's document tokens
_doc_cost = dispatch.FwdConfig.doc_cost
_kernels = {}  # per variant: the launcher's loaded kernels are keyed by name, which doc_cost does not change


def use(tiles):
    dispatch.FwdConfig.doc_cost = property(lambda cfg: int(tiles * cfg.bn) if cfg.packed else 0)
    rebind(launch, "_kernels", _kernels.setdefault(tiles, {}))


def corpora(rng):
    skew = np.concatenate([np.full(500, 16), np.full(500, 512)])
    mixed = rng.permutation(np.concatenate([np.full(4000, 16), np.full(250, 1024)]))
    empties = rng.integers(0, 1025, size=1000)
    empties[rng.random(1000) < 0.3] = 0
    ragged, passages = rng.integers(16, 513, size=1000), rng.integers(100, 181, size=20_000)
    cases = [("1,000 x 16..512", ragged), ("500 x 16, then 500 x 512", skew), ("4,000 x 16 + 250 x 1,024", mixed),
             ("1,000 x 0..1,024, 30% empty", empties), ("20,000 x 100..180", passages)]
    return [(name, lens, nq) for nq in (1, 32) for name, lens in cases]


def main():
    out = out_dir()
    props = device_properties(0)
    rng = np.random.default_rng(606)
    flash_maxsim, err = baselines.load(baselines.FLASH)
    if flash_maxsim is None:
        print(f"flash-maxsim not timed: {err}", flush=True)
    rows, mismatches = [], 0
    for case, lens, nq in corpora(rng):
        q = cp.asarray(rng.standard_normal((nq, 32, 128), dtype=np.float32).astype(np.float16))
        off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        T = int(off[-1])
        n_sets = 6 if T < 1 << 22 else 2  # distinct corpora in turn, so no call finds D in L2
        toks = [cp.asarray(rng.standard_normal((T, 128), dtype=np.float32).astype(np.float16)) for _ in range(n_sets)]
        off_d = cp.asarray(off)
        ours, flash = baselines.packed_calls(torch, q, toks, off_d)

        mismatches += count_mismatches(cp, TILES, use,
                                       lambda: lik_cupy.maxsim_varlen(q, toks[0], off_d, validate_offsets=False),
                                       lambda t: f"{case} {nq} q, doc_cost {t} tiles")
        times = {f"{t} tiles": [] for t in TILES}
        with_flash = flash_maxsim is not None and nq == 1
        if with_flash:
            flash()
            times["flash-maxsim packed"] = []
        n = 40 if T * nq < 1 << 22 else 8
        for _ in range(5):
            for t in TILES:
                use(t)
                times[f"{t} tiles"].append(per_call_ms(torch, ours, n, rounds=1, spin_cycles=50_000_000))
            if with_flash:
                times["flash-maxsim packed"].append(per_call_ms(torch, flash, n, rounds=1, spin_cycles=50_000_000))
        for name, ts in times.items():
            rows.append({"case": case, "queries": nq, "variant": name, "us": float(np.median(ts)) * 1e3,
                         "runs_ms": ts})
        toks = ours = flash = None  # freed before the next corpus is made
        cp.get_default_memory_pool().free_all_blocks()
    dispatch.FwdConfig.doc_cost = _doc_cost
    rebind(launch, "_kernels", {})
    write_result(out, "sweep_doc_cost", props, query="Lq 32, d 128 fp16, unchecked offsets", rows=rows,
                 mismatches=mismatches)
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    print(f"\n{'case (us)':34s}" + "".join(f"{v[:12]:>13s}" for v in variants))
    for case, nq in dict.fromkeys((r["case"], r["queries"]) for r in rows):
        got = {r["variant"]: r["us"] for r in rows if r["case"] == case and r["queries"] == nq}
        print(f"{f'{nq} q, {case}':34s}" + "".join(f"{got[v]:13.2f}" if v in got else f"{'-':>13s}" for v in variants))
    print(f"score mismatches: {mismatches}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
