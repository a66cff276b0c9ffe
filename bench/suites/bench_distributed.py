#!/usr/bin/env python3
"""One corpus resident on 1, 2 and 4 GPUs through Dask (lik_cupy.distributed), against in-process retrieve.

Generates (or reuses, under ``--data``) a corpus of 8 shards x 25,000 documents of 32-256
tokens (uniform), d = 128, float16, L2-normalised random tokens (about 7 GB), and 1,024 queries
of 32 tokens; reads every file once so the shards sit in the page cache. Then, for 64 and 1,024
queries, top-100:

  in_process   lik_cupy.retrieve(Q, shards, k) in this process with every shard resident on GPU g,
               for each GPU g used: the rate one process gets out of one GPU. Their sum is what
               the GPUs could give; GPU 0's rankings are the reference every other mode must equal
               bitwise.
  dask_<n>gpu  for each n of --workers (default 1 2 4): a LocalCUDACluster of GPUs 0..n-1, one
               worker process each, and a DistributedCorpus on it: cluster start, loading (the
               shards become resident), the first query batch, then resident batches (median),
               and the median of each stage of those batches (DistributedCorpus.last_search:
               placement check, shipping Q, submitting, waiting, each worker's retrieve and
               position map, the scheduler's round trips, gathering, the client's merge).
  cli          `lik score --device 0` and `lik score --devices 0,1` (a LocalCUDACluster per run)
               as new processes: what a one-shot user waits for (skip with --skip-cli).
  fixed_cost   `lik info` wall time, `python -X importtime -m lik_cupy info` (lik_cupy's own import
               time against all), and CUDA start (cupy import, context, first kernel).

Targets (issues 31, 49), 1,024 queries: 4 GPUs >= 3.5x one Dask GPU, 2 GPUs >= 1.9x; resident
batches >= 90% of the summed in-process rate of the GPUs used; rankings identical to one GPU's.

The device image lacks Dask: carry the wheels
listed in docs/distributed.md in .whl/dask/ and run, from the repository root (4 GPUs),

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/dask/*.whl
    PYTHONPATH=/tmp/site:$PWD python3 bench/suites/bench_distributed.py --data /tmp/lik-dist --skip-cli
    PYTHONPATH=$PWD python3 bench/suites/bench_distributed.py --data /tmp/lik-small --cpu   # harness check, no GPU

Writes JSON to ``--out`` (default distributed_<n>gpu_<gpu-slug>.json, n the most workers, in $OUT, else
bench/results/).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the repo root: bench.lib, and this checkout's lik_cupy
from bench.lib.corpus import generate, warm_page_cache  # noqa: E402
from bench.lib.results import out_dir, write_json  # noqa: E402

SEED = 31


def build_argparser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[2:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=pathlib.Path, default=pathlib.Path("/tmp/lik-distributed"),
                   help="directory for the generated corpus, kept for reuse (default /tmp/lik-distributed)")
    p.add_argument("--out", type=pathlib.Path, help="results JSON file")
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--docs-per-shard", type=int, default=25_000)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--nq", type=int, nargs="+", default=[64, 1024], help="query batch sizes (default 64 1024)")
    p.add_argument("--lq", type=int, default=32)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5, help="resident batches timed per mode; the median is reported")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4],
                   help="cluster sizes, one GPU per worker (default 1 2 4)")
    p.add_argument("--skip-cli", action="store_true", help="leave out the `lik score` processes")
    p.add_argument("--prepare", action="store_true",
                   help="only generate the corpus under --data and exit (run it while something else uses the GPUs)")
    p.add_argument("--cpu", action="store_true", help="harness check without GPUs: LocalCluster workers, NumPy path")
    p.add_argument("--quick", action="store_true", help="2 shards x 5,000 documents, 2 repeats")
    return p


def corpus_spec(args) -> dict:
    return {"shards": args.shards, "docs_per_shard": args.docs_per_shard, "min_len": args.min_len,
            "max_len": args.max_len, "dim": args.dim, "nq": sorted(args.nq), "lq": args.lq, "dtype": "float16",
            "seed": SEED}


def doc_lengths(args):
    """Document lengths of a shard: uniform in [min_len, max_len]."""
    return lambda rng, s: rng.integers(args.min_len, args.max_len + 1, args.docs_per_shard)


def slugify(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-")


def bitwise_equal(got, expected) -> bool:
    """Rankings ``(scores, ids)`` equal bit for bit (NaN scores included)."""
    (s, i), (es, ei) = got, expected
    return bool(np.array_equal(i, ei) and np.array_equal(np.asarray(s).view(np.uint32), np.asarray(es).view(np.uint32)))


def median_time(fn, repeats: int) -> tuple[float, list[float], object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times, out


# --------------------------------------------------------------------------- data


# --------------------------------------------------------------------------- modes


def fixed_cost(env: dict) -> dict:
    """`lik info` wall time, import time split (lik_cupy's own modules vs the rest), CUDA start."""
    def run(args):
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True)
        return time.perf_counter() - t0, p

    walls = [run(["-m", "lik_cupy", "info"])[0] for _ in range(3)]
    _, p = run(["-X", "importtime", "-m", "lik_cupy", "info"])
    ours = total = 0
    for line in p.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+\d+ \|\s*(\S+)", line)
        if m:
            total += int(m[1])
            ours += int(m[1]) if m[2].startswith("lik_cupy") else 0
    code = ("import time; t0 = time.perf_counter(); import cupy; t1 = time.perf_counter(); "
            "cupy.cuda.runtime.getDeviceCount(); cupy.cuda.Device(0).use(); cupy.zeros(1).sum().item(); "
            "t2 = time.perf_counter(); print(t1 - t0, t2 - t1)")
    _, p = run(["-c", code])
    cuda = [float(x) for x in p.stdout.split()] if p.returncode == 0 else [None, None]
    return {"lik_info_s": statistics.median(walls), "lik_info_runs_s": walls, "import_self_ms_lik_cupy": ours / 1e3,
            "import_self_ms_all": total / 1e3, "cupy_import_s": cuda[0], "cuda_context_and_first_kernel_s": cuda[1]}


def in_process(Q_all, nqs, k, paths, device, repeats, cpu) -> tuple[dict, dict]:
    """retrieve over every shard resident on GPU ``device`` (host memory with ``cpu``): timings and rankings."""
    import lik_cupy
    from lik_cupy import shards

    opened = [shards.open_shard(p) for p in paths]
    if cpu:
        resident = [(np.array(s.tokens), np.array(s.offsets)) for s in opened]
        scope = None
    else:
        import cupy

        scope = cupy.cuda.Device(device)
        scope.use()
        resident = [(cupy.asarray(s.tokens), cupy.asarray(s.offsets)) for s in opened]
    backend = "cpu" if cpu else "gpu"
    timings, rankings = {}, {}
    for nq in nqs:
        Q = Q_all[:nq]
        lik_cupy.retrieve(Q, resident, k, backend=backend)  # warm: kernels loaded, pools filled
        t, runs, out = median_time(lambda: lik_cupy.retrieve(Q, resident, k, backend=backend), repeats)
        timings[nq] = {"s": t, "runs_s": runs, "queries_per_s": nq / t}
        rankings[nq] = out
    resident.clear()
    if scope is not None:
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()
    return timings, rankings


def on_dask(Q_all, nqs, k, paths, gpus, repeats, cpu, expected) -> dict:
    """A cluster of one worker per GPU in ``gpus`` (``cpu``: that many CPU workers), the corpus resident on it."""
    import distributed

    from lik_cupy.distributed import DistributedCorpus

    t0 = time.perf_counter()
    if cpu:
        cluster = distributed.LocalCluster(n_workers=len(gpus), threads_per_worker=1, dashboard_address=":0",
                                           silence_logs=logging.ERROR)
    else:
        from dask_cuda import LocalCUDACluster

        cluster = LocalCUDACluster(CUDA_VISIBLE_DEVICES=",".join(map(str, gpus)), threads_per_worker=1,
                                   dashboard_address=":0", silence_logs=logging.ERROR)
    result = {"gpus": gpus}
    with cluster, distributed.Client(cluster) as client:
        client.wait_for_workers(len(gpus), timeout=300)
        result["cluster_start_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        with DistributedCorpus(client, paths, backend="cpu" if cpu else "auto") as corpus:
            result["load_s"] = time.perf_counter() - t0
            result["placement"] = {str(i): list(v) for i, v in corpus.placement.items()}
            for nq in nqs:
                Q = Q_all[:nq]
                t0 = time.perf_counter()
                first = corpus.search(Q, k)
                first_s = time.perf_counter() - t0
                batches = []

                def batch():
                    out = corpus.search(Q, k)
                    batches.append(corpus.last_search)
                    return out

                t, runs, out = median_time(batch, repeats)
                same = bitwise_equal(first, expected[nq]) and bitwise_equal(out, expected[nq])
                result[nq] = {"first_query_s": first_s, "s": t, "runs_s": runs, "queries_per_s": nq / t,
                              "identical_to_in_process_gpu0": same, "stages": median_stages(batches),
                              "batches": batches}
    return result


STAGES = ("placement_s", "ship_s", "submit_s", "wait_s", "slowest_task_s", "round_trip_s", "gather_s", "merge_s",
          "total_s")
WORKER_STAGES = ("task_s", "retrieve_s", "positions_s", "dispatch_s", "notice_s")


def median_stages(batches: list[dict]) -> dict:
    """The median of each stage of ``batches`` (DistributedCorpus.last_search records): the client's
    stages, and per worker (by address) the worker's."""
    out = {name: statistics.median(b[name] for b in batches) for name in STAGES}
    workers = sorted({t["worker"] for b in batches for t in b["tasks"]})
    out["tasks"] = [{"worker": w, **{name: statistics.median(t[name] for b in batches for t in b["tasks"]
                                                               if t["worker"] == w) for name in WORKER_STAGES}}
                    for w in workers]
    out["merge_tasks"] = statistics.median(len(b["merge_tasks"]) for b in batches)
    return out


def cli_runs(paths, queries, nqs, k, env, ngpus, data) -> dict:
    """`lik score` as a new process on one GPU and on ``ngpus`` GPUs (Dask); rankings compared."""
    out = {}
    with tempfile.TemporaryDirectory(dir=data) as tmp:
        for nq in nqs:
            q = os.path.join(tmp, f"q{nq}.npy")
            np.save(q, np.load(queries)[:nq])
            row = {}
            devices = ",".join(map(str, range(ngpus)))
            for name, flag in (("1gpu", ["--device", "0"]), (f"{ngpus}gpu", ["--devices", devices])):
                top = os.path.join(tmp, f"{name}-{nq}.npy")
                argv = [sys.executable, "-m", "lik_cupy", "score", "-q", q, "-d", *paths, "-k", str(k), "-o", top,
                        *flag]
                t0 = time.perf_counter()
                p = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
                row[name] = {"s": time.perf_counter() - t0, "exit": p.returncode, "stderr": p.stderr.strip()[-500:]}
                row[name]["ids"] = top if p.returncode == 0 else None
            ids = [np.load(v["ids"]) for v in row.values() if v["ids"]]
            row["identical"] = len(ids) == 2 and bool(np.array_equal(*ids))
            for v in row.values():
                if isinstance(v, dict):
                    v.pop("ids")
            out[nq] = row
    return out


def gpu_names(cpu: bool) -> list[str]:
    if cpu:
        return ["cpu"]
    import cupy

    names = []
    for i in range(cupy.cuda.runtime.getDeviceCount()):
        p = cupy.cuda.runtime.getDeviceProperties(i)
        names.append(p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"]))
    return names


def main() -> None:
    args = build_argparser().parse_args()
    if args.quick:
        args.shards, args.docs_per_shard, args.repeats = 2, 5_000, 2
    import lik_cupy

    if args.prepare:
        gen_s = generate(args.data, corpus_spec(args), max(args.nq), doc_lengths(args), "random (bench_distributed.py)")
        print(f"corpus under {args.data}: generated in {gen_s:.1f} s (0: it was there)")
        return
    names = gpu_names(args.cpu)
    sizes = sorted(set(args.workers))
    if sizes[0] != 1:
        sys.exit("bench_distributed: --workers must include 1, the baseline of every speedup")
    if not args.cpu and len(names) < sizes[-1]:
        sys.exit(f"bench_distributed: --workers {sizes[-1]} needs {sizes[-1]} GPUs, found {len(names)} "
                 f"({', '.join(names) or 'none'}); --cpu checks the harness without them")
    spec = corpus_spec(args)
    gen_s = generate(args.data, spec, max(spec["nq"]), doc_lengths(args), "random (bench_distributed.py)")
    cache_s, cache_bytes = warm_page_cache(args.data)
    paths = [str(args.data / f"shard{s}") for s in range(args.shards)]
    queries = str(args.data / "queries.npy")
    Q_all = np.load(queries)
    docs = args.shards * args.docs_per_shard
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)])))
    gpus = list(range(sizes[-1]))

    result = {"what": f"lik_cupy.distributed (Dask) on {', '.join(map(str, sizes))} GPUs vs in-process retrieve per GPU",
              "corpus": {**spec, "docs": docs, "bytes": cache_bytes, "generated_s": round(gen_s, 2),
                         "page_cache_read_s": round(cache_s, 3)},
              "k": args.k, "repeats": args.repeats, "gpus": names, "python": platform.python_version(),
              "numpy": np.__version__, "lik_cupy": lik_cupy.__version__}
    try:
        import dask
        import distributed

        result["dask"] = dask.__version__
        result["distributed"] = distributed.__version__
        if not args.cpu:
            import dask_cuda

            result["dask_cuda"] = dask_cuda.__version__
    except ImportError as e:
        sys.exit(f"bench_distributed: {e}; carry the Dask wheels (docs/distributed.md) and put them on PYTHONPATH")
    if not args.cpu:
        result["fixed_cost"] = fixed_cost(env)
        print(f"fixed cost: {json.dumps(result['fixed_cost'])}", flush=True)

    result["in_process"], expected = {}, None
    for g in ([0] if args.cpu else gpus):
        timings, rankings = in_process(Q_all, args.nq, args.k, paths, g, args.repeats, args.cpu)
        result["in_process"][f"gpu{g}"] = timings
        expected = expected or rankings
        print(f"in-process GPU {g}: " + ", ".join(f"{nq} queries {t['s'] * 1e3:.0f} ms" for nq, t in timings.items()),
              flush=True)
    for n in sizes:
        r = on_dask(Q_all, args.nq, args.k, paths, gpus[:n], args.repeats, args.cpu, expected)
        result[f"dask_{n}gpu"] = r
        print(f"dask {n} GPU(s): start {r['cluster_start_s']:.1f} s, load {r['load_s']:.1f} s; " + ", ".join(
            f"{nq} queries first {r[nq]['first_query_s'] * 1e3:.0f} ms, resident {r[nq]['s'] * 1e3:.0f} ms, "
            f"identical {r[nq]['identical_to_in_process_gpu0']}" for nq in args.nq), flush=True)
        stages = r[max(args.nq)]["stages"]
        print(f"  stages ({max(args.nq)} queries, ms): " + ", ".join(f"{name[:-2]} {stages[name] * 1e3:.1f}"
                                                                      for name in STAGES), flush=True)
    if not args.skip_cli and not args.cpu:
        result["cli"] = cli_runs(paths, queries, args.nq, args.k, env, 2, args.data)
        print(f"cli: {json.dumps(result['cli'])}", flush=True)

    big, most = max(args.nq), sizes[-1]
    one = result["dask_1gpu"][big]
    # the in-process rate of each GPU the largest cluster uses (GPU 0's for all of them on the CPU)
    rates = [t[big]["queries_per_s"] for t in result["in_process"].values()]
    summed = sum(rates[g] if g < len(rates) else rates[0] for g in range(most))
    result["targets"] = {
        f"speedup_{most}gpu_over_1gpu": result[f"dask_{most}gpu"][big]["queries_per_s"] / one["queries_per_s"],
        **{f"speedup_{n}gpu_over_1gpu": result[f"dask_{n}gpu"][big]["queries_per_s"] / one["queries_per_s"]
           for n in sizes[1:-1]},
        "speedup_target": {"2": 1.9, "4": 3.5},
        "fraction_of_summed_in_process": result[f"dask_{most}gpu"][big]["queries_per_s"] / summed,
        "fraction_target": 0.9,
        "identical": all(result[f"dask_{n}gpu"][nq]["identical_to_in_process_gpu0"] for n in sizes for nq in args.nq),
    }
    slug = slugify(names[0])
    out = args.out or out_dir() / f"distributed_{most}gpu_{slug}.json"
    write_json(out, result, default=str)
    print(f"wrote {out}")
    print(table(result, sizes, big))


def table(result: dict, sizes: list[int], nq: int) -> str:
    """The summary printed last: per cluster size, the batch time, the speedup and the stage medians."""
    one = result["dask_1gpu"][nq]["s"]
    cols = ["placement_s", "ship_s", "submit_s", "round_trip_s", "slowest_task_s", "gather_s", "merge_s"]
    lines = [f"{nq} queries, top-{result['k']}; stage medians in ms (retrieve: the slowest worker's)",
             f"{'GPUs':>4} {'batch ms':>9} {'speedup':>8} " + " ".join(f"{c[:-2][:10]:>10}" for c in cols)
             + f" {'retrieve':>9}"]
    for n in sizes:
        r = result[f"dask_{n}gpu"][nq]
        st = r["stages"]
        lines.append(f"{n:>4} {r['s'] * 1e3:>9.1f} {one / r['s']:>7.2f}x " + " ".join(
            f"{st[c] * 1e3:>10.1f}" for c in cols) + f" {max(t['retrieve_s'] for t in st['tasks']) * 1e3:>9.1f}")
    lines.append("targets: " + json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                           for k, v in result["targets"].items()}))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
