"""k-quants written straight from the source's tensors: no lossless GGUF intermediate on disk.

libllama's quantizer reads a whole GGUF, so the usual way to a k-quant (llama.cpp's converter too) writes the
model once losslessly (131 GiB for a 70B in bf16) and then its quantized copy beside it. Two things decide
the quantized file: which type each tensor gets (llama.cpp's rules: Q6_K for the output matrix, more bits
for some attn_v / ffn_down layers, fallbacks for rows that are not whole blocks) and how a tensor's rows are
quantized. Both are taken from llama.cpp itself, never re-implemented:

- the types from `llama_quant_compute_types` (llama-ext.h: a model made from the GGUF's hyperparameters and
  the tensors' names and shapes), called in a child process because it is C++ that may throw;
- the rows from `ggml_quantize_chunk` (libggml-base), called on each streamed row slice as the converter
  writes it. Rows are independent, so slicing changes no byte.

The converter feeds the quantizer what libllama would have read from the intermediate: values rounded to
the lossless type first (a transform computed in fp32 is rounded to bf16 there). The result is the same file,
byte for byte, as the intermediate quantized by libllama (tests/targets/gguf/test_gguf_tensor_quant.py), written with
one tensor's row slices in memory and only the quantized file on disk.

Not taken this way (the intermediate path stays): an importance matrix (libllama maps its entries to
tensors by name while it quantizes), and a libllama without the llama-ext.h functions.
"""

from __future__ import annotations

import ctypes
import importlib.util
from collections import Counter
from functools import cache, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

# The exported names differ by compiler: llama-ext.h declares them without extern "C" (Itanium C++ mangling
# on Linux; plain names where a build exports them as C).
SYMBOLS = {
    "from_metadata": ("llama_quant_model_from_metadata", "_Z31llama_quant_model_from_metadataPK22llama_quant_model_desc"),
    "init": ("llama_quant_init", "_Z16llama_quant_initPK11llama_modelPK27llama_model_quantize_params"),
    "free": ("llama_quant_free", "_Z16llama_quant_freeP19quantize_state_impl"),
    "allows": ("llama_quant_tensor_allows_quantization",
               "_Z38llama_quant_tensor_allows_quantizationPK19quantize_state_implPK11ggml_tensor"),
    "compute_types": ("llama_quant_compute_types",
                      "_Z25llama_quant_compute_typesP19quantize_state_impl11llama_ftypePP11ggml_tensorP9ggml_typem"),
}
# gguf-py's numpy quantizers give ggml's reference bytes for these (and the converter's q8_0 uses them).
SUPERBLOCK = 256  # the k-quants' block of weights
GGML_LOG_LEVEL_ERROR = 4
NUMPY_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
FLOAT_GGML_TYPES = (0, 1, 30)  # F32, F16, BF16: what a lossless GGUF holds unless a rule fixed the type


def _lib_dir() -> Path | None:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def _symbol(lib: ctypes.CDLL, names: tuple[str, ...]):
    for name in names:
        try:
            return getattr(lib, name)
        except AttributeError:
            continue
    return None


@lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why the direct path cannot run here (None when it can). Loads libllama, imports nothing heavy: the plan
    asks too, to know whether a k-quant needs disk for its intermediate."""
    lib_dir = _lib_dir()
    if lib_dir is None:
        return "llama-cpp-python is not installed"
    try:
        llama = ctypes.CDLL(str(lib_dir / "libllama.so"))
        base = ctypes.CDLL(str(lib_dir / "libggml-base.so"))
    except OSError as e:
        return f"libllama could not be loaded ({e})"
    missing = [names[0] for names in SYMBOLS.values() if _symbol(llama, names) is None]
    if missing or _symbol(base, ("ggml_quantize_chunk",)) is None:
        return f"this libllama lacks {', '.join(missing) or 'ggml_quantize_chunk'}"
    return None


def direct(options: dict[str, Any]) -> bool:
    """Whether a k-quant recipe is written without the lossless intermediate."""
    return bool(options.get("ftype")) and not options.get("imatrix") and unavailable() is None


# --- the per-tensor types (in a child) ---------------------------------------------------------------------------

def model_shape(arch: str, key_values: dict[str, tuple[Any, type]]) -> dict[str, Any]:
    """llama_quant_model_desc from the GGUF keys the converter writes (per-layer lists: their largest)."""
    def value(key: str, default: Any = None) -> Any:
        v = key_values.get(f"{arch}.{key}", (default, None))[0]
        return max(v) if isinstance(v, (list, tuple)) else v

    n_embd, n_head = int(value("embedding_length", 0)), int(value("attention.head_count", 1) or 1)
    return {
        "architecture": arch, "n_embd": n_embd, "n_ff": int(value("feed_forward_length", 0)),
        "n_layer": int(value("block_count", 0)), "n_head": n_head,
        "n_head_kv": int(value("attention.head_count_kv", n_head)), "n_expert": int(value("expert_count", 0)),
        "n_embd_head_k": int(value("attention.key_length", n_embd // n_head)),
        "n_embd_head_v": int(value("attention.value_length", n_embd // n_head)),
    }


def assign_types(shape: dict[str, Any], tensors: list[tuple[str, tuple[int, ...], int]], ftype: int,
                 step: str) -> list[int | None]:
    """llama.cpp's type for each (name, numpy shape, lossless ggml type) tensor, None where it stays as it is."""
    from ...process.isolation import run_isolated

    return run_isolated(assign_types_here, engine="llama.cpp", step=step,
                        shape=shape, tensors=[[n, list(s), t] for n, s, t in tensors], ftype=ftype)


class _Desc(ctypes.Structure):
    _fields_ = [("architecture", ctypes.c_char_p)] + [(n, ctypes.c_uint32) for n in (
        "n_embd", "n_ff", "n_layer", "n_head", "n_head_kv", "n_expert", "n_embd_head_k", "n_embd_head_v")]


class _GgmlInit(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def assign_types_here(shape: dict[str, Any], tensors: list[list], ftype: int) -> list[int | None]:
    """Runs in the child: a metadata-only model, a ggml context of shapes without data, llama.cpp's rules."""
    import llama_cpp

    llama, base = llama_cpp.llama_cpp._lib, ctypes.CDLL(str(_lib_dir() / "libggml-base.so"))
    fn = {k: _symbol(llama, names) for k, names in SYMBOLS.items()}
    fn["from_metadata"].argtypes, fn["from_metadata"].restype = [ctypes.POINTER(_Desc)], ctypes.c_void_p
    fn["init"].argtypes = [ctypes.c_void_p, ctypes.POINTER(llama_cpp.llama_model_quantize_params)]
    fn["init"].restype = ctypes.c_void_p
    fn["free"].argtypes, fn["free"].restype = [ctypes.c_void_p], None
    fn["allows"].argtypes, fn["allows"].restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_bool
    fn["compute_types"].argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p),
                                    ctypes.POINTER(ctypes.c_int), ctypes.c_size_t]
    fn["compute_types"].restype = None
    base.ggml_init.argtypes, base.ggml_init.restype = [_GgmlInit], ctypes.c_void_p
    base.ggml_new_tensor.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int64)]
    base.ggml_new_tensor.restype = ctypes.c_void_p
    base.ggml_set_name.argtypes, base.ggml_set_name.restype = [ctypes.c_void_p, ctypes.c_char_p], ctypes.c_void_p
    base.ggml_tensor_overhead.restype = ctypes.c_size_t
    base.ggml_free.argtypes, base.ggml_free.restype = [ctypes.c_void_p], None
    llama.llama_model_free.argtypes, llama.llama_model_free.restype = [ctypes.c_void_p], None

    import sys

    @llama_cpp.llama_log_callback
    def errors_only(level: int, text: bytes, _user_data) -> None:
        # llama.cpp warns once per fallback tensor (about 180 lines for a small model): apply() sums them up
        if level == GGML_LOG_LEVEL_ERROR:
            sys.stderr.write(text.decode("utf-8", "replace"))

    llama_cpp.llama_log_set(errors_only, ctypes.c_void_p(0))
    desc = _Desc(shape["architecture"].encode(), *(int(shape[k]) for k, _ in _Desc._fields_[1:]))
    model = fn["from_metadata"](ctypes.byref(desc))
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    overrides = type_overrides([(name, gtype) for name, _dims, gtype in tensors if gtype not in FLOAT_GGML_TYPES])
    if overrides is not None:
        params.tt_overrides = overrides
    state = fn["init"](model, ctypes.byref(params))
    ctx = base.ggml_init(_GgmlInit(len(tensors) * base.ggml_tensor_overhead() + 4096, None, True))
    try:
        handles = []
        for name, dims, gtype in tensors:
            ne = list(reversed(dims)) or [1]  # ggml counts dimensions from the innermost
            handle = base.ggml_new_tensor(ctx, int(gtype), len(ne), (ctypes.c_int64 * len(ne))(*ne))
            base.ggml_set_name(handle, name.encode())
            handles.append(handle)
        chosen = (ctypes.c_int * len(handles))()
        fn["compute_types"](state, ftype, (ctypes.c_void_p * len(handles))(*handles), chosen, len(handles))
        return [int(t) if fn["allows"](state, h) else None for h, t in zip(handles, chosen)]
    finally:
        base.ggml_free(ctx)
        fn["free"](state)
        llama.llama_model_free(model)


def type_overrides(kept: list[tuple[str, int]]):
    """llama.cpp's per-tensor type overrides (`llama-quantize --tensor-type`) that keep each (name, ggml type)
    tensor the lossless GGUF already holds quantized in its type (gpt-oss's MXFP4 experts, which llama.cpp keeps
    MXFP4): without them libllama's quantizer refuses the file ("requantizing from type mxfp4 is disabled").
    The NULL-terminated array for `tt_overrides` (it holds its pattern strings), or None when nothing is kept.
    The streamed k-quant and libllama's quantizer of the intermediate (quantize.py) pass the same ones."""
    import re

    import llama_cpp

    if not kept:
        return None
    overrides = (llama_cpp.llama_model_tensor_override * (len(kept) + 1))()
    for i, (name, gtype) in enumerate(kept):
        overrides[i].pattern = f"^{re.escape(name)}$".encode()
        overrides[i].type = int(gtype)
    overrides[len(kept)].pattern = None
    return overrides


def apply(outputs: list, arch: str, key_values: dict[str, tuple[Any, type]], ftype_name: str, ftype: int,
          model: str) -> dict:
    """Give each planned output (convert.Output, in its lossless type) the type libllama would quantize it to
    for llama_ftype `ftype` (named `ftype_name`); returns the quantizer's summary as quantize.quantize reports
    it: {"tensors", "fallbacks"}."""
    import sys

    import gguf

    name = ftype_name.upper()
    chosen = assign_types(model_shape(arch, key_values), [(o.name, o.shape, int(o.qtype)) for o in outputs],
                          ftype, step=f"{name} type choice for {model}")
    quantized = []
    for out, t in zip(outputs, chosen):
        if t is not None and t != int(out.qtype):
            out.lossless, out.qtype = out.qtype, gguf.GGMLQuantizationType(t)
            quantized.append(out)
    needs = [o for o in quantized if o.qtype.name not in NUMPY_TYPES and _needs_imatrix(int(o.qtype))]
    if needs:  # ggml would abort the process on these without one
        from ...core.errors import HiveError

        raise HiveError(f"{model}: llama.cpp gives {needs[0].name} type {needs[0].qtype.name} in {name}, which needs an "
                        "importance matrix: set the recipe option imatrix: calibration")
    prepare(o.qtype for o in quantized)
    summary = fallbacks([(o.shape, int(o.qtype)) for o in quantized], name)
    if summary:
        kinds = ", ".join(f"{f['from']}->{f['to']} x{f['tensors']}" for f in summary)
        print(f"llama.cpp {name}: {sum(f['tensors'] for f in summary)} of {len(quantized)} tensors fell back to "
              f"another type ({kinds}): their rows are not a multiple of the type's block size, which is expected",
              file=sys.stderr)
    return {"tensors": sum(t is not None for t in chosen), "fallbacks": summary}


def fallbacks(assigned: list[tuple[tuple[int, ...], int]], ftype_name: str) -> list[dict[str, Any]]:
    """What libllama's quantizer reports as fallbacks, from the types it chose: tensors whose rows are not whole
    256-blocks and that got another type than the file type's own (the one it wanted is not known here: a
    k-quant or, for the output matrix, Q6_K). `assigned`: (numpy shape, ggml type)."""
    import gguf

    default = _default_type(ftype_name)
    counts = Counter(gguf.GGMLQuantizationType(t).name for shape, t in assigned
                     if shape and shape[-1] % SUPERBLOCK and (t != int(default) or shape[-1] % gguf.GGML_QUANT_SIZES[default][0]))
    return [{"from": "a 256-block type", "to": to, "tensors": n} for to, n in sorted(counts.items())]


def _default_type(ftype_name: str):
    import gguf

    head = ftype_name.upper().split("_")
    for n in range(len(head), 0, -1):  # Q4_K_M -> Q4_K, IQ4_XS -> IQ4_XS, Q8_0 -> Q8_0
        name = "_".join(head[:n])
        if name in gguf.GGMLQuantizationType.__members__:
            return gguf.GGMLQuantizationType[name]
    return gguf.GGMLQuantizationType.Q8_0


# --- the rows (in the converter) ---------------------------------------------------------------------------------

@lru_cache(maxsize=1)
def _ggml_base() -> ctypes.CDLL:
    base = ctypes.CDLL(str(_lib_dir() / "libggml-base.so"))
    base.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    base.ggml_quantize_chunk.restype = ctypes.c_size_t
    base.ggml_quantize_init.argtypes, base.ggml_quantize_init.restype = [ctypes.c_int], None
    return base


def _needs_imatrix(gtype: int) -> bool:
    base = _ggml_base()
    base.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    base.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    return bool(base.ggml_quantize_requires_imatrix(gtype))


@cache
def _initialized(gtype: int) -> ctypes.CDLL:
    base = _ggml_base()
    base.ggml_quantize_init(gtype)  # tables some types need, built once (not thread-safe: done before threads use it)
    return base


def prepare(types) -> None:
    """Build ggml's tables for these types before encoder threads quantize with them."""
    for t in set(types):
        if t.name not in NUMPY_TYPES:
            _initialized(int(t))


def quantize_rows(rows: np.ndarray, gtype) -> np.ndarray:
    """A slice of whole rows (float32, last axis = a row) in ggml type `gtype`, as ggml_quantize_chunk writes it
    (ctypes releases the GIL for the call, so encoder threads run in parallel)."""
    import gguf
    import numpy as np

    data = np.ascontiguousarray(rows, dtype=np.float32)
    n_per_row = data.shape[-1]
    nrows = data.size // n_per_row if n_per_row else 0
    block, type_bytes = gguf.GGML_QUANT_SIZES[gtype]
    if n_per_row % block:
        raise ValueError(f"rows of {n_per_row} are not whole {gtype.name} blocks of {block}")
    out = np.empty((*data.shape[:-1], n_per_row // block * type_bytes), dtype=np.uint8)
    written = _initialized(int(gtype)).ggml_quantize_chunk(int(gtype), data.ctypes.data, out.ctypes.data, 0, nrows,
                                                           n_per_row, None)
    if written != out.nbytes:
        raise RuntimeError(f"ggml wrote {written} bytes of {gtype.name}, expected {out.nbytes}")
    return out


def round_to(data: np.ndarray, lossless) -> np.ndarray:
    """float32 values as the lossless intermediate holds them (what libllama would read back)."""
    import gguf
    import numpy as np

    if lossless.name == "F16":
        return data.astype(np.float16).astype(np.float32)
    if lossless.name == "BF16":
        bits = gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), lossless).view(np.uint16)
        return (bits.astype(np.uint32) << 16).view(np.float32).reshape(data.shape)
    return data
