"""Names that moved in 0.2 and keep working, with a ``DeprecationWarning``, until the next release.

Old modules (``lik_cupy.dispatch``, ``lik_cupy.compile``, ...) are served by an import hook that
hands out their new home; old attributes of the package (``lik_cupy.dispatch``) by the package's
``__getattr__``. Nothing here is imported unless an old name is used.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old module -> new module
MODULES = {
    "lik_cupy.dispatch": "lik_cupy._dispatch",
    "lik_cupy.compile": "lik_cupy._runtime.nvrtc",
    "lik_cupy.device": "lik_cupy._base.device",
    "lik_cupy.checks": "lik_cupy._runtime.device_checks",
    "lik_cupy.masks": "lik_cupy._runtime.masks",
    "lik_cupy.tma": "lik_cupy._runtime.tma",
    "lik_cupy.token_split": "lik_cupy._runtime.token_split",
    "lik_cupy.pinned": "lik_cupy._runtime.pinned",
    "lik_cupy.warmup": "lik_cupy._runtime.warmup",
    "lik_cupy.interop": "lik_cupy._interop",
    "lik_cupy.validate": "lik_cupy._validate",
    "lik_cupy.cpu": "lik_cupy._cpu",
}


def warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; the old name goes in the next release", DeprecationWarning, stacklevel=3)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name in MODULES:
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        new = MODULES[spec.name]
        warn(spec.name, new)
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__  # the import system stamps ``spec`` on the module next
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state  # give the module its own spec back


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())


def attribute(name: str):
    """``lik_cupy.<name>`` for an old submodule name, or raise AttributeError."""
    old = f"lik_cupy.{name}"
    if old not in MODULES:
        raise AttributeError(f"module 'lik_cupy' has no attribute {name!r}")
    install()
    return importlib.import_module(old)
