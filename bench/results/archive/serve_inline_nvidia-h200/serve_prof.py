"""Low-load latency of lik serve, broken down (prof_server.py's timers), with the in-process call time."""
import argparse, json, os, re, signal, subprocess, sys
import numpy as np
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from latclient import client
from bench.suites.bench_serve import request_bytes, queries, in_process
ap = argparse.ArgumentParser()
ap.add_argument("--docs", type=int, default=100000); ap.add_argument("--ld", type=int, default=180)
ap.add_argument("--dim", type=int, default=128); ap.add_argument("--devices", default="0")
ap.add_argument("--ids", type=int, default=1000); ap.add_argument("--n", type=int, default=3000)
ap.add_argument("--tag", default="")
ap.add_argument("--repos", nargs="+", default=[os.getcwd()])
ap.add_argument("--plain", action="store_true"); ap.add_argument("--rounds", type=int, default=2)
a = ap.parse_args()
qs = queries(16, 32, a.dim, 1)
rng = np.random.default_rng(2)
cand = [rng.choice(a.docs, min(a.ids, a.docs), replace=False) for _ in qs]
out = {"args": vars(a)}
ns = argparse.Namespace(ld=a.ld, dim=a.dim, devices=a.devices, seed=0, duration=1.5)
out["in_process"] = in_process(ns, a.docs, ["search", "rerank"], qs, cand)
print("in process", out["in_process"], flush=True)
for rnd in range(a.rounds):
  for repo in a.repos:
    script = os.path.join(repo, "bench/suites/bench_serve.py") if a.plain else os.path.join(os.path.dirname(os.path.abspath(__file__)), "prof_server.py")
    cmd = [sys.executable, script, "--role", "server", "--docs", str(a.docs), "--ld", str(a.ld), "--dim",
           str(a.dim), "--devices", a.devices, "--max-batch", "64", "--max-delay-us", "0", "--max-queue", "4096", "--seed", "0",
           "--processes", "1"]
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=repo, env=env)
    port = None
    for line in proc.stderr:
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if m: port = int(m.group(1))
        if "lik serve: ready" in line: break
    for w in ("rerank", "search"):
        p = [request_bytes(w, q, c if w == "rerank" else None) for q, c in zip(qs, cand)]
        e, q, c = client(port, p, n=a.n)
        r = {"repo": repo, "round": rnd, "workload": w, "e2e_ms": e, "queue_ms": q, "compute_ms": c,
             "over_call_ms": e - out["in_process"][w]["call_ms"]}
        out.setdefault("runs", []).append(r)
        print(r, flush=True)
    proc.send_signal(signal.SIGTERM)
    prof = [l.strip() for l in proc.stderr if "PROF" in l]
    proc.wait()
    print("\n".join(prof))
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), f"serve_prof{a.tag}.json"), "w"), indent=1)
