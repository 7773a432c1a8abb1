"""`hive-aot` commands of the base install that read or change a store: pull, serve, profiles, tag, retire,
ls, gc (no torch, no Dagster: serving containers run them)."""

from __future__ import annotations

import re
import sys
from datetime import UTC
from pathlib import Path

from ..core.errors import ExitCode, HiveError, IntegrityError
from .output import QUIET_HELP, emit, size, table


def cmd_pull(args) -> int:
    from ..client.pull import pull

    if args.model.startswith("oci://"):
        return _cmd_pull_artifact(args)
    if not args.target:  # a usage error (exit 2, with the usage line), as argparse's own required flags are
        args.usage_error("the following arguments are required for a model of the store: --target (a runtime "
                         "profile id, or 'auto'); only an oci://HOST/REPOSITORY:TAG reference is pulled without it")
    res = pull(args.model, args.target, _dest(args.dest), recipe=args.recipe, tag=args.tag, store_uri=args.store,
               registry=args.registry, strict=args.strict, trusted=args.trusted_keys, allow_stand_in=args.allow_stand_in)
    for w in res.warnings:
        print(f"hive-aot: warning: {w}", file=sys.stderr)
    human = (f"{'already present' if res.already_present else 'pulled'} {res.model_id} {res.recipe} "
             f"(build {res.build_id[:12]}, {size(res.size)}) into {res.dest}")
    if res.auto_target:
        a = res.auto_target
        human += f"\n  target auto: found {a.found}; chose {a.profile}: {a.why}"
    moved = res.transfer
    if moved and (moved.resumed_bytes or moved.cached_blobs):
        parts = [f"fetched {size(moved.fetched_bytes)}"]
        if moved.resumed_bytes:
            parts.append(f"resumed {size(moved.resumed_bytes)} a killed pull had written")
        if moved.cached_blobs:
            parts.append(f"{moved.cached_blobs} blob(s) already in the cache")
        human += "\n  " + "; ".join(parts)
    if res.image:
        human += f"\n  image: {res.image}"
    if res.env:
        human += "\n  env: " + " ".join(f"{k}={v}" for k, v in sorted(res.env.items()))
    if res.serve:
        human += f"\n  serve: {res.serve}"
    if res.serve_refused:
        human += f"\n  hive-aot serve would refuse it: {res.serve_refused}"
    emit(args, res.to_json(), human)
    return ExitCode.OK


def _cmd_pull_artifact(args) -> int:
    """`pull oci://HOST/REPOSITORY:TAG|@sha256:...`: any ModelPack artifact (foreign_pull.py)."""
    from ..client.foreign_pull import pull_foreign

    given = [flag for flag, value in (("--target", args.target), ("--recipe", args.recipe), ("--store", args.store),
                                      ("--tag", args.tag != "latest"), ("--strict", args.strict),
                                      ("--allow-stand-in", args.allow_stand_in)) if value]
    if given:
        raise HiveError(f"{', '.join(given)}: not for an oci:// artifact reference, which names its registry, "
                        f"repository and tag (or digest) itself and carries no runtime profile")
    res = pull_foreign(args.model, _dest(args.dest), trusted=args.trusted_keys)
    human = (f"{'already present' if res['already_present'] else 'pulled'} {res['reference']} ({res['digest'][:19]}, "
             f"{len(res['files'])} file(s), {size(res['size'])}) into {res['dest']}")
    if res["signed_by"]:
        human += f"\n  signed by {res['signed_by']}"
    moved = res.get("transfer")
    if moved and (moved["resumed_bytes"] or moved["cached_blobs"]):
        human += (f"\n  fetched {size(moved['fetched_bytes'])}; resumed {size(moved['resumed_bytes'])}; "
                  f"{moved['cached_blobs']} layer(s) already in the cache")
    emit(args, res, human)
    return ExitCode.OK


def _dest(given: str) -> Path:
    if not given.strip():  # Path("") is ".": a pull would replace the current directory's contents
        raise HiveError("--dest is empty: name the directory to pull into (e.g. --dest /models/model)")
    return Path(given)


def cmd_serve(args) -> int:
    from ..client.serve import PLACEHOLDER_DEST, serve

    if args.dest is None and not args.dry_run:  # a usage error (exit 2), as argparse's own required flags are
        args.usage_error("the following arguments are required: --dest (only --dry-run, which downloads nothing, "
                         "goes without it)")
    dest = _dest(args.dest) if args.dest is not None else PLACEHOLDER_DEST
    res = serve(args.model, args.target, dest, extra_args=args.server_args, dry_run=args.dry_run,
                allow_remote_code=args.allow_remote_code, recipe=args.recipe, tag=args.tag, store_uri=args.store,
                registry=args.registry, strict=args.strict, trusted=args.trusted_keys, allow_stand_in=args.allow_stand_in)
    import shlex

    env = "".join(f"{k}={shlex.quote(v)} " for k, v in sorted(res["exec_env"].items()))
    where = ""
    if args.dest is None:
        res["dest_placeholder"] = True  # for a JSON reader: "dest" is not a directory anyone named
        where = f"\n  (no --dest: {PLACEHOLDER_DEST} stands for the directory it would pull into)"
    emit(args, res, f"would exec: {env}{shlex.join(res['exec'])}{where}")  # only reached with --dry-run
    return ExitCode.OK


def cmd_profiles(args) -> int:
    from ..client.pull import profiles_report

    res = profiles_report(args.model, tag=args.tag, store_uri=args.store, registry=args.registry)
    lines = [f"{res['model_id']} ({res['tag']}) in {res['store']}:"]
    rows = sorted(res["profiles"], key=lambda r: (str(r["vendor"]), str(r["role"]), r["profile"]))  # by vendor, role
    lines += ["  " + line for line in table(
        ("vendor", "profile", "role", "pull takes", "published"),
        [(str(r["vendor"]), r["profile"], str(r["role"]), r["pull_picks"] or "-",
          ", ".join(f"{a['recipe']} ({a['build_id'][:12]}, {size(a['size'])})" for a in r["artifacts"]) or "-")
         for r in rows]).splitlines()]
    for b in res["pending_bundles"]:
        lines.append(f"  pending: {b['recipe']} export bundle {b['build_id'][:12]} ({b['format']}): compile it on a host "
                     f"with {b['needs']} (hive-aot compile {res['model_id']} --recipe {b['recipe']})")
    a = res["auto"]
    lines.append(f"--target auto here: found {a['found']}; " + (f"chooses {a['profile']}: {a['why']}" if a["profile"]
                                                                else a["why"]))
    emit(args, res, "\n".join(lines))
    return ExitCode.OK


def cmd_tag(args) -> int:
    from ..client.operations import tag

    res = tag(args.model, args.tag, recipe=args.recipe, store_uri=args.store)
    moved = f" (was {res['previous_build_id'][:12]})" if res["previous_build_id"] else ""
    emit(args, res, f"{res['model_id']} {res['recipe']} {res['tag']} -> build {res['build_id'][:12]}{moved}")
    return ExitCode.OK


def cmd_retire(args) -> int:
    from ..client.operations import retire

    res = retire(args.model, recipe=args.recipe, store_uri=args.store, dry_run=args.dry_run)
    verb = "would remove" if res["dry_run"] else "removed"
    images = f", {len(res['images'])} Modelcar image tag(s)" if res["images"] else ""
    emit(args, res, f"{verb} {len(res['refs'])} ref(s) and {len(res['manifests'])} manifest(s){images} of "
                     f"{res['model_id']}{' ' + res['recipe'] if res['recipe'] else ''}; {res['blobs_left_for_gc']} "
                     "blob(s) left for `hive-aot gc`")
    return ExitCode.OK


# A hex run this long is an id (a build id, a source's hash or commit in a tag): `ls` shows its first 12 digits,
# as every other command prints a build id; `--json` has it whole.
_LONG_HEX = re.compile(r"[0-9a-f]{40,}")


def short_ids(text: str) -> str:
    return _LONG_HEX.sub(lambda m: m.group(0)[:12], text)


def _minute_utc(stamp: str) -> str:
    """A ref's ISO 8601 time as `2026-05-01 12:34` in UTC (what a table has room for); as it is when unreadable."""
    from datetime import datetime

    try:
        when = datetime.fromisoformat(stamp)
    except ValueError:
        return stamp
    return (when.astimezone(UTC) if when.tzinfo else when).strftime("%Y-%m-%d %H:%M")


def cmd_ls(args) -> int:
    from ..client.inventory import list_published, published_builds

    rows = list_published(args.store)
    if args.json:
        emit(args, rows, "")
    elif not rows:
        print("(store is empty)")
    else:
        print(table(("model", "recipe", "build", "tags", "size", "created (UTC)"),
                    [(r["model_id"], r["recipe"], short_ids(r["build_id"]), short_ids(", ".join(r["tags"])),
                      size(r["size"]), _minute_utc(r["created_at"])) for r in published_builds(rows)], right=(4,)))
    return ExitCode.OK


def cmd_gc(args) -> int:
    from ..client.inventory import gc

    res = gc(args.store, dry_run=args.dry_run, min_age_s=args.min_age)
    emit(args, res, f"{'would remove' if args.dry_run else 'removed'} {len(res['blobs'])} blob(s) "
                     f"({size(res['bytes'])}), {len(res['staging'])} staging record(s), "
                     f"{len(res['temporaries'])} stale temporary file(s), {len(res['work'])} dead work dir(s) and "
                     f"{len(res['partials'])} dead partial download(s)")
    return ExitCode.OK


def cmd_modelcar(args) -> int:
    from ..client.modelcar import modelcar

    res = modelcar(args.model, store_uri=args.store, recipe=args.recipe, build=args.build, tag=args.tag,
                   image_tag=args.image_tag, base=args.base)
    verb = "already there:" if res["already_present"] else "pushed"
    human = (f"{verb} Modelcar of {res['model_id']} {res['recipe']} (build {res['build_id'][:12]}, {res['files']} "
             f"file(s), layer {size(res['layer_size'])}" + (f", on {res['base']}" if res["base"] else "")
             + f")\n  {res['storage_uri']}\n  digest {res['digest']}")
    if not res["base"]:
        human += "\n  no base image: for image volumes (subPath: models) and oci+native://; KServe's Modelcar mode " \
                 "needs --base (a runnable image with a shell, e.g. busybox)"
    emit(args, res, human)
    return ExitCode.OK


class ProfileIds:
    """The runtime profile ids `--target` takes, read when a help text is printed (not at every parse): the packaged
    registry's, extended by the deployment's ($HIVE_AOT_REGISTRY or ./registry.yaml)."""

    def __str__(self) -> str:
        from ..config.registry import load_registry
        from ..core.errors import ConfigError

        try:
            registry, _ = load_registry()
        except ConfigError:  # a broken deployment registry: --help still answers, with the packaged profiles
            from ..config.registry import packaged_defaults_dir

            registry, _ = load_registry(packaged_defaults_dir() / "registry.yaml")
        return ", ".join(p.id for p in registry.runtime_profiles)


def target_option(sp, text: str, **kw) -> None:
    """`--target`, its help naming every runtime profile (%(profiles)s: filled in when help is printed)."""
    action = sp.add_argument("--target", metavar="PROFILE", help=text + "; the profiles: %(profiles)s", **kw)
    action.profiles = ProfileIds()


def pull_parsers(sub, common) -> None:
    """pull, serve and profiles: the serving container's commands."""
    sp = sub.add_parser("pull", help="fetch a published artifact (or any ModelPack artifact: oci://...) into a directory")
    sp.add_argument("model", help="org/name[@build_id], or oci://HOST[:PORT]/REPOSITORY:TAG (or @sha256:<hex>): any "
                                  "CNCF ModelPack artifact in a registry")
    target_option(sp, "runtime profile id, or 'auto' (required, except for an oci:// artifact)")
    sp.add_argument("--dest", required=True, metavar="DIR", help="the directory to pull into (replaced as a whole)")
    sp.add_argument("--recipe", help="this recipe's artifact (default: the profile's preferred one published)")
    sp.add_argument("--tag", default="latest", help="the ref tag to pull")
    sp.add_argument("--strict", action="store_true",
                    help="fail when this container's engine version differs from the one the artifact was validated with")
    sp.add_argument("--trusted-keys", help="ECDSA public key PEM file(s) (Ed25519: stores signed before OMS), "
                                           "comma-separated: require the manifest to be signed by one (default: "
                                           "$HIVE_AOT_TRUSTED_KEYS)")
    sp.add_argument("--allow-stand-in", action="store_true", help="accept an artifact a stand-in toolchain made (tests)")
    common(sp)
    sp.set_defaults(func=cmd_pull, usage_error=sp.error)

    sp = sub.add_parser("serve", help="a serving container's entrypoint: pull, then exec the manifest's server "
                                      "(arguments after -- are appended to the server's)")
    sp.add_argument("model", help="org/name[@build_id]")
    target_option(sp, "runtime profile id, or 'auto' (this host's accelerator decides)", default="auto")
    sp.add_argument("--dest", metavar="DIR", help="the directory to pull into (required, except with --dry-run)")
    sp.add_argument("--recipe", help="this recipe's artifact (default: the profile's preferred one published)")
    sp.add_argument("--tag", default="latest", help="the ref tag to serve")
    sp.add_argument("--strict", action="store_true", help="refuse an engine version other than the validated one")
    sp.add_argument("--trusted-keys", help="ECDSA public key PEM file(s) (Ed25519: stores signed before OMS): "
                                           "require a signed manifest")
    sp.add_argument("--allow-stand-in", action="store_true", help="accept an artifact a stand-in toolchain made (tests)")
    sp.add_argument("--dry-run", action="store_true", help="print the server command and its environment instead of "
                                                            "running it; downloads nothing (--dest optional)")
    sp.add_argument("--allow-remote-code", action="store_true",
                    help="run --trust-remote-code servers from an unsigned manifest (a signed one needs no flag)")
    common(sp)
    sp.set_defaults(func=cmd_serve, usage_error=sp.error)

    sp = sub.add_parser("profiles", help="what is published for a model, per runtime profile, and what --target auto picks")
    sp.add_argument("model", help="org/name[@build_id]")
    sp.add_argument("--tag", default="latest", help="the ref tag to report on")
    common(sp)
    sp.set_defaults(func=cmd_profiles)


def modelcar_parser(sub) -> None:
    sp = sub.add_parser("modelcar", help="push a Modelcar image of a published artifact (its files under /models) "
                                         "to the artifact's repository in an oci:// store",
                        description="Push a regular OCI image whose one added layer is an uncompressed tar of the "
                                    "artifact's files under models/ (deterministic: the same artifact gives the same "
                                    "digest), streamed from the store to the registry, tagged <recipe>.<tag>-modelcar "
                                    "(or <recipe>.<build id>-modelcar with --build) in the model's repository. "
                                    "Without --base the image has no shell: it is for Kubernetes image volumes "
                                    "(subPath: models) and KServe's oci+native://. KServe's Modelcar mode "
                                    "(storageUri: oci://..., enableModelcar) runs `ln` and `sleep` in it: give "
                                    "--base a runnable image such as busybox.")
    sp.add_argument("model", help="org/name[@build_id]")
    sp.add_argument("--recipe", help="the recipe (default: the only one published with --tag)")
    sp.add_argument("--build", help="a build id (or a unique prefix of 8+ of its hex digits) instead of a tag")
    sp.add_argument("--tag", default="latest", help="the ref tag whose build is imaged")
    sp.add_argument("--image-tag", help="the image's tag (default <recipe>.<tag>-modelcar); not one of the store's "
                                        "own <recipe>.<tag> tags")
    sp.add_argument("--base", metavar="IMAGE_REF", help="a base image: oci://host[:port]/repository[:tag] or a "
                                                        "repository[:tag] of the store's registry")
    sp.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    sp.add_argument("--store", help="an oci://host[:port]/repository store (default: $HIVE_AOT_STORE)")
    sp.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    sp.set_defaults(func=cmd_modelcar)


def cmd_verify(args) -> int:
    from ..client.verify import verify_published

    res = verify_published(args.model, recipe=args.recipe, tag=args.tag, store_uri=args.store, deep=args.deep,
                           trusted=args.trusted_keys)
    lines = []
    for b in res["builds"]:
        ok = sum(f["state"] == "intact" for f in b["files"])
        signed = f", signed by {b['signed_by']}" if b["signed_by"] else ""
        lines.append(f"{res['model_id']} {b['recipe']} (build {b['build_id'][:12]}): {ok} of {len(b['files'])} "
                     f"file(s) intact by {b['checked']}{signed}")
        lines += [f"  {p}" for p in b["problems"]]
    emit(args, res, "\n".join(lines))
    if res["intact"]:
        return ExitCode.OK
    damaged = [f"{b['recipe']} {b['build_id'][:12]}" for b in res["builds"] if not b["intact"]]
    print(f"hive-aot: error: {res['model_id']}: {', '.join(damaged)} not intact in {res['store']} (the next "
          f"`hive-aot build` of a build id re-uploads its damaged blobs)", file=sys.stderr)
    return IntegrityError.exit_code


def verify_parser(sub) -> None:
    sp = sub.add_parser("verify", help="check a model's published builds in the store without pulling them "
                                       "(manifests, signatures, every blob at its size and intact)",
                        description="Check what a tag (or build id) of a model names in any store: the manifests "
                                    "as pull reads them, their signatures with --trusted-keys, and every blob by "
                                    "the store's own policy (a local store hashes; S3 compares its upload "
                                    "evidence), or with --deep by reading and hashing every blob from the store "
                                    "(nothing is written). Exit 0 when everything is intact, 1 otherwise.")
    sp.add_argument("model", help="org/name[@build_id]")
    sp.add_argument("--recipe", help="only this recipe (default: every recipe the tag names)")
    sp.add_argument("--tag", default="latest", help="the ref tag to check")
    sp.add_argument("--deep", action="store_true", help="read and hash every blob from the store")
    sp.add_argument("--trusted-keys", help="ECDSA public key PEM file(s) (Ed25519: stores signed before OMS): also "
                                           "require a trusted signature (default: $HIVE_AOT_TRUSTED_KEYS)")
    sp.add_argument("--json", action="store_true", help="print the report as one JSON document on stdout")
    sp.add_argument("--store", help="the store (default: $HIVE_AOT_STORE)")
    sp.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    sp.set_defaults(func=cmd_verify)


STORE_HELP = "store URI: a directory, file://, s3://, oci:// or oci-layout:// (default: $HIVE_AOT_STORE, else ./artifacts)"
JSON_HELP = "print one JSON document on stdout"


def store_parsers(sub) -> None:
    """tag, retire, ls and gc: what an operator does to a store's refs and blobs."""
    sp = sub.add_parser("tag", help="point a tag at a published build (promote it, or roll a tag back to it)")
    sp.add_argument("model", metavar="MODEL_ID@BUILD_ID",
                    help="the model and the build to tag (a full build id or a unique prefix of 8+ hex digits)")
    sp.add_argument("tag", help="e.g. latest, stable, canary (an export bundle takes only bundle-* tags)")
    sp.add_argument("--recipe", help="the build's recipe, when one build id is published for several")
    sp.add_argument("--json", action="store_true", help=JSON_HELP)
    sp.add_argument("--store", help=STORE_HELP)
    sp.set_defaults(func=cmd_tag)

    sp = sub.add_parser("retire", help="remove a model's refs and manifests (licence takedown); gc removes its blobs")
    sp.add_argument("model", metavar="MODEL_ID", help="the model to retire (org/name)")
    sp.add_argument("--recipe", help="only this recipe of the model (default: every recipe)")
    sp.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    sp.add_argument("--json", action="store_true", help=JSON_HELP)
    sp.add_argument("--store", help=STORE_HELP)
    sp.set_defaults(func=cmd_retire)

    sp = sub.add_parser("ls", help="list published artifacts: one row per build, its tags joined (long ids cut to 12 "
                                   "characters; --json has them whole, one record per tag)")
    sp.add_argument("--json", action="store_true", help=JSON_HELP + ": one record per tag, ids in full")
    sp.add_argument("--store", help=STORE_HELP)
    sp.set_defaults(func=cmd_ls)

    sp = sub.add_parser("gc", help="remove unreferenced blobs and stale staging records")
    sp.add_argument("--json", action="store_true", help=JSON_HELP)
    sp.add_argument("--store", help=STORE_HELP)
    sp.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    sp.add_argument("--min-age", type=float, default=3600.0, metavar="SECONDS",
                    help="only collect blobs, staging records and temporary files older than this many seconds "
                         "(a build in flight uploads blobs before its manifest)")
    sp.set_defaults(func=cmd_gc)
