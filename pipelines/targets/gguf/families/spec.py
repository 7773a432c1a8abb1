"""The vocabulary of GGUF family declarations: hyper-parameters, tensor rules, transforms.

A family (one module per family in this package) is data: which config values become which GGUF keys
(`Param`), and which HF tensors become which GGUF tensors (`Rule`: several sources -> several targets
through one small `Transform`). The streaming engine (`..convert`) plans every tensor from the
safetensors headers with `Transform.shapes`, then runs `Transform.apply` one rule at a time; a rowwise
transform is applied to row slices, so a 2 GB embedding never exists in float32 at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np

from ....core.errors import ModelFormatError

T = gguf.MODEL_TENSOR
Shape = tuple[int, ...]


@dataclass(frozen=True)
class HParams:
    """The config values a family needs, read once from config.json (transformers 4 and 5 spellings)."""

    cfg: dict[str, Any]

    def get(self, key: str, default: Any = None) -> Any:
        return self.cfg.get(key, default)

    def find(self, *keys: str, default: Any = None) -> Any:
        """The first of `keys` the config sets (families spell one value several ways: n_embd, hidden_size)."""
        for key in keys:
            if self.cfg.get(key) is not None:
                return self.cfg[key]
        return default

    def require(self, *keys: str) -> Any:
        value = self.find(*keys)
        if value is None:
            raise ModelFormatError(f"config.json has no {' / '.join(keys)}")
        return value

    @property
    def hidden(self) -> int:
        return int(self.require("hidden_size", "n_embd", "d_model"))

    @property
    def n_layers(self) -> int:
        blocks = self.get("layers_block_type")
        if self.find("num_hidden_layers", "n_layer", "num_layers") is None and isinstance(blocks, list):
            return len(blocks)  # Nemotron-H as transformers 5 saves it: the count is its per-layer list's length
        return int(self.require("num_hidden_layers", "n_layer", "num_layers"))

    @property
    def n_head(self) -> int:
        return int(self.require("num_attention_heads", "n_head"))

    @property
    def n_head_kv(self) -> int:
        return int(self.find("num_key_value_heads", "num_kv_heads", "n_head_kv", default=self.n_head))

    @property
    def head_dim(self) -> int:
        return int(self.get("head_dim") or self.hidden // self.n_head)

    @property
    def n_experts(self) -> int:
        # ERNIE 4.5 MoE spells it moe_num_experts (transformers maps num_experts onto it), DeepSeek / GLM-4.5
        # n_routed_experts
        return int(self.require("num_local_experts", "num_experts", "moe_num_experts", "n_routed_experts"))

    @property
    def rope(self) -> dict[str, Any]:
        """rope_theta, scaling and partial_rotary_factor: transformers 5 nests them in rope_parameters."""
        for key in ("rope_parameters", "rope_scaling"):
            # `check` refuses these too; a direct convert() must still fail in one line, not on dict("linear").
            if self.get(key) is not None and not isinstance(self.get(key), dict):
                raise ModelFormatError(f"config.json {key} must be an object, not {type(self.get(key)).__name__}")
        params = dict(self.get("rope_parameters") or {})
        if "full_attention" in params and isinstance(params["full_attention"], dict):
            params = dict(params["full_attention"])  # per-layer-type rope (Gemma 3): the global layers'
        scaling = self.get("rope_scaling") or {}
        out = {**scaling, **params}
        out.setdefault("rope_theta", self.find("rope_theta", "rotary_emb_base", default=10000.0))
        out.setdefault("partial_rotary_factor", self.get("partial_rotary_factor", 1.0))
        out["rope_type"] = out.get("rope_type") or out.get("type") or "default"
        return out


# --- hyper-parameters --------------------------------------------------------------------------------

Source = tuple[str, ...] | Callable[[HParams], Any]


@dataclass(frozen=True)
class Param:
    """One GGUF key (`{arch}` filled in) from the first config key that is set, or computed from the config.
    A value of None (from a function, or no config key set) writes nothing, or is an error if `required`;
    in a family's own params it also drops the generic key of that name."""

    key: str
    source: Source
    kind: type = int
    required: bool = False

    def value(self, hp: HParams) -> Any:
        value = self.source(hp) if callable(self.source) else hp.find(*self.source)
        if value is None:
            if self.required:
                what = "a value" if callable(self.source) else " / ".join(self.source)
                raise ModelFormatError(f"config.json has no {what} (needed for {self.key.format(arch='<arch>')})")
            return None
        if self.kind is int and (isinstance(value, bool) or int(value) != value):
            raise ModelFormatError(f"config value for {self.key.format(arch='<arch>')} must be an integer, not {value!r}")
        return self.kind(value)


def param(key: str, *source: str, kind: type = int, required: bool = False) -> Param:
    return Param(key, tuple(source), kind, required)


def derived(key: str, fn: Callable[[HParams], Any], kind: type = int) -> Param:
    return Param(key, fn, kind)


K, A, R = gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.Rope

# What llama.cpp's converter writes for every text model when the config has it (the same config spellings).
GENERIC: tuple[Param, ...] = (
    derived(K.BLOCK_COUNT, lambda hp: hp.n_layers),
    param(K.CONTEXT_LENGTH, "max_position_embeddings", "n_ctx", "n_positions", "max_length", "max_sequence_length",
          "model_max_length"),
    param(K.EMBEDDING_LENGTH, "hidden_size", "n_embd", "dim"),
    param(K.FEED_FORWARD_LENGTH, "intermediate_size", "n_inner", "hidden_dim"),
    param(A.HEAD_COUNT, "num_attention_heads", "n_head", "n_heads"),
    param(A.HEAD_COUNT_KV, "num_key_value_heads", "n_kv_heads"),
    param(A.LAYERNORM_RMS_EPS, "rms_norm_eps", "norm_eps", kind=float),
    param(A.LAYERNORM_EPS, "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon", kind=float),
    param(K.EXPERT_COUNT, "num_local_experts", "num_experts", "n_routed_experts"),
    param(K.EXPERT_USED_COUNT, "num_experts_per_tok", "num_experts_per_token", "top_k_experts"),
    param(A.KEY_LENGTH, "head_dim"),
    param(A.VALUE_LENGTH, "head_dim"),
)


def rope_params(hp: HParams) -> list[tuple[str, Any, type]]:
    """(key, value, kind) of the rope scaling keys (llama.cpp's names), or a one-line refusal."""
    rope = hp.rope
    kind = rope["rope_type"]
    out: list[tuple[str, Any, type]] = [(R.FREQ_BASE, rope["rope_theta"], float)]
    if kind == "linear":
        out += [(R.SCALING_TYPE, gguf.RopeScalingType.LINEAR.value, str), (R.SCALING_FACTOR, rope["factor"], float)]
    elif kind == "yarn":
        out += [(R.SCALING_TYPE, gguf.RopeScalingType.YARN.value, str), (R.SCALING_FACTOR, rope["factor"], float),
                (R.SCALING_ORIG_CTX_LEN, rope["original_max_position_embeddings"], int)]
        for key, names in ((R.SCALING_YARN_EXT_FACTOR, ("extrapolation_factor",)),
                           (R.SCALING_YARN_ATTN_FACTOR, ("attention_factor", "attn_factor")),
                           (R.SCALING_YARN_BETA_FAST, ("beta_fast",)), (R.SCALING_YARN_BETA_SLOW, ("beta_slow",))):
            value = next((rope[n] for n in names if rope.get(n) is not None), None)
            if value is not None:
                out.append((key, value, float))
    elif kind == "dynamic":
        # Dynamic NTK rescales the base only for sequences longer than max_position_embeddings, the GGUF's
        # context length: inside it the model's rope is the default one, which llama.cpp computes.
        pass
    elif kind not in ("default", "llama3"):  # llama3's scaling is the rope_freqs tensor (shared.py)
        raise ModelFormatError(f"rope scaling type {kind!r} is not supported for GGUF yet")
    return out


def rotary_dims(hp: HParams) -> int:
    """Rotary dimensions per head: all of head_dim unless a partial rotary factor (Phi, StableLM, NeoX) says less."""
    return int(hp.head_dim * float(hp.rope["partial_rotary_factor"]))


# --- one-line refusals shared by the families' checks -------------------------------------------------


def refuse_true(hp: HParams, arch: str, key: str, why: str) -> None:
    """Refuse a config that sets `key` (a bias, tied embeddings ...) that llama.cpp's `arch` cannot run."""
    if hp.get(key):
        raise ModelFormatError(f"{arch} with {key}=true is not supported: {why}")


def refuse_false(hp: HParams, arch: str, key: str, why: str) -> None:
    """Refuse a config that turns off `key` (biases, attention scaling ...) that llama.cpp's `arch` always has.
    Only an explicit false: an unset key means the config class's default, which is the layout llama.cpp runs."""
    if hp.get(key) is False:
        raise ModelFormatError(f"{arch} with {key}=false is not supported: {why}")


def refuse_rope(hp: HParams, arch: str, allowed: tuple[str, ...] = ("default", "linear", "yarn"), *,
                why: str | None = None) -> None:
    """Refuse a rope scaling type llama.cpp's `arch` does not implement; `why` says so when it never will."""
    kind = hp.rope["rope_type"]
    if kind not in allowed:
        raise ModelFormatError(f"rope scaling type {kind!r} is not supported for {arch} GGUF"
                               + (f": {why}" if why else " yet"))


def refuse_scaled_sliding_rope(arch: str, sliding_rope: dict[str, Any]) -> None:
    """Refuse a scaled rope of its own on the sliding-window layers (Gemma 3, OLMo 3): llama.cpp scales only
    the global layers' rope. `sliding_rope` is the sliding layers' rope with its `rope_type` filled in."""
    kind = sliding_rope["rope_type"]
    if kind != "default":
        raise ModelFormatError(f"{arch} with a {kind!r} rope on the sliding layers is not supported: llama.cpp "
                               "runs their rope unscaled")


def require_activation(hp: HParams, arch: str, expected: str | tuple[str, ...], why: str,
                       key: str = "hidden_act") -> None:
    """Refuse an MLP activation that llama.cpp's `arch` does not run. `expected` may be several spellings of
    the one function it runs (GELU's); an unset `key` is the config class's default, which is one of them."""
    accepted = (expected,) if isinstance(expected, str) else expected
    act = hp.find(key, default=accepted[0])
    if act not in accepted:
        raise ModelFormatError(f"{arch} with activation {act!r} is not supported: {why}")


def require_whole_heads(hp: HParams, arch: str) -> None:
    """llama.cpp graphs that size the attention output as [hidden, hidden] need heads x head_dim == hidden."""
    if hp.n_head * hp.head_dim != hp.hidden:
        raise ModelFormatError(f"{arch} GGUF needs num_attention_heads x head_dim == hidden_size ({hp.hidden}), "
                               f"config has {hp.n_head} x {hp.head_dim}")


# --- tensors -------------------------------------------------------------------------------------------

Arrays = list[np.ndarray]


@dataclass(frozen=True)
class Transform:
    """Source tensors -> GGUF tensors. `shapes` gives the output shapes from the input shapes (planning
    happens before data is read); `apply` computes them in float32. `rowwise`: one input, one output of
    the same shape, and row r of the output depends only on row r of the input, so the engine streams it
    in row slices. `stack`: the inputs are stacked along a new first axis (MoE experts), which the engine
    writes input by input."""

    name: str
    apply: Callable[[Arrays, HParams], Arrays]
    shapes: Callable[[list[Shape], HParams], list[Shape]]
    rowwise: bool = False
    stack: bool = False
    # One output whose rows along the first axis (the experts of a fused [E, ...] tensor) depend only on the same
    # rows of every input: the engine streams the inputs sliced together along that axis (a 120B's experts).
    sliced: bool = False
    # The output's GGML type whatever the recipe's outtype (MXFP4 experts stay MXFP4, as llama.cpp keeps them):
    # sliced, and `apply` gets the inputs as stored (packed bytes, not widened) and returns that type's bytes;
    # `shapes` gives the output's element shape.
    fixed: gguf.GGMLQuantizationType | None = None


def _same_shape(shapes: list[Shape], hp: HParams) -> list[Shape]:
    return [shapes[0]]


def elementwise(name: str, fn: Callable[[np.ndarray, HParams], np.ndarray]) -> Transform:
    """A transform of each value on its own (a scale, an offset): streamed in row slices."""
    return Transform(name, lambda xs, hp: [fn(xs[0], hp)], _same_shape, rowwise=True)


def reshaped(name: str, fn: Callable[[np.ndarray, HParams], np.ndarray]) -> Transform:
    """A whole-tensor transform that keeps the shape (a permutation of rows)."""
    return Transform(name, lambda xs, hp: [fn(xs[0], hp)], _same_shape)


IDENTITY = elementwise("identity", lambda x, hp: x)
STACK = Transform("stack", lambda xs, hp: [np.stack(xs)], lambda s, hp: [(len(s), *s[0])], stack=True)
TRANSPOSE = Transform("transpose", lambda xs, hp: [np.ascontiguousarray(xs[0].T)], lambda s, hp: [tuple(reversed(s[0]))])
PLUS_ONE = elementwise("plus_one", lambda x, hp: x + np.float32(1.0))  # norms stored as w where the model uses 1 + w


def split_axis(name: str, sizes: Callable[[HParams], Sequence[int]], axis: int) -> Transform:
    """One fused tensor -> several, split along `axis` (stacked experts [E, gate + up, H] -> gate, up: axis 1)."""

    def apply(xs: Arrays, hp: HParams) -> Arrays:
        return [np.ascontiguousarray(x) for x in np.split(xs[0], np.cumsum(sizes(hp))[:-1], axis=axis)]

    def shapes(s: list[Shape], hp: HParams) -> list[Shape]:
        parts = list(sizes(hp))
        if len(s[0]) <= axis or sum(parts) != s[0][axis]:
            raise ModelFormatError(f"a fused tensor of shape {list(s[0])} cannot be split into {parts} along axis {axis}")
        return [tuple(n if i == axis else d for i, d in enumerate(s[0])) for n in parts]

    return Transform(name, apply, shapes)


def split_rows(name: str, sizes: Callable[[HParams], Sequence[int]]) -> Transform:
    """One fused tensor -> several, split along the first axis (qkv_proj -> q, k, v)."""
    return split_axis(name, sizes, 0)


def then(first: Transform, *more: Callable[[Arrays, HParams], Arrays]) -> Transform:
    """`first`, then shape-preserving steps on its outputs (split qkv, then permute q and k)."""

    def apply(xs: Arrays, hp: HParams) -> Arrays:
        out = first.apply(xs, hp)
        for step in more:
            out = step(out, hp)
        return out

    return Transform(first.name + "+" + "+".join(getattr(m, "__name__", "step") for m in more), apply, first.shapes)


@dataclass(frozen=True)
class Rule:
    """GGUF tensors `outputs` from HF tensors `inputs` through `transform`. Names may hold `{bid}` (the block);
    an input holding `{xid}` stands for one tensor per expert, in order. `optional`: skipped (with all its
    outputs) when an input is absent. `when(hp, bid)`: the rule applies to that block only if true."""

    outputs: tuple[str, ...]
    inputs: tuple[str, ...]
    transform: Transform = IDENTITY
    optional: bool = False
    when: Callable[[HParams, int], bool] | None = None

    @property
    def per_block(self) -> bool:
        return any("{bid}" in n for n in self.outputs + self.inputs)


def name(t: gguf.MODEL_TENSOR, suffix: str = "weight") -> str:
    return f"{gguf.TENSOR_NAMES[t]}.{suffix}"


def tensor(t: gguf.MODEL_TENSOR, hf: str, transform: Transform = IDENTITY, *, suffix: str = "weight",
           optional: bool = False, when: Callable[[HParams, int], bool] | None = None) -> Rule:
    """The common case: one HF tensor -> one GGUF tensor."""
    return Rule((name(t, suffix),), (hf,), transform, optional, when)


def weight_and_bias(t: gguf.MODEL_TENSOR, hf_prefix: str, transform: Transform = IDENTITY, *,
                    bias_optional: bool = False, bias_transform: Transform | None = None) -> tuple[Rule, ...]:
    """`<prefix>.weight` and `<prefix>.bias` (layer norms, biased linears)."""
    return (tensor(t, f"{hf_prefix}.weight", transform),
            tensor(t, f"{hf_prefix}.bias", bias_transform or transform, suffix="bias", optional=bias_optional))


def experts(t: gguf.MODEL_TENSOR, hf: str, *, when: Callable[[HParams, int], bool] | None = None) -> Rule:
    """Per-expert HF tensors (`hf` holds `{xid}`) stacked into one GGUF tensor [experts, rows, cols]."""
    return Rule((name(t),), (hf,), STACK, when=when)


def no_extra(hp: HParams) -> dict[str, np.ndarray]:
    return {}


def accept(hp: HParams) -> None:
    return None


def located(name: str, renames, present: Callable[[str], bool]) -> str:
    """The checkpoint's name of the tensor rules call `name` (a family's or a projector's `renames` applied)."""
    moved = (to + name[len(prefix):] for prefix, to in renames if name.startswith(prefix))
    return name if present(name) else next((m for m in moved if present(m)), name)


@dataclass(frozen=True)
class Family:
    """One llama.cpp architecture and the HF architectures converted to it."""

    name: str
    gguf_arch: str
    architectures: tuple[str, ...]
    tensors: tuple[Rule, ...]
    params: tuple[Param, ...] = ()  # after GENERIC, overriding keys it also sets
    rope: bool = True  # write rope_params (freq base, scaling)
    extra_tensors: Callable[[HParams], dict[str, np.ndarray]] = no_extra  # computed tensors (rope_freqs)
    ignored: tuple[str, ...] = field(default=())  # regexes of HF tensors deliberately unused
    check: Callable[[HParams], None] = accept  # refuses configs llama.cpp cannot run for this architecture
    tied_output: str | None = "lm_head.weight"  # dropped when tie_word_embeddings (llama.cpp reuses token_embd)
    tied_default: bool = False  # transformers' default tie_word_embeddings for these architectures (a config may omit it)
    block_prefix: str = "model.layers"  # HF module list of the blocks (for the "unmapped tensors" check)
    # GGUF blocks when more than num_hidden_layers: multi-token-prediction (NextN) layers kept after the trunk
    blocks: Callable[[HParams], int] | None = None
    # HF tensors deliberately unused by what the config says (the NextN layers llama.cpp's converter drops)
    unused: Callable[[HParams, str], bool] | None = None
    query_gate: bool = False  # attn_q also yields each head's output gate (Qwen3-Next): 2 x heads x head_dim rows
    query_head_dim: Callable[[HParams], int] | None = None  # a query head's rows when not head_dim (MLA: nope + rope)
    # config.json quant_methods whose stored tensors the rules read as they are (gpt-oss: "mxfp4"); any other
    # quantization_config is refused, as the converter reads only unquantized float weights otherwise
    quantizations: tuple[str, ...] = ()
    # (family prefix, checkpoint prefix): where a wrapper keeps the tensors the rules name, tried in order when a
    # name is absent as written (a vision-language model's language model under `model.language_model.`)
    renames: tuple[tuple[str, str], ...] = ()
    # (GGUF key, HF tensor holding `{bid}`): a per-layer key whose values are checkpoint scalars, not config values
    # (Apertus's learned xIELU parameters): one float per block, read when the header is written, as a list
    tensor_keys: tuple[tuple[str, str], ...] = ()
    # The family a config is written as when not this one (a Granite 4 hybrid config without Mamba layers is
    # llama.cpp's `granite`, as its converter writes it); None: this family. Never registered on its own.
    variant: Callable[[HParams], Family | None] | None = None
    # Recurrent and hybrid families: f32 values of llama.cpp's recurrent state per sequence, all layers together
    # (the memory plan's cache beside the KV cache), and how many layers keep a KV cache (None: every layer).
    recurrent_state: Callable[[HParams], int] | None = None
    kv_layers: Callable[[HParams], int] | None = None

    def for_config(self, hp: HParams) -> Family:
        """The family this config is converted as (`variant`)."""
        return (self.variant(hp) if self.variant is not None else None) or self

    def located(self, name: str, present: Callable[[str], bool]) -> str:
        return located(name, self.renames, present)

    def key_tensors(self, hp: HParams, present: Callable[[str], bool]) -> dict[str, list[str]]:
        """GGUF key -> the checkpoint scalars (one per block) its per-layer values are read from (`tensor_keys`)."""
        out: dict[str, list[str]] = {}
        for key, hf in self.tensor_keys:
            names = [self.located(hf.replace("{bid}", str(bid)), present) for bid in range(hp.n_layers)]
            missing = [n for n in names if not present(n)]
            if missing:
                raise ModelFormatError(f"missing tensor {missing[0]!r} for {self.name} (needed for "
                                       f"{key.format(arch=self.gguf_arch)})")
            out[key.format(arch=self.gguf_arch)] = names
        return out

    def tensor_key_values(self, hp: HParams, present: Callable[[str], bool],
                          read: Callable[[str], np.ndarray]) -> dict[str, tuple[Any, type]]:
        """The per-layer keys read from checkpoint scalars, as float lists (the values llama.cpp's converter writes)."""
        out: dict[str, tuple[Any, type]] = {}
        for key, names in self.key_tensors(hp, present).items():
            values = [np.asarray(read(n), dtype=np.float32).reshape(-1) for n in names]
            bad = next((n for n, v in zip(names, values) if v.size != 1 or not np.isfinite(v).all()), None)
            if bad is not None:
                raise ModelFormatError(f"{bad} must hold one finite value (for {key})")
            out[key] = ([float(v[0]) for v in values], list)
        return out

    def key_values(self, hp: HParams) -> dict[str, tuple[Any, type]]:
        """Every GGUF hyper-parameter key of this family for this config, in writing order."""
        self.check(hp)
        out: dict[str, tuple[Any, type]] = {}
        for p in GENERIC:
            if (value := p.value(hp)) is not None:
                out[p.key.format(arch=self.gguf_arch)] = (value, p.kind)
        for p in self.params:  # a family's own value replaces the generic one; None drops the key
            key, value = p.key.format(arch=self.gguf_arch), p.value(hp)
            out.pop(key, None)
            if value is not None:
                out[key] = (value, p.kind)
        if self.rope:
            for key, value, kind in rope_params(hp):
                out[key.format(arch=self.gguf_arch)] = (kind(value) if kind is not str else value, kind)
        return out
