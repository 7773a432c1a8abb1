"""A transformers causal LM whose weights stay on disk: each block is read when it runs, then dropped.

The reference every artifact is compared with is transformers' own fp32 forward pass. Holding an 8B
model in fp32 takes 32 GB, more than the build hosts have; this keeps only one block resident:

- the model is built from its config with every parameter on the meta device (no memory; buffers such
  as rotary tables are real, computed by the model's own constructor);
- the module tree is cut into *units*: each element of a ModuleList (a decoder layer) and each other
  module with parameters of its own (embeddings, final norm, lm_head);
- a forward pre-hook on a unit reads its tensors from the safetensors files (mmap, widened to fp32,
  the pages dropped from the resident set afterwards), a forward hook puts the meta parameters back.

The forward code is the model's own, so the numbers are those of `from_pretrained` (tests compare the
two on every family the project builds). `resident=True` keeps every unit loaded after its first use:
the same code path, used when the model fits with margin, so repeated passes do not re-read it.

Checkpoint names map onto parameter names one to one, except where transformers 5 fuses per-expert
MoE weights into stacked tensors (Mixtral, Qwen2/3-MoE): those are stacked here from the per-expert
tensors, as transformers does when it loads them.
"""

from __future__ import annotations

import re
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from .errors import ModelFormatError
from .safetensors_io import TensorSource

if TYPE_CHECKING:
    from .native import NativeEquivalent

# Per-expert checkpoint layouts (module under the layer, gate, up, down) that transformers 5 stacks
# into `<layer>.mlp.experts.gate_up_proj` [E, 2I, H] and `.down_proj` [E, H, I].
EXPERT_LAYOUTS = (("block_sparse_moe", "w1", "w3", "w2"), ("mlp", "gate_proj", "up_proj", "down_proj"))
# Bytes of a checkpoint tensor widened to fp32 at a time (and then dropped from the resident set).
READ_SLICE_BYTES = 16 << 20
# Whole-module renames between checkpoint and model (Mixtral's router lives in block_sparse_moe; GPT-NeoX's
# checkpoints name the output embedding embed_out, transformers 5 names it lm_head; Granite MoE checkpoints keep
# JetMoE's names for their router and stacked experts, as transformers' conversion mapping says).
MODULE_RENAMES = ((".mlp.", ".block_sparse_moe."), ("lm_head.", "embed_out."),
                  (".block_sparse_moe.router.weight", ".block_sparse_moe.router.layer.weight"),
                  (".block_sparse_moe.experts.gate_up_proj", ".block_sparse_moe.input_linear.weight"),
                  (".block_sparse_moe.experts.down_proj", ".block_sparse_moe.output_linear.weight"))


@dataclass(frozen=True)
class WeightRule:
    """How one model parameter is made from checkpoint tensors: `sources` read, then `combine`d."""

    sources: tuple[str, ...]
    combine: Callable[[list], object] | None = None  # None: the single source as it is

    def load(self, read: Callable[[str], object]):
        parts = [read(s) for s in self.sources]
        return parts[0] if self.combine is None else self.combine(parts)


def _stack_gate_up(n_experts: int):
    def combine(parts):
        import torch

        gates, ups = parts[:n_experts], parts[n_experts:]
        return torch.stack([torch.cat([g, u], dim=0) for g, u in zip(gates, ups)])
    return combine


def _stack(parts):
    import torch

    return torch.stack(parts)


def weight_rules(param_names: list[str], checkpoint: set[str], tied: dict[str, str],
                 native: "tuple[NativeEquivalent, dict] | None" = None) -> dict[str, WeightRule]:
    """The rule for every parameter; ModelFormatError naming what no checkpoint tensor provides. `native`: the
    native equivalent of a remote-code architecture and its repository config, whose names it translates."""
    rules: dict[str, WeightRule] = {}
    missing = []
    for name in param_names:
        rule = _native_rule(name, checkpoint, tied, *native) if native else _rule_for(name, checkpoint, tied)
        if rule is None:
            missing.append(name)
        else:
            rules[name] = rule
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelFormatError(f"the checkpoint has no tensor for {', '.join(missing[:3])}{more}")
    return rules


def _rule_for(name: str, checkpoint: set[str], tied: dict[str, str]) -> WeightRule | None:
    candidates = [name]
    for model_part, ckpt_part in MODULE_RENAMES:
        if model_part in name:
            candidates.append(name.replace(model_part, ckpt_part))
    if "." in name:  # checkpoints saved from the base model lack its prefix (`transformer.`, `model.`)
        candidates.append(name.split(".", 1)[1])
    for c in candidates:
        if c in checkpoint:
            return WeightRule((c,))
    m = re.fullmatch(r"(.*)\.mlp\.experts\.(gate_up_proj|down_proj)", name)
    if m:
        layer, which = m.groups()
        for moe, gate, up, down in EXPERT_LAYOUTS:
            n = 0
            while f"{layer}.{moe}.experts.{n}.{gate}.weight" in checkpoint:
                n += 1
            if n == 0:
                continue
            expert = f"{layer}.{moe}.experts.{{}}.{{}}.weight"
            if which == "down_proj":
                return WeightRule(tuple(expert.format(e, down) for e in range(n)), _stack)
            return WeightRule(tuple(expert.format(e, gate) for e in range(n)) + tuple(expert.format(e, up) for e in range(n)),
                              _stack_gate_up(n))
    if name in tied:
        return _rule_for(tied[name], checkpoint, {})
    return None


def _native_rule(name: str, checkpoint: set[str], tied: dict[str, str], eq: "NativeEquivalent",
                 cfg: dict) -> WeightRule | None:
    from .native import checkpoint_source

    found = checkpoint_source(eq, name, cfg)
    if found is not None and found[0] in checkpoint:
        source, take = found
        return WeightRule((source,), None if take is None else (lambda parts, take=take: take(parts[0]).contiguous()))
    if name in tied:
        return _native_rule(tied[name], checkpoint, {}, eq, cfg)
    return None


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside is created on the meta device (no memory, no random init);
    buffers are left alone, so the model's own constructor computes its rotary tables for real."""
    import threading

    import torch

    original = torch.nn.Module.register_parameter
    builder = threading.get_ident()  # modules other threads build meanwhile keep real parameters

    def register(module, name, param):
        if param is not None and param.device.type != "meta" and threading.get_ident() == builder:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=False)
        original(module, name, param)

    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def _units(model) -> list[tuple[str, object, bool]]:
    """(name, module, recurse): decoder layers whole, other modules by their own parameters."""
    import torch

    out: list[tuple[str, object, bool]] = []

    def walk(prefix: str, module) -> None:
        if isinstance(module, torch.nn.ModuleList):
            for i, child in enumerate(module):
                out.append((f"{prefix}{i}", child, True))
            return
        if any(True for _ in module.parameters(recurse=False)):
            out.append((prefix.rstrip("."), module, False))
        for name, child in module.named_children():
            walk(f"{prefix}{name}.", child)

    walk("", model)
    return out


def return_freed_memory() -> None:
    """Make glibc give freed blocks of 1 MiB and more straight back to the kernel. By default its mmap
    threshold rises to 32 MiB after the first large free, so a layer's 4-32 MiB weight matrices land on
    the heap, and the heap does not shrink between layers: streamed, the process would still grow to
    the size of the model."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD (a fixed value also stops the dynamic adjustment)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def trim_heap() -> None:
    """Hand the heap's free pages back to the kernel (after an in-process reference: the build goes on
    to run an engine child, and the fp32 weights it no longer holds should not stay counted)."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class StreamedCausalLM:
    """A causal LM from `model_dir`'s config and safetensors, run with one unit resident at a time."""

    def __init__(self, model_dir: Path, files: list[Path], *, resident: bool = False):
        import torch
        from transformers import AutoModelForCausalLM

        from .native import native_config, read_config
        from .reference import _quiet_transformers

        _quiet_transformers()
        if not resident:
            return_freed_memory()
        try:
            # a remote-code architecture with a native equivalent is built as that (never its own code)
            config, native = native_config(model_dir)
            with _parameters_on_meta():
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 - a config transformers cannot build is malformed input for us
            raise ModelFormatError(f"transformers cannot build the reference model: {type(e).__name__}: {e}") from None
        self.model = model.eval()
        self.resident = resident
        self.source = TensorSource(files)
        names = [n for n, _ in self.model.named_parameters(remove_duplicate=False)]
        self.rules = weight_rules(names, set(self.source.names()), self._tied_names(config),
                                  (native, read_config(model_dir)) if native is not None else None)
        self.units = _units(self.model)
        self.loads = 0  # units read from disk (a test checks streaming really happened)
        self._loaded: set[str] = set()
        for name, module, recurse in self.units:
            module.register_forward_pre_hook(self._loader(name, module, recurse))
            if not resident:
                module.register_forward_hook(self._dropper(name, module, recurse))

    def _tied_names(self, config) -> dict[str, str]:
        """Output embedding -> input embedding, for models that tie them (lm_head has no tensor of its own)."""
        if not getattr(config, "tie_word_embeddings", False) and not getattr(config.get_text_config(), "tie_word_embeddings", False):
            return {}
        by_module = {id(m): n for n, m in self.model.named_modules()}
        inp, outp = self.model.get_input_embeddings(), self.model.get_output_embeddings()
        if inp is None or outp is None:
            return {}
        return {f"{by_module[id(outp)]}.weight": f"{by_module[id(inp)]}.weight"}

    def _params(self, prefix: str, module, recurse: bool):
        for pname, _ in list(module.named_parameters(recurse=recurse, remove_duplicate=False)):
            owner_path, _, attr = pname.rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            yield (f"{prefix}.{pname}" if prefix else pname), owner, attr

    def _read(self, name: str):
        """One checkpoint tensor as a float32 torch tensor, widened a slice at a time with each slice's
        mmap pages dropped from the resident set as soon as it is converted (so an embedding matrix
        never has its file pages and its fp32 copy resident in full at once)."""
        import torch

        info = self.source.info(name)
        kinds = {"BF16": (np.int16, torch.bfloat16), "F16": (np.float16, None), "F32": (np.float32, None),
                 "F64": (np.float64, None)}
        if info.dtype not in kinds:
            raise ModelFormatError(f"tensor {name!r} has dtype {info.dtype}: the reference needs float weights")
        view, torch_view = kinds[info.dtype]
        raw = self.source.where[name].raw(name)
        out = torch.empty(info.shape, dtype=torch.float32)
        flat = out.view(-1)
        width = np.dtype(view).itemsize
        step = READ_SLICE_BYTES // width
        with warnings.catch_warnings():  # the mapping is read-only; each slice is copied, never written
            warnings.simplefilter("ignore", UserWarning)
            for lo in range(0, flat.numel(), step):
                part = torch.from_numpy(raw[lo * width:(lo + step) * width].view(view))
                flat[lo:lo + step] = part.view(torch_view) if torch_view is not None else part
                self.source.release(name, lo * width, (lo + step) * width)
        return out

    def _loader(self, prefix: str, module, recurse: bool):
        import torch

        def hook(_module, _args):
            if prefix in self._loaded:
                return
            for full, owner, attr in self._params(prefix, module, recurse):
                value = self.rules[full].load(self._read)
                expected = tuple(owner._parameters[attr].shape)
                if tuple(value.shape) != expected:
                    raise ModelFormatError(f"tensor for {full} has shape {list(value.shape)}, the config implies {list(expected)}")
                owner._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)
            self._loaded.add(prefix)
            self.loads += 1
        return hook

    def _dropper(self, prefix: str, module, recurse: bool):
        import torch

        def hook(_module, _args, _output):
            for _full, owner, attr in self._params(prefix, module, recurse):
                p = owner._parameters[attr]
                owner._parameters[attr] = torch.nn.Parameter(p.to("meta"), requires_grad=False)
            self._loaded.discard(prefix)
        return hook

    def logits(self, ids: list[int]) -> np.ndarray:
        """fp32 logits [len(ids), vocab] of one sequence."""
        import torch

        with torch.inference_mode():
            out = self.model(torch.tensor([ids], dtype=torch.long), use_cache=False).logits[0]
        return out.float().numpy()

    def greedy(self, ids: list[int], n: int, eos: set[int] | None = None) -> list[int]:
        """n tokens by argmax, with the KV cache (one pass over the weights per token). Pure argmax: a
        repository's generation_config (repetition penalty, ...) is not applied, as engines compare
        greedy ids."""
        import torch

        out: list[int] = []
        with torch.inference_mode():
            res = self.model(torch.tensor([ids], dtype=torch.long), use_cache=True)
            for _ in range(n):
                nxt = int(res.logits[0, -1].argmax())
                out.append(nxt)
                if eos and nxt in eos or len(out) == n:
                    break
                res = self.model(torch.tensor([[nxt]], dtype=torch.long), past_key_values=res.past_key_values,
                                 use_cache=True)
        return out

    def close(self) -> None:
        self.source.close()

    def __enter__(self) -> "StreamedCausalLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
