"""Kernel choice: which compiled forward configuration runs a given problem.

Every rule that maps (architecture, dtype, dim, query length) to tile sizes is here, reading the
measured tables of ``tables.py``, so that the CPU-side compile check
(``lik_cupy._runtime.nvrtc.check_all``) can enumerate exactly what can run. A candidate is
skipped when its shared memory exceeds the architecture's per-block limit.
"""

from __future__ import annotations

import functools

from . import tables as t
from .config import (ELEM_CODES, ELEM_SIZES, MAX_DIM_INT8, MAX_DIM_RESIDUAL, SMEM_PER_BLOCK, FwdConfig, arch_of,
                     dim_bucket, int8_dim_ok, one_shot_bucket, padded_dim)
from .plan import tile_rows

__all__ = ["choose_forward", "choose_residual", "choose_backward", "all_forward_configs", "all_residual_configs",
           "residual_dim_ok", "split_family", "uses_split"]


def split_family(arch: int, hopper: bool, dim: int) -> tuple[int, str]:
    """The (architecture, family) row of ``tables.SPLIT_FROM`` a problem reads."""
    if hopper:
        return arch, "wgmma" if dim % 64 == 0 else "wgmma-odd"
    return arch, "mma"


def uses_split(arch: int, family: str, short: bool, dim: int) -> bool:
    """Whether the dispatch table runs ``dim`` split-d (always above 512, the one-shot tiles' limit)."""
    return dim > 512 or dim_bucket(dim) >= t.SPLIT_FROM.get((arch, family, short), t.SPLIT_FROM_DEFAULT)


def _qreg(elem: int, dp: int, mt: int) -> bool:
    # Query fragments cost mt * dp / (k per mma) * 4 registers; keep them at or under 64 (32 for
    # int8, whose scale handling needs the rest: 64 spilled with the argmax, nvrtc.check_all).
    per_k = {2: 8, 3: 32}.get(elem, 16)
    return mt * (dp // per_k) * 4 <= (32 if elem == 3 else 64)


def _wgmma_tiles(lq: int, ld: int, multi: bool) -> list[tuple[int, int]]:
    """(bn, stages) candidates for the Hopper kernel, best first."""
    cost = t.WGMMA_BN_COST_MULTI if multi else t.WGMMA_BN_COST
    order = sorted(cost, key=lambda bn: -(-max(ld, 1) // bn) * bn * cost[bn])
    return [(bn, st) for bn in order for st in t.WGMMA_STAGES[bn]]


def _short_wgmma_tiles(ld: int, int8: bool) -> list[tuple[int, int]]:
    """(bn, stages) candidates for the one-warpgroup Hopper tile, best first."""
    cost = t.SHORT_WGMMA_COST[int8]
    order = sorted(cost, key=lambda bn: -(-max(ld, 1) // bn) * bn * cost[bn])
    return [(bn, st) for bn in order for st in t.SHORT_WGMMA_STAGES[bn]]


def _wgmma_tma(int8: bool, argmax: bool, multi: bool, q_len: int) -> bool:
    """Whether a Hopper tile stages documents by TMA (when the caller can). From
    bench/results/archive/sweep_tma_nvidia-h100-80gb-hbm3.json and the H200 forward runs before and
    after: TMA is 11-17% faster at Lq=512 and 1024 (argmax too), on multi-query tiles and on
    INT8, but 1-5% slower on a single query of at most 128 tokens (Lq=128, Ld=1024, B=1000:
    0.0717 against 0.0681 ms on an H200), which streams D near the HBM rate either way.
    INT8's argmax with TMA spills at two CTAs per SM (nvrtc.check_all)."""
    return not (int8 and argmax) and (multi or q_len > 128)


def _tokm(int8: bool, argmax: bool, multi: bool, tma: bool, dim: int, ld: int) -> bool:
    """Whether an INT8 Hopper problem takes the tokens-on-M tiles."""
    return int8 and not argmax and not multi and tma and dim % 128 == 0 and dim * 128 * 128 < 1 << 22 \
        and ld >= t.TOKM_MIN_LD


@functools.lru_cache(maxsize=4096)
def choose_forward(cc: int, dtype: str, dim: int, lq: int, argmax: bool, vec: bool, wgmma: bool = True,
                   shared_queries: int = 1, ld: int = 1024, packed: bool = False, tma: bool = False,
                   x3: bool = False, cand: bool = False) -> FwdConfig:
    """The forward configuration for one problem on a device of compute capability ``cc``.

    ``shared_queries`` is the number of queries scored against the same
    documents (1 for per-query candidate sets); short queries are then packed
    several to a tile, so the tile is chosen by the rows it will hold.
    ``ld`` is the (padded or mean) document length, which sets how much of a
    document tile is padding; ``packed`` selects the packed-document variant.
    ``wgmma=False`` keeps to the portable mma.sync kernels (the fallback when
    an sm_90a build fails, and the switch tests use to cover both paths).
    ``tma``: the caller can hand the kernel tensor maps of D (and of the INT8 scales);
    one-shot Hopper tiles then stage documents by TMA.
    ``x3``: float32 at float32 accuracy (precision "fp32": three tf32 products per product,
    query fragments re-read from shared memory); ignored for other dtypes.
    ``cand``: each query scores the documents of its row of a candidate id array, in place
    (``LIK_CAND``): the tile of a single query, staged by cp.async (the same tile shape as without).
    """
    if cand:
        shared_queries, tma = 1, False
    arch = arch_of(cc)
    elem = ELEM_CODES[dtype]
    int8 = elem == 3
    if int8 and not int8_dim_ok(dim):
        raise ValueError(f"int8 scoring needs dim a multiple of 16 up to {MAX_DIM_INT8}, got {dim}")
    x3 = x3 and elem == 2
    dp = padded_dim(dim, elem)
    dim_bucket(dim)  # range check
    # Split-d chunks hold as many bytes per row for every dtype: INT8 takes twice the elements.
    chunk = 2 if int8 else 1
    q_len, lq = lq, tile_rows(lq, shared_queries)

    def multi(bm: int) -> bool:
        # Whole queries share the tile. The multi-query reduction costs a little on every
        # document, so single-query tiles keep the leaner one (6-9% on ColPali shapes).
        return shared_queries > 1 and 2 * q_len <= bm

    # Hopper tensor-core tiles can run. INT8's argmax over candidate ids spilled on the two-warpgroup
    # tiles (compile check): those take the mma.sync ones.
    wgmma_ok = wgmma and arch == 90 and elem != 2 and vec and not (cand and int8 and argmax)
    hopper = wgmma_ok and lq > 64
    row_bytes = dim * ELEM_SIZES[elem]
    short_hopper = wgmma_ok and lq <= 64 and row_bytes % 128 == 0 and row_bytes <= t.SHORT_WGMMA_MAX_ROW_BYTES
    limit = SMEM_PER_BLOCK.get(arch, 99 * 1024)  # unknown (newer) GPUs: the smallest limit
    lb = 32 if lq <= 32 else 64 if lq <= 64 else 128
    # INT8 runs one-shot up to 512 (its rows have the bytes, and fragment registers, of 16-bit rows
    # half as wide), split-d above.
    if (int8 and dim <= 512) or (not int8 and not uses_split(*split_family(arch, hopper, dim), lq <= 64, dim)):
        if short_hopper:
            for bn, stages in _short_wgmma_tiles(ld, int8):
                cfg = FwdConfig(elem=elem, dp=dim, warps=4, mt=1, bn=bn, stages=stages, qreg=False, argmax=argmax, vec=vec,
                                wgmma=True, multi=multi(64), packed=packed, cand=cand,
                                tma=tma and _wgmma_tma(int8, argmax, multi(64), q_len))
                if cfg.smem_bytes <= limit:
                    return cfg
        if hopper and row_bytes % 128 == 0:
            if _tokm(int8, argmax, multi(128), tma, dim, ld):
                cfg = FwdConfig(elem=elem, dp=dim, warps=8, mt=1, bn=128, stages=t.TOKM_STAGES, qreg=False, argmax=False,
                                vec=vec, wgmma=True, multi=False, packed=packed, cand=cand, tma=True, tokm=True)
                if cfg.smem_bytes <= limit:
                    return cfg
            for bn, stages in _wgmma_tiles(lq, ld, multi(128)):
                cfg = FwdConfig(elem=elem, dp=dim, warps=8, mt=1, bn=bn, stages=stages, qreg=False, argmax=argmax, vec=vec,
                                wgmma=True, multi=multi(128), packed=packed, cand=cand,
                                tma=tma and _wgmma_tma(int8, argmax, multi(128), q_len))
                # int8's argmax of several queries does not fit the 128 registers of two CTAs per SM.
                if cfg.smem_bytes <= limit and not (int8 and argmax and cfg.multi and cfg.min_blocks > 1):
                    return cfg
        # TMA needs whole 128-byte rows (no padding lanes) and swizzled tiles (not the fp32 lds path).
        tma_mma = tma and vec and arch == 90 and elem != 2 and dim == dp and row_bytes % 128 == 0
        rows = t.MMA_TABLE[(elem == 2, one_shot_bucket(dp // 2 if int8 else dp), lb)]
        for warps, mt, bn, stages in (t.X3_TABLE[lb] + rows if x3 else rows):
            cfg = FwdConfig(elem=elem, dp=dp, warps=warps, mt=mt, bn=bn, stages=stages,
                            qreg=_qreg(elem, dp, mt) and not x3, argmax=argmax, vec=vec, multi=multi(warps * mt * 16),
                            packed=packed, cand=cand, tma=tma_mma, x3=x3)
            if cfg.smem_bytes <= limit:
                return cfg
    if int8 and dim <= 512:
        raise ValueError(f"no int8 forward configuration fits dim {dim} on sm_{arch}")
    if wgmma_ok:
        # Hopper split-d: two warpgroups staged by TMA when the caller can hand over tensor maps,
        # one warpgroup by cp.async for a short query.
        warps = 8 if hopper else 4
        qhalf = not hopper and q_len <= 32 and not multi(64) and not int8
        if hopper and tma:
            tiles = t.WGMMA_SPLIT_TMA
        elif hopper:
            tiles = t.WGMMA_SPLIT_WIDE if dim_bucket(dim) >= t.WGMMA_SPLIT_WIDE_FROM else t.WGMMA_SPLIT_NARROW
        else:
            tiles = t.WGMMA_SPLIT_SHORT_QHALF if qhalf else t.WGMMA_SPLIT_SHORT
        for bn, bk, stages in tiles:
            cfg = FwdConfig(elem=elem, dp=bk * chunk, warps=warps, mt=1, bn=bn, stages=stages, qreg=False, argmax=argmax, vec=vec,
                            wgmma=True, multi=multi(warps * 16), packed=packed, cand=cand, split=True,
                            tma=tma and hopper, qhalf=qhalf)
            # Two CTAs of two warpgroups cap registers at 128: too few for the argmax of several queries.
            # A TMA box carries at most 256 INT8 scales (BN + 4 of them).
            if cfg.smem_bytes <= limit and not (warps == 8 and cfg.min_blocks > 1 and argmax and cfg.multi) \
                    and not (int8 and cfg.tma and bn + 4 > 256) \
                    and not (int8 and argmax and (cfg.min_blocks > 1 or (cfg.multi and bn > 128))):
                return cfg
    # 3xTF32's split fragments leave two m-tiles too few registers for the argmax of several
    # queries: those take the one m-tile rows.
    rows = t.SPLIT_TABLE[(elem == 2, lb)] + (t.SPLIT_TABLE[(True, 64)] if x3 and argmax else ())
    for warps, mt, bn, bk, stages in rows:
        cfg = FwdConfig(elem=elem, dp=bk * chunk, warps=warps, mt=mt, bn=bn, stages=stages, qreg=False, argmax=argmax,
                        vec=vec, multi=multi(warps * mt * 16), packed=packed, cand=cand, split=True, x3=x3)
        # 32 x 128 accumulators per warp leave no room for the argmax or multi-query epilogue
        # without spilling (nvrtc.check_all): those take the 64-token tiles.
        # INT8's scale handling spills them even without (compile check), as do padded documents
        # picked by candidate ids (the same warps and rows per warp, so the same scores).
        if cfg.smem_bytes <= limit \
                and not (bn > 64 and mt > 1 and (argmax or cfg.multi or int8 or (cand and not packed))) \
                and not (x3 and mt > 1 and argmax and cfg.multi):
            return cfg
    raise ValueError(f"no forward configuration fits dim {dim} on sm_{arch}")


def residual_dim_ok(dim: int) -> bool:
    """Whether the residual kernels take embedding dim ``dim``: a multiple of 8 up to ``MAX_DIM_RESIDUAL``."""
    return dim % 8 == 0 and 0 < dim <= MAX_DIM_RESIDUAL


@functools.lru_cache(maxsize=1024)
def choose_residual(cc: int, dtype: str, dim: int, lq: int, nbits: int, argmax: bool, shared_queries: int = 1,
                    packed: bool = False, cand: bool = False) -> FwdConfig:
    """The forward configuration for PLAID residual documents (``LIK_RESIDUAL``): one-shot
    mma.sync tiles of ``dtype`` ("float16" or "bfloat16": the tile the loader decompresses into,
    the queries' dtype) from ``tables.RESIDUAL_TILES``, the first whose shared memory fits.
    ``shared_queries`` as in :func:`choose_forward`; ``cand``: packed documents picked per query
    by candidate ids (one query per tile).
    """
    arch = arch_of(cc)
    if not residual_dim_ok(dim):
        raise ValueError(f"the residual kernels need dim a multiple of 8 up to {MAX_DIM_RESIDUAL}, got {dim}")
    if nbits not in (1, 2, 4):
        raise ValueError(f"nbits must be 1, 2 or 4, got {nbits}")
    elem = ELEM_CODES[dtype]
    if elem not in (0, 1):
        raise ValueError(f"residual tiles are float16 or bfloat16, not {dtype}")
    dp = padded_dim(dim)
    q_len, lq = lq, tile_rows(lq, 1 if cand else shared_queries)
    lb = 32 if lq <= 32 else 64 if lq <= 64 else 128
    limit = SMEM_PER_BLOCK.get(arch, 99 * 1024)
    for warps, mt, bn, stages in t.RESIDUAL_TILES[lb]:
        bm = warps * mt * 16
        cfg = FwdConfig(elem=elem, dp=dp, warps=warps, mt=mt, bn=bn, stages=stages, qreg=_qreg(elem, dp, mt),
                        argmax=argmax, vec=True, multi=not cand and shared_queries > 1 and 2 * q_len <= bm,
                        packed=packed, residual=nbits, cand=cand)
        if cfg.smem_bytes <= limit:
            return cfg
    raise ValueError(f"no residual configuration fits dim {dim} on sm_{arch}")


def all_residual_configs(arch: int, dims=None) -> list[FwdConfig]:
    """Every configuration ``choose_residual`` can return on ``arch`` for the embedding ``dims``
    (by default a sample reaching every tile of ``tables.RESIDUAL_TILES`` and both gather loops: 96, 128, 512)."""
    seen: dict[str, FwdConfig] = {}
    for dtype in ("float16", "bfloat16"):
        for dim in (dims if dims is not None else (96, 128, 512)):
            if not residual_dim_ok(dim):
                continue
            for nbits in (1, 2, 4):
                for lq, shared in ((32, 1), (64, 1), (128, 1), (300, 1), (8, 2), (32, 4)):
                    for argmax in (False, True):
                        for packed, cand in ((False, False), (True, False), (True, True)):
                            c = choose_residual(arch, dtype, dim, lq, nbits, argmax, shared, packed, cand)
                            seen[c.name] = c
    return list(seen.values())


def all_forward_configs(arch: int, dims=None) -> list[FwdConfig]:
    """Every configuration ``choose_forward`` (and ``choose_residual``) can return on ``arch`` for the
    embedding ``dims``.

    The default samples a few dims that between them reach every tile family, query / document
    length rule and flag (the CI compile check builds these); a padded dim of its own names a
    kernel of its own, so ``dims=range(16, 513, 16)`` plus the split-d widths is the whole set
    (the opt-in all-dims check in ``tests/test_compile.py``). INT8 keeps the dims it accepts.
    Padded configurations bring their token-split tiles (``FwdConfig.strided_tile``), which the
    launch takes for few long documents; single-query ones their candidate-id tiles (``cand``).
    """
    seen: dict[str, FwdConfig] = {}
    for dtype in ELEM_CODES:
        if dims is not None:
            picked = [d for d in dims if dtype != "int8" or int8_dim_ok(d)]
        else:
            picked = (64, 96, 128, 256, 384, 512, 1024, 4096) if dtype == "int8" else (64, 128, 256, 384, 512, 1000,
                                                                                          2048, 4096)
        for dim in picked:
            for lq, shared in ((32, 1), (64, 1), (128, 1), (1024, 1), (8, 2), (32, 2), (32, 4), (64, 2)):
                for ld in (128, 180, 300, 1024):
                    for argmax in (False, True):
                        for vec in (True, False):
                            for wg in (True, False):
                                for packed in (False, True):
                                    for tma in (False, True):
                                        for x3 in (False, True) if dtype == "float32" else (False,):
                                            c = choose_forward(arch, dtype, dim, lq, argmax, vec, wg, shared, ld, packed,
                                                               tma, x3)
                                            seen[c.name] = c
                                            s = c.strided_tile
                                            if s is not None:
                                                seen[s.name] = s
                                            if shared == 1 and not tma:  # candidate ids: one query a tile, no TMA
                                                c = choose_forward(arch, dtype, dim, lq, argmax, vec, wg, 1, ld, packed,
                                                                   False, x3, True)
                                                seen[c.name] = c
    seen.update((c.name, c) for c in all_residual_configs(arch, None if dims is None else
                                                          [d for d in dims if residual_dim_ok(d)]))
    return list(seen.values())


def choose_backward(method: str, cc: int, nq: int, nd: int, lq: int, rows: int, dim: int) -> str:
    """"atomic" or "csr" for ``maxsim_backward``'s dD (an explicit method is kept as asked).

    The fused atomic pass reads the argmax once and needs one fp32 [rows, dim] buffer; CSR
    adds a key build, a sort of Nq * Nd * Lq keys and a second pass, so "auto" takes the
    atomic path (measured faster at every shape of bench/results/latest/backward_nvidia-h200.json).
    """
    if method != "auto":
        return method
    return "atomic"
