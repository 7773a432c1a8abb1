"""What the AI 100 kinds do with a vision-language model, called by the targets (qaic/__init__.py) where a
decoder would be built, checked or predicted: the two graphs' export, their onnxruntime parity, the device's
predicted quality. One place, so the targets hold one call per step, not the family's details.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PARITY_TEXT_TOKENS = 24  # text tokens after the image in the parity prompt


def _family(config: dict[str, Any]):
    from . import vision_family

    return vision_family(config)[1]


def parity_text(tok) -> list[int]:
    from ....validation import prompts

    return list(tok(prompts.PARITY_TEXTS[0]).input_ids)[:PARITY_TEXT_TOKENS]


def build(model_dir: Path, out_dir: Path, options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Both graphs into out_dir: (the language graph's ExportReport, the vision graph's report as JSON)."""
    from .export import export_vlm

    family = _family({"architectures": _architectures(model_dir)})
    report, vision = export_vlm(family, model_dir, out_dir, batch_index=bool(options.get("batch_index", True)),
                                weight_dtype=options.get("weight_dtype", "float16"))
    return report, vision.to_json()


def _architectures(model_dir: Path) -> list[str]:
    """config.json's architectures, a declared remote-code architecture's as its native form (what the export builds)."""
    from ....model.native import native_dict, read_config

    return native_dict(read_config(Path(model_dir))).get("architectures") or []


def parity(snapshot, root: Path, language_onnx: Path, tok, decode_steps: int, weight_dtype: str
           ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metrics, details) of onnxruntime on both graphs against transformers fp32 (language matrices rounded
    as stored), end to end on a synthetic image. The reference streams from the checkpoint (resident when it
    fits); when the whole language graph does not fit onnxruntime's budget, a graph of its first layers over the
    same data file runs against the reference of the same layers (the vision graph always whole)."""
    from ....core.host import memory_budget
    from ....model.memory import model_facts
    from ....model.streamed_model import StreamedCausalLM
    from ....validation import parity as metrics_util
    from ..export import slice_graph
    from ..plan import ort_check, reference_resident
    from .export import VISION_DIR, language_decoder
    from .parity import vlm_parity
    from .streamed import split_transform, stored_rounding, vision_side

    family = _family({"architectures": _architectures(snapshot.dir)})
    facts, budget = model_facts(snapshot), memory_budget()[0]
    check = ort_check(facts, budget, weight_dtype)
    graph = language_onnx
    if check.layers is not None:
        graph = slice_graph(snapshot.dir, language_onnx, check.layers,
                            language_onnx.with_name(f"slice-{check.layers}.onnx"),
                            decoder_of=lambda model, batch_index, _keep: language_decoder(
                                family, model, batch_index=batch_index, ctx_len=16))
    resident = reference_resident(facts, check.layers, budget)
    with StreamedCausalLM(snapshot.dir, snapshot.safetensors_files(), resident=resident, layers=check.layers) as lm:
        lm.transform = split_transform(lm, family, None, stored_rounding(weight_dtype))
        with vision_side(lm, family):
            r = vlm_parity(family, lm.model, graph, Path(root) / VISION_DIR / "model.onnx", parity_text(tok),
                           decode_steps=decode_steps)
    metrics = {"ort_top1_agreement": r["top1_agreement"] if r["tokens_equal"] else 0.0, "ort_steps": r["steps"],
               "finite": r["finite"]}
    deltas = [r["max_abs_logit_delta"], r["vision_max_abs_delta"]]
    if None not in deltas:
        metrics["ort_max_abs_delta"] = metrics_util.round6(max(deltas))
        metrics["ort_vision_max_abs_delta"] = metrics_util.round6(r["vision_max_abs_delta"])
    details = {"ort": {k: v for k, v in r.items() if k not in ("tokens", "reference_tokens")},
               "ort_check": check.to_json(),
               "reference": f"transformers fp32 ({family.architectures[0]}), a synthetic image, language matrices "
                            f"rounded to {weight_dtype} as stored"}
    return metrics, details


def quality(snapshot, tok, *, mxfp6: bool, mxint8: bool) -> dict[str, Any]:
    from ....core.host import memory_budget
    from ....model.memory import model_facts
    from ..plan import reference_resident
    from .quality import predict_vlm

    family = _family({"architectures": _architectures(snapshot.dir)})
    resident = reference_resident(model_facts(snapshot), None, memory_budget()[0])
    return predict_vlm(family, snapshot.dir, snapshot.safetensors_files(), parity_text(tok), mxfp6=mxfp6,
                       mxint8=mxint8, resident=resident)
