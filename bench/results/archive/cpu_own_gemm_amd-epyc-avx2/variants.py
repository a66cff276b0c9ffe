"""Ways to write the folded path's GEMM in Numba, timed on the same pieces (out[t, j] = T[t] . A[j],
R = 32 rows, d = 128, 90,000 tokens in pieces of 3,200, one thread, best of 5): the tile of four tokens
by sixteen rows written as scalar Python (LLVM left to vectorise it: Numba runs no SLP vectoriser, and
with reassociation allowed the loop vectoriser vectorises along d), and the same tile as explicit LLVM
vector IR (an intrinsic) with the tokens prefetched 0, 1, 2 or 4 tiles ahead; then OpenBLAS on the same
pieces. python variants.py > variants.txt"""
import collections, re, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from threadpoolctl import threadpool_limits

TB, RB = 4, 16


def scalar_tile(fastmath):
    """The tile as scalar statements, generated (64 accumulators), flat arrays indexed unsigned."""
    L = ["def kern(T, ATb, out, n, d, m, j0):", "    d_ = numba.uint64(d); m_ = numba.uint64(m)",
         f"    for tt in range(0, n // {TB}):", f"        t = numba.uint64(tt) * numba.uint64({TB})"]
    L += [f"        c{i}_{j} = np.float32(0)" for i in range(TB) for j in range(RB)]
    L += ["        tb = t * d_", "        for kk in range(d):", "            k = numba.uint64(kk)",
          f"            ab = k * numba.uint64({RB})"]
    L += [f"            a{j} = ATb[ab + numba.uint64({j})]" for j in range(RB)]
    for i in range(TB):
        L.append(f"            x{i} = T[tb + numba.uint64({i}) * d_ + k]")
        L += [f"            c{i}_{j} += x{i} * a{j}" for j in range(RB)]
    for i in range(TB):
        L.append(f"        ob = (t + numba.uint64({i})) * m_ + numba.uint64(j0)")
        L += [f"        out[ob + numba.uint64({j})] = c{i}_{j}" for j in range(RB)]
    ns = {"np": np, "numba": numba}
    exec("\n".join(L), ns)
    return numba.njit(nogil=True, fastmath=fastmath, boundscheck=False)(ns["kern"])


def vector_tile(ahead):
    """The shipped tile's loop (gemm_kernels._tile, full blocks only) with the prefetch ``ahead`` tiles on."""
    @intrinsic
    def tile(typingctx, T, Ap, out, t, b):
        def codegen(context, builder, signature, args):
            tv, apv, ov, t0, blk = args
            Ta, Aa, Oa = (context.make_array(ty)(context, builder, v) for ty, v in zip(signature.args[:3], (tv, apv, ov)))
            i64, i32 = ir.IntType(64), ir.IntType(32)
            vec = ir.VectorType(ir.FloatType(), 8)
            c = lambda v: ir.Constant(i64, v)  # noqa: E731
            d, m = builder.extract_value(Ta.shape, 1), builder.extract_value(Oa.shape, 1)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec] * 3), "llvm.fma.v8f32")
            i8p = ir.IntType(8).as_pointer()
            pf = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                                "llvm.prefetch.p0i8")
            row = lambda i: builder.mul(builder.add(t0, c(i)), d)  # noqa: E731
            if ahead:
                with cgutils.for_range_slice(builder, c(0), d, c(16)) as (k, _):
                    for i in range(ahead * TB, ahead * TB + TB):
                        p = builder.gep(Ta.data, [builder.add(row(i), k)])
                        builder.call(pf, [builder.bitcast(p, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
            base = builder.mul(blk, builder.mul(d, c(16)))
            zero = ir.Constant(vec, [0.0] * 8)
            entry = builder.block
            loop, done = builder.append_basic_block("k"), builder.append_basic_block("done")
            builder.branch(loop)
            builder.position_at_end(loop)
            k = builder.phi(i64)
            acc = [builder.phi(vec) for _ in range(2 * TB)]
            a = [builder.load(builder.bitcast(builder.gep(Aa.data, [builder.add(base, builder.add(builder.mul(k, c(16)), c(h * 8)))]),
                                              vec.as_pointer()), align=4) for h in range(2)]
            new = []
            for i in range(TB):
                x = builder.load(builder.gep(Ta.data, [builder.add(row(i), k)]))
                xs = builder.shuffle_vector(builder.insert_element(ir.Constant(vec, ir.Undefined), x, ir.Constant(i32, 0)),
                                            ir.Constant(vec, ir.Undefined), ir.Constant(ir.VectorType(i32, 8), [0] * 8))
                new += [builder.call(fma, [xs, a[h], acc[2 * i + h]]) for h in range(2)]
            k1 = builder.add(k, c(1))
            builder.cbranch(builder.icmp_signed("<", k1, d), loop, done)
            k.add_incoming(c(0), entry); k.add_incoming(k1, loop)
            for p, v in zip(acc, new):
                p.add_incoming(zero, entry); p.add_incoming(v, loop)
            builder.position_at_end(done)
            for i in range(TB):
                orow = builder.add(builder.mul(builder.add(t0, c(i)), m), builder.mul(blk, c(16)))
                for h in range(2):
                    builder.store(new[2 * i + h], builder.bitcast(builder.gep(Oa.data, [builder.add(orow, c(h * 8))]), vec.as_pointer()), align=4)
            return context.get_dummy_value()
        return types.void(T, Ap, out, types.intp, types.intp), codegen

    @numba.njit(nogil=True, boundscheck=False)
    def gemm(T, Ap, out):
        for t in range(0, T.shape[0] - T.shape[0] % TB, TB):
            for b in range(out.shape[1] // 16):
                tile(T, Ap, out, t, b)
    return gemm


rng = np.random.default_rng(0)
n, R, d, piece = 90000, 32, 128, 3200
T = rng.standard_normal((n, d)).astype(np.float32)
A = rng.standard_normal((R, d)).astype(np.float32)
AT = np.ascontiguousarray(A.T)
Ap = np.ascontiguousarray(A.reshape(2, 16, d).transpose(0, 2, 1))
ATbs = [np.ascontiguousarray(AT[:, j0:j0 + RB]).ravel() for j0 in range(0, R, RB)]
ref = T @ AT
flop = 2 * n * R * d


def timed(run, out, f=None):
    run()
    ts = []
    for _ in range(5):
        t = time.perf_counter(); run(); ts.append(time.perf_counter() - t)
    assert np.abs(out - ref).max() < 1e-3
    ops = "" if f is None else str(dict(collections.Counter(re.findall(r"\n\s+(v\w+)", f.inspect_asm(f.signatures[0]))).most_common(4)))
    return f"{flop / min(ts) / 1e9:.1f} GFLOP/s {ops}"


with threadpool_limits(1):
    for name, fm in (("scalar tile, contraction", {"contract"}), ("scalar tile, contraction and reassociation", {"contract", "reassoc"})):
        k = scalar_tile(fm)
        out = np.zeros((n, R), np.float32)

        def run():
            for p0 in range(0, n, piece):
                Tf, of = T[p0:p0 + piece].reshape(-1), out[p0:p0 + piece].reshape(-1)
                for b, j0 in enumerate(range(0, R, RB)):
                    k(Tf, ATbs[b], of, Tf.size // d, d, R, j0)
        print(name, timed(run, out, k), flush=True)
    for ahead in (0, 1, 2, 4):
        g = vector_tile(ahead)
        out = np.zeros((n, R), np.float32)
        print(f"vector IR tile, prefetch {ahead} tiles ahead", timed(lambda: [g(T[p:p + piece], Ap, out[p:p + piece]) for p in range(0, n, piece)], out), flush=True)
    out = np.zeros((n, R), np.float32)
    print("OpenBLAS", timed(lambda: [np.matmul(T[p:p + piece], AT, out=out[p:p + piece]) for p in range(0, n, piece)], out), flush=True)
