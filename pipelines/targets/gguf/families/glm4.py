"""GLM-4 (Glm4ForCausalLM, GLM-4-9B/32B-0414): llama.cpp arch `glm4`.

- Four RMS norms per block, "sandwich" style: `input_layernorm` before attention (attn_norm),
  `post_self_attn_layernorm` on the attention output (attn_post_norm), `post_attention_layernorm` before
  the MLP (ffn_norm: in GLM-4 it is the pre-MLP norm, as in Llama), `post_mlp_layernorm` on the MLP output
  (ffn_post_norm); both post-norms apply before their residual add, in HF and llama.cpp alike.
- q/k/v carry biases (`attention_bias`, true by default), o_proj none.
- A partial rope: only the first head_dim * partial_rotary_factor dimensions of each head rotate, in
  interleaved pairs (HF's GLM rotate_half), which is llama.cpp's NORM rope for glm4 with
  `rope.dimension_count` set to that: Q and K are stored as they are. transformers' default factor for
  glm4 is 0.5 (a config may omit it; the generic default of 1.0 would rotate every dimension).
- `mlp.gate_up_proj` is [gate; up], which llama.cpp's glm4 reads as one `ffn_up` of 2 x n_ff rows
  (SwiGLU on its halves), so it is kept fused, as for Phi-3.
- The output matrix is `lm_head` or, tied, token_embd (llama.cpp falls back to it).

Refused: multimodal M-RoPE sections (GLM-4V: this is the text model; no rope.dimension_sections is written),
rope scalings llama.cpp cannot reproduce here, and another activation than SiLU.
"""

from __future__ import annotations

from ....core.errors import ModelFormatError
from .shared import EMBEDDINGS, LAYER, ROTARY_BUFFERS, attention
from .spec import IDENTITY, Family, HParams, K, R, T, derived, param, refuse_rope, require_activation, tensor

DEFAULT_ROTARY_FACTOR = 0.5  # Glm4Config's default partial_rotary_factor


def rotary_factor(hp: HParams) -> float:
    """partial_rotary_factor from rope_parameters / rope_scaling / the config, else transformers' glm4 default."""
    for key in ("rope_parameters", "rope_scaling"):
        value = hp.get(key)
        if isinstance(value, dict) and value.get("partial_rotary_factor") is not None:
            return float(value["partial_rotary_factor"])
    return float(hp.get("partial_rotary_factor", DEFAULT_ROTARY_FACTOR))


def rotary_dims(hp: HParams) -> int:
    return int(hp.head_dim * rotary_factor(hp))


def _check(hp: HParams) -> None:
    rope = hp.rope
    if rope.get("mrope_section") is not None:
        raise ModelFormatError("glm4 GGUF with mrope_section (GLM-4V M-RoPE) is not supported: the text model's "
                               "rope is written without dimension sections")
    refuse_rope(hp, "glm4", ("default", "linear"))
    require_activation(hp, "glm4", "silu", "llama.cpp's glm4 runs a SwiGLU MLP")
    if rotary_dims(hp) % 2 or not 0 < rotary_dims(hp) <= hp.head_dim:
        raise ModelFormatError(f"glm4 GGUF needs an even rotary dimension count in 2..head_dim, config gives "
                               f"{rotary_dims(hp)}")


FAMILY = Family(
    name="glm4",
    gguf_arch="glm4",
    architectures=("Glm4ForCausalLM",),
    tensors=EMBEDDINGS + (
        tensor(T.ATTN_NORM, LAYER + ".input_layernorm.weight"),
        *attention(q=IDENTITY, k=IDENTITY),
        tensor(T.ATTN_POST_NORM, LAYER + ".post_self_attn_layernorm.weight"),
        tensor(T.FFN_NORM, LAYER + ".post_attention_layernorm.weight"),
        tensor(T.FFN_UP, LAYER + ".mlp.gate_up_proj.weight"),  # [gate; up]: llama.cpp's glm4 splits it
        tensor(T.FFN_DOWN, LAYER + ".mlp.down_proj.weight"),
        tensor(T.FFN_POST_NORM, LAYER + ".post_mlp_layernorm.weight"),
    ),
    params=(
        param(K.VOCAB_SIZE, "vocab_size", required=True),
        derived(R.DIMENSION_COUNT, rotary_dims),
    ),
    ignored=ROTARY_BUFFERS,
    check=_check,
)
