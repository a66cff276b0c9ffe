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

    python3 bench/suites/bench_e2e.py [--out DIR] [--cells 1x1000,...] [--calls 300]

Writes ``e2e_<gpu>.json``: ``rows`` (every implementation of every cell) and ``cells``
(``{"case", "caller", "ours_ms", "kernel_ms", "overhead_us", "best_peer", "best_peer_ms", "ratio"}``,
ratio = ours / best peer, below 1 means ours is faster, null where no peer does the job), and prints
the table last.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("LIK_SUPPRESS_NORM_WARN", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
from bench.lib import baselines  # noqa: E402
from bench.lib.gpu import unit_tokens  # noqa: E402
from bench.lib.results import out_dir, slugify, text_table, write_json  # noqa: E402
from bench.lib.timing import queued_call_ms, wall_ms  # noqa: E402

D = 128
def serving_cells(torch):
    """name -> dict of inputs (torch) for the serving rows."""
    g = torch.Generator(device="cuda").manual_seed(29)
    torch.manual_seed(29)
    cells = {}

    def padded(name, nq, lq, nd, ld):
        q, d = unit_tokens(torch, nq, lq, D), unit_tokens(torch, nd, ld, D)
        lens = torch.randint(ld // 4, ld + 1, (nd,), device="cuda", generator=g)
        mask = torch.arange(ld, device="cuda")[None, :] < lens[:, None]
        cells[name] = dict(q=q, d=d, lens=lens, mask=mask)

    padded("1x100cand", 1, 32, 100, 180)
    padded("1x1000", 1, 32, 1000, 300)
    padded("1024x16pages", 1, 1024, 16, 1024)
    padded("32x1000", 32, 32, 1000, 180)
    return cells


def serving_impls(torch, peers, cells):
    """(cell, variant) -> {impl: fn}."""
    out = {}
    for name, c in cells.items():
        out.update(_cell_impls(torch, peers, name, c))
    return out


def _cell_impls(torch, peers, name, c):
    """One cell's calls (a function of its own, so that each closure holds this cell's arrays).
    Peers take the equivalent of each variant: flash-maxsim lengths for a mask, LIK a mask for lengths."""
    import cupy

    import lik_cupy

    flash, lik = peers.get("flash"), peers.get("lik")
    q, d, lens, mask = c["q"], c["d"], c["lens"], c["mask"]
    qc, dc = cupy.from_dlpack(q), cupy.from_dlpack(d)
    out = {}
    plain = {"torch": lambda: lik_cupy.maxsim(q, d), "cupy": lambda: lik_cupy.maxsim(qc, dc)}
    if lik is not None:
        plain["lik"] = lambda: lik.maxsim(q, d)
    if flash is not None:
        plain["flash"] = (lambda: flash.flash_maxsim(q[0], d)) if q.shape[0] == 1 else \
            (lambda: flash.flash_maxsim_batched(q, d))
    out[(name, "")] = plain
    if name != "1x1000":
        return out
    lens32 = lens.int()
    lens32c, maskc = cupy.from_dlpack(lens32), cupy.from_dlpack(mask)
    lengths = {"torch": lambda: lik_cupy.maxsim(q, d, d_lengths=lens),
               "cupy": lambda: lik_cupy.maxsim(qc, dc, d_lengths=lens32c)}
    masked = {"torch": lambda: lik_cupy.maxsim(q, d, d_mask=mask),
              "cupy": lambda: lik_cupy.maxsim(qc, dc, d_mask=maskc)}
    if flash is not None:
        lengths["flash"] = masked["flash"] = lambda: flash.flash_maxsim(q[0], d, doc_lengths=lens32)
    if lik is not None:
        lengths["lik"] = masked["lik"] = lambda: lik.maxsim(q, d, d_mask=mask)
    out[(name, "d_lengths")] = lengths
    out[(name, "d_mask")] = masked
    toks = d[mask].contiguous()
    off = torch.zeros(d.shape[0] + 1, dtype=torch.int32, device="cuda")
    off[1:] = torch.cumsum(lens, 0)
    tc, oc = cupy.from_dlpack(toks), cupy.from_dlpack(off)
    packed = {"torch": lambda: lik_cupy.maxsim_varlen(q, toks, off),
              "torch_unchecked": lambda: lik_cupy.maxsim_varlen(q, toks, off, validate=False),
              "cupy": lambda: lik_cupy.maxsim_varlen(qc, tc, oc),
              "cupy_unchecked": lambda: lik_cupy.maxsim_varlen(qc, tc, oc, validate=False)}
    if flash is not None:
        packed["flash"] = lambda: flash.flash_maxsim(q[0], toks, doc_lengths=off)
    out[(name, "packed")] = packed
    return out


def training_impls(torch, peers):
    """(cell, "") -> {impl: step fn}: the in-batch step scores [N, N] -> (scores * W).sum() -> backward."""
    import lik_cupy.torch as lt

    flash, lik = peers.get("flash"), peers.get("lik")
    train = getattr(flash, "flash_maxsim_batched_train", None)
    out = {}
    for name, (n, lq, ld) in {"train_n32_32x80": (32, 32, 80), "train_n64_32x300": (64, 32, 300)}.items():
        q = unit_tokens(torch, n, lq, D).requires_grad_()
        d = unit_tokens(torch, n, ld, D).requires_grad_()
        w = torch.randn(n, n, device="cuda")

        def step(fn, q=q, d=d, w=w):
            def run():
                q.grad = d.grad = None
                (fn(q, d) * w).sum().backward()
            return run

        impls = {"torch": step(lambda a, b: lt.maxsim(a, b))}
        if lik is not None:
            impls["lik"] = step(lambda a, b: lik.maxsim(a, b))
        if train is not None:
            impls["flash"] = step(lambda a, b: train(a, b, shared_docs=True))
        out[(name, "")] = impls
    return out


def jax_impls(cells, jax_mod):
    """(cell, variant) -> {"jax_jit": fn}: the serving rows ``lik_cupy.jax`` takes under ``jit``."""
    out = {(name, ""): {"jax_jit": jax_mod.jitted(c["q"], c["d"])} for name, c in cells.items()}
    c = cells["1x1000"]
    out[("1x1000", "d_lengths")] = {"jax_jit": jax_mod.jitted(c["q"], c["d"], c["lens"])}
    return out


def corpus_impls(torch, peers):
    """``Corpus.search`` (1 query, top-10 of 100,000 resident documents of 180 tokens) and
    ``Corpus.rerank`` (1 and 32 queries x 100 candidate ids), against the peers scoring the same
    (flash-maxsim + torch.topk; LIK on the gathered candidates, the gather included)."""
    import lik_cupy

    if not hasattr(lik_cupy, "Corpus"):
        return {}
    flash, lik = peers.get("flash"), peers.get("lik")
    d = unit_tokens(torch, 100_000, 180, D)
    corpus = lik_cupy.Corpus(d)
    out = {}
    q1 = unit_tokens(torch, 1, 32, D)
    search = {"torch": lambda: corpus.search(q1, 10)}
    if flash is not None:
        search["flash"] = lambda: torch.topk(flash.flash_maxsim(q1[0], d), 10)
    out[("corpus_search_1x100k", "")] = search
    for nq in (1, 32):
        q = unit_tokens(torch, nq, 32, D)
        ids = torch.randint(0, 100_000, (nq, 100), device="cuda")
        rerank = {"torch": lambda q=q, ids=ids: corpus.rerank(q, ids)}
        if lik is not None:
            rerank["lik"] = lambda q=q, ids=ids: lik.maxsim(q, d[ids])
        if flash is not None and nq == 1:
            rerank["flash"] = lambda q=q, ids=ids: flash.flash_maxsim(q[0], d[ids[0]])
        out[(f"corpus_rerank_{nq}x100", "")] = rerank
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


OURS = ("torch", "cupy", "torch_unchecked", "cupy_unchecked", "jax_jit")
PEERS = ("lik", "flash")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cells", default=None, help="comma-separated case names (default: all)")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--no-jax", action="store_true", help="skip the JAX rows")
    args = ap.parse_args()

    import torch

    props = torch.cuda.get_device_properties(0)
    peers = baselines.load_peers()
    cells_in = serving_cells(torch)
    todo = {}
    todo.update(serving_impls(torch, peers, cells_in))
    todo.update(training_impls(torch, peers))
    todo.update(corpus_impls(torch, peers))
    keep = set(args.cells.split(",")) if args.cells else None

    keep_case = (lambda key: True) if keep is None else (lambda key: key[0] in keep)
    rows, got = [], {}

    def time_all(todo, on_torch_stream=True):
        """Time every implementation of every kept case; ``on_torch_stream``: their kernels run on
        torch's current stream, so torch's events time them (JAX's do not: no kernel_ms for it)."""
        for key, impls in todo.items():
            if not keep_case(key):
                continue
            label = key[0] + (f" {key[1]}" if key[1] else "")
            for impl, fn in impls.items():
                row = {"case": label, "impl": impl}
                try:
                    row["wall_ms"] = wall_ms(torch, fn, args.calls)
                    if on_torch_stream:
                        row["kernel_ms"] = queued_call_ms(torch, fn, args.calls, row["wall_ms"])
                        row["overhead_us"] = (row["wall_ms"] - row["kernel_ms"]) * 1e3
                    got.setdefault(label, {})[impl] = row
                except Exception as e:  # noqa: BLE001 - a failing implementation is recorded
                    row["error"] = repr(e)[:300]
                rows.append(row)
                print(row, flush=True)

    time_all(todo)
    # JAX last: its runtime (threads, its own allocator) starts only now, costing the rows above nothing.
    jax_err = "skipped (--no-jax)"
    if not args.no_jax:
        jax_mod, jax_err = load_jax()
        if jax_err:
            print("jax:", jax_err)
        else:
            time_all(jax_impls(cells_in, jax_mod), on_torch_stream=False)

    cells = []
    for label, impls in got.items():
        peer = min(((impls[p]["wall_ms"], p) for p in PEERS if p in impls), default=None)
        for impl in OURS:
            if impl in impls:
                r = impls[impl]
                cells.append({"case": label, "caller": impl, "ours_ms": r["wall_ms"], "kernel_ms": r.get("kernel_ms"),
                              "overhead_us": r.get("overhead_us"), "best_peer": peer[1] if peer else None,
                              "best_peer_ms": peer[0] if peer else None,
                              "ratio": r["wall_ms"] / peer[0] if peer else None})
    name = slugify(props.name)
    path = out_dir(args.out) / f"e2e_{name}.json"
    write_json(path, {"gpu": props.name, "calls": args.calls, "rows": rows, "cells": cells,
                      "jax_error": jax_err, "torch": torch.__version__})
    print(f"wrote {path}")
    header = ["case", "caller", "ours_ms", "kernel_ms", "overhead_us", "best_peer", "best_peer_ms", "ratio"]
    body = [[c["case"], c["caller"], f"{c['ours_ms']:.4f}",
             "-" if c["kernel_ms"] is None else f"{c['kernel_ms']:.4f}",
             "-" if c["overhead_us"] is None else f"{c['overhead_us']:.1f}",
             c["best_peer"] or "-", "-" if c["best_peer_ms"] is None else f"{c['best_peer_ms']:.4f}",
             "-" if c["ratio"] is None else f"{c['ratio']:.2f}"] for c in cells]
    print("\n".join(text_table(header, body, [c["case"] for c in cells])))


if __name__ == "__main__":
    main()
