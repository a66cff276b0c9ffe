"""The runtime's base, below every other private package: every environment variable (``env``),
devices, streams and named allocations (``device``) and the per-device caches (``cache``). It
imports nothing of the package but ``errors``."""
