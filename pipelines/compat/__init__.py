"""Compatibility: which backend serves a model, and which of our recipes can build it."""

from .check import classify, classify_snapshot
from .results import Check, Compatibility

__all__ = ["Check", "Compatibility", "classify", "classify_snapshot"]
