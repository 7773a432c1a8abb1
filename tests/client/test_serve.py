"""The serving entrypoint (deploy/serving/entrypoint.sh -> `hive-aot serve`): pull, then exec the manifest's
server, which answers over HTTP from the pulled model; and the serving images' Dockerfiles.

The server here is `tests/support/llama_server_shim.py` named `llama-server` on PATH: llama.cpp's library behind a
tiny HTTP server (labelled stand-in for llama.cpp's server binary, which this host lacks; the model loading
and generation are real). Docker cannot run on these hosts, so the Dockerfiles are checked as text.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from factories import rewrite_published_manifest, write_test_config

from pipelines.config.registry import Config
from pipelines.engine.build import build_and_publish

REPO = Path.cwd()
MODEL = "test-org/served-llama"
SERVING = REPO / "deploy" / "serving"


@pytest.fixture(scope="module")
def store(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    config = Config.load(write_test_config(root / "cfg", REPO))
    res = build_and_publish(str(tiny_llama), "gguf-f16", config, str(root / "store"), MODEL)
    assert res.state == "published"
    return root / "store"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _server_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "llama-server"
    shim.write_text(f"#!{sys.executable}\nimport runpy, sys\nsys.argv[0] = 'llama-server'\n"
                    f"runpy.run_path({str(REPO / 'tests' / 'support' / 'llama_server_shim.py')!r}, run_name='__main__')\n")
    shim.chmod(0o755)
    return bin_dir


def test_the_entrypoint_pulls_then_becomes_the_server(store, tmp_path):
    port = _port()
    dest = tmp_path / "models" / "model"
    env = {**os.environ, "HIVE_AOT_MODEL": MODEL, "HIVE_AOT_STORE": str(store), "HIVE_AOT_MODEL_DIR": str(dest),
           "HIVE_AOT_CACHE": str(tmp_path / "cache"),
           "PATH": f"{_server_bin(tmp_path)}:{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.Popen(["sh", str(SERVING / "entrypoint.sh"), "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_hostile_signal_state)
    # drained while the server runs: a full pipe must never be what stops it
    said: list[str] = []
    drain = threading.Thread(target=lambda: said.extend(proc.stderr), daemon=True)
    drain.start()
    try:
        deadline, health = time.time() + 120, None
        while time.time() < deadline and proc.poll() is None:
            try:
                health = _get(f"http://127.0.0.1:{port}/health")
                break
            except OSError:
                time.sleep(0.3)
        assert health is not None, "".join(said) if proc.poll() is not None else "no answer"
        marker = json.loads((dest / "hive-aot.json").read_text())
        gguf_file = marker["manifest"]["files"][0]["path"]
        # the server is the entrypoint's own process (exec, twice: sh, then hive-aot), on the pulled file
        assert health["pid"] == proc.pid and health["model"] == str(dest / gguf_file)
        out = _get(f"http://127.0.0.1:{port}/completion", {"prompt": "The capital of France is", "n_predict": 6})
        assert isinstance(out["content"], str) and out["tokens_predicted"] > 0
        # As process 1 of a container it must get the runtime's SIGTERM: not ignored, not blocked, from the kernel's
        # own view of the process (what the exec chain inherited, whatever the server's code does)
        masks = _signal_masks(proc.pid)
        for sig in STOP_SIGNALS:
            assert not masks["SigIgn"] & _bit(sig) and not masks["SigBlk"] & _bit(sig), (sig.name, masks)
        proc.send_signal(signal.SIGTERM)  # straight to the server: it is process 1 of the container
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            # say what the kernel shows instead of only timing out
            pytest.fail(f"the server outlived SIGTERM by 60 s: {_process_state(proc.pid)}")
        assert rc == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        drain.join(timeout=10)
    err = "".join(said)
    assert f"hive-aot serve: {MODEL} gguf-f16" in err and "exec llama-server -m " in err


# What a container runtime or an operator sends to stop the server.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _bit(sig: signal.Signals) -> int:
    return 1 << (sig - 1)


def _hostile_signal_state() -> None:
    """The entrypoint started as under nohup or a parent that shields itself: stop signals ignored or blocked.
    Both survive exec; a full suite run once handed the server SIGTERM ignored this way and it outlived
    SIGTERM. `hive-aot serve` must give the server every stop signal at its default."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def _status(proc_dir: Path) -> dict[str, str]:
    """/proc/<pid>/status (or a thread's) as its fields."""
    return dict(line.split(":\t", 1) for line in (proc_dir / "status").read_text().splitlines() if ":\t" in line)


def _signal_masks(pid: int) -> dict[str, int]:
    fields = _status(Path(f"/proc/{pid}"))
    return {k: int(fields[k], 16) for k in ("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")}


def _process_state(pid: int) -> str:
    """State, signal masks and kernel wait channel of each thread of a process, for a failure message."""
    rows = []
    for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
        status = _status(task)
        wchan = (task / "wchan").read_text() if (task / "wchan").exists() else "?"
        rows.append(f"{task.name}: {status.get('State')} wchan={wchan} blk={status.get('SigBlk')} "
                    f"pnd={status.get('SigPnd')}")
    return f"masks {_signal_masks(pid)}; threads: " + "; ".join(rows)


def test_serve_without_the_engine_is_one_line(store, tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HIVE_AOT_CACHE": str(tmp_path / "c")}
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "serve", MODEL, "--target", "llm-llamacpp-cpu",
                           "--dest", str(tmp_path / "m"), "--store", str(store)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hive-aot: error: cannot start llama-server: not found on PATH"), proc.stderr
    assert (tmp_path / "m" / "hive-aot.json").is_file()  # pulled all the same: the error says where


def test_dry_run_prints_the_command_with_the_extra_arguments(store, tmp_path, capsys):
    from pipelines.cli.main import main

    assert main(["serve", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(tmp_path / "m"), "--store", str(store),
                 "--dry-run", "--json", "--", "--port", "9000"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["exec"][:2] == ["llama-server", "-m"] and doc["exec"][-2:] == ["--port", "9000"]
    with pytest.raises(SystemExit):  # `--` belongs to serve only: argparse's usage error
        main(["ls", "--", "--port", "1"])


@pytest.mark.parametrize("image", ["llamacpp", "vllm", "vllm-qaic"])
def test_the_images_run_the_entrypoint_as_an_unprivileged_user(image):
    text = (SERVING / image / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")  # the last USER before ENTRYPOINT is who serves
    assert text.index(f"USER {users[-1]}") < text.index("ENTRYPOINT")
    assert 'ENTRYPOINT ["/usr/local/bin/hive-aot-entrypoint"]' in text
    assert "COPY --chmod=755 deploy/serving/entrypoint.sh /usr/local/bin/hive-aot-entrypoint" in text
    assert re.search(r"pip install --no-cache-dir hive-aot\b", text)


def _rewrite_serving(src: Path, dst: Path, **fields) -> None:
    """An unsigned store whose profile's serving fields someone with write access changed (ref sha fixed)."""
    import shutil

    shutil.copytree(src, dst)
    rewrite_published_manifest(dst, "gguf-f16", lambda doc: doc["serving"]["llm-llamacpp-cpu"].update(fields))


GOOD = ["llama-server", "-m", "{model_dir}/PLACEHOLDER", "-c", "512"]
HOSTILE = {  # red team round two, items 5 and 11: each of these ran, or ended in a traceback
    "sh -c": {"command": ["sh", "-c", "touch {model_dir}/../PWNED"]},
    "python -c": {"command": ["python3", "-c", "open('PWNED', 'w')"]},
    "a shipped script": {"command": ["{model_dir}/PLACEHOLDER"]},
    "a path as argv0": {"command": ["/usr/bin/llama-server", "-m", "{model_dir}/PLACEHOLDER"]},
    "an unknown flag": {"command": GOOD + ["--lora", "{model_dir}/PLACEHOLDER"]},
    "a model outside": {"command": ["llama-server", "-m", "/etc/passwd"]},
    "an option as value": {"command": ["llama-server", "-c", "--lora"]},
    "remote code unsigned": {"command": ["vllm", "serve", "{model_dir}", "--trust-remote-code"]},
    "vllm elsewhere": {"command": ["vllm", "serve", "/tmp", "--dtype", "auto"]},
    "LD_PRELOAD": {"command": GOOD, "env": {"LD_PRELOAD": "{model_dir}/PLACEHOLDER"}},
    "env key with =": {"command": GOOD, "env": {"A=B": "1"}},
    "empty env key": {"command": GOOD, "env": {"": "1"}},
    "NUL in env": {"command": GOOD, "env": {"HF_HUB_OFFLINE": "1\u0000"}},
    "env as a list": {"command": GOOD, "env": ["LD_PRELOAD=/x.so"]},
    "empty argv0": {"command": [""]},
    "NUL in argv": {"command": ["llama-server", "-m", "{model_dir}/PLACEHOLDER\u0000"]},
    "argv too long": {"command": ["llama-server"] + ["-c", "1"] * 300},
    "a string command": {"command": "sh -c id"},
    "a number in argv": {"command": ["llama-server", "-c", 512]},
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_serve_runs_only_the_kinds_own_server_with_its_own_arguments(case, store, tmp_path, capsys):
    from pipelines.cli.main import main

    fields = json.loads(json.dumps(HOSTILE[case]).replace("PLACEHOLDER", _gguf_name(store)))
    hostile = tmp_path / "store"
    _rewrite_serving(store, hostile, **fields)
    capsys.readouterr()
    rc = main(["serve", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(tmp_path / "m"), "--store", str(hostile),
               "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "hive-aot: error: " in err and "Traceback" not in err, err
    assert not (tmp_path / "PWNED").exists() and not Path("PWNED").exists()
    # pull itself still pulls (the files are verified), and says that serve would refuse the command
    assert main(["pull", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(tmp_path / "p"), "--store",
                 str(hostile), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["serve_refused"]


def _gguf_name(store: Path) -> str:
    doc = json.loads(next(store.glob("manifests/*/gguf-f16/*.json")).read_text())
    return doc["files"][0]["path"]


def test_the_operator_pins_the_engine_and_allows_env_names(store, tmp_path, capsys, monkeypatch):
    from pipelines.cli.main import main

    hostile = tmp_path / "store"
    _rewrite_serving(store, hostile, env={"OMP_NUM_THREADS": "4"})
    pinned = _server_bin(tmp_path) / "llama-server"
    monkeypatch.setenv("HIVE_AOT_SERVE_PROGRAMS", f"llama-server={pinned}")
    monkeypatch.setenv("HIVE_AOT_SERVE_ENV", "OMP_NUM_THREADS")
    capsys.readouterr()
    assert main(["serve", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(tmp_path / "m"), "--store",
                 str(hostile), "--dry-run", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["exec_program"] == str(pinned) and doc["exec_env"] == {"OMP_NUM_THREADS": "4"}
    monkeypatch.delenv("HIVE_AOT_SERVE_ENV")
    assert main(["serve", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(tmp_path / "n"), "--store",
                 str(hostile), "--dry-run"]) == 1
    assert "sets OMP_NUM_THREADS for llama-server, which hive-aot never sets" in capsys.readouterr().err


def test_remote_code_from_an_unsigned_manifest_needs_the_operators_flag(store, tmp_path, capsys):
    from pipelines.cli.main import main

    hostile = tmp_path / "store"
    _rewrite_serving(store, hostile, command=["vllm", "serve", "{model_dir}", "--trust-remote-code"])
    args = ["serve", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(tmp_path / "m"), "--store", str(hostile),
            "--dry-run", "--json"]
    capsys.readouterr()
    assert main(args) == 1
    assert "--allow-remote-code" in capsys.readouterr().err
    assert main([*args, "--allow-remote-code"]) == 0
    assert json.loads(capsys.readouterr().out)["exec"][-1] == "--trust-remote-code"
