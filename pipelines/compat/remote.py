"""Header-only look at a Hub repo: config.json, the shard index and each safetensors header, read
with HTTP range requests. No weight bytes are downloaded; `bytes_fetched` says what was.

Each shard costs one ranged GET of its first 64 KiB (which holds the header of most files), plus
one more only when the header is larger. The total file size comes from `Content-Range`, so a header
that claims more bytes than the file holds is caught without reading the data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import SourceError
from ..source.fetch import SourceSpec, hf_license, index_shards, select_files
from ..source.safetensors_io import Header, header_length, parse_header

FIRST_RANGE = 64 * 1024


@dataclass
class RemoteRepo:
    model_id: str
    revision: str
    commit: str
    files: list[str]
    config: dict[str, Any] | None
    config_error: str | None
    headers: dict[str, Header] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    bytes_fetched: int = 0
    license: str | None = None
    gated: bool | str = False

    @property
    def repo_bytes(self) -> int:
        return sum(self.sizes.values())


class _Fetcher:
    def __init__(self, repo: str, commit: str):
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session

        self.repo, self.commit = repo, commit
        self.session = get_session()
        self.auth = build_hf_headers()  # carries HF_TOKEN when set; never logged
        self.url = lambda name: hf_hub_url(repo, name, revision=commit)
        self.bytes = 0

    def _request(self, method: str, name: str, headers: dict[str, str]):
        try:
            return self.session.stream(method, self.url(name), headers=headers, follow_redirects=True)
        except Exception as e:  # noqa: BLE001 - transport errors of whichever HTTP client the hub uses
            raise SourceError(f"{self.repo}: cannot read {name} ({type(e).__name__})") from None

    def size(self, name: str) -> int | None:
        try:
            r = self.session.head(self.url(name), headers=dict(self.auth), follow_redirects=True)
        except Exception as e:  # noqa: BLE001
            raise SourceError(f"{self.repo}: cannot read {name} ({type(e).__name__})") from None
        value = r.headers.get("x-linked-size") or r.headers.get("content-length")
        return int(value) if value and value.isdigit() else None

    def get(self, name: str, byte_range: tuple[int, int] | None = None) -> tuple[bytes, int | None]:
        """The requested bytes and the file's total size (None if the server does not say).

        Streams and stops reading once the range is in hand, so a server that ignores Range (answers
        200 with the whole file) still costs only about the bytes we asked for.
        """
        headers = dict(self.auth)
        if byte_range is not None:
            headers["Range"] = f"bytes={byte_range[0]}-{byte_range[1]}"
        want = None if byte_range is None else byte_range[1] + 1
        body = bytearray()
        try:
            with self._request("GET", name, headers) as r:
                if r.status_code not in (200, 206):
                    raise SourceError(f"{self.repo}: reading {name} answered HTTP {r.status_code}")
                partial = r.status_code == 206
                for chunk in r.iter_bytes():
                    body += chunk
                    self.bytes += len(chunk)
                    if want is not None and not partial and len(body) >= want:
                        break
                total = None
                cr = r.headers.get("Content-Range", "")
                if "/" in cr and cr.rsplit("/", 1)[1].isdigit():
                    total = int(cr.rsplit("/", 1)[1])
                elif not partial and (r.headers.get("Content-Length") or "").isdigit():
                    total = int(r.headers["Content-Length"])
        except SourceError:
            raise
        except Exception as e:  # noqa: BLE001
            raise SourceError(f"{self.repo}: cannot read {name} ({type(e).__name__})") from None
        data = bytes(body)
        if byte_range is not None and not partial:
            data = data[byte_range[0]: byte_range[1] + 1]
        return data, total


def inspect_remote(spec: SourceSpec) -> RemoteRepo:
    from huggingface_hub import HfApi

    from ..source.fetch import fetch_hf_info

    repo = spec.repo_id
    info = fetch_hf_info(HfApi(), spec)
    names = [s.rfilename for s in (info.siblings or [])]
    wanted = select_files(names, repo, weights_required=False)  # a full fetch's refusals but a config-only repo
    out = RemoteRepo(model_id=repo, revision=spec.revision or "main", commit=info.sha, files=sorted(names),
                     config=None, config_error=None, license=hf_license(info), gated=info.gated or False)
    f = _Fetcher(repo, info.sha)
    weights = [n for n in wanted if n.endswith(".safetensors")]
    for cfg_name in ("config.json", "model_index.json"):
        if cfg_name in names:
            raw, _ = f.get(cfg_name)
            try:
                doc = json.loads(raw.decode("utf-8"))
                if not isinstance(doc, dict):
                    raise ValueError("not an object")
                if cfg_name == "config.json":
                    out.config = doc
                else:
                    out.config = {"_diffusers_pipeline": doc.get("_class_name")}
            except (UnicodeDecodeError, ValueError) as e:
                out.config_error = f"{cfg_name} is not valid JSON ({e})"
            except RecursionError:
                out.config_error = f"{cfg_name} is nested too deeply to be a model config"
            break
    else:
        out.config_error = "config.json is missing"
    if "model.safetensors.index.json" in names:
        raw, _ = f.get("model.safetensors.index.json")
        shards = index_shards(raw, names, repo)
        weights = shards
    for name in weights:
        first, total = f.get(name, (0, FIRST_RANGE - 1))
        total = total if total is not None else f.size(name)
        if total is None:
            raise SourceError(f"{repo}: the server did not report the size of {name}")
        n = header_length(first[:8], name, total)
        raw = first[8:8 + n]
        if len(raw) < n:
            more, _ = f.get(name, (8 + len(raw), 8 + n - 1))
            raw += more
        out.headers[name] = parse_header(raw, n, total, name)
        out.sizes[name] = total
    out.bytes_fetched = f.bytes
    return out
