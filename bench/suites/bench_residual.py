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

Errors: every contender's scores, all queries' candidates, are checked once before it is timed
against float64 MaxSim of the documents it reads, decompressed exactly in float64 (``exact_docs``:
centroid + bucket weight, then unit length; ``max_abs_err_vs_float64``, per contender). Ours and
fast-plaid's operations read the residual bits as fast-plaid and ColBERTv2 write them (fast-plaid's
own tables, ``plaid_buckets``), the format lik_cupy.plaid documents; LIK reads each byte from its low
bits (``lik_buckets``) and scales the queries to unit length too, so its reference is its reading of
the same bytes, with its queries so scaled: each error is the contender's own arithmetic. A contender
past ``err_bound`` (twice the sum over the unit query tokens of the float16 rounding of a tile's
values, 2^-11 each) is listed in ``wrong`` and is no best peer; ours then gets no ratio.

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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
from bench.lib import baselines  # noqa: E402
from bench.lib.gpu import safe_cleanup, start  # noqa: E402
from bench.lib.reference import exact_scores  # noqa: E402
from bench.lib.results import counts, fastest, out_dir, short_err, write_json  # noqa: E402
from bench.lib.timing import time_device, time_e2e  # noqa: E402

DIM, LQ, K, N_CENT, MAX_LEN = 128, 32, 4096, 32768, 180
TARGET = 1 / 1.3
ERR_BOUND = 2 * 2.0**-11 * LQ  # twice the sum over the (unit) query tokens of |q_s| 2^-11


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
    dev = lens.device
    rows = torch.repeat_interleave(c["off"][ids], lens) + (
        torch.arange(int(lens.sum()), device=dev) - torch.repeat_interleave(lens.cumsum(0) - lens, lens))
    cu = torch.zeros(ids.numel() + 1, dtype=torch.int32, device=dev)
    cu[1:] = lens.cumsum(0)
    return c["codes"][rows], c["bits"][rows], cu, int(lens.max())


def fastplaid_tables(torch, nbits, device="cuda"):
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
    return (torch.tensor(rev, dtype=torch.uint8, device=device),
            torch.tensor(look, dtype=torch.int64, device=device))


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
    pad = torch.zeros(ids.numel(), lmax, DIM, dtype=emb.dtype, device=emb.device)  # direct_pad_sequences
    mask = torch.arange(lmax, device=emb.device)[None, :] < lens[:, None]
    pad[mask] = emb
    scores = pad @ q.T.unsqueeze(0)  # [K, Ld, Lq]
    scores = scores.masked_fill(~mask[..., None], -9999.0)  # colbert_score_reduce
    return scores.max(dim=1).values.sum(dim=-1, dtype=torch.float32)


def plaid_buckets(tables):
    """The reader of residual bytes [n, d * nbits / 8] -> bucket ids [n, d] as fast-plaid and ColBERTv2
    write them (each byte from its most significant bit), by fast-plaid's own ``tables``."""
    rev, look = tables

    def read(bits):
        return look.index_select(0, rev.index_select(0, bits.flatten().int()).int()).view(bits.shape[0], -1)

    return read


def lik_buckets(torch, nbits):
    """The reader of residual bytes as LIK 0.4.5 reads them: dim f's ``nbits`` bits from byte
    f // (8 / nbits), the lowest bits first."""
    per = 8 // nbits

    def read(bits):
        f = torch.arange(DIM, device=bits.device)
        return (bits[:, f // per].long() >> ((f % per) * nbits)) & ((1 << nbits) - 1)

    return read


def exact_docs(torch, c, ids, buckets):
    """float64 embeddings of documents ``ids`` of corpus ``c``, each token centroid + bucket weights
    (``buckets``: the reader of its residual bytes) scaled to unit length, padded: ([K, Lmax, d], valid
    [K, Lmax])."""
    codes, bits, _, lmax = gathered(torch, c, ids)
    e = c["cen"].double()[codes.long()] + c["w"].double()[buckets(bits)]
    e = e / e.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    valid = torch.arange(lmax, device=e.device)[None, :] < c["lens"][ids][:, None]
    docs = torch.zeros(ids.numel(), lmax, DIM, dtype=torch.float64, device=e.device)
    docs[valid] = e
    return docs, valid


def reference(torch, c, q, ids, buckets, unit_queries=False):
    """float64 scores [Nq, K] of queries q [Nq, Lq, d] against their candidates ids [Nq, K], read by
    ``buckets`` (``exact_docs``); ``unit_queries``: each query token scaled to unit length first (LIK)."""
    out = []
    for i in range(q.shape[0]):
        qi = q[i].double()
        if unit_queries:
            qi = qi / qi.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        docs, valid = exact_docs(torch, c, ids[i], buckets)
        out.append(exact_scores(torch, qi[None], docs, d_mask=valid)[0])
    return torch.stack(out)


def scores_of(torch, out):
    """A contender's result as float64 [Nq, K]: ours as it is, the per-query calls' results stacked."""
    return (torch.stack([x.reshape(-1) for x in out]) if isinstance(out, list) else out).double()


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
    for cell in res["cells"]:  # (a case whose ours or every peer is wrong has no cell)
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
    readings = {"plaid": lambda: reference(torch, c, q, ids, plaid_buckets(tables)),
                "lik": lambda: reference(torch, c, q, ids, lik_buckets(torch, nbits), unit_queries=True)}
    reads = {"ours": "plaid", "ours_checked": "plaid", "fastplaid_ops": "plaid", "lik": "lik", "lik_gather": "lik"}
    refs = {}  # reading -> float64 [nq, K], made once per case
    row["max_abs_err_vs_float64"], row["err_bound"] = {}, ERR_BOUND
    if lik_plaid is not None:
        packs = [gathered(torch, c, ids[i]) for i in range(nq)]
        # One max_seqlen_d for every call: LIK autotunes and compiles per value (a constexpr).
        impls["lik"] = lambda: [lik_plaid.maxsim_residual_varlen(
            q[i], p[0], p[1], p[2], c["cen"], c["w"], nbits, max_seqlen_d=MAX_LEN) for i, p in enumerate(packs)]
        impls["lik_gather"] = lambda: [lik_plaid.maxsim_residual_varlen(
            q[i], *gathered(torch, c, ids[i])[:3], c["cen"], c["w"], nbits, max_seqlen_d=MAX_LEN) for i in range(nq)]
    impls["fastplaid_ops"] = lambda: [fastplaid_exact(torch, c, q[i], ids[i], tables) for i in range(nq)]
    errs = row["max_abs_err_vs_float64"]
    for name, fn in impls.items():
        try:
            out = scores_of(torch, fn())
            try:
                if reads[name] not in refs:
                    refs[reads[name]] = readings[reads[name]]()
                errs[name] = float((out - refs[reads[name]]).abs().max())
            except Exception as e:  # noqa: BLE001  (not compared: timed, and wrong)
                errs[name] = float("nan")
                row.setdefault("check_errors", {})[name] = short_err(e)
            del out
            torch.cuda.synchronize()
            row["impls"][name] = timed(ctx, fn, args.reps)
        except Exception as e:  # noqa: BLE001
            row["impls"][name] = {"error": short_err(e)}
            safe_cleanup(torch)
    row["wrong"] = sorted(k for k, v in row["impls"].items() if "ms" in v and not counts(v["ms"], errs[k], ERR_BOUND))
    peers = {k: v["ms"] for k, v in row["impls"].items() if k not in ("ours", "ours_checked") and "ms" in v}
    best = fastest(peers, errs, ERR_BOUND)
    ours_ms = row["impls"]["ours"].get("ms")
    if best and ours_ms and "ours" not in row["wrong"]:
        res["cells"].append({"case": case, "ours_ms": ours_ms, "best_peer": best[0], "best_peer_ms": best[1],
                             "ratio": ours_ms / best[1]})
        if "lik" in peers and "lik" not in row["wrong"]:
            res["targets"].append({"case": case, "ours_over_lik": ours_ms / peers["lik"], "target": TARGET,
                                   "met": ours_ms / peers["lik"] <= TARGET})
    res["rows"].append(row)
    print(case, {k: round(v.get("ms", float("nan")), 4) for k, v in row["impls"].items()},
          "err vs float64 " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()) + f" (bound {ERR_BOUND:.2e})"
          + (f"; wrong: {', '.join(row['wrong'])}" if row["wrong"] else ""), flush=True)
    if args.sweep:
        res["sweep"] += sweep(ctx, dispatch, impls["ours"], case, args.reps, refs.get("plaid"))


def sweep(ctx, dispatch, fn, case, reps, ref=None):
    """``fn`` timed with each row of tables.RESIDUAL_TILES first in turn (the rows that fit), each tile's
    scores first checked against ``ref`` (float64 [Nq, K]; None: not checked)."""
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
                    err = None if ref is None else float((scores_of(ctx.torch, fn()) - ref).abs().max())
                    rows.append({"case": case, "tile": list(tile), "max_abs_err_vs_float64": err,
                                 "wrong": err is not None and not err <= ERR_BOUND, **timed(ctx, fn, reps)})
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
