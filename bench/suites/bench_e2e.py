#!/usr/bin/env python3
"""Whole calls as a service or a training loop makes them: wall time per call, host included.

Each cell is one call shape (d = 128, fp16, inputs already on the GPU), timed for ours from PyTorch
and from CuPy (the same buffers), from JAX under ``jit`` where ``lik_cupy.jax`` supports the call,
and for late-interaction-kernels 0.4.5 and flash-maxsim 0.3.0 with their equivalent masks or
lengths, in one run on one GPU:

  wall_ms    best of three rounds of 300 back-to-back calls, one synchronisation after each round
  kernel_ms  the same calls queued behind a spin kernel long enough that the host runs ahead: the
             GPU's time per call (every kernel the call launches); none for JAX, whose kernels run
             on its own stream, out of the reach of torch's events
  overhead   wall - kernel, in microseconds

Every contender's result is checked once, before it is timed, against float64 of the same inputs
(their masks or lengths too), computed once per cell outside the timed loop: ``max_rel_err``, the
max over its scores of |score - float64| / |float64| (a search: its top-k scores against
float64's top k, and against float64's scores of the ids it returned; a training step: the scores
it computes) and, for a training step, ``grad_rel_err``, its dQ and dD against float64's gradients
of (scores * W).sum(), relative in the Frobenius norm (a near tie that moves one argmax shows as
that row's share of the norm, not as a wrong gradient). A contender past
``bench.lib.results.WRONG_REL_ERR`` (1e-2) in either, with a NaN score, or whose result cannot be
compared, is listed as wrong: it is never the best peer, and a wrong row of ours gets no ratio.

    python3 bench/suites/bench_e2e.py [--out DIR] [--cells 1x1000,...] [--calls 300]
    python3 bench/suites/bench_e2e.py --smoke --out /tmp/e2e   # tiny shapes on the CPU path, no peers

Writes ``e2e_<gpu>.json`` (the smoke run: ``e2e_cpu-smoke.json``) to ``--out``, else $OUT, else
bench/results: ``rows`` (every implementation of every cell, with its errors) and ``cells`` (``{"case",
"caller", "ours_ms", "kernel_ms", "overhead_us", "best_peer", "best_peer_ms", "ratio", "max_rel_err",
"grad_rel_err", "wrong"}``, ratio = ours / best peer, below 1 means ours is faster, null where no
right peer does the job or this caller of ours is wrong; ``max_rel_err`` and ``grad_rel_err`` (training
steps) name every contender of the cell, ``wrong`` those past the tolerance), and prints the table last.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Callable

import numpy as np

os.environ.setdefault("LIK_SUPPRESS_NORM_WARN", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
from bench.lib import baselines  # noqa: E402
from bench.lib.gpu import unit_tokens  # noqa: E402
from bench.lib.reference import exact_grads, exact_scores, host64, max_rel_err, norm_rel_err  # noqa: E402
from bench.lib.results import (WRONG_REL_ERR, counts, fastest, out_dir, short_err, slugify, text_table,  # noqa: E402
                               write_json)
from bench.lib.timing import queued_call_ms, wall_ms  # noqa: E402

D = 128
# name: (queries, query tokens, documents, document tokens); the smoke run's shapes beside them
SERVING = {"1x100cand": (1, 32, 100, 180), "1x1000": (1, 32, 1000, 300), "1024x16pages": (1, 1024, 16, 1024),
           "32x1000": (32, 32, 1000, 180)}
SERVING_SMOKE = {"1x100cand": (1, 8, 10, 12), "1x1000": (1, 8, 20, 16), "1024x16pages": (1, 16, 3, 16),
                 "32x1000": (3, 8, 20, 12)}
# name: (N, query tokens, document tokens) of an in-batch training step
TRAINING = {"train_n32_32x80": (32, 32, 80), "train_n64_32x300": (64, 32, 300)}
TRAINING_SMOKE = {"train_n32_32x80": (4, 8, 12), "train_n64_32x300": (5, 8, 16)}
# the resident corpus: documents, their tokens, candidate ids per query, k of the search (the smoke run's
# cells keep the full run's names)
CORPUS = (100_000, 180, 100, 10)
CORPUS_SMOKE = (60, 12, 10, 10)


class Case:
    """One cell's calls: ``impls`` (name -> a call taking no argument), ``reference`` (a call making its
    float64 reference) and ``check`` (a call's result and the reference -> its errors, by name)."""

    def __init__(self, impls: dict, reference: Callable, check: Callable):
        self.impls, self.reference, self.check = impls, reference, check
        self._ref = None

    def ref(self):
        """The reference, made on the first call (after the cells a ``--cells`` run leaves out)."""
        if self._ref is None:
            self._ref = self.reference()
        return self._ref


def worst(*errs) -> float:
    """The largest error, NaN if any is NaN (``max`` would keep whichever came first)."""
    return math.nan if any(math.isnan(e) for e in errs) else max(errs)


def scores_check(out, ref) -> dict:
    return {"max_rel_err": max_rel_err(out, ref)}


def search_check(out, ref) -> dict:
    """A search's (scores, ids): its scores against float64's top k, and against float64's scores of its ids."""
    values, ids = out
    exact = host64(ref).reshape(-1)
    ids = host64(ids).astype(np.int64).reshape(-1)
    top = np.sort(exact)[::-1][:ids.size]
    return {"max_rel_err": worst(max_rel_err(values, top), max_rel_err(values, exact[ids]))}


def step_check(q, d):
    """The check of a training step on the leaves ``q``, ``d``: the scores it returned, and the gradients it
    left in ``q.grad`` and ``d.grad``, against ``exact_grads``'s."""
    def check(out, ref) -> dict:
        dq, dd, scores = ref
        return {"max_rel_err": max_rel_err(out, scores),
                "grad_rel_err": worst(norm_rel_err(q.grad, dq), norm_rel_err(d.grad, dd))}

    return check


def serving_cells(torch, device, smoke):
    """name -> dict of inputs (torch) for the serving rows."""
    g = torch.Generator(device=device).manual_seed(29)
    torch.manual_seed(29)
    cells = {}
    for name, (nq, lq, nd, ld) in (SERVING_SMOKE if smoke else SERVING).items():
        q, d = unit_tokens(torch, nq, lq, D, device=device), unit_tokens(torch, nd, ld, D, device=device)
        lens = torch.randint(ld // 4, ld + 1, (nd,), device=device, generator=g)
        mask = torch.arange(ld, device=device)[None, :] < lens[:, None]
        cells[name] = dict(q=q, d=d, lens=lens, mask=mask)
    return cells


def serving_impls(torch, peers, cells, cupy):
    """(cell, variant) -> Case."""
    out = {}
    for name, c in cells.items():
        out.update(_cell_impls(torch, peers, name, c, cupy))
    return out


def _cell_impls(torch, peers, name, c, cupy):
    """One cell's calls (a function of its own, so that each closure holds this cell's arrays).
    Peers take the equivalent of each variant: flash-maxsim lengths for a mask, LIK a mask for lengths.
    ``cupy``: the module, or None for no CuPy rows (the smoke run)."""
    import lik_cupy

    flash, lik = peers.get("flash"), peers.get("lik")
    q, d, lens, mask = c["q"], c["d"], c["lens"], c["mask"]
    whole = lambda: exact_scores(torch, q, d)  # noqa: E731
    valid = lambda: exact_scores(torch, q, d, d_mask=mask)  # noqa: E731  (lengths, mask and packed alike)
    out = {}
    plain = {"torch": lambda: lik_cupy.maxsim(q, d)}
    if cupy is not None:
        qc, dc = cupy.from_dlpack(q), cupy.from_dlpack(d)
        plain["cupy"] = lambda: lik_cupy.maxsim(qc, dc)
    if lik is not None:
        plain["lik"] = lambda: lik.maxsim(q, d)
    if flash is not None:
        plain["flash"] = (lambda: flash.flash_maxsim(q[0], d)) if q.shape[0] == 1 else \
            (lambda: flash.flash_maxsim_batched(q, d))
    out[(name, "")] = Case(plain, whole, scores_check)
    if name != "1x1000":
        return out
    lens32 = lens.int()
    lengths = {"torch": lambda: lik_cupy.maxsim(q, d, d_lengths=lens)}
    masked = {"torch": lambda: lik_cupy.maxsim(q, d, d_mask=mask)}
    if cupy is not None:
        lens32c, maskc = cupy.from_dlpack(lens32), cupy.from_dlpack(mask)
        lengths["cupy"] = lambda: lik_cupy.maxsim(qc, dc, d_lengths=lens32c)
        masked["cupy"] = lambda: lik_cupy.maxsim(qc, dc, d_mask=maskc)
    if flash is not None:
        lengths["flash"] = masked["flash"] = lambda: flash.flash_maxsim(q[0], d, doc_lengths=lens32)
    if lik is not None:
        lengths["lik"] = masked["lik"] = lambda: lik.maxsim(q, d, d_mask=mask)
    out[(name, "d_lengths")] = Case(lengths, valid, scores_check)
    out[(name, "d_mask")] = Case(masked, valid, scores_check)
    toks = d[mask].contiguous()
    off = torch.zeros(d.shape[0] + 1, dtype=torch.int32, device=d.device)
    off[1:] = torch.cumsum(lens, 0)
    packed = {"torch": lambda: lik_cupy.maxsim_varlen(q, toks, off),
              "torch_unchecked": lambda: lik_cupy.maxsim_varlen(q, toks, off, validate=False)}
    if cupy is not None:
        tc, oc = cupy.from_dlpack(toks), cupy.from_dlpack(off)
        packed["cupy"] = lambda: lik_cupy.maxsim_varlen(qc, tc, oc)
        packed["cupy_unchecked"] = lambda: lik_cupy.maxsim_varlen(qc, tc, oc, validate=False)
    if flash is not None:
        packed["flash"] = lambda: flash.flash_maxsim(q[0], toks, doc_lengths=off)
    out[(name, "packed")] = Case(packed, valid, scores_check)
    return out


def training_impls(torch, peers, device, smoke):
    """(cell, "") -> Case of step calls: the in-batch step scores [N, N] -> (scores * W).sum() -> backward,
    each returning its scores (detached) and leaving its gradients in the shared leaves' ``.grad``."""
    import lik_cupy.torch as lt

    flash, lik = peers.get("flash"), peers.get("lik")
    train = getattr(flash, "flash_maxsim_batched_train", None)
    out = {}
    for name, (n, lq, ld) in (TRAINING_SMOKE if smoke else TRAINING).items():
        q = unit_tokens(torch, n, lq, D, device=device).requires_grad_()
        d = unit_tokens(torch, n, ld, D, device=device).requires_grad_()
        w = torch.randn(n, n, device=device)

        def step(fn, q=q, d=d, w=w):
            def run():
                q.grad = d.grad = None
                s = fn(q, d)
                (s * w).sum().backward()
                return s.detach()
            return run

        impls = {"torch": step(lambda a, b: lt.maxsim(a, b))}
        if lik is not None:
            impls["lik"] = step(lambda a, b: lik.maxsim(a, b))
        if train is not None:
            impls["flash"] = step(lambda a, b: train(a, b, shared_docs=True))
        out[(name, "")] = Case(impls, lambda q=q, d=d, w=w: exact_grads(torch, q, d, w), step_check(q, d))
    return out


def jax_impls(cells, cases, jax_mod):
    """(cell, variant) -> Case of ``"jax_jit"``: the serving rows ``lik_cupy.jax`` takes under ``jit``, checked
    against the reference the torch rows of the same cell made."""
    out = {(name, ""): Case({"jax_jit": jax_mod.jitted(c["q"], c["d"])}, cases[(name, "")].ref, scores_check)
           for name, c in cells.items()}
    c = cells["1x1000"]
    out[("1x1000", "d_lengths")] = Case({"jax_jit": jax_mod.jitted(c["q"], c["d"], c["lens"])},
                                        cases[("1x1000", "d_lengths")].ref, scores_check)
    return out


def corpus_impls(torch, peers, device, smoke):
    """``Corpus.search`` (1 query, top-10 of 100,000 resident documents of 180 tokens) and
    ``Corpus.rerank`` (1 and 32 queries x 100 candidate ids), against the peers scoring the same
    (flash-maxsim + torch.topk; LIK on the gathered candidates, the gather included)."""
    import lik_cupy

    if not hasattr(lik_cupy, "Corpus"):
        return {}
    flash, lik = peers.get("flash"), peers.get("lik")
    n_docs, ld, n_ids, k = CORPUS_SMOKE if smoke else CORPUS
    d = unit_tokens(torch, n_docs, ld, D, device=device)
    corpus = lik_cupy.Corpus(d, device="cpu" if smoke else None)
    out = {}
    q1 = unit_tokens(torch, 1, 32, D, device=device)
    search = {"torch": lambda: corpus.search(q1, k)}
    if flash is not None:
        search["flash"] = lambda: torch.topk(flash.flash_maxsim(q1[0], d), k)
    out[("corpus_search_1x100k", "")] = Case(search, lambda: exact_scores(torch, q1, d), search_check)
    for nq in (1, 32):
        q = unit_tokens(torch, nq, 32, D, device=device)
        ids = torch.randint(0, n_docs, (nq, n_ids), device=device)
        rerank = {"torch": lambda q=q, ids=ids: corpus.rerank(q, ids)}
        if lik is not None:
            rerank["lik"] = lambda q=q, ids=ids: lik.maxsim(q, d[ids])
        if flash is not None and nq == 1:
            rerank["flash"] = lambda q=q, ids=ids: flash.flash_maxsim(q[0], d[ids[0]])
        out[(f"corpus_rerank_{nq}x100", "")] = Case(rerank, lambda q=q, ids=ids: torch.cat(
            [exact_scores(torch, q[i:i + 1], d[ids[i]]) for i in range(len(q))]), scores_check)
    return out


class _Jax:
    """Jitted calls of ``lik_cupy.jax.maxsim`` on the same data (JAX arrays made from the torch tensors)."""

    def __init__(self, jax, ljax):
        self.jax, self.ljax = jax, ljax

    def jitted(self, q, d, lens=None):
        jax = self.jax
        qj, dj = jax.dlpack.from_dlpack(q), jax.dlpack.from_dlpack(d)
        if lens is None:
            f = jax.jit(lambda a, b: self.ljax.maxsim(a, b))
            return lambda: f(qj, dj)
        lj = jax.dlpack.from_dlpack(lens.int())
        f = jax.jit(lambda a, b, c: self.ljax.maxsim(a, b, d_lengths=c))
        return lambda: f(qj, dj, lj)


def load_jax():
    try:
        import jax

        import lik_cupy.jax as ljax

        if jax.default_backend() != "gpu":
            return None, f"jax backend {jax.default_backend()}"
        return _Jax(jax, ljax), None
    except Exception as e:  # noqa: BLE001 - reported, the run goes on
        return None, repr(e)[:200]


def load_peers(smoke: bool) -> dict:
    """The peers (a missing one is None); none in the smoke run, which has no GPU for them."""
    return {} if smoke else baselines.load_peers()


def checked(case: Case, fn) -> dict:
    """One call of ``fn`` checked against the case's reference: its errors, and ``wrong`` (past
    WRONG_REL_ERR, NaN, or not comparable: ``check_error``)."""
    try:
        errs = case.check(fn(), case.ref())
    except Exception as e:  # noqa: BLE001 - a result that cannot be compared is wrong, and says why
        return {"check_error": short_err(e), "wrong": True}
    return {**errs, "wrong": not all(e <= WRONG_REL_ERR for e in errs.values())}  # (NaN fails <=)


OURS = ("torch", "cupy", "torch_unchecked", "cupy_unchecked", "jax_jit")
PEERS = ("lik", "flash")


def summarise(got: dict) -> list:
    """The ``cells``: each caller of ours in each case against the fastest right peer."""
    cells = []
    for label, impls in got.items():
        err = {i: worst(r.get("max_rel_err", math.nan), r.get("grad_rel_err", 0.0)) for i, r in impls.items()}
        best = fastest({p: impls[p]["wall_ms"] for p in PEERS if p in impls}, err)
        common = {"max_rel_err": {i: r.get("max_rel_err") for i, r in impls.items()},
                  **({"grad_rel_err": {i: r.get("grad_rel_err") for i, r in impls.items()}}
                     if any("grad_rel_err" in r for r in impls.values()) else {}),
                  "wrong": sorted(i for i, r in impls.items() if r["wrong"])}
        for impl in OURS:
            if impl in impls:
                r = impls[impl]
                right = best is not None and counts(r["wall_ms"], err[impl])
                cells.append({"case": label, "caller": impl, "ours_ms": r["wall_ms"], "kernel_ms": r.get("kernel_ms"),
                              "overhead_us": r.get("overhead_us"), "best_peer": best[0] if best else None,
                              "best_peer_ms": best[1] if best else None,
                              "ratio": r["wall_ms"] / best[1] if right else None, **common})
    return cells


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output directory (default $OUT, else bench/results)")
    ap.add_argument("--cells", default=None, help="comma-separated case names (default: all)")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--no-jax", action="store_true", help="skip the JAX rows")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU path, no CuPy, JAX or peers")
    args = ap.parse_args(argv)

    import torch

    if args.smoke:
        device, gpu, cupy, calls = "cpu", "cpu smoke", None, 3
        sync = lambda: None  # noqa: E731
    else:
        import cupy

        device, gpu, calls, sync = "cuda", torch.cuda.get_device_properties(0).name, args.calls, None
    peers = load_peers(args.smoke)
    cells_in = serving_cells(torch, device, args.smoke)
    todo = {}
    todo.update(serving_impls(torch, peers, cells_in, cupy))
    todo.update(training_impls(torch, peers, device, args.smoke))
    todo.update(corpus_impls(torch, peers, device, args.smoke))
    keep = set(args.cells.split(",")) if args.cells else None

    keep_case = (lambda key: True) if keep is None else (lambda key: key[0] in keep)
    rows, got = [], {}

    def time_all(todo, on_torch_stream=True):
        """Check, then time, every implementation of every kept case; ``on_torch_stream``: their kernels
        run on torch's current stream, so torch's events time them (JAX's do not: no kernel_ms for it)."""
        for key, case in todo.items():
            if not keep_case(key):
                continue
            label = key[0] + (f" {key[1]}" if key[1] else "")
            for impl, fn in case.impls.items():
                row = {"case": label, "impl": impl}
                try:
                    row.update(checked(case, fn))
                    row["wall_ms"] = wall_ms(torch, fn, calls, sync=sync)
                    if on_torch_stream and not args.smoke:
                        row["kernel_ms"] = queued_call_ms(torch, fn, calls, row["wall_ms"])
                        row["overhead_us"] = (row["wall_ms"] - row["kernel_ms"]) * 1e3
                    got.setdefault(label, {})[impl] = row
                except Exception as e:  # noqa: BLE001 - a failing implementation is recorded
                    row["error"] = repr(e)[:300]
                rows.append(row)
                print(row, flush=True)

    time_all(todo)
    # JAX last: its runtime (threads, its own allocator) starts only now, costing the rows above nothing.
    jax_err = "skipped (--smoke)" if args.smoke else "skipped (--no-jax)"
    if not args.no_jax and not args.smoke:
        jax_mod, jax_err = load_jax()
        if jax_err:
            print("jax:", jax_err)
        else:
            time_all(jax_impls(cells_in, todo, jax_mod), on_torch_stream=False)

    cells = summarise(got)
    path = out_dir(args.out) / f"e2e_{slugify(gpu)}.json"
    write_json(path, {"gpu": gpu, "smoke": args.smoke, "calls": calls, "rows": rows, "cells": cells,
                      "checks": {"reference": "float64 MaxSim of the same inputs, once per cell, before timing",
                                 "wrong_rel_err": WRONG_REL_ERR},
                      "jax_error": jax_err, "torch": torch.__version__})
    print(f"wrote {path}")
    header = ["case", "caller", "ours_ms", "kernel_ms", "overhead_us", "best_peer", "best_peer_ms", "ratio", "err"]
    body = [[c["case"], c["caller"], f"{c['ours_ms']:.4f}",
             "-" if c["kernel_ms"] is None else f"{c['kernel_ms']:.4f}",
             "-" if c["overhead_us"] is None else f"{c['overhead_us']:.1f}",
             c["best_peer"] or "-", "-" if c["best_peer_ms"] is None else f"{c['best_peer_ms']:.4f}",
             "-" if c["ratio"] is None else f"{c['ratio']:.2f}",
             "-" if c["max_rel_err"][c["caller"]] is None else f"{c['max_rel_err'][c['caller']]:.1e}"] for c in cells]
    print("\n".join(text_table(header, body, [c["case"] for c in cells])))
    for label, impls in got.items():
        for impl, r in impls.items():
            if r["wrong"]:
                print(f"wrong against float64: {label} {impl}: " + ", ".join(
                    f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()
                    if k in ("max_rel_err", "grad_rel_err", "check_error")))
    return path


if __name__ == "__main__":
    main()
