"""The committed benchmark results: one copy of each, run numbers only in archive/, and every result file
the README and docs cite present."""

from __future__ import annotations

import hashlib
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
KINDS = (".json", ".txt", ".log", ".png")


def _results():
    return [p for top in (RESULTS, REPO / "tests" / "data") for p in top.rglob("*") if p.is_file()]


def test_latest_names_carry_no_run_number():
    assert sorted(p.name for p in (RESULTS / "latest").iterdir() if re.search(r"_run\d+\.", p.name)) == []


def test_no_result_is_committed_twice():
    seen: dict[str, pathlib.Path] = {}
    twins = []
    for p in sorted(_results()):
        digest = hashlib.sha256(p.read_bytes()).hexdigest()
        if digest in seen:
            twins.append((str(seen[digest].relative_to(REPO)), str(p.relative_to(REPO))))
        seen.setdefault(digest, p)
    assert twins == []


def test_every_cited_result_file_exists():
    # A bare name may lie anywhere among the results; a path is read from the repository root,
    # bench/ or bench/results/ (docs write `results/latest/x.json` and `archive/x.json`).
    names = {p.name for p in _results()}
    paths = {p.relative_to(REPO).as_posix() for p in _results()}
    missing = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for cited in re.findall(r"`([\w./-]+)`", doc.read_text()):
            if not cited.endswith(KINDS) or cited.startswith(("_", ".")):
                continue  # not a file, or the tail of the name before it (`_run4.json`)
            found = (not {cited, f"bench/{cited}", f"bench/results/{cited}"}.isdisjoint(paths) if "/" in cited
                     else cited in names)
            if not found:
                missing.append(f"{doc.relative_to(REPO)}: {cited}")
    assert missing == []
