"""InternLM2 / InternLM2.5 (InternLM2ForCausalLM, remote code only): llama.cpp arch `internlm2`.

A Llama block under other names, with Q, K and V fused into one `wqkv` grouped by KV head; split with the
same declaration the reference uses (`pipelines.model.native`), then Q and K are permuted for llama.cpp's rope
pairs as Llama's are. The repositories ship their modeling code (auto_map): hive-aot never runs it, and
converts such a repository only once the registry marks it reviewed (as every auto_map repo); its reference
is transformers' Llama on the same weights.
"""

from __future__ import annotations

from ....core.errors import ModelFormatError
from ....model.native import split_internlm2_wqkv
from .shared import ROTARY_BUFFERS, VOCAB_AND_ROPE_DIMS, permute_qk
from .spec import Family, HParams, Rule, T, Transform, name, refuse_true, require_whole_heads, tensor

LAYER = "model.layers.{bid}"


def _split_qkv(xs, hp: HParams):
    q, k, v = split_internlm2_wqkv(xs[0], hp.n_head, hp.n_head_kv)
    return [permute_qk(q, hp.n_head), permute_qk(k, hp.n_head_kv), v]


def _qkv_shapes(shapes, hp: HParams):
    rows, cols = shapes[0]
    d = hp.head_dim
    if rows != (hp.n_head + 2 * hp.n_head_kv) * d:
        raise ModelFormatError(f"a wqkv of {rows} rows is not {hp.n_head} query + 2 x {hp.n_head_kv} KV heads of {d}")
    return [(hp.n_head * d, cols), (hp.n_head_kv * d, cols), (hp.n_head_kv * d, cols)]


SPLIT_QKV = Transform("split_internlm2_wqkv+permute_qk", _split_qkv, _qkv_shapes)


def _check(hp: HParams) -> None:
    refuse_true(hp, "internlm2", "bias", "llama.cpp's internlm2 has no attention biases")
    refuse_true(hp, "internlm2", "tie_word_embeddings", "llama.cpp's internlm2 requires an untied output matrix")
    require_whole_heads(hp, "internlm2")


FAMILY = Family(
    name="internlm2",
    gguf_arch="internlm2",
    architectures=("InternLM2ForCausalLM",),
    tensors=(
        tensor(T.TOKEN_EMBD, "model.tok_embeddings.weight"),
        tensor(T.OUTPUT_NORM, "model.norm.weight"),
        tensor(T.OUTPUT, "output.weight"),
        tensor(T.ATTN_NORM, LAYER + ".attention_norm.weight"),
        tensor(T.FFN_NORM, LAYER + ".ffn_norm.weight"),
        Rule((name(T.ATTN_Q), name(T.ATTN_K), name(T.ATTN_V)), (LAYER + ".attention.wqkv.weight",), SPLIT_QKV),
        tensor(T.ATTN_OUT, LAYER + ".attention.wo.weight"),
        tensor(T.FFN_GATE, LAYER + ".feed_forward.w1.weight"),
        tensor(T.FFN_UP, LAYER + ".feed_forward.w3.weight"),
        tensor(T.FFN_DOWN, LAYER + ".feed_forward.w2.weight"),
    ),
    params=VOCAB_AND_ROPE_DIMS,
    ignored=ROTARY_BUFFERS,
    check=_check,
    tied_output="output.weight",
)
