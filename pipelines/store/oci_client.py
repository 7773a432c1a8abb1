"""A small client of the OCI distribution API (v1.1) on urllib3 (a base dependency: no boto3 needed).

Only what the OCI store needs: blobs (HEAD, ranged GET, monolithic and chunked upload, cross-repository mount,
DELETE),
manifests (GET, PUT, DELETE by digest), tags and the catalog with `Link` pagination. Authentication answers
the registry's challenge (oci_auth.py): Basic, or a Bearer token per scope from the challenge's realm.

Plain HTTP only for a loopback registry (127.0.0.1, ::1, localhost), as docker does; HTTPS with certificate
verification for every other host. Credentials go to the registry's origin only, every answer is read to a
bound, and every request has a deadline (oci_http.py). Every failure is one StoreError line that names the
registry, the operation and the HTTP status (the registry's own error code when it sent one) and never a
credential, a token or an upload URL's state.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO
from urllib.parse import urlencode, urljoin

import urllib3

from ..core import settings
from ..core.errors import IntegrityError, StoreError
from .oci_auth import Auth, Credentials, parse_challenge
from .oci_http import (
    BODY_LIMITS,
    TRANSIENT,
    Answer,
    Lost,
    Stalled,
    Streamed,
    TooLarge,
    Watch,
    discard,
    is_loopback,
    origin,
    pool_manager,
    progress_body,
    read_body,
    send,
    shown,
)

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_TYPE = "application/vnd.oci.image.index.v1+json"
READ_CHUNK = 1 << 20
PUT_TRIES = 4
# A listing that names more pages than this is refused: each page is a request, and a registry that links page
# after page (distinct URLs, so no loop is seen) would otherwise hold the client for ever.
MAX_PAGES = 10_000
_NEXT = re.compile(r'<([^>]*)>\s*;[^,]*\brel="?next"?')

_UNREAD = object()  # an error answer's body not read yet
Body = bytes | Callable[[], BinaryIO] | None  # a callable opens a fresh stream: a retry after a 401 resends it


def _error_code(data: bytes) -> str:
    """The registry's first error code and message ({"errors": [{code, message}]}), short, for the line."""
    try:
        errors = json.loads(data or b"{}").get("errors") or []
        code, message = str(errors[0].get("code", "")), str(errors[0].get("message", ""))
    except (ValueError, AttributeError, IndexError, TypeError, RecursionError):
        return ""
    code, message = (" ".join(t.split()) for t in (code, message))  # one line, whatever the registry sent
    return f"{code}: {message}"[:160] if message else code[:80]


def _range_end(header: str | None) -> int | None:
    """Bytes held, from an upload's `Range: 0-<last>`; None when absent, malformed or the ambiguous `0-0`."""
    first, _, last = (header or "").partition("-")
    if first.strip() != "0" or not last.strip().isdigit() or int(last) == 0:
        return None
    return int(last) + 1


class Registry:
    """One registry host. Thread-safe: a pull reads parts of several blobs at once through one instance."""

    def __init__(self, host: str, *, workers: int = 16):
        self.host = host
        self.base = f"{'http' if is_loopback(host) else 'https'}://{host}"
        self.origin = origin(self.base)  # where credentials may go
        self.deadline = settings.OCI_DEADLINE.seconds()
        self.http = pool_manager(workers)
        self.auth = Auth(host)

    def credentials(self) -> Credentials | None:
        return self.auth.credentials()

    # --- requests ----------------------------------------------------------------------------------------------
    def _token_request(self, method: str, url: str, what: str, **kw) -> bytes:
        """The token service's answer (at most BODY_LIMITS["token"] bytes, within the deadline)."""
        watch = Watch(self.deadline)
        try:
            try:
                resp = send(self.http, watch, method, url, redirect=True, **kw)
            except (urllib3.exceptions.HTTPError, OSError) as e:
                if watch.fired:
                    raise self._late(what, "the token service") from None
                raise StoreError(f"{self.host}: cannot {what}: token service unreachable ({type(e).__name__})") from None
            if resp.status != 200:
                discard(resp, watch)
                if resp.status in (401, 403):
                    raise StoreError(f"{self.host}: cannot {what}: credentials refused by the token service "
                                     f"({resp.status})")
                raise StoreError(f"{self.host}: cannot {what}: the token service answered {resp.status}")
            return self._read(resp, watch, "token", what)
        finally:
            watch.close()

    def _url(self, path: str, what: str) -> str:
        """The absolute URL of a path or of a URL the registry named; plain HTTP only to loopback."""
        url = path if path.startswith(("http://", "https://")) else self.base + path
        where = origin(url)
        if where is None:
            raise StoreError(f"{self.host}: cannot {what}: the registry named an address that is not an http(s) URL")
        if where[0] != "https" and not is_loopback(where[1]):
            raise StoreError(f"{self.host}: cannot {what}: the registry sends it to {where[1]} over plain HTTP "
                             "(refused: HTTPS for every host but loopback)")
        return url

    def _late(self, what: str, who: str = "the registry") -> StoreError:
        return StoreError(f"{self.host}: cannot {what}: {who} did not answer in full within {self.deadline:g} s "
                          f"({settings.OCI_DEADLINE.name})")

    def _read(self, resp: urllib3.BaseHTTPResponse, watch: Watch, kind: str, what: str) -> bytes:
        try:
            return read_body(resp, watch, BODY_LIMITS[kind])
        except TooLarge:
            raise StoreError(f"{self.host}: cannot {what}: the answer is larger than {shown(BODY_LIMITS[kind])}, "
                             f"more than a {kind} holds (refused, not read)") from None
        except Stalled:
            raise self._late(what) from None
        except Lost:
            raise StoreError(f"{self.host}: cannot {what}: connection lost while reading the answer") from None

    def request(self, method: str, path: str, what: str, *, scope: str = "", headers: dict[str, str] | None = None,
                body: Body = None, ok: tuple[int, ...] = (200,), missing_ok: bool = False,
                stream: bool = False, kind: str = "answer") -> Any:
        """Send one request, answering one 401 challenge. `ok`: the statuses that succeed, whose body is read
        (at most BODY_LIMITS[kind] bytes: an Answer) or handed over (`stream`: a Streamed, for the caller to
        close); a 404 returns None when `missing_ok`; anything else is a StoreError line. `what` is what the line
        says could not be done."""
        url = self._url(path, what)
        # Credentials go to the registry's own origin only: an upload's Location may name a blob store elsewhere
        # (followed without them, as docker does), and anything else the registry names gets none either.
        mine = origin(url) == self.origin
        watch, handed = Watch(self.deadline), False
        try:
            for attempt in (0, 1):
                seen: Any = _UNREAD
                hdrs = dict(headers or {})
                auth = self.auth.header(scope) if mine else None
                data = body() if callable(body) else body
                if auth is not None:
                    # per request, never on the pool: urllib3 drops Authorization on a redirect to another host
                    # (a blob store's presigned URL)
                    hdrs["Authorization"] = auth
                try:
                    resp = self._send(watch, method, url, what, body=progress_body(data, watch), headers=hdrs,
                                      redirect=method in ("GET", "HEAD"))
                finally:
                    if callable(body) and hasattr(data, "close"):
                        data.close()
                if resp.status == 401 and attempt == 0:
                    challenge = parse_challenge(resp.headers.get("WWW-Authenticate"))
                    seen = self._error_body(resp, watch, what)
                    if not mine:
                        raise StoreError(f"{self.host}: cannot {what}: {origin(url)[1]}, which is not the registry, "
                                         "asks for credentials (401): they are sent to the registry only")
                    if auth is not None and (challenge is None or challenge.scheme == "basic"):
                        break  # what we sent was refused
                    self.auth.answer(challenge, scope, what, self._token_request)
                    watch.restart()  # the second exchange has its own time
                    continue
                break
            if resp.status in ok:
                if stream:
                    handed = True
                    return Streamed(resp, watch)
                return Answer(resp.status, resp.headers, self._read(resp, watch, kind, what))
            if resp.status == 404 and missing_ok:
                discard(resp, watch)
                return None
            raise self.error(resp, what, watch, seen)
        finally:
            if not handed:
                watch.close()

    def _send(self, watch: Watch, method: str, url: str, what: str, **kw) -> urllib3.BaseHTTPResponse:
        try:
            return send(self.http, watch, method, url, **kw)
        except (urllib3.exceptions.HTTPError, OSError) as e:
            if watch.fired:
                raise self._late(what) from None
            reason = type(getattr(e, "reason", None) or e).__name__
            raise StoreError(f"{self.host}: cannot {what}: registry unreachable ({reason})") from None

    def _error_body(self, resp: urllib3.BaseHTTPResponse, watch: Watch, what: str) -> bytes | None:
        """An error answer's body, to BODY_LIMITS["answer"]; None when it is longer (not read further)."""
        try:
            return read_body(resp, watch, BODY_LIMITS["answer"])
        except TooLarge:
            return None
        except Stalled:
            raise self._late(what) from None
        except Lost:
            return b""

    def error(self, resp: urllib3.BaseHTTPResponse, what: str, watch: Watch, data: Any = None) -> StoreError:
        """The line for an answer that is not one of the successes (its body read to the bound here, unless the
        caller read it already: `data`, None for one over the bound)."""
        if data is _UNREAD:
            data = self._error_body(resp, watch, what)
        code = "" if data is None else _error_code(data)
        err = self._error(resp.status, code, what, "" if data is not None else
                          f", an error body over {shown(BODY_LIMITS['answer'])}, not read")
        err.status, err.code = resp.status, code  # for a caller that retries
        return err

    def _error(self, status: int, code: str, what: str, note: str = "") -> StoreError:
        detail = f"{status}" + (f" {code}" if code else "") + note
        if status == 401:
            return StoreError(f"{self.host}: cannot {what}: credentials refused ({detail})")
        if status == 403:
            return StoreError(f"{self.host}: cannot {what}: access denied ({detail})")
        if status == 404:
            return StoreError(f"{self.host}: cannot {what}: not found ({detail})")
        if status == 413:
            return StoreError(f"{self.host}: cannot {what}: the registry refuses something this large ({detail})")
        if code.startswith(("DIGEST_INVALID", "SIZE_INVALID")):
            return IntegrityError(f"{self.host}: cannot {what}: the bytes do not match their digest ({detail})")
        if code.startswith(("MANIFEST_INVALID", "UNSUPPORTED", "MANIFEST_UNKNOWN")) or status == 415:
            return StoreError(f"{self.host}: cannot {what}: the registry does not accept this artifact ({detail})")
        return StoreError(f"{self.host}: cannot {what}: the registry answered {detail}")

    # --- the distribution API ----------------------------------------------------------------------------------
    @staticmethod
    def scope(repo: str, push: bool = False, *more: str) -> str:
        return " ".join([f"repository:{repo}:{'pull,push' if push else 'pull'}", *more])

    def blob_size(self, repo: str, digest: str) -> int | None:
        resp = self.request("HEAD", f"/v2/{repo}/blobs/{digest}", f"stat blob {digest[7:19]}", scope=self.scope(repo),
                            missing_ok=True)
        if resp is None:
            return None
        length = resp.headers.get("Content-Length", "")
        return int(length) if length.isdigit() else -1  # a size no blob has: never "intact"

    def blob_stream(self, repo: str, digest: str, start: int = 0, length: int | None = None,
                    at_most: int | None = None) -> Iterator[bytes]:
        """The blob's bytes [start, start + length), streamed; a missing blob is a StoreError. `at_most`: a whole
        blob read no further than that (the size the registry gave: a body that goes on is not followed)."""
        what = f"read blob {digest[7:19]}"
        headers = {} if start == 0 and length is None else {
            "Range": f"bytes={start}-" + ("" if length is None else str(start + length - 1))}
        resp = self.request("GET", f"/v2/{repo}/blobs/{digest}", what, scope=self.scope(repo), headers=headers,
                            ok=(200, 206), stream=True)
        try:
            skip = start if (resp.status == 200 and start) else 0  # a registry that ignores Range sends it all
            left = length if length is not None else (None if at_most is None else max(at_most, 0))
            for chunk in resp.chunks(READ_CHUNK):
                if skip:
                    cut = min(skip, len(chunk))
                    chunk, skip = chunk[cut:], skip - cut
                if left is not None:
                    chunk = chunk[:left]
                    left -= len(chunk)
                if chunk:
                    yield chunk
                if left == 0:
                    break
        except Stalled:
            raise StoreError(f"{self.host}: cannot {what}: the transfer stalled (less than 1 MiB in "
                             f"{self.deadline:g} s, {settings.OCI_DEADLINE.name})") from None
        except Lost:
            raise StoreError(f"{self.host}: cannot {what}: connection lost") from None
        finally:
            resp.close()

    def _location(self, resp: urllib3.BaseHTTPResponse, what: str) -> str:
        loc = resp.headers.get("Location")
        if not loc:
            raise StoreError(f"{self.host}: cannot {what}: the registry's upload answer has no Location")
        return urljoin(self.base + "/", loc)

    def mount_blob(self, repo: str, digest: str, source: str) -> bool:
        """Link a blob of `source` into `repo` without sending it (201). False when the registry began a plain
        upload instead (202: the blob is not in `source`, or it does not mount); that upload is cancelled."""
        what = f"mount blob {digest[7:19]} into {repo}"
        query = urlencode({"mount": digest, "from": source})
        resp = self.request("POST", f"/v2/{repo}/blobs/uploads/?{query}", what,
                            scope=self.scope(repo, True, f"repository:{source}:pull"), ok=(201, 202))
        if resp.status == 201:
            return True
        self.request("DELETE", self._location(resp, what), what, scope=self.scope(repo, True), ok=(204, 200, 202),
                     missing_ok=True)
        return False

    def upload_blob(self, repo: str, digest: str, size: int, body: Body) -> None:
        """Monolithic upload (POST, then one PUT of the bytes with their digest): the registry verifies the
        digest before the blob exists, so a blob under a digest always holds that content."""
        what = f"upload blob {digest[7:19]}"
        scope = self.scope(repo, True)
        resp = self.request("POST", f"/v2/{repo}/blobs/uploads/", what, scope=scope, ok=(202,),
                            headers={"Content-Length": "0"})
        loc = self._location(resp, what)
        url = loc + ("&" if "?" in loc else "?") + urlencode({"digest": digest})
        try:
            self.request("PUT", url, what, scope=scope, body=body, ok=(201,),
                         headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)})
        except StoreError as e:
            # a concurrent upload of the same blob can fail one of them (see TRANSIENT); if the blob is there
            # now, the registry checked its digest when it took it
            if getattr(e, "status", 0) in (400, *TRANSIENT) and self.blob_size(repo, digest) == size:
                return
            raise

    # Chunked upload (a layer streamed as it is made, its digest known only at the end). Distribution 2.8
    # ignores Content-Range and appends whatever a PATCH carries: a PATCH re-sent after a lost answer would
    # duplicate bytes, so nothing here retries one; the caller asks upload_offset() where the upload stands.
    def start_upload(self, repo: str) -> str:
        what = f"start an upload to {repo}"
        resp = self.request("POST", f"/v2/{repo}/blobs/uploads/", what, scope=self.scope(repo, True), ok=(202,),
                            headers={"Content-Length": "0"})
        return self._location(resp, what)

    def patch_upload(self, repo: str, location: str, start: int, data: bytes) -> tuple[str, int | None]:
        """Append `data` at `start`: (the upload's newest Location, its size as the registry now reports it,
        None when it did not say)."""
        what = f"upload a chunk to {repo}"
        resp = self.request("PATCH", location, what, scope=self.scope(repo, True), body=data, ok=(202,),
                            headers={"Content-Type": "application/octet-stream", "Content-Length": str(len(data)),
                                     "Content-Range": f"{start}-{start + len(data) - 1}"})
        return self._location(resp, what), _range_end(resp.headers.get("Range"))

    def upload_offset(self, repo: str, location: str) -> tuple[str, int | None] | None:
        """(Location, bytes the registry holds) of an upload in progress; None when it is gone. The size is
        None when the answer is ambiguous: Distribution says `0-0` both for no byte and for one."""
        what = f"read the state of an upload to {repo}"
        resp = self.request("GET", location, what, scope=self.scope(repo, True), ok=(204,), missing_ok=True)
        if resp is None:
            return None
        return self._location(resp, what), _range_end(resp.headers.get("Range"))

    def finish_upload(self, repo: str, location: str, digest: str) -> None:
        """The closing PUT: the registry checks the digest of everything appended, then the blob exists."""
        what = f"finish the upload of blob {digest[7:19]} to {repo}"
        url = location + ("&" if "?" in location else "?") + urlencode({"digest": digest})
        self.request("PUT", url, what, scope=self.scope(repo, True), ok=(201,), headers={"Content-Length": "0"})

    def cancel_upload(self, repo: str, location: str) -> None:
        self.request("DELETE", location, f"cancel an upload to {repo}", scope=self.scope(repo, True),
                     ok=(204, 200, 202), missing_ok=True)

    def start_and_cancel_upload(self, repo: str) -> None:
        """Whether we may push to `repo`, without leaving anything there."""
        what = f"write to {repo}"
        resp = self.request("POST", f"/v2/{repo}/blobs/uploads/", what, scope=self.scope(repo, True), ok=(202,),
                            headers={"Content-Length": "0"})
        self.request("DELETE", self._location(resp, what), what, scope=self.scope(repo, True), ok=(204, 200, 202),
                     missing_ok=True)

    def delete_blob(self, repo: str, digest: str) -> None:
        self.request("DELETE", f"/v2/{repo}/blobs/{digest}", f"delete blob {digest[7:19]}", scope=self.scope(repo, True),
                     ok=(202, 200, 204), missing_ok=True)

    def get_manifest(self, repo: str, reference: str, accept: str = MANIFEST_TYPE) -> tuple[bytes, str] | None:
        """(bytes, digest) of a manifest by tag or digest, None when there is none."""
        resp = self.request("GET", f"/v2/{repo}/manifests/{reference}", f"read {repo}:{reference}",
                            scope=self.scope(repo), headers={"Accept": accept}, missing_ok=True, kind="manifest")
        if resp is None:
            return None
        return resp.data, resp.headers.get("Docker-Content-Digest", "")

    def head_manifest(self, repo: str, reference: str) -> str | None:
        resp = self.request("HEAD", f"/v2/{repo}/manifests/{reference}", f"stat {repo}:{reference}",
                            scope=self.scope(repo), headers={"Accept": MANIFEST_TYPE}, missing_ok=True)
        return None if resp is None else resp.headers.get("Docker-Content-Digest", "")

    def put_manifest(self, repo: str, reference: str, data: bytes, media_type: str = MANIFEST_TYPE) -> bool:
        """PUT the exact bytes (idempotent: the same bytes under the same reference), retried on a transient
        answer (TRANSIENT, or DIGEST_INVALID for bytes whose digest we computed ourselves). True when the registry
        answered `OCI-Subject` (it keeps the referrers of a manifest with a `subject` itself)."""
        shown = f"{repo}@{reference[:19]}" if reference.startswith("sha256:") else f"{repo}:{reference}"
        for attempt in range(PUT_TRIES):
            try:
                answer = self.request("PUT", f"/v2/{repo}/manifests/{reference}", f"write {shown}",
                                      scope=self.scope(repo, True), body=data, ok=(201,),
                                      headers={"Content-Type": media_type, "Content-Length": str(len(data))})
                return bool(answer.headers.get("OCI-Subject"))
            except StoreError as e:
                status, code = getattr(e, "status", 0), getattr(e, "code", "")
                if attempt == PUT_TRIES - 1 or not (status in TRANSIENT or code.startswith("DIGEST_INVALID")):
                    raise
                time.sleep(0.2 * (attempt + 1))

    def referrers(self, repo: str, digest: str) -> bytes | None:
        """The referrers API's index of the manifests whose subject is `digest`; None where the registry has no
        such API (404: Distribution 2.x), and then clients keep the referrers tag themselves (oci_referrers.py)."""
        resp = self.request("GET", f"/v2/{repo}/referrers/{digest}", f"list the referrers of {repo}@{digest[7:19]}",
                            scope=self.scope(repo), headers={"Accept": INDEX_TYPE}, missing_ok=True, kind="manifest")
        if resp is None or not resp.headers.get("Content-Type", "").startswith(INDEX_TYPE):
            return None  # a registry answering something else at that path has no referrers API either
        return resp.data

    def delete_manifest(self, repo: str, digest: str) -> None:
        self.request("DELETE", f"/v2/{repo}/manifests/{digest}", f"delete {repo}@{digest[7:19]}",
                     scope=self.scope(repo, True), ok=(202, 200, 204), missing_ok=True)

    def _pages(self, path: str, what: str, scope: str, field: str) -> Iterator[str]:
        """The names of a paginated list, following `Link: <...>; rel="next"`: on the registry's own origin only
        (credentials would follow it there; a list has no business elsewhere), never a page twice (a loop), at
        most MAX_PAGES pages."""
        url, seen = self.base + path, set()
        for _ in range(MAX_PAGES):
            resp = self.request("GET", url, what, scope=scope, missing_ok=True, kind="page")
            if resp is None:
                return
            try:
                items = json.loads(resp.data).get(field) or []
            except (ValueError, AttributeError, RecursionError):
                raise StoreError(f"{self.host}: cannot {what}: the registry's answer is not JSON") from None
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise StoreError(f"{self.host}: cannot {what}: the registry's {field!r} is not a list of names")
            yield from items
            found = _NEXT.search(resp.headers.get("Link", ""))  # </v2/...?last=x&n=100>; rel="next"
            if found is None:
                return
            seen.add(url)
            url = urljoin(url, found.group(1))
            if origin(url) != self.origin:
                raise StoreError(f"{self.host}: cannot {what}: the registry links its next page to "
                                 f"{(origin(url) or ('', 'an address that is not http(s)'))[1]}, not to itself (refused)")
            if url in seen:
                raise StoreError(f"{self.host}: cannot {what}: the registry's next page is one already read "
                                 "(a loop of Links)")
        raise StoreError(f"{self.host}: cannot {what}: more than {MAX_PAGES} pages (refused)")

    def tags(self, repo: str) -> list[str]:
        """The repository's tags; none when it does not exist (yet, or any more)."""
        return sorted(self._pages(f"/v2/{repo}/tags/list?n=1000", f"list the tags of {repo}", self.scope(repo), "tags"))

    def catalog(self) -> list[str]:
        return sorted(self._pages("/v2/_catalog?n=1000", "list the registry's repositories (catalog)",
                                  "registry:catalog:*", "repositories"))
