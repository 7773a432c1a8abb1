"""Which models the AI 100 kinds convert, and what `check` says of the others: the one place their supported
set is decided (the decoder families of families/, the encoders of encoders.py), read through the Target
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
EXPORTS = {"causal-lm": "decoder", "embedding": "encoder", "reranker": "encoder"}


def decoder_archs() -> frozenset[str]:
    from .families import FAMILY_SPECS

    return frozenset(FAMILY_SPECS)


def encoder_archs() -> frozenset[str]:
    from .encoders import ENCODERS

    return ENCODERS


def exported(arch: "Architecture | None", architecture: str, names: frozenset[str]) -> bool:
    """An architecture transformers builds (the export reads its modules) among `names`."""
    return (arch is not None and arch.active and arch.transformers_known
            and (architecture in names or arch.name in names))


def refusal(arch: "Architecture | None", architecture: str, names: frozenset[str]) -> str | None:
    """Why the export of `names` does not convert the model, in one clause (None: it does)."""
    if exported(arch, architecture, names):
        return None
    if arch is None:
        return f"no hive-aot exporter for {architecture} (an architecture hive-aot does not know)"
    if arch.task not in EXPORTS:
        return f"no hive-aot exporter for {arch.task} models yet"
    if not (arch.active and arch.transformers_known):
        return f"no hive-aot exporter for {arch.name}: the export reads transformers' modules, and transformers has none"
    other = encoder_archs() if names == decoder_archs() else decoder_archs() if names == encoder_archs() else frozenset()
    if exported(arch, architecture, other):
        kind = EXPORTS[arch.task]
        return f"{arch.name} is exported as an {kind}: a compile with task: {'embedding' if kind == 'encoder' else 'generate'} builds it"
    covered = decoder_archs() if EXPORTS[arch.task] == "decoder" else encoder_archs()
    return f"no hive-aot exporter for {arch.name} yet (the AI 100 {arch.task} export covers {', '.join(sorted(covered))})"


def is_encoder(config: dict[str, Any]) -> bool:
    archs = config.get("architectures") or []
    return bool(archs) and archs[0] in encoder_archs()
