"""Every example in the public docstrings runs, on the CPU path, and prints what it shows."""

from __future__ import annotations

import doctest
import importlib

import numpy as np
import pytest

MODULES = ["lik_cupy", "lik_cupy.forward", "lik_cupy.int8", "lik_cupy.quantize", "lik_cupy.backward",
           "lik_cupy.fused_head", "lik_cupy.retrieval", "lik_cupy.plaid", "lik_cupy.shards", "lik_cupy.errors",
           "lik_cupy.cli",
           "lik_cupy.torch", "lik_cupy.jax", "lik_cupy.integrations.pylate", "lik_cupy.integrations.colpali"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    if name in ("lik_cupy.torch", "lik_cupy.jax"):
        pytest.importorskip(name.rsplit(".", 1)[1])
    if name.startswith("lik_cupy.integrations."):
        pytest.importorskip("torch")
    mod = importlib.import_module(name)
    with np.printoptions(legacy=False):
        result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE, raise_on_error=False, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (run doctest -v)"


def test_the_ops_have_examples():
    import lik_cupy

    for fn in ("maxsim", "maxsim_pairs", "maxsim_varlen", "maxsim_int8", "quantize_int8", "maxsim_backward",
               "retrieve", "maxsim_residual", "maxsim_residual_varlen"):
        assert ">>> " in getattr(lik_cupy, fn).__doc__, f"{fn} has no example"
