"""The device's quality predicted for a vision-language compile, before compiling: the two QPCs emulated in
torch against transformers fp32 on the same synthetic image and ids.
- vision QPC: never MXFP6 (QEfficient's rule), `-convert-to-fp16`: the vision module's weights rounded to fp16;
- language QPC: MXFP6 E2M3 on every constant MatMul weight of the language model (or fp16), MXINT8 (or fp16)
  on the K/V written to the cache, the image rows as the vision emulation gives them.
Every text position after the image is scored (top-1, KL, max |delta logit|). Compute stays fp32, as in
quality.py. Memory: two copies of the model in fp32 (plan's whole-model estimate).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .spec import VisionFamily


def predict_vlm(family: VisionFamily, model_dir: Path, text_ids: list[int], *, mxfp6: bool = True,
                mxint8: bool = True, seed: int = 0) -> dict[str, Any]:
    import numpy as np
    import torch

    from .... import parity
    from ..mx import fake_mxint8
    from ..quality import fake_fp16, fake_mxfp6_weights
    from .export import language_decoder, language_shim, load_vlm
    from .parity import _reference, image_prompt

    reference = load_vlm(model_dir)
    inputs = family.vision_inputs(reference.config, seed)
    prompt = image_prompt(family, reference.config, text_ids)
    ref = _reference(family, reference, prompt, inputs)
    del reference
    model = load_vlm(model_dir)
    vision = family.vision_module(model)
    with torch.no_grad():
        for p in vision.parameters():  # the vision QPC: fp16, never MXFP6
            p.copy_(fake_fp16(p))
        fake_mxfp6_weights(language_shim(family, model), None if mxfp6 else fake_fp16)
        image = vision(*(torch.from_numpy(a) for a in inputs.values()))
        decoder = language_decoder(family, model, batch_index=False, ctx_len=len(prompt),
                                   kv_transform=fake_mxint8 if mxint8 else fake_fp16)
        decoder.all_positions = True
        args = family.form.decoder_args(family, model.config, image, inputs, prompt, decoder, fake_fp16)
        got = decoder(*args)[0][0].float().numpy()
    token = family.image_token_id(model.config)
    first_text = max(i for i, t in enumerate(prompt) if t == token) + 1  # the text the image conditions
    total = parity.compare(ref[first_text:], got[first_text:])
    return {"positions": total.positions, "top1": round(total.top1_agreement, 6), "kl": float(f"{total.mean_kl:.6g}"),
            "max_abs_logit_delta": float(f"{total.max_abs_logit_delta:.6g}"),
            "finite": bool(np.isfinite(got).all()),
            "emulated": ["fp16 vision weights", "mxfp6 language weights" if mxfp6 else "fp16 language weights",
                         "mxint8 kv cache" if mxint8 else "float16 kv cache"]}
