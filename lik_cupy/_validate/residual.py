"""Argument checks of the PLAID residual functions (``lik_cupy.plaid``): shapes, dtypes, frameworks
and devices, read without touching the data, each error naming the argument and what was expected."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._interop import Info
from .arguments import Problem, _info, _lengths_info, _same_place, check_valid, offsets_count

_INT = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32")
NBITS = (1, 2, 4)


@dataclass(frozen=True, kw_only=True)
class ResidualProblem:
    """A validated residual call: the scoring problem (``p``: Q [nq, lq, dim]; ``p.dtype`` is the
    tile dtype the GPU decompresses into, float16 or bfloat16) and what the documents are."""

    p: Problem
    q_dtype: str  # Q's own dtype
    nbits: int
    n_centroids: int
    rbytes: int  # residual bytes per token: dim * nbits / 8
    n_docs: int  # packed: documents the offsets describe (candidate ids index them)
    cand: bool  # packed documents picked per query by candidate ids


def check_residual(Q, codes, residuals, lengths_or_offsets, centroids, bucket_weights, nbits, q_mask, q_lengths, *,
                   packed: bool, candidates=None) -> ResidualProblem:
    """``packed``: codes [T], residuals [T, R] and offsets [N + 1] (``candidates`` [Nq, K] or [K]
    optional); else codes [Nd, Ld] or [Nq, K, Ld] with residuals [..., R] and lengths of
    ``codes.shape[:-1]`` (or None)."""
    q = _check_queries(Q)
    dim = q.shape[-1]
    cen, rbytes = _check_codec(q, "Q", centroids, bucket_weights, nbits, dim)
    c = _check_tokens(q, "Q", codes, residuals, rbytes)
    nq, lq = (q.shape[0], q.shape[1]) if len(q.shape) == 3 else (1, q.shape[0])
    q_valid = check_valid("q", q_mask, q_lengths, q, q.shape[:-1], q.shape[:-2])
    if packed:
        if len(c.shape) != 1:
            raise ValueError(f"codes must be packed [T] (one per document token); got shape {list(c.shape)}")
        n_docs = offsets_count("d_offsets", lengths_or_offsets, q)
        return _packed_problem(q, q_valid, candidates, "candidates", nbits=nbits, n_centroids=cen.shape[0],
                               rbytes=rbytes, ntok=c.shape[0], n_docs=n_docs)
    if len(c.shape) not in (2, 3):
        raise ValueError(f"codes must be [Nd, Ld] or [Nq, K, Ld] (per-query candidates); got shape {list(c.shape)}")
    sets = len(c.shape) == 3
    if sets:
        if len(q.shape) != 3:
            raise ValueError(f"codes [Nq, K, Ld] (per-query candidates) needs Q [Nq, Lq, d]; got Q shape {list(q.shape)}")
        if c.shape[0] != nq:
            raise ValueError(f"codes has candidate sets for {c.shape[0]} queries but Q has {nq} queries")
    d_valid = check_valid("d", None, lengths_or_offsets, q, (), c.shape[:-1])
    nd, ld = c.shape[-2], c.shape[-1]
    scores_shape = tuple(q.shape[:-2]) + (nd,)
    p = Problem(framework=q.framework, device=q.device, dtype=_tile(q.dtype), nq=nq, lq=lq, nd=nd, ld=ld, dim=dim,
                candidates=sets, scores_shape=scores_shape, argmax_shape=scores_shape + (lq,), q_valid=q_valid,
                d_valid=d_valid)
    return ResidualProblem(p=p, q_dtype=q.dtype, nbits=nbits, n_centroids=cen.shape[0], rbytes=rbytes, n_docs=nd,
                           cand=False)


def check_index_rerank(Q, candidate_ids, q_mask, q_lengths, *, dim: int, nbits: int, n_centroids: int, ntok: int,
                       n_docs: int) -> ResidualProblem:
    """``PlaidIndex.rerank``'s arguments, before any of them is converted or copied: Q (of the index's
    ``dim``), its mask or lengths and ``candidate_ids`` (int32 or int64 ``[Nq, K]``, ``[K]`` for a
    2-D Q) in Q's framework and place (lists go with any). The index's own arrays were checked
    when it was read: ``nbits``, ``n_centroids``, ``ntok`` tokens and ``n_docs`` documents."""
    q = _check_queries(Q)
    if q.shape[-1] != dim:
        raise ValueError(f"Q has dim {q.shape[-1]} but the index has dim {dim}")
    q_valid = check_valid("q", q_mask, q_lengths, q, q.shape[:-1], q.shape[:-2])
    return _packed_problem(q, q_valid, candidate_ids, "candidate_ids", nbits=nbits, n_centroids=n_centroids,
                           rbytes=dim * nbits // 8, ntok=ntok, n_docs=n_docs)


def _check_queries(Q) -> Info:
    q = _info("Q", Q)
    if q.dtype not in ("float16", "bfloat16", "float32"):
        raise TypeError(f"Q has dtype {q.dtype}; expected float16, bfloat16 or float32")
    if len(q.shape) not in (2, 3):
        raise ValueError(f"Q must be [Nq, Lq, d] or [Lq, d]; got shape {list(q.shape)}")
    return q


def _packed_problem(q: Info, q_valid, candidates, name: str, *, nbits: int, n_centroids: int, rbytes: int, ntok: int,
                    n_docs: int) -> ResidualProblem:
    """The problem of queries ``q`` against ``n_docs`` packed documents of ``ntok`` tokens: all of them, or
    each query's ``candidates`` (argument ``name``: int32 or int64 ``[Nq, K]``, ``[K]`` for a 2-D Q)."""
    nq, lq = (q.shape[0], q.shape[1]) if len(q.shape) == 3 else (1, q.shape[0])
    nd, cand = n_docs, candidates is not None
    if cand:
        k = _lengths_info(name, candidates, q)
        _same_place(name, k, q)
        if k.dtype not in ("int32", "int64"):
            raise TypeError(f"{name} must be int32 or int64 document ids, got dtype {k.dtype}")
        want = 2 if len(q.shape) == 3 else 1
        if len(k.shape) != want or (want == 2 and k.shape[0] != nq):
            raise ValueError(f"{name} has shape {list(k.shape)}; expected "
                             f"{'[Nq, K] with Nq = ' + str(nq) if want == 2 else '[K] (Q is one query)'}")
        nd = k.shape[-1]
    scores_shape = tuple(q.shape[:-2]) + (nd,)
    p = Problem(framework=q.framework, device=q.device, dtype=_tile(q.dtype), nq=nq, lq=lq, nd=nd, ld=0,
                dim=q.shape[-1], candidates=cand, scores_shape=scores_shape, argmax_shape=scores_shape + (lq,),
                q_valid=q_valid, d_valid="offsets", d_packed=True, ntok=ntok)
    return ResidualProblem(p=p, q_dtype=q.dtype, nbits=nbits, n_centroids=n_centroids, rbytes=rbytes, n_docs=n_docs,
                           cand=cand)


def check_decompress(codes, residuals, centroids, bucket_weights, nbits) -> None:
    """Arguments of ``decompress_residuals``: tokens of any shape, in the framework and place of ``codes``."""
    c = _info("codes", codes)
    _, rbytes = _check_codec(c, "codes", centroids, bucket_weights, nbits, None)
    _check_tokens(c, "codes", codes, residuals, rbytes)


def _check_codec(ref: Info, ref_name: str, centroids, bucket_weights, nbits, dim: int | None):
    """centroids [C, d] and bucket_weights [2**nbits] beside ``ref``; returns centroids' Info and the
    residual bytes a token."""
    if isinstance(nbits, (bool, np.bool_)) or not isinstance(nbits, (int, np.integer)):
        raise TypeError(f"nbits must be an integer (1, 2 or 4), got {nbits!r}")
    if nbits not in NBITS:
        raise ValueError(f"nbits must be 1, 2 or 4, got {nbits!r}")
    cen = _info("centroids", centroids)
    _same_place("centroids", cen, ref, ref_name)
    if cen.dtype not in ("float16", "float32"):
        raise TypeError(f"centroids has dtype {cen.dtype}; expected float16 (as PLAID indexes store them) or float32")
    if len(cen.shape) != 2 or cen.shape[0] < 1:
        raise ValueError(f"centroids must be [n_centroids, d] with at least one centroid; got shape {list(cen.shape)}")
    if dim is not None and cen.shape[1] != dim:
        raise ValueError(f"centroids have dim {cen.shape[1]} but Q has dim {dim}")
    dim = cen.shape[1]
    if dim < 1 or dim * nbits % 8:
        raise ValueError(f"dim {dim} with nbits {nbits} does not pack into whole bytes (dim * nbits must be a "
                         f"multiple of 8)")
    bw = _info("bucket_weights", bucket_weights)
    _same_place("bucket_weights", bw, ref, ref_name)
    if bw.dtype not in ("float16", "float32"):
        raise TypeError(f"bucket_weights has dtype {bw.dtype}; expected float16 or float32")
    if tuple(bw.shape) != (1 << nbits,):
        raise ValueError(f"bucket_weights has shape {list(bw.shape)}; expected [{1 << nbits}] (2**nbits values)")
    return cen, dim * nbits // 8


def _check_tokens(ref: Info, ref_name: str, codes, residuals, rbytes: int) -> Info:
    """Integer codes and uint8 residuals of codes' shape plus ``rbytes``; returns codes' Info."""
    c = _info("codes", codes)
    _same_place("codes", c, ref, ref_name)
    if c.dtype not in _INT:
        raise TypeError(f"codes has dtype {c.dtype}; expected an integer dtype (int32 or int64 centroid ids)")
    r = _info("residuals", residuals)
    _same_place("residuals", r, ref, ref_name)
    if r.dtype != "uint8":
        raise TypeError(f"residuals has dtype {r.dtype}; expected uint8 (packed residual bits)")
    if len(r.shape) != len(c.shape) + 1 or tuple(r.shape[:-1]) != tuple(c.shape):
        raise ValueError(f"residuals has shape {list(r.shape)}; expected codes' shape {list(c.shape)} plus the "
                         f"packed bytes ({rbytes})")
    if r.shape[-1] != rbytes:
        raise ValueError(f"residuals rows hold {r.shape[-1]} bytes; expected {rbytes} (dim x nbits / 8)")
    return c


def _tile(q_dtype: str) -> str:
    """The tile dtype the GPU decompresses documents into: bfloat16 for bfloat16 queries, else float16."""
    return "bfloat16" if q_dtype == "bfloat16" else "float16"


def check_id_values(name: str, lo: int, hi: int, n: int, what: str) -> None:
    """Ids must lie in [0, n): ``lo``/``hi`` are the smallest and largest given."""
    if lo < 0 or hi >= n:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name} holds {bad}; every entry must be in [0, {n - 1}] ({what})")
