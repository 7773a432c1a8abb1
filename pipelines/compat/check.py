"""The compatibility check: the same object the platform's live check returns.

status (compatible | requires_review | incompatible), runtime_profile_id, checks [{name, status,
detail}], estimated_requirements, and the recipes this project can build for the model. Status
speaks of the platform; `recipes` speaks of this project's converters.

Routing (the seed's rules; each target is the active profile of that role for the hardware's vendor):
- diffusers pipelines (`model_index.json`) -> diffusers; text-to-audio -> generative (NVIDIA only)
- time series, embeddings, rerankers, speech-to-text -> the vendor's specialists backend
  (`specialists-ts-cu121` is the NVIDIA specialists image, `inference-specialists`)
- SSM / hybrid -> requires_review (fine-tuning templates only), mamba-vllm-cu121 on NVIDIA
- causal LMs and vision-language models vLLM runs (natively or through its Transformers backend)
  -> vLLM; other architectures transformers knows -> the transformers fallback
- `--hardware cpu`: the GGUF tier (the gguf-role profile, llm-llamacpp-cpu) when a recipe it loads applies,
  else transformers-cpu
- `--hardware qaic-*`: vllm-qaic serves only what hive-aot compiles, so the recipes it loads decide first: none
  converts the model -> incompatible, saying why (their targets' `refusal`: "no hive-aot exporter for <task>
  models yet"), never routed; else compatible for the AI 100 validated matrix, and requires_review for an
  exported architecture outside it until the registry marks the model reviewed (then compatible)
- unknown class: incompatible, or requires_review with `auto_map` (remote code, never executed here)
- any `auto_map`: requires_review until the registry marks the model reviewed
Deactivated profiles are never chosen.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ..model.native import equivalent_for, native_dict
from ..source.safetensors_io import TensorSource
from .database import Architecture, cached as architecture_database
from .hardware import Hardware, parse_hardware
from .layout import headless_embedding
from .requirements import WeightsSummary, serving_requirements
from .results import Check, Compatibility, Status
from .sanity import config_problems, text_cfg

if TYPE_CHECKING:
    from ..config.registry import Recipe, Registry
    from ..source.fetch import Snapshot


# quant_method values transformers (QuantizationMethod, 5.23) and vLLM 0.33 load; anything else is not a model
# any engine of the platform can read as quantized.
QUANT_METHODS = frozenset({
    "aqlm", "auto-round", "awq", "bitnet", "bitsandbytes", "compressed-tensors", "eetq", "fbgemm_fp8", "fouroversix",
    "fp8", "fp_quant", "gemma", "gguf", "gptq", "higgs", "hqq", "metal", "mxfp4", "mxfp8", "nvfp4", "quanto", "quark",
    "sinq", "spqr", "torchao", "vptq",
    "awq_marlin", "bitblas", "deepspeedfp", "experts_int8", "gptq_bitblas", "gptq_marlin", "gptq_marlin_24", "inc",
    "ipex", "marlin", "modelopt", "modelopt_fp4", "moe_wna16", "petit_nvfp4", "ptpc_fp8", "qqq", "rtn", "tpu_int8",
})
# transformers model types a class serves that neither its name spells nor the snapshot records (the snapshot keeps
# one model type per class, e.g. LlamaForCausalLM -> internlm3); from transformers 5.23's auto mappings.
EXTRA_MODEL_TYPES = {
    "LlamaForCausalLM": ("llama", "iquestcoder"), "LlamaModel": ("llama", "iquestcoder"),
    "Gemma3ForConditionalGeneration": ("shieldgemma2",),
    "Glm46VForConditionalGeneration": ("glmga",), "GotOcr2ForConditionalGeneration": ("pp_chart2table",),
}
SPECIALIST_TASKS = {"time-series", "embedding", "reranker", "seq2seq-audio"}


def _model_type_problem(cfg: dict[str, Any], rec: Architecture, arch: str) -> str | None:
    """transformers builds the model from `model_type`, vLLM from `architectures`: they must name the same model."""
    if "model_type" not in cfg or rec.transformers_model_type is None:
        return None  # nothing to compare against (vLLM-only class, or no model_type at all)
    mt = cfg["model_type"]
    if not isinstance(mt, str):
        return f"model_type={mt!r} is not a string naming the model type of architecture {arch}"
    known = {rec.transformers_model_type, *EXTRA_MODEL_TYPES.get(rec.name, ())}
    if mt in known:
        return None

    def norm(s: str) -> str:
        return re.sub(r"[^a-z0-9]", "", s.lower())

    # The class name spells the model type (Qwen2_5_VLForConditionalGeneration / qwen2_5_vl, Gemma3ForCausalLM /
    # gemma3_text): the snapshot records only one model type per class.
    stems = {norm(re.sub(r"(For[A-Z]\w*|LMHeadModel|Model|Backbone)$", "", n)) for n in (rec.name, arch, *rec.aliases)}
    if {norm(mt), norm(re.sub(r"_(text|vision)(_model)?$", "", mt))} & stems:
        return None
    return f"model_type {mt!r} contradicts architecture {arch} (transformers model type: {', '.join(sorted(known))})"


def _quantization(cfg: dict[str, Any]) -> tuple[str | None, str | None]:
    """(quant_method, problem) of config.json's quantization_config; (None, None) when there is none."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return None, None
    if not isinstance(qc, dict):
        return None, f"quantization_config={qc!r:.60} is not an object with a quant_method"
    method = qc.get("quant_method")
    if not isinstance(method, str) or method.lower() not in QUANT_METHODS:
        return None, f"quantization_config has unknown quant_method {method!r:.60}"
    return method.lower(), None


_EMBED_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")


def _vocab_consistency(cfg: dict[str, Any], weights: WeightsSummary) -> str | None:
    vocab = text_cfg(cfg).get("vocab_size")
    if not isinstance(vocab, int):
        return None
    heads = [shape[0] for name, shape in weights.shapes.items() if name.endswith("lm_head.weight") and shape]
    for name, shape in weights.shapes.items():
        if name.endswith(_EMBED_SUFFIXES) and shape:
            # extra rows past an output head of vocab_size rows are input-only tokens the head never predicts
            # (Llama 3.2 Vision's <|image|> and 7 reserved rows); fewer rows would index out of the table
            if shape[0] != vocab and not (shape[0] > vocab and heads == [vocab]):
                return f"config vocab_size={vocab} but {name} has {shape[0]} rows"
            return None
    return None


class _Profiles:
    def __init__(self, registry: Registry | None):
        self.active = [p for p in (registry.runtime_profiles if registry else []) if p.active]

    def pick(self, hw: Hardware, role: str) -> str | None:
        return next((p.id for p in self.active if p.vendor == hw.profile_vendor and p.role == role), None)


def _answer(status: Status, profile: str | None, level: str, detail: str) -> tuple[Status, str | None, Check]:
    return status, profile, Check(name="architecture_known", status=level, detail=detail)


def _validated_kin(db, name: str) -> list[str]:
    """The AI 100 validated matrix's architectures whose class name starts as `name`'s model does (Qwen3ForCausalLM:
    Qwen3MoeForCausalLM, Qwen3VLForConditionalGeneration, ...): what the platform validated instead of it."""
    stem = re.sub(r"(For[A-Z]\w*|LMHeadModel|Model)$", "", name)
    return sorted(a.name for a in db.architectures.values() if a.qaic and a.name != name and stem
                  and a.name.startswith(stem))


def _route(rec: Architecture | None, arch: str | None, task: str, hw: Hardware, profiles: _Profiles,
           auto_map: bool, reviewed: bool, gguf_applies: bool, closest: str | None,
           unbuilt: Callable[[str], str | None], gguf_after_review: bool = False,
           validated_kin: list[str] | None = None) -> tuple[Status, str | None, Check]:
    """(status, runtime profile, the architecture_known check explaining it). `gguf_after_review`: a GGUF
    recipe converts this remote-code repo with hive-aot's own mapping once a human reviews it. `unbuilt(role)`:
    why no recipe that the role's profile loads converts the model (None: one does). `validated_kin`: the AI 100
    matrix's nearest architectures (_validated_kin)."""

    def pick(role: str) -> str | None:
        return profiles.pick(hw, role)

    def served_by(role: str, detail: str, why_not: str) -> tuple[Status, str | None, Check]:
        prof = pick(role)
        return _answer("compatible", prof, "pass", detail) if prof else _answer(
            "incompatible", None, "fail", f"{detail}; no {why_not} backend on {hw.vendor}")

    def compiled_ahead(detail: str) -> tuple[Status, str | None, Check]:
        # vllm-qaic loads only the QPCs hive-aot compiles: what its recipes convert decides, before remote code,
        # SSM or any other rule (nothing else could serve the model there).
        why = unbuilt("qaic")
        if why:
            return _answer("incompatible", None, "fail", f"{detail}; {why}")
        if rec is not None and rec.qaic:
            return _answer("compatible", pick("qaic"), "pass", f"{detail}; in the AI 100 validated matrix")
        if reviewed:
            return _answer("compatible", pick("qaic"), "pass", f"{detail}; not in the AI 100 validated matrix, "
                           "reviewed: hive-aot's export builds it")
        # What is unvalidated and what the review means, in the one line that check and a refused build print.
        name = rec.name if rec is not None else arch
        kin = f"validates {', '.join(validated_kin)} but not {name}" if validated_kin else f"does not list {name}"
        return _answer("requires_review", pick("qaic"), "warn", (
            f"{detail}; not in the AI 100 validated matrix: Qualcomm's AOT list {kin}; hive-aot's export builds it, "
            "checked against transformers (onnxruntime parity, predicted device quality) but never compiled or run on "
            "an AI 100 here; `reviewed: true` on this model in registry.yaml records that a person accepts that, and "
            "then it builds"))

    def remote_code(detail: str) -> tuple[Status, str | None, Check]:
        # The seed's universal fallback serves custom modeling_*.py with transformers, after review; a config
        # without auto_map declares no such code, so nothing could serve it.
        if not auto_map:
            return _answer("incompatible", None, "fail",
                           f"{detail.replace(' once reviewed', '')}, and this config declares none (no auto_map)")
        prof = pick("transformers")
        if reviewed and prof:
            return _answer("compatible", prof, "pass", f"{detail} (reviewed: trust_remote_code allowed)")
        return _answer("requires_review", None, "warn", detail)

    if task == "diffusion":
        return served_by("diffusers", f"diffusers pipeline {arch}", "diffusers")
    if rec is None:
        hint = f" (closest known: {closest})" if closest else ""
        if hw.vendor == "qaic":
            return compiled_ahead(f"{arch} is not in the architecture database{hint}")
        if auto_map:
            return remote_code(f"{arch} is not in the architecture database; it ships remote code{hint}")
        return _answer("incompatible", None, "fail", f"{arch} is not in the architecture database{hint}")
    detail = f"{rec.name}: family {rec.family}, task {rec.task}"
    if rec.name != arch:
        detail = f"{arch} is an alias of {detail}"
    if rec.tested:
        detail += ", tested on " + ", ".join(p + (f" ({v} tok/s)" if v else "") for p, v in rec.tested.items())
    if hw.vendor == "qaic":
        return compiled_ahead(detail)
    if not rec.active:
        why = f"vLLM dropped {rec.name} after {rec.vllm_last_version}" if rec.vllm_last_version else f"{rec.name} is inactive"
        if auto_map:
            return remote_code(f"{why}; only its remote code could serve it")
        return _answer("incompatible", None, "fail", f"{why} and transformers has no class for it")
    if rec.trust_remote_code and not rec.vllm_support and not rec.transformers_known:
        return remote_code(f"{detail}; served by the transformers fallback with the repo's own modeling code once reviewed")
    if task == "ssm-hybrid":
        return _answer("requires_review", pick("ssm"), "warn",
                       f"{detail}; SSM/hybrid: fine-tuning templates only, untested, no public inference endpoint")
    if task == "text-to-audio":
        return served_by("generative", detail, "generative")
    if task in SPECIALIST_TASKS:
        return served_by("specialists", detail, "specialists")
    if task == "speculative-draft":
        prof = pick("vllm")
        if prof in rec.tested:  # e.g. the GLM-4 MoE MTP heads validated on vllm-xpu
            return _answer("compatible", prof, "pass", detail)
        return _answer("requires_review", prof, "warn", f"{detail}; a draft/MTP head, served with its target model")
    if hw.vendor == "cpu":
        if gguf_applies:
            return _answer("compatible", pick("gguf"), "pass", detail)
        if rec.llama_cpp_arch and not gguf_after_review:  # llama.cpp runs it; hive-aot cannot build its GGUF yet
            detail += (f"; llama.cpp's converter makes it a {rec.llama_cpp_arch} GGUF, but no GGUF recipe here "
                       f"converts it ({unbuilt('gguf')})")
        if rec.transformers_known:
            return _answer("compatible", pick("transformers"), "pass", detail)
        if gguf_after_review:
            return _answer("requires_review", None, "warn",
                           f"{detail}; hive-aot's own GGUF mapping converts it for {pick('gguf')} once reviewed "
                           "(its remote code is never run)")
        if auto_map:  # the CPU tier's transformers fallback runs the repo's own code, once reviewed
            return remote_code(f"{detail}; the transformers fallback with the repo's own modeling code once reviewed")
        return _answer("incompatible", None, "fail", f"{detail}; no GGUF recipe and no transformers class for the CPU tier")
    if rec.vllm_support:
        return _answer("compatible", pick("vllm"), "pass", detail)
    if rec.transformers_known:
        return _answer("compatible", pick("transformers"), "pass", f"{detail}; transformers fallback (slower than vLLM-native)")
    return _answer("incompatible", None, "fail", f"{detail}; no backend serves it")


def classify(
    cfg: dict[str, Any] | None,
    *,
    weights: WeightsSummary | None = None,
    files: Iterable[str] = (),
    hardware: str = "nvidia",
    recipes: Iterable[Recipe] = (),
    registry: Registry | None = None,
    reviewed: bool = False,
    config_error: str | None = None,
) -> Compatibility:
    from ..config.kinds import target_for

    hw = parse_hardware(hardware)
    files = set(files)
    recipes = list(recipes)  # read more than once below
    checks: list[Check] = []
    if cfg is None:
        checks.append(Check(name="config", status="fail", detail=config_error or "config.json is missing"))
        return Compatibility(status="incompatible", runtime_profile_id=None, architecture=None, hardware=hw.spec, checks=checks)
    db = architecture_database(registry)
    profiles = _Profiles(registry)

    pipeline = cfg.get("_diffusers_pipeline") or (cfg.get("_class_name") if "_diffusers_version" in cfg else None)
    archs = cfg.get("architectures")
    if pipeline:
        arch, rec, task = str(pipeline), None, "diffusion"
    else:
        names = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
        arch = names[0] if names else None
        rec = db.lookup(arch) if arch else None
        task = rec.task if rec else "causal-lm"
        if len({db.lookup(a).name if db.lookup(a) else a for a in names}) > 1:
            checks.append(Check(name="architectures_consistent", status="fail",
                                detail=f"config.json lists conflicting architectures: {', '.join(names)}"))
    headless = headless_embedding(arch, weights.shapes if weights else ()) if not pipeline else None
    if headless:  # the weights decide what the model is: no recipe that builds a causal LM applies
        task = "embedding"
        checks.append(Check(name="checkpoint_layout", status="pass", detail=headless + (
            "; routed as an embedding model (the seed routes embeddings to the specialists backends, so neither "
            "vLLM's pooling runner nor a generation recipe is offered)")))
    auto_map = "auto_map" in cfg or "auto_map" in text_cfg(cfg)
    quant_method, quant_problem = _quantization(cfg)
    # the sizes and text settings as transformers reads them: a remote-code layout with a native equivalent
    # (InternVL's llm_config) is read as that form's config
    view = native_dict(cfg) if not pipeline else cfg

    def recipe_applies(r: Recipe) -> bool:
        """The recipe's target converts this model (whatever hardware it is served on)."""
        return (not headless and target_for(r.kind).supports(rec, arch, cfg, r.options)
                and (quant_method is None or target_for(r.kind).reads_quantization(rec, arch, cfg)))

    def unbuilt(role: str) -> str | None:
        """Why no recipe that the vendor's `role` profile loads converts this model (None: one does)."""
        prof = profiles.pick(hw, role)
        loaded = [r for r in recipes if prof is not None and prof in r.runtime_profiles]
        if any(recipe_applies(r) for r in loaded):
            return None
        if not loaded:
            return f"no recipe here builds for {prof or f'a {role} profile'}"
        if headless:
            return headless
        if quant_method is not None and not any(target_for(r.kind).reads_quantization(rec, arch, cfg) for r in loaded):
            return f"pre-quantized ({quant_method}): the recipes {prof} loads convert unquantized float weights only"
        why = dict.fromkeys(target_for(r.kind).refusal(rec, arch, cfg, r.options) for r in loaded)
        return "; ".join(w for w in why if w) or f"no recipe {prof} loads converts {arch}"

    status: Status
    if arch is None:
        checks.append(Check(name="architecture_known", status="fail", detail="config.json has no architectures field"))
        status, profile = "incompatible", None
    else:
        # The CPU tier serves the model when a recipe that the vendor's gguf-role profile loads applies to it.
        cpu_tier = profiles.pick(hw, "gguf")
        # Remote code (auto_map) is converted by our own family mapping only once a human reviewed the repo.
        gguf_convertible = cpu_tier is not None and any(cpu_tier in r.runtime_profiles and recipe_applies(r) for r in recipes)
        gguf_applies = gguf_convertible and (not auto_map or reviewed)
        closest = None
        if rec is None and task != "diffusion":
            close = difflib.get_close_matches(arch, list(db.architectures), n=1, cutoff=0.6)
            closest = f"{close[0]} ({db.architectures[close[0]].family} family)" if close else None
        status, profile, arch_check = _route(rec, arch, task, hw, profiles, auto_map, reviewed, gguf_applies, closest,
                                             unbuilt, gguf_after_review=gguf_convertible and not gguf_applies,
                                             validated_kin=_validated_kin(db, rec.name if rec else arch))
        checks.append(arch_check)
        mismatch = _model_type_problem(cfg, rec, arch) if rec is not None and not auto_map else None
        if mismatch:  # remote code brings its own model_type; review covers it
            checks.append(Check(name="model_type_consistent", status="fail", detail=mismatch))
    if any(c.status == "fail" for c in checks):
        status = "incompatible"

    # On AI 100 a remote-code architecture whose recipes build its native equivalent (native.py) is compiled from
    # transformers' own model of it and served as that form: its remote code is needed nowhere, so not reviewed.
    native = (equivalent_for(cfg) if hw.vendor == "qaic" and status != "incompatible" and arch is not None
              and not pipeline else None)
    if auto_map and native is not None:
        checks.append(Check(name="remote_code", status="pass", detail=(
            f"config.json has auto_map (custom modeling code), never run and not trusted: the AI 100 recipes build "
            f"transformers' {native.native_architecture} from hive-aot's declaration of {native.architecture}, and "
            "the QPCs are served as that form")))
    elif auto_map and reviewed:
        checks.append(Check(name="remote_code", status="pass", detail="config.json has auto_map (custom modeling code), "
                            "reviewed (registry allow-list): the server may run it; hive-aot never executes it"))
    elif auto_map:
        checks.append(Check(name="remote_code", status="warn",
                            detail="config.json has auto_map (custom modeling code): requires review; "
                                   "hive-aot never executes it"))
        if status == "compatible":
            status = "requires_review"
    else:
        checks.append(Check(name="remote_code", status="pass", detail="no custom code"))
    if rec is not None and rec.trust_remote_code and native is None:
        checks.append(Check(name="trust_remote_code", status="warn",
                            detail="the serving engine needs trust_remote_code=True for this family"))

    problems = config_problems(text_cfg(view)) if not pipeline else []
    if problems:
        checks.append(Check(name="config_sane", status="fail", detail="; ".join(problems)))
        status = "incompatible"
    elif not pipeline:
        checks.append(Check(name="config_sane", status="pass", detail="sizes plausible"))

    tc = text_cfg(view)
    if tc.get("sliding_window") and tc.get("use_sliding_window", True) is not False:
        # The seed's Gemma note is for AI 100's vLLM, whose export computes full attention; GPU vLLM serves the
        # window (its disable_sliding_window would cap max_model_len at the window)
        note = (" (AI 100's vLLM: pass disable_sliding_window; GPU vLLM serves the window as configured)"
                if rec is not None and rec.family == "gemma" else "")
        checks.append(Check(name="sliding_window", status="warn" if note else "pass",
                            detail=f"sliding_window={tc['sliding_window']}{note}"))
    if quant_problem:
        checks.append(Check(name="quantization_config", status="fail", detail=quant_problem))
        status = "incompatible"
    elif quant_method:
        skipped = sorted({r.kind for r in recipes if not target_for(r.kind).reads_quantization(rec, arch, cfg)})
        why = f"; {', '.join(skipped)} recipes do not apply (they convert unquantized float weights only)" if skipped else ""
        checks.append(Check(name="quantization_config", status="pass",
                            detail=f"pre-quantized ({quant_method}); weights served as stored{why}"))

    reqs: dict[str, Any] = {}
    if weights is not None:
        checks.append(Check(name="weights_safetensors", status="pass",
                            detail=f"{weights.files} safetensors file(s), {weights.tensors} tensors"))
        mismatch = _vocab_consistency(view, weights)
        if mismatch:
            checks.append(Check(name="vocab_consistent", status="fail", detail=mismatch))
            status = "incompatible"
        elif not pipeline:
            checks.append(Check(name="vocab_consistent", status="pass", detail="embedding rows match vocab_size"))
        if not problems and not pipeline:
            reqs, fit = serving_requirements(view, weights, task, hw)
            if fit is not None:
                checks.append(fit)
                if fit.status == "fail" and status == "compatible":
                    status = "incompatible"
    has_tok = (bool(files & {"tokenizer.json", "tokenizer.model", "vocab.json"})
               or any(f.endswith("/tokenizer.json") for f in files))
    if not pipeline:
        checks.append(Check(name="tokenizer_present", status="pass" if has_tok else "warn",
                            detail="tokenizer files present" if has_tok else "no tokenizer.json or tokenizer.model"))

    # The recipes listed are those the routed profile loads: what this hardware would be served from.
    applicable = []
    if status != "incompatible" and arch is not None and not pipeline and profile is not None:
        applicable = [r.id for r in recipes if profile in r.runtime_profiles and recipe_applies(r)]
    return Compatibility(status=status, runtime_profile_id=profile if status != "incompatible" else None,
                         architecture=arch, family=(rec.family if rec else ("diffusion" if pipeline else None)),
                         task=task if arch else None, hardware=hw.spec, checks=checks, estimated_requirements=reqs,
                         recipes=applicable)


def classify_snapshot(snap: Snapshot, recipes: Iterable[Recipe] = (), hardware: str = "nvidia",
                      registry: Registry | None = None, reviewed: bool = False) -> Compatibility:
    """Classify a fetched snapshot: config, safetensors headers (strictly checked), tokenizer presence."""
    import json

    from ..core.errors import ModelFormatError

    cfg, err = None, None
    try:
        cfg = snap.config()
    except ModelFormatError as e:  # includes hostile nesting (sources.load_config)
        err = str(e)
        index = snap.file("model_index.json")
        if index is not None:
            try:
                doc = json.loads(index.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError) as bad:
                doc, err = None, f"model_index.json is not valid JSON ({type(bad).__name__})"
            if isinstance(doc, dict):
                cfg, err = {"_diffusers_pipeline": doc.get("_class_name")}, None
    files = snap.safetensors_files()
    weights = None
    if files:
        with TensorSource(files) as src:
            weights = WeightsSummary.from_source(src)
    compat = classify(cfg, weights=weights, files=[f.path for f in snap.files], hardware=hardware,
                      recipes=list(recipes), registry=registry, reviewed=reviewed, config_error=err)
    if not files and cfg is not None and "_diffusers_pipeline" not in cfg:  # asked before downloading weights
        compat.checks.append(Check(name="weights", status="fail", detail="no *.safetensors weights here (config "
                                   "only): routing is from config.json; the weights' checks need the weights"))
    return compat
