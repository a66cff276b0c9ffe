"""JAX gradients for MaxSim: ``lik_cupy.jax.maxsim`` (a ``jax.custom_vjp``).

Importing this module imports jax. Eager use only: the kernels run through CuPy on
concrete device arrays, so inside ``jax.jit`` (or ``grad`` of a jitted function,
``vmap``, ``scan``) the inputs are tracers and the call raises a TypeError saying so.
Take the gradient eagerly (``jax.grad`` / ``jax.value_and_grad`` of a Python function
that is not jitted) and jit the rest of the model around it.
"""

from __future__ import annotations

import jax

from .backward import maxsim_backward
from .forward import maxsim as _maxsim

__all__ = ["maxsim"]


def maxsim(Q, D, q_mask=None, d_mask=None, *, q_lengths=None, d_lengths=None, method="auto", precision=None):
    """``lik_cupy.maxsim`` on JAX arrays, differentiable in Q and D (eagerly).

    Arguments and semantics as :func:`lik_cupy.maxsim`; masks and lengths take no
    gradient; ``method`` is the backward's dD method (see :func:`lik_cupy.maxsim_backward`);
    ``precision`` as in :func:`lik_cupy.maxsim` (None follows ``jax_default_matmul_precision``).
    Returns float32 scores (float64 for float64 arrays).
    """
    def forward(q, d):
        # jax.grad hands the custom_vjp concrete primals; jit, vmap and scan hand tracers.
        for name, x in (("Q", q), ("D", d)):
            if isinstance(x, jax.core.Tracer):
                raise TypeError(f"lik_cupy.jax.maxsim got a traced {name} (inside jax.jit, vmap or scan): it runs "
                                "eagerly on concrete arrays only; call it outside the jitted function")
        return _maxsim(q, d, q_mask, d_mask, q_lengths=q_lengths, d_lengths=d_lengths, return_argmax=True,
                       precision=precision)

    @jax.custom_vjp
    def f(q, d):
        return forward(q, d)[0]

    def f_fwd(q, d):
        scores, amax = forward(q, d)
        return scores, (q, d, amax)

    def f_bwd(res, g):
        q, d, amax = res
        return maxsim_backward(g, q, d, amax, method=method, validate=False)

    f.defvjp(f_fwd, f_bwd)
    return f(Q, D)
