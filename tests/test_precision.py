"""The precision contract's rules (``lik_cupy.precision``) and the kernels they choose, without a GPU.
The GPU's accuracy under each precision is tests/test_precision_gpu.py."""

import sys
import types

import numpy as np
import pytest

import lik_cupy
from lik_cupy import _dispatch as dispatch
from lik_cupy._dispatch.precision import fp32_accurate


@pytest.fixture(autouse=True)
def _no_process_default(monkeypatch):
    monkeypatch.delenv("LIK_PRECISION", raising=False)
    monkeypatch.delenv("CUPY_TF32", raising=False)
    lik_cupy.set_precision(None)
    yield
    lik_cupy.set_precision(None)


def _fake_torch(monkeypatch, *, fp32_precision=None, allow_tf32=False, matmul_precision="highest"):
    matmul = types.SimpleNamespace(allow_tf32=allow_tf32)
    if fp32_precision is not None:
        matmul.fp32_precision = fp32_precision
    torch = types.SimpleNamespace(backends=types.SimpleNamespace(cuda=types.SimpleNamespace(matmul=matmul)),
                                  get_float32_matmul_precision=lambda: matmul_precision)
    monkeypatch.setitem(sys.modules, "torch", torch)


def _fake_jax(monkeypatch, value):
    monkeypatch.setitem(sys.modules, "jax", types.SimpleNamespace(config=types.SimpleNamespace(
        jax_default_matmul_precision=value)))


def test_float32_defaults_to_float32_accuracy():
    for fw in ("numpy", "cupy", "dlpack"):
        assert fp32_accurate(None, fw, "float32") is True
        assert fp32_accurate(None, fw, "float64") is True


def test_other_dtypes_have_no_tf32_choice():
    for dtype in ("float16", "bfloat16", "int8"):
        assert fp32_accurate(None, "cupy", dtype) is False
        assert fp32_accurate("fp32", "cupy", dtype) is False


@pytest.mark.parametrize("kw,expect", [
    ({}, True),
    ({"allow_tf32": True}, False),
    ({"matmul_precision": "high"}, False),
    ({"matmul_precision": "medium"}, False),
    ({"fp32_precision": "tf32"}, False),
    ({"fp32_precision": "ieee", "allow_tf32": True}, True),  # the newer switch speaks first
    ({"fp32_precision": "none", "allow_tf32": True}, False),  # "none": the older ones decide
])
def test_torch_tensors_follow_torch(monkeypatch, kw, expect):
    _fake_torch(monkeypatch, **kw)
    assert fp32_accurate(None, "torch", "float32") is expect
    assert fp32_accurate(None, "cupy", "float32") is True  # only torch tensors follow torch


@pytest.mark.parametrize("value,expect", [(None, True), ("highest", True), ("float32", True), ("high", True),
                                          ("tensorfloat32", False), ("bfloat16", False), ("default", False),
                                          ("fastest", False),
                                          # dot-algorithm presets: one product of narrower operands is TF32's
                                          # accuracy or less; three or more passes, or float32 operands, are not
                                          ("TF32_TF32_F32", False), ("BF16_BF16_F32", False),
                                          ("F16_F16_F32", False), ("TF32_TF32_F32_X3", True),
                                          ("BF16_BF16_F32_X6", True), ("F32_F32_F32", True)])
def test_jax_arrays_follow_jax(monkeypatch, value, expect):
    _fake_jax(monkeypatch, value)
    assert fp32_accurate(None, "jax", "float32") is expect


def test_cupy_arrays_follow_cupy_tf32(monkeypatch):
    monkeypatch.setenv("CUPY_TF32", "1")
    assert fp32_accurate(None, "cupy", "float32") is False
    assert fp32_accurate(None, "numpy", "float32") is True


def test_order_call_then_process_default_then_framework(monkeypatch):
    _fake_torch(monkeypatch, allow_tf32=True)
    monkeypatch.setenv("LIK_PRECISION", "fp32")
    assert fp32_accurate(None, "torch", "float32") is True  # the process default beats torch
    assert fp32_accurate("tf32", "torch", "float32") is False  # the call beats both
    lik_cupy.set_precision("tf32")
    assert lik_cupy.get_precision() == "tf32"  # set_precision beats the environment
    assert fp32_accurate(None, "numpy", "float32") is False
    lik_cupy.set_precision(None)
    assert lik_cupy.get_precision() == "fp32"


def test_bad_values_are_refused_with_what_was_expected(monkeypatch):
    with pytest.raises(ValueError, match=r"precision must be one of 'fp32', 'tf32', got 'fp64'"):
        lik_cupy.maxsim(np.ones((1, 2, 4), np.float32), np.ones((3, 5, 4), np.float32), backend="cpu",
                        precision="fp64")
    with pytest.raises(ValueError, match="precision must be one of"):  # checked for every dtype
        lik_cupy.maxsim(np.ones((1, 2, 4), np.float16), np.ones((3, 5, 4), np.float16), backend="cpu",
                        precision="TF32")
    with pytest.raises(ValueError, match="set_precision must be one of"):
        lik_cupy.set_precision("half")
    with pytest.raises(ValueError, match="precision must be one of 'fp32', 'tf32', got 'fp64'"):  # before any GPU work
        lik_cupy.warmup(precision="fp64")
    monkeypatch.setenv("LIK_PRECISION", "bf16")
    with pytest.raises(ValueError, match="LIK_PRECISION must be one of 'fp32', 'tf32', got 'bf16'"):
        lik_cupy.get_precision()
    monkeypatch.delenv("LIK_PRECISION")
    # An array was compared elementwise: two entries raised NumPy's 'truth value of an array ... is
    # ambiguous', and set_precision kept a one-entry array as the process default.
    with pytest.raises(ValueError, match=r"precision must be one of 'fp32', 'tf32', got array\(\['fp32', 'tf32'\]"):
        lik_cupy.maxsim(np.ones((1, 2, 4), np.float32), np.ones((3, 5, 4), np.float32), backend="cpu",
                        precision=np.array(["fp32", "tf32"]))
    with pytest.raises(ValueError, match="set_precision must be one of 'fp32', 'tf32', got array"):
        lik_cupy.set_precision(np.array(["tf32"]))
    assert lik_cupy.get_precision() is None


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dim", [64, 128, 200, 1000])
def test_fp32_precision_chooses_float32_accurate_kernels(arch, dim):
    # float32 accuracy: refined TF32 wgmma tiles on Hopper where float32 rows of 128-byte multiples
    # run one-shot (d <= 128), 3xTF32 mma.sync tiles elsewhere; "tf32" takes neither
    for lq, shared, argmax in ((32, 1, False), (32, 8, True), (1024, 1, True)):
        acc = dispatch.choose_forward(arch, "float32", dim, lq, argmax, True, True, shared, 300, False, False, True)
        one = dispatch.choose_forward(arch, "float32", dim, lq, argmax, True, True, shared, 300, False, False, False)
        if arch == 90 and dim in (64, 128):
            assert acc.refine and acc.wgmma and not acc.x3 and acc.name.endswith("_rf")
            assert not (argmax and acc.multi) or acc.min_blocks == 1  # config.min_blocks: it spilled at two
            assert acc.defines()["LIK_REFINE"] == 1 and "LIK_REFINE" not in one.defines()
            assert one.wgmma and not one.refine
        else:
            assert acc.x3 and not acc.qreg and acc.name.endswith("_x3") and acc.defines()["LIK_X3"] == 1
        assert not one.x3 and one.defines()["LIK_X3"] == 0 and not one.refine
        assert not dispatch.choose_forward(arch, "float16", dim, lq, argmax, True, True, shared, 300, False, False,
                                           True).x3


def test_tf32_one_warpgroup_tiles_stage_long_padded_documents_by_cp_async():
    """tables.TF32_SHORT_TMA_BELOW_LD: padded documents of 512 tokens or more by cp.async at precision
    "tf32", with or without the argmax; shorter or packed ones, and the refined tiles, by TMA."""
    def pick(lq, argmax, ld, packed=False, refined=False):
        return dispatch.choose_forward(90, "float32", 128, lq, argmax, True, True, 1, ld, packed, True, refined)
    for lq in (32, 64):
        for argmax in (False, True):
            for ld in (300, 511):
                assert pick(lq, argmax, ld).tma
            for ld in (512, 1024, 4096):
                cfg = pick(lq, argmax, ld)
                assert cfg.warps == 4 and not cfg.refine and not cfg.tma
                assert pick(lq, argmax, ld, packed=True).tma
                assert pick(lq, argmax, ld, refined=True).tma


def test_tf32_queries_of_65_to_128_tokens_take_96_token_stages_against_long_documents():
    """tables.TF32_MID_TILE: scores only, documents of TF32_MID_MIN_LD tokens or more."""
    def pick(lq, argmax, ld, refined=False):
        return dispatch.choose_forward(90, "float32", 128, lq, argmax, True, True, 1, ld, False, True, refined)
    for lq in (65, 100, 128):
        for ld in (768, 1024, 2048):
            assert (pick(lq, False, ld).bn, pick(lq, False, ld).stages) == (96, 2)
            assert pick(lq, True, ld).bn != 96 and pick(lq, False, ld, refined=True).bn != 96
        assert pick(lq, False, 512).bn != 96
    assert pick(129, False, 1024).bn != 96 and pick(1024, False, 1024).bn != 96
    assert dispatch.choose_forward(90, "float16", 128, 128, False, True, True, 1, 1024, False, True).bn != 96


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dim", [528, 1024, 2048, 4096])
def test_int8_takes_split_d_above_512(arch, dim):
    for lq, shared, argmax, tma in ((32, 1, False, False), (1024, 1, True, True), (32, 4, True, True)):
        cfg = dispatch.choose_forward(arch, "int8", dim, lq, argmax, True, True, shared, 300, False, tma)
        assert cfg.split and cfg.elem == 3 and cfg.dp % 32 == 0 and not cfg.tokm and not cfg.qhalf
        assert not (cfg.tma and cfg.bn + 4 > 256)  # a TMA box carries at most 256 scales
    spec = dispatch.elem_spec("int8")
    assert spec.dim_ok(dim) and spec.max_dim == 4096
    assert not spec.dim_ok(spec.max_dim + 16)
