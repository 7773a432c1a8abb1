"""A store in an S3 bucket (AWS, MinIO, SeaweedFS, Ceph RGW): `s3://bucket/prefix`.

boto3 reads credentials and `AWS_ENDPOINT_URL` from the environment as usual; they never appear in
a message. Each PUT is atomic per object, which is what the store layout needs (blobs are
content-addressed, manifests immutable, the ref write is the commit point). Large blobs go both ways as
parallel parts over presigned URLs with http.client (s3_ranges.py, s3_upload.py), hashed as they stream; behind
a proxy, through botocore.
"""

from __future__ import annotations

import base64
import hashlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from ..core.errors import HiveError, StoreError
from ..core.hashing import sha256_file
from ..core.paths import safe_relpath
from .base import Entry, Store
from .faults import store_event
from .layout import blob_key
from .s3_http import usable as http_usable
from .s3_ranges import RangeReader
from .s3_upload import ETAG_TAG, ETAG_TAGGED, SHA256_CHECKSUM, MultipartUpload, abandoned_uploads, mismatch

CHUNK = 64 * 1024 * 1024
RANGE_CHUNK = 1 << 20  # bytes per read of a ranged GET's body


def _b64(hex_digest: str) -> str:
    """A hex sha256 as S3 spells checksums (base64 of the raw digest)."""
    return base64.b64encode(bytes.fromhex(hex_digest)).decode()


class S3Store(Store):
    def __init__(self, bucket: str, prefix: str = ""):
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.uri = f"s3://{bucket}" + (f"/{self.prefix}" if self.prefix else "")
        try:  # not in the base install: a container pulling from oci:// or a directory does without it
            import boto3
            from boto3.s3.transfer import TransferConfig
            from botocore.config import Config
        except ModuleNotFoundError as e:
            raise StoreError(f"{self.uri} needs boto3, which the base install leaves out ({e.name} is missing): "
                             "pip install 'hive-aot[s3]'") from None
        self.client = boto3.client("s3", config=Config(retries={"max_attempts": 5, "mode": "standard"}))
        self.transfer = TransferConfig(multipart_threshold=CHUNK, multipart_chunksize=CHUNK, max_concurrency=8)
        self._ranges: RangeReader | None = None
        self._uploads: MultipartUpload | None = None

    def _key(self, key: str) -> str:
        try:
            safe_relpath(key, what="store key")
        except HiveError as e:
            raise StoreError(str(e)) from None
        return f"{self.prefix}/{key}" if self.prefix else key

    @staticmethod
    def _reason(e: Exception) -> str:
        code = getattr(e, "response", {}).get("Error", {}).get("Code") if hasattr(e, "response") else None
        return {"NoSuchBucket": "bucket not found", "AccessDenied": "access denied",
                "InvalidAccessKeyId": "credentials refused", "SignatureDoesNotMatch": "credentials refused"}.get(
            code or "", code or type(e).__name__)

    def _error(self, what: str, e: Exception) -> StoreError:
        return StoreError(f"{self.uri}: cannot {what} ({self._reason(e)})")

    def _missing(self, e: Exception) -> bool:
        code = getattr(e, "response", {}).get("Error", {}).get("Code") if hasattr(e, "response") else None
        return code in ("NoSuchKey", "404", "NotFound")

    def check_writable(self) -> None:
        probe = self._key(f".write-check-{uuid.uuid4().hex}")
        try:
            self.client.put_object(Bucket=self.bucket, Key=probe, Body=b"")
            self.client.delete_object(Bucket=self.bucket, Key=probe)
        except Exception as e:  # noqa: BLE001 - botocore raises several unrelated classes
            raise StoreError(f"store {self.uri} is not writable ({self._reason(e)})") from None

    def read_bytes(self, key: str) -> bytes | None:
        k = self._key(key)
        try:
            return self.client.get_object(Bucket=self.bucket, Key=k)["Body"].read()
        except Exception as e:  # noqa: BLE001
            if self._missing(e):
                return None
            raise self._error(f"read {key}", e) from None

    def write_bytes(self, key: str, data: bytes) -> None:
        k = self._key(key)
        store_event("temp", key)
        try:
            self.client.put_object(Bucket=self.bucket, Key=k, Body=data)
        except Exception as e:  # noqa: BLE001
            raise self._error(f"write {key}", e) from None
        store_event("done", key)

    def _head(self, key: str, **extra) -> dict | None:
        k = self._key(key)
        try:
            return self.client.head_object(Bucket=self.bucket, Key=k, **extra)
        except Exception as e:  # noqa: BLE001
            if self._missing(e):
                return None
            raise self._error(f"stat {key}", e) from None

    def blob_intact(self, digest: str, size: int) -> bool:
        """Whether the object still holds the bytes hive-aot's verified upload put there, from the store's own
        answers (no byte of the blob is read: re-reading every blob to verify a skipped build would cost its whole
        download). Size and the sha256 recorded at upload (object metadata), and the evidence the upload left
        (s3_upload.py): S3's own SHA-256 checksum of a single PUT, or the multipart completion's ETag kept in an
        object tag, compared with the ETag the object has now. An object replaced since, even with the metadata
        copied, lacks that evidence and counts as damaged; the next build uploads it again.

        What this cannot see: blobs uploaded before the evidence existed, or behind a proxy (boto3's transfer
        manager), or on a store without object tagging, are checked by metadata alone; and a writer who forges the
        evidence on purpose. `hive-aot verify --deep` reads and hashes every blob; pull always does."""
        head = self._head(blob_key(digest), ChecksumMode="ENABLED")
        meta = {} if head is None else head.get("Metadata", {})
        if head is None or int(head["ContentLength"]) != size or meta.get("sha256") != digest:
            return False
        evidence = meta.get("evidence")
        if evidence == SHA256_CHECKSUM:
            return head.get("ChecksumSHA256") == _b64(digest)
        if evidence == ETAG_TAGGED:
            tags = self._tags(self._key(blob_key(digest)))
            return tags is None or tags.get(ETAG_TAG) == head.get("ETag", "").strip('"')
        return True  # uploaded without evidence (see above): metadata alone

    def _tags(self, k: str) -> dict[str, str] | None:
        """The object's tags; None when the store does not implement object tagging."""
        try:
            found = self.client.get_object_tagging(Bucket=self.bucket, Key=k).get("TagSet", [])
        except Exception as e:  # noqa: BLE001
            code = getattr(e, "response", {}).get("Error", {}).get("Code") if hasattr(e, "response") else None
            if code in ("NotImplemented", "MethodNotAllowed", "501"):
                return None
            raise self._error(f"read the tags of {k}", e) from None
        return {t.get("Key"): t.get("Value") for t in found if isinstance(t, dict)}

    def exists(self, key: str) -> bool:
        return self._head(key) is not None

    def size(self, key: str) -> int | None:
        head = self._head(key)
        return None if head is None else int(head["ContentLength"])

    def modified(self, key: str) -> float | None:
        head = self._head(key)
        return None if head is None else head["LastModified"].timestamp()

    def list(self, prefix: str) -> list[str]:
        return [e.key for e in self.list_entries(prefix)]

    def list_entries(self, prefix: str) -> list[Entry]:
        full = self._key(prefix.rstrip("/")) + "/" if prefix else (self.prefix + "/" if self.prefix else "")
        out = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
                for obj in page.get("Contents", []):
                    key = obj["Key"][len(self.prefix) + 1:] if self.prefix else obj["Key"]
                    if not key.rsplit("/", 1)[-1].startswith("."):
                        out.append(Entry(key, int(obj.get("Size", 0)), obj["LastModified"].timestamp()))
        except Exception as e:  # noqa: BLE001
            raise self._error(f"list {prefix or '/'}", e) from None
        return sorted(out, key=lambda e: e.key)

    def delete(self, key: str) -> None:
        k = self._key(key)
        try:
            self.client.delete_object(Bucket=self.bucket, Key=k)
        except Exception as e:  # noqa: BLE001
            if not self._missing(e):
                raise self._error(f"delete {key}", e) from None
            return
        store_event("delete", key)

    def upload_file(self, key: str, path: Path, sha256: str) -> None:
        # Verified on the way: S3 has no rename, so what lands under a digest must already match it. A large file
        # goes up in parts, hashed as they go, the upload completed only on a match (s3_upload.py); a small one is
        # read once, hashed, then sent.
        k = self._key(key)
        store_event("temp", key)
        try:
            if path.stat().st_size < CHUNK:
                data = path.read_bytes()
                if hashlib.sha256(data).hexdigest() != sha256:
                    raise mismatch(path, sha256, key)
                self.client.put_object(Bucket=self.bucket, Key=k, Body=data, ChecksumSHA256=_b64(sha256),
                                       Metadata={"sha256": sha256, "evidence": SHA256_CHECKSUM})
            elif http_usable():
                if self._uploads is None:
                    self._uploads = MultipartUpload(self.client, self.bucket, self.uri)
                self._uploads.upload(key, k, path, sha256)
            else:  # behind a proxy: boto3's transfer manager, after a full read to verify
                if sha256_file(path) != sha256:
                    raise mismatch(path, sha256, key)
                self.client.upload_file(str(path), self.bucket, k, Config=self.transfer,
                                        ExtraArgs={"Metadata": {"sha256": sha256}})
        except (HiveError, OSError):
            raise
        except Exception as e:  # noqa: BLE001 - botocore raises several unrelated classes
            raise self._error(f"upload {key}", e) from None
        store_event("done", key)

    def reclaim_temporaries(self, min_age_s: float, dry_run: bool = False) -> list[str]:
        """Abort the multipart uploads killed publishers left (invisible, but their parts take space) once they are
        older than min_age_s: a younger one may belong to a publish in flight."""
        prefix = self.prefix + "/" if self.prefix else ""
        try:
            found = abandoned_uploads(self.client, self.bucket, prefix, time.time() - min_age_s)
            if not dry_run:
                for k, upload_id in found:
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=k, UploadId=upload_id)
        except Exception as e:  # noqa: BLE001
            raise self._error("list or abort unfinished uploads", e) from None
        return [f"{k[len(prefix):]} (unfinished upload)" for k, _ in found]

    def iter_range(self, key: str, start: int, length: int) -> Iterator[bytes]:
        if length <= 0:
            return
        k = self._key(key)
        if http_usable():  # http.client over a presigned URL: faster than botocore's body (s3_ranges.py)
            if self._ranges is None:
                self._ranges = RangeReader(self.client, self.bucket, self.uri)
            yield from self._ranges.iter_range(key, k, start, length, RANGE_CHUNK)
            return
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=k, Range=f"bytes={start}-{start + length - 1}")["Body"]
            yield from body.iter_chunks(RANGE_CHUNK)
        except Exception as e:  # noqa: BLE001 - botocore and urllib3 raise several unrelated classes
            if self._missing(e):
                raise StoreError(f"{self.uri}: {key} is missing") from None
            raise self._error(f"read {key}", e) from None

    def download_file(self, key: str, dest: Path, progress=None) -> None:
        k = self._key(key)
        try:
            self.client.download_file(self.bucket, k, str(dest), Config=self.transfer,
                                      Callback=(progress.update if progress is not None else None))
        except Exception as e:  # noqa: BLE001
            raise self._error(f"download {key}", e) from None
