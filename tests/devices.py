"""Helpers of the multi-GPU tests (the ``other_gpu`` fixture, tests/conftest.py): a call whose arrays lie on
another GPU than the current one, against the same call on the current GPU, bit for bit."""

import numpy as np


def on_gpu(x, device: int):
    """A copy of ``x`` (NumPy, CuPy or torch; lists and tuples of them, None, ints, strings) on GPU ``device``, in
    the same framework (NumPy arrays become CuPy ones); other values as they are."""
    if isinstance(x, (list, tuple)):
        return type(x)(on_gpu(y, device) for y in x)
    if isinstance(x, dict):
        return {k: on_gpu(v, device) for k, v in x.items()}
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        return x.detach().to(f"cuda:{device}").requires_grad_(x.requires_grad)
    if mod in ("cupy", "numpy") and hasattr(x, "shape"):
        import cupy

        host = x.get() if mod == "cupy" else x
        with cupy.cuda.Device(device):
            return cupy.asarray(host)
    return x


def device_of(x):
    """The GPU ordinal of a CuPy, torch or JAX array, None on the host (NumPy, a CPU tensor or JAX array)."""
    mod = type(x).__module__.split(".")[0]
    if mod == "cupy":
        return x.device.id
    if mod == "torch":
        return x.get_device() if x.is_cuda else None
    if mod in ("jax", "jaxlib"):
        (d,) = x.devices()
        return None if d.platform == "cpu" else getattr(d, "local_hardware_id", d.id)
    return None


def host(x):
    """A result (CuPy, torch, JAX or NumPy; tuples of them, None) as NumPy, bfloat16 as its 16-bit patterns."""
    if x is None:
        return None
    if isinstance(x, (list, tuple)):
        return tuple(host(y) for y in x)
    mod = type(x).__module__.split(".")[0]
    if mod == "cupy":
        return x.get()
    if mod == "torch":
        import torch

        t = x.detach().cpu()
        return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    a = np.asarray(x)
    return a.view(np.int16) if a.dtype.name == "bfloat16" else a


def assert_same_bits(got, want, what: str = "") -> None:
    """``got`` and ``want`` (results as :func:`host` takes them) hold the same dtypes, shapes and bytes
    (``what``: the call, for the message)."""
    got, want = host(got), host(want)
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want), what
        for g, w in zip(got, want):
            assert_same_bits(g, w, what)
        return
    if want is None:
        assert got is None, what
        return
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.dtype, want.shape)
    if got.dtype.kind in "US":
        np.testing.assert_array_equal(got, want, err_msg=what)
    else:
        assert got.tobytes() == want.tobytes(), f"{what}: {np.sum(got != want)} of {got.size} entries differ"


def assert_on(x, device, what: str = "") -> None:
    """Every array of a result (tuples of them) lies on ``device`` (None: the host); ids of strings (NumPy)
    pass (``what``: the call, for the message)."""
    if x is None:
        return
    if isinstance(x, (list, tuple)):
        for y in x:
            assert_on(y, device, what)
        return
    if isinstance(x, np.ndarray) and x.dtype.kind in "US":
        return
    assert device_of(x) == device, f"{what}: a result lies on {device_of(x)}, expected {device}"


def current(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, checking that the current CUDA device after it is the one before it."""
    import cupy

    before = cupy.cuda.runtime.getDevice()
    out = fn(*args, **kwargs)
    after = cupy.cuda.runtime.getDevice()
    assert after == before, f"{getattr(fn, '__qualname__', fn)} left device {after} current (it was {before})"
    return out


def assert_calls_match(calls: dict, here, there, device: int, repeats: int = 2) -> None:
    """Each ``calls[name](arrays)`` on ``there`` (arrays on GPU ``device``) against the same call on
    ``here`` (on cuda:0), with cuda:0 current: results on ``device`` and bit for bit, the first call
    and then (``repeats``) the repeat path's prepared call."""
    for name, call in calls.items():
        want = current(call, here)
        for _ in range(repeats):
            got = current(call, there)
            assert_on(got, device, name)
            assert_same_bits(got, want, name)
