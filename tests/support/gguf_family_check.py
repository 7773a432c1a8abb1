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

from pipelines.source.fetch import fetch
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
                 options: dict[str, Any] | None = None, stored: dict[str, Any] | None = None,
                 f16_min_top1: float = 0.99) -> dict[str, Any]:
    """f16: top-1 >= 0.99 and KL < 1e-3 (MoE models included: their test models have decisive routers);
    q8_0: KL <= 0.01; token-id parity 1.0 on the tokenizer texts for both (with SmolLM2's pre-tokenizer named, as
    the build records); the file's architecture and tensor types as requested. Returns {outtype: (report, metrics)}
    for family-specific assertions. `stored`: {regex: type} of tensors written as the checkpoint stores them in
    every outtype (gpt-oss's MXFP4 experts); the outtype's type is asserted for the other matrices.
    `f16_min_top1`: lower only where llama.cpp itself runs part of an f16 file at lower precision (MXFP4 experts
    multiply Q8_0-rounded activations), the f16 KL bar unchanged."""
    import re
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
            assert metrics["top1_agreement"] >= f16_min_top1, metrics
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
        as_stored = {n: q for n in types for pattern, q in (stored or {}).items() if re.fullmatch(pattern, n)}
        assert all(types[n] == q for n, q in as_stored.items()), {n: types[n].name for n in as_stored}
        assert as_stored or not stored, f"no tensor matches {list(stored)}"
        matrices = [n for n, t in types.items() if len(next(x for x in reader.tensors if x.name == n).shape) >= 2
                    and n not in norms and n not in kept and n not in as_stored]
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
                                    options: dict[str, Any] | None = None, *, exp_tensors: str | None = None,
                                    converter_args: tuple[str, ...] = (), tensors_only: bool = False,
                                    released_keys: dict[str, Any] | None = None) -> Path:
    """hive-aot's f16 of `model_dir` holds exactly the tensors llama.cpp's own converter writes for it (names,
    types, shapes, bytes: `llamacpp_converter`). Returns hive-aot's file. `exp_tensors`: a regex of f32 tensors
    computed through exp (Mamba's A = -exp(A_log)), held to within one ulp of llama.cpp's instead: its converter
    takes torch's float32 exp, which is not correctly rounded (an ulp off in about 1% of values), hive-aot's is.
    `converter_args`: options of llama.cpp's converter run that a family's conversion matches (Qwen3-Next: --no-mtp,
    its multi-token-prediction head is not carried). `tensors_only`: llama.cpp's converter skips its vocabulary
    step (a family whose converter wants its own tokenizer files: `llamacpp_converter.convert`). `released_keys`:
    config keys set (None: removed) on a copy that both converters read, where llama.cpp's converter reads a key as
    the released config spells it and transformers 5 saves it otherwise (GPT-2's n_ctx, GPT-NeoX's rotary_pct)."""
    import re

    import llamacpp_converter
    from factories import copy_model, edit_config

    if released_keys:
        model_dir = copy_model(model_dir, tmp_path / f"{model_dir.name}-released-keys")
        edit_config(model_dir, **released_keys)

    ours = tmp_path / f"{model_dir.name}-hive-aot-f16.gguf"
    theirs = tmp_path / f"{model_dir.name}-llama-cpp-f16.gguf"
    convert_only(model_dir, ours, options)
    llamacpp_converter.convert(llamacpp_tree, model_dir, theirs, "f16", *converter_args, tensors_only=tensors_only)
    differences = llamacpp_converter.tensor_differences(ours, theirs)
    if exp_tensors is not None:
        a, b = tensors(ours), tensors(theirs)
        within = [d for d in differences if d.endswith(", other bytes") and re.fullmatch(exp_tensors, d.split(":")[0])]
        for d in within:
            n = d.split(":")[0]
            assert a[n].tensor_type == Q.F32, d
            np.testing.assert_array_max_ulp(np.asarray(a[n].data), np.asarray(b[n].data), maxulp=1)
        differences = [d for d in differences if d not in within]
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


def assert_refused(model_dir: Path, tmp_path: Path, change, message: str, options: dict[str, Any] | None = None,
                   convert=None) -> None:
    """A copy of `model_dir` with config.json changed as `change` says (keys to set, or a function editing the
    config dict) is refused in one line matching `message` by `convert(dir, out)` (the f16 conversion unless
    given), and leaves no file behind (a layout llama.cpp cannot run)."""
    import json

    import pytest
    from factories import copy_model, edit_config

    from pipelines.core.errors import ModelFormatError

    d = copy_model(model_dir, tmp_path / model_dir.name)
    if callable(change):
        cfg = json.loads((d / "config.json").read_text())
        change(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    else:
        edit_config(d, **change)
    out = tmp_path / "refused.gguf"
    with pytest.raises(ModelFormatError, match=message) as err:
        (convert or (lambda src, dest: convert_only(src, dest, options)))(d, out)
    assert "\n" not in str(err.value)
    assert not out.exists()


# --- negative controls: a conversion with something of the family left out ---------------------------------

def replace_transforms(monkeypatch, replace) -> None:
    """Convert with each rule's transform replaced by `replace(rule)` (None keeps it)."""
    import dataclasses

    from pipelines.targets.gguf import convert as convert_mod

    original = convert_mod.family_for

    def patched(arch):
        fam = original(arch)
        rules = tuple(r if (t := replace(r)) is None else dataclasses.replace(r, transform=t) for r in fam.tensors)
        return dataclasses.replace(fam, tensors=rules)

    monkeypatch.setattr(convert_mod, "family_for", patched)


def without_keys(*keys: str):
    """A negative control (applied with monkeypatch) converting without the family's params of these keys."""
    def apply(monkeypatch) -> None:
        import dataclasses

        from pipelines.targets.gguf import convert as convert_mod

        original = convert_mod.family_for
        monkeypatch.setattr(convert_mod, "family_for", lambda arch: dataclasses.replace(
            original(arch), params=tuple(p for p in original(arch).params if p.key not in keys)))
    return apply


def calibration_inputs(model, module, ids: list[int]):
    """What `module` of the transformers `model` receives over the calibration ids, fed in the imatrix's chunks,
    as one float64 [tokens, hidden] matrix (to recompute an importance matrix by hand)."""
    import torch

    from pipelines.targets.gguf import imatrix

    captured: list[torch.Tensor] = []
    handle = module.register_forward_pre_hook(lambda _m, args: captured.append(args[0].reshape(-1, args[0].shape[-1])))
    try:
        with torch.no_grad():
            for lo in range(0, len(ids), imatrix.CHUNK_TOKENS):
                model(torch.tensor([ids[lo:lo + imatrix.CHUNK_TOKENS]]))
    finally:
        handle.remove()
    return torch.cat(captured).double()
