#!/usr/bin/env python3
"""Forward MaxSim benchmark: lik_cupy vs naive CuPy / torch vs flash-maxsim / LIK.

One query [Lq, d] against B docs [B, Ld, d] -> scores [B]
(score[j] = sum_s max_t <Q[s], D[j, t]>), on one GPU, all implementations in
one process, same inputs.

Implementations (``--impls``):
  ours          lik_cupy.maxsim(Q, D) with torch tensors in / torch tensor out
  ours_cupy     lik_cupy.maxsim(Q, D) with CuPy arrays (zero-copy DLPack views)
  flash_maxsim  flash_maxsim.flash_maxsim(Q, D)                      (0.3.0)
  lik           late_interaction_kernels.maxsim(Q, D)                 (0.4.5)
  torch_naive   torch matmul in the input dtype + amax + fp32 sum, doc-chunked
  torch_tf32    same in fp32 with TF32 tensor-core matmuls (includes the upcast)
  cupy_naive    cupy.matmul in the input dtype + max + fp32 sum, doc-chunked

Timing (CUDA events): each timed call is preceded by a short
``torch.cuda._sleep`` spin kernel so the host runs ahead of the GPU, then
start/end events bracket the one call; ``ms`` is the median over reps
(= device time, host overhead hidden).  ``ms_e2e`` is back-to-back calls
between two events divided by the count (includes host/launch overhead when
the call is host-bound).  Calls rotate over enough distinct (Q, D) sets that
their total size is >= 4x the L2, so D comes from HBM.

Peak memory: CuPy is switched to a torch-backed allocator
(``cupy.cuda.set_allocator``), so everything CuPy (and lik_cupy through CuPy)
allocates is visible to ``torch.cuda.max_memory_allocated``; the reported
``peak_extra_bytes`` is max_memory_allocated - memory_allocated (inputs already
resident) for one call after ``reset_peak_memory_stats``, output included.

Error: max over docs of |out - ref| / |ref|, ref computed in float64 on the GPU
(doc-chunked) from the same rounded fp16/bf16 inputs.

Writes ``forward_<gpu-slug>.json`` (rewritten after every case, so a killed
run still leaves results), ``forward_<gpu-slug>.png`` and
``forward_<gpu-slug>.txt`` (the table) into ``--out``.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
from bench.lib.gpu import cupy_stream, safe_cleanup, start, warm_up_ours  # noqa: E402
from bench.lib.results import counts, fastest, out_dir as default_out_dir, short_err, text_table, write_json  # noqa: E402
from bench.lib.timing import ceiling_fraction, run_ceilings, time_device, time_e2e  # noqa: E402

# Must be set before anything imports jax (lik_cupy may import it lazily): JAX
# would otherwise grab 75% of the GPU memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# LIK warns once on un-normalized inputs (ours are normalized anyway).
os.environ.setdefault("LIK_SUPPRESS_NORM_WARN", "1")

ALL_IMPLS = ["ours", "ours_cupy", "flash_maxsim", "lik", "torch_naive", "torch_tf32", "cupy_naive"]
BASELINES_FOR_RATIO = ("flash_maxsim", "lik")
OURS_IMPLS = ("ours", "ours_cupy")

DEFAULT_SHAPES = "32x300,32x1024,128x1024,512x1024,1024x1024,colpali"
QUICK_SHAPES = "32x300,1024x1024"
SHAPE_ALIASES = {"colpali": "1024x1024@10000"}
DTYPE_ALIASES = {"fp16": "float16", "float16": "float16", "half": "float16",
                 "bf16": "bfloat16", "bfloat16": "bfloat16"}
SHORT_DTYPE = {"float16": "fp16", "bfloat16": "bf16"}


# --------------------------------------------------------------------------- args

def parse_shapes(spec: str, default_b: int):
    """'LqxLd[@B]' comma list (or alias 'colpali') -> list of dicts."""
    shapes = []
    for tok in spec.split(","):
        tok = tok.strip().lower()
        if not tok:
            continue
        name = tok
        tok = SHAPE_ALIASES.get(tok, tok)
        m = re.fullmatch(r"(\d+)x(\d+)(?:@(\d+))?", tok)
        if not m:
            raise SystemExit(f"--shapes: cannot parse {tok!r} (want LqxLd or LqxLd@B or 'colpali')")
        lq, ld = int(m.group(1)), int(m.group(2))
        b = int(m.group(3)) if m.group(3) else default_b
        label = f"{lq}x{ld}" + ("" if b == default_b else f"@B{b}")
        shapes.append({"label": label, "name": name, "Lq": lq, "Ld": ld, "B": b})
    return shapes


def parse_dtypes(spec: str):
    out = []
    for tok in spec.split(","):
        tok = tok.strip().lower()
        if not tok:
            continue
        if tok not in DTYPE_ALIASES:
            raise SystemExit(f"--dtypes: unknown dtype {tok!r} (fp16, bf16)")
        out.append(DTYPE_ALIASES[tok])
    return out


def build_argparser():
    p = argparse.ArgumentParser(
        description="Forward MaxSim benchmark: lik_cupy vs naive CuPy/torch vs flash-maxsim 0.3.0 vs LIK 0.4.5 "
                    "(one query vs B docs, one GPU).")
    p.add_argument("--quick", action="store_true",
                   help=f"small subset: shapes {QUICK_SHAPES}, fp16+bf16, short timing")
    p.add_argument("--shapes", default=None,
                   help=f"comma list of LqxLd[@B] or 'colpali' (=1024x1024@10000); default {DEFAULT_SHAPES}")
    p.add_argument("--dtypes", default=None, help="comma list of fp16,bf16 (default both)")
    p.add_argument("--impls", default=None, help=f"comma list subset of {','.join(ALL_IMPLS)}")
    p.add_argument("--B", type=int, default=1000, help="docs per query for shapes without @B (default 1000)")
    p.add_argument("--d", type=int, default=128, help="embedding dim (default 128)")
    p.add_argument("--out", default=None, help="output dir (default $OUT or bench/results)")
    p.add_argument("--target-s", type=float, default=None,
                   help="seconds of timed reps per (shape, dtype, impl) (default 0.5, --quick 0.15)")
    p.add_argument("--max-reps", type=int, default=200)
    p.add_argument("--min-reps", type=int, default=5)
    p.add_argument("--l2-factor", type=float, default=4.0,
                   help="rotate input sets until their total bytes >= this x L2 (default 4)")
    p.add_argument("--naive-chunk-mb", type=int, default=2048,
                   help="naive impls: max size of the materialized [b, Ld, Lq] similarity chunk in MB (default 2048)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds; measurements that would start after this are recorded as skipped")
    p.add_argument("--no-ceilings", action="store_true", help="skip the cuBLAS / HBM ceiling measurement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--table-from", default=None, metavar="JSON",
                   help="only print the table of an existing forward_*.json (no GPU / torch needed) and exit")
    return p


# --------------------------------------------------------------------------- data

def make_sets(ctx, Lq, Ld, B, d, dtype, n_sets, seed):
    """n_sets of (Q [Lq,d], D [B,Ld,d]) with L2-normalized random tokens."""
    torch = ctx.torch
    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(seed)
    sets = []
    chunk = max(1, (256 << 20) // max(1, Ld * d * 4))  # <=256 MB fp32 temporaries
    for _ in range(n_sets):
        q = torch.randn(Lq, d, device="cuda", generator=g)
        q = torch.nn.functional.normalize(q, dim=-1).to(tdt)
        D = torch.empty(B, Ld, d, device="cuda", dtype=tdt)
        for b0 in range(0, B, chunk):
            b1 = min(B, b0 + chunk)
            t = torch.randn(b1 - b0, Ld, d, device="cuda", generator=g)
            D[b0:b1] = torch.nn.functional.normalize(t, dim=-1).to(tdt)
            del t
        sets.append({"Q": q, "D": D})
    return sets


def reference_f64(ctx, Q, D):
    torch = ctx.torch
    B, Ld, d = D.shape
    Lq = Q.shape[0]
    Qd = Q.double()
    chunk = max(1, min(B, (512 << 20) // max(1, Ld * (Lq + d) * 8)))
    out = torch.empty(B, dtype=torch.float64, device="cuda")
    for b0 in range(0, B, chunk):
        b1 = min(B, b0 + chunk)
        S = torch.matmul(D[b0:b1].double().reshape(-1, d), Qd.T).view(b1 - b0, Ld, Lq)
        out[b0:b1] = S.amax(dim=1).sum(dim=-1)
        del S
    return out


# --------------------------------------------------------------------------- implementations

def set_tf32(torch, on):
    """Enable (True) / disable (False) TF32 fp32 matmuls, or restore a value returned earlier.
    Returns the previous setting."""
    m = torch.backends.cuda.matmul
    if hasattr(m, "fp32_precision"):  # torch >= 2.9 API
        prev = m.fp32_precision
        m.fp32_precision = on if isinstance(on, str) else ("tf32" if on else "ieee")
        return prev
    prev = m.allow_tf32
    m.allow_tf32 = bool(on)
    return prev


def build_impls(ctx, selected):
    """name -> (prepare(sets) -> call_sets, call(s) -> output, to_torch(out))."""
    torch = ctx.torch
    args = ctx.args
    cap = args.naive_chunk_mb << 20
    impls = {}
    ident = lambda o: o  # noqa: E731

    def torch_sets(sets):
        return sets

    def cupy_sets(sets):
        if ctx.cupy is None:
            raise RuntimeError(f"cupy unavailable: {ctx.cupy_err}")
        cp = ctx.cupy
        return [{"Q": cp.from_dlpack(s["Q"]), "D": cp.from_dlpack(s["D"])} for s in sets]

    def cupy_to_torch(o):
        return torch.from_dlpack(o)

    # --- ours
    lk_mod = {"m": None, "err": None}

    def get_lk():
        if lk_mod["m"] is None and lk_mod["err"] is None:
            try:
                import lik_cupy
                lk_mod["m"] = lik_cupy
            except Exception as e:  # noqa: BLE001
                lk_mod["err"] = short_err(e)
        if lk_mod["m"] is None:
            raise RuntimeError(f"import lik_cupy failed: {lk_mod['err']}")
        return lk_mod["m"]

    def ours_call(s):
        return get_lk().maxsim(s["Q"], s["D"])

    def ours_cupy_call(s):
        with cupy_stream(ctx):
            return get_lk().maxsim(s["Q"], s["D"])

    impls["ours"] = (lambda sets: (get_lk(), torch_sets(sets))[1], ours_call, ident)
    impls["ours_cupy"] = (lambda sets: (get_lk(), cupy_sets(sets))[1], ours_cupy_call, cupy_to_torch)

    # --- flash-maxsim 0.3.0
    def flash_call(s):
        import flash_maxsim
        return flash_maxsim.flash_maxsim(s["Q"], s["D"])

    def flash_prep(sets):
        import flash_maxsim  # noqa: F401
        return sets

    impls["flash_maxsim"] = (flash_prep, flash_call, ident)

    # --- late-interaction-kernels 0.4.5
    def lik_call(s):
        import late_interaction_kernels as lik
        return lik.maxsim(s["Q"], s["D"])

    def lik_prep(sets):
        import late_interaction_kernels  # noqa: F401
        return sets

    impls["lik"] = (lik_prep, lik_call, ident)

    # --- naive torch, input dtype
    def torch_naive_call(s):
        Q, D = s["Q"], s["D"]
        B, Ld, d = D.shape
        Lq = Q.shape[0]
        chunk = max(1, min(B, cap // max(1, Ld * Lq * D.element_size())))
        if chunk >= B:
            S = torch.matmul(D.reshape(-1, d), Q.T).view(B, Ld, Lq)
            return S.amax(dim=1).sum(dim=-1, dtype=torch.float32)
        out = torch.empty(B, dtype=torch.float32, device=D.device)
        for b0 in range(0, B, chunk):
            b1 = min(B, b0 + chunk)
            S = torch.matmul(D[b0:b1].reshape(-1, d), Q.T).view(b1 - b0, Ld, Lq)
            out[b0:b1] = S.amax(dim=1).sum(dim=-1, dtype=torch.float32)
        return out

    impls["torch_naive"] = (torch_sets, torch_naive_call, ident)

    # --- naive torch, fp32 + TF32 (upcast included in the timing)
    def torch_tf32_call(s):
        Q, D = s["Q"], s["D"]
        B, Ld, d = D.shape
        Lq = Q.shape[0]
        Qf = Q.float()
        chunk = max(1, min(B, cap // max(1, Ld * (Lq + d) * 4)))
        out = torch.empty(B, dtype=torch.float32, device=D.device)
        for b0 in range(0, B, chunk):
            b1 = min(B, b0 + chunk)
            S = torch.matmul(D[b0:b1].float().reshape(-1, d), Qf.T).view(b1 - b0, Ld, Lq)
            out[b0:b1] = S.amax(dim=1).sum(dim=-1)
        return out

    impls["torch_tf32"] = (torch_sets, torch_tf32_call, ident)

    # --- naive CuPy, input dtype
    def cupy_naive_call(s):
        cp = ctx.cupy
        Q, D = s["Q"], s["D"]
        B, Ld, d = D.shape
        Lq = Q.shape[0]
        chunk = max(1, min(B, cap // max(1, Ld * Lq * D.itemsize)))
        with cupy_stream(ctx):
            out = cp.empty(B, dtype=cp.float32)
            for b0 in range(0, B, chunk):
                b1 = min(B, b0 + chunk)
                S = cp.matmul(D[b0:b1].reshape(-1, d), Q.T).reshape(b1 - b0, Ld, Lq)
                out[b0:b1] = S.max(axis=1).sum(axis=-1, dtype=cp.float32)
            return out

    impls["cupy_naive"] = (cupy_sets, cupy_naive_call, cupy_to_torch)

    return {k: impls[k] for k in selected}


# --------------------------------------------------------------------------- one measurement

def measure(ctx, name, impl, sets, ref, row, ceilings):
    torch = ctx.torch
    args = ctx.args
    prep, call, to_torch = impl
    if ctx.over_budget():
        row.update(status="skipped", error="skipped: --time-budget exhausted")
        return
    tf32 = name == "torch_tf32"
    prev_tf32 = None
    try:
        if tf32:
            prev_tf32 = set_tf32(torch, True)
        csets = prep(sets)
        with torch.no_grad():
            # warm-up (JIT / autotune / NVRTC compile), one call per set up to 3
            for s in csets[:3]:
                call(s)
            torch.cuda.synchronize()
            # rough per-call time -> rep count
            t = time_device(ctx, call, csets, min(3, len(csets)))
            est = max(statistics.median(t), 1e-3)
            reps = int(max(args.min_reps, min(args.max_reps, (args.target_s * 1e3) / est)))
            times = time_device(ctx, call, csets, reps)
            ms = statistics.median(times)
            ms_e2e = time_e2e(ctx, call, csets, max(args.min_reps, min(reps, 50)))
            # peak extra memory + correctness, on set 0
            gc.collect()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = call(csets[0])
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            o = to_torch(out).reshape(-1).double()
            if o.numel() != ref.numel():
                raise RuntimeError(f"output has {o.numel()} elements, expected {ref.numel()}")
            abs_err = (o - ref).abs()
            rel = (abs_err / ref.abs().clamp_min(1e-12)).max().item()
            mabs = abs_err.max().item()
            if not torch.isfinite(o).all().item():
                rel = float("nan")
            del out, o, abs_err
        flops, nbytes = row["flops"], row["bytes"]
        tflops = flops / (ms * 1e-3) / 1e12
        gbs = nbytes / (ms * 1e-3) / 1e9
        frac = ceiling_fraction(row["bound"], tflops, gbs, ceilings)
        row.update(status="ok", ms=ms, ms_min=min(times), ms_e2e=ms_e2e, reps=reps,
                   tflops=tflops, gbs=gbs, frac_of_ceiling=frac,
                   peak_extra_bytes=int(peak), max_rel_err=rel, max_abs_err=mabs)
    except Exception as e:  # noqa: BLE001  (OOM, compile errors, unsupported dtype, ...)
        row.update(status="error", error=short_err(e))
        tb = traceback.format_exc(limit=4)
        print(f"    [{name}] {row['error']}\n" + "\n".join("      " + ln for ln in tb.splitlines()[-6:]),
              flush=True)
    finally:
        if tf32 and prev_tf32 is not None:
            set_tf32(torch, prev_tf32)
        safe_cleanup(torch)


def finish_case(case_rows):
    """Each of our rows' ``ratio_vs_best_baseline``: its ms over the fastest baseline's, among the baselines
    that ran and scored right (``results.counts``); none for a row of ours that scored wrong."""
    ok = {r["impl"]: r for r in case_rows if r.get("status") == "ok"}
    best = fastest({k: r["ms"] for k, r in ok.items() if k in BASELINES_FOR_RATIO},
                   {k: r.get("max_rel_err") for k, r in ok.items()})
    for name, r in ok.items():
        if name in OURS_IMPLS and best and counts(r["ms"], r.get("max_rel_err")):
            r["ratio_vs_best_baseline"] = r["ms"] / best[1]


# --------------------------------------------------------------------------- output

def fmt_row(r):
    if r.get("status") != "ok":  # error / skipped: message goes in the last column
        tag = "SKIP" if r.get("status") == "skipped" else "ERR"
        return [r["shape"], SHORT_DTYPE.get(r["dtype"], r["dtype"]), r["impl"], tag, "", "", "", "", "",
                (r.get("error") or "")[:60]]
    frac = r.get("frac_of_ceiling")
    ratio = r.get("ratio_vs_best_baseline")
    rel = r.get("max_rel_err")
    return [
        r["shape"], SHORT_DTYPE.get(r["dtype"], r["dtype"]), r["impl"],
        f"{r['ms']:.4f}", f"{r['ms_e2e']:.4f}", f"{r['tflops']:.1f}",
        (f"{100 * frac:.0f}%{r['bound'][0]}" if frac is not None else "-"),
        f"{r['peak_extra_bytes'] / 2**20:.1f}",
        (f"{rel:.1e}" if isinstance(rel, float) and math.isfinite(rel) else str(rel)),
        (f"{ratio:.2f}" if ratio is not None else ""),
    ]


TABLE_HDR = ["shape", "dt", "impl", "ms", "e2e_ms", "TF/s", "%ceil", "peakMB", "rel_err", "ours/best_bl"]


def render_table(rows, meta):
    lines = []
    c = meta.get("ceilings", {})
    lines.append(f"# {meta.get('gpu')}  cuBLAS fp16 {c.get('cublas_fp16_tflops', float('nan')):.0f} TF/s, "
                 f"HBM {c.get('hbm_gbs', float('nan')):.0f} GB/s  (%ceil: c=compute-bound, m=memory-bound; "
                 f"ours/best_bl <1 = ours faster)")
    lines += text_table(TABLE_HDR, [fmt_row(r) for r in rows], [(r["shape"], r["dtype"]) for r in rows])
    return "\n".join(lines)


def write_chart(path, rows, meta, shapes, dtypes, impls):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"(chart skipped: {short_err(e)})")
        return False
    labels = [s["label"] for s in shapes]
    fig, axes = plt.subplots(len(dtypes), 1,
                             figsize=(min(20, max(8, 0.5 * len(labels) * len(impls))), 4.2 * len(dtypes)),
                             squeeze=False)
    width = 0.8 / max(1, len(impls))
    cmap = plt.get_cmap("tab10")
    for ax, dt in zip(axes[:, 0], dtypes):
        for k, impl in enumerate(impls):
            xs, hs, errs = [], [], []
            for i, lab in enumerate(labels):
                r = next((r for r in rows if r["shape"] == lab and r["dtype"] == dt and r["impl"] == impl), None)
                x = i - 0.4 + width * (k + 0.5)
                if r is None:
                    continue
                if r.get("status") == "ok":
                    xs.append(x)
                    hs.append(r["tflops"])
                else:
                    errs.append(x)
            if xs:
                ax.bar(xs, hs, width, color=cmap(k % 10))
            if errs:
                ax.plot(errs, [0] * len(errs), "x", color=cmap(k % 10), markersize=7)
        c = meta.get("ceilings", {}).get("cublas_fp16_tflops")
        ax.set_title(f"{dt}  |  {meta.get('gpu')}  |  one query vs B docs, d={meta['d']}"
                     + (f"  |  cuBLAS fp16 ceiling {c:.0f} TF/s" if c else ""), fontsize=9)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_ylabel("TFLOP/s (2*B*Lq*Ld*d / t)")
        ax.grid(axis="y", alpha=0.3)
        from matplotlib.patches import Patch
        handles = [Patch(color=cmap(k % 10), label=impl) for k, impl in enumerate(impls)]
        ax.legend(handles=handles, fontsize=7, ncol=min(len(impls), 7), loc="upper left")
    fig.text(0.01, 0.005, "x = failed / error", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- main

def main(argv=None):
    args = build_argparser().parse_args(argv)
    if args.table_from:
        data = json.loads(Path(args.table_from).read_text())
        print(render_table(data.get("rows", []), data.get("meta", {})))
        return 0
    if args.target_s is None:
        args.target_s = 0.15 if args.quick else 0.5
    shapes = parse_shapes(args.shapes or (QUICK_SHAPES if args.quick else DEFAULT_SHAPES), args.B)
    dtypes = parse_dtypes(args.dtypes or "fp16,bf16")
    impl_names = ALL_IMPLS if not args.impls else [s.strip() for s in args.impls.split(",") if s.strip()]
    bad = [s for s in impl_names if s not in ALL_IMPLS]
    if bad:
        raise SystemExit(f"--impls: unknown {bad}; choose from {ALL_IMPLS}")
    out_dir = default_out_dir(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    # ---- heavy imports only here
    ctx, meta = start(args)
    torch, props, slug, l2 = ctx.torch, ctx.props, ctx.slug, ctx.l2
    meta.update({
        "args": vars(args),
        "d": args.d, "Nq": 1,
        "timing": ("CUDA events; ms = median per-call device time with a ~250us torch.cuda._sleep pad before "
                   "each call (host overhead hidden); ms_e2e = back-to-back calls / count; inputs rotate over "
                   f"n_sets distinct sets with total bytes >= {args.l2_factor}x L2"),
        "sleep_cycles_per_ms": ctx.cycles_per_ms,
        "memory": ("peak_extra_bytes = torch.cuda.max_memory_allocated() - memory_allocated() over one call "
                   "after reset_peak_memory_stats (inputs resident, output included); CuPy allocates through "
                   "torch's caching allocator via cupy.cuda.set_allocator, so CuPy/lik_cupy buffers count too"
                   + ("" if ctx.cupy is not None else f" [cupy unavailable: {ctx.cupy_err}]")),
        "error": "max_j |out_j - ref_j| / |ref_j|, ref in float64 (torch, GPU, doc-chunked) from the same "
                 "rounded inputs (set 0)",
        "flops": "2 * Nq * B * Lq * Ld * d", "bytes": "Q + D (input dtype, read once) + fp32 output",
        "naive_chunk_mb": args.naive_chunk_mb,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    })

    ceilings = run_ceilings(ctx, meta)
    ridge = ceilings.get("ridge_flop_per_byte")

    json_path = out_dir / f"forward_{slug}.json"
    png_path = out_dir / f"forward_{slug}.png"
    txt_path = out_dir / f"forward_{slug}.txt"
    rows = []
    impls = build_impls(ctx, impl_names)

    # optional: pre-compile our kernels (ignored if the API is missing / fails)
    if "ours" in impl_names or "ours_cupy" in impl_names:
        warm_up_ours(meta, dims=(args.d,), dtypes=tuple(dtypes))

    def payload():
        return {"meta": meta, "rows": rows}

    d = args.d
    for shp in shapes:
        Lq, Ld, B = shp["Lq"], shp["Ld"], shp["B"]
        for dt in dtypes:
            elt = 2
            set_bytes = (Lq * d + B * Ld * d) * elt
            try:
                free, _total = torch.cuda.mem_get_info()
            except Exception:  # noqa: BLE001
                free = props.total_memory
            n_sets = max(1, math.ceil(args.l2_factor * l2 / set_bytes))
            n_sets = max(1, min(n_sets, 64, int(0.25 * free // set_bytes)))
            flops = 2 * 1 * B * Lq * Ld * d
            nbytes = set_bytes + B * 4
            ai = flops / nbytes
            bound = ("compute" if ai >= ridge else "memory") if ridge else ("compute" if Lq >= 256 else "memory")
            print(f"\n== {shp['label']}  {dt}  (B={B}, n_sets={n_sets}, "
                  f"{set_bytes / 2**20:.1f} MiB/set, AI={ai:.0f} FLOP/B -> {bound}-bound)", flush=True)
            case_rows = []
            base = dict(shape=shp["label"], shape_name=shp["name"], Nq=1, B=B, Lq=Lq, Ld=Ld, d=d, dtype=dt, n_sets=n_sets,
                        flops=flops, bytes=nbytes, arith_intensity=ai, bound=bound)
            try:
                sets = make_sets(ctx, Lq, Ld, B, d, dt, n_sets, args.seed)
                ref = reference_f64(ctx, sets[0]["Q"], sets[0]["D"])
            except Exception as e:  # noqa: BLE001
                err = f"input/reference setup failed: {short_err(e)}"
                print("   " + err, flush=True)
                for name in impl_names:
                    case_rows.append(dict(base, impl=name, status="error", error=err))
                rows.extend(case_rows)
                sets = ref = None
                safe_cleanup(torch)
                write_json(json_path, payload())
                continue
            for name in impl_names:
                row = dict(base, impl=name)
                t_start = time.time()
                measure(ctx, name, impls[name], sets, ref, row, ceilings)
                row["wall_s"] = time.time() - t_start
                case_rows.append(row)
                if row["status"] == "ok":
                    print(f"   {name:13s} {row['ms']:9.4f} ms (e2e {row['ms_e2e']:.4f})  "
                          f"{row['tflops']:7.1f} TF/s  {row['gbs']:7.0f} GB/s  "
                          f"peak {row['peak_extra_bytes'] / 2**20:8.1f} MiB  rel_err {row['max_rel_err']:.2e}  "
                          f"[{row['reps']} reps, {row['wall_s']:.1f}s]", flush=True)
                else:
                    print(f"   {name:13s} {row['status'].upper()}: {row.get('error')}", flush=True)
            finish_case(case_rows)
            rows.extend(case_rows)
            del sets, ref
            safe_cleanup(torch)
            write_json(json_path, payload())

    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    meta["wall_s"] = time.time() - ctx.t0
    write_json(json_path, payload())
    try:
        if write_chart(png_path, rows, meta, shapes, dtypes, impl_names):
            print(f"chart: {png_path}")
    except Exception as e:  # noqa: BLE001
        print(f"(chart failed: {short_err(e)})")
    table = render_table(rows, meta)
    txt_path.write_text(table + "\n")
    print(f"results: {json_path}")
    print()
    print(table, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
