"""pin_host: page-locked host corpora stream without staging copies and score bit for bit as staged ones."""

import numpy as np
import pytest

import lik_cupy
from lik_cupy._streaming import gpu as gpu_engine
from test_forward_gpu import _cp, _np, _unit

BUDGET = 4 << 20  # forces many chunks


def test_pin_host_refuses_non_numpy_and_strided():
    with pytest.raises(TypeError, match=r"argument 0 must be a NumPy array .* got builtins.list"):
        lik_cupy.pin_host([1, 2, 3])
    a = np.zeros((10, 8), np.float16)
    with pytest.raises(ValueError, match=r"argument 1 \(float16 \[10, 4\], strides \[16, 4\]\) is not C-contiguous"):
        lik_cupy.pin_host(a, a[:, ::2])


def test_pin_host_without_gpu_locks_nothing(monkeypatch):
    from lik_cupy._base import device

    monkeypatch.setattr(device, "gpu_available", lambda: False)
    with lik_cupy.pin_host(np.zeros((4, 8), np.float16)) as p:
        assert p._locked == []


@pytest.fixture
def staged_copies(monkeypatch):
    """The shapes of the host staging copies retrieve makes (none for page-locked tokens)."""
    seen = []
    real = gpu_engine.parallel_copy

    def spy(pool, dst, src):
        seen.append((src.dtype.name, src.shape))
        real(pool, dst, src)

    monkeypatch.setattr(gpu_engine, "parallel_copy", spy)
    return seen


def _corpus(rng, nd=700, ld=83, dim=128):
    d = _unit(rng, nd, ld, dim).astype(np.float16)
    q = _unit(rng, 9, 29, dim).astype(np.float16)
    lens = rng.integers(0, ld + 1, size=nd)
    return q, d, lens


@pytest.mark.gpu
def test_pinned_padded_corpus_uploads_in_place_and_matches(rng, staged_copies):
    from lik_cupy._runtime.pinned import span_page_locked

    q, d, lens = _corpus(rng)
    want_s, want_i = lik_cupy.retrieve(_cp(q), d, 50, d_lengths=lens, max_gpu_bytes=BUDGET)
    assert staged_copies, "a pageable corpus is staged"
    staged_copies.clear()
    with lik_cupy.pin_host(d) as pinned:
        assert span_page_locked(d) and pinned._locked
        s, i = lik_cupy.retrieve(_cp(q), d, 50, d_lengths=lens, max_gpu_bytes=BUDGET)
    assert staged_copies == []
    assert not span_page_locked(d)  # unlocked on leaving the block
    np.testing.assert_array_equal(_np(i), _np(want_i))
    assert _np(s).tobytes() == _np(want_s).tobytes()


@pytest.mark.gpu
def test_pinned_packed_and_int8_corpora_match(rng, staged_copies):
    q, d, lens = _corpus(rng)
    off = np.concatenate([[0], np.cumsum(lens)])
    tok = np.ascontiguousarray(d[np.arange(d.shape[1])[None, :] < lens[:, None]])
    want = lik_cupy.retrieve(_cp(q), tok, 40, d_offsets=off, max_gpu_bytes=BUDGET)
    t8, ts = lik_cupy.quantize_int8(tok)
    want8 = lik_cupy.retrieve(_cp(q), t8, 40, d_offsets=off, d_scales=ts, max_gpu_bytes=BUDGET)
    ts2 = ts.copy()  # scales left pageable: staged, while their locked tokens upload in place
    staged_copies.clear()
    with lik_cupy.pin_host(tok, t8, ts):
        got = lik_cupy.retrieve(_cp(q), tok, 40, d_offsets=off, max_gpu_bytes=BUDGET)
        got8 = lik_cupy.retrieve(_cp(q), t8, 40, d_offsets=off, d_scales=ts, max_gpu_bytes=BUDGET)
        assert staged_copies == []
        got8b = lik_cupy.retrieve(_cp(q), t8, 40, d_offsets=off, d_scales=ts2, max_gpu_bytes=BUDGET)
        assert staged_copies and {name for name, _ in staged_copies} == {"float32"}
    for (a_s, a_i), (b_s, b_i) in ((want, got), (want8, got8), (want8, got8b)):
        np.testing.assert_array_equal(_np(a_i), _np(b_i))
        assert _np(a_s).tobytes() == _np(b_s).tobytes()


@pytest.mark.gpu
def test_pinned_read_only_memmap(rng, tmp_path, staged_copies):
    from lik_cupy._runtime.pinned import span_page_locked

    q, d, lens = _corpus(rng, nd=300)
    np.save(tmp_path / "docs.npy", d)
    mm = np.load(tmp_path / "docs.npy", mmap_mode="r")
    want_s, want_i = lik_cupy.retrieve(_cp(q), d, 20, d_lengths=lens, max_gpu_bytes=BUDGET)
    staged_copies.clear()
    with lik_cupy.pin_host(mm):
        assert span_page_locked(mm)
        s, i = lik_cupy.retrieve(_cp(q), mm, 20, d_lengths=lens, max_gpu_bytes=BUDGET)
    assert staged_copies == [] and not span_page_locked(mm)
    np.testing.assert_array_equal(_np(i), _np(want_i))
    assert _np(s).tobytes() == _np(want_s).tobytes()


@pytest.mark.gpu
def test_partly_locked_or_owner_locked_memory(rng, staged_copies):
    import cupyx

    from lik_cupy._runtime.pinned import span_page_locked

    q, d, lens = _corpus(rng, nd=400)
    want_s, want_i = lik_cupy.retrieve(_cp(q), d, 30, d_lengths=lens, max_gpu_bytes=BUDGET)
    # Only the first documents locked: the corpus is not locked end to end, so it is staged.
    with lik_cupy.pin_host(d[:100]):
        staged_copies.clear()
        s, i = lik_cupy.retrieve(_cp(q), d, 30, d_lengths=lens, max_gpu_bytes=BUDGET)
        assert staged_copies
    np.testing.assert_array_equal(_np(i), _np(want_i))
    assert _np(s).tobytes() == _np(want_s).tobytes()
    # Memory its owner locked: used in place, and left locked when pin_host's block ends.
    owned = cupyx.empty_pinned(d.shape, d.dtype)
    owned[...] = d
    staged_copies.clear()
    with lik_cupy.pin_host(owned) as p:
        assert p._locked == []
        s, i = lik_cupy.retrieve(_cp(q), owned, 30, d_lengths=lens, max_gpu_bytes=BUDGET)
    assert staged_copies == [] and span_page_locked(owned)
    np.testing.assert_array_equal(_np(i), _np(want_i))
    assert _np(s).tobytes() == _np(want_s).tobytes()


@pytest.mark.gpu
def test_torch_pinned_corpus_uploads_in_place(rng, staged_copies):
    torch = pytest.importorskip("torch")
    q, d, lens = _corpus(rng, nd=300)
    want_s, want_i = lik_cupy.retrieve(_cp(q), d, 25, d_lengths=lens, max_gpu_bytes=BUDGET)
    staged_copies.clear()
    dt = torch.from_numpy(d).pin_memory()
    s, i = lik_cupy.retrieve(torch.from_numpy(q).cuda(), dt, 25, d_lengths=torch.from_numpy(lens),
                             max_gpu_bytes=BUDGET)
    assert staged_copies == []
    np.testing.assert_array_equal(_np(i), _np(want_i))
    assert _np(s).tobytes() == _np(want_s).tobytes()


@pytest.fixture
def fake_locks(monkeypatch):
    """The driver's page locks as a set of start addresses (no GPU needed): hostRegister adds, hostUnregister
    removes, and memory reads as page-locked only where pin_host found it so before."""
    import cupy

    from lik_cupy._runtime import pinned

    locked = set()
    monkeypatch.setattr(pinned, "span_page_locked", lambda a: False)
    monkeypatch.setattr(cupy.cuda.runtime, "hostRegister", lambda ptr, n, flags: locked.add(ptr))
    monkeypatch.setattr(cupy.cuda.runtime, "hostUnregister", locked.remove)
    return locked


def test_a_dropped_pinned_host_unlocks_its_pages(fake_locks):
    """The pages stay locked only while the PinnedHost, which keeps their arrays alive, lives: one dropped
    without release() unlocks them, rather than leaving freed memory registered with the driver."""
    import gc

    from lik_cupy._runtime.pinned import PinnedHost

    a = np.zeros((1 << 16,), np.float32)
    p = PinnedHost([a])
    assert len(fake_locks) == 1 and p._locked
    del p
    gc.collect()
    assert fake_locks == set()
    with PinnedHost([a]) as p:
        assert len(fake_locks) == 1
    assert fake_locks == set()
    del p  # (released already: nothing to unlock twice)
    gc.collect()
