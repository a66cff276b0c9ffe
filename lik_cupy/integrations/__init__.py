"""Drop-ins for the libraries people score late-interaction embeddings with.

- :mod:`lik_cupy.integrations.pylate`: PyLate 1.6's ``colbert_scores``, ``colbert_scores_pairwise``,
  ``colbert_kd_scores`` and ``ColBERTScores`` with PyLate's signatures and the exact semantics of
  its torch path, and ``patch_pylate()`` to route PyLate's own reranking, losses and evaluators
  through them.
- :mod:`lik_cupy.integrations.colpali`: colpali-engine 0.3's ``maxsim_inbatch``, ``maxsim_kd`` and
  ``score_multi_vector``, and ``patch_colpali_engine()``.

Each submodule imports torch (they are PyTorch integrations) but not the library it serves: that is
imported only to patch it, or when a caller asks for the library's own backend by name. This package
itself imports nothing.
"""

__all__ = []
