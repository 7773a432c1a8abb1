"""`hive-aot` command line.

Conventions: `--json` prints exactly one JSON document on stdout (progress and logs go to stderr);
errors are one line on stderr. Exit codes: 0 done, 1 error (bad input, refused source, store
problem), 2 usage, 3 validation failed (nothing published), 4 check: requires_review,
5 check: incompatible, 6 a native engine crashed (its step named; nothing published), 7 not enough memory
or disk (refused before work by the memory plan, or the disk filled up: nothing published; `plan` exits 7
when the build would be refused).

The base install is the pull client; `check`, `build` and `onboard` need extras, and without them
say which one in one line instead of a ModuleNotFoundError traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from ..core import settings
from ..core.errors import ExitCode, HiveError
from .copy import copy_parser
from .output import QUIET_HELP, HelpFormatter, emit as _emit, size as _size, table
from .store import modelcar_parser, pull_parsers, store_parsers, verify_parser
from .version import VersionAction, cmd_version

# Import names that differ from the distribution that provides them.
_DIST_OF_MODULE = {"llama_cpp": "llama_cpp_python", "google": "protobuf"}
def cmd_check(args) -> int:
    from ..compat.check import classify, classify_snapshot
    from ..compat.requirements import WeightsSummary
    from ..config.registry import Config
    from ..source.fetch import fetch, hub_offline, parse_source

    config = Config.load(args.registry, args.recipes)
    spec = parse_source(args.source)
    extra: dict[str, Any] = {}
    if spec.kind == "hf" and not hub_offline():
        # Header-only: config.json, the index and safetensors headers by HTTP range; no weight bytes.
        from ..compat.remote import inspect_remote

        repo = inspect_remote(spec)
        weights = WeightsSummary.from_headers(repo.headers.values()) if repo.headers else None
        compat = classify(repo.config, weights=weights, files=repo.files, hardware=args.hardware,
                          recipes=config.recipes.values(), registry=config.registry,
                          reviewed=config.reviewed(repo.model_id), config_error=repo.config_error)
        model_id, revision, commit = repo.model_id, repo.revision, repo.commit
        extra = {"bytes_fetched": repo.bytes_fetched, "repo_weights_bytes": repo.repo_bytes}
    else:
        snap = fetch(args.source, args.model_id, hashed=False, weights_required=False)  # headers only
        compat = classify_snapshot(snap, config.recipes.values(), hardware=args.hardware, registry=config.registry,
                                   reviewed=config.reviewed(snap.model_id))
        model_id, revision, commit = snap.model_id, snap.revision, snap.commit
    doc = {"model_id": model_id, "revision": revision, "commit": commit, **compat.model_dump(), **extra}
    lines = [f"{model_id} @ {commit[:12]}: {compat.status} -> {compat.runtime_profile_id or 'none'} ({compat.hardware})"]
    lines += [f"  [{c.status}] {c.name}: {c.detail}" for c in compat.checks]
    req = compat.estimated_requirements
    if req:
        lines.append(f"  parameters {req['parameters']:,}, weights {_size(req['weights_bytes'])}, "
                     f"estimated memory {_size(req.get('vram_bytes', 0))}")
        if req.get("recommended_config"):
            lines.append("  recommended: " + ", ".join(f"{k}={v}" for k, v in req["recommended_config"].items()))
    if extra:
        lines.append(f"  header-only: fetched {extra['bytes_fetched']:,} bytes of {extra['repo_weights_bytes']:,}")
    lines.append(f"  recipes: {', '.join(compat.recipes) or 'none'}")
    _emit(args, doc, "\n".join(lines))
    return {"compatible": ExitCode.OK, "requires_review": ExitCode.REVIEW}.get(compat.status, ExitCode.INCOMPATIBLE)


def add_check_parser(subparsers) -> None:
    """`check`: classify a model without its weights."""
    sp = subparsers.add_parser("check", help="classify a model: status, runtime profile, checks, requirements")
    sp.add_argument("source", help="hf://owner/repo[@rev], owner/repo[@rev] or a local directory")
    sp.add_argument("--hardware", default="nvidia",
                    help="vendor[-model][-<N>gb]: nvidia, nvidia-a100-80gb, amd-mi300x-192gb, intel-max-1550, cpu, qaic-ai100")
    sp.add_argument("--model-id", help="model id for a local directory source")
    _common_options(sp, store=False)
    sp.set_defaults(func=cmd_check)


def cmd_settings(args) -> int:
    rows = settings.describe()
    _emit(args, rows, table(("variable", "set", "value", "meaning"),
                            [(r["name"], "set" if r["set"] else "-", "-" if r["value"] is None else r["value"], r["meaning"])
                             for r in rows]))
    return ExitCode.OK


def add_settings_parser(subparsers) -> None:
    """`settings`: the HIVE_AOT_* environment variables."""
    sp = subparsers.add_parser("settings", help="every HIVE_AOT_* environment variable: its effective value (secrets "
                                                "masked) and meaning")
    sp.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    sp.set_defaults(func=cmd_settings)


def cmd_registry(args) -> int:
    from ..config.registry import Config

    if args.registry_command == "sync":
        from ..compat.sync import build_snapshot, snapshot_path, write_snapshot

        doc = build_snapshot(args.vllm_version, Path(args.wheel) if args.wheel else None, args.llama_cpp_version,
                             Path(args.llama_cpp_sdist) if args.llama_cpp_sdist else None)
        path = Path(args.output) if args.output else snapshot_path()
        write_snapshot(doc, path)
        archs = doc["architectures"].values()
        summary = {"path": str(path), "sources": doc["sources"], "architectures": len(doc["architectures"]),
                   "vllm_supported": sum(1 for a in archs if (a.get("vllm") or {}).get("support")),
                   "llama_cpp_converted": sum(1 for a in archs if (a.get("llama_cpp") or {}).get("arch"))}
        _emit(args, summary, f"wrote {summary['architectures']} architectures ({summary['vllm_supported']} run by vLLM "
                             f"{args.vllm_version}) to {path}")
        return ExitCode.OK
    config = Config.load(args.registry, args.recipes)
    if args.registry_command == "backends":
        rows = [p.model_dump(mode="json") for p in config.registry.runtime_profiles]
        _emit(args, rows, table(("profile", "vendor", "role", "state", "loads", "image"),
                                [(p["id"], p["vendor"], p["role"], "active" if p["active"] else "INACTIVE",
                                  ",".join(p["loads"]), p["image"]) for p in rows]))
        return ExitCode.OK
    from ..compat import database

    db = database.build(config.registry)
    rows = [a.to_dict() for a in db.architectures.values()]
    if not args.json:
        active = sum(1 for r in rows if r["active"])
        print(f"{len(rows)} architectures, {active} active (vLLM {db.sources.get('vllm')}, "
              f"transformers {db.sources.get('transformers')})")
        print(table(("architecture", "family", "task", "state", "vllm", "tested"),
                    [(r["name"], r["family"], r["task"], "active" if r["active"] else "inactive",
                      str(r["vllm_support"] or "-"), ",".join(r["tested"] or ())) for r in rows]))
        return ExitCode.OK
    _emit(args, {"sources": db.sources, "aliases": db.aliases, "architectures": rows}, "")
    return ExitCode.OK


def add_registry_parser(subparsers) -> None:
    """`registry` and its subcommands: architectures, backends, sync."""
    sp = subparsers.add_parser("registry", help="the architecture database and runtime profiles")
    rsub = sp.add_subparsers(dest="registry_command", required=True, metavar="SUBCOMMAND",
                             help="`hive-aot registry SUBCOMMAND --help` for its options")
    for name, text in (("architectures", "one record per architecture"), ("backends", "the runtime profiles")):
        r = rsub.add_parser(name, help=text, description=text, formatter_class=HelpFormatter)
        _common_options(r, store=False)
    text = "regenerate the architecture snapshot from vLLM's registry, transformers and llama.cpp's converter"
    r = rsub.add_parser("sync", help=text, description=text, formatter_class=HelpFormatter)
    r.add_argument("--vllm-version", default="0.33.0", help="the vLLM release the serving images pin")
    r.add_argument("--wheel", help="a local vllm wheel instead of downloading one")
    r.add_argument("--llama-cpp-version", default="0.3.36", help="the llama-cpp-python release the CPU tier pins")
    r.add_argument("--llama-cpp-sdist", help="a local llama-cpp-python sdist instead of downloading one")
    r.add_argument("--output", help="where to write (default: the packaged snapshot)")
    _common_options(r, store=False)
    sp.set_defaults(func=cmd_registry)


def cmd_build(args) -> int:
    from ..config.kinds import target_for
    from ..config.registry import Config
    from ..engine.build import build_and_publish

    config = Config.load(args.registry, args.recipes)
    res = build_and_publish(args.source, args.recipe, config, args.store, args.model_id)
    v = res.validation or {}
    score = target_for(config.recipe(res.recipe).kind).summary(v)
    size = sum(f["size"] for f in res.files)
    if res.state == "rejected":
        why = "; ".join(v.get("failures", [])) or res.reason or ""
        human = f"rejected {res.recipe} for {res.model_id}: {why} (nothing published)"
    else:
        human = f"{res.state} {res.recipe} for {res.model_id}: build {res.build_id[:12]}, {_size(size)},{score}\n  {res.manifest}"
        if res.state == "compile_pending":
            human += f"\n  {res.reason}; on a host that has it: hive-aot compile {res.model_id} --recipe {res.recipe}"
        for name, sub in (("input", res.input), ("compiled from", res.bundle)):
            if sub is not None:
                human += f"\n  {name}: {sub.recipe} build {sub.build_id[:12]} ({sub.state})"
    _emit(args, res.to_json(), human)
    if res.state == "rejected":
        print(f"hive-aot: validation failed: {'; '.join(v.get('failures', []))}", file=sys.stderr)
        return ExitCode.REJECTED
    return ExitCode.OK


def add_build_parser(subparsers) -> None:
    """`build`: build, validate and publish."""
    _add_recipe_build_parser(subparsers, "build", cmd_build, "build, validate and publish one recipe for one model")


def _add_recipe_build_parser(subparsers, name: str, func, text: str) -> None:
    """A command that takes a build's source, --recipe and --model-id (build and plan)."""
    sp = subparsers.add_parser(name, help=text)
    sp.add_argument("source", help="hf://owner/repo[@rev], owner/repo[@rev] or a local directory")
    sp.add_argument("--recipe", required=True, help="the recipe id (e.g. gguf-q8_0, vllm-fp8; the packaged ones "
                                                     "are in pipelines/config/defaults/recipes)")
    sp.add_argument("--model-id", help="model id (org/name) for a local directory source")
    _common_options(sp)
    sp.set_defaults(func=func)


def cmd_plan(args) -> int:
    """Each step's estimated memory and disk for a build (its input recipes first), without building."""
    from ..config.registry import Config
    from ..core.errors import ResourceError
    from ..engine.build import plan, resource_plan
    from ..model.memory import plan_text
    from ..store import open_store

    config = Config.load(args.registry, args.recipes)
    store = open_store(args.store)
    chain, p = [], plan(args.source, args.recipe, config, args.model_id, hashed=False)
    while p is not None:
        chain.insert(0, p)
        p = p.parent
    docs, texts, refusals = [], [], []
    for q in chain:
        mp = resource_plan(q, store)
        published = _published(store, q) if q.build_id is not None else None
        doc = {**mp.to_json(), "build_id": q.build_id, "published": published}
        docs.append(doc)
        texts.append(plan_text(mp) + ("\n  (already published in the store: a build skips it)" if published else "")
                     + ("\n  (build id: computed when a build hashes the source)" if q.build_id is None else ""))
        if not published and not mp.fits():
            refusals.append(f"{mp.recipe} of {mp.model_id}: {'; '.join(mp.problems())}")
    hardware = chain[-1].target.hardware_step
    planned = hardware.planned() if hardware is not None else (None, None)
    _emit(args, {"plans": docs, "fits": not refusals, "hardware_step": planned[0]},
          "\n".join(texts + [planned[1]] * (hardware is not None)))
    if refusals:
        print(f"hive-aot: error: {ResourceError('; '.join(refusals) + '; a build would be refused')}", file=sys.stderr)
        return ExitCode.RESOURCES
    return ExitCode.OK


def _published(store, p) -> bool:
    """Whether the build is published in the store (False when the store cannot be read: a plan needs none)."""
    from ..core.errors import StoreError
    from ..engine.build import published_manifest

    try:
        return published_manifest(p, store) is not None
    except StoreError:
        return False


def add_plan_parser(subparsers) -> None:
    """`plan`: a build's memory and disk, without building."""
    _add_recipe_build_parser(subparsers, "plan", cmd_plan,
                             "each step's estimated memory and disk for a build, against this host")


def cmd_compile(args) -> int:
    """Finish published artifacts with their kind's hardware step (the AI 100 compile) on this host."""
    from ..client.build_ids import resolve_build_id
    from ..client.pull import parse_model
    from ..config.kinds import target_for
    from ..config.registry import Config
    from ..core.paths import model_slug
    from ..store import open_store

    config = Config.load(args.registry, args.recipes)
    model_id, input_build = parse_model(args.model)
    store = open_store(args.store)
    if input_build is not None:  # a prefix names one published build (of --recipe, where given)
        input_build = resolve_build_id(input_build, store.list(f"manifests/{model_slug(model_id)}/"),
                                       model_id=model_id, where=store.uri, recipe=args.recipe)
    if args.recipe is not None:
        step = target_for(config.recipe(args.recipe).kind).hardware_step
        if step is None:
            raise HiveError(f"recipe {args.recipe} ({config.recipe(args.recipe).kind}) has no step to run on other "
                            "hardware: `hive-aot build` makes the whole artifact")
        steps = [step]
    else:  # each kind's step once, in recipe order
        steps = list({id(s): s for r in sorted(config.recipes.values(), key=lambda r: r.id)
                      if (s := target_for(r.kind).hardware_step) is not None}.values())
    results = [r for step in steps for r in step.finish_published(model_id, config, store, args.recipe, input_build)]
    lines = []
    for r in results:
        extra = (r.validation or {}).get(r.format or "", {})
        took = f", compiled in {extra['compile_seconds']} s" if r.state == "published" and "compile_seconds" in extra else ""
        lines.append(f"{r.state} {r.recipe} for {r.model_id}: {str(r.format).upper()} build {r.build_id[:12]}, "
                     f"{_size(sum(f['size'] for f in r.files))}{took}\n  {r.manifest}")
    _emit(args, [r.to_json() for r in results], "\n".join(lines))
    return ExitCode.OK


def add_compile_parser(subparsers) -> None:
    """`compile` (alias qaic-compile): finish published artifacts on this host's hardware."""
    sp = subparsers.add_parser("compile", aliases=["qaic-compile"],
                               help="finish published artifacts on this host's hardware (AI 100 export bundles into "
                                    "QPCs, with the Cloud AI SDK)")
    sp.add_argument("model", metavar="MODEL_ID[@INPUT_BUILD_ID]",
                    help="the model, and optionally the published input build (a full id or 8+ hex digits) to finish")
    sp.add_argument("--recipe", help="one recipe (default: every recipe of the model with a published artifact waiting)")
    _common_options(sp)
    sp.set_defaults(func=cmd_compile)


def cmd_onboard(args) -> int:
    from ..orchestration.onboard import onboard

    res = onboard(registry=args.registry, store=args.store, models=args.model or None, recipes=args.recipes)
    if args.json:
        _emit(args, res.to_json(), "")
    else:
        print(table(("model", "recipe", "state", "build"),
                    [(r.model_id, r.recipe, r.state, r.build_id[:12]) for r in res.results]))
    # One line per failed step on stderr, with the run to open in the UI (`make ui`); the tracebacks are there.
    for r in res.results:
        if r.state in ("failed", "rejected"):
            print(f"hive-aot: error: {r.model_id} {r.recipe}: {r.state}: {r.error or ''} (run {r.run_id})",
                  file=sys.stderr)
    return ExitCode.OK if res.success else ExitCode.ERROR


def add_onboard_parser(subparsers) -> None:
    """`onboard`: the Dagster onboarding job, headless."""
    sp = subparsers.add_parser("onboard", help="run the Dagster onboarding job headless for registry models",
                               description="Run the Dagster onboarding job without the UI: for each model of the "
                                           "registry (or those named), fetch, classify, build, validate and publish "
                                           "the recipes it lists, on the local SQLite instance ($DAGSTER_HOME) or the "
                                           "configured one. Builds whose build id is already published are skipped.")
    sp.add_argument("--model", action="append", help="only this model id (repeatable)")
    _common_options(sp)
    sp.set_defaults(func=cmd_onboard)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hive-aot", description="Ahead-of-time model artifact factory.",
                                formatter_class=HelpFormatter)
    p.add_argument("--version", action=VersionAction, help="print the package's and the engines' versions and the "
                   "CPU level llama.cpp was compiled for, then exit (`hive-aot --version --json`: as JSON)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", help="`hive-aot COMMAND --help` for its options")
    _describe_subcommands(sub)
    add_check_parser(sub)
    add_build_parser(sub)
    add_plan_parser(sub)
    add_compile_parser(sub)
    pull_parsers(sub, _common_options)
    modelcar_parser(sub)
    copy_parser(sub)
    verify_parser(sub)
    store_parsers(sub)
    add_settings_parser(sub)
    add_registry_parser(sub)
    add_onboard_parser(sub)
    return p


def _describe_subcommands(sub) -> None:
    """Make `sub.add_parser` give each command a description (its help line) and the HelpFormatter by default."""
    add_parser = sub.add_parser

    def described(name, **kw):  # `hive-aot CMD --help` shows the command's help line, not only its usage
        kw.setdefault("description", kw.get("help"))
        kw.setdefault("formatter_class", HelpFormatter)  # every option's default in its help line
        return add_parser(name, **kw)

    sub.add_parser = described


def _common_options(sp, store=True) -> None:
    """The options most commands share: --json, --registry, --recipes, --store (unless store=False), --quiet."""
    sp.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    sp.add_argument("--registry", help="a registry.yaml extending the packaged defaults "
                                       "(default: $HIVE_AOT_REGISTRY, else ./registry.yaml if present)")
    sp.add_argument("--recipes", help="a directory of recipe YAMLs extending the packaged ones "
                                      "(default: $HIVE_AOT_RECIPES, else the registry's recipes_dir)")
    if store:
        sp.add_argument("--store", help="store URI (default: $HIVE_AOT_STORE or ./artifacts)")
    sp.add_argument("--quiet", action="store_true", help=QUIET_HELP)


def _extra_providing(module: str) -> str | None:
    """The extra of hive-aot whose requirements install `module`, read from the installed metadata
    (pyproject.toml's optional-dependencies), so the two never disagree."""
    import re
    from importlib import metadata

    dist = _DIST_OF_MODULE.get(module, module).lower()
    try:
        requirements = metadata.requires("hive-aot") or []
    except metadata.PackageNotFoundError:
        return None
    for req in requirements:
        m = re.match(r"([A-Za-z0-9._-]+).*;\s*extra\s*==\s*['\"]([\w-]+)['\"]", req)
        if m and re.sub(r"[-.]", "_", m.group(1).lower()) == dist:
            return m.group(2)
    return None


def _missing_extra(command: str, e: ModuleNotFoundError) -> HiveError:
    top = (e.name or "").split(".")[0]
    extra = _extra_providing(top)
    if extra is None:
        return HiveError(f"`hive-aot {command}` needs the Python module {e.name!r}, which is not installed")
    return HiveError(f"`hive-aot {command}` needs the '{extra}' extra (module {top!r} is not installed): "
                     f"pip install 'hive-aot[{extra}]'")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    server_args: list[str] = []
    # `serve ... -- --port 8080`: the rest is the server's. Other commands keep argparse's meaning of
    # `--` (what follows is positional, e.g. a model id that starts with '-'). No option precedes the
    # command, so the command is argv[0].
    if argv[:1] == ["serve"] and "--" in argv:
        cut = argv.index("--")
        argv, server_args = argv[:cut], argv[cut + 1:]
    if argv[:1] == ["--version"]:  # before the parser, which asks for a command: `--version --json` has its own
        return cmd_version(argv[1:])
    args = parser().parse_args(argv)
    args.server_args = server_args
    try:
        if getattr(args, "quiet", False):
            from ..core.progress import silenced

            with silenced():  # through the environment: isolated engine children are quiet too
                return args.func(args)
        return args.func(args)
    except ModuleNotFoundError as e:
        return _fail(args, _missing_extra(args.command, e))
    except (HiveError, settings.SettingError) as e:
        return _fail(args, e)
    except BrokenPipeError:
        # The reader went away (`hive-aot ls | head`): stop quietly, as Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.BROKEN_PIPE
    except KeyboardInterrupt:
        print("hive-aot: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED


def _fail(args: argparse.Namespace, e: HiveError | settings.SettingError) -> int:
    print(f"hive-aot: error: {e}", file=sys.stderr)
    if getattr(args, "json", False):
        sys.stdout.write(json.dumps({"error": str(e), "exit_code": e.exit_code}) + "\n")
    return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
