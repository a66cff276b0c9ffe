"""A server (:func:`lik_cupy.serving.http.run`) over a host corpus whose batched calls sleep, for the
tests of deadlines that pass while a batch runs: ``python tests/slow_served.py SECONDS [--max-batch N]
[--max-delay-us US] [--grpc-port P] [--max-body-bytes N] [--header-timeout S] [--body-timeout S]
[--body-min-rate N] [--grpc-max-streams N] --port P`` (the last five as ``make_app`` takes them: a
small body limit makes a small budget). Each call of the batcher prints ``slow_served: score of N
queries`` to stderr as it starts (``tests/served.py``'s ``Server`` keeps the lines), then sleeps
SECONDS. :func:`documents` gives its documents, for comparing answers."""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import lik_cupy

DIM = 16


def documents() -> tuple[np.ndarray, np.ndarray]:
    """(tokens, d_offsets) of the served corpus: 60 documents of 1 to 11 tokens."""
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 12, 60)
    return rng.standard_normal((int(lengths.sum()), DIM)).astype(np.float32), np.concatenate([[0], np.cumsum(lengths)])


class Slow(lik_cupy.Corpus):
    seconds = 0.0

    def score(self, Q, *args, **kwargs):
        offsets = kwargs.get("q_offsets")
        if offsets is not None:  # (the batcher's calls)
            print(f"slow_served: score of {len(offsets) - 1} queries", file=sys.stderr, flush=True)
            time.sleep(self.seconds)
        return super().score(Q, *args, **kwargs)


def main() -> None:
    from lik_cupy.serving import Batcher
    from lik_cupy.serving._service import BODY_MIN_RATE, BODY_TIMEOUT_S, GRPC_MAX_STREAMS, HEADER_TIMEOUT_S, MAX_BODY
    from lik_cupy.serving.http import make_app, run

    p = argparse.ArgumentParser()
    p.add_argument("seconds", type=float)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--max-delay-us", type=int, default=0)
    p.add_argument("--grpc-port", type=int)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY)
    p.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT_S)
    p.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S)
    p.add_argument("--body-min-rate", type=int, default=BODY_MIN_RATE)
    p.add_argument("--grpc-max-streams", type=int, default=GRPC_MAX_STREAMS)
    a = p.parse_args()
    Slow.seconds = a.seconds
    tokens, offsets = documents()
    corpus = Slow(tokens, d_offsets=offsets, device="cpu")
    load = lambda observer: Batcher(corpus, max_batch=a.max_batch, max_delay_us=a.max_delay_us,  # noqa: E731
                                    observer=observer)
    run(make_app(load, grpc_address=None if a.grpc_port is None else f"127.0.0.1:{a.grpc_port}",
                 max_body_bytes=a.max_body_bytes, header_timeout=a.header_timeout, body_timeout=a.body_timeout,
                 body_min_rate=a.body_min_rate, grpc_max_streams=a.grpc_max_streams), port=a.port)


if __name__ == "__main__":
    main()
