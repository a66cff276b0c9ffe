"""CPU corpus scoring: packed documents, retrieve, and their argument checks (run in CI)."""

import numpy as np
import pytest

import lik_cupy
from lik_cupy._streaming.gpu import packed_chunks
from reference import assert_within_rounding, maxsim_ref, rounding_bound


def _packed(rng, nd, lo, hi, dim, empty_frac=0.2):
    lens = rng.integers(lo, hi + 1, size=nd)
    lens[rng.random(nd) < empty_frac] = 0
    off = np.concatenate([[0], np.cumsum(lens)])
    return rng.standard_normal((int(off[-1]), dim)).astype(np.float32), off, lens


def _padded(tokens, lens):
    lmax = max(1, int(lens.max()))
    out = np.zeros((lens.size, lmax, tokens.shape[1]), tokens.dtype)
    valid = np.arange(lmax)[None, :] < lens[:, None]
    out[valid] = tokens
    return out, valid


def _ranked(scores, k):
    idx = np.broadcast_to(np.arange(scores.shape[1]), scores.shape)
    nan = np.isnan(scores)
    order = np.lexsort((idx, -np.where(nan, 0, scores), nan), axis=1)[:, :k]
    return np.take_along_axis(scores, order, 1), order


@pytest.mark.parametrize("off_dtype", [np.int32, np.int64])
def test_varlen_cpu_vs_float64(rng, off_dtype):
    tok, off, lens = _packed(rng, 70, 0, 60, 24)
    q = rng.standard_normal((4, 9, 24)).astype(np.float32)
    qmask = rng.random((4, 9)) < 0.7
    s, a = lik_cupy.maxsim_varlen(q, tok, off.astype(off_dtype), q_mask=qmask, return_argmax=True, backend="cpu")
    dpad, dv = _padded(tok, lens)
    ref, sim = maxsim_ref(q, dpad, qmask, dv)
    assert_within_rounding(s, ref, rounding_bound(q, dpad, qmask, dv))
    np.testing.assert_array_equal(a, np.where(qmask[:, None, :] & (lens > 0)[None, :, None], sim.argmax(axis=3), -1))
    assert s.dtype == np.float32 and a.shape == (4, 70, 9) and a.dtype == np.int32
    assert np.all(s[:, lens == 0] == -np.inf) and np.all(a[:, lens == 0] == -1)
    assert np.all(a[~np.broadcast_to(qmask[:, None, :], a.shape)] == -1)


def test_varlen_cpu_packed_queries_and_2d(rng):
    tok, off, lens = _packed(rng, 30, 1, 20, 8)
    qlens = np.array([3, 0, 7])
    qt = rng.standard_normal((10, 8)).astype(np.float32)
    s = lik_cupy.maxsim_varlen(qt, tok, off, q_offsets=np.concatenate([[0], np.cumsum(qlens)]), backend="cpu")
    assert s.shape == (3, 30) and np.all(s[1] == 0)
    one = lik_cupy.maxsim_varlen(qt[:3], tok, off, backend="cpu")
    # The 3-token query alone and padded to 7 among others: GEMMs of different shapes, the same scores
    # bit for bit (each term is its winner's float64 dot product, lik_cupy._cpu.maxsim)
    np.testing.assert_array_equal(one, s[0])
    dpad, dv = _padded(tok, lens)
    assert_within_rounding(one, maxsim_ref(qt[None, :3], dpad, None, dv)[0][0],
                           rounding_bound(qt[None, :3], dpad, None, dv)[0])


def _long_and_short(rng, short, long, dim):
    """Packed queries: ``short`` of 0 to 3 tokens and one of ``long`` tokens among them (tokens, offsets, lengths)."""
    lens = rng.integers(0, 4, short + 1)
    lens[short // 2] = long
    off = np.concatenate([[0], np.cumsum(lens)])
    return rng.standard_normal((int(off[-1]), dim)).astype(np.float32), off, lens


def test_packed_queries_are_padded_a_group_at_a_time(rng, monkeypatch):
    """Packed queries were all padded to the longest: one long query among 2,000 short ones took 518 MB
    for a 273 KB input. Each group of similar lengths is now padded to its own longest (within twice
    its tokens' bytes, or a fixed chunk, here 1 KiB), with every score and argmax bit for bit those of
    the call padded to the longest (a query's results are its own, lik_cupy._cpu.maxsim)."""
    from lik_cupy._cpu import maxsim as cpu_maxsim
    from test_cpu_exact import _peak as peak

    monkeypatch.setattr(cpu_maxsim, "QUERY_CHUNK", 1 << 10, raising=False)
    tok, off, _ = _packed(rng, 12, 0, 8, 16)
    qt, qoff, qlens = _long_and_short(rng, 60, 100, 16)
    s, a = lik_cupy.maxsim_varlen(qt, tok, off, q_offsets=qoff, return_argmax=True, backend="cpu")
    want_s, want_a = lik_cupy.maxsim_varlen(_padded(qt, qlens)[0], tok, off, q_lengths=qlens, return_argmax=True,
                                            backend="cpu")
    assert s.shape == (61, 12) and a.shape == (61, 12, 100)
    np.testing.assert_array_equal(s, want_s)
    np.testing.assert_array_equal(a, want_a)
    qt, qoff, _ = _long_and_short(rng, 300, 512, 16)  # 64 KB of tokens; padded to 512 tokens, 9.9 MB
    lik_cupy.maxsim_varlen(qt, tok, off, q_offsets=qoff, backend="cpu")  # (NumPy's lazy imports, once)
    held = peak(lambda: lik_cupy.maxsim_varlen(qt, tok, off, q_offsets=qoff, backend="cpu"))
    assert held < 301 * 512 * 16 * 4 / 2, held


def test_query_groups_keep_the_padding_bound(rng):
    """Every query in exactly one group; a group's padded bytes within twice its tokens' or the chunk."""
    from lik_cupy._cpu import QUERY_CHUNK, query_groups

    for lens in (rng.integers(0, 4096, 5000), np.r_[rng.integers(0, 3, 3000), 40_000], np.zeros(7, np.int64),
                 np.arange(3000), np.zeros(0, np.int64)):
        groups = query_groups(lens, 256)
        assert sorted(np.concatenate(groups).tolist()) == list(range(lens.size))
        for g in groups:
            padded = g.size * (int(lens[g].max()) if g.size else 0) * 256
            assert padded <= max(2 * int(lens[g].sum()) * 256, QUERY_CHUNK)
    lens = rng.integers(1, 40, 100)  # little padding: one group, the caller's order (one padded call, as before)
    assert [g.tolist() for g in query_groups(lens, 256)] == [list(range(100))]


@pytest.mark.parametrize(
    "off,msg",
    [
        ([0, 5, 3, 10], "non-decreasing"),
        ([2, 5, 10], "start at 0"),
        ([0, 5, 9], "ends at 9 but there are 10"),
    ],
)
def test_varlen_offset_values(off, msg):
    with pytest.raises(ValueError, match=msg):
        lik_cupy.maxsim_varlen(np.zeros((2, 3, 4), np.float32), np.zeros((10, 4), np.float32), np.array(off),
                               backend="cpu")


@pytest.mark.parametrize(
    "kwargs,err,msg",
    [
        (dict(d_offsets=np.array([0.0, 10.0])), TypeError, "int32 or int64"),
        (dict(d_offsets=np.zeros((2, 2), np.int64)), ValueError, r"1-D \[N \+ 1\]"),
        (dict(d_offsets=np.zeros(0, np.int64)), ValueError, "at least one entry"),
        (dict(D_tokens=np.zeros((10, 5), np.float32)), ValueError, "D_tokens has dim 5 but Q has dim 4"),
        (dict(D_tokens=np.zeros((2, 5, 4), np.float32)), ValueError, r"packed tokens \[T, d\]"),
        (dict(D_tokens=np.zeros((10, 4), np.float16)), TypeError, "D_tokens has dtype float16 but Q has float32"),
        (dict(q_offsets=np.array([0, 1])), ValueError, r"with q_offsets, Q must be packed tokens \[Tq, d\]"),
        (dict(q_offsets=np.array([0, 1]), q_lengths=[1, 2]), ValueError, "take no q_mask or q_lengths"),
    ],
)
def test_varlen_argument_errors(kwargs, err, msg):
    args = dict(Q=np.zeros((2, 3, 4), np.float32), D_tokens=np.zeros((10, 4), np.float32),
                d_offsets=np.array([0, 4, 10]))
    args.update(kwargs)
    with pytest.raises(err, match=msg):
        lik_cupy.maxsim_varlen(args.pop("Q"), args.pop("D_tokens"), args.pop("d_offsets"), backend="cpu", **args)


def test_retrieve_cpu_layouts_agree(rng):
    tok, off, lens = _packed(rng, 300, 0, 40, 16, empty_frac=0.1)
    q = rng.standard_normal((5, 6, 16)).astype(np.float32)
    dpad, dv = _padded(tok, lens)
    full = lik_cupy.maxsim(q, dpad, d_mask=dv, backend="cpu")
    want_s, want_i = _ranked(full, 17)
    got = [
        lik_cupy.retrieve(q, dpad, 17, d_mask=dv, backend="cpu"),
        lik_cupy.retrieve(q, dpad, 17, d_lengths=lens, backend="cpu"),
        lik_cupy.retrieve(q, tok, 17, d_offsets=off, backend="cpu"),
        lik_cupy.retrieve(q, [(tok[: off[100]], off[:101]), dpad[100:]], 17, backend="cpu"),
        lik_cupy.retrieve(q, iter([dpad[:1], dpad[1:0], dpad[1:]]), 17, backend="cpu"),  # generator, empty shard
    ]
    for s, i in got[:3]:  # every layout and chunking scores bit for bit alike (lik_cupy._cpu.maxsim)
        np.testing.assert_array_equal(i, want_i)
        np.testing.assert_array_equal(s, want_s)
    ref, bound = maxsim_ref(q, dpad, None, dv)[0], rounding_bound(q, dpad, None, dv)
    assert_within_rounding(full, ref, bound)
    for s, i in got[3:]:  # the padded shard is unmasked: different scores, same machinery
        assert s.shape == (5, 17) and i.dtype == np.int64
        assert np.all(np.diff(s, axis=1) <= 0)


def test_retrieve_cpu_ties_nan_and_k_above_corpus():
    d = np.zeros((6, 2, 4), np.float32)
    d[:, 0, 0] = [1, 3, 3, np.nan, -1, 3]
    q = np.zeros((1, 1, 4), np.float32)
    q[0, 0, 0] = 1
    s, i = lik_cupy.retrieve(q, d, 10, d_lengths=[1, 1, 1, 1, 1, 0], backend="cpu")
    assert i.tolist() == [[1, 2, 0, 4, 5, 3]]  # ties by index, -inf (empty doc 5) above NaN
    assert s[0, :4].tolist() == [3, 3, 1, -1] and s[0, 4] == -np.inf and np.isnan(s[0, 5])
    s2, i2 = lik_cupy.retrieve(q[0], d, 2, backend="cpu")  # 2-D Q: 1-D results
    assert i2.tolist() == [1, 2] and s2.shape == (2,)


def test_retrieve_cpu_merges_many_queries_within_the_step_bytes(rng, monkeypatch):
    # The running top-k and a step's scores were merged for every query at once, about 48 bytes a
    # candidate: 2,048 queries at k = 2,048 peaked at 675 MiB for a 48 MiB result. Now a few rows
    # of queries at a time, within the step bound, with the same ranking.
    import tracemalloc

    from lik_cupy import _ranking
    from lik_cupy._streaming import cpu as streaming_cpu

    q = rng.standard_normal((512, 1, 4)).astype(np.float32)
    d = rng.standard_normal((2048, 1, 4)).astype(np.float32)
    want_s, want_i = _ranked(lik_cupy.maxsim(q, d, backend="cpu"), 512)
    merge, peaks = _ranking.merge_ranked, []

    def traced(*args):  # each merge's temporaries and result
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        out = merge(*args)
        peaks.append(tracemalloc.get_traced_memory()[1] - held)
        return out

    monkeypatch.setattr(streaming_cpu, "_CPU_STEP_BYTES", 1 << 20)
    monkeypatch.setattr(_ranking, "merge_ranked", traced)  # (each block of rows merge_ranked_rows merges)
    tracemalloc.start()
    try:
        s, i = lik_cupy.retrieve(q, d, 512, backend="cpu")
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(i, want_i)
    np.testing.assert_array_equal(s, want_s)
    assert peaks and max(peaks) < 2 << 20, max(peaks)  # (a whole merge took 22 MiB)


@pytest.mark.parametrize(
    "kwargs,err,msg",
    [
        (dict(k=0), ValueError, r"k must be an integer in \[1, 4096\]"),
        (dict(k=5000), ValueError, r"k must be an integer in \[1, 4096\]"),
        (dict(k=2.0), ValueError, "k must be an integer"),
        (dict(max_gpu_bytes=-1), ValueError, "max_gpu_bytes must be a positive integer"),
        (dict(D="corpus.npy"), TypeError, "D must be an array or an iterable of shards"),
        (dict(D=[np.zeros((3, 2, 4), np.float32), [1, 2]]), TypeError, "shard 1 must be a padded array"),
        (dict(D=[np.zeros((3, 2, 5), np.float32)]), ValueError, "has dim 5 but Q has dim 4"),
        (dict(D=[np.zeros((3, 2, 4), np.float16)]), TypeError, "shard 0 has dtype float16 but Q has float32"),
        (dict(D=np.zeros((3, 2, 4), np.float16)), TypeError, "the corpus has dtype float16 but Q has float32"),
        (dict(D=[np.zeros((3, 2, 4), np.float32), np.zeros((3, 2, 5), np.float32)]), ValueError,
         "^shard 1 has dim 5 but Q has dim 4"),  # (the shard, not the corpus, whose shard 0 is right)
        (dict(D=[np.zeros((3, 4), np.float32)]), ValueError,
         r"^shard 0: a padded corpus must be \[Nd, Ld, d\]; got shape \[3, 4\] \(a shard of packed tokens"),
        # which shard, and which argument, is wrong
        (dict(D=[np.zeros((3, 2, 4), np.float32), np.zeros((4,), np.float32)]), ValueError,
         r"^shard 1: a padded corpus must be \[Nd, Ld, d\]; got shape \[4\]$"),
        (dict(D=np.zeros((6, 4), np.float32)), ValueError,
         r"^D: a padded corpus must be \[Nd, Ld, d\]; got shape \[6, 4\] \(packed tokens \[T, d\] take d_offsets\)"),
        (dict(D=[(np.zeros((3, 2, 4), np.float32), np.array([1, 2, 2]))]), ValueError,
         r"^shard 0: packed corpus tokens must be \[T, d\]; got shape \[3, 2, 4\] \(a shard tuple is"),
        (dict(D=np.zeros((3, 2, 4), np.float32), d_offsets=[0, 1, 2, 3]), ValueError,
         r"^D: packed corpus tokens must be \[T, d\]; got shape \[3, 2, 4\]$"),
        (dict(D=[(np.zeros((3, 4), np.float32), np.array([0, 2]))]), ValueError, "ends at 2 but there are 3"),
        # a shard's offset values are its own, not d_offsets (which goes with a single array D)
        (dict(D=[np.zeros((3, 2, 4), np.float32), (np.zeros((3, 4), np.float32), np.array([0, 2, 1, 3]))]),
         ValueError, r"^shard 1 offsets must be non-decreasing"),
        (dict(D=[(np.zeros((3, 4), np.float32), np.array([1, 2, 3]))]), ValueError, "^shard 0 offsets must start at 0"),
        (dict(D=[np.zeros((3, 2, 4), np.float32)], d_lengths=[1, 2, 3]), TypeError, "go with a single array D"),
        (dict(d_lengths=[1, 2, 3]), ValueError, r"every length must be in \[0, 2\]"),
    ],
)
def test_retrieve_argument_errors(kwargs, err, msg):
    args = dict(D=np.zeros((3, 2, 4), np.float32), k=2)
    args.update(kwargs)
    with pytest.raises(err, match=msg):
        lik_cupy.retrieve(np.zeros((2, 3, 4), np.float32), args.pop("D"), args.pop("k"), backend="cpu", **args)


def test_packed_chunks_cover_every_document():
    rng = np.random.default_rng(1)
    lens = rng.integers(0, 500, size=1000)
    lens[::50] = 0
    off = np.concatenate([[0], np.cumsum(lens)])
    for c in (1, 7, 64, 999, 5000):
        b = packed_chunks(off, c)
        assert b[0][0] == 0 and b[-1][1] == 1000
        assert all(x[1] == y[0] for x, y in zip(b, b[1:]))
        assert all(0 < hi - lo <= c for lo, hi in b)


# --------------------------------------------------------------------------- out of GPU memory: chunk halving


class _FakeOOM(MemoryError):
    """Stands in for cupy.cuda.memory.OutOfMemoryError (which keeps the request size in ``_size``)."""

    def __init__(self, size):
        super().__init__(f"Out of memory allocating {size:,} bytes")
        self._size = size


class _Scorer:
    """Scores documents chunk by chunk like retrieve's GPU runner; a chunk of more than ``fits()``
    documents runs out of memory. Records every merged range."""

    def __init__(self, total, fits, chunking):
        self.total, self.fits, self.chunking, self.merged = total, fits, chunking, []

    def done(self):
        return self.merged[-1][1] if self.merged else 0

    def run(self, start, c):
        for a in range(start, self.total, c):
            b = min(self.total, a + c)
            if b - a > self.fits(self):
                raise _FakeOOM(512 * (b - a))
            self.merged.append((a, b))
            self.chunking.succeeded()


def _covered(merged, total):
    return merged[0][0] == 0 and merged[-1][1] == total and all(x[1] == y[0] for x, y in zip(merged, merged[1:]))


def test_chunk_halves_resumes_and_warns_once():
    import warnings

    from lik_cupy._streaming.gpu import Chunking, drive

    chunking = Chunking(lambda: 4096)
    # 300 documents fit per chunk until two chunks are merged; then only 70 (memory taken elsewhere).
    shard = _Scorer(1000, lambda s: 300 if len(s.merged) < 2 else 70, chunking)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        drive(1000, 250, shard.run, shard.done, chunking, _FakeOOM)
        assert _covered(shard.merged, 1000), "every document merged exactly once, in order"
        assert shard.merged[:3] == [(0, 250), (250, 500), (500, 562)]  # resumed where it failed: 250 -> 125 -> 62
        assert all(b - a <= 62 for a, b in shard.merged[2:])
        # A later shard starts at the reduced size and halves again without a second warning.
        second = _Scorer(500, lambda s: 40, chunking)
        drive(500, 250, second.run, second.done, chunking, _FakeOOM)
        assert _covered(second.merged, 500) and max(b - a for a, b in second.merged) == 31
    warned = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(warned) == 1 and len(caught) == 1
    assert str(warned[0].message).startswith(
        "lik_cupy.retrieve: out of GPU memory with 250 documents per chunk; continuing with 62 per chunk")
    assert warned[0].filename == __file__  # points at the caller, not into lik_cupy


def test_not_even_one_document_fits():
    import warnings

    from lik_cupy._streaming.gpu import Chunking, drive

    chunking = Chunking(lambda: 123_456)
    shard = _Scorer(10, lambda s: 0, chunking)
    dropped = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing fitted: no warning, only the error
        with pytest.raises(MemoryError) as info:
            drive(10, 8, shard.run, shard.done, chunking, _FakeOOM, lambda: dropped.append(1))
    msg = str(info.value)
    assert msg.startswith("lik_cupy.retrieve: out of GPU memory allocating 512 bytes with one document per chunk, "
                          "while the queries and the running top-k hold 123,456 bytes")
    assert "fewer queries" in msg and "max_gpu_bytes" in msg
    assert isinstance(info.value.__cause__, _FakeOOM) and not isinstance(info.value, _FakeOOM)
    assert shard.merged == [] and len(dropped) == 4  # tried 8, 4, 2, 1; cached buffers dropped after each


def test_topk_merge_parameters_are_packed_in_the_kernels_order():
    """topk._PARAMS packs lik_topk_merge's parameters by raw slot (launch_raw): its kinds must name
    the kernel's parameters in cuda_src/topk.cu by C type, in order, or every merge reads its
    arguments from the wrong slots."""
    from pathlib import Path

    from lik_cupy._runtime import topk
    from lik_cupy._runtime.raw_launch import signature

    src = (Path(__file__).resolve().parents[1] / "cuda_src" / "topk.cu").read_text()
    params = src[src.index("lik_topk_merge(") + len("lik_topk_merge("):]
    params = params[:params.index(")")]
    kinds = []
    for decl in (d.strip() for d in params.split(",")):
        ctype = decl.rsplit(None, 1)[0]
        kinds.append("p" if "*" in decl else {"long long": "q", "int": "i"}.get(ctype, "?" + ctype))
    assert topk._PARAMS.format == signature("".join(kinds)).format, "".join(kinds)


class _FakeArray:
    def __init__(self, shape, at):
        self.shape = tuple(shape)
        self.data = type("Ptr", (), {"ptr": at})()


class _Allocator:
    """Device addresses handed out in order (0 for an empty array, as CuPy's), the same sequence
    for each path compared."""

    def __init__(self):
        self.next = 1 << 20

    def __call__(self, shape, *args):
        if int(np.prod(shape)) == 0:
            return _FakeArray(shape, 0)
        self.next += 1 << 20
        return _FakeArray(shape, self.next)


def _old_merge_launches(nq, k_run, nd, k, run, s, base, alloc):
    """The launches merge_topk queued before 5accd65 (through CuPy's RawKernel): (rows, smem,
    the kernel's arguments by its parameters, ids and n_ids then null)."""
    from lik_cupy._runtime.topk import MERGE_SLICE, split_merge

    k_out = min(k, k_run + nd)
    out_s, out_i = alloc((nq, k_out)).data.ptr, alloc((nq, k_out)).data.ptr
    launches = []

    def merge_kernel(rows, run_s, run_i, k_run, chunk, chunk_i, stride, n, groups, slice_, base, o_s, o_i, k):
        kp = 1 << max(0, (k - 1).bit_length())
        cache = k_run + min(n, slice_) <= 4096
        smem = kp * 12 + (4096 * 4 if cache else 0)
        launches.append((rows, smem, (run_s, run_i, k_run, chunk, chunk_i, stride, n, groups, slice_, base, o_s, o_i,
                                      k, kp, 4096 if cache else 0, 0, 0)))

    groups = -(-nd // MERGE_SLICE)
    if groups > 1 and split_merge(k):
        win_s, win_i = alloc((nq * groups, k)).data.ptr, alloc((nq * groups, k)).data.ptr
        merge_kernel(nq * groups, 0, 0, 0, s, 0, nd, nd, groups, MERGE_SLICE, base, win_s, win_i, k)
        merge_kernel(nq, run[0], run[1], k_run, win_s, win_i, groups * k, groups * k, 1, groups * k, 0, out_s, out_i,
                     k_out)
    else:
        merge_kernel(nq, run[0], run[1], k_run, s, 0, nd, nd, 1, nd, base, out_s, out_i, k_out)
    return launches


@pytest.mark.parametrize("nq,k_run,nd,k,base", [(3, 0, 9000, 40, 0), (3, 0, 9000, 1500, 0), (2, 0, 210, 7, 0),
                                                (1, 0, 4096, 4096, 0), (1, 0, 50, 4096, 0), (2, 40, 9000, 40, 12345),
                                                (2, 300, 5000, 300, 7), (1, 4096, 8192, 4096, 8192),
                                                (5, 1024, 70000, 1024, 99)])
def test_merge_launches_keep_the_old_arguments_and_the_prepared_merge_repeats_them(monkeypatch, nq, k_run, nd, k,
                                                                                   base):
    """merge_topk, launched by handle since 5accd65, hands the kernel every argument the CuPy launch
    did (null run lists in a split merge's first launch aside: k_run is 0 there, so they are never
    read), with dynamic shared memory within what _kernel sets once; and PreparedTopK (a repeat of
    Corpus.search, whose streamed call merged one chunk into an empty running list) queues the same
    launches, the corpus's ids (or none) in the last alone."""
    import sys
    import types

    from lik_cupy._runtime import topk

    launched = []
    monkeypatch.setattr(topk, "launch_raw", lambda func, grid, threads, smem, stream, params, values: launched.append(
        (func, grid, threads, smem, stream, params, values)))
    monkeypatch.setattr(topk, "_kernel", lambda device: 4242)
    alloc = _Allocator()
    stream = types.SimpleNamespace(ptr=77)
    fake = types.SimpleNamespace(empty=alloc, float32="float32", int64="int64",
                                 cuda=types.SimpleNamespace(get_current_stream=lambda: stream))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    run = alloc((nq, k_run)), alloc((nq, k_run))
    s = alloc((nq, nd))
    start = alloc.next
    out_s, out_i = topk.merge_topk(0, run[0], run[1], s, nd, base, k)
    assert out_s.shape == out_i.shape == (nq, min(k, k_run + nd))
    alloc.next = start
    old = _old_merge_launches(nq, k_run, nd, k, (run[0].data.ptr, run[1].data.ptr), s.data.ptr, base, alloc)
    assert len(launched) == len(old)
    limit = topk.MAX_K * 12 + topk._MERGE_CACHE * 4
    for (func, grid, threads, smem, stream_ptr, params, values), (rows, old_smem, old_values) in zip(launched, old):
        assert (func, grid, threads, stream_ptr, params) == (4242, (rows, 1, 1), 1024, 77, topk._PARAMS)
        assert smem == old_smem <= limit
        if old_values[0] == 0 and values[2] == 0:  # a split merge's first launch: the run lists unread
            values = (0, 0) + values[2:]
        assert values == old_values
    if k_run or base:
        return
    # The repeat: the same launches into arrays of the caller's framework, on its stream
    adapter = types.SimpleNamespace(new_empty=lambda shape, dtype, device: alloc(shape),
                                    address=lambda x: x.data.ptr)
    for ids in (None, alloc((nd,))):
        merged, launched[:] = list(launched), []
        alloc.next = start
        top = topk.PreparedTopK(0, nq, nd, k, ids)
        got_s, got_i = top(adapter, 0, 77, s)
        assert got_s.shape == got_i.shape == (nq, min(k, nd))
        assert len(launched) == len(merged)
        for i, (a, b) in enumerate(zip(launched, merged)):
            last = i == len(merged) - 1
            assert a[:6] == b[:6]
            want = b[6][:15] + ((ids.data.ptr, nd) if last and ids is not None else (0, 0))
            assert a[6][:2] == (0, 0) and a[6][2:] == want[2:]
        launched[:] = merged


def test_the_merge_kernels_shared_memory_limit_is_set_once_per_device(monkeypatch):
    """_kernel raises the merge kernel's dynamic shared memory limit once per device, to what the
    largest launch takes (k = MAX_K with the row's keys cached), and hands out its handle."""
    from lik_cupy._runtime import topk

    made = []

    class Kern:
        def __init__(self, device):
            self.device = device
            self.kernel = type("F", (), {"ptr": 1000 + device})()
            made.append(self)

    monkeypatch.setattr(topk, "_handles", {})
    monkeypatch.setattr(topk, "get_function", lambda name, entry, device: Kern(device))
    assert topk._kernel(0) == 1000 and topk._kernel(0) == 1000 and topk._kernel(1) == 1001
    assert [k.device for k in made] == [0, 1]
    assert all(k.max_dynamic_shared_size_bytes == topk.MAX_K * 12 + topk._MERGE_CACHE * 4 for k in made)
    widest = max(launch[8] for nd in (1, 4095, 4096, 4097, 10**6) for k_run in (0, 1, topk.MAX_K)
                 for k in (1, 1024, 1025, topk.MAX_K) for launch in topk._launches(2, k_run, nd, k))
    assert widest == topk.MAX_K * 12 + topk._MERGE_CACHE * 4
