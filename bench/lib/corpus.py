"""Random corpora on disk for the suites that time whole programs (``lik score``, Dask): L2-unit
float16 tokens written as lik shards, regenerated only when the spec changes, then read once so
the timed runs find them in the page cache."""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
import time
from collections.abc import Callable

import numpy as np

GEN_TOKENS = 1 << 20  # tokens generated per block (bounds the float32 scratch memory)


def generate(data: pathlib.Path, spec: dict, n_queries: int, shard_lengths: Callable, model: str) -> float:
    """Write ``queries.npy`` [n_queries, spec["lq"], spec["dim"]] and ``shard0..`` (``spec["shards"]``
    of them, document lengths ``shard_lengths(rng, s)``) into ``data`` unless the same spec is there;
    returns the seconds spent."""
    from lik_cupy import shards

    marker = data / "corpus.json"
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return 0.0
    t0 = time.perf_counter()
    data.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(spec["seed"])

    def unit_fp16(shape):
        x = rng.standard_normal(shape, dtype=np.float32)
        x /= np.sqrt(np.einsum("...d,...d->...", x, x))[..., None]
        return x.astype(np.float16)

    np.save(data / "queries.npy", unit_fp16((n_queries, spec["lq"], spec["dim"])))
    for s in range(spec["shards"]):
        offsets = np.concatenate([[0], np.cumsum(shard_lengths(rng, s))]).astype(np.int64)
        with tempfile.TemporaryDirectory(dir=data) as scratch:  # tokens built in a mapped file, then packed
            tokens = np.lib.format.open_memmap(os.path.join(scratch, "t.npy"), mode="w+", dtype=np.float16,
                                               shape=(int(offsets[-1]), spec["dim"]))
            for a in range(0, tokens.shape[0], GEN_TOKENS):
                b = min(tokens.shape[0], a + GEN_TOKENS)
                tokens[a:b] = unit_fp16((b - a, spec["dim"]))
            tokens.flush()
            shards.write_shard(data / f"shard{s}", tokens, offsets, model=model, overwrite=True)
            del tokens
    marker.write_text(json.dumps(spec) + "\n")
    return time.perf_counter() - t0


def warm_page_cache(data: pathlib.Path) -> tuple[float, int]:
    """Read every file of the corpus once; returns (seconds, bytes)."""
    t0, total = time.perf_counter(), 0
    for f in sorted(data.rglob("*.npy")):
        with open(f, "rb") as fh:
            while chunk := fh.read(64 << 20):
                total += len(chunk)
    return time.perf_counter() - t0, total
