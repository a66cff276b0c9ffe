"""Reversible attribute replacement, shared by ``patch_pylate`` and ``patch_colpali_engine``."""

from __future__ import annotations

import importlib
import threading

__all__ = ["Patches", "Patched", "swap", "SwappedProperty", "SwappedAttribute"]


class Patches:
    """Attribute replacements on modules and classes, each undone exactly: an attribute the owner
    held itself gets its old value back, one it inherited (or lacked) is deleted again.
    ``originals`` holds what the patch set aside (the library's own functions), while it is active.
    Patching and undoing are serialised: threads entering ``patch_*()`` at once once both applied
    it, the second setting aside the first's replacements as the library's own. The patch is
    process-wide, not per thread."""

    def __init__(self):
        self._saved = []  # (owner, name, had its own attribute, the old value)
        self.originals: dict = {}
        self._lock = threading.RLock()

    @property
    def active(self) -> bool:
        return bool(self._saved)

    def patch(self, apply) -> Patched:
        """Run ``apply`` (which calls ``set``) unless the patch is already in place; a failure
        half way undoes what it did. Returns the handle ``patch_*()`` hands back."""
        with self._lock:
            was_active = self.active
            if not was_active:
                try:
                    apply()
                except BaseException:
                    self.undo()
                    raise
        return Patched(self.undo, was_active)

    def set(self, owner, name: str, value) -> None:
        own = vars(owner)
        self._saved.append((owner, name, name in own, own.get(name)))
        setattr(owner, name, value)

    def set_globals(self, module: str, originals: dict, replacements: dict) -> None:
        """In ``module``, every name of ``replacements`` still bound to its entry in ``originals``
        (the module's own copy of ``from ... import name``) gets its replacement."""
        mod = importlib.import_module(module)
        for name, value in replacements.items():
            if vars(mod).get(name) is originals[name]:
                self.set(mod, name, value)

    def undo(self) -> None:
        with self._lock:
            saved, self._saved = self._saved, []
            for owner, name, had, old in reversed(saved):
                if had:
                    setattr(owner, name, old)
                elif name in vars(owner):
                    delattr(owner, name)
            self.originals.clear()


class Patched:
    """What ``patch_*()`` returns: also a context manager, whose exit undoes the patch unless it was
    already in place when the ``with`` began."""

    def __init__(self, undo, was_active: bool):
        self._undo, self._was_active = undo, was_active

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if not self._was_active:
            self._undo()
        return False


def swap(value, table: dict):
    """``table[value]`` when ``value`` is one of its keys, else ``value`` (unhashable values too)."""
    try:
        return table.get(value, value)
    except TypeError:
        return value


class SwappedProperty(property):
    """A read-only property that reads the inherited property ``base`` and hands back
    ``table``'s replacement of what it found (a model's stored similarity function)."""

    def __init__(self, base: property, table: dict):
        super().__init__(lambda obj: swap(base.fget(obj), table), doc=base.__doc__)


class SwappedAttribute:
    """A data descriptor over an instance attribute (an object's stored score function): reads
    hand back ``table``'s replacement, writes store what they are given, deletions remove it. Being
    a data descriptor it wins over the instance's own ``__dict__`` entry, so objects made before the
    patch are covered too."""

    def __init__(self, name: str, table: dict):
        self.name, self.table = name, table

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        try:
            value = obj.__dict__[self.name]
        except KeyError:
            raise AttributeError(f"{type(obj).__name__!r} object has no attribute {self.name!r}") from None
        return swap(value, self.table)

    def __set__(self, obj, value):
        obj.__dict__[self.name] = value

    def __delete__(self, obj):
        try:
            del obj.__dict__[self.name]
        except KeyError:
            raise AttributeError(f"{type(obj).__name__!r} object has no attribute {self.name!r}") from None
