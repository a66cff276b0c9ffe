"""Interleaved A/B of JAX jit(value_and_grad) steps: XLA einsum vs lik_cupy.jax (xla path) vs variants."""
import json, os, statistics, sys, time
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax, jax.numpy as jnp, numpy as np
import lik_cupy.jax as lj

TAU = 0.05
cells = [tuple(int(x) for x in c.split("x")) for c in (sys.argv[1] if len(sys.argv) > 1 else
         "32x32x300,64x32x80,128x32x80,32x128x300,64x32x300").split(",")]
ROUNDS, STEPS = int(os.environ.get("ROUNDS", 15)), int(os.environ.get("STEPS", 200))

def einsum(a, b):
    return jnp.einsum("isk,jtk->ijst", a, b, preferred_element_type=jnp.float32).max(-1).sum(-1)

def old_xla(a, b):  # the previous path: argmax + select-sum
    sim = jnp.einsum("isk,jtk->ijst", a, b, preferred_element_type=jnp.float32)
    first = jnp.argmax(sim, axis=-1)
    return jnp.where(jnp.arange(sim.shape[-1]) == first[..., None], sim, 0).sum(-1).sum(-1)

from lik_cupy._jax_xla import _first_max
def bare_first(a, b):  # the new rule without lik_cupy.jax's wrappers
    return _first_max(jnp.einsum("isk,jtk->ijst", a, b, preferred_element_type=jnp.float32)).sum(-1)

def _sim(a, b):
    return jnp.einsum("isk,jtk->ijst", a, b, preferred_element_type=jnp.float32)

def _mk(fwd, bwd):
    f = jax.custom_vjp(lambda sim: sim.max(-1))
    f.defvjp(fwd, bwd)
    return lambda a, b: f(_sim(a, b)).sum(-1)

def _sel(iota, first, g, dt):
    return (jnp.where(iota == first[..., None], g[..., None], 0).astype(dt),)

def f32_fwd(sim):
    best = sim.max(-1); return best, (sim, best)
def f32_bwd(res, g):
    sim, best = res
    iota = jnp.arange(sim.shape[-1], dtype=jnp.float32)
    first = jnp.min(jnp.where((sim == best[..., None]) | jnp.isnan(sim), iota, float(sim.shape[-1])), -1)
    return _sel(iota, first, g, sim.dtype)

def infwd_fwd(sim):
    best = sim.max(-1)
    iota = jnp.arange(sim.shape[-1], dtype=jnp.int32)
    first = jnp.min(jnp.where((sim == best[..., None]) | jnp.isnan(sim), iota, sim.shape[-1]), -1)
    return best, (first, sim.shape[-1])
def infwd_bwd(res, g):
    first, L = res
    iota = jnp.arange(L, dtype=jnp.int32)
    return (jnp.where(iota == first[..., None], g[..., None], 0).astype(jnp.float32),)

def mul_bwd(res, g):  # the one-hot as a multiply, as jnp.max's own gradient is formed
    sim, best = res
    iota = jnp.arange(sim.shape[-1], dtype=jnp.float32)
    first = jnp.min(jnp.where((sim == best[..., None]) | jnp.isnan(sim), iota, float(sim.shape[-1])), -1)
    return ((iota == first[..., None]).astype(sim.dtype) * g[..., None],)

def eqmul_bwd(res, g):  # and reading the similarities again in it, as jnp.max's does
    sim, best = res
    iota = jnp.arange(sim.shape[-1], dtype=jnp.float32)
    won = (sim == best[..., None]) | jnp.isnan(sim)
    first = jnp.min(jnp.where(won, iota, float(sim.shape[-1])), -1)
    return ((won & (iota == first[..., None])).astype(sim.dtype) * g[..., None],)

def tie_bwd(res, g):  # every equal maximum takes g (wrong on ties): what a select without the index costs
    sim, best = res
    return (jnp.where(sim == best[..., None], g[..., None], 0).astype(sim.dtype),)

def lik(a, b):
    return lj.maxsim(a, b)

impls = {"einsum": einsum, "lik_xla": lik, "mul": _mk(f32_fwd, mul_bwd), "eqmul": _mk(f32_fwd, eqmul_bwd),
         "tie_select": _mk(f32_fwd, tie_bwd)}
os.environ["LIK_JAX_PATH"] = "xla"
rng = np.random.default_rng(0)
out = []
for n, lq, ld in cells:
    q, d = (jnp.asarray((lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True))(rng.standard_normal((n, L, 128)).astype(np.float32)).astype(np.float16)) for L in (lq, ld))
    steps = {}
    for name, f in impls.items():
        loss = lambda a, b, f=f: -jnp.mean(jnp.diagonal(jax.nn.log_softmax(f(a, b) / TAU, axis=1)))
        s = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        jax.block_until_ready(s(q, d)); jax.block_until_ready(s(q, d))
        steps[name] = s
    times = {k: [] for k in impls}
    names = list(impls)
    for r in range(ROUNDS):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            s = steps[name]; last = None
            t = time.perf_counter()
            for _ in range(STEPS):
                last = s(q, d)
            jax.block_until_ready(last)
            times[name].append((time.perf_counter() - t) * 1e3 / STEPS)
    row = {"cell": f"{n}x{lq}x{ld}", **{k: {"median_ms": statistics.median(v), "best_ms": min(v)} for k, v in times.items()}}
    out.append(row)
    print(row["cell"], " ".join(f"{k}={row[k]['median_ms']:.4f}/{row[k]['best_ms']:.4f}" for k in impls), flush=True)
json.dump({"gpu": jax.devices()[0].device_kind, "rounds": ROUNDS, "steps": STEPS, "rows": out},
          open(os.path.join(os.environ.get("OUT", "."), "jax_ab.json"), "w"), indent=1)
