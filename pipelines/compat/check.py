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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..model.native import equivalent_for, native_dict
from ..source.safetensors_io import TensorSource
from .database import Architecture, cached as architecture_database
from .hardware import Hardware, parse_hardware
from .layout import headless_embedding
from .requirements import WeightsSummary, serving_requirements
from .results import Check, Compatibility, Status
from .routing import Profiles, route, validated_kin
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


@dataclass(frozen=True)
class _Model:
    """What config.json (and the weights' layout) say the model is: what each step of `classify` reads."""

    cfg: dict[str, Any]
    # the sizes and text settings as transformers reads them: a remote-code layout with a native equivalent
    # (InternVL's llm_config) is read as that form's config
    view: dict[str, Any]
    pipeline: Any  # a diffusers pipeline's class name (model_index.json), else None
    arch: str | None
    rec: Architecture | None
    task: str
    headless: str | None  # why a causal-LM config's weights are an embedding model's (layout.headless_embedding)
    auto_map: bool
    quant_method: str | None
    quant_problem: str | None


def _read_model(cfg: dict[str, Any], weights: WeightsSummary | None, db, checks: list[Check]) -> _Model:
    """Which architecture, record and task config.json names; checks conflicting architectures and headless weights."""
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
    return _Model(cfg=cfg, view=native_dict(cfg) if not pipeline else cfg, pipeline=pipeline, arch=arch, rec=rec,
                  task=task, headless=headless, auto_map=auto_map, quant_method=quant_method,
                  quant_problem=quant_problem)


@dataclass(frozen=True)
class _Converters:
    """The recipes given to `classify`, asked which of them convert the model."""

    model: _Model
    recipes: list[Recipe]
    profiles: Profiles
    hw: Hardware
    target_for: Callable[[str], Any]  # config.kinds.target_for, imported when classify runs

    def reads_quantization(self, r: Recipe) -> bool:
        """The recipe's target reads the model's pre-quantized weights."""
        m = self.model
        return self.target_for(r.kind).reads_quantization(m.rec, m.arch, m.cfg)

    def applies(self, r: Recipe) -> bool:
        """The recipe's target converts this model (whatever hardware it is served on)."""
        m = self.model
        return (not m.headless and self.target_for(r.kind).supports(m.rec, m.arch, m.cfg, r.options)
                and (m.quant_method is None or self.reads_quantization(r)))

    def convertible_by(self, profile: str) -> bool:
        """A recipe that `profile` loads converts this model."""
        return any(profile in r.runtime_profiles and self.applies(r) for r in self.recipes)

    def applicable(self, profile: str) -> list[str]:
        """The ids of the recipes that `profile` loads and that convert this model."""
        return [r.id for r in self.recipes if profile in r.runtime_profiles and self.applies(r)]

    def unbuilt(self, role: str) -> str | None:
        """Why no recipe that the vendor's `role` profile loads converts this model (None: one does)."""
        m = self.model
        prof = self.profiles.pick(self.hw, role)
        loaded = [r for r in self.recipes if prof is not None and prof in r.runtime_profiles]
        if any(self.applies(r) for r in loaded):
            return None
        if not loaded:
            return f"no recipe here builds for {prof or f'a {role} profile'}"
        if m.headless:
            return m.headless
        if m.quant_method is not None and not any(self.reads_quantization(r) for r in loaded):
            return f"pre-quantized ({m.quant_method}): the recipes {prof} loads convert unquantized float weights only"
        why = dict.fromkeys(self.target_for(r.kind).refusal(m.rec, m.arch, m.cfg, r.options) for r in loaded)
        return "; ".join(w for w in why if w) or f"no recipe {prof} loads converts {m.arch}"


def _closest(db, model: _Model) -> str | None:
    """The known architecture nearest an unknown class's name, as the routing check's hint (None: no hint)."""
    if model.rec is not None or model.task == "diffusion":
        return None
    close = difflib.get_close_matches(model.arch, list(db.architectures), n=1, cutoff=0.6)
    return f"{close[0]} ({db.architectures[close[0]].family} family)" if close else None


def _routed(model: _Model, converters: _Converters, db, hw: Hardware, profiles: Profiles, reviewed: bool,
            checks: list[Check]) -> tuple[Status, str | None]:
    """Route the model (routing.route) and check its model_type; any failed check so far makes it incompatible."""
    status: Status
    arch, rec = model.arch, model.rec
    if arch is None:
        checks.append(Check(name="architecture_known", status="fail", detail="config.json has no architectures field"))
        status, profile = "incompatible", None
    else:
        # The CPU tier serves the model when a recipe that the vendor's gguf-role profile loads applies to it.
        cpu_tier = profiles.pick(hw, "gguf")
        # Remote code (auto_map) is converted by our own family mapping only once a human reviewed the repo.
        gguf_convertible = cpu_tier is not None and converters.convertible_by(cpu_tier)
        gguf_applies = gguf_convertible and (not model.auto_map or reviewed)
        status, profile, arch_check = route(rec, arch, model.task, hw, profiles, model.auto_map, reviewed, gguf_applies,
                                            _closest(db, model), converters.unbuilt,
                                            gguf_after_review=gguf_convertible and not gguf_applies,
                                            validated_kin=validated_kin(db, rec.name if rec else arch))
        checks.append(arch_check)
        mismatch = _model_type_problem(model.cfg, rec, arch) if rec is not None and not model.auto_map else None
        if mismatch:  # remote code brings its own model_type; review covers it
            checks.append(Check(name="model_type_consistent", status="fail", detail=mismatch))
    if any(c.status == "fail" for c in checks):
        status = "incompatible"
    return status, profile


def _remote_code_checks(model: _Model, hw: Hardware, reviewed: bool, status: Status, checks: list[Check]) -> Status:
    """Whether the repo's custom code (auto_map) is needed, trusted or awaiting review; unreviewed code holds it back."""
    # On AI 100 a remote-code architecture whose recipes build its native equivalent (native.py) is compiled from
    # transformers' own model of it and served as that form: its remote code is needed nowhere, so not reviewed.
    native = (equivalent_for(model.cfg) if hw.vendor == "qaic" and status != "incompatible" and model.arch is not None
              and not model.pipeline else None)
    if model.auto_map and native is not None:
        checks.append(Check(name="remote_code", status="pass", detail=(
            f"config.json has auto_map (custom modeling code), never run and not trusted: the AI 100 recipes build "
            f"transformers' {native.native_architecture} from hive-aot's declaration of {native.architecture}, and "
            "the QPCs are served as that form")))
    elif model.auto_map and reviewed:
        checks.append(Check(name="remote_code", status="pass", detail="config.json has auto_map (custom modeling code), "
                            "reviewed (registry allow-list): the server may run it; hive-aot never executes it"))
    elif model.auto_map:
        checks.append(Check(name="remote_code", status="warn",
                            detail="config.json has auto_map (custom modeling code): requires review; "
                                   "hive-aot never executes it"))
        if status == "compatible":
            status = "requires_review"
    else:
        checks.append(Check(name="remote_code", status="pass", detail="no custom code"))
    if model.rec is not None and model.rec.trust_remote_code and native is None:
        checks.append(Check(name="trust_remote_code", status="warn",
                            detail="the serving engine needs trust_remote_code=True for this family"))
    return status


def _config_sane_check(model: _Model, status: Status, checks: list[Check]) -> tuple[Status, list[str]]:
    """config_sane: the text config's sizes are plausible (not asked of a diffusers pipeline); also its problems."""
    problems = config_problems(text_cfg(model.view)) if not model.pipeline else []
    if problems:
        checks.append(Check(name="config_sane", status="fail", detail="; ".join(problems)))
        status = "incompatible"
    elif not model.pipeline:
        checks.append(Check(name="config_sane", status="pass", detail="sizes plausible"))
    return status, problems


def _sliding_window_check(model: _Model, checks: list[Check]) -> None:
    """sliding_window: a note where the model attends through a window."""
    tc = text_cfg(model.view)
    if tc.get("sliding_window") and tc.get("use_sliding_window", True) is not False:
        # The seed's Gemma note is for AI 100's vLLM, whose export computes full attention; GPU vLLM serves the
        # window (its disable_sliding_window would cap max_model_len at the window)
        note = (" (AI 100's vLLM: pass disable_sliding_window; GPU vLLM serves the window as configured)"
                if model.rec is not None and model.rec.family == "gemma" else "")
        checks.append(Check(name="sliding_window", status="warn" if note else "pass",
                            detail=f"sliding_window={tc['sliding_window']}{note}"))


def _quantization_check(model: _Model, converters: _Converters, status: Status, checks: list[Check]) -> Status:
    """quantization_config: a method no engine loads fails; a known one says which recipes it rules out."""
    if model.quant_problem:
        checks.append(Check(name="quantization_config", status="fail", detail=model.quant_problem))
        status = "incompatible"
    elif model.quant_method:
        skipped = sorted({r.kind for r in converters.recipes if not converters.reads_quantization(r)})
        why = f"; {', '.join(skipped)} recipes do not apply (they convert unquantized float weights only)" if skipped else ""
        checks.append(Check(name="quantization_config", status="pass",
                            detail=f"pre-quantized ({model.quant_method}); weights served as stored{why}"))
    return status


def _weights_checks(model: _Model, weights: WeightsSummary | None, problems: list[str], hw: Hardware, status: Status,
                    checks: list[Check]) -> tuple[Status, dict[str, Any]]:
    """The safetensors headers' checks: vocab rows, then the serving requirements and whether the device fits them."""
    reqs: dict[str, Any] = {}
    if weights is not None:
        checks.append(Check(name="weights_safetensors", status="pass",
                            detail=f"{weights.files} safetensors file(s), {weights.tensors} tensors"))
        mismatch = _vocab_consistency(model.view, weights)
        if mismatch:
            checks.append(Check(name="vocab_consistent", status="fail", detail=mismatch))
            status = "incompatible"
        elif not model.pipeline:
            checks.append(Check(name="vocab_consistent", status="pass", detail="embedding rows match vocab_size"))
        if not problems and not model.pipeline:
            reqs, fit = serving_requirements(model.view, weights, model.task, hw)
            if fit is not None:
                checks.append(fit)
                if fit.status == "fail" and status == "compatible":
                    status = "incompatible"
    return status, reqs


def _tokenizer_check(model: _Model, files: set[str], checks: list[Check]) -> None:
    """tokenizer_present (not asked of a diffusers pipeline)."""
    has_tok = (bool(files & {"tokenizer.json", "tokenizer.model", "vocab.json"})
               or any(f.endswith("/tokenizer.json") for f in files))
    if not model.pipeline:
        checks.append(Check(name="tokenizer_present", status="pass" if has_tok else "warn",
                            detail="tokenizer files present" if has_tok else "no tokenizer.json or tokenizer.model"))


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
    """The compatibility check of a model's config.json, with its safetensors headers and file names where given."""
    from ..config.kinds import target_for

    hw = parse_hardware(hardware)
    files = set(files)
    recipes = list(recipes)  # read more than once below
    checks: list[Check] = []
    if cfg is None:
        checks.append(Check(name="config", status="fail", detail=config_error or "config.json is missing"))
        return Compatibility(status="incompatible", runtime_profile_id=None, architecture=None, hardware=hw.spec, checks=checks)
    db = architecture_database(registry)
    profiles = Profiles(registry)
    model = _read_model(cfg, weights, db, checks)
    converters = _Converters(model, recipes, profiles, hw, target_for)
    status, profile = _routed(model, converters, db, hw, profiles, reviewed, checks)
    status = _remote_code_checks(model, hw, reviewed, status, checks)
    status, problems = _config_sane_check(model, status, checks)
    _sliding_window_check(model, checks)
    status = _quantization_check(model, converters, status, checks)
    status, reqs = _weights_checks(model, weights, problems, hw, status, checks)
    _tokenizer_check(model, files, checks)

    # The recipes listed are those the routed profile loads: what this hardware would be served from.
    arch, rec, pipeline = model.arch, model.rec, model.pipeline
    applicable = []
    if status != "incompatible" and arch is not None and not pipeline and profile is not None:
        applicable = converters.applicable(profile)
    return Compatibility(status=status, runtime_profile_id=profile if status != "incompatible" else None,
                         architecture=arch, family=(rec.family if rec else ("diffusion" if pipeline else None)),
                         task=model.task if arch else None, hardware=hw.spec, checks=checks,
                         estimated_requirements=reqs, recipes=applicable)


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
