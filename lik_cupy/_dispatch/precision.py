"""The float32 precision rule (``lik_cupy.precision`` is its public face and documents it): the
process default, what the caller's framework asks for, and which a call gets."""

from __future__ import annotations

from .._base import env
from .._interop import tf32_default

__all__ = ["PRECISIONS", "checked", "set_default", "default", "fp32_accurate"]

PRECISIONS = ("fp32", "tf32")

_default: str | None = None


def checked(precision, what: str) -> str:
    """``precision`` if it is one of ``PRECISIONS``, else ValueError naming ``what``."""
    if not isinstance(precision, str) or precision not in PRECISIONS:  # (``in`` compares an array elementwise)
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


def fp32_accurate(precision: str | None, framework: str, dtype: str) -> bool:
    """Whether a call scores at float32 accuracy (3xTF32): True or False for float32 and float64
    inputs by the rule in ``lik_cupy.precision``'s docstring; False for every other dtype (no TF32 there)."""
    if dtype not in ("float32", "float64"):
        if precision is not None:
            checked(precision, "precision")
        return False
    if precision is None:
        precision = default() or tf32_default(framework) or "fp32"
    return checked(precision, "precision") == "fp32"
