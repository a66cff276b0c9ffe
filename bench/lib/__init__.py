"""What the bench scripts share, in one place (nothing here imports torch, CuPy or lik_cupy at import time,
so ``--table-from`` and ``--help`` work without a GPU):

- ``results``: where results go (``$OUT``, else ``bench/results``), the GPU slug in file names, JSON writing
  (every result JSON, stamped with its ``provenance``), the plain-text tables, library and baseline versions;
- ``provenance``: which code a result came from (the digest of the package's sources, and the commit where it
  can be checked);
- ``reference``: the float64 references contenders are checked against, and the errors against them;
- ``timing``: CUDA-event timing (back-to-back calls, calls behind a queued sleep), the cuBLAS / HBM ceilings;
- ``gpu``: the run context of the suites (torch, CuPy allocating through torch, the sleep calibration);
- ``baselines``: the peers (flash-maxsim, LIK) loaded when installed, and flash-maxsim's packed kernel;
- ``forcing``: making lik_cupy's dispatch pick a given configuration (what the sweeps and split-d time);
- ``sweep``: what a sweep starts from (``--out``, the device, a seeded generator) and writes.

Scripts put the repository root first on ``sys.path`` (one line at their top) and import ``bench.lib``.
"""
