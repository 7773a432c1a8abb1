"""The HTTP rules under the OCI client (oci_client.py): where credentials may go, how long a request may take, how
much of an answer is read.

Origins. Credentials (Basic, or a Bearer token the registry's realm issued) go to the registry's origin only:
scheme, host and port as the store URI names them. A URL the registry names (an upload's `Location`, a page's
`Link`) on another origin is sent nothing secret, as docker and oras do; plain HTTP only to loopback.

Deadlines. A per-read socket timeout never fires on a server that sends a byte every few seconds, so each
request has a Watch: past its deadline a watchdog thread shuts the request's socket down, which ends a read or
write blocked on it, and the request fails in one line. What the deadline bounds depends on the request:
- metadata (manifests, tag and catalog pages, tokens, upload answers): the whole exchange, HIVE_AOT_OCI_DEADLINE
  seconds, redirects and urllib3's retries included (a TCP connect in progress is bounded by its own 15 s);
- a blob transfer (a streamed GET, an upload's body): a stall cut-off instead. The clock restarts whenever
  another MiB has moved (and is stopped while the caller holds a chunk it was given), so a 140 GB blob at any
  sane rate never meets it, and a transfer slower than 1 MiB per deadline (3.5 KB/s at the default 300 s) ends.
An overall deadline on a blob would have to be sized for the largest blob on the slowest link, which would make
it useless for every other request; a rate floor bounds a hostile trickle and lets a long honest download run.

Bodies. Every answer is read with preload_content=False and bounded by what it may hold (BODY_LIMITS): more is
refused in one line, read no further. A body the client only discards (a 401's, a 404's, one urllib3 retries
past or follows a redirect from) is read to the small bound and its connection closed when longer.
"""

from __future__ import annotations

import functools
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

MIB = 1 << 20
# What an answer of each kind may hold. Distribution refuses manifests over 4 MiB; a page of 1000 tags or
# repositories is well under 1 MiB (a registry that ignores `n` and answers 100k tags at once still fits); an
# error body is a few hundred bytes, a token a few KiB.
BODY_LIMITS = {"manifest": 4 * MIB, "page": 8 * MIB, "token": 64 << 10, "answer": 64 << 10}
# Answers worth a second try (urllib3 retries them for reads; the client for manifest writes). Distribution's
# filesystem driver writes a tag's link in place, not by rename: a read racing a concurrent write of the same tag
# (six publishers of one build) gets 500, and a PUT racing one of the same manifest can get DIGEST_INVALID for
# bytes that are right (both seen in tests/store/test_store_faults.py).
TRANSIENT = (500, 502, 503, 504)
POLL_S = 0.25  # the watchdog looks again at least this often (a restarted clock does not wake it)
LOOPBACK = {"127.0.0.1", "::1", "[::1]", "localhost"}  # plain HTTP is allowed to these only, as docker does
_local = threading.local()  # .watch: the Watch of the request this thread is sending, for the connection to join


def is_loopback(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.endswith("]") and host.count(":") == 1 else host
    if host.startswith("["):
        name = host.split("]")[0] + "]"
    return name in LOOPBACK


def origin(url: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an absolute http(s) URL, default ports filled in; None for anything else."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        return None
    return scheme, parts.hostname.lower(), port or (443 if scheme == "https" else 80)


def shown(size: int) -> str:
    return f"{size >> 20} MiB" if size >= MIB else f"{size >> 10} KiB"


class Watch:
    """The deadline of one request. `fired` once it passed: the socket the request uses has been shut down."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.fired = False
        self.conn: Any = None  # the connection the request was last sent on
        self._done = False
        self._lock = threading.Lock()
        _watchdog.add(self)

    def restart(self) -> None:
        """The clock begins again (a transfer made progress, or its reader asks for more)."""
        self.deadline = time.monotonic() + self.seconds

    def pause(self) -> None:
        """No deadline while the caller holds what was read (a stalled consumer is not a stalled server)."""
        self.deadline = math.inf

    def fire(self) -> None:
        with self._lock:
            if self._done:
                return
            self.fired = True
            conn = self.conn
            # only while the connection is still this request's: once released to the pool it may carry another's
            sock = getattr(conn, "sock", None) if getattr(conn, "watch", None) is self else None
            if sock is not None:
                with suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            self._done = True
        _watchdog.remove(self)


class _Watchdog:
    """One daemon thread for every Watch of the process: it sleeps until the nearest deadline."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # a forked child has no such thread, and maybe a held lock

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._watches: set[Watch] = set()
        self._thread: threading.Thread | None = None

    def add(self, watch: Watch) -> None:
        with self._cond:
            self._watches.add(watch)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="oci-deadlines", daemon=True)
                self._thread.start()
            self._cond.notify()

    def remove(self, watch: Watch) -> None:
        with self._cond:
            self._watches.discard(watch)

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = [w for w in self._watches if w.deadline <= now]
                self._watches.difference_update(due)
                if not due:
                    nearest = min((w.deadline for w in self._watches), default=None)
                    self._cond.wait(None if nearest is None else min(nearest - now, POLL_S))
            for w in due:
                w.fire()


_watchdog = _Watchdog()


class _Watched:
    """A connection that joins the sending thread's Watch, so the watchdog can shut its socket down; once the
    deadline passed it sends and waits for nothing more (urllib3's retries end at once)."""

    watch: Watch | None = None

    def request(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        watch = getattr(_local, "watch", None)
        self.watch = watch
        if watch is not None:
            watch.conn = self
            if watch.fired:
                raise TimeoutError("the request's deadline passed")
        return super().request(*args, **kwargs)  # type: ignore[misc]

    def getresponse(self):  # type: ignore[no-untyped-def]
        if self.watch is not None and self.watch.fired:
            raise TimeoutError("the request's deadline passed")
        resp = super().getresponse()  # type: ignore[misc]
        # urllib3 drains, whole and into memory, the body of an answer it retries (503) or follows (a redirect):
        # an endless one would never end; here it is read to the small bound, else the connection is dropped
        resp.drain_conn = functools.partial(discard, resp, self.watch)
        return resp


class _HTTPConnection(_Watched, HTTPConnection):
    pass


class _HTTPSConnection(_Watched, HTTPSConnection):
    pass


class _HTTPPool(HTTPConnectionPool):
    ConnectionCls = _HTTPConnection


class _HTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _HTTPSConnection


class _Retry(urllib3.Retry):
    """urllib3's retries, none once the request's deadline passed."""

    def increment(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        watch = getattr(_local, "watch", None)
        if watch is not None and watch.fired:
            error = kwargs.get("error") or (args[3] if len(args) > 3 else None)
            raise urllib3.exceptions.MaxRetryError(kwargs.get("_pool"), kwargs.get("url") or "", error)
        return super().increment(*args, **kwargs)


def pool_manager(workers: int) -> urllib3.PoolManager:
    http = urllib3.PoolManager(
        maxsize=workers, block=False, timeout=urllib3.Timeout(connect=15.0, read=300.0),
        # Retry-After is not obeyed: a registry that asks for an hour's wait would hang the client past any deadline
        retries=_Retry(total=5, connect=3, read=2, status=4, redirect=5, backoff_factor=0.2,
                       status_forcelist=TRANSIENT, raise_on_status=False, respect_retry_after_header=False,
                       allowed_methods={"GET", "HEAD", "DELETE"}))
    http.pool_classes_by_scheme = {"http": _HTTPPool, "https": _HTTPSPool}
    return http


def send(http: urllib3.PoolManager, watch: Watch, method: str, url: str, **kw) -> urllib3.BaseHTTPResponse:
    """One request under `watch` (the body unread: preload_content=False)."""
    previous = getattr(_local, "watch", None)
    _local.watch = watch  # a nested request (a body read from another registry's stream) restores ours after
    try:
        return http.request(method, url, preload_content=False, **kw)
    finally:
        _local.watch = previous


class TooLarge(Exception):
    pass


class Stalled(Exception):
    """The deadline passed (or the transfer stalled) while reading."""


class Lost(Exception):
    """The connection broke while reading."""


def read_body(resp: urllib3.BaseHTTPResponse, watch: Watch, limit: int) -> bytes:
    """At most `limit` bytes of the answer's body, all of it; TooLarge (the connection closed) beyond that."""
    length = getattr(resp, "length_remaining", None)  # the Content-Length of a body there is (none for HEAD)
    if length is not None and length > limit:
        discard(resp)
        raise TooLarge
    parts, n = [], 0
    try:
        while chunk := resp.read(min(64 << 10, limit + 1 - n)):
            parts.append(chunk)
            n += len(chunk)
            if n > limit:
                discard(resp)
                raise TooLarge
    except (urllib3.exceptions.HTTPError, OSError):
        discard(resp)
        raise Stalled if watch.fired else Lost from None
    if watch.fired:  # a socket shut down mid-body reads as the end of a body without a length
        raise Stalled
    return b"".join(parts)


def discard(resp: urllib3.BaseHTTPResponse, watch: Watch | None = None) -> None:
    """Let go of an answer whose body is not wanted: a short one is read so its connection can be kept."""
    if watch is not None and not watch.fired:
        with suppress(TooLarge, Stalled, Lost):
            read_body(resp, watch, BODY_LIMITS["answer"])
            resp.release_conn()
            return
    with suppress(Exception):
        resp.close()  # unread bytes: the connection cannot carry another request
    with suppress(Exception):
        resp.release_conn()


@dataclass
class Answer:
    """A bounded answer, read: what the client's methods look at."""

    status: int
    headers: Any
    data: bytes


class Streamed:
    """A blob's answer, streamed under the stall rule: each chunk must come within the deadline of being asked
    for; the clock stops while the caller holds it."""

    def __init__(self, resp: urllib3.BaseHTTPResponse, watch: Watch):
        self.resp, self.watch, self.status, self.headers = resp, watch, resp.status, resp.headers
        self._complete = False

    def chunks(self, size: int) -> Iterator[bytes]:
        it = self.resp.stream(size)
        while True:
            self.watch.restart()
            try:
                chunk = next(it, None)
            except (urllib3.exceptions.HTTPError, OSError):
                raise Stalled if self.watch.fired else Lost from None
            if self.watch.fired:
                raise Stalled
            if chunk is None:
                self._complete = True
                return
            self.watch.pause()
            yield chunk

    def close(self) -> None:
        self.watch.close()
        if self._complete or self.resp.closed:  # all read: the connection serves the next request
            self.resp.release_conn()
        else:
            discard(self.resp)


class Progress:
    """An upload's body as urllib3 reads it: each MiB read restarts the request's clock (the stall rule)."""

    def __init__(self, f: Any, watch: Watch):
        self.f, self.watch, self.n, self.mark = f, watch, 0, MIB

    def read(self, size: int = -1) -> bytes:
        chunk = self.f.read(size)
        self.n += len(chunk)
        if self.n >= self.mark:
            self.mark = self.n + MIB
            self.watch.restart()
        return chunk

    def close(self) -> None:
        if hasattr(self.f, "close"):
            self.f.close()


def progress_body(data: Any, watch: Watch) -> Any:
    """What to hand urllib3 for a request body: a large one under the stall rule, anything else as it is."""
    if data is None:
        return None
    if isinstance(data, (bytes, bytearray, memoryview)):
        if len(data) <= MIB:
            return data
        import io

        return Progress(io.BytesIO(data), watch)
    return Progress(data, watch) if hasattr(data, "read") else data

