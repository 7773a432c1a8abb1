"""`make ui`: the Dagster UI (`dg dev`) on a port that is really free.

On a busy port `dg dev` logs an address-in-use error and keeps running, while the browser reaches
whatever owns that port. So the port is checked first: an explicit `--port` that is taken is one
error line; without `--port` the first free port from 3000 up is used and printed.

Exec'd in place of this launcher, `dg dev` did not reliably stop: started from a background job it inherits an
ignored SIGINT, and a SIGTERM left its webserver, daemon and code servers running. So it runs as a child in a
process group of its own, with both signals at their defaults: Ctrl-C or SIGTERM to this launcher (or to the
`make` that started it, which passes SIGTERM on) is forwarded to that whole group, and whatever is left of the
group GRACE_S seconds later is killed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from ..core import settings

FIRST_PORT, LAST_PORT = 3000, 3099
# How long the UI's processes get to stop on their own after Ctrl-C or SIGTERM before they are killed: `dg dev`
# asks its webserver, daemon and code server to stop and waits for them: a second or two on an idle host.
GRACE_S = 3.0


def port_is_free(host: str, port: int) -> bool:
    """Nothing listens on the port. SO_REUSEADDR, as the webserver binds: the connections a stopped UI left in
    TIME_WAIT for a minute do not keep its port from a new one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def choose_port(host: str, wanted: int | None) -> int:
    if wanted is not None:
        if not port_is_free(host, wanted):
            raise SystemExit(f"hive-aot ui: port {wanted} on {host} is already in use; "
                             "pick another with `make ui UI_PORT=N`, or leave UI_PORT empty for the first free one")
        return wanted
    for port in range(FIRST_PORT, LAST_PORT + 1):
        if port_is_free(host, port):
            return port
    raise SystemExit(f"hive-aot ui: no free port between {FIRST_PORT} and {LAST_PORT} on {host}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}")
    ap.add_argument("--port", type=int)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--workspace", default="workspace.yaml")
    args = ap.parse_args(argv)
    port = choose_port(args.host, args.port)
    dg = shutil.which("dg", path=str(Path(sys.executable).parent)) or shutil.which("dg")
    if dg is None:
        raise SystemExit("hive-aot ui: the `dg` command is missing: install hive-aot[orchestrate]")
    if settings.DAGSTER_HOME.is_set():
        # The same instance settings as `hive-aot onboard`: pool limits (validate_large: 1), dead runs' slots freed.
        from .onboard import _instance

        _instance()
    print(f"Dagster UI: http://{args.host}:{port} (DAGSTER_HOME={settings.DAGSTER_HOME.get() or ''})", file=sys.stderr,
          flush=True)
    return run_group([dg, "dev", "-w", args.workspace, "--host", args.host, "--port", str(port)])


def _defaults() -> None:
    # In the child before exec: a background job's ignored SIGINT would be inherited by `dg dev` and its children.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:  # the group is gone already
        pass


def run_group(argv: list[str], grace_s: float = GRACE_S) -> int:
    """Run `argv` in its own process group until it exits; SIGINT, SIGTERM or SIGHUP to this process goes to the
    whole group, and what is left of it `grace_s` seconds after the first such signal is killed. Returns the
    child's exit status (128 + the signal when a signal stopped it, as a shell reports it)."""
    stopping: list[int] = []  # the signals received
    group: list[int] = []  # the child's pid, which is its process group's id, once it runs
    killers: list[threading.Timer] = []

    def stop(sig: int) -> None:
        _kill_group(group[0], sig)
        if not killers:  # SIGKILL for what is left once the grace period after the first signal is over
            killers.append(threading.Timer(grace_s, _kill_group, (group[0], signal.SIGKILL)))
            killers[0].daemon = True
            killers[0].start()

    def forward(sig: int, _frame) -> None:
        stopping.append(sig)
        if group:
            stop(sig)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        child = subprocess.Popen(argv, process_group=0, preexec_fn=_defaults)
        group.append(child.pid)
        if stopping:  # a signal came while it started
            stop(stopping[0])
        code = child.wait()
    finally:
        for killer in killers:
            killer.cancel()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if group:  # children of `dg dev` that outlived it (it exited on an error, or was killed) stop with it
            _kill_group(group[0], signal.SIGKILL)
    if stopping:
        print(f"Dagster UI stopped ({signal.Signals(stopping[0]).name})", file=sys.stderr, flush=True)
        return 128 + stopping[0]
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
