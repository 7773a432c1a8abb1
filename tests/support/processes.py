"""Servers the tests start for real (SeaweedFS, docker-registry, Redis, Celery workers, `dg dev`): a free loopback
port, a server started in its own session and waited for until it answers, and stopping such a process together
with its children."""

from __future__ import annotations

import fcntl
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

# Ports are taken below Linux's ephemeral range (32768-60999 by default), so the kernel never hands one of
# them to an outgoing connection, and each is claimed with an flock held until this process exits, so two
# test processes (xdist workers, a second checkout's CI) never pick the same one. Binding port 0, closing it
# and handing the number to a server raced with everything else on the machine.
PORT_RANGE = range(20000, 32000)
_LOCK_DIR = Path(tempfile.gettempdir()) / f"hive-aot-test-ports-{os.getuid()}"
_claimed: list[int] = []  # lock fds, open for the life of this process


def free_port() -> int:
    """A loopback port that nothing listens on and no other test process was given."""
    _LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
    start = random.randrange(len(PORT_RANGE))
    for i in range(len(PORT_RANGE)):
        port = PORT_RANGE[(start + i) % len(PORT_RANGE)]
        fd = os.open(_LOCK_DIR / str(port), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # someone outside the tests listens there: keep the lock, so no one retries it
                _claimed.append(fd)
                continue
        _claimed.append(fd)
        return port
    raise RuntimeError(f"no free port in {PORT_RANGE}")


def stop_group(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM the process group of a `start_new_session=True` child, SIGKILL it if it outlives `timeout`."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextmanager
def serving(name: str, args: list[str], root: Path, log: Path, answers: Callable[[], bool], timeout: float,
            poll: float = 0.2) -> Iterator[subprocess.Popen]:
    """Run the server `args` in `root`, in its own session (so its children stop with it), its output in `log`;
    yield it once `answers()` says it is up, and stop its process group when the block ends. RuntimeError naming
    `name`, with the log's tail, when it exits first or does not answer within `timeout` seconds."""
    with open(log, "wb") as logf:
        proc = subprocess.Popen(args, cwd=root, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not answers():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start: " + log.read_text(errors="replace")[-3000:])
            time.sleep(poll)
        yield proc
    finally:
        stop_group(proc)
