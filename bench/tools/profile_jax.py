"""Where a lik_cupy.jax call under jit spends its time, µs per call back to back (best of 3 x 300):
XLA's dispatch of a jitted x + 1 (jit_add), a no-op buffer_callback (bc_noop), one that reads its
buffers' interface (bc_touch_cai), one that makes CuPy views (bc_views), then lik_cupy.maxsim on
them (bc_views_maxsim) and a copy into XLA's output (bc_views_maxsim_copy); lik_cupy.jax.maxsim
under jit; lik_cupy.maxsim from CuPy. 1 query (32) x 1,000 docs (300), d = 128, fp16.

    PYTHONPATH=. python3 bench/tools/profile_jax.py   # -> $OUT/profile_jax.json (or /tmp), with the sources' provenance
"""

import json
import os
import sys
import time
from pathlib import Path

import cupy
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
import lik_cupy
import lik_cupy.jax as lj
from bench.lib.results import write_json
from lik_cupy import _jax_ops

def per_call(f, *a, n=300):
    for _ in range(20): r = f(*a)
    jax.block_until_ready(r)
    best = 1e9
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n): r = f(*a)
        jax.block_until_ready(r)
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best

key = jax.random.PRNGKey(0)
Q = jax.random.normal(key, (1, 32, 128), jnp.float16)
D = jax.random.normal(key, (1000, 300, 128), jnp.float16)
out = {}
out["jit_add"] = per_call(jax.jit(lambda q: q + 1), Q)
out_sd = (jax.ShapeDtypeStruct((1, 1000), jnp.float32),)
noop = buffer_callback(lambda ctx, outs, *b: None, out_sd)
out["bc_noop"] = per_call(jax.jit(lambda q, d: noop(q, d)), Q, D)
def touch(ctx, outs, *b):
    _ = ctx.stream  # (read, as the real callback does)
    for x in b: x.__cuda_array_interface__
    outs[0].__cuda_array_interface__
bc_touch = buffer_callback(touch, out_sd)
out["bc_touch_cai"] = per_call(jax.jit(lambda q, d: bc_touch(q, d)), Q, D)
def xla_contexts(ctx, buffers):
    """(device, CuPy's Device, CuPy's view of XLA's stream) of a callback's buffers, as
    lik_cupy.jax's callback makes them (a plain call: a context manager would add to the timings)."""
    dev = _jax_ops._device_of(buffers)
    st = ctx.stream() if callable(ctx.stream) else ctx.stream
    return dev, cupy.cuda.Device(dev), _jax_ops._cupy_stream(int(st), dev)
# views + contexts only
def views(ctx, outs, *b):
    dev, device, stream = xla_contexts(ctx, b + tuple(outs))
    with device, stream:
        [ _jax_ops._cupy_view(x, dev) for x in b]; [_jax_ops._cupy_view(o, dev) for o in outs]
bc_views = buffer_callback(views, out_sd)
out["bc_views"] = per_call(jax.jit(lambda q, d: bc_views(q, d)), Q, D)
# views + maxsim (cupy, prepared) no copy
def score(ctx, outs, *b):
    dev, device, stream = xla_contexts(ctx, b + tuple(outs))
    with device, stream:
        q, d = [_jax_ops._cupy_view(x, dev) for x in b]
        lik_cupy.maxsim(q, d, validate=False)
bc_score = buffer_callback(score, out_sd)
out["bc_views_maxsim"] = per_call(jax.jit(lambda q, d: bc_score(q, d)), Q, D)
def score_copy(ctx, outs, *b):
    dev, device, stream = xla_contexts(ctx, b + tuple(outs))
    with device, stream:
        q, d = [_jax_ops._cupy_view(x, dev) for x in b]
        o = _jax_ops._cupy_view(outs[0], dev)
        s = lik_cupy.maxsim(q, d, validate=False)
        o[...] = s.reshape(o.shape)
bc_sc = buffer_callback(score_copy, out_sd)
out["bc_views_maxsim_copy"] = per_call(jax.jit(lambda q, d: bc_sc(q, d)), Q, D)
out["lik_jax_maxsim"] = per_call(jax.jit(lambda q, d: lj.maxsim(q, d)), Q, D)
qc, dc = cupy.asarray(np.asarray(Q)), cupy.asarray(np.asarray(D))
def cupy_loop(n=300):
    for _ in range(20): lik_cupy.maxsim(qc, dc)
    cupy.cuda.Device().synchronize(); best=1e9
    for _ in range(3):
        t=time.perf_counter()
        for _ in range(n): lik_cupy.maxsim(qc, dc)
        cupy.cuda.Device().synchronize(); best=min(best,(time.perf_counter()-t)/n*1e6)
    return best
out["cupy_maxsim"] = cupy_loop()
print(json.dumps({k: round(v, 1) for k, v in out.items()}, indent=1))
write_json(os.path.join(os.environ.get("OUT", "/tmp"), "profile_jax.json"), out)
