#!/usr/bin/env python3
"""Corpus-scoring benchmark (issue 3): many queries against a document corpus.

Four cells, all d=128, fp16, every implementation timed side by side in one
process on one GPU and on the same inputs (L2-normalized random tokens):

  multiquery  32 queries (Lq=32) x 1,024 docs (Ld=180) -> scores [32, 1024]
              ours         lik_cupy.maxsim(Q[32,32,128], D[1024,180,128])  (torch in/out)
              ours_cupy    the same with CuPy arrays (zero-copy DLPack views)
              flash_batched  flash_maxsim.flash_maxsim_batched(Q[Nq,Lq,d], D[B,Ld,d]) -> [Nq, B]  (0.3.0)
              lik          late_interaction_kernels.maxsim(Q[Nq,Lq,d], D[Nd,Ld,d]) -> [Nq, Nd]  (0.4.5)
              torch_naive  one cuBLAS fp16 matmul [B*Ld, d] x [d, Nq*Lq] + amax + fp32 sum (context)
              target: ours >= 3x faster than the best of flash_batched / lik.

  topk        top-100 of 100,000 docs (Ld=180) for 32 queries (Lq=32), corpus on the GPU
              ours              lik_cupy.retrieve(Q, D, 100) -> (scores [Nq,k] f32, indices [Nq,k] i64)
              ours_maxsim_topk  lik_cupy.maxsim + torch.topk (context: what the fused path saves)
              flash_batched_topk  flash_maxsim_batched + torch.topk
              lik_retrieve      late_interaction_kernels.retrieve(Q, D, top_k=100, normalize=False)
              also: FLOP floor at the measured cuBLAS rate (target ours/floor <= 1.5), top-k
              overlap with the baseline and with the exact float64 top-k, and how far the
              returned set falls short of the exact k-th score (near-ties make exact overlap < 1).

  ragged      1,000 docs, lengths uniform in [16, 512] (seeded), Lq=32, Nq=1 and Nq=32
              ours_varlen       lik_cupy.maxsim_varlen(Q[Nq,Lq,d], D_tokens[T,d], d_offsets[Nd+1] int32)
              ours_varlen_nocheck  the same with validate_offsets=False (skips the device check of the
                                offsets and its host sync; an error row if the keyword is not there)
              ours_padded_mask  lik_cupy.maxsim(Q, D_pad[1000,512,d], d_mask=bool[1000,512])
              ours_padded_len   lik_cupy.maxsim(Q, D_pad, d_lengths=int32[1000])
              flash_packed      flash_maxsim.flash_maxsim(Q[Lq,d], D_tokens, doc_lengths=cu_seqlens)
                                (public packed path, one query per call: Nq calls for Nq=32)
              flash_packed_1launch  flash-maxsim's packed Triton kernel launched once with Q [Nq,Lq,d]
                                (what flash_maxsim_packed does internally, Nq=32 only)
              flash_padded_len  flash_maxsim_batched(Q, D_pad, doc_lengths=lengths)
              lik_varlen        late_interaction_kernels.maxsim_varlen(Q_packed[Nq*Lq,d], D_tokens,
                                cu_q, cu_d, max_seqlen_q, max_seqlen_d) -> [Nq, Nd]
              targets: ours_varlen at least as fast as flash-maxsim's packed path; >= 1.5x faster
              than ours on the padded layout (both d_mask and d_lengths).

  outofcore   32 queries (Lq=32) against a host-resident NumPy fp16 corpus [N, 180, 128]
              (default N=200,000 = 9.2 GB, --ooc-docs)
              ours_host  lik_cupy.retrieve(Q_device, D_host_numpy, 100, max_gpu_bytes=2 GiB)
                         (pageable: host threads stage each chunk into pinned buffers)
              ours_host_pinned  the same after lik_cupy.pin_host(D_host_numpy) (page-locked in
                         place once, time reported as pin_s; chunks upload without staging)
              ours_gpu   lik_cupy.retrieve(Q, D_gpu, 100) on the same corpus copied to the GPU (if it fits)
              reports wall time, docs/s, corpus GB/s as a fraction of the measured pinned H2D
              bandwidth (target >= 80% when transfer-bound, on the page-locked row; the pageable
              row is reported beside the host's own staging-copy rate), GPU peak memory during
              the call vs max_gpu_bytes, and top-k agreement with the exact float64 top-k.

Metrics per row: ``ms`` = median device time per call (CUDA events, a ~250 us
``torch.cuda._sleep`` pad before each call so host overhead is hidden;
bench/lib/timing.py: time_device), ``ms_e2e`` = back-to-back calls / count (host
overhead included); outofcore host rows: ``ms`` = median wall time (host clock,
synchronized). TFLOP/s with FLOPs = 2*Nq*Lq*sum(doc lengths)*d (top-k counts the
same); ``%ceil`` = fraction of the measured cuBLAS fp16 rate (c) or of the
device-to-device copy bandwidth (m), by arithmetic intensity, or of the pinned
H2D bandwidth (h); ``ours/bl`` = our ms / the best baseline's ms (< 1 = ours
faster); ``rel_err`` = max |out - ref| / |ref| vs a float64 reference (torch,
GPU, doc-chunked) from the same rounded inputs.

Peak memory (cells 1-3): CuPy allocates through torch's caching allocator
(bench/lib/gpu.py: setup_cupy), and peak_extra_bytes = torch.cuda.max_memory_allocated()
- memory_allocated() over one call (inputs resident, outputs included).
Outofcore: CuPy is switched back to its own default memory pool (what a user
gets), the pool's unused blocks are freed before the measured call, and the
peak is the largest of (a) the pool's high-water total_bytes() (the pool never
shrinks during a call, so its final size is its high-water mark; a sampler
thread also polls it), (b) device-wide used memory from cudaMemGetInfo sampled
every ~0.5 ms by a background thread, minus the value just before the call, and
(c) torch.cuda.max_memory_allocated() delta, over the first full call and a
second one (the larger; catches buffers cached across calls). These measured
calls are separate from the timed ones (sampling costs GIL time).

Writes ``corpus_<gpu-slug>.json`` (rewritten after every case) and
``corpus_<gpu-slug>.txt`` (the table) into ``--out``; prints the table last.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
from bench.lib.gpu import cupy_stream, safe_cleanup, setup_cupy, start, warm_up_ours  # noqa: E402
from bench.lib.results import counts, fastest, out_dir as default_out_dir, short_err, text_table, write_json  # noqa: E402
from bench.lib.timing import ceiling_fraction, run_ceilings, time_device, time_e2e  # noqa: E402
D_DIM = 128
ALL_CELLS = ["multiquery", "topk", "ragged", "outofcore"]
CELL_IMPLS = {
    "multiquery": ["ours", "ours_cupy", "flash_batched", "lik", "torch_naive"],
    "topk": ["ours", "ours_maxsim_topk", "flash_batched_topk", "lik_retrieve"],
    "ragged": ["ours_varlen", "ours_varlen_nocheck", "ours_padded_mask", "ours_padded_len", "flash_packed",
               "flash_packed_1launch", "flash_padded_len", "lik_varlen"],
    "outofcore": ["ours_host", "ours_host_pinned", "ours_gpu"],
}
# baselines entering "best baseline" per cell (ratios are computed for impls starting with "ours")
CELL_BASELINES = {
    "multiquery": ("flash_batched", "lik"),
    "topk": ("flash_batched_topk", "lik_retrieve"),
    "ragged": ("flash_packed", "flash_packed_1launch", "flash_padded_len", "lik_varlen"),
    "outofcore": (),
}
FULL = {
    "multiquery": dict(Nq=32, Lq=32, Nd=1024, Ld=180),
    "topk": dict(Nq=32, Lq=32, Nd=100_000, Ld=180, k=100),
    "ragged": dict(Nq_list=(1, 32), Lq=32, Nd=1000, Lmin=16, Lmax=512),
    "outofcore": dict(Nq=32, Lq=32, Nd=200_000, Ld=180, k=100, max_gpu_bytes=2 << 30),
}
QUICK = {
    "multiquery": dict(Nq=32, Lq=32, Nd=1024, Ld=180),
    "topk": dict(Nq=32, Lq=32, Nd=20_000, Ld=180, k=100),
    "ragged": dict(Nq_list=(1, 32), Lq=32, Nd=1000, Lmin=16, Lmax=512),
    "outofcore": dict(Nq=32, Lq=32, Nd=40_000, Ld=180, k=100, max_gpu_bytes=512 << 20),
}
H2D_BYTES = 1 << 30
HOST_IMPLS = ("ours_host", "ours_host_pinned")


# --------------------------------------------------------------------------- args


def record_failure(row, name, e):
    """Mark a row skipped (time budget) or failed, and print the tail of the traceback."""
    row.update(status="skipped" if isinstance(e, TimeoutError) else "error", error=short_err(e))
    if row["status"] == "error":
        print(f"    [{name}] " + row["error"] + "\n" + "\n".join(
            "      " + ln for ln in traceback.format_exc(limit=4).splitlines()[-6:]), flush=True)

def build_argparser():
    p = argparse.ArgumentParser(
        description="Corpus-scoring benchmark: lik_cupy vs flash-maxsim 0.3.0 vs LIK 0.4.5 "
                    "(multi-query scoring, top-k retrieval, ragged corpora, host-resident corpora).")
    p.add_argument("--cells", default=",".join(ALL_CELLS),
                   help=f"comma list of {','.join(ALL_CELLS)} (default all)")
    p.add_argument("--quick", action="store_true",
                   help="smaller sizes (topk 20k docs, outofcore 40k docs with a 512 MiB budget) and short timing")
    p.add_argument("--impls", default=None,
                   help="comma list: only these impls (names from any cell: "
                        + "; ".join(f"{c}: {','.join(v)}" for c, v in CELL_IMPLS.items()) + ")")
    p.add_argument("--out", default=None, help="output dir (default $OUT or bench/results)")
    p.add_argument("--budget-s", "--time-budget", dest="budget_s", type=float, default=None,
                   help="seconds; cells / measurements that would start after this are recorded as skipped")
    p.add_argument("--target-s", type=float, default=None,
                   help="seconds of timed reps per (case, impl) (default 0.5, --quick 0.15)")
    p.add_argument("--max-reps", type=int, default=200)
    p.add_argument("--min-reps", type=int, default=5)
    p.add_argument("--l2-factor", type=float, default=4.0,
                   help="rotate input sets until their total bytes >= this x L2 (default 4)")
    p.add_argument("--topk-docs", type=int, default=None, help="topk cell: corpus size (default 100000, --quick 20000)")
    p.add_argument("--ooc-docs", type=int, default=None,
                   help="outofcore cell: host corpus size N of [N,180,128] fp16 (default 200000 = 9.2 GB, "
                        "--quick 40000)")
    p.add_argument("--ooc-max-gpu-bytes", type=int, default=None,
                   help="outofcore cell: max_gpu_bytes passed to retrieve (default 2 GiB, --quick 512 MiB)")
    p.add_argument("--ooc-reps", type=int, default=3, help="outofcore cell: timed calls (default 3)")
    p.add_argument("--ooc-q", default="auto", choices=("auto", "cupy", "torch", "numpy"),
                   help="outofcore cell: framework of Q when D is a NumPy array (auto: first of torch, cupy, "
                        "numpy that a small probe call accepts)")
    p.add_argument("--ooc-no-gpu-copy", action="store_true",
                   help="outofcore cell: skip the comparison with the corpus on the GPU")
    p.add_argument("--no-ceilings", action="store_true", help="skip the cuBLAS / HBM ceiling measurement")
    p.add_argument("--no-txt", action="store_true", help="do not write corpus_<gpu>.txt (the table is still printed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--table-from", default=None, metavar="JSON",
                   help="only print the table of an existing corpus_*.json (no GPU / torch needed) and exit")
    return p


# --------------------------------------------------------------------------- small helpers

def fmt_bytes(n):
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def rand_tokens(torch, shape, dtype, g):
    """L2-normalized random tokens on the GPU, generated in <= 256 MB fp32 chunks."""
    out = torch.empty(shape, dtype=dtype, device="cuda")
    d = shape[-1]
    flat = out.view(-1, d)
    step = max(1, (256 << 20) // (d * 4))
    for r0 in range(0, flat.shape[0], step):
        r1 = min(flat.shape[0], r0 + step)
        t = torch.randn(r1 - r0, d, device="cuda", generator=g)
        flat[r0:r1] = torch.nn.functional.normalize(t, dim=-1).to(dtype)
        del t
    return out


def reference_multi_f64(torch, Q3, D, d_valid=None, chunk_bytes=512 << 20):
    """float64 scores [Nq, B] of Q3 [Nq, Lq, d] against D [B, Ld, d] (d_valid: bool [B, Ld] or None)."""
    Nq, Lq, d = Q3.shape
    B, Ld, _ = D.shape
    Qt = Q3.reshape(Nq * Lq, d).double().T.contiguous()
    per_doc = Ld * (Nq * Lq + d) * 8
    chunk = max(1, min(B, chunk_bytes // max(1, per_doc)))
    out = torch.empty(Nq, B, dtype=torch.float64, device="cuda")
    for b0 in range(0, B, chunk):
        b1 = min(B, b0 + chunk)
        Dc = D[b0:b1]
        if Dc.device.type != "cuda":
            Dc = Dc.to("cuda", non_blocking=False)
        S = torch.matmul(Dc.double().reshape(-1, d), Qt).view(b1 - b0, Ld, Nq, Lq)
        if d_valid is not None:
            S.masked_fill_(~d_valid[b0:b1].view(b1 - b0, Ld, 1, 1), float("-inf"))
        out[:, b0:b1] = S.amax(dim=1).sum(dim=-1).T
        del S, Dc
    return out


def rescore_f64(torch, Q3, docs):
    """float64 scores [Nq, k] of Q3 [Nq, Lq, d] against per-query docs [Nq, k, Ld, d] (any device)."""
    Nq = Q3.shape[0]
    out = []
    for q in range(Nq):
        Dq = docs[q].to("cuda").double()                      # [k, Ld, d]
        S = torch.matmul(Dq, Q3[q].double().T)                 # [k, Ld, Lq]
        out.append(S.amax(dim=1).sum(dim=-1))
    return torch.stack(out)


def to_torch_any(torch, x):
    """torch / CuPy / NumPy array -> torch tensor on the GPU."""
    if torch.is_tensor(x):
        t = x
    elif type(x).__module__.startswith("cupy"):
        t = torch.from_dlpack(x)
    else:
        import numpy as np
        t = torch.from_numpy(np.ascontiguousarray(x))
    return t.to("cuda") if t.device.type != "cuda" else t


def scores_err(torch, out, ref):
    """max rel / abs error of a score array vs a float64 reference (same number of elements)."""
    o = to_torch_any(torch, out).reshape(-1).double()
    r = ref.reshape(-1)
    if o.numel() != r.numel():
        raise RuntimeError(f"output has {o.numel()} elements, expected {r.numel()}")
    if not torch.isfinite(o).all().item():
        return {"max_rel_err": float("nan"), "max_abs_err": float("nan")}
    a = (o - r).abs()
    return {"max_rel_err": (a / r.abs().clamp_min(1e-12)).max().item(), "max_abs_err": a.max().item()}


def overlap(torch, a, b):
    """mean / min over queries of |a_q & b_q| / k for index arrays [Nq, k]."""
    a = a.long()
    b = b.long().to(a.device)
    k = a.shape[-1]
    hit = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).double().sum(-1) / k
    return hit.mean().item(), hit.min().item()


def topk_check(torch, out, k, Nq, Nd, ref=None, Q3=None, doc_fetch=None):
    """Check a (scores, indices) result. ref: full float64 scores [Nq, Nd] (exact top-k available);
    else doc_fetch(indices[Nq,k] long cpu) -> docs [Nq, k, Ld, d] for a float64 re-score."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise RuntimeError(f"expected (scores, indices), got {type(out).__name__}")
    s = to_torch_any(torch, out[0])
    i = to_torch_any(torch, out[1])
    res = {"out_dtypes": f"{str(s.dtype).replace('torch.', '')},{str(i.dtype).replace('torch.', '')}",
           "out_shape": list(s.shape)}
    if tuple(s.shape) != (Nq, k) or tuple(i.shape) != (Nq, k):
        raise RuntimeError(f"expected [{Nq}, {k}] scores and indices, got {list(s.shape)} / {list(i.shape)}")
    il = i.long()
    valid = bool(((il >= 0) & (il < Nd)).all().item())
    uniq = all(torch.unique(il[q]).numel() == k for q in range(Nq)) if valid else False
    res["indices_valid"] = valid and uniq
    if not valid:
        raise RuntimeError("indices out of range")
    sd = s.double()
    res["sorted_desc"] = bool((sd[:, :-1] >= sd[:, 1:]).all().item())
    if ref is not None:
        got = ref.gather(1, il)
        ex_vals, ex_idx = torch.topk(ref, k, dim=-1)
        o_mean, o_min = overlap(torch, il, ex_idx)
        res["overlap_exact"] = o_mean
        res["overlap_exact_min"] = o_min
        kth = ex_vals[:, -1]
        short = ((kth - got.min(dim=1).values).clamp_min(0) / kth.abs().clamp_min(1e-12)).max().item()
        res["kth_shortfall_rel"] = short   # how far below the exact k-th score the worst returned doc is
    else:
        got = rescore_f64(torch, Q3, doc_fetch(il.cpu()))
    a = (sd - got).abs()
    res["max_rel_err"] = (a / got.abs().clamp_min(1e-12)).max().item() if torch.isfinite(sd).all().item() \
        else float("nan")
    res["max_abs_err"] = a.max().item()
    res["_indices"] = il  # kept in memory for cross-impl overlap, dropped before JSON
    return res


# --------------------------------------------------------------------------- one measurement

def measure(ctx, row, prep, call, check, sets, ceilings, note=None):
    """Time one impl on `sets` (device ms + e2e ms), measure peak extra memory and run `check`
    on the output of set 0. Never raises: failures become status="error"."""
    torch = ctx.torch
    args = ctx.args
    if ctx.over_budget():
        row.update(status="skipped", error="skipped: --budget-s exhausted")
        return row
    t_start = time.time()
    try:
        csets = prep(sets)
        n = len(csets)
        with torch.no_grad():
            for j in range(max(2, min(3, n))):   # JIT / autotune / NVRTC, >= 2 calls
                call(csets[j % n])
            torch.cuda.synchronize()
            ms_e2e = time_e2e(ctx, call, csets, max(args.min_reps, 30))
            # The sleep before each timed call must outlast the call's host time, or a call that
            # waits inside (our checked calls wait for their value checks) is charged for host
            # work done before its kernel was even queued.
            pad = ctx.pad_cycles
            if pad and getattr(ctx, "cycles_per_ms", None):
                ctx.pad_cycles = max(pad, int(2 * ms_e2e * ctx.cycles_per_ms))
            try:
                t = time_device(ctx, call, csets, min(3, n))
                est = max(statistics.median(t), 1e-3)
                reps = int(max(args.min_reps, min(args.max_reps, (args.target_s * 1e3) / est)))
                times = time_device(ctx, call, csets, reps)
            finally:
                ctx.pad_cycles = pad
            ms = statistics.median(times)
            gc.collect()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = call(csets[0])
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            try:
                row.update(check(out))
            except Exception as e:  # noqa: BLE001  (keep the timing; the table shows the check failure)
                row["check_error"] = short_err(e)
                print(f"    [{row['impl']}] output check failed: {row['check_error']}", flush=True)
            del out
        tflops = row["flops"] / (ms * 1e-3) / 1e12
        gbs = row["bytes"] / (ms * 1e-3) / 1e9
        frac = ceiling_fraction(row["bound"], tflops, gbs, ceilings)
        row.update(status="ok", ms=ms, ms_min=min(times), ms_e2e=ms_e2e, reps=reps, tflops=tflops, gbs=gbs,
                   frac_of_ceiling=frac, peak_extra_bytes=int(peak))
        if row.get("check_error"):
            row["note"] = f"CHECK FAILED: {row['check_error'][:70]}"
        elif note:
            row["note"] = note
    except Exception as e:  # noqa: BLE001
        row.update(status="error", error=short_err(e))
        tb = traceback.format_exc(limit=4)
        print(f"    [{row['impl']}] {row['error']}\n" + "\n".join("      " + ln for ln in tb.splitlines()[-6:]),
              flush=True)
    finally:
        row["wall_s"] = time.time() - t_start
        safe_cleanup(torch)
    return row


def print_row(r):
    if r.get("status") == "ok":
        extra = f"  {r['note']}" if r.get("note") else ""
        print(f"   {r['impl']:20s} {r['ms']:9.4f} ms (e2e {r.get('ms_e2e', float('nan')):.4f})  "
              f"{r['tflops']:7.1f} TF/s  peak {r.get('peak_extra_bytes', 0) / 2**20:8.1f} MiB  "
              f"rel_err {r.get('max_rel_err', float('nan')):.2e}  [{r.get('reps', '?')} reps, "
              f"{r.get('wall_s', 0):.1f}s]{extra}", flush=True)
    else:
        print(f"   {r['impl']:20s} {r['status'].upper()}: {r.get('error')}", flush=True)


def bound_of(flops, nbytes, ceilings):
    ridge = ceilings.get("ridge_flop_per_byte")
    ai = flops / max(1, nbytes)
    return ai, (("compute" if ai >= ridge else "memory") if ridge else "compute")


def n_sets_for(ctx, set_bytes, cap=64):
    torch = ctx.torch
    try:
        free, _ = torch.cuda.mem_get_info()
    except Exception:  # noqa: BLE001
        free = ctx.total_memory
    n = max(1, math.ceil(ctx.args.l2_factor * ctx.l2 / max(1, set_bytes)))
    return max(1, min(n, cap, int(0.25 * free // max(1, set_bytes))))


def row_error(r):
    """A timed row's error for ``results.counts``: NaN when its output check failed or its top-k indices
    repeat, else its ``max_rel_err`` (None: not measured)."""
    if r.get("check_error") or r.get("indices_valid") is False:
        return float("nan")
    return r.get("max_rel_err")


def finish_case(cell, case_rows):
    """ours/best-baseline ratios, against the fastest baseline that ran and scored right (none for a row of
    ours that scored wrong)."""
    ok = {r["impl"]: r for r in case_rows if r.get("status") == "ok"}
    best = fastest({k: r["ms"] for k, r in ok.items() if k in CELL_BASELINES[cell]},
                   {k: row_error(r) for k, r in ok.items()})
    for name, r in ok.items():
        if name.startswith("ours") and best and counts(r["ms"], row_error(r)):
            r["ratio_vs_best_baseline"] = r["ms"] / best[1]
            r["best_baseline_ms"] = best[1]


def strip_private(rows):
    for r in rows:
        for key in [k for k in r if k.startswith("_")]:
            del r[key]


def add_target(targets, cell, case, what, value, op, threshold, detail="", info=False):
    """A target line; info=True: reported, not a pass/fail goal."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        ok = None
    else:
        ok = value >= threshold if op == ">=" else value <= threshold
    targets.append(dict(cell=cell, case=case, what=what, value=value, op=op, threshold=threshold, ok=ok,
                        detail=detail, info=bool(info)))


def ok_row(rows, impl):
    return next((r for r in rows if r["impl"] == impl and r.get("status") == "ok"), None)


def lik_cupy_mod():
    import lik_cupy
    return lik_cupy


def cupy_sets(ctx, sets, keys):
    if ctx.cupy is None:
        raise RuntimeError(f"cupy unavailable: {ctx.cupy_err}")
    cp = ctx.cupy
    return [{k: (cp.from_dlpack(v) if k in keys else v) for k, v in s.items()} for s in sets]


# --------------------------------------------------------------------------- cell 1: multiquery

def cell_multiquery(ctx, C, ceilings, impl_names, rows, targets, save):
    torch = ctx.torch
    Nq, Lq, Nd, Ld, d = C["Nq"], C["Lq"], C["Nd"], C["Ld"], D_DIM
    case = f"{Nq}q x {Nd}d Ld{Ld}"
    set_bytes = (Nq * Lq + Nd * Ld) * d * 2
    n_sets = n_sets_for(ctx, set_bytes)
    flops = 2 * Nq * Lq * Nd * Ld * d
    nbytes = set_bytes + Nq * Nd * 4
    ai, bound = bound_of(flops, nbytes, ceilings)
    base = dict(cell="multiquery", case=case, Nq=Nq, Lq=Lq, Nd=Nd, Ld=Ld, d=d, dtype="float16", n_sets=n_sets,
                flops=flops, bytes=nbytes, arith_intensity=ai, bound=bound)
    print(f"\n== multiquery {case}  (n_sets={n_sets}, {set_bytes / 2**20:.1f} MiB/set, AI={ai:.0f} -> {bound}-bound)",
          flush=True)
    g = torch.Generator(device="cuda").manual_seed(ctx.args.seed + 101)
    sets = [{"Q": rand_tokens(torch, (Nq, Lq, d), torch.float16, g),
             "D": rand_tokens(torch, (Nd, Ld, d), torch.float16, g)} for _ in range(n_sets)]
    ref = reference_multi_f64(torch, sets[0]["Q"], sets[0]["D"])
    check = lambda out: scores_err(torch, out, ref)  # noqa: E731
    ident = lambda s: s  # noqa: E731

    def torch_naive(s):
        Q, D = s["Q"], s["D"]
        Qt = Q.reshape(-1, d).T
        cap = 2 << 30
        chunk = max(1, min(Nd, cap // max(1, Ld * Nq * Lq * 2)))
        out = torch.empty(Nq, Nd, dtype=torch.float32, device="cuda")
        for b0 in range(0, Nd, chunk):
            b1 = min(Nd, b0 + chunk)
            S = torch.matmul(D[b0:b1].reshape(-1, d), Qt).view(b1 - b0, Ld, Nq, Lq)
            out[:, b0:b1] = S.amax(dim=1).sum(dim=-1, dtype=torch.float32).T
        return out

    def ours_cupy(s):
        with cupy_stream(ctx):
            return lik_cupy_mod().maxsim(s["Q"], s["D"])

    impls = {
        "ours": (ident, lambda s: lik_cupy_mod().maxsim(s["Q"], s["D"])),
        "ours_cupy": (lambda ss: cupy_sets(ctx, ss, ("Q", "D")), ours_cupy),
        "flash_batched": (ident, lambda s: __import__("flash_maxsim").flash_maxsim_batched(s["Q"], s["D"])),
        "lik": (ident, lambda s: __import__("late_interaction_kernels").maxsim(s["Q"], s["D"])),
        "torch_naive": (ident, torch_naive),
    }
    case_rows = []
    for name in [n for n in CELL_IMPLS["multiquery"] if n in impl_names]:
        prep, call = impls[name]
        row = measure(ctx, dict(base, impl=name), prep, call, check, sets, ceilings)
        case_rows.append(row)
        print_row(row)
    finish_case("multiquery", case_rows)
    rows.extend(case_rows)
    o = ok_row(case_rows, "ours")
    if o is not None or any(r["impl"] == "ours" for r in case_rows):
        bl = o.get("best_baseline_ms") if o else None
        add_target(targets, "multiquery", case, "ours >= 3x faster than the best baseline (best_bl_ms / ours_ms)",
                   (bl / o["ms"]) if (o and bl) else None, ">=", 3.0,
                   f"ours {o['ms']:.4f} ms, best baseline {bl:.4f} ms" if (o and bl) else "missing rows")
    del sets                 # (ref goes with the closures when the function returns)
    safe_cleanup(torch)
    save()


# --------------------------------------------------------------------------- cell 2: topk

def cell_topk(ctx, C, ceilings, impl_names, rows, targets, save):
    torch = ctx.torch
    Nq, Lq, Nd, Ld, k, d = C["Nq"], C["Lq"], C["Nd"], C["Ld"], C["k"], D_DIM
    case = f"top{k} {Nq}q x {Nd}d Ld{Ld}"
    set_bytes = (Nq * Lq + Nd * Ld) * d * 2
    flops = 2 * Nq * Lq * Nd * Ld * d
    nbytes = set_bytes + Nq * k * 12
    ai, bound = bound_of(flops, nbytes, ceilings)
    floor_ms = flops / (ceilings["cublas_fp16_tflops"] * 1e12) * 1e3 if ceilings.get("cublas_fp16_tflops") else None
    base = dict(cell="topk", case=case, Nq=Nq, Lq=Lq, Nd=Nd, Ld=Ld, d=d, k=k, dtype="float16", n_sets=1,
                flops=flops, bytes=nbytes, arith_intensity=ai, bound=bound, floor_ms=floor_ms)
    print(f"\n== topk {case}  ({set_bytes / 2**30:.2f} GiB corpus, AI={ai:.0f} -> {bound}-bound, "
          f"FLOP floor {'-' if floor_ms is None else f'{floor_ms:.4g}'} ms)", flush=True)
    g = torch.Generator(device="cuda").manual_seed(ctx.args.seed + 202)
    sets = [{"Q": rand_tokens(torch, (Nq, Lq, d), torch.float16, g),
             "D": rand_tokens(torch, (Nd, Ld, d), torch.float16, g)}]
    t0 = time.time()
    ref = reference_multi_f64(torch, sets[0]["Q"], sets[0]["D"])
    print(f"   float64 reference: {time.time() - t0:.1f}s", flush=True)
    check = lambda out: topk_check(torch, out, k, Nq, Nd, ref=ref)  # noqa: E731
    ident = lambda s: s  # noqa: E731

    def flash_topk(s):
        import flash_maxsim
        sc = flash_maxsim.flash_maxsim_batched(s["Q"], s["D"])
        return torch.topk(sc, k, dim=-1)

    def ours_maxsim_topk(s):
        sc = lik_cupy_mod().maxsim(s["Q"], s["D"])
        return torch.topk(sc, k, dim=-1)

    def lik_retrieve(s):
        import late_interaction_kernels as lik
        # chunk=4096 as LIK's docstring shows: unchunked, LIK 0.4.5 hits an illegal memory access
        # on this corpus (100k x 180 x 128 = 2.3e9 elements, past 32-bit offsets; H200, run of 2026-11-22).
        return lik.retrieve(s["Q"], s["D"], top_k=k, normalize=False, chunk=4096)

    impls = {
        "ours": (ident, lambda s: lik_cupy_mod().retrieve(s["Q"], s["D"], k)),
        "ours_maxsim_topk": (ident, ours_maxsim_topk),
        "flash_batched_topk": (ident, flash_topk),
        "lik_retrieve": (ident, lik_retrieve),
    }
    case_rows = []
    for name in [n for n in CELL_IMPLS["topk"] if n in impl_names]:
        prep, call = impls[name]
        row = measure(ctx, dict(base, impl=name), prep, call, check, sets, ceilings)
        if row.get("status") == "ok" and floor_ms:
            row["ratio_vs_floor"] = row["ms"] / floor_ms
        case_rows.append(row)
    finish_case("topk", case_rows)
    # cross-impl overlaps (vs the best baseline that ran, and vs flash specifically)
    idx = {r["impl"]: r.get("_indices") for r in case_rows if r.get("status") == "ok" and r.get("_indices") is not None}
    bl_ok = [r for r in case_rows if r["impl"] in CELL_BASELINES["topk"] and r["impl"] in idx]
    ref_bl = "flash_batched_topk" if "flash_batched_topk" in idx else (bl_ok[0]["impl"] if bl_ok else None)
    for r in case_rows:
        if r["impl"] in idx and ref_bl and r["impl"] != ref_bl:
            m, mn = overlap(torch, idx[r["impl"]], idx[ref_bl])
            r["overlap_vs"] = ref_bl
            r["overlap_baseline"] = m
            r["overlap_baseline_min"] = mn
        if r.get("status") == "ok":
            parts = []
            if "ratio_vs_floor" in r:
                parts.append(f"{r['ratio_vs_floor']:.2f}x floor")
            if "overlap_exact" in r:
                parts.append(f"ovl_exact {r['overlap_exact']:.3f}")
            if "overlap_baseline" in r:
                parts.append(f"ovl_bl {r['overlap_baseline']:.3f}")
            if "kth_shortfall_rel" in r:
                parts.append(f"kth_short {r['kth_shortfall_rel']:.1e}")
            if r.get("impl") == "ours" and r.get("out_dtypes") not in (None, "float32,int64"):
                parts.append(f"dtypes {r.get('out_dtypes')} (spec: float32,int64)")
            if r.get("check_error"):
                parts.append(f"CHECK FAILED: {r['check_error'][:70]}")
            r["note"] = " ".join(parts)
        print_row(r)
    strip_private(case_rows)
    rows.extend(case_rows)
    o = ok_row(case_rows, "ours")
    if any(r["impl"] == "ours" for r in case_rows):
        add_target(targets, "topk", case, "ours / FLOP floor at the measured cuBLAS rate",
                   o.get("ratio_vs_floor") if o else None, "<=", 1.5,
                   f"ours {o['ms']:.4g} ms, floor {floor_ms:.4g} ms" if (o and floor_ms) else "missing")
        add_target(targets, "topk", case, f"top-{k} index overlap with {ref_bl or 'baseline'}",
                   o.get("overlap_baseline") if o else None, ">=", 0.99,
                   (f"min over queries {o.get('overlap_baseline_min'):.3f}; vs exact float64 top-k "
                    f"{o.get('overlap_exact', float('nan')):.3f}, worst returned doc "
                    f"{o.get('kth_shortfall_rel', float('nan')):.1e} (rel) below the exact k-th score")
                   if (o and "overlap_baseline" in o) else "missing", info=True)
        bl = o.get("best_baseline_ms") if o else None
        add_target(targets, "topk", case, "ours >= 3x faster than the best baseline (best_bl_ms / ours_ms)",
                   (bl / o["ms"]) if (o and bl) else None, ">=", 3.0,
                   f"ours {o['ms']:.4g} ms, best baseline {bl:.4g} ms" if (o and bl) else "missing")
    del sets, idx
    safe_cleanup(torch)
    save()


# --------------------------------------------------------------------------- cell 3: ragged

def cell_ragged(ctx, C, ceilings, impl_names, rows, targets, save):
    import numpy as np
    torch = ctx.torch
    Lq, Nd, Lmin, Lmax, d = C["Lq"], C["Nd"], C["Lmin"], C["Lmax"], D_DIM
    rng = np.random.default_rng(ctx.args.seed + 303)
    lens_np = rng.integers(Lmin, Lmax + 1, size=Nd).astype(np.int32)
    T = int(lens_np.sum())
    max_len = int(lens_np.max())
    offs_np = np.zeros(Nd + 1, np.int64)
    offs_np[1:] = np.cumsum(lens_np)
    lens = torch.from_numpy(lens_np).cuda()
    offs = torch.from_numpy(offs_np.astype(np.int32)).cuda()
    mask = torch.arange(Lmax, device="cuda")[None, :] < lens[:, None]        # [Nd, Lmax] bool
    packed_bytes = T * d * 2
    n_sets = n_sets_for(ctx, packed_bytes + Nd * Lmax * d * 2, cap=16)
    n_sets = max(1, min(n_sets, math.ceil(ctx.args.l2_factor * ctx.l2 / packed_bytes)))
    print(f"\n== ragged: {Nd} docs, lengths {Lmin}..{Lmax} (mean {T / Nd:.0f}, max {max_len}, T={T}), "
          f"packed {packed_bytes / 2**20:.1f} MiB, padded [{Nd},{Lmax},{d}] {Nd * Lmax * d * 2 / 2**20:.1f} MiB, "
          f"n_sets={n_sets}", flush=True)
    Nq_max = max(C["Nq_list"])
    g = torch.Generator(device="cuda").manual_seed(ctx.args.seed + 304)
    data = []
    for _ in range(n_sets):
        Dt = rand_tokens(torch, (T, d), torch.float16, g)
        Dp = torch.zeros(Nd, Lmax, d, dtype=torch.float16, device="cuda")
        Dp[mask] = Dt                      # row-major order of the mask == packing order
        data.append({"Qall": rand_tokens(torch, (Nq_max, Lq, d), torch.float16, g), "Dt": Dt, "Dp": Dp})
    ref_all = reference_multi_f64(torch, data[0]["Qall"], data[0]["Dp"], d_valid=mask)   # [Nq_max, Nd]
    lk = None

    def LK():
        nonlocal lk
        if lk is None:
            lk = lik_cupy_mod()
        return lk

    def flash_packed(s):
        import flash_maxsim
        Q3 = s["Q"]
        if Q3.shape[0] == 1:
            return flash_maxsim.flash_maxsim(Q3[0], s["Dt"], doc_lengths=s["off"])
        return torch.stack([flash_maxsim.flash_maxsim(Q3[i], s["Dt"], doc_lengths=s["off"])
                            for i in range(Q3.shape[0])])

    def flash_packed_1launch(s):
        from flash_maxsim.flash_maxsim_varlen import _maxsim_packed_kernel, _round_to_bucket
        Q3, Dt, off = s["Q"], s["Dt"], s["off"]
        nq, lq, dd = Q3.shape
        if dd & (dd - 1):
            raise RuntimeError("d must be a power of two for the direct packed-kernel launch")
        B = off.numel() - 1
        sc = torch.empty(nq, B, device=Q3.device, dtype=torch.float32)
        _maxsim_packed_kernel[(nq * B,)](
            Q3, Dt, off, sc, nq, B, _round_to_bucket(lq), lq, dd, dd,
            Q3.stride(0), Q3.stride(1), Q3.stride(2), Dt.stride(0), Dt.stride(1), sc.stride(0), sc.stride(1))
        return sc

    def lik_varlen(s):
        import late_interaction_kernels as lik
        return lik.maxsim_varlen(s["Qp"], s["Dt"], s["cu_q"], s["off"],
                                 max_seqlen_q=s["Lq"], max_seqlen_d=max_len)

    ident = lambda s: s  # noqa: E731
    impls = {
        "ours_varlen": (ident, lambda s: LK().maxsim_varlen(s["Q"], s["Dt"], s["off"])),
        "ours_varlen_nocheck": (ident, lambda s: LK().maxsim_varlen(s["Q"], s["Dt"], s["off"],
                                                                   validate_offsets=False)),
        "ours_padded_mask": (ident, lambda s: LK().maxsim(s["Q"], s["Dp"], d_mask=s["mask"])),
        "ours_padded_len": (ident, lambda s: LK().maxsim(s["Q"], s["Dp"], d_lengths=s["lens"])),
        "flash_packed": (ident, flash_packed),
        "flash_packed_1launch": (ident, flash_packed_1launch),
        "flash_padded_len": (ident, lambda s: __import__("flash_maxsim").flash_maxsim_batched(
            s["Q"], s["Dp"], doc_lengths=s["lens"])),
        "lik_varlen": (ident, lik_varlen),
    }
    for Nq in C["Nq_list"]:
        if ctx.over_budget():
            rows.append(dict(cell="ragged", case=f"Nq{Nq}", impl="(case)", status="skipped",
                             error="skipped: --budget-s exhausted"))
            continue
        case = f"Nq{Nq} Lq{Lq} x {Nd} ragged"
        flops = 2 * Nq * Lq * T * d
        nbytes = Nq * Lq * d * 2 + packed_bytes + (Nd + 1) * 4 + Nq * Nd * 4
        ai, bound = bound_of(flops, nbytes, ceilings)
        print(f"\n== ragged {case}  (AI={ai:.0f} -> {bound}-bound)", flush=True)
        cu_q = torch.arange(0, (Nq + 1) * Lq, Lq, dtype=torch.int32, device="cuda")
        sets = []
        for s in data:
            Q3 = s["Qall"][:Nq].contiguous()
            sets.append({"Q": Q3, "Qp": Q3.view(Nq * Lq, d), "cu_q": cu_q, "Lq": Lq, "Dt": s["Dt"], "off": offs,
                         "Dp": s["Dp"], "mask": mask, "lens": lens})
        ref = ref_all[:Nq]
        check = lambda out, ref=ref: scores_err(torch, out, ref)  # noqa: E731
        base = dict(cell="ragged", case=case, Nq=Nq, Lq=Lq, Nd=Nd, Ld=f"{Lmin}..{Lmax}", total_tokens=T,
                    d=d, dtype="float16", n_sets=n_sets, flops=flops, bytes=nbytes, arith_intensity=ai, bound=bound)
        case_rows = []
        for name in [n for n in CELL_IMPLS["ragged"] if n in impl_names]:
            if name == "flash_packed_1launch" and Nq == 1:
                continue    # identical to flash_packed for one query
            prep, call = impls[name]
            row = measure(ctx, dict(base, impl=name), prep, call, check, sets, ceilings)
            case_rows.append(row)
            print_row(row)
        finish_case("ragged", case_rows)
        rows.extend(case_rows)
        fl = [r for r in case_rows if r["impl"] in ("flash_packed", "flash_packed_1launch") and r.get("status") == "ok"
              and counts(r["ms"], row_error(r))]
        fbest = min(fl, key=lambda r: r["ms"]) if fl else None
        for ours, info in (("ours_varlen", False), ("ours_varlen_nocheck", True)):
            if not any(r["impl"] == ours for r in case_rows):
                continue
            o = ok_row(case_rows, ours)
            add_target(targets, "ragged", case, f"{ours} at least as fast as flash-maxsim packed (flash_ms / ours_ms)",
                       (fbest["ms"] / o["ms"]) if (o and fbest) else None, ">=", 1.0,
                       f"ours {o['ms']:.4f} ms, {fbest['impl']} {fbest['ms']:.4f} ms" if (o and fbest) else "missing",
                       info=info)
            for pad in ("ours_padded_mask", "ours_padded_len"):
                p = ok_row(case_rows, pad)
                add_target(targets, "ragged", case, f"{ours} >= 1.5x faster than {pad} ({pad}_ms / varlen_ms)",
                           (p["ms"] / o["ms"]) if (o and p) else None, ">=", 1.5,
                           f"{pad} {p['ms']:.4f} ms" if p else "missing", info=info)
        del sets
        save()
    del data, ref_all
    safe_cleanup(torch)
    save()


# --------------------------------------------------------------------------- cell 4: outofcore

def measure_h2d(ctx, nbytes=None):
    """Pinned and pageable host-to-device copy bandwidth (GB/s, 1e9) of an nbytes (default 1 GiB) buffer."""
    import numpy as np
    torch = ctx.torch
    nbytes = nbytes or H2D_BYTES
    out = {"h2d_bytes": nbytes}
    cp = ctx.cupy
    try:
        if cp is not None:
            mem = cp.cuda.alloc_pinned_memory(nbytes)
            h = np.frombuffer(mem, np.uint8, nbytes)
            h[:] = 1
            dev = cp.empty(nbytes, dtype=cp.uint8)
            st = cp.cuda.Stream(non_blocking=True)
            for _ in range(2):
                dev.set(h, stream=st)
            st.synchronize()
            ts = []
            for _ in range(8):
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                e0.record(st)
                dev.set(h, stream=st)
                e1.record(st)
                e1.synchronize()
                ts.append(cp.cuda.get_elapsed_time(e0, e1))
            out["h2d_method"] = "cupy.ndarray.set(pinned numpy view of cupy.cuda.alloc_pinned_memory, stream=...)"
            ms = statistics.median(ts)
            # The staging copy a pageable host corpus needs (retrieve's own threads and split), alone
            # and while a DMA out of pinned memory runs, as it does inside retrieve.
            from concurrent.futures import ThreadPoolExecutor

            from lik_cupy._streaming.gpu import COPY_THREADS, parallel_copy
            src_pg = np.ones(nbytes, np.uint8)
            mem2 = cp.cuda.alloc_pinned_memory(nbytes)
            dst_pin = np.frombuffer(mem2, np.uint8, nbytes)
            with ThreadPoolExecutor(COPY_THREADS) as tpool:
                parallel_copy(tpool, dst_pin, src_pg)
                t0 = time.perf_counter()
                parallel_copy(tpool, dst_pin, src_pg)
                out["host_copy_gbs"] = nbytes / (time.perf_counter() - t0) / 1e9
                for _ in range(4):
                    dev.set(h, stream=st)
                t0 = time.perf_counter()
                for _ in range(2):
                    parallel_copy(tpool, dst_pin, src_pg)
                out["host_copy_under_dma_gbs"] = 2 * nbytes / (time.perf_counter() - t0) / 1e9
                st.synchronize()
            out["host_copy_threads"] = COPY_THREADS
            del src_pg, dst_pin, mem2
            hp = np.ones(nbytes, np.uint8)
            tp = []
            for _ in range(3):
                cp.cuda.Device().synchronize()
                t0 = time.perf_counter()
                dev.set(hp)
                cp.cuda.Device().synchronize()
                tp.append((time.perf_counter() - t0) * 1e3)
            del hp, dev, h, mem, st
            cp.get_default_pinned_memory_pool().free_all_blocks()
        else:
            h = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
            dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            for _ in range(2):
                dev.copy_(h, non_blocking=True)
            torch.cuda.synchronize()
            ts = []
            for _ in range(8):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                dev.copy_(h, non_blocking=True)
                e1.record()
                e1.synchronize()
                ts.append(e0.elapsed_time(e1))
            out["h2d_method"] = "torch copy_ from pinned (cupy unavailable)"
            ms = statistics.median(ts)
            hp = torch.ones(nbytes, dtype=torch.uint8)
            tp = []
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                dev.copy_(hp)
                torch.cuda.synchronize()
                tp.append((time.perf_counter() - t0) * 1e3)
            del h, hp, dev
        out["h2d_pinned_ms"] = ms
        out["h2d_pinned_gbs"] = nbytes / (ms * 1e-3) / 1e9
        out["h2d_pageable_gbs"] = nbytes / (statistics.median(tp) * 1e-3) / 1e9
    except Exception as e:  # noqa: BLE001
        out["h2d_error"] = short_err(e)
    safe_cleanup(torch)
    return out


class MemSampler:
    """Background high-water sampler of device-wide used memory (cudaMemGetInfo) and the CuPy pool."""

    def __init__(self, ctx, pool, interval_s=0.0005):
        self.torch = ctx.torch
        self.cp = ctx.cupy
        self.pool = pool
        self.interval = interval_s
        self._stop = threading.Event()
        self._thread = None
        self.n = 0

    def _used(self):
        if self.cp is not None:
            free, total = self.cp.cuda.runtime.memGetInfo()
        else:
            free, total = self.torch.cuda.mem_get_info()
        return total - free

    def _sample(self):
        u = self._used()
        self.max_used = max(self.max_used, u)
        if self.pool is not None:
            self.max_pool = max(self.max_pool, self.pool.total_bytes())
            self.max_pool_used = max(self.max_pool_used, self.pool.used_bytes())
        self.n += 1

    def _run(self):
        while not self._stop.is_set():
            try:
                self._sample()
            except Exception:  # noqa: BLE001
                pass
            self._stop.wait(self.interval)

    def start(self):
        self.base_used = self._used()
        self.base_pool = self.pool.total_bytes() if self.pool is not None else 0
        self.base_pool_used = self.pool.used_bytes() if self.pool is not None else 0
        self.max_used, self.max_pool, self.max_pool_used = self.base_used, self.base_pool, self.base_pool_used
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self._thread.join()
        self._sample()
        return {"device_used_peak_extra_bytes": int(self.max_used - self.base_used),
                "pool_peak_extra_bytes": int(self.max_pool - self.base_pool),
                "pool_used_peak_extra_bytes": int(self.max_pool_used - self.base_pool_used),
                "mem_samples": self.n}


@contextlib.contextmanager
def cupy_default_pool(ctx):
    """Run CuPy (and lik_cupy) on CuPy's own default memory pool, then go back to the torch allocator."""
    cp = ctx.cupy
    if cp is None:
        yield None
        return
    pool = cp.get_default_memory_pool()
    cp.cuda.set_allocator(pool.malloc)
    try:
        yield pool
    finally:
        try:
            gc.collect()
            pool.free_all_blocks()
        except Exception:  # noqa: BLE001
            pass
        setup_cupy(ctx)


def sync_all(ctx):
    ctx.torch.cuda.synchronize()
    if ctx.cupy is not None:
        ctx.cupy.cuda.Device().synchronize()


def measured_call(ctx, pool, fn):
    """One call with the peak-memory measurement (see module doc). Returns (out, wall_s, mem dict)."""
    torch = ctx.torch
    gc.collect()
    sync_all(ctx)
    if pool is not None:
        pool.free_all_blocks()
    torch.cuda.empty_cache()
    base_t = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    sampler = MemSampler(ctx, pool).start()
    t0 = time.perf_counter()
    try:
        out = fn()
        sync_all(ctx)
    finally:
        wall = time.perf_counter() - t0
        mem = sampler.stop()
    mem["torch_peak_extra_bytes"] = int(torch.cuda.max_memory_allocated() - base_t)
    mem["peak_extra_bytes"] = max(mem["device_used_peak_extra_bytes"], mem["pool_peak_extra_bytes"],
                                  mem["torch_peak_extra_bytes"])
    return out, wall, mem


def make_host_corpus(ctx, N, Ld, d, seed):
    """NumPy fp16 [N, Ld, d], L2-normalized tokens generated on the GPU in chunks and copied down."""
    import numpy as np
    torch = ctx.torch
    host = np.empty((N, Ld, d), np.float16)
    ht = torch.from_numpy(host)
    g = torch.Generator(device="cuda").manual_seed(seed)
    chunk = max(1, (256 << 20) // (Ld * d * 4))
    for b0 in range(0, N, chunk):
        b1 = min(N, b0 + chunk)
        t = rand_tokens(torch, (b1 - b0, Ld, d), torch.float16, g)
        ht[b0:b1].copy_(t)
        del t
    torch.cuda.synchronize()
    return host


def cell_outofcore(ctx, C, ceilings, impl_names, rows, targets, save):
    torch = ctx.torch
    args = ctx.args
    Nq, Lq, N, Ld, k, d = C["Nq"], C["Lq"], C["Nd"], C["Ld"], C["k"], D_DIM
    budget = C["max_gpu_bytes"]
    corpus_bytes = N * Ld * d * 2
    case = f"top{k} {Nq}q x {N}d Ld{Ld} host"
    flops = 2 * Nq * Lq * N * Ld * d
    nbytes = corpus_bytes + Nq * Lq * d * 2 + Nq * k * 12
    print(f"\n== outofcore {case}: corpus {fmt_bytes(corpus_bytes)} on the host, max_gpu_bytes {fmt_bytes(budget)} "
          f"({corpus_bytes / budget:.1f}x)", flush=True)

    h2d = measure_h2d(ctx)
    ceilings.update(h2d)
    print("   H2D: " + ", ".join(f"{k_}={v:.4g}" if isinstance(v, float) else f"{k_}={v}" for k_, v in h2d.items()),
          flush=True)
    h2d_gbs = h2d.get("h2d_pinned_gbs")
    floor_transfer_ms = corpus_bytes / (h2d_gbs * 1e9) * 1e3 if h2d_gbs else None
    floor_compute_ms = flops / (ceilings["cublas_fp16_tflops"] * 1e12) * 1e3 if ceilings.get("cublas_fp16_tflops") \
        else None
    base = dict(cell="outofcore", case=case, Nq=Nq, Lq=Lq, Nd=N, Ld=Ld, d=d, k=k, dtype="float16", flops=flops,
                bytes=nbytes, corpus_bytes=corpus_bytes, max_gpu_bytes=budget,
                floor_transfer_ms=floor_transfer_ms, floor_compute_ms=floor_compute_ms)

    t0 = time.time()
    host = make_host_corpus(ctx, N, Ld, d, args.seed + 404)
    gen_s = time.time() - t0
    print(f"   host corpus generated in {gen_s:.1f}s", flush=True)
    g = torch.Generator(device="cuda").manual_seed(args.seed + 405)
    Qt = rand_tokens(torch, (Nq, Lq, d), torch.float16, g)
    lk = lik_cupy_mod()
    cp = ctx.cupy

    def q_as(kind):
        if kind == "torch":
            return Qt
        if kind == "cupy":
            if cp is None:
                raise RuntimeError(f"cupy unavailable: {ctx.cupy_err}")
            return cp.from_dlpack(Qt)
        return Qt.cpu().numpy()

    def stream_ctx(kind):
        return cupy_stream(ctx) if (kind == "cupy" and cp is not None) else contextlib.nullcontext()

    case_rows = []
    idx = {}  # impl -> top-k indices (CPU)
    with cupy_default_pool(ctx) as pool:
        # ---------------------------------------------------------------- ours_host, ours_host_pinned
        def time_host(impl, pin):
            """retrieve over the host corpus as it is (pageable: staged), or page-locked first by
            lik_cupy.pin_host (uploaded in place; the lock's own time reported as pin_s)."""
            row = dict(base, impl=impl, bound="h2d")
            t_start = time.time()
            locked = None
            try:
                if ctx.over_budget():
                    raise TimeoutError("skipped: --budget-s exhausted")
                kinds = ["torch", "cupy", "numpy"] if args.ooc_q == "auto" else [args.ooc_q]
                probe_errs = []
                kind = None
                for kd in kinds:
                    try:
                        with stream_ctx(kd):
                            lk.retrieve(q_as(kd), host[:256], 10, max_gpu_bytes=budget)
                        sync_all(ctx)
                        kind = kd
                        break
                    except Exception as e:  # noqa: BLE001
                        probe_errs.append(f"Q as {kd}: {short_err(e, 160)}")
                if kind is None:
                    raise RuntimeError("retrieve(Q, D_host_numpy) rejected every Q kind: " + " | ".join(probe_errs))
                row["q_kind"] = kind
                if pin:
                    t0 = time.perf_counter()
                    locked = lk.pin_host(host)
                    row["pin_s"] = time.perf_counter() - t0
                if probe_errs:
                    row["probe_errors"] = probe_errs
                Qk = q_as(kind)

                def call_host():
                    with stream_ctx(kind):
                        out = lk.retrieve(Qk, host, k, max_gpu_bytes=budget)
                    sync_all(ctx)
                    return out

                # first full call (compile, pinned buffers, anything cached across calls) and a second
                # one, both with the memory measurement; the peak reported is the larger of the two
                out, wall_first, mem1 = measured_call(ctx, pool, call_host)
                row["ms_first_call"] = wall_first * 1e3
                row["first_call_peak_extra_bytes"] = mem1["peak_extra_bytes"]
                del out
                out, wall_mem, mem = measured_call(ctx, pool, call_host)
                for key in ("device_used_peak_extra_bytes", "pool_peak_extra_bytes", "pool_used_peak_extra_bytes",
                            "torch_peak_extra_bytes", "peak_extra_bytes"):
                    mem[key] = max(mem[key], mem1[key])
                row.update(mem)
                row["ms_mem_call"] = wall_mem * 1e3
                walls = []
                for i in range(max(1, args.ooc_reps)):
                    if i >= 1 and ctx.over_budget():
                        break
                    del out
                    t0 = time.perf_counter()
                    out = call_host()
                    walls.append(time.perf_counter() - t0)
                ms = statistics.median(walls) * 1e3
                row.update(status="ok", ms=ms, ms_e2e=ms, ms_min=min(walls) * 1e3, reps=len(walls),
                           tflops=flops / (ms * 1e-3) / 1e12, gbs=corpus_bytes / (ms * 1e-3) / 1e9,
                           docs_per_s=N / (ms * 1e-3),
                           frac_of_ceiling=(corpus_bytes / (ms * 1e-3) / 1e9) / h2d_gbs if h2d_gbs else None,
                           peak_over_budget=row["peak_extra_bytes"] / budget)
                s_, i_ = out
                row["_out"] = (to_torch_any(torch, s_), to_torch_any(torch, i_))
                del out
            except Exception as e:  # noqa: BLE001
                record_failure(row, impl, e)
            finally:
                if locked is not None:
                    locked.release()
                row["wall_s"] = time.time() - t_start
                safe_cleanup(torch)
            case_rows.append(row)

        for impl, pin in (("ours_host", False), ("ours_host_pinned", True)):
            if impl in impl_names:
                time_host(impl, pin)

        # ---------------------------------------------------------------- corpus on the GPU (+ exact reference)
        D_gpu = None
        ref = None
        gpu_note = None
        if args.ooc_no_gpu_copy:
            gpu_note = "skipped: --ooc-no-gpu-copy"
        elif ctx.over_budget():
            gpu_note = "skipped: --budget-s exhausted"
        else:
            try:
                free, _ = torch.cuda.mem_get_info()
                if free < corpus_bytes + (3 << 30):
                    gpu_note = f"skipped: corpus {fmt_bytes(corpus_bytes)} does not fit ({fmt_bytes(free)} free)"
                else:
                    t0 = time.time()
                    D_gpu = torch.empty((N, Ld, d), dtype=torch.float16, device="cuda")
                    ht = torch.from_numpy(host)
                    step = max(1, (1 << 30) // (Ld * d * 2))
                    for b0 in range(0, N, step):
                        D_gpu[b0:b0 + step].copy_(ht[b0:b0 + step])
                    torch.cuda.synchronize()
                    up_s = time.time() - t0
                    t0 = time.time()
                    ref = reference_multi_f64(torch, Qt, D_gpu)
                    print(f"   corpus uploaded in {up_s:.1f}s (pageable), float64 reference {time.time() - t0:.1f}s",
                          flush=True)
            except Exception as e:  # noqa: BLE001
                gpu_note = f"error: {short_err(e)}"
                D_gpu = ref = None
                safe_cleanup(torch)

        # ---------------------------------------------------------------- ours_gpu
        if "ours_gpu" in impl_names:
            row = dict(base, impl="ours_gpu")
            ai, row["bound"] = bound_of(flops, nbytes, ceilings)
            row["arith_intensity"] = ai
            t_start = time.time()
            try:
                if D_gpu is None:
                    raise TimeoutError(gpu_note or "corpus not on the GPU")
                kind = next((r.get("q_kind") for r in case_rows if r.get("q_kind")), None)
                kind = kind if kind in ("torch", "cupy") else "torch"
                row["q_kind"] = kind
                Qg = Qt if kind == "torch" else cp.from_dlpack(Qt)
                Dg = D_gpu if kind == "torch" else cp.from_dlpack(D_gpu)

                def call_gpu(_s=None):
                    with stream_ctx(kind):
                        return lk.retrieve(Qg, Dg, k)

                with torch.no_grad():
                    for _ in range(2):
                        call_gpu()
                    sync_all(ctx)
                    out, wall_mem, mem = measured_call(ctx, pool, call_gpu)
                    row.update(mem)
                    row["ms_mem_call"] = wall_mem * 1e3
                    sets = [None]
                    t = time_device(ctx, call_gpu, sets, 2)
                    reps = int(max(args.min_reps, min(args.max_reps, (args.target_s * 1e3) / max(1e-3, max(t)))))
                    reps = min(reps, 20)
                    times = time_device(ctx, call_gpu, sets, reps)
                    ms = statistics.median(times)
                    ms_e2e = time_e2e(ctx, call_gpu, sets, max(3, min(reps, 10)))
                frac = None
                tflops = flops / (ms * 1e-3) / 1e12
                gbs = nbytes / (ms * 1e-3) / 1e9
                if row["bound"] == "compute" and ceilings.get("cublas_fp16_tflops"):
                    frac = tflops / ceilings["cublas_fp16_tflops"]
                elif row["bound"] == "memory" and ceilings.get("hbm_gbs"):
                    frac = gbs / ceilings["hbm_gbs"]
                row.update(status="ok", ms=ms, ms_min=min(times), ms_e2e=ms_e2e, reps=reps, tflops=tflops, gbs=gbs,
                           docs_per_s=N / (ms * 1e-3), frac_of_ceiling=frac)
                s_, i_ = out
                row["_out"] = (to_torch_any(torch, s_), to_torch_any(torch, i_))
                del out
            except Exception as e:  # noqa: BLE001
                record_failure(row, "ours_gpu", e)
            finally:
                row["wall_s"] = time.time() - t_start
                safe_cleanup(torch)
            case_rows.append(row)

        # ---------------------------------------------------------------- checks
        def fetch(il_cpu):
            return torch.from_numpy(host[il_cpu.numpy().reshape(-1)]).view(Nq, k, Ld, d)

        for r in case_rows:
            if r.get("status") != "ok" or "_out" not in r:
                continue
            try:
                res = topk_check(torch, r["_out"], k, Nq, N, ref=ref, Q3=Qt, doc_fetch=fetch)
                idx[r["impl"]] = res["_indices"]
                r.update({kk: v for kk, v in res.items() if not kk.startswith("_")})
            except Exception as e:  # noqa: BLE001
                r["check_error"] = short_err(e)
        for r in case_rows:
            if r["impl"] in HOST_IMPLS and r["impl"] in idx and "ours_gpu" in idx:
                r["overlap_vs"] = "ours_gpu"
                r["overlap_baseline"], r["overlap_baseline_min"] = overlap(torch, idx[r["impl"]], idx["ours_gpu"])
        rg = ok_row(case_rows, "ours_gpu")
        for r in case_rows:
            if r.get("status") != "ok":
                continue
            parts = [f"{r['docs_per_s']:.3g} docs/s"]
            if r["impl"] in HOST_IMPLS:
                parts.append(f"{r['gbs']:.1f} GB/s")
                if "pin_s" in r:
                    parts.append(f"pin_host {r['pin_s']:.2f}s")
                parts.append(f"peak {r['peak_extra_bytes'] / 2**20:.0f} MiB = {r['peak_over_budget']:.2f}x budget")
                if rg:
                    parts.append(f"{r['ms'] / rg['ms']:.1f}x gpu-resident")
                    r["ratio_vs_gpu_resident"] = r["ms"] / rg["ms"]
            if "overlap_exact" in r:
                parts.append(f"ovl_exact {r['overlap_exact']:.3f}")
            if "overlap_baseline" in r:
                parts.append(f"ovl_gpu {r['overlap_baseline']:.3f}")
            if r.get("check_error"):
                parts.append(f"check: {r['check_error'][:60]}")
            r["note"] = " ".join(parts)
        for r in case_rows:
            print_row(r)
        if gpu_note:
            for r in case_rows:
                r["gpu_resident_note"] = gpu_note
        del D_gpu, ref
    strip_private(case_rows)
    rows.extend(case_rows)
    t_floor = max([x for x in (floor_transfer_ms, floor_compute_ms, rg["ms"] if rg else None) if x] or [0])
    transfer_bound = bool(floor_transfer_ms and floor_transfer_ms >= t_floor)
    staging = h2d.get("host_copy_under_dma_gbs")
    for impl in HOST_IMPLS:
        if not any(r["impl"] == impl for r in case_rows):
            continue
        rh = ok_row(case_rows, impl)
        # A pageable corpus is staged by host threads first: the host's copy rate, not PCIe, is its
        # ceiling (reported, info only). Page-locked corpora go straight to the DMA engine.
        pageable = impl == "ours_host"
        detail = "missing"
        if rh and h2d_gbs:
            detail = (f"{rh['gbs']:.1f} GB/s vs H2D {h2d_gbs:.1f} GB/s; transfer floor {floor_transfer_ms:.1f} ms, "
                      f"compute floor {floor_compute_ms or float('nan'):.2f} ms"
                      + (f", gpu-resident {rg['ms']:.2f} ms" if rg else ""))
            if pageable and staging:
                detail += f"; host staging copy (16 threads, DMA running) {staging:.1f} GB/s"
            if "pin_s" in rh:
                detail += f"; pin_host took {rh['pin_s']:.2f} s once"
        add_target(targets, "outofcore", case,
                   f"{impl}: {'pageable' if pageable else 'page-locked'} host corpus throughput / pinned H2D bandwidth"
                   + (" (transfer-bound)" if transfer_bound else " (not transfer-bound)"),
                   rh.get("frac_of_ceiling") if rh else None, ">=", 0.8, info=pageable or not transfer_bound,
                   detail=detail)
        add_target(targets, "outofcore", case, f"{impl}: GPU peak memory during the call / max_gpu_bytes",
                   rh.get("peak_over_budget") if rh else None, "<=", 1.0,
                   (f"peak {fmt_bytes(rh['peak_extra_bytes'])} (pool {fmt_bytes(rh['pool_peak_extra_bytes'])}, "
                    f"device-wide sampled {fmt_bytes(rh['device_used_peak_extra_bytes'])}), budget {fmt_bytes(budget)}")
                   if rh else "missing")
        if rh and "overlap_baseline" in rh:
            add_target(targets, "outofcore", case, f"{impl}: top-k overlap host path vs gpu-resident path",
                       rh["overlap_baseline"], ">=", 1.0, f"min {rh['overlap_baseline_min']:.3f}", info=True)
    save()                   # the host corpus is freed when this returns (main runs gc + empty_cache)


# --------------------------------------------------------------------------- output

TABLE_HDR = ["cell", "case", "impl", "ms", "e2e_ms", "TF/s", "%ceil", "peakMB", "rel_err", "ours/bl", "note"]
BOUND_TAG = {"compute": "c", "memory": "m", "h2d": "h"}


def fmt_row(r):
    if r.get("status") != "ok":
        tag = "SKIP" if r.get("status") == "skipped" else "ERR"
        return [r.get("cell", ""), r.get("case", ""), r.get("impl", ""), tag, "", "", "", "", "", "",
                (r.get("error") or "")[:90]]
    frac = r.get("frac_of_ceiling")
    ratio = r.get("ratio_vs_best_baseline")
    rel = r.get("max_rel_err")
    peak = r.get("peak_extra_bytes")
    return [
        r["cell"], r["case"], r["impl"], f"{r['ms']:.4f}",
        (f"{r['ms_e2e']:.4f}" if isinstance(r.get("ms_e2e"), float) else "-"),
        f"{r['tflops']:.1f}",
        (f"{100 * frac:.0f}%{BOUND_TAG.get(r.get('bound'), '?')}" if isinstance(frac, float) else "-"),
        (f"{peak / 2**20:.1f}" if isinstance(peak, int) else "-"),
        (f"{rel:.1e}" if isinstance(rel, float) and math.isfinite(rel) else str(rel) if rel is not None else "-"),
        (f"{ratio:.2f}" if isinstance(ratio, float) else ""),
        r.get("note", ""),
    ]


def render_table(payload):
    meta = payload.get("meta", {})
    rows = payload.get("rows", [])
    targets = payload.get("targets", [])
    c = meta.get("ceilings", {})
    nan = float("nan")
    lines = [f"# {meta.get('gpu')}  cuBLAS fp16 {c.get('cublas_fp16_tflops', nan):.0f} TF/s, "
             f"HBM {c.get('hbm_gbs', nan):.0f} GB/s, H2D pinned {c.get('h2d_pinned_gbs', nan):.1f} GB/s "
             f"(pageable {c.get('h2d_pageable_gbs', nan):.1f})  (%ceil: c=cuBLAS, m=HBM, h=H2D; "
             f"ours/bl < 1 = ours faster; ms = device median, outofcore ours_host: wall median)"]
    lines += text_table(TABLE_HDR, [fmt_row(r) for r in rows], [(r.get("cell"), r.get("case")) for r in rows])
    if targets:
        lines.append("")
        lines.append("targets:")
        for t in targets:
            tag = "info" if t.get("info") else {True: "PASS", False: "FAIL", None: "n/a "}[t.get("ok")]
            v = t.get("value")
            vs = f"{v:.3g}" if isinstance(v, (int, float)) else "-"
            lines.append(f"  [{tag}] {t['cell']:10s} {t['case']}: {t['what']}: {vs} (want {t['op']} {t['threshold']})"
                         + (f"  -- {t['detail']}" if t.get("detail") else ""))
    return "\n".join(lines)


# --------------------------------------------------------------------------- main

CELL_FUNCS = {"multiquery": cell_multiquery, "topk": cell_topk, "ragged": cell_ragged, "outofcore": cell_outofcore}


def main(argv=None):
    args = build_argparser().parse_args(argv)
    if args.table_from:
        print(render_table(json.loads(Path(args.table_from).read_text())))
        return 0
    args.time_budget = args.budget_s            # bench.lib.gpu.Ctx.over_budget reads this
    if args.target_s is None:
        args.target_s = 0.15 if args.quick else 0.5
    cells = [c.strip() for c in args.cells.split(",") if c.strip()]
    bad = [c for c in cells if c not in ALL_CELLS]
    if bad:
        raise SystemExit(f"--cells: unknown {bad}; choose from {ALL_CELLS}")
    all_impls = sorted({n for v in CELL_IMPLS.values() for n in v})
    impl_names = set(all_impls) if not args.impls else {s.strip() for s in args.impls.split(",") if s.strip()}
    bad = sorted(impl_names - set(all_impls))
    if bad:
        raise SystemExit(f"--impls: unknown {bad}; choose from {all_impls}")
    sizes = {c: dict(v) for c, v in (QUICK if args.quick else FULL).items()}
    if args.topk_docs:
        sizes["topk"]["Nd"] = args.topk_docs
    if args.ooc_docs:
        sizes["outofcore"]["Nd"] = args.ooc_docs
    if args.ooc_max_gpu_bytes:
        sizes["outofcore"]["max_gpu_bytes"] = args.ooc_max_gpu_bytes
    out_dir = default_out_dir(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    # ---- heavy imports only here
    ctx, meta = start(args)  # CuPy through torch's allocator (cells 1-3), before anything allocates through CuPy
    torch, slug = ctx.torch, ctx.slug
    meta.update({
        "args": vars(args), "cells": cells, "sizes": sizes, "d": D_DIM,
        "timing": ("CUDA events; ms = median per-call device time with a ~250us torch.cuda._sleep pad before each "
                   "call (host overhead hidden); ms_e2e = back-to-back calls / count; inputs rotate over n_sets "
                   f"distinct sets with total bytes >= {args.l2_factor}x L2 (topk: one set, corpus >> L2). "
                   "outofcore ours_host: ms = median host wall time of synchronized calls (after two "
                   "memory-measured calls)"),
        "sleep_cycles_per_ms": ctx.cycles_per_ms,
        "memory": ("cells 1-3: peak_extra_bytes = torch.cuda.max_memory_allocated() - memory_allocated() over one "
                   "call (inputs resident, outputs included); CuPy allocates through torch's caching allocator. "
                   "outofcore: CuPy on its own default pool; peak_extra_bytes = max(pool high-water total_bytes() "
                   "delta [exact for CuPy/lik_cupy allocations], device-wide cudaMemGetInfo used-bytes high-water "
                   "delta sampled every ~0.5 ms by a thread, torch max_memory_allocated delta), max over the first and "
                   "second full call"
                   + ("" if ctx.cupy is not None else f" [cupy unavailable: {ctx.cupy_err}]")),
        "error": "max |out - ref| / |ref|, ref in float64 (torch, GPU, doc-chunked) from the same rounded inputs; "
                 "top-k rows: returned scores vs the float64 score of the returned doc; overlap_exact = mean over "
                 "queries of |returned & exact float64 top-k| / k; kth_shortfall_rel = max over queries of "
                 "(exact k-th score - worst returned doc's exact score) / |exact k-th score|",
        "flops": "2 * Nq * Lq * sum(doc lengths) * d (top-k: the same)",
        "bytes": "Q + D (useful tokens, read once) + outputs; padded impls read more",
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    })
    ceilings = run_ceilings(ctx, meta)

    json_path = out_dir / f"corpus_{slug}.json"
    txt_path = out_dir / f"corpus_{slug}.txt"
    rows, targets = [], []

    def payload():
        return {"meta": meta, "rows": rows, "targets": targets}

    def save():
        strip_private(rows)
        write_json(json_path, payload())

    if any(n.startswith("ours") for n in impl_names):
        warm_up_ours(meta, dims=(D_DIM,), dtypes=("float16",), query_lengths=(32,))

    for cell in cells:
        if ctx.over_budget():
            rows.append(dict(cell=cell, case="", impl="(cell)", status="skipped", error="skipped: --budget-s exhausted"))
            save()
            continue
        names = [n for n in CELL_IMPLS[cell] if n in impl_names]
        if not names:
            continue
        t0 = time.time()
        try:
            CELL_FUNCS[cell](ctx, sizes[cell], ceilings, set(names), rows, targets, save)
        except Exception as e:  # noqa: BLE001  (input / reference setup, OOM, ...)
            err = f"cell setup failed: {short_err(e)}"
            print(f"   {cell}: {err}\n" + "\n".join("      " + ln for ln in
                                                   traceback.format_exc(limit=5).splitlines()[-8:]), flush=True)
            rows.append(dict(cell=cell, case="", impl="(cell)", status="error", error=err))
        finally:
            meta.setdefault("cell_wall_s", {})[cell] = time.time() - t0
            safe_cleanup(torch)
            save()

    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    meta["wall_s"] = time.time() - ctx.t0
    save()
    table = render_table(payload())
    if not args.no_txt:
        txt_path.write_text(table + "\n")
    print(f"results: {json_path}")
    print()
    print(table, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
