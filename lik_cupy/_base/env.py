"""Every environment variable the package reads, in one place (documented in docs/environment.md).

Switches are read when used, not at import, so a test or a service can flip them at run time.
The package's own variables share the prefix ``LIK_``; the four that were once spelled
``LIK_CUPY_...`` still work under that name, with a DeprecationWarning, where the new one is unset.
"""

from __future__ import annotations

import os
import warnings

__all__ = ["cache_dir_override", "validate_strict", "poison_outputs", "wgmma_disabled", "tma_disabled", "numba_disabled", "precision_default", "cupy_tf32",
           "pylate_scores_backend", "colpali_scores_backend", "jax_path_forced"]

_TRUE = ("1", "true", "yes")
_FALSE = ("", "0", "false", "no")
_TRUE_BYTES = (b"1", b"true", b"yes")
_FALSE_BYTES = (b"", b"0", b"false", b"no")

# The switches a scoring call reads every time, straight from the process environment's byte
# mapping where the platform keeps one (POSIX): ``os.environ.get`` encodes and decodes on each
# read, a microsecond of a repeat call's budget for four reads.
_RAW = getattr(os.environ, "_data", None) if os.name == "posix" else None


# new name -> the old one it replaces
_OLD_NAMES = {"LIK_CACHE_DIR": "LIK_CUPY_CACHE_DIR", "LIK_POISON": "LIK_CUPY_POISON",
              "LIK_DISABLE_WGMMA": "LIK_CUPY_DISABLE_WGMMA", "LIK_DISABLE_TMA": "LIK_CUPY_DISABLE_TMA"}
_OLD_RAW = {new.encode(): old.encode() for new, old in _OLD_NAMES.items()}
_warned: set[str] = set()


def _get(name: str) -> str | None:
    """``name``'s value, else its old spelling's (warned once per process), else None."""
    value = os.environ.get(name)
    old = _OLD_NAMES.get(name)
    if value is None and old is not None and old in os.environ:
        if old not in _warned:
            _warned.add(old)
            warnings.warn(f"environment variable {old} is deprecated; set {name} instead", DeprecationWarning,
                          stacklevel=2)
        return os.environ[old]
    return value


def _raw_get(raw: bytes) -> bytes | None:
    # The hot path: one lookup in the byte mapping when the new name is set, two when neither is.
    value = _RAW.get(raw)
    if value is None and _RAW.get(_OLD_RAW.get(raw)) is not None:
        return _get(raw.decode()).encode()
    return value


def _switch(name: str, raw: bytes) -> bool:
    """An on/off variable: 1, true or yes; 0, false, no, empty or unset (any case, spaces around
    ignored). Anything else raises, naming the variable: a near miss (``TRUE``, ``on``) once read
    silently as off."""
    if _RAW is not None:
        value = _raw_get(raw)
        if value is None or value in _FALSE_BYTES:
            return False
        if value in _TRUE_BYTES:
            return True
        value = value.decode(errors="replace")
    else:
        value = _get(name) or ""
    word = value.strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise ValueError(f"environment variable {name} is {value!r}; expected 1, true or yes (on), or 0, false, no or "
                     "empty (off)")


def cache_dir_override() -> str | None:
    """``LIK_CACHE_DIR``: where compiled kernels are cached (default: ``$XDG_CACHE_HOME/lik_cupy/kernels``, ``~/.cache`` without ``XDG_CACHE_HOME``)."""
    return (_get("LIK_CACHE_DIR") or "").strip() or None  # (spaces alone: unset, as empty is)


def validate_strict() -> bool:
    """``LIK_VALIDATE=1``: calls check device lengths, offsets and ids on the host and raise
    (strict mode), as ``validate=True`` does, instead of marking the affected scores NaN."""
    return _switch("LIK_VALIDATE", b"LIK_VALIDATE")


def poison_outputs() -> bool:
    """``LIK_POISON=1``: fill every output buffer with garbage before a kernel writes it, so an
    element a kernel forgot to write cannot pass as a plausible value (the tests set it)."""
    return _switch("LIK_POISON", b"LIK_POISON")


def wgmma_disabled() -> bool:
    """``LIK_DISABLE_WGMMA=1``: keep Hopper GPUs on the portable mma.sync kernels."""
    return _switch("LIK_DISABLE_WGMMA", b"LIK_DISABLE_WGMMA")


def tma_disabled() -> bool:
    """``LIK_DISABLE_TMA=1``: stage tiles by cp.async instead of the tensor memory accelerator."""
    return _switch("LIK_DISABLE_TMA", b"LIK_DISABLE_TMA")


def numba_disabled() -> bool:
    """``LIK_DISABLE_NUMBA=1``: the CPU path keeps its NumPy passes where Numba would fold a block
    (``lik_cupy/_cpu/fold.py``) or decompress PLAID tokens (``lik_cupy/_cpu/residual_kernels.py``)."""
    return _switch("LIK_DISABLE_NUMBA", b"LIK_DISABLE_NUMBA")


def precision_default() -> str | None:
    """``LIK_PRECISION``: the process default of the float32 precision, ``fp32`` or ``tf32``
    (``lik_cupy.precision``; ``lik_cupy.set_precision`` overrides it). Unset or empty: none."""
    return os.environ.get("LIK_PRECISION", "").strip().lower() or None


def cupy_tf32() -> bool:
    """``CUPY_TF32=1``: CuPy's own switch to TF32 matmuls, which float32 CuPy arrays follow when no
    precision is set (``lik_cupy.precision``)."""
    return os.environ.get("CUPY_TF32", "0") == "1"


def pylate_scores_backend() -> str:
    """``PYLATE_SCORES_BACKEND`` (PyLate's own variable): the backend ``lik_cupy.integrations.pylate``
    takes when a call names none, as PyLate does (``torch`` and ``flash`` hand the call to PyLate)."""
    return os.environ.get("PYLATE_SCORES_BACKEND", "auto")


def colpali_scores_backend() -> str:
    """``COLPALI_SCORES_BACKEND`` (colpali-engine's own variable): ``torch`` hands
    ``lik_cupy.integrations.colpali``'s calls to colpali-engine's torch reference."""
    return os.environ.get("COLPALI_SCORES_BACKEND", "auto")


def jax_path_forced() -> str | None:
    """``LIK_JAX_PATH``: ``xla`` or ``kernel`` forces the path of differentiated ``lik_cupy.jax.maxsim`` calls
    (``lik_cupy._dispatch.jax_paths``), read when a call is traced. Unset or empty: the measured rule."""
    return os.environ.get("LIK_JAX_PATH", "").strip().lower() or None
