"""bench/suites/bench_fused_head.py's --smoke run on the CPU: every cell timed for ours and the unfused
pipeline, the same scores from both, the summary and table written."""

from __future__ import annotations

import json

import pytest

from bench.lib.provenance import tree_digest
from bench_scripts import load

pytest.importorskip("torch")


def test_smoke_run_writes_every_cell(tmp_path, capsys, monkeypatch):
    import torch

    bench = load("bench/suites/bench_fused_head.py")
    # As in a process that used the GPU before (a GPU host's whole test run): the smoke run still times the CPU
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    run = json.loads((tmp_path / "fused_head_cpu-smoke.json").read_text())
    assert run["gpu"] == "cpu smoke" and run["skipped"] == []
    assert run["provenance"]["source_sha256"] == tree_digest()  # which sources made it
    rows = {(r["cell"], r["contender"]): r for r in run["rows"]}
    assert set(rows) == {(c, w) for c in bench.CELLS for w in ("ours", "unfused")} | {("rerank", "floor")}
    for (_, who), r in rows.items():
        assert "error" not in r and r["ms"] > 0 and r["gpu_ms"] is None  # (no GPU time on the CPU)
        assert (r["scores_max_abs_diff"] is None) == (who == "floor") and (who == "floor" or r["scores_max_abs_diff"] < 1e-5)
    assert [s["cell"] for s in run["summary"]] == sorted(bench.CELLS)
    assert capsys.readouterr().out.splitlines()[-len(bench.CELLS) - 1].startswith("cell")  # the table, last
