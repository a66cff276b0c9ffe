"""The bench scripts' modules for the tests that run them on the CPU (``bench/`` is a folder of
scripts, not a package the tests import by name)."""

from __future__ import annotations

import importlib.util
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]


def load(rel: str):
    """A fresh module of the script at ``rel`` (relative to the repository root), named by its stem."""
    path = REPO / rel
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
