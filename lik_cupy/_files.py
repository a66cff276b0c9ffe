"""Input files as the operating system sees them: what a path is, and what went wrong, in words.

Every input the package reads (``.npy`` arrays, lengths, manifests, PLAID index files) is
first judged here by ``stat``: anything but a regular file (a FIFO, ``/dev/zero``, a socket, a
directory) is refused without being opened. A regular file is then opened with ``O_NONBLOCK``
and judged again by ``fstat``, so that a FIFO renamed into its place in between is refused at
once instead of blocking until some writer appears. Failures become a :class:`ShardError`
naming the path and saying what the error was (no such file, permission denied, a name too
long, ...) rather than a guess: a file that cannot be seen for lack of permission is not
reported as missing.

The checked readers of ``.npy`` arrays (:func:`open_npy`) and of per-document lengths
(:func:`read_lengths`) that shards and PLAID indexes share are here too.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import stat
import tokenize

import numpy as np

from .errors import ShardError

# What each errno means for a path, said the way the CLI's one-line errors say things.
_PROBLEMS = {
    errno.ENOENT: "no such file",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOTDIR: "a component of the path is not a directory",
    errno.ENAMETOOLONG: "file name too long",
    errno.ELOOP: "too many levels of symbolic links",
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large for the file system or the file size limit (ulimit -f)",
    errno.EROFS: "read-only file system",
    errno.EISDIR: "is a directory",
    errno.EEXIST: "already exists",
    errno.EIO: "input/output error",
    errno.EMFILE: "too many open files (the process's limit, ulimit -n, is too low for this many inputs)",
}


def problem(e: OSError) -> str:
    """What ``e`` says about its path, in words, without the errno number.

    An OSError this package raised with a message of its own (a ``strerror`` that is not
    the system's) keeps that message.
    """
    if e.errno is None or (e.strerror and e.strerror != os.strerror(e.errno)):
        return e.strerror or str(e)
    words = _PROBLEMS.get(e.errno, (e.strerror or str(e)).lower())
    if e.errno == errno.ENAMETOOLONG and e.filename is not None:
        path = os.fspath(e.filename)
        limit = name_max(os.path.dirname(path))
        if len(os.fsencode(os.path.basename(path))) > limit:
            words += f" (a name may hold at most {limit} bytes)"
    return words


def name_max(directory: str) -> int:
    """The longest file name, in bytes, ``directory``'s file system takes (255 where it does not say)."""
    try:
        return int(os.pathconf(directory or ".", "PC_NAME_MAX"))
    except (OSError, ValueError, AttributeError):
        return 255


def kind(mode: int) -> str:
    """What a file of this ``st_mode`` is, with its article ("a FIFO")."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "not a regular file"


@contextlib.contextmanager
def open_regular(path: str, expected: str):
    """Open ``path`` for reading and yield a binary file object, if it is a regular file.

    ``expected`` names what the path should be ("a .npy file") in the error. Raises
    ShardError naming the path for a missing file, a special file, a directory, or any
    other OSError (permission denied, ...). A special file is judged by ``stat`` and never
    opened (opening some devices acts); what is opened is judged again by ``fstat``, in case
    another file took the name in between.
    """
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise ShardError(path, f"is {kind(mode)}, expected {expected}")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno == errno.EISDIR:  # some systems refuse to open a directory at all
            raise ShardError(path, f"is a directory, expected {expected}") from None
        raise ShardError(path, problem(e)) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ShardError(path, f"is {kind(mode)}, expected {expected}")
        os.set_blocking(fd, True)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        try:
            yield f
        except OSError as e:  # a read that failed part way (EIO, a file on a vanished mount)
            raise ShardError(path, f"cannot read: {problem(e)}") from None


def read_regular(path: str, expected: str, limit: int | None = None) -> bytes:
    """The bytes of a regular file (see :func:`open_regular`); ShardError if it holds more than ``limit``."""
    with open_regular(path, expected) as f:
        data = f.read() if limit is None else f.read(limit + 1)
    if limit is not None and len(data) > limit:
        raise ShardError(path, f"larger than {limit} bytes; expected {expected}")
    return data


def read_json(path: str, invalid: str, expected: str, limit: int | None = None):
    """The JSON value in a regular file (UTF-8). ShardError naming the file, ``invalid`` and why for
    anything that is not one: bad syntax or encoding, nesting too deep for the parser, an integer
    too long to convert; for a special file, or more than ``limit`` bytes, naming ``expected``."""
    data = read_regular(path, expected, limit)
    try:
        return json.loads(data.decode("utf-8"))
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, int digits over the limit
        raise ShardError(path, f"{invalid} ({e})") from None
    except RecursionError:
        raise ShardError(path, f"{invalid} (nested too deeply to read)") from None


def file_kind(path: str) -> str | None:
    """What ``path`` is (see :func:`kind`), following symbolic links; None if nothing is there.

    Any other failure to look (permission denied on a directory above it, ...) is a
    ShardError naming the path.
    """
    try:
        return kind(os.stat(path).st_mode)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ShardError(path, problem(e)) from None


# --------------------------------------------------------------------------- .npy arrays and lengths

_NPY_MAGIC = b"\x93NUMPY"
_NPY_MAX_HEADER = 10_000  # NumPy's own limit on a header it parses (numpy.save writes ~128 bytes)


def open_npy(path: str | os.PathLike) -> np.ndarray:
    """Open one ``.npy`` file memory-mapped, read-only, never unpickling.

    Returns a ``numpy.memmap`` of the file's shape and dtype. Raises ShardError for a
    missing, unreadable, empty, truncated or corrupt file, a special file (a FIFO, a
    device) or a directory, a header whose shape no file could hold, a ``.npz``
    archive, object data, a header holding what numpy.save never writes and Python would warn
    about when NumPy parses it (a name such as ``if``, a backslash escape), or format version
    3.0 (structured dtypes with non-Latin-1 field names, which no embedding, length or id array
    has). The file checked is the file mapped: one descriptor, so a FIFO swapped in after the check is never opened.
    """
    path = os.fspath(path)
    with open_regular(path, "a .npy file") as f:
        magic = f.read(len(_NPY_MAGIC))
        if not magic:
            raise ShardError(path, "empty file, expected a .npy array")
        if magic[:2] == b"PK":
            raise ShardError(path, "is a .npz archive; save each array with numpy.save as its own .npy")
        if magic != _NPY_MAGIC:
            raise ShardError(path, "not a .npy file (bad magic bytes); write it with numpy.save")
        f.seek(0)
        try:
            shape, fortran, dtype = check_npy_header(path, f)
            return np.memmap(f, dtype=dtype, mode="r", shape=shape, order="F" if fortran else "C", offset=f.tell())
        except ShardError:
            raise
        except (ValueError, OSError, EOFError, SyntaxError, TypeError, tokenize.TokenError, RecursionError) as e:
            raise ShardError(path, npy_problem(e)) from None


def check_npy_header(path: str, f) -> tuple[tuple[int, ...], bool, np.dtype]:
    """The header's (shape, fortran order, dtype), leaving ``f`` at the data. Refuses a header
    whose shape is negative, needs more than 2**63 bytes (NumPy's own size arithmetic would
    overflow) or more bytes than the file holds, before anything is mapped."""
    version = np.lib.format.read_magic(f)
    if version in ((1, 0), (2, 0)):  # NumPy reads the length it is given before checking it: check it first
        size = 2 if version == (1, 0) else 4
        raw = f.read(size)
        length = int.from_bytes(raw, "little") if len(raw) == size else 0
        left = os.fstat(f.fileno()).st_size - f.tell()
        if length > min(_NPY_MAX_HEADER, left):
            why = "more than the file holds" if length > left else f"past NumPy's limit of {_NPY_MAX_HEADER:,}"
            raise ShardError(path, f"corrupt .npy header: it claims {length:,} bytes of header, {why}")
        _check_header_text(path, f.read(length).decode("latin-1"))
        f.seek(-len(raw) - length, os.SEEK_CUR)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    else:
        raise ShardError(path, f".npy format version {version[0]}.{version[1]} is not read; expected 1.0 or 2.0 "
                               "(numpy.save writes them for every numeric or string array)")
    if dtype.hasobject:
        raise ShardError(path, "holds Python objects (object dtype); only numeric and fixed-width string arrays are read")
    if any(n < 0 for n in shape):
        raise ShardError(path, f"header's shape {shape} has a negative dimension")
    room = max(dtype.itemsize, 1)
    for n in shape:
        room *= max(n, 1)
    if room >= 2**63:
        raise ShardError(path, f"header's shape {shape} of {dtype} would take more than 2**63 bytes; no array is that large")
    need = math.prod(shape) * dtype.itemsize
    have = os.fstat(f.fileno()).st_size - f.tell()
    if need > have:
        raise ShardError(path, f"truncated .npy file: it holds fewer bytes than its header's shape needs "
                               f"({shape} {dtype}: {need:,} bytes of data, {max(have, 0):,} in the file)")
    return shape, fortran, dtype


# Names a header of numpy.save holds (True, False; L after a number in a header written by Python 2).
_NPY_HEADER_NAMES = {"True", "False", "L"}


def _check_header_text(path: str, text: str) -> None:
    """Refuse a .npy header that NumPy's parser (Python's, ``ast.literal_eval``) would warn about on
    stderr before failing or reading it: a backslash escape in a string, or a name such as ``if``
    (``4if`` is an "invalid decimal literal"), neither of which a header numpy.save writes holds.
    A header that does not tokenize is judged by the tokens before the failure (Python still
    warns about those), then left to NumPy's own error."""
    tokens = []
    with contextlib.suppress(tokenize.TokenError, SyntaxError):
        for t in tokenize.generate_tokens(io.StringIO(text).readline):
            tokens.append(t)
    for t in tokens:
        if t.type == tokenize.STRING and "\\" in t.string:
            raise ShardError(path, f"corrupt .npy header: it holds a backslash in the string {t.string[:40]!r}; "
                                   "numpy.save writes none in the headers of the arrays read here")
        if t.type == tokenize.NAME and t.string not in _NPY_HEADER_NAMES:
            raise ShardError(path, f"corrupt .npy header: it holds the name {t.string[:40]!r}; numpy.save writes "
                                   "a dict of strings, integers and True / False")


def npy_problem(e: BaseException) -> str:
    """What an error of NumPy's .npy reader says about the file."""
    msg = str(e)
    if isinstance(e, RecursionError):  # a header of thousands of nested operators, which NumPy parses as Python
        return "corrupt .npy header (nested too deeply to read)"
    if "mmap length is greater than file size" in msg or "cannot reshape" in msg:
        return "truncated .npy file: it holds fewer bytes than its header's shape needs"
    if "EOF" in msg:
        return f"truncated .npy header ({msg})"
    if "allow_pickle" in msg:  # (object dtypes are refused before NumPy reads data; an AST's "object" is no data)
        return "holds Python objects (object dtype); only numeric and fixed-width string arrays are read"
    if isinstance(e, OSError):
        return f"cannot read: {problem(e)}"
    if isinstance(e, ValueError):
        return f"corrupt .npy file ({msg})"
    return f"corrupt .npy file ({type(e).__name__}: {msg})"  # TokenError: an unbalanced header


def read_lengths(path: str | os.PathLike) -> np.ndarray:
    """Per-document token counts from a ``.npy`` integer array or a JSON list (ColBERT's ``doclens.*.json``).

    Returns int64 ``[N]``, every value >= 0. A JSON list is read in memory of its file's bytes,
    the result's 8 bytes a value and a fixed few MiB (:func:`_json_lengths`): at most 5 times
    the file's size, and 4 MiB.
    """
    path = os.fspath(path)
    if path.lower().endswith(".json"):
        arr = _json_lengths(read_regular(path, "a JSON list of integers (one token count per document)"), path)
    else:
        raw = open_npy(path)
        if raw.dtype.kind not in "iu":
            raise ShardError(path, f"lengths must be integers, got dtype {raw.dtype}")
        if raw.ndim != 1:
            raise ShardError(path, f"lengths must be 1-D [N], got shape {raw.shape}")
        if raw.dtype.kind == "u" and raw.size and int(raw.max()) >= 2**63:
            raise ShardError(path, f"length {int(raw.max())} does not fit int64; expected a token count")
        arr = np.asarray(raw, dtype=np.int64)
    if arr.size and arr.min() < 0:
        i = int(np.argmax(arr < 0))
        raise ShardError(path, f"length {int(arr[i])} at index {i} is negative")
    return arr


# --------------------------------------------------------------------------- JSON lists of integers

# A doclens.*.json is parsed here, a block of bytes at a time with NumPy, not by the json module:
# its Python ints took 28 to 36 bytes a value (5 to 11 times the file's bytes at the peak).
_BLOCK = 1 << 15  # bytes classified at once: the parse's own arrays stay within a few MiB
_WS, _DIGIT, _MINUS, _COMMA = 1, 2, 3, 4  # the bytes a list of integers holds inside its brackets; 0: any other
_CLASS = np.zeros(256, np.uint8)
_CLASS[np.frombuffer(b" \t\n\r", np.uint8)] = _WS  # JSON's whitespace, no other
_CLASS[ord("0"):ord("9") + 1] = _DIGIT
_CLASS[ord("-")] = _MINUS
_CLASS[ord(",")] = _COMMA
_POW10 = 10 ** np.arange(19, dtype=np.uint64)
_MAX_CARRY = 64  # characters of one value kept across blocks (int64 takes 20: '-' and 19 digits)
_LIST_OF_INTEGERS = "not a JSON list of integers (one token count per document)"


def _json_lengths(data: bytes, path: str) -> np.ndarray:
    """The values of ``data``, a JSON list of integers (RFC 8259: ``[``, integers without a
    fraction, an exponent or leading zeros, separated by ``,``, then ``]``; whitespace around
    each), as int64 ``[N]``, every one >= 0: what ``json.loads`` reads as a list of such
    integers, and nothing else (a ShardError naming ``path`` says what and where).

    The result is allocated once, from the count of commas; the rest is a few arrays of one block
    of the file (``_BLOCK``) at a time, and values too long for int64 are refused as they come."""
    u = np.frombuffer(data, np.uint8)
    first, last = _edge(u, forward=True), _edge(u, forward=False)  # the first and last bytes not whitespace
    if first is None:
        raise ShardError(path, f"{_LIST_OF_INTEGERS}; the file is empty or whitespace")
    if data[first] != ord("[") or data[last] != ord("]") or last == first:
        raise ShardError(path, f"{_LIST_OF_INTEGERS}; it does not begin with '[' and end with ']'")
    values = _Values(np.empty(data.count(b",", first + 1, last) + 1, np.int64), path)
    for start in range(first + 1, last, _BLOCK):
        values.feed(u[start:min(start + _BLOCK, last)], start)
    return values.finish()


def _edge(u: np.ndarray, forward: bool) -> int | None:
    """The index of ``u``'s first (``forward``) or last byte that is not JSON whitespace, or None."""
    starts = range(0, u.size, _BLOCK) if forward else range((u.size - 1) // _BLOCK * _BLOCK, -1, -_BLOCK)
    for s in starts:
        kept = np.flatnonzero(_CLASS[u[s:s + _BLOCK]] != _WS)
        if kept.size:
            return s + int(kept[0] if forward else kept[-1])
    return None


class _Values:
    """The values between a JSON list's brackets, fed a block of bytes at a time into ``out``."""

    def __init__(self, out: np.ndarray, path: str):
        self.out, self.path, self.n = out, path, 0
        self.carry = np.zeros(0, np.uint8)  # the characters of a value the last block cut
        self.in_value = False  # whether the last character that is not whitespace was part of a value
        self.spaced = False  # whether whitespace has come since then
        self.seen = False  # whether anything but whitespace has come

    def fail(self, index: int, what: str):
        raise ShardError(self.path, f"{_LIST_OF_INTEGERS}; value {index} {what}")

    def feed(self, block: np.ndarray, offset: int) -> None:
        cls = _CLASS[block]
        other = np.flatnonzero(cls == 0)
        if other.size:
            c = int(block[other[0]])
            what = repr(chr(c)) if 0x20 <= c < 0x7F else f"the byte 0x{c:02x}"
            raise ShardError(self.path, f"{_LIST_OF_INTEGERS}; found {what} at byte {offset + int(other[0])}")
        kept = np.flatnonzero(cls != _WS)
        if not kept.size:
            self.spaced = self.spaced or bool(block.size)
            return
        self.seen = True
        kcls = cls[kept]
        part = kcls != _COMMA  # a digit or '-': part of a value
        spaced = np.empty(kept.size, bool)  # whitespace just before
        spaced[0], spaced[1:] = kept[0] > 0 or self.spaced, np.diff(kept) > 1
        after = np.empty(kept.size, bool)  # the character before (whitespace aside) is part of a value
        after[0], after[1:] = self.in_value, part[:-1]
        split = np.flatnonzero(spaced & part & after)
        if split.size:
            self.fail(self.n + np.count_nonzero(kcls[:split[0]] == _COMMA), "has whitespace inside it")
        self.in_value, self.spaced = bool(part[-1]), bool(kept[-1] < block.size - 1)
        chars = block[kept]
        pending = np.concatenate((self.carry, chars)) if self.carry.size else chars
        commas = np.flatnonzero(pending == ord(","))
        if commas.size:
            self._values(pending[:commas[-1] + 1])
            pending = pending[commas[-1] + 1:]
        if pending.size > _MAX_CARRY:
            raise ShardError(self.path, f"length of more than {_MAX_CARRY - 1} digits at index {self.n} does not fit "
                                        f"int64; expected a token count")
        self.carry = pending.copy()

    def finish(self) -> np.ndarray:
        if not self.seen and self.out.size == 1:
            return np.zeros(0, np.int64)  # []
        self._values(np.concatenate((self.carry, np.array([ord(",")], np.uint8))))
        return self.out

    def _values(self, seg: np.ndarray) -> None:
        """Write the values of ``seg``: characters of values, each ended by ','."""
        ends = np.flatnonzero(seg == ord(","))
        starts = np.empty_like(ends)
        starts[0], starts[1:] = 0, ends[:-1] + 1
        n = self.n
        empty = np.flatnonzero(ends == starts)
        if empty.size:
            self.fail(n + int(empty[0]), "is empty (a ',' next to another one, to '[' or to ']')")
        neg = seg[starts] == ord("-")
        minus = np.flatnonzero(seg == ord("-"))
        if minus.size != np.count_nonzero(neg):
            inner = minus[np.isin(minus, starts, invert=True)][0]
            self.fail(n + int(np.searchsorted(ends, inner)), "has a '-' inside it")
        first = starts + neg  # each value's first digit
        digits = ends - first
        for bad, what in ((digits == 0, "is a '-' without digits"),
                          ((seg[first] == ord("0")) & (digits > 1), "has a leading zero (JSON writes none)")):
            if bad.any():
                self.fail(n + int(np.argmax(bad)), what)
        if (digits > 19).any():
            self._too_big(seg, starts, ends, int(np.argmax(digits > 19)))
        at = np.flatnonzero(seg >= ord("0"))  # the digits, value by value (',' and '-' sort below '0')
        place = np.repeat(ends - 1, digits) - at  # each digit's power of ten
        vals = np.add.reduceat((seg[at] - ord("0")).astype(np.uint64) * _POW10[place], np.cumsum(digits) - digits)
        top = np.uint64(1 << 63)
        big = (vals > top) | ((vals == top) & ~neg)
        if big.any():
            self._too_big(seg, starts, ends, int(np.argmax(big)))
        below = neg & (vals > 0)
        if below.any():
            k = int(np.argmax(below))
            raise ShardError(self.path, f"length {self._text(seg, starts, ends, k)} at index {n + k} is negative")
        self.out[n:n + ends.size] = vals.astype(np.int64)
        self.n = n + ends.size

    def _too_big(self, seg, starts, ends, k: int):
        text = self._text(seg, starts, ends, k)
        if len(text) > 40:
            text = f"of {len(text.lstrip('-'))} digits"
        raise ShardError(self.path, f"length {text} at index {self.n + k} does not fit int64; expected a token count")

    @staticmethod
    def _text(seg, starts, ends, k: int) -> str:
        return seg[starts[k]:ends[k]].tobytes().decode("ascii")
