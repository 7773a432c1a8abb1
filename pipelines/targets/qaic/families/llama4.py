"""Llama 4's language model (transformers' Llama4TextModel under Llama4ForCausalLM, also the decoder of
Llama4ForConditionalGeneration): Llama's names with these differences, each read from modeling_llama4.py:

- RoPE on pairs of interleaved dims: transformers multiplies (x[2i], x[2i+1]) as a complex number by its
  `rotary_emb`'s complex frequencies, which is GPT-J's rotate-every-two with cos / sin repeated per pair;
- NoPE layers: `config.no_rope_layers[i]` is 0 (the attention's `use_rope`) on every fourth layer: no RoPE
  there, and with `attn_temperature_tuning` their queries are scaled by log1p(floor((p + 1) / floor_scale))
  * attn_scale + 1 at position p (the attention's own attributes);
- L2 q/k norm (`use_qk_norm`, RoPE layers only: the attention has a weightless `qk_norm`) after RoPE;
- chunked attention: layer_types marks the RoPE layers "chunked_attention", where a token at p sees only the
  positions of its own chunk of `attention_chunk_size` (j // chunk == p // chunk); the NoPE layers see the
  whole past. The cache of a chunked layer stays ctx_len long here (QEfficient gives it min(ctx_len, chunk)):
  the mask alone makes it right;
- the feed-forward module is `feed_forward`: a dense gated MLP of `intermediate_size_mlp` (`activation_fn`),
  or on `moe_layers` (every interleave_moe_layer_step-th) a MoE: the router's top-k logits through a sigmoid
  (the others score 0) scale each expert's INPUT, experts stacked as [E, hidden, 2 x inter] (gate first) and
  [E, inter, hidden] ([in, out] weights), and a `shared_expert` (the dense MLP's layout) added.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .blocks import GatedMlp, QkNorm, RopeSource, rotary_emb_table, rotate_interleaved
from .llama import LLAMA
from .spec import Moe

ARCHITECTURES = ("Llama4ForCausalLM",)
TEXT_MODEL_TYPES = ("llama4_text",)  # the language model of Llama4ForConditionalGeneration
# Scout and Maverick declare 10M positions (a 10 GB RoPE table); QEfficient serves 65536 (its
# LLAMA4_MAX_POSITION_EMBEDDINGS), so the table and the compiled ctx_len stop there
MAX_POSITIONS = 65536


def complex_rotary_table(src: RopeSource):
    """`<base>.rotary_emb`'s complex frequencies (one per pair of dims, attention scaling included) as real
    cos / sin tables, each value repeated for the two dims of its pair (rotate_interleaved's layout)."""

    def split(freqs_cis):
        return freqs_cis[0].real.float().repeat_interleave(2, -1), freqs_cis[0].imag.float().repeat_interleave(2, -1)

    return rotary_emb_table(src, split)


@dataclass(frozen=True)
class L2QkNorm(QkNorm):
    """Llama4TextL2Norm on q and k after RoPE, in the layers whose attention has it (the RoPE layers)."""

    def rotated(self, norm, attn, q, k):
        import torch

        module = getattr(attn, "qk_norm", None)
        if module is None:
            return q, k

        def l2(x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.eps)

        return l2(q), l2(k)


def temperature_tuning(attn, position_ids):
    """The NoPE layers' query multiplier at each position (transformers counts positions from the cache's
    length, the position ids of an unpadded sequence); None on RoPE layers or without temperature tuning."""
    import torch

    if not attn.attn_temperature_tuning or attn.use_rope:
        return None
    steps = torch.floor((position_ids.float() + 1.0) / float(attn.floor_scale))
    return torch.log(steps + 1.0) * float(attn.attn_scale) + 1.0


def sigmoid_topk(logits, k: int, normalize: bool):
    """TopK of the router logits, each through a sigmoid (Llama4Router); never renormalized."""
    import torch

    top, index = torch.topk(logits, k, dim=-1)
    return torch.sigmoid(top), index


@dataclass(frozen=True)
class Llama4Experts:
    """gate_up_proj [E, H, 2I] (gate in the first half), down_proj [E, I, H]: [in, out] weights multiplied
    from the right; up * act_fn(gate)."""

    reduction_axis: int = -2

    def __call__(self, experts, e: int, x):
        import torch

        gate, up = torch.matmul(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
        return torch.matmul(up * experts.act_fn(gate), experts.down_proj[e])


FAMILY = replace(LLAMA, rotary=rotate_interleaved, rope_table=complex_rotary_table, qk_norm=L2QkNorm(),
                 rope_switch="use_rope", query_scale=temperature_tuning, chunk="attention_chunk_size",
                 max_positions=MAX_POSITIONS, ffn="feed_forward", mlp=GatedMlp(act="activation_fn"),
                 moe=Moe(router="router", scoring=sigmoid_topk, normalize=False, layout=Llama4Experts(),
                         scale_input=True, shared="shared_expert"))
