"""Where results go and how they are written: the output directory, the GPU slug in file names, JSON and
plain-text tables, and the versions of what was timed. Every result JSON is written here (``write_json``,
``write_result``), and so carries the sources' provenance (``bench.lib.provenance``)."""

from __future__ import annotations

import json
import math
import os
import platform
import re
from pathlib import Path

from .provenance import provenance

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"  # where a run writes by default; the committed runs sit in latest/ and archive/


def out_dir(arg=None) -> Path:
    """The directory a run writes to: ``arg`` (``--out``), else ``$OUT``, else ``bench/results``."""
    return Path(arg or os.environ.get("OUT") or RESULTS)


def slugify(s: str) -> str:
    """The GPU name as it appears in result file names: ``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``."""
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-") or "gpu"


def short_err(e: BaseException, n: int = 300) -> str:
    msg = f"{type(e).__name__}: {e}".replace("\n", " ")
    return msg[:n]


# A contender whose scores stray further than this from float64 (relative) is wrong: it is reported,
# never the best peer nor given a ratio. The peers' fp16 / TF32 paths sit near 1e-3 at worst.
WRONG_REL_ERR = 1e-2


def counts(ms, err=None, limit: float = WRONG_REL_ERR) -> bool:
    """Whether a contender that took ``ms`` per call with error ``err`` (None: not measured) may enter a
    ratio: a finite positive time, and an error (when measured) finite and at most ``limit``."""
    if not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms <= 0:
        return False
    return err is None or (isinstance(err, (int, float)) and math.isfinite(err) and err <= limit)


def fastest(times: dict, errors: dict | None = None, limit: float = WRONG_REL_ERR):
    """``(name, ms)`` of the fastest contender in ``times`` (name -> ms per call) that ``counts`` with its
    error in ``errors`` (name -> error; a name missing there: not measured), or None when none does."""
    errors = errors or {}
    ok = [(ms, name) for name, ms in times.items() if counts(ms, errors.get(name), limit)]
    return (min(ok)[1], min(ok)[0]) if ok else None


def finite_or_str(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def sanitize(obj):
    """``obj`` with every non-finite float written as a string (strict JSON)."""
    if isinstance(obj, dict):
        return {k: sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [sanitize(v) for v in obj]
    return finite_or_str(obj)


def write_json(path, payload: dict, default=None):
    """Write ``payload`` and the sources' ``provenance`` (its last key) to ``path``, strict JSON (non-finite
    floats as strings; ``default`` as in ``json.dumps``), through a temporary file, so a run killed mid-write
    keeps the last one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    text = json.dumps(sanitize({**payload, "provenance": provenance()}), indent=1, allow_nan=False, default=default)
    tmp.write_text(text + "\n")
    os.replace(tmp, path)


def write_result(out, name: str, props, **fields) -> str:
    """Write ``out/<name>_<gpu-slug>.json`` (``write_json``) holding the GPU's name and compute capability
    (``props``: lik_cupy's device properties) and then ``fields``; returns its path."""
    path = os.path.join(out, f"{name}_{slugify(props.name)}.json")
    write_json(path, {"gpu": props.name, "cc": props.cc, **fields})
    return path


def text_table(header, body, keys) -> list[str]:
    """Lines of a plain-text table: ``header`` and the rows of ``body`` (lists of cells), each column as wide as
    its widest cell but the last, and a blank line wherever ``keys`` (one per row) changes."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)] if body else [len(h) for h in header]
    widths[-1] = 0
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(header, widths)).rstrip()]
    prev = None
    for key, b in zip(keys, body):
        if prev is not None and key != prev:
            lines.append("")
        prev = key
        lines.append("  ".join(str(x).ljust(w) for x, w in zip(b, widths)).rstrip())
    return lines


def versions(ctx):
    """Python, torch, CUDA and the version of every library a suite times (a missing one says why)."""
    torch = ctx.torch
    v = {"python": platform.python_version(), "torch": torch.__version__,
         "torch_cuda": torch.version.cuda}
    for mod, key in (("triton", "triton"), ("cupy", "cupy"), ("flash_maxsim", "flash_maxsim"),
                     ("late_interaction_kernels", "late_interaction_kernels"), ("lik_cupy", "lik_cupy"),
                     ("matplotlib", "matplotlib")):
        try:
            m = __import__(mod)
            v[key] = getattr(m, "__version__", "?")
        except Exception as e:  # noqa: BLE001
            v[key] = f"unavailable ({short_err(e, 120)})"
    try:
        if ctx.cupy is not None:
            v["cupy_cuda_runtime"] = ctx.cupy.cuda.runtime.runtimeGetVersion()
            v["cuda_driver"] = ctx.cupy.cuda.runtime.driverGetVersion()
    except Exception:  # noqa: BLE001
        pass
    return v
