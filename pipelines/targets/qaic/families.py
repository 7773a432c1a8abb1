"""What the AI 100 export needs to know about each decoder family, declared once per architecture.

One `Family` says where the weights live in the transformers model (module names), which norm, rotary
style, attention projections and MLP it uses, how the residual stream is wired and which config
multipliers or soft-caps apply. `export.py` holds the single decoder engine that reads these
declarations; nothing here runs a forward pass. Facts come from transformers' own modeling files
(5.x): where a family's layout depends on its config (Falcon, GPTBigCode), the declaration is a
function of the config.

Conventions the engine relies on:
- projections are called as modules (`nn.Linear`, GPT-2's `Conv1D`, `FalconLinear`), so their biases and
  weight layouts come along; every other weight is read as a tensor;
- `qkv` is either three projection names or one fused projection, whose output is split per `qkv_layout`:
  "split" [q | k | v], "per_head" [head][q, k, v] (GPT-2-era fused layouts with as many KV heads as query
  heads), "grouped" [kv group][r queries, k, v] (Falcon's new decoder architecture);
- norm slots name the layer's norm modules by role; the same attribute name means different roles in
  different families (Olmo2's `post_attention_layernorm` normalizes the attention output, Llama's the MLP
  input).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable


@dataclass(frozen=True)
class Norms:
    """Norm module names per role in a decoder layer (None: no norm in that place)."""

    pre_attn: str | None = "input_layernorm"
    post_attn: str | None = None  # on the attention output, before the residual add
    pre_mlp: str | None = "post_attention_layernorm"  # None with parallel attention: the MLP reads pre_attn's output
    post_mlp: str | None = None  # on the MLP output, before the residual add


@dataclass(frozen=True)
class Mlp:
    """A dense MLP. kind: "gated" act(gate(x)) * up(x) -> down (proj: gate, up, down); "gated_fused" one
    projection whose first half is the gate (proj: gate_up, down); "plain" act(fc_in(x)) -> fc_out (proj: in, out)."""

    kind: str = "gated"
    proj: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
    act: str = "act_fn"  # the activation module's attribute on the MLP


@dataclass(frozen=True)
class Moe:
    """A sparse MoE block, computed statically: router logits, TopK, the top-k weights scattered into a dense
    [tokens, experts] matrix, every expert applied to every token and summed with those weights.

    scoring: "softmax_topk" (softmax over all experts, then TopK; Mixtral, Qwen3-MoE) or "topk_softmax"
    (TopK of the logits, softmax over the k; GPT-OSS). normalize: renormalize the top-k weights to sum 1:
    True, False, or the name of the config flag that says so. layout: "stacked" (gate_up_proj [E, 2I, H] with
    the gate in the first half, down_proj [E, H, I], the experts' act_fn) or "gpt_oss" (gate_up_proj [E, H, 2I]
    with gate/up interleaved, down_proj [E, I, H], biases, clamped SwiGLU (up + 1) * g * sigmoid(alpha g))."""

    router: str = "gate"
    experts: str = "experts"
    scoring: str = "softmax_topk"
    normalize: bool | str = True
    layout: str = "stacked"


@dataclass(frozen=True)
class Family:
    # where things live
    base: str = "model"  # the decoder stack inside *ForCausalLM
    embed: str = "embed_tokens"  # token embedding module (Gemma's scales by sqrt(hidden) itself)
    positions: str | None = None  # learned absolute position embedding module (GPT-2, GPTBigCode)
    layers: str = "layers"
    final_norm: str = "norm"
    # norms
    norm: str = "rms"  # "rms": x / rms(x) * w; "rms_1p": x / rms(x) * (1 + w) (Gemma); "layer": LayerNorm with bias
    norms: Norms = field(default_factory=Norms)
    parallel: bool = False  # h + attn(n(h)) + mlp(n'(h)) (GPT-J, Falcon) instead of two sequential residual adds
    # attention
    attn: str = "self_attn"
    qkv: tuple[str, str, str] | str = ("q_proj", "k_proj", "v_proj")
    qkv_layout: str = "separate"  # or, for a fused projection: "split" | "per_head" | "grouped"
    o_proj: str = "o_proj"
    kv_heads: int | None = None  # None: config.num_key_value_heads, else num_attention_heads
    qk_norm: str | None = None  # "head": q_norm/k_norm over head_dim (Qwen3); "full": over the projection (Olmo2)
    rotary: str | None = "half"  # "half": rotate_half (Llama); "interleaved": rotate every two (GPT-J); None
    rope_table: str = "model"  # "model": <base>.rotary_emb; "halves": it returns one half (GPT-OSS); "gptj"
    scaling: str | None = "scaling"  # attention module attribute holding the score scale; None: head_dim ** -0.5
    attn_softcap: str | None = None  # config attribute: scores = cap * tanh(scores / cap)
    final_softcap: str | None = None  # config attribute: logits = cap * tanh(logits / cap)
    sinks: bool = False  # per-head attention sink logits (GPT-OSS): an extra softmax column, dropped after
    sliding: bool = True  # honor the layers' sliding windows in the mask; False: full attention everywhere
    # multipliers (config attribute names)
    embed_multiplier: str | None = None
    residual_multiplier: str | None = None
    logits_divisor: str | None = None
    # feed-forward
    mlp: Mlp = field(default_factory=Mlp)
    moe: Moe | None = None  # layers whose MLP has `moe.experts` use it; the others use `mlp`


LLAMA = Family()
_GPT2_NAMES = dict(base="transformer", embed="wte", layers="h", final_norm="ln_f", norm="layer",
                   norms=Norms(pre_attn="ln_1", pre_mlp="ln_2"), attn="attn", o_proj="c_proj")


def _gpt_bigcode(cfg: Any) -> Family:
    return Family(**_GPT2_NAMES, positions="wpe", qkv="c_attn", rotary=None,
                  qkv_layout="split" if cfg.multi_query else "per_head",
                  kv_heads=1 if cfg.multi_query else cfg.num_attention_heads,
                  mlp=Mlp("plain", ("c_fc", "c_proj"), "act"))


def _falcon(cfg: Any) -> Family:
    if getattr(cfg, "alibi", False):
        from ...errors import NotApplicableError

        raise NotApplicableError("no AI 100 ONNX export for Falcon with ALiBi (alibi: true); rotary Falcon only")
    new = bool(cfg.new_decoder_architecture)
    if new:  # always parallel; two input norms unless num_ln_in_parallel_attn says one
        two = (cfg.num_ln_in_parallel_attn or 2) == 2
        norms = Norms(pre_attn="ln_attn" if two else "input_layernorm", pre_mlp="ln_mlp" if two else None)
        layout, kv, parallel = "grouped", cfg.num_kv_heads, True
    else:
        parallel = bool(cfg.parallel_attn)
        norms = Norms(pre_attn="input_layernorm", pre_mlp=None if parallel else "post_attention_layernorm")
        layout, kv = ("split", 1) if cfg.multi_query else ("per_head", cfg.num_attention_heads)
    return Family(base="transformer", embed="word_embeddings", layers="h", final_norm="ln_f", norm="layer",
                  norms=norms, parallel=parallel, attn="self_attention", qkv="query_key_value", qkv_layout=layout,
                  o_proj="dense", kv_heads=kv, scaling="inv_norm_factor",
                  mlp=Mlp("plain", ("dense_h_to_4h", "dense_4h_to_h"), "act"))


FAMILY_SPECS: dict[str, Family | Callable[[Any], Family]] = {
    "LlamaForCausalLM": LLAMA,
    "MistralForCausalLM": LLAMA,
    "Qwen2ForCausalLM": LLAMA,  # q/k/v biases come with the projection modules
    "Qwen3ForCausalLM": replace(LLAMA, qk_norm="head"),
    "GemmaForCausalLM": replace(LLAMA, norm="rms_1p"),
    # Sliding window disabled (full attention in every layer, as vLLM serves Gemma on AI 100): equal to
    # transformers while sequences stay shorter than config.sliding_window.
    "Gemma2ForCausalLM": replace(LLAMA, norm="rms_1p", sliding=False, attn_softcap="attn_logit_softcapping",
                                 final_softcap="final_logit_softcapping",
                                 norms=Norms("input_layernorm", "post_attention_layernorm",
                                             "pre_feedforward_layernorm", "post_feedforward_layernorm")),
    "Phi3ForCausalLM": replace(LLAMA, qkv="qkv_proj", qkv_layout="split",
                               mlp=Mlp("gated_fused", ("gate_up_proj", "down_proj"), "activation_fn")),
    "GraniteForCausalLM": replace(LLAMA, embed_multiplier="embedding_multiplier",
                                  residual_multiplier="residual_multiplier", logits_divisor="logits_scaling"),
    "Olmo2ForCausalLM": replace(LLAMA, qk_norm="full",
                                norms=Norms(pre_attn=None, post_attn="post_attention_layernorm", pre_mlp=None,
                                            post_mlp="post_feedforward_layernorm")),
    "GPT2LMHeadModel": Family(**_GPT2_NAMES, positions="wpe", qkv="c_attn", qkv_layout="split", rotary=None,
                              mlp=Mlp("plain", ("c_fc", "c_proj"), "act")),
    "GPTJForCausalLM": Family(base="transformer", embed="wte", layers="h", final_norm="ln_f", norm="layer",
                              norms=Norms(pre_attn="ln_1", pre_mlp=None), parallel=True, attn="attn",
                              o_proj="out_proj", rotary="interleaved", rope_table="gptj", scaling=None,
                              mlp=Mlp("plain", ("fc_in", "fc_out"), "act")),
    "GPTBigCodeForCausalLM": _gpt_bigcode,
    "FalconForCausalLM": _falcon,
    "MixtralForCausalLM": replace(LLAMA, moe=Moe()),  # top-k weights always renormalized
    "Qwen3MoeForCausalLM": replace(LLAMA, qk_norm="head", moe=Moe(normalize="norm_topk_prob")),
    # Sliding-window layers (config.layer_types) are masked as transformers masks them (p - j < window over
    # the full-length cache), so the export equals transformers below and beyond the window.
    "GptOssForCausalLM": replace(LLAMA, rope_table="halves", sinks=True,
                                 moe=Moe(router="router", scoring="topk_softmax", layout="gpt_oss")),
}


def unsupported(arch: str) -> Exception:
    """The one-line refusal of an architecture without a declaration here."""
    from ...errors import NotApplicableError

    return NotApplicableError(f"no AI 100 ONNX export for {arch} (supported: {', '.join(sorted(FAMILY_SPECS))})")


def architecture(config: Any) -> str:
    """The architecture named first in a config (a transformers config or config.json's dict)."""
    names = config.get("architectures") if isinstance(config, dict) else getattr(config, "architectures", None)
    return (names or ["<no architectures in config.json>"])[0]


def family_for(config: Any) -> tuple[str, Family]:
    """(architecture, its Family) for a transformers config; NotApplicableError (one line) when unsupported."""
    arch = architecture(config)
    spec = FAMILY_SPECS.get(arch)
    if spec is None:
        raise unsupported(arch)
    return arch, spec(config) if callable(spec) else spec


def matmul_weights(model: Any) -> list[tuple[Any, str, int]]:
    """Every weight the exported graph multiplies as a constant MatMul operand (what `-mxfp6-matmul`
    compresses), as (module, parameter name, reduction axis): nn.Linear weights (axis -1), GPT-2 Conv1D
    weights ([in, out]: axis 0), MoE routers (axis -1) and stacked expert weights (per layout). Embeddings
    are Gathers, norms and biases are not MatMul weights."""
    import torch

    _arch, fam = family_for(model.config)
    found: list[tuple[Any, str, int]] = []
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            found.append((module, "weight", -1))
        elif type(module).__name__ == "Conv1D" and module.weight.dim() == 2:
            found.append((module, "weight", 0))
    if fam.moe is not None:
        for layer in getattr(getattr(model, fam.base), fam.layers):
            experts = getattr(layer.mlp, fam.moe.experts, None)
            if experts is None:
                continue
            router = getattr(layer.mlp, fam.moe.router)
            if not isinstance(router, torch.nn.Linear):
                found.append((router, "weight", -1))
            axis = -1 if fam.moe.layout == "stacked" else -2  # gpt_oss stores [E, in, out]
            found += [(experts, "gate_up_proj", axis), (experts, "down_proj", axis)]
    return found
