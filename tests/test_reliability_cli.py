"""The CLI's exit statuses where the environment fails it: a write the disk cuts short, a full
stdout, a scheduler that never answers, a shard that --force cannot remove (docs/reliability.md,
"Exit statuses and faults", maps each promise to its test here). CPU only; Linux.

Every case ends with exit status 2, one stderr line and nothing left behind but what was there.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from lik_command import child_pythonpath
from lik_command import run_lik as run
from test_reliability_files import (LIK, REPO, commit_mode, lik, listing, make_shard, modes_bind,  # noqa: F401
                                    one_line, queries, small_disk)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux files and devices")


# --------------------------------------------------------------------------- short writes


def _score_ids(tmp_path, out):
    """`lik score --cpu ... -k 41 --out ids.npy`: 250 x 41 int64 ids (82 KB, past a 64 KiB disk)."""
    q = tmp_path / "q.npy"
    np.save(q, np.random.default_rng(0).standard_normal((250, 4, 8)).astype(np.float32))
    np.save(tmp_path / "many.npy", np.ones((64, 1, 8), np.float32))
    return ["score", "--cpu", "--queries", q, "--docs", tmp_path / "many.npy", "-k", 41, "--out", out]


def _pack_1880(tmp_path, out):
    """`lik pack` of a 1880x1x8 array: its tokens fit a 64 KiB disk, its offsets do not."""
    np.save(tmp_path / "p.npy", np.ones((1880, 1, 8), np.float32))
    return ["pack", tmp_path / "p.npy", "--out", out]


@pytest.mark.parametrize("case", [_score_ids, _pack_1880])
def test_a_write_cut_short_on_a_full_disk_is_exit_2(tmp_path, small_disk, case):
    """ndarray.tofile (np.save's path) raised an OSError with no errno, "10250 requested and 8176
    written": "internal error", exit 1."""
    disk, preexec, words = small_disk
    if preexec is not None:
        pytest.skip("each file here stays under the file size limit; the tmpfs case is the one")
    out = disk / ("ids.npy" if case is _score_ids else "sh")
    p = lik(*case(tmp_path, out))
    one_line(p.returncode, p.stderr, out, "no space left on device")
    assert listing(disk) == []


@pytest.mark.parametrize("case", [_score_ids, _pack_1880])
def test_a_short_write_anywhere_is_exit_2(tmp_path, monkeypatch, case):
    """The same, on any machine: np.save's array write cut short as NumPy reports it."""
    out = tmp_path / "out" / ("ids.npy" if case is _score_ids else "sh")
    out.parent.mkdir()
    args = case(tmp_path, out)
    real = np.lib.format.write_array

    def short(fp, array, *a, **kw):
        if array.size > 1000:
            fp.write(b"\0" * 496)
            raise OSError(f"{array.size} requested and 496 written")
        return real(fp, array, *a, **kw)

    monkeypatch.setattr(np.lib.format, "write_array", short)
    r = run(*args)
    one_line(r.exit_code, r.stderr, out, "no space left on device (a write was cut short: ")
    assert listing(out.parent) == []


# --------------------------------------------------------------------------- a full stdout


@pytest.mark.parametrize("args", [["info"], ["inspect", "SHARD"], ["--help"], ["score", "--help"], ["pack", "SHARD"]])
def test_a_full_stdout_is_exit_2_in_one_line(tmp_path, args):
    """Writing to /dev/full (ENOSPC, as a full disk behind `> file`) was "internal error", exit 1, or
    a traceback for --help."""
    shard = make_shard(tmp_path / "s").path
    args = [shard if a == "SHARD" else a for a in args] + (["--out", tmp_path / "p"] if args[0] == "pack" else [])
    env = dict(os.environ, PYTHONPATH=child_pythonpath(), PYTHONDONTWRITEBYTECODE="1")
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-c", LIK, *map(str, args)], env=env, stdout=full, stderr=subprocess.PIPE,
                           text=True, timeout=120)
    assert p.returncode == 2 and p.stderr == "lik: error: standard output: no space left on device\n", p


# --------------------------------------------------------------------------- schedulers


@pytest.fixture
def silent_scheduler():
    """An address whose listener accepts connections and never says a word."""
    server = socket.create_server(("127.0.0.1", 0))
    held, stop = [], threading.Event()

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"tcp://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    t.join()
    for c in held:
        c.close()
    server.close()


# Dask's connect timeout, which bounds reaching a --scheduler: 1 s for these runs
_SHORT_CONNECT = "import dask.config\ndask.config.set({'distributed.comm.timeouts.connect': '1s'})\n"


def test_a_scheduler_that_never_answers_is_exit_2(tmp_path, silent_scheduler):
    """Client's timeout bounds the TCP connect, not the handshake: the run waited for ever."""
    pytest.importorskip("distributed")
    shard, q = make_shard(tmp_path / "s").path, queries(tmp_path / "q.npy")
    p = lik("score", "--queries", q, "--docs", shard, "-k", 2, "--out", tmp_path / "o.tsv", "--cpu",
            "--scheduler", silent_scheduler, prelude=_SHORT_CONNECT)
    one_line(p.returncode, p.stderr, "--scheduler", f"no Dask scheduler answered at {silent_scheduler} within 1 s")
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        closed = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    p = lik("score", "--queries", q, "--docs", shard, "-k", 2, "--out", tmp_path / "o.tsv", "--cpu",
            "--scheduler", closed, prelude=_SHORT_CONNECT)
    one_line(p.returncode, p.stderr, "--scheduler", f"cannot reach a Dask scheduler at {closed}")
    assert listing(tmp_path) == ["q.npy", "s"]


# --------------------------------------------------------------------------- pack --force


def _contents(directory) -> dict:
    return {n: open(os.path.join(directory, n), "rb").read() for n in os.listdir(directory)}


def test_pack_force_onto_a_shard_it_cannot_remove_is_exit_2_and_keeps_it(tmp_path, modes_bind):
    """A read-only shard (mode 555; the child is held to file modes: as root, without
    CAP_DAC_OVERRIDE): "wrote", exit 0, the old shard left as a hidden temporary."""
    old = make_shard(tmp_path / "sh", n_docs=3).path
    before = _contents(old)
    os.chmod(old, 0o555)
    try:
        p = lik("pack", queries(tmp_path / "q.npy"), "--out", old, "--force", preexec_fn=modes_bind)
        one_line(p.returncode, p.stderr, old, "not writable, so its files cannot be removed; nothing was replaced")
        assert listing(tmp_path) == ["q.npy", "sh"]
        assert _contents(old) == before
    finally:
        os.chmod(old, 0o755)


def test_a_replaced_shard_that_cannot_be_removed_is_put_back(tmp_path, monkeypatch, commit_mode):
    """Past the judge (a permission it could not foresee): the swap is undone, exit 2, nothing left."""
    import shutil

    old = make_shard(tmp_path / "sh", n_docs=3).path
    before = _contents(old)

    real, refused = shutil.rmtree, []

    def refuse_once(path, *a, **kw):  # the old shard's removal; this write's own output then goes
        if refused:
            return real(path, *a, **kw)
        refused.append(path)
        raise PermissionError(13, "Permission denied", os.path.join(path, "tokens.npy"))

    monkeypatch.setattr(shutil, "rmtree", refuse_once)
    r = run("pack", queries(tmp_path / "q.npy"), "--out", old, "--force")
    one_line(r.exit_code, r.stderr, old, "what was there could not be removed (permission denied); it was put back")
    monkeypatch.undo()
    assert listing(tmp_path) == ["q.npy", "sh"]
    assert _contents(old) == before


SCHEDULER = """import logging, sys, time
from distributed import LocalCluster
cluster = LocalCluster(n_workers=1, processes=False, protocol="tcp", threads_per_worker=1, dashboard_address=":0",
                       silence_logs=logging.CRITICAL)
print(cluster.scheduler_address, flush=True)
time.sleep(600)
"""


def test_a_scheduler_that_dies_mid_run_is_exit_2_in_one_line(tmp_path):
    """The scheduler's process is killed while `lik score --scheduler` waits on it: Dask's client gives
    up reconnecting (after its 30 s), and the run ends with exit 2 and one line, writing nothing."""
    pytest.importorskip("distributed")
    shard, q = make_shard(tmp_path / "s").path, queries(tmp_path / "q.npy")
    env = dict(os.environ, PYTHONPATH=child_pythonpath(), PYTHONDONTWRITEBYTECODE="1")
    sched = subprocess.Popen([sys.executable, "-c", SCHEDULER], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    try:
        address = sched.stdout.readline().strip()
        assert address.startswith("tcp://"), address
        # the search starts only once the scheduler is gone
        prelude = ("import os, signal, lik_cupy.distributed as d\nreal = d.DistributedCorpus.search\n"
                   f"def search(self, *a, **k):\n    os.kill({sched.pid}, signal.SIGKILL)\n"
                   "    return real(self, *a, **k)\nd.DistributedCorpus.search = search\n")
        p = lik("score", "--queries", q, "--docs", shard, "-k", 2, "--out", tmp_path / "o.tsv", "--cpu",
                "--scheduler", address, prelude=prelude, timeout=300)
    finally:
        sched.kill()
        sched.wait()
    one_line(p.returncode, p.stderr, "--scheduler", f"lost the connection to the Dask scheduler at {address}")
    assert listing(tmp_path) == ["q.npy", "s"]


def test_more_shards_than_the_soft_open_files_limit(tmp_path):
    """Every shard stays open (three memory maps each), and the usual soft limit of 1024 files stopped
    `lik score` over a few hundred shards with "too many open files". The soft limit is now raised to the
    hard one; past the hard one, the error says which limit."""
    resource = pytest.importorskip("resource")
    from lik_cupy import shards

    docs = []
    for i in range(40):
        docs.append(tmp_path / f"s{i:02d}")
        shards.write_shard(docs[-1], np.ones((3, 8), np.float32), [0, 1, 3], ids=np.array([2 * i, 2 * i + 1]))
    q = queries(tmp_path / "q.npy")
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 256:
        pytest.skip(f"the hard limit on open files here is {hard}")
    args = ["score", "--cpu", "-q", q, "-d", *docs, "-k", 3]
    p = lik(*args, "-o", tmp_path / "a.tsv", preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard)))
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert len((tmp_path / "a.tsv").read_text().splitlines()) > 1
    p = lik(*args, "-o", tmp_path / "b.tsv", preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)))
    lines = p.stderr.splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "too many open files (the process's limit, ulimit -n," in lines[0]
    assert not (tmp_path / "b.tsv").exists()


def test_a_padded_npy_of_no_tokens_claims_no_documents(tmp_path):
    """A 128-byte header claiming 2**40 rows of zero tokens: every command refuses it in one line, not
    by allocating or looping once per row."""
    hostile = tmp_path / "hostile.npy"
    with open(hostile, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (2**40, 0, 4)})
    other = tmp_path / "d.npy"
    np.save(other, np.ones((3, 5, 4), np.float32))
    for args in (["inspect", hostile], ["pack", hostile, "--out", tmp_path / "x"],
                 ["score", "--cpu", "-q", hostile, "-d", other, "-o", tmp_path / "a.tsv"],
                 ["score", "--cpu", "-q", other, "-d", hostile, "-o", tmp_path / "b.tsv"]):
        r = run(*args)
        assert r.exit_code == 2 and "padded length is 0" in r.stderr and "expected L >= 1" in r.stderr, r.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "a.tsv").exists()


def test_ids_errors_name_the_ids_file_and_empty_devices_are_refused(tmp_path):
    d = tmp_path / "d.npy"
    np.save(d, np.ones((3, 5, 4), np.float32))
    np.save(tmp_path / "two.npy", np.arange(2))
    np.save(tmp_path / "scalar.npy", np.array(5))
    r = run("pack", d, "--out", tmp_path / "x", "--ids", tmp_path / "two.npy")
    assert r.exit_code == 2 and f"{tmp_path / 'two.npy'}: expected 3 ids (one per document)" in r.stderr, r.stderr
    r = run("pack", d, "--out", tmp_path / "x", "--ids", tmp_path / "scalar.npy")
    assert r.exit_code == 2 and "ids must be a 1-D array, one per document; got shape ()" in r.stderr, r.stderr
    r = run("score", "--cpu", "-q", d, "-d", d, "--devices", "", "-o", tmp_path / "o.tsv")
    assert r.exit_code == 2 and "--devices: expected comma-separated GPU indices" in r.stderr, r.stderr
