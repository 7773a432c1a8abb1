"""Whisper for Cloud AI 100: encoder and decoder as ONE retained-state ONNX graph (opset 17, standard ops only),
as QEfficient compiles it (one QPC, `Encoder` and `Decode` specializations; reference/ai100-qpc.md, Whisper).

The graph (`build_whisper` traced by `export_whisper`), weights read from a transformers
WhisperForConditionalGeneration (no remote code):
- inputs `input_features` [batch_size, num_mel_bins, feature_len] fp32, `input_ids`, `position_ids`
  [batch_size, seq_len] int64 (the decoder's, QEfficient's names), then per decoder layer i
  `past_key_self.{i}` / `past_value_self.{i}` [batch_size, heads, decoder_ctx_len, head_dim] and
  `past_key_cross.{i}` / `past_value_cross.{i}` [batch_size, heads, encoder_ctx_len, head_dim];
- outputs `logits` [batch_size, 1, vocab] (the last valid position: the largest position id) and every past
  input again as `<name>_RetainedState`.

How one graph serves both specializations (the choice, documented because the reference only says that
QEfficient's cross-attention "selects old cache vs fresh K/V by input_features.shape[2] == 1"):
- the encoder always runs on `input_features` (convolutions, positions `embed_positions[:frames / 2]`, layers);
  the cross K/V of every decoder layer are projected from its output ("fresh", [batch, heads, frames / 2, hd]);
- `reuse = Shape(input_features)[2] == 1` and the cross K/V read and retained are `Where(reuse, past, fresh)`:
  no `If` node, one path the compiler sees whole. In the `Encoder` specialization (feature_len =
  2 x max_source_positions, the real log-mel) fresh has encoder_ctx_len rows and replaces the cache; in the
  `Decode` specialization (feature_len 1, a dummy [batch, mels, 1] input) fresh has one row, broadcast by
  Where, and the cache passes through unchanged. The encoder's work on one frame is a few rows: negligible;
- so encoder_ctx_len must equal feature_len / 2 in the Encoder specialization (1500 for 3000 frames), which
  `specializations` writes;
- the decoder runs in both: the Encoder call takes the start token(s) at position 0.. and returns the first
  logits, each Decode call one token. Self-attention K/V are scattered into the cache at `position_ids`
  (ScatterElements) and read under the causal mask slot <= position, as the causal-LM engine (decoder.py).
The attention is written with MatMul/Softmax (no fused kernels); weights are fp32 initializers in one external
data file beside the .onnx (QEfficient's layout; the device converts to fp16 at compile).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # numpy and torch are imported where used: the compile host reads the compile inputs only
    import numpy as np

OPSET = 17
ARCHITECTURES = frozenset({"WhisperForConditionalGeneration"})
DATA_SUFFIX = ".data"
SELF, CROSS = ("key_self", "value_self"), ("key_cross", "value_cross")
# Every Whisper (tiny .. large-v3-turbo) encodes 3000 frames into 1500 positions; QEfficient's Encoder
# specialization and vLLM's max_num_batched_tokens / hf_overrides fix that length, so the compile does too.
ENCODER_CTX = 1500
FEATURES = "input_features"  # the log-mel input; compiled as float16 IO, as QEfficient does (the model's dtype)


@dataclass
class WhisperExportReport:
    path: str
    files: list[str]  # relative to the .onnx's folder
    architecture: str
    layers: int  # decoder layers (each retains self and cross K/V)
    heads: int
    head_dim: int
    vocab: int
    num_mel_bins: int
    encoder_ctx_len: int  # max_source_positions: the Encoder specialization's cross-KV rows
    feature_len: int  # 2 x max_source_positions: the Encoder specialization's frames
    max_target_positions: int
    decoder_ctx_len: int  # the export sample's self-KV length (the axis stays dynamic)
    inputs: list[str] = field(default_factory=list)


def past_names(layers: int) -> list[str]:
    """The retained inputs in graph order: each layer's self K, self V, cross K, cross V."""
    return [f"past_{kv}.{i}" for i in range(layers) for kv in SELF + CROSS]


def custom_io_names(layers: int) -> list[str]:
    """Every retained tensor (custom_io.yaml): each past input and its _RetainedState output."""
    return [f"{p}{suffix}" for p in past_names(layers) for suffix in ("", "_RetainedState")]


def specializations(batch_size: int, ctx_len: int, named: bool = True, encoder_ctx: int = ENCODER_CTX) -> dict[str, Any]:
    """specializations.json of the one graph (QEfficient's): `Encoder` (the real log-mel of 2 x encoder_ctx
    frames, the start token) and `Decode` (a one-frame dummy feature, one token); ctx_len: the decoder's cache
    (vLLM's max_model_len). Every value a string; `named`: SDK >= 1.22's named form."""
    common = {"batch_size": str(batch_size), "seq_len": "1", "encoder_ctx_len": str(encoder_ctx),
              "decoder_ctx_len": str(ctx_len)}
    specs = [("Encoder", {**common, "feature_len": str(2 * encoder_ctx)}), ("Decode", {**common, "feature_len": "1"})]
    return {"specializations": [{"name": n, "symbols": s} if named else s for n, s in specs]}


def build_whisper(model):
    """The one-graph Whisper module (torch) over a transformers WhisperForConditionalGeneration's weights:
    forward(input_features, input_ids, position_ids, *past) -> (logits, *retained)."""
    return _whisper_class()(model).eval()


@functools.cache
def _whisper_class():
    import torch
    from torch import nn

    class RetainedStateWhisper(nn.Module):
        def __init__(self, model):
            super().__init__()
            cfg = model.config
            self.encoder, self.decoder = model.model.encoder, model.model.decoder
            self.proj_out = model.proj_out
            self.n_heads = int(cfg.decoder_attention_heads)
            self.enc_heads = int(cfg.encoder_attention_heads)
            self.head_dim = int(cfg.d_model) // self.n_heads
            self.layers = len(self.decoder.layers)
            self.vocab = int(cfg.vocab_size)

        @staticmethod
        def split(x, heads):
            """[B, S, H*D] -> [B, H, S, D]."""
            b, s, _ = x.shape
            return x.view(b, s, heads, -1).transpose(1, 2)

        def attend(self, q, k, v, out_proj, mask=None):
            """Scaled dot-product attention of q [B, H, S, D] over k, v [B, H, T, D] -> out_proj([B, S, H*D])."""
            scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(2, 3))
            if mask is not None:
                scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
            out = torch.matmul(torch.softmax(scores, dim=-1), v)
            b, h, s, d = out.shape
            return out_proj(out.transpose(1, 2).reshape(b, s, h * d))

        def encode(self, features):
            """transformers' WhisperEncoder for any number of frames (positions embed_positions[:frames / 2])."""
            enc = self.encoder
            x = nn.functional.gelu(enc.conv1(features))
            x = nn.functional.gelu(enc.conv2(x)).permute(0, 2, 1)
            x = x + enc.embed_positions.weight[: x.shape[1]]
            for layer in enc.layers:
                a = layer.self_attn
                h = layer.self_attn_layer_norm(x)
                q, k, v = (self.split(p(h), self.enc_heads) for p in (a.q_proj, a.k_proj, a.v_proj))
                x = x + self.attend(q, k, v, a.out_proj)
                x = x + layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(x))))
            return enc.layer_norm(x)

        def forward(self, input_features, input_ids, position_ids, *past):
            reuse = torch.onnx.operators.shape_as_tensor(input_features)[2] == 1  # the Decode specialization
            memory = self.encode(input_features)
            dec = self.decoder
            bsz, seq = input_ids.shape
            # no embed_scale: transformers' WhisperDecoder defines it (scale_embedding) but never applies it
            h = dec.embed_tokens(input_ids) + dec.embed_positions.weight[position_ids]
            ctx = past[0].shape[2]
            mask = torch.arange(ctx, dtype=position_ids.dtype).view(1, 1, 1, ctx) <= position_ids.view(bsz, 1, seq, 1)
            index = position_ids.view(bsz, 1, seq, 1).expand(bsz, self.n_heads, seq, self.head_dim)
            retained = []
            for i, layer in enumerate(dec.layers):
                pk, pv, ck, cv = past[4 * i: 4 * i + 4]
                a = layer.self_attn
                x = layer.self_attn_layer_norm(h)
                q, k, v = (self.split(p(x), self.n_heads) for p in (a.q_proj, a.k_proj, a.v_proj))
                k_all, v_all = pk.scatter(2, index, k), pv.scatter(2, index, v)  # ScatterElements at position_ids
                h = h + self.attend(q, k_all, v_all, a.out_proj, mask)
                c = layer.encoder_attn
                k_cross = torch.where(reuse, ck, self.split(c.k_proj(memory), self.n_heads))
                v_cross = torch.where(reuse, cv, self.split(c.v_proj(memory), self.n_heads))
                h = h + self.attend(self.split(c.q_proj(layer.encoder_attn_layer_norm(h)), self.n_heads),
                                    k_cross, v_cross, c.out_proj)
                h = h + layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(h))))
                retained += [k_all, v_all, k_cross, v_cross]
            h = dec.layer_norm(h)
            # the last valid position (largest position id): a one-hot [B, 1, S] MatMul keeps logits static
            last = position_ids.argmax(dim=1, keepdim=True)
            pick = (torch.arange(seq, dtype=last.dtype).view(1, seq) == last).to(h.dtype).unsqueeze(1)
            return (self.proj_out(torch.matmul(pick, h)), *retained)

    return RetainedStateWhisper


def export_whisper(model, out_path: Path, *, ctx_len: int = 64) -> WhisperExportReport:
    """Trace `build_whisper(model)` to `out_path` (+ `<out_path>.data`, the fp32 weights). Dynamic axes:
    batch_size, feature_len, seq_len, decoder_ctx_len, encoder_ctx_len (the specializations fix them)."""
    import onnx
    import torch

    module = build_whisper(model)
    cfg = model.config
    n, heads, hd, mels = module.layers, module.n_heads, module.head_dim, int(cfg.num_mel_bins)
    enc = int(cfg.max_source_positions)
    names_in = ["input_features", "input_ids", "position_ids"] + past_names(n)
    names_out = ["logits"] + [f"{p}_RetainedState" for p in past_names(n)]
    sample = [torch.zeros(1, mels, 2 * enc), torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)]
    sample += [torch.zeros(1, heads, ctx_len if kv in SELF else enc, hd) for _ in range(n) for kv in SELF + CROSS]
    axes: dict[str, dict[int, str]] = {"input_features": {0: "batch_size", 2: "feature_len"},
                                       "input_ids": {0: "batch_size", 1: "seq_len"},
                                       "position_ids": {0: "batch_size", 1: "seq_len"}, "logits": {0: "batch_size"}}
    for name in past_names(n):
        cache = {0: "batch_size", 2: "encoder_ctx_len" if "_cross" in name else "decoder_ctx_len"}
        axes[name] = axes[f"{name}_RetainedState"] = cache
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".trace")
    with torch.no_grad():
        torch.onnx.export(module, tuple(sample), str(tmp), input_names=names_in, output_names=names_out,
                          dynamic_axes=axes, opset_version=OPSET, do_constant_folding=True, dynamo=False)
    graph = onnx.load(str(tmp))
    tmp.unlink()
    data = out_path.name + DATA_SUFFIX
    out_path.with_name(data).unlink(missing_ok=True)
    graph.producer_name = "hive-aot"
    onnx.save_model(graph, str(out_path), save_as_external_data=True, all_tensors_to_one_file=True, location=data,
                    size_threshold=0)
    return WhisperExportReport(str(out_path), [out_path.name, data], "WhisperForConditionalGeneration", n, heads, hd,
                               module.vocab, mels, enc, 2 * enc, int(cfg.max_target_positions), ctx_len, names_in)


# -- onnxruntime ------------------------------------------------------------------------------------------

def run_ort_whisper(onnx_path: Path, features: np.ndarray, start: list[int], decode_steps: int,
                    ctx_len: int) -> dict[str, Any]:
    """The Encoder step (the log-mel [1, mels, frames] and the start tokens, one call per start token: the
    first with the real features, the next ones already Decode calls), then `decode_steps` greedy Decode steps
    (a [1, mels, 1] zero feature) feeding every retained state back. -> {"logits": per step, "tokens"}."""
    import numpy as np

    from .ort import session

    sess = session(onnx_path)
    outputs = [o.name for o in sess.get_outputs()]
    state = {}
    for i in sess.get_inputs():
        if i.name.startswith("past_"):
            rows = ctx_len if "_self" in i.name else features.shape[2] // 2
            state[i.name] = np.zeros((1, i.shape[1], rows, i.shape[3]), dtype=np.float32)
    dummy = np.zeros((1, features.shape[1], 1), dtype=np.float32)
    logits_steps, tokens, ids = [], [], list(start)
    for step in range(len(start) + decode_steps):
        tok = ids[step] if step < len(start) else tokens[-1]
        feed = {"input_features": features.astype(np.float32) if step == 0 else dummy,
                "input_ids": np.asarray([[tok]], dtype=np.int64), "position_ids": np.asarray([[step]], dtype=np.int64)}
        res = dict(zip(outputs, sess.run(outputs, {**feed, **state})))
        state = {name: res[f"{name}_RetainedState"] for name in state}
        if step >= len(start) - 1:
            logits_steps.append(res["logits"][0, 0])
            tokens.append(int(res["logits"][0, 0].argmax()))
    return {"logits": logits_steps, "tokens": tokens}


def log_mel(cfg, seed: int = 0) -> np.ndarray:
    """A synthetic log-mel [1, num_mel_bins, 2 x max_source_positions] (numpy, deterministic), in the range of
    Whisper's normalized features: the parity input (no audio file, no feature extractor)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    shape = (1, int(cfg.num_mel_bins), 2 * int(cfg.max_source_positions))
    return np.clip(rng.standard_normal(shape), -1.5, 1.5).astype(np.float32)


def start_tokens(model) -> list[int]:
    """The decoder prompt a transcription starts with, from the checkpoint's generation config as transformers'
    generate builds it: <|startoftranscript|>, the language (English when the model is multilingual), the task
    (transcribe) and <|notimestamps|>; a model whose config names none of them starts with its start token alone."""
    gen, cfg = getattr(model, "generation_config", None), model.config
    ids = [int(cfg.decoder_start_token_id)]
    lang = (getattr(gen, "lang_to_id", None) or {}).get("<|en|>")
    task = (getattr(gen, "task_to_id", None) or {}).get("transcribe")
    no_timestamps = getattr(gen, "no_timestamps_token_id", None)
    if getattr(gen, "is_multilingual", False) and lang is not None:
        ids.append(int(lang))
    if getattr(gen, "is_multilingual", False) and task is not None:
        ids.append(int(task))
    if no_timestamps is not None:
        ids.append(int(no_timestamps))
    return ids


def load_model(model_dir: Path):
    """transformers' WhisperForConditionalGeneration in fp32 with eager attention (no remote code)."""
    import torch
    from transformers import WhisperForConditionalGeneration

    return WhisperForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32,
                                                           attn_implementation="eager").eval()


def reference_greedy(model, features: np.ndarray, start: list[int], steps: int) -> dict[str, Any]:
    """transformers fp32, end to end: greedy decoding by whole forwards (decoder_input_ids = start + tokens so
    far), the logits of each new position."""
    import numpy as np
    import torch

    feats = torch.from_numpy(features.astype(np.float32))
    ids, logits_steps = list(start), []
    with torch.no_grad():
        for _ in range(steps + 1):
            out = model(input_features=feats, decoder_input_ids=torch.tensor([ids])).logits[0, -1].numpy()
            logits_steps.append(out)
            ids.append(int(out.argmax()))
    return {"logits": logits_steps, "tokens": ids[len(start):]}


def whisper_parity(model, onnx_path: Path, features: np.ndarray, start: list[int], decode_steps: int = 8,
                   ctx_len: int = 64) -> dict[str, Any]:
    """ORT (Encoder step, decode_steps Decode steps, state fed back) against transformers fp32: teacher-forced on
    ORT's own tokens (top-1 agreement, max |delta logit|), and both greedy runs' tokens (`tokens_equal`)."""
    import numpy as np
    import torch

    from .ort import compare

    got = run_ort_whisper(onnx_path, features, start, decode_steps, ctx_len)
    with torch.no_grad():
        seq = torch.tensor([list(start) + got["tokens"][:-1]])
        ref = model(input_features=torch.from_numpy(features.astype(np.float32)),
                    decoder_input_ids=seq).logits[0, len(start) - 1:].numpy()
    greedy = reference_greedy(model, features, start, decode_steps)
    return {**compare(ref, got["logits"]), "tokens": got["tokens"], "reference_tokens": greedy["tokens"],
            "tokens_equal": got["tokens"] == greedy["tokens"]}


# -- serving ------------------------------------------------------------------------------------------------

def compile_problems(opts, config: dict[str, Any]) -> list[str]:
    """What a Whisper compile (task: transcribe) cannot be, for this config.json: QEfficient's and vllm-qaic's
    fixed encoder length, the decoder's positions, and the precisions QEfficient leaves off for Whisper (and
    hive-aot does not emulate for it)."""
    problems = []
    if config.get("max_source_positions") != ENCODER_CTX:
        problems.append(f"max_source_positions {config.get('max_source_positions')}: the Encoder specialization encodes "
                        f"{2 * ENCODER_CTX} frames into {ENCODER_CTX} positions, as QEfficient and vllm-qaic do")
    target = config.get("max_target_positions")
    if isinstance(target, int) and opts.ctx_len > target:
        problems.append(f"ctx_len {opts.ctx_len} is beyond the decoder's {target} positions (max_target_positions)")
    if opts.mxfp6 or opts.mxint8:
        problems.append("task transcribe compiles fp16 weights and an fp16 KV cache (mxfp6: false, mxint8: false)")
    return problems


def serving_args() -> dict[str, Any]:
    """vllm-qaic's arguments for a prebuilt Whisper QPC beyond the common ones (max_model_len = the decoder's
    ctx_len, max_num_seqs 1; reference/ai100-qpc.md, Whisper; VQ's encoder_decoder.md): AOT only, read from
    VLLM_QAIC_QPC_PATH; the encoder's 1500 rows as the batched-token budget and as hf_overrides'
    max_source_positions; one audio per prompt; prefix caching off. The loader forces prefill_seq_len 1
    itself, so no capture length is passed. The reference names no `--task` for speech-to-text (vLLM infers
    transcription from the architecture): none is passed, unconfirmed on a device."""
    return {"max_num_batched_tokens": ENCODER_CTX, "hf_overrides": json.dumps({"max_source_positions": ENCODER_CTX}),
            "limit_mm_per_prompt": json.dumps({"audio": 1}), "no_enable_prefix_caching": True}


def predict_fp16(model, features: np.ndarray, start: list[int], steps: int = 8) -> dict[str, Any]:
    """The device's quality predicted for a -convert-to-fp16 compile: every weight rounded to fp16 (clipped to
    its range), greedy from the same log-mel, teacher-forced against the fp32 model on the fp16 run's ids."""
    import copy

    import numpy as np
    import torch

    from .external_data import FP16_MAX

    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.clamp(-FP16_MAX, FP16_MAX).half().float())
    got = reference_greedy(rounded, features, start, steps)
    with torch.no_grad():
        ids = torch.tensor([list(start) + got["tokens"][:-1]])
        ref = model(input_features=torch.from_numpy(features), decoder_input_ids=ids).logits[0, len(start) - 1:].numpy()
    pred = np.stack(got["logits"])
    return {"top1": float((ref.argmax(-1) == pred.argmax(-1)).mean()), "max_abs_logit_delta": float(np.abs(ref - pred).max()),
            "steps": len(pred), "emulated": ["fp16 weights"]}
