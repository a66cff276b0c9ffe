"""A/B of the two refinements of float32-accurate TF32 wgmma tiles on Hopper (``tables.REFINE_SCHEME``):
1 recomputes near-max similarities tile by tile from shared memory (cuda_src/fwd/refine.cuh), 2 keeps each
row's few near-max tokens and recomputes them once per document (cuda_src/fwd/refine_deferred.cuh).

One run on one GPU, in three parts:
  (a) correctness of both against float64: the contract (|s - f64| / (|f64| + 1) < 2e-6) and float64's
      argmax on tests/test_precision_gpu.py's near-tie constructions (ties of 1-100 ulps, exact duplicates,
      near ties in one thread's columns) on padded, packed and multi-query tiles;
  (b) kernel time of scheme 1, scheme 2, precision="tf32" and LIK's (and flash-maxsim's) float32 path on
      bench_precision.py's forward cells, and each one's error against float64 there;
  (c) a NumPy model of scheme 2's decision (the kernel's bound E, three keys per thread and row) counting
      the exact recomputations per query row per document on random unit vectors and clustered tokens.
Writes ``refine_sweep_<gpu>.json`` in ``--out`` (else $OUT, else bench/results) and prints a table last.

    python bench/sweeps/sweep_refine.py --out $OUT          # GPU, about two minutes
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the near-tie constructions and the float64 reference
from bench.lib import baselines  # noqa: E402
from bench.lib.forcing import refine_scheme  # noqa: E402
from bench.lib.gpu import safe_cleanup, start  # noqa: E402
from bench.lib.reference import exact_scores  # noqa: E402
from bench.lib.results import out_dir, short_err, slugify, text_table, write_json  # noqa: E402
from bench.suites.bench_precision import CELLS, Env, GpuClock, forward_case, peaks_of  # noqa: E402

SCHEMES = {1: "refine_tile", 2: "refine_deferred"}
TIMED_CELLS = ("textual", "long-doc", "medium", "visual", "colpali-1000", "32q-1000", "few-long-1", "few-long-16",
               "few-long-256")
TIE_ULPS = (0, 1, 3, 10, 100)
# (copies of the runner-up, all in one thread's columns)
TIE_KINDS = ((1, False), (1, True), (2, True), (40, False))


# --------------------------------------------------------------------------- kernels, compiled first

def _compile(cfg):
    from lik_cupy._runtime.nvrtc import cubin_path

    try:
        cubin_path("maxsim_fwd.cu", cfg.defines(), cfg.target(90))
        return None
    except Exception as e:  # noqa: BLE001  (reported; the run goes on and fails that contender alone)
        return f"{cfg.name}: {short_err(e)}"


def kernels(cells) -> list:
    """The configurations the run launches (both schemes, TF32, token-split variants), for a parallel
    compile into the kernel cache before anything is timed."""
    from dataclasses import replace

    from lik_cupy._dispatch import choose_forward

    shapes = [(40, 1, 400, False, True), (40, 1, 400, True, True), (32, 9, 400, False, True),
              (256, 1, 400, False, True), (1, 1, 150, False, True)]  # the tie checks: lq, queries, ld, packed, argmax
    shapes += [(CELLS[n].lq, max(1, CELLS[n].nq), CELLS[n].ld, False, False) for n in cells]
    out = {}
    for lq, nq, ld, packed, argmax in shapes:
        for x3 in (False, True):
            base = choose_forward(90, "float32", 128, lq, argmax, True, True, nq, ld, packed, True, x3)
            for cfg in ([replace(base, refine=s) for s in SCHEMES] if base.refine else [base]):
                out[cfg.name] = cfg
                if cfg.strided_tile is not None:
                    out[cfg.strided_tile.name] = cfg.strided_tile
    return list(out.values())


# --------------------------------------------------------------------------- (a) correctness

def tie_checks(torch, lk, rng) -> dict:
    """Under the current scheme: how many near-tie constructions keep float64's argmax and the contract."""
    import cupy
    from test_precision_gpu import CONTRACT_TOL, _contract_err, _packed, _planted_ties, _ulp_ties

    def ref_of(q, d):
        return exact_scores(torch, torch.from_numpy(q).cuda(), torch.from_numpy(d).cuda()).cpu().numpy()

    ok, failed = 0, []

    def holds(a, want, s, ref) -> bool:
        """float64's argmax, and the contract (_contract_err asserts that the non-finite scores agree)."""
        try:
            return np.array_equal(a, want) and _contract_err(s, ref) < CONTRACT_TOL
        except AssertionError:
            return False

    for ulps in TIE_ULPS:
        for copies, same_lane in TIE_KINDS:
            for layout, nq, lq in (("padded", 1, 40), ("packed", 1, 40), ("multi", 9, 32), ("long-query", 1, 256)):
                q, d, want, _ = _planted_ties(rng, nq, lq, 13, 400, 128, ulps, copies, same_lane)
                ref = ref_of(q, d)
                if layout == "packed":
                    tok, off = _packed(d, np.full(13, 400))
                    s, a = lk.maxsim_varlen(cupy.asarray(q), cupy.asarray(tok), cupy.asarray(off), return_argmax=True)
                else:
                    s, a = lk.maxsim(cupy.asarray(q), cupy.asarray(d), return_argmax=True)
                good = holds(cupy.asnumpy(a), np.broadcast_to(want[None, :, None], a.shape), cupy.asnumpy(s), ref)
                ok += good
                if not good:
                    failed.append(f"planted ulps={ulps} copies={copies} same_lane={same_lane} {layout}")
        if ulps:  # every token within the TF32 bound: the scans decide
            q, d, want = _ulp_ties(rng, 37, 150, 128, ulps, bool(ulps % 2))
            s, a = lk.maxsim(cupy.asarray(q), cupy.asarray(d), return_argmax=True)
            good = holds(cupy.asnumpy(a)[0, :, 0], want, cupy.asnumpy(s), ref_of(q, d))
            ok += good
            if not good:
                failed.append(f"ulp_ties ulps={ulps}")
    return {"passed": ok, "failed": failed}


# --------------------------------------------------------------------------- (b) timing

def time_cell(torch, lk, mods, name, env) -> dict:
    """Each contender's kernel ms and error against float64 on one of bench_precision.py's forward cells."""
    case = forward_case(torch, lk, mods, CELLS[name], env)
    runs = [(SCHEMES[1], "ours_default", 1), (SCHEMES[2], "ours_default", 2), ("tf32", "ours_tf32", None),
            ("lik_f32", "lik_f32", None), ("flash_f32", "flash_f32", None)]
    row = {"case": name, "kernel_ms": {}, "err": {}, "failures": {}}
    for label, key, scheme in runs:
        if key not in case.contenders:
            continue
        once, repeat = case.contenders[key]
        try:
            with refine_scheme(scheme) if scheme else contextlib.nullcontext():
                out = case.scored(once()).double()
                env.clock.sync()
                row["err"][label] = float(((out - case.ref).abs() / (case.ref.abs() + 1)).max())
                row["kernel_ms"][label] = env.clock.times(repeat)[0]
        except Exception as e:  # noqa: BLE001  (reported; the other contenders go on)
            row["failures"][label] = short_err(e)
            safe_cleanup(torch)
    k = row["kernel_ms"]
    peers = [k[p] for p in ("lik_f32", "flash_f32") if p in k]
    row["best_peer_ms"] = min(peers) if peers else None
    for label in SCHEMES.values():
        row[f"ratio_{label}"] = k[label] / row["best_peer_ms"] if label in k and row["best_peer_ms"] else None
    print(f"  {name}: " + ", ".join(f"{a} {b:.4f} ms" for a, b in k.items()), flush=True)
    return row


# --------------------------------------------------------------------------- (c) the recomputation model

def _tf32(x):
    return (x.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


def _unit(x):
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def recompute_model(q, d, bn: int) -> dict:
    """Scheme 2's decision for query rows q [R, dim] against one document d [L, dim] (all valid) in tiles of
    ``bn`` tokens: the exact recomputations per row (the candidates: TF32 value within 2E of the row's max;
    a scan recomputes exactly the same ones), the share of rows that a thread's bound sends to a scan
    (three candidates in one lane's columns, or two in one tile's; tokens t with (t % 8) // 2 the lane),
    and the float32 dot products per row those scans take (one per token of the scanned lanes' columns)."""
    v = _tf32(q).astype(np.float64) @ _tf32(d).astype(np.float64).T
    w = 2.0 ** -10 * (1 + 2.0 ** -11) + 2.0 ** -13 + 2.0 ** -15
    e = (np.linalg.norm(q - _tf32(q), axis=1) + w * np.linalg.norm(q, axis=1)) * np.linalg.norm(d, axis=1).max()
    near = v >= (v.max(axis=1) - 2 * e)[:, None]
    t = np.arange(d.shape[0])
    lane, tile = (t % 8) // 2, t // bn
    over = np.stack([(near[:, lane == k].sum(axis=1) >= 3)
                     | np.stack([near[:, (lane == k) & (tile == j)].sum(axis=1) >= 2 for j in range(tile.max() + 1)],
                                axis=1).any(axis=1) for k in range(4)], axis=1)
    return {"exact_per_row": float(near.sum(axis=1).mean()), "rows_scanned": float(over.any(axis=1).mean()),
            "float32_dots_per_row": float((over * np.bincount(lane, minlength=4)[None, :]).sum(axis=1).mean())}


def recompute_counts(seed: int) -> dict:
    """recompute_model on random unit vectors and on clustered tokens, 300-token documents in 64-token
    tiles and 1,024-token ones in 128-token tiles (the textual and ColPali tiles)."""
    rng = np.random.default_rng(seed)
    out = {}
    for ld, bn in ((300, 64), (1024, 128)):
        q = _unit(rng.standard_normal((512, 128)))
        out[f"random unit, {ld} tokens"] = recompute_model(q, _unit(rng.standard_normal((ld, 128))), bn)
        for clusters, noise in ((16, 0.3), (8, 0.1), (4, 0.03)):
            c = _unit(rng.standard_normal((clusters, 128)))
            d = _unit(c[rng.integers(0, clusters, ld)] + noise / np.sqrt(128) * rng.standard_normal((ld, 128)))
            qc = _unit(c[rng.integers(0, clusters, 512)] + 0.5 / np.sqrt(128) * rng.standard_normal((512, 128)))
            out[f"{clusters} clusters (noise {noise}), {ld} tokens"] = recompute_model(qc, d, bn)
    return out


# --------------------------------------------------------------------------- the run

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="output directory (default $OUT, else bench/results)")
    ap.add_argument("--cells", default=",".join(TIMED_CELLS), help="comma list of bench_precision.py forward cells")
    ap.add_argument("--time-budget", type=float, default=140.0, help="seconds: later cells are skipped")
    ap.add_argument("--target-ms", type=float, default=60.0, help="time of one timing round of calls (ms)")
    ap.add_argument("--max-calls", type=int, default=50)
    ap.add_argument("--ref-docs", type=int, default=100, help="errors over each cell's first N documents")
    ap.add_argument("--seed", type=int, default=43)
    args = ap.parse_args(argv)
    t0 = time.time()
    import torch

    import lik_cupy as lk

    ctx, meta = start(args)
    env = Env(smoke=False, device="cuda", l2=ctx.l2, peaks=peaks_of(ctx.gpu),
              clock=GpuClock(ctx, args.target_ms, args.max_calls), ref_docs=args.ref_docs)
    env.gen = torch.Generator(device="cuda").manual_seed(args.seed)
    mods = baselines.load_peers()
    cfgs = kernels(args.cells.split(","))
    with ProcessPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as ex:
        compile_failed = [e for e in ex.map(_compile, cfgs) if e]
    print(f"compiled {len(cfgs)} kernels in {time.time() - t0:.0f} s; failed: {compile_failed}", flush=True)
    out = out_dir(args.out) / f"refine_sweep_{slugify(ctx.gpu)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"suite": "sweep_refine", **meta, "args": vars(args), "schemes": SCHEMES, "compile_failed": compile_failed,
              "recompute_model": recompute_counts(args.seed), "ties": {}, "cells": [], "skipped": []}

    def save():
        write_json(out, {**result, "wall_s": time.time() - t0})

    for scheme, label in SCHEMES.items():
        with refine_scheme(scheme):
            result["ties"][label] = tie_checks(torch, lk, np.random.default_rng(args.seed))
        print(f"ties {label}: {result['ties'][label]['passed']} passed, failed: {result['ties'][label]['failed']}",
              flush=True)
        save()
    for name in args.cells.split(","):
        if time.time() - t0 > args.time_budget:
            result["skipped"].append(name)
            continue
        try:
            result["cells"].append(time_cell(torch, lk, mods, name, env))
        except Exception as e:  # noqa: BLE001  (a cell that cannot run: the rest go on)
            result.setdefault("cell_errors", {})[name] = short_err(e)
            print(f"  {name} failed: {short_err(e)}", flush=True)
        safe_cleanup(torch)
        save()
    save()
    print(f"wrote {out}", flush=True)
    for name, m in result["recompute_model"].items():
        print(f"model {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in m.items()))
    labels = ("refine_tile", "refine_deferred", "tf32", "lik_f32", "flash_f32")
    body = [[c["case"], *(f"{c['kernel_ms'][x]:.4f}" if x in c["kernel_ms"] else "-" for x in labels),
             *(f"{c[f'ratio_{x}']:.2f}" if c.get(f"ratio_{x}") else "-" for x in SCHEMES.values()),
             *(f"{c['err'][x]:.1e}" if x in c["err"] else "-" for x in SCHEMES.values())] for c in result["cells"]]
    print(f"# {ctx.gpu}: kernel ms; ratio = ours / best peer (target <= 0.8); ties passed: "
          + ", ".join(f"{k} {v['passed']} ({len(v['failed'])} failed)" for k, v in result["ties"].items()))
    header = ["case", *labels, "ratio tile", "ratio deferred", "err tile", "err deferred"]
    print("\n".join(text_table(header, body, [""] * len(body))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
