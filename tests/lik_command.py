"""The ``lik`` command run in the test's own process, its stdout and stderr kept apart; the
``PYTHONPATH`` of a child process that runs this checkout; whether an optional module is installed."""

from __future__ import annotations

import importlib.util
import os
import pathlib

from click.testing import CliRunner

from lik_cupy import cli


def run_lik(*args, **kw):
    """``lik ARGS`` through click's runner: the ``Result`` (exit_code, stdout, stderr)."""
    try:
        runner = CliRunner(mix_stderr=False)  # click 8.1
    except TypeError:
        runner = CliRunner()  # click >= 8.2 keeps stderr apart by default
    return runner.invoke(cli.main, [str(a) for a in args], catch_exceptions=False, **kw)


def child_pythonpath() -> str:
    """``PYTHONPATH`` for a child process: this checkout first, then the caller's own entries
    (packages a host provides on its PYTHONPATH, as the device machines do)."""
    return os.pathsep.join(filter(None, [str(pathlib.Path(__file__).resolve().parents[1]),
                                         os.environ.get("PYTHONPATH")]))


def installed(*modules: str) -> bool:
    """Whether every one of ``modules`` (dotted names too) can be imported, without importing them
    (a dotted name's parents are imported)."""
    try:
        return all(importlib.util.find_spec(m) is not None for m in modules)
    except ModuleNotFoundError:  # a dotted name whose parent is not installed
        return False
