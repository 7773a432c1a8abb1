"""The vision projectors hive-aot writes as llama.cpp `mmproj` GGUFs (`mmproj.py`), one declaration per projector
type: the tensors of the vision tower and the projector, the `clip.*` keys llama.cpp reads, and the configs it
cannot run (one-line refusals). Names are those of the released checkpoints; `renames` find them where
transformers 5.23 saves them (`vision_tower.*` without `vision_model.`) and in transformers 5's nested layout
(`model.vision_tower.*`, `model.visual.*`, `model.multi_modal_projector.*`).

- LLaVA-1.5 (`mlp`): a CLIP ViT and a two-layer GELU MLP. llama.cpp's `--mmproj` converter does not write it
  (its LLaVA class is Pixtral's); its legacy LLaVA script does. As there: the tower up to the layer whose output
  feeds the projector (`vision_feature_layer`, -2: every layer but the last), no post-layernorm, the position
  embedding in F16. Unlike there, `clip.vision.feature_layer` names that layer (libmtmd otherwise runs one layer
  fewer than `block_count`) and the MLP's fc1 / fc2 are `ffn_up` / `ffn_down` (the legacy names are swapped,
  which libmtmd undoes by shape).
- Gemma 3 (`gemma3`): a SigLIP ViT, then a 4x4 average pool (`projector.scale_factor` when not 4), an RMS norm
  stored as w for 1 + w, and a matrix into the text width.
- Qwen2-VL / Qwen2.5-VL (`qwen2vl_merger` / `qwen2.5vl_merger`): the Conv3D patch embedding split into its two
  time steps, the fused qkv split into q, k, v; Qwen2.5's window attention every `n_wa_pattern` blocks (full
  attention on `fullatt_block_indexes`, which must be evenly spaced).
- Qwen3-VL (`qwen3vl_merger`): the fused qkv kept, learned position embeddings, and DeepStack mergers on
  `deepstack_visual_indexes`, written on the vision block they read (`v.deepstack.<block>`).
"""

from __future__ import annotations

import gguf
import numpy as np

from ...core.errors import ModelFormatError
from .families.spec import IDENTITY, PLUS_ONE, HParams, Rule, T, Transform, derived, param
from .mmproj import C, Projector, Q, V

__all__ = ["PROJECTORS", "projector_for"]


def vt(t: gguf.MODEL_TENSOR, hf: str, transform: Transform = IDENTITY, *, suffix: str | None = "weight",
       bid: int | None = None, optional: bool = False, when=None) -> Rule:
    """One checkpoint tensor -> one projector tensor (`bid`: a fixed index in the name, mm.0 / mm.2)."""
    n = gguf.TENSOR_NAMES[t] if bid is None else gguf.TENSOR_NAMES[t].replace("{bid}", str(bid))
    return Rule((f"{n}.{suffix}" if suffix else n,), (hf,), transform, optional, when)


def vwb(t: gguf.MODEL_TENSOR, hf: str, *, bid: int | None = None, optional: bool = False, when=None) -> tuple[Rule, ...]:
    return (vt(t, hf + ".weight", bid=bid, optional=optional, when=when),
            vt(t, hf + ".bias", suffix="bias", bid=bid, optional=optional, when=when))


def _thirds(s, hp):
    if s[0][0] % 3:
        raise ModelFormatError(f"a fused qkv of {s[0][0]} rows cannot be split in three")
    return [(s[0][0] // 3, *s[0][1:])] * 3


SPLIT_QKV = Transform("split_qkv", lambda xs, hp: [np.ascontiguousarray(x) for x in np.split(xs[0], 3)], _thirds)


def _time_steps(s, hp):
    if len(s[0]) != 5 or s[0][2] != 2:
        raise ModelFormatError(f"a Conv3D patch embedding {list(s[0])} without two time steps")
    return [(s[0][0], s[0][1], s[0][3], s[0][4])] * 2


# Conv3D [out, in, time 2, p, p] -> two Conv2D [out, in, p, p], one per time step (`v.patch_embd.weight(.1)`)
SPLIT_TIME = Transform("split_time", lambda xs, hp: [np.ascontiguousarray(xs[0][:, :, t]) for t in (0, 1)], _time_steps)
PATCH_PAIR = (gguf.TENSOR_NAMES[T.V_ENC_EMBD_PATCH] + ".weight", gguf.TENSOR_NAMES[T.V_ENC_EMBD_PATCH] + ".weight.1")

# --- CLIP / SigLIP towers (LLaVA, Gemma 3) ------------------------------------------------------------------------

TOWER = "vision_tower.vision_model."
PROJ = "multi_modal_projector."
TOWER_RENAMES = ((TOWER, "vision_tower."), (TOWER, "model.vision_tower.vision_model."), (TOWER, "model.vision_tower."),
                 (PROJ, "model." + PROJ))
TOWER_BLOCK = r"(?:model\.)?vision_tower\.(?:vision_model\.)?encoder\.layers\.(\d+)\..+"


def vit_block(prefix: str = TOWER + "encoder.layers.{bid}.") -> tuple[Rule, ...]:
    """A CLIP / SigLIP encoder layer: pre-norm attention with biases, a two-layer MLP (fc1 up, fc2 down)."""
    a = prefix + "self_attn."
    return (vwb(T.V_ENC_ATTN_Q, a + "q_proj") + vwb(T.V_ENC_ATTN_K, a + "k_proj") + vwb(T.V_ENC_ATTN_V, a + "v_proj")
            + vwb(T.V_ENC_ATTN_O, a + "out_proj") + vwb(T.V_ENC_INPUT_NORM, prefix + "layer_norm1")
            + vwb(T.V_ENC_POST_ATTN_NORM, prefix + "layer_norm2") + vwb(T.V_ENC_FFN_UP, prefix + "mlp.fc1")
            + vwb(T.V_ENC_FFN_DOWN, prefix + "mlp.fc2"))


def feature_depth(hp: HParams) -> int:
    """Vision blocks up to the one whose output feeds LLaVA's projector (-2: all but the last)."""
    layer, n = hp.get("_outer").get("vision_feature_layer", -2), int(hp.require("num_hidden_layers"))
    if not isinstance(layer, int) or not -n - 1 <= layer <= n:
        raise ModelFormatError(f"LLaVA projector GGUF needs one vision_feature_layer within the {n} layers, config has "
                               f"{layer!r}")
    return layer if layer >= 0 else n + layer + 1


def _check_llava(hp: HParams) -> None:
    outer = hp.get("_outer")
    if hp.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ModelFormatError(f"LLaVA projector GGUF with a {hp.get('model_type')!r} vision tower is not supported: "
                               "llama.cpp's llava graph runs a CLIP ViT")
    if outer.get("vision_feature_select_strategy", "default") != "default":
        raise ModelFormatError("LLaVA projector GGUF needs vision_feature_select_strategy 'default': llama.cpp's "
                               "llava graph always drops the class token")
    if outer.get("multimodal_projector_bias") is False:
        raise ModelFormatError("LLaVA projector GGUF needs the projector's biases: llama.cpp's mlp adds them")
    feature_depth(hp)


LLAVA = Projector(
    name="llava",
    architectures=("LlavaForConditionalGeneration",),
    tensors=(
        vt(T.V_ENC_EMBD_CLS, TOWER + "embeddings.class_embedding", suffix=None),
        vt(T.V_ENC_EMBD_PATCH, TOWER + "embeddings.patch_embedding.weight"),
        vt(T.V_ENC_EMBD_POS, TOWER + "embeddings.position_embedding.weight"),
        *vwb(T.V_PRE_NORM, TOWER + "pre_layrnorm"),
        *vit_block(),
        *vwb(T.V_MMPROJ, PROJ + "linear_1", bid=0),
        *vwb(T.V_MMPROJ, PROJ + "linear_2", bid=2),
    ),
    params=(
        derived(C.HAS_LLAVA_PROJECTOR, lambda hp: True, kind=bool),
        derived(C.PROJECTOR_TYPE, lambda hp: "mlp", kind=str),
        param(V.Attention.LAYERNORM_EPS, "layer_norm_eps", kind=float),
        derived("clip.vision.feature_layer", lambda hp: [feature_depth(hp)], kind=list),
        derived(V.USE_GELU, lambda hp: hp.get("hidden_act", "quick_gelu") == "gelu", kind=bool),
    ),
    vision=(TOWER, PROJ),
    renames=TOWER_RENAMES,
    blocks=feature_depth,
    types=((r"v\.position_embd\.weight", Q.F16),),  # the legacy script keeps every 2-D weight in F16
    ignored=(r"(?:model\.)?vision_tower\.(?:vision_model\.)?post_layernorm\..+",),  # after the feature layer
    deeper=TOWER_BLOCK,
    check=_check_llava,
    divergence=("llama.cpp 0.3.36's llava graph appends the class token after the patches (positions 0..n) and "
                "keeps rows 1..n, so its image embeddings are not LLaVA-1.5's: transformers' with the class token "
                "moved last give the same numbers (cosine 0.999999 on the test model)"),
)


def _gemma3_scale(hp: HParams) -> int | None:
    """Patches per side over tokens per side (llama.cpp's default 4 is not written)."""
    per_side = int(int(hp.get("_pre").get("image_seq_length", 256)) ** 0.5)
    factor = (int(hp.require("image_size")) // int(hp.require("patch_size"))) // per_side
    return factor if factor > 0 and factor != 4 else None


def _check_gemma3(hp: HParams) -> None:
    if hp.get("model_type", "siglip_vision_model") != "siglip_vision_model":
        raise ModelFormatError(f"gemma3 projector GGUF with a {hp.get('model_type')!r} vision tower is not supported")
    tokens = hp.get("_outer").get("mm_tokens_per_image", 256)
    if int(hp.get("_pre").get("image_seq_length", 256)) != tokens:
        raise ModelFormatError(f"gemma3 projector GGUF: the image processor's image_seq_length differs from "
                               f"mm_tokens_per_image ({tokens}), which llama.cpp's pooling is sized by")


GEMMA3 = Projector(
    name="gemma3",
    architectures=("Gemma3ForConditionalGeneration",),
    tensors=(
        *vwb(T.V_ENC_EMBD_PATCH, TOWER + "embeddings.patch_embedding"),
        vt(T.V_ENC_EMBD_POS, TOWER + "embeddings.position_embedding.weight"),
        *vit_block(),
        *vwb(T.V_POST_NORM, TOWER + "post_layernorm"),
        vt(T.V_MM_INP_PROJ, PROJ + "mm_input_projection_weight"),
        vt(T.V_MM_SOFT_EMB_NORM, PROJ + "mm_soft_emb_norm.weight", PLUS_ONE),  # Gemma's RMS norm scales by 1 + w
    ),
    params=(
        derived(C.PROJECTOR_TYPE, lambda hp: gguf.VisionProjectorType.GEMMA3, kind=str),
        derived(V.Attention.LAYERNORM_EPS, lambda hp: hp.get("layer_norm_eps", 1e-6), kind=float),
        derived(V.USE_GELU, lambda hp: True, kind=bool),
        derived(V.Projector.SCALE_FACTOR, _gemma3_scale),
    ),
    vision=(TOWER, PROJ),
    renames=TOWER_RENAMES,
    # llama.cpp's converter keeps the tower's embeddings in F32
    types=((r"v\.(patch_embd|position_embd)\.weight", Q.F32),),
    ignored=(r"(?:model\.)?vision_tower\.(?:vision_model\.)?head\..+",),  # SigLIP's pooling head: unused by Gemma 3
    check=_check_gemma3,
)

# --- Qwen-VL towers ------------------------------------------------------------------------------------------------

QV = "visual."
QV_BLOCK = QV + "blocks.{bid}."


def qwen_block(mlp: tuple[Rule, ...], *, split: bool = True) -> tuple[Rule, ...]:
    a = QV_BLOCK + "attn."
    if split:  # q, k, v of llama.cpp's Qwen2(.5)-VL graph
        qkv = (Rule(tuple(gguf.TENSOR_NAMES[t] + ".weight" for t in (T.V_ENC_ATTN_Q, T.V_ENC_ATTN_K, T.V_ENC_ATTN_V)),
                    (a + "qkv.weight",), SPLIT_QKV),
               Rule(tuple(gguf.TENSOR_NAMES[t] + ".bias" for t in (T.V_ENC_ATTN_Q, T.V_ENC_ATTN_K, T.V_ENC_ATTN_V)),
                    (a + "qkv.bias",), SPLIT_QKV))
    else:
        qkv = vwb(T.V_ENC_ATTN_QKV, a + "qkv")
    norms = (vt(T.V_ENC_INPUT_NORM, QV_BLOCK + "norm1.weight"),
             vt(T.V_ENC_INPUT_NORM, QV_BLOCK + "norm1.bias", suffix="bias", optional=True),
             vt(T.V_ENC_POST_ATTN_NORM, QV_BLOCK + "norm2.weight"),
             vt(T.V_ENC_POST_ATTN_NORM, QV_BLOCK + "norm2.bias", suffix="bias", optional=True))
    return qkv + vwb(T.V_ENC_ATTN_O, a + "proj") + norms + mlp


def _check_qwen(hp: HParams) -> None:
    if int(hp.get("temporal_patch_size", 2)) != 2:
        raise ModelFormatError(f"Qwen-VL projector GGUF needs temporal_patch_size 2 (llama.cpp's two Conv2D time steps), "
                               f"config has {hp.get('temporal_patch_size')}")


def wa_pattern(hp: HParams) -> int:
    """Qwen2.5-VL's window-attention period: full attention on every n-th block (the last of each period)."""
    full = list(hp.get("fullatt_block_indexes") or [])
    if not full or any(b - a != full[0] + 1 for a, b in zip(full, full[1:])):
        raise ModelFormatError(f"qwen2.5vl projector GGUF needs evenly spaced fullatt_block_indexes (llama.cpp's "
                               f"n_wa_pattern), config has {full}")
    return full[0] + 1


def qwen_probe(hp: HParams) -> int:
    """4 x 4 merged patches: above llama.cpp's minimum of 8 image tokens, which it would upscale to."""
    return 4 * int(hp.require("patch_size")) * int(hp.get("spatial_merge_size", 2))


def _check_qwen2_5(hp: HParams) -> None:
    _check_qwen(hp)
    wa_pattern(hp)


QWEN_COMMON_PARAMS = (
    derived(V.IMAGE_SIZE, lambda hp: hp.get("image_size", 560)),
    derived(V.Attention.LAYERNORM_EPS, lambda hp: hp.get("_outer").get("rms_norm_eps", 1e-6), kind=float),
)
QWEN_MERGER = (vt(T.V_POST_NORM, QV + "merger.ln_q.weight"),
               vt(T.V_POST_NORM, QV + "merger.ln_q.bias", suffix="bias", optional=True),
               *vwb(T.V_MMPROJ, QV + "merger.mlp.0", bid=0), *vwb(T.V_MMPROJ, QV + "merger.mlp.2", bid=2))

QWEN2_5_VL = Projector(
    name="qwen2.5vl",
    architectures=("Qwen2_5_VLForConditionalGeneration",),
    tensors=(Rule(PATCH_PAIR, (QV + "patch_embed.proj.weight",), SPLIT_TIME),
             *qwen_block(vwb(T.V_ENC_FFN_GATE, QV_BLOCK + "mlp.gate_proj") + vwb(T.V_ENC_FFN_UP, QV_BLOCK + "mlp.up_proj")
                         + vwb(T.V_ENC_FFN_DOWN, QV_BLOCK + "mlp.down_proj")),
             *QWEN_MERGER),
    params=QWEN_COMMON_PARAMS + (
        derived(C.PROJECTOR_TYPE, lambda hp: gguf.VisionProjectorType.QWEN25VL, kind=str),
        derived(V.USE_SILU, lambda hp: True, kind=bool),
        derived(V.N_WA_PATTERN, wa_pattern),
    ),
    vision=(QV,),
    renames=((QV, "model." + QV),),
    blocks=lambda hp: int(hp.require("depth")),
    check=_check_qwen2_5,
    probe=qwen_probe,
    patches=True,
)

QWEN2_VL = Projector(
    name="qwen2vl",
    architectures=("Qwen2VLForConditionalGeneration",),
    tensors=(Rule(PATCH_PAIR, (QV + "patch_embed.proj.weight",), SPLIT_TIME),
             *qwen_block(vwb(T.V_ENC_FFN_UP, QV_BLOCK + "mlp.fc1") + vwb(T.V_ENC_FFN_DOWN, QV_BLOCK + "mlp.fc2")),
             *QWEN_MERGER),
    params=QWEN_COMMON_PARAMS + (
        derived(C.PROJECTOR_TYPE, lambda hp: gguf.VisionProjectorType.QWEN2VL, kind=str),
        # Qwen2-VL's config: embed_dim is the tower's width, hidden_size the merger's output
        param(V.EMBEDDING_LENGTH, "embed_dim", required=True),
        param(V.FEED_FORWARD_LENGTH, "hidden_size", required=True),
    ),
    vision=(QV,),
    renames=((QV, "model." + QV),),
    blocks=lambda hp: int(hp.require("depth")),
    check=_check_qwen,
    probe=qwen_probe,
    patches=True,
)

Q3 = "model.visual."
Q3_BLOCK = Q3 + "blocks.{bid}."


def deepstack_levels(hp: HParams) -> list[int]:
    return [int(i) for i in hp.get("deepstack_visual_indexes") or ()]


def _q3_image_size(hp: HParams) -> int:
    """The size whose patches match the learned position grid, as llama.cpp's converter derives it."""
    grid = int(hp.get("num_position_embeddings", 2304)) ** 0.5
    return int(hp.get("image_size") or int(grid * int(hp.get("patch_size", 16))))


def _in_deepstack(hp: HParams, bid: int) -> bool:
    return bid in deepstack_levels(hp)


QWEN3_VL = Projector(
    name="qwen3vl",
    architectures=("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"),
    tensors=(Rule(PATCH_PAIR, (Q3 + "patch_embed.proj.weight",), SPLIT_TIME),
             vt(T.V_ENC_EMBD_PATCH, Q3 + "patch_embed.proj.bias", suffix="bias"),
             vt(T.V_ENC_EMBD_POS, Q3 + "pos_embed.weight"),
             *vwb(T.V_ENC_ATTN_QKV, Q3_BLOCK + "attn.qkv"), *vwb(T.V_ENC_ATTN_O, Q3_BLOCK + "attn.proj"),
             *vwb(T.V_ENC_INPUT_NORM, Q3_BLOCK + "norm1"), *vwb(T.V_ENC_POST_ATTN_NORM, Q3_BLOCK + "norm2"),
             *vwb(T.V_ENC_FFN_UP, Q3_BLOCK + "mlp.linear_fc1"), *vwb(T.V_ENC_FFN_DOWN, Q3_BLOCK + "mlp.linear_fc2"),
             *vwb(T.V_DS_NORM, Q3 + "deepstack_merger_list.{level}.norm", when=_in_deepstack),
             *vwb(T.V_DS_FC1, Q3 + "deepstack_merger_list.{level}.linear_fc1", when=_in_deepstack),
             *vwb(T.V_DS_FC2, Q3 + "deepstack_merger_list.{level}.linear_fc2", when=_in_deepstack),
             *vwb(T.V_POST_NORM, Q3 + "merger.norm"),
             *vwb(T.V_MMPROJ, Q3 + "merger.linear_fc1", bid=0), *vwb(T.V_MMPROJ, Q3 + "merger.linear_fc2", bid=2)),
    params=(
        derived(V.IMAGE_SIZE, _q3_image_size),
        derived(C.PROJECTOR_TYPE, lambda hp: gguf.VisionProjectorType.QWEN3VL, kind=str),
        derived(V.USE_GELU, lambda hp: True, kind=bool),
        param(V.SPATIAL_MERGE_SIZE, "spatial_merge_size"),
        derived(V.Attention.LAYERNORM_EPS, lambda hp: hp.get("_text").get("rms_norm_eps", 1e-6), kind=float),
        derived(V.IS_DEEPSTACK_LAYERS, lambda hp: [b in deepstack_levels(hp) for b in range(int(hp.require("depth")))]
                or None, kind=list),
    ),
    vision=(Q3,),
    renames=((Q3, QV),),
    blocks=lambda hp: int(hp.require("depth")),
    levels=deepstack_levels,
    check=_check_qwen,
    probe=_q3_image_size,  # the learned position grid, not interpolated
    patches=True,
)

PROJECTORS = (LLAVA, GEMMA3, QWEN2_5_VL, QWEN2_VL, QWEN3_VL)
_BY_ARCHITECTURE = {a: p for p in PROJECTORS for a in p.architectures}


def projector_for(architecture: str | None) -> Projector | None:
    """The projector llama.cpp pairs with this vision-language architecture's language model, if hive-aot writes it."""
    return _BY_ARCHITECTURE.get(architecture or "")


def write_projector(snapshot, out_dir, provenance: dict[str, str]) -> dict | None:
    """The snapshot's projector GGUF next to its language model, when its architecture has one: what the manifest
    records of it, with how it is validated (or why it is not)."""
    from ...core import meter
    from .mmproj import convert_mmproj, mmproj_name
    from .mmproj_check import mtmd_available

    cfg = snapshot.config()
    projector = projector_for((cfg.get("architectures") or [None])[0])
    if projector is None:
        return None
    with meter.step("mmproj"):
        info = convert_mmproj(projector, snapshot.dir, cfg, snapshot.safetensors_files(),
                              out_dir / mmproj_name(snapshot.model_id), name=snapshot.model_id, provenance=provenance)
    why = projector.divergence or mtmd_available()
    info["validation"] = (f"projector not validated: {why}" if why else
                          "image embeddings of libmtmd against transformers' (validation details: projector)")
    return info
