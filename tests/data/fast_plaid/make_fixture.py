# How tests/data/fast_plaid/ was made: indexes built by fast-plaid 1.7.0.2110 itself (on the CPU, torch
# 2.11), with what its get_embeddings and its search (exact stage) returned, so that CI, which cannot
# install that torch, still checks lik_cupy.plaid against the real tool. embeddings.npy, ivf*.npy and
# plaid.lock were deleted afterwards (not read by PlaidIndex).
#   python tests/data/fast_plaid/make_fixture.py tests/data/fast_plaid
import numpy as np, torch, os, sys
from fast_plaid import search
out = sys.argv[1]
rng = np.random.default_rng(32)
torch.manual_seed(32)
for nbits in (1, 2, 4):
    docs = [torch.nn.functional.normalize(torch.randn(int(n), 128), dim=-1) for n in rng.integers(3, 40, 60)]
    path = os.path.join(out, f"fast_plaid_nbits{nbits}")
    fp = search.FastPlaid(index=path, device="cpu")
    fp.create(documents_embeddings=docs, nbits=nbits)
    ids = np.array([0, 7, 59, 31])
    emb = [e.float().numpy() for e in fp.get_embeddings(ids.tolist())]
    q = torch.nn.functional.normalize(torch.randn(3, 16, 128), dim=-1)
    res = fp.search(queries_embeddings=q, top_k=20, n_full_scores=4096)
    pids = np.array([[p for p, _ in r] + [-1] * (20 - len(r)) for r in res])
    scores = np.array([[s for _, s in r] + [np.nan] * (20 - len(r)) for r in res], np.float32)
    np.savez(os.path.join(out, f"fast_plaid_nbits{nbits}_expected.npz"), ids=ids,
             embeddings=np.concatenate(emb), lengths=np.array([len(e) for e in emb]), queries=q.numpy(),
             pids=pids, scores=scores)
