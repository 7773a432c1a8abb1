"""Tiny but real models for tests: transformers configs -> random weights, real tokenizers.

Weights use a large initializer range so logits are far from uniform and parity metrics mean
something. The BPE tokenizer is SmolLM2's real one (from the demo model); SentencePiece models
are trained here with the sentencepiece trainer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make_llama(dest: Path, tokenizer_dir: Path, *, arch: str = "LlamaForCausalLM", tie: bool = True,
               dtype: str = "bfloat16", seed: int = 0, **overrides: Any) -> Path:
    """A 2-layer Llama/Mistral with SmolLM2's BPE tokenizer (vocab 49152)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    cfg_cls, model_cls = (MistralConfig, MistralForCausalLM) if arch == "MistralForCausalLM" else (LlamaConfig, LlamaForCausalLM)
    params = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=tie,
                  bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    params.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**params)).to(getattr(torch, dtype))
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(dest), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, dest / name)
    return dest


def edit_config(model_dir: Path, **changes: Any) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg, indent=2))


def copy_model(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, symlinks=True)
    return dest


# --- helpers appended for the engine tests ------------------------------------------------------

def write_registry(dest_dir: Path, repo_root: Path, *, models: list[dict[str, Any]] | None = None,
                   recipes_dir: Path | None = None, **changes: Any) -> Path:
    """A copy of the project's registry.yaml in dest_dir (recipes_dir made absolute), with changes applied."""
    import yaml

    data = yaml.safe_load((repo_root / "registry.yaml").read_text())
    data["recipes_dir"] = str((recipes_dir or repo_root / "recipes").resolve())
    if models is not None:
        data["models"] = models
    data.update(changes)
    dest_dir.mkdir(parents=True, exist_ok=True)
    path = dest_dir / "registry.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def raw_safetensors(path: Path, header: dict[str, Any] | bytes, data: bytes = b"", *,
                    header_len: int | None = None) -> Path:
    """Write a safetensors file byte by byte (for malformed-file tests): u64 LE length, header, data."""
    import struct

    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


def rewrite_safetensors_header(path: Path, edit) -> None:
    """Apply edit(header_dict) to a real safetensors file's header; the data section is left as it is."""
    import struct

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * ((8 - len(new) % 8) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def poison_weights(model_dir: Path, tensor: str = "model.layers.0.mlp.down_proj.weight", value: float = float("nan")) -> None:
    """Set one element of a tensor to NaN (or another value) in model.safetensors, keeping its dtype."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    t = tensors[tensor].clone()
    t.view(-1)[0] = value
    tensors[tensor] = t
    save_file(tensors, str(path), metadata={"format": "pt"})


# Random-weight tiny models have flat logits, so 4- and 8-bit quantization flips many top-1 choices that a
# trained model keeps (the shipped thresholds are calibrated on SmolLM2-135M). Tests that must publish a
# quantized tiny model use a copy of the recipes with these gates instead; f16 keeps the shipped gates.
LENIENT_VALIDATION = {"min_top1_agreement": 0.3, "max_mean_kl": 1.0, "require_token_parity": True}


def write_test_config(dest_dir: Path, repo_root: Path, *, models: list[dict[str, Any]] | None = None,
                      lenient: tuple[str, ...] = ("gguf-q8_0", "gguf-q4_k_m")) -> Path:
    """registry.yaml + recipes/ in dest_dir: the project's, with lenient validation for the named recipes."""
    import yaml

    recipes = dest_dir / "recipes"
    shutil.copytree(repo_root / "recipes", recipes)
    for rid in lenient:
        p = recipes / f"{rid}.yaml"
        data = yaml.safe_load(p.read_text())
        data["validation"] = dict(LENIENT_VALIDATION)
        p.write_text(yaml.safe_dump(data, sort_keys=False))
    return write_registry(dest_dir, repo_root, models=models if models is not None else [], recipes_dir=recipes)
