"""A blob's upload to S3 in one read of the file: its parts go out in parallel straight from the page cache
(sendfile over presigned URLs, s3_http.py) while the sha256 follows in order from the same file, and the upload
completes only when that digest is the blob's key and the file did not change meanwhile.

What this replaces cost three full reads and two extra hash passes of every blob: a sha256 of the file before the
upload, then boto3's `upload_file`, whose SigV4 signing over plain HTTP hashes each part's payload again (a
presigned URL signs `UNSIGNED-PAYLOAD`), with its default CRC32 on top. An incomplete multipart upload is
invisible to readers: a killed publisher leaves nothing under the key, and `gc` aborts what it left behind
(`abandoned_uploads`). The object's metadata carries the sha256 (set when the upload is created; it becomes
visible only with a matching digest), which `S3Store.blob_intact` reads, with the completion's ETag kept in an
object tag (`tag_etag`): a later overwrite of the key, even one that copies the metadata, is told apart.
"""

from __future__ import annotations

import hashlib
import http.client
import os
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import suppress
from pathlib import Path
from urllib.parse import urlsplit

from ..core.errors import IntegrityError, StoreError
from .s3_http import URL_LIFETIME_S, ThreadConnections, status_error

PART_BYTES = 64 << 20  # S3 allows 10,000 parts: 64 MiB parts reach 625 GiB, far above any one file of a model
MAX_PARTS = 10_000
WORKERS = 8  # parts in flight
TRIES = 3  # per part: a reset connection or a 5xx sends the part again
HASH_READ = 8 << 20  # bytes per sha256 update


def part_bytes_for(size: int) -> int:
    """PART_BYTES, or the smallest power-of-two multiple of it that keeps a huge file within S3's 10,000 parts."""
    part = PART_BYTES
    while -(-size // part) > MAX_PARTS:
        part *= 2
    return part


def _identity(st: os.stat_result) -> tuple[int, ...]:
    # a write through the file system changes mtime and ctime (ctime cannot be set back): the same identity before
    # and after means the bytes hashed are the bytes sent
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class MultipartUpload:
    """Uploads of files to `bucket`, each verified against the sha256 it is published under. Errors other than
    IntegrityError and StoreError are botocore's, for the store to put in one line."""

    def __init__(self, client, bucket: str, uri: str, *, workers: int = WORKERS):
        self.client, self.bucket, self.uri, self.workers = client, bucket, uri, workers
        self._connections = ThreadConnections()

    def upload(self, key: str, k: str, path: Path, sha256: str) -> None:
        with open(path, "rb") as f:
            before = _identity(os.fstat(f.fileno()))
            size = before[2]
            part = part_bytes_for(size)
            parts = [(start, min(part, size - start)) for start in range(0, size, part)]
            upload_id = self.client.create_multipart_upload(
                Bucket=self.bucket, Key=k, Metadata={"sha256": sha256, "evidence": ETAG_TAGGED})["UploadId"]
            try:
                etags = self._send(key, k, path, f.fileno(), before, upload_id, parts, sha256)
                if _identity(os.fstat(f.fileno())) != before:
                    raise IntegrityError(f"{path.name} changed while uploading: nothing was published under {key}")
                done = self.client.complete_multipart_upload(
                    Bucket=self.bucket, Key=k, UploadId=upload_id,
                    MultipartUpload={"Parts": [{"ETag": e, "PartNumber": n} for n, e in enumerate(etags, 1)]})
            except BaseException:
                with suppress(Exception):  # invisible either way; gc aborts what a failed abort leaves
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=k, UploadId=upload_id)
                raise
        tag_etag(self.client, self.bucket, k, done.get("ETag", ""))

    def _send(self, key: str, k: str, path: Path, fd: int, identity: tuple[int, ...], upload_id: str,
              parts: list[tuple[int, int]], sha256: str) -> list[str]:
        """Every part sent (their ETags, in order) while this thread hashes the file from its start; a digest that
        is not `sha256` stops the parts not yet sent."""
        with ThreadPoolExecutor(max(1, min(self.workers, len(parts))), thread_name_prefix="s3-part") as pool:
            futures = [pool.submit(self._send_part, key, k, path, identity, upload_id, n, start, length)
                       for n, (start, length) in enumerate(parts, 1)]
            failures: list[BaseException] = []  # filled as parts fail: no scan of every part per chunk hashed

            def note_failure(f) -> None:
                if not f.cancelled() and f.exception() is not None:
                    failures.append(f.exception())

            for f in futures:
                f.add_done_callback(note_failure)
            try:
                hasher, at = hashlib.sha256(), 0
                while at < identity[2]:
                    data = os.pread(fd, min(HASH_READ, identity[2] - at), at)
                    if not data:
                        break
                    hasher.update(data)
                    at += len(data)
                    if failures:
                        raise failures[0]
                if hasher.hexdigest() != sha256:
                    raise mismatch(path, sha256, key)
                done, _ = wait(futures, return_when=FIRST_EXCEPTION)
                for f in done:
                    if f.exception() is not None:
                        raise f.exception()
                return [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise

    def _send_part(self, key: str, k: str, path: Path, identity: tuple[int, ...], upload_id: str, number: int,
                   start: int, length: int) -> str:
        f = open(path, "rb")  # its own file: sendfile through TLS seeks and reads it
        try:
            if _identity(os.fstat(f.fileno())) != identity:
                raise IntegrityError(f"{path.name} changed while uploading: nothing was published under {key}")
            for attempt in range(1, TRIES + 1):
                url = urlsplit(self.client.generate_presigned_url(
                    "upload_part", Params={"Bucket": self.bucket, "Key": k, "UploadId": upload_id,
                                           "PartNumber": number}, ExpiresIn=URL_LIFETIME_S))
                conn = self._connections.get(url)
                try:
                    conn.putrequest("PUT", f"{url.path}?{url.query}", skip_accept_encoding=True)
                    conn.putheader("Content-Length", str(length))
                    conn.endheaders()
                    conn.sock.sendfile(f, start, length)
                    resp = conn.getresponse()
                    resp.read()
                    etag = resp.getheader("ETag")
                    if resp.status == 200 and etag:
                        return etag
                    if resp.status < 500 or attempt == TRIES:
                        raise status_error(self.uri, "upload", key, resp.status)
                except (OSError, http.client.HTTPException) as e:
                    self._connections.drop()
                    if attempt == TRIES:
                        raise StoreError(f"{self.uri}: cannot upload {key} ({type(e).__name__} after {TRIES} "
                                         f"tries)") from None
                else:
                    self._connections.drop()  # a 5xx: a fresh connection for the next try
            raise AssertionError("unreachable")
        finally:
            f.close()


# How `S3Store.blob_intact` can tell later, from the store's own answers, that an object still holds the bytes this
# upload verified (object metadata `evidence`): SHA256_CHECKSUM, a single PUT that sent the sha256 as S3's
# x-amz-checksum-sha256 (the server checks the body against it and reports it on HEAD); ETAG_TAGGED, a multipart
# upload whose completion ETag (computed by the server from the parts it holds) is kept in an object tag. Any later
# PUT or copy over the key replaces the checksum and the tags with its own.
SHA256_CHECKSUM, ETAG_TAGGED = "sha256-checksum", "etag-tag"
ETAG_TAG = "hive-aot-etag"


def tag_etag(client, bucket: str, k: str, etag: str) -> None:
    """Record the completed upload's ETag as an object tag. Best effort: a store without object tagging leaves the
    blob checked by its metadata alone (S3Store.blob_intact says so)."""
    with suppress(Exception):
        client.put_object_tagging(Bucket=bucket, Key=k,
                                  Tagging={"TagSet": [{"Key": ETAG_TAG, "Value": etag.strip('"')}]})


def mismatch(path: Path, sha256: str, key: str) -> IntegrityError:
    """The one line for a file whose bytes are not the digest it is published under."""
    return IntegrityError(f"{path.name}: content does not match sha256 {sha256[:12]} (changed while uploading?): "
                          f"nothing was published under {key}")


def abandoned_uploads(client, bucket: str, prefix: str, older_than: float) -> list[tuple[str, str]]:
    """(key, upload id) of the multipart uploads under `prefix` started before `older_than` (epoch seconds): what
    killed publishers left (invisible, but stored)."""
    out = []
    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix):
        for u in page.get("Uploads", []):
            if u["Initiated"].timestamp() < older_than:
                out.append((u["Key"], u["UploadId"]))
    return out

