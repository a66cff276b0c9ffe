"""The lik shard format, and reading every corpus layout as one kind of ``Shard``.

A shard is a directory of plain ``.npy`` files plus a manifest::

    shard0/
      manifest.json   {"format": "lik-shard", "version": 1, "dim": 128, "dtype": "float16",
                       "num_docs": N, "num_tokens": T, "normalized": true, "model": "...",
                       "files": {"tokens": "tokens.npy", "offsets": "offsets.npy", "ids": "ids.npy"}}
      tokens.npy      [T, d]  float16 | float32 | bfloat16 stored as its uint16 bit patterns | int8
      scales.npy      [T]     float32, INT8 shards only: token t is tokens[t] * scales[t]
      offsets.npy     [N+1] int64: document j is tokens[offsets[j]:offsets[j+1]]
      ids.npy         [N]     int64 or fixed-width strings (optional; without it a
                              document's id is its position in the corpus)

An INT8 shard (``"dtype": "int8"``) stores each token as d int8 values and one symmetric
float32 scale (``lik_cupy.quantize``: scale = max|x| / 127, values in
[-127, 127]; an all-zero token has scale 0), named in the manifest as
``"files": {..., "scales": "scales.npy"}``: d + 4 bytes per token against 2 d for
float16. Its manifest says ``"version": 2`` so that readers older than INT8 refuse it
as too new; float shards are still written as version 1. Scales must be finite and
>= 0; a reader checks them on opening, like the offsets.

The rules a reader holds a shard to:

- offsets start at 0, never decrease and end at ``T``; equal neighbours are an empty
  document, which scores -inf;
- ``"normalized": true`` promises every token has unit L2 norm (within ``NORM_TOLERANCE``;
  ``lik inspect --check`` verifies it); ``"model"`` names the encoder, for people: neither
  changes how a shard is scored;
- the files named under ``"files"`` lie inside the shard directory (absolute paths, ``..``
  and symbolic links leading out are refused); unknown manifest keys are ignored, and a
  ``"version"`` newer than ``VERSION`` is refused;
- ids are integers or strings; across the shards of one corpus all have ids of one kind or
  none do, and a string id holds no tab, line break (any that ``str.splitlines`` splits at)
  or NUL, since results are written one per line.

A corpus is one or more shards. :func:`open_input` also reads the layouts people
already have as the same :class:`Shard`: a padded ``[N, L, d]`` array with optional
per-document lengths, and ColBERT-style flat ``[T, d]`` tokens with a doclens array
(lengths and doclens as an integer ``.npy`` or a JSON list, as ColBERT writes them).

Every array is opened memory-mapped with ``allow_pickle=False``: a corpus is never loaded whole and
no file can run code. Whatever reads every token (:func:`pack`, :func:`scan_values`,
:func:`check_finite`) goes block by block, and its ``max_bytes`` (``CHUNK_BYTES``, 256 MiB, unless
told otherwise) bounds all a block holds at once: the tokens read and every array made of them
(float32 values, masks, the INT8 quantiser's temporaries), plus 64 bytes a token; the offsets and
ids (a few bytes a document) come on top. Inputs must be regular files (``lik_cupy._files``: a FIFO
or a device is refused, never waited on). Paths in a manifest must name files inside the shard
directory. A shard that ``lik pack --force`` replaces while it is being opened is read whole, the
old one or the new one, never a mix of their files. Problems raise :class:`ShardError` naming the
file and what was expected.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from . import _atomic, _files
from . import _shard_format as fmt
from .errors import ShardError

__all__ = ["Shard", "open_shard", "open_input", "write_shard", "pack", "pack_arrays", "scan_values", "ValueScan",
           "check_finite", "VERSION", "NORM_TOLERANCE", "CHUNK_BYTES", "ShardError"]

VERSION = 2  # the newest version this reader reads
# The version a shard is written with: the oldest that can read it. Float shards stay at 1,
# so readers older than INT8 still read them; int8 shards need 2.
_WRITE_VERSION = {"float16": 1, "float32": 1, "bfloat16": 1, "int8": 2}
# How tokens.npy stores each dtype. bfloat16 is kept as raw uint16 bits: NumPy has no
# bfloat16, and np.load cannot read ml_dtypes' type back from a .npy header.
_STORED = {"float16": np.dtype("<f2"), "float32": np.dtype("<f4"), "bfloat16": np.dtype("<u2"), fmt.INT8: np.dtype("i1")}
_SCALES_STORED = np.dtype("<f4")
# A token counts as L2-normalised when its norm is within this of 1 (bfloat16 keeps ~3 digits).
NORM_TOLERANCE = 2e-2
# The default bound, in bytes, on what reading or writing a shard piece by piece holds at once:
# chunk_ranges' token embeddings; for pack, scan_values and check_finite (their max_bytes) a block's
# tokens and everything made of them while it is processed (see _rows).
CHUNK_BYTES = 256 << 20
# What a block holds per token beyond its d elements, whatever the path: its scale, norm and
# masks of rows, an int8 token's sum of squares, a padded block's row indices (measured at most
# about 50 bytes).
_TOKEN_WORK_BYTES = 64
_MAX_MANIFEST_BYTES = 1 << 20
# How many times a shard replaced while it is being opened is opened again before giving up.
_OPEN_TRIES = 3


def _embedding_dtype(arr: np.ndarray, name: str, bf16_bits: bool = False) -> str:
    """The dtype name (one of ``fmt.DTYPES``) of token embeddings read from a file.

    float16 and float32 are taken as they are; uint16 holds bfloat16 bit patterns only
    when ``bf16_bits`` says so. Big-endian data and any other dtype raise ShardError.
    """
    dt = arr.dtype
    if dt.str.startswith(">"):
        raise ShardError(name, f"dtype {dt.str} is big-endian; expected little-endian (convert with a.astype(a.dtype.newbyteorder('<')))")
    if dt.kind == "f" and dt.itemsize in (2, 4):
        return "float16" if dt.itemsize == 2 else "float32"
    if dt.kind == "u" and dt.itemsize == 2:
        if bf16_bits:
            return "bfloat16"
        raise ShardError(name, "dtype uint16 is not an embedding dtype; if it holds bfloat16 bits, say so (lik --bf16-bits, bf16_bits=True)")
    if dt.kind == "V" and dt.itemsize == 2:
        raise ShardError(name, "dtype |V2 (bfloat16 saved through ml_dtypes?) cannot be read back; save a.view(numpy.uint16) and read it with --bf16-bits")
    if dt.kind == "i" and dt.itemsize == 1:
        raise ShardError(name, "dtype int8 needs its per-token scales, which only a shard directory holds; "
                               "pack the float embeddings with `lik pack --int8` (shards.pack(..., dtype='int8'))")
    raise ShardError(name, f"unsupported dtype {dt}; expected float16, float32, or bfloat16 bits stored as uint16")


def _as_numpy_dtype(arr: np.ndarray, name: str) -> np.ndarray:
    return arr.view(fmt.numpy_dtype(name)) if name == "bfloat16" else arr


# --------------------------------------------------------------------------- the Shard


@dataclass(frozen=True)
class Shard:
    """Documents opened for reading: a packed or a padded layout, memory-mapped.

    Attributes:
        path: what was opened (a shard directory or a ``.npy`` file); names the input in messages.
        tokens: packed ``[T, d]`` (with ``offsets``) or padded ``[N, L, d]`` (with optional
            ``lengths``), float16, float32 or ``ml_dtypes.bfloat16``; or int8 ``[T, d]``
            (packed, with ``scales``); usually a read-only memmap.
        offsets: int64 ``[N+1]`` for the packed layout, else None.
        lengths: int64 ``[N]`` valid leading rows per document of the padded layout;
            None means every row counts (and for the packed layout).
        ids: ``[N]`` int64 or fixed-width string ids, or None (ids are then positions).
        manifest: the shard's manifest.json as a dict; None for a ``.npy`` input.
        tokens_file: the file ``tokens`` comes from, named in value errors.
        scales: float32 ``[T]`` per-token scales of an int8 shard (token t is
            ``tokens[t] * scales[t]``), else None.
    """

    path: str
    tokens: np.ndarray
    offsets: np.ndarray | None = None
    lengths: np.ndarray | None = None
    ids: np.ndarray | None = None
    manifest: dict | None = None
    tokens_file: str = ""
    scales: np.ndarray | None = None

    @property
    def padded(self) -> bool:
        return self.offsets is None

    @property
    def num_docs(self) -> int:
        return int(self.tokens.shape[0]) if self.padded else int(self.offsets.shape[0]) - 1

    @property
    def dim(self) -> int:
        return int(self.tokens.shape[-1])

    @property
    def dtype(self) -> str:
        """One of ``SHARD_DTYPES``."""
        return self.tokens.dtype.name

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes: d * the element size, plus 4 for an int8 token's scale."""
        return self.dim * self.tokens.dtype.itemsize + (4 if self.scales is not None else 0)

    def doc_lengths(self) -> np.ndarray:
        """int64 ``[N]``: valid tokens per document."""
        if not self.padded:
            return np.diff(self.offsets)
        if self.lengths is not None:
            return self.lengths
        return np.full(self.num_docs, self.tokens.shape[1], np.int64)

    def chunk_ranges(self, max_bytes: int = CHUNK_BYTES, max_docs: int = 0) -> list[tuple[int, int]]:
        """Document ranges ``[(start, stop), ...]`` covering the shard in order.

        Each range holds about ``max_bytes`` of token embeddings (at least one document)
        and at most ``max_docs`` documents (0: no limit). Reads only offsets.
        """
        n = self.num_docs
        row = self.bytes_per_token
        if self.padded:
            step = max(1, max_bytes // max(1, row * self.tokens.shape[1]))
            if max_docs:
                step = min(step, max_docs)
            return [(s, min(n, s + step)) for s in range(0, n, step)]
        budget = max(1, max_bytes // row)
        ranges, s = [], 0
        while s < n:
            e = int(np.searchsorted(self.offsets, self.offsets[s] + budget, side="right")) - 1
            e = min(n, max(e, s + 1))
            if max_docs:
                e = min(e, s + max_docs)
            ranges.append((s, e))
            s = e
        return ranges

    def read_chunk(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Documents ``start..stop-1`` as packed ``(tokens [t, d], offsets int64 [n+1])``, offsets from 0.

        Packed shards and padded arrays without lengths give memory-mapped views (read
        when used); a padded array with lengths is copied, keeping only valid rows. ValueError
        unless ``0 <= start <= stop <= num_docs``.
        """
        self._check_range(start, stop)
        if not self.padded:
            lo, hi = int(self.offsets[start]), int(self.offsets[stop])
            return self.tokens[lo:hi], np.asarray(self.offsets[start : stop + 1], np.int64) - lo
        block = self.tokens[start:stop]
        n, length = block.shape[0], block.shape[1]
        if self.lengths is None:
            return block.reshape(n * length, self.dim), np.arange(n + 1, dtype=np.int64) * length
        lens = self.lengths[start:stop]
        valid = np.arange(length)[None, :] < lens[:, None]
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        return block[valid], offsets

    def read_scales(self, start: int, stop: int) -> np.ndarray:
        """float32 ``[t]``: the scales of the tokens :meth:`read_chunk` gives for documents
        ``start..stop-1`` of an int8 shard (a memory-mapped view)."""
        if self.scales is None:
            raise ValueError(f"{self.path} holds {self.dtype} tokens, which have no scales")
        self._check_range(start, stop)
        return self.scales[int(self.offsets[start]) : int(self.offsets[stop])]

    def _check_range(self, start: int, stop: int) -> None:
        """ValueError unless documents ``start..stop-1`` lie in the shard (not Python's slicing:
        a range past the end or a negative position would read other documents, or none)."""
        if not 0 <= start <= stop <= self.num_docs:
            raise ValueError(f"documents {start}..{stop - 1} are not among the {self.num_docs} of {self.path}; "
                             f"expected 0 <= start <= stop <= {self.num_docs}")

    def read_values(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Like :meth:`read_chunk`, with the tokens as float32 values (int8 tokens dequantized)."""
        tokens, offsets = self.read_chunk(start, stop)
        return _values(tokens, None if self.scales is None else self.read_scales(start, stop)), offsets

    def _row_offsets(self) -> np.ndarray:
        """int64 ``[N+1]``: where each document's valid tokens start among all valid token rows."""
        if not self.padded:
            return self.offsets
        offsets = np.zeros(self.num_docs + 1, np.int64)
        np.cumsum(self.doc_lengths(), out=offsets[1:])
        return offsets

    def _row_blocks(self, rows: int):
        """Every valid token row in order, as ``(first row, tokens [t, d], scales [t] or None)``.

        Rows are numbered as in :meth:`_row_offsets` (a padded layout's padding is skipped).
        A block holds at most ``rows`` tokens (and a padded one at most ``rows`` rows with its
        padding), so a document longer than that comes in pieces: what reading any shard holds
        is set by ``rows``, whatever the length of its longest document or its dim (the callers
        size ``rows`` with :func:`_rows`). Packed blocks are memory-mapped views; several
        documents of a padded layout with lengths are a copy of their valid rows.
        """
        rows = max(1, int(rows))
        if not self.padded:
            total = int(self.offsets[-1])
            for a in range(0, total, rows):
                b = min(total, a + rows)
                yield a, self.tokens[a:b], None if self.scales is None else self.scales[a:b]
            return
        lens, first = self.doc_lengths(), 0
        for start, stop in self.chunk_ranges(rows * self.bytes_per_token):
            if stop - start > 1:  # several documents fit: their valid rows, copied together
                tokens, _ = self.read_chunk(start, stop)
                yield first, tokens, None
                first += tokens.shape[0]
                continue
            n = int(lens[start])
            for a in range(0, n, rows):
                yield first + a, self.tokens[start, a : min(n, a + rows)], None
            first += n


def _packed(path, tokens, offsets, ids, manifest, tokens_file, offsets_file, ids_file, scales=None,
            scales_file="", max_bytes: int = CHUNK_BYTES) -> Shard:
    """Check a packed layout and build its Shard (``tokens`` already in its library dtype;
    int8 tokens come with their ``scales``, checked ``max_bytes`` at a time)."""
    if tokens.ndim != 2:
        raise ShardError(tokens_file, f"expected packed token embeddings [T, d], got shape {tokens.shape}")
    if tokens.shape[1] == 0:
        raise ShardError(tokens_file, f"embedding dim is 0 (shape {tokens.shape}); expected d >= 1")
    offsets = _check_offsets(offsets, tokens.shape[0], offsets_file)
    ids = fmt.check_ids(ids, offsets.shape[0] - 1, ids_file) if ids is not None else None
    if (tokens.dtype == np.int8) != (scales is not None):
        raise ShardError(scales_file or tokens_file, "int8 tokens need per-token scales, and only int8 tokens have them")
    if scales is not None:
        _check_scales(scales, offsets, scales_file, max_bytes)
    return Shard(path, tokens, offsets=offsets, ids=ids, manifest=manifest, tokens_file=tokens_file, scales=scales)


def _check_scales(scales: np.ndarray, offsets: np.ndarray, name: str, max_bytes: int = CHUNK_BYTES) -> None:
    """Check an int8 shard's scales: float32 ``[T]`` (T = offsets[-1]), every value finite and >= 0.

    Read block by block (a memmap is never loaded whole); ShardError names the first bad
    token and its document.
    """
    if scales.dtype != _SCALES_STORED:
        raise ShardError(name, f"dtype {scales.dtype.str}; expected float32 (<f4), one scale per token")
    num_tokens = int(offsets[-1])
    if scales.shape != (num_tokens,):
        raise ShardError(name, f"shape {scales.shape} does not match the {num_tokens} token rows; expected [{num_tokens}] (one scale per token)")
    step = max(1, max_bytes // (4 + 2))  # each scale, and two masks of it
    for a in range(0, num_tokens, step):
        block = np.asarray(scales[a : a + step])
        bad = block >= 0
        np.logical_not(bad, out=bad)  # NaN fails the comparison
        bad |= np.isinf(block)
        if bad.any():
            t = a + int(np.argmax(bad))
            doc, tok = _position(t, offsets)
            raise ShardError(name, f"scale of token {t} (document {doc}, token {tok}) is {float(scales[t])!r}; "
                                   "expected a finite value >= 0 (token = int8 values * scale)")


def _check_offsets(offsets: np.ndarray, num_tokens: int, name: str) -> np.ndarray:
    """Check document offsets ``[N+1]`` into ``num_tokens`` token rows; returns them as int64.

    offsets[0] must be 0, each offset at least the one before it, and offsets[-1] == T.
    """
    if offsets.ndim != 1 or offsets.shape[0] < 1:
        raise ShardError(name, f"expected 1-D offsets [N+1] (at least [0]), got shape {offsets.shape}")
    if offsets.dtype.kind not in "iu":
        raise ShardError(name, f"offsets must be integers (int64), got dtype {offsets.dtype}")
    if offsets.dtype.kind == "u" and int(offsets.max()) >= 2**63:  # named as given, not as it wraps in int64
        i = int(np.argmax(offsets >= 2**63))
        raise ShardError(name, f"offsets[{i}] = {int(offsets[i])} does not fit int64; expected token rows 0..T")
    offsets = np.asarray(offsets, dtype=np.int64)
    if offsets[0] != 0:
        raise ShardError(name, f"offsets[0] is {int(offsets[0])}; expected 0")
    drops = np.flatnonzero(offsets[1:] < offsets[:-1])
    if drops.size:
        i = int(drops[0])
        raise ShardError(name, f"offsets are not monotone: offsets[{i}] = {int(offsets[i])} > offsets[{i + 1}] = {int(offsets[i + 1])}; expected non-decreasing")
    if offsets[-1] != num_tokens:
        raise ShardError(name, f"offsets end at {int(offsets[-1])} but there are {num_tokens} token rows; expected offsets[-1] == T")
    return offsets


def _padded(path, tokens, lengths, lengths_file, tokens_file) -> Shard:
    if tokens.shape[2] == 0:
        raise ShardError(tokens_file, f"embedding dim is 0 (shape {tokens.shape}); expected d >= 1")
    if tokens.shape[1] == 0 and tokens.shape[0] > 0:  # (rows the file holds no byte of: any number of them)
        raise ShardError(tokens_file, f"padded length is 0 (shape {tokens.shape}): no row can hold a token; "
                                      f"expected L >= 1")
    if lengths is not None:
        n, limit = tokens.shape[0], tokens.shape[1]
        if lengths.shape != (n,):
            raise ShardError(lengths_file, f"expected {n} lengths (one per row of {tokens_file}), got shape {lengths.shape}")
        over = np.flatnonzero(lengths > limit)
        if over.size:
            i = int(over[0])
            raise ShardError(lengths_file, f"length {int(lengths[i])} at index {i} is out of range 0..{limit} (padded length of {tokens_file})")
    return Shard(path, tokens, lengths=lengths, tokens_file=tokens_file)


# --------------------------------------------------------------------------- opening


def _read_manifest(path: str | os.PathLike) -> dict:
    """Read and check a shard's manifest.json; returns it as a dict.

    Required keys: format (``"lik-shard"``), version (int, at most ``VERSION``), dim
    (int >= 1), dtype (one of ``SHARD_DTYPES``), num_docs and num_tokens (int >= 0),
    normalized (bool), model (str or null), files (``{"tokens": ..., "offsets": ...}``,
    ``"scales"`` exactly when dtype is int8, and optionally ``"ids"``: names of files
    inside the shard directory). Other keys are kept and ignored.
    """
    path = os.fspath(path)
    try:
        os.lstat(path)
    except FileNotFoundError:
        raise ShardError(path, "no such file; a shard directory holds manifest.json, tokens.npy and offsets.npy (make one with `lik pack`)") from None
    except OSError:
        pass  # reported below as what it is (permission denied, ...)
    m = _files.read_json(path, "not valid JSON", "a manifest (a small JSON object)", _MAX_MANIFEST_BYTES)
    if not isinstance(m, dict):
        raise ShardError(path, f"expected a JSON object, got {type(m).__name__}")
    if m.get("format") != fmt.FORMAT:
        raise ShardError(path, f"format is {m.get('format')!r}; expected {fmt.FORMAT!r}")
    version = m.get("version")
    if type(version) is not int or version < 1:
        raise ShardError(path, f"version is {version!r}; expected a positive integer")
    if version > VERSION:
        raise ShardError(path, f"format version {version} is newer than this lik-cupy reads ({VERSION}); upgrade lik-cupy")
    for key, least in (("dim", 1), ("num_docs", 0), ("num_tokens", 0)):
        if type(m.get(key)) is not int or m[key] < least:
            raise ShardError(path, f"{key} is {m.get(key)!r}; expected an integer >= {least}")
    if m.get("dtype") not in fmt.SHARD_DTYPES:
        raise ShardError(path, f"dtype is {m.get('dtype')!r}; expected one of {', '.join(fmt.SHARD_DTYPES)}")
    if type(m.get("normalized")) is not bool:
        raise ShardError(path, f"normalized is {m.get('normalized')!r}; expected true or false")
    if m.get("model") is not None and not isinstance(m.get("model"), str):
        raise ShardError(path, f"model is {m.get('model')!r}; expected a string or null")
    files = m.get("files")
    if not isinstance(files, dict) or not isinstance(files.get("tokens"), str) or not isinstance(files.get("offsets"), str):
        raise ShardError(path, 'files must be an object naming at least "tokens" and "offsets" (e.g. {"tokens": "tokens.npy", "offsets": "offsets.npy"})')
    for key in ("ids", "scales"):
        if key in files and not isinstance(files[key], str):
            raise ShardError(path, f"files.{key} is {files[key]!r}; expected a file name")
    if m["dtype"] == fmt.INT8 and "scales" not in files:
        raise ShardError(path, 'dtype is int8 but files names no "scales"; expected e.g. "scales": "scales.npy" (one float32 scale per token)')
    if m["dtype"] != fmt.INT8 and "scales" in files:
        raise ShardError(path, f"files names scales but dtype is {m['dtype']}; only int8 shards have scales")
    return m


def _member_path(shard_dir: str, name: str, manifest_path: str) -> str:
    """The path of file ``name`` of a shard; ShardError unless it lies inside ``shard_dir``.

    Absolute names, ``..`` and symbolic links that lead out of the directory are refused,
    so a manifest cannot point the reader at other files.
    """
    try:
        encodable = "\0" not in name and os.fsencode(name) is not None
    except UnicodeEncodeError:
        encodable = False
    if not encodable:
        raise ShardError(manifest_path, f"file name {name!r} cannot be a path (a NUL or an unencodable character); "
                         "expected a relative name such as 'tokens.npy'")
    parts = name.replace("\\", "/").split("/")
    if not name or os.path.isabs(name) or os.path.splitdrive(name)[0] or ".." in parts:
        raise ShardError(manifest_path, f"file {name!r} is not inside the shard directory; expected a relative name such as 'tokens.npy'")
    full = os.path.join(shard_dir, name)
    root = os.path.realpath(shard_dir)
    if os.path.commonpath([root, os.path.realpath(full)]) != root:
        raise ShardError(manifest_path, f"file {name!r} leads outside the shard directory (a symbolic link?); expected a file inside it")
    return full


def open_shard(path: str | os.PathLike) -> Shard:
    """Open a shard directory memory-mapped and check its structure against its manifest.

    Checks the manifest, that tokens.npy is ``[num_tokens, dim]`` of the stored dtype,
    the offsets (start at 0, non-decreasing, end at T), the ids and, for an int8 shard,
    that scales.npy is float32 ``[num_tokens]`` with every scale finite and >= 0 (read
    block by block). Token values are not read: :func:`scan_values` checks them. A shard
    replaced while it is opened (``lik pack --force``) is opened again, whole. Returns
    a packed :class:`Shard` whose ``tokens`` are in the library's dtype (bfloat16 as
    ``ml_dtypes.bfloat16``; int8 with ``scales``).
    """
    return _open_shard(path)


def _open_shard(path: str | os.PathLike, max_bytes: int = CHUNK_BYTES) -> Shard:
    """:func:`open_shard`, checking an int8 shard's scales ``max_bytes`` at a time (at most 6 bytes a scale held).

    The files are opened by name one after another, so the directory at ``path`` must be the same one
    before and after (its device and inode): one that ``lik pack --force`` replaced in between (an
    atomic exchange of two directories) gave the old shard's tokens with the new one's offsets and ids.
    Its files are then opened again (what was raised meanwhile is no judgement of either shard), up to
    ``_OPEN_TRIES`` times. The opened files are checked last, against what they hold.
    """
    path = os.fspath(path)
    for _ in range(_OPEN_TRIES):
        before = _identity(path)
        try:
            opened = _open_files(path)
        except ShardError:
            if _identity(path) == before:
                raise
            continue
        if _identity(path) == before:
            return _packed(path, *opened, max_bytes)
    raise ShardError(path, f"was replaced while it was being opened, {_OPEN_TRIES} times in a row (another process "
                           "writing it, such as lik pack --force); open it again once it is written")


def _identity(path: str) -> tuple[int, int] | None:
    """The (device, inode) of what is at ``path`` (links followed), None where nothing can be seen."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _open_files(path: str) -> tuple:
    """The files of the shard directory ``path``, opened and checked against its manifest: ``_packed``'s
    arguments from ``tokens`` to ``scales_file``."""
    what = _files.file_kind(path)
    if what is None:
        raise ShardError(path, "no such shard directory")
    if what != "a directory":
        raise ShardError(path, f"is {what}, not a directory; a shard is a directory holding manifest.json, tokens.npy and offsets.npy")
    mpath = os.path.join(path, fmt.MANIFEST)
    m = _read_manifest(mpath)
    files = {key: _member_path(path, name, mpath) for key, name in m["files"].items()
             if key in ("tokens", "offsets", "ids", "scales")}
    raw = _files.open_npy(files["tokens"])
    expect = (m["num_tokens"], m["dim"])
    if raw.shape != expect:
        raise ShardError(files["tokens"], f"shape {raw.shape} does not match the manifest's [num_tokens, dim] = {list(expect)}")
    if raw.dtype != _STORED[m["dtype"]]:
        raise ShardError(files["tokens"], f"dtype {raw.dtype.str} does not match the manifest's dtype {m['dtype']} (stored as {_STORED[m['dtype']].str})")
    offsets = _files.open_npy(files["offsets"])
    if offsets.dtype != np.dtype("<i8"):
        raise ShardError(files["offsets"], f"dtype {offsets.dtype.str}; expected int64 (<i8)")
    if offsets.shape != (m["num_docs"] + 1,):
        raise ShardError(files["offsets"], f"shape {offsets.shape} does not match the manifest's num_docs + 1 = {m['num_docs'] + 1}")
    ids = _files.open_npy(files["ids"]) if "ids" in files else None
    if ids is not None and ids.dtype.kind in "iu" and ids.dtype != np.dtype("<i8"):
        raise ShardError(files["ids"], f"integer ids must be int64 (<i8), got {ids.dtype.str}")
    scales = _files.open_npy(files["scales"]) if "scales" in files else None
    return (_as_numpy_dtype(raw, m["dtype"]), offsets, ids, m, files["tokens"], files["offsets"], files.get("ids", ""),
            scales, files.get("scales", ""))


def open_input(path: str | os.PathLike, lengths: str | os.PathLike | None = None, *, bf16_bits: bool = False) -> Shard:
    """Open any accepted corpus or query input as a :class:`Shard`.

    - a shard directory (``lengths`` must be None: the shard has offsets);
    - a padded ``[N, L, d]`` ``.npy``, with ``lengths`` an optional file of ``[N]``
      valid-row counts (each 0..L);
    - ColBERT-style flat tokens ``[T, d]`` ``.npy`` with ``lengths`` its doclens
      (``.npy`` or ColBERT's ``doclens.*.json``), summing to T.

    ``lengths`` files may be ``.npy`` integer arrays or JSON lists. uint16 ``.npy`` data
    is read as bfloat16 bits only with ``bf16_bits``.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        if lengths is not None:
            raise ShardError(lengths, f"{path} is a shard directory with its own offsets; a lengths file goes with a .npy input only")
        return open_shard(path)
    arr = _files.open_npy(path)
    if arr.ndim not in (2, 3):
        raise ShardError(path, f"expected a padded [N, L, d] array, or flat [T, d] tokens with doclens; got shape {arr.shape}")
    dtype = _embedding_dtype(arr, path, bf16_bits)
    tokens = _as_numpy_dtype(arr, dtype)
    lens = _files.read_lengths(lengths) if lengths is not None else None
    if arr.ndim == 3:
        return _padded(path, tokens, lens, None if lengths is None else os.fspath(lengths), path)
    if lens is None:
        raise ShardError(path, f"flat token embeddings {list(arr.shape)} need per-document token counts (doclens); pass a lengths file")
    offsets = np.zeros(lens.shape[0] + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    # lengths are >= 0 and below 2**63: a sum past int64 shows as a step down where it wraps
    if (offsets[1:] < offsets[:-1]).any():
        raise ShardError(os.fspath(lengths), f"doclens add up to 2**63 tokens or more; expected token counts summing "
                                             f"to the {arr.shape[0]} token rows of {path}")
    if offsets[-1] != arr.shape[0]:
        raise ShardError(os.fspath(lengths), f"doclens sum to {int(offsets[-1])} but {path} holds {arr.shape[0]} token rows; expected them to match")
    return _packed(path, tokens, offsets, None, None, path, os.fspath(lengths), "")


def _load_padded(shard: Shard) -> tuple[np.ndarray, np.ndarray | None]:
    """A whole shard in memory as padded ``[N, Lmax, d]`` plus int64 lengths ``[N]`` (None: all rows valid).

    Meant for queries, which are few; a corpus is read with :meth:`Shard.read_chunk`.
    An int8 shard comes back dequantized, as float32.
    """
    if shard.padded:
        return np.array(shard.tokens), None if shard.lengths is None else np.array(shard.lengths)
    lens = shard.doc_lengths()
    width = max(1, int(lens.max())) if lens.size else 1
    tokens = shard.read_values(0, shard.num_docs)[0] if shard.scales is not None else shard.read_chunk(0, shard.num_docs)[0]
    out = np.zeros((shard.num_docs, width, shard.dim), tokens.dtype)
    out[np.arange(width)[None, :] < lens[:, None]] = tokens
    return out, lens


# --------------------------------------------------------------------------- value checks


@dataclass(frozen=True)
class ValueScan:
    """What :func:`scan_values` found. Positions are ``(document, token within it)``; None if none."""

    nonfinite: tuple[int, int] | None
    not_unit: tuple[int, int, float] | None  # (document, token, its L2 norm)

    @property
    def normalized(self) -> bool:
        return self.not_unit is None


def _norms(x32: np.ndarray) -> np.ndarray:
    """L2 norm of each row of float32 tokens [t, d]; NaN/inf rows give non-finite norms."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.sqrt(np.einsum("td,td->t", x32, x32))


def scan_values(shard: Shard, max_bytes: int = CHUNK_BYTES) -> ValueScan:
    """Read every valid token once: find the first NaN/inf and the first token whose norm is not 1.

    Padding rows of a padded layout are not read as values (they are never scored); int8
    tokens are read dequantized. Tokens are read in blocks, a long document in pieces;
    ``max_bytes`` bounds what a block holds at once: its tokens as read, their float32
    values and a mask of them (for float16 tokens 7 bytes an element), plus
    ``_TOKEN_WORK_BYTES`` a token. At least one token at a time.
    """
    offsets = shard._row_offsets()
    nonfinite = not_unit = None
    for first, tokens, scales in shard._row_blocks(_rows(max_bytes, shard.dim, *_read_work(shard.dtype))):
        x32 = _float32(tokens, scales)
        finite, norms = np.isfinite(x32).all(axis=1), _norms(x32)
        del x32  # before the next block's
        if nonfinite is None and not finite.all():
            nonfinite = _position(first + int(np.argmin(finite)), offsets)
        off = ~(np.abs(norms - 1) <= NORM_TOLERANCE)
        if not_unit is None and off.any():
            t = int(np.argmax(off))
            not_unit = (*_position(first + t, offsets), float(norms[t]))
        if nonfinite is not None and not_unit is not None:
            break
    return ValueScan(nonfinite, not_unit)


def _values(tokens: np.ndarray, scales: np.ndarray | None) -> np.ndarray:
    """float32 values of a block of tokens (int8 ones dequantized with their scales), a new array."""
    x32 = tokens.astype(np.float32)
    if scales is not None:
        x32 *= scales[:, None]
    return x32


def _float32(tokens: np.ndarray, scales: np.ndarray | None) -> np.ndarray:
    """:func:`_values`, to read only: float32 tokens come back as they are, not copied."""
    return tokens if scales is None and tokens.dtype == np.float32 else _values(tokens, scales)


# How many tokens a block takes so that what it holds at once fits a budget. Each path says what it
# holds of one token: bytes an element (its tokens as stored in the source, and every temporary of
# the block's size made from them) and bytes a token (an int8 source's scale); every path holds
# _TOKEN_WORK_BYTES a token more. tracemalloc measures each path's peak within these
# (tests/test_shards.py).


def _rows(max_bytes: int, dim: int, element_bytes: int, token_bytes: int = 0) -> int:
    """Tokens in a block whose working set (``element_bytes`` an element, ``token_bytes`` +
    ``_TOKEN_WORK_BYTES`` a token) fits ``max_bytes``; at least one."""
    return max(1, int(max_bytes) // (dim * element_bytes + token_bytes + _TOKEN_WORK_BYTES))


def _scale_bytes(dtype: str) -> int:
    return _SCALES_STORED.itemsize if dtype == fmt.INT8 else 0


def _read_work(dtype: str) -> tuple[int, int]:
    """What reading ``dtype`` tokens as values (:func:`scan_values`, :func:`check_finite`) holds of one
    (bytes an element, bytes a token): the tokens, their float32 values (float32 tokens are their
    own) and a mask of them; an int8 token's scale."""
    values = 0 if dtype == "float32" else 4
    return _STORED[dtype].itemsize + values + 1, _scale_bytes(dtype)


def _write_work(source: str, dtype: str, check: bool, contiguous: bool = True) -> tuple[int, int]:
    """What writing ``source`` tokens as ``dtype`` (:func:`_write_block`) holds of one (bytes an element,
    bytes a token), ``check``: with check_finite; ``contiguous``: the block's rows lie back to back
    (else they are copied so to be written).

    - to int8 from int8: the tokens (their sum of squares is taken without a copy);
    - to int8 from a float dtype: the tokens and what the quantiser holds of them
      (``INT8_WORK_BYTES``: a float32 copy, a float32 temporary and the int8 codes);
    - to a float dtype: the tokens, their float32 values (float32 tokens are their own), the
      values as stored (none when the dtype is the values' own) and, with ``check``, a mask.
    """
    from ._cpu.quantize import INT8_WORK_BYTES

    held = _STORED[source].itemsize
    if dtype == fmt.INT8:
        if source == fmt.INT8:
            return held * (1 if contiguous else 2), _scale_bytes(source)
        return held + INT8_WORK_BYTES, 0
    values = 0 if source == "float32" else 4
    cast_from = "float32" if source == fmt.INT8 else source  # what is cast to dtype: the values, or the tokens
    stored = 0 if dtype == cast_from and contiguous else _STORED[dtype].itemsize
    return held + values + stored + (1 if check else 0), _scale_bytes(source)


def _position(row: int, offsets: np.ndarray) -> tuple[int, int]:
    """(document, token within it) of a valid token row; ``offsets`` as in ``Shard._row_offsets``."""
    j = int(np.searchsorted(offsets, row, side="right")) - 1
    return j, row - int(offsets[j])


def check_finite(shard: Shard, max_bytes: int = CHUNK_BYTES) -> None:
    """Raise ShardError naming the file and the first document with a NaN or infinite token value.

    Reads tokens in blocks of at most ``max_bytes`` held at once, as :func:`scan_values`.
    """
    offsets = shard._row_offsets()
    for first, tokens, scales in shard._row_blocks(_rows(max_bytes, shard.dim, *_read_work(shard.dtype))):
        finite = np.isfinite(_float32(tokens, scales)).all(axis=1)
        if not finite.all():
            doc, tok = _position(first + int(np.argmin(finite)), offsets)
            raise ShardError(shard.tokens_file, f"document {doc}{_id_note(shard, doc)}, token {tok} holds NaN or inf; embeddings must be finite")


def _id_note(shard: Shard, doc: int) -> str:
    return "" if shard.ids is None else f" (id {fmt.plain(shard.ids[doc])!r})"


# --------------------------------------------------------------------------- writing


def pack(source: Shard, path: str | os.PathLike, *, ids=None, model: str | None = None, dtype: str | None = None,
         overwrite: bool = False, check_finite: bool = False, max_bytes: int = CHUNK_BYTES) -> Shard:
    """Write any opened input (padded, flat + doclens, or another shard) as a shard directory.

    Tokens are copied block by block (only valid rows of a padded layout), converted to
    ``dtype`` (None: keep the source's). ``dtype="int8"`` quantizes float tokens block by
    block (``lik_cupy.quantize``: one float32 scale per token, stored in
    scales.npy; NaN or inf cannot be quantized and raise ShardError); an int8 source is
    copied as it is, or dequantized for a float ``dtype``. ``ids`` ([N] int64 or str)
    replace the source's ids. With ``check_finite`` a NaN or inf value raises ShardError
    and nothing is written. The manifest's ``normalized`` is measured while copying (on
    the stored values: dequantized for int8). The shard is built in a temporary
    directory beside ``path`` and renamed into place at the end (``lik_cupy._atomic``):
    whatever appears at ``path`` meanwhile is never replaced, and a full disk raises OSError
    naming ``path`` and leaves nothing. Returns the written shard, opened.

    ``max_bytes`` bounds the memory a block of tokens holds at once: the tokens read (a
    memory-mapped view, or the valid rows of a padded layout with lengths copied) and every
    array made of them while they are converted, quantized, checked and measured, e.g. per
    element 2 (float16 tokens) + 4 (their float32 values) for a float16 copy, 2 + 9 (the
    quantiser's float32 copy, one float32 temporary and the int8 codes) for ``dtype="int8"``;
    plus 64 bytes a token (``_TOKEN_WORK_BYTES``: scales, norms, masks of rows). Blocks are sized
    so that this fits in ``max_bytes``, at least one token each. Besides the blocks, writing
    holds the offsets and ids (8-16 bytes a document, and the ids' own size); string ids are
    checked 8 MiB at a time, masks included.
    """
    def blocks(rows):
        return ((source.tokens_file, tokens, scales) for _, tokens, scales in source._row_blocks(rows))

    ids = source.ids if ids is None else ids
    return _write(path, blocks, source._row_offsets(), ids, source.dim, source.dtype, dtype, model, overwrite,
                  check_finite, max_bytes)


def write_shard(path: str | os.PathLike, tokens: np.ndarray, offsets, *, ids=None, model: str | None = None,
                dtype: str | None = None, overwrite: bool = False, check_finite: bool = False,
                scales: np.ndarray | None = None) -> Shard:
    """Write packed documents as a new shard directory.

    Args:
        path: the shard directory to create (its parent must exist).
        tokens: ``[T, d]`` float16, float32 or ``ml_dtypes.bfloat16``, or int8 with
            ``scales``; a memmap is copied block by block, never loaded whole (blocks
            holding at most ``CHUNK_BYTES`` at once, as :func:`pack`'s ``max_bytes``).
        offsets: integer ``[N+1]``; document j is ``tokens[offsets[j]:offsets[j+1]]``
            (offsets[0] == 0, non-decreasing, offsets[-1] == T).
        ids: optional ``[N]`` int64 or str document ids.
        model: free-form name of the model that made the embeddings (stored in the manifest).
        dtype: store as "float16", "float32", "bfloat16" or "int8" (quantized per token
            while writing; see :func:`pack`). None: tokens' own dtype.
        overwrite: replace ``path`` if it already is a shard holding only its own files
            (anything else is never replaced).
        check_finite: raise ShardError (writing nothing) if a value is NaN or inf.
        scales: float32 ``[T]`` per-token scales of int8 ``tokens`` (each finite, >= 0);
            None for float tokens.

    Returns:
        The written :class:`Shard`, opened memory-mapped.
    """
    tokens = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
    tokens = _check_array_dtype(tokens, "tokens", int8_ok=scales is not None)
    if scales is not None and tokens.dtype != np.int8:
        raise ShardError("scales", f"scales go with int8 tokens; tokens have dtype {tokens.dtype}")
    scales = None if scales is None else scales if isinstance(scales, np.ndarray) else np.asarray(scales)
    source = _packed("tokens", tokens, np.asarray(offsets), None, None, "tokens", "offsets", "ids", scales, "scales")
    return pack(source, path, ids=ids, model=model, dtype=dtype, overwrite=overwrite, check_finite=check_finite)


def pack_arrays(docs: Sequence, path: str | os.PathLike, *, ids=None, model: str | None = None,
                dtype: str | None = None, overwrite: bool = False, check_finite: bool = False,
                bf16_bits: bool = False) -> Shard:
    """Write one document per array as a shard directory.

    ``docs``: a sequence (or any iterable) of ``[L_i, d]`` arrays (float16, float32,
    ``ml_dtypes.bfloat16``; an ``[N, L, d]`` array's rows too) or of ``.npy`` paths, opened
    memory-mapped (uint16 files hold bfloat16 bits when ``bf16_bits``). All share d and dtype.
    Other arguments as in :func:`write_shard` (``dtype="int8"`` quantizes them). Each document is
    written in blocks holding at most ``CHUNK_BYTES`` at once, as :func:`pack`'s ``max_bytes``.
    """
    docs = list(docs)  # (an array's truth value is ambiguous, a generator's always true)
    if not docs:
        raise ShardError(path, "no documents given; expected at least one [L, d] array")
    # A file's array is not kept but opened again when it is written: a memory map holds a file
    # descriptor, and thousands of pages held at once ran out of them (ulimit -n).
    arrays, names, kinds = [], [], []  # the array (None: a file's), its name, its (shape, dtype)
    for i, doc in enumerate(docs):
        if isinstance(doc, (str, os.PathLike)):
            name = os.fspath(doc)
            doc, kept = _npy_document(name, bf16_bits), None
        else:
            name = f"docs[{i}]"
            doc = kept = _check_array_dtype(doc if isinstance(doc, np.ndarray) else np.asarray(doc), name)
        if doc.ndim != 2:
            raise ShardError(name, f"expected one document's token embeddings [L, d], got shape {doc.shape}")
        if kinds and (doc.shape[1], doc.dtype) != (kinds[0][0][1], kinds[0][1]):
            raise ShardError(name, f"d={doc.shape[1]}, {doc.dtype} differs from {names[0]}'s d={kinds[0][0][1]}, {kinds[0][1]}; every document needs the same dim and dtype")
        arrays.append(kept)
        names.append(name)
        kinds.append((doc.shape, doc.dtype))
    del doc
    if kinds[0][0][1] == 0:
        raise ShardError(names[0], "embedding dim is 0; expected d >= 1")
    offsets = np.zeros(len(arrays) + 1, np.int64)
    np.cumsum([shape[0] for shape, _ in kinds], out=offsets[1:])

    def blocks(rows):  # one document at a time (_write_tokens splits a long one into blocks of ``rows``)
        for name, a, (shape, dt) in zip(names, arrays, kinds):
            if a is None:
                a = _npy_document(name, bf16_bits)
                if (a.shape, a.dtype) != (shape, dt):
                    raise ShardError(name, f"changed while it was packed: it now holds {list(a.shape)} {a.dtype}, "
                                           f"it held {list(shape)} {dt}; pack it again")
            yield name, a, None

    return _write(path, blocks, offsets, ids, kinds[0][0][1], kinds[0][1].name, dtype, model, overwrite,
                  check_finite)


def _npy_document(name: str, bf16_bits: bool) -> np.ndarray:
    """One document's ``.npy`` file, memory-mapped, in its library dtype."""
    raw = _files.open_npy(name)
    return _as_numpy_dtype(raw, _embedding_dtype(raw, name, bf16_bits))


def _check_array_dtype(arr: np.ndarray, name: str, int8_ok: bool = False) -> np.ndarray:
    if arr.dtype.name in fmt.DTYPES or (int8_ok and arr.dtype == np.int8):
        return arr
    if arr.dtype == np.int8:
        raise ShardError(name, "dtype int8 needs per-token scales: pass scales= (float32 [T]) to write_shard, "
                               "or give float embeddings with dtype='int8' to quantize them")
    raise ShardError(name, f"dtype {arr.dtype} is not float16, float32 or ml_dtypes.bfloat16 (bfloat16 bits in uint16: a.view(ml_dtypes.bfloat16))")


def _write(path, blocks, offsets: np.ndarray, ids, dim: int, source_dtype: str, dtype: str | None, model, overwrite,
           check_finite: bool, max_bytes: int | None = None) -> Shard:
    """Stream ``(source name, token rows, their scales or None)`` triples into a new shard directory at
    ``path``, atomically (``lik_cupy._atomic``). ``blocks(rows)`` gives the triples, each at most
    ``rows`` tokens where it holds a copy (the rows :func:`_write_work` fits in ``max_bytes``).
    Rows are quantized to int8, dequantized, or converted between float dtypes on the way, in
    blocks whose working set fits ``max_bytes`` (see :func:`pack`; None: ``CHUNK_BYTES``)."""
    path = os.fspath(path)
    max_bytes = CHUNK_BYTES if max_bytes is None else max_bytes
    dtype = dtype or source_dtype
    if dtype not in fmt.SHARD_DTYPES:
        raise ShardError(path, f"dtype {dtype!r} is not one of {', '.join(fmt.SHARD_DTYPES)}")
    if model is not None and not isinstance(model, str):
        raise ShardError(path, f"model must be a string, got {type(model).__name__}")
    num_docs, num_tokens = offsets.shape[0] - 1, int(offsets[-1])
    if ids is not None:
        ids = fmt.check_ids(ids, num_docs, "ids")
    files = {"tokens": fmt.TOKENS, "offsets": fmt.OFFSETS}
    if dtype == fmt.INT8:
        files["scales"] = fmt.SCALES
    if ids is not None:
        files["ids"] = fmt.IDS
    manifest = {
        "format": fmt.FORMAT, "version": _WRITE_VERSION[dtype], "dim": dim, "dtype": dtype,
        "num_docs": num_docs, "num_tokens": num_tokens, "normalized": False, "model": model, "files": files,
    }
    size = len(_manifest_text(manifest))  # (ASCII; normalized as "false", the longer of its values)
    if size > _MAX_MANIFEST_BYTES:
        raise ShardError(path, f"the model name makes a manifest of {size:,} bytes, past the {_MAX_MANIFEST_BYTES:,} "
                               "a reader takes; give a shorter one")
    _check_target(path, overwrite)
    try:
        with _atomic.output_dir(path, _replaceable_shard if overwrite else None) as tmp:
            work = functools.partial(_write_work, source_dtype, dtype, check_finite)
            manifest["normalized"] = _write_tokens(
                tmp, path, blocks(_rows(max_bytes, dim, *work())), offsets, dim, dtype, check_finite,
                lambda rows: _rows(max_bytes, dim, *work(rows.flags.c_contiguous)))
            with _new_member(tmp, fmt.OFFSETS, path) as f:
                np.save(f, offsets.astype("<i8", copy=False))
            if ids is not None:
                with _new_member(tmp, fmt.IDS, path) as f:
                    np.save(f, ids, allow_pickle=False)
            with _new_member(tmp, fmt.MANIFEST, path) as f:
                f.write(_manifest_text(manifest).encode("utf-8"))
    except FileExistsError as e:  # what was at ``path`` when the shard was renamed there, or in ``tmp`` (_new_member)
        raise ShardError(path, _files.problem(e)) from None
    return _open_shard(path, max_bytes)


def _new_member(tmp: str, name: str, path: str):
    """File ``name`` of the shard being written in ``tmp``, open for writing, created exclusively: never
    through a link, or over a file, that another process put in the temporary directory (a
    FileExistsError naming the shard ``path`` says so)."""
    try:
        return open(os.path.join(tmp, name), "xb")
    except FileExistsError:
        raise FileExistsError(errno.EEXIST, f"{name} appeared in the shard's temporary directory while it was being "
                                            "written (another process writes into it); nothing was written", path) from None


def _manifest_text(manifest: dict) -> str:
    """A manifest as written: JSON (ASCII, other characters escaped), keys sorted, one per line."""
    return json.dumps(manifest, indent=2, sort_keys=True) + "\n"


def _write_tokens(tmp: str, path: str, blocks, offsets: np.ndarray, dim: int, dtype: str, check_finite: bool,
                  block_rows) -> bool:
    """Write tokens.npy (and for int8 scales.npy) into ``tmp``; returns whether every token has norm 1.
    ``block_rows(rows)``: how many of the token rows ``rows`` go in one block.

    Both files are allocated at their full size before the first row is converted, so a disk
    too small fails at once, and are filled by plain sequential writes: a disk that fills up
    anyway raises OSError, never SIGBUS as a writable memory map would.
    """
    num_tokens = int(offsets[-1])
    files = [(fmt.TOKENS, _STORED[dtype], (num_tokens, dim))] + ([(fmt.SCALES, _SCALES_STORED, (num_tokens,))] if dtype == fmt.INT8 else [])
    with contextlib.ExitStack() as stack:
        out = []
        for name, stored, shape in files:
            f = stack.enter_context(_new_member(tmp, name, path))
            np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(stored),
                                                     "fortran_order": False, "shape": shape})
            _atomic.allocate(f, f.tell() + math.prod(shape) * stored.itemsize, path)
            out.append(f)
        pos, normalized = 0, True
        for name, rows, row_scales in blocks:
            step = block_rows(rows)
            for a in range(0, rows.shape[0], step):  # a long document in pieces
                block = rows[a : a + step]
                scales = None if row_scales is None else row_scales[a : a + step]
                normalized &= _write_block(out, name, block, scales, pos, offsets, dtype, check_finite)
                pos += block.shape[0]
    return normalized


def _write_block(out, name: str, block: np.ndarray, scales, pos: int, offsets: np.ndarray, dtype: str,
                 check_finite: bool) -> bool:
    """Convert one block of token rows (the first is row ``pos``) to ``dtype`` and append it to the
    open files ``out`` (tokens, and scales for int8); returns whether each of its tokens has norm 1."""

    def refuse(bad: np.ndarray, why: str):
        row = pos + int(np.argmax(bad))
        doc, tok = _position(row, offsets)
        raise ShardError(name, f"document {doc}, token {tok} {why}")

    # What each branch holds at once is what _write_work counts; keep the two in step.
    if dtype == fmt.INT8:
        if scales is None:  # float tokens, quantized; a token with NaN or inf gets scale NaN, refused here
            from ._cpu import quantize_numpy

            block, scales = quantize_numpy(block, strict=False)
            bad = np.isnan(scales)
            if bad.any():
                why = "embeddings must be finite" if check_finite else "INT8 quantization needs finite values"
                refuse(bad, f"holds NaN or inf; {why}")
        # An int8 block copied as int8 needs no float values: it is finite (its scales were
        # checked on opening), and norms come from the integers, their squares summed exactly.
        out[0].write(np.ascontiguousarray(block, np.int8).data)
        out[1].write(np.ascontiguousarray(scales, _SCALES_STORED).data)
        norms = np.sqrt(np.einsum("td,td->t", block, block, dtype=np.int64).astype(np.float64)) * scales
    else:
        x32 = _float32(block, scales)
        if check_finite and not np.isfinite(x32).all():
            refuse(~np.isfinite(x32).all(axis=1), "holds NaN or inf; embeddings must be finite")
        # An int8 source is written dequantized; float sources convert directly.
        with np.errstate(over="ignore"):  # a value past the dtype's range: refused below with --check
            stored = (x32 if scales is not None else block).astype(fmt.numpy_dtype(dtype), copy=False)
        if check_finite and stored.dtype != block.dtype:
            # The values as stored: a float32 value past float16's range becomes inf in the cast.
            over = ~np.isfinite(stored).all(axis=1)
            if over.any():
                largest = float(np.abs(x32[int(np.argmax(over))]).max())
                refuse(over, f"holds {largest:g}, which is inf as {dtype} (outside its range); embeddings must be finite")
        out[0].write(np.ascontiguousarray(stored).view(_STORED[dtype]).data)
        del stored
        norms = _norms(x32)
    return bool(np.all(np.abs(norms - 1) <= NORM_TOLERANCE))


def _check_target(path: str, overwrite: bool) -> None:
    """ShardError if a shard may not be written at ``path``: its parent is missing or not writable,
    its name too long, or something is there that may not be replaced."""
    try:
        _atomic.check_name(path)  # first: a path ending in '..' has no parent of its own to judge
    except OSError as e:
        raise ShardError(path, _files.problem(e)) from None
    parent = os.path.dirname(os.path.abspath(path))
    what = _files.file_kind(parent)
    if what is None:
        raise ShardError(path, f"parent directory {parent} does not exist")
    if what != "a directory":
        raise ShardError(path, f"{parent} is {what}, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ShardError(path, f"parent directory {parent} is not writable")
    _atomic.sweep(path)  # first: a shard a killed run left moved aside is put back before the target is judged
    if os.path.lexists(path):
        if not overwrite:
            raise ShardError(path, "already exists; choose a new path, or replace a shard with overwrite=True (lik pack --force)")
        why = _replaceable_shard(path)
        if why is not None:
            raise ShardError(path, why)


def _replaceable_shard(path: str) -> str | None:
    """None if ``path`` is a lik shard that ``overwrite`` may replace, else why not.

    A shard is replaced whole, so it may hold nothing but its own files: its manifest and
    the files the manifest names, under the names lik writes them with. Anything else in the
    directory (notes, another program's data, a subdirectory), or a manifest naming one of its
    files otherwise (it could claim a file that is not the shard's), makes it not a shard to replace.
    """
    refusing = "refusing to replace it (overwrite / lik pack --force replaces a lik shard, never anything else)"
    if os.path.islink(path) or not os.path.isdir(path):
        return f"exists and is not a lik shard; {refusing}"
    try:
        m = _read_manifest(os.path.join(path, fmt.MANIFEST))
        entries = os.listdir(path)
    except (ShardError, OSError):
        return f"exists and is not a lik shard (no readable manifest.json); {refusing}"
    written = {"tokens": fmt.TOKENS, "offsets": fmt.OFFSETS, "ids": fmt.IDS, "scales": fmt.SCALES}
    renamed = sorted(f"{key} as {name}" for key, name in m["files"].items()
                     if key in written and os.path.normpath(name) != written[key])
    if renamed:
        return (f"is a shard whose manifest names its files otherwise than lik writes them ({', '.join(renamed)}); "
                f"{refusing}")
    own = {fmt.MANIFEST} | {written[key] for key in m["files"] if key in written}
    others = sorted(n for n in entries if n not in own or os.path.isdir(os.path.join(path, n))
                    and not os.path.islink(os.path.join(path, n)))
    if others:
        listed = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        return f"is a lik shard but also holds {listed}, which are not its files; {refusing}"
    if not os.access(path, os.W_OK | os.X_OK):
        return ("is a lik shard in a directory that is not writable, so its files cannot be removed; "
                "nothing was replaced (make it writable, or write elsewhere)")
    return None
