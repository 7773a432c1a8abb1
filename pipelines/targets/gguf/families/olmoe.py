"""OLMoE (OlmoeForCausalLM, OLMoE-1B-7B): llama.cpp arch `olmoe`.

The Llama block with NEOX rope (HF rotates halves, as llama.cpp's olmoe does: nothing permuted), RMS norms
of the whole projected queries and keys before the rope (`q_norm` / `k_norm`, [heads x head_dim], not per
head: llama.cpp's olmoe normalizes the flat {n_embd} vectors the same way), and a routed MoE MLP on every
layer: per-expert `mlp.experts.{xid}.gate_proj/up_proj/down_proj` (as checkpoints and transformers 5's
`save_pretrained` write them) stacked into [experts, rows, cols], the router `mlp.gate` as `ffn_gate_inp`.

llama.cpp's olmoe graph never renormalizes the top-k weights (softmax over all experts, then top-k), as
OLMoE's `norm_topk_prob=false`; it loads `k_norm` as {n_embd}, so grouped-query attention (a narrower
k_norm) cannot load; its output matrix is required (no tied fallback); it has no attention biases and no
qkv clipping. Those configs are refused in one line.
"""

from __future__ import annotations

from ....core.errors import ModelFormatError
from .shared import EMBEDDINGS, NORMS, QK_NORMS, ROTARY_BUFFERS, VOCAB_AND_ROPE_DIMS, attention, check_moe, routed_experts
from .spec import IDENTITY, Family, HParams, refuse_true, require_activation, require_whole_heads


def _check(hp: HParams) -> None:
    check_moe("olmoe", hp, renormalizes=False)
    refuse_true(hp, "olmoe", "tie_word_embeddings", "llama.cpp's olmoe requires an untied output matrix")
    if hp.n_head_kv != hp.n_head:
        raise ModelFormatError(f"olmoe GGUF needs num_key_value_heads == num_attention_heads ({hp.n_head}): "
                               f"llama.cpp's olmoe k_norm is {{n_embd}}, config has {hp.n_head_kv} key/value heads")
    require_whole_heads(hp, "olmoe")
    if hp.get("clip_qkv") is not None:
        raise ModelFormatError(f"olmoe with clip_qkv={hp.get('clip_qkv')} is not supported: llama.cpp's olmoe "
                               "does not clip q/k/v")
    refuse_true(hp, "olmoe", "attention_bias", "llama.cpp's olmoe has no attention output bias")
    require_activation(hp, "olmoe", "silu", "llama.cpp's olmoe runs SiLU-gated experts")


FAMILY = Family(
    name="olmoe",
    gguf_arch="olmoe",
    architectures=("OlmoeForCausalLM",),
    tensors=EMBEDDINGS + NORMS + attention(q=IDENTITY, k=IDENTITY) + QK_NORMS + routed_experts(),
    params=VOCAB_AND_ROPE_DIMS,
    ignored=ROTARY_BUFFERS,
    check=_check,
)
