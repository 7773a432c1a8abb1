"""The vocabulary of AI 100 vision-language family declarations (QEfficient's dual-QPC form,
reference/ai100-qpc.md "VLMs"): what a family says about its model, read by one export (export.py) and one
parity run (parity.py), so neither holds a per-family branch.

A vision-language model is exported as two graphs:
- the vision graph: the family's `vision_module` (vision tower + projector, transformers' own modules) from
  the family's image inputs (`pixel_values` and its extras) to `vision_embeds` [vision_batch, vision_size,
  hidden], the language model's hidden size; compiled without retained state and never MXFP6;
- the language graph: the retained-state decoder (decoder.py) of the family's `language_model`, which takes
  `vision_embeds` and `image_idx` beside the text inputs and writes the image rows over the embeddings of the
  image placeholder tokens (`image_token_id`), as QEfficient's language decoder does.
A family whose language model reads the image through cross-attention layers (Mllama) declares another
`form` (forms.py): its vision graph outputs those layers' K/V, and its language graph takes them as retained
state with a per-token `cross_attention_mask`. The family also says how transformers runs the whole model on the same inputs (`reference_kwargs`), so parity
compares the two graphs end to end with the model as its authors wrote it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .forms import MERGED_ROWS

# (the VLM in memory) -> (its text config, its decoder stack, its lm_head): what build_decoder reads
LanguageModel = Callable[[Any], tuple[Any, Any, Any]]


@dataclass(frozen=True)
class VisionFamily:
    """One vision-language family.

    - `vision_module(model)`: a torch module whose forward takes the arrays of `vision_inputs`, in order, and
      returns vision_embeds [vision_batch, vision_size, hidden] (traced at opset 17, standard ops);
    - `vision_inputs(config, seed)`: a synthetic image as the vision graph takes it (numpy, deterministic; names
      in graph order), and `vision_axes` the dynamic axes of those inputs;
    - `vision_size(config)`: the image rows one image gives the language model;
    - `image_token_id(config)`: the placeholder token the image rows replace;
    - `language_model(model)`: (text config, decoder stack, lm_head) of the VLM in memory;
    - `reference_kwargs(config, inputs)`: what transformers' forward takes beside input_ids for that image;
    - `vision_symbols(config)`: the Vision specialization's symbols (every value a string);
    - `max_image_tokens`: placeholder tokens a prompt may carry before the processor expands them (1: one image);
    - `form`: how the image reaches the language model (forms.py): merged rows (default) or cross-attention K/V.
    """

    architectures: tuple[str, ...]
    vision_module: Callable[[Any], Any]
    vision_inputs: Callable[[Any, int], dict[str, np.ndarray]]
    vision_size: Callable[[Any], int]
    image_token_id: Callable[[Any], int]
    language_model: LanguageModel
    reference_kwargs: Callable[[Any, dict[str, np.ndarray]], dict[str, Any]]
    vision_symbols: Callable[[Any], dict[str, str]]
    vision_axes: dict[str, dict[int, str]] = field(default_factory=lambda: {"pixel_values": {0: "batch_size"}})
    form: Any = MERGED_ROWS


def config_value(config: Any, *names: str) -> Any:
    """The first of `names` a transformers config (or its dict) sets."""
    for name in names:
        value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if value is not None:
            return value
    raise AttributeError(f"the config sets none of {', '.join(names)}")


def text_causal_lm_config(text_config: Any) -> Any:
    """The text config with `architectures` naming the causal LM of its model_type (the decoder family is read
    from it): a VLM's text config names none."""
    import copy

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg = copy.copy(text_config)
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(cfg.model_type)
    if name is None:
        from ....errors import NotApplicableError

        raise NotApplicableError(f"the language model of this VLM ({cfg.model_type}) has no causal LM in transformers")
    cfg.architectures = [name]
    return cfg


def nested_language_model(model) -> tuple[Any, Any, Any]:
    """transformers 5's layout of most VLMs: `model.model.language_model` (the decoder stack), `model.lm_head`."""
    return text_causal_lm_config(model.config.get_text_config()), model.model.language_model, model.lm_head


def pixels(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """A synthetic normalized image (CLIP-style mean/std already applied): smooth gradients plus noise, so
    patches differ from each other (a constant image would hide a wrong patch order)."""
    rng = np.random.default_rng(seed)
    cols = np.linspace(-1.0, 1.0, shape[-1], dtype=np.float32)
    rows = np.linspace(-1.0, 1.0, shape[-2], dtype=np.float32) if len(shape) >= 2 else np.ones(1, np.float32)
    base = rows[:, None] * cols[None, :] if len(shape) >= 2 else cols
    return (0.8 * base + 0.4 * rng.standard_normal(shape)).astype(np.float32)
