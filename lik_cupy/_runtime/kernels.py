"""The kernel registry: every source of ``cuda_src/`` the package compiles, its entry points and
the ``-D`` sets it is built with. The launches, ``warmup`` and the compile check
(``nvrtc.check_all``) reach the sources through it."""

from __future__ import annotations

from dataclasses import dataclass

from .._dispatch import ELEMS, elem_spec
from .._dispatch.tables import HIDDEN_FUSED_QN, HIDDEN_FUSED_STAGES, HIDDEN_FUSED_WARPGROUPS

__all__ = ["KernelSource", "FORWARD", "TOPK", "CHECKS", "MASKS", "QUANTIZE", "BACKWARD", "HIDDEN", "HIDDEN_FUSED",
           "SOURCES", "QUANTISED_FROM", "BACKWARD_DTYPES"]


@dataclass(frozen=True)
class KernelSource:
    """One NVRTC entry source and its kernels."""

    file: str  # under cuda_src/
    entries: tuple[str, ...]  # its kernels (the forward's: beside each configuration's own, LIK_NAME)
    variants: tuple[dict[str, int], ...] = ({},)  # the -D sets the compile check builds (the forward's: dispatch's)
    hopper: bool = False  # built for sm_90a alone (wgmma, TMA): the compile check builds it for sm_90 only

    def target(self, arch: int) -> int | str | None:
        """What the compile check builds for architecture ``arch``: ``arch``, ``"90a"``, or None (nothing)."""
        if not self.hopper:
            return arch
        return "90a" if arch == 90 else None

    def row_name(self, entry: str, defines: dict[str, int]) -> str:
        """The compile check's name of ``entry`` built with ``defines``: ``lik_bwd_dq[elem=0,vec=1]``."""
        if not defines:
            return entry
        return entry + "[" + ",".join(f"{k.removeprefix('LIK_').lower()}={v}" for k, v in defines.items()) + "]"


# The float element types the quantiser reads, and those the backward kernels take.
QUANTISED_FROM = tuple(map(elem_spec, ("float16", "bfloat16", "float32")))
BACKWARD_DTYPES = tuple(e.name for e in ELEMS if not e.scaled)

FORWARD = KernelSource("maxsim_fwd.cu", ("lik_sum_partials",), ())
TOPK = KernelSource("topk.cu", ("lik_topk_merge",))
CHECKS = KernelSource("checks.cu", ("lik_check_range_i32", "lik_check_range_i64", "lik_check_offsets_i32",
                                    "lik_check_offsets_i64", "lik_nan_invalid"))
MASKS = KernelSource("masks.cu", ("lik_mask_spans",))
QUANTIZE = KernelSource("quantize.cu", tuple(e.quantiser_kernel for e in ELEMS if e.quantiser_kernel),
                        tuple({"LIK_ELEM": e.code} for e in QUANTISED_FROM))
BACKWARD = KernelSource("maxsim_bwd.cu", ("lik_bwd_dq", "lik_bwd_keys", "lik_bwd_dd_csr", "lik_bwd_cast"),
                        tuple({"LIK_ELEM": elem_spec(d).code, "LIK_VEC": vec} for d in BACKWARD_DTYPES for vec in (0, 1)))

HIDDEN = KernelSource("hidden.cu", ("lik_hidden_normalize", "lik_hidden_normalize_grad"),
                      tuple({"LIK_ELEM": e.code} for e in QUANTISED_FROM))
# The fused head's one-pass forward (lik_cupy/_runtime/hidden_maxsim.py): each 16-bit type at each query width.
HIDDEN_FUSED = KernelSource("hidden_maxsim.cu", ("lik_hidden_maxsim", "lik_hidden_maxsim_finish"),
                            tuple({"LIK_ELEM": elem_spec(d).code, "LIK_QN": qn, "LIK_STAGES": HIDDEN_FUSED_STAGES,
                                   "LIK_WG": HIDDEN_FUSED_WARPGROUPS}
                                  for d in ("float16", "bfloat16") for qn in HIDDEN_FUSED_QN), hopper=True)

# In the compile check's order.
SOURCES = (FORWARD, TOPK, CHECKS, MASKS, QUANTIZE, BACKWARD, HIDDEN, HIDDEN_FUSED)
