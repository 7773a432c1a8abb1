"""gpt-oss (GptOssForCausalLM): llama.cpp arch `gpt-oss`.

A Llama-shaped decoder (NEOX rope: nothing permuted) with what OpenAI's models add:

- attention sinks: one learned logit per head (`self_attn.sinks`, [heads]) joins every softmax and is dropped
  after it; llama.cpp's `attn_sinks` (f32);
- q/k/v/o biases (`attention_bias`, on in every release: llama.cpp requires the output bias, so off is refused);
- alternating attention: `layer_types` (HF's default: even layers slide, odd ones attend fully) with one
  window (`sliding_window`, 128 as released), written as llama.cpp's per-layer bool pattern; YaRN rope
  (factor 32 over 4,096 positions as released). llama.cpp always rounds YaRN's correction range to whole
  dimensions; the release says `truncate: false`, which no GGUF key carries: its mid frequencies differ a little
  (measured on the tiny test model: f16 KL 1.7e-5 instead of 4e-7), as in llama.cpp's own file;
- the post-attention RMS norm is llama.cpp's `post_attention_norm` (its gpt-oss graph has no `ffn_norm`);
- a router with a bias (`mlp.router.weight` / `.bias`): top-k of the logits, softmax over the k chosen;
- experts with biases and a clamped SwiGLU: gate clamped above at 7.0, up clamped to [-7, 7], gate *
  sigmoid(1.702 gate) * (up + 1); llama.cpp hard-codes alpha 1.702 and limit 7.0, so other values are refused;
- an untied output matrix (llama.cpp requires `output`).

The experts come in two layouts, told apart by config.json's quantization_config:

- as released (gpt-oss-20b/120b): MXFP4 (`quant_method: mxfp4`). `gate_up_proj_blocks` [E, 2I, H/32, 16]
  (E2M1 pairs, low nibble first) with `gate_up_proj_scales` [E, 2I, H/32] (E8M0), gate and up interleaved
  row by row, and `down_proj_blocks` / `_scales` [E, H, I/32, ...]. llama.cpp keeps them MXFP4 in every file
  type: each 32-block becomes ggml's `block_mxfp4` (the scale byte, then 16 bytes holding element j in the
  low nibble and element j + 16 in the high one), bytes moved, no value changed; the biases are bf16 tensors.
  (llama.cpp's CPU backend multiplies MXFP4 weights with activations rounded to Q8_0, so such an "f16" file runs
  its experts at q8_0-activation precision.) A k-quant keeps them MXFP4 (tensor_quant.type_overrides);
- dequantized (transformers' `save_pretrained`, the BF16 re-uploads): `gate_up_proj` [E, H, 2I] (gate and
  up interleaved along the last axis) and `down_proj` [E, I, H], transposed to llama.cpp's [E, out, in].

Both stream expert by expert (sliced rules). Gate and up biases are the even and odd entries of
`gate_up_proj_bias` [E, 2I]; stacked biases stay f32 like every bias.
"""

from __future__ import annotations

import gguf
import numpy as np

from ....core.errors import ModelFormatError
from .shared import EMBEDDINGS, LAYER, ROTARY_BUFFERS, attention, layer_types
from .spec import (
    IDENTITY,
    A,
    Family,
    HParams,
    K,
    Rule,
    T,
    Transform,
    derived,
    name,
    param,
    refuse_false,
    refuse_rope,
    refuse_true,
    tensor,
)

ARCH = "gpt-oss"
EXPERTS = LAYER + ".mlp.experts"
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # llama.cpp's LLM_FFN_SWIGLU_OAI_MOE constants
DEFAULT_WINDOW = 128  # GptOssConfig's sliding_window when config.json omits it
MXFP4_BLOCK = 32


def mxfp4(hp: HParams) -> bool:
    """The experts are stored MXFP4 (the released layout), by config.json's quantization_config."""
    qc = hp.get("quantization_config")
    return isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() == "mxfp4"


# --- dequantized experts -------------------------------------------------------------------------------------

def _interleaved(parity: int) -> Transform:
    """gate_up_proj [E, H, 2I] -> gate (parity 0) or up (1) [E, I, H]: every other column, transposed."""
    def apply(xs, hp):
        return [np.ascontiguousarray(xs[0][:, :, parity::2].transpose(0, 2, 1))]

    def shapes(s, hp):
        if len(s[0]) != 3 or s[0][2] % 2:
            raise ModelFormatError(f"fused gate_up_proj {list(s[0])} is not [experts, hidden, 2 x intermediate]")
        return [(s[0][0], s[0][2] // 2, s[0][1])]

    return Transform(("gate", "up")[parity], apply, shapes, sliced=True)


def _transposed(what: str) -> Transform:
    """down_proj [E, I, H] -> [E, H, I]."""
    def shapes(s, hp):
        if len(s[0]) != 3:
            raise ModelFormatError(f"{what} {list(s[0])} is not [experts, rows, columns]")
        return [(s[0][0], s[0][2], s[0][1])]

    return Transform("transpose_experts", lambda xs, hp: [np.ascontiguousarray(xs[0].transpose(0, 2, 1))], shapes,
                     sliced=True)


def _bias_half(parity: int) -> Transform:
    """gate_up_proj_bias [E, 2I] -> the gate (even) or up (odd) entries [E, I]."""
    def shapes(s, hp):
        if len(s[0]) != 2 or s[0][1] % 2:
            raise ModelFormatError(f"gate_up_proj_bias {list(s[0])} is not [experts, 2 x intermediate]")
        return [(s[0][0], s[0][1] // 2)]

    return Transform(("gate_bias", "up_bias")[parity],
                     lambda xs, hp: [np.ascontiguousarray(xs[0][:, parity::2])], shapes)


# --- MXFP4 experts (as released) ------------------------------------------------------------------------------

def repack_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[..., n, 16] packed E2M1 pairs (element 2j in byte j's low nibble) and [..., n] E8M0 scales -> ggml's
    block_mxfp4 rows [..., n * 17]: per block the scale byte, then qs[j] = element j | element j + 16 << 4."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ModelFormatError(f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)}")
    if (scales == 0xFF).any():  # E8M0's NaN: weights no conversion can carry
        raise ModelFormatError(f"MXFP4 scales hold {int((scales == 0xFF).sum())} NaN value(s) (0xFF)")
    values = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], MXFP4_BLOCK)
    qs = values[..., :16] | (values[..., 16:] << 4)
    return np.concatenate([scales[..., None], qs], axis=-1).reshape(*scales.shape[:-1], -1)


def _mxfp4(what: str, rows: slice) -> Transform:
    """(blocks [E, R, n, 16], scales [E, R, n]) -> the MXFP4 tensor [E, R', n * 32] of the rows `rows` (gate_up:
    even rows are gate, odd rows up; down: all), written as stored."""
    def apply(xs, hp):
        return [repack_mxfp4(xs[0][:, rows], xs[1][:, rows])]

    def shapes(s, hp):
        blocks, scales = s
        if len(blocks) != 4 or blocks[-1] != MXFP4_BLOCK // 2 or tuple(blocks[:3]) != tuple(scales):
            raise ModelFormatError(f"MXFP4 {what} blocks {list(blocks)} / scales {list(scales)} are not "
                                   "[experts, rows, blocks, 16] / [experts, rows, blocks]")
        return [(blocks[0], len(range(blocks[1])[rows]), blocks[2] * MXFP4_BLOCK)]

    return Transform(f"mxfp4_{what}", apply, shapes, fixed=gguf.GGMLQuantizationType.MXFP4)


def _dense(hp: HParams, bid: int) -> bool:
    return not mxfp4(hp)


def _packed(hp: HParams, bid: int) -> bool:
    return mxfp4(hp)


EXPERT_RULES = (
    Rule((name(T.FFN_GATE_EXP),), (EXPERTS + ".gate_up_proj",), _interleaved(0), when=_dense),
    Rule((name(T.FFN_UP_EXP),), (EXPERTS + ".gate_up_proj",), _interleaved(1), when=_dense),
    Rule((name(T.FFN_DOWN_EXP),), (EXPERTS + ".down_proj",), _transposed("down_proj"), when=_dense),
    Rule((name(T.FFN_GATE_EXP),), (EXPERTS + ".gate_up_proj_blocks", EXPERTS + ".gate_up_proj_scales"),
         _mxfp4("gate", slice(0, None, 2)), when=_packed),
    Rule((name(T.FFN_UP_EXP),), (EXPERTS + ".gate_up_proj_blocks", EXPERTS + ".gate_up_proj_scales"),
         _mxfp4("up", slice(1, None, 2)), when=_packed),
    Rule((name(T.FFN_DOWN_EXP),), (EXPERTS + ".down_proj_blocks", EXPERTS + ".down_proj_scales"),
         _mxfp4("down", slice(None)), when=_packed),
    tensor(T.FFN_GATE_EXP, EXPERTS + ".gate_up_proj_bias", _bias_half(0), suffix="bias"),
    tensor(T.FFN_UP_EXP, EXPERTS + ".gate_up_proj_bias", _bias_half(1), suffix="bias"),
    tensor(T.FFN_DOWN_EXP, EXPERTS + ".down_proj_bias", suffix="bias"),
)

BLOCK = (
    tensor(T.ATTN_NORM, LAYER + ".input_layernorm.weight"),
    tensor(T.ATTN_POST_NORM, LAYER + ".post_attention_layernorm.weight"),
    *attention(q=IDENTITY, k=IDENTITY),
    tensor(T.ATTN_SINKS, LAYER + ".self_attn.sinks"),
    tensor(T.FFN_GATE_INP, LAYER + ".mlp.router.weight"),
    tensor(T.FFN_GATE_INP, LAYER + ".mlp.router.bias", suffix="bias"),
)


def window(hp: HParams):
    """The sliding window: config.json's (an explicit null turns sliding off in transformers), else the default."""
    return hp.cfg["sliding_window"] if "sliding_window" in hp.cfg else DEFAULT_WINDOW


def sliding_pattern(hp: HParams) -> list[bool]:
    """One bool per layer, true where it slides (`layer_types`, HF's default: every other layer from the first)."""
    return [t == "sliding_attention" for t in layer_types(hp, 2)]


def _check(hp: HParams) -> None:
    refuse_true(hp, ARCH, "tie_word_embeddings", "llama.cpp's gpt-oss requires an untied output matrix")
    refuse_false(hp, ARCH, "attention_bias", "llama.cpp's gpt-oss requires the attention output bias")
    refuse_rope(hp, ARCH)
    for key, value in (("swiglu_alpha", SWIGLU_ALPHA), ("swiglu_limit", SWIGLU_LIMIT)):
        if hp.get(key) is not None and float(hp.get(key)) != value:
            raise ModelFormatError(f"{ARCH} with {key}={hp.get(key)} is not supported: llama.cpp's experts use "
                                   f"{key.split('_')[1]} {value}")
    if isinstance(window(hp), bool) or not isinstance(window(hp), int) or window(hp) <= 0:
        raise ModelFormatError(f"{ARCH} GGUF needs a sliding_window (llama.cpp's gpt-oss always slides), config has "
                               f"{window(hp)!r}")
    sliding_pattern(hp)
    qc = hp.get("quantization_config")
    if qc is not None and not mxfp4(hp):
        raise ModelFormatError(f"{ARCH} GGUF reads MXFP4 or unquantized experts, not quant_method "
                               f"{qc.get('quant_method') if isinstance(qc, dict) else qc!r}")


FAMILY = Family(
    name="gpt_oss",
    gguf_arch=ARCH,
    architectures=("GptOssForCausalLM",),
    tensors=EMBEDDINGS + BLOCK + EXPERT_RULES,
    params=(
        param(K.EXPERT_FEED_FORWARD_LENGTH, "intermediate_size", required=True),
        derived(A.SLIDING_WINDOW, window),
        derived(A.SLIDING_WINDOW_PATTERN, sliding_pattern, kind=list),
    ),
    ignored=ROTARY_BUFFERS,
    check=_check,
    quantizations=("mxfp4",),
)
