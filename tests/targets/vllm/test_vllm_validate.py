"""The validation of a prepared vLLM directory (pipelines/targets/vllm/validate.py), its own logic on tiny
inputs: the artifact in transformers (`evaluate`: logits, greedy continuations, weight errors; resident, in a
child process, kept memory-mapped, as a layer slice) and the engine's answers compared with transformers
(`compare_engine`: positions, top-1, log-probabilities, greedy ties). The truths are computed here in plain
transformers, torch and numpy. Starting the real vLLM (validate_prepared end to end) is
tests/targets/vllm/test_vllm_engine.py's, once per session.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pipelines.core.errors import EngineFailed, HiveError
from pipelines.targets.vllm.validate import compare_engine, evaluate
from pipelines.validation import prompts

PERTURBED = "model.layers.1.mlp.down_proj.weight"


# --- compare_engine: what vLLM answered against transformers on the same files -------------------------------------

def log_softmax(x: np.ndarray) -> np.ndarray:
    return torch.log_softmax(torch.from_numpy(np.asarray(x, dtype=np.float64)), dim=-1).numpy()


def engine_rows(logits: np.ndarray, seq: list[int]) -> list[list[float]]:
    """What a faithful engine reports for a teacher-forced sequence: at row p, its top token and that token's
    log-probability, and the log-probability of the token that follows (seq[p + 1])."""
    lp = log_softmax(logits)
    return [[int(lp[p].argmax()), float(lp[p].max()), float(lp[p, seq[p + 1]])] for p in range(len(seq) - 1)]


def greedy_of(ids, logprobs, gaps=None) -> dict:
    return {"ids": list(ids), "logprobs": list(logprobs), **({"gaps": list(gaps)} if gaps is not None else {})}


@pytest.fixture
def teacher_forced():
    """Two sequences over a 13-token vocabulary: transformers' logits, the source reference's (its top token
    differs at two positions) and three greedy prompts vLLM reproduced exactly."""
    rng = np.random.default_rng(11)
    ids = [rng.integers(0, 13, 7).tolist(), rng.integers(0, 13, 4).tolist()]
    tf = [rng.standard_normal((len(s), 13)).astype(np.float32) for s in ids]
    ref = [lg.copy() for lg in tf]
    ref[0][[1, 4]] *= -1  # the source's reference picks another top token at two positions
    greedy = [greedy_of([3, 4, 5], [-0.1, -0.2, -0.3], [0.5, 0.5, 0.5]) for _ in prompts.GREEDY_PROMPTS]
    return ids, tf, ref, greedy


def test_a_faithful_engine_agrees_everywhere_and_the_reference_is_counted_apart(teacher_forced):
    ids, tf, ref, greedy = teacher_forced
    result = {"sequences": [engine_rows(lg, s) for lg, s in zip(tf, ids)], "greedy": greedy,
              "vllm": "0.32.0+cpu", "load_seconds": 4.2, "cached": True}
    metrics, details = compare_engine(tf, ids, greedy, result, ref)
    # the first position of a prompt has no prediction: vLLM reports len - 1 rows per sequence
    assert metrics["vllm_positions"] == (7 - 1) + (4 - 1)
    assert metrics["vllm_top1_agreement"] == 1.0 and metrics["vllm_max_logprob_delta"] < 1e-6
    ref_agree = sum(int(r[p].argmax() == t[p].argmax()) for r, t, s in zip(ref, tf, ids) for p in range(len(s) - 1))
    assert 0 < ref_agree < 9  # the two models do disagree somewhere: the count below means something
    assert metrics["vllm_reference_top1_agreement"] == pytest.approx(ref_agree / 9, abs=1e-6)
    assert metrics["vllm_greedy_agreement"] == 1.0 and metrics["vllm_greedy_tokens_matched"] == "9/9"
    assert details["engine"] == "0.32.0+cpu" and details["load_seconds"] == 4.2 and details["cached"] is True
    assert all(g["identical"] and g["diverged_at"] is None for g in details["greedy"])


def test_wrong_top_tokens_and_logprobs_are_counted(teacher_forced):
    """Two positions where vLLM's top token differs, and one log-probability 0.25 off: 7 of 9 agree and the
    largest delta is that 0.25. An engine that scored each position's own token instead of the next one (an
    off-by-one) is far off."""
    ids, tf, ref, greedy = teacher_forced
    rows = [engine_rows(lg, s) for lg, s in zip(tf, ids)]
    rows[0][1][0] = (rows[0][1][0] + 1) % 13
    rows[1][2][0] = (rows[1][2][0] + 5) % 13
    rows[0][4][2] -= 0.25
    metrics, _ = compare_engine(tf, ids, greedy, {"sequences": rows, "greedy": greedy}, ref)
    assert metrics["vllm_top1_agreement"] == pytest.approx(7 / 9, abs=1e-6)
    assert metrics["vllm_max_logprob_delta"] == pytest.approx(0.25, abs=1e-5)

    shifted = [[[r[0], r[1], float(log_softmax(lg)[p, s[p]])] for p, r in enumerate(engine_rows(lg, s))]
               for lg, s in zip(tf, ids)]
    off_by_one, _ = compare_engine(tf, ids, greedy, {"sequences": shifted, "greedy": greedy}, ref)
    assert off_by_one["vllm_max_logprob_delta"] > 0.5


@pytest.mark.parametrize("cut", ["a sequence", "a position", "a greedy run"])
def test_an_engine_result_that_leaves_questions_out_is_refused(teacher_forced, cut):
    """Answers the engine left out must not drop out of the comparison and raise the agreement."""
    ids, tf, ref, greedy = teacher_forced
    rows = [engine_rows(lg, s) for lg, s in zip(tf, ids)]
    answered = list(greedy)
    if cut == "a sequence":
        rows = rows[:1]
    elif cut == "a position":
        rows[1] = rows[1][:-1]
    else:
        answered = answered[:-1]
    with pytest.raises(EngineFailed, match="an incomplete result") as e:
        compare_engine(tf, ids, greedy, {"sequences": rows, "greedy": answered}, ref)
    assert "\n" not in str(e.value)


def test_greedy_divergence_at_a_near_tie_is_not_an_engine_error():
    logits = [np.array([[0.0, 1.0, 0.5], [2.0, 0.0, 0.0]], dtype=np.float32)]
    ids = [[0, 1, 0]]
    run = {"sequences": [[[1, -0.7, -0.7], [0, -0.24, -0.24]]], "greedy": []}
    ref = {"ids": [1, 2], "logprobs": [-0.5, -0.6], "gaps": [0.5, 0.0004]}
    same = {"ids": [1, 2], "logprobs": [-0.5, -0.6]}
    tie = {"ids": [1, 0], "logprobs": [-0.5, -0.6]}
    real = {"ids": [0, 0], "logprobs": [-0.9, -0.6]}
    metrics, details = compare_engine(logits, ids, [ref, ref, ref], {**run, "greedy": [same, tie, real]}, logits)
    assert [d["identical"] for d in details["greedy"]] == [True, False, False]
    assert [d["near_tie"] for d in details["greedy"]] == [False, True, False]
    assert metrics["vllm_greedy_agreement"] == pytest.approx(2 / 3, abs=1e-5)
    assert metrics["vllm_top1_agreement"] == 1.0 and metrics["vllm_greedy_tokens_matched"] == "3/6"


def test_greedy_divergences_that_are_engine_errors(teacher_forced):
    """A divergence where transformers' two best tokens were 0.01 apart (ten times a numerical tie), and a
    continuation that stopped early (as at an EOS the engine should have ignored), both fail; log-probabilities
    after a divergence are not compared (the contexts differ), those before are."""
    ids, tf, ref_logits, _ = teacher_forced
    ref = greedy_of([3, 4, 5, 6], [-0.1, -0.2, -0.3, -0.4], [0.5, 0.01, 0.5, 0.5])
    not_a_tie = greedy_of([3, 9, 9, 9], [-0.1, -7.0, -7.0, -7.0])
    stopped = greedy_of([3, 4], [-0.1, -0.2])
    drifted = greedy_of([3, 4, 5, 6], [-0.1, -0.2, -0.36, -0.4])  # identical ids, one logprob 0.06 off
    result = {"sequences": [engine_rows(lg, s) for lg, s in zip(tf, ids)], "greedy": [not_a_tie, stopped, drifted]}
    metrics, details = compare_engine(tf, ids, [ref, ref, ref], result, ref_logits)
    g = details["greedy"]
    assert [(p["identical"], p["diverged_at"], p["near_tie"]) for p in g] == [(False, 1, False), (False, 2, False),
                                                                            (True, None, False)]
    assert [p["prompt"] for p in g] == prompts.GREEDY_PROMPTS
    assert g[0]["max_logprob_delta"] == 0.0  # -7.0 came after the divergence
    assert g[2]["max_logprob_delta"] == pytest.approx(0.06, abs=1e-6)
    assert metrics["vllm_greedy_agreement"] == pytest.approx(1 / 3, abs=1e-5)
    assert metrics["vllm_greedy_tokens_matched"] == f"{1 + 2 + 4}/{3 * 4}"
    assert metrics["vllm_max_logprob_delta"] == pytest.approx(0.06, abs=1e-6)  # the greedy drift counts too


# --- evaluate: the artifact in transformers ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def artifact(tiny_llama, tmp_path_factory) -> Path:
    """tiny-llama's directory with one weight moved off the source's (as a lossy preparation would): the other
    tensors are the source's bytes."""
    dest = tmp_path_factory.mktemp("vllm-validate") / "artifact"
    shutil.copytree(tiny_llama, dest)
    tensors = load_file(str(tiny_llama / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    w = tensors[PERTURBED]
    tensors[PERTURBED] = (w.float() + torch.randn(w.shape, generator=g) * 0.02).to(w.dtype)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


@pytest.fixture(scope="module")
def sequences(smollm2_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    return [tok(t).input_ids for t in prompts.PARITY_TEXTS[:2]]


def transformers_model(model_dir: Path, **config):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **config).eval()


def test_the_artifact_in_transformers_resident(artifact, tiny_llama, sequences):
    """Resident, in this process: the logits are transformers fp32's on the artifact's files, the greedy
    continuation is transformers' own argmax loop (EOS not stopping it, as vLLM runs with ignore_eos), and every
    weight's relative L2 error against the source is the one computed here: zero but for the tensor moved."""
    got = evaluate(artifact, [artifact / "model.safetensors"], [tiny_llama / "model.safetensors"], sequences,
                   [sequences[0][:6]], resident=True, step="tiny artifact in transformers")
    model = transformers_model(artifact)
    with torch.inference_mode():
        for seq, logits in zip(sequences, got["logits"]):
            np.testing.assert_allclose(logits, model(torch.tensor([seq])).logits[0].numpy(), atol=1e-4)
        ctx, want_ids, want_lp, want_gap = list(sequences[0][:6]), [], [], []
        for _ in range(prompts.GREEDY_TOKENS):
            lp = torch.log_softmax(model(torch.tensor([ctx])).logits[0, -1].double(), -1)
            top = torch.topk(lp, 2)
            want_ids.append(int(top.indices[0]))
            want_lp.append(float(top.values[0]))
            want_gap.append(float(top.values[0] - top.values[1]))
            ctx.append(want_ids[-1])
    (greedy,) = got["greedy"]
    assert greedy["ids"] == want_ids
    np.testing.assert_allclose(greedy["logprobs"], want_lp, atol=1e-4)
    np.testing.assert_allclose(greedy["gaps"], want_gap, atol=1e-4)

    source = load_file(str(tiny_llama / "model.safetensors"))
    moved = load_file(str(artifact / "model.safetensors"))
    assert set(got["weight_errors"]) == set(source)
    a, s = moved[PERTURBED].double().numpy(), source[PERTURBED].double().numpy()
    assert got["weight_errors"][PERTURBED] == pytest.approx(np.linalg.norm(a - s) / np.linalg.norm(s), rel=1e-5)
    assert got["weight_errors"][PERTURBED] > 0.01
    assert all(e == 0.0 for name, e in got["weight_errors"].items() if name != PERTURBED)


def test_streamed_in_a_child_and_kept_memory_mapped(artifact, sequences, tmp_path):
    """Streamed unit by unit in a child process, the logits are the resident ones; with `keep` they stay in that
    directory after the call and come back memory-mapped (the parent holds no copy while vLLM runs)."""
    files = [artifact / "model.safetensors"]
    resident = evaluate(artifact, files, None, sequences, [], resident=True, step="resident")
    keep = tmp_path / "keep"
    keep.mkdir()
    streamed = evaluate(artifact, files, None, sequences, [], resident=False, keep=keep, step="streamed")
    assert streamed["weight_errors"] == {} and streamed["greedy"] == []  # no source given, no prompts
    assert streamed["unit_loads"] > 0 and resident["unit_loads"] >= 0
    for a, b in zip(resident["logits"], streamed["logits"]):
        assert isinstance(b, np.memmap)
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert sorted(p.name for p in keep.glob("l*.npy")) == ["l0.npy", "l1.npy"]


def test_a_layer_slice_is_the_first_layers_in_transformers(artifact, sequences):
    """`layers=1`: the artifact's first decoder layer, then its final norm and head, as transformers computes a
    one-layer model from the same files (the engine's slice check compares against exactly this)."""
    got = evaluate(artifact, [artifact / "model.safetensors"], None, sequences[:1], [], resident=True, layers=1,
                   step="one-layer slice")
    model = transformers_model(artifact, num_hidden_layers=1)
    with torch.inference_mode():
        want = model(torch.tensor([sequences[0]])).logits[0].numpy()
        whole = transformers_model(artifact)(torch.tensor([sequences[0]])).logits[0].numpy()
    np.testing.assert_allclose(got["logits"][0], want, atol=1e-4)
    assert np.abs(whole - want).max() > 1e-2  # the second layer matters: the slice is not the whole model


def test_a_truncated_artifact_shard_is_refused_in_one_line(artifact, sequences, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(artifact, broken)
    shard = broken / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(HiveError) as e:
        evaluate(broken, [shard], None, sequences[:1], [], resident=True, step="a truncated artifact")
    msg = str(e.value)
    # the refusal names the file and what is missing from it, not a torch traceback
    assert "\n" not in msg and "model.safetensors: truncated safetensors file" in msg, msg
