"""pipelines/targets/gguf/imatrix.py: the importance matrix, in llama.cpp's imatrix GGUF layout.

Every matrix's sums are checked against forward hooks on transformers' own modules run over the same chunks
(the chunk size the file itself records), `load` against imatrix files written here with gguf-py, and the
libllama parameter array by reading its C memory back. The stacked-expert case is test_gguf_families_moe.py;
quantizing with the matrix is test_gguf_quant_types.py.
"""

from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
from factories import make_llama
from gguf_reader import FastGGUFReader

from pipelines.core.errors import HiveError, ModelFormatError
from pipelines.source.fetch import fetch
from pipelines.targets.gguf import imatrix
from pipelines.validation import prompts

# GGUF matrix -> the transformers module whose input it weighs (llama.cpp's names, written out by hand)
PER_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
TEXT = "\n\n".join(prompts.PARITY_TEXTS)  # long enough for several chunks


@pytest.fixture(scope="module")
def snap(smollm2_small_vocab_dir, tmp_path_factory):
    """Untied (the output matrix gets its own row of sums), on the cut vocabulary (small logits per chunk)."""
    d = make_llama(tmp_path_factory.mktemp("imatrix-model") / "untied-llama", smollm2_small_vocab_dir, tie=False)
    return fetch(str(d), "test/untied-llama")


@pytest.fixture(scope="module")
def computed(snap, tmp_path_factory):
    out = tmp_path_factory.mktemp("imatrix") / "untied.imatrix.gguf"
    return out, imatrix.compute(snap, out, text=TEXT)


def hooked_sums(model_dir, ids: list[int], chunk: int) -> tuple[dict[str, np.ndarray], int]:
    """Sum over tokens of x^2 per input column of every Linear, from forward pre-hooks on transformers' model,
    run chunk by chunk as llama.cpp's imatrix does."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    sums: dict[str, torch.Tensor] = {}

    def hook(name):
        def add(_module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + (x * x).sum(0)
        return add

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(hook(name))
    with torch.no_grad():
        for lo in range(0, len(ids), chunk):
            model(torch.tensor([ids[lo:lo + chunk]]))
    return {k: v.numpy() for k, v in sums.items()}, model.config.num_hidden_layers


def test_every_matrix_is_the_mean_square_of_its_input_over_the_calibration_tokens(snap, computed):
    from tokenizers import Tokenizer

    path, summary = computed
    ids = Tokenizer.from_file(str(snap.dir / "tokenizer.json")).encode(TEXT).ids
    fields = FastGGUFReader(str(path)).fields
    chunk = fields["imatrix.chunk_size"].contents()
    assert fields["general.type"].contents() == "imatrix"
    assert fields["imatrix.chunk_count"].contents() == summary["chunks"] == -(-len(ids) // chunk) >= 2
    assert summary["tokens"] == len(ids)

    sums, layers = hooked_sums(snap.dir, ids, chunk)
    expected = {f"blk.{i}.{g}.weight": sums[f"model.layers.{i}.{hf}"] for i in range(layers) for g, hf in PER_LAYER.items()}
    expected["output.weight"] = sums["lm_head"]
    assert summary["tensors"] == len(expected) and summary["missing"] == []

    values = imatrix.load(path)
    assert set(values) == set(expected)
    for name, want in expected.items():
        np.testing.assert_allclose(values[name], want / len(ids), rtol=1e-4, err_msg=name)
    # the raw file: sums and counts as llama.cpp's `--imatrix` reads them
    tensors = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(path)).tensors}
    assert set(tensors) == {f"{n}.{part}" for n in expected for part in ("in_sum2", "counts")}
    for name, want in expected.items():
        assert tensors[f"{name}.counts"].reshape(-1).tolist() == [len(ids)]
        np.testing.assert_allclose(tensors[f"{name}.in_sum2"].reshape(-1), want, rtol=1e-4, err_msg=name)


def test_the_cache_serves_the_same_text_and_repairs_a_damaged_entry(snap, computed, tmp_path):
    """Every imatrix recipe of a model shares one pass over the text: a second compute copies the cached file.
    An entry whose summary (written last) is lost is computed again, not a failure of every later build."""
    path, summary = computed
    original = path.read_bytes()
    again = tmp_path / "again.imatrix.gguf"
    assert imatrix.compute(snap, again, text=TEXT) == summary
    assert again.read_bytes() == original

    from pipelines.core.paths import cache_root

    entries = [e for e in (cache_root() / "imatrix").iterdir() if (e / "imatrix.gguf").read_bytes() == original]
    assert len(entries) == 1
    (entries[0] / "summary.json").unlink()
    (entries[0] / "imatrix.gguf").unlink()  # a new inode: the outputs above are hard links to the cached file
    (entries[0] / "imatrix.gguf").write_bytes(b"GGUF truncated")
    repaired = tmp_path / "repaired.imatrix.gguf"
    assert imatrix.compute(snap, repaired, text=TEXT) == summary
    assert repaired.read_bytes() == original


def test_a_calibration_text_too_short_is_refused(snap, tmp_path):
    out = tmp_path / "short.imatrix.gguf"
    with pytest.raises(HiveError, match=r"^the calibration text is \d+ tokens: too short for an importance matrix$"):
        imatrix.compute(snap, out, text="Too short.")
    assert not out.exists()


# --- load: imatrix files written here ------------------------------------------------------------------------------

def write_imatrix(path, tensors: dict[str, np.ndarray]) -> None:
    writer = gguf.GGUFWriter(str(path), arch="imatrix")
    writer.add_type("imatrix")
    for name, value in tensors.items():
        writer.add_tensor(name, value.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_load_divides_by_each_experts_count_and_gives_unreached_experts_uniform_weights(tmp_path):
    sums = np.array([[3.0, 6.0, 9.0, 12.0], [5.0, 5.0, 5.0, 5.0], [0.0, 0.0, 0.0, 0.0]])
    write_imatrix(tmp_path / "m.gguf", {"blk.0.ffn_down_exps.weight.in_sum2": sums,
                                        "blk.0.ffn_down_exps.weight.counts": np.array([[3.0], [10.0], [0.0]]),
                                        "blk.0.attn_q.weight.in_sum2": np.array([[2.0, 4.0]]),
                                        "blk.0.attn_q.weight.counts": np.array([[4.0]])})
    values = imatrix.load(tmp_path / "m.gguf")
    assert values.keys() == {"blk.0.ffn_down_exps.weight", "blk.0.attn_q.weight"}
    np.testing.assert_array_equal(values["blk.0.ffn_down_exps.weight"], [1, 2, 3, 4, 0.5, 0.5, 0.5, 0.5, 1, 1, 1, 1])
    np.testing.assert_array_equal(values["blk.0.attn_q.weight"], [0.5, 1.0])
    assert all(v.dtype == np.float32 for v in values.values())


def test_load_refuses_sums_without_counts(tmp_path):
    write_imatrix(tmp_path / "m.gguf", {"blk.0.attn_q.weight.in_sum2": np.ones((1, 8))})
    with pytest.raises(ModelFormatError, match=r"^m.gguf: blk.0.attn_q.weight has sums but no counts$"):
        imatrix.load(tmp_path / "m.gguf")


@pytest.mark.parametrize("damage", ["truncated", "not_gguf"])
def test_load_refuses_a_file_that_is_not_an_imatrix_gguf_in_one_line(computed, tmp_path, damage):
    bad = tmp_path / f"{damage}.gguf"
    raw = computed[0].read_bytes()
    bad.write_bytes(raw[: len(raw) // 2] if damage == "truncated" else b"\x00imatrix\x00" * 64)
    with pytest.raises(ModelFormatError, match=rf"^{damage}.gguf is not an importance matrix GGUF \(") as err:
        imatrix.load(bad)
    assert "\n" not in str(err.value)


def test_quantize_param_is_a_null_terminated_c_array_of_the_values():
    values = {"blk.1.ffn_up.weight": np.arange(5, dtype=np.float64),  # converted to float32 for libllama
              "blk.0.attn_q.weight": np.array([0.25, 0.5, 4.0], dtype=np.float32)}
    entries, keep = imatrix.as_quantize_param(values)
    assert len(entries) == 3 and entries[2].name is None  # libllama stops at the NULL name
    for entry, name in zip(entries, sorted(values)):
        assert entry.name == name.encode() and entry.size == values[name].size
        read_back = np.ctypeslib.as_array(ctypes.cast(entry.data, ctypes.POINTER(ctypes.c_float)), (entry.size,))
        np.testing.assert_array_equal(read_back, values[name].astype(np.float32))
    assert len(keep) == 2  # the caller keeps the arrays alive while libllama reads them
