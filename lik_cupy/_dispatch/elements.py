"""The element types the forward kernels score: one row each, the host side of the kernels'
per-element traits (``LIK_ELEM`` selects them in ``cuda_src/fwd/config.cuh``).

Every host rule that depends on the element type reads a field of its row here, so a new element
type is a new row (with its traits, its quantiser and its measured tile rows: docs/extending.md).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ElemSpec", "ELEMS", "elem_spec", "elem_of_code", "scaled_dtype", "kernel_dtype", "SCALED_DTYPES"]


@dataclass(frozen=True, kw_only=True)
class ElemSpec:
    """One element type of the forward kernels."""

    name: str  # the dtype's name as a Problem (and NumPy, but for bfloat16) spells it
    code: int  # LIK_ELEM, and FwdConfig.elem
    tag: str  # in kernel names: lik_maxsim_fwd_<tag>_...
    bytes: int  # per element, in memory and in the shared-memory tiles
    numpy_dtype: str  # the NumPy dtype the kernels read it as (bfloat16 as its bits)
    scaled: bool  # one float32 scale per token beside Q and D, staged with each tile (SCL in the kernel)
    integer: bool  # integer accumulators (Elem<>::kInt): exact dot products, and the tokens-on-M tiles' offset trick
    k: int  # elements of K one mma.sync takes: 32 bytes of K, 8 elements for tf32
    dim_step: int  # the kernel's dim (FwdConfig.dp) is a multiple of this (32 bytes of K a mma)
    dim_multiple: int  # the GPU kernels take dims a multiple of this (1: any dim, padded)
    max_dim: int  # the widest dim the GPU kernels take
    min_arch: int  # the oldest architecture (compute capability * 10) with its tensor-core instructions
    tf32: bool  # float32 on tf32 tensor cores: its own MMA_TABLE / SPLIT_TABLE rows, unswizzled mma.sync
    #             tiles read by lds (so no TMA on them), float32 accuracy by 3xTF32 there (FwdConfig.x3)
    #             and by refined TF32 wgmma tiles on Hopper (FwdConfig.refine)
    wgmma: bool  # Hopper warpgroup tiles exist for it (one-shot and split-d)
    token_split: bool  # packed documents may be split over CTAs by token shares (TSPLIT in the kernel; wgmma tiles always may)
    one_shot_max: int  # dims up to this run one-shot and wider ones split-d; 0: tables.SPLIT_FROM decides
    corpus: bool  # retrieve, Corpus and the shards take it (not FP8 yet: its scoring functions only)
    # Architectures whose mma.sync for it ptxas emulates, where only its wgmma tiles run: FP8 on sm_90
    # (a tile of 128 registers on sm_89 takes 255 and spills there; compile check).
    emulated_mma: tuple[int, ...]
    quantiser: str | None  # the NumPy quantiser of float tokens to it (lik_cupy._cpu), for scaled types
    quantiser_kernel: str | None  # its device quantiser's entry in cuda_src/quantize.cu (one build per float LIK_ELEM)
    dequantiser: str | None  # the public function that dequantises it (lik_cupy)
    public_quantiser: str | None  # the public function that quantises floats to it (lik_cupy)

    @property
    def per_16bit(self) -> int:
        """Elements in the bytes of one 16-bit element: the tables' dims and split-d chunks count
        16-bit elements, so a one-byte type takes twice as many (float32 has rows of its own)."""
        return max(1, 2 // self.bytes)

    @property
    def accepted(self) -> str:
        """The dtypes the scaled functions take for it, in words (errors): FP8 natively (torch, ml_dtypes,
        JAX) or as its bit patterns (CuPy has no float8 type)."""
        if self.numpy_dtype == self.name:
            return self.name
        return f"{self.name} (or {self.numpy_dtype} holding its bit patterns)"

    def dim_ok(self, dim: int) -> bool:
        """Whether the GPU kernels take embedding dim ``dim`` (positive: validation refuses 0 before)."""
        return dim <= self.max_dim and dim % self.dim_multiple == 0

    def dim_ok_on(self, arch: int, dim: int) -> bool:
        """``dim_ok`` on architecture ``arch``: where mma.sync is emulated (``emulated_mma``: FP8 on
        sm_90) the one-shot dims are the wgmma tiles' only, whole 128-byte rows (select.py's
        ``_mma_native``); split-d, above ``one_shot_max``, takes every dim."""
        if arch in self.emulated_mma and dim <= self.one_shot_max and dim * self.bytes % 128:
            return False
        return self.dim_ok(dim)

    def dim_rule(self) -> str:
        """The dims the GPU kernels take, in words, for errors."""
        if self.dim_multiple == 1:
            return f"up to {self.max_dim}"
        return f"a multiple of {self.dim_multiple} up to {self.max_dim}"


_FLOAT = dict(scaled=False, integer=False, dim_step=16, dim_multiple=1, max_dim=8192, min_arch=80, one_shot_max=0,
              quantiser=None, quantiser_kernel=None, dequantiser=None, public_quantiser=None, corpus=True, emulated_mma=())

ELEMS: tuple[ElemSpec, ...] = (
    ElemSpec(name="float16", code=0, tag="f16", bytes=2, numpy_dtype="float16", k=16, tf32=False, wgmma=True,
             token_split=True, **_FLOAT),
    ElemSpec(name="bfloat16", code=1, tag="bf16", bytes=2, numpy_dtype="uint16", k=16, tf32=False, wgmma=True,
             token_split=True, **_FLOAT),
    ElemSpec(name="float32", code=2, tag="f32", bytes=4, numpy_dtype="float32", k=8, tf32=True, wgmma=True,
             token_split=False, **_FLOAT),
    # Dims a multiple of 16 up to 4096: int32 dot products stay exact (127 * 127 * 4096 < 2^31);
    # one-shot up to 512 (its rows have the bytes, and fragment registers, of 16-bit rows half as
    # wide), split-d above.
    ElemSpec(name="int8", code=3, tag="i8", bytes=1, numpy_dtype="int8", scaled=True, integer=True, k=32, dim_step=32,
             dim_multiple=16, max_dim=4096, min_arch=80, tf32=False, wgmma=True, token_split=True, one_shot_max=512,
             corpus=True, emulated_mma=(), quantiser="quantize_numpy", quantiser_kernel="lik_quantize_int8", dequantiser="dequantize_int8",
             public_quantiser="quantize_int8"),
    # FP8 e4m3 (OCP's float8_e4m3fn, no infinities) with per-token float32 scales: INT8's tiles and
    # scale handling with float32 accumulators (so no dim limit from exactness); the kernels read it
    # as its bit patterns. Tensor-core e4m3 starts at sm_89 (mma.sync) and sm_90a (wgmma). Its tile
    # rows are INT8's (an H200 sweep found them within 1% of FP8's best: tests/data/sweep_fp8_nvidia-h200.json).
    ElemSpec(name="float8_e4m3fn", code=4, tag="e4m3", bytes=1, numpy_dtype="uint8", scaled=True, integer=False, k=32,
             dim_step=32, dim_multiple=16, max_dim=8192, min_arch=89, tf32=False, wgmma=True, token_split=True,
             one_shot_max=512, corpus=False, emulated_mma=(90,), quantiser="quantize_fp8_numpy", quantiser_kernel="lik_quantize_fp8",
             dequantiser="dequantize_fp8", public_quantiser="quantize_fp8"),
)

_BY_NAME = {e.name: e for e in ELEMS}
_BY_CODE = {e.code: e for e in ELEMS}
SCALED_DTYPES = tuple(e.name for e in ELEMS if e.scaled)


def elem_spec(dtype: str) -> ElemSpec:
    """The row of element type ``dtype`` ("float16", "bfloat16", "float32", "int8", "float8_e4m3fn")."""
    try:
        return _BY_NAME[dtype]
    except KeyError:
        raise ValueError(f"the GPU kernels take {', '.join(_BY_NAME)} elements, not {dtype}") from None


def elem_of_code(code: int) -> ElemSpec:
    """The row whose ``LIK_ELEM`` is ``code``."""
    return _BY_CODE[code]


def kernel_dtype(dtype: str) -> str:
    """The element type the kernels compute in for inputs of ``dtype``: float64 runs as float32 (at
    float32 accuracy, ``lik_cupy.precision``; its callers get float64 results back)."""
    return "float32" if dtype == "float64" else dtype


def scaled_dtype(dtype: str) -> bool:
    """Whether ``dtype`` (any dtype name: float64 and integer types are no element) is a scaled
    element type, whose tokens carry a float32 scale each."""
    spec = _BY_NAME.get(dtype)
    return spec is not None and spec.scaled
