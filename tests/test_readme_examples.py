"""Every code example in README.md, run as written.

Each ```python block is executed on its own. A block whose first line is
``# requires: gpu`` / ``torch`` / ``jax`` (comma-separated for several) is skipped where that is
missing: ``gpu`` means CuPy sees a CUDA device (such blocks are also marked ``gpu``, so
``pytest -m gpu`` runs them); ``torch``, ``jax``, ``pylate`` and ``colpali_engine`` mean the package
imports. A block with no
``requires`` line runs everywhere, CI's CPU-only machine included. The examples check their own
results (asserts), so a wrong example fails here.

Every ``lik ...`` line in a ```bash or ```console block is run through the CLI's click entry point
from the repository root, with paths under /tmp/ moved into the test's temporary directory.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shlex

import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX, if a block imports it, takes no 75% share

REPO = pathlib.Path(__file__).resolve().parents[1]
README = REPO / "README.md"
_FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
_REQUIRES = re.compile(r"#\s*requires:\s*(.+)")
KNOWN = ("gpu", "torch", "jax", "distributed", "pylate", "colpali_engine", "fast_plaid")


def _blocks(langs: tuple[str, ...]) -> list[tuple[int, str]]:
    """(first line number, body) of each fenced block in README.md whose language is in ``langs``."""
    text = README.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start(2)) + 1, m.group(2)) for m in _FENCE.finditer(text) if m.group(1) in langs]


def _requires(body: str) -> tuple[str, ...]:
    first = body.lstrip("\n").split("\n", 1)[0].strip()
    m = _REQUIRES.fullmatch(first)
    return tuple(r.strip() for r in m.group(1).split(",")) if m else ()


def _has_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _missing(req: str) -> str | None:
    """Why a requirement is not met here, or None when it is."""
    if req == "gpu":
        return None if _has_gpu() else "needs a CUDA GPU"
    if importlib.util.find_spec(req) is None:
        return f"needs {req}"
    return None


PYTHON_BLOCKS = _blocks(("python", "py"))


def _params():
    for line, body in PYTHON_BLOCKS:
        reqs = _requires(body)
        marks = [pytest.mark.gpu] if "gpu" in reqs else []
        yield pytest.param(line, body, reqs, id=f"README.md:{line}" + (f"[{','.join(reqs)}]" if reqs else ""),
                           marks=marks)


def test_readme_has_the_promised_examples():
    """One example runs on every machine (the NumPy path), and each framework has one of its own."""
    assert PYTHON_BLOCKS, "README.md has no ```python block"
    reqs = [_requires(body) for _, body in PYTHON_BLOCKS]
    assert any(not r for r in reqs), "no README example runs without a GPU, torch or jax"
    for r in reqs:
        assert set(r) <= set(KNOWN), f"unknown '# requires:' entry in {r}; known: {KNOWN}"
    for need in KNOWN:
        assert any(need in r for r in reqs), f"no README example marked '# requires: {need}'"
    bodies = "\n".join(body for _, body in PYTHON_BLOCKS)
    for name in ("lik_cupy.torch", "lik_cupy.jax", "import cupy", "import numpy"):
        assert name in bodies, f"no README example uses {name}"


@pytest.mark.parametrize("line, body, reqs", list(_params()))
def test_readme_python_example(line, body, reqs):
    for req in reqs:
        why = _missing(req)
        if why:
            pytest.skip(f"README.md:{line} {why}")
    code = compile(body, f"README.md:{line}", "exec")
    exec(code, {"__name__": "__readme__"})  # noqa: S102 - the README's own example


# --------------------------------------------------------------------------- the lik command


def _lik_lines() -> list[tuple[int, str]]:
    """(line number, command) of every ``lik ...`` line in the README's shell blocks, but ``lik serve``
    (a server runs until it is stopped: tests/test_serve.py runs `lik serve` as a real process)."""
    out = []
    for line, body in _blocks(("bash", "console", "sh", "shell")):
        joined = body.replace("\\\n", " ")
        for i, cmd in enumerate(joined.splitlines()):
            cmd = cmd.strip().removeprefix("$ ")
            if cmd.startswith("lik ") and not cmd.startswith("lik serve "):
                out.append((line + i, cmd))
    return out


LIK_LINES = _lik_lines()


def _planted() -> tuple[str, ...]:
    spec = importlib.util.spec_from_file_location("make_examples", REPO / "examples" / "make_examples.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return tuple(mod.PLANTED)


def test_readme_shows_the_cli():
    subcommands = {shlex.split(cmd, comments=True)[1] for _, cmd in LIK_LINES}
    assert {"score", "pack", "inspect", "info"} <= subcommands, subcommands


@pytest.mark.parametrize("line, cmd", LIK_LINES, ids=[f"README.md:{n}" for n, _ in LIK_LINES])
def test_readme_cli_example(line, cmd, tmp_path, monkeypatch):
    from lik_command import run_lik

    argv = shlex.split(cmd, comments=True)[1:]
    moved = {}
    for i, arg in enumerate(argv):
        if arg.startswith("/tmp/"):
            moved[arg] = argv[i] = str(tmp_path / pathlib.PurePosixPath(arg).relative_to("/tmp"))
    monkeypatch.chdir(REPO)
    result = run_lik(*argv)
    assert result.exit_code == 0, f"README.md:{line}: `{cmd}` exited {result.exit_code}:\n{result.output}"
    if argv[0] == "score":
        out = pathlib.Path(argv[argv.index("--out") + 1])
        rows = [r.split("\t") for r in out.read_text().splitlines()]
        assert rows[0] == ["query", "rank", "doc", "score"]
        if "examples/queries.npy" in argv:
            firsts = tuple(doc for _, rank, doc, _ in rows[1:] if rank == "1")
            assert firsts == _planted(), f"README.md:{line}: rank-1 documents {firsts}"
    if argv[0] == "pack":
        out = pathlib.Path(argv[argv.index("--out") + 1])
        assert (out / "manifest.json").is_file()
