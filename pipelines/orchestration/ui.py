"""`make ui`: the Dagster UI (`dg dev`) on a port that is really free.

On a busy port `dg dev` logs an address-in-use error and keeps running, while the browser reaches
whatever owns that port. So the port is checked first: an explicit `--port` that is taken is one
error line; without `--port` the first free port from 3000 up is used and printed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
from pathlib import Path

FIRST_PORT, LAST_PORT = 3000, 3099


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
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
    ap = argparse.ArgumentParser(prog="python -m pipelines.orchestration.ui")
    ap.add_argument("--port", type=int)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--workspace", default="workspace.yaml")
    args = ap.parse_args(argv)
    port = choose_port(args.host, args.port)
    dg = shutil.which("dg", path=str(Path(sys.executable).parent)) or shutil.which("dg")
    if dg is None:
        raise SystemExit("hive-aot ui: the `dg` command is missing: install hive-aot[orchestrate]")
    if os.environ.get("DAGSTER_HOME"):
        # The same instance settings as `hive-aot onboard`: pool limits (validate_large: 1), dead runs' slots freed.
        from .onboard import _instance

        _instance()
    print(f"Dagster UI: http://{args.host}:{port} (DAGSTER_HOME={os.environ.get('DAGSTER_HOME', '')})", file=sys.stderr,
          flush=True)
    os.execv(dg, [dg, "dev", "-w", args.workspace, "--host", args.host, "--port", str(port)])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
