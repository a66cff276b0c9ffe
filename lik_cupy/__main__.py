"""``python -m lik_cupy``: the ``lik`` command."""

from lik_cupy.cli import main

if __name__ == "__main__":
    main(prog_name="lik")
