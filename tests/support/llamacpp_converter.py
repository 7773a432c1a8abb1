"""llama.cpp's own `convert_hf_to_gguf.py`, the yardstick for every GGUF family: the same checkpoint converted by
it and by hive-aot must give the same tensors, byte for byte (names, types, shapes, data).

The converter is not part of this repository: `make setup` runs `python tests/support/llamacpp_converter.py` once, which
downloads the llama-cpp-python sdist the project pins (from the package registry) into
`~/.cache/hive-aot/compare/` and extracts only the converter, its `conversion/` modules and its `gguf-py`
(`bench/compare_llamacpp.py` uses the same tree). It runs in a child process with the project venv's
interpreter (torch and transformers are there), its own gguf-py first on the path as the script arranges.

The family tests' tokenizer is SmolLM2's cut to 2,048 tokens, whose check hash llama.cpp's converter does not
know: the child names SmolLM2's pre-tokenizer ("smollm") where the converter would give up on an unknown one,
as hive-aot's conversions do with `bpe_pre_fallback`; for families whose converter wants a tokenizer of their
own (a SentencePiece model, GLM's chat tokens), `tensors_only` skips its vocabulary step. Nothing else of the
converter is changed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

from pipelines.process import warm

LLAMA_CPP_VERSION = "0.3.36"  # the Makefile's LLAMA_CPP_VERSION: the library that runs the files
VENDOR = f"llama_cpp_python-{LLAMA_CPP_VERSION}/vendor/llama.cpp/"
VENDOR_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")

# llama.cpp's converter runs in a child: this script, forked by a warm server where the tests have one (torch and
# transformers imported once: a tiny model's conversion took 3-7 s in a fresh interpreter, under 1 s warm).
CHILD = Path(__file__).with_name("llamacpp_convert_child.py")


def cache_root() -> Path:
    return Path(os.environ.get("HIVE_AOT_CACHE") or Path.home() / ".cache" / "hive-aot")


def tree_path(cache: Path | None = None) -> Path:
    return (cache or cache_root()) / "compare" / f"llama.cpp-{LLAMA_CPP_VERSION}"


def ensure_tree(cache: Path | None = None, log=lambda msg: None) -> Path:
    """The extracted converter tree, downloading and extracting the sdist the first time."""
    tree = tree_path(cache)
    if (tree / ".complete").is_file():
        return tree
    comp = tree.parent
    comp.mkdir(parents=True, exist_ok=True)
    sdist = comp / f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz"
    if not sdist.is_file():
        log(f"downloading the llama-cpp-python {LLAMA_CPP_VERSION} sdist into {comp}")
        part = Path(tempfile.mkdtemp(prefix=".download-", dir=comp))
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", str(part)], check=True)
        (part / sdist.name).rename(sdist)  # whole or absent: a killed download leaves only its temporary folder
        shutil.rmtree(part)
    shutil.rmtree(tree, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=comp))
    with tarfile.open(sdist) as tf:
        members = [m for m in tf.getmembers()
                   if m.name.startswith(VENDOR) and m.name[len(VENDOR):].startswith(VENDOR_PARTS)]
        tf.extractall(tmp, members=members, filter="data")
    (tmp / VENDOR).rename(tree)
    shutil.rmtree(tmp)
    (tree / ".complete").touch()
    return tree


def architectures(tree: Path) -> set[str]:
    """The HF architecture names the converter registers (`@ModelBase.register("...", ...)` in conversion/)."""
    import re

    found: set[str] = set()
    for module in sorted((tree / "conversion").glob("*.py")):
        for args in re.findall(r"@ModelBase\.register\(([^)]*)\)", module.read_text()):
            found |= set(re.findall(r"[\"']([A-Za-z0-9_.]+)[\"']", args))
    return found


def convert(tree: Path, model_dir: Path, out: Path, outtype: str = "f16", *extra: str, tensors_only: bool = False) -> Path:
    """`convert_hf_to_gguf.py model_dir --outtype outtype --outfile out` in a child; its log on failure.
    `tensors_only`: the converter's vocabulary step is skipped (its tokenizer rules want each family's own
    tokenizer files, a SentencePiece model or chat tokens, which the test models' shared BPE lacks)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NO_LOCAL_GGUF", "HIVE_AOT_TENSORS_ONLY")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               **({"HIVE_AOT_TENSORS_ONLY": "1"} if tensors_only else {}))
    argv = [str(CHILD), str(tree), str(model_dir), "--outtype", outtype, "--outfile", str(out), *extra]
    with tempfile.TemporaryFile() as log:
        done = warm.run(sys.executable, str(CHILD), argv, cwd=tree, env=env, timeout=None, output=log.fileno())
        # -P: tests/ stays off the fresh interpreter's path, as it was off the warm server's
        rc = subprocess.run([sys.executable, "-P", *argv], stdout=log, stderr=log, env=env, cwd=tree).returncode \
            if done is None else done[0]
        if rc != 0:
            log.seek(0)
            said = log.read().decode(errors="replace")
            raise AssertionError(f"llama.cpp's converter failed on {model_dir.name}:\n{said[-4000:]}")
    return out


def tensor_differences(ours: Path, theirs: Path) -> list[str]:
    """Every way the two files' tensors differ (empty: the same names, types, shapes and bytes)."""
    from gguf_reader import FastGGUFReader

    a = {t.name: t for t in FastGGUFReader(str(ours)).tensors}
    b = {t.name: t for t in FastGGUFReader(str(theirs)).tensors}
    out = [f"only in hive-aot's: {n}" for n in sorted(set(a) - set(b))]
    out += [f"only in llama.cpp's: {n}" for n in sorted(set(b) - set(a))]
    for n in sorted(set(a) & set(b)):
        x, y = a[n], b[n]
        if x.tensor_type != y.tensor_type or list(x.shape) != list(y.shape):
            out.append(f"{n}: {x.tensor_type.name}{list(x.shape)} vs llama.cpp's {y.tensor_type.name}{list(y.shape)}")
        elif np.asarray(x.data).tobytes() != np.asarray(y.data).tobytes():
            out.append(f"{n}: {x.tensor_type.name}{list(x.shape)}, other bytes")
    return out


if __name__ == "__main__":  # `make setup`: fetch the tree once
    print(ensure_tree(log=lambda msg: print(f"== {msg}", flush=True)))
