"""InternVL's remote-code form (InternVLChatModel, OpenGVLab's InternVL2 / 2.5 / 3 / 3.5 repositories) as transformers'
InternVLForConditionalGeneration: the pieces of its native-equivalent declaration (native.py assembles them).

The two compute the same function (facts from transformers' InternVL conversion script and the remote layout):
- the vision tower is InternViT: `vision_model.embeddings` (class_embedding, position_embedding, patch_embedding)
  and `vision_model.encoder.layers.N` with a fused `attn.qkv` ([q; k; v] rows, hidden each), `attn.proj`, optional
  `attn.q_norm`/`k_norm`, layer scales `ls1`/`ls2`, `norm1`/`norm2`, `mlp.fc1`/`fc2`; transformers names them
  `model.vision_tower.embeddings.{cls_token, position_embeddings, patch_embeddings.projection}` and
  `model.vision_tower.encoder.layer.N.{attention.{q,k,v}_proj, attention.projection_layer, lambda_1/2,
  layernorm_before/after, mlp}`;
- the projector `mlp1` is Sequential(LayerNorm, Linear, GELU, Linear): `mlp1.0/1/3` are transformers'
  `multi_modal_projector.layer_norm / linear_1 / linear_2`;
- the language model is a plain transformers causal LM (`language_model.model.*`, `language_model.lm_head`):
  `model.language_model.*` and `lm_head` natively. Only Qwen2, Qwen3 and Llama language models are declared:
  InternLM2 inside InternVL (InternVL2_5-2B/8B/26B) fuses its attention differently and is refused for now;
- `select_layer` is transformers' vision_feature_layer (both index the tower's hidden states with the embeddings
  first), the CLS row is dropped ("default"), `ps_version` v2's pixel shuffle is the one transformers computes, and
  the image rows replace the `<IMG_CONTEXT>` tokens, whose id the tokenizer holds (config.json does not say it).
Config defaults are the remote InternVisionConfig's (rms_norm, qk_normalization on, no qkv bias) where config.json
leaves a field out: transformers' own defaults differ.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ..core.errors import ModelFormatError, NotApplicableError

ARCHITECTURE = "InternVLChatModel"
NATIVE_ARCHITECTURE = "InternVLForConditionalGeneration"
MODEL_TYPE = "internvl"
# The language models whose checkpoint names and config transformers reads as they are -> their model type.
LANGUAGE_MODELS = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}
IMAGE_CONTEXT_TOKEN = "<IMG_CONTEXT>"
# llm_config keys that describe the remote wrapper or the training run, not the language model (as transformers'
# conversion drops them); the rest is the language model's own config.
_NOT_TEXT_CONFIG = ("_name_or_path", "_attn_implementation_autoset", "auto_map", "architectures", "use_bfloat16",
                    "use_flash_attn", "attn_implementation", "moe_config", "transformers_version")
# InternVisionConfig's defaults for the fields whose transformers default means something else
_VISION_DEFAULTS = {"norm_type": "rms_norm", "qk_normalization": True, "qkv_bias": False, "layer_norm_eps": 1e-6,
                    "hidden_act": "gelu", "num_channels": 3}
_VISION_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "patch_size")
QK_NORM_EPS = 1e-6  # transformers' InternVL vision q/k RMSNorm has this epsilon whatever layer_norm_eps says


def _language(cfg: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    llm = cfg.get("llm_config")
    archs = llm.get("architectures") if isinstance(llm, dict) else None
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    return (llm if isinstance(llm, dict) else None), arch


def _refusal(cfg: dict[str, Any]) -> str | None:
    """Why this config.json has no native form, in one line (None: it has)."""
    llm, arch = _language(cfg)
    if llm is None:
        return f"config.json has no llm_config object ({ARCHITECTURE}'s language model)"
    *others, last = LANGUAGE_MODELS
    if arch not in LANGUAGE_MODELS:
        return (f"{ARCHITECTURE} with language model {arch or '(unnamed in llm_config)'}: hive-aot builds "
                f"{ARCHITECTURE} as transformers' {NATIVE_ARCHITECTURE} with a {', '.join(others)} or {last} "
                "language model only")
    vision = cfg.get("vision_config")
    if not isinstance(vision, dict):
        return f"config.json has no vision_config object ({ARCHITECTURE}'s InternViT tower)"
    if cfg.get("ps_version", "v1") != "v2":  # InternVLChatConfig's default is v1
        return (f"{ARCHITECTURE} with ps_version {cfg.get('ps_version', 'v1')!r}: its pixel shuffle leaves the image "
                f"rows transposed; transformers' {NATIVE_ARCHITECTURE} computes v2's only")
    qk_norm = vision.get("qk_normalization", _VISION_DEFAULTS["qk_normalization"])
    if qk_norm and vision.get("layer_norm_eps", _VISION_DEFAULTS["layer_norm_eps"]) != QK_NORM_EPS:
        return (f"{ARCHITECTURE}'s vision q/k normalization with layer_norm_eps {vision.get('layer_norm_eps')!r}: "
                f"transformers' {NATIVE_ARCHITECTURE} normalizes q/k with {QK_NORM_EPS}")
    return None


def _vision_config(cfg: dict[str, Any]) -> dict[str, Any]:
    vision = cfg["vision_config"]
    out: dict[str, Any] = {}
    for key in _VISION_SIZES:
        if key not in vision:
            raise KeyError(f"vision_config.{key}")
        out[key] = vision[key]
    image_size = cfg.get("force_image_size") or vision.get("image_size")  # the remote model resizes to force_image_size
    if image_size is None:
        raise KeyError("vision_config.image_size")
    get = lambda key: vision.get(key, _VISION_DEFAULTS[key])  # noqa: E731
    out.update(image_size=image_size, norm_type=get("norm_type"), layer_norm_eps=get("layer_norm_eps"),
               hidden_act=get("hidden_act"), num_channels=get("num_channels"), use_qk_norm=bool(get("qk_normalization")),
               attention_bias=bool(get("qkv_bias")),
               # InternViT has no final norm and learned absolute positions; inference runs without dropout
               use_mean_pooling=True, use_absolute_position_embeddings=True, use_mask_token=False,
               attention_dropout=0.0, projection_dropout=0.0, hidden_dropout_prob=0.0)
    if "initializer_range" in vision:
        out["initializer_range"] = vision["initializer_range"]
    return out


def config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json of an InternVLChatModel -> InternVLConfig's arguments (the image token id aside: `files`);
    NotApplicableError (one line) for a repository without a native form."""
    problem = _refusal(cfg)
    if problem:
        raise NotApplicableError(problem)
    llm, arch = _language(cfg)
    assert llm is not None and arch is not None  # _refusal() said so
    text = {k: v for k, v in llm.items() if k not in _NOT_TEXT_CONFIG}
    text["model_type"] = LANGUAGE_MODELS[arch]
    # InternVLChatModel ties its output embedding as its own config says (the language model's when it is silent)
    tie = bool(cfg.get("tie_word_embeddings", llm.get("tie_word_embeddings", False)))
    text["tie_word_embeddings"] = tie
    vision = _vision_config(cfg)
    ratio = float(cfg.get("downsample_ratio", 0.5))
    side, patch = (v[0] if isinstance(v, (list, tuple)) else v for v in (vision["image_size"], vision["patch_size"]))
    return {"text_config": text, "vision_config": vision, "downsample_ratio": ratio,
            "vision_feature_layer": int(cfg.get("select_layer", -1)), "vision_feature_select_strategy": "default",
            "projector_hidden_act": "gelu",  # mlp1's nn.GELU(): the exact GELU
            "image_seq_length": int((int(side) // int(patch)) ** 2 * ratio ** 2), "tie_word_embeddings": tie}


def _added_tokens(model_dir: Path) -> dict[str, int]:
    """The added tokens the tokenizer files declare (tokenizer.json, tokenizer_config.json, added_tokens.json)."""
    found: dict[str, int] = {}

    def read(name: str) -> Any:
        path = model_dir / name
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise ModelFormatError(f"{name} cannot be read: {type(e).__name__}: {e}") from None

    doc = read("tokenizer.json")
    for tok in (doc.get("added_tokens") or []) if isinstance(doc, dict) else []:
        if isinstance(tok, dict) and isinstance(tok.get("content"), str) and type(tok.get("id")) is int:
            found.setdefault(tok["content"], tok["id"])
    doc = read("tokenizer_config.json")
    decoder = doc.get("added_tokens_decoder") if isinstance(doc, dict) else None
    for key, tok in (decoder.items() if isinstance(decoder, dict) else []):
        if isinstance(tok, dict) and isinstance(tok.get("content"), str) and re.fullmatch(r"\d+", str(key)):
            found.setdefault(tok["content"], int(key))
    doc = read("added_tokens.json")
    for content, index in (doc.items() if isinstance(doc, dict) else []):
        if type(index) is int:
            found.setdefault(content, index)
    return found


def files(model_dir: Path) -> dict[str, Any]:
    """What InternVLConfig needs beside config.json: the image placeholder's id, from the tokenizer files."""
    tokens = _added_tokens(model_dir)
    if IMAGE_CONTEXT_TOKEN not in tokens:
        raise ModelFormatError(f"the tokenizer declares no {IMAGE_CONTEXT_TOKEN} token ({ARCHITECTURE}'s image "
                               "placeholder): its id is the native config's image_token_id")
    return {"image_token_id": tokens[IMAGE_CONTEXT_TOKEN]}


_TOWER, _LAYER = r"model\.vision_tower\.", r"model\.vision_tower\.encoder\.layer\.(\d+)\."
REMOTE_LAYER = "vision_model.encoder.layers.{0}."
# (native parameter regex, checkpoint name template), one to one
RENAME = (
    (_TOWER + r"embeddings\.cls_token", "vision_model.embeddings.class_embedding"),
    (_TOWER + r"embeddings\.position_embeddings", "vision_model.embeddings.position_embedding"),
    (_TOWER + r"embeddings\.patch_embeddings\.projection\.(.*)", "vision_model.embeddings.patch_embedding.{0}"),
    (_LAYER + r"lambda_([12])", REMOTE_LAYER + "ls{1}"),
    (_LAYER + r"attention\.projection_layer\.(.*)", REMOTE_LAYER + "attn.proj.{1}"),
    (_LAYER + r"attention\.([qk])_norm\.(.*)", REMOTE_LAYER + "attn.{1}_norm.{2}"),
    (_LAYER + r"layernorm_before\.(.*)", REMOTE_LAYER + "norm1.{1}"),
    (_LAYER + r"layernorm_after\.(.*)", REMOTE_LAYER + "norm2.{1}"),
    (_LAYER + r"mlp\.(fc[12])\.(.*)", REMOTE_LAYER + "mlp.{1}.{2}"),
    (r"model\.multi_modal_projector\.layer_norm\.(.*)", "mlp1.0.{0}"),
    (r"model\.multi_modal_projector\.linear_1\.(.*)", "mlp1.1.{0}"),
    (r"model\.multi_modal_projector\.linear_2\.(.*)", "mlp1.3.{0}"),
    (r"model\.language_model\.(.*)", "language_model.model.{0}"),
    (r"lm_head\.(.*)", "language_model.lm_head.{0}"),
)
_QKV = re.compile(_LAYER + r"attention\.([qkv])_proj\.(weight|bias)")


def split_qkv(w, index: int):
    """Part `index` (0 q, 1 k, 2 v) of InternViT's fused `attn.qkv` rows [q; k; v] (weight or bias; numpy or torch)."""
    rows = w.shape[0]
    if rows % 3:
        raise ModelFormatError(f"an InternViT attn.qkv of {rows} rows is not three equal parts (q, k, v)")
    return w[index * (rows // 3):(index + 1) * (rows // 3)]


def fused(name: str, cfg: dict[str, Any]):
    """The vision attention's q/k/v projections: slices of the layer's fused `attn.qkv`."""
    m = _QKV.fullmatch(name)
    if not m:
        return None
    layer, which, kind = m.groups()
    index = "qkv".index(which)
    return f"{REMOTE_LAYER.format(layer)}attn.qkv.{kind}", lambda w: split_qkv(w, index)
