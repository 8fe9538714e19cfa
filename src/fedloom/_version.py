"""The package version (a leaf module: what reports its version imports only this)."""

__version__ = "0.1.0"
