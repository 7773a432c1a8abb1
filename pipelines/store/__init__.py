"""The artifact store: one layout for local directories, S3 and OCI registries (oci.py maps it onto one).

    blobs/sha256/<2 hex>/<64 hex>                     immutable, verified on write
    manifests/<model-slug>/<recipe>/<build-id>.json   immutable, deterministic bytes
    refs/<model-slug>/<recipe>/<tag>                  {build_id, manifest_sha256, created_at}
    staging/<build-id>.json                           candidate awaiting validation
    profiles.json                                     runtime profiles as last published (for pull)
"""

from __future__ import annotations

import re
from pathlib import Path

from ..core import settings
from ..core.errors import StoreError
from ..core.settings import redact_uri
from .base import Store
from .layout import blob_key, manifest_key, ref_key, staging_key


def default_store_uri() -> str:
    return settings.STORE.get()


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def open_store(uri: str | None = None) -> Store:
    """A path, `file:///absolute/path`, `s3://bucket[/prefix]`, `oci://host[:port]/repository` or
    `oci-layout:///absolute/dir/name` (an OCI image layout per repository under that directory, oci_dir.py; `name`
    is the store's repository, as in oci://, so it follows the same grammar); anything else is refused (an unknown
    scheme taken as a relative path once wrote `./ftp:/x/...` and reported success).

    A URI never carries a secret here: user-info, a query or a fragment is refused, and every message shows the
    URI without them (settings.redact_uri), so a password pasted into `--store` is not echoed to a log."""
    uri = uri or default_store_uri()
    scheme = _SCHEME.match(uri)
    shown = redact_uri(uri)
    if scheme and scheme.group(1) not in ("s3", "file", "oci", "oci-layout"):
        raise StoreError(f"{shown!r}: unknown store scheme {scheme.group(1)!r} (use a path, file:///absolute/path, "
                         "s3://bucket/prefix, oci://host[:port]/repository or oci-layout:///absolute/dir/name)")
    if scheme and shown != uri:
        where = {"oci": "HIVE_AOT_OCI_USERNAME/HIVE_AOT_OCI_PASSWORD or docker's config.json",
                 "s3": "the AWS_* variables or the AWS config files"}.get(scheme.group(1), "the environment")
        raise StoreError(f"{shown!r}: a store URI takes no user-info, query or fragment (credentials go in {where}, "
                         "never the URI)")
    if uri.startswith("file://") and not uri.startswith("file:///"):
        raise StoreError(f"{uri!r}: a file:// store URI must be absolute (file:///absolute/path)")
    if uri.startswith("oci-layout://"):
        return _layout_store(uri)
    if uri.startswith("s3://"):
        from .s3 import S3Store

        bucket, _, prefix = uri[5:].partition("/")
        if not bucket:
            raise StoreError(f"{uri!r} is not s3://bucket[/prefix]")
        return S3Store(bucket, prefix)
    if uri.startswith("oci://"):
        from .oci import OciStore

        host, _, repository = uri[6:].partition("/")
        if not host or not repository.strip("/"):
            raise StoreError(f"{uri!r} is not oci://host[:port]/repository")
        return OciStore(host, repository)
    from .local import LocalStore

    path = uri[len("file://"):] if uri.startswith("file://") else uri
    return LocalStore(Path(path).expanduser().resolve())


def _layout_store(uri: str) -> Store:
    from .oci import OciStore
    from .oci_dir import LayoutRegistry

    path = uri[len("oci-layout://"):]
    if not path.startswith("/") or not path.strip("/"):
        raise StoreError(f"{uri!r}: an oci-layout:// store URI names an absolute directory "
                         "(oci-layout:///absolute/dir/name)")
    where = Path(path).resolve()
    return OciStore(str(where.parent).rstrip("/"), where.name, registry=LayoutRegistry(where.parent, where.name))


__all__ = ["Store", "open_store", "default_store_uri", "blob_key", "manifest_key", "ref_key", "staging_key"]
