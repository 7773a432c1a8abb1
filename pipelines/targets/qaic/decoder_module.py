"""The retained-state decoder's torch module (the engine decoder.py builds and documents). It lives apart from
decoder.py because it imports torch at the top: decoder.py imports it on first use, so importing decoder.py
(and declaring a family) does not import torch."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from .families import family_for
from .families.blocks import Heads, RopeSource
from .families.spans import attention_spans


class _Inputs(NamedTuple):
    """forward's positional inputs by name (the module's doc in decoder.py gives their order per graph)."""

    position_ids: object  # [B, S]: the text positions
    rope_positions: object  # M-RoPE's t/h/w rows [3, B, S], or None
    past: list  # past_key.{i}, past_value.{i} per layer
    rows: object  # the cache row of each batch row (continuous batching), or None
    keep: object  # the target LM's num_logits_to_keep, or None
    vision_embeds: object = None
    features: object = None  # DeepStack's levels, or None
    image_idx: object = None
    cross_mask: object = None  # a cross-attention VLM's cross_attention_mask, or None


def _config_value(cfg, name):
    """The config's attribute `name` (None when the family names none, or the config lacks it)."""
    return None if name is None else getattr(cfg, name, None)


class RetainedStateDecoder(nn.Module):
    """The retained-state decoder of one transformers causal LM (built by decoder.py's `build_decoder`)."""

    all_positions = False  # quality prediction scores every position; the exported graph only the last
    logits_to_keep = False  # the target LM of speculative decoding: a last input num_logits_to_keep [N, 1]
    image_token = None  # a VLM's language graph: the placeholder token id vision_embeds rows replace
    deepstack = 0  # DeepStack levels of a VLM whose vision tower also gives them (layout.DEEPSTACK)
    cross_grid = None  # a cross-attention VLM's language graph: (tiles per image, image rows per tile)

    def __init__(self, model, *, kv_transform, batch_index, ctx_len):
        super().__init__()
        cfg = model.config
        self.arch, fam = family_for(cfg)
        self.fam = fam
        base = getattr(model, fam.base)
        self._take_modules(model, base)
        self.kv_transform = kv_transform
        self.batch_index = batch_index
        self._read_shapes(cfg)
        self._read_layer_kinds(cfg)
        self._read_scalars(cfg)
        if fam.rotary is not None:
            self._register_rope_tables(cfg, base, ctx_len)
        # the position input's leading rows (M-RoPE: [rows, batch, seq]); None: [batch, seq]
        self.position_rows = fam.mrope.rows if fam.mrope is not None else None

    def _take_modules(self, model, base):
        """The embeddings, layers, final norm and head of the model, as the family names them."""
        fam = self.fam
        self.embed = getattr(base, fam.embed)
        self.pos_embed = getattr(base, fam.positions) if fam.positions else None
        self.layers = getattr(base, fam.layers)
        self.final_norm = getattr(base, fam.final_norm)
        self.lm_head = model.lm_head

    def _read_shapes(self, cfg):
        """Head counts and sizes, the position limit and the vocabulary from the config."""
        fam = self.fam
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(fam.kv_heads or getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)
        self.heads = Heads(self.n_heads, self.n_kv, self.head_dim)
        self.max_positions = min(int(cfg.max_position_embeddings), fam.max_positions or cfg.max_position_embeddings)
        self.vocab = int(cfg.vocab_size)

    def _read_layer_kinds(self, cfg):
        """Per layer: cross- or self-attention, its score scale, its attention span, and whether it rotates."""
        fam = self.fam
        n = len(self.layers)
        # layers the family computes with its cross-attention block (reading the image's K/V), not self-attention
        self.cross_layers = frozenset(getattr(cfg, fam.cross_layers, None) or ()) if fam.cross_layers else frozenset()
        self.self_layers = [i for i in range(n) if i not in self.cross_layers]
        self.scales = [None if i in self.cross_layers else
                       float(getattr(getattr(layer, fam.attn), fam.scaling)) if fam.scaling else self.head_dim**-0.5
                       for i, layer in enumerate(self.layers)]
        self.spans = attention_spans(cfg, fam, n)
        self.uses_rope = [fam.rotary is not None and i not in self.cross_layers
                          and (not fam.rope_switch or bool(getattr(getattr(layer, fam.attn), fam.rope_switch)))
                          for i, layer in enumerate(self.layers)]

    def _read_scalars(self, cfg):
        """The family's multipliers, divisors and softcaps, and its MoE routing settings."""
        fam = self.fam
        self.embed_multiplier = _config_value(cfg, fam.embed_multiplier)
        self.residual_multiplier = _config_value(cfg, fam.residual_multiplier)
        self.logits_divisor = _config_value(cfg, fam.logits_divisor)
        self.attn_softcap = _config_value(cfg, fam.attn_softcap)
        self.final_softcap = _config_value(cfg, fam.final_softcap)
        if fam.moe is not None:
            norm = fam.moe.normalize
            self.moe_normalize = bool(getattr(cfg, norm) if isinstance(norm, str) else norm)
            self.moe_top_k = int(cfg.num_experts_per_tok)

    def _register_rope_tables(self, cfg, base, ctx_len):
        """The static cos/sin tables by position (and M-RoPE's row selection) as non-persistent buffers."""
        fam = self.fam
        source = RopeSource(base, getattr(self.layers[self.self_layers[0]], fam.attn), self.head_dim,
                            self.max_positions, ctx_len)
        with torch.no_grad():
            cos, sin = fam.rope_table(source)
        self.register_buffer("cos_table", cos, persistent=False)
        self.register_buffer("sin_table", sin, persistent=False)
        self.rot_dim = int(cos.shape[-1])  # < head_dim: partial rotary, the rest passes through
        if fam.mrope is not None:  # which of the t/h/w position rows each rotary dim reads
            self.register_buffer("mrope_select", fam.mrope.select(cfg, self.rot_dim), persistent=False)

    # -- building blocks ---------------------------------------------------------------------

    def norm(self, module, x):
        return self.fam.norm(module, x)

    def rotate(self, x, cos, sin):
        rot = self.rot_dim
        x_rot, x_pass = (x, None) if rot == self.head_dim else (x[..., :rot], x[..., rot:])
        out = x_rot * cos + self.fam.rotary(x_rot, rot) * sin
        return out if x_pass is None else torch.cat((out, x_pass), dim=-1)

    def qkv(self, attn, x):
        """q [B, S, H, D], k and v [B, S, KV, D] from the family's projections."""
        fam = self.fam
        q, k, v = fam.qkv(attn, x, self.heads, fam.qk_norm, self.norm)
        q, k = fam.qk_norm.heads(self.norm, attn, q, k)
        return q, k, v

    def write_cache(self, past, new, position_ids, rows):
        """The cache with `new` [B, KV, S, D] written at position_ids (and at cache rows `rows`), and the
        [B, KV, ctx, D] cache this batch attends to."""
        bsz, nkv, seq, hd = new.shape
        if rows is None:
            index = position_ids.view(bsz, 1, seq, 1).expand(bsz, nkv, seq, hd)
            full = past.scatter(2, index, new)  # ScatterElements at position_ids
            return full, full
        heads = torch.arange(nkv, dtype=rows.dtype).view(1, nkv, 1)
        full = past.index_put((rows.view(bsz, 1, 1), heads, position_ids.view(bsz, 1, seq)), new)  # ScatterND
        return full, full[rows]

    def attention(self, i, attn, x, rope, mask, past_k, past_v, position_ids, rows):
        bsz, seq = x.shape[0], x.shape[1]
        q, k, v = self.qkv(attn, x)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.uses_rope[i]:
            q, k = self.rotate(q, *rope), self.rotate(k, *rope)
        q, k = self.fam.qk_norm.rotated(self.norm, attn, q, k)
        scale = self.fam.query_scale(attn, position_ids) if self.fam.query_scale else None
        if scale is not None:  # [B, S]: one multiplier per query position
            q = q * scale.unsqueeze(1).unsqueeze(-1)
        if self.kv_transform is not None:  # e.g. MXINT8 emulation of the device's KV cache (never exported)
            k, v = self.kv_transform(k), self.kv_transform(v)
        k_full, k_cache = self.write_cache(past_k, k, position_ids, rows)
        v_full, v_cache = self.write_cache(past_v, v, position_ids, rows)
        if self.n_kv != self.n_heads:
            k_cache = k_cache.repeat_interleave(self.n_heads // self.n_kv, dim=1)
            v_cache = v_cache.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        scores = torch.matmul(q, k_cache.transpose(2, 3)) * self.scales[i]
        if self.attn_softcap:
            scores = torch.tanh(scores / self.attn_softcap) * self.attn_softcap
        scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
        probs = self.fam.probs(attn, scores)
        out = torch.matmul(probs, v_cache).transpose(1, 2).reshape(bsz, seq, self.n_heads * self.head_dim)
        return getattr(attn, self.fam.o_proj)(out), k_full, v_full

    def mlp(self, mlp, x):
        fam = self.fam
        if fam.moe is not None and hasattr(mlp, fam.moe.experts):
            return self.moe(mlp, x)
        return fam.mlp(mlp, x)

    def moe(self, mlp, x):
        """Static MoE: TopK routing as transformers computes it, the top-k weights scattered into a dense
        [tokens, experts] matrix, every expert on every token, summed with those weights (scaling each
        expert's input instead where the family says so: zero for an expert a token did not pick, which a
        bias-free expert maps to zero), plus the shared expert where there is one."""
        spec = self.fam.moe
        tokens = x.reshape(-1, x.shape[-1])
        router = getattr(mlp, spec.router)
        logits = F.linear(tokens, router.weight, getattr(router, "bias", None))
        top, index = spec.scoring(logits, self.moe_top_k, self.moe_normalize)
        weights = torch.zeros_like(logits).scatter(1, index, top)  # [tokens, experts]
        experts = getattr(mlp, spec.experts)
        out = self.fam.mlp(getattr(mlp, spec.shared), tokens) if spec.shared else None
        for e in range(experts.num_experts):
            w = weights[:, e:e + 1]
            y = spec.layout(experts, e, tokens * w) if spec.scale_input else spec.layout(experts, e, tokens) * w
            out = y if out is None else out + y
        return out.view(x.shape)

    # -- the whole decoder ---------------------------------------------------------------------

    def begin(self, input_ids, position_ids, ctx: int, image=None, rope_positions=None):
        """Embeddings (and learned positions), the RoPE rows of the positions, and the masks: slot j is
        visible to the token at position p iff j <= p (and within the layer's span): [B, 1, S, ctx] per span.
        `rope_positions` [3, B, S]: the t/h/w rows of a multimodal RoPE family (fam.mrope), which then
        rotates by them while the text positions still place, mask and pick."""
        bsz, seq = input_ids.shape
        h = self.embed(input_ids)
        if image is not None:  # before the multipliers: transformers scales the merged embeddings as a whole
            h = image(h)
        if self.embed_multiplier is not None:
            h = h * self.embed_multiplier
        if self.pos_embed is not None:
            h = h + self.pos_embed(position_ids)
        rope = None
        if self.fam.rotary is not None and rope_positions is not None:
            rope = self.fam.mrope(self.cos_table, self.sin_table, rope_positions, self.mrope_select)
        elif self.fam.rotary is not None:
            rope = (self.cos_table[position_ids].unsqueeze(1), self.sin_table[position_ids].unsqueeze(1))
        slots = torch.arange(ctx, dtype=position_ids.dtype).view(1, 1, 1, ctx)
        pos = position_ids.view(bsz, 1, seq, 1)
        causal = slots <= pos
        masks = {span: causal if span is None else causal & span.visible(slots, pos) for span in set(self.spans)}
        return h, rope, masks

    def layer_step(self, i, h, rope, masks, past_k, past_v, position_ids, rows):
        """Decoder layer i: (the new hidden states, its key and value caches with the new K/V written)."""
        fam, layer = self.fam, self.layers[i]
        if i in self.cross_layers:
            return fam.cross_layer(self, layer, h, masks["cross"], past_k, past_v, rows)

        def slot(name, x):
            return x if name is None else self.norm(getattr(layer, name), x)

        def attend(x):
            return self.attention(i, getattr(layer, fam.attn), x, rope, masks[self.spans[i]], past_k, past_v,
                                  position_ids, rows)

        ffn = getattr(layer, fam.ffn)
        return fam.residual(h, slot, attend, lambda x: self.mlp(ffn, x), fam.norms, self.residual_multiplier)

    def end(self, h, position_ids, keep=None):
        """Final norm and head: logits of the last valid position (every position with all_positions; the
        last `keep.shape[0]` positions up to the last valid one with the target LM's num_logits_to_keep)."""
        h = self.norm(self.final_norm, h)
        if not self.all_positions:
            # the last valid position (largest position id) of each row: a one-hot [B, 1, S] MatMul keeps
            # logits' shape [B, 1, vocab] static for the compiler
            seq = position_ids.shape[1]
            last = position_ids.argmax(dim=1, keepdim=True)  # [B, 1]
            slots = torch.arange(seq, dtype=last.dtype)
            if keep is None:
                pick = (slots.view(1, seq) == last).to(h.dtype).unsqueeze(1)
            else:  # N rows ending at the last valid one (starting at 0 when it is closer than N): [B, N, S]
                n = keep.shape[0]
                rows = (last + 1 - n).clamp(min=0) + torch.arange(n, dtype=last.dtype).view(1, n)  # [B, N]
                pick = (slots.view(1, 1, seq) == rows.unsqueeze(-1)).to(h.dtype)
            h = torch.matmul(pick, h)
        logits = self.lm_head(h)
        if self.logits_divisor is not None:
            logits = logits / self.logits_divisor
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def merge_image(self, h, input_ids, vision_embeds, image_idx):
        """The image rows over the placeholders (QEfficient's merge): the k-th placeholder of the chunk takes
        row image_idx + k of the flattened vision_embeds; `image_idx_output` is the next chunk's image_idx, so
        an image may span prefill chunks. A chunk without placeholders (every decode step) keeps its text."""
        mask = input_ids == self.image_token  # [B, S]
        count = torch.cumsum(mask.to(torch.int64), dim=1)
        rows = count - 1 + image_idx  # [B, S]; -1 (no placeholder yet) gathers a row the mask then drops
        flat = vision_embeds.reshape(-1, vision_embeds.shape[-1])
        merged = torch.where(mask.unsqueeze(-1), flat[rows], h)
        return merged, image_idx + count[:, -1:].sum(dim=0, keepdim=True)

    def deepstack_rows(self, input_ids, features, image_idx):
        """[levels, B, S, hidden]: each placeholder's row of every DeepStack level (the rows merge_image
        picks), zero elsewhere; level i is added to the hidden states after decoder layer i."""
        mask = input_ids == self.image_token
        rows = torch.cumsum(mask.to(torch.int64), dim=1) - 1 + image_idx
        flat = features.reshape(features.shape[0], -1, features.shape[-1])  # [levels, images * rows, hidden]
        return torch.where(mask.unsqueeze(-1), flat[:, rows], torch.zeros((), dtype=flat.dtype))

    def image_hook(self, input_ids, vision_embeds, features, image_idx):
        """(the embeddings hook `begin` takes, the retained image outputs it fills, the per-layer additions it
        fills): the image rows merged over the placeholders; `features`, DeepStack's levels or None."""
        image_out, added = [], []

        def image(text):
            merged, next_idx = self.merge_image(text, input_ids, vision_embeds, image_idx)
            # vision_embeds_RetainedState (and its DeepStack twin): the device's state after prefill
            image_out[:] = [vision_embeds] + ([features] if features is not None else []) + [next_idx]
            if features is not None:
                added[:] = self.deepstack_rows(input_ids, features, image_idx).unbind(0)
            return merged
        return image, image_out, added

    def split_positions(self, position_ids):
        """(text positions [B, S], M-RoPE's t/h/w rows [3, B, S] or None): row 0 of a multimodal RoPE input."""
        if self.position_rows is not None:
            return position_ids[0], position_ids[1:]
        return position_ids, None

    def forward(self, input_ids, *rest):
        """(logits, *image outputs, *retained caches): `begin`, every `layer_step`, `end` (decoder.py's contract)."""
        inputs = self._unpack(rest)
        image, image_out, added = None, [], []
        if self.image_token is not None:
            image, image_out, added = self.image_hook(input_ids, inputs.vision_embeds, inputs.features,
                                                      inputs.image_idx)
        h, rope, masks = self.begin(input_ids, inputs.position_ids, inputs.past[2 * self.self_layers[0]].shape[2],
                                    image, inputs.rope_positions)
        if self.cross_layers:
            masks["cross"] = self.fam.cross_layer.masks(inputs.cross_mask, self.cross_grid[1])
        h, retained = self._run_layers(h, rope, masks, inputs, added)
        return (self.end(h, inputs.position_ids, inputs.keep), *image_out, *retained)

    def _unpack(self, rest) -> _Inputs:
        """forward's inputs after input_ids, by name: which there are depends on the graph (VLM, cross-attention,
        continuous batching, target LM)."""
        vision_embeds = features = image_idx = cross_mask = None
        if self.image_token is not None:
            vision_embeds, *rest = rest
            features, rest = (rest[0], rest[1:]) if self.deepstack else (None, rest)
            position_ids, image_idx, *rest = rest
        elif self.cross_grid is not None:
            cross_mask, position_ids, *rest = rest
        else:
            position_ids, *rest = rest
        position_ids, rope_positions = self.split_positions(position_ids)
        keep = None
        if self.logits_to_keep:
            rest, keep = rest[:-1], rest[-1]
        past, rows = (rest[:-1], rest[-1].view(-1)) if self.batch_index else (rest, None)
        return _Inputs(position_ids, rope_positions, past, rows, keep, vision_embeds, features, image_idx, cross_mask)

    def _run_layers(self, h, rope, masks, inputs: _Inputs, added):
        """Every decoder layer in turn, DeepStack's level i added after layer i: (hidden states, retained caches)."""
        retained = []
        for i in range(len(self.layers)):
            h, k_full, v_full = self.layer_step(i, h, rope, masks, inputs.past[2 * i], inputs.past[2 * i + 1],
                                                inputs.position_ids, inputs.rows)
            if i < len(added):
                h = h + added[i]
            retained += [k_full, v_full]
        return h, retained
