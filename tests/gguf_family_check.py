"""What every GGUF family test asserts (issue 11's bar), shared by the per-family test modules.

A tiny random model of the family (2 layers, hidden >= 64, the SmolLM2 BPE tokenizer unless the case
brings its own) is converted to f16 and q8_0, each file is loaded in llama.cpp and compared with the
transformers fp32 reference on the same token ids (`validate_gguf`), and the tensor types in the file
are read back with GGUFReader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf

from gguf_reader import FastGGUFReader
from pipelines.sources import fetch
from pipelines.targets.gguf.convert import ALWAYS_F32, convert
from pipelines.targets.gguf.validate import validate_gguf

Q = gguf.GGMLQuantizationType


def convert_and_validate(model_dir: Path, out: Path, outtype: str, options: dict[str, Any] | None = None):
    snap = fetch(str(model_dir), f"test/{model_dir.name}")
    report = convert(snap.dir, snap.config(), snap.safetensors_files(), out, outtype, name=snap.model_id,
                     options=options)
    metrics, details = validate_gguf(snap, out)
    print(f"{model_dir.name} {outtype}: {metrics}")
    return report, metrics, details


def check_family(model_dir: Path, tmp_path: Path, gguf_arch: str, *,
                 options: dict[str, Any] | None = None) -> dict[str, Any]:
    """f16: top-1 >= 0.99 and KL < 1e-3 (MoE models included: their test models have decisive routers);
    q8_0: KL <= 0.01; token-id parity 1.0 on the tokenizer texts for both; the file's architecture and tensor
    types as requested. Returns {outtype: (report, metrics)} for family-specific assertions."""
    out: dict[str, Any] = {}
    for outtype, qtype in (("f16", Q.F16), ("q8_0", Q.Q8_0)):
        path = tmp_path / f"{model_dir.name}-{outtype}.gguf"
        report, metrics, details = convert_and_validate(model_dir, path, outtype, options)
        assert metrics["finite"] is True, metrics
        assert metrics["positions"] > 200, metrics
        assert metrics["token_parity"] == 1.0, details["tokenizer_mismatches"]
        if outtype == "f16":
            assert metrics["top1_agreement"] >= 0.99, metrics
            assert metrics["mean_kl"] < 1e-3, metrics
        else:
            assert metrics["mean_kl"] <= 0.01, metrics
        reader = FastGGUFReader(str(path))
        assert reader.fields["general.architecture"].contents() == gguf_arch
        types = {t.name: t.tensor_type for t in reader.tensors}
        # norms stay f32 whatever their rank (per-head norms are [heads, head_dim]), as llama.cpp's converter keeps them
        norms = [n for n in types if n.endswith("_norm.weight")]
        assert all(types[n] == Q.F32 for n in norms), {n: types[n].name for n in norms}
        # routers and position embeddings too, as llama.cpp keeps them
        kept = [n for n in types if ALWAYS_F32.fullmatch(n)]
        assert all(types[n] == Q.F32 for n in kept), {n: types[n].name for n in kept}
        matrices = [n for n, t in types.items() if len(next(x for x in reader.tensors if x.name == n).shape) >= 2
                    and n not in norms and n not in kept]
        assert matrices and all(types[n] == qtype for n in matrices), {n: types[n].name for n in matrices}
        out[outtype] = (report, metrics)
    return out


def field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def tensors(path: Path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in FastGGUFReader(str(path)).tensors}


def convert_only(model_dir: Path, out: Path, options: dict[str, Any] | None = None):
    """f16 conversion without validation (the refusal and metadata tests)."""
    snap = fetch(str(model_dir), f"test/{model_dir.name}")
    return convert(snap.dir, snap.config(), snap.safetensors_files(), out, "f16", name=snap.model_id, options=options)
