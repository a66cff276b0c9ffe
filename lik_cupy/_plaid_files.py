"""The on-disk layouts of fast-plaid and ColBERTv2 (PLAID) indexes, read into NumPy arrays for
``lik_cupy.plaid.PlaidIndex``. Nothing here writes to the index directory.

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

``.pt`` files are torch zip archives, read by a small interpreter of the pickle opcodes torch.save
writes for tensors, which builds NumPy arrays and refuses any other object (so torch is not needed,
and a file cannot run code: nothing here imports pickle).
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass

import numpy as np

__all__ = ["IndexArrays", "read_index", "read_torch_file"]


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
    """Read the fast-plaid or ColBERTv2 index in directory ``path``."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: not a directory (expected a fast-plaid or ColBERTv2 index)")
    if os.path.exists(os.path.join(path, "centroids.npy")):
        return _read_fast_plaid(path)
    if os.path.exists(os.path.join(path, "centroids.pt")):
        return _read_colbert(path)
    raise FileNotFoundError(f"{path}: neither a fast-plaid index (centroids.npy) nor a ColBERTv2 index "
                            f"(centroids.pt)")


def _json(path: str, name: str):
    with open(os.path.join(path, name)) as f:
        return json.load(f)


def _doclens(path: str, chunks: int) -> list[list[int]]:
    out = []
    for i in range(chunks):
        name = f"doclens.{i}.json"
        out.append([int(n) for n in _json(path, name)] if os.path.exists(os.path.join(path, name)) else [])
    return out


def _weights(w: np.ndarray, nbits: int, where: str) -> np.ndarray:
    w = np.asarray(w).reshape(-1)
    if w.size != 1 << nbits:
        raise ValueError(f"{where}: {w.size} bucket weights for nbits {nbits}; expected {1 << nbits}")
    return w.astype(np.float16).astype(np.float32)  # as both tools decompress on the GPU


def _offsets(doclens: list[list[int]]) -> np.ndarray:
    lens = np.array([n for chunk in doclens for n in chunk], np.int64)
    if (lens < 0).any():
        raise ValueError("a doclens file holds a negative document length")
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)


def _read_fast_plaid(path: str) -> IndexArrays:
    meta = _json(path, "metadata.json")
    nbits, chunks = int(meta["nbits"]), int(meta["num_chunks"])
    centroids = np.load(os.path.join(path, "centroids.npy"), allow_pickle=False).astype(np.float16)
    weights = _weights(np.load(os.path.join(path, "bucket_weights.npy"), allow_pickle=False), nbits, path)
    doclens = _doclens(path, chunks)
    rows = [sum(c) for c in doclens]
    codes = _chunked(path, "codes", rows)
    residuals = _chunked(path, "residuals", rows)
    return _checked(IndexArrays("fast-plaid", nbits, centroids, weights, codes, residuals, _offsets(doclens)), path)


def _chunked(path: str, suffix: str, rows: list[int]) -> np.ndarray:
    """A payload's rows, chunk by chunk: a chunk's own ``{i}.{suffix}.npy`` if present (not merged
    yet, or an index from before merged files), else its rows of ``merged_{suffix}.npy`` at the
    offset the manifest gives (the chunks' rows in order when there is no manifest)."""
    merged_path = os.path.join(path, f"merged_{suffix}.npy")
    merged = np.load(merged_path, mmap_mode="r", allow_pickle=False) if os.path.exists(merged_path) else None
    manifest_path = os.path.join(path, f"merged_{suffix}.manifest.json")
    manifest = _json(path, os.path.basename(manifest_path)) if os.path.exists(manifest_path) else {}
    parts, at = [], 0
    for i, n in enumerate(rows):
        own = os.path.join(path, f"{i}.{suffix}.npy")
        entry = manifest.get(f"{i}.{suffix}.npy")
        if os.path.exists(own):
            part = np.load(own, mmap_mode="r", allow_pickle=False)
        elif merged is not None:
            part = merged[at:at + n]
        else:
            raise FileNotFoundError(f"{path}: chunk {i} has neither {i}.{suffix}.npy nor rows in merged_{suffix}.npy")
        if part.shape[0] != n:
            raise ValueError(f"{path}: chunk {i} has {part.shape[0]} rows of {suffix} but its doclens add up to {n}")
        parts.append(part)
        at += int(entry["rows"]) if entry else n
    if _contiguous_merged(parts, merged):  # one view of the merged file: nothing copied
        return merged[:sum(rows)]
    if len(parts) == 1:
        return parts[0]
    if parts:
        return np.concatenate(parts)
    return np.zeros((0,) + (tuple(merged.shape[1:]) if merged is not None else ()), merged.dtype if merged is not None
                    else np.int64)


def _contiguous_merged(parts: list[np.ndarray], merged) -> bool:
    """Whether ``parts`` are the merged file's rows from its first on, in order."""
    if merged is None or not parts:
        return False
    at = merged.__array_interface__["data"][0]
    for p in parts:
        if p.size and p.__array_interface__["data"][0] != at:
            return False
        at += p.nbytes
    return True


def _read_colbert(path: str) -> IndexArrays:
    meta = _json(path, "metadata.json")
    config = meta.get("config", meta)
    nbits, chunks = int(config["nbits"]), int(meta["num_chunks"])
    centroids = np.asarray(read_torch_file(os.path.join(path, "centroids.pt"))).astype(np.float16)
    buckets = read_torch_file(os.path.join(path, "buckets.pt"))
    if not isinstance(buckets, (tuple, list)) or len(buckets) != 2:
        raise ValueError(f"{path}/buckets.pt: expected (bucket_cutoffs, bucket_weights)")
    weights = _weights(buckets[1], nbits, path)
    doclens = _doclens(path, chunks)
    codes, residuals = [], []
    for i in range(chunks):
        codes.append(np.asarray(read_torch_file(os.path.join(path, f"{i}.codes.pt"))).reshape(-1))
        residuals.append(np.asarray(read_torch_file(os.path.join(path, f"{i}.residuals.pt"))))
        if codes[-1].shape[0] != sum(doclens[i]) or residuals[-1].shape[0] != codes[-1].shape[0]:
            raise ValueError(f"{path}: chunk {i} has {codes[-1].shape[0]} codes and {residuals[-1].shape[0]} "
                             f"residual rows but its doclens add up to {sum(doclens[i])}")
    rb = centroids.shape[1] * nbits // 8
    arrays = IndexArrays("colbertv2", nbits, centroids, weights,
                         np.concatenate(codes) if codes else np.zeros(0, np.int32),
                         np.concatenate(residuals) if residuals else np.zeros((0, rb), np.uint8), _offsets(doclens))
    return _checked(arrays, path)


def _checked(a: IndexArrays, path: str) -> IndexArrays:
    """The shapes agree, and every code names a centroid (read once here, so scoring need not)."""
    dim = a.centroids.shape[1] if a.centroids.ndim == 2 else -1
    if a.nbits not in (1, 2, 4) or dim < 1 or dim * a.nbits % 8:
        raise ValueError(f"{path}: nbits {a.nbits} with centroids of shape {list(a.centroids.shape)} is not a "
                         f"PLAID layout this reader knows")
    t = int(a.offsets[-1])
    if a.codes.shape != (t,) or a.residuals.shape != (t, dim * a.nbits // 8) or a.residuals.dtype != np.uint8:
        raise ValueError(f"{path}: codes {list(a.codes.shape)} and residuals {list(a.residuals.shape)} "
                         f"{a.residuals.dtype} do not match {t} tokens of dim {dim} at {a.nbits} bits")
    if a.codes.dtype.kind not in "iu":
        raise ValueError(f"{path}: codes have dtype {a.codes.dtype}; expected integers")
    step = 1 << 24
    for s in range(0, t, step):
        c = a.codes[s:s + step]
        if c.min() < 0 or c.max() >= a.centroids.shape[0]:
            raise ValueError(f"{path}: a code lies outside the {a.centroids.shape[0]} centroids")
    return a


# ---------------------------------------------------------------- torch.save archives, without torch

# What a torch.save archive's data.pkl may name (anything else is refused): storage types by their
# NumPy dtype, the tensor rebuilder, and OrderedDict (a tensor's empty backward hooks).
_STORAGES = {"HalfStorage": np.float16, "FloatStorage": np.float32, "DoubleStorage": np.float64,
             "ByteStorage": np.uint8, "CharStorage": np.int8, "ShortStorage": np.int16, "IntStorage": np.int32,
             "LongStorage": np.int64, "BoolStorage": np.bool_}


def _rebuild_tensor(storage, offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    """torch._utils._rebuild_tensor_v2, as a contiguous NumPy copy of the strided view."""
    if not size:
        return storage[offset:offset + 1].reshape(()).copy()
    view = np.lib.stride_tricks.as_strided(storage[offset:], shape=tuple(size),
                                           strides=tuple(s * storage.dtype.itemsize for s in stride))
    return np.ascontiguousarray(view)


class _Mark:
    pass


def _unpickle(data: bytes, storage, name: str):
    """The value of a torch data.pkl (pickle protocol 2, as torch.save writes it), by a small
    interpreter of the opcodes torch.save uses: containers, numbers, strings and the names in
    ``_STORAGES`` / ``_rebuild_tensor``. Nothing is imported and no other callable is run, so a
    crafted file cannot execute code. ``storage(key, dtype, numel)`` returns a storage's array."""
    import struct

    stack: list = []
    memo: dict = {}
    marks: list[int] = []
    pos = 0

    def take(n):
        nonlocal pos
        b = data[pos:pos + n]
        if len(b) != n:
            raise ValueError(f"{name}: truncated pickle")
        pos += n
        return b

    def line():
        nonlocal pos
        end = data.index(b"\n", pos)
        s = data[pos:end].decode("utf-8")
        pos = end + 1
        return s

    def pop_mark():
        at = marks.pop()
        items = stack[at:]
        del stack[at:]
        return items

    def resolve(module, attr):
        if module == "torch._utils" and attr == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch" and attr in _STORAGES:
            return ("storage-type", _STORAGES[attr])
        if module == "collections" and attr == "OrderedDict":
            return dict
        raise ValueError(f"{name}: {module}.{attr} is not a tensor or container; refusing to load it")

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
                    and isinstance(pid[1], tuple) and pid[1][0] == "storage-type"):
                raise ValueError(f"{name}: unexpected persistent id {pid!r}")
            stack.append(storage(str(pid[2]), pid[1][1], int(pid[4])))
        elif op == b"R":  # REDUCE
            args, fn = stack.pop(), stack.pop()
            if fn is _rebuild_tensor:
                stack.append(_rebuild_tensor(*args))
            elif fn is dict and args == ():
                stack.append({})
            else:
                raise ValueError(f"{name}: refusing to call {fn!r}")
        elif op == b")":  # EMPTY_TUPLE
            stack.append(())
        elif op == b"t":  # TUPLE
            stack.append(tuple(pop_mark()))
        elif op in (b"\x85", b"\x86", b"\x87"):  # TUPLE1..3
            n = op[0] - 0x84
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
            stack[-1][k] = v
        elif op == b"u":  # SETITEMS
            items = pop_mark()
            stack[-1].update(zip(items[::2], items[1::2]))
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
            if state not in (None, {}, ()):
                raise ValueError(f"{name}: unexpected object state in the pickle")
        else:
            raise ValueError(f"{name}: pickle opcode {op!r} is not one torch.save writes for tensors")


def read_torch_file(path: str):
    """The tensors (as NumPy arrays) and containers of a ``torch.save`` zip archive."""
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise ValueError(f"{path}: not a torch zip archive (torch.save before 1.6 wrote another format; "
                         f"re-save it with a recent torch)") from None
    with archive:
        pkl = [n for n in archive.namelist() if n.endswith("data.pkl")]
        if len(pkl) != 1:
            raise ValueError(f"{path}: a torch archive has one data.pkl; found {len(pkl)}")
        prefix = pkl[0][: -len("data.pkl")]
        order = f"{prefix}byteorder"
        if order in archive.namelist() and archive.read(order).strip() != b"little":
            raise ValueError(f"{path}: big-endian tensors are not read")

        def storage(key, dtype, numel):
            arr = np.frombuffer(archive.read(f"{prefix}data/{key}"), dtype)
            if arr.size < numel:
                raise ValueError(f"{path}: storage {key} holds {arr.size} values, not {numel}")
            return arr[:numel]

        return _unpickle(archive.read(pkl[0]), storage, path)
