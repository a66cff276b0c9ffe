"""The float64 reference the suites measure errors and rankings against."""

from __future__ import annotations


def exact_scores(torch, q, d, chunk=None):
    """float64 MaxSim [Nq, B] of q [Nq, Lq, dim] and d [B, Ld, dim] (torch CUDA tensors), chunked over
    documents: ``chunk`` at a time, by default as many as keep a chunk's similarities within 1 GiB."""
    q64 = q.double()
    if chunk is None:
        chunk = max(1, (1 << 30) // max(1, q.shape[0] * q.shape[1] * d.shape[1] * 8))
    out = []
    for j in range(0, d.shape[0], chunk):
        sim = torch.einsum("isk,jtk->ijst", q64, d[j:j + chunk].double())
        out.append(sim.amax(dim=3).sum(dim=2))
    return torch.cat(out, dim=1)
