"""Kernel choice: which compiled forward configuration runs a given problem.

Every rule that maps (architecture, dtype, dim, query length) to tile sizes
lives here, so that tuning is one table to edit and the CPU-side compile
check (``lik_cupy.compile.check_all``) can enumerate exactly what can run.
The preference lists are ordered by measured speed on the GPUs named in
``bench/results``; a candidate is skipped when its shared memory exceeds the
architecture's per-block limit.
"""

from __future__ import annotations

from dataclasses import dataclass

# Architectures we build machine code for (compute capability * 10).
SUPPORTED_ARCHS = (80, 86, 89, 90)

# Largest dynamic shared memory one block may opt into, per architecture.
_SMEM_PER_BLOCK = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}
_SMEM_PER_SM = {80: 164 * 1024, 86: 100 * 1024, 87: 164 * 1024, 89: 100 * 1024, 90: 228 * 1024}

ELEM_CODES = {"float16": 0, "bfloat16": 1, "float32": 2}
MAX_DIM = 512


@dataclass(frozen=True)
class FwdConfig:
    """One compiled variant of ``cuda_src/maxsim_fwd.cu``."""

    elem: int  # 0 fp16, 1 bf16, 2 fp32 (tf32 tensor cores)
    dp: int  # padded dim (multiple of 16)
    warps: int
    mt: int  # 16-row mma tiles per warp
    bn: int  # document tokens per pipeline stage
    stages: int
    qreg: bool  # query fragments in registers
    argmax: bool
    vec: bool  # 16-byte cp.async copies
    wgmma: bool = False  # Hopper warpgroup MMA (sm_90a)

    @property
    def bm(self) -> int:
        return self.warps * self.mt * 16

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def esize(self) -> int:
        return 4 if self.elem == 2 else 2

    @property
    def smem_bytes(self) -> int:
        if self.wgmma:  # unpadded swizzled tiles, plus slack to align them to 1024 bytes
            return (self.bm + self.stages * self.bn) * self.dp * self.esize + 1024 + 2 * self.warps * 4
        lds = self.dp + 16 // self.esize
        return (self.bm + self.stages * self.bn) * lds * self.esize + 2 * self.warps * 4

    @property
    def name(self) -> str:
        e = ("f16", "bf16", "f32")[self.elem]
        return (
            f"lik_maxsim_fwd_{e}_d{self.dp}_w{self.warps}m{self.mt}_n{self.bn}s{self.stages}"
            f"{'_qreg' if self.qreg else ''}{'_argmax' if self.argmax else ''}{'_vec' if self.vec else ''}"
            f"{'_wgmma' if self.wgmma else ''}"
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
        }

    def target(self, arch: int) -> str:
        """NVRTC architecture suffix: wgmma kernels need the sm_90a feature set."""
        return "90a" if self.wgmma else str(arch)


def padded_dim(dim: int) -> int:
    return max(16, -(-dim // 16) * 16)


def _dim_bucket(dp: int) -> int:
    for b in (64, 128, 256, 512):
        if dp <= b:
            return b
    raise ValueError(f"dim {dp} is above the supported maximum of {MAX_DIM}")


# (warps, mt, bn, stages) in order of preference, keyed by
# (16-bit or fp32, dim bucket, query-length bucket). Short queries use short
# row tiles so no tensor-core work is spent on padding rows; long queries use
# 32 rows per warp so each staged document fragment feeds two mma.
_TABLE: dict[tuple[bool, int, int], tuple[tuple[int, int, int, int], ...]] = {}
for _wide in (False, True):
    for _db in (64, 128, 256, 512):
        for _lb in (32, 64, 128):
            if not _wide:  # fp16 / bf16
                if _db <= 128:
                    pref = {32: ((2, 1, 64, 3), (2, 1, 32, 3)), 64: ((4, 1, 64, 3), (4, 1, 32, 3))}.get(
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
    # Query fragments cost mt * dp / (16 or 8) * 4 registers; keep them at or under 64.
    per_k = 8 if elem == 2 else 16
    return mt * (dp // per_k) * 4 <= 64


def arch_of(cc: int) -> int:
    """Map a device's compute capability (e.g. 90) to the table's architecture."""
    if cc < 80:
        raise RuntimeError(f"compute capability {cc / 10:.1f} is not supported: lik-cupy needs 8.0 or newer (or backend='cpu')")
    if cc in _SMEM_PER_BLOCK or cc >= 100:
        return cc  # newer GPUs get machine code built for their own architecture
    return 90 if cc >= 90 else 80


# Hopper warpgroup-MMA tiles: (bn, stages) in order of preference; 8 warps = 2 warpgroups x 64 query rows.
# From bench/results/sweep_tiles_nvidia-h200.json: 128-token document tiles beat 64 everywhere; with
# Lq >= 1024 two stages (two CTAs per SM, one's epilogue hiding under the other's MMA) beat three.
_WGMMA_TABLE = ((128, 3), (128, 2), (64, 3), (64, 2))
_WGMMA_TABLE_LONG_Q = ((128, 2), (64, 3), (64, 2))


def choose_forward(cc: int, dtype: str, dim: int, lq: int, argmax: bool, vec: bool, wgmma: bool = True) -> FwdConfig:
    """The forward configuration for one problem on a device of compute capability ``cc``.

    ``wgmma=False`` keeps to the portable mma.sync kernels (the fallback when
    an sm_90a build fails, and the switch tests use to cover both paths).
    """
    arch = arch_of(cc)
    elem = ELEM_CODES[dtype]
    dp = padded_dim(dim)
    if wgmma and arch == 90 and elem != 2 and vec and dim % 64 == 0 and lq > 64:
        for bn, stages in _WGMMA_TABLE_LONG_Q if lq >= 1024 else _WGMMA_TABLE:
            cfg = FwdConfig(elem, dim, 8, 1, bn, stages, False, argmax, vec, True)
            if cfg.smem_bytes <= _SMEM_PER_BLOCK[arch]:
                return cfg
    lb = 32 if lq <= 32 else 64 if lq <= 64 else 128
    limit = _SMEM_PER_BLOCK.get(arch, 99 * 1024)  # unknown (newer) GPUs: the smallest limit
    for warps, mt, bn, stages in _TABLE[(elem == 2, _dim_bucket(dp), lb)]:
        cfg = FwdConfig(elem, dp, warps, mt, bn, stages, _qreg(elem, dp, mt), argmax, vec)
        if cfg.smem_bytes <= limit:
            return cfg
    raise ValueError(f"no forward configuration fits dim {dim} on sm_{arch}")


def ctas_per_sm(cfg: FwdConfig, cc: int) -> int:
    arch = arch_of(cc)
    by_smem = _SMEM_PER_SM.get(arch, 100 * 1024) // (cfg.smem_bytes + 1024)
    by_threads = 2048 // cfg.threads
    regs = 128 if cfg.wgmma else 192  # per-thread ceilings of the compiled kernels (compile.check_all reports them)
    by_regs = 65536 // (cfg.threads * regs)
    return max(1, min(by_smem, by_threads, max(1, by_regs)))


@dataclass(frozen=True)
class Launch:
    n_qt: int  # query tiles per query
    docs_per_cta: int
    grid: tuple[int, int, int]


def plan_launch(cfg: FwdConfig, cc: int, num_sms: int, nq: int, nd: int, lq: int) -> Launch:
    """Grid shape: query tiles on x (neighbours share document tiles in L2), document runs on y.

    The number of CTAs is a whole number of waves of resident CTAs, and each
    CTA streams a run of documents through one pipeline (its ring crosses
    document boundaries), so short documents cost no pipeline restarts and the
    last wave is not left half empty.
    """
    n_qt = max(1, -(-lq // cfg.bm))
    rows = nq * n_qt
    resident = num_sms * ctas_per_sm(cfg, cc)
    units = rows * nd
    if units <= resident:
        per = 1
    else:
        waves = -(-units // (resident * 32))  # at most ~32 documents per CTA
        chunks = max(1, resident * waves // rows)
        per = -(-nd // chunks)
    per = max(per, -(-nd // 65535))  # grid.y limit
    return Launch(n_qt, per, (rows, -(-nd // per), 1))


def all_forward_configs(arch: int) -> list[FwdConfig]:
    """Every configuration ``choose_forward`` can return on ``arch`` (for compile checks and warm-up)."""
    seen: dict[str, FwdConfig] = {}
    for dtype in ELEM_CODES:
        for dim in (64, 128, 256, 512):
            for lq in (32, 64, 128, 1024):
                for argmax in (False, True):
                    for vec in (True, False):
                        for wg in (True, False):
                            c = choose_forward(arch, dtype, dim, lq, argmax, vec, wg)
                            seen[c.name] = c
    return list(seen.values())
