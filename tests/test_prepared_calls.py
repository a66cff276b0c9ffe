"""The repeat-call path without a GPU: what a prepared launch hands the driver, when a prepared
launch or call is made again, and which calls can take the path (``lik_cupy._runtime.launch``,
``lik_cupy._runtime.prepared_calls``). The GPU side is in tests/test_nan_contract_gpu.py."""

import numpy as np
import pytest

from lik_cupy import _dispatch as dispatch
from lik_cupy._runtime import launch, prepared_calls
from lik_cupy._base.device import DeviceProps
from lik_cupy._validate import check_call, check_varlen


class _Mod:
    def get_function(self, name):
        raise AssertionError(f"no kernel but the forward one should be looked up here ({name})")


@pytest.fixture
def fake_gpu(monkeypatch):
    """An H100-like device whose kernels are never built: ``launches`` records every launch."""
    launches, built = [], []
    monkeypatch.setattr(launch, "device_properties", lambda device: DeviceProps("fake", 90, 132))
    monkeypatch.setattr(launch, "_kernel", lambda cfg, arch, device: built.append(cfg.name) or (_Mod(), 4242))
    monkeypatch.setattr(launch, "launch_raw", lambda *a: launches.append(a))
    monkeypatch.setattr(launch, "is_capturing", lambda stream: False)
    monkeypatch.setattr(launch.tma, "tile_map", lambda *a: ("map", a))  # no driver here to encode maps
    monkeypatch.setattr(launch.tma, "scale_map", lambda *a: ("scales", a))
    launch.clear_prepared()
    yield launches, built
    launch.clear_prepared()


def _problem(nq=2, lq=32, nd=50, ld=300, dim=128):
    return check_call(np.zeros((nq, lq, dim), np.float16), np.zeros((nd, ld, dim), np.float16), None, None, None,
                      None, pairs=False)


def test_a_prepared_launch_hands_the_driver_what_the_problem_says(fake_gpu):
    launches, built = fake_gpu
    p = _problem()
    fwd = launch.prepare(p, 0, esize=2, vec=True, use_tma=True, argmax=True)
    fwd.run(77, 1000, 2000, 0, 0, 3000, 0, 4000, 0, 0, 5000, 6000)
    (func, grid, threads, smem, stream, params, values, by_value), = launches
    assert (func, stream, threads, smem) == (4242, 77, fwd.cfg.threads, fwd.cfg.smem_bytes)
    assert params is launch._FWD_PARAMS and len(values) == len(launch._FWD_SIGNATURE)
    assert values[:9] == (1000, 2000, 0, 0, 3000, 0, 4000, 0, 0)
    assert values[11:18] == (5000, 6000, p.nq, p.nd, p.lq, p.ld, p.dim)
    assert values[22] == 0  # no zero-vector padding flags
    fwd.run(77, 1000, 2000, 0, 0, 3000, 0, 4000, 0, 0, 5000, 6000, zero_pad=7000)
    assert launches[-1][6][:22] == values[:22] and launches[-1][6][22] == 7000
    assert grid == fwd.plan.grid
    assert len(by_value) == (3 if fwd.cfg.tma else 0)
    # the same signature is prepared once; a swapped dispatch function or a cleared cache prepares anew
    assert launch.prepare(p, 0, esize=2, vec=True, use_tma=True, argmax=True) is fwd and fwd.current()
    dispatch.clear_caches()  # what a sweep or a test does after changing a table
    assert not fwd.current()
    again = launch.prepare(p, 0, esize=2, vec=True, use_tma=True, argmax=True)
    assert again is not fwd and built.count(fwd.cfg.name) == 2


def test_a_swapped_choice_is_seen_by_the_next_call(fake_gpu, monkeypatch):
    p = _problem()
    fwd = launch.prepare(p, 0, esize=2, vec=True, use_tma=False, argmax=False)
    forced = dispatch.choose_forward(90, "float16", 128, 32, False, False, False, 2, 300)
    monkeypatch.setattr(dispatch, "choose_forward", lambda *a, **k: forced)
    assert not fwd.current()
    assert launch.prepare(p, 0, esize=2, vec=True, use_tma=False, argmax=False).cfg == forced


def test_packed_documents_keep_their_token_count_in_graph_capture(fake_gpu, monkeypatch):
    # A token-split plan falls back to whole documents inside capture, with the same token count
    # (it bounds every packed document).
    launches, _ = fake_gpu
    q, t = np.zeros((1, 32, 128), np.float16), np.zeros((200_000, 128), np.float16)
    p = check_varlen(q, t, np.array([0, 100_000, 200_000]), None, None, None)
    fwd = launch.prepare(p, 0, esize=2, vec=True, use_tma=False, argmax=False, packed=True, ld_hint=100_000)
    assert fwd.plan.token_split
    monkeypatch.setattr(launch, "is_capturing", lambda stream: True)
    monkeypatch.setattr(launch.token_split, "launch", lambda *a: pytest.fail("no token split in capture"))
    fwd.run(1, 1, 1, 0, 0, 0, 0, 0, 0, 9, 1, 0)
    values = launches[-1][6]
    assert values[10] == 200_000 and launches[-1][1] == fwd.whole()[2].grid and not fwd.whole()[2].token_split


def test_only_device_arrays_of_one_framework_take_the_repeat_path():
    q = np.zeros((1, 4, 8), np.float16)
    assert prepared_calls.call_key("maxsim", (None, False, "auto", None), q, (q,)) is None
    assert prepared_calls.call_key("maxsim", (True, False, "auto", None), [[0.0]], ()) is None


def test_the_call_cache_is_bounded_and_the_oldest_stored_goes_first(monkeypatch):
    monkeypatch.setattr(prepared_calls, "MAX_CALLS", 3)
    prepared_calls.clear()

    class Call:
        @staticmethod
        def current():
            return True

    for k in range(3):
        prepared_calls.store(k, Call())
    assert prepared_calls.lookup(0) is not None
    prepared_calls.store(0, Call())  # stored again: the newest
    prepared_calls.store(3, Call())
    assert sorted(prepared_calls._calls) == [0, 2, 3]
    prepared_calls.clear()
    assert prepared_calls.lookup(2) is None


class _FakeArray:
    def __init__(self, ptr, wide=False):
        self.ptr, self.wide = ptr, wide


class _FakeAdapter:
    """The adapter calls a PreparedCall makes, over fake arrays (addresses only)."""

    def __init__(self):
        self.narrowed = []

    def address(self, x):
        return x.ptr

    def stream_handle(self, device):
        return 7

    def new_empty(self, shape, dtype, device):
        return _FakeArray(0x1000)

    def to_int32(self, x):
        self.narrowed.append(x)
        return _FakeArray(x.ptr + 0x100)

    def fill(self, x, value):
        pass


class _FakeLaunch:
    partials = 0

    def __init__(self, tagged):
        self.tagged_doc_lengths = tagged
        self.runs = []

    def run(self, *args, **kw):
        self.runs.append(args + tuple(kw.items()))


@pytest.mark.parametrize("tagged", [True, False])
def test_repeat_call_passes_int64_document_lengths_as_the_tile_reads_them(monkeypatch, tagged):
    # Tiles that read int64 document lengths get the tagged address; the others (INT8 and multi-query
    # argmax tiles) an int32 copy; query lengths are narrowed for every tile. The NaN pass reads the
    # caller's arrays.
    adapter, fwd, marked = _FakeAdapter(), _FakeLaunch(tagged), []
    monkeypatch.setitem(prepared_calls._ADAPTERS, "fake", adapter)
    monkeypatch.setattr(prepared_calls, "_device", lambda: 0)
    monkeypatch.setattr(prepared_calls, "mark_invalid", lambda *a, **k: marked.append(k))
    p = _problem(nq=2, lq=8, nd=5, ld=16, dim=64)
    call = prepared_calls.PreparedCall("fake", p, 0, fwd, False, (True, True, False), mark=True, caller="maxsim")
    ql, dl = _FakeArray(0x2000, True), _FakeArray(0x3000, True)
    call(_FakeArray(0x4000), _FakeArray(0x5000), None, None, ql, dl, None)
    (args,) = fwd.runs
    q_arg, d_arg = args[5], args[7]  # run(stream, q, d, q_scale, d_scale, ql, qm, dl, ...)
    assert q_arg == 0x2100
    assert d_arg == (0x3001 if tagged else 0x3100)
    assert adapter.narrowed == ([ql] if tagged else [ql, dl])
    (k,) = marked
    assert (k["q_len"].ptr, k["q_len"].wide, k["d_len"].ptr, k["d_len"].wide) == (0x2000, 1, 0x3000, 1)


def test_repeat_call_hands_the_zero_padding_flags_to_the_kernel(monkeypatch):
    adapter, fwd = _FakeAdapter(), _FakeLaunch(True)
    monkeypatch.setitem(prepared_calls._ADAPTERS, "fake", adapter)
    monkeypatch.setattr(prepared_calls, "_device", lambda: 0)
    p = _problem(nq=2, lq=8, nd=5, ld=16, dim=64)
    call = prepared_calls.PreparedCall("fake", p, 0, fwd, False, (False, False, False), mark=False, caller="maxsim")
    call(_FakeArray(0x4000), _FakeArray(0x5000), None, None, None, None, None)
    call(_FakeArray(0x4000), _FakeArray(0x5000), None, None, None, None, None, _FakeArray(0x6000))
    assert fwd.runs[0][-1] == ("zero_pad", 0) and fwd.runs[1][-1] == ("zero_pad", 0x6000)


def test_repeat_call_makes_masked_flags_with_the_mask_spans(monkeypatch):
    # zero_pad="masked": one buffer holds the int32 spans [rows], then the uint8 flags the spans
    # kernel writes; the forward reads the flags from there.
    adapter, fwd, queued, sizes = _FakeAdapter(), _FakeLaunch(False), [], []
    monkeypatch.setitem(prepared_calls._ADAPTERS, "fake", adapter)
    monkeypatch.setattr(prepared_calls, "_device", lambda: 0)
    monkeypatch.setattr(adapter, "new_empty", lambda shape, dtype, device: sizes.append((shape, dtype)) or
                        _FakeArray(0x1000))
    monkeypatch.setattr(prepared_calls, "queue_mask_spans", lambda *a: queued.append(a))
    p = check_call(np.zeros((2, 8, 64), np.float16), np.zeros((5, 16, 64), np.float16), None,
                   np.ones((5, 16), bool), None, None, pairs=False)
    call = prepared_calls.PreparedCall("fake", p, 0, fwd, False, (False, False, False), mark=False, caller="maxsim")
    call(_FakeArray(0x4000), _FakeArray(0x5000), None, _FakeArray(0x6000), None, None, None, "masked")
    call(_FakeArray(0x4000), _FakeArray(0x5000), None, _FakeArray(0x6000), None, None, None)
    assert ((5 + 2,), "int32") in sizes and ((5,), "int32") in sizes
    assert queued[0][2:] == (0x6000, 5, 16, 0x1000, 0x1000 + 4 * 5) and queued[1][-1] == 0
    assert fwd.runs[0][-1] == ("zero_pad", 0x1000 + 4 * 5) and fwd.runs[1][-1] == ("zero_pad", 0)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_prepared_backward_of_float32_accumulates_in_dd_itself(monkeypatch, dtype):
    """The atomic method sums dD in float32; a float32 dD takes the sums itself (no float32 copy to
    allocate, clear and cast back), other dtypes get the copy and the cast."""
    cupy = pytest.importorskip("cupy")  # (its runtime's memset, replaced: no GPU is used)

    made, cleared, launches = [], [], []

    class Adapter:  # addresses stand in for arrays
        def stream_handle(self, device):
            return 5

        def new_empty(self, shape, dt, device):
            made.append((tuple(shape), dt))
            return 1000 * len(made)

        def address(self, x):
            return x

    monkeypatch.setitem(prepared_calls._ADAPTERS, "fake", Adapter())
    monkeypatch.setattr(prepared_calls, "_device", lambda: 0)
    monkeypatch.setattr(cupy.cuda.runtime, "memsetAsync", lambda ptr, value, n, stream: cleared.append((ptr, n)))
    monkeypatch.setattr(prepared_calls, "launch_raw", lambda *a: launches.append(a))
    nq, nd, lq, ld, dim, rows = 2, 3, 4, 5, 8, 15
    call = prepared_calls.PreparedBackward("fake", None, 0, 11, 22, (1, 1, 1), (1, 1, 1), 256,
                                           (nq, nd, lq, ld, dim, 0, rows), ((nq * lq, dim), (rows, dim)), dtype)
    dq, dd = call(1, 2, 3, 4, None)
    assert made[:2] == [((nq * lq, dim), dtype), ((rows, dim), dtype)] and (dq, dd) == (1000, 2000)
    acc = dd if dtype == "float32" else 3000
    assert made[2:] == ([] if dtype == "float32" else [((rows * dim,), "float32")])
    assert cleared == [(acc, rows * dim * 4)]
    assert [launch[0] for launch in launches] == ([11] if dtype == "float32" else [11, 22])
    assert launches[0][6][5:7] == (dq, acc)  # dQ, and where the atomics add
    if dtype != "float32":
        assert launches[1][6] == (acc, dd, rows * dim)
