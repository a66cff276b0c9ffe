"""The element-type table (lik_cupy/_dispatch/elements.py): its rows agree with each other, with
the kernels and with the hooks they name, and no other module tests for an element type itself."""

import pathlib
import re

import numpy as np
import pytest

import lik_cupy
from lik_cupy import _cpu
from lik_cupy import _dispatch as dispatch
from lik_cupy._runtime.nvrtc import source_dir

ROOT = pathlib.Path(lik_cupy.__file__).parent


def test_rows_are_unique_and_found_by_name_and_code():
    assert len({e.name for e in dispatch.ELEMS}) == len({e.code for e in dispatch.ELEMS}) == len(dispatch.ELEMS)
    assert len({e.tag for e in dispatch.ELEMS}) == len(dispatch.ELEMS)
    for e in dispatch.ELEMS:
        assert dispatch.elem_spec(e.name) is e and dispatch.elem_of_code(e.code) is e
        assert dispatch.scaled_dtype(e.name) == e.scaled
    assert dispatch.SCALED_DTYPES == ("int8", "float8_e4m3fn")
    assert not dispatch.scaled_dtype("float64") and not dispatch.scaled_dtype("int32")
    with pytest.raises(ValueError, match="not float64"):
        dispatch.elem_spec("float64")


@pytest.mark.parametrize("spec", dispatch.ELEMS, ids=lambda e: e.name)
def test_row_is_consistent(spec):
    assert spec.k * spec.bytes == 32  # one mma.sync takes 32 bytes of K
    assert spec.dim_step * spec.bytes >= 32 and spec.max_dim % spec.dim_step == 0
    assert np.dtype(spec.numpy_dtype).itemsize == spec.bytes
    assert spec.min_arch in dispatch.SUPPORTED_ARCHS
    assert spec.dim_ok(spec.max_dim) and not spec.dim_ok(spec.max_dim + spec.dim_step)
    assert spec.dim_ok(spec.dim_multiple) and (spec.dim_multiple == 1 or not spec.dim_ok(spec.dim_multiple + 1))
    # a scaled type is quantised from floats and dequantised back, by hooks that exist
    assert spec.scaled == (spec.quantiser is not None) == (spec.quantiser_kernel is not None) \
        == (spec.dequantiser is not None) == (spec.public_quantiser is not None)
    if spec.scaled:
        assert callable(getattr(_cpu, spec.quantiser)) and callable(getattr(lik_cupy, spec.dequantiser))
        assert callable(getattr(lik_cupy, spec.public_quantiser))
        assert f"void {spec.quantiser_kernel}(" in (source_dir() / "quantize.cu").read_text()
    # every type with Hopper wgmma tiles has its one-warpgroup tile costs
    assert (spec.name in dispatch.tables.SHORT_WGMMA_COST) == spec.wgmma


@pytest.mark.parametrize("spec", dispatch.ELEMS, ids=lambda e: e.name)
def test_configs_read_their_row(spec):
    cfg = dispatch.choose_forward(90, spec.name, 128, 32, False, True)
    assert cfg.spec is spec and cfg.esize == spec.bytes and cfg.name.startswith(f"lik_maxsim_fwd_{spec.tag}_")
    assert cfg.defines()["LIK_ELEM"] == spec.code and cfg.dp % spec.dim_step == 0


def test_padded_dim_steps():
    assert [dispatch.padded_dim(d, dispatch.elem_spec("float16")) for d in (1, 16, 17, 100)] == [16, 16, 32, 112]
    assert [dispatch.padded_dim(d, dispatch.elem_spec("int8")) for d in (16, 32, 48, 96)] == [32, 32, 64, 96]


def test_gpu_dim_check_names_the_rule():
    dispatch.check_gpu_dim("int8", 4096)
    dispatch.check_gpu_dim("float64", 8192)  # scored on float32's kernels
    with pytest.raises(ValueError, match=r"int8 scoring on the GPU needs dim a multiple of 16 up to 4096; got dim 40 "
                                         r"\(device='cpu' scores any dim\)"):
        dispatch.check_gpu_dim("int8", 40, "device='cpu'")
    with pytest.raises(ValueError, match="float32 scoring on the GPU needs dim up to 8192; got dim 8200"):
        dispatch.check_gpu_dim("float64", 8200)


# An element type tested for itself: `elem == 3`, `cfg.elem in (0, 1)`, `dtype == "int8"`.
_ELEMENT_TEST = re.compile(r"""\belem\s*(==|!=)\s*\d|\belem\s+(not\s+)?in\s*[(\[{]\s*\d|(==|!=)\s*["']int8["']"""
                           r"""|["']int8["']\s*(==|!=)|["']int8["']\s+(not\s+)?in\s+\w""")


def test_no_element_tests_outside_the_table():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path == ROOT / "_dispatch" / "elements.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if _ELEMENT_TEST.search(line.split("#")[0]):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "test the element type's row (lik_cupy/_dispatch/elements.py) instead:\n" + "\n".join(found)


# The kernels' side: a scaled or integer element type tested by its code or an INT8 flag
# (`ELEM == 3`, `LIK_ELEM != 4`, `I8`) instead of its traits (cuda_src/elements.cuh).
_KERNEL_ELEMENT_TEST = re.compile(r"\bELEM\s*(==|!=)\s*[34]\b|\bI8\b")


def test_no_element_tests_outside_the_kernel_traits():
    src = source_dir()
    found = []
    for path in sorted(src.rglob("*.cu*")):
        if path.name == "elements.cuh":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if _KERNEL_ELEMENT_TEST.search(line.split("//")[0]):
                found.append(f"{path.relative_to(src)}:{n}: {line.strip()}")
    assert not found, "read the element type's traits (cuda_src/elements.cuh) instead:\n" + "\n".join(found)


def test_kernel_traits_match_the_rows():
    # Each row's code has a traits specialisation whose K and flags agree with the row.
    text = (source_dir() / "elements.cuh").read_text()
    for spec in dispatch.ELEMS:
        body = re.search(rf"struct Elem<{spec.code}> \{{(.*?)\n\}};", text, re.S)
        assert body, f"no Elem<{spec.code}> in elements.cuh"
        b = body.group(1)
        assert f"kK = {spec.k} " in b
        flags = dict(re.findall(r"(k\w+) = (true|false)", b))
        assert flags == {"kScaled": str(spec.scaled).lower(), "kInt": str(spec.integer).lower(),
                         "kTf32": str(spec.tf32).lower()}, (spec.name, flags)
