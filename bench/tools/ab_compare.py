"""Compare two runs of one suite, made in one session on one GPU: an earlier tree ("before") and
this one ("after"). For each cell, our time against the best peer's in the same run, before and
after, so a change in our speed shows apart from drift of the machine.

    python bench/tools/ab_compare.py BEFORE.json AFTER.json [--tolerance 0.05]

Reads forward_*.json and corpus_*.json rows; a row's call time (``ms_e2e``, wall time per call
back to back, host included) is compared as a cell of its own, "(call)". Exit status 1 when a cell of ours got slower than
the tolerance in both its raw time and its ratio to the best peer; the table prints either way.
"""

from __future__ import annotations

import argparse
import json
import sys

PEERS = {"flash_maxsim", "lik", "flash_batched", "flash_batched_topk", "lik_retrieve", "flash_packed",
         "flash_packed_1launch", "flash_padded_len", "lik_varlen"}


def _cells(path: str) -> dict:
    """(cell key, impl) -> ms for every measured row, and the best peer per cell key."""
    rows = json.load(open(path))["rows"]
    ms, peer = {}, {}
    for r in rows:
        if r.get("status") != "ok" or not r.get("ms"):
            continue
        key = " ".join(str(r.get(k)) for k in ("cell", "case", "shape", "dtype") if r.get(k) is not None)
        ms[(key, r["impl"])] = r["ms"]
        if r.get("ms_e2e"):  # wall time per call, back to back, host included
            ms[(key + " (call)", r["impl"])] = r["ms_e2e"]
        if r["impl"] in PEERS:
            peer[key] = min(peer.get(key, float("inf")), r["ms"])
            if r.get("ms_e2e"):
                peer[key + " (call)"] = min(peer.get(key + " (call)", float("inf")), r["ms_e2e"])
    return ms, peer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--tolerance", type=float, default=0.05, help="relative slowdown counted as real (default 5%%)")
    a = p.parse_args(argv)
    (b_ms, b_peer), (a_ms, a_peer) = _cells(a.before), _cells(a.after)
    slower = []
    print(f"{'cell':58s} {'impl':22s} {'before':>9s} {'after':>9s} {'change':>7s} {'/peer b':>8s} {'/peer a':>8s}")
    for (key, impl), t_after in sorted(a_ms.items()):
        if impl in PEERS or (key, impl) not in b_ms:
            continue
        t_before = b_ms[(key, impl)]
        rb = t_before / b_peer[key] if key in b_peer else None
        ra = t_after / a_peer[key] if key in a_peer else None
        change = t_after / t_before - 1
        flag = change > a.tolerance and (rb is None or ra is None or ra / rb - 1 > a.tolerance)
        if flag:
            slower.append((key, impl))
        fmt = lambda x: f"{x:8.3f}" if x is not None else f"{'-':>8s}"  # noqa: E731
        print(f"{key[:58]:58s} {impl:22s} {t_before:9.4f} {t_after:9.4f} {change:+7.1%} {fmt(rb)} {fmt(ra)}"
              + ("  SLOWER" if flag else ""))
    print(f"\n{len(slower)} cell(s) slower than {a.tolerance:.0%} in time and in ratio to the best peer")
    return 1 if slower else 0


if __name__ == "__main__":
    sys.exit(main())
