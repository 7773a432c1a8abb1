"""Llama and the decoders that share its layout exactly (Mistral, Qwen2): the defaults of `Family`, which the
other RoPE families start from. Qwen2's q/k/v biases come along with its projection modules."""

from __future__ import annotations

from .spec import Family

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
LLAMA = Family()
FAMILY = LLAMA
