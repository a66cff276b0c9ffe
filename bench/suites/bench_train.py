#!/usr/bin/env python3
"""Training steps in every framework and mode, all in one run (issue 46's gate): wall time per step,
the GPU's time per step beside it.

The step: in-batch contrastive training, scores ``[N, N]`` of Q ``[N, Lq, d]`` against D ``[N, Ld, d]``
(unit tokens, float16, d = 128), cross-entropy of ``scores / 0.05`` against the diagonal, backward to Q
and D.

torch (``--torch-cells``): for each contender
  ours    ``lik_cupy.torch.maxsim``
  lik     late-interaction-kernels' ``maxsim`` (where it imports)
  flash   flash-maxsim's ``flash_maxsim_batched_train(shared_docs=True)`` (where it imports)
  torch   plain torch: einsum, amax, sum
in each mode: ``eager``, ``compile`` (``torch.compile``, inductor) and ``reduce-overhead``
(``torch.compile(mode="reduce-overhead")``: inductor's CUDA graphs, ``cudagraph_mark_step_begin``
each step). Each row records how many graphs dynamo made and how many cudagraph skips inductor
counted while compiling it (a skip means the step ran without CUDA graphs).

JAX (``--jax-cells``): ``jax.jit(jax.value_and_grad(loss))`` of the same step through
  kernel   ``lik_cupy.jax.maxsim`` on the kernels (``LIK_JAX_PATH=kernel``: two callbacks a step)
  xla      ``lik_cupy.jax.maxsim`` on its XLA path (``LIK_JAX_PATH=xla``: the einsum, first-winner gradient)
  auto     ``lik_cupy.jax.maxsim`` as shipped (the measured rule; ``path`` says which it took)
  einsum   XLA's own einsum as a user writes it (``jnp.einsum(...).max(-1).sum(-1)``)
The XLA rows are skipped where the similarities would pass ``--xla-max-gib``.

Timing: ``wall_ms`` is the best of ``--rounds`` rounds of ``--steps`` steps back to back, one
synchronisation after each round (fewer steps, at least 10, where a round would pass ``--round-s``),
after warm-up steps that compile (and record the CUDA graphs); ``kernel_ms`` the same steps queued
behind a spin kernel so the host runs ahead (torch on CUDA only: JAX's kernels run on XLA's stream).
A JAX cell's implementations take their rounds in turn, in a rotating order (steps of 0.05-0.5 ms
drift by 30% between rows timed one after the other): its rows' ``wall_ms`` is the median of
``--jax-rounds`` rounds and ``best_ms`` the best. Each row keeps its loss, to compare across rows.

``--smoke``: a tiny run on the CPU (torch eager and ``torch.compile(backend="aot_eager")``, JAX on
its CPU device, a few steps) that the tests run; its numbers mean nothing.

A whole run takes longer than one device command may (every compile mode recompiles per row):
split it by ``--torch-cells`` / ``--modes`` / ``--jax-cells`` (``none`` skips a framework), each
part with its own ``--tag``.

Writes ``train_<gpu-slug>[_<tag>].json`` (``gpu``, ``torch_rows``, ``jax_rows``, ``summary``: ours over the
best other contender per torch cell and mode, and the JAX rows over ``einsum`` per cell) to ``--out``
(default $OUT, else bench/results), after every row (``complete`` says whether the run finished). ``python bench/tools/jax_paths.py <that json>`` writes the JAX
rows' verdicts into ``lik_cupy/_dispatch/jax_paths.py``.

    python3 bench/suites/bench_train.py [--out DIR] [--torch-cells n32_32x80,...] [--jax-cells 8x32x80,...]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before jax is imported: CuPy needs its room
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
from bench.lib import baselines  # noqa: E402
from bench.lib.forcing import environment  # noqa: E402
from bench.lib.results import out_dir, short_err, slugify, text_table, write_json  # noqa: E402

DIM, TAU = 128, 0.05
TORCH_CELLS = {"n32_32x80": (32, 32, 80), "n64_32x300": (64, 32, 300), "n128_32x300": (128, 32, 300),
               "n256_32x300": (256, 32, 300), "colpali_n64_1024x1024": (64, 1024, 1024)}
JAX_CELLS = tuple((n, lq, ld) for n in (8, 32, 64, 128, 256)
                  for lq, ld in ((32, 80), (32, 300), (32, 1024), (128, 300), (1024, 1024)))
SMOKE_DIM, SMOKE_TORCH_CELLS, SMOKE_JAX_CELLS = 16, {"n4_8x16": (4, 8, 16)}, ((4, 8, 16), (6, 8, 24))
CONTENDERS = ("ours", "lik", "flash", "torch")
MODES = ("eager", "compile", "reduce-overhead")
JAX_IMPLS = ("kernel", "xla", "auto", "einsum")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output directory (default $OUT, else bench/results)")
    ap.add_argument("--torch-cells", default=None, help=f"comma-separated, of {','.join(TORCH_CELLS)}; 'none': skip")
    ap.add_argument("--jax-cells", default=None, help="comma-separated NxLqxLd (default: N 8-256 by five token "
                                                      "shapes); 'none': skip")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--round-s", type=float, default=1.0, help="fewer steps where a round would take longer")
    ap.add_argument("--jax-rounds", type=int, default=9, help="rotated rounds per JAX implementation")
    ap.add_argument("--tag", default=None, help="appended to the file name: train_<gpu>_<tag>.json (a run split "
                                                "by --modes or cells)")
    ap.add_argument("--xla-max-gib", type=float, default=24.0, help="skip XLA rows whose similarities pass this")
    ap.add_argument("--smoke", action="store_true", help="a tiny CPU run (the tests' check of this script)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.rounds, args.jax_rounds = min(args.steps, 3), 1, 2

    name, gpu = _device_name(args.smoke)
    path = out_dir(args.out) / f"train_{slugify(name)}{'_' + slugify(args.tag) if args.tag else ''}.json"
    os.makedirs(path.parent, exist_ok=True)
    rows_t, rows_j, run = [], [], {"jax_backend": None, "complete": False}

    def save() -> None:  # after every row: a run stopped at a device command's limit keeps what it measured
        write_json(path, {"gpu": gpu, "device": name, "smoke": args.smoke, "dim": SMOKE_DIM if args.smoke else DIM,
                          "dtype": "float32" if args.smoke else "float16", "tau": TAU, **run,
                          "versions": _versions(), "torch_rows": rows_t, "jax_rows": rows_j,
                          "summary": _summary(rows_t, rows_j)})

    if args.torch_cells != "none":
        torch_rows(args, rows_t, save)
    if args.jax_cells != "none":
        run["jax_backend"] = jax_rows(args, rows_j, save)
    run["complete"] = True
    save()
    _print(rows_t, rows_j, _summary(rows_t, rows_j))
    print(f"wrote {path}")
    return 0


# ---------------------------------------------------------------- torch


def torch_rows(args, rows: list, save) -> None:
    """Appends a row per (cell, mode, contender) to ``rows``, calling ``save`` after each."""
    import torch
    import torch.nn.functional as F

    device = "cpu" if args.smoke else "cuda"
    dim = SMOKE_DIM if args.smoke else DIM
    dtype = torch.float32 if args.smoke else torch.float16  # (the CPU path has no float16 GEMM worth timing)
    cells = _pick(SMOKE_TORCH_CELLS if args.smoke else TORCH_CELLS, args.torch_cells)
    scorers = _torch_scorers(torch, {} if args.smoke else baselines.load_peers(), args.contenders.split(","))
    modes = [m for m in args.modes.split(",") if m in MODES]
    gen = torch.Generator(device=device).manual_seed(46)
    for cell, (n, lq, ld) in cells.items():
        q, d = (_unit(torch, gen, (n, length, dim), dtype, device).requires_grad_() for length in (lq, ld))
        labels = torch.arange(n, device=device)
        for mode in modes:
            for who, score in scorers.items():
                row = {"cell": cell, "n": n, "lq": lq, "ld": ld, "mode": mode, "contender": who}
                try:
                    row.update(_time_torch_step(torch, F, args, score, mode, q, d, labels))
                except Exception as e:  # noqa: BLE001 - a failing row is recorded and the run goes on
                    row["error"] = short_err(e)
                rows.append(row)
                save()
                print(row, flush=True)


def _torch_scorers(torch, peers: dict, wanted: list) -> dict:
    """contender -> score(Q, D) -> [N, N] (float32 where the contender returns it)."""
    import lik_cupy.torch as lt

    def plain(q, d):
        return torch.einsum("isk,jtk->ijst", q, d).amax(-1).float().sum(-1)

    scorers = {"ours": lambda q, d: lt.maxsim(q, d), "torch": plain}
    if peers.get("lik") is not None:
        scorers["lik"] = lambda q, d: peers["lik"].maxsim(q, d)
    train = getattr(peers.get("flash"), "flash_maxsim_batched_train", None)
    if train is not None:
        scorers["flash"] = lambda q, d: train(q, d, shared_docs=True)
    return {k: scorers[k] for k in CONTENDERS if k in scorers and k in wanted}


def _time_torch_step(torch, F, args, score, mode, q, d, labels) -> dict:
    from torch._dynamo.utils import counters

    def loss(a, b):
        return F.cross_entropy(score(a, b).float() / TAU, labels)

    on_cuda = q.is_cuda
    if mode == "reduce-overhead" and not on_cuda:
        return {"error": "skipped: CUDA graphs need a CUDA device"}
    torch._dynamo.reset()
    counters.clear()
    if mode == "eager":
        fn = loss
    elif mode == "compile":
        fn = torch.compile(loss, backend="inductor" if on_cuda else "aot_eager")
    else:
        fn = torch.compile(loss, mode="reduce-overhead")

    def step():
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        q.grad = d.grad = None
        value = fn(q, d)
        value.backward()
        return value

    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    value = float(_warm(step, sync, 3).detach())
    out = {"loss": value, "graphs": int(counters["stats"]["unique_graphs"]),
           "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"])}
    out.update(_wall(step, sync, args))
    if on_cuda:
        from bench.lib.timing import queued_call_ms

        out["kernel_ms"] = queued_call_ms(torch, step, out["steps"], out["wall_ms"])
    return out


def _unit(torch, gen, shape, dtype, device):
    x = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
    return (x / x.norm(dim=-1, keepdim=True)).to(dtype)


# ---------------------------------------------------------------- JAX


def jax_rows(args, rows: list, save) -> str:
    """Appends a row per (cell, implementation) to ``rows``, calling ``save`` after each cell; returns
    JAX's backend."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import lik_cupy.jax as lj
    from lik_cupy._dispatch.jax_paths import choose_jax_path

    backend = "cpu" if args.smoke else "gpu"
    device = jax.devices(backend)[0]
    dim = SMOKE_DIM if args.smoke else DIM
    dtype = np.float32 if args.smoke else np.float16
    cells = SMOKE_JAX_CELLS if args.smoke else JAX_CELLS
    if args.jax_cells:
        cells = tuple(tuple(int(x) for x in c.split("x")) for c in args.jax_cells.split(","))
    rng = np.random.default_rng(46)

    def einsum(a, b):
        return jnp.einsum("isk,jtk->ijst", a, b, preferred_element_type=jnp.float32).max(-1).sum(-1)

    impls = {"kernel": ("kernel", lj.maxsim), "xla": ("xla", lj.maxsim), "auto": (None, lj.maxsim),
             "einsum": (None, einsum)}
    for n, lq, ld in cells:
        q, d = (jax.device_put(_unit_np(rng, (n, length, dim), dtype), device) for length in (lq, ld))
        gib = n * n * lq * ld * 4 / 2**30
        here, steps = [], {}
        for impl, (path, score) in impls.items():
            row = {"cell": f"{n}x{lq}x{ld}", "n": n, "lq": lq, "ld": ld, "impl": impl}
            if impl == "auto":
                row["path"] = choose_jax_path(backend, n, n, lq, ld)
            if (impl in ("xla", "einsum") or row.get("path") == "xla") and gib > args.xla_max_gib:
                row["error"] = f"skipped: the similarities take {gib:.1f} GiB (--xla-max-gib {args.xla_max_gib})"
            else:
                try:
                    row["loss"], steps[impl] = _jax_step(jax, jnp, score, path, q, d)
                except Exception as e:  # noqa: BLE001 - a failing row is recorded and the run goes on
                    row["error"] = short_err(e)
            here.append(row)
        timed = _rotated(steps, args) if steps else {}
        for row in here:
            row.update(timed.get(row["impl"], {}))
        rows += here
        save()
        for row in here:
            print(row, flush=True)
    return backend


def _jax_step(jax, jnp, score, path, q, d):
    """(the first step's loss, the jitted step, compiled and warm) through ``score`` on ``path``."""
    def loss(a, b):
        return -jnp.mean(jnp.diagonal(jax.nn.log_softmax(score(a, b) / TAU, axis=1)))

    step_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    with environment("LIK_JAX_PATH", path):  # read when the step is traced, on its first call
        value = float(jax.block_until_ready(step_fn(q, d))[0])
    for _ in range(2):
        out = step_fn(q, d)
    jax.block_until_ready(out)
    return value, lambda: step_fn(q, d)


def _rotated(steps: dict, args) -> dict:
    """Per implementation (``steps``: name -> a call of one step), the median and best ms per step over
    ``args.jax_rounds`` rounds taken in turn, in a rotating order: each round ``n`` steps back to back
    and one wait (``n`` from one timed step: ``--steps``, fewer where a round would pass ``--round-s``)."""
    import jax

    counts = {}
    for name, step in steps.items():
        t = time.perf_counter()
        jax.block_until_ready(step())
        counts[name] = max(min(10, args.steps), min(args.steps, int(args.round_s / max(time.perf_counter() - t, 1e-9))))
    times = {name: [] for name in steps}
    names = list(steps)
    for r in range(args.jax_rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            step, n = steps[name], counts[name]
            t = time.perf_counter()
            for _ in range(n):
                out = step()
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t) * 1e3 / n)
    return {name: {"wall_ms": statistics.median(v), "best_ms": min(v), "steps": counts[name], "rounds": len(v)}
            for name, v in times.items()}


def _unit_np(rng, shape, dtype):
    import numpy as np

    x = rng.standard_normal(shape).astype(np.float32)
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(dtype)


# ---------------------------------------------------------------- timing and the report


def _warm(step, sync, n):
    for _ in range(n):
        out = step()
    sync()
    return out


def _wall(step, sync, args) -> dict:
    """Best of ``args.rounds`` rounds of back-to-back steps (one ``sync`` a round): ``wall_ms`` per step
    and the steps a round took (``args.steps``, fewer where a round would pass ``args.round_s``)."""
    t = time.perf_counter()
    step()
    sync()
    one = time.perf_counter() - t
    steps = max(min(10, args.steps), min(args.steps, int(args.round_s / max(one, 1e-9))))
    best = float("inf")
    for _ in range(args.rounds):
        t = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        best = min(best, (time.perf_counter() - t) * 1e3 / steps)
    return {"wall_ms": best, "steps": steps}


def _summary(rows_t: list, rows_j: list) -> list[dict]:
    """Per torch cell and mode: ours over the best other contender; per JAX cell: each row over ``einsum``."""
    out = []
    timed = [r for r in rows_t if "wall_ms" in r]
    for cell, mode in dict.fromkeys((r["cell"], r["mode"]) for r in timed):
        here = {r["contender"]: r["wall_ms"] for r in timed if r["cell"] == cell and r["mode"] == mode}
        others = {k: v for k, v in here.items() if k != "ours"}
        best = min(others, key=others.get) if others else None
        out.append({"framework": "torch", "cell": cell, "mode": mode, "ours_ms": here.get("ours"), "best_other": best,
                    "best_other_ms": others.get(best),
                    "ratio": here["ours"] / others[best] if best and "ours" in here else None})
    timed = [r for r in rows_j if "wall_ms" in r]
    for cell in dict.fromkeys(r["cell"] for r in timed):
        here = {r["impl"]: r["wall_ms"] for r in timed if r["cell"] == cell}
        base = here.get("einsum")
        out.append({"framework": "jax", "cell": cell, "einsum_ms": base,
                    **{f"{k}_ratio": (v / base if base else None) for k, v in here.items() if k != "einsum"}})
    return out


def _print(rows_t, rows_j, summary) -> None:
    if rows_t:
        body = [[r["cell"], r["mode"], r["contender"], f"{r['wall_ms']:.4f}" if "wall_ms" in r else r["error"][:60],
                 f"{r['kernel_ms']:.4f}" if "kernel_ms" in r else "-", r.get("cudagraph_skips", "-")] for r in rows_t]
        print("\n".join(text_table(["cell", "mode", "contender", "wall_ms", "kernel_ms", "cudagraph_skips"], body,
                                   [(r["cell"], r["mode"]) for r in rows_t])))
    if rows_j:
        body = [[r["cell"], r["impl"] + (f" ({r['path']})" if "path" in r else ""),
                 f"{r['wall_ms']:.4f}" if "wall_ms" in r else r["error"][:60]] for r in rows_j]
        print("\n".join(text_table(["cell", "impl", "wall_ms"], body, [r["cell"] for r in rows_j])))
    for s in summary:
        print(s)


def _pick(cells: dict, arg) -> dict:
    if not arg:
        return cells
    names = arg.split(",")
    unknown = [c for c in names if c not in cells]
    if unknown:
        raise SystemExit(f"unknown cells {unknown}; known: {', '.join(cells)}")
    return {c: cells[c] for c in names}


def _device_name(smoke: bool) -> tuple[str, str | None]:
    """(the name in the file name, the GPU's name or None)."""
    if smoke:
        return "cpu-smoke", None
    import torch

    name = torch.cuda.get_device_properties(0).name
    return name, name


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for mod in ("torch", "jax", "cupy", baselines.LIK, baselines.FLASH):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - not installed, or no version
            out[mod] = None
    return out


if __name__ == "__main__":
    sys.exit(main())
