"""The AI 100 compile stage (pipelines/targets/qaic/compile.py, bundle.py, qpc.py, serving.py) and derived
builds: qaic-export -> export bundle (compile pending without the SDK) -> QPC with the vllm-qaic binding.

The Apps SDK cannot exist on these machines. Where a compiler must run, `tests/support/qaic_standin.py` is a
labelled STAND-IN: it accepts only the contract's flags, checks every input against the ONNX and writes
a placeholder marked "NOT A QPC". `test_real_sdk_compiles_the_bundle` runs the real compiler and skips,
saying why, where /opt/qti-aic is absent.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from factories import write_test_config
from qaic_standin import LABEL, make_sdk
from test_cli import doc, hive, one_error_line

from pipelines.targets.qaic.compile import CompileOptions, command, compile_files, custom_io, specializations
from pipelines.targets.qaic.serving import describe

MODEL = "test-org/tiny-llama"
SLUG = "test-org--tiny-llama"
SHAPE = {"num_cores": 4, "ctx_len": 128, "prefill_seq_len": 32, "batch_size": 1, "full_batch_size": 4,
         "num_devices": 1, "mxfp6": True, "mxint8": True, "sdk_version": "1.22"}


# --- the contract as data --------------------------------------------------------------------------


def test_specializations_named_legacy_and_continuous_batching():
    opts = CompileOptions.parse(SHAPE)
    named = specializations(opts)["specializations"]
    assert [s["name"] for s in named] == ["Prefill", "Decode"]
    # continuous batching: prefill one sequence into the full_batch_size cache, decode all slots
    assert named[0]["symbols"] == {"batch_size": "1", "seq_len": "32", "ctx_len": "128", "full_batch_size": "4"}
    assert named[1]["symbols"] == {"batch_size": "4", "seq_len": "1", "ctx_len": "128", "full_batch_size": "4"}
    legacy = specializations(opts, "1.20")["specializations"]
    assert legacy == [named[0]["symbols"], named[1]["symbols"]]  # SDKs before 1.22: the flat list form
    plain = specializations(CompileOptions.parse({**SHAPE, "full_batch_size": None, "batch_size": 2}))["specializations"]
    assert plain[0]["symbols"] == {"batch_size": "2", "seq_len": "32", "ctx_len": "128"}
    assert plain[1]["symbols"] == {"batch_size": "2", "seq_len": "1", "ctx_len": "128"}
    assert all(isinstance(v, str) for s in named + legacy + plain for v in s.get("symbols", s).values())


def test_custom_io_partition_and_command_per_option():
    opts = CompileOptions.parse({**SHAPE, "num_devices": 4, "mos": 2, "ols": 3, "depth_first": True})
    io = yaml.safe_load(custom_io(3, opts))
    assert len(io) == 3 * 2 * 2 and {e["Precision"] for e in io} == {"mxint8"}
    assert {e["IOName"] for e in io} >= {"past_key.2", "past_value.0_RetainedState"}
    fp16 = yaml.safe_load(custom_io(1, CompileOptions.parse({**SHAPE, "mxint8": False})))
    assert {e["Precision"] for e in fp16} == {"float16"}
    files = compile_files(3, opts)
    mdp = json.loads(files["compile/mdp_ts_4.json"])
    assert [d["deviceId"] for d in mdp["partitions"][0]["devices"]] == [0, 1, 2, 3]
    assert all(d["numCores"] == 4 for d in mdp["partitions"][0]["devices"])
    argv = command(opts, "onnx/model.onnx")
    assert argv == [
        "qaic-compile", "-aic-hw", "-aic-hw-version=ai100", "-m={bundle}/onnx/model.onnx", "-retained-state",
        "-convert-to-fp16", "-mxfp6-matmul", "-aic-num-cores=4", "-mos=2", "-ols=3", "-aic-enable-depth-first",
        "-network-specialization-config={bundle}/compile/specializations.json",
        "-custom-IO-list-file={bundle}/compile/custom_io.yaml",
        "-mdp-load-partition-config={bundle}/compile/mdp_ts_4.json", "-aic-binary-dir={qpc}"]
    one = command(CompileOptions.parse({**SHAPE, "mxfp6": False}), "onnx/model.onnx", "1.20")
    assert one[0] == "qaic-exec" and "-compile-only" in one and "-mxfp6-matmul" not in one
    assert (not any(a.startswith("-mdp") for a in one)
            and "compile/mdp_ts_1.json" not in compile_files(1, CompileOptions.parse(SHAPE)))


@pytest.mark.parametrize("options, message", [
    ({**SHAPE, "prefill_seq_len": 256}, "prefill_seq_len 256 is larger than ctx_len 128"),
    ({**SHAPE, "num_cores": 17}, "num_cores: Input should be less than or equal to 16"),
    ({**SHAPE, "ctx_len": "long"}, "ctx_len: Input should be a valid integer"),
    ({**SHAPE, "turbo": True}, "turbo: Extra inputs are not permitted"),
    ({**SHAPE, "sdk_version": "latest"}, "sdk_version: String should match pattern"),
    ({**SHAPE, "hw_version": "ai300"}, "hw_version: Input should be 'ai100' or 'ai200'"),
    ({**SHAPE, "hw_version": "AI200"}, "hw_version: Input should be 'ai100' or 'ai200'"),
    ({**SHAPE, "allow_mxint8_mdp_io": True}, "allow_mxint8_mdp_io compresses the traffic between the devices tensor "
                                             "slicing splits the model over: it needs num_devices > 1"),
    ({**SHAPE, "num_devices": 2, "allow_mxint8_mdp_io": "yes"}, "allow_mxint8_mdp_io: Input should be a valid boolean"),
])
def test_bad_options_are_one_line_each(options, message):
    problems = CompileOptions.problems(options)
    assert len(problems) == 1 and message in problems[0], problems


# --- compile options as QEfficient's, flag by flag, and what the stand-in compiler accepts -------------


def _argv(hw="ai100", tuning=(), devices=1) -> list[str]:
    """The contract's command for SHAPE: each tuning option after the cores, the partition after custom IO."""
    mdp = [f"-mdp-load-partition-config={{bundle}}/compile/mdp_ts_{devices}.json"] if devices > 1 else []
    return ["qaic-compile", "-aic-hw", f"-aic-hw-version={hw}", "-m={bundle}/onnx/model.onnx", "-retained-state",
            "-convert-to-fp16", "-mxfp6-matmul", "-aic-num-cores=4", *tuning,
            "-network-specialization-config={bundle}/compile/specializations.json",
            "-custom-IO-list-file={bundle}/compile/custom_io.yaml", *mdp, "-aic-binary-dir={qpc}"]


OPTION_FLAGS = [  # (options over SHAPE, the command QEfficient's _compile would emit for them)
    ({}, _argv()),
    ({"hw_version": "ai100"}, _argv()),
    ({"hw_version": "ai200"}, _argv(hw="ai200")),
    ({"depth_first": True}, _argv(tuning=["-aic-enable-depth-first"])),
    ({"mos": 2}, _argv(tuning=["-mos=2"])),
    ({"ols": 3}, _argv(tuning=["-ols=3"])),
    ({"num_devices": 4}, _argv(devices=4)),
    ({"num_devices": 2, "allow_mxint8_mdp_io": True}, _argv(tuning=["-allow-mxint8-mdp-io"], devices=2)),
    ({"num_devices": 2, "allow_mxint8_mdp_io": True, "mos": 1, "depth_first": True, "hw_version": "ai200"},
     _argv(hw="ai200", tuning=["-mos=1", "-aic-enable-depth-first", "-allow-mxint8-mdp-io"], devices=2)),
]


@pytest.mark.parametrize("options, argv", OPTION_FLAGS)
def test_each_compile_option_emits_its_flag_and_nothing_else(options, argv):
    opts = CompileOptions.parse({**SHAPE, **options})
    assert command(opts, "onnx/model.onnx") == argv
    # an option added later is recorded in the bundle only when it is not its default (older bundles keep their bytes)
    recorded = opts.recorded()
    for key in ("hw_version", "allow_mxint8_mdp_io"):
        assert (key in recorded) == (key in options and options[key] != CompileOptions.model_fields[key].default)
    assert CompileOptions.parse(recorded) == opts
    # the QPC's serving binding names the card generation only when it is not the AI 100 (older QPCs keep their bytes)
    assert describe(opts, {}, MODEL, False, {})["compiled_for"].get("hw_version") == \
        ("ai200" if options.get("hw_version") == "ai200" else None)


SHIPPED = {  # the commands the shipped recipes compiled with before the hardware version and MDP IO options
    "qaic-mxfp6": ["qaic-compile", "-aic-hw", "-aic-hw-version=ai100", "-m={bundle}/onnx/model.onnx", "-retained-state",
                   "-convert-to-fp16", "-mxfp6-matmul", "-aic-num-cores=16",
                   "-network-specialization-config={bundle}/compile/specializations.json",
                   "-custom-IO-list-file={bundle}/compile/custom_io.yaml", "-aic-binary-dir={qpc}"],
    "qaic-fp16": ["qaic-compile", "-aic-hw", "-aic-hw-version=ai100", "-m={bundle}/onnx/model.onnx", "-retained-state",
                  "-convert-to-fp16", "-aic-num-cores=16",
                  "-network-specialization-config={bundle}/compile/specializations.json",
                  "-custom-IO-list-file={bundle}/compile/custom_io.yaml", "-aic-binary-dir={qpc}"],
    "qaic-embed-mxfp6": ["qaic-compile", "-aic-hw", "-aic-hw-version=ai100", "-m={bundle}/onnx/model.onnx",
                         "-convert-to-fp16", "-mxfp6-matmul", "-aic-num-cores=16",
                         "-network-specialization-config={bundle}/compile/specializations.json", "-aic-binary-dir={qpc}"],
}
RECORDED_KEYS = {"task", "num_cores", "ctx_len", "prefill_seq_len", "batch_size", "full_batch_size", "num_devices",
                 "mxfp6", "mxint8", "mos", "ols", "depth_first", "sdk_version"}


@pytest.mark.parametrize("recipe", sorted(SHIPPED))
def test_shipped_recipes_compile_and_record_as_before(recipe):
    opts = CompileOptions.parse(yaml.safe_load((Path.cwd() / "recipes" / f"{recipe}.yaml").read_text())["options"])
    assert command(opts, "onnx/model.onnx") == SHIPPED[recipe]
    assert set(opts.recorded()) == RECORDED_KEYS and not opts.depth_first and opts.mos is None


def test_the_standin_compiler_checks_each_option(tmp_path):
    """Every option's flag through the stand-in: accepted and recorded as given; a flag it does not know, a hardware
    version other than ai100/ai200, MDP IO compression without a partition and a partition whose devices do not
    have the program's cores are refused as the SDK refuses (exit status, one stderr line)."""
    import subprocess

    from test_qaic_qpc import LAYERS, OPTIONS, retained_state_onnx

    from pipelines.targets.qaic.compile import fill

    exe = make_sdk(tmp_path / "sdk", "1.22.0") / "exec" / "qaic-compile"

    def compile_with(options: dict, edit=lambda argv: argv) -> tuple[subprocess.CompletedProcess, dict | None]:
        opts = CompileOptions.parse({**OPTIONS, **options})
        bundle = tmp_path / f"b{len(list(tmp_path.iterdir()))}"
        for rel, body in {"onnx/model.onnx": retained_state_onnx(), **compile_files(LAYERS, opts)}.items():
            (bundle / rel).parent.mkdir(parents=True, exist_ok=True)
            (bundle / rel).write_bytes(body)
        argv = edit(fill(command(opts, "onnx/model.onnx", compiler=str(exe)), bundle, bundle / "qpc"))
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
        program = bundle / "qpc" / "programqpc.bin"
        return proc, json.loads(program.read_bytes()[len(LABEL):]) if proc.returncode == 0 else None

    for options, flags, values, devices in [
        ({}, [], {"-aic-hw-version": "ai100"}, 1),
        ({"hw_version": "ai200"}, [], {"-aic-hw-version": "ai200"}, 1),
        ({"depth_first": True, "mos": 2, "ols": 3}, ["-aic-enable-depth-first"], {"-mos": "2", "-ols": "3"}, 1),
        ({"num_devices": 4}, [], {}, 4),
        ({"num_devices": 2, "allow_mxint8_mdp_io": True}, ["-allow-mxint8-mdp-io"], {}, 2),
    ]:
        proc, checked = compile_with(options)
        assert proc.returncode == 0, proc.stderr
        assert checked["flags"] == sorted(["-aic-hw", "-convert-to-fp16", "-mxfp6-matmul", "-retained-state", *flags])
        assert {k: v for k, v in checked["values"].items() if k in ("-aic-hw-version", "-mos", "-ols")} \
            == {"-aic-hw-version": "ai100", **values}
        assert checked["devices"] == devices and checked["values"]["-aic-num-cores"] == "4"

    def partition_cores(argv):
        mdp = Path(next(a for a in argv if a.startswith("-mdp-load")).split("=", 1)[1])
        doc = json.loads(mdp.read_text())
        doc["partitions"][0]["devices"][1]["numCores"] = 8
        mdp.write_text(json.dumps(doc))
        return argv

    for options, edit, message in [
        ({}, lambda argv: [*argv, "-aic-turbo"], "Unknown command line argument '-aic-turbo'"),
        ({}, lambda argv: [a.replace("=ai100", "=ai300") for a in argv], "unknown hardware version ai300"),
        ({}, lambda argv: [*argv, "-allow-mxint8-mdp-io"], "-allow-mxint8-mdp-io compresses traffic between devices"),
        ({}, lambda argv: [*argv, "-mos=0"], "-mos=0: expected a positive integer"),
        ({"num_devices": 2}, partition_cores, "partition devices must each have -aic-num-cores=4 cores"),
    ]:
        proc, _ = compile_with(options, edit)
        assert proc.returncode != 0 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


# --- derived builds, end to end through the CLI ---------------------------------------------------


def _config(tmp_path: Path, model_dir: Path, repo: Path, **shape) -> Path:
    """The project's registry and recipes plus `qaic-tiny`: the mxfp6 recipe at a shape a 512-position model has."""
    reg = write_test_config(tmp_path / "cfg", repo, models=[{"id": MODEL, "source": str(model_dir), "recipes": ["qaic-tiny"]}],
                            gates={})
    recipe = yaml.safe_load((repo / "recipes" / "qaic-mxfp6.yaml").read_text())
    recipe.update(id="qaic-tiny", options={**SHAPE, **shape},
                  validation={"min_predicted_top1": 0.5, "max_predicted_kl": 1.0})
    (tmp_path / "cfg" / "recipes" / "qaic-tiny.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    return reg


@pytest.fixture(scope="module")
def pending(tiny_llama, tmp_path_factory):
    """tiny-llama built with qaic-tiny on a host without the SDK: export and bundle published, compile pending."""
    tmp = tmp_path_factory.mktemp("qaic")
    repo = Path.cwd()
    reg = _config(tmp, tiny_llama, repo)
    store = tmp / "store"
    env = {"HIVE_AOT_QAIC_SDK": str(tmp / "no-sdk")}
    proc = hive("build", str(tiny_llama), "--model-id", MODEL, "--recipe", "qaic-tiny", "--registry", str(reg),
                "--store", str(store), "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    return {"tmp": tmp, "reg": reg, "store": store, "env": env, "doc": doc(proc), "model": tiny_llama}


def _manifest(store: Path, recipe: str, build_id: str) -> dict:
    return json.loads((store / "manifests" / SLUG / recipe / f"{build_id}.json").read_text())


def test_without_sdk_the_build_publishes_the_export_and_its_bundle_compile_pending(pending):
    d, store = pending["doc"], pending["store"]
    assert d["state"] == "compile_pending" and d["format"] == "qaic-export-bundle"
    assert "exported, compile pending: no Cloud AI SDK on this host" in d["reason"]
    assert d["input"]["recipe"] == "qaic-export" and d["input"]["state"] == "published"
    export = _manifest(store, "qaic-export", d["input"]["build_id"])
    assert export["format"] == "onnx" and export["runtime_profiles"] == []
    v = export["validation"]
    assert v["passed"] and v["metrics"]["ort_top1_agreement"] == 1.0 and v["metrics"]["ort_steps"] >= 18
    assert 0 <= v["metrics"]["ort_max_abs_delta"] < 1e-3
    bundle = _manifest(store, "qaic-tiny", d["build_id"])
    paths = {f["path"] for f in bundle["files"]}
    assert {"onnx/model.onnx", "compile/specializations.json", "compile/custom_io.yaml", "compile/command.json",
            "config.json", "tokenizer.json", "export.json"} <= paths
    # The bundle's ONNX is the export's, blob for blob (content addressed: stored once).
    digests = {f["path"]: f["sha256"] for f in export["files"]}
    assert all(f["sha256"] == digests[f["path"]] for f in bundle["files"] if f["path"] in digests)
    assert bundle["build"]["state"] == "compile_pending" and bundle["build"]["input"]["build_id"] == d["input"]["build_id"]
    assert bundle["build"]["compile"]["command"][0] == "qaic-compile" and bundle["serving"] == {}
    # The quality estimate travels with the bundle: MXFP6 weights + MXINT8 KV emulated against fp32.
    q = bundle["validation"]["mxfp6"]
    assert q["emulated"] == ["mxfp6 weights", "mxint8 kv cache"] and 0 < q["top1"] <= 1 and q["kl"] >= 0
    assert bundle["validation"]["metrics"]["predicted_top1"] == q["top1"]
    # Tags: only bundle-* refs; `latest` of the compile recipe never names a bundle.
    refs = {p.name for p in (store / "refs" / SLUG / "qaic-tiny").iterdir()}
    assert refs == {"bundle-latest", f"bundle-{bundle['model']['commit']}"}
    # The derived build id includes its input's: the same recipe on another export is another build.
    assert d["build_id"] != d["input"]["build_id"]


def test_pull_refuses_a_bundle_naming_its_build(pending, tmp_path):
    proc = hive("pull", MODEL, "--target", "vllm-qaic", "--dest", str(tmp_path / "m"), "--store", str(pending["store"]),
                "--registry", str(pending["reg"]))
    line = one_error_line(proc)
    assert proc.returncode == 1 and not (tmp_path / "m").exists()
    assert f"qaic-tiny is only an export bundle so far (build {pending['doc']['build_id'][:12]}" in line
    assert "compile it on a host with the Cloud AI SDK: hive-aot compile test-org/tiny-llama --recipe qaic-tiny" in line
    by_id = hive("pull", f"{MODEL}@{pending['doc']['build_id']}", "--target", "vllm-qaic", "--dest", str(tmp_path / "m"),
                 "--store", str(pending["store"]), "--registry", str(pending["reg"]))
    assert "only an export bundle" in one_error_line(by_id)


def test_pull_for_a_profile_no_bundle_serves_says_what_is_published(pending, tmp_path):
    """Red team round two, item 16: `pull --target transformers-cu121` of a model whose only artifacts are an AI 100
    export and bundle said the bundle must be compiled; no compile would give that profile anything."""
    proc = hive("pull", MODEL, "--target", "transformers-cu121", "--dest", str(tmp_path / "m"), "--store",
                str(pending["store"]), "--registry", str(pending["reg"]))
    line = one_error_line(proc)
    assert proc.returncode == 1 and "only an export bundle" not in line and "hive-aot compile" not in line, line
    assert "no published artifact serves transformers-cu121 (published: qaic-export" in line, line


def test_rebuilding_reuses_every_step_by_build_id(pending):
    proc = hive("build", str(pending["model"]), "--model-id", MODEL, "--recipe", "qaic-tiny", "--registry",
                str(pending["reg"]), "--store", str(pending["store"]), "--json", env=pending["env"])
    d = doc(proc)
    assert proc.returncode == 0 and d["state"] == "compile_pending" and d["skipped"] and d["input"]["state"] == "skipped"
    assert d["build_id"] == pending["doc"]["build_id"]


def test_qaic_compile_without_sdk_says_so(pending):
    proc = hive("qaic-compile", MODEL, "--registry", str(pending["reg"]), "--store", str(pending["store"]), env=pending["env"])
    assert proc.returncode == 1 and "no Cloud AI SDK on this host" in one_error_line(proc)


def test_compile_refuses_a_recipe_whose_kind_has_no_hardware_step(pending):
    proc = hive("compile", MODEL, "--recipe", "qaic-export", "--registry", str(pending["reg"]), "--store",
                str(pending["store"]), env=pending["env"])
    line = one_error_line(proc)
    assert proc.returncode == 1 and "recipe qaic-export (qaic-export) has no step to run on other hardware" in line, line


@pytest.mark.parametrize("with_sdk", [False, True])
def test_plan_names_the_hardware_step_and_whether_this_host_has_it(pending, tmp_path, with_sdk):
    env = {"HIVE_AOT_QAIC_SDK": str(make_sdk(tmp_path / "sdk", "1.22.0") if with_sdk else tmp_path / "no-sdk")}
    proc = hive("plan", str(pending["model"]), "--model-id", MODEL, "--recipe", "qaic-tiny", "--registry",
                str(pending["reg"]), "--store", str(pending["store"]), "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    step = doc(proc)["hardware_step"]
    assert (step["step"], step["needs"], step["here"]) == ("qpc", "the Cloud AI SDK", with_sdk)
    assert (step["missing"] is None) == with_sdk and (with_sdk or "no Cloud AI SDK on this host" in step["missing"])
    text = hive("plan", str(pending["model"]), "--model-id", MODEL, "--recipe", "qaic-tiny", "--registry",
                str(pending["reg"]), "--store", str(pending["store"]), env=env).stdout.splitlines()[-1]
    assert text.startswith("  then qpc: needs the Cloud AI SDK; ")
    assert ("the build runs it" in text) == with_sdk and ("`hive-aot compile`" in text) != with_sdk


def test_an_interrupted_compile_publish_is_repaired_signature_first(pending, tmp_path):
    """The compile commits through the engine's sequence: a rerun after a kill between manifest and refs (or
    before a signing key existed) signs the manifest, then writes the missing refs, moving no tag."""
    from factories import ecdsa_keypair

    store = _qpc_store(pending, tmp_path)
    env = {"HIVE_AOT_QAIC_SDK": str(make_sdk(tmp_path / "sdk", "1.22.0"))}
    first = doc(hive("compile", MODEL, "--registry", str(pending["reg"]), "--store", str(store), "--json", env=env))[0]
    refs = store / "refs" / SLUG / "qaic-tiny"
    signatures = store / "signatures" / SLUG / "qaic-tiny"
    assert (refs / "latest").is_file() and not signatures.exists()  # no key: unsigned
    (refs / "latest").unlink()
    private, public = ecdsa_keypair(tmp_path, "k")
    proc = hive("compile", MODEL, "--registry", str(pending["reg"]), "--store", str(store), "--json",
                env={**env, "HIVE_AOT_SIGNING_KEY": str(private)})
    again = doc(proc)[0]
    assert again["state"] == "skipped" and again["build_id"] == first["build_id"], proc.stderr
    assert json.loads((refs / "latest").read_text())["build_id"] == first["build_id"]
    assert (signatures / f"{first['build_id']}.json.sig").is_file()
    pulled = hive("pull", MODEL, "--target", "vllm-qaic", "--dest", str(tmp_path / "d"), "--store", str(store),
                  "--registry", str(pending["reg"]), "--allow-stand-in", "--trusted-keys", str(public), "--json")
    assert pulled.returncode == 0 and doc(pulled)["build_id"] == first["build_id"], pulled.stderr


def _qpc_store(pending, tmp_path: Path) -> Path:
    store = tmp_path / "store"
    shutil.copytree(pending["store"], store)
    return store


def test_standin_compile_publishes_a_qpc_bound_to_its_serving_arguments(pending, tmp_path):
    """STAND-IN compiler: checks every flag and file it is given; its output is labelled NOT A QPC."""
    store = _qpc_store(pending, tmp_path)
    sdk = make_sdk(tmp_path / "sdk", "1.22.0")
    env = {"HIVE_AOT_QAIC_SDK": str(sdk)}
    proc = hive("compile", MODEL, "--registry", str(pending["reg"]), "--store", str(store), "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    (res,) = doc(proc)
    assert res["state"] == "published" and res["format"] == "qpc" and res["recipe"] == "qaic-tiny"
    m = _manifest(store, "qaic-tiny", res["build_id"])
    assert m["build"]["input"]["build_id"] == pending["doc"]["build_id"]
    assert m["toolchain"]["qaic_apps_sdk"] == "1.22.0" and m["runtime_profiles"] == ["vllm-qaic"]
    # the compile time is reported, never stored: a build id's manifest bytes do not depend on the host
    assert res["validation"]["qpc"]["compile_seconds"] >= 0 and "compile_seconds" not in m["validation"]["qpc"]
    assert m["validation"]["qpc"]["program_bytes"] > len(LABEL)
    paths = {f["path"] for f in m["files"]}
    assert {"qpc/programqpc.bin", "compile/specializations.json", "compile/custom_io.yaml", "compile/command.json",
            "compile/sdk.json", "config.json", "tokenizer.json"} <= paths
    assert not any(p.startswith("onnx/") for p in paths)  # the server loads the QPC, not the ONNX
    assert m["validation"]["mxfp6"] == _manifest(store, "qaic-tiny", pending["doc"]["build_id"])["validation"]["mxfp6"]
    serving = m["serving"]["vllm-qaic"]
    assert serving["env"]["VLLM_QAIC_QPC_PATH"] == "{model_dir}/qpc"
    assert serving["engine_args"] == {"served_model_name": MODEL, "max_model_len": 128, "max_num_seqs": 4,
                                      "max_seq_len_to_capture": 32, "device_group": "0", "quantization": "mxfp6",
                                      "kv_cache_dtype": "mxint8"}
    # Red team round two, item 23: a stand-in's placeholder was published as `latest` with no mark. It is marked,
    # and pull refuses it unless the stand-in is asked for.
    assert "stand-in" in m["build"]["stand_in"]
    refused = hive("pull", MODEL, "--target", "vllm-qaic", "--dest", str(tmp_path / "no"), "--store", str(store),
                   "--registry", str(pending["reg"]))
    assert refused.returncode == 1 and "was made by a stand-in" in one_error_line(refused)
    assert not (tmp_path / "no").exists()
    # pull hands out the QPC and prints exactly the serving arguments it was compiled for
    dest = tmp_path / "served"
    pulled = hive("pull", MODEL, "--target", "vllm-qaic", "--dest", str(dest), "--store", str(store),
                  "--registry", str(pending["reg"]), "--json", "--allow-stand-in")
    p = doc(pulled)
    assert pulled.returncode == 0 and p["recipe"] == "qaic-tiny" and p["build_id"] == res["build_id"]
    assert p["env"]["VLLM_QAIC_QPC_PATH"] == f"{dest}/qpc"
    assert p["serve_argv"] == ["vllm", "serve", str(dest), "--served-model-name", MODEL, "--max-model-len", "128",
                               "--max-num-seqs", "4", "--max-seq-len-to-capture", "32", "--device-group", "0",
                               "--quantization", "mxfp6", "--kv-cache-dtype", "mxint8"]
    blob = (dest / "qpc" / "programqpc.bin").read_bytes()
    assert blob.startswith(LABEL)  # the stand-in's placeholder, labelled as such
    checked = json.loads(blob[len(LABEL):])
    assert checked["compiler"] == "qaic-compile" and checked["sdk"] == "1.22"  # base_version of apps.xml
    assert checked["flags"] == ["-aic-hw", "-convert-to-fp16", "-mxfp6-matmul", "-retained-state"]
    assert checked["values"]["-aic-num-cores"] == "4" and checked["devices"] == 1
    assert set(checked["custom_io"].values()) == {"mxint8"} and len(checked["custom_io"]) == 2 * 2 * 2
    assert checked["specializations"][1] == {"name": "Decode", "symbols": {"batch_size": "4", "seq_len": "1",
                                                                           "ctx_len": "128", "full_batch_size": "4"}}
    assert "batch_index" in checked["inputs"]
    # again: the same bundle and SDK is the same QPC build
    again = hive("compile", MODEL, "--registry", str(pending["reg"]), "--store", str(store), "--json", env=env)
    assert doc(again)[0]["state"] == "skipped" and doc(again)[0]["build_id"] == res["build_id"]


def test_an_older_sdk_gets_the_legacy_specializations_and_qaic_exec(pending, tmp_path):
    store = _qpc_store(pending, tmp_path)
    env = {"HIVE_AOT_QAIC_SDK": str(make_sdk(tmp_path / "sdk", "1.20.2.0"))}
    proc = hive("compile", f"{MODEL}@{pending['doc']['build_id']}", "--recipe", "qaic-tiny", "--registry",
                str(pending["reg"]), "--store", str(store), "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    (res,) = doc(proc)
    m = _manifest(store, "qaic-tiny", res["build_id"])
    cmd = m["build"]["compile"]["command"]
    assert cmd[0] == "qaic-exec" and "-compile-only" in cmd and m["toolchain"]["qaic_apps_sdk"] == "1.20.2.0"
    blob = store / "blobs" / "sha256"
    spec = next(f for f in m["files"] if f["path"] == "compile/specializations.json")
    assert "name" not in json.loads((blob / spec["sha256"][:2] / spec["sha256"]).read_text())["specializations"][0]


def test_a_failing_compiler_publishes_nothing_and_shows_its_stderr(pending, tmp_path):
    store = _qpc_store(pending, tmp_path)
    env = {"HIVE_AOT_QAIC_SDK": str(make_sdk(tmp_path / "sdk")), "STANDIN_FAIL": "out of memory partitioning layer 1"}
    proc = hive("compile", MODEL, "--registry", str(pending["reg"]), "--store", str(store), env=env)
    line = one_error_line(proc)
    assert proc.returncode == 1
    assert "qaic-compile exited with status 1" in line and "out of memory partitioning layer 1" in line
    assert not (store / "refs" / SLUG / "qaic-tiny" / "latest").exists()
    assert len(list((store / "manifests" / SLUG / "qaic-tiny").iterdir())) == 1  # the bundle only


def test_on_an_sdk_host_one_build_goes_from_the_repo_to_the_qpc(pending, tmp_path):
    store = _qpc_store(pending, tmp_path)
    env = {"HIVE_AOT_QAIC_SDK": str(make_sdk(tmp_path / "sdk"))}
    proc = hive("build", str(pending["model"]), "--model-id", MODEL, "--recipe", "qaic-tiny", "--registry",
                str(pending["reg"]), "--store", str(store), "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    d = doc(proc)
    assert d["state"] == "published" and d["format"] == "qpc"
    assert d["bundle"]["build_id"] == pending["doc"]["build_id"] and d["bundle"]["state"] == "skipped"
    ref = json.loads((store / "refs" / SLUG / "qaic-tiny" / "latest").read_text())
    assert ref["build_id"] == d["build_id"]


@pytest.mark.parametrize("shape, message", [
    ({"ctx_len": 1024}, "ctx_len 1024 is beyond the model's 512 positions"),
])
def test_serving_shapes_the_model_cannot_have_are_refused_before_work(tiny_llama, tmp_path, shape, message):
    reg = _config(tmp_path, tiny_llama, Path.cwd(), **shape)
    proc = hive("build", str(tiny_llama), "--model-id", MODEL, "--recipe", "qaic-tiny", "--registry", str(reg),
                "--store", str(tmp_path / "store"))
    assert proc.returncode == 1 and message in one_error_line(proc)
    assert not (tmp_path / "store" / "manifests").exists()


def test_config_refuses_bad_derivations(tmp_path):
    reg = write_test_config(tmp_path, Path.cwd(), gates={})
    path = tmp_path / "recipes" / "qaic-mxfp6.yaml"
    original = yaml.safe_load(path.read_text())
    for change, message in [
        ({"input": "gguf-f16"}, "input: gguf-f16 is a gguf recipe; a qaic recipe reads qaic-export"),
        ({"input": "nope"}, "input: unknown recipe 'nope'"),
        ({"input": None}, "a qaic recipe is built from a qaic-export recipe; name it"),
        ({"options": {**original["options"], "prefill_seq_len": 4096}}, "prefill_seq_len 4096 is larger than ctx_len 2048"),
    ]:
        path.write_text(yaml.safe_dump({**original, **change}))
        proc = hive("registry", "backends", "--registry", str(reg))
        assert proc.returncode != 0 and message in one_error_line(proc), (change, proc.stderr)
    export = tmp_path / "recipes" / "qaic-export.yaml"
    path.write_text(yaml.safe_dump(original))
    export.write_text(yaml.safe_dump({**yaml.safe_load(export.read_text()), "options": {"batch_index": False}}))
    proc = hive("registry", "backends", "--registry", str(reg))
    assert "continuous batching needs an input export with batch_index: true" in one_error_line(proc)


@pytest.mark.skipif(not Path("/opt/qti-aic/exec/qaic-compile").exists() and not Path("/opt/qti-aic/exec/qaic-exec").exists(),
                    reason="the Cloud AI Apps SDK (/opt/qti-aic/exec/qaic-compile) is not installed on this host: "
                           "the real compile runs on AI 100 build hosts only")
def test_real_sdk_compiles_the_bundle(pending, tmp_path):
    """The real compiler on the real bundle (no stand-in): a non-empty programqpc.bin, published as a QPC."""
    store = _qpc_store(pending, tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "HIVE_AOT_QAIC_SDK"}
    proc = hive("compile", MODEL, "--registry", str(pending["reg"]), "--store", str(store), "--json",
                env={**env, "HIVE_AOT_QAIC_SDK": "/opt/qti-aic"})
    assert proc.returncode == 0, proc.stderr
    (res,) = doc(proc)
    m = _manifest(store, "qaic-tiny", res["build_id"])
    program = next(f for f in m["files"] if f["path"] == "qpc/programqpc.bin")
    assert program["size"] > 1024
    blob = store / "blobs" / "sha256" / program["sha256"][:2] / program["sha256"]
    assert not blob.read_bytes().startswith(LABEL)


def test_dagster_wires_the_export_into_the_compile_and_shows_the_prediction(pending, tmp_path):
    """One onboarding run for a model listing only qaic-tiny: the export is built because the compile reads
    it, the check carries the MXFP6/MXINT8 prediction as metadata, and without an SDK the qpc step is
    pending (nothing materialized), the run a success."""
    import dagster as dg

    from pipelines.config.registry import Config
    from pipelines.orchestration.automation import onboard_job
    from pipelines.orchestration.factories import all_recipe_assets, source_assets
    from pipelines.orchestration.resources import HiveResource

    store = _qpc_store(pending, tmp_path)  # export and bundle published: the run reuses both by build id
    reg = pending["reg"]
    assets, checks = all_recipe_assets(Config.load(reg).recipes.values())
    defs = dg.Definitions(assets=source_assets() + assets, asset_checks=checks, jobs=[onboard_job],
                          resources={"hive": HiveResource(registry=str(reg), store=str(store))})
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("models", [MODEL])
    old = os.environ.get("HIVE_AOT_QAIC_SDK")
    os.environ["HIVE_AOT_QAIC_SDK"] = pending["env"]["HIVE_AOT_QAIC_SDK"]
    try:
        result = defs.resolve_job_def("onboard").execute_in_process(partition_key=MODEL, instance=instance,
                                                                    raise_on_error=False)
    finally:
        os.environ.pop("HIVE_AOT_QAIC_SDK") if old is None else os.environ.update(HIVE_AOT_QAIC_SDK=old)
    assert result.success
    mats = {e.asset_key.to_user_string(): e.materialization.metadata for e in result.get_asset_materialization_events()}
    assert mats["published/qaic-export"]["state"].value == "skipped"
    assert mats["published/qaic-tiny"]["state"].value == "compile_pending"
    assert mats["published/qaic-tiny"]["build_id"].value == pending["doc"]["build_id"]
    assert "qpc/qaic-tiny" not in mats and "artifact/gguf-f16" not in mats  # not requested: nothing built
    # the onboarding summary (make demo's table) says the reused bundle was skipped, its compile still pending
    from pipelines.orchestration.onboard import _summarize

    (row,) = _summarize(result, Config.load(reg), MODEL, ["qaic-tiny"])
    assert (row.state, row.skipped, row.build_id) == ("compile_pending", True, pending["doc"]["build_id"])
    evals = {e.asset_key.to_user_string(): e for e in result.get_asset_check_evaluations()
             if e.check_name == "numerical_parity"}
    md = evals["artifact/qaic-tiny"].metadata
    recorded = _manifest(store, "qaic-tiny", pending["doc"]["build_id"])["validation"]["mxfp6"]
    assert md["predicted_top1"].value == recorded["top1"] and md["predicted_kl"].value == recorded["kl"]
    assert md["mxfp6"].value["ppl_delta"] == recorded["ppl_delta"]
    assert evals["artifact/qaic-export"].metadata["ort_top1_agreement"].value == 1.0
    # Red team round two, item 17: the command the UI shows for a pending bundle pinned the bundle's build id, so it
    # could never serve. It names the recipe: once a compile is published, it resolves to the QPC.
    import shlex

    command = mats["published/qaic-tiny"]["serving_command"].value.replace("/models", str(tmp_path / "models"))
    sdk = make_sdk(tmp_path / "sdk", "1.22.0")
    compiled = hive("compile", MODEL, "--registry", str(reg), "--store", str(store), "--json",
                    env={"HIVE_AOT_QAIC_SDK": str(sdk)})
    assert compiled.returncode == 0, compiled.stderr
    served = hive(*shlex.split(command)[1:], "--registry", str(reg), "--dry-run", "--json", "--allow-stand-in")
    assert served.returncode == 0, served.stderr
    plan = doc(served)
    assert plan["build_id"] == doc(compiled)[0]["build_id"] and plan["exec"][:2] == ["vllm", "serve"]
    assert plan["exec_env"]["VLLM_QAIC_QPC_PATH"].endswith("/models/qpc")
    assert not (tmp_path / "models").exists()  # a dry run downloads and writes nothing


def test_an_architecture_outside_the_ai100_matrix_is_refused_in_one_line(tiny_llama, tmp_path):
    reg = _config(tmp_path, tiny_llama, Path.cwd())
    data = yaml.safe_load(reg.read_text())
    data["architectures"] = {"LlamaForCausalLM": {"qaic": False}}
    reg.write_text(yaml.safe_dump(data))
    proc = hive("build", str(tiny_llama), "--model-id", MODEL, "--recipe", "qaic-tiny", "--registry", str(reg),
                "--store", str(tmp_path / "store"))
    line = one_error_line(proc)
    assert proc.returncode == 1 and "not in the AI 100 validated matrix" in line
    assert not (tmp_path / "store" / "manifests").exists()


def _tiny_bert(dest: Path, tokenizer_dir: Path) -> Path:
    """A 2-layer random BertModel with SmolLM2's tokenizer (its vocabulary size), for the embedding path."""
    import torch
    from transformers import BertConfig, BertModel

    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=64, max_position_embeddings=256, initializer_range=0.2),
                      add_pooling_layer=False)
    model.save_pretrained(str(dest))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, dest / name)
    return dest


def test_an_embedding_model_goes_through_export_bundle_and_standin_compile(smollm2_dir, tmp_path):
    """BERT: encoder ONNX with onnxruntime parity, the embedding bundle (one specialization, no KV, no
    custom IO) with its predicted cosine, then the STAND-IN compile and `vllm serve --task embedding`."""
    bert = _tiny_bert(tmp_path / "bert", smollm2_dir)
    reg = write_test_config(tmp_path / "cfg", Path.cwd(), gates={},
                            models=[{"id": "test-org/tiny-bert", "source": str(bert), "recipes": ["qaic-embed-tiny"]}])
    recipe = yaml.safe_load((Path.cwd() / "recipes" / "qaic-embed-mxfp6.yaml").read_text())
    recipe.update(id="qaic-embed-tiny", options={**recipe["options"], "ctx_len": 128, "prefill_seq_len": 128,
                                                 "batch_size": 4, "num_cores": 2})
    (tmp_path / "cfg" / "recipes" / "qaic-embed-tiny.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    store = tmp_path / "store"
    check = doc(hive("check", str(bert), "--model-id", "test-org/tiny-bert", "--hardware", "qaic-ai100", "--json",
                     "--registry", str(reg)))
    assert sorted(check["recipes"]) == ["qaic-embed-mxfp6", "qaic-embed-tiny", "qaic-export"]  # no decoder compile
    proc = hive("build", str(bert), "--model-id", "test-org/tiny-bert", "--recipe", "qaic-embed-tiny", "--registry",
                str(reg), "--store", str(store), "--json", env={"HIVE_AOT_QAIC_SDK": str(tmp_path / "no-sdk")})
    assert proc.returncode == 0, proc.stderr
    d = doc(proc)
    assert d["state"] == "compile_pending"
    slug = "test-org--tiny-bert"
    export = json.loads((store / "manifests" / slug / "qaic-export" / f"{d['input']['build_id']}.json").read_text())
    m = export["validation"]["metrics"]
    assert export["build"]["export"]["encoder"] is True and m["ort_max_abs_delta"] < 1e-4
    assert m["ort_min_cosine"] > 0.9999 and "ort_top1_agreement" not in m  # an embedder has no top-1
    bundle = json.loads((store / "manifests" / slug / "qaic-embed-tiny" / f"{d['build_id']}.json").read_text())
    assert "compile/custom_io.yaml" not in {f["path"] for f in bundle["files"]}
    q = bundle["validation"]["mxfp6"]
    assert q["emulated"] == ["mxfp6 weights"] and 0.9 < q["cosine_min"] < 1.0 and q["sequences"] == 4
    assert bundle["validation"]["metrics"]["predicted_cosine"] == q["cosine_min"]
    env = {"HIVE_AOT_QAIC_SDK": str(make_sdk(tmp_path / "sdk"))}
    proc = hive("compile", "test-org/tiny-bert", "--registry", str(reg), "--store", str(store), "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    (res,) = doc(proc)
    qpc = json.loads((store / "manifests" / slug / "qaic-embed-tiny" / f"{res['build_id']}.json").read_text())
    cmd = qpc["build"]["compile"]["command"]
    assert "-retained-state" not in cmd and not any(a.startswith("-custom-IO") for a in cmd) and "-mxfp6-matmul" in cmd
    pulled = doc(hive("pull", "test-org/tiny-bert", "--target", "vllm-qaic", "--dest", str(tmp_path / "served"),
                      "--store", str(store), "--registry", str(reg), "--json", "--allow-stand-in"))
    argv = pulled["serve_argv"]
    assert argv[argv.index("--task") + 1] == "embedding" and argv[argv.index("--max-num-seqs") + 1] == "4"
    assert argv[argv.index("--max-model-len") + 1] == "128" and "--max-seq-len-to-capture" not in argv
    checked = json.loads((tmp_path / "served" / "qpc" / "programqpc.bin").read_bytes()[len(LABEL):])
    assert checked["specializations"] == [{"name": "Encode", "symbols": {"batch_size": "4", "seq_len": "128"}}]


@pytest.mark.parametrize("config, problem", [
    ({"max_position_embeddings": 512}, "ctx_len 1024 is beyond the model's 512 positions"),
    ({"max_position_embeddings": 514, "model_type": "xlm-roberta", "pad_token_id": 1},
     "ctx_len 1024 is beyond the model's 512 positions"),  # RoBERTa-style positions start at pad + 1
    ({"max_position_embeddings": 131072, "original_max_position_embeddings": 512,
      "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}},
     "beyond the 512 positions longrope serves with its short factors"),
    ({"max_position_embeddings": 4096}, None),
])
def test_serving_shapes_the_exported_graph_cannot_serve(config, problem):
    from types import SimpleNamespace

    from pipelines.targets.qaic import QaicTarget

    ctx = SimpleNamespace(recipe=SimpleNamespace(options={**SHAPE, "ctx_len": 1024}), config=config)
    found = QaicTarget().plan_problems(ctx)
    assert (found == []) if problem is None else (len(found) == 1 and problem in found[0]), found
