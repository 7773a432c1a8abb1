"""A serving container's entrypoint: pull the model's artifact, then become its server.

`hive-aot serve MODEL --target auto --dest DIR [-- EXTRA SERVER ARGS]` pulls exactly as `pull` does (the
accelerator detected, the profile and recipe chosen, blobs verified, DIR complete or absent), then replaces
itself (exec) with the serve command the manifest records for the chosen runtime profile, with its
environment, and the extra arguments appended (`--host 0.0.0.0 --port 8080`): the server is the container's
process 1, receives its signals directly and its exit status is the container's. The images in
`deploy/serving/` run it as a non-root user.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..core.errors import HiveError

# What `serve --dry-run` without --dest shows in the server's command line where the pulled directory would be.
PLACEHOLDER_DEST = Path("/DEST")


def serve(model: str, target: str, dest: Path, *, extra_args: Sequence[str] = (), dry_run: bool = False,
          allow_remote_code: bool = False, **pull_options: Any) -> dict[str, Any]:
    """Pull, then exec the server (never returns unless `dry_run`, which returns what it would run, having
    checked the manifest but downloaded nothing). Only what serve_policy allows runs: the kind's own server,
    its own arguments and environment."""
    from .pull import pull
    from .serve_policy import ServeRefused, check

    res = pull(model, target, dest, fetch=not dry_run, **pull_options)  # a dry run downloads nothing
    if not res.serve_argv and not res.serve_refused:
        raise HiveError(f"{res.model_id} {res.recipe}: its manifest has no serve command for "
                        f"{res.runtime_profile}")
    try:
        if res.serve_refused and not (allow_remote_code and res.serve_refused_remote_code):
            raise ServeRefused(res.serve_refused)  # also what the summary could not show (a malformed env)
        program, argv, env_add = check(res.serve_argv, res.env, res.dest,
                                       remote_code_allowed=allow_remote_code or res.signed_by is not None)
    except ServeRefused as e:
        where = "" if dry_run else f"; the model is pulled into {res.dest}"
        raise ServeRefused(f"{res.model_id} {res.recipe} (build {res.build_id[:12]}): {e}{where}") from None
    argv = [*argv, *extra_args]
    env = {**os.environ, **env_add}
    plan = {**res.to_json(), "exec": argv, "exec_program": program, "exec_env": env_add, "uid": os.geteuid()}
    if dry_run:
        return plan
    for w in res.warnings:
        print(f"hive-aot: warning: {w}", file=sys.stderr)
    if os.geteuid() == 0:
        print("hive-aot: warning: serving as root; the images in deploy/serving run as an unprivileged user",
              file=sys.stderr)
    print(f"hive-aot serve: {res.model_id} {res.recipe} (build {res.build_id[:12]}) on "
          f"{res.runtime_profile}: exec {shlex.join(argv)}", file=sys.stderr, flush=True)
    _default_signals()
    try:
        if os.sep in program:  # pinned by the operator: that file, not a PATH lookup
            os.execve(program, argv, env)
        os.execvpe(program, argv, env)
    except FileNotFoundError:
        raise HiveError(f"cannot start {argv[0]}: not found on PATH (is this the {res.runtime_profile} serving "
                        f"image?); the model is pulled into {res.dest}") from None
    except PermissionError:
        raise HiveError(f"cannot start {argv[0]}: permission denied") from None
    raise AssertionError("unreachable: exec returned")


# An ignored signal stays ignored across exec, and so does a blocked one. Python itself ignores SIGPIPE and
# SIGXFSZ; a wrapper (nohup, a shell's background job, a process manager) may have ignored SIGTERM, SIGINT or
# SIGHUP. The server must start as a container's process 1 would: every one of them at its default, none blocked,
# or `docker stop` / a pod's termination reaches a server that ignores it (seen in this project's test suite,
# where a parent had SIGTERM ignored).
RESET_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGPIPE, signal.SIGXFSZ,
                 signal.SIGUSR1, signal.SIGUSR2)


def _default_signals() -> None:
    for sig in RESET_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


__all__ = ["PLACEHOLDER_DEST", "serve"]
