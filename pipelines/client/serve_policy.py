"""What `hive-aot serve` will exec: only a kind's own server, with the arguments and environment that kind
writes, whatever a store's manifest says.

A manifest records the serve command of each runtime profile (argv with "{model_dir}", and an env), and
whoever can write a store can rewrite it: without signatures nothing ties it to the factory, and even a
signed manifest should not be able to run `sh -c`, a script shipped as a blob, or a library through
LD_PRELOAD. So the command is checked against the `server_programs` the installed targets declare:

- argv[0] is one of their program names, bare (no path: the container's PATH, or the operator's pin in
  `HIVE_AOT_SERVE_PROGRAMS=vllm=/opt/vllm/bin/vllm,llama-server=/usr/local/bin/llama-server`, decides
  which file runs);
- the leading positionals are the program's own, every flag is one the kind writes, each value a plain
  word, a path inside the pulled directory, or a JSON object of the keys the kind names, each a plain value;
- flags that run code shipped with the model (`--trust-remote-code`) need a manifest signed by a trusted
  key, or the operator's `--allow-remote-code`;
- env names are the kind's own or listed by the operator in `HIVE_AOT_SERVE_ENV`; no NUL anywhere, and
  bounded sizes.

The arguments a container passes after `--` are the operator's own and are appended unchecked.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config.kinds import known as known_kinds, target_for
from ..core import settings
from ..core.errors import ConfigError, HiveError
from ..targets import MODEL_DIR, ServerProgram

if TYPE_CHECKING:
    from ..store.manifest import Manifest

PROGRAMS_ENV, ENV_ALLOW_ENV = settings.SERVE_PROGRAMS.name, settings.SERVE_ENV.name
MAX_ARGS, MAX_ARG_CHARS, MAX_ENV = 256, 4096, 64
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
# a value is one word: model ids, numbers, dtypes, device lists; never an option, a space or a control character
_WORD = re.compile(r"[A-Za-z0-9_.:/,+=@][A-Za-z0-9_.:/,+=@-]{0,255}")


class ServeRefused(HiveError):
    """The recorded serve command is not one this container runs."""


class RemoteCodeRefused(ServeRefused):
    """Only because it would run code shipped with the model, from a manifest no trusted key signed."""


def allowed_programs() -> dict[str, ServerProgram]:
    """Program name -> what it may be given, merged over every kind that runs it (vLLM serves two kinds)."""
    merged: dict[str, ServerProgram] = {}
    for kind in known_kinds():
        for prog in target_for(kind).server_programs:
            have = merged.get(prog.name)
            if have is None:
                merged[prog.name] = prog
                continue
            if have.positionals != prog.positionals:
                raise AssertionError(f"{prog.name}: kinds disagree on its positionals")
            merged[prog.name] = ServerProgram(prog.name, prog.positionals, {**have.options, **prog.options},
                                              have.remote_code | prog.remote_code, {**have.env, **prog.env})
    return merged


def pinned_programs() -> dict[str, str]:
    """The operator's program name -> absolute path pins ($HIVE_AOT_SERVE_PROGRAMS)."""
    pins = {}
    for item in settings.SERVE_PROGRAMS.items():
        name, eq, path = item.partition("=")
        if not eq or not os.path.isabs(path):
            raise ConfigError(f"{PROGRAMS_ENV}: {item[:80]!r} is not name=/absolute/path")
        pins[name] = path
    return pins


def check(argv: Any, env: Any, model_dir: str, *, remote_code_allowed: bool) -> tuple[str, list[str], dict[str, str]]:
    """(the file to exec, argv, env) when the recorded command is one this container runs; ServeRefused (one
    line) otherwise. `argv` and `env` are the manifest's, with "{model_dir}" already filled in."""
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ServeRefused("the manifest's serve command is not a list of strings")
    if len(argv) > MAX_ARGS or any(len(a) > MAX_ARG_CHARS or "\0" in a for a in argv):
        raise ServeRefused(f"the manifest's serve command is too long or holds a NUL byte ({len(argv)} arguments)")
    programs = allowed_programs()
    prog = programs.get(argv[0])
    if prog is None:
        raise ServeRefused(f"the manifest asks to run {argv[0][:80]!r}, which is not a server this container runs "
                           f"(allowed: {', '.join(sorted(programs))}); refusing to exec it")
    wanted = [p.replace(MODEL_DIR, model_dir) for p in prog.positionals]
    if argv[1:1 + len(wanted)] != wanted:
        raise ServeRefused(f"{prog.name} must be started as {' '.join([prog.name, *wanted])} ...; the manifest says "
                           f"{' '.join(argv[:1 + len(wanted)])[:120]!r}")
    rest = argv[1 + len(wanted):]
    i = 0
    while i < len(rest):
        flag, eq, value = rest[i].partition("=")
        kind = prog.options.get(flag)
        if kind is None:
            raise ServeRefused(f"the manifest gives {prog.name} {rest[i][:80]!r}, which is not an argument hive-aot "
                               f"writes for it; refusing to exec it")
        if flag in prog.remote_code and not remote_code_allowed:
            raise RemoteCodeRefused(f"the manifest asks {prog.name} for {flag} (code shipped with the model would run), "
                               f"but it is not signed by a trusted key; pass --allow-remote-code to accept it")
        if kind == "switch":
            if eq:
                raise ServeRefused(f"{flag} takes no value (the manifest says {rest[i][:80]!r})")
            i += 1
            continue
        if not eq:
            if i + 1 >= len(rest):
                raise ServeRefused(f"{flag} has no value in the manifest's serve command")
            value, i = rest[i + 1], i + 1
        _check_value(flag, value, kind, model_dir)
        i += 1
    return _program_file(prog.name), argv, _check_env(env, prog, model_dir)


def _check_value(name: str, value: str, kind: str, model_dir: str) -> None:
    if kind == "model-paths":  # `a:b`: each part a path in the pulled directory (a VLM's dual QPC)
        for part in value.split(":"):
            _check_value(name, part, "model-path", model_dir)
    elif kind == "model-path":
        inside = os.path.realpath(value)
        root = os.path.realpath(model_dir)
        if not (inside == root or inside.startswith(root + os.sep)):
            raise ServeRefused(f"{name} must name a file in the pulled directory {model_dir}, not {value[:120]!r}")
    elif kind.startswith("json:"):
        _check_json(name, value, kind.removeprefix("json:").split(","))
    elif _WORD.fullmatch(value) is None:
        raise ServeRefused(f"{name}: {value[:80]!r} is not a plain value")


def _check_json(name: str, value: str, keys: list[str]) -> None:
    """A JSON object whose keys are among `keys`, each value a plain word or a number (never nested)."""
    try:
        doc = json.loads(value)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise ServeRefused(f"{name}: {value[:80]!r} is not a JSON object")
    for key, item in doc.items():
        if key not in keys:
            raise ServeRefused(f"{name}: key {key[:40]!r} is not one hive-aot writes (allowed: {', '.join(keys)})")
        plain = (isinstance(item, (int, float)) and not isinstance(item, bool)) or (
            isinstance(item, str) and _WORD.fullmatch(item) is not None)
        if not plain:
            raise ServeRefused(f"{name}: {key} is not a plain value")


def _check_env(env: Any, prog: ServerProgram, model_dir: str) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, dict) or len(env) > MAX_ENV:
        raise ServeRefused("the manifest's serving env is not a mapping of at most 64 names")
    extra = set(settings.SERVE_ENV.items())
    out = {}
    for name, value in env.items():
        if not isinstance(name, str) or _ENV_NAME.fullmatch(name) is None:
            raise ServeRefused(f"the manifest's serving env has a malformed name {str(name)[:80]!r}")
        if not isinstance(value, (str, int, float)) or isinstance(value, bool) or "\0" in str(value) \
                or len(str(value)) > MAX_ARG_CHARS:
            raise ServeRefused(f"the manifest's serving env {name} is not a plain value")
        kind = prog.env.get(name) or ("value" if name in extra else None)
        if kind is None:
            raise ServeRefused(f"the manifest sets {name} for {prog.name}, which hive-aot never sets (allowed: "
                               f"{', '.join(sorted(prog.env)) or 'none'}; an operator adds names in {ENV_ALLOW_ENV})")
        if kind in ("model-path", "model-paths"):
            _check_value(name, str(value), kind, model_dir)
        out[name] = str(value)
    return out


def serving_summary(doc: dict[str, Any], dest: Path, m: Manifest, *, signed: bool) -> dict[str, Any]:
    """What a serving container needs next: the files, and the serve command of the chosen runtime profile
    exactly as the manifest describes it (with the pulled directory filled in), and whether this policy
    would run it (`serve_refused`: why not). Malformed serving fields are reported, never a traceback."""
    files = [str(dest / f.path) for f in m.files]
    serving = doc["serving"]
    cmd, env = serving.get("command"), serving.get("env") or {}
    argv = [a.replace(MODEL_DIR, str(dest)) for a in cmd] if isinstance(cmd, list) and all(
        isinstance(a, str) for a in cmd) else None
    if cmd is None and m.format == "gguf":  # manifests from before serving profiles
        argv = ["llama-server", "-m", files[0], "-c", str(serving.get("n_ctx", 4096))]
    shown_env = {k: str(v).replace(MODEL_DIR, str(dest)) for k, v in env.items()} if isinstance(env, dict) else {}
    refused, only_remote_code = None, False
    if argv is not None or cmd is not None:
        try:
            check(argv if argv is not None else cmd, shown_env if isinstance(env, dict) else env, str(dest),
                  remote_code_allowed=signed)
        except HiveError as e:
            refused, only_remote_code = str(e), isinstance(e, RemoteCodeRefused)
    return {"model_id": doc["model_id"], "build_id": m.build_id, "recipe": doc["recipe"],
            "runtime_profile": doc["runtime_profile"]["id"], "dest": str(dest), "files": files,
            "size": m.total_size, "serve": shlex.join(argv) if argv else None, "serve_argv": argv,
            "env": shown_env, "serve_refused": refused, "serve_refused_remote_code": only_remote_code,
            "image": serving.get("image") or doc["runtime_profile"].get("image")}


def _program_file(name: str) -> str:
    """The operator's pinned path for the program, else its bare name (found on PATH by exec)."""
    path = pinned_programs().get(name)
    if path is not None and not Path(path).is_file():
        raise ConfigError(f"{PROGRAMS_ENV} pins {name} to {path}, which is not a file")
    return path or name


__all__ = ["ENV_ALLOW_ENV", "PROGRAMS_ENV", "RemoteCodeRefused", "ServeRefused", "allowed_programs", "check", "pinned_programs",
           "serving_summary"]
