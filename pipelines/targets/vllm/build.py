"""Writing a prepared vLLM directory from a snapshot (the mechanism; the file policy is in prepare.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ...errors import ModelFormatError
from ...paths import link_or_copy
from ...progress import bar
from ...safetensors_io import TensorSource
from ...units import parse_size
from .. import BuiltArtifact
from .fp8 import linear_layers, quantization_config, quantize_rows
from .prepare import (INDEX, OutTensor, PrepareReport, bf16_tensor, carry_files, check_dtypes, check_finite,
                      normalize_config, plan_shards, reusable_source_shards, row_chunks, shard_names,
                      tensor_order, write_index, write_shard)

if TYPE_CHECKING:
    from .. import BuildContext

SHARD_METADATA = {"format": "pt"}  # transformers refuses safetensors files without it


def meta_model(config_dir: Path):
    """The transformers class built from config.json on the meta device: shapes and module types, nothing
    allocated whatever the model's size."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ...quiet import quiet_transformers

    quiet_transformers()
    try:
        cfg = AutoConfig.from_pretrained(str(config_dir), trust_remote_code=False, local_files_only=True)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(cfg, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - a config transformers cannot build is malformed input
        raise ModelFormatError(f"transformers cannot build the model from config.json: {type(e).__name__}: {e}") from None


def expected_shapes(model) -> tuple[dict[str, tuple[int, ...]], list[set[str]], str]:
    """Parameter shapes of a (meta) model, groups of tied names (one stored copy suffices), and the class's
    base-model prefix."""
    groups: dict[int, set[str]] = {}
    shapes = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), set()).add(name)
        shapes[name] = tuple(p.shape)
    return shapes, [g for g in groups.values() if len(g) > 1], getattr(model, "base_model_prefix", "")


def check_weights_match_config(src: TensorSource, model) -> list[str]:
    """Refuse weights whose shapes do not match config.json, or that lack parameters the model needs
    (vLLM would fail at load time on the serving host, or worse, load garbage). Returns checkpoint
    tensors the model class does not know (reported, not refused: e.g. rotary caches)."""
    shapes, tied, prefix = expected_shapes(model)
    have = {n: src.info(n).shape for n in src.names()}
    # Checkpoints saved from the base model (no "model." prefix) name the same parameters.
    if prefix and not any(n in shapes for n in have):
        have = {(f"{prefix}.{n}" if f"{prefix}.{n}" in shapes else n): s for n, s in have.items()}
    for name, shape in have.items():
        if name in shapes and tuple(shape) != shapes[name]:
            raise ModelFormatError(f"weights do not match config.json: {name} has shape {list(shape)}, "
                                   f"the config implies {list(shapes[name])}")
    tied_names = {n for g in tied for n in g}
    missing = [n for n in shapes if n not in have
               and not (n in tied_names and any(m in have for g in tied if n in g for m in g))]
    # Legacy names transformers renames at load time (GPT-NeoX's embed_out -> lm_head, ...): a missing
    # parameter is present under another name when an unknown checkpoint tensor has its exact shape.
    spare = [have[n] for n in have if n not in shapes]
    for n in list(missing):
        if shapes[n] in spare:
            spare.remove(shapes[n])
            missing.remove(n)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelFormatError(f"weights lack parameters the config requires: {', '.join(missing[:3])}{more}")
    return sorted(n for n in have if n not in shapes)


def prepare_directory(ctx: "BuildContext", out_dir: Path) -> BuiltArtifact:
    snap, opts = ctx.snapshot, ctx.recipe.options
    cfg = ctx.config
    quantize = opts.get("quantization", "none") == "fp8-dynamic"
    max_bytes = parse_size(opts.get("max_shard_size", "5GB"), "max_shard_size")
    names = [f.path for f in snap.files]
    report = PrepareReport()
    with TensorSource(snap.safetensors_files()) as src:
        check_dtypes(src)
        model = meta_model(snap.dir)
        unknown = check_weights_match_config(src, model)
        known_digests: dict[str, str] = {}
        order = tensor_order(src)
        qcfg = None
        if quantize:
            quantized, kept = linear_layers(model)
            qset = {f"{m}.weight" for m in quantized}
            outs = []
            for name in order:
                if name in qset and len(src.info(name).shape) == 2:
                    outs += _fp8_pair(src, name, report.weight_errors)
                    report.quantized.append(name)
                else:
                    outs.append(bf16_tensor(src, name))
            report.ignored = sorted(set(kept) | {"lm_head"})
            qcfg = quantization_config(report.ignored)
        else:
            outs = [bf16_tensor(src, n) for n in order]
        weight_map: dict[str, str] = {}
        if not quantize and reusable_source_shards(src, max_bytes):
            # bf16 already: the source's shards are carried byte for byte, with the snapshot's digests.
            by_path = {f.path: f for f in snap.files}
            for t in outs:  # carried unchanged, but never with NaN/Inf in it: read once, a chunk at a time
                if t.dtype == "BF16":
                    for _part in t.chunks():
                        pass
            for f in src.files:
                rel = f.path.relative_to(snap.dir).as_posix() if f.path.is_relative_to(snap.dir) else f.path.name
                link_or_copy(f.path, out_dir / f.path.name)
                if rel in by_path:
                    known_digests[f.path.name] = by_path[rel].sha256
                report.shards.append(f.path.name)
                report.reused_shards.append(f.path.name)
                weight_map.update({n: f.path.name for n in f.header.tensors})
            total = sum(src.info(n).nbytes for n in order)
        else:
            planned = plan_shards(outs, max_bytes)
            total = sum(t.nbytes for t in outs)
            with bar(total, f"write {ctx.recipe.id}") as pb:
                for shard_name, tensors in zip(shard_names(len(planned)), planned):
                    write_shard(out_dir / shard_name, tensors, src, SHARD_METADATA)
                    report.shards.append(shard_name)
                    weight_map.update({t.name: shard_name for t in tensors})
                    pb.update(sum(t.nbytes for t in tensors))
        report.tensors = len(weight_map)
        for name in order:
            dt = src.info(name).dtype
            report.converted_dtypes[dt] = report.converted_dtypes.get(dt, 0) + 1
    write_index(out_dir, weight_map, total)
    files = carry_files(snap.dir, names, out_dir, normalize_config(cfg, "bfloat16", qcfg))
    files += report.shards + [INDEX]
    for f in files:
        if (out_dir / f).stat().st_mode & 0o777 != 0o644:  # never on a link to the source (already 0644)
            os.chmod(out_dir / f, 0o644)
    info = {"shards": report.shards, "reused_source_shards": report.reused_shards, "tensors": report.tensors,
            "source_dtypes": report.converted_dtypes, "dtype": "bfloat16", "max_shard_bytes": max_bytes,
            "unknown_tensors": unknown[:20]}
    if quantize:
        errs = report.weight_errors
        info.update(quantization="fp8-dynamic (compressed-tensors W8A8, per-channel weight scales, per-token activations)",
                    quantized_tensors=len(report.quantized), ignored_layers=report.ignored,
                    max_weight_rel_error=float(f"{max(errs.values(), default=0.0):.6g}"))
    return BuiltArtifact(root=out_dir, files=sorted(set(files)), info=info, known_digests=known_digests)


def _fp8_pair(src: TensorSource, name: str, errors: dict[str, float]) -> list[OutTensor]:
    """The e4m3 weight and its per-row scale: the weight quantized a chunk of rows at a time as it is written,
    the scales gathered meanwhile and written after it."""
    info = src.info(name)
    rows, cols = info.shape
    scales: list = []

    def weight():
        err = norm = 0.0
        for lo, hi in row_chunks(src, name):
            data = src.rows(name, lo, hi)
            check_finite(name, data)
            q, scale, e, n = quantize_rows(data)
            scales.append(scale)
            err, norm = err + e, norm + n
            yield q
            src.release(name)
        errors[name] = (err / norm) ** 0.5 if norm > 0 else 0.0

    def scale():
        yield np.concatenate(scales, axis=0) if scales else np.zeros((0, 1), dtype=np.float32)
        scales.clear()

    prefix = name[: -len(".weight")]
    return [OutTensor(name, "F8_E4M3", (rows, cols), rows * cols, weight, source=name),
            OutTensor(f"{prefix}.weight_scale", "F32", (rows, 1), rows * 4, scale)]
