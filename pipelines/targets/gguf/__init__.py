"""GGUF for llama.cpp: own converter (f32/f16/bf16/q8_0), libllama for k-quants, llama.cpp validation."""

from __future__ import annotations

import os
from functools import lru_cache
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from ...config.thresholds import Thresholds, check_thresholds, gate
from ...core import meter
from ...core.errors import HiveError
from .. import MODEL_DIR, BuildContext, BuiltArtifact, ServerProgram, Target, ValidationReport

if TYPE_CHECKING:
    from ...compat.database import Architecture
    from ...config.registry import Recipe

# Bump when the bytes this target writes change for the same inputs (part of every build id).
# 2: explicit add_bos_token for BPE; SentencePiece add_dummy_prefix read from the model.
# 3: the manifest's build info records llama.cpp's quantization type fallbacks.
# 4: per-family modules; llama.cpp's general.* metadata and generic hyper-parameters; hive_aot.* provenance.
# 5: general.name and the name heuristics as llama.cpp derives them from the repository's name (not the
#    snapshot directory's commit); InternLM2; more families.
# 6: the 2025-26 families; llama.cpp's converter's bytes where they differed (Qwen2-MoE's shared-expert gate kept
#    [1, hidden]; Llama 3.1 rope_freqs computed in float32 as its converter does); MoE near-ties reported apart.
FORMAT_VERSION = 6
LOSSLESS = {"F32": "f32", "F16": "f16", "BF16": "bf16"}


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def artifact_name(model_id: str, recipe: Recipe) -> str:
    label = (recipe.options.get("ftype") or recipe.options.get("outtype") or "f16").upper()
    return f"{model_id.split('/')[-1]}-{label}.gguf"


DIRECT_OUTTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")  # written by our converter (convert.OUTTYPES)


class GgufThresholds(Thresholds):
    """What a GGUF must reach against the transformers fp32 reference, run in llama.cpp."""

    min_top1_agreement: float = Field(ge=0.0, le=1.0, json_schema_extra=gate("top1_agreement", "top-1 agreement"))
    max_mean_kl: float = Field(ge=0.0, json_schema_extra=gate("mean_kl", "mean KL", ".5f"))
    max_abs_logit_delta: float | None = Field(default=None, ge=0.0,
                                              json_schema_extra=gate("max_abs_logit_delta", "max |delta logit|"))
    require_token_parity: bool = Field(default=True, json_schema_extra=gate("token_parity", "tokenizer id parity", ".3f"))


# llama-server with what serving() writes: the model file, the context and the threads.
LLAMA_SERVER = ServerProgram(name="llama-server", options={"-m": "model-path", "-c": "value", "-t": "value",
                                                           "--mmproj": "model-path"})


class GgufTarget(Target):
    kind = "gguf"
    server_programs = (LLAMA_SERVER,)
    format_version = FORMAT_VERSION
    Thresholds = GgufThresholds
    build_step = "convert"

    @staticmethod
    def plan_steps(env) -> list:
        from .plan import plan_steps

        return plan_steps(env)

    @staticmethod
    def artifact_format(options: dict[str, Any]) -> str:
        return "gguf"

    @staticmethod
    def describe_weights(options: dict[str, Any], config: dict[str, Any]) -> dict[str, str]:
        """The file type's weights ("gguf-q4_k_m": int4); a lossless file is not quantized, unless the family wrote
        its checkpoint's quantized tensors as stored (gpt-oss's MXFP4 experts, the bulk of it): that method then."""
        from .ftypes import WEIGHT_PRECISION

        name = str(options.get("ftype") or options.get("outtype") or "f16").upper()
        if name not in LOSSLESS:
            return {"precision": WEIGHT_PRECISION.get(name, ""), "quantization": f"gguf-{name.lower()}"}
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        quant = config.get("quantization_config") or text.get("quantization_config")
        kept = quant.get("quant_method") if isinstance(quant, dict) else None
        if isinstance(kept, str) and kept:  # only a family that reads it builds a pre-quantized checkpoint
            return {"precision": "", "quantization": kept.lower()}
        return {"precision": WEIGHT_PRECISION[name], "quantization": ""}

    @staticmethod
    def option_problems(options: dict[str, Any]) -> list[str]:
        """What is wrong with a recipe's options for this target (checked when recipes load)."""
        from .quantize import FTYPES, NEEDS_IMATRIX

        known = ("outtype", "ftype", "bpe_pre_fallback", "imatrix", "split_max_size")
        problems = [f"unknown option {k!r}" for k in options if k not in known]
        if ("outtype" in options) == ("ftype" in options):
            problems.append("give exactly one of outtype (written directly) or ftype (llama.cpp quantization)")
        if "outtype" in options and options["outtype"] not in DIRECT_OUTTYPES:
            problems.append(f"outtype {options['outtype']!r} is not one of {', '.join(DIRECT_OUTTYPES)}")
        if "ftype" in options and str(options["ftype"]).upper() not in FTYPES:
            problems.append(f"ftype {options['ftype']!r} is not a llama.cpp file type hive-aot can make")
        if options.get("split_max_size") is not None:
            try:
                split_bytes(options)
            except HiveError as e:
                problems.append(str(e))
        if options.get("imatrix") not in (None, False, "calibration"):
            problems.append("imatrix must be 'calibration' (computed from hive-aot's calibration text) or false")
        if options.get("imatrix") and "ftype" not in options:
            problems.append("imatrix weighs llama.cpp's quantizer: it needs an ftype")
        if str(options.get("ftype", "")).upper() in NEEDS_IMATRIX and not options.get("imatrix"):
            problems.append(f"ftype {options['ftype']} needs an importance matrix: add imatrix: calibration")
        return problems

    def supports(self, arch: Architecture | None, architecture: str, config: dict[str, Any],
                 options: dict[str, Any]) -> bool:
        from .families import BY_ARCHITECTURE

        return (arch.name if arch else architecture) in BY_ARCHITECTURE

    def reads_quantization(self, arch: Architecture | None, architecture: str, config: dict[str, Any]) -> bool:
        """A family that writes its checkpoint's quantized tensors as stored (gpt-oss's MXFP4 experts, which
        llama.cpp keeps MXFP4) converts that pre-quantized model; any other is refused (convert.py)."""
        from .convert import text_config
        from .sliced import reads_quantization

        quant = config.get("quantization_config")
        quant = quant if quant is not None else text_config(config).get("quantization_config")
        return reads_quantization(arch.name if arch else architecture, quant)

    def toolchain(self) -> dict[str, str]:
        return {
            "hive_aot_gguf_format": str(FORMAT_VERSION),
            "gguf": _version("gguf"),
            "llama_cpp_python": _version("llama_cpp_python"),
            "llama_cpp_cpu_backend": llama_cpp_cpu_backend_digest(),
            "transformers": _version("transformers"),
            "tokenizers": _version("tokenizers"),
        }

    def build(self, ctx: BuildContext, out_dir: Path) -> BuiltArtifact:
        from .convert import convert
        from .quantize import quantize
        from .tensor_quant import direct as quantized_as_it_streams

        snapshot, recipe = ctx.snapshot, ctx.recipe
        cfg = snapshot.config()
        opts = recipe.options
        name = artifact_name(snapshot.model_id, recipe)
        out = out_dir / name
        ftype = opts.get("ftype")
        split = split_bytes(opts)
        # Where the file came from, in the file itself (libllama's quantizer copies these keys).
        provenance = {"source_commit": snapshot.commit, "model_id": snapshot.model_id, "recipe": recipe.id,
                      **({"build_id": ctx.build_id} if ctx.build_id else {})}
        dtypes = {t for f in snapshot.safetensors_files() for t in _float_dtypes(f)} if ftype else set()
        lossless = LOSSLESS.get(dtypes.pop(), "f32") if len(dtypes) == 1 else "f32"
        if ftype and quantized_as_it_streams(opts):
            # k-quants straight from the source: libllama's types and ggml's quantizer on each row slice, the same
            # bytes as the lossless intermediate quantized by libllama, without the intermediate on disk.
            report = convert(snapshot.dir, cfg, snapshot.safetensors_files(), out, lossless, ftype=ftype,
                             name=snapshot.model_id, options=opts, provenance=provenance, split_max_bytes=split)
            files = list(report.files)
            info = {**report.__dict__, "outtype": ftype.upper(), "intermediate": None}
            info["quantization_fallbacks"] = info.pop("quantization")
        elif ftype:
            # k-quants with an importance matrix (or a libllama without llama-ext.h): a lossless intermediate in
            # the source precision, then libllama's quantizer (it maps the matrix's entries to tensors by name).
            inter = lossless
            tmp = out_dir / f".intermediate-{inter}.gguf"
            files = []
            imatrix_info = None
            if opts.get("imatrix"):
                # Published next to the model: llama-quantize --imatrix reads the same file.
                from . import imatrix

                imatrix_file = out_dir / f"{name.removesuffix('.gguf')}.imatrix.gguf"
                with meter.step("imatrix"):
                    imatrix_info = imatrix.compute(snapshot, imatrix_file, step=f"importance matrix of {snapshot.model_id}")
            report = convert(snapshot.dir, cfg, snapshot.safetensors_files(), tmp, inter,
                             name=snapshot.model_id, options=opts, provenance=provenance, split_max_bytes=split)
            try:
                # A split intermediate is quantized shard for shard (llama.cpp's keep_split).
                with meter.step("quantize"):
                    fallbacks = quantize(out_dir / report.files[0], out, ftype, keep_split=len(report.files) > 1,
                                         step=f"{ftype.upper()} quantization of {snapshot.model_id}",
                                         imatrix=imatrix_file if imatrix_info else None)
            finally:
                for f in report.files:
                    (out_dir / f).unlink(missing_ok=True)
            files = fallbacks.pop("files") + ([imatrix_file.name] if imatrix_info else [])
            info = {**report.__dict__, "outtype": ftype.upper(), "intermediate": inter,
                    "quantization_fallbacks": fallbacks, **({"imatrix": imatrix_info} if imatrix_info else {})}
        else:
            report = convert(snapshot.dir, cfg, snapshot.safetensors_files(), out, opts.get("outtype", "f16"),
                             name=snapshot.model_id, options=opts, provenance=provenance, split_max_bytes=split)
            info = dict(report.__dict__)
            files = list(report.files)
        from .projectors import write_projector

        projector = write_projector(snapshot, out_dir, provenance)  # a VLM's vision side: llama.cpp's mmproj GGUF
        if projector is not None:
            info["mmproj"] = projector
            files.append(projector["file"])
        for f in files:
            os.chmod(out_dir / f, 0o644)
        return BuiltArtifact(root=out_dir, files=files, info=info)

    def validate(self, ctx: BuildContext, artifact_dir: Path, files: dict[str, str]) -> ValidationReport:
        from .mmproj import mmproj_name
        from .mmproj_check import check_projector
        from .projectors import projector_for
        from .validate import validate_gguf

        model = artifact_name(ctx.model_id, ctx.recipe)  # the imatrix and the projector, when published, are others
        model = model if model in files else next(f for f in files if f != mmproj_name(ctx.model_id))
        step = f"GGUF validation of {ctx.model_id} ({ctx.recipe.id})"
        metrics, details = validate_gguf(ctx.snapshot, artifact_dir / model, step=step)
        failures = check_thresholds(metrics, ctx.recipe.validation)
        if mmproj_name(ctx.model_id) in files:  # the projector's image embeddings against transformers'
            projector = projector_for((ctx.snapshot.config().get("architectures") or [None])[0])
            more, details["projector"] = check_projector(projector, ctx.snapshot, artifact_dir / model,
                                                         artifact_dir / mmproj_name(ctx.model_id), step)
            failures += more
        return ValidationReport(passed=not failures, failures=failures, metrics=metrics, details=details)

    def serving(self, ctx: BuildContext, files: list[str]) -> dict[str, dict[str, Any]]:
        """llama-server for every profile of the recipe (the CPU tier), with the context `check` recommends for
        the profile's hardware (the model's window, at most 8192 tokens), so the two never disagree."""
        from ...compat.hardware import hardware_for_vendor

        out = {}
        for prof in ctx.profiles():
            rc = ctx.classify(hardware_for_vendor(prof.vendor)).estimated_requirements.get("recommended_config") or {}
            n_ctx = int(rc.get("max_model_len") or min(int(ctx.config.get("max_position_embeddings") or 4096), 4096))
            threads = prof.serving.get("n_threads")
            cmd = ["llama-server", "-m", f"{MODEL_DIR}/{files[0]}", "-c", str(n_ctx)]
            mmproj = next((f for f in files if f.startswith("mmproj-")), None)
            if mmproj is not None:  # a VLM: the projector libmtmd loads beside the language model
                cmd += ["--mmproj", f"{MODEL_DIR}/{mmproj}"]
            if isinstance(threads, int):
                cmd += ["-t", str(threads)]
            out[prof.id] = {"engine": "llama.cpp", "image": prof.image, "model_file": files[0], "n_ctx": n_ctx,
                            "chat_template": "embedded in GGUF metadata", "command": cmd, "env": {}}
        return out


def split_bytes(options: dict[str, Any]) -> int:
    """The recipe's `split_max_size` (e.g. 2G, 45GB) in bytes; 0: one file."""
    from ...core.units import parse_size

    value = options.get("split_max_size")
    return 0 if value in (None, 0, False) else parse_size(str(value), "split_max_size")


@lru_cache(maxsize=1)
def llama_cpp_cpu_backend_digest() -> str:
    """sha256 (16 hex) of the installed libggml-cpu's machine code: the same llama-cpp-python version compiled
    for another CPU level runs other kernels, whose quantized outputs and validation metrics may differ, so it
    is a different toolchain (else two hosts would publish different manifests under one build id). Only the
    code (elf_code.py): the file also holds the random directory pip compiled it in, which made every factory
    host's build ids its own. Read from disk, not loaded: the parent process never runs native llama.cpp code."""
    from ...process.elf_code import code_digest

    spec = find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return "absent"
    libs = sorted(Path(spec.submodule_search_locations[0], "lib").glob("libggml-cpu*.so*"))
    return code_digest(libs[0])[:16] if libs else "absent"


def _float_dtypes(path: Path) -> set[str]:
    from ...source.safetensors_io import read_header

    return {t.dtype for t in read_header(path).tensors.values() if t.dtype in LOSSLESS}


__all__ = ["GgufTarget", "artifact_name", "FORMAT_VERSION"]
