"""``lik_cupy.jax.maxsim`` as XLA's own computation: an einsum, each query token's maximum and
their sum, which ``jax.grad`` differentiates natively (no callback). ``lik_cupy.jax`` takes it for
a differentiated call where the measured rule (``lik_cupy._dispatch.jax_paths``) says XLA is faster.

The kernels' semantics:

- a masked (or past-length) document token never wins; a masked query token adds 0, whatever
  its values;
- a document with no valid token scores -inf, a query with no valid token 0;
- a NaN in an unmasked similarity makes its score NaN (``argmax`` takes the first NaN as the
  winner);
- each query token's gradient goes to its first winning document token (the lowest index on
  ties), as through the kernels' argmax; ``jnp.max``'s own gradient would share it among equal
  maxima.

Lengths arrive clamped to ``[0, L]`` (``lik_cupy.jax`` marks the scores of bad ones NaN).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._validate import Problem

__all__ = ["maxsim"]

# (Q's rank, D's rank) -> similarities [*scores_shape, Lq, Ld]
_SUBSCRIPTS = {(3, 3): "isk,jtk->ijst", (3, 4): "isk,ijtk->ijst", (3, 2): "isk,tk->ist", (2, 3): "sk,jtk->jst",
               (2, 2): "sk,tk->st"}


def maxsim(p: Problem, Q, D, rest: dict, precision: str | None):
    """Scores ``p.scores_shape`` (float32; float64 for float64 inputs) of ``Q`` against padded ``D``
    with ``rest``'s masks or lengths (``q_mask``, ``d_mask``, ``q_lengths``, ``d_lengths``).
    ``precision``: "fp32" (float32 products in full) or "tf32" (XLA's default) for float inputs."""
    out = jnp.float64 if p.dtype == "float64" else jnp.float32
    full = precision == "fp32" or p.dtype == "float64"
    q_valid, d_valid = _valid(rest, "q", Q.shape[:-1]), _valid(rest, "d", D.shape[:-1])
    # Masked tokens zeroed first: a NaN there must not reach the gradients through the einsum's transpose.
    Q, D = (x if v is None else jnp.where(v[..., None], x, 0) for x, v in ((Q, q_valid), (D, d_valid)))
    sim = jnp.einsum(_SUBSCRIPTS[Q.ndim, D.ndim], Q, D, preferred_element_type=out,
                     precision=jax.lax.Precision.HIGHEST if full else jax.lax.Precision.DEFAULT)
    if d_valid is not None:
        sim = jnp.where(d_valid[..., None, :], sim, -jnp.inf)
    best = _first_max(sim)  # [*scores, Lq]
    if q_valid is not None:  # [..., Lq] with an axis of 1 for each document axis of the scores
        q_valid = q_valid.reshape(q_valid.shape[:-1] + (1,) * (best.ndim - q_valid.ndim) + q_valid.shape[-1:])
        best = jnp.where(q_valid, best, 0)
    return best.sum(axis=-1)


@jax.custom_vjp
def _first_max(sim):
    """``sim.max(-1)``, whose gradient goes to the first winner only (the first NaN where there is one).

    A plain max, as XLA's own einsum step takes it: one reduction forward and one backward (the
    winner's index, its comparison fused in), where an argmax and a select-sum forward took two."""
    return sim.max(axis=-1)


def _first_max_fwd(sim):
    best = sim.max(axis=-1)
    return best, (sim, best)


def _first_max_bwd(residuals, g):
    sim, best = residuals
    # Token indices as float32 (exact below 2**24): a float32 min-reduction measured 0.5-7% faster per
    # training step than an int32 one on an H200 (bench/results/archive/jax_first_winner_ab_nvidia-h200/).
    iota = jnp.arange(sim.shape[-1], dtype=jnp.float32)
    # A NaN maximum equals nothing: its winner is the first NaN. An all -inf row wins at token 0.
    won = (sim == best[..., None]) | jnp.isnan(sim)
    first = jnp.min(jnp.where(won, iota, jnp.float32(sim.shape[-1])), axis=-1)
    # `won &` changes no value (the first winner won), but with it XLA forms the gradient in one
    # fusion in the layout both transposed GEMMs read, as for jnp.max's own: a select on the index
    # alone was written in two layouts, 3-9% slower a step (the A/Bs there). A select, not a product:
    # a NaN or infinite g reaches the winner only, as through the kernels' backward.
    return (jnp.where(won & (iota == first[..., None]), g[..., None], 0).astype(sim.dtype),)


_first_max.defvjp(_first_max_fwd, _first_max_bwd)


def _valid(rest: dict, side: str, shape: tuple):
    """Bool ``shape`` (the tokens of one side), True where valid; None when all are."""
    mask = rest.get(f"{side}_mask")
    if mask is not None:
        return mask.astype(bool)
    lengths = rest.get(f"{side}_lengths")
    if lengths is None:
        return None
    return jnp.arange(shape[-1]) < lengths.reshape(shape[:-1] + (1,))
