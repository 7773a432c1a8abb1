"""Cohere Command R7B (Cohere2ForCausalLM): llama.cpp arch `cohere2`.

Command-R's block (`cohere.py`): one bias-free LayerNorm (`input_layernorm`) feeds attention and MLP in
parallel, x + attn(ln x) + mlp(ln x), so there is no ffn_norm; the final norm is the same LayerNorm; HF
rotates interleaved pairs, llama.cpp's NORM rope for this arch, so Q and K are stored as they are; the
logits are multiplied by `logit_scale` (0.0625 by default, always written). New in Cohere 2:

- sliding-window attention on most layers: the window (`attention.sliding_window`, required by llama.cpp)
  and which layers slide (`attention.sliding_window_pattern`, one bool per layer from `layer_types`; HF's
  default, and llama.cpp's when the key is missing, is three sliding layers then a full one);
- the rope is applied on the sliding layers only: the full-attention layers have no position encoding, in
  HF and in llama.cpp's graph alike, so nothing is written for them;
- the output matrix is token_embd (llama.cpp's cohere2 has no `output` tensor): transformers ties the
  embeddings by default for this architecture, and an untied model is refused.

Refused in one line: attention biases (HF puts one on o_proj too, which llama.cpp's cohere2 never loads),
a scaled rope (llama.cpp runs it unscaled), no sliding window, another activation than SiLU, and a head
size other than hidden / heads (llama.cpp's cohere2 sizes Q and the output projection by n_embd).
"""

from __future__ import annotations

import gguf

from ....core.errors import ModelFormatError
from .shared import LAYER, ROTARY_BUFFERS, SWIGLU, VOCAB_AND_ROPE_DIMS, attention, layer_types
from .spec import (
    IDENTITY,
    A,
    Family,
    HParams,
    K,
    R,
    T,
    derived,
    param,
    refuse_false,
    refuse_rope,
    refuse_true,
    require_activation,
    require_whole_heads,
    tensor,
)

PERIOD = 4  # HF's (and llama.cpp's) default: every 4th layer full attention, the others sliding


def period(hp: HParams) -> int:
    return int(hp.get("sliding_window_pattern") or hp.get("_sliding_window_pattern") or PERIOD)


def sliding_pattern(hp: HParams) -> list[bool]:
    return [t == "sliding_attention" for t in layer_types(hp, period(hp))]


def _check(hp: HParams) -> None:
    refuse_false(hp, "cohere2", "tie_word_embeddings", "llama.cpp's cohere2 uses token_embd as its output matrix")
    refuse_true(hp, "cohere2", "attention_bias", "llama.cpp's cohere2 has no attention output bias")
    refuse_rope(hp, "cohere2", ("default",), why="llama.cpp runs its rope unscaled")
    if not hp.get("sliding_window"):
        raise ModelFormatError("cohere2 with sliding_window=null is not supported: llama.cpp's cohere2 requires a "
                               "sliding window")
    require_activation(hp, "cohere2", "silu", "llama.cpp's cohere2 runs a SiLU-gated MLP")
    require_whole_heads(hp, "cohere2")
    sliding_pattern(hp)  # a malformed layer_types list is refused here, not while writing keys


FAMILY = Family(
    name="cohere2",
    gguf_arch="cohere2",
    architectures=("Cohere2ForCausalLM",),
    tensors=(
        tensor(T.TOKEN_EMBD, "model.embed_tokens.weight"),
        tensor(T.OUTPUT_NORM, "model.norm.weight"),
        tensor(T.OUTPUT, "lm_head.weight", optional=True),  # only ever a tied copy (untied is refused): dropped
        tensor(T.ATTN_NORM, LAYER + ".input_layernorm.weight"),
        *attention(q=IDENTITY, k=IDENTITY),
        *SWIGLU,
    ),
    params=VOCAB_AND_ROPE_DIMS + (
        derived(K.LOGIT_SCALE, lambda hp: float(hp.find("logit_scale", default=0.0625)), float),
        param(A.SLIDING_WINDOW, "sliding_window"),
        # always written: the one source of truth for which layers slide (and get a rope)
        derived(A.SLIDING_WINDOW_PATTERN, sliding_pattern, kind=list),
        derived(R.SCALING_TYPE, lambda hp: gguf.RopeScalingType.NONE.value, str),
    ),
    ignored=ROTARY_BUFFERS,
    check=_check,
    tied_default=True,
)
