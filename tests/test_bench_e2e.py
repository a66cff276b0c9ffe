"""bench/suites/bench_e2e.py's --smoke run on the CPU, with stand-ins for the peers (the real ones need a
GPU): every contender is checked against float64 once per cell, a wrong one is listed and never the
best peer, a wrong caller of ours gets no ratio, and the JSON carries the sources' digest."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

import lik_cupy  # noqa: E402
import lik_cupy.torch as lt  # noqa: E402
from bench.lib.provenance import tree_digest  # noqa: E402
from bench_scripts import load  # noqa: E402

OFF = 1.05  # the planted peer's scores (and so its gradients) are 5% high


def _load():
    return load("bench/suites/bench_e2e.py")


class RightFlash:
    """flash-maxsim's calls as the suite makes them, answered by the CPU path (right)."""

    def __init__(self):
        self.maxsim, self.varlen = lik_cupy.maxsim, lik_cupy.maxsim_varlen  # (before any test patches them)

    def flash_maxsim(self, q, d, doc_lengths=None):
        if d.dim() == 2:  # packed tokens, doc_lengths their offsets
            return self.varlen(q[None], d, doc_lengths)[0]
        return self.maxsim(q[None], d, d_lengths=doc_lengths)[0]

    def flash_maxsim_batched(self, q, d):
        return self.maxsim(q, d)

    def flash_maxsim_batched_train(self, q, d, shared_docs=True):
        return lt.maxsim(q, d)


class WrongLik:
    """late-interaction-kernels' ``maxsim`` as the suite calls it, ``OFF`` times the truth."""

    def maxsim(self, q, d, d_mask=None):
        if d.dim() == 4:  # a candidate set per query
            return torch.cat([lt.maxsim(q[i:i + 1], d[i]) for i in range(len(q))]) * OFF
        return lt.maxsim(q, d, d_mask=d_mask) * OFF


def _run(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "load_peers", lambda smoke: {"lik": WrongLik(), "flash": RightFlash()})
    return json.loads(bench.main(["--smoke", "--out", str(tmp_path)]).read_text())


def test_a_wrong_peer_is_flagged_and_never_the_best_peer(tmp_path, monkeypatch):
    bench = _load()
    out = _run(bench, tmp_path, monkeypatch)
    assert out["provenance"]["source_sha256"] == tree_digest()
    cases = {c["case"] for c in out["cells"]}
    assert {"1x1000 packed", "train_n32_32x80", "corpus_search_1x100k", "corpus_rerank_32x100"} <= cases
    for cell in out["cells"]:
        errs = cell["max_rel_err"]
        assert errs[cell["caller"]] < 1e-6, cell  # fp16 inputs: the CPU path is float64's to float32 rounding
        if "lik" in errs:
            assert "lik" in cell["wrong"] and errs["lik"] == pytest.approx(OFF - 1, rel=1e-3)
        if "flash" in errs:
            assert errs["flash"] < 1e-6 and "flash" not in cell["wrong"]
            assert cell["best_peer"] == "flash" and cell["ratio"] == cell["ours_ms"] / cell["best_peer_ms"]
        else:  # LIK alone, and wrong: no peer to take a ratio against
            assert cell["best_peer"] is None and cell["ratio"] is None
        if cell["case"].startswith("train"):
            g = cell["grad_rel_err"]
            assert g[cell["caller"]] < 1e-3 and g["flash"] < 1e-3 and g["lik"] == pytest.approx(OFF - 1, rel=1e-2)
    rows = [r for r in out["rows"] if r["impl"] == "lik"]
    assert rows and all(r["wrong"] and "wall_ms" in r for r in rows)  # timed all the same, and reported


def test_a_wrong_caller_of_ours_gets_no_ratio(tmp_path, monkeypatch):
    bench = _load()
    real = lik_cupy.maxsim
    flash = RightFlash()
    monkeypatch.setattr(bench, "load_peers", lambda smoke: {"flash": flash})
    monkeypatch.setattr(lik_cupy, "maxsim", lambda *a, **k: real(*a, **k) * OFF)
    out = json.loads(bench.main(["--smoke", "--out", str(tmp_path), "--cells", "1x1000"]).read_text())
    cells = {(c["case"], c["caller"]): c for c in out["cells"]}
    assert set(cells) == {("1x1000", "torch"), ("1x1000 d_lengths", "torch"), ("1x1000 d_mask", "torch"),
                          ("1x1000 packed", "torch"), ("1x1000 packed", "torch_unchecked")}
    for (case, caller), c in cells.items():
        assert c["best_peer"] == "flash"
        if case.endswith("packed"):  # maxsim_varlen: right, and given its ratio
            assert c["wrong"] == [] and c["ratio"] is not None
        else:
            assert c["wrong"] == ["torch"] and c["ratio"] is None


def test_a_result_that_cannot_be_compared_is_wrong():
    bench = _load()
    case = bench.Case({}, lambda: torch.zeros(2, 3, dtype=torch.float64), bench.scores_check)
    got = bench.checked(case, lambda: torch.zeros(5))
    assert got["wrong"] and "expected 6" in got["check_error"]
    assert bench.checked(case, lambda: torch.full((2, 3), float("nan")))["wrong"]
