"""onnxruntime against transformers for a vision-language export, on a synthetic image (numpy) and the same ids:
- the vision graph alone: its outputs against the family's vision module in torch (max |delta|);
- end to end: the vision graph's outputs into the language graph (prefill of a prompt with the image's
  placeholders, then greedy decode steps feeding the retained image state, `image_idx_output` and the KV back;
  the family's form runs it: forms.py) against transformers' whole model on the same image, teacher-forced on
  onnxruntime's tokens (top-1, max |delta logit|), and both greedy runs' first tokens (`tokens_equal`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .runs import image_state
from .spec import VisionFamily


def image_prompt(family: VisionFamily, config: Any, text_ids: list[int]) -> list[int]:
    """The prompt as the processor expands it: the first text token (BOS), the image's placeholders (one per
    image row, or one per image for a cross-attention family), the rest."""
    return family.form.prompt(family, config, text_ids)


def _reference(family: VisionFamily, model, ids: list[int], inputs: dict[str, np.ndarray]) -> np.ndarray:
    import torch

    kwargs = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
              for k, v in family.form.reference_kwargs(family, model.config, inputs, ids).items()}
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), **kwargs).logits[0].float().numpy()


def vlm_parity(family: VisionFamily, model, language_onnx: Path, vision_onnx: Path, text_ids: list[int],
               decode_steps: int = 8, seed: int = 0, inputs: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """Both halves and the whole against transformers (the model already rounded as the export stores it), on
    the family's synthetic image of `seed` (or on `inputs`, the vision graph's inputs)."""
    import torch

    from ..ort import compare

    inputs = family.vision_inputs(model.config, seed) if inputs is None else inputs
    image = image_state(vision_onnx, inputs)
    with torch.no_grad():
        ref_image = family.vision_module(model)(*(torch.from_numpy(a) for a in inputs.values()))
    ref_image = dict(zip(image, ref_image if isinstance(ref_image, tuple) else (ref_image,)))
    prompt = image_prompt(family, model.config, text_ids)
    ctx_len = len(prompt) + decode_steps + 8
    got = family.form.run_language(family, model.config, language_onnx, image, inputs, prompt, decode_steps, ctx_len)
    ref = _reference(family, model, prompt + got["tokens"][:-1], inputs)[len(prompt) - 1:]
    greedy, ids = [], list(prompt)
    for _ in range(decode_steps + 1):  # transformers greedy by whole forwards, from the same image
        greedy.append(int(_reference(family, model, ids, inputs)[-1].argmax()))
        ids.append(greedy[-1])
    same = all(image[k].shape == tuple(ref_image[k].shape) for k in image)
    vision_delta = max(float(np.abs(image[k] - ref_image[k].numpy()).max()) for k in image) if same else None
    rows = int(next(iter(image.values())).shape[-2])  # [images, rows, hidden] or [batch, heads, rows, head_dim]
    return {**compare(ref, got["logits"]), "vision_max_abs_delta": vision_delta, "vision_rows": rows,
            "prompt_tokens": len(prompt), "image_rows_consumed": got["image_rows"][0], "tokens": got["tokens"],
            "reference_tokens": greedy, "tokens_equal": got["tokens"] == greedy}
