"""The compatibility check: the same object the platform's live check returns.

status (compatible | requires_review | incompatible), runtime_profile_id, checks [{name, status,
detail}], estimated_requirements, and the recipes this project can build for the model.
Status speaks of the platform; `recipes` speaks of this project's converters.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any, Iterable, Literal

from pydantic import BaseModel, Field

from ..errors import HiveError
from ..safetensors_io import TensorSource
from . import database

if TYPE_CHECKING:
    from ..config import Recipe
    from ..sources import Snapshot

Status = Literal["compatible", "requires_review", "incompatible"]

# Bounds beyond which a config is not a model we should try to read (guards against absurd allocations).
PLAUSIBLE = {
    "hidden_size": 131072, "num_hidden_layers": 2048, "num_attention_heads": 4096, "num_key_value_heads": 4096,
    "intermediate_size": 1048576, "vocab_size": 8_388_608, "max_position_embeddings": 1 << 27, "head_dim": 4096,
}


class Check(BaseModel):
    name: str
    status: Literal["pass", "warn", "fail"]
    detail: str


class Compatibility(BaseModel):
    status: Status
    runtime_profile_id: str | None
    architecture: str | None
    family: str | None = None
    hardware: str = "nvidia"
    checks: list[Check]
    estimated_requirements: dict[str, Any] = Field(default_factory=dict)
    recipes: list[str] = Field(default_factory=list)

    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]

    def reason(self) -> str:
        bad = self.failed() or [c for c in self.checks if c.status == "warn"]
        return "; ".join(f"{c.name}: {c.detail}" for c in bad) or self.status


def _sanity(cfg: dict[str, Any]) -> list[str]:
    problems = []
    text_cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    for key, bound in PLAUSIBLE.items():
        if key not in text_cfg or text_cfg[key] is None:
            continue
        v = text_cfg[key]
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0 or v > bound:
            problems.append(f"{key}={v!r} is not plausible")
    h, n = text_cfg.get("hidden_size"), text_cfg.get("num_attention_heads")
    if not problems and isinstance(h, int) and isinstance(n, int) and "head_dim" not in text_cfg and h % n:
        problems.append(f"hidden_size={h} is not divisible by num_attention_heads={n}")
    return problems


_EMBED_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")


def _vocab_consistency(cfg: dict[str, Any], tensors: TensorSource) -> str | None:
    vocab = (cfg.get("text_config") or cfg).get("vocab_size")
    if not isinstance(vocab, int):
        return None
    for name in tensors:
        if name.endswith(_EMBED_SUFFIXES):
            rows = tensors.info(name).shape[0]
            if rows != vocab:
                return f"config vocab_size={vocab} but {name} has {rows} rows"
            return None
    return None


def classify(
    cfg: dict[str, Any] | None,
    *,
    tensors: TensorSource | None = None,
    has_tokenizer: bool = True,
    hardware: str = "nvidia",
    recipes: Iterable["Recipe"] = (),
    config_error: str | None = None,
) -> Compatibility:
    from ..targets import target_for

    checks: list[Check] = []
    vendor = hardware.split("-", 1)[0]
    if vendor not in database.VENDOR_LLM_PROFILE:
        raise HiveError(f"unknown hardware {hardware!r} (vendors: {', '.join(database.VENDOR_LLM_PROFILE)})")
    if cfg is None:
        checks.append(Check(name="config", status="fail", detail=config_error or "config.json is missing"))
        return Compatibility(status="incompatible", runtime_profile_id=None, architecture=None,
                             hardware=hardware, checks=checks)

    archs = cfg.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    record = database.lookup(arch) if arch else None
    status: Status = "compatible"
    profile: str | None = None

    if arch is None:
        checks.append(Check(name="architecture_known", status="fail", detail="config.json has no architectures field"))
        status = "incompatible"
    elif record is None:
        close = difflib.get_close_matches(arch, list(database.ARCHITECTURES), n=1)
        hint = f" (closest known: {close[0]})" if close else ""
        checks.append(Check(name="architecture_known", status="warn",
                            detail=f"{arch} is not in the architecture database yet{hint}"))
        status = "requires_review"
    else:
        detail = f"{arch}: family {record.family}, task {record.task}"
        if record.tested:
            detail += f", tested on {record.default_profile}"
            if record.throughput_tok_s:
                detail += f" ({record.throughput_tok_s} tok/s)"
        checks.append(Check(name="architecture_known", status="pass", detail=detail))
        profile = record.default_profile if vendor == "nvidia" else database.VENDOR_LLM_PROFILE[vendor]

    if "auto_map" in cfg:
        checks.append(Check(name="remote_code", status="warn",
                            detail="config.json has auto_map (custom modeling code): requires review; hive-aot never executes it"))
        if status == "compatible":
            status = "requires_review"
    else:
        checks.append(Check(name="remote_code", status="pass", detail="no custom code"))

    problems = _sanity(cfg)
    if problems:
        checks.append(Check(name="config_sane", status="fail", detail="; ".join(problems)))
        status = "incompatible"
    else:
        checks.append(Check(name="config_sane", status="pass", detail="sizes plausible"))

    reqs: dict[str, Any] = {}
    if tensors is not None:
        checks.append(Check(name="weights_safetensors", status="pass",
                            detail=f"{len(tensors.files)} safetensors file(s), {len(tensors.names())} tensors"))
        by_dtype = tensors.bytes_by_dtype()
        reqs = {"parameters": tensors.parameters, "weights_bytes": sum(by_dtype.values()),
                "weights_bytes_by_dtype": by_dtype}
        mismatch = _vocab_consistency(cfg, tensors)
        if mismatch:
            checks.append(Check(name="vocab_consistent", status="fail", detail=mismatch))
            status = "incompatible"
        else:
            checks.append(Check(name="vocab_consistent", status="pass", detail="embedding rows match vocab_size"))
    checks.append(Check(name="tokenizer_present", status="pass" if has_tokenizer else "warn",
                        detail="tokenizer files present" if has_tokenizer else "no tokenizer.json or tokenizer.model"))

    applicable = []
    if status != "incompatible" and arch is not None:
        for r in recipes:
            t = target_for(r.kind)
            if t.supports(arch, cfg):
                applicable.append(r.id)
        if vendor == "cpu":
            gguf = [r for r in recipes if r.id in applicable and "llm-llamacpp-cpu" in r.runtime_profiles]
            profile = "llm-llamacpp-cpu" if gguf else None
            if not gguf:
                status = "incompatible"
                checks.append(Check(name="cpu_tier", status="fail", detail=f"no GGUF recipe applies to {arch}"))
    return Compatibility(status=status, runtime_profile_id=profile if status != "incompatible" else None,
                         architecture=arch, family=record.family if record else None, hardware=hardware,
                         checks=checks, estimated_requirements=reqs, recipes=applicable)


def classify_snapshot(snap: "Snapshot", recipes: Iterable["Recipe"] = (), hardware: str = "nvidia") -> Compatibility:
    """Classify a fetched snapshot: config, safetensors headers (strictly checked), tokenizer presence."""
    from ..errors import ModelFormatError

    cfg, err = None, None
    try:
        cfg = snap.config()
    except ModelFormatError as e:
        err = str(e)
    tensors = TensorSource(snap.safetensors_files()) if snap.safetensors_files() else None
    try:
        return classify(cfg, tensors=tensors, has_tokenizer=snap.has("tokenizer.json") or snap.has("tokenizer.model"),
                        hardware=hardware, recipes=list(recipes), config_error=err)
    finally:
        if tensors is not None:
            tensors.close()
