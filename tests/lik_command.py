"""The ``lik`` command run in the test's own process, its stdout and stderr kept apart."""

from __future__ import annotations

from click.testing import CliRunner

from lik_cupy import cli


def run_lik(*args, **kw):
    """``lik ARGS`` through click's runner: the ``Result`` (exit_code, stdout, stderr)."""
    try:
        runner = CliRunner(mix_stderr=False)  # click 8.1
    except TypeError:
        runner = CliRunner()  # click >= 8.2 keeps stderr apart by default
    return runner.invoke(cli.main, [str(a) for a in args], catch_exceptions=False, **kw)
