"""The AI 100 compile recipes of vision-language models reach compile_pending through their own gates (issue 41 item
7): qaic-fp16 and qaic-mxfp6, as shipped (options and validation unchanged), of a tiny LLaVA-1.5, Qwen2.5-VL and
Qwen3-VL. The VLM path predicts top-1, KL and the perplexity change on the text after the image (the gate
`max_predicted_ppl_delta` once failed every VLM as "not measured").

A random model's logits are near-ties that any rounding flips, which no served model's are, so each tiny model's
output head gets a least-squares fit to the parity text's next tokens (from its own final hidden states on the
check's image prompt): it then predicts that text confidently, and the emulated device has to keep it so. Every
gated number is the build's own; the fp32 perplexity is recomputed here from transformers' logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from factories import write_test_config
from test_qaic_vision import tiny_llava
from test_qaic_vision_qwen2_5_vl import tiny_qwen2_5_vl
from test_qaic_vision_qwen3_vl import tiny_qwen3_vl

ROOT = Path(__file__).resolve().parents[3]
RECIPES = ("qaic-fp16", "qaic-mxfp6")
# head_dim 64 (what the export and the device serve); M-RoPE sections cover its 32 frequencies
TEXT = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]}
# architecture -> (tiny model of it, ids past the tokenizer's it adds: image, video and vision start/end, language sizes)
MODELS = {
    "LlavaForConditionalGeneration": (tiny_llava, 1, TEXT),
    "Qwen2_5_VLForConditionalGeneration": (tiny_qwen2_5_vl, 4, {**TEXT, "rope_parameters": MROPE}),
    "Qwen3VLForConditionalGeneration": (tiny_qwen3_vl, 4,
                                        {**TEXT, "rope_parameters": {**MROPE, "mrope_interleaved": True}}),
}


def check_prompt(model, tokenizer_dir: Path) -> tuple[object, list[int], int, dict]:
    """(family, the prompt the quality check scores, its first text position after the image, transformers' kwargs
    for the synthetic image): the check's own prompt (vision/target.py)."""
    from pipelines.targets.qaic.vision import vision_family
    from pipelines.targets.qaic.vision.parity import image_prompt
    from pipelines.targets.qaic.vision.target import parity_text
    from pipelines.validation.tokenizer_cache import CachedTokenizer

    _arch, family = vision_family(model.config.to_dict())
    inputs = family.vision_inputs(model.config, 0)
    prompt = image_prompt(family, model.config, parity_text(CachedTokenizer(tokenizer_dir)))
    first_text = max(i for i, t in enumerate(prompt) if t == family.image_token_id(model.config)) + 1
    kwargs = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
              for k, v in family.form.reference_kwargs(family, model.config, inputs, prompt).items()}
    return family, prompt, first_text, kwargs


def fit_head_to_the_text(model_dir: Path, margin: float = 10.0, ridge: float = 1.0) -> float:
    """Add to the output head the ridge solution that gives each text position's next token `margin` more logit,
    from the final hidden states of the check's prompt; save the model. Returns fp32's perplexity of that text,
    computed here from transformers' logits."""
    from pipelines.targets.qaic.vision.export import load_vlm

    model = load_vlm(model_dir)
    _family, prompt, first, kwargs = check_prompt(model, model_dir)
    head, seen = model.get_output_embeddings(), []
    hook = head.register_forward_hook(lambda _m, args, _out: seen.append(args[0][0].double()))
    with torch.no_grad():
        model(input_ids=torch.tensor([prompt]), **kwargs)
    hook.remove()
    hidden, nxt = seen[0][first:len(prompt) - 1], torch.tensor(prompt[first + 1:])
    target = torch.zeros(len(nxt), head.weight.shape[0], dtype=torch.float64)
    target[torch.arange(len(nxt)), nxt] = margin
    eye = torch.eye(len(hidden), dtype=torch.float64)
    with torch.no_grad():
        head.weight += (hidden.T @ torch.linalg.solve(hidden @ hidden.T + ridge * eye, target)).T.float()
        logits = model(input_ids=torch.tensor([prompt]), **kwargs).logits[0, first:-1]
    model.save_pretrained(str(model_dir))
    return float(torch.nn.functional.cross_entropy(logits.double(), nxt).exp())


@pytest.fixture(scope="module", params=sorted(MODELS))
def published(request, smollm2_small_vocab_dir, tmp_path_factory):
    """Both compile recipes of one tiny VLM built into one store (the export once, reused by build id)."""
    from pipelines.config.registry import Config
    from pipelines.engine.build import build_and_publish

    arch = request.param
    make, extra_ids, text = MODELS[arch]
    root = tmp_path_factory.mktemp(arch)
    vocab = json.loads((smollm2_small_vocab_dir / "config.json").read_text())["vocab_size"]
    model_dir = make(root / "model", vocab=vocab + extra_ids, image_token=vocab + extra_ids - 1, **text)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).write_bytes((smollm2_small_vocab_dir / name).read_bytes())
    fp32_ppl = fit_head_to_the_text(model_dir)
    model_id = f"test-org/{arch}"
    config = Config.load(write_test_config(root / "cfg", ROOT, gates={},  # the shipped gates
                                           models=[{"id": model_id, "source": str(model_dir), "recipes": list(RECIPES)}]))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HIVE_AOT_QAIC_SDK", str(root / "no-sdk"))
        results = {r: build_and_publish(str(model_dir), r, config, str(root / "store"), model_id) for r in RECIPES}
    return arch, fp32_ppl, results


def test_both_compile_recipes_publish_compile_pending_through_the_shipped_gates(published):
    arch, fp32_ppl, results = published
    for recipe, res in results.items():
        assert (res.state, res.format) == ("compile_pending", "qaic-export-bundle"), (recipe, res.state, res.validation)
        gates = yaml.safe_load((ROOT / "recipes" / f"{recipe}.yaml").read_text())["validation"]
        assert {"min_predicted_top1", "max_predicted_kl", "max_predicted_ppl_delta"} <= set(gates)
        metrics = res.validation["metrics"]
        q = res.validation["mxfp6" if recipe == "qaic-mxfp6" else "fp16"]
        assert metrics["predicted_ppl_delta"] == q["ppl_delta"] and metrics["predicted_kl"] == q["kl"]
        assert metrics["predicted_top1"] <= 1 and metrics["predicted_top1"] >= gates["min_predicted_top1"], metrics
        assert 0 < metrics["predicted_kl"] <= gates["max_predicted_kl"], metrics
        assert abs(metrics["predicted_ppl_delta"]) <= gates["max_predicted_ppl_delta"], metrics
        # the perplexities behind the change: fp32's is transformers' here, the device's its own
        assert q["ppl_fp32"] == pytest.approx(fp32_ppl, rel=1e-3), (q, fp32_ppl)
        assert q["ppl_delta"] == pytest.approx((q["ppl"] - q["ppl_fp32"]) / q["ppl_fp32"], abs=1e-4), q
    assert results["qaic-fp16"].input.build_id == results["qaic-mxfp6"].input.build_id  # one export
    fp16, mx = (results[r].validation for r in RECIPES)
    assert fp16["fp16"]["emulated"] == ["fp16 vision weights", "fp16 language weights", "float16 kv cache"]
    assert mx["mxfp6"]["emulated"] == ["fp16 vision weights", "mxfp6 language weights", "mxint8 kv cache"]
    # each emulation moves the text by its own rounding: MXFP6 / MXINT8 far more than fp16
    assert mx["metrics"]["predicted_kl"] > 10 * fp16["metrics"]["predicted_kl"], (arch, fp16, mx)
    assert abs(mx["metrics"]["predicted_ppl_delta"]) > abs(fp16["metrics"]["predicted_ppl_delta"]), (arch, fp16, mx)

