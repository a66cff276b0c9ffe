"""Mutation fuzzer of every file reader: shard directories, ``.npy`` inputs with lengths (``.npy`` or
ColBERT doclens JSON), fast-plaid / PyLate / ColBERTv2 PLAID indexes (``.pt`` zip archives read without
torch). Small valid inputs are written first (a float16 shard with string ids, an INT8 shard with integer
ids, a bfloat16 shard, flat tokens with JSON and ``.npy`` doclens, a padded array with lengths, the
fast-plaid fixture of ``tests/data/fast_plaid/`` merged and in per-chunk files, PyLate's layout of it and,
where torch is installed, the same index as ``torch.save`` writes ColBERTv2's). Each iteration copies
one and applies one to three mutations: bytes flipped, set, inserted or deleted, the file truncated or
extended, files swapped, deleted or copied to other names; JSON values replaced (huge and negative
integers, NaN, Infinity, deep nesting, values of other types, keys dropped); ``.npy`` headers rewritten
(shape, huge dims, dtype, fortran_order, version 2.0, header text Python parses); ``.pt`` members
mutated, swapped, dropped, deflated and their pickles' integers changed. The input is then opened AND
used in a forked child under ``RLIMIT_AS`` and a time limit: a shard is read chunk by chunk, scanned,
packed again, scored as documents, as queries and against itself by ``lik score``'s own function on
the CPU (``.tsv``, ``.jsonl``, ``--full-matrix``) and searched as a ``Corpus``; an index is opened and
every document scored, candidates reranked and decompressed. A ``ShardError`` (or the CLI's
``LikError``) is the documented outcome; any other exception, a signal, ``MemoryError``, a time-out, an
input that opens inconsistent (an invariant of what was read fails), a library call refusing what the
reader accepted, a Syntax/Deprecation/FutureWarning (a line on stderr besides the CLI's one), or peak
memory or time far past the unmutated input's (``judge``) is a finding, kept with its mutations under
the work directory.

    python3 bench/tools/file_fuzz.py SEED SECONDS [--mem-mb 2048] [--timeout 20] [--work DIR]
    python3 bench/tools/file_fuzz.py SEED --replay N     # run iteration N of SEED again, printing its result

Prints each finding as it comes and a summary by outcome; writes ``findings.json`` in the work
directory (default ``/tmp/lik-filefuzz-SEED``). Exit 1 if there was a finding. Linux only (fork,
``RLIMIT_AS``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before NumPy: children are forked
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import resource  # noqa: E402
import select  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import struct  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
import zipfile  # noqa: E402

import numpy as np  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from lik_cupy import Corpus, PlaidIndex, shards  # noqa: E402
from lik_cupy import cli as lik_cli  # noqa: E402
from lik_cupy.errors import LikError, ShardError  # noqa: E402
from lik_cupy.plaid import maxsim_residual_varlen  # noqa: E402

FIXTURE = REPO / "tests" / "data" / "fast_plaid" / "fast_plaid_nbits2"

# --------------------------------------------------------------------------- valid inputs


def _npy(path, arr):
    np.save(path, arr, allow_pickle=False)


def build_bases(root: pathlib.Path) -> dict[str, dict]:
    """Write the valid inputs under ``root``: {name: {"kind": "shard" | "plaid", "dir", "args"}} where
    ``args`` are the input's paths relative to its directory (the input, then its lengths file)."""
    rng = np.random.default_rng(0)
    bases = {}
    docs = [rng.standard_normal((int(n), 8)).astype(np.float16) for n in rng.integers(0, 9, 12)]
    docs = [d / np.maximum(np.linalg.norm(d, axis=1, keepdims=True), 1e-3) for d in docs]

    def shard(name, arrays, **kw):
        (root / name).mkdir()
        shards.pack_arrays(arrays, root / name / "s", **kw)
        bases[name] = {"kind": "shard", "dir": str(root / name), "args": ["s"]}

    shard("shard-f16", docs, ids=[f"doc{i}" for i in range(len(docs))])
    shard("shard-int8", docs, ids=list(range(100, 100 + len(docs))), dtype="int8")
    shard("shard-bf16", docs, dtype="bfloat16", ids=[f"d{i}".encode() for i in range(len(docs))])
    flat = np.concatenate(docs)
    lens = [len(d) for d in docs]
    (root / "flat-json").mkdir()
    _npy(root / "flat-json" / "tokens.npy", flat.astype(np.float32))
    (root / "flat-json" / "doclens.json").write_text(json.dumps(lens))
    bases["flat-json"] = {"kind": "shard", "dir": str(root / "flat-json"), "args": ["tokens.npy", "doclens.json"]}
    (root / "flat-npy").mkdir()
    _npy(root / "flat-npy" / "tokens.npy", flat)
    _npy(root / "flat-npy" / "doclens.npy", np.array(lens, np.int32))
    bases["flat-npy"] = {"kind": "shard", "dir": str(root / "flat-npy"), "args": ["tokens.npy", "doclens.npy"]}
    (root / "padded").mkdir()
    pad = np.zeros((len(docs), max(lens), 8), np.float16)
    for i, d in enumerate(docs):
        pad[i, :len(d)] = d
    _npy(root / "padded" / "docs.npy", pad)
    _npy(root / "padded" / "lengths.npy", np.array(lens, np.int64))
    bases["padded"] = {"kind": "shard", "dir": str(root / "padded"), "args": ["docs.npy", "lengths.npy"]}
    (root / "padded-bare").mkdir()
    _npy(root / "padded-bare" / "docs.npy", pad[:, :4].astype(np.float32))
    bases["padded-bare"] = {"kind": "shard", "dir": str(root / "padded-bare"), "args": ["docs.npy"]}

    # PLAID: the fast-plaid fixture (merged files), in per-chunk files, in PyLate's directory.
    shutil.copytree(FIXTURE, root / "fast-plaid" / "i")
    bases["fast-plaid"] = {"kind": "plaid", "dir": str(root / "fast-plaid"), "args": ["i"]}
    cen, w = np.load(FIXTURE / "centroids.npy"), np.load(FIXTURE / "bucket_weights.npy")
    lens = json.loads((FIXTURE / "doclens.0.json").read_text())
    t = sum(lens)
    codes, bits = np.load(FIXTURE / "merged_codes.npy")[:t], np.load(FIXTURE / "merged_residuals.npy")[:t]
    chunked = root / "fast-plaid-chunks" / "i"
    chunked.mkdir(parents=True)
    _npy(chunked / "centroids.npy", cen)
    _npy(chunked / "bucket_weights.npy", w)
    meta = json.loads((FIXTURE / "metadata.json").read_text())
    (chunked / "metadata.json").write_text(json.dumps({**meta, "num_chunks": 2}))
    half = len(lens) // 2
    off = int(sum(lens[:half]))
    for i, (ls, sl) in enumerate(((lens[:half], slice(0, off)), (lens[half:], slice(off, t)))):
        (chunked / f"doclens.{i}.json").write_text(json.dumps(ls))
        _npy(chunked / f"{i}.codes.npy", codes[sl].astype(np.int32 if i else np.int64))
        _npy(chunked / f"{i}.residuals.npy", bits[sl])
    bases["fast-plaid-chunks"] = {"kind": "plaid", "dir": str(root / "fast-plaid-chunks"), "args": ["i"]}
    shutil.copytree(FIXTURE, root / "pylate" / "i" / "fast_plaid_index")
    bases["pylate"] = {"kind": "plaid", "dir": str(root / "pylate"), "args": ["i"]}

    colbert = root / "colbert" / "i"
    colbert.mkdir(parents=True)
    np.savez(root / "colbert" / "arrays.npz", cen=cen, w=w.astype(np.float32), codes=codes.astype(np.int32),
             bits=bits, cut=np.array([off]))
    (colbert / "metadata.json").write_text(json.dumps({"config": {"dim": int(cen.shape[1]), "nbits": 2},
                                                        "num_chunks": 2}))
    for i, ls in enumerate((lens[:half], lens[half:])):
        (colbert / f"doclens.{i}.json").write_text(json.dumps(ls))
    # torch.save in a process of its own (this one forks its children, and torch is large); views of
    # one tensor save its whole storage at an offset, as a sliced tensor does
    script = f"""
import numpy as np, torch
a = np.load({str(root / 'colbert' / 'arrays.npz')!r})
d = {str(colbert)!r}
torch.save(torch.from_numpy(a["cen"]), d + "/centroids.pt")
torch.save((torch.linspace(-1, 1, 3), torch.from_numpy(a["w"])), d + "/buckets.pt")
cut = int(a["cut"][0])
codes, bits = torch.from_numpy(a["codes"]), torch.from_numpy(a["bits"])
torch.save(codes[:cut].clone(), d + "/0.codes.pt")
torch.save(bits[:cut], d + "/0.residuals.pt")
torch.save(codes[cut:], d + "/1.codes.pt")
torch.save(bits[cut:].clone(), d + "/1.residuals.pt")
"""
    try:
        subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, timeout=300)
        bases["colbert"] = {"kind": "plaid", "dir": str(root / "colbert"), "args": ["i"]}
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        print(f"no ColBERTv2 base (torch.save failed: {getattr(e, 'stderr', b'')[-300:]!r})", file=sys.stderr)
    return bases


# --------------------------------------------------------------------------- mutations

INTERESTING_INTS = [0, 1, -1, 2, 7, 255, 256, 65535, 2**31 - 1, 2**31, -2**31, 2**32, 2**53, 2**62, 2**63 - 1,
                    2**63, 2**64, -2**63, -2**63 - 1, 10**30, 10**400]
INTERESTING_BYTES = [0x00, 0x01, 0x7F, 0x80, 0xFF, 0x20, 0x0A, 0x22, 0x5B, 0x7B, 0x2D]


def _files_in(d: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in d.rglob("*") if p.is_file() and not p.is_symlink())


def mutate_bytes(rng, data: bytes) -> tuple[bytes, dict]:
    """One byte-level mutation of ``data``: (new bytes, its description)."""
    b = bytearray(data)
    n = len(b)
    op = rng.choice(["flip", "set", "insert", "delete", "truncate", "extend", "dup", "int"]) if n else "extend"
    if op == "flip":
        at = [int(x) for x in rng.integers(0, n, int(rng.integers(1, 5)))]
        bits = [int(x) for x in rng.integers(0, 8, len(at))]
        for i, k in zip(at, bits):
            b[i] ^= 1 << k
        return bytes(b), {"op": "flip bits", "at": at, "bit": bits}
    if op == "set":
        at = [int(x) for x in rng.integers(0, n, int(rng.integers(1, 4)))]
        vals = [int(rng.choice(INTERESTING_BYTES)) if rng.random() < .5 else int(rng.integers(0, 256)) for _ in at]
        for i, v in zip(at, vals):
            b[i] = v
        return bytes(b), {"op": "set bytes", "at": at, "value": vals}
    if op == "insert":
        at, k = int(rng.integers(0, n + 1)), int(rng.choice([1, 2, 4, 8, 64, 1000]))
        ins = bytes(rng.integers(0, 256, k, dtype=np.uint8)) if rng.random() < .5 else bytes(k)
        return bytes(b[:at] + ins + b[at:]), {"op": "insert", "at": at, "bytes": ins.hex()[:64], "count": k}
    if op == "delete":
        at = int(rng.integers(0, n))
        k = int(min(n - at, rng.choice([1, 2, 4, 8, 64])))
        return bytes(b[:at] + b[at + k:]), {"op": "delete", "at": at, "count": k}
    if op == "truncate":
        at = int(rng.integers(0, n))
        return bytes(b[:at]), {"op": "truncate", "to": at}
    if op == "extend":
        k = int(rng.choice([1, 7, 64, 4096, 1 << 20]))
        ext = bytes(k) if rng.random() < .5 else bytes(rng.integers(0, 256, min(k, 4096), dtype=np.uint8)) * (
            max(k // 4096, 1))
        return bytes(b) + ext, {"op": "extend", "count": len(ext)}
    if op == "dup":
        a = int(rng.integers(0, n))
        k = int(min(n - a, rng.integers(1, 256)))
        at = int(rng.integers(0, n + 1))
        return bytes(b[:at] + b[a:a + k] + b[at:]), {"op": "duplicate", "from": a, "count": k, "at": at}
    # an interesting integer written over 1, 2, 4 or 8 bytes, little-endian
    width = int(rng.choice([1, 2, 4, 8]))
    at = int(rng.integers(0, max(n - width, 0) + 1))
    v = int(rng.choice(INTERESTING_INTS)) % (1 << (8 * width))
    b[at:at + width] = v.to_bytes(width, "little")[: n - at]
    return bytes(b[:n]), {"op": "int", "at": at, "width": width, "value": v}


def _json_paths(v, prefix=()):
    yield prefix
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _json_paths(x, prefix + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v[:50]):
            yield from _json_paths(x, prefix + (i,))


def _weird_json_value(rng):
    kind = int(rng.integers(0, 16))
    if kind < 4:
        return int(rng.choice(INTERESTING_INTS)), None
    return [(None, "NaN"), (None, "Infinity"), (None, "-Infinity"), (1.5, None), (-0.0, None), ("2", None),
            ("", None), ([], None), ({}, None), (True, None), (None, None), ("x" * 100_000, None)][kind - 4]


def mutate_json(rng, text: str) -> tuple[str, dict]:
    try:
        value = json.loads(text)
        json.dumps(value)
    except (ValueError, RecursionError):
        data, d = mutate_bytes(rng, text.encode("utf-8", "surrogateescape"))
        return data.decode("utf-8", "surrogateescape"), d
    paths = list(_json_paths(value))
    path = paths[int(rng.integers(0, len(paths)))]
    op = rng.choice(["replace", "replace", "replace", "delete", "deep", "add", "append"])
    marker = "\x00LIKFUZZ\x00"

    def put(new):
        if not path:
            return new
        node = value
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = new
        return value

    if op == "replace" and rng.random() < .2:  # another name: a file of the input, itself, a directory
        new = str(rng.choice(["offsets.npy", "tokens.npy", "ids.npy", "scales.npy", "manifest.json", ".", "",
                              "tokens.npy/", "./tokens.npy", "../s/tokens.npy", "missing.npy", "a/b.npy"]))
        return json.dumps(put(new)), {"op": "json replace", "path": list(path), "value": repr(new)}
    if op == "replace":
        new, raw = _weird_json_value(rng)
        out = json.dumps(put(marker if raw else new))
        out = out.replace(json.dumps(marker), raw) if raw else out
        return out, {"op": "json replace", "path": list(path), "value": raw or (repr(new)[:60])}
    if op == "deep":
        depth = int(rng.choice([100, 1000, 100_000]))
        inner = ("[" * depth + "]" * depth) if rng.random() < .5 else ('{"a":' * depth + "1" + "}" * depth)
        out = json.dumps(put(marker)).replace(json.dumps(marker), inner)
        return out, {"op": "json deep", "path": list(path), "depth": depth}
    if op == "delete" and path:
        node = value
        for k in path[:-1]:
            node = node[k]
        del node[path[-1]]
        return json.dumps(value), {"op": "json delete", "path": list(path)}
    node = value
    for k in path:
        node = node[k]
    if isinstance(node, list):
        new = int(rng.choice(INTERESTING_INTS))
        node.insert(int(rng.integers(0, len(node) + 1)), new) if op != "append" else node.append(new)
        return json.dumps(value), {"op": "json list insert", "path": list(path), "value": new}
    if isinstance(node, dict):
        key = str(rng.choice(["config", "nbits", "num_chunks", "files", "0.codes.npy", "rows", "dim", "ids",
                              "scales", "version"]))
        new, _ = _weird_json_value(rng)
        node[key] = new
        return json.dumps(value), {"op": "json add key", "path": list(path), "key": key, "value": repr(new)[:60]}
    new, raw = _weird_json_value(rng)
    out = json.dumps(put(marker if raw else new))
    out = out.replace(json.dumps(marker), raw) if raw else out
    return out, {"op": "json replace", "path": list(path), "value": raw or repr(new)[:60]}


DESCRS = ["<f2", "<f4", "<f8", "<i1", "|i1", "<i2", "<i4", "<i8", "<u2", "<u4", "<u8", "|u1", "|b1", ">f2", ">i8",
          ">u2", "<c8", "|V2", "|V3", "<U4", "|S3", "<M8[s]", "<m8[ns]", "|O", "<f16",
          [("a", "<f2")], [("a", "<f2"), ("b", "<f2")], ("<f2", (4,)), ("<i8", (0,)), [("", "<i4")], "|S0", "<U0",
          "|V0", ("<i8", (2,)), ("|u1", (32,)), ("<f2", (8,)), [("a", "<i8", (0,))]]


def _npy_header(data: bytes):
    """(version, header dict, data offset) of a .npy file's bytes, or None."""
    if not data.startswith(b"\x93NUMPY") or len(data) < 10:
        return None
    major = data[6]
    if major == 1:
        hl, start = struct.unpack("<H", data[8:10])[0], 10
    elif len(data) >= 12:
        hl, start = struct.unpack("<I", data[8:12])[0], 12
    else:
        return None
    try:
        import ast
        with warnings.catch_warnings():  # (a mutated header's SyntaxWarning is this script's, not a finding)
            warnings.simplefilter("ignore", SyntaxWarning)
            header = ast.literal_eval(data[start:start + hl].decode("latin-1"))
    except Exception:
        return None
    return major, header, start + hl


def _write_header(header_text: str, version: int) -> bytes:
    raw = header_text.encode("latin-1", "replace")
    pre = 10 if version == 1 else 12
    raw += b" " * (-(pre + len(raw) + 1) % 64) + b"\n"
    if version == 1 and len(raw) >= 65536:
        version = 2
        return _write_header(header_text, 2)
    size = struct.pack("<H", len(raw)) if version == 1 else struct.pack("<I", len(raw))
    return b"\x93NUMPY" + bytes([version, 0]) + size + raw


def mutate_npy(rng, data: bytes) -> tuple[bytes, dict]:
    parsed = _npy_header(data)
    if parsed is None:
        return mutate_bytes(rng, data)
    version, header, start = parsed
    if not isinstance(header, dict):
        return mutate_bytes(rng, data)
    body = data[start:]
    op = rng.choice(["shape", "shape", "descr", "descr", "fortran", "version", "keys", "text"])
    h = dict(header)
    desc: dict = {"op": f"npy {op}"}
    if op == "shape":
        shape = h.get("shape", ())
        shape = [v for v in shape if type(v) is int] if isinstance(shape, (tuple, list)) else []
        kind = int(rng.integers(0, 7))
        if kind == 0 or not shape:
            shape = [int(rng.choice(INTERESTING_INTS)) for _ in range(int(rng.integers(0, 4)))]
        elif kind == 1:
            shape[int(rng.integers(0, len(shape)))] = int(rng.choice(INTERESTING_INTS))
        elif kind == 2:
            shape.insert(int(rng.integers(0, len(shape) + 1)), int(rng.choice([0, 1, 2, 2**40])))
        elif kind == 3:
            del shape[int(rng.integers(0, len(shape)))]
        elif kind == 4:
            shape = shape[::-1]
        elif kind == 5:  # the same number of elements in another shape
            total = int(np.prod(shape, dtype=object))
            shape = [total] if len(shape) > 1 else ([1, total] if rng.random() < .5 else [total, 1])
        else:
            shape = [0] * len(shape) if rng.random() < .5 else [2**40, 0] + shape[2:]
        h["shape"] = tuple(shape)
        desc["shape"] = repr(h["shape"])
    elif op == "descr":
        d = DESCRS[int(rng.integers(0, len(DESCRS)))]
        h["descr"] = d
        desc["descr"] = repr(d)
    elif op == "fortran":
        h["fortran_order"] = [True, False, 1, "yes", None][int(rng.integers(0, 5))]
        desc["fortran_order"] = repr(h["fortran_order"])
    elif op == "version":
        version = 3 - version if version in (1, 2) else 1
        if rng.random() < .3:
            version = int(rng.choice([0, 3, 4, 255]))
        desc["version"] = version
    elif op == "keys":
        if rng.random() < .5 and h:
            k = list(h)[int(rng.integers(0, len(h)))]
            del h[k]
            desc["dropped"] = k
        else:
            h["extra"] = 1
            desc["added"] = "extra"
    if op == "text":
        text = repr(h)
        choice = int(rng.integers(0, 8))
        text = [text.replace("(", "[", 1), "(" * 500 + text + ")" * 500, text[: len(text) // 2],
                text.replace("'shape'", "'shape': -" * 1 + "1, 'x'", 1),
                text.replace(")", "if 1else 0)", 1), text.replace("'<", "'\\,<", 1),
                text.replace(")", "L)", 1), text.replace(")", ")(1)", 1)][choice]
        desc["text"] = text[:120]
        return _write_header(text, 1 if version not in (1, 2) else version) + body, desc
    if version not in (1, 2):
        out = _write_header(repr(h), 1)
        return out[:6] + bytes([version, 0]) + out[8:] + body, desc
    return _write_header(repr(h), version) + body, desc


def _pt_members(data: bytes):
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            return [(i.filename, z.read(i), i.compress_type) for i in z.infolist()]
    except Exception:
        return None


def _pt_bytes(members) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data, method in members:
            z.writestr(zipfile.ZipInfo(name, (1980, 1, 1, 0, 0, 0)) if method == zipfile.ZIP_STORED else name,
                       data, compress_type=method)
    return buf.getvalue()


def mutate_pickle(rng, data: bytes) -> tuple[bytes, dict]:
    """An integer argument of one opcode of a pickle changed (BININT1/2/4, LONG1), or an opcode swapped."""
    spots = [i for i in range(len(data) - 1) if data[i:i + 1] in (b"K", b"M", b"J", b"\x8a")]
    if spots and rng.random() < .7:
        at = spots[int(rng.integers(0, len(spots)))]
        op = data[at:at + 1]
        v = int(rng.choice(INTERESTING_INTS))
        if op == b"K":
            new = (b"K" + bytes([v & 0xFF])) if 0 <= v < 256 else None
            old = 2
        elif op == b"M":
            new, old = b"M" + struct.pack("<H", v & 0xFFFF), 3
        elif op == b"J":
            new, old = b"J" + struct.pack("<i", ((v + 2**31) % 2**32) - 2**31), 5
        else:
            old = 2 + data[at + 1] if at + 1 < len(data) else 2
            new = None
        if new is None:  # as LONG1, any size
            raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)[:255]
            new = b"\x8a" + bytes([len(raw)]) + raw
        return data[:at] + new + data[at + old:], {"op": "pickle int", "at": at, "value": v if abs(v) < 2**70 else
                                                   "huge"}
    at = int(rng.integers(0, len(data))) if data else 0
    op = bytes([int(rng.choice(list(b"()tR.q}]eausNbhQ\x85\x86\x87\x93\x94")))])
    return data[:at] + op + data[at + 1:], {"op": "pickle opcode", "at": at, "opcode": op.hex()}


def mutate_pt(rng, data: bytes, others: list[bytes]) -> tuple[bytes, dict]:
    members = _pt_members(data)
    if members is None or rng.random() < .25:
        return mutate_bytes(rng, data)
    op = rng.choice(["member bytes", "pickle", "pickle", "swap", "drop", "deflate", "foreign", "dup"])
    i = int(rng.integers(0, len(members)))
    name, body, method = members[i]
    desc = {"op": f"pt {op}", "member": name}
    if op == "pickle":
        pk = [j for j, m in enumerate(members) if m[0].endswith("data.pkl")]
        if pk:
            i = pk[0]
            name, body, method = members[i]
            body, d = mutate_pickle(rng, body)
            members[i] = (name, body, method)
            desc.update(member=name, **d)
    elif op == "member bytes":
        body, d = mutate_bytes(rng, body)
        members[i] = (name, body, method)
        desc.update(d)
    elif op == "swap" and len(members) > 1:
        j = int(rng.integers(0, len(members)))
        members[i], members[j] = (name, members[j][1], method), (members[j][0], body, members[j][2])
        desc["with"] = members[j][0]
    elif op == "drop":
        del members[i]
    elif op == "deflate":
        members = [(n, b, zipfile.ZIP_DEFLATED) for n, b, _ in members]
    elif op == "foreign" and others:
        other = _pt_members(others[int(rng.integers(0, len(others)))]) or []
        data_members = [m for m in other if "/data/" in m[0]]
        if data_members and "/data/" in name:
            members[i] = (name, data_members[int(rng.integers(0, len(data_members)))][1], method)
            desc["from"] = "another .pt's storage"
    elif op == "dup":
        members.append(members[i])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a duplicated member is meant
            return _pt_bytes(members), desc
    except Exception:  # zipfile refuses some duplicates
        return data, {"op": "pt unchanged"}


def mutate_dir(rng, root: pathlib.Path) -> dict:
    """One mutation of the files under ``root``; its description."""
    files = _files_in(root)
    if not files:
        return {"op": "none"}
    f = files[int(rng.integers(0, len(files)))]
    rel = str(f.relative_to(root))
    r = rng.random()
    if r < .06 and len(files) > 1:  # two files' contents swapped
        g = files[int(rng.integers(0, len(files)))]
        a, b = f.read_bytes(), g.read_bytes()
        f.write_bytes(b)
        g.write_bytes(a)
        return {"file": rel, "op": "swap contents", "with": str(g.relative_to(root))}
    if r < .09:
        f.unlink()
        return {"file": rel, "op": "delete file"}
    if r < .13:  # a copy under another name: the next chunk, or a chunk's own file beside merged ones
        name = f.name
        for a, b in (("doclens.0", "doclens.2"), ("doclens.1", "doclens.2"), ("merged_codes", "0.codes"),
                     ("merged_residuals", "0.residuals"), ("0.", "2."), ("1.", "2.")):
            if name.startswith(a):
                new = f.with_name(b + name[len(a):])
                shutil.copyfile(f, new)
                return {"file": rel, "op": "copy to", "to": new.name}
        return {"file": rel, "op": "none"}
    if r < .16:
        data = f.read_bytes()
        g = files[int(rng.integers(0, len(files)))]
        f.write_bytes(g.read_bytes())
        return {"file": rel, "op": "replace with", "from": str(g.relative_to(root)), "size": len(data)}
    data = f.read_bytes()
    if f.suffix == ".json":
        text, d = mutate_json(rng, data.decode("utf-8", "surrogateescape"))
        f.write_bytes(text.encode("utf-8", "surrogateescape"))
    elif f.suffix == ".npy" and rng.random() < .6:
        new, d = mutate_npy(rng, data)
        f.write_bytes(new)
    elif f.suffix == ".pt":
        others = [g.read_bytes() for g in files if g.suffix == ".pt" and g != f]
        new, d = mutate_pt(rng, data, others)
        f.write_bytes(new)
    else:
        new, d = mutate_bytes(rng, data)
        f.write_bytes(new)
    return {"file": rel, **d}


# --------------------------------------------------------------------------- using an input (in the child)


def use_shard(case: pathlib.Path, args: list[str]) -> str:
    path = str(case / args[0])
    lengths = str(case / args[1]) if len(args) > 1 else None
    s = shards.open_input(path, lengths)
    n, d = s.num_docs, s.dim
    lens = s.doc_lengths()
    assert lens.shape == (n,) and (lens >= 0).all(), "doc_lengths"
    if not s.padded:
        assert s.offsets[0] == 0 and s.offsets[-1] == s.tokens.shape[0], "offsets"
    if s.ids is not None:
        assert s.ids.shape == (n,), "ids"
    seen = 0
    for a, b in s.chunk_ranges(1 << 12):
        t, off = s.read_values(a, b)
        assert t.shape == (int(off[-1]), d) and off.shape == (b - a + 1,), "read_values"
        seen += b - a
    assert seen == n, "chunk_ranges"
    shards.scan_values(s, max_bytes=1 << 14)
    try:
        shards.check_finite(s, max_bytes=1 << 14)
    except ShardError:
        pass
    work = case / "work"
    work.mkdir()
    if n:
        shards.pack(s, work / "packed", max_bytes=1 << 14)
        again = shards.open_shard(work / "packed")
        assert again.num_docs == n and again.dim == d, "pack"
    rng = np.random.default_rng(1)
    q, corpus = work / "q.npy", work / "corpus.npy"
    if d <= 4096:  # (a header may claim any dim for no token at all)
        _npy(q, rng.standard_normal((2, 3, d)).astype(np.float32))
        _npy(corpus, rng.standard_normal((3, 4, d)).astype(np.float16))
    outcome = []
    combos = [(path, lengths, [path], [lengths] if lengths else [])]
    if d <= 4096:
        combos += [(str(q), None, [path], [lengths] if lengths else []), (path, lengths, [str(corpus)], [])]
    outs = [("out.tsv", {}), ("out.jsonl", {"top_k": 100}), ("out.npy", {"full_matrix": True})]
    for j, (queries, ql, docs, dl) in enumerate(combos):
        out, kw = outs[j % len(outs)]
        if j == 0 and lengths is None:  # the input twice in one corpus
            docs = docs * 2
        try:
            lik_cli.run_score(queries, docs, str(work / out), q_lengths=ql, d_lengths=dl, cpu=True,
                              **{"top_k": 3, **kw})
            outcome.append("scored")
        except LikError as e:
            if "rejected" in str(e):  # the library refused what the reader accepted
                raise AssertionError(f"library refused an opened input: {e}") from None
            outcome.append("LikError")
    if lengths is None:  # a shard directory or a padded array: a Corpus too
        try:
            c = Corpus.from_shards([path])
        except ShardError:
            raise
        except ValueError as e:  # the Corpus refusing what the reader accepted
            raise AssertionError(f"Corpus.from_shards refused an opened input: {e}") from None
        if len(c) and d <= 4096:
            q32 = rng.standard_normal((2, 3, d)).astype(np.float32)
            c.search(q32 if c.dtype in ("float32", "int8") else q32.astype(shards.fmt.numpy_dtype(c.dtype)),
                     min(3, len(c)))
    return f"opened: {n} docs, d {d}; score {outcome}"


def use_plaid(case: pathlib.Path, args: list[str]) -> str:
    idx = PlaidIndex.open(case / args[0])
    repr(idx)
    t, c = idx.codes.shape[0], idx.centroids.shape[0]
    off = idx.offsets
    assert off[0] == 0 and off[-1] == t and (np.diff(off) >= 0).all(), "offsets"
    assert idx.residual_bits.shape == (t, idx.dim * idx.nbits // 8) and idx.residual_bits.dtype == np.uint8, "bits"
    assert t == 0 or (0 <= idx.codes.min() and idx.codes.max() < c), "codes"
    assert np.isfinite(idx.centroids).all() and np.isfinite(idx.bucket_weights).all(), "codec"
    n = len(idx)
    rng = np.random.default_rng(2)
    Q = rng.standard_normal((2, 3, idx.dim)).astype(np.float32)  # (a centroid holds each of its dim)
    if n:
        cand = np.array([[0, n - 1, n // 2], [n - 1, 0, 0]])
        s, a = idx.rerank(Q, cand, return_argmax=True, backend="cpu")
        assert s.shape == (2, 3) and a.shape == (2, 3, 3), "rerank"
        idx.embeddings([0, n - 1])
        idx.residuals([n // 2])
    every = maxsim_residual_varlen(Q, idx.codes, idx.residual_bits, idx.offsets, idx.centroids,
                                   idx.bucket_weights, idx.nbits, backend="cpu")
    assert every.shape == (2, n), "every document"
    return f"opened: {n} docs, {t} tokens, dim {idx.dim}, nbits {idx.nbits}"


def child(case: pathlib.Path, kind: str, args: list[str], mem_bytes: int, wfd: int) -> None:
    """Run in the forked child: use the input, write one JSON line to ``wfd``, exit."""
    code = 0
    try:
        resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        sys.stderr = open(case / "stderr.txt", "w")
        caught = warnings.catch_warnings(record=True)
        seen = caught.__enter__()
        warnings.simplefilter("always")
        try:
            what = (use_shard if kind == "shard" else use_plaid)(case, args)
            out = {"outcome": "ok", "detail": what}
        except (ShardError, LikError) as e:
            out = {"outcome": type(e).__name__, "detail": str(e)[:400]}
        except BaseException as e:
            out = {"outcome": type(e).__name__, "detail": str(e)[:400],
                   "traceback": traceback.format_exc()[-3000:]}
        if seen:  # what a user would see on stderr besides the one line of an error
            out["warnings"] = sorted({f"{w.category.__name__}: {w.message}"[:200] for w in seen})
        os.write(wfd, (json.dumps(out) + "\n").encode())
    except BaseException:
        code = 3
    finally:
        os._exit(code)


def run_case(case: pathlib.Path, kind: str, args: list[str], mem_bytes: int, timeout: float) -> dict:
    """Fork a child that uses the input at ``case``; its result, or how it ended."""
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        child(case, kind, args, mem_bytes, w)
    os.close(w)
    start, buf, status = time.monotonic(), b"", None
    while True:
        left = timeout - (time.monotonic() - start)
        if left <= 0:
            os.kill(pid, signal.SIGKILL)
            os.wait4(pid, 0)
            os.close(r)
            return {"outcome": "timeout", "detail": f"still running after {timeout} s", "seconds": timeout}
        ready, _, _ = select.select([r], [], [], min(left, 0.5))
        if ready:
            chunk = os.read(r, 1 << 16)
            if chunk:
                buf += chunk
                continue
            break  # the child closed its end: it is exiting
    _, status, usage = os.wait4(pid, 0)
    os.close(r)
    seconds = round(time.monotonic() - start, 3)
    rss = usage.ru_maxrss << 10  # (KiB on Linux)
    if os.WIFSIGNALED(status):
        return {"outcome": "signal", "detail": signal.Signals(os.WTERMSIG(status)).name, "seconds": seconds,
                "rss": rss}
    try:
        res = json.loads(buf.decode())
    except ValueError:
        return {"outcome": "died", "detail": f"exit status {os.WEXITSTATUS(status)}, no result", "seconds": seconds}
    res.update(seconds=seconds, rss=rss)
    return res


DOCUMENTED = ("ok", "ShardError", "LikError")
# Warnings reading a file may not print on stderr (the CLI's error is one line); a RuntimeWarning of
# NaN values scored, or NumPy's advice on a header written by Python 2, is reported, not a finding.
WARNING_FINDINGS = ("SyntaxWarning", "DeprecationWarning", "FutureWarning")
# What a case may take beyond its unmutated base's run before it counts as excess: peak memory of at
# most this many times its files' bytes plus a slack, and time.
MEMORY_PER_INPUT_BYTE = 32
MEMORY_SLACK = 96 << 20
SLOW_FACTOR, SLOW_SLACK = 10, 3.0


def _input_bytes(case: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in case.rglob("*") if p.is_file() and not p.is_symlink()
               and "work" not in p.relative_to(case).parts)


def judge(res: dict, base: dict, case: pathlib.Path) -> dict:
    """``res`` with "excess" set where it took much more memory or time than its base's run."""
    size = _input_bytes(case)
    if res.get("rss", 0) > base["rss"] + MEMORY_PER_INPUT_BYTE * size + MEMORY_SLACK:
        res["excess"] = f"peak RSS {res['rss'] >> 20} MiB (base {base['rss'] >> 20} MiB) for {size} bytes of files"
    elif res.get("seconds", 0) > SLOW_FACTOR * base["seconds"] + SLOW_SLACK and res["outcome"] != "timeout":
        res["excess"] = f"{res['seconds']} s (base {base['seconds']} s)"
    return res


def iteration(seed: int, i: int, bases: dict, work: pathlib.Path) -> tuple[pathlib.Path, dict, list[dict]]:
    """Iteration ``i`` of ``seed``: the case directory, its base and its mutations (deterministic)."""
    rng = np.random.default_rng([seed, i])
    names = sorted(bases)
    name = names[int(rng.integers(0, len(names)))]
    base = bases[name]
    case = work / f"case{i}"
    if case.exists():
        shutil.rmtree(case)
    shutil.copytree(base["dir"], case, symlinks=True)
    for p in case.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    mutations = [mutate_dir(rng, case) for _ in range(int(rng.choice([1, 1, 1, 2, 3])))]
    return case, {"name": name, **base}, mutations


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("seed", type=int)
    ap.add_argument("seconds", type=float, nargs="?", default=60.0)
    ap.add_argument("--mem-mb", type=int, default=2048)
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--work", default=None)
    ap.add_argument("--replay", type=int, default=None, help="run iteration N of SEED again and print its result")
    a = ap.parse_args()
    if not sys.platform.startswith("linux"):
        print("file_fuzz.py needs Linux (fork, RLIMIT_AS)", file=sys.stderr)
        return 2
    work = pathlib.Path(a.work or f"/tmp/lik-filefuzz-{a.seed}")
    bases_root = work / "bases"
    if bases_root.exists():
        shutil.rmtree(bases_root)
    bases_root.mkdir(parents=True)
    (work / "bases.json").unlink(missing_ok=True)
    # the valid inputs are written in a child too, so that this process forks with no pools of threads
    pid = os.fork()
    if pid == 0:
        try:
            (work / "bases.json").write_text(json.dumps(build_bases(bases_root)))
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    bases = json.loads((work / "bases.json").read_text())
    mem = a.mem_mb << 20
    baseline = {}
    for name, base in bases.items():  # each must open and score as it is
        res = run_case(pathlib.Path(base["dir"]), base["kind"], base["args"], mem, a.timeout)
        shutil.rmtree(pathlib.Path(base["dir"]) / "work", ignore_errors=True)  # what the run left: no input
        (pathlib.Path(base["dir"]) / "stderr.txt").unlink(missing_ok=True)
        if res["outcome"] != "ok":
            print(f"base {name} does not open: {res}", file=sys.stderr)
            return 2
        baseline[name] = res
    if a.replay is not None:
        case, base, muts = iteration(a.seed, a.replay, bases, work)
        res = judge(run_case(case, base["kind"], base["args"], mem, a.timeout), baseline[base["name"]], case)
        print(json.dumps({"iteration": a.replay, "base": base["name"], "mutations": muts, "result": res,
                          "case": str(case)}, indent=1))
        return 0
    findings, counts, worst, warned, i = [], {}, {}, {}, 0
    end = time.monotonic() + a.seconds
    while time.monotonic() < end:
        case, base, muts = iteration(a.seed, i, bases, work)
        res = judge(run_case(case, base["kind"], base["args"], mem, a.timeout), baseline[base["name"]], case)
        key = res["outcome"]
        counts[key] = counts.get(key, 0) + 1
        w = worst.setdefault(base["name"], {"rss_over_base_mib": 0, "seconds": 0.0, "iteration": {}})
        for k, v in (("rss_over_base_mib", (res.get("rss", 0) - baseline[base["name"]]["rss"]) >> 20),
                     ("seconds", res.get("seconds", 0))):
            if v > w[k]:
                w[k], w["iteration"][k] = v, i
        for w in res.get("warnings", ()):
            warned.setdefault(w, i)
        loud = [w for w in res.get("warnings", ()) if w.startswith(WARNING_FINDINGS)]
        if key not in DOCUMENTED or res.get("excess") or loud:
            f = {"iteration": i, "base": base["name"], "mutations": muts, "result": res, "case": str(case)}
            findings.append(f)
            print("FINDING", json.dumps(f)[:3000], flush=True)
        else:
            shutil.rmtree(case)
        i += 1
    (work / "findings.json").write_text(json.dumps(findings, indent=1))
    print(json.dumps({"seed": a.seed, "iterations": i, "outcomes": counts, "findings": len(findings),
                      "work": str(work), "worst": worst, "warnings": warned,
                      "baseline": {k: {"rss_mib": v["rss"] >> 20, "seconds": v["seconds"]}
                                   for k, v in baseline.items()}}, indent=1))
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
