"""Run-time compilation of ``cuda_src/`` with NVRTC, and the kernel caches.

* NVRTC (through cuda-python) turns a kernel source plus its ``-D``
  configuration into a CUBIN for one architecture. This needs no GPU, so the
  same path serves the CPU-only compile check in CI. The source and every
  file it includes are read once (``kernel_sources``) and handed to NVRTC by
  name, so the bytes the key hashes are the bytes compiled: no header of the
  working directory, or one beside an including file, is looked up instead.
* The CUBIN is kept in an on-disk cache whose key covers the contents of the
  source and of every file it includes, the configuration, the NVRTC options,
  the architecture and NVRTC's build (its release with the patch level, as the
  PTX it writes names it). Entries are written atomically
  (``lik_cupy._atomic``: a killed compile's temporary is swept by the next write) and
  verified when read (their key and checksum; regular files only, of bounded
  size, so a FIFO, a device or a link to one never blocks or floods a read); an
  entry that fails is compiled again and replaced, never deleted, so a process
  never removes an entry another one has just written. The driver reads the
  verified entry by path; where that load fails because the entry was removed
  or changed after its check, the bytes that verified are loaded from a memory
  file of the process instead. Where the cache cannot be written (read-only,
  full, not a directory), kernels go to a directory of the process's own, and
  where that cannot be written either to memory files (one warning). A
  metadata write that fails after its CUBIN leaves that complete CUBIN, which
  verifies nothing until the next write of its key replaces it.
* The compile check (``check_all``) reads each build's ptxas report; under the
  same key it keeps only that report (``logs/``), so a later check compiles
  only what changed.
* Loaded modules (``cupy.RawModule``) are kept per device in a bounded
  in-memory cache. Compilation is serialised per key, so concurrent callers
  asking for the same kernel compile it once.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from .._base import env
from .._base.cache import DeviceCache
from .. import _atomic
from .._files import read_regular
from .kernels import FORWARD, SOURCES
from .._version import __version__
from ..errors import CompileError, ShardError

_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
# Every NVRTC option besides the architecture, the include path and the defines (part of the cache key).
_FLAGS = ("--std=c++17", "--ptxas-options=-v", "-lineinfo")
_MEMORY_CACHE_SIZE = 256
_MAX_CUBIN = 64 << 20  # bytes a cache entry's CUBIN may have (the largest build is well under 1 MB)
_MAX_META = 16 << 20  # its metadata's, with the ptxas log


def source_dir() -> Path:
    """Directory holding the ``.cu``/``.cuh`` sources (installed wheel or source tree)."""
    here = Path(__file__).resolve().parent
    for cand in (here.parent / "cuda_src", here.parent.parent / "cuda_src"):
        if (cand / FORWARD.file).is_file():
            return cand
    raise FileNotFoundError(f"kernel sources not found next to {here} (looked for cuda_src/{FORWARD.file})")


def cache_dir() -> Path:
    """On-disk kernel cache (``LIK_CACHE_DIR`` overrides the default; a leading ``~`` is the home
    directory, as no shell expands it in a .env file or a service's environment)."""
    override = env.cache_dir_override()
    if override:
        return Path(os.path.expanduser(override))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lik_cupy" / "kernels"


def kernel_sources(name: str) -> dict[str, bytes]:
    """``name`` and, recursively, every file it includes with ``#include "..."``, each read once:
    {its path as included (relative to :func:`source_dir`): its bytes}, ``name`` first. The key
    hashes these bytes and NVRTC compiles them, handed the headers by name (it then looks for
    none of them in the working directory or beside the including file)."""
    root = source_dir()
    files: dict[str, bytes] = {}

    def visit(rel: str) -> None:
        if rel in files:
            return
        path = root / rel
        if not path.is_file():
            raise FileNotFoundError(f"{rel} (included from the kernel sources) is missing in {root}")
        files[rel] = text = path.read_bytes()
        for inc in _INCLUDE.findall(text.decode()):
            visit(inc)

    visit(name)
    return files


def source_digest(name: str, sources: dict[str, bytes] | None = None) -> str:
    """sha256 over ``name`` and, recursively, every file it includes (:func:`kernel_sources`)."""
    h = hashlib.sha256()
    for rel, text in (sources or kernel_sources(name)).items():
        h.update(rel.encode() + b"\0" + text + b"\0")
    return h.hexdigest()


def nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    _check(nvrtc, err, "nvrtcVersion")
    return int(major), int(minor)


_RELEASE = re.compile(rb"^//\s*Cuda compilation tools, release [^,\n]*, V([0-9][0-9.]*)", re.M)
_BUILD_ID = re.compile(rb"^//\s*Compiler Build ID: (\S+)", re.M)


@functools.cache
def nvrtc_build() -> str:
    """NVRTC's full version as the PTX it writes names it, e.g. ``"12.9.86 (CL-36037853)"``: its
    release with the patch level (``nvrtcVersion`` gives major.minor only) and its build. Read
    once a process from the PTX of an empty program (some 30 ms); ``"major.minor"`` where that
    header says less."""
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(b"", b"lik_nvrtc_version.cu", 0, [], [])
    _check(nvrtc, err, "nvrtcCreateProgram")
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, 0, [])
        _check(nvrtc, err, "nvrtcCompileProgram (an empty program, for NVRTC's version)")
        err, n = nvrtc.nvrtcGetPTXSize(prog)
        _check(nvrtc, err, "nvrtcGetPTXSize")
        ptx = bytearray(n)  # a fresh buffer for NVRTC to write into (see nvrtc_compile)
        (err,) = nvrtc.nvrtcGetPTX(prog, ptx)
        _check(nvrtc, err, "nvrtcGetPTX")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    release, build = _RELEASE.search(ptx), _BUILD_ID.search(ptx)
    words = release.group(1).decode() if release else "%d.%d" % nvrtc_version()
    return f"{words} ({build.group(1).decode()})" if build else words


def _check(nvrtc, err, what: str) -> None:
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"{what} failed: {err}")


@dataclass(frozen=True)
class Compiled:
    cubin: bytes
    log: str  # NVRTC + ptxas (-v) output


def nvrtc_compile(name: str, defines: dict, arch: int | str, sources: dict[str, bytes] | None = None) -> Compiled:
    """Compile ``cuda_src/name`` for ``sm_<arch>`` (e.g. 80 or "90a") to a CUBIN. No GPU needed.

    ``sources``: :func:`kernel_sources`'s read of ``name`` (default: read now), the bytes compiled.
    """
    from cuda.bindings import nvrtc

    sources = sources or kernel_sources(name)
    headers = [(rel, text) for rel, text in sources.items() if rel != name]
    err, prog = nvrtc.nvrtcCreateProgram(sources[name], name.encode(), len(headers), [t for _, t in headers],
                                         [rel.encode() for rel, _ in headers])
    _check(nvrtc, err, "nvrtcCreateProgram")
    opts = [f"--gpu-architecture=sm_{arch}".encode(), *(f.encode() for f in _FLAGS)]
    opts += [f"-D{k}={v}".encode() for k, v in sorted(defines.items())]
    try:
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        # NVRTC writes into the buffers it is given: fresh bytearrays. (An immutable b" " * n of one
        # byte, an empty log's terminator, is CPython's shared b" ", which the write turned into
        # b"\0" for the whole process: every .npy header numpy.save wrote after was padded with NULs.)
        err, n = nvrtc.nvrtcGetProgramLogSize(prog)
        log = bytearray(n)
        nvrtc.nvrtcGetProgramLog(prog, log)
        log_s = bytes(log).rstrip(b"\0 ").decode(errors="replace")
        if res != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            cfg = " ".join(f"{k}={v}" for k, v in sorted(defines.items()))
            raise CompileError(f"NVRTC failed to compile {name} for sm_{arch} ({cfg}):\n{log_s}")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(nvrtc, err, "nvrtcGetCUBINSize")
        cubin = bytearray(size)
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        _check(nvrtc, err, "nvrtcGetCUBIN")
        return Compiled(bytes(cubin), log_s)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


_RES = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "static_smem": re.compile(r"(\d+) bytes smem"),
}


def resource_usage(log: str, kernel: str) -> dict[str, int]:
    """Registers, stack, spills and static shared memory of ``kernel`` from a ptxas -v log, and
    ``wgmma_serialized``: 1 where ptxas reports having serialized the kernel's wgmma instructions
    (its C751x/C752x "Potential Performance Loss" notes), which costs a Hopper tile its pipelining."""
    block = []
    capture = serialized = False
    quoted = f"'{kernel}'"
    for line in log.splitlines():
        if "Compiling entry function" in line or "Function properties for" in line:
            capture = quoted in line or line.rstrip().endswith(kernel)
        if capture:
            block.append(line)
        # (ptxas prints these notes before the per-function blocks, naming the function)
        serialized |= "wgmma.mma_async instructions are serialized" in line and quoted in line
    text = "\n".join(block)
    out = {}
    for key, rx in _RES.items():
        m = rx.search(text)
        out[key] = int(m.group(1)) if m else 0
    out["wgmma_serialized"] = int(serialized)
    return out


def cache_key(name: str, defines: dict, arch: int | str, sources: dict[str, bytes] | None = None) -> str:
    """The disk cache's key of a build: 40 hex digits over the source and every file it includes
    (``sources``, default: read now), the defines, the architecture, the NVRTC options, NVRTC's
    build (:func:`nvrtc_build`) and this package's version."""
    payload = json.dumps(
        {
            "src": source_digest(name, sources),
            "file": name,
            "defines": sorted((k, str(v)) for k, v in defines.items()),
            "arch": str(arch),
            "flags": _FLAGS,
            "nvrtc": nvrtc_build(),
            "lik": __version__,
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:40]


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all (``lik_cupy._atomic``: a killed writer's temporary is swept
    by the next write into the directory). Whatever else holds the entry's name is replaced, but a
    directory: that fails the write with an OSError, which sends the entry to the process's own
    directory."""
    target = str(path)
    _atomic.sweep(target)
    with _atomic.output_file(target, _not_a_directory) as f:
        f.write(data)


def _not_a_directory(target: str) -> str | None:
    with contextlib.suppress(OSError):
        if stat.S_ISDIR(os.lstat(target).st_mode):
            return "is a directory, not a kernel cache entry"
    return None


def _read_entry(path: Path, limit: int) -> bytes | None:
    """A cache file's bytes, or None where it is missing, not a regular file or past ``limit``."""
    try:
        return read_regular(str(path), "a kernel cache entry", limit)
    except ShardError:
        return None


def _parse(data: bytes | None) -> dict | None:
    """A cache file's JSON object, or None (damaged: nesting too deep for the parser included)."""
    if data is None:
        return None
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _read_cached(key: str, d: Path) -> bytes | None:
    """The CUBIN of entry ``key`` of cache directory ``d`` where it verifies (its metadata names the
    key and the CUBIN's checksum), else None: it is then compiled again and replaced, never deleted
    here (another process may be writing it)."""
    info = _parse(_read_entry(d / f"{key}.json", _MAX_META))
    if info is None or info.get("key") != key:
        return None
    data = _read_entry(d / f"{key}.cubin", _MAX_CUBIN)
    if data is None or hashlib.sha256(data).hexdigest() != info.get("sha256"):
        return None
    return data


_fallback_lock = threading.Lock()
_fallback: Path | None = None  # the process's own directory, where the cache cannot be written
_warned = False  # whether this process has said that its cache cannot be written
_in_memory: dict[str, tuple[Path, bytes]] = {}  # key -> a memory file of its CUBIN (_memory_file), and the bytes


def _elsewhere(problem: OSError, d: Path, key: str, cubin: bytes, meta: dict) -> Path:
    """Where a kernel the cache at ``d`` cannot take goes: a directory of this process's own
    (made once, removed at exit) or, where that cannot be written either (one full file system),
    a memory file of the process (:func:`_memory_file`). One warning a process, naming the cache
    and why; ``problem`` is raised where neither can be had."""
    global _fallback, _warned
    with _fallback_lock:
        if _fallback is None:
            with contextlib.suppress(OSError):
                _fallback = Path(tempfile.mkdtemp(prefix="lik-cupy-kernels-"))
                atexit.register(shutil.rmtree, _fallback, True)
        own = _fallback
    path = None
    if own is not None:
        with contextlib.suppress(OSError):
            path = _write_entry(own, key, cubin, meta)
    path = path or _memory_file(key, cubin)
    with _fallback_lock:
        if path is not None and not _warned:
            _warned = True
            where = f"in {own}" if path.parent == own else "in memory"
            warnings.warn(f"the kernel cache {d} (LIK_CACHE_DIR) cannot be written ({problem}); compiled kernels "
                          f"are kept {where} for this process only", RuntimeWarning, stacklevel=5)
    if path is None:
        raise problem
    return path


def _memory_file(key: str, cubin: bytes) -> Path | None:
    """A path to ``cubin`` that no other process can change or remove: a sealed memory file of this
    process, ``/proc/self/fd/<n>`` (Linux), made once a key; None where the system has none.

    Its descriptor stays open for the process's life: CuPy keeps the modules it loads by path, so
    a number once handed out must never come to name other bytes."""
    if not hasattr(os, "memfd_create") or not os.path.isdir("/proc/self/fd"):
        return None
    with _fallback_lock:
        if key in _in_memory:
            return _in_memory[key][0]
        try:
            fd = os.memfd_create(f"lik-cupy-{key}", os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 0))
        except OSError:
            return None
        try:
            view = memoryview(cubin)
            while view:
                view = view[os.write(fd, view):]
            with contextlib.suppress(OSError, AttributeError):
                import fcntl

                fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                            fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
        except OSError:
            os.close(fd)
            return None
        path = Path(f"/proc/self/fd/{fd}")
        _in_memory[key] = (path, cubin)
        return path


class _Cubin(NamedTuple):
    key: str  # its cache_key
    path: Path  # where the driver can read it
    data: bytes  # the bytes that verified (or were compiled)


def _cubin(name: str, defines: dict, arch: int | str) -> _Cubin:
    """A verified CUBIN for this kernel, compiled and cached if needed."""
    sources = kernel_sources(name)  # read once: the key hashes what NVRTC compiles
    key = cache_key(name, defines, arch, sources)
    d = cache_dir()
    for where in (d, _fallback):
        data = _read_cached(key, where) if where is not None else None
        if data is not None:
            return _Cubin(key, where / f"{key}.cubin", data)
    held = _in_memory.get(key)
    if held is not None:
        return _Cubin(key, *held)
    out = nvrtc_compile(name, defines, arch, sources=sources)
    meta = {"key": key, "sha256": hashlib.sha256(out.cubin).hexdigest(), "file": name, "arch": str(arch),
            "defines": {k: str(v) for k, v in defines.items()}, "log": out.log}
    try:
        path = _write_entry(d, key, out.cubin, meta)
    except OSError as e:  # read-only, full, or a file where a directory should be
        path = _elsewhere(e, d, key, out.cubin, meta)
    return _Cubin(key, path, out.cubin)


def cubin_path(name: str, defines: dict, arch: int | str) -> Path:
    """Path of a verified CUBIN for this kernel, compiling and caching it if needed."""
    return _cubin(name, defines, arch).path


def _write_entry(d: Path, key: str, cubin: bytes, meta: dict) -> Path:
    """Write an entry (the CUBIN first: its metadata, written last, is what makes it verify)."""
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{key}.cubin"
    _atomic_write(path, cubin)
    _atomic_write(d / f"{key}.json", json.dumps(meta, indent=1).encode())
    return path


_modules = DeviceCache(_MEMORY_CACHE_SIZE, lru=True)  # loaded modules, compiled once per key
_functions = DeviceCache(1024)  # small kernels of sources built without defines, per (source, entry)


def get_module(name: str, defines: dict, arch: int | str, device_id: int, entry: str | None = None):
    """A loaded ``cupy.RawModule`` for this kernel on ``device_id`` (compiled once per key).

    ``entry`` is a kernel the module defines (default: ``defines["LIK_NAME"]``);
    it is loaded at once so a bad module fails here, not at the first launch.
    """
    key = (name, tuple(sorted((k, str(v)) for k, v in defines.items())), str(arch))
    return _modules.get(device_id, key, lambda: _load_checked(name, defines, arch, device_id,
                                                               entry or str(defines["LIK_NAME"])))


def _load_checked(name: str, defines: dict, arch: int | str, device_id: int, entry: str):
    """Load the CUBIN that verified. The driver reads it by path, after the check: where that
    load fails and the file no longer holds the bytes checked (another process removed or
    rewrote the entry in between, or a tool damaged it in place), they are loaded from a memory
    file of the process instead; a load that fails on the bytes checked raises the driver's error."""
    key, path, data = _cubin(name, defines, arch)
    try:
        return _load(path, device_id, entry)
    except Exception:
        copy = None if _holds(path, data) else _memory_file(key, data)
        if copy is None:
            raise
    return _load(copy, device_id, entry)


def _holds(path: Path, data: bytes) -> bool:
    """Whether the regular file at ``path`` holds exactly ``data``."""
    return _read_entry(path, len(data)) == data


def get_function(name: str, entry: str, device_id: int):
    """Kernel ``entry`` of ``name``, a source built without defines (``checks.cu``, ``masks.cu``,
    ``topk.cu``), for ``device_id``'s architecture. Looked up once per device: the small kernels
    launched on every call then build no cache key."""
    return _functions.lookup(device_id, (name, entry)) or _functions.get(
        device_id, (name, entry), lambda: _small_kernel(name, entry, device_id))


_handles: dict = {}  # (device, source, entry) -> CUfunction handle of a small kernel


def function_handle(name: str, entry: str, device_id: int) -> int:
    """The driver handle of :func:`get_function`'s kernel, for launches by handle (``raw_launch``):
    one dictionary read on a repeat call."""
    key = (device_id, name, entry)
    h = _handles.get(key)
    if h is None:
        h = _handles[key] = get_function(name, entry, device_id).kernel.ptr
    return h


def _small_kernel(name: str, entry: str, device_id: int):
    from .._dispatch import arch_of
    from .._base.device import device_properties

    return get_module(name, {}, arch_of(device_properties(device_id).cc), device_id, entry=entry).get_function(entry)


def _load(path: Path, device_id: int, entry: str):
    """Load a CUBIN on ``device_id`` and resolve ``entry``: the one step of ``get_module`` that
    needs a GPU (the CPU tests replace it to exercise the caches and their locking)."""
    import cupy

    with cupy.cuda.Device(device_id):
        mod = cupy.RawModule(path=str(path))
        mod.get_function(entry)
    return mod


def _build_log(build: tuple) -> str:
    """The ptxas -v log of one ``(source, defines, arch)`` build (a process pool's picklable target)."""
    return nvrtc_compile(*build).log


_KEY = re.compile(r"[0-9a-f]{40}")


def _log_path(key: str) -> Path | None:
    """Where the cache keeps the log of ``key``; None for a name that is not a :func:`cache_key`
    (a recorded log's key is read from a file: a path in it must not reach outside the cache)."""
    return cache_dir() / "logs" / f"{key}.json" if isinstance(key, str) and _KEY.fullmatch(key) else None


def _read_log(key: str) -> str | None:
    path = _log_path(key)
    entry = _parse(_read_entry(path, _MAX_META)) if path is not None else None
    if entry is None or entry.get("key") != key or not isinstance(entry.get("log"), str):
        return None  # damaged: compiled again, and rewritten
    return entry["log"]


def _write_log(key: str, log: str) -> None:
    path = _log_path(key)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(path, json.dumps({"key": key, "log": log}).encode())
    except OSError:
        pass  # a read-only or missing cache only costs the next check its compiles


def cached_log(key: str) -> str | None:
    """The ptxas -v log the cache holds under :func:`cache_key` ``key``, or None."""
    return _read_log(key)


def seed_logs(logs: dict[str, str]) -> int:
    """Put ``{cache_key: ptxas -v log}`` entries the cache lacks into it (a compile check's recorded
    proofs: a key names the source and every file it includes, so a changed source misses them and
    compiles); returns how many were added."""
    added = 0
    for key, log in logs.items():
        path = _log_path(key)
        if path is not None and isinstance(log, str) and not path.exists():
            _write_log(key, log)
            added += 1
    return added


def compile_logs(builds: list[tuple], *, workers: int = 1, cache: bool = True) -> list[str]:
    """The ptxas -v logs of ``(source, defines, arch)`` builds, in order.

    With ``cache``, a build whose :func:`cache_key` (the source and every file it includes, the
    defines, the NVRTC options, the architecture, NVRTC's build) was compiled before reads that
    log from ``cache_dir()/logs`` instead; a missing or unwritable cache only means compiling.
    The rest compile on ``workers`` processes, the sm_90a builds (the slowest) first. Raises
    ``CompileError`` if any build fails; a failure is never cached.
    """
    keys = [cache_key(*b) for b in builds] if cache else [None] * len(builds)
    logs = [_read_log(k) if cache else None for k in keys]
    todo = sorted((i for i, log in enumerate(logs) if log is None), key=lambda i: not str(builds[i][2]).endswith("a"))
    if workers > 1 and len(todo) > 1:
        import concurrent.futures
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no NVRTC state shared over fork
        with concurrent.futures.ProcessPoolExecutor(min(workers, len(todo)), mp_context=ctx) as ex:
            fresh = list(ex.map(_build_log, [builds[i] for i in todo]))
    else:
        fresh = [_build_log(builds[i]) for i in todo]
    for i, log in zip(todo, fresh):
        logs[i] = log
        if cache:
            _write_log(keys[i], log)
    return logs


def check_all(archs=None, configs=None, *, other_kernels: bool = True, workers: int = 1,
              cache: bool = True) -> list[dict]:
    """CPU-only: compile every forward configuration (or ``configs``: one list for every
    architecture, or a dict from architecture to its list) for every supported architecture (or
    ``archs``), and with ``other_kernels`` the kernels outside the forward family, on ``workers``
    processes, reading what an earlier check proved from the cache (:func:`compile_logs`).

    Returns one row per (kernel, arch) with registers, stack, spills, static and dynamic shared
    memory and its build's :func:`cache_key` (``lik_sum_partials``, the top-k merge, the value
    checks, the mask spans, the INT8 quantiser and the backward kernels once per architecture:
    every source of ``kernels.SOURCES`` in each of its variants). Raises ``CompileError`` if any
    kernel fails.
    """
    from .._dispatch import SUPPORTED_ARCHS, all_forward_configs

    builds = []  # (source, defines, target, [(row's kernel, entry in the log, dynamic smem)])
    for arch in archs or SUPPORTED_ARCHS:
        chosen = configs.get(arch, []) if isinstance(configs, dict) else configs
        for n, cfg in enumerate(chosen if chosen is not None else all_forward_configs(arch)):
            entries = [(cfg.name, cfg.name, cfg.smem_bytes)]
            if n == 0:  # compiled into every forward module: reported once per architecture
                entries += [(k, k, 0) for k in FORWARD.entries]
            builds.append((FORWARD.file, cfg.defines(), cfg.target(arch), entries))
        if other_kernels:
            for src in SOURCES:
                target = src.target(arch)
                for defines in src.variants if target is not None else ():
                    builds.append((src.file, defines, target, [(src.row_name(k, defines), k, 0) for k in src.entries]))
    logs = compile_logs([b[:3] for b in builds], workers=workers, cache=cache)
    return [{"kernel": kernel, "arch": f"sm_{target}", "dynamic_smem": smem, "key": cache_key(src, defines, target),
             **resource_usage(log, entry)}
            for (src, defines, target, entries), log in zip(builds, logs) for kernel, entry, smem in entries]
