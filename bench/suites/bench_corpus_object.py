#!/usr/bin/env python3
"""The resident corpus of a search service (issue 29): ``lik_cupy.Corpus`` search and rerank.

Corpus: ``--docs`` documents (default 100,000) of Ld = 180 tokens, d = 128, float16, unit random
tokens, on the GPU (4.6 GB at the default size); queries of 32 tokens. Cases:

  search  1 query, top-10 of the whole corpus
          ours           Corpus.search(Q, 10): the corpus checked once, the call checks Q only
          ours_retrieve  lik_cupy.retrieve(Q, D, 10): the stateless call on the same arrays
          flash_topk     flash_maxsim.flash_maxsim_batched(Q, D) + torch.topk (0.3.0)
          lik_retrieve   late_interaction_kernels.retrieve(Q, D, top_k=10, normalize=False, chunk=4096) (0.4.5)
  rerank  1 and 32 queries, each against its own 100 candidate ids (distinct, random)
          ours           Corpus.rerank(Q, ids): the candidates scored where they lie (LIK_CAND tiles)
          ours_gather    D[ids] gathered by torch ([Nq, 100, 180, 128]), then lik_cupy.maxsim
          flash_gather   D[ids] gathered, then flash_maxsim_batched one query at a time
          lik_gather     D[ids] gathered, then late_interaction_kernels.maxsim one query at a time

``ms``: median device time per call (CUDA events, a ~250 us sleep queued before each call so host
overhead is hidden; bench/lib/timing.py time_device); ``ms_e2e``: back-to-back calls, host included.
Each rerank row says whether its scores equal ``ours`` bit for bit (``same_as_ours``; the gathered
maxsim must, tests/test_corpus_object_gpu.py checks it). ``cells``: ours against the best peer.

    python bench/suites/bench_corpus_object.py --out bench/results    # JSON: corpus_object_<gpu>.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
from bench.lib import baselines  # noqa: E402
from bench.lib.gpu import safe_cleanup, start, warm_up_ours  # noqa: E402
from bench.lib.results import counts, fastest, out_dir, short_err, write_json  # noqa: E402
from bench.lib.timing import time_device, time_e2e  # noqa: E402

DIM, LQ, LD, K_SEARCH, K_RERANK = 128, 32, 180, 10, 100


def timed(ctx, fn, reps):
    dev = time_device(ctx, lambda _s: fn(), [None], reps)
    e2e = time_e2e(ctx, lambda _s: fn(), [None], max(3, reps // 2))
    return {"ms": statistics.median(dev), "ms_min": min(dev), "ms_e2e": e2e}


def unit(torch, shape, gen):
    return torch.nn.functional.normalize(torch.randn(*shape, device="cuda", generator=gen), dim=-1).half()


def run(args):
    ctx, meta = start(args)
    torch = ctx.torch
    import lik_cupy

    warm_up_ours(meta, dims=(DIM,), dtypes=("float16",), query_lengths=(LQ,))
    peers = baselines.load_peers()
    res = {**meta, "suite": "corpus_object", "args": vars(args), "docs": args.docs, "dim": DIM, "lq": LQ, "ld": LD,
           "peers": {k: ("ok" if v is not None else "unavailable") for k, v in peers.items()}, "rows": [], "cells": []}
    out = out_dir(args.out) / f"corpus_object_{ctx.slug}.json"
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    D = unit(torch, (args.docs, LD, DIM), gen)
    t0 = time.time()
    corpus = lik_cupy.Corpus(D)
    torch.cuda.synchronize()
    res["corpus_build_s"] = time.time() - t0
    res["corpus"] = repr(corpus)
    print(res["corpus"], f"built in {res['corpus_build_s']:.3f} s", flush=True)

    q = unit(torch, (1, LQ, DIM), gen)
    impls = {
        "ours": lambda: corpus.search(q, K_SEARCH),
        "ours_retrieve": lambda: lik_cupy.retrieve(q, D, K_SEARCH),
    }
    if peers["flash"] is not None:
        impls["flash_topk"] = lambda: torch.topk(peers["flash"].flash_maxsim_batched(q, D), K_SEARCH, dim=-1)
    if peers["lik"] is not None:
        impls["lik_retrieve"] = lambda: peers["lik"].retrieve(q, D, top_k=K_SEARCH, normalize=False, chunk=4096)
    want = corpus.search(q, K_SEARCH)[1]
    case(ctx, args, res, f"search top{K_SEARCH} 1q x {args.docs}d Ld{LD}", impls,
         lambda got: bool(torch.equal(got[1], want)) if isinstance(got, tuple) else None)
    write_json(out, res)

    for nq in (1, 32):
        q = unit(torch, (nq, LQ, DIM), gen)
        ids = torch.stack([torch.randperm(args.docs, device="cuda", generator=gen)[:K_RERANK] for _ in range(nq)])
        impls = {
            "ours": lambda: corpus.rerank(q, ids),
            "ours_gather": lambda: lik_cupy.maxsim(q, D[ids]),
        }
        if peers["flash"] is not None:
            impls["flash_gather"] = lambda: torch.cat(
                [peers["flash"].flash_maxsim_batched(q[i:i + 1], D[ids[i]]) for i in range(nq)])
        if peers["lik"] is not None:
            impls["lik_gather"] = lambda: torch.cat([peers["lik"].maxsim(q[i:i + 1], D[ids[i]]) for i in range(nq)])
        want = corpus.rerank(q, ids)
        case(ctx, args, res, f"rerank {nq}q x {K_RERANK} ids of {args.docs}d Ld{LD}", impls,
             lambda got: bool(torch.equal(got.float(), want)))
        write_json(out, res)
        safe_cleanup(torch)
    for cell in res["cells"]:
        print(f"{cell['case']}: ours {cell['ours_ms']:.4f} ms, {cell['best_peer']} {cell['best_peer_ms']:.4f} ms, "
              f"ratio {cell['ratio']:.3f}", flush=True)
    print(f"wrote {out}", flush=True)
    return res


def case(ctx, args, res, name, impls, same_as_ours):
    torch = ctx.torch
    row = {"case": name, "impls": {}}
    for impl, fn in impls.items():
        try:
            got = fn()
            torch.cuda.synchronize()
            try:
                same = same_as_ours(got)
            except Exception:  # noqa: BLE001  (a peer's result of another shape or type)
                same = None
            row["impls"][impl] = {**timed(ctx, fn, args.reps), "same_as_ours": same}
        except Exception as e:  # noqa: BLE001
            row["impls"][impl] = {"error": short_err(e)}
            safe_cleanup(torch)
    cell = best_cell(name, row["impls"])
    if cell:
        res["cells"].append(cell)
    res["rows"].append(row)
    print(name, {k: round(v.get("ms", float("nan")), 4) for k, v in row["impls"].items()}, flush=True)


def best_cell(name, impls):
    """The case's cell: ``ours`` against the fastest peer that ran (flash-maxsim or LIK; our own other calls,
    ``ours_*``, are no peers), ratio = ours / peer; None without both."""
    ours_ms = impls.get("ours", {}).get("ms")
    best = fastest({k: v["ms"] for k, v in impls.items() if not k.startswith("ours") and "ms" in v})
    if not best or not counts(ours_ms):
        return None
    return {"case": name, "ours_ms": ours_ms, "best_peer": best[0], "best_peer_ms": best[1], "ratio": ours_ms / best[1]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--time-budget", type=float, default=None)
    run(ap.parse_args())


if __name__ == "__main__":
    main()
