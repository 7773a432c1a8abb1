"""Phi-1.5 / Phi-2 (PhiForCausalLM): llama.cpp arch `phi2`.

One LayerNorm feeds attention and MLP in parallel (x + attn(ln x) + mlp(ln x)); q/k/v stay separate
tensors with biases (llama.cpp's phi2 takes attn_q/k/v or a fused attn_qkv; its converter keeps HF's
separate ones), `dense` is the biased output projection, `final_layernorm` has a bias and so has
lm_head (llama.cpp's `output.bias`). Only partial_rotary_factor of each head is rotated, NEOX style as
in HF, so nothing is permuted: the rope dimension count says how many. llama.cpp has no Q/K layer norms
and needs its own output matrix, so qk_layernorm and tied embeddings are refused.
"""

from __future__ import annotations

from .shared import GELU, LAYER, ROTARY_BUFFERS
from .spec import Family, HParams, R, T, derived, refuse_true, require_activation, rotary_dims, tensor, weight_and_bias


def _check(hp: HParams) -> None:
    refuse_true(hp, "phi2", "qk_layernorm", "llama.cpp's phi2 has no Q/K norms")
    refuse_true(hp, "phi2", "tie_word_embeddings", "llama.cpp's phi2 needs its own output matrix and bias")
    require_activation(hp, "phi2", GELU, "llama.cpp's phi2 runs a GELU MLP")


FAMILY = Family(
    name="phi2",
    gguf_arch="phi2",
    architectures=("PhiForCausalLM",),
    tensors=(
        tensor(T.TOKEN_EMBD, "model.embed_tokens.weight"),
        *weight_and_bias(T.OUTPUT_NORM, "model.final_layernorm"),
        *weight_and_bias(T.OUTPUT, "lm_head"),
        *weight_and_bias(T.ATTN_NORM, LAYER + ".input_layernorm"),
        *weight_and_bias(T.ATTN_Q, LAYER + ".self_attn.q_proj"),
        *weight_and_bias(T.ATTN_K, LAYER + ".self_attn.k_proj"),
        *weight_and_bias(T.ATTN_V, LAYER + ".self_attn.v_proj"),
        *weight_and_bias(T.ATTN_OUT, LAYER + ".self_attn.dense"),
        *weight_and_bias(T.FFN_UP, LAYER + ".mlp.fc1"),
        *weight_and_bias(T.FFN_DOWN, LAYER + ".mlp.fc2"),
    ),
    params=(derived(R.DIMENSION_COUNT, rotary_dims),),
    ignored=ROTARY_BUFFERS,
    check=_check,
    tied_output=None,  # never tied (refused): lm_head is always written
)
