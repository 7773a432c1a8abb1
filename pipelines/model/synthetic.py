"""Synthetic Llama-family models: real shapes, random weights, written one chunk at a time.

For memory and scale tests of the pipeline (an 8B model on a 24 GB host) without downloading one. A
model directory as the Hub ships it: `config.json` (LlamaForCausalLM), `generation_config.json`,
sharded safetensors with `model.safetensors.index.json` (one `model.safetensors` when it fits one
shard), and a real tokenizer: a SentencePiece BPE (byte fallback, Llama-2 settings) trained here on
generated text to exactly the config's vocab size (or fewer pieces, `tokenizer_vocab`: the embedding
rows beyond it are legal and unused; the GGUF converter pads them with UNUSED tokens), with the
`tokenizer.json` layout Llama-2 repos ship (loaded as-is by `PreTrainedTokenizerFast`).

Why SentencePiece and not a byte-level BPE like Llama 3's: the GGUF converter identifies a BPE
pre-tokenizer by hashing the ids of a check text (as llama.cpp does) and refuses an unknown one unless
the recipe names a fallback; every freshly trained BPE vocabulary is unknown. A SentencePiece
vocabulary needs no such identification, so the shipped recipes build it unchanged.

Weights: normal(0, 0.02) for every linear and embedding matrix, 1.0 for the RMSNorm weights; bf16
(round to nearest even from float32, as torch does) or f32. Deterministic: each chunk of CHUNK
elements of a tensor comes from its own generator seeded by (seed, crc32(tensor name), chunk index),
so values do not depend on the shard size, the thread count or the order of writing. Memory stays a
few chunks (MBs) whatever the model size: the process never holds a tensor, let alone the model (the
tokenizer trainer peaks higher: about 340 MB of RSS for 128,256 pieces, 10 s).

    python -m pipelines.model.synthetic --preset llama3-8b --out DIR [--dtype bf16] [--seed 0] [--max-shard-size 4GiB]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import tempfile
import time
import zlib
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from math import prod
from pathlib import Path
from typing import Any

import numpy as np

from ..core.errors import ConfigError
from ..core.units import parse_size

# the tokenizer of every synthetic model (re-exported: tests build their small models' tokenizers with it)
from .spm_tokenizer import spm_merges, spm_vocab, train_spm, write_spm_tokenizer, write_tokenizer  # noqa: F401

GENERATOR_VERSION = 1  # bump when the bytes written for the same arguments change
CHUNK = 1 << 20  # elements per generated chunk (4 MiB of float32): cache-friendly, cheap per call
INIT_STD = 0.02
GiB = 1 << 30
DTYPES = {"bf16": ("BF16", "bfloat16", 2), "f32": ("F32", "float32", 4)}  # safetensors, torch_dtype, bytes


@dataclass(frozen=True)
class LlamaShape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rope_theta: float = 500000.0
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    rms_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "vocab_size", "max_position_embeddings"):
            if not isinstance(getattr(self, k), int) or getattr(self, k) <= 0:
                raise ValueError(f"{k} must be a positive integer, not {getattr(self, k)!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of {self.num_attention_heads} heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.num_key_value_heads} KV heads do not divide {self.num_attention_heads} heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def tensors(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, shape, init) in the order transformers' LlamaForCausalLM lists its state dict;
        init is "normal" (std INIT_STD) or "ones"."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        out = [("model.embed_tokens.weight", (self.vocab_size, h), "normal")]
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            out += [
                (p + "self_attn.q_proj.weight", (h, h), "normal"),
                (p + "self_attn.k_proj.weight", (kv, h), "normal"),
                (p + "self_attn.v_proj.weight", (kv, h), "normal"),
                (p + "self_attn.o_proj.weight", (h, h), "normal"),
                (p + "mlp.gate_proj.weight", (self.intermediate_size, h), "normal"),
                (p + "mlp.up_proj.weight", (self.intermediate_size, h), "normal"),
                (p + "mlp.down_proj.weight", (h, self.intermediate_size), "normal"),
                (p + "input_layernorm.weight", (h,), "ones"),
                (p + "post_attention_layernorm.weight", (h,), "ones"),
            ]
        out.append(("model.norm.weight", (h,), "ones"))
        if not self.tie_word_embeddings:
            out.append(("lm_head.weight", (self.vocab_size, h), "normal"))
        return out

    @property
    def parameters(self) -> int:
        return sum(prod(s) for _, s, _ in self.tensors())

    def config(self, dtype: str = "bf16") -> dict[str, Any]:
        """config.json as a Llama-3 repo on the Hub writes it (transformers 4 spelling, which 5 reads)."""
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
            "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "head_dim": self.head_dim,
            "hidden_act": "silu", "hidden_size": self.hidden_size, "initializer_range": INIT_STD,
            "intermediate_size": self.intermediate_size, "max_position_embeddings": self.max_position_embeddings,
            "mlp_bias": False, "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers, "num_key_value_heads": self.num_key_value_heads,
            "pretraining_tp": 1, "rms_norm_eps": self.rms_norm_eps, "rope_scaling": None,
            "rope_theta": float(self.rope_theta), "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": DTYPES[dtype][1], "use_cache": True, "vocab_size": self.vocab_size,
        }


PRESETS: dict[str, tuple[LlamaShape, str]] = {
    # Meta-Llama-3-8B's config: 8,030,261,248 parameters, 16.06 GB in bf16.
    "llama3-8b": (LlamaShape(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                             num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                             max_position_embeddings=8192), "Llama-3-8B's shapes"),
    # Llama-3.2-1B's config (tied embeddings): 1,235,814,400 parameters, 2.47 GB in bf16.
    "llama3-1b": (LlamaShape(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                             num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                             max_position_embeddings=8192, tie_word_embeddings=True), "Llama-3.2-1B's shapes"),
    # The ~1B model of the scale measurements (reference/scale.md): 955,596,800 parameters, 1.91 GB in bf16
    # (3.82 GB in fp32), untied lm_head; head_dim 128, GQA 16/8.
    "llama-1b": (LlamaShape(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                            num_key_value_heads=8, vocab_size=49152, rope_theta=500000.0,
                            max_position_embeddings=8192), "the ~1B model of the scale measurements"),
    # Llama-3-70B's config (for plans: `--sparse` writes its headers only): 70,553,706,496 parameters.
    "llama3-70b": (LlamaShape(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                              num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                              max_position_embeddings=8192), "Llama-3-70B's shapes"),
    # Llama-3-style layers (head_dim 128, GQA 12/4, SwiGLU 4096) at 1536 wide, 16 deep, Llama-2's vocab:
    # 501,007,872 parameters, 1.00 GB in bf16 (2.00 GB in fp32); the embeddings are 20% of it (13% in the 8B).
    "llama-1g": (LlamaShape(hidden_size=1536, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=12,
                            num_key_value_heads=4, vocab_size=32000, rope_theta=500000.0,
                            max_position_embeddings=8192), "about 1 GB in bf16"),
    # For tests: 1,705,216 parameters (3.4 MB in bf16); rows are multiples of 256 so k-quants apply.
    "tiny": (LlamaShape(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=1024, rope_theta=10000.0, max_position_embeddings=2048),
             "for tests"),
}


def preset(name: str, **overrides: Any) -> LlamaShape:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    return replace(PRESETS[name][0], **overrides) if overrides else PRESETS[name][0]


# --- weights -------------------------------------------------------------------------------------

def _chunk_seed(seed: int, name: str, index: int) -> np.random.SeedSequence:
    return np.random.SeedSequence([seed, zlib.crc32(name.encode()), index])


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest even (torch's rounding; no NaN here). Consumes x."""
    u = x.view(np.uint32)
    r = u >> 16
    r &= 1
    r += 0x7FFF
    u += r
    u >>= 16
    return u.astype(np.uint16)


def chunk_array(seed: int, name: str, index: int, n: int, init: str, dtype: str) -> np.ndarray:
    """Elements [index * CHUNK, index * CHUNK + n) of tensor `name` as stored: uint16 bf16 bit patterns or
    float32 (little-endian, as safetensors stores them)."""
    if init == "ones":
        x = np.ones(n, dtype=np.float32)
    else:
        x = np.random.default_rng(_chunk_seed(seed, name, index)).standard_normal(n, dtype=np.float32)
        x *= np.float32(INIT_STD)
    return _bf16_bits(x) if dtype == "bf16" else x


def tensor_values(name: str, shape: tuple[int, ...], init: str, *, seed: int = 0, dtype: str = "bf16") -> np.ndarray:
    """The stored values of one tensor as float32 (exact for bf16), for tests: the same chunks the
    generator writes."""
    numel = prod(shape)
    flat = np.concatenate([chunk_array(seed, name, i, min(CHUNK, numel - i * CHUNK), init, dtype)
                           for i in range(-(-numel // CHUNK))])
    if dtype == "bf16":
        flat = (flat.astype(np.uint32) << 16).view(np.float32)
    return flat.reshape(shape)


@dataclass
class Shard:
    file: str
    tensors: list[tuple[str, tuple[int, ...], str]]
    header: bytes
    data_bytes: int

    @property
    def size(self) -> int:
        return 8 + len(self.header) + self.data_bytes


def plan_shards(shape: LlamaShape, dtype: str, max_shard_size: int) -> list[Shard]:
    """Tensors in order, a new shard whenever the next one would pass max_shard_size (a tensor larger than
    the limit gets a shard of its own, as transformers does)."""
    st_dtype, _, width = DTYPES[dtype]
    groups: list[list[tuple[str, tuple[int, ...], str]]] = [[]]
    size = 0
    for t in shape.tensors():
        nbytes = prod(t[1]) * width
        if groups[-1] and size + nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += nbytes
    shards = []
    for i, group in enumerate(groups):
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, dims, _ in group:
            nbytes = prod(dims) * width
            header[name] = {"dtype": st_dtype, "shape": list(dims), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data section 8-byte aligned
        file = "model.safetensors" if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        shards.append(Shard(file, group, raw, offset))
    return shards


def _chunks(tensors) -> Iterator[tuple[str, int, int, str]]:
    for name, dims, init in tensors:
        numel = prod(dims)
        for i in range(-(-numel // CHUNK)):
            yield name, i, min(CHUNK, numel - i * CHUNK), init


def _write(f, data: np.ndarray, progress) -> None:
    f.write(data.data)  # the array's buffer, no copy
    if progress is not None:
        progress.update(data.nbytes)


def write_weights(dest: Path, shards: list[Shard], seed: int, dtype: str, threads: int, progress=None) -> None:
    """Each shard streamed to disk: generator threads run at most a small window ahead of the writer, so
    memory is a few chunks. numpy's normal sampler holds the GIL, its ufuncs (scaling, bf16 rounding) and
    the file writes do not: a second thread overlaps those, about 1.3x on 2 cores."""
    window = 2 * threads + 2
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for shard in shards:
            with open(dest / shard.file, "wb") as f:
                f.write(struct.pack("<Q", len(shard.header)) + shard.header)
                pending: deque = deque()
                for name, index, n, init in _chunks(shard.tensors):
                    pending.append(pool.submit(chunk_array, seed, name, index, n, init, dtype))
                    if len(pending) >= window:
                        _write(f, pending.popleft().result(), progress)
                while pending:
                    _write(f, pending.popleft().result(), progress)
            if os.path.getsize(dest / shard.file) != shard.size:
                raise RuntimeError(f"{shard.file}: wrote {os.path.getsize(dest / shard.file)} bytes, expected {shard.size}")


# --- the model directory ----------------------------------------------------------------------------

@dataclass
class Generated:
    path: str
    parameters: int
    weight_bytes: int
    shards: int
    tokenizer_vocab: int
    dtype: str
    seed: int
    seconds: float

    def summary(self) -> str:
        return (f"{self.path}: {self.parameters:,} parameters, {self.weight_bytes / 1e9:.2f} GB of {self.dtype} in "
                f"{self.shards} shard(s), tokenizer {self.tokenizer_vocab} pieces, {self.seconds:.1f} s "
                f"({self.weight_bytes / max(self.seconds, 1e-9) / 1e6:.0f} MB/s)")


def generate(out: Path, shape: LlamaShape, *, dtype: str = "bf16", seed: int = 0, max_shard_size: int | str = 4 * GiB,
             tokenizer_vocab: int | None = None, threads: int | None = None, progress: bool = False,
             name: str = "synthetic", sparse: bool = False) -> Generated:
    """Write the model directory `out` (which must not exist or be empty), atomically: everything goes to a
    temporary sibling first, renamed into place when complete; a failure leaves nothing behind.

    `sparse`: real headers, the data sections left as holes (zeros, no disk used): a model of any size for
    what reads headers only (`hive-aot plan`, `check`); nothing can be built from it."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if sys.byteorder != "little":
        raise OSError("safetensors are little-endian; this generator writes native numpy buffers")
    out = Path(out).resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory")
    tok_vocab = tokenizer_vocab or shape.vocab_size
    if tok_vocab > shape.vocab_size:
        raise ValueError(f"tokenizer_vocab {tok_vocab} exceeds the embedding's {shape.vocab_size} rows")
    shards = plan_shards(shape, dtype, parse_size(max_shard_size, "max_shard_size"))
    total = sum(s.size for s in shards)
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if not sparse and total + (64 << 20) > free:
        raise OSError(f"{out.parent}: {total / 1e9:.2f} GB needed for the weights, {free / 1e9:.2f} GB free")
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        n_tok = write_tokenizer(tmp, tok_vocab, seed)
        (tmp / "config.json").write_text(json.dumps(shape.config(dtype), indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(
            {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2}, indent=2) + "\n")
        params = shape.parameters
        (tmp / "README.md").write_text(
            f"---\nlicense: apache-2.0\n---\nSynthetic Llama ({name}): "
            + ("headers only, the data sections are holes (zeros); " if sparse else
               f"random weights (normal 0, {INIT_STD}; norms 1.0), seed {seed}, ")
            + f"{params:,} parameters in {dtype}. Generated by `python -m {__spec__.name}`; "
            "for pipeline tests and benchmarks only, it knows no language.\n")
        (tmp / "synthetic.json").write_text(json.dumps({
            "generator": __spec__.name, "version": GENERATOR_VERSION, "name": name, "seed": seed, "dtype": dtype,
            "init_std": INIT_STD, "chunk": CHUNK, "parameters": params, "tokenizer_vocab": n_tok, "shape": asdict(shape),
            **({"sparse": True} if sparse else {}),
        }, indent=2) + "\n")
        if len(shards) > 1:
            weight_map = {t[0]: s.file for s in shards for t in s.tensors}
            (tmp / "model.safetensors.index.json").write_text(json.dumps({
                "metadata": {"total_size": sum(s.data_bytes for s in shards), "total_parameters": params},
                "weight_map": dict(sorted(weight_map.items())),
            }, indent=2) + "\n")
        bar = None
        if sparse:
            for shard in shards:
                with open(tmp / shard.file, "wb") as f:
                    f.write(struct.pack("<Q", len(shard.header)) + shard.header)
                    f.truncate(shard.size)
        elif progress:
            from ..core.progress import bar as progress_bar  # drawn on a terminal only, as every bar of hive-aot

            bar = progress_bar(sum(s.data_bytes for s in shards), f"weights {dtype}")
        try:
            if not sparse:
                write_weights(tmp, shards, seed, dtype, threads or max(1, min(4, os.cpu_count() or 1)), bar)
        finally:
            if bar is not None:
                bar.close()
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        os.chmod(tmp, 0o755)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Generated(path=str(out), parameters=params, weight_bytes=sum(s.data_bytes for s in shards), shards=len(shards),
                     tokenizer_vocab=n_tok, dtype=dtype, seed=seed, seconds=time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", required=True, choices=sorted(PRESETS))
    ap.add_argument("--out", required=True, type=Path, help="model directory to create (must not exist or be empty)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-shard-size", default="4GiB", help="e.g. 4GiB (default), 500MB")
    ap.add_argument("--layers", type=int, help="override num_hidden_layers")
    ap.add_argument("--vocab", type=int, help="override vocab_size")
    ap.add_argument("--tokenizer-vocab", type=int, help="train the tokenizer to fewer pieces than vocab_size")
    ap.add_argument("--tie-word-embeddings", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--sparse", action="store_true",
                    help="headers only, data sections left as holes: for plan and check at any size")
    args = ap.parse_args(argv)
    overrides = {k: v for k, v in (("num_hidden_layers", args.layers), ("vocab_size", args.vocab),
                                   ("tie_word_embeddings", args.tie_word_embeddings)) if v is not None}
    try:
        shape = preset(args.preset, **overrides)
        print(f"{args.preset} ({PRESETS[args.preset][1]}): {shape.parameters:,} parameters, "
              f"{shape.parameters * DTYPES[args.dtype][2] / 1e9:.2f} GB in {args.dtype}", file=sys.stderr)
        res = generate(args.out, shape, dtype=args.dtype, seed=args.seed, max_shard_size=args.max_shard_size,
                       tokenizer_vocab=args.tokenizer_vocab, threads=args.threads, progress=True, name=args.preset,
                       sparse=args.sparse)
    except (ValueError, OSError, ConfigError) as e:
        print(f"synthetic: error: {e}", file=sys.stderr)
        return 1
    print(res.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
