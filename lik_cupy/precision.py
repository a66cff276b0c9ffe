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
   ``"default"``) for JAX arrays; ``CUPY_TF32=1`` for CuPy arrays;
4. ``"fp32"``: every one of those frameworks defaults to full float32 for its own matmuls.
"""

from __future__ import annotations

import sys

from ._base import env

__all__ = ["PRECISIONS", "set_precision", "get_precision"]

PRECISIONS = ("fp32", "tf32")

_default: str | None = None
_JAX_TF32 = ("tensorfloat32", "bfloat16", "fastest", "default")


def _checked(precision, what: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, PRECISIONS))}, got {precision!r}")
    return precision


def set_precision(precision: str | None) -> None:
    """Set the process default for float32 scoring: ``"fp32"``, ``"tf32"``, or None to follow the
    caller's framework again (the default). A call's own ``precision=`` still wins.

    >>> import lik_cupy
    >>> lik_cupy.set_precision("tf32"); lik_cupy.get_precision()
    'tf32'
    >>> lik_cupy.set_precision(None); lik_cupy.get_precision() is None
    True
    """
    global _default
    _default = None if precision is None else _checked(precision, "set_precision")


def get_precision() -> str | None:
    """The process default set by :func:`set_precision` (else ``LIK_PRECISION``), or None when
    each call follows its framework."""
    if _default is not None:
        return _default
    value = env.precision_default()
    return _checked(value, "LIK_PRECISION") if value else None


def _framework_says(framework: str) -> str | None:
    """What the caller's framework asks of its own float32 matmuls, if anything. Read only when
    that framework is already imported (an array of it was passed, so it is)."""
    if framework == "torch":
        torch = sys.modules.get("torch")
        if torch is None:
            return None
        matmul = torch.backends.cuda.matmul
        fp32 = getattr(matmul, "fp32_precision", None)  # PyTorch 2.9+
        if fp32 in ("tf32", "ieee"):
            return "tf32" if fp32 == "tf32" else "fp32"
        try:
            tf32 = matmul.allow_tf32 or torch.get_float32_matmul_precision() in ("high", "medium")
        except RuntimeError:  # PyTorch refuses the older switches once the newer ones were set
            return None
        return "tf32" if tf32 else "fp32"
    if framework == "jax":
        jax = sys.modules.get("jax")
        if jax is None:
            return None
        value = jax.config.jax_default_matmul_precision
        return "tf32" if value is not None and str(value).lower() in _JAX_TF32 else "fp32"
    if framework == "cupy":
        return "tf32" if env.cupy_tf32() else "fp32"
    return None


def _resolve(precision: str | None, framework: str, dtype: str) -> bool:
    """Whether a call scores at float32 accuracy (3xTF32): True or False for float32 and float64
    inputs by the rule in this module's docstring; False for every other dtype (no TF32 there)."""
    if dtype not in ("float32", "float64"):
        if precision is not None:
            _checked(precision, "precision")
        return False
    if precision is None:
        precision = get_precision() or _framework_says(framework) or "fp32"
    return _checked(precision, "precision") == "fp32"
