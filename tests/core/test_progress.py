"""What a build tells its operator while it runs (pipelines/core/progress.py): one start and one end line per step,
with elapsed time and peak memory, wherever stderr goes; bars with an ETA on a terminal; nothing with --quiet;
the same lines in a Dagster run's log."""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import dagster as dg
import pytest
from factories import copy_model, poison_weights, write_test_config

from pipelines.cli.main import main

REPO = Path.cwd()
LINE = re.compile(r"^hive-aot: \[(?P<step>[^\]]+)\] (?:(?P<start>start)|(?P<end>done in|failed after) "
                  r"(?P<seconds>\d+\.\d) s(?:, peak (?P<peak>\d+\.\d [KMG]iB))?"
                  r"(?:, (?P<flops>\d+\.\d) GFLOP/s)?(?:, (?P<rate>\d+(?:\.\d)? (?:B|[KMGTPE]iB))/s)?)$")
# a tqdm bar with its counter and its ETA: "reference:  35%|████▉      | 33/95 [00:01<00:02, 21.95unit/s]" (the
# ETA is "?" until a rate is known)
BAR = re.compile(r"(?P<desc>[\w.][\w. ]*): +\d+%\|[^|\r\n]*\| *[\d.]+[KMG]?/[\d.]+[KMG]? "
                 r"\[\d\d:\d\d<(?P<eta>\d\d:\d\d|\?)")


def on_a_terminal(args: list[str], cache: Path) -> tuple[int, str]:
    """The CLI with stderr on a pseudo-terminal of 120 columns (a window size, as a real one has: tqdm draws
    nothing in zero columns); returns its exit status and everything it drew there."""
    import pty

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    with subprocess.Popen([sys.executable, "-m", "pipelines.cli", *args], cwd=REPO, stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=slave,
                          env={**os.environ, "PYTHONPATH": str(REPO), "HIVE_AOT_CACHE": str(cache)}) as proc:
        os.close(slave)
        drawn = []
        while True:
            if not select.select([master], [], [], 1)[0]:
                if proc.poll() is not None:  # ended, and nothing more to read (a process it left may hold the pty)
                    break
                continue
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # EIO: every writer of the terminal has closed it
                break
            if not chunk:
                break
            drawn.append(chunk)
        os.close(master)
    return proc.returncode, b"".join(drawn).decode("utf-8", "replace")


def steps_of(lines: list[str]) -> dict[str, dict]:
    """Each step's start and end line, checked to nest like the steps themselves: one start, then one end."""
    steps: dict[str, dict] = {}
    open_steps: list[str] = []
    for line in lines:
        m = LINE.match(line)
        assert m, f"not a step line: {line!r}"
        name = m["step"]
        if m["start"]:
            assert name not in steps, f"{name} started twice"
            steps[name] = {}
            open_steps.append(name)
        else:
            assert open_steps and open_steps[-1] == name, f"{name} ended out of order: {lines}"
            open_steps.pop()
            steps[name] = {"how": m["end"], "seconds": float(m["seconds"]), "line": line, "flops": m["flops"],
                           "rate": m["rate"]}
    assert not open_steps, f"never ended: {open_steps}"
    return steps


def test_a_step_reports_what_it_used_with_its_nested_steps_and_measures_only_its_own(capfd):
    """The reported peak covers the steps nested in it (what the operator waited for); the measurement the build
    records beside its memory plan stays each step's own (meter.py)."""
    import numpy as np

    from pipelines.core import meter

    meter.reset()
    with meter.step("validate"):
        with meter.step("reference"):
            block = np.ones(200 * 2**20 // 8)  # 200 MiB touched inside the nested step only
            del block
        with meter.step("validate", label="engine check"):
            pass
    measured = meter.measured()
    lines = capfd.readouterr().err.splitlines()
    assert list(steps_of(lines)) == ["validate", "reference", "engine check"]
    peaks = {m["step"]: _bytes(m["peak"]) for m in map(LINE.match, lines) if m["end"]}
    assert peaks["validate"] >= peaks["reference"] >= measured["reference"] - 2**20
    assert measured["validate"] < measured["reference"] - 150 * 2**20  # exclusive: the allocation is not its own
    meter.reset()


def _bytes(peak: str) -> float:
    number, unit = peak.split()
    return float(number) * {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("progress")
    return {"root": root, "registry": str(write_test_config(root / "cfg", REPO)), "store": root / "store"}


def test_a_build_into_a_file_says_when_each_step_starts_and_ends(setup, tiny_llama, capfd, monkeypatch):
    """stderr a file (capfd's): the CLI in this process, with a cache of its own so that the source is hashed and
    the reference computed again, and every step of the build runs."""
    monkeypatch.setenv("HIVE_AOT_CACHE", str(setup["root"] / "cache-file"))
    monkeypatch.delenv("HIVE_AOT_PROGRESS", raising=False)
    rc = main(["build", str(tiny_llama), "--recipe", "gguf-f16", "--model-id", "test/progress", "--store",
               str(setup["store"]), "--registry", setup["registry"], "--json"])
    said = capfd.readouterr()
    text = said.err
    assert rc == 0, text
    assert "\r" not in text and "%|" not in text  # no bar into a file
    steps = steps_of(text.splitlines())
    assert set(steps) == {"hash source", *(f"gguf-f16: {s}" for s in ("convert", "upload", "validate", "reference",
                                                                       "llama.cpp check", "publish"))}
    assert all(s["how"] == "done in" and ", peak " in s["line"] for s in steps.values())
    # a step's time includes the steps nested in it (each figure is rounded to a tenth)
    validate = steps["gguf-f16: validate"]["seconds"]
    assert validate >= steps["gguf-f16: reference"]["seconds"] + steps["gguf-f16: llama.cpp check"]["seconds"] - 0.2
    # the steps that did countable work say their rate: bytes read or uploaded, a forward pass's FLOPs
    assert {name for name, s in steps.items() if s["rate"]} == {"gguf-f16: convert", "gguf-f16: upload"}
    assert {name for name, s in steps.items() if s["flops"]} == {"gguf-f16: reference", "gguf-f16: llama.cpp check"}
    # and the build records them per plan step: the source's bytes for the conversion, the artifact's for publish
    rates = json.loads(said.out)["step_rates"]
    assert set(rates) == {"convert", "publish", "reference", "validate"}
    source = sum(f.stat().st_size for f in tiny_llama.glob("*.safetensors"))
    assert rates["convert"]["bytes"] == source and rates["convert"]["bytes_per_s"] > 0
    assert rates["publish"]["bytes"] == sum(f["size"] for f in json.loads(said.out)["files"])
    assert rates["reference"]["flop"] > 0 and rates["validate"]["flop"] > 0


def test_on_a_terminal_the_long_steps_draw_bars_with_an_eta(setup, tiny_llama):
    rc, drawn = on_a_terminal(["build", str(tiny_llama), "--recipe", "gguf-q8_0", "--model-id", "test/progress",
                               "--store", str(setup["store"]), "--registry", setup["registry"]],
                              setup["root"] / "cache-terminal")
    assert rc == 0, drawn[-3000:]
    bars = {m["desc"].strip() for m in BAR.finditer(drawn)}
    assert {"gguf q8_0", "upload", "reference", "llama.cpp check"} <= bars, (bars, drawn[-3000:])
    assert "reference" in {m["desc"].strip() for m in BAR.finditer(drawn) if m["eta"] != "?"}
    # the step lines are still there, each written over the bars and never torn by them
    lines = [line.split("\r")[-1] for line in drawn.split("\r\n") if "hive-aot: [" in line]
    assert set(steps_of(lines)) >= {"gguf-q8_0: convert", "gguf-q8_0: reference", "gguf-q8_0: publish"}


def test_a_failed_step_says_so_before_the_error_line(setup, tiny_llama, tmp_path, capfd):
    nan = copy_model(tiny_llama, tmp_path / "nan")
    poison_weights(nan)  # refused while converting
    rc = main(["build", str(nan), "--recipe", "gguf-f16", "--model-id", "test/nan", "--store", str(setup["store"]),
               "--registry", setup["registry"]])
    lines = capfd.readouterr().err.strip().splitlines()
    assert rc == 1 and lines[-1].startswith("hive-aot: error: ") and "non-finite" in lines[-1], lines
    steps = steps_of(lines[:-1])
    assert steps["gguf-f16: convert"]["how"] == "failed after"


def test_quiet_says_nothing_but_the_result(setup, tiny_llama, capfd):
    rc = main(["build", str(tiny_llama), "--recipe", "gguf-f16", "--model-id", "test/quiet", "--store",
               str(setup["store"]), "--registry", setup["registry"], "--quiet"])
    out, err = capfd.readouterr()
    assert rc == 0 and out.startswith("published gguf-f16 for test/quiet")
    assert err == ""
    assert "HIVE_AOT_QUIET" not in os.environ  # only for the command it was given to


def test_the_dagster_run_log_gets_the_step_lines(tiny_llama, tmp_path):
    """The snapshot asset of a source never hashed before: its hashing step's lines, in the run's own log."""
    from pipelines.orchestration.factories import source_assets
    from pipelines.orchestration.resources import HiveResource

    model = copy_model(tiny_llama, tmp_path / "fresh")  # another path: the digest cache knows nothing of it
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("models", ["test/fresh"])
    reg = write_test_config(tmp_path / "cfg", REPO, models=[{"id": "test/fresh", "source": str(model),
                                                             "recipes": ["gguf-f16"]}])
    snapshot = next(a for a in source_assets() if a.key == dg.AssetKey(["snapshot"]))
    result = dg.materialize([snapshot], partition_key="test/fresh", instance=instance,
                            resources={"hive": HiveResource(registry=str(reg), store=str(tmp_path / "store"))})
    assert result.success
    logged = [e.user_message for e in instance.all_logs(result.run_id) if e.step_key == "snapshot"]
    assert "[hash source] start" in logged, logged
    assert any(re.fullmatch(r"\[hash source\] done in \d+\.\d s(, peak .*)?", m) for m in logged), logged
