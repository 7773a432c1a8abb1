"""`hive-aot` commands of the base install that read or change a store: pull, serve, profiles, tag, retire,
ls, gc (no torch, no Dagster: serving containers run them)."""

from __future__ import annotations

import sys
from pathlib import Path

from .cli_output import EXIT_OK, emit, size
from .errors import HiveError, IntegrityError


def cmd_pull(args) -> int:
    from .pull import pull

    if args.model.startswith("oci://"):
        return _cmd_pull_artifact(args)
    if not args.target:  # a usage error (exit 2, with the usage line), as argparse's own required flags are
        args.usage_error("the following arguments are required for a model of the store: --target (a runtime "
                         "profile id, or 'auto'); only an oci://HOST/REPOSITORY:TAG reference is pulled without it")
    res = pull(args.model, args.target, _dest(args.dest), recipe=args.recipe, tag=args.tag, store_uri=args.store,
               registry=args.registry, strict=args.strict, trusted=args.trusted_keys, allow_stand_in=args.allow_stand_in)
    for w in res.get("warnings", []):
        print(f"hive-aot: warning: {w}", file=sys.stderr)
    human = (f"{'already present' if res['already_present'] else 'pulled'} {res['model_id']} {res['recipe']} "
             f"(build {res['build_id'][:12]}, {size(res['size'])}) into {res['dest']}")
    if res.get("auto_target"):
        a = res["auto_target"]
        human += f"\n  target auto: found {a['found']}; chose {a['profile']}: {a['why']}"
    moved = res.get("transfer")
    if moved and (moved["resumed_bytes"] or moved["cached_blobs"]):
        parts = [f"fetched {size(moved['fetched_bytes'])}"]
        if moved["resumed_bytes"]:
            parts.append(f"resumed {size(moved['resumed_bytes'])} a killed pull had written")
        if moved["cached_blobs"]:
            parts.append(f"{moved['cached_blobs']} blob(s) already in the cache")
        human += "\n  " + "; ".join(parts)
    if res.get("image"):
        human += f"\n  image: {res['image']}"
    if res.get("env"):
        human += "\n  env: " + " ".join(f"{k}={v}" for k, v in sorted(res["env"].items()))
    if res.get("serve"):
        human += f"\n  serve: {res['serve']}"
    if res.get("serve_refused"):
        human += f"\n  hive-aot serve would refuse it: {res['serve_refused']}"
    emit(args, res, human)
    return EXIT_OK


def _cmd_pull_artifact(args) -> int:
    """`pull oci://HOST/REPOSITORY:TAG|@sha256:...`: any ModelPack artifact (foreign_pull.py)."""
    from .foreign_pull import pull_foreign

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
    return EXIT_OK


def _dest(given: str) -> Path:
    if not given.strip():  # Path("") is ".": a pull would replace the current directory's contents
        raise HiveError("--dest is empty: name the directory to pull into (e.g. --dest /models/model)")
    return Path(given)


def cmd_serve(args) -> int:
    from .serve import serve

    res = serve(args.model, args.target, _dest(args.dest), extra_args=args.server_args, dry_run=args.dry_run,
                allow_remote_code=args.allow_remote_code, recipe=args.recipe, tag=args.tag, store_uri=args.store,
                registry=args.registry, strict=args.strict, trusted=args.trusted_keys, allow_stand_in=args.allow_stand_in)
    import shlex

    env = "".join(f"{k}={shlex.quote(v)} " for k, v in sorted(res["exec_env"].items()))
    emit(args, res, f"would exec: {env}{shlex.join(res['exec'])}")  # only reached with --dry-run
    return EXIT_OK


def cmd_profiles(args) -> int:
    from .pull import profiles_report

    res = profiles_report(args.model, tag=args.tag, store_uri=args.store, registry=args.registry)
    lines = [f"{res['model_id']} ({res['tag']}) in {res['store']}:"]
    vendor = None
    for row in sorted(res["profiles"], key=lambda r: (str(r["vendor"]), str(r["role"]), r["profile"])):
        if row["vendor"] != vendor:  # grouped by vendor, then role
            vendor = row["vendor"]
            lines.append(f"  {vendor}:")
        arts = ", ".join(f"{a['recipe']} ({a['build_id'][:12]}, {size(a['size'])})" for a in row["artifacts"]) or "-"
        lines.append(f"    {row['profile']:22} {str(row['role']):13} {arts}" + (f"; pull takes {row['pull_picks']}"
                                                                                if row["pull_picks"] else ""))
    for b in res["pending_bundles"]:
        lines.append(f"  pending: {b['recipe']} export bundle {b['build_id'][:12]} ({b['format']}): compile it on a host "
                     f"with {b['needs']} (hive-aot compile {res['model_id']} --recipe {b['recipe']})")
    a = res["auto"]
    lines.append(f"--target auto here: found {a['found']}; " + (f"chooses {a['profile']}: {a['why']}" if a["profile"]
                                                                else a["why"]))
    emit(args, res, "\n".join(lines))
    return EXIT_OK


def cmd_tag(args) -> int:
    from .operations import tag

    res = tag(args.model, args.tag, recipe=args.recipe, store_uri=args.store)
    moved = f" (was {res['previous_build_id'][:12]})" if res["previous_build_id"] else ""
    emit(args, res, f"{res['model_id']} {res['recipe']} {res['tag']} -> build {res['build_id'][:12]}{moved}")
    return EXIT_OK


def cmd_retire(args) -> int:
    from .operations import retire

    res = retire(args.model, recipe=args.recipe, store_uri=args.store, dry_run=args.dry_run)
    verb = "would remove" if res["dry_run"] else "removed"
    images = f", {len(res['images'])} Modelcar image tag(s)" if res["images"] else ""
    emit(args, res, f"{verb} {len(res['refs'])} ref(s) and {len(res['manifests'])} manifest(s){images} of "
                     f"{res['model_id']}{' ' + res['recipe'] if res['recipe'] else ''}; {res['blobs_left_for_gc']} "
                     "blob(s) left for `hive-aot gc`")
    return EXIT_OK


def cmd_ls(args) -> int:
    from .inventory import list_published

    rows = list_published(args.store)
    if args.json:
        emit(args, rows, "")
    elif not rows:
        print("(store is empty)")
    else:
        # columns as wide as their widest value: a tag is never cut (bundle-latest vs bundle-<commit>)
        table = [(r["model_id"], r["recipe"], r["tag"], r["build_id"][:12], size(r["size"]), r["created_at"])
                 for r in rows]
        header = ("model", "recipe", "tag", "build", "size", "created")
        widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]
        for row in [header, *table]:
            print("  ".join(v.rjust(w) if i == 4 else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths))).rstrip())
    return EXIT_OK


def cmd_gc(args) -> int:
    from .inventory import gc

    res = gc(args.store, dry_run=args.dry_run, min_age_s=args.min_age)
    emit(args, res, f"{'would remove' if args.dry_run else 'removed'} {len(res['blobs'])} blob(s) "
                     f"({size(res['bytes'])}), {len(res['staging'])} staging record(s), "
                     f"{len(res['temporaries'])} stale temporary file(s), {len(res['work'])} dead work dir(s) and "
                     f"{len(res['partials'])} dead partial download(s)")
    return EXIT_OK


def cmd_modelcar(args) -> int:
    from .modelcar import modelcar

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
    return EXIT_OK


def pull_parsers(sub, common) -> None:
    """pull, serve and profiles: the serving container's commands."""
    sp = sub.add_parser("pull", help="fetch a published artifact (or any ModelPack artifact: oci://...) into a directory")
    sp.add_argument("model", help="org/name[@build_id], or oci://HOST[:PORT]/REPOSITORY:TAG (or @sha256:<hex>): any "
                                  "CNCF ModelPack artifact in a registry")
    sp.add_argument("--target", help="runtime profile id, or 'auto' (required, except for an oci:// artifact)")
    sp.add_argument("--dest", required=True)
    sp.add_argument("--recipe")
    sp.add_argument("--tag", default="latest")
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
    sp.add_argument("--target", default="auto", help="runtime profile id, or 'auto' (default)")
    sp.add_argument("--dest", required=True)
    sp.add_argument("--recipe")
    sp.add_argument("--tag", default="latest")
    sp.add_argument("--strict", action="store_true", help="refuse an engine version other than the validated one")
    sp.add_argument("--trusted-keys", help="ECDSA public key PEM file(s) (Ed25519: stores signed before OMS): "
                                           "require a signed manifest")
    sp.add_argument("--allow-stand-in", action="store_true", help="accept an artifact a stand-in toolchain made (tests)")
    sp.add_argument("--dry-run", action="store_true", help="pull, then print the command instead of running it")
    sp.add_argument("--allow-remote-code", action="store_true",
                    help="run --trust-remote-code servers from an unsigned manifest (a signed one needs no flag)")
    common(sp)
    sp.set_defaults(func=cmd_serve)

    sp = sub.add_parser("profiles", help="what is published for a model, per runtime profile, and what --target auto picks")
    sp.add_argument("model", help="org/name[@build_id]")
    sp.add_argument("--tag", default="latest")
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
    sp.add_argument("--tag", default="latest", help="the ref tag whose build is imaged (default latest)")
    sp.add_argument("--image-tag", help="the image's tag (default <recipe>.<tag>-modelcar); not one of the store's "
                                        "own <recipe>.<tag> tags")
    sp.add_argument("--base", metavar="IMAGE_REF", help="a base image: oci://host[:port]/repository[:tag] or a "
                                                        "repository[:tag] of the store's registry")
    sp.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    sp.add_argument("--store", help="an oci://host[:port]/repository store (default: $HIVE_AOT_STORE)")
    sp.set_defaults(func=cmd_modelcar)


def cmd_verify(args) -> int:
    from .verify import verify_published

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
        return EXIT_OK
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
    sp.add_argument("--tag", default="latest", help="the ref tag to check (default latest)")
    sp.add_argument("--deep", action="store_true", help="read and hash every blob from the store")
    sp.add_argument("--trusted-keys", help="ECDSA public key PEM file(s) (Ed25519: stores signed before OMS): also "
                                           "require a trusted signature (default: $HIVE_AOT_TRUSTED_KEYS)")
    sp.add_argument("--json", action="store_true", help="print the report as one JSON document on stdout")
    sp.add_argument("--store", help="the store (default: $HIVE_AOT_STORE)")
    sp.set_defaults(func=cmd_verify)
