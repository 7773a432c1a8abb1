"""The transformers fp32 reference on fixed token ids: logits, and a greedy continuation for the kinds that compare one.

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
    generation_ids: list[int] | None  # None: the caller asked for no continuation
    usage: dict[str, Any] = field(default_factory=dict)  # the computing child's peak memory (not cached results)
    # MoE models: each position's smallest routing gap over the layers (router_gaps.py); None for a dense model
    router_gaps: list[np.ndarray] | None = None
    # the linear layers' FLOPs per position of the logits pass (model/flops.py): the work of a check on these ids
    flop_per_position: float = 0.0


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
# 5: the logits and the greedy continuation are two entries (same numbers): a kind that compares no
#    continuation never computes one.
REFERENCE_VERSION = 5


def _key(part: str, content_digest: str, inputs: list) -> str:
    from importlib.metadata import version  # the installed versions, without importing torch for them

    payload = json.dumps([REFERENCE_VERSION, part, content_digest, inputs, version("transformers"), version("torch")])
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


def compute(model_dir: Path, content_digest: str, ids: list[list[int]], gen_ids: list[int] | None = None,
            n_gen: int = 0, files: list[Path] | None = None, step: str | None = None) -> Reference:
    """The reference's logits on `ids` and, when `n_gen` > 0, its greedy continuation of `gen_ids`, each cached
    per content: the logits serve every kind, the continuation only the kinds that compare one (a greedy token
    is a pass over the weights: twelve of them cost a streamed 8B model more than its logits).

    Whatever the cache lacks is computed in one go by the streamed model: one block resident at a time, in a
    child process (its memory goes back when it ends, an out-of-memory kill is one error line); or, when the
    fp32 model fits the memory budget with margin, with every block kept after its first use, in this process
    (same code, same numbers)."""
    entries = {"logits": cache_root() / "reference" / _key("logits", content_digest, ids)}
    if n_gen > 0:
        entries["continuation"] = cache_root() / "reference" / _key("continuation", content_digest, [gen_ids, n_gen])
    missing = [part for part, root in entries.items() if not (root / "done.json").is_file()]
    if missing:
        _compute_missing(model_dir, files, ids, gen_ids or [], n_gen, {part: entries[part] for part in missing}, step)
    done = json.loads((entries["logits"] / "done.json").read_text())
    gaps = [np.load(entries["logits"] / f"g{i}.npy") for i in range(len(ids))] if done.get("router_gaps") else None
    generation = (json.loads((entries["continuation"] / "done.json").read_text())["generation_ids"]
                  if "continuation" in entries else None)
    return Reference(ids, LazyLogits(entries["logits"], len(ids)), gen_ids or [], generation, done.get("usage", {}),
                     gaps, done.get("flop_per_position", 0.0))


def _compute_missing(model_dir: Path, files: list[Path] | None, ids: list[list[int]], gen_ids: list[int], n_gen: int,
                     entries: dict[str, Path], step: str | None) -> None:
    from ..core import meter

    with meter.step("reference"):
        from ..core.paths import publish_cache_entry, work_dir
        from ..process.isolation import run_isolated

        files = files if files is not None else sorted(model_dir.glob("*.safetensors"))
        (cache_root() / "reference").mkdir(parents=True, exist_ok=True)
        resident = reference_resident(files)
        # Computed in a locked work dir (a killed build's is reclaimed like any other), then each entry renamed
        # whole into the cache: readers never see a partial reference.
        with work_dir("reference-") as work:
            outs = {part: str(work / part) for part in entries}
            args = dict(model_dir=str(model_dir), files=[str(f) for f in files], ids=ids, gen_ids=gen_ids,
                        n_gen=n_gen if "continuation" in entries else 0, outs=outs, resident=resident)
            if resident:  # fits with margin: in this process, which has torch loaded already
                from ..model.unit_memory import trim_heap

                usage = compute_into(**args)
                trim_heap()
            else:  # streamed: in a child, whose memory goes back when it ends and whose OOM kill is one line
                usage = run_isolated(compute_into, engine="transformers", needs_torch=True,
                                     step=step or f"the transformers reference of {model_dir.name}", **args)
            meter.work(flop=usage["flop"])
            for part, root in entries.items():
                publish_cache_entry(Path(outs[part]), root, "done.json")


def reference_resident(files: list[Path]) -> bool:
    """Keep every block loaded after first use (fewer reads, same numbers) only when the fp32 model fits
    the memory budget with a wide margin; otherwise stream block by block."""
    from ..core.host import memory_budget
    from ..model.memory import reference_in_process
    from ..source.safetensors_io import read_header

    return reference_in_process(sum(read_header(f).parameters for f in files) * 4, memory_budget()[0])


def compute_into(model_dir: str, files: list[str], ids: list[list[int]], gen_ids: list[int], n_gen: int,
                 outs: dict[str, str], resident: bool) -> dict[str, Any]:
    """The child's side of `compute`: the entries named in `outs` ("logits": one .npy of logits per sequence;
    "continuation": `n_gen` greedy tokens), each directory's done.json written last."""
    from ..core.progress import unit_runs
    from ..model import flops
    from ..model.streamed_model import StreamedCausalLM
    from ..process.isolation import peak_memory
    from . import router_gaps

    passes = ((len(ids) if resident else 1) if "logits" in outs else 0) + n_gen  # logits: one batch when streamed
    done: dict[str, dict[str, Any]] = {}
    with StreamedCausalLM(Path(model_dir), [Path(f) for f in files], resident=resident) as lm, \
            unit_runs([module for _name, module, _r in lm.units], passes, "reference"), \
            flops.counted(lm.model) as work:
        if "logits" in outs:
            out = Path(outs["logits"])
            out.mkdir()
            with router_gaps.recording(lm.model) as routing:
                for i, logits in enumerate(lm.logits_batch(ids)):  # one pass over the weights when streamed
                    np.save(out / f"l{i}.npy", logits)
            gaps = routing.per_sequence([len(s) for s in ids], None if resident else max(len(s) for s in ids))
            for i, gap in enumerate(gaps or []):
                np.save(out / f"g{i}.npy", gap.astype(np.float32))
            # a check that runs the artifact on these positions did about this much work per position
            done["logits"] = {"router_gaps": gaps is not None, "flop_per_position": work.per_position()}
        if "continuation" in outs:
            config = lm.model.config  # a vision-language wrapper may keep the token ids in its text config only
            eos = getattr(config, "eos_token_id", None)
            eos = getattr(config.get_text_config(), "eos_token_id", None) if eos is None else eos
            gen = lm.greedy(gen_ids, n_gen, eos=set(eos) if isinstance(eos, list) else {eos} if eos is not None else None)
            Path(outs["continuation"]).mkdir()
            done["continuation"] = {"generation_ids": gen}
        loads = lm.loads
    usage = {**(peak_memory() if not resident else {}), "unit_loads": loads, "resident": resident, "flop": work.flop}
    for part, record in done.items():  # what this run measured: in each entry it made
        (Path(outs[part]) / "done.json").write_text(json.dumps({**record, "usage": usage}))
    return usage
