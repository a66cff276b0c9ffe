"""The corpus as parts (a single array or shards) and the checks that describe each as a
``Problem`` before any of it is read: the queries, a shard, one scoring call of the two."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from .. import _dispatch as dispatch
from .. import _interop as interop
from .._validate import Problem, check_call, check_docs, check_scales, check_valid, offsets_count

__all__ = ["Part", "corpus_parts", "query_problem", "same_kind", "part_problem", "doc_problem", "with_queries"]



@dataclass
class Part:
    """One shard of the corpus: padded ``docs [n, L, d]`` (mask or lengths) or packed ``tokens [T, d]`` + offsets;
    int8 tokens with their float32 ``scales`` (``[n, L]`` or ``[T]``). ``index``: the shard's position in an
    iterable corpus, None for a single array D."""

    docs: object
    offsets: object = None
    mask: object = None
    lengths: object = None
    scales: object = None
    index: int | None = None

    @property
    def packed(self) -> bool:
        return self.offsets is not None

    @property
    def name(self) -> str:
        return "the corpus" if self.index is None else f"shard {self.index}"

    def arg(self, what: str = "") -> str:
        """The argument errors name: D (``what``: "offsets", "scales": d_offsets, d_scales), or shard i
        of an iterable D (shard i's offsets or scales)."""
        if self.index is None:
            return f"d_{what}" if what else "D"
        return f"shard {self.index} {what}".rstrip()


def corpus_parts(D, d_offsets, d_mask, d_lengths, d_scales) -> Iterable[Part]:
    """The corpus as parts: a list when D is one array or a list/tuple of shards, else a generator."""
    if _is_array(D):
        return [Part(D, d_offsets, d_mask, d_lengths, d_scales)]
    if d_offsets is not None or d_mask is not None or d_lengths is not None or d_scales is not None:
        raise TypeError("d_offsets, d_mask, d_lengths and d_scales go with a single array D; give each shard as "
                        "(tokens, offsets), or for INT8 as (tokens, offsets, scales) or (docs, scales)")
    if isinstance(D, (str, bytes)) or not isinstance(D, Iterable):
        raise TypeError(f"D must be an array or an iterable of shards, got {type(D).__name__}")
    shards = (_shard(i, s) for i, s in enumerate(D))
    return list(shards) if isinstance(D, (list, tuple)) else shards


def _shard(i: int, s) -> Part:
    if _is_array(s):
        return Part(s, index=i)
    if isinstance(s, tuple) and len(s) in (2, 3) and all(_is_array(x) for x in s):
        if len(s) == 3:
            return Part(s[0], s[1], scales=s[2], index=i)
        first = interop.describe(s[0])
        if dispatch.scaled_dtype(first.dtype) and len(first.shape) == 3:  # padded INT8 docs and their scales
            return Part(s[0], scales=s[1], index=i)
        return Part(s[0], s[1], index=i)
    raise TypeError(f"shard {i} must be a padded array [n, L, d], a (tokens [T, d], offsets [n + 1]) tuple, or for "
                    f"INT8 a (tokens [T, d], offsets [n + 1], scales [T]) or (docs [n, L, d], scales [n, L]) tuple; "
                    f"got {type(s).__name__}")


def _is_array(x) -> bool:
    try:
        interop.framework_of(x)
        return not isinstance(x, (list, tuple))
    except TypeError:
        return False


def query_problem(Q, q_mask, q_lengths, q_scales) -> Problem:
    """Check the queries on their own: float Q as :func:`lik_cupy.maxsim` checks it, or int8 Q with q_scales."""
    info = interop.describe_named("Q", Q)
    _check_streamed(info.dtype, "Q")
    if not dispatch.scaled_dtype(info.dtype):
        if q_scales is not None:
            raise ValueError(f"q_scales goes with an int8 Q, but Q is {info.dtype} (it is quantised on the fly)")
        return check_call(Q, Q, q_mask, None, q_lengths, None, pairs=False)
    if q_scales is None:
        raise TypeError("Q is int8 but q_scales is missing: pass its float32 per-token scales (Q's shape without the "
                        "last axis), or pass float Q, which is quantized per call")
    if len(info.shape) not in (2, 3):
        raise ValueError(f"Q must be [Nq, Lq, d] or [Lq, d]; got shape {list(info.shape)}")
    if info.shape[-1] < 1:
        raise ValueError("Q has embedding dim 0; expected at least 1")
    check_scales("q_scales", q_scales, info, tuple(info.shape[:-1]), "one per query token")
    q_valid = check_valid("q", q_mask, q_lengths, info, info.shape[:-1], info.shape[:-2])
    nq, lq = (info.shape[0], info.shape[1]) if len(info.shape) == 3 else (1, info.shape[0])
    return Problem(framework=info.framework, device=info.device, dtype=info.dtype, nq=nq, lq=lq, nd=0, ld=0,
                   dim=info.shape[-1], candidates=False, scores_shape=(nq, 0), argmax_shape=(nq, 0, lq),
                   q_valid=q_valid, d_valid=None)


def same_kind(kind: str | None, dtype: str, part: Part) -> str:
    """The corpus's kind (the scaled dtype, INT8, or the float dtype seen first) after ``part``; TypeError when
    INT8 and float mix."""
    if kind is None or dispatch.scaled_dtype(kind) == dispatch.scaled_dtype(dtype):
        return kind or dtype
    raise TypeError(f"{part.name} has dtype {dtype} but earlier shards are {kind}: a corpus is all INT8 or all float; "
                    "quantize the float shards (lik_cupy.quantize_int8, `lik pack --int8`) or score the two "
                    "kinds in separate calls")


def part_problem(qp: Problem, part: Part) -> Problem:
    """Check one shard against the queries (before any of it is read) and describe one
    scoring call of Q against the whole shard. Frameworks may differ: a host corpus
    streams to device queries."""
    info = interop.describe(part.docs)
    if not dispatch.scaled_dtype(info.dtype) and part.scales is None:
        if dispatch.scaled_dtype(qp.dtype):
            raise TypeError(f"Q is int8 but {part.name} has dtype {info.dtype}: int8 queries score INT8 corpora only; "
                            "pass float Q")
        if info.dtype != qp.dtype:
            raise TypeError(f"{part.name} has dtype {info.dtype} but Q has {qp.dtype}: cast one so both match")
    return with_queries(qp, doc_problem(part, info), part.name)


def doc_problem(part: Part, info: interop.Info) -> Problem:
    """Check one shard on its own (``info``: its tokens' description): layout, shapes, dtypes, validity
    and INT8 scales, before any of it is read. The Problem describes its documents (no queries yet:
    ``with_queries`` adds them)."""
    _check_streamed(info.dtype, part.name)
    if part.packed and (part.mask is not None or part.lengths is not None):  # (they were ignored)
        raise ValueError(f"packed documents (d_offsets) take no d_mask or d_lengths: the offsets give "
                         f"{part.name}'s lengths")
    if dispatch.scaled_dtype(info.dtype) or part.scales is not None:
        return _scaled_doc_problem(part, info)
    _check_layout(part, info)
    return check_docs(part.docs, part.offsets, part.mask, part.lengths, part.arg(), part.arg("offsets"))


def _check_layout(part: Part, info: interop.Info) -> None:
    """ValueError naming the part (D, or shard i of an iterable D) unless its tokens are packed ``[T, d]``
    (with offsets) or padded ``[Nd, Ld, d]``."""
    shape, hint = list(info.shape), ""
    if part.packed and len(shape) != 2:
        if part.index is not None and len(shape) == 3:
            hint = " (a shard tuple is (tokens [T, d], offsets [n + 1]) or for INT8 (tokens, offsets, scales) or " \
                   "(docs [n, L, d], scales); padded shards take no lengths or mask)"
        raise ValueError(f"{part.arg()}: packed corpus tokens must be [T, d]; got shape {shape}{hint}")
    if not part.packed and len(shape) != 3:
        if len(shape) == 2:
            hint = " (packed tokens [T, d] take d_offsets)" if part.index is None else \
                " (a shard of packed tokens [T, d] is a (tokens, offsets) tuple)"
        raise ValueError(f"{part.arg()}: a padded corpus must be [Nd, Ld, d]; got shape {shape}{hint}")


def _check_streamed(dtype: str, name: str) -> None:
    """TypeError for a scaled element type that the streaming engines do not take (``ElemSpec.corpus``: FP8)."""
    if dispatch.scaled_dtype(dtype) and not dispatch.elem_spec(dtype).corpus:
        spec = dispatch.elem_spec(dtype)
        raise TypeError(f"{name} has dtype {dtype}, which retrieve and Corpus do not take yet (float or int8 "
                        f"corpora): score it with its own functions (lik_cupy.maxsim_fp8 for FP8), or dequantise it "
                        f"(lik_cupy.{spec.dequantiser})")


def with_queries(qp: Problem, p: Problem, name: str = "corpus") -> Problem:
    """One scoring call of the queries ``qp`` against the documents ``p`` (``doc_problem``; ``name``:
    theirs in an error, a shard of a corpus maybe), whose dtype the caller has matched to the queries'."""
    if p.dim != qp.dim:
        raise ValueError(f"{name} has dim {p.dim} but Q has dim {qp.dim}")
    return replace(p, framework=qp.framework, device=qp.device, nq=qp.nq, lq=qp.lq, scores_shape=(qp.nq, p.nd),
                   argmax_shape=(qp.nq, p.nd, qp.lq), q_valid=qp.q_valid)


def _scaled_doc_problem(part: Part, info: interop.Info) -> Problem:
    scales_name = part.arg("scales")
    if not dispatch.scaled_dtype(info.dtype):
        raise TypeError(f"{scales_name} go with int8 tokens, but {part.name} has dtype {info.dtype}")
    if part.scales is None:
        raise TypeError(f"{part.name} is int8 but has no scales: pass d_scales (float32, D's shape without its last "
                        "axis; [T] for packed tokens), or give INT8 shards as (tokens, offsets, scales) or "
                        "(docs, scales)")
    _check_layout(part, info)
    if part.packed:
        nd, ld, ntok = offsets_count(part.arg("offsets"), part.offsets, info, part.arg()), 0, info.shape[0]
        d_valid = "offsets"
    else:
        d_valid = check_valid("d", part.mask, part.lengths, info, info.shape[:-1], info.shape[:-2], part.arg())
        nd, ld, ntok = info.shape[0], info.shape[1], 0
    if info.shape[-1] < 1:
        raise ValueError(f"{part.name} has embedding dim 0; expected at least 1")
    check_scales(scales_name, part.scales, info, tuple(info.shape[:-1]), "one per document token",
                 f"{part.name}'s tokens")
    return Problem(framework=info.framework, device=info.device, dtype=info.dtype, nq=0, lq=0, nd=nd, ld=ld,
                   dim=info.shape[-1], candidates=False, scores_shape=(0, nd), argmax_shape=(0, nd, 0), q_valid=None,
                   d_valid=d_valid, d_packed=part.packed, ntok=ntok)
