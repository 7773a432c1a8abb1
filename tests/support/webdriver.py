"""A minimal W3C WebDriver client for Debian's chromedriver + headless chromium: open a page, wait until its
rendered text contains what a person would look for, take a screenshot. Standard library only (urllib)."""

from __future__ import annotations

import base64
import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

# As the platform's probe starts it as root: no sandbox, no GPU, and none of the background connections a
# closed network refuses (each one otherwise costs a timeout).
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1600,1000"]


def browser_missing() -> str | None:
    """Why no browser test can run here, or None."""
    for cmd, package in (("chromium", "chromium"), ("chromedriver", "chromium-driver")):
        if shutil.which(cmd) is None:
            return f"{cmd} is not installed (Debian package {package}; `make setup` installs it where apt works)"
    return None


class Browser:
    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.profile = Path(tempfile.mkdtemp(prefix="hive-aot-chromium-"))
        self.driver = subprocess.Popen([shutil.which("chromedriver"), f"--port={self.port}"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 30
        while True:
            try:
                if self._call("GET", "/status")["value"]["ready"]:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError("chromedriver did not start")
            time.sleep(0.2)
        caps = {"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": {
            "binary": shutil.which("chromium"), "args": CHROMIUM_ARGS + [f"--user-data-dir={self.profile}"]}}}}
        self.session = self._call("POST", "/session", caps)["value"]["sessionId"]

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method,
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    def _session(self, method: str, path: str, body: dict | None = None):
        return self._call(method, f"/session/{self.session}{path}", body)["value"]

    def open(self, url: str) -> None:
        self._session("POST", "/url", {"url": url})

    def script(self, source: str, *args):
        return self._session("POST", "/execute/sync", {"script": source, "args": list(args)})

    def text(self) -> str:
        return self.script("return document.body ? document.body.innerText : '';")

    def wait_for_text(self, *needles: str, timeout: float = 60) -> str:
        """The page's rendered text once it contains every needle; fails naming what is missing."""
        deadline = time.time() + timeout
        while True:
            text = self.text()
            missing = [n for n in needles if n not in text]
            if not missing:
                return text
            if time.time() > deadline:
                raise AssertionError(f"page never showed {missing}; it shows: {text[:1500]!r}")
            time.sleep(0.5)

    def click_text(self, label: str) -> bool:
        """Click the first button or link whose text is `label` (e.g. to dismiss a first-visit dialog), else the
        first innermost element showing exactly that text (a list entry: the click reaches its handler)."""
        return self.script("""
            const all = [...document.querySelectorAll('*')];
            const el = all.find(e => (e.tagName === 'BUTTON' || e.tagName === 'A') && e.innerText.trim() === arguments[0])
                    || all.find(e => e.children.length === 0 && (e.innerText || '').trim() === arguments[0]);
            if (el) { el.click(); return true; } return false;""", label)

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self._session("GET", "/screenshot")))
        return path

    def close(self) -> None:
        try:
            self._call("DELETE", f"/session/{self.session}")
        except OSError:
            pass
        self.driver.terminate()
        try:
            self.driver.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.driver.kill()
        shutil.rmtree(self.profile, ignore_errors=True)
