"""Native engines run in a child process: a crash is one error line naming engine, signal and step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import child_helpers
import pytest
from factories import write_test_config

from pipelines.core.errors import EngineCrashed, EngineFailed, ModelFormatError
from pipelines.process.isolation import run_isolated

REPO = Path.cwd()
SUPPORT = Path(__file__).resolve().parents[1] / "support"  # child_helpers.py


@pytest.fixture(params=["warm", "fresh"])
def child_start(request, monkeypatch):
    """Twice: the child forked by the session's warm server, and a fresh interpreter."""
    if request.param == "fresh":
        from pipelines.process import warm

        monkeypatch.delenv(warm.WARM_DIR_ENV, raising=False)
    return request.param


@pytest.mark.usefixtures("child_start")
def test_result_and_errors_cross_as_json(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(SUPPORT))  # child_helpers.py
    # os.path.relpath runs in the child: a real function, a JSON result
    assert run_isolated(os.path.relpath, engine="e", step="s", path="x/y", start="x") == "y"
    # a HiveError comes back as the same class with the same line
    with pytest.raises(ModelFormatError, match=r"^config.json is not valid JSON \(x\)$"):
        run_isolated(child_helpers.raise_exception, engine="e", step="s",
                     kind="ModelFormatError", message="config.json is not valid JSON (x)")
    # anything else becomes EngineFailed naming the engine, the step and the type
    with pytest.raises(EngineFailed, match=r"^llama.cpp failed during the step: ValueError: bad\s*value$"):
        run_isolated(child_helpers.raise_exception, engine="llama.cpp", step="the step",
                     kind="ValueError", message="bad\nvalue")


def test_a_warm_server_learns_the_module_of_a_jobs_function(monkeypatch, child_start):
    """The server imports the module of a job's function before it forks (isolation.prepare): the first job of
    that function forks with it imported, and so does every later one; a fresh child imports it itself."""
    monkeypatch.setenv("PYTHONPATH", str(SUPPORT))
    first = run_isolated(child_helpers.who_imported, engine="e", step="s")
    second = run_isolated(child_helpers.who_imported, engine="e", step="s")
    if child_start == "fresh":
        assert first["imported_by"] == first["pid"] and second["imported_by"] == second["pid"]
    else:
        assert first["imported_by"] == first["parent"] == second["imported_by"] == second["parent"]
        assert first["pid"] != second["pid"]


@pytest.mark.usefixtures("child_start")
def test_a_full_disk_in_the_child_is_the_disk_full_line(monkeypatch, tmp_path):
    from pipelines.core.errors import DiskFull

    monkeypatch.setenv("PYTHONPATH", str(SUPPORT))
    with pytest.raises(DiskFull, match=r"^llama logits: disk full \(no space left on device\) writing under "
                                       + str(tmp_path).replace(".", r"\.") + r" \(.* free\); partial files removed"):
        run_isolated(child_helpers.fill_the_disk, engine="llama.cpp", step="llama logits", path=str(tmp_path / "l0.npy"))


@pytest.mark.usefixtures("child_start")
@pytest.mark.parametrize("fault, signame", [("SIGILL", "SIGILL"), ("segv", "SIGSEGV"), ("SIGABRT", "SIGABRT")])
def test_native_crash_becomes_one_line(monkeypatch, fault, signame):
    monkeypatch.setenv("HIVE_AOT_FAULT", f"GGUF validation:{fault}")
    with pytest.raises(EngineCrashed) as ei:
        run_isolated(os.path.relpath, engine="llama.cpp", step="GGUF validation of a/b (gguf-f16)", path="x")
    msg = str(ei.value)
    assert "\n" not in msg and ei.value.exit_code == 6
    assert msg.startswith(f"llama.cpp crashed with {signame} (")
    assert msg.endswith("during GGUF validation of a/b (gguf-f16); nothing was published")
    # the fault is scoped to the named step: others run normally
    assert run_isolated(os.path.relpath, engine="llama.cpp", step="Q4_K_M quantization", path="x") == "x"


@pytest.mark.usefixtures("child_start")
def test_child_exit_without_result_is_reported(monkeypatch):
    with pytest.raises(EngineCrashed, match=r"^eng exited with status 3 during st without a result"):
        run_isolated(os._exit, engine="eng", step="st", status=3)


def test_build_whose_validation_crashes_publishes_nothing(tiny_llama, tmp_path):
    """Through the CLI, as a user sees it: the crash of llama.cpp in GGUF validation is one line, exit 6."""
    store = tmp_path / "store"
    reg = write_test_config(tmp_path / "cfg", REPO)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HIVE_AOT_FAULT": "GGUF validation:SIGILL",
           "HIVE_AOT_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "build", str(tiny_llama), "--recipe", "gguf-f16",
                           "--model-id", "test-org/crashy", "--store", str(store), "--registry", str(reg)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 6, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hive-aot: error: ")]
    assert errors == ["hive-aot: error: llama.cpp crashed with SIGILL (illegal instruction: the library uses CPU "
                      "instructions this host lacks) during GGUF validation of test-org/crashy (gguf-f16); "
                      "nothing was published"], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (store / "manifests").exists() and not (store / "refs").exists()
    # a candidate whose validation crashed can never be published as it is: its record is gone too
    assert list((store / "staging").glob("*.json")) == []
    # and no scratch directory of the build, the validation or the child stays behind
    assert [p.name for p in (Path(env["HIVE_AOT_CACHE"]) / "work").iterdir()] == []


def test_only_a_module_level_function_is_run_and_it_is_named_by_its_module():
    from pipelines.process.isolation import importable_name
    from pipelines.validation.reference import compute_into

    assert importable_name(compute_into) == "pipelines.validation.reference:compute_into"
    assert importable_name(os.path.relpath) == f"{os.path.relpath.__module__}:relpath"

    def nested() -> None:
        pass

    with pytest.raises(TypeError, match="module-level functions only"):
        run_isolated(nested, engine="e", step="s")
