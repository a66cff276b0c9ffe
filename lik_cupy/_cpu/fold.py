"""Each document's argmax, max, second max and the winners' reference similarities, in one pass over a
tokens-first similarity block, compiled by Numba where it is installed (the ``cpu`` extra).

Without Numba, a chunk's GEMM of a few query rows runs with the document tokens as its rows into a
scratch and is copied transposed into the similarity block (``maxsim.py``, ``_TOKENS_FIRST_ROWS``),
and NumPy reduces that block in three passes (argmax, then the second max with the max masked out;
packed documents take a max, a comparison and a search for hits instead, having no segmented
argmax); then the winners' tokens are gathered again, from memory, for their reference similarities.

:class:`DocumentFold` reads the tokens-first GEMM's output ``St [n, R]`` where it lies, piece by piece
as the GEMM fills it, with the R rows of a token as one vector. When a document ends, it writes its
results and the reference similarity of each row's winner, whose token the piece's GEMM has just
read (it is in the cache). The results are the NumPy passes' bit for bit:

- ``first``: the first column holding the max (the first of equal maxima; masked columns never win,
  as the -inf NumPy writes there); ``best``, that max, NaN where the document holds a NaN (float64
  then decides the whole document, as for NumPy's NaN max); ``second``, the max of the other columns
  (equal to ``best`` where the max occurs twice); column 0 and -inf for a document with no valid column.
- ``win``: the winner's reference similarity (``refine.dot64``): the products in float64, summed by
  NumPy's pairwise summation (``np.add.reduce``), reproduced step for step (``fold_kernels.py``). A probe at
  the first build checks the two agree on vectors whose sums round at every step, and the compiled
  fold is not used where they do not.
- ``norms``: a bound on the norm of each document's valid tokens, ``refine.bound_norms``'s steps on
  the largest sum of squares (summed in whatever order vectorises: the bound holds for any order). It
  is not NumPy's bound bit for bit, and need not be: a looser or tighter margin only sends more or fewer
  near ties to float64, which decides them exactly either way.

Beside the block, a chunk's fold holds 32 bytes per query row and document (its results) and, in the
kernel, one row's float64 products (``d * 8`` bytes).

The same build widens float16 and bfloat16 tokens to float32 for the GEMM (:func:`float32_tokens`)
by a table of the type's own conversions of all 65,536 values, bit for bit its cast, in parts shared
by the chunk threads: on one core 10 ms for 23 million values on an AMD EPYC, against 32 for NumPy's
float16 cast and 8.4 for ml_dtypes' bfloat16 one.

The GEMM that fills ``St`` is ``gemm_kernels.tokens_by_rows`` for few query rows on hosts with AVX2 or
AVX-512 (:func:`tokens_first_gemm`, ``_OWN_GEMM``; that module says why and how fast), else BLAS's.

The kernels release the GIL, so the chunk threads of ``cores.py`` fold at once.
``LIK_DISABLE_NUMBA=1`` keeps the NumPy passes (``docs/environment.md``). Numba is imported at the
first call that could use it, never when ``lik_cupy`` is imported; a Numba that will not import or
compile, or disagrees with NumPy, gives one warning and the NumPy passes.
"""

from __future__ import annotations

import functools
import importlib.util
import threading
import warnings

import numpy as np

from .._base import env
from . import cores
from .refine import norm_terms

__all__ = ["available", "DocumentFold", "float32_tokens", "GEMM_PAD_ROWS", "tokens_first_gemm", "widening_table"]

_lock = threading.Lock()
_kernel = None  # fold_kernels.piece once built, False once that failed, None before the first try
_widen = None  # fold_kernels.widen once built
# rows a token above which the fold keeps its winners' offsets in int32, else int64: each vectorises best so
# (AMD EPYC, AVX-512: 82 against 113 us for a chunk of 32 rows, 225 against 294 us for 1,024 rows)
_WIDE_ROWS = 64
_WIDEN_SHARED = 1 << 20  # float16 values from which their widening is shared by the chunk threads
# Where gemm_kernels runs the folded path's float32 GEMM: (CPU features, the float32 lanes of its tiles'
# vectors there, the most query rows it takes), the first row whose features the host has; BLAS runs the
# GEMM past those rows and on hosts with neither. Two hosts measured, each against OpenBLAS:
# - an AMD EPYC with AVX2 and FMA, no AVX-512 (OpenBLAS's Haswell kernels): 8-lane tiles ran pieces of
#   the product 1.1-2.2x as fast at 8 to 1,024 rows, on one thread and on two at once; whole calls took
#   0.75-0.90x as long for one query of 32 tokens and 0.94x for 16 (512 rows), and one query of 1,024
#   tokens against 16 pages was level (0.93-1.07 over six A/Bs)
#   (bench/results/archive/cpu_own_gemm_amd-epyc-avx2/);
# - an Intel Xeon with AVX-512 (OpenBLAS's SkylakeX kernels): 16-lane tiles ran 1.5x as fast at 32 rows
#   and 1.1-1.4x at 64, slower from 128; whole calls took 0.82x (one padded query of 32 tokens) and 0.77x
#   (a ragged one) as long, 1.10x at 512 rows and 1.17x at 1,024; 8-lane tiles took 0.94-1.67x there
#   (bench/results/archive/cpu_own_gemm_h200_host/wide/). AMD's EPYCs with AVX-512 were not measured.
_OWN_GEMM = ((("avx512f",), 16, 64), (("avx2", "fma"), 8, 512))
# the most rows gemm_kernels.pack adds to fill a tile (two vectors of the widest lanes, less one)
GEMM_PAD_ROWS = 2 * max(lanes for _, lanes, _ in _OWN_GEMM) - 1
_gemm = None  # (gemm_kernels.tokens_by_rows, lanes, most rows) once built, False where BLAS runs every GEMM, None before


def available() -> bool:
    """Whether :class:`DocumentFold` runs: Numba importable, compiling and agreeing with NumPy, and
    ``LIK_DISABLE_NUMBA`` off. The first call imports Numba and compiles the kernels (or loads them
    from Numba's on-disk cache)."""
    global _kernel
    if env.numba_disabled():
        return False
    if _kernel is None:
        with _lock:
            if _kernel is None:
                _kernel = _first_build()
    return _kernel is not False


@functools.cache
def widening_table(dtype: np.dtype) -> np.ndarray:
    """float32 ``[65536]``: every value of the 16-bit ``dtype`` (indexed by its bits), by its own cast."""
    with np.errstate(invalid="ignore"):  # (the signalling NaNs among them)
        return np.arange(1 << 16, dtype=np.uint16).view(dtype).astype(np.float32)


def float32_tokens(x: np.ndarray) -> np.ndarray:
    """float16 or bfloat16 ``x`` (any shape) as a new C-contiguous float32 array, bit for bit
    ``x.astype(np.float32)``, in parts shared by ``cores``' chunk threads. Call only where
    :func:`available` said so."""
    bits = np.ascontiguousarray(x).view(np.uint16).reshape(-1)
    out = np.empty(x.shape, np.float32)
    flat, table = out.reshape(-1), widening_table(x.dtype)
    threads = cores.chunk_threads() if bits.size >= _WIDEN_SHARED else 1
    cuts = np.linspace(0, bits.size, threads + 1).astype(np.int64)

    def work(_, parts):
        for a, b in parts:
            _widen(bits[a:b], table, flat[a:b])
    cores.run_chunks(list(zip(cuts[:-1], cuts[1:])), work, threads, blas_threads=False)
    return out


def tokens_first_gemm(A: np.ndarray, blas_threads: bool = False):
    """``gemm(T, out)``: ``out[:] = T @ A.T`` for the query rows ``A [R, d]`` and a piece of tokens
    ``T [n, d]`` into ``out [n, R]``: in float32 by ``gemm_kernels`` where :func:`available`, the host
    has a row of ``_OWN_GEMM`` whose rows take R, the arrays are C-contiguous float32, and BLAS would not
    run the block on threads of its own (``blas_threads``: one chunk thread, BLAS keeping its threads,
    ``cores.run_chunks``), as the kernel runs on one core; else by BLAS (``np.matmul``). Either sums
    each product in an order the fold's margins cover."""
    global _gemm
    if _gemm is None and A.dtype == np.float32 and available():
        with _lock:
            if _gemm is None:
                _gemm = _build_gemm()
    At = A.T
    if not _gemm or blas_threads or A.dtype != np.float32 or A.shape[0] > _gemm[2]:
        return lambda T, out: np.matmul(T, At, out=out)
    from .gemm_kernels import pack

    own, lanes, _ = _gemm
    Ap = pack(A, lanes)

    def gemm(T, out):
        if T.dtype == out.dtype == np.float32 and T.flags.c_contiguous and out.flags.c_contiguous:
            own(T, Ap, out)
        else:
            np.matmul(T, At, out=out)
    return gemm


def _build_gemm():
    """``(gemm_kernels.tokens_by_rows, lanes, most rows)`` for this host, built and checked against
    float64, or False: no row of ``_OWN_GEMM`` fits the host, or Numba compiles for another CPU than it
    (``NUMBA_CPU_NAME``, ``NUMBA_CPU_FEATURES``: its vector FMAs could become library calls), or the
    build failed (one warning)."""
    try:
        from llvmlite import binding

        features = binding.get_host_cpu_features()
    except Exception:  # noqa: BLE001 (llvmlite cannot read this host's features: BLAS, silently)
        return False
    rule = next((r for r in _OWN_GEMM if all(features.get(f, False) for f in r[0])), None)
    if rule is None or _numba_config("CPU_NAME") is not None or _numba_config("CPU_FEATURES") is not None:
        return False
    try:
        from .gemm_kernels import pack, tokens_by_rows

        rng = np.random.default_rng(0x5eed)
        for i, (n, r, d) in enumerate(((1, 1, 1), (5, 17, 3), (9, 32, 128), (13, 40, 129))):  # tails; a long d
            T, A = (rng.standard_normal(s).astype(np.float32) for s in ((n, d), (r, d)))
            T.setflags(write=i % 2 == 0)  # both signatures a call can bring: writable and read-only tokens
            out = np.full((n, r), np.nan, np.float32)
            tokens_by_rows(T, pack(A, rule[1]), out)
            exact = T.astype(np.float64) @ A.T.astype(np.float64)
            if not np.all(np.abs(out - exact) <= d * 2.0 ** -23 * (np.abs(T) @ np.abs(A).T)):
                raise ArithmeticError("its sums differ from float64's by more than float32's rounding")
        return tokens_by_rows, rule[1], rule[2]
    except Exception as e:  # noqa: BLE001 (as for the fold: BLAS runs the GEMM instead)
        warnings.warn(f"the CPU path's compiled GEMM is not used ({type(e).__name__}: {e}); BLAS runs it instead",
                      RuntimeWarning, stacklevel=3)
        return False


def _numba_config(name: str):
    """``numba.config``'s setting ``name`` (Numba imported: called once :func:`available` said so)."""
    import numba

    return getattr(numba.config, name, None)


def _probe() -> list[tuple[np.ndarray, np.ndarray]]:
    """Pairs of rows whose float64 sums round at nearly every step, at the lengths where NumPy's
    summation changes shape (under 8, the eight partial sums, the halving past 128)."""
    rng = np.random.default_rng(0x5eed)
    pairs = []
    for d in (1, 3, 7, 8, 9, 15, 64, 127, 128, 129, 200, 256, 1000):
        for _ in range(4):
            a = rng.standard_normal(d) * np.exp2(rng.integers(-40, 40, d))
            pairs.append((a, rng.standard_normal(d).astype(np.float32)))
    return pairs


def _first_build():
    if importlib.util.find_spec("numba") is None:
        return False
    try:
        from . import fold_kernels as kernels

        for a, b in _probe():
            if kernels.dot(a, b, *kernels.scratch(a.size)) != np.add.reduce(a * b.astype(np.float64)):
                raise ArithmeticError("its float64 sums differ from NumPy's (np.add.reduce)")
        # compiled (or loaded) here, once, for tiny blocks of both offset types (float32, the common
        # case): not by two chunk threads at once later
        for rows in (1, _WIDE_ROWS + 1):
            DocumentFold(np.zeros(1, np.int64), np.ones(1, np.int64), None, np.zeros((rows, 1)),
                         np.zeros((1, 1), np.float32), np.float32, kernels.piece).piece(np.zeros((1, rows), np.float32), 0, 1)
        global _widen
        _widen = kernels.widen
        return kernels.piece
    except Exception as e:  # noqa: BLE001 (any failure of an optional accelerator leaves the NumPy passes)
        warnings.warn(f"numba is installed but the CPU path's compiled fold is not used ({type(e).__name__}: {e}); "
                      "the NumPy passes run instead", RuntimeWarning, stacklevel=3)
        return False


class DocumentFold:
    """One chunk's documents folded as its tokens-first GEMM fills ``St [n, R]`` (module docstring):
    documents ``start`` / ``length`` (int64 ``[nb]``, consecutive runs of the chunk's columns),
    ``valid`` (bool ``[n]``: the columns that count) or None, the query rows ``A64 [R, d]`` (float64)
    and the chunk's tokens ``T [n, d]`` (float32 or float64, C-contiguous: the GEMM's operand), the
    GEMM's output dtype ``dtype``. After the last piece: ``first`` (int64), ``best`` and ``second``
    (``dtype``) and ``win`` (float64), each ``[R, nb]``, and ``norms`` (``T``'s dtype, ``[nb]``). Build
    one only where :func:`available` said so."""

    def __init__(self, start, length, valid, A64, T, dtype, kernel=None):
        offset = np.dtype(np.int32 if A64.shape[0] > _WIDE_ROWS else np.int64)
        self._kernel = kernel or _kernel
        terms = np.array(norm_terms(T.shape[1], T.dtype), T.dtype)
        self._args = (T, A64, np.zeros(0, bool) if valid is None else valid, start, length, terms)
        rows, nb = A64.shape[0], start.size
        self._state = np.zeros(2, np.int64)  # the document the next piece begins in; the current runner-up buffer
        top, runner = np.full(rows, -np.inf, dtype), np.full(rows, -np.inf, dtype)
        self._run = (np.zeros(1, T.dtype), top, runner, np.empty(rows, dtype), np.zeros(rows, offset),
                     np.zeros(rows, bool), np.zeros(1, offset))
        self.first = np.empty((rows, nb), np.int64)
        self.best = np.empty((rows, nb), dtype)
        self.second = np.empty((rows, nb), dtype)
        self.win = np.empty((rows, nb))
        self.norms = np.empty(nb, T.dtype)

    def piece(self, St: np.ndarray, p0: int, p1: int) -> None:
        """Columns ``p0 .. p1`` of ``St`` (``dtype``) are filled, pieces in order from 0 to ``n`` (one
        piece ``0 .. 0`` when ``n`` is 0): the documents they end are folded, those they begin or go on
        with carried to the next piece."""
        self._kernel(St, *self._args, p0, p1, self._state, *self._run, self.first, self.best, self.second, self.win,
                     self.norms)
