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

The same machinery runs an *artifact* unit by unit (what the vLLM and AI 100 validations measure):
`reader` reads checkpoint tensors a plain widening cannot (FP8 weights times their scales), `transform`
rewrites each parameter as it is loaded (MXFP6 or fp16 emulation), `layers` keeps only the first N decoder
layers (a layer slice, for the engines' checks at sizes that do not fit), and `loaded(module)` loads a unit
for code that calls the units' submodules itself (the AI 100 decoder). Checkpoint names map onto
parameters through weight_rules.py.
"""

from __future__ import annotations

import inspect
import types
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.errors import HiveError, ModelFormatError
from ..source.safetensors_io import TensorSource
from . import expert_stream
from .unit_memory import BufferPool, return_freed_memory
from .weight_rules import weight_rules

if TYPE_CHECKING:
    import torch

# Bytes of a checkpoint tensor widened to fp32 at a time (and then dropped from the resident set).
READ_SLICE_BYTES = 16 << 20
# (parameter name, the module owning it, its attribute, the tensor as read) -> the tensor to use
Transform = Callable[[str, Any, str, "torch.Tensor"], "torch.Tensor"]
# (the checkpoint, a tensor name) -> that tensor as float32, or None where plain widening reads it
Reader = Callable[[TensorSource, str], "torch.Tensor | None"]


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


def read_float32(source: TensorSource, name: str, out: torch.Tensor | None = None):
    """One checkpoint tensor as a float32 torch tensor, widened a slice at a time with each slice's mmap pages
    dropped from the resident set as soon as it is converted (so an embedding matrix never has its file pages
    and its fp32 copy resident in full at once). `out`: a float32 tensor of the tensor's shape to write into."""
    import torch

    info = source.info(name)
    kinds = {"BF16": (np.int16, torch.bfloat16), "F16": (np.float16, None), "F32": (np.float32, None),
             "F64": (np.float64, None)}
    if info.dtype not in kinds:
        raise ModelFormatError(f"tensor {name!r} has dtype {info.dtype}: the reference needs float weights")
    view, torch_view = kinds[info.dtype]
    raw = source.where[name].raw(name)
    out = out if out is not None and tuple(out.shape) == tuple(info.shape) else torch.empty(info.shape,
                                                                                          dtype=torch.float32)
    flat = out.view(-1)
    width = np.dtype(view).itemsize
    step = READ_SLICE_BYTES // width
    with warnings.catch_warnings():  # the mapping is read-only; each slice is copied, never written
        warnings.simplefilter("ignore", UserWarning)
        for lo in range(0, flat.numel(), step):
            part = torch.from_numpy(raw[lo * width:(lo + step) * width].view(view))
            flat[lo:lo + step] = part.view(torch_view) if torch_view is not None else part
            source.release(name, lo * width, (lo + step) * width)
    return out


def read_packed(source: TensorSource, name: str):
    """A packed checkpoint tensor (uint8: MXFP4 blocks, E8M0 scales) as a uint8 torch tensor, copied out of the
    mapping with its pages then dropped; its weight rule (weight_rules.dequantize_mxfp4) makes the float32 value."""
    import torch

    info = source.info(name)
    out = torch.from_numpy(np.array(source.where[name].raw(name)).reshape(info.shape))
    source.release(name)
    return out


def meta_model(model_dir: Path, checkpoint: set[str], layers: int | None = None):
    """(the causal LM built from `model_dir`'s config with every parameter on the meta device, the rule that
    makes each of its parameters from the `checkpoint`'s tensors). A remote-code architecture with a native
    equivalent is built as that (never its own code); `layers` keeps the first N decoder layers."""
    import torch

    from ..core.quiet import quiet_transformers
    from .native import native_config, read_config
    from .slicing import slice_transformers_config

    quiet_transformers()
    try:
        config, native = native_config(model_dir)
        if layers is not None:
            slice_transformers_config(config, layers)
        auto, extra = _auto_class(config)
        with _parameters_on_meta():
            model = auto.from_config(config, dtype=torch.float32, trust_remote_code=False, **extra)
    except HiveError:  # already one line (a native equivalent's refusal of this config)
        raise
    except Exception as e:  # noqa: BLE001 - a config transformers cannot build is malformed input for us
        raise ModelFormatError(f"transformers cannot build the reference model: {type(e).__name__}: {e}") from None
    model = model.eval()
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    rules = weight_rules(names, checkpoint, _tied_names(model, config),
                         (native, read_config(model_dir)) if native is not None else None)
    return model, rules


def _auto_class(config) -> tuple[Any, dict[str, Any]]:
    """(the transformers auto class, its extra from_config arguments) of the architecture the config names: a
    causal LM, or a vision-language model (image-text-to-text) built whole with eager attention, the form its
    vision tower is traced in (the language model inside is the same causal LM)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    archs = getattr(config, "architectures", None) or []
    if archs and MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(config.model_type) == archs[0]:
        return AutoModelForImageTextToText, {"attn_implementation": "eager"}
    return AutoModelForCausalLM, {}


def _tied_names(model, config) -> dict[str, str]:
    """Output embedding -> input embedding, for models that tie them (lm_head has no tensor of its own)."""
    if not getattr(config, "tie_word_embeddings", False) and not getattr(config.get_text_config(), "tie_word_embeddings", False):
        return {}
    by_module = {id(m): n for n, m in model.named_modules()}
    inp, outp = model.get_input_embeddings(), model.get_output_embeddings()
    if inp is None or outp is None:
        return {}
    return {f"{by_module[id(outp)]}.weight": f"{by_module[id(inp)]}.weight"}


def padded_batch(sequences: list[list[int]]):
    """(ids, attention mask) [sequences x the longest], right-padded: no real position attends to a pad."""
    import torch

    longest = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    mask = torch.zeros(len(sequences), longest, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
    return ids, mask


def _first_parameter_owner_outside_decoder(model):
    """The module owning the model's first parameter when it is not part of the language model (None otherwise)."""
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError):
        return None
    first = next((n for n, _ in model.named_parameters()), None)
    inside = {n for n, m in model.named_modules() if m is decoder}
    if first is None or any(first.startswith(d + ".") for d in inside):
        return None
    return model.get_submodule(first.rpartition(".")[0])


class StreamedCausalLM:
    """A causal LM from `model_dir`'s config and safetensors, run with one unit resident at a time."""

    def __init__(self, model_dir: Path, files: list[Path], *, resident: bool = False, layers: int | None = None,
                 transform: Transform | None = None, reader: Reader | None = None, source: TensorSource | None = None):
        """`source`: `files` opened by a TensorSource that names their tensors otherwise (a packed artifact's)."""
        return_freed_memory()  # a unit's tensors, resident or not, go back to the kernel when they are freed
        self.source = source if source is not None else TensorSource(files)
        try:
            self.model, self.rules = meta_model(model_dir, set(self.source.names()), layers)
        except BaseException:
            self.source.close()
            raise
        self.resident = resident
        self.transform = transform
        self.reader = reader
        self.pool = BufferPool()  # streamed: a dropped unit's fp32 buffers serve the next unit's reads
        self._taken: set[int] = set()  # where the reads of the parameter being loaded were written
        self._pooled: set[str] = set()  # parameters whose tensor is the buffer their read was given
        try:
            self._load_buffers()
        except BaseException:
            self.source.close()
            raise
        self.units = _units(self.model)
        self.loads = 0  # units read from disk (a test checks streaming really happened)
        self._loaded: set[str] = set()
        self._held: set[str] = set()  # units loaded by `loaded()`: their forward hooks keep them
        self._by_module: dict[int, tuple[Callable, Callable]] = {}
        for name, module, recurse in self.units:
            load, drop = self._loader(name, module, recurse), self._dropper(name, module, recurse)
            self._by_module[id(module)] = (load, drop)
            module.register_forward_pre_hook(load)
            if not resident:
                module.register_forward_hook(drop)
        # some decoder stacks read the input embedding's device before calling it (Llama 4 moves the ids there):
        # it is loaded as the model's forward starts, so the ids never go to the meta device
        embed_hooks = self._by_module.get(id(self.model.get_input_embeddings()))
        if embed_hooks is not None:
            self.model.register_forward_pre_hook(lambda _module, _args: embed_hooks[0]())
        # some VLMs move their inputs to `model.device` before calling anything (Idefics3), which is the first
        # parameter's: where that lies outside the language model (a vision tower's patch embedding, small), its unit
        # is loaded as the model's forward starts too
        first_hooks = self._by_module.get(id(_first_parameter_owner_outside_decoder(self.model)))
        if first_hooks is not None:
            self.model.register_forward_pre_hook(lambda _module, _args: first_hooks[0]())

    def _load_buffers(self) -> None:
        """Persistent floating-point buffers that the checkpoint holds are read as `from_pretrained` reads them: a
        learned routing bias (MiniMax-M2's, DeepSeek-V3's `e_score_correction_bias`), Apertus's xIELU beta and
        eps. Without this they keep the constructor's zeros and the reference routes another way. The others
        (rotary tables, masks) stay as the constructor made them. Small: read once and kept."""
        checkpoint = set(self.source.names())
        for owner_name, owner in self.model.named_modules():
            for attr, buf in list(owner._buffers.items()):
                if buf is None or attr in owner._non_persistent_buffers_set or not buf.is_floating_point():
                    continue
                full = f"{owner_name}.{attr}" if owner_name else attr
                try:
                    rule = weight_rules([full], checkpoint, {})[full]
                except ModelFormatError:  # not in the checkpoint: the constructor's value, as from_pretrained keeps
                    continue
                value = rule.load(self._read)
                if tuple(value.shape) != tuple(buf.shape):
                    raise ModelFormatError(f"tensor for {full} has shape {list(value.shape)}, the model's buffer is "
                                           f"{list(buf.shape)}")
                owner._buffers[attr] = value.to(buf.dtype)

    def _params(self, prefix: str, module, recurse: bool):
        for pname, _ in list(module.named_parameters(recurse=recurse, remove_duplicate=False)):
            owner_path, _, attr = pname.rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            yield (f"{prefix}.{pname}" if prefix else pname), owner, attr

    def _read(self, name: str):
        """One checkpoint tensor as a float32 torch tensor: the reader's, else `read_float32`."""
        if self.reader is not None:
            read = self.reader(self.source, name)
            if read is not None:
                return read
        if self.source.info(name).dtype == "U8":  # packed MXFP4 blocks / E8M0 scales: their rule decodes the bytes
            return read_packed(self.source, name)
        out = read_float32(self.source, name, self.pool.take(self.source.info(name).shape))
        self._taken.add(out.data_ptr())
        return out

    def _loader(self, prefix: str, module, recurse: bool):
        import torch

        def hook(_module=None, _args=None):
            if prefix in self._loaded:
                return
            params = list(self._params(prefix, module, recurse))
            self.pool.keep_only([tuple(owner._parameters[attr].shape) for _full, owner, attr in params])
            for full, owner, attr in params:
                expected = tuple(owner._parameters[attr].shape)
                if self.transform is None and expert_stream.streams(attr, expected):
                    one = expert_stream.expert_loader(self.rules[full], self.source, self._read, expected[0])
                    if one is not None:  # a large stack of experts: read one expert at a time as the layer runs
                        owner._parameters[attr] = expert_stream.ExpertSlices(expected, one)
                        # the eager forward, expert by expert (not a grouped matmul over the whole stack)
                        eager = inspect.unwrap(type(owner).forward)
                        if "torch.bmm" in inspect.getsource(eager):  # all experts multiplied at once (Llama 4)
                            owner.forward = types.MethodType(expert_stream.bmm_by_expert, owner)
                        elif eager is not type(owner).forward:
                            owner.forward = types.MethodType(eager, owner)
                        continue
                self._taken.clear()
                value = self.rules[full].load(self._read)
                if value.dim() == 3 and tuple(value.shape) == (expected[0], expected[2], expected[1]) != expected:
                    # fused experts stored inputs first (Qwen3-VL-MoE as released): transposed as transformers'
                    # conversion transposes them (a square stack is taken as it is, as there)
                    value = value.transpose(1, 2).contiguous()
                if tuple(value.shape) != expected:
                    raise ModelFormatError(f"tensor for {full} has shape {list(value.shape)}, "
                                           f"the config implies {list(expected)}")
                if self.transform is not None:
                    value = self.transform(full, owner, attr, value)
                elif value.data_ptr() in self._taken and value.is_contiguous() and value.dtype == torch.float32:
                    self._pooled.add(full)  # the read's own buffer: given back to the pool when the unit drops
                owner._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)
            self._loaded.add(prefix)
            self.loads += 1
        return hook

    def _dropper(self, prefix: str, module, recurse: bool):
        import torch

        def hook(_module=None, _args=None, _output=None):
            if _module is not None and prefix in self._held:  # a forward inside `loaded()`: kept until it ends
                return
            for full, owner, attr in self._params(prefix, module, recurse):
                p = owner._parameters[attr]
                owner._parameters[attr] = torch.nn.Parameter(p.to("meta"), requires_grad=False)
                if full in self._pooled:
                    self._pooled.discard(full)
                    self.pool.give(p.data)
                owner.__dict__.pop("forward", None)  # an expert-by-expert forward lives as long as its slices
            self._loaded.discard(prefix)
        return hook

    @contextmanager
    def loaded(self, *modules) -> Iterator[None]:
        """The units `modules` loaded for code that reads them without calling them (their submodules, their
        weights); dropped again on the way out unless the model is resident. Modules that are not units
        (nothing of their own to load) are ignored."""
        hooks = [self._by_module[id(m)] for m in modules if m is not None and id(m) in self._by_module]
        held = {prefix for prefix, module, _r in self.units if any(id(module) == id(m) for m in modules)}
        self._held |= held
        for load, _drop in hooks:
            load()
        try:
            yield
        finally:
            self._held -= held
            if not self.resident:
                for _load, drop in hooks:
                    drop()

    def logits(self, ids: list[int]) -> np.ndarray:
        """fp32 logits [len(ids), vocab] of one sequence."""
        import torch

        with torch.inference_mode():
            out = self.model(torch.tensor([ids], dtype=torch.long), use_cache=False).logits[0]
        return out.float().numpy()

    def logits_batch(self, sequences: list[list[int]]) -> list[np.ndarray]:
        """fp32 logits of several sequences, each [len(seq), vocab]. Streamed: in one pass over the weights (one
        read of each unit), right-padded with an attention mask so no real position sees a pad (the padded
        matrix products round differently from one sequence's, by about 1e-7). Resident: sequence by sequence,
        the numbers of `logits` exactly."""
        import torch

        if self.resident or not sequences:
            return [self.logits(s) for s in sequences]

        ids, mask = padded_batch(sequences)
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        return [out[i, :len(s)].float().numpy().copy() for i, s in enumerate(sequences)]

    def greedy(self, ids: list[int], n: int, eos: set[int] | None = None) -> list[int]:
        """n tokens by argmax, with the KV cache (one pass over the weights per token). Pure argmax: a
        repository's generation_config (repetition penalty, ...) is not applied, as engines compare
        greedy ids."""
        return [t for t, _lp, _gap in self.greedy_scored(ids, n, eos)]

    def greedy_scored(self, ids: list[int], n: int, eos: set[int] | None = None) -> list[tuple[int, float, float]]:
        """Greedy tokens with each one's log-probability and its margin over the runner-up (ties are reported,
        not failed, by the engines' comparison)."""
        import torch

        out: list[tuple[int, float, float]] = []
        with torch.inference_mode():
            res = self.model(torch.tensor([ids], dtype=torch.long), use_cache=True)
            for _ in range(n):
                lp = torch.log_softmax(res.logits[0, -1].float(), dim=-1)
                top2 = torch.topk(lp, 2)
                nxt = int(top2.indices[0])
                out.append((nxt, float(top2.values[0]), float(top2.values[0] - top2.values[1])))
                if eos and nxt in eos or len(out) == n:
                    break
                res = self.model(torch.tensor([[nxt]], dtype=torch.long), past_key_values=res.past_key_values,
                                 use_cache=True)
        return out

    def close(self) -> None:
        """Close the files; units still loaded (a resident model) go back to the meta device, so their memory
        is returned even while the model object lives on."""
        for _name, module, _recurse in self.units:
            if id(module) in self._by_module:
                self._by_module[id(module)][1]()
        self.pool.clear()
        self.source.close()

    def __enter__(self) -> StreamedCausalLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
