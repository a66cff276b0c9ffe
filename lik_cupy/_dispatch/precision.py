"""The float32 precision rule (``lik_cupy.precision`` is its public face and documents it): the
process default, what the caller's framework asks for, and which a call gets."""

from __future__ import annotations

import sys

from .._base import env

__all__ = ["PRECISIONS", "checked", "set_default", "default", "framework_says", "fp32_accurate"]

PRECISIONS = ("fp32", "tf32")

_default: str | None = None
_JAX_TF32 = ("tensorfloat32", "bfloat16", "fastest", "default")


def checked(precision, what: str) -> str:
    """``precision`` if it is one of ``PRECISIONS``, else ValueError naming ``what``."""
    if precision not in PRECISIONS:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, PRECISIONS))}, got {precision!r}")
    return precision


def set_default(precision: str | None) -> None:
    """The process default (``lik_cupy.set_precision``)."""
    global _default
    _default = None if precision is None else checked(precision, "set_precision")


def default() -> str | None:
    """The process default set by ``set_default`` (else ``LIK_PRECISION``), or None."""
    if _default is not None:
        return _default
    value = env.precision_default()
    return checked(value, "LIK_PRECISION") if value else None


def framework_says(framework: str) -> str | None:
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


def fp32_accurate(precision: str | None, framework: str, dtype: str) -> bool:
    """Whether a call scores at float32 accuracy (3xTF32): True or False for float32 and float64
    inputs by the rule in ``lik_cupy.precision``'s docstring; False for every other dtype (no TF32 there)."""
    if dtype not in ("float32", "float64"):
        if precision is not None:
            checked(precision, "precision")
        return False
    if precision is None:
        precision = default() or framework_says(framework) or "fp32"
    return checked(precision, "precision") == "fp32"
