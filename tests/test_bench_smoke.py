"""The float32 benchmark (bench/suites/bench_precision.py) in its ``--smoke`` mode: tiny shapes on the CPU
path, no GPU, no peers. Checks the JSON the issue-43 gate reads and the table printed last; the GPU run
itself is the lead's (``python bench/suites/bench_precision.py --time-budget 480``). Also, on the CPU, how
the suites pick the best peer their ratios are taken against (bench.lib.results.fastest)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from bench.lib.provenance import tree_digest
from bench_scripts import load as _load

pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "suites" / "bench_precision.py"
GATE_KEYS = {"case", "kind", "ours_default_ms", "ours_tf32_ms", "best_peer", "best_peer_ms", "ratio_default",
             "ratio_tf32", "err_default", "err_tf32", "peer_err"}


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_precision", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        del sys.modules[spec.name]


def test_smoke_run_writes_every_cell_in_the_gate_schema(bench, tmp_path, capsys):
    # one cell of each workload (forward, many queries, rerank, training step), one by its old name
    cells = "textual,32q-1000,rerank-100,colpali-16,train-32"
    assert bench.main(["--smoke", "--out", str(tmp_path), "--cells", cells, "--target-ms", "1"]) == 0
    data = json.loads((tmp_path / "precision_cpu-smoke.json").read_text())
    assert data["gpu"] == "cpu smoke" and data["skipped"] == []
    assert data["provenance"]["source_sha256"] == tree_digest()  # which sources made it
    assert data["ours_default_precision"] == "fp32"
    assert [c["case"] for c in data["cells"]] == ["textual", "32q-1000", "rerank-100", "few-long-16", "train-32"]
    for c in data["cells"]:
        assert GATE_KEYS <= set(c), c["case"]
        assert c["kind"] in ("compute", "memory")
        assert c["ours_default_ms"] > 0 and c["ours_tf32_ms"] > 0
        # no peer runs on the CPU: no best peer, no ratio
        assert c["best_peer"] is c["best_peer_ms"] is c["ratio_default"] is c["peer_err"] is None
        # the CPU path scores exactly (float32 rounding of the sum only)
        assert 0 <= c["err_default"] < 1e-6 and 0 <= c["err_tf32"] < 1e-6
        assert c["failures"] == {}
    assert set(data["cells"][-1]["grad_err"]) == {"ours_default", "ours_tf32"}
    assert max(data["cells"][-1]["grad_err"].values()) < 1e-5
    lines = capsys.readouterr().out.rstrip().splitlines()
    table_at = next(i for i, ln in enumerate(lines) if ln.startswith("case "))
    assert [ln.split()[0] for ln in lines[table_at + 1:] if ln] == [c["case"] for c in data["cells"]]


def test_time_budget_skips_the_remaining_cells(bench, tmp_path):
    assert bench.main(["--smoke", "--out", str(tmp_path), "--cells", "textual,train-64", "--time-budget", "0"]) == 0
    data = json.loads((tmp_path / "precision_cpu-smoke.json").read_text())
    assert data["cells"] == [] and data["skipped"] == ["textual", "train-64"]


def test_cells_filter(bench):
    assert bench.parse_cells("text-1000,textual,1q-1000,colpali-256") == ["textual", "few-long-256"]
    assert bench.parse_cells("all")[:len(bench.DEFAULT_CELLS)] == list(bench.DEFAULT_CELLS)
    assert "text-40k" in bench.parse_cells("all") and "text-40k" not in bench.DEFAULT_CELLS
    with pytest.raises(SystemExit, match="unknown cell 'colpali-5'"):
        bench.parse_cells("colpali-5")


def test_best_peer_skips_wrong_and_nan_peers():
    from bench.lib.results import counts, fastest

    times = {"flash": 0.5, "lik": 1.0, "slow": 2.0, "nan_time": float("nan")}
    assert fastest(times) == ("flash", 0.5)
    # flash scored NaN, lik 10% off: neither is the best peer however fast
    assert fastest(times, {"flash": float("nan"), "lik": 0.1, "slow": 3e-7}) == ("slow", 2.0)
    assert fastest({"a": float("nan")}) is None and fastest({}) is None
    assert not counts(1.0, float("nan")) and not counts(float("inf")) and counts(1.0, 1e-3)


def test_forward_and_corpus_ratios_ignore_a_wrong_baseline():
    fwd = _load("bench/suites/bench_forward.py")
    rows = [{"impl": "ours", "status": "ok", "ms": 1.0, "max_rel_err": 3e-7},
            {"impl": "ours_cupy", "status": "ok", "ms": 0.9, "max_rel_err": float("nan")},
            {"impl": "flash_maxsim", "status": "ok", "ms": 0.1, "max_rel_err": float("nan")},
            {"impl": "lik", "status": "ok", "ms": 2.0, "max_rel_err": 3e-7},
            {"impl": "torch_naive", "status": "ok", "ms": 0.05, "max_rel_err": 1e-3}]  # not a baseline
    fwd.finish_case(rows)
    assert rows[0]["ratio_vs_best_baseline"] == 0.5 and "ratio_vs_best_baseline" not in rows[1]

    corpus = _load("bench/suites/bench_corpus.py")
    rows = [{"impl": "ours", "status": "ok", "ms": 1.0, "max_rel_err": 3e-7},
            {"impl": "flash_batched", "status": "ok", "ms": 0.1, "max_rel_err": 3e-7, "check_error": "bad shape"},
            {"impl": "lik", "status": "ok", "ms": 4.0, "max_rel_err": 3e-7}]
    corpus.finish_case("multiquery", rows)
    assert rows[0]["ratio_vs_best_baseline"] == 0.25 and rows[0]["best_baseline_ms"] == 4.0


def test_corpus_object_best_peer_is_never_one_of_ours():
    mod = _load("bench/suites/bench_corpus_object.py")
    cell = mod.best_cell("search", {"ours": {"ms": 1.0}, "ours_retrieve": {"ms": 0.5}, "ours_gather": {"ms": 0.7},
                                    "flash_topk": {"ms": 2.0}, "lik_retrieve": {"error": "x"}})
    assert cell == {"case": "search", "ours_ms": 1.0, "best_peer": "flash_topk", "best_peer_ms": 2.0, "ratio": 0.5}
    assert mod.best_cell("search", {"ours": {"ms": 1.0}, "ours_gather": {"ms": 0.5}}) is None


def test_precision_best_peer_skips_a_nan_peer(bench):
    cell = bench.CELLS["textual"]
    case = bench.Case(contenders={}, ref=None, flops=1, nbytes=1)
    env = bench.Env(smoke=True, device="cpu", l2=0, peaks=None, clock=None)
    got = {"kernel_ms": {"ours_default": 1.0, "ours_tf32": 0.8, "lik_f32": 2.0, "flash_f32": 0.1},
           "call_ms": {"ours_default": 1.0, "ours_tf32": 0.8, "lik_f32": 2.0, "flash_f32": 0.1},
           "err": {"ours_default": 1e-7, "ours_tf32": float("nan"), "lik_f32": 1e-4, "flash_f32": float("nan")}}
    row = bench.summary("textual", cell, env, case, got)
    assert row["best_peer"] == "lik_f32" and row["ratio_default"] == 0.5 and row["ratio_call_default"] == 0.5
    assert row["ratio_tf32"] is None and row["ratio_call_tf32"] is None
