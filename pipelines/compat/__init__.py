"""Compatibility: which backend serves a model, and which of our recipes can build it."""

from .check import Check, Compatibility, classify, classify_snapshot

__all__ = ["Check", "Compatibility", "classify", "classify_snapshot"]
