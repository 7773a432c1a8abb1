"""EXAONE 4.0 (Exaone4ForCausalLM): llama.cpp arch `exaone4`.

OLMo 2's block shape with per-head norms: no pre-norms, HF's `post_attention_layernorm` /
`post_feedforward_layernorm` normalise the attention and MLP outputs before the residual adds (llama.cpp's
`post_attention_norm` / `post_ffw_norm`), and `q_norm` / `k_norm` are RMS norms over each head ([head_dim])
before the rope. The rope rotates halves (NEOX) as HF stores them, so nothing is permuted; Llama 3.1
frequency scaling becomes the `rope_freqs` tensor.

Sliding windows: with `sliding_window` set, transformers slides the layers `layer_types` marks and applies
the rope *only* on those (the full-attention layers have no position encoding); with it null every layer is
full attention with the rope. llama.cpp's exaone4 decides by the layer count instead: the 64-layer 32B gets
sliding windows (window and per-layer pattern read from the keys written here, rope on the sliding layers
only), every other size runs full attention with the rope everywhere. So a 64-layer model needs a window and
any other needs `sliding_window: null`; the rest is refused. llama.cpp sizes the attention output as
[hidden, hidden] (heads x head_dim must equal hidden) and has no biases.
"""

from __future__ import annotations

from ....core.errors import ModelFormatError
from .shared import EMBEDDINGS, LAYER, ROTARY_BUFFERS, SWIGLU, VOCAB_AND_ROPE_DIMS, attention, llama3_rope_freqs
from .spec import IDENTITY, A, Family, HParams, T, derived, refuse_rope, require_activation, require_whole_heads, tensor

SWA_LAYERS = 64  # llama.cpp's exaone4 enables sliding windows for this layer count only (the 32B)
DEFAULT_WINDOW = 4096  # Exaone4Config's default sliding_window


def window(hp: HParams) -> int | None:
    return hp.get("sliding_window", DEFAULT_WINDOW)


def sliding_pattern(hp: HParams) -> list[bool]:
    """One bool per layer: `layer_types`, else transformers' rule from `sliding_window_pattern` (4, or "LLLG")."""
    types = hp.get("layer_types")
    if types is None:
        period = hp.get("sliding_window_pattern", 4)
        if isinstance(period, str):
            types = ["sliding_attention" if period[i % len(period)] == "L" else "full_attention"
                     for i in range(hp.n_layers)]
        else:
            types = ["sliding_attention" if period and (i + 1) % int(period) else "full_attention"
                     for i in range(hp.n_layers)]
    if len(types) != hp.n_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ModelFormatError(f"config.json layer_types must name sliding_attention or full_attention for each of "
                               f"the {hp.n_layers} layers, got {types!r}")
    return [t == "sliding_attention" for t in types]


def _check(hp: HParams) -> None:
    if hp.n_layers == SWA_LAYERS and not window(hp):
        raise ModelFormatError(f"exaone4 with {SWA_LAYERS} layers and sliding_window=null is not supported: "
                               f"llama.cpp's exaone4 always slides (and skips the rope on full layers) at "
                               f"{SWA_LAYERS} layers")
    if hp.n_layers != SWA_LAYERS and window(hp):
        raise ModelFormatError(f"exaone4 with sliding_window={window(hp)} and {hp.n_layers} layers is not "
                               f"supported: llama.cpp's exaone4 slides only at {SWA_LAYERS} layers (else full "
                               f"attention with the rope everywhere, which needs sliding_window: null)")
    if window(hp):
        sliding_pattern(hp)
    require_activation(hp, "exaone4", "silu", "llama.cpp's exaone4 runs a SiLU-gated MLP")
    refuse_rope(hp, "exaone4", ("default", "linear", "yarn", "llama3"))
    require_whole_heads(hp, "exaone4")


def _sliding(value):
    return lambda hp: value(hp) if window(hp) else None


FAMILY = Family(
    name="exaone4",
    gguf_arch="exaone4",
    architectures=("Exaone4ForCausalLM",),
    tensors=EMBEDDINGS + attention(q=IDENTITY, k=IDENTITY) + (
        tensor(T.ATTN_Q_NORM, LAYER + ".self_attn.q_norm.weight"),
        tensor(T.ATTN_K_NORM, LAYER + ".self_attn.k_norm.weight"),
        tensor(T.ATTN_POST_NORM, LAYER + ".post_attention_layernorm.weight"),
        tensor(T.FFN_POST_NORM, LAYER + ".post_feedforward_layernorm.weight"),
    ) + SWIGLU,
    params=VOCAB_AND_ROPE_DIMS + (
        derived(A.SLIDING_WINDOW, _sliding(window)),
        derived(A.SLIDING_WINDOW_PATTERN, _sliding(sliding_pattern), kind=list),
    ),
    extra_tensors=llama3_rope_freqs,
    ignored=ROTARY_BUFFERS,
    check=_check,
)
