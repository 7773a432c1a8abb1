"""The transformers fp32 reference: logits and a greedy continuation on fixed token ids.

Every artifact kind is compared with this on the same ids. Results are cached on disk keyed by the
snapshot content, the ids and the transformers/torch versions, so several recipes of one model pay
for the reference once. Remote code is never executed (`trust_remote_code=False`), and only
safetensors weights are read.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import ModelFormatError
from .paths import cache_root


@dataclass
class Reference:
    ids: list[list[int]]
    logits: list[np.ndarray]  # float32 [len(ids[i]), vocab]
    generation_prompt_ids: list[int]
    generation_ids: list[int]


def _quiet_transformers() -> None:
    """transformers' own warnings (and, off a terminal, its progress bars) would surround hive-aot's one
    error line and fill build logs; what matters is reported by hive-aot itself."""
    import sys

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if not sys.stderr.isatty():
        hf_logging.disable_progress_bar()


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    _quiet_transformers()

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

    _quiet_transformers()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32, trust_remote_code=False, use_safetensors=True, local_files_only=True
        )
    except Exception as e:  # noqa: BLE001 - a model transformers cannot load is malformed input for us
        raise ModelFormatError(f"transformers cannot load {what}: {type(e).__name__}: {e}") from None
    return model.eval()


def _key(content_digest: str, ids: list[list[int]], gen_ids: list[int], n_gen: int) -> str:
    import torch
    import transformers

    payload = json.dumps([content_digest, ids, gen_ids, n_gen, transformers.__version__, torch.__version__])
    return hashlib.sha256(payload.encode()).hexdigest()


def compute(model_dir: Path, content_digest: str, ids: list[list[int]], gen_ids: list[int], n_gen: int) -> Reference:
    cache = cache_root() / "reference" / f"{_key(content_digest, ids, gen_ids, n_gen)}.npz"
    if cache.is_file():
        with np.load(cache) as z:
            logits = [z[f"l{i}"] for i in range(len(ids))]
            return Reference(ids, logits, gen_ids, z["gen"].tolist())
    import torch

    model = load_model(model_dir, "the reference model")
    logits = []
    with torch.inference_mode():
        for seq in ids:
            out = model(torch.tensor([seq], dtype=torch.long)).logits[0]
            logits.append(out.float().numpy())
        gen = model.generate(torch.tensor([gen_ids]), max_new_tokens=n_gen, do_sample=False,
                             attention_mask=torch.ones(1, len(gen_ids), dtype=torch.long))[0, len(gen_ids):].tolist()
    cache.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache.parent, suffix=".npz")
    os.close(fd)
    np.savez(tmp, gen=np.asarray(gen, dtype=np.int64), **{f"l{i}": lg for i, lg in enumerate(logits)})
    os.replace(tmp, cache)
    return Reference(ids, logits, gen_ids, gen)
