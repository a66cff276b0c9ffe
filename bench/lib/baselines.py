"""The peers we time against: flash-maxsim 0.3.0 (``flash_maxsim``) and late-interaction-kernels 0.4.5
(``late_interaction_kernels``, LIK), installed from the wheels in ``.whl/`` (``bench/tools/gpu_session.sh``
does it on the device), and PyLate's and colpali-engine's scoring (``load_without_init``). A missing one
is reported, not fatal."""

from __future__ import annotations

import importlib
import importlib.util
import sys

FLASH = "flash_maxsim"
LIK = "late_interaction_kernels"


def load_peers() -> dict:
    """``{"lik": module or None, "flash": module or None}``, printing why a peer did not import."""
    peers = {}
    for key, name in (("lik", LIK), ("flash", FLASH)):
        peers[key], err = load(name)
        if err:
            print(f"{name}: {err}", flush=True)
    return peers


def load(name: str):
    """``(module, None)``, or ``(None, why)`` when ``name`` does not import (the reason as ``repr``, at most 200
    characters)."""
    try:
        return importlib.import_module(name), None
    except Exception as e:  # noqa: BLE001  (not installed, or fails on this machine)
        return None, repr(e)[:200]


def load_without_init(module: str, package: str):
    """``(module, None)``, or ``(None, why)``: ``module`` imported with ``package`` standing as a bare
    package (its path only, its ``__init__.py`` not run). How bench_integrations.py reaches PyLate's and
    colpali-engine's scoring modules on the device, which has their wheels but not the dependencies
    their package ``__init__`` files import (datasets; every colpali-engine model class): pylate.scores
    itself needs only ``pylate.utils.tensor`` (NumPy, torch), colpali_engine.utils.maxsim only torch."""
    try:
        if package not in sys.modules:
            parent = package.rpartition(".")[0]
            if parent:
                importlib.import_module(parent)
            spec = importlib.util.find_spec(package)
            if spec is None or spec.submodule_search_locations is None:
                return None, f"{package} is not installed as a package"
            sys.modules[package] = importlib.util.module_from_spec(spec)
        return importlib.import_module(module), None
    except Exception as e:  # noqa: BLE001  (not installed, or fails on this machine)
        return None, repr(e)[:200]


def packed_calls(torch, q, toks, off):
    """(ours, flash): callables making one call each of ``lik_cupy.maxsim_varlen`` (unchecked
    offsets) and of flash-maxsim's packed kernel (one query: q[0]), each call on the next of the
    packed corpora ``toks`` (CuPy [T, d] copies, so that no call finds its corpus in L2).
    q: CuPy [Nq, Lq, d]; off: CuPy [Nd + 1] offsets shared by every corpus."""
    import lik_cupy

    tq, toff = torch.as_tensor(q, device="cuda"), torch.as_tensor(off, device="cuda")
    ttoks = [torch.as_tensor(t, device="cuda") for t in toks]
    counter = [0]

    def ours():
        counter[0] += 1
        return lik_cupy.maxsim_varlen(q, toks[counter[0] % len(toks)], off, validate_offsets=False)

    def flash():
        import flash_maxsim

        counter[0] += 1
        return flash_maxsim.flash_maxsim(tq[0], ttoks[counter[0] % len(toks)], doc_lengths=toff)

    return ours, flash
