"""Every argument error is a ValueError/TypeError naming the argument and what was expected,
raised before any scoring work runs. CPU only."""

from __future__ import annotations

import importlib
import pathlib
import re

import ml_dtypes
import numpy as np
import pytest

import lik_cupy
from lik_cupy import _cpu as cpu
from lik_cupy import _dispatch as dispatch
from lik_cupy import _maxsim_calls
from lik_cupy._dispatch import backend

E = re.escape
INDEX = pathlib.Path(__file__).parent / "data" / "fast_plaid" / "fast_plaid_nbits2"


@pytest.fixture(autouse=True)
def no_scoring(monkeypatch):
    """Validation must fail before the NumPy path (or any kernel) runs."""

    def boom(*a, **k):
        raise AssertionError("scoring ran although the arguments were invalid")

    monkeypatch.setattr(cpu, "maxsim_numpy", boom)
    monkeypatch.setattr(_maxsim_calls, "_gpu", boom)


def f16(*shape):
    return np.zeros(shape, np.float16)


def ms(*a, **k):
    k.setdefault("backend", "cpu")
    return lik_cupy.maxsim(*a, **k)


def pairs(*a, **k):
    k.setdefault("backend", "cpu")
    return lik_cupy.maxsim_pairs(*a, **k)


class FakeDLPack:
    """A foreign DLPack producer (host memory) that is not a NumPy array."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, *a, **k):
        return self._a.__dlpack__(*a, **k)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


# ---------------------------------------------------------------- ranks and dims


@pytest.mark.parametrize("shape", [(128,), (2, 3, 4, 128), ()])
def test_q_rank(shape):
    with pytest.raises(ValueError, match=E("Q must be [Nq, Lq, d] or [Lq, d]; got shape " + str(list(shape)))):
        ms(f16(*shape), f16(5, 7, 128))


@pytest.mark.parametrize("shape", [(128,), (1, 2, 3, 4, 128)])
def test_d_rank(shape):
    with pytest.raises(ValueError, match=E("D must be [Nd, Ld, d], [Nq, K, Ld, d] or [Ld, d]; got shape " + str(list(shape)))):
        ms(f16(2, 3, 128), f16(*shape))


@pytest.mark.parametrize("dshape", [(5, 7, 96), (7, 96), (2, 4, 7, 96)])
def test_dim_mismatch(dshape):
    with pytest.raises(ValueError, match="D has dim 96 but Q has dim 128"):
        ms(f16(2, 3, 128), f16(*dshape))


@pytest.mark.parametrize("qshape", [(64,), (2, 3, 4, 64), (2, 3, 64, 4)])
@pytest.mark.parametrize("int8", [False, True])
def test_varlen_checks_ranks_before_dims(qshape, int8):
    # a Q of the wrong rank is reported as such, whatever its last axis (it was "D_tokens has dim 64 but Q has dim 4")
    q, d = f16(*qshape), f16(10, 64)
    call = lik_cupy.maxsim_varlen
    if int8:
        d8, ds = np.zeros((10, 64), np.int8), np.ones(10, np.float32)

        def call(q, d, off, **k):
            return lik_cupy.maxsim_int8_varlen(q, d8, ds, off, **k)
    msg = f"Q must be [Nq, Lq, d] or [Lq, d] (or packed [Tq, d] with q_offsets); got shape {list(qshape)}"
    with pytest.raises(ValueError, match=E(msg)):
        call(q, d, [0, 4, 10], backend="cpu")
    with pytest.raises(ValueError, match=E("with q_offsets, Q must be packed tokens [Tq, d]; got shape [2, 3, 64]")):
        lik_cupy.maxsim_varlen(f16(2, 3, 64), d, [0, 4, 10], q_offsets=[0, 1, 2], backend="cpu")
    with pytest.raises(ValueError, match=E("D_tokens has dim 64 but Q has dim 32")):  # dims once the ranks are right
        lik_cupy.maxsim_varlen(f16(2, 3, 32), d, [0, 4, 10], backend="cpu")


def test_dim_zero():
    with pytest.raises(ValueError, match="embedding dim 0"):
        ms(f16(2, 3, 0), f16(4, 5, 0))


def test_gpu_dim_limit_before_any_launch(monkeypatch):
    monkeypatch.setattr(backend, "gpu_available", lambda: True)
    wide = dispatch.MAX_DIM + 8
    with pytest.raises(ValueError, match=rf"float16 scoring on the GPU needs dim up to {dispatch.MAX_DIM}; got dim {wide}"):
        ms(f16(2, 3, wide), f16(4, 5, wide), backend="gpu")


def test_candidates_need_3d_query():
    with pytest.raises(ValueError, match=E("D [Nq, K, Ld, d] (per-query candidates) needs Q [Nq, Lq, d]; got Q shape [3, 64]")):
        ms(f16(3, 64), f16(3, 4, 5, 64))


def test_candidates_wrong_leading_dim():
    with pytest.raises(ValueError, match="D has candidate sets for 4 queries but Q has 3 queries"):
        ms(f16(3, 8, 64), f16(4, 2, 5, 64))


def test_pairs_batch_mismatch():
    with pytest.raises(ValueError, match="D has 5 documents but Q has 4 queries: maxsim_pairs scores Q\\[b\\] with D\\[b\\]"):
        pairs(f16(4, 8, 64), f16(5, 9, 64))


@pytest.mark.parametrize("qs,ds", [((8, 64), (4, 9, 64)), ((4, 8, 64), (9, 64)), ((4, 8, 64), (4, 1, 9, 64))])
def test_pairs_ranks(qs, ds):
    with pytest.raises(ValueError, match=E("maxsim_pairs needs Q [B, Lq, d] and D [B, Ld, d]")):
        pairs(f16(*qs), f16(*ds))


# ---------------------------------------------------------------- dtypes and frameworks


@pytest.mark.parametrize("bad", [np.int32, np.int64, np.bool_, np.complex64, np.complex128])
@pytest.mark.parametrize("which", ["Q", "D"])
def test_bad_float_dtype(bad, which):
    q, d = f16(2, 3, 16), f16(4, 5, 16)
    if which == "Q":
        q = q.astype(bad)
    else:
        d = d.astype(bad)
    name = np.dtype(bad).name
    with pytest.raises(TypeError, match=E(f"{which} has dtype {name}; expected float16, bfloat16, float32 or float64")):
        ms(q, d)


def test_float64_host_arrays_score_on_the_cpu_and_where_the_gpu_takes_them(monkeypatch):
    q, d = np.zeros((2, 3, 16)), np.zeros((4, 5, 16))
    with pytest.raises(AssertionError, match="scoring ran"):  # valid: it reaches the NumPy path
        ms(q, d)
    monkeypatch.setattr(backend, "gpu_available", lambda: True)
    with pytest.raises(AssertionError, match="scoring ran"):  # "auto" with host float64: the CPU, GPU or not
        ms(q, d, backend="auto")
    # The forward and the backward take float64 on the GPU (at float32 accuracy, float64 results);
    # retrieve and the INT8 functions refuse it there rather than round it silently.
    assert backend.use_gpu("gpu", None, float64=True, float64_gpu=True)
    assert backend.use_gpu("auto", 0, float64=True, float64_gpu=True)
    assert not backend.use_gpu("auto", None, float64=True, float64_gpu=True)
    msg = "float64 inputs with backend='gpu': this call's GPU kernels take float16, bfloat16 or float32. Cast to float32"
    with pytest.raises(TypeError, match=E(msg)):
        lik_cupy.retrieve(q, d, 2, backend="gpu")
    d8, ds = lik_cupy.quantize_int8(np.ones((4, 5, 16), np.float32), backend="cpu")
    with pytest.raises(TypeError, match=E(msg)):  # a float64 Q quantised on the fly: the CPU only too
        lik_cupy.maxsim_int8(q, d8, ds, backend="gpu")
    with pytest.raises(TypeError, match=E("float64 inputs with arrays on the GPU")):  # device arrays, "auto"
        backend.use_gpu("auto", 0, float64=True)


@pytest.mark.parametrize("qd,dd", [(np.float16, np.float32), (np.float32, ml_dtypes.bfloat16), (ml_dtypes.bfloat16, np.float16)])
def test_q_d_dtype_mismatch(qd, dd):
    q, d = np.zeros((2, 3, 16), qd), np.zeros((4, 5, 16), dd)
    msg = f"D has dtype {np.dtype(dd).name} but Q has {np.dtype(qd).name}: cast one so both match"
    with pytest.raises(TypeError, match=E(msg)):
        ms(q, d)


@pytest.mark.parametrize("which", ["Q", "D"])
def test_not_an_array(which):
    q, d = f16(2, 3, 16), f16(4, 5, 16)
    if which == "Q":
        q = q.tolist()
    else:
        d = d.tolist()
    with pytest.raises(TypeError, match=E(f"{which}: expected a NumPy, CuPy, PyTorch or JAX array (or any DLPack array), got list")):
        ms(q, d)


def test_mixed_frameworks_dlpack():
    with pytest.raises(TypeError, match="Q is a numpy array but D is a dlpack array: pass both from one framework"):
        ms(f16(2, 3, 16), FakeDLPack(f16(4, 5, 16)))
    with pytest.raises(TypeError, match="Q is a dlpack array but D is a numpy array"):
        ms(FakeDLPack(f16(2, 3, 16)), f16(4, 5, 16))
    with pytest.raises(TypeError, match="d_mask is a dlpack array but Q is a numpy array"):
        ms(f16(2, 3, 16), f16(4, 5, 16), d_mask=FakeDLPack(np.ones((4, 5), bool)))
    with pytest.raises(TypeError, match="q_lengths is a dlpack array but Q is a numpy array"):
        ms(f16(2, 3, 16), f16(4, 5, 16), q_lengths=FakeDLPack(np.ones(2, np.int32)))


def test_mixed_frameworks_torch():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="Q is a numpy array but D is a torch array"):
        ms(f16(2, 3, 16), torch.zeros(4, 5, 16, dtype=torch.float16))
    with pytest.raises(TypeError, match="q_mask is a numpy array but Q is a torch array"):
        ms(torch.zeros(2, 3, 16, dtype=torch.float16), torch.zeros(4, 5, 16, dtype=torch.float16),
           q_mask=np.ones((2, 3), bool))
    with pytest.raises(TypeError, match="D has dtype float32 but Q has bfloat16"):
        ms(torch.zeros(2, 3, 16, dtype=torch.bfloat16), torch.zeros(4, 5, 16))


# ---------------------------------------------------------------- masks and lengths


@pytest.mark.parametrize("side", ["q", "d"])
@pytest.mark.parametrize("bad", [np.uint8, np.int32, np.float32])
def test_mask_not_boolean(side, bad):
    q, d = f16(2, 3, 16), f16(4, 5, 16)
    m = np.ones((2, 3) if side == "q" else (4, 5), bad)
    with pytest.raises(TypeError, match=E(f"{side}_mask must be boolean (True = valid token), got dtype {np.dtype(bad).name}")):
        ms(q, d, **{f"{side}_mask": m})


@pytest.mark.parametrize(
    "qs,ds,side,mshape,expect",
    [
        ((2, 3, 16), (4, 5, 16), "q", (3, 2), [2, 3]),
        ((2, 3, 16), (4, 5, 16), "q", (2,), [2, 3]),
        ((2, 3, 16), (4, 5, 16), "d", (4, 5, 1), [4, 5]),
        ((2, 3, 16), (4, 5, 16), "d", (5,), [4, 5]),
        ((3, 16), (4, 5, 16), "q", (1, 3), [3]),
        ((2, 3, 16), (2, 4, 5, 16), "d", (4, 5), [2, 4, 5]),
    ],
)
def test_mask_shape(qs, ds, side, mshape, expect):
    what = "Q" if side == "q" else "D"
    msg = f"{side}_mask has shape {list(mshape)}; expected {expect} ({what}'s shape without its last axis)"
    with pytest.raises(ValueError, match=E(msg)):
        ms(f16(*qs), f16(*ds), **{f"{side}_mask": np.ones(mshape, bool)})


def test_mask_not_an_array():
    with pytest.raises(TypeError, match="d_mask: expected a NumPy"):
        ms(f16(2, 3, 16), f16(4, 5, 16), d_mask=[[True] * 5] * 4)


@pytest.mark.parametrize("side", ["q", "d"])
def test_both_mask_and_lengths(side):
    q, d = f16(2, 3, 16), f16(4, 5, 16)
    rows, length = ((2, 3) if side == "q" else (4, 5))
    kw = {f"{side}_mask": np.ones((rows, length), bool), f"{side}_lengths": np.full(rows, length)}
    with pytest.raises(ValueError, match=f"pass either {side}_mask or {side}_lengths, not both"):
        ms(q, d, **kw)


@pytest.mark.parametrize("side", ["q", "d"])
@pytest.mark.parametrize("kind", ["numpy", "list"])
def test_lengths_out_of_range(side, kind):
    q, d = f16(2, 3, 16), f16(4, 5, 16)
    rows, limit = ((2, 3) if side == "q" else (4, 5))
    for bad, shown in ((-1, -1), (limit + 1, limit + 1), (-(2**40), -(2**40))):
        lens = np.full(rows, 1, np.int64)
        lens[-1] = bad
        arg = lens if kind == "numpy" else lens.tolist()
        with pytest.raises(ValueError, match=E(f"{side}_lengths holds {shown}; every length must be in [0, {limit}]")):
            ms(q, d, **{f"{side}_lengths": arg})


def test_lengths_out_of_range_candidates_and_pairs():
    with pytest.raises(ValueError, match=E("d_lengths holds 6; every length must be in [0, 5]")):
        ms(f16(2, 3, 16), f16(2, 4, 5, 16), d_lengths=np.array([[1, 2, 3, 4], [5, 6, 0, 0]]))
    with pytest.raises(ValueError, match=E("q_lengths holds 4; every length must be in [0, 3]")):
        pairs(f16(2, 3, 16), f16(2, 5, 16), q_lengths=[3, 4])
    with pytest.raises(ValueError, match=E("q_lengths holds -1; every length must be in [0, 3]")):
        ms(f16(3, 16), f16(2, 5, 16), q_lengths=-1)


@pytest.mark.parametrize(
    "qs,ds,side,lshape,expect,what",
    [
        ((2, 3, 16), (4, 5, 16), "q", (3,), [2], "query"),
        ((2, 3, 16), (4, 5, 16), "q", (2, 1), [2], "query"),
        ((2, 3, 16), (4, 5, 16), "d", (2,), [4], "document"),
        ((2, 3, 16), (4, 5, 16), "d", (4, 5), [4], "document"),
        ((2, 3, 16), (2, 4, 5, 16), "d", (4,), [2, 4], "document"),
    ],
)
def test_lengths_shape(qs, ds, side, lshape, expect, what):
    msg = f"{side}_lengths has shape {list(lshape)}; expected {expect} (one length per {what})"
    with pytest.raises(ValueError, match=E(msg)):
        ms(f16(*qs), f16(*ds), **{f"{side}_lengths": np.zeros(lshape, np.int32)})


def test_lengths_of_one_query_or_document_say_an_int():
    """Q [Lq, d] with q_lengths [1] said 'expected [] (one length per query)', and q_lengths=[], which
    that reads as, was then refused in turn ('has shape [0]; expected []'); the error now says the
    length is one int."""
    for q_lengths in ([1], []):
        with pytest.raises(ValueError, match=E(f"q_lengths has shape [{len(q_lengths)}]; expected [] (one int: Q is "
                                               "one query [Lq, d])")):
            ms(f16(3, 16), f16(4, 5, 16), q_lengths=q_lengths)
    with pytest.raises(ValueError, match=E("d_lengths has shape [1]; expected [] (one int: D is one document [Ld, d])")):
        ms(f16(2, 3, 16), f16(5, 16), d_lengths=np.array([2]))
    with pytest.raises(ValueError, match=E("q_lengths has shape [1]; expected [] (one int: Q is one query [Lq, d])")):
        lik_cupy.maxsim_varlen(f16(3, 16), f16(5, 16), [0, 5], q_lengths=[2], backend="cpu")


def test_lengths_shape_python_list():
    with pytest.raises(ValueError, match=E("d_lengths has shape [3]; expected [4] (one length per document)")):
        ms(f16(2, 3, 16), f16(4, 5, 16), d_lengths=[1, 2, 3])


@pytest.mark.parametrize("side", ["q", "d"])
@pytest.mark.parametrize("bad", [np.float32, np.float64, np.bool_, np.float16])
def test_lengths_non_integer_dtype(side, bad):
    rows = 2 if side == "q" else 4
    with pytest.raises(TypeError, match=E(f"{side}_lengths must be integers, got dtype {np.dtype(bad).name}")):
        ms(f16(2, 3, 16), f16(4, 5, 16), **{f"{side}_lengths": np.ones(rows, bad)})


def test_lengths_non_integer_python_list_of_strings():
    with pytest.raises(TypeError, match="d_lengths must hold integers"):
        ms(f16(2, 3, 16), f16(4, 5, 16), d_lengths=["a", "b", "c", "d"])


def test_lengths_python_list_of_floats():
    with pytest.raises(TypeError, match="q_lengths must"):
        ms(f16(2, 3, 16), f16(4, 5, 16), q_lengths=[1.5, 2.7])


def test_lengths_ragged_python_list():
    with pytest.raises((TypeError, ValueError), match="d_lengths"):
        ms(f16(2, 3, 16), f16(2, 4, 5, 16), d_lengths=[[1, 2, 3, 4], [3]])


# ---------------------------------------------------------------- backend


@pytest.mark.parametrize("bad", ["GPU", "cuda", "", None, "numpy", np.array(["cpu", "gpu"]), np.array(["cpu"])])
def test_bad_backend(bad):
    # (an array was compared elementwise: two entries raised NumPy's 'truth value of an array ... is
    # ambiguous', one was taken as its entry)
    with pytest.raises(ValueError, match=E(f"backend must be one of ('auto', 'gpu', 'cpu'), got {bad!r}")):
        ms(f16(2, 3, 16), f16(4, 5, 16), backend=bad)
    with pytest.raises(ValueError, match="backend must be one of"):
        pairs(f16(2, 3, 16), f16(2, 5, 16), backend=bad)


def test_backend_gpu_without_gpu(monkeypatch):
    monkeypatch.setattr(backend, "gpu_available", lambda: False)
    with pytest.raises(RuntimeError, match="backend='gpu' but no CUDA GPU is visible"):
        ms(f16(2, 3, 16), f16(4, 5, 16), backend="gpu")
    with pytest.raises(RuntimeError, match="backend='gpu' but no CUDA GPU is visible"):
        pairs(f16(2, 3, 16), f16(2, 5, 16), backend="gpu")


def test_argument_errors_come_before_the_backend_check(monkeypatch):
    monkeypatch.setattr(backend, "gpu_available", lambda: False)
    with pytest.raises(ValueError, match="D has dim 8 but Q has dim 16"):
        ms(f16(2, 3, 16), f16(4, 5, 8), backend="gpu")


def test_valid_calls_reach_scoring():
    # the autouse fixture's stand-in proves that valid arguments get through validation
    with pytest.raises(AssertionError, match="scoring ran"):
        ms(f16(2, 3, 16), f16(4, 5, 16), q_lengths=[3, 0], d_mask=np.ones((4, 5), bool))


def test_32bit_extents_named_in_the_error():
    from lik_cupy._validate import check_32bit

    check_32bit(Nq=2**31 - 1, grid=1)
    with pytest.raises(ValueError, match=r"grid = 2147483648 does not fit the kernel's 32-bit index; split the call"):
        check_32bit(Nq=5, grid=2**31)


def test_mask_spans_refuse_a_row_past_int32():
    # lik_mask_spans takes the row length as an int: a mask of 2**31 tokens a row (a Corpus's spans are
    # made at its construction, before any forward check) failed in the launch's parameter packing with
    # a struct.error that named neither Ld nor what fits
    from types import SimpleNamespace

    from lik_cupy._runtime.masks import mask_spans

    with pytest.raises(ValueError, match=r"Ld = 2147483648 does not fit the kernel's 32-bit index; split the call"):
        mask_spans(SimpleNamespace(shape=(1, 2**31)), 0)


# ---------------------------------------------------------------- arguments once accepted or badly named


def test_packed_corpora_refuse_masks_and_lengths():
    """retrieve and Corpus of packed tokens took d_lengths and d_mask, even garbage, and ignored them."""
    T, off, Q = np.ones((6, 8), np.float32), np.array([0, 2, 4, 6]), np.ones((1, 2, 8), np.float32)
    for kw in ({"d_lengths": [0, 0, 0]}, {"d_mask": np.zeros((3, 2), bool)}, {"d_lengths": "garbage"}):
        with pytest.raises(ValueError, match="packed documents .d_offsets. take no d_mask or d_lengths"):
            lik_cupy.retrieve(Q, T, 2, d_offsets=off, backend="cpu", **kw)
        with pytest.raises(ValueError, match="packed documents .d_offsets. take no d_mask or d_lengths"):
            lik_cupy.Corpus(T, d_offsets=off, **kw)


def test_torch_tensors_without_storage_are_named():
    torch = pytest.importorskip("torch")
    Q, D = torch.randn(2, 3, 8), torch.randn(4, 5, 8)
    with pytest.raises(TypeError, match=r"Q: torch tensors must be dense and strided .*torch.sparse_coo"):
        lik_cupy.maxsim(Q.to_sparse(), D)
    with pytest.raises(TypeError, match=r"d_lengths: torch tensors must be dense and strided"):
        lik_cupy.maxsim(Q, D, d_lengths=torch.tensor([1, 2, 3, 4]).to_sparse())
    with pytest.raises(ValueError, match="Q: torch tensors must be on a CUDA device or the CPU, got device meta"):
        lik_cupy.maxsim(torch.empty(2, 3, 8, device="meta"), D)


def test_scaled_and_quantiser_arguments_are_named():
    f32 = np.ones((2, 3, 16), np.float32)
    for call, name in [(lambda: lik_cupy.quantize_int8(None), "X"), (lambda: lik_cupy.quantize_fp8(None), "X"),
                       (lambda: lik_cupy.dequantize_fp8(None, np.ones(2, np.float32)), "X_fp8"),
                       (lambda: lik_cupy.maxsim_fp8(None, f32, np.ones((2, 3), np.float32)), "Q"),
                       (lambda: lik_cupy.maxsim_fp8(f32, None, np.ones((2, 3), np.float32)), "D")]:
        with pytest.raises(TypeError, match=f"^{name}: expected a NumPy"):
            call()


def test_corpus_options_are_checked_before_use():
    D = np.ones((3, 4, 8), np.float32)
    for bad in ("1G", [1], True):
        with pytest.raises(ValueError, match="max_gpu_bytes must be a non-negative integer"):
            lik_cupy.Corpus(D, max_gpu_bytes=bad)
    with pytest.raises(ValueError, match="max_gpu_bytes must be a positive integer, got True"):
        lik_cupy.retrieve(np.ones((1, 2, 8), np.float32), D, 2, max_gpu_bytes=True)
    with pytest.raises(ValueError, match="device must be a CUDA device ordinal"):
        lik_cupy.Corpus(D, device=-1)


def test_a_device_this_machine_lacks_is_named(monkeypatch):
    """Corpus(device=N), warmup(device=N) and PlaidIndex.to_device(N) with N past the GPUs there got
    CUDA's "invalid device ordinal", and to_device(True) copied to GPU 1. The GPU is stubbed."""
    cupy = pytest.importorskip("cupy")
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", lambda: 1)
    monkeypatch.setattr(backend, "gpu_available", lambda: True)
    monkeypatch.setattr(importlib.import_module("lik_cupy._runtime.warmup"), "gpu_available", lambda: True)
    monkeypatch.setattr(importlib.import_module("lik_cupy.plaid"), "gpu_available", lambda: True)
    D = np.ones((3, 4, 64), np.float32)
    index = lik_cupy.PlaidIndex.open(INDEX)
    calls = {"Corpus": lambda d: lik_cupy.Corpus(D, device=d), "warmup": lambda d: lik_cupy.warmup(device=d),
             "to_device": index.to_device}
    for name, call in calls.items():
        for n in (5, np.int64(1)):
            with pytest.raises(ValueError, match=E(f"device {n} does not exist: this machine has 1 visible GPU (0)")):
                call(n)
        for bad in (-1, True, np.True_, 1.0, "0"):
            with pytest.raises(ValueError, match=E("device must be a CUDA device ordinal (an int >= 0)")):
                call(bad)
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", lambda: 2)
    with pytest.raises(ValueError, match=E("device 2 does not exist: this machine has 2 visible GPUs (0..1)")):
        lik_cupy.warmup(device=2)


def test_plaid_flags_and_nbits_take_their_types():
    """normalize="no" normalised (a truthy string); nbits=np.int64(2) was refused as not 1, 2 or 4."""
    rng = np.random.default_rng(0)
    cen = rng.standard_normal((4, 8)).astype(np.float16)
    w = np.linspace(-1, 1, 4).astype(np.float32)
    codes, bits = rng.integers(0, 4, (2, 4)), rng.integers(0, 256, (2, 4, 2)).astype(np.uint8)
    Q = rng.standard_normal((1, 3, 8)).astype(np.float32)
    want = lik_cupy.maxsim_residual(Q, codes, bits, [4, 2], cen, w, 2, backend="cpu")
    np.testing.assert_array_equal(lik_cupy.maxsim_residual(Q, codes, bits, [4, 2], cen, w, np.int64(2), backend="cpu"),
                                  want)
    for call in (lambda: lik_cupy.maxsim_residual(Q, codes, bits, [4, 2], cen, w, 2, normalize="no", backend="cpu"),
                 lambda: lik_cupy.plaid.decompress_residuals(codes.reshape(-1), bits.reshape(-1, 2), cen, w, 2,
                                                             normalize=None)):
        with pytest.raises(TypeError, match="normalize must be True or False"):
            call()
    with pytest.raises(TypeError, match=r"nbits must be an integer \(1, 2 or 4\), got '2'"):
        lik_cupy.maxsim_residual(Q, codes, bits, [4, 2], cen, w, "2", backend="cpu")


def test_corpus_and_retrieve_name_the_documents_not_q():
    """The documents were checked as a stand-in call's D with a Q cut from them, so their errors named
    Q ("Q has dtype int16", "d_mask is a dlpack array but Q is a numpy array")."""
    Q, T, off = np.ones((1, 2, 8), np.float32), np.ones((6, 8), np.float32), np.array([0, 2, 6])
    D, D8, ds = np.ones((3, 4, 8), np.float32), np.ones((3, 4, 8), np.int8), np.ones((3, 4), np.float32)
    cases = [
        (lambda: lik_cupy.Corpus(np.ones((3, 4, 8), np.int16)), TypeError, "D has dtype int16; expected float16"),
        (lambda: lik_cupy.Corpus(np.ones((6, 8), np.int16), d_offsets=off), TypeError, "D has dtype int16"),
        (lambda: lik_cupy.Corpus(np.ones((3, 4, 0), np.float32)), ValueError, "D has embedding dim 0"),
        (lambda: lik_cupy.Corpus(np.ones((6, 0), np.float32), d_offsets=off), ValueError, "D has embedding dim 0"),
        (lambda: lik_cupy.Corpus(D, d_mask=FakeDLPack(np.ones((3, 4), bool))), TypeError,
         "d_mask is a dlpack array but D is a numpy array"),
        (lambda: lik_cupy.Corpus(D8, d_scales=ds, d_lengths=FakeDLPack(np.ones(3, np.int64))), TypeError,
         "d_lengths is a dlpack array but D is a numpy array"),
        (lambda: lik_cupy.Corpus(T, d_offsets=FakeDLPack(off)), TypeError,
         "d_offsets is a dlpack array but D is a numpy array"),
        (lambda: lik_cupy.retrieve(Q, D, 2, d_lengths=FakeDLPack(np.ones(3, np.int64)), backend="cpu"), TypeError,
         "d_lengths is a dlpack array but D is a numpy array"),
        (lambda: lik_cupy.retrieve(Q, [(T, FakeDLPack(off))], 2, backend="cpu"), TypeError,
         "shard 0 offsets is a dlpack array but shard 0 is a numpy array"),
    ]
    for call, err, msg in cases:
        with pytest.raises(err, match=E(msg)):
            call()


def test_ragged_candidates_say_what_was_expected():
    """A ragged list of candidates gave NumPy's "inhomogeneous shape" error."""
    corpus = lik_cupy.Corpus(np.ones((3, 4, 8), np.float32), device="cpu")
    with pytest.raises(ValueError, match=E("candidates is a ragged list (its rows differ in length); expected "
                                           "[Nq, K] with Nq = 2: K indices for every query")):
        corpus.rerank(np.ones((2, 2, 8), np.float32), [[0, 1], [2]])


def test_integers_past_int64_are_out_of_range():
    """A list holding 2**70 (or 2**64 - 1 beside a smaller int) is an object or float64 array to NumPy,
    and was reported as a type error ("must hold integers", "got dtype object")."""
    Q, D, T = np.ones((1, 2, 8), np.float32), np.ones((3, 4, 8), np.float32), np.ones((6, 8), np.float32)
    big = 2**70
    index = lik_cupy.PlaidIndex.open(INDEX)
    cases = [
        (lambda: ms(Q, D, d_lengths=[big, 1, 1]), "d_lengths", big),
        (lambda: ms(Q, D, d_lengths=[2**64 - 1, 1, 1]), "d_lengths", 2**64 - 1),
        (lambda: ms(Q[0], D, q_lengths=big), "q_lengths", big),
        (lambda: lik_cupy.maxsim_varlen(Q, T, [0, 3, big], backend="cpu"), "d_offsets", big),
        (lambda: lik_cupy.retrieve(Q, D, 2, d_lengths=[1, -big, 1], backend="cpu"), "d_lengths", -big),
        (lambda: lik_cupy.Corpus(D, ids=[0, 1, big]), "ids", big),
        (lambda: lik_cupy.Corpus(D, device="cpu").rerank(Q, [[0, big]]), "candidates", big),
        (lambda: index.residuals([0, big]), "doc_ids", big),
        (lambda: index.rerank(np.ones((1, 2, index.dim), np.float32), [[0, big]], backend="cpu"), "candidate_ids",
         big),
    ]
    for call, name, value in cases:
        with pytest.raises(ValueError, match=E(f"{name} holds {value}; every entry must fit int64")):
            call()


def test_flags_take_booleans_only():
    """return_argmax="no" (a truthy string) returned the argmax, and validate="no" validated; every public
    on/off option now takes True or False (NumPy's bools too), validate also None."""
    Q, D, T, off = f16(1, 2, 16), f16(3, 4, 16), f16(6, 16), np.array([0, 2, 6])
    D8, ds = np.ones((3, 4, 16), np.int8), np.ones((3, 4), np.float32)
    rng = np.random.default_rng(0)
    cen, w = rng.standard_normal((4, 16)).astype(np.float16), np.linspace(-1, 1, 4).astype(np.float32)
    codes, bits = rng.integers(0, 4, (3, 4)), rng.integers(0, 256, (3, 4, 4)).astype(np.uint8)
    H, W = np.ones((3, 4, 8), np.float32), np.ones((16, 8), np.float32)
    index = lik_cupy.PlaidIndex.open(INDEX)
    calls = {
        "return_argmax": [lambda v: ms(Q, D, return_argmax=v), lambda v: pairs(Q, D[:1], return_argmax=v),
                          lambda v: lik_cupy.maxsim_varlen(Q, T, off, return_argmax=v, backend="cpu"),
                          lambda v: lik_cupy.maxsim_int8(Q, D8, ds, return_argmax=v, backend="cpu"),
                          lambda v: lik_cupy.maxsim_int8_varlen(Q, D8[0], ds[0], [0, 4], return_argmax=v,
                                                                backend="cpu"),
                          lambda v: lik_cupy.maxsim_fp8(Q, D8.view(np.uint8), ds, return_argmax=v, backend="cpu"),
                          lambda v: lik_cupy.maxsim_residual(Q, codes, bits, None, cen, w, 2, return_argmax=v,
                                                             backend="cpu"),
                          lambda v: lik_cupy.maxsim_residual_varlen(Q, codes[0], bits[0], [0, 4], cen, w, 2,
                                                                    return_argmax=v, backend="cpu"),
                          lambda v: index.rerank(np.ones((1, 2, index.dim), np.float32), [[0]], return_argmax=v,
                                                 backend="cpu"),
                          lambda v: lik_cupy.maxsim_from_hidden(Q.astype(np.float32), H, W, return_argmax=v,
                                                                backend="cpu")],
        "validate": [lambda v: ms(Q, D, validate=v), lambda v: lik_cupy.maxsim_varlen(Q, T, off, validate=v),
                     lambda v: lik_cupy.maxsim_int8(Q, D8, ds, validate=v, backend="cpu"),
                     lambda v: lik_cupy.maxsim_backward(np.ones((1, 3), np.float32), Q, D,
                                                        np.zeros((1, 3, 2), np.int32), validate=v, backend="cpu"),
                     lambda v: lik_cupy.maxsim_residual_varlen(Q, codes[0], bits[0], [0, 4], cen, w, 2, validate=v,
                                                               backend="cpu"),
                     lambda v: lik_cupy.maxsim_from_hidden(Q.astype(np.float32), H, W, validate=v, backend="cpu"),
                     lambda v: lik_cupy.maxsim_from_hidden_backward(np.ones((1, 3), np.float32), Q.astype(np.float32),
                                                                    H, W, None, np.zeros((1, 3, 2), np.int32),
                                                                    validate=v, backend="cpu")],
        "validate_offsets": [lambda v: lik_cupy.maxsim_varlen(Q, T, off, validate_offsets=v, backend="cpu"),
                             lambda v: lik_cupy.maxsim_int8_varlen(Q, D8[0], ds[0], [0, 4], validate_offsets=v,
                                                                   backend="cpu")],
        "ids": [lambda v: lik_cupy.Corpus.from_shards(pathlib.Path(__file__).parents[1] / "examples" / "shard0",
                                                      device="cpu", ids=v)],
    }
    for name, fns in calls.items():
        for fn in fns:
            for bad in ("no", 1, None if name != "validate" else "False"):
                with pytest.raises(TypeError, match=f"{name} must be (None, )?True or False, got {bad!r}"):
                    fn(bad)
    with pytest.raises(AssertionError, match="scoring ran"):  # NumPy's bools are bools
        ms(Q, D, return_argmax=np.True_, validate=np.False_)
    pytest.importorskip("torch")
    import torch

    import lik_cupy.torch as lt

    t = torch.ones(1, 2, 16)
    for fn in (lambda: lt.maxsim(t, torch.ones(3, 4, 16), return_argmax="no"),
               lambda: lt.maxsim_varlen(t, torch.ones(6, 16), [0, 2, 6], return_argmax="no"),
               lambda: lt.maxsim_from_hidden(t, torch.ones(3, 4, 8), torch.ones(16, 8), return_argmax="no")):
        with pytest.raises(TypeError, match="return_argmax must be True or False, got 'no'"):
            fn()


@pytest.mark.parametrize("kw, err, match", [
    (dict(dims="128"), TypeError, "dims must be a tuple or list of embedding dims, ints >= 1, got '128'"),
    (dict(dims=128), TypeError, "dims must be a tuple or list"),
    (dict(dims=(0,)), ValueError, "dims holds 0; expected embedding dims, ints >= 1"),
    (dict(dtypes="float16"), TypeError, "dtypes must be a tuple or list of dtype names"),
    (dict(dtypes=("float16", "fp16")), ValueError,
     "dtypes holds 'fp16'; expected dtype names (float16, bfloat16, float32, int8, float8_e4m3fn)"),
    (dict(query_lengths=(-1,)), ValueError, "query_lengths holds -1"),
    (dict(argmax=True), TypeError, "argmax must be a tuple or list of bools"),
    (dict(argmax=("x",)), ValueError, "argmax holds 'x'; expected bools"),
    (dict(device=-1), ValueError, "device must be a CUDA device ordinal"),
])
def test_warmup_checks_its_arguments_before_looking_for_a_gpu(kw, err, match):
    # (on a GPU, dims="128" reached the kernel selection as dims "1", "2", "8": a TypeError of string
    # formatting; argmax=True was "'bool' object is not iterable"; a dtype name the kernels lack was
    # found only there, and without a GPU came back as "no CUDA GPU is visible")
    with pytest.raises(err, match=E(match)):
        lik_cupy.warmup(**kw)


def test_option_values_of_no_string_are_named():
    """With torch tensors (the repeat path's key holds the options) backend=["cpu"], a float16 call's
    precision=["fp32"] and maxsim_backward's method=["csr"] raised 'unhashable type: list'; a NumPy
    array of two names raised NumPy's 'truth value of an array ... is ambiguous'. Each now names
    its argument and the values it takes."""
    torch = pytest.importorskip("torch")
    Q, D = torch.zeros(1, 2, 16, dtype=torch.float16), torch.zeros(3, 4, 16, dtype=torch.float16)
    g, a = torch.ones(1, 3), torch.zeros(1, 3, 2, dtype=torch.int32)
    two = np.array(["cpu", "gpu"])
    for bad in (["cpu"], {}, two):
        with pytest.raises(ValueError, match="backend must be one of"):
            lik_cupy.maxsim(Q, D, backend=bad)
        with pytest.raises(ValueError, match="backend must be one of"):
            lik_cupy.maxsim_varlen(Q, D[0], [0, 4], backend=bad)
        with pytest.raises(ValueError, match="backend must be one of"):
            lik_cupy.maxsim_backward(g, Q, D, a, backend=bad)
        with pytest.raises(ValueError, match="precision must be one of"):
            ms(Q, D, precision=bad)
        with pytest.raises(ValueError, match="precision must be one of"):
            ms(Q.float(), D.float(), precision=bad)
        with pytest.raises(ValueError, match="method must be one of"):
            lik_cupy.maxsim_backward(g, Q, D, a, method=bad, backend="cpu")
    with pytest.raises(ValueError, match="set_precision must be one of"):
        lik_cupy.set_precision(two)
