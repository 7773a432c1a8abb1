"""The vocabulary of AI 100 decoder family declarations: where a family's weights live in the transformers
model (module and config attribute names) and which layout blocks (blocks.py) compute its pieces.

A declaration is data plus blocks; the decoder engine (decoder.py) reads the names and calls the blocks, so
it holds no per-family branch. Facts come from transformers' own modeling files (5.x).

Conventions the engine relies on:
- projections are called as modules (`nn.Linear`, GPT-2's `Conv1D`, `FalconLinear`), so their biases and
  weight layouts come along; every other weight is read as a tensor;
- norm slots name the layer's norm modules by role; the same attribute name means different roles in
  different families (Olmo2's `post_attention_layernorm` normalizes the attention output, Llama's the MLP
  input).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .blocks import (
    NO_QK_NORM,
    STACKED_EXPERTS,
    AttentionProbs,
    ExpertLayout,
    GatedMlp,
    MlpBlock,
    MoeScoring,
    MultimodalRope,
    Norm,
    QkNorm,
    QkvSplit,
    QueryScale,
    ResidualWiring,
    RopeTable,
    Rotary,
    SeparateQkv,
    model_rotary_table,
    rms_norm,
    rotate_half,
    sequential_residual,
    softmax_probs,
    softmax_topk,
)


@dataclass(frozen=True)
class Norms:
    """Norm module names per role in a decoder layer (None: no norm in that place)."""

    pre_attn: str | None = "input_layernorm"
    post_attn: str | None = None  # on the attention output, before the residual add
    pre_mlp: str | None = "post_attention_layernorm"  # None with parallel attention: the MLP reads pre_attn's output
    post_mlp: str | None = None  # on the MLP output, before the residual add


@dataclass(frozen=True)
class Moe:
    """A sparse MoE block, computed statically: router logits, `scoring` (TopK weights and indices), the
    top-k weights scattered into a dense [tokens, experts] matrix, every expert (`layout`) applied to every
    token and summed with those weights. normalize: renormalize the top-k weights to sum 1: True, False, or
    the name of the config flag that says so (the scoring decides what it means)."""

    router: str = "gate"
    experts: str = "experts"
    scoring: MoeScoring = softmax_topk
    normalize: bool | str = True
    layout: ExpertLayout = STACKED_EXPERTS
    scale_input: bool = False  # the weights scale each expert's input, not its output (Llama 4)
    shared: str | None = None  # a shared expert every token goes through (the family's `mlp` block), added


@dataclass(frozen=True)
class Family:
    """One decoder family: Llama's layout by default, each field overridden where the family differs."""

    # where things live
    base: str = "model"  # the decoder stack inside *ForCausalLM
    embed: str = "embed_tokens"  # token embedding module (Gemma's scales by sqrt(hidden) itself)
    positions: str | None = None  # learned absolute position embedding module (GPT-2, GPTBigCode)
    layers: str = "layers"
    final_norm: str = "norm"
    # norms
    norm: Norm = rms_norm  # the norm block every norm module of the family is computed with
    norms: Norms = field(default_factory=Norms)
    residual: ResidualWiring = sequential_residual  # or parallel_residual (GPT-J, Falcon)
    # attention
    attn: str = "self_attn"
    qkv: QkvSplit = SeparateQkv()  # a q/k/v split block (blocks.py), bound to its projection names
    o_proj: str = "o_proj"
    kv_heads: int | None = None  # None: config.num_key_value_heads, else num_attention_heads
    qk_norm: QkNorm = NO_QK_NORM
    rotary: Rotary | None = rotate_half  # None: no RoPE (learned positions)
    rope_table: RopeTable = model_rotary_table
    mrope: MultimodalRope | None = None  # multimodal RoPE: position_ids [rows, batch, seq] (blocks.py)
    max_positions: int | None = None  # the positions the export serves at most, where the config declares more
    scaling: str | None = "scaling"  # attention module attribute holding the score scale; None: head_dim ** -0.5
    attn_softcap: str | None = None  # config attribute: scores = cap * tanh(scores / cap)
    final_softcap: str | None = None  # config attribute: logits = cap * tanh(logits / cap)
    probs: AttentionProbs = softmax_probs  # masked scores -> probabilities (softmax_with_sinks: GPT-OSS)
    sliding: bool = True  # honor the layers' sliding windows in the mask; False: full attention everywhere
    chunk: str | None = None  # config attribute: layers typed "chunked_attention" see only their own chunk
    rope_switch: str | None = None  # attention attribute, false in a layer without RoPE (Llama 4's NoPE layers)
    query_scale: QueryScale | None = None  # a per-position multiplier of a layer's queries (Llama 4's NoPE layers)
    # multipliers (config attribute names)
    embed_multiplier: str | None = None
    residual_multiplier: str | None = None
    logits_divisor: str | None = None
    # feed-forward
    ffn: str = "mlp"  # the layer's feed-forward module (dense MLP or MoE)
    mlp: MlpBlock = GatedMlp()  # a dense MLP block (blocks.py): (the layer's MLP module, x) -> output
    moe: Moe | None = None  # layers whose MLP has `moe.experts` use it; the others use `mlp`
    # cross-attention layers (a VLM's language model reading the image's K/V: Mllama)
    cross_layers: str | None = None  # config attribute listing the layers computed by `cross_layer`
    cross_layer: Any = None  # (engine, layer, h, masks, past_k, past_v, rows) -> (h, past_k, past_v), with .masks
