"""The package version (the root re-exports it; the kernel cache keys on it)."""

__version__ = "0.1.0"
