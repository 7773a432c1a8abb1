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
    from .... import prompts

    return list(tok(prompts.PARITY_TEXTS[0]).input_ids)[:PARITY_TEXT_TOKENS]


def build(model_dir: Path, out_dir: Path, options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Both graphs into out_dir: (the language graph's ExportReport, the vision graph's report as JSON)."""
    from .export import export_vlm, load_vlm, round_language

    family = _family({"architectures": _architectures(model_dir)})
    weight_dtype = options.get("weight_dtype", "float16")
    model = load_vlm(model_dir)
    round_language(family, model, weight_dtype)
    report, vision = export_vlm(family, model, out_dir, batch_index=bool(options.get("batch_index", True)),
                                weight_dtype=weight_dtype)
    return report, vision.to_json()


def _architectures(model_dir: Path) -> list[str]:
    import json

    return json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or []


def parity(model_dir: Path, root: Path, language_onnx: Path, tok, decode_steps: int, weight_dtype: str
           ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metrics, details) of onnxruntime on both graphs against transformers fp32 (language matrices rounded
    as stored), end to end on a synthetic image."""
    from .... import parity as metrics_util
    from .export import VISION_DIR, load_vlm, round_language
    from .parity import vlm_parity

    family = _family({"architectures": _architectures(model_dir)})
    model = load_vlm(model_dir)
    round_language(family, model, weight_dtype)
    r = vlm_parity(family, model, language_onnx, Path(root) / VISION_DIR / "model.onnx", parity_text(tok),
                   decode_steps=decode_steps)
    metrics = {"ort_top1_agreement": r["top1_agreement"] if r["tokens_equal"] else 0.0, "ort_steps": r["steps"],
               "finite": r["finite"]}
    deltas = [r["max_abs_logit_delta"], r["vision_max_abs_delta"]]
    if None not in deltas:
        metrics["ort_max_abs_delta"] = metrics_util.round6(max(deltas))
        metrics["ort_vision_max_abs_delta"] = metrics_util.round6(r["vision_max_abs_delta"])
    details = {"ort": {k: v for k, v in r.items() if k not in ("tokens", "reference_tokens")},
               "reference": f"transformers fp32 ({family.architectures[0]}), a synthetic image, language matrices "
                            f"rounded to {weight_dtype} as stored"}
    return metrics, details


def quality(model_dir: Path, tok, *, mxfp6: bool, mxint8: bool) -> dict[str, Any]:
    from .quality import predict_vlm

    family = _family({"architectures": _architectures(model_dir)})
    return predict_vlm(family, model_dir, parity_text(tok), mxfp6=mxfp6, mxint8=mxint8)
