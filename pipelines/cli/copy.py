"""`hive-aot copy`: the command line of pipelines/client/copy.py."""

from __future__ import annotations

from ..core.errors import ExitCode
from .output import QUIET_HELP, emit, size


def cmd_copy(args) -> int:
    from ..client.copy import copy_model

    res = copy_model(args.model, source=args.source, dest=args.dest, recipe=args.recipe)
    lines = [f"copied {res['model_id']} from {res['from']} to {res['to']}: {len(res['builds'])} build(s), "
             f"{res['blobs_copied']} blob(s) sent ({size(res['bytes_sent'])}), {res['blobs_skipped']} already there"]
    for b in res["builds"]:
        tags = ", ".join(b["tags"]) or "no tag written"
        lines.append(f"  {b['recipe']} build {b['build_id'][:12]} ({b['files']} file(s), {size(b['bytes'])}; "
                     f"signature: {b['signature']}; tags: {tags})")
    emit(args, res, "\n".join(lines))
    return ExitCode.OK


def copy_parser(sub) -> None:
    sp = sub.add_parser("copy", help="copy a model's published builds from one store to another (any kinds)",
                        description="Copy the builds a tag names (MODEL:TAG, default latest: one per recipe) or one "
                                    "build (MODEL@BUILD, a full id or a unique prefix of 8+ hex digits) between any "
                                    "two stores: a directory, file://, s3://, oci:// or oci-layout:// (an OCI image "
                                    "layout directory, for air-gapped transfer). Every blob is verified on the way "
                                    "and skipped when the destination already holds it intact (a rerun resumes); "
                                    "the manifest keeps its bytes (same build id), its signature travels with it, "
                                    "and the refs are written last. The tag asked for moves in the destination; "
                                    "the source's other tags of the build are added where the destination lacks "
                                    "them.")
    sp.add_argument("model", help="org/name[@build_id|:tag]")
    sp.add_argument("--from", dest="source", required=True, metavar="STORE", help="the store to copy from")
    sp.add_argument("--to", dest="dest", required=True, metavar="STORE", help="the store to copy to")
    sp.add_argument("--recipe", help="only this recipe's build")
    sp.add_argument("--json", action="store_true", help="print the report as one JSON document on stdout")
    sp.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    sp.set_defaults(func=cmd_copy)
