"""Mllama's text model (Llama 3.2 Vision, MllamaTextModel): Llama's self-attention layers with gated
cross-attention layers interleaved at `config.cross_attention_layers`.

Only reached through the vision-language export (vision/mllama.py): a text-only Mllama checkpoint is not a
supported causal LM here, so the family is declared among the language-only families (families/__init__.py).

A cross-attention layer (transformers' MllamaCrossAttentionDecoderLayer) reads the image's K/V, which the vision
graph computed (k_proj, v_proj, k_norm of the projected vision states) and the language graph takes as retained
state `past_key.{i}` / `past_value.{i}` [batch, n_kv, image_rows, head_dim], returned unchanged:
    h = h + tanh(attn_gate) * o_proj(attend(q_norm(q_proj(input_layernorm(h))), K, V, mask))
    h = h + tanh(mlp_gate) * row_visible * mlp(post_attention_layernorm(h))
The mask comes from `cross_attention_mask` [batch, seq, images, tiles] (1: the token sees that tile), each tile
widened to its image rows; a token that sees no tile at all (text before the image) attends to every row
unmasked and its MLP branch is zeroed, exactly as transformers' _prepare_cross_attention_mask makes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .spec import Family


@dataclass(frozen=True)
class GatedCrossAttentionLayer:
    """The block the engine calls for a layer listed in the config's `cross_attention_layers`."""

    attn: str = "cross_attn"
    attn_gate: str = "cross_attn_attn_gate"
    mlp_gate: str = "cross_attn_mlp_gate"

    def masks(self, cross_attention_mask, rows_per_tile: int):
        """(visible [B, 1, S, rows], row_sees_image [B, 1, S, 1]) from the int mask [B, S, images, tiles]."""
        import torch

        bsz, seq = cross_attention_mask.shape[0], cross_attention_mask.shape[1]
        tiles = cross_attention_mask != 0
        visible = tiles.unsqueeze(-1).expand(*tiles.shape, rows_per_tile).reshape(bsz, 1, seq, -1)
        sees = visible.any(dim=-1, keepdim=True)
        return visible | ~sees, sees.to(torch.float32)  # a blind row attends unmasked (transformers' bias 0)

    def __call__(self, engine, layer, h, masks, past_k, past_v, rows):
        import torch

        allowed, sees = masks
        attn = getattr(layer, self.attn)
        bsz, seq = h.shape[0], h.shape[1]
        x = engine.norm(layer.input_layernorm, h)
        q = attn.q_proj(x).view(bsz, seq, engine.n_heads, engine.head_dim).transpose(1, 2)
        q = engine.norm(attn.q_norm, q)
        k, v = (past_k, past_v) if rows is None else (past_k[rows], past_v[rows])
        if engine.n_kv != engine.n_heads:
            k = k.repeat_interleave(engine.n_heads // engine.n_kv, dim=1)
            v = v.repeat_interleave(engine.n_heads // engine.n_kv, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * float(attn.scaling)
        scores = scores.masked_fill(~allowed, torch.finfo(torch.float32).min)
        out = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2).reshape(bsz, seq, -1)
        h = h + torch.tanh(getattr(layer, self.attn_gate)) * attn.o_proj(out)
        m = engine.mlp(layer.mlp, engine.norm(layer.post_attention_layernorm, h)) * sees[:, 0]
        h = h + torch.tanh(getattr(layer, self.mlp_gate)) * m
        return h, past_k, past_v  # the image's K/V stay as the vision graph wrote them


ARCHITECTURES = ("MllamaForCausalLM",)
FAMILY = Family(cross_layers="cross_attention_layers", cross_layer=GatedCrossAttentionLayer())
