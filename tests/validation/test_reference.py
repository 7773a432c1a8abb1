"""pipelines/validation/reference.py: the transformers fp32 reference every artifact is compared with.

Its numbers are checked against transformers' own forward pass on the same weights (`from_pretrained`, a plain
argmax loop for the continuation), streamed in a child and resident in this process alike; its cache against
what must and must not share an entry; its loaders against inputs they must refuse in one line (pickle-only
weights, remote code, truncated files). The streamed model itself is test_streamed_model.py.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
from factories import copy_model

from pipelines.core.errors import ModelFormatError
from pipelines.validation import reference

IDS = [[1, 504, 2365, 30, 7042, 1359, 314, 260, 9110, 28, 4082, 17, 216, 33, 34, 35], [8, 91, 4000]]
GEN_PROMPT = [1, 504, 3575, 282, 4649, 314]
N_GEN = 6
TRIPWIRE = "import pathlib\npathlib.Path(__file__).with_name('REMOTE_CODE_RAN').write_text('yes')\n"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """This test's own cache root: which entries exist is what some tests look at."""
    root = tmp_path / "cache"
    monkeypatch.setenv("HIVE_AOT_CACHE", str(root))
    return root


@pytest.fixture(scope="module")
def truth(tiny_llama):
    """transformers' own fp32 forward of tiny_llama: each sequence's logits, and argmax tokens one at a time
    without a KV cache (stopping at EOS, as a greedy continuation does)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = [model(torch.tensor([s])).logits[0].numpy() for s in IDS]
        seq, generated = list(GEN_PROMPT), []
        for _ in range(N_GEN):
            nxt = int(model(torch.tensor([seq])).logits[0, -1].argmax())
            generated.append(nxt)
            if nxt == model.config.eos_token_id:
                break
            seq.append(nxt)
    return logits, generated


def assert_is_truth(ref: reference.Reference, truth) -> None:
    logits, generated = truth
    assert len(ref.logits) == len(IDS)
    for got, want in zip(ref.logits, logits):
        assert got.shape == want.shape and got.dtype == np.float32
        assert np.abs(np.asarray(got) - want).max() <= 1e-4
    assert ref.generation_ids == generated and ref.generation_prompt_ids == GEN_PROMPT


def test_streamed_in_a_child_and_resident_here_are_transformers_own_numbers(tiny_llama, truth, cache, monkeypatch):
    """A small memory budget streams the reference block by block in a child process; the default budget keeps
    this tiny model resident in this process. Both compute transformers' numbers."""
    files = sorted(tiny_llama.glob("*.safetensors"))
    monkeypatch.setenv("HIVE_AOT_MEMORY_BUDGET", "1M")
    streamed = reference.compute(tiny_llama, "digest-streamed", IDS, GEN_PROMPT, N_GEN, files=files)
    assert streamed.usage["resident"] is False and streamed.usage["peak_rss"] > 0  # measured in the child
    monkeypatch.delenv("HIVE_AOT_MEMORY_BUDGET")
    resident = reference.compute(tiny_llama, "digest-resident", IDS, GEN_PROMPT, N_GEN, files=files)
    assert resident.usage["resident"] is True
    assert_is_truth(streamed, truth)
    assert_is_truth(resident, truth)
    assert len(list((cache / "reference").iterdir())) == 4  # per content digest: its logits, its continuation


def test_logits_are_read_from_the_cache_one_prompt_at_a_time(tiny_llama, truth, cache):
    ref = reference.compute(tiny_llama, "digest", IDS, GEN_PROMPT, N_GEN)
    logits = ref.logits
    assert isinstance(logits[0], np.memmap)  # mapped from the cache, not held in memory
    assert np.array_equal(logits[-1], logits[len(IDS) - 1]) and np.array_equal(logits[-2], logits[0])
    assert [a.shape for a in logits[0:2]] == [a.shape for a in truth[0]]
    assert len(logits[1:]) == 1 and logits[5:] == []
    for bad in (len(IDS), -len(IDS) - 1):
        with pytest.raises(IndexError):
            logits[bad]


def test_the_cache_is_keyed_by_content_and_inputs_never_by_path(tiny_llama, truth, cache, tmp_path):
    first = reference.compute(tiny_llama, "digest", IDS, GEN_PROMPT, N_GEN)
    entries = lambda: sorted(p.name for p in (cache / "reference").iterdir())  # noqa: E731
    # two entries, each complete: the logits, the continuation
    assert len(entries()) == 2 and all((cache / "reference" / e / "done.json").is_file() for e in entries())
    # the same content elsewhere (another snapshot directory, here an empty one: nothing could be computed from
    # it) is answered from the cache
    elsewhere = tmp_path / "moved"
    elsewhere.mkdir()
    again = reference.compute(elsewhere, "digest", IDS, GEN_PROMPT, N_GEN, files=[])
    assert_is_truth(again, truth)
    assert again.generation_ids == first.generation_ids and len(entries()) == 2
    # each input that changes the numbers has its own entry, and only the part it changes is computed again:
    # other content both, other parity ids the logits, another generation prompt or length the continuation
    for args, new in ((("other-digest", IDS, GEN_PROMPT, N_GEN), 2), (("digest", IDS[:1], GEN_PROMPT, N_GEN), 1),
                      (("digest", IDS, GEN_PROMPT[:-1], N_GEN), 1), (("digest", IDS, GEN_PROMPT, N_GEN - 2), 1)):
        before = len(entries())
        ref = reference.compute(tiny_llama, *args)
        assert len(entries()) == before + new and len(ref.logits) == len(args[1])
    assert len(ref.generation_ids) <= N_GEN - 2


def test_a_kind_that_compares_no_continuation_never_computes_one(tiny_llama, truth, cache, monkeypatch):
    """vLLM and AI 100 compare logits only: a greedy token is a pass over the weights, so their reference is one
    pass. A later kind that asks for the continuation computes only that, and reads the same logits."""
    files = sorted(tiny_llama.glob("*.safetensors"))
    monkeypatch.setenv("HIVE_AOT_MEMORY_BUDGET", "1M")  # streamed in a child: unit_loads counts the passes
    logits_only = reference.compute(tiny_llama, "digest", IDS, files=files)
    units = logits_only.usage["unit_loads"]
    assert logits_only.generation_ids is None and len(list((cache / "reference").iterdir())) == 1
    both = reference.compute(tiny_llama, "digest", IDS, GEN_PROMPT, N_GEN, files=files)
    assert_is_truth(both, truth)
    (continuation,) = [json.loads(p.read_text()) for p in (cache / "reference").glob("*/done.json")
                       if "generation_ids" in p.read_text()]
    assert continuation["usage"]["unit_loads"] == len(both.generation_ids) * units  # a pass a token, no logits pass
    assert both.usage == logits_only.usage  # the logits entry is the one computed first, not computed again


def test_an_entry_without_done_json_is_computed_again(tiny_llama, truth, cache):
    """done.json is written last: an entry without it (a damaged cache) is never read as a reference."""
    reference.compute(tiny_llama, "digest", IDS, GEN_PROMPT, N_GEN)
    (entry,) = [e for e in (cache / "reference").iterdir() if (e / "l0.npy").is_file()]
    (entry / "done.json").unlink()
    (entry / "l0.npy").write_bytes(b"\x93NUMPY truncated")
    assert_is_truth(reference.compute(tiny_llama, "digest", IDS, GEN_PROMPT, N_GEN), truth)
    assert (entry / "done.json").is_file()


# --- loading: only safetensors, never remote code, failures in one line ----------------------------------------

def test_encode_is_the_repositorys_tokenizer(tiny_llama):
    from tokenizers import Tokenizer

    texts = ["The capital of France is", "  spaces\tand tabs\n", "emoji 🚀 and 中文"]
    own = Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))
    assert reference.encode(reference.load_tokenizer(tiny_llama), texts) == [own.encode(t).ids for t in texts]


class Tripwire:
    """Unpickling this leaves a marker file: proof that a pickle was loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "unpickled"))


def test_pickle_weights_are_never_loaded(tiny_llama, tmp_path):
    d = tmp_path / "pickled"
    d.mkdir()
    shutil.copy(tiny_llama / "config.json", d / "config.json")
    marker = tmp_path / "UNPICKLED"
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(Tripwire(marker)))
    with pytest.raises(ModelFormatError, match=r"^transformers cannot load the pickled model: ") as err:
        reference.load_model(d, "the pickled model")
    assert "\n" not in str(err.value) and not marker.exists()


def test_remote_code_is_never_run(tiny_llama, tmp_path):
    d = copy_model(tiny_llama, tmp_path / "remote")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["RemoteForCausalLM"], model_type="remote-only",
               auto_map={"AutoConfig": "configuration_remote.RemoteConfig",
                         "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM"})
    (d / "config.json").write_text(json.dumps(cfg))
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    tcfg.update(tokenizer_class="RemoteTokenizer", auto_map={"AutoTokenizer": ["tokenization_remote.RemoteTokenizer", None]})
    (d / "tokenizer_config.json").write_text(json.dumps(tcfg))
    (d / "tokenizer.json").unlink()  # nothing but the remote class could tokenize
    for name in ("configuration_remote.py", "modeling_remote.py", "tokenization_remote.py"):
        (d / name).write_text(TRIPWIRE)
    with pytest.raises(ModelFormatError, match=r"^transformers cannot load the model: ") as err:
        reference.load_model(d)
    assert "\n" not in str(err.value)
    with pytest.raises(ModelFormatError, match=r"^tokenizer cannot be loaded: ") as err:
        reference.load_tokenizer(d)
    assert "\n" not in str(err.value)
    assert not (d / "REMOTE_CODE_RAN").exists()


def test_a_truncated_checkpoint_is_one_line(tiny_llama, tmp_path):
    d = copy_model(tiny_llama, tmp_path / "truncated")
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelFormatError, match=r"^transformers cannot load the model: ") as err:
        reference.load_model(d)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("content", [b"{\"model\": ", b"\xff\xfe\x00", b"[]"])
def test_a_malformed_tokenizer_is_one_line(tiny_llama, tmp_path, content):
    d = copy_model(tiny_llama, tmp_path / "tok")
    (d / "tokenizer.json").write_bytes(content)
    with pytest.raises(ModelFormatError, match=r"^tokenizer cannot be loaded: ") as err:
        reference.load_tokenizer(d)
    assert "\n" not in str(err.value)
