"""`hive-aot` command line.

Conventions: `--json` prints exactly one JSON document on stdout (progress and logs go to stderr);
errors are one line on stderr. Exit codes: 0 done, 1 error (bad input, refused source, store
problem), 2 usage, 3 validation failed (nothing published), 4 check: requires_review,
5 check: incompatible.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .errors import HiveError

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_REJECTED, EXIT_REVIEW, EXIT_INCOMPATIBLE = 0, 1, 2, 3, 4, 5


def _emit(args: argparse.Namespace, doc: Any, human: str) -> None:
    if getattr(args, "json", False):
        sys.stdout.write(json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n")
    else:
        print(human)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def cmd_check(args) -> int:
    from .compat import classify_snapshot
    from .config import Config
    from .sources import fetch

    config = Config.load(args.registry)
    snap = fetch(args.source, args.model_id)
    compat = classify_snapshot(snap, config.recipes.values(), hardware=args.hardware)
    doc = {"model_id": snap.model_id, "revision": snap.revision, "commit": snap.commit, **compat.model_dump()}
    lines = [f"{snap.model_id} @ {snap.commit[:12]}: {compat.status} -> {compat.runtime_profile_id or 'none'}"]
    lines += [f"  [{c.status}] {c.name}: {c.detail}" for c in compat.checks]
    req = compat.estimated_requirements
    if req:
        lines.append(f"  parameters {req['parameters']:,}, weights {_mb(req['weights_bytes'])}")
    lines.append(f"  recipes: {', '.join(compat.recipes) or 'none'}")
    _emit(args, doc, "\n".join(lines))
    return {"compatible": EXIT_OK, "requires_review": EXIT_REVIEW}.get(compat.status, EXIT_INCOMPATIBLE)


def cmd_build(args) -> int:
    from .build import build_and_publish
    from .config import Config

    config = Config.load(args.registry)
    res = build_and_publish(args.source, args.recipe, config, args.store, args.model_id)
    v = res.validation or {}
    met = v.get("metrics", {})
    score = f" top-1 {met['top1_agreement']:.4f}, KL {met['mean_kl']:.5f}" if met else ""
    size = sum(f["size"] for f in res.files)
    if res.state == "rejected":
        human = f"rejected {res.recipe} for {res.model_id}: {'; '.join(v.get('failures', []))} (nothing published)"
    else:
        human = f"{res.state} {res.recipe} for {res.model_id}: build {res.build_id[:12]}, {_mb(size)},{score}\n  {res.manifest}"
    _emit(args, res.to_json(), human)
    if res.state == "rejected":
        print(f"hive-aot: validation failed: {'; '.join(v.get('failures', []))}", file=sys.stderr)
        return EXIT_REJECTED
    return EXIT_OK


def cmd_pull(args) -> int:
    from .pull import pull

    res = pull(args.model, args.target, Path(args.dest), recipe=args.recipe, tag=args.tag, store_uri=args.store,
               registry=args.registry)
    human = (f"{'already present' if res['already_present'] else 'pulled'} {res['model_id']} {res['recipe']} "
             f"(build {res['build_id'][:12]}, {_mb(res['size'])}) into {res['dest']}")
    if res.get("serve"):
        human += f"\n  serve: {res['serve']}"
    _emit(args, res, human)
    return EXIT_OK


def cmd_ls(args) -> int:
    from .inventory import list_published

    rows = list_published(args.store)
    if args.json:
        _emit(args, rows, "")
    elif not rows:
        print("(store is empty)")
    else:
        print(f"{'model':40} {'recipe':14} {'tag':10} {'build':12} {'size':>10}  created")
        for r in rows:
            tag = r["tag"] if len(r["tag"]) <= 10 else r["tag"][:9] + "…"
            print(f"{r['model_id']:40} {r['recipe']:14} {tag:10} {r['build_id'][:12]} {_mb(r['size']):>10}  {r['created_at']}")
    return EXIT_OK


def cmd_gc(args) -> int:
    from .inventory import gc

    res = gc(args.store, dry_run=args.dry_run, min_age_s=args.min_age)
    _emit(args, res, f"{'would remove' if args.dry_run else 'removed'} {len(res['blobs'])} blob(s) "
                     f"({_mb(res['bytes'])}) and {len(res['staging'])} staging record(s)")
    return EXIT_OK


def cmd_onboard(args) -> int:
    from .orchestration.onboard import onboard

    res = onboard(registry=args.registry, store=args.store, models=args.model or None)
    if args.json:
        _emit(args, res, "")
    else:
        for r in res["results"]:
            print(f"{r['model_id']:40} {r['recipe']:14} {r['state']:10} {r.get('build_id', '')[:12]}")
    return EXIT_OK if res["success"] else EXIT_ERROR


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hive-aot", description="Ahead-of-time model artifact factory.")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp, store=True):
        sp.add_argument("--json", action="store_true", help="print one JSON document on stdout")
        sp.add_argument("--registry", help="registry.yaml (default: $HIVE_AOT_REGISTRY or ./registry.yaml)")
        if store:
            sp.add_argument("--store", help="store URI (default: $HIVE_AOT_STORE or ./artifacts)")

    sp = sub.add_parser("check", help="classify a model: status, runtime profile, checks, requirements")
    sp.add_argument("source", help="hf://owner/repo[@rev], owner/repo[@rev] or a local directory")
    sp.add_argument("--hardware", default="nvidia", help="nvidia (default), amd, intel, cpu, qaic")
    sp.add_argument("--model-id", help="model id for a local directory source")
    common(sp, store=False)
    sp.set_defaults(func=cmd_check)

    sp = sub.add_parser("build", help="build, validate and publish one recipe for one model")
    sp.add_argument("source")
    sp.add_argument("--recipe", required=True)
    sp.add_argument("--model-id", help="model id (org/name) for a local directory source")
    common(sp)
    sp.set_defaults(func=cmd_build)

    sp = sub.add_parser("pull", help="fetch a published artifact into a directory")
    sp.add_argument("model", help="org/name[@build_id]")
    sp.add_argument("--target", required=True, help="runtime profile id, or 'auto'")
    sp.add_argument("--dest", required=True)
    sp.add_argument("--recipe")
    sp.add_argument("--tag", default="latest")
    common(sp)
    sp.set_defaults(func=cmd_pull)

    sp = sub.add_parser("ls", help="list published artifacts")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--store")
    sp.set_defaults(func=cmd_ls)

    sp = sub.add_parser("gc", help="remove unreferenced blobs and stale staging records")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--store")
    sp.add_argument("--dry-run", action="store_true")
    sp.add_argument("--min-age", type=float, default=3600.0, help="only collect items older than this many seconds")
    sp.set_defaults(func=cmd_gc)

    sp = sub.add_parser("onboard", help="run the Dagster onboarding job headless for registry models")
    sp.add_argument("--model", action="append", help="only this model id (repeatable)")
    common(sp)
    sp.set_defaults(func=cmd_onboard)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except HiveError as e:
        print(f"hive-aot: error: {e}", file=sys.stderr)
        if getattr(args, "json", False):
            sys.stdout.write(json.dumps({"error": str(e), "exit_code": e.exit_code}) + "\n")
        return e.exit_code
    except KeyboardInterrupt:
        print("hive-aot: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
