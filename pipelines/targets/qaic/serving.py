"""How vllm-qaic serves a compiled QPC: the serving arguments are the compile's, never a guess.

vLLM on AI 100 loads a prebuilt QPC from `VLLM_QAIC_QPC_PATH` and checks nothing up front: ctx_len must
equal --max-model-len, the decode batch (full_batch_size) --max-num-seqs, the prefill length the
sequence length the server captures, the device count its device group (reference/ai100-qpc.md).
A target LM (num_speculative_tokens K) is served with vLLM's n-gram speculation of K tokens, and in that mode
vllm-qaic reads the prebuilt QPC from `VLLM_QAIC_SPEC_TARGET_QPC_PATH`, never `VLLM_QAIC_QPC_PATH`.
"""

from __future__ import annotations

import json
from typing import Any

from .. import MODEL_DIR
from .compile import QPC_DIR, CompileOptions
from .vision.compile import VISION_QPC_DIR


def engine_args(opts: CompileOptions, model_id: str, trust_remote_code: bool,
                disable_sliding_window: bool = False, vision: bool = False) -> dict[str, Any]:
    """`disable_sliding_window`: the export computes full attention where the config declares a window (Gemma 2,
    families.window_served_full), as the seed's serving notes ask of the Gemma family under vLLM."""
    args: dict[str, Any] = {
        "served_model_name": model_id,
        "task": "embedding" if opts.task == "embedding" else None,
        "max_model_len": opts.ctx_len,
        "max_num_seqs": opts.decode_batch,
        # the prefill specialization's seq_len (an encoder's one specialization is max_model_len long)
        "max_seq_len_to_capture": opts.prefill_seq_len if opts.retained_state else None,
        "device_group": ",".join(str(d) for d in range(opts.num_devices)),
        "quantization": "mxfp6" if opts.mxfp6 else None,
        "kv_cache_dtype": "mxint8" if opts.mxint8 else None,
        "trust_remote_code": trust_remote_code,
        "speculative_config": speculative_config(opts.num_speculative_tokens) if opts.num_speculative_tokens else None,
        "disable_sliding_window": disable_sliding_window,
    }
    if opts.task == "transcribe":  # Whisper (whisper.py): no capture length, its own encoder-decoder arguments
        from .whisper import serving_args

        args["max_seq_len_to_capture"] = None
        args.update(serving_args())
    if vision:  # one image per prompt: the vision QPC's one Vision specialization
        args["limit_mm_per_prompt"] = json.dumps({"image": 1})
    return {k: v for k, v in args.items() if v is not None and v is not False}


def speculative_config(k: int) -> str:
    """--speculative-config of the seed's quick start: n-gram drafts (no draft model) verified by the target QPC."""
    return json.dumps({"method": "ngram", "num_speculative_tokens": k}, separators=(",", ":"))


def qpc_path(dual: bool) -> str:
    """The prebuilt QPC(s) in the pulled model directory: a VLM's dual QPC as `<vision_qpc>:<language_qpc>`,
    the form vllm-qaic's loader splits (reference/ai100-qpc.md; unconfirmed on a device); one QPC otherwise."""
    language = f"{MODEL_DIR}/{QPC_DIR}"
    return f"{MODEL_DIR}/{VISION_QPC_DIR}:{language}" if dual else language


def qpc_env(opts: CompileOptions) -> str:
    """The variable vllm-qaic reads the prebuilt QPC from: the target's in speculative mode."""
    return "VLLM_QAIC_SPEC_TARGET_QPC_PATH" if opts.num_speculative_tokens else "VLLM_QAIC_QPC_PATH"


def describe(opts: CompileOptions, profile: dict[str, Any], model_id: str, trust_remote_code: bool,
             sdk: dict[str, str], disable_sliding_window: bool = False, vision: bool = False,
             dual: bool = False) -> dict[str, Any]:
    """The vllm-qaic description recorded in a QPC's manifest (pull prints image, env and command); `dual`: a
    VLM's two QPCs (its single-QPC form has one, and runs one sequence: max_num_seqs is the batch of 1)."""
    args = engine_args(opts, model_id, trust_remote_code, disable_sliding_window, vision)
    argv = ["vllm", "serve", MODEL_DIR]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return {
        "engine": "vllm-qaic", "image": profile.get("image"),
        "engine_args": args,
        "env": {"HF_HUB_OFFLINE": "1", **((profile.get("serving") or {}).get("env") or {}),
                qpc_env(opts): qpc_path(dual)},
        "command": argv,
        "compiled_for": {"task": opts.task, "ctx_len": opts.ctx_len, "prefill_seq_len": opts.prefill_seq_len,
                         "batch_size": opts.batch_size, "full_batch_size": opts.full_batch_size,
                         "num_devices": opts.num_devices, "num_cores": opts.num_cores,
                         "weights": opts.precision, "kv_cache": opts.kv_precision, **sdk,
                         **({"num_speculative_tokens": opts.num_speculative_tokens} if opts.num_speculative_tokens else {}),
                         **({"hw_version": opts.hw_version} if opts.hw_version != "ai100" else {})},
    }
