"""pytest plugin: a real OCI registry (Debian's `docker-registry`, Distribution 2.8) on 127.0.0.1 per test session.

Two instances, each started on first use with its own config on a free loopback port, its data under the
session's tmp dir, and stopped at the end: an anonymous one (`oci_registry`), and one that requires htpasswd
Basic auth (`oci_auth_registry`; the bcrypt hash is made with the standard library's `crypt`, which Python 3.11
still has and Debian's libcrypt implements; without it that fixture skips saying so). Deletes are enabled (retire
and gc delete manifests and blobs) and `http.secret` is set, as a real deployment's would be.
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from processes import free_port, serving

START_TIMEOUT_S = 60.0
USER, PASSWORD = "hive-test", "oci-test-secret-71ac"
REPOSITORY = "hive"
_roots: dict[str, Path] = {}  # host -> the registry's root directory (config, data, log)


def data_dir(host: str) -> Path:
    """The registry's storage (the tamper tests reach under it, as someone with disk access would)."""
    return _roots[host] / "data"


def _binary() -> str:
    path = shutil.which("docker-registry")
    if path is None:
        pytest.fail("docker-registry is missing: run `make setup` (requirements/system-packages.sh installs it)")
    return path


def bcrypt_hash(password: str) -> str | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            import crypt
        except ImportError:
            return None
    try:
        hashed = crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=1 << 5))
    except (OSError, ValueError):
        return None
    return hashed if hashed and hashed.startswith("$2") else None


@contextmanager
def registry(root: Path, htpasswd: str | None = None) -> Iterator[str]:
    """A registry with its data under `root`: yields `127.0.0.1:<port>`."""
    port = free_port()
    root.mkdir(parents=True, exist_ok=True)
    auth = ""
    if htpasswd is not None:
        (root / "htpasswd").write_text(htpasswd)
        auth = f"auth:\n  htpasswd:\n    realm: hive-test\n    path: {root / 'htpasswd'}\n"
    (root / "config.yml").write_text(
        "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\n"
        f"storage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n  secret: local-test-only-{uuid.uuid4().hex}\n{auth}")
    args = [_binary(), "serve", str(root / "config.yml")]
    host = f"127.0.0.1:{port}"
    _roots[host] = root
    with serving("docker-registry", args, root, root / "registry.log", lambda: _answers(host), START_TIMEOUT_S):
        yield host


def _answers(host: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}/v2/", timeout=2):
            return True
    except urllib.error.HTTPError:
        return True  # 401: up, and asking for credentials
    except OSError:
        return False


@pytest.fixture(scope="session")
def oci_registry(tmp_path_factory, hermetic_env) -> Iterator[str]:
    """`127.0.0.1:<port>` of an anonymous registry; its data directory is `oci_registry_data`."""
    try:
        with registry(tmp_path_factory.mktemp("oci-registry")) as host:
            yield host
    except RuntimeError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def oci_auth_registry(tmp_path_factory, hermetic_env) -> Iterator[str]:
    """`127.0.0.1:<port>` of a registry that requires Basic auth as USER/PASSWORD."""
    hashed = bcrypt_hash(PASSWORD)
    if hashed is None:
        pytest.skip("no bcrypt here (Python's crypt module with libcrypt's bcrypt): the Basic-auth registry "
                    "cannot be configured")
    try:
        with registry(tmp_path_factory.mktemp("oci-auth-registry"), f"{USER}:{hashed}\n") as host:
            yield host
    except RuntimeError as e:
        pytest.fail(str(e))


@pytest.fixture
def oci_uri(oci_registry) -> str:
    """A fresh, empty store: its own repository namespace in the shared registry."""
    return f"oci://{oci_registry}/{REPOSITORY}-{uuid.uuid4().hex[:12]}"


@contextmanager
def token_proxy(upstream: str, user: str, password: str) -> Iterator[str]:
    """A registry front that demands the Bearer token flow (as Docker Hub, GHCR or Harbor do) before the real
    registry at `upstream`: a request without a valid token gets 401 with a Bearer challenge, `/token` hands out
    a token for Basic `user:password` only. Yields its `127.0.0.1:<port>`. Bodies are buffered: small test data."""
    import base64
    import http.client
    import secrets
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import parse_qs, urlsplit

    port = free_port()
    me = f"127.0.0.1:{port}"
    issued: set[str] = set()
    expected = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _reply(self, status: int, headers: dict[str, str], body: bytes = b"") -> None:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _handle(self) -> None:
            url = urlsplit(self.path)
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if url.path == "/token":
                if self.headers.get("Authorization") != expected:
                    return self._reply(401, {}, b'{"errors":[{"code":"UNAUTHORIZED"}]}')
                token = secrets.token_hex(16)
                issued.add(token)
                scope = parse_qs(url.query).get("scope", [""])[0]
                return self._reply(200, {"Content-Type": "application/json"},
                                   json.dumps({"token": token, "expires_in": 300, "scope": scope}).encode())
            auth = self.headers.get("Authorization", "")
            if not (auth.startswith("Bearer ") and auth[7:] in issued):
                challenge = f'Bearer realm="http://{me}/token",service="test-registry"'
                return self._reply(401, {"WWW-Authenticate": challenge, "Content-Type": "application/json"},
                                   b'{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}')
            conn = http.client.HTTPConnection(upstream, timeout=60)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("authorization", "host")}
            conn.request(self.command, self.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            out = {k: v.replace(upstream, me) for k, v in resp.getheaders()
                   if k.lower() not in ("content-length", "transfer-encoding", "connection")}
            conn.close()
            self._reply(resp.status, out, data)

        do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _handle  # noqa: N815 - http.server's method names

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield me
    finally:
        server.shutdown()
        server.server_close()
