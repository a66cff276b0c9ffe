"""``lik``: score padded .npy token embeddings with lik_cupy.maxsim from the command line.

This module is deliberately thin: argument parsing, input checks, streaming the
document shards chunk by chunk, a running top-k, and atomic output.  All scoring
goes through :func:`lik_cupy.maxsim`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import signal
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass, field

import click
import numpy as np

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
OUTPUT_SUFFIXES = (".tsv", ".jsonl", ".npy")
# Bytes of document embeddings read (and scores produced) per lik_cupy.maxsim call.
CHUNK_BYTES = 64 << 20
NPY_MAGIC = b"\x93NUMPY"

FORMAT_HELP = """\b
Input format (NumPy .npy files, zero-padded, one token embedding per row):
  queries  [Nq, Lq, d]  float16 or float32 (bfloat16: store the bits as
                        uint16 and pass --bf16-bits)
  docs     [N, L, d]    one or more shards, same dtype rules; d must match
                        the queries, L may differ between shards
  lengths  [Nq] or [N]  optional integer arrays: how many leading token
                        rows of each query / doc are real (0..L); without
                        them every row counts. One --d-lengths per shard.
Doc ids are global: shard 0 gives ids 0..N0-1, shard 1 continues at N0, ...

\b
Make the files from Python, e.g.:
  np.save("q.npy", q.astype(np.float16))     # q: [Nq, Lq, d]
  np.save("d0.npy", d0.astype(np.float16))   # d0: [N, L, d]
  np.save("l0.npy", np.asarray(lens, np.int32))
"""


# --------------------------------------------------------------------------- errors


class LikError(Exception):
    """Bad input or environment: reported as ``lik: error: <what>: <problem>``, exit 2."""

    def __init__(self, what: object, problem: str):
        super().__init__(f"{what}: {problem}")
        self.what = str(what)
        self.problem = problem


def _cli_errors(fn):
    """Turn LikError / KeyboardInterrupt / crashes into one stderr line and an exit code.

    A traceback is printed only when the command got ``--debug``.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        debug = bool(kwargs.get("debug"))
        try:
            return fn(*args, **kwargs)
        except click.exceptions.Exit:
            raise
        except click.ClickException:
            raise
        except click.Abort:
            raise
        except LikError as e:
            if debug:
                traceback.print_exc()
            click.echo(f"lik: error: {e}", err=True)
            raise click.exceptions.Exit(EXIT_BAD_INPUT) from None
        except KeyboardInterrupt:
            if debug:
                traceback.print_exc()
            click.echo("lik: interrupted; no output written", err=True)
            raise click.exceptions.Exit(EXIT_INTERRUPTED) from None
        except Exception as e:  # a bug or an environment problem, not bad input
            if debug:
                traceback.print_exc()
            hint = "" if debug else " (rerun with --debug for a traceback)"
            click.echo(f"lik: error: internal error: {type(e).__name__}: {e}{hint}", err=True)
            raise click.exceptions.Exit(1) from None

    return wrapper


# --------------------------------------------------------------------------- input files


def _open_npy(path: str, mmap: bool = True) -> np.ndarray:
    """np.load(mmap_mode='r', allow_pickle=False) with every failure turned into a LikError."""
    if not os.path.exists(path):
        raise LikError(path, "no such file")
    if os.path.isdir(path):
        raise LikError(path, "is a directory, expected a .npy file")
    try:
        with open(path, "rb") as f:
            magic = f.read(len(NPY_MAGIC))
    except OSError as e:
        raise LikError(path, f"cannot read: {e.strerror or e}") from None
    if not magic:
        raise LikError(path, "empty file, expected a .npy array")
    if magic[:2] == b"PK":
        raise LikError(path, "is a .npz archive; save each array with np.save as its own .npy")
    if magic != NPY_MAGIC:
        raise LikError(path, "not a .npy file (bad magic bytes); write it with numpy.save")
    try:
        arr = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except ValueError as e:
        msg = str(e)
        if "mmap length is greater than file size" in msg or "cannot reshape" in msg:
            problem = "truncated .npy file: it holds fewer bytes than its header's shape needs"
        elif "EOF" in msg:
            problem = f"truncated .npy header ({msg})"
        elif "object" in msg.lower() or "pickle" in msg.lower():
            problem = "holds Python objects (object dtype); only numeric arrays are read"
        else:
            problem = f"corrupt .npy file ({msg})"
        raise LikError(path, problem) from None
    except (OSError, EOFError, SyntaxError, TypeError) as e:
        raise LikError(path, f"corrupt .npy file ({type(e).__name__}: {e})") from None
    if not isinstance(arr, np.ndarray):  # pragma: no cover - np.load of a .npy is always an array
        raise LikError(path, "not a single .npy array")
    return arr


def _dtype_tag(arr: np.ndarray, path: str, bf16_bits: bool) -> str:
    """'float16' | 'float32' | 'bfloat16' for an embeddings file, else LikError."""
    dt = arr.dtype
    if dt.kind == "f" and dt.itemsize in (2, 4):
        return "float16" if dt.itemsize == 2 else "float32"
    if dt.kind == "u" and dt.itemsize == 2:
        if bf16_bits:
            return "bfloat16"
        raise LikError(path, "dtype uint16 is not an embedding dtype; if it holds bfloat16 bits pass --bf16-bits")
    if dt.kind == "V" and dt.itemsize == 2:
        raise LikError(
            path,
            "dtype |V2 (bfloat16 saved via ml_dtypes?) cannot be read back safely; "
            "save arr.view(np.uint16) instead and pass --bf16-bits",
        )
    raise LikError(
        path,
        f"unsupported dtype {dt}; expected float16, float32, or bfloat16 bits stored as uint16 (--bf16-bits)",
    )


def _compute_dtype(tag: str):
    if tag == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(tag)


def _to_compute(a: np.ndarray, tag: str, compute: np.dtype) -> np.ndarray:
    """Read a (memory-mapped) slice into memory as a native-order array of ``compute`` dtype."""
    a = np.ascontiguousarray(a)
    if tag == "bfloat16":
        import ml_dtypes

        a = a.astype(np.dtype("=u2"), copy=False).view(ml_dtypes.bfloat16)
    else:
        a = a.astype(a.dtype.newbyteorder("="), copy=False)
    if a.dtype != compute:
        a = a.astype(compute)
    return a


def _load_lengths(path: str, n: int, maxlen: int, rows_of: str) -> np.ndarray:
    arr = _open_npy(path, mmap=False)
    if arr.dtype.kind not in "iu":
        raise LikError(path, f"lengths must be integers, got dtype {arr.dtype}")
    if arr.ndim != 1 or arr.shape[0] != n:
        raise LikError(path, f"expected shape ({n},) (one length per row of {rows_of}), got {arr.shape}")
    if n:
        bad = np.flatnonzero((arr < 0) | (arr > maxlen))
        if bad.size:
            i = int(bad[0])
            raise LikError(path, f"length {int(arr[i])} at index {i} is out of range 0..{maxlen} (padded length of {rows_of})")
    return arr.astype(np.int32)


@dataclass
class _Shard:
    path: str
    arr: np.ndarray
    tag: str
    lengths: np.ndarray | None = None
    n: int = field(init=False)
    length: int = field(init=False)

    def __post_init__(self):
        self.n, self.length = int(self.arr.shape[0]), int(self.arr.shape[1])


def _open_embeddings(path: str, role: str, bf16_bits: bool) -> tuple[np.ndarray, str]:
    arr = _open_npy(path)
    if arr.ndim != 3:
        shape = "[Nq, Lq, d]" if role == "queries" else "[N, L, d]"
        raise LikError(path, f"expected a 3-D {role} array {shape}, got shape {arr.shape}")
    tag = _dtype_tag(arr, path, bf16_bits)
    if arr.shape[1] == 0 or arr.shape[2] == 0:
        raise LikError(path, f"token axis and embedding dim must be non-zero, got shape {arr.shape}")
    return arr, tag


# --------------------------------------------------------------------------- top-k


def _desc_keys(v: np.ndarray) -> np.ndarray:
    """uint32 keys whose ascending order is: +inf, ..., -inf, NaN (descending score, NaN last)."""
    v = np.asarray(v, dtype=np.float32) + np.float32(0.0)  # -0.0 -> +0.0 so they tie
    b = v.view(np.uint32)
    asc = np.where(b & np.uint32(0x80000000), ~b, b | np.uint32(0x80000000))
    desc = ~asc
    desc[np.isnan(v)] = np.uint32(0xFFFFFFFF)
    return desc


def _merge_topk(vals, ids, new_vals, first_id: int, k: int):
    """Merge a score block for ids first_id.. into a running top-k.

    ``vals``/``ids`` [Nq, m<=k] are the current top-k, ordered best first; every id in
    them is < first_id.  Order: higher score first, ties -> lower doc id, NaN last.
    """
    nq, n = new_vals.shape
    new_ids = np.broadcast_to(np.arange(first_id, first_id + n, dtype=np.int64), (nq, n))
    V = np.concatenate([vals, np.asarray(new_vals, np.float32)], axis=1)
    I = np.concatenate([ids, new_ids], axis=1)
    m = V.shape[1]
    # Column position grows with doc id, so (score key, position) is a unique, exact sort key.
    key = (_desc_keys(V).astype(np.uint64) << np.uint64(32)) | np.arange(m, dtype=np.uint64)
    if m > k:
        key = np.take_along_axis(key, np.argpartition(key, k - 1, axis=1)[:, :k], axis=1)
    key = np.sort(key, axis=1)
    pos = (key & np.uint64(0xFFFFFFFF)).astype(np.intp)
    return np.take_along_axis(V, pos, axis=1), np.take_along_axis(I, pos, axis=1)


# --------------------------------------------------------------------------- output


def _format_score(x) -> str:
    return str(np.float32(x))  # shortest repr that round-trips float32; 'nan', '-inf'


def _write_tsv(f, vals, ids):
    f.write("query\trank\tdoc\tscore\n")
    for q in range(vals.shape[0]):
        f.write("".join(f"{q}\t{r + 1}\t{int(ids[q, r])}\t{_format_score(vals[q, r])}\n" for r in range(vals.shape[1])))


def _write_jsonl(f, vals, ids):
    for q in range(vals.shape[0]):
        for r in range(vals.shape[1]):
            s = vals[q, r]
            score = float(_format_score(s)) if np.isfinite(s) else None  # JSON has no inf/NaN
            f.write(json.dumps({"query": q, "rank": r + 1, "doc": int(ids[q, r]), "score": score}) + "\n")


def _check_output(out: str, full_matrix: bool, top_k: int) -> tuple[str, str]:
    if top_k < 1:
        raise LikError("--top-k", f"must be at least 1, got {top_k}")
    suffix = os.path.splitext(out)[1].lower()
    if suffix not in OUTPUT_SUFFIXES:
        raise LikError(out, f"unknown output suffix {repr(suffix) if suffix else '(none)'}; use .tsv, .jsonl or .npy")
    if full_matrix and suffix != ".npy":
        raise LikError(out, "--full-matrix writes the [Nq, Ndocs] float32 score matrix and needs a .npy output")
    if os.path.isdir(out):
        raise LikError(out, "is a directory, expected an output file name")
    outdir = os.path.dirname(os.path.abspath(out))
    if not os.path.exists(outdir):
        raise LikError(out, f"output directory {outdir} does not exist")
    if not os.path.isdir(outdir):
        raise LikError(out, f"{outdir} is not a directory")
    if not os.access(outdir, os.W_OK | os.X_OK):
        raise LikError(out, f"output directory {outdir} is not writable")
    return suffix, outdir


@contextlib.contextmanager
def _atomic_output(out: str, outdir: str):
    """Yield a temp path in the target directory; os.replace it onto ``out`` on success,
    delete it on any error or KeyboardInterrupt."""
    base = os.path.basename(out)
    try:
        fd, tmp = tempfile.mkstemp(dir=outdir, prefix=f".{base}.", suffix=".part")
    except OSError as e:
        raise LikError(out, f"cannot create a file in {outdir}: {e.strerror or e}") from None
    os.close(fd)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the usual permissions
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# --------------------------------------------------------------------------- scoring


class _NoBar:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n):
        pass


def _progress(total: int, label: str):
    if sys.stderr.isatty():
        return click.progressbar(length=total, label=label, file=sys.stderr)
    return _NoBar()


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """Treat SIGTERM like Ctrl-C while scoring, so the temp file is cleaned up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _import_lik():
    try:
        import lik_cupy
    except Exception as e:
        raise LikError("lik_cupy", f"cannot import the library: {type(e).__name__}: {e}") from None
    return lik_cupy


def _gpu_available(lik) -> bool:
    try:
        return bool(lik.gpu_available())
    except Exception:
        return False


def _device_context(device: int | None):
    if device is None:
        return contextlib.nullcontext()
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        raise LikError("--device", f"cannot query GPUs: {e}") from None
    if not 0 <= device < count:
        raise LikError("--device", f"no GPU {device}; {count} visible (0..{count - 1})")
    return cupy.cuda.Device(device)


def _to_numpy(x) -> np.ndarray:
    if not isinstance(x, np.ndarray) and hasattr(x, "get"):  # CuPy array
        x = x.get()
    return np.asarray(x, dtype=np.float32)


@dataclass
class ScoreResult:
    n_queries: int
    n_docs: int
    backend: str
    top_vals: np.ndarray | None = None
    top_ids: np.ndarray | None = None


def run_score(
    queries: str,
    docs: list[str] | tuple[str, ...],
    out: str,
    *,
    q_lengths: str | None = None,
    d_lengths: list[str] | tuple[str, ...] = (),
    top_k: int = 10,
    full_matrix: bool = False,
    cpu: bool = False,
    device: int | None = None,
    bf16_bits: bool = False,
    chunk_docs: int = 0,
) -> ScoreResult:
    """Check inputs, stream every shard through lik_cupy.maxsim, write ``out`` atomically."""
    suffix, outdir = _check_output(out, full_matrix, top_k)
    if not docs:
        raise LikError("--docs", "give at least one doc shard .npy")
    if d_lengths and len(d_lengths) != len(docs):
        raise LikError(
            "--d-lengths",
            f"got {len(d_lengths)} lengths file(s) for {len(docs)} doc shard(s); give one per shard, in the same order",
        )
    if chunk_docs < 0:
        raise LikError("--chunk-docs", f"must be >= 0 (0 = automatic), got {chunk_docs}")

    Q, qtag = _open_embeddings(queries, "queries", bf16_bits)
    nq, lq, dim = (int(s) for s in Q.shape)
    if nq == 0:
        raise LikError(queries, "holds no queries (Nq = 0)")
    qlen = _load_lengths(q_lengths, nq, lq, queries) if q_lengths else None

    shards = []
    for i, path in enumerate(docs):
        arr, tag = _open_embeddings(path, "docs", bf16_bits)
        if arr.shape[2] != dim:
            others = f" and from shard {docs[0]}" if i else ""
            raise LikError(path, f"embedding dim d={arr.shape[2]} differs from the queries' d={dim} ({queries}){others}")
        shard = _Shard(path, arr, tag)
        if d_lengths:
            shard.lengths = _load_lengths(d_lengths[i], shard.n, shard.length, path)
        shards.append(shard)
    n_docs = sum(s.n for s in shards)
    if n_docs == 0:
        raise LikError(docs[0], "no documents in any shard")

    tags = {qtag, *(s.tag for s in shards)}
    ctag = tags.pop() if len(tags) == 1 else "float32"  # mixed dtypes: score in float32
    compute = _compute_dtype(ctag)

    lik = _import_lik()
    if cpu:
        backend = "cpu"
    elif _gpu_available(lik):
        backend = "gpu"
    else:
        backend = "cpu"
        click.echo("lik: no usable GPU found, falling back to CPU (pass --cpu to silence this)", err=True)
    dev_ctx = _device_context(device) if backend == "gpu" else contextlib.nullcontext()

    k = min(top_k, n_docs)
    result = ScoreResult(nq, n_docs, backend)
    with _atomic_output(out, outdir) as tmp:
        matrix = None
        if full_matrix:
            matrix = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(nq, n_docs))
        top_vals = np.empty((nq, 0), np.float32)
        top_ids = np.empty((nq, 0), np.int64)
        Qc = _to_compute(Q, qtag, compute)
        first = 0
        with dev_ctx, _progress(n_docs, "scoring") as bar:
            for shard in shards:
                per_doc = shard.length * dim * compute.itemsize
                step = chunk_docs or max(1, min(CHUNK_BYTES // per_doc, CHUNK_BYTES // (4 * nq)))
                for s in range(0, shard.n, step):
                    e = min(shard.n, s + step)
                    Dc = _to_compute(shard.arr[s:e], shard.tag, compute)
                    dl = shard.lengths[s:e] if shard.lengths is not None else None
                    try:
                        S = lik.maxsim(Qc, Dc, q_lengths=qlen, d_lengths=dl, backend=backend)
                    except (ValueError, TypeError) as err:
                        raise LikError(shard.path, f"lik_cupy.maxsim rejected docs {s}..{e - 1}: {err}") from None
                    S = _to_numpy(S)
                    if S.shape != (nq, e - s):
                        raise RuntimeError(f"lik_cupy.maxsim returned shape {S.shape}, expected {(nq, e - s)}")
                    if matrix is not None:
                        matrix[:, first + s : first + e] = S
                    else:
                        top_vals, top_ids = _merge_topk(top_vals, top_ids, S, first + s, k)
                    bar.update(e - s)
                first += shard.n
        if matrix is not None:
            matrix.flush()
            del matrix  # close the memmap before the rename
        elif suffix == ".npy":
            with open(tmp, "wb") as f:
                np.save(f, top_ids)
        else:
            with open(tmp, "w", encoding="utf-8", newline="\n") as f:
                (_write_tsv if suffix == ".tsv" else _write_jsonl)(f, top_vals, top_ids)
        if not full_matrix:
            result.top_vals, result.top_ids = top_vals, top_ids
    return result


# --------------------------------------------------------------------------- commands


class _GreedyCommand(click.Command):
    """Lets ``--docs a.npy b.npy`` (and ``--d-lengths``) take several values, as in
    ``--docs a.npy --docs b.npy``."""

    def parse_args(self, ctx, args):
        out, current, expecting = [], None, False
        for i, tok in enumerate(args):
            if tok == "--":
                out.extend(args[i:])
                break
            if tok.startswith("-") and len(tok) > 1:
                name, eq, _ = tok.partition("=")
                if name in ("--docs", "--d-lengths"):
                    current, expecting = name, not eq
                elif tok.startswith("-d") and not tok.startswith("--"):  # -d FILE or -dFILE
                    current, expecting = "--docs", tok == "-d"
                else:
                    current = None
            elif current is not None:
                if expecting:
                    expecting = False  # the option's own value
                else:
                    out.append(current)  # one more value: repeat the option
            out.append(tok)
        return super().parse_args(ctx, out)


@click.group(
    help="lik: late-interaction (ColBERT / ColPali) MaxSim scoring with lik_cupy.\n\n"
    "score[i, j] = sum over valid query tokens s of max over valid doc tokens t of "
    "<Q[i, s], D[j, t]>. Scoring runs on a GPU through lik_cupy's CUDA kernels when one is "
    "visible, else on the CPU (exact NumPy path).\n\n" + FORMAT_HELP + "\n\b\nExamples:\n"
    "  lik demo /tmp/lik-demo          # make small example files and score them\n"
    "  lik score --queries q.npy --docs d0.npy d1.npy \\\n"
    "            --d-lengths l0.npy l1.npy --top-k 10 --out results.tsv\n"
    "  lik info                        # versions, GPU, kernel cache\n",
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
def main():
    pass


@main.command(
    cls=_GreedyCommand,
    help="Score every query against every doc of the shards and write the top-k per query.\n\n"
    + FORMAT_HELP
    + "\n\b\nOutput (chosen by the suffix of --out; written to a temp file, renamed at the end):\n"
    "  .tsv    header 'query rank doc score', tab-separated, rank 1 = best\n"
    "  .jsonl  one {\"query\", \"rank\", \"doc\", \"score\"} object per line (score null for -inf/NaN)\n"
    "  .npy    int64 [Nq, min(K, Ndocs)] top doc ids, best first; with --full-matrix\n"
    "          the float32 [Nq, Ndocs] score matrix instead\n"
    "Ties go to the lower doc id; NaN scores rank last, after -inf (docs with no valid token).\n"
    "\n\b\nExample:\n"
    "  lik score --queries q.npy --q-lengths ql.npy \\\n"
    "            --docs d0.npy d1.npy --d-lengths l0.npy l1.npy \\\n"
    "            --top-k 10 --out results.tsv\n",
)
@click.option("-q", "--queries", required=True, metavar="Q.npy", help="Padded queries [Nq, Lq, d].")
@click.option("-d", "--docs", required=True, multiple=True, metavar="D.npy [D2.npy ...]", help="Doc shards [N, L, d], in id order.")
@click.option("--q-lengths", metavar="QL.npy", help="int [Nq]: valid tokens per query.")
@click.option("--d-lengths", multiple=True, metavar="DL.npy [DL2.npy ...]", help="int [N] per shard: valid tokens per doc.")
@click.option("-k", "--top-k", type=int, default=10, show_default=True, metavar="K", help="Results kept per query.")
@click.option("-o", "--out", required=True, metavar="FILE", help="results.tsv, results.jsonl or results.npy")
@click.option("--full-matrix", is_flag=True, help="Write the whole [Nq, Ndocs] float32 matrix (.npy only).")
@click.option("--cpu", is_flag=True, help="Score on the CPU even if a GPU is visible.")
@click.option("--device", type=int, default=None, metavar="N", help="GPU index to use (default: current device).")
@click.option("--bf16-bits", is_flag=True, help="Read uint16 inputs as bfloat16 bit patterns.")
@click.option("--chunk-docs", type=int, default=0, metavar="N", help="Docs per lik_cupy.maxsim call (0 = ~64 MiB).")
@click.option("--debug", is_flag=True, help="Show a traceback on errors.")
@_cli_errors
def score(queries, docs, q_lengths, d_lengths, top_k, out, full_matrix, cpu, device, bf16_bits, chunk_docs, debug):
    with _sigterm_as_interrupt():
        _score(queries, docs, q_lengths, d_lengths, top_k, out, full_matrix, cpu, device, bf16_bits, chunk_docs)


def _score(queries, docs, q_lengths, d_lengths, top_k, out, full_matrix, cpu, device, bf16_bits, chunk_docs):
    run_score(
        queries,
        list(docs),
        out,
        q_lengths=q_lengths,
        d_lengths=list(d_lengths),
        top_k=top_k,
        full_matrix=full_matrix,
        cpu=cpu,
        device=device,
        bf16_bits=bf16_bits,
        chunk_docs=chunk_docs,
    )


def _version(dist: str, module: str | None = None) -> str:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        pass
    if module:
        try:
            mod = __import__(module)
            return str(getattr(mod, "__version__", "unknown version"))
        except Exception:
            pass
    return "not installed"


def _gpu_lines() -> list[str]:
    try:
        import cupy
    except Exception as e:
        return [f"none usable (cupy not importable: {type(e).__name__})"]
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return [f"none visible ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"]
    if count == 0:
        return ["none visible"]
    lines = []
    for i in range(count):
        try:
            p = cupy.cuda.runtime.getDeviceProperties(i)
            name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
            mem = p.get("totalGlobalMem", 0) / 2**30
            lines.append(f"{i}: {name}, compute capability {p['major']}.{p['minor']} (sm_{p['major']}{p['minor']}), {mem:.0f} GiB")
        except Exception as e:
            lines.append(f"{i}: properties unavailable ({type(e).__name__}: {e})")
    return lines


@main.command(help="Show versions, visible GPUs and the kernel cache location. Works without a GPU or CuPy.")
@click.option("--debug", is_flag=True, help="Show a traceback on errors.")
@_cli_errors
def info(debug):
    echo = click.echo
    echo(f"python        {platform.python_version()} ({sys.executable})")
    try:
        import lik_cupy

        where = os.path.dirname(getattr(lik_cupy, "__file__", None) or "") or "?"
        version = getattr(lik_cupy, "__version__", None) or _version("lik-cupy")
        echo(f"lik-cupy      {version} ({where})")
    except Exception as e:
        lik_cupy = None
        echo(f"lik-cupy      import failed: {type(e).__name__}: {e}")
    echo(f"numpy         {np.__version__}")
    echo(f"click         {_version('click')}")
    echo(f"ml_dtypes     {_version('ml_dtypes', 'ml_dtypes')}")
    try:
        import cupy

        echo(f"cupy          {cupy.__version__}")
    except Exception as e:
        echo(f"cupy          not importable ({type(e).__name__}); the CPU path still works")
    echo(f"cuda-python   {_version('cuda-python')}")
    gpus = _gpu_lines()
    echo(f"GPU           {gpus[0]}")
    for line in gpus[1:]:
        echo(f"              {line}")
    if lik_cupy is not None:
        echo(f"GPU backend   {'available' if _gpu_available(lik_cupy) else 'not available (CPU fallback)'}")
        try:
            from lik_cupy import compile as lik_compile

            echo(f"kernel cache  {lik_compile.cache_dir()}")
        except Exception as e:
            echo(f"kernel cache  unknown ({type(e).__name__}: {e})")


def _demo_data(outdir: str, seed: int):
    """Small random unit-normalised queries and 2 doc shards; each query has one 'planted'
    doc holding noisy copies of its tokens, which MaxSim must rank first."""
    rng = np.random.default_rng(seed)
    nq, lq, dim = 4, 8, 64
    shard_sizes, shard_lens = (24, 16), (32, 24)

    def unit(x):
        return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)

    Q = unit(rng.standard_normal((nq, lq, dim)))
    q_len = np.array([8, 6, 8, 5], np.int32)
    Q[np.arange(lq)[None, :] >= q_len[:, None]] = 0  # padding rows
    shards = [unit(rng.standard_normal((n, L, dim))) for n, L in zip(shard_sizes, shard_lens)]
    lens = [rng.integers(lq, L + 1, size=n).astype(np.int32) for n, L in zip(shard_sizes, shard_lens)]
    planted = [5, 30, 17, 38]  # global ids; 30 and 38 live in shard 1
    for qi, g in enumerate(planted):
        si, j = (0, g) if g < shard_sizes[0] else (1, g - shard_sizes[0])
        pos = rng.choice(lens[si][j], size=q_len[qi], replace=False)
        noisy = unit(Q[qi, : q_len[qi]] + 0.15 * rng.standard_normal((q_len[qi], dim)))
        shards[si][j, pos] = noisy
    for si in range(len(shards)):
        shards[si][np.arange(shards[si].shape[1])[None, :] >= lens[si][:, None]] = 0

    paths = {"queries": os.path.join(outdir, "queries.npy"), "q_lengths": os.path.join(outdir, "query_lengths.npy")}
    np.save(paths["queries"], Q)
    np.save(paths["q_lengths"], q_len)
    paths["docs"], paths["d_lengths"] = [], []
    for si, (D, L) in enumerate(zip(shards, lens)):
        paths["docs"].append(os.path.join(outdir, f"docs_{si}.npy"))
        paths["d_lengths"].append(os.path.join(outdir, f"doc_lengths_{si}.npy"))
        np.save(paths["docs"][-1], D)
        np.save(paths["d_lengths"][-1], L)
    return paths, planted


@main.command(
    help="Write a small random example (unit-normalised float32 queries and 2 doc shards "
    "with lengths) into OUTDIR, score it exactly as `lik score` would, print the top results "
    "and check that each query's planted doc ranks first (exit 1 if not).\n\n"
    + FORMAT_HELP
    + "\n\b\nExample:\n  lik demo /tmp/lik-demo\n  lik demo /tmp/lik-demo --cpu --top-k 5\n",
)
@click.argument("outdir", type=click.Path(file_okay=False))
@click.option("-k", "--top-k", type=int, default=3, show_default=True, metavar="K")
@click.option("--cpu", is_flag=True, help="Score on the CPU even if a GPU is visible.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--debug", is_flag=True, help="Show a traceback on errors.")
@_cli_errors
def demo(outdir, top_k, cpu, seed, debug):
    try:
        os.makedirs(outdir, exist_ok=True)
    except OSError as e:
        raise LikError(outdir, f"cannot create directory: {e.strerror or e}") from None
    paths, planted = _demo_data(outdir, seed)
    out = os.path.join(outdir, "results.tsv")
    with _sigterm_as_interrupt():
        res = run_score(
            paths["queries"], paths["docs"], out,
            q_lengths=paths["q_lengths"], d_lengths=paths["d_lengths"], top_k=top_k, cpu=cpu,
        )
    rel = lambda p: os.path.relpath(p, outdir)  # noqa: E731
    click.echo(f"wrote {res.n_queries} queries and {res.n_docs} docs in 2 shards to {outdir}; scored on {res.backend}.")
    click.echo(
        f"same as: (cd {outdir} && lik score --queries {rel(paths['queries'])} --q-lengths {rel(paths['q_lengths'])} "
        f"--docs {' '.join(map(rel, paths['docs']))} --d-lengths {' '.join(map(rel, paths['d_lengths']))} "
        f"--top-k {top_k} --out results.tsv{' --cpu' if cpu else ''})"
    )
    hits = 0
    for q in range(res.n_queries):
        tops = "  ".join(f"doc {int(d):>2} {v:7.3f}" for d, v in zip(res.top_ids[q], res.top_vals[q]))
        ok = int(res.top_ids[q, 0]) == planted[q]
        hits += ok
        click.echo(f"query {q}: {tops}   (planted doc {planted[q]}{' ranked 1' if ok else ' NOT ranked 1'})")
    click.echo(f"results: {out}")
    if hits != res.n_queries:
        click.echo(f"lik: error: demo check failed: planted doc ranked first for {hits}/{res.n_queries} queries", err=True)
        raise click.exceptions.Exit(1)
    click.echo(f"check: planted doc ranked first for {hits}/{res.n_queries} queries")


if __name__ == "__main__":
    main(prog_name="lik")
