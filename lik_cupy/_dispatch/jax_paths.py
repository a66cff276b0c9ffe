"""Which path a differentiated ``lik_cupy.jax.maxsim`` call takes: XLA's own einsum (``"xla"``,
which JAX differentiates) or lik-cupy's kernels (``"kernel"``), by a measured rule kept as data.
A call not differentiated always takes the kernels (one custom call, nothing materialised).

A jitted training step through the kernels pays for two host callbacks (the forward with its
argmax, the backward) whatever its size; XLA's einsum pays for its work, the similarities
``Nq * Nd * Lq * Ld`` materialised in float32. So XLA wins the small steps and the kernels the
large ones. ``JAX_PATHS`` holds, per backend (``"gpu"``: XLA on a CUDA device; ``"cpu"``: XLA on
the host, against the NumPy path), the cells ``bench/suites/bench_train.py`` timed (an in-batch
``jit(grad)`` step of N queries of Lq tokens against N documents of Ld tokens) and the faster
path there. A call takes the path of its nearest cell (by log2 of ``Nq * Nd``, ``Lq`` and
``Ld``), but XLA never for more similarities than the largest cell XLA won; a backend with no
cells takes the kernels (on the CPU, the NumPy path: exact float64 winners). The rule sees the
call as traced: under ``jax.vmap`` that is one batch element (the batch size is not known where
the path is chosen), so a vmapped differentiated call of small elements takes XLA's einsum for
the whole batch, however large; pass such a batch as one ``[Nq, Lq, d]`` call, or set
``LIK_JAX_PATH=kernel``.
``LIK_JAX_PATH=xla`` or ``kernel`` forces a path.

The table is written by ``python bench/tools/jax_paths.py <bench_train json>``.
"""

from __future__ import annotations

import math

from .._base.env import jax_path_forced

__all__ = ["JAX_PATHS", "JAX_PATHS_SOURCE", "PATHS", "choose_jax_path"]

PATHS = ("xla", "kernel")

JAX_PATHS_SOURCE = 'bench/results/latest/train_jax_nvidia-h200.json (NVIDIA H200, jit(value_and_grad) in-batch steps)'
JAX_PATHS: dict[str, tuple[tuple[int, int, int, str], ...]] = {
    'gpu': (
        (8, 32, 80, 'xla'),
        (8, 32, 300, 'xla'),
        (8, 32, 1024, 'xla'),
        (8, 128, 300, 'xla'),
        (8, 1024, 1024, 'kernel'),
        (32, 32, 80, 'xla'),
        (32, 32, 300, 'xla'),
        (32, 32, 1024, 'xla'),
        (32, 128, 300, 'xla'),
        (32, 1024, 1024, 'kernel'),
        (64, 32, 80, 'xla'),
        (64, 32, 300, 'xla'),
        (64, 32, 1024, 'kernel'),
        (64, 128, 300, 'kernel'),
        (64, 1024, 1024, 'kernel'),
        (128, 32, 80, 'xla'),
        (128, 32, 300, 'kernel'),
        (128, 32, 1024, 'kernel'),
        (128, 128, 300, 'kernel'),
        (128, 1024, 1024, 'kernel'),
        (256, 32, 80, 'kernel'),
        (256, 32, 300, 'kernel'),
        (256, 32, 1024, 'kernel'),
        (256, 128, 300, 'kernel'),
        (256, 1024, 1024, 'kernel'),
    ),
}


def choose_jax_path(backend: str, nq: int, nd: int, lq: int, ld: int) -> str:
    """``"xla"`` or ``"kernel"`` for ``nq`` queries of ``lq`` tokens each scored against ``nd``
    documents of ``ld`` tokens, on ``backend`` ("gpu" or "cpu"; the module docstring)."""
    if min(nq, nd, lq, ld) < 1:  # no similarities to materialise: the kernels' path handles empty sides
        return "kernel"
    forced = jax_path_forced()
    if forced is not None:
        if forced not in PATHS:
            raise ValueError(f"LIK_JAX_PATH must be one of {PATHS}, got {forced!r}")
        return forced
    cells = JAX_PATHS.get(backend, ())
    size = nq * nd * lq * ld
    largest_xla = max((n * n * q * d for n, q, d, path in cells if path == "xla"), default=0)
    if size > largest_xla:
        return "kernel"

    def distance(cell):
        n, q, d, _ = cell
        return abs(math.log2(nq * nd / (n * n))) + abs(math.log2(lq / q)) + abs(math.log2(ld / d))

    return min(cells, key=distance)[3]
