#!/usr/bin/env python3
"""PLAID residual reranking benchmark (issue 32): the exact stage of a PLAID search, 4,096 candidate
documents per query (fast-plaid's default ``n_full_scores``) scored from their compressed form.

Corpus: ``--docs`` documents (default 100,000) of 32..180 tokens (uniform, seeded; mean about 106,
ColBERT passages at fast-plaid's and PyLate's usual ``document_length`` of 180), d = 128, 32,768
float16 centroids, nbits 2 and 4, random codes and residual bits; queries of 32 unit tokens;
each query's own 4,096 distinct candidate ids. Cases: nbits {2, 4} x {1, 32} queries.

  ours         lik_cupy.maxsim_residual_varlen(Q, codes, bits, offsets, centroids, weights, nbits,
               candidates=ids, validate=False): the candidates scored where they lie in the corpus
  ours_checked the same with validate=True (the candidate ids range-checked on the device; the call
               waits for the check)
  lik          late_interaction_kernels.plaid.maxsim_residual_varlen (0.4.5) on each query's
               candidates, gathered into a packed copy beforehand (the gather is not timed: generous
               to it); one call per query, as its API scores every query against every document
  lik_gather   the same, the torch gather of the candidates' codes and residuals included
  fastplaid_ops  the torch operations fast-plaid 1.7's exact stage runs (rust/search/search.rs:
               StridedTensor lookup, decompress_residuals' lookup tables, direct_pad_sequences,
               matmul, colbert_score_reduce), re-created in torch for one query at a time. fast-plaid's
               own wheel needs its torch build and exposes no call to its exact stage alone, so it is
               not timed itself.

LIK reads the bits of each residual byte from the low end, not in fast-plaid's and ColBERTv2's
order, so its scores are not compared (timed only); ours are checked against float64 on a sample.

Metrics: ``ms`` median device time per call (CUDA events, a ~250 us sleep queued before each call so
host overhead is hidden; bench/lib/timing.py time_device), ``ms_e2e`` back-to-back calls (host
included). ``cells``: {"case", "ours_ms", "best_peer", "best_peer_ms", "ratio"} with ratio = ours /
best peer (target <= 1/1.3 against LIK). ``--sweep`` (default) also times every tile of
``lik_cupy._dispatch.tables.RESIDUAL_TILES`` for each case.

    python bench/suites/bench_residual.py --out bench/results      # JSON: residual_<gpu>.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
from bench.lib import baselines  # noqa: E402
from bench.lib.gpu import safe_cleanup, start  # noqa: E402
from bench.lib.results import out_dir, short_err, write_json  # noqa: E402
from bench.lib.timing import time_device, time_e2e  # noqa: E402

DIM, LQ, K, N_CENT, MAX_LEN = 128, 32, 4096, 32768, 180
TARGET = 1 / 1.3


def corpus(torch, n_docs, nbits, gen):
    lens = torch.randint(32, MAX_LEN + 1, (n_docs,), device="cuda", generator=gen)
    off = torch.zeros(n_docs + 1, dtype=torch.int64, device="cuda")
    off[1:] = lens.cumsum(0)
    t = int(off[-1])
    codes = torch.randint(0, N_CENT, (t,), device="cuda", generator=gen, dtype=torch.int32)
    bits = torch.randint(0, 256, (t, DIM * nbits // 8), device="cuda", generator=gen, dtype=torch.uint8)
    cen = torch.nn.functional.normalize(torch.randn(N_CENT, DIM, device="cuda", generator=gen), dim=-1).half()
    w = torch.sort(torch.randn(1 << nbits, device="cuda", generator=gen) * 0.03).values.half().float()
    return dict(lens=lens, off=off, codes=codes, bits=bits, cen=cen, w=w, nbits=nbits)


def candidates(torch, nq, n_docs, gen):
    return torch.stack([torch.randperm(n_docs, device="cuda", generator=gen)[:K] for _ in range(nq)])


def gathered(torch, c, ids):
    """One query's candidates packed: (codes, bits, int32 cu_seqlens, max length)."""
    lens = c["lens"][ids]
    rows = torch.repeat_interleave(c["off"][ids], lens) + (
        torch.arange(int(lens.sum()), device="cuda") - torch.repeat_interleave(lens.cumsum(0) - lens, lens))
    cu = torch.zeros(ids.numel() + 1, dtype=torch.int32, device="cuda")
    cu[1:] = lens.cumsum(0)
    return c["codes"][rows], c["bits"][rows], cu, int(lens.max())


def fastplaid_tables(torch, nbits):
    """fast-plaid's byte_reversed_bits_map and bucket_weight_indices_lookup (rust/utils/residual_codec.rs)."""
    rev = []
    mask = (1 << nbits) - 1
    for i in range(256):
        out, pos = 0, 8
        while pos >= nbits:
            seg = (i >> (pos - nbits)) & mask
            r = sum(1 << (nbits - 1 - k) for k in range(nbits) if seg & (1 << k))
            out |= r
            if pos > nbits:
                out <<= nbits
            pos -= nbits
        rev.append(out)
    kpb = 8 // nbits
    look = [[(b >> (k * nbits)) & mask for k in reversed(range(kpb))] for b in range(256)]
    return (torch.tensor(rev, dtype=torch.uint8, device="cuda"),
            torch.tensor(look, dtype=torch.int64, device="cuda"))


def fastplaid_exact(torch, c, q, ids, tables):
    """One query's exact stage as fast-plaid 1.7 runs it (rust/search/search.rs), in the same ATen ops."""
    rev, look = tables
    nbits = c["nbits"]
    lens = c["lens"][ids]
    codes, bits, _, lmax = gathered(torch, c, ids)  # StridedTensor::lookup
    n = codes.numel()
    packed_dim = DIM * nbits // 8
    cen = c["cen"].index_select(0, codes.long()).view(n, packed_dim, 8 // nbits)
    rb = rev.index_select(0, bits.flatten().int()).view(n, packed_dim)
    idx = look.index_select(0, rb.flatten().int()).to(torch.uint8)
    wts = c["w"].half().index_select(0, idx.flatten().int()).view(n, packed_dim, 8 // nbits)
    emb = (wts + cen).view(n, DIM)
    emb = emb / emb.norm(p=2, dim=-1, keepdim=True).clamp_min(1e-12)
    pad = torch.zeros(ids.numel(), lmax, DIM, dtype=emb.dtype, device="cuda")  # direct_pad_sequences
    mask = torch.arange(lmax, device="cuda")[None, :] < lens[:, None]
    pad[mask] = emb
    scores = pad @ q.T.unsqueeze(0)  # [K, Ld, Lq]
    scores = scores.masked_fill(~mask[..., None], -9999.0)  # colbert_score_reduce
    return scores.max(dim=1).values.sum(dim=-1, dtype=torch.float32)


def reference(c, q, ids):
    """float64 scores of q [Lq, d] against documents ``ids``, decompressed as lik_cupy.plaid documents them."""
    import lik_cupy.plaid as lp

    cen, w, qd = c["cen"].cpu().numpy(), c["w"].cpu().numpy(), q.double().cpu().numpy()
    out = []
    for j in ids.tolist():
        a, b = int(c["off"][j]), int(c["off"][j + 1])
        e = lp.decompress_residuals(c["codes"][a:b].cpu().numpy(), c["bits"][a:b].cpu().numpy(), cen, w, c["nbits"])
        out.append((qd @ e.astype(np.float64).T).max(axis=1).sum())
    return np.array(out)


def timed(ctx, fn, reps):
    dev = time_device(ctx, lambda _s: fn(), [None], reps)
    e2e = time_e2e(ctx, lambda _s: fn(), [None], max(3, reps // 2))
    return {"ms": statistics.median(dev), "ms_min": min(dev), "ms_e2e": e2e}


def run(args):
    ctx, meta = start(args)
    torch = ctx.torch
    lik, lik_err = baselines.load(baselines.LIK)
    lik_plaid = None
    if lik is not None:
        try:
            import late_interaction_kernels.plaid as lik_plaid
        except Exception as e:  # noqa: BLE001
            lik_err = short_err(e)
    res = {**meta, "suite": "residual", "args": vars(args), "docs": args.docs, "dim": DIM, "lq": LQ, "k": K,
           "centroids": N_CENT, "lik": "ok" if lik_plaid else f"unavailable: {lik_err}", "rows": [], "cells": [],
           "sweep": [], "targets": []}
    out = out_dir(args.out) / f"residual_{ctx.slug}.json"
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    t_end = time.time() + args.time_budget
    for nbits in (2, 4):
        c = corpus(torch, args.docs, nbits, gen)
        tables = fastplaid_tables(torch, nbits)
        for nq in (1, 32):
            if time.time() > t_end:
                break
            run_case(ctx, args, res, c, tables, nq, gen, lik_plaid)
            write_json(out, res)
            safe_cleanup(torch)
        del c, tables
        safe_cleanup(torch)
    write_json(out, res)
    for cell in res["cells"]:
        print(f"{cell['case']}: ours {cell['ours_ms']:.4f} ms, {cell['best_peer']} {cell['best_peer_ms']:.4f} ms, "
              f"ratio {cell['ratio']:.3f}", flush=True)
    print(f"wrote {out}", flush=True)
    return res


def run_case(ctx, args, res, c, tables, nq, gen, lik_plaid):
    """Time one case (nq queries of its own candidates against corpus ``c``) into ``res``."""
    import lik_cupy
    from lik_cupy import _dispatch as dispatch

    torch, nbits = ctx.torch, c["nbits"]
    case = f"nbits={nbits} Nq={nq} K={K} Lq={LQ}"
    q = torch.nn.functional.normalize(torch.randn(nq, LQ, DIM, device="cuda", generator=gen), dim=-1).half()
    ids = candidates(torch, nq, args.docs, gen)
    cc = torch.cuda.get_device_capability()
    row = {"case": case, "nbits": nbits, "nq": nq, "tokens_scored": int(c["lens"][ids].sum()),
           "kernel": dispatch.choose_residual(cc[0] * 10 + cc[1], "float16", DIM, LQ, nbits, False, 1, True,
                                              True).name, "impls": {}}
    ours_args = (q, c["codes"], c["bits"], c["off"], c["cen"], c["w"], nbits)
    impls = {
        "ours": lambda: lik_cupy.maxsim_residual_varlen(*ours_args, candidates=ids, validate=False),
        "ours_checked": lambda: lik_cupy.maxsim_residual_varlen(*ours_args, candidates=ids),
    }
    got = impls["ours"]()
    want = reference(c, q[0], ids[0, :48])
    row["max_abs_err_vs_float64"] = float(np.abs(got[0, :48].double().cpu().numpy() - want).max())
    row["err_bound"] = 2 * 2.0**-11 * LQ  # twice the sum over the (unit) query tokens of |q_s| 2^-11
    row["within_bound"] = row["max_abs_err_vs_float64"] <= row["err_bound"]
    if lik_plaid is not None:
        packs = [gathered(torch, c, ids[i]) for i in range(nq)]
        # One max_seqlen_d for every call: LIK autotunes and compiles per value (a constexpr).
        impls["lik"] = lambda: [lik_plaid.maxsim_residual_varlen(
            q[i], p[0], p[1], p[2], c["cen"], c["w"], nbits, max_seqlen_d=MAX_LEN) for i, p in enumerate(packs)]
        impls["lik_gather"] = lambda: [lik_plaid.maxsim_residual_varlen(
            q[i], *gathered(torch, c, ids[i])[:3], c["cen"], c["w"], nbits, max_seqlen_d=MAX_LEN) for i in range(nq)]
    impls["fastplaid_ops"] = lambda: [fastplaid_exact(torch, c, q[i], ids[i], tables) for i in range(nq)]
    # fast-plaid decodes the bits in its own way: its scores agree with ours to float16 rounding
    fp = torch.stack(impls["fastplaid_ops"]())
    row["fastplaid_ops_max_abs_diff"] = float((fp.float() - got.float()).abs().max())
    for name, fn in impls.items():
        try:
            fn()
            torch.cuda.synchronize()
            row["impls"][name] = timed(ctx, fn, args.reps)
        except Exception as e:  # noqa: BLE001
            row["impls"][name] = {"error": short_err(e)}
            safe_cleanup(torch)
    peers = {k: v["ms"] for k, v in row["impls"].items() if k not in ("ours", "ours_checked") and "ms" in v}
    ours_ms = row["impls"]["ours"].get("ms")
    if peers and ours_ms:
        best = min(peers, key=peers.get)
        res["cells"].append({"case": case, "ours_ms": ours_ms, "best_peer": best, "best_peer_ms": peers[best],
                             "ratio": ours_ms / peers[best]})
        if "lik" in peers:
            res["targets"].append({"case": case, "ours_over_lik": ours_ms / peers["lik"], "target": TARGET,
                                   "met": ours_ms / peers["lik"] <= TARGET})
    res["rows"].append(row)
    print(case, {k: round(v.get("ms", float("nan")), 4) for k, v in row["impls"].items()},
          f"err {row['max_abs_err_vs_float64']:.2e} (bound {row['err_bound']:.2e}), "
          f"fast-plaid ops differ by {row['fastplaid_ops_max_abs_diff']:.2e}", flush=True)
    if args.sweep:
        res["sweep"] += sweep(ctx, dispatch, impls["ours"], case, args.reps)


def sweep(ctx, dispatch, fn, case, reps):
    """``fn`` timed with each row of tables.RESIDUAL_TILES first in turn (the rows that fit)."""
    rows = []
    tiles = dict(dispatch.tables.RESIDUAL_TILES)
    try:
        for lb, order in tiles.items():
            if lb != 32:  # the cases' queries have 32 tokens
                continue
            for tile in order:
                dispatch.tables.RESIDUAL_TILES[lb] = (tile,) + tuple(t for t in order if t != tile)
                dispatch.clear_caches()
                try:
                    fn()
                    rows.append({"case": case, "tile": list(tile), **timed(ctx, fn, reps)})
                except Exception as e:  # noqa: BLE001
                    rows.append({"case": case, "tile": list(tile), "error": short_err(e)})
    finally:
        dispatch.tables.RESIDUAL_TILES.update(tiles)
        dispatch.clear_caches()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--time-budget", type=float, default=400.0)
    ap.add_argument("--no-sweep", dest="sweep", action="store_false")
    run(ap.parse_args())


if __name__ == "__main__":
    main()
