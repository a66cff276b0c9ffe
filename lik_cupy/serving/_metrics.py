"""The server's measurements, fed by the batcher's :class:`Observer` hooks and by the transports:
Prometheus metrics (prometheus-client, one registry per server) and the per-model totals of Triton's
statistics extension (``/v2/models/{model}/stats``, which perf_analyzer reads)."""

from __future__ import annotations

import os
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import GaugeMetricFamily

from .batcher import OPERATIONS, Observer

_SECONDS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_QUERIES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_TOTALS = ("inference_count", "execution_count", "scored", "success_count", "success_ns", "fail_count", "fail_ns",
           "queue_ns", "compute_ns", "last_inference")


class Metrics(Observer):
    """Histograms of queue, compute and end-to-end time and of batch sizes (queries and requests per
    call); counters of rejects and responses; the queue depths, read at each scrape from
    ``batcher()`` (None before it is loaded); and the per-model totals of :meth:`statistics`."""

    def __init__(self, batcher):
        self.registry = r = CollectorRegistry()
        labels = ["device", "model"]
        self.queue = Histogram("lik_serve_queue_seconds", "Time a request waited in its device's queue", labels,
                               buckets=_SECONDS, registry=r)
        self.compute = Histogram("lik_serve_compute_seconds", "Time of each batched corpus call", labels,
                                 buckets=_SECONDS, registry=r)
        self.batch_queries = Histogram("lik_serve_batch_queries", "Queries per batched corpus call (its count is "
                                       "the calls, its sum the queries)", labels, buckets=_QUERIES, registry=r)
        self.batch_requests = Histogram("lik_serve_batch_requests", "Requests per batched corpus call", labels,
                                        buckets=_QUERIES, registry=r)
        self.request = Histogram("lik_serve_request_seconds", "End-to-end time of an inference request in the "
                                 "server, from its body read to its response", ["model"], buckets=_SECONDS, registry=r)
        self.rejected_total = Counter("lik_serve_rejected", "Requests refused or given up, by model and reason "
                                      "(docs/serving.md lists the reasons; model empty: a request that named no "
                                      "model served, or was refused before it was read)", ["model", "reason"],
                                      registry=r)
        self.responses = Counter("lik_serve_responses", "Inference responses by model and HTTP status (gRPC's "
                                 "by the HTTP status of the same outcome; 499: the client went away first; model "
                                 "empty: a request that named no model served, or was refused before it was read)",
                                 ["model", "code"], registry=r)
        self._depth = _QueueDepth(batcher)
        r.register(self._depth)
        self._totals = {op: dict.fromkeys(_TOTALS, 0) for op in OPERATIONS}
        self._lock = threading.Lock()
        # Each label set's children, looked up once: a labels() call costs a microsecond a metric and request.
        self._per_call: dict = {}
        self._per_response: dict = {}
        self._per_reject: dict = {}

    def exposition(self) -> bytes:
        """The Prometheus text. Under ``lik serve --processes`` (prometheus-client's multiprocess mode:
        ``PROMETHEUS_MULTIPROC_DIR`` set) the histograms and counters are summed over the processes;
        the queue depth is the answering process's."""
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            return generate_latest(self.registry)
        r = CollectorRegistry()
        multiprocess.MultiProcessCollector(r)
        r.register(self._depth)
        return generate_latest(r)

    def _call_children(self, device: str, op: str):
        key = (device, op)
        children = self._per_call.get(key)
        if children is None:
            children = self._per_call[key] = tuple(m.labels(device, op) for m in (
                self.compute, self.batch_queries, self.batch_requests, self.queue))
        return children

    def batch(self, device: str, op: str, requests: int, queries: int, compute_s: float) -> None:
        compute, batch_queries, batch_requests, _ = self._call_children(device, op)
        compute.observe(compute_s)
        batch_queries.observe(queries)
        batch_requests.observe(requests)
        with self._lock:
            t = self._totals[op]
            t["inference_count"] += queries
            t["execution_count"] += 1

    def answered(self, device: str, op: str, queue_s: float, compute_s: float) -> None:
        self._call_children(device, op)[3].observe(queue_s)
        with self._lock:
            t = self._totals[op]
            t["scored"] += 1
            t["queue_ns"] += int(queue_s * 1e9)
            t["compute_ns"] += int(compute_s * 1e9)

    def rejected(self, op: str, reason: str) -> None:
        child = self._per_reject.get((op, reason))
        if child is None:  # (a refused request is cheap, and a server under load refuses many)
            child = self._per_reject[op, reason] = self.rejected_total.labels(op, reason)
        child.inc()

    def refused_unread(self, status: int, reason: str) -> None:
        """A request answered ``status`` for ``reason`` before the server had read it (its headers
        came too slowly or too large, or it came over the server-wide caps), whatever it asked:
        counted rejected and responded under no model, untimed."""
        self.rejected("", reason)
        self.responses.labels("", str(status)).inc()

    def responded(self, op: str, status: int, seconds: float) -> None:
        """A transport answered an inference request of model ``op`` with HTTP's ``status`` (or gave it
        up); ``op`` "" for a request that named no model (a gRPC call whose message had not arrived),
        which Triton's per-model statistics leave out."""
        key = (op, status)
        children = self._per_response.get(key)
        if children is None:
            children = self._per_response[key] = (self.request.labels(op), self.responses.labels(op, str(status)))
        children[0].observe(seconds)
        children[1].inc()
        if op not in self._totals:
            return
        with self._lock:
            t = self._totals[op]
            kind = "success" if status == 200 else "fail"
            t[f"{kind}_count"] += 1
            t[f"{kind}_ns"] += int(seconds * 1e9)
            t["last_inference"] = int(time.time() * 1e3)

    def statistics(self, op: str) -> dict:
        """Model ``op``'s entry of Triton's statistics extension. Queue and compute times are each
        request's; a request's compute time is its whole batched call's."""
        with self._lock:
            t = dict(self._totals[op])
        def duration(count, ns):
            return {"count": count, "ns": ns}

        return {"name": op, "version": "1", "last_inference": t["last_inference"],
                "inference_count": t["inference_count"], "execution_count": t["execution_count"],
                "inference_stats": {"success": duration(t["success_count"], t["success_ns"]),
                                    "fail": duration(t["fail_count"], t["fail_ns"]),
                                    "queue": duration(t["scored"], t["queue_ns"]),
                                    "compute_input": duration(t["scored"], 0),
                                    "compute_infer": duration(t["scored"], t["compute_ns"]),
                                    "compute_output": duration(t["scored"], 0),
                                    "cache_hit": duration(0, 0), "cache_miss": duration(0, 0)},
                "batch_stats": [], "memory_usage": []}


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
