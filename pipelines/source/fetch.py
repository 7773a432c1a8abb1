"""Fetch a model source to a pinned local snapshot: `hf://owner/repo[@rev]`, `owner/repo[@rev]`, or a directory.

Only what builds need is downloaded (configs, tokenizer files, chat template, safetensors + index);
every file name is checked before it touches the disk, and each file gets a size and sha256.
Pickle weights are refused, never opened. The HF token comes from `HF_TOKEN` (read by the
huggingface_hub client itself) and never appears in a message.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from ..core import meter, progress, settings
from ..core.errors import SourceError
from ..core.hashing import DigestCache, sha256_file, sha256_json
from ..core.paths import cache_root, check_model_id, confined, model_slug, safe_relpath
from ..core.progress import bar

# The snapshot's data model (re-exported: most of the engine knows it as sources.*).
from .snapshot import (  # noqa: F401
    _COMMIT_RE,
    _REPO_RE,
    EXCLUDED_PATTERNS,
    MARKER,
    PICKLE_PATTERNS,
    WANTED_PATTERNS,
    FileRecord,
    Snapshot,
    SourceSpec,
    check_index,
    hf_cache_model_id,
    hf_cache_repo_dir,
    index_shards,
    load_config,
    parse_source,
    select_files,
)


def _hash_files(root: Path, names: list[str], cache: DigestCache | None = None,
                within: Path | None = None, hashed: bool = True) -> list[FileRecord]:
    """Size and sha256 of each file (cached by file identity). `hashed=False`: only what the cache already knows;
    the others get no digest (nothing is read)."""
    total = sum(confined(root, n, within).stat().st_size for n in names)
    out = []
    # A step (a line at its start and end) only where bytes are read: digests the cache knows cost nothing.
    reads = hashed and (cache is None or any(cache.get(confined(root, n, within)) is None for n in names))
    with meter.step("fetch", label="hash source") if reads else nullcontext(), bar(total if hashed else 0, "sha256") as pb:
        for n in names:
            p = confined(root, n, within)  # through a symlink: the blob's bytes, cached by its real path
            if not p.is_file():  # confined() already refused links leading outside
                raise SourceError(f"refusing {n!r}: not a regular file")
            digest = cache.get(p) if cache is not None else None
            if digest is None and hashed:
                digest = sha256_file(p, pb)
                if cache is not None:
                    cache.put(p, digest)
            out.append(FileRecord(n, p.stat().st_size, digest))
    if cache is not None:
        cache.save()
    return out


def _readme_license(root: Path) -> str | None:
    readme = root / "README.md"
    if not readme.is_file():
        return None
    text = readme.read_text(encoding="utf-8", errors="replace")
    m = re.match(r"^---\n(.*?)\n---", text, re.S)
    if not m:
        return None
    lm = re.search(r"^license:\s*['\"]?([^'\"\n]+)", m.group(1), re.M)
    return lm.group(1).strip() if lm else None


UNHASHED = "local-unhashed"  # the revision of a local snapshot looked at without hashing (plan, check)


def fetch_local(spec: SourceSpec, model_id: str | None, hashed: bool = True, weights_required: bool = True) -> Snapshot:
    """A local directory as a snapshot. `hashed=False` reads names, sizes and what the digest cache knows, never
    the weights' bytes (plan and check read headers only); a build hashes them when it starts."""
    root = spec.path
    assert root is not None
    hf_repo = hf_cache_repo_dir(root)  # None for a plain directory: symlinks must stay inside root
    names = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for fn in filenames:
            if fn.startswith("."):
                continue
            names.append(str(Path(dirpath, fn).relative_to(root)).replace(os.sep, "/"))
    mid = check_model_id(model_id or (hf_cache_model_id(hf_repo) if hf_repo else None) or f"local/{root.name}",
                         hint="; give --model-id org/name")
    wanted = select_files(names, mid, weights_required)
    for n in wanted:
        confined(root, n, hf_repo)  # symlinks must stay inside the directory (or its HF cache repo tree)
    check_index(root, wanted, mid)
    files = _hash_files(root, wanted, DigestCache(), hf_repo, hashed=hashed)
    known = all(f.sha256 is not None for f in files)
    digest = sha256_json(sorted((f.path, f.sha256) for f in files)) if known else None
    # An HF cache snapshot is named by its commit: pin it like `hf://org/name@<commit>` would, so the same
    # files give the same build id; the file digests are still part of it.
    rev = root.name if hf_repo and _COMMIT_RE.match(root.name) else (f"local-{digest}" if known else UNHASHED)
    return Snapshot(model_id=mid, source=str(root), revision=rev, commit=rev, local_dir=str(root),
                    files=files, license=_readme_license(root), gated=False)


def _hf_errors():
    from huggingface_hub import errors as hf_errors

    return hf_errors


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection-level failures of the Hub client's HTTP stack (httpx2 in huggingface_hub 2.x, httpx in
    1.x); they are not OSErrors, so without this an unreachable Hub ends in a traceback."""
    import importlib

    errs: list[type[BaseException]] = [OSError]
    for mod in ("httpx2", "httpx"):
        try:
            errs.append(importlib.import_module(mod).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(errs)


def hf_license(info) -> str | None:
    """The repo's license from its card data, else from a `license:` tag."""
    card = getattr(info, "card_data", None) or {}
    found = card.get("license") if hasattr(card, "get") else None
    return found or next((t.split(":", 1)[1] for t in (info.tags or []) if t.startswith("license:")), None)


def fetch_hf_info(api, spec: SourceSpec, files_metadata: bool = True):
    """model_info at the requested revision (commit sha, file list, card data), errors as one line."""
    hf_errors = _hf_errors()
    repo = spec.repo_id
    try:
        # Offline mirrors answer model_info without a revision with 401; always ask for one.
        return api.model_info(repo, revision=spec.revision or "main", files_metadata=files_metadata)
    except hf_errors.GatedRepoError:
        raise SourceError(f"{repo}: gated repo - accept its terms on the Hub and set HF_TOKEN") from None
    except hf_errors.RepositoryNotFoundError:
        raise SourceError(f"{repo}: repository not found (or private without HF_TOKEN)") from None
    except hf_errors.RevisionNotFoundError:
        raise SourceError(f"{repo}: revision {spec.revision!r} not found") from None
    except hf_errors.HfHubHTTPError as e:
        code = getattr(getattr(e, "response", None), "status_code", "?")
        raise SourceError(f"{repo}: the Hub answered HTTP {code}") from None
    except _transport_errors() as e:
        raise SourceError(f"{repo}: cannot reach the Hub at {api.endpoint} ({type(e).__name__})") from None


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub read it at import, or as set in the environment since then."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or (settings.HF_HUB_OFFLINE.get() or "").upper() in {"1", "ON", "YES", "TRUE"}


def _snapshot_dest(repo: str, commit: str) -> Path:
    return cache_root() / "snapshots" / model_slug(repo) / commit


def _cached_snapshot(dest: Path) -> Snapshot | None:
    """hive-aot's own snapshot at dest if complete: the marker is written last and every file has its size."""
    marker = dest / MARKER
    if not marker.is_file():
        return None
    snap = Snapshot.from_dict(json.loads(marker.read_text()))
    if all(confined(dest, f.path).is_file() and confined(dest, f.path).stat().st_size == f.size for f in snap.files):
        return snap
    return None


def fetch_hf_offline(spec: SourceSpec) -> Snapshot:
    """`hf://` with the Hub offline: hive-aot's own snapshot cache, else the user's HF cache (`HF_HUB_CACHE`).

    The revision resolves as huggingface_hub resolves it offline: a full commit sha as is, else
    `models--org--name/refs/<revision>`. An HF cache snapshot is read in place, with fetch_local's rules.
    """
    from huggingface_hub import constants

    repo, rev = spec.repo_id, spec.revision or "main"
    assert repo is not None
    hf_repo = Path(constants.HF_HUB_CACHE) / f"models--{model_slug(repo)}"
    offline = "the Hub is offline (HF_HUB_OFFLINE)"
    if _COMMIT_RE.match(rev):
        commit = rev
    else:
        ref = confined(hf_repo / "refs", safe_relpath(rev, what="revision"))  # `refs/pr/1` yes, `../x` no
        commit = ref.read_text().strip() if ref.is_file() else ""
        if not _COMMIT_RE.match(commit):
            raise SourceError(f"{repo}: revision {rev!r} is not in the HF cache (no commit in {ref}) and {offline}")
    dest = _snapshot_dest(repo, commit)
    snap = _cached_snapshot(dest)
    if snap is None:
        snap_dir = hf_repo / "snapshots" / commit
        if not snap_dir.is_dir():
            raise SourceError(f"{repo}: revision {rev!r} (commit {commit}) is cached neither in {dest} nor in "
                              f"{snap_dir} and {offline}")
        snap = fetch_local(SourceSpec("local", path=snap_dir.resolve()), repo)
        snap.gated = "unknown"  # only the Hub knows; nothing offline says
    # Describe this request (pinned_source then gives hf://repo@commit), whichever cache served it.
    snap.source, snap.revision = spec.uri, rev
    return snap


@contextmanager
def _hub_bars(shown: bool) -> Iterator[None]:
    """huggingface_hub's download bars as hive-aot's own are: drawn on a terminal, never into a log or when quiet
    (the Hub client draws them wherever stderr goes)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if shown or are_progress_bars_disabled():
        yield
        return
    disable_progress_bars()
    try:
        yield
    finally:
        enable_progress_bars()


def fetch_hf(spec: SourceSpec, model_id: str | None) -> Snapshot:
    from huggingface_hub import HfApi, snapshot_download

    hf_errors = _hf_errors()
    repo = spec.repo_id
    assert repo is not None
    if model_id and model_id != repo:
        raise SourceError(f"model id {model_id!r} does not match the source repo {repo!r}")
    if hub_offline():
        return fetch_hf_offline(spec)
    if spec.revision and _COMMIT_RE.match(spec.revision):
        # A commit never changes: once its snapshot is complete here, the Hub has nothing to add (a no-op
        # onboarding of a pinned model asks it nothing).
        snap = _cached_snapshot(_snapshot_dest(repo, spec.revision))
        if snap is not None:
            snap.source, snap.revision = spec.uri, spec.revision
            return snap
    info = fetch_hf_info(HfApi(), spec)
    commit = info.sha
    if not commit:
        raise SourceError(f"{repo}: the Hub did not return a commit sha")
    siblings = {s.rfilename: s for s in (info.siblings or [])}
    wanted = select_files(list(siblings), repo)
    dest = _snapshot_dest(repo, commit)
    snap = _cached_snapshot(dest)
    if snap is not None:
        # Content comes from the cache; source and revision describe this request, not the first one.
        snap.source, snap.revision = spec.uri, spec.revision or "main"
        return snap
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Download into a private directory and rename: a crash never leaves a snapshot that looks complete.
    tmp = Path(tempfile.mkdtemp(prefix=f".{commit}.", dir=dest.parent))
    try:
        with meter.step("fetch", label="download source"), _hub_bars(progress.bars_shown()):
            snapshot_download(repo, revision=commit, allow_patterns=wanted, local_dir=str(tmp))
        shutil.rmtree(tmp / ".cache", ignore_errors=True)
        for n in wanted:
            if not confined(tmp, n).is_file():
                raise SourceError(f"{repo}: {n} was listed but not downloaded")
        check_index(tmp, wanted, repo)
        files = _hash_files(tmp, wanted)
        for f in files:
            s = siblings[f.path]
            lfs_sha = getattr(getattr(s, "lfs", None), "sha256", None)
            if lfs_sha and lfs_sha != f.sha256:
                raise SourceError(f"{repo}: {f.path} sha256 does not match the Hub's LFS digest")
            if s.size is not None and s.size != f.size:
                raise SourceError(f"{repo}: {f.path} is {f.size} bytes, the Hub says {s.size}")
        license_ = hf_license(info)
        snap = Snapshot(model_id=repo, source=spec.uri, revision=spec.revision or "main", commit=commit,
                        local_dir=str(dest), files=files, license=license_, gated=info.gated or False)
        (tmp / MARKER).write_text(json.dumps(snap.to_dict()))
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except hf_errors.HfHubHTTPError as e:
        code = getattr(getattr(e, "response", None), "status_code", "?")
        raise SourceError(f"{repo}: download failed with HTTP {code}") from None
    except _transport_errors() as e:  # the Hub went away mid-download (LocalEntryNotFoundError is an OSError)
        raise SourceError(f"{repo}: download failed ({type(e).__name__})") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return snap


def resolve_revision(source: str, model_id: str | None = None) -> str:
    """The commit a source resolves to now, without downloading it: one Hub call (model_info) for a Hub repo,
    the content digest for a local directory (hashes are cached by file identity). Equal to the `commit` of the
    snapshot `fetch` would return, so a changed upstream revision is a changed value."""
    spec = parse_source(source)
    if spec.kind != "hf":
        return fetch_local(spec, model_id).commit
    from huggingface_hub import HfApi

    if hub_offline():
        return fetch_hf_offline(spec).commit
    info = fetch_hf_info(HfApi(), spec, files_metadata=False)
    if not info.sha:
        raise SourceError(f"{spec.repo_id}: the Hub did not return a commit sha")
    return info.sha


def fetch(source: str, model_id: str | None = None, hashed: bool = True, weights_required: bool = True) -> Snapshot:
    """`hashed=False` (plan, check): a local directory's weights are not read (see fetch_local);
    `weights_required=False` (check): a local directory with config.json but no weights is a snapshot too."""
    spec = parse_source(source)
    return (fetch_hf(spec, model_id) if spec.kind == "hf"
            else fetch_local(spec, model_id, hashed=hashed, weights_required=weights_required))
