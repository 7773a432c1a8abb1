"""Runtime profile descriptions of a prepared vLLM directory, one per platform the model routes to.

Mechanism here, platform facts in registry.yaml (each profile's `serving:` holds `env` and `tiers`:
how that platform loads each tier). Engine arguments come from the compatibility estimate for the
platform's default device (max_model_len, max_num_seqs, tensor_parallel_size); architectures vLLM runs
through its Transformers backend get `--model-impl transformers`; architectures vLLM does not run at
all are described for the transformers fallback profile instead. Sliding windows are served as configured:
`--disable-sliding-window` would make vLLM cap `max_model_len` at the window (Gemma 3: 512 or 1024 tokens),
so a GPU profile never passes it (the seed's Gemma note is for AI 100's vLLM: pipelines/targets/qaic/serving.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...compat import database
from ...compat.hardware import hardware_for_vendor
from .. import MODEL_DIR

if TYPE_CHECKING:
    from ...config.registry import RuntimeProfile
    from .. import BuildContext

TIER_OF = {"none": "bf16", "fp8-dynamic": "fp8-dynamic", "w4a16-gptq": "w4a16", "int8-dynamic": "w8a8-int8"}

def _flags(args: dict[str, Any]) -> list[str]:
    out = []
    for key, value in args.items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return out


def _vllm(ctx: BuildContext, prof: RuntimeProfile, compat, tier: str) -> dict[str, Any]:
    rec = database.cached(ctx.registry).lookup(compat.architecture or "")
    rc = compat.estimated_requirements.get("recommended_config") or {}
    args = {
        "served_model_name": ctx.model_id,
        # auto: bf16 where the device has it; vLLM itself casts to float16 where it does not (T4, Arc A770)
        "dtype": "auto",
        "max_model_len": rc.get("max_model_len"),
        "max_num_seqs": rc.get("max_num_seqs"),
        "tensor_parallel_size": rc.get("tensor_parallel_size"),
        "gpu_memory_utilization": rc.get("gpu_memory_utilization"),
        "kv_cache_dtype": rc.get("kv_cache_dtype", "auto"),
        "quantization": "compressed-tensors" if tier != "bf16" else None,
        "model_impl": "transformers" if rec is not None and rec.vllm_support == "transformers-backend" else None,
        "trust_remote_code": ctx.trust_remote_code,
        "generation_config": "auto",
    }
    return {
        "engine": "vllm", "image": prof.image, "tier": tier,
        "loads_as": (prof.serving.get("tiers") or {}).get(tier),
        "engine_args": {k: v for k, v in args.items() if v is not None and v is not False},
        "env": {"HF_HUB_OFFLINE": "1", **(prof.serving.get("env") or {})},
        "command": ["vllm", "serve", MODEL_DIR, *_flags(args)],
        "sized_for": compat.hardware,
    }


def _transformers(ctx: BuildContext, prof: RuntimeProfile, compat, tier: str) -> dict[str, Any]:
    return {
        "engine": "transformers", "image": prof.image, "tier": tier,
        "engine_args": {"pretrained_model_name_or_path": MODEL_DIR, "dtype": "bfloat16",
                        "trust_remote_code": ctx.trust_remote_code},
        "env": {"HF_HUB_OFFLINE": "1", **(prof.serving.get("env") or {})},
        "command": None, "sized_for": compat.hardware,
    }


def describe(ctx: BuildContext) -> dict[str, dict[str, Any]]:
    """profile id -> description, for each profile of the recipe that its vendor's hardware routes this model to."""
    tier = TIER_OF[ctx.recipe.options.get("quantization", "none")]
    out = {}
    for prof in ctx.profiles():
        compat = ctx.classify(hardware_for_vendor(prof.vendor))
        if compat.status == "incompatible" or compat.runtime_profile_id != prof.id:
            continue
        out[prof.id] = (_vllm if prof.role == "vllm" else _transformers)(ctx, prof, compat, tier)
    return out
