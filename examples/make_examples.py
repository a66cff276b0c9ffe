"""Write the bundled example corpus: queries.npy and two shards, byte for byte reproducible.

    python examples/make_examples.py            # rewrites examples/queries.npy, shard0/, shard1/
    python examples/make_examples.py --out DIR  # somewhere else (the tests compare the bytes)

Random L2-normalised float16 embeddings, d = 64: 4 queries of 12 tokens (all valid, as
ColBERT pads queries with [MASK] tokens) and 80 documents of 6..24 tokens in two shards
(48 + 32, ids "doc-000".."doc-079"). Each query has one planted document holding noisy
copies of its tokens, which MaxSim ranks first: ``PLANTED`` below.

Only elementwise NumPy operations and a fixed PCG64 stream are used (no BLAS), so
every machine writes the same bytes.
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

from lik_cupy import shards

SEED = 20241122
DIM = 64
QUERY_TOKENS = 12
NUM_QUERIES = 4
SHARD_DOCS = (48, 32)
DOC_TOKENS = (6, 24)  # inclusive range of tokens per document
PLANTED = ("doc-007", "doc-030", "doc-055", "doc-071")  # query i's planted document
NOISE = 0.35
MODEL = "random example embeddings (examples/make_examples.py)"


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).sum(axis=-1, keepdims=True))


def generate(out: pathlib.Path) -> None:
    """Write queries.npy, shard0/ and shard1/ into ``out`` (existing example shards are replaced)."""
    rng = np.random.default_rng(SEED)
    queries = _unit(rng.standard_normal((NUM_QUERIES, QUERY_TOKENS, DIM)))
    n_docs = sum(SHARD_DOCS)
    lengths = rng.integers(DOC_TOKENS[0], DOC_TOKENS[1] + 1, size=n_docs)
    docs = [_unit(rng.standard_normal((int(n), DIM))) for n in lengths]
    ids = np.array([f"doc-{j:03d}" for j in range(n_docs)])
    for q, doc_id in enumerate(PLANTED):
        j = int(np.flatnonzero(ids == doc_id)[0])
        rows = rng.choice(int(lengths[j]), size=min(QUERY_TOKENS, int(lengths[j])), replace=False)
        noise = rng.standard_normal((rows.size, DIM))
        docs[j][rows] = _unit(queries[q, : rows.size] + NOISE * noise)

    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "queries.npy", queries.astype(np.float16))
    first = 0
    for s, n in enumerate(SHARD_DOCS):
        part = docs[first : first + n]
        offsets = np.concatenate([[0], np.cumsum([len(d) for d in part])])
        shards.write_shard(out / f"shard{s}", np.concatenate(part).astype(np.float16), offsets,
                           ids=ids[first : first + n], model=MODEL, overwrite=True)
        first += n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).resolve().parent,
                        help="directory to write into (default: this script's directory)")
    generate(parser.parse_args().out)


if __name__ == "__main__":
    main()
