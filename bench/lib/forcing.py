"""Making lik_cupy pick what a sweep wants to time: a forced configuration, a forced launch plan, a changed
tuning table, an environment variable set for a block.

A name such as ``choose_forward`` may be bound in several of lik_cupy's modules (the dispatch package
re-exports it, a caller may have imported it by name), so ``rebind`` replaces it in every loaded lik_cupy
module that holds the same object, not only in the one named.
"""

from __future__ import annotations

import contextlib
import os
import sys

_MISSING = object()


def rebind(owner, name: str, value):
    """Set ``owner.name`` to ``value``, and ``name`` in every loaded ``lik_cupy`` module that binds the object
    ``owner.name`` held; returns that object (``rebind(owner, name, old)`` puts everything back)."""
    old = getattr(owner, name)
    places = [owner]
    for key, mod in list(sys.modules.items()):
        if (key == "lik_cupy" or key.startswith("lik_cupy.")) and mod is not None and mod is not owner:
            if getattr(mod, "__dict__", {}).get(name, _MISSING) is old:
                places.append(mod)
    for place in places:
        setattr(place, name, value)
    return old


@contextlib.contextmanager
def environment(name: str, value: str | None):
    """Inside the block, the environment variable ``name`` is ``value`` (None: unset); then as it was."""
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def dispatch():
    """lik_cupy's dispatch package (``lik_cupy._dispatch``)."""
    from lik_cupy import _dispatch

    return _dispatch


@contextlib.contextmanager
def forcing(cfg):
    """Inside the block, dispatch picks ``cfg`` (a ``FwdConfig``) for every forward call."""
    d = dispatch()
    chosen = rebind(d, "choose_forward", lambda *a, **k: cfg)
    try:
        yield
    finally:
        rebind(d, "choose_forward", chosen)


def picked(fn):
    """The configuration dispatch picks for ``fn()``'s call (recorded by wrapping choose_forward)."""
    d = dispatch()
    seen = []

    def spy(*a, **k):
        c = chosen(*a, **k)
        seen.append(c)
        return c

    chosen = rebind(d, "choose_forward", spy)
    try:
        fn()
    finally:
        rebind(d, "choose_forward", chosen)
    return seen[-1]


@contextlib.contextmanager
def tables(**values):
    """Inside the block, the tuning tables ``lik_cupy._dispatch.tables`` hold ``values`` (name: value), every
    cached choice dropped on the way in and out; then as they were."""
    d = dispatch()
    old = {name: getattr(d.tables, name) for name in values}
    for name, value in values.items():
        setattr(d.tables, name, value)
    d.clear_caches()
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(d.tables, name, value)
        d.clear_caches()


@contextlib.contextmanager
def padded_split(on: bool):
    """Inside the block, padded documents take the token split (``FwdConfig.strided_tile``) wherever the
    launch plan's grid rule allows it, whatever their length (``on``: ``tables.PADDED_SPLIT_MIN_LD`` set
    aside), or never (``on`` False: whole documents, the reference a split must match)."""
    d = dispatch()
    plan = d.plan_launch
    if on:
        with tables(PADDED_SPLIT_MIN_LD=(1, 1)):
            yield
        return
    rebind(d, "plan_launch", lambda cfg, *a: plan(cfg, *a[:6]) if cfg.strided else plan(cfg, *a))
    try:
        yield
    finally:
        rebind(d, "plan_launch", plan)


def planned(fn):
    """(configuration name, grid + [docs_per_cta, token_split]) of the last forward launch ``fn()`` makes."""
    d = dispatch()
    seen = {}

    def spy(cfg, *a, **k):
        launch = plan(cfg, *a, **k)
        seen.update(cfg=cfg.name, grid=list(launch.grid) + [launch.docs_per_cta, launch.token_split])
        return launch

    plan = rebind(d, "plan_launch", spy)
    try:
        fn()
    finally:
        rebind(d, "plan_launch", plan)
    return seen.get("cfg"), seen.get("grid")
