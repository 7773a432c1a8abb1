"""What a checkpoint's tensor names say about the model, where config.json's `architectures` says otherwise.

Embedding models are often released as the weights of the base model under a causal-LM architecture name:
Qwen3-Embedding says `Qwen3ForCausalLM`, but its safetensors hold `embed_tokens`, `layers.N.*` and `norm`,
without the causal LM's `model.` prefix and with no `lm_head` (sentence-transformers saves the bare
transformer and adds a pooling module in `modules.json`). Read as a causal LM it fails on a missing tensor
after a download; read from the headers it is an embedding model, decided before any weight is fetched.
"""

from __future__ import annotations

from collections.abc import Iterable

# Names every decoder's base model (LlamaModel, Qwen3Model, ...) has at its root: the token embedding and
# the block list, which a causal LM keeps under `model.`.
_BASE_ROOTS = ("embed_tokens.", "layers.")
_CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def headless_embedding(architecture: str | None, tensor_names: Iterable[str]) -> str | None:
    """Why a checkpoint that config.json calls a causal LM is an embedding model (None: it is what it says).

    A causal-LM architecture whose tensors are the base model's (a root `embed_tokens` and `layers.*`, nothing
    under `model.`, no `lm_head`) has no language-model head to generate with: an embedding model as released
    (sentence-transformers' pooling config beside it is not fetched; the weights alone decide)."""
    if not architecture or not architecture.endswith(_CAUSAL_LM_SUFFIXES):
        return None
    names = list(tensor_names)
    if not names or any(n.startswith(("model.", "lm_head.")) for n in names):
        return None
    if not all(any(n.startswith(root) for n in names) for root in _BASE_ROOTS):
        return None
    return (f"config.json says {architecture}, but the weights are its base model (embed_tokens, layers.*, norm: "
            "no model. prefix, no lm_head): an embedding model, not a text generator")
