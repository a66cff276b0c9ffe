"""PyLate on lik-cupy: drop-ins for PyLate 1.6's scoring functions, and ``patch_pylate()``.

``colbert_scores``, ``colbert_scores_pairwise``, ``colbert_kd_scores`` and ``ColBERTScores`` take
PyLate's arguments and give the results of PyLate's torch path, computed by lik-cupy's kernels
(``lik_cupy.torch.maxsim``, so gradients flow through lik-cupy's backward and the
``[Nq, Nd, Lq, Ld]`` similarity tensor is never built). On CUDA tensors the CUDA kernels run, on
CPU tensors the exact NumPy path.

Masks (float, int or bool; nonzero = valid, as PyLate's ``flash`` and ``lik`` backends read them)
zero the similarities of masked tokens, as PyLate's torch path does by multiplying by them: a
masked document token is not left out, it scores 0 against every query token. So where a document
has a masked token, each query token's max over that document is ``max(true max, 0)``, and an
all-masked document scores 0 rather than -inf (lik-cupy's own ``d_mask`` leaves masked tokens out
instead: PyLate's ``flash`` and ``lik`` backends follow that convention, its torch path does not).
This module gets the torch path's scores without touching the embeddings: masked tokens are
skipped and each masked document's row maxima floored at 0 in the kernel (its zero-vector padding
flag, ``lik_cupy._maxsim_calls.maxsim_zero_pad``), the gradient of a floored max is 0 as through the
torch path's zeroed similarity. Three differences remain, all where the torch path multiplies
rather than zeroes: a mask value other than 0 and 1 scales the torch path's similarities but is
just "valid" here; a NaN or infinite similarity with a masked token (a NaN or infinite embedding of
the masked token, or of a valid query token against a document with a masked token) makes the torch
path's score NaN (``nan * 0``, ``inf * 0``), where an eager call here never scores a masked token;
and where a valid token's similarity is exactly 0 and ties the masked tokens' 0 for the max, the
gradient goes to the valid token, where PyLate's ``max`` takes whichever of them comes first (both
are gradients of the max; the scores are equal). While ``torch.compile`` traces, masked document
tokens are scored as zero vectors instead (the embeddings times their masks, which the compiled
graph fuses), so a NaN there is NaN again and a tie goes to the first token, as in PyLate.

Scores come back float32 (float64 for float64 inputs, which are scored in float32), as PyLate's
``flash`` and ``lik`` backends return them; its torch path returns the inputs' dtype.

``backend`` and ``PYLATE_SCORES_BACKEND`` are read as PyLate reads them: ``None``/``"auto"`` and
``"lik"`` score with lik-cupy, ``"torch"`` and ``"flash"`` call PyLate's own function with that
backend (PyLate must then be installed).

Importing this module imports torch, not PyLate.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import _torch_autograd as _autograd
from .. import torch as _lik
from .._base import env
from .._runtime.masks import MASKED
from ._patching import Patched, Patches, SwappedAttribute, SwappedProperty
from ._scoring import CHUNK_BYTES, kernel_operands, list_dim, padded_runs

__all__ = ["colbert_scores", "colbert_scores_pairwise", "colbert_kd_scores", "ColBERTScores", "patch_pylate",
           "unpatch_pylate"]

_BACKENDS = ("auto", "torch", "flash", "lik")
_NAMES = ("colbert_scores", "colbert_scores_pairwise", "colbert_kd_scores")
# Modules whose own copies of PyLate's scoring functions (``from ..scores import colbert_scores``)
# the patch replaces; pylate.scores.similarity_functions is reached through ColBERT.similarity.
_IMPORTERS = ("pylate.scores", "pylate.rank.rank", "pylate.losses.distillation",
              "pylate.evaluation.colbert_distillation", "pylate.evaluation.colbert_triplet")

# colbert_scores_pairwise pads the pairs of its lists a run at a time, each run's copies within this many bytes.
_CHUNK_BYTES = CHUNK_BYTES

_patches = Patches()  # its originals: PyLate's functions by name, and "ColBERTScores.__call__"


def colbert_scores(queries_embeddings, documents_embeddings, queries_mask=None, documents_mask=None, backend=None):
    """Every query against every document: ``pylate.scores.colbert_scores`` on lik-cupy.

    Args:
        queries_embeddings: ``[Nq, Lq, H]`` torch tensor, NumPy array or list of either.
        documents_embeddings: ``[Nd, Ld, H]``, same dtype (float16, bfloat16, float32 or float64)
            and device.
        queries_mask: ``[Nq, Lq]`` (bool or 0/1 numbers), or None.
        documents_mask: ``[Nd, Ld]``, or None. A masked token's similarities count as 0.
        backend: PyLate's backend name, see the module docstring.

    Returns:
        float32 ``[Nq, Nd]`` scores (float64 for float64 inputs) on the inputs' device.

    Example (the zero-scoring masked token lifts query token 1, whose true max is -1, to 0)::

        >>> import torch
        >>> from lik_cupy.integrations.pylate import colbert_scores
        >>> Q = torch.tensor([[[1., 0.], [0., 1.]]])
        >>> D = torch.tensor([[[2., -1.], [5., 5.]]])
        >>> colbert_scores(Q, D)
        tensor([[10.]])
        >>> colbert_scores(Q, D, documents_mask=torch.tensor([[1, 0]]))
        tensor([[2.]])
    """
    if _use_pylate(backend):
        return _original("colbert_scores")(queries_embeddings, documents_embeddings, queries_mask, documents_mask,
                                           backend=backend)
    Q, D = _tensor(queries_embeddings), _tensor(documents_embeddings)
    _check_ndim(Q, D, 3, "[Nd, Ld, H]")
    return _masked_maxsim(Q, D, queries_mask, documents_mask)


def colbert_kd_scores(queries_embeddings, documents_embeddings, queries_mask=None, documents_mask=None,
                      backend=None):
    """Each query against its own candidates: ``pylate.scores.colbert_kd_scores`` on lik-cupy.

    Args:
        queries_embeddings: ``[B, Lq, H]``.
        documents_embeddings: ``[B, N, Ld, H]``: query b's N candidates.
        queries_mask: ``[B, Lq]`` or None; documents_mask: ``[B, N, Ld]`` or None (masks as in
            :func:`colbert_scores`).
        backend: PyLate's backend name, see the module docstring.

    Returns:
        float32 ``[B, N]`` scores (float64 for float64 inputs).

    Example::

        >>> import torch
        >>> from lik_cupy.integrations.pylate import colbert_kd_scores
        >>> Q = torch.tensor([[[1., 0.]], [[0., 1.]]])
        >>> D = torch.tensor([[[[3., 0.]], [[1., 0.]]], [[[0., 2.]], [[0., 4.]]]])
        >>> colbert_kd_scores(Q, D)
        tensor([[3., 1.],
                [2., 4.]])
    """
    if _use_pylate(backend):
        return _original("colbert_kd_scores")(queries_embeddings, documents_embeddings, queries_mask, documents_mask,
                                              backend=backend)
    Q, D = _tensor(queries_embeddings), _tensor(documents_embeddings)
    _check_ndim(Q, D, 4, "[B, N, Ld, H]")
    return _masked_maxsim(Q, D, queries_mask, documents_mask)


def colbert_scores_pairwise(queries_embeddings, documents_embeddings, backend=None):
    """Query i against document i: ``pylate.scores.colbert_scores_pairwise`` on lik-cupy.

    Args:
        queries_embeddings: ``[B, Lq, H]``, or a list of ``[Lq_i, H]`` (lengths may differ).
        documents_embeddings: ``[B, Ld, H]``, or a list of ``[Ld_i, H]``. Every token counts
            (there are no masks); a pair of lists scores its own tokens only (the lists are
            zero-padded a run of pairs at a time, each run's copies within about 512 MiB, and the
            padding left out). As in PyLate, pairs past the shorter of the two are ignored.
        backend: PyLate's backend name, see the module docstring.

    Returns:
        float32 ``[B]`` scores (float64 for float64 inputs).

    Example::

        >>> import torch
        >>> from lik_cupy.integrations.pylate import colbert_scores_pairwise
        >>> Q = [torch.tensor([[1., 0.]]), torch.tensor([[0., 1.], [1., 1.]])]
        >>> D = [torch.tensor([[2., 0.], [1., 1.]]), torch.tensor([[0., 3.]])]
        >>> colbert_scores_pairwise(Q, D)
        tensor([2., 6.])
    """
    if _use_pylate(backend):
        return _original("colbert_scores_pairwise")(queries_embeddings, documents_embeddings, backend=backend)
    if isinstance(queries_embeddings, torch.Tensor) and isinstance(documents_embeddings, torch.Tensor):
        n = min(len(queries_embeddings), len(documents_embeddings))
        Q, D = queries_embeddings[:n], documents_embeddings[:n]
        _check_ndim(Q, D, 3, "[B, Ld, H]")
        Q, D, out = kernel_operands(Q, D)
        return _lik.maxsim(Q, D.unsqueeze(1))[:, 0].to(out)
    pairs = list(zip(queries_embeddings, documents_embeddings))
    qs = [_tensor(q) for q, _ in pairs]
    ds = [_tensor(d) for _, d in pairs]
    list_dim(qs, "queries_embeddings", "[L, H]")
    list_dim(ds, "documents_embeddings", "[L, H]")
    scores = []
    token_bytes = qs[0].shape[-1] * qs[0].element_size() if qs else 0
    for run in padded_runs(_CHUNK_BYTES, token_bytes, [len(q) for q in qs], [len(d) for d in ds]):
        Q = torch.nn.utils.rnn.pad_sequence(qs[run], batch_first=True)
        D = torch.nn.utils.rnn.pad_sequence(ds[run], batch_first=True)
        _check_ndim(Q, D, 3, "a list of [Ld, H]")
        q_len = torch.tensor([len(q) for q in qs[run]], device=Q.device)
        d_len = torch.tensor([[len(d)] for d in ds[run]], device=D.device)
        Q, D, out = kernel_operands(Q, D)
        scores.append(_lik.maxsim(Q, D.unsqueeze(1), q_lengths=q_len, d_lengths=d_len)[:, 0].to(out))
    return torch.cat(scores)


class ColBERTScores:
    """``pylate.scores.ColBERTScores`` (the contrastive losses' scorer) on lik-cupy: one kernel
    call for all N document groups, where PyLate loops over them.

    Calling it with queries ``[Qn, Lq, H]`` and stacked document groups ``[Dn, N, Ld, H]`` (masks
    ``[Qn, Lq]`` and ``[Dn, N, Ld]``) returns ``[Qn, Dn * N]``: column ``d * N + k`` scores group
    d's k-th document, PyLate's query-major order. Masks and backend as in :func:`colbert_scores`.

    Example::

        >>> import torch
        >>> from lik_cupy.integrations.pylate import ColBERTScores
        >>> Q = torch.tensor([[[1., 0.]]])
        >>> D = torch.tensor([[[[1., 0.]], [[2., 0.]]], [[[3., 0.]], [[4., 0.]]]])
        >>> ColBERTScores()(Q, D)
        tensor([[1., 2., 3., 4.]])
    """

    def __call__(self, queries_embeddings, documents_embeddings, queries_mask=None, documents_mask=None,
                 backend=None):
        if _use_pylate(backend):
            return _original("ColBERTScores.__call__")(self, queries_embeddings, documents_embeddings, queries_mask,
                                                       documents_mask, backend=backend)
        Q, D = _tensor(queries_embeddings), _tensor(documents_embeddings)
        _check_ndim(Q, D, 4, "[Dn, N, Ld, H]")
        Dn, N, Ld, H = D.shape
        if documents_mask is not None:
            documents_mask = _tensor(documents_mask)
            if documents_mask.shape != D.shape[:-1]:  # reshaped unchecked, another layout would mask other tokens
                raise ValueError(f"documents_mask has shape {list(documents_mask.shape)}; expected "
                                 f"{list(D.shape[:-1])} ([Dn, N, Ld], documents_embeddings' shape without its last axis)")
            documents_mask = documents_mask.reshape(Dn * N, Ld)
        return _masked_maxsim(Q, D.reshape(Dn * N, Ld, H), queries_mask, documents_mask)


def patch_pylate() -> Patched:
    """Route PyLate's scoring through this module until :func:`unpatch_pylate`.

    Covers ``pylate.scores``' three functions; ``ColBERTScores`` (the ``Contrastive`` and
    ``CachedContrastive`` losses' default scorer, existing instances included); the copies that
    ``rank`` (so ``rerank`` and ``retrieve``), the ``Distillation`` loss and the distillation and
    triplet evaluators took when PyLate loaded; the ``score_metric`` a ``Distillation`` loss stored;
    and the similarity functions a ``ColBERT`` model stored (``model.similarity``, which the
    information-retrieval evaluators call). Objects made before the patch are covered as well as new
    ones. A score function of your own that you passed is left alone; PyLate's three are replaced
    wherever these objects read them. ``SimilarityFunction.to_similarity_fn`` itself still returns
    PyLate's functions (a model stores what it returns, and the patch must not outlive
    :func:`unpatch_pylate` in models made meanwhile).

    Imports PyLate (and through it sentence-transformers). Patching twice is harmless. Returns a
    handle that is also a context manager::

        with patch_pylate():
            results = rank.rerank(...)   # scored by lik-cupy
    """
    return _patches.patch(_apply)


def unpatch_pylate() -> None:
    """Undo :func:`patch_pylate`: every replaced attribute gets PyLate's own back."""
    _patches.undo()


# ---------------------------------------------------------------- internals


def _apply() -> None:
    import importlib

    colbert = importlib.import_module("pylate.scores.colbert")
    ours = {name: globals()[name] for name in _NAMES}
    originals = {name: getattr(colbert, name) for name in _NAMES}
    table = {originals[name]: ours[name] for name in _NAMES}
    _patches.originals.update(originals, **{"ColBERTScores.__call__": colbert.ColBERTScores.__call__})
    _patches.set_globals("pylate.scores.colbert", originals, ours)
    _patches.set(colbert.ColBERTScores, "__call__", ColBERTScores.__call__)
    for module in _IMPORTERS:
        _patches.set_globals(module, originals, ours)
    distillation = importlib.import_module("pylate.losses.distillation").Distillation
    _patches.set(distillation, "score_metric", SwappedAttribute("score_metric", table))
    model = importlib.import_module("pylate.models.colbert").ColBERT
    for name in ("similarity", "similarity_pairwise"):
        base = getattr(model, name)  # sentence-transformers' property
        _patches.set(model, name, SwappedProperty(base, table))


def _use_pylate(backend) -> bool:
    """Whether PyLate's own backend was asked for (validated as PyLate validates it)."""
    name = backend if backend is not None else env.pylate_scores_backend()
    if not isinstance(name, str):
        raise TypeError(f"backend must be a string or None, got {type(name).__name__}")
    name = name.lower()
    if name not in _BACKENDS:
        raise ValueError(f"backend must be one of 'auto', 'torch', 'flash', 'lik'; got {name!r}")
    return name in ("torch", "flash")


def _original(name: str):
    """PyLate's own function (or ``ColBERTScores.__call__``), patched or not."""
    if name in _patches.originals:
        return _patches.originals[name]
    try:
        from pylate.scores import colbert
    except ImportError as e:
        raise ImportError(f"PyLate's own backends (backend='torch' or 'flash') need pylate installed: {e}") from e
    return colbert.ColBERTScores.__call__ if name == "ColBERTScores.__call__" else getattr(colbert, name)


def _tensor(x) -> torch.Tensor:
    """A torch tensor from a tensor, a NumPy array or a list of either (as PyLate's
    ``convert_to_tensor``: a list of arrays becomes float32)."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    if isinstance(x, (list, tuple)):
        if not x:
            return torch.tensor([], dtype=torch.float32)
        if isinstance(x[0], np.ndarray):
            return torch.from_numpy(np.array(x, dtype=np.float32))
        if isinstance(x[0], torch.Tensor):
            return torch.stack(list(x))
        return torch.tensor(x, dtype=torch.float32)
    raise TypeError(f"expected a torch tensor, a NumPy array or a list, got {type(x).__name__}")


def _check_ndim(Q, D, d_ndim: int, d_layout: str) -> None:
    if Q.ndim != 3:
        raise ValueError(f"queries_embeddings must be [Nq, Lq, H], got shape {list(Q.shape)}")
    if D.ndim != d_ndim:
        raise ValueError(f"documents_embeddings must be {d_layout}, got shape {list(D.shape)}")


def _masked_maxsim(Q, D, q_mask, d_mask):
    """MaxSim with PyLate's torch-path masks (a masked token's similarities are 0): a masked query
    token adds nothing; masked document tokens are skipped and the row maxima of a document with any
    floored at 0 (its zero-vector padding flag, ``zero_pad="masked"``: made from the mask where the
    mask is read), what their zero similarities give."""
    Q, D, out = kernel_operands(Q, D)
    qm = None if q_mask is None else _valid(q_mask, Q)
    if d_mask is None:
        return _lik.maxsim(Q, D, qm).to(out)
    dm = _valid(d_mask, D)
    if _autograd.traced(Q):  # the operators take no zero-padding flags: masked tokens as zero vectors
        return _lik.maxsim(Q, D * dm.unsqueeze(-1).to(D.dtype), qm).to(out)
    return _autograd.maxsim_zero_pad_grad(Q, D, MASKED, qm, dm).to(out)


def _valid(mask, like) -> torch.Tensor:
    """A PyLate mask as a lik-cupy one: bool on ``like``'s device, True where the mask is nonzero."""
    m = _tensor(mask).to(like.device)
    return m if m.dtype == torch.bool else m != 0
