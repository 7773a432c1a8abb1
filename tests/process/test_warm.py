"""Warm engine processes (pipelines/process/warm.py): a server imports once and forks a child per job. The child must
behave as a fresh process would: the job's argv, environment, working directory and output; its exit status
(a signal as a negative status); a timeout kills it; a client that goes away takes its job with it; a server
that cannot start means a fresh process, never a failure. Entries here are small stdlib scripts."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipelines.process import warm

ENTRY = textwrap.dedent('''
    import json, os, sys, time

    PRELOADED = []

    def preload():
        PRELOADED.append(os.getpid())

    def other_preload():
        PRELOADED.append(-os.getpid())

    PREPARED = []

    def prepare(argv):
        if argv[1] == "nonsense":
            raise ValueError("prepare cannot either")
        PREPARED.append([os.getpid(), argv[2]])

    def main(argv):
        mode = argv[1]
        if mode == "report":
            print(json.dumps({"argv": argv, "cwd": os.getcwd(), "value": os.environ.get("WARM_TEST_VALUE"),
                              "preloaded_by": PRELOADED, "prepared": PREPARED, "server": os.getppid(),
                              "session": os.getsid(0) == os.getpid()}))
            return int(argv[2])
        if mode == "signal":
            os.kill(os.getpid(), 9)
        if mode == "block":  # says it started through the FIFO, then waits for ever
            with open(argv[2], "w") as f:
                f.write(str(os.getpid()))
            while True:
                time.sleep(60)
        if mode == "memory":
            block = bytearray(int(argv[2]) << 20)
            block[::4096] = b"x" * len(block[::4096])
            return 0
        raise ValueError("no mode " + mode)
''')


@pytest.fixture
def entry(tmp_path) -> Path:
    path = tmp_path / "entry.py"
    path.write_text(ENTRY)
    return path


@pytest.fixture
def warm_dir(monkeypatch):
    """A short directory of its own (a socket path holds 108 bytes), its servers stopped at the end."""
    import tempfile

    directory = Path(tempfile.mkdtemp(prefix="warm-test-"))
    monkeypatch.setenv(warm.WARM_DIR_ENV, str(directory))
    yield directory
    warm.stop_all(directory)


def _run(entry: Path, tmp_path: Path, *argv: str, env: dict | None = None, timeout: float | None = 60, **kw):
    """warm.run with the job's stdout and stderr in a file of its own: (its result, the file)."""
    out = tmp_path / f"out-{len(list(tmp_path.glob('out-*')))}.log"
    with open(out, "w") as f:
        done = warm.run(sys.executable, str(entry), [str(entry), *argv], cwd=tmp_path, env=env or dict(os.environ),
                        output=f.fileno(), timeout=timeout, **kw)
    return done, out


def _gone(pid: int, timeout: float) -> bool:
    """Whether process `pid` ends within `timeout` (a pidfd: the kernel says when, nothing polls)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def test_off_without_a_warm_dir(entry, tmp_path, monkeypatch):
    monkeypatch.delenv(warm.WARM_DIR_ENV, raising=False)
    assert _run(entry, tmp_path, "report", "0") == (None, tmp_path / "out-0.log")


def test_a_job_gets_its_own_argv_env_cwd_and_output_and_the_server_is_reused(entry, tmp_path, warm_dir):
    (rc, peak), out = _run(entry, tmp_path, "report", "3", env={**os.environ, "WARM_TEST_VALUE": "one"})
    first = json.loads(out.read_text())
    assert rc == 3 and peak > 1 << 20
    assert first["argv"] == [str(entry), "report", "3"] and first["cwd"] == str(tmp_path) and first["value"] == "one"
    assert first["session"]  # its own session: a kill of its group reaches nothing else
    (rc, _), out = _run(entry, tmp_path, "report", "0", env={**os.environ, "WARM_TEST_VALUE": "two"})
    second = json.loads(out.read_text())
    assert rc == 0 and second["value"] == "two"
    # one server, preloaded once, forked both
    assert first["server"] == second["server"] == first["preloaded_by"][0] and len(second["preloaded_by"]) == 1
    # the entry's prepare ran in the server before each fork, with the job's argv
    assert second["prepared"] == [[first["server"], "3"], [first["server"], "0"]]
    assert [p.name[:len("entry-preload-")] for p in warm_dir.glob("*.sock")] == ["entry-preload-"]
    # another preload, or another value of an import-time variable, is another server
    (_, _), out = _run(entry, tmp_path, "report", "0", preload="other_preload")
    assert json.loads(out.read_text())["preloaded_by"][0] < 0
    (_, _), out = _run(entry, tmp_path, "report", "0", env={**os.environ, "OMP_NUM_THREADS": "7"})
    assert json.loads(out.read_text())["server"] != first["server"]
    assert len(list(warm_dir.glob("*.sock"))) == 3


def test_a_signal_and_an_exception_read_as_a_fresh_process_would(entry, tmp_path, warm_dir):
    (rc, _), _ = _run(entry, tmp_path, "signal")
    assert rc == -signal.SIGKILL
    (rc, _), out = _run(entry, tmp_path, "nonsense")
    assert rc == 1 and "ValueError: no mode nonsense" in out.read_text()
    # a prepare that raised ("nonsense" above) left the server serving, and the job ran
    (rc, _), out = _run(entry, tmp_path, "report", "0")
    assert rc == 0 and len(list(warm_dir.glob("*.sock"))) == 1


def test_the_peak_is_the_childs_own(entry, tmp_path, warm_dir):
    (_, small), _ = _run(entry, tmp_path, "memory", "1")
    (_, large), _ = _run(entry, tmp_path, "memory", "200")
    assert 190 << 20 <= large - small <= 230 << 20


def test_a_job_past_its_timeout_is_killed(entry, tmp_path, warm_dir):
    fifo = tmp_path / "started"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            _run(entry, tmp_path, "block", str(fifo), timeout=2)
        pid = int(os.read(reader, 64))
    finally:
        os.close(reader)
    assert _gone(pid, 30)


def test_a_client_that_goes_away_takes_its_job_with_it(entry, tmp_path, warm_dir):
    fifo = tmp_path / "started"
    os.mkfifo(fifo)
    client = subprocess.Popen([sys.executable, "-c", (
        "import os, sys; from pathlib import Path; from pipelines.process import warm; "
        f"warm.run(sys.executable, {str(entry)!r}, [{str(entry)!r}, 'block', {str(fifo)!r}], cwd=Path('/'), "
        "env=dict(os.environ), timeout=None)")],
        cwd=Path.cwd(), env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    with open(fifo) as started:  # blocks until the job has started
        pid = int(started.read())
    client.kill()
    client.wait()
    assert _gone(pid, 30)
    # the server lives on and serves the next job
    (rc, _), _ = _run(entry, tmp_path, "report", "0")
    assert rc == 0


def test_a_server_that_cannot_start_means_a_fresh_process(tmp_path, warm_dir):
    broken = tmp_path / "broken.py"
    broken.write_text("def preload():\n    raise ImportError('no engine here')\n\ndef main(argv):\n    return 0\n")
    assert _run(broken, tmp_path, "x")[0] is None
    assert "no engine here" in next(warm_dir.glob("broken-*.log")).read_text()
    assert not list(warm_dir.glob("*.sock")) and not list(warm_dir.glob("*.pid"))


def test_an_idle_server_exits_and_a_stale_socket_is_replaced(entry, tmp_path, warm_dir, monkeypatch):
    monkeypatch.setenv(warm.IDLE_ENV, "1")
    (_, _), out = _run(entry, tmp_path, "report", "0")
    server = json.loads(out.read_text())["server"]
    assert _gone(server, 30)
    assert not list(warm_dir.glob("*.sock"))  # it removed its socket
    sock = warm.server_socket(warm_dir, sys.executable, str(entry), "preload", dict(os.environ))
    sock.write_text("")  # a dead server's leftover: not a socket
    (rc, _), out = _run(entry, tmp_path, "report", "0")
    assert rc == 0 and json.loads(out.read_text())["server"] != server


def test_isolated_children_are_forked_warm_with_the_same_results(warm_dir, monkeypatch):
    from pipelines.core.errors import EngineCrashed
    from pipelines.process.isolation import run_isolated

    assert run_isolated(os.path.relpath, engine="e", step="s", path="x/y", start="x") == "y"
    monkeypatch.setenv("HIVE_AOT_FAULT", "GGUF validation:segv")
    with pytest.raises(EngineCrashed, match=r"^llama.cpp crashed with SIGSEGV \(segmentation fault\) during GGUF"):
        run_isolated(os.path.relpath, engine="llama.cpp", step="GGUF validation of a/b", path="x")
    assert [p.name.split("-")[1] for p in warm_dir.glob("isolation-*.sock")] == ["preload"]


def test_a_warm_dir_others_can_enter_is_not_used(entry, tmp_path, monkeypatch, capfd):
    """Whoever reaches a server's socket runs code as this user: a directory open to others means fresh processes."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    monkeypatch.setenv(warm.WARM_DIR_ENV, str(shared))
    assert _run(entry, tmp_path, "report", "0")[0] is None
    assert "not a directory of this user's alone" in capfd.readouterr().err
    assert list(shared.iterdir()) == []


def test_a_servers_socket_is_this_users_only(entry, tmp_path, warm_dir):
    _run(entry, tmp_path, "report", "0")
    (sock,) = warm_dir.glob("*.sock")
    assert sock.stat().st_mode & 0o077 == 0 and warm_dir.stat().st_mode & 0o077 == 0


def test_two_protocol_lines_that_arrive_together_are_read_one_at_a_time():
    """A quick job's "done" can reach the socket before its client read "started" (a full run saw it)."""
    import socket

    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(b'{"pid": 7}\n{"status": 0, "maxrss": 1}\n')
        theirs.shutdown(socket.SHUT_WR)
        assert warm._read_line(ours) == b'{"pid": 7}\n'
        assert warm._read_line(ours) == b'{"status": 0, "maxrss": 1}\n'
        assert warm._read_line(ours) == b""
