"""Falcon: llama.cpp arch `falcon` (NEOX rope, attention and MLP in parallel, no biases).

HF's fused query_key_value is grouped per kv head: each group holds its queries, then its key, then its
value (new decoder architecture, Falcon-40B/180B: num_kv_heads groups; the old multi-query layout,
Falcon-7B: one group of every query + one key + one value; old multi-head: one group per head).
llama.cpp's `attn_qkv` wants all queries, then all keys, then all values, so the rows are regrouped, as
llama.cpp's converter does ("jploski" layout). The new architecture has two norms, `ln_attn` before
attention (llama.cpp's attn_norm_2) and `ln_mlp` before the MLP (attn_norm); the others share one
`input_layernorm`. llama.cpp has no Falcon biases, ALiBi or sequential (parallel_attn=false) blocks:
those configs are refused.
"""

from __future__ import annotations

from ....core.errors import ModelFormatError
from .shared import GELU, ROTARY_BUFFERS, regroup_qkv
from .spec import (
    A,
    Family,
    HParams,
    K,
    Rule,
    T,
    derived,
    refuse_false,
    refuse_true,
    require_activation,
    reshaped,
    tensor,
    weight_and_bias,
)

LAYER = "transformer.h.{bid}"


def kv_heads(hp: HParams) -> int:
    """Key/value heads as HF's FalconAttention has them."""
    if hp.get("new_decoder_architecture"):
        return int(hp.find("num_kv_heads", "n_head_kv", default=hp.n_head))
    return 1 if hp.get("multi_query", True) else hp.n_head


def two_norms(hp: HParams, bid: int | None = None) -> bool:
    return bool(hp.get("new_decoder_architecture")) and int(hp.get("num_ln_in_parallel_attn") or 2) == 2


# Looked up at call time, so a negative-control test can replace regroup_qkv.
QKV = reshaped("falcon_qkv", lambda w, hp: regroup_qkv(w, kv_heads(hp), hp.n_head // kv_heads(hp), hp.head_dim))


def _check(hp: HParams) -> None:
    refuse_true(hp, "falcon", "alibi", "llama.cpp's falcon uses rotary positions")
    refuse_true(hp, "falcon", "bias", "llama.cpp's falcon has no linear biases")
    if not hp.get("new_decoder_architecture"):  # the new layout is always parallel, whatever parallel_attn says
        refuse_false(hp, "falcon", "parallel_attn", "llama.cpp's falcon runs attention and MLP in parallel")
    if hp.n_head % kv_heads(hp):
        raise ModelFormatError(f"falcon with {hp.n_head} heads cannot share {kv_heads(hp)} kv heads")
    require_activation(hp, "falcon", GELU, "llama.cpp's falcon runs a GELU MLP", key="activation")


def _not_two_norms(hp: HParams, bid: int) -> bool:
    return not two_norms(hp)


def _norm(t, hf: str, when) -> tuple[Rule, ...]:
    return tuple(tensor(t, f"{LAYER}.{hf}.{suffix}", suffix=suffix, when=when) for suffix in ("weight", "bias"))


FAMILY = Family(
    name="falcon",
    gguf_arch="falcon",
    architectures=("FalconForCausalLM",),
    tensors=(
        tensor(T.TOKEN_EMBD, "transformer.word_embeddings.weight"),
        *weight_and_bias(T.OUTPUT_NORM, "transformer.ln_f"),
        tensor(T.OUTPUT, "lm_head.weight", optional=True),  # absent when tied (the default)
        *_norm(T.ATTN_NORM, "ln_mlp", two_norms),  # llama.cpp feeds attn_norm to the MLP
        *_norm(T.ATTN_NORM_2, "ln_attn", two_norms),  # and attn_norm_2, when present, to attention
        *_norm(T.ATTN_NORM, "input_layernorm", _not_two_norms),
        tensor(T.ATTN_QKV, LAYER + ".self_attention.query_key_value.weight", QKV),
        tensor(T.ATTN_OUT, LAYER + ".self_attention.dense.weight"),
        tensor(T.FFN_UP, LAYER + ".mlp.dense_h_to_4h.weight"),
        tensor(T.FFN_DOWN, LAYER + ".mlp.dense_4h_to_h.weight"),
    ),
    params=(
        derived(A.HEAD_COUNT_KV, kv_heads),
        derived(K.FEED_FORWARD_LENGTH, lambda hp: hp.find("ffn_hidden_size", default=4 * hp.hidden)),
        derived(K.TENSOR_DATA_LAYOUT, lambda hp: "jploski", kind=str),  # the regrouped qkv, as llama.cpp names it
    ),
    ignored=ROTARY_BUFFERS + (r"transformer\.rotary_emb\.inv_freq",
                              r"transformer\.h\.\d+\.self_attention\.rotary_emb\.inv_freq"),
    check=_check,
    block_prefix="transformer.h",
)
