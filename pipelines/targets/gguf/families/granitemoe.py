"""IBM Granite MoE (GraniteMoeForCausalLM, granite-3.x-1b-a400m / 3b-a800m): llama.cpp arch `granitemoe`.

Granite's dense layout and multipliers (`granite.py`: embedding / residual / attention multipliers and
the logit divisor as keys, Q and K permuted for llama.cpp's adjacent-pair rope) with a sparse MoE MLP.
Its checkpoints store the experts already stacked, JetMoE style:

- `block_sparse_moe.input_linear.weight` [experts, 2 x ff, hidden] is [gate; up] per expert: split along
  axis 1 into `ffn_gate_exps` and `ffn_up_exps` (llama.cpp's granitemoe loads no fused gate_up tensor);
- `block_sparse_moe.output_linear.weight` [experts, hidden, ff] is `ffn_down_exps` as it is;
- the router `block_sparse_moe.router.layer.weight` becomes `ffn_gate_inp` (kept f32, as every router).

HF takes the softmax of the top-k router logits, which is llama.cpp's softmax gating with renormalized
top-k weights, so no config refuses on that. GraniteMoeShared (a shared expert) is another architecture
and is not declared.
"""

from __future__ import annotations

from .granite import FAMILY as GRANITE
from .shared import EMBEDDINGS, LAYER, NORMS, attention
from .spec import Family, HParams, Rule, T, name, split_axis, tensor

MOE = LAYER + ".block_sparse_moe"


def _halves(hp: HParams) -> tuple[int, int]:
    ff = int(hp.require("intermediate_size"))
    return ff, ff


SPLIT_GATE_UP = split_axis("split_expert_gate_up", _halves, axis=1)

SPARSE_MOE = (
    tensor(T.FFN_GATE_INP, MOE + ".router.layer.weight"),
    Rule((name(T.FFN_GATE_EXP), name(T.FFN_UP_EXP)), (MOE + ".input_linear.weight",), SPLIT_GATE_UP),
    tensor(T.FFN_DOWN_EXP, MOE + ".output_linear.weight"),
)

FAMILY = Family(
    name="granitemoe",
    gguf_arch="granitemoe",
    architectures=("GraniteMoeForCausalLM",),
    tensors=EMBEDDINGS + NORMS + attention() + SPARSE_MOE,
    params=GRANITE.params,  # vocab, rope dims and the four multipliers
    extra_tensors=GRANITE.extra_tensors,  # llama3 rope_freqs (granitemoe loads them)
    ignored=GRANITE.ignored,
    check=GRANITE.check,  # head_dim == hidden / heads (the granite graph asserts it)
)
