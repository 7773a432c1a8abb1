"""IBM Granite (3.x dense): the Llama layout, with four multipliers llama.cpp's `granite` arch reads as keys.

transformers scales the embeddings (`embedding_multiplier`), each residual branch (`residual_multiplier`),
the attention scores (`attention_multiplier` replaces 1/sqrt(head_dim)) and divides the logits
(`logits_scaling`). They are written with transformers' defaults (1.0) when the config omits them:
llama.cpp reads a missing attention scale as 1/sqrt(head_dim) and requires the logit scale. The rope is
llama's (adjacent pairs), so Q and K are permuted as for Llama; the MLP may carry biases (`mlp_bias`).
"""

from __future__ import annotations

from ....core.errors import ModelFormatError
from .shared import EMBEDDINGS, LAYER, NORMS, ROTARY_BUFFERS, SWIGLU, VOCAB_AND_ROPE_DIMS, attention, llama3_rope_freqs
from .spec import A, Family, HParams, K, T, derived, tensor

MLP_BIASES = tuple(tensor(t, f"{LAYER}.mlp.{hf}.bias", suffix="bias", optional=True)
                   for t, hf in ((T.FFN_GATE, "gate_proj"), (T.FFN_UP, "up_proj"), (T.FFN_DOWN, "down_proj")))


def _multiplier(config_key: str):
    return lambda hp: float(hp.find(config_key, default=1.0))  # transformers' default when unset


def _check(hp: HParams) -> None:
    # llama.cpp's granite graph asserts head size == rotary size == hidden / heads (its converter drops head_dim)
    if hp.get("head_dim") is not None and int(hp.get("head_dim")) != hp.hidden // hp.n_head:
        raise ModelFormatError(f"granite GGUF needs head_dim == hidden_size / num_attention_heads "
                               f"({hp.hidden // hp.n_head}), config has {hp.get('head_dim')}")


FAMILY = Family(
    name="granite",
    gguf_arch="granite",
    architectures=("GraniteForCausalLM",),
    tensors=EMBEDDINGS + NORMS + attention() + SWIGLU + MLP_BIASES,
    params=VOCAB_AND_ROPE_DIMS + (
        derived(K.EMBEDDING_SCALE, _multiplier("embedding_multiplier"), float),
        derived(K.RESIDUAL_SCALE, _multiplier("residual_multiplier"), float),
        derived(A.SCALE, _multiplier("attention_multiplier"), float),
        derived(K.LOGIT_SCALE, _multiplier("logits_scaling"), float),
    ),
    extra_tensors=llama3_rope_freqs,
    ignored=ROTARY_BUFFERS,
    check=_check,
)
