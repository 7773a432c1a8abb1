"""Predicted quality of an AI 100 compile (pipelines/targets/qaic/quality.py): which weights the MXFP6 / fp16
emulation touches, the perplexity, agreement and KL it reports against fp32, the precision switches, the
streamed run, and the encoder prediction. The truths are computed here in plain transformers, torch and numpy
(fp16 rounding by numpy, perplexity by cross-entropy, mean pooling by hand); mx.py's quantizers are held to
known encodings in tests/targets/qaic/test_qaic_mx.py and serve here as the MXFP6 grid.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from factories import make_causal_lm, make_tiny_causal_lm

from pipelines.targets.qaic.mx import fake_mxfp6
from pipelines.targets.qaic.quality import fake_fp16, fake_mxfp6_weights, predict, predict_encoder

VOCAB = 512
# A tied Llama: the tied head is the case where emulating the head's MatMul must not touch the embedding.
LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=True,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory) -> Path:
    return make_causal_lm("LlamaConfig", "LlamaForCausalLM", LLAMA, tmp_path_factory.mktemp("quality") / "llama")


@pytest.fixture(scope="module")
def sequences() -> list[list[int]]:
    rng = random.Random(7)
    return [rng.sample(range(3, VOCAB), 19), rng.sample(range(3, VOCAB), 11)]


def transformers_logits(model_dir: Path, sequences: list[list[int]]) -> list[np.ndarray]:
    """fp32 logits of every position straight from transformers (no hive-aot code on this path)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(torch.tensor([s])).logits[0].double().numpy() for s in sequences]


def perplexity(sequences: list[list[int]], logits: list[np.ndarray]) -> float:
    """exp of the mean next-token cross-entropy over every sequence, in float64."""
    nll = [torch.nn.functional.cross_entropy(torch.from_numpy(lg[:-1]), torch.tensor(s[1:]), reduction="sum")
           for s, lg in zip(sequences, logits)]
    return math.exp(float(sum(nll)) / sum(len(s) - 1 for s in sequences))


def on_mxfp6_grid(w: torch.Tensor, axis: int) -> bool:
    """Whether `w` is already its own MXFP6 quantization in blocks along `axis` (an emulated weight is)."""
    moved = w.detach().movedim(axis, -1).contiguous()
    return torch.equal(fake_mxfp6(moved), moved)


# --- the emulated weights ----------------------------------------------------------------------------------------

def test_fake_fp16_is_ieee_half_rounding():
    """Round-to-nearest-even into float16 and back, as numpy does it: overflow to inf, subnormals kept, tiny
    values flushed, and the tensor's own dtype kept (the model stays fp32)."""
    rng = np.random.default_rng(3)
    values = np.concatenate([rng.standard_normal(500) * 10.0 ** rng.integers(-9, 5, 500),
                             [65504.0, 65520.0, 7e4, -7e4, 6e-8, 3e-8, 1e-9, 0.0, 1 + 2**-11, 1 + 3 * 2**-11]])
    x = values.astype(np.float32)
    got = fake_fp16(torch.from_numpy(x))
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), x.astype(np.float16).astype(np.float32))
    assert not np.array_equal(got.numpy(), x)  # the rounding really happened: the check can fail


def test_mxfp6_weights_cover_every_linear_and_leave_a_tied_embedding_fp32(tied_llama):
    """Every nn.Linear weight (the decoder's constant MatMuls, the tied head included) lands on the MXFP6 grid in
    blocks along its input axis; the embedding, a Gather on the device, keeps its fp32 values although the head
    shared its tensor; norms are untouched."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tied_llama), dtype=torch.float32).eval()
    embedding = model.model.embed_tokens.weight.detach().clone()
    norms = {n: p.detach().clone() for n, p in model.named_parameters() if "norm" in n}
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as the case needs
    assert not on_mxfp6_grid(model.lm_head.weight, -1)  # random weights are not on the grid: the check can fail
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]

    assert fake_mxfp6_weights(model) == len(linears) == 2 * 7 + 1
    assert all(on_mxfp6_grid(m.weight, -1) for m in linears)
    assert torch.equal(model.model.embed_tokens.weight, embedding)
    assert not torch.equal(model.lm_head.weight, embedding)
    assert all(torch.equal(p, norms[n]) for n, p in model.named_parameters() if "norm" in n)


def test_fp16_variant_rounds_the_same_weights_to_float16(tied_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tied_llama), dtype=torch.float32).eval()
    before = {n: p.detach().clone().numpy() for n, p in model.named_parameters()}
    before["lm_head.weight"] = before["model.embed_tokens.weight"]  # tied: listed once until the head gets its copy
    fake_mxfp6_weights(model, quantize=fake_fp16)
    rounded = [n for n, _ in model.named_parameters() if n.endswith("_proj.weight") or n == "lm_head.weight"]
    assert len(rounded) == 2 * 7 + 1
    for name, p in model.named_parameters():
        expected = before[name].astype(np.float16).astype(np.float32) if name in rounded else before[name]
        np.testing.assert_array_equal(p.detach().numpy(), expected, err_msg=name)


def test_blocks_follow_each_weights_reduction_axis_in_chunks_of_rows():
    """GPT-2's Conv1D is [in, out]: its blocks run down the columns. A spike shares its block with the values
    after it along the input axis (they flush to 0) and with nothing across it; chunking the rows
    (`rows=2`, as a 128k-vocabulary head is done) gives the same bytes as one piece."""
    from pipelines.targets.qaic.quality import _blockwise

    conv = torch.full((64, 3), 0.01)
    conv[0, 0] = 100.0  # in block rows 0..31 of column 0
    conv[1, 0] = conv[0, 1] = conv[40, 0] = 0.5
    q = _blockwise(fake_mxfp6, conv, axis=0, rows=2)
    assert q[1, 0] == 0.0  # same block as the spike: below its 2^-? step
    assert q[0, 1] == 0.5 and q[40, 0] == 0.5  # another column, another block of the same column
    experts = torch.randn(3, 40, 70)  # stacked experts [E, in, out], reduced along axis 1
    whole = fake_mxfp6(experts.movedim(1, -1).contiguous()).movedim(-1, 1)
    assert torch.equal(_blockwise(fake_mxfp6, experts, axis=1, rows=3), whole)
    assert not torch.equal(_blockwise(fake_mxfp6, experts, axis=2, rows=3), whole)  # the axis matters


# --- the prediction of a decoder -------------------------------------------------------------------------------

def test_prediction_reports_perplexity_agreement_and_kl_against_transformers(tied_llama, sequences):
    """Emulation off, the retained-state decoder equals transformers and both perplexities are the one computed
    here; given reference logits (another model's, so they disagree), every number is taken against them."""
    truth = transformers_logits(tied_llama, sequences)
    plain = predict(tied_llama, sequences, mxfp6=False, mxint8=False, fp16=False)
    assert plain["positions"] == sum(map(len, sequences)) and plain["top1"] == 1.0 and plain["kl"] < 1e-9
    assert plain["ppl_fp32"] == pytest.approx(perplexity(sequences, truth), rel=1e-4)
    assert plain["ppl"] == pytest.approx(plain["ppl_fp32"], rel=1e-5) and plain["emulated"] == []

    rng = np.random.default_rng(5)
    other = [lg + rng.standard_normal(lg.shape) for lg in truth]  # a different "fp32 reference"
    vs_other = predict(tied_llama, sequences, mxfp6=False, mxint8=False, fp16=False, reference_logits=other)
    agree = np.concatenate([a.argmax(-1) == b.argmax(-1) for a, b in zip(other, truth)]).mean()
    assert vs_other["top1"] == pytest.approx(agree, abs=1e-6) and vs_other["top1"] < 1.0
    assert vs_other["ppl_fp32"] == pytest.approx(perplexity(sequences, other), rel=1e-4)
    assert vs_other["ppl"] == pytest.approx(plain["ppl"], rel=1e-5)  # the emulated side does not move
    kl = np.concatenate([(np.exp(lp) * (lp - lq)).sum(-1) for lp, lq in
                         ((torch.log_softmax(torch.from_numpy(o), -1).numpy(), torch.log_softmax(torch.from_numpy(t), -1).numpy())
                          for o, t in zip(other, truth))]).mean()
    assert vs_other["kl"] == pytest.approx(kl, rel=1e-3)
    # logits are defined up to a per-position shift: the delta is taken between row-centred logits
    delta = max(float(np.abs((o - o.mean(-1, keepdims=True)) - (t - t.mean(-1, keepdims=True))).max())
                for o, t in zip(other, truth))
    assert vs_other["max_abs_logit_delta"] == pytest.approx(delta, rel=1e-3)


def test_each_precision_switch_moves_the_prediction_by_its_own_rounding(tied_llama, sequences):
    """KL against fp32 grows with the rounding each switch stands for: float16 weights and cache (11-bit
    significands) < an MXINT8 cache (7-bit, a scale per 32) < MXFP6 weights too (3-bit). A switch that did
    nothing would leave two of these equal; the perplexity moves with the emulation, not the reference."""
    fp16 = predict(tied_llama, sequences, mxfp6=False, mxint8=False, fp16=True)
    kv_only = predict(tied_llama, sequences, mxfp6=False, mxint8=True, fp16=False)
    mxint8 = predict(tied_llama, sequences, mxfp6=False, mxint8=True, fp16=True)
    both = predict(tied_llama, sequences)
    assert 0 < fp16["kl"] < mxint8["kl"] < both["kl"] < 0.5, (fp16, mxint8, both)
    assert 0 < kv_only["kl"] and kv_only["kl"] != mxint8["kl"]  # the cache alone, weights left fp32
    assert fp16["max_abs_logit_delta"] < 1e-2 < both["max_abs_logit_delta"]
    assert len({r["ppl_fp32"] for r in (fp16, kv_only, mxint8, both)}) == 1
    assert both["ppl"] != both["ppl_fp32"]
    assert fp16["emulated"] == ["fp16 weights", "float16 kv cache"]
    assert both["emulated"] == ["mxfp6 weights", "mxint8 kv cache"]


def test_quality_prediction_of_a_moe_family(tmp_path):
    """quality.predict on a non-Llama family: the decoder alone equals transformers; MXFP6 + MXINT8 move it."""
    model_dir = make_tiny_causal_lm("gpt_oss", tmp_path / "gpt_oss")
    rng = random.Random(0)
    ids = [rng.sample(range(512), 24), rng.sample(range(512), 20)]
    off = predict(model_dir, ids, mxfp6=False, mxint8=False, fp16=False)
    both = predict(model_dir, ids)
    assert off["positions"] == 44 and off["top1"] == 1.0 and off["max_abs_logit_delta"] < 1e-3
    assert both["max_abs_logit_delta"] > 1e-3 and both["kl"] > 0
    assert both["emulated"] == ["mxfp6 weights", "mxint8 kv cache"]


def test_quality_prediction_streams_unit_by_unit_with_the_same_numbers(tmp_path):
    """Streamed (each weight emulated as it loads, every sequence through a layer before the next is read) the
    prediction equals the resident one: one pass over the weights whatever the number of sequences."""
    model_dir = make_tiny_causal_lm("gpt2", tmp_path / "gpt2")  # Conv1D weights (MXFP6 along axis 0)
    rng = random.Random(1)
    ids = [rng.sample(range(512), 20), rng.sample(range(512), 13), rng.sample(range(512), 17)]
    resident = predict(model_dir, ids, resident=True)
    streamed = predict(model_dir, ids, resident=False)
    for key in ("top1", "kl", "max_abs_logit_delta", "ppl_delta"):
        assert abs(resident[key] - streamed[key]) <= 1e-5 * max(1.0, abs(resident[key])), key
    assert streamed["resident"] is False and streamed["unit_loads"] == 2 + 2 + 2  # wte, wpe, 2 blocks, ln_f, lm_head
    assert 0 < streamed["kl"] and streamed["emulated"] == ["mxfp6 weights", "mxint8 kv cache"]


@pytest.mark.parametrize("name", ["gpt2", "gpt_bigcode", "falcon", "mixtral", "gpt_oss"])
def test_mxfp6_emulation_covers_every_constant_matmul_weight(name, tmp_path):
    """After quality.fake_mxfp6_weights, every constant MatMul/Gemm weight of the exported graph (what
    `-mxfp6-matmul` compresses: linear layers, GPT-2's Conv1D, MoE routers and experts, lm_head) is already
    on the MXFP6 grid in blocks along its reduction axis; only attention's two MatMuls per layer and the
    last-position pick read no constant."""
    import onnx
    from onnx import numpy_helper

    from pipelines.targets.qaic.decoder import build_decoder
    from pipelines.targets.qaic.export import export_decoder
    from pipelines.validation import reference

    model = reference.load_model(make_tiny_causal_lm(name, tmp_path / name))
    assert not on_mxfp6_grid(model.lm_head.weight, -1)  # random weights are not: the check can fail
    assert fake_mxfp6_weights(model) >= 2 * 4 + 1
    out = tmp_path / "model.onnx"
    export_decoder(build_decoder(model), out, ctx_len=16)
    m = onnx.load(str(out))
    weights = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    stored_as = {n.output[0]: n.input[0] for n in m.graph.node if n.op_type == "Cast" and n.input[0] in weights}
    checked, dynamic = 0, 0
    for node in m.graph.node:
        if node.op_type not in ("MatMul", "Gemm"):
            continue
        b = weights.get(stored_as.get(node.input[1], node.input[1]))  # fp16 matrices are read through a Cast
        if b is None:
            dynamic += 1
            continue
        trans_b = any(a.name == "transB" and a.i for a in node.attribute)
        # MatMul's B is [K, N]: the reduction axis is 0 unless transposed
        assert on_mxfp6_grid(torch.from_numpy(np.ascontiguousarray(b)), -1 if trans_b else 0), (name, node.name, b.shape)
        checked += 1
    assert dynamic == 2 * 2 + 1 and checked >= 2 * 4 + 1


@pytest.mark.slow
def test_demo_model_quality_prediction(smollm2_dir):
    from pipelines.validation import prompts, reference

    ids = reference.encode(reference.load_tokenizer(smollm2_dir), prompts.PARITY_TEXTS[:2])
    both = predict(smollm2_dir, ids)
    off = predict(smollm2_dir, ids[:1], mxfp6=False, mxint8=False, fp16=False)
    assert off["top1"] == 1.0 and off["max_abs_logit_delta"] < 1e-3  # the decoder itself equals transformers
    assert 0.8 < both["top1"] < 1.0 and 0 < both["kl"] < 0.2 and both["ppl_delta"] > 0
    assert both["emulated"] == ["mxfp6 weights", "mxint8 kv cache"]


# --- the prediction of an encoder ------------------------------------------------------------------------------

ENCODER = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               max_position_embeddings=40, initializer_range=0.2)
BATCHES = [[[5, 9, 17, 33, 64, 2], [7, 8, 9]], [[100, 3, 44, 21, 90, 91, 92, 93, 11]]]


def _encoder(dest: Path, arch: str, **overrides) -> Path:
    import transformers

    cfg = {"BertModel": transformers.BertConfig,
           "XLMRobertaForSequenceClassification": transformers.XLMRobertaConfig}[arch](**{**ENCODER, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, arch)(cfg).eval()
    with torch.no_grad():  # random init leaves biases at 0 and norms at 1: give each parameter its own values
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * 0.05)
    model.save_pretrained(str(dest))
    return dest


def _encode(model, batches, classifier: bool) -> list[np.ndarray]:
    """Mean-pooled sentence embeddings (or classifier logits) of right-padded batches, computed here."""
    out = []
    with torch.inference_mode():
        for batch in batches:
            width = max(map(len, batch))
            ids = torch.tensor([s + [model.config.pad_token_id] * (width - len(s)) for s in batch])
            mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in batch])
            res = model(input_ids=ids, attention_mask=mask)
            if classifier:
                out.append(res.logits.double().numpy())
            else:
                h = res.last_hidden_state.double()
                out.append(((h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)).numpy())
    return out


def _round_linears(model, quantize) -> None:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(quantize(m.weight))


def test_encoder_prediction_against_embeddings_computed_here(tmp_path):
    """fp16 weights: the cosines and the largest |delta| are those of mean-pooled embeddings computed here with
    numpy's float16 rounding of every Linear weight; MXFP6 loses more than fp16 does."""
    from transformers import BertModel

    d = _encoder(tmp_path / "bert", "BertModel")
    ref_model = BertModel.from_pretrained(str(d), dtype=torch.float32).eval()
    ref = _encode(ref_model, BATCHES, classifier=False)
    _round_linears(ref_model, lambda w: torch.from_numpy(w.numpy().astype(np.float16).astype(np.float32)))
    got = _encode(ref_model, BATCHES, classifier=False)
    a, b = np.concatenate(ref), np.concatenate(got)
    cos = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))

    fp16 = predict_encoder(d, BATCHES, mxfp6=False)
    assert fp16["sequences"] == 3 and fp16["top1"] is None and fp16["emulated"] == ["fp16 weights"]
    assert fp16["cosine_min"] == pytest.approx(cos.min(), abs=1e-7)
    assert fp16["cosine_mean"] == pytest.approx(cos.mean(), abs=1e-7)
    assert fp16["max_abs_delta"] == pytest.approx(np.abs(a - b).max(), rel=1e-2) and fp16["max_abs_delta"] > 0
    mx = predict_encoder(d, BATCHES)
    assert mx["cosine_min"] < fp16["cosine_min"] < 1.0 and mx["max_abs_delta"] > fp16["max_abs_delta"]


def test_reranker_prediction_reports_top1_over_its_labels(tmp_path):
    """A 3-label classifier: top-1 agreement of its logits with MXFP6 weights, counted here; a one-label reranker
    (a score, no argmax) has none."""
    from transformers import XLMRobertaForSequenceClassification

    d = _encoder(tmp_path / "xlmr3", "XLMRobertaForSequenceClassification", num_labels=3, hidden_size=48)
    model = XLMRobertaForSequenceClassification.from_pretrained(str(d), dtype=torch.float32).eval()
    ref = _encode(model, BATCHES, classifier=True)
    _round_linears(model, fake_mxfp6)
    got = _encode(model, BATCHES, classifier=True)
    agree = np.concatenate([r.argmax(-1) == g.argmax(-1) for r, g in zip(ref, got)]).mean()
    res = predict_encoder(d, BATCHES)
    assert res["top1"] == pytest.approx(agree) and res["sequences"] == 3
    assert res["max_abs_delta"] == pytest.approx(max(np.abs(r - g).max() for r, g in zip(ref, got)), rel=1e-2)

    one = _encoder(tmp_path / "xlmr1", "XLMRobertaForSequenceClassification", num_labels=1)
    assert predict_encoder(one, BATCHES)["top1"] is None
