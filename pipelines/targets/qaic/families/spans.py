"""Attention spans: which cache slots j <= p a token at position p also sees beyond causality, per layer. The
decoder engine (decoder.py) builds one mask per distinct span from `visible(slots, pos)`; a family's config says
which layers have which span (config.layer_types), its declaration which config attributes size them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SlidingWindow:
    """The last `size` positions: p - j < size (Mistral-style sliding windows)."""

    size: int

    def visible(self, slots, pos):
        return slots > pos - self.size


@dataclass(frozen=True)
class AttentionChunk:
    """Only the token's own chunk of `size` positions: j // size == p // size (Llama 4's chunked layers)."""

    size: int

    def visible(self, slots, pos):
        return slots // self.size == pos // self.size


def attention_spans(cfg, fam, n: int) -> list:
    """Each layer's attention span beyond causality (None: the whole past), from config.layer_types: the
    config's sliding window on "sliding_attention" layers (every layer without layer_types), the family's chunk
    on "chunked_attention" layers."""
    window = getattr(cfg, "sliding_window", None) if fam.sliding else None
    chunk = getattr(cfg, fam.chunk, None) if fam.chunk else None
    types = getattr(cfg, "layer_types", None)

    def span(i):
        kind = types[i] if types is not None else None
        if chunk and kind == "chunked_attention":
            return AttentionChunk(int(chunk))
        if window and kind in (None, "sliding_attention"):
            return SlidingWindow(int(window))
        return None

    return [span(i) for i in range(n)]
