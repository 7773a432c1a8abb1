"""A fourth artifact kind, defined outside hive-aot as a plug-in package would define one (tests/targets/test_toy_kind.py).

`toy`: the checkpoint's floating-point tensors rewritten in fp16 (a safetensors file in the Hugging Face layout,
with the config and tokenizer files), validated by running the artifact through the same streamed transformers
model as the fp32 reference, on the same token ids. Served by a `toy-serve` program. Nothing in hive-aot names
it: the entry point in toy_kind-1.0.dist-info registers it, and this folder's recipe and the test's registry
use it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from pydantic import Field

from pipelines.targets import MODEL_DIR, BuildContext, BuiltArtifact, ServerProgram, Target, ValidationReport
from pipelines.targets.kit import BASE_STEP, CARRIED_FILES, StepNeed, Thresholds, check_thresholds, gate, sha256_json

FORMAT = "toy-fp16"
WEIGHTS = "model.safetensors"
TOY_SERVER = ServerProgram(name="toy-serve", positionals=(MODEL_DIR,), options={"--port": "value"})


class ToyThresholds(Thresholds):
    min_top1_agreement: float = Field(ge=0.0, le=1.0, json_schema_extra=gate("top1_agreement", "top-1 agreement"))
    max_mean_kl: float = Field(ge=0.0, json_schema_extra=gate("mean_kl", "mean KL", ".5f"))


class ToyTarget(Target):
    kind = "toy"
    format_version = 1
    Thresholds = ToyThresholds
    build_step = "toy"
    server_programs = (TOY_SERVER,)

    @staticmethod
    def plan_steps(env) -> list[StepNeed]:
        size = env.facts.parameters * 2
        convert = StepNeed("toy", BASE_STEP + env.facts.fp32_bytes + size, disk=size, where=env.work,
                           detail="the whole model in fp32 and fp16 (a toy: real kinds stream)")
        reference = env.reference()
        return [convert, reference, StepNeed("validate", reference.memory, where=env.refs,
                                             disk=reference.disk, detail="the artifact through the reference"),
                env.publish(size)]

    @staticmethod
    def option_problems(options: dict[str, Any]) -> list[str]:
        return [f"unknown option {k!r}" for k in options if k != "dtype"] + \
            ([f"dtype {options['dtype']!r} is not float16"] if options.get("dtype", "float16") != "float16" else [])

    @staticmethod
    def artifact_format(options: dict[str, Any]) -> str:
        return FORMAT

    @staticmethod
    def describe_weights(options: dict[str, Any], config: dict[str, Any]) -> dict[str, str]:
        return {"precision": "float16", "quantization": ""}

    def supports(self, arch, architecture: str, config: dict[str, Any], options: dict[str, Any]) -> bool:
        return arch is not None and arch.active and arch.task == "causal-lm" and arch.transformers_known

    def toolchain(self) -> dict[str, str]:
        return {"toy_format": "1"}

    def build(self, ctx: BuildContext, out_dir: Path) -> BuiltArtifact:
        import numpy as np
        from safetensors.numpy import save_file

        from pipelines.targets.kit import TensorSource

        tensors = {}
        with TensorSource(ctx.snapshot.safetensors_files()) as src:
            for name in src:
                info = src.info(name)
                tensors[name] = src.float32(name).reshape(info.shape).astype(np.float16)
        save_file(tensors, str(out_dir / WEIGHTS), metadata={"format": "pt"})
        cfg = dict(ctx.config, torch_dtype="float16")
        (out_dir / "config.json").write_text(json.dumps(cfg, indent=1))
        files, known = [WEIGHTS, "config.json"], {}
        digests = {f.path: f.sha256 for f in ctx.snapshot.files}
        for name in CARRIED_FILES:  # copied unchanged: their source digests are theirs
            src_file = ctx.snapshot.file(name)
            if name != "config.json" and src_file is not None:
                shutil.copyfile(src_file, out_dir / name)
                files.append(name)
                known[name] = digests[name]
        return BuiltArtifact(root=out_dir, files=files, known_digests=known, format=FORMAT)

    def validate(self, ctx: BuildContext, artifact_dir: Path, files: dict[str, str]) -> ValidationReport:
        from pipelines.targets.kit import parity, prompts, reference

        tok = reference.load_tokenizer(ctx.snapshot.dir)
        ids = reference.encode(tok, prompts.PARITY_TEXTS)
        ref = reference.compute(ctx.snapshot.dir, ctx.snapshot.content_digest, ids)  # the logits: no continuation
        # the artifact through the same streamed model, cached under the artifact's own content
        art = reference.compute(artifact_dir, sha256_json(files), ids, files=[artifact_dir / WEIGHTS])
        per_prompt = [parity.compare(r, a) for r, a in zip(ref.logits, art.logits)]
        total = parity.merge(per_prompt)
        metrics = {"top1_agreement": parity.round6(total.top1_agreement), "mean_kl": parity.round6(total.mean_kl),
                   "max_abs_logit_delta": parity.round6(total.max_abs_logit_delta), "finite": total.finite}
        failures = check_thresholds(metrics, ctx.recipe.validation)
        return ValidationReport(passed=not failures, failures=failures, metrics=metrics,
                                details={"per_prompt": [p.rounded() for p in per_prompt]})

    def serving(self, ctx: BuildContext, files: list[str]) -> dict[str, dict[str, Any]]:
        return {p.id: {"engine": "toy", "image": p.image, "command": ["toy-serve", MODEL_DIR, "--port", "8000"],
                       "env": {}} for p in ctx.profiles()}
