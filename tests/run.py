"""`make test`: run the whole pytest suite on xdist workers, then print a timing summary.

Files, not tests, are spread over the workers (`--dist loadfile`): a file's module fixtures (a family's tiny
models, a built store) are built once. The longest files go first (tests/conftest.py orders them by the last
run's times, which this script records). `--random` runs in random order instead (pytest-randomly; the seed
is printed first, `--random --randomly-seed=N` replays it). HIVE_AOT_TEST_WORKERS sets the number of
workers (default 2; 0 runs in this process).

pytest's exit code 5 ("no tests collected") is a failure here: a green run must have run tests.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from durations import durations_cache, known_durations

SLOWEST = 10


def pytest_args(argv: list[str]) -> list[str]:
    random_order = "--random" in argv
    args = [a for a in argv if a != "--random"]
    if random_order and not any(a.startswith("--randomly-seed") for a in args):
        # chosen here and printed first: pytest -q hides pytest-randomly's own header line
        seed = random.randrange(1 << 32)
        print(f"random order, seed {seed} (replay: tests/run.py --random --randomly-seed={seed})", flush=True)
        args.append(f"--randomly-seed={seed}")
    workers = int(os.environ.get("HIVE_AOT_TEST_WORKERS", "2"))
    if workers > 0:
        args = ["-n", str(workers), "--dist", "loadfile", "--no-loadscope-reorder", *args]
    if not random_order:
        args = ["-p", "no:randomly", *args]
    return args


def summarize(report: Path) -> tuple[dict[str, int], dict[str, float], list[tuple[float, str]], list[str]]:
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    per_file: dict[str, float] = {}
    cases: list[tuple[float, str]] = []
    fault_loops: list[str] = []
    root = ET.parse(report).getroot()
    for suite in root.iter("testsuite"):
        for k in counts:
            counts[k] += int(suite.get(k, 0))
    for prop in root.iter("property"):
        if prop.get("name") == "fault_loop":
            fault_loops.append(prop.get("value", ""))
    for case in root.iter("testcase"):
        parts = (case.get("classname") or "?").split(".")
        name = next((p for p in parts if p.startswith("test_")), parts[-1]) + ".py"
        secs = float(case.get("time", 0))
        per_file[name] = per_file.get(name, 0.0) + secs
        cases.append((secs, f"{name}::{case.get('name')}"))
    return counts, per_file, sorted(cases, reverse=True)[:SLOWEST], fault_loops


def record_durations(per_file: dict[str, float]) -> None:
    """Merge this run's per-file times into the cache the next run orders files by."""
    merged = {**known_durations(), **{k: round(v, 1) for k, v in per_file.items()}}
    path = durations_cache()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        print(f"(test durations not recorded: {e})", file=sys.stderr)


def worker_env() -> dict[str, str]:
    """The workers' environment: each worker's torch (and every child it starts) gets its share of the CPUs.
    With two workers on two cores, two intra-op threads per process spend their time waiting for each other's
    time slices: a 2-layer model's forward passes took 1.9 s on two threads and 1.3 s on one beside the
    other worker. An OMP_NUM_THREADS already set is kept."""
    env = dict(os.environ)
    workers = int(env.get("HIVE_AOT_TEST_WORKERS", "2"))
    if workers > 1:
        env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // workers)))
    return env


class DiskWatch:
    """The free space of the file systems the suite writes to (the temp dir, the cache), sampled while it runs.

    A CI run failed when SeaweedFS, which stops taking writes once its disk is about 99 % full, answered every
    S3 write with InternalError ("No writable volumes and no free volumes left") late in the suite: the
    summary now says how close to full each disk came, and when."""

    def __init__(self, paths: list[Path], every_s: float = 2.0):
        self.every_s = every_s
        self.roots: dict[int, Path] = {}
        for path in paths:
            path.mkdir(parents=True, exist_ok=True)
            self.roots.setdefault(path.stat().st_dev, path)  # one sample per file system
        self.start = {dev: shutil.disk_usage(p).free for dev, p in self.roots.items()}
        self.lowest = {dev: (free, 0.0) for dev, free in self.start.items()}
        self._stop = threading.Event()
        self._t0 = time.time()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            for dev, path in self.roots.items():
                free = shutil.disk_usage(path).free
                if free < self.lowest[dev][0]:
                    self.lowest[dev] = (free, time.time() - self._t0)

    def __enter__(self) -> DiskWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def lines(self) -> list[str]:
        gib = 1 << 30
        out = []
        for dev, path in self.roots.items():
            usage = shutil.disk_usage(path)
            low, at = self.lowest[dev]
            out.append(f"{path}: {self.start[dev] / gib:.1f} GiB free at start, lowest {low / gib:.1f} GiB "
                       f"({low / usage.total:.1%} of {usage.total / gib:.0f} GiB) at {at:.0f} s, "
                       f"{usage.free / gib:.1f} GiB at the end")
        return out


def main() -> int:
    report = Path(tempfile.mkdtemp(prefix="hive-aot-test-")) / "report.xml"
    t0 = time.time()
    with DiskWatch([Path(tempfile.gettempdir()), Path.home() / ".cache"]) as disk:
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", f"--junitxml={report}",
                              *pytest_args(sys.argv[1:])], env=worker_env())
    wall = time.time() - t0
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    try:
        summary = summarize(report) if report.is_file() else None
    except ET.ParseError as e:  # pytest died before writing it (a full disk, a killed controller)
        print(f"make test: the junit report {report} is unreadable ({e}): no summary", file=sys.stderr)
        summary = None
    if summary is not None:
        counts, per_file, slowest, fault_loops = summary
        print("\n== timing summary: seconds per file (summed over its tests) ==")
        for name, secs in sorted(per_file.items(), key=lambda kv: -kv[1]):
            print(f"  {secs:8.1f}s  {name}")
        print(f"== the {SLOWEST} slowest tests ==")
        for secs, name in slowest:
            print(f"  {secs:8.1f}s  {name}")
        if fault_loops:
            print("== fault loops ==")
            for line in fault_loops:
                print(f"  {line}")
        if per_file:
            record_durations(per_file)
    print("== disk ==")
    for line in disk.lines():
        print(f"  {line}")
    print(f"  {wall:8.1f}s  total wall time (pytest incl. session fixtures)")
    print(json.dumps({"pytest_exit": rc, "wall_s": round(wall, 1), **counts}))
    if rc == 5 or counts["tests"] == 0:
        print("make test: no tests ran - failing", file=sys.stderr)
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
