"""Kernel choice: which compiled forward configuration runs a given problem.

Every rule that maps (architecture, dtype, dim, query length) to tile sizes
lives here, so that tuning is one table to edit and the CPU-side compile
check (``lik_cupy.compile.check_all``) can enumerate exactly what can run.
The preference lists are ordered by measured speed on the GPUs named in
``bench/results``; a candidate is skipped when its shared memory exceeds the
architecture's per-block limit.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

# Architectures we build machine code for (compute capability * 10).
SUPPORTED_ARCHS = (80, 86, 89, 90)

# Largest dynamic shared memory one block may opt into, per architecture.
_SMEM_PER_BLOCK = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}
_SMEM_PER_SM = {80: 164 * 1024, 86: 100 * 1024, 87: 164 * 1024, 89: 100 * 1024, 90: 228 * 1024}

ELEM_CODES = {"float16": 0, "bfloat16": 1, "float32": 2, "int8": 3}
MAX_DIM = 8192  # split-d has no inherent limit; this is the widest dim the tests cover
# INT8 runs one-shot only (no split-d): dims a multiple of 16 up to this.
MAX_DIM_INT8 = 512


@dataclass(frozen=True)
class FwdConfig:
    """One compiled variant of ``cuda_src/maxsim_fwd.cu``."""

    elem: int  # 0 fp16, 1 bf16, 2 fp32 (tf32 tensor cores), 3 int8 (with per-token scales)
    dp: int  # padded dim (multiple of 16, 32 for int8); split-d: the dim chunk staged per pipeline stage
    warps: int
    mt: int  # 16-row mma tiles per warp
    bn: int  # document tokens per pipeline stage
    stages: int
    qreg: bool  # query fragments in registers
    argmax: bool
    vec: bool  # 16-byte cp.async copies
    wgmma: bool = False  # Hopper warpgroup MMA (sm_90a)
    multi: bool = False  # a tile may hold several whole queries
    packed: bool = False  # packed documents with offsets
    split: bool = False  # split-d: query and document chunks of dp columns share each stage
    tma: bool = False  # tiles staged by TMA from tensor maps (sm_90: one-shot with 128-byte multiple rows, or split-d wgmma)
    qhalf: bool = False  # split-d, one warpgroup, one query of <= 32 tokens: stages hold 32 query rows, not 64
    tokm: bool = False  # int8 Hopper tiles with document tokens on the wgmma M side (per-token scales in registers)

    @property
    def token_split(self) -> bool:
        """Whether the kernel can split packed documents over CTAs by token shares (maxsim_fwd.cu's
        TSPLIT: single-query one-shot tiles of float16 or bfloat16 elements)."""
        return self.packed and not (self.multi or self.tokm or self.split) and self.elem in (0, 1)

    @property
    def query_rows_staged(self) -> int:
        return 32 if self.qhalf else self.bm

    @property
    def bm(self) -> int:
        return self.warps * self.mt * 16

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def esize(self) -> int:
        return ELEM_SIZES[self.elem]

    @functools.cached_property  # read on every launch
    def smem_bytes(self) -> int:
        rows = self.stages * (self.query_rows_staged + self.bn) if self.split else self.bm + self.stages * self.bn
        if self.wgmma or self.tma:  # unpadded swizzled tiles, slack to align them to 1024 bytes, TMA barriers
            return rows * self.dp * self.esize + 1024 + self._extra_bytes + (16 * self.stages if self.tma else 0)
        return rows * (self.dp + 16 // self.esize) * self.esize + self._extra_bytes

    @property
    def _extra_bytes(self) -> int:
        # double-buffered row maxima (every warp's with tokm, the tile's with multi) or per-warp
        # sums; int8: each stage's token scales
        scales = self.stages * (self.bn + (32 if self.tma else 0)) * 4 if self.elem == 3 else 0  # as SCL in the kernel
        red = self.warps * self.bm if self.tokm else self.bm if self.multi else self.warps  # as RED in the kernel
        return 2 * red * 4 + (self.bm * 4 if self.tokm else 0) + scales

    @functools.cached_property  # read on every launch
    def name(self) -> str:
        e = ("f16", "bf16", "f32", "i8")[self.elem]
        return (
            f"lik_maxsim_fwd_{e}_{'k' if self.split else 'd'}{self.dp}_w{self.warps}m{self.mt}_n{self.bn}s{self.stages}"
            f"{'_qreg' if self.qreg else ''}{'_argmax' if self.argmax else ''}{'_vec' if self.vec else ''}"
            f"{'_wgmma' if self.wgmma else ''}{'_mq' if self.multi else ''}{'_packed' if self.packed else ''}"
            f"{'_tma' if self.tma else ''}{'_qh' if self.qhalf else ''}{'_tokm' if self.tokm else ''}"
        )

    def defines(self) -> dict[str, int | str]:
        return {
            "LIK_NAME": self.name,
            "LIK_ELEM": self.elem,
            "LIK_DP": self.dp,
            "LIK_WARPS": self.warps,
            "LIK_MT": self.mt,
            "LIK_BN": self.bn,
            "LIK_STAGES": self.stages,
            "LIK_QREG": int(self.qreg),
            "LIK_ARGMAX": int(self.argmax),
            "LIK_VEC": int(self.vec),
            "LIK_WGMMA": int(self.wgmma),
            "LIK_MULTI": int(self.multi),
            "LIK_PACKED": int(self.packed),
            "LIK_SPLIT": int(self.split),
            "LIK_TMA": int(self.tma),
            "LIK_QHALF": int(self.qhalf),
            "LIK_TOKM": int(self.tokm),
            "LIK_MIN_BLOCKS": self.min_blocks,
            "LIK_DOC_COST": self.doc_cost,
        }

    @property
    def doc_cost(self) -> int:
        """Packed documents: tokens of work each document counts for beside its own when the CTAs
        share the corpus out (maxsim_fwd.cu, shares), for its last tile's padding and its score.
        From bench/results/sweep_doc_cost_nvidia-h100-80gb-hbm3.json (one and 32 queries of 32
        tokens), 1.5 tiles against tokens alone: 500 documents of 16 tokens then 500 of 512 in
        29.95 us against 69.07 (flash-maxsim 31.95), 32 queries 169.9 against 863.9; 4,000 of 16
        and 250 of 1,024 shuffled 43.5 against 103.9 (flash-maxsim 49.0); within 2.8% of the best
        variant on the ragged corpus and on 20,000 passages in three runs (_run2.json, _run3.json);
        with 30% of the documents empty, 3.0-3.4% behind tokens alone for one query, level for 32."""
        return self.bn * 3 // 2 if self.packed else 0

    @functools.cached_property  # read on every launch
    def min_blocks(self) -> int:
        """CTAs per SM the kernel is compiled for: two Hopper CTAs when their shared memory fits
        (registers then capped at 128) and their accumulators do too (at most 128 tokens per
        tile), else no register cap."""
        return 2 if (self.wgmma and self.bn <= 128
                     and 2 * (self.smem_bytes + 1024) <= _SMEM_PER_SM[90]) else 1

    def target(self, arch: int) -> str:
        """NVRTC architecture suffix: wgmma and TMA kernels are built for sm_90a (the TMA and
        mbarrier helpers sit beside the wgmma ones)."""
        return "90a" if self.wgmma or self.tma else str(arch)


ELEM_SIZES = (2, 2, 4, 1)


def int8_dim_ok(dim: int) -> bool:
    """Whether the INT8 kernels take embedding dim ``dim``: a multiple of 16 up to ``MAX_DIM_INT8``."""
    return dim % 16 == 0 and dim <= MAX_DIM_INT8


def padded_dim(dim: int, elem: int = 0) -> int:
    """The kernel's dim: a multiple of 16, or of 32 for int8 (32 bytes of K per mma either way)."""
    step = 32 if elem == 3 else 16
    return max(step, -(-dim // step) * step)


def _dim_bucket(dp: int) -> int:
    for b in (64, 128, 256, 512):
        if dp <= b:
            return b
    raise ValueError(f"dim {dp} is above the one-shot kernel's maximum of 512")


# Buckets of the split-d table: a dim belongs to the first bucket at or above it.
DIM_BUCKETS = (64, 128, 256, 384, 512, 768, 1024, 2048, 4096, 8192)


def dim_bucket(dim: int) -> int:
    for b in DIM_BUCKETS:
        if dim <= b:
            return b
    raise ValueError(f"dim {dim} is above the supported maximum of {MAX_DIM}")


# Smallest dim bucket that runs split-d (dim chunks streamed through the ring
# with the document tiles) rather than one-shot (the whole dim of the query tile
# staged once), keyed by (architecture, kernel family, short query). Families:
#   "wgmma"  Hopper, one-shot wgmma (dim a multiple of 64) against split-d wgmma;
#   "wgmma-odd"  Hopper, other dims: one-shot mma.sync against split-d wgmma;
#   "mma"    mma.sync both ways (every other GPU, short queries, fp32, unaligned rows).
# Short = at most 64 query rows per tile. From bench/results/sweep_split_d_nvidia-h200.json
# (fp16, ColPali Lq=Ld=1024 B=128 and textual Lq=32 Ld=180 B=1024):
#   - wgmma: one-shot 0.062/0.120 ms at d=128/256 vs split 0.080/0.144; split
#     0.207 ms at 384 vs one-shot 0.242. With TMA staging on both sides the same split holds
#     (sweep_split_d_nvidia-h100-80gb-hbm3.json): one-shot 0.091 vs split 0.105 ms at d=256,
#     split 0.146 vs one-shot 0.164 at 384.
#   - short queries on Hopper: one-shot (mma.sync, TMA) and the one-warpgroup split tiles are
#     level at d=384/512 (0.0525 vs 0.0521, 0.0684 vs 0.0679 ms on the H100), so split-d
#     starts where one-shot tiles stop fitting.
#   - wgmma-odd: split wgmma beats one-shot mma.sync already at d=128 (0.080 vs 0.102 ms).
#   - mma, long queries: split 0.222 ms at 256 vs one-shot 0.236, and 0.32 vs 0.55 at 384;
#     short queries: one-shot stays ahead through 512 (0.059 vs 0.074 ms).
# The mma rows of sm_80/86/89 reuse the H200 measurement of the same kernels (no such GPU
# was measured), fp32 reuses the 16-bit rows. An architecture not listed splits only
# above 512, where one-shot tiles stop fitting.
_SPLIT_FROM: dict[tuple[int, str, bool], int] = {(90, "wgmma", False): 384, (90, "wgmma-odd", False): 128}
for _arch in (80, 86, 89, 90):
    _SPLIT_FROM[(_arch, "mma", False)] = 256
    _SPLIT_FROM[(_arch, "mma", True)] = 1024
_SPLIT_FROM_DEFAULT = 1024

# Split-d tiles, best first. Hopper: (bn, dim chunk, stages).
# - Two warpgroups x 64 query rows, both chunks of a stage staged by TMA (the default on an
#   sm_90 with a CUDA 12+ driver): 256-token tiles at four stages lead at every split bucket,
#   704-766 TF/s from d=384 to 2048 against 605-667 for the best 128-token tile and 462-575 for
#   cp.async staging (sweep_split_d_nvidia-h100-80gb-hbm3.json; one-shot TMA tiles give 749 at
#   d=256).
# - The same staged by cp.async (TMA turned off), by dim bucket: 128-token tiles at three
#   stages (two CTAs per SM) up to 1024, 256-token tiles (one CTA, a third less traffic per MMA)
#   from 2048 (sweep_split_d_nvidia-h200.json: 1.08 vs 1.11 ms at 2048, 2.27 vs 2.33 at 4096).
# - One warpgroup (64 rows) for a short query: memory-bound, 64-token tiles six stages deep by
#   cp.async stream D at 2.8-2.9 TB/s on an H100, 3-30% ahead of 128- and 256-token tiles, of
#   TMA staging (whose whole-box copies pay for the rows past each document) and of the
#   mma.sync split tiles (same sweep, textual Lq=32, Ld=180, d=768..2048).
# - A single query of at most 32 tokens stages 32 query rows per stage instead of 64 (qhalf:
#   12 KB a stage at 64 x 64): 128-dim chunks four stages deep are fastest or within 1% of it
#   from d=768 to 4096 on an H100, 2-4% ahead of the 64-row stages and level with flash-maxsim
#   (0.98-1.04x; sweep_split_short_nvidia-h100-80gb-hbm3.json, textual Lq=32 and 20, Ld=180).
# mma.sync: (warps, mt, bn, dim chunk, stages) keyed by (fp32, query-length bucket); fp32
# chunks are 32 wide so a stage's bytes match.
_WGMMA_SPLIT_TMA = ((256, 64, 4), (256, 64, 3), (128, 64, 4))
_WGMMA_SPLIT_NARROW = ((128, 64, 3), (256, 64, 4), (128, 128, 3))
_WGMMA_SPLIT_WIDE = ((256, 64, 4), (128, 64, 3))
_WGMMA_SPLIT_WIDE_FROM = 2048
_WGMMA_SPLIT_SHORT = ((64, 64, 6), (64, 64, 4))
_WGMMA_SPLIT_SHORT_QHALF = ((64, 128, 4), (64, 64, 8), (64, 64, 4))
_SPLIT_TABLE: dict[tuple[bool, int], tuple[tuple[int, int, int, int, int], ...]] = {
    (False, 32): ((2, 1, 64, 64, 4), (2, 1, 64, 64, 3)),
    (False, 64): ((4, 1, 64, 64, 4), (4, 1, 64, 64, 3)),
    (False, 128): ((4, 2, 128, 64, 3), (4, 2, 128, 32, 4), (4, 2, 64, 64, 3)),
    (True, 32): ((2, 1, 64, 32, 4), (2, 1, 64, 32, 3)),
    (True, 64): ((4, 1, 64, 32, 4), (4, 1, 64, 32, 3)),
    (True, 128): ((4, 2, 64, 32, 3), (4, 2, 32, 32, 3)),
}


def split_family(arch: int, hopper: bool, dim: int) -> tuple[int, str]:
    """The (architecture, family) row of ``_SPLIT_FROM`` a problem reads."""
    if hopper:
        return arch, "wgmma" if dim % 64 == 0 else "wgmma-odd"
    return arch, "mma"


def uses_split(arch: int, family: str, short: bool, dim: int) -> bool:
    """Whether the dispatch table runs ``dim`` split-d (always above 512, the one-shot tiles' limit)."""
    return dim > 512 or dim_bucket(dim) >= _SPLIT_FROM.get((arch, family, short), _SPLIT_FROM_DEFAULT)


# (warps, mt, bn, stages) in order of preference, keyed by
# (16-bit or fp32, dim bucket, query-length bucket). Short queries use short
# row tiles so no tensor-core work is spent on padding rows; long queries use
# 32 rows per warp so each staged document fragment feeds two mma.
_TABLE: dict[tuple[bool, int, int], tuple[tuple[int, int, int, int], ...]] = {}
for _wide in (False, True):
    for _db in (64, 128, 256, 512):
        for _lb in (32, 64, 128):
            if not _wide:  # fp16 / bf16
                if _db <= 128:  # 32 rows: four stages 4-5% ahead of three (sweep_tiles_nvidia-h200.json)
                    pref = {32: ((2, 1, 64, 4), (2, 1, 64, 3), (2, 1, 32, 3)), 64: ((4, 1, 64, 3), (4, 1, 32, 3))}.get(
                        _lb, ((4, 2, 64, 3), (4, 2, 32, 3), (4, 2, 32, 2))
                    )
                elif _db <= 256:
                    pref = ((2, 1, 64, 3), (2, 1, 32, 2)) if _lb == 32 else ((8, 1, 64, 3), (8, 1, 64, 2), (4, 1, 32, 3), (4, 1, 32, 2))
                else:
                    pref = ((2, 1, 64, 2), (2, 1, 32, 2)) if _lb == 32 else ((4, 1, 64, 2), (4, 1, 32, 2), (2, 1, 32, 2))
            else:  # fp32 on tf32
                if _db <= 128:
                    pref = ((2, 1, 64, 3), (2, 1, 32, 2)) if _lb == 32 else ((4, 1, 64, 3), (4, 1, 32, 2))
                else:
                    pref = ((2, 1, 32, 2), (2, 1, 16, 2), (1, 1, 16, 2)) if _lb == 32 else (
                        (4, 1, 32, 2), (2, 1, 32, 2), (2, 1, 16, 2), (1, 1, 16, 2))
            _TABLE[(_wide, _db, _lb)] = pref


def _qreg(elem: int, dp: int, mt: int) -> bool:
    # Query fragments cost mt * dp / (k per mma) * 4 registers; keep them at or under 64 (32 for
    # int8, whose scale handling needs the rest: 64 spilled with the argmax, compile.check_all).
    per_k = {2: 8, 3: 32}.get(elem, 16)
    return mt * (dp // per_k) * 4 <= (32 if elem == 3 else 64)


def arch_of(cc: int) -> int:
    """Map a device's compute capability (e.g. 90) to the table's architecture."""
    if cc < 80:
        raise RuntimeError(f"compute capability {cc / 10:.1f} is not supported: lik-cupy needs 8.0 or newer (or backend='cpu')")
    if cc in _SMEM_PER_BLOCK or cc >= 100:
        return cc  # newer GPUs get machine code built for their own architecture
    return 90 if cc >= 90 else 80


# Hopper warpgroup-MMA tiles; 8 warps = 2 warpgroups x 64 query rows. Relative
# cost per staged document token of each tile width, so that a shorter tile wins
# where it pads documents less (Ld=180: 192 tokens in 64- or 96-token tiles
# against 256).
# - One query per tile, from bench/results/sweep_tiles_nvidia-h200.json:
#   128-token tiles run 12-17% faster per token than 64-token ones.
# - Several short queries per tile, from bench/results/sweep_bn_multiquery_nvidia-h200.json
#   (32 queries of 32 tokens, Ld 128..512): 96-token tiles about 10% faster per
#   token than 64, and 128 (one CTA per SM at three stages) 17-30% slower.
# 128-token tiles: two stages (two CTAs per SM, one's epilogue hiding under the other's
# MMA) beat three at Lq = 128, 512 and 1024 (7-10%, sweep_tiles_nvidia-h200.json).
_WGMMA_BN_COST = {128: 1.0, 64: 1.12}
_WGMMA_BN_COST_MULTI = {96: 0.9, 64: 1.0, 128: 1.25}


def _wgmma_tiles(lq: int, ld: int, multi: bool) -> list[tuple[int, int]]:
    """(bn, stages) candidates for the Hopper kernel, best first."""
    cost = _WGMMA_BN_COST_MULTI if multi else _WGMMA_BN_COST
    order = sorted(cost, key=lambda bn: -(-max(ld, 1) // bn) * bn * cost[bn])
    stages = {128: (2, 3), 96: (3, 2), 64: (3, 2)}
    return [(bn, st) for bn in order for st in stages[bn]]


# One warpgroup (4 warps, 64 query rows) for queries of at most 64 rows, from
# bench/results/sweep_short_nvidia-h200.json: a single query streams D at 4.1-4.5 TB/s on these
# tiles against 3.7-4.1 on the portable mma.sync tiles (8-15% less time at Lq = 32 and 64,
# Ld = 180..1024, padded and packed, INT8 too); two warpgroups (half their rows padding) and
# TMA staging were slower. Relative cost per staged document token: 64- and 128-token tiles
# are within 2% of each other on long documents, so the shorter one wins where it pads less;
# INT8's 64-token tiles ran 22% slower (Ld = 1024). Measured at d = 128 (256-byte rows), the
# widest rows this rule takes.
_SHORT_WGMMA_COST = {False: {64: 1.0, 128: 0.98}, True: {128: 1.0, 64: 1.22}}
_SHORT_WGMMA_STAGES = {64: (4, 3), 128: (2, 3)}
_SHORT_WGMMA_MAX_ROW_BYTES = 256


def _short_wgmma_tiles(ld: int, int8: bool) -> list[tuple[int, int]]:
    """(bn, stages) candidates for the one-warpgroup Hopper tile, best first."""
    cost = _SHORT_WGMMA_COST[int8]
    order = sorted(cost, key=lambda bn: -(-max(ld, 1) // bn) * bn * cost[bn])
    return [(bn, st) for bn in order for st in _SHORT_WGMMA_STAGES[bn]]


def _wgmma_tma(int8: bool, argmax: bool, multi: bool, q_len: int) -> bool:
    """Whether a Hopper tile stages documents by TMA (when the caller can). From
    bench/results/sweep_tma_nvidia-h100-80gb-hbm3.json and the H200 forward runs before and
    after: TMA is 11-17% faster at Lq=512 and 1024 (argmax too), on multi-query tiles and on
    INT8, but 1-5% slower on a single query of at most 128 tokens (Lq=128, Ld=1024, B=1000:
    0.0717 against 0.0681 ms on an H200), which streams D near the HBM rate either way.
    INT8's argmax with TMA spills at two CTAs per SM (compile.check_all)."""
    return not (int8 and argmax) and (multi or q_len > 128)


# INT8 tiles with document tokens on the wgmma M side (LIK_TOKM in cuda_src/maxsim_fwd.cu), from
# bench/results/sweep_int8_tokm_nvidia-h100-80gb-hbm3.json: per-token scales in registers and one
# fused multiply-add per similarity make Lq >= 100 against documents of 512+ tokens 2-11% faster
# than the best standard tile (ColPali 1024 x 1024: 8%), two to five stages within 3%; the
# cross-warp max each document costs makes them level at Ld = 300 and 13% slower at 180. They
# need the dot products below 2^22 (dim <= 224) and TMA's 128-byte rows, so d = 128.
_TOKM_MIN_LD = 512
_TOKM_STAGES = 4


def _tokm(int8: bool, argmax: bool, multi: bool, tma: bool, dim: int, ld: int) -> bool:
    """Whether an INT8 Hopper problem takes the tokens-on-M tiles."""
    return int8 and not argmax and not multi and tma and dim % 128 == 0 and dim * 128 * 128 < 1 << 22 \
        and ld >= _TOKM_MIN_LD


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


@functools.lru_cache(maxsize=4096)
def choose_forward(cc: int, dtype: str, dim: int, lq: int, argmax: bool, vec: bool, wgmma: bool = True,
                   shared_queries: int = 1, ld: int = 1024, packed: bool = False, tma: bool = False) -> FwdConfig:
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
    """
    arch = arch_of(cc)
    elem = ELEM_CODES[dtype]
    int8 = elem == 3
    if int8 and not int8_dim_ok(dim):
        raise ValueError(f"int8 scoring needs dim a multiple of 16 up to {MAX_DIM_INT8}, got {dim}")
    dp = padded_dim(dim, elem)
    dim_bucket(dim)  # range check
    q_len, lq = lq, tile_rows(lq, shared_queries)

    def multi(bm: int) -> bool:
        # Whole queries share the tile. The multi-query reduction costs a little on every
        # document, so single-query tiles keep the leaner one (6-9% on ColPali shapes).
        return shared_queries > 1 and 2 * q_len <= bm

    wgmma_ok = wgmma and arch == 90 and elem != 2 and vec  # Hopper tensor-core tiles can run
    hopper = wgmma_ok and lq > 64
    row_bytes = dim * ELEM_SIZES[elem]
    short_hopper = wgmma_ok and lq <= 64 and row_bytes % 128 == 0 and row_bytes <= _SHORT_WGMMA_MAX_ROW_BYTES
    limit = _SMEM_PER_BLOCK.get(arch, 99 * 1024)  # unknown (newer) GPUs: the smallest limit
    lb = 32 if lq <= 32 else 64 if lq <= 64 else 128
    # INT8 runs one-shot only; its rows have the bytes (and fragment registers) of 16-bit rows half as wide.
    if int8 or not uses_split(*split_family(arch, hopper, dim), lq <= 64, dim):
        if short_hopper:
            for bn, stages in _short_wgmma_tiles(ld, int8):
                cfg = FwdConfig(elem, dim, 4, 1, bn, stages, False, argmax, vec, True, multi(64), packed,
                                tma=tma and _wgmma_tma(int8, argmax, multi(64), q_len))
                if cfg.smem_bytes <= limit:
                    return cfg
        if hopper and row_bytes % 128 == 0:
            if _tokm(int8, argmax, multi(128), tma, dim, ld):
                cfg = FwdConfig(elem, dim, 8, 1, 128, _TOKM_STAGES, False, False, vec, True, False, packed, tma=True,
                                tokm=True)
                if cfg.smem_bytes <= limit:
                    return cfg
            for bn, stages in _wgmma_tiles(lq, ld, multi(128)):
                cfg = FwdConfig(elem, dim, 8, 1, bn, stages, False, argmax, vec, True, multi(128), packed,
                                tma=tma and _wgmma_tma(int8, argmax, multi(128), q_len))
                # int8's argmax of several queries does not fit the 128 registers of two CTAs per SM.
                if cfg.smem_bytes <= limit and not (int8 and argmax and cfg.multi and cfg.min_blocks > 1):
                    return cfg
        # TMA needs whole 128-byte rows (no padding lanes) and swizzled tiles (not the fp32 lds path).
        tma_mma = tma and vec and arch == 90 and elem != 2 and dim == dp and row_bytes % 128 == 0
        for warps, mt, bn, stages in _TABLE[(elem == 2, _dim_bucket(dp // 2 if int8 else dp), lb)]:
            cfg = FwdConfig(elem, dp, warps, mt, bn, stages, _qreg(elem, dp, mt), argmax, vec, False,
                            multi(warps * mt * 16), packed, tma=tma_mma)
            if cfg.smem_bytes <= limit:
                return cfg
    if int8:
        raise ValueError(f"no int8 forward configuration fits dim {dim} on sm_{arch}")
    if wgmma_ok:
        # Hopper split-d: two warpgroups staged by TMA when the caller can hand over tensor maps,
        # one warpgroup by cp.async for a short query.
        warps = 8 if hopper else 4
        qhalf = not hopper and q_len <= 32 and not multi(64)
        if hopper and tma:
            tiles = _WGMMA_SPLIT_TMA
        elif hopper:
            tiles = _WGMMA_SPLIT_WIDE if dim_bucket(dim) >= _WGMMA_SPLIT_WIDE_FROM else _WGMMA_SPLIT_NARROW
        else:
            tiles = _WGMMA_SPLIT_SHORT_QHALF if qhalf else _WGMMA_SPLIT_SHORT
        for bn, bk, stages in tiles:
            cfg = FwdConfig(elem, bk, warps, 1, bn, stages, False, argmax, vec, True, multi(warps * 16), packed,
                            True, tma and hopper, qhalf)
            # Two CTAs of two warpgroups cap registers at 128: too few for the argmax of several queries.
            if cfg.smem_bytes <= limit and not (warps == 8 and cfg.min_blocks > 1 and argmax and cfg.multi):
                return cfg
    for warps, mt, bn, bk, stages in _SPLIT_TABLE[(elem == 2, lb)]:
        cfg = FwdConfig(elem, bk, warps, mt, bn, stages, False, argmax, vec, False, multi(warps * mt * 16), packed,
                        True)
        # 32 x 128 accumulators per warp leave no room for the argmax or multi-query epilogue
        # without spilling (compile.check_all): those take the 64-token tiles.
        if cfg.smem_bytes <= limit and not (bn > 64 and mt > 1 and (argmax or cfg.multi)):
            return cfg
    raise ValueError(f"no forward configuration fits dim {dim} on sm_{arch}")


def ctas_per_sm(cfg: FwdConfig, cc: int, registers: int | None = None) -> int:
    """CTAs of ``cfg`` resident per SM. ``registers``: a compiled kernel's count per thread (the
    compile check passes ptxas's); by default the ceilings the kernels are built to stay under."""
    arch = arch_of(cc)
    by_smem = _SMEM_PER_SM.get(arch, 100 * 1024) // (cfg.smem_bytes + 1024)
    by_threads = 2048 // cfg.threads
    # Per-thread register ceilings of the compiled kernels (compile.check_all checks them): two
    # warpgroups are capped at 128 by their launch bounds; one warpgroup is not capped, and its
    # argmax or multi-query epilogue takes up to 168 (INT8's argmax up to 192).
    if registers is not None:
        regs = -(-registers // 8) * 8  # allocated per warp in units of 8 registers a thread
    elif cfg.wgmma and cfg.warps == 4 and (cfg.argmax or cfg.multi):
        regs = 192 if cfg.argmax and cfg.elem == 3 else 168
    else:
        regs = 128 if cfg.wgmma else 192
    by_regs = 65536 // (cfg.threads * regs)
    return max(1, min(by_smem, by_threads, max(1, by_regs)))


# Documents one CTA streams (about, at most): a longer run fills and drains its ring less often, a
# shorter one leaves a smaller last wave. From bench/results/sweep_docs_per_cta_nvidia-h100-80gb-hbm3.json:
# 128 makes 32 queries of 32 tokens against 20,000-100,000 documents of 180 tokens 1-2% faster than
# 32 (top-100 retrieval too), 8 and 16 are 2-5% slower, and single-query, ColPali and ragged shapes
# do not change. One wave (a run of every document a CTA will ever see) gained another 0.5%, but
# leaves the grid no slack when fewer CTAs are resident than planned (another kernel beside it).
_DOCS_PER_CTA = 128


# Token split (packed documents, single-query tiles, at most a quarter of a wave of query tiles,
# and at most a quarter as many documents as the CTAs a query tile may have): the grid's y side
# cuts the corpus into equal token shares, one wave in all, each share at least this many document
# tiles. Whole-document CTAs leave most of the wave idle when documents are that few: one query
# against 62 documents of 4,096 tokens took 33.5 us that way and 24.5 us split (flash-maxsim:
# 36.9). Merging the pieces of split documents costs about 5 us at the end of the kernel, so
# corpora of more documents keep whole-document CTAs: 128 of 2,000 tokens 23.7 us whole against
# 24.5 split, 1,000 of 16..512 tokens 26.7 against 28.8 (H200,
# bench/results/sweep_token_split_nvidia-h200.json; on an H100, _h100-80gb-hbm3.json: 62 of
# 4,096 36.0 whole, 30.7 split, flash-maxsim 38.7; 128 of 2,000 28.6 whole, 31.0 split).
_SPLIT_MIN_TILES = 4
SPLIT_MAX_CTAS = 4096  # CTAs of one token-split launch at most (the arrival counts it may use)


@dataclass(frozen=True)
class Launch:
    n_qt: int  # query tiles per query
    qb: int  # whole queries per tile (n_qt is 1 when qb > 1)
    docs_per_cta: int
    grid: tuple[int, int, int]
    token_split: bool = False  # packed documents cut into grid[1] token shares (maxsim_fwd.cu, piece_role)


@functools.lru_cache(maxsize=4096)
def plan_launch(cfg: FwdConfig, cc: int, num_sms: int, nq: int, nd: int, lq: int, shared_queries: int = 1,
                ntok: int = 0) -> Launch:
    """Grid shape: query tiles on x (neighbours share document tiles in L2), document runs on y.

    The number of CTAs is a whole number of waves of resident CTAs, and each
    CTA streams a run of documents through one pipeline (its ring crosses
    document boundaries), so short documents cost no pipeline restarts and the
    last wave is not left half empty. ``ntok``: the token count of packed documents, which
    single-query tiles may split by token ranges instead (see ``_SPLIT_MIN_TILES``).
    """
    qb = queries_per_tile(cfg, lq, shared_queries)
    n_qt = 1 if qb > 1 else max(1, -(-lq // cfg.bm))
    rows = -(-nq // qb) * n_qt
    resident = num_sms * ctas_per_sm(cfg, cc)
    if ntok > 0 and cfg.token_split and rows * 4 <= resident and nd * 4 <= resident // rows:
        shares = min(min(resident, SPLIT_MAX_CTAS) // rows, -(-ntok // (_SPLIT_MIN_TILES * cfg.bn)))
        if shares > 1:
            return Launch(n_qt, qb, 0, (rows, shares, 1), True)
    units = rows * nd
    if units <= resident:
        per = 1
    else:
        waves = -(-units // (resident * _DOCS_PER_CTA))
        chunks = max(1, resident * waves // rows)
        per = -(-nd // chunks)
    per = max(per, -(-nd // 65535))  # grid.y limit
    return Launch(n_qt, qb, per, (rows, -(-nd // per), 1))


def all_forward_configs(arch: int, dims=None) -> list[FwdConfig]:
    """Every configuration ``choose_forward`` can return on ``arch`` for the embedding ``dims``.

    The default samples a few dims that between them reach every tile family, query / document
    length rule and flag (the CI compile check builds these); a padded dim of its own names a
    kernel of its own, so ``dims=range(16, 513, 16)`` plus the split-d widths is the whole set
    (the opt-in all-dims check in ``tests/test_compile.py``). INT8 keeps the dims it accepts.
    """
    seen: dict[str, FwdConfig] = {}
    for dtype in ELEM_CODES:
        if dims is not None:
            picked = [d for d in dims if dtype != "int8" or int8_dim_ok(d)]
        else:
            picked = (64, 96, 128, 256, 384, 512) if dtype == "int8" else (64, 128, 256, 384, 512, 1000, 2048, 4096)
        for dim in picked:
            for lq, shared in ((32, 1), (64, 1), (128, 1), (1024, 1), (8, 2), (32, 2), (32, 4), (64, 2)):
                for ld in (128, 180, 300, 1024):
                    for argmax in (False, True):
                        for vec in (True, False):
                            for wg in (True, False):
                                for packed in (False, True):
                                    for tma in (False, True):
                                        c = choose_forward(arch, dtype, dim, lq, argmax, vec, wg, shared, ld, packed,
                                                           tma)
                                        seen[c.name] = c
    return list(seen.values())


def choose_backward(method: str, cc: int, nq: int, nd: int, lq: int, rows: int, dim: int) -> str:
    """"atomic" or "csr" for ``maxsim_backward``'s dD (an explicit method is kept as asked).

    The fused atomic pass reads the argmax once and needs one fp32 [rows, dim] buffer; CSR
    adds a key build, a sort of Nq * Nd * Lq keys and a second pass, so "auto" takes the
    atomic path (measured faster at every shape of bench/results/backward_nvidia-h200.json).
    """
    if method != "auto":
        return method
    return "atomic"
