"""Credentials for an OCI registry, found the way registry clients find them, and the challenge they answer.

Where a username/password comes from, first match wins:
1. HIVE_AOT_OCI_USERNAME + HIVE_AOT_OCI_PASSWORD (the password may be a token or a personal access token);
2. `$DOCKER_CONFIG/config.json` (default `~/.docker/config.json`): `credHelpers[host]`, then `credsStore`
   (both run `docker-credential-<name> get` with the host on stdin, as docker does), then `auths[host].auth`
   (base64 of `user:password`);
3. none: anonymous.

They are used only when the registry asks (a 401 with `WWW-Authenticate`): `Basic` sends them on every request,
`Bearer` exchanges them at the challenge's realm for a short-lived token per scope. No credential, token or
helper output ever reaches a message or a log: errors name the host and what failed, nothing else.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .. import settings
from ..errors import StoreError


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
    root = os.environ.get("DOCKER_CONFIG") or str(Path.home() / ".docker")
    return Path(root) / "config.json"


def _helper(name: str, host: str) -> Credentials | None:
    """`docker-credential-<name> get`: the host on stdin, JSON {Username, Secret} on stdout."""
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
        user, secret = str(doc["Username"]), str(doc["Secret"])
    except (ValueError, KeyError, TypeError):
        raise StoreError(f"{host}: credential helper {program} answered something that is not its JSON") from None
    return Credentials(user, secret, identity_token=user == "<token>")


def _host_keys(host: str) -> list[str]:
    """How config.json may spell the host (docker login writes `host`, old clients `https://host/v1/`)."""
    return [host, f"https://{host}", f"http://{host}", f"https://{host}/v1/", f"http://{host}/v1/"]


def from_docker_config(host: str) -> Credentials | None:
    path = _config_path()
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        raise StoreError(f"{path} is not readable JSON (docker's credential file)") from None
    if not isinstance(doc, dict):
        return None
    helpers = doc.get("credHelpers") or {}
    for k in _host_keys(host):
        if isinstance(helpers, dict) and isinstance(helpers.get(k), str):
            return _helper(helpers[k], host)
    if isinstance(doc.get("credsStore"), str) and doc["credsStore"]:
        found = _helper(doc["credsStore"], host)
        if found is not None:
            return found
    auths = doc.get("auths") or {}
    for k in _host_keys(host):
        entry = auths.get(k) if isinstance(auths, dict) else None
        if not isinstance(entry, dict):
            continue
        if entry.get("identitytoken"):
            return Credentials("<token>", str(entry["identitytoken"]), identity_token=True)
        if entry.get("auth"):
            try:
                user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                raise StoreError(f"{path}: the auth entry for {host} is not base64 of user:password") from None
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
