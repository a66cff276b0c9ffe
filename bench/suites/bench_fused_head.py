#!/usr/bin/env python3
"""The fused projection head (issue 47): ``lik_cupy.torch.maxsim_from_hidden`` against
late-interaction-kernels' ``maxsim_from_hidden`` (LIK, where it imports) and the unfused torch
pipeline ``F.linear -> F.normalize -> lik_cupy.torch.maxsim``, in one run on one GPU.

Cells (h = 768, d = 128, Lq = 32, Ld = 300, unit queries, hidden states N(0, 1), ``W`` scaled by
1/sqrt(h), a bias):
  rerank   1 query x 1,000 documents, forward only (no gradient)
  train32  in-batch training, N = 32 queries x 32 documents: scores, cross-entropy of ``scores / 0.05``
           against the diagonal, backward to Q, H, W and bias
  train64  the same with N = 64

Each contender in each cell: ``ms``, the median over 3 rounds of n back-to-back calls (steps)
timed by CUDA events on torch's stream after warm-up calls (LIK's Triton autotuning and our
first compile happen there), host time included where the GPU waits on it; ``gpu_ms``, the
same calls queued behind a sleep, so that the host runs ahead and only GPU time shows (a training
step whose ``ms`` is far above it is host-bound); ``peak_mib``,
``torch.cuda.max_memory_allocated`` during one call (step) less what was allocated before it: the
call's scratch, outputs and, in training, the gradients. CuPy allocates through torch's caching
allocator (``bench.lib.gpu.setup_cupy``), so lik_cupy's buffers count; cuBLAS's own workspace does not,
for either cuBLAS handle (torch's and CuPy's). A ``floor`` row (forward cells) times the projection GEMM alone, ``F.linear(H, W, bias)`` in
cuBLAS: the work no design avoids (h = 768, d = 128, 1,000 x 300 tokens: 59 GFLOP and H's 460 MB in
16 bits). ``ours_over_best`` is our time over the faster peer,
``peak_over_best`` our peak over the smaller peer peak; ``scores_max_abs_diff`` compares each
contender's scores with the unfused pipeline's.

Writes ``fused_head_<gpu-slug>.json`` to ``--out`` (default $OUT, else bench/results) and prints a short
table last. ``--dtypes`` (default bfloat16) and ``--cells`` choose the run. ``--smoke``: tiny shapes on
the CPU (float32, wall-clock time, no peak memory, no LIK), which a test runs; its numbers mean nothing.

    python3 bench/suites/bench_fused_head.py [--out DIR] [--dtypes float16,bfloat16] [--cells rerank,train32,train64]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
from bench.lib import baselines  # noqa: E402
from bench.lib.gpu import safe_cleanup, start  # noqa: E402
from bench.lib.results import out_dir, short_err, text_table, write_json  # noqa: E402
from bench.lib.timing import per_call_ms, queued_call_ms  # noqa: E402

SHAPES = {"hidden": 768, "dim": 128, "lq": 32, "ld": 300}
CELLS = {"rerank": (1, 1000, False), "train32": (32, 32, True), "train64": (64, 64, True)}  # nq, nd, train
SMOKE_SHAPES = {"hidden": 24, "dim": 8, "lq": 4, "ld": 6}
SMOKE_CELLS = {"rerank": (1, 10, False), "train32": (3, 3, True), "train64": (5, 5, True)}
TARGET_MS = 100.0  # each timed round lasts about this long


def _inputs(torch, nq, nd, dtype, train, device, shapes, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    hid, dim, lq, ld = shapes["hidden"], shapes["dim"], shapes["lq"], shapes["ld"]
    Q = torch.nn.functional.normalize(torch.randn(nq, lq, dim, device=device, generator=g), dim=-1)
    H = torch.randn(nd, ld, hid, device=device, generator=g)
    W = torch.randn(dim, hid, device=device, generator=g) / hid**0.5
    b = torch.randn(dim, device=device, generator=g) * 0.01
    return [x.to(dtype).requires_grad_(train) for x in (Q, H, W, b)]


def _contenders(torch, lik):
    import torch.nn.functional as F

    import lik_cupy.torch as lt

    def unfused(Q, H, W, b):
        return lt.maxsim(Q, F.normalize(F.linear(H, W, b), dim=-1))

    out = {"ours": lambda Q, H, W, b: lt.maxsim_from_hidden(Q, H, W, b), "unfused": unfused,
           "floor": lambda Q, H, W, b: F.linear(H, W, b)}
    fn = _lik_head(lik)
    if fn is not None:
        out["lik"] = lambda Q, H, W, b: fn(Q, H, W, b=b)
    return out


def _lik_head(lik):
    """LIK's ``maxsim_from_hidden``: top-level where a release exports it, else in its
    ``fused_head`` module (0.4.5); None without LIK."""
    if lik is None:
        return None
    if hasattr(lik, "maxsim_from_hidden"):
        return lik.maxsim_from_hidden
    try:
        import importlib

        return importlib.import_module(lik.__name__ + ".fused_head").maxsim_from_hidden
    except (ImportError, AttributeError):
        return None


def _step(torch, fn, leaves, train):
    if not train:  # (no leaf requires a gradient)
        return lambda: fn(*leaves)
    labels = torch.arange(leaves[0].shape[0], device=leaves[0].device)

    def step():
        s = fn(*leaves)
        loss = torch.nn.functional.cross_entropy(s.float() / 0.05, labels)
        torch.autograd.grad(loss, leaves)
        return s

    return step


def _time(torch, call, gpu: bool, warm: int = 3):
    """(ms per call, calls per round): ``per_call_ms`` with rounds of about ``TARGET_MS``, after ``warm`` calls
    (on the CPU, smoke: the wall time of one call). ``gpu``: the calls run on the GPU (not whether CUDA
    is initialised: a smoke run in a process that used the GPU before still times the CPU)."""
    for _ in range(warm):
        call()
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    sync()
    t = time.perf_counter()
    call()
    sync()
    ms = (time.perf_counter() - t) * 1e3
    if not gpu:
        return ms, 1
    n = max(2, min(200, int(TARGET_MS / max(1e-3, ms))))
    return per_call_ms(torch, call, n), n


def _peak_mib(torch, call, gpu: bool):
    if not gpu:
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def run_cell(torch, name, dtype_name, contenders, smoke=False):
    nq, nd, train = (SMOKE_CELLS if smoke else CELLS)[name]
    shapes = SMOKE_SHAPES if smoke else SHAPES
    dtype = getattr(torch, dtype_name)
    leaves = _inputs(torch, nq, nd, dtype, train, "cpu" if smoke else "cuda", shapes)
    rows, ref = [], None
    for who in ("unfused", "ours", "lik", "floor"):
        fn = contenders.get(who)
        if fn is None or (who == "floor" and train):
            continue
        row = {"cell": name, "dtype": dtype_name, "contender": who, "nq": nq, "nd": nd, **shapes, "train": train}
        try:
            call = _step(torch, fn, leaves, train)
            with torch.no_grad():
                scores = fn(*[x.detach() for x in leaves]).float()
            ref = scores if who == "unfused" else ref
            row["scores_max_abs_diff"] = None if ref is None or who == "floor" else float((scores - ref).abs().max())
            row["ms"], row["calls_per_round"] = _time(torch, call, not smoke)
            # GPU time alone: the same calls queued behind a sleep (None on the CPU)
            row["gpu_ms"] = None if smoke else queued_call_ms(torch, call, row["calls_per_round"], row["ms"])
            row["peak_mib"] = _peak_mib(torch, call, not smoke)
        except Exception as e:  # noqa: BLE001  (a contender failing is reported, not fatal)
            row["error"] = short_err(e)
        print(f"{name:8s} {dtype_name:9s} {who:8s} " + (f"{row['ms']:.3f} ms  peak {_fmt(row['peak_mib'], '.1f')} "
              f"MiB  max|d scores| {row['scores_max_abs_diff']}" if "ms" in row else row["error"]), flush=True)
        rows.append(row)
        if not smoke:
            safe_cleanup(torch)
    return rows


def summarise(rows):
    """Per cell and dtype: our time (call and GPU) and peak over the best peer's."""
    out = []
    for key in sorted({(r["cell"], r["dtype"]) for r in rows}):
        cell = {r["contender"]: r for r in rows if (r["cell"], r["dtype"]) == key and "ms" in r}
        peers = [r for w, r in cell.items() if w not in ("ours", "floor")]
        if "ours" not in cell or not peers:
            continue
        ours = cell["ours"]
        out.append({"cell": key[0], "dtype": key[1], "ours_ms": ours["ms"], "ours_peak_mib": ours["peak_mib"],
                    "lik_ms": cell.get("lik", {}).get("ms"), "lik_peak_mib": cell.get("lik", {}).get("peak_mib"),
                    "unfused_ms": cell["unfused"]["ms"] if "unfused" in cell else None,
                    "unfused_peak_mib": cell["unfused"]["peak_mib"] if "unfused" in cell else None,
                    "ours_over_best": ours["ms"] / min(r["ms"] for r in peers),
                    "ours_over_lik": ours["ms"] / cell["lik"]["ms"] if "lik" in cell else None,
                    "ours_gpu_ms": ours.get("gpu_ms"), "lik_gpu_ms": cell.get("lik", {}).get("gpu_ms"),
                    "ours_gpu_over_lik": ours["gpu_ms"] / cell["lik"]["gpu_ms"]
                    if ours.get("gpu_ms") and cell.get("lik", {}).get("gpu_ms") else None,
                    "floor_ms": cell["floor"]["ms"] if "floor" in cell else None,
                    "peak_over_best": None if ours["peak_mib"] is None else
                    ours["peak_mib"] / min(r["peak_mib"] for r in peers)})
    return out


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--time-budget", type=float, default=None, help="seconds; cells past it are skipped")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (float32), for the tests")
    args = ap.parse_args(argv)
    cells = [c for c in args.cells.split(",") if c]
    unknown = [c for c in cells if c not in CELLS]
    if unknown:
        ap.error(f"unknown cells {unknown}; expected some of {list(CELLS)}")
    if args.smoke:
        import torch

        meta, slug, lik, err, dtypes, over_budget = {"gpu": "cpu smoke"}, "cpu-smoke", None, "smoke", ["float32"], \
            (lambda: False)
    else:
        ctx, meta = start(args)
        torch, slug, over_budget, dtypes = ctx.torch, ctx.slug, ctx.over_budget, args.dtypes.split(",")
        lik, err = baselines.load(baselines.LIK)
        if err:
            print(f"{baselines.LIK}: {err}", flush=True)
    contenders = _contenders(torch, lik)
    rows, skipped = [], []
    for dtype in [d for d in dtypes if d]:
        for cell in cells:
            if over_budget():
                skipped.append(f"{cell}/{dtype}")
                continue
            rows += run_cell(torch, cell, dtype, contenders, args.smoke)
    summary = summarise(rows)
    path = out_dir(args.out) / f"fused_head_{slug}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {**meta, "rows": rows, "summary": summary, "skipped": skipped, "lik_error": err,
                      "shapes": SMOKE_SHAPES if args.smoke else SHAPES})
    print(f"wrote {path}")
    header = ["cell", "dtype", "ours ms", "lik ms", "unfused ms", "floor ms", "ours/best", "ours/lik",
              "GPU ms ours/lik", "peak MiB ours/lik/unfused"]
    body = [[s["cell"], s["dtype"], _fmt(s["ours_ms"], ".3f"), _fmt(s["lik_ms"], ".3f"), _fmt(s["unfused_ms"], ".3f"),
             _fmt(s["floor_ms"], ".3f"),
             _fmt(s["ours_over_best"], ".2f"), _fmt(s["ours_over_lik"], ".2f"),
             "/".join(_fmt(s[k], ".3f") for k in ("ours_gpu_ms", "lik_gpu_ms")),
             "/".join(_fmt(s[k], ".0f") for k in ("ours_peak_mib", "lik_peak_mib", "unfused_peak_mib"))]
            for s in summary]
    print("\n".join(text_table(header, body, [s["dtype"] for s in summary])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
