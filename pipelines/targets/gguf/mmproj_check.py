"""Validate a projector GGUF: one synthetic image through llama.cpp's multimodal library (libmtmd, as
llama-cpp-python ships it) against transformers' `get_image_features` on the same pixels.

The image is square, at the size the projector's llama.cpp preprocessing leaves it (`Projector.probe`: the tower's
image size, or 4 x 4 merged patches for Qwen-VL), so both sides see the same pixels; the normalization is the
image processor's mean and std, which both apply as (x / 255 - mean) / std. llama.cpp encodes the image as a
prompt's image chunk (`mtmd_encode_chunk`) with the language model GGUF it pairs with; transformers runs the
vision tower and projector of the streamed reference model (`streamed_model`: the checkpoint's names under any
layout, the vision units loaded for the call). Qwen3-VL's rows are the merger's output followed by each DeepStack
level's, as llama.cpp lays them out. Reported: per-token cosine (min, mean) and max |delta| against the
reference's scale; gated at MIN_COSINE unless the projector declares why llama.cpp's graph differs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ...source.fetch import Snapshot
    from .mmproj import Projector

MIN_COSINE = 0.99  # per image token, f16 projector weights against the fp32 reference (measured >= 0.99999)
VISION_UNITS = ("model.visual", "model.vision_tower", "model.multi_modal_projector")  # transformers 5 module names


def synthetic_image(side: int) -> np.ndarray:
    """[side, side, 3] uint8: gradients and a texture, so every patch differs (a wrong patch order shows)."""
    y, x = np.mgrid[0:side, 0:side]
    return np.stack([x * 255 // max(1, side - 1), y * 255 // max(1, side - 1), (x * 7 + y * 13) * 37 % 256],
                    -1).astype(np.uint8)


def pixel_inputs(projector: Projector, hp, image: np.ndarray) -> dict[str, np.ndarray]:
    """transformers' inputs for `image`: normalized [1, 3, H, W], or Qwen-VL's patch rows (the frame repeated over
    the temporal patch, each merge window's patches together) with their grid."""
    from .mmproj import image_stat

    mean, std = (np.asarray(image_stat(k)(hp), np.float32) for k in ("image_mean", "image_std"))
    x = ((image.astype(np.float32) / np.float32(255.0) - mean) / std).transpose(2, 0, 1)
    if not projector.patches:
        return {"pixel_values": np.ascontiguousarray(x[None])}
    p, m, tp = int(hp.require("patch_size")), int(hp.get("spatial_merge_size", 2)), int(hp.get("temporal_patch_size", 2))
    c, h, w = x.shape
    gh, gw = h // p, w // p
    rows = np.stack([x] * tp).reshape(1, tp, c, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return {"pixel_values": np.ascontiguousarray(rows.reshape(gh * gw, c * tp * p * p)),
            "image_grid_thw": np.asarray([[1, gh, gw]], dtype=np.int64)}


def image_features(model_dir: str, files: list[str], inputs: str, out: str) -> dict[str, Any]:
    """transformers' side, in a child (torch): the VLM's image features on the saved inputs -> `out` (.npy)."""
    import json

    import torch

    from ...model.streamed_model import StreamedCausalLM

    arrays = dict(np.load(inputs))
    kwargs: dict[str, Any] = {k: torch.from_numpy(v) for k, v in arrays.items()}
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if "vision_feature_layer" in cfg or cfg.get("model_type") == "llava":  # LLaVA reads them from its call
        kwargs.update(vision_feature_layer=cfg.get("vision_feature_layer", -2),
                      vision_feature_select_strategy=cfg.get("vision_feature_select_strategy", "default"))
    with StreamedCausalLM(Path(model_dir), [Path(f) for f in files]) as lm:
        vision = [module for name, module, _ in lm.units if name.startswith(VISION_UNITS)]
        with lm.loaded(*vision), torch.inference_mode():
            result = lm.model.get_image_features(**kwargs)
    rows = [_rows(result.pooler_output)] + [_rows(level) for level in getattr(result, "deepstack_features", None) or []]
    np.save(out, torch.cat(rows, -1).float().numpy())
    return {"tokens": int(rows[0].shape[0])}


def _rows(features):
    import torch

    if isinstance(features, (list, tuple)):
        return torch.cat([f.reshape(-1, f.shape[-1]) for f in features], 0)
    return features.reshape(-1, features.shape[-1])


def run_mtmd(model_path: str, mmproj_path: str, image: str, out: str) -> dict[str, Any]:
    """llama.cpp's side, in a child: the image's embeddings from libmtmd -> `out` (.npy [tokens, width])."""
    import ctypes

    import llama_cpp
    import llama_cpp.mtmd_cpp as mtmd

    from .llama_log import _KEEP, capture_errors, reason

    errors = capture_errors()
    mtmd.mtmd_log_set(_KEEP[0], ctypes.c_void_p(0))  # libmtmd's errors into the same list
    pixels = np.ascontiguousarray(np.load(image))
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), llama_cpp.llama_model_default_params())
    if not model:
        raise ValueError(f"llama.cpp cannot load {Path(model_path).name}: {reason(errors)}")
    ctx = bitmap = chunks = None
    try:
        params = mtmd.mtmd_context_params_default()
        params.use_gpu, params.warmup, params.print_timings, params.n_threads = False, False, False, 1
        ctx = mtmd.mtmd_init_from_file(mmproj_path.encode(), model, params)
        if not ctx:
            raise ValueError(f"libmtmd cannot load {Path(mmproj_path).name}: {reason(errors)}")
        h, w = pixels.shape[:2]
        bitmap = mtmd.mtmd_bitmap_init(w, h, pixels.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))
        chunks = mtmd.mtmd_input_chunks_init()
        text = mtmd.mtmd_input_text()
        text.text = mtmd.mtmd_default_marker()
        text.text_len, text.add_special, text.parse_special = len(text.text), False, True
        if mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) != 0:
            raise ValueError(f"libmtmd could not tokenize the image: {reason(errors)}")
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            if mtmd.mtmd_input_chunk_get_type(chunk) != mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                continue
            n, width = mtmd.mtmd_input_chunk_get_n_tokens(chunk), llama_cpp.llama_model_n_embd_inp(model)
            if mtmd.mtmd_encode_chunk(ctx, chunk) != 0:
                raise ValueError(f"libmtmd could not encode the image: {reason(errors)}")
            embd = np.ctypeslib.as_array(mtmd.mtmd_get_output_embd(ctx), shape=(n * width,))
            np.save(out, embd.reshape(n, width).copy())
            return {"tokens": int(n), "width": int(width)}
        raise ValueError("libmtmd made no image chunk of the test image")
    finally:
        for free, handle in ((mtmd.mtmd_input_chunks_free, chunks), (mtmd.mtmd_bitmap_free, bitmap),
                             (mtmd.mtmd_free, ctx)):
            if handle:
                free(handle)
        llama_cpp.llama_model_free(model)


def mtmd_available() -> str | None:
    """Why libmtmd cannot validate a projector here, or None when it can."""
    import importlib

    try:
        importlib.import_module("llama_cpp.mtmd_cpp")  # loads libmtmd
    except (ImportError, OSError) as e:
        return f"llama-cpp-python ships no usable libmtmd ({type(e).__name__}: {e})"
    return None


def validate_mmproj(snapshot: Snapshot, model_gguf: Path, mmproj_gguf: Path, projector: Projector,
                    step: str) -> tuple[list[str], dict[str, Any]]:
    """(failures, details) of the projector against transformers' image features on one synthetic image."""
    from ...core.paths import work_dir
    from ...process.isolation import run_isolated
    from .mmproj import projector_hparams

    hp = projector_hparams(projector, snapshot.config(), snapshot.dir)
    side = int(projector.probe(hp))
    details: dict[str, Any] = {"reference": "transformers get_image_features, fp32", "engine": "libmtmd",
                               "image": f"synthetic {side}x{side} RGB"}
    with work_dir("mmproj-check-") as tmp:
        image = synthetic_image(side)
        np.save(tmp / "image.npy", image)
        np.savez(tmp / "inputs.npz", **pixel_inputs(projector, hp, image))
        run_isolated(image_features, engine="transformers", needs_torch=True,
                     step=f"{step}: transformers' image features", model_dir=str(snapshot.dir),
                     files=[str(f) for f in snapshot.safetensors_files()], inputs=str(tmp / "inputs.npz"),
                     out=str(tmp / "reference.npy"))
        run_isolated(run_mtmd, engine="llama.cpp", step=f"{step}: libmtmd",
                     model_path=str(model_gguf), mmproj_path=str(mmproj_gguf), image=str(tmp / "image.npy"),
                     out=str(tmp / "mtmd.npy"))
        ref, got = np.load(tmp / "reference.npy"), np.load(tmp / "mtmd.npy")
    if ref.shape != got.shape:
        details["shapes"] = {"transformers": list(ref.shape), "llama_cpp": list(got.shape)}
        return [f"projector: llama.cpp made {got.shape[0]} image tokens of width {got.shape[1]}, transformers "
                f"{ref.shape[0]} of {ref.shape[1]}"], details
    norms = np.linalg.norm(ref, axis=-1) * np.linalg.norm(got, axis=-1)
    cos = (ref * got).sum(-1) / np.maximum(norms, np.finfo(np.float32).tiny)
    details.update(tokens=int(ref.shape[0]), width=int(ref.shape[1]), cosine_min=round(float(cos.min()), 6),
                   cosine_mean=round(float(cos.mean()), 6), max_abs_delta=round(float(np.abs(ref - got).max()), 6),
                   reference_max_abs=round(float(np.abs(ref).max()), 6), finite=bool(np.isfinite(got).all()))
    if projector.divergence:
        details["not_gated"] = projector.divergence
        return [], details
    if not details["finite"] or details["cosine_min"] < MIN_COSINE:
        return [f"projector: image embeddings cosine {details['cosine_min']} < {MIN_COSINE} against transformers"], details
    return [], details


def check_projector(projector: Projector | None, snapshot: Snapshot, model_gguf: Path, mmproj_gguf: Path,
                    step: str) -> tuple[list[str], dict[str, Any]]:
    """The projector of a build's files checked (failures, details), or the reason it cannot be."""
    if projector is None:
        return [f"{mmproj_gguf.name} is published but {snapshot.model_id}'s architecture has no projector"], {}
    why = mtmd_available()
    if why:
        return [], {"not_validated": why}
    return validate_mmproj(snapshot, model_gguf, mmproj_gguf, projector, step)
