"""Which scaled (FP8, INT8) shapes score wrong on this GPU: per-tensor against per-token document
scales, the 96-token Hopper tiles, queries of 33 tokens, several queries a tile. Prints one line a
case: the largest |score - float64 of the dequantised inputs| and the kernel dispatch picks.

    python bench/tools/fp8_scale_probe.py        # GPU, a few seconds

An error near 1e-3 is FP8 rounding (INT8: 1e-6); one near the scores' size is a wrong scale.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the float64 reference
from reference import maxsim_ref  # noqa: E402

CASES = [(4, 33, 60, 77, "tensor"), (4, 33, 60, 77, "token"), (4, 32, 60, 77, "token"), (1, 33, 60, 77, "token"),
         (4, 33, 60, 64, "token"), (4, 33, 60, 128, "token"), (3, 40, 60, 77, "token"), (16, 32, 60, 48, "token"),
         (4, 33, 60, 300, "token")]


def _unit(rng, *shape):
    x = rng.standard_normal(shape)
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _dequantised(x, s):
    s = np.asarray(s, np.float64)
    return x.astype(np.float64) * (s[..., None] if s.ndim else s)


def main() -> int:
    import cupy

    import lik_cupy
    from lik_cupy._dispatch import choose_forward

    cc = int(cupy.cuda.Device().compute_capability)
    rng = np.random.default_rng(1)
    for dtype in ("float8_e4m3fn", "int8"):
        for nq, lq, nd, ld, per in CASES:
            if dtype == "int8" and per == "tensor":
                continue  # quantize_int8 scales per token only
            q, d = _unit(rng, nq, lq, 128), _unit(rng, nd, ld, 128)
            if dtype == "int8":
                (q8, qs), (d8, ds), fn = lik_cupy.quantize_int8(q), lik_cupy.quantize_int8(d), lik_cupy.maxsim_int8
            else:
                q8, qs = lik_cupy.quantize_fp8(q)
                d8, ds = lik_cupy.quantize_fp8(d, per=per)
                fn = lik_cupy.maxsim_fp8

            def dev(a):  # FP8 (ml_dtypes) as its uint8 bit patterns, the form CuPy holds it in
                a = np.asarray(a)
                return cupy.asarray(a.view(np.uint8) if a.dtype.itemsize == 1 and dtype != "int8" else a)

            s = cupy.asnumpy(fn(dev(q8), dev(d8), dev(ds), q_scales=dev(qs)))
            ref = maxsim_ref(_dequantised(q8, qs), _dequantised(d8, ds))[0]
            cfg = choose_forward(cc, dtype, 128, lq, False, True, True, nq, ld, False, True, False)
            print(f"{dtype:14s} nq={nq:2d} lq={lq} ld={ld:3d} {per:6s} max|err|={np.abs(s - ref).max():.3e}  {cfg.name}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
