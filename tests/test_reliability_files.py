"""Files and processes that never lose data: full disks, races, kills, casts, duplicate inputs,
hostile files and hostile environments (docs/reliability.md, "Files and processes", maps each
promise to its test here). CPU only.

The conditions are real where the machine allows, and a test skips (never fails) where not:

* a full disk: a 64 KiB tmpfs (root with mount rights) and, everywhere, a child ``lik`` whose
  file size limit (RLIMIT_FSIZE) is 64 KiB;
* file permissions: plain modes; as root, a child whose capability bounding set has dropped
  CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, so that modes bind it as they bind anyone;
* kills: SIGKILL to a child ``lik`` while it writes, then the directory is looked at;
* races: a second writer runs inside the first one's write (in process), or two ``lik pack``
  processes run at once; both with ``renameat2`` and with the locked fallback.
"""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import resource
import signal
import subprocess
import sys
import time
import tracemalloc

import numpy as np
import pytest

import lik_cupy
from lik_command import child_pythonpath
from lik_command import run_lik as run
from lik_cupy import _cpu as cpu
from lik_cupy import _atomic, cli, shards

REPO = pathlib.Path(__file__).resolve().parents[1]
LIK = "import sys\nfrom lik_cupy.cli import main\nmain(sys.argv[1:], prog_name='lik')\n"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux files, signals and limits")


# --------------------------------------------------------------------------- helpers


def lik(*args, prelude="", preexec_fn=None, timeout=120, **kw):
    """``lik`` in a child process (``prelude``: Python run first, e.g. to slow a function down)."""
    env = dict(os.environ, PYTHONPATH=child_pythonpath(), PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-c", prelude + LIK, *map(str, args)], env=env, preexec_fn=preexec_fn,
                          capture_output=True, text=True, timeout=timeout, **kw)


def lik_popen(*args, prelude="", **kw):
    env = dict(os.environ, PYTHONPATH=child_pythonpath(), PYTHONDONTWRITEBYTECODE="1")
    return subprocess.Popen([sys.executable, "-c", prelude + LIK, *map(str, args)], env=env, **kw)


def one_line(code: int, stderr: str, culprit, words: str | None = None) -> None:
    """Exit 2 and one stderr line naming ``culprit`` (saying ``words``), no traceback."""
    lines = stderr.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"lik: error: {culprit}: "), (code, stderr)
    assert words is None or words in lines[0], (words, lines[0])


def listing(path) -> list[str]:
    return sorted(os.listdir(path))


def slow(target: str, seconds: float = 0.5) -> str:
    """A prelude that makes every call of ``target`` ("module.function") sleep first."""
    module, name = target.rsplit(".", 1)
    return (f"import time, importlib\nmod = importlib.import_module({module!r})\nreal = getattr(mod, {name!r})\n"
            f"def slow(*a, **k):\n    time.sleep({seconds})\n    return real(*a, **k)\nsetattr(mod, {name!r}, slow)\n")


def wait_for(predicate, p: subprocess.Popen, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert p.poll() is None, f"the child ended before {what}: {p.communicate()}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.02)


def make_shard(path, n_docs=6, dim=8, seed=0, ids=None, lengths=None):
    rng = np.random.default_rng(seed)
    lens = np.asarray(lengths if lengths is not None else rng.integers(1, 6, n_docs))
    tokens = rng.standard_normal((int(lens.sum()), dim)).astype(np.float32)
    return shards.write_shard(path, tokens, np.concatenate([[0], np.cumsum(lens)]), ids=ids)


def queries(path, n=2, length=3, dim=8, seed=1):
    np.save(path, np.random.default_rng(seed).standard_normal((n, length, dim)).astype(np.float32))
    return path


@pytest.fixture(params=["renameat2", "locked"])
def commit_mode(request, monkeypatch):
    """Outputs committed with renameat2, or (as on NFS or non-Linux systems) under the lock."""
    if request.param == "locked":
        from lik_cupy import _atomic

        monkeypatch.setattr(_atomic, "_RENAMEAT2", None)
    return request.param


# --------------------------------------------------------------------------- a full disk


@pytest.fixture(params=["tmpfs", "fsize"])
def small_disk(request, tmp_path):
    """(directory, preexec_fn, what a write there fails with): a 64 KiB tmpfs, or a plain
    directory written by a child whose file size limit is 64 KiB."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if request.param == "fsize":
        yield disk, lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10)), "file too large"
        return
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0755", "tmpfs", str(disk)], capture_output=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({p.stderr.decode().strip() or p.returncode}); the fsize case runs")
    try:
        yield disk, None, "no space left on device"
    finally:
        if subprocess.run(["umount", str(disk)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@pytest.mark.parametrize("kind", ["full matrix", "pack", "tsv"])
def test_full_disk_is_exit_2_naming_the_output_and_leaves_nothing(tmp_path, small_disk, kind):
    """Defect 1: the full matrix and pack wrote through a sparse memory map and died of SIGBUS
    (exit 135), leaving their temporary; .tsv said "internal error" (exit 1)."""
    disk, preexec, words = small_disk
    np.save(tmp_path / "many.npy", np.ones((50_000, 1, 8), np.float32))  # 1.6 MB; its score matrix 400 KB
    q = queries(tmp_path / "q.npy")
    out = {"full matrix": disk / "fm.npy", "pack": disk / "sh", "tsv": disk / "o.tsv"}[kind]
    args = {"full matrix": ["score", "--queries", q, "--docs", tmp_path / "many.npy", "--full-matrix", "--out", out, "--cpu"],
            "pack": ["pack", tmp_path / "many.npy", "--out", out],
            "tsv": ["score", "--queries", q, "--docs", tmp_path / "many.npy", "-k", 4000, "--out", out, "--cpu"]}[kind]
    p = lik(*args, preexec_fn=preexec)
    one_line(p.returncode, p.stderr, out, words)
    assert listing(disk) == []


def test_a_full_disk_keeps_the_previous_output(tmp_path, small_disk):
    disk, preexec, words = small_disk
    np.save(tmp_path / "many.npy", np.ones((50_000, 1, 8), np.float32))
    out = disk / "fm.npy"
    out.write_bytes(b"previous")
    p = lik("score", "--queries", queries(tmp_path / "q.npy"), "--docs", tmp_path / "many.npy", "--full-matrix",
            "--out", out, "--cpu", preexec_fn=preexec)
    one_line(p.returncode, p.stderr, out, words)
    assert listing(disk) == ["fm.npy"] and out.read_bytes() == b"previous"


# --------------------------------------------------------------------------- races


def _appear_during(monkeypatch, make):
    """Run ``make()`` once, in the middle of a shard's write (when its offsets are saved)."""
    real, done = np.save, []

    def save(*a, **kw):
        if not done:
            done.append(1)
            make()
        return real(*a, **kw)

    monkeypatch.setattr(np, "save", save)


def test_pack_never_deletes_a_directory_that_appears_at_out(tmp_path, monkeypatch, commit_mode):
    """Defect 2: without --force, whatever was at --out when the shard was renamed into place was
    moved away and deleted."""
    q = queries(tmp_path / "src.npy")
    out = tmp_path / "out"

    def someone_else():
        out.mkdir()
        (out / "precious.txt").write_text("keep me")

    _appear_during(monkeypatch, someone_else)
    r = run("pack", q, "--out", out)
    one_line(r.exit_code, r.stderr, out, "appeared while this run was writing it; nothing was replaced")
    assert listing(out) == ["precious.txt"] and (out / "precious.txt").read_text() == "keep me"
    assert listing(tmp_path) == ["out", "src.npy"]


def test_a_pack_racing_another_to_one_out_fails_and_keeps_the_winner(tmp_path, monkeypatch, commit_mode):
    """Defect 2: two packs to one --out both reported success, the second deleting the first's shard."""
    a, b = queries(tmp_path / "a.npy", seed=1), queries(tmp_path / "b.npy", n=3, seed=2)
    out = tmp_path / "out"
    _appear_during(monkeypatch, lambda: shards.pack(shards.open_input(str(b)), out))
    r = run("pack", a, "--out", out)
    one_line(r.exit_code, r.stderr, out, "appeared while this run was writing it")
    assert shards.open_shard(out).num_docs == 3  # the other run's shard, whole
    assert listing(tmp_path) == ["a.npy", "b.npy", "out"]


def test_two_pack_processes_to_one_out_one_succeeds(tmp_path):
    """Defect 2 with real processes: both start before either finishes; exactly one succeeds."""
    sources = [queries(tmp_path / f"{i}.npy", n=2 + i, seed=i) for i in range(2)]
    out = tmp_path / "out"
    procs = [lik_popen("pack", s, "--out", out, prelude=slow("numpy.save", 1.0), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True) for s in sources]
    results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    assert sorted(code for code, _ in results) == [0, 2], results
    loser = next(err for code, err in results if code == 2)
    one_line(2, loser, out)
    assert shards.open_shard(out).num_docs in (2, 3)
    assert listing(tmp_path) == ["0.npy", "1.npy", "out"]


def test_pack_force_never_deletes_files_that_are_not_the_shards(tmp_path, commit_mode):
    """Defect 5: --force onto a directory whose manifest.json parses deleted everything in it."""
    src = queries(tmp_path / "src.npy")
    out = tmp_path / "out"
    make_shard(out)
    before = {n: (out / n).read_bytes() for n in listing(out)}
    (out / "notes.txt").write_text("keep me")
    r = run("pack", src, "--out", out, "--force")
    one_line(r.exit_code, r.stderr, out, "notes.txt")
    assert (out / "notes.txt").read_text() == "keep me"
    assert {n: (out / n).read_bytes() for n in before} == before
    (out / "notes.txt").unlink()
    (out / "sub").mkdir()  # a subdirectory is not a shard's either
    r = run("pack", src, "--out", out, "--force")
    one_line(r.exit_code, r.stderr, out, "sub")
    (out / "sub").rmdir()
    assert run("pack", src, "--out", out, "--force").exit_code == 0  # a shard alone is replaced
    assert listing(out) == ["manifest.json", "offsets.npy", "tokens.npy"] and shards.open_shard(out).num_docs == 2
    assert listing(tmp_path) == ["out", "src.npy"]


def test_pack_force_rechecks_what_it_replaces(tmp_path, monkeypatch, commit_mode):
    """A file that appears in the shard being replaced, during the run, is kept with its shard."""
    src = queries(tmp_path / "src.npy")
    out = tmp_path / "out"
    make_shard(out)
    _appear_during(monkeypatch, lambda: (out / "late.txt").write_text("keep me"))
    r = run("pack", src, "--out", out, "--force")
    one_line(r.exit_code, r.stderr, out, "late.txt")
    assert (out / "late.txt").read_text() == "keep me" and shards.open_shard(out).num_docs == 6
    assert listing(tmp_path) == ["out", "src.npy"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs mkfifo")
def test_score_replaces_a_regular_file_and_nothing_else(tmp_path, monkeypatch, commit_mode):
    """An output that is (or becomes, during the run) a FIFO or a device is never replaced."""
    shard, q = make_shard(tmp_path / "shard").path, queries(tmp_path / "q.npy")
    fifo = tmp_path / "fifo.tsv"
    os.mkfifo(fifo)
    r = run("score", "--queries", q, "--docs", shard, "--out", fifo, "--cpu")
    one_line(r.exit_code, r.stderr, fifo, "is a FIFO")
    os.symlink("/dev/null", tmp_path / "null.tsv")
    r = run("score", "--queries", q, "--docs", shard, "--out", tmp_path / "null.tsv", "--cpu")
    one_line(r.exit_code, r.stderr, tmp_path / "null.tsv", "is a character device")
    late = tmp_path / "late.tsv"
    real = lik_cupy.retrieve
    monkeypatch.setattr(lik_cupy, "retrieve", lambda *a, **kw: os.path.exists(late) or os.mkfifo(late) or real(*a, **kw))
    r = run("score", "--queries", q, "--docs", shard, "--out", late, "--cpu")
    one_line(r.exit_code, r.stderr, late, "is a FIFO")
    assert os.path.exists(late) and not os.path.isfile(late)
    assert listing(tmp_path) == ["fifo.tsv", "late.tsv", "null.tsv", "q.npy", "shard"]
    assert os.readlink(tmp_path / "null.tsv") == "/dev/null"


# --------------------------------------------------------------------------- kills


@pytest.mark.parametrize("kind", ["tsv", "full matrix", "pack"])
def test_sigkill_mid_write_leaves_a_temporary_that_the_next_run_sweeps(tmp_path, kind):
    shard, q = make_shard(tmp_path / "shard", n_docs=40).path, queries(tmp_path / "q.npy")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    target = {"tsv": "r.tsv", "full matrix": "m.npy", "pack": "packed"}[kind]
    args = {"tsv": ["score", "--queries", q, "--docs", shard, shard, "--out", out_dir / target, "--cpu"],
            "full matrix": ["score", "--queries", q, "--docs", shard, shard, "--full-matrix", "--out", out_dir / target,
                            "--cpu"],
            "pack": ["pack", shard, "--out", out_dir / target]}[kind]
    hook = {"tsv": "lik_cupy.retrieve", "full matrix": "lik_cupy.maxsim_varlen", "pack": "numpy.save"}[kind]
    p = lik_popen(*args, prelude=slow(hook, 30), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: listing(out_dir), p, "temporary output")
        time.sleep(0.2)
        p.send_signal(signal.SIGKILL)
    finally:
        p.kill()
        p.wait(timeout=60)
    left = listing(out_dir)
    assert target not in left and left and all(n.startswith(".") for n in left), left
    r = lik(*args)
    assert r.returncode == 0, r.stderr
    assert listing(out_dir) == [target]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    try:
        os.kill(p.pid, 0)
    except ProcessLookupError:
        return p.pid
    pytest.skip("the pid of a finished process was taken again at once")


def test_the_sweep_removes_only_dead_temporaries_of_this_host(tmp_path):
    shard, q = make_shard(tmp_path / "shard").path, queries(tmp_path / "q.npy")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    host = _atomic._HOST.decode()
    other = f"{(int(host, 16) ^ 1):08x}"
    dead = _dead_pid()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        swept = [f".r.tsv.lik-tmp.{dead}.{host}.0123abcd", f".other.npy.lik-tmp.{dead}.{host}.4567cdef",
                 f".shard.lik-tmp.{dead}.{host}.89abcdef"]
        kept = [f".r.tsv.lik-tmp.{live.pid}.{host}.0123abcd",  # a writer still running
                f".r.tsv.lik-tmp.{dead}.{other}.0123abcd",  # another host's (a shared directory)
                f".r.tsv.lik-tmp.{dead}.{host}.0123abc",  # not the pattern
                f"r.tsv.lik-tmp.{dead}.{host}.0123abcd", ".r.tsv.keep", "notes.txt",
                f".other.lik-tmp.{dead}.{host}.0123abcd.old"]  # another target's, moved aside: left for it
        for name in swept + kept:
            if name.startswith(".shard") or name.endswith(".old"):
                (out_dir / name).mkdir()
                (out_dir / name / "tokens.npy").write_bytes(b"x")
            else:
                (out_dir / name).write_text("x")
        r = run("score", "--queries", q, "--docs", shard, "--out", out_dir / "r.tsv", "--cpu")
        assert r.exit_code == 0, r.stderr
        assert listing(out_dir) == sorted(kept + ["r.tsv"])
    finally:
        live.kill()
        live.wait()


def test_a_shard_moved_aside_by_a_killed_run_is_put_back(tmp_path):
    """The locked fallback moves a shard being replaced aside for a moment; killed then, the next
    write of that target puts it back rather than sweeping it."""
    host = _atomic._HOST.decode()
    aside = tmp_path / f".shard.lik-tmp.{_dead_pid()}.{host}.0123abcd.old"
    make_shard(aside)
    r = run("pack", queries(tmp_path / "q.npy"), "--out", tmp_path / "shard")
    one_line(r.exit_code, r.stderr, tmp_path / "shard", "already exists")
    assert listing(tmp_path) == ["q.npy", "shard"] and shards.open_shard(tmp_path / "shard").num_docs == 6


def test_a_cut_name_moves_back_only_its_own_set_aside_shard(tmp_path):
    """Two targets whose names share the part a temporary's name keeps (names past ~213 bytes):
    the sweep moved the other's set-aside shard onto this one. A cut name now ends in a hash of the
    whole name."""
    a, b = tmp_path / ("s" * 213 + "_A_target"), tmp_path / ("s" * 213 + "_B_other")
    own_a, own_b = _atomic._prefix(str(a)), _atomic._prefix(str(b))
    assert own_a != own_b and len(own_a) == len(own_b)
    aside = tmp_path / os.fsdecode(own_b + b"%d.%s.0123abcd.old" % (_dead_pid(), _atomic._HOST))
    make_shard(aside)
    r = run("pack", queries(tmp_path / "q.npy"), "--out", a)
    assert r.exit_code == 0, r.stderr
    assert shards.open_shard(a).num_docs == 2 and aside.is_dir()  # b's shard left for b's next write


def test_pids_of_another_pid_namespace_are_another_host(monkeypatch):
    """Containers sharing a volume may share a host name, not their pids: the sweep took a live
    writer's temporary in another pid namespace for a dead one of its own."""
    here = _atomic._where_pids_mean()
    real = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: os.stat_result((0, 12345, 0, 0, 0, 0, 0, 0, 0, 0))
                        if p == "/proc/self/ns/pid" else real(p, *a, **k))
    assert _atomic._where_pids_mean() != here or not os.path.exists("/proc/self/ns/pid")


# --------------------------------------------------------------------------- --check, --d-lengths


def test_pack_check_refuses_values_the_cast_makes_inf(tmp_path):
    """Defect 3: --check looked at the float32 input, then float16 stored 70000 as inf."""
    x = np.ones((3, 4, 8), np.float32)
    x[1, 2, 3] = 70000
    np.save(tmp_path / "f32.npy", x)
    r = run("pack", tmp_path / "f32.npy", "--dtype", "float16", "--check", "--out", tmp_path / "s")
    one_line(r.exit_code, r.stderr, tmp_path / "f32.npy", "document 1, token 2 holds 70000, which is inf as float16")
    assert listing(tmp_path) == ["f32.npy"]
    assert run("pack", tmp_path / "f32.npy", "--dtype", "float32", "--check", "--out", tmp_path / "s").exit_code == 0


def test_score_check_refuses_queries_the_cast_makes_inf(tmp_path, monkeypatch):
    """Defect 3: queries were checked, then cast to the corpus's float16 and scored as inf."""
    rng = np.random.default_rng(0)
    shards.write_shard(tmp_path / "s16", rng.standard_normal((9, 8)).astype(np.float16), np.array([0, 4, 9]))
    q = rng.standard_normal((2, 3, 8)).astype(np.float32)
    q[1, 2, 5] = -70000
    np.save(tmp_path / "q.npy", q)
    calls = []
    monkeypatch.setattr(lik_cupy, "retrieve", lambda *a, **kw: calls.append(1))
    r = run("score", "--queries", tmp_path / "q.npy", "--docs", tmp_path / "s16", "--out", tmp_path / "r.tsv",
            "--check", "--cpu")
    one_line(r.exit_code, r.stderr, tmp_path / "q.npy", "query 1, token 2 holds 70000, which is inf as float16")
    assert calls == [] and listing(tmp_path) == ["q.npy", "s16"]


def test_the_same_npy_twice_takes_its_lengths_by_position(tmp_path):
    """Defect 4: lengths were looked up by path, so both copies got the last lengths file."""
    rng = np.random.default_rng(3)
    docs = rng.standard_normal((4, 5, 8)).astype(np.float32)
    np.save(tmp_path / "d.npy", docs)
    np.save(tmp_path / "l1.npy", np.array([5, 5, 5, 5]))
    np.save(tmp_path / "l2.npy", np.array([1, 2, 1, 2]))
    q = queries(tmp_path / "q.npy")
    r = run("score", "--queries", q, "--docs", tmp_path / "d.npy", tmp_path / "d.npy", "--d-lengths",
            tmp_path / "l1.npy", tmp_path / "l2.npy", "--full-matrix", "--out", tmp_path / "m.npy", "--cpu")
    assert r.exit_code == 0, r.stderr
    Q = np.load(q).astype(np.float64)
    ragged = [docs[j, :n] for j, n in enumerate([5, 5, 5, 5])] + [docs[j, :n] for j, n in enumerate([1, 2, 1, 2])]
    S = np.array([[(qq @ d.T.astype(np.float64)).max(axis=1).sum() for d in ragged] for qq in Q])
    np.testing.assert_allclose(np.load(tmp_path / "m.npy"), S, rtol=1e-5)


# --------------------------------------------------------------------------- hostile files


def _json_cases(t: pathlib.Path):
    """(name, how to make the file at t/<file>, words the error says: one for both files, or (the
    doclens file's, the manifest's))."""
    deep = "[" * 100_000 + "]" * 100_000
    return [
        ("nested too deeply", lambda p: p.write_text(deep), ("found '[' at byte 1", "nested too deeply")),
        ("an integer of 5000 digits", lambda p: p.write_text("[" + "7" * 5000 + "]"), None),
        ("not UTF-8", lambda p: p.write_bytes(b"[1, \xff]"), None),
        ("a byte order mark", lambda p: p.write_bytes(b"\xef\xbb\xbf[1, 2]"), None),
        ("empty", lambda p: p.write_bytes(b""), None),
        ("a FIFO", lambda p: os.mkfifo(p), "is a FIFO"),
        ("a directory", lambda p: p.mkdir(), "is a directory"),
        ("/dev/zero", lambda p: os.symlink("/dev/zero", p), "is a character device"),
    ]


@pytest.mark.parametrize("case", range(len(_json_cases(pathlib.Path()))),
                         ids=[c[0] for c in _json_cases(pathlib.Path())])
def test_malformed_json_is_exit_2_naming_the_file(tmp_path, case):
    name, make, words = _json_cases(tmp_path)[case]
    doclens_words, manifest_words = words if isinstance(words, tuple) else (words, words)
    q = queries(tmp_path / "q.npy")
    np.save(tmp_path / "flat.npy", np.ones((3, 8), np.float32))
    lens = tmp_path / "doclens.0.json"
    make(lens)
    p = lik("score", "--queries", q, "--docs", tmp_path / "flat.npy", "--d-lengths", lens, "--out", tmp_path / "r.tsv",
            "--cpu", timeout=60)
    one_line(p.returncode, p.stderr, lens, doclens_words)
    shard = make_shard(tmp_path / "shard").path
    os.unlink(os.path.join(shard, "manifest.json"))
    make(pathlib.Path(shard) / "manifest.json")
    p = lik("score", "--queries", q, "--docs", shard, "--out", tmp_path / "r.tsv", "--cpu", timeout=60)
    one_line(p.returncode, p.stderr, os.path.join(shard, "manifest.json"), manifest_words)
    assert not (tmp_path / "r.tsv").exists()


@pytest.mark.parametrize("text", ["[1, 99999999999999999999]", "[1, -99999999999999999999]", "[1, NaN]", "{}", "[[1]]"])
def test_doclens_json_values_out_of_range_are_exit_2(tmp_path, text):
    (tmp_path / "doclens.json").write_text(text)
    np.save(tmp_path / "flat.npy", np.ones((3, 8), np.float32))
    r = run("pack", tmp_path / "flat.npy", "--lengths", tmp_path / "doclens.json", "--out", tmp_path / "s")
    one_line(r.exit_code, r.stderr, tmp_path / "doclens.json")


@pytest.mark.parametrize("shape", ["(-1, 3)", "(4611686018427387904, 8)", "(2**62, 2**62)", "(0, 4611686018427387904)",
                                   "(9223372036854775807, 1, 1)", "(3, 5, 8)"])
def test_npy_headers_with_impossible_shapes_are_one_line(tmp_path, shape):
    s = str(eval(shape))  # noqa: S307 - the test's own literals
    text = "{'descr': '<f4', 'fortran_order': False, 'shape': %s, }" % s
    header = (text + " " * (64 - (10 + len(text) + 1) % 64) + "\n").encode()
    (tmp_path / "x.npy").write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + b"\0" * 64)
    r = lik("score", "--queries", tmp_path / "x.npy", "--docs", make_shard(tmp_path / "s").path, "--out",
            tmp_path / "r.tsv", "--cpu")
    one_line(r.returncode, r.stderr, tmp_path / "x.npy")


@pytest.mark.parametrize("bad", ["a\ud800", "\udc80z"])
def test_ids_that_utf8_cannot_write_are_refused_by_index(tmp_path, bad):
    """A lone surrogate in a str id crashed lik score's .tsv writer (UnicodeEncodeError, exit 1)."""
    shard = make_shard(tmp_path / "s", n_docs=3, ids=["a", "b", "c"]).path
    np.save(os.path.join(shard, "ids.npy"), np.array(["a", bad, "c"]))
    r = run("score", "--queries", queries(tmp_path / "q.npy"), "--docs", shard, "--out", tmp_path / "r.tsv", "--cpu")
    one_line(r.exit_code, r.stderr, os.path.join(shard, "ids.npy"), "id at index 1")
    assert "no character (a lone surrogate, or past U+10FFFF)" in r.stderr and not (tmp_path / "r.tsv").exists()
    with pytest.raises(shards.ShardError, match="id at index 1"):
        shards.write_shard(tmp_path / "t", np.ones((3, 8), np.float32), [0, 1, 2, 3], ids=["a", bad, "c"])


@pytest.mark.skipif(sys.platform != "linux", reason="file names of any bytes")
def test_per_doc_ids_of_file_names_that_are_not_utf8(tmp_path):
    """lik pack --per-doc took a name's undecodable bytes as lone surrogates, which lik score could not write."""
    with open(os.path.join(os.fsencode(tmp_path), b"doc\xff.npy"), "wb") as f:
        np.save(f, np.ones((3, 8), np.float32))
    name = os.fsdecode(os.path.join(os.fsencode(tmp_path), b"doc\xff.npy"))
    assert run("pack", "--per-doc", name, "--out", tmp_path / "pd").exit_code == 0
    assert np.load(tmp_path / "pd" / "ids.npy").tolist() == ["doc\\xff"]
    r = run("score", "--queries", queries(tmp_path / "q.npy"), "--docs", tmp_path / "pd", "--out", tmp_path / "r.tsv",
            "--cpu")
    assert r.exit_code == 0 and "\tdoc\\xff\t" in (tmp_path / "r.tsv").read_text()


@pytest.mark.parametrize("version, length", [(2, 0xFFFFFFF0), (1, 0xFFFF), (2, 20_000)])
def test_npy_header_lengths_are_checked_before_they_are_read(tmp_path, version, length):
    """NumPy's reader reads the header length a file gives before checking it: a 74-byte file
    claiming a 4 GiB header made it allocate 4 GiB. The length is checked first now."""
    text = b"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 8), }\n"
    size = 2 if version == 1 else 4
    body = text + b" " * max(0, length - len(text)) if length <= 20_000 else text
    path = tmp_path / "x.npy"
    path.write_bytes(b"\x93NUMPY" + bytes([version, 0]) + length.to_bytes(size, "little") + body)
    tracemalloc.start()
    try:
        with pytest.raises(shards.ShardError, match="corrupt .npy header: it claims") as e:
            shards.open_input(str(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20 and str(path) in str(e.value)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs mkfifo")
def test_special_files_are_refused_by_what_they_are(tmp_path):
    """A FIFO given as an input was opened and waited on for ever; now every input is opened
    without blocking and refused unless it is a regular file."""
    shard = make_shard(tmp_path / "shard").path
    q = queries(tmp_path / "q.npy")
    os.mkfifo(tmp_path / "fifo.npy")
    os.mkfifo(tmp_path / "fifo_lens.npy")
    (tmp_path / "dir.npy").mkdir()
    fifo_shard = make_shard(tmp_path / "fifo_shard").path
    os.unlink(os.path.join(fifo_shard, "offsets.npy"))
    os.mkfifo(os.path.join(fifo_shard, "offsets.npy"))
    np.save(tmp_path / "pad.npy", np.ones((3, 4, 8), np.float32))
    out = tmp_path / "r.tsv"
    cases = [
        (["--queries", tmp_path / "fifo.npy", "--docs", shard], tmp_path / "fifo.npy", "is a FIFO"),
        (["--queries", q, "--docs", tmp_path / "fifo.npy"], tmp_path / "fifo.npy", "is a FIFO"),
        (["--queries", q, "--docs", fifo_shard], os.path.join(fifo_shard, "offsets.npy"), "is a FIFO"),
        (["--queries", q, "--docs", tmp_path / "pad.npy", "--d-lengths", tmp_path / "fifo_lens.npy"],
         tmp_path / "fifo_lens.npy", "is a FIFO"),
        (["--queries", "/dev/zero", "--docs", shard], "/dev/zero", "is a character device"),
        (["--queries", q, "--q-lengths", tmp_path / "dir.npy", "--docs", shard], tmp_path / "dir.npy", "is a directory"),
    ]
    for args, culprit, words in cases:
        p = lik("score", *args, "--out", out, "--cpu", timeout=60)
        one_line(p.returncode, p.stderr, culprit, words)
    assert not out.exists()


def test_names_at_and_past_the_file_name_limit(tmp_path):
    """A 255-byte output name is fine (its temporary's name is cut to fit); 256 bytes is one line
    saying the name is too long, for outputs and inputs alike."""
    shard, q = make_shard(tmp_path / "s").path, queries(tmp_path / "q.npy")
    longest = tmp_path / ("a" * 251 + ".tsv")  # 255 bytes
    r = run("score", "--queries", q, "--docs", shard, "--out", longest, "--cpu")
    assert r.exit_code == 0, r.stderr
    assert longest.exists()
    packed = tmp_path / ("é" * 127 + "p")  # 255 bytes, multi-byte characters cut by the temporary's name
    r = run("pack", q, "--out", packed)
    assert r.exit_code == 0, r.stderr
    too_long = tmp_path / ("a" * 252 + ".tsv")
    r = run("score", "--queries", q, "--docs", shard, "--out", too_long, "--cpu")
    one_line(r.exit_code, r.stderr, too_long, "file name too long")
    r = run("pack", q, "--out", tmp_path / ("b" * 256))
    one_line(r.exit_code, r.stderr, tmp_path / ("b" * 256), "file name too long")
    r = run("score", "--queries", tmp_path / ("c" * 256 + ".npy"), "--docs", shard, "--out", tmp_path / "r.tsv", "--cpu")
    one_line(r.exit_code, r.stderr, tmp_path / ("c" * 256 + ".npy"), "file name too long")
    assert sorted(listing(tmp_path)) == sorted([longest.name, packed.name, "q.npy", "s"])


BREAKS = ["\t", "\n", "\r", "\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029", "\x00"]


@pytest.mark.parametrize("kind", ["str", "bytes"])
@pytest.mark.parametrize("ch", BREAKS, ids=[f"U+{ord(c):04X}" for c in BREAKS])
def test_ids_with_a_line_break_or_nul_are_refused(tmp_path, ch, kind):
    """No id can break the one-result-per-line formats: any Unicode line break, a tab or a NUL
    inside an id is refused when ids are packed, and when a shard holding one is opened."""
    ids = np.array(["a", f"b{ch}c", "d"])
    if kind == "bytes":
        ids = np.array([i.encode() for i in ids.tolist()])
    np.save(tmp_path / "ids.npy", ids)
    q = queries(tmp_path / "q.npy", n=3)
    r = run("pack", q, "--ids", tmp_path / "ids.npy", "--out", tmp_path / "s")
    one_line(r.exit_code, r.stderr, tmp_path / "ids.npy", "id at index 1")
    assert not (tmp_path / "s").exists()
    make_shard(tmp_path / "s", n_docs=3, ids=np.array(["x", "y", "z"]))
    np.save(tmp_path / "s" / "ids.npy", ids)
    r = run("score", "--queries", q, "--docs", tmp_path / "s", "--out", tmp_path / "r.tsv", "--cpu")
    one_line(r.exit_code, r.stderr, tmp_path / "s" / "ids.npy", "id at index 1")


def test_ids_of_any_other_character_keep_one_result_per_line(tmp_path):
    weird = ["é", "\u00a0", "\u200b", "a b", "\\n", "😀", "\x7f", "x\x01y"]
    make_shard(tmp_path / "s", n_docs=len(weird), ids=np.array(weird))
    q = queries(tmp_path / "q.npy")
    for out in ("r.tsv", "r.jsonl"):
        r = run("score", "--queries", q, "--docs", tmp_path / "s", "-k", len(weird), "--out", tmp_path / out, "--cpu")
        assert r.exit_code == 0, r.stderr
    rows = (tmp_path / "r.tsv").read_text(encoding="utf-8").splitlines()
    assert len(rows) == 1 + 2 * len(weird) and sorted({r.split("\t")[2] for r in rows[1:]}) == sorted(weird)
    objs = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(objs) == 2 * len(weird) and sorted({o["doc"] for o in objs}) == sorted(weird)


# --------------------------------------------------------------------------- pipes, permissions, GPUs


def test_closed_stdout_ends_quietly_with_141(tmp_path):
    """`lik inspect ... | head -1`: the reader went away. Quiet, and 141 (128 + SIGPIPE) as a shell
    reports a program SIGPIPE ended; it was "internal error: BrokenPipeError", exit 1."""
    shard = make_shard(tmp_path / "s").path
    for args in (["inspect", shard], ["pack", shard, "--out", tmp_path / "p"]):
        p = lik_popen(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        p.stdout.close()  # before the child has written anything
        err = p.stderr.read()
        assert p.wait(timeout=120) == 141 and err == b"", (args, p.returncode, err)


def test_out_dev_stdout_is_one_line_and_creates_nothing(tmp_path):
    shard, q = make_shard(tmp_path / "s").path, queries(tmp_path / "q.npy")
    before = listing("/dev")
    p = subprocess.run(f"{sys.executable} -c \"$LIK\" score --queries {q} --docs {shard} --out /dev/stdout --cpu | head -1",
                       shell=True, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, LIK=LIK, PYTHONPATH=child_pythonpath()), executable="/bin/bash")
    one_line(2, p.stderr, "/dev/stdout")
    assert listing("/dev") == before


def _without_dac_override():
    """preexec_fn: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding set, so that a root
    child is held to file modes after exec (prctl PR_CAPBSET_DROP)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.fixture
def modes_bind(tmp_path):
    """A preexec_fn under which file modes bind the child ``lik`` (None when not root); skips where
    that cannot be had."""
    preexec = _without_dac_override if os.geteuid() == 0 else None
    probe = tmp_path / "probe"
    probe.write_text("x")
    probe.chmod(0)
    try:
        p = subprocess.run([sys.executable, "-c", f"open({str(probe)!r})"], preexec_fn=preexec, capture_output=True)
    except subprocess.SubprocessError as e:
        pytest.skip(f"cannot drop the capabilities that override file modes: {e}")
    finally:
        probe.unlink()
    if p.returncode == 0:
        pytest.skip("file modes do not bind a child process here")
    return preexec


def test_permission_errors_say_permission_denied(tmp_path, modes_bind):
    """An unreadable shard directory was "no such file; a shard directory holds manifest.json ..."."""
    shard, q = make_shard(tmp_path / "s").path, queries(tmp_path / "q.npy")
    locked = make_shard(tmp_path / "locked").path
    os.chmod(locked, 0)
    secret = queries(tmp_path / "secret.npy")
    secret.chmod(0)
    np.save(tmp_path / "ids.npy", np.arange(2))
    (tmp_path / "ids.npy").chmod(0)
    out = tmp_path / "r.tsv"
    try:
        cases = [(["score", "--queries", q, "--docs", locked, "--out", out, "--cpu"], os.path.join(locked, "manifest.json")),
                 (["inspect", locked], os.path.join(locked, "manifest.json")),
                 (["score", "--queries", secret, "--docs", shard, "--out", out, "--cpu"], secret),
                 (["pack", q, "--ids", tmp_path / "ids.npy", "--out", tmp_path / "p"], tmp_path / "ids.npy")]
        for args, culprit in cases:
            p = lik(*args, preexec_fn=modes_bind)
            one_line(p.returncode, p.stderr, culprit)
            assert p.stderr.rstrip().endswith(": permission denied"), p.stderr
        # A directory that may be written but not listed: the output is written; nothing can be swept.
        wo = tmp_path / "write_only"
        wo.mkdir()
        wo.chmod(0o300)
        p = lik("score", "--queries", q, "--docs", shard, "--out", wo / "r.tsv", "--cpu", preexec_fn=modes_bind)
        assert p.returncode == 0, p.stderr
        assert (wo / "r.tsv").exists()
    finally:
        os.chmod(locked, 0o755)


def test_warmup_without_a_gpu_is_a_clear_error():
    if lik_cupy.gpu_available():
        pytest.skip("a GPU is visible: warmup works")
    with pytest.raises(RuntimeError, match=r"^lik_cupy.warmup: no CUDA GPU is visible"):
        lik_cupy.warmup()


def test_plaid_to_device_without_a_gpu_is_a_clear_error():
    """PlaidIndex.to_device() without a GPU raised CUDA's "cudaErrorInsufficientDriver" (or whatever
    the driver said), naming neither the call nor the missing GPU."""
    if lik_cupy.gpu_available():
        pytest.skip("a GPU is visible: to_device works")
    index = lik_cupy.PlaidIndex.open(pathlib.Path(__file__).parent / "data" / "fast_plaid" / "fast_plaid_nbits2")
    for device in (None, 0):
        with pytest.raises(RuntimeError, match=r"^PlaidIndex.to_device: no CUDA GPU is visible"):
            index.to_device(device)


def test_inspect_touches_nothing_outside_the_shard(tmp_path, monkeypatch):
    """inspect listed the size of every name in the manifest's "files", one leading outside the
    shard included (and a name that was no string was an internal error)."""
    shard = make_shard(tmp_path / "s").path
    (tmp_path / "outside.bin").write_bytes(b"x" * 12345)
    m = json.loads((tmp_path / "s" / "manifest.json").read_text())
    m["files"].update({"notes": "../outside.bin", "count": 5})
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(m))
    touched = []  # every path stat'ed or opened
    for name in ("stat", "lstat", "open"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda p, *a, _real=real, **kw: touched.append(p) or _real(p, *a, **kw))
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **kw: touched.append(p) or real_open(p, *a, **kw))
    r = run("inspect", shard, "--check")
    monkeypatch.undo()
    assert r.exit_code == 0, r.stderr
    files = [line for line in r.output.splitlines() if line.startswith("files ")]
    assert len(files) == 1 and "outside" not in files[0] and "12.1 KiB" not in r.output, files
    root = os.path.realpath(shard)
    paths = [os.path.realpath(os.fsdecode(p)) for p in touched if isinstance(p, (str, bytes, os.PathLike))]
    outside = [p for p in paths if p.startswith(str(tmp_path)) and os.path.commonpath([root, p]) not in (root, p)]
    assert any(p.startswith(root + os.sep) for p in paths) and not outside, outside  # (the shard's parents are walked)


# --------------------------------------------------------------------------- host memory, in bytes


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_host_memory_is_bounded_by_bytes_for_a_very_wide_d(tmp_path, monkeypatch):
    """The CPU path sized its blocks by similarities alone, not the float64 copy of d-wide tokens."""
    rng = np.random.default_rng(0)
    np.save(tmp_path / "d.npy", rng.standard_normal((200, 4, 8192)).astype(np.float16))  # 13 MB
    np.save(tmp_path / "q.npy", rng.standard_normal((2, 2, 8192)).astype(np.float16))
    real = cpu.maxsim_numpy
    monkeypatch.setattr(cpu, "maxsim_numpy", lambda *a, **kw: real(*a, **{**kw, "block_bytes": 1 << 20}))
    peak = _peak(lambda: cli.run_score(str(tmp_path / "q.npy"), [str(tmp_path / "d.npy")], str(tmp_path / "r.tsv"),
                                       cpu=True))
    assert peak < 16 << 20, f"{peak / 2**20:.0f} MiB for 1 MiB blocks"  # a float64 copy of the corpus: 52 MB


def test_host_memory_is_bounded_by_bytes_for_one_very_long_document(tmp_path):
    """Packed documents were padded 65,536 tokens at a time to their longest: one long document
    among 100 short ones made a 517 MB array."""
    make_shard(tmp_path / "s", dim=64, lengths=[20_000] + [5] * 100)
    q = queries(tmp_path / "q.npy", dim=64, length=4)
    peak = _peak(lambda: cli.run_score(str(q), [str(tmp_path / "s")], str(tmp_path / "r.tsv"), cpu=True))
    assert peak < 128 << 20, f"{peak / 2**20:.0f} MiB"


def test_host_memory_is_bounded_by_bytes_for_one_very_long_query(tmp_path):
    """The queries were padded to the longest: one query of 10,000 tokens among 200 of 2 made 257 MB."""
    rng = np.random.default_rng(0)
    lens = np.array([2] * 100 + [10_000] + [2] * 100)
    np.save(tmp_path / "q.npy", rng.standard_normal((int(lens.sum()), 32)).astype(np.float32))
    np.save(tmp_path / "ql.npy", lens)
    make_shard(tmp_path / "s", dim=32, n_docs=20)
    args = dict(q_lengths=str(tmp_path / "ql.npy"), cpu=True, top_k=3)
    peak = _peak(lambda: cli.run_score(str(tmp_path / "q.npy"), [str(tmp_path / "s")], str(tmp_path / "r.npy"), **args))
    assert peak < 128 << 20, f"{peak / 2**20:.0f} MiB"
    # the same ranking as the queries scored one at a time
    got = np.load(tmp_path / "r.npy")
    starts = np.concatenate([[0], np.cumsum(lens)])
    tokens = np.load(tmp_path / "q.npy")
    for i in (0, 100, 200):
        np.save(tmp_path / "one.npy", tokens[starts[i] : starts[i + 1]][None])
        cli.run_score(str(tmp_path / "one.npy"), [str(tmp_path / "s")], str(tmp_path / "one_r.npy"), cpu=True, top_k=3)
        np.testing.assert_array_equal(np.load(tmp_path / "one_r.npy")[0], got[i])


def test_host_memory_is_bounded_by_bytes_for_many_queries_with_a_large_k(tmp_path, monkeypatch):
    """Each part's top k was merged into the running one for every query at once, about 48 bytes a
    candidate: 1,024 queries' top 1,024 (12 MiB) peaked at 132 MiB with 1 MiB blocks. A block of
    queries at a time is merged now, within the parts' bytes (50 MiB), with the same ranking."""
    from lik_cupy._streaming import cpu as streaming_cpu

    rng = np.random.default_rng(0)
    nq = k = 1024
    docs = rng.standard_normal((4500, 4)).astype(np.float32)
    for n in range(3):
        shards.write_shard(tmp_path / f"s{n}", docs[1500 * n : 1500 * (n + 1)], np.arange(1501))
    Q = rng.standard_normal((nq, 1, 4)).astype(np.float32)
    np.save(tmp_path / "q.npy", Q)
    real = cpu.maxsim_packed_numpy
    monkeypatch.setattr(cpu, "maxsim_packed_numpy", lambda *a, **kw: real(*a, **{**kw, "block_bytes": 1 << 20}))
    monkeypatch.setattr(streaming_cpu, "_CPU_STEP_BYTES", 1 << 20)
    monkeypatch.setattr(cli, "_PART_BYTES", 1 << 20)
    paths = [str(tmp_path / f"s{n}") for n in range(3)]

    def run():
        cli.run_score(str(tmp_path / "q.npy"), paths, str(tmp_path / "r.npy"), top_k=k, cpu=True)

    run()  # (NumPy's lazy imports, once)
    (tmp_path / "r.npy").unlink()
    peak = _peak(run)
    assert peak < 6 * nq * k * 12, f"{peak / 2**20:.0f} MiB for a {nq * k * 12 / 2**20:.0f} MiB top k"
    want = lik_cupy.retrieve(Q, docs[:, None], k, backend="cpu")[1]
    np.testing.assert_array_equal(np.load(tmp_path / "r.npy"), want)


def test_host_memory_is_bounded_by_bytes_for_many_empty_queries(tmp_path):
    """Queries without tokens were padded to one row each: 20,000 of them of d = 4,096 (a file of
    176 KB) took 328 MB; at d = 131,072 a 1 MB file asked for 32 GiB."""
    lens = np.array([1] + [0] * 20_000)
    np.save(tmp_path / "q.npy", np.ones((1, 4096), np.float32))
    np.save(tmp_path / "ql.npy", lens)
    make_shard(tmp_path / "s", dim=4096, n_docs=3)
    out = tmp_path / "r.npy"
    peak = _peak(lambda: cli.run_score(str(tmp_path / "q.npy"), [str(tmp_path / "s")], str(out),
                                       q_lengths=str(tmp_path / "ql.npy"), cpu=True, full_matrix=True))
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB"
    S = np.load(out)
    assert S.shape == (20_001, 3) and (S[1:] == 0).all() and np.isfinite(S[0]).all()  # an empty query scores 0


@pytest.mark.parametrize("suffix", [".tsv", ".jsonl", ".npy"])
def test_host_memory_is_bounded_by_bytes_for_ids_declared_wide(tmp_path, suffix):
    """Results' ids were gathered at the width ids.npy declares: short ids in a <U100000 array
    (4 MB for 10 documents) took 800 MB for 200 queries' top 10 (37 GiB for 10,000)."""
    rng = np.random.default_rng(0)
    make_shard(tmp_path / "s", n_docs=10, ids=np.array([f"doc-{i}" for i in range(10)], dtype="<U100000"))
    assert np.load(tmp_path / "s" / "ids.npy").dtype == np.dtype("<U100000")
    np.save(tmp_path / "q.npy", rng.standard_normal((200, 1, 8)).astype(np.float32))
    out = tmp_path / f"r{suffix}"
    peak = _peak(lambda: cli.run_score(str(tmp_path / "q.npy"), [str(tmp_path / "s")], str(out), cpu=True, top_k=10))
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB"
    S = lik_cupy.maxsim_varlen(np.load(tmp_path / "q.npy"), *_shard_docs(tmp_path / "s"), backend="cpu")
    want = np.array([f"doc-{i}" for i in range(10)])[np.argsort(-S, axis=1, kind="stable")]
    if suffix == ".npy":
        got = np.load(out)
        assert got.dtype == np.dtype("<U5")  # as wide as the longest id given back
    elif suffix == ".tsv":
        got = np.array([line.split("\t")[2] for line in out.read_text().splitlines()[1:]]).reshape(200, 10)
    else:
        got = np.array([json.loads(line)["doc"] for line in out.read_text().splitlines()]).reshape(200, 10)
    assert (got == want).all()


def _shard_docs(path):
    s = shards.open_shard(str(path))
    return np.asarray(s.tokens), np.asarray(s.offsets)


def test_cpu_blocks_split_long_documents_exactly(rng):
    """A document scored in runs of its tokens gives the whole document's scores and argmax, bit
    for bit: NaN, -inf, ties to the first token, masks and INT8 scales included."""
    nq, lq, nd, ld, dim = 3, 5, 7, 40, 16
    Q = rng.integers(-3, 4, (nq, lq, dim)).astype(np.float32)
    D = rng.integers(-3, 4, (nd, ld, dim)).astype(np.float32)
    D[2, 30] = np.nan
    D[4, 5:] = D[4, 0]  # ties with the first token
    qv, dv = rng.random((nq, lq)) < 0.8, rng.random((nd, ld)) < 0.7
    dv[3] = False
    whole = cpu.maxsim_numpy(Q, D, qv, dv, candidates=False, nd=nd, return_argmax=True)
    for block in (1, 200, 2000, 8 * (dim + 2 * lq) * 7):
        got = cpu.maxsim_numpy(Q, D, qv, dv, candidates=False, nd=nd, return_argmax=True, block_bytes=block)
        np.testing.assert_array_equal(got[0], whole[0])
        np.testing.assert_array_equal(got[1], whole[1])
    from lik_cupy._cpu import quantize_numpy

    q8, qs = quantize_numpy(Q)
    d8, ds = quantize_numpy(D[[0, 1, 3, 4, 5, 6]])
    dv8 = dv[[0, 1, 3, 4, 5, 6]]
    whole = cpu.maxsim_numpy(q8, d8, qv, dv8, candidates=False, nd=6, return_argmax=True, q_scale=qs, d_scale=ds)
    got = cpu.maxsim_numpy(q8, d8, qv, dv8, candidates=False, nd=6, return_argmax=True, q_scale=qs, d_scale=ds,
                           block_bytes=300)
    np.testing.assert_array_equal(got[0], whole[0])
    np.testing.assert_array_equal(got[1], whole[1])
    # and the peak follows the budget, however long the one document is
    long_doc = rng.standard_normal((1, 200_000, dim)).astype(np.float16)
    ones = np.ones((1, 200_000), bool)
    peak = _peak(lambda: cpu.maxsim_numpy(Q, long_doc, qv, ones, candidates=False, nd=1, return_argmax=False,
                                          block_bytes=1 << 20))
    assert peak < 4 << 20, f"{peak / 2**20:.1f} MiB for 1 MiB blocks"  # the document in float64: 25.6 MB


def test_the_locked_fallback_opens_no_symbolic_link_planted_as_its_lock(tmp_path, monkeypatch):
    """Without renameat2 every write takes a lock file beside its target; a symbolic link planted
    under that name (a dangling one: where it points, nothing exists yet) is refused, and nothing is
    created where it points."""
    monkeypatch.setattr(_atomic, "_RENAMEAT2", None)
    target = tmp_path / "shard"
    lock = tmp_path / os.fsdecode(_atomic._prefix(str(target))[: -len(_atomic._TAG)] + b".lik-lock")
    victim = tmp_path / "elsewhere" / "created-by-lik"
    victim.parent.mkdir()
    lock.symlink_to(victim)
    tok = np.ones((3, 8), np.float16)
    with pytest.raises(OSError):
        shards.write_shard(target, tok, np.array([0, 1, 3]))
    assert not victim.exists() and not target.exists()
    assert lock.is_symlink()  # not ours: left where it was
