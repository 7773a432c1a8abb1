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
    """A 2-layer Llama/Mistral with the tokenizer of `tokenizer_dir` and its config's vocab_size (SmolLM2's BPE:
    49152; `make_small_bpe_tokenizer`'s cut: 2048)."""
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


# SmolLM2's byte-level BPE cut to its first 2,048 tokens: its 17 special tokens, its 235 single characters and its
# first 1,796 merges (SmolLM2 numbers each merge's result by the merge's rank), so the cut is a whole, smaller BPE
# with the same pre-tokenizer. A tiny model's parameters, logits and GGUF vocabulary are almost all vocabulary (49,152
# x hidden 64), so the GGUF family tests run on the cut one; the full one's pre-tokenizer check stays tested on it.
SMALL_BPE_VOCAB = 2048
# llama.cpp's name for SmolLM2's pre-tokenizer: the full vocabulary's check hash maps to it. The cut vocabulary's
# check ids differ, so its conversions name the pre-tokenizer explicitly (the recipe option `bpe_pre_fallback`).
SMOLLM2_PRE = "smollm"


def make_small_bpe_tokenizer(dest: Path, tokenizer_dir: Path, size: int = SMALL_BPE_VOCAB) -> Path:
    """SmolLM2's tokenizer files with the vocabulary cut to ids < size and the merges to those that make them;
    config.json gives the size (make_llama reads it)."""
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    bpe = spec["model"]
    unmerged = len(bpe["vocab"]) - len(bpe["merges"])  # special tokens and single characters come first
    vocab = {token: i for token, i in bpe["vocab"].items() if i < size}
    merges = bpe["merges"][:size - unmerged]
    for rank, pair in enumerate(merges):
        joined = "".join(pair.split(" ") if isinstance(pair, str) else pair)
        assert vocab.get(joined) == unmerged + rank, f"merge {rank} does not make token {unmerged + rank}"
    assert all(t["id"] < size for t in spec["added_tokens"])
    bpe["vocab"], bpe["merges"] = vocab, merges
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    for name in TOKENIZER_FILES:
        if name != "tokenizer.json" and (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, dest / name)
    (dest / "config.json").write_text(json.dumps({"vocab_size": size}))
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


# Random-weight tiny models have flat logits (49152-way, no trained structure), so small numerical differences
# flip top-1 choices that a trained model keeps: 4- and 8-bit quantization flips many, and even f16 (llama.cpp
# rounds activations to f16) flips a few positions per thousand. The shipped gates are calibrated on
# SmolLM2-135M; tests that must publish a tiny model use a copy of the recipes with these gates instead, so that
# a change of the prompt set cannot push a mechanics test over a quality threshold. f16 stays strict on KL.
# The project's GGUF recipes (recipes/gguf-*.yaml) and the CPU tier's order of them (registry.yaml), written out
# rather than read from those files, so that adding, losing or reordering one is done on purpose.
GGUF_RECIPES = ["gguf-bf16", "gguf-f16", "gguf-iq2_xs", "gguf-iq4_nl", "gguf-iq4_xs", "gguf-q2_k", "gguf-q3_k_l",
                "gguf-q3_k_m", "gguf-q3_k_s", "gguf-q4_0", "gguf-q4_k_m", "gguf-q4_k_s", "gguf-q5_0", "gguf-q5_k_m",
                "gguf-q5_k_s", "gguf-q6_k", "gguf-q8_0"]
CPU_PREFERENCE = ["gguf-q4_k_m", "gguf-q5_k_m", "gguf-q4_k_s", "gguf-q5_k_s", "gguf-q6_k", "gguf-q8_0", "gguf-iq4_xs",
                  "gguf-iq4_nl", "gguf-q5_0", "gguf-q4_0", "gguf-q3_k_l", "gguf-q3_k_m", "gguf-q3_k_s", "gguf-q2_k",
                  "gguf-iq2_xs", "gguf-bf16", "gguf-f16"]

LENIENT_VALIDATION = {"min_top1_agreement": 0.3, "max_mean_kl": 1.0, "require_token_parity": True}
TEST_GATES = {
    "gguf-f16": {"min_top1_agreement": 0.95, "max_mean_kl": 0.001, "require_token_parity": True},
    "gguf-q8_0": LENIENT_VALIDATION,
    "gguf-q4_k_m": LENIENT_VALIDATION,
    # vLLM against transformers, both fp32 on the same bf16 artifact: a near-uniform random model can still
    # flip a teacher-forced top-1 at a near-tie; greedy divergences at near-ties are not counted by the metric.
    "vllm-bf16": {"min_top1_agreement": 0.99, "max_mean_kl": 0.001, "require_token_parity": True,
                  "require_engine_load": True, "min_vllm_top1_agreement": 0.97, "max_vllm_logprob_delta": 0.05,
                  "min_vllm_greedy_agreement": 1.0},
    "vllm-fp8": {"min_top1_agreement": 0.3, "max_mean_kl": 1.0, "require_token_parity": True,
                 "max_weight_rel_error": 0.05, "require_engine_load": False},
}


def write_test_config(dest_dir: Path, repo_root: Path, *, models: list[dict[str, Any]] | None = None,
                      gates: dict[str, dict[str, Any]] | None = None) -> Path:
    """registry.yaml + recipes/ in dest_dir: the project's, with the validation gates replaced per recipe
    (default TEST_GATES; pass {} for an exact copy)."""
    import yaml

    recipes = dest_dir / "recipes"
    shutil.copytree(repo_root / "recipes", recipes)
    for rid, gate in (TEST_GATES if gates is None else gates).items():
        p = recipes / f"{rid}.yaml"
        data = yaml.safe_load(p.read_text())
        data["validation"] = dict(gate)
        p.write_text(yaml.safe_dump(data, sort_keys=False))
    return write_registry(dest_dir, repo_root, models=models if models is not None else [], recipes_dir=recipes)


# --- SentencePiece (Llama-2 style) tokenizers, trained here --------------------------------------

from pipelines.model.spm_tokenizer import WORDS  # noqa: E402

_SPM_WORDS = WORDS


def spm_corpus(lines: int = 4000, seed: int = 0) -> list[str]:
    """Varied English-like sentences with punctuation, digits, decimals, dates and a little code."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_SPM_WORDS) for _ in range(rng.randint(3, 16))]
        s = " ".join(words)
        if rng.random() < 0.6:
            s = s[0].upper() + s[1:] + rng.choice(".!?;:,")
        r = rng.random()
        if r < 0.25:
            s += f" {rng.randint(0, 10 ** rng.randint(1, 8))}"
        elif r < 0.4:
            s += f" {rng.random() * 1000:.{rng.randint(1, 4)}f}"
        elif r < 0.5:
            s = f"{rng.randint(1900, 2100)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} {s}"
        elif r < 0.6:
            s = f"{rng.choice(_SPM_WORDS)} = {rng.choice(_SPM_WORDS)}({rng.randint(0, 99)}, '{rng.choice(_SPM_WORDS)}')"
        out.append(s)
    return out


def make_spm_tokenizer(dest: Path, *, add_dummy_prefix: bool = True, vocab_size: int = 700,
                       hf_tokenizer: str = "llama", seed: int = 0) -> Path:
    """Train a SentencePiece BPE model (byte fallback; Llama-2 settings: identity normalization, whitespace
    kept) and write HF tokenizer files next to `tokenizer.model`.

    hf_tokenizer="llama": transformers 5 `LlamaTokenizer` built from the SentencePiece vocab and merges
    (transformers rebuilds its Metaspace pipeline on load; its own SentencePiece conversion needs
    sentencepiece's protobuf module, which does not import next to protobuf 6).
    hf_tokenizer="legacy": the tokenizer.json layout Llama-2 repos ship (Prepend + Replace normalizer,
    no pre-tokenizer), loaded as-is through `PreTrainedTokenizerFast`.
    """
    from pipelines.model.synthetic import spm_vocab, train_spm, write_spm_tokenizer

    dest.mkdir(parents=True, exist_ok=True)
    proto = train_spm(spm_corpus(seed=seed), vocab_size, add_dummy_prefix=add_dummy_prefix)
    if hf_tokenizer == "llama":
        from transformers import LlamaTokenizer

        (dest / "tokenizer.model").write_bytes(proto)
        vocab, merges = spm_vocab(proto)
        tok = LlamaTokenizer(vocab=vocab, merges=merges, add_prefix_space=add_dummy_prefix, legacy=False,
                             add_bos_token=True, add_eos_token=False)
        tok.save_pretrained(str(dest))
        pieces = len(vocab)
    elif hf_tokenizer == "legacy":
        pieces = write_spm_tokenizer(dest, proto, add_dummy_prefix=add_dummy_prefix)
    else:
        raise ValueError(f"unknown hf_tokenizer {hf_tokenizer!r}")
    (dest / "config.json").write_text(json.dumps({"vocab_size": pieces}))  # read by make_llama
    return dest


def make_spm_llama(dest: Path, *, add_dummy_prefix: bool = True, hf_tokenizer: str = "llama", spm_vocab: int = 700,
                   **overrides: Any) -> Path:
    """A tiny Llama whose vocabulary is a freshly trained SentencePiece model (tokenizer.model kept in the dir)."""
    tok_dir = make_spm_tokenizer(dest.parent / f"{dest.name}-tokenizer", add_dummy_prefix=add_dummy_prefix,
                                 vocab_size=spm_vocab, hf_tokenizer=hf_tokenizer)
    make_llama(dest, tok_dir, **overrides)
    shutil.copy(tok_dir / "tokenizer.model", dest / "tokenizer.model")
    return dest


def rewrite_published_manifest(store: Path, recipe: str, edit, build_id: str = "*") -> Path:
    """What anyone with write access to a local store can do without a signing key: rewrite a published
    manifest (`edit(doc)` changes the decoded document) and fix the sha256 its recipe's `latest` ref records, so
    only a signature (or serve's own policy) can tell. Returns the manifest's path."""
    import hashlib

    mpath = next(store.glob(f"manifests/*/{recipe}/{build_id}.json"))
    doc = json.loads(mpath.read_text())
    edit(doc)
    raw = (json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n").encode()
    mpath.write_bytes(raw)
    ref = next(store.glob(f"refs/*/{recipe}/latest"))
    r = json.loads(ref.read_text())
    r["manifest_sha256"] = hashlib.sha256(raw).hexdigest()
    ref.write_text(json.dumps(r))
    return mpath


def rewrite_safetensors(model_dir: Path, edit) -> None:
    """Load model.safetensors as numpy (bf16 widened to float32), let `edit(dict)` change it, write it back."""
    import numpy as np
    from safetensors.numpy import save_file

    import pipelines.source.safetensors_io as sio

    path = model_dir / "model.safetensors"
    with sio.SafetensorsFile(path) as f:
        tensors = {n: np.array(f.float32(n)) for n in f.header.tensors}
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def make_sharded_llama(dest: Path, *, hidden: int = 256, intermediate: int = 704, layers: int = 4, vocab: int = 32000,
                       heads: int = 8, kv_heads: int = 2, shards: int = 3) -> tuple[Path, int]:
    """A Llama-layout repo split into `shards` safetensors files with an index; tensor data are zeros
    written as sparse files (headers are what the header-only check reads). Returns (dir, parameters)."""
    import struct

    head_dim = hidden // heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
                                          "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (intermediate, hidden), p + "mlp.up_proj.weight": (intermediate, hidden),
            p + "mlp.down_proj.weight": (hidden, intermediate), p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        })
    names = list(shapes)
    per = -(-len(names) // shards)
    dest.mkdir(parents=True, exist_ok=True)
    weight_map, total_params = {}, 0
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        header, offset = {}, 0
        for n in names[s * per:(s + 1) * per]:
            numel = 1
            for d in shapes[n]:
                numel *= d
            header[n] = {"dtype": "BF16", "shape": list(shapes[n]), "data_offsets": [offset, offset + 2 * numel]}
            offset += 2 * numel
            total_params += numel
            weight_map[n] = fname
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(dest / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 2 * total_params},
                                                                   "weight_map": weight_map}))
    (dest / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    return dest, total_params


def make_qwen2(dest: Path, tokenizer_dir: Path, *, seed: int = 0, **overrides: Any) -> Path:
    """A 2-layer Qwen2 (q/k/v biases, randomized: transformers initializes them to zero) with SmolLM2's
    tokenizer files. transformers loads them as Qwen2Tokenizer (qwen2's own pre-tokenizer regex)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    params = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=True,
                  bos_token_id=1, eos_token_id=2)
    params.update(overrides)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**params))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    dest.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(str(dest), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, dest / name)
    return dest


# --- tiny random causal LMs of every AI 100 text family (qaic export tests) ----------------------------

_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
_GPT = dict(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=256, initializer_range=0.2, bos_token_id=0,
            eos_token_id=1)
TINY_CAUSAL_LMS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # name: (config class, model class, config) -- every name is a transformers 5 class
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_TINY, head_dim=16)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(_TINY, head_dim=16, hidden_act="gelu_pytorch_tanh",
                                                      tie_word_embeddings=True)),
    # sliding_window (4096 by default) stays longer than any test sequence: full attention equals it there
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(_TINY, head_dim=16, query_pre_attn_scalar=24,
                                                         attn_logit_softcapping=4.0, final_logit_softcapping=8.0)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_TINY, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(_GPT, activation_function="gelu_new")),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(_GPT, rotary_dim=8, tie_word_embeddings=False)),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(_GPT, multi_query=True)),
    "gpt_bigcode_mha": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(_GPT, multi_query=False)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(_TINY, embedding_multiplier=4.0, residual_multiplier=0.5,
                                                            attention_multiplier=0.1, logits_scaling=2.0)),
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
        new_decoder_architecture=True, alibi=False, bias=True, max_position_embeddings=256, initializer_range=0.2)),
    "falcon_mqa": ("FalconConfig", "FalconForCausalLM", dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
        parallel_attn=True, new_decoder_architecture=False, alibi=False, max_position_embeddings=256,
        initializer_range=0.2)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(_TINY)),
    # LayerNorms and every projection with biases, a plain c_fc/c_proj MLP; a window of 16 on every layer: the
    # parity test's 12 + 8 positions pass it. At initializer_range 0.2 greedy decoding repeats one token.
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(_TINY, sliding_window=16, initializer_range=0.5)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_TINY, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        _TINY, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=False,
        mlp_only_layers=[1])),
    # sliding layers (every other one) with a window of 16: the parity test runs 12 + 8 positions, past it
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(_TINY, head_dim=16, num_local_experts=4,
                                                         num_experts_per_tok=2, intermediate_size=64,
                                                         sliding_window=16)),
}


def make_tiny_causal_lm(name: str, dest: Path, *, seed: int = 0, **overrides: Any) -> Path:
    """A 2-layer random model of one TINY_CAUSAL_LMS entry (vocab 512, hidden 64, fp32, no tokenizer);
    biases are randomized too (transformers initializes most to zero)."""
    cfg_name, model_name, params = TINY_CAUSAL_LMS[name]
    return make_causal_lm(cfg_name, model_name, {**params, **overrides}, dest, seed=seed)


def make_causal_lm(config_class: str, model_class: str, params: dict[str, Any], dest: Path, *, seed: int = 0,
                   tokenizer_dir: Path | None = None, router_scale: float = 1.0) -> Path:
    """A random transformers model from its config class and parameters (fp32 safetensors), with biases and
    norm weights randomized (transformers initializes them to 0 and 1, which hides a wrong mapping), and the
    tokenizer files of `tokenizer_dir` copied in when given. `router_scale` multiplies MoE router weights
    (`mlp.gate`): a random router sits near top-k ties that any rounding flips; a trained one is decisive."""
    import torch
    import transformers

    cfg = getattr(transformers, config_class)(**params)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or pname.endswith("_bias") or pname.endswith("sinks"):
                p.normal_(0.0, 0.2)
            elif "norm" in pname or "ln_" in pname:  # norm weights around 1 (Gemma's around 0: scale 1 + w)
                p.add_(torch.randn_like(p) * 0.1)
            if pname.endswith("mlp.gate.weight"):
                p.mul_(router_scale)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(dest), safe_serialization=True)
    for fname in TOKENIZER_FILES if tokenizer_dir is not None else ():
        if (tokenizer_dir / fname).is_file():
            shutil.copy(tokenizer_dir / fname, dest / fname)
    return dest


def store_contract(store, ref: str) -> None:
    """The opening every store's contract test shares, on an empty store: writable, an absent key reads as absent,
    a document at `ref` (a key under refs/, for the store's own layout) written, overwritten whole, sized, listed
    and dated."""
    store.check_writable()
    assert store.read_bytes(ref) is None and store.size("x/y") is None and not store.exists("x/y")
    store.write_bytes(ref, b'{"a": 1}')
    store.write_bytes(ref, b'{"a": 2}')  # overwrite is whole
    assert store.read_json(ref) == {"a": 2} and store.size(ref) == 8
    assert store.list("refs/") == [ref] and store.modified(ref) > 0


def ecdsa_keypair(d: Path, name: str, curve: str = "P-256") -> tuple[Path, Path]:
    """(private PEM, public PEM) of a fresh ECDSA key (P-256, P-384 or P-521) written under `d`: a publisher's
    OpenSSF Model Signing key and what a puller trusts."""
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key({"P-256": ec.SECP256R1(), "P-384": ec.SECP384R1(), "P-521": ec.SECP521R1()}[curve])
    return _write_keypair(key, d, name)


def _write_keypair(key, d: Path, name: str) -> tuple[Path, Path]:
    """`key` as `<name>.pem` (PKCS#8, unencrypted) and its public key as `<name>.pub` (SubjectPublicKeyInfo)."""
    from cryptography.hazmat.primitives import serialization

    priv, pub = d / f"{name}.pem", d / f"{name}.pub"
    priv.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo))
    return priv, pub


def legacy_ed25519_signature(manifest_bytes: bytes, private_pem: Path) -> bytes:
    """The signature document hive-aot wrote before OpenSSF Model Signing (Ed25519 over the manifest's bytes):
    what stores signed then still hold, and pull still verifies with the Ed25519 public key."""
    import base64
    import hashlib

    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(private_pem.read_bytes(), password=None)
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return json.dumps({"algorithm": "ed25519", "key_id": hashlib.sha256(raw).hexdigest()[:16],
                       "signature": base64.b64encode(key.sign(manifest_bytes)).decode()}, indent=1).encode()


def ed25519_keypair(d: Path, name: str) -> tuple[Path, Path]:
    """(private PEM, public PEM) of a fresh Ed25519 key written under `d`: the key of stores signed before OpenSSF
    Model Signing (legacy_ed25519_signature), and what hive-aot now refuses as a signing key."""
    from cryptography.hazmat.primitives.asymmetric import ed25519

    return _write_keypair(ed25519.Ed25519PrivateKey.generate(), d, name)

