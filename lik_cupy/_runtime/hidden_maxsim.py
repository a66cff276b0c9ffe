"""The fused projection head's one-pass forward on Hopper (``cuda_src/hidden_maxsim.cu``): hidden states
projected, normalised and scored in one kernel, with no projected tensor in memory, then a small kernel
that turns its per-document keys into scores and the argmax. ``_dispatch.choose_hidden_fused`` decides
where it runs; ``lik_cupy.fused_head`` (CuPy, JAX) and ``lik_cupy._torch_hidden`` (torch) call it with
device addresses and their own framework's buffers."""

from __future__ import annotations

import functools

from .._base import env
from .._base.device import device_properties
from .._dispatch import choose_hidden_fused, tables
from . import tma
from .kernels import HIDDEN_FUSED
from .raw_launch import float32_arg, launch_raw, signature

__all__ = ["fused_width", "aligned", "score_hidden", "key_count", "shared_bytes"]

_MAIN = signature("pppiiiiiif")  # bias, dmask, keys, R, Ld, Nd, QR, kchunks, normalize, eps (the maps by value)
_FINISH = signature("pppiii")


def fused_width(hp, device: int, q_mask, q_lengths, d_lengths, budget: int) -> int | None:
    """The query width :func:`score_hidden` takes for the validated call ``hp`` (``HiddenProblem``) on GPU
    ``device``, or None where the streamed pipeline runs it: query masks and lengths, and document lengths,
    go through the MaxSim kernels' checks and NaN contract there (a boolean ``d_mask`` has no invalid
    value: the kernel takes it); a scratch (:func:`key_count`, 8 bytes each) over ``budget`` bytes (the
    call's ``max_chunk_bytes``: the streamed path holds that much at most); wgmma or TMA turned off; and
    shapes ``_dispatch.choose_hidden_fused`` refuses. The operands' addresses are :func:`aligned`'s."""
    if q_mask is not None or q_lengths is not None or d_lengths is not None:
        return None
    p = hp.p
    if 8 * key_count(p.nq, p.lq, p.nd) > budget:
        return None
    if env.wgmma_disabled() or env.tma_disabled() or not tma.available():
        return None
    return choose_hidden_fused(device_properties(device).cc, p.dtype, p.dim, hp.hidden, p.nq * p.lq, p.nd * p.ld)


def aligned(*addresses: int) -> bool:
    """Whether the operands' device addresses are 16-byte aligned, as TMA's tensor maps need: else the
    streamed pipeline runs the call."""
    return not any(a % 16 for a in addresses)


def key_count(nq: int, lq: int, nd: int) -> int:
    """uint64 elements of the zeroed scratch :func:`score_hidden` takes: one per query token and document."""
    return nq * lq * nd


@functools.cache
def _functions(dtype: str, qn: int, device: int) -> tuple:
    """(the main kernel's handle, the finish kernel's, the main kernel's dynamic shared memory, and
    the module that owns both, held with them: the compile cache may drop it, and its release
    unloads them)."""
    from .._dispatch import elem_spec
    from .nvrtc import get_module

    stages, groups = tables.HIDDEN_FUSED_STAGES, tables.HIDDEN_FUSED_WARPGROUPS
    defines = {"LIK_ELEM": elem_spec(dtype).code, "LIK_QN": qn, "LIK_STAGES": stages, "LIK_WG": groups}
    mod = get_module(HIDDEN_FUSED.file, defines, "90a", device, entry="lik_hidden_maxsim")
    main = mod.get_function("lik_hidden_maxsim")
    main.max_dynamic_shared_size_bytes = smem = shared_bytes(qn, stages, groups)
    return main.kernel.ptr, mod.get_function("lik_hidden_maxsim_finish").kernel.ptr, smem, mod


def shared_bytes(qn: int, stages: int, groups: int) -> int:
    """The main kernel's dynamic shared memory (``cuda_src/hidden_maxsim.cu``'s layout): its stages (64
    hidden elements of ``64 * groups`` rows of H and of W's 128), the queries, the barriers and the bias."""
    return stages * (64 * groups + 128) * 128 + 2 * qn * 128 + (2 * stages + 1) * 8 + 128 * 4


def score_hidden(*, q: int, h: int, w: int, bias: int, dmask: int, keys: int, scores: int, amax: int, nq: int,
                 lq: int, nd: int, ld: int, hidden: int, dtype: str, qn: int, normalize: bool, eps: float,
                 device: int, stream: int) -> None:
    """Queue the fused forward on ``stream`` (a handle) of GPU ``device`` (current). Device addresses:
    ``q`` the queries ``[nq * lq, 128]``, ``h`` the hidden states ``[nd * ld, hidden]`` and ``w`` the
    projection ``[128, hidden]``, all C-contiguous of ``dtype``; ``bias`` float32 ``[128]`` or 0;
    ``dmask`` uint8 ``[nd * ld]`` or 0 (0: a token not scored); ``keys`` :func:`key_count` zeroed
    uint64; ``scores`` float32 ``[nq, nd]``; ``amax`` int32 ``[nq, nd, lq]`` or 0. ``qn``:
    ``_dispatch.choose_hidden_fused``'s width for these shapes."""
    main, finish, smem, _ = _functions(dtype, qn, device)
    rows, tile_rows = nd * ld, 64 * tables.HIDDEN_FUSED_WARPGROUPS
    tiles = -(-rows // tile_rows)
    hmap = tma.tile_map(h, rows, hidden * 2, tile_rows)
    wmap = tma.tile_map(w, 128, hidden * 2, 128)
    qmap = tma.tile_map(q, nq * lq, 256, qn)
    grid = (min(tiles, device_properties(device).num_sms), 1, 1)
    launch_raw(main, grid, 128 * tables.HIDDEN_FUSED_WARPGROUPS, smem, stream, _MAIN,
               (bias, dmask, keys, rows, ld, nd, nq * lq, hidden // 64, int(normalize), float32_arg(eps)),
               (hmap, wmap, qmap))
    n = nq * nd
    launch_raw(finish, (-(-n // 256), 1, 1), 256, 0, stream, _FINISH, (keys, scores, amax, nq, lq, nd))
