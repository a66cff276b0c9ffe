"""Kernel choice: which compiled forward configuration runs a given problem.

Every rule that maps (architecture, dtype, dim, query length) to tile sizes is here, reading the
measured tables of ``tables.py``, so that the CPU-side compile check
(``lik_cupy._runtime.nvrtc.check_all``) can enumerate exactly what can run. A candidate is
skipped when its shared memory exceeds the architecture's per-block limit.
"""

from __future__ import annotations

import functools

from . import tables as t
from .config import MAX_DIM_RESIDUAL, SMEM_PER_BLOCK, FwdConfig, arch_of, dim_bucket, one_shot_bucket, padded_dim
from .elements import ELEMS, ElemSpec, elem_spec
from .plan import tile_rows

__all__ = ["choose_forward", "choose_residual", "choose_backward", "choose_hidden_fused", "BACKWARD_METHODS",
           "check_backward_method",
           "all_forward_configs", "all_residual_configs", "residual_dim_ok", "split_family", "uses_split",
           "RESIDUAL_DTYPES"]

# The element types PLAID residual tiles decompress into (the queries' dtype).
RESIDUAL_DTYPES = ("float16", "bfloat16")


def split_family(arch: int, hopper: bool, dim: int, esize: int = 2) -> tuple[int, str]:
    """The (architecture, family) row of ``tables.SPLIT_FROM`` a problem of ``esize``-byte elements reads."""
    if hopper:
        return arch, "wgmma" if dim * esize % 128 == 0 else "wgmma-odd"
    return arch, "mma"


def uses_split(arch: int, family: str, short: bool, dim: int, esize: int = 2) -> bool:
    """Whether the dispatch table runs ``dim`` split-d (always above 512, the one-shot tiles' limit).
    The wgmma families' thresholds are in 16-bit elements: a float32 row of ``dim`` holds the
    bytes of a 16-bit row twice as wide, and stages as much."""
    width = dim * esize // 2 if family.startswith("wgmma") else dim
    return dim > 512 or dim_bucket(min(width, 8192)) >= t.SPLIT_FROM.get((arch, family, short), t.SPLIT_FROM_DEFAULT)


def _qreg(spec: ElemSpec, dp: int, mt: int) -> bool:
    # Query fragments cost mt * dp / (k per mma) * 4 registers; keep them at or under 64 (32 for
    # scaled types, whose scale handling needs the rest: INT8 spilled at 64 with the argmax, nvrtc.check_all).
    return mt * (dp // spec.k) * 4 <= (32 if spec.scaled else 64)


def _wgmma_tiles(lq: int, ld: int, multi: bool) -> list[tuple[int, int]]:
    """(bn, stages) candidates for the Hopper kernel, best first."""
    cost = t.WGMMA_BN_COST_MULTI if multi else t.WGMMA_BN_COST
    order = sorted(cost, key=lambda bn: -(-max(ld, 1) // bn) * bn * cost[bn])
    return [(bn, st) for bn in order for st in t.WGMMA_STAGES[bn]]


def _short_wgmma_tiles(ld: int, spec: ElemSpec) -> list[tuple[int, int]]:
    """(bn, stages) candidates for the one-warpgroup Hopper tile, best first."""
    cost = t.SHORT_WGMMA_COST[spec.name]
    stages = t.SHORT_WGMMA_STAGES_TF32 if spec.tf32 else t.SHORT_WGMMA_STAGES
    order = sorted(cost, key=lambda bn: -(-max(ld, 1) // bn) * bn * cost[bn])
    return [(bn, st) for bn in order for st in stages[bn]]


def _wgmma_tma(spec: ElemSpec, argmax: bool, multi: bool, q_len: int, ld: int, packed: bool,
               short_tf32: bool = False) -> bool:
    """Whether a Hopper tile stages documents by TMA (when the caller can). From
    bench/results/archive/sweep_tma_nvidia-h100-80gb-hbm3.json and the H200 forward runs before and
    after: TMA is 11-17% faster at Lq=512 and 1024 (argmax too), on multi-query tiles and on
    INT8, but 1-5% slower on a single query of at most 128 tokens (Lq=128, Ld=1024, B=1000:
    0.0717 against 0.0681 ms on an H200), which streams D near the HBM rate either way.
    INT8's argmax with TMA (its scales' registers) spills at two CTAs per SM, or serializes its wgmma
    (packed documents, several queries a tile: nvrtc.check_all); FP8's compiles clean in every form.
    float32 tiles (512-byte rows at d = 128) take TMA for short single queries too: 0.0411 against
    0.0508 ms, packed 0.0457 against 0.0680, for 32 tokens x 1,000 documents of 300 on an H200
    (bench/results/latest/fp32_wgmma_sweep_nvidia-h200.json), except the one-warpgroup TF32 tiles
    (``short_tf32``: precision "tf32", not the refined ones) against padded documents of
    ``tables.TF32_SHORT_TMA_BELOW_LD`` tokens or more; so do FP8's argmax tiles, and its scores-only
    ones against packed documents or padded ones shorter than ``tables.FP8_SHORT_TMA_BELOW_LD``."""
    fp8 = spec.scaled and not spec.integer and (argmax or packed or ld < t.FP8_SHORT_TMA_BELOW_LD)
    f32 = spec.bytes == 4 and not (short_tf32 and not packed and ld >= t.TF32_SHORT_TMA_BELOW_LD)
    return not (spec.integer and argmax) and (multi or q_len > 128 or f32 or fp8)


def _tokm(spec: ElemSpec, argmax: bool, multi: bool, tma: bool, dim: int, ld: int) -> bool:
    """Whether a scaled Hopper problem takes the tokens-on-M tiles (per-token scales in registers; they
    read integer accumulators, INT8's, as floats: fwd/config.cuh, LIK_TOKM)."""
    return spec.scaled and spec.integer and not argmax and not multi and tma and dim % 128 == 0 \
        and dim * 128 * 128 < 1 << 22 and ld >= t.TOKM_MIN_LD


def _mma_native(spec: ElemSpec, arch: int, dim: int, argmax: bool) -> None:
    """ValueError where a problem would take mma.sync tiles that ``arch`` emulates for ``spec``
    (``ElemSpec.emulated_mma``: FP8 on sm_90, which takes its wgmma tiles only)."""
    if arch in spec.emulated_mma:
        raise ValueError(f"{spec.name} on sm_{arch} runs on its wgmma tiles only (mma.sync is emulated there), and "
                         f"none takes this problem (d = {dim}{', argmax' if argmax else ''}): they need 16-byte "
                         f"aligned Q and D and d a multiple of {128 // spec.bytes} up to {spec.one_shot_max}, and an argmax "
                         "over candidate ids has none; score without the argmax or on the CPU (backend='cpu'), "
                         "and leave LIK_DISABLE_WGMMA unset")


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
    spec = elem_spec(dtype)
    if not spec.dim_ok(dim):
        raise ValueError(f"{dtype} scoring needs dim {spec.dim_rule()}, got {dim}")
    if arch < spec.min_arch:
        raise ValueError(f"{dtype} scoring needs sm_{spec.min_arch} or newer, not sm_{arch}")
    elem, scaled = spec.code, spec.scaled
    x3 = x3 and spec.tf32
    dp = padded_dim(dim, spec)
    dim_bucket(dim)  # range check
    # Split-d chunks hold as many bytes per row for every dtype: one-byte types take twice the elements.
    chunk = spec.per_16bit
    q_len, lq = lq, tile_rows(lq, shared_queries)

    def multi(bm: int) -> bool:
        # Whole queries share the tile. The multi-query reduction costs a little on every
        # document, so single-query tiles keep the leaner one (6-9% on ColPali shapes).
        return shared_queries > 1 and 2 * q_len <= bm

    # Hopper tensor-core tiles can run (float32 on TF32: at float32 accuracy, x3, the one-shot tiles
    # refine their near-max similarities, and split-d keeps to mma.sync's 3xTF32). A scaled type's
    # argmax over candidate ids spilled on the two-warpgroup tiles (compile check): those take the
    # mma.sync ones.
    esize = spec.bytes
    wgmma_ok = wgmma and arch == 90 and spec.wgmma and vec and not (cand and scaled and argmax)
    row_bytes = dim * esize
    # A type whose mma.sync sm_90 emulates (FP8) has nothing to fall back on: short queries whose rows
    # are too wide for the one-warpgroup one-shot tiles (d 384, 512) take the two-warpgroup ones (half
    # their rows empty); wider rows run split-d, which has one-warpgroup tiles.
    hopper = wgmma_ok and (lq > 64 or (arch in spec.emulated_mma and row_bytes > t.SHORT_WGMMA_MAX_ROW_BYTES[esize]
                                       and dim <= spec.one_shot_max))
    short_hopper = wgmma_ok and lq <= 64 and row_bytes % 128 == 0 and row_bytes <= t.SHORT_WGMMA_MAX_ROW_BYTES[esize]
    limit = SMEM_PER_BLOCK.get(arch, 99 * 1024)  # unknown (newer) GPUs: the smallest limit
    lb = 32 if lq <= 32 else 64 if lq <= 64 else 128
    # A type with one_shot_max (INT8) runs one-shot up to it, split-d above; the others as SPLIT_FROM says.
    one_shot = dim <= spec.one_shot_max if spec.one_shot_max else not uses_split(
        *split_family(arch, hopper, dim, esize), lq <= 64, dim, esize)
    if one_shot:
        if short_hopper and x3 and not (argmax or multi(64) or cand) and tma and q_len <= t.REFINE_TOKM_MAX_LQ \
                and ld >= t.REFINE_TOKM_MIN_LD:
            for stages in t.REFINE_TOKM_STAGES:
                cfg = FwdConfig(elem=elem, dp=dim, warps=4, mt=1, bn=64, stages=stages, qreg=False, argmax=False, vec=vec,
                                wgmma=True, packed=packed, refine=True, tma=True, tokm=True)
                if cfg.smem_bytes <= limit:
                    return cfg
        if short_hopper:
            for bn, stages in _short_wgmma_tiles(ld, spec):
                cfg = FwdConfig(elem=elem, dp=dim, warps=4, mt=1, bn=bn, stages=stages, qreg=False, argmax=argmax, vec=vec,
                                wgmma=True, multi=multi(64), packed=packed, cand=cand, refine=x3,
                                tma=tma and _wgmma_tma(spec, argmax, multi(64), q_len, ld, packed, not x3))
                if cfg.smem_bytes <= limit:
                    return cfg
        if hopper and row_bytes % 128 == 0:
            if _tokm(spec, argmax, multi(128), tma, dim, ld):
                cfg = FwdConfig(elem=elem, dp=dim, warps=8, mt=1, bn=128, stages=t.TOKM_STAGES, qreg=False, argmax=False,
                                vec=vec, wgmma=True, multi=False, packed=packed, cand=cand, tma=True, tokm=True)
                if cfg.smem_bytes <= limit:
                    return cfg
            tiles = _wgmma_tiles(lq, ld, multi(128))
            if spec.tf32 and not (x3 or argmax or multi(128) or cand) and ld >= t.TF32_MID_MIN_LD and q_len <= 128:
                tiles = [t.TF32_MID_TILE, *tiles]
            for bn, stages in tiles:
                cfg = FwdConfig(elem=elem, dp=dim, warps=8, mt=1, bn=bn, stages=stages, qreg=False, argmax=argmax, vec=vec,
                                wgmma=True, multi=multi(128), packed=packed, cand=cand, refine=x3,
                                tma=tma and _wgmma_tma(spec, argmax, multi(128), q_len, ld, packed))
                # INT8's argmax of several queries does not fit the 128 registers of two CTAs per SM.
                if cfg.smem_bytes <= limit and not (scaled and argmax and cfg.multi and cfg.min_blocks > 1):
                    return cfg
        _mma_native(spec, arch, dim, argmax)
        # TMA needs whole 128-byte rows (no padding lanes) and swizzled tiles (not the tf32 lds path).
        tma_mma = tma and vec and arch == 90 and not spec.tf32 and dim == dp and row_bytes % 128 == 0
        rows = t.MMA_TABLE[(spec.tf32, one_shot_bucket(dp // spec.per_16bit), lb)]
        for warps, mt, bn, stages in (t.X3_TABLE[lb] + rows if x3 else rows):
            cfg = FwdConfig(elem=elem, dp=dp, warps=warps, mt=mt, bn=bn, stages=stages,
                            qreg=_qreg(spec, dp, mt) and not x3, argmax=argmax, vec=vec, multi=multi(warps * mt * 16),
                            packed=packed, cand=cand, tma=tma_mma, x3=x3)
            # Two m-tiles of 3xTF32 fragments with the argmax of several queries take 255 registers at
            # d = 256 and spill on sm_80 (nvrtc.check_all; 244-250 below it): those take the one m-tile rows.
            if cfg.smem_bytes <= limit and not (x3 and mt > 1 and argmax and cfg.multi and dp >= 256):
                return cfg
    if spec.one_shot_max and one_shot:
        raise ValueError(f"no {dtype} forward configuration fits dim {dim} on sm_{arch}")
    if wgmma_ok and not x3:
        # Hopper split-d: two warpgroups staged by TMA when the caller can hand over tensor maps,
        # one warpgroup by cp.async for a short query. A scaled type's argmax leaves out the
        # one-warpgroup tiles (two CTAs an SM): where mma.sync is emulated (FP8 on sm_90) short
        # queries then take the two-warpgroup ones, their rows past the queries empty.
        for two in (True,) if hopper else (False, True) if arch in spec.emulated_mma else (False,):
            warps = 8 if two else 4
            qhalf = not two and q_len <= 32 and not multi(64) and not scaled
            if two and tma:
                tiles = t.WGMMA_SPLIT_TMA
            elif two:
                tiles = t.WGMMA_SPLIT_WIDE if dim_bucket(dim) >= t.WGMMA_SPLIT_WIDE_FROM else t.WGMMA_SPLIT_NARROW
            else:
                tiles = t.WGMMA_SPLIT_SHORT_QHALF if qhalf else t.WGMMA_SPLIT_SHORT
            for bn, bk, stages in tiles:  # bk: 16-bit elements of a chunk (its bytes / 2)
                cfg = FwdConfig(elem=elem, dp=bk * 2 // esize, warps=warps, mt=1, bn=bn, stages=stages, qreg=False,
                                argmax=argmax, vec=vec, wgmma=True, multi=multi(warps * 16), packed=packed, cand=cand,
                                split=True, tma=tma and two, qhalf=qhalf)
                # Two CTAs of two warpgroups cap registers at 128: too few for the argmax of several queries.
                # A TMA box carries at most 256 scales (BN + 4 of them).
                if cfg.smem_bytes <= limit and not (warps == 8 and cfg.min_blocks > 1 and argmax and cfg.multi) \
                        and not (scaled and cfg.tma and bn + 4 > 256) \
                        and not (scaled and argmax and (cfg.min_blocks > 1 or (cfg.multi and bn > 128))):
                    return cfg
    _mma_native(spec, arch, dim, argmax)
    # 3xTF32's split fragments leave two m-tiles too few registers for the argmax of several
    # queries: those take the one m-tile rows.
    rows = t.SPLIT_TABLE[(spec.tf32, lb)] + (t.SPLIT_TABLE[(True, 64)] if x3 and argmax else ())
    for warps, mt, bn, bk, stages in rows:
        cfg = FwdConfig(elem=elem, dp=bk * chunk, warps=warps, mt=mt, bn=bn, stages=stages, qreg=False, argmax=argmax,
                        vec=vec, multi=multi(warps * mt * 16), packed=packed, cand=cand, split=True, x3=x3)
        # 32 x 128 accumulators per warp leave no room for the argmax or multi-query epilogue
        # without spilling (nvrtc.check_all): those take the 64-token tiles.
        # INT8's scale handling spills them even without (compile check), as do padded documents
        # picked by candidate ids (the same warps and rows per warp, so the same scores).
        if cfg.smem_bytes <= limit \
                and not (bn > 64 and mt > 1 and (argmax or cfg.multi or scaled or (cand and not packed))) \
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
    spec = elem_spec(dtype)
    if spec.name not in RESIDUAL_DTYPES:
        raise ValueError(f"residual tiles are float16 or bfloat16, not {dtype}")
    dp = padded_dim(dim, spec)
    q_len, lq = lq, tile_rows(lq, 1 if cand else shared_queries)
    lb = 32 if lq <= 32 else 64 if lq <= 64 else 128
    limit = SMEM_PER_BLOCK.get(arch, 99 * 1024)
    for warps, mt, bn, stages in t.RESIDUAL_TILES[lb]:
        bm = warps * mt * 16
        cfg = FwdConfig(elem=spec.code, dp=dp, warps=warps, mt=mt, bn=bn, stages=stages, qreg=_qreg(spec, dp, mt),
                        argmax=argmax, vec=True, multi=not cand and shared_queries > 1 and 2 * q_len <= bm,
                        packed=packed, residual=nbits, cand=cand)
        if cfg.smem_bytes <= limit:
            return cfg
    raise ValueError(f"no residual configuration fits dim {dim} on sm_{arch}")


def all_residual_configs(arch: int, dims=None) -> list[FwdConfig]:
    """Every configuration ``choose_residual`` can return on ``arch`` for the embedding ``dims``
    (by default a sample reaching every tile of ``tables.RESIDUAL_TILES`` and both gather loops: 96, 128, 512)."""
    seen: dict[str, FwdConfig] = {}
    for dtype in RESIDUAL_DTYPES:
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


def _chosen(spec: ElemSpec, arch: int, *args) -> FwdConfig | None:
    """``choose_forward(arch, spec.name, *args)``, or None for a problem that only emulated mma.sync
    tiles would take (``ElemSpec.emulated_mma``)."""
    try:
        return choose_forward(arch, spec.name, *args)
    except ValueError:
        if arch_of(arch) in spec.emulated_mma:
            return None
        raise


def all_forward_configs(arch: int, dims=None) -> list[FwdConfig]:
    """Every configuration ``choose_forward`` (and ``choose_residual``) can return on ``arch`` for the
    embedding ``dims``.

    The default samples a few dims that between them reach every tile family, query / document
    length rule and flag (the CI compile check builds these); a padded dim of its own names a
    kernel of its own, so ``dims=range(16, 513, 16)`` plus the split-d widths is the whole set
    (the opt-in all-dims check in ``tests/test_compile.py``). Each element type keeps the dims it accepts.
    Padded configurations bring their token-split tiles (``FwdConfig.strided_tile``), which the
    launch takes for few long documents; single-query ones their candidate-id tiles (``cand``).
    """
    seen: dict[str, FwdConfig] = {}
    for spec in ELEMS:
        if arch_of(arch) < spec.min_arch:
            continue
        if dims is not None:
            picked = [d for d in dims if spec.dim_ok(d)]
        else:  # a float's odd width (1000) pads; a scaled type's (96) has a one-shot bucket of its own
            picked = (64, 96, 128, 256, 384, 512, 1024, 4096) if spec.scaled else (64, 128, 256, 384, 512, 1000, 2048,
                                                                                    4096)
        for dim in picked:
            for lq, shared in ((32, 1), (64, 1), (128, 1), (1024, 1), (8, 2), (32, 2), (32, 4), (64, 2)):
                for ld in (128, 180, 300, 1024):
                    for argmax in (False, True):
                        for vec in (True, False):
                            for wg in (True, False):
                                for packed in (False, True):
                                    for tma in (False, True):
                                        for x3 in (False, True) if spec.tf32 else (False,):
                                            c = _chosen(spec, arch, dim, lq, argmax, vec, wg, shared, ld, packed,
                                                        tma, x3)
                                            if c is None:
                                                continue
                                            seen[c.name] = c
                                            s = c.strided_tile
                                            if s is not None:
                                                seen[s.name] = s
                                            if shared == 1 and not tma:  # candidate ids: one query a tile, no TMA
                                                c = _chosen(spec, arch, dim, lq, argmax, vec, wg, 1, ld, packed,
                                                            False, x3, True)
                                                if c is not None:
                                                    seen[c.name] = c
    seen.update((c.name, c) for c in all_residual_configs(arch, None if dims is None else
                                                          [d for d in dims if residual_dim_ok(d)]))
    return list(seen.values())


BACKWARD_METHODS = ("auto", "csr", "atomic")  # maxsim_backward's method=


def check_backward_method(method) -> None:
    """ValueError unless ``method`` is one of ``BACKWARD_METHODS`` (an array of names is no name)."""
    if not isinstance(method, str) or method not in BACKWARD_METHODS:
        raise ValueError(f"method must be one of {BACKWARD_METHODS}, got {method!r}")


def choose_backward(method: str, cc: int, nq: int, nd: int, lq: int, rows: int, dim: int) -> str:
    """"atomic" or "csr" for ``maxsim_backward``'s dD (an explicit method is kept as asked).

    The fused atomic pass reads the argmax once and needs one fp32 [rows, dim] buffer; CSR
    adds a key build, a sort of Nq * Nd * Lq keys and a second pass, so "auto" takes the
    atomic path (measured faster at every shape of bench/results/latest/backward_nvidia-h200.json).
    """
    if method != "auto":
        return method
    return "atomic"


def choose_hidden_fused(cc: int, dtype: str, dim: int, hidden: int, query_rows: int, rows: int) -> int | None:
    """The query width (``tables.HIDDEN_FUSED_QN``) of the fused head's one-pass forward
    (``cuda_src/hidden_maxsim.cu``) for ``query_rows`` (Nq * Lq) query tokens against ``rows``
    (Nd * Ld) hidden states of width ``hidden`` projected to ``dim``, or None where it does not run:
    a Hopper GPU (wgmma and TMA), float16 or bfloat16, d = 128, ``hidden`` a multiple of 64 (whole
    128-byte TMA boxes), at least one row of each, and rows whose indices, a tile past the last
    included, fit the kernel's and TMA's 32-bit coordinates."""
    if cc != 90 or dtype not in ("float16", "bfloat16") or dim != 128 or hidden % 64 or not hidden:
        return None
    if not 0 < query_rows <= t.HIDDEN_FUSED_QN[-1] or not 0 < rows <= 2**31 - 256:
        return None
    return next(qn for qn in t.HIDDEN_FUSED_QN if query_rows <= qn)
