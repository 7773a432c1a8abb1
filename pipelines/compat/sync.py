"""`hive-aot registry sync`: regenerate the architecture database snapshot from real sources.

Sources, each recorded with its version in the snapshot:
- vLLM's model registry (`vllm/model_executor/models/registry.py`), parsed statically from the
  release wheel (downloaded with `pip download --no-deps vllm==X`, never imported or installed):
  which architectures vLLM runs natively, through its Transformers backend, or used to run.
- transformers' auto mappings (class -> model_type and task), from the installed transformers.
- llama.cpp's converter (`llama_cpp_archs.py`), from the llama-cpp-python sdist the CPU tier pins: which
  architectures it converts to GGUF, as which llama.cpp architecture, and whether a projector (mmproj) comes too.

The output, `pipelines/compat/data/architectures.json`, is committed, so classification needs no
heavy import at run time. Curated facts (the seeds' tested rows, notes, aliases, AI 100 matrix)
live in `registry.yaml` and are merged at load time (`database.py`).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Any

from ..core.errors import HiveError
from ..core.paths import cache_root

REGISTRY_MEMBER = "vllm/model_executor/models/registry.py"

# vLLM registry dict -> task, in priority order: an architecture listed in several tables (e.g.
# LlavaNext is a chat VLM and an embedding model) takes the first. The transformers tables are
# refined from transformers' own mappings.
VLLM_TASKS = {
    "_TEXT_GENERATION_MODELS": "causal-lm",
    "_MULTIMODAL_MODELS": "vision-language",
    "_TRANSFORMERS_SUPPORTED_MODELS": None,
    "_TRANSFORMERS_BACKEND_MODELS": None,
    "_EMBEDDING_MODELS": "embedding",
    "_LATE_INTERACTION_MODELS": "embedding",
    "_REWARD_MODELS": "reranker",
    "_TOKEN_CLASSIFICATION_MODELS": "reranker",
    "_SEQUENCE_CLASSIFICATION_MODELS": "reranker",
    "_SPECULATIVE_DECODING_MODELS": "speculative-draft",
}

# transformers auto mapping -> task, most specific first.
TRANSFORMERS_TASKS = [
    ("MODEL_FOR_TIME_SERIES_PREDICTION_MAPPING_NAMES", "time-series"),
    ("MODEL_FOR_TIME_SERIES_CLASSIFICATION_MAPPING_NAMES", "time-series"),
    ("MODEL_FOR_TIME_SERIES_REGRESSION_MAPPING_NAMES", "time-series"),
    ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "seq2seq-audio"),
    ("MODEL_FOR_CTC_MAPPING_NAMES", "seq2seq-audio"),
    ("MODEL_FOR_TEXT_TO_WAVEFORM_MAPPING_NAMES", "text-to-audio"),
    ("MODEL_FOR_TEXT_TO_SPECTROGRAM_MAPPING_NAMES", "text-to-audio"),
    ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "vision-language"),
    ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "causal-lm"),
    ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "seq2seq"),
    ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "reranker"),
    ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "embedding"),
    ("MODEL_FOR_TEXT_ENCODING_MAPPING_NAMES", "embedding"),
]

# SSM and SSM/attention hybrids: the seed's fine-tuning-only family.
SSM_RE = re.compile(r"^(Mamba|Mamba2|FalconMamba|Jamba|Zamba|Zamba2|Bamba)(For|Model)")

# The seed's representative families, by class-name pattern (first match wins).
FAMILIES = [
    ("ssm-hybrid", SSM_RE),
    ("llama", re.compile(r"^(Llama|CodeLlama|Mllama)")),
    ("mistral", re.compile(r"^(Mistral|Mixtral|Ministral|Pixtral|Voxtral)")),
    ("qwen", re.compile(r"^Q[Ww]en")),
    ("gemma", re.compile(r"^(Gemma|PaliGemma|VaultGemma|RecurrentGemma|ShieldGemma)")),
    ("phi", re.compile(r"^Phi")),
    ("deepseek", re.compile(r"^(Deepseek|DeepSeek)")),
    ("glm", re.compile(r"^(ChatGLM|Glm|GLM)")),
    ("gpt-classic", re.compile(r"^(GPT2|GPTNeoX|GPTJ|GPTNeo|GPTBigCode|Bloom|OPT|Falcon|MPT|Mpt)")),
    ("moe", re.compile(r"^(GptOss|NemotronH|Granite.*Moe|Olmoe|Dbrx|Arctic)")),
]


def parse_vllm_registry(source: str) -> dict[str, dict[str, Any]]:
    """Module-level dict literals of vLLM's registry.py, without importing vLLM."""
    tables: dict[str, dict[str, Any]] = {}
    for node in ast.parse(source).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if not isinstance(target, ast.Name) or not isinstance(value, ast.Dict):
            continue
        items = {}
        for k, v in zip(value.keys, value.values):
            if k is None:  # `**OTHER_TABLE` spreads
                continue
            items[ast.literal_eval(k)] = ast.literal_eval(v)
        tables[target.id] = items
    missing = [t for t in list(VLLM_TASKS) + ["_PREVIOUSLY_SUPPORTED_MODELS"] if t not in tables]
    if missing:
        raise HiveError(f"vLLM registry.py has no {', '.join(missing)}: the format changed, update sync.py")
    return tables


def vllm_registry_source(version: str, wheel: Path | None = None) -> str:
    if wheel is None:
        cache = cache_root() / "downloads" / "vllm"
        cache.mkdir(parents=True, exist_ok=True)
        found = sorted(cache.glob(f"vllm-{version}-*.whl"))
        if not found:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache),
                            f"vllm=={version}"], check=True)
            found = sorted(cache.glob(f"vllm-{version}-*.whl"))
        if not found:
            raise HiveError(f"could not download the vllm {version} wheel")
        wheel = found[0]
    with zipfile.ZipFile(wheel) as z:
        return z.read(REGISTRY_MEMBER).decode("utf-8")


def transformers_classes() -> tuple[dict[str, str], dict[str, str], str]:
    """(class -> task, class -> model_type, transformers version)."""
    from transformers.models.auto import modeling_auto as auto

    task: dict[str, str] = {}
    model_type: dict[str, str] = {}
    for table, t in TRANSFORMERS_TASKS:
        for mtype, classes in getattr(auto, table, {}).items():
            for cls in classes if isinstance(classes, (list, tuple)) else [classes]:
                task.setdefault(cls, t)
                model_type.setdefault(cls, mtype)
    for mtype, classes in auto.MODEL_MAPPING_NAMES.items():
        for cls in classes if isinstance(classes, (list, tuple)) else [classes]:
            model_type.setdefault(cls, mtype)
    return task, model_type, metadata.version("transformers")


def family_of(name: str, model_type: str | None) -> str:
    for family, pattern in FAMILIES:
        if pattern.match(name):
            return family
    if model_type:
        return re.sub(r"[\d_]+$", "", model_type.replace("-", "_")) or model_type
    stem = re.sub(r"(ForCausalLM|LMHeadModel|ForConditionalGeneration|Model|ForSequenceClassification|"
                  r"ForTokenClassification|ForMaskedLM|MTP.*|ForPrediction)$", "", name)
    return re.sub(r"[\dV_.]+$", "", stem).lower() or name.lower()


def build_snapshot(vllm_version: str, wheel: Path | None = None, llama_cpp_version: str = "0.3.36",
                   llama_cpp_sdist: Path | None = None) -> dict[str, Any]:
    from . import llama_cpp_archs

    tables = parse_vllm_registry(vllm_registry_source(vllm_version, wheel))
    t_task, t_type, t_version = transformers_classes()
    records: dict[str, dict[str, Any]] = {}
    for table, task in VLLM_TASKS.items():
        for arch, (module, cls) in tables[table].items():
            if arch in records:
                continue  # listed in a higher-priority table already
            support = "transformers-backend" if module == "transformers" else "native"
            records[arch] = {"name": arch,
                             "task": task or t_task.get(arch) or ("vision-language" if "MultiModal" in cls else "causal-lm"),
                             "vllm": {"support": support, "module": module, "class": cls, "table": table.strip("_").lower()}}
    for arch, last in tables["_PREVIOUSLY_SUPPORTED_MODELS"].items():
        rec = records.setdefault(arch, {"name": arch})
        rec.setdefault("vllm", {"support": None, "last_version": last})
    # transformers-only generative architectures: the universal fallback's domain
    for cls, task in t_task.items():
        if task in ("causal-lm", "vision-language", "time-series", "seq2seq-audio", "text-to-audio", "embedding", "reranker"):
            records.setdefault(cls, {"name": cls, "vllm": {"support": None}})
    for name, rec in records.items():
        mtype = t_type.get(name)
        rec["transformers"] = {"model_type": mtype, "task": t_task.get(name)} if (mtype or name in t_task) else None
        task = rec.get("task") or t_task.get(name) or "causal-lm"
        if SSM_RE.match(name):
            task = "ssm-hybrid"
        if task == "vision-language" and t_task.get(name) in ("seq2seq-audio", "text-to-audio"):
            task = t_task[name]
        if re.search(r"(Whisper|Speech|Asr|ASR)", name) and task == "vision-language":
            task = "seq2seq-audio"
        rec["task"] = task
        rec["family"] = family_of(name, mtype)
    converted = llama_cpp_archs.from_sdist(llama_cpp_sdist or llama_cpp_archs.sdist(llama_cpp_version))
    with_llama_cpp(records, converted)
    return {
        "about": "generated by `hive-aot registry sync`; curated overrides live in registry.yaml",
        "sources": {"vllm": vllm_version, "transformers": t_version, "llama_cpp_python": llama_cpp_version},
        "architectures": dict(sorted(records.items())),
    }


def with_llama_cpp(records: dict[str, dict[str, Any]], converted: dict[str, dict[str, Any]]) -> None:
    """Record on each known architecture what llama.cpp's converter makes of it (`llama_cpp_archs.parse`)."""
    for name, rec in records.items():
        if name in converted:
            rec["llama_cpp"] = dict(converted[name])


def write_snapshot(doc: dict[str, Any], path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def snapshot_path() -> Path:
    from importlib import resources

    return Path(str(resources.files(__package__).joinpath("data/architectures.json")))
