"""float32 benchmark (issue 43's gate): every forward cell in float32, lik_cupy at its default precision
(float32 accuracy) and at precision="tf32", against LIK's and flash-maxsim's float32 paths, side by side
in one run on one GPU, inputs already there, d = 128 unless named, L2-normalised random tokens.

Cells (``--cells``, a comma list; default all of the first group):
  textual, long-doc,     1 query of 32 tokens x 1,000 docs of 300 / 1,024 tokens, 128 and 512 tokens x
  medium, visual         1,000 docs of 1,024 (bench_forward.py's default shapes, B = 1,000)
  colpali-1000, -10000   1 query of 1,024 tokens x 1,000 / 10,000 pages of 1,024 tokens
  32q-1000               32 queries of 32 tokens x 1,000 docs of 180 tokens
  rerank-100             1 query of 32 tokens x its own 100 candidate ids of a resident corpus of
                         100,000 docs of 180 tokens (bench_corpus_object.py's corpus): ours
                         ``Corpus.rerank``, the peers score the gathered documents (gather timed)
  few-long-1 .. -256     1 query of 1,024 tokens x B pages of 1,024 tokens, B in 1, 4, 16, 64, 256
  train-32, train-64     a training step, in-batch contrastive: scores [N, N] of N queries (32 tokens)
                         and N docs (80 / 300 tokens), cross entropy against the diagonal, backward;
                         ours lik_cupy.torch.maxsim, LIK's maxsim (autograd) and flash-maxsim's
                         flash_maxsim_batched_train
Aliases: 1q-1000 and text-1000 are textual, colpali-16 and colpali-256 are few-long-16 and -256.
Not run by default: text-40k (32 x 180, 40,000 docs), wide-d1024 (32 x 300, 2,000 docs, d = 1,024).

Contenders, each cell: ours_default (precision left to lik_cupy: torch's default matmul setting
resolves it to float32 accuracy, recorded in the JSON), ours_tf32 (precision="tf32"), lik_f32
(late_interaction_kernels: fp16 tiles of the float32 inputs), flash_f32 (flash_maxsim). A missing
peer is skipped. Per contender:
  kernel ms  the GPU's time per call: back-to-back calls queued behind a spin kernel that outlasts
             their host time (bench.lib.timing.queued_call_ms)
  call ms    wall time per call of back-to-back calls, host included (bench.lib.timing.wall_ms)
  err        max over scores of |score - float64| / (|float64| + 1), float64 MaxSim of the same
             float32 inputs computed in document chunks (training steps: the step's forward scores;
             ``grad_err`` adds max |grad - float64 grad| / max |float64 grad| over dQ and dD)
Documents (rerank: the candidates' tokens) smaller than 4x the L2 cache rotate over enough copies
(candidate id sets) to add up to that, so calls read HBM.

Output: ``precision_<gpu>.json`` in ``--out`` (else $OUT, else bench/results), rewritten after every
cell, with a top-level list "cells", each {"case", "kind": "compute" | "memory", "ours_default_ms",
"ours_tf32_ms", "best_peer", "best_peer_ms", "ratio_default", "ratio_tf32", "err_default",
"err_tf32", "peer_err"} (ratio = ours / the best peer's kernel time, peer_err the best peer's error; a
contender whose err is NaN or past bench.lib.results.WRONG_REL_ERR is neither best peer nor given a ratio)
and the per-contender kernel_ms, call_ms, err, tflops, gbs and peak_fraction (TF/s of the dense TF32
peak for compute-bound cells, GB/s of HBM for memory-bound ones: H200 494.7 TF/s and 4.8 TB/s, H100
SXM 494.7 and 3.35). ``kind``: compute-bound where the cell's FLOP per byte of float32 input reaches
the GPU's ridge (the H200's elsewhere). A table is printed last.

    python bench/suites/bench_precision.py --time-budget 480          # GPU: precision_<gpu>.json
    python bench/suites/bench_precision.py --smoke --out /tmp/p       # tiny shapes, CPU path, no peers
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
from bench.lib import baselines  # noqa: E402
from bench.lib.gpu import safe_cleanup, start  # noqa: E402
from bench.lib.reference import exact_scores  # noqa: E402
from bench.lib.results import counts, fastest, out_dir, short_err, slugify, text_table, write_json  # noqa: E402
from bench.lib.timing import queued_call_ms, wall_ms  # noqa: E402

os.environ.setdefault("LIK_SUPPRESS_NORM_WARN", "1")


@dataclass(frozen=True)
class Cell:
    """One workload: ``work`` "forward" (nq queries, 0 for one 2-D query, of lq tokens x b docs of ld),
    "rerank" (one query x b candidate ids of ``docs`` documents) or "train" (b queries x b docs)."""
    work: str
    title: str
    lq: int
    ld: int
    b: int
    nq: int = 0
    dim: int = 128
    docs: int = 0


CELLS = {
    "textual": Cell("forward", "1 q (32) x 1,000 docs (300)", 32, 300, 1000),
    "long-doc": Cell("forward", "1 q (32) x 1,000 docs (1,024)", 32, 1024, 1000),
    "medium": Cell("forward", "1 q (128) x 1,000 docs (1,024)", 128, 1024, 1000),
    "visual": Cell("forward", "1 q (512) x 1,000 docs (1,024)", 512, 1024, 1000),
    "colpali-1000": Cell("forward", "ColPali 1 q (1,024) x 1,000 pages (1,024)", 1024, 1024, 1000),
    "colpali-10000": Cell("forward", "ColPali 1 q (1,024) x 10,000 pages (1,024)", 1024, 1024, 10_000),
    "32q-1000": Cell("forward", "32 q (32) x 1,000 docs (180)", 32, 180, 1000, nq=32),
    "rerank-100": Cell("rerank", "rerank 1 q (32) x 100 ids of 100,000 docs (180)", 32, 180, 100, docs=100_000),
    **{f"few-long-{b}": Cell("forward", f"few long pages: 1 q (1,024) x {b} pages (1,024)", 1024, 1024, b)
       for b in (1, 4, 16, 64, 256)},
    "train-32": Cell("train", "training step N = 32 (32, 80)", 32, 80, 32),
    "train-64": Cell("train", "training step N = 64 (32, 300)", 32, 300, 64),
}
DEFAULT_CELLS = tuple(CELLS)
# Earlier runs' cells: not in the default set; text-40k stays under 2^31 float32 elements, which the
# peers index in int32.
CELLS.update({
    "text-40k": Cell("forward", "1 q (32) x 40,000 docs (180)", 32, 180, 40_000),
    "wide-d1024": Cell("forward", "1 q (32) x 2,000 docs (300), d = 1,024", 32, 300, 2000, dim=1024),
})
ALIASES = {"1q-1000": "textual", "text-1000": "textual", "colpali-16": "few-long-16", "colpali-256": "few-long-256"}

PEERS = ("lik_f32", "flash_f32")
# Dense TF32 tensor-core peak (FLOP/s) and HBM bandwidth (B/s), by a part of the GPU's name.
PEAKS = {"H200": (494.7e12, 4.8e12), "H100 80GB HBM3": (494.7e12, 3.35e12), "H100 SXM": (494.7e12, 3.35e12)}
DEFAULT_RIDGE = PEAKS["H200"][0] / PEAKS["H200"][1]
L2_FACTOR = 4          # memory-bound documents rotate over copies adding up to this many L2 caches
MAX_SETS = 64


def smoke_cell(c: Cell) -> Cell:
    """The same workload at a size the CPU path runs in well under a second."""
    return replace(c, lq=min(c.lq, 8), ld=min(c.ld, 12), b=min(c.b, 6), nq=min(c.nq, 3), dim=16,
                   docs=min(c.docs, 20))


def parse_cells(spec: str) -> list[str]:
    """Cell names from a comma list (aliases resolved, repeats dropped); ``all``: every cell."""
    if spec.strip() == "all":
        return list(CELLS)
    names = []
    for tok in filter(None, (t.strip() for t in spec.split(","))):
        name = ALIASES.get(tok, tok)
        if name not in CELLS:
            raise SystemExit(f"--cells: unknown cell {tok!r}; expected 'all' or names from "
                             f"{', '.join(list(CELLS) + list(ALIASES))}")
        if name not in names:
            names.append(name)
    return names


def peaks_of(gpu: str):
    """(dense TF32 FLOP/s, HBM B/s) of a GPU named ``gpu``, or None when this suite does not know it."""
    if "PCIe" in gpu:
        return None
    return next((v for k, v in PEAKS.items() if k in gpu), None)


# --------------------------------------------------------------------------- timing

class GpuClock:
    """Kernel time (calls queued behind a spin kernel) and call time (wall, host included) on the GPU."""

    def __init__(self, ctx, target_ms: float, max_calls: int):
        self.ctx, self.target_ms, self.max_calls = ctx, target_ms, max_calls

    def times(self, fn) -> tuple[float, float, int]:
        torch = self.ctx.torch
        est = wall_ms(torch, fn, 2, rounds=1)
        calls = max(3, min(self.max_calls, int(self.target_ms / max(est, 1e-3))))
        call = wall_ms(torch, fn, calls)
        return queued_call_ms(torch, fn, calls, call, self.ctx.cycles_per_ms), call, calls

    def sync(self):
        self.ctx.torch.cuda.synchronize()


class HostClock:
    """The smoke run's clock: the CPU path's wall time stands for both figures."""

    def __init__(self, target_ms: float, max_calls: int):
        self.target_ms, self.max_calls = target_ms, max_calls

    def times(self, fn) -> tuple[float, float, int]:
        fn()
        t = time.perf_counter()
        fn()
        est = (time.perf_counter() - t) * 1e3
        calls = max(2, min(self.max_calls, int(self.target_ms / max(est, 1e-3))))
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - t) * 1e3 / calls)
        return best, best, calls

    def sync(self):
        pass


# --------------------------------------------------------------------------- inputs

def unit_tokens(torch, shape, gen, device):
    """float32 unit-norm random tokens ``shape``, drawn at most 64 MiB at a time (the normalisation's
    temporaries stay that small however large the documents)."""
    out = torch.empty(*shape, device=device, dtype=torch.float32)
    flat = out.view(-1, shape[-1])
    step = max(1, (64 << 20) // (4 * shape[-1]))
    for i in range(0, flat.shape[0], step):
        x = torch.randn(min(step, flat.shape[0] - i), shape[-1], device=device, generator=gen)
        flat[i:i + step] = x / x.norm(dim=-1, keepdim=True)
    return out


def rotation(torch, make, set_bytes: int, env) -> list:
    """Copies of an input, enough to add up to L2_FACTOR L2 caches (one in the smoke run, at most a
    quarter of the free memory): calls cycling through them read HBM, not the L2."""
    if env.smoke:
        return [make()]
    n = max(1, min(MAX_SETS, math.ceil(L2_FACTOR * env.l2 / max(1, set_bytes)),
                   int(0.25 * torch.cuda.mem_get_info()[0] // max(1, set_bytes))))
    return [make() for _ in range(n)]


def cycling(fn, sets):
    """A callable taking no argument: ``fn`` on the next of ``sets`` at each call."""
    i = [0]

    def call():
        i[0] = (i[0] + 1) % len(sets)
        return fn(sets[i[0]])

    return call


# --------------------------------------------------------------------------- the cells' contenders

@dataclass
class Case:
    """A cell made ready: ``contenders`` name -> (a call on the first input set, a call cycling
    through the sets), the float64 scores of the first set, the cell's FLOPs and bytes, extra JSON
    keys, and for a training step each contender's (Q, D) leaves and the float64 (dQ, dD). ``scored``
    picks from a contender's result the scores ``ref`` covers, flattened."""
    contenders: dict
    ref: object
    flops: int
    nbytes: int
    scored: object = None
    extra: dict = field(default_factory=dict)
    leaves: dict | None = None
    grad64: tuple | None = None


def forward_case(torch, lk, mods, cell: Cell, env) -> Case:
    """One query (or ``nq``) against B padded documents, rotated where they are memory-bound."""
    qshape = (cell.nq, cell.lq, cell.dim) if cell.nq else (cell.lq, cell.dim)
    q = unit_tokens(torch, qshape, env.gen, env.device)
    dshape = (cell.b, cell.ld, cell.dim)
    sets = rotation(torch, lambda: unit_tokens(torch, dshape, env.gen, env.device), 4 * math.prod(dshape), env)
    backend = "cpu" if env.smoke else "auto"
    fns = {"ours_default": lambda d: lk.maxsim(q, d, backend=backend),
           "ours_tf32": lambda d: lk.maxsim(q, d, backend=backend, precision="tf32")}
    if mods.get("lik"):
        fns["lik_f32"] = lambda d: mods["lik"].maxsim(q, d)
    if mods.get("flash"):
        flash = mods["flash"]
        fns["flash_f32"] = (lambda d: flash.flash_maxsim_batched(q, d)) if cell.nq else (
            lambda d: flash.flash_maxsim(q, d))
    nq, n_ref = max(1, cell.nq), min(cell.b, env.ref_docs or cell.b)
    return Case({k: (lambda f=f: f(sets[0]), cycling(f, sets)) for k, f in fns.items()},
                exact_scores(torch, q if cell.nq else q[None], sets[0][:n_ref]).reshape(-1),
                2 * nq * cell.b * cell.lq * cell.ld * cell.dim,
                4 * (cell.b * cell.ld * cell.dim + nq * cell.lq * cell.dim + nq * cell.b),
                scored=lambda out: out.reshape(nq, cell.b)[:, :n_ref].reshape(-1))


def rerank_case(torch, lk, mods, cell: Cell, env) -> Case:
    """Ours: ``Corpus.rerank`` of the ids in place; the peers: the ids' documents gathered, then scored."""
    D = unit_tokens(torch, (cell.docs, cell.ld, cell.dim), env.gen, env.device)
    corpus = lk.Corpus(D, device="cpu" if env.smoke else None)
    q = unit_tokens(torch, (cell.lq, cell.dim), env.gen, env.device)
    id_sets = rotation(torch, lambda: torch.randperm(cell.docs, device=env.device, generator=env.gen)[:cell.b],
                       4 * cell.b * cell.ld * cell.dim, env)
    fns = {"ours_default": lambda ids: corpus.rerank(q, ids),
           "ours_tf32": lambda ids: corpus.rerank(q, ids, precision="tf32")}
    if mods.get("lik"):
        fns["lik_f32"] = lambda ids: mods["lik"].maxsim(q, D[ids])
    if mods.get("flash"):
        fns["flash_f32"] = lambda ids: mods["flash"].flash_maxsim(q, D[ids])
    case = Case({k: (lambda f=f: f(id_sets[0]), cycling(f, id_sets)) for k, f in fns.items()},
                exact_scores(torch, q[None], D[id_sets[0]]).reshape(-1),
                2 * cell.b * cell.lq * cell.ld * cell.dim,
                4 * (cell.b * cell.ld * cell.dim + cell.lq * cell.dim + cell.b) + 8 * cell.b)
    if not env.smoke:  # the part of the peers' time that is the gather
        case.extra["peer_gather_kernel_ms"] = env.clock.times(cycling(lambda ids: D[ids], id_sets))[0]
    return case


def train_case(torch, lk, mods, cell: Cell, env) -> Case:
    """Each contender's step: scores [N, N] -> cross entropy against the diagonal -> backward into Q
    and D; a step returns its scores, detached. FLOPs are the forward's, bytes Q and D read once."""
    import lik_cupy.torch as lt

    n = cell.b
    q0 = unit_tokens(torch, (n, cell.lq, cell.dim), env.gen, env.device)
    d0 = unit_tokens(torch, (n, cell.ld, cell.dim), env.gen, env.device)
    labels = torch.arange(n, device=env.device)
    scorers = {"ours_default": lambda q, d: lt.maxsim(q, d),
               "ours_tf32": lambda q, d: lt.maxsim(q, d, precision="tf32")}
    if mods.get("lik"):
        scorers["lik_f32"] = lambda q, d: mods["lik"].maxsim(q, d)
    if mods.get("flash"):
        scorers["flash_f32"] = lambda q, d: mods["flash"].flash_maxsim_batched_train(q, d, shared_docs=True)

    def step_of(score, q, d):
        def step():
            q.grad = d.grad = None
            s = score(q, d)
            torch.nn.functional.cross_entropy(s, labels).backward()
            return s.detach()

        return step

    q64, d64 = q0.double().requires_grad_(True), d0.double().requires_grad_(True)
    s64 = torch.einsum("isk,jtk->ijst", q64, d64).amax(-1).sum(-1)
    torch.nn.functional.cross_entropy(s64, labels).backward()
    leaves = {k: (q0.clone().requires_grad_(True), d0.clone().requires_grad_(True)) for k in scorers}
    steps = {k: step_of(f, *leaves[k]) for k, f in scorers.items()}
    return Case({k: (f, f) for k, f in steps.items()}, s64.detach().reshape(-1),
                2 * n * n * cell.lq * cell.ld * cell.dim, 4 * n * (cell.lq + cell.ld) * cell.dim,
                leaves=leaves, grad64=(q64.grad, d64.grad))


CASES = {"forward": forward_case, "rerank": rerank_case, "train": train_case}


def grad_error(leaves, grad64) -> float:
    """max over dQ and dD of max |grad - float64 grad| / max |float64 grad|."""
    return max(float((x.grad.double() - g).abs().max() / g.abs().max()) for x, g in zip(leaves, grad64))


# --------------------------------------------------------------------------- one cell

def run_cell(torch, lk, mods, name: str, cell: Cell, env) -> dict:
    """Every contender of one cell: its error against float64, kernel and call time; then the summary."""
    case = CASES[cell.work](torch, lk, mods, cell, env)
    got = {"kernel_ms": {}, "call_ms": {}, "err": {}, "calls_per_round": {}, "failures": {}}
    if case.leaves is not None:
        got["grad_err"] = {}
    for impl, (once, repeat) in case.contenders.items():
        try:
            out = once()
            out = (case.scored(out) if case.scored else out.reshape(-1)).double()
            env.clock.sync()
            err = float(((out - case.ref).abs() / (case.ref.abs() + 1)).max())
            gerr = grad_error(case.leaves[impl], case.grad64) if case.leaves is not None else None
            kernel, call, calls = env.clock.times(repeat)
        except Exception as e:  # noqa: BLE001  (a contender that cannot run a cell is reported, the rest go on)
            got["failures"][impl] = short_err(e)
            print(f"  {impl:13s} FAILED {got['failures'][impl]}", flush=True)
            if not env.smoke:
                safe_cleanup(torch)
            continue
        got["kernel_ms"][impl], got["call_ms"][impl], got["err"][impl] = kernel, call, err
        got["calls_per_round"][impl] = calls
        if gerr is not None:
            got["grad_err"][impl] = gerr
        print(f"  {impl:13s} kernel {kernel:.4f} ms  call {call:.4f} ms  err {err:.1e}", flush=True)
    return summary(name, cell, env, case, got)


def summary(name: str, cell: Cell, env, case: Case, got: dict) -> dict:
    """The cell's JSON: the gate's keys first, then the details."""
    kernel, call, err = got["kernel_ms"], got["call_ms"], got["err"]
    ridge = env.peaks[0] / env.peaks[1] if env.peaks else DEFAULT_RIDGE
    kind = "compute" if case.flops / case.nbytes >= ridge else "memory"
    # a peer that scored wrong (or NaN) is no best peer, and a wrong row of ours gets no ratio
    right = {k for k in kernel if counts(kernel[k], err.get(k))}
    peers = {p: kernel[p] for p in PEERS if p in right}
    best = fastest(peers)
    best = best and best[0]
    best_call = fastest({p: call[p] for p in peers})
    best_call = best_call and best_call[1]

    def ratio(times, ours, peer_ms):
        return times[ours] / peer_ms if peer_ms and ours in times and ours in right else None

    tflops = {k: case.flops / v / 1e9 for k, v in kernel.items()}
    gbs = {k: case.nbytes / v / 1e6 for k, v in kernel.items()}
    frac = {k: (tflops[k] * 1e12 / env.peaks[0] if kind == "compute" else gbs[k] * 1e9 / env.peaks[1])
            for k in kernel} if env.peaks else {}
    return {
        "case": name, "kind": kind,
        "ours_default_ms": kernel.get("ours_default"), "ours_tf32_ms": kernel.get("ours_tf32"),
        "best_peer": best, "best_peer_ms": peers.get(best),
        "ratio_default": ratio(kernel, "ours_default", peers.get(best)),
        "ratio_tf32": ratio(kernel, "ours_tf32", peers.get(best)),
        "err_default": err.get("ours_default"), "err_tf32": err.get("ours_tf32"), "peer_err": err.get(best),
        "title": cell.title, "work": cell.work, "Nq": cell.nq or 1, "Lq": cell.lq, "Ld": cell.ld, "B": cell.b,
        "dim": cell.dim, **({"corpus_docs": cell.docs} if cell.work == "rerank" else {}),
        "flops": case.flops, "bytes": case.nbytes,
        "ratio_call_default": ratio(call, "ours_default", best_call),
        "ratio_call_tf32": ratio(call, "ours_tf32", best_call),
        **got, "tflops": tflops, "gbs": gbs, "peak_fraction": frac, **case.extra,
    }


# --------------------------------------------------------------------------- output

def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def table(cells) -> list[str]:
    header = ["case", "kind", "default ms", "tf32 ms", "best peer", "peer ms", "ratio def", "ratio tf32",
              "tf32 of peak", "err def", "err tf32", "peer err"]
    body = [[c["case"], c["kind"], fmt(c["ours_default_ms"], ".4f"), fmt(c["ours_tf32_ms"], ".4f"),
             c["best_peer"] or "-", fmt(c["best_peer_ms"], ".4f"), fmt(c["ratio_default"], ".2f"),
             fmt(c["ratio_tf32"], ".2f"), fmt(c["peak_fraction"].get("ours_tf32"), ".0%"),
             fmt(c["err_default"], ".1e"), fmt(c["err_tf32"], ".1e"), fmt(c["peer_err"], ".1e")] for c in cells]
    return text_table(header, body, [c["work"] for c in cells])


@dataclass
class Env:
    """What every cell shares: smoke run or not, the device, the L2's bytes, the GPU's peaks (or
    None), the clock, the generator."""
    smoke: bool
    device: str
    l2: int
    peaks: tuple | None
    clock: object
    ref_docs: int | None = None
    gen: object = None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="output directory (default $OUT, else bench/results)")
    ap.add_argument("--cells", default=",".join(DEFAULT_CELLS),
                    help="comma list of cells (or 'all'); default every issue-43 cell")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds: cells that would start later are skipped (listed in the JSON's 'skipped'); "
                         "leave one cell's time below the hard limit (colpali-10000 is the longest)")
    ap.add_argument("--target-ms", type=float, default=150.0, help="time of one timing round of calls (ms)")
    ap.add_argument("--max-calls", type=int, default=100, help="calls per timing round at most")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU path (no GPU, no peers)")
    ap.add_argument("--ref-docs", type=int, default=None,
                    help="errors over the first N documents of a forward cell (default all; the float64 "
                         "reference of colpali-10000 is 2.7 PFLOP of float64 GEMMs, some 40 s on an H200)")
    ap.add_argument("--seed", type=int, default=43)
    args = ap.parse_args(argv)
    names = parse_cells(args.cells)
    t0 = time.time()

    import torch

    import lik_cupy as lk
    from lik_cupy._dispatch.precision import fp32_accurate

    meta = {"suite": "precision", "when": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
            "smoke": args.smoke, "args": vars(args)}
    if args.smoke:
        env = Env(smoke=True, device="cpu", l2=0, peaks=None, clock=HostClock(args.target_ms, args.max_calls),
                  ref_docs=args.ref_docs)
        mods, gpu = {}, "cpu smoke"
    else:
        ctx, gpu_meta = start(args)
        meta.update(gpu_meta)
        env = Env(smoke=False, device="cuda", l2=ctx.l2, peaks=peaks_of(ctx.gpu),
                  clock=GpuClock(ctx, args.target_ms, args.max_calls), ref_docs=args.ref_docs)
        mods, gpu = baselines.load_peers(), ctx.gpu
        meta["peers"] = {k: ("ok" if v is not None else "unavailable") for k, v in mods.items()}
    env.gen = torch.Generator(device=env.device).manual_seed(args.seed)
    meta["gpu"] = gpu
    meta["ours_default_precision"] = "fp32" if fp32_accurate(None, "torch", "float32") else "tf32"
    if meta["ours_default_precision"] != "fp32":
        print("WARNING: precision=None resolves to tf32 here (torch's matmul setting or LIK_PRECISION)", flush=True)
    meta["peaks"] = ({"tf32_tflops": env.peaks[0] / 1e12, "hbm_gbs": env.peaks[1] / 1e9} if env.peaks else None)
    meta["timing"] = ("kernel_ms: back-to-back calls queued behind a spin kernel (bench.lib.timing.queued_call_ms); "
                      "call_ms: wall per call of back-to-back calls, host included (bench.lib.timing.wall_ms)"
                      if not args.smoke else "CPU wall time per call (smoke run)")
    meta["error"] = "max |score - float64| / (|float64| + 1) over the cell's scores"
    out = out_dir(args.out) / f"precision_{slugify(gpu)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cells, skipped = [], []

    def save():  # after every cell, so that a run killed at its time limit keeps what it measured
        write_json(out, {**meta, "skipped": skipped, "wall_s": time.time() - t0, "cells": cells})

    for name in names:
        if args.time_budget is not None and time.time() - t0 > args.time_budget:
            skipped.append(name)
            continue
        cell = smoke_cell(CELLS[name]) if args.smoke else CELLS[name]
        print(f"== {name}: {cell.title}", flush=True)
        if not args.smoke:
            torch.cuda.reset_peak_memory_stats()
        t_cell = time.time()
        try:
            row = run_cell(torch, lk, mods, name, cell, env)
            row["cell_s"] = time.time() - t_cell
        except Exception as e:  # noqa: BLE001  (inputs or reference that do not fit: the run goes on)
            print(f"  cell failed: {short_err(e)}", flush=True)
            meta.setdefault("cell_errors", {})[name] = short_err(e)
            row = None
        if not args.smoke:
            if row is not None:
                row["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
            safe_cleanup(torch)
        if row is not None:
            cells.append(row)
        save()
    save()
    if skipped:
        print(f"skipped: {', '.join(skipped)}", flush=True)
    print(f"wrote {out}", flush=True)
    print(f"# {gpu}: float32 kernel ms; ratio = ours / the best peer (below 1: ours faster); "
          f"err = max |s - f64| / (|f64| + 1)")
    print("\n".join(table(cells)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
