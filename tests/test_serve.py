"""The serving entrypoint (deploy/serving/entrypoint.sh -> `hive-aot serve`): pull, then exec the manifest's
server, which answers over HTTP from the pulled model; and the serving images' Dockerfiles.

The server here is `tests/llama_server_shim.py` named `llama-server` on PATH: llama.cpp's library behind a
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

from factories import write_test_config
from pipelines.build import build_and_publish
from pipelines.config import Config

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
                    f"runpy.run_path({str(REPO / 'tests' / 'llama_server_shim.py')!r}, run_name='__main__')\n")
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
    from pipelines.cli import main

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
