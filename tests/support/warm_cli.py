"""The hive-aot CLI as an entry of a warm server (pipelines/process/warm.py), for tests that start it dozens of times.

A fault loop runs `hive-aot build` some 25 times per store kind, each killed at a store event or left to finish.
A fresh interpreter spends most of such a tiny build importing hive-aot (numpy, pydantic, the stores); a warm
server imports it once and forks each run from there. Each run is still a process of its own, in a session of
its own (the kill takes its whole group, as a container kill does), with the run's own environment, and it runs
the CLI's `main` as `python -m pipelines.cli` would: only the imports are done before it starts.

`run_cli` returns a `subprocess.CompletedProcess` (stdout and stderr apart, as `capture_output` gives them);
without HIVE_AOT_WARM_DIR (HIVE_AOT_TEST_WARM=0), or where no warm server could be had, it runs a fresh
`python -m pipelines.cli`.

Runs as a script in the warm server (`python warm.py serve ... warm_cli.py ...`): the checkout this file is in is
put first on the path, as `python -m` from the repository root has it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def preload() -> None:
    """What a build, a pull, ls and gc import before their first step (a run imports anything else itself)."""
    import pipelines.cli.main
    import pipelines.client.pull
    import pipelines.config.kinds
    import pipelines.config.registry
    import pipelines.engine.build
    import pipelines.store.local
    import pipelines.store.oci
    import pipelines.store.s3
    import pipelines.targets.gguf  # noqa: F401 - imported for the forked runs, not used here
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # nothing of the server's own output is copied into a forked run


def main(argv: list[str]) -> int:
    """argv: this file, the file the run's stdout goes to, then the CLI's arguments."""
    out = os.open(argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out, 1)
    os.close(out)
    from pipelines.cli.main import main as cli_main

    return cli_main(argv[2:])


def run_cli(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """`python -m pipelines.cli *args` with `env`, forked by a warm server where the tests have one."""
    from pipelines.process import warm

    with tempfile.TemporaryDirectory(prefix="warm-cli-") as d:
        out, err = Path(d) / "stdout", Path(d) / "stderr"
        with open(err, "wb") as errf:
            done = warm.run(sys.executable, __file__, [__file__, str(out), *args], cwd=Path.cwd(), env=env,
                            timeout=timeout, output=errf.fileno())
        if done is not None:
            stdout = out.read_text() if out.exists() else ""  # a run killed before it began has none
            return subprocess.CompletedProcess(args, done[0], stdout, err.read_text())
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, start_new_session=True)
