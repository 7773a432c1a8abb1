"""Warm engine processes: a server that has imported an engine once forks a fresh child for each job.

Starting vLLM on two cores spends about 11 s importing it (torch, transformers, its model registry) before it
reads a byte of the model, and a host that checks several artifacts pays that on every check. A warm server
imports once (a preload function of the entry: `preload()` unless the job names another), then forks one
child per job. An entry's `prepare(argv)`, when it has one, runs in the server before each fork, so a server
learns the imports its jobs need (the isolation entry imports the job's function module there). The child is a
fork of a process that has only imported (no model loaded, no thread pool started); it takes the job's own
environment and working directory, writes to the client's own stdout and stderr (passed over the socket), runs
in its own session, and calls the entry's `main(argv)`. An entry is a script file (`*.py`, run by path: the vLLM
runner) or a module name (imported: the isolation module). Its exit status
(negative for a signal) and its peak resident set come back as a fresh process's would, from wait4.

Opt-in: `HIVE_AOT_WARM_DIR` names a directory for the servers' sockets, logs and pid files; unset, every job is
a fresh process. One server serves one (interpreter, entry and its content, preload, import-time environment)
and exits after `HIVE_AOT_WARM_IDLE` seconds (default 600) without a job. A job whose client goes away (killed
with its build) is killed with it.

Standard library only, and nothing of hive-aot: the server runs under other venvs' interpreters (the vLLM
venv has no hive-aot), as `python warm.py serve SOCKET ENTRY PRELOAD IDLE READY_FD`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

WARM_DIR_ENV = "HIVE_AOT_WARM_DIR"
IDLE_ENV = "HIVE_AOT_WARM_IDLE"
# What a server's imports may have read from the environment when it started: a job whose values differ
# gets a server of its own.
IMPORT_TIME_PREFIXES = ("VLLM_", "OMP_", "MKL_", "KMP_", "HF_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "CUDA_",
                        "TOKENIZERS_", "LD_", "PYTHON")
SOCKET_PATH_MAX = 100  # sun_path holds 108 bytes on Linux
START_TIMEOUT_S = 300


# --- the client (hive-aot's side) -----------------------------------------------------------------------------

def warm_dir() -> Path | None:
    value = _settings().WARM_DIR.get()
    return Path(value) if value else None


def _settings():
    """hive-aot's settings, imported by the client only: the server runs this file as a script, outside the package."""
    from ..core import settings

    return settings


def _entry_file(entry: str) -> Path:
    if entry.endswith(".py"):
        return Path(entry)
    import importlib.util

    spec = importlib.util.find_spec(entry)
    if spec is None or not spec.origin:
        raise ImportError(f"no module {entry}")
    return Path(spec.origin)


def server_socket(directory: Path, python: str, entry: str, preload: str, env: dict[str, str]) -> Path:
    """The socket of the server for this interpreter, this entry's content and these import-time variables."""
    imported = sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES))
    # a module entry imports as `python -m` would, the working directory first on sys.path
    where = "" if entry.endswith(".py") else os.getcwd()
    key = json.dumps([python, entry, preload, where, hashlib.sha256(_entry_file(entry).read_bytes()).hexdigest(), imported,
                      hashlib.sha256(Path(__file__).read_bytes()).hexdigest()])
    name = Path(entry).stem if entry.endswith(".py") else entry.rsplit(".", 1)[-1]
    return directory / f"{name}-{preload}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.sock"


def run(python: str, entry: str, argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float | None,
        preload: str = "preload", output: int | None = None) -> tuple[int, int] | None:
    """Run `entry`'s main(argv) in a warm child: (exit status as subprocess gives it, peak resident set in
    bytes). `output`: a file descriptor for the job's stdout and stderr, else it writes to this process's
    (as a child inheriting them would). None when warm processes are off (no HIVE_AOT_WARM_DIR), or when no
    server could be had here (the socket path too long, the server failed to start): the caller runs a fresh
    process instead. A job past `timeout` is killed (SIGKILL to its session): subprocess.TimeoutExpired."""
    directory = warm_dir()
    if directory is None:
        return None
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        # whoever can reach a server's socket runs code as this user: only a directory of ours alone
        print(f"hive-aot: {WARM_DIR_ENV}={directory} is not a directory of this user's alone (mode 0700): "
              "running engines fresh", file=sys.stderr)
        return None
    path = server_socket(directory, python, entry, preload, env)
    if len(str(path).encode()) > SOCKET_PATH_MAX:
        return None
    conn = _connect(path)
    if conn is None:
        conn = _start_and_connect(path, python, entry, preload, env)
        if conn is None:
            return None
    with conn:
        fds = [output, output] if output is not None else [1, 2]  # what a child process would inherit
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # what this process wrote comes before what the job writes
        request = json.dumps({"argv": argv, "cwd": str(cwd), "env": env}).encode() + b"\n"
        socket.send_fds(conn, [request], fds)
        started = _read_line(conn)
        if not started:
            return None  # the server went away before forking (it was idling out): a fresh process does it
        pid = json.loads(started)["pid"]
        conn.settimeout(timeout)
        try:
            line = _read_line(conn)
        except TimeoutError:
            _kill_session(pid)
            conn.settimeout(30)
            _read_line(conn)  # the server reaps it
            raise subprocess.TimeoutExpired(argv, timeout or 0) from None
    if not line:
        raise OSError(f"the warm server {path.name} went away while job {pid} ran")
    done = json.loads(line)
    return os.waitstatus_to_exitcode(done["status"]), done["maxrss"]


def _read_line(conn: socket.socket) -> bytes:
    """One JSON line of the protocol (b"" at end of stream), and not a byte of the next: a job quick enough
    finishes before its client reads, and then "started" and "done" wait in the socket together."""
    data = b""
    while True:
        chunk = conn.recv(65536, socket.MSG_PEEK)
        if not chunk:
            return b""
        end = chunk.find(b"\n")
        if end >= 0:
            return data + conn.recv(end + 1)  # already buffered: exactly the line's bytes
        data += conn.recv(len(chunk))


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _connect(path: Path) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
    except OSError:
        conn.close()
        return None
    return conn


def _start_and_connect(path: Path, python: str, entry: str, preload: str, env: dict[str, str]) -> socket.socket | None:
    """Start the server (one starter at a time, under a lock beside the socket) and connect to it. The server
    says it listens by closing its end of a pipe: nothing here polls."""
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        conn = _connect(path)  # another starter won
        if conn is not None:
            return conn
        path.unlink(missing_ok=True)  # a server that died leaves its socket file
        ready_r, ready_w = os.pipe()
        idle = _settings().WARM_IDLE.get()
        with open(path.with_suffix(".log"), "ab") as log:
            # -P: this file's directory (pipelines/process/, whose isolation.py... could shadow top-level
            # modules) stays off sys.path.
            proc = subprocess.Popen([python, "-P", str(Path(__file__).resolve()), "serve", str(path), entry, preload, idle,
                                     str(ready_w)], env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    pass_fds=(ready_w,), start_new_session=True)
        os.close(ready_w)
        with os.fdopen(ready_r, "rb") as ready:
            sel = selectors.DefaultSelector()
            sel.register(ready, selectors.EVENT_READ)
            answered = sel.select(START_TIMEOUT_S)
            said = ready.read() if answered else b""
        if said.strip() != b"ready":
            proc.kill()
            return None
        path.with_suffix(".pid").write_text(str(proc.pid))
        return _connect(path)


def stop_all(directory: Path) -> list[int]:
    """Kill every server a directory's pid files name (a test session's end); returns their pids."""
    stopped = []
    for pid_file in directory.glob("*.pid"):
        try:
            pid = int(pid_file.read_text())
            os.killpg(pid, signal.SIGKILL)
            stopped.append(pid)
        except (ValueError, OSError):
            pass
        pid_file.unlink(missing_ok=True)
    return stopped


# --- the server (runs under the engine's interpreter) ---------------------------------------------------------

def _child(job: dict[str, Any], fds: list[int], main: Callable[[list[str]], int], closing: list[int]) -> None:
    """In the forked child: become the job's own process, run main, never return."""
    rc = 1
    try:
        os.setsid()
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        for fd in closing:
            os.close(fd)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(job["cwd"])
        os.environ.clear()
        os.environ.update(job["env"])
        sys.argv = list(job["argv"])
        rc = main(list(job["argv"]))
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - the traceback is the job's output
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc if isinstance(rc, int) else 1)


def serve(path: str, entry: str, preload: str, idle: float, ready_fd: int) -> int:
    if entry.endswith(".py"):
        names = runpy.run_path(entry, run_name="__warm__")
    else:
        import importlib

        sys.path.insert(0, os.getcwd())  # as `python -m` has it
        names = vars(importlib.import_module(entry))
    names[preload]()
    main, prepare = names["main"], names.get("prepare")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    os.umask(0o077)  # the socket file: this user only
    listener.bind(path)
    listener.listen(16)
    own_inode = os.stat(path).st_ino
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    os.write(ready_fd, b"ready")
    os.close(ready_fd)
    sel = selectors.EpollSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "reap")
    jobs: dict[int, socket.socket] = {}
    try:
        while True:
            events = sel.select(None if jobs else idle)
            if not events and not jobs:
                return 0
            for key, _ in events:
                if key.data == "accept":
                    conn, _addr = listener.accept()
                    _start_job(conn, main, prepare, sel, jobs, [listener.fileno(), wake_r, wake_w])
                elif key.data == "reap":
                    try:
                        while os.read(wake_r, 512):
                            pass
                    except BlockingIOError:
                        pass
                    _reap(sel, jobs)
                else:  # a client's connection: readable while its job runs means it went away
                    if not _peek(key.fileobj):
                        _kill_session(key.data)
            _reap(sel, jobs)
    finally:
        try:
            if os.stat(path).st_ino == own_inode:
                os.unlink(path)
        except OSError:
            pass


def _start_job(conn: socket.socket, main: Callable[[list[str]], int], prepare: Callable[[list[str]], None] | None,
               sel: selectors.EpollSelector, jobs: dict[int, socket.socket], server_fds: list[int]) -> None:
    conn.settimeout(30)
    fds: list[int] = []
    _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if uid != os.getuid():  # a job runs as this user: only this user may ask for one
        conn.close()
        return
    try:
        first, fds, _flags, _addr = socket.recv_fds(conn, 65536, 2)
        rest = b"" if first.endswith(b"\n") or not first else _read_line(conn)
        job = json.loads(first + rest)
        if len(fds) != 2:
            raise ValueError("a job comes with its stdout and stderr")
    except (OSError, ValueError):
        for fd in fds:
            os.close(fd)
        conn.close()
        return
    if prepare is not None:
        try:
            prepare(list(job["argv"]))  # imports in the server itself: this job's fork and every later one have them
        except Exception:  # noqa: BLE001 - the job still runs: whatever failed here, it meets and reports itself
            pass
    closing = server_fds + [conn.fileno()] + [c.fileno() for c in jobs.values()] + [sel.fileno()]
    pid = os.fork()
    if pid == 0:
        _child(job, fds, main, closing)
    for fd in fds:
        os.close(fd)
    conn.settimeout(None)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    jobs[pid] = conn
    sel.register(conn, selectors.EVENT_READ, pid)


def _peek(conn: socket.socket) -> bool:
    try:
        return bool(conn.recv(1, socket.MSG_PEEK))
    except OSError:
        return False


def _reap(sel: selectors.BaseSelector, jobs: dict[int, socket.socket]) -> None:
    while jobs:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = jobs.pop(pid, None)
        if conn is None:
            continue
        sel.unregister(conn)
        try:
            conn.sendall(json.dumps({"status": status, "maxrss": usage.ru_maxrss * 1024}).encode() + b"\n")
        except OSError:
            pass
        conn.close()


if __name__ == "__main__":
    if len(sys.argv) != 7 or sys.argv[1] != "serve":
        sys.exit("usage: warm.py serve SOCKET ENTRY PRELOAD IDLE_SECONDS READY_FD")
    sys.exit(serve(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]), int(sys.argv[6])))
