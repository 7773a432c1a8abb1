"""Per-family GGUF declarations (data): hyper-parameters and the HF -> GGUF tensor mapping.

A family says, for each GGUF tensor, which HF tensor it comes from and which small transform turns
one into the other; HF tensors a family deliberately does not use are listed as ignored. The
streaming engine (`convert.py`) refuses any tensor that is neither mapped nor ignored. Adding a
family is adding a `Family` here and listing its architectures.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import gguf
import numpy as np

from ...errors import ModelFormatError

T = gguf.MODEL_TENSOR
Transform = Callable[[np.ndarray, "HParams"], np.ndarray]


@dataclass(frozen=True)
class HParams:
    """The config values a family needs, read once from config.json (transformers 4 and 5 spellings)."""

    cfg: dict[str, Any]

    def get(self, key: str, default: Any = None) -> Any:
        return self.cfg.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.cfg or self.cfg[key] is None:
            raise ModelFormatError(f"config.json has no {key}")
        return self.cfg[key]

    @property
    def n_layers(self) -> int:
        return int(self.require("num_hidden_layers"))

    @property
    def n_head(self) -> int:
        return int(self.require("num_attention_heads"))

    @property
    def n_head_kv(self) -> int:
        return int(self.get("num_key_value_heads") or self.n_head)

    @property
    def head_dim(self) -> int:
        return int(self.get("head_dim") or self.require("hidden_size") // self.n_head)

    @property
    def rope(self) -> dict[str, Any]:
        """rope_theta and scaling: transformers 5 nests them in rope_parameters."""
        for key in ("rope_parameters", "rope_scaling"):
            # `check` refuses these too; a direct convert() must still fail in one line, not on dict("linear").
            if self.get(key) is not None and not isinstance(self.get(key), dict):
                raise ModelFormatError(f"config.json {key} must be an object, not {type(self.get(key)).__name__}")
        params = dict(self.get("rope_parameters") or {})
        scaling = self.get("rope_scaling") or {}
        out = {**scaling, **params}
        out.setdefault("rope_theta", self.get("rope_theta", 10000.0))
        out["rope_type"] = out.get("rope_type") or out.get("type") or "default"
        return out


@dataclass(frozen=True)
class TensorRule:
    gguf: str  # GGUF name, may contain {bid}
    hf: str  # HF name, may contain {bid}
    transform: Transform | None = None
    optional: bool = False


@dataclass(frozen=True)
class Family:
    name: str
    gguf_arch: str
    architectures: tuple[str, ...]
    global_tensors: tuple[TensorRule, ...]
    block_tensors: tuple[TensorRule, ...]
    write_hparams: Callable[[gguf.GGUFWriter, HParams], None]
    extra_tensors: Callable[[HParams], dict[str, np.ndarray]] = lambda hp: {}
    ignored: tuple[str, ...] = field(default=())  # regexes of HF tensors deliberately unused


def _name(t: gguf.MODEL_TENSOR, suffix: str = "weight") -> str:
    return f"{gguf.TENSOR_NAMES[t]}.{suffix}"


# --- Llama layout (Llama, Mistral, ...) ----------------------------------------------------------

def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF stores rotary halves [x0..x(d/2), y0..]; llama.cpp expects interleaved pairs per head."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ModelFormatError(f"cannot permute a {list(w.shape)} tensor for {n_head} heads")
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _permute_q(w: np.ndarray, hp: HParams) -> np.ndarray:
    return permute_qk(w, hp.n_head)


def _permute_k(w: np.ndarray, hp: HParams) -> np.ndarray:
    return permute_qk(w, hp.n_head_kv)


def _llama_hparams(w: gguf.GGUFWriter, hp: HParams) -> None:
    w.add_context_length(int(hp.require("max_position_embeddings")))
    w.add_embedding_length(int(hp.require("hidden_size")))
    w.add_block_count(hp.n_layers)
    w.add_feed_forward_length(int(hp.require("intermediate_size")))
    w.add_head_count(hp.n_head)
    w.add_head_count_kv(hp.n_head_kv)
    w.add_layer_norm_rms_eps(float(hp.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(int(hp.require("vocab_size")))
    hd = hp.head_dim
    w.add_rope_dimension_count(hd)
    if hd * hp.n_head != int(hp.require("hidden_size")):
        w.add_key_length(hd)
        w.add_value_length(hd)
    rope = hp.rope
    w.add_rope_freq_base(float(rope["rope_theta"]))
    kind = rope["rope_type"]
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    elif kind not in ("default", "llama3"):
        raise ModelFormatError(f"rope scaling type {kind!r} is not supported for GGUF yet")


def _llama3_rope_freqs(hp: HParams) -> dict[str, np.ndarray]:
    """Llama 3.1+ frequency scaling becomes a `rope_freqs` factor tensor in GGUF."""
    rope = hp.rope
    if rope["rope_type"] != "llama3":
        return {}
    base, dim = float(rope["rope_theta"]), hp.head_dim
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old_ctx = float(rope.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    factors = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return {_name(T.ROPE_FREQS): np.asarray(factors, dtype=np.float32)}


LLAMA = Family(
    name="llama",
    gguf_arch="llama",
    architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    global_tensors=(
        TensorRule(_name(T.TOKEN_EMBD), "model.embed_tokens.weight"),
        TensorRule(_name(T.OUTPUT_NORM), "model.norm.weight"),
        TensorRule(_name(T.OUTPUT), "lm_head.weight", optional=True),  # absent when tied
    ),
    block_tensors=(
        TensorRule(_name(T.ATTN_NORM), "model.layers.{bid}.input_layernorm.weight"),
        TensorRule(_name(T.ATTN_Q), "model.layers.{bid}.self_attn.q_proj.weight", _permute_q),
        TensorRule(_name(T.ATTN_K), "model.layers.{bid}.self_attn.k_proj.weight", _permute_k),
        TensorRule(_name(T.ATTN_V), "model.layers.{bid}.self_attn.v_proj.weight"),
        TensorRule(_name(T.ATTN_OUT), "model.layers.{bid}.self_attn.o_proj.weight"),
        TensorRule(_name(T.ATTN_Q, "bias"), "model.layers.{bid}.self_attn.q_proj.bias", _permute_q, optional=True),
        TensorRule(_name(T.ATTN_K, "bias"), "model.layers.{bid}.self_attn.k_proj.bias", _permute_k, optional=True),
        TensorRule(_name(T.ATTN_V, "bias"), "model.layers.{bid}.self_attn.v_proj.bias", optional=True),
        TensorRule(_name(T.ATTN_OUT, "bias"), "model.layers.{bid}.self_attn.o_proj.bias", optional=True),
        TensorRule(_name(T.FFN_NORM), "model.layers.{bid}.post_attention_layernorm.weight"),
        TensorRule(_name(T.FFN_GATE), "model.layers.{bid}.mlp.gate_proj.weight"),
        TensorRule(_name(T.FFN_UP), "model.layers.{bid}.mlp.up_proj.weight"),
        TensorRule(_name(T.FFN_DOWN), "model.layers.{bid}.mlp.down_proj.weight"),
    ),
    write_hparams=_llama_hparams,
    extra_tensors=_llama3_rope_freqs,
    ignored=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"model\.rotary_emb\.inv_freq"),
)

def _unpermuted(rules: tuple[TensorRule, ...]) -> tuple[TensorRule, ...]:
    """The same rules without the Q/K permutation (for NEOX-style rope, which matches HF's rotate_half)."""
    return tuple(TensorRule(r.gguf, r.hf, None if r.transform in (_permute_q, _permute_k) else r.transform, r.optional)
                 for r in rules)


def _qwen2_hparams(w: gguf.GGUFWriter, hp: HParams) -> None:
    if hp.rope["rope_type"] not in ("default", "linear", "yarn"):
        raise ModelFormatError(f"rope scaling type {hp.rope['rope_type']!r} is not supported for qwen2 GGUF yet")
    _llama_hparams(w, hp)


# Qwen2: the Llama tensor layout plus q/k/v biases; llama.cpp runs it with NEOX rope, so no permutation.
QWEN2 = Family(
    name="qwen2",
    gguf_arch="qwen2",
    architectures=("Qwen2ForCausalLM",),
    global_tensors=LLAMA.global_tensors,
    block_tensors=_unpermuted(LLAMA.block_tensors),
    write_hparams=_qwen2_hparams,
    ignored=LLAMA.ignored,
)

FAMILIES: tuple[Family, ...] = (LLAMA, QWEN2)
BY_ARCHITECTURE: dict[str, Family] = {a: f for f in FAMILIES for a in f.architectures}


def family_for(architecture: str) -> Family:
    try:
        return BY_ARCHITECTURE[architecture]
    except KeyError:
        supported = ", ".join(sorted(BY_ARCHITECTURE))
        raise ModelFormatError(f"no GGUF converter for {architecture} (supported: {supported})") from None


def is_ignored(family: Family, name: str) -> bool:
    return any(re.fullmatch(p, name) for p in family.ignored)
