"""Qualcomm Cloud AI 100: two kinds, one derived from the other.

- `qaic-export` (recipe qaic-export, any host): our own PyTorch -> ONNX export with retained-state KV
  (export.py), validated in onnxruntime against transformers fp32 (prefill + decode steps, state fed
  back; with `target_lm: true` the target LM of speculative decoding, also checked in steps of K+1 tokens).
  An intermediate artifact: no runtime profile loads ONNX; compile recipes read it.
- `qaic` (recipes qaic-mxfp6, qaic-fp16; `input: qaic-export`): the compile of that ONNX for one serving
  shape. Its build writes the compile inputs beside the export's ONNX (specializations.json,
  custom_io.yaml, the partition file, the exact command: compile.py) and its validation predicts the
  device's quality by emulating MXFP6 / MXINT8 (or fp16) in the reference (quality.py). That export
  bundle is published on every host (format `qaic-export-bundle`, tags `bundle-latest` /
  `bundle-<commit>`, so pull never hands it out); a host with the Apps SDK then compiles it into the
  QPC (qpc.py), published under the usual tags with the serving binding of vllm-qaic (serving.py).
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from typing import Any

from ...config.thresholds import check_thresholds, metric_text
from ...core.errors import NotApplicableError
from ...validation.tokenizer_cache import CachedTokenizer
from .. import BuildContext, BuiltArtifact, Target, ValidationReport
from .compile import COMPILE_DIR, NOT_A_TARGET_LM, CompileOptions, compiled_weights
from .export_parity import PARITY_DECODE_STEPS, WHISPER_PARITY_CTX, decoder_parity, speech_parity
from .families import architecture as config_architecture, positions_served, window_served_full
from .gates import ExportThresholds, QaicThresholds
from .layout import BUNDLE_FORMAT, BUNDLE_FORMAT_VERSION, EXPORT_FORMAT_VERSION, EXPORT_REPORT, ONNX_DIR
from .qpc import QpcCompile
from .server import QAIC_SERVER
from .support import (
    encoder_archs,
    export_archs,
    export_weights,
    exported,
    generate_archs,
    is_encoder,
    is_speech,
    is_vision,
    refusal,
    speech_archs,
)

EXPORT_OPTIONS = ("batch_index", "weight_dtype", "target_lm")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def _config(holder: Any) -> dict[str, Any]:
    """config.json of a build (or plan) as the export reads it: a declared remote-code architecture's as its native
    form (native.py: InternVLChatModel as InternVLForConditionalGeneration, the model transformers builds), every
    other model's as it is."""
    from ...model.native import native_dict

    return native_dict(holder.config)


def _multimodal(config: dict[str, Any]) -> bool:
    """A vision-language (or speech) model: its config nests a vision or audio tower."""
    return any(isinstance(config.get(k), dict) for k in ("vision_config", "audio_config"))


def _max_positions(config: dict[str, Any]) -> int | None:
    """The longest sequence the model's positions allow (RoBERTa-style tables start at pad_token_id + 1)."""
    cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    n = cfg.get("max_position_embeddings") or cfg.get("n_positions") or cfg.get("seq_length")
    if not isinstance(n, int):
        return None
    if cfg.get("model_type") in ("roberta", "xlm-roberta", "mpnet") and isinstance(cfg.get("pad_token_id"), int):
        return n - cfg["pad_token_id"] - 1
    return n


def _whole(config: dict[str, Any]) -> str:
    """What plan says is loaded whole (the models not streamed layer by layer)."""
    return "Whisper model" if is_speech(config) else "encoder"


def encoder_batches(tok, config: dict[str, Any]) -> list[list[list[int]]]:
    """The parity texts for an encoder: one sequence alone, then three of different lengths (padded)."""
    from ...validation import prompts, reference

    limit = min(64, _max_positions(config) or 64)
    ids = [list(s)[:limit] for s in reference.encode(tok, prompts.PARITY_TEXTS[:4])]
    return [ids[:1], ids[1:4]]


def _refuse_bad_source(snap, config: dict[str, Any]) -> None:
    """What the vLLM target refuses too (source/checks.py). A decoder's NaN/Inf are refused as its weights
    stream into the ONNX data file, and its stray tensors where its weight rules are made (export.py)."""
    from ...source.checks import refuse_index_mismatch, refuse_non_finite, refuse_quantized_without_config
    from ...source.safetensors_io import TensorSource

    with TensorSource(snap.safetensors_files()) as src:
        refuse_quantized_without_config(src, config)
        refuse_index_mismatch(snap.dir, src)
        if is_encoder(config) or is_speech(config):  # exported from loaded weights: nothing else would look
            refuse_non_finite(src)


class QaicExportTarget(Target):
    kind = "qaic-export"
    format_version = EXPORT_FORMAT_VERSION
    Thresholds = ExportThresholds
    intermediate = True  # read by qaic recipes, served by nobody
    server_programs = ()
    build_step = "export"

    @staticmethod
    def plan_steps(env) -> list:
        from .plan import export_steps

        # Whisper is loaded whole, as encoders are; a vision-language model streams its language model as a
        # decoder does, its vision side held
        config = _config(env)
        return export_steps(env, encoder=is_encoder(config) or is_speech(config), whole=_whole(config),
                            vision=is_vision(config))

    @staticmethod
    def option_problems(options: dict[str, Any]) -> list[str]:
        from .plan import WEIGHT_DTYPES

        problems = [f"unknown option {k!r}" for k in options if k not in EXPORT_OPTIONS]
        for name in ("batch_index", "target_lm"):
            if not isinstance(options.get(name, True), bool):
                problems.append(f"{name} must be true or false")
        if options.get("weight_dtype", "float16") not in WEIGHT_DTYPES:
            problems.append(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}")
        return problems

    @staticmethod
    def artifact_format(options: dict[str, Any]) -> str:
        return "onnx"

    @staticmethod
    def describe_weights(options: dict[str, Any], config: dict[str, Any]) -> dict[str, str]:
        from ...model.native import native_dict

        return export_weights(options, native_dict(config))

    def supports(self, arch, architecture: str, config: dict[str, Any], options: dict[str, Any]) -> bool:
        return exported(arch, architecture, export_archs(), config)

    def refusal(self, arch, architecture: str, config: dict[str, Any], options: dict[str, Any]) -> str | None:
        return refusal(arch, architecture, export_archs(), config)

    def plan_problems(self, ctx: BuildContext) -> list[str]:
        config = _config(ctx)
        if ctx.recipe.options.get("target_lm") and (is_encoder(config) or is_speech(config) or _multimodal(config)):
            return [f"target_lm: {NOT_A_TARGET_LM}"]
        return []

    def toolchain(self) -> dict[str, str]:
        return {"hive_aot_qaic_export_format": str(EXPORT_FORMAT_VERSION), "torch": _version("torch"),
                "transformers": _version("transformers"), "onnx": _version("onnx"),
                "onnxruntime_validation": _version("onnxruntime")}

    def build(self, ctx: BuildContext, out_dir: Path) -> BuiltArtifact:
        from ...core.paths import link_or_copy
        from ...source.snapshot import CARRIED_FILES
        from .export import export

        snap, config = ctx.snapshot, _config(ctx)
        _refuse_bad_source(snap, config)
        if is_encoder(config):
            from .encoders import export_encoder

            report = export_encoder(snap.dir, out_dir / ONNX_DIR / "model.onnx")
        elif is_speech(config):  # one Encoder/Decode graph, fp32 weights (batch_index, weight_dtype: n/a)
            from .whisper import export_whisper, load_model

            report = export_whisper(load_model(snap.dir), out_dir / ONNX_DIR / "model.onnx", ctx_len=WHISPER_PARITY_CTX)
        elif is_vision(config):  # two graphs: onnx/model.onnx (language) and onnx/vision/model.onnx
            from .vision.target import build as build_vision

            report, vision = build_vision(snap.dir, out_dir, ctx.recipe.options)
        else:
            batch_index = bool(ctx.recipe.options.get("batch_index", True))
            report = export(snap.dir, out_dir / ONNX_DIR / "model.onnx", batch_index=batch_index,
                            weight_dtype=ctx.recipe.options.get("weight_dtype", "float16"),
                            logits_to_keep=bool(ctx.recipe.options.get("target_lm", False)))
        files = [f"{ONNX_DIR}/{name}" for name in report.files]
        if is_vision(config):
            files += vision["files"]
        known = {}
        digests = {f.path: f.sha256 for f in snap.files}
        converted = config is not ctx.config  # native_dict hands config.json back unless it is a native form's
        for name in CARRIED_FILES:
            if name == "config.json" and converted:
                # the artifact is the native model: its config is that model's, and what serves it never meets the
                # repository's remote code (auto_map)
                from ...model.native import write_native_config

                write_native_config(snap.dir, out_dir / name)
                files.append(name)
            elif name in digests:
                link_or_copy(snap.dir / name, out_dir / name)
                files.append(name)
                known[name] = digests[name]
        # logits_to_keep is recorded only when set: the report of every other export keeps its bytes; so is
        # the architecture a converted checkpoint was exported from
        info = {"encoder": is_encoder(config), **({"speech": True} if is_speech(config) else {}),
                **({"vision": vision} if is_vision(config) else {}),
                **({"converted_from": config_architecture(ctx.config)} if converted else {}),
                **{k: v for k, v in vars(report).items() if k != "path" and (k != "logits_to_keep" or v)}}
        (out_dir / EXPORT_REPORT).write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
        files.append(EXPORT_REPORT)
        return BuiltArtifact(root=out_dir, files=files, info={"export": info}, known_digests=known)

    def validate(self, ctx: BuildContext, artifact_dir: Path, files: dict[str, str]) -> ValidationReport:
        from ...validation import parity

        tok = CachedTokenizer(ctx.snapshot.dir)
        onnx_path = artifact_dir / ONNX_DIR / "model.onnx"
        thresholds, config = ctx.recipe.validation, _config(ctx)
        if is_encoder(config):
            from .encoders import encoder_parity

            r = encoder_parity(ctx.snapshot.dir, onnx_path, encoder_batches(tok, config))
            metrics = {"ort_max_abs_delta": parity.round6(max(r["max_abs_delta"].values())),
                       "ort_sequences": r["sequences"]}
            if r["min_cosine"] is not None:
                metrics["ort_min_cosine"] = float(f"{r['min_cosine']:.12f}")
            if r["top1_agreement"] is not None:
                metrics["ort_top1_agreement"] = r["top1_agreement"]
            details = {"ort": r}
        elif is_speech(config):
            metrics, details = speech_parity(ctx, onnx_path)
        elif is_vision(config):
            from .vision.target import parity as vision_parity

            metrics, details = vision_parity(ctx.snapshot, artifact_dir, onnx_path, tok, PARITY_DECODE_STEPS,
                                             ctx.recipe.options.get("weight_dtype", "float16"))
        else:
            metrics, details = decoder_parity(ctx, tok, onnx_path)
        # Gates on metrics this architecture does not have do not apply (cosine of a decoder, top-1 of an embedder).
        thresholds = thresholds.model_copy(update={f: None for f, info in type(thresholds).model_fields.items()
                                                   if info.json_schema_extra["metric"] not in metrics})
        failures = check_thresholds(metrics, thresholds)
        return ValidationReport(passed=not failures, failures=failures, metrics=metrics, details=details)

    @staticmethod
    def summary(validation: dict[str, Any]) -> str:
        met = validation.get("metrics", {})
        line = Target.summary(validation)
        if "ort_max_abs_delta" not in met:
            return line
        line += f" onnxruntime: max |delta| {metric_text(met['ort_max_abs_delta'], '.2e')}"
        for key, name, spec in (("ort_top1_agreement", "top-1", ".4f"), ("ort_min_cosine", "cosine", ".6f")):
            if key in met:
                line += f", {name} {metric_text(met[key], spec)}"
        return line

    def serving(self, ctx: BuildContext, files: list[str]) -> dict[str, dict[str, Any]]:
        return {}


class QaicTarget(Target):
    """A compile recipe. Its build is the export bundle; the QPC is compiled from that bundle (qpc.py)."""

    kind = "qaic"
    server_programs = (QAIC_SERVER,)
    format_version = BUNDLE_FORMAT_VERSION
    Thresholds = QaicThresholds
    input_kinds = ("qaic-export",)
    build_step = "bundle"
    hardware_step = QpcCompile()

    @staticmethod
    def plan_steps(env) -> list:
        from .plan import bundle_steps

        weight_dtype = (env.input_options or {}).get("weight_dtype", "float16")
        streamed = env.options.get("task", "generate") == "generate"
        config = _config(env)
        return bundle_steps(env, decoder=streamed, weight_dtype=weight_dtype, whole=_whole(config),
                            vision=is_vision(config))

    @staticmethod
    def option_problems(options: dict[str, Any]) -> list[str]:
        return CompileOptions.problems(options)

    @staticmethod
    def input_problems(options: dict[str, Any], input_options: dict[str, Any]) -> list[str]:
        if options.get("full_batch_size", 8) and input_options.get("batch_index", True) is False:
            return ["options.full_batch_size: continuous batching needs an input export with batch_index: true"]
        spd, tlm = options.get("num_speculative_tokens") is not None, bool(input_options.get("target_lm", False))
        if spd and not tlm:
            return ["options.num_speculative_tokens: the target LM needs an input export with target_lm: true "
                    "(logits for every token of a decode step)"]
        if tlm and not spd:
            return ["the input export has target_lm: true (a num_logits_to_keep input): set num_speculative_tokens"]
        return []

    @staticmethod
    def artifact_format(options: dict[str, Any]) -> str:
        return "qpc"

    @staticmethod
    def describe_weights(options: dict[str, Any], config: dict[str, Any]) -> dict[str, str]:
        return compiled_weights(options)

    @staticmethod
    def _compiled(options: dict[str, Any]) -> frozenset[str]:
        """Decoder compiles for the exported decoder families, embedding compiles for the encoders, transcribe
        compiles for Whisper."""
        task = options.get("task", "generate")
        return encoder_archs() if task == "embedding" else speech_archs() if task == "transcribe" else generate_archs()

    def supports(self, arch, architecture: str, config: dict[str, Any], options: dict[str, Any]) -> bool:
        return exported(arch, architecture, self._compiled(options), config)

    def refusal(self, arch, architecture: str, config: dict[str, Any], options: dict[str, Any]) -> str | None:
        return refusal(arch, architecture, self._compiled(options), config)

    def plan_problems(self, ctx: BuildContext) -> list[str]:
        """What makes this serving shape impossible for the model, before any work."""
        opts, config = CompileOptions.parse(ctx.recipe.options), _config(ctx)
        if opts.num_speculative_tokens and (is_encoder(config) or _multimodal(config)):
            return [NOT_A_TARGET_LM]
        if opts.task == "transcribe":
            from .whisper import compile_problems

            return compile_problems(opts, config)
        positions = min((n for n in (_max_positions(config), positions_served(config)) if n), default=None)
        if positions is not None and opts.ctx_len > positions:
            return [f"ctx_len {opts.ctx_len} is beyond the model's {positions} positions (max_position_embeddings)"]
        window = window_served_full(config)
        if window is not None and opts.ctx_len > window:
            return [f"ctx_len {opts.ctx_len} is beyond the {window}-token sliding window that the export of "
                    f"{config_architecture(config)} serves as full attention (disable_sliding_window): beyond it the "
                    "graph would differ from the model (use ctx_len <= sliding_window)"]
        rope = config.get("rope_scaling") or {}
        original = config.get("original_max_position_embeddings")
        if (isinstance(rope, dict) and (rope.get("rope_type") or rope.get("type")) == "longrope"
                and isinstance(original, int) and opts.ctx_len > original):
            # transformers switches longrope's factors by sequence length; the exported RoPE table is static
            # (the short factors), so positions beyond the original window would be wrong.
            return [f"ctx_len {opts.ctx_len} is beyond the {original} positions longrope serves with its short "
                    "factors; the exported RoPE table is static (use ctx_len <= original_max_position_embeddings)"]
        return []

    def toolchain(self) -> dict[str, str]:
        # The SDK is not here: the bundle is the same on every host; the QPC's id adds the SDK (qpc.py).
        return {"hive_aot_qaic_bundle_format": str(BUNDLE_FORMAT_VERSION), "torch": _version("torch"),
                "transformers": _version("transformers")}

    def build(self, ctx: BuildContext, out_dir: Path) -> BuiltArtifact:
        from .bundle import write_bundle

        if ctx.input is None:
            raise NotApplicableError(f"recipe {ctx.recipe.id} is built from its input {ctx.recipe.input}, which was not given")
        return write_bundle(ctx, out_dir)

    def validate(self, ctx: BuildContext, artifact_dir: Path, files: dict[str, str]) -> ValidationReport:
        from .bundle import check_bundle
        from .quality import predict

        opts = CompileOptions.parse(ctx.recipe.options)
        problems = check_bundle(artifact_dir, files, opts)
        if problems:
            return ValidationReport(passed=False, failures=problems, metrics={})
        from ...validation import prompts, reference

        if opts.task == "transcribe":  # Whisper: fp16 weights emulated on a synthetic log-mel
            from .whisper import load_model, log_mel, predict_fp16, start_tokens

            model = load_model(ctx.snapshot.dir)
            q = predict_fp16(model, log_mel(model.config), start_tokens(model), PARITY_DECODE_STEPS)
            metrics = {"predicted_top1": q["top1"], "predicted_max_abs_logit_delta": q["max_abs_logit_delta"]}
            failures = check_thresholds(metrics, ctx.recipe.validation)
            return ValidationReport(passed=not failures, failures=failures, metrics=metrics, details={opts.precision: q})
        tok, config = CachedTokenizer(ctx.snapshot.dir), _config(ctx)
        if is_vision(config):  # both QPCs emulated on a synthetic image
            from .vision.target import quality

            q = quality(ctx.snapshot, tok, mxfp6=opts.mxfp6, mxint8=opts.mxint8)
            metrics = {"predicted_top1": q["top1"], "predicted_kl": q["kl"], "predicted_ppl_delta": q["ppl_delta"],
                       "predicted_max_abs_logit_delta": q["max_abs_logit_delta"]}
            failures = check_thresholds(metrics, ctx.recipe.validation)
            return ValidationReport(passed=not failures, failures=failures, metrics=metrics, details={opts.precision: q})
        if not opts.retained_state:
            from .quality import predict_encoder

            q = predict_encoder(ctx.snapshot.dir, encoder_batches(tok, config), mxfp6=opts.mxfp6)
            metrics = {k: q[src] for k, src in (("predicted_cosine", "cosine_min"), ("predicted_top1", "top1"),
                                                ("predicted_max_abs_delta", "max_abs_delta")) if q.get(src) is not None}
            failures = check_thresholds(metrics, ctx.recipe.validation)
            return ValidationReport(passed=not failures, failures=failures, metrics=metrics, details={opts.precision: q})
        # The same ids and the same cached fp32 reference as every other artifact kind of this snapshot.
        snap = ctx.snapshot
        ids = reference.encode(tok, prompts.PARITY_TEXTS)
        ref = reference.compute(snap.dir, snap.content_digest, ids, files=snap.safetensors_files(),
                                step=f"the transformers reference of {snap.model_id}")  # logits only
        resident = reference.reference_resident(snap.safetensors_files())
        q = predict(snap.dir, ids, mxfp6=opts.mxfp6, mxint8=opts.mxint8, reference_logits=ref.logits, resident=resident)
        metrics = {"predicted_top1": q["top1"], "predicted_kl": q["kl"], "predicted_ppl_delta": q["ppl_delta"],
                   "predicted_max_abs_logit_delta": q["max_abs_logit_delta"]}
        failures = check_thresholds(metrics, ctx.recipe.validation)
        return ValidationReport(passed=not failures, failures=failures, metrics=metrics, details={opts.precision: q})

    @staticmethod
    def summary(validation: dict[str, Any]) -> str:
        met = validation.get("metrics", {})
        line = Target.summary(validation)
        if "predicted_kl" in met:
            q = validation.get("mxfp6") or validation.get("fp16") or {}
            line += (f" predicted on the device ({', '.join(q.get('emulated', []))}): "
                     f"top-1 {metric_text(met.get('predicted_top1'), '.4f')}, "
                     f"KL {metric_text(met.get('predicted_kl'), '.5f')}, "
                     f"perplexity {metric_text(met.get('predicted_ppl_delta'), '+.2%')}")
        if "predicted_cosine" in met:
            line += f" predicted on the device: embedding cosine {metric_text(met.get('predicted_cosine'), '.5f')}"
        return line

    def serving(self, ctx: BuildContext, files: list[str]) -> dict[str, dict[str, Any]]:
        return {}  # a bundle serves nothing; the QPC's manifest carries the vllm-qaic binding


__all__ = ["QaicExportTarget", "QaicTarget", "BUNDLE_FORMAT", "COMPILE_DIR"]
