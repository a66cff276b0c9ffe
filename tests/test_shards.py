"""lik_cupy.shards: writing, opening (memory-mapped) and checking shards and the other input layouts. CPU only."""

from __future__ import annotations

import json
import os
import pathlib
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

from lik_cupy import _files, shards
from lik_cupy import _shard_format as fmt
from lik_cupy.errors import ShardError

DIM = 12


def unit(x):
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def ragged(rng, lengths, dim=DIM):
    """One [L, d] float32 unit-norm array per length."""
    return [unit(rng.standard_normal((int(n), dim))) for n in lengths]


def offsets_of(docs):
    return np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)


def listing(path):
    return sorted(p.name for p in pathlib.Path(path).iterdir())


def write_example(tmp_path, name="s", lengths=(3, 0, 5, 1, 7), ids=None, dtype=np.float16, seed=0):
    docs = ragged(np.random.default_rng(seed), lengths)
    tokens = np.concatenate(docs).astype(dtype)
    return shards.write_shard(tmp_path / name, tokens, offsets_of(docs), ids=ids), docs


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", [np.float16, np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("ids", [None, "int", "str"])
def test_write_then_open_round_trip(tmp_path, dtype, ids):
    rng = np.random.default_rng(1)
    lengths = [4, 0, 9, 1, 3, 6]
    docs = ragged(rng, lengths)
    tokens = np.concatenate(docs).astype(dtype)
    id_values = {None: None, "int": np.arange(100, 106), "str": [f"doc {j}" for j in range(6)]}[ids]
    s = shards.write_shard(tmp_path / "shard", tokens, offsets_of(docs), ids=id_values, model="colbert-test")

    again = shards.open_shard(tmp_path / "shard")
    for shard in (s, again):
        assert isinstance(shard.tokens, np.memmap), "tokens must be memory-mapped, not loaded"
        assert shard.tokens.dtype == np.dtype(dtype)
        assert (shard.num_docs, shard.dim, shard.dtype) == (6, DIM, np.dtype(dtype).name)
        np.testing.assert_array_equal(shard.offsets, offsets_of(docs))
        np.testing.assert_array_equal(np.asarray(shard.tokens), tokens)
        for j in range(6):
            t, off = shard.read_chunk(j, j + 1)
            np.testing.assert_array_equal(t, docs[j].astype(dtype))
            assert off.tolist() == [0, lengths[j]]
    m = again.manifest
    assert m == {"format": "lik-shard", "version": 1, "dim": DIM, "dtype": np.dtype(dtype).name, "num_docs": 6,
                 "num_tokens": sum(lengths), "normalized": True, "model": "colbert-test",
                 "files": {"tokens": "tokens.npy", "offsets": "offsets.npy", **({"ids": "ids.npy"} if ids else {})}}
    stored = np.load(tmp_path / "shard" / "tokens.npy", allow_pickle=False)
    assert stored.dtype == (np.uint16 if dtype is ml_dtypes.bfloat16 else np.dtype(dtype))  # bf16 kept as bits
    if ids == "int":
        assert again.ids.dtype == np.int64 and again.ids.tolist() == list(range(100, 106))
    elif ids == "str":
        assert again.ids.tolist() == [f"doc {j}" for j in range(6)]
    else:
        assert again.ids is None and not (tmp_path / "shard" / "ids.npy").exists()


def test_normalized_is_measured(tmp_path):
    rng = np.random.default_rng(2)
    docs = ragged(rng, [3, 4])
    assert shards.write_shard(tmp_path / "unit", np.concatenate(docs), offsets_of(docs)).manifest["normalized"]
    scaled = np.concatenate(docs) * 1.5
    assert not shards.write_shard(tmp_path / "scaled", scaled, offsets_of(docs)).manifest["normalized"]


def test_same_input_gives_same_bytes(tmp_path):
    for name in ("a", "b"):
        write_example(tmp_path, name, ids=["x", "y", "z", "w", "v"])
    for f in listing(tmp_path / "a"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    text = (tmp_path / "a" / "manifest.json").read_text()
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"


def test_shard_directory_gets_usual_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        write_example(tmp_path)
    finally:
        os.umask(old)
    assert (tmp_path / "s").stat().st_mode & 0o777 == 0o755


# --------------------------------------------------------------------------- chunks and layouts


@pytest.mark.parametrize("max_bytes,max_docs", [(1, 0), (DIM * 2 * 6, 0), (1 << 20, 2), (1 << 20, 0)])
def test_chunks_cover_every_document_in_order(tmp_path, max_bytes, max_docs):
    lengths = [3, 0, 5, 1, 7, 0, 2]
    s, docs = write_example(tmp_path, lengths=lengths)
    ranges = s.chunk_ranges(max_bytes, max_docs)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(lengths)
    assert all(a < b and (not max_docs or b - a <= max_docs) for a, b in ranges)
    assert all(r[1] == nxt[0] for r, nxt in zip(ranges, ranges[1:]))
    for a, b in ranges:
        tokens, off = s.read_chunk(a, b)
        if b - a > 1:  # a chunk only exceeds the byte budget when one document does
            assert tokens.nbytes <= max(max_bytes, DIM * 2 * max(lengths[a:b]))
        for j in range(a, b):
            np.testing.assert_array_equal(tokens[off[j - a] : off[j - a + 1]], docs[j].astype(np.float16))


def test_reading_documents_outside_the_shard_is_a_value_error(tmp_path):
    """read_chunk took any numbers as Python slices do: documents 0..4 of a padded array of 3
    gave its 3, documents -1..1 of a shard none (-1 is no document), 1..0 offsets [] where
    [n + 1] are promised, 0..2 of 2 an IndexError. A range outside the shard is a ValueError
    naming it now, for read_chunk, read_scales and read_values."""
    s, _ = write_example(tmp_path, lengths=(3, 0, 5))
    np.save(tmp_path / "p.npy", np.ones((3, 2, DIM), np.float32))
    np.save(tmp_path / "pl.npy", np.array([1, 2, 0]))
    padded = shards.open_input(tmp_path / "p.npy", tmp_path / "pl.npy")
    int8 = shards.pack(s, tmp_path / "int8", dtype="int8")
    for shard in (s, padded, int8):
        for start, stop in ((0, 4), (-1, 2), (2, 1), (4, 4)):
            for read in (shard.read_chunk, shard.read_values) + ((shard.read_scales,) if shard is int8 else ()):
                with pytest.raises(ValueError, match=f"documents {start}..{stop - 1} are not among the 3 of "):
                    read(start, stop)
        tokens, off = shard.read_chunk(3, 3)  # no documents: an empty range at the end is one
        assert tokens.shape == (0, DIM) and off.tolist() == [0]


def test_padded_with_lengths(tmp_path):
    rng = np.random.default_rng(3)
    D = rng.standard_normal((5, 4, DIM)).astype(np.float32)
    lens = np.array([1, 4, 0, 2, 3])
    np.save(tmp_path / "d.npy", D)
    np.save(tmp_path / "l.npy", lens)
    s = shards.open_input(tmp_path / "d.npy", tmp_path / "l.npy")
    assert s.padded and isinstance(s.tokens, np.memmap)
    assert s.doc_lengths().tolist() == lens.tolist()
    for a, b in s.chunk_ranges(max_docs=2):
        tokens, off = s.read_chunk(a, b)
        np.testing.assert_array_equal(tokens, np.concatenate([D[j, : lens[j]] for j in range(a, b)]))
        assert off.tolist() == [0, *np.cumsum(lens[a:b]).tolist()]
    packed = shards.pack(s, tmp_path / "shard")
    assert packed.offsets.tolist() == [0, *np.cumsum(lens).tolist()]
    np.testing.assert_array_equal(np.asarray(packed.tokens), np.concatenate([D[j, : lens[j]] for j in range(5)]))
    Q, ql = shards._load_padded(packed)
    assert Q.shape == (5, 4, DIM) and ql.tolist() == lens.tolist()
    assert (Q[0, 1:] == 0).all() and (Q[2] == 0).all()
    np.testing.assert_array_equal(Q[1], D[1])


def test_padded_without_lengths_is_all_rows(tmp_path):
    D = np.random.default_rng(4).standard_normal((3, 5, DIM)).astype(np.float16)
    np.save(tmp_path / "d.npy", D)
    s = shards.open_input(tmp_path / "d.npy")
    assert s.doc_lengths().tolist() == [5, 5, 5]
    tokens, off = s.read_chunk(1, 3)
    np.testing.assert_array_equal(tokens, D[1:3].reshape(10, DIM))
    assert off.tolist() == [0, 5, 10]


@pytest.mark.parametrize("doclens_format", ["json", "npy"])
def test_colbert_flat_tokens_with_doclens(tmp_path, doclens_format):
    rng = np.random.default_rng(5)
    docs = ragged(rng, [2, 6, 0, 3])
    np.save(tmp_path / "embs.npy", np.concatenate(docs).astype(np.float16))
    if doclens_format == "json":
        (tmp_path / "doclens.0.json").write_text(json.dumps([2, 6, 0, 3]))
        doclens = tmp_path / "doclens.0.json"
    else:
        doclens = tmp_path / "doclens.npy"
        np.save(doclens, np.array([2, 6, 0, 3], np.int32))
    s = shards.open_input(tmp_path / "embs.npy", doclens)
    assert not s.padded and s.offsets.tolist() == [0, 2, 8, 8, 11]
    packed = shards.pack(s, tmp_path / "shard", model="colbertv2.0")
    assert packed.manifest["model"] == "colbertv2.0" and packed.manifest["normalized"]
    np.testing.assert_array_equal(np.asarray(packed.tokens), np.concatenate(docs).astype(np.float16))


def test_pack_arrays_and_dtype_conversion(tmp_path):
    rng = np.random.default_rng(6)
    docs = ragged(rng, [3, 1, 4])
    files = []
    for i, d in enumerate(docs):
        files.append(tmp_path / f"page{i}.npy")
        np.save(files[-1], d)
    s = shards.pack_arrays(files, tmp_path / "pages", ids=["p0", "p1", "p2"], dtype="bfloat16")
    assert s.dtype == "bfloat16" and s.offsets.tolist() == [0, 3, 4, 8]
    np.testing.assert_array_equal(np.asarray(s.tokens), np.concatenate(docs).astype(ml_dtypes.bfloat16))
    from_arrays = shards.pack_arrays(docs, tmp_path / "mem", dtype="float16")
    np.testing.assert_array_equal(np.asarray(from_arrays.tokens), np.concatenate(docs).astype(np.float16))
    back = shards.pack(s, tmp_path / "fp32", dtype="float32")
    np.testing.assert_array_equal(np.asarray(back.tokens), np.concatenate(docs).astype(ml_dtypes.bfloat16).astype(np.float32))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open descriptors in /proc")
def test_pack_arrays_of_more_files_than_descriptors(tmp_path):
    """Every page's memory map (a file descriptor each) was held until the shard was written, so
    `lik pack --per-doc` of a thousand pages under the usual `ulimit -n 1024` failed with "too many
    open files". Each file is now opened again when it is written; one that changed meanwhile is refused."""
    resource = pytest.importorskip("resource")
    rng = np.random.default_rng(8)
    docs = ragged(rng, rng.integers(0, 5, 300))
    files = []
    for i, d in enumerate(docs):
        files.append(tmp_path / f"page{i}.npy")
        np.save(files[-1], d)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 100, hard))
    try:
        s = shards.pack_arrays(files, tmp_path / "pages")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert s.offsets.tolist() == offsets_of(docs).tolist()
    np.testing.assert_array_equal(np.asarray(s.tokens), np.concatenate(docs))

    real = shards._npy_document
    seen = []

    def changing(name, bf16_bits):  # the last page grows between its check and its write
        seen.append(name)
        if len(seen) == len(files) + len(files):
            np.save(name, np.ones((7, DIM), np.float32))
        return real(name, bf16_bits)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(shards, "_npy_document", changing)
        with pytest.raises(ShardError, match=r"page299.npy: changed while it was packed: it now holds \[7, 12\]"):
            shards.pack_arrays(files, tmp_path / "again")
    assert not (tmp_path / "again").exists()


def test_pack_arrays_takes_any_iterable_of_documents(tmp_path):
    """An [N, L, d] array (a sequence of [L, d] documents) raised NumPy's "truth value of an
    array is ambiguous", and an empty generator an UnboundLocalError; the array's rows are
    documents now, and no documents at all is the ShardError saying so."""
    rng = np.random.default_rng(9)
    padded = rng.standard_normal((3, 4, DIM)).astype(np.float32)
    s = shards.pack_arrays(padded, tmp_path / "rows")
    assert s.offsets.tolist() == [0, 4, 8, 12]
    np.testing.assert_array_equal(np.asarray(s.tokens), padded.reshape(12, DIM))
    g = shards.pack_arrays((d for d in padded[:2]), tmp_path / "gen")
    assert g.offsets.tolist() == [0, 4, 8]
    for empty in (np.zeros((0, 4, DIM), np.float32), (d for d in ())):
        with pytest.raises(ShardError, match="no documents given"):
            shards.pack_arrays(empty, tmp_path / "none")
    assert listing(tmp_path) == ["gen", "rows"]


def test_pack_arrays_rejects_mixed_dims(tmp_path):
    with pytest.raises(ShardError, match=r"docs\[1\]: d=5"):
        shards.pack_arrays([np.zeros((2, 4), np.float32), np.zeros((2, 5), np.float32)], tmp_path / "x")
    assert listing(tmp_path) == []


# --------------------------------------------------------------------------- writing safely


def test_overwrite_replaces_only_a_shard(tmp_path):
    write_example(tmp_path, lengths=(1, 2))
    with pytest.raises(ShardError, match="already exists"):
        write_example(tmp_path, lengths=(3,))
    docs = ragged(np.random.default_rng(0), [3])
    s = shards.write_shard(tmp_path / "s", np.concatenate(docs), offsets_of(docs), overwrite=True)
    assert s.num_docs == 1 and listing(tmp_path) == ["s"]
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "data.txt").write_text("keep me")
    with pytest.raises(ShardError, match="not a lik shard"):
        shards.write_shard(tmp_path / "precious", np.concatenate(docs), offsets_of(docs), overwrite=True)
    assert (tmp_path / "precious" / "data.txt").read_text() == "keep me"


def test_overwrite_never_takes_a_file_a_manifest_claims_under_another_name(tmp_path):
    """A manifest may name any file of its directory, but a shard lik wrote has its files' own names:
    a crafted one claiming a user's file (here as its ids) does not make --force delete it."""
    docs = ragged(np.random.default_rng(3), [2, 3])
    path = tmp_path / "s"
    shards.write_shard(path, np.concatenate(docs), offsets_of(docs), ids=np.array([5, 6]))
    (path / "notes.txt").write_text("keep me")
    m = json.loads((path / "manifest.json").read_text())
    (path / m["files"]["ids"]).unlink()
    m["files"]["ids"] = "notes.txt"
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ShardError, match="notes.txt"):
        shards.write_shard(path, np.concatenate(docs), offsets_of(docs), overwrite=True)
    assert (path / "notes.txt").read_text() == "keep me"


def test_failed_write_leaves_nothing(tmp_path):
    docs = ragged(np.random.default_rng(7), [2, 3])
    tokens = np.concatenate(docs)
    tokens[3, 1] = np.nan  # document 1, token 1
    with pytest.raises(ShardError, match=r"tokens: document 1, token 1 holds NaN or inf"):
        shards.write_shard(tmp_path / "s", tokens, offsets_of(docs), check_finite=True)
    assert listing(tmp_path) == []
    assert not shards.write_shard(tmp_path / "s", tokens, offsets_of(docs)).manifest["normalized"]  # allowed unless checked


def test_a_path_naming_no_entry_of_its_own_is_refused_before_any_work(tmp_path, monkeypatch):
    """A path that is empty or ends in '.' or '..' was written whole, its temporary beside the
    directory it resolves to ('y/..' with no y: the working directory's parent), and then failed
    at the final rename with a bare FileNotFoundError (lik pack: "lik: error: : no such file").
    It is refused before anything is read or written now."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    docs = ragged(np.random.default_rng(10), [2, 3])
    written = []
    monkeypatch.setattr(shards, "_write_tokens", lambda *a: written.append(a) or True)
    for path in ("", "x/.", "y/..", "z/./", str(work / "..")):
        with pytest.raises(ShardError, match="names no file or directory of its own"):
            shards.write_shard(path, np.concatenate(docs), offsets_of(docs))
    assert written == [] and listing(tmp_path) == ["work"] and listing(work) == []


def test_a_model_name_the_reader_would_refuse_is_refused_before_writing(tmp_path):
    """A model name of a megabyte made a manifest past the 1 MiB a reader takes: write_shard
    committed the shard, then raised when it opened it, leaving a shard no reader opens. The
    manifest's size is checked before anything is written now."""
    docs = ragged(np.random.default_rng(11), [2, 3])
    limit = shards._MAX_MANIFEST_BYTES
    with pytest.raises(ShardError, match=f"the model name makes a manifest of [0-9,]+ bytes, past the {limit:,}"):
        shards.write_shard(tmp_path / "s", np.concatenate(docs), offsets_of(docs), model="m" * limit)
    assert listing(tmp_path) == []
    model = "\u00e9" * 1000  # (written as \u escapes: 6 bytes each)
    s = shards.write_shard(tmp_path / "s", np.concatenate(docs), offsets_of(docs), model=model)
    assert shards.open_shard(s.path).manifest["model"] == model


def test_pack_never_writes_through_a_link_planted_in_its_temporary(tmp_path, monkeypatch):
    """offsets.npy and ids.npy were written with np.save(path), which follows a symbolic link that another
    process (one that may write the temporary shard directory: a shared group under umask 002) put
    there, and overwrote the file it points at; the shard was then committed and refused as leading
    outside itself. Every file of a shard is created exclusively now (as tokens.npy always was): the
    pack fails naming the shard, and the file outside is untouched."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    real = shards._write_tokens
    for name in (fmt.OFFSETS, fmt.IDS, fmt.MANIFEST):
        def planting(tmp, *args, name=name):
            normalized = real(tmp, *args)
            os.symlink(victim, os.path.join(tmp, name))
            return normalized

        monkeypatch.setattr(shards, "_write_tokens", planting)
        docs = ragged(np.random.default_rng(12), [2, 3])
        with pytest.raises(ShardError, match=f"{name} appeared in the shard's temporary directory"):
            shards.write_shard(out / "s", np.concatenate(docs), offsets_of(docs), ids=["a", "b"])
        assert victim.read_text() == "keep me" and listing(out) == [], name


def _swapping_opens(monkeypatch, path, other, every: bool):
    """Make the shard at ``other`` take ``path``'s place (and the one there ``other``'s), as lik pack
    --force's exchange does, just after ``open_npy`` opens a tokens.npy: once, or ``every`` time."""
    real, swaps = _files.open_npy, []

    def opening(name):
        arr = real(name)
        if os.path.basename(os.fspath(name)) == fmt.TOKENS and (every or not swaps):
            os.rename(path, f"{path}.aside")
            os.rename(other, path)
            os.rename(f"{path}.aside", other)
            swaps.append(name)
        return arr

    monkeypatch.setattr(_files, "open_npy", opening)
    return swaps


def test_a_shard_replaced_while_it_is_opened_is_read_whole(tmp_path, monkeypatch):
    """open_shard read the manifest, tokens, offsets and ids by path one after another: a shard that
    ``lik pack --force`` replaced in between (an atomic exchange of the two directories) was read
    as the old one's tokens with the new one's offsets and ids, a shard that never existed, scored
    without a word where the counts agreed. The shard's directory is the same one before and after
    its files are opened, or they are opened again."""
    old, _ = write_example(tmp_path, "s", lengths=(2, 4), ids=["a", "b"], seed=1)
    new, _ = write_example(tmp_path, "new", lengths=(4, 2), ids=["c", "d"], seed=2)
    want = [np.array(new.tokens), np.array(new.offsets), np.array(new.ids)]
    swaps = _swapping_opens(monkeypatch, old.path, new.path, every=False)
    s = shards.open_shard(old.path)
    assert len(swaps) == 1
    for got, expected in zip([s.tokens, s.offsets, s.ids], want):
        assert np.array_equal(np.asarray(got), expected)


def test_a_shard_that_keeps_being_replaced_is_refused(tmp_path, monkeypatch):
    old, _ = write_example(tmp_path, "s", lengths=(2, 4), seed=1)
    new, _ = write_example(tmp_path, "new", lengths=(4, 2), seed=2)
    swaps = _swapping_opens(monkeypatch, old.path, new.path, every=True)
    with pytest.raises(ShardError, match="was replaced while it was being opened"):
        shards.open_shard(old.path)
    assert 1 < len(swaps) <= 8


def test_write_rejects_bad_arguments(tmp_path):
    docs = ragged(np.random.default_rng(8), [2, 3])
    tokens, off = np.concatenate(docs), offsets_of(docs)
    cases = [
        (dict(tokens=tokens.astype(np.float64), offsets=off), "tokens: dtype float64"),
        (dict(tokens=tokens.view(np.uint16).reshape(5, -1)[:, :DIM], offsets=off), "tokens: dtype uint16"),
        (dict(tokens=tokens, offsets=off[::-1]), "offsets: offsets\\[0\\] is 5"),
        (dict(tokens=tokens, offsets=np.array([0, 4, 3])), "not monotone"),
        (dict(tokens=tokens, offsets=np.array([0, 2, 4])), "end at 4 but there are 5"),
        # (uint64 past int64: the value as given, not what it wraps to; it was "offsets[1] = -1")
        (dict(tokens=tokens, offsets=np.array([0, 2**64 - 1, 5], np.uint64)),
         "offsets: offsets\\[1\\] = 18446744073709551615 does not fit int64"),
        (dict(tokens=tokens, offsets=off, ids=[1, 2, 3]), "ids: expected 2 ids"),
        (dict(tokens=tokens, offsets=off, ids=["a", "b\tc"]), "tab or line break"),
        (dict(tokens=tokens, offsets=off, ids=[1.5, 2.5]), "ids must be int64 or fixed-width strings"),
        (dict(tokens=tokens, offsets=off, dtype="float64"), "dtype 'float64' is not one of"),
        (dict(tokens=tokens[None], offsets=off), "expected packed token embeddings"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ShardError, match=message):
            shards.write_shard(tmp_path / "s", **kwargs)
    assert listing(tmp_path) == []
    with pytest.raises(ShardError, match="parent directory .* does not exist"):
        shards.write_shard(tmp_path / "no" / "s", tokens, off)


# --------------------------------------------------------------------------- opening bad shards


def _edit_manifest(path, **changes):
    m = json.loads((path / "manifest.json").read_text())
    for key, value in changes.items():
        if value is KeyError:
            del m[key]
        else:
            m[key] = value
    (path / "manifest.json").write_text(json.dumps(m))


def _bad_shards(tmp_path):
    """(name, mutate(shard_dir), file at fault (relative to the shard), words of the problem)."""
    def save(name, arr):
        return lambda d: np.save(d / name, arr, allow_pickle=True)

    def truncate(name, cut):
        return lambda d: (d / name).write_bytes((d / name).read_bytes()[:-cut])

    def link_outside(d):
        np.save(tmp_path / "outside.npy", np.zeros(6, np.int64))
        os.symlink(tmp_path / "outside.npy", d / "evil.npy")
        _edit_manifest(d, files={"tokens": "tokens.npy", "offsets": "evil.npy"})

    return [
        ("no manifest", lambda d: (d / "manifest.json").unlink(), "manifest.json", "no such file"),
        ("manifest not JSON", lambda d: (d / "manifest.json").write_text("{oops"), "manifest.json", "not valid JSON"),
        ("manifest a list", lambda d: (d / "manifest.json").write_text("[]"), "manifest.json", "expected a JSON object"),
        ("wrong format", lambda d: _edit_manifest(d, format="other"), "manifest.json", "expected 'lik-shard'"),
        ("newer version", lambda d: _edit_manifest(d, version=shards.VERSION + 1), "manifest.json", "newer than this lik-cupy reads"),
        ("no dim", lambda d: _edit_manifest(d, dim=KeyError), "manifest.json", "dim is None"),
        ("bad dtype", lambda d: _edit_manifest(d, dtype="float64"), "manifest.json", "dtype is 'float64'"),
        ("normalized not bool", lambda d: _edit_manifest(d, normalized="yes"), "manifest.json", "expected true or false"),
        ("no files", lambda d: _edit_manifest(d, files=KeyError), "manifest.json", "files must be an object"),
        ("dot-dot path", lambda d: _edit_manifest(d, files={"tokens": "../tokens.npy", "offsets": "offsets.npy"}),
         "manifest.json", "not inside the shard directory"),
        ("absolute path", lambda d: _edit_manifest(d, files={"tokens": "/etc/passwd", "offsets": "offsets.npy"}),
         "manifest.json", "not inside the shard directory"),
        ("symlink out", link_outside, "manifest.json", "leads outside the shard directory"),
        ("tokens missing", lambda d: (d / "tokens.npy").unlink(), "tokens.npy", "no such file"),
        ("tokens truncated", truncate("tokens.npy", 10), "tokens.npy", "truncated"),
        ("tokens not npy", lambda d: (d / "tokens.npy").write_text("hello"), "tokens.npy", "not a .npy file"),
        ("tokens shape", save("tokens.npy", np.zeros((16, DIM + 1), np.float16)), "tokens.npy", "does not match the manifest"),
        ("tokens dtype", save("tokens.npy", np.zeros((16, DIM), np.float32)), "tokens.npy", "does not match the manifest's dtype"),
        ("offsets not monotone", save("offsets.npy", np.array([0, 3, 2, 8, 9, 16])), "offsets.npy", "not monotone"),
        ("offsets short of T", save("offsets.npy", np.array([0, 3, 3, 8, 9, 15])), "offsets.npy", "expected offsets[-1] == T"),
        ("offsets start", save("offsets.npy", np.array([1, 3, 3, 8, 9, 16])), "offsets.npy", "expected 0"),
        ("offsets int32", save("offsets.npy", np.array([0, 3, 3, 8, 9, 16], np.int32)), "offsets.npy", "expected int64"),
        ("offsets count", save("offsets.npy", np.array([0, 3, 8, 9, 16])), "offsets.npy", "num_docs + 1 = 6"),
        ("ids count", save("ids.npy", np.arange(4)), "ids.npy", "expected 5 ids"),
        ("ids float", save("ids.npy", np.arange(5.0)), "ids.npy", "ids must be int64 or fixed-width strings"),
        ("ids int32", save("ids.npy", np.arange(5, dtype=np.int32)), "ids.npy", "must be int64"),
        ("ids objects", save("ids.npy", np.array([1, "a", 2, 3, 4], dtype=object)), "ids.npy", "Python objects"),
    ]


def _check_bad_shards(cases, make):
    """Each (name, mutate, culprit file, words) case, applied to a fresh shard from ``make(i)``, must
    make open_shard raise a ShardError naming that file and saying those words."""
    failures = []
    for i, (name, mutate, culprit, words) in enumerate(cases):
        shard = make(i)
        mutate(pathlib.Path(shard.path))
        try:
            shards.open_shard(shard.path)
            failures.append(f"{name}: opened without error")
        except ShardError as e:
            if e.path != os.path.join(shard.path, culprit) or words not in e.problem:
                failures.append(f"{name}: {e}")
    assert not failures, "\n".join(failures)


def test_bad_shards_name_the_file_and_problem(tmp_path):
    _check_bad_shards(_bad_shards(tmp_path),
                      lambda i: write_example(tmp_path, f"s{i}", lengths=(3, 0, 5, 1, 7), ids=np.arange(5))[0])


def test_never_unpickles(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (pathlib.Path.touch, (marker,))

    np.save(tmp_path / "evil.npy", np.array([Payload()], dtype=object), allow_pickle=True)
    with pytest.raises(ShardError, match="Python objects"):
        _files.open_npy(tmp_path / "evil.npy")
    with pytest.raises(ShardError, match="Python objects"):
        shards.open_input(tmp_path / "evil.npy")
    assert not marker.exists()


def test_open_input_rejects(tmp_path):
    np.save(tmp_path / "four.npy", np.zeros((2, 3, 4, 5), np.float32))
    np.save(tmp_path / "flat.npy", np.zeros((6, 4), np.float32))
    np.save(tmp_path / "pad.npy", np.zeros((3, 4, 5), np.float32))
    np.save(tmp_path / "big.npy", np.zeros((3, 4, 5), np.float32).astype(">f4"))
    np.save(tmp_path / "f64.npy", np.zeros((3, 4, 5)))
    np.save(tmp_path / "u16.npy", np.zeros((3, 4, 5), np.uint16))
    np.save(tmp_path / "d0.npy", np.zeros((3, 4, 0), np.float32))
    np.save(tmp_path / "lens_big.npy", np.array([1, 5, 2]))
    np.save(tmp_path / "lens_neg.npy", np.array([1, -1, 2]))
    np.save(tmp_path / "lens_2.npy", np.array([1, 2]))
    np.save(tmp_path / "lens_f.npy", np.array([1.0, 2.0, 3.0]))
    np.save(tmp_path / "lens_wrap.npy", np.array([2**63 - 1, 2**63 - 1, 2, 6], np.uint64))  # wraps to 6 == T
    np.save(tmp_path / "lens_neg_sum.npy", np.array([2**62, 2**62, 6], np.uint64))  # wraps below 0
    (tmp_path / "lens_str.json").write_text('[1, "2", 3]')
    (tmp_path / "lens_bad.json").write_text("[1, 2")
    (tmp_path / "doclens.json").write_text("[1, 2, 2]")
    np.savez(tmp_path / "arch.npz", a=np.zeros(3))
    shard, _ = write_example(tmp_path)
    t = tmp_path
    cases = [
        ((t / "nope.npy",), t / "nope.npy", "no such file"),
        ((t / "four.npy",), t / "four.npy", "expected a padded [N, L, d] array"),
        ((t / "flat.npy",), t / "flat.npy", "need per-document token counts"),
        ((t / "flat.npy", t / "doclens.json"), t / "doclens.json", "doclens sum to 5 but"),
        # (a sum past int64 said "offsets are not monotone", or "doclens sum to -9223372036854775802")
        ((t / "flat.npy", t / "lens_wrap.npy"), t / "lens_wrap.npy", "doclens add up to 2**63 tokens or more"),
        ((t / "flat.npy", t / "lens_neg_sum.npy"), t / "lens_neg_sum.npy", "doclens add up to 2**63 tokens or more"),
        ((t / "big.npy",), t / "big.npy", "big-endian"),
        ((t / "f64.npy",), t / "f64.npy", "unsupported dtype float64"),
        ((t / "u16.npy",), t / "u16.npy", "--bf16-bits"),
        ((t / "d0.npy",), t / "d0.npy", "embedding dim is 0"),
        ((t / "pad.npy", t / "lens_big.npy"), t / "lens_big.npy", "length 5 at index 1 is out of range 0..4"),
        ((t / "pad.npy", t / "lens_neg.npy"), t / "lens_neg.npy", "length -1 at index 1 is negative"),
        ((t / "pad.npy", t / "lens_2.npy"), t / "lens_2.npy", "expected 3 lengths"),
        ((t / "pad.npy", t / "lens_f.npy"), t / "lens_f.npy", "lengths must be integers"),
        ((t / "pad.npy", t / "lens_str.json"), t / "lens_str.json", "JSON list of integers"),
        ((t / "pad.npy", t / "lens_bad.json"), t / "lens_bad.json", "not a JSON list"),
        ((t / "pad.npy", t / "nolens.npy"), t / "nolens.npy", "no such file"),
        ((t / "arch.npz",), t / "arch.npz", ".npz archive"),
        ((shard.path, t / "lens_2.npy"), t / "lens_2.npy", "a lengths file goes with a .npy input only"),
    ]
    for args, culprit, words in cases:
        with pytest.raises(ShardError) as info:
            shards.open_input(*args)
        assert info.value.path == str(culprit) and words in info.value.problem, str(info.value)
    u16 = shards.open_input(t / "u16.npy", bf16_bits=True)
    assert u16.dtype == "bfloat16"


# --------------------------------------------------------------------------- value scans


def test_scan_values_and_check_finite(tmp_path):
    rng = np.random.default_rng(9)
    docs = ragged(rng, [2, 3, 4])
    clean = shards.write_shard(tmp_path / "clean", np.concatenate(docs), offsets_of(docs))
    assert shards.scan_values(clean) == shards.ValueScan(None, None)
    shards.check_finite(clean)

    tokens = np.concatenate(docs)
    tokens[6, 0] = np.inf  # document 2, token 1
    tokens[3] *= 2  # document 1, token 1: norm 2
    bad = shards.write_shard(tmp_path / "bad", tokens, offsets_of(docs), ids=["a", "b", "c"])
    scan = shards.scan_values(bad, max_bytes=1)
    assert scan.nonfinite == (2, 1)
    assert scan.not_unit[:2] == (1, 1) and abs(scan.not_unit[2] - 2) < 1e-3 and not scan.normalized
    with pytest.raises(ShardError, match=r"tokens.npy: document 2 \(id 'c'\), token 1 holds NaN or inf"):
        shards.check_finite(bad, max_bytes=1)


def test_nan_in_padding_is_not_a_value(tmp_path):
    D = unit(np.random.default_rng(10).standard_normal((3, 4, DIM)))
    D[1, 2:] = np.nan  # padding of document 1
    np.save(tmp_path / "d.npy", D)
    np.save(tmp_path / "l.npy", np.array([4, 2, 4]))
    s = shards.open_input(tmp_path / "d.npy", tmp_path / "l.npy")
    shards.check_finite(s)
    assert shards.scan_values(s).normalized
    with pytest.raises(ShardError, match=r"d.npy: document 1, token 2 holds NaN"):
        shards.check_finite(shards.open_input(tmp_path / "d.npy"))


# --------------------------------------------------------------------------- INT8 shards


def quantized(x):
    """The reference quantizer, on float32 values: what an INT8 shard must hold."""
    from lik_cupy._cpu import quantize_numpy

    return quantize_numpy(np.asarray(x).astype(np.float32))


def write_int8_example(tmp_path, name="q", lengths=(3, 0, 5, 1, 7), ids=None, seed=0, dim=DIM):
    docs = ragged(np.random.default_rng(seed), lengths, dim)
    return shards.write_shard(tmp_path / name, np.concatenate(docs), offsets_of(docs), ids=ids, dtype="int8"), docs


@pytest.mark.parametrize("source", [np.float16, np.float32, ml_dtypes.bfloat16])
def test_int8_write_then_open_round_trip(tmp_path, source):
    lengths = [4, 0, 9, 1, 3, 6, 17]
    docs = ragged(np.random.default_rng(11), lengths, 40)
    tokens = np.concatenate(docs).astype(source)
    tokens[5] = 0  # an all-zero token: scale 0, values 0
    s = shards.write_shard(tmp_path / "shard", tokens, offsets_of(docs), ids=np.arange(7), model="m")
    assert s.dtype == np.dtype(source).name  # the source dtype is kept unless int8 is asked for
    s8 = shards.write_shard(tmp_path / "shard8", tokens, offsets_of(docs), ids=np.arange(7), model="m", dtype="int8")
    q, scales = quantized(tokens)
    assert scales[5] == 0 and (q[5] == 0).all()
    for shard in (s8, shards.open_shard(tmp_path / "shard8")):
        assert isinstance(shard.tokens, np.memmap) and isinstance(shard.scales, np.memmap), "must be memory-mapped"
        assert (shard.dtype, shard.dim, shard.num_docs, shard.bytes_per_token) == ("int8", 40, 7, 44)
        np.testing.assert_array_equal(np.asarray(shard.tokens), q)
        np.testing.assert_array_equal(np.asarray(shard.scales), scales)
        for a, b in [(0, 7), (2, 3), (3, 6)]:
            t, off = shard.read_chunk(a, b)
            lo, hi = sum(lengths[:a]), sum(lengths[:b])
            np.testing.assert_array_equal(t, q[lo:hi])
            np.testing.assert_array_equal(shard.read_scales(a, b), scales[lo:hi])
            x32, off2 = shard.read_values(a, b)
            assert x32.dtype == np.float32 and off2.tolist() == off.tolist()
            np.testing.assert_array_equal(x32, q[lo:hi].astype(np.float32) * scales[lo:hi, None])
    m = json.loads((tmp_path / "shard8" / "manifest.json").read_text())
    assert m == {"format": "lik-shard", "version": 2, "dim": 40, "dtype": "int8", "num_docs": 7, "num_tokens": 40,
                 "normalized": False, "model": "m",  # the zero token has norm 0
                 "files": {"tokens": "tokens.npy", "offsets": "offsets.npy", "scales": "scales.npy", "ids": "ids.npy"}}
    assert np.load(tmp_path / "shard8" / "tokens.npy", allow_pickle=False).dtype == np.int8
    assert np.load(tmp_path / "shard8" / "scales.npy", allow_pickle=False).dtype == np.dtype("<f4")
    assert json.loads((tmp_path / "shard" / "manifest.json").read_text())["version"] == 1  # float shards stay v1


def test_int8_normalized_is_measured_on_the_stored_values(tmp_path):
    s, docs = write_int8_example(tmp_path, dim=64)
    assert s.manifest["normalized"]  # unit vectors stay within NORM_TOLERANCE after quantization
    scan = shards.scan_values(s)
    assert scan == shards.ValueScan(None, None)
    shards.check_finite(s)
    scaled = [d * 1.5 for d in docs]
    s2 = shards.write_shard(tmp_path / "scaled", np.concatenate(scaled), offsets_of(docs), dtype="int8")
    assert not s2.manifest["normalized"] and abs(shards.scan_values(s2).not_unit[2] - 1.5) < 0.02


def test_int8_quantizes_block_by_block(tmp_path, monkeypatch):
    """Packing never quantizes the whole corpus at once, and blocks give the same bytes as one pass."""
    from lik_cupy import _cpu as quantize

    lengths = [5, 0, 40, 3, 22, 9, 1, 30]
    docs = ragged(np.random.default_rng(12), lengths)
    tokens = np.concatenate(docs).astype(np.float16)
    np.save(tmp_path / "flat.npy", tokens)
    np.save(tmp_path / "lens.npy", np.array(lengths))
    source = shards.open_input(tmp_path / "flat.npy", tmp_path / "lens.npy")
    seen = []
    real = quantize.quantize_numpy

    def spy(x, **kw):
        seen.append(x.shape[0])
        return real(x, **kw)

    monkeypatch.setattr(quantize, "quantize_numpy", spy)
    block = 16 * DIM * 2  # about 16 float16 tokens per block (a longer document goes whole)
    s = shards.pack(source, tmp_path / "blocks", dtype="int8", max_bytes=block)
    assert len(seen) > 4 and max(seen) <= max(lengths) < tokens.shape[0]
    q, scales = quantized(tokens)
    np.testing.assert_array_equal(np.asarray(s.tokens), q)
    np.testing.assert_array_equal(np.asarray(s.scales), scales)


def test_int8_convert_back_and_forth(tmp_path):
    s8, docs = write_int8_example(tmp_path, ids=["a", "b", "c", "d", "e"])
    deq = np.asarray(s8.tokens).astype(np.float32) * np.asarray(s8.scales)[:, None]
    f32 = shards.pack(s8, tmp_path / "f32", dtype="float32")  # dequantized
    assert f32.dtype == "float32" and f32.manifest["version"] == 1 and f32.ids.tolist() == ["a", "b", "c", "d", "e"]
    np.testing.assert_array_equal(np.asarray(f32.tokens), deq)
    shards.pack(s8, tmp_path / "copy")  # int8 -> int8: copied as stored, not re-quantized
    for name in ("tokens.npy", "scales.npy", "offsets.npy", "ids.npy", "manifest.json"):
        assert (tmp_path / "q" / name).read_bytes() == (tmp_path / "copy" / name).read_bytes(), name
    own = shards.write_shard(tmp_path / "own", np.asarray(s8.tokens), s8.offsets, scales=np.asarray(s8.scales))
    np.testing.assert_array_equal(np.asarray(own.tokens), np.asarray(s8.tokens))
    arrays = shards.pack_arrays(docs, tmp_path / "arrays", dtype="int8")
    np.testing.assert_array_equal(np.asarray(arrays.tokens), np.asarray(s8.tokens))
    Q, lens = shards._load_padded(s8)  # INT8 queries come back dequantized
    assert Q.dtype == np.float32 and lens.tolist() == [3, 0, 5, 1, 7]
    np.testing.assert_array_equal(Q[2, :5], deq[3:8])


def test_int8_write_failures_leave_nothing(tmp_path, monkeypatch):
    from lik_cupy import _cpu as quantize

    docs = ragged(np.random.default_rng(13), [2, 3, 4])
    tokens, off = np.concatenate(docs), offsets_of(docs)
    bad = tokens.copy()
    bad[3, 2] = np.inf  # document 1, token 1
    with pytest.raises(ShardError, match=r"^tokens: document 1, token 1 holds NaN or inf; INT8 quantization needs finite values$"):
        shards.write_shard(tmp_path / "s", bad, off, dtype="int8")  # refused even without check_finite
    assert listing(tmp_path) == []
    cases = [
        (dict(tokens=quantized(tokens)[0], offsets=off), "tokens: dtype int8 needs per-token scales"),
        (dict(tokens=tokens, offsets=off, scales=quantized(tokens)[1]), "scales: scales go with int8 tokens"),
        (dict(tokens=quantized(tokens)[0], offsets=off, scales=quantized(tokens)[1][:-1]), r"scales: shape \(8,\) does not match the 9 token rows"),
        (dict(tokens=quantized(tokens)[0], offsets=off, scales=quantized(tokens)[1].astype(np.float64)), r"scales: dtype <f8; expected float32"),
        (dict(tokens=quantized(tokens)[0], offsets=off, scales=-quantized(tokens)[1]), r"scales: scale of token 0 \(document 0, token 0\) is -"),
        (dict(tokens=tokens, offsets=off, dtype="int4"), "dtype 'int4' is not one of float16, float32, bfloat16, int8"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ShardError, match=message):
            shards.write_shard(tmp_path / "s", **kwargs)
    assert listing(tmp_path) == []

    # A failure in the middle of a write (the second block) leaves no partial shard, and an
    # existing shard that was to be replaced stays as it was.
    write_int8_example(tmp_path, name="s")
    before = {n: (tmp_path / "s" / n).read_bytes() for n in listing(tmp_path / "s")}
    real, calls = quantize.quantize_numpy, []

    def fail_second(x, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(x, **kw)

    monkeypatch.setattr(quantize, "quantize_numpy", fail_second)
    source = shards.open_input(*_flat_files(tmp_path, tokens, [2, 3, 4]))
    with pytest.raises(OSError, match="disk full"):
        shards.pack(source, tmp_path / "s", dtype="int8", overwrite=True, max_bytes=3 * DIM * 4)
    assert listing(tmp_path) == ["flat.npy", "lens.npy", "s"]
    assert {n: (tmp_path / "s" / n).read_bytes() for n in listing(tmp_path / "s")} == before


def _flat_files(tmp_path, tokens, lengths):
    np.save(tmp_path / "flat.npy", tokens)
    np.save(tmp_path / "lens.npy", np.array(lengths))
    return tmp_path / "flat.npy", tmp_path / "lens.npy"


def _bad_int8_shards(tmp_path):
    """(name, mutate(shard_dir), file at fault (relative to the shard), words of the problem) for an INT8 shard."""
    def save(name, arr):
        return lambda d: np.save(d / name, arr, allow_pickle=True)

    def scales_with(value, at=4):
        def mutate(d):
            s = np.load(d / "scales.npy")
            s[at] = value
            np.save(d / "scales.npy", s)
        return mutate

    def link_outside(d):
        np.save(tmp_path / "outside_scales.npy", np.ones(16, np.float32))
        os.symlink(tmp_path / "outside_scales.npy", d / "evil.npy")
        _edit_manifest(d, files={"tokens": "tokens.npy", "offsets": "offsets.npy", "scales": "evil.npy"})

    files = {"tokens": "tokens.npy", "offsets": "offsets.npy"}
    return [
        ("scales missing", lambda d: (d / "scales.npy").unlink(), "scales.npy", "no such file"),
        ("scales truncated", lambda d: (d / "scales.npy").write_bytes((d / "scales.npy").read_bytes()[:-8]), "scales.npy", "truncated"),
        ("scales float64", save("scales.npy", np.ones(16)), "scales.npy", "expected float32 (<f4)"),
        ("scales float16", save("scales.npy", np.ones(16, np.float16)), "scales.npy", "expected float32 (<f4)"),
        ("scales short", save("scales.npy", np.ones(15, np.float32)), "scales.npy", "expected [16] (one scale per token)"),
        ("scales 2-D", save("scales.npy", np.ones((16, 1), np.float32)), "scales.npy", "expected [16]"),
        ("scales NaN", scales_with(np.nan), "scales.npy", "scale of token 4 (document 2, token 1) is nan; expected a finite value >= 0"),
        ("scales inf", scales_with(np.inf, 15), "scales.npy", "scale of token 15 (document 4, token 6) is inf"),
        ("scales negative", scales_with(-0.5, 0), "scales.npy", "scale of token 0 (document 0, token 0) is -0.5"),
        ("scales objects", save("scales.npy", np.array([1.0] * 15 + ["x"], dtype=object)), "scales.npy", "Python objects"),
        ("no scales named", lambda d: _edit_manifest(d, files=files), "manifest.json", 'files names no "scales"'),
        ("scales name not a string", lambda d: _edit_manifest(d, files={**files, "scales": 3}), "manifest.json", "files.scales is 3"),
        ("scales outside", lambda d: _edit_manifest(d, files={**files, "scales": "../scales.npy"}), "manifest.json", "not inside the shard directory"),
        ("scales absolute", lambda d: _edit_manifest(d, files={**files, "scales": str(d / "scales.npy")}), "manifest.json", "not inside the shard directory"),
        ("scales symlink out", link_outside, "manifest.json", "leads outside the shard directory"),
        ("float dtype with scales", lambda d: (_edit_manifest(d, dtype="float16"), save("tokens.npy", np.zeros((16, DIM), np.float16))(d)),
         "manifest.json", "only int8 shards have scales"),
        ("int8 manifest, float tokens", save("tokens.npy", np.zeros((16, DIM), np.float16)), "tokens.npy", "does not match the manifest's dtype int8"),
        ("tokens uint8", save("tokens.npy", np.zeros((16, DIM), np.uint8)), "tokens.npy", "does not match the manifest's dtype int8"),
    ]


def test_bad_int8_shards_name_the_file_and_problem(tmp_path):
    _check_bad_shards(_bad_int8_shards(tmp_path), lambda i: write_int8_example(tmp_path, f"s{i}")[0])


def test_int8_npy_inputs_are_refused_with_a_hint(tmp_path):
    np.save(tmp_path / "q8.npy", np.zeros((3, 4, DIM), np.int8))
    with pytest.raises(ShardError, match="needs its per-token scales.*lik pack --int8") as info:
        shards.open_input(tmp_path / "q8.npy")
    assert info.value.path == str(tmp_path / "q8.npy")


# --------------------------------------------------------------------------- memory, in bytes

# max_bytes of the tests below: their sources (64k tokens of d = 128, 16 MiB as float16) come in
# many blocks. Besides its blocks, a pack reads the written shard's manifest, which takes up to
# 1 MiB (read whole up to its limit); _SLACK is that and Python's own.
_BOUND = 4 << 20
_SLACK = 3 << 19
_MEMORY_DIM = 128


def _peak_extra(fn) -> int:
    """The peak of NumPy's and Python's allocations while ``fn`` runs, beyond what was held before."""
    tracemalloc.start()
    try:
        held = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - held
    finally:
        tracemalloc.stop()


def _memory_source(tmp_path, layout: str, dtype: str):
    """A source of ``layout`` holding 65,536 unit tokens (and padding) in ``dtype``, opened."""
    rng = np.random.default_rng(21)
    x = unit(rng.standard_normal((1 << 16, _MEMORY_DIM), np.float32))
    x[7] = 0  # an all-zero token (scale 0)
    lens = rng.integers(0, 250, 512)
    lens[-1] = 0
    lens[-1] = x.shape[0] - lens.sum()
    assert lens[-1] >= 0
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    if layout == "shard":
        if dtype == "int8":
            return shards.write_shard(tmp_path / "src", x, off, dtype="int8")
        return shards.write_shard(tmp_path / "src", x.astype(fmt_dtype(dtype)), off)
    if layout in ("flat", "fortran"):
        tokens = x.astype(fmt_dtype(dtype))
        assert dtype != "bfloat16"
        np.save(tmp_path / "src.npy", np.asfortranarray(tokens) if layout == "fortran" else tokens)
        np.save(tmp_path / "lens.npy", lens)
        return shards.open_input(tmp_path / "src.npy", tmp_path / "lens.npy")
    if layout == "strided":  # a caller's array whose rows are not back to back
        wide = np.empty((x.shape[0], 2 * _MEMORY_DIM), fmt_dtype(dtype))
        wide[:, ::2] = x
        return shards._packed("tokens", wide[:, ::2], off, None, None, "tokens", "offsets", "ids")
    padded = x.reshape(512, 128, _MEMORY_DIM).astype(fmt_dtype(dtype))
    bits = dtype == "bfloat16"  # saved as its uint16 bits
    np.save(tmp_path / "src.npy", padded.view(np.uint16) if bits else padded)
    if layout == "padded":
        return shards.open_input(tmp_path / "src.npy", bf16_bits=bits)
    np.save(tmp_path / "lens.npy", rng.integers(0, 129, 512))
    return shards.open_input(tmp_path / "src.npy", tmp_path / "lens.npy", bf16_bits=bits)


def fmt_dtype(name: str):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def _same_shards(a, b):
    assert listing(a) == listing(b)
    for name in listing(a):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize("layout,source,dtype,check", [
    ("shard", "float16", None, False), ("shard", "float32", None, False), ("shard", "bfloat16", None, False),
    ("shard", "float32", "float16", True), ("shard", "float16", "float32", False),
    ("shard", "float16", "bfloat16", True), ("shard", "float16", "int8", False), ("shard", "float32", "int8", True),
    ("shard", "bfloat16", "int8", False), ("shard", "int8", None, False), ("shard", "int8", "float16", False),
    ("shard", "int8", "float32", True), ("flat", "float16", None, False), ("flat", "float16", "int8", False),
    ("fortran", "float16", None, True), ("fortran", "float32", "int8", False), ("strided", "float32", None, True),
    ("strided", "float16", "int8", False), ("padded", "float16", None, False), ("padded", "float16", "int8", False),
    ("padded-lengths", "float16", None, True), ("padded-lengths", "float16", "int8", False),
    ("padded-lengths", "bfloat16", "float32", False),
])
def test_pack_memory_is_bounded_by_max_bytes(tmp_path, layout, source, dtype, check):
    """pack sized its blocks by the tokens read, then held their float32 values, masks and the
    quantiser's temporaries on top: 2-8.7x max_bytes at its peak (float16 to int8: 8.6x, about
    1.2 GiB at the default 256 MiB). Blocks are sized by all they hold now, and write the same
    bytes as one block does."""
    src = _memory_source(tmp_path, layout, source)
    one = shards.pack(src, tmp_path / "one", dtype=dtype, check_finite=check, max_bytes=1 << 30)  # (imports too)
    peak = _peak_extra(lambda: shards.pack(src, tmp_path / "blocks", dtype=dtype, check_finite=check, max_bytes=_BOUND))
    assert peak <= 1.5 * _BOUND + _SLACK, f"peak {peak / 2**20:.1f} MiB for max_bytes {_BOUND / 2**20:.0f} MiB"
    assert one.num_docs == src.num_docs and one.dtype == (dtype or source)
    _same_shards(tmp_path / "one", tmp_path / "blocks")


def test_pack_arrays_memory_is_bounded(tmp_path, monkeypatch):
    """pack_arrays writes each document in blocks of the same bound (CHUNK_BYTES; smaller here)."""
    rng = np.random.default_rng(22)
    docs = [unit(rng.standard_normal((n, _MEMORY_DIM), np.float32)).astype(ml_dtypes.bfloat16)
            for n in (30000, 5, 0, 20000, 15531)]
    one = shards.pack_arrays(docs, tmp_path / "one", dtype="int8")
    monkeypatch.setattr(shards, "CHUNK_BYTES", _BOUND)
    peak = _peak_extra(lambda: shards.pack_arrays(docs, tmp_path / "blocks", dtype="int8"))
    assert peak <= 1.5 * _BOUND + _SLACK, f"peak {peak / 2**20:.1f} MiB for max_bytes {_BOUND / 2**20:.0f} MiB"
    assert one.manifest["normalized"] and one.num_docs == 5
    _same_shards(tmp_path / "one", tmp_path / "blocks")


@pytest.mark.parametrize("layout,dtype", [("shard", "float16"), ("shard", "float32"), ("shard", "int8"),
                                          ("padded-lengths", "bfloat16")])
def test_value_scans_are_bounded_by_max_bytes(tmp_path, layout, dtype):
    """scan_values and check_finite held each block's float32 values and the last block's at once
    (4-7.8x max_bytes); now each block's values, mask and tokens fit in max_bytes."""
    src = _memory_source(tmp_path, layout, dtype)
    whole = shards.scan_values(src, max_bytes=1 << 30)
    for fn in (shards.scan_values, shards.check_finite):
        got = []
        peak = _peak_extra(lambda: got.append(fn(src, max_bytes=_BOUND)))
        assert peak <= 1.5 * _BOUND + (256 << 10), f"{fn.__name__}: peak {peak / 2**20:.1f} MiB for {_BOUND / 2**20:.0f} MiB"
    assert got == [None] and shards.scan_values(src, max_bytes=_BOUND) == whole and whole.nonfinite is None


@pytest.mark.parametrize("kind", ["U", "S"])
def test_string_id_checks_are_bounded_by_their_block(kind, monkeypatch):
    """Checking string ids (whenever a shard is written or opened) read 8 MiB of ids a block and
    held 4.9x (str) to 7x (bytes) of that at once in masks of their code units, np.isin's among
    them: 39-56 MiB. The block's copy, its masks and flags fit in _ID_BLOCK_BYTES now, and the
    first bad id is still found wherever the blocks fall."""
    n = 600_000  # 38 MB of str ids, 9.6 MB of bytes: more than one block
    ids = np.array([f"doc-{i:010d}" for i in range(n)], dtype=f"{kind}16")
    fmt.check_ids(ids[:10], 10, "ids")  # (imports)
    peak = _peak_extra(lambda: fmt.check_ids(ids, n, "ids"))
    assert peak <= fmt._ID_BLOCK_BYTES + (64 << 10), f"peak {peak / 2**20:.1f} MiB"
    monkeypatch.setattr(fmt, "_ID_BLOCK_BYTES", 1000)  # a dozen ids a block
    few = ids[:2000]
    fmt.check_ids(few, 2000, "ids")
    for at, ch in [(0, "\t"), (11, "\u2028"), (1999, "\x85"), (777, "\0")]:
        bad = few.copy()
        bad[at] = f"x{ch}y".encode() if kind == "S" else f"x{ch}y"
        with pytest.raises(ShardError, match=f"^ids: id at index {at} "):
            fmt.check_ids(bad, 2000, "ids")


@pytest.mark.parametrize("ids", [[1, "b", 2], [True, 1, 2], ["a", b"b", "c"]])
def test_a_list_of_ids_of_mixed_kinds_is_refused_before_writing(tmp_path, ids):
    # NumPy made one kind of them ([1, "b", 2] the strings '1', 'b', '2'; True the id 1), and the shard kept
    # those: the rule Corpus's ids follow, before anything is written.
    docs = [np.ones((2, 4), np.float32)] * 3
    with pytest.raises(ShardError, match=r"ids\[0\] is .* but ids\[\d\] is .*: ids are all integers"):
        shards.pack_arrays(docs, tmp_path / "s", ids=ids)
    assert not (tmp_path / "s").exists()
