"""A small client of the OCI distribution API (v1.1) on urllib3, which the base install has through botocore.

Only what the OCI store needs: blobs (HEAD, ranged GET, monolithic and chunked upload, cross-repository mount,
DELETE),
manifests (GET, PUT, DELETE by digest), tags and the catalog with `Link` pagination. Authentication answers
the registry's challenge (oci_auth.py): Basic, or a Bearer token per scope from the challenge's realm.

Plain HTTP only for a loopback registry (127.0.0.1, ::1, localhost), as docker does; HTTPS with certificate
verification for every other host. Every failure is one StoreError line that names the registry, the
operation and the HTTP status (the registry's own error code when it sent one) and never a credential, a
token or an upload URL's state.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, BinaryIO, Callable, Iterator
from urllib.parse import urlencode, urljoin, urlsplit

import urllib3

from ..errors import IntegrityError, StoreError
from .oci_auth import Challenge, Credentials, credentials_for, parse_challenge

LOOPBACK = {"127.0.0.1", "::1", "[::1]", "localhost"}
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
READ_CHUNK = 1 << 20
TOKEN_MARGIN_S = 10.0
# Answers worth a second try. Distribution's filesystem driver writes a tag's link in place, not by rename: a
# read racing a concurrent write of the same tag (six publishers of one build) gets 500, and a PUT racing one
# of the same manifest can get DIGEST_INVALID for bytes that are right (both seen in tests/test_store_faults.py).
TRANSIENT = (500, 502, 503, 504)
PUT_TRIES = 4  # renew a Bearer token this long before the realm said it expires

Body = bytes | Callable[[], BinaryIO] | None  # a callable opens a fresh stream: a retry after a 401 resends it


def is_loopback(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.endswith("]") and host.count(":") == 1 else host
    if host.startswith("["):
        name = host.split("]")[0] + "]"
    return name in LOOPBACK


def _error_code(resp: urllib3.BaseHTTPResponse) -> str:
    """The registry's first error code and message ({"errors": [{code, message}]}), short, for the line."""
    try:
        errors = json.loads(resp.data or b"{}").get("errors") or []
        code, message = str(errors[0].get("code", "")), str(errors[0].get("message", ""))
    except (ValueError, AttributeError, IndexError, TypeError):
        return ""
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
        self.http = urllib3.PoolManager(
            maxsize=workers, block=False, timeout=urllib3.Timeout(connect=15.0, read=300.0),
            retries=urllib3.Retry(total=5, connect=3, read=2, status=4, redirect=5, backoff_factor=0.2,
                                  status_forcelist=TRANSIENT, raise_on_status=False,
                                  allowed_methods={"GET", "HEAD", "DELETE"}))
        self._lock = threading.Lock()
        self._creds: Credentials | None = None
        self._creds_loaded = False
        self._basic = False  # the registry asked for Basic: send it on every request from now on
        self._tokens: dict[str, tuple[str, float]] = {}  # scope -> (token, expires at)

    # --- authentication ----------------------------------------------------------------------------------------
    def credentials(self) -> Credentials | None:
        with self._lock:
            if not self._creds_loaded:
                self._creds, self._creds_loaded = credentials_for(self.host), True
            return self._creds

    def _auth_header(self, scope: str) -> str | None:
        if self._basic:
            creds = self.credentials()
            return creds.basic() if creds else None
        with self._lock:
            token = self._tokens.get(scope)
        if token and token[1] > time.monotonic():
            return f"Bearer {token[0]}"
        return None

    def _answer(self, challenge: Challenge | None, scope: str, what: str) -> None:
        """Get what the 401's challenge asks for, so the request can be sent again."""
        creds = self.credentials()
        if challenge is None or challenge.scheme not in ("basic", "bearer"):
            raise StoreError(f"{self.host}: cannot {what}: the registry asks for an authentication it does not name (401)")
        if challenge.scheme == "basic":
            if creds is None:
                raise StoreError(f"{self.host}: cannot {what}: the registry needs credentials (401); set "
                                 "HIVE_AOT_OCI_USERNAME/HIVE_AOT_OCI_PASSWORD or `docker login`")
            self._basic = True
            return
        realm = challenge.params.get("realm")
        if not realm:
            raise StoreError(f"{self.host}: cannot {what}: the registry's Bearer challenge names no realm")
        if urlsplit(realm).scheme != "https" and not is_loopback(urlsplit(realm).netloc):
            raise StoreError(f"{self.host}: refusing the token realm {urlsplit(realm).netloc}: not HTTPS")
        query = {k: v for k, v in (("service", challenge.params.get("service")),) if v}
        scopes = scope.split(" ") if scope else ([challenge.params["scope"]] if challenge.params.get("scope") else [])
        headers = {}
        if creds is not None and creds.identity_token:
            resp = self._token_request("POST", realm, what, encode_multipart=False, fields={  # OAuth2: a form
                "grant_type": "refresh_token", "refresh_token": creds.password, "client_id": "hive-aot",
                "scope": " ".join(scopes), **query})
        else:
            if creds is not None:
                headers["Authorization"] = creds.basic()
            url = realm + ("&" if "?" in realm else "?") + urlencode([*query.items(), *(("scope", s) for s in scopes)])
            resp = self._token_request("GET", url, what, headers=headers)
        try:
            doc = json.loads(resp.data)
            token = doc.get("token") or doc.get("access_token")
            ttl = float(doc.get("expires_in") or 60)
        except (ValueError, AttributeError, TypeError):
            token = None
        if not isinstance(token, str) or not token:
            raise StoreError(f"{self.host}: cannot {what}: the token service answered without a token")
        with self._lock:
            self._tokens[scope] = (token, time.monotonic() + max(ttl - TOKEN_MARGIN_S, 1.0))

    def _token_request(self, method: str, url: str, what: str, **kw) -> urllib3.BaseHTTPResponse:
        try:
            resp = self.http.request(method, url, redirect=True, **kw)
        except urllib3.exceptions.HTTPError as e:
            raise StoreError(f"{self.host}: cannot {what}: token service unreachable ({type(e).__name__})") from None
        if resp.status in (401, 403):
            raise StoreError(f"{self.host}: cannot {what}: credentials refused by the token service ({resp.status})")
        if resp.status != 200:
            raise StoreError(f"{self.host}: cannot {what}: the token service answered {resp.status}")
        return resp

    # --- requests ----------------------------------------------------------------------------------------------
    def request(self, method: str, path: str, what: str, *, scope: str = "", headers: dict[str, str] | None = None,
                body: Body = None, ok: tuple[int, ...] = (200,), missing_ok: bool = False,
                stream: bool = False) -> urllib3.BaseHTTPResponse | None:
        """Send one request, answering one 401 challenge. `ok`: the statuses that succeed; a 404 returns None
        when `missing_ok`; anything else is a StoreError line. `what` is what the line says could not be done."""
        url = path if path.startswith(("http://", "https://")) else self.base + path
        for attempt in (0, 1):
            hdrs = dict(headers or {})
            auth = self._auth_header(scope)
            data = body() if callable(body) else body
            if auth is not None:
                # per request, never on the pool: urllib3 drops Authorization on a redirect to another host (a
                # blob store's presigned URL)
                hdrs["Authorization"] = auth
            try:
                resp = self.http.request(method, url, body=data, headers=hdrs, preload_content=not stream,
                                         redirect=method in ("GET", "HEAD"))
            except urllib3.exceptions.HTTPError as e:
                reason = type(getattr(e, "reason", None) or e).__name__
                raise StoreError(f"{self.host}: cannot {what}: registry unreachable ({reason})") from None
            finally:
                if callable(body) and hasattr(data, "close"):
                    data.close()
            if resp.status == 401 and attempt == 0:
                challenge = parse_challenge(resp.headers.get("WWW-Authenticate"))
                resp.drain_conn()
                if auth is not None and (challenge is None or challenge.scheme == "basic"):
                    break  # what we sent was refused
                self._answer(challenge, scope, what)
                continue
            break
        if resp.status in ok:
            return resp
        if resp.status == 404 and missing_ok:
            resp.drain_conn()
            return None
        raise self.error(resp, what)  # reads the (small) error body, streamed or not

    def error(self, resp: urllib3.BaseHTTPResponse, what: str) -> StoreError:
        code = _error_code(resp)
        err = self._error(resp, code, what)
        err.status, err.code = resp.status, code  # for a caller that retries
        return err

    def _error(self, resp: urllib3.BaseHTTPResponse, code: str, what: str) -> StoreError:
        detail = f"{resp.status}" + (f" {code}" if code else "")
        if resp.status == 401:
            return StoreError(f"{self.host}: cannot {what}: credentials refused ({detail})")
        if resp.status == 403:
            return StoreError(f"{self.host}: cannot {what}: access denied ({detail})")
        if resp.status == 404:
            return StoreError(f"{self.host}: cannot {what}: not found ({detail})")
        if resp.status == 413:
            return StoreError(f"{self.host}: cannot {what}: the registry refuses something this large ({detail})")
        if code.startswith(("DIGEST_INVALID", "SIZE_INVALID")):
            return IntegrityError(f"{self.host}: cannot {what}: the bytes do not match their digest ({detail})")
        if code.startswith(("MANIFEST_INVALID", "UNSUPPORTED", "MANIFEST_UNKNOWN")) or resp.status == 415:
            return StoreError(f"{self.host}: cannot {what}: the registry does not accept this artifact ({detail})")
        return StoreError(f"{self.host}: cannot {what}: the registry answered {detail}")

    # --- the distribution API ----------------------------------------------------------------------------------
    @staticmethod
    def scope(repo: str, push: bool = False, *more: str) -> str:
        return " ".join([f"repository:{repo}:{'pull,push' if push else 'pull'}", *more])

    def blob_size(self, repo: str, digest: str) -> int | None:
        resp = self.request("HEAD", f"/v2/{repo}/blobs/{digest}", f"stat blob {digest[7:19]}", scope=self.scope(repo),
                            missing_ok=True)
        return None if resp is None else int(resp.headers.get("Content-Length", -1))

    def blob_stream(self, repo: str, digest: str, start: int = 0, length: int | None = None) -> Iterator[bytes]:
        """The blob's bytes [start, start + length), streamed; a missing blob is a StoreError."""
        what = f"read blob {digest[7:19]}"
        headers = {} if start == 0 and length is None else {
            "Range": f"bytes={start}-" + ("" if length is None else str(start + length - 1))}
        resp = self.request("GET", f"/v2/{repo}/blobs/{digest}", what, scope=self.scope(repo), headers=headers,
                            ok=(200, 206), stream=True)
        try:
            skip = start if (resp.status == 200 and start) else 0  # a registry that ignores Range sends it all
            left = length
            for chunk in resp.stream(READ_CHUNK):
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
        except urllib3.exceptions.HTTPError as e:
            raise StoreError(f"{self.host}: cannot {what}: connection lost ({type(e).__name__})") from None
        finally:
            resp.release_conn()

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
                            scope=self.scope(repo), headers={"Accept": accept}, missing_ok=True)
        if resp is None:
            return None
        return resp.data, resp.headers.get("Docker-Content-Digest", "")

    def head_manifest(self, repo: str, reference: str) -> str | None:
        resp = self.request("HEAD", f"/v2/{repo}/manifests/{reference}", f"stat {repo}:{reference}",
                            scope=self.scope(repo), headers={"Accept": MANIFEST_TYPE}, missing_ok=True)
        return None if resp is None else resp.headers.get("Docker-Content-Digest", "")

    def put_manifest(self, repo: str, reference: str, data: bytes) -> None:
        """PUT the exact bytes (idempotent: the same bytes under the same reference), retried on a transient
        answer (TRANSIENT, or DIGEST_INVALID for bytes whose digest we computed ourselves)."""
        shown = f"{repo}@{reference[:19]}" if reference.startswith("sha256:") else f"{repo}:{reference}"
        for attempt in range(PUT_TRIES):
            try:
                self.request("PUT", f"/v2/{repo}/manifests/{reference}", f"write {shown}",
                             scope=self.scope(repo, True), body=data, ok=(201,),
                             headers={"Content-Type": MANIFEST_TYPE, "Content-Length": str(len(data))})
                return
            except StoreError as e:
                status, code = getattr(e, "status", 0), getattr(e, "code", "")
                if attempt == PUT_TRIES - 1 or not (status in TRANSIENT or code.startswith("DIGEST_INVALID")):
                    raise
                time.sleep(0.2 * (attempt + 1))

    def delete_manifest(self, repo: str, digest: str) -> None:
        self.request("DELETE", f"/v2/{repo}/manifests/{digest}", f"delete {repo}@{digest[7:19]}",
                     scope=self.scope(repo, True), ok=(202, 200, 204), missing_ok=True)

    def _pages(self, path: str, what: str, scope: str, field: str) -> Iterator[Any]:
        url: str | None = path
        while url:
            resp = self.request("GET", url, what, scope=scope, missing_ok=True)
            if resp is None:
                return
            try:
                items = json.loads(resp.data).get(field) or []
            except (ValueError, AttributeError):
                raise StoreError(f"{self.host}: cannot {what}: the registry's answer is not JSON") from None
            yield from items
            link = resp.headers.get("Link", "")  # </v2/...?last=x&n=100>; rel="next"
            url = link[link.index("<") + 1:link.index(">")] if "<" in link and 'rel="next"' in link else None

    def tags(self, repo: str) -> list[str]:
        """The repository's tags; none when it does not exist (yet, or any more)."""
        return sorted(self._pages(f"/v2/{repo}/tags/list?n=1000", f"list the tags of {repo}", self.scope(repo), "tags"))

    def catalog(self) -> list[str]:
        return sorted(self._pages("/v2/_catalog?n=1000", "list the registry's repositories (catalog)",
                                  "registry:catalog:*", "repositories"))
