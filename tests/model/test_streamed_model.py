"""The streamed transformers reference (pipelines/model/streamed_model.py) against transformers' own loading.

Every family the project builds (GGUF: Llama, Mistral, Qwen2; AI 100 and vLLM: the TINY_CAUSAL_LMS
list, MoE included) gives the same logits and greedy ids streamed block by block as `from_pretrained`
in memory, and streaming really reads each block once per pass.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from factories import TINY_CAUSAL_LMS, make_tiny_causal_lm

from pipelines.core.errors import ModelFormatError
from pipelines.model.streamed_model import StreamedCausalLM, weight_rules
from pipelines.validation import reference

IDS = [1, 5, 9, 33, 200, 7, 8, 100, 45, 3, 2, 300, 17, 18, 411, 64]
GEN_PROMPT = IDS[:5]

# The GGUF families, tiny (the AI 100 list in factories has the others).
_DENSE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2)
EXTRA = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_DENSE, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_DENSE, sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_DENSE)),  # q/k/v biases
}


def _make(name: str, dest: Path) -> Path:
    if name in TINY_CAUSAL_LMS:
        return make_tiny_causal_lm(name, dest)
    import torch
    import transformers

    cfg_name, model_name, params = EXTRA[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**params)).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(str(dest), safe_serialization=True)
    return dest


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: _make(name, root / name) for name in [*EXTRA, *TINY_CAUSAL_LMS]}


@pytest.mark.parametrize("name", [*EXTRA, *TINY_CAUSAL_LMS])
def test_streamed_equals_from_pretrained(families, name):
    import torch

    d = families[name]
    model = reference.load_model(d)
    with torch.inference_mode():
        expected = model(torch.tensor([IDS])).logits[0].numpy()
        expected_greedy = model(torch.tensor([GEN_PROMPT])).logits[0, -1].argmax().item()
    files = sorted(d.glob("*.safetensors"))
    for resident in (False, True):
        with StreamedCausalLM(d, files, resident=resident) as lm:
            got = lm.logits(IDS)
            again = lm.logits(IDS)  # a second pass reads the blocks again (streamed) or reuses them
            greedy = lm.greedy(GEN_PROMPT, 4)
            loads = lm.loads
        assert np.abs(got - expected).max() <= 1e-5, (name, resident)
        assert np.array_equal(got, again)
        assert greedy[0] == expected_greedy
        units = len(lm.units)
        # streamed: every unit read on every pass (2 + 4 greedy steps); resident: each read once
        assert loads == (units * 6 if not resident else units), (name, resident, loads, units)


def test_greedy_matches_transformers_generate(families):
    import torch

    d = families["qwen3"]
    model = reference.load_model(d)
    expected = model.generate(torch.tensor([GEN_PROMPT]), max_new_tokens=8, do_sample=False,
                              attention_mask=torch.ones(1, len(GEN_PROMPT), dtype=torch.long))[0, len(GEN_PROMPT):].tolist()
    with StreamedCausalLM(d, sorted(d.glob("*.safetensors"))) as lm:
        assert lm.greedy(GEN_PROMPT, 8) == expected


def test_tied_output_embedding_reads_the_input_embedding(families):
    d = families["llama"]  # tied: the checkpoint has no lm_head.weight
    with StreamedCausalLM(d, sorted(d.glob("*.safetensors"))) as lm:
        assert lm.rules["lm_head.weight"].sources == ("model.embed_tokens.weight",)


def test_moe_experts_are_stacked_from_per_expert_tensors(families):
    d = families["mixtral"]
    with StreamedCausalLM(d, sorted(d.glob("*.safetensors"))) as lm:
        rule = lm.rules["model.layers.0.mlp.experts.gate_up_proj"]
        router = lm.rules["model.layers.0.mlp.gate.weight"]
    assert rule.sources[0] == "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    assert rule.sources[4] == "model.layers.0.block_sparse_moe.experts.0.w3.weight"
    assert router.sources == ("model.layers.0.block_sparse_moe.gate.weight",)


def test_a_missing_tensor_is_one_line():
    with pytest.raises(ModelFormatError, match=r"no tensor for model\.norm\.weight$"):
        weight_rules(["model.embed_tokens.weight", "model.norm.weight"], {"model.embed_tokens.weight"}, {})


def test_a_tensor_of_the_wrong_shape_is_one_line(families, tmp_path):
    from factories import copy_model, edit_config

    d = copy_model(families["qwen2"], tmp_path / "m")
    edit_config(d, intermediate_size=96)  # the checkpoint has 128
    with StreamedCausalLM(d, sorted(d.glob("*.safetensors"))) as lm:
        with pytest.raises(ModelFormatError,
                           match=r"mlp\.gate_proj\.weight has shape \[128, 64\], the config implies \[96, 64\]"):
            lm.logits(IDS)


# --- the same machinery for artifacts: batches, slices, load-time transforms ----------------------------------

@pytest.mark.parametrize("name", ["llama", "mixtral", "gemma2"])  # tied; MoE stacked from experts; soft-capped
def test_a_batch_of_sequences_streams_once_and_equals_each_alone(families, name):
    d = families[name]
    seqs = [IDS, IDS[:7], IDS[3:12]]
    files = sorted(d.glob("*.safetensors"))
    with StreamedCausalLM(d, files, resident=True) as lm:
        alone = [lm.logits(s) for s in seqs]
    with StreamedCausalLM(d, files) as lm:
        batch = lm.logits_batch(seqs)
        assert lm.loads == len(lm.units)  # every unit read once for the whole batch
    for a, b, s in zip(alone, batch, seqs):
        assert b.shape == (len(s), a.shape[-1]) and np.abs(a - b).max() <= 1e-5, name  # padding changes nothing real


def test_a_layer_slice_is_the_first_layers_with_embeddings_and_head(families):
    import torch

    d = families["qwen3"]
    full = reference.load_model(d)
    full.model.layers = full.model.layers[:1]  # transformers' own model cut after its first layer
    full.config.num_hidden_layers = 1
    with torch.inference_mode():
        expected = full(torch.tensor([IDS])).logits[0].numpy()
    with StreamedCausalLM(d, sorted(d.glob("*.safetensors")), layers=1) as lm:
        assert len(lm.model.model.layers) == 1 and lm.model.config.num_hidden_layers == 1
        got = lm.logits(IDS)
        assert all("layers.1." not in rule.sources[0] for rule in lm.rules.values())  # nothing read beyond it
    assert np.abs(got - expected).max() <= 1e-5


def test_a_transform_rewrites_each_weight_as_it_loads(families):
    d = families["llama"]
    files = sorted(d.glob("*.safetensors"))
    seen = []

    def zero_the_head(name, owner, attr, value):
        seen.append(name)
        return value * 0 if name == "lm_head.weight" else value

    with StreamedCausalLM(d, files, transform=zero_the_head) as lm:
        assert np.abs(lm.logits(IDS)).max() == 0.0  # the head (tied: its own copy) was zeroed, the embedding not
        assert "model.embed_tokens.weight" in seen and "lm_head.weight" in seen
    with StreamedCausalLM(d, files) as lm:
        assert np.abs(lm.logits(IDS)).max() > 0.0


def test_loaded_gives_a_unit_to_code_that_reads_its_weights_and_takes_it_back(families):
    d = families["qwen2"]
    with StreamedCausalLM(d, sorted(d.glob("*.safetensors"))) as lm:
        layer = lm.model.model.layers[0]
        assert layer.self_attn.q_proj.weight.device.type == "meta"
        with lm.loaded(layer, None):  # None and modules that are not units are ignored
            assert layer.self_attn.q_proj.weight.device.type == "cpu" and lm.loads == 1
        assert layer.self_attn.q_proj.weight.device.type == "meta"
    with StreamedCausalLM(d, sorted(d.glob("*.safetensors")), resident=True) as lm:
        layer = lm.model.model.layers[0]
        with lm.loaded(layer):
            pass
        assert layer.self_attn.q_proj.weight.device.type == "cpu"  # resident: kept until the model is closed
    assert layer.self_attn.q_proj.weight.device.type == "meta"  # closed: its memory went back


@pytest.mark.parametrize("name", ["llama", "qwen2", "mixtral"])  # tied; biases; experts stacked from their tensors
def test_a_pass_reads_into_the_dropped_units_buffers_and_gets_the_same_numbers(families, name, monkeypatch):
    """Streamed, every pass reads every unit again: the second pass writes its weights into the buffers the
    first one dropped (no page faults for fresh memory), and the logits are those of reads into fresh memory,
    bit for bit."""
    from pipelines.model import unit_memory

    d = families[name]
    files = sorted(d.glob("*.safetensors"))
    with StreamedCausalLM(d, files) as lm:
        first = lm.logits(IDS)
        after_one_pass = (lm.pool.allocated, lm.pool.reused)
        second = lm.logits(IDS)
        greedy = lm.greedy(GEN_PROMPT, 3)
        allocated, reused = lm.pool.allocated, lm.pool.reused
    assert after_one_pass[0] > 0
    assert reused - after_one_pass[1] >= after_one_pass[0] // 2, (after_one_pass, allocated, reused)
    assert np.array_equal(first, second)
    fresh = unit_memory.BufferPool.take

    def never_reused(pool, shape):
        pool.clear()
        return fresh(pool, shape)

    monkeypatch.setattr(unit_memory.BufferPool, "take", never_reused)
    with StreamedCausalLM(d, files) as lm:
        assert np.array_equal(lm.logits(IDS), first) and lm.greedy(GEN_PROMPT, 3) == greedy
        assert lm.pool.reused == 0


def test_only_a_parameter_that_is_its_reads_buffer_goes_back_to_the_pool(families):
    """A stack of experts is a new tensor made of its reads, and what a transform returns is its own: neither is
    ever handed to another read."""
    d = families["mixtral"]
    files = sorted(d.glob("*.safetensors"))
    with StreamedCausalLM(d, files, resident=True) as lm:
        lm.logits(IDS)
        pooled = set(lm._pooled)
    stacked = {name for name, rule in lm.rules.items() if rule.combine is not None}
    assert stacked and not pooled & stacked and "lm_head.weight" in pooled
    with StreamedCausalLM(d, files, resident=True, transform=lambda _n, _o, _a, value: value) as lm:
        lm.logits(IDS)
        assert not lm._pooled
