"""Input files as the operating system sees them: what a path is, and what went wrong, in words.

Every input the package reads (``.npy`` arrays, lengths, manifests, PLAID index files) is
first judged here by ``stat``: anything but a regular file (a FIFO, ``/dev/zero``, a socket, a
directory) is refused without being opened. A regular file is then opened with ``O_NONBLOCK``
and judged again by ``fstat``, so that a FIFO renamed into its place in between is refused at
once instead of blocking until some writer appears. Failures become a :class:`ShardError`
naming the path and saying what the error was (no such file, permission denied, a name too
long, ...) rather than a guess: a file that cannot be seen for lack of permission is not
reported as missing.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat

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
