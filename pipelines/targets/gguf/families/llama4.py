"""Llama 4 (Llama4ForCausalLM, and the language model of Llama4ForConditionalGeneration): llama.cpp arch `llama4`.

Scout (16 experts, every layer MoE) and Maverick (128 experts, MoE every 2nd layer) are Llama blocks with:

- interleaved MoE: layer i is MoE where (i + 1) % `interleave_moe_layer_step` == 0 (HF's default `moe_layers`),
  dense SwiGLU (`intermediate_size_mlp`, llama.cpp's `feed_forward_length`) elsewhere; an MoE layer is a top-k
  sigmoid router (`feed_forward.router`, the score scales the expert's input, as llama.cpp does for llama4), the
  routed experts and one shared expert, both `intermediate_size` wide (`expert_feed_forward_length`);
- experts FUSED, as released and as transformers 5 saves them: `feed_forward.experts.gate_up_proj` [E, H, 2I]
  (gate in the first half) and `down_proj` [E, I, H], both [in, out]: split and transposed to llama.cpp's
  [E, rows, H], streamed expert by expert (sliced rules);
- rope on three layers of four, with chunked attention; every 4th layer is NoPE with global attention and
  attention temperature tuning (queries scaled by 1 + attn_scale * log1p(floor((pos + 1) / floor_scale)));
  llama.cpp hard-codes that layout: chunks of 8192, floor_scale 8192, attn_scale 0.1, NoPE on every 4th layer,
  so any other `no_rope_layers` / `layer_types` / chunk / temperature is refused in one line;
- an L2 norm (no weight, rms_norm_eps) of q and k after the rope (`use_qk_norm`): llama.cpp decides it by the
  expert count (on unless 128 experts), so a config that says otherwise is refused;
- complex (interleaved-pair) rope, which is llama.cpp's own: Q and K are NOT permuted; Scout's "llama3" rope
  scaling is the `rope_freqs` tensor.

The wrapper keeps the language model under `language_model.model.` / `language_model.lm_head.` (as released and
as transformers 5 saves it); its vision tower and projector belong to the mmproj GGUF.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ....core.errors import ModelFormatError
from .shared import (
    EMBEDDINGS,
    LAYER,
    NORMS,
    ROTARY_BUFFERS,
    VISION_TENSORS,
    VLM_RENAMES,
    VOCAB_AND_ROPE_DIMS,
    attention,
    llama3_rope_freqs,
)
from .spec import (
    IDENTITY,
    Family,
    HParams,
    K,
    Rule,
    T,
    Transform,
    derived,
    name,
    param,
    refuse_rope,
    refuse_true,
    require_activation,
    tensor,
)

ARCH = "llama4"
FF = LAYER + ".feed_forward"
# What llama.cpp's llama4 hard-codes (llama_model_llama4::load_arch_hparams) and the HF configs it matches
CHUNK, FLOOR_SCALE, ATTN_SCALE, NOPE_EVERY = 8192, 8192, 0.1, 4
NO_QK_NORM_EXPERTS = 128  # llama.cpp turns the q/k L2 norm off for its 17B-128E model type only (Maverick)


def moe_step(hp: HParams) -> int:
    return int(hp.get("interleave_moe_layer_step") or 1)  # HF's default 1 (Scout)


def is_moe(hp: HParams, bid: int) -> bool:
    return (bid + 1) % moe_step(hp) == 0


def is_dense(hp: HParams, bid: int) -> bool:
    return not is_moe(hp, bid)


def _experts_half(which: int) -> Transform:
    """gate_up_proj [E, H, 2I] -> gate (0, the first half) or up (1) [E, I, H]: a half of the columns, transposed."""
    def apply(xs, hp):
        half = xs[0].shape[2] // 2
        return [np.ascontiguousarray(xs[0][:, :, which * half:(which + 1) * half].transpose(0, 2, 1))]

    def shapes(s, hp):
        if len(s[0]) != 3 or s[0][2] != 2 * int(hp.require("intermediate_size")):
            raise ModelFormatError(f"fused gate_up_proj {list(s[0])} is not [experts, hidden, 2 x intermediate_size]")
        return [(s[0][0], s[0][2] // 2, s[0][1])]

    return Transform(("experts_gate", "experts_up")[which], apply, shapes, sliced=True)


def _experts_down() -> Transform:
    """down_proj [E, I, H] -> [E, H, I]."""
    def shapes(s, hp):
        if len(s[0]) != 3:
            raise ModelFormatError(f"fused down_proj {list(s[0])} is not [experts, intermediate_size, hidden]")
        return [(s[0][0], s[0][2], s[0][1])]

    return Transform("experts_down", lambda xs, hp: [np.ascontiguousarray(xs[0].transpose(0, 2, 1))], shapes,
                     sliced=True)


EXPERTS_GATE, EXPERTS_UP, EXPERTS_DOWN = _experts_half(0), _experts_half(1), _experts_down()

DENSE_MLP = tuple(tensor(t, f"{FF}.{hf}.weight", when=is_dense)
                  for t, hf in ((T.FFN_GATE, "gate_proj"), (T.FFN_UP, "up_proj"), (T.FFN_DOWN, "down_proj")))
MOE = (
    tensor(T.FFN_GATE_INP, FF + ".router.weight", when=is_moe),
    Rule((name(T.FFN_GATE_EXP),), (FF + ".experts.gate_up_proj",), EXPERTS_GATE, when=is_moe),
    Rule((name(T.FFN_UP_EXP),), (FF + ".experts.gate_up_proj",), EXPERTS_UP, when=is_moe),
    Rule((name(T.FFN_DOWN_EXP),), (FF + ".experts.down_proj",), EXPERTS_DOWN, when=is_moe),
    *(tensor(t, f"{FF}.shared_expert.{hf}.weight", when=is_moe)
      for t, hf in ((T.FFN_GATE_SHEXP, "gate_proj"), (T.FFN_UP_SHEXP, "up_proj"), (T.FFN_DOWN_SHEXP, "down_proj"))),
)


def _expect(hp: HParams, key: str, got, want, why: str) -> None:
    if got != want:
        raise ModelFormatError(f"{ARCH} with {key}={got!r} is not supported: {why} (needs {want!r})")


def _check(hp: HParams) -> None:
    refuse_rope(hp, ARCH, ("default", "llama3", "linear"))
    require_activation(hp, ARCH, "silu", "llama.cpp's llama4 runs SwiGLU MLPs and experts")
    refuse_true(hp, ARCH, "attention_bias", "llama.cpp's llama4 loads no attention biases")
    n, step = hp.n_layers, moe_step(hp)
    if hp.n_experts <= 0:
        raise ModelFormatError(f"{ARCH} GGUF needs experts (llama.cpp's llama4 refuses a model without), config has "
                               f"num_local_experts={hp.n_experts}")
    moe = [i for i in range(n) if is_moe(hp, i)]
    if hp.get("moe_layers") is not None:
        _expect(hp, "moe_layers", list(hp.get("moe_layers")), moe,
                f"llama.cpp's llama4 puts the MoE on the layers i with (i + 1) % {step} == 0 "
                "(interleave_moe_layer_step)")
    rope_layers = [int((i + 1) % NOPE_EVERY != 0) for i in range(n)]
    # transformers: an unset or empty list is the default, a NoPE layer every `no_rope_layer_interval`
    interval = int(hp.get("no_rope_layer_interval") or NOPE_EVERY)
    given = list(hp.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)])
    _expect(hp, "no_rope_layers", given, rope_layers, f"llama.cpp's llama4 skips the rope on every {NOPE_EVERY}th "
            "layer exactly")
    if hp.get("layer_types") is not None:
        _expect(hp, "layer_types", list(hp.get("layer_types")),
                ["chunked_attention" if r else "full_attention" for r in rope_layers],
                "llama.cpp's llama4 chunks the attention of its rope layers and no other")
    _expect(hp, "attention_chunk_size", hp.get("attention_chunk_size", CHUNK), CHUNK,
            "llama.cpp's llama4 attends in chunks of 8192")
    if not hp.get("attn_temperature_tuning", True):
        raise ModelFormatError(f"{ARCH} with attn_temperature_tuning=false is not supported: llama.cpp's llama4 always "
                               "scales the NoPE layers' queries")
    _expect(hp, "floor_scale", int(hp.get("floor_scale", FLOOR_SCALE)), FLOOR_SCALE,
            "llama.cpp's llama4 tunes the attention temperature with floor_scale 8192")
    if abs(float(hp.get("attn_scale", ATTN_SCALE)) - ATTN_SCALE) > 1e-9:
        _expect(hp, "attn_scale", hp.get("attn_scale"), ATTN_SCALE,
                "llama.cpp's llama4 tunes the attention temperature with attn_scale 0.1")
    _expect(hp, "use_qk_norm", bool(hp.get("use_qk_norm", True)), hp.n_experts != NO_QK_NORM_EXPERTS,
            f"llama.cpp's llama4 L2-normalizes q and k unless the model has {NO_QK_NORM_EXPERTS} experts, this one "
            f"has {hp.n_experts}")


TEXT = Family(
    name="llama4",
    gguf_arch=ARCH,
    architectures=("Llama4ForCausalLM",),
    tensors=EMBEDDINGS + NORMS + attention(q=IDENTITY, k=IDENTITY) + DENSE_MLP + MOE,
    params=VOCAB_AND_ROPE_DIMS + (
        # the dense layers' width; `intermediate_size` is the experts' (llama.cpp's converter swaps them too)
        param(K.FEED_FORWARD_LENGTH, "intermediate_size_mlp", required=True),
        param(K.EXPERT_FEED_FORWARD_LENGTH, "intermediate_size", required=True),
        derived(K.INTERLEAVE_MOE_LAYER_STEP, moe_step),
    ),
    extra_tensors=llama3_rope_freqs,
    ignored=ROTARY_BUFFERS,
    check=_check,
)

# The released vision-language model: the same language model inside the wrapper, the vision side left out.
VLM = dataclasses.replace(TEXT, name="llama4_vlm", architectures=("Llama4ForConditionalGeneration",),
                          renames=VLM_RENAMES, ignored=TEXT.ignored + VISION_TENSORS)

FAMILIES = (TEXT, VLM)  # FAMILIES, not FAMILY: the registry reads FAMILY alone when a module has one
