"""The framework adapter contract (``lik_cupy._interop.contract``): each adapter module has every
member of its protocols, functions with the protocol's parameters, and is registered where the
package looks for it; the core modules name no framework; ``GpuCall``, the GPU paths' prologue."""

from __future__ import annotations

import inspect
import types

import numpy as np
import pytest

from lik_cupy import _interop as interop
from lik_cupy._interop import contract, cupy_arrays, torch_tensors, xla_buffers
from reference import HostDLPack


def _members(protocol) -> dict:
    """name -> the protocol's function (None for a data member), over its bases too."""
    out = {}
    for cls in reversed(protocol.__mro__):
        if cls is object or not getattr(cls, "_is_protocol", False):
            continue
        out.update({n: None for n in getattr(cls, "__annotations__", {})})
        out.update({n: f for n, f in vars(cls).items() if inspect.isfunction(f) and not n.startswith("_")})
    return out


def _params(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def breaches(module: types.ModuleType, protocol) -> list[str]:
    """What ``module`` lacks of ``protocol``, or has with other parameters."""
    out = []
    for name, fn in _members(protocol).items():
        if not hasattr(module, name):
            out.append(f"{module.__name__} has no {name}")
        elif fn is not None and _params(getattr(module, name)) != _params(fn):
            out.append(f"{module.__name__}.{name}{_params(getattr(module, name))}: expected {_params(fn)}")
    return out


ROLES = [(m, contract.Adapter) for m in interop.ADAPTERS.values()] + \
    [(m, contract.RepeatCalls) for m in interop.REPEAT_CALLS.values()] + \
    [(m, contract.CallBuffers) for m in interop.CALLBACK_BUFFERS.values()]


@pytest.mark.parametrize("module, protocol", ROLES, ids=[f"{m.__name__.rsplit('.', 1)[1]}-{p.__name__}" for m, p in ROLES])
def test_every_adapter_has_its_protocols_members(module, protocol):
    assert breaches(module, protocol) == []


def test_the_protocols_cover_what_the_issue_names():
    # conversion, the repeat-call hooks, stream and allocator, the TF32 default and the bf16 view
    assert {"to_cupy", "to_numpy", "from_cupy", "from_numpy", "bfloat16_from_bits", "caller_stream",
            "tf32_default"} <= set(_members(contract.Adapter))
    assert {"signature", "address", "stream_handle", "new_empty", "to_int32", "is_float32", "fill",
            "dtype_name", "NEW_DTYPES"} <= set(_members(contract.RepeatCalls))


def test_a_missing_or_misshaped_member_is_a_breach():
    shallow = types.ModuleType("shallow")
    for name in _members(contract.Adapter):
        setattr(shallow, name, getattr(cupy_arrays, name))
    assert breaches(shallow, contract.Adapter) == []
    del shallow.tf32_default
    shallow.from_cupy = lambda a: a  # on_host missing
    assert breaches(shallow, contract.Adapter) == ["shallow.from_cupy['a']: expected ['a', 'on_host']",
                                                   "shallow has no tf32_default"]


def test_every_adapter_is_registered_under_its_framework():
    assert set(interop.ADAPTERS) == {"numpy", "cupy", "torch", "jax", "dlpack"}
    assert all(m.FRAMEWORK == fw for reg in (interop.ADAPTERS, interop.REPEAT_CALLS, interop.CALLBACK_BUFFERS)
               for fw, m in reg.items())
    assert interop.REPEAT_CALLS == {"torch": torch_tensors, "cupy": cupy_arrays}
    assert interop.CALLBACK_BUFFERS == {"jax": xla_buffers}
    # a resident corpus stands the CuPy call in for host and JAX arrays; the repeat frameworks need none
    assert {fw: m.STAND_IN for fw, m in interop.ADAPTERS.items()} == {
        "numpy": "staged", "jax": "shared", "cupy": None, "torch": None, "dlpack": None}


def test_the_tf32_defaults_of_host_frameworks_and_cupy(monkeypatch):
    assert interop.tf32_default("numpy") is None and interop.tf32_default("dlpack") is None
    monkeypatch.setenv("CUPY_TF32", "1")
    assert interop.tf32_default("cupy") == "tf32"
    monkeypatch.setenv("CUPY_TF32", "0")
    assert interop.tf32_default("cupy") == "fp32"


def test_torch_takes_a_host_bfloat16_result_as_its_bits():
    torch = pytest.importorskip("torch")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a = np.array([[1.5, -2.0], [0.0, 3.25]], ml_dtypes.bfloat16)
    t = interop.from_numpy(a, "torch")
    assert t.dtype == torch.bfloat16 and t.tolist() == [[1.5, -2.0], [0.0, 3.25]]
    assert interop.from_numpy(np.float32(2.0), "torch").shape == ()  # 0-d stays 0-d


def test_gpu_call_picks_the_device_and_holds_the_callers_stream(monkeypatch):
    # the prologue of every public GPU path (lik_cupy._interop.GpuCall), on a stand-in framework
    cupy = pytest.importorskip("cupy")
    events = []

    class Stream:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            events.append(("enter", self.device))

        def __exit__(self, *exc):
            events.append(("exit", self.device, exc[0]))

    fake = types.SimpleNamespace(caller_stream=Stream, from_cupy=lambda a, on_host: ("fake", a, on_host))
    monkeypatch.setitem(interop.ADAPTERS, "fake", fake)
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 7)
    on = types.SimpleNamespace(framework="fake", device=3)
    with interop.GpuCall(on) as g:
        assert (g.device, g.on_host, events) == (3, False, [("enter", 3)])
        assert g.result("s") == ("fake", "s", False)
    assert events[-1] == ("exit", 3, None)
    host = types.SimpleNamespace(framework="fake", device=None)
    assert (interop.GpuCall(host).device, interop.GpuCall(host).on_host) == (7, True)  # the current device
    assert interop.GpuCall(host, 5).device == 5  # a device of the call's own (a Corpus's)
    with pytest.raises(KeyError), interop.GpuCall(host, 5):
        raise KeyError("inside")
    assert events[-1] == ("exit", 5, KeyError)


# Modules whose subject is one framework (or the adapters themselves): they may name it.
_FRAMEWORK_MODULES = ("_interop/", "torch.py", "_torch_autograd.py", "jax.py", "_jax_ops.py", "_jax_xla.py",
                      "integrations/", "_plaid_files.py")  # (_plaid_files reads torch's .pt format, not tensors)


def framework_tests(path) -> list[str]:
    """Where ``path`` compares something with a framework's name (``fw == "torch"``) or keys a table by
    one: knowledge of a framework that belongs in its adapter."""
    import ast

    names = set(interop.ADAPTERS)
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            consts = [c for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in names]
        elif isinstance(node, ast.Dict):
            consts = [k for k in node.keys if isinstance(k, ast.Constant) and k.value in names]
        else:
            continue
        out += [f"{path.name}:{c.lineno} {c.value!r}" for c in consts]
    return out


def test_no_core_module_tests_a_framework_by_name():
    import pathlib

    root = pathlib.Path(interop.__file__).parents[1]
    core = [p for p in sorted(root.rglob("*.py"))
            if not any(str(p.relative_to(root)).startswith(m) for m in _FRAMEWORK_MODULES)]
    assert len(core) > 50
    assert [t for p in core for t in framework_tests(p)] == []


def test_the_framework_name_check_sees_comparisons_and_tables(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('if fw == "torch":\n    pass\nok = fw in ("cupy", "other")\nt = {"jax": 1}\nx = "numpy"\n')
    assert framework_tests(probe) == ["probe.py:1 'torch'", "probe.py:3 'cupy'", "probe.py:4 'jax'"]


def test_a_torch_subclass_from_elsewhere_comes_back_as_torch():
    """The framework of a subclass defined outside torch (here in this test module) by isinstance:
    its results are torch tensors, gradients and bfloat16 included."""
    torch = pytest.importorskip("torch")
    import lik_cupy
    import lik_cupy.torch  # noqa: F401  (the autograd functions)

    class Mine(torch.Tensor):
        pass

    rng = np.random.default_rng(0)
    q = torch.from_numpy(rng.standard_normal((2, 3, 8)).astype(np.float32)).as_subclass(Mine)
    d = torch.from_numpy(rng.standard_normal((4, 5, 8)).astype(np.float32)).as_subclass(Mine)
    s = lik_cupy.maxsim(q, d, backend="cpu")
    assert isinstance(s, torch.Tensor) and s.shape == (2, 4)
    assert torch.equal(torch.as_tensor(s), lik_cupy.maxsim(q.as_subclass(torch.Tensor), d.as_subclass(torch.Tensor),
                                                           backend="cpu"))
    b = lik_cupy.maxsim(q.to(torch.bfloat16), d.to(torch.bfloat16), backend="cpu")
    assert isinstance(b, torch.Tensor)
    qg = q.detach().clone().requires_grad_()
    lik_cupy.torch.maxsim(qg, d).sum().backward()
    assert qg.grad is not None and qg.grad.shape == q.shape


def test_a_torch_negative_bit_view_is_read_as_its_values():
    """``z.conj().imag`` holds its values' negations in memory under torch's negative bit: the CPU
    path scores the values it shows (not torch's error), and its signature keeps it off the repeat
    path, whose kernels would read the memory as it lies."""
    torch = pytest.importorskip("torch")
    import lik_cupy

    rng = np.random.default_rng(0)
    a = torch.from_numpy(rng.standard_normal((2, 3, 8)).astype(np.float32))
    d = torch.from_numpy(rng.standard_normal((4, 5, 8)).astype(np.float32))
    q = torch.complex(torch.zeros_like(a), a).conj().imag
    assert q.is_neg() and torch.equal(q, -a)
    expected = lik_cupy.maxsim(-a, d, backend="cpu")
    assert torch.equal(lik_cupy.maxsim(q, d, backend="cpu"), expected)
    assert torch.equal(lik_cupy.maxsim(d[0], q, backend="cpu"), lik_cupy.maxsim(d[0], -a, backend="cpu"))
    contiguous = torch._neg_view(a.clone())  # (the private route to a C-contiguous one)
    assert contiguous.is_contiguous() and not torch_tensors.signature(contiguous)[4]
    assert torch_tensors.signature(a)[4]


def test_jax_without_x64_refuses_int64_results_it_would_truncate():
    """JAX without 64-bit types (its default) took int64 results as int32 without a word: a CPU corpus's
    ids 2**40 + 1 and 2**33 came back from a JAX query's search as 1 and 0. Such results are now a
    ValueError naming the switch; ids that fit come back as JAX's int32, as before."""
    jax = pytest.importorskip("jax")
    import lik_cupy

    if jax.config.jax_enable_x64:
        pytest.skip("x64 is on in this process")
    rng = np.random.default_rng(0)
    D = rng.standard_normal((3, 5, 8)).astype(np.float32)
    q = jax.numpy.asarray(rng.standard_normal((2, 4, 8)).astype(np.float32))
    wide = lik_cupy.Corpus(D, ids=[2**40 + 1, 2**33, -5], device="cpu")
    with pytest.raises(ValueError, match=r"holds 1099511627777, which JAX .*jax_enable_x64"):
        wide.search(q, 3)
    s, i = lik_cupy.Corpus(D, ids=[7, -2**31, 2**31 - 1], device="cpu").search(q, 3)
    assert i.dtype == np.int32 and set(np.asarray(i).ravel()) == {7, -2**31, 2**31 - 1}
    assert interop.from_numpy(np.array([2**31], np.uint32), "jax").dtype == np.uint32  # (32-bit types as they are)


def test_a_masked_array_with_masked_entries_is_refused():
    """NumPy's masked arrays were read as their data, masked entries included: a query token masked out
    (np.ma) still scored. One whose mask hides something is now a ValueError naming the argument and
    the mask arguments; one that hides nothing is an array like any other."""
    import lik_cupy

    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 8)).astype(np.float32)
    d = rng.standard_normal((3, 5, 8)).astype(np.float32)
    hidden = np.ma.masked_array(q, mask=np.zeros(q.shape, bool))
    hidden[0, 3] = np.ma.masked
    with pytest.raises(ValueError, match=r"^Q: a NumPy masked array with 8 masked entries.*q_mask"):
        lik_cupy.maxsim(hidden, d, backend="cpu")
    lens = np.ma.masked_array([5, 3, 0], mask=[False, True, False])
    with pytest.raises(ValueError, match=r"^d_lengths: a NumPy masked array with 1 masked entry"):
        lik_cupy.maxsim(q, d, d_lengths=lens, backend="cpu")
    want = lik_cupy.maxsim(q, d, backend="cpu")
    assert np.array_equal(lik_cupy.maxsim(np.ma.masked_array(q), np.ma.masked_array(d, mask=False), backend="cpu"), want)


def test_a_dlpack_export_that_fails_is_named():
    """A DLPack producer that cannot export (here a big-endian array) raised its BufferError, which named
    no argument; it is now the TypeError of the argument, with the producer's reason."""
    import lik_cupy

    q = np.ones((2, 3, 4), np.float32)
    assert lik_cupy.maxsim(HostDLPack(q), HostDLPack(q), backend="cpu").shape == (2, 2)
    with pytest.raises(TypeError, match=r"^D: its DLPack export failed \(.*native byte order"):
        lik_cupy.maxsim(HostDLPack(q), HostDLPack(q.astype(">f4")), backend="cpu")
