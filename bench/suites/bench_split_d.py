"""Wide embeddings: split-d against one-shot tiles, and against flash-maxsim / LIK, per dim.

For each d it times, in one process on one GPU and on the same inputs:
  * every candidate kernel configuration (one-shot and split-d, Hopper wgmma and
    portable mma.sync), each forced in turn: the sweep behind
    ``dispatch.tables.SPLIT_FROM`` / ``_WGMMA_SPLIT`` / ``tables.SPLIT_TABLE``;
  * ``lik_cupy.maxsim`` as dispatched ("ours");
  * flash-maxsim 0.3.0 ``flash_maxsim`` and LIK 0.4.5 ``maxsim``.

Shapes: ColPali (Lq=Ld=1024, B=128) and textual (Lq=32, Ld=180, B=1024), one query
against B documents, fp16. Device time: a spin kernel is queued before each timed
batch so host overhead stays hidden. Each candidate's scores are checked against an
fp32 torch reference (max relative error recorded).

    python bench/suites/bench_split_d.py [--dims 128,256,...] [--out DIR] [--time-budget S]
    python bench/suites/bench_split_d.py --no-candidates      (ours and the baselines only)
    python bench/suites/bench_split_d.py --table-from bench/results/latest/split_d_<gpu>.json

Writes ``sweep_split_d_<gpu>.json`` (``split_d_<gpu>.json`` with --no-candidates) and
prints a table ("vs" columns: baseline time / our time, above 1 means ours is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("LIK_SUPPRESS_NORM_WARN", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
from bench.lib import baselines  # noqa: E402
from bench.lib.forcing import forcing as forced, rebind  # noqa: E402
from bench.lib.results import out_dir, slugify, write_json  # noqa: E402
from bench.lib.timing import per_call_ms  # noqa: E402

DIMS = (128, 256, 384, 512, 768, 1024, 2048, 4096)
SHAPES = {"colpali": (1024, 1024, 128), "textual": (32, 180, 1024)}


def candidates(dim: int, lq: int):
    """(label, FwdConfig) pairs to force, for fp16 on an sm_90 device."""
    from lik_cupy._dispatch import SMEM_PER_BLOCK, FwdConfig, choose_forward

    limit = SMEM_PER_BLOCK[90]
    out = []
    if dim <= 512:  # one-shot: the tables' own choice (wgmma where the one-shot rules allow it), TMA or not
        for wg in (True, False):
            for tma in (True, False):
                try:
                    saved = _force_split_from(10**9)
                    c = choose_forward(90, "float16", dim, lq, False, True, wg, tma=tma)
                finally:
                    _restore(saved)
                if not c.split and c.name not in {x.name for _, x in out}:
                    out.append((f"oneshot_{'wgmma' if c.wgmma else 'mma'}{'_tma' if c.tma else ''}", c))
        if lq > 64 and dim % 64 == 0:
            for bn, st in ((128, 2), (64, 2), (64, 3)):
                c = FwdConfig(elem=0, dp=dim, warps=8, mt=1, bn=bn, stages=st, qreg=False, argmax=False, vec=True,
                              wgmma=True)
                if c.smem_bytes <= limit and c.name not in {x.name for _, x in out}:
                    out.append((f"oneshot_wgmma_n{bn}s{st}", c))
    # Hopper split-d: two warpgroups for long queries, one for short ones; TMA or cp.async staging.
    if lq > 64:
        warps, tiles = 8, ((256, 64, 3), (256, 64, 4), (128, 64, 3), (128, 64, 4), (128, 64, 6), (128, 128, 3))
        mma = ((4, 2, 64, 64, 3), (4, 2, 128, 64, 3), (4, 2, 128, 32, 4))
    else:
        warps, tiles = 4, ((64, 64, 4), (64, 64, 6), (64, 128, 3), (128, 64, 3), (128, 64, 4), (128, 64, 6),
                           (256, 64, 3), (256, 64, 4))
        mma = ((2, 1, 64, 64, 3), (2, 1, 64, 64, 4), (2, 1, 64, 64, 6), (2, 1, 64, 128, 3), (2, 1, 32, 64, 6))
    for bn, bk, st in tiles:
        for tma in (True, False):
            c = FwdConfig(elem=0, dp=bk, warps=warps, mt=1, bn=bn, stages=st, qreg=False, argmax=False, vec=True,
                          wgmma=True, multi=False, packed=False, split=True, tma=tma)
            if c.smem_bytes <= limit:
                out.append((f"split_wgmma_w{warps}n{bn}k{bk}s{st}{'_tma' if tma else ''}", c))
    for w, mt, bn, bk, st in mma:
        c = FwdConfig(elem=0, dp=bk, warps=w, mt=mt, bn=bn, stages=st, qreg=False, argmax=False, vec=True,
                      wgmma=False, multi=False, packed=False, split=True)
        if c.smem_bytes <= limit:
            out.append((f"split_mma_w{w}m{mt}n{bn}k{bk}s{st}", c))
    return out


def _force_split_from(value):
    from lik_cupy import _dispatch as dispatch

    saved = dict(dispatch.tables.SPLIT_FROM), dispatch.tables.SPLIT_FROM_DEFAULT
    for k in dispatch.tables.SPLIT_FROM:
        dispatch.tables.SPLIT_FROM[k] = value
    rebind(dispatch.tables, "SPLIT_FROM_DEFAULT", value)
    dispatch.clear_caches()
    return saved


def _restore(saved):
    from lik_cupy import _dispatch as dispatch

    dispatch.tables.SPLIT_FROM.clear()
    dispatch.tables.SPLIT_FROM.update(saved[0])
    rebind(dispatch.tables, "SPLIT_FROM_DEFAULT", saved[1])
    dispatch.clear_caches()


def device_ms(torch, fn, n):
    # The spin must outlast the host's queueing of all n calls (up to ~0.4 ms each through torch
    # on a slow host), or small shapes time the host instead of the GPU.
    return per_call_ms(torch, fn, n, spin_cycles=max(20_000_000, n * 1_000_000))


def cublas_tflops(torch):
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.float16)
    b = torch.randn(n, n, device="cuda", dtype=torch.float16)
    for _ in range(20):
        torch.matmul(a, b)
    ms = device_ms(torch, lambda: torch.matmul(a, b), 20)
    return 2 * n**3 / ms / 1e9


def reference(torch, q, d):
    out = torch.empty(d.shape[0], dtype=torch.float64, device="cuda")
    qf = q.float()
    step = max(1, (1 << 28) // (d.shape[1] * q.shape[0] * 4))
    for b0 in range(0, d.shape[0], step):
        sim = torch.matmul(d[b0: b0 + step].float(), qf.T)
        out[b0: b0 + step] = sim.amax(dim=1).double().sum(dim=-1)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default=",".join(map(str, DIMS)))
    ap.add_argument("--shapes", default="colpali,textual")
    ap.add_argument("--out", default=str(out_dir()))
    ap.add_argument("--time-budget", type=float, default=480.0)
    ap.add_argument("--no-candidates", action="store_true", help="only the dispatched kernel and the baselines")
    ap.add_argument("--table-from", default=None)
    args = ap.parse_args(argv)
    if args.table_from:
        print(table(json.loads(Path(args.table_from).read_text())))
        return 0

    import torch

    import lik_cupy
    from lik_cupy._base.device import device_properties

    t0 = time.time()
    props = device_properties(torch.cuda.current_device())
    slug = slugify(props.name)
    meta = {"gpu": props.name, "cc": props.cc, "cublas_fp16_tflops": cublas_tflops(torch), "rows": []}
    # The candidate sweep backs the dispatch table; the dispatched-only run backs the speed claims.
    path = Path(args.out) / f"{'split_d' if args.no_candidates else 'sweep_split_d'}_{slug}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    impls = {}
    flash_maxsim, err = baselines.load(baselines.FLASH)
    if flash_maxsim is not None:
        impls["flash_maxsim"] = lambda q, d: flash_maxsim.flash_maxsim(q, d)
    else:
        meta["flash_maxsim_error"] = err
    likk, err = baselines.load(baselines.LIK)
    if likk is not None:
        impls["lik"] = lambda q, d: likk.maxsim(q, d)
    else:
        meta["lik_error"] = err

    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes.split(","):
        lq, ld, b = SHAPES[shape]
        for dim in (int(x) for x in args.dims.split(",")):
            if time.time() - t0 > args.time_budget:
                meta["truncated"] = f"time budget reached before {shape} d={dim}"
                break
            q = torch.nn.functional.normalize(torch.randn(lq, dim, device="cuda", generator=g), dim=-1).half()
            d = torch.empty(b, ld, dim, device="cuda", dtype=torch.float16)
            for b0 in range(0, b, 16):
                t = torch.randn(min(16, b - b0), ld, dim, device="cuda", generator=g)
                d[b0: b0 + 16] = torch.nn.functional.normalize(t, dim=-1).half()
            ref = reference(torch, q, d)
            flops = 2.0 * lq * ld * dim * b
            nbytes = (lq + b * ld) * dim * 2
            runs = [("ours", None, lambda: lik_cupy.maxsim(q, d))]
            runs += [(k, None, (lambda f=f: f(q, d))) for k, f in impls.items()]
            if not args.no_candidates:
                runs += [(lbl, c, lambda: lik_cupy.maxsim(q, d)) for lbl, c in candidates(dim, lq)]
            for name, cfg, fn in runs:
                row = {"shape": shape, "lq": lq, "ld": ld, "B": b, "dim": dim, "impl": name,
                       "config": cfg.name if cfg else None, "flops": flops, "bytes": nbytes}
                try:
                    ctx = forced(cfg) if cfg is not None else _Null()
                    with ctx:
                        if name == "ours":
                            row["config"] = _dispatched(props.cc, dim, lq)
                        out = torch.as_tensor(fn(), device="cuda").double().reshape(-1)
                        err = ((out - ref).abs() / ref.abs().clamp_min(1e-6)).max().item()
                        est = device_ms(torch, fn, 1)
                        ms = device_ms(torch, fn, max(3, min(50, int(150 / max(est, 1e-3)))))
                    row.update(ms=ms, tflops=flops / ms / 1e9, gbs=nbytes / ms / 1e6, max_rel_err=err,
                               frac_cublas=flops / ms / 1e9 / meta["cublas_fp16_tflops"])
                except Exception as e:  # noqa: BLE001
                    row["error"] = repr(e)[:300]
                meta["rows"].append(row)
                print(_line(row), flush=True)
            q = d = ref = None  # free before the next dim is allocated
            torch.cuda.empty_cache()
            write_json(path, meta)
    write_json(path, meta)
    print(table(meta))
    return 0


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _dispatched(cc, dim, lq):
    from lik_cupy import _dispatch as dispatch
    from lik_cupy._runtime.launch import tma_usable

    return dispatch.choose_forward(cc, "float16", dim, lq, False, True, tma=tma_usable()).name


def _line(r):
    if "error" in r:
        return f"{r['shape']:8s} d={r['dim']:5d} {r['impl']:28s} ERROR {r['error'][:150]}"
    return (f"{r['shape']:8s} d={r['dim']:5d} {r['impl']:28s} {r['ms']:8.4f} ms {r['tflops']:7.1f} TF/s "
            f"{r['gbs']:7.0f} GB/s err {r['max_rel_err']:.1e}")


def table(meta):
    """Per (shape, dim): ours, the baselines, the best candidate, and the ratios."""
    lines = [f"GPU {meta['gpu']}  cuBLAS fp16 {meta['cublas_fp16_tflops']:.0f} TF/s",
             f"{'shape':8s} {'d':>5s} {'ours ms':>9s} {'TF/s':>6s} {'%cuBLAS':>7s} {'flash ms':>9s} {'lik ms':>8s} "
             f"{'vs flash':>8s} {'vs best':>8s}  best candidate"]
    by = {}
    for r in meta["rows"]:
        by.setdefault((r["shape"], r["dim"]), {})[r["impl"]] = r
    for (shape, dim), rs in by.items():
        def ms(k):
            return rs[k]["ms"] if k in rs and "ms" in rs[k] else None

        o, f, li = ms("ours"), ms("flash_maxsim"), ms("lik")
        cands = [(r["ms"], k) for k, r in rs.items() if k not in ("ours", "flash_maxsim", "lik") and "ms" in r]
        best = min(cands) if cands else None
        base = min([x for x in (f, li) if x is not None], default=None)
        fmt = lambda x, w, p: f"{x:{w}.{p}f}" if x is not None else " " * (w - 1) + "-"  # noqa: E731
        lines.append(
            f"{shape:8s} {dim:5d} {fmt(o, 9, 4)} {fmt(rs['ours'].get('tflops') if o else None, 6, 0)} "
            f"{fmt(100 * rs['ours']['frac_cublas'] if o else None, 7, 1)} {fmt(f, 9, 4)} {fmt(li, 8, 4)} "
            f"{fmt(f / o if f and o else None, 8, 2)} {fmt(base / o if base and o else None, 8, 2)}  "
            + (f"{best[1]} {best[0]:.4f}" if best else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
