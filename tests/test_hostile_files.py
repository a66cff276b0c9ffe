"""Every reader of index and shard files treats them as hostile (issue 44; docs/reliability.md,
"Hostile input", maps each promise to its test here). CPU only, no torch needed.

Each case opens a file or directory in a child process under a 1 GiB address-space limit and a
time limit, so that an out-of-bounds read that crashes, a FIFO that blocks or a claimed size that
allocates fails the test instead of the runner. A case either opens with the right contents or
raises ``ShardError`` naming a file of the index (nothing else: no KeyError, RecursionError,
MemoryError, ...). The fuzz starts from the fast-plaid indexes in ``tests/data/fast_plaid/`` and
from ColBERTv2, PyLate and lik-shard layouts written here, and mutates them deterministically
(truncation, resized and re-strided shapes, swapped dtypes, deep pickles and JSON, special files).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import struct
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from lik_cupy import _files, shards
from lik_command import child_pythonpath

REPO = pathlib.Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "data" / "fast_plaid" / "fast_plaid_nbits2"
ADDRESS_SPACE = 1 << 30
SECONDS = 50

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(os, "mkfifo"),
                                reason="Linux limits and FIFOs")

# The child: opens each case, prints one JSON line per case (a digest of what it read, or the error).
WORKER = r"""
import hashlib, json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
import numpy as np
from lik_cupy import PlaidIndex, shards
from lik_cupy._plaid_files import read_torch_file
from lik_cupy.errors import ShardError

def digest(*arrays):
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(repr((a.shape, a.dtype.str)).encode())
        h.update(a.tobytes())
    return h.hexdigest()

def plaid(path):
    idx = PlaidIndex.open(path)
    t, c = idx.codes.shape[0], idx.centroids.shape[0]
    off = idx.offsets
    assert off[0] == 0 and off[-1] == t and (np.diff(off) >= 0).all()
    assert idx.residual_bits.shape == (t, idx.dim * idx.nbits // 8) and idx.residual_bits.dtype == np.uint8
    assert t == 0 or (0 <= idx.codes.min() and idx.codes.max() < c)
    assert np.isfinite(idx.centroids).all() and np.isfinite(idx.bucket_weights).all()
    if len(idx):
        s = idx.rerank(np.ones((1, 3, idx.dim), np.float16) / idx.dim ** 0.5, [[0, len(idx) - 1]], backend="cpu")
        assert s.shape == (1, 2) and s.dtype == np.float32
    return digest(idx.codes.astype(np.int64), idx.residual_bits, off, idx.centroids, idx.bucket_weights,
                  np.array([idx.nbits]))

def shard(path, lengths=None):
    s = shards.open_input(path, lengths)
    parts = [s.doc_lengths()]
    for a, b in s.chunk_ranges(1 << 12):
        parts += list(s.read_values(a, b))
    if s.ids is not None:
        parts.append(np.asarray(s.ids))
    return digest(*parts)

def torch_file(path):
    out, todo = [], [read_torch_file(path)]
    while todo:
        v = todo.pop()
        if isinstance(v, (tuple, list)):
            todo += list(v)
        elif isinstance(v, dict):
            todo += list(v.values())
        else:
            out.append(np.asarray(v))
    return digest(*out)

for name, kind, args in json.loads(sys.argv[1]):
    print(json.dumps({"start": name}), flush=True)
    try:
        out = {"case": name, "outcome": "ok", "digest": {"plaid": plaid, "shard": shard, "pt": torch_file}[kind](*args)}
    except ShardError as e:
        out = {"case": name, "outcome": "ShardError", "path": e.path, "message": str(e)}
    except BaseException as e:
        out = {"case": name, "outcome": type(e).__name__, "message": str(e)[:300]}
    print(json.dumps(out), flush=True)
""".replace("ADDRESS_SPACE", str(ADDRESS_SPACE))


def open_in_child(cases: list[tuple[str, str, list[str]]]) -> dict[str, dict]:
    """Run ``(name, kind, args)`` cases in one child; {name: its result}. A crash, a hang or a
    child that exits early fails the test naming the case it was in."""
    env = dict(os.environ, PYTHONPATH=child_pythonpath(), PYTHONDONTWRITEBYTECODE="1", OPENBLAS_NUM_THREADS="1",
               OMP_NUM_THREADS="1")
    try:
        p = subprocess.run([sys.executable, "-c", WORKER, json.dumps(cases)], env=env, cwd=REPO,
                           capture_output=True, text=True, timeout=SECONDS)
        out, err, code = p.stdout, p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out, err, code = (e.stdout or b"").decode(), (e.stderr or b"").decode(), "timeout"
    results, started = {}, None
    for line in out.splitlines():
        r = json.loads(line)
        if "start" in r:
            started = r["start"]
        else:
            results[r["case"]] = r
            started = None
    if started is not None or code != 0:
        pytest.fail(f"case {started!r} ended the child ({code}): {err[-2000:]}")
    return results


def check(results: dict[str, dict], expect: dict[str, str], root, original: str | None = None) -> None:
    """Each case's outcome against ``expect``: "error" (a ShardError naming a file under ``root``),
    "same" (opens with the digest ``original``) or "any" (one or the other, or opens with other
    contents that the child checked for consistency)."""
    bad = []
    for name, want in expect.items():
        r = results[name]
        if r["outcome"] == "ShardError":
            inside = os.path.realpath(r["path"]).startswith(os.path.realpath(root)) or r["path"].startswith(str(root))
            if want == "same" or not inside:
                bad.append(f"{name}: {r['message']}")
        elif r["outcome"] == "ok":
            if want == "error" or (want == "same" and r["digest"] != original):
                bad.append(f"{name}: opened ({'same' if r['digest'] == original else 'other'} contents)")
        else:
            bad.append(f"{name}: {r['outcome']}: {r['message']}")
    assert not bad, "\n".join(bad)


# --------------------------------------------------------------------------- .npy and .pt files, by hand


def npy_bytes(arr: np.ndarray, *, shape=None, descr=None, fortran=False) -> bytes:
    """A version 1.0 .npy file whose header may say another shape or dtype than its data has."""
    header = repr({"descr": descr or np.lib.format.dtype_to_descr(arr.dtype), "fortran_order": fortran,
                   "shape": tuple(arr.shape if shape is None else shape)}).encode("latin-1")
    header += b" " * (-(10 + len(header) + 1) % 64) + b"\n"
    return (b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header
            + np.ascontiguousarray(arr).tobytes())


def _int(n: int) -> bytes:
    if 0 <= n < 256:
        return b"K" + bytes([n])
    if -2**31 <= n < 2**31:
        return b"J" + struct.pack("<i", n)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _str(s: str) -> bytes:
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _tuple(items: list[bytes]) -> bytes:
    return b"(" + b"".join(items) + b"t"


STORAGE_TYPES = {np.dtype(np.float16): "HalfStorage", np.dtype(np.float32): "FloatStorage",
                 np.dtype(np.int32): "IntStorage", np.dtype(np.int64): "LongStorage", np.dtype(np.uint8): "ByteStorage"}


def tensor_pickle(key: str, storage_type: str, numel: int, offset: int, size, stride) -> bytes:
    """The opcodes torch.save writes for one tensor (protocol 2), fields as given."""
    pid = _tuple([_str("storage"), b"ctorch\n" + storage_type.encode() + b"\n", _str(key), _str("cpu"), _int(numel)])
    args = _tuple([pid + b"Q", _int(offset), _tuple([_int(n) for n in size]), _tuple([_int(n) for n in stride]),
                   b"\x89", b"ccollections\nOrderedDict\n)R"])
    return b"ctorch._utils\n_rebuild_tensor_v2\n" + args + b"R"


def tensor(arr: np.ndarray, key: str = "0", **override) -> tuple[bytes, dict[str, bytes]]:
    """(pickle of ``arr`` as torch.save writes it, {storage key: its bytes}); ``override`` replaces
    numel, offset, size, stride, storage_type or the storage's bytes."""
    arr = np.ascontiguousarray(arr)
    fields = {"numel": arr.size, "offset": 0, "size": arr.shape,
              "stride": tuple(s // arr.itemsize for s in arr.strides), "storage_type": STORAGE_TYPES[arr.dtype],
              "data": arr.tobytes()}
    fields.update(override)
    data = fields.pop("data")
    return tensor_pickle(key, **fields), {key: data}


def pt_bytes(body: bytes, storages: dict[str, bytes], compress: int = zipfile.ZIP_STORED,
             pickle: bytes | None = None) -> bytes:
    """A torch.save zip archive of pickled ``body`` (a tuple's opcodes, or one tensor's)."""
    import io

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compress) as z:
        z.writestr("archive/data.pkl", b"\x80\x02" + body + b"." if pickle is None else pickle)
        z.writestr("archive/version", b"3\n")
        z.writestr("archive/byteorder", b"little")
        for key, data in storages.items():
            z.writestr(f"archive/data/{key}", data)
    return buf.getvalue()


def save_pt(path, *arrays: np.ndarray, **override) -> None:
    """``arrays`` as torch.save writes one tensor (or a tuple of them), the first one's fields overridden."""
    parts = [tensor(a, str(i), **(override if i == 0 else {})) for i, a in enumerate(arrays)]
    body = parts[0][0] if len(parts) == 1 else _tuple([p for p, _ in parts])
    pathlib.Path(path).write_bytes(pt_bytes(body, {k: v for _, s in parts for k, v in s.items()}))


def deep_pickle(depth: int) -> bytes:
    """A list nested ``depth`` deep: no recursion may read it."""
    return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."


# --------------------------------------------------------------------------- the layouts


def fixture_arrays():
    """The fast-plaid fixture's codec, codes, residual bits and doclens (chunk 0 only)."""
    load = lambda n: np.load(FIXTURE / n)  # noqa: E731
    lens = json.loads((FIXTURE / "doclens.0.json").read_text())
    t = sum(lens)
    return (load("centroids.npy"), load("bucket_weights.npy"), load("merged_codes.npy")[:t],
            load("merged_residuals.npy")[:t], lens)


def write_colbert(path: pathlib.Path, chunks: int = 2) -> None:
    """The fixture's index in ColBERTv2's layout (.pt files), cut into ``chunks`` chunks."""
    cen, w, codes, bits, lens = fixture_arrays()
    path.mkdir()
    save_pt(path / "centroids.pt", cen)
    save_pt(path / "buckets.pt", np.zeros(3, np.float32), w)
    (path / "metadata.json").write_text(json.dumps({"config": {"dim": 128, "nbits": 2}, "num_chunks": chunks}))
    cuts = np.linspace(0, len(lens), chunks + 1).astype(int)
    off = np.concatenate([[0], np.cumsum(lens)])
    for i in range(chunks):
        a, b = off[cuts[i]], off[cuts[i + 1]]
        save_pt(path / f"{i}.codes.pt", codes[a:b].astype(np.int32))
        save_pt(path / f"{i}.residuals.pt", bits[a:b])
        (path / f"doclens.{i}.json").write_text(json.dumps(lens[cuts[i]:cuts[i + 1]]))


def write_pylate(path: pathlib.Path) -> None:
    """PyLate's PLAID directory: a fast-plaid index in fast_plaid_index/ beside pickled id maps,
    which must never be loaded (this one would run code)."""
    path.mkdir()
    shutil.copytree(FIXTURE, path / "fast_plaid_index")
    (path / "documents_ids_to_plaid_ids.pkl").write_bytes(b"cos\nsystem\n(S'exit 3'\ntR.")


def with_original(cases: list, kind: str, *args) -> tuple[dict[str, dict], str]:
    """Run ``cases`` in one child after the unmutated input: (their results, its digest)."""
    results = open_in_child([("original", kind, list(map(str, args))), *cases])
    assert results["original"]["outcome"] == "ok", results["original"]
    return results, results["original"]["digest"]


# --------------------------------------------------------------------------- the repros of issue 44


def test_storage_of_one_byte_viewed_as_4096_elements_is_refused(tmp_path):
    # It returned 4,095 bytes of process heap, pointers included.
    save_pt(tmp_path / "x.pt", np.frombuffer(b"A", np.uint8), size=(4096,), stride=(1,))
    r = open_in_child([("heap", "pt", [str(tmp_path / "x.pt")])])["heap"]
    assert r["outcome"] == "ShardError" and "reaches element 4095 of a storage of 1 elements" in r["message"], r


def test_stride_past_the_storage_is_refused(tmp_path):
    # It was a segfault.
    save_pt(tmp_path / "x.pt", np.arange(2, dtype=np.uint8), size=(2,), stride=(100000,))
    r = open_in_child([("stride", "pt", [str(tmp_path / "x.pt")])])["stride"]
    assert r["outcome"] == "ShardError" and "reaches element 100000 of a storage of 2" in r["message"], r


def test_centroids_pt_striding_past_its_storage_does_not_kill_plaid_index_open(tmp_path):
    # PlaidIndex.open died of signal 11.
    write_colbert(tmp_path / "idx")
    cen = np.load(FIXTURE / "centroids.npy")[:32, :16]
    save_pt(tmp_path / "idx" / "centroids.pt", cen, size=(32, 16), stride=(100000, 1))
    r = open_in_child([("centroids", "plaid", [str(tmp_path / "idx")])])["centroids"]
    assert r["outcome"] == "ShardError" and r["path"] == str(tmp_path / "idx" / "centroids.pt"), r
    assert "reaches element 3100015 of a storage of 512 elements" in r["message"], r


def test_residuals_pt_larger_than_its_storage_is_refused(tmp_path):
    # It opened, and rerank scored heap bytes with exit 0.
    write_colbert(tmp_path / "idx", chunks=1)
    lens = json.loads((FIXTURE / "doclens.0.json").read_text())
    (tmp_path / "idx" / "doclens.0.json").write_text(json.dumps(lens[:3]))  # 54 tokens
    save_pt(tmp_path / "idx" / "0.codes.pt", np.zeros(sum(lens[:3]), np.int32))
    save_pt(tmp_path / "idx" / "0.residuals.pt", np.zeros(1, np.uint8), size=(54, 4), stride=(4, 1))
    r = open_in_child([("residuals", "plaid", [str(tmp_path / "idx")])])["residuals"]
    assert r["outcome"] == "ShardError" and r["path"] == str(tmp_path / "idx" / "0.residuals.pt"), r


# --------------------------------------------------------------------------- the torch reader's own limits


def test_hand_written_pt_files_are_what_torch_reads(tmp_path):
    # The fuzz's .pt writer writes what torch.save does: torch itself reads it back.
    torch = pytest.importorskip("torch")
    a, b = np.arange(12, dtype=np.float32).reshape(3, 4), np.arange(5, dtype=np.int64)
    save_pt(tmp_path / "pair.pt", a, b)
    got = torch.load(tmp_path / "pair.pt", weights_only=True)
    assert np.array_equal(got[0].numpy(), a) and np.array_equal(got[1].numpy(), b)


def test_torch_reader_reads_views_and_compressed_members(tmp_path):
    from lik_cupy._plaid_files import read_torch_file

    base = np.arange(20, dtype=np.int64)
    save_pt(tmp_path / "view.pt", base, numel=20, offset=5, size=(3, 2), stride=(4, 3))
    np.testing.assert_array_equal(read_torch_file(str(tmp_path / "view.pt")), [[5, 8], [9, 12], [13, 16]])
    body, st = tensor(base)
    (tmp_path / "zip.pt").write_bytes(pt_bytes(body, st, zipfile.ZIP_DEFLATED))
    np.testing.assert_array_equal(read_torch_file(str(tmp_path / "zip.pt")), base)


def test_torch_reader_reads_a_deep_pickle_without_recursion(tmp_path):
    (tmp_path / "deep.pt").write_bytes(pt_bytes(b"", {}, pickle=deep_pickle(200_000)))
    r = open_in_child([("deep", "pt", [str(tmp_path / "deep.pt")])])["deep"]
    assert r["outcome"] == "ok", r


def test_torch_reader_refuses_hostile_archives(tmp_path):
    arr = np.arange(8, dtype=np.int32)
    body, st = tensor(arr)
    data = {
        "bomb": lambda: pt_bytes(body, {"0": bytes(1 << 24)}, zipfile.ZIP_DEFLATED),
        "deep key": lambda: pt_bytes(b"", {}, pickle=b"\x80\x02}" + b")" + b"\x85" * 100_000 + b"K\x01s."),
        "big pickle": lambda: pt_bytes(b"", {}, pickle=b"\x80\x02" + b"N0" * (1 << 20) + b"N."),
        "forged storage type": lambda: pt_bytes(body.replace(b"ctorch\nIntStorage\n", _tuple(
            [_str("storage-type"), _str("O")])), st),
        "no storage": lambda: pt_bytes(body, {}),
        "truncated storage": lambda: pt_bytes(body, {"0": arr.tobytes()[:-1]}),
        "overlapping strides": lambda: pt_bytes(tensor(arr, size=(1000, 8), stride=(0, 1))[0], st),
        "negative stride": lambda: pt_bytes(tensor(arr, offset=7, size=(8,), stride=(-1,))[0], st),
        "negative offset": lambda: pt_bytes(tensor(arr, offset=-4)[0], st),
        "huge size": lambda: pt_bytes(tensor(arr, size=(2**62, 2**62), stride=(0, 0))[0], st),
        "rank 65": lambda: pt_bytes(tensor(arr, size=(1,) * 65, stride=(1,) * 65)[0], st),
        "rank 100000": lambda: pt_bytes(tensor(arr, size=(2,) * 100_000, stride=(0,) * 100_000)[0], st),
        "float size": lambda: pt_bytes(tensor(arr)[0].replace(b"(K\x08t", b"(G" + struct.pack(">d", 8.0) + b"t"), st),
        "not a zip": lambda: b"\x80\x02N.",
        # a view 10 long over element 9 alone, then a tensor over that view as if it were contiguous
        "tensor over a tensor": lambda: pt_bytes(b"ctorch._utils\n_rebuild_tensor_v2\n" + _tuple(
            [tensor_pickle("0", "IntStorage", 8, 7, (8,), (0,)), _int(0), _tuple([_int(8)]), _tuple([_int(1)]),
             b"\x89", b"ccollections\nOrderedDict\n)R"]) + b"R", st),
    }
    for case, make in data.items():
        (tmp_path / f"{case}.pt").write_bytes(make())
    for what in SPECIALS:
        special(tmp_path / f"{what}.pt", what)
    results = open_in_child([(name, "pt", [str(tmp_path / f"{name}.pt")]) for name in [*data, *SPECIALS]])
    check(results, dict.fromkeys(results, "error"), tmp_path)
    why = {"bomb": "more than 64 times", "deep key": "a dict key is a tuple", "big pickle": "expected at most 1048576",
           "forged storage type": "expected a storage", "no storage": "no member 'archive/data/0'",
           "truncated storage": "holds 31 bytes, not the 32", "overlapping strides": "claims 8000 elements",
           "negative stride": "negative", "negative offset": "negative", "huge size": "more than 2**63 bytes",
           "rank 65": "at most 64", "rank 100000": "at most 64", "float size": "not integers",
           "not a zip": "not a torch zip archive", "fifo": "is a FIFO", "dev zero": "is a character device",
           "directory": "is a directory", "dangling": "no such file",
           "tensor over a tensor": "storage is a ndarray, not a storage"}
    assert not [n for n, r in results.items() if why[n] not in r["message"]], results


@pytest.mark.parametrize("method", [zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA],
                         ids=["deflated", "bzip2", "lzma"])
def test_a_member_claiming_fewer_bytes_than_it_expands_to_is_not_expanded(tmp_path, method):
    # A storage whose header claims 32 bytes but whose stream expands to 64 MiB: zipfile's read()
    # expanded the whole stream before the sizes were compared (a 900-byte bzip2 file took 557 MiB,
    # MemoryError under a 1 GiB limit). Now no more than the claimed bytes are expanded, and only
    # stored or deflated members (what torch.save and zip tools write) are read.
    import io
    import tracemalloc

    from lik_cupy._plaid_files import read_torch_file

    arr = np.arange(8, dtype=np.int32)
    body, _ = tensor(arr)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", method) as z:
        z.writestr("archive/data.pkl", b"\x80\x02" + body + b".", zipfile.ZIP_STORED)
        z.writestr("archive/byteorder", b"little", zipfile.ZIP_STORED)
        with z.open("archive/data/0", "w") as w:
            w.write(arr.tobytes())
            for _ in range(64):
                w.write(bytes(1 << 20))
    raw = bytearray(buf.getvalue())
    name = b"archive/data/0"
    at = raw.find(b"PK\x01\x02")
    while raw[at + 46:at + 46 + len(name)] != name:  # its central directory entry
        at = raw.find(b"PK\x01\x02", at + 1)
    raw[at + 24:at + 28] = struct.pack("<I", arr.nbytes)  # the uncompressed size it claims
    (tmp_path / "x.pt").write_bytes(bytes(raw))
    tracemalloc.start()
    try:
        with pytest.raises(shards.ShardError, match="x.pt: (corrupt zip archive|member 'archive/data/0' is "
                                                    "compressed with method)"):
            read_torch_file(str(tmp_path / "x.pt"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak


def overlapping_members(n: int, shared: int) -> bytes:
    """A torch archive whose ``n`` storages (one byte each, by the pickle) are stored members that
    overlap: member i's data is every later member's local header and a ``shared`` byte tail, each
    with its right CRC, so zipfile reads each whole (a zip bomb of overlapping files)."""
    import zlib

    def local(name, crc, size):
        return struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 0, crc, size, size, len(name), 0) + name

    keys = [str(i) for i in range(n)]
    body = _tuple([tensor_pickle(k, "ByteStorage", 1, 0, (1,), (1,)) for k in keys])
    out, members = bytearray(), []
    for name, data in ((b"archive/data.pkl", b"\x80\x02" + body + b"."), (b"archive/byteorder", b"little")):
        members.append((name, len(out), zlib.crc32(data), len(data)))
        out += local(name, zlib.crc32(data), len(data)) + data
    names = [f"archive/data/{k}".encode() for k in keys]
    at = [len(out)]
    for name in names:
        at.append(at[-1] + 30 + len(name))
    tail = bytearray(shared)
    for i in range(n - 1, -1, -1):
        members.append((names[i], at[i], zlib.crc32(tail), len(tail)))
        tail[0:0] = local(names[i], zlib.crc32(tail), len(tail))
    out += tail
    cd = b"".join(struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 0, 0, 0, crc, size, size, len(name), 0, 0, 0,
                              0, 0, offset) + name for name, offset, crc, size in members)
    return bytes(out + cd + struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(members), len(members), len(cd),
                                        len(out), 0))


def test_overlapping_members_are_not_read_more_than_once(tmp_path):
    # Stored members whose data overlap (each one's bytes run over every later member to a shared
    # tail) were each read whole: a 1.1 MiB file of 4,000 such storages took more than 1 GiB
    # (MemoryError under the children's limit). Members of one archive hold disjoint bytes, so
    # together they claim no more than the file; one that would pass that is refused unread.
    import tracemalloc

    from lik_cupy._plaid_files import read_torch_file

    raw = overlapping_members(512, 256 << 10)
    (tmp_path / "x.pt").write_bytes(raw)
    tracemalloc.start()
    try:
        with pytest.raises(shards.ShardError, match="x.pt: .*more bytes than the file holds") as e:
            read_torch_file(str(tmp_path / "x.pt"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "overlap" in str(e.value), str(e.value)
    assert peak < 4 * len(raw), (peak, len(raw))


def zip_directory(names: list[bytes], *, entries: int | None = None, size: int | None = None,
                  offset: int | None = None, zip64: bool = True, locator_at: int | None = None) -> bytes:
    """A zip archive of central directory entries for ``names`` alone (zipfile reads only the
    directory when it opens an archive), its end records as torch.save writes them (zip64 ones
    before the plain one), each field they claim overridable."""
    cd = b"".join(struct.pack("<4s4B4HL2L5H2L", b"PK\x01\x02", 20, 3, 20, 0, 0, 0, 0, 0, 0, 0, 0, len(n), 0, 0,
                              0, 0, 0, 0) + n for n in names)
    n, size_, offset_ = len(names) if entries is None else entries, len(cd) if size is None else size, offset or 0
    tail = b""
    if zip64:
        tail = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, n, n, size_, offset_)
        tail += struct.pack("<4sLQL", b"PK\x06\x07", 0, len(cd) if locator_at is None else locator_at, 1)
        n, size_, offset_ = 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF
    return cd + tail + struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, min(n, 0xFFFF), min(n, 0xFFFF),
                                   min(size_, 0xFFFFFFFF), min(offset_, 0xFFFFFFFF), 0)


def test_a_zip_directory_of_many_entries_is_refused_before_zipfile_reads_it(tmp_path):
    # zipfile makes a ZipInfo of every central directory entry before anything can be checked: a
    # 19 MiB .pt of 400,000 tiny entries took 177 MiB (9.1 times the file) and 14 s to refuse.
    # The end records and the directory are checked first: at most 4,096 entries in 4 MiB.
    import time
    import tracemalloc

    from lik_cupy._plaid_files import read_torch_file

    names = [b"%x" % i for i in range(400_000)]
    cases = {
        "honest count": (zip_directory(names), "its zip directory claims 400000 members"),
        "plain end record": (zip_directory(names, zip64=False), "its zip directory claims 65535 members"),
        "count of 8": (zip_directory(names, entries=8), "its zip central directory claims 20"),
        "count of 8 in 4 MiB": (zip_directory(names[:75_000], entries=8),
                                "holds more than the 8 members its end record counts"),
    }
    for case, (raw, why) in cases.items():
        (tmp_path / "x.pt").write_bytes(raw)
        tracemalloc.start()
        t = time.perf_counter()
        try:
            with pytest.raises(shards.ShardError, match="x.pt: ") as e:
                read_torch_file(str(tmp_path / "x.pt"))
            seconds, peak = time.perf_counter() - t, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert why in str(e.value), (case, str(e.value))
        # the file is 4 to 20 MiB; the directory read is 4 MiB at most, and no entry becomes an object
        assert peak < (5 << 20 if "4 MiB" in case else 1 << 20), (case, peak)
        assert seconds < 2, (case, seconds)


def test_zip_end_records_that_do_not_fit_the_file_are_refused(tmp_path):
    from lik_cupy._plaid_files import read_torch_file

    names = [b"archive/data.pkl", b"archive/byteorder", b"archive/data/0"]
    raw = zip_directory(names)
    cases = {
        "count 2**63": (zip_directory(names, entries=2**63), "claims 9223372036854775808 members"),
        "4097 entries": (zip_directory([b"%d" % i for i in range(4097)]), "claims 4097 members"),
        "size 2**64 - 1": (zip_directory(names, size=2**64 - 1), "claims 18446744073709551615 bytes"),
        "offset 2**63": (zip_directory(names, offset=2**63), "at byte 9223372036854775808, 185 bytes) does not end"),
        "offset past the directory": (zip_directory(names, offset=1), "does not end where its end record begins"),
        "size short of the directory": (zip_directory(names, size=90), "does not end where its end record begins"),
        "plain offset 2**32 - 1": (zip_directory(names, zip64=False, offset=2**32 - 1), "does not end where"),
        "count of 4": (zip_directory(names, entries=4), "3 entries fill 185 bytes; its end record says 4 entries"),
        "locator elsewhere": (zip_directory(names, locator_at=0), "zip64 end record locator points at byte 0"),
        "locator past the end": (zip_directory(names, locator_at=2**64 - 1), "locator points at byte 18446744073709"),
        "entry not an entry": (raw.replace(b"PK\x01\x02", b"PK\x03\x04", 1), "entry 0 (at byte 0) is malformed"),
        "comment": (raw[:-2] + b"\x02\x00hi", "not a torch zip archive"),
        "end records alone": (raw[-42:], "locator points at byte 185, but the file of 42 bytes has no room"),
        "no zip64 record": (raw.replace(b"PK\x06\x06", bytes(4)), "byte 185, which holds no zip64 end record"),
        "two disks": (raw[:-26] + struct.pack("<L", 2) + raw[-22:], "an archive of several disks"),
        "22 bytes": (bytes(22), "not a torch zip archive"),
    }
    for case, (data, why) in cases.items():
        (tmp_path / f"{case}.pt").write_bytes(data)
        with pytest.raises(shards.ShardError, match="pt: ") as e:
            read_torch_file(str(tmp_path / f"{case}.pt"))
        assert why in str(e.value) and str(tmp_path / f"{case}.pt") in str(e.value), (case, str(e.value))


def test_what_torch_save_writes_still_reads(tmp_path):
    # torch.save's archives (zip64 end records, members aligned by extra fields, a long stem as
    # their prefix) pass the directory check; so do zipfile's (no zip64 records).
    torch = pytest.importorskip("torch")
    from lik_cupy._plaid_files import read_torch_file

    values = {"centroids": torch.arange(12, dtype=torch.float16).reshape(3, 4),
              "buckets": (torch.zeros(3), torch.linspace(-1, 1, 4)),
              "codes": torch.arange(7, dtype=torch.int32), "bits": torch.arange(8, dtype=torch.uint8).reshape(2, 4)}
    for name in ("x.pt", "n" * 200 + ".pt"):
        torch.save(values, tmp_path / name)
        got = read_torch_file(str(tmp_path / name))
        assert got.keys() == values.keys()
        for k in ("centroids", "codes", "bits"):
            np.testing.assert_array_equal(got[k], values[k].numpy())
        np.testing.assert_array_equal(got["buckets"][1], values["buckets"][1].numpy())
    torch.save([torch.arange(3)] * 3 + [torch.zeros(2) for _ in range(100)], tmp_path / "many.pt")
    assert len(read_torch_file(str(tmp_path / "many.pt"))) == 103
    save_pt(tmp_path / "zipfile.pt", np.arange(5, dtype=np.int64))
    np.testing.assert_array_equal(read_torch_file(str(tmp_path / "zipfile.pt")), np.arange(5))


# --------------------------------------------------------------------------- fuzz: PLAID indexes


def special(path: pathlib.Path, what: str) -> None:
    """Put a FIFO, a link to /dev/zero, a directory or a dangling link where ``path`` was."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    {"fifo": lambda: os.mkfifo(path), "dev zero": lambda: path.symlink_to("/dev/zero"), "directory": path.mkdir,
     "dangling": lambda: path.symlink_to(path.parent / "nothing here")}[what]()


SPECIALS = ("fifo", "dev zero", "directory", "dangling")


def npy_mutations(rng, arr: np.ndarray):
    """(name, bytes, expectation) for one .npy file that the reader reads."""
    raw = npy_bytes(arr)
    start = len(npy_bytes(np.zeros(0, arr.dtype).reshape((0,) + arr.shape[1:])))
    yield "empty", b"", "error"
    yield "header only", raw[:start], "error"
    yield "half", raw[:start + (len(raw) - start) // 2], "error"
    yield "one byte short", raw[:-1], "error"
    yield "fortran", npy_bytes(arr, fortran=arr.ndim > 1), "same" if arr.ndim == 1 else "any"
    for dims in ((2**40,) + arr.shape[1:], (2**62, 2**62), (-1,) + arr.shape[1:], arr.shape[:-1] or (0,),
                 (arr.shape[0] * 2,) + arr.shape[1:], (max(arr.shape[0] - 1, 0),) + arr.shape[1:], ()):
        yield f"shape {dims}", npy_bytes(arr, shape=dims), "any"
    for descr in ("<f4", "<i4", "|u1", "<f8", "|b1", "<U4", "|O", ">i8", "<c8", "<u8", "|V3"):
        yield f"dtype {descr}", npy_bytes(arr, descr=descr, shape=(arr.size * arr.itemsize // max(
            np.dtype(descr if descr != "|O" else "<i8").itemsize, 1),)), "any"
    for i in range(8):  # random bytes in the header
        b = bytearray(raw)
        for at in rng.integers(6, start, 3):
            b[at] = int(rng.integers(0, 256))
        yield f"header bytes {i}", bytes(b), "any"


def json_mutations(value):
    """(name, text, expectation) for one JSON file that the reader reads."""
    yield "empty", "", "error"
    yield "deep", "[" * 100_000 + "]" * 100_000, "error"
    yield "long int", "9" * 5000, "error"
    yield "not utf-8", "\udcff", "error"
    yield "null", "null", "error"
    yield "string", '"x"', "error"
    yield "deep object", '{"a":' * 50_000 + "1" + "}" * 50_000, "error"
    if isinstance(value, list):
        yield "one more", json.dumps(value + [1]), "error"
        yield "one less", json.dumps(value[:-1]), "error" if value[-1] else "any"  # an empty last document
        yield "negative", json.dumps([-1] + value[1:]), "error"
        yield "float", json.dumps([1.5] + value[1:]), "error"
        yield "huge", json.dumps([2**63 - 1] + value[1:]), "error"
        yield "wraps int64", json.dumps([2**62] * 4 + value), "error"
        yield "bool", json.dumps([True] + value[1:]), "error"
    else:
        for key in value:
            for bad in (None, -1, 10**9, 2**70, 1.5, "2", [], True, 3):
                yield f"{key}={bad!r}", json.dumps({**value, key: bad}), "any"
            rest = dict(value)
            del rest[key]
            yield f"no {key}", json.dumps(rest), "any"


def write_mutation(path: pathlib.Path, data) -> None:
    if isinstance(data, str):
        path.write_bytes(data.encode("utf-8", "surrogateescape"))
    else:
        path.write_bytes(data)


def test_fuzz_fast_plaid_and_pylate_indexes(tmp_path):
    rng = np.random.default_rng(44)
    cases, expect = [], {}
    n = 0

    def case(base: pathlib.Path, name: str, file: str, mutate, want: str) -> None:
        nonlocal n
        n += 1
        d = tmp_path / f"c{n}"
        shutil.copytree(base, d, symlinks=True)
        mutate(d / file)
        cases.append((name, "plaid", [str(d)]))
        expect[name] = want

    fixture = tmp_path / "fast"
    shutil.copytree(FIXTURE, fixture)
    for file in ("centroids.npy", "bucket_weights.npy", "merged_codes.npy", "merged_residuals.npy"):
        arr = np.load(fixture / file)
        for name, data, want in npy_mutations(rng, arr):
            case(fixture, f"{file} {name}", file, lambda p, data=data: write_mutation(p, data), want)
    for file in ("metadata.json", "doclens.0.json", "merged_codes.manifest.json", "merged_residuals.manifest.json"):
        value = json.loads((fixture / file).read_text())
        for name, text, want in json_mutations(value):
            if file.startswith("merged") and name in ("empty", "deep", "long int", "not utf-8", "deep object"):
                want = "error"
            elif file.startswith("merged"):
                want = "any"
            case(fixture, f"{file} {name}", file, lambda p, text=text: write_mutation(p, text), want)
    for file in ("centroids.npy", "merged_codes.npy", "metadata.json", "doclens.0.json", "merged_codes.manifest.json"):
        for what in SPECIALS:
            case(fixture, f"{file} {what}", file, lambda p, what=what: special(p, what), "error")
    for file in ("plan.json", "0.metadata.json", "avg_residual.npy", "bucket_cutoffs.npy", "cluster_threshold.npy"):
        for what in ("fifo", "dev zero"):  # files the reader never needs: never opened
            case(fixture, f"unread {file} {what}", file, lambda p, what=what: special(p, what), "same")
    # counts across files: merged codes without their padding rows (still enough), or a row short; a chunk's own file
    codes = np.load(fixture / "merged_codes.npy")
    t = sum(json.loads((fixture / "doclens.0.json").read_text()))
    case(fixture, "merged codes without padding", "merged_codes.npy",
         lambda p: p.write_bytes(npy_bytes(codes[:t])), "same")
    case(fixture, "merged codes a row short", "merged_codes.npy",
         lambda p: p.write_bytes(npy_bytes(codes[:t - 1])), "error")
    case(fixture, "chunk file of int32 codes", "0.codes.npy",
         lambda p: p.write_bytes(npy_bytes(codes[:t].astype(np.int32))), "same")
    case(fixture, "chunk file a row short", "0.codes.npy",
         lambda p: p.write_bytes(npy_bytes(codes[:t - 1])), "error")
    case(fixture, "code out of range", "merged_codes.npy",
         lambda p: p.write_bytes(npy_bytes(np.where(np.arange(codes.size) == 7, 512, codes))), "error")
    case(fixture, "num_chunks 2", "metadata.json",
         lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "num_chunks": 2})), "error")
    case(fixture, "num_chunks 0", "metadata.json",
         lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "num_chunks": 0})), "error")
    pylate = tmp_path / "pylate"
    write_pylate(pylate)
    case(pylate, "pylate", "documents_ids_to_plaid_ids.pkl", lambda p: None, "same")
    case(pylate, "pylate codes fifo", "fast_plaid_index/merged_codes.npy", lambda p: special(p, "fifo"), "error")
    results, original = with_original(cases, "plaid", fixture)
    check(results, expect, tmp_path, original)
    assert len(cases) > 250


def test_a_manifest_is_read_no_larger_than_its_chunks_need(tmp_path):
    # merged_codes.manifest.json was parsed whatever its size: an object of a million small entries
    # (19 MB) took 18 times its size in Python objects, though one entry a chunk is read. A
    # manifest may now hold 1 MiB and 1 KiB a chunk (an entry is about 60 bytes).
    import tracemalloc

    from lik_cupy import PlaidIndex

    d = tmp_path / "x"
    shutil.copytree(FIXTURE, d)
    entries = ",".join(f'"{i:x}":{{"rows":0}}' for i in range(200_000))
    (d / "merged_codes.manifest.json").write_text('{"0.codes.npy": {"rows": 1298}, ' + entries + "}")
    tracemalloc.start()
    try:
        with pytest.raises(shards.ShardError, match="merged_codes.manifest.json: larger than"):
            PlaidIndex.open(d)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * (d / "merged_codes.manifest.json").stat().st_size, peak
    text = json.dumps({"0.codes.npy": {"rows": 1298, "merged": True, "mtime": None}}, indent=4)
    (d / "merged_codes.manifest.json").write_text(text + " " * ((1 << 20) - len(text)))  # 1 MiB and one chunk: read
    assert len(PlaidIndex.open(d)) == 60


def _doclens_text(shape: str, n: int) -> str:
    rng = np.random.default_rng(5)
    if shape == "zeros, two bytes a value":
        return "[" + ",".join(["0"] * n) + "]"
    low, high, sep = {"lengths of 257 to 999": (257, 1000, ","), "lengths of 32 to 300": (32, 300, ", "),
                      "lengths of five digits, a line each": (10_000, 99_999, ",\n  ")}[shape]
    return "[" + sep.join(map(str, rng.integers(low, high, n).tolist())) + "]"


@pytest.mark.parametrize("shape", ["zeros, two bytes a value", "lengths of 257 to 999", "lengths of 32 to 300",
                                   "lengths of five digits, a line each"])
def test_a_doclens_file_is_read_in_memory_proportional_to_its_size(tmp_path, shape):
    # A doclens JSON list was parsed into Python ints (28 bytes each where past 256, and 8 in the
    # list) and then copied into an array: 5 to 11 times the file's size at the peak, so a doclens
    # file of 1 GB (hostile, or an index of 200M documents) asked for 11 GB. The peak is now the
    # file's bytes, the int64 result and a fixed 4 MiB: at most 5 times the file (a value takes at
    # least two bytes, "0,") and 4 MiB.
    n = 1_000_000
    path = tmp_path / "doclens.0.json"
    path.write_text(_doclens_text(shape, n))
    size = path.stat().st_size
    expected = np.array(json.loads(path.read_text()), np.int64)
    got, peak = _traced(lambda: _files.read_lengths(path))
    assert np.array_equal(got, expected) and got.dtype == np.int64
    assert peak <= size + 8 * n + (4 << 20), (peak / size, size)


def test_an_index_reads_its_doclens_in_memory_proportional_to_their_size(tmp_path):
    # The index's offsets: the chunk's lengths and then the offsets, 16 bytes a document, besides
    # the file while it is parsed; not the parse's 28 to 36 bytes a value.
    from lik_cupy import PlaidIndex

    d = tmp_path / "x"
    shutil.copytree(FIXTURE, d)
    lens = json.loads((d / "doclens.0.json").read_text())
    n = 2_000_000  # empty documents before the fixture's 60: the codes still add up
    (d / "doclens.0.json").write_text("[" + "0," * n + ",".join(map(str, lens)) + "]")
    size = (d / "doclens.0.json").stat().st_size
    idx, peak = _traced(lambda: PlaidIndex.open(d))
    assert len(idx) == n + len(lens) and idx.offsets[-1] == sum(lens)
    assert peak <= max(size + 8 * n, 16 * n) + (8 << 20), (peak / size, size)


def _traced(fn):
    """``fn()``'s result and the peak of the memory Python allocated while it ran (tracemalloc)."""
    import tracemalloc

    tracemalloc.start()
    try:
        return fn(), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _reference_lengths(text: bytes):
    """What the doclens reader must make of ``text``: the json module's reading, a list of int64
    values >= 0 (bools and floats are not integers), else None."""
    try:
        value = json.loads(text.decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, list) or not all(type(v) is int and 0 <= v < 2**63 for v in value):
        return None
    return value


def test_a_doclens_file_is_read_as_json_reads_it(tmp_path):
    # The reader parses JSON lists of integers itself (the json module's objects are what took the
    # memory): it takes exactly what json.loads takes as a list of int64 values >= 0, to the byte.
    fixed = [b"[]", b"[ ]", b" \n[\t1 ,2\r\n, 3 ] \n", b"[0]", b"[-0]", b"[9223372036854775807]", b"[01]", b"[-01]",
             b"[9223372036854775808]", b"[-1]", b"[-9223372036854775808]", b"[1 2]", b"[- 1]", b"[1,]", b"[,1]",
             b"[,]", b"[1,,2]", b"[1.0]", b"[1e3]", b"[+1]", b"[true]", b'["1"]', b"[[1]]", b"[1]]", b"[[1]",
             b"[1] 2", b"[", b"]", b"", b" ", b"1", b"{}", b"\xef\xbb\xbf[1]", b"[1\x00]", b"[\xa01]", b"[1,\x0b2]",
             b"[" + b"7" * 5000 + b"]", b"[-]", b"[--1]", b"[1-]", b"[0" + b" " * 70_000 + b",1]",
             b"[" + b" " * 70_000 + b"]", b"[" + b"1," * 40_000 + b"2]", b"[" + b"1," * 40_000 + b"02]"]
    rng = np.random.default_rng(11)
    alphabet = list(b"0123456789-, \n[].e+x\t") + [0xff]
    base = b"[" + b", ".join(str(v).encode() for v in rng.integers(0, 400, 200)) + b"]"
    mutated = []
    for _ in range(1500):
        b = bytearray(base)
        for _ in range(int(rng.integers(1, 4))):
            at, op = int(rng.integers(0, len(b) + 1)), int(rng.integers(0, 3))
            c = alphabet[int(rng.integers(0, len(alphabet)))]
            if op == 0 and at < len(b):
                b[at] = c
            elif op == 1:
                b.insert(at, c)
            elif at < len(b):
                del b[at]
        mutated.append(bytes(b))
    path = tmp_path / "doclens.json"
    accepted = 0
    for text in fixed + mutated:
        path.write_bytes(text)
        want = _reference_lengths(text)
        if want is None:
            with pytest.raises(shards.ShardError) as e:
                _files.read_lengths(path)
            assert str(e.value).startswith(f"{path}: "), str(e.value)
        else:
            got = _files.read_lengths(path)
            assert got.dtype == np.int64 and got.tolist() == want, text[:80]
            accepted += 1
    assert 50 < accepted < len(fixed) + len(mutated) - 50  # both sides exercised


@pytest.mark.parametrize("text,words", [
    ("[3, 1, -2]", "length -2 at index 2 is negative"),
    ("[1, 99999999999999999999]", "length 99999999999999999999 at index 1 does not fit int64"),
    ("[1, -99999999999999999999]", "length -99999999999999999999 at index 1 does not fit int64"),
    ("[1, " + "9" * 50 + ", 2]", "length of 50 digits at index 1 does not fit int64"),
    ("[1, " + "9" * 100 + "]", "length of more than 63 digits at index 1 does not fit int64"),
    ("[1, 2.5]", "'.' at byte 5"),
    ("[[1]]", "'[' at byte 1"),
    ("{}", "not a JSON list of integers"),
    ("[1, 2", "not a JSON list of integers"),
    ("[1,, 2]", "value 1 is empty"),
    ("[1, 02]", "value 1 has a leading zero"),
    ("[1 2]", "value 0 has whitespace inside it"),
])
def test_a_bad_doclens_file_says_where(tmp_path, text, words):
    path = tmp_path / "doclens.0.json"
    path.write_text(text)
    with pytest.raises(shards.ShardError) as e:
        _files.read_lengths(path)
    assert str(e.value).startswith(f"{path}: ") and words in str(e.value), str(e.value)


def pt_mutations(rng, arrays: list[np.ndarray]):
    """(name, bytes, expectation) for one .pt file (a tensor, or a tuple of them) that the reader reads."""
    def pt(**override):
        parts = [tensor(a, str(i), **(override if i == len(arrays) - 1 else {})) for i, a in enumerate(arrays)]
        body = parts[0][0] if len(parts) == 1 else _tuple([p for p, _ in parts])
        return pt_bytes(body, {k: v for _, s in parts for k, v in s.items()})

    arr = arrays[-1]
    raw = pt()
    yield "empty", b"", "error"
    yield "half", raw[:len(raw) // 2], "error"
    yield "deflated", pt_bytes(*tensor(arr), zipfile.ZIP_DEFLATED) if len(arrays) == 1 else raw, "same"
    yield "deep", pt_bytes(b"", {}, pickle=deep_pickle(100_000)), "error"
    yield "numel + 1", pt(numel=arr.size + 1), "error"
    yield "storage short", pt(data=arr.tobytes()[:-1]), "error"
    yield "storage empty", pt(data=b""), "error"
    yield "offset 1", pt(offset=1), "error"
    yield "offset -1", pt(offset=-1), "error"
    yield "offset 2**70", pt(offset=2**70), "error"
    yield "rows doubled", pt(size=(arr.shape[0] * 2,) + arr.shape[1:]), "error"
    yield "size 2**62", pt(size=(2**62,) + arr.shape[1:]), "error"
    yield "stride 100000", pt(stride=(100000,) + tuple(s // arr.itemsize for s in arr.strides[1:])), "error"
    yield "stride -1", pt(stride=(-1,) + tuple(s // arr.itemsize for s in arr.strides[1:])), "error"
    yield "stride 0", pt(stride=(0,) + tuple(s // arr.itemsize for s in arr.strides[1:])), "any"
    yield "rank + 1", pt(size=arr.shape + (1,), stride=tuple(s // arr.itemsize for s in arr.strides) + (1,)), "any"
    yield "size and stride of other ranks", pt(stride=(1,) * (arr.ndim + 1)), "error"
    for other in ("HalfStorage", "FloatStorage", "LongStorage", "ByteStorage", "IntStorage"):
        yield f"as {other}", pt(storage_type=other), "any"
    for i in range(24):  # random bytes anywhere
        b = bytearray(raw)
        for at in rng.integers(0, len(b), 4):
            b[at] = int(rng.integers(0, 256))
        yield f"bytes {i}", bytes(b), "any"


def test_fuzz_colbertv2_indexes(tmp_path):
    rng = np.random.default_rng(4402)
    base = tmp_path / "colbert"
    write_colbert(base)
    cen, w, codes, bits, lens = fixture_arrays()
    off = np.concatenate([[0], np.cumsum(lens)])
    cut = off[len(lens) // 2]
    files = {"centroids.pt": [cen], "buckets.pt": [np.zeros(3, np.float32), w],
             "0.codes.pt": [codes[:cut].astype(np.int32)], "1.residuals.pt": [bits[cut:]]}
    cases, expect = [], {}
    for n, (file, arrays) in enumerate(files.items()):
        for i, (name, data, want) in enumerate(pt_mutations(rng, arrays)):
            d = tmp_path / f"c{n}_{i}"
            shutil.copytree(base, d)
            (d / file).write_bytes(data)
            cases.append((f"{file} {name}", "plaid", [str(d)]))
            expect[f"{file} {name}"] = want
        for what in SPECIALS:
            d = tmp_path / f"c{n}_{what}"
            shutil.copytree(base, d)
            special(d / file, what)
            cases.append((f"{file} {what}", "plaid", [str(d)]))
            expect[f"{file} {what}"] = "error"
    for name, mutate in (("codes of chunk 1 missing", lambda d: (d / "1.codes.pt").unlink()),
                         ("doclens of chunk 1 missing", lambda d: (d / "doclens.1.json").unlink()),
                         ("chunks swapped", lambda d: shutil.copy(base / "1.codes.pt", d / "0.codes.pt")),
                         ("float codes", lambda d: save_pt(d / "0.codes.pt", codes[:cut].astype(np.float32))),
                         ("int64 codes", lambda d: save_pt(d / "0.codes.pt", codes[:cut].astype(np.int64))),
                         ("2-D codes", lambda d: save_pt(d / "0.codes.pt", codes[:cut].astype(np.int32)[:, None])),
                         ("residuals of nbits 4", lambda d: save_pt(d / "1.residuals.pt", np.repeat(bits[cut:], 2, 1))),
                         ("a tensor where buckets were", lambda d: save_pt(d / "buckets.pt", w)),
                         ("dim 64", lambda d: (d / "metadata.json").write_text(
                             json.dumps({"config": {"nbits": 2, "dim": 64}, "num_chunks": 2}))),
                         ("nbits 3", lambda d: (d / "metadata.json").write_text(
                             json.dumps({"config": {"nbits": 3}, "num_chunks": 2}))),
                         ("config a list", lambda d: (d / "metadata.json").write_text(
                             json.dumps({"config": [2], "num_chunks": 2})))):
        d = tmp_path / name.replace(" ", "_")
        shutil.copytree(base, d)
        mutate(d)
        cases.append((name, "plaid", [str(d)]))
        expect[name] = "same" if name == "int64 codes" else "error"
    results, original = with_original(cases, "plaid", base)
    check(results, expect, tmp_path, original)


def test_colbertv2_and_pylate_layouts_read_what_fast_plaid_wrote(tmp_path):
    # The ColBERTv2 copy of the fixture decompresses to the same embeddings as the fixture itself,
    # and PyLate's directory opens the fast-plaid index inside it without touching its pickles.
    from lik_cupy import PlaidIndex

    write_colbert(tmp_path / "colbert")
    write_pylate(tmp_path / "pylate")
    fast = PlaidIndex.open(FIXTURE)
    for other in (PlaidIndex.open(tmp_path / "colbert"), PlaidIndex.open(tmp_path / "pylate")):
        assert len(other) == len(fast) == 60
        np.testing.assert_array_equal(other.offsets, fast.offsets)
        np.testing.assert_array_equal(other.codes, fast.codes)
        np.testing.assert_array_equal(other.residual_bits, fast.residual_bits)
        np.testing.assert_array_equal(other.centroids, fast.centroids)


def test_a_chunk_of_its_own_file_is_never_taken_for_rows_of_the_merged_file(tmp_path, monkeypatch):
    # Whether the chunks' rows were the merged file's from its first on was judged by their addresses:
    # a chunk file whose mapping the system placed just past the merged file's last row was taken for
    # more merged rows, and the codes came back as the merged file's rows alone, fewer than the
    # doclens count (the GPU rerank, which trusts the index's offsets, would read past them). The
    # rows' sources are tracked instead. Two mappings back to back are simulated here: the files
    # come back as views of one buffer.
    from lik_cupy import PlaidIndex, _plaid_files

    cen, w, codes, bits, lens = fixture_arrays()
    d = tmp_path / "x"
    d.mkdir()
    np.save(d / "centroids.npy", cen)
    np.save(d / "bucket_weights.npy", w)
    (d / "metadata.json").write_text(json.dumps({"nbits": 2, "num_chunks": 2}))
    (d / "doclens.0.json").write_text(json.dumps(lens[:30]))
    (d / "doclens.1.json").write_text(json.dumps(lens[30:]))
    t0 = sum(lens[:30])
    for suffix, rows in (("codes", codes), ("residuals", bits)):
        np.save(d / f"merged_{suffix}.npy", rows[:t0])  # chunk 0, merged; chunk 1 not merged yet
        np.save(d / f"1.{suffix}.npy", rows[t0:])
    adjacent = {"codes": np.array(codes), "residuals": np.array(bits)}
    real = _files.open_npy

    def back_to_back(path):
        name = os.path.basename(os.fspath(path))
        for suffix, rows in adjacent.items():
            if name == f"merged_{suffix}.npy":
                return rows[:t0]
            if name == f"1.{suffix}.npy":
                return rows[t0:]
        return real(path)

    monkeypatch.setattr(_plaid_files._files, "open_npy", back_to_back)
    idx = PlaidIndex.open(d)
    assert idx.offsets[-1] == len(codes) == idx.codes.shape[0] == idx.residual_bits.shape[0]
    np.testing.assert_array_equal(idx.codes, codes)
    np.testing.assert_array_equal(idx.residual_bits, bits)


# --------------------------------------------------------------------------- fuzz: shards and .npy inputs


def test_fuzz_shards_and_npy_inputs(tmp_path):
    rng = np.random.default_rng(4403)
    docs = [rng.standard_normal((int(n), 8)).astype(np.float16) for n in rng.integers(0, 9, 12)]
    base = tmp_path / "shard"
    shards.pack_arrays(docs, base, ids=[f"doc{i}" for i in range(12)])
    int8 = tmp_path / "int8"
    shards.pack_arrays(docs, int8, dtype="int8")
    flat = tmp_path / "flat"
    flat.mkdir()
    np.save(flat / "tokens.npy", np.concatenate(docs))
    (flat / "doclens.json").write_text(json.dumps([len(d) for d in docs]))
    cases, expect, n = [], {}, 0

    def case(src, name, file, mutate, want, kind_args):
        nonlocal n
        n += 1
        d = tmp_path / f"c{n}"
        shutil.copytree(src, d)
        mutate(d / file)
        cases.append((name, "shard", kind_args(d)))
        expect[name] = want

    shard_args = lambda d: [str(d)]  # noqa: E731
    flat_args = lambda d: [str(d / "tokens.npy"), str(d / "doclens.json")]  # noqa: E731
    for src, files, args in ((base, ("tokens.npy", "offsets.npy", "ids.npy"), shard_args),
                             (int8, ("tokens.npy", "scales.npy"), shard_args), (flat, ("tokens.npy",), flat_args)):
        for file in files:
            arr = np.load(src / file)
            for name, data, want in npy_mutations(rng, arr):
                case(src, f"{src.name} {file} {name}", file, lambda p, data=data: write_mutation(p, data), want,
                     args)
            for what in SPECIALS:
                case(src, f"{src.name} {file} {what}", file, lambda p, what=what: special(p, what), "error", args)
        json_file = "manifest.json" if args is shard_args else "doclens.json"
        value = json.loads((src / json_file).read_text())
        for name, text, want in json_mutations(value):
            case(src, f"{src.name} {json_file} {name}", json_file, lambda p, text=text: write_mutation(p, text),
                 want, args)
        for what in SPECIALS:
            case(src, f"{src.name} {json_file} {what}", json_file, lambda p, what=what: special(p, what), "error", args)
    case(base, "manifest names a file outside", "manifest.json", lambda p: p.write_text(json.dumps(
        {**json.loads(p.read_text()), "files": {"tokens": "/dev/zero", "offsets": "offsets.npy"}})), "error",
         shard_args)
    sources = ((base, shard_args), (int8, shard_args), (flat, flat_args))
    results = open_in_child([(src.name, "shard", args(src)) for src, args in sources] + cases)
    assert all(results[src.name]["outcome"] == "ok" for src, _ in sources), results
    originals = {src.name: results[src.name]["digest"] for src, _ in sources}
    for prefix, original in originals.items():
        check(results, {k: v for k, v in expect.items() if k.startswith(prefix + " ")}, tmp_path, original)
    check(results, {k: v for k, v in expect.items() if k.split()[0] not in originals}, tmp_path)


def test_the_npy_file_checked_is_the_file_mapped(tmp_path):
    # A FIFO renamed over a .npy between its check and its mapping is never opened: the old
    # reader checked one descriptor, then np.load opened the path again and waited on the FIFO.
    np.save(tmp_path / "x.npy", np.arange(5, dtype=np.int64))
    os.mkfifo(tmp_path / "fifo")
    code = f"""
import numpy as np
from lik_cupy import _files
check = _files.check_npy_header
def swapped(path, f):
    out = check(path, f)
    import os
    os.replace({str(tmp_path / 'fifo')!r}, path)
    return out
_files.check_npy_header = swapped
print(_files.open_npy({str(tmp_path / 'x.npy')!r}).tolist())
"""
    env = dict(os.environ, PYTHONPATH=child_pythonpath())
    try:
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=SECONDS)
    except subprocess.TimeoutExpired:
        pytest.fail("open_npy waited on the FIFO swapped in after its check")
    assert p.returncode == 0 and p.stdout.strip() == "[0, 1, 2, 3, 4]", p.stderr


def test_npy_errors_name_the_file_once_and_version_3_is_refused(tmp_path):
    (tmp_path / "neg.npy").write_bytes(npy_bytes(np.zeros(3), shape=(-1,)))
    with pytest.raises(shards.ShardError) as e:
        _files.open_npy(tmp_path / "neg.npy")
    assert str(e.value) == f"{tmp_path / 'neg.npy'}: header's shape (-1,) has a negative dimension"
    with open(tmp_path / "v3.npy", "wb") as f:
        np.lib.format.write_array(f, np.zeros(3), version=(3, 0))
    with pytest.raises(shards.ShardError, match=r"v3.npy: .npy format version 3.0 is not read"):
        _files.open_npy(tmp_path / "v3.npy")


@pytest.mark.parametrize("operators", ["-", "~", "+"])
def test_npy_header_nested_too_deeply_is_a_shard_error(tmp_path, operators):
    # NumPy parses a header as Python: 3,000 unary operators (well inside its 10,000 bytes) raised
    # RecursionError out of open_npy, PlaidIndex.open and open_shard.
    from lik_cupy import PlaidIndex

    text = "{'descr': '<f2', 'fortran_order': False, 'shape': (%s1,), }" % (operators * 3000)
    header = (text + " " * (-(10 + len(text) + 1) % 64) + "\n").encode()
    deep = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + bytes(64)
    idx = tmp_path / "idx"
    shutil.copytree(FIXTURE, idx)
    (idx / "centroids.npy").write_bytes(deep)
    shard = shards.pack_arrays([np.ones((3, 8), np.float16)], tmp_path / "shard").path
    pathlib.Path(shard, "offsets.npy").write_bytes(deep)
    for read, path, file in ((_files.open_npy, idx / "centroids.npy", idx / "centroids.npy"),
                             (PlaidIndex.open, idx, idx / "centroids.npy"),
                             (shards.open_shard, shard, os.path.join(shard, "offsets.npy"))):
        with pytest.raises(shards.ShardError) as e:
            read(path)
        assert str(e.value) == f"{file}: corrupt .npy header (nested too deeply to read)"


@pytest.mark.parametrize("shape, why", [
    ("(2, 4if 1else 4)", "the name 'if'"),  # Python warns "invalid decimal literal" (3.11 on)
    ("(2, 0x4for 4)", "the name 'or'"),  # "invalid hexadecimal literal"
    ("(2, 4), 'x\\,': 1", "a backslash"),  # "invalid escape sequence" (DeprecationWarning in 3.11)
    ("(2, 4 if 1 else 4)", "the name 'if'"),  # no warning, but this was "holds Python objects (object dtype)"
    ("(2, (4)(4))", None),  # so was this: NumPy's error names an <ast.Call object>
    ("(2, 4if 1else 4", "the name 'if'"),  # does not tokenize (an unclosed bracket): Python still warned
])
def test_npy_header_python_would_warn_about_is_one_error_and_no_warning(tmp_path, shape, why):
    # NumPy parses a header as Python: these made Python print SyntaxWarnings on stderr (lik's one
    # line of error came after two more), and an expression in the shape was called object data.
    import warnings

    text = "{'descr': '<f2', 'fortran_order': False, 'shape': %s, }" % shape
    header = (text + " " * (-(10 + len(text) + 1) % 64) + "\n").encode()
    path = tmp_path / "x.npy"
    path.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + bytes(16))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(shards.ShardError) as e:
            _files.open_npy(path)
    assert [str(w.message) for w in seen] == []
    want = f"corrupt .npy header: it holds {why}" if why else "corrupt .npy file (malformed node"
    assert str(e.value).startswith(f"{path}: {want}"), str(e.value)


def test_special_files_are_judged_without_being_opened(tmp_path, monkeypatch):
    # Opening a device can act (a tape rewinds, a watchdog starts): a link to one is refused by
    # stat alone, for every reader.
    from lik_cupy import PlaidIndex
    from lik_cupy._plaid_files import read_torch_file

    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(os.fspath(path)) or real_open(path, *a, **k))
    idx = tmp_path / "idx"
    shutil.copytree(FIXTURE, idx)
    special(idx / "merged_codes.npy", "dev zero")
    (tmp_path / "x.pt").symlink_to("/dev/null")
    (tmp_path / "lens.json").symlink_to("/dev/null")
    for read, path in ((PlaidIndex.open, idx), (read_torch_file, tmp_path / "x.pt"),
                       (_files.read_lengths, tmp_path / "lens.json"), (_files.open_npy, idx / "merged_codes.npy")):
        with pytest.raises(shards.ShardError, match="is a character device"):
            read(path)
    assert not [p for p in opened if os.path.realpath(p).startswith("/dev/")], opened
