"""Predicted quality of an AI 100 compile before compiling: the retained-state decoder (export.py) run in
torch with MXFP6 E2M3 on every constant MatMul weight (families.matmul_weights: the linear layers and
lm_head, GPT-2's Conv1D, MoE routers and experts, each in blocks along its reduction axis; the embedding is
a Gather and stays as it is) and MXINT8 on the K/V written to the cache, against transformers fp32 on the
same ids: top-1 agreement, KL, and perplexity on the parity texts. The fp16 variant rounds the same weights
and the KV cache to float16 instead. Compute stays fp32 here; the device computes in fp16
(`-convert-to-fp16`), which this does not model.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def fake_fp16(x):
    """Round to float16 and back (what `-convert-to-fp16` does to a weight or a float16 KV cache)."""
    return x.half().to(x.dtype)


def _blockwise(quantize, w, axis: int, rows: int = 4096):
    """`quantize` applied to `w` in blocks along `axis` (moved last), a few thousand rows at a time: the MX
    emulation's temporaries stay small whatever the weight's size (a 128k-vocabulary head is 2 GB in fp32)."""
    import itertools

    import torch

    moved = w.movedim(axis, -1)
    if moved.dim() < 2:
        return quantize(moved)
    out = torch.empty(moved.shape, dtype=moved.dtype)
    for idx in itertools.product(*[range(d) for d in moved.shape[:-2]]):
        src, dst = moved[idx], out[idx]
        for lo in range(0, src.shape[0], rows):
            dst[lo:lo + rows] = quantize(src[lo:lo + rows].contiguous())
    return out.movedim(-1, axis).contiguous()


def fake_mxfp6_weights(model, quantize=None) -> int:
    """Replace every constant MatMul weight of a supported causal LM in memory with its MXFP6 E2M3
    quantize-dequantize (or `quantize`, e.g. fake_fp16), in blocks of 32 along its reduction axis (nn.Linear
    [out, in], Conv1D [in, out], stacked MoE experts); tied weights get a copy, so the embedding (a Gather)
    stays fp32. Returns how many tensors changed."""
    import torch

    from .families import matmul_weights
    from .mx import fake_mxfp6

    quantize = quantize or fake_mxfp6
    found = matmul_weights(model)
    with torch.no_grad():
        for module, name, axis in found:
            q = _blockwise(quantize, getattr(module, name).detach(), axis)
            setattr(module, name, torch.nn.Parameter(q, requires_grad=False))
    return len(found)


def mx_transform(model, quantize):
    """The streamed model's load-time transform that does what fake_mxfp6_weights does, one weight as it loads."""
    from .families import matmul_weights

    axes = {(id(module), name): axis for module, name, axis in matmul_weights(model)}

    def transform(_name, owner, attr, value):
        axis = axes.get((id(owner), attr))
        return value if axis is None else _blockwise(quantize, value, axis)
    return transform


def predict(model_dir: Path, sequences: list[list[int]], *, mxfp6: bool = True, mxint8: bool = True,
            fp16: bool = True, reference_logits: list[Any] | None = None, resident: bool = True) -> dict[str, Any]:
    """`fp16`: what is not MX is rounded to float16 as the device stores it (False: left fp32, so the
    decoder itself can be compared with transformers). `reference_logits`: the fp32 logits of `sequences`
    when the caller has them (reference.compute caches them for every artifact kind of a snapshot).
    `resident`: keep every unit after its first load (the model fits with margin); else the decoder runs unit
    by unit, every sequence through a layer before the next one is read (one pass over the weights)."""
    from ...model.streamed_model import StreamedCausalLM
    from ...model.unit_memory import trim_heap
    from ...validation import parity
    from .decoder import build_decoder
    from .mx import fake_mxfp6, fake_mxint8

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if reference_logits is None:
        with StreamedCausalLM(Path(model_dir), files, resident=resident) as plain:
            reference_logits = plain.logits_batch(sequences)
    with StreamedCausalLM(Path(model_dir), files, resident=resident) as lm:
        # Without MXFP6 the compiler still converts every weight to fp16, and the KV cache is float16.
        if mxfp6 or fp16:
            lm.transform = mx_transform(lm.model, fake_mxfp6 if mxfp6 else fake_fp16)
        decoder = build_decoder(lm.model, kv_transform=fake_mxint8 if mxint8 else (fake_fp16 if fp16 else None),
                                ctx_len=max(len(s) for s in sequences))
        decoder.all_positions = True
        got = run_decoder(lm, decoder, sequences)
    del decoder
    trim_heap()
    ref = reference_logits
    total = parity.merge([parity.compare(r, g) for r, g in zip(ref, got)])
    return {"positions": total.positions, "top1": round(total.top1_agreement, 6), "kl": float(f"{total.mean_kl:.6g}"),
            "max_abs_logit_delta": float(f"{total.max_abs_logit_delta:.6g}"),
            **perplexity_change(sequences, ref, got), "unit_loads": lm.loads, "resident": resident,
            "emulated": [name for name in ("mxfp6 weights" if mxfp6 else "fp16 weights" if fp16 else None,
                                           "mxint8 kv cache" if mxint8 else "float16 kv cache" if fp16 else None) if name]}


def perplexity(sequences: list[list[int]], all_logits: list[Any]) -> float:
    """exp(mean negative log-likelihood) of each sequence's next tokens under its logits (one row per token)."""
    import numpy as np

    from ...validation import parity

    nll, n = 0.0, 0
    for s, lg in zip(sequences, all_logits):
        lp = parity.log_softmax(np.asarray(lg)[:len(s) - 1])
        nll -= float(lp[np.arange(len(s) - 1), s[1:]].sum())
        n += len(s) - 1
    return math.exp(nll / n)


def perplexity_change(sequences: list[list[int]], reference: list[Any], emulated: list[Any]) -> dict[str, float]:
    """The perplexity gates' metrics: fp32's, the emulated device's, and the relative change."""
    p_ref, p_got = perplexity(sequences, reference), perplexity(sequences, emulated)
    return {"ppl_fp32": round(p_ref, 4), "ppl": round(p_got, 4), "ppl_delta": float(f"{(p_got - p_ref) / p_ref:.6g}")}


def run_decoder(lm, decoder, sequences: list[list[int]], images: list[tuple[Any, list]] | None = None,
                positions: list[Any] | None = None, cross: list[tuple[Any, dict]] | None = None) -> list[Any]:
    """Every sequence's logits (all positions) through the retained-state decoder over a streamed model, unit
    by unit: each unit is loaded once and every sequence goes through it (prefill from an empty cache).
    A VLM's sequences come with `images` (per sequence, decoder.image_hook's embeddings hook and the per-layer
    additions it fills), `positions` (per sequence, its position_ids tensor, M-RoPE rows included), or `cross`
    (per sequence, a cross-attention VLM's tile mask and its cross layers' image K/V by layer)."""
    import torch

    with torch.inference_mode():
        states = []
        with lm.loaded(decoder.embed, decoder.pos_embed):
            for n, s in enumerate(sequences):
                ids = torch.tensor([s])
                pos = positions[n] if positions else torch.arange(len(s)).unsqueeze(0)
                text_pos, rope_pos = decoder.split_positions(pos)
                hook, added = images[n] if images else (None, [])
                h, rope, masks = decoder.begin(ids, text_pos, len(s), hook, rope_pos)
                kv = {}
                if cross:
                    mask, kv = cross[n]
                    masks["cross"] = decoder.fam.cross_layer.masks(mask, decoder.cross_grid[1])
                states.append([h, rope, masks, text_pos, added, kv])
        for i, layer in enumerate(decoder.layers):
            with lm.loaded(layer):
                for st in states:
                    empty = torch.zeros(1, decoder.n_kv, st[3].shape[1], decoder.head_dim)
                    past_k, past_v = st[5].get(i, (empty, empty))
                    st[0], _k, _v = decoder.layer_step(i, st[0], st[1], st[2], past_k, past_v, st[3], None)
                    if i < len(st[4]):  # DeepStack: the image rows' level i
                        st[0] = st[0] + st[4][i]
        with lm.loaded(decoder.final_norm, decoder.lm_head):
            return [decoder.end(st[0], st[3])[0].float().numpy() for st in states]


def predict_encoder(model_dir: Path, batches: list[list[list[int]]], *, mxfp6: bool = True) -> dict[str, Any]:
    """The same prediction for an embedding model or reranker: every nn.Linear weight (the encoder's constant
    MatMul weights) in MXFP6 (else float16), the exported graph's outputs against fp32 on padded batches:
    min / mean cosine of the sentence embeddings, max |delta|, and a classifier's top-1 over its labels."""
    import numpy as np
    import torch

    from .encoders import CLASSIFIERS, _graph_module, _pad, load_encoder, pooling_mode
    from .mx import fake_mxfp6

    arch, model = load_encoder(model_dir)
    classifier = arch in CLASSIFIERS
    graph = _graph_module(model, classifier, None if classifier else pooling_mode(model_dir))
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def outputs() -> list[np.ndarray]:
        out = []
        with torch.inference_mode():
            for batch in batches:
                ids, mask = _pad(batch, pad_id)
                res = graph(torch.from_numpy(ids), torch.from_numpy(mask))
                out.append((res if classifier else res[1]).float().numpy().astype(np.float64))
        return out

    ref = outputs()
    quantize = fake_mxfp6 if mxfp6 else fake_fp16
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight = torch.nn.Parameter(quantize(module.weight.detach().clone()), requires_grad=False)
    got = outputs()
    cos = np.concatenate([(a * b).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-30)
                          for a, b in zip(ref, got)])
    top1 = None
    if classifier and ref[0].shape[-1] > 1:
        top1 = float(np.mean(np.concatenate([a.argmax(-1) == b.argmax(-1) for a, b in zip(ref, got)])))
    return {"sequences": int(sum(len(b) for b in batches)), "cosine_min": float(f"{cos.min():.8f}"),
            "cosine_mean": float(f"{cos.mean():.8f}"),
            "max_abs_delta": float(f"{max(float(np.abs(a - b).max()) for a, b in zip(ref, got)):.6g}"),
            "top1": top1, "emulated": ["mxfp6 weights" if mxfp6 else "fp16 weights"]}
