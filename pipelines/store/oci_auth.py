"""Credentials for an OCI registry, found the way registry clients find them, and the challenge they answer.

Where a username/password comes from, first match wins:
1. HIVE_AOT_OCI_USERNAME + HIVE_AOT_OCI_PASSWORD (the password may be a token or a personal access token);
2. `$DOCKER_CONFIG/config.json` (default `~/.docker/config.json`): `credHelpers[host]`, then `credsStore`
   (both run `docker-credential-<name> get` with the host on stdin, as docker does), then `auths[host].auth`
   (base64 of `user:password`);
3. none: anonymous.

They are used only when the registry asks (a 401 with `WWW-Authenticate`): `Basic` sends them on every request,
`Bearer` exchanges them at the challenge's realm for a short-lived token per scope (Auth). No credential, token
or helper output ever reaches a message or a log: errors name the host and what failed, nothing else.

config.json is read the way every file a user names is (paths.read_small_file): a regular file of at most
CONFIG_LIMIT bytes, opened without blocking (a FIFO, /dev/zero or a link to one is one line, not a hang); a field
of the wrong type, deep nesting or a helper name that is not a plain name is one line naming the file.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

from ..core import settings
from ..core.errors import StoreError
from ..core.paths import read_small_file
from .oci_http import is_loopback

CONFIG_LIMIT = 1 << 20  # a docker config.json with a few hundred registries is a few KiB
_HELPER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # docker-credential-<name>, looked up on PATH only
TOKEN_MARGIN_S = 10.0  # renew a Bearer token this long before the realm said it expires


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = ""
    identity_token: bool = False  # a helper's `<token>` username: the secret is a refresh token (OAuth2 grant)

    def basic(self) -> str:
        return "Basic " + base64.b64encode(f"{self.username}:{self.password}".encode()).decode()

    def __repr__(self) -> str:  # never the secret, even in a traceback's locals
        return f"Credentials(username={self.username!r}, password=***)"


def _config_path() -> Path:
    root = settings.DOCKER_CONFIG.get() or str(Path.home() / ".docker")
    return Path(root) / "config.json"


def _helper(name: str, host: str, path: Path) -> Credentials | None:
    """`docker-credential-<name> get`: the host on stdin, JSON {Username, Secret} on stdout."""
    if not _HELPER_NAME.fullmatch(name):
        # a name with a '/' would make the program a path, run from wherever the command runs
        raise StoreError(f"{path}: credential helper {name[:40]!r} is not a helper name (letters, digits, . _ -)")
    program = f"docker-credential-{name}"
    try:
        proc = subprocess.run([program, "get"], input=host, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise StoreError(f"{host}: docker config names credential helper {name!r} but {program} is not on PATH") from None
    except subprocess.TimeoutExpired:
        raise StoreError(f"{host}: credential helper {program} did not answer within 30 s") from None
    if proc.returncode != 0:
        return None  # "credentials not found in native keychain": anonymous, as docker goes on
    try:
        doc = json.loads(proc.stdout)
        user, secret = doc["Username"], doc["Secret"]
        if not (isinstance(user, str) and isinstance(secret, str)):
            raise TypeError
    except (ValueError, KeyError, TypeError, RecursionError):
        raise StoreError(f"{host}: credential helper {program} answered something that is not its JSON") from None
    return Credentials(user, secret, identity_token=user == "<token>")


def _host_keys(host: str) -> list[str]:
    """How config.json may spell the host (docker login writes `host`, old clients `https://host/v1/`)."""
    return [host, f"https://{host}", f"http://{host}", f"https://{host}/v1/", f"http://{host}/v1/"]


def _read_config(path: Path) -> dict[str, Any] | None:
    """docker's config.json as an object; None when there is none."""
    try:
        raw = read_small_file(path, CONFIG_LIMIT)
    except FileNotFoundError:
        return None
    except ValueError as e:  # not a regular file, or larger than the limit: nothing past the limit was read
        raise StoreError(f"{path} {e} (docker's credential file)") from None
    except OSError as e:
        raise StoreError(f"{path}: cannot read docker's credential file ({e.strerror or type(e).__name__})") from None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
        raise StoreError(f"{path} is not readable JSON (docker's credential file)") from None
    if not isinstance(doc, dict):
        raise StoreError(f"{path}: docker's credential file is not a JSON object")
    return doc


def _field(doc: dict[str, Any], name: str, kind: type, path: Path, where: str = "") -> Any:
    """doc[name] when present and of `kind`; None when absent or null; one line naming the file otherwise."""
    value = doc.get(name)
    if value is None or isinstance(value, kind) and not isinstance(value, bool):
        return value
    raise StoreError(f"{path}: {where}{name} is {type(value).__name__}, not a "
                     f"{'string' if kind is str else 'JSON object'} (docker's credential file)")


def from_docker_config(host: str) -> Credentials | None:
    path = _config_path()
    doc = _read_config(path)
    if doc is None:
        return None
    helpers = _field(doc, "credHelpers", dict, path) or {}
    for k in _host_keys(host):
        name = _field(helpers, k, str, path, "credHelpers.")
        if name:
            return _helper(name, host, path)
    store = _field(doc, "credsStore", str, path)
    if store:
        found = _helper(store, host, path)
        if found is not None:
            return found
    auths = _field(doc, "auths", dict, path) or {}
    for k in _host_keys(host):
        entry = _field(auths, k, dict, path, "auths.")
        if entry is None:
            continue
        token = _field(entry, "identitytoken", str, path, f"auths.{k}.")
        if token:
            return Credentials("<token>", token, identity_token=True)
        auth = _field(entry, "auth", str, path, f"auths.{k}.")
        if auth:
            try:
                user, colon, password = base64.b64decode(auth).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                colon = ""
            if not colon:
                raise StoreError(f"{path}: the auth entry for {host} is not base64 of user:password")
            return Credentials(user, password)
    return None


def credentials_for(host: str) -> Credentials | None:
    user, password = settings.OCI_USERNAME.get(), settings.OCI_PASSWORD.get()
    if user or password:
        if not (user and password):
            raise StoreError(f"{host}: set both {settings.OCI_USERNAME.name} and {settings.OCI_PASSWORD.name} "
                             "(or neither: docker's config.json, else anonymous)")
        return Credentials(user, password)
    return from_docker_config(host)


_PARAM = re.compile(r'(\w+)=(?:"([^"]*)"|([^,\s]*))')


@dataclass(frozen=True)
class Challenge:
    scheme: str  # "basic" or "bearer"
    params: dict[str, str]


def parse_challenge(header: str | None) -> Challenge | None:
    """`WWW-Authenticate: Bearer realm="...",service="...",scope="..."` or `Basic realm="..."`."""
    if not header:
        return None
    scheme, _, rest = header.strip().partition(" ")
    params = {m.group(1).lower(): (m.group(2) if m.group(2) is not None else m.group(3)) for m in _PARAM.finditer(rest)}
    return Challenge(scheme.lower(), params)


Fetch = Callable[..., bytes]  # (method, url, what, **urllib3 request arguments) -> the token service's answer


class Auth:
    """What one registry host is sent, per scope: nothing until it asks; then Basic on every request, or a Bearer
    token per scope from its challenge's realm. Credentials are looked up once, on the first challenge."""

    def __init__(self, host: str):
        self.host = host
        self._lock = threading.Lock()
        self._creds: Credentials | None = None
        self._creds_loaded = False
        self._basic = False  # the registry asked for Basic: send it on every request from now on
        self._tokens: dict[str, tuple[str, float]] = {}  # scope -> (token, expires at)

    def credentials(self) -> Credentials | None:
        with self._lock:
            if not self._creds_loaded:
                self._creds, self._creds_loaded = credentials_for(self.host), True
            return self._creds

    def header(self, scope: str) -> str | None:
        """The Authorization header for a request to the registry itself (never to another origin)."""
        if self._basic:
            creds = self.credentials()
            return creds.basic() if creds else None
        with self._lock:
            token = self._tokens.get(scope)
        if token and token[1] > time.monotonic():
            return f"Bearer {token[0]}"
        return None

    def answer(self, challenge: Challenge | None, scope: str, what: str, fetch: Fetch) -> None:
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
        # the realm is where the standard flow sends the credentials (another host is normal: auth.docker.io)
        if urlsplit(realm).scheme != "https" and not is_loopback(urlsplit(realm).netloc):
            raise StoreError(f"{self.host}: refusing the token realm {urlsplit(realm).netloc}: not HTTPS")
        query = {k: v for k, v in (("service", challenge.params.get("service")),) if v}
        scopes = scope.split(" ") if scope else ([challenge.params["scope"]] if challenge.params.get("scope") else [])
        if creds is not None and creds.identity_token:
            raw = fetch("POST", realm, what, encode_multipart=False, fields={  # OAuth2: a form
                "grant_type": "refresh_token", "refresh_token": creds.password, "client_id": "hive-aot",
                "scope": " ".join(scopes), **query})
        else:
            headers = {"Authorization": creds.basic()} if creds is not None else {}
            url = realm + ("&" if "?" in realm else "?") + urlencode([*query.items(), *(("scope", s) for s in scopes)])
            raw = fetch("GET", url, what, headers=headers)
        try:
            doc = json.loads(raw)
            token = doc.get("token") or doc.get("access_token")
            ttl = float(doc.get("expires_in") or 60)
        except (ValueError, AttributeError, TypeError, RecursionError, OverflowError):
            token, ttl = None, 0.0
        if not isinstance(token, str) or not token:
            raise StoreError(f"{self.host}: cannot {what}: the token service answered without a token")
        with self._lock:
            self._tokens[scope] = (token, time.monotonic() + max(ttl - TOKEN_MARGIN_S, 1.0))
