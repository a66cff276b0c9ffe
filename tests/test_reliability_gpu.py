"""Reliability on the GPU (docs/reliability.md maps each promise to its test here):

* scale: a packed corpus of 20 million tokens at d=128 (2.56e9 elements) and an argmax of more than
  2**31 entries, checked at their far ends against float64 (skipped when the GPU lacks the memory);
* concurrency: threads on their own CuPy or PyTorch streams, and on two GPUs, get bitwise the serial
  results; a cold start compiles each kernel once however many threads ask at once;
* long-running use: 10,000 mixed calls leave CuPy's pool, PyTorch's allocator, host RSS and the
  kernel caches flat after warm-up;
* faults: a failed launch names the kernel and the shapes and the library keeps working; a request
  too large for the GPU raises a MemoryError naming the buffer, its size and what to do;
* determinism: forward results (scores and argmax, INT8 included), retrieve, the CSR backward and the
  atomic backward's dQ are bitwise identical run to run, in this process and in a fresh one.

Everything but the scale tests uses small shapes; the file takes about a minute on an H100 or H200.
``LIK_RELIABILITY_JSON=<file or directory>`` writes the measured figures there as JSON
(a directory gets ``reliability_<gpu>.json``, the name bench/results/latest uses).
"""

from __future__ import annotations

import collections
import datetime
import gc
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import lik_cupy
from threads import run_threads

pytestmark = pytest.mark.gpu
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX, if a test imports it, takes no 75% share

FIGURES: dict = {}  # what the tests measured, written to LIK_RELIABILITY_JSON at the end


@pytest.fixture(scope="module", autouse=True)
def _write_figures():
    yield
    target = os.environ.get("LIK_RELIABILITY_JSON")
    if not target or not FIGURES:
        return
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    path = pathlib.Path(target)
    if path.is_dir():
        path = path / f"reliability_{re.sub(r'[^a-z0-9]+', '-', name.lower()).strip('-')}.json"
    path.write_text(json.dumps({
        "gpu": name, "compute_capability": f"{props['major']}.{props['minor']}",
        "memory_bytes": int(props["totalGlobalMem"]), "driver": cupy.cuda.runtime.driverGetVersion(),
        "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(), "cupy": cupy.__version__,
        "torch": getattr(sys.modules.get("torch"), "__version__", None),
        "jax": getattr(sys.modules.get("jax"), "__version__", None), "lik_cupy": lik_cupy.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "results": FIGURES,
    }, indent=1, default=float) + "\n")


def _free_bytes() -> int:
    import cupy

    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    return cupy.cuda.runtime.memGetInfo()[0]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _jax():
    try:
        import jax
    except ImportError:
        return None
    return jax if any(d.platform == "gpu" for d in jax.devices()) else None


def _host(x):
    """Host NumPy copy of any result (bfloat16 as its uint16 bits, for bitwise comparison)."""
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        t = x.detach().cpu()
        return t.view(sys.modules["torch"].int16).numpy() if t.dtype == sys.modules["torch"].bfloat16 else t.numpy()
    a = x.get() if mod == "cupy" else np.asarray(x)
    return a.view(np.uint16) if a.dtype.name == "bfloat16" else a


def _hosts(out) -> tuple:
    return tuple(_host(x) for x in (out if isinstance(out, tuple) else (out,)))


def _bitwise_equal(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
                                    for x, y in zip(a, b))


def _ref(q, d):
    """float64 scores [Nq] and similarity [Nq, Lq, Ld] of queries q [Nq, Lq, dim] against one document d [Ld, dim]."""
    sim = np.einsum("isk,tk->ist", q.astype(np.float64), d.astype(np.float64))
    return sim.max(axis=2).sum(axis=1), sim


def _check_docs(q, tokens_of, scores, amax, docs, what):
    """Scores and argmax of ``docs`` (their tokens from ``tokens_of(j)``) against float64; returns the
    largest relative score error."""
    worst = 0.0
    for j in docs:
        d = tokens_of(j)
        ref, sim = _ref(q, d)
        got = scores[:, j].astype(np.float64)
        err = np.abs(got - ref) / (np.abs(ref) + 1)
        assert (err < 2e-5).all(), (what, j, got, ref)
        worst = max(worst, float(err.max()))
        a = amax[:, j]
        assert ((a >= 0) & (a < len(d))).all(), (what, j)
        picked = np.take_along_axis(sim, a[..., None].astype(np.int64), 2)[..., 0]
        best = sim.max(axis=2)
        assert (picked >= best - 1e-5 * (np.abs(best) + 1)).all(), (what, j)  # the winner is a maximum
    return worst


def _timed(call):
    """call() twice (the first compiles its kernels): the second result and its wall time in
    seconds, device work included."""
    import cupy

    call()
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    out = call()
    cupy.cuda.Device().synchronize()
    return out, time.perf_counter() - t0


# ---------------------------------------------------------------- scale: past 2**31 elements


def test_20m_token_packed_corpus_scores_its_last_documents_right():
    """20,000,000 tokens x 128 (2.56e9 elements, 5.1 GB fp16), packed and as a padded view: the first
    and last documents (element offsets past 2**31) match float64, argmax included, and retrieve ranks
    a document planted at the very end first."""
    import cupy

    if _free_bytes() < 12 << 30:
        pytest.skip("needs about 12 GB of free GPU memory")
    t_start = time.perf_counter()
    T, dim, lq = 20_000_000, 128, 32
    rng = np.random.default_rng(20)
    lens = rng.integers(16, 301, size=T // 150)
    ends = np.cumsum(lens)
    lens = lens[: np.searchsorted(ends, T - 1000)]
    lens = np.append(lens, T - lens.sum())  # the last document: at least 1000 tokens ending at T
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    nd = lens.size
    D = cupy.empty((T, dim), cupy.float16)
    gen = cupy.random.default_rng(20)
    for a in range(0, T, 1 << 21):  # 1 GB of float32 at a time
        D[a:a + (1 << 21)] = gen.standard_normal((min(1 << 21, T - a), dim), dtype=cupy.float32).astype(cupy.float16)
    Q = gen.standard_normal((2, lq, dim), dtype=cupy.float32).astype(cupy.float16)
    D[int(off[-2]):int(off[-2]) + lq] = Q[1]  # query 1 planted at the start of the last document
    off_d = cupy.asarray(off)
    cupy.cuda.Device().synchronize()

    (scores, amax), t_varlen = _timed(lambda: lik_cupy.maxsim_varlen(Q, D, off_d, return_argmax=True))
    q = Q.get()
    checked = [0, 1, 2, nd - 3, nd - 2, nd - 1]
    s_h = scores[:, checked].get()
    a_h = amax[:, checked].get()
    err = _check_docs(q, lambda k: D[int(off[checked[k]]):int(off[checked[k] + 1])].get(), s_h, a_h,
                      range(len(checked)), "packed")
    assert int(off[-2]) * dim > 2**31  # the last document really lies past 2**31 elements

    (top_s, top_i), t_retrieve = _timed(lambda: lik_cupy.retrieve(Q, D, 5, d_offsets=off_d))
    assert int(top_i[1, 0]) == nd - 1 and abs(float(top_s[1, 0]) - float(scores[1, nd - 1])) <= 1e-5 * float(top_s[1, 0])

    ld = 160  # the same tokens as padded documents [125000, 160, 128]
    pad = D.reshape(T // ld, ld, dim)
    (ps, pa), t_padded = _timed(lambda: lik_cupy.maxsim(Q, pad, return_argmax=True))
    last = [0, T // ld - 2, T // ld - 1]
    err = max(err, _check_docs(q, lambda k: pad[last[k]].get(), ps[:, last].get(), pa[:, last].get(), range(3),
                               "padded"))
    FIGURES["largest_corpus"] = {
        "tokens": T, "dim": dim, "dtype": "float16", "bytes": int(D.nbytes), "documents": int(nd),
        "last_element_offset": int(off[-1]) * dim, "queries": 2, "query_tokens": lq,
        "maxsim_varlen_argmax_s": t_varlen, "retrieve_top5_s": t_retrieve, "maxsim_padded_argmax_s": t_padded,
        "documents_checked_against_float64": len(checked) + len(last), "max_rel_err": err,
        "test_s": time.perf_counter() - t_start,
    }


def test_argmax_of_more_than_2_31_entries():
    """An argmax [2, 1.1M, 1024] (2.25e9 int32 entries, 9 GB) is supported: the entries past 2**31
    are right."""
    import cupy

    if _free_bytes() < 12 << 30:
        pytest.skip("needs about 12 GB of free GPU memory")
    nq, lq, nd, ld, dim = 2, 1024, 1_100_000, 4, 16
    gen = cupy.random.default_rng(31)
    Q = gen.standard_normal((nq, lq, dim), dtype=cupy.float32).astype(cupy.float16)
    D = gen.standard_normal((nd, ld, dim), dtype=cupy.float32).astype(cupy.float16)
    (scores, amax), elapsed = _timed(lambda: lik_cupy.maxsim(Q, D, return_argmax=True))
    assert amax.size > 2**31 and amax.shape == (nq, nd, lq)
    docs = [0, nd - 2, nd - 1]
    err = _check_docs(Q.get(), lambda k: D[docs[k]].get(), scores[:, docs].get(), amax[:, docs].get(), range(3),
                      "argmax > 2**31")
    FIGURES["largest_argmax"] = {"entries": int(amax.size), "bytes": int(amax.nbytes), "shape": list(amax.shape),
                                 "maxsim_argmax_s": elapsed, "max_rel_err": err}


def test_counts_within_a_tile_or_run_of_2_31_are_refused():
    """Nd = 2**31 - 1 padded documents (4 GB at d = 1 in fp16) are refused with a ValueError naming Nd:
    the plan's last CTA took a run of documents past 2**31 - 1 in the kernel's int and never wrote the
    last score. So is D of 2**31 - 1 tokens a document, masked with a hole, naming Ld: its last tile's
    int token indices went past 2**31 - 1 and read the mask 2 GB before its start."""
    import cupy

    if _free_bytes() < 16 << 30:
        pytest.skip("needs about 16 GB of free GPU memory")
    n = 2**31 - 1
    Q = cupy.ones((1, 1, 1), cupy.float16)
    D = cupy.ones((n, 1, 1), cupy.float16)
    with pytest.raises(ValueError, match=r"Nd \+ \d+ \(a CTA's run of documents past the last\) = \d+ does not fit"):
        lik_cupy.maxsim(Q, D)
    del D
    mask = cupy.ones((1, n), bool)
    mask[0, 5] = False
    D = cupy.ones((1, n, 1), cupy.float16)
    with pytest.raises(ValueError, match=r"Ld \+ 1024 \(a tile's tokens past the last\) = 2147484671 does not fit"):
        lik_cupy.maxsim(Q, D, d_mask=mask)
    short = lik_cupy.maxsim(Q, cupy.ascontiguousarray(D[:, :1000]), d_mask=cupy.ascontiguousarray(mask[:, :1000]))
    assert float(short[0, 0]) == 1.0  # the library still works
    # Ld = 2**31 through the general path (strict validation): refused before the mask spans' launch,
    # whose int parameter could not hold it (a struct.error saying nothing of Ld)
    del D, mask
    mask = cupy.ones((1, n + 1), bool)
    D = cupy.ones((1, n + 1, 1), cupy.float16)
    with pytest.raises(ValueError, match=r"Ld \+ 1024 \(a tile's tokens past the last\) = 2147484672 does not fit"):
        lik_cupy.maxsim(Q, D, d_mask=mask, validate=True)


# ---------------------------------------------------------------- concurrency


def _cupy_jobs(seed=0):
    """name -> call on CuPy arrays covering every kernel family (each returns host copies)."""
    import cupy

    rng = np.random.default_rng(seed)

    def arr(*shape, dt=np.float16):
        return cupy.asarray(rng.standard_normal(shape).astype(dt))

    Q, D = arr(4, 40, 128), arr(60, 90, 128)
    dmask = cupy.asarray(rng.random((60, 90)) < 0.8)
    Qf, Df = arr(3, 33, 96, dt=np.float32), arr(20, 50, 96, dt=np.float32)
    dlen = cupy.asarray(rng.integers(0, 51, 20))
    Qm, Dm = arr(32, 16, 64), arr(100, 70, 64)
    Ql = arr(2, 300, 128)
    lens = rng.integers(0, 120, 200)
    off = cupy.asarray(np.concatenate([[0], np.cumsum(lens)]))
    T = arr(int(lens.sum()), 128)
    Qw, Dw = arr(2, 20, 1000), arr(10, 30, 1000)
    g = arr(4, 60, dt=np.float32)
    _, a = lik_cupy.maxsim(Q, D, d_mask=dmask, return_argmax=True)
    cupy.cuda.Device().synchronize()
    return {
        "maxsim fp16 d_mask argmax": lambda: _hosts(lik_cupy.maxsim(Q, D, d_mask=dmask, return_argmax=True)),
        "maxsim fp32 d_lengths": lambda: _hosts(lik_cupy.maxsim(Qf, Df, d_lengths=dlen)),
        "maxsim 32 short queries": lambda: _hosts(lik_cupy.maxsim(Qm, Dm, return_argmax=True)),
        "maxsim long query": lambda: _hosts(lik_cupy.maxsim(Ql, D)),
        "maxsim split-d 1000": lambda: _hosts(lik_cupy.maxsim(Qw, Dw, return_argmax=True)),
        "maxsim_pairs": lambda: _hosts(lik_cupy.maxsim_pairs(Q, D[:4])),
        "maxsim_varlen argmax": lambda: _hosts(lik_cupy.maxsim_varlen(Q, T, off, return_argmax=True)),
        "retrieve": lambda: _hosts(lik_cupy.retrieve(Q, T, 7, d_offsets=off)),
        "maxsim_backward csr": lambda: _hosts(lik_cupy.maxsim_backward(g, Q, D, a, method="csr")),
    }


def _threads_match_serial(jobs, n_threads, rounds, stream_of):
    serial = {name: fn() for name, fn in jobs.items()}
    mismatches, calls = [], collections.Counter()

    def work(k):
        names = list(jobs)
        with stream_of(k):
            for r in range(rounds):
                for name in names[k % len(names):] + names[:k % len(names)]:  # each thread its own order
                    calls[k] += 1
                    if not _bitwise_equal(jobs[name](), serial[name]):
                        mismatches.append((k, r, name))

    t0 = time.perf_counter()
    run_threads(n_threads, work)
    assert not mismatches, mismatches[:5]
    return {"threads": n_threads, "calls": sum(calls.values()), "kinds": sorted(jobs),
            "s": time.perf_counter() - t0, "bitwise_equal_to_serial": True}


def test_threads_on_their_own_cupy_streams_match_serial():
    import cupy

    FIGURES["threads_cupy_streams"] = _threads_match_serial(
        _cupy_jobs(), 8, 4, lambda k: cupy.cuda.Stream(non_blocking=True))


def test_threads_on_their_own_torch_streams_match_serial():
    torch = _torch()
    if torch is None:
        pytest.skip("needs PyTorch with CUDA")
    gen = torch.Generator(device="cuda").manual_seed(1)

    def t(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", generator=gen).to(dtype)

    Q, D, C = t(4, 40, 128), t(60, 90, 128), t(4, 12, 70, 128, dtype=torch.float16)
    Qc = t(4, 40, 128, dtype=torch.float16)
    dl = torch.randint(0, 91, (60,), device="cuda", generator=gen)
    lens = torch.randint(0, 100, (150,), device="cuda", generator=gen)
    off = torch.cat([torch.zeros(1, dtype=torch.int64, device="cuda"), lens.cumsum(0)])
    T = t(int(off[-1]), 128)
    _, a = lik_cupy.maxsim(Q, D, return_argmax=True)
    g = torch.randn(4, 60, device="cuda", generator=gen)
    torch.cuda.synchronize()
    jobs = {
        "maxsim bf16 d_lengths argmax": lambda: _hosts(lik_cupy.maxsim(Q, D, d_lengths=dl, return_argmax=True)),
        "maxsim fp16 candidates": lambda: _hosts(lik_cupy.maxsim(Qc, C)),
        "maxsim_varlen bf16": lambda: _hosts(lik_cupy.maxsim_varlen(Q, T, off, return_argmax=True)),
        "retrieve bf16": lambda: _hosts(lik_cupy.retrieve(Q, T, 5, d_offsets=off)),
        "maxsim_backward csr": lambda: _hosts(lik_cupy.maxsim_backward(g, Q, D, a, method="csr")),
    }
    FIGURES["threads_torch_streams"] = _threads_match_serial(
        jobs, 8, 4, lambda k: torch.cuda.stream(torch.cuda.Stream()))


def test_two_gpus_at_once_match_serial():
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    jobs, serial = {}, {}
    for dev in (0, 1):
        with cupy.cuda.Device(dev):
            jobs[dev] = _cupy_jobs(seed=5)  # the same inputs on each GPU
            serial[dev] = {name: fn() for name, fn in jobs[dev].items()}
    mismatches = []

    def work(k):
        dev = k % 2
        with cupy.cuda.Device(dev), cupy.cuda.Stream(non_blocking=True):
            for _ in range(3):
                for name, fn in jobs[dev].items():
                    if not _bitwise_equal(fn(), serial[dev][name]):
                        mismatches.append((dev, name))

    run_threads(8, work)
    assert not mismatches, mismatches[:5]
    names = {cupy.cuda.runtime.getDeviceProperties(d)["name"] for d in (0, 1)}
    if len(names) == 1:  # the same model: the same kernels, so the same bits
        assert all(_bitwise_equal(serial[0][n], serial[1][n]) for n in serial[0])
    FIGURES["two_gpus"] = {"threads": 8, "calls_per_thread": 3 * len(jobs[0]), "bitwise_equal_to_serial": True}


class _Counted:
    def __init__(self, fn):
        self.fn, self.calls, self._lock = fn, 0, threading.Lock()

    def __call__(self, *a, **kw):
        with self._lock:
            self.calls += 1
        return self.fn(*a, **kw)


def test_cold_start_from_many_threads_compiles_each_kernel_once(tmp_path, monkeypatch):
    import cupy

    from lik_cupy._runtime import launch

    from lik_cupy._runtime import nvrtc as lc

    from lik_cupy._base.cache import DeviceCache

    monkeypatch.setenv("LIK_CACHE_DIR", str(tmp_path))  # an empty disk cache
    monkeypatch.setattr(lc, "_modules", DeviceCache(lc._MEMORY_CACHE_SIZE, lru=True))
    monkeypatch.setattr(launch, "_kernels", DeviceCache(4096))
    nvrtc = _Counted(lc.nvrtc_compile)
    monkeypatch.setattr(lc, "nvrtc_compile", nvrtc)
    rng = np.random.default_rng(3)
    Q = cupy.asarray(rng.standard_normal((2, 24, 128)).astype(np.float16))
    D = cupy.asarray(rng.standard_normal((40, 77, 128)).astype(np.float16))
    out = [None] * 16

    def work(k):
        out[k] = _hosts(lik_cupy.maxsim(Q, D, return_argmax=bool(k % 2)))

    t0 = time.perf_counter()
    run_threads(16, work)
    assert nvrtc.calls == 2  # two kernels (with and without argmax), sixteen callers
    assert all(_bitwise_equal(out[k], out[k % 2]) for k in range(16))
    FIGURES["cold_start"] = {"threads": 16, "kernels": 2, "nvrtc_compiles": nvrtc.calls,
                             "s": time.perf_counter() - t0}


# ---------------------------------------------------------------- long-running use


def _templates(rng):
    """Small calls of every kind: frameworks, dtypes, masks/lengths, padded/packed, argmax,
    retrieve (device and host corpora) and the backward. Inputs are made once."""
    import cupy

    torch, jax = _torch(), _jax()
    fws = ["cupy", "numpy"] + (["torch"] if torch else []) + (["jax"] if jax else [])

    def conv(fw, x):
        x = np.asarray(x)
        bf16 = x.dtype.name == "bfloat16"
        if fw == "cupy":
            return cupy.asarray(x)
        if fw == "torch":
            t = torch.from_numpy(x.view(np.int16) if bf16 else x).cuda()
            return t.view(torch.bfloat16) if bf16 else t
        if fw == "jax":
            gpu = next(d for d in jax.devices() if d.platform == "gpu")
            return jax.device_put(jax.numpy.asarray(x.astype(np.float32)).astype(x.dtype) if bf16 else x, gpu)
        return x

    import ml_dtypes

    dts = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
    kinds = ("maxsim", "maxsim q_mask", "maxsim d_lengths argmax", "candidates", "pairs", "varlen",
             "varlen argmax", "retrieve", "retrieve shards", "backward") + (
             ("int8", "int8 varlen argmax") if hasattr(lik_cupy, "maxsim_int8") else ())
    out = []
    for i in range(len(kinds) * len(fws) * 2):
        fw, kind = fws[i % len(fws)], kinds[(i // len(fws)) % len(kinds)]
        dtype = ("float16", "bfloat16", "float32")[i % 3]
        if fw in ("cupy", "numpy") and dtype == "bfloat16":
            dtype = "float16"  # CuPy holds no bfloat16 array: the bfloat16 calls come from torch and JAX
        dim = (16, 64, 128)[i % 3]
        nq, lq, nd, ld = int(rng.integers(1, 5)), int(rng.integers(1, 41)), int(rng.integers(1, 21)), int(rng.integers(1, 51))

        def a(*shape, _dt=dtype, _fw=fw):
            return conv(_fw, rng.standard_normal(shape).astype(np.float32).astype(dts[_dt]))

        Q, D = a(nq, lq, dim), a(nd, ld, dim)
        lens = rng.integers(0, 60, nd)
        off_np = np.concatenate([[0], np.cumsum(lens)])
        T, off = a(int(off_np[-1]), dim), conv(fw, off_np)
        if kind == "maxsim":
            call = lambda Q=Q, D=D: lik_cupy.maxsim(Q, D)  # noqa: E731
        elif kind == "maxsim q_mask":
            qm = conv(fw, rng.random((nq, lq)) < 0.7)
            call = lambda Q=Q, D=D, qm=qm: lik_cupy.maxsim(Q, D, q_mask=qm)  # noqa: E731
        elif kind == "maxsim d_lengths argmax":
            dl = conv(fw, rng.integers(0, ld + 1, nd))
            call = lambda Q=Q, D=D, dl=dl: lik_cupy.maxsim(Q, D, d_lengths=dl, return_argmax=True)  # noqa: E731
        elif kind == "candidates":
            C = a(nq, 5, ld, dim)
            call = lambda Q=Q, C=C: lik_cupy.maxsim(Q, C)  # noqa: E731
        elif kind == "pairs":
            P = a(nq, ld, dim)
            call = lambda Q=Q, P=P: lik_cupy.maxsim_pairs(Q, P, return_argmax=True)  # noqa: E731
        elif kind == "varlen":
            call = lambda Q=Q, T=T, off=off: lik_cupy.maxsim_varlen(Q, T, off)  # noqa: E731
        elif kind == "varlen argmax":
            call = lambda Q=Q, T=T, off=off: lik_cupy.maxsim_varlen(Q, T, off, return_argmax=True)  # noqa: E731
        elif kind == "retrieve":
            call = lambda Q=Q, T=T, off=off: lik_cupy.retrieve(Q, T, 3, d_offsets=off)  # noqa: E731
        elif kind == "retrieve shards":
            host = (_host(T).view(dts[dtype]) if fw != "numpy" else T, off_np)  # a host shard: streamed
            call = lambda Q=Q, D=D, host=host: lik_cupy.retrieve(Q, [D, host], 4)  # noqa: E731
        elif kind == "int8":
            Di, ds = lik_cupy.quantize_int8(D)
            call = lambda Q=Q, Di=Di, ds=ds: lik_cupy.maxsim_int8(Q, Di, ds)  # noqa: E731
        elif kind == "int8 varlen argmax":
            Ti, ts = lik_cupy.quantize_int8(T)
            call = lambda Q=Q, Ti=Ti, ts=ts, off=off: lik_cupy.maxsim_int8_varlen(Q, Ti, ts, off,  # noqa: E731
                                                                                 return_argmax=True)
        else:
            _, am = lik_cupy.maxsim(Q, D, return_argmax=True)
            g = conv(fw, rng.standard_normal((nq, nd)).astype(np.float32))
            method = ("atomic", "csr")[i % 2]
            call = lambda g=g, Q=Q, D=D, am=am, m=method: lik_cupy.maxsim_backward(g, Q, D, am, method=m)  # noqa: E731
        out.append((f"{kind} {fw} {dtype} d={dim}", call))
    return out


def _memory(torch):
    import cupy

    cupy.cuda.Device().synchronize()
    gc.collect()
    pool = cupy.get_default_memory_pool()
    return {"cupy_pool_used": pool.used_bytes(), "cupy_pool_total": pool.total_bytes(), "rss": _rss_bytes(),
            "torch_allocated": torch.cuda.memory_allocated() if torch else 0}


def test_10000_mixed_calls_leave_memory_and_caches_flat():
    """After warm-up, 10,000 calls leave CuPy's used bytes where they were (at most 1 MiB over), its
    pool within 64 MiB, PyTorch's allocated bytes unchanged, host RSS within 64 MiB (at most 16 MiB
    over the second 5,000 calls, i.e. under ~3 KB per call) and the kernel caches unchanged."""
    import concurrent.futures

    from lik_cupy._runtime import launch

    from lik_cupy._runtime import nvrtc as lc


    torch = _torch()
    calls = _templates(np.random.default_rng(10))
    with concurrent.futures.ThreadPoolExecutor(16) as ex:  # first calls compile, several kernels at once
        list(ex.map(lambda c: c[1](), calls))
    for _ in range(3):
        for _, call in calls:
            call()
    base = _memory(torch)
    caches = (len(lc._modules), len(launch._kernels))
    series = []
    t0 = time.perf_counter()
    n = 10_000
    for k in range(n):
        calls[k % len(calls)][1]()
        if (k + 1) % 2500 == 0:
            series.append({"calls": k + 1, **_memory(torch)})
    elapsed = time.perf_counter() - t0
    end, half = series[-1], series[1]
    FIGURES["long_running"] = {
        "calls": n, "distinct_calls": len(calls), "kinds": sorted({c[0].split(" ")[0] for c in calls}),
        "frameworks": sorted({c[0].split(" ")[-3] for c in calls}), "s": elapsed, "calls_per_s": n / elapsed,
        "after_warmup": base, "checkpoints": series, "kernel_cache_entries": {"compile": caches[0], "forward": caches[1]},
        "bounds": {"cupy_pool_used": 1 << 20, "cupy_pool_total": 64 << 20, "torch_allocated": 0,
                   "rss": 64 << 20, "rss_second_half": 16 << 20},
    }
    assert end["cupy_pool_used"] - base["cupy_pool_used"] <= 1 << 20, (base, end)
    assert end["cupy_pool_total"] - base["cupy_pool_total"] <= 64 << 20, (base, end)
    assert end["torch_allocated"] == base["torch_allocated"], (base, end)
    assert end["rss"] - base["rss"] <= 64 << 20 and end["rss"] - half["rss"] <= 16 << 20, series
    assert (len(lc._modules), len(launch._kernels)) == caches and caches[0] <= lc._MEMORY_CACHE_SIZE


# ---------------------------------------------------------------- determinism


def determinism_digests() -> dict:
    """sha256 of the outputs of a fixed set of calls (seeded inputs), for comparison within a
    process and with a fresh one."""
    import cupy

    rng = np.random.default_rng(7)

    def arr(*shape, dt=np.float16):
        return cupy.asarray(rng.standard_normal(shape).astype(dt))

    Q, D = arr(3, 100, 128), arr(50, 130, 128)
    dmask = cupy.asarray(rng.random((50, 130)) < 0.7)
    lens = rng.integers(0, 200, 80)
    off = cupy.asarray(np.concatenate([[0], np.cumsum(lens)]))
    T = arr(int(lens.sum()), 128)
    Qm = arr(40, 20, 64)
    Dm = arr(64, 90, 64)
    Qf, Df = arr(2, 40, 96, dt=np.float32), arr(30, 60, 96, dt=np.float32)
    Qw, Dw = arr(2, 70, 1000), arr(12, 40, 1000)
    Ql = arr(1, 700, 128)
    g = arr(3, 50, dt=np.float32)
    calls = {
        "maxsim fp16 d_mask argmax (Hopper wgmma on sm_90)": lambda: lik_cupy.maxsim(Q, D, d_mask=dmask,
                                                                                      return_argmax=True),
        "maxsim 40 short queries argmax": lambda: lik_cupy.maxsim(Qm, Dm, return_argmax=True),
        "maxsim fp32 (tf32)": lambda: lik_cupy.maxsim(Qf, Df, return_argmax=True),
        "maxsim split-d 1000": lambda: lik_cupy.maxsim(Qw, Dw, return_argmax=True),
        "maxsim 700-token query (partial sums)": lambda: lik_cupy.maxsim(Ql, D),
        "maxsim_varlen argmax": lambda: lik_cupy.maxsim_varlen(Q, T, off, return_argmax=True),
        "retrieve": lambda: lik_cupy.retrieve(Q, T, 10, d_offsets=off),
        "maxsim_backward csr": lambda: lik_cupy.maxsim_backward(
            g, Q, D, lik_cupy.maxsim(Q, D, return_argmax=True)[1], method="csr"),
        "maxsim_backward atomic dQ": lambda: lik_cupy.maxsim_backward(
            g, Q, D, lik_cupy.maxsim(Q, D, return_argmax=True)[1], method="atomic")[0],
    }
    if hasattr(lik_cupy, "maxsim_int8"):
        Di, ds = lik_cupy.quantize_int8(D)
        Ti, ts = lik_cupy.quantize_int8(T)
        calls["maxsim_int8 d_mask argmax"] = lambda: lik_cupy.maxsim_int8(Q, Di, ds, d_mask=dmask, return_argmax=True)
        calls["maxsim_int8_varlen argmax"] = lambda: lik_cupy.maxsim_int8_varlen(Q, Ti, ts, off, return_argmax=True)
    return {name: hashlib.sha256(b"".join(x.tobytes() for x in _hosts(fn()))).hexdigest() for name, fn in calls.items()}


def test_results_are_bitwise_identical_run_to_run():
    runs = [determinism_digests() for _ in range(3)]
    assert runs[0] == runs[1] == runs[2], runs
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import test_reliability_gpu as t; "
            "print(json.dumps(t.determinism_digests()))")
    fresh = subprocess.run([sys.executable, "-c", code, str(pathlib.Path(__file__).parent)], capture_output=True,
                           text=True, timeout=300, env=os.environ)
    assert fresh.returncode == 0, fresh.stderr
    assert json.loads(fresh.stdout.splitlines()[-1]) == runs[0]  # a new process, the same bits
    FIGURES["determinism"] = {"calls": sorted(runs[0]), "runs_in_process": 3, "fresh_process": True,
                              "bitwise_identical": True}


_NO_DISK = """
import os, sys, tempfile, warnings
def full(*a, **k):
    raise OSError(28, "No space left on device (simulated)")
tempfile.mkdtemp = full  # no directory of the process's own either
import numpy as np, cupy as cp
import lik_cupy
from lik_cupy._runtime import nvrtc
rng = np.random.default_rng(0)
q = rng.standard_normal((3, 17, 128)).astype(np.float16)
d = rng.standard_normal((50, 33, 128)).astype(np.float16)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    s, a = lik_cupy.maxsim(cp.asarray(q), cp.asarray(d), return_argmax=True)
    cp.cuda.Device().synchronize()
ref, ra = lik_cupy.maxsim(q, d, return_argmax=True, backend="cpu")
paths = [str(path) for path, _ in nvrtc._in_memory.values()]
print(len(w), int(np.array_equal(cp.asnumpy(a), ra)), float(np.max(np.abs(cp.asnumpy(s) - ref) / (np.abs(ref) + 1))),
      " ".join(paths))
"""


def test_kernels_load_from_memory_files_where_no_directory_can_be_written():
    """The kernel cache's last fallback, on the real driver (docs/reliability.md): neither the cache
    nor a temporary directory can be written, so each compiled CUBIN is loaded from a sealed memory
    file of the process (``/proc/self/fd/N``), with one warning, and scores as ever."""
    if not os.path.isdir("/proc/self/fd") or not hasattr(os, "memfd_create"):
        pytest.skip("memory files are a Linux fallback")
    env = {**os.environ, "LIK_CACHE_DIR": "/proc/lik-cupy-no-cache"}
    run = subprocess.run([sys.executable, "-c", _NO_DISK], capture_output=True, text=True, timeout=300, env=env,
                         cwd=pathlib.Path(__file__).parents[1])
    assert run.returncode == 0, run.stderr
    warned, same_argmax, err, *paths = run.stdout.split()
    assert int(warned) == 1 and int(same_argmax) == 1 and float(err) < 1e-3, run.stdout
    assert paths and all(p.startswith("/proc/self/fd/") for p in paths), run.stdout


def test_query_without_tokens_scores_0_against_documents_without_tokens():
    import cupy

    Q = cupy.ones((2, 3, 16), cupy.float16)
    ql = cupy.asarray([3, 0])
    want = [[-np.inf] * 4, [0.0] * 4]
    assert lik_cupy.maxsim(Q, cupy.ones((4, 0, 16), cupy.float16), q_lengths=ql).get().tolist() == want
    assert lik_cupy.maxsim_varlen(Q, cupy.ones((0, 16), cupy.float16), cupy.zeros(5, cupy.int64),
                                  q_lengths=ql).get().tolist() == want


def test_retrieve_without_queries_returns_empty_results():
    import cupy

    s, i = lik_cupy.retrieve(cupy.zeros((0, 4, 16), cupy.float16), cupy.ones((4, 16), cupy.float16), 3,
                             d_offsets=cupy.asarray([0, 4]))
    assert s.shape == i.shape == (0, 1)


# ---------------------------------------------------------------- faults


def test_failed_launch_names_the_kernel_and_the_library_recovers(monkeypatch):
    import cupy

    from lik_cupy import _dispatch as dispatch

    from lik_cupy._runtime import backward  # the backward's launches

    rng = np.random.default_rng(4)
    Q = cupy.asarray(rng.standard_normal((2, 30, 64)).astype(np.float16))
    D = cupy.asarray(rng.standard_normal((9, 50, 64)).astype(np.float16))
    good, am = _hosts(lik_cupy.maxsim(Q, D, return_argmax=True))
    g = cupy.ones((2, 9), cupy.float32)
    grads = _hosts(lik_cupy.maxsim_backward(g, Q, D, cupy.asarray(am), method="csr"))

    real = dispatch.plan_launch
    monkeypatch.setattr(dispatch, "plan_launch", lambda *a, **k: dispatch.Launch(n_qt=1, qb=1, docs_per_cta=1, grid=(1, 70_000, 1)))
    with pytest.raises(RuntimeError) as e:  # grid.y above 65535: the driver refuses the launch
        lik_cupy.maxsim(Q, D, return_argmax=True)
    fwd_msg = str(e.value)
    assert re.search(r"lik_maxsim_fwd_\w+ failed to launch", fwd_msg) and "Nq=2, Nd=9, Lq=30, Ld=50, d=64" in fwd_msg
    monkeypatch.setattr(dispatch, "plan_launch", real)
    assert _bitwise_equal(_hosts(lik_cupy.maxsim(Q, D, return_argmax=True)), (good, am))

    monkeypatch.setattr(backward, "THREADS", 2048)  # more threads per block than any GPU takes
    with pytest.raises(RuntimeError) as e:
        lik_cupy.maxsim_backward(g, Q, D, cupy.asarray(am), method="csr")
    bwd_msg = str(e.value)
    assert "lik_bwd_dq failed to launch" in bwd_msg and "Nq=2, Nd=9, Lq=30, Ld=50" in bwd_msg
    monkeypatch.setattr(backward, "THREADS", 256)
    assert _bitwise_equal(_hosts(lik_cupy.maxsim_backward(g, Q, D, cupy.asarray(am), method="csr")), grads)
    cupy.cuda.runtime.deviceSynchronize()  # nothing sticky was left in the context
    FIGURES["launch_errors"] = {"forward": fwd_msg, "backward": bwd_msg, "usable_afterwards": True}


def test_too_large_forward_request_raises_a_memory_error_naming_the_buffer():
    """An argmax of 64 x 2**20 x 1024 int32 entries (256 GiB) fits no GPU: the error says which
    buffer, how many bytes, and that return_argmax=False needs none."""
    import cupy

    Q = cupy.asarray(np.random.default_rng(6).standard_normal((64, 1024, 16)).astype(np.float16))
    D = cupy.zeros((2**20, 1, 16), cupy.float16)
    with pytest.raises(MemoryError) as e:
        lik_cupy.maxsim(Q, D, return_argmax=True)
    msg = str(e.value)
    del e  # its traceback holds the frames, and so the buffers, of the failed call
    want = 64 * 2**20 * 1024 * 4
    assert "argmax" in msg and f"{want:,}" in msg and "return_argmax=False" in msg, msg
    lik_cupy.maxsim(Q[:2], D[:1000])  # and the library works on
    cupy.cuda.runtime.deviceSynchronize()
    FIGURES.setdefault("too_large", {})["forward"] = msg


def test_too_large_backward_request_raises_a_memory_error_naming_the_buffer():
    """With room for dQ and dD but not for the atomic method's fp32 copy of dD, the error names that
    buffer and says method='csr' needs none; that call then works."""
    import cupy

    rng = np.random.default_rng(7)
    Q = cupy.asarray(rng.standard_normal((2, 16, 128)).astype(np.float16))
    D = cupy.asarray(rng.standard_normal((4096, 64, 128)).astype(np.float16))  # 64 MiB; fp32 dD: 128 MiB
    g = cupy.ones((2, 4096), cupy.float32)
    _, am = lik_cupy.maxsim(Q, D, return_argmax=True)
    pool = cupy.get_default_memory_pool()

    def tight(size):  # a GPU with about 100 MiB left: larger requests fail as CuPy's pool fails them
        if size > 100 << 20:
            raise cupy.cuda.memory.OutOfMemoryError(size, pool.total_bytes())
        return pool.malloc(size)

    cupy.cuda.set_allocator(tight)
    try:
        with pytest.raises(MemoryError) as e:
            lik_cupy.maxsim_backward(g, Q, D, am, method="atomic")
        msg = str(e.value)
        del e  # its traceback holds the frames, and so the buffers, of the failed call
        assert "maxsim_backward: the atomic method's fp32 dD [262144, 128] float32" in msg, msg
        assert f"{2 * D.nbytes:,} bytes" in msg and "method='csr'" in msg and "GiB free of" in msg, msg
        dq, dd = lik_cupy.maxsim_backward(g, Q, D, am, method="csr")
        assert dq.shape == Q.shape and dd.shape == D.shape
    finally:
        cupy.cuda.set_allocator(pool.malloc)
    lik_cupy.maxsim_backward(g, Q, D, am)  # with the room back, the default method works again
    cupy.cuda.runtime.deviceSynchronize()
    FIGURES.setdefault("too_large", {})["backward"] = msg
