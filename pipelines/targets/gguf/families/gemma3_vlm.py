"""Gemma 3 vision-language model, its language model (Gemma3ForConditionalGeneration): llama.cpp arch `gemma3`.

The text model is Gemma 3's (`gemma3.py`: PLUS_ONE norms, q/k norms, sliding layers with their own rope base),
read from the nested text config, whose tied embeddings are the default (Gemma3Config ties them; released
configs do not say). Released checkpoints and transformers 5.23's save keep it under `language_model.model.*`,
transformers 5's own layout under `model.language_model.*` (`shared.VLM_RENAMES`). The SigLIP tower
(`vision_tower.*`) and the projector (`multi_modal_projector.*`) go to the projector's GGUF (`mmproj`).
llama.cpp's converter also drops embedding rows past the tokenizer's size; this converter keeps them (unused
tokens), as it does for every family whose config's vocab_size is larger than the tokenizer.
"""

from __future__ import annotations

import dataclasses

from .gemma3 import FAMILY as GEMMA3
from .shared import VISION_TENSORS, VLM_RENAMES

FAMILY = dataclasses.replace(
    GEMMA3,
    name="gemma3_vlm",
    architectures=("Gemma3ForConditionalGeneration",),
    tied_default=True,
    ignored=GEMMA3.ignored + VISION_TENSORS,
    renames=VLM_RENAMES,
)
