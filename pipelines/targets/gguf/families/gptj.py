"""GPT-J: written as llama.cpp arch `phi2`, because llama.cpp has no GPT-J graph.

llama.cpp knows the name `gptj` but builds no model for it, so a `gptj` GGUF would not load. GPT-J's block
is exactly Phi-2's: one LayerNorm feeding attention and a GELU MLP in parallel (x + attn(ln x) + mlp(ln x)),
rope on the first `rotary_dim` dimensions of each head, a biased final LayerNorm and a biased lm_head.
Two differences are bridged here:
- GPT-J rotates adjacent pairs (x0, x1), (x2, x3), ... (rotate_every_two) where Phi-2's NEOX rope rotates
  (x_i, x_(i + rotary_dim/2)): the first rotary_dim rows of each Q and K head are reordered evens-then-odds,
  which turns one into the other (Q.K is unchanged by the same reordering of both);
- GPT-J's attention output projection has no bias, which llama.cpp's phi2 requires: a zero bias is written.
GPT-J's q/k/v have no biases (phi2's are optional) and its rotary base is 10000.
"""

from __future__ import annotations

import numpy as np

from ....core.errors import ModelFormatError
from .shared import GELU, MASK_BUFFERS, ffn_length
from .spec import A, Family, HParams, K, R, T, derived, name, refuse_true, require_activation, reshaped, tensor, weight_and_bias

LAYER = "transformer.h.{bid}"


def rotary_dim(hp: HParams) -> int:
    return int(hp.get("rotary_dim") or hp.head_dim)


def pairs_to_halves(w: np.ndarray, n_head: int, rot: int) -> np.ndarray:
    """Per head, rows [0, 2, 4, ..., rot-2, 1, 3, ..., rot-1, rot, ...]: GPT-J's adjacent rotary pairs become
    NEOX's (i, i + rot/2) pairs; the unrotated rows stay where they are."""
    head_dim = w.shape[0] // n_head
    order = np.concatenate([np.arange(0, rot, 2), np.arange(1, rot, 2), np.arange(rot, head_dim)])
    return np.ascontiguousarray(w.reshape(n_head, head_dim, *w.shape[1:])[:, order].reshape(w.shape))


# Looked up at call time, so a negative-control test can replace pairs_to_halves.
ROTARY_PAIRS = reshaped("gptj_rotary_pairs", lambda w, hp: pairs_to_halves(w, hp.n_head, rotary_dim(hp)))


def zero_output_biases(hp: HParams) -> dict[str, np.ndarray]:
    bias = name(T.ATTN_OUT, "bias")
    return {bias.format(bid=bid): np.zeros(hp.hidden, dtype=np.float32) for bid in range(hp.n_layers)}


def _check(hp: HParams) -> None:
    rot = rotary_dim(hp)
    if rot % 2 or rot > hp.head_dim:
        raise ModelFormatError(f"gptj rotary_dim={rot} must be even and at most the head size {hp.head_dim}")
    refuse_true(hp, "gptj", "tie_word_embeddings", "llama.cpp's phi2 needs its own output matrix and bias")
    require_activation(hp, "gptj", GELU, "llama.cpp's gptj runs a GELU MLP", key="activation_function")


FAMILY = Family(
    name="gptj",
    gguf_arch="phi2",
    architectures=("GPTJForCausalLM",),
    tensors=(
        tensor(T.TOKEN_EMBD, "transformer.wte.weight"),
        *weight_and_bias(T.OUTPUT_NORM, "transformer.ln_f"),
        *weight_and_bias(T.OUTPUT, "lm_head"),
        *weight_and_bias(T.ATTN_NORM, LAYER + ".ln_1"),
        tensor(T.ATTN_Q, LAYER + ".attn.q_proj.weight", ROTARY_PAIRS),
        tensor(T.ATTN_K, LAYER + ".attn.k_proj.weight", ROTARY_PAIRS),
        tensor(T.ATTN_V, LAYER + ".attn.v_proj.weight"),
        tensor(T.ATTN_OUT, LAYER + ".attn.out_proj.weight"),
        *weight_and_bias(T.FFN_UP, LAYER + ".mlp.fc_in"),
        *weight_and_bias(T.FFN_DOWN, LAYER + ".mlp.fc_out"),
    ),
    params=(
        derived(K.FEED_FORWARD_LENGTH, ffn_length),
        derived(A.HEAD_COUNT_KV, lambda hp: hp.n_head),
        derived(R.DIMENSION_COUNT, rotary_dim),
    ),
    extra_tensors=zero_output_biases,
    ignored=MASK_BUFFERS + (r"transformer\.h\.\d+\.attn\.embed_positions",),
    check=_check,
    tied_output=None,  # never tied (refused): lm_head is always written
    block_prefix="transformer.h",
)
