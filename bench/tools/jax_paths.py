#!/usr/bin/env python3
"""Write the JAX rows of a ``bench/suites/bench_train.py`` run (one file, or the parts of a run split by
``--tag``) into ``lik_cupy/_dispatch/jax_paths.py``.

For each JAX cell (N, Lq, Ld) of the run, the faster of ``lik_cupy.jax.maxsim``'s two paths, the
kernels (row ``kernel``) and its XLA einsum (row ``xla``), becomes the cell's verdict (``"kernel"``
where the XLA row was skipped or failed); the cells replace the table's rows for the run's backend
(``jax_backend``: "gpu", or "cpu" for a CPU run) and ``JAX_PATHS_SOURCE`` names the file and the GPU.
The other backends' rows are kept.

    python3 bench/tools/jax_paths.py bench/results/latest/train_nvidia-h200_jax*.json [--module PATH] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODULE = REPO / "lik_cupy" / "_dispatch" / "jax_paths.py"
# The two assignments this script owns, each up to the first line that closes it.
_SOURCE = re.compile(r"^JAX_PATHS_SOURCE = .*?$", re.M)
_TABLE = re.compile(r"^JAX_PATHS: .*? = \{\n.*?^\}\n", re.M | re.S)


def verdicts(run: dict) -> list[tuple[int, int, int, str]]:
    """(N, Lq, Ld, "xla" | "kernel") for every JAX cell of ``run`` (a bench_train JSON) whose kernel row was timed."""
    rows: dict = {}
    for r in run["jax_rows"]:
        rows.setdefault((r["n"], r["lq"], r["ld"]), {})[r["impl"]] = r.get("wall_ms")
    out = []
    for (n, lq, ld), times in sorted(rows.items()):
        kernel, xla = times.get("kernel"), times.get("xla")
        if kernel is None:
            continue
        out.append((n, lq, ld, "xla" if xla is not None and xla < kernel else "kernel"))
    return out


def rewrite(text: str, backend: str, cells: list, source: str) -> str:
    """``jax_paths.py``'s text with ``backend``'s cells and the source replaced."""
    namespace: dict = {}
    table = _TABLE.search(text)
    if table is None or _SOURCE.search(text) is None:
        raise SystemExit("jax_paths.py no longer has the JAX_PATHS_SOURCE and JAX_PATHS assignments this script writes")
    exec(table.group(0).replace("JAX_PATHS: dict[str, tuple[tuple[int, int, int, str], ...]]", "JAX_PATHS"),
         namespace)
    paths = dict(namespace["JAX_PATHS"])
    paths[backend] = tuple(cells)
    lines = ["JAX_PATHS: dict[str, tuple[tuple[int, int, int, str], ...]] = {"]
    for key in sorted(paths):
        lines.append(f"    {key!r}: (")
        lines += [f"        {cell!r}," for cell in paths[key]]
        lines.append("    ),")
    lines.append("}\n")
    text = _TABLE.sub(lambda _: "\n".join(lines), text, count=1)
    return _SOURCE.sub(lambda _: f"JAX_PATHS_SOURCE = {source!r}", text, count=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="bench_train.py JSON files of one device (a run split by --tag)")
    ap.add_argument("--module", default=str(MODULE), help="the module to rewrite (default: lik_cupy's own)")
    ap.add_argument("--dry-run", action="store_true", help="print the new module instead of writing it")
    args = ap.parse_args(argv)
    paths = [Path(r) for r in args.runs]
    runs = [json.loads(p.read_text()) for p in paths]
    if any(r.get("smoke") for r in runs) and not args.dry_run and Path(args.module).resolve() == MODULE:
        raise SystemExit("a --smoke run's times mean nothing; not writing lik_cupy's table from it")
    devices = {(r.get("device"), r.get("jax_backend")) for r in runs}
    if len(devices) != 1:
        raise SystemExit(f"the runs come from different devices or backends: {sorted(map(str, devices))}")
    (device, backend), = devices
    cells = verdicts({"jax_rows": [row for r in runs for row in r["jax_rows"]]})
    if not cells:
        raise SystemExit("the runs have no timed JAX kernel rows")
    shown = ", ".join(str(p.resolve().relative_to(REPO)) if p.resolve().is_relative_to(REPO) else str(p)
                      for p in paths)
    source = f"{shown} ({device}, jit(value_and_grad) in-batch steps)"
    module = Path(args.module)
    text = rewrite(module.read_text(), backend, cells, source)
    if args.dry_run:
        print(text)
        return 0
    tmp = module.with_suffix(".py.tmp")
    tmp.write_text(text)
    os.replace(tmp, module)
    print(f"wrote {len(cells)} {backend} cells to {module}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
