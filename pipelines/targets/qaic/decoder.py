"""The retained-state decoder of the AI 100 export: one engine, written with standard ONNX ops only (opset 17),
reading the weights of a transformers causal LM as its family declares them (families/). The engine holds no
per-family branch: where families differ (norms, q/k/v splits, q/k norms, rotary style and RoPE table, MLP,
MoE scoring and expert layout) it calls the block the family declares (families/blocks.py).
This module holds the contract and `build_decoder`; the torch module is decoder_module.py, imported on first
use so that importing this one does not import torch.

The same module is traced into the ONNX graph (export.py) and run in torch to predict the device's quality
(quality.py). Its forward is three stages, so a driver can run it unit by unit on a streamed model (one layer
resident, every sequence through it): `begin` (embeddings, RoPE rows, masks), `layer_step(i)` (decoder layer i
with its cache update), `end` (final norm, head). Composed, they are `forward`:
- inputs `input_ids`, `position_ids` [batch, seq_len] int64 ([4, batch, seq_len] for a multimodal-RoPE family:
  row 0 the text positions, which place, mask and pick as below, rows 1-3 the t/h/w RoPE positions), then
  `past_key.{i}` / `past_value.{i}`
  [batch, n_kv_heads, ctx_len, head_dim] fp32 per layer; no attention mask;
- with continuous batching (`batch_index=True`) the past inputs are [full_batch_size, ...] and a last input
  `batch_index` [batch, 1] int64 names the cache row of each batch row: its new K/V are scattered into that
  row (ScatterND at (row, head, position)) and its attention reads that row; the retained state is the whole
  [full_batch_size, ...] cache;
- as the target LM of speculative decoding (`logits_to_keep=True`, QEfficient's TLM) a last input
  `num_logits_to_keep` [N, 1] int64 whose length N alone is read: `logits` are [batch, N, vocab], the last N
  positions up to the last valid one, so a decode step of K+1 tokens (the last accepted token and K drafts)
  is verified in one run; without it the graph is the plain one, input for input;
- outputs `logits` [batch, 1, vocab] for the last valid position (the largest position id), then
  `past_key.{i}_RetainedState` / `past_value.{i}_RetainedState`: the cache with the new K/V scattered in at
  `position_ids` (ScatterElements);
- a VLM's language graph (vision/) either merges image rows over placeholder tokens (`image_token`) or, with
  cross-attention layers (`cross_grid`, Mllama), takes `cross_attention_mask` [batch, seq_len, images,
  tiles] after input_ids and reads each cross layer's image K/V from its past inputs (passed through);
- the causal mask is built in the graph from `position_ids` (a cache slot j is visible to a token at
  position p when j <= p, and p - j < window in a sliding-window layer, j // chunk == p // chunk in a chunked
  one); RoPE reads static cos/sin tables by position; MoE routing is a static TopK + dense expert sum.
"""

from __future__ import annotations


def build_decoder(model, *, kv_transform=None, batch_index: bool = False, ctx_len: int | None = None,
                  logits_to_keep: bool = False, image_token: int | None = None, deepstack: int = 0,
                  cross_grid: tuple[int, int] | None = None):
    """The retained-state decoder (a torch module) of a transformers causal LM of a supported family.

    forward(input_ids, position_ids, *past[, batch_index][, num_logits_to_keep]) -> (logits, *retained);
    `logits_to_keep`: the target LM's `num_logits_to_keep` input (see the module's doc); `all_positions = True`
    returns logits for every position instead of the last valid one (quality prediction). `kv_transform`
    is applied to the new K/V before they are written to the cache (MXINT8 emulation; never exported).
    `image_token`: the language graph of a vision-language model (vision/): forward(input_ids, vision_embeds,
    position_ids, image_idx, *past[, batch_index]) -> (logits, vision_embeds, image_idx_output, *retained), the
    rows of `vision_embeds` written over the embeddings of the `image_token` placeholders (`merge_image`);
    `deepstack` (a level count) adds `deepstack_features` [levels, images, vision_size, hidden] after
    vision_embeds (and its retained twin after vision_embeds'), level i added to the image rows after decoder
    layer i (Qwen3-VL's DeepStack).
    `ctx_len` picks the RoPE mode of length-dependent scalings (longrope, dynamic) for the positions below
    it: the mode transformers uses for a sequence of that length. transformers switches the mode per
    sequence (Phi-3 longrope: long factors once a sequence passes original_max_position_embeddings); a
    static table cannot, so with ctx_len above that length, sequences shorter than it differ from transformers.
    `cross_grid`: (tiles per image, image rows per tile) of a cross-attention VLM's language graph (a family
    declaring `cross_layers`): forward(input_ids, cross_attention_mask, position_ids, *past[, batch_index]); the
    past of a cross layer is the image's K/V [batch, n_kv, images * tiles * rows per tile, head_dim].
    """
    from .decoder_module import RetainedStateDecoder  # here: importing this module does not import torch

    decoder = RetainedStateDecoder(model, kv_transform=kv_transform, batch_index=batch_index, ctx_len=ctx_len)
    if decoder.cross_layers and cross_grid is None:
        from ...core.errors import NotApplicableError

        raise NotApplicableError(f"{decoder.arch} has cross-attention layers: it is exported through its "
                                 "vision-language model (the image's K/V come from the vision graph)")
    decoder.logits_to_keep = logits_to_keep
    decoder.image_token = image_token
    decoder.deepstack = deepstack
    decoder.cross_grid = cross_grid
    return decoder.eval()

