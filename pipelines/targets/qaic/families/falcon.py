"""Falcon (rotary only; ALiBi is refused): its layout depends on the config.

- new decoder architecture (Falcon-40B/180B): always parallel, one fused query_key_value grouped per KV head
  ([group][r queries, k, v]), two input norms (ln_attn, ln_mlp) unless num_ln_in_parallel_attn says one;
- otherwise (Falcon-7B and older): [q | k | v] with one KV head when multi_query, else [head][q, k, v]; one
  input_layernorm, parallel or sequential as parallel_attn says.
"""

from __future__ import annotations

from typing import Any

from ....core.errors import NotApplicableError
from .blocks import GroupedQkv, PerHeadQkv, PlainMlp, SplitQkv, layer_norm, parallel_residual, sequential_residual
from .spec import Family, Norms

ARCHITECTURES = ("FalconForCausalLM",)
QKV = "query_key_value"


def FAMILY(cfg: Any) -> Family:  # noqa: N802 -- a declaration that depends on the config
    if getattr(cfg, "alibi", False):
        raise NotApplicableError("no AI 100 ONNX export for Falcon with ALiBi (alibi: true); rotary Falcon only")
    if cfg.new_decoder_architecture:
        two = (cfg.num_ln_in_parallel_attn or 2) == 2
        norms = Norms(pre_attn="ln_attn" if two else "input_layernorm", pre_mlp="ln_mlp" if two else None)
        qkv, kv, parallel = GroupedQkv(QKV), cfg.num_kv_heads, True
    else:
        parallel = bool(cfg.parallel_attn)
        norms = Norms(pre_attn="input_layernorm", pre_mlp=None if parallel else "post_attention_layernorm")
        qkv, kv = (SplitQkv(QKV), 1) if cfg.multi_query else (PerHeadQkv(QKV), cfg.num_attention_heads)
    return Family(base="transformer", embed="word_embeddings", layers="h", final_norm="ln_f", norm=layer_norm,
                  norms=norms, residual=parallel_residual if parallel else sequential_residual, attn="self_attention",
                  qkv=qkv, o_proj="dense", kv_heads=kv,
                  scaling="inv_norm_factor", mlp=PlainMlp("dense_h_to_4h", "dense_4h_to_h", "act"))
