"""Which models the AI 100 kinds convert, and what `check` says of the others: the one place their supported
set is decided (the decoder families of families/, the encoders of encoders.py, Whisper of whisper.py, the
vision-language families of vision/), read through the Target
protocol (`supports`, `refusal`).

The registry's validated matrix (`qaic: true`) is the platform's fact, and decides the status `check` answers;
what hive-aot can build is decided here, whatever the matrix says. An exported architecture outside the matrix
is built once a human reviews the model (`reviewed: true`); one without an exporter is answered as such.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ...compat.database import Architecture

# The model tasks an AI 100 export covers, and which export (tests check every exported architecture's task).
EXPORTS = {"causal-lm": "decoder", "embedding": "encoder", "reranker": "encoder", "seq2seq-audio": "speech",
           "vision-language": "vision"}


def decoder_archs() -> frozenset[str]:
    from .families import FAMILY_SPECS

    return frozenset(FAMILY_SPECS)


def encoder_archs() -> frozenset[str]:
    from .encoders import ENCODERS

    return ENCODERS


def speech_archs() -> frozenset[str]:
    """Speech-to-text models exported as one Encoder/Decode graph (whisper.py)."""
    from .whisper import ARCHITECTURES

    return ARCHITECTURES


def vision_archs() -> frozenset[str]:
    """Vision-language models exported as a vision graph and a language graph (vision/, dual QPC)."""
    from .vision import ARCHITECTURES

    return ARCHITECTURES


def generate_archs() -> frozenset[str]:
    """What a `task: generate` compile builds: decoders, and the language graph (+ vision QPC) of a VLM."""
    return decoder_archs() | vision_archs()


def export_archs() -> frozenset[str]:
    """Everything the qaic-export recipe converts."""
    return decoder_archs() | encoder_archs() | speech_archs() | vision_archs()


# Remote-code architectures the export builds as the transformers model their declaration in native.py names (never
# their own code), each checked end to end against that model (tests/targets/qaic/test_qaic_vision_internvl_chat.py). InternLM2's
# declaration serves the GGUF conversion and the reference; its AI 100 export is not checked, so not offered.
NATIVE_FORMS = frozenset({"InternVLChatModel"})


def native_form(architecture: str, config: dict[str, Any] | None) -> tuple[str | None, str | None]:
    """(the transformers architecture the export builds for a remote-code `architecture`, why this config.json has
    no such form); (None, None) for every other architecture."""
    if architecture not in NATIVE_FORMS:
        return None, None
    from ...model.native import EQUIVALENTS, native_problem

    eq = EQUIVALENTS[architecture]
    return eq.native_architecture, native_problem(eq, config if isinstance(config, dict) else {})


def exported(arch: Architecture | None, architecture: str, names: frozenset[str],
             config: dict[str, Any] | None = None) -> bool:
    """An architecture transformers builds (the export reads its modules) among `names`, itself or, for a declared
    remote-code architecture, its native form (`config`: the config.json that must translate to it)."""
    if arch is None or not arch.active:
        return False
    if arch.transformers_known and (architecture in names or arch.name in names):
        return True
    native, problem = native_form(arch.name, config)
    return native is not None and problem is None and native in names


def refusal(arch: Architecture | None, architecture: str, names: frozenset[str],
            config: dict[str, Any] | None = None) -> str | None:
    """Why the export of `names` does not convert the model, in one clause (None: it does)."""
    if exported(arch, architecture, names, config):
        return None
    if arch is None:
        return f"no hive-aot exporter for {architecture} (an architecture hive-aot does not know)"
    if arch.task not in EXPORTS:
        return f"no hive-aot exporter for {arch.task} models yet"
    native, problem = native_form(arch.name, config)
    if problem:
        return problem
    if not (arch.active and (arch.transformers_known or native is not None)):
        return (f"no hive-aot exporter for {arch.name}: the export reads transformers' modules, and transformers has "
                "none")
    if exported(arch, architecture, export_archs(), config):  # another compile task builds it
        kind = EXPORTS[arch.task]
        return f"{arch.name} is exported as {TASK_OF[kind][0]}: a compile with task: {TASK_OF[kind][1]} builds it"
    covered = {"decoder": decoder_archs, "encoder": encoder_archs, "speech": speech_archs,
               "vision": vision_archs}[EXPORTS[arch.task]]()
    return f"no hive-aot exporter for {arch.name} yet (the AI 100 {arch.task} export covers {', '.join(sorted(covered))})"


# export -> (what the model is exported as, the compile task that builds it)
TASK_OF = {"decoder": ("a decoder", "generate"), "encoder": ("an encoder", "embedding"),
           "speech": ("one Encoder/Decode graph", "transcribe"),
           "vision": ("a vision graph and a language graph", "generate")}


def is_speech(config: dict[str, Any]) -> bool:
    archs = config.get("architectures") or []
    return bool(archs) and archs[0] in speech_archs()


def is_vision(config: dict[str, Any]) -> bool:
    archs = config.get("architectures") or []
    return bool(archs) and archs[0] in vision_archs()


def is_encoder(config: dict[str, Any]) -> bool:
    archs = config.get("architectures") or []
    return bool(archs) and archs[0] in encoder_archs()


def export_weights(options: dict[str, Any], config: dict[str, Any]) -> dict[str, str]:
    """What an export's weights are stored as (the kind's describe_weights; `config` in its native form): an
    encoder's and Whisper's in float32 (their exports ignore weight_dtype), a decoder's and a vision-language
    model's in the recipe's weight_dtype. Never quantized: the compile recipes quantize."""
    whole = is_encoder(config) or is_speech(config)
    return {"precision": "float32" if whole else str(options.get("weight_dtype", "float16")), "quantization": ""}
