"""StarCoder / SantaCoder (GPTBigCode): llama.cpp arch `starcoder` (learned absolute positions, no rope).

Multi-query checkpoints (multi_query=true, StarCoder's) fuse c_attn as [all queries; one key; one value],
already llama.cpp's `attn_qkv` layout with one kv head. Multi-head ones (multi_query=false) interleave it
per head ([q, k, v] of head 0, then head 1, ...), so their rows (and bias) are regrouped to [q; k; v] and
the kv head count is the head count (llama.cpp's converter always writes 1, which only fits multi-query).
transformers 5 stores GPTBigCode's linears as nn.Linear ([out, in]): nothing is transposed.
"""

from __future__ import annotations

from .shared import GELU, MASK_BUFFERS, ffn_length, regroup_qkv
from .spec import A, Family, HParams, K, T, derived, refuse_false, require_activation, reshaped, tensor, weight_and_bias

LAYER = "transformer.h.{bid}"


def kv_heads(hp: HParams) -> int:
    return 1 if hp.get("multi_query", True) else hp.n_head


# One group of every query + key + value (multi-query: the identity), or one group per head (multi-head).
# Looked up at call time, so a negative-control test can replace regroup_qkv.
QKV = reshaped("bigcode_qkv", lambda w, hp: regroup_qkv(w, kv_heads(hp), hp.n_head // kv_heads(hp), hp.head_dim))


def _check(hp: HParams) -> None:
    refuse_false(hp, "starcoder", "scale_attn_weights", "llama.cpp scales attention by 1/sqrt(head_dim)")
    require_activation(hp, "starcoder", GELU, "llama.cpp's starcoder runs a GELU MLP", key="activation_function")


FAMILY = Family(
    name="starcoder",
    gguf_arch="starcoder",
    architectures=("GPTBigCodeForCausalLM",),
    tensors=(
        tensor(T.TOKEN_EMBD, "transformer.wte.weight"),
        tensor(T.POS_EMBD, "transformer.wpe.weight"),
        *weight_and_bias(T.OUTPUT_NORM, "transformer.ln_f"),
        tensor(T.OUTPUT, "lm_head.weight", optional=True),  # absent when tied (the default)
        *weight_and_bias(T.ATTN_NORM, LAYER + ".ln_1"),
        *weight_and_bias(T.ATTN_QKV, LAYER + ".attn.c_attn", QKV),
        *weight_and_bias(T.ATTN_OUT, LAYER + ".attn.c_proj"),
        *weight_and_bias(T.FFN_NORM, LAYER + ".ln_2"),
        *weight_and_bias(T.FFN_UP, LAYER + ".mlp.c_fc"),
        *weight_and_bias(T.FFN_DOWN, LAYER + ".mlp.c_proj"),
    ),
    params=(
        derived(K.CONTEXT_LENGTH, lambda hp: hp.find("n_positions", "max_position_embeddings")),
        derived(K.FEED_FORWARD_LENGTH, ffn_length),
        derived(A.HEAD_COUNT_KV, kv_heads),
    ),
    rope=False,
    ignored=MASK_BUFFERS,
    check=_check,
    block_prefix="transformer.h",
)
