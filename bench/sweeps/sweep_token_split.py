"""One query against packed corpora: token shares against whole-document CTAs, on one GPU.

Packed single-query launches may cut the corpus into equal token shares, one per CTA, with a
document crossing a share's edge scored in pieces and merged (``dispatch.tables.SPLIT_MIN_TILES``,
``maxsim_fwd.cu``'s ``piece_role``). Whole-document CTAs instead take the documents whose first
token falls in their share. This times both plans forced, the plan dispatch picks, flash-maxsim's
packed kernel, and a plain read of the same bytes (the floor), on:

- the corpus bench's ragged corpus (1,000 documents of 16..512 tokens);
- corpora of equal documents of 64 .. 4,096 tokens (about 256,000 tokens each), where whole
  documents leave CTAs idle once there are fewer documents than CTAs;

each timed as 60 calls back to back behind a queued sleep (device time), five rounds in turn,
and checks that every plan gives the same scores bit for bit.

Writes ``sweep_token_split_<gpu>.json`` to $OUT (or bench/results) and prints a table last.

    python bench/sweeps/sweep_token_split.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import lik_cupy  # noqa: E402
from lik_cupy import _dispatch as dispatch  # noqa: E402
from lik_cupy._base.device import device_properties  # noqa: E402

from bench.lib import baselines  # noqa: E402
from bench.lib.forcing import rebind  # noqa: E402
from bench.lib.results import out_dir, write_result  # noqa: E402
from bench.lib.timing import per_call_ms  # noqa: E402

_READ = r'''
extern "C" __global__ void read_all(const uint4* __restrict__ p, long long n, unsigned* out) {
    unsigned acc = 0;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        const uint4 a = __ldg(p + i), b = __ldg(p + i + stride), c = __ldg(p + i + 2 * stride), d = __ldg(p + i + 3 * stride);
        acc ^= a.x ^ b.y ^ c.z ^ d.w ^ a.w ^ b.x ^ c.y ^ d.z;
    }
    for (; i < n; i += stride) { const uint4 a = __ldg(p + i); acc ^= a.x ^ a.w; }
    if (acc == 0x9e3779b9u) out[0] = acc;  // keeps the loads
}
'''


def corpora(rng):
    out = [("ragged 1000 x 16..512", rng.integers(16, 513, size=1000))]
    for L in (64, 256, 1024, 1350, 2000, 4096):
        out.append((f"{256_000 // L} x {L}", np.full(256_000 // L, L)))
    return out


def main():
    out = out_dir()
    props = device_properties(0)
    rng = np.random.default_rng(303)
    lq, d, n_sets = 32, 128, 6
    cases = corpora(rng)
    T = max(int(lens.sum()) for _, lens in cases)
    q = cp.asarray(rng.standard_normal((1, lq, d), dtype=np.float32).astype(np.float16))
    toks = [cp.asarray(rng.standard_normal((T, d), dtype=np.float32).astype(np.float16)) for _ in range(n_sets)]
    tq, ttoks = torch.as_tensor(q, device="cuda"), [torch.as_tensor(t, device="cuda") for t in toks]
    read = cp.RawKernel(_READ, "read_all")
    sink = cp.zeros(1, cp.uint32)
    real_plan = dispatch.plan_launch

    def whole(*a):  # no ntok: whole-document CTAs
        return real_plan(*a[:7])

    def split(cfg, cc, num_sms, nq, nd, lq, shared, ntok):  # token shares whatever the corpus
        p = real_plan(cfg, cc, num_sms, nq, nd, lq, shared)
        rows = p.grid[0]
        shares = min(num_sms * dispatch.ctas_per_sm(cfg, cc) // rows, -(-ntok // (dispatch.tables.SPLIT_MIN_TILES * cfg.bn)))
        return dispatch.Launch(n_qt=p.n_qt, qb=p.qb, docs_per_cta=0, grid=(rows, shares, 1), token_split=True)

    plans = {"token shares": split, "whole documents": whole, "dispatch": real_plan}
    counter = [0]

    def nxt():
        counter[0] += 1
        return counter[0] % n_sets

    flash_maxsim, err = baselines.load(baselines.FLASH)
    if flash_maxsim is None:
        print(f"flash-maxsim not timed: {err}", flush=True)
    rows = []
    for name, lens in cases:
        off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        t = int(off[-1])
        off_d, toff = cp.asarray(off), torch.as_tensor(off, device="cuda")
        nbytes = t * d * 2
        got = {}
        for k, plan in plans.items():
            rebind(dispatch, "plan_launch", plan)
            got[k] = lik_cupy.maxsim_varlen(q, toks[0][:t], off_d, validate_offsets=False).get().tobytes()
        rebind(dispatch, "plan_launch", real_plan)
        ours = lambda: lik_cupy.maxsim_varlen(q, toks[nxt()][:t], off_d, validate_offsets=False)  # noqa: E731
        fns = {k: ours for k in plans}
        fns["read floor"] = lambda: read((8 * props.num_sms,), (256,), (toks[nxt()], np.int64(nbytes // 16), sink))
        if flash_maxsim is not None:
            fns["flash-maxsim packed"] = lambda: flash_maxsim.flash_maxsim(tq[0], ttoks[nxt()][:t], doc_lengths=toff)
        times = {k: [] for k in fns}
        for _ in range(5):
            for k, fn in fns.items():
                rebind(dispatch, "plan_launch", plans.get(k, real_plan))
                times[k].append(per_call_ms(torch, fn, 60, rounds=1, spin_cycles=50_000_000))
        rebind(dispatch, "plan_launch", real_plan)
        med = {k: float(np.median(v)) for k, v in times.items()}
        for k, ms in med.items():
            rows.append({"corpus": name, "docs": int(lens.size), "tokens": t, "impl": k, "ms": ms, "runs": times[k],
                         "gbs": nbytes / ms / 1e6, "over_read_floor": ms / med["read floor"],
                         "flash_over_this": med["flash-maxsim packed"] / ms if flash_maxsim else None,
                         "bitwise_equal_plans": len(set(got.values())) == 1})
    write_result(out, "sweep_token_split", props, query=f"1 x {lq}, d {d} fp16", rows=rows)
    print(f"\n{'corpus':22s} {'impl':20s} {'us':>7s} {'GB/s':>6s} {'/floor':>6s} {'flash/this':>10s} bitwise")
    for r in rows:
        fl = f"{r['flash_over_this']:.3f}" if r["flash_over_this"] else "-"
        print(f"{r['corpus']:22s} {r['impl']:20s} {r['ms'] * 1e3:7.2f} {r['gbs']:6.0f} {r['over_read_floor']:6.2f} "
              f"{fl:>10s} {r['bitwise_equal_plans']}")


if __name__ == "__main__":
    main()
