"""STAND-IN for Qualcomm's `qaic-compile` / `qaic-exec` (the Cloud AI Apps SDK cannot exist on these machines).

It is NOT a compiler and what it writes is NOT a QPC. It stands in for the real binary only to test what
hive-aot hands a compiler: it accepts exactly the flags of the compile contract (reference/ai100-qpc.md),
refuses anything else as the SDK does, checks every input file against the ONNX (retained-state pairs,
dynamic axes vs specialization symbols, custom IO precisions, the partition file (devices 0..N-1, one p2p
connection over them, each device with -aic-num-cores), -allow-mxint8-mdp-io only beside a partition, the
hardware version (ai100 or ai200), -mos/-ols positive, the
specialization format for its own SDK version, a target LM's num_logits_to_keep in every
specialization), and writes a labelled placeholder `programqpc.bin`
holding what it checked. `make_sdk()` lays out an SDK-shaped directory around it for
$HIVE_AOT_QAIC_SDK. `STANDIN_FAIL=<text>` makes it fail as a compiler does (stderr, exit 1).
The real-SDK test (tests/targets/qaic/test_qaic_compile.py) runs the real binary where /opt/qti-aic exists.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

LABEL = b"HIVE-AOT STAND-IN COMPILER OUTPUT: NOT A QPC\n"  # starts with qpc.STAND_IN_MARK
FLAGS = {"-aic-hw", "-retained-state", "-convert-to-fp16", "-mxfp6-matmul", "-aic-enable-depth-first", "-compile-only",
         "-allow-mxint8-mdp-io"}
VALUED = {"-aic-hw-version", "-m", "-aic-num-cores", "-mos", "-ols", "-network-specialization-config",
          "-custom-IO-list-file", "-mdp-load-partition-config", "-aic-binary-dir"}
REQUIRED = {"-aic-hw", "-aic-hw-version", "-m", "-convert-to-fp16", "-aic-num-cores",
            "-network-specialization-config", "-aic-binary-dir"}
HW_VERSIONS = {"ai100", "ai200"}
RETAINED = {"-retained-state", "-custom-IO-list-file"}  # required for a graph with KV state
# A graph without KV state (an encoder, a VLM's vision graph) may still set its IO precisions (no -retained-state).


def fail(msg: str) -> None:
    print(f"qaic-compile (stand-in): ERROR: {msg}", file=sys.stderr)
    sys.exit(1)


def sdk_version(exe: Path) -> tuple[int, ...]:
    text = (exe.resolve().parent.parent / "versions" / "apps.xml").read_text()
    return tuple(int(x) for x in re.search(r"<base_version>([\d.]+)</base_version>", text).group(1).split("."))


def main(argv: list[str], exe: Path) -> None:
    if os.environ.get("STANDIN_FAIL"):
        print("compiling graph ...")
        fail(os.environ["STANDIN_FAIL"])
    flags: set[str] = set()
    values: dict[str, str] = {}
    for a in argv:
        name, eq, value = a.partition("=")
        if name in FLAGS and not eq:
            flags.add(name)
        elif name in VALUED and eq:
            values[name] = value
        else:
            print(f"Unknown command line argument '{a}'", file=sys.stderr)
            sys.exit(2)
    version = sdk_version(exe)
    if exe.name == "qaic-exec" and "-compile-only" not in flags:
        fail("qaic-exec needs -compile-only to compile without a device")
    missing = REQUIRED - flags - set(values)
    if missing:
        fail(f"missing {', '.join(sorted(missing))}")
    if values["-aic-hw-version"] not in HW_VERSIONS:
        fail(f"unknown hardware version {values['-aic-hw-version']}")
    cores = int(values["-aic-num-cores"])
    if not 1 <= cores <= 16:
        fail(f"-aic-num-cores={cores} out of range")
    for tuning in ("-mos", "-ols"):
        if tuning in values and not (values[tuning].isdigit() and int(values[tuning]) >= 1):
            fail(f"{tuning}={values[tuning]}: expected a positive integer")
    if "-allow-mxint8-mdp-io" in flags and "-mdp-load-partition-config" not in values:
        fail("-allow-mxint8-mdp-io compresses traffic between devices: it needs -mdp-load-partition-config")

    import onnx

    model_path = Path(values["-m"])
    model = onnx.load(str(model_path), load_external_data=False)
    for init in model.graph.initializer:  # external data must be where the ONNX says
        for entry in init.external_data:
            if entry.key == "location" and not (model_path.parent / entry.value).is_file():
                fail(f"external data {entry.value} of {init.name} not found")
    if model.opset_import[0].version != 17:
        fail(f"opset {model.opset_import[0].version}, expected 17")
    inputs = [i.name for i in model.graph.input]
    outputs = [o.name for o in model.graph.output]
    past = [n for n in inputs if n.startswith("past_")]
    if any(f"{n}_RetainedState" not in outputs for n in past):
        fail("retained state: every past_* input needs a *_RetainedState output")
    given = RETAINED & (flags | set(values))
    if past and given != RETAINED:
        fail(f"a graph with retained state needs {', '.join(sorted(RETAINED - given))}")
    if not past and "-retained-state" in given:
        fail("-retained-state given for a graph without retained state")
    symbols = {d.dim_param for v in list(model.graph.input) + list(model.graph.output)
               for d in v.type.tensor_type.shape.dim if d.dim_param}

    specs = json.loads(Path(values["-network-specialization-config"]).read_text())["specializations"]
    named = all("symbols" in s for s in specs)
    if version < (1, 22) and named:
        fail("specialization config: unexpected key 'name' (this SDK reads the flat list form)")
    if version >= (1, 22) and not named:
        fail("specialization config: expected named specializations with 'symbols'")
    for s in specs:
        sym = s["symbols"] if named else s
        if not all(isinstance(v, str) for v in sym.values()):
            fail("specialization values must be strings")
        unknown = set(sym) - symbols
        if unknown:
            fail(f"specialization symbol(s) {sorted(unknown)} are not dynamic axes of the model")
        if "full_batch_size" in sym and "batch_index" not in inputs:
            fail("full_batch_size needs a batch_index input")
        if "num_logits_to_keep" in inputs:  # a target LM: every specialization sizes its logits, within its tokens
            if "num_logits_to_keep" not in sym:
                fail("specialization leaves the dynamic axis num_logits_to_keep unset")
            if not 1 <= int(sym["num_logits_to_keep"]) <= int(sym["seq_len"]):
                fail(f"num_logits_to_keep {sym['num_logits_to_keep']} is not within seq_len {sym['seq_len']}")

    io = Path(values["-custom-IO-list-file"]).read_text() if "-custom-IO-list-file" in values else ""
    pairs = re.findall(r"- IOName: (\S+)\n\s+Precision: (\S+)", io)
    precisions = {p for _, p in pairs}
    if precisions - {"mxint8", "float16"}:
        fail(f"custom IO precision {sorted(precisions)} unknown")
    named = {n for n, _ in pairs}
    kv = set(past) | {f"{n}_RetainedState" for n in past}
    if not kv <= named:
        fail("custom IO list does not cover every retained-state input and output")
    float_io = {v.name for v in list(model.graph.input) + list(model.graph.output)
                if v.type.tensor_type.elem_type == 1}  # FLOAT: what a custom IO precision may change
    if named - kv - float_io:
        fail(f"custom IO names {sorted(named - kv - float_io)[:3]}, not float inputs or outputs of the model")
    if any(p == "mxint8" for n, p in pairs if n not in kv):
        fail("mxint8 custom IO is for the KV cache only")

    devices = 1
    if "-mdp-load-partition-config" in values:
        mdp = json.loads(Path(values["-mdp-load-partition-config"]).read_text())
        ids = [d["deviceId"] for d in mdp["partitions"][0]["devices"]]
        if ids != list(range(len(ids))) or len(ids) < 2:
            fail(f"partition devices {ids} must be 0..N-1 with N >= 2")
        if mdp["connections"] != [{"devices": ids, "type": "p2p"}]:
            fail(f"partition connections {mdp['connections']} must be one p2p connection over devices {ids}")
        if {d["numCores"] for d in mdp["partitions"][0]["devices"]} != {cores}:
            fail(f"partition devices must each have -aic-num-cores={cores} cores")
        devices = len(ids)

    out = Path(values["-aic-binary-dir"])
    out.mkdir(parents=True, exist_ok=True)
    checked = {"sdk": ".".join(map(str, version)), "compiler": exe.name, "flags": sorted(flags), "values": values,
               "specializations": specs, "custom_io": dict(pairs), "devices": devices, "inputs": inputs}
    (out / "programqpc.bin").write_bytes(LABEL + json.dumps(checked, sort_keys=True).encode())
    print("compile (stand-in) done")


def make_sdk(root: Path, version: str = "1.22.0", python: str | None = None) -> Path:
    """An SDK-shaped directory whose compiler is this stand-in: versions/{apps,platform}.xml, exec/<compiler>."""
    base = version.rsplit(".", 1)[0] if version.count(".") >= 2 else version
    build = version.rsplit(".", 1)[1] if version.count(".") >= 2 else "0"
    (root / "versions").mkdir(parents=True, exist_ok=True)
    for name in ("apps", "platform"):
        (root / "versions" / f"{name}.xml").write_text(
            f"<versions><ci_build><base_name>{name}</base_name><base_version>{base}</base_version>"
            f"<build_id>{build}</build_id></ci_build></versions>\n")
    (root / "exec").mkdir(exist_ok=True)
    modern = tuple(int(x) for x in base.split(".")) >= (1, 21)
    exe = root / "exec" / ("qaic-compile" if modern else "qaic-exec")
    exe.write_text(f"#!/bin/sh\nexec {python or sys.executable} {Path(__file__).resolve()} \"$0\" \"$@\"\n")
    exe.chmod(0o755)
    return root


if __name__ == "__main__":
    main(sys.argv[2:], Path(sys.argv[1]))
