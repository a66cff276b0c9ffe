#!/usr/bin/env python3
"""End-to-end `lik score` throughput against the in-library `lik_cupy.retrieve` on the same shards.

Generates a corpus of memory-mapped shards (default 200,000 documents, Ld=128, d=128,
float16, L2-normalised random tokens, in 8 shards) under ``--data`` (reused when a
previous run left the same corpus there), reads every file once so the shards sit in
the page cache, then times, on one GPU:

  library     lik_cupy.retrieve(Q, [(tokens, offsets) per shard], k) in this process,
              after a warm-up call (kernels compiled, pinned buffers pooled)
  cli         `lik score` run in this process through lik_cupy.cli.main (after a warm-up run):
              opening and checking the shards, the retrieve calls, merging, writing
              the .npy output; no interpreter start or CUDA context creation
  subprocess  `python -m lik_cupy score ...` as a new process: everything a user waits for

and reports docs/s for each and the CLI's overhead = 1 - library time / cli time
(target: under 20% when the shards are in the page cache), plus whether the CLI's
top-k equals the library's. Each timing is the median of ``--repeats`` runs.

    python bench/suites/bench_cli.py --data /tmp/lik-bench                 # the 200,000-doc run
    python bench/suites/bench_cli.py --data /tmp/lik-bench --quick         # 20,000 docs, 2 shards
    python bench/suites/bench_cli.py --data /tmp/lik-small --docs 2000 --backend cpu   # harness check, no GPU

Writes the results as JSON to ``--out`` (default $OUT/cli_<gpu-slug>.json, else bench/results/cli_<gpu-slug>.json).
Imports lik_cupy and CuPy only when it runs, so --help works anywhere.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the repo root: bench.lib, and this checkout's lik_cupy
from bench.lib.corpus import generate, warm_page_cache  # noqa: E402
from bench.lib.results import out_dir, slugify, write_json  # noqa: E402

SEED = 0


def build_argparser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--data", required=True, type=pathlib.Path, help="directory for the generated shards (kept for reuse)")
    p.add_argument("--out", type=pathlib.Path,
                   help="results JSON file (default $OUT or bench/results, file cli_<gpu-slug>.json)")
    p.add_argument("--docs", type=int, default=200_000, help="documents in the corpus (default 200000)")
    p.add_argument("--shards", type=int, default=8, help="shards the corpus is split into (default 8)")
    p.add_argument("--ld", type=int, default=128, help="tokens per document (default 128)")
    p.add_argument("--dim", type=int, default=128, help="embedding dim (default 128)")
    p.add_argument("--nq", type=int, default=32, help="queries (default 32)")
    p.add_argument("--lq", type=int, default=32, help="tokens per query (default 32)")
    p.add_argument("--k", type=int, default=100, help="top-k (default 100)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per mode; the median is reported (default 3)")
    p.add_argument("--backend", choices=("gpu", "cpu"), default="gpu", help="cpu: check the harness without a GPU")
    p.add_argument("--quick", action="store_true", help="20,000 documents in 2 shards, 2 repeats")
    return p


# --------------------------------------------------------------------------- data


def corpus_spec(args) -> dict:
    return {"docs": args.docs, "shards": args.shards, "ld": args.ld, "dim": args.dim, "nq": args.nq, "lq": args.lq,
            "dtype": "float16", "seed": SEED}


# --------------------------------------------------------------------------- timing


def median_time(fn, repeats: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def gpu_info() -> dict:
    try:
        import cupy

        p = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
        name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
        return {"name": name, "cc": f"{p['major']}.{p['minor']}", "cupy": cupy.__version__}
    except Exception as e:  # no GPU: the cpu harness check
        return {"name": "cpu", "error": f"{type(e).__name__}: {e}"}


def main() -> None:
    args = build_argparser().parse_args()
    if args.quick:
        args.docs, args.shards, args.repeats = 20_000, 2, 2
    import lik_cupy
    from lik_cupy import cli, shards

    spec = corpus_spec(args)
    sizes = [len(a) for a in np.array_split(np.arange(spec["docs"]), spec["shards"])]
    gen_s = generate(args.data, spec, spec["nq"], lambda rng, s: np.full(sizes[s], spec["ld"]), "random (bench_cli.py)")
    cache_s, cache_bytes = warm_page_cache(args.data)
    shard_dirs = [str(args.data / f"shard{s}") for s in range(args.shards)]
    queries = str(args.data / "queries.npy")
    Q = np.load(queries)
    opened = [shards.open_shard(d) for d in shard_dirs]
    corpus = [(s.tokens, s.offsets) for s in opened]
    cpu_flag = ["--cpu"] if args.backend == "cpu" else []

    def library():
        return lik_cupy.retrieve(Q, corpus, args.k, backend=args.backend)

    lib_scores, lib_idx = library()  # warm-up: kernels compiled, pinned and device pools filled
    lib_s, lib_runs = median_time(library, args.repeats)

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "top.npy")
        argv = ["score", "--queries", queries, "--docs", *shard_dirs, "--top-k", str(args.k), "--out", out, *cpu_flag]

        def in_process():
            rc = cli.main(argv, prog_name="lik", standalone_mode=False)  # errors come back as an exit code here
            if rc:
                raise RuntimeError(f"lik score failed in process (exit {rc})")

        in_process()
        agree = bool(np.array_equal(np.load(out), lib_idx))
        cli_s, cli_runs = median_time(in_process, args.repeats)

        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))

        def subprocess_run():
            p = subprocess.run([sys.executable, "-m", "lik_cupy", *argv], cwd=REPO, env=env, capture_output=True,
                               text=True)
            if p.returncode != 0:
                raise RuntimeError(f"lik score failed ({p.returncode}): {p.stderr.strip()}")

        sub_s, sub_runs = median_time(subprocess_run, args.repeats)

    gpu = gpu_info()
    tokens_bytes = sum(s.tokens.nbytes for s in opened)
    result = {
        "what": "lik score end to end vs lik_cupy.retrieve on the same memory-mapped shards (page cache warm)",
        "corpus": {**spec, "bytes": tokens_bytes, "generated_s": round(gen_s, 2),
                   "page_cache_read_s": round(cache_s, 3), "page_cache_read_bytes": cache_bytes},
        "k": args.k, "backend": args.backend, "repeats": args.repeats,
        "gpu": gpu, "python": platform.python_version(), "numpy": np.__version__, "lik_cupy": lik_cupy.__version__,
        "library": {"s": lib_s, "runs_s": lib_runs, "docs_per_s": args.docs / lib_s},
        "cli_in_process": {"s": cli_s, "runs_s": cli_runs, "docs_per_s": args.docs / cli_s,
                           "overhead": 1 - lib_s / cli_s},
        "cli_subprocess": {"s": sub_s, "runs_s": sub_runs, "docs_per_s": args.docs / sub_s,
                           "overhead": 1 - lib_s / sub_s},
        "cli_topk_equals_library": agree,
        "target": "cli_in_process.overhead < 0.20",
        "target_met": (1 - lib_s / cli_s) < 0.20,
    }
    out_path = args.out or out_dir() / f"cli_{slugify(gpu['name'])}.json"
    write_json(out_path, result)
    print(f"corpus: {args.docs} docs x {args.ld} tokens x d={args.dim} fp16 in {args.shards} shards "
          f"({tokens_bytes / 2**30:.2f} GiB), {args.nq} queries x {args.lq} tokens, top-{args.k}, on {gpu['name']}")
    for name in ("library", "cli_in_process", "cli_subprocess"):
        r = result[name]
        over = f"  overhead {r['overhead']:6.1%}" if "overhead" in r else ""
        print(f"{name:<15} {r['s']:8.3f} s  {r['docs_per_s']:12,.0f} docs/s{over}")
    print(f"cli top-k equals library: {agree}; target (in-process overhead < 20%) met: {result['target_met']}")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
