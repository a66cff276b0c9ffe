"""docs/distributed.md's cost model of one query batch: its counts checked against a real Dask cluster
(``counts``), and its times fitted to the stage times bench_distributed.py measured (``fit``).

``fit BENCH.json`` reads what bench/suites/bench_distributed.py wrote (the median stage times of
resident batches on 1, 2 and 4 workers, from DistributedCorpus.last_search), fits each stage to
how it grows with the number of workers N, and predicts N = 8 .. 64 on the same hardware:

- retrieve (the slowest worker): r0 + r1 / N, the corpus split N ways;
- shipping Q: s0 + s1 N while the client sends each worker its copy (N <= _DIRECT_MAX);
  beyond, one copy and ceil(log3 N) rounds of worker-to-worker copies, each a hop of s0 + s1;
- placement check, submitting, the scheduler's round trips: a + b N (messages per task);
- gathering and the client's merge: a + b m, m = min(N, fan-in) rankings reach the client;
- each level of merge tasks on the workers (N > fan-in): a task round trip, fetching fan-in - 1
  rankings, and one merge of fan-in rankings, as measured at N = fan-in.

    PYTHONPATH=. python bench/sweeps/distributed_model.py fit bench/results/latest/distributed_4gpu_nvidia-h200.json

The model (Nq queries of Lq tokens, dim d, e bytes per element, N workers holding shards, top-k,
fan-in f = lik_cupy.distributed._FAN_IN):

- queries: B_Q = Nq * Lq * d * e (+ 8 * Nq of lengths) bytes. Up to _DIRECT_MAX workers the client
  sends each its copy (N * B_Q out, no copies between workers); beyond, it sends one, which
  Dask's replicate copies worker to worker: N - 1 copies in ceil(log3 N) rounds (each holder
  feeds two more per round).
- partial rankings: P = Nq * k * 12 bytes each (float32 score + int64 position). Merge tasks
  take them f at a time until at most f are left (ceil(log_f N) - 1 levels); a merge of g
  partials runs where one of them is and fetches g - 1. The client fetches the last m <= f and
  merges them, the tree's root: depth ceil(log_f N) in all, N - m partials moved between
  workers, m * P bytes into the client.

For each N this script starts an in-process LocalCluster of N single-thread workers (inproc
transport; the CPU path), builds a DistributedCorpus of 2 N small shards, runs one search and
counts, from Dask itself: the workers holding Q (``who_has``), the bytes of partial rankings
workers fetched from each other (their ``transfer_incoming_log``), the tasks that ran and the
merge levels on workers (the task stream's keys), and the rankings the client fetched.
The tiny shards keep scoring out of the way; only the counts matter. Prints a table and writes
JSON (``$OUT`` or bench/results/latest/distributed_model.json; ``fit``: distributed_model_fit.json),
with the sources' provenance as every result JSON (``bench.lib.results.write_json``).

    PYTHONPATH=. python bench/sweeps/distributed_model.py counts     # N = 1, 2, 4, ..., 64
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import pathlib
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repo root: bench.lib
from bench.lib.results import write_json  # noqa: E402

NQ, LQ, DIM, K = 64, 32, 128, 100  # float32 queries: B_Q = 1 MiB
DOCS_PER_SHARD = 60  # 2 shards per worker: each worker's partial has k = 100 rows


def model(n: int, nq: int = NQ, lq: int = LQ, d: int = DIM, e: int = 4, k: int = K, fan_in: int = 4,
          direct_max: int = 8) -> dict:
    """The paper model of one search batch over n workers (bytes and depths)."""
    b_q = nq * lq * d * e + 8 * nq
    p = nq * k * 12
    levels = tasks = 0
    parts = n
    while parts > fan_in:  # as DistributedCorpus._search groups them
        groups = [min(fan_in, parts - i) for i in range(0, parts, fan_in)]
        tasks += sum(g > 1 for g in groups)
        parts, levels = len(groups), levels + 1
    return {
        "query_bytes": b_q,
        "query_copies_between_workers": 0 if n <= direct_max else n - 1,
        "query_rounds": 0 if n <= direct_max else math.ceil(math.log(n, 3) - 1e-9),
        "partial_bytes": p,
        "worker_merge_levels": levels,
        "merge_tasks": tasks,
        "merge_depth": levels + (n > 1),  # the client's merge is the root
        "partials_moved": n - parts,
        "merge_bytes_between_workers": (n - parts) * p,
        "client_partials": parts,
        "client_bytes_out": n * b_q if n <= direct_max else b_q,
        "client_bytes_in": parts * p,
    }


def measure(n: int, root: pathlib.Path) -> dict:
    import distributed

    from lik_cupy import shards
    from lik_cupy.distributed import _FAN_IN, DistributedCorpus

    rng = np.random.default_rng(n)
    paths = []
    for j in range(2 * n):
        path = root / f"n{n}-shard{j}"
        if not path.exists():
            lens = rng.integers(1, 16, DOCS_PER_SHARD)
            off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
            shards.write_shard(path, rng.standard_normal((int(off[-1]), DIM)).astype(np.float32), off)
        paths.append(str(path))
    Q = rng.standard_normal((NQ, LQ, DIM)).astype(np.float32)
    with distributed.LocalCluster(n_workers=n, threads_per_worker=1, processes=False, dashboard_address=":0",
                                  silence_logs=logging.ERROR) as cluster, distributed.Client(cluster) as client:
        with DistributedCorpus(client, paths, backend="cpu") as corpus:
            corpus.search(Q, K)  # warm: imports, first-call costs
            client.run(lambda dask_worker: dask_worker.transfer_incoming_log.clear())
            seen = {}
            real_ship = corpus._ship

            def ship(query, workers):  # who holds the batch's queries once they are sent (before Dask's
                copies = real_ship(query, workers)  # memory manager drops copies no task needs anymore)
                who = client.who_has(list({f.key: f for f in copies.values()}.values()))
                seen["holders"] = len({w for holders in who.values() for w in holders})
                return copies

            corpus._ship = ship
            with distributed.get_task_stream(client) as stream:
                t0 = time.perf_counter()
                corpus.search(Q, K)
                seconds = time.perf_counter() - t0
            logs = client.run(lambda dask_worker: list(dask_worker.transfer_incoming_log))
            fetched = corpus.last_search["rankings_to_client"]
    moved = [(key, size) for log in logs.values() for entry in log for key, size in entry["keys"].items()
             if key.startswith(("lik-cupy-top-k", "lik-cupy-merge"))]
    ran = [str(t["key"]) for t in stream.data]
    levels = {int(key.split("-")[-2]) for key in ran if key.startswith("lik-cupy-merge")}
    return {
        "workers_holding_query": seen["holders"],
        "partials_moved": len(moved),
        "merge_bytes_between_workers": sum(size for _, size in moved),
        "worker_merge_levels": max(levels) + 1 if levels else 0,
        "search_tasks": sum(key.startswith("lik-cupy-top-k") for key in ran),
        "merge_tasks": sum(key.startswith("lik-cupy-merge") for key in ran),
        "client_partials": fetched,
        "search_seconds": round(seconds, 4),
        "fan_in": _FAN_IN,
    }


STAGE_FITS = {  # stage -> what it grows with: "per_worker" (a + b N), "split" (a + b / N), "client" (a + b m)
    "placement_s": "per_worker", "submit_s": "per_worker", "round_trip_s": "per_worker",
    "gather_s": "client", "merge_s": "client",
}


def _line(xs, ys) -> tuple[float, float]:
    """Least squares a + b x (a constant when all x are equal)."""
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    if np.ptp(xs) == 0:
        return float(ys.mean()), 0.0
    b, a = np.polyfit(xs, ys, 1)
    return float(a), float(b)


def fit(bench: dict, fan_in: int = 4, direct_max: int = 8) -> dict:
    """Coefficients of every stage from the bench's median stage times at the largest query batch."""
    nq = max(int(key) for key in bench["dask_1gpu"] if key.isdigit())
    rows = {int(name[5:-3]): bench[name][str(nq)] for name in bench if name.startswith("dask_") and name.endswith("gpu")}
    ns = sorted(rows)
    stages = {n: rows[n]["stages"] for n in ns}
    coef = {"queries": nq, "measured_workers": ns, "fan_in": fan_in, "direct_max": direct_max}
    coef["retrieve_s"] = _line([1 / n for n in ns], [max(t["retrieve_s"] for t in stages[n]["tasks"]) for n in ns])
    coef["task_extra_s"] = _line(ns, [stages[n]["slowest_task_s"] - max(t["retrieve_s"] for t in stages[n]["tasks"])
                                      for n in ns])
    coef["ship_s"] = _line(ns, [stages[n]["ship_s"] for n in ns])
    for stage, grows in STAGE_FITS.items():
        xs = [min(n, fan_in) for n in ns] if grows == "client" else ns
        coef[stage] = _line(xs, [stages[n][stage] for n in ns])
    coef["measured_s"] = {n: rows[n]["s"] for n in ns}
    return coef


def predict(coef: dict, n: int) -> dict:
    """Stage times (seconds) of one batch on n workers, from ``fit``'s coefficients."""
    f, at = coef["fan_in"], lambda stage, x: coef[stage][0] + coef[stage][1] * x
    m = n
    levels = 0
    while m > f:
        m, levels = math.ceil(m / f), levels + 1
    if n <= coef["direct_max"]:
        ship = at("ship_s", n)
    else:  # one copy from the client, then ceil(log3 n) rounds of copies, each a hop like the client's
        ship = at("ship_s", 1) * (1 + math.ceil(math.log(n, 3) - 1e-9))
    # a level of merge tasks: a task's round trip, fan-in - 1 rankings fetched, a merge of fan-in
    level = at("round_trip_s", 1) + at("gather_s", f) - at("gather_s", 1) + at("merge_s", f)
    out = {"placement_s": at("placement_s", n), "ship_s": ship, "submit_s": at("submit_s", n),
           "round_trip_s": at("round_trip_s", n), "task_s": at("retrieve_s", 1 / n) + at("task_extra_s", n),
           "merge_levels_s": levels * level, "gather_s": at("gather_s", m), "merge_s": at("merge_s", m)}
    out = {k: max(v, 0.0) for k, v in out.items()}
    out["total_s"] = sum(out.values())
    return out


def main_fit(path: pathlib.Path, sizes: list[int]) -> None:
    bench = json.loads(path.read_text())
    coef = fit(bench)
    base = predict(coef, 1)["total_s"]
    rows = []
    print(f"{coef['queries']} queries; fitted to {coef['measured_workers']} workers of {path.name}")
    print(f"{'N':>3} {'batch ms':>9} {'measured':>9} {'speedup':>8}  stages (ms)")
    for n in sizes:
        p = predict(coef, n)
        measured = coef["measured_s"].get(n)
        rows.append({"workers": n, "predicted": p, "measured_s": measured, "speedup_over_1": base / p["total_s"]})
        print(f"{n:>3} {p['total_s'] * 1e3:>9.1f} {'-' if measured is None else f'{measured * 1e3:.1f}':>9} "
              f"{base / p['total_s']:>7.2f}x  " + ", ".join(f"{k[:-2]} {v * 1e3:.1f}" for k, v in p.items()
                                                         if k != "total_s"), flush=True)
    out = pathlib.Path(os.environ.get("OUT") or pathlib.Path(__file__).resolve().parents[1] / "results" / "latest")
    target = out / "distributed_model_fit.json"
    write_json(target, {"source": path.name, "coefficients": coef, "rows": rows})
    print(f"wrote {target}")


def main_counts(sizes: list[int]) -> None:
    rows = []
    with tempfile.TemporaryDirectory(prefix="lik-model-") as tmp:
        for n in sizes:
            row = {"workers": n, "model": model(n), "dask": measure(n, pathlib.Path(tmp))}
            rows.append(row)
            m, d = row["model"], row["dask"]
            print(f"N={n:3d}  Q holders {d['workers_holding_query']:3d} (model {n}; copies between workers "
                  f"{m['query_copies_between_workers']} in "
                  f"{m['query_rounds']} rounds)  partials moved {d['partials_moved']:3d} "
                  f"(model {m['partials_moved']})  "
                  f"merge bytes {d['merge_bytes_between_workers']:9d} (model {m['merge_bytes_between_workers']})  "
                  f"worker merge levels {d['worker_merge_levels']} (model {m['worker_merge_levels']}), merge tasks "
                  f"{d['merge_tasks']} (model {m['merge_tasks']}), client fetches {d['client_partials']} "
                  f"(model {m['client_partials']})  search {d['search_seconds'] * 1e3:.0f} ms",
                  flush=True)
    out = pathlib.Path(os.environ.get("OUT") or pathlib.Path(__file__).resolve().parents[1] / "results" / "latest")
    meta = {"nq": NQ, "lq": LQ, "dim": DIM, "dtype": "float32", "k": K,
            "note": "in-process LocalCluster (inproc transport), CPU path"}
    write_json(out / "distributed_model.json", {"config": meta, "rows": rows})
    print(f"wrote {out / 'distributed_model.json'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("counts", help="count copies, transfers and merge tasks on an in-process cluster")
    c.add_argument("workers", type=int, nargs="*", default=[1, 2, 3, 4, 8, 16, 32, 64])
    f = sub.add_parser("fit", help="fit the stage times of a bench_distributed.py JSON; predict more workers")
    f.add_argument("bench", type=pathlib.Path)
    f.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    args = p.parse_args()
    if args.mode == "counts":
        main_counts(args.workers)
    else:
        main_fit(args.bench, args.workers)


if __name__ == "__main__":
    main()
