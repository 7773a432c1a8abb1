"""The AI 100 compile contract as data: recipe options -> the files and the command `qaic-compile` needs,
the Apps SDK found on this host (or not), and the run itself (reference/ai100-qpc.md).

Everything here is plain Python (no torch, no onnx) so the compile host needs only the SDK and hive-aot.
- `CompileOptions`: the recipe's options (serving shape, precisions, SDK the bundle is prepared for);
- `specializations()`: `specializations.json` in the named (SDK >= 1.22) or legacy flat form; with
  `num_speculative_tokens` K the target LM's (QEfficient's TLM): Prefill keeps 1 logit, Decode runs K+1 tokens
  and keeps all their logits (the export's `num_logits_to_keep` axis);
- `custom_io()`: `custom_io.yaml`, the precision of every `past_*` input and its `_RetainedState` output
  (mxint8 KV cache is not a flag, it is this file);
- `partition()`: the tensor-slicing partition file listing devices 0..N-1 (multi-device);
- `command()`: the argv of `qaic-compile` (SDK >= 1.21) or `qaic-exec ... -compile-only` (older), with
  `{bundle}` / `{qpc}` placeholders so the same command is recorded in the bundle and run anywhere; each
  tuning option is emitted only when set, as QEfficient's `_compile` does (`-mos`, `-ols`,
  `-aic-enable-depth-first`, `-allow-mxint8-mdp-io`), and `-aic-hw-version` names the card generation;
- `find_sdk()`: `$HIVE_AOT_QAIC_SDK`, else /opt/qti-aic; its apps/platform versions from `versions/*.xml`;
- `run()`: the compiler in a child process, its stderr tail in the error when it fails.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ...core import settings
from ...core.errors import EngineFailed
from .layout import KEEP_INPUT

DEFAULT_SDK_ROOT = "/opt/qti-aic"
NAMED_SPECIALIZATIONS_FROM = (1, 22)  # SDKs before this reject the named form
QAIC_COMPILE_FROM = (1, 21)  # older SDKs compile with `qaic-exec ... -compile-only`
BUNDLE, QPC = "{bundle}", "{qpc}"  # placeholders in a recorded command: the bundle directory, the QPC output
COMPILE_DIR = "compile"  # the compile inputs inside a bundle and a QPC artifact
QPC_DIR = "qpc"  # the compiler's output directory (VLLM_QAIC_QPC_PATH)
MAX_SPECULATIVE_TOKENS = 16  # n-gram speculation proposes a few tokens; more is a typo, and a costlier decode graph
# Options added after bundles were first published: left out of `recorded()` while at their default, so the
# bundles (and QPC manifests) of recipes that do not use them keep their bytes.
ADDED_LATER = ("num_speculative_tokens", "hw_version", "allow_mxint8_mdp_io", "kv_offload")
NO_MDP_IO = ("allow_mxint8_mdp_io compresses the traffic between the devices tensor slicing splits the model over: "
             "it needs num_devices > 1")
NOT_A_TARGET_LM = ("speculative decoding (num_speculative_tokens) compiles a causal LM decoder as its target "
                   "(task: generate); embedding models have no decode step, and vision-language models cannot "
                   "combine it on Cloud AI 100")


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


class CompileOptions(BaseModel):
    """Options of a `kind: qaic` recipe. The serving shape is what vLLM must be started with: a QPC is
    bound to it (ctx_len = --max-model-len, full_batch_size = --max-num-seqs, prefill_seq_len, devices)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task: Literal["generate", "embedding", "transcribe"] = Field(
        "generate", description="generate: a decoder with retained-state KV; embedding: an encoder (no KV cache); "
                                "transcribe: Whisper's one Encoder/Decode graph (retained self and cross KV, whisper.py)")
    num_cores: int = Field(16, ge=1, le=16, description="NSP cores per device the program uses")
    ctx_len: int = Field(2048, ge=16, description="KV cache length: --max-model-len")
    prefill_seq_len: int = Field(128, ge=1, description="tokens per prefill step")
    batch_size: int = Field(1, ge=1, description="prefill batch (and decode batch without continuous batching)")
    full_batch_size: int | None = Field(8, ge=1, description="continuous batching slots: --max-num-seqs (null: off)")
    num_devices: int = Field(1, ge=1, le=64)
    mxfp6: bool = Field(True, description="MXFP6 E2M3 constant MatMul weights (-mxfp6-matmul)")
    mxint8: bool = Field(True, description="MXINT8 KV cache (custom_io.yaml), else float16")
    mos: int | None = Field(None, ge=1, description="-mos: maximum output splits (compiler tuning)")
    ols: int | None = Field(None, ge=1, description="-ols: overlap split factor (compiler tuning)")
    depth_first: bool = Field(
        False, description="-aic-enable-depth-first: depth-first (DFS) scheduling with the default memory size "
                           "(QEfficient's default is off; vllm-qaic turns it on only when it compiles itself)")
    allow_mxint8_mdp_io: bool = Field(
        False, strict=True,
        description="-allow-mxint8-mdp-io: MXINT8-compress the traffic between the devices of a tensor-sliced "
                    "compile (num_devices > 1); lossy, and not part of the quality prediction")
    hw_version: Literal["ai100", "ai200"] = Field(
        "ai100", description="-aic-hw-version: the Cloud AI card generation the QPC runs on (QEfficient detects "
                             "ai200 from the device's firmware; a build host without a card gets ai100)")
    num_speculative_tokens: int | None = Field(
        None, ge=1, le=MAX_SPECULATIVE_TOKENS, strict=True,
        description="speculative decoding's target LM: decode steps of K+1 tokens returning every logit (needs an "
                    "input export with target_lm: true); served with vLLM's n-gram speculation of K tokens")
    kv_offload: bool = Field(
        True, strict=True,
        description="a vision-language model as two QPCs (vision, language; QEfficient's default) or, false, as one "
                    "QPC holding both (one sequence at a time: needs batch_size 1 and full_batch_size null)")
    sdk_version: str = Field("1.22", pattern=r"^\d+\.\d+(\.\d+)*$",
                             description="the Apps SDK the bundle's files are written for; "
                                         "a compile host re-derives them for its own")

    @model_validator(mode="after")
    def _shape(self) -> CompileOptions:
        if self.prefill_seq_len > self.ctx_len:
            raise ValueError(f"prefill_seq_len {self.prefill_seq_len} is larger than ctx_len {self.ctx_len}")
        if self.task == "embedding" and self.full_batch_size is not None:
            raise ValueError("an embedding model has no KV cache to batch continuously: full_batch_size must be null")
        if self.allow_mxint8_mdp_io and self.num_devices < 2:
            raise ValueError(NO_MDP_IO)
        if self.task == "transcribe" and (self.full_batch_size is not None or self.prefill_seq_len != 1):
            raise ValueError("task transcribe (Whisper) runs one token a step without continuous batching: "
                             "prefill_seq_len must be 1 and full_batch_size null (QEfficient, vllm-qaic)")
        if not self.kv_offload and (self.full_batch_size is not None or self.batch_size != 1):
            raise ValueError("kv_offload: false compiles a single QPC, which runs one sequence at a time "
                             "(continuous batching is dual-QPC only): batch_size must be 1 and full_batch_size null")
        k = self.num_speculative_tokens
        if k is not None and self.task != "generate":
            raise ValueError(NOT_A_TARGET_LM)
        if k is not None and k + 1 > self.prefill_seq_len:
            raise ValueError(f"num_speculative_tokens {k}: a decode step of {k + 1} tokens is longer than "
                             f"prefill_seq_len {self.prefill_seq_len} (QEfficient needs prefill_seq_len >= K+1)")
        return self

    def recorded(self) -> dict[str, Any]:
        """The options as a bundle records them (an option at its default that older bundles did not know is left
        out, so their bytes stay the same)."""
        fields = type(self).model_fields
        unset = {k for k in ADDED_LATER if getattr(self, k) == fields[k].default}
        return self.model_dump(exclude=unset or None)

    @property
    def retained_state(self) -> bool:
        return self.task != "embedding"

    @classmethod
    def parse(cls, options: dict[str, Any]) -> CompileOptions:
        return cls.model_validate(options)

    @staticmethod
    def problems(options: dict[str, Any]) -> list[str]:
        try:
            CompileOptions.model_validate(options)
        except ValidationError as e:
            return [f"{'.'.join(str(x) for x in err['loc']) or 'options'}: {err['msg']}".replace("Value error, ", "")
                    for err in e.errors()]
        return []

    @property
    def decode_batch(self) -> int:
        return self.full_batch_size or self.batch_size

    @property
    def precision(self) -> str:
        """The label of the quality prediction: what the weights become on the device."""
        return "mxfp6" if self.mxfp6 else "fp16"

    @property
    def kv_precision(self) -> str:
        return "mxint8" if self.mxint8 else "float16"


def compiled_weights(options: dict[str, Any]) -> dict[str, str]:
    """What a QPC's MatMul weights are (the kind's describe_weights): MXFP6 elements (FP6 E2M3 under a shared
    scale per block of 32), else the fp16 the device computes in (whatever the export stored). The KV cache's
    MXINT8 is state, not weights: not said here."""
    if options.get("mxfp6", CompileOptions.model_fields["mxfp6"].default):
        return {"precision": "float6_e2m3", "quantization": "mxfp6"}
    return {"precision": "float16", "quantization": ""}


def named_specializations(sdk_version: str) -> bool:
    return _version_tuple(sdk_version) >= NAMED_SPECIALIZATIONS_FROM


def specializations(opts: CompileOptions, sdk_version: str | None = None,
                    vision: dict[str, Any] | None = None) -> dict[str, Any]:
    """Prefill then decode; every value a string. With continuous batching the prefill runs one
    sequence at a time into a `full_batch_size` cache and decode runs all slots. An encoder has one
    specialization: the batch at the full sequence length. `vision`: export.json's record of a VLM's vision
    graph, whose image size the language graph's specializations fix too (vision/compile.py)."""
    named = named_specializations(sdk_version or opts.sdk_version)
    if opts.task == "transcribe":
        from .whisper import specializations as speech

        return speech(opts.batch_size, opts.ctx_len, named)
    if not opts.retained_state:
        encode = {"batch_size": str(opts.batch_size), "seq_len": str(opts.ctx_len)}
        return {"specializations": [{"name": "Encode", "symbols": encode} if named else encode]}
    prefill = {"batch_size": str(opts.batch_size), "seq_len": str(opts.prefill_seq_len), "ctx_len": str(opts.ctx_len)}
    step = (opts.num_speculative_tokens or 0) + 1  # the target LM verifies K drafts after the last token
    decode = {"batch_size": str(opts.decode_batch), "seq_len": str(step), "ctx_len": str(opts.ctx_len)}
    if opts.full_batch_size:
        prefill["full_batch_size"] = decode["full_batch_size"] = str(opts.full_batch_size)
        prefill["batch_size"] = "1"
    if opts.num_speculative_tokens:  # logits: the prefill's last position, every position of a decode step
        prefill[KEEP_INPUT], decode[KEEP_INPUT] = "1", str(step)
    if vision is not None:
        from .vision.compile import language_symbols

        prefill.update(language_symbols(vision, opts))
        decode.update(language_symbols(vision, opts))
    if named:
        return {"specializations": [{"name": "Prefill", "symbols": prefill}, {"name": "Decode", "symbols": decode}]}
    return {"specializations": [prefill, decode]}


def custom_io(layers: int, opts: CompileOptions, vision: dict[str, Any] | None = None) -> str:
    """custom_io.yaml: every past input and its retained output at the KV precision (and a VLM's image rows)."""
    lines, named = [], set()
    if vision is not None:
        from .vision.compile import language_custom_io

        for name, precision in language_custom_io(vision, opts):
            lines += [f"- IOName: {name}", f"  Precision: {precision}", ""]
            named.add(name)  # a cross-attention VLM's image K/V: float16, not the KV precision below
    if opts.task == "transcribe":  # Whisper: the log-mel in the compute dtype, self and cross K/V per decoder layer
        from .whisper import FEATURES, custom_io_names

        lines += [f"- IOName: {FEATURES}", "  Precision: float16", ""]
        for name in custom_io_names(layers):
            lines += [f"- IOName: {name}", f"  Precision: {opts.kv_precision}", ""]
        return "\n".join(lines)
    for i in range(layers):
        for kv in ("key", "value"):
            for suffix in ("", "_RetainedState"):
                if f"past_{kv}.{i}{suffix}" not in named:
                    lines += [f"- IOName: past_{kv}.{i}{suffix}", f"  Precision: {opts.kv_precision}", ""]
    return "\n".join(lines)


def partition_name(num_devices: int) -> str:
    return f"mdp_ts_{num_devices}.json"


def partition(num_devices: int, num_cores: int) -> dict[str, Any]:
    """Tensor slicing over devices 0..N-1 of one card group, each with the program's cores."""
    return {"connections": [{"devices": list(range(num_devices)), "type": "p2p"}],
            "partitions": [{"name": "Partition0",
                            "devices": [{"deviceId": d, "numCores": num_cores} for d in range(num_devices)]}]}


def compile_files(layers: int, opts: CompileOptions, sdk_version: str | None = None,
                  vision: dict[str, Any] | None = None) -> dict[str, bytes]:
    """The compile inputs beside the ONNX, by path relative to the bundle (or QPC artifact) root; `vision`: a
    VLM's vision graph (export.json), whose own inputs come too (vision/compile.py)."""
    spec = specializations(opts, sdk_version, vision)
    files = {f"{COMPILE_DIR}/specializations.json": (json.dumps(spec, indent=1) + "\n").encode()}
    if opts.retained_state:  # an encoder has no KV tensors whose precision to set
        files[f"{COMPILE_DIR}/custom_io.yaml"] = custom_io(layers, opts, vision).encode()
    if vision is not None and opts.kv_offload:  # the dual form's second program
        from .vision.compile import vision_files

        files.update(vision_files(vision, named_specializations(sdk_version or opts.sdk_version)))
    if opts.num_devices > 1:
        files[f"{COMPILE_DIR}/{partition_name(opts.num_devices)}"] = (
            json.dumps(partition(opts.num_devices, opts.num_cores), indent=1) + "\n").encode()
    return files


def command(opts: CompileOptions, onnx_rel: str, sdk_version: str | None = None, compiler: str | None = None) -> list[str]:
    """The compiler argv; paths use the {bundle} and {qpc} placeholders (see `fill`)."""
    version = sdk_version or opts.sdk_version
    modern = _version_tuple(version) >= QAIC_COMPILE_FROM
    exe = compiler or ("qaic-compile" if modern else "qaic-exec")
    argv = [exe, "-aic-hw", f"-aic-hw-version={opts.hw_version}", f"-m={BUNDLE}/{onnx_rel}"]
    if opts.retained_state:
        argv.append("-retained-state")
    argv.append("-convert-to-fp16")
    if not modern:
        argv.append("-compile-only")
    if opts.mxfp6:
        argv.append("-mxfp6-matmul")
    argv.append(f"-aic-num-cores={opts.num_cores}")
    if opts.mos is not None:
        argv.append(f"-mos={opts.mos}")
    if opts.ols is not None:
        argv.append(f"-ols={opts.ols}")
    if opts.depth_first:
        argv.append("-aic-enable-depth-first")
    if opts.allow_mxint8_mdp_io:  # validated: only with num_devices > 1, beside the partition file below
        argv.append("-allow-mxint8-mdp-io")
    argv.append(f"-network-specialization-config={BUNDLE}/{COMPILE_DIR}/specializations.json")
    if opts.retained_state:
        argv.append(f"-custom-IO-list-file={BUNDLE}/{COMPILE_DIR}/custom_io.yaml")
    if opts.num_devices > 1:
        argv.append(f"-mdp-load-partition-config={BUNDLE}/{COMPILE_DIR}/{partition_name(opts.num_devices)}")
    argv.append(f"-aic-binary-dir={QPC}")
    return argv


def vision_command(opts: CompileOptions, vision: dict[str, Any], sdk_version: str | None = None,
                   compiler: str | None = None) -> list[str]:
    """The argv of a VLM's vision QPC (vision/compile.py), same compiler and SDK rules as `command`."""
    from .vision.compile import vision_command as argv

    modern = _version_tuple(sdk_version or opts.sdk_version) >= QAIC_COMPILE_FROM
    return argv(opts, vision, compiler or ("qaic-compile" if modern else "qaic-exec"), modern, BUNDLE)


def fill(argv: list[str], bundle: Path, qpc: Path) -> list[str]:
    """The placeholders replaced: {bundle}, {qpc} (the language or only QPC) and {qpc_vision} beside it."""
    from .vision.compile import QPC_VISION, VISION_QPC_DIR

    return [a.replace(BUNDLE, str(bundle)).replace(QPC_VISION, str(qpc.with_name(VISION_QPC_DIR))).replace(QPC, str(qpc))
            for a in argv]


@dataclass(frozen=True)
class Sdk:
    """The Cloud AI Apps SDK on this host: where its compiler is and which versions it is."""

    root: Path
    compiler: Path
    apps_version: str
    platform_version: str

    @property
    def version(self) -> str:
        return self.apps_version

    def toolchain(self) -> dict[str, str]:
        return {"qaic_apps_sdk": self.apps_version, "qaic_platform_sdk": self.platform_version,
                "qaic_compiler": self.compiler.name}


def _xml_version(path: Path) -> str | None:
    """`<base_version>1.20.2</base_version><build_id>0</build_id>` -> "1.20.2.0" (the SDK's versions/*.xml)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    base = re.search(r"<base_version>\s*([^<\s]+)\s*</base_version>", text)
    if base is None:
        return None
    build = re.search(r"<build_id>\s*([^<\s]+)\s*</build_id>", text)
    return base.group(1) + (f".{build.group(1)}" if build else "")


def sdk_root() -> Path:
    return Path(settings.QAIC_SDK.get())


def find_sdk() -> Sdk | None:
    """The SDK if this host has a usable one (its compiler executable and its apps version), else None."""
    root = sdk_root()
    apps = _xml_version(root / "versions" / "apps.xml")
    if apps is None:
        return None
    exe = root / "exec" / ("qaic-compile" if _version_tuple(apps) >= QAIC_COMPILE_FROM else "qaic-exec")
    if not (exe.is_file() and os.access(exe, os.X_OK)):
        return None
    return Sdk(root=root, compiler=exe, apps_version=apps,
               platform_version=_xml_version(root / "versions" / "platform.xml") or "absent")


def no_sdk_reason() -> str:
    root = sdk_root()
    how = "$HIVE_AOT_QAIC_SDK" if settings.QAIC_SDK.is_set() else "the default location"
    return f"no Cloud AI SDK on this host ({root}, {how}, has no versions/apps.xml and compiler)"


def run(argv: list[str], log: Path, what: str, timeout_s: float | None = None) -> float:
    """Run the compiler with its output in `log`; one line with the tail of stderr when it fails."""
    started = time.monotonic()
    with open(log, "wb") as out:
        try:
            proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
        except FileNotFoundError:
            raise EngineFailed(f"{what}: compiler {argv[0]} not found") from None
        except subprocess.TimeoutExpired:
            raise EngineFailed(f"{what}: the compiler ran longer than {timeout_s:.0f} s and was stopped") from None
    if proc.returncode != 0:
        tail = " | ".join(line.strip() for line in log.read_text(errors="replace").splitlines()[-5:] if line.strip())
        raise EngineFailed(f"{what}: {Path(argv[0]).name} exited with status {proc.returncode}: {tail or 'no output'}")
    return time.monotonic() - started
