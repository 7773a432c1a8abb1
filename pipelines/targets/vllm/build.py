"""Writing a prepared vLLM directory from a snapshot (the mechanism; the file policy is in prepare.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from ...core.paths import link_or_copy
from ...core.progress import bar
from ...core.units import parse_size
from ...source.safetensors_io import TensorSource
from .. import BuiltArtifact
from .checkpoint_names import map_checkpoint
from .fp8 import fp8_selection, quantization_config, quantize_rows
from .int_tiers import INT_TIERS, int_tier_tensors
from .prepare import (
    INDEX,
    OutTensor,
    PrepareReport,
    bf16_tensor,
    carry_files,
    check_dtypes,
    normalize_config,
    plan_shards,
    reusable_source_shards,
    row_quantized,
    shard_names,
    tensor_order,
    write_index,
    write_shard,
)

if TYPE_CHECKING:
    from .. import BuildContext

SHARD_METADATA = {"format": "pt"}  # transformers refuses safetensors files without it


def prepare_directory(ctx: BuildContext, out_dir: Path) -> BuiltArtifact:
    snap, opts = ctx.snapshot, ctx.recipe.options
    cfg = ctx.config
    quantize = opts.get("quantization", "none") == "fp8-dynamic"
    int_tier = opts.get("quantization", "none") in INT_TIERS  # W4A16 / INT8: int_tiers.py
    int_info: dict = {}
    max_bytes = parse_size(opts.get("max_shard_size", "5GB"), "max_shard_size")
    names = [f.path for f in snap.files]
    report = PrepareReport()
    with TensorSource(snap.safetensors_files()) as src:
        check_dtypes(src)
        cmap = map_checkpoint(snap.dir, src)
        unknown = cmap.unknown
        known_digests: dict[str, str] = {}
        order = tensor_order(src)
        qcfg = None
        if quantize:
            qset, report.ignored = fp8_selection(cmap, src)
            outs = []
            for name in order:
                if name in qset:
                    outs += _fp8_pair(src, name, report.weight_errors)
                    report.quantized.append(name)
                else:
                    outs.append(bf16_tensor(src, name))
            qcfg = quantization_config(report.ignored)
        elif int_tier:
            outs, qcfg, int_info = int_tier_tensors(ctx, src, cmap, order, out_dir, report)
        else:
            outs = [bf16_tensor(src, n) for n in order]
        weight_map: dict[str, str] = {}
        if not quantize and not int_tier and reusable_source_shards(src, max_bytes):
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
    info.update(int_info)
    return BuiltArtifact(root=out_dir, files=sorted(set(files)), info=info, known_digests=known_digests)


def _fp8_pair(src: TensorSource, name: str, errors: dict[str, float]) -> list[OutTensor]:
    """The e4m3 weight and its per-row scale, quantized a chunk of rows at a time as it is written."""
    return row_quantized(src, name, errors, quantize_rows, "F8_E4M3")
