"""Servers the tests start for real (SeaweedFS, Redis, Celery workers, `dg dev`): a free loopback port, and
stopping a process started in its own session together with its children."""

from __future__ import annotations

import fcntl
import os
import random
import signal
import socket
import subprocess
import tempfile
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
