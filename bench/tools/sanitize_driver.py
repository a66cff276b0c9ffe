"""Small calls through every kernel family, for compute-sanitizer (bench/tools/sanitize.sh runs it).

Families: the forward (float16, bfloat16, float32; padded with masks and lengths, per-query
candidates, packed documents, several short queries per tile, long queries with partial sums,
argmax, odd and split-d dims, the Hopper wgmma tiles and, on Hopper, the same calls again on the
portable mma.sync kernels, unvalidated bad offsets), the backward (atomic and CSR, padded, candidates and packed,
unvalidated out-of-range argmax entries) and the streaming top-k (device and host corpora, several
chunks, k large enough for more than 48 KB of shared memory).

Every input is a small integer, so the GPU must equal the CPU path exactly; a mismatch is
printed and the exit status is 1. Under the sanitizer its own error exit code takes precedence.

    python bench/tools/sanitize_driver.py                   # compile everything and check, no sanitizer
    compute-sanitizer --tool memcheck python bench/tools/sanitize_driver.py --no-pool
    compute-sanitizer --tool racecheck python bench/tools/sanitize_driver.py --no-pool --families forward,topk
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import ml_dtypes
import numpy as np

os.environ.setdefault("LIK_POISON", "1")  # outputs start as garbage: an unwritten element cannot pass
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the repo root

import lik_cupy  # noqa: E402
from lik_cupy._base.device import device_properties  # noqa: E402

NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
FAMILIES = ("forward", "backward", "topk")


def ints(rng, shape, dtype):
    """Small integers: every product and sum is exact in each dtype, so GPU == CPU bit for bit."""
    return rng.integers(-3, 4, size=shape).astype(np.float32).astype(NP[dtype])


def _floats(x: np.ndarray):
    """``x`` as float32 (bfloat16 arrays, and the int16 bits Runner.host gives torch's bfloat16, too),
    or None when it holds no floats."""
    if x.dtype == ml_dtypes.bfloat16:
        return x.astype(np.float32)
    if x.dtype == np.int16:
        return x.view(ml_dtypes.bfloat16).astype(np.float32)
    return x.astype(np.float32) if x.dtype.kind == "f" else None


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays of one shape and item size hold the same bytes, NaNs of any payload alike."""
    fa, fb = _floats(a), _floats(b)
    if fa is not None and fb is not None:
        na, nb = np.isnan(fa), np.isnan(fb)
        if not np.array_equal(na, nb):
            return False
        a, b = a.copy(), b.copy()
        a[na], b[nb] = 0, 0
    return a.tobytes() == b.tobytes()


class Runner:
    def __init__(self, torch):
        import cupy

        self.cupy, self.torch = cupy, torch
        self.checked = self.failed = 0

    def framework(self, *values) -> str | None:
        """CuPy, or torch when a bfloat16 array is among ``values`` (CuPy holds none); None when
        bfloat16 is needed but torch is missing."""
        bf16 = any(isinstance(v, np.ndarray) and v.dtype == ml_dtypes.bfloat16 for v in values)
        return ("torch" if self.torch is not None else None) if bf16 else "cupy"

    def dev(self, x, fw):
        """A device copy of a NumPy array (other values pass through)."""
        if not isinstance(x, np.ndarray):
            return x
        if fw == "torch":
            bf16 = x.dtype == ml_dtypes.bfloat16
            t = self.torch.from_numpy(x.view(np.int16) if bf16 else x).cuda()
            return t.view(self.torch.bfloat16) if bf16 else t
        return self.cupy.asarray(x)

    def host(self, x):
        mod = type(x).__module__.split(".")[0]
        if mod == "torch":  # (NumPy takes no torch bfloat16: its bits, compared as bytes)
            t = x.detach().cpu()
            return t.view(self.torch.int16).numpy() if t.dtype == self.torch.bfloat16 else t.numpy()
        return x.get() if mod == "cupy" else np.asarray(x)

    def compare(self, name, got, want):
        """Bitwise equal results, a NaN matching any NaN."""
        self.cupy.cuda.runtime.deviceSynchronize()
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        ok = len(got) == len(want) and all(
            g.shape == w.shape and g.dtype.itemsize == w.dtype.itemsize and _same_bits(g, w)
            for g, w in ((self.host(g), np.asarray(w)) for g, w in zip(got, want)))
        self.checked += 1
        self.failed += not ok
        print(f"{'ok   ' if ok else 'FAIL '} {name}", flush=True)

    def same(self, name, fn, args, kwargs, gpu_args=None, gpu_kwargs=None):
        """fn on the CPU (NumPy arguments) and on the GPU (device copies of ``gpu_args``/``gpu_kwargs``,
        by default the same arguments): bitwise equal results."""
        gpu_args = args if gpu_args is None else gpu_args
        gpu_kwargs = kwargs if gpu_kwargs is None else gpu_kwargs
        fw = self.framework(*gpu_args, *gpu_kwargs.values())
        if fw is None:
            print(f"skip  {name}: bfloat16 needs torch", flush=True)
            return
        want = fn(*args, **kwargs, backend="cpu")
        got = fn(*(self.dev(a, fw) for a in gpu_args), **{k: self.dev(v, fw) for k, v in gpu_kwargs.items()},
                 backend="gpu")
        self.compare(name, got, want)

    def runs(self, name, fn, args, kwargs):
        """A GPU call whose result is unspecified but must not fault (the sanitizer watches)."""
        fw = self.framework(*args, *kwargs.values())
        if fw is None:
            print(f"skip  {name}: bfloat16 needs torch", flush=True)
            return
        fn(*(self.dev(a, fw) for a in args), **{k: self.dev(v, fw) for k, v in kwargs.items()}, backend="gpu")
        self.cupy.cuda.runtime.deviceSynchronize()
        print(f"ran   {name}", flush=True)


def forward(r: Runner, rng, portable: bool):
    tag = " (portable)" if portable else ""
    os.environ["LIK_DISABLE_WGMMA"] = "1" if portable else ""
    for dtype in ("float16", "bfloat16", "float32"):
        Q, D = ints(rng, (3, 32, 128), dtype), ints(rng, (9, 70, 128), dtype)
        qm, dl = rng.random((3, 32)) < 0.8, rng.integers(0, 71, 9)
        dl[2] = 0
        r.same(f"forward {dtype} padded{tag}", lik_cupy.maxsim, (Q, D), {})
        r.same(f"forward {dtype} q_mask d_lengths argmax{tag}", lik_cupy.maxsim, (Q, D),
               {"q_mask": qm, "d_lengths": dl, "return_argmax": True})
        C, cm = ints(rng, (3, 4, 50, 128), dtype), rng.random((3, 4, 50)) < 0.6
        r.same(f"forward {dtype} candidates d_mask argmax{tag}", lik_cupy.maxsim, (Q, C),
               {"d_mask": cm, "return_argmax": True})
        lens = rng.integers(0, 90, 12)
        lens[[0, 5]] = 0
        off = np.concatenate([[0], np.cumsum(lens)])
        T = ints(rng, (int(off[-1]), 128), dtype)
        r.same(f"forward {dtype} packed argmax{tag}", lik_cupy.maxsim_varlen, (Q, T, off), {"return_argmax": True})
        Qm = ints(rng, (8, 16, 64), dtype)
        r.same(f"forward {dtype} 8 short queries per tile argmax{tag}", lik_cupy.maxsim,
               (Qm, ints(rng, (10, 40, 64), dtype)), {"return_argmax": True})
        r.same(f"forward {dtype} 8 short queries packed{tag}", lik_cupy.maxsim_varlen, (Qm, T[:, :64].copy(), off), {})
        r.same(f"forward {dtype} long query (partial sums){tag}", lik_cupy.maxsim,
               (ints(rng, (1, 300, 128), dtype), D), {"d_lengths": dl})
        r.same(f"forward {dtype} odd dim 20{tag}", lik_cupy.maxsim,
               (ints(rng, (2, 20, 20), dtype), ints(rng, (5, 33, 20), dtype)), {"return_argmax": True})
        r.same(f"forward {dtype} split-d dim 1000 argmax{tag}", lik_cupy.maxsim,
               (ints(rng, (2, 70, 1000), dtype), ints(rng, (4, 30, 1000), dtype)), {"return_argmax": True})
        if dtype != "float32":  # the Hopper wgmma tiles: 16-bit, more than 64 query rows, aligned rows
            Qh = ints(rng, (2, 128, 128), dtype)
            r.same(f"forward {dtype} 128-row tile (wgmma on sm_90) argmax{tag}", lik_cupy.maxsim, (Qh, D),
                   {"d_lengths": dl, "return_argmax": True})
            r.same(f"forward {dtype} 128-row tile packed{tag}", lik_cupy.maxsim_varlen, (Qh, T, off), {})
            r.same(f"forward {dtype} split-d wgmma dim 384{tag}", lik_cupy.maxsim,
                   (ints(rng, (1, 100, 384), dtype), ints(rng, (5, 40, 384), dtype)), {"return_argmax": True})
            r.same(f"forward {dtype} 3 queries of 40 rows per tile{tag}", lik_cupy.maxsim,
                   (ints(rng, (6, 40, 128), dtype), D), {})
            # One query against a few long documents: cut over CTAs by token shares, pieces merged.
            lens = np.array([0, 3000, 17, 0, 2500, 400])
            offl = np.concatenate([[0], np.cumsum(lens)])
            r.same(f"forward {dtype} packed documents split over CTAs argmax{tag}", lik_cupy.maxsim_varlen,
                   (Q[:1], ints(rng, (int(offl[-1]), 128), dtype), offl), {"return_argmax": True})
    Q, T = ints(rng, (2, 16, 64), "float16"), ints(rng, (30, 64), "float16")
    for bad in ([0, 5, 3, 31], [2, 10, 20, 30], [0, 10, 20, 10**6], [-7, 4, 9, 30]):
        r.runs(f"forward unvalidated bad offsets {bad}{tag}", lik_cupy.maxsim_varlen,
               (Q, T, np.array(bad, np.int64)), {"validate_offsets": False})
    Q1, T1 = ints(rng, (1, 32, 128), "float16"), ints(rng, (6000, 128), "float16")
    for bad in ([0, 5000, 300, 6000], [0, 10**6, 2, 6000], [-50, 3000, 2999, 6000], [0, 6000, 0, 6000]):
        r.runs(f"forward unvalidated bad offsets, documents split over CTAs {bad}{tag}", lik_cupy.maxsim_varlen,
               (Q1, T1, np.array(bad, np.int64)), {"validate_offsets": False})
    os.environ["LIK_DISABLE_WGMMA"] = ""


def backward(r: Runner, rng):
    for dtype in ("float16", "bfloat16", "float32"):
        for method in ("atomic", "csr"):
            for dim in (128, 20):
                Q, D = ints(rng, (3, 24, dim), dtype), ints(rng, (7, 40, dim), dtype)
                _, am = lik_cupy.maxsim(Q, D, return_argmax=True, backend="cpu")
                g = ints(rng, (3, 7), "float32")
                r.same(f"backward {dtype} {method} d={dim} padded", lik_cupy.maxsim_backward, (g, Q, D, am),
                       {"method": method})
            C = ints(rng, (3, 5, 30, 64), dtype)
            Qc = ints(rng, (3, 24, 64), dtype)
            _, am = lik_cupy.maxsim(Qc, C, return_argmax=True, backend="cpu")
            r.same(f"backward {dtype} {method} candidates", lik_cupy.maxsim_backward,
                   (ints(rng, (3, 5), "float32"), Qc, C, am), {"method": method})
            lens = rng.integers(0, 50, 8)
            off = np.concatenate([[0], np.cumsum(lens)])
            T = ints(rng, (int(off[-1]), 64), dtype)
            _, am = lik_cupy.maxsim_varlen(Qc, T, off, return_argmax=True, backend="cpu")
            g = ints(rng, (3, 8), "float32")
            r.same(f"backward {dtype} {method} packed", lik_cupy.maxsim_backward, (g, Qc, T, am),
                   {"d_offsets": off, "method": method})
            # Out-of-range entries, unvalidated: the GPU adds nothing of them to dD and makes their query
            # tokens' dQ rows NaN (maxsim_backward's NaN contract); elsewhere the CPU's values, with
            # those entries -1 there (the CPU path checks every call).
            bad = am.copy()
            bad[0, :, :3], bad[1, 2, 5], bad[2, 3, 0] = 10**6, -(2**31), int(lens[3])
            invalid = (bad < 0) | (bad >= lens[:, None])
            fixed = np.where(invalid, -1, bad).astype(np.int32)
            fw = r.framework(Qc)
            if fw is None:
                continue
            dq, dd = lik_cupy.maxsim_backward(g, Qc, T, fixed, d_offsets=off, method=method, backend="cpu")
            dq = dq.copy()
            dq[(invalid & (bad != -1)).any(axis=1)] = np.nan
            r.compare(f"backward {dtype} {method} packed, unvalidated bad argmax",
                      lik_cupy.maxsim_backward(*(r.dev(x, fw) for x in (g, Qc, T, bad)), d_offsets=r.dev(off, fw),
                                               method=method, validate=False, backend="gpu"), (dq, dd))


def topk(r: Runner, rng):
    for dtype in ("float16", "bfloat16", "float32"):
        Q = ints(rng, (3, 20, 64), dtype)
        lens = rng.integers(0, 30, 4500)
        off = np.concatenate([[0], np.cumsum(lens)])
        T = ints(rng, (int(off[-1]), 64), dtype)
        r.same(f"top-k {dtype} device corpus k=10", lik_cupy.retrieve, (Q, T, 10), {"d_offsets": off})
        r.same(f"top-k {dtype} device corpus k=4096 (48 KB of shared memory)", lik_cupy.retrieve, (Q, T, 4096),
               {"d_offsets": off})
        D, dl = ints(rng, (300, 25, 64), dtype), rng.integers(0, 26, 300)
        r.same(f"top-k {dtype} padded d_lengths", lik_cupy.retrieve, (Q, D, 7), {"d_lengths": dl})
        # Host corpora stream through pinned buffers on a second stream; a small budget makes
        # many chunks, each merged into the running top-k.
        fw = r.framework(Q)
        if fw is None:
            continue
        want = lik_cupy.retrieve(Q, D, 7, d_lengths=dl, backend="cpu")
        r.compare(f"top-k {dtype} host padded corpus in chunks",
                  lik_cupy.retrieve(r.dev(Q, fw), D, 7, d_lengths=dl, max_gpu_bytes=1 << 18, backend="gpu"), want)
        want = lik_cupy.retrieve(Q, [(T, off), D], 9, backend="cpu")
        r.compare(f"top-k {dtype} host shards in chunks",
                  lik_cupy.retrieve(r.dev(Q, fw), [(T, off), D], 9, max_gpu_bytes=1 << 20, backend="gpu"), want)
        # Corpus.search's repeat path: from the second call of a signature on, the merge is launched by
        # kernel handle, the corpus's integer ids written by its last launch (two launches at k = 10,
        # one at 4,096)
        ids = np.arange(off.size - 1, dtype=np.int64) * 3 + 7
        for k in (10, 4096):
            want = lik_cupy.Corpus(T, d_offsets=off, ids=ids, device="cpu").search(Q, k)
            corpus = lik_cupy.Corpus(r.dev(T, fw), d_offsets=r.dev(off, fw), ids=ids)
            for call in ("first", "repeat"):
                r.compare(f"Corpus.search {dtype} k={k}, {call} call", corpus.search(r.dev(Q, fw), k), want)


_PLANTED = r"""
extern "C" __global__ void planted_oob(float* x, int n) { x[n + threadIdx.x] = 1.0f; }  // past the end
extern "C" __global__ void planted_race(float* out) {
    __shared__ float s[64];
    s[threadIdx.x] = threadIdx.x;
    out[threadIdx.x] = s[(threadIdx.x + 32) % 64];  // the other warp's element, with no barrier between
}
"""


def planted(tool: str) -> None:
    """A deliberate error of the kind ``tool`` finds: the sanitizer must report it, which shows it
    watches kernels loaded the way this library loads them (a run of 0 errors then means something)."""
    import cupy

    mod = cupy.RawModule(code=_PLANTED)
    x = cupy.zeros(256, cupy.float32)
    if tool == "memcheck":
        mod.get_function("planted_oob")((1,), (64,), (x, np.int32(x.size)))
    else:
        mod.get_function("planted_race")((1,), (64,), (x,))
    cupy.cuda.runtime.deviceSynchronize()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated subset of {', '.join(FAMILIES)}")
    p.add_argument("--no-pool", action="store_true",
                   help="allocate every buffer with its own cudaMalloc (CuPy's pool off), so memcheck sees each "
                        "array's exact bounds instead of a pooled block's")
    p.add_argument("--planted", choices=("memcheck", "racecheck"),
                   help="run only a deliberate error that this sanitizer tool must report")
    args = p.parse_args(argv)
    import cupy

    if args.no_pool:
        cupy.cuda.set_allocator(None)
        cupy.cuda.set_pinned_memory_allocator(None)
    if args.planted:
        planted(args.planted)
        return 0
    try:
        import torch
    except ImportError:
        torch = None
    r = Runner(torch)
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    fams = args.families.split(",")
    if "forward" in fams:
        forward(r, rng, portable=False)
        if device_properties(cupy.cuda.runtime.getDevice()).cc == 90:
            forward(r, rng, portable=True)  # the mma.sync kernels the Hopper path otherwise hides
    if "backward" in fams:
        backward(r, rng)
    if "topk" in fams:
        topk(r, rng)
    print(f"{r.checked} checks, {r.failed} mismatches, {time.perf_counter() - t0:.1f} s")
    return 1 if r.failed else 0


if __name__ == "__main__":
    sys.exit(main())
