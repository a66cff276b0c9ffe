"""Kernel configuration: what one compiled forward variant is, and the per-architecture facts
(shared memory, supported dims) that bound which variants can run."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from . import tables
from .elements import ELEMS, ElemSpec, elem_of_code

__all__ = ["SUPPORTED_ARCHS", "SMEM_PER_BLOCK", "SMEM_PER_SM", "MAX_DIM", "MAX_DIM_RESIDUAL", "RESIDUAL_REGISTERS",
           "RESIDUAL_REGISTERS_MULTI", "DIM_BUCKETS", "FwdConfig", "padded_dim", "dim_bucket", "one_shot_bucket", "arch_of"]

# Architectures we build machine code for (compute capability * 10).
SUPPORTED_ARCHS = (80, 86, 89, 90)

# Largest dynamic shared memory one block may opt into, per architecture.
SMEM_PER_BLOCK = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}
SMEM_PER_SM = {80: 164 * 1024, 86: 100 * 1024, 87: 164 * 1024, 89: 100 * 1024, 90: 228 * 1024}

MAX_DIM = max(e.max_dim for e in ELEMS)  # split-d has no inherent limit; this is the widest dim the tests cover
# PLAID residual documents (cuda_src/fwd/residual.cuh): one-shot mma.sync tiles of whole 8-dim
# centroid chunks, so a dim that is a multiple of 8 up to this; registers a thread at most, so
# that several CTAs share an SM (their loads wait behind the others' decompression): 128, and 168
# for tiles of several queries (their row-max reduction spilled a few bytes at 128 on sm_90).
MAX_DIM_RESIDUAL = 512
RESIDUAL_REGISTERS = 128
RESIDUAL_REGISTERS_MULTI = 168


@dataclass(frozen=True, kw_only=True)
class FwdConfig:
    """One compiled variant of ``cuda_src/maxsim_fwd.cu``."""

    elem: int  # LIK_ELEM: the code of its element type's row (``spec``, lik_cupy/_dispatch/elements.py)
    dp: int  # padded dim (a multiple of spec.dim_step); split-d: the dim chunk staged per pipeline stage
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
    tokm: bool = False  # Hopper tiles with document tokens on the wgmma M side: INT8 (per-token scales in registers), refined float32
    x3: bool = False  # fp32 at float32 accuracy: three tf32 products per product (3xTF32, cuda_src/fwd/config.cuh)
    refine: bool = False  # fp32 at float32 accuracy on TF32 wgmma: near-max similarities recomputed exactly (fwd/refine.cuh)
    residual: int = 0  # PLAID residual documents: nbits (1, 2 or 4) per dim, decompressed by the tile loader
    cand: bool = False  # each query scores the documents a candidate id array names (in place; one query a tile)
    strided: bool = False  # padded documents on the packed token-split path (LIK_STRIDED; packed is set too)

    @property
    def spec(self) -> ElemSpec:
        """The element type's row."""
        return elem_of_code(self.elem)

    def __post_init__(self):
        if self.strided and not self.token_split:
            raise ValueError(f"strided (padded token-split) tiles need a token-split tile, not {self}")

    @functools.cached_property
    def queries_on_m(self) -> FwdConfig:
        """The tile that splits documents over CTAs in place of a tokens-on-M INT8 tile: the same
        one with query rows on the wgmma M side, as dispatch takes it below ``TOKM_MIN_LD`` (the
        first stage count of ``WGMMA_STAGES`` for its tokens; tokens-on-M tiles never split, their
        cross-warp maxima are per document); a refined float32 one's, the first stage count of
        ``SHORT_WGMMA_STAGES_TF32``. Other tiles: themselves."""
        if not self.tokm:
            return self
        stages = tables.SHORT_WGMMA_STAGES_TF32 if self.refine else tables.WGMMA_STAGES
        return replace(self, tokm=False, stages=stages[self.bn][0])

    @functools.cached_property  # read on every padded launch
    def strided_tile(self) -> FwdConfig | None:
        """This padded configuration's tile on the token-split path for padded documents
        (``strided``; a tokens-on-M tile's is its ``queries_on_m`` tile's), or None where the
        tile cannot split documents."""
        if self.packed or self.cand:
            return None
        v = replace(self.queries_on_m, packed=True)
        return replace(v, strided=True) if v.token_split else None

    @property
    def int8_argmax_strided(self) -> bool:
        """INT8's two-warpgroup argmax tile on the padded token split: compiled for one CTA an SM,
        whose strided reads took 16 B of spills at two (193 registers at one; compile check). A
        split fills the GPU with one an SM anyway."""
        return self.strided and self.spec.scaled and self.argmax and self.wgmma and self.warps == 8

    @property
    def token_split(self) -> bool:
        """Whether the kernel can split packed documents over CTAs by token shares (cuda_src/fwd/config.cuh's
        TSPLIT: single-query one-shot tiles of element types with ``token_split``, and wgmma tiles of any)."""
        return self.packed and not (self.multi or self.tokm or self.split or self.residual or self.cand) \
            and (self.spec.token_split or self.wgmma)

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
        return self.spec.bytes

    @functools.cached_property  # read on every launch
    def smem_bytes(self) -> int:
        rows = self.stages * (self.query_rows_staged + self.bn) if self.split else self.bm + self.stages * self.bn
        if self.wgmma or self.tma:  # unpadded swizzled tiles, slack to align them to 1024 bytes, TMA barriers
            # (refined TF32 tiles: their per-slot norm parts follow the barriers' place)
            refine = (0 if self.tma else 16 * self.stages) + 4 * self.stages * self.warps if self.refine and not self.tokm else 0
            return rows * self.dp * self.esize + 1024 + self._extra_bytes + (16 * self.stages if self.tma else 0) + refine
        used = rows * (self.dp + 16 // self.esize) * self.esize + self._extra_bytes
        if not self.residual:
            return used
        # From the next 16-byte boundary, as cuda_src/fwd/mainloop.cuh carves it: the bucket table, the
        # codes of two tiles and each slot's byte shift, then each slot's residual bytes (RBYTES).
        pad16 = lambda n: -(-n // 16) * 16  # noqa: E731
        return pad16(used) + 128 + pad16(4 * (2 * self.bn + self.stages)) + \
            self.stages * (self.bn * self.dp * self.residual // 8 + 32)

    @property
    def _extra_bytes(self) -> int:
        # double-buffered row maxima (every warp's with tokm, the tile's with multi) or per-warp
        # sums; tokm: INT8 query multipliers or refined column weights (QMUL); scaled elements: each
        # stage's token scales
        scales = self.stages * (self.bn + (32 if self.tma else 0)) * 4 if self.spec.scaled else 0  # as SCL in the kernel
        red = self.warps * self.bm if self.tokm else self.bm if self.multi else self.warps  # as RED in the kernel
        qmul = (2 * self.bm + self.warps * 32 if self.refine else self.bm) if self.tokm else 0  # as QMUL
        return 2 * red * 4 + qmul * 4 + scales

    @functools.cached_property  # read on every launch
    def name(self) -> str:
        return (
            f"lik_maxsim_fwd_{self.spec.tag}_{'k' if self.split else 'd'}{self.dp}_w{self.warps}m{self.mt}_n{self.bn}s{self.stages}"
            f"{'_qreg' if self.qreg else ''}{'_argmax' if self.argmax else ''}{'_vec' if self.vec else ''}"
            f"{'_wgmma' if self.wgmma else ''}{'_mq' if self.multi else ''}{'_packed' if self.packed else ''}"
            f"{'_tma' if self.tma else ''}{'_qh' if self.qhalf else ''}{'_tokm' if self.tokm else ''}"
            f"{'_x3' if self.x3 else ''}{'_rf' if self.refine else ''}{'_strided' if self.strided else ''}"
            f"{f'_r{self.residual}' if self.residual else ''}{'_cand' if self.cand else ''}"
        )

    def defines(self) -> dict[str, int | str]:
        residual = {"LIK_RESIDUAL": self.residual} if self.residual else {}
        cand = {"LIK_CAND": 1} if self.cand else {}
        refine = {"LIK_REFINE": 1} if self.refine else {}
        return residual | cand | refine | {
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
            "LIK_X3": int(self.x3),
            "LIK_STRIDED": int(self.strided),
            "LIK_MIN_BLOCKS": self.min_blocks,
            "LIK_DOC_COST": self.doc_cost,
        }

    @property
    def doc_cost(self) -> int:
        """Packed documents: tokens of work each document counts for beside its own when the CTAs
        share the corpus out (cuda_src/fwd/tile_scheduler.cuh, shares), for its last tile's padding and its score.
        From tests/data/sweep_doc_cost_nvidia-h100-80gb-hbm3.json (one and 32 queries of 32
        tokens), 1.5 tiles against tokens alone: 500 documents of 16 tokens then 500 of 512 in
        29.95 us against 69.07 (flash-maxsim 31.95), 32 queries 169.9 against 863.9; 4,000 of 16
        and 250 of 1,024 shuffled 43.5 against 103.9 (flash-maxsim 49.0); within 2.8% of the best
        variant on the ragged corpus and on 20,000 passages in three runs (_run2.json, _run3.json);
        with 30% of the documents empty, 3.0-3.4% behind tokens alone for one query, level for 32."""
        return self.bn * 3 // 2 if self.packed else 0

    @property
    def wide_registers(self) -> bool:
        """Hopper tiles that spilled in the 128 registers of two CTAs per SM (compile check) and so
        are built for one: refined float32 tiles of two warpgroups (up to 200 bytes at d = 32 and
        64, where two CTAs fit the shared memory; packed documents 44-70 at d = 64, candidate ids 8,
        the argmax of several queries 4-12), and FP8's two-warpgroup argmax tiles of several queries,
        packed documents (150 bytes at d = 128 and 256) or split-d (INT8's take mma.sync tiles there,
        select.py; sm_90 emulates FP8's). One-warpgroup tiles have 256 registers at two CTAs: refined
        ones take at most 176 of them and FP8's argmax ones at most 188 (every one of them, compile
        check), so they are built for two (FP8's one-warpgroup packed argmax at one CTA an SM, four
        warps, took 0.264 ms for a 32-token query against 10,000 documents of 180, padded 0.134:
        bench/results/archive/fp8_short_tma_nvidia-h200/)."""
        if not self.wgmma or self.warps != 8:
            return False
        if self.refine:
            return True
        return self.argmax and self.spec.scaled and 90 in self.spec.emulated_mma and (
            self.multi or self.packed or self.split)

    @functools.cached_property  # read on every launch
    def min_blocks(self) -> int:
        """CTAs per SM the kernel is compiled for: two Hopper CTAs when their shared memory fits
        (registers then capped at 128) and their accumulators do too (at most 128 tokens per
        tile), else no register cap."""
        if self.residual:  # as many CTAs as their register budget allows: their decompression hides loads
            return max(1, 65536 // (self.threads * (RESIDUAL_REGISTERS_MULTI if self.multi else RESIDUAL_REGISTERS)))
        if self.int8_argmax_strided or self.wide_registers:
            return 1
        return 2 if (self.wgmma and self.bn <= 128
                     and 2 * (self.smem_bytes + 1024) <= SMEM_PER_SM[90]) else 1

    def target(self, arch: int) -> str:
        """NVRTC architecture suffix: wgmma and TMA kernels are built for sm_90a (the TMA and
        mbarrier helpers sit beside the wgmma ones)."""
        return "90a" if self.wgmma or self.tma else str(arch)


def padded_dim(dim: int, spec: ElemSpec = ELEMS[0]) -> int:
    """The kernel's dim: a multiple of the element type's ``dim_step`` (32 bytes of K per mma)."""
    step = spec.dim_step
    return max(step, -(-dim // step) * step)


def one_shot_bucket(dp: int) -> int:
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


def arch_of(cc: int) -> int:
    """Map a device's compute capability (e.g. 90) to the table's architecture."""
    if cc < 80:
        raise RuntimeError(f"compute capability {cc / 10:.1f} is not supported: lik-cupy needs 8.0 or newer (or backend='cpu')")
    if cc in SMEM_PER_BLOCK or cc >= 100:
        return cc  # newer GPUs get machine code built for their own architecture
    return 90 if cc >= 90 else 80
