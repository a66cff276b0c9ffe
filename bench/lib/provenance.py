"""Which code a result came from: a digest of the package's sources, stamped into every result JSON.

The digest is taken over the files that make up what runs: ``lik_cupy/**/*.py``,
``cuda_src/**/*.cu`` and ``*.cuh``, and ``pyproject.toml`` (``is_source``). Each file's sha256 and
path make a line ``<sha256>  <path>`` (what ``sha256sum`` prints), the lines sorted by path, and
the digest is the sha256 of those lines: the same for a working tree and for a commit whose tree
holds the same files, so a reader recomputes it at a commit (``bench/tools/source_digest.py
COMMIT``) to learn which commit a JSON came from. It is taken from the files themselves because
the GPU machine's copy of the repository carries a stale ``.git``: ``git rev-parse HEAD`` there
names an old commit.

The commit itself is recorded where it can be trusted: from ``LIK_COMMIT`` when the launcher sets
it (checked against the digest where this ``.git`` has that commit), else git's ``HEAD`` only when
its tree's digest equals the working tree's.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("lik_cupy", "cuda_src", "pyproject.toml")
TOOL = "python3 bench/tools/source_digest.py COMMIT"


def is_source(path: str) -> bool:
    """Whether ``path`` (relative to the repository root, with ``/``) is one of the digested files."""
    if path == "pyproject.toml":
        return True
    if "/__pycache__/" in path:
        return False
    return ((path.startswith("lik_cupy/") and path.endswith(".py"))
            or (path.startswith("cuda_src/") and path.endswith((".cu", ".cuh"))))


def digest_of(files: dict) -> str:
    """The sha256 (hex) of the manifest of ``files`` (path -> sha256 hex of its bytes)."""
    manifest = "".join(f"{files[p]}  {p}\n" for p in sorted(files))
    return hashlib.sha256(manifest.encode()).hexdigest()


def tree_files(root=REPO) -> dict:
    """path -> sha256 of every digested file in the working tree under ``root``, tracked or not."""
    root = Path(root)
    out = {}
    for top in ROOTS:
        start = root / top
        paths = [start] if start.is_file() else sorted(p for p in start.rglob("*") if p.is_file())
        for p in paths:
            rel = p.relative_to(root).as_posix()
            if is_source(rel):
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def tree_digest(root=REPO) -> str:
    """The digest of the working tree under ``root``."""
    return digest_of(tree_files(root))


def _git(root, *args, stdin: bytes | None = None) -> bytes | None:
    """git's stdout, or None where git is missing or fails (no repository, an unknown commit)."""
    try:
        r = subprocess.run(["git", "-C", str(root), *args], input=stdin, capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def resolve(commit: str, root=REPO) -> str | None:
    """The full id of ``commit`` in ``root``'s git, or None where git does not know it."""
    out = _git(root, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
    return out.decode().strip() if out else None


class CommitReader:
    """Digests of commits of one repository, each blob's sha256 computed once (``--find`` walks many)."""

    def __init__(self, root=REPO):
        self.root = root
        self._blob_sha256: dict[str, str] = {}

    def files(self, commit: str) -> dict | None:
        """path -> sha256 of every digested file in ``commit``'s tree, or None where git cannot say."""
        listing = _git(self.root, "ls-tree", "-r", "-z", commit, "--", *ROOTS)
        if listing is None:
            return None
        blobs = {}
        for entry in filter(None, listing.split(b"\0")):
            meta, path = entry.split(b"\t", 1)
            _mode, kind, oid = meta.split()
            path = path.decode()
            if kind == b"blob" and is_source(path):
                blobs[path] = oid.decode()
        missing = sorted({oid for oid in blobs.values() if oid not in self._blob_sha256})
        if missing:
            out = _git(self.root, "cat-file", "--batch", stdin="".join(f"{o}\n" for o in missing).encode())
            if out is None:
                return None
            at = 0
            for oid in missing:  # each: "<oid> blob <size>\n<content>\n"
                end = out.index(b"\n", at)
                size = int(out[at:end].split()[2])
                self._blob_sha256[oid] = hashlib.sha256(out[end + 1:end + 1 + size]).hexdigest()
                at = end + 1 + size + 1
        return {p: self._blob_sha256[o] for p, o in blobs.items()}

    def digest(self, commit: str) -> str | None:
        files = self.files(commit)
        return None if files is None else digest_of(files)


def history(rev: str, limit: int, root=REPO) -> list[str] | None:
    """The ids of ``rev``'s last ``limit`` commits, newest first, or None where git cannot list them."""
    out = _git(root, "rev-list", f"--max-count={limit}", rev)
    return None if out is None else out.decode().split()


def commit_digest(commit: str, root=REPO) -> str | None:
    """The digest of ``commit``'s tree in ``root``'s git, or None where git does not know it."""
    return CommitReader(root).digest(commit)


def provenance(root=REPO) -> dict:
    """What a result JSON records of the code that made it (see the module docstring):

    ``source_sha256`` and ``source_files`` (the working tree's digest and how many files it covers);
    ``commit`` and ``commit_from`` (``"LIK_COMMIT"``, ``"git HEAD"``, or both None where neither can
    be trusted); ``commit_matches`` (whether that commit's tree has this digest: None where this
    ``.git`` does not have the commit); ``check`` (how a reader recomputes the digest at a commit)."""
    return dict(_provenance(str(root), os.environ.get("LIK_COMMIT", "").strip()))


@functools.lru_cache(maxsize=None)
def _provenance(root: str, given: str) -> tuple:
    files = tree_files(root)
    mine = digest_of(files)
    commit = source = matches = None
    if given:
        full = resolve(given, root)
        commit, source = full or given, "LIK_COMMIT"
        matches = None if full is None else commit_digest(full, root) == mine
        if matches is False:
            print(f"provenance: LIK_COMMIT={given}, but this tree's sources differ from that commit's "
                  f"(uncommitted changes?); the JSON's source_sha256 says which sources ran", file=sys.stderr)
    else:
        head = resolve("HEAD", root)
        if head is not None and commit_digest(head, root) == mine:
            commit, source, matches = head, "git HEAD", True
    return tuple({"source_sha256": mine, "source_files": len(files), "commit": commit, "commit_from": source,
                  "commit_matches": matches, "check": TOOL}.items())
