"""The NumPy streaming top-k: documents scored in bounded steps, merged into a running top-k."""

from __future__ import annotations

import numpy as np

from .. import _cpu as cpu
from .. import _dispatch as dispatch
from .. import _interop as interop
from .._interop import host_array
from .._ranking import merge_ranked_rows
from .._runtime.operands import valid_host
from .._validate import Problem
from .docs import HostDocs, host_docs
from .parts import Part, part_problem, same_kind

__all__ = ["CpuTopK"]

_CPU_STEP_BYTES = 64 << 20


class CpuTopK:
    def __init__(self, Q, q_mask, q_lengths, q_scales, qp: Problem, k: int):
        fw = qp.framework
        self.qp, self.k = qp, k
        self.q = host_array(Q, fw).reshape(qp.nq, qp.lq, qp.dim)
        self.qv = valid_host(q_mask, q_lengths, qp.nq, qp.lq, "q_lengths", fw)
        self.qs = None
        if q_scales is not None:
            self.qs = host_array(q_scales, fw).reshape(qp.nq, qp.lq)
        self.kind = None
        self.s = np.empty((qp.nq, 0), np.float64 if qp.dtype == "float64" else np.float32)
        self.i = np.empty((qp.nq, 0), np.int64)
        self.base = 0

    def _int8_queries(self) -> dict:
        """The int8 queries' scales for the NumPy path; float queries are quantized on the first call."""
        if self.qs is None:
            from .._cpu import quantize_numpy

            # A token holding NaN or inf gets scale NaN (its scores are NaN), as on the device.
            self.q, self.qs = quantize_numpy(self.q, strict=False)
        return {"q_scale": self.qs}

    def add(self, part: Part):
        p = part_problem(self.qp, part)
        self.kind = same_kind(self.kind, p.dtype, part)
        self.add_docs(p, host_docs(part, p))

    def add_docs(self, p: Problem, docs: HostDocs):
        """Merge the scores of checked documents ``docs`` (problem ``p``, as ``with_queries`` makes it)
        into the running top-k."""
        self.kind = self.kind or p.dtype
        int8 = dispatch.scaled_dtype(p.dtype)
        q8 = self._int8_queries() if int8 else {}
        # Documents per NumPy call: 4096, fewer where their scores [Nq, step] or (padded) validity
        # mask [step, Ld] would pass _CPU_STEP_BYTES, so that many queries or very long documents
        # cost bytes, not a count of tokens.
        step = max(1, min(4096, _CPU_STEP_BYTES // max(1, 4 * self.qp.nq + (0 if p.d_packed else p.ld))))
        if p.d_packed:
            for a in range(0, p.nd, step):
                b = min(p.nd, a + step)
                kw = {**q8, "d_scale": docs.scales} if int8 else {}  # [T]: read with the same offsets as the tokens
                s, _ = cpu.maxsim_packed_numpy(self.q, self.qv, docs.tokens, docs.offsets[a:b + 1],
                                               return_argmax=False, **kw)
                self._merge(s)
        else:
            for a in range(0, p.nd, step):
                b = min(p.nd, a + step)
                kw = {**q8, "d_scale": docs.scales[a:b]} if int8 else {}
                s, _ = cpu.maxsim_numpy(self.q, docs.tokens[a:b], self.qv, docs.valid(slice(a, b)), candidates=False,
                                        nd=b - a, return_argmax=False, **kw)
                self._merge(s)

    def _merge(self, s):
        # Rows of queries at a time whose merge temporaries stay within _CPU_STEP_BYTES (merged whole, the
        # running top-k and a step of many queries took about 48 bytes a candidate: 675 MiB for 2,048
        # queries at k = 2,048, whose result is 48 MiB).
        n = s.shape[1]
        pos = np.broadcast_to(np.arange(self.base, self.base + n, dtype=np.int64), s.shape)  # (a view)
        self.s, self.i = merge_ranked_rows(self.s, self.i, s, pos, self.k, _CPU_STEP_BYTES)
        self.base += n

    def result(self):
        fw = self.qp.framework
        if dispatch.scaled_dtype(self.kind):  # INT8 scores are float32 whatever the queries were
            self.s = self.s.astype(np.float32, copy=False)
        if self.qp.device is None:
            return interop.from_numpy(self.s, fw), interop.from_numpy(self.i, fw)
        import cupy

        with cupy.cuda.Device(self.qp.device):
            return (interop.from_cupy(cupy.asarray(self.s), fw, on_host=False),
                    interop.from_cupy(cupy.asarray(self.i), fw, on_host=False))
