"""Native stand-ins for architectures whose repositories ship only remote code.

Some architectures exist only as `modeling_*.py` inside their repositories (`auto_map`), which hive-aot
never executes. Where such an architecture is a known transformers model under other names, it is
declared here: the transformers model type that computes the same function, how the repository's
config.json translates into that model's config, and which checkpoint tensors make each of its
parameters. The reference (`streamed_model`) then runs transformers' own code for it, and the GGUF family
of the architecture reads the same declaration of the fused layouts (`split_internlm2_wqkv`).

InternLM2 (InternLM2ForCausalLM) is a Llama block: RMSNorm, rotary attention with grouped KV heads, SwiGLU.
Its checkpoint names the modules differently and fuses Q, K and V into one `wqkv` whose rows are grouped by
KV head: for each of the `n_kv` heads, its `n_head / n_kv` query heads, then its key head, then its value
head (`head_dim` rows each). Its tokenizer is SentencePiece (`tokenizer.model`) with a BOS token in front,
which `sentencepiece` itself computes (`SentencePieceTokenizer`).

InternVL (InternVLChatModel) is transformers' InternVLForConditionalGeneration under other names, with a fused
vision q/k/v: declared in native_internvl.py. Its tokenizer is transformers' own class (Qwen2's), and the image
placeholder's id, which its config.json does not hold, is read from the tokenizer files (`files`).

Code that reads config.json's fields (sizes, the text config, the architecture) reads `native_dict`: the native
config as a dict, so a remote-code layout (InternVL's `llm_config`) is seen where transformers' own would be.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import HiveError, ModelFormatError
from . import native_internvl


@dataclass(frozen=True)
class NativeEquivalent:
    architecture: str
    model_type: str  # the transformers model type that computes the same function
    native_architecture: str
    config: Callable[[dict[str, Any]], dict[str, Any]]  # the repository's config.json -> the native config's
    rename: tuple[tuple[str, str], ...]  # (native parameter regex, checkpoint name template) one to one
    fused: Callable[[str, dict[str, Any]], tuple[str, Callable[[Any], Any]] | None]  # native name -> (source, take)
    # how the reference tokenizes: "sentencepiece" over tokenizer.model (the repository's tokenizer class is remote
    # code), or "auto": transformers' own tokenizer class that the repository names
    tokenizer: str = "sentencepiece"
    # native config values that files other than config.json hold (the directory -> values)
    files: Callable[[Path], dict[str, Any]] | None = None


def split_internlm2_wqkv(w, n_head: int, n_kv: int):
    """InternLM2's fused `wqkv` [(n_head + 2 n_kv) * d, hidden] -> (q, k, v) in the usual head-major rows.
    Works on numpy arrays and torch tensors alike (reshape and slicing only)."""
    rows, cols = w.shape[0], w.shape[-1]
    groups = n_head // n_kv
    if n_head % n_kv or rows % (n_head + 2 * n_kv):
        raise ModelFormatError(f"an InternLM2 wqkv of {rows} rows does not hold {n_head} query and {n_kv} KV heads")
    d = rows // (n_head + 2 * n_kv)
    grouped = w.reshape(n_kv, groups + 2, d, cols)
    return (grouped[:, :groups].reshape(n_head * d, cols), grouped[:, groups].reshape(n_kv * d, cols),
            grouped[:, groups + 1].reshape(n_kv * d, cols))


def _internlm2_config(cfg: dict[str, Any]) -> dict[str, Any]:
    heads = cfg["num_attention_heads"]
    out = {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta",
                               "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings",
                               "hidden_act", "initializer_range") if k in cfg}
    out["num_key_value_heads"] = cfg.get("num_key_value_heads", heads)
    out["attention_bias"] = bool(cfg.get("bias", False))  # InternLM2's one `bias` switch: wqkv and wo
    out["mlp_bias"] = False
    scaling = cfg.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, dict) or (scaling.get("type") or scaling.get("rope_type")) not in ("linear", "dynamic"):
            raise ModelFormatError(f"InternLM2 rope_scaling {scaling!r} is not linear or dynamic")
        out["rope_scaling"] = {"rope_type": scaling.get("type") or scaling.get("rope_type"),
                               "factor": float(scaling["factor"])}
    return out


_QKV = re.compile(r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)")


def _internlm2_fused(name: str, cfg: dict[str, Any]):
    m = _QKV.fullmatch(name)
    if not m:
        return None
    layer, which, kind = m.groups()
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    index = "qkv".index(which)

    def take(w):
        if kind == "bias":
            return split_internlm2_wqkv(w.reshape(-1, 1), heads, kv)[index].reshape(-1)
        return split_internlm2_wqkv(w, heads, kv)[index]

    return f"model.layers.{layer}.attention.wqkv.{kind}", take


EQUIVALENTS: dict[str, NativeEquivalent] = {
    e.architecture: e for e in (
        NativeEquivalent(
            architecture="InternLM2ForCausalLM", model_type="llama", native_architecture="LlamaForCausalLM",
            config=_internlm2_config,
            rename=((r"model\.embed_tokens\.(.*)", "model.tok_embeddings.{0}"),
                    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.(.*)", "model.layers.{0}.attention.wo.{1}"),
                    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.(.*)", "model.layers.{0}.feed_forward.w1.{1}"),
                    (r"model\.layers\.(\d+)\.mlp\.up_proj\.(.*)", "model.layers.{0}.feed_forward.w3.{1}"),
                    (r"model\.layers\.(\d+)\.mlp\.down_proj\.(.*)", "model.layers.{0}.feed_forward.w2.{1}"),
                    (r"model\.layers\.(\d+)\.input_layernorm\.(.*)", "model.layers.{0}.attention_norm.{1}"),
                    (r"model\.layers\.(\d+)\.post_attention_layernorm\.(.*)", "model.layers.{0}.ffn_norm.{1}"),
                    (r"model\.norm\.(.*)", "model.norm.{0}"),
                    (r"lm_head\.(.*)", "output.{0}")),
            fused=_internlm2_fused,
        ),
        NativeEquivalent(
            architecture=native_internvl.ARCHITECTURE, model_type=native_internvl.MODEL_TYPE,
            native_architecture=native_internvl.NATIVE_ARCHITECTURE, config=native_internvl.config,
            rename=native_internvl.RENAME, fused=native_internvl.fused, tokenizer="auto",
            files=native_internvl.files,
        ),
    )
}


def read_config(model_dir: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ModelFormatError(f"config.json cannot be read: {type(e).__name__}: {e}") from None
    if not isinstance(cfg, dict):
        raise ModelFormatError("config.json is not an object")
    return cfg


def equivalent_for(cfg: dict[str, Any]) -> NativeEquivalent | None:
    archs = cfg.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    return EQUIVALENTS.get(arch or "")


# config.json fields that mean the same for the native form, which its readers ask of it (a pre-quantized repository
# stays one: the recipes that convert float weights only refuse it)
_CARRIED = ("quantization_config",)


def _native_kwargs(eq: NativeEquivalent, cfg: dict[str, Any]) -> dict[str, Any]:
    """The native config's arguments; one line (HiveError) for a config.json without a native form (the
    declaration's refusal: NotApplicableError) or that does not translate (ModelFormatError)."""
    try:
        return eq.config(cfg)
    except KeyError as e:
        raise ModelFormatError(f"config.json has no {e.args[0]} (needed for {eq.architecture})") from None
    except (TypeError, ValueError, ArithmeticError, IndexError, AttributeError) as e:  # a field of the wrong kind
        raise ModelFormatError(f"config.json of {eq.architecture} does not translate to {eq.native_architecture}: "
                               f"{type(e).__name__}: {e}") from None


def native_problem(eq: NativeEquivalent, cfg: dict[str, Any]) -> str | None:
    """Why `cfg` has no native form under `eq`, in one line (None: it translates)."""
    try:
        _native_kwargs(eq, cfg)
    except HiveError as e:
        return str(e)
    return None


def native_dict(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json as its native equivalent's config.json reads (model_type, architectures, the text config nested
    as transformers nests it; values from other files aside): config.json itself for an architecture without one,
    or whose translation fails (building it then refuses in one line). For the code that reads config.json's
    fields: memory plans, sanity checks, the AI 100 families."""
    eq = equivalent_for(cfg) if isinstance(cfg, dict) else None
    if eq is None:
        return cfg
    try:
        kwargs = _native_kwargs(eq, cfg)
    except HiveError:  # refused where it is built (and by the check of a target that builds it)
        return cfg
    carried = {k: cfg[k] for k in _CARRIED if k in cfg}
    return {**kwargs, **carried, "model_type": eq.model_type, "architectures": [eq.native_architecture]}


def native_config(model_dir: Path):
    """The transformers config of `model_dir`: its own, or its native equivalent's (never remote code)."""
    from transformers import AutoConfig

    cfg = read_config(model_dir)
    eq = equivalent_for(cfg)
    if eq is None:
        return AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False, local_files_only=True), None
    kwargs = _native_kwargs(eq, cfg)
    if eq.files is not None:
        kwargs.update(eq.files(model_dir))
    config = AutoConfig.for_model(eq.model_type, **kwargs)
    config.architectures = [eq.native_architecture]
    return config, eq


def write_native_config(model_dir: Path, path: Path) -> None:
    """The native equivalent's config.json, as transformers' save_pretrained writes it, at `path`: the config of
    an artifact converted to the native form (what serves it never meets the repository's remote code)."""
    config, _eq = native_config(model_dir)
    config.to_json_file(str(path), use_diff=True)


def checkpoint_source(eq: NativeEquivalent, name: str, cfg: dict[str, Any]) -> tuple[str, Callable[[Any], Any] | None] | None:
    """The checkpoint tensor a native parameter comes from, and the slice of it to take (None: all of it)."""
    fused = eq.fused(name, cfg)
    if fused is not None:
        return fused
    for pattern, template in eq.rename:
        m = re.fullmatch(pattern, name)
        if m:
            return template.format(*m.groups()), None
    return None


class SentencePieceTokenizer:
    """The reference tokenizer of a SentencePiece model whose repository's own tokenizer class is remote code:
    `sentencepiece` encodes (what those classes wrap), with the BOS id in front as they add it. The slice of
    the transformers tokenizer API that hive-aot uses."""

    def __init__(self, model_dir: Path):
        import sentencepiece

        path = model_dir / "tokenizer.model"
        if not path.is_file():
            raise ModelFormatError("tokenizer.model is missing (the tokenizer of this architecture is SentencePiece)")
        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        try:
            tcfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise ModelFormatError(f"tokenizer_config.json cannot be read: {type(e).__name__}: {e}") from None
        self.add_bos = bool(tcfg.get("add_bos_token", True))
        self.add_eos = bool(tcfg.get("add_eos_token", False))
        bos, eos = self.sp.bos_id(), self.sp.eos_id()
        self.bos_token_id = bos if bos >= 0 else None
        self.eos_token_id = eos if eos >= 0 else None
        self.added_tokens_decoder: dict[int, Any] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(self.sp.encode(text))
        if add_special_tokens:
            ids = ([self.bos_token_id] if self.add_bos and self.bos_token_id is not None else []) + ids
            ids += [self.eos_token_id] if self.add_eos and self.eos_token_id is not None else []
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.sp.decode([int(i) for i in ids])

    def get_vocab(self) -> dict[str, int]:
        return {self.sp.id_to_piece(i): i for i in range(self.sp.get_piece_size())}

    def get_added_vocab(self) -> dict[str, int]:
        return {}

    def __call__(self, text: str):
        return type("Encoding", (), {"input_ids": self.encode(text)})()


__all__ = ["EQUIVALENTS", "NativeEquivalent", "SentencePieceTokenizer", "checkpoint_source", "equivalent_for",
           "native_config", "native_dict", "native_problem", "split_internlm2_wqkv", "write_native_config"]
