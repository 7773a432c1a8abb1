"""Granite: Llama's layout with config multipliers on the embeddings and the residual branches and a divisor
on the logits (its attention multiplier is the attention module's `scaling`)."""

from __future__ import annotations

from dataclasses import replace

from .llama import LLAMA

ARCHITECTURES = ("GraniteForCausalLM",)
FAMILY = replace(LLAMA, embed_multiplier="embedding_multiplier", residual_multiplier="residual_multiplier",
                 logits_divisor="logits_scaling")
