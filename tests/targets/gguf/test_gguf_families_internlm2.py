"""InternLM2, an architecture whose repositories ship only remote code, converted and validated without it.

The tiny InternLM2 repository is made from a random transformers Llama (the truth: its own logits): the
same weights under InternLM2's names, with Q, K and V fused into `wqkv` grouped by KV head the way InternLM2's
modeling code splits it (written here, independently of `pipelines.model.native`), a config that names the remote
classes (auto_map) and a tokenizer_config whose class is remote too. Its modeling file is a tripwire: were it
ever imported, it would leave a marker file.

The tokenizer is a SentencePiece model trained here (InternLM2's is SentencePiece); the reference tokenizes
with sentencepiece itself, which llama.cpp must match id for id.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from factories import make_causal_lm, make_spm_tokenizer
from gguf_family_check import check_family, convert_and_validate, convert_only
from safetensors.numpy import load_file, save_file

from pipelines.core.errors import ModelFormatError
from pipelines.targets.gguf import convert as convert_mod
from pipelines.targets.gguf.families import internlm2 as internlm2_family

HEADS, KV, HIDDEN, LAYERS = 4, 2, 64, 2
TRIPWIRE = "import pathlib\npathlib.Path(__file__).with_name('REMOTE_CODE_RAN').write_text('yes')\n"


def fuse_wqkv(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_head: int, n_kv: int) -> np.ndarray:
    """InternLM2's layout: per KV head g, its query heads g*G .. g*G+G-1, then key head g, then value head g."""
    d, groups = q.shape[0] // n_head, n_head // n_kv
    blocks = []
    for g in range(n_kv):
        blocks += [q[(g * groups + j) * d:(g * groups + j + 1) * d] for j in range(groups)]
        blocks += [k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]]
    return np.concatenate(blocks)


def make_internlm2(root: Path, tok: Path, *, rope_scaling: dict | None = None) -> tuple[Path, Path]:
    """(InternLM2 repository, the Llama it was made from), with the SentencePiece tokenizer of `tok`."""
    vocab = json.loads((tok / "config.json").read_text())["vocab_size"]
    params = dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=512,
                  initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  rope_theta=10000.0)
    if rope_scaling:
        params["rope_scaling"] = {"rope_type": rope_scaling["type"], "factor": rope_scaling["factor"]}
    llama = make_causal_lm("LlamaConfig", "LlamaForCausalLM", params, root / "llama")
    w = load_file(str(llama / "model.safetensors"))
    out = {"model.tok_embeddings.weight": w["model.embed_tokens.weight"], "model.norm.weight": w["model.norm.weight"],
           "output.weight": w["lm_head.weight"]}
    for i in range(LAYERS):
        src, dst = f"model.layers.{i}.", f"model.layers.{i}."
        out[dst + "attention.wqkv.weight"] = fuse_wqkv(w[src + "self_attn.q_proj.weight"], w[src + "self_attn.k_proj.weight"],
                                                       w[src + "self_attn.v_proj.weight"], HEADS, KV)
        for theirs, ours in (("self_attn.o_proj", "attention.wo"), ("mlp.gate_proj", "feed_forward.w1"),
                             ("mlp.up_proj", "feed_forward.w3"), ("mlp.down_proj", "feed_forward.w2"),
                             ("input_layernorm", "attention_norm"), ("post_attention_layernorm", "ffn_norm")):
            out[f"{dst}{ours}.weight"] = w[f"{src}{theirs}.weight"]
    repo = root / "internlm2-tiny-chat"
    repo.mkdir()
    save_file(out, str(repo / "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2",
              "auto_map": {"AutoConfig": "configuration_internlm2.InternLM2Config",
                           "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM"},
              "bias": False, "hidden_act": "silu", "hidden_size": HIDDEN, "intermediate_size": 128,
              "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV,
              "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "rope_scaling": rope_scaling, "vocab_size": vocab, "tie_word_embeddings": False,
              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32"}
    (repo / "config.json").write_text(json.dumps(config, indent=1))
    (repo / "tokenizer.model").write_bytes((tok / "tokenizer.model").read_bytes())
    (repo / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "InternLM2Tokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_internlm2.InternLM2Tokenizer", None]},
        "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    for f in ("modeling_internlm2.py", "configuration_internlm2.py", "tokenization_internlm2.py"):
        (repo / f).write_text(TRIPWIRE)
    return repo, llama


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    root = tmp_path_factory.mktemp("internlm2")
    tok = make_spm_tokenizer(root / "tokenizer", vocab_size=700)
    return {"plain": make_internlm2(root / "plain", tok),
            "dynamic": make_internlm2(root / "dynamic", tok, rope_scaling={"type": "dynamic", "factor": 2.0})}


def test_reference_is_transformers_llama_on_the_same_weights(repos):
    """The streamed reference of the InternLM2 repository (native equivalent, no remote code) computes the
    logits of the Llama the repository was made from."""
    import torch

    from pipelines.model.streamed_model import StreamedCausalLM
    from pipelines.validation.reference import load_model, load_tokenizer

    repo, llama = repos["plain"]
    ids = load_tokenizer(repo)("The quick brown fox jumps over the lazy dog 12345, said the river.").input_ids
    assert ids[0] == 1 and len(ids) > 10  # BOS in front, as InternLM2's tokenizer adds it
    with StreamedCausalLM(repo, [repo / "model.safetensors"]) as lm:
        ours = lm.logits(ids)
    with torch.no_grad():
        truth = load_model(llama)(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(ours - truth).max() < 1e-4
    assert not (repo / "REMOTE_CODE_RAN").exists()


@pytest.mark.parametrize("case", ["plain", "dynamic"])
def test_family_parity(case, repos, tmp_path):
    """f16 / q8_0 in llama.cpp against the reference; token parity with sentencepiece. Dynamic NTK scaling only
    acts beyond max_position_embeddings, so inside it llama.cpp's default rope is exact."""
    repo, _ = repos[case]
    results = check_family(repo, tmp_path, "internlm2")
    report = results["f16"][0]
    assert (report.architecture, report.family, report.vocab["tokenizer"]) == ("InternLM2ForCausalLM", "internlm2",
                                                                               "sentencepiece")
    assert not (repo / "REMOTE_CODE_RAN").exists()


def test_kv_head_grouping_matters(repos, tmp_path, monkeypatch):
    """Negative control: splitting wqkv as [all q; all k; all v] (Phi-3's layout) loads and runs, but only
    parity shows it computes another model."""
    original = convert_mod.family_for

    def flat_split(xs, hp):
        q, k, v = np.split(xs[0], [hp.n_head * hp.head_dim, (hp.n_head + hp.n_head_kv) * hp.head_dim])
        return [internlm2_family.permute_qk(q, hp.n_head), internlm2_family.permute_qk(k, hp.n_head_kv), v]

    def with_flat_split(arch):
        fam = original(arch)
        rules = tuple(dataclasses.replace(r, transform=dataclasses.replace(r.transform, apply=flat_split))
                      if r.transform is internlm2_family.SPLIT_QKV else r for r in fam.tensors)
        return dataclasses.replace(fam, tensors=rules)

    monkeypatch.setattr(convert_mod, "family_for", with_flat_split)
    _, metrics, _ = convert_and_validate(repos["plain"][0], tmp_path / "flat.gguf", "f16")
    assert metrics["finite"] is True and metrics["mean_kl"] > 0.05, metrics


@pytest.mark.parametrize("change,message", [({"bias": True}, "no attention biases"),
                                            ({"tie_word_embeddings": True}, "requires an untied output"),
                                            ({"rope_scaling": {"type": "ntk", "factor": 2.0}}, "not supported")])
def test_layouts_llama_cpp_cannot_run_are_refused(change, message, repos, tmp_path):
    from factories import copy_model, edit_config

    d = copy_model(repos["plain"][0], tmp_path / "internlm2-changed")
    edit_config(d, **change)
    out = tmp_path / "refused.gguf"
    with pytest.raises(ModelFormatError, match=message) as err:
        convert_only(d, out)
    assert "\n" not in str(err.value) and not out.exists()


def test_converted_only_once_reviewed(repos, config):
    """auto_map: hive-aot's own mapping converts it for the CPU tier only once a human reviewed the repo."""
    from pipelines.compat import classify

    cfg = json.loads((repos["plain"][0] / "config.json").read_text())
    recipes = list(config.recipes.values())
    before = classify(cfg, hardware="cpu", recipes=recipes, registry=config.registry)
    assert before.status == "requires_review" and before.runtime_profile_id != "llm-llamacpp-cpu"
    after = classify(cfg, hardware="cpu", recipes=recipes, registry=config.registry, reviewed=True)
    assert after.runtime_profile_id == "llm-llamacpp-cpu"
    assert {r for r in after.recipes if r.startswith("gguf-")} == {r for r in config.recipes if r.startswith("gguf-")}
