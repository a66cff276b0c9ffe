"""The kernel registry (lik_cupy/_runtime/kernels.py): every source it names defines the entries
it lists, and the package launches no kernel it does not list."""

import ast
import pathlib
import re

import pytest

import lik_cupy
from lik_cupy._runtime import kernels
from lik_cupy._runtime.nvrtc import source_dir

ROOT = pathlib.Path(lik_cupy.__file__).parent


@pytest.mark.parametrize("src", kernels.SOURCES, ids=lambda s: s.file)
def test_sources_define_their_entries(src):
    text = (source_dir() / src.file).read_text()
    for entry in src.entries:
        assert re.search(rf"__global__[^;{{]*\b{entry}\s*\(", text), f"{src.file} defines no kernel {entry}"


def test_launches_name_registered_kernels():
    registered = {e for src in kernels.SOURCES for e in src.entries}
    used = set()
    for path in ROOT.rglob("*.py"):
        # the forward configurations' own entries are named lik_maxsim_fwd_... by FwdConfig.name; the
        # server's Prometheus metrics (lik_serve_...) are no kernels
        used |= {m for m in re.findall(r"""["'](lik_(?!cupy["'])[a-z0-9_]+)["']""", path.read_text())
                 if not m.startswith(("lik_maxsim_fwd", "lik_serve_"))}
    assert used and used <= registered, f"launched but not in kernels.SOURCES: {sorted(used - registered)}"


def test_row_names():
    assert kernels.BACKWARD.row_name("lik_bwd_dq", {"LIK_ELEM": 1, "LIK_VEC": 0}) == "lik_bwd_dq[elem=1,vec=0]"
    assert kernels.TOPK.row_name("lik_topk_merge", {}) == "lik_topk_merge"
    assert [v["LIK_ELEM"] for v in kernels.QUANTIZE.variants] == [0, 1, 2]
    assert kernels.BACKWARD_DTYPES == ("float16", "bfloat16", "float32")


def test_kernels_are_loaded_only_in_the_runtime():
    # every kernel is compiled, loaded and launched from lik_cupy/_runtime (the public modules call it)
    loaders = {"get_module", "get_function", "function_handle", "launch_raw", "cubin_path"}
    outside = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.is_relative_to(ROOT / "_runtime"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and any(a.name in loaders for a in node.names):
                outside.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not outside, outside
