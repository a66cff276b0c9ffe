"""The digest of lik-cupy's sources that every result JSON records (``provenance.source_sha256``), for the
working tree or for commits, so that a JSON can be matched to the commit that produced it.

    python3 bench/tools/source_digest.py                       # this working tree's digest
    python3 bench/tools/source_digest.py COMMIT [COMMIT ...]   # each commit's: "<digest>  <commit>"
    python3 bench/tools/source_digest.py --find RESULT.json [--rev main] [--max 500]
                                                               # the commits whose sources made RESULT.json

The digest covers ``lik_cupy/**/*.py``, ``cuda_src/**/*.cu``, ``*.cuh`` and ``pyproject.toml``: the sha256
of the lines ``<sha256>  <path>`` of those files sorted by path (``bench/lib/provenance.py``). For a
commit's tracked files it is also what coreutils give:

    git ls-files -- 'lik_cupy/*.py' 'cuda_src/*.cu' 'cuda_src/*.cuh' pyproject.toml | LC_ALL=C sort \\
        | xargs sha256sum | sha256sum

``--find`` walks ``--rev``'s history (newest first, at most ``--max`` commits) and prints every commit
whose digest equals the JSON's; exit status 1 when none does (sources run uncommitted, or a commit
outside the walk).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib
from bench.lib.provenance import REPO, CommitReader, history, resolve, tree_digest  # noqa: E402


def recorded(path: Path) -> str:
    """The digest a result JSON records."""
    try:
        return json.loads(Path(path).read_text())["provenance"]["source_sha256"]
    except (KeyError, TypeError) as e:
        raise SystemExit(f"{path}: no provenance.source_sha256 (written before results carried it?): {e!r}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("commits", nargs="*", help="commits to digest (default: the working tree)")
    ap.add_argument("--find", metavar="RESULT.json", help="list the commits whose digest this JSON records")
    ap.add_argument("--rev", default="HEAD", help="the history --find walks (default HEAD)")
    ap.add_argument("--max", type=int, default=500, help="commits --find reads at most (default 500)")
    ap.add_argument("--repo", default=str(REPO), help="the repository (default this checkout)")
    args = ap.parse_args(argv)
    reader = CommitReader(args.repo)
    if args.find:
        want = recorded(args.find)
        listed = history(args.rev, args.max, args.repo)
        if listed is None:
            raise SystemExit(f"git cannot list {args.rev!r} in {args.repo}")
        found = [c for c in listed if reader.digest(c) == want]
        for c in found:
            print(c)
        if not found:
            print(f"no commit among the last {args.max} of {args.rev} has digest {want}", file=sys.stderr)
        return 0 if found else 1
    if not args.commits:
        print(tree_digest(args.repo))
        return 0
    status = 0
    for c in args.commits:
        full = resolve(c, args.repo)
        if full is None:
            print(f"unknown commit {c!r}", file=sys.stderr)
            status = 1
            continue
        print(f"{reader.digest(full)}  {c}")
    return status


if __name__ == "__main__":
    sys.exit(main())
