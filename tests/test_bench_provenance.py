"""Which code a benchmark result came from (bench/lib/provenance.py, bench/tools/source_digest.py): the
digest of the package's sources, the same for a working tree and for a commit holding the same files,
recorded in every JSON the suites write, and a commit named only where it can be checked (the GPU
machine's .git is stale)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from bench.lib import provenance as prov
from bench.lib.results import write_json, write_result
from bench_scripts import load

REPO = pathlib.Path(__file__).resolve().parents[1]
git_missing = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
FILES = {"lik_cupy/__init__.py": "x = 1\n", "lik_cupy/_cpu/maxsim.py": "y = 2\n", "cuda_src/maxsim_fwd.cu": "// k\n",
         "cuda_src/fwd/tile.cuh": "// t\n", "pyproject.toml": "[project]\n", "README.md": "words\n",
         "lik_cupy/notes.txt": "not source\n", "bench/suites/bench_x.py": "z = 3\n"}
SOURCES = {"lik_cupy/__init__.py", "lik_cupy/_cpu/maxsim.py", "cuda_src/maxsim_fwd.cu", "cuda_src/fwd/tile.cuh",
           "pyproject.toml"}


def _git(root, *args) -> str:
    return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


def _commit(root, msg="c") -> str:
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", msg)
    return _git(root, "rev-parse", "HEAD")


@pytest.fixture
def repo(tmp_path, monkeypatch):
    root = tmp_path / "repo"
    for rel, text in FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    _git(tmp_path, "init", "-q", str(root))
    monkeypatch.delenv("LIK_COMMIT", raising=False)
    prov._provenance.cache_clear()
    yield root
    prov._provenance.cache_clear()


@git_missing
def test_a_commits_digest_is_its_trees_and_what_coreutils_give(repo):
    head = _commit(repo)
    assert set(prov.tree_files(repo)) == SOURCES
    assert prov.commit_digest(head, repo) == prov.tree_digest(repo)
    if shutil.which("sha256sum"):  # the tool's docstring: anyone recomputes it with coreutils
        shell = subprocess.run("git ls-files -- 'lik_cupy/*.py' 'cuda_src/*.cu' 'cuda_src/*.cuh' pyproject.toml "
                               "| LC_ALL=C sort | xargs sha256sum | sha256sum", shell=True, cwd=repo, check=True,
                               capture_output=True, text=True).stdout.split()[0]
        assert shell == prov.tree_digest(repo)


@git_missing
def test_the_digest_follows_the_sources_alone(repo):
    first = _commit(repo)
    before = prov.tree_digest(repo)
    (repo / "README.md").write_text("other words\n")
    (repo / "lik_cupy" / "__pycache__").mkdir()
    (repo / "lik_cupy" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    (repo / "bench/suites/bench_x.py").write_text("z = 4\n")
    assert prov.tree_digest(repo) == before
    (repo / "cuda_src/fwd/tile.cuh").write_text("// t, changed\n")
    changed = prov.tree_digest(repo)
    assert changed != before and prov.commit_digest(first, repo) == before
    second = _commit(repo)
    assert prov.commit_digest(second, repo) == changed and prov.commit_digest(first, repo) == before


@git_missing
def test_a_commit_is_named_only_where_it_can_be_checked(repo, monkeypatch):
    head = _commit(repo)
    p = prov.provenance(repo)
    assert p["source_sha256"] == prov.tree_digest(repo) and p["source_files"] == len(SOURCES)
    assert (p["commit"], p["commit_from"], p["commit_matches"]) == (head, "git HEAD", True)
    # the GPU machine: a working tree newer than its stale .git's HEAD
    (repo / "lik_cupy/_cpu/maxsim.py").write_text("y = 3\n")
    prov._provenance.cache_clear()
    p = prov.provenance(repo)
    assert p["commit"] is p["commit_from"] is p["commit_matches"] is None
    assert p["source_sha256"] == prov.tree_digest(repo)
    # the launcher names the commit: checked where this .git has it
    newer = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("LIK_COMMIT", newer)
    assert (prov.provenance(repo)["commit"], prov.provenance(repo)["commit_from"],
            prov.provenance(repo)["commit_matches"]) == (newer, "LIK_COMMIT", None)
    monkeypatch.setenv("LIK_COMMIT", head)  # a commit this tree's sources are not
    assert prov.provenance(repo)["commit_matches"] is False
    now = _commit(repo)
    monkeypatch.setenv("LIK_COMMIT", now[:10])
    prov._provenance.cache_clear()
    assert (prov.provenance(repo)["commit"], prov.provenance(repo)["commit_matches"]) == (now, True)


def test_without_git_the_digest_is_still_recorded(tmp_path, monkeypatch):
    for rel, text in FILES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.delenv("LIK_COMMIT", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no repository above it either
    prov._provenance.cache_clear()
    p = prov.provenance(tmp_path)
    prov._provenance.cache_clear()
    assert p["source_sha256"] == prov.tree_digest(tmp_path) and p["commit"] is None


@git_missing
def test_the_tool_finds_the_commit_a_result_came_from(repo, tmp_path, capsys):
    tool = load("bench/tools/source_digest.py")
    first = _commit(repo, "first")
    result = tmp_path / "forward_x.json"
    result.write_text(json.dumps({"rows": [], "provenance": {"source_sha256": prov.tree_digest(repo)}}))
    (repo / "lik_cupy/__init__.py").write_text("x = 2\n")
    second = _commit(repo, "second")
    capsys.readouterr()
    assert tool.main(["--find", str(result), "--repo", str(repo)]) == 0
    assert capsys.readouterr().out.split() == [first]
    assert tool.main([first, second, "--repo", str(repo)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"{prov.commit_digest(first, repo)}  {first}", f"{prov.tree_digest(repo)}  {second}"]
    result.write_text(json.dumps({"provenance": {"source_sha256": "0" * 64}}))
    assert tool.main(["--find", str(result), "--repo", str(repo)]) == 1


def test_every_result_file_carries_the_sources_digest(tmp_path):
    write_json(tmp_path / "a.json", {"rows": [1.0, float("nan")]})
    a = json.loads((tmp_path / "a.json").read_text())
    assert a["rows"] == [1.0, "nan"] and a["provenance"]["source_sha256"] == prov.tree_digest()
    path = write_result(tmp_path, "sweep_x", SimpleNamespace(name="NVIDIA H200", cc=90), rows=[])
    b = json.loads(pathlib.Path(path).read_text())
    assert path.endswith("sweep_x_nvidia-h200.json") and b["gpu"] == "NVIDIA H200"
    assert b["provenance"] == a["provenance"]


def test_every_suite_writes_its_json_through_bench_lib():
    # a suite that wrote its own JSON would leave the provenance out: bench/lib/results.py is the one writer
    # (a rough guard: each suite calls it, and none dumps JSON into a file of its own)
    for path in sorted((REPO / "bench" / "suites").glob("bench_*.py")):
        text = path.read_text()
        assert ("write_json(" in text or "write_result(" in text) and "json.dump(" not in text, path.name


# bench/tools/file_fuzz.py writes its work files (the index files it mutates, its findings), no results
NOT_RESULTS = {"file_fuzz.py"}


def test_every_sweep_and_tool_writes_its_json_through_bench_lib():
    """gpu_fuzz.py, profile_jax.py and distributed_model.py wrote their JSON themselves (json.dump, or
    write_text of json.dumps), without the provenance every other result carries. The same rough
    guard as the suites': no sweep or tool writes JSON into a file of its own."""
    for folder in ("sweeps", "tools"):
        for path in sorted((REPO / "bench" / folder).glob("*.py")):
            if path.name in NOT_RESULTS:
                continue
            text = path.read_text()
            assert "json.dump(" not in text and "write_text(json.dumps(" not in text, f"{folder}/{path.name}"


def test_gpu_fuzz_writes_the_provenance(tmp_path):
    # FUZZ_LOCAL=1: the script on the CPU path (no GPU), for no seconds: no case, then its JSON
    env = {**os.environ, "FUZZ_LOCAL": "1", "OUT": str(tmp_path)}
    subprocess.run([sys.executable, str(REPO / "bench/tools/gpu_fuzz.py"), "3", "0"], check=True, env=env,
                   cwd=tmp_path, capture_output=True, timeout=300)
    out = json.loads((tmp_path / "gpufuzz_3.json").read_text())
    assert (out["seed"], out["cases"], out["gpu"]) == (3, 0, "local")
    assert out["provenance"]["source_sha256"] == prov.tree_digest()


def test_distributed_model_writes_the_provenance(tmp_path, monkeypatch):
    model = load("bench/sweeps/distributed_model.py")
    monkeypatch.setenv("OUT", str(tmp_path))
    # fit: the fitted stages stood in (the committed bench JSON predates the stage times it reads)
    monkeypatch.setattr(model, "fit", lambda bench: {"queries": 8, "measured_workers": [1], "measured_s": {1: 0.1}})
    monkeypatch.setattr(model, "predict", lambda coef, n: {"retrieve_s": 0.1 / n, "total_s": 0.1 / n})
    bench = tmp_path / "bench.json"
    bench.write_text("{}")
    model.main_fit(bench, [1, 8])
    fit = json.loads((tmp_path / "distributed_model_fit.json").read_text())
    assert [r["workers"] for r in fit["rows"]] == [1, 8]
    # counts: Dask's own counts stood in by the model's (the cluster is not what is checked here)
    monkeypatch.setattr(model, "measure", lambda n, root: {
        **{k: model.model(n)[k] for k in ("partials_moved", "merge_bytes_between_workers", "worker_merge_levels",
                                           "merge_tasks", "client_partials")},
        "workers_holding_query": n, "search_seconds": 0.0})
    model.main_counts([1, 4])
    counts = json.loads((tmp_path / "distributed_model.json").read_text())
    assert [r["workers"] for r in counts["rows"]] == [1, 4]
    for out in (fit, counts):
        assert out["provenance"]["source_sha256"] == prov.tree_digest()
