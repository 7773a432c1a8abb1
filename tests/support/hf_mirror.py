"""pytest plugin: a real Hugging Face Hub mirror (olah, offline mode) on loopback.

The session fixture `hf_mirror` starts `olah-cli` from its own venv (`$HIVE_AOT_OLAH_VENV`, default
`.venvs/olah`) on a free 127.0.0.1 port and points `HF_ENDPOINT` at it for the whole session, so
the real huggingface_hub client (model_info, snapshot_download, Range requests) talks to it.

`hf_mirror.publish("org/name", src_dir)` turns a directory into a commit on branch `main` of the
git repo olah serves as `org/name`, and returns that commit's sha. Publishing again to the same
repo adds a new commit whose tree is exactly the new directory. Files go into git as ordinary
blobs (olah serves them from the git object store; no LFS).

olah quirks worth knowing (0.5.4, offline mode, checked with huggingface_hub 2.4):
- `model_info` without a revision answers 401: always pass one (the engine does). A branch name or a
  full commit sha both work, and `info.sha` is the git commit sha.
- An unknown repo and an unknown revision of a known repo both answer 401, which the client raises
  as RepositoryNotFoundError (never RevisionNotFoundError).
- Siblings of `model_info(files_metadata=True)` have `size=None` and `lfs=None` (files come straight
  from git), so there is no upstream digest to check against; README front matter does reach
  `card_data` (license).
- `GET /` answers 500; readiness here means "answers HTTP at all".
- huggingface_hub reads `HF_ENDPOINT` once, at import: see `_point_loaded_client_at`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from processes import free_port

START_TIMEOUT_S = 60.0


def _olah_cli() -> Path:
    venv = Path(os.environ.get("HIVE_AOT_OLAH_VENV") or Path.cwd() / ".venvs" / "olah")
    cli = venv / "bin" / "olah-cli"
    if not cli.exists():
        pytest.fail(f"{cli} is missing: run `make setup` (it builds the olah venv)")
    return cli


def _git(repo: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    # No system/user git config (signing, hooks, LFS filters) may change what gets committed.
    env.update(GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull, GIT_TERMINAL_PROMPT="0")
    res = subprocess.run(["git", "-C", str(repo), *args], env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {repo}: {res.stderr.strip()}")
    return res.stdout.strip()


def _log_tail(log: Path, n: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


@dataclass
class HfMirror:
    root: Path
    port: int
    process: subprocess.Popen
    log: Path
    published: dict[str, list[str]] = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def mirrors(self) -> Path:
        return self.root / "mirrors"

    def repo_path(self, repo_id: str) -> Path:
        org, _, name = repo_id.partition("/")
        if not org or not name or "/" in name or ".." in (org, name):
            raise ValueError(f"{repo_id!r} is not org/name")
        return self.mirrors / "models" / org / name

    def publish(self, repo_id: str, src_dir: Path, message: str | None = None) -> str:
        """Commit the files of src_dir as the new tree of branch `main` of repo_id; return the commit sha."""
        src_dir = Path(src_dir)
        if not src_dir.is_dir():
            raise ValueError(f"{src_dir} is not a directory")
        repo = self.repo_path(repo_id)
        if not (repo / ".git").is_dir():
            repo.mkdir(parents=True, exist_ok=True)
            _git(repo, "init", "-q", "-b", "main")
            _git(repo, "config", "user.name", "hive-aot tests")
            _git(repo, "config", "user.email", "tests@hive-aot.invalid")
            _git(repo, "config", "commit.gpgsign", "false")
        # Replace the work tree with the new content (keep .git only).
        for child in repo.iterdir():
            if child.name == ".git":
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
        for child in src_dir.iterdir():
            if child.name == ".git":
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.copytree(child, repo / child.name, symlinks=True)
            else:
                shutil.copy2(child, repo / child.name, follow_symlinks=False)
        _git(repo, "add", "-A")
        n = len(self.published.get(repo_id, [])) + 1
        _git(repo, "commit", "-q", "--allow-empty", "-m", message or f"publish {repo_id} #{n}")
        sha = _git(repo, "rev-parse", "HEAD")
        self.published.setdefault(repo_id, []).append(sha)
        return sha


def _answers_http(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2):
            return True
    except urllib.error.HTTPError:
        return True  # any HTTP status means the server is up
    except (urllib.error.URLError, OSError):
        return False


def start_mirror(root: Path) -> HfMirror:
    """Start olah in offline mode over `root/mirrors` on a free loopback port (also used by bench/)."""
    (root / "repos").mkdir(parents=True, exist_ok=True)
    (root / "mirrors" / "models").mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = root / "config.toml"
    config.write_text(
        "[basic]\n"
        f'host = "127.0.0.1"\n'
        f"port = {port}\n"
        f'mirror-netloc = "127.0.0.1:{port}"\n'
        f'mirror-lfs-netloc = "127.0.0.1:{port}"\n'
        f'repos-path = "{root / "repos"}"\n'
        f'mirrors-path = ["{root / "mirrors"}"]\n'
        "[accessibility]\n"
        "offline = true\n"
    )
    log = root / "olah.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    with open(log, "wb") as logf:
        proc = subprocess.Popen([str(_olah_cli()), "-c", str(config)], cwd=root, env=env, stdout=logf,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    mirror = HfMirror(root=root, port=port, process=proc, log=log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _answers_http(port):
        if proc.poll() is not None:
            raise RuntimeError(f"olah exited with {proc.returncode} before answering on port {port}:\n{_log_tail(log)}")
        if time.monotonic() > deadline:
            _stop(proc)
            raise RuntimeError(f"olah did not answer on port {port} within {START_TIMEOUT_S:.0f} s:\n{_log_tail(log)}")
        time.sleep(0.2)
    return mirror


@pytest.fixture(scope="session")
def hf_mirror(tmp_path_factory, hermetic_env):
    """A running olah mirror; HF_ENDPOINT points at it for the rest of the session."""
    try:
        mirror = start_mirror(tmp_path_factory.mktemp("hf-mirror"))
    except RuntimeError as e:
        pytest.fail(str(e))
    try:
        old = os.environ.get("HF_ENDPOINT")
        os.environ["HF_ENDPOINT"] = mirror.endpoint
        restore = _point_loaded_client_at(mirror.endpoint)
        try:
            yield mirror
        finally:
            restore()
            if old is None:
                os.environ.pop("HF_ENDPOINT", None)
            else:
                os.environ["HF_ENDPOINT"] = old
    finally:
        _stop(mirror.process)


def _point_loaded_client_at(endpoint: str):
    """huggingface_hub reads HF_ENDPOINT once, at import. If something in this test process imported it
    before the mirror started (transformers does), update its endpoint constants too; returns an undo."""
    import sys

    constants = sys.modules.get("huggingface_hub.constants")
    if constants is None:
        return lambda: None
    saved = {k: getattr(constants, k) for k in ("ENDPOINT", "HUGGINGFACE_CO_URL_TEMPLATE")}
    constants.ENDPOINT = endpoint
    constants.HUGGINGFACE_CO_URL_TEMPLATE = endpoint + "/{repo_id}/resolve/{revision}/{filename}"

    def restore() -> None:
        for k, v in saved.items():
            setattr(constants, k, v)

    return restore


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
