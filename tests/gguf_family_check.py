"""What every GGUF family test asserts (issue 11's bar), shared by the per-family test modules.

A tiny random model of the family (2 layers, hidden >= 64, SmolLM2's BPE tokenizer cut to its first 2,048 tokens
unless the case brings its own: `factories.make_small_bpe_tokenizer`) is converted to f16 and q8_0, each file is
loaded in llama.cpp and compared with the transformers fp32 reference on the same token ids (`validate_gguf`), and
the tensor types in the file are read back with GGUFReader.

llama.cpp recognises a BPE pre-tokenizer by the ids of a check text, which the cut vocabulary changes, so every
conversion here names SmolLM2's pre-tokenizer (`bpe_pre_fallback`, recorded in the build); token-id parity with
llama.cpp shows the name is right (a wrong one, e.g. "qwen2", tokenizes newlines differently). That llama.cpp
recognises the full vocabulary by its hash, as transformers reads it for each family's model type, is held by
`assert_full_vocab_recognised`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

from factories import SMOLLM2_PRE, TOKENIZER_FILES
from gguf_reader import FastGGUFReader
from pipelines.sources import fetch
from pipelines.targets.gguf.convert import ALWAYS_F32, convert
from pipelines.targets.gguf.validate import validate_gguf

Q = gguf.GGMLQuantizationType
SMALL_VOCAB_OPTIONS = {"bpe_pre_fallback": SMOLLM2_PRE}


def with_pre_tokenizer(options: dict[str, Any] | None) -> dict[str, Any]:
    """Build options naming SmolLM2's pre-tokenizer (the cut vocabulary's check hash is unknown to llama.cpp)."""
    return {**SMALL_VOCAB_OPTIONS, **(options or {})}


def convert_and_validate(model_dir: Path, out: Path, outtype: str, options: dict[str, Any] | None = None):
    snap = fetch(str(model_dir), f"test/{model_dir.name}")
    report = convert(snap.dir, snap.config(), snap.safetensors_files(), out, outtype, name=snap.model_id,
                     options=with_pre_tokenizer(options))
    metrics, details = validate_gguf(snap, out)
    print(f"{model_dir.name} {outtype}: {metrics}")
    return report, metrics, details


def check_family(model_dir: Path, tmp_path: Path, gguf_arch: str, *,
                 options: dict[str, Any] | None = None) -> dict[str, Any]:
    """f16: top-1 >= 0.99 and KL < 1e-3 (MoE models included: their test models have decisive routers);
    q8_0: KL <= 0.01; token-id parity 1.0 on the tokenizer texts for both (with SmolLM2's pre-tokenizer named, as
    the build records); the file's architecture and tensor types as requested. Returns {outtype: (report, metrics)}
    for family-specific assertions."""
    out: dict[str, Any] = {}
    for outtype, qtype in (("f16", Q.F16), ("q8_0", Q.Q8_0)):
        path = tmp_path / f"{model_dir.name}-{outtype}.gguf"
        report, metrics, details = convert_and_validate(model_dir, path, outtype, options)
        assert metrics["finite"] is True, metrics
        assert metrics["positions"] > 200, metrics
        assert metrics["token_parity"] == 1.0, details["tokenizer_mismatches"]
        if report.vocab["tokenizer"] == "bpe":
            assert report.vocab["pre"] == SMOLLM2_PRE and report.vocab["pre_detection"].startswith("fallback:")
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
    return convert(snap.dir, snap.config(), snap.safetensors_files(), out, "f16", name=snap.model_id,
                   options=with_pre_tokenizer(options))


def assert_full_vocab_recognised(config_class: str, params: dict[str, Any], smollm2_dir: Path, dest: Path) -> None:
    """llama.cpp recognises the full SmolLM2 tokenizer by its check hash (no `bpe_pre_fallback`) as the converter
    reads it for this config's model type (transformers picks the tokenizer class by model type), and names the
    pre-tokenizer the family tests name for the cut vocabulary. Only the vocabulary is built: no weights needed."""
    import json

    import transformers

    from pipelines.targets.gguf.vocab import build_vocab

    full = json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (smollm2_dir / name).is_file():
            (dest / name).write_bytes((smollm2_dir / name).read_bytes())
    getattr(transformers, config_class)(**{**params, "vocab_size": full}).to_json_file(str(dest / "config.json"))
    info = build_vocab(dest, full, {}).info
    assert info["pre"] == SMOLLM2_PRE and info["pre_detection"].startswith("hash:"), info


def assert_same_tensors_as_llamacpp(llamacpp_tree: Path, model_dir: Path, tmp_path: Path,
                                    options: dict[str, Any] | None = None) -> Path:
    """hive-aot's f16 of `model_dir` holds exactly the tensors llama.cpp's own converter writes for it (names,
    types, shapes, bytes: `llamacpp_converter`). Returns hive-aot's file."""
    import llamacpp_converter

    ours = tmp_path / f"{model_dir.name}-hive-aot-f16.gguf"
    theirs = tmp_path / f"{model_dir.name}-llama-cpp-f16.gguf"
    convert_only(model_dir, ours, options)
    llamacpp_converter.convert(llamacpp_tree, model_dir, theirs, "f16")
    differences = llamacpp_converter.tensor_differences(ours, theirs)
    assert differences == [], "\n".join(differences[:40])
    theirs.unlink()
    return ours


def check_kquant(model_dir: Path, tmp_path: Path, *, options: dict[str, Any] | None = None, ftype: str = "Q4_K_M",
                 max_kl: float = 0.1) -> dict[str, Any]:
    """The streamed direct k-quant (libllama's type choice and ggml's quantizer per row slice, no intermediate)
    writes the bytes libllama's quantizer makes of hive-aot's f16, loads in llama.cpp and stays within `max_kl`
    of the transformers reference, with token-id parity. Returns the metrics."""
    from pipelines.targets.gguf.quantize import quantize

    snap = fetch(str(model_dir), f"test/{model_dir.name}")
    args = (snap.dir, snap.config(), snap.safetensors_files())
    direct = tmp_path / f"{model_dir.name}-direct-{ftype}.gguf"
    convert(*args, direct, "f16", ftype=ftype, name=snap.model_id, options=with_pre_tokenizer(options))
    f16 = tmp_path / f"{model_dir.name}-for-{ftype}.gguf"
    convert(*args, f16, "f16", name=snap.model_id, options=with_pre_tokenizer(options))
    via_libllama = tmp_path / f"{model_dir.name}-libllama-{ftype}.gguf"
    quantize(f16, via_libllama, ftype)
    f16.unlink()
    a, b = tensors(direct), tensors(via_libllama)
    assert set(a) == set(b)
    differing = [n for n in a if a[n].tensor_type != b[n].tensor_type
                 or np.asarray(a[n].data).tobytes() != np.asarray(b[n].data).tobytes()]
    assert differing == [], differing
    via_libllama.unlink()
    metrics, details = validate_gguf(snap, direct)
    print(f"{model_dir.name} {ftype}: {metrics}")
    assert metrics["finite"] is True and metrics["token_parity"] == 1.0, (metrics, details["tokenizer_mismatches"])
    assert metrics["mean_kl"] <= max_kl, metrics
    return metrics
