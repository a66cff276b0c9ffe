"""The shard format's names and id rules, shared by the reader and writer (``lik_cupy.shards``,
whose docstring is the one description of the format), the CLI, the distributed corpus, and a
corpus of several shards (``Corpus.from_shards``, a serving partition)."""

from __future__ import annotations

import numpy as np

from .errors import ShardError

FORMAT = "lik-shard"
MANIFEST = "manifest.json"
TOKENS = "tokens.npy"
OFFSETS = "offsets.npy"
IDS = "ids.npy"
SCALES = "scales.npy"
DTYPES = ("float16", "float32", "bfloat16")  # embedding dtypes the library scores as they are
INT8 = "int8"
SHARD_DTYPES = (*DTYPES, INT8)  # what a shard may store


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype the library takes for a dtype name: bfloat16 is ``ml_dtypes.bfloat16``."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def plain(v):
    """A NumPy scalar as the Python value it holds (for messages)."""
    return v.item() if isinstance(v, np.generic) else v


def check_id_kinds(opened: list) -> None:
    """Shards (``lik_cupy.shards.Shard``) read as one corpus: every one has ids, of one kind
    (integer or string), or none has; else ValueError."""
    named = [s for s in opened if s.ids is not None]
    if named and len(named) != len(opened):
        bare = next(s for s in opened if s.ids is None)
        raise ValueError(f"{bare.path} has no ids but {named[0].path} has; give every shard ids.npy, or none")
    if named and len({s.ids.dtype.kind in "iu" for s in named}) > 1:
        raise ValueError("the shards mix integer and string ids; use one kind in every shard")


def joined_ids(opened: list) -> np.ndarray | None:
    """The ids of shards read as one corpus, in order (``check_id_kinds``), or None when none has
    ids; byte-string ids beside text ids are read as UTF-8, as ``lik score`` shows them."""
    check_id_kinds(opened)
    if not opened or opened[0].ids is None:
        return None
    ids = [np.asarray(s.ids) for s in opened]
    if {a.dtype.kind for a in ids} == {"S", "U"}:
        ids = [np.char.decode(a, "utf-8", errors="backslashreplace") if a.dtype.kind == "S" else a for a in ids]
    return np.concatenate(ids)


def _id_kind(t: type) -> str:
    for kind, types in (("a bool", (bool, np.bool_)), ("an integer", (int, np.integer)), ("a string", str),
                        ("a byte string", bytes)):  # (a bool is an int: asked first)
        if issubclass(t, types):
            return kind
    return f"a {t.__name__}"


def mixed_id_kinds(ids) -> str | None:
    """Where a list (or tuple) of ids holds more than one kind of id, the message saying so; else None
    (an array has one dtype). NumPy would make one kind of them: 1 beside "b" the string "1", True
    beside integers 1, bytes beside text that is no ASCII a "ragged" error."""
    if not isinstance(ids, (list, tuple)) or len({_id_kind(t) for t in {type(v) for v in ids}}) < 2:
        return None
    first = _id_kind(type(ids[0]))
    j, other = next((j, k) for j, k in ((j, _id_kind(type(v))) for j, v in enumerate(ids)) if k != first)
    return f"ids[0] is {first} but ids[{j}] is {other}: ids are all integers, all str or all bytes"


def check_ids(ids, n: int, name: str) -> np.ndarray:
    """Check document ids: ``[n]`` int64 or fixed-width strings.

    A string id may not hold a tab, a line break of any kind (what ``str.splitlines``
    splits at: LF, CR, VT, FF, FS, GS, RS, NEL, U+2028, U+2029) or a NUL: ids are written
    one result per line to TSV, and a reader must never see a line where none was meant.
    Accepts an array or a list (of one kind of id: ``mixed_id_kinds``); returns the ids as an array (a
    memmap stays one).
    """
    mixed = mixed_id_kinds(ids)
    if mixed:
        raise ShardError(name, mixed)
    ids = ids if isinstance(ids, np.ndarray) else np.asarray(ids)
    if ids.ndim != 1 or ids.shape[0] != n:
        raise ShardError(name, f"expected {n} ids (one per document), got shape {ids.shape}")
    if ids.dtype.kind in "iu":
        if ids.dtype != np.int64:
            if ids.size and ids.dtype.kind == "u" and int(ids.max()) >= 2**63:
                raise ShardError(name, "integer ids must fit int64")
            ids = ids.astype(np.int64)
        return ids
    if ids.dtype.kind not in "US":
        raise ShardError(name, f"ids must be int64 or fixed-width strings, got dtype {ids.dtype}")
    bad, breaks = _first_break(ids)
    if bad is not None and breaks:
        raise ShardError(name, f"id at index {bad} ({plain(ids[bad])!r}) holds a tab or line break (or a NUL); "
                               "ids are written one result per line to TSV")
    if bad is not None:
        raise ShardError(name, f"id at index {bad} ({plain(ids[bad])!r}) holds a code point that is no character "
                               "(a lone surrogate, or past U+10FFFF); ids are written as UTF-8")
    return ids


# Code points no id may hold (see check_ids); in UTF-8 bytes ids, NEL, U+2028 and U+2029 are
# the multi-byte sequences below.
_ID_BREAKS = np.array([0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x1C, 0x1D, 0x1E, 0x85, 0x2028, 0x2029], np.uint32)
_ID_BREAKS_UTF8 = (b"\xc2\x85", b"\xe2\x80\xa8", b"\xe2\x80\xa9")
_ID_BLOCK_BYTES = 8 << 20  # what checking a block of string ids holds at once: its copy and its masks
# Masks of a block's code units (one byte each) held at once while it is checked (_first_break),
# and bytes of flags an id (whether it holds a break, ...).
_ID_UNIT_MASKS = 4
_ID_FLAG_BYTES = 4


def _first_break(ids: np.ndarray) -> tuple[int | None, bool]:
    """Index of the first string id holding a character ``check_ids`` refuses (None: none), and
    whether it is a break (else, in str ids, a code point UTF-8 cannot write).

    Reads the ids block by block as their code units (a memmap is never loaded whole); a block
    holds its ids' copy, ``_ID_UNIT_MASKS`` boolean masks of their code units and a few flags an id
    at once, within ``_ID_BLOCK_BYTES``. A NUL counts only inside an id: NumPy pads fixed-width strings with NULs
    and drops them when read.
    """
    unicode = ids.dtype.kind == "U"
    width = ids.dtype.itemsize // 4 if unicode else ids.dtype.itemsize
    if width == 0:
        return None, False
    breaks = _ID_BREAKS if unicode else _ID_BREAKS[_ID_BREAKS < 0x80]
    step = max(1, _ID_BLOCK_BYTES // (ids.dtype.itemsize + width * _ID_UNIT_MASKS + _ID_FLAG_BYTES))
    for a in range(0, ids.shape[0], step):
        block = np.ascontiguousarray(ids[a : a + step]).astype(ids.dtype.newbyteorder("="))
        codes = block.view(np.uint32 if unicode else np.uint8).reshape(block.shape[0], width)
        hit = _holds_any(codes, breaks)
        used = codes != 0
        after = np.logical_or.accumulate(used[:, ::-1], axis=1)[:, ::-1]  # a code at or after this one
        np.logical_not(used, out=used)
        hit |= (used[:, :-1] & after[:, 1:]).any(axis=1)  # a NUL before a code
        del used, after
        if not unicode:
            for seq in _ID_BREAKS_UTF8:
                if width >= len(seq):
                    n = width - len(seq) + 1  # where the sequence may start
                    at = codes[:, :n] == seq[0]
                    for k in range(1, len(seq)):
                        at &= codes[:, k : k + n] == seq[k]
                    hit |= at.any(axis=1)
                    del at
            wild = hit & False
        else:
            wild = _holds_any(codes, (), lo=0xD800, hi=0xDFFF) | (codes > 0x10FFFF).any(axis=1)
        if hit.any() or wild.any():
            first = int(np.argmax(hit | wild))
            return a + first, bool(hit[first])
    return None, False


def _holds_any(codes: np.ndarray, values, lo: int | None = None, hi: int | None = None) -> np.ndarray:
    """bool ``[n]``: whether each row of ``codes [n, w]`` holds one of ``values`` (or, given ``lo`` and
    ``hi``, a code in ``lo..hi``), with two masks of ``codes`` held at once."""
    found = np.zeros(codes.shape, bool)
    for v in values:
        found |= codes == int(v)
    if lo is not None:
        within = codes >= lo
        within &= codes <= hi
        found |= within
        del within
    return found.any(axis=1)
