"""A pinned model snapshot and what may be in one: the source grammar, the files a build reads (safetensors,
configs, tokenizer; never pickles), shard indexes that stay inside the snapshot, and Hugging Face cache
layouts. Data only: fetching (fetch.py) builds on it.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import ModelFormatError, SourceError
from ..core.hashing import sha256_json
from ..core.paths import MODEL_ID_PATTERN, confined, safe_relpath

# What a build may read. Anything else in the repo (pickles, original/, consolidated.*) is left upstream.
WANTED_PATTERNS = [
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
    "chat_template.json", "model_index.json", "*.safetensors", "model.safetensors.index.json",
    "README.md", "LICENSE", "LICENSE.txt",
    # a vision-language model's processor: its projector GGUF records the normalization (gguf/mmproj.py); vLLM and
    # transformers build the processor from these
    "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
]
# Besides the weights, the files vLLM and transformers read from a model directory, which every kind's artifact
# carries as they are; licence and model card travel with the weights. Pickles, original/, consolidated* and
# params.json never do (consolidated*.safetensors silently switches vLLM to the Mistral load format).
CARRIED_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
    "chat_template.json", "README.md", "LICENSE", "LICENSE.txt",
    "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
)
EXCLUDED_PATTERNS = ["original/*", "consolidated*.safetensors"]
PICKLE_PATTERNS = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.pickle"]
MARKER = ".hive-aot-snapshot.json"

_REPO_RE = re.compile(rf"^({MODEL_ID_PATTERN})(?:@([A-Za-z0-9._/-]+))?\Z")  # \Z: no trailing newline
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")  # a full git commit sha, as the Hub and its cache name commits


@dataclass(frozen=True)
class SourceSpec:
    kind: str  # "hf" | "local"
    repo_id: str | None = None
    revision: str | None = None
    path: Path | None = None

    @property
    def uri(self) -> str:
        if self.kind == "hf":
            return f"hf://{self.repo_id}" + (f"@{self.revision}" if self.revision else "")
        return str(self.path)


def parse_source(source: str) -> SourceSpec:
    if source.startswith("hf://"):
        m = _REPO_RE.match(source[5:])
        if not m:
            raise SourceError(f"{source!r} is not hf://owner/repo[@revision]")
        return SourceSpec("hf", m.group(1), m.group(2))
    if source.startswith("file://"):
        source = source[7:]
    p = Path(source).expanduser()
    if p.exists() or source.startswith((".", "/", "~")):
        if not p.is_dir():
            raise SourceError(f"{source}: not a directory")
        return SourceSpec("local", path=p.resolve())
    m = _REPO_RE.match(source)
    if m:
        return SourceSpec("hf", m.group(1), m.group(2))
    raise SourceError(f"{source!r} is neither a directory nor owner/repo[@revision]")


@dataclass
class FileRecord:
    path: str
    size: int
    sha256: str | None  # None: not hashed yet (a header-only look at a local directory: plan, check)


@dataclass
class Snapshot:
    model_id: str
    source: str
    revision: str
    commit: str
    local_dir: str
    files: list[FileRecord]
    license: str | None = None
    gated: bool | str = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def dir(self) -> Path:
        return Path(self.local_dir)

    @property
    def pinned_source(self) -> str:
        """A source string that fetches exactly this snapshot again."""
        if self.source.startswith("hf://"):
            return f"hf://{self.model_id}@{self.commit}"
        return self.local_dir

    def file(self, name: str) -> Path | None:
        if any(f.path == name for f in self.files):
            return confined(self.dir, name, hf_cache_repo_dir(self.dir))
        return None

    def has(self, name: str) -> bool:
        return any(f.path == name for f in self.files)

    def safetensors_files(self) -> list[Path]:
        fence = hf_cache_repo_dir(self.dir)
        return [confined(self.dir, f.path, fence) for f in self.files if f.path.endswith(".safetensors")]

    def config(self) -> dict[str, Any]:
        return load_config(self)

    @property
    def hashed(self) -> bool:
        return all(f.sha256 is not None for f in self.files)

    @property
    def content_digest(self) -> str:
        if not self.hashed:
            raise SourceError(f"{self.model_id}: the snapshot's files were not hashed (a header-only look)")
        return sha256_json(sorted((f.path, f.sha256) for f in self.files))

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def weight_bytes(self) -> int:
        """The safetensors files' bytes: what a build step reads from the source."""
        return sum(f.size for f in self.files if f.path.endswith(".safetensors"))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Snapshot:
        return cls(**{**d, "files": [FileRecord(**f) for f in d["files"]]})


def load_config(snap: Snapshot) -> dict[str, Any]:
    path = snap.file("config.json")
    if path is None:
        raise ModelFormatError(f"{snap.model_id}: config.json is missing")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:  # not UTF-8, not JSON, or an integer beyond Python's 4300-digit conversion limit
        raise ModelFormatError(f"{snap.model_id}: config.json is not valid JSON ({str(e)[:120]})") from None
    except RecursionError:
        raise ModelFormatError(f"{snap.model_id}: config.json is nested too deeply to be a model config") from None
    if not isinstance(cfg, dict):
        raise ModelFormatError(f"{snap.model_id}: config.json is not a JSON object")
    return cfg


def _matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def select_files(names: list[str], model: str, weights_required: bool = True) -> list[str]:
    """The files a build needs; refuses unsafe names and pickle-only repos. `weights_required=False` (check):
    a config-only directory or repo is answered from its config, so only the lack of config.json refuses."""
    for n in names:
        safe_relpath(n, what=f"file name in {model}")
    wanted = sorted(n for n in names if _matches(n, WANTED_PATTERNS) and not _matches(n, EXCLUDED_PATTERNS))
    if not any(n.endswith(".safetensors") for n in wanted) and "model_index.json" not in wanted:
        pickles = sorted(n for n in names if _matches(n.rsplit("/", 1)[-1], PICKLE_PATTERNS))
        if pickles:
            raise SourceError(
                f"{model}: only pickle weights ({', '.join(pickles[:3])}); hive-aot never unpickles - "
                "publish safetensors upstream"
            )
        if weights_required:
            raise SourceError(f"{model}: no *.safetensors weights found")
    if "config.json" not in wanted and "model_index.json" not in wanted:
        raise ModelFormatError(f"{model}: config.json is missing")
    return wanted


def index_shards(raw: bytes, files: list[str], model: str) -> list[str]:
    """The shards a model.safetensors.index.json names; each must be a safe name present in `files`."""
    try:
        weight_map = json.loads(raw.decode("utf-8"))["weight_map"]
        assert isinstance(weight_map, dict)
    except Exception:  # noqa: BLE001 - any parse failure of the index is one malformed-input line
        raise ModelFormatError(f"{model}: model.safetensors.index.json is malformed (no weight_map object)") from None
    shards = sorted(set(weight_map.values()), key=str)
    for shard in shards:
        if not isinstance(shard, str):
            raise ModelFormatError(f"{model}: index names a non-string shard")
        safe_relpath(shard, what="shard named in model.safetensors.index.json")
        if shard not in files:
            raise ModelFormatError(f"{model}: model.safetensors.index.json names missing shard {shard!r}")
    return shards


def check_index(root: Path, files: list[str], model: str) -> None:
    """The shard index may only name shards that exist in this snapshot."""
    if "model.safetensors.index.json" in files:
        index_shards((root / "model.safetensors.index.json").read_bytes(), files, model)


def hf_cache_repo_dir(path: Path) -> Path | None:
    """The `models--org--name` directory when `path` is a snapshot in the Hugging Face cache layout, else None.

    huggingface_hub keeps `models--org--name/snapshots/<commit>/<file>` as relative symlinks to
    `../../blobs/<hash>`, so such a snapshot's files may resolve anywhere in that one repo tree (never
    outside it, nor into a sibling `models--x--y`). Any directory at such a path gets this wider fence:
    it only reaches two levels up, into the tree the snapshot is part of.
    """
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent
    return None


def hf_cache_model_id(repo_dir: Path) -> str | None:
    """`models--org--name` -> `org/name`.

    huggingface_hub names the folder `models--` + repo_id with `/` replaced by `--`, and its
    validate_repo_id refuses `--` inside repo ids, so splitting on `--` is unambiguous. Legacy ids
    without an org (`models--gpt2`) are not `org/name` model ids here: None (give --model-id).
    """
    parts = repo_dir.name.split("--")
    repo = "/".join(parts[1:])
    m = _REPO_RE.match(repo)
    return repo if len(parts) == 3 and m and m.group(2) is None else None
