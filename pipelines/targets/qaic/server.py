"""What a vllm-qaic serving container may run for a compiled QPC (serve_policy.py checks manifests against it).

Kept apart from serving.py so that pull and serve import nothing heavy.
"""

from __future__ import annotations

from .. import MODEL_DIR, ServerProgram

# vLLM on AI 100: the flags engine_args writes; the QPC's path points into the pulled directory.
QAIC_SERVER = ServerProgram(
    name="vllm", positionals=("serve", MODEL_DIR),
    options={f"--{flag}": kind for flag, kind in {
        "served-model-name": "value", "task": "value", "max-model-len": "value", "max-num-seqs": "value",
        "max-seq-len-to-capture": "value", "device-group": "value", "quantization": "value",
        "kv-cache-dtype": "value", "trust-remote-code": "switch", "disable-sliding-window": "switch",
        # a target LM's n-gram speculation (serving.speculative_config): these keys only, each a plain value
        "speculative-config": "json:method,num_speculative_tokens",
        # Whisper's encoder length (whisper.serving_args) and a multimodal prompt's one audio or image
        "max-num-batched-tokens": "value", "hf-overrides": "json:max_source_positions",
        "limit-mm-per-prompt": "json:audio,image", "no-enable-prefix-caching": "switch"}.items()},
    remote_code=frozenset({"--trust-remote-code"}),
    # a VLM's dual QPC is `<vision_qpc>:<language_qpc>` (serving.qpc_path)
    env={"HF_HUB_OFFLINE": "value", "VLLM_QAIC_QPC_PATH": "model-paths", "VLLM_QAIC_SPEC_TARGET_QPC_PATH": "model-path"})
