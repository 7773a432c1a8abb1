"""The retained-state decoder of the AI 100 export: one engine, written with standard ONNX ops only (opset 17),
reading the weights of a transformers causal LM as its family declares them (families.py).

The same module is traced into the ONNX graph (export.py) and run in torch to predict the device's quality
(quality.py). Its forward is three stages, so a driver can run it unit by unit on a streamed model (one layer
resident, every sequence through it): `begin` (embeddings, RoPE rows, masks), `layer_step(i)` (decoder layer i
with its cache update), `end` (final norm, head). Composed, they are `forward`:
- inputs `input_ids`, `position_ids` [batch, seq_len] int64, then `past_key.{i}` / `past_value.{i}`
  [batch, n_kv_heads, ctx_len, head_dim] fp32 per layer; no attention mask;
- with continuous batching (`batch_index=True`) the past inputs are [full_batch_size, ...] and a last input
  `batch_index` [batch, 1] int64 names the cache row of each batch row: its new K/V are scattered into that
  row (ScatterND at (row, head, position)) and its attention reads that row; the retained state is the whole
  [full_batch_size, ...] cache;
- outputs `logits` [batch, 1, vocab] for the last valid position (the largest position id), then
  `past_key.{i}_RetainedState` / `past_value.{i}_RetainedState`: the cache with the new K/V scattered in at
  `position_ids` (ScatterElements);
- the causal mask is built in the graph from `position_ids` (a cache slot j is visible to a token at
  position p when j <= p, and p - j < window in a sliding-window layer); RoPE reads static cos/sin tables by
  position; MoE routing is a static TopK + dense expert sum.
"""

from __future__ import annotations

import functools

from .families import family_for


def build_decoder(model, *, kv_transform=None, batch_index: bool = False, ctx_len: int | None = None):
    """The retained-state decoder (a torch module) of a transformers causal LM of a supported family.

    forward(input_ids, position_ids, *past[, batch_index]) -> (logits, *retained); `all_positions = True`
    returns logits for every position instead of the last valid one (quality prediction). `kv_transform`
    is applied to the new K/V before they are written to the cache (MXINT8 emulation; never exported).
    `ctx_len` picks the RoPE mode of length-dependent scalings (longrope, dynamic) for the positions below
    it: the mode transformers uses for a sequence of that length. transformers switches the mode per
    sequence (Phi-3 longrope: long factors once a sequence passes original_max_position_embeddings); a
    static table cannot, so with ctx_len above that length, sequences shorter than it differ from transformers.
    """
    return _decoder_class()(model, kv_transform=kv_transform, batch_index=batch_index, ctx_len=ctx_len).eval()


@functools.cache
def _decoder_class():
    """The engine's nn.Module class (defined on first use: importing this module does not import torch)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class RetainedStateDecoder(nn.Module):
        all_positions = False  # quality prediction scores every position; the exported graph only the last

        def __init__(self, model, *, kv_transform, batch_index, ctx_len):
            super().__init__()
            cfg = model.config
            self.arch, fam = family_for(cfg)
            self.fam = fam
            base = getattr(model, fam.base)
            self.embed = getattr(base, fam.embed)
            self.pos_embed = getattr(base, fam.positions) if fam.positions else None
            self.layers = getattr(base, fam.layers)
            self.final_norm = getattr(base, fam.final_norm)
            self.lm_head = model.lm_head
            self.kv_transform = kv_transform
            self.batch_index = batch_index
            self.n_heads = int(cfg.num_attention_heads)
            self.n_kv = int(fam.kv_heads or getattr(cfg, "num_key_value_heads", None) or self.n_heads)
            self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)
            self.max_positions = int(cfg.max_position_embeddings)
            self.vocab = int(cfg.vocab_size)
            n = len(self.layers)
            self.scales = [float(getattr(getattr(layer, fam.attn), fam.scaling)) if fam.scaling else self.head_dim**-0.5
                           for layer in self.layers]
            window = getattr(cfg, "sliding_window", None) if fam.sliding else None
            types = getattr(cfg, "layer_types", None)
            self.windows = [window if window and (types is None or types[i] == "sliding_attention") else None
                            for i in range(n)]

            def conf(name):
                return None if name is None else getattr(cfg, name, None)

            self.embed_multiplier = conf(fam.embed_multiplier)
            self.residual_multiplier = conf(fam.residual_multiplier)
            self.logits_divisor = conf(fam.logits_divisor)
            self.attn_softcap = conf(fam.attn_softcap)
            self.final_softcap = conf(fam.final_softcap)
            if fam.moe is not None:
                norm = fam.moe.normalize
                self.moe_normalize = bool(getattr(cfg, norm) if isinstance(norm, str) else norm)
                self.moe_top_k = int(cfg.num_experts_per_tok)
            if fam.rotary is not None:
                cos, sin = self._rope_tables(model, base, ctx_len)
                self.register_buffer("cos_table", cos, persistent=False)
                self.register_buffer("sin_table", sin, persistent=False)
                self.rot_dim = int(cos.shape[-1])  # < head_dim: partial rotary, the rest passes through

        # -- construction helpers ------------------------------------------------------------------

        def _rope_tables(self, model, base, ctx_len):
            """Static [max_positions, rotary_dim] cos/sin tables, laid out for the family's rotary style."""
            fam, max_pos = self.fam, self.max_positions
            with torch.no_grad():
                if fam.rope_table == "gptj":  # [max_pos, rot] = [sin | cos] per frequency, pairs interleaved
                    sincos = getattr(self.layers[0], fam.attn).embed_positions[:max_pos].float()
                    sin, cos = sincos.chunk(2, dim=-1)
                    return cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
                rot = base.rotary_emb

                def table(length):
                    probe = torch.zeros(1, length, self.head_dim)
                    cos, sin = rot(probe, torch.arange(length).unsqueeze(0))
                    cos, sin = cos[0].float(), sin[0].float()
                    if fam.rope_table == "halves":  # GPT-OSS returns one frequency per pair of halves
                        cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
                    return cos, sin

                cos, sin = table(max_pos)
                if ctx_len and ctx_len < max_pos:  # length-dependent RoPE: the mode of a ctx_len sequence below it
                    c, s = table(ctx_len)
                    cos, sin = torch.cat((c, cos[ctx_len:])), torch.cat((s, sin[ctx_len:]))
                return cos, sin

        # -- building blocks ---------------------------------------------------------------------

        def norm(self, module, x):
            if self.fam.norm == "layer":
                return F.layer_norm(x, module.normalized_shape, module.weight, module.bias, module.eps)
            eps = getattr(module, "variance_epsilon", None)
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + (module.eps if eps is None else eps))
            return y * (1.0 + module.weight) if self.fam.norm == "rms_1p" else y * module.weight

        def rotate(self, x, cos, sin):
            rot = self.rot_dim
            x_rot, x_pass = (x, None) if rot == self.head_dim else (x[..., :rot], x[..., rot:])
            if self.fam.rotary == "interleaved":
                pairs = torch.stack((-x_rot[..., 1::2], x_rot[..., 0::2]), dim=-1)
                turned = pairs.flatten(-2)
            else:
                half = rot // 2
                turned = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
            out = x_rot * cos + turned * sin
            return out if x_pass is None else torch.cat((out, x_pass), dim=-1)

        def qkv(self, attn, x):
            """q [B, S, H, D], k and v [B, S, KV, D] from the family's projections."""
            fam, bsz, seq = self.fam, x.shape[0], x.shape[1]
            nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
            if fam.qkv_layout in ("separate", "split"):
                if fam.qkv_layout == "separate":
                    q, k, v = (getattr(attn, name)(x) for name in fam.qkv)
                else:
                    q, k, v = getattr(attn, fam.qkv)(x).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
                if fam.qk_norm == "full":
                    q, k = self.norm(attn.q_norm, q), self.norm(attn.k_norm, k)
                q, k, v = q.view(bsz, seq, nh, hd), k.view(bsz, seq, nkv, hd), v.view(bsz, seq, nkv, hd)
            elif fam.qkv_layout == "per_head":
                fused = getattr(attn, fam.qkv)(x).view(bsz, seq, nh, 3, hd)
                q, k, v = fused[..., 0, :], fused[..., 1, :], fused[..., 2, :]
            elif fam.qkv_layout == "grouped":
                r = nh // nkv
                fused = getattr(attn, fam.qkv)(x).view(bsz, seq, nkv, r + 2, hd)
                q, k, v = fused[:, :, :, :r].reshape(bsz, seq, nh, hd), fused[:, :, :, r], fused[:, :, :, r + 1]
            else:
                raise ValueError(f"unknown qkv_layout {fam.qkv_layout!r}")
            if fam.qk_norm == "head":
                q, k = self.norm(attn.q_norm, q), self.norm(attn.k_norm, k)
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
            if rope is not None:
                q, k = self.rotate(q, *rope), self.rotate(k, *rope)
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
            if self.fam.sinks:  # one more softmax column per head, dropped after normalization
                sink = attn.sinks.view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
                probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
            else:
                probs = torch.softmax(scores, dim=-1)
            out = torch.matmul(probs, v_cache).transpose(1, 2).reshape(bsz, seq, self.n_heads * self.head_dim)
            return getattr(attn, self.fam.o_proj)(out), k_full, v_full

        def mlp(self, mlp, x):
            fam = self.fam
            if fam.moe is not None and hasattr(mlp, fam.moe.experts):
                return self.moe(mlp, x)
            spec = fam.mlp
            act = getattr(mlp, spec.act)
            proj = [getattr(mlp, name) for name in spec.proj]
            if spec.kind == "gated":
                return proj[2](act(proj[0](x)) * proj[1](x))
            if spec.kind == "gated_fused":
                gate, up = proj[0](x).chunk(2, dim=-1)
                return proj[1](up * act(gate))
            return proj[1](act(proj[0](x)))  # plain

        def moe(self, mlp, x):
            """Static MoE: TopK routing as transformers computes it, the top-k weights scattered into a dense
            [tokens, experts] matrix, every expert on every token, summed with those weights."""
            spec = self.fam.moe
            tokens = x.reshape(-1, x.shape[-1])
            router = getattr(mlp, spec.router)
            logits = F.linear(tokens, router.weight, getattr(router, "bias", None))
            if spec.scoring == "softmax_topk":
                top, index = torch.topk(torch.softmax(logits, dim=-1), self.moe_top_k, dim=-1)
                if self.moe_normalize:
                    top = top / top.sum(dim=-1, keepdim=True)
            else:  # topk_softmax
                top, index = torch.topk(logits, self.moe_top_k, dim=-1)
                top = torch.softmax(top, dim=-1)
            weights = torch.zeros_like(logits).scatter(1, index, top)  # [tokens, experts]
            experts = getattr(mlp, spec.experts)
            out = None
            for e in range(experts.num_experts):
                y = self.expert(experts, e, tokens) * weights[:, e:e + 1]
                out = y if out is None else out + y
            return out.view(x.shape)

        def expert(self, experts, e, x):
            if self.fam.moe.layout == "stacked":
                gate, up = F.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
                return F.linear(experts.act_fn(gate) * up, experts.down_proj[e])
            # gpt_oss: [in, out] weights, gate/up interleaved, clamped SwiGLU with (up + 1)
            gate_up = torch.matmul(x, experts.gate_up_proj[e]) + experts.gate_up_proj_bias[e]
            gate = gate_up[..., 0::2].clamp(max=experts.limit)
            up = gate_up[..., 1::2].clamp(min=-experts.limit, max=experts.limit)
            glu = gate * torch.sigmoid(gate * experts.alpha)
            return torch.matmul((up + 1) * glu, experts.down_proj[e]) + experts.down_proj_bias[e]

        # -- the whole decoder ---------------------------------------------------------------------

        def begin(self, input_ids, position_ids, ctx: int):
            """Embeddings (and learned positions), the RoPE rows of the positions, and the masks: slot j is
            visible to the token at position p iff j <= p (and p - j < window): [B, 1, S, ctx] per window."""
            bsz, seq = input_ids.shape
            h = self.embed(input_ids)
            if self.embed_multiplier is not None:
                h = h * self.embed_multiplier
            if self.pos_embed is not None:
                h = h + self.pos_embed(position_ids)
            rope = None
            if self.fam.rotary is not None:
                rope = (self.cos_table[position_ids].unsqueeze(1), self.sin_table[position_ids].unsqueeze(1))
            slots = torch.arange(ctx, dtype=position_ids.dtype).view(1, 1, 1, ctx)
            pos = position_ids.view(bsz, 1, seq, 1)
            causal = slots <= pos
            masks = {w: causal if w is None else causal & (slots > pos - w) for w in set(self.windows)}
            return h, rope, masks

        def layer_step(self, i, h, rope, masks, past_k, past_v, position_ids, rows):
            """Decoder layer i: (the new hidden states, its key and value caches with the new K/V written)."""
            fam, layer, rm = self.fam, self.layers[i], self.residual_multiplier
            norms = fam.norms
            x = self.norm(getattr(layer, norms.pre_attn), h) if norms.pre_attn else h
            a, k_full, v_full = self.attention(i, getattr(layer, fam.attn), x, rope, masks[self.windows[i]],
                                               past_k, past_v, position_ids, rows)
            if norms.post_attn:
                a = self.norm(getattr(layer, norms.post_attn), a)
            if fam.parallel:
                m_in = self.norm(getattr(layer, norms.pre_mlp), h) if norms.pre_mlp else x
            else:
                h = h + (a * rm if rm is not None else a)
                m_in = self.norm(getattr(layer, norms.pre_mlp), h) if norms.pre_mlp else h
            m = self.mlp(layer.mlp, m_in)
            if norms.post_mlp:
                m = self.norm(getattr(layer, norms.post_mlp), m)
            if fam.parallel:
                h = h + (a + m if rm is None else (a + m) * rm)
            else:
                h = h + (m * rm if rm is not None else m)
            return h, k_full, v_full

        def end(self, h, position_ids):
            """Final norm and head: logits of the last valid position (every position with all_positions)."""
            h = self.norm(self.final_norm, h)
            if not self.all_positions:
                # the last valid position (largest position id) of each row: a one-hot [B, 1, S] MatMul keeps
                # logits' shape [B, 1, vocab] static for the compiler
                seq = position_ids.shape[1]
                last = position_ids.argmax(dim=1, keepdim=True)  # [B, 1]
                pick = (torch.arange(seq, dtype=last.dtype).view(1, seq) == last).to(h.dtype).unsqueeze(1)
                h = torch.matmul(pick, h)
            logits = self.lm_head(h)
            if self.logits_divisor is not None:
                logits = logits / self.logits_divisor
            if self.final_softcap:
                logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
            return logits

        def forward(self, input_ids, position_ids, *rest):
            past, rows = (rest[:-1], rest[-1].view(-1)) if self.batch_index else (rest, None)
            h, rope, masks = self.begin(input_ids, position_ids, past[0].shape[2])
            retained = []
            for i in range(len(self.layers)):
                h, k_full, v_full = self.layer_step(i, h, rope, masks, past[2 * i], past[2 * i + 1], position_ids, rows)
                retained += [k_full, v_full]
            return (self.end(h, position_ids), *retained)

    return RetainedStateDecoder
