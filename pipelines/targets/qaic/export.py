"""PyTorch -> ONNX for Cloud AI 100, per the AI 100 compile contract (reference/ai100-qpc.md).

The graph is ours, not transformers' forward: a decoder written with standard ONNX ops only, reading
the weights of the transformers model, so that it runs in onnxruntime (parity is checked there) and
the compiler sees the shape it expects:
- inputs `input_ids`, `position_ids` [batch, seq_len] int64, then `past_key.{i}` / `past_value.{i}`
  [batch, n_kv_heads, ctx_len, head_dim] fp32 per layer; no attention mask;
- outputs `logits` [batch, 1, vocab] for the last valid position, then `past_key.{i}_RetainedState` /
  `past_value.{i}_RetainedState`: the cache with the new K/V scattered in at `position_ids`;
- the causal mask is built in the graph from `position_ids` (a cache slot j is visible to a token at
  position p when j <= p); RoPE reads static cos/sin tables by position; weights stay initializers.
Llama family first (Llama, Mistral, Qwen2: the same decoder layout, Qwen2 with q/k/v biases).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

OPSET = 17
FAMILIES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}


@dataclass
class ExportReport:
    path: str
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int
    external_data: bool


def _decoder(model, kv_transform=None):
    """A torch module computing the retained-state decoder from a transformers Llama-family model."""
    import torch
    from torch import nn

    cfg = model.config
    base = model.model
    n_heads = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    max_pos = int(cfg.max_position_embeddings)

    class RetainedStateDecoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = base.embed_tokens
            self.layers = base.layers
            self.norm = base.norm
            self.lm_head = model.lm_head
            # Static RoPE tables [max_pos, head_dim] from the model's own rotary embedding (scaling included).
            with torch.no_grad():
                pos = torch.arange(max_pos).unsqueeze(0)
                probe = torch.zeros(1, max_pos, head_dim)
                cos, sin = base.rotary_emb(probe, pos)
            self.register_buffer("cos_table", cos[0].float(), persistent=False)
            self.register_buffer("sin_table", sin[0].float(), persistent=False)

        @staticmethod
        def rms(x, norm):
            var = x.pow(2).mean(-1, keepdim=True)
            return x * torch.rsqrt(var + norm.variance_epsilon) * norm.weight

        @staticmethod
        def rotate(x, cos, sin):
            half = x.shape[-1] // 2
            rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
            return x * cos + rotated * sin

        all_positions = False  # quality prediction scores every position; the exported graph only the last

        def forward(self, input_ids, position_ids, *past):
            bsz, seq = input_ids.shape
            ctx = past[0].shape[2]
            h = self.embed(input_ids)
            cos = self.cos_table[position_ids].unsqueeze(1)  # [B, 1, S, D]
            sin = self.sin_table[position_ids].unsqueeze(1)
            # slot j visible to the token at position p iff j <= p: [B, 1, S, ctx]
            slots = torch.arange(ctx, dtype=position_ids.dtype).view(1, 1, 1, ctx)
            visible = slots <= position_ids.unsqueeze(1).unsqueeze(-1)
            index = position_ids.view(bsz, 1, seq, 1).expand(bsz, n_kv, seq, head_dim)
            retained = []
            for i, layer in enumerate(self.layers):
                attn = layer.self_attn
                x = self.rms(h, layer.input_layernorm)
                q = attn.q_proj(x).view(bsz, seq, n_heads, head_dim).transpose(1, 2)
                k = attn.k_proj(x).view(bsz, seq, n_kv, head_dim).transpose(1, 2)
                v = attn.v_proj(x).view(bsz, seq, n_kv, head_dim).transpose(1, 2)
                q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
                if kv_transform is not None:  # e.g. MXINT8 emulation of the device's KV cache (never exported)
                    k, v = kv_transform(k), kv_transform(v)
                k_cache = past[2 * i].scatter(2, index, k)  # ScatterElements at position_ids
                v_cache = past[2 * i + 1].scatter(2, index, v)
                retained += [k_cache, v_cache]
                if n_kv != n_heads:
                    k_cache = k_cache.repeat_interleave(n_heads // n_kv, dim=1)
                    v_cache = v_cache.repeat_interleave(n_heads // n_kv, dim=1)
                scores = torch.matmul(q, k_cache.transpose(2, 3)) * attn.scaling
                scores = scores.masked_fill(~visible, torch.finfo(torch.float32).min)
                out = torch.matmul(torch.softmax(scores, dim=-1), v_cache)
                h = h + attn.o_proj(out.transpose(1, 2).reshape(bsz, seq, n_heads * head_dim))
                x = self.rms(h, layer.post_attention_layernorm)
                mlp = layer.mlp
                h = h + mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
            h = self.rms(h, self.norm)
            if self.all_positions:
                return (self.lm_head(h), *retained)
            last = position_ids.argmax(dim=1).view(bsz, 1, 1).expand(bsz, 1, h.shape[-1])
            logits = self.lm_head(torch.gather(h, 1, last))  # [B, 1, vocab]: the last valid position
            return (logits, *retained)

    return RetainedStateDecoder().eval(), n_kv, head_dim, max_pos


def export(model_dir: Path, out_path: Path, *, ctx_len: int = 128) -> ExportReport:
    """Export a Llama-family checkpoint (fp32) to `out_path` (external data beside it when over 2 GB)."""
    import torch

    from ... import reference
    from ...errors import NotApplicableError

    model = reference.load_model(model_dir)
    arch = (model.config.architectures or [type(model).__name__])[0]
    if arch not in FAMILIES:
        raise NotApplicableError(f"no AI 100 ONNX export for {arch} yet (exported: {', '.join(sorted(FAMILIES))})")
    decoder, n_kv, head_dim, max_pos = _decoder(model)
    layers = len(decoder.layers)
    names_in = ["input_ids", "position_ids"] + [f"past_{kv}.{i}" for i in range(layers) for kv in ("key", "value")]
    names_out = ["logits"] + [f"past_{kv}.{i}_RetainedState" for i in range(layers) for kv in ("key", "value")]
    seq = 4
    sample = (torch.zeros(1, seq, dtype=torch.long), torch.arange(seq).unsqueeze(0),
              *[torch.zeros(1, n_kv, ctx_len, head_dim) for _ in range(2 * layers)])
    axes: dict[str, dict[int, str]] = {"input_ids": {0: "batch_size", 1: "seq_len"},
                                       "position_ids": {0: "batch_size", 1: "seq_len"}, "logits": {0: "batch_size"}}
    for name in names_in[2:] + names_out[1:]:
        axes[name] = {0: "batch_size", 2: "ctx_len"}
    n_bytes = sum(p.numel() * 4 for p in model.parameters())
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        torch.onnx.export(decoder, sample, str(out_path), input_names=names_in, output_names=names_out,
                          dynamic_axes=axes, opset_version=OPSET, do_constant_folding=True, dynamo=False)
    _fix_logits_shape(out_path, model.config.vocab_size)
    external = n_bytes > 2 * 1024**3
    return ExportReport(str(out_path), layers, n_kv, head_dim, model.config.vocab_size, max_pos, external)


def _fix_logits_shape(path: Path, vocab: int) -> None:
    """The tracer names logits' middle axis symbolically; the contract (and the compiler) wants [batch, 1, vocab]."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    dims = next(o for o in m.graph.output if o.name == "logits").type.tensor_type.shape.dim
    dims[1].Clear()
    dims[1].dim_value = 1
    dims[2].Clear()
    dims[2].dim_value = vocab
    onnx.save(m, str(path))


def run_ort(onnx_path: Path, prompt: list[int], decode_steps: int, ctx_len: int) -> dict[str, Any]:
    """Prefill the prompt, then greedy-decode `decode_steps` tokens feeding the retained state back."""
    import numpy as np
    import onnxruntime as ort

    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    past_inputs = [i for i in sess.get_inputs() if i.name.startswith("past_")]
    state = {}
    for i in past_inputs:
        _b, kv, _ctx, d = i.shape
        state[i.name] = np.zeros((1, kv, ctx_len, d), dtype=np.float32)
    outputs = [o.name for o in sess.get_outputs()]
    ids = np.asarray([prompt], dtype=np.int64)
    pos = np.arange(len(prompt), dtype=np.int64)[None]
    steps_logits, tokens = [], []
    for _ in range(decode_steps + 1):
        res = dict(zip(outputs, sess.run(outputs, {"input_ids": ids, "position_ids": pos, **state})))
        logits = res["logits"][0, 0]
        steps_logits.append(logits)
        tok = int(logits.argmax())
        tokens.append(tok)
        state = {name: res[f"{name}_RetainedState"] for name in state}
        ids = np.asarray([[tok]], dtype=np.int64)
        pos = np.asarray([[int(pos[0, -1]) + 1]], dtype=np.int64)
    return {"logits": steps_logits, "tokens": tokens}


def ort_parity(model_dir: Path, onnx_path: Path, prompt: list[int], decode_steps: int = 8,
               ctx_len: int = 128) -> dict[str, Any]:
    """ORT (prefill + decode_steps, retained state fed back) against transformers fp32 on the same ids:
    transformers scores the prompt followed by ORT's own greedy tokens, teacher-forced in one pass."""
    import numpy as np
    import torch

    from ... import reference

    ort_out = run_ort(onnx_path, prompt, decode_steps, ctx_len)
    model = reference.load_model(model_dir)
    seq = prompt + ort_out["tokens"][:-1]
    with torch.inference_mode():
        ref = model(torch.tensor([seq])).logits[0, len(prompt) - 1:].float().numpy()
    got = np.stack(ort_out["logits"])
    return {"steps": len(got), "top1_agreement": float((ref.argmax(-1) == got.argmax(-1)).mean()),
            "max_abs_logit_delta": float(np.abs(ref - got).max()), "tokens": ort_out["tokens"]}
