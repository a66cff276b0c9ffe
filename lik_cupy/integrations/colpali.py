"""colpali-engine on lik-cupy: drop-ins for colpali-engine 0.3's MaxSim, and ``patch_colpali_engine()``.

``maxsim_inbatch``, ``maxsim_kd`` and ``score_multi_vector`` take colpali-engine's arguments and give
the results of its torch reference, computed by lik-cupy's kernels (``lik_cupy.torch.maxsim``:
gradients flow through lik-cupy's backward, and no ``[Bq, Bd, Lq, Ld]`` similarity tensor is built).
colpali-engine has no masks: padding tokens are zero vectors and count as tokens, so a zero token
scores 0 and lifts each query token's max over that document to at least 0. lik-cupy scores them
the same way (they are ordinary tokens to it). Gradients are the reference's, except where a max is
shared by several tokens (zero pads tie at 0): the argmax sends it to the first of them, where
torch's ``amax`` splits it between them. The sum over the tied tokens is the same, and
colpali-engine's models multiply their outputs by the attention mask, so no pad's gradient reaches
the model either way.

``maxsim_inbatch`` and ``maxsim_kd`` return float32 (float64 for float64 inputs, which are scored in
float32) on the inputs' device, as colpali-engine's ``lik`` backend does; its torch reference
returns the inputs' dtype. ``score_multi_vector`` returns float32 on the CPU, as colpali-engine's.

``COLPALI_SCORES_BACKEND`` is read per call, as colpali-engine reads it: ``auto`` (the default) and
``lik`` score with lik-cupy, ``torch`` calls colpali-engine's own function (which must then be
installed).

Importing this module imports torch, not colpali-engine.
"""

from __future__ import annotations

import operator

import numpy as np
import torch

from .. import _torch_autograd as _autograd
from .. import torch as _lik
from .._base import env
from ._patching import Patched, Patches
from ._scoring import CHUNK_BYTES, kernel_operands, list_dim, padded_runs

__all__ = ["maxsim_inbatch", "maxsim_kd", "score_multi_vector", "patch_colpali_engine", "unpatch_colpali_engine"]

_BACKENDS = ("auto", "torch", "lik")
_NAMES = ("maxsim_inbatch", "maxsim_kd")
# Modules holding their own copies (``from colpali_engine.utils.maxsim import ...``).
_IMPORTERS = ("colpali_engine.loss.late_interaction_losses", "colpali_engine.utils.processing_utils")
# score_multi_vector pads the pages scored in one call into one buffer of at most about this many
# bytes (colpali-engine's own step holds a [batch, batch, Lq, Ld] similarity tensor, which is larger),
# and a run of queries into another.
_CHUNK_BYTES = CHUNK_BYTES

_patches = Patches()  # its originals: colpali-engine's functions by name


def maxsim_inbatch(query, doc):
    """In-batch MaxSim: ``colpali_engine.utils.maxsim.maxsim_inbatch`` on lik-cupy.

    Args:
        query: ``[Bq, Lq, d]`` zero-padded query embeddings (torch tensor).
        doc: ``[Bd, Ld, d]`` zero-padded document embeddings, same dtype and device.

    Returns:
        float32 ``[Bq, Bd]`` scores (float64 for float64 inputs).

    Example (document 0's zero padding token lifts the query's second token from -1 to 0)::

        >>> import torch
        >>> from lik_cupy.integrations.colpali import maxsim_inbatch
        >>> q = torch.tensor([[[1., 0.], [0., 1.]]])
        >>> d = torch.tensor([[[2., -1.], [0., 0.]], [[2., -1.], [1., -3.]]])
        >>> maxsim_inbatch(q, d)
        tensor([[2., 1.]])
    """
    if _use_colpali():
        return _original("maxsim_inbatch")(query, doc)
    _check_ndim(query, doc, 3, "[Bd, Ld, d]")
    Q, D, out = kernel_operands(query, doc)
    return _lik.maxsim(Q, D).to(out)


def maxsim_kd(query, doc):
    """Each query against its own candidates: ``colpali_engine.utils.maxsim.maxsim_kd`` on lik-cupy.

    Args:
        query: ``[B, Lq, d]``; doc: ``[B, N, Ld, d]``, query b's N candidates (zero-padded).

    Returns:
        float32 ``[B, N]`` scores (float64 for float64 inputs).

    Example::

        >>> import torch
        >>> from lik_cupy.integrations.colpali import maxsim_kd
        >>> q = torch.tensor([[[1., 0.]], [[0., 1.]]])
        >>> d = torch.tensor([[[[3., 0.]], [[1., 0.]]], [[[0., 2.]], [[0., 4.]]]])
        >>> maxsim_kd(q, d)
        tensor([[3., 1.],
                [2., 4.]])
    """
    if _use_colpali():
        return _original("maxsim_kd")(query, doc)
    _check_ndim(query, doc, 4, "[B, N, Ld, d]")
    Q, D, out = kernel_operands(query, doc)
    return _lik.maxsim(Q, D).to(out)


def score_multi_vector(qs, ps, batch_size: int = 128, device=None):
    """Every query against every page: ``BaseVisualRetrieverProcessor.score_multi_vector`` on lik-cupy.

    Args:
        qs: query embeddings, a list of ``[Lq_i, d]`` tensors or one ``[Nq, Lq, d]`` tensor. A list
            is zero-padded a run of queries at a time (each run's copy within about 512 MiB, or one
            query), its padding left out by their lengths.
        ps: page (passage) embeddings, a list of ``[Ld_j, d]`` tensors or one ``[Np, Ld, d]`` tensor.
        batch_size: colpali-engine zero-pads pages to the longest in their batch of
            ``batch_size``, and those zero tokens count: a page shorter than the longest of its
            batch has every query token's max lifted to at least 0. The same batches decide it
            here, so the scores are colpali-engine's, but no page is padded: the pages are packed
            back to back (one copy of the lot), a short page's row maxima floored at 0 in the
            kernel (its zero-vector padding flag), and scored in as few kernel calls as memory
            allows, not batch by batch. While ``torch.compile`` traces (the operators take no
            padding flags), the short pages are zero-padded to their batch's longest instead.
            Where an embedding is NaN or infinite the scores can differ: colpali-engine also
            multiplies it by the padding's zeros (of the pages, and of the queries it pads to the
            longest of their batch), and ``inf * 0`` is NaN; no padding is read here.
        device: where to score (default: ``"cuda:0"`` when CUDA is available, else the CPU).

    Returns:
        float32 ``[Nq, Np]`` scores on the CPU.

    Example::

        >>> import torch
        >>> from lik_cupy.integrations.colpali import score_multi_vector
        >>> qs = [torch.tensor([[1., 0.], [0., 1.]])]
        >>> ps = [torch.tensor([[2., -1.]]), torch.tensor([[2., -1.], [1., 3.]])]
        >>> score_multi_vector(qs, ps, device="cpu")  # page 0 padded with a zero token
        tensor([[2., 5.]])
        >>> score_multi_vector(qs, ps, batch_size=1, device="cpu")
        tensor([[1., 5.]])
    """
    if _use_colpali():
        return _original("score_multi_vector")(qs, ps, batch_size=batch_size, device=device)
    if len(qs) == 0:
        raise ValueError("No queries provided")
    if len(ps) == 0:
        raise ValueError("No passages provided")
    try:
        batch_size = operator.index(batch_size)
    except TypeError:
        raise TypeError(f"batch_size must be an integer, got {type(batch_size).__name__}") from None
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    q_dim, p_dim = _embedding_dim(qs, "qs"), _embedding_dim(ps, "ps")
    if p_dim != q_dim:
        raise ValueError(f"ps have dim {p_dim} but qs have dim {q_dim}")
    device = device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    if isinstance(ps, torch.Tensor):
        page_len = [ps.shape[1]] * len(ps)
    else:
        page_len = [len(p) for p in ps]
    rows = []
    for run in _query_runs(qs):
        Q, q_len = _padded(run, device)
        rows.append(_score_pages(Q, q_len, ps, page_len, batch_size, device).cpu())
    return torch.cat(rows).to(torch.float32)


def patch_colpali_engine() -> Patched:
    """Route colpali-engine's MaxSim through this module until :func:`unpatch_colpali_engine`.

    Covers ``colpali_engine.utils.maxsim``'s two functions and the copies its late-interaction
    losses and processors imported, and ``score_multi_vector`` of every processor (it is defined
    once, on ``BaseVisualRetrieverProcessor``). Imports colpali-engine. Patching twice is harmless.
    Returns a handle that is also a context manager::

        with patch_colpali_engine():
            scores = processor.score_multi_vector(query_embeddings, page_embeddings)
    """
    return _patches.patch(_apply)


def unpatch_colpali_engine() -> None:
    """Undo :func:`patch_colpali_engine`: every replaced attribute gets colpali-engine's own back."""
    _patches.undo()


# ---------------------------------------------------------------- internals


def _apply() -> None:
    import importlib

    maxsim = importlib.import_module("colpali_engine.utils.maxsim")
    processor = importlib.import_module("colpali_engine.utils.processing_utils").BaseVisualRetrieverProcessor
    ours = {name: globals()[name] for name in _NAMES}
    originals = {name: getattr(maxsim, name) for name in _NAMES}
    _patches.originals.update(originals, score_multi_vector=processor.score_multi_vector)
    _patches.set_globals("colpali_engine.utils.maxsim", originals, ours)
    for module in _IMPORTERS:
        _patches.set_globals(module, originals, ours)
    _patches.set(processor, "score_multi_vector", staticmethod(score_multi_vector))


def _use_colpali() -> bool:
    """Whether ``COLPALI_SCORES_BACKEND`` asks for colpali-engine's torch reference."""
    backend = env.colpali_scores_backend().lower()
    if backend not in _BACKENDS:
        raise ValueError(f"COLPALI_SCORES_BACKEND must be one of {_BACKENDS}, got {backend!r}.")
    return backend == "torch"


def _original(name: str):
    if name in _patches.originals:
        return _patches.originals[name]
    try:
        if name == "score_multi_vector":
            from colpali_engine.utils.processing_utils import BaseVisualRetrieverProcessor

            return BaseVisualRetrieverProcessor.score_multi_vector
        from colpali_engine.utils import maxsim
    except ImportError as e:
        raise ImportError(f"COLPALI_SCORES_BACKEND=torch runs colpali-engine's own scoring, which needs "
                          f"colpali-engine installed: {e}") from e
    return getattr(maxsim, name)


def _check_ndim(query, doc, d_ndim: int, d_layout: str) -> None:
    for name, x in (("query", query), ("doc", doc)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch tensor, got {type(x).__name__}")
    if query.ndim != 3:
        raise ValueError(f"query must be [B, Lq, d], got shape {list(query.shape)}")
    if doc.ndim != d_ndim:
        raise ValueError(f"doc must be {d_layout}, got shape {list(doc.shape)}")


def _embedding_dim(xs, name: str) -> int:
    """The embedding dim of ``xs`` (``qs`` or ``ps``: a list of ``[L, d]`` tensors of one d, or one
    ``[N, L, d]`` tensor), each entry checked before any is copied."""
    if isinstance(xs, torch.Tensor):
        if xs.ndim != 3:
            raise ValueError(f"{name} must be a list of [L, d] tensors or one [N, L, d] tensor, "
                             f"got shape {list(xs.shape)}")
        return xs.shape[-1]
    return list_dim(xs, name, "a [L, d] tensor")


def _score_pages(Q, q_len, ps, page_len, batch_size: int, device):
    """``[len(Q), len(ps)]`` scores of the padded queries ``Q`` (lengths ``q_len``) against every page,
    on ``device``, with colpali-engine's batches of ``batch_size`` pages."""
    # colpali-engine pads a page to the longest of its batch: the pages shorter than that have zero vectors.
    batch_max = [max(page_len[b:b + batch_size]) for b in range(0, len(ps), batch_size)]
    short = [page_len[j] < batch_max[j // batch_size] for j in range(len(ps))]
    row_bytes = max(page_len) * Q.shape[-1] * Q.element_size()
    chunk = batch_size * max(1, _CHUNK_BYTES // max(1, batch_size * row_bytes))
    scores = []
    for c in range(0, len(ps), chunk):
        pages, lens = ps[c:c + chunk], page_len[c:c + chunk]
        if isinstance(pages, torch.Tensor) or all(n == lens[0] for n in lens):  # no padding: dense pages
            D = pages.to(device) if isinstance(pages, torch.Tensor) else torch.stack(list(pages)).to(device)
            Qk, Dk, _ = kernel_operands(Q, D)
            scores.append(_lik.maxsim(Qk, Dk, q_lengths=q_len))
            continue
        if _autograd.traced(Q):  # the operators take no padding flags: pages zero-padded to their batch's longest
            D = torch.nn.utils.rnn.pad_sequence(list(pages), batch_first=True).to(device)
            d_len = torch.tensor([batch_max[j // batch_size] for j in range(c, c + len(lens))], device=device)
            Qk, Dk, _ = kernel_operands(Q, D)
            scores.append(_lik.maxsim(Qk, Dk, q_lengths=q_len, d_lengths=d_len))
            continue
        tokens = torch.cat(list(pages)).to(device)
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lens)])).to(device)
        zero_pad = torch.tensor(short[c:c + chunk], device=device)
        Qk, Tk, _ = kernel_operands(Q, tokens)
        scores.append(_autograd.maxsim_varlen_zero_pad_grad(Qk, Tk, offsets, zero_pad, q_lengths=q_len, validate=False))
    return torch.cat(scores, dim=1)


def _query_runs(qs):
    """``qs`` as runs of consecutive queries, each run's zero-padded copy within ``_CHUNK_BYTES`` (or a
    single query); colpali-engine pads a batch of queries at a time."""
    if isinstance(qs, torch.Tensor):
        return [qs]
    return [qs[run] for run in padded_runs(_CHUNK_BYTES, qs[0].shape[-1] * qs[0].element_size(),
                                           [len(q) for q in qs])]


def _padded(xs, device):
    """``(X, lengths)``: ``xs`` (a list of ``[L_i, d]`` or one ``[N, L, d]`` tensor) zero-padded into
    ``[N, L, d]`` on ``device`` with one copy of each row (stacked when the lengths agree, else
    concatenated and scattered into place), and the rows' lengths as a device tensor, or None when
    every row is whole."""
    if isinstance(xs, torch.Tensor):
        return xs.to(device), None
    lens = np.array([len(x) for x in xs])
    width = int(lens.max())
    if (lens == width).all():
        return torch.stack(list(xs)).to(device), None
    flat = torch.cat(list(xs)).to(device)
    X = flat.new_zeros((len(lens), width, flat.shape[-1]))
    starts = np.cumsum(lens) - lens
    rows = np.arange(flat.shape[0]) + np.repeat(np.arange(len(lens)) * width - starts, lens)  # each token's padded row
    X.view(-1, X.shape[-1]).index_copy_(0, torch.from_numpy(rows).to(device), flat)
    return X, torch.from_numpy(lens).to(device)
