"""Checked documents as the engines read them: on the host (``HostDocs``, with the staged
source the GPU engine streams) or as device operands (``DeviceDocs``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import _dispatch as dispatch
from .. import _interop as interop
from .._interop import device_array, host_array
from .._runtime.device_checks import call_checks
from .._runtime.operands import check_scales_of_valid, device_offsets, device_valid, host_offsets
from .._validate import Problem, check_length_values
from .parts import Part

__all__ = ["HostDocs", "host_docs", "staged_source", "DeviceDocs", "device_docs"]



@dataclass
class HostDocs:
    """A shard's documents on the host, checked, as the NumPy path reads them: packed ``tokens [T, d]``
    with int64 ``offsets``, or padded ``tokens [Nd, Ld, d]`` with a bool ``mask`` or range-checked
    ``lengths`` (or neither); float32 INT8 ``scales`` shaped like the tokens without their last axis."""

    tokens: np.ndarray
    offsets: np.ndarray | None = None
    mask: np.ndarray | None = None
    lengths: np.ndarray | None = None
    scales: np.ndarray | None = None

    def valid(self, rows) -> np.ndarray:
        """bool ``[n, Ld]``: the valid tokens of the padded documents ``rows`` (a slice or an index array)."""
        if self.mask is not None:
            return self.mask[rows].astype(bool, copy=False)
        n = len(range(*rows.indices(self.tokens.shape[0]))) if isinstance(rows, slice) else len(rows)
        if self.lengths is not None:
            return np.arange(self.tokens.shape[1])[None, :] < self.lengths[rows].reshape(n, 1)
        return np.ones((n, self.tokens.shape[1]), bool)


def host_docs(part: Part, p: Problem) -> HostDocs:
    """``part`` (checked by ``doc_problem``) on the host, its offsets, lengths and scales (of a scaled
    element type, such as INT8) value-checked."""
    fw = interop.framework_of(part.docs)
    scales = np.asarray(host_array(part.scales, fw), np.float32) if dispatch.scaled_dtype(p.dtype) else None
    scales_name = part.arg("scales")
    if part.packed:
        docs = HostDocs(host_array(part.docs, fw), offsets=host_offsets(host_array(part.offsets, fw), p.ntok,
                                                                        part.arg("offsets")), scales=scales)
        if scales is not None:  # offsets from 0 to T: every token is a document's
            check_scales_of_valid(scales.reshape(p.ntok), None, scales_name)
        return docs
    lens = None
    if part.lengths is not None:
        lens = np.asarray(host_array(part.lengths, fw)).reshape(p.nd)
        if lens.size:  # on the values as given, as valid_host checks them
            check_length_values("d_lengths", int(lens.min()), int(lens.max()), p.ld)
        lens = lens.astype(np.int64, copy=False)
    mask = None if part.mask is None else host_array(part.mask, fw)
    docs = HostDocs(host_array(part.docs, fw), mask=mask, lengths=lens, scales=scales)
    if scales is not None:
        check_scales_of_valid(scales.reshape(p.nd, p.ld), docs.valid(slice(None)), scales_name)
    return docs


def staged_source(docs: HostDocs, p: Problem) -> dict:
    """The host arrays a streamed shard's chunks are staged from (``GpuTopK._stream``): "docs" (bfloat16
    as its 16-bit patterns), and "off" (packed), "mask" / "lens" (padded), "scales" (INT8)."""
    src = {"docs": docs.tokens.view(np.uint16) if p.dtype == "bfloat16" else docs.tokens}
    for name, a in (("off", docs.offsets), ("mask", docs.mask), ("lens", docs.lengths), ("scales", docs.scales)):
        if a is not None:
            src[name] = a
    return src


@dataclass
class DeviceDocs:
    """A shard's documents on the device, checked, as the kernels read them: ``tokens`` (bfloat16 as its
    uint16 bits) packed ``[T, d]`` with device ``offsets``, or padded ``[Nd, Ld, d]`` with a uint8
    ``mask`` and / or int32 ``lengths`` (beside a mask: its spans, ``_runtime/masks.py``); INT8
    ``scales`` float32, flat ([T] or [Nd * Ld])."""

    tokens: object
    offsets: object = None
    mask: object = None
    lengths: object = None
    scales: object = None


def device_docs(part: Part, p: Problem, verify: bool = True) -> DeviceDocs:
    """``part`` (on the current device, checked by ``doc_problem``) in the kernels' form, its offsets
    and lengths value-checked on the device (``verify``: with a host wait, raising; else left to
    the caller's NaN pass)."""
    import cupy

    fw = interop.framework_of(part.docs)
    d = interop.to_cupy(part.docs, fw)
    if p.dtype == "bfloat16":  # the corpus's dtype: a bfloat16 Q may score an INT8 corpus
        d = d.view(cupy.uint16)
    # INT8 scales, flat as the kernel reads them: [T] packed, [nd * ld] padded.
    ds = interop.to_cupy(part.scales, fw).reshape(-1) if dispatch.scaled_dtype(p.dtype) else None
    if part.packed:
        return DeviceDocs(d, offsets=device_offsets(device_array(part.offsets, fw, False), p.ntok,
                                                     part.arg("offsets"), check=verify), scales=ds)
    dm, dl = device_valid(part.mask, part.lengths, p.nd, p.ld, "d_lengths", fw, False,
                          None if verify else call_checks(False))
    return DeviceDocs(d, mask=dm, lengths=dl, scales=ds)
