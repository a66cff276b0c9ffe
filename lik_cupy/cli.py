"""``lik``: the command line of lik-cupy. Score a corpus of .npy shards, pack shards, inspect them.

This module is deliberately thin: inputs are opened and checked by
:mod:`lik_cupy.shards`, the top-k is computed by :func:`lik_cupy.retrieve` (the full
score matrix by :func:`lik_cupy.maxsim_varlen` / :func:`lik_cupy.maxsim`, for INT8 shards
:func:`lik_cupy.maxsim_int8_varlen`). What is
added here: option checks, spreading shards over GPUs and merging their rankings,
the progress bar, and the output, written through :mod:`lik_cupy._atomic` (complete or
absent, never clobbering, space reserved up front where the size is known).

Host memory is bounded by bytes on every path (``_MEMORY_HELP`` states the bound that
``lik score --help`` shows): documents go to the library about ``_PART_BYTES`` at a time,
the library's CPU path blocks them again by bytes (a long document in runs of tokens),
the queries are padded in groups of similar length (``_query_groups``), and the full
score matrix goes to disk part by part.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import json
import math
import os
import platform
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import NoReturn

import click
import numpy as np

import lik_cupy
from lik_cupy import _atomic, _files, shards
from lik_cupy import _shard_format as fmt
from lik_cupy._ranking import merge_ranked_rows
from lik_cupy.errors import LikError

# The scoring modules (lik_cupy.retrieval, lik_cupy._dispatch, ...) are imported by `lik score`
# alone, where it needs them: `lik info`, `pack`, `inspect` and `--help` start without them.

__all__ = ["main", "run_score", "EXIT_BAD_INPUT", "EXIT_INTERRUPTED"]

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
# stdout's reader went away (`lik inspect ... | head -1`): 128 + SIGPIPE, what a shell reports for a
# program that SIGPIPE ended, as 130 is 128 + SIGINT.
_EXIT_BROKEN_PIPE = 141
_OUTPUT_SUFFIXES = (".tsv", ".jsonl", ".npy")
# Corpus bytes per library call when a shard is scored piece by piece (CPU path, full
# matrix, dtype casts). GPU top-k calls take whole shards: retrieve overlaps its copies
# and kernels within one call, so splitting a shard would only add pipeline restarts.
_PART_BYTES = 64 << 20
# Queries are padded in groups of similar length whenever padding them all to the longest would
# take more than this and more than twice their own bytes (see _query_groups).
_QUERY_BYTES = 64 << 20
_MEMORY_HELP = f"""\b
Host memory is bounded by bytes, whatever the corpus: documents reach the library about
{_PART_BYTES >> 20} MiB at a time (a larger document alone, copied only when its dtype is cast), and the CPU
path works on blocks of about 64 MiB more (a long document in runs of its tokens, a wide d counted);
the queries are held padded in groups of similar length, at most twice their own bytes (or
{_QUERY_BYTES >> 20} MiB, if more); the top-k is [Nq, k]; the full matrix goes to disk {_PART_BYTES >> 20} MiB at a time.
"""


def _layout_help() -> str:
    """The shard layout drawn in ``lik_cupy.shards``' docstring, the one description of the format."""
    block = shards.__doc__.split("::\n\n", 1)[1].split("\n\n", 1)[0]
    return "\n".join(line[4:] for line in block.splitlines())


_FORMAT_HELP = ("\b\nInputs (opened memory-mapped, never unpickled):\n" + _layout_help() + """
  padded .npy    [N, L, d] (queries: [Nq, Lq, d]) + optional lengths [N]
  flat .npy      [T, d] + doclens [N] (.npy, or ColBERT's doclens.*.json)
A corpus is one or more shards (the format: `python -m pydoc lik_cupy.shards`). Doc ids are
the shards' ids.npy values, else global positions (shard 0 holds 0..N0-1, shard 1 continues
at N0, ...). `lik pack` makes shards, `lik pack --int8` INT8 shards (d + 4 bytes per token),
scored on INT8 tensor cores. A corpus is all INT8 or all float.
""")

_SCORE_EXAMPLE = """\b
Example (the bundled example shards, from the repository root):
  lik score --queries examples/queries.npy \\
            --docs examples/shard0 examples/shard1 --top-k 5 --out /tmp/lik-top5.tsv
"""


# --------------------------------------------------------------------------- errors


class _Cancelled(Exception):
    """A GPU worker stopped because another one failed or the run was interrupted."""


def _cli_errors(fn):
    """Turn bad input, Ctrl-C/SIGTERM and crashes into one stderr line and an exit code.

    A traceback is printed only when the command got ``--debug``.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        debug = bool(kwargs.get("debug"))
        try:
            return fn(*args, **kwargs)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except (LikError, shards.ShardError) as e:
            _bad_input(str(e), debug)
        except KeyboardInterrupt:
            if debug:
                traceback.print_exc()
            click.echo("lik: interrupted; no output written", err=True)
            raise click.exceptions.Exit(EXIT_INTERRUPTED) from None
        except BrokenPipeError:
            _silence_stdout()
            raise click.exceptions.Exit(_EXIT_BROKEN_PIPE) from None
        except OSError as e:
            if e.filename == _STDOUT:
                _silence_stdout()  # what is left in its buffer cannot be written either
            if e.filename is None:
                _internal(e, debug)
            # The environment, about one file: no space left, permission denied, a name too long, ...
            _bad_input(f"{e.filename}: {_files.problem(e)}", debug)
        except Exception as e:  # a bug or an environment problem, not bad input
            _internal(e, debug)

    return wrapper


def _bad_input(line: str, debug: bool) -> NoReturn:
    if debug:
        traceback.print_exc()
    click.echo(f"lik: error: {line}", err=True)
    raise click.exceptions.Exit(EXIT_BAD_INPUT) from None


def _internal(e: BaseException, debug: bool) -> NoReturn:
    if debug:
        traceback.print_exc()
    hint = "" if debug else " (rerun with --debug for a traceback)"
    click.echo(f"lik: error: internal error: {type(e).__name__}: {e}{hint}", err=True)
    raise click.exceptions.Exit(1) from None


_STDOUT = "standard output"


class _NamedStream:
    """``sys.stdout`` (and its ``buffer``) with failed writes naming it: a full stdout's OSError (ENOSPC
    on /dev/full or on a full disk behind ``> file``) names no file, and would read as a bug."""

    def __init__(self, stream):
        self._stream = stream

    def __getattr__(self, attr):
        value = getattr(self._stream, attr)
        return _NamedStream(value) if attr == "buffer" else value

    def write(self, data):
        return self._named(self._stream.write, data)

    def flush(self):
        return self._named(self._stream.flush)

    @staticmethod
    def _named(fn, *args):
        try:
            return fn(*args)
        except BrokenPipeError:  # its reader is gone: exit 141, quietly (_cli_errors)
            raise
        except OSError as e:
            if e.filename is not None or e.errno is None:
                raise
            raise OSError(e.errno, e.strerror, _STDOUT) from None


def _silence_stdout() -> None:
    """Point stdout at /dev/null: its reader is gone, and Python would otherwise complain when it
    flushes stdout on the way out."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return  # not a real file (a test's capture): nothing to flush into a closed pipe
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _raise_open_files_limit() -> None:
    """Let this process open as many files as its hard limit allows: every input stays open (memory-mapped,
    three or four files a shard directory), and the usual soft limit of 1024 stopped a run over a few
    hundred shards with "too many open files"."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):  # not POSIX, or not allowed: the limit stays as it is
        pass


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """Treat SIGTERM like Ctrl-C while working, so temporary output is cleaned up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


# --------------------------------------------------------------------------- output


def _check_output(out: str, full_matrix: bool, top_k: int) -> str:
    """The output's suffix; LikError (or OSError naming it) if it cannot be written as asked."""
    from lik_cupy.retrieval import MAX_K

    if not full_matrix and not 1 <= top_k <= MAX_K:
        raise LikError("--top-k", f"must be in 1..{MAX_K}, got {top_k} (--full-matrix writes every score)")
    suffix = os.path.splitext(out)[1].lower()
    if suffix not in _OUTPUT_SUFFIXES:
        raise LikError(out, f"unknown output suffix {repr(suffix) if suffix else '(none)'}; use .tsv, .jsonl or .npy")
    if full_matrix and suffix != ".npy":
        raise LikError(out, "--full-matrix writes the [Nq, Ndocs] float32 score matrix and needs a .npy output")
    if os.path.isdir(out):
        raise LikError(out, "is a directory, expected an output file name")
    outdir = os.path.dirname(os.path.abspath(out))
    if not os.path.exists(outdir):
        raise LikError(out, f"output directory {outdir} does not exist")
    if not os.path.isdir(outdir):
        raise LikError(out, f"{outdir} is not a directory")
    if not os.access(outdir, os.W_OK | os.X_OK):
        raise LikError(out, f"output directory {outdir} is not writable")
    _atomic.sweep(out)  # a killed run's temporaries go before anything is judged or written
    why = _replaceable_output(out)
    if why is not None:
        raise LikError(out, why)
    _atomic.check_name(out)
    return suffix


def _replaceable_output(path: str) -> str | None:
    """None if an output may replace what is at ``path`` (nothing, a regular file, or a symbolic
    link to one: the link itself is replaced), else why not. A FIFO or a device is never
    replaced: the result would not reach whoever reads it, and the special file would be gone."""
    try:
        what = _files.file_kind(path)
    except shards.ShardError as e:
        return e.problem
    if what in (None, "a regular file"):
        return None
    return f"is {what}; an output replaces a regular file, never anything else (name a new file)"


def _check_not_an_input(out: str, files: list[str], shard_dirs: list[str]) -> None:
    """The output may neither replace an input file nor land inside a shard directory."""
    target = os.path.realpath(out)
    for f in files:
        if os.path.realpath(f) == target:
            raise LikError(out, f"is an input of this run ({f}); choose another output path")
    for d in shard_dirs:
        root = os.path.realpath(d)
        if os.path.commonpath([root, target]) == root:
            raise LikError(out, f"lies inside the shard directory {d}; choose a path outside it")


def _format_score(x) -> str:
    return str(np.float32(x))  # shortest repr that round-trips float32; 'nan', '-inf'


def _write_tsv(f, qids, docids, vals):
    """The rows of queries ``qids`` (the header is written once, before the first block)."""
    for q in range(vals.shape[0]):
        f.write("".join(f"{qids[q]}\t{r + 1}\t{docids[q, r]}\t{_format_score(vals[q, r])}\n" for r in range(vals.shape[1])))


def _write_jsonl(f, qids, docids, vals):
    for q in range(vals.shape[0]):
        for r in range(vals.shape[1]):
            s = vals[q, r]
            score = float(_format_score(s)) if np.isfinite(s) else None  # JSON has no inf/NaN
            f.write(json.dumps({"query": qids[q].item(), "rank": r + 1, "doc": docids[q, r].item(), "score": score}) + "\n")


def _readable_ids(ids: np.ndarray) -> np.ndarray:
    """int64 ids as they are; byte-string ids decoded to str."""
    return np.char.decode(ids, "utf-8", errors="backslashreplace") if ids.dtype.kind == "S" else np.asarray(ids)


class _DocIds:
    """Global document positions -> the ids results show: the shards' ids.npy values, else the positions."""

    def __init__(self, corpus: list[shards.Shard]):
        named = [s for s in corpus if s.ids is not None]
        if named and len(named) != len(corpus):
            bare = next(s for s in corpus if s.ids is None)
            raise LikError(bare.path, f"has no ids but {named[0].path} has; give every shard ids.npy, or none")
        numeric = [s.ids.dtype.kind in "iu" for s in named]
        if len(set(numeric)) > 1:
            odd = named[numeric.index(not numeric[0])]
            raise LikError(odd.path, f"has {'integer' if not numeric[0] else 'string'} ids but {named[0].path} has "
                                     f"{'integer' if numeric[0] else 'string'} ids; use one kind in every shard")
        self.corpus = corpus if named else None
        self.starts = np.cumsum([0] + [s.num_docs for s in corpus])
        self.width = max([8] + [s.ids.dtype.itemsize * (4 if s.ids.dtype.kind == "S" else 1) for s in named])

    def rows_per_block(self, k: int) -> int:
        """Queries whose ``k`` ids, each as wide as the widest a shard declares (as str), fit 64 MiB."""
        return max(1, _QUERY_BYTES // max(1, k * self.width))

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """``positions`` int64 [Nq, k] -> ids [Nq, k] (int64, or str as wide as the longest of them).
        Each shard's ids are read once per distinct position and cut to the longest read: an
        ids.npy may declare a width far past its ids' (``<U100000``), and gathering every result
        at that width took gigabytes. The positions are sorted by shard once: a mask of every position
        for each shard made a block take time growing as its results times the shards."""
        if self.corpus is None:
            return positions
        flat = positions.reshape(-1)
        which = np.searchsorted(self.starts, flat, side="right") - 1
        order = np.argsort(which, kind="stable")  # (each shard's positions in their own order)
        shards_hit, first = np.unique(which[order], return_index=True)
        parts = []
        for j, sel in zip(shards_hit.tolist(), np.split(order, first[1:])):
            distinct, back = np.unique(flat[sel] - self.starts[j], return_inverse=True)
            ids = _readable_ids(self.corpus[j].ids[distinct])
            if ids.dtype.kind == "U" and ids.size:
                ids = ids.astype(f"<U{max(1, int(np.char.str_len(ids).max()))}")
            parts.append((sel, ids[back.reshape(-1)]))
        dtype = np.result_type(*(v.dtype for _, v in parts)) if parts else np.int64
        out = np.empty(flat.shape, dtype)
        for sel, values in parts:
            out[sel] = values
        return out.reshape(positions.shape)


# --------------------------------------------------------------------------- progress


class _Progress:
    """A progress bar with docs/s on stderr when it is a terminal; silent otherwise. Thread-safe."""

    def __init__(self, total: int):
        self._bar = None
        if sys.stderr.isatty():
            self._bar = click.progressbar(length=total, label="scoring", file=sys.stderr, item_show_func=lambda s: s)
        self._lock = threading.Lock()
        self._done = 0
        self._start = time.monotonic()

    def __enter__(self):
        if self._bar is not None:
            self._bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)
        return False

    def update(self, docs: int) -> None:
        if self._bar is None:
            return
        with self._lock:
            self._done += docs
            rate = self._done / max(time.monotonic() - self._start, 1e-9)
            self._bar.update(docs, f"{rate:,.0f} docs/s")


# --------------------------------------------------------------------------- devices


def _gpu_available() -> bool:
    try:
        return bool(lik_cupy.gpu_available())
    except Exception:
        return False


def _gpu_index(entry: str) -> int | None:
    """A --devices entry's GPU index, or None where it is not one. Digits only (spaces around them
    aside): int() also takes "-1", "+1" and "1_0"."""
    x = entry.strip()
    return int(x) if x.isascii() and x.isdigit() else None


def _parse_devices(text: str) -> list[int]:
    """--devices of ``lik score``: distinct GPU indices."""
    devices = [_gpu_index(x) for x in text.split(",")]
    if None in devices:
        raise LikError("--devices", f"expected comma-separated GPU indices such as 0,1; got {text!r}")
    if len(set(devices)) != len(devices):
        raise LikError("--devices", f"lists a GPU twice: {text}")
    return devices


def _choose_backend(cpu: bool, device: int | None, devices: str | None) -> tuple[str, list[int | None]]:
    """("gpu" | "cpu", the GPUs to spread shards over; [None] = the current device)."""
    if device is not None and devices is not None:
        raise LikError("--devices", "give --device or --devices, not both")
    option = "--devices" if devices is not None else "--device"
    wanted = _parse_devices(devices) if devices is not None else None if device is None else [device]
    if cpu:
        if wanted is not None:
            raise LikError(option, "conflicts with --cpu; drop one of them")
        return "cpu", [None]
    if not _gpu_available():
        if wanted is not None:
            raise LikError(option, "no usable GPU found; drop it to fall back to the CPU, or pass --cpu")
        click.echo("lik: no usable GPU found, falling back to CPU (pass --cpu to silence this)", err=True)
        return "cpu", [None]
    if wanted is None:
        return "gpu", [None]
    count = _gpu_count()
    for d in wanted:
        if not 0 <= d < count:
            raise LikError(option, f"no GPU {d}; {count} visible (0..{count - 1})")
    return "gpu", wanted


def _gpu_count() -> int:
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


def _device_scope(device: int | None):
    if device is None:
        return contextlib.nullcontext()
    import cupy

    return cupy.cuda.Device(device)


# --------------------------------------------------------------------------- scoring


@dataclass(frozen=True)
class _Part:
    """Documents ``start..stop-1`` of one shard, scored in one library call; ``first`` is the global position of ``start``."""

    shard: shards.Shard
    start: int
    stop: int
    first: int

    @property
    def docs(self) -> int:
        return self.stop - self.start

    @property
    def nbytes(self) -> int:
        s = self.shard
        rows = (self.stop - self.start) * s.tokens.shape[1] if s.padded else int(s.offsets[self.stop] - s.offsets[self.start])
        return rows * s.bytes_per_token

    def arrays(self, dtype: np.dtype):
        """(docs, offsets, lengths, scales) for the library: padded [n, L, d] + lengths, or packed
        [t, d] + offsets; int8 tokens (``dtype`` int8) come with their float32 scales [t], else None."""
        s = self.shard
        if s.padded:
            lens = None if s.lengths is None else s.lengths[self.start : self.stop]
            return s.tokens[self.start : self.stop].astype(dtype, copy=False), None, lens, None
        tokens, offsets = s.read_chunk(self.start, self.stop)
        scales = s.read_scales(self.start, self.stop) if s.scales is not None else None
        return tokens.astype(dtype, copy=False), offsets, None, scales


def _plan(corpus: list[shards.Shard], dtype: np.dtype, whole_shards: bool, max_docs: int = 0) -> list[_Part]:
    """The library calls: whole shards, or about _PART_BYTES of documents each (and at most
    ``max_docs`` documents, 0: any number)."""
    parts, first = [], 0
    for s in corpus:
        if whole_shards and s.tokens.dtype == dtype:
            ranges = [(0, s.num_docs)] if s.num_docs else []
        else:
            ranges = s.chunk_ranges(_PART_BYTES, max_docs)
        parts += [_Part(s, a, b, first + a) for a, b in ranges]
        first += s.num_docs
    return parts


def _balance(parts: list[_Part], n: int) -> list[list[_Part]]:
    """Deal parts to n devices, each part to the least-loaded one (by bytes); each keeps corpus order."""
    groups, loads = [[] for _ in range(n)], [0] * n
    for p in parts:
        i = loads.index(min(loads))
        groups[i].append(p)
        loads[i] += p.nbytes
    return groups


def _spread(devices: list[int | None], parts: list[_Part], job) -> list:
    """Run ``job(parts_of_one_device, cancelled)`` per device, inside its device scope; results in device order.

    One device runs in this thread. Several run in threads; the first failure (or
    Ctrl-C here) sets ``cancelled`` so the others stop at their next part.
    """
    groups = _balance(parts, len(devices))
    cancelled = threading.Event()
    if len(devices) == 1:
        with _device_scope(devices[0]):
            return [job(groups[0], cancelled)]
    results, errors = [None] * len(devices), []

    def run(i):
        try:
            with _device_scope(devices[i]):
                results[i] = job(groups[i], cancelled)
        except _Cancelled:
            pass
        except BaseException as e:  # handed to the main thread, which reports it
            errors.append(e)
            cancelled.set()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(devices))]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except BaseException:
        cancelled.set()
        raise
    if errors:
        raise errors[0]
    return results


def _call(part: _Part, fn, *args, **kwargs):
    """A library call; its ValueError/TypeError (bad input found by the library) becomes a LikError naming the shard."""
    try:
        return fn(*args, **kwargs)
    except shards.ShardError:
        raise
    except (ValueError, TypeError) as e:
        raise LikError(part.shard.tokens_file, f"lik_cupy rejected documents {part.start}..{part.stop - 1}: {e}") from None


def _top_k(groups: list[_QueryGroup], nq: int, k, backend, devices, parts, bar, dtype):
    def job(mine, cancelled):
        vals, ids = np.empty((nq, 0), np.float32), np.empty((nq, 0), np.int64)
        for part in mine:
            if cancelled.is_set():
                raise _Cancelled
            D, offsets, lens, scales = part.arrays(dtype)
            extra = {} if scales is None else {"d_scales": scales}
            s = i = None
            for g in groups:
                gs, gi = _call(part, lik_cupy.retrieve, g.Q, D, k, q_lengths=g.lengths, d_offsets=offsets,
                               d_lengths=lens, backend=backend, **extra)
                if s is None:
                    s, i = np.empty((nq, gs.shape[1]), np.float32), np.empty((nq, gs.shape[1]), np.int64)
                s[g.rows], i[g.rows] = np.asarray(gs, np.float32), np.asarray(gi, np.int64)
            i += part.first
            # (merged whole, many queries' top k took about 48 bytes a candidate: 8x the result)
            vals, ids = merge_ranked_rows(vals, ids, s, i, k, _PART_BYTES)
            bar.update(part.docs)
        return vals, ids

    ranked = _spread(devices, parts, job)
    if len(ranked) == 1:
        return ranked[0]
    vals, ids = np.empty((nq, 0), np.float32), np.empty((nq, 0), np.int64)
    for v, i in ranked:
        vals, ids = merge_ranked_rows(vals, ids, v, i, k, _PART_BYTES)
    return vals, ids


def _full_matrix(groups: list[_QueryGroup], backend, devices, parts, bar, matrix: _MatrixFile, dtype):
    def job(mine, cancelled):
        for part in mine:
            if cancelled.is_set():
                raise _Cancelled
            D, offsets, lens, scales = part.arrays(dtype)
            for g in groups:
                if scales is not None:
                    S = _call(part, lik_cupy.maxsim_int8_varlen, g.Q, D, scales, offsets, q_lengths=g.lengths,
                              backend=backend)
                elif offsets is None:
                    S = _call(part, lik_cupy.maxsim, g.Q, D, q_lengths=g.lengths, d_lengths=lens, backend=backend)
                else:
                    S = _call(part, lik_cupy.maxsim_varlen, g.Q, D, offsets, q_lengths=g.lengths, backend=backend)
                matrix.write(g.rows, part.first, np.asarray(S, np.float32))
            bar.update(part.docs)

    _spread(devices, parts, job)


class _MatrixFile:
    """The full score matrix, a float32 [Nq, Ndocs] .npy, as it is written: the header, the whole
    size reserved (a disk too small fails before scoring), then blocks of columns by positioned
    writes. Never a writable memory map: a full disk under one kills the process with SIGBUS."""

    def __init__(self, f, out: str, shape: tuple[int, int]):
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": shape})
        f.flush()
        self._fd, self._start, self._width = f.fileno(), f.tell(), shape[1]
        _atomic.allocate(f, self._start + shape[0] * shape[1] * 4, out)

    def write(self, rows: np.ndarray, first: int, S: np.ndarray) -> None:
        """Scores ``S`` [len(rows), n] of queries ``rows`` against documents ``first .. first+n-1``."""
        S = np.ascontiguousarray(S, "<f4")
        for r, values in zip(rows, S):
            data, at = memoryview(values).cast("B"), self._start + (int(r) * self._width + first) * 4
            while data:  # a regular file takes it all unless the disk fills, which then raises
                n = os.pwrite(self._fd, data, at)
                data, at = data[n:], at + n


@dataclass(frozen=True)
class _QueryGroup:
    """Queries ``rows`` (int64 positions in the query input) padded together: ``Q`` [n, L, d] and
    their lengths [n] (None: all L rows valid)."""

    rows: np.ndarray
    Q: np.ndarray
    lengths: np.ndarray | None


def _query_groups(query: shards.Shard, dtype: np.dtype | None) -> list[_QueryGroup]:
    """Every query in memory, padded, cast to ``dtype`` (None: float, int8 dequantized).

    Usually one group, padded as the input is (a padded file's own width, a packed one's
    longest query): whenever that takes at most twice the queries' own bytes, or 64 MiB.
    Past that (a few queries far longer than the rest) they are grouped: longest first, each
    group as long as padding it to its longest takes at most twice its own bytes, the
    queries without tokens together, as ``[n, 0, d]`` (no row at all: a row each, of a large d,
    made a small file of empty queries take gigabytes). So the queries never hold more than
    twice their bytes, or 64 MiB.
    """
    lens, n = query.doc_lengths(), query.num_docs
    row = query.dim * (4 if dtype is None and query.scales is not None else (dtype or query.tokens.dtype).itemsize)
    width = query.tokens.shape[1] if query.padded else max(1, int(lens.max()))
    if n * width * row <= max(_QUERY_BYTES, 2 * int(lens.sum()) * row):
        return [_query_group(query, np.arange(n), width, dtype)]
    order = np.argsort(-lens, kind="stable")
    groups, i = [], 0
    while i < n:
        top = int(lens[order[i]])
        # Lengths fall, so once padding costs more than twice the tokens it only gets worse.
        fits = np.arange(1, n - i + 1) * top <= 2 * np.cumsum(lens[order[i:]]) if top else np.ones(n - i, bool)
        take = n - i if fits.all() else int(np.argmin(fits))
        groups.append(_query_group(query, np.sort(order[i : i + take]), top, dtype))
        i += take
    return groups


def _query_group(query: shards.Shard, rows: np.ndarray, width: int, dtype: np.dtype | None) -> _QueryGroup:
    if query.padded and rows.size == query.num_docs and width == query.tokens.shape[1]:  # the whole input
        Q, lengths = np.array(query.tokens), None if query.lengths is None else np.array(query.lengths)
    elif query.padded:
        Q, lengths = np.asarray(query.tokens[rows, :width]), query.doc_lengths()[rows]
    else:
        lengths = query.doc_lengths()[rows]
        valid = np.arange(width)[None, :] < lengths[:, None]
        src = (query.offsets[rows][:, None] + np.arange(width)[None, :])[valid]
        tokens = np.asarray(query.tokens[src])
        if query.scales is not None:
            tokens = tokens.astype(np.float32) * query.scales[src][:, None]
        Q = np.zeros((rows.size, width, query.dim), tokens.dtype)
        Q[valid] = tokens
    if dtype is not None:
        with np.errstate(over="ignore"):  # a value past the dtype's range: refused by --check (_check_cast)
            Q = Q.astype(dtype, copy=False)
    return _QueryGroup(rows, Q, lengths)


def _check_cast(groups: list[_QueryGroup], query: shards.Shard, dtype: np.dtype) -> None:
    """--check on the values scored: queries cast to the corpus's dtype must still be finite
    (a float32 70000 is inf as float16). Padding rows are never scored, so never checked."""
    bad = []
    for g in groups:
        finite = np.isfinite(g.Q.astype(np.float32)).all(axis=2)
        if g.lengths is not None:
            finite |= np.arange(g.Q.shape[1])[None, :] >= g.lengths[:, None]
        if not finite.all():
            r, t = np.argwhere(~finite)[0]
            bad.append((int(g.rows[r]), int(t)))
    if bad:
        q, t = min(bad)
        row = (q, t) if query.padded else int(query.offsets[q]) + t
        value = np.asarray(query.tokens[row], np.float32) * (1 if query.scales is None else query.scales[row])
        largest = float(np.abs(value).max())
        raise LikError(query.tokens_file, f"query {q}, token {t} holds {largest:g}, which is inf as {dtype.name}, "
                                          "the corpus's dtype the queries are cast to; embeddings must be finite")


# --------------------------------------------------------------------------- scoring on Dask
# --scheduler, and --devices with two or more GPUs when dask-cuda is installed, score on a Dask
# cluster through lik_cupy.distributed: shards resident on the workers, rankings merged there.


def _cluster_backend(cpu: bool, device: int | None, devices: str | None) -> tuple[str, list]:
    """The backend the cluster's workers use (each finds its own GPU); --device/--devices name this machine's GPUs."""
    if device is not None or devices:
        raise LikError("--scheduler", "scores on the cluster's workers, each on its own GPU; drop --device/--devices")
    return ("cpu" if cpu else "auto"), []


def _dask_cuda_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("dask_cuda") is not None


@contextlib.contextmanager
def _dask_corpus(scheduler: str | None, gpus: list, backend: str, docs, d_lengths, bf16_bits: bool, dtype: str | None):
    """The --docs inputs resident on a Dask cluster: the one at ``scheduler``, else a LocalCUDACluster
    of ``gpus`` (two or more, with dask-cuda installed) started for this run. Yields a
    ``lik_cupy.distributed.DistributedCorpus``, or None to score in this process."""
    if scheduler is None and (len(gpus) < 2 or not _dask_cuda_installed()):
        if len(gpus) > 1:
            click.echo("lik: dask-cuda is not installed, so --devices spreads shards over threads of this process; "
                       "pip install 'lik-cupy[distributed-gpu]' for one worker process per GPU", err=True)
        yield None
        return
    import logging

    from distributed import Client

    from lik_cupy.distributed import DistributedCorpus

    lengths = iter(d_lengths)  # --d-lengths pair with the .npy inputs by position, as _open_corpus reads them
    sources = [p if os.path.isdir(p) else (p, next(lengths, None)) for p in docs]
    with contextlib.ExitStack() as stack:
        # Log lines (Dask's client failing to reconnect, ...) are silenced for the run: the cluster's
        # trouble reaches the user as the one-line error below.
        stack.callback(logging.disable, logging.root.manager.disable)
        logging.disable(logging.CRITICAL)
        if scheduler is None:
            from dask_cuda import LocalCUDACluster

            # A free port for the scheduler's web server (another cluster may hold 8787); workers'
            # logs silenced, since their errors reach the user as the one-line error below.
            cluster = stack.enter_context(LocalCUDACluster(
                CUDA_VISIBLE_DEVICES=_driver_devices(gpus), n_workers=len(gpus), threads_per_worker=1,
                dashboard_address=":0", silence_logs=logging.CRITICAL))
            client = stack.enter_context(Client(cluster))
        else:
            client = stack.enter_context(_connect(scheduler))
        address = client.scheduler.address  # a client that closes (its scheduler gone) forgets it
        try:
            yield stack.enter_context(DistributedCorpus(client, sources, dtype=dtype, bf16_bits=bf16_bits,
                                                        backend=backend))
        except TimeoutError as e:  # the cluster's trouble, not a bug here: its own message, exit status 2
            raise LikError("--scheduler" if scheduler else "--devices", str(e)) from None
        except OSError as e:
            if e.filename is not None:  # a file's trouble (outputs are named by _atomic, stdout by _NamedStream)
                raise
            # the scheduler went away mid-run: Dask's CommClosedError, a reset, a reconnect that timed out
            raise LikError("--scheduler" if scheduler else "--devices",
                           f"lost the connection to the Dask scheduler at {address}: {e}") from None


def _driver_devices(gpus: list[int]) -> str:
    """The CUDA_VISIBLE_DEVICES of a LocalCUDACluster of ``gpus`` (indices among the GPUs this process
    sees). dask-cuda hands that list to each worker as it is, where the driver reads it against every
    GPU of the machine: under CUDA_VISIBLE_DEVICES=2,3 this process's GPUs 0 and 1 are the entries 2
    and 3, and "0,1" would name GPUs its user had left out."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return ",".join(map(str, gpus))
    entries = [e.strip() for e in visible.split(",")]
    return ",".join(entries[d] for d in gpus)  # every d < the GPUs seen, so < the entries


def _connect(scheduler: str):
    """A ``distributed.Client`` of the scheduler at ``scheduler`` within about Dask's connect timeout
    (``distributed.comm.timeouts.connect``: 30 s unless configured, as by
    ``DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT``), whatever answers there: Client's own timeout
    bounds the TCP connect, not the handshake that follows, which waits for ever on a peer that
    accepts and says nothing. The connecting thread is a daemon, so one left waiting does not hold
    up the exit. The client's timeout is also how long it tries to get a lost scheduler back before
    it closes for good (``lik serve --scheduler`` then connects a new one)."""
    import dask.config
    import dask.utils
    from distributed import Client

    timeout = dask.utils.parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"), default="s")
    done: dict = {}

    def connect():
        try:
            done["client"] = Client(scheduler, timeout=timeout)
        except BaseException as e:  # handed to the caller's thread
            done["error"] = e

    t = threading.Thread(target=connect, name="lik-connect", daemon=True)
    t.start()
    t.join(timeout + 1)
    if t.is_alive():
        raise LikError("--scheduler", f"no Dask scheduler answered at {scheduler} within {timeout:g} s "
                                      "(something there accepts connections but does not answer as one)")
    e = done.get("error")
    # unreachable (TimeoutError is an OSError), not an address, or a scheme this Dask cannot use as it is
    # configured (tls:// without a security config, ucx:// without UCX: TypeError)
    if isinstance(e, (OSError, ValueError, TypeError)):
        raise LikError("--scheduler", f"cannot reach a Dask scheduler at {scheduler}: {e}") from None
    if e is not None:
        raise e
    return done["client"]


def _on_dask(fn, *args, **kwargs):
    """``fn`` (a DistributedCorpus method); bad input the workers' lik_cupy calls found becomes a LikError."""
    try:
        return fn(*args, **kwargs)
    except shards.ShardError:
        raise
    except (ValueError, TypeError) as e:
        raise LikError("--docs", f"lik_cupy rejected the corpus on the Dask workers: {e}") from None


def _dask_top_k(corpus, groups: list[_QueryGroup], nq: int, k: int):
    """The top ``k`` of every query group on the cluster, in query order."""
    vals, ids = np.empty((nq, k), np.float32), np.empty((nq, k), np.int64)
    for g in groups:
        vals[g.rows], ids[g.rows] = _on_dask(corpus.search, g.Q, k, q_lengths=g.lengths)
    return vals, ids


def _open_corpus(docs, d_lengths, bf16_bits: bool) -> list[shards.Shard]:
    """Open every --docs input; --d-lengths pair with the .npy inputs (not shard directories), in order."""
    npy = [p for p in docs if not os.path.isdir(p)]
    if d_lengths and len(d_lengths) != len(npy):
        raise LikError(
            "--d-lengths",
            f"got {len(d_lengths)} lengths file(s) for {len(npy)} .npy doc input(s); give one per .npy input, "
            "in the same order (shard directories carry their own offsets)",
        )
    lengths = iter(d_lengths)  # by position: one .npy given twice may come with two lengths files
    return [shards.open_input(p, None if os.path.isdir(p) else next(lengths, None), bf16_bits=bf16_bits) for p in docs]


def _check_precision_default() -> None:
    """LIK_PRECISION checked before any work: a bad value failed the first library call, whose error
    ``_call`` blames on the documents being scored."""
    from lik_cupy._dispatch import precision

    try:
        precision.default()  # (set_precision's value, where a caller of run_score set one, wins)
    except ValueError:
        raise LikError("LIK_PRECISION", f"must be {' or '.join(map(repr, precision.PRECISIONS))} (or unset), got "
                                        f"{os.environ['LIK_PRECISION']!r}; it is the process default of the float32 "
                                        "precision, which --precision sets for one run") from None


def _check_gpu_switches() -> None:
    """The GPU path's on/off variables checked before any work, for the reason of ``_check_precision_default``
    (local Dask workers inherit them)."""
    from lik_cupy._base import env

    for name, read in (("LIK_VALIDATE", env.validate_strict), ("LIK_POISON", env.poison_outputs),
                       ("LIK_DISABLE_WGMMA", env.wgmma_disabled), ("LIK_DISABLE_TMA", env.tma_disabled)):
        try:
            read()
        except ValueError as e:  # (the value may be read under its deprecated name)
            raise LikError(name, str(e).removeprefix(f"environment variable {name} ")) from None


def run_score(queries: str, docs, out: str, *, q_lengths: str | None = None, d_lengths=(), top_k: int = 10,
              full_matrix: bool = False, check: bool = False, cpu: bool = False, device: int | None = None,
              devices: str | None = None, bf16_bits: bool = False, scheduler: str | None = None) -> None:
    """Score every query against every document and write ``out`` (see ``lik score --help``)."""
    suffix = _check_output(out, full_matrix, top_k)
    if scheduler is None:  # (a cluster's workers read their own)
        _check_precision_default()
    if not docs:
        raise LikError("--docs", "give at least one shard directory or .npy file")
    query = shards.open_input(queries, q_lengths, bf16_bits=bf16_bits)
    if query.num_docs == 0:
        raise LikError(queries, "holds no queries")
    corpus = _open_corpus(list(docs), list(d_lengths), bf16_bits)
    for i, s in enumerate(corpus):
        if s.dim != query.dim:
            also = f" and from {corpus[0].tokens_file}" if i and corpus[0].dim == query.dim else ""
            raise LikError(s.tokens_file, f"embedding dim d={s.dim} differs from the queries' d={query.dim} ({query.tokens_file}){also}")
    kinds = {s.dtype for s in corpus}
    int8 = fmt.INT8 in kinds
    if int8 and len(kinds) > 1:
        odd = next(s for s in corpus if (s.dtype == fmt.INT8) != (corpus[0].dtype == fmt.INT8))
        raise LikError(odd.path, f"holds {odd.dtype} tokens but {corpus[0].path} holds {corpus[0].dtype}; a corpus is "
                                 "all INT8 or all float (convert a shard with `lik pack SHARD --int8` or --dtype)")
    n_docs = sum(s.num_docs for s in corpus)
    if n_docs == 0:
        raise LikError(docs[0], "no documents in any input")
    inputs = [queries, *docs, *([q_lengths] if q_lengths else []), *d_lengths]
    _check_not_an_input(out, [p for p in inputs if not os.path.isdir(p)], [p for p in inputs if os.path.isdir(p)])
    doc_ids = _DocIds(corpus)
    if check:
        for s in [query, *corpus]:
            shards.check_finite(s, max_bytes=_PART_BYTES)  # within the memory --help states

    # One dtype for the library: the corpus's own when all shards share one (queries are cast to it), else float32.
    # An INT8 corpus takes the queries as they are (float; quantized per library call).
    dtype = fmt.numpy_dtype(kinds.pop() if len(kinds) == 1 else "float32")
    groups = _query_groups(query, None if int8 else dtype)
    if check and not int8 and dtype != query.tokens.dtype:
        _check_cast(groups, query, dtype)
    qids = _readable_ids(query.ids) if query.ids is not None else np.arange(query.num_docs)
    nq = query.num_docs

    if scheduler is None:
        backend, gpus = _choose_backend(cpu, device, devices)
        if backend == "gpu":
            _check_gpu_switches()
    else:
        backend, gpus = _cluster_backend(cpu, device, devices)
    from lik_cupy import _dispatch as dispatch

    spec = dispatch.elem_spec(fmt.INT8)
    if int8 and backend == "gpu" and not spec.dim_ok(query.dim):
        raise LikError(corpus[0].path, f"INT8 shards of d={query.dim} cannot be scored on the GPU (the INT8 kernels "
                                       f"take d {spec.dim_rule()}); pass --cpu")
    # A full matrix part's scores [Nq, docs] stay within _PART_BYTES too.
    parts = _plan(corpus, dtype, whole_shards=backend == "gpu" and not full_matrix,
                  max_docs=max(1, _PART_BYTES // (4 * nq)) if full_matrix else 0)
    cast = None if int8 else dtype.name
    with (_atomic.output_file(out, _replaceable_output) as f,
          _dask_corpus(scheduler, gpus, backend, docs, d_lengths, bf16_bits, cast) as on_dask):
        with _Progress(n_docs) as bar:
            if full_matrix:
                matrix = _MatrixFile(f, out, (nq, n_docs))
                if on_dask is None:
                    _full_matrix(groups, backend, gpus, parts, bar, matrix, dtype)
                else:
                    for g in groups:
                        _on_dask(on_dask.score, g.Q, q_lengths=g.lengths, write=functools.partial(matrix.write, g.rows))
                    bar.update(n_docs)
            elif on_dask is None:
                vals, positions = _top_k(groups, nq, min(top_k, n_docs), backend, gpus, parts, bar, dtype)
            else:
                vals, positions = _dask_top_k(on_dask, groups, nq, min(top_k, n_docs))
                bar.update(n_docs)
        if not full_matrix:
            if suffix == ".npy":
                np.save(f, doc_ids(positions), allow_pickle=False)
            else:  # ids looked up a block of queries at a time: long ids are held for that block only
                text = io.TextIOWrapper(f, encoding="utf-8", newline="\n")
                write = _write_tsv if suffix == ".tsv" else _write_jsonl
                if suffix == ".tsv":
                    text.write("query\trank\tdoc\tscore\n")
                block = doc_ids.rows_per_block(positions.shape[1])
                for q0 in range(0, nq, block):
                    rows = slice(q0, q0 + block)
                    write(text, qids[rows], doc_ids(positions[rows]), vals[rows])
                text.flush()
                text.detach()  # ``f`` stays open; output_file closes it


# --------------------------------------------------------------------------- commands


class _GreedyCommand(click.Command):
    """Lets the options in ``greedy`` take several values (``--docs a b``), as ``--docs a --docs b`` does."""

    greedy = ("--docs", "--d-lengths")
    short = {"-d": "--docs"}

    def parse_args(self, ctx, args):
        out, current, expecting = [], None, False
        for i, tok in enumerate(args):
            if tok == "--":
                out.extend(args[i:])
                break
            if tok.startswith("-") and len(tok) > 1:
                name, eq, _ = tok.partition("=")
                short = next((s for s in self.short if tok.startswith(s) and not tok.startswith("--")), None)
                if name in self.greedy:
                    current, expecting = name, not eq
                elif short:  # -d FILE or -dFILE
                    current, expecting = self.short[short], tok == short
                else:
                    current = None
            elif current is not None:
                if expecting:
                    expecting = False  # the option's own value
                else:
                    out.append(current)  # one more value: repeat the option
            out.append(tok)
        return super().parse_args(ctx, out)


_CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class _Lik(click.Group):
    """The ``lik`` group: stdout's failed writes name it (``_NamedStream``), and one outside a
    command's own handling (``--help``) is the same one line and exit status 2."""

    def main(self, *args, **kwargs):
        real = sys.stdout
        sys.stdout = _NamedStream(real)
        try:
            return super().main(*args, **kwargs)
        except OSError as e:
            if e.filename != _STDOUT:
                raise
            _silence_stdout()
            click.echo(f"lik: error: {_STDOUT}: {_files.problem(e)}", err=True)
            sys.exit(EXIT_BAD_INPUT)
        finally:
            sys.stdout = real


@click.group(
    cls=_Lik,
    help="lik: late-interaction (ColBERT / ColPali) MaxSim retrieval with lik_cupy.\n\n"
    "score[i, j] = sum over valid query tokens s of max over valid doc tokens t of "
    "<Q[i, s], D[j, t]>. Scoring runs on a GPU through lik_cupy's CUDA kernels when one is "
    "visible, else on the CPU (exact NumPy path).\n\n" + _FORMAT_HELP + "\n\b\nExamples:\n"
    "  lik score --queries examples/queries.npy --docs examples/shard0 examples/shard1 \\\n"
    "            --top-k 5 --out /tmp/lik-top5.tsv   # rank the bundled example shards\n"
    "  lik pack docs.npy --lengths lens.npy --out shard0   # padded [N, L, d] -> shard\n"
    "  lik inspect examples/shard0 --check             # manifest and checks\n"
    "  lik info                                        # versions, GPUs, kernel cache\n",
    context_settings=_CONTEXT,
)
def main():
    pass


@main.command(
    "score",
    cls=_GreedyCommand,
    help="Rank every document of the corpus for every query and write the top-k per query "
    "(or, with --full-matrix, every score).\n\n"
    + _FORMAT_HELP
    + "\n\b\nQueries (--queries) are a padded [Nq, Lq, d] .npy with optional --q-lengths, a flat\n"
    "[T, d] .npy with --q-lengths as its doclens, or a shard directory (its ids name the queries).\n"
    "Docs (--docs) are shard directories and/or .npy files; --d-lengths gives one lengths file\n"
    "per .npy doc input, in order. Mixed dtypes are scored in float32; otherwise the queries\n"
    "are cast to the corpus's dtype. INT8 shards are scored as they are (float queries are\n"
    "quantized per token on the fly); float and INT8 shards do not mix in one corpus.\n"
    "\n\b\nOutput (chosen by the suffix of --out; written to a temporary file beside it and renamed\n"
    "at the end, so a failed, interrupted or killed run leaves no partial result; an existing\n"
    "regular file is replaced, never anything else):\n"
    "  .tsv    header 'query rank doc score', tab-separated, rank 1 = best\n"
    "  .jsonl  one {\"query\", \"rank\", \"doc\", \"score\"} object per line (score null for -inf/NaN)\n"
    "  .npy    the doc ids [Nq, min(K, Ndocs)], best first; with --full-matrix the float32\n"
    "          [Nq, Ndocs] score matrix instead (columns in corpus order)\n"
    "Ties go to the lower global position; NaN scores rank last, after -inf (empty docs).\n"
    "A progress bar with docs/s appears when stderr is a terminal; piped runs are quiet.\n"
    "Exit status: 0 ok; 2 bad input or environment (one line naming the file: missing, unreadable,\n"
    "corrupt, a full disk, ...); 1 internal error; 130 interrupted; 141 stdout closed (quietly).\n"
    "\n" + _MEMORY_HELP + "\n" + _SCORE_EXAMPLE + "\b\n"
    "  lik score --queries q.npy --docs d0.npy d1.npy --d-lengths l0.npy l1.npy \\\n"
    "            --top-k 10 --out results.jsonl --devices 0,1\n",
    context_settings=_CONTEXT,
)
@click.option("-q", "--queries", required=True, metavar="Q", help="Queries: padded .npy, flat .npy or shard directory.")
@click.option("-d", "--docs", required=True, multiple=True, metavar="D [D2 ...]", help="Shard directories and/or .npy files, in id order.")
@click.option("--q-lengths", metavar="QL", help="Lengths [Nq] (.npy or .json) for a .npy --queries.")
@click.option("--d-lengths", multiple=True, metavar="L [L2 ...]", help="One lengths/doclens file per .npy doc input.")
@click.option("-k", "--top-k", type=int, default=10, show_default=True, metavar="K", help="Results kept per query.")
@click.option("-o", "--out", required=True, metavar="FILE", help="results.tsv, results.jsonl or results.npy")
@click.option("--full-matrix", is_flag=True, help="Write the whole [Nq, Ndocs] float32 matrix (.npy only; no --top-k).")
@click.option("--check", is_flag=True, help="Read every embedding first and refuse NaN or inf values "
              "(the queries also after their cast to the corpus's dtype).")
@click.option("--cpu", is_flag=True, help="Score on the CPU even if a GPU is visible.")
@click.option("--device", type=int, default=None, metavar="N", help="GPU index to use (default: the current device).")
@click.option("--devices", metavar="0,1", help="Spread the shards over these GPUs of this machine (one Dask worker "
              "per GPU with the [distributed-gpu] extra, else threads).")
@click.option("--scheduler", metavar="ADDRESS", help="Score on the Dask cluster at ADDRESS (tcp://host:8786): shards "
              "resident on its workers (docs/distributed.md).")
@click.option("--bf16-bits", is_flag=True, help="Read uint16 .npy inputs as bfloat16 bit patterns.")
@click.option("--precision", type=click.Choice(["fp32", "tf32"]), default=None,
              help="float32 corpora on the GPU: fp32 (float32 accuracy, the default) or tf32 (faster, ~1e-3 "
              "relative error). Sets LIK_PRECISION for the run, which local Dask workers inherit (not with --scheduler).")
@click.option("--debug", is_flag=True, help="Show a traceback on errors.")
@_cli_errors
def _score_command(queries, docs, q_lengths, d_lengths, top_k, out, full_matrix, check, cpu, device, devices, scheduler,
                   bf16_bits, precision, debug):
    if full_matrix and click.get_current_context().get_parameter_source("top_k") != click.core.ParameterSource.DEFAULT:
        raise LikError("--top-k", "does not go with --full-matrix, which writes every score; drop one of them")
    if precision is not None and scheduler is not None:
        raise LikError("--precision", "does not reach the workers of a --scheduler, which are already running; "
                                      "start them with LIK_PRECISION set instead")
    _raise_open_files_limit()
    with _sigterm_as_interrupt(), _precision_for_the_run(precision):
        run_score(queries, docs, out, q_lengths=q_lengths, d_lengths=d_lengths, top_k=top_k, full_matrix=full_matrix,
                  check=check, cpu=cpu, device=device, devices=devices, bf16_bits=bf16_bits, scheduler=scheduler)


@contextlib.contextmanager
def _precision_for_the_run(precision: str | None):
    """LIK_PRECISION, the process default of lik_cupy.precision, set to ``precision`` for the run (local Dask
    workers started in it inherit it), then as it was: a caller of ``main`` in its own process keeps its own."""
    if precision is None:
        yield
        return
    before = os.environ.get("LIK_PRECISION")
    os.environ["LIK_PRECISION"] = precision
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LIK_PRECISION", None)
        else:
            os.environ["LIK_PRECISION"] = before


def _load_ids(path: str) -> np.ndarray:
    ids = _files.open_npy(path)
    if ids.dtype.kind not in "iuUS":
        raise LikError(path, f"ids must be int64 or fixed-width strings, got dtype {ids.dtype}")
    if ids.ndim != 1:
        raise LikError(path, f"ids must be a 1-D array, one per document; got shape {ids.shape}")
    return fmt.check_ids(ids, ids.shape[0], path)  # the file named in what is wrong


@contextlib.contextmanager
def _naming_ids(path: str | None):
    """What the shard writer finds wrong with the ids (their count) named by the --ids file they came from."""
    try:
        yield
    except shards.ShardError as e:
        if path and e.path == "ids":
            raise shards.ShardError(path, e.problem) from None
        raise


@main.command(
    "pack",
    help="Convert embeddings into a shard directory (see the format below): a padded [N, L, d] "
    ".npy (optionally with --lengths), flat [T, d] tokens with ColBERT-style doclens (--lengths), "
    "one .npy per document (--per-doc), or another shard (e.g. to change --dtype). --int8 quantizes "
    "each token to int8 with one float32 scale (scale = max|x| / 127), block by block; an INT8 shard "
    "packed with a float --dtype is dequantized. The manifest's 'normalized' is measured while "
    "copying. The shard is built in a temporary directory beside --out and renamed into place at "
    f"the end. Host memory is bounded by bytes: tokens go through in blocks that hold at most "
    f"{shards.CHUNK_BYTES >> 20} MiB at once (the tokens read, their float32 values, masks and the --int8 "
    "quantizer's temporaries; at least one token), plus the offsets and ids (about 8-16 bytes a "
    "document, and the ids' own size; string ids are checked 8 MiB at a time).\n\n"
    + _FORMAT_HELP
    + "\n\b\nExamples:\n"
    "  lik pack docs.npy --lengths lens.npy --out shard0 --model colbertv2.0\n"
    "  lik pack colbert/embs.npy --lengths colbert/doclens.0.json --out shard0\n"
    "  lik pack --per-doc page1.npy page2.npy --out pages    # ids: page1, page2\n"
    "  lik pack shard0 --dtype float16 --out shard0-fp16\n"
    "  lik pack shard0 --int8 --out shard0-int8               # quantize an existing shard\n",
    context_settings=_CONTEXT,
)
@click.argument("sources", nargs=-1, required=True, metavar="SOURCE [SOURCE ...]")
@click.option("-o", "--out", required=True, metavar="SHARD_DIR", help="The shard directory to create.")
@click.option("--lengths", metavar="L", help="Lengths [N] (padded) or doclens (flat), .npy or .json.")
@click.option("--per-doc", is_flag=True, help="Each SOURCE is one document [L, d]; ids default to the file names.")
@click.option("--ids", metavar="IDS.npy", help="Document ids [N]: int64 or fixed-width strings.")
@click.option("--model", metavar="NAME", help="Free-form name of the model that made the embeddings.")
@click.option("--dtype", type=click.Choice(fmt.DTYPES), help="Store as this float dtype (default: keep).")
@click.option("--int8", "int8", is_flag=True, help="Quantize to int8 with a float32 scale per token (NaN/inf refused).")
@click.option("--bf16-bits", is_flag=True, help="Read uint16 .npy inputs as bfloat16 bit patterns.")
@click.option("--check", is_flag=True, help="Refuse NaN or inf values, as stored (after the --dtype cast).")
@click.option("--force", is_flag=True, help="Replace --out if it is a lik shard holding only its own files.")
@click.option("--debug", is_flag=True, help="Show a traceback on errors.")
@_cli_errors
def _pack_command(sources, out, lengths, per_doc, ids, model, dtype, int8, bf16_bits, check, force, debug):
    if int8 and dtype:
        raise LikError("--int8", f"conflicts with --dtype {dtype}; give one of them")
    dtype = fmt.INT8 if int8 else dtype
    ids_file, ids = ids, _load_ids(ids) if ids else None
    with _sigterm_as_interrupt(), _naming_ids(ids_file):
        if per_doc:
            if lengths:
                raise LikError("--lengths", "does not go with --per-doc (each file is one whole document)")
            if ids is None:  # (a name's bytes that are not UTF-8 as \xNN escapes: ids are written as UTF-8)
                ids = np.array([os.fsencode(os.path.splitext(os.path.basename(s))[0]).decode("utf-8", "backslashreplace")
                                for s in sources])
            written = shards.pack_arrays(list(sources), out, ids=ids, model=model, dtype=dtype, overwrite=force,
                                         bf16_bits=bf16_bits, check_finite=check)
        else:
            if len(sources) != 1:
                raise LikError("SOURCE", f"got {len(sources)} inputs; give one (or pass --per-doc for one file per document)")
            source = shards.open_input(sources[0], lengths, bf16_bits=bf16_bits)
            written = shards.pack(source, out, ids=ids, model=model, dtype=dtype, overwrite=force, check_finite=check)
    m = written.manifest
    click.echo(f"wrote {out}: {m['num_docs']} docs, {m['num_tokens']} tokens, d={m['dim']}, {m['dtype']}, "
               f"{'normalized' if m['normalized'] else 'not normalized'}{', with ids' if written.ids is not None else ''}")


def _size(path: str) -> str:
    n = float(os.path.getsize(path))
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _printable(text: str) -> str:
    """A shard's own string (its model name, a file name) as it is if every character of it prints,
    else as its repr: a line break or a terminal escape in it must not forge or hide lines of the report."""
    return text if text.isprintable() else repr(text)


def _describe(s: shards.Shard) -> list[str]:
    lens = s.doc_lengths()
    if s.manifest is not None:
        m = s.manifest
        kind = f"shard directory ({m['format']} v{m['version']})"
        # Only the files the shard was opened from (checked to lie inside it), not whatever else
        # the manifest's "files" names: inspect reads nothing outside the shard.
        names = [fmt.MANIFEST, *(m["files"][k] for k in ("tokens", "offsets", "ids", "scales") if k in m["files"])]
        files = ", ".join(f"{_printable(name)} {_size(os.path.join(s.path, name))}" for name in names)
    else:
        kind = f"padded .npy {list(s.tokens.shape)}" if s.padded else f"flat .npy {list(s.tokens.shape)} with doclens"
        files = f"{os.path.basename(s.path)} {_size(s.path)}"
    rows = [("input", f"{s.path}: {kind}"), ("docs", str(s.num_docs))]
    if lens.size:
        rows.append(("tokens", f"{int(lens.sum())} ({int(lens.min())}..{int(lens.max())} per doc, mean {lens.mean():.1f}; "
                               f"{int((lens == 0).sum())} empty)"))
    int8 = s.scales is not None
    rows += [("dim", str(s.dim)), ("dtype", f"{s.dtype} (one float32 scale per token)" if int8 else s.dtype),
             ("token size", f"{s.bytes_per_token} bytes" + (f" ({s.dim} int8 values + a float32 scale)" if int8 else ""))]
    if s.manifest is not None:
        rows += [("normalized", "yes" if s.manifest["normalized"] else "no"),
                 ("model", _printable(str(s.manifest["model"])))]
    if s.ids is not None:
        ids = _readable_ids(s.ids[[0, -1]] if s.ids.size else s.ids)  # (decoding every id took 4x the file's bytes)
        kind = "int64" if ids.dtype.kind in "iu" else "str"
        rows.append(("ids", f"{kind}, {ids[0].item()!r} .. {ids[-1].item()!r}" if ids.size else kind))
    else:
        rows.append(("ids", "none (positions)"))
    if s.manifest is not None:
        checked = "manifest, shapes, dtypes, offsets monotone and ending at T, ids"
    else:
        checked = "header, shape, dtype" + (", lengths in [0, L]" if s.lengths is not None else "") \
            + ("" if s.padded else ", doclens summing to T") + (", ids" if s.ids is not None else "")
    rows += [("files", files), ("structure", f"ok ({checked}" + (", scales finite and >= 0)" if int8 else ")"))]
    return [f"{name:<11}{value}" for name, value in rows]


@main.command(
    name="inspect",
    help="Print what an input holds (a shard directory, or a .npy input with --lengths) and check "
    "it: manifest, shapes, dtypes, offsets, ids. With --check also read every embedding: "
    "NaN/inf values fail, and so does a manifest that says 'normalized' when a token's norm "
    f"is not 1, read in blocks that hold at most {shards.CHUNK_BYTES >> 20} MiB at once (the tokens, "
    "their float32 values and a mask). Exit status 2 when a check fails.\n\n" + _FORMAT_HELP + "\n\b\nExample:\n"
    "  lik inspect examples/shard0 --check\n",
    context_settings=_CONTEXT,
)
@click.argument("path", metavar="SHARD")
@click.option("--lengths", metavar="L", help="Lengths (padded) or doclens (flat) for a .npy input.")
@click.option("--check", is_flag=True, help="Also read every value: finite, and normalized as the manifest says.")
@click.option("--bf16-bits", is_flag=True, help="Read a uint16 .npy input as bfloat16 bit patterns.")
@click.option("--debug", is_flag=True, help="Show a traceback on errors.")
@_cli_errors
def _inspect_command(path, lengths, check, bf16_bits, debug):
    s = shards.open_input(path, lengths, bf16_bits=bf16_bits)
    for line in _describe(s):
        click.echo(line)
    if s.manifest is not None:
        click.echo("manifest.json:")
        click.echo(json.dumps(s.manifest, indent=2, sort_keys=True))
    if not check:
        click.echo(f"{'values':<11}not read (pass --check)")
        return
    scan = shards.scan_values(s)
    if scan.nonfinite is not None:
        doc, tok = scan.nonfinite
        raise LikError(s.tokens_file, f"document {doc}, token {tok} holds NaN or inf; embeddings must be finite")
    if s.manifest is not None and s.manifest["normalized"] and not scan.normalized:
        doc, tok, norm = scan.not_unit
        raise LikError(os.path.join(s.path, fmt.MANIFEST),
                       f"says normalized: true but document {doc}, token {tok} has L2 norm {norm:.4g}")
    click.echo(f"{'values':<11}all finite; {'every token has norm 1' if scan.normalized else 'not L2-normalised'}")


def _numba_line() -> str:
    """What ``lik info`` says of Numba: whether the CPU path folds its chunks, runs its GEMM of few query
    rows (on CPUs with AVX2 or AVX-512) and decompresses PLAID tokens compiled (``_cpu/fold.py``,
    ``_cpu/gemm_kernels.py``, ``_cpu/residual.py``). Read from the installed metadata and the switch:
    nothing is imported or compiled."""
    numba = _version("numba")
    if numba == "not installed":
        return ("not installed (the CPU path runs NumPy's passes; the [cpu] extra adds the compiled fold, GEMM "
                "and PLAID decompression)")
    from lik_cupy._base import env

    if env.numba_disabled():
        return f"{numba} (not used: LIK_DISABLE_NUMBA is set)"
    return f"{numba} (the CPU path's compiled fold, GEMM and PLAID decompression)"


def _version(dist: str, module: str | None = None) -> str:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        pass
    if module:
        try:
            mod = __import__(module)
            return str(getattr(mod, "__version__", "unknown version"))
        except Exception:
            pass
    return "not installed"


_CUDA_ERROR_INSUFFICIENT_DRIVER, _CUDA_ERROR_NO_DEVICE = 35, 100  # cudaError_t values


def _driver_loadable() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _gpu_lines() -> list[str]:
    try:
        import cupy
    except Exception as e:
        return [f"none usable (cupy not importable: {type(e).__name__})"]
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        status = getattr(e, "status", None)
        # The CUDA runtime reports a missing driver library as an insufficient driver version.
        if status == _CUDA_ERROR_INSUFFICIENT_DRIVER and not _driver_loadable():
            return ["none: no NVIDIA driver on this machine (libcuda.so.1 cannot be loaded)"]
        if status == _CUDA_ERROR_NO_DEVICE:
            return ["none: the NVIDIA driver sees no GPU"]
        return [f"none visible ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"]
    if count == 0:
        return ["none visible"]
    lines = []
    for i in range(count):
        try:
            p = cupy.cuda.runtime.getDeviceProperties(i)
            name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
            mem = p.get("totalGlobalMem", 0) / 2**30
            lines.append(f"{i}: {name}, compute capability {p['major']}.{p['minor']} (sm_{p['major']}{p['minor']}), {mem:.0f} GiB")
        except Exception as e:
            lines.append(f"{i}: properties unavailable ({type(e).__name__}: {e})")
    return lines


@main.command(
    "info",
    help="Show versions, visible GPUs with their compute capability, the kernel cache location "
    "and the shard format version. Works without a GPU or CuPy.\n\n" + _FORMAT_HELP + "\n\b\nExample:\n  lik info\n",
    context_settings=_CONTEXT,
)
@click.option("--debug", is_flag=True, help="Show a traceback on errors.")
@_cli_errors
def _info_command(debug):
    echo = click.echo
    echo(f"python        {platform.python_version()} ({sys.executable})")
    echo(f"lik-cupy      {lik_cupy.__version__} ({os.path.dirname(lik_cupy.__file__)})")
    echo(f"shard format  {fmt.FORMAT} v{shards.VERSION} (reads v1..v{shards.VERSION}; dtypes "
         f"{', '.join(fmt.SHARD_DTYPES)})")
    echo(f"numpy         {np.__version__}")
    echo(f"click         {_version('click')}")
    echo(f"ml_dtypes     {_version('ml_dtypes', 'ml_dtypes')}")
    echo(f"numba         {_numba_line()}")
    try:
        import cupy

        echo(f"cupy          {cupy.__version__}")
    except Exception as e:
        echo(f"cupy          not importable ({type(e).__name__}); the CPU path still works")
    echo(f"cuda-python   {_version('cuda-python')}")
    gpus = _gpu_lines()
    echo(f"GPU           {gpus[0]}")
    for line in gpus[1:]:
        echo(f"              {line}")
    echo(f"GPU backend   {'available' if _gpu_available() else 'not available (CPU fallback)'}")
    from lik_cupy._runtime import nvrtc

    cache = nvrtc.cache_dir()
    problem = _unwritable(cache)
    echo(f"kernel cache  {cache}" + ("" if problem is None else f" (cannot be written: {problem}; each process "
                                                                 "compiles its kernels into a directory of its own, "
                                                                 "removed at exit)"))


def _unwritable(d) -> str | None:
    """Why the kernel cache at ``d`` cannot be written (None: it can, as far as can be told without
    writing): it, or the nearest of its parents that exists where it does not yet, must be a
    directory this process may write in."""
    at = os.path.abspath(d)
    while not os.path.lexists(at) and os.path.dirname(at) != at:
        at = os.path.dirname(at)
    if not os.path.isdir(at):
        return f"{at} is not a directory"
    if not os.access(at, os.W_OK | os.X_OK):
        return f"{at} is not writable"
    return None


def _serve_devices(text: str) -> list:
    """--devices of ``lik serve``: GPU indices and 'cpu' entries, in order."""
    devices = []
    for x in text.split(","):
        index = "cpu" if x.strip() == "cpu" else _gpu_index(x)
        if index is None:
            raise LikError("--devices", f"expected GPU indices (0 or more) and/or cpu, comma-separated (0,1 or cpu); "
                           f"got {text!r}")
        devices.append(index)
    return devices


def _seconds(ctx, param, value: float) -> float:
    """A --...-timeout of ``lik serve``: a positive, finite number of seconds (click's range lets nan and inf by)."""
    if not 0 < value < math.inf:
        raise click.BadParameter(f"expected a positive number of seconds, got {value}")
    return value


def _cluster_seconds(ctx, param, value: float | None) -> float | None:
    """--cluster-timeout: None (not given), or :func:`_seconds`, at most what a thread's join takes
    (how lik_cupy.distributed bounds its waits)."""
    if value is not None and not 0 < value <= threading.TIMEOUT_MAX:
        raise click.BadParameter(f"expected a positive number of seconds (at most {threading.TIMEOUT_MAX:.3g}), "
                                 f"got {value}")
    return value


@main.command(
    "serve",
    help="Serve MaxSim with the Open Inference Protocol (KServe v2) over HTTP, and over gRPC with "
    "--grpc-port (tritonclient works as a client): models search (Q, K -> SCORES, IDS), rerank (Q, IDS -> SCORES) "
    "and score (Q -> SCORES) over the documents of SHARD..., kept resident (a replica per device, "
    "requests routed to the least loaded; or split over the GPUs, --partition; or on a Dask cluster's workers, "
    "--scheduler). Concurrent requests are batched into multi-query calls; "
    "each caller gets its own rows. /v2/health/ready turns 200 once the corpus is resident "
    "and warm; /metrics is Prometheus. A full queue answers 503 with Retry-After; a request sent too slowly "
    "(--header-timeout, --body-timeout, --body-min-rate), 408; SIGTERM or Ctrl-C "
    "answers every accepted request, then stops. Needs the [serve] extra; see docs/serving.md.\n\n\b\nExample:\n"
    "  lik serve examples/shard0 examples/shard1 --port 8000 --max-delay-us 200\n",
    context_settings=_CONTEXT,
)
@click.argument("paths", nargs=-1, required=True, metavar="SHARD...")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="Port to listen on (0: any free one; the line 'listening on' names it).")
@click.option("--grpc-port", type=click.IntRange(0, 65535), default=None,
              help="Also serve the protocol over gRPC on this port (0: any free one; Triton's is 8001). "
              "Needs the [serve-grpc] extra.")
@click.option("--grpc-max-streams", type=click.IntRange(1, 2**31 - 1), default=100, show_default=True, metavar="N",
              help="gRPC calls one connection may have at once (HTTP/2's max concurrent streams): a client keeps "
              "those over it waiting, and a call opened over it anyway is refused. (An HTTP connection has one "
              "request at a time.)")
@click.option("--grpc-max-calls", type=click.IntRange(1, 2**31 - 2), default=None, metavar="N",
              help="gRPC calls the server (each process) serves at once, over all connections; one over it is "
              "refused RESOURCE_EXHAUSTED. Default: 8192, or --max-queue times the --devices entries (eight where "
              "none are given) where that is more, so that a full queue is never refused.")
@click.option("--max-connections", type=click.IntRange(1, 2**31 - 2), default=None, metavar="N",
              help="HTTP connections the server (each process) serves at once; a request that comes while more are "
              "open is answered 503 and its connection closed. Default: that of --grpc-max-calls.")
@click.option("--devices", metavar="LIST", help="Comma-separated GPU indices and/or 'cpu', one worker each; "
              "entries naming one device share its corpus (0,0: two workers on GPU 0). Default: every GPU, else cpu.")
@click.option("--partition/--replicate", default=None, help="Split the shards over the --devices, a part each "
              "(consecutive shards, even documents), or keep a replica on each. Default: partition over two or more "
              "GPUs when a replica would not fit each of them. One worker runs every call on all the parts; search "
              "merges their top k exactly.")
@click.option("--max-batch", type=click.IntRange(1), default=64, show_default=True, help="Queries per call.")
@click.option("--max-tokens", type=click.IntRange(1), default=65536, show_default=True,
              help="Padded query tokens per call (queries x the longest).")
@click.option("--max-delay-us", type=click.IntRange(0), default=0, show_default=True,
              help="How long a free device waits for more requests before it scores what it has.")
@click.option("--max-queue", type=click.IntRange(1), default=1024, show_default=True,
              help="Requests waiting per device; beyond, 503.")
@click.option("--processes", type=click.IntRange(1), default=1, show_default=True,
              help="Server processes on the one port, each with replicas of its own on the --devices (one "
              "process's Python answers about 2,000 requests a second).")
@click.option("--header-timeout", type=float, default=10.0, show_default=True, callback=_seconds, metavar="SECONDS",
              help="A request's headers must all arrive within this long of the connection opening or of the "
              "previous answer, else the connection closes (with a 408 where part of a request had arrived); and "
              "take at most 64 KiB (431). A gRPC connection must begin HTTP/2 within it, and closes after it "
              "without a call.")
@click.option("--body-timeout", type=float, default=30.0, show_default=True, callback=_seconds, metavar="SECONDS",
              help="The longest wait for more of a request's body (408 past it, the connection closed, what it held "
              "of the server's budget given back), or for a client to take more of a large answer (the connection "
              "dropped). A gRPC message, whose progress grpc core does not show, must arrive within the time the "
              "largest takes at --body-min-rate, this long at least (DEADLINE_EXCEEDED).")
@click.option("--body-min-rate", type=click.IntRange(0), default=1 << 20, show_default=True, metavar="BYTES",
              help="Bytes a second a request's body, or a large answer, must average once it has taken --body-timeout "
              "(0: any rate).")
@click.option("--scheduler", metavar="ADDRESS", help="Keep the shards resident on the workers of the Dask cluster at "
              "ADDRESS (tcp://host:8786), which read them under the same paths; each batch is one round trip to the "
              "cluster (lik_cupy.distributed). Not with --devices, --partition/--replicate or --processes. Needs the "
              "[distributed] extra.")
@click.option("--cluster-timeout", type=float, default=None, callback=_cluster_seconds, metavar="SECONDS",
              help="With --scheduler: the longest any one wait on the cluster may take (a scheduler call, loading "
              "the shards, a batch's tasks). A batch past it is answered 504, each of its requests at once. "
              "Default: 300.")
@click.option("--debug", is_flag=True, help="Show a traceback on errors.")
@_cli_errors
def _serve_command(paths, host, port, grpc_port, grpc_max_streams, grpc_max_calls, max_connections, devices, partition,
                   max_batch, max_tokens, max_delay_us, max_queue, processes, header_timeout, body_timeout,
                   body_min_rate, scheduler, cluster_timeout, debug):
    devices = None if devices is None else _serve_devices(devices)  # a usage error, before the extras are looked for
    if cluster_timeout is not None and scheduler is None:
        raise LikError("--cluster-timeout", "bounds each wait on the Dask cluster of --scheduler; give --scheduler too")
    if scheduler is not None:
        placed = [name for name, given in (("--devices", devices is not None), ("--processes", processes != 1),
                                           ("--partition" if partition else "--replicate", partition is not None))
                  if given]
        if placed:
            raise LikError("--scheduler", f"serves the corpus from the cluster's workers, which hold the shards; "
                                          f"drop {', '.join(placed)}")
    try:
        from lik_cupy.serving.http import serve
    except ImportError as e:
        raise LikError("lik serve", f"needs the [serve] extra (pip install 'lik-cupy[serve]'): {e}") from None
    if grpc_port is not None:
        try:
            importlib.import_module("lik_cupy.serving.grpc")  # fail before loading the corpus
        except ImportError as e:
            raise LikError("lik serve --grpc-port",
                           f"needs the [serve-grpc] extra (pip install 'lik-cupy[serve-grpc]'): {e}") from None
    with contextlib.ExitStack() as stack:
        client = None
        if scheduler is not None:
            try:
                importlib.import_module("lik_cupy.distributed")  # (its ImportError names the extra)
            except ImportError as e:
                raise LikError("lik serve --scheduler", str(e)) from None
            client = stack.enter_context(_connect(scheduler))  # before listening: an unreachable one stops here
        serve(list(paths), host=host, port=port, grpc_port=grpc_port,
              devices=devices, partition=partition, max_batch=max_batch, max_tokens=max_tokens,
              max_delay_us=max_delay_us, max_queue=max_queue, processes=processes, header_timeout=header_timeout,
              body_timeout=body_timeout, body_min_rate=body_min_rate, grpc_max_streams=grpc_max_streams,
              max_connections=max_connections, grpc_max_calls=grpc_max_calls, client=client,
              cluster_timeout=cluster_timeout)


if __name__ == "__main__":
    main(prog_name="lik")
