"""Random GPU calls against a float64 reference: layouts (padded, candidates, packed, a 2-D query, a
single document, pairs, retrieve over padded and packed corpora), dtypes (float16, bfloat16, float32 at
"fp32" and "tf32", float64), masks and lengths with NaN in every masked position, awkward sizes (d from
8 to 1,024, Lq to 1,024, Ld to 32,768) and near ties (tokens copied with 1e-7 perturbations, query tokens
planted in documents). The reference is torch float64 on the same GPU; a score must lie within a bound of
its dtype's arithmetic (``c_sim`` per similarity times |q| max|d|, plus the float32 sum over query tokens),
NaN and inf exactly where float64 has them, each argmax a valid token whose float64 similarity is within
twice that bound of the max, and retrieve's ids a top-k of the reference within it. INT8 and FP8 calls run
on the GPU and the CPU path on the same quantised inputs: INT8's argmax equal, scores within the float32
sum's rounding; FP8 within 2^-10 relative. ``maxsim_backward`` (atomic, csr and auto; padded, candidates and
packed) is checked against float64 gradients rebuilt from the forward's own argmax, with NaN in every masked
position: each entry within its output dtype's rounding plus the float32 sum's over its terms, all finite.
``Corpus`` (padded or packed, on the GPU or in page-locked host memory, integer ids) is scored, searched
and reranked by candidate ids twice (the second call takes the repeat path), each against float64.
Every call is synchronised, so a launch error is a failure.

    python3 bench/tools/gpu_fuzz.py SEED SECONDS        # JSON (with the sources' provenance): $OUT/gpufuzz_SEED.json
    FUZZ_LOCAL=1 python3 bench/tools/gpu_fuzz.py 1 60   # the script itself checked on the CPU path
"""
import math, os, sys, time, traceback, warnings
from pathlib import Path
import numpy as np
import torch
import cupy
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
import lik_cupy
from bench.lib.results import write_json

warnings.simplefilter("ignore")
seed, budget = int(sys.argv[1]), float(sys.argv[2])
rng = np.random.default_rng(seed)
LOCAL = os.environ.get("FUZZ_LOCAL") == "1"  # script check on a machine without a GPU: the CPU path stands in
dev = torch.device("cpu" if LOCAL else "cuda")
BE = "cpu" if LOCAL else "gpu"
fails, stats = [], {}
U = 2.0 ** -24


def note(cat, ratio):
    s = stats.setdefault(cat, {"n": 0, "worst": 0.0})
    s["n"] += 1
    if ratio == ratio:
        s["worst"] = max(s["worst"], float(ratio))


def fail(cat, case, msg):
    fails.append({"cat": cat, "case": case, "msg": msg[:2000]})
    print("FAIL", cat, case, msg[:600], flush=True)


def tokens(n, L, d, scale, near):
    x = rng.standard_normal((n, L, d)) * scale
    if near and L > 1:  # near-duplicate tokens: copies perturbed in the last bits, so maxima nearly tie
        src = rng.integers(0, L, size=L // 2)
        dst = rng.integers(0, L, size=L // 2)
        x[:, dst] = x[:, src] * (1 + rng.standard_normal((n, L // 2, 1)) * 1e-7)
    return x


def valid_side(shape, kind):
    """(mask or None, lengths or None, valid bool array) for leading shape + (L,)."""
    L = shape[-1]
    if kind == "none":
        return None, None, np.ones(shape, bool)
    if kind == "mask":
        m = rng.random(shape) < rng.uniform(0.3, 1.0)
        if m.size and rng.random() < 0.5:
            m.reshape(-1, L)[rng.integers(0, m.reshape(-1, L).shape[0])] = False  # one empty row
        return m, None, m
    lens = rng.integers(0, L + 1, size=shape[:-1])
    if lens.size and rng.random() < 0.5:
        lens.reshape(-1)[rng.integers(0, lens.size)] = L
    return None, lens, np.arange(L) < lens[..., None]


def reference(q64, qv, d64, dv, cand):
    """float64 scores, per-row maxima and sims; q64 [nq,lq,d]; d64 [nd,ld,d] or [nq,K,ld,d]."""
    sims = torch.einsum("isk,ijtk->ijst", q64, d64) if cand else torch.einsum("isk,jtk->ijst", q64, d64)
    dvb = dv[:, :, None, :] if cand else dv[None, :, None, :]
    sims = torch.where(dvb, sims, torch.tensor(-math.inf, dtype=torch.float64, device=dev))
    mx = sims.amax(-1)  # NaN propagates
    if sims.shape[-1] == 0:
        mx = torch.full(sims.shape[:-1], -math.inf, dtype=torch.float64, device=dev)
    sc = torch.where(qv[:, None, :], mx, torch.zeros((), dtype=torch.float64, device=dev)).sum(-1)
    return sc, mx, sims


def c_sim(dtype, prec, d, lq):
    if dtype in ("float16", "bfloat16"):
        return d * 2 * U
    if dtype == "float32":
        return 2 ** -8 if prec == "tf32" else (d + lq) * 2 * U
    return (d + lq) * 2 * U + 4 * U  # float64: scored from its float32 rounding


def check(cat, case, got_s, got_a, q64, qv, d64, dv, cand, c):
    sc, mx, sims = reference(q64, qv, d64, dv, cand)
    qn = q64.norm(dim=-1)  # [nq, lq]
    dn = d64.norm(dim=-1)
    dmax = torch.where(dv, dn, torch.zeros((), dtype=torch.float64, device=dev)).amax(-1) if dv.shape[-1] else dn.sum(-1) * 0
    bound = qn[:, None, :] * (dmax[:, :, None] if cand else dmax[None, :, None])  # [nq, nd, lq]
    tol_row = c * bound + 1e-300
    absmax = torch.where(qv[:, None, :] & torch.isfinite(mx), mx.abs(), torch.zeros((), dtype=torch.float64, device=dev))
    tol = torch.where(qv[:, None, :], tol_row, torch.zeros((), dtype=torch.float64, device=dev)).sum(-1) \
        + (qv.shape[1] + 2) * 2 * U * absmax.sum(-1) + 1e-30
    g = torch.as_tensor(got_s, device=dev).double()
    ref_nan, got_nan = torch.isnan(sc), torch.isnan(g)
    if not torch.equal(ref_nan, got_nan):
        fail(cat, case, f"NaN pattern differs: ref {int(ref_nan.sum())} got {int(got_nan.sum())}")
        return
    inf_ref = torch.isinf(sc)
    if not torch.equal(inf_ref, torch.isinf(g)) or not torch.equal(sc[inf_ref], g[inf_ref]):
        fail(cat, case, "inf pattern differs")
        return
    fin = torch.isfinite(sc)
    err = ((g - sc).abs() / tol)[fin]
    r = float(err.max()) if err.numel() else 0.0
    note(cat, r)
    if r > 1:
        i = int(err.argmax())
        fail(cat, case, f"score error {r:.2f}x tolerance (ref {float(sc[fin][i])!r} got {float(g[fin][i])!r})")
        return
    if got_a is None:
        return
    a = torch.as_tensor(got_a, device=dev).long()
    rowvalid = qv[:, None, :] & (dv.any(-1)[:, :, None] if cand else dv.any(-1)[None, :, None])
    if not torch.equal(a < 0, ~rowvalid):
        bad = (a < 0) != ~rowvalid
        fail(cat, case, f"argmax -1 pattern differs at {int(bad.sum())} rows")
        return
    ok = rowvalid & torch.isfinite(mx)
    ld = sims.shape[-1]
    if ld == 0:
        return
    w = a.clamp(0, ld - 1)
    dvx = (dv[:, :, None, :] if cand else dv[None, :, None, :]).expand(sims.shape)
    wval = torch.gather(sims, -1, w[..., None])[..., 0]
    wok = torch.gather(dvx, -1, w[..., None])[..., 0]
    bad = ok & ((a >= ld) | ~wok | (wval < mx - 2 * tol_row))
    if bad.any():
        fail(cat, case, f"argmax wrong at {int(bad.sum())} rows")


def top(cat, case, res, q64, qv, d64, dv, c):
    """retrieve's (scores, ids) [nq, k]: distinct ids, each score within tolerance of float64's, ranked
    descending with NaN last, and a top-k of the reference within tolerance."""
    cat = cat + "/retrieve"
    s = torch.as_tensor(res[0], device=dev).double()
    ids = torch.as_tensor(res[1], device=dev).long()
    sc, mx, _ = reference(q64, qv, d64, dv, False)
    nq, k = ids.shape
    if ((ids < 0) | (ids >= sc.shape[1])).any():
        fail(cat, case, "ids out of range")
        return
    for i in range(nq):
        if len(set(ids[i].tolist())) != k:
            fail(cat, case, f"query {i}: repeated ids")
            return
    refk = torch.gather(sc, 1, ids)
    both = torch.isfinite(refk)
    scale = sc.abs().nan_to_num(0, 0, 0).amax() + 1
    tol = c * q64.norm(dim=-1).amax() * d64.norm(dim=-1).amax() * q64.shape[1] + 4e-6 * scale
    if not torch.equal(torch.isnan(refk), torch.isnan(s)) or not torch.equal(refk[~both], s[~both]):
        fail(cat, case, "retrieve NaN/inf differs from the reference at its ids")
        return
    err = float((s - refk).abs()[both].max() / tol) if both.any() else 0.0
    note(cat, err)
    if err > 1:
        fail(cat, case, f"retrieve score error {err:.2f}x")
        return
    key = torch.where(torch.isnan(sc), torch.tensor(-math.inf, dtype=torch.float64, device=dev), sc)
    kth = key.sort(dim=1, descending=True).values[:, k - 1]
    got = torch.where(torch.isnan(s), torch.tensor(-math.inf, dtype=torch.float64, device=dev), s)
    if (got.amin(1) < kth - 2 * tol).any():
        fail(cat, case, "retrieve missed a better document")
    if (got[:, 1:] > got[:, :-1] + 0).any():
        fail(cat, case, "retrieve scores not descending")


def to_fw(x, dtype, fw):
    if x is None:
        return None
    if fw == "torch":
        t = torch.as_tensor(x, device=dev)
        return t.to(getattr(torch, dtype)) if dtype else t
    return cupy.asarray(x.astype(dtype) if dtype else x)


def one_float_case(it):
    fw = "torch" if LOCAL or rng.random() < 0.7 else "cupy"
    dtype = rng.choice(["float16", "bfloat16", "float32", "float32", "float64"] if fw == "torch" else ["float16", "float32", "float32", "float64"])
    prec = rng.choice(["fp32", "tf32"]) if dtype == "float32" else None
    d = int(rng.choice([8, 16, 24, 40, 64, 96, 128, 128, 128, 136, 200, 256, 320, 512, 1024]))
    layout = rng.choice(["padded", "padded", "cand", "packed", "packed", "q2d", "onedoc", "pairs"])
    nq = int(rng.integers(1, 9))
    lq = int(rng.choice([1, 3, 17, 32, 32, 33, 64, 100, 128, 300, 1024]))
    ld = int(rng.choice([1, 5, 31, 64, 127, 180, 300, 513, 700, 2000, 4096, 32768]))
    nd = int(rng.integers(1, 70))
    while nq * nd * lq * ld > 6_000_000 and nd > 1:
        nd = max(1, nd // 2)
    while nq * nd * lq * ld > 6_000_000 and ld > 1:
        ld = max(1, ld // 2)
    scale = float(rng.choice([1.0, 1 / math.sqrt(d), 8.0]))
    near = rng.random() < 0.5
    argmax = bool(rng.random() < 0.6)
    qkind = rng.choice(["none", "mask", "lengths"])
    case = dict(it=it, fw=fw, dtype=str(dtype), prec=prec, d=d, layout=str(layout), nq=nq, lq=lq, ld=ld, nd=nd,
                scale=scale, near=near, argmax=argmax, q=str(qkind))
    q = tokens(nq, lq, d, scale, False)
    if layout == "pairs":
        nd = nq
    K = int(rng.integers(1, 12))
    dshape = (nq, K, ld) if layout == "cand" else (nd, ld)
    if layout == "cand":
        dtok = tokens(nq * K, ld, d, scale, near).reshape(nq, K, ld, d)
    else:
        dtok = tokens(nd, ld, d, scale, near)
    if near:  # a query token copied into some documents: a near tie at the top
        for _ in range(3):
            dtok.reshape(-1, ld, d)[rng.integers(0, dtok.reshape(-1, ld, d).shape[0]), rng.integers(0, ld)] = q[rng.integers(0, nq), rng.integers(0, lq)]
    qm, ql, qv = valid_side((nq, lq), qkind)
    dkind = rng.choice(["none", "mask", "lengths"]) if layout not in ("packed",) else "packed"
    if layout == "packed":
        lens = rng.integers(0, ld + 1, size=nd)
        if rng.random() < 0.3:
            lens[rng.integers(0, nd)] = 0
        dm, dl, dv = None, None, np.arange(ld) < lens[:, None]
    else:
        dm, dl, dv = valid_side(dshape, dkind)
    case["dside"] = str(dkind)
    # masked positions hold NaN: never read
    npd = {"float16": np.float16, "float32": np.float32, "float64": np.float64, "bfloat16": np.float32}[str(dtype)]
    qx, dx = q.copy(), dtok.copy()
    qx[~qv] = np.nan
    dx[~dv] = np.nan
    # the reference sees the values the kernel sees (rounded to the input dtype)
    qt = to_fw(qx, None, "torch").to(getattr(torch, str(dtype)))
    dt = to_fw(dx, None, "torch").to(getattr(torch, str(dtype)))
    q64, d64 = torch.nan_to_num(qt.double()), torch.nan_to_num(dt.double())
    qvt, dvt = torch.as_tensor(qv, device=dev), torch.as_tensor(dv, device=dev)
    if fw == "cupy":
        Qa, Da = cupy.asarray(qt.cpu().numpy().astype(npd)), cupy.asarray(dt.cpu().numpy().astype(npd))
    else:
        Qa, Da = qt, dt
    qmask = to_fw(qm, None, fw)
    qlen = to_fw(ql, None, fw)
    kw = dict(q_lengths=qlen, return_argmax=argmax, backend=BE)
    if prec:
        kw["precision"] = str(prec)
    cat = f"{dtype}/{prec or '-'}/{layout}"
    try:
        if layout == "packed":
            lens = dv.sum(1)
            off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64 if rng.random() < 0.5 else np.int32)
            flat = np.concatenate([dx[j, :lens[j]] for j in range(nd)]) if lens.sum() else np.zeros((0, d))
            ft = torch.as_tensor(flat, device=dev).to(getattr(torch, str(dtype)))
            Fa = ft if fw == "torch" else cupy.asarray(ft.cpu().numpy().astype(npd))
            res = lik_cupy.maxsim_varlen(Qa, Fa, to_fw(off, None, fw), qmask, **kw)
            check(cat, case, *(res if argmax else (res, None)), q64, qvt, d64, dvt, False, c_sim(str(dtype), prec, d, lq))
            if str(dtype) != "float64":
                top(cat, case, lik_cupy.retrieve(Qa, Fa, int(rng.integers(1, nd + 1)), qmask, q_lengths=qlen, d_offsets=to_fw(off, None, fw),
                                                 precision=kw.get("precision"), backend=BE), q64, qvt, d64, dvt, c_sim(str(dtype), prec, d, lq))
        elif layout in ("padded", "cand"):
            res = lik_cupy.maxsim(Qa, Da, qmask, to_fw(dm, None, fw), d_lengths=to_fw(dl, None, fw), **kw)
            check(cat, case, *(res if argmax else (res, None)), q64, qvt, d64, dvt, layout == "cand", c_sim(str(dtype), prec, d, lq))
            if layout == "padded" and str(dtype) != "float64":
                top(cat, case, lik_cupy.retrieve(Qa, Da, int(rng.integers(1, nd + 1)), qmask, q_lengths=qlen, d_mask=to_fw(dm, None, fw),
                                                 d_lengths=to_fw(dl, None, fw), precision=kw.get("precision"), backend=BE),
                    q64, qvt, d64, dvt, c_sim(str(dtype), prec, d, lq))
        elif layout == "pairs":
            res = lik_cupy.maxsim_pairs(Qa, Da, qmask, to_fw(dm, None, fw), d_lengths=to_fw(dl, None, fw), **kw)
            s, a = res if argmax else (res, None)
            s = torch.as_tensor(s, device=dev)[:, None]
            a = None if a is None else torch.as_tensor(a, device=dev)[:, None]
            check(cat, case, s, a, q64, qvt, d64[:, None], dvt[:, None], True, c_sim(str(dtype), prec, d, lq))
        elif layout == "q2d":
            qm1 = None if qkind == "none" else to_fw(qv[0], None, fw)
            kw2 = dict(kw, q_lengths=None)
            res = lik_cupy.maxsim(Qa[0], Da, qm1, to_fw(dm, None, fw), d_lengths=to_fw(dl, None, fw), **kw2)
            s, a = res if argmax else (res, None)
            s = torch.as_tensor(s, device=dev)[None]
            a = None if a is None else torch.as_tensor(a, device=dev)[None]
            qv1 = qvt[:1]
            check(cat, case, s, a, q64[:1], qv1, d64, dvt, False, c_sim(str(dtype), prec, d, lq))
        elif layout == "onedoc":
            dm1 = None if dkind == "none" else to_fw(dv[0], None, fw)
            res = lik_cupy.maxsim(Qa, Da[0], qmask, dm1, **kw)
            s, a = res if argmax else (res, None)
            s = torch.as_tensor(s, device=dev)[:, None]
            a = None if a is None else torch.as_tensor(a, device=dev)[:, None]
            dv1 = dvt[:1]
            check(cat, case, s, a, q64, qvt, d64[:1], dv1, False, c_sim(str(dtype), prec, d, lq))
        LOCAL or torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {e}"
        if isinstance(e, (ValueError, TypeError)) and ("d must" in str(e) or "dim" in str(e) or "bfloat16" in str(e) or "float64" in str(e)):
            note(cat + "/refused", 0.0)
            return
        fail(cat, case, msg + "\n" + traceback.format_exc()[-1500:])


def one_scaled_case(it):
    kind = rng.choice(["int8", "fp8"])
    d = int(rng.choice([16, 32, 64, 128, 128, 256, 384, 512] if kind == "int8" else [128, 128, 256, 384, 512]))
    nq, lq, nd, ld = int(rng.integers(1, 6)), int(rng.choice([1, 7, 32, 64, 65, 300])), int(rng.integers(1, 50)), int(rng.choice([1, 9, 64, 180, 333]))
    while nq * nd * lq * ld > 4_000_000 and nd > 1:
        nd = max(1, nd // 2)
    layout = rng.choice(["padded", "packed", "cand"])
    argmax = bool(rng.random() < 0.5)
    case = dict(it=it, kind=str(kind), d=d, nq=nq, lq=lq, nd=nd, ld=ld, layout=str(layout), argmax=argmax)
    cat = f"{kind}/{layout}"
    q = rng.standard_normal((nq, lq, d)).astype(np.float32)
    K = int(rng.integers(1, 8))
    dt = rng.standard_normal((nq * K if layout == "cand" else nd, ld, d)).astype(np.float32)
    quant = lik_cupy.quantize_int8 if kind == "int8" else lik_cupy.quantize_fp8
    fn = {"int8": (lik_cupy.maxsim_int8, lik_cupy.maxsim_int8_varlen), "fp8": (lik_cupy.maxsim_fp8, lik_cupy.maxsim_fp8_varlen)}[str(kind)]
    Q8, qs = quant(q, backend="cpu")
    D8, ds = quant(dt, backend="cpu")
    qm, ql, qv = valid_side((nq, lq), rng.choice(["none", "mask", "lengths"]))
    lens = rng.integers(0, ld + 1, size=nd)  # (packed: each document's length, the same for both backends)
    try:
        outs = {}
        for be in ("cpu", "gpu"):
            conv = (lambda x: x) if be == "cpu" else (lambda x: None if x is None else cupy.asarray(x if x.dtype != np.dtype("O") else x))
            Qd = conv(Q8.view(np.uint8)) if kind == "fp8" and be == "gpu" else conv(Q8)
            Dd = D8
            if layout == "packed":
                off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
                flat = np.concatenate([D8[j, :lens[j]] for j in range(nd)]) if lens.sum() else D8[:0, 0]
                fs = np.concatenate([ds[j, :lens[j]] for j in range(nd)]) if lens.sum() else ds[:0, 0]
                Fd = conv(flat.view(np.uint8)) if kind == "fp8" and be == "gpu" else conv(flat)
                r = fn[1](Qd, Fd, conv(fs), conv(off), conv(qm), q_scales=conv(qs), q_lengths=conv(ql), return_argmax=argmax, backend=be)
            else:
                if layout == "cand":
                    Dd = D8.reshape(nq, K, ld, d)
                    dsc = ds.reshape(nq, K, ld)
                else:
                    dsc = ds
                Dg = conv(Dd.view(np.uint8)) if kind == "fp8" and be == "gpu" else conv(Dd)
                r = fn[0](Qd, Dg, conv(dsc), conv(qm), q_scales=conv(qs), q_lengths=conv(ql), return_argmax=argmax, backend=be)
            outs[be] = [cupy.asnumpy(x) if isinstance(x, cupy.ndarray) else np.asarray(x) for x in (r if argmax else (r,))]
        cupy.cuda.runtime.deviceSynchronize()
        sc, sg = outs["cpu"][0].astype(np.float64), outs["gpu"][0].astype(np.float64)
        if kind == "int8":  # the same similarities (argmax bit for bit); the GPU sums the rows in float32
            if argmax and not np.array_equal(outs["cpu"][1], outs["gpu"][1]):
                fail(cat, case, f"int8 argmax differs at {int((outs['cpu'][1] != outs['gpu'][1]).sum())}")
            if not np.array_equal(np.isnan(sc), np.isnan(sg)) or not np.array_equal(np.isinf(sc), np.isinf(sg)):
                fail(cat, case, "int8 NaN/inf pattern")
                return
            fin = np.isfinite(sc)
            tol = (lq + 2) * 2.0 ** -23 * (np.abs(sc) + 1) * 4
            r = float((np.abs(sc - sg)[fin] / tol[fin]).max()) if fin.any() else 0.0
            note(cat, r)
            if r > 1:
                fail(cat, case, f"int8 score error {r:.2f}x tolerance")
        else:
            bad = np.isnan(sc) != np.isnan(sg)
            if bad.any():
                fail(cat, case, "fp8 NaN pattern")
                return
            fin = np.isfinite(sc)
            tol = 2.0 ** -10 * (np.abs(sc) + lq * 4.0) * (d / 128)
            r = float((np.abs(sc - sg)[fin] / tol[fin]).max()) if fin.any() else 0.0
            note(cat, r)
            if r > 1:
                fail(cat, case, f"fp8 error {r:.2f}x tolerance")
    except Exception as e:  # noqa: BLE001
        fail(cat, case, f"{type(e).__name__}: {e}\n" + traceback.format_exc()[-1500:])


def grad_reference(g, q64, d64, a, cand, off):
    """float64 (dQ, dD, |dQ| terms, |dD| terms) of the backward from the argmax ``a`` that the GPU's
    forward returned: dQ[i, s] = sum_j g[i, j] D_j[a], dD_j[t] = sum of g[i, j] Q[i, s] over a == t."""
    nq, lq, d = q64.shape
    ok = a >= 0
    if off is not None:  # packed: a document's argmax indexes its own tokens
        rows = torch.where(ok, off[:-1][None, :, None] + a, 0).reshape(-1)  # (-1: an empty document's end)
        win = d64[rows].reshape(*a.shape, d) if d64.shape[0] else torch.zeros(*a.shape, d, dtype=torch.float64, device=dev)
    elif cand:
        win = torch.gather(d64, 2, a.clamp(min=0)[..., None].expand(*a.shape, d))
    else:
        win = d64[torch.arange(d64.shape[0], device=dev)[None, :, None], a.clamp(min=0)]
    win = torch.where(ok[..., None], win, torch.zeros((), dtype=torch.float64, device=dev))
    gq = g[:, :, None, None] * win  # [nq, nd, lq, d]
    dQ, dQa = gq.sum(1), gq.abs().sum(1)
    term = g[:, :, None, None] * q64[:, None] * ok[..., None]  # [nq, nd, lq, d]
    if off is not None:
        dD = torch.zeros_like(d64)
        dD.index_add_(0, rows, term.reshape(-1, d))
        dDa = torch.zeros_like(d64)
        dDa.index_add_(0, rows, term.abs().reshape(-1, d))
    elif cand:
        oh = torch.nn.functional.one_hot(a.clamp(min=0), d64.shape[2]).double() * ok[..., None]  # [nq, K, lq, ld]
        dD = torch.einsum("iksd,ikst->iktd", term, oh)
        dDa = torch.einsum("iksd,ikst->iktd", term.abs(), oh)
    else:
        oh = torch.nn.functional.one_hot(a.clamp(min=0), d64.shape[1]).double() * ok[..., None]  # [nq, nd, lq, ld]
        dD = torch.einsum("ijsd,ijst->jtd", term, oh)
        dDa = torch.einsum("ijsd,ijst->jtd", term.abs(), oh)
    return dQ, dD, dQa, dDa


def one_backward_case(it):
    """maxsim_backward on the GPU (atomic and csr) against float64 from the forward's own argmax, with NaN
    in every masked position (never read: masked rows and tokens get 0)."""
    dtype = str(rng.choice(["float16", "bfloat16", "float32", "float64"]))
    layout = str(rng.choice(["padded", "cand", "packed"]))
    method = str(rng.choice(["atomic", "csr", "auto"]))
    d = int(rng.choice([16, 64, 96, 128, 128, 256, 512]))
    nq, lq = int(rng.integers(1, 9)), int(rng.choice([1, 7, 32, 33, 64, 300]))
    nd, ld, K = int(rng.integers(1, 40)), int(rng.choice([1, 9, 80, 180, 300, 1024])), int(rng.integers(1, 6))
    while nq * nd * lq * ld > 3_000_000 and nd > 1:
        nd = max(1, nd // 2)
    case = dict(it=it, dtype=dtype, layout=layout, method=method, d=d, nq=nq, lq=lq, nd=nd, ld=ld, K=K)
    cat = f"backward/{dtype}/{layout}"
    near = rng.random() < 0.5
    q = tokens(nq, lq, d, 1.0, False)
    dtok = tokens(nq * K, ld, d, 1.0, near).reshape(nq, K, ld, d) if layout == "cand" else tokens(nd, ld, d, 1.0, near)
    qm, ql, qv = valid_side((nq, lq), str(rng.choice(["none", "mask", "lengths"])))
    if layout == "packed":
        lens = rng.integers(0, ld + 1, size=nd)
        dv = np.arange(ld) < lens[:, None]
        dm = dl = None
    else:
        dm, dl, dv = valid_side((nq, K, ld) if layout == "cand" else (nd, ld), str(rng.choice(["none", "mask", "lengths"])))
    qx, dx = q.copy(), dtok.copy()
    qx[~qv] = np.nan
    dx[~dv] = np.nan
    tdt = getattr(torch, dtype)
    Qt = torch.as_tensor(qx, device=dev).to(tdt)
    Dt = torch.as_tensor(dx, device=dev).to(tdt)
    q64 = torch.nan_to_num(Qt.double())
    d64 = torch.nan_to_num(Dt.double())
    try:
        qmask, qlen = to_fw(qm, None, "torch"), to_fw(ql, None, "torch")
        if layout == "packed":
            off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
            Ft = torch.cat([Dt[j, :lens[j]] for j in range(nd)]) if lens.sum() else Dt.reshape(-1, d)[:0]
            s, a = lik_cupy.maxsim_varlen(Qt, Ft, to_fw(off, None, "torch"), qmask, q_lengths=qlen, return_argmax=True, backend=BE)
            g = torch.as_tensor(rng.standard_normal(tuple(s.shape)), device=dev).float()
            dQ, dD = lik_cupy.maxsim_backward(g, Qt, Ft, a, d_offsets=to_fw(off, None, "torch"), method=method, backend=BE)
            f64 = torch.nan_to_num(Ft.double())
            offt = torch.as_tensor(off, device=dev)
            rQ, rD, aQ, aD = grad_reference(g.double(), q64, f64, a.long(), False, offt)
        else:
            s, a = lik_cupy.maxsim(Qt, Dt, qmask, to_fw(dm, None, "torch"), q_lengths=qlen, d_lengths=to_fw(dl, None, "torch"),
                                   return_argmax=True, backend=BE)
            g = torch.as_tensor(rng.standard_normal(tuple(s.shape)), device=dev).float()
            dQ, dD = lik_cupy.maxsim_backward(g, Qt, Dt, a, method=method, backend=BE)
            rQ, rD, aQ, aD = grad_reference(g.double(), q64, d64, a.long(), layout == "cand", None)
        LOCAL or torch.cuda.synchronize()
        if dQ.dtype != Qt.dtype or dD.dtype != Dt.dtype or dQ.shape != Qt.shape or dD.shape != (Ft if layout == "packed" else Dt).shape:
            fail(cat, case, f"gradient dtype/shape {dQ.dtype} {tuple(dQ.shape)} {dD.dtype} {tuple(dD.shape)}")
            return
        out_u = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24, "float64": 2.0 ** -24}[dtype]
        out_tiny = {"float16": 2.0 ** -25, "bfloat16": 2.0 ** -134, "float32": 2.0 ** -150, "float64": 2.0 ** -150}[dtype]  # half the subnormal step
        worst = 0.0
        for name, got, ref, mag, terms in (("dQ", dQ, rQ, aQ, nd * (K if layout == "cand" else 1)), ("dD", dD, rD, aD, nq * lq)):
            got = got.double()
            if not torch.isfinite(got).all():
                fail(cat, case, f"{name} has {int((~torch.isfinite(got)).sum())} non-finite entries")
                return
            tol = out_u * ref.abs() + out_tiny + (terms + 2) * 2.0 ** -23 * mag + 1e-30
            r = float(((got - ref).abs() / tol).max()) if got.numel() else 0.0
            worst = max(worst, r)
            if r > 1:
                fail(cat, case, f"{name} error {r:.2f}x tolerance")
                return
        note(cat, worst)
    except Exception as e:  # noqa: BLE001
        fail(cat, case, f"{type(e).__name__}: {e}\n" + traceback.format_exc()[-1500:])


def one_corpus_case(it):
    """A Corpus (padded with lengths or a mask, or packed; resident on the GPU or, with a tiny
    max_gpu_bytes, in page-locked host memory) scored, searched and reranked by candidate ids, each
    against float64 as the stateless calls are; its integer ids map back to positions. Each call runs
    twice: the second takes the repeat path."""
    dtype = str(rng.choice(["float16", "bfloat16", "float32"]))
    prec = str(rng.choice(["fp32", "tf32"])) if dtype == "float32" else None
    layout = str(rng.choice(["padded", "packed"]))
    where = "cpu" if LOCAL else str(rng.choice(["gpu", "gpu", "pinned"]))
    d = int(rng.choice([64, 96, 128, 128, 256]))
    nq, lq = int(rng.integers(1, 6)), int(rng.choice([1, 8, 32, 33, 64, 300]))
    nd, ld = int(rng.integers(1, 300)), int(rng.choice([1, 16, 80, 180, 300, 700]))
    while nq * nd * lq * ld > 6_000_000 and nd > 1:
        nd = max(1, nd // 2)
    k, K = int(rng.integers(1, nd + 1)), int(rng.integers(1, 20))
    case = dict(it=it, dtype=dtype, prec=prec, layout=layout, where=where, d=d, nq=nq, lq=lq, nd=nd, ld=ld, k=k, K=K)
    cat = f"corpus/{dtype}/{prec or '-'}/{layout}/{where}"
    q = tokens(nq, lq, d, 1.0, False)
    dtok = tokens(nd, ld, d, 1.0, rng.random() < 0.5)
    qm, ql, qv = valid_side((nq, lq), str(rng.choice(["none", "lengths"])))
    dkind = "packed" if layout == "packed" else str(rng.choice(["none", "mask", "lengths"]))
    if layout == "packed":
        lens = rng.integers(0, ld + 1, size=nd)
        dm = dl = None
        dv = np.arange(ld) < lens[:, None]
    else:
        dm, dl, dv = valid_side((nd, ld), dkind)
    dx = dtok.copy()
    dx[~dv] = np.nan
    tdt = getattr(torch, dtype)
    Qt = torch.as_tensor(q, device=dev).to(tdt)
    Dh = torch.as_tensor(dx).to(tdt)  # the corpus comes from host memory, as a service loads it
    q64, d64 = Qt.double(), torch.nan_to_num(Dh.double()).to(dev)
    qvt, dvt = torch.as_tensor(qv, device=dev), torch.as_tensor(dv, device=dev)
    ids = np.arange(nd) * 7 + 3
    kw = dict(device="cpu") if where == "cpu" else dict(max_gpu_bytes=1024) if where == "pinned" else {}
    c = c_sim(dtype, prec, d, lq)
    try:
        if layout == "packed":
            flat = torch.cat([Dh[j, :lens[j]] for j in range(nd)]) if lens.sum() else Dh.reshape(-1, d)[:0]
            off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
            corpus = lik_cupy.Corpus(flat, d_offsets=torch.as_tensor(off), ids=ids, **kw)
        else:
            host = (lambda x: None if x is None else torch.as_tensor(x))  # D's framework, on the host
            corpus = lik_cupy.Corpus(Dh, d_mask=host(dm), d_lengths=host(dl), ids=ids, **kw)
        qlen = to_fw(ql, None, "torch")
        pk = dict(precision=prec) if prec else {}
        for _ in range(2):
            check(cat + "/score", case, corpus.score(Qt, q_lengths=qlen, **pk), None, q64, qvt, d64, dvt, False, c)
            sc, got_ids = corpus.search(Qt, k, q_lengths=qlen, **pk)
            pos = torch.as_tensor(np.asarray(torch.as_tensor(got_ids).cpu()), device=dev)
            if ((pos - 3) % 7 != 0).any():
                fail(cat, case, "search returned an id the corpus does not hold")
                return
            top(cat + "/search", case, (sc, (pos - 3) // 7), q64, qvt, d64, dvt, c)
            cand = rng.integers(0, nd, size=(nq, K))
            rs = corpus.rerank(Qt, torch.as_tensor(cand, device=dev), q_lengths=qlen, **pk)
            ct = torch.as_tensor(cand, device=dev)
            check(cat + "/rerank", case, rs, None, q64, qvt, d64[ct], dvt[ct], True, c)
        LOCAL or torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        fail(cat, case, f"{type(e).__name__}: {e}\n" + traceback.format_exc()[-1500:])


t_end = time.time() + budget
it = 0
while time.time() < t_end:
    u = rng.random()
    (one_backward_case if u < 0.15 else one_corpus_case if u < 0.3 else one_scaled_case if u < 0.45 and not LOCAL
     else one_float_case)(it)
    it += 1
out = os.environ.get("OUT", "/tmp")
write_json(os.path.join(out, f"gpufuzz_{seed}.json"), {"seed": seed, "cases": it, "fails": fails, "stats": stats,
                                                        "gpu": "local" if LOCAL else torch.cuda.get_device_name()})
print(f"seed {seed}: {it} cases, {len(fails)} failures")
for k in sorted(stats):
    print(f"  {k:34s} n={stats[k]['n']:4d} worst/tol={stats[k]['worst']:.3f}")
