"""The OCI client against a hostile registry: an HTTP server on loopback (the standard library's, in a thread) that
answers whatever a test scripts. Credentials never leave the registry's origin (a `Link` or an upload `Location`
naming another host), no answer is read past its bound (endless catalog, tags, manifest, error body, token), no
request outlives its deadline (a `Link` loop, a server that trickles a byte every half second), and a malformed
docker config.json is one line naming the file, never a hang. Each case is one StoreError line, within seconds."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from processes import free_port

from pipelines.core.errors import StoreError
from pipelines.store import open_store
from pipelines.store.oci_client import Registry

USER, SECRET = "hive-user", "hostile-test-secret-3f9a"
BASIC = "Basic " + base64.b64encode(f"{USER}:{SECRET}".encode()).decode()
CAP = 64 << 20  # "endless" bodies stop here, far past every bound: a broken client cannot take the machine down
TRICKLE_S = 0.5


class Server:
    """A loopback HTTP/1.1 server: `route(handler)` answers each request (set per test); `seen` records
    (method, path, Authorization) of every request; `stop` ends every endless or trickling answer."""

    def __init__(self) -> None:
        self.port = free_port()
        self.seen: list[tuple[str, str, str | None]] = []
        self.route: Callable[[Handler], None] = lambda h: h.reply(404)
        self.stop = threading.Event()
        server = self

        class _Handler(Handler):
            owner = server

        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), _Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: Server

    def log_message(self, *args):  # quiet
        pass

    def _any(self) -> None:
        self.owner.seen.append((self.command, self.path, self.headers.get("Authorization")))
        length = int(self.headers.get("Content-Length") or 0)
        while length > 0 and (got := self.rfile.read(min(length, 1 << 20))):  # the body, whole, whatever its size
            length -= len(got)
        try:
            self.owner.route(self)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client hung up: what a bounded client does to an endless answer

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _any  # noqa: N815 - http.server's method names

    def reply(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def endless(self, status: int = 200, headers: dict[str, str] | None = None, piece: bytes = b'["x",') -> None:
        """A chunked body that never ends (until CAP, or the test's end)."""
        self.send_response(status)
        for k, v in {"Content-Type": "application/json", **(headers or {})}.items():
            self.send_header(k, v)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        block = piece * ((64 << 10) // len(piece))
        sent = 0
        while sent < CAP and not self.owner.stop.is_set():
            self.wfile.write(b"%x\r\n%s\r\n" % (len(block), block))
            sent += len(block)

    def trickle(self, status: int = 200, length: int = 10 << 20, headers: dict[str, str] | None = None) -> None:
        """A body of `length` bytes, one byte every TRICKLE_S: every read gets something, none ever the whole."""
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        while not self.owner.stop.wait(TRICKLE_S):
            self.wfile.write(b"{")
            self.wfile.flush()

    def trickle_headers(self) -> None:
        self.wfile.write(b"HTTP/1.1 200 OK\r\n")
        while not self.owner.stop.wait(TRICKLE_S):
            self.wfile.write(b"X")
            self.wfile.flush()


@pytest.fixture
def servers() -> Iterator[tuple[Server, Server]]:
    a, b = Server(), Server()
    yield a, b
    a.close()
    b.close()


@pytest.fixture(autouse=True)
def no_credentials(monkeypatch, tmp_path):
    monkeypatch.delenv("HIVE_AOT_OCI_USERNAME", raising=False)
    monkeypatch.delenv("HIVE_AOT_OCI_PASSWORD", raising=False)
    monkeypatch.delenv("HIVE_AOT_OCI_DEADLINE", raising=False)
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "no-docker"))


def _within(seconds: float, call: Callable[[], object]) -> BaseException | None:
    """Run `call` in a thread; what it raised (None: it returned). A call still running after `seconds` fails the
    test: that is the hang (the server's `stop` ends it afterwards)."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            out.append(None)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"still running after {seconds} s"
    return out[0]


def _one_line(err: BaseException | None, *needles: str) -> str:
    assert isinstance(err, StoreError), repr(err)
    line = str(err)
    assert "\n" not in line and SECRET not in line, line
    for n in needles:
        assert n in line, line
    return line


def _auth_front(a: Server, scheme: str, rest: Callable[[Handler], None]) -> None:
    """Server a demands `scheme` (Basic, or Bearer with its own /token) before answering with `rest`."""
    token = "tok-" + SECRET[-4:]

    def route(h: Handler) -> None:
        if h.path.startswith("/token"):
            ok = h.headers.get("Authorization") == BASIC
            return h.reply(200 if ok else 401, json.dumps({"token": token}).encode() if ok else b"")
        want = BASIC if scheme == "basic" else f"Bearer {token}"
        if h.headers.get("Authorization") != want:
            challenge = ('Basic realm="hostile"' if scheme == "basic"
                         else f'Bearer realm="http://127.0.0.1:{a.port}/token",service="hostile"')
            return h.reply(401, b'{"errors":[{"code":"UNAUTHORIZED"}]}', {"WWW-Authenticate": challenge})
        rest(h)

    a.route = route


# --- 3: credentials stay with the registry's origin ------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["basic", "bearer"])
def test_credentials_never_follow_a_link_or_an_upload_location_to_another_host(servers, monkeypatch, scheme):
    a, b = servers
    monkeypatch.setenv("HIVE_AOT_OCI_USERNAME", USER)
    monkeypatch.setenv("HIVE_AOT_OCI_PASSWORD", SECRET)
    other = f"http://localhost:{b.port}"  # another origin than 127.0.0.1:<a>, and loopback (plain HTTP allowed)

    def registry(h: Handler) -> None:
        if "/tags/list" in h.path:
            return h.reply(200, b'{"name":"hive/m","tags":["a"]}',
                           {"Link": f'<{other}/v2/hive/m/tags/list?last=a&n=1000>; rel="next"'})
        if h.command == "POST":
            return h.reply(202, headers={"Location": f"{other}/upload/1?_state=s"})
        h.reply(404)

    _auth_front(a, scheme, registry)
    b.route = lambda h: h.reply(201 if h.command == "PUT" else 200, b'{"tags":[]}' if h.command == "GET" else b"")
    reg = Registry(f"127.0.0.1:{a.port}")
    _one_line(_within(10, lambda: reg.tags("hive/m")), "links its next page to localhost, not to itself")
    data = b"blob bytes"
    assert _within(10, lambda: reg.upload_blob("hive/m", "sha256:" + hashlib.sha256(data).hexdigest(), len(data),
                                               data)) is None
    assert [m for m, _, _ in b.seen] == ["PUT"]  # the upload went on, to the blob store the registry named
    assert [auth for _, _, auth in b.seen] == [None]  # and nothing secret went with it
    assert any(auth for _, _, auth in a.seen)  # while the registry itself got them
    b.route = lambda h: h.reply(401, headers={"WWW-Authenticate": 'Basic realm="other"'})  # the other host asks
    _one_line(_within(10, lambda: reg.upload_blob("hive/m", "sha256:" + "0" * 64, 1, b"x")),
              "localhost, which is not the registry, asks for credentials")
    assert [auth for _, _, auth in b.seen] == [None, None]


# --- 4: every answer read to its bound -------------------------------------------------------------------------------
ENDLESS = {
    "catalog": (lambda h: h.endless(), lambda reg: reg.catalog(), "larger than 8 MiB"),
    "tags": (lambda h: h.endless(), lambda reg: reg.tags("hive/m"), "larger than 8 MiB"),
    "manifest": (lambda h: h.endless(), lambda reg: reg.get_manifest("hive/m", "latest"), "larger than 4 MiB"),
    "error body": (lambda h: h.endless(403), lambda reg: reg.get_manifest("hive/m", "latest"),
                   "access denied (403, an error body over 64 KiB, not read)"),
    "retried error body": (lambda h: h.endless(503), lambda reg: reg.tags("hive/m"),
                           "answered 503, an error body over 64 KiB"),
    "token": (None, lambda reg: reg.tags("hive/m"), "larger than 64 KiB"),
}


@pytest.mark.parametrize("kind", list(ENDLESS))
def test_an_endless_answer_is_refused_at_its_bound(servers, kind):
    a, _ = servers
    route, call, needle = ENDLESS[kind]
    if route is None:  # the token service streams for ever
        a.route = lambda h: h.endless() if h.path.startswith("/token") else h.reply(
            401, headers={"WWW-Authenticate": f'Bearer realm="http://127.0.0.1:{a.port}/token"'})
    else:
        a.route = route
    reg = Registry(f"127.0.0.1:{a.port}")
    started = time.monotonic()
    _one_line(_within(20, lambda: call(reg)), needle)
    assert time.monotonic() - started < 5


# --- 5: no request outlives its deadline -----------------------------------------------------------------------------
@pytest.mark.parametrize("loop", ["itself", "a cycle"])
def test_a_link_loop_ends_in_one_line(servers, loop):
    a, _ = servers

    def route(h: Handler) -> None:
        nxt = h.path if loop == "itself" else ("/v2/hive/m/tags/list?last=b" if "last=a" in h.path
                                                else "/v2/hive/m/tags/list?last=a")
        h.reply(200, b'{"tags":["a"]}', {"Link": f'<{nxt}>; rel="next"'})

    a.route = route
    _one_line(_within(10, lambda: Registry(f"127.0.0.1:{a.port}").tags("hive/m")), "a loop of Links")
    assert len(a.seen) <= 3


TRICKLING = {
    "manifest body": (lambda h: h.trickle(length=1000), lambda reg: reg.get_manifest("hive/m", "latest"),
                      "did not answer in full within 1 s (HIVE_AOT_OCI_DEADLINE)"),
    "headers": (lambda h: h.trickle_headers(), lambda reg: reg.tags("hive/m"), "did not answer in full within 1 s"),
    "blob": (lambda h: h.trickle(), lambda reg: b"".join(reg.blob_stream("hive/m", "sha256:" + "1" * 64)),
             "the transfer stalled (less than 1 MiB in 1 s, HIVE_AOT_OCI_DEADLINE)"),
}


@pytest.mark.parametrize("kind", list(TRICKLING))
def test_a_trickling_server_is_cut_off_at_the_deadline(servers, monkeypatch, kind):
    a, _ = servers
    monkeypatch.setenv("HIVE_AOT_OCI_DEADLINE", "1")
    route, call, needle = TRICKLING[kind]
    a.route = route
    reg = Registry(f"127.0.0.1:{a.port}")
    started = time.monotonic()
    _one_line(_within(15, lambda: call(reg)), needle)
    assert 0.9 < time.monotonic() - started < 3  # the deadline, not the 300 s per-read timeout


# --- 7: docker's config.json, malformed ----------------------------------------------------------------------------
def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


CONFIGS: dict[str, tuple[Callable[[Path, str], None], str]] = {
    "auth a number": (lambda p, host: p.write_text(json.dumps({"auths": {host: {"auth": 12345}}})),
                      "auth is int, not a string"),
    "auth a list": (lambda p, host: p.write_text(json.dumps({"auths": {host: {"auth": ["a", "b"]}}})),
                    "auth is list, not a string"),
    "auths a list": (lambda p, host: p.write_text(json.dumps({"auths": [host]})), "auths is list, not a JSON object"),
    "helper a number": (lambda p, host: p.write_text(json.dumps({"credHelpers": {host: 7}})),
                        "credHelpers." + "{host} is int"),
    "helper a path": (lambda p, host: p.write_text(json.dumps({"credsStore": "../../tmp/x"})), "not a helper name"),
    "auth not user:password": (lambda p, host: p.write_text(json.dumps({"auths": {host: {"auth": "bm9jb2xvbg=="}}})),
                               "not base64 of user:password"),
    "deep nesting": (lambda p, host: p.write_text("[" * 200_000 + "]" * 200_000), "is not readable JSON"),
    "over 1 MiB": (lambda p, host: p.write_text(" " * (1 << 20) + "{}"), "is larger than 1048576 bytes"),
    "a FIFO": (lambda p, host: _fifo(p), "is not a regular file"),
    "a link to /dev/zero": (lambda p, host: _dev_zero(p), "is not a regular file"),
}


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_a_malformed_docker_config_is_one_line_naming_it(servers, monkeypatch, tmp_path, kind):
    a, _ = servers
    host = f"127.0.0.1:{a.port}"
    _auth_front(a, "basic", lambda h: h.reply(404))
    docker = tmp_path / "docker"
    docker.mkdir()
    make, needle = CONFIGS[kind]
    make(docker / "config.json", host)
    monkeypatch.setenv("DOCKER_CONFIG", str(docker))
    store = open_store(f"oci://{host}/hive")
    try:
        err = _within(10, lambda: store.exists("profiles.json"))
    finally:
        if kind == "a FIFO":  # a reader still blocked on it (a hang) gets its end of file
            try:
                os.close(os.open(docker / "config.json", os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass  # no reader: nothing hangs
    _one_line(err, str(docker / "config.json"), needle.replace("{host}", host))
