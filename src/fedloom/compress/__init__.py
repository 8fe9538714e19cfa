"""Compressors with an exact wire encoding."""

from fedloom.compress.base import Compressor, PayloadError
from fedloom.compress.identity import Identity

__all__ = ["Compressor", "Identity", "PayloadError"]
