"""The transformers fp32 reference: logits and a greedy continuation on fixed token ids.

Every artifact kind is compared with this on the same ids. It is computed by `streamed_model` (the
model's own transformers modules, one block resident at a time), so a model larger than the host's
memory still gets a reference. Results are cached on disk keyed by the snapshot content, the ids and
the transformers/torch versions, so several recipes of one model pay for the reference once. Remote
code is never executed (`trust_remote_code=False`), and only safetensors weights are read.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..core.errors import ModelFormatError
from ..core.paths import cache_root
from ..core.quiet import quiet_transformers


@dataclass
class Reference:
    ids: list[list[int]]
    logits: Sequence[np.ndarray]  # float32 [len(ids[i]), vocab], read one at a time
    generation_prompt_ids: list[int]
    generation_ids: list[int]
    usage: dict[str, Any] = field(default_factory=dict)  # the computing child's peak memory (not cached results)
    # MoE models: each position's smallest routing gap over the layers (router_gaps.py); None for a dense model
    router_gaps: list[np.ndarray] | None = None


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    from ..model.native import SentencePieceTokenizer, equivalent_for, read_config

    quiet_transformers()
    eq = equivalent_for(read_config(model_dir)) if (model_dir / "config.json").is_file() else None
    if eq is not None and eq.tokenizer == "sentencepiece":
        # the repository's own tokenizer class is remote code: its SentencePiece model, run by sentencepiece
        return SentencePieceTokenizer(model_dir)
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - a tokenizer that cannot load is malformed input for us
        raise ModelFormatError(f"tokenizer cannot be loaded: {type(e).__name__}: {e}") from None


def encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return [list(tokenizer(t).input_ids) for t in texts]


def load_model(model_dir: Path, what: str = "the model"):
    """A causal LM in fp32 from safetensors only, never running remote code; a failure is one line."""
    import torch
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32, trust_remote_code=False, use_safetensors=True, local_files_only=True
        )
    except Exception as e:  # noqa: BLE001 - a model transformers cannot load is malformed input for us
        raise ModelFormatError(f"transformers cannot load {what}: {type(e).__name__}: {e}") from None
    return model.eval()


# Part of the cache key: bump when what `compute` produces changes for the same inputs.
# 2: streamed weights; greedy is pure argmax (a repository's generation_config is not applied).
# 3: streamed, the parity texts go through each unit together (one pass over the weights, right-padded).
# 4: MoE routing gaps per position (router_gaps.py).
REFERENCE_VERSION = 4


def _key(content_digest: str, ids: list[list[int]], gen_ids: list[int], n_gen: int) -> str:
    from importlib.metadata import version  # the installed versions, without importing torch for them

    payload = json.dumps([REFERENCE_VERSION, content_digest, ids, gen_ids, n_gen, version("transformers"),
                          version("torch")])
    return hashlib.sha256(payload.encode()).hexdigest()


class LazyLogits(Sequence):
    """Per-prompt logits read from the cache when asked for (memory-mapped), so a 128k-vocab model's
    [tokens x vocab] arrays are never all in memory at once."""

    def __init__(self, root: Path, n: int):
        self.root, self.n = root, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return np.load(self.root / f"l{i % self.n}.npy", mmap_mode="r")


def compute(model_dir: Path, content_digest: str, ids: list[list[int]], gen_ids: list[int], n_gen: int,
            files: list[Path] | None = None, step: str | None = None) -> Reference:
    """The reference's logits on `ids` and its greedy continuation of `gen_ids`, cached per content.

    Computed by the streamed model: one block resident at a time, in a child process (its memory goes
    back when it ends, an out-of-memory kill is one error line); or, when the fp32 model fits the memory
    budget with margin, with every block kept after its first use, in this process (same code, same
    numbers)."""
    root = cache_root() / "reference" / _key(content_digest, ids, gen_ids, n_gen)
    if not (root / "done.json").is_file():
        from ..core import meter

        with meter.step("reference"):
            from ..core.paths import publish_cache_entry, work_dir
            from ..process.isolation import run_isolated

            files = files if files is not None else sorted(model_dir.glob("*.safetensors"))
            root.parent.mkdir(parents=True, exist_ok=True)
            resident = reference_resident(files)
            # Computed in a locked work dir (a killed build's is reclaimed like any other), then renamed whole
            # into the cache: readers never see a partial reference.
            with work_dir("reference-") as work:
                tmp = work / "out"
                tmp.mkdir()
                args = dict(model_dir=str(model_dir), files=[str(f) for f in files], ids=ids, gen_ids=gen_ids,
                            n_gen=n_gen, out_dir=str(tmp), resident=resident)
                if resident:  # fits with margin: in this process, which has torch loaded already
                    from ..model.streamed_model import trim_heap

                    compute_into(**args)
                    trim_heap()
                else:  # streamed: in a child, whose memory goes back when it ends and whose OOM kill is one line
                    run_isolated(compute_into, engine="transformers", needs_torch=True,
                                 step=step or f"the transformers reference of {model_dir.name}", **args)
                publish_cache_entry(tmp, root, "done.json")
    done = json.loads((root / "done.json").read_text())
    gaps = [np.load(root / f"g{i}.npy") for i in range(len(ids))] if done.get("router_gaps") else None
    return Reference(ids, LazyLogits(root, len(ids)), gen_ids, done["generation_ids"], done.get("usage", {}), gaps)


def reference_resident(files: list[Path]) -> bool:
    """Keep every block loaded after first use (fewer reads, same numbers) only when the fp32 model fits
    the memory budget with a wide margin; otherwise stream block by block."""
    from ..core.host import memory_budget
    from ..model.memory import reference_in_process
    from ..source.safetensors_io import read_header

    return reference_in_process(sum(read_header(f).parameters for f in files) * 4, memory_budget()[0])


def compute_into(model_dir: str, files: list[str], ids: list[list[int]], gen_ids: list[int], n_gen: int,
                 out_dir: str, resident: bool) -> dict[str, Any]:
    """The child's side of `compute`: one .npy of logits per sequence, then done.json (written last)."""
    from ..core.progress import unit_runs
    from ..model.streamed_model import StreamedCausalLM
    from ..process.isolation import peak_memory
    from . import router_gaps

    out = Path(out_dir)
    passes = (len(ids) if resident else 1) + n_gen  # the logits (one batch when streamed), then a token a pass
    with StreamedCausalLM(Path(model_dir), [Path(f) for f in files], resident=resident) as lm, \
            unit_runs([module for _name, module, _r in lm.units], passes, "reference"):
        with router_gaps.recording(lm.model) as routing:
            for i, logits in enumerate(lm.logits_batch(ids)):  # one pass over the weights when streamed
                np.save(out / f"l{i}.npy", logits)
        gaps = routing.per_sequence([len(s) for s in ids], None if resident else max(len(s) for s in ids))
        for i, gap in enumerate(gaps or []):
            np.save(out / f"g{i}.npy", gap.astype(np.float32))
        config = lm.model.config  # a vision-language wrapper may keep the token ids in its text config only
        eos = getattr(config, "eos_token_id", None)
        eos = getattr(config.get_text_config(), "eos_token_id", None) if eos is None else eos
        gen = lm.greedy(gen_ids, n_gen, eos=set(eos) if isinstance(eos, list) else {eos} if eos is not None else None)
        loads = lm.loads
    usage = {**(peak_memory() if not resident else {}), "unit_loads": loads, "resident": resident}
    (out / "done.json").write_text(json.dumps({"generation_ids": gen, "usage": usage, "router_gaps": gaps is not None}))
    return usage
