"""AI 100 encoder export (pipelines/targets/qaic/encoders.py): the five embedding / reranker architectures of
the seed as tiny random models, exported to ONNX and run in onnxruntime against transformers fp32 on the
same ids, padded batches included; the graph contract; external data; refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from pipelines.core.errors import ModelFormatError, NotApplicableError
from pipelines.targets.qaic.encoders import (
    CLASSIFIERS,
    ENCODERS,
    OPSET,
    architecture,
    encoder_parity,
    export_encoder,
    run_ort,
)

VOCAB = 128
TOL = 1e-4

# case id -> (architecture, config overrides). Hidden sizes differ so a shape mix-up cannot pass.
CASES = {
    "BertModel": ("BertModel", dict(hidden_size=32)),
    "MPNetForMaskedLM": ("MPNetForMaskedLM", dict(hidden_size=48)),
    "RobertaModel": ("RobertaModel", dict(hidden_size=64)),
    "XLMRobertaModel": ("XLMRobertaModel", dict(hidden_size=32)),
    "XLMRobertaForSequenceClassification": ("XLMRobertaForSequenceClassification", dict(hidden_size=48, num_labels=1)),
    "XLMRobertaForSequenceClassification-3labels": ("XLMRobertaForSequenceClassification",
                                                    dict(hidden_size=32, num_labels=3)),
}


def _classes(arch: str):
    import transformers as t

    cfg = {"BertModel": t.BertConfig, "MPNetForMaskedLM": t.MPNetConfig, "RobertaModel": t.RobertaConfig,
           "XLMRobertaModel": t.XLMRobertaConfig, "XLMRobertaForSequenceClassification": t.XLMRobertaConfig}[arch]
    return cfg, getattr(t, arch)


def _perturb(model, seed: int) -> None:
    """Random init leaves biases at 0 and LayerNorm at 1 (the exporter would even merge those equal
    tensors): give every parameter its own values so each one is exercised."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def make_encoder(dest: Path, arch: str, *, seed: int = 0, **overrides) -> Path:
    cfg_cls, model_cls = _classes(arch)
    params = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=40, initializer_range=0.2)
    params.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**params)).eval()
    _perturb(model, seed)
    model.save_pretrained(str(dest))
    return dest


def _ids(seed: int, *lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]  # 0..2: pad/bos/eos


# Longer than the export's sample (8) and batch sizes other than its 2: the axes must really be dynamic.
BATCHES = [_ids(1, 7, 3, 13, 1), _ids(2, 21), _ids(3, 5, 5)]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """case id -> (model_dir, report), built once per module."""
    root = tmp_path_factory.mktemp("encoders")
    done = {}
    for i, (case, (arch, overrides)) in enumerate(CASES.items()):
        model_dir = make_encoder(root / case, arch, seed=i, **overrides)
        done[case] = (model_dir, export_encoder(model_dir, root / case / "onnx" / "model.onnx"))
    return done


@pytest.mark.parametrize("case", list(CASES))
def test_ort_parity_with_transformers_padded_batches_included(case, exported):
    model_dir, rep = exported[case]
    parity = encoder_parity(model_dir, Path(rep.path), BATCHES)
    print(case, parity)
    assert parity["padded_batches"] >= 1 and parity["sequences"] == sum(len(b) for b in BATCHES)
    assert set(parity["max_abs_delta"]) == set(rep.outputs)
    for name, delta in parity["max_abs_delta"].items():
        assert delta < TOL, (name, delta)
    if rep.architecture in CLASSIFIERS:
        assert parity["top1_agreement"] == 1.0
        assert parity["top1_over"] == ("labels" if rep.num_labels > 1 else "batch")
    else:
        assert parity["min_cosine"] > 1 - 1e-6


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][0] not in CLASSIFIERS])
def test_padding_changes_nothing_for_real_tokens(case, exported):
    """Each sequence alone (no padding) and inside a padded batch give the same vectors."""
    model_dir, rep = exported[case]
    pad = json.loads((model_dir / "config.json").read_text())["pad_token_id"]
    batch = BATCHES[0]
    together = run_ort(Path(rep.path), batch, pad)
    worst = 0.0
    for i, seq in enumerate(batch):
        alone = run_ort(Path(rep.path), [seq], pad)
        worst = max(worst, float(np.abs(alone["last_hidden_state"][0] - together["last_hidden_state"][i, :len(seq)]).max()),
                    float(np.abs(alone["sentence_embedding"][0] - together["sentence_embedding"][i]).max()))
    print(case, "padded vs alone", worst)
    assert worst < 1e-5


def _dims(value_info) -> list:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


@pytest.mark.parametrize("case", list(CASES))
def test_graph_follows_the_contract(case, exported):
    model_dir, rep = exported[case]
    m = onnx.load(rep.path)
    onnx.checker.check_model(m)
    assert [(o.domain, o.version) for o in m.opset_import] == [("", OPSET)] and OPSET == 17
    assert {n.domain for n in m.graph.node} <= {"", "ai.onnx"}  # standard ops only
    inputs = {i.name: i for i in m.graph.input}
    outputs = {o.name: o for o in m.graph.output}
    assert list(inputs) == ["input_ids", "attention_mask"]
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden = cfg["hidden_size"]
    for v in inputs.values():
        assert _dims(v) == ["batch_size", "seq_len"] and v.type.tensor_type.elem_type == onnx.TensorProto.INT64
    if rep.architecture in CLASSIFIERS:
        assert list(outputs) == rep.outputs == ["logits"]
        assert _dims(outputs["logits"]) == ["batch_size", cfg["num_labels"] if "num_labels" in cfg else
                                            len(cfg["id2label"])]
    else:
        assert list(outputs) == rep.outputs == ["last_hidden_state", "sentence_embedding"]
        assert _dims(outputs["last_hidden_state"]) == ["batch_size", "seq_len", hidden]
        assert _dims(outputs["sentence_embedding"]) == ["batch_size", hidden]
        assert rep.pooling == "mean"
    assert all(o.type.tensor_type.elem_type == onnx.TensorProto.FLOAT for o in outputs.values())
    assert (rep.hidden_size, rep.layers, rep.external_data, rep.files) == (hidden, 2, False, ["model.onnx"])
    offset = 0 if rep.architecture == "BertModel" else cfg["pad_token_id"] + 1
    assert rep.max_positions == cfg["max_position_embeddings"] - offset
    # Weights are fp32 initializers, not inputs nor big Constant nodes; every weight matrix is there.
    inits = list(m.graph.initializer)
    assert all(i.data_type == onnx.TensorProto.FLOAT for i in inits if len(i.dims) == 2)
    matrices = sum(1 for i in inits if len(i.dims) == 2 and min(i.dims) >= hidden // 2)
    assert matrices >= 6 * 2 + 2  # q, k, v, o, up, down per layer; word and position embeddings
    assert not set(inputs) & {i.name for i in inits}
    big_constants = [n.name for n in m.graph.node if n.op_type == "Constant"
                     for a in n.attribute if a.name == "value" and a.t.data_type == onnx.TensorProto.FLOAT
                     and int(np.prod(a.t.dims)) > 256]
    assert big_constants == []
    meta = {p.key: p.value for p in m.metadata_props}
    assert meta["hive_aot.architecture"] == rep.architecture


def test_external_data_with_a_lowered_threshold(tmp_path):
    model_dir = make_encoder(tmp_path / "bert", "BertModel", seed=7)
    out = tmp_path / "onnx" / "model.onnx"
    rep = export_encoder(model_dir, out, external_data_threshold=16 * 1024)
    assert rep.external_data and rep.files == ["model.onnx", "model.onnx.data"]
    assert rep.weight_bytes > 16 * 1024
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.onnx", "model.onnx.data"]  # no temp leftovers
    data = out.parent / "model.onnx.data"
    assert data.stat().st_size >= rep.weight_bytes * 0.9 > out.stat().st_size
    assert data.stat().st_mode == out.stat().st_mode  # readable by whoever can read the .onnx
    m = onnx.load(str(out), load_external_data=False)
    external = [i for i in m.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
    assert len(external) >= 6 * 2
    assert {e.value for i in external for e in i.external_data if e.key == "location"} == {"model.onnx.data"}
    parity = encoder_parity(model_dir, out, BATCHES[:1])
    print("external data", parity)
    assert max(parity["max_abs_delta"].values()) < TOL
    # Moved elsewhere, the pair still loads: the location is relative.
    moved = tmp_path / "moved"
    moved.mkdir()
    for f in rep.files:
        (out.parent / f).rename(moved / f)
    assert run_ort(moved / "model.onnx", BATCHES[0], 0)["sentence_embedding"].shape == (4, 32)
    # Re-exported under the default threshold to the same path: one file, the stale data file gone.
    rep2 = export_encoder(model_dir, moved / "model.onnx")
    assert not rep2.external_data and sorted(p.name for p in moved.iterdir()) == ["model.onnx"]


def test_cls_pooling_from_sentence_transformers_config(tmp_path):
    model_dir = make_encoder(tmp_path / "bge-like", "BertModel", seed=3)
    (model_dir / "1_Pooling").mkdir()
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    rep = export_encoder(model_dir, tmp_path / "model.onnx")
    assert rep.pooling == "cls"
    out = run_ort(Path(rep.path), BATCHES[0], 0)
    assert np.array_equal(out["sentence_embedding"], out["last_hidden_state"][:, 0])
    parity = encoder_parity(model_dir, Path(rep.path), BATCHES)
    print("cls pooling", parity)
    assert parity["pooling"] == "cls" and max(parity["max_abs_delta"].values()) < TOL


def test_mpnet_saved_by_sentence_transformers_loads_every_weight(tmp_path):
    """sentence-transformers stores the bare MPNetModel's weights under an MPNetForMaskedLM config: all of
    them must be read (ORT equals the original in-memory model), none random-filled."""
    import transformers as t

    torch.manual_seed(5)
    base = t.MPNetModel(t.MPNetConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=40, initializer_range=0.2),
                        add_pooling_layer=False).eval()
    _perturb(base, 5)
    base.save_pretrained(str(tmp_path / "st-mpnet"))
    cfg_path = tmp_path / "st-mpnet" / "config.json"  # save_pretrained writes its own class name
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "architectures": ["MPNetForMaskedLM"]}))
    assert not any(k.startswith("mpnet.") for k in _safetensors_keys(tmp_path / "st-mpnet"))
    rep = export_encoder(tmp_path / "st-mpnet", tmp_path / "model.onnx")
    ids, lengths = BATCHES[0], [len(s) for s in BATCHES[0]]
    got = run_ort(Path(rep.path), ids, base.config.pad_token_id)
    with torch.inference_mode():
        for i, seq in enumerate(ids):
            want = base(input_ids=torch.tensor([seq])).last_hidden_state[0].numpy()
            delta = float(np.abs(got["last_hidden_state"][i, :lengths[i]] - want).max())
            assert delta < TOL, (i, delta)


def _safetensors_keys(model_dir: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return list(f.keys())


def test_checkpoint_missing_a_weight_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = make_encoder(tmp_path / "roberta", "RobertaModel", seed=4)
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    victim = next(k for k in tensors if "layer.1.attention" in k and k.endswith("query.weight"))
    del tensors[victim]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ModelFormatError, match="lacks weights") as e:
        export_encoder(model_dir, tmp_path / "model.onnx")
    assert "\n" not in str(e.value) and "query.weight" in str(e.value)
    assert not (tmp_path / "model.onnx").exists()


def test_pickle_weights_are_not_read(tmp_path):
    model_dir = make_encoder(tmp_path / "bert", "BertModel", seed=6)
    (model_dir / "model.safetensors").unlink()
    torch.save({}, model_dir / "pytorch_model.bin")
    with pytest.raises(ModelFormatError, match="safetensors"):
        export_encoder(model_dir, tmp_path / "model.onnx")


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "BertForMaskedLM", "XLMRobertaForMaskedLM", None])
def test_unsupported_architectures_are_refused_in_one_line(arch, tmp_path):
    cfg = {"model_type": "bert", "hidden_size": 32}
    if arch:
        cfg["architectures"] = [arch]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert arch not in ENCODERS
    with pytest.raises(NotApplicableError) as e:
        export_encoder(tmp_path, tmp_path / "model.onnx")
    assert "\n" not in str(e.value) and (arch or "no architecture") in str(e.value)
    with pytest.raises(NotApplicableError):
        encoder_parity(tmp_path, tmp_path / "model.onnx", [[[5, 6]]])


def test_the_seed_architectures_are_the_supported_set(tmp_path):
    expected = {"BertModel", "MPNetForMaskedLM", "RobertaModel", "XLMRobertaModel", "XLMRobertaForSequenceClassification"}
    assert ENCODERS == expected and {a for a, _ in CASES.values()} == expected
    for arch in expected:
        (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch]}))
        assert architecture(tmp_path) == arch


def test_an_encoder_with_a_nan_weight_is_refused_before_export(tmp_path):
    """Red team round two, item 3: an encoder is exported by torch from loaded weights, so nothing looked at them."""
    from factories import poison_weights

    from pipelines.core.errors import ModelFormatError
    from pipelines.source.fetch import fetch
    from pipelines.targets.qaic import _refuse_bad_source

    model_dir = make_encoder(tmp_path / "bert", "BertModel", seed=5)
    poison_weights(model_dir, "embeddings.word_embeddings.weight", float("nan"))
    snap = fetch(str(model_dir), "test-org/nan-bert", hashed=False)
    with pytest.raises(ModelFormatError, match="tensor embeddings.word_embeddings.weight holds NaN/Inf"):
        _refuse_bad_source(snap, snap.config())
