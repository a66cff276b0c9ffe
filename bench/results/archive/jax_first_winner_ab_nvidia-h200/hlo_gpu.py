import os, re, sys
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax, jax.numpy as jnp, numpy as np
import lik_cupy.jax as lj
n, lq, ld = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "32x32x300").split("x"))
rng = np.random.default_rng(0)
q = jnp.asarray(rng.standard_normal((n, lq, 128)).astype(np.float16))
d = jnp.asarray(rng.standard_normal((n, ld, 128)).astype(np.float16))
def einsum(a, b):
    return jnp.einsum("isk,jtk->ijst", a, b, preferred_element_type=jnp.float32).max(-1).sum(-1)
def loss(score):
    return lambda a, b: -jnp.mean(jnp.diagonal(jax.nn.log_softmax(score(a, b) / 0.05, axis=1)))
os.environ["LIK_JAX_PATH"] = "xla"
out = os.environ.get("OUT", "/tmp")
for name, f in (("einsum", einsum), ("ours", lj.maxsim)):
    step = jax.jit(jax.value_and_grad(loss(f), argnums=(0, 1)))
    txt = step.lower(q, d).compile().as_text()
    open(f"{out}/hlo_{name}.txt", "w").write(txt)
    entry = txt[txt.index("ENTRY"):]
    print(f"== {name}")
    for line in entry.splitlines()[1:]:
        line = line.strip()
        m = re.match(r"(ROOT )?%(\S+) = (\S+) (\w[\w-]*)\(", line)
        if m and m.group(4) not in ("parameter", "constant", "get-tuple-element", "bitcast", "tuple"):
            kind = re.search(r"kind=(\w+)", line)
            print(f"  {m.group(4):14s} {m.group(3):28s} {m.group(2)} {kind.group(1) if kind else ''}")
