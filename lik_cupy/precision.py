"""The float32 precision contract: how accurately float32 (and float64) inputs are scored on the GPU.

- ``"fp32"``: float32 accuracy, about 1e-6 relative error against float64. The tensor cores take
  each operand as two TF32 parts (3xTF32: ``lo*hi + hi*lo + hi*hi``), three times the tensor-core
  work of ``"tf32"``.
- ``"tf32"``: one TF32 product, about 1e-3 relative error, the fastest float32 path. A near tie
  between two document tokens can then pick the other token than float64 would.

float16, bfloat16 and INT8 inputs are unaffected, and the CPU path always computes its products
exactly (float32 GEMMs with a float64 refinement of near ties). float64 inputs on the GPU run the
``"fp32"`` path (unless ``"tf32"`` is asked for) and return float64 scores.

Which precision a call gets, first match wins:

1. the call's ``precision=`` argument;
2. the process default, :func:`set_precision` or the ``LIK_PRECISION`` environment variable;
3. the caller's framework, where it says something: PyTorch's
   ``torch.backends.cuda.matmul.fp32_precision`` (``"tf32"``), ``allow_tf32`` or
   ``torch.get_float32_matmul_precision()`` (``"high"`` / ``"medium"``) for torch tensors; JAX's
   ``jax_default_matmul_precision`` (``"tensorfloat32"``, ``"bfloat16"``, ``"fastest"``,
   ``"default"``, or a dot-algorithm preset of one product of narrower operands than float32,
   such as ``"TF32_TF32_F32"`` or ``"BF16_BF16_F32"``) for JAX arrays; ``CUPY_TF32=1`` for CuPy arrays;
4. ``"fp32"``: every one of those frameworks defaults to full float32 for its own matmuls.
"""

from __future__ import annotations

from ._dispatch import precision as _rule

__all__ = ["PRECISIONS", "set_precision", "get_precision"]

PRECISIONS = _rule.PRECISIONS


def set_precision(precision: str | None) -> None:
    """Set the process default for float32 scoring: ``"fp32"``, ``"tf32"``, or None to follow the
    caller's framework again (the default). A call's own ``precision=`` still wins.

    >>> import lik_cupy
    >>> lik_cupy.set_precision("tf32"); lik_cupy.get_precision()
    'tf32'
    >>> lik_cupy.set_precision(None); lik_cupy.get_precision() is None
    True
    """
    _rule.set_default(precision)


def get_precision() -> str | None:
    """The process default set by :func:`set_precision` (else ``LIK_PRECISION``), or None when
    each call follows its framework."""
    return _rule.default()
