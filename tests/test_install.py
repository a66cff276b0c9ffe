"""Every combination of the package's extras resolves: pip's resolver, on an empty environment
(``--dry-run --ignore-installed``: metadata only, nothing installed), over the union of every extra
with each CUDA extra in turn. A union that resolves means each of its parts does. Skips when pip
cannot reach a package index.

The CUDA extras (``cuda12``, ``cuda13``) are alternatives (``cuda-python`` < 13 against >= 13), so
they never combine; every other extra, documented or CI's own, joins both unions.
"""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
import subprocess
import sys

import pytest

from test_packaging import _source_copy

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = pathlib.Path(__file__).resolve().parents[1]
ALTERNATIVES = ("cuda12", "cuda13")


def _extras() -> list[str]:
    return sorted(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def _pip(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "pip", *args, "--disable-pip-version-check"], capture_output=True,
                          text=True, timeout=timeout)


def _union(cuda: str) -> list[str]:
    return [e for e in _extras() if e not in ALTERNATIVES or e == cuda]


@pytest.fixture(scope="module")
def resolutions(tmp_path_factory):
    """pip's dry run of each union, both at once (they wait on the network, not the CPU)."""
    probe = _pip("index", "versions", "pylate", "--retries", "0", "--timeout", "20", timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"no package index reachable (pip index versions pylate: {probe.stderr.strip()[-300:]})")
    source = _source_copy(tmp_path_factory.mktemp("resolve") / "src")
    with concurrent.futures.ThreadPoolExecutor(len(ALTERNATIVES)) as ex:
        runs = {cuda: ex.submit(_pip, "install", "--dry-run", "--ignore-installed", "--no-build-isolation", "--quiet",
                                "--report", "-", f"{source}[{','.join(_union(cuda))}]") for cuda in ALTERNATIVES}
        return {cuda: run.result() for cuda, run in runs.items()}


def test_the_alternatives_are_extras_and_every_other_extra_joins_them():
    extras = _extras()
    assert set(ALTERNATIVES) <= set(extras) and {"integrations", "plaid", "jax", "distributed", "test"} <= set(extras)


@pytest.mark.parametrize("cuda", ALTERNATIVES)
def test_every_extra_resolves_together(resolutions, cuda):
    p = resolutions[cuda]
    assert p.returncode == 0, f"pip cannot resolve lik-cupy[{','.join(_union(cuda))}]:\n{p.stderr[-3000:]}"
    report = json.loads(p.stdout)
    got = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in report["install"]}
    assert "lik-cupy" in got and "pylate" in got and "fast-plaid" in got, sorted(got)
