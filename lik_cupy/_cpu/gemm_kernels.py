"""The folded path's GEMM where BLAS runs it slowly: ``out[t, j] = T[t] . A[j]`` in float32 for a piece
of document tokens ``T [n, d]`` and a few query rows ``A [R, d]``, compiled by Numba like
``fold_kernels.py``; imported by ``fold.py`` when it builds the GEMM (its ``_OWN_GEMM`` says on which
CPUs and for how many rows), never with the package.

Why not BLAS: with R of a few dozen rows this product is thin, and OpenBLAS runs it at a third to a
half of its square rate, as it packs every token before using it R times. Here each tile of four
tokens by two vectors of query rows (16 rows on AVX2, 32 on AVX-512) keeps its eight accumulators in
vector registers through the whole of ``d``: per step, two vector loads of the query rows (packed once
a block by :func:`pack`), four broadcasts of the tokens' values and eight fused multiply-adds. The
tokens stream from memory once, each tile prefetching the tokens two tiles ahead, where the hardware's
own prefetch of four interleaved streams left the loop waiting on memory.

The loop is LLVM vector IR written through a Numba intrinsic rather than Python loops: Numba leaves
LLVM's SLP vectoriser off, so the same tile in scalar statements stays scalar, and its loop vectoriser,
given leave to reassociate, vectorises along ``d`` into horizontal sums instead (on one AMD EPYC core,
pieces of 3,200 tokens by 32 rows: 3 and 17 GFLOP/s, this tile 55-70, OpenBLAS 34-39;
``bench/results/archive/cpu_own_gemm_amd-epyc-avx2/variants.txt``). Each sum adds its ``d`` products
in ascending order with fused multiply-adds, an order the fold's margins cover as they cover every
order (``refine.margin``): the scores and argmax come out bit for bit as with BLAS, since float64
decides every near tie.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["pack", "tokens_by_rows"]

_LANES = (8, 16)  # float32 lanes of a vector: AVX2's, AVX-512's (a tile's query rows: two vectors)
_TOKENS = 4  # tokens a tile: with the two row vectors, eight accumulators, enough to cover the FMA's latency
_AHEAD = 2  # tiles between a token's prefetch and its use (1 to 4 level; none: 31-42 GFLOP/s against 55-70)
_LINE = 16  # float32 values a cache line


def pack(A: np.ndarray, lanes: int = 8) -> np.ndarray:
    """float32 ``A [R, d]`` as ``[ceil(R / w), d, w]`` for tiles of ``w = 2 * lanes`` rows (``lanes`` one of
    ``_LANES``): each tile's rows transposed, so that a step of ``d`` reads them as two vectors; rows past
    R are zeros. :func:`tokens_by_rows` takes the tile width from the last axis."""
    w = 2 * lanes
    r, d = A.shape
    whole = r // w
    out = np.zeros((-(-r // w), d, w), np.float32)  # (the one copy: the block's budget counts it, maxsim._Budget)
    out[:whole] = A[:whole * w].reshape(whole, w, d).transpose(0, 2, 1)
    out[whole:, :, :r - whole * w] = A[whole * w:].T
    return out


def _tile(tokens: int, lanes: int, partial: bool):
    """A tile of ``tokens`` tokens from ``t`` by the ``2 * lanes`` rows of block ``b``, into ``out [n, R]``;
    ``partial``: the last block, whose rows past R are not stored."""

    @intrinsic
    def tile(typingctx, T, Ap, out, t, b):
        # C-contiguous float32 of these ranks, into a writable out: the addresses below assume it (any
        # other array fails to type); tokens_by_rows checks the shapes agree
        if not all(isinstance(a, types.Array) and a.layout == "C" and a.dtype == types.float32 and a.ndim == k
                   for a, k in ((T, 2), (Ap, 3), (out, 2))) or not out.mutable:
            return None
        sig = types.void(T, Ap, out, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            tv, apv, ov, t0, blk = args
            Ta = context.make_array(signature.args[0])(context, builder, tv)
            Aa = context.make_array(signature.args[1])(context, builder, apv)
            Oa = context.make_array(signature.args[2])(context, builder, ov)
            i64, i32, f32 = ir.IntType(64), ir.IntType(32), ir.FloatType()
            vec = ir.VectorType(f32, lanes)
            c = lambda v: ir.Constant(i64, v)  # noqa: E731
            d = builder.extract_value(Ta.shape, 1)
            nrows = builder.extract_value(Oa.shape, 1)
            n = builder.extract_value(Ta.shape, 0)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec, vec, vec]), f"llvm.fma.v{lanes}f32")
            i8p = ir.IntType(8).as_pointer()
            prefetch = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                                      "llvm.prefetch.p0i8")
            row = lambda i: builder.mul(builder.add(t0, c(i)), d)  # noqa: E731 (token t0 + i's first value)

            # the tokens _AHEAD tiles on, line by line, where they exist (a prefetch is only a hint), once:
            # by the first block of rows
            ahead = _AHEAD * _TOKENS
            exists = builder.icmp_signed("<", builder.add(t0, c(ahead + tokens - 1)), n)
            with builder.if_then(builder.and_(exists, builder.icmp_signed("==", blk, c(0)))):
                with cgutils.for_range_slice(builder, c(0), d, c(_LINE)) as (k, _):
                    for i in range(ahead, ahead + tokens):
                        p = builder.gep(Ta.data, [builder.add(row(i), k)], inbounds=True)
                        builder.call(prefetch, [builder.bitcast(p, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3),
                                                ir.Constant(i32, 1)])

            base = builder.mul(blk, builder.mul(d, c(2 * lanes)))  # block b of Ap
            zero = ir.Constant(vec, [0.0] * lanes)
            entry = builder.block
            loop = builder.append_basic_block("tile.k")
            done = builder.append_basic_block("tile.done")
            builder.cbranch(builder.icmp_signed(">", d, c(0)), loop, done)  # d == 0: the sums stay zero

            builder.position_at_end(loop)
            k = builder.phi(i64)
            acc = [builder.phi(vec) for _ in range(tokens * 2)]
            a = []
            for h in range(2):
                p = builder.gep(Aa.data, [builder.add(base, builder.add(builder.mul(k, c(2 * lanes)), c(h * lanes)))],
                                inbounds=True)
                a.append(builder.load(builder.bitcast(p, vec.as_pointer()), align=4))
            new = []
            splat = ir.Constant(ir.VectorType(i32, lanes), [0] * lanes)
            for i in range(tokens):
                x = builder.load(builder.gep(Ta.data, [builder.add(row(i), k)], inbounds=True))
                xs = builder.shuffle_vector(builder.insert_element(ir.Constant(vec, ir.Undefined), x, ir.Constant(i32, 0)),
                                            ir.Constant(vec, ir.Undefined), splat)
                new += [builder.call(fma, [xs, a[h], acc[2 * i + h]]) for h in range(2)]
            k1 = builder.add(k, c(1))
            builder.cbranch(builder.icmp_signed("<", k1, d), loop, done)
            k.add_incoming(c(0), entry)
            k.add_incoming(k1, loop)
            for p, v in zip(acc, new):
                p.add_incoming(zero, entry)
                p.add_incoming(v, loop)

            builder.position_at_end(done)
            res = [builder.phi(vec) for _ in range(tokens * 2)]
            for r, v in zip(res, new):
                r.add_incoming(v, loop)
                r.add_incoming(zero, entry)
            j0 = builder.mul(blk, c(2 * lanes))
            for i in range(tokens):
                orow = builder.add(builder.mul(builder.add(t0, c(i)), nrows), j0)
                for h in range(2):
                    v = res[2 * i + h]
                    if not partial:
                        p = builder.gep(Oa.data, [builder.add(orow, c(h * lanes))], inbounds=True)
                        builder.store(v, builder.bitcast(p, vec.as_pointer()), align=4)
                        continue
                    for lane in range(lanes):  # the rows that exist, one by one
                        j = h * lanes + lane
                        with builder.if_then(builder.icmp_signed("<", builder.add(j0, c(j)), nrows)):
                            p = builder.gep(Oa.data, [builder.add(orow, c(j))], inbounds=True)
                            builder.store(builder.extract_element(v, ir.Constant(i32, lane)), p)
            return context.get_dummy_value()

        return sig, codegen

    return tile


def _kernel(lanes: int):
    """:func:`tokens_by_rows`' loop over the tiles of ``lanes``-wide vectors."""
    full, last, full1, last1 = (_tile(k, lanes, p) for k in (_TOKENS, 1) for p in (False, True))

    @numba.njit(nogil=True, boundscheck=False)
    def tiles(T, Ap, out):  # pragma: no cover (compiled)
        n = T.shape[0]
        w = Ap.shape[2]
        whole = out.shape[1] // w
        part = out.shape[1] % w != 0
        t = 0
        while t + _TOKENS <= n:
            for b in range(whole):
                full(T, Ap, out, t, b)
            if part:
                last(T, Ap, out, t, whole)
            t += _TOKENS
        while t < n:
            for b in range(whole):
                full1(T, Ap, out, t, b)
            if part:
                last1(T, Ap, out, t, whole)
            t += 1
    return tiles


_narrow, _wide = _kernel(_LANES[0]), _kernel(_LANES[1])


@numba.njit(nogil=True, cache=True, boundscheck=False)
def tokens_by_rows(T, Ap, out):  # pragma: no cover (compiled)
    """``out[t, j] = T[t] . A[j]``: float32 ``T [n, d]``, ``Ap = pack(A, lanes)``, ``out [n, R]``, each
    C-contiguous; R from ``out``, the tiles' vectors from ``Ap``'s last axis. Shapes that disagree raise
    ValueError before anything is read."""
    if Ap.shape[2] != 2 * _LANES[0] and Ap.shape[2] != 2 * _LANES[1]:
        raise ValueError("Ap is not gemm_kernels.pack's: its last axis is not a tile's rows")
    if Ap.shape[1] != T.shape[1] or Ap.shape[0] * Ap.shape[2] < out.shape[1] or out.shape[0] != T.shape[0]:
        raise ValueError("T [n, d], pack(A) of A [R, d] and out [n, R] disagree in n, d or R")
    if Ap.shape[2] == 2 * _LANES[1]:
        _wide(T, Ap, out)
    else:
        _narrow(T, Ap, out)
