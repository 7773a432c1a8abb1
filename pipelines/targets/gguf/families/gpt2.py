"""GPT-2: llama.cpp arch `gpt2` (learned absolute positions, no rope).

HF keeps GPT-2's linears as `Conv1D` modules whose weights are stored [in, out]: every matrix of a block
(c_attn, c_proj, mlp.c_fc, mlp.c_proj) is transposed to llama.cpp's [out, in]; their biases are not.
c_attn is already the fused [q; k; v] that llama.cpp's `attn_qkv` wants. Old checkpoints carry the causal
mask buffers `attn.bias` / `attn.masked_bias`, which llama.cpp's converter drops too. The blocks live under
`transformer.h`, the output is tied to `transformer.wte` (lm_head.weight is dropped when tied).
"""

from __future__ import annotations

from .shared import GELU, MASK_BUFFERS, ffn_length
from .spec import (
    IDENTITY,
    TRANSPOSE,
    Family,
    HParams,
    K,
    T,
    derived,
    refuse_false,
    refuse_true,
    require_activation,
    tensor,
    weight_and_bias,
)

LAYER = "transformer.h.{bid}"


def _check(hp: HParams) -> None:
    refuse_true(hp, "gpt2", "scale_attn_by_inverse_layer_idx",
                "llama.cpp scales every layer's attention by 1/sqrt(head_dim)")
    refuse_false(hp, "gpt2", "scale_attn_weights", "llama.cpp scales attention by 1/sqrt(head_dim)")
    require_activation(hp, "gpt2", GELU, "llama.cpp's gpt2 runs a GELU MLP", key="activation_function")


def conv1d(t, hf_prefix: str):
    """A Conv1D linear: weight transposed from [in, out], bias as it is."""
    return weight_and_bias(t, hf_prefix, TRANSPOSE, bias_transform=IDENTITY)


FAMILY = Family(
    name="gpt2",
    gguf_arch="gpt2",
    architectures=("GPT2LMHeadModel",),
    tensors=(
        tensor(T.TOKEN_EMBD, "transformer.wte.weight"),
        tensor(T.POS_EMBD, "transformer.wpe.weight"),
        *weight_and_bias(T.OUTPUT_NORM, "transformer.ln_f"),
        tensor(T.OUTPUT, "lm_head.weight", optional=True),  # absent when tied (the default)
        *weight_and_bias(T.ATTN_NORM, LAYER + ".ln_1"),
        *conv1d(T.ATTN_QKV, LAYER + ".attn.c_attn"),
        *conv1d(T.ATTN_OUT, LAYER + ".attn.c_proj"),
        *weight_and_bias(T.FFN_NORM, LAYER + ".ln_2"),
        *conv1d(T.FFN_UP, LAYER + ".mlp.c_fc"),
        *conv1d(T.FFN_DOWN, LAYER + ".mlp.c_proj"),
    ),
    params=(
        # the position table has n_positions rows; llama.cpp sizes position_embd by the context length
        derived(K.CONTEXT_LENGTH, lambda hp: hp.find("n_positions", "n_ctx", "max_position_embeddings")),
        derived(K.FEED_FORWARD_LENGTH, ffn_length),
    ),
    rope=False,
    ignored=MASK_BUFFERS,
    check=_check,
    block_prefix="transformer.h",
)
