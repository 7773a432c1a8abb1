"""Nemotron / Minitron (NemotronForCausalLM): llama.cpp arch `nemotron`.

- Norms are "LayerNorm1P": a LayerNorm with a bias whose weight is stored as w where the model scales by
  1 + w, so PLUS_ONE on every norm weight (not on the biases), and the LayerNorm eps
  (`attention.layer_norm_epsilon`, from `norm_eps`). No RMS norm exists, so the generic RMS eps key that
  `norm_eps` would also give is dropped.
- The MLP is up -> relu(x)^2 -> down, without a gate; biases on it and on the attention projections
  (`mlp_bias`, `attention_bias`) are optional in llama.cpp and written when present.
- The rope rotates halves (NEOX), as HF stores them, so nothing is permuted; it rotates only
  `partial_rotary_factor` of each head (transformers' default for Nemotron is 0.5, not 1), which is the
  rope dimension count.
llama.cpp's nemotron needs its own output matrix, sizes the attention output as [hidden, hidden] and takes
no rope factor tensor: tied embeddings, a head_dim that does not divide the hidden size evenly and llama3
rope scaling are refused.
"""

from __future__ import annotations

from .shared import LAYER, RELU2_MLP, ROTARY_BUFFERS, attention
from .spec import (
    IDENTITY,
    PLUS_ONE,
    A,
    Family,
    HParams,
    K,
    R,
    T,
    derived,
    param,
    refuse_rope,
    refuse_true,
    require_activation,
    require_whole_heads,
    tensor,
    weight_and_bias,
)

DEFAULT_ROTARY_FACTOR = 0.5  # NemotronConfig's default when a config does not say


def rotary_factor(hp: HParams) -> float:
    """The config's partial_rotary_factor (in rope_parameters, rope_scaling or at the top), else Nemotron's 0.5."""
    for where in (hp.get("rope_parameters"), hp.get("rope_scaling"), hp.cfg):
        if isinstance(where, dict) and where.get("partial_rotary_factor") is not None:
            return float(where["partial_rotary_factor"])
    return DEFAULT_ROTARY_FACTOR


def _check(hp: HParams) -> None:
    refuse_true(hp, "nemotron", "tie_word_embeddings", "llama.cpp's nemotron needs its own output matrix")
    require_activation(hp, "nemotron", "relu2", "llama.cpp's nemotron runs a squared-ReLU MLP")
    refuse_rope(hp, "nemotron")
    require_whole_heads(hp, "nemotron")


RELU2_MLP_BIASES = (
    tensor(T.FFN_UP, LAYER + ".mlp.up_proj.bias", suffix="bias", optional=True),
    tensor(T.FFN_DOWN, LAYER + ".mlp.down_proj.bias", suffix="bias", optional=True),
)


def _norm(t: T, hf: str):
    return weight_and_bias(t, hf, PLUS_ONE, bias_transform=IDENTITY)


FAMILY = Family(
    name="nemotron",
    gguf_arch="nemotron",
    architectures=("NemotronForCausalLM",),
    tensors=(
        tensor(T.TOKEN_EMBD, "model.embed_tokens.weight"),
        *_norm(T.OUTPUT_NORM, "model.norm"),
        tensor(T.OUTPUT, "lm_head.weight"),
        *_norm(T.ATTN_NORM, LAYER + ".input_layernorm"),
        *_norm(T.FFN_NORM, LAYER + ".post_attention_layernorm"),
    ) + attention(q=IDENTITY, k=IDENTITY) + RELU2_MLP + RELU2_MLP_BIASES,
    params=(
        param(K.VOCAB_SIZE, "vocab_size", required=True),
        derived(R.DIMENSION_COUNT, lambda hp: int(hp.head_dim * rotary_factor(hp))),
        param(A.LAYERNORM_EPS, "norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon", kind=float,
              required=True),
        derived(A.LAYERNORM_RMS_EPS, lambda hp: None, kind=float),  # drops GENERIC's (from norm_eps)
    ),
    ignored=ROTARY_BUFFERS,
    check=_check,
)
