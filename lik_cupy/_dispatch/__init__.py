"""Dispatch: which kernel runs a problem, and with what grid.

- ``elements.py``: the element types (``ElemSpec``), one row each: every rule that depends on the type reads it;
- ``config.py``: what one compiled forward variant is (``FwdConfig``) and the per-architecture limits;
- ``tables.py``: the measured tuning tables, as literal data;
- ``select.py``: the rules that read them (``choose_forward``, ``choose_residual``, ``choose_backward``,
  ``choose_hidden_fused``);
- ``plan.py``: the grid of a launch (``plan_launch``);
- ``backend.py``: GPU or CPU (``use_gpu``);
- ``jax_paths.py``: XLA's einsum or the kernels for a differentiated ``lik_cupy.jax.maxsim`` call (``choose_jax_path``).
"""

from .backend import BACKENDS, check_backend, check_gpu_dim, scoring_on_gpu, use_gpu
from .config import (DIM_BUCKETS, MAX_DIM, MAX_DIM_RESIDUAL, SMEM_PER_BLOCK, SMEM_PER_SM, SUPPORTED_ARCHS, FwdConfig,
                     arch_of, dim_bucket, one_shot_bucket, padded_dim)
from .elements import ELEMS, SCALED_DTYPES, ElemSpec, elem_of_code, elem_spec, kernel_dtype, scaled_dtype
from .plan import SPLIT_MAX_CTAS, Launch, ctas_per_sm, padded_split_min_ld, plan_launch, queries_per_tile, tile_rows
from .select import (RESIDUAL_DTYPES, all_forward_configs, all_residual_configs, choose_backward, choose_forward,
                     choose_hidden_fused, choose_residual, residual_dim_ok, split_family, uses_split)

__all__ = ["BACKENDS", "check_backend", "check_gpu_dim", "scoring_on_gpu", "use_gpu", "DIM_BUCKETS", "MAX_DIM", "MAX_DIM_RESIDUAL",
           "SMEM_PER_BLOCK", "SMEM_PER_SM", "SUPPORTED_ARCHS", "FwdConfig", "arch_of", "dim_bucket", "one_shot_bucket",
           "padded_dim", "ELEMS", "SCALED_DTYPES", "ElemSpec", "elem_of_code", "elem_spec", "kernel_dtype", "scaled_dtype",
           "SPLIT_MAX_CTAS", "Launch", "ctas_per_sm", "padded_split_min_ld", "plan_launch", "queries_per_tile",
           "tile_rows", "RESIDUAL_DTYPES", "all_forward_configs", "all_residual_configs", "choose_backward",
           "choose_hidden_fused", "choose_forward", "choose_residual", "residual_dim_ok", "split_family", "uses_split", "clear_caches",
           "on_clear"]

_listeners: list = []
_memoised = (choose_forward, choose_residual, plan_launch)  # as defined, whatever a test swaps in later


def on_clear(fn) -> None:
    """Call ``fn()`` whenever :func:`clear_caches` runs (the launch module forgets its prepared
    launches, which hold the choices)."""
    _listeners.append(fn)


def clear_caches() -> None:
    """Forget every cached choice and plan, after a change to the tables (a sweep, a test): the
    memoised ``choose_forward``, ``choose_residual`` and ``plan_launch``, and what was prepared
    from them."""
    for f in _memoised:
        f.cache_clear()
    for fn in _listeners:
        fn()
