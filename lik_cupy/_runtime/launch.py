"""The forward launch: a validated problem and its device operands in, the chosen kernel
configuration compiled (or found), its grid planned and the kernel queued on the caller's stream.

``launch`` is the one place every GPU scoring path (``maxsim``, the INT8 and packed forms,
``retrieve``) launches the forward kernel.
"""

from __future__ import annotations

import warnings

from dataclasses import replace

import numpy as np

from .. import _dispatch as dispatch
from .._base import env
from .._base.cache import DeviceCache
from .._base.device import device_properties, empty
from .._validate import Problem, check_32bit
from . import tma, token_split
from .kernels import FORWARD
from .masks import mask_spans
from .raw_launch import is_capturing, launch_raw, signature

__all__ = ["launch", "prepare", "ForwardLaunch", "clear_prepared", "use_tma_for", "tma_usable", "caller_name",
           "check_extents"]


def caller_name(p: Problem) -> str:
    """The public function a problem came from, for error messages."""
    return "maxsim" + (f"_{p.dtype}" if dispatch.scaled_dtype(p.dtype) else "") + ("_varlen" if p.d_packed else "")


def tma_usable() -> bool:
    """Whether Hopper tiles may stage documents by TMA here (not turned off, and the driver
    can build tensor maps); dispatch decides which tiles do."""
    return not env.tma_disabled() and tma.available()


_wgmma_warned = False


def _warn_wgmma_once(err: Exception) -> None:
    global _wgmma_warned
    if not _wgmma_warned:
        _wgmma_warned = True
        warnings.warn(f"lik_cupy: the Hopper (sm_90a) kernel failed to build, using the portable kernel instead: {err}",
                      RuntimeWarning, stacklevel=4)


# (device, kernel name) -> (module, the kernel's CUfunction handle on that device): spares each
# call the cache-key building; its size is bounded by the configurations dispatch can return.
_kernels = DeviceCache(4096)


def _kernel(cfg, arch: int, device: int):
    """The loaded module of ``cfg`` and its kernel's driver handle on ``device`` (the current one)."""
    return _kernels.lookup(device, cfg.name) or _kernels.get(device, cfg.name, lambda: _load_kernel(cfg, arch, device))


def _load_kernel(cfg, arch: int, device: int):
    from .nvrtc import get_module

    mod = get_module(FORWARD.file, cfg.defines(), cfg.target(arch), device)
    kern = mod.get_function(cfg.name)
    if cfg.smem_bytes > 48 * 1024:
        kern.max_dynamic_shared_size_bytes = cfg.smem_bytes
    return mod, kern.kernel.ptr


# The forward kernel's parameters in order, by C type (``raw_launch.signature``); the TMA
# descriptors follow as their own 128-byte buffers.
_FWD_SIGNATURE = "pppppppppiqppiiiiiiiiippu"
_FWD_PARAMS = signature(_FWD_SIGNATURE)


def _ptr(a) -> int:
    """A device array's address, or 0 (NULL) for None."""
    return a.data.ptr if a is not None else 0


def lengths_ptr(a) -> int:
    """The address the kernels take for int32 or int64 document lengths ``a``: int64 ones tagged by
    the low bit (``length_at`` in cuda_src/common.cuh); 0 for None."""
    return 0 if a is None else a.data.ptr | (a.dtype.itemsize == 8)


_SUM_PARAMS = signature("ppqi")


class ForwardLaunch:
    """Everything a forward launch needs that depends on the call's signature alone (shapes, dtypes,
    flags, alignment), made once per signature by :func:`prepare`: the configuration, its compiled
    kernel, the launch plans and the scalar parameters. :meth:`run` then only reads pointers."""

    def __init__(self, p: Problem, device: int, cfg, mod, func: int, plan, whole, ntok: int, rows: int, esize: int,
                 off_flags: int, argmax: bool, split_mod=None):
        self.p, self.device, self.cfg, self.mod, self.func, self.plan = p, device, cfg, mod, func, plan
        # The token split's tile comes from a module of its own: held, as mod is, so that the compile
        # cache dropping it cannot unload the function this launch calls by handle.
        self._split_mod = split_mod
        # (cfg, func, plan, ntok) without a token split, for a stream being captured (token_split.py):
        # the whole-document tile and plan a split replaced (padded documents, tokens-on-M INT8
        # tiles), or the same tile planned without one (packed documents keep their token count,
        # which bounds every document), made when first needed.
        self._whole = whole
        self._shared = 1 if p.candidates else p.nq
        self.ntok, self.rows, self.esize, self.argmax = ntok, rows, esize, argmax
        self.off_flags = off_flags
        self.partials = plan.n_qt * p.nq * p.nd if plan.n_qt > 1 else 0  # float32 scratch elements
        # document lengths may be int64 (a tagged address), except in scaled (INT8) and multi-query argmax
        # tiles (fwd_length in cuda_src/fwd/config.cuh); query lengths are int32 in every tile
        self.tagged_doc_lengths = not (cfg.argmax and (cfg.spec.scaled or cfg.multi))
        self.sum_func = mod.get_function("lik_sum_partials").kernel.ptr if plan.n_qt > 1 else 0
        self._made_with = _made_with()

    def whole(self):
        if self._whole is None:
            props = device_properties(self.device)
            p = self.p
            self._whole = (self.cfg, self.func, dispatch.plan_launch(self.cfg, props.cc, props.num_sms, p.nq, p.nd,
                                                                     p.lq, self._shared), self.ntok)
        return self._whole

    def current(self) -> bool:
        """Whether dispatch would still prepare this launch (no cache cleared, no dispatch function
        swapped since)."""
        return self._made_with == _made_with()

    def run(self, stream: int, q: int, d: int, q_scale: int, d_scale: int, ql: int, qm: int, dl: int, dm: int,
            d_off: int, scores: int, amax: int, partials: int = 0, by_value: tuple = (), zero_pad: int = 0) -> None:
        """Queue the kernel on ``stream`` (a handle); every other argument is a device address (0 for
        none). ``partials``: float32 scratch of ``self.partials`` elements when that is nonzero;
        ``zero_pad``: uint8 per document row of D, the documents with zero-vector padding (``launch``)."""
        cfg, func, plan, ntok = self.cfg, self.func, self.plan, self.ntok
        if plan.token_split and is_capturing(stream):
            cfg, func, plan, ntok = self.whole()
        p = self.p
        part = partials if plan.n_qt > 1 else scores
        values = (q, d, q_scale, d_scale, ql, qm, dl, dm, d_off, self.off_flags, ntok, part, amax,
                  p.nq, p.nd, p.lq, p.ld, p.dim, plan.n_qt, plan.qb, plan.docs_per_cta, p.nd if p.candidates else 0,
                  zero_pad)
        if cfg.tma:
            dmap = tma.tile_map(d, self.rows, p.dim * self.esize, cfg.bn)
            smap = tma.scale_map(d_scale, self.rows, cfg.bn + 4) if d_scale else dmap
            qmap = tma.tile_map(q, p.nq * p.lq, p.dim * self.esize, cfg.bm) if cfg.split else dmap
            by_value = (dmap, smap, qmap)
        try:
            if plan.token_split:
                size = token_split.nbytes(plan.grid[0] * plan.grid[1], cfg.bm, self.argmax, cfg.refine)
                token_split.launch(self.device, stream, size, lambda split: launch_raw(
                    func, plan.grid, cfg.threads, cfg.smem_bytes, stream, _FWD_PARAMS, values + split, by_value))
            else:
                launch_raw(func, plan.grid, cfg.threads, cfg.smem_bytes, stream, _FWD_PARAMS, values + (0, 0), by_value)
            if plan.n_qt > 1:
                n = p.nq * p.nd
                launch_raw(self.sum_func, (min(-(-n // 256), 65535), 1, 1), 256, 0, stream, _SUM_PARAMS,
                           (partials, scores, n, plan.n_qt))
        except Exception as e:
            import cupy

            if not isinstance(e, cupy.cuda.driver.CUDADriverError):
                raise
            raise RuntimeError(f"{cfg.name} failed to launch (grid {plan.grid}, Nq={p.nq}, Nd={p.nd}, Lq={p.lq}, "
                               f"Ld={p.ld}, d={p.dim}): {e}") from e


# Prepared launches by signature, bounded. Each remembers the dispatch functions it was made with
# and the generation of the caches, so that a test or a sweep that swaps them in
# (bench/lib/forcing.py) or changes a table and clears the caches gets a fresh plan.
_prepared = DeviceCache(1024, lru=True)
_generation = [0]


def _made_with():
    return dispatch.choose_forward, dispatch.plan_launch, _generation[0], env.wgmma_disabled(), env.tma_disabled()


def clear_prepared() -> None:
    """Forget every prepared launch, and so every prepared call (``dispatch.clear_caches`` calls it)."""
    _generation[0] += 1
    _prepared.clear()


dispatch.on_clear(clear_prepared)


def prepare(p: Problem, device: int, *, esize: int, vec: bool, use_tma: bool, argmax: bool, packed: bool = False,
            off_wide: bool = False, ld_hint=None, d_off_whole: bool = True, x3: bool = False, residual=None,
            cand: bool = False) -> ForwardLaunch:
    """The :class:`ForwardLaunch` of a problem on ``device`` (the current one), made once per
    signature. ``residual``: nbits of PLAID-compressed documents, or None; ``cand``: candidate ids
    pick each query's documents (``candidates.CandidateIds``)."""
    key = (p, esize, vec, use_tma, argmax, packed, off_wide, ld_hint, d_off_whole, x3, residual, cand,
           _made_with())
    return _prepared.lookup(device, key) or _prepared.get(device, key, lambda: _prepare(
        p, device, esize, vec, use_tma, argmax, packed, off_wide, ld_hint, d_off_whole, x3, residual, cand))


def _prepare(p: Problem, device: int, esize: int, vec: bool, use_tma: bool, argmax: bool, packed: bool,
             off_wide: bool, ld_hint, d_off_whole: bool, x3: bool, residual, cand: bool) -> ForwardLaunch:
    from ..errors import CompileError

    props = device_properties(device)
    shared = 1 if p.candidates else p.nq
    ld = ld_hint if ld_hint is not None else p.ld
    arch = dispatch.arch_of(props.cc)

    def choose(wgmma: bool):
        if residual is not None:
            return dispatch.choose_residual(props.cc, p.dtype, p.dim, p.lq, residual, argmax, shared, packed, cand)
        return dispatch.choose_forward(props.cc, p.dtype, p.dim, p.lq, argmax, vec, wgmma, shared, ld, packed,
                                       use_tma and wgmma, x3, cand)

    cfg = choose(not env.wgmma_disabled())
    try:
        mod, func = _kernel(cfg, arch, device)
    except CompileError as e:
        if not (cfg.wgmma or cfg.tma):  # only the sm_90a builds have a fallback
            raise
        _warn_wgmma_once(e)
        cfg = choose(False)
        mod, func = _kernel(cfg, arch, device)
    rows = p.ntok if packed else (p.nq * p.nd if p.candidates else p.nd) * p.ld
    ntok = p.ntok if packed else 0
    plan = dispatch.plan_launch(cfg, props.cc, props.num_sms, p.nq, p.nd, p.lq, shared, ntok)
    check_extents(p, plan)  # (a token split's plan has its rows and no longer runs of documents)
    whole = None  # made at the first launch on a captured stream (ForwardLaunch.whole)
    split_mod = None
    if not plan.token_split and (not packed or cfg.tokm):  # few long documents: a tile that splits them
        split = _token_split(cfg, p, props, arch, device, shared, packed)
        if split is not None:
            whole = (cfg, func, plan, ntok)
            cfg, func, plan, ntok, split_mod = split
    off_flags = (1 if not packed or off_wide else 0) | (2 if d_off_whole else 0)
    return ForwardLaunch(p, device, cfg, mod, func, plan, whole, ntok, rows, esize, off_flags, argmax, split_mod)


# Indices the forward kernel forms in 32-bit ints past the last of a count: a tile's rows or tokens
# and a block's threads (1,024 at most) past Lq's and Ld's last (a padded document's tile of tokens
# at its end, a masked one's mask read there), and past Nd's last a block's threads (the packed
# documents' search of the offsets samples that far) or a CTA's run of padded documents
# (docs_per_cta), whichever is more.
_MARGIN = 1024


def check_extents(p: Problem, plan) -> None:
    """Raise ValueError, naming the count, where problem ``p`` under launch plan ``plan``
    (``dispatch.plan_launch``) would take the forward kernel's 32-bit indices past 2**31 - 1."""
    # (packed documents' CTAs take shares of tokens, found by the search)
    run = _MARGIN if p.d_packed else max(_MARGIN, plan.docs_per_cta)
    past = "a block's search of the offsets" if p.d_packed else "a CTA's run of documents"
    if max(p.nq, p.lq + _MARGIN, p.ld + _MARGIN, p.nd + run, plan.grid[0]) >= 2**31:
        check_32bit(Nq=p.nq, grid=plan.grid[0], **{
            f"Lq + {_MARGIN} (a tile's rows past the last)": p.lq + _MARGIN,
            f"Ld + {_MARGIN} (a tile's tokens past the last)": p.ld + _MARGIN,
            f"Nd + {run} ({past} past the last)": p.nd + run})


def _token_split(cfg, p: Problem, props, arch: int, device: int, shared: int, packed: bool):
    """(cfg, func, plan, ntok, module) of the tile that splits the documents ``cfg`` would score whole,
    where the launch plan splits them (token_split.py), else None: padded documents take
    ``cfg``'s strided tile (``ntok`` is then one query's documents' padded tokens), packed ones
    under a tokens-on-M INT8 tile its ``queries_on_m`` tile."""
    from ..errors import CompileError

    tile = cfg.queries_on_m if packed else cfg.strided_tile
    if tile is None or not tile.token_split or (not packed and p.ld < dispatch.padded_split_min_ld(tile)):
        return None
    ntok = p.ntok if packed else p.nd * p.ld
    split = dispatch.plan_launch(tile, props.cc, props.num_sms, p.nq, p.nd, p.lq, shared, ntok)
    if not split.token_split:
        return None
    try:
        smod, sfunc = _kernel(tile, arch, device)
    except CompileError as e:  # the sm_90a build of this variant failed: whole documents, as planned
        if not (tile.wgmma or tile.tma):
            raise
        _warn_wgmma_once(e)
        return None
    return tile, sfunc, split, ntok, smod


def use_tma_for(p: Problem, vec: bool, rows: int, d_scale=None, residual=None) -> bool:
    """Whether the caller can hand the kernel tensor maps of D (and of its scales)."""
    return (residual is None and tma_usable() and vec and max(rows, p.nq * p.lq) <= tma.MAX_ROWS
            and (d_scale is None or d_scale.data.ptr % 16 == 0))


def launch(p: Problem, q, d, qm, dm, ql, dl, return_argmax: bool, device: int, *, d_off=None, ld_hint=None,
           d_off_whole=True, out=None, q_scale=None, d_scale=None, caller=None, x3=False, residual=None, cand=None,
           zero_pad=None):
    """Choose the kernel configuration and launch it on the current CuPy stream.

    q: [nq, lq, dim] (bfloat16 as uint16); d: padded [rows, ld, dim], or packed
    tokens [T, dim] when ``d_off`` (int32 or int64 [nd + 1] device offsets) is given.
    ``d_off_whole``: the offsets run from 0 to T (not a slice of them), so CTAs split the
    tokens without reading where they start and end (a hint: scores never depend on it).
    ``out``: optional float32 buffer of nq * nd elements for the scores.
    A scaled ``p.dtype`` (INT8, ``ElemSpec.scaled``): q and d are of it and ``q_scale`` (float32 [nq * lq],
    non-negative) and ``d_scale`` (float32 [rows * ld] or [T]) are their contiguous per-token scales.
    ``caller`` names the public function in error messages (default: the one ``p`` came from).
    ``x3``: float32 at float32 accuracy (``lik_cupy.precision``), for float32 q and d.
    ``residual`` (a ``lik_cupy._runtime.residual.ResidualOperands``): the documents are
    PLAID-compressed and ``d`` is their codes ([rows] or, padded, [rows, ld]); the kernel's tile
    loader decompresses them (``p.dtype``, float16 or bfloat16, is the tile's dtype).
    ``cand`` (a ``lik_cupy._runtime.candidates.CandidateIds`` [nq, p.nd], with ``p.candidates``):
    query i scores the documents of ``d`` its row of ids names, in place (an id outside the
    corpus scores NaN).
    ``zero_pad`` (uint8 [rows of d, or nd packed documents], 16-bit and float32 calls without
    candidate ids): the documents whose padding is zero vectors that count, as in PyLate's and
    colpali-engine's torch paths: each query token's max over a flagged document is floored at 0
    (NaN kept), and where the floor wins its argmax is -1. The padding is skipped all the same (by
    ``dl``, ``dm`` or the offsets), never read. ``masks.MASKED`` (with ``dm``): the documents with a
    masked token, flagged by the kernel that reads the mask's spans.
    """
    import cupy

    fn, split = caller or caller_name(p), "split the call over fewer queries or documents"
    if zero_pad is not None and (dispatch.scaled_dtype(p.dtype) or residual is not None or cand is not None):
        raise ValueError(f"{fn}: zero-vector padding is for float16, bfloat16 and float32 documents scored whole")
    scores = out.reshape(p.nq, p.nd) if out is not None else empty((p.nq, p.nd), np.float32, f"{fn}: scores", split)
    amax = empty((p.nq, p.nd, p.lq), np.int32, f"{fn}: argmax",
                 f"return_argmax=False needs no argmax buffer; or {split}") if return_argmax else None
    if env.poison_outputs():
        scores.fill(np.float32(-1.2345e33))
        if amax is not None:
            amax.fill(-77)
    if p.nq == 0 or p.nd == 0:
        return scores, amax
    if p.lq == 0:  # no query token: empty sums
        scores.fill(0)
        return scores, amax
    if d.shape[0] == 0 or (d_off is None and p.ld == 0):  # every document empty: -inf, or 0 for an empty query
        if isinstance(zero_pad, str):  # MASKED: no token, so none masked
            zero_pad = None
        valid = (ql > 0) if ql is not None else qm.any(axis=1) if qm is not None else cupy.ones(p.nq, bool)
        valid = valid.reshape(p.nq, 1)
        if zero_pad is not None:  # and 0 for a document of zero-vector padding
            valid = valid & (zero_pad.reshape(p.nq if p.candidates else 1, p.nd) == 0)
        scores[...] = cupy.where(valid, np.float32(-np.inf), np.float32(0))
        if amax is not None:
            amax.fill(-1)
        return scores, amax

    esize = q.dtype.itemsize
    # The kernels read one scale per token: fewer would be read out of bounds
    for name, scale, tokens in (("q_scale", q_scale, p.nq * p.lq), ("d_scale", d_scale, d.size // p.dim)):
        if scale is not None and scale.size < tokens:
            raise RuntimeError(f"{fn}: internal error: {name} holds {scale.size} scales for {tokens} tokens")
    if residual is not None and q.data.ptr % 16:  # the residual tiles copy 16-byte query chunks
        q = q.copy()
    vec = (p.dim * esize) % 16 == 0 and q.data.ptr % 16 == 0 and (residual is not None or d.data.ptr % 16 == 0)
    if d_off is not None and p.ntok != d.shape[0]:
        p = replace(p, ntok=d.shape[0])
    # (first: its extents check refuses what the kernels cannot index before any launch)
    fwd = prepare(p, device, esize=esize, vec=vec, use_tma=use_tma_for(p, vec, d.size // p.dim, d_scale, residual),
                  argmax=return_argmax, packed=d_off is not None, off_wide=d_off is not None and d_off.dtype == np.int64,
                  ld_hint=ld_hint, d_off_whole=d_off_whole, x3=x3, residual=None if residual is None else residual.nbits,
                  cand=cand is not None)
    if dm is not None and dl is None:  # the kernel then skips each document's padding (masks.py)
        if isinstance(zero_pad, str):  # MASKED: the flags come with the spans
            dl, zero_pad = mask_spans(dm, device, masked=True)
        else:
            dl = mask_spans(dm, device)
    part = empty((fwd.partials,), np.float32, f"{fn}: partial scores of the long queries' tiles", split) \
        if fwd.partials else None
    if ql is not None and ql.dtype == np.int64:
        ql = ql.astype(np.int32)
    if dl is not None and dl.dtype == np.int64 and not fwd.tagged_doc_lengths:
        dl = dl.astype(np.int32)
    fwd.run(cupy.cuda.get_current_stream().ptr, q.data.ptr, d.data.ptr, _ptr(q_scale), _ptr(d_scale), _ptr(ql),
            _ptr(qm), lengths_ptr(dl), _ptr(dm), _ptr(d_off), scores.data.ptr, _ptr(amax), _ptr(part),
            # the by-value parameters after the fixed ones: the residual kernel's, then the candidate ids'
            (() if residual is None else (residual,)) + (() if cand is None else (cand,)), _ptr(zero_pad))
    return scores, amax
