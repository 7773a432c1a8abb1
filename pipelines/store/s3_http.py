"""The standard library's HTTP client over presigned S3 URLs: one persistent connection per thread.

Ranged reads (s3_ranges.py) and multipart uploads (s3_upload.py) of large blobs go this way because botocore's
request and response layers cost more CPU than the bytes themselves on a fast link (bench/s3_read_paths.py:
1.47x s5cmd for botocore's ranged GETs, 1.01x for http.client). botocore still signs every URL locally; a presigned
URL is a credential for its lifetime, so it is never logged or put in a message.

Not used behind a proxy (HTTP(S)_PROXY, ALL_PROXY), which http.client ignores: the store then goes through
botocore as before.
"""

from __future__ import annotations

import http.client
import ssl
import threading
from urllib.parse import SplitResult

from ..core import settings
from ..core.errors import StoreError

URL_LIFETIME_S = 3600  # a request retried after this long signs a fresh URL


def usable() -> bool:
    """Whether http.client reaches the endpoint as botocore would: not through a proxy."""
    return not any(s.is_set() for s in (settings.HTTPS_PROXY, settings.HTTP_PROXY, settings.ALL_PROXY))


class ThreadConnections:
    """One keep-alive connection per thread and endpoint; `drop` after any error, so the next request starts clean."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, url: SplitResult) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is not None and getattr(self._local, "where", None) == (url.scheme, url.netloc):
            return conn
        if conn is not None:
            conn.close()
        if url.scheme == "https":
            context = ssl.create_default_context(cafile=settings.AWS_CA_BUNDLE.get())
            conn = http.client.HTTPSConnection(url.netloc, context=context, timeout=60)
        else:
            conn = http.client.HTTPConnection(url.netloc, timeout=60)
        self._local.conn, self._local.where = conn, (url.scheme, url.netloc)
        return conn

    def drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._local.conn = None


def status_error(uri: str, what: str, key: str, status: int) -> StoreError:
    """One line for an HTTP status S3 answered (`what`: "read", "upload"), the URL never in it."""
    if status == 404:
        return StoreError(f"{uri}: {key} is missing")
    if status in (401, 403):
        return StoreError(f"{uri}: cannot {what} {key} (access denied)")
    return StoreError(f"{uri}: cannot {what} {key} (HTTP {status})")
