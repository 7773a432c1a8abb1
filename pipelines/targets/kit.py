"""What a kind may use, in one place: a plug-in (or a new built-in kind) imports `pipelines.targets` for the
interface it implements and this module for the parts of hive-aot it builds with, nothing deeper, so that the
package can move its modules without breaking a kind.

Imported by kinds only, never by `pipelines.targets` itself: the pull client reads the interface without the
engine's modules (numpy, the reference) this one brings.
"""

from __future__ import annotations

from ..config.thresholds import Thresholds, check_thresholds, gate, metric_text
from ..core.errors import HiveError, ModelFormatError, NotApplicableError
from ..core.hashing import sha256_file, sha256_json
from ..core.progress import bar
from ..model.memory import BASE_PYTHON, BASE_STEP, BASE_TORCH, GIB, MIB, PlanEnv, StepNeed, human_bytes
from ..process.isolation import run_isolated
from ..source.safetensors_io import TensorSource
from ..source.snapshot import CARRIED_FILES
from ..validation import parity, prompts, reference

__all__ = [
    # gates: a kind's threshold schema and the check of measured metrics against it
    "Thresholds", "check_thresholds", "gate", "metric_text",
    # one-line errors
    "HiveError", "ModelFormatError", "NotApplicableError",
    # the memory plan's vocabulary
    "BASE_PYTHON", "BASE_STEP", "BASE_TORCH", "GIB", "MIB", "PlanEnv", "StepNeed", "human_bytes",
    # the source: tensors read one at a time, the files carried unchanged into an artifact
    "TensorSource", "CARRIED_FILES",
    # the fp32 reference, the fixed texts and the parity metrics every artifact is checked with
    "reference", "prompts", "parity",
    # engines in a child process, progress bars, digests
    "run_isolated", "bar", "sha256_file", "sha256_json",
]
