"""Where the refined float32 tiles with the document tokens on M (cuda_src/fwd/refine_m.cuh) beat the
queries-on-M refined tiles they replace, by document length.

One float32 query of 32 or 64 tokens (d = 128, unit vectors) against documents of Ld tokens, padded
and packed, Nd so that every cell streams about 300,000 tokens (and at least 1,000 documents): the
default precision (float32 accuracy) on the queries-on-M tile (``tables.REFINE_TOKM_STAGES`` empty),
on the tokens-on-M tile at each stage count, and precision "tf32" as the floor the refinement
approaches. Device time per call (back-to-back calls behind a spin kernel). The JSON backs
``tables.REFINE_TOKM_MIN_LD``.

    python bench/sweeps/sweep_refine_tokm.py --out DIR      # refine_tokm_sweep_<gpu>.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.lib.forcing import tables  # noqa: E402
from bench.lib.results import slugify, text_table, write_json  # noqa: E402
from bench.lib.timing import per_call_ms  # noqa: E402

LDS = (128, 180, 300, 512, 768, 1024, 2048)
TOKENS = 300_000


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--lq", default="32,64")
    ap.add_argument("--ld", default=",".join(map(str, LDS)))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--time-budget", type=float, default=240)
    args = ap.parse_args()
    t0 = time.time()
    import torch

    import lik_cupy

    stage_sets = {"queries_on_m": (), "tokens_on_m_s2": (2,), "tokens_on_m_s3": (3,)}
    gpu = torch.cuda.get_device_name()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for lq in map(int, args.lq.split(",")):
        for ld in map(int, args.ld.split(",")):
            if time.time() - t0 > args.time_budget:
                print("time budget spent; skipping lq", lq, "ld", ld, flush=True)
                continue
            nd = max(1000, TOKENS // ld)
            q = torch.nn.functional.normalize(torch.randn(1, lq, 128, device="cuda", generator=g), dim=-1)
            d = torch.nn.functional.normalize(torch.randn(nd, ld, 128, device="cuda", generator=g), dim=-1)
            off = torch.arange(0, (nd + 1) * ld, ld, device="cuda", dtype=torch.int64)
            tok = d.reshape(-1, 128)
            for packed in (False, True):
                def call(precision=None):
                    if packed:
                        return lik_cupy.maxsim_varlen(q, tok, off, precision=precision)
                    return lik_cupy.maxsim(q, d, precision=precision)

                row = {"lq": lq, "ld": ld, "nd": nd, "packed": packed,
                       "tf32_ms": per_call_ms(torch, lambda: call("tf32"), args.reps, spin_cycles=20_000_000)}
                outs = {}
                for name, stages in stage_sets.items():
                    with tables(REFINE_TOKM_STAGES=stages, REFINE_TOKM_MIN_LD=0, REFINE_TOKM_MAX_LQ=64):
                        outs[name] = call().cpu()
                        row[f"{name}_ms"] = per_call_ms(torch, call, args.reps, spin_cycles=20_000_000)
                base = outs["queries_on_m"]
                row["same_bits"] = all(bool(torch.equal(o, base)) for o in outs.values())
                best = min((k for k in row if k.startswith("tokens_on_m")), key=lambda k: row[k])
                row["best_tokens_on_m"] = best[:-3]
                row["ratio"] = row[best] / row["queries_on_m_ms"]  # below 1: tokens on M faster
                rows.append(row)
                print(row, flush=True)
            q = d = tok = off = None  # freed before the next cell allocates
            torch.cuda.empty_cache()
    path = Path(args.out) / f"refine_tokm_sweep_{slugify(gpu)}.json"
    write_json(path, {"gpu": gpu, "tokens_per_cell": TOKENS, "rows": rows})
    cols = ["lq", "ld", "packed", "tf32_ms", "queries_on_m_ms", *[f"{k}_ms" for k in stage_sets if k != "queries_on_m"],
            "ratio", "same_bits"]
    print("\n".join(text_table(cols, [[r.get(c) for c in cols] for r in rows], [r["lq"] for r in rows])))


if __name__ == "__main__":
    main()
