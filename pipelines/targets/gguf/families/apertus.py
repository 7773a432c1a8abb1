"""Apertus (ApertusForCausalLM: Apertus-8B, 70B): llama.cpp arch `apertus`.

A Llama-style block with three differences:

- The MLP has no gate: down(xIELU(up(x))). xIELU has learned parameters per layer, stored as checkpoint
  scalars (`mlp.act_fn.alpha_p`, `alpha_n`, and the `beta`, `eps` buffers), not config values. llama.cpp
  reads them as per-layer float keys (`xielu.alpha_p`, ... one value per block, no arch prefix) and applies
  the softplus itself (alpha_p' = softplus(alpha_p), alpha_n' = beta + softplus(alpha_n), as transformers
  does at run time): the raw stored values are written, as llama.cpp's converter writes them.
- Per-head q/k RMS norms ([head_dim]) before the rope.
- The norms are named `attention_layernorm` (before attention) and `feedforward_layernorm` (before the MLP).
The rope rotates halves (NEOX), as HF stores Q and K, so nothing is permuted; Llama 3.1's "llama3" frequency
scaling (Apertus's default) is the `rope_freqs` tensor, as for Llama.
"""

from __future__ import annotations

import gguf

from .shared import EMBEDDINGS, LAYER, QK_NORMS, RELU2_MLP, ROTARY_BUFFERS, VOCAB_AND_ROPE_DIMS, attention, llama3_rope_freqs
from .spec import IDENTITY, Family, HParams, T, refuse_rope, require_activation, tensor

ARCH = "apertus"
XIELU = gguf.Keys.xIELU
ACT = LAYER + ".mlp.act_fn."

# (GGUF key, checkpoint scalar per layer): read as stored (softplus is llama.cpp's to apply)
XIELU_KEYS = ((XIELU.ALPHA_P, ACT + "alpha_p"), (XIELU.ALPHA_N, ACT + "alpha_n"), (XIELU.BETA, ACT + "beta"),
              (XIELU.EPS, ACT + "eps"))


def _check(hp: HParams) -> None:
    refuse_rope(hp, ARCH, ("default", "llama3", "linear", "yarn"))
    require_activation(hp, ARCH, "xielu", "llama.cpp's apertus runs the xIELU MLP")


FAMILY = Family(
    name="apertus",
    gguf_arch=ARCH,
    architectures=("ApertusForCausalLM",),
    tensors=EMBEDDINGS + (
        tensor(T.ATTN_NORM, LAYER + ".attention_layernorm.weight"),
        tensor(T.FFN_NORM, LAYER + ".feedforward_layernorm.weight"),
    ) + attention(q=IDENTITY, k=IDENTITY) + QK_NORMS + RELU2_MLP,
    params=VOCAB_AND_ROPE_DIMS,
    extra_tensors=llama3_rope_freqs,
    ignored=ROTARY_BUFFERS,
    check=_check,
    tensor_keys=XIELU_KEYS,
)
