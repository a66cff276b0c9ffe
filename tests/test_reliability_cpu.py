"""Reliability promises that need no GPU (docs/reliability.md maps every promise to its test).

* Kernel compilation under concurrency: one NVRTC compile per kernel however many threads ask
  for it at the same moment, other kernels compiling meanwhile; processes sharing the on-disk
  cache never see a half-written entry; the in-memory module cache is bounded.
* The on-disk cache: corrupt, truncated, half-written or mismatched entries are discarded and
  rebuilt; an NVRTC failure reaches every caller with the compiler log and is never cached.
  (test_compile.py covers truncated and zeroed CUBINs and broken JSON; the cases here are the rest.)
* Hostile files: nothing in the package can unpickle; a manifest cannot point outside its shard.
* The CLI writes its output (through a temporary file beside it) and nothing else, anywhere.

NVRTC runs without a GPU; the one step of ``compile.get_module`` that needs one (loading the
CUBIN, ``compile._load``) is replaced here by a stand-in that records what it was given.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import multiprocessing
import os
import pathlib
import tempfile
import threading
import time
import types

import numpy as np
import pytest
from click.testing import CliRunner

from lik_cupy import _atomic, _files, cli
from lik_cupy._runtime import nvrtc as lc
from lik_cupy._base.cache import DeviceCache
from lik_cupy import _dispatch as dispatch
from lik_cupy import shards

REPO = pathlib.Path(__file__).resolve().parents[1]
SRC = "maxsim_fwd.cu"


def _cfg(argmax=False):
    return dispatch.choose_forward(80, "float16", 64, 32, argmax, True)


class Counting:
    """Wraps a function: counts calls and how many run at once; ``delay`` seconds before each call
    hold open the window in which concurrent callers could race."""

    def __init__(self, fn, delay=0.0):
        self.fn, self.delay = fn, delay
        self.calls = self.active = self.most_at_once = 0
        self._lock = threading.Lock()

    def __call__(self, *a, **kw):
        with self._lock:
            self.calls += 1
            self.active += 1
            self.most_at_once = max(self.most_at_once, self.active)
        try:
            time.sleep(self.delay)
            return self.fn(*a, **kw)
        finally:
            with self._lock:
                self.active -= 1


@pytest.fixture
def kernel_cache(tmp_path, monkeypatch):
    """An empty disk cache, empty in-memory caches, counted NVRTC compiles and stand-in loads."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC (cuda-python) is not installed")
    monkeypatch.setenv("LIK_CACHE_DIR", str(tmp_path / "kc"))
    monkeypatch.setattr(lc, "_modules", DeviceCache(lc._MEMORY_CACHE_SIZE, lru=True))
    for name, empty in (("_fallback", None), ("_warned", False), ("_in_memory", {})):
        monkeypatch.setattr(lc, name, empty)
    nvrtc = Counting(lc.nvrtc_compile, delay=0.2)
    load = Counting(lambda path, device, entry: types.SimpleNamespace(path=path, device=device, entry=entry))
    monkeypatch.setattr(lc, "nvrtc_compile", nvrtc)
    monkeypatch.setattr(lc, "_load", load)
    return types.SimpleNamespace(dir=tmp_path / "kc", nvrtc=nvrtc, load=load)


def _entries(d: pathlib.Path):
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


# ---------------------------------------------------------------- compilation under concurrency


def test_concurrent_callers_compile_each_kernel_once(kernel_cache):
    cfgs = [_cfg(False), _cfg(True)]
    n = 24
    barrier = threading.Barrier(n)
    got: list = [None] * n

    def ask(i):
        barrier.wait()  # every thread asks at the same moment
        cfg = cfgs[i % 2]
        got[i] = lc.get_module(SRC, cfg.defines(), 80, 0)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert kernel_cache.nvrtc.calls == 2 and kernel_cache.load.calls == 2
    assert kernel_cache.nvrtc.most_at_once == 2  # the two kernels compiled side by side, not one after the other
    for k in (0, 1):
        assert all(m is got[k] for m in got[k::2]) and got[k].entry == cfgs[k].name
    assert len(_entries(kernel_cache.dir)) == 4  # a CUBIN and its metadata per kernel, no temporary left

    for cfg in cfgs:  # later callers: memory hits
        lc.get_module(SRC, cfg.defines(), 80, 0)
    assert kernel_cache.nvrtc.calls == 2 and kernel_cache.load.calls == 2
    lc._modules.clear()  # a new process: the disk cache serves it, NVRTC stays idle
    lc.get_module(SRC, cfgs[0].defines(), 80, 0)
    assert kernel_cache.nvrtc.calls == 2 and kernel_cache.load.calls == 3
    assert lc._modules.building() == 0  # per-key locks do not pile up


def test_a_compile_with_an_empty_log_leaves_the_process_bytes_alone(tmp_path, monkeypatch):
    # NVRTC writes the log into the buffer it is given; an empty log is its one NUL terminator. A
    # one-byte immutable buffer was CPython's shared b" ", which then read b"\0" process-wide, so
    # numpy.save padded every later .npy header with NULs (shards unreadable on CUDA 13 hosts).
    pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC (cuda-python) is not installed")
    (tmp_path / "quiet.cu").write_text('extern "C" __global__ void lik_quiet(float* x) { x[0] = 1.f; }\n')
    monkeypatch.setattr(lc, "source_dir", lambda: tmp_path)
    monkeypatch.setattr(lc, "_FLAGS", ("--std=c++17",))  # no ptxas -v: the log is empty
    from cuda.bindings import nvrtc

    n = [None]
    real_size = nvrtc.nvrtcGetProgramLogSize

    def size(prog):
        out = real_size(prog)
        n[0] = out[1]
        return out

    monkeypatch.setattr(nvrtc, "nvrtcGetProgramLogSize", size)
    built = lc.nvrtc_compile("quiet.cu", {}, 80)
    assert n[0] == 1 and built.log == "" and built.cubin[:4] == b"\x7fELF"
    space = bytes([32])  # the shared one-byte object, built at run time (not a folded constant)
    assert space * 3 == b"   "
    buf = io.BytesIO()
    np.save(buf, np.ones((6, 8), np.float32))
    header = buf.getvalue()[10:128]
    assert b"\0" not in header and header.endswith(b" \n")


def _compile_in_process(cache: str, barrier, out):
    os.environ["LIK_CACHE_DIR"] = cache
    barrier.wait()
    path = lc.cubin_path(SRC, _cfg().defines(), 80)
    out.put(hashlib.sha256(path.read_bytes()).hexdigest())


def test_processes_sharing_the_disk_cache_never_see_a_partial_entry(tmp_path):
    pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC (cuda-python) is not installed")
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_compile_in_process, args=(str(tmp_path), barrier, out)) for _ in range(3)]
    for p in procs:
        p.start()
    digests = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    meta = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert set(digests) == {meta["sha256"]}  # every process got the complete, verified CUBIN
    assert len(_entries(tmp_path)) == 2


def test_failed_compile_reaches_every_caller_with_the_log_and_is_not_cached(kernel_cache):
    bad = {**_cfg().defines(), "LIK_DP": 15}
    errors = []

    def ask():
        try:
            lc.get_module(SRC, bad, 80, 0)
        except lc.CompileError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 3
    assert all("NVRTC failed to compile maxsim_fwd.cu for sm_80" in e and "DP must be a multiple of 16" in e
               for e in errors)  # the compiler's own log, for every caller
    assert kernel_cache.load.calls == 0 and not lc._modules and _entries(kernel_cache.dir) == []
    calls = kernel_cache.nvrtc.calls
    with pytest.raises(lc.CompileError):  # a failure is not remembered: the next call compiles again
        lc.get_module(SRC, bad, 80, 0)
    assert kernel_cache.nvrtc.calls == calls + 1


def test_memory_cache_is_bounded_and_keeps_recent_kernels(monkeypatch):
    monkeypatch.setattr(lc, "_modules", DeviceCache(lc._MEMORY_CACHE_SIZE, lru=True))
    monkeypatch.setattr(lc, "_cubin", lambda name, defines, arch: lc._Cubin("", pathlib.Path(defines["LIK_NAME"]), b""))
    monkeypatch.setattr(lc, "_load", lambda path, device, entry: types.SimpleNamespace(name=entry))
    size = lc._MEMORY_CACHE_SIZE
    first = lc.get_module(SRC, {"LIK_NAME": "k0"}, 80, 0)
    for i in range(1, 2 * size):
        lc.get_module(SRC, {"LIK_NAME": f"k{i}"}, 80, 0)
        if i % 16 == 0:
            assert lc.get_module(SRC, {"LIK_NAME": "k0"}, 80, 0) is first  # in use: stays
        assert len(lc._modules) <= size
    names = [m.name for m in lc._modules.values()]
    assert len(names) == size and "k0" in names and "k1" not in names and f"k{2 * size - 1}" in names
    assert lc._modules.building() == 0


def test_kernel_handles_keep_their_module_loaded(monkeypatch):
    """The fused head's one-pass kernel (hidden_maxsim) kept its two driver handles but not the module
    that owns them, which only the bounded module cache held: once 256 other kernels had been loaded
    that module was dropped, and its release unloads it, so the next fused-head call launched by
    handles of an unloaded module."""
    import gc
    import weakref

    from lik_cupy._runtime import hidden_maxsim

    class Module:  # a loaded module: unloaded (its functions' handles dangling) once collected
        def get_function(self, entry):
            return types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=id(self)), module=self)

    loaded = []
    monkeypatch.setattr(lc, "_modules", DeviceCache(2, lru=True))
    monkeypatch.setattr(lc, "_cubin",
                        lambda name, defines, arch: lc._Cubin("", pathlib.Path(str(sorted(defines.items()))), b""))
    monkeypatch.setattr(lc, "_load", lambda path, device, entry: loaded.append(weakref.ref(m := Module())) or m)
    hidden_maxsim._functions.cache_clear()
    try:
        main, finish, *_ = hidden_maxsim._functions("float16", 64, 0)
        for i in range(3):  # other kernels push it out of the module cache
            lc.get_module(SRC, {"LIK_NAME": f"k{i}"}, 80, 0)
        gc.collect()
        assert loaded[0]() is not None and main == finish == id(loaded[0]())
    finally:
        hidden_maxsim._functions.cache_clear()


# ---------------------------------------------------------------- the on-disk cache


def test_small_kernels_are_looked_up_once_per_device(monkeypatch):
    # checks.cu, masks.cu and topk.cu launch on every scoring call: their functions are resolved
    # once per (device, source, entry), and each device gets its own architecture's build.
    import lik_cupy._base.device

    monkeypatch.setattr(lc, "_functions", DeviceCache(1024))
    modules = []

    def get_module(name, defines, arch, device, entry=None):
        modules.append((name, arch, device, entry))
        return types.SimpleNamespace(get_function=lambda e: (name, arch, device, e))

    monkeypatch.setattr(lc, "get_module", get_module)
    monkeypatch.setattr(lik_cupy._base.device, "device_properties", lambda d: types.SimpleNamespace(cc=(80, 90)[d]))
    for _ in range(3):
        assert lc.get_function("masks.cu", "lik_mask_spans", 0) == ("masks.cu", 80, 0, "lik_mask_spans")
        assert lc.get_function("masks.cu", "lik_mask_spans", 1) == ("masks.cu", 90, 1, "lik_mask_spans")
        assert lc.get_function("checks.cu", "lik_check_offsets_i32", 0) == ("checks.cu", 80, 0, "lik_check_offsets_i32")
    assert sorted(modules) == [("checks.cu", 80, 0, "lik_check_offsets_i32"), ("masks.cu", 80, 0, "lik_mask_spans"),
                               ("masks.cu", 90, 1, "lik_mask_spans")]

def _corruptions():
    """(name, damage(cubin, meta, other_cubin), whether the entry must be rebuilt)."""
    return [
        ("metadata is a JSON list", lambda c, m, o: m.write_text("[]"), True),
        ("metadata is null", lambda c, m, o: m.write_text("null"), True),
        ("metadata lacks the checksum", lambda c, m, o: m.write_text("{}"), True),
        ("metadata is not UTF-8", lambda c, m, o: m.write_bytes(b"\xff\xfe{"), True),
        ("CUBIN missing", lambda c, m, o: c.unlink(), True),
        ("metadata missing", lambda c, m, o: m.unlink(), True),
        ("CUBIN empty", lambda c, m, o: c.write_bytes(b""), True),
        ("CUBIN of another kernel", lambda c, m, o: c.write_bytes(o), True),
        ("a killed writer's temporary file", lambda c, m, o: c.with_name(c.name + ".x1y2.tmp").write_bytes(b"\x7fE"),
         False),
    ]


@pytest.fixture(scope="module")
def two_kernels():
    """The real NVRTC output for two configurations, compiled once for all the damage cases."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC (cuda-python) is not installed")
    return {am: lc.nvrtc_compile(SRC, _cfg(am).defines(), 80) for am in (False, True)}


@pytest.mark.parametrize("name,damage,rebuilt", _corruptions(), ids=[c[0] for c in _corruptions()])
def test_damaged_disk_entry_is_discarded_and_rebuilt(kernel_cache, two_kernels, monkeypatch, name, damage, rebuilt):
    nvrtc = Counting(lambda name, defines, arch, **_: two_kernels[bool(defines["LIK_ARGMAX"])])
    monkeypatch.setattr(lc, "nvrtc_compile", nvrtc)
    defines = _cfg().defines()
    cubin = lc.cubin_path(SRC, defines, 80)
    good = cubin.read_bytes()
    damage(cubin, cubin.with_suffix(".json"), two_kernels[True].cubin)
    path = lc.cubin_path(SRC, defines, 80)
    assert path == cubin and path.read_bytes() == good == two_kernels[False].cubin
    assert json.loads(path.with_suffix(".json").read_text())["sha256"] == hashlib.sha256(good).hexdigest()
    assert nvrtc.calls == 1 + rebuilt


def _driver_load(path, device, entry):
    """Stands in for cuModuleLoad: reads the file at ``path`` (an error where it is gone) and refuses
    an ELF image whose section headers lie past its end (a truncated CUBIN)."""
    data = pathlib.Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or len(data) < 64:
        raise RuntimeError(f"CUDA_ERROR_INVALID_IMAGE: {path}")
    shoff, shentsize, shnum = int.from_bytes(data[40:48], "little"), data[58] | data[59] << 8, data[60] | data[61] << 8
    if shoff + shentsize * shnum > len(data):
        raise RuntimeError(f"CUDA_ERROR_INVALID_IMAGE: {path} is truncated")
    return types.SimpleNamespace(data=data, entry=entry)


@pytest.mark.parametrize("change", ["removed", "truncated in place", "replaced by a complete entry"])
def test_an_entry_changed_between_its_check_and_its_load_loads_what_was_checked(kernel_cache, monkeypatch, change):
    """cubin_path verified an entry and gave its path; the driver then read the path again. An entry
    removed in between (another process clearing the cache) or damaged in place (a copy or restore
    by another tool) failed the module's load: an exception from the kernel's first call. Now the
    load gets the bytes that were checked."""
    defines = _cfg().defines()
    good = lc.cubin_path(SRC, defines, 80).read_bytes()  # the entry, in the cache

    def load(path, device, entry):
        path = pathlib.Path(path)
        if path.parent == kernel_cache.dir:  # another process acts between the check and the read
            if change == "removed":
                path.unlink()
            elif change == "truncated in place":
                with open(path, "r+b") as f:
                    f.truncate(len(good) // 2)
            else:
                other = path.with_name("other")
                other.write_bytes(good)
                os.replace(other, path)
        return _driver_load(path, device, entry)

    monkeypatch.setattr(lc, "_load", load)
    assert lc.get_module(SRC, defines, 80, 0).data == good
    assert kernel_cache.nvrtc.calls == 1


def test_a_load_that_fails_on_an_unchanged_entry_raises_its_own_error(kernel_cache, monkeypatch):
    # Only an entry that changed after its check is loaded again from a copy: a module the driver
    # refuses as it is (no memory left, an image for another device) keeps the driver's error.
    def load(path, device, entry):
        load.paths.append(path)
        raise RuntimeError("CUDA_ERROR_OUT_OF_MEMORY")

    load.paths = []
    monkeypatch.setattr(lc, "_load", load)
    with pytest.raises(RuntimeError, match="CUDA_ERROR_OUT_OF_MEMORY"):
        lc.get_module(SRC, _cfg().defines(), 80, 0)
    assert len(load.paths) == 1


def _failing_writes(monkeypatch, errno_, dirs):
    """Every file ``lik_cupy._atomic`` writes into ``dirs`` fails as on a full disk (half its bytes
    written, then ENOSPC) or a read-only one (EROFS when its temporary is created)."""
    import errno

    real_open, real_os_open = open, os.open
    inside = lambda p: os.path.dirname(os.path.abspath(os.fsdecode(p))) in {str(d) for d in dirs}  # noqa: E731

    class HalfWritten:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            self.f.write(data[:len(data) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def full_open(fd, mode="r", *a, **k):
        f = real_open(fd, mode, *a, **k)
        return HalfWritten(f) if isinstance(fd, int) and inside(os.readlink(f"/proc/self/fd/{fd}")) else f

    def read_only_open(path, flags, *a, **k):
        if flags & os.O_CREAT and inside(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real_os_open(path, flags, *a, **k)

    if errno_ == "ENOSPC":
        monkeypatch.setattr(_atomic, "open", full_open, raising=False)
    else:
        monkeypatch.setattr(os, "open", read_only_open)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="finds a descriptor's file through /proc")
@pytest.mark.parametrize("errno_", ["ENOSPC", "EROFS"])
@pytest.mark.parametrize("where", ["the cache", "the cache and the temporary directory"])
def test_a_cache_that_cannot_take_an_entry_costs_one_warning_and_leaves_nothing(kernel_cache, monkeypatch, tmp_path,
                                                                                 errno_, where):
    """A full or read-only disk under the cache: the kernels still load, with one warning in all,
    and no temporary or partial file is left. Where the temporary directory could not take them
    either (one file system full), every kernel load raised the OSError after compiling."""
    import errno

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(lc.tempfile, "tempdir", str(tmp))
    kernel_cache.dir.mkdir()
    dirs = [kernel_cache.dir]
    if where != "the cache":
        def no_directory(*a, **k):
            raise OSError(getattr(errno, errno_), os.strerror(getattr(errno, errno_)), str(tmp))

        monkeypatch.setattr(lc.tempfile, "mkdtemp", no_directory)
    _failing_writes(monkeypatch, errno_, dirs)
    monkeypatch.setattr(lc, "_load", _driver_load)
    expected = {am: lc.nvrtc_compile(SRC, _cfg(am).defines(), 80).cubin for am in (False, True)}
    with pytest.warns(RuntimeWarning, match="cannot be written") as w:
        for am in (False, True):
            assert lc.get_module(SRC, _cfg(am).defines(), 80, 0).data == expected[am]
        lc._modules.clear()
        assert lc.get_module(SRC, _cfg().defines(), 80, 0).data == expected[False]
    assert len([x for x in w if issubclass(x.category, RuntimeWarning)]) == 1
    assert _entries(kernel_cache.dir) == []  # no temporary, and no entry half written
    assert not [p for p in tmp.rglob("*") if ".lik-tmp." in p.name]


def test_an_entry_another_user_wrote_is_compiled_again_and_replaced(kernel_cache, monkeypatch):
    """An entry this process cannot read (another user's, written under umask 077) is a miss: it is
    compiled and the entry replaced (where the directory lets this user rename over it)."""
    defines = _cfg().defines()
    cubin = lc.cubin_path(SRC, defines, 80)
    real = lc.read_regular

    def unreadable(path, expected, limit=None):
        if str(path) == str(unreadable.path):
            raise lc.ShardError(path, "permission denied")
        return real(path, expected, limit)

    unreadable.path = cubin.with_suffix(".json")
    monkeypatch.setattr(lc, "read_regular", unreadable)
    before = os.stat(cubin.with_suffix(".json")).st_ino
    assert lc.cubin_path(SRC, defines, 80) == cubin and kernel_cache.nvrtc.calls == 2
    assert os.stat(cubin.with_suffix(".json")).st_ino != before  # replaced by this process's entry
    monkeypatch.setattr(lc, "read_regular", real)
    assert lc.cubin_path(SRC, defines, 80) == cubin and kernel_cache.nvrtc.calls == 2


def test_files_in_the_cache_that_lik_did_not_make_are_left_alone(kernel_cache, tmp_path):
    """Compiling, damaging, rebuilding and sweeping the cache touch the entries' names and dead lik
    temporaries of this host only: every other file, link and name is left as it was."""
    d = kernel_cache.dir
    (d / "logs").mkdir(parents=True)
    defines = _cfg().defines()
    key = lc.cache_key(SRC, defines, 80)
    outside = tmp_path / "outside.txt"
    outside.write_text("theirs")
    other_host = "0" * 8 if _atomic._HOST != b"00000000" else "1" * 8
    foreign = {"notes.txt": b"mine", f"{key}.cubin.bak": b"a copy", f"{key}.json~": b"{}", ".hidden": b"",
               f".{key}.cubin.lik-tmp.1.{other_host}.0123abcd": b"another host's writer", "logs/mine.json": b"[]",
               f"{key[:39]}.cubin": b"a name one short", f"{key.upper()}.cubin": b"another name"}
    for name, data in foreign.items():
        (d / name).write_bytes(data)
    (d / "link.cubin").symlink_to(outside)
    os.link(outside, d / "hard.json")
    cubin = lc.cubin_path(SRC, defines, 80)
    cubin.write_bytes(b"damaged")
    lc.cubin_path(SRC, defines, 80)
    lc.cubin_path(SRC, _cfg(True).defines(), 80)
    lc.compile_logs([(SRC, defines, 80)])
    assert all((d / name).read_bytes() == data for name, data in foreign.items())
    assert os.readlink(d / "link.cubin") == str(outside) and outside.read_text() == "theirs"
    assert os.path.samefile(d / "hard.json", outside)


def test_recorded_logs_under_names_that_are_not_keys_are_not_written(kernel_cache, tmp_path):
    # seed_logs takes {key: log} from a file (the compile check's recorded proofs): a "key" with a
    # path in it wrote its log outside the cache.
    added = lc.seed_logs({"../../elsewhere": "log", "0" * 40: "log", "A" * 40: "log", "0" * 39 + "/": "log"})
    assert added == 1 and not (tmp_path / "elsewhere.json").exists()
    assert _entries(kernel_cache.dir / "logs") == ["0" * 40 + ".json"]
    assert lc.cached_log("../../elsewhere") is None and lc.cached_log("0" * 40) == "log"


# ---------------------------------------------------------------- no file can run code


_UNPICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal", "jsonpickle"}


def pickle_risks(source: str, filename: str) -> list[str]:
    """Every way ``source`` could unpickle: an unpickling module imported, ``np.load`` without
    ``allow_pickle=False``, anything passed ``allow_pickle=True``, ``torch.load``, ``read_pickle``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{where}: imports {m}" for m in mods if m.split(".")[0] in _UNPICKLERS]
        if not isinstance(node, ast.Call):
            continue
        func = ast.unparse(node.func)
        kw = {k.arg: k.value for k in node.keywords}
        if "allow_pickle" in kw and not (isinstance(kw["allow_pickle"], ast.Constant) and kw["allow_pickle"].value is False):
            found.append(f"{where}: {func}(allow_pickle={ast.unparse(kw['allow_pickle'])})")
        if func in ("np.load", "numpy.load") and "allow_pickle" not in kw:
            found.append(f"{where}: {func} without allow_pickle=False")
        if func.endswith(("torch.load", "read_pickle", "pickle.load", "pickle.loads")):
            found.append(f"{where}: {func}")
    return found


def test_nothing_in_the_package_can_unpickle():
    files = sorted((REPO / "lik_cupy").rglob("*.py")) + [REPO / "cli.py"]
    assert len(files) > 10
    risks = [r for f in files for r in pickle_risks(f.read_text(), str(f.relative_to(REPO)))]
    assert not risks, "\n".join(risks)
    # the scan itself finds each kind of risk
    bad = ("import pickle\nfrom joblib import load\nnp.load(p)\nnumpy.load(p, mmap_mode='r')\n"
           "np.load(p, allow_pickle=True)\ntorch.load(f)\npd.read_pickle(f)\nnp.load(p, allow_pickle=flag)\n")
    assert len(pickle_risks(bad, "bad.py")) == 8
    assert pickle_risks("np.load(p, mmap_mode='r', allow_pickle=False)\n", "ok.py") == []


def _payload(path: pathlib.Path, marker: pathlib.Path):
    """An object-dtype .npy whose unpickling would create ``marker``."""

    class Payload:
        def __reduce__(self):
            return (pathlib.Path.touch, (marker,))

    np.save(path, np.array([Payload(), Payload()], dtype=object), allow_pickle=True)


def test_pickled_npy_never_runs_through_the_cli(tmp_path):
    marker = tmp_path / "pwned"
    _payload(tmp_path / "evil.npy", marker)
    np.save(tmp_path / "q.npy", np.ones((2, 3, 8), np.float32))
    np.save(tmp_path / "d.npy", np.ones((2, 4, 8), np.float32))
    np.save(tmp_path / "flat.npy", np.ones((6, 8), np.float32))
    shard = tmp_path / "shard"
    shards.write_shard(shard, np.ones((6, 8), np.float32), np.array([0, 2, 6]), ids=np.arange(2))
    (shard / "ids.npy").write_bytes((tmp_path / "evil.npy").read_bytes())
    out = str(tmp_path / "o.tsv")
    cases = [
        ["score", "--queries", tmp_path / "evil.npy", "--docs", tmp_path / "d.npy", "--out", out, "--cpu"],
        ["score", "--queries", tmp_path / "q.npy", "--docs", tmp_path / "evil.npy", "--out", out, "--cpu"],
        ["score", "--queries", tmp_path / "q.npy", "--docs", tmp_path / "d.npy", "--d-lengths", tmp_path / "evil.npy",
         "--out", out, "--cpu"],
        ["score", "--queries", tmp_path / "q.npy", "--q-lengths", tmp_path / "evil.npy", "--docs", tmp_path / "d.npy",
         "--out", out, "--cpu"],
        ["score", "--queries", tmp_path / "q.npy", "--docs", tmp_path / "flat.npy", "--d-lengths",
         tmp_path / "evil.npy", "--out", out, "--cpu"],
        ["score", "--queries", tmp_path / "q.npy", "--docs", shard, "--out", out, "--cpu"],
        ["inspect", shard],
        ["inspect", tmp_path / "evil.npy"],
        ["pack", tmp_path / "evil.npy", "--out", tmp_path / "packed"],
        ["pack", tmp_path / "d.npy", "--lengths", tmp_path / "evil.npy", "--out", tmp_path / "packed"],
    ]
    for args in cases:
        r = CliRunner().invoke(cli.main, [str(a) for a in args])
        assert r.exit_code == 2 and not marker.exists(), (args, r.exit_code, r.output)


# ---------------------------------------------------------------- manifests stay inside their shard


def _shard_with_files(tmp_path):
    d = tmp_path / "s"
    shards.write_shard(d, np.arange(24, dtype=np.float32).reshape(6, 4), np.array([0, 2, 6]))
    outside = tmp_path / "outside"
    outside.mkdir()
    np.save(outside / "tokens.npy", np.zeros((6, 4), np.float32))
    return d, outside


def _point_tokens_at(d: pathlib.Path, name):
    m = json.loads((d / "manifest.json").read_text())
    m["files"]["tokens"] = name
    (d / "manifest.json").write_text(json.dumps(m))


def test_manifest_cannot_leave_its_shard_through_a_linked_directory(tmp_path):
    d, outside = _shard_with_files(tmp_path)
    os.symlink(outside, d / "sub")
    _point_tokens_at(d, "sub/tokens.npy")
    with pytest.raises(shards.ShardError, match="leads outside the shard directory"):
        shards.open_shard(d)
    os.symlink(d / "tokens.npy", d / "alias.npy")  # a link that stays inside is a file of the shard
    _point_tokens_at(d, "alias.npy")
    assert shards.open_shard(d).tokens.shape == (6, 4)


@pytest.mark.parametrize("name", ["tok\0ens.npy", "tok\ud800ens.npy"], ids=["NUL", "lone surrogate"])
def test_manifest_names_no_path_can_hold(tmp_path, name):
    """A name no path can hold is the manifest's fault (a ShardError, so `lik` exits 2 naming it),
    not an internal error."""
    d, _ = _shard_with_files(tmp_path)
    _point_tokens_at(d, name)
    with pytest.raises(shards.ShardError):
        shards.open_shard(d)


def test_unbalanced_npy_header_is_a_shard_error(tmp_path):
    """A version-1 header with an unclosed bracket (NumPy's parser raises tokenize.TokenError)."""
    text = "{'descr': '<f2', 'shape': (1,"
    header = (text + " " * (64 - (10 + len(text) + 1) % 64) + "\n").encode()
    (tmp_path / "x.npy").write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + b"\0" * 8)
    with pytest.raises(shards.ShardError, match="x.npy"):
        _files.open_npy(tmp_path / "x.npy")


# ---------------------------------------------------------------- the CLI writes its output and nothing else


def _snapshot(root: pathlib.Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file() or p.is_symlink()}


@pytest.mark.parametrize("kind", ["tsv", "jsonl", "npy ids", "npy full matrix", "pack"])
def test_cli_writes_its_output_and_nothing_else(tmp_path, monkeypatch, kind):
    """Inputs, the working directory, TMPDIR, HOME and the kernel cache directory are watched:
    only the output appears, and every temporary file or directory is made beside it."""
    root = tmp_path
    for sub in ("in", "out", "cwd", "tmp", "home", "cache"):
        (root / sub).mkdir()
    rng = np.random.default_rng(0)
    np.save(root / "in" / "q.npy", rng.standard_normal((2, 3, 8)).astype(np.float32))
    np.save(root / "in" / "docs.npy", rng.standard_normal((4, 5, 8)).astype(np.float32))
    np.save(root / "in" / "lens.npy", np.array([5, 0, 3, 1]))
    shards.write_shard(root / "in" / "shard", rng.standard_normal((9, 8)).astype(np.float32), np.array([0, 4, 4, 9]))
    for var, sub in (("TMPDIR", "tmp"), ("HOME", "home"), ("XDG_CACHE_HOME", "cache"), ("LIK_CACHE_DIR", "cache")):
        monkeypatch.setenv(var, str(root / sub))
    monkeypatch.setattr(tempfile, "tempdir", None)  # forget a temporary directory chosen before TMPDIR changed
    monkeypatch.chdir(root / "cwd")
    made_in, real = [], _atomic._temp_path

    def temp_path(*a, **kw):
        path = real(*a, **kw)
        made_in.append(os.path.dirname(path))
        return path

    monkeypatch.setattr(_atomic, "_temp_path", temp_path)

    score = ["score", "--queries", root / "in" / "q.npy", "--docs", root / "in" / "shard", root / "in" / "docs.npy",
             "--d-lengths", root / "in" / "lens.npy", "--cpu", "--out"]
    out = {"tsv": "r.tsv", "jsonl": "r.jsonl", "npy ids": "r.npy", "npy full matrix": "m.npy", "pack": "packed"}[kind]
    args = {"npy full matrix": score + [root / "out" / out, "--full-matrix"],
            "pack": ["pack", root / "in" / "docs.npy", "--lengths", root / "in" / "lens.npy", "--out", root / "out" / out],
            }.get(kind, score + [root / "out" / out, "--top-k", "3"])
    before = _snapshot(root)
    r = CliRunner().invoke(cli.main, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    after = _snapshot(root)
    changed = {p for p in after if before.get(p) != after[p]} | (set(before) - set(after))
    assert changed and all(p == f"out/{out}" or p.startswith(f"out/{out}/") for p in changed), sorted(changed)
    assert made_in and {os.path.realpath(d) for d in made_in} == {str(root / "out")}, made_in
