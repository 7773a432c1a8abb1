"""Servers the tests start for real (SeaweedFS, Redis, Celery workers, `dg dev`): a free loopback port, and
stopping a process started in its own session together with its children."""

from __future__ import annotations

import os
import signal
import socket
import subprocess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
