"""The device's quality predicted for a vision-language compile, before compiling: the two QPCs emulated in
torch against transformers fp32 on the same synthetic image and ids.
- vision QPC: never MXFP6 (QEfficient's rule), `-convert-to-fp16`: the vision module's weights rounded to fp16;
- language QPC: MXFP6 E2M3 on every constant MatMul weight of the language model (or fp16), MXINT8 (or fp16)
  on the K/V written to the cache, the image rows as the vision emulation gives them.
Every text position after the image is scored (top-1, KL, max |delta logit|, and the perplexity of the text's next
tokens, as quality.py scores a decoder's). Compute stays fp32, as in quality.py. Memory: the model streamed from
the checkpoint twice in turn (reference, then emulation), each resident when it fits, else unit by unit with the
vision side held (vision/streamed.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .spec import VisionFamily


def predict_vlm(family: VisionFamily, model_dir: Path, files: list[Path], text_ids: list[int], *,
                mxfp6: bool = True, mxint8: bool = True, seed: int = 0, resident: bool = True) -> dict[str, Any]:
    """`resident`: keep every unit after its first load (the model fits with margin); else the language model
    runs unit by unit (quality.run_decoder), the vision side held throughout."""
    import numpy as np
    import torch

    from ....model.streamed_model import StreamedCausalLM
    from ....model.unit_memory import trim_heap
    from ....validation import parity
    from ..mx import fake_mxfp6, fake_mxint8
    from ..quality import fake_fp16, mx_transform, perplexity_change
    from .export import language_decoder, language_shim
    from .parity import _reference, image_prompt
    from .streamed import split_transform, vision_side

    with StreamedCausalLM(Path(model_dir), files, resident=resident) as plain:
        inputs = family.vision_inputs(plain.model.config, seed)
        prompt = image_prompt(family, plain.model.config, text_ids)
        with vision_side(plain, family):
            ref = _reference(family, plain.model, prompt, inputs)
    trim_heap()
    with StreamedCausalLM(Path(model_dir), files, resident=resident) as lm:
        # the vision QPC: fp16, never MXFP6; the language QPC: MXFP6 (or fp16) on its constant MatMul weights
        language = mx_transform(language_shim(family, lm.model), fake_mxfp6 if mxfp6 else fake_fp16)
        lm.transform = split_transform(lm, family, fake_fp16, language)
        with torch.no_grad(), vision_side(lm, family):
            image = family.vision_module(lm.model)(*(torch.from_numpy(a) for a in inputs.values()))
        image = image if isinstance(image, tuple) else (image,)  # vision_embeds (and DeepStack features), or K/V
        decoder = language_decoder(family, lm.model, batch_index=False, ctx_len=len(prompt),
                                   kv_transform=fake_mxint8 if mxint8 else fake_fp16)
        decoder.all_positions = True
        got = family.form.streamed_logits(family, lm.model.config, lm, decoder, image, inputs, prompt, fake_fp16)
        token = family.image_token_id(lm.model.config)
    trim_heap()
    first_text = max(i for i, t in enumerate(prompt) if t == token) + 1  # the text the image conditions
    total = parity.compare(ref[first_text:], got[first_text:])
    # the text path's perplexity, on the same positions: each one's next token of the prompt's text
    text = [prompt[first_text:]]
    return {"positions": total.positions, "top1": round(total.top1_agreement, 6), "kl": float(f"{total.mean_kl:.6g}"),
            "max_abs_logit_delta": float(f"{total.max_abs_logit_delta:.6g}"),
            **perplexity_change(text, [ref[first_text:]], [got[first_text:]]),
            "finite": bool(np.isfinite(got).all()), "resident": resident,
            "emulated": ["fp16 vision weights", "mxfp6 language weights" if mxfp6 else "fp16 language weights",
                         "mxint8 kv cache" if mxint8 else "float16 kv cache"]}
