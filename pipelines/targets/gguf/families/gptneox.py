"""GPT-NeoX (Pythia, ...): llama.cpp arch `gptneox` (NEOX rope on part of each head, biases everywhere).

HF's fused query_key_value is interleaved per head ([q, k, v] of head 0, then of head 1, ...); llama.cpp's
`attn_qkv` wants all queries, then all keys, then all values, so its rows (and its bias) are regrouped,
as llama.cpp's converter does. Only `rotary_pct` (transformers 5: `partial_rotary_factor`) of each head
is rotated: that is the rope dimension count. `use_parallel_residual` (x + attn(ln1 x) + mlp(ln2 x), the
default) or sequential blocks are both llama.cpp graphs, chosen by the key of the same name.
"""

from __future__ import annotations

from .shared import GELU, regroup_qkv
from .spec import (
    Family,
    HParams,
    K,
    R,
    T,
    derived,
    refuse_false,
    refuse_true,
    require_activation,
    reshaped,
    tensor,
    weight_and_bias,
)

LAYER = "gpt_neox.layers.{bid}"


def rotary_factor(hp: HParams) -> float:
    """The rotated fraction of a head: transformers 5's rope_parameters, or the older top-level spellings."""
    params = hp.get("rope_parameters") or {}
    for value in (params.get("partial_rotary_factor"), hp.get("partial_rotary_factor"), hp.get("rotary_pct")):
        if value is not None:
            return float(value)
    return 1.0


# Looked up at call time, so a negative-control test can replace regroup_qkv.
QKV = reshaped("neox_qkv", lambda w, hp: regroup_qkv(w, hp.n_head, 1, hp.head_dim))


def _check(hp: HParams) -> None:
    refuse_false(hp, "gptneox", "attention_bias", "llama.cpp's gptneox needs the qkv and output biases")
    refuse_true(hp, "gptneox", "tie_word_embeddings", "llama.cpp's gptneox needs its own output matrix (embed_out)")
    require_activation(hp, "gptneox", GELU, "llama.cpp's gptneox runs a GELU MLP")


FAMILY = Family(
    name="gptneox",
    gguf_arch="gptneox",
    architectures=("GPTNeoXForCausalLM",),
    tensors=(
        tensor(T.TOKEN_EMBD, "gpt_neox.embed_in.weight"),
        *weight_and_bias(T.OUTPUT_NORM, "gpt_neox.final_layer_norm"),
        tensor(T.OUTPUT, "embed_out.weight"),
        *weight_and_bias(T.ATTN_NORM, LAYER + ".input_layernorm"),
        *weight_and_bias(T.ATTN_QKV, LAYER + ".attention.query_key_value", QKV),
        *weight_and_bias(T.ATTN_OUT, LAYER + ".attention.dense"),
        *weight_and_bias(T.FFN_NORM, LAYER + ".post_attention_layernorm"),
        *weight_and_bias(T.FFN_UP, LAYER + ".mlp.dense_h_to_4h"),
        *weight_and_bias(T.FFN_DOWN, LAYER + ".mlp.dense_4h_to_h"),
    ),
    params=(
        derived(R.DIMENSION_COUNT, lambda hp: int(rotary_factor(hp) * hp.head_dim)),
        derived(K.USE_PARALLEL_RESIDUAL, lambda hp: hp.get("use_parallel_residual", True), kind=bool),
    ),
    # old checkpoints' causal-mask buffers and rotary tables are not weights
    ignored=(r"gpt_neox\.layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)",
             r"gpt_neox\.rotary_emb\.inv_freq"),
    check=_check,
    tied_output=None,  # never tied (refused): embed_out is always written
    block_prefix="gpt_neox.layers",
)
