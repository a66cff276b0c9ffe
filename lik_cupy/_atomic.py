"""Outputs that are complete or absent: every file and directory the package writes goes through here.

Whatever happens during a write (the disk fills up, the process is interrupted or killed,
another process writes the same target), an existing file is never corrupted, nothing is
deleted but what this write replaces, and no partial result is left under the target's
name. How:

* **Temporary name.** The output is built under a temporary name in the target's own
  directory, ``.<target>.lik-tmp.<pid>.<host>.<random>``: ``<target>`` is the target's
  name (cut, in bytes, so that the whole name fits the file system's NAME_MAX, and then
  ending in a hash of the whole name, so that two cut names never meet), ``<pid>`` the
  writing process, ``<host>`` 8 hex digits of a hash of the host name, the boot and the pid
  namespace (its pids mean nothing in another: containers sharing a volume may share a host
  name), ``<random>`` 8 hex digits. A write that fails or is interrupted removes its
  temporary itself.
* **Killed writers.** A process killed outright (SIGKILL, the OOM killer) cannot clean up;
  its temporary stays behind. Every later write into the same directory first *sweeps*
  (``lik score`` and ``shards.pack`` call :func:`sweep` before they check their target):
  it removes each entry whose name has exactly the pattern above, whose host is this host
  and whose process is gone (``kill(pid, 0)`` fails with ESRCH). Nothing else is ever
  removed: not other programs' files, not the temporaries of live writers, not those of
  another host sharing the directory (NFS). A pid reused by a new process keeps its dead
  temporary until that process ends too; one left by a previous boot, or by a container
  since restarted in a new pid namespace, is never swept (its pids cannot be told from a live
  writer's in another namespace): remove such hidden ``.lik-tmp.`` names by hand.
  ``O_TMPFILE`` (a file that vanishes with its process) is not used because a shard is a
  directory, which it cannot make; one scheme serves both kinds of output.
* **Space up front.** Where the size is known (the full score matrix, a shard's token
  and scale arrays), the file is allocated with ``posix_fallocate`` before any work, so a
  disk too small fails at once, naming the bytes needed and free. Data is then written
  with plain writes, never through a writable memory map: a write that meets a full disk
  raises ENOSPC instead of killing the process with SIGBUS, and the temporary is removed.
* **No clobbering.** The finished output is renamed onto the target with ``renameat2``
  (``RENAME_NOREPLACE``), which fails if anything appeared there during the run. What is
  there is then judged by the caller's ``replace`` rule (a regular file for a score
  result; for ``pack --force``, a lik shard holding only its own files). If it may be
  replaced, the two are swapped atomically (``RENAME_EXCHANGE``), the swapped-out one is
  judged again (in case it changed in between) and deleted, or swapped back and the write
  fails. Where ``renameat2`` or its flags are missing (non-Linux systems, NFS and some
  FUSE file systems), the same judging and renames run under an exclusive ``flock`` on
  ``.<target>.lik-lock`` in the same directory, which every lik process takes: lik
  processes cannot race each other, and a directory being replaced is moved aside as
  ``<temporary name>.old`` for the moment between its two renames; should the process be
  killed in that moment, the next write of the same target moves it back.

Not covered: power loss (nothing is fsync'ed) and other programs that rename into the
target's place in the microseconds between a judgement and its rename.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import secrets
import shutil
import socket
import zlib
from collections.abc import Callable, Iterator

from . import _files

_TAG = b".lik-tmp."


def _where_pids_mean() -> bytes:
    """8 hex digits naming the pid space this process's pids live in: the host name, and on
    Linux the boot and the pid namespace."""
    parts = [socket.gethostname().encode()]
    with contextlib.suppress(OSError):
        parts.append(b"%d" % os.stat("/proc/self/ns/pid").st_ino)
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            parts.append(f.read(64).strip())
    return f"{zlib.crc32(b'/'.join(parts)):08x}".encode()


_HOST = _where_pids_mean()
# .<target>.lik-tmp.<pid>.<host>.<random>[.old]: only names of exactly this shape are ever swept.
_PATTERN = re.compile(rb"\A\..*\.lik-tmp\.([0-9]{1,10})\.([0-9a-f]{8})\.[0-9a-f]{8}(\.old)?\Z", re.S)
_SUFFIX_BYTES = 10 + 1 + 8 + 1 + 8 + 4  # <pid>.<host>.<random>.old, at most
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_SHORT_WRITE = re.compile(r"\A\d+ requested and \d+ written\Z")  # ndarray.tofile's words for a short write
_AT_FDCWD = -100
# Errors of renameat2 and posix_fallocate meaning "not on this system or file system".
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}

# A judge of what is at a target: None if it may be replaced, else why not.
Judge = Callable[[str], "str | None"]


def _load_renameat2():
    """libc's renameat2 (glibc >= 2.28), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError, TypeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _load_renameat2()


class _Unsupported(Exception):
    """renameat2 or the flag asked for is missing here."""


def _rename2(src: str, dst: str, flags: int) -> bool:
    """renameat2(src, dst, flags); False where it failed with EEXIST (NOREPLACE) or ENOENT (EXCHANGE
    and ``dst`` vanished), _Unsupported where the system or file system lacks it."""
    if _RENAMEAT2 is None:
        raise _Unsupported
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        raise _Unsupported
    if err in (errno.EEXIST, errno.ENOTEMPTY) and flags == _RENAME_NOREPLACE:
        return False
    if err == errno.ENOENT and flags == _RENAME_EXCHANGE and os.path.lexists(src):
        return False
    raise OSError(err, os.strerror(err), dst)


# --------------------------------------------------------------------------- names


def _split(target: str) -> tuple[str, bytes]:
    """The target's directory and its name in bytes."""
    directory, name = os.path.split(os.path.abspath(target))
    return directory, os.fsencode(name)


def _prefix(target: str) -> bytes:
    """``.<target>.lik-tmp.`` with the name cut so that every temporary name fits NAME_MAX; a cut
    name ends in ``~`` and a hash of the whole name (another target sharing the cut part once had
    its set-aside directory moved onto this one by :func:`sweep`)."""
    directory, name = _split(target)
    room = _files.name_max(directory) - 1 - len(_TAG) - _SUFFIX_BYTES
    if len(name) > room:
        name = name[: max(1, room - 9)] + b"~%08x" % zlib.crc32(name)
    return b"." + name + _TAG


def _temp_path(target: str, old: bool = False) -> str:
    directory, _ = _split(target)
    name = _prefix(target) + b"%d.%s.%s" % (os.getpid(), _HOST, secrets.token_hex(4).encode())
    return os.path.join(directory, os.fsdecode(name + (b".old" if old else b"")))


def _create(target: str, make: Callable[[str], object]):
    """Make a fresh temporary beside ``target`` with ``make(path)``; returns (path, what make returned)."""
    for _ in range(100):
        path = _temp_path(target)
        try:
            return path, make(path)
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name beside it", target)


# --------------------------------------------------------------------------- sweeping


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OverflowError, OSError):
        return True  # someone else's process (EPERM), or no answer: keep its files
    return True


def _remove(path: str) -> None:
    """Remove a file or a whole directory tree of this package's own making; errors are ignored
    (a sweeper running at the same moment, a permission taken away)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _discard(replaced: str, target: str, put_back: Callable[[], str | None]) -> None:
    """Remove ``replaced``, what a write moved out of ``target``. When it cannot be removed (a
    permission its judge could not foresee), ``put_back()`` returns it to ``target`` and gives the
    path this write's output then has (removed here), or None where it could not; then raise,
    naming ``target``."""
    try:
        if os.path.isdir(replaced) and not os.path.islink(replaced):
            shutil.rmtree(replaced)
        else:
            os.unlink(replaced)
    except OSError as e:
        ours = put_back()
        if ours is not None:
            _remove(ours)
        raise OSError(e.errno, f"what was there could not be removed ({_files.problem(e)})"
                      + ("; it was put back" if ours is not None else ""), target) from None


def sweep(target: str) -> None:
    """Remove the temporaries that killed writers left in ``target``'s directory (see the module docstring).

    A directory moved aside for ``target`` itself (``.old``) is moved back when ``target`` is
    missing, else removed; those of other targets are left for their own next write. A
    directory that cannot be listed is not swept.
    """
    directory, _ = _split(target)
    own = _prefix(target)
    try:
        with os.scandir(os.fsencode(directory)) as it:
            entries = [(e.name, e.path) for e in it]
    except OSError:
        return
    for name, path in entries:
        m = _PATTERN.match(name)
        if m is None or m.group(2) != _HOST or _alive(int(m.group(1))):
            continue
        path = os.fsdecode(path)
        if not m.group(3):
            _remove(path)
        elif name.startswith(own):
            if os.path.lexists(target):
                _remove(path)
            else:
                with contextlib.suppress(OSError):
                    os.rename(path, target)


# --------------------------------------------------------------------------- committing


@contextlib.contextmanager
def _lock(target: str) -> Iterator[None]:
    """An exclusive flock on ``.<target>.lik-lock``, removed again when released.

    The lock file is unlinked while still held; a process that locked it in the meantime
    finds it no longer linked and locks the new one, so two processes never both hold it.
    """
    import fcntl  # POSIX only: imported here, where the fallback needs it

    directory, _ = _split(target)
    path = os.path.join(directory, os.fsdecode(_prefix(target)[: -len(_TAG)] + b".lik-lock"))
    # Not through a symbolic link: one planted under the lock's name would have the open create (or
    # truncate nothing, but create) a file wherever it points; ELOOP refuses it instead.
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    while True:
        fd = os.open(path, flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                linked = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                linked = False
            if linked:
                try:
                    yield
                finally:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                return
        finally:
            os.close(fd)


def _commit(tmp: str, target: str, replace: Judge | None, swapped: list) -> None:
    """Rename the finished ``tmp`` onto ``target``: see "No clobbering" in the module docstring.

    ``swapped[0]`` is True while ``tmp`` holds what was swapped out of ``target`` (then it
    is not this write's to delete on failure: the caller leaves it for the sweep).
    """
    try:
        for _ in range(100):  # another turn when what was at the target vanished meanwhile
            if _rename2(tmp, target, _RENAME_NOREPLACE):
                return
            _judge(target, replace)
            if not _rename2(tmp, target, _RENAME_EXCHANGE):
                continue
            swapped[0] = True
            why = replace(tmp)  # what was swapped out, judged again now that no one can change it
            if why is not None:
                if _rename2(tmp, target, _RENAME_EXCHANGE) or _rename2(tmp, target, _RENAME_NOREPLACE):
                    swapped[0] = False
                raise FileExistsError(errno.EEXIST, why, target)
            swapped[0] = False
            _discard(tmp, target, lambda: tmp if _rename2(tmp, target, _RENAME_EXCHANGE) else None)
            return
        raise FileExistsError(errno.EEXIST, "keeps changing while being replaced; nothing was replaced", target)
    except _Unsupported:
        pass
    with _lock(target):
        if not os.path.lexists(target):
            os.rename(tmp, target)
            return
        _judge(target, replace)
        if os.path.isdir(tmp):
            aside = _temp_path(target, old=True)
            os.rename(target, aside)
            try:
                os.rename(tmp, target)
            except BaseException:
                os.rename(aside, target)
                raise

            def put_back() -> str:
                os.rename(target, tmp)
                os.rename(aside, target)
                return tmp

            _discard(aside, target, put_back)
        else:
            os.replace(tmp, target)


def _judge(target: str, replace: Judge | None) -> None:
    why = ("appeared while this run was writing it; nothing was replaced" if replace is None
           else replace(target))
    if why is not None:
        raise FileExistsError(errno.EEXIST, why, target)


# --------------------------------------------------------------------------- writing


def allocate(f, size: int, target: str) -> None:
    """Reserve ``size`` bytes for the open file ``f`` now, so that a disk too small fails here.

    OSError naming ``target`` (no space left, the bytes needed and free). Where the file
    system cannot preallocate, nothing is reserved: plain writes still fail cleanly.
    """
    if size <= 0 or not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(f.fileno(), 0, size)
    except OSError as e:
        if e.errno in _UNSUPPORTED:  # this file system does not preallocate
            return
        words = _files.problem(e)
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            words += f": the output needs {size:,} bytes"
        if e.errno == errno.ENOSPC:
            with contextlib.suppress(OSError):
                st = os.statvfs(_split(target)[0])
                words += f", {st.f_bavail * st.f_frsize:,} are free"
        raise OSError(e.errno, words, target) from None


def check_name(target: str) -> None:
    """OSError naming ``target`` if it names no entry of its own (EINVAL: it is empty or ends in
    ``.`` or ``..``, so its temporary would go beside the directory it resolves to and the final
    rename fail) or its name is longer than its file system takes (ENAMETOOLONG): found before
    any work rather than at the final rename."""
    last = os.path.basename(os.fspath(target).rstrip(os.sep + (os.altsep or "")))
    if last in ("", ".", ".."):
        raise OSError(errno.EINVAL, "names no file or directory of its own (it is empty or ends in '.' or '..'); "
                                    "give the name of the one to create", target)
    directory, name = _split(target)
    if len(name) > _files.name_max(directory):
        raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG), target)


@contextlib.contextmanager
def _written(target: str, tmp: str, replace: Judge | None, cleanup: Callable[[], None]):
    """Commit ``tmp`` after the block; on any error or interrupt clean it up (unless it holds what
    was swapped out of the target) and raise, naming the target rather than the temporary."""
    swapped = [False]
    try:
        yield
        _commit(tmp, target, replace, swapped)
    except BaseException as e:
        if not swapped[0]:
            cleanup()
        if isinstance(e, OSError) and e.errno is not None and (e.filename is None or os.fspath(e.filename).startswith(tmp)):
            raise OSError(e.errno, e.strerror, target) from e
        if isinstance(e, OSError) and e.errno is None and _SHORT_WRITE.search(str(e)):
            # NumPy's tofile (np.save's path) reports a write the disk cut short with no errno.
            raise OSError(errno.ENOSPC, f"no space left on device (a write was cut short: {e})", target) from e
        raise


@contextlib.contextmanager
def output_file(target: str, replace: Judge):
    """Yield a binary file open for writing; when the block ends without error it becomes ``target``.

    ``replace`` judges what is at ``target`` when the file is committed. On any error or
    interrupt the temporary is removed and the error raised (OSErrors about the temporary
    name the target instead). The file gets the usual permissions (0666 less the umask).
    A caller that knows the size reserves it (:func:`allocate`); callers :func:`sweep`
    first, before they look at what is at ``target``.
    """
    check_name(target)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    tmp, fd = _create(target, lambda p: os.open(p, flags, 0o666))

    def unlink():
        with contextlib.suppress(OSError):
            os.unlink(tmp)

    with _written(target, tmp, replace, unlink):
        with open(fd, "wb") as f:
            yield f


@contextlib.contextmanager
def output_dir(target: str, replace: Judge | None):
    """Yield the path of a new empty directory; when the block ends without error it becomes ``target``.

    ``replace``: None if nothing may be at ``target`` (whatever appeared there during the
    write makes it fail), else the judge of what may be replaced. Errors as in
    :func:`output_file`; the directory gets the usual permissions (0777 less the umask).
    """
    check_name(target)
    tmp, _ = _create(target, lambda p: os.mkdir(p, 0o777))
    with _written(target, tmp, replace, lambda: shutil.rmtree(tmp, ignore_errors=True)):
        yield tmp
