"""Run the ``lik`` command from a source checkout (``python cli.py ...``); the command itself is
``lik_cupy.cli``, installed as ``lik`` and runnable as ``python -m lik_cupy``."""

from lik_cupy.cli import main

if __name__ == "__main__":
    main(prog_name="lik")
