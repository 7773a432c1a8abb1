"""GPT-J: attention and MLP in parallel off one LayerNorm, separate q/k/v projections, rotary on adjacent
pairs of the first rotary_dim dims from the attention's precomputed `embed_positions`, head_dim ** -0.5."""

from __future__ import annotations

from .blocks import PlainMlp, gptj_positions_table, layer_norm, parallel_residual, rotate_interleaved
from .spec import Family, Norms

ARCHITECTURES = ("GPTJForCausalLM",)
FAMILY = Family(base="transformer", embed="wte", layers="h", final_norm="ln_f", norm=layer_norm,
                norms=Norms(pre_attn="ln_1", pre_mlp=None), residual=parallel_residual, attn="attn", o_proj="out_proj",
                rotary=rotate_interleaved, rope_table=gptj_positions_table, scaling=None,
                mlp=PlainMlp("fc_in", "fc_out", "act"))
