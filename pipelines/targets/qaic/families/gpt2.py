"""GPT-2: learned positions, LayerNorms, one fused c_attn ([q | k | v]) and Conv1D projections ([in, out]
weights, called as modules), a plain MLP. GPT2_NAMES is where GPT-2-lineage models keep their modules
(GPTBigCode shares them)."""

from __future__ import annotations

from .blocks import PlainMlp, SplitQkv, layer_norm
from .spec import Family, Norms

ARCHITECTURES = ("GPT2LMHeadModel",)
GPT2_NAMES = dict(base="transformer", embed="wte", layers="h", final_norm="ln_f", norm=layer_norm,
                  norms=Norms(pre_attn="ln_1", pre_mlp="ln_2"), attn="attn", o_proj="c_proj")
GPT2_MLP = PlainMlp("c_fc", "c_proj", "act")
FAMILY = Family(**GPT2_NAMES, positions="wpe", qkv=SplitQkv("c_attn"), rotary=None, mlp=GPT2_MLP)
