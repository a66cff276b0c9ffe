"""The CPU suite (bench/suites/bench_cpu.py) in its smoke mode: it runs, checks every contender's
scores against float64 and ours, and writes the JSON the issue asks for (the machine, its load, median
and best, the sources' digest) where the other suites write theirs (``--out``, else $OUT, else
bench/results/; never latest/, which holds committed runs)."""

from __future__ import annotations

import json

from bench.lib.provenance import tree_digest
from bench_scripts import load


def test_bench_cpu_smoke(tmp_path):
    bench = _load_cpu()
    out = json.loads(bench.main(["--smoke", "--out", str(tmp_path)]).read_text())
    assert out["smoke"] and out["machine"]["cores"] >= 1 and out["machine"]["cpu"]
    assert out["provenance"]["source_sha256"] == tree_digest()  # which sources made it
    assert len(out["load_average"]["before"]) == 3 and isinstance(out["quiet"], bool)
    assert [c["case"] for c in out["cells"]] == list(bench.SMOKE)
    for cell in out["cells"]:
        others = set(cell["times"]) - {"ours", "ours_argmax"}
        assert {"numpy_batched", "numpy_loop"} <= others
        assert others - {"numpy_batched", "numpy_loop"} == set(bench.RUST) - set(out["skipped"])
        assert all(t["best_ms"] <= t["median_ms"] for t in cell["times"].values())
        right = others - set(cell["wrong"])
        assert cell["median"]["fastest_other"] in right and cell["best"]["fastest_other"] in right
        # NumPy's float32 GEMMs: within float32 rounding of ours
        assert cell["max_rel_err_vs_ours"]["numpy_loop"] < 1e-5
    assert len(out["plaid_rerank"]) == len(bench.RERANK_SMOKE)
    for cell in out["plaid_rerank"]:
        assert set(cell["times"]) == {"rerank", "decompress_maxsim_varlen"}


def _load_cpu():
    return load("bench/suites/bench_cpu.py")


def test_a_nan_score_is_an_error_not_skipped():
    import numpy as np

    bench = _load_cpu()
    want = np.array([[1.0, 2.0, 3.0]])
    assert np.isnan(bench.rel_err(np.array([[1.0, np.nan, 3.0]]), want))  # was 0: nanmax skipped the NaN
    assert not bench.rel_err(np.array([[1.0, np.nan, 3.0]]), want) <= bench.WRONG


def test_contenders_are_checked_against_float64_and_a_wrong_ours_gets_no_ratio(tmp_path, monkeypatch):
    bench = _load_cpu()
    real = bench.cell_contenders

    def ours_off(*a):  # ours scores 1% high: every other would look wrong against it
        ours, others, docs = real(*a)
        return {k: (lambda f=f: f() * 1.01) for k, f in ours.items()}, others, docs

    monkeypatch.setattr(bench, "cell_contenders", ours_off)
    out = json.loads(bench.main(["--smoke", "--out", str(tmp_path)]).read_text())
    for cell in out["cells"]:
        assert cell["ours_wrong"] and cell["median"] is None and cell["best"] is None
        assert "numpy_loop" not in cell["wrong"]  # right against float64, though 1% off ours
        assert cell["max_rel_err_vs_float64"]["numpy_loop"] < 1e-5


def test_without_out_it_writes_to_OUT_as_the_other_suites_do(tmp_path, monkeypatch):
    bench = _load_cpu()
    monkeypatch.setattr(bench, "RERANK_SMOKE", [])  # (the cells alone: where the file goes is the point)
    monkeypatch.setenv("OUT", str(tmp_path))
    path = bench.main(["--smoke"])
    assert path.parent == tmp_path and json.loads(path.read_text())["smoke"]


def test_hosts_that_share_a_model_name_get_their_own_file():
    bench = _load_cpu()
    milan = "processor\t: 0\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC\n\nprocessor\t: 1\nmodel\t\t: 9\n"
    genoa = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
    fields = {name: bench.cpuinfo_fields(text) for name, text in (("milan", milan), ("genoa", genoa))}
    assert bench.cpu_id(fields["milan"]) == "f25m1" and bench.cpu_id(fields["genoa"]) == "f25m17"
    assert bench.cpu_model(fields["milan"]) == "AMD EPYC"
    assert bench.cpu_id(bench.cpuinfo_fields("processor\t: 0\nmodel name\t: Apple M2\n")) is None  # none there
    names = {bench.result_name({"cpu": "AMD EPYC", "cpu_id": bench.cpu_id(f), "cores": 2}, False) for f in fields.values()}
    assert names == {"cpu_amd-epyc-f25m1-2c.json", "cpu_amd-epyc-f25m17-2c.json"}
    assert bench.result_name({"cpu": "AMD EPYC", "cpu_id": None, "cores": 2}, True) == "cpu_amd-epyc-2c_smoke.json"
