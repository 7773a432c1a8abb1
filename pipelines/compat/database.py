"""The architecture database (data). Minimal until the full generated snapshot lands.

Each record: family, task, the platform's default NVIDIA runtime profile, and whether the seed
marks it tested (with the benchmarked vllm-cu121 throughput where the seed gives one).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    name: str
    family: str
    task: str
    default_profile: str
    tested: bool = False
    throughput_tok_s: int | None = None
    notes: str = ""


# The seed's benchmarked rows (architecture-and-backend-compatibility.txt, "Benchmarked throughput").
_ROWS = [
    Architecture("GPT2LMHeadModel", "gpt2", "causal-lm", "vllm-cu121", True, 150),
    Architecture("MixtralForCausalLM", "mistral", "causal-lm", "vllm-cu121", True, 120),
    Architecture("PhiForCausalLM", "phi", "causal-lm", "vllm-cu121", True, 110),
    Architecture("Phi3ForCausalLM", "phi", "causal-lm", "vllm-cu121", True, 105,
                 "set trust_remote_code for Phi-3 family on AI 100"),
    Architecture("LlamaForCausalLM", "llama", "causal-lm", "vllm-cu121", True, 100),
    Architecture("MistralForCausalLM", "mistral", "causal-lm", "vllm-cu121", True, 95),
    Architecture("GemmaForCausalLM", "gemma", "causal-lm", "vllm-cu121", True, 90,
                 "pass disable_sliding_window under vLLM"),
    Architecture("Qwen2ForCausalLM", "qwen", "causal-lm", "vllm-cu121", True, 90),
    Architecture("QWenLMHeadModel", "qwen", "causal-lm", "vllm-cu121", True, 85),
    Architecture("GPTNeoXForCausalLM", "gpt-neox", "causal-lm", "vllm-cu121", True, 80),
]

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in _ROWS}

# Per vendor, the profile that serves causal LMs natively (the `--hardware` switch).
VENDOR_LLM_PROFILE = {
    "nvidia": "vllm-cu121",
    "amd": "vllm-rocm",
    "intel": "vllm-xpu",
    "cpu": "llm-llamacpp-cpu",
    "qaic": "vllm-qaic",
}


def lookup(name: str) -> Architecture | None:
    return ARCHITECTURES.get(name)
