"""Importance matrix: how strongly each input column of every matrix is used, from a calibration text.

For each weight matrix W (GGUF rows = output features, columns = input features), the matrix is the sum
over calibration tokens of x_j^2 for the activations x that multiply W, with the token count: exactly
what llama.cpp's quantizer weighs its rounding error by (IQ types need it; other k-quants improve with
it). Computed here with the transformers model itself (the streamed fp32 reference, one layer resident),
by forward pre-hooks on the modules whose weights the GGUF family maps to matrices, and stored in
llama.cpp's imatrix GGUF layout (`<tensor>.in_sum2` [columns x matrices], `<tensor>.counts`), so
`llama-quantize --imatrix` reads it too. Stacked MoE experts get one row of sums per expert from the
tokens the router sent to it, as llama.cpp's imatrix counts them: transformers 5 runs the experts of a
layer as one module holding fused `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] parameters, so
that module's pre-hook takes the routed tokens per expert for gate and up, and recomputes act(gate) * up
for down's input. An expert no calibration token reached has count 0; `load` gives it uniform weights.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np

from ...core.errors import HiveError, ModelFormatError
from ...validation.prompts import CALIBRATION_CHUNK_TOKENS as CHUNK_TOKENS, calibration_chunks, calibration_text

# Part of the cache key: bump when what `compute_here` writes changes for the same inputs.
# 2: stacked experts get their rows (fused transformers 5 experts modules hooked).
IMATRIX_VERSION = 2


def matrix_sources(model_dir: Path, cfg: dict[str, Any], files: list[Path]) -> dict[str, list[str]]:
    """GGUF matrix name -> the HF weight(s) it is made from (several: stacked experts), from headers only."""
    from ...source.safetensors_io import TensorSource
    from .convert import plan_tensors, text_config
    from .families import HParams, family_for

    tcfg = text_config(cfg)
    hp = HParams(tcfg)
    family = family_for((tcfg.get("architectures") or [None])[0]).for_config(hp)
    with TensorSource(files) as tensors:
        plan = plan_tensors(family, hp, tensors, "f16")
    out: dict[str, list[str]] = {}
    for step in plan:
        for o in step.outputs:
            if len(o.shape) < 2 or not step.inputs or o.name.startswith("token_embd") or not o.name.endswith(".weight"):
                continue  # vectors, stacked biases ([experts, rows]) and the embedding are not quantized by a matrix
            if step.rule is not None and step.rule.transform.fixed is not None:
                continue  # kept as stored (MXFP4 experts): never quantized, nothing to weigh
            if o.qtype.name == "F32":  # kept f32 in every file type (a router, Mamba's conv1d and A): never quantized
                continue
            if step.rule is not None and step.rule.transform.stack:
                out[o.name] = list(step.inputs)  # one checkpoint tensor per expert
            elif len(o.shape) == 3:  # experts stacked in the checkpoint already (Granite MoE): `<tensor>#<expert>`
                out[o.name] = [f"{step.inputs[0]}#{e}" for e in range(o.shape[0])]
            else:
                out[o.name] = [step.inputs[0]]
    return out


def compute_here(model_dir: str, files: list[str], out_path: str, sources: dict[str, list[str]],
                 sequences: list[list[int]], dataset: str) -> dict[str, Any]:
    """Runs in a child process (torch): hook, run the calibration sequences, write the imatrix GGUF."""
    import gguf
    import torch

    from ...model.streamed_model import StreamedCausalLM

    wanted = {hf for names in sources.values() for hf in names}
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def add(hf: str, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).double()
        sums[hf] = sums[hf] + (x * x).sum(0) if hf in sums else (x * x).sum(0)
        counts[hf] = counts.get(hf, 0) + x.shape[0]

    with StreamedCausalLM(Path(model_dir), [Path(f) for f in files]) as lm:
        for path, module in lm.model.named_modules():
            experts = _fused_experts(lm.rules, path, module, wanted)
            if experts is not None:
                module.register_forward_pre_hook(_experts_hook(module, *experts, add))
                continue
            rule = lm.rules.get(f"{path}.weight")
            if rule is None or len(rule.sources) != 1 or rule.sources[0] not in wanted:
                continue
            module.register_forward_pre_hook(lambda _m, args, hf=rule.sources[0]: add(hf, args[0]))
        from ...core.progress import unit_runs

        with unit_runs([module for _name, module, _r in lm.units], len(sequences), "imatrix"):
            for seq in sequences:
                lm.logits(seq)
    writer = gguf.GGUFWriter(out_path, arch="imatrix")
    writer.add_type("imatrix")
    writer.add_array(gguf.Keys.IMatrix.DATASETS, [dataset])
    writer.add_uint32(gguf.Keys.IMatrix.CHUNK_COUNT, len(sequences))
    writer.add_uint32(gguf.Keys.IMatrix.CHUNK_SIZE, CHUNK_TOKENS)
    stored, missing = 0, []
    for name, hfs in sources.items():
        if not all(h in sums for h in hfs):
            missing.append(name)
            continue
        in_sum2 = np.stack([sums[h].float().numpy() for h in hfs])  # [matrices, columns]
        writer.add_tensor(f"{name}.in_sum2", in_sum2)
        writer.add_tensor(f"{name}.counts", np.asarray([[counts[h]] for h in hfs], dtype=np.float32))
        stored += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"tensors": stored, "missing": sorted(missing), "chunks": len(sequences), "chunk_tokens": CHUNK_TOKENS,
            "tokens": sum(len(s) for s in sequences)}


def _fused_experts(rules, path: str, module, wanted: set[str]):
    """(gate sources, up sources, down sources), one checkpoint tensor per expert each, when `module` is a
    transformers 5 experts module whose fused parameters the streamed model stacks from per-expert tensors."""
    gate_up, down = rules.get(f"{path}.gate_up_proj"), rules.get(f"{path}.down_proj")
    if gate_up is None or down is None or not (hasattr(module, "act_fn") or hasattr(module, "_apply_gate")):
        return None
    if len(gate_up.sources) == len(down.sources) == 1:  # stacked in the checkpoint: one GGUF source per expert
        n = module.down_proj.shape[0]
        gates = [f"{gate_up.sources[0]}#{e}" for e in range(n)]
        downs = [f"{down.sources[0]}#{e}" for e in range(n)]
        return (gates, gates, downs) if set(gates + downs) <= wanted else None
    n = len(down.sources)
    if len(gate_up.sources) != 2 * n or not set(gate_up.sources + down.sources) <= wanted:
        return None
    return gate_up.sources[:n], gate_up.sources[n:], down.sources


def _experts_hook(module, gates, ups, downs, add):
    """Pre-hook of an experts module called as (hidden_states [T, H], top_k_index [T, k], top_k_weights), or with
    the routed hidden states alone (Llama 4: `_prescaled_experts`)."""
    import inspect

    import torch

    # an experts module that takes the hidden states alone (Llama 4's): the routing is in the input itself
    prescaled = len(inspect.signature(module.forward).parameters) == 1

    def hook(_module, args):
        if prescaled:
            with torch.no_grad():
                _prescaled_experts(module, args[0], gates, ups, downs, add)
            return
        x, top_k = args[0], args[1]
        with torch.no_grad():
            for e in range(len(downs)):
                rows = (top_k == e).any(dim=-1).nonzero().flatten()
                xe = x[rows]
                # the sums and counts exist for every expert, reached or not (llama.cpp's layout)
                add(gates[e], xe)
                if ups[e] != gates[e]:  # gate and up split from one stacked tensor: one source, counted once
                    add(ups[e], xe)
                # gpt-oss: [H, 2I] with gate and up interleaved, biases, clamps (every transformers 5 experts module
                # has an `_apply_gate`; only gpt-oss has the biases)
                if hasattr(module, "gate_up_proj_bias"):
                    add(downs[e], module._apply_gate(xe @ module.gate_up_proj[e] + module.gate_up_proj_bias[e]))
                    continue
                gate, up = torch.nn.functional.linear(xe, module.gate_up_proj[e]).chunk(2, dim=-1)
                add(downs[e], module.act_fn(gate) * up)

    return hook


def _prescaled_experts(module, x, gates, ups, downs, add) -> None:
    """Llama 4's experts module is called with every token once per expert ([experts x tokens, H]), each already
    scaled by its router score, which is zero where the token was not routed (sigmoid of -inf), as llama.cpp's
    llama4 scales the experts' input too; its fused parameters are [in, out]: gate_up_proj [E, H, 2I]."""
    x = x.reshape(len(downs), -1, x.shape[-1])
    for e in range(len(downs)):
        xe = x[e][(x[e] != 0).any(dim=-1)]
        add(gates[e], xe)
        if ups[e] != gates[e]:
            add(ups[e], xe)
        gate, up = (xe @ module.gate_up_proj[e]).chunk(2, dim=-1)
        add(downs[e], module.act_fn(gate) * up)


def compute(snapshot, out_path: Path, *, text: str | None = None, step: str | None = None) -> dict[str, Any]:
    """The importance matrix of a snapshot's model from `text` (the built-in calibration text by default),
    written to `out_path`. Cached per (model content, calibration ids, matrices, versions): every imatrix
    recipe of a model (Q2_K ... IQ4_NL) shares one pass of the streamed model over the text, as the
    recipes share one reference."""
    import hashlib
    import json
    import os
    from importlib.metadata import version

    from ...core.paths import cache_root, link_or_copy, publish_cache_entry, work_dir
    from ...process.isolation import run_isolated
    from ...validation.reference import encode
    from ...validation.tokenizer_cache import CachedTokenizer

    text = text if text is not None else calibration_text()
    tok = CachedTokenizer(snapshot.dir)
    ids = encode(tok, [text])[0]
    if len(ids) < 16:
        raise HiveError(f"the calibration text is {len(ids)} tokens: too short for an importance matrix")
    sequences = calibration_chunks(ids)
    sources = matrix_sources(snapshot.dir, snapshot.config(), snapshot.safetensors_files())
    key = hashlib.sha256(json.dumps([IMATRIX_VERSION, snapshot.content_digest, sequences, sources,
                                     version("transformers"), version("torch")]).encode()).hexdigest()
    cached = cache_root() / "imatrix" / key
    if not (cached / "summary.json").is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        # computed in a locked work dir and renamed whole into the cache: readers never see a partial file
        with work_dir("imatrix-") as work:
            tmp = work / "out"
            tmp.mkdir()
            summary = run_isolated(compute_here, engine="transformers", needs_torch=True,
                                   step=step or f"importance matrix of {snapshot.model_id}", model_dir=str(snapshot.dir),
                                   files=[str(f) for f in snapshot.safetensors_files()],
                                   out_path=str(tmp / "imatrix.gguf"), sources=sources, sequences=sequences,
                                   dataset="hive-aot calibration.txt")
            os.chmod(tmp / "imatrix.gguf", 0o644)
            (tmp / "summary.json").write_text(json.dumps(summary))
            publish_cache_entry(tmp, cached, "summary.json")
    link_or_copy(cached / "imatrix.gguf", out_path)
    return json.loads((cached / "summary.json").read_text())


def load(path: Path) -> dict[str, np.ndarray]:
    """tensor name -> mean of x^2 per column (per expert, concatenated), as llama.cpp's quantizer wants it."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001
        raise ModelFormatError(f"{path.name} is not an importance matrix GGUF ({type(e).__name__}: {e})") from None
    tensors = {t.name: np.asarray(t.data, dtype=np.float32) for t in reader.tensors}
    out = {}
    for key, sums in tensors.items():
        if not key.endswith(".in_sum2"):
            continue
        name = key[: -len(".in_sum2")]
        counts = tensors.get(f"{name}.counts")
        if counts is None:
            raise ModelFormatError(f"{path.name}: {name} has sums but no counts")
        sums2 = sums.reshape(counts.size, -1)
        mean = sums2 / np.maximum(counts.reshape(-1, 1), 1.0)
        # an expert no calibration token reached: uniform weights rather than all-zero ones
        mean[counts.reshape(-1) == 0] = 1.0
        out[name] = mean.astype(np.float32).reshape(-1)
    return out


def as_quantize_param(values: dict[str, np.ndarray]):
    """The NULL-terminated `llama_model_imatrix_data` array libllama's quantizer reads (kept alive by the caller)."""
    import llama_cpp

    entries = (llama_cpp.llama_model_imatrix_data * (len(values) + 1))()
    keep = []
    for i, (name, arr) in enumerate(sorted(values.items())):
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        keep.append(arr)
        entries[i].name = name.encode()
        entries[i].data = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        entries[i].size = arr.size
    entries[len(values)].name = None
    return entries, keep
