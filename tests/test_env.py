"""Environment variables: one prefix (``LIK_``), the old ``LIK_CUPY_`` spellings kept as warned aliases,
and every variable the package reads documented in docs/environment.md."""

from __future__ import annotations

import pathlib
import re

import pytest

from lik_cupy._base import env

REPO = pathlib.Path(__file__).resolve().parents[1]
OLD = ("LIK_CUPY_CACHE_DIR", "LIK_CUPY_POISON", "LIK_CUPY_DISABLE_WGMMA", "LIK_CUPY_DISABLE_TMA")
READERS = {"LIK_CACHE_DIR": env.cache_dir_override, "LIK_POISON": env.poison_outputs,
           "LIK_DISABLE_WGMMA": env.wgmma_disabled, "LIK_DISABLE_TMA": env.tma_disabled}
SET = {"LIK_CACHE_DIR": "/some/dir", "LIK_POISON": "1", "LIK_DISABLE_WGMMA": "1", "LIK_DISABLE_TMA": "1"}
UNSET = {"LIK_CACHE_DIR": None, "LIK_POISON": False, "LIK_DISABLE_WGMMA": False, "LIK_DISABLE_TMA": False}


@pytest.fixture
def clean(monkeypatch):
    for name in (*READERS, *OLD):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(env, "_warned", set())
    return monkeypatch


@pytest.mark.parametrize("name", sorted(READERS))
def test_the_new_name_is_read_without_a_warning(clean, name, recwarn):
    assert READERS[name]() == UNSET[name]
    clean.setenv(name, SET[name])
    assert READERS[name]() == (SET[name] if name == "LIK_CACHE_DIR" else True)
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize("name", sorted(READERS))
def test_the_old_name_still_works_with_one_deprecation_warning(clean, name, recwarn):
    old = name.replace("LIK_", "LIK_CUPY_", 1)
    clean.setenv(old, SET[name])
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated; set {name} instead"):
        assert READERS[name]() == (SET[name] if name == "LIK_CACHE_DIR" else True)
    recwarn.clear()
    READERS[name]()  # once per process
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize("name", sorted(READERS))
def test_the_new_name_wins_over_the_old(clean, name):
    clean.setenv(name.replace("LIK_", "LIK_CUPY_", 1), SET[name])
    clean.setenv(name, "")  # set, empty: off (the cache directory: the default)
    assert READERS[name]() == UNSET[name]


def test_every_package_variable_is_documented():
    # env.py is where the package reads its environment (its docstring says so).
    read = set(re.findall(r"\"([A-Z][A-Z0-9_]+)\"", pathlib.Path(env.__file__).read_text()))
    assert read >= set(READERS) | set(OLD) | {"LIK_VALIDATE", "LIK_PRECISION"}
    doc = (REPO / "docs" / "environment.md").read_text()
    assert sorted(n for n in read if f"`{n}`" not in doc) == []


def test_nothing_outside_the_alias_table_uses_an_old_name():
    exempt = {pathlib.Path(env.__file__).resolve(), REPO / "tests" / "test_env.py", REPO / "docs" / "environment.md"}
    files = [p for top in ("lik_cupy", "tests", "bench", "docs", ".ci") for p in (REPO / top).rglob("*")
             if p.is_file() and p.suffix in (".py", ".sh", ".md", "") and "results" not in p.parts
             and "__pycache__" not in p.parts and p not in exempt]
    files.append(REPO / "README.md")
    assert sorted(str(p.relative_to(REPO)) for p in files if "LIK_CUPY_" in p.read_text(errors="replace")) == []
