"""Benchmarks of lik_cupy (not part of the installed package): see bench/README.md."""
