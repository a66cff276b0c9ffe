"""Where a call runs: the one resolution of ``backend="auto" | "gpu" | "cpu"`` every public
function shares."""

from __future__ import annotations

from .._base.device import device_properties, gpu_available
from .config import arch_of
from .elements import elem_spec, kernel_dtype

__all__ = ["BACKENDS", "check_backend", "use_gpu", "scoring_on_gpu", "check_gpu_dim", "check_gpu_arch"]

BACKENDS = ("auto", "gpu", "cpu")


def check_backend(backend) -> None:
    # (a string first: ``in`` would compare an array elementwise)
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def use_gpu(backend: str, device: int | None, *, host_to_gpu: bool = True, float64: bool = False,
            float64_gpu: bool = False) -> bool:
    """Whether a call runs on the GPU. ``"gpu"`` always (a GPU must be visible), ``"cpu"`` never,
    ``"auto"`` for device arrays (``device`` is their ordinal) and, with ``host_to_gpu``, for host
    arrays too when a GPU is present.

    ``float64`` inputs: ``"auto"`` sends host arrays to the CPU, which computes in float64. On the
    GPU only the calls that say so (``float64_gpu``: the forward and the backward, which score
    float64 at float32 accuracy and return float64) take them; the others refuse them with a
    TypeError saying what to do rather than round them silently."""
    check_backend(backend)
    if backend == "cpu":
        return False
    if float64:
        if backend == "auto" and device is None:
            return False
        where = "backend='gpu'" if backend == "gpu" else "arrays on the GPU"
        if not float64_gpu:
            raise TypeError(f"float64 inputs with {where}: this call's GPU kernels take float16, bfloat16 or float32. "
                            "Cast to float32 to score on the GPU, or pass host arrays with backend='cpu' (or 'auto') to score "
                            "in float64 on the CPU")
    if backend == "auto" and device is None and not (host_to_gpu and gpu_available()):
        return False
    if not gpu_available():
        raise RuntimeError("backend='gpu' but no CUDA GPU is visible (CuPy could not find one, or is not installed)")
    return True


def scoring_on_gpu(p, backend: str, *, float64: bool = False, float64_gpu: bool = False) -> bool:
    """``use_gpu`` for a scoring problem (a ``Problem``), refusing dims the GPU kernels lack.
    ``float64``: a float64 input the Problem's dtype does not show (an INT8 call's float Q);
    ``float64_gpu``: the caller scores float64 on the GPU (see ``use_gpu``). Host arrays under
    ``"auto"`` stay on the CPU when the current GPU lacks their element type's dim or instructions
    (FP8 at d = 32, or on a GPU older than Ada), as they would on a host without a GPU; device arrays
    and ``"gpu"`` raise instead."""
    on_gpu = use_gpu(backend, p.device, float64=float64 or p.dtype == "float64", float64_gpu=float64_gpu)
    if on_gpu and backend == "auto" and p.device is None and not _current_gpu_takes(p.dtype, p.dim):
        return False
    if on_gpu:
        check_gpu_dim(p.dtype, p.dim)
    return on_gpu


def _current_gpu_takes(dtype: str, dim: int) -> bool:
    """Whether the current GPU's kernels take element type ``dtype`` at embedding dim ``dim``."""
    spec = elem_spec(kernel_dtype(dtype))
    cc = device_properties(_current_device()).cc
    return cc >= spec.min_arch and spec.dim_ok_on(arch_of(cc), dim)


def _current_device() -> int:
    import cupy

    return cupy.cuda.runtime.getDevice()


def check_gpu_dim(dtype: str, dim: int, cpu: str = "backend='cpu'") -> None:
    """ValueError unless the GPU kernels of element type ``dtype`` take embedding dim ``dim``
    (float64 is scored on float32's kernels); ``cpu``: the caller's way to the CPU, for the message."""
    spec = elem_spec(kernel_dtype(dtype))
    if not spec.dim_ok(dim):
        raise ValueError(f"{spec.name} scoring on the GPU needs dim {spec.dim_rule()}; got dim {dim} "
                         f"({cpu} scores any dim)")


def check_gpu_arch(dtype: str, device: int) -> None:
    """RuntimeError unless GPU ``device`` has the tensor-core instructions of element type ``dtype``
    (``ElemSpec.min_arch``: FP8 needs sm_89, Ada or Hopper), naming the GPU and the ways around it."""
    spec = elem_spec(kernel_dtype(dtype))
    props = device_properties(device)
    if props.cc < spec.min_arch:
        fallback = f", or dequantise ({spec.dequantiser}) and score the floats" if spec.dequantiser else ""
        raise RuntimeError(
            f"{spec.name} on the GPU needs compute capability {spec.min_arch / 10:.1f} or newer (its tensor-core "
            f"instructions), but device {device} ({props.name}) has {props.cc / 10:.1f}: use backend='cpu'{fallback}")
