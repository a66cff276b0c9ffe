"""Build the wheel, install it (alone, --no-deps) into a fresh venv and run ``lik`` from there.

Runs on a CPU-only machine.  The fresh venv gets its dependencies (numpy, click,
ml_dtypes, and CuPy if present) from the running interpreter's site-packages through
a ``.pth`` file, so nothing is downloaded; lik_cupy itself comes only from the wheel
(checked below), and nothing named ``cli`` is installed at top level.  A ``.pth`` line only adds a directory to sys.path:
``.pth`` files inside it (e.g. an editable install of this repo) are not executed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
BIN = "Scripts" if os.name == "nt" else "bin"


def _version_tuple(dist: str) -> tuple[int, ...]:
    try:
        v = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return ()
    return tuple(int(p) for p in v.split(".")[:2] if p.isdigit())


def _run(cmd, **kw):
    kw.setdefault("timeout", 600)
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert p.returncode == 0, f"{cmd} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return p


def _build_wheel(src: pathlib.Path, outdir: pathlib.Path) -> pathlib.Path:
    local_backend = _version_tuple("setuptools") >= (77,) and importlib.util.find_spec("wheel") is not None
    if local_backend and importlib.util.find_spec("build") is not None:
        cmd = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", outdir, src]
    elif local_backend:
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", outdir, src]
    else:  # this interpreter lacks the build backend: let pip fetch it into an isolated env
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", outdir, src]
    _run(cmd, cwd=src)
    wheels = sorted(outdir.glob("lik_cupy-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _source_copy(dst: pathlib.Path) -> pathlib.Path:
    """The files the wheel is built from, copied so the build leaves nothing in the repo."""
    dst.mkdir()
    for name in ("pyproject.toml", "README.md", "cli.py", "LICENSE", "setup.cfg", "MANIFEST.in"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, dst / name)
    for name in ("lik_cupy", "cuda_src"):
        shutil.copytree(REPO / name, dst / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dst


def _venv_python(venv_dir: pathlib.Path) -> pathlib.Path:
    _run([sys.executable, "-m", "venv", venv_dir])
    py = venv_dir / BIN / ("python.exe" if os.name == "nt" else "python")
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (pathlib.Path(site) / "_lik_test_deps.pth").write_text("\n".join(sorted(ours)) + "\n")
    return py


def _clean_env():
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # nothing from the repo checkout may leak in
    env.pop("PYTHONHOME", None)
    return env


def _ref_scores(Q, D, d_len):
    sim = np.einsum("qsd,ntd->qnst", Q.astype(np.float64), D.astype(np.float64))
    mask = np.arange(D.shape[1])[None, :] < d_len[:, None]
    sim = np.where(mask[None, :, None, :], sim, -np.inf)
    return sim.max(-1).sum(-1)


def test_wheel_installs_and_scores(tmp_path):
    src = _source_copy(tmp_path / "src")
    whl = _build_wheel(src, tmp_path / "dist")

    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        entry_points = next((z.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt")), "")
    assert "cli.py" not in names and not any(n.startswith("cli/") for n in names)
    assert "lik_cupy/__init__.py" in names and "lik_cupy/cli.py" in names and "lik_cupy/__main__.py" in names
    kernel_sources = sorted(str(p.relative_to(REPO / "cuda_src")) for p in (REPO / "cuda_src").rglob("*")
                            if p.suffix in (".cu", ".cuh"))
    assert any(n.endswith(".cu") for n in kernel_sources) and any(n.endswith(".cuh") for n in kernel_sources)
    for n in kernel_sources:
        assert f"lik_cupy/cuda_src/{n}" in names, f"{n} missing from the wheel"
    for pkg in sorted({p.parent.relative_to(REPO).as_posix() for p in (REPO / "lik_cupy").rglob("*.py")}):
        assert f"{pkg}/__init__.py" in names, f"package {pkg} missing from the wheel"
    assert "lik = lik_cupy.cli:main" in entry_points
    licenses = [n for n in names if ".dist-info/" in n and n.rsplit("/", 1)[-1] == "LICENSE"]
    assert licenses, "the wheel carries no LICENSE"
    with zipfile.ZipFile(whl) as z:
        license_text = z.read(licenses[0]).decode()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text

    py = _venv_python(tmp_path / "venv")
    _run([py, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check", whl])
    env, work = _clean_env(), tmp_path / "work"
    work.mkdir()

    where = _run(
        [py, "-c", "import lik_cupy.cli as c, lik_cupy, pathlib; print(c.__file__); print(lik_cupy.__file__);"
         "r = pathlib.Path(lik_cupy.__file__).parent / 'cuda_src';"
         "print(sorted(str(p.relative_to(r)) for p in r.rglob('*') if p.suffix in ('.cu', '.cuh')))"],
        cwd=work, env=env,
    ).stdout.splitlines()
    venv_root = str((tmp_path / "venv").resolve())
    assert where[0].startswith(venv_root) and where[1].startswith(venv_root), where
    assert where[2] == str(kernel_sources)

    lik = tmp_path / "venv" / BIN / "lik"
    h = _run([lik, "--help"], cwd=work, env=env).stdout
    assert "[Nq, Lq, d]" in h and "lik score" in h
    m = _run([py, "-m", "lik_cupy", "--help"], cwd=work, env=env).stdout
    assert "lik score" in m

    rng = np.random.default_rng(11)
    Q = rng.standard_normal((2, 5, 12)).astype(np.float32)
    D = rng.standard_normal((9, 6, 12)).astype(np.float32)
    d_len = rng.integers(1, 7, size=9).astype(np.int32)
    np.save(work / "q.npy", Q)
    np.save(work / "d.npy", D)
    np.save(work / "dl.npy", d_len)
    p = _run([lik, "score", "--queries", "q.npy", "--docs", "d.npy", "--d-lengths", "dl.npy",
              "--top-k", 4, "--out", "res.tsv", "--cpu"], cwd=work, env=env)
    assert p.stderr == ""
    rows = [line.split("\t") for line in (work / "res.tsv").read_text().splitlines()]
    assert rows[0] == ["query", "rank", "doc", "score"]
    S = _ref_scores(Q, D, d_len)
    expect = np.argsort(-S, axis=1, kind="stable")[:, :4]
    for q in range(2):
        got = [r for r in rows[1:] if r[0] == str(q)]
        assert [int(r[2]) for r in got] == expect[q].tolist()
        np.testing.assert_allclose([float(r[3]) for r in got], S[q, expect[q]], rtol=1e-5, atol=1e-5)

    info = _run([lik, "info"], cwd=work, env=env).stdout
    assert "kernel cache" in info and venv_root in info
