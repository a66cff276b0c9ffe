"""The on-disk layouts of fast-plaid, ColBERTv2 and PyLate (PLAID) indexes, read into NumPy arrays
for ``lik_cupy.plaid.PlaidIndex``. Nothing here writes to the index directory.

fast-plaid (``metadata.json`` beside ``centroids.npy``):
    metadata.json                    {"nbits", "num_chunks", ...}
    centroids.npy                    [C, d] float16 (float32 in some versions; read as float16)
    bucket_weights.npy               [2^nbits] (float32 on disk, float16 when fast-plaid loads it)
    doclens.{i}.json                 chunk i's document lengths, in document order
    merged_codes.npy                 int64 [rows]: every chunk's codes back to back (fast-plaid >= 1.7
                                     keeps only these, plus padding rows at the end)
    merged_residuals.npy             uint8 [rows, d * nbits / 8]
    merged_{codes,residuals}.manifest.json   rows of each chunk in the merged files
    {i}.codes.npy, {i}.residuals.npy chunk i alone: older versions, and updates not merged yet (they win)
ColBERTv2 (``metadata.json`` with a "config" beside ``centroids.pt``):
    metadata.json                    {"config": {"dim", "nbits", ...}, "num_chunks", ...}
    centroids.pt                     [C, d] float16 (torch.save)
    buckets.pt                       (bucket_cutoffs, bucket_weights)
    doclens.{i}.json, {i}.codes.pt (int32 [n]), {i}.residuals.pt (uint8 [n, d * nbits / 8])
PyLate (its PLAID index directory):
    fast_plaid_index/                a fast-plaid index, read as above
    *.pkl, *.sqlite                  PyLate's document-id maps (pickles in some versions, SQLite in others),
                                     never read (ids are positions: map PyLate's ids through them first)

``.pt`` files are torch zip archives, read by a small interpreter of the pickle opcodes torch.save
writes for tensors, which builds NumPy arrays and refuses any other object (so torch is not needed,
and a file cannot run code: nothing here imports pickle).

Every file is hostile until checked, and every problem is a ShardError naming the file: each is
opened as a regular file (``lik_cupy._files``: a FIFO or a device is refused, never waited on);
``.npy`` headers are checked against the file's size before it is mapped (``_files.open_npy``); a
``.pt`` file's zip directory against the file and ``_MAX_MEMBERS`` / ``_MAX_DIRECTORY_BYTES``
before zipfile reads it (``_check_zip_directory``), a member's claimed size against the file (and
the sizes of all members read, so overlapping members are not each read whole), a
compressed one's expansion against ``_MAX_EXPANSION``, and every tensor's elements against its
storage's bytes before any view is made;
counts must agree across files (metadata's chunks, each chunk's doclens, codes and residual rows,
the manifests' rows); codes are int32 or int64 naming a centroid, lengths integers >= 0 whose sum
fits int64; centroids and bucket weights finite. metadata.json and the manifests are read no larger
than an index needs (JSON takes many times its bytes as Python objects); doclens files, of any size,
are parsed without Python objects (``_files.read_lengths``: the file, 8 bytes a value and a few MiB),
their lengths checked (>= 0, a sum inside int64, the codes' rows) before anything is sized by them.
Memory is bounded by what the files hold.
"""

from __future__ import annotations

import lzma
import os
import struct
import zipfile
import zlib
from dataclasses import dataclass

import numpy as np

from . import _files
from .errors import ShardError

__all__ = ["IndexArrays", "read_index", "read_torch_file"]

# metadata.json is a few hundred bytes; anything near this is not an index's.
_MAX_METADATA_BYTES = 1 << 20
# A merged manifest holds an entry of about 60 bytes a chunk; parsed JSON takes up to 18 times its
# bytes, so a manifest is read up to this much a chunk beyond _MAX_METADATA_BYTES.
_MAX_MANIFEST_BYTES_PER_CHUNK = 1 << 10


@dataclass
class IndexArrays:
    kind: str  # "fast-plaid" or "colbertv2"
    nbits: int
    centroids: np.ndarray  # float16 [C, d]
    bucket_weights: np.ndarray  # float32 [2^nbits], the float16 values both tools decompress with
    codes: np.ndarray  # int32 or int64 [T] (memory-mapped where the file allows)
    residuals: np.ndarray  # uint8 [T, d * nbits / 8]
    offsets: np.ndarray  # int64 [N + 1]


def read_index(path: str | os.PathLike) -> IndexArrays:
    """Read the fast-plaid, ColBERTv2 or PyLate PLAID index in directory ``path``.

    Every file is treated as hostile: ShardError names the file and the problem for anything
    missing, special (a FIFO, a device), truncated, of the wrong type or shape, or inconsistent
    with the other files; memory is bounded by what the files hold."""
    path = os.fspath(path)
    what = _files.file_kind(path)
    if what != "a directory":
        raise ShardError(path, f"{'no such directory' if what is None else 'is ' + what}; expected a fast-plaid, "
                               f"ColBERTv2 or PyLate PLAID index directory")
    pylate = os.path.join(path, "fast_plaid_index")  # PyLate's PLAID: a fast-plaid index inside it
    if _files.file_kind(pylate) == "a directory" and _files.file_kind(os.path.join(pylate, "centroids.npy")):
        path = pylate
    if _present(os.path.join(path, "centroids.npy")):
        return _read_fast_plaid(path)
    if _present(os.path.join(path, "centroids.pt")):
        return _read_colbert(path)
    raise ShardError(path, "neither a fast-plaid index (centroids.npy), a PyLate index (fast_plaid_index/) nor a "
                           "ColBERTv2 index (centroids.pt)")


def _metadata(path: str) -> tuple[dict, int, int]:
    """metadata.json's config (its "config" for ColBERTv2, else itself), nbits and number of chunks,
    which may not exceed the directory's entries (each chunk has files of its own)."""
    name = os.path.join(path, "metadata.json")
    meta = _files.read_json(name, "not valid JSON", "an index's metadata (a small JSON object)", _MAX_METADATA_BYTES)
    config = meta.get("config", meta) if isinstance(meta, dict) else None
    if not isinstance(config, dict):
        raise ShardError(name, "expected a JSON object (with a \"config\" object for ColBERTv2)")
    nbits, chunks = config.get("nbits"), meta.get("num_chunks")
    if type(nbits) is not int or nbits not in (1, 2, 4):
        raise ShardError(name, f"nbits is {_short(nbits)}; expected 1, 2 or 4")
    try:
        entries = len(os.listdir(path))
    except OSError as e:
        raise ShardError(path, f"cannot list the index directory: {_files.problem(e)}") from None
    if type(chunks) is not int or not 0 <= chunks <= entries:
        raise ShardError(name, f"num_chunks is {_short(chunks)}; expected an integer from 0 to the files in the index")
    return config, nbits, chunks


def _short(value, limit: int = 40) -> str:
    """A value read from a file (a JSON value, a name, an error's detail), for a message: its repr,
    a long string's cut to its first ``limit`` characters; a long number's or a container's type
    (a value of any depth)."""
    if isinstance(value, str):
        return repr(value) if len(value) <= limit else f"{value[:limit]!r}... ({len(value)} characters)"
    if isinstance(value, (int, float, bool)) or value is None:
        text = repr(value)
        return text if len(text) <= limit else f"a {type(value).__name__} of {len(text)} characters"
    return f"a {type(value).__name__}"


def _doclens(path: str, chunks: int) -> tuple[np.ndarray, list[int]]:
    """Every chunk's doclens.{i}.json: (int64 offsets [N + 1], each chunk's token count). Memory: a
    file's bytes and its lengths while it is parsed (``_files.read_lengths``), then 16 bytes a
    document (the chunks' offsets, and all of them in one array)."""
    pieces, rows, total = [], [], 0
    for i in range(chunks):
        name = os.path.join(path, f"doclens.{i}.json")
        if not _present(name):
            raise ShardError(name, f"no such file; metadata.json says the index has {chunks} chunks")
        cum = _files.read_lengths(name)
        np.cumsum(cum, out=cum)
        # lengths are >= 0 and below 2**63: a sum past int64 shows as a step down where it wraps
        if (cum[1:] < cum[:-1]).any() or total + (int(cum[-1]) if cum.size else 0) >= 2**63:
            raise ShardError(name, "document lengths add up to 2**63 tokens or more; expected token counts")
        cum += total
        pieces.append(cum)
        rows.append(int(cum[-1]) - total if cum.size else 0)
        total += rows[-1]
    extra = os.path.join(path, f"doclens.{chunks}.json")
    if _present(extra):
        raise ShardError(extra, f"a chunk that metadata.json does not count (it says {chunks} chunks)")
    offsets = np.empty(1 + sum(p.size for p in pieces), np.int64)
    offsets[0] = 0
    if pieces:
        np.concatenate(pieces, out=offsets[1:])
    return offsets, rows


def _weights(w: np.ndarray, nbits: int, name: str) -> np.ndarray:
    if not isinstance(w, np.ndarray) or w.dtype.kind != "f":
        raise ShardError(name, f"bucket weights are {_what(w)}; expected floats")
    w = w.reshape(-1)
    if w.size != 1 << nbits:
        raise ShardError(name, f"{w.size} bucket weights for nbits {nbits}; expected {1 << nbits}")
    with np.errstate(over="ignore"):  # a value past float16's range is refused below, not warned of
        w = w.astype(np.float16).astype(np.float32)  # as both tools decompress on the GPU
    if not np.isfinite(w).all():
        raise ShardError(name, "a bucket weight is not finite (as float16); expected finite values")
    return w


def _centroids(c, name: str) -> np.ndarray:
    if not isinstance(c, np.ndarray) or c.dtype.kind != "f" or c.ndim != 2 or min(c.shape) < 1:
        raise ShardError(name, f"centroids are {_what(c)}; expected floats [C, d], at least one centroid")
    with np.errstate(over="ignore"):  # a value past float16's range is refused below, not warned of
        c = c.astype(np.float16)
    if not np.isfinite(c).all():
        raise ShardError(name, "a centroid is not finite (as float16); expected finite values")
    return c


def _what(a) -> str:
    """What a value read from a file is, for a message."""
    if isinstance(a, np.ndarray):
        return f"{a.dtype} of shape {list(a.shape)}"
    return _short(a)


def _payload(part, suffix: str, row_bytes: int, name: str):
    """``part`` if it is what a chunk's codes (integers [n]) or residuals (uint8 [n, row_bytes]) must be."""
    if suffix == "codes":  # the dtypes the scoring functions take as ids
        ok = isinstance(part, np.ndarray) and part.ndim == 1 and part.dtype in (np.dtype("<i4"), np.dtype("<i8"))
        expected = "int32 or int64 codes [n]"
    else:
        ok = isinstance(part, np.ndarray) and part.dtype == np.uint8 and part.shape[1:] == (row_bytes,)
        expected = f"uint8 residual bits [n, {row_bytes}]"
    if not ok:
        raise ShardError(name, f"holds {_what(part)}; expected {expected}")
    return part


def _read_fast_plaid(path: str) -> IndexArrays:
    _, nbits, chunks = _metadata(path)
    centroids = _centroids(_files.open_npy(os.path.join(path, "centroids.npy")), os.path.join(path, "centroids.npy"))
    name = os.path.join(path, "bucket_weights.npy")
    weights = _weights(_files.open_npy(name), nbits, name)
    offsets, rows = _doclens(path, chunks)
    row_bytes = _row_bytes(centroids, nbits, path)
    codes = _chunked(path, "codes", rows, row_bytes)
    residuals = _chunked(path, "residuals", rows, row_bytes)
    return _checked(IndexArrays("fast-plaid", nbits, centroids, weights, codes, residuals, offsets), path)


def _row_bytes(centroids: np.ndarray, nbits: int, path: str) -> int:
    dim = centroids.shape[1]
    if dim * nbits % 8:
        raise ShardError(path, f"nbits {nbits} with centroids of dim {dim} is not a PLAID layout this reader "
                               f"knows (dim * nbits must be a multiple of 8)")
    return dim * nbits // 8


def _chunked(path: str, suffix: str, rows: list[int], row_bytes: int) -> np.ndarray:
    """A payload's rows, chunk by chunk: a chunk's own ``{i}.{suffix}.npy`` if present (not merged
    yet, or an index from before merged files), else its rows of ``merged_{suffix}.npy`` at the
    offset the manifest gives (the chunks' rows in order when there is no manifest)."""
    merged_path = os.path.join(path, f"merged_{suffix}.npy")
    merged = _payload(_files.open_npy(merged_path), suffix, row_bytes, merged_path) if _present(merged_path) else None
    manifest = _manifest(path, suffix, len(rows))
    parts, at = [], 0
    leading = True  # whether every chunk so far is the merged file's next rows, from its first on
    for i, n in enumerate(rows):
        own = os.path.join(path, f"{i}.{suffix}.npy")
        entry = manifest.get(f"{i}.{suffix}.npy")
        if _present(own):
            part = _payload(_files.open_npy(own), suffix, row_bytes, own)
            where, rows_of = own, f"chunk {i}"
            leading = leading and n == 0 and not entry
        elif merged is not None:
            if entry is not None and entry != n:
                raise ShardError(os.path.join(path, f"merged_{suffix}.manifest.json"),
                                 f"chunk {i} has {entry} rows but its doclens add up to {n}")
            part = merged[at:at + n]
            where, rows_of = merged_path, f"chunk {i} from row {at}"
        else:
            raise ShardError(own, f"no such file, and no merged_{suffix}.npy holds chunk {i}'s rows")
        if part.shape[0] != n:
            raise ShardError(where, f"{part.shape[0]} rows of {suffix} for {rows_of}, but doclens.{i}.json adds up "
                                    f"to {n} tokens")
        parts.append(part)
        at += n if entry is None else entry
    if leading and merged is not None and parts:  # one view of the merged file: nothing copied
        return merged[:sum(rows)]
    if len(parts) == 1:
        return parts[0]
    return _concatenated(parts, suffix, row_bytes)


def _concatenated(parts: list[np.ndarray], suffix: str, row_bytes: int) -> np.ndarray:
    """The chunks' rows back to back; codes of mixed integer types as int64 (never promoted to float)."""
    if not parts:
        return np.zeros((0,) if suffix == "codes" else (0, row_bytes), np.int64 if suffix == "codes" else np.uint8)
    if len({p.dtype for p in parts}) > 1:
        parts = [p.astype(np.int64) for p in parts]
    return np.concatenate(parts)


def _manifest(path: str, suffix: str, chunks: int) -> dict[str, int]:
    """merged_{suffix}.manifest.json as {file name: rows} (empty when there is none), read no
    larger than an index of ``chunks`` chunks needs."""
    name = os.path.join(path, f"merged_{suffix}.manifest.json")
    if not _present(name):
        return {}
    m = _files.read_json(name, "not valid JSON", "a fast-plaid manifest (a JSON object, an entry a chunk)",
                         _MAX_METADATA_BYTES + _MAX_MANIFEST_BYTES_PER_CHUNK * chunks)
    if not isinstance(m, dict):
        raise ShardError(name, f"holds {_short(m)}; expected an object of {{file name: {{\"rows\": n}}}}")
    out = {}
    for key, entry in m.items():
        rows = entry.get("rows") if isinstance(entry, dict) else None
        if type(rows) is not int or rows < 0:
            raise ShardError(name, f"{_short(key)} has rows {_short(rows)}; expected an integer >= 0")
        out[key] = rows
    return out


def _present(name: str) -> bool:
    """Whether anything is at ``name``: a dangling link where an optional file goes is read (and
    refused as missing), not taken for no file."""
    return os.path.islink(name) or _files.file_kind(name) is not None


def _read_colbert(path: str) -> IndexArrays:
    config, nbits, chunks = _metadata(path)
    dim = config.get("dim")
    name = os.path.join(path, "centroids.pt")
    centroids = _centroids(read_torch_file(name), name)
    if dim is not None and dim != centroids.shape[1]:
        raise ShardError(name, f"centroids of dim {centroids.shape[1]}, but metadata.json says dim {_short(dim)}")
    name = os.path.join(path, "buckets.pt")
    buckets = read_torch_file(name)
    if not isinstance(buckets, (tuple, list)) or len(buckets) != 2:
        raise ShardError(name, f"holds {_what(buckets)}; expected (bucket_cutoffs, bucket_weights)")
    weights = _weights(buckets[1], nbits, name)
    offsets, rows = _doclens(path, chunks)
    row_bytes = _row_bytes(centroids, nbits, path)
    codes, residuals = [], []
    for i in range(chunks):
        for suffix, out in (("codes", codes), ("residuals", residuals)):
            name = os.path.join(path, f"{i}.{suffix}.pt")
            out.append(_payload(read_torch_file(name), suffix, row_bytes, name))
            if out[-1].shape[0] != rows[i]:
                raise ShardError(name, f"{out[-1].shape[0]} rows of {suffix}, but doclens.{i}.json adds up to "
                                       f"{rows[i]} tokens")
    return _checked(IndexArrays("colbertv2", nbits, centroids, weights, _concatenated(codes, "codes", row_bytes),
                                _concatenated(residuals, "residuals", row_bytes), offsets), path)


def _checked(a: IndexArrays, path: str) -> IndexArrays:
    """Every code names a centroid (read once here, so scoring need not)."""
    step = 1 << 24
    for s in range(0, a.codes.shape[0], step):
        c = a.codes[s:s + step]
        if c.min() < 0 or c.max() >= a.centroids.shape[0]:
            raise ShardError(path, f"a code lies outside the {a.centroids.shape[0]} centroids; expected ids in "
                                   f"[0, {a.centroids.shape[0] - 1}]")
    return a


# ---------------------------------------------------------------- torch.save archives, without torch

# What a torch.save archive's data.pkl may name (anything else is refused): storage types by their
# NumPy dtype, the tensor rebuilder, and OrderedDict (a tensor's empty backward hooks).
_STORAGES = {"HalfStorage": np.float16, "FloatStorage": np.float32, "DoubleStorage": np.float64,
             "ByteStorage": np.uint8, "CharStorage": np.int8, "ShortStorage": np.int16, "IntStorage": np.int32,
             "LongStorage": np.int64, "BoolStorage": np.bool_}
# torch.save stores its members uncompressed; a compressed member may expand at most this much.
_MAX_EXPANSION = 64
# data.pkl describes tensors and containers: a few hundred bytes for any index file (this bounds
# the Python objects a pickle can make).
_MAX_PICKLE_BYTES = 1 << 20


# torch.save writes data.pkl, byteorder, version, .format_version, .storage_alignment,
# .data/serialization_id and one data/<key> per storage: 8 members for a PLAID file's one or two
# tensors. zipfile makes a ZipInfo (about 0.5 KiB) of every central directory entry (46 bytes and a
# name) before anything can be checked, so a directory of many tiny entries took 9 times the file's
# size; _check_zip_directory refuses more than _MAX_MEMBERS entries, or a directory over
# _MAX_DIRECTORY_BYTES (torch's entries are 46 bytes, a name of the file's stem and ``/data/<key>``,
# and a zip64 field: 1 KiB each is generous), before zipfile is given the file. What zipfile
# allocates for the directory is then a few MiB at most.
_MAX_MEMBERS = 4096
_MAX_DIRECTORY_BYTES = _MAX_MEMBERS * 1024
# The zip records _check_zip_directory reads (APPNOTE 4.3.12, 4.3.14-16): the end of central
# directory record, the zip64 one and its locator (torch.save writes both), a directory entry.
_EOCD = struct.Struct("<4s4H2LH")
_ZIP64_LOCATOR = struct.Struct("<4sLQL")
_ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")
_ENTRY = struct.Struct("<4s4B4HL2L5H2L")


class _NotZip(Exception):
    """The file does not end in a zip end of central directory record."""


class _Refused(Exception):
    """A problem with a .pt file; read_torch_file names the file."""


@dataclass(frozen=True)
class _Storage:
    """A storage's elements, contiguous: made only by ``read_torch_file``, so a tensor can be
    rebuilt over nothing else (a tensor rebuilt over a strided view of another could reach past
    the bytes the checks counted)."""

    array: np.ndarray


@dataclass(frozen=True)
class _StorageType:
    """A storage type the pickle named (``torch.HalfStorage``, ...): made only by ``resolve``, so a
    pickle cannot forge one of another dtype."""

    dtype: type


def _rebuild_tensor(storage, offset, size, stride, *_):
    """torch._utils._rebuild_tensor_v2, as a read-only NumPy view of the storage, after checking
    that every element the view reaches lies inside the storage and that it claims no more
    elements than the storage holds (so a file cannot read past its bytes, nor expand a few bytes
    into a large array by overlapping strides)."""
    if not isinstance(storage, _Storage):
        raise _Refused(f"a tensor's storage is a {type(storage).__name__}, not a storage")
    storage = storage.array
    if not (type(offset) is int and _ints(size) and _ints(stride) and len(size) == len(stride) <= 64):
        raise _Refused("a tensor's offset, size and stride are not integers of one rank (at most 64)")
    if offset < 0 or any(n < 0 for n in size) or any(st < 0 for st in stride):
        raise _Refused(f"a tensor has a negative offset, size or stride (offset {offset}, rank {len(size)})")
    numel, room = 1, storage.dtype.itemsize
    for n in size:
        numel *= n
        room *= max(n, 1)
    if room >= 2**63:
        raise _Refused(f"a tensor's size needs more than 2**63 bytes (rank {len(size)})")
    if numel == 0:
        return np.zeros(tuple(size), storage.dtype)
    last = offset + sum((n - 1) * st for n, st in zip(size, stride))
    if last >= storage.size:
        raise _Refused(f"a tensor reaches element {last} of a storage of {storage.size} elements "
                       f"(offset {offset}, its size and stride lead past the storage's bytes)")
    if numel > storage.size:
        raise _Refused(f"a tensor claims {numel} elements of a storage of {storage.size} (overlapping strides)")
    strides = tuple(0 if n == 1 else st * storage.itemsize for n, st in zip(size, stride))
    return np.lib.stride_tricks.as_strided(storage[offset:], shape=tuple(size), strides=strides, writeable=False)


def _ints(values) -> bool:
    return isinstance(values, tuple) and all(type(v) is int for v in values)


def _unpickle(data: bytes, storage):
    """The value of a torch data.pkl (pickle protocol 2, as torch.save writes it), by a small
    interpreter of the opcodes torch.save uses: containers, numbers, strings and the names in
    ``_STORAGES`` / ``_rebuild_tensor``. Nothing is imported and no other callable is run, so a
    crafted file cannot execute code; it runs no recursion (a pickle nested deep is read as deep
    as it is) and hashes nothing but numbers and strings (dict keys). ``storage(key, dtype,
    numel)`` returns a storage's array. Raises _Refused, or IndexError / KeyError / ... for a
    malformed stream (read_torch_file says so)."""

    stack: list = []
    memo: dict = {}
    marks: list[int] = []
    pos = 0

    def take(n):
        nonlocal pos
        b = data[pos:pos + n]
        if len(b) != n:
            raise _Refused("truncated pickle")
        pos += n
        return b

    def line():
        nonlocal pos
        end = data.find(b"\n", pos)
        if end < 0:
            raise _Refused("truncated pickle")
        s = data[pos:end].decode("utf-8")
        pos = end + 1
        return s

    def pop_mark():
        at = marks.pop()
        items = stack[at:]
        del stack[at:]
        return items

    def key(k):
        if not isinstance(k, (str, int, float)) and k is not None:
            raise _Refused(f"a dict key is a {type(k).__name__}; torch.save writes strings and numbers")
        return k

    def resolve(module, attr):
        if module == "torch._utils" and attr == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch" and attr in _STORAGES:
            return _StorageType(_STORAGES[attr])
        if module == "collections" and attr == "OrderedDict":
            return dict
        name = f"{module}.{attr}" if isinstance(module, str) and isinstance(attr, str) else "a name that is no string"
        raise _Refused(f"{name[:80]} is not a tensor or container; refusing to load it")

    while True:
        op = take(1)
        if op == b"\x80":  # PROTO
            take(1)
        elif op == b"\x95":  # FRAME
            take(8)
        elif op == b".":  # STOP
            return stack.pop()
        elif op == b"(":  # MARK
            marks.append(len(stack))
        elif op == b"c":  # GLOBAL
            stack.append(resolve(line(), line()))
        elif op == b"\x93":  # STACK_GLOBAL
            attr, module = stack.pop(), stack.pop()
            stack.append(resolve(module, attr))
        elif op == b"Q":  # BINPERSID
            pid = stack.pop()
            if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                    and isinstance(pid[1], _StorageType) and type(pid[2]) is str and type(pid[4]) is int
                    and pid[4] >= 0):
                raise _Refused(f"unexpected persistent id (a {type(pid).__name__}); expected a storage")
            stack.append(storage(pid[2], pid[1].dtype, pid[4]))
        elif op == b"R":  # REDUCE
            args, fn = stack.pop(), stack.pop()
            if fn is _rebuild_tensor and isinstance(args, tuple) and 4 <= len(args) <= 7:
                stack.append(_rebuild_tensor(*args))
            elif fn is dict and args == ():
                stack.append({})
            else:
                raise _Refused(f"refusing to call a {type(fn).__name__} with {type(args).__name__} arguments")
        elif op == b")":  # EMPTY_TUPLE
            stack.append(())
        elif op == b"t":  # TUPLE
            stack.append(tuple(pop_mark()))
        elif op in (b"\x85", b"\x86", b"\x87"):  # TUPLE1..3
            n = op[0] - 0x84
            if len(stack) < n:
                raise _Refused("a tuple of more items than the stack holds")
            items = tuple(stack[-n:])
            del stack[-n:]
            stack.append(items)
        elif op == b"]":  # EMPTY_LIST
            stack.append([])
        elif op == b"a":  # APPEND
            v = stack.pop()
            stack[-1].append(v)
        elif op == b"e":  # APPENDS
            items = pop_mark()
            stack[-1].extend(items)
        elif op == b"}":  # EMPTY_DICT
            stack.append({})
        elif op == b"s":  # SETITEM
            v, k = stack.pop(), stack.pop()
            stack[-1][key(k)] = v
        elif op == b"u":  # SETITEMS
            items = pop_mark()
            stack[-1].update(zip(map(key, items[::2]), items[1::2]))
        elif op == b"N":
            stack.append(None)
        elif op == b"\x88":
            stack.append(True)
        elif op == b"\x89":
            stack.append(False)
        elif op == b"K":  # BININT1
            stack.append(take(1)[0])
        elif op == b"M":  # BININT2
            stack.append(struct.unpack("<H", take(2))[0])
        elif op == b"J":  # BININT
            stack.append(struct.unpack("<i", take(4))[0])
        elif op == b"\x8a":  # LONG1
            stack.append(int.from_bytes(take(take(1)[0]), "little", signed=True))
        elif op == b"G":  # BINFLOAT
            stack.append(struct.unpack(">d", take(8))[0])
        elif op == b"X":  # BINUNICODE
            stack.append(take(struct.unpack("<I", take(4))[0]).decode("utf-8"))
        elif op == b"\x8c":  # SHORT_BINUNICODE
            stack.append(take(take(1)[0]).decode("utf-8"))
        elif op in (b"U", b"C"):  # SHORT_BINSTRING, SHORT_BINBYTES
            stack.append(take(take(1)[0]).decode("latin-1"))
        elif op == b"q":  # BINPUT
            memo[take(1)[0]] = stack[-1]
        elif op == b"r":  # LONG_BINPUT
            memo[struct.unpack("<I", take(4))[0]] = stack[-1]
        elif op == b"\x94":  # MEMOIZE
            memo[len(memo)] = stack[-1]
        elif op == b"h":  # BINGET
            stack.append(memo[take(1)[0]])
        elif op == b"j":  # LONG_BINGET
            stack.append(memo[struct.unpack("<I", take(4))[0]])
        elif op == b"b":  # BUILD: only an empty state onto a plain container
            state = stack.pop()
            if not (state is None or state == {} or state == ()):
                raise _Refused("unexpected object state in the pickle")
        else:
            raise _Refused(f"pickle opcode {op!r} is not one torch.save writes for tensors")


def read_torch_file(path: str):
    """The tensors (as read-only NumPy views of their storages) and containers of a ``torch.save``
    zip archive.

    The file must be a regular file (a FIFO or a device is refused without blocking). Every
    archive's central directory must lie inside the file where its end records say, hold at most
    ``_MAX_MEMBERS`` entries in at most ``_MAX_DIRECTORY_BYTES``, checked before zipfile reads it
    (zipfile makes an object of every entry first); every
    member's claimed size is checked against the file before it is read, alone and added to the
    members read before it (so members whose data overlap are not each read whole; a compressed
    member must be deflated, claim at most ``_MAX_EXPANSION`` times its own size, and is expanded no further than
    it claims), each storage is read once, and every tensor's elements must lie inside its
    storage: memory is bounded by what the file holds. Anything else (a malformed archive or
    pickle, a callable other than the tensor rebuilder) raises ShardError naming the file and the
    problem.
    """
    path = os.fspath(path)
    with _files.open_regular(path, "a torch .pt file") as f:
        file_bytes = os.fstat(f.fileno()).st_size
        try:
            _check_zip_directory(f, file_bytes)
            with zipfile.ZipFile(f) as archive:
                return _read_archive(archive, file_bytes)
        except _NotZip:
            raise ShardError(path, "not a torch zip archive: it does not end in a zip end of central directory "
                                   "record (torch.save before 1.6 wrote another format; re-save it with a recent "
                                   "torch)") from None
        except zipfile.BadZipFile as e:
            raise ShardError(path, f"corrupt zip archive ({e})") from None
        except _Refused as e:
            raise ShardError(path, str(e)) from None
        except ShardError:
            raise
        # a malformed pickle or archive (RecursionError is a RuntimeError)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError, EOFError, NotImplementedError,
                RuntimeError, zipfile.LargeZipFile, zlib.error, lzma.LZMAError) as e:
            raise ShardError(path, f"corrupt torch archive ({type(e).__name__}: {_short(str(e), 200)})") from None


def _check_zip_directory(f, file_bytes: int) -> None:
    """Refuse a zip archive whose central directory zipfile would read into more than
    ``_MAX_MEMBERS`` ZipInfos, or from more than ``_MAX_DIRECTORY_BYTES``, or from anywhere but
    where its end records say it lies inside the file, reading only those records and the
    directory itself (at most ``_MAX_DIRECTORY_BYTES``).

    The end of central directory record must be the file's last 22 bytes (torch.save writes no
    archive comment), which is the record zipfile reads then; a zip64 locator before it must point
    at the zip64 record just before it (where zipfile reads it, and where torch.save writes it),
    whose counts and offsets then hold. The directory must end exactly where those records begin,
    and its entries, walked as zipfile walks them, must fill it and number what the record says.
    Raises _NotZip, or _Refused saying what was wrong.
    """
    if file_bytes < _EOCD.size:
        raise _NotZip
    f.seek(file_bytes - _EOCD.size)
    sig, disk, cd_disk, disk_entries, entries, size, offset, comment = _EOCD.unpack(f.read(_EOCD.size))
    if sig != b"PK\x05\x06" or comment:
        raise _NotZip
    end = file_bytes - _EOCD.size  # where the central directory must end
    if end >= _ZIP64_LOCATOR.size:
        f.seek(end - _ZIP64_LOCATOR.size)
        sig, locator_disk, at, disks = _ZIP64_LOCATOR.unpack(f.read(_ZIP64_LOCATOR.size))
        if sig == b"PK\x06\x07":
            end -= _ZIP64_LOCATOR.size + _ZIP64_EOCD.size
            if end < 0:
                raise _Refused(f"its zip64 end record locator points at byte {at}, but the file of {file_bytes} "
                               f"bytes has no room for a zip64 end record before it")
            if at != end:
                raise _Refused(f"its zip64 end record locator points at byte {at}; expected the record just "
                               f"before it, at byte {end} of a file of {file_bytes} bytes")
            f.seek(end)
            (sig, _, _, _, disk, cd_disk, disk_entries, entries, size,
             offset) = _ZIP64_EOCD.unpack(f.read(_ZIP64_EOCD.size))
            if sig != b"PK\x06\x06":
                raise _Refused(f"its zip64 end record locator points at byte {at}, which holds no zip64 end record")
            disk |= locator_disk | (disks > 1)
    if disk or cd_disk or disk_entries != entries:
        raise _Refused("its zip end record describes an archive of several disks; a torch archive is one file")
    if entries > _MAX_MEMBERS:
        raise _Refused(f"its zip directory claims {entries} members; a torch file of tensors has a handful "
                       f"(at most {_MAX_MEMBERS} are read)")
    if size > _MAX_DIRECTORY_BYTES:
        raise _Refused(f"its zip central directory claims {size} bytes; a torch file of tensors needs a few "
                       f"hundred (at most {_MAX_DIRECTORY_BYTES} are read)")
    if offset + size != end:
        raise _Refused(f"its zip central directory (at byte {offset}, {size} bytes) does not end where its end "
                       f"record begins (byte {end} of a file of {file_bytes} bytes)")
    f.seek(offset)
    directory = f.read(size)
    pos = count = 0
    while pos < size:
        if count == entries:
            raise _Refused(f"its zip central directory holds more than the {entries} members its end record counts")
        if pos + _ENTRY.size > size or directory[pos:pos + 4] != b"PK\x01\x02":
            raise _Refused(f"its zip central directory's entry {count} (at byte {offset + pos}) is malformed")
        name, extra, note = struct.unpack_from("<3H", directory, pos + 28)
        pos += _ENTRY.size + name + extra + note
        count += 1
    if pos != size or count != entries:
        raise _Refused(f"its zip central directory's {count} entries fill {pos} bytes; its end record says "
                       f"{entries} entries in {size} bytes")


def _read_archive(archive: zipfile.ZipFile, file_bytes: int):
    names = archive.namelist()
    pkl = [n for n in names if n.endswith("data.pkl")]
    if len(pkl) != 1:
        raise _Refused(f"a torch archive has one data.pkl; found {len(pkl)}")
    prefix = pkl[0][: -len("data.pkl")]
    # A zip's members hold disjoint bytes of it, so what is read together fits the file; members
    # whose data overlap (each a long run over the next ones) would otherwise each be read whole.
    claimed = 0

    def member(name: str, limit: int) -> bytes:
        nonlocal claimed
        try:
            info = archive.getinfo(name)
        except KeyError:
            raise _Refused(f"the archive has no member {_short(name)}") from None
        stored = info.compress_type == zipfile.ZIP_STORED
        if not stored and info.compress_type != zipfile.ZIP_DEFLATED:
            # zipfile expands a bzip2 or LZMA stream whole, whatever size the header claims: a few
            # hundred bytes of one can take gigabytes
            raise _Refused(f"member {_short(name)} is compressed with method {info.compress_type}; expected it "
                           f"stored (as torch.save writes it) or deflated")
        if info.compress_size > file_bytes or (stored and info.file_size != info.compress_size):
            raise _Refused(f"member {_short(name)} claims more bytes than the file holds")
        claimed += info.compress_size
        if claimed > file_bytes:
            raise _Refused(f"member {_short(name)} and those read before it claim more bytes than the file holds "
                           f"({claimed} of {file_bytes}): their data overlap")
        if info.file_size > max(info.compress_size, 1) * _MAX_EXPANSION:
            raise _Refused(f"member {_short(name)} expands {info.file_size} bytes from {info.compress_size}, more "
                           f"than {_MAX_EXPANSION} times (torch.save stores members uncompressed)")
        if info.file_size > limit:
            raise _Refused(f"member {_short(name)} holds {info.file_size} bytes; expected at most {limit}")
        with archive.open(info) as m:  # no more than the header claims (read() expands the whole stream first)
            data = m.read(info.file_size)
        if len(data) != info.file_size:
            raise _Refused(f"member {_short(name)} is truncated")
        return data

    order = f"{prefix}byteorder"
    if order in names and member(order, 16).strip() != b"little":
        raise _Refused("big-endian tensors are not read")
    storages: dict[str, bytes] = {}  # each member read once, however often the pickle names it

    def storage(key: str, dtype: type, numel: int) -> _Storage:
        if key not in storages:
            storages[key] = member(f"{prefix}data/{key}", 2**63)
        data, need = storages[key], numel * np.dtype(dtype).itemsize
        if len(data) < need:
            raise _Refused(f"storage {_short(key)} holds {len(data)} bytes, not the {need} its {numel} elements need")
        return _Storage(np.frombuffer(data, dtype, count=numel))

    return _unpickle(member(pkl[0], _MAX_PICKLE_BYTES), storage)
