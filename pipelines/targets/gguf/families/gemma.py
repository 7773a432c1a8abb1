"""Gemma (GemmaForCausalLM): llama.cpp arch `gemma`, the Llama layout with three differences in meaning.

- Gemma's RMS norms scale by (1 + w) and store w: every norm is written as 1 + w (PLUS_ONE), the weight
  llama.cpp's plain RMS norm multiplies by.
- The embeddings are multiplied by sqrt(hidden_size) on the way in: llama.cpp's gemma graph does that
  itself, so token_embd is stored as it is. It is also the output matrix: llama.cpp's gemma has none of its
  own (its converter drops lm_head), so an untied Gemma is refused.
- The rope rotates halves (NEOX), as HF stores them, so Q and K are not permuted; head_dim is its own
  setting (Gemma 7B: 256 with hidden 3072 / 16 heads) and is written as the key/value length.
The MLP is GELU-gated (the tanh approximation in both). llama.cpp's gemma has no attention biases.
The checks here are shared by Gemma 2 and 3.
"""

from __future__ import annotations

from .shared import GELU, LAYER, ROTARY_BUFFERS, SWIGLU, attention
from .spec import IDENTITY, PLUS_ONE, Family, HParams, T, refuse_false, refuse_rope, refuse_true, require_activation, tensor

ARCHITECTURES = ("GemmaForCausalLM",)

EMBEDDINGS = (
    tensor(T.TOKEN_EMBD, "model.embed_tokens.weight"),
    tensor(T.OUTPUT_NORM, "model.norm.weight", PLUS_ONE),
    tensor(T.OUTPUT, "lm_head.weight", optional=True),  # only ever a tied copy (untied is refused): dropped
)
ATTENTION = attention(q=IDENTITY, k=IDENTITY)


def check_gemma(hp: HParams, arch: str, activation_key: str, rope_types: tuple[str, ...], *,
                tied_only: bool = True) -> None:
    """What the llama.cpp graphs of Gemma 1-3 cannot run (Gemma 3 alone may have an output matrix)."""
    if tied_only:
        refuse_false(hp, arch, "tie_word_embeddings", f"llama.cpp's {arch} uses token_embd as its output matrix")
    refuse_true(hp, arch, "attention_bias", f"llama.cpp's {arch} has no attention biases")
    refuse_true(hp, arch, "use_bidirectional_attention", "that is an embedding model, and llama.cpp runs it causally")
    refuse_rope(hp, arch, rope_types)
    require_activation(hp, arch, GELU, f"llama.cpp's {arch} runs a GELU MLP", key=activation_key)


FAMILY = Family(
    name="gemma",
    gguf_arch="gemma",
    architectures=ARCHITECTURES,
    tensors=EMBEDDINGS + (
        tensor(T.ATTN_NORM, LAYER + ".input_layernorm.weight", PLUS_ONE),
        tensor(T.FFN_NORM, LAYER + ".post_attention_layernorm.weight", PLUS_ONE),
    ) + ATTENTION + SWIGLU,
    ignored=ROTARY_BUFFERS,
    check=lambda hp: check_gemma(hp, "gemma", "hidden_act", ("default", "linear", "yarn")),
)
