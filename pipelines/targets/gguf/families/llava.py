"""LLaVA's language model (LlavaForConditionalGeneration): llama.cpp arch `llama`.

llava-1.5 (and the Vicuna / Llama / Mistral decoders of its kind) runs a Llama decoder: `llama.py`'s rules
(Q/K rows permuted to llama.cpp's rotary pairs, Llama 3.1 `rope_freqs`), read from the nested text config
under the wrapper's architecture (the text config names its base model: LlamaForCausalLM). Released checkpoints
and transformers 5.23's save keep it under `language_model.model.*` / `language_model.lm_head.*`, transformers
5's own layout under `model.language_model.*` / `lm_head.*` (`shared.VLM_RENAMES`). The CLIP tower and the
projector go to the projector's GGUF (`mmproj`). A LLaVA on another decoder (Qwen2: llava-interleave,
llava-onevision) is refused: llama.cpp's converter would write it as a Llama, which it is not.
"""

from __future__ import annotations

import dataclasses

from ....core.errors import ModelFormatError
from .llama import FAMILY as LLAMA
from .shared import VISION_TENSORS, VLM_RENAMES
from .spec import HParams

DECODERS = ("llama", "mistral")  # text_config.model_type of the decoders llama.cpp's `llama` runs


def _check(hp: HParams) -> None:
    kind = hp.get("model_type", "llama")
    if kind not in DECODERS:
        raise ModelFormatError(f"LLaVA with a {kind!r} language model is not supported for GGUF: llama.cpp's "
                               "converter writes every LLaVA as a Llama")
    LLAMA.check(hp)


FAMILY = dataclasses.replace(
    LLAMA,
    name="llava",
    architectures=("LlavaForConditionalGeneration",),
    ignored=LLAMA.ignored + VISION_TENSORS,
    renames=VLM_RENAMES,
    check=_check,
)
