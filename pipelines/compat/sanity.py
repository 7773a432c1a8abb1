"""Whether a config.json is a model at all: sizes, float settings and field shapes an engine would take on
trust (llama.cpp aborts on a negative epsilon; a non-finite rope base makes every rotation NaN)."""

from __future__ import annotations

import math
from typing import Any

# Bounds beyond which a config is not a model we should try to read (guards against absurd allocations).
PLAUSIBLE = {
    "hidden_size": 131072, "num_hidden_layers": 2048, "num_attention_heads": 4096, "num_key_value_heads": 4096,
    "intermediate_size": 1048576, "vocab_size": 8_388_608, "max_position_embeddings": 1 << 27, "head_dim": 4096,
}
# Float settings engines take on trust: llama.cpp aborts the process on GGML_ASSERT(eps >= 0.0f) (exit 134), and
# a non-positive or non-finite rope base turns every rotation into NaN. Range-checked before any engine sees them.
EPS_KEYS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon", "norm_eps")
ROPE_KEYS = ("rope_scaling", "rope_parameters")  # transformers 4 and 5 spellings; objects when present


def text_cfg(cfg: dict[str, Any]) -> dict[str, Any]:
    tc = cfg.get("text_config")
    return tc if isinstance(tc, dict) else cfg


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _shown(v: Any) -> str:
    r = repr(v)  # a 4000-digit size from a hostile config.json is named, not printed
    return r if len(r) <= 40 else f"{r[:16]}... ({len(r)} characters)"


def config_problems(cfg: dict[str, Any]) -> list[str]:
    """What makes a (text) config unreadable or dangerous for an engine: sizes, float ranges, shapes of fields."""
    problems = []
    tc = text_cfg(cfg)
    for key, bound in PLAUSIBLE.items():
        if key not in tc or tc[key] is None:
            continue
        v = tc[key]
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0 or v > bound:
            problems.append(f"{key}={_shown(v)} is not plausible")
    for key in EPS_KEYS:
        v = tc.get(key)
        if v is not None and not (_number(v) and 0 < v < 1):
            problems.append(f"{key}={_shown(v)} is not plausible (must be a number in (0, 1))")
    rope = {}
    for key in ROPE_KEYS:
        v = tc.get(key)
        if v is not None and not isinstance(v, dict):
            problems.append(f"{key}={_shown(v)} is not plausible (must be an object)")
        elif v:
            rope.update(v)
    for key, v in (("rope_theta", tc.get("rope_theta")), ("rope_theta", rope.get("rope_theta")),
                   ("rope scaling factor", rope.get("factor"))):
        if v is not None and not (_number(v) and math.isfinite(v) and v > 0):
            problems.append(f"{key}={_shown(v)} is not plausible (must be a finite number > 0)")
    sw = tc.get("sliding_window")
    if sw is not None and (not isinstance(sw, int) or isinstance(sw, bool) or not 0 < sw <= PLAUSIBLE["max_position_embeddings"]):
        problems.append(f"sliding_window={_shown(sw)} is not plausible (must be a positive integer or null)")
    if problems:
        return problems
    h, n, kv = tc.get("hidden_size"), tc.get("num_attention_heads"), tc.get("num_key_value_heads")
    if isinstance(h, int) and isinstance(n, int) and "head_dim" not in tc and h % n:
        problems.append(f"hidden_size={h} is not divisible by num_attention_heads={n}")
    if isinstance(n, int) and isinstance(kv, int) and n % kv:  # grouped-query attention shares K/V across n/kv heads
        problems.append(f"num_attention_heads={n} is not divisible by num_key_value_heads={kv}")
    return problems
