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
state with a per-token `cross_attention_mask`. The family also says how transformers runs the whole model on
the same inputs (`reference_kwargs`), so parity compares the two graphs end to end with the model as its
authors wrote it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .forms import MERGED_ROWS

if TYPE_CHECKING:  # numpy loads where an image is made or run, not when the families are read
    import numpy as np

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
    - `image_token_id(config)`: the placeholder token the image rows replace (default: the config's
      image_token_id / image_token_index);
    - `language_model(model)`: (text config, decoder stack, lm_head) of the VLM in memory (default:
      `nested_language_model`, transformers 5's usual layout);
    - `reference_kwargs(config, inputs)`: what transformers' forward takes beside input_ids for that image
      (default: pixel_values);
    - `vision_symbols(config)`: the Vision specialization's symbols (every value a string);
    - `single_qpc`: whether the family also compiles as one QPC (vision/single.py), as QEfficient allows;
    - `positions(config, prompt_ids, inputs)`: the language graph's position_ids for the prompt (numpy int64),
      [1, seq] `arange` when None; a family with more rows (M-RoPE: [4, 1, seq], row 0 the text positions)
      says so here, and decode continues every row from its own max + 1;
    - `reference_token_kwargs(config, ids)`: what transformers' forward takes beside input_ids that depends on
      the ids (Qwen's `mm_token_type_ids`); None: nothing;
    - `deepstack(config)`: the DeepStack levels; when set, the vision module returns (vision_embeds,
      deepstack_features [levels, images, vision_size, hidden]) and the language graph takes both
      (layout.DEEPSTACK: level i is added to the image rows after decoder layer i, Qwen3-VL's DeepStack);
    - `form`: how the image reaches the language model (forms.py): merged rows (default) or cross-attention K/V.
    """

    architectures: tuple[str, ...]
    vision_module: Callable[[Any], Any]
    vision_inputs: Callable[[Any, int], dict[str, np.ndarray]]
    vision_size: Callable[[Any], int]
    vision_symbols: Callable[[Any], dict[str, str]]
    vision_axes: dict[str, dict[int, str]] = field(default_factory=lambda: {"pixel_values": {0: "batch_size"}})
    # LLaVA-style defaults: most families of transformers share them
    image_token_id: Callable[[Any], int] = field(default=lambda config: image_token_index(config))
    language_model: LanguageModel = field(default=lambda model: nested_language_model(model))
    reference_kwargs: Callable[[Any, dict[str, np.ndarray]], dict[str, Any]] = field(
        default=lambda config, inputs: {"pixel_values": inputs["pixel_values"]})
    single_qpc: bool = True  # QEfficient also compiles it as one QPC (kv_offload=False); False: dual only
    positions: Callable[[Any, list[int], dict[str, np.ndarray]], np.ndarray] | None = None
    reference_token_kwargs: Callable[[Any, np.ndarray], dict[str, Any]] | None = None
    deepstack: Callable[[Any], int] | None = None
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
        from ....core.errors import NotApplicableError

        raise NotApplicableError(f"the language model of this VLM ({cfg.model_type}) has no causal LM in transformers")
    cfg.architectures = [name]
    return cfg


def image_token_index(config: Any) -> int:
    """The placeholder token of transformers' LLaVA-style configs (`image_token_id`, older `image_token_index`)."""
    return int(config_value(config, "image_token_id", "image_token_index"))


def image_features_module(model, arrange: Callable[[Any], Any]):
    """A module running transformers' own `get_image_features` of the VLM (tower, the config's feature layer and
    select strategy, projector) on pixel_values; `arrange` lays its per-image features out as vision_embeds."""
    import torch

    class ImageFeatures(torch.nn.Module):
        def __init__(self, vlm):
            super().__init__()
            self.inner, cfg = vlm.model, vlm.config
            self.layer, self.strategy = cfg.vision_feature_layer, cfg.vision_feature_select_strategy

        def forward(self, pixel_values):
            out = self.inner.get_image_features(pixel_values=pixel_values, vision_feature_layer=self.layer,
                                                vision_feature_select_strategy=self.strategy)
            return arrange(out.pooler_output)

    return ImageFeatures(model).eval()


def nested_language_model(model) -> tuple[Any, Any, Any]:
    """transformers 5's layout of most VLMs: `model.model.language_model` (the decoder stack), `model.lm_head`."""
    return text_causal_lm_config(model.config.get_text_config()), model.model.language_model, model.lm_head


def pixels(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """A synthetic normalized image (CLIP-style mean/std already applied): smooth gradients plus noise, so
    patches differ from each other (a constant image would hide a wrong patch order)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    cols = np.linspace(-1.0, 1.0, shape[-1], dtype=np.float32)
    rows = np.linspace(-1.0, 1.0, shape[-2], dtype=np.float32) if len(shape) >= 2 else np.ones(1, np.float32)
    base = rows[:, None] * cols[None, :] if len(shape) >= 2 else cols
    return (0.8 * base + 0.4 * rng.standard_normal(shape)).astype(np.float32)
