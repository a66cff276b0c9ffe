"""Malformed and adversarial requests against a real ``lik serve`` (CPU path, loopback, port 0, a small
shard it packs itself): valid requests of each model (search, rerank, score) as JSON, as the binary
tensor extension (Inference-Header-Content-Length), gzip / deflate encoded, and over gRPC (when the
[serve-grpc] extra is installed), then mutated: the header's JSON (types, shapes with zeros, negatives
and huge values, datatypes, names, duplicated and missing inputs, parameters of wrong types,
binary_data_size off by some, deep nesting), binary payload lengths, header-length values,
compression bombs, ids out of range or of the wrong type, k, timeouts, methods and paths.

Every answer must be a status the protocol allows (200, 400, 404, 405, 413, 503, 504; the gRPC codes
of those) within the client's timeout, every refusal JSON with an ``error``; a request whose mutation
keeps its meaning must get the in-process Corpus call's answer bitwise. Every ~50 requests a valid
request of each model is checked against the Corpus and ``/v2/health/ready`` must be 200; bursts of
valid and invalid requests go concurrently. The server's RSS is sampled throughout, and its stderr is
searched for tracebacks. Findings go to stdout as JSON lines; a summary last (exit 1 with findings).

    python3 bench/tools/serve_fuzz.py --seed 1 --seconds 300 [--ids int|string|none] [--no-grpc]
"""
from __future__ import annotations

import argparse
import gzip
import http.client
import importlib
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import numpy as np  # noqa: E402

import lik_cupy  # noqa: E402
from lik_cupy import shards  # noqa: E402
from served import Server  # noqa: E402

DIM, NDOCS = 16, 80
HTTP_OK = {200, 400, 404, 405, 413, 503, 504}
TIMEOUT_S = 30.0
MAX_BODY = 64 << 20


class Fuzz:
    def __init__(self, seed: int, ids: str):
        self.rng = random.Random(seed)
        self.nrng = np.random.default_rng(seed)
        self.findings, self.counts, self.accepted = [], {}, {}
        self.ids_kind = ids
        self.lock = threading.Lock()

    # ------------------------------------------------------------ the server

    def start(self, grpc_on: bool):
        rng = np.random.default_rng(0)
        docs = [rng.standard_normal((int(n), DIM)).astype(np.float32) for n in rng.integers(1, 20, NDOCS)]
        self.tmp = tempfile.TemporaryDirectory(prefix="servefuzz")
        path = Path(self.tmp.name) / "shard0"
        ids = {"int": np.arange(NDOCS) * 3 + 5, "string": np.array([f"doc-{i}" for i in range(NDOCS)]),
               "none": None}[self.ids_kind]
        shards.pack_arrays(docs, path, ids=ids)
        self.ext_ids = np.arange(NDOCS) if ids is None else ids
        self.local = lik_cupy.Corpus.from_shards(path, device="cpu")
        # (the serving tests' launcher: --port 0, the child's PYTHONPATH, ready once /v2/health/ready is 200)
        self.server = Server(path, "--devices", "cpu,cpu", "--max-batch", "8", "--max-delay-us", "2000",
                             "--max-queue", "64", *(["--grpc-port", "0"] if grpc_on else []))
        self.proc, self.lines = self.server.proc, self.server.lines
        self.port, self.grpc_port = self.server.port, self.server.grpc_port
        if grpc_on:
            import grpc
            from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc as rpc

            self.grpc, self.pb = grpc, pb
            self.channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}",
                                                 options=[("grpc.max_send_message_length", -1),
                                                          ("grpc.max_receive_message_length", -1)])
            self.stub = rpc.GRPCInferenceServiceStub(self.channel)

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.find("hang", "SIGTERM did not stop the server in 120 s")
            self.proc.kill()
        return "".join(self.lines)

    def rss_mb(self) -> float:
        try:
            for line in open(f"/proc/{self.proc.pid}/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return float("nan")

    def http(self, method, path, body=None, headers=None, timeout=TIMEOUT_S):
        return self.server.request(method, path, body, headers, timeout)

    # ------------------------------------------------------------ findings

    def find(self, kind: str, what: str, request=None):
        with self.lock:
            f = {"kind": kind, "what": what[:2000]}
            if request is not None:
                f["request"] = repr(request)[:3000]
            self.findings.append(f)
        print(json.dumps(f), flush=True)

    def count(self, key):
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1

    # ------------------------------------------------------------ valid requests and their answers

    def valid(self, model: str):
        """(JSON-able header, {name: array}, expected outputs {name: array})."""
        r = self.nrng
        nq = int(r.integers(1, 4))
        lq = int(r.integers(1, 40))
        three = bool(r.integers(0, 2))
        Q = r.standard_normal((nq, lq, DIM) if three else (lq, DIM)).astype(np.float32)
        arrays = {"Q": Q}
        if model == "search":
            k = int(r.choice([1, 3, 10, NDOCS, NDOCS + 5, 4096]))
            arrays["K"] = np.array([k], np.int32 if r.integers(0, 2) else np.int64)
            s, i = self.local.search(Q, k)
            expected = {"SCORES": s, "IDS": i}
        elif model == "rerank":
            K = int(r.integers(0, 12))
            pos = r.integers(0, NDOCS, (nq, K) if three else (K,))
            arrays["IDS"] = self.ext_ids[pos]
            expected = {"SCORES": self.local.rerank(Q, pos)}
        else:
            expected = {"SCORES": self.local.score(Q)}
        return arrays, expected

    @staticmethod
    def datatype(a: np.ndarray) -> str:
        if a.dtype.kind in "US":
            return "BYTES"
        return {"float32": "FP32", "int32": "INT32", "int64": "INT64"}[str(a.dtype)]

    def encode(self, arrays: dict, binary: bool, header_extra=None):
        """(header dict, list of binary chunks or None)."""
        inputs, chunks = [], []
        for name, a in arrays.items():
            t = {"name": name, "shape": list(a.shape), "datatype": self.datatype(a)}
            if binary:
                raw = (b"".join(struct.pack("<I", len(x.encode())) + x.encode() for x in a.reshape(-1).tolist())
                       if a.dtype.kind in "US" else a.tobytes())
                t["parameters"] = {"binary_data_size": len(raw)}
                chunks.append(raw)
            else:
                t["data"] = a.reshape(-1).tolist()
            inputs.append(t)
        header = {"inputs": inputs, **(header_extra or {})}
        return header, (chunks if binary else None)

    @staticmethod
    def body(header, chunks, raw_header: bytes | None = None):
        text = raw_header if raw_header is not None else json.dumps(header).encode()
        if chunks is None:
            return text, {}
        return text + b"".join(chunks), {"Inference-Header-Content-Length": str(len(text))}

    def check_outputs(self, body: bytes, headers: dict, expected: dict, names=None):
        """Whether a 200's outputs are the expected arrays (a finding otherwise)."""
        n = headers.get("inference-header-content-length")
        head = json.loads(body[:int(n)] if n else body)
        at = int(n) if n else 0
        got = {}
        for o in head["outputs"]:
            size = (o.get("parameters") or {}).get("binary_data_size")
            if size is not None:
                raw = body[at:at + size]
                at += size
                if o["datatype"] == "BYTES":
                    vals, i = [], 0
                    while i < len(raw):
                        (m,) = struct.unpack_from("<I", raw, i)
                        vals.append(raw[i + 4:i + 4 + m].decode())
                        i += 4 + m
                    got[o["name"]] = np.array(vals).reshape(o["shape"])
                else:
                    dt = {"FP32": "<f4", "INT64": "<i8"}[o["datatype"]]
                    got[o["name"]] = np.frombuffer(raw, dt).reshape(o["shape"])
            else:
                got[o["name"]] = np.array(o["data"], dtype=np.float32 if o["name"] == "SCORES" else None).reshape(
                    o["shape"])
        want = {k: v for k, v in expected.items() if names is None or k in names}
        if set(got) != set(want):
            return f"outputs {sorted(got)}, expected {sorted(want)}"
        for k, v in want.items():
            g = got[k]
            if k == "IDS" and v.dtype.kind in "US":
                v = v.astype(str)
            if g.shape != v.shape or not np.array_equal(g.astype(v.dtype) if v.dtype.kind != "U" else g, v):
                return f"output {k} differs: got {g.ravel()[:6]} shape {g.shape}, expected {v.ravel()[:6]} shape {v.shape}"
        return None

    # ------------------------------------------------------------ one HTTP request, checked

    def send(self, label, method, path, body, headers, expected=None, names=None, preserve=False, timeout=TIMEOUT_S):
        self.count(label)
        t0 = time.monotonic()
        try:
            status, head, out = self.http(method, path, body, headers, timeout)
        except socket.timeout:
            self.find("hang", f"{label}: no answer in {timeout} s", (method, path, headers, body[:500] if body else body))
            return None
        except (ConnectionError, http.client.HTTPException, OSError, UnicodeError) as e:
            if self.proc.poll() is not None:
                self.find("crash", f"{label}: server exited {self.proc.returncode}: {e}", (path, headers, body[:500] if body else body))
                raise SystemExit(1)
            self.find("connection", f"{label}: {type(e).__name__}: {e}", (method, path, headers, body[:500] if body else body))
            return None
        dt = time.monotonic() - t0
        if status not in HTTP_OK:
            self.find(f"status {status}", f"{label}: {out[:500]!r}", (method, path, headers, body[:800] if body else body))
            return status
        if status != 200 and method != "HEAD":
            try:
                msg = json.loads(out)["error"]
                assert isinstance(msg, str) and msg
            except Exception:  # noqa: BLE001
                self.find("body", f"{label}: {status} without a JSON error: {out[:300]!r}", (method, path, headers))
        if status == 200 and method == "POST" and path.endswith("/infer"):
            if expected is not None and preserve:
                try:
                    err = self.check_outputs(out, head, expected, names)
                except Exception as e:  # noqa: BLE001
                    err = f"unreadable answer: {type(e).__name__}: {e}: {out[:200]!r}"
                if err:
                    self.find("wrong answer", f"{label}: {err}", (path, headers, body[:800]))
            elif not preserve:
                with self.lock:
                    self.accepted[label] = self.accepted.get(label, 0) + 1
        if dt > 10 and label != "big json":
            self.find("slow", f"{label}: answered {status} after {dt:.1f} s", (path, headers))
        return status

    # ------------------------------------------------------------ mutations

    def mutate_header(self, header: dict, model: str):
        """One mutation of the header (in place, or a replacement returned): (label, header, preserving)."""
        r = self.rng
        inputs = header["inputs"]
        t = r.choice(inputs) if inputs else None
        huge = [2**31, 2**32 + 1, 2**63 - 1, 2**63, 2**64, 10**30]
        choice = r.randrange(32)
        if choice == 0 and t:
            t["name"] = r.choice(["", "q", "Q ", "K", "IDS", "SCORES", 5, None, ["Q"], "Q" * 5000, "\u00e9", "Q\x00"])
            return "name", header, False
        if choice == 1 and t:
            t["shape"] = r.choice([[], [0], [-1, DIM], [1, -DIM], [r.choice(huge)], [r.choice(huge), r.choice(huge)],
                                   [1.5, DIM], ["2", DIM], None, "16", {}, [True, DIM], [[1], DIM], [1] * 70,
                                   [2**20, 2**20, DIM], [0, 2**40], [2**28 + 1], [1, 0, DIM], [0, 5, DIM],
                                   [1, 1, 1, 1, DIM], [2, 2**27], [0, 2**40, DIM], [0, 2**62], [2**40, 0]])
            return "shape", header, False
        if choice == 2 and t:
            t["datatype"] = r.choice(["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32",
                                      "INT64", "FP16", "FP32", "FP64", "BF16", "BYTES", "fp32", "", None, 5,
                                      ["FP32"], {}, "FP32 ", "STRING"])
            return "datatype", header, False
        if choice == 3 and t and "data" in t:
            flat = t["data"]
            v = r.choice([1e308, -1e308, float("nan"), float("inf"), 10**30, -10**30, 2**63, -2**63 - 1, 2**64,
                          "1", None, True, [], {}, [1, [2]], 0.5, -1, 2**31, 2**31 - 1, -0.0])
            if flat:
                flat[r.randrange(len(flat))] = v
            else:
                t["data"] = [v]
            return "data value", header, False
        if choice == 4 and t and "data" in t:
            t["data"] = r.choice([None, {}, "abc", 5, [[t["data"]]], t["data"][:-1], t["data"] + [0],
                                  [t["data"]] * 2, [[[[[[]]]]]], []])
            return "data form", header, False
        if choice == 5 and t:
            inputs.append(json.loads(json.dumps(t)))
            return "duplicate input", header, False
        if choice == 6 and t:
            inputs.remove(t)
            return "missing input", header, False
        if choice == 7:
            inputs.append({"name": r.choice(["X", "Q", "K", "IDS"]), "shape": [1], "datatype": "INT32", "data": [1]})
            return "extra input", header, False
        if choice == 8 and t:
            t["parameters"] = r.choice([[], "x", 5, None, {"binary_data_size": None}, {"binary_data_size": -1},
                                        {"binary_data_size": 1.5}, {"binary_data_size": "12"},
                                        {"binary_data_size": True}, {"binary_data_size": 2**70},
                                        {"binary_data_size": 0}, {"other": [1, 2]}])
            return "input parameters", header, False
        if choice == 9:
            if not isinstance(header.get("parameters"), dict):
                header["parameters"] = {}
            p = header["parameters"]
            key, val = r.choice([
                ("timeout", r.choice([0, -1, 1, 1e-300, "1", True, None, [], 2**64, 1e308, float("nan"),
                                      float("inf"), -0.0, 10**400 if r.random() < 0.2 else 2**1000])),
                ("precision", r.choice(["tf32", "fp64", 5, None, "", "FP32", []])),
                ("binary_data_output", r.choice([1, "true", None, [], 0])),
                ("priority", r.choice([1, "x", None])),
            ])
            p[key] = val
            return f"parameter {key}", header, False
        if choice == 10:
            header["parameters"] = r.choice([[], "x", 5, True, [1, 2]])
            return "parameters form", header, False
        if choice == 11:
            header["outputs"] = r.choice([[{"name": "X"}], "SCORES", [{"name": "SCORES", "parameters": []}],
                                          [{"name": "SCORES"}, {"name": "SCORES"}],
                                          [{"name": "SCORES", "parameters": {"binary_data": "yes"}}],
                                          [{}], [None], [{"name": 5}], {"name": "SCORES"}, 5])
            return "outputs bad", header, False
        if choice == 12:
            names = ["SCORES", "IDS"] if model == "search" else ["SCORES"]
            header["outputs"] = [{"name": n, "parameters": {"binary_data": r.random() < 0.5}} for n in names
                                 if r.random() < 0.7] or [{"name": "SCORES"}]
            if r.random() < 0.5 and isinstance(header.get("parameters", {}), dict):
                header.setdefault("parameters", {})["binary_data_output"] = r.random() < 0.5
            return "outputs good", header, True
        if choice == 13:
            header["id"] = r.choice([5, "x" * 10000, ["a"], None, "\u2603", {"a": 1}])
            return "id", header, True
        if choice == 14:
            if not isinstance(header.get("parameters"), dict):
                header["parameters"] = {}
            header["parameters"].update(timeout=r.choice([10**9, 10**15, 30_000_000, 1e12]),
                                                       unknown_param=r.choice([1, "x", None, [1], {"a": 1}]))
            return "harmless parameters", header, True
        if choice == 15:
            return "top level", r.choice([[], None, 5, "x", {"inputs": {}}, {"inputs": None}, {"inputs": "Q"},
                                          {"inputs": [None]}, {"inputs": [5]}, {}, {"inputs": [{"name": "Q"}]}]), False
        if choice == 16 and model == "search":
            k = next((x for x in inputs if x.get("name") == "K"), None)
            if k is not None and "data" in k:
                k["data"] = [r.choice([0, -1, 4096, 4097, 2**31 - 1, 2**63 - 1, -2**63, 1, NDOCS])]
                k["datatype"] = r.choice(["INT32", "INT64", "INT8", "UINT64", "UINT8", "INT16", "FP32"])
                k["shape"] = r.choice([[1], [], [1, 1], [1, 1, 1]])
                return "k value", header, False
        if choice == 17 and model == "rerank":
            ids = next((x for x in inputs if x.get("name") == "IDS"), None)
            if ids is not None and "data" in ids and ids["data"]:
                i = r.randrange(len(ids["data"]))
                if self.ids_kind == "string":
                    ids["data"][i] = r.choice(["doc-999", "", "doc-1 ", 5, "d" * 70000, "doc-\ud800" if False else "\u00e9",
                                               "doc-01"])
                else:
                    ids["data"][i] = r.choice([-1, NDOCS * 3 + 5, 2**63 - 1, -2**63, 6, "5", 5.0, 2**63, 2**64 - 1])
                    ids["datatype"] = r.choice(["INT64", "INT32", "UINT64", "INT8", "UINT8", "BYTES", ids["datatype"]])
                return "ids value", header, False
        if choice == 18 and t:
            deep = json.loads("[" * 100 + "1" + "]" * 100)
            where = r.choice(["data", "shape", "parameters", "top"])
            if where == "top":
                header["x"] = deep
            else:
                t[where] = deep
            return "nesting", header, False
        if choice == 19:
            # Nq / Lq / K large but within limits: memory and time, not an error
            q = next((x for x in inputs if x.get("name") == "Q"), None)
            if q is not None:
                nq = r.choice([64, 200, 1000])
                q.pop("data", None)
                q["shape"] = [nq, 1, DIM]
                q["data"] = [0.25] * (nq * DIM)
                if model == "rerank":
                    for x in inputs:
                        if x.get("name") == "IDS":
                            x.update(shape=[nq, 3], datatype="BYTES" if self.ids_kind == "string" else "INT64",
                                     data=[self.ext_ids[0].item()] * (3 * nq))
                return "many queries", header, False
        if choice == 20 and t:
            t["shape"] = list(reversed(t["shape"])) if isinstance(t.get("shape"), list) else t.get("shape")
            return "transposed shape", header, False
        if choice == 21 and t and t.get("name") == "Q":
            t["datatype"] = "FP16" if r.random() < 0.5 else "BF16"
            return "Q half", header, False
        if choice == 22:
            header["inputs"] = list(reversed(inputs))
            return "reordered inputs", header, True
        # (the rest: no change beyond the encodings below)
        return "none", header, True

    def http_case(self):
        r = self.rng
        model = r.choice(["search", "rerank", "score"])
        arrays, expected = self.valid(model)
        binary = r.random() < 0.45
        header, chunks = self.encode(arrays, binary)
        label, header, preserve = self.mutate_header(header, model)
        if isinstance(header, dict) and isinstance(header.get("inputs"), list) and r.random() < 0.3:
            try:  # two at once: a datatype and a value
                second, header, kept = self.mutate_header(header, model)
                label, preserve = f"{label}&{second}", preserve and kept
            except (AttributeError, TypeError, KeyError, ValueError):  # (the first left nothing it can change)
                pass
        names = None
        if preserve and isinstance(header, dict) and isinstance(header.get("outputs"), list) and header["outputs"]:
            names = {o["name"] for o in header["outputs"]}
        try:
            raw_header = json.dumps(header).encode()
        except (ValueError, TypeError):
            raw_header = b"{}"
        body, headers = self.body(header, chunks, raw_header)
        path = f"/v2/models/{model}/infer"
        label = f"{'bin' if binary else 'json'}:{label}"
        m = r.randrange(24)
        method = "POST"
        if m == 0 and chunks is not None:
            n = len(raw_header) + r.choice([-1, 1, -len(raw_header), 3, len(body)])
            headers["Inference-Header-Content-Length"] = str(n)
            label, preserve = label + "+hlen", False
        elif m == 1:
            headers["Inference-Header-Content-Length"] = r.choice(["-1", "abc", "", " 5", "1e3", str(10**30), "0x10",
                                                                   "\u0663".encode().decode("latin-1"), "0", "5 5", "00012"])
            label, preserve = label + "+hlen value", False
        elif m == 2 and chunks is not None:
            body = body[:-r.randint(1, 8)] if r.random() < 0.5 else body + os.urandom(r.randint(1, 8))
            label, preserve = label + "+payload length", False
        elif m == 3:
            i = r.randrange(len(body))
            body = body[:i] + bytes([r.randrange(256)]) + body[i + 1:]
            label, preserve = label + "+flipped byte", False
        elif m in (4, 5):
            coding = r.choice(["gzip", "deflate", "GZIP", " gzip "])
            body = gzip.compress(body) if "gzip" in coding.lower() else zlib.compress(body)
            headers["Content-Encoding"] = coding
            label += "+" + coding.strip().lower()
        elif m == 6:
            kind = r.randrange(7)
            if kind == 0:
                body = gzip.compress(bytes(MAX_BODY + 1), 1)
                headers["Content-Encoding"] = "gzip"
            elif kind == 1:
                body = zlib.compress(b"[" * (MAX_BODY + 10), 9)
                headers["Content-Encoding"] = "deflate"
            elif kind == 2:  # many tiny gzip members
                body = gzip.compress(b"") * r.choice([1000, 100000])
                headers["Content-Encoding"] = "gzip"
            elif kind == 3:
                headers["Content-Encoding"] = r.choice(["br", "gzip, gzip", "identity", "", "x" * 1000, "gzip;q=1"])
            elif kind == 4:
                headers["Content-Encoding"] = "gzip"  # not compressed
            elif kind == 5:
                body = gzip.compress(body)[:-r.randint(1, 20)]
                headers["Content-Encoding"] = "gzip"
            else:
                body = gzip.compress(gzip.compress(bytes(MAX_BODY // 2)))
                headers["Content-Encoding"] = "gzip"
            label, preserve = label + f"+encoding {kind}", False
        elif m == 7:
            method = r.choice(["GET", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE"])
            label, preserve = label + "+method", False
        elif m == 8:
            path = r.choice([f"/v2/models/{model}/versions/2/infer", f"/v2/models/{model}/versions/1/infer",
                             "/v2/models//infer", f"/v2/models/{model}%2F/infer", f"/v2/models/{model}/infer/",
                             "/v2/models/" + "x" * 6000 + "/infer", "/v2/models/%C3%A9/infer", "/v2/models/%00/infer",
                             f"/v2/models/{model}/../{model}/infer", f"/v2/models/{model}/infer?x=1",
                             f"/v2/models/{model.upper()}/infer", "/v2/models/search/versions//infer", "//v2",
                             "/v2/models/stats/infer", "/v2/health/ready", "/metrics", "/v2/models/search/config",
                             f"/v2/models/{model}/versions/1/stats", "/v2/models/nope/ready", "/"])
            if path.endswith("versions/1/infer") or path.endswith("infer?x=1"):
                label += "+path ok"
            else:
                label, preserve = label + "+path", False
        elif m == 9 and len(body) > 64:
            body = os.urandom(r.choice([1, 100, 10000]))
            label, preserve = label + "+random body", False
        elif m == 10:
            body = body + b" " * r.choice([1, 1000])
            if chunks is not None:
                label, preserve = label + "+trailing spaces", False
            else:
                label += "+trailing spaces json"
        if method in ("GET", "HEAD", "OPTIONS") and r.random() < 0.5:
            body = None
        return self.send(label, method, path, body, headers, expected, names, preserve)

    # ------------------------------------------------------------ gRPC

    def grpc_case(self):
        r, pb = self.rng, self.pb
        model = r.choice(["search", "rerank", "score"])
        arrays, expected = self.valid(model)
        req = pb.ModelInferRequest(model_name=model)
        raw = r.random() < 0.6
        for name, a in arrays.items():
            dt = self.datatype(a)
            t = req.inputs.add(name=name, datatype=dt, shape=list(a.shape))
            if raw:
                req.raw_input_contents.append(
                    b"".join(struct.pack("<I", len(x.encode())) + x.encode() for x in a.reshape(-1).tolist())
                    if dt == "BYTES" else a.tobytes())
            else:
                field = {"FP32": "fp32_contents", "INT32": "int_contents", "INT64": "int64_contents",
                         "BYTES": "bytes_contents"}[dt]
                vals = [x.encode() for x in a.reshape(-1).tolist()] if dt == "BYTES" else a.reshape(-1).tolist()
                getattr(t.contents, field).extend(vals)
        label, preserve = "none", True
        m = r.randrange(16)
        t = r.choice(req.inputs)
        if m == 0:
            del t.shape[:]
            t.shape.extend(r.choice([[], [0], [-1, DIM], [2**62, 2**62], [2**40], [1, 0, DIM], [2**28 + 1], [1] * 70]))
            label, preserve = "shape", False
        elif m == 1:
            t.datatype = r.choice(["BOOL", "UINT8", "INT8", "FP16", "BF16", "FP64", "BYTES", "", "fp32", "UINT64"])
            label, preserve = "datatype", False
        elif m == 2 and raw:
            i = r.randrange(len(req.raw_input_contents))
            b = req.raw_input_contents[i]
            req.raw_input_contents[i] = b[:-r.randint(1, 5)] if b and r.random() < 0.5 else b + os.urandom(3)
            label, preserve = "raw length", False
        elif m == 3 and raw:
            req.raw_input_contents.append(b"x")
            label, preserve = "raw count", False
        elif m == 4:
            t.name = r.choice(["", "X", "K", "IDS", "Q"])
            label, preserve = "name", False
        elif m == 5:
            key = r.choice(["timeout", "precision", "binary_data_output", "other"])
            p = req.parameters[key]
            which = r.randrange(4)
            if which == 0:
                p.int64_param = r.choice([0, -1, 1, 2**63 - 1])
            elif which == 1:
                p.string_param = r.choice(["tf32", "x", "", "1"])
            elif which == 2:
                p.bool_param = r.random() < 0.5
            else:
                p.double_param = r.choice([0.0, -1.0, float("nan"), float("inf"), 1e308, 1e-300])
            label, preserve = f"parameter {key}", key == "other"
        elif m == 6:
            req.outputs.add(name=r.choice(["X", "SCORES", "IDS", ""]))
            label, preserve = "outputs", False
        elif m == 7:
            req.model_version = r.choice(["2", "1", "", "x" * 1000])
            label, preserve = "version", req.model_version in ("1", "")
        elif m == 8:
            req.model_name = r.choice(["", "nope", "SCORE", "x" * 5000])
            label, preserve = "model name", False
        elif m == 9 and not raw:
            # typed contents in the wrong field
            for fld in ("int_contents", "fp32_contents", "bytes_contents", "bool_contents", "uint64_contents"):
                if r.random() < 0.3:
                    t.contents.ClearField(fld)
                    getattr(t.contents, fld).extend({"bytes_contents": [b"1"], "bool_contents": [True]}.get(fld, [1]))
            label, preserve = "contents field", False
        elif m == 10 and model == "search":
            k = next(x for x in req.inputs if x.name == "K")
            i = list(req.inputs).index(k)
            val = r.choice([0, -1, 4097, 2**31 - 1, 1])
            if raw:
                req.raw_input_contents[i] = np.array([val], np.int32 if k.datatype == "INT32" else np.int64).tobytes()
            else:
                k.contents.ClearField("int_contents")
                k.contents.ClearField("int64_contents")
                getattr(k.contents, "int_contents" if k.datatype == "INT32" else "int64_contents").append(val)
            label, preserve = "k value", False
        elif m == 11 and model == "rerank" and not raw:
            ids = next(x for x in req.inputs if x.name == "IDS")
            if ids.datatype == "BYTES":
                ids.contents.bytes_contents.append(b"\xff\xfe")
                ids.shape[-1] += 1 if len(ids.shape) == 1 else 0
            else:
                ids.contents.int64_contents.append(r.choice([-1, 2**63 - 1, NDOCS * 3 + 4]))
                if len(ids.shape) == 1:
                    ids.shape[0] += 1
            label, preserve = "ids value", False
        elif m == 12:
            del req.inputs[r.randrange(len(req.inputs))]
            label, preserve = "missing input", False
        elif m == 13:
            req.inputs.add().CopyFrom(t)
            if raw:
                req.raw_input_contents.append(req.raw_input_contents[list(req.inputs).index(t)])
            label, preserve = "duplicate input", False
        elif m == 14 and r.random() < 0.1:
            req.raw_input_contents.append(bytes(MAX_BODY))
            label, preserve = "huge message", False
        label = f"grpc:{'raw' if raw else 'typed'}:{label}"
        self.count(label)
        timeout = r.choice([TIMEOUT_S, TIMEOUT_S, 1e-4, 0.01])
        t0 = time.monotonic()
        try:
            resp = self.stub.ModelInfer(req, timeout=timeout)
        except self.grpc.RpcError as e:
            code = e.code()
            ok = {"INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED"}
            if code.name not in ok:
                self.find(f"grpc {code.name}", f"{label}: {e.details()}", req if req.ByteSize() < 10000 else label)
            elif code.name == "DEADLINE_EXCEEDED" and time.monotonic() - t0 >= TIMEOUT_S - 1:
                self.find("hang", f"{label}: no gRPC answer in {timeout} s", req if req.ByteSize() < 10000 else label)
            elif not e.details() and code.name != "DEADLINE_EXCEEDED":
                self.find("body", f"{label}: {code.name} without a message")
            return
        if preserve:
            got = {}
            for o, b in zip(resp.outputs, resp.raw_output_contents):
                if o.datatype == "BYTES":
                    vals, i = [], 0
                    while i < len(b):
                        (n,) = struct.unpack_from("<I", b, i)
                        vals.append(b[i + 4:i + 4 + n].decode())
                        i += 4 + n
                    got[o.name] = np.array(vals).reshape(list(o.shape))
                else:
                    got[o.name] = np.frombuffer(b, {"FP32": "<f4", "INT64": "<i8"}[o.datatype]).reshape(list(o.shape))
            for k, v in expected.items():
                g = got.get(k)
                v = v.astype(str) if v.dtype.kind in "US" else v
                if g is None or g.shape != v.shape or not np.array_equal(g, v):
                    self.find("wrong answer", f"{label}: output {k} differs", req if req.ByteSize() < 10000 else label)
        else:
            with self.lock:
                self.accepted[label] = self.accepted.get(label, 0) + 1

    # ------------------------------------------------------------ health and concurrency

    def health(self):
        try:
            status = self.http("GET", "/v2/health/ready")[0]
        except OSError as e:
            status = f"{type(e).__name__}: {e}"
        if status != 200:
            self.find("health", f"/v2/health/ready answered {status}")
        for model in ("search", "rerank", "score"):
            arrays, expected = self.valid(model)
            header, chunks = self.encode(arrays, self.rng.random() < 0.5)
            body, headers = self.body(header, chunks)
            self.send(f"check:{model}", "POST", f"/v2/models/{model}/infer", body, headers, expected, None, True)

    def burst(self, n: int):
        """n requests at once, half valid (checked), half mutated."""
        def one(i):
            if i % 2:
                model = self.rng.choice(["search", "rerank", "score"])
                arrays, expected = self.valid(model)
                header, chunks = self.encode(arrays, i % 4 == 1)
                body, headers = self.body(header, chunks)
                self.send(f"burst valid:{model}", "POST", f"/v2/models/{model}/infer", body, headers, expected, None,
                          True)
            elif hasattr(self, "stub") and i % 4 == 2:
                self.grpc_case()
            else:
                self.http_case()

        with ThreadPoolExecutor(16) as ex:
            list(ex.map(one, range(n)))

    def slow_clients(self):
        """Connections that send part of a request and stall, while others are served."""
        socks = []
        for i in range(8):
            s = socket.create_connection(("127.0.0.1", self.port))
            s.sendall(b"POST /v2/models/score/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"inputs\"")
            socks.append(s)
        self.health()
        for s in socks:
            s.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--ids", choices=["int", "string", "none"], default="int")
    ap.add_argument("--no-grpc", action="store_true")
    a = ap.parse_args()
    grpc_on = not a.no_grpc
    if grpc_on:
        try:
            importlib.import_module("lik_cupy.serving.grpc")
        except ImportError:
            grpc_on = False
    f = Fuzz(a.seed, a.ids)
    f.start(grpc_on)
    rss, n, until = [f.rss_mb()], 0, time.monotonic() + a.seconds
    try:
        while time.monotonic() < until:
            if grpc_on and f.rng.random() < 0.25:
                f.grpc_case()
            else:
                f.http_case()
            n += 1
            if n % 50 == 0:
                f.health()
                rss.append(f.rss_mb())
            if n % 400 == 0:
                f.burst(48)
            if n % 1000 == 0:
                f.slow_clients()
            if n % 1500 == 0:  # a JSON body just under the limit: what parsing it holds
                nq = (60 << 20) // 4 // DIM // 16
                big = b'{"inputs": [{"name": "Q", "datatype": "FP32", "shape": [%d, 16, %d], "data": [' % (nq, DIM)
                big += b"0.5," * (nq * 16 * DIM - 1) + b"0.5]}]}"
                f.send("big json", "POST", "/v2/models/score/infer", big, {}, timeout=120)
                rss.append(f.rss_mb())
            if f.proc.poll() is not None:
                f.find("crash", f"server exited {f.proc.returncode}")
                break
    finally:
        log = f.stop()
    for line in log.splitlines():
        if "Traceback" in line or "inference request failed" in line or "Exception" in line:
            f.find("stderr", log[-4000:])
            break
    summary = {"seed": a.seed, "ids": a.ids, "grpc": grpc_on, "requests": sum(f.counts.values()),
               "findings": len(f.findings), "kinds": sorted({x["kind"] for x in f.findings}),
               "rss_mb": {"start": rss[0], "max": max(rss), "end": rss[-1],
                          "tenths": [round(max(rss[i * len(rss) // 10:(i + 1) * len(rss) // 10] or [0])) for i in range(10)]},
               "accepted_mutations": dict(sorted(f.accepted.items())), "exit": f.proc.returncode}
    print(json.dumps(summary), flush=True)
    sys.exit(1 if f.findings else 0)


if __name__ == "__main__":
    main()
