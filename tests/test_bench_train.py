"""bench/suites/bench_train.py's --smoke run on the CPU (every row it writes, the same loss from every
contender), and bench/tools/jax_paths.py writing its JAX rows into a copy of the dispatch table."""

from __future__ import annotations

import ast
import json
import pathlib

import pytest

pytest.importorskip("torch")
pytest.importorskip("jax")

REPO = pathlib.Path(__file__).resolve().parents[1]

from bench.lib.provenance import tree_digest  # noqa: E402
from bench_scripts import load as _load  # noqa: E402


def _table(text: str) -> dict:
    for node in ast.parse(text).body:
        if isinstance(node, ast.AnnAssign) and node.target.id == "JAX_PATHS":
            return ast.literal_eval(node.value)
    raise AssertionError("no JAX_PATHS in the module")


def test_smoke_run_times_every_row_and_writes_the_jax_table(tmp_path, monkeypatch):
    monkeypatch.delenv("LIK_JAX_PATH", raising=False)
    bench = _load("bench/suites/bench_train.py")
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    path = tmp_path / "train_cpu-smoke.json"
    run = json.loads(path.read_text())
    assert run["smoke"] and run["complete"] and run["jax_backend"] == "cpu" and run["gpu"] is None
    assert run["provenance"]["source_sha256"] == tree_digest()  # which sources made it

    torch_rows = run["torch_rows"]
    assert {(r["mode"], r["contender"]) for r in torch_rows} == {(m, c) for m in bench.MODES for c in ("ours", "torch")}
    for r in torch_rows:
        if r["mode"] == "reduce-overhead":
            assert r["error"].startswith("skipped: CUDA graphs")
        else:
            assert r["wall_ms"] > 0 and r["steps"] == 3 and r["graphs"] == int(r["mode"] == "compile"), r
    losses = [r["loss"] for r in torch_rows if "loss" in r]
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0])

    jax_rows = run["jax_rows"]
    assert [(r["n"], r["lq"], r["ld"], r["impl"]) for r in jax_rows] == [
        (*cell, impl) for cell in bench.SMOKE_JAX_CELLS for impl in bench.JAX_IMPLS]
    for cell in bench.SMOKE_JAX_CELLS:
        here = [r for r in jax_rows if (r["n"], r["lq"], r["ld"]) == cell]
        assert all(r["wall_ms"] > 0 for r in here)
        assert max(r["loss"] for r in here) - min(r["loss"] for r in here) <= 1e-5 * abs(here[0]["loss"])
    assert {s["framework"] for s in run["summary"]} == {"torch", "jax"}

    tool = _load("bench/tools/jax_paths.py")
    with pytest.raises(SystemExit, match="--smoke run"):  # never into lik_cupy's own table
        tool.main([str(path)])
    module = tmp_path / "jax_paths.py"
    original = (REPO / "lik_cupy" / "_dispatch" / "jax_paths.py").read_text()
    module.write_text(original)
    assert tool.main([str(path), "--module", str(module)]) == 0
    written = module.read_text()
    want = tuple((n, lq, ld, "xla" if t["xla"] < t["kernel"] else "kernel")
                 for (n, lq, ld) in bench.SMOKE_JAX_CELLS
                 for t in [{r["impl"]: r["wall_ms"] for r in jax_rows if (r["n"], r["lq"], r["ld"]) == (n, lq, ld)}])
    assert _table(written) == {**_table(original), "cpu": want}  # the GPU's rows kept
    assert str(path) in written


def test_jax_verdicts_take_the_kernels_where_xla_was_skipped():
    tool = _load("bench/tools/jax_paths.py")
    rows = [{"n": 8, "lq": 32, "ld": 80, "impl": "kernel", "wall_ms": 0.3},
            {"n": 8, "lq": 32, "ld": 80, "impl": "xla", "wall_ms": 0.05},
            {"n": 256, "lq": 1024, "ld": 1024, "impl": "kernel", "wall_ms": 9.0},
            {"n": 256, "lq": 1024, "ld": 1024, "impl": "xla", "error": "skipped: the similarities take 256 GiB"},
            {"n": 64, "lq": 32, "ld": 300, "impl": "xla", "wall_ms": 0.1}]  # no kernel row: not a cell
    assert tool.verdicts({"jax_rows": rows}) == [(8, 32, 80, "xla"), (256, 1024, 1024, "kernel")]
