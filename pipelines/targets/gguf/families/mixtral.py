"""Mixtral: Llama attention (Q/K permuted for llama.cpp's adjacent-pair rope) with a sparse MoE feed-forward,
run by llama.cpp's `llama` arch when expert tensors are present.

Checkpoints (and transformers 5's `save_pretrained`, which splits its fused `experts.gate_up_proj` back)
hold one `block_sparse_moe.experts.{xid}.w1/w2/w3` per expert: gate, down, up. llama.cpp wants one
[experts, rows, cols] tensor each, stacked expert by expert; the router `block_sparse_moe.gate` becomes
`ffn_gate_inp`. llama.cpp renormalizes the top-k weights, as Mixtral does.
"""

from __future__ import annotations

from .shared import EMBEDDINGS, LAYER, NORMS, ROTARY_BUFFERS, VOCAB_AND_ROPE_DIMS, attention, llama3_rope_freqs
from .spec import Family, T, experts, tensor

MOE = LAYER + ".block_sparse_moe"

SPARSE_MOE = (
    tensor(T.FFN_GATE_INP, MOE + ".gate.weight"),
    experts(T.FFN_GATE_EXP, MOE + ".experts.{xid}.w1.weight"),
    experts(T.FFN_DOWN_EXP, MOE + ".experts.{xid}.w2.weight"),
    experts(T.FFN_UP_EXP, MOE + ".experts.{xid}.w3.weight"),
)

FAMILY = Family(
    name="mixtral",
    gguf_arch="llama",
    architectures=("MixtralForCausalLM",),
    tensors=EMBEDDINGS + NORMS + attention() + SPARSE_MOE,
    params=VOCAB_AND_ROPE_DIMS,
    extra_tensors=llama3_rope_freqs,
    ignored=ROTARY_BUFFERS,
)
