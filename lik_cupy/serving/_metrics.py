"""The server's Prometheus metrics (prometheus-client), fed by the batcher's :class:`Observer` hooks
and by the HTTP handlers; one registry per server."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from .batcher import Observer

_SECONDS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_QUERIES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Metrics(Observer):
    """Histograms of queue, compute and end-to-end time and of batch sizes; counters of rejects and
    responses; the queue depths, read from the batcher at each scrape (``batcher``: a callable that
    returns it, or None before it is loaded)."""

    def __init__(self, batcher):
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue = Histogram("lik_serve_queue_seconds", "Time a request waited in its device's queue",
                               ["device"], buckets=_SECONDS, registry=r)
        self.compute = Histogram("lik_serve_compute_seconds", "Time of each batched corpus call",
                                 ["device"], buckets=_SECONDS, registry=r)
        self.batch_queries = Histogram("lik_serve_batch_queries", "Queries per batched corpus call (its count is "
                                       "the calls, its sum the queries)", ["device"], buckets=_QUERIES, registry=r)
        self.batch_requests = Histogram("lik_serve_batch_requests", "Requests per batched corpus call", ["device"],
                                        buckets=_QUERIES, registry=r)
        self.request = Histogram("lik_serve_request_seconds", "End-to-end time of an inference request in the "
                                 "server, from its body read to its response", ["model"], buckets=_SECONDS, registry=r)
        self.rejected_total = Counter("lik_serve_rejected", "Requests refused: overloaded (a full queue, 503) or "
                                      "deadline (expired in the queue, 504)", ["reason"], registry=r)
        self.responses = Counter("lik_serve_responses", "Inference responses by model and HTTP status",
                                 ["model", "code"], registry=r)
        r.register(_QueueDepth(batcher))

    def batch(self, device: str, requests: int, queries: int, compute_s: float) -> None:
        self.compute.labels(device).observe(compute_s)
        self.batch_queries.labels(device).observe(queries)
        self.batch_requests.labels(device).observe(requests)

    def answered(self, device: str, queue_s: float, compute_s: float) -> None:
        self.queue.labels(device).observe(queue_s)

    def rejected(self, reason: str) -> None:
        self.rejected_total.labels(reason).inc()


class _QueueDepth:
    """``lik_serve_queue_depth{device}``: requests waiting, at scrape time."""

    def __init__(self, batcher):
        self._batcher = batcher

    def collect(self):
        g = GaugeMetricFamily("lik_serve_queue_depth", "Requests waiting in each device's queue", labels=["device"])
        b = self._batcher()
        for device, depth in ({} if b is None else b.queue_depths()).items():
            g.add_metric([device], depth)
        yield g

    def describe(self):
        return []
