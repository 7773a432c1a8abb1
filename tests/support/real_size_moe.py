"""The 2025-26 frontier MoE models at their real sizes, headers only: config.json as released and safetensors whose
headers declare every tensor under its released name and shape (per-expert or fused as the checkpoint stores
them), with the data sections left as holes (sparse files: nothing is written, a 671B model costs a few MB).

For planning tests (`hive-aot plan` reads headers only). Configs are the released ones (the values that set
sizes and layer layouts); the shards are ~5 GB as released. DeepSeek-V3 is its bf16 form (the released FP8
checkpoint's weights, upcast, as community bf16 uploads ship it).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

SHARD_BYTES = 5 * 10**9
Tensor = tuple[str, list[int], str]  # name, shape, dtype


def _attention_gqa(p: str, c: dict, bias: bool, qk_norm: bool) -> Iterator[Tensor]:
    h, hd, heads, kv = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    for proj, rows in (("q_proj", heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)):
        yield f"{p}.self_attn.{proj}.weight", [rows, h], "BF16"
        if bias:
            yield f"{p}.self_attn.{proj}.bias", [rows], "BF16"
    yield f"{p}.self_attn.o_proj.weight", [h, heads * hd], "BF16"
    if qk_norm:
        yield f"{p}.self_attn.q_norm.weight", [hd], "BF16"
        yield f"{p}.self_attn.k_norm.weight", [hd], "BF16"


def _norms(p: str, h: int) -> Iterator[Tensor]:
    yield f"{p}.input_layernorm.weight", [h], "BF16"
    yield f"{p}.post_attention_layernorm.weight", [h], "BF16"


def _swiglu(p: str, h: int, inter: int) -> Iterator[Tensor]:
    yield f"{p}.gate_proj.weight", [inter, h], "BF16"
    yield f"{p}.up_proj.weight", [inter, h], "BF16"
    yield f"{p}.down_proj.weight", [h, inter], "BF16"


def _experts(p: str, h: int, inter: int, n: int) -> Iterator[Tensor]:
    for x in range(n):
        yield from _swiglu(f"{p}.experts.{x}", h, inter)


def _sigmoid_moe(p: str, c: dict) -> Iterator[Tensor]:
    """DeepSeek-V3 / GLM-4.5 MoE: router with its selection bias, routed and shared experts."""
    h, e, inter = c["hidden_size"], c["n_routed_experts"], c["moe_intermediate_size"]
    yield f"{p}.mlp.gate.weight", [e, h], "BF16"
    yield f"{p}.mlp.gate.e_score_correction_bias", [e], "F32"
    yield from _experts(f"{p}.mlp", h, inter, e)
    yield from _swiglu(f"{p}.mlp.shared_experts", h, inter * c["n_shared_experts"])


def qwen3_235b() -> tuple[dict, Iterator[Tensor]]:
    c = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096,
         "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8,
         "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
         "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
         "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
         "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16"}

    def tensors() -> Iterator[Tensor]:
        h = c["hidden_size"]
        yield "model.embed_tokens.weight", [c["vocab_size"], h], "BF16"
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}"
            yield from _norms(p, h)
            yield from _attention_gqa(p, c, bias=False, qk_norm=True)
            yield f"{p}.mlp.gate.weight", [c["num_experts"], h], "BF16"
            yield from _experts(f"{p}.mlp", h, c["moe_intermediate_size"], c["num_experts"])
        yield "model.norm.weight", [h], "BF16"
        yield "lm_head.weight", [c["vocab_size"], h], "BF16"

    return c, tensors()


def deepseek_v3() -> tuple[dict, Iterator[Tensor]]:
    c = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
         "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
         "num_experts_per_tok": 8, "num_hidden_layers": 61, "first_k_dense_replace": 3, "num_attention_heads": 128,
         "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
         "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280, "n_group": 8, "topk_group": 4,
         "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
         "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
         "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                          "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
         "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16"}

    def tensors() -> Iterator[Tensor]:
        h, heads = c["hidden_size"], c["num_attention_heads"]
        qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        yield "model.embed_tokens.weight", [c["vocab_size"], h], "BF16"
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}"
            yield from _norms(p, h)
            a = f"{p}.self_attn"
            yield f"{a}.q_a_proj.weight", [c["q_lora_rank"], h], "BF16"
            yield f"{a}.q_a_layernorm.weight", [c["q_lora_rank"]], "BF16"
            yield f"{a}.q_b_proj.weight", [heads * qk, c["q_lora_rank"]], "BF16"
            yield f"{a}.kv_a_proj_with_mqa.weight", [c["kv_lora_rank"] + c["qk_rope_head_dim"], h], "BF16"
            yield f"{a}.kv_a_layernorm.weight", [c["kv_lora_rank"]], "BF16"
            yield f"{a}.kv_b_proj.weight", [heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]], "BF16"
            yield f"{a}.o_proj.weight", [h, heads * c["v_head_dim"]], "BF16"
            if i < c["first_k_dense_replace"]:
                yield from _swiglu(f"{p}.mlp", h, c["intermediate_size"])
            else:
                yield from _sigmoid_moe(p, c)
        yield "model.norm.weight", [h], "BF16"
        yield "lm_head.weight", [c["vocab_size"], h], "BF16"

    return c, tensors()


def glm_4_6() -> tuple[dict, Iterator[Tensor]]:
    c = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 5120,
         "intermediate_size": 12288, "moe_intermediate_size": 1536, "n_routed_experts": 160, "n_shared_experts": 1,
         "num_experts_per_tok": 8, "num_hidden_layers": 92, "first_k_dense_replace": 3, "num_attention_heads": 96,
         "num_key_value_heads": 8, "head_dim": 128, "partial_rotary_factor": 0.5, "vocab_size": 151552,
         "use_qk_norm": True, "attention_bias": True, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
         "norm_topk_prob": True, "max_position_embeddings": 202752, "num_nextn_predict_layers": 1,
         "rope_theta": 1000000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
         "eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329, "torch_dtype": "bfloat16"}

    def tensors() -> Iterator[Tensor]:
        h = c["hidden_size"]
        yield "model.embed_tokens.weight", [c["vocab_size"], h], "BF16"
        for i in range(c["num_hidden_layers"] + c["num_nextn_predict_layers"]):  # the MTP layer last, as released
            p = f"model.layers.{i}"
            yield from _norms(p, h)
            yield from _attention_gqa(p, c, bias=True, qk_norm=True)
            if i < c["first_k_dense_replace"]:
                yield from _swiglu(f"{p}.mlp", h, c["intermediate_size"])
            else:
                yield from _sigmoid_moe(p, c)
            if i >= c["num_hidden_layers"]:
                yield f"{p}.eh_proj.weight", [h, 2 * h], "BF16"
                for norm in ("enorm", "hnorm", "shared_head.norm"):
                    yield f"{p}.{norm}.weight", [h], "BF16"
        yield "model.norm.weight", [h], "BF16"
        yield "lm_head.weight", [c["vocab_size"], h], "BF16"

    return c, tensors()


def llama4_maverick() -> tuple[dict, Iterator[Tensor]]:
    text = {"model_type": "llama4_text", "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
            "num_local_experts": 128, "num_experts_per_tok": 1, "num_hidden_layers": 48, "interleave_moe_layer_step": 2,
            "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 202048,
            "rope_theta": 500000.0, "attention_chunk_size": 8192, "use_qk_norm": True, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 1048576, "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(48)],
            "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1, "hidden_act": "silu",
            "bos_token_id": 200000, "eos_token_id": [200001, 200007, 200008], "tie_word_embeddings": False}
    c = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "text_config": text,
         "tie_word_embeddings": False, "torch_dtype": "bfloat16"}

    def tensors() -> Iterator[Tensor]:
        h, e, inter = text["hidden_size"], text["num_local_experts"], text["intermediate_size"]
        yield "language_model.model.embed_tokens.weight", [text["vocab_size"], h], "BF16"
        for i in range(text["num_hidden_layers"]):
            p = f"language_model.model.layers.{i}"
            yield from _norms(p, h)
            yield from _attention_gqa(p, text, bias=False, qk_norm=False)
            f = f"{p}.feed_forward"
            if (i + 1) % text["interleave_moe_layer_step"] == 0:
                yield f"{f}.router.weight", [e, h], "BF16"
                yield f"{f}.experts.gate_up_proj", [e, h, 2 * inter], "BF16"
                yield f"{f}.experts.down_proj", [e, inter, h], "BF16"
                yield from _swiglu(f"{f}.shared_expert", h, inter)
            else:
                yield from _swiglu(f, h, text["intermediate_size_mlp"])
        yield "language_model.model.norm.weight", [h], "BF16"
        yield "language_model.lm_head.weight", [text["vocab_size"], h], "BF16"

    return c, tensors()


MODELS = {"qwen3-235b-a22b": qwen3_235b, "deepseek-v3": deepseek_v3, "glm-4.6": glm_4_6,
          "llama-4-maverick": llama4_maverick}
SIZE = {"F32": 4, "BF16": 2}


def write(name: str, dest: Path, tokenizer_dir: Path | None = None) -> tuple[Path, int]:
    """The model's directory (config, sharded header-only safetensors, index, tokenizer files copied from
    `tokenizer_dir`) and its parameter count."""
    config, tensors = MODELS[name]()
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    shards: list[list[Tensor]] = [[]]
    used, parameters = 0, 0
    for t in tensors:
        n = 1
        for d in t[1]:
            n *= d
        parameters += n
        if used and used + n * SIZE[t[2]] > SHARD_BYTES:
            shards.append([])
            used = 0
        shards[-1].append(t)
        used += n * SIZE[t[2]]
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for tname, shape, dtype in shard:
            nbytes = SIZE[dtype]
            for d in shape:
                nbytes *= d
            header[tname] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
            weight_map[tname] = fname
            offset += nbytes
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(dest / fname, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            f.truncate(8 + len(raw) + offset)
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for fname in ("tokenizer.json", "tokenizer_config.json"):
        if tokenizer_dir is not None and (tokenizer_dir / fname).is_file():
            (dest / fname).write_bytes((tokenizer_dir / fname).read_bytes())
    return dest, parameters
