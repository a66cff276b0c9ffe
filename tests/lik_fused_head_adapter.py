"""A pytest plugin that runs late-interaction-kernels' own fused-head tests (test_fused_head.py,
test_fused_head_train.py) against lik_cupy: ``late_interaction_kernels.maxsim_from_hidden`` (and
``late_interaction_kernels.fused_head.maxsim_from_hidden``) become a thin adapter over
``lik_cupy.torch.maxsim_from_hidden``. Loaded by tests/test_fused_head_gpu.py with ``-p``.

Where the semantics differ the adapter translates: LIK's ``b=`` is our ``bias``, a 1-D ``d_mask``
is one document's, and LIK scores a document with no valid token 0 where lik_cupy scores it
``-inf``, so such scores become 0 (with no gradient, as in LIK). LIK's ``rel`` fixture (the largest
error relative to the largest reference entry) is given here for the revisions of its suite whose
conftest lacks it."""

from __future__ import annotations

import pytest
import torch


def maxsim_from_hidden(Q, H_d, W, b=None, d_mask=None, normalize=True):
    import lik_cupy.torch as lt

    if d_mask is not None and d_mask.dim() == 1:
        d_mask = d_mask.unsqueeze(0)
    scores = lt.maxsim_from_hidden(Q, H_d, W, b, d_mask=None if d_mask is None else d_mask.bool(),
                                   normalize=normalize)
    return scores.masked_fill(torch.isneginf(scores), 0.0)


def pytest_configure(config):
    import late_interaction_kernels
    import late_interaction_kernels.fused_head

    late_interaction_kernels.maxsim_from_hidden = maxsim_from_hidden
    late_interaction_kernels.fused_head.maxsim_from_hidden = maxsim_from_hidden
    config.addinivalue_line("markers", "cuda: needs a CUDA device")


@pytest.fixture
def rel():
    def rel(out, ref):
        return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()

    return rel
