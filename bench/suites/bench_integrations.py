#!/usr/bin/env python3
"""PyLate and colpali-engine scoring: their own backends against lik_cupy.integrations (what
``patch_pylate()`` / ``patch_colpali_engine()`` route their calls to).

PyLate 1.6 ``colbert_scores(Q [Nq, Lq, 128], D [Nd, Ld, 128])``, fp16 unit tokens, with and without a
``documents_mask`` (prefix masks of random lengths, as bool):
  pylate_torch / pylate_flash / pylate_lik   pylate.scores.colbert_scores(..., backend=...)
  ours                                      lik_cupy.integrations.pylate.colbert_scores
Reranking shapes (``rerank_*``) are timed as a no-grad call; the in-batch training shapes
(``train_*``: N queries against their N positives) as a step, scores -> (scores * W).sum() -> backward.
With a mask the backends do not agree: PyLate's torch path (and ours) scores a masked token 0, its
flash and lik backends leave masked tokens out; each row's ``rel_err`` is against float64 of the
torch path's semantics, so it shows where a backend computes something else.

colpali-engine 0.3 ``score_multi_vector(qs, ps)`` (16 queries of 15..25 tokens, 1,000 pages of 1,030
tokens, bf16 lists on the GPU, the result on the CPU as colpali-engine returns it):
  colpali_torch / colpali_lik   BaseVisualRetrieverProcessor.score_multi_vector with
                                COLPALI_SCORES_BACKEND=torch / lik
  ours                          lik_cupy.integrations.colpali.score_multi_vector

Timing (CUDA events, as bench_forward.py): ``call_ms`` is back-to-back calls (or steps) over their
count, host included: what a PyLate or colpali-engine user pays. A case's implementations are timed
together, in ``ROUNDS`` interleaved rounds (the order rotating), and each reports its median round
(``call_ms_rounds`` holds them all): these calls are host-bound, and the host's speed drifts by
tens of percent over a run. ``device_ms`` queues the calls behind a spin kernel that outlasts their
host time (launch overhead hidden). ``score_multi_vector`` ends in a copy to the CPU, so its two
times are alike. Each implementation of each case first runs back to back for ``WARM_MS`` (kernels
built, caches, prepared calls and the allocator's pool filled, clocks up), so no case pays for
coming first.

PyLate and colpali-engine are imported through ``bench.lib.baselines.load_without_init`` (their scoring
modules only), flash-maxsim and LIK as the other suites import them. On the device:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .whl/integrations/*.whl
    PYTHONPATH=/tmp/site python3 bench/suites/bench_integrations.py [--out DIR] [--cases rerank_1x100,...]

Writes ``integrations_<gpu>.json``: ``rows`` (every implementation of every case) and ``cells``
(``{"case", "ours_ms", "best_peer", "best_peer_ms", "ratio"}``, call times, ratio = ours / the best peer,
below 1 means ours is faster (the committed runs before this direction, up to
``integrations_nvidia-h200.json`` and ``..._h100-80gb-hbm3.json`` with their archived runs, hold best
peer / ours under the same keys); with the device times and both sides' ``rel_err`` beside them: a masked
case's best peer may be a backend that scores something else).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("LIK_SUPPRESS_NORM_WARN", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
from bench.lib import baselines  # noqa: E402
from bench.lib.forcing import environment  # noqa: E402
from bench.lib.gpu import safe_cleanup, start, unit_tokens, warm_up_ours  # noqa: E402
from bench.lib.results import out_dir, short_err, text_table, write_json  # noqa: E402
from bench.lib.timing import per_call_ms, queued_call_ms  # noqa: E402

DIM = 128
# name -> (Nq, Nd, Lq, Ld, training step)
PYLATE_CASES = {
    "rerank_1x100": (1, 100, 32, 180, False),
    "rerank_1x1000": (1, 1000, 32, 300, False),
    "rerank_32x1000": (32, 1000, 32, 180, False),
    "train_32_ld80": (32, 32, 32, 80, True),
    "train_32_ld300": (32, 32, 32, 300, True),
    "train_64_ld80": (64, 64, 32, 80, True),
    "train_64_ld300": (64, 64, 32, 300, True),
}
COLPALI_CASES = {"colpali_16x1000": (16, 1000, (15, 25), 1030)}
PYLATE_BACKENDS = ("torch", "flash", "lik")
WARM_MS = 300  # back-to-back calls of each implementation of each case before it is timed
ROUNDS = 31  # timed rounds of each implementation of a case, interleaved
ROUND_MS = 20  # calls per round: about this long


def _pylate_impls():
    """name -> colbert_scores-like callable, and the import errors of what is missing."""
    from lik_cupy.integrations import pylate as ours

    impls, errors = {}, {}
    scores, err = baselines.load_without_init("pylate.scores", "pylate.utils")
    for backend in PYLATE_BACKENDS:
        if scores is None:
            errors[f"pylate_{backend}"] = err
        else:
            impls[f"pylate_{backend}"] = (lambda b: lambda q, d, dm: scores.colbert_scores(
                q, d, documents_mask=dm, backend=b))(backend)
    impls["ours"] = lambda q, d, dm: ours.colbert_scores(q, d, documents_mask=dm)
    return impls, errors


def _colpali_impls():
    from lik_cupy.integrations import colpali as ours

    impls, errors = {}, {}
    proc, err = baselines.load_without_init("colpali_engine.utils.processing_utils", "colpali_engine")
    for backend in ("torch", "lik"):
        if proc is None:
            errors[f"colpali_{backend}"] = err
            continue

        def call(qs, ps, b=backend):
            with environment("COLPALI_SCORES_BACKEND", b):
                return proc.BaseVisualRetrieverProcessor.score_multi_vector(qs, ps, device="cuda")

        impls[f"colpali_{backend}"] = call
    impls["ours"] = lambda qs, ps: ours.score_multi_vector(qs, ps, device="cuda")
    return impls, errors


def _reference(torch, Q, D, dm):
    """float64 scores with PyLate's torch-path semantics (a masked token scores 0), documents chunked."""
    out = []
    for j in range(0, D.shape[0], 100):
        d = D[j:j + 100].double()
        if dm is not None:
            d = d * dm[j:j + 100, :, None].double()
        out.append(torch.einsum("isk,jtk->ijst", Q.double(), d).amax(-1).sum(-1))
    return torch.cat(out, dim=1)


def _warm(torch, call):
    """``call`` back to back for ``WARM_MS`` (five calls at least), waiting for the GPU every ten
    calls (the host stays near it) and at the end."""
    t0, n = time.perf_counter(), 0
    while n < 5 or (time.perf_counter() - t0) * 1e3 < WARM_MS:
        call()
        n += 1
        if n % 10 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()


def _time_together(ctx, calls, reps):
    """name -> (call_ms, device_ms, call_ms of each round) for ``calls`` (name -> callable), timed
    together: each warmed up, then ``ROUNDS`` rounds in which each runs ``n`` calls back to back
    (its own ``n``: about ``ROUND_MS``), the order rotating from round to round, so that the
    machine's drift (the host's clocks, other tenants) falls on every implementation alike;
    ``call_ms`` is the median round. ``device_ms``: the calls queued behind a spin kernel longer
    than their host time (``timing.queued_call_ms``)."""
    torch = ctx.torch
    for call in calls.values():
        _warm(torch, call)
    n = {k: max(3, min(reps, int(ROUND_MS / max(per_call_ms(torch, c, 1, rounds=1), 1e-3))))
         for k, c in calls.items()}
    names, rounds = list(calls), {k: [] for k in calls}
    for r in range(ROUNDS):
        for k in names[r % len(names):] + names[:r % len(names)]:
            rounds[k].append(per_call_ms(torch, calls[k], n[k], rounds=1))
    out = {}
    for k, call in calls.items():
        call_ms = statistics.median(rounds[k])
        out[k] = (call_ms, queued_call_ms(torch, call, n[k], call_ms, ctx.cycles_per_ms), rounds[k])
    return out


def _time_rows(ctx, case_rows, calls, reps):
    """Time the implementations that ran (``calls``) together and write their times into their rows."""
    for name, (call_ms, device_ms, rounds) in _time_together(ctx, calls, reps).items():
        row = case_rows[name]
        row["call_ms"], row["device_ms"], row["call_ms_rounds"] = call_ms, device_ms, rounds
    for row in case_rows.values():
        print(_line(row), flush=True)


def run_pylate(ctx, name, rows, reps):
    torch = ctx.torch
    nq, nd, lq, ld, train = PYLATE_CASES[name]
    impls, errors = _pylate_impls()
    gen = torch.Generator(device="cuda").manual_seed(0)
    Q0 = unit_tokens(torch, nq, lq, DIM, generator=gen)
    D0 = unit_tokens(torch, nd, ld, DIM, generator=gen)
    lengths = torch.randint(ld // 4, ld + 1, (nd,), device="cuda", generator=gen)
    mask = torch.arange(ld, device="cuda")[None, :] < lengths[:, None]
    W = torch.randn(nq, nd, device="cuda", generator=gen)
    for masked in (False, True):
        dm = mask if masked else None
        case = f"{name}{'_mask' if masked else ''}"
        ref = _reference(torch, Q0, D0, dm)
        for impl in errors:
            rows.append({"case": case, "impl": impl, "error": errors[impl]})
        case_rows, calls = {}, {}
        for impl, fn in impls.items():
            row = case_rows[impl] = {"case": case, "impl": impl, "Nq": nq, "Nd": nd, "Lq": lq, "Ld": ld,
                                     "masked": masked, "step": "forward+backward" if train else "forward"}
            rows.append(row)
            try:
                if train:
                    Q, D = Q0.clone().requires_grad_(True), D0.clone().requires_grad_(True)

                    def call(fn=fn, Q=Q, D=D):
                        Q.grad = D.grad = None
                        (fn(Q, D, dm).float() * W).sum().backward()
                else:
                    def call(fn=fn):
                        with torch.no_grad():
                            return fn(Q0, D0, dm)
                with torch.no_grad():
                    out = fn(Q0, D0, dm).double()
                row["rel_err"] = ((out - ref).norm() / ref.norm()).item()
                call()
                calls[impl] = call
            except Exception as e:  # noqa: BLE001
                row["error"] = short_err(e)
        _time_rows(ctx, case_rows, calls, reps)
        safe_cleanup(torch)


def run_colpali(ctx, name, rows, reps):
    torch = ctx.torch
    nq, npages, (lq_lo, lq_hi), ld = COLPALI_CASES[name]
    impls, errors = _colpali_impls()
    gen = torch.Generator(device="cuda").manual_seed(1)
    lqs = torch.randint(lq_lo, lq_hi + 1, (nq,), generator=torch.Generator().manual_seed(1)).tolist()
    qs = [unit_tokens(torch, n, DIM, dtype=torch.bfloat16, generator=gen) for n in lqs]
    ps = [unit_tokens(torch, ld, DIM, dtype=torch.bfloat16, generator=gen) for _ in range(npages)]
    Qpad = torch.nn.utils.rnn.pad_sequence(qs, batch_first=True)
    ref = _reference(torch, Qpad, torch.stack(ps), None).cpu()
    for impl in errors:
        rows.append({"case": name, "impl": impl, "error": errors[impl]})
    case_rows, calls = {}, {}
    for impl, fn in impls.items():
        row = case_rows[impl] = {"case": name, "impl": impl, "Nq": nq, "Nd": npages, "Lq": f"{lq_lo}..{lq_hi}",
                                 "Ld": ld, "masked": False, "step": "score_multi_vector"}
        rows.append(row)
        try:
            out = fn(qs, ps).double()
            row["rel_err"] = ((out - ref).norm() / ref.norm()).item()
            calls[impl] = lambda fn=fn: fn(qs, ps)
        except Exception as e:  # noqa: BLE001
            row["error"] = short_err(e)
    _time_rows(ctx, case_rows, calls, reps)
    safe_cleanup(torch)


def cells(rows):
    """One cell per case: ours against the fastest peer that ran (by call time)."""
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        rs = [r for r in rows if r["case"] == case and "call_ms" in r]
        ours = next((r for r in rs if r["impl"] == "ours"), None)
        peers = [r for r in rs if r["impl"] != "ours"]
        if ours is None or not peers:
            continue
        best = min(peers, key=lambda r: r["call_ms"])
        best_dev = min(peers, key=lambda r: r["device_ms"])
        out.append({"case": case, "ours_ms": ours["call_ms"], "best_peer": best["impl"],
                    "best_peer_ms": best["call_ms"], "ratio": ours["call_ms"] / best["call_ms"],
                    "ours_rel_err": ours["rel_err"], "best_peer_rel_err": best["rel_err"],
                    "ours_device_ms": ours["device_ms"], "best_peer_device": best_dev["impl"],
                    "best_peer_device_ms": best_dev["device_ms"],
                    "device_ratio": ours["device_ms"] / best_dev["device_ms"]})
    return out


def _line(r):
    if "error" in r:
        return f"{r['case']:22s} {r['impl']:14s} {r['error'][:140]}"
    return (f"{r['case']:22s} {r['impl']:14s} call {r['call_ms']:8.3f} ms  device {r['device_ms']:8.3f} ms  "
            f"rel_err {r['rel_err']:.1e}")


def table(payload):
    header = ["case", "ours ms", "best peer", "peer ms", "ratio", "ours dev ms", "peer dev ms", "dev ratio"]
    body = [[c["case"], f"{c['ours_ms']:.3f}", c["best_peer"], f"{c['best_peer_ms']:.3f}", f"{c['ratio']:.2f}",
             f"{c['ours_device_ms']:.3f}", f"{c['best_peer_device_ms']:.3f}", f"{c['device_ratio']:.2f}"]
            for c in payload["cells"]]
    return "\n".join([f"GPU {payload['gpu']}: PyLate / colpali-engine scoring, d={DIM}"]
                     + text_table(header, body, [c["case"].split("_")[0] for c in payload["cells"]]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join([*PYLATE_CASES, *COLPALI_CASES]))
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None)
    ap.add_argument("--time-budget", type=float, default=None)
    args = ap.parse_args(argv)
    ctx, meta = start(args)
    warm_up_ours(meta, dims=(DIM,), dtypes=("float16", "bfloat16"))
    for dist in ("pylate", "colpali-engine"):
        meta["versions"][dist] = _dist_version(dist) or "not installed"
    rows = []
    path = out_dir(args.out) / f"integrations_{ctx.slug}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    for case in args.cases.split(","):
        if ctx.over_budget():
            rows.append({"case": case, "impl": "-", "error": "skipped: time budget spent"})
            continue
        (run_pylate if case in PYLATE_CASES else run_colpali)(ctx, case, rows, args.reps)
        payload = {**meta, "dim": DIM, "rows": rows, "cells": cells(rows)}
        write_json(path, payload)
    print(table(payload))
    print(f"wrote {path}")
    return 0


def _dist_version(name):
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
