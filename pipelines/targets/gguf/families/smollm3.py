"""SmolLM3 (SmolLM3ForCausalLM): llama.cpp arch `smollm3`.

Llama's tensors (the rope is llama's, adjacent pairs, so Q and K rows are permuted per head) and tied
embeddings by default, with "NoPE" layers: transformers skips the rope on the layers whose `no_rope_layers`
entry is 0 (by default every 4th), and llama.cpp hard-codes exactly that: no rope on layer i when
(i + 1) % 4 == 0, with no key to say otherwise. A config whose NoPE layers are placed differently, with
sliding-window layers (llama.cpp's smollm3 has no window), with attention or MLP biases, or with llama3
rope scaling (no rope factor tensor there) is refused.
"""

from __future__ import annotations

from ....core.errors import ModelFormatError
from .shared import EMBEDDINGS, NORMS, ROTARY_BUFFERS, SWIGLU, VOCAB_AND_ROPE_DIMS, attention
from .spec import Family, HParams, refuse_rope, refuse_true, require_activation

NOPE_PERIOD = 4  # llama.cpp's smollm3: n_no_rope_layer_step


def rope_layers(hp: HParams) -> list[int]:
    """1 where the layer applies the rope: the config's no_rope_layers, or transformers' default from the interval."""
    value = hp.get("no_rope_layers")
    if value is None:
        interval = int(hp.get("no_rope_layer_interval") or NOPE_PERIOD)
        value = [int((i + 1) % interval != 0) for i in range(hp.n_layers)]
    return [int(v) for v in value]


def _check(hp: HParams) -> None:
    expected = [int((i + 1) % NOPE_PERIOD != 0) for i in range(hp.n_layers)]
    if rope_layers(hp) != expected:
        raise ModelFormatError(f"smollm3 GGUF needs no_rope_layers == {expected} (llama.cpp skips the rope on every "
                               f"{NOPE_PERIOD}th layer, and only there), config has {rope_layers(hp)}")
    types = hp.get("layer_types") or []
    if "sliding_attention" in types or (hp.get("use_sliding_window") and hp.get("sliding_window")
                                        and not hp.get("layer_types")):
        raise ModelFormatError("smollm3 with sliding-window layers is not supported: llama.cpp's smollm3 runs full "
                               "attention on every layer")
    refuse_true(hp, "smollm3", "attention_bias", "llama.cpp's smollm3 has no attention output bias")
    refuse_true(hp, "smollm3", "mlp_bias", "llama.cpp's smollm3 has no MLP biases")
    refuse_rope(hp, "smollm3")
    require_activation(hp, "smollm3", "silu", "llama.cpp's smollm3 runs a SiLU-gated MLP")


FAMILY = Family(
    name="smollm3",
    gguf_arch="smollm3",
    architectures=("SmolLM3ForCausalLM",),
    tensors=EMBEDDINGS + NORMS + attention() + SWIGLU,
    params=VOCAB_AND_ROPE_DIMS,
    ignored=ROTARY_BUFFERS,
    check=_check,
    tied_default=True,  # SmolLM3Config's tie_word_embeddings default
)
