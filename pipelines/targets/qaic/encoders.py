"""PyTorch -> ONNX for the Cloud AI 100 embedding / reranker models of the seed (BERT, MPNet, RoBERTa, XLM-RoBERTa).

Encoders have no KV cache, so the retained-state contract of export.py does not apply; the graph is the
transformers model itself, traced with eager attention so that it holds standard ONNX ops only (onnxruntime
runs it, which is how parity is checked on a CPU):
- inputs `input_ids`, `attention_mask` [batch_size, seq_len] int64 (both axes dynamic);
- embedding models: `last_hidden_state` [batch_size, seq_len, hidden] and `sentence_embedding`
  [batch_size, hidden]: attention-mask-weighted mean pooling (sentence-transformers' default), or the first
  token when the snapshot's sentence-transformers `1_Pooling/config.json` asks for CLS pooling (BGE and
  granite-embedding do). No L2 normalisation: cosine similarity does not need it;
- XLMRobertaForSequenceClassification (rerankers): `logits` [batch_size, num_labels];
- opset 17, fp32 weights as initializers; external data in one `<name>.data` file beside the .onnx when
  the weights exceed the threshold (2 GiB, protobuf's limit, by default).

The 2-D mask is turned into the additive [batch, 1, 1, seq] mask in the graph and handed to transformers
prepared: transformers' own mask builder skips the mask when the traced sample has no padding, which a
trace would freeze into the graph.

Optimum cannot do this here: optimum-onnx (the exporter since optimum 2.0; 0.1.0 is the newest) requires
transformers<4.58 and fails to import under transformers 5 (`get_parameter_dtype` is gone).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OPSET = 17
EMBEDDERS = frozenset({"BertModel", "MPNetForMaskedLM", "RobertaModel", "XLMRobertaModel"})
CLASSIFIERS = frozenset({"XLMRobertaForSequenceClassification"})
ENCODERS = EMBEDDERS | CLASSIFIERS
INPUTS = ("input_ids", "attention_mask")
PROTOBUF_LIMIT = 2 * 1024**3
_GRAPH_MARGIN = 64 * 1024**2  # the graph itself must fit beside inline weights in one protobuf
# Additive mask for padded keys: representable in fp16 (AI 100 compiles with -convert-to-fp16), and as
# good as -inf after softmax in fp32.
_MASKED = -65504.0


@dataclass
class EncoderExportReport:
    path: str
    files: list[str]  # relative to Path(path).parent: the .onnx, then its external data file if any
    architecture: str
    hidden_size: int
    layers: int
    max_positions: int  # longest sequence the position table allows (RoBERTa-style tables start at pad+1)
    outputs: list[str]
    external_data: bool
    pooling: str | None = None  # "mean" / "cls" for embedding models, None for classifiers
    num_labels: int | None = None
    weight_bytes: int = 0
    metadata: dict[str, str] = field(default_factory=dict)


def architecture(model_dir: Path) -> str:
    """The architecture config.json names, refused (one line) unless it is one of ENCODERS."""
    from ...core.errors import ModelFormatError, NotApplicableError

    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"config.json cannot be read: {type(e).__name__}: {e}") from None
    archs = cfg.get("architectures") if isinstance(cfg, dict) else None
    if not archs or not isinstance(archs, list):
        raise NotApplicableError("config.json names no architecture: no AI 100 encoder export")
    arch = str(archs[0])
    if arch not in ENCODERS:
        raise NotApplicableError(f"no AI 100 encoder export for {arch} (exported: {', '.join(sorted(ENCODERS))})")
    return arch


def pooling_mode(model_dir: Path) -> str:
    """sentence-transformers' pooling for the snapshot: its 1_Pooling/config.json when present, else mean."""
    from ...core.errors import ModelFormatError, NotApplicableError

    path = Path(model_dir) / "1_Pooling" / "config.json"
    if not path.is_file():
        return "mean"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"1_Pooling/config.json cannot be read: {type(e).__name__}: {e}") from None
    modes = sorted(k.removeprefix("pooling_mode_") for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True)
    modes = ["cls" if m == "cls_token" else "mean" if m == "mean_tokens" else m for m in modes]
    if len(modes) != 1 or modes[0] not in ("mean", "cls"):
        raise NotApplicableError(f"sentence-transformers pooling {'+'.join(modes) or 'none'} is not exported "
                                 "(exported: mean, cls)")
    return modes[0]


def load_encoder(model_dir: Path, *, eager: bool = False):
    """The fp32 transformers model for the snapshot: the base encoder for embedding models (any MLM head
    dropped), the whole model for classifiers. Safetensors only, never remote code; a checkpoint that
    leaves a weight of the loaded model uninitialised is refused, not silently random-filled."""
    import torch
    from transformers import AutoModel, AutoModelForSequenceClassification

    from ...core.errors import ModelFormatError
    from ...core.quiet import quiet_transformers

    arch = architecture(model_dir)
    quiet_transformers()
    kwargs: dict[str, Any] = {"dtype": torch.float32, "trust_remote_code": False, "use_safetensors": True,
                              "local_files_only": True, "output_loading_info": True}
    if eager:
        kwargs["attn_implementation"] = "eager"
    try:
        if arch in CLASSIFIERS:
            model, info = AutoModelForSequenceClassification.from_pretrained(str(model_dir), **kwargs)
        else:
            # AutoModel gives the base encoder, reading checkpoints saved with or without the head's prefix
            # (sentence-transformers saves MPNetModel weights under an MPNetForMaskedLM config).
            model, info = AutoModel.from_pretrained(str(model_dir), add_pooling_layer=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - a model transformers cannot load is malformed input for us
        raise ModelFormatError(f"transformers cannot load {arch}: {type(e).__name__}: {e}") from None
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ModelFormatError(f"{arch} checkpoint lacks weights: {', '.join(missing[:3])}{more}")
    return arch, model.eval()


def _max_positions(cfg) -> int:
    n = int(cfg.max_position_embeddings)
    if cfg.model_type in ("roberta", "xlm-roberta", "mpnet") and cfg.pad_token_id is not None:
        return n - int(cfg.pad_token_id) - 1  # position ids count from pad_token_id + 1
    return n


def _pool(hidden, mask, mode: str):
    if mode == "cls":
        return hidden[:, 0]
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)


def _graph_module(model, classifier: bool, pooling: str):
    import inspect

    import torch
    from torch import nn

    token_types = "token_type_ids" in inspect.signature(model.forward).parameters

    class EncoderGraph(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            additive = (1.0 - attention_mask[:, None, None, :].to(torch.float32)) * _MASKED
            kw = {"token_type_ids": torch.zeros_like(input_ids)} if token_types else {}
            out = self.model(input_ids=input_ids, attention_mask=additive, return_dict=True, **kw)
            if classifier:
                return out.logits
            h = out.last_hidden_state
            return h, _pool(h, attention_mask, pooling)

    return EncoderGraph().eval()


def _initializer_bytes(m) -> int:
    import numpy as np
    from onnx import helper

    total = 0
    for t in m.graph.initializer:
        total += int(np.prod(t.dims, dtype=np.int64)) * np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    return total


def export_encoder(model_dir: Path, out_path: Path, *, external_data_threshold: int = 2 * 1024**3) -> EncoderExportReport:
    """Export an encoder snapshot (fp32) to `out_path`; weights over the threshold (capped at protobuf's 2 GiB
    less 64 MiB for the graph) go to one `<out_path.name>.data` beside it. The files appear only once complete;
    a `.data` file left by an earlier external export to the same path is removed when no longer used."""
    import onnx
    import torch

    model_dir, out_path = Path(model_dir), Path(out_path)
    arch, model = load_encoder(model_dir, eager=True)
    cfg = model.config
    classifier = arch in CLASSIFIERS
    pooling = None if classifier else pooling_mode(model_dir)
    outputs = ["logits"] if classifier else ["last_hidden_state", "sentence_embedding"]
    graph = _graph_module(model, classifier, pooling or "mean")
    axes: dict[str, dict[int, str]] = {n: {0: "batch_size", 1: "seq_len"} for n in INPUTS}
    if classifier:
        axes["logits"] = {0: "batch_size"}
    else:
        axes["last_hidden_state"] = {0: "batch_size", 1: "seq_len"}
        axes["sentence_embedding"] = {0: "batch_size"}
    # A padded sample (batch 2, seq 8): nothing about padding or the sample's sizes may be frozen in.
    seq = min(8, _max_positions(cfg))
    ids = ((torch.arange(2 * seq) + 3) % cfg.vocab_size).view(2, seq)
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, seq // 2:] = 0
    if cfg.pad_token_id is not None:
        ids[1, seq // 2:] = cfg.pad_token_id
    limit = min(int(external_data_threshold), PROTOBUF_LIMIT - _GRAPH_MARGIN)
    data_name = f"{out_path.name}.data"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".encoder-export-", dir=out_path.parent))
    try:
        raw = tmp / "raw" / "model.onnx"
        raw.parent.mkdir()
        with torch.no_grad():
            torch.onnx.export(graph, (ids, mask), str(raw), input_names=list(INPUTS), output_names=outputs,
                              dynamic_axes=axes, opset_version=OPSET, do_constant_folding=True, dynamo=False)
        m = onnx.load(str(raw))  # pulls in external data if the exporter needed it (over 2 GiB)
        weight_bytes = _initializer_bytes(m)
        external = weight_bytes > limit
        meta = {"hive_aot.architecture": arch, "hive_aot.outputs": ",".join(outputs),
                "hive_aot.max_positions": str(_max_positions(cfg))}
        if pooling:
            meta["hive_aot.pooling"] = pooling
        for k, v in meta.items():
            m.metadata_props.add(key=k, value=v)
        staged = tmp / out_path.name
        if external:
            onnx.save_model(m, str(staged), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=data_name, size_threshold=1024)
        else:
            onnx.save_model(m, str(staged))
        del m
        onnx.checker.check_model(str(staged))
        files = [out_path.name]
        data_dest = out_path.parent / data_name
        if external:
            shutil.copymode(staged, tmp / data_name)  # onnx writes the data file owner-only
            os.replace(tmp / data_name, data_dest)
            files.append(data_name)
        elif data_dest.is_file():
            data_dest.unlink()  # an earlier external-data export of this path: nothing refers to it now
        os.replace(staged, out_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return EncoderExportReport(
        path=str(out_path), files=files, architecture=arch, hidden_size=int(cfg.hidden_size),
        layers=int(cfg.num_hidden_layers), max_positions=_max_positions(cfg), outputs=outputs,
        external_data=external, pooling=pooling, num_labels=int(cfg.num_labels) if classifier else None,
        weight_bytes=weight_bytes, metadata=meta)


def _pad(batch: list[list[int]], pad_id: int):
    import numpy as np

    width = max(len(s) for s in batch)
    ids = np.full((len(batch), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(batch), width), dtype=np.int64)
    for i, s in enumerate(batch):
        ids[i, :len(s)] = s
        mask[i, :len(s)] = 1
    return ids, mask


def run_ort(onnx_path: Path, batch: list[list[int]], pad_id: int) -> dict[str, Any]:
    """The exported graph on one batch (right-padded with `pad_id`): output name -> array, plus the mask."""
    import onnxruntime as ort

    from .ort import session_options

    sess = ort.InferenceSession(str(onnx_path), sess_options=session_options(), providers=["CPUExecutionProvider"])
    ids, mask = _pad(batch, pad_id)
    names = [o.name for o in sess.get_outputs()]
    res = dict(zip(names, sess.run(names, {"input_ids": ids, "attention_mask": mask})))
    res["attention_mask"] = mask
    return res


def _numpy_pool(hidden, mask, mode: str):
    """The reference pooling, written apart from the graph's so that a pooling bug cannot hide in both."""
    import numpy as np

    if mode == "cls":
        return hidden[:, 0]
    out = np.zeros((hidden.shape[0], hidden.shape[-1]), dtype=np.float64)
    for i in range(hidden.shape[0]):
        real = hidden[i][mask[i].astype(bool)].astype(np.float64)
        out[i] = real.mean(axis=0)
    return out


def encoder_parity(model_dir: Path, onnx_path: Path, batches: list[list[list[int]]]) -> dict[str, Any]:
    """onnxruntime against transformers fp32 (its default attention) on the same ids; every batch is
    right-padded to its longest sequence with the model's pad token and a 0 mask.

    Returns max |delta| per output (hidden states over real tokens only: padded rows mean nothing), the
    minimum cosine similarity of the sentence embeddings, and for classifiers top-1 agreement: over the
    labels per sequence, or, for single-score rerankers, over each batch's candidates (batches of 2+).
    """
    import numpy as np
    import onnxruntime as ort
    import torch

    from .ort import session_options

    if not batches or any(not b or any(not s for s in b) for b in batches):
        raise ValueError("encoder parity needs non-empty batches of non-empty sequences")
    arch, model = load_encoder(Path(model_dir))
    cfg = model.config
    classifier = arch in CLASSIFIERS
    pooling = None if classifier else pooling_mode(Path(model_dir))
    pad_id = int(cfg.pad_token_id) if cfg.pad_token_id is not None else 0
    sess = ort.InferenceSession(str(onnx_path), sess_options=session_options(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    deltas: dict[str, float] = {n: 0.0 for n in names}
    cosines: list[float] = []
    agree: list[bool] = []
    top1_over = None
    for batch in batches:
        ids, mask = _pad(batch, pad_id)
        got = dict(zip(names, sess.run(names, {"input_ids": ids, "attention_mask": mask})))
        with torch.inference_mode():
            out = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), return_dict=True)
        if classifier:
            want = {"logits": out.logits.float().numpy()}
        else:
            h = out.last_hidden_state.float().numpy()
            want = {"last_hidden_state": h, "sentence_embedding": _numpy_pool(h, mask, pooling)}
        for n in names:
            d = np.abs(got[n].astype(np.float64) - want[n].astype(np.float64))
            if n == "last_hidden_state":
                d = d[mask.astype(bool)]
            deltas[n] = max(deltas[n], float(d.max()))
        if "sentence_embedding" in got:
            a, b = got["sentence_embedding"].astype(np.float64), want["sentence_embedding"].astype(np.float64)
            cos = (a * b).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-30)
            cosines += cos.tolist()
        if classifier:
            g, w = got["logits"], want["logits"]
            if g.shape[-1] > 1:
                top1_over = "labels"
                agree += (g.argmax(-1) == w.argmax(-1)).tolist()
            elif len(batch) > 1:
                top1_over = "batch"
                agree.append(bool(g[:, 0].argmax() == w[:, 0].argmax()))
    return {
        "architecture": arch,
        "batches": len(batches),
        "sequences": sum(len(b) for b in batches),
        "padded_batches": sum(1 for b in batches if len({len(s) for s in b}) > 1),
        "max_abs_delta": deltas,
        "min_cosine": min(cosines) if cosines else None,
        "top1_agreement": (sum(agree) / len(agree)) if agree else None,
        "top1_over": top1_over,
        "pooling": pooling,
    }
