"""Launch plan: the grid of one forward launch (query tiles on x, document runs or token shares
on y) and how many CTAs of a configuration an SM holds."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from . import tables as t
from .config import SMEM_PER_SM, FwdConfig, arch_of

__all__ = ["Launch", "plan_launch", "ctas_per_sm", "tile_rows", "queries_per_tile", "padded_split_min_ld",
           "SPLIT_MAX_CTAS"]

SPLIT_MAX_CTAS = t.SPLIT_MAX_CTAS


def tile_rows(lq: int, shared_queries: int) -> int:
    """Query rows one CTA tile can usefully hold: several whole short queries when
    ``shared_queries`` queries score the same documents (up to 128 rows)."""
    if lq >= 128 or shared_queries <= 1:
        return lq
    return lq * min(shared_queries, 128 // lq)


def queries_per_tile(cfg: FwdConfig, lq: int, shared_queries: int) -> int:
    """How many whole queries share one CTA tile (1: the tile is part of a single query)."""
    if not cfg.multi or shared_queries <= 1 or lq > cfg.bm:
        return 1
    return max(1, min(shared_queries, cfg.bm // lq))


def ctas_per_sm(cfg: FwdConfig, cc: int, registers: int | None = None) -> int:
    """CTAs of ``cfg`` resident per SM. ``registers``: a compiled kernel's count per thread (the
    compile check passes ptxas's); by default the ceilings the kernels are built to stay under."""
    arch = arch_of(cc)
    by_smem = SMEM_PER_SM.get(arch, 100 * 1024) // (cfg.smem_bytes + 1024)
    by_threads = 2048 // cfg.threads
    # Per-thread register ceilings of the compiled kernels (nvrtc.check_all checks them): two
    # warpgroups are capped at 128 by their launch bounds; one warpgroup is not capped, and its
    # argmax or multi-query epilogue takes up to 168 (a scaled type's argmax, INT8's, up to 192), and
    # the refined tokens-on-M tiles up to 256 (two CTAs).
    if registers is not None:
        regs = -(-registers // 8) * 8  # allocated per warp in units of 8 registers a thread
    elif cfg.residual or cfg.int8_argmax_strided or cfg.wide_registers:  # built for min_blocks CTAs an SM
        regs = 65536 // (cfg.threads * cfg.min_blocks)
    elif cfg.refine and cfg.tokm:  # each column's three best and their tokens: 212-224
        regs = 256
    elif cfg.wgmma and cfg.warps == 4 and (cfg.argmax or cfg.multi):
        regs = 192 if cfg.argmax and cfg.spec.scaled else 168
    elif cfg.x3 and cfg.mt > 1:  # two m-tiles of 3xTF32 fragments with the argmax or several queries: up to 256
        regs = 256
    else:
        regs = 128 if cfg.wgmma else 192
    by_regs = 65536 // (cfg.threads * regs)
    return max(1, min(by_smem, by_threads, max(1, by_regs)))


def padded_split_min_ld(cfg: FwdConfig) -> int:
    """The padded length from which padded documents may take a token split (``tables.PADDED_SPLIT_MIN_LD``)."""
    return t.PADDED_SPLIT_MIN_LD[0 if cfg.bm <= 64 else 1]


@dataclass(frozen=True, kw_only=True)
class Launch:
    n_qt: int  # query tiles per query
    qb: int  # whole queries per tile (n_qt is 1 when qb > 1)
    docs_per_cta: int
    grid: tuple[int, int, int]
    token_split: bool = False  # documents cut into grid[1] token shares (cuda_src/fwd/tile_scheduler.cuh, piece_role)


@functools.lru_cache(maxsize=4096)
def plan_launch(cfg: FwdConfig, cc: int, num_sms: int, nq: int, nd: int, lq: int, shared_queries: int = 1,
                ntok: int = 0) -> Launch:
    """Grid shape: query tiles on x (neighbours share document tiles in L2), document runs on y.

    The number of CTAs is a whole number of waves of resident CTAs, and each
    CTA streams a run of documents through one pipeline (its ring crosses
    document boundaries), so short documents cost no pipeline restarts and the
    last wave is not left half empty. ``ntok``: the token count of packed documents, which
    single-query tiles may split by token ranges instead (see ``tables.SPLIT_MIN_TILES``); for a
    ``strided`` configuration (padded documents), ``nd * Ld`` of one query's documents, split
    from ``padded_split_min_ld`` tokens a document.
    """
    qb = queries_per_tile(cfg, lq, shared_queries)
    n_qt = 1 if qb > 1 else max(1, -(-lq // cfg.bm))
    rows = -(-nq // qb) * n_qt
    resident = num_sms * ctas_per_sm(cfg, cc)
    if ntok > 0 and cfg.token_split and rows * 4 <= resident and nd * 4 <= resident // rows \
            and 2 * rows * nd <= num_sms and (not cfg.strided or ntok >= nd * padded_split_min_ld(cfg)):
        shares = min(min(resident, SPLIT_MAX_CTAS) // rows, -(-ntok // (t.SPLIT_MIN_TILES * cfg.bn)))
        if shares > 1:
            return Launch(n_qt=n_qt, qb=qb, docs_per_cta=0, grid=(rows, shares, 1), token_split=True)
    units = rows * nd
    if units <= resident:
        per = 1
    else:
        waves = -(-units // (resident * t.DOCS_PER_CTA))
        chunks = max(1, resident * waves // rows)
        per = -(-nd // chunks)
    per = max(per, -(-nd // 65535))  # grid.y limit
    return Launch(n_qt=n_qt, qb=qb, docs_per_cta=per, grid=(rows, -(-nd // per), 1))
