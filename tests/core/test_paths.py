"""Scratch directories: removed when done, and reclaimed after a kill -9, never while their process lives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipelines.core.paths import reclaim_work, work_dir, work_root

REPO = Path.cwd()


def test_work_dir_is_private_and_removed(monkeypatch, tmp_path):
    monkeypatch.setenv("HIVE_AOT_CACHE", str(tmp_path))
    with work_dir("build-x-") as d:
        assert d.parent == work_root() and d.name.startswith("build-x-")
        (d / "big.gguf").write_bytes(b"x" * 100)
        assert reclaim_work() == []  # held by this (live) process
    assert not d.exists()


def test_killed_process_leftovers_are_reclaimed_live_ones_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("HIVE_AOT_CACHE", str(tmp_path))
    code = ("import sys, time; from pipelines.core.paths import work_dir\n"
            "with work_dir('build-victim-') as d:\n"
            "    (d / 'part.gguf').write_bytes(b'x' * 1000); print(d, flush=True); time.sleep(600)\n")
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "HIVE_AOT_CACHE": str(tmp_path)}) for _ in range(2)]
    try:
        dirs = [Path(p.stdout.readline().strip()) for p in procs]
        assert all(d.is_dir() for d in dirs)
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].wait(timeout=30)
        assert reclaim_work() == [dirs[0].name]
        assert not dirs[0].exists() and dirs[1].is_dir()  # the live one is untouched
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)


def test_unlocked_directories_wait_for_the_grace_period(monkeypatch, tmp_path):
    """No lock file: just created (the lock follows in microseconds) or left by an older version."""
    monkeypatch.setenv("HIVE_AOT_CACHE", str(tmp_path))
    young, old = work_root() / "build-young", work_root() / "build-old"
    young.mkdir()
    old.mkdir()
    past = time.time() - 7200
    os.utime(old, (past, past))
    assert reclaim_work() == ["build-old"]
    assert young.is_dir() and not old.exists()
