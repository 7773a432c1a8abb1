"""What a vLLM serving container may run for a prepared directory (serve_policy.py checks manifests against it).

Kept apart from serving.py, which imports the compatibility database: pull and serve stay light.
"""

from __future__ import annotations

from .. import MODEL_DIR, ServerProgram

# Every flag _vllm can write, and nothing else: a store cannot add --chat-template, --worker-extension-cls or
# anything else vLLM would load code or files from.
VLLM_SERVER = ServerProgram(
    name="vllm", positionals=("serve", MODEL_DIR),
    options={f"--{flag}": kind for flag, kind in {
        "served-model-name": "value", "dtype": "value", "max-model-len": "value", "max-num-seqs": "value",
        "tensor-parallel-size": "value", "gpu-memory-utilization": "value", "kv-cache-dtype": "value",
        "quantization": "value", "model-impl": "value", "trust-remote-code": "switch",
        "disable-sliding-window": "switch", "generation-config": "value"}.items()},
    remote_code=frozenset({"--trust-remote-code"}),
    env={"HF_HUB_OFFLINE": "value"})
