"""Where one padded query's call (1 q (32) x 1,000 docs (180), float32) spends its time on this host:
on one chunk thread by cProfile (the GEMM is counted in `similarities`, the fold in `piece`), each
chunk thread's share when two run, and the tokens-first GEMM of the whole call alone, as NumPy runs it
with BLAS's threads. python padded_probe.py > outputs.txt"""
import cProfile, pstats, sys, time
from pathlib import Path
ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))
import numpy as np
import lik_cupy
from lik_cupy._cpu import cores
import lik_cupy._cpu.maxsim as M
def unit(x): return x / np.linalg.norm(x, axis=-1, keepdims=True)
rng = np.random.default_rng(0)
Q = unit(rng.standard_normal((1, 32, 128), dtype=np.float32))
D = unit(rng.standard_normal((1000, 180, 128), dtype=np.float32))
call = lambda: lik_cupy.maxsim(Q, D, backend="cpu")
call()
run_chunks, chunk_threads = cores.run_chunks, cores.chunk_threads
shares = []
def timed_run_chunks(items, work, threads, *, blas_threads=True):
    def timed(k, claims):
        t = time.perf_counter(); work(k, claims); shares.append((k, round(1e3 * (time.perf_counter() - t), 1)))
    run_chunks(items, timed, threads, blas_threads=blas_threads)
M.cores.run_chunks = timed_run_chunks
for _ in range(4):
    shares.clear(); t = time.perf_counter(); call()
    print(f"two chunk threads: call {1e3 * (time.perf_counter() - t):.1f} ms, each thread's share (thread, ms): {sorted(shares)}")
M.cores.run_chunks = run_chunks
cores.chunk_threads = lambda: 1
call()
t = time.perf_counter()
for _ in range(5): call()
print(f"one chunk thread: {1e3 * (time.perf_counter() - t) / 5:.1f} ms a call")
pr = cProfile.Profile(); pr.enable()
for _ in range(5): call()
pr.disable()
st = pstats.Stats(pr)
for (file, line, fn), (cc, nc, tt, ct, callers) in sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:6]:
    print(f"  {fn:>14} ({Path(file).name}:{line}): {1e3 * tt / 5:.1f} ms a call, own time")
cores.chunk_threads = chunk_threads
A, T = Q[0], D.reshape(-1, 128)
out = np.empty((T.shape[0], 32), np.float32)
ts = []
for _ in range(9):
    time.sleep(0.15); t = time.perf_counter(); np.matmul(T, A.T, out=out); ts.append(time.perf_counter() - t)
ms = 1e3 * float(np.median(ts))
print(f"the tokens-first GEMM whole, BLAS's threads: {ms:.1f} ms ({2 * 32 * T.shape[0] * 128 / ms / 1e6:.0f} GFLOP/s)")
