"""`make test`: run the whole pytest suite, then print a timing summary.

pytest's exit code 5 ("no tests collected") is a failure here: a green run must have run tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    report = Path(tempfile.mkdtemp(prefix="hive-aot-test-")) / "report.xml"
    t0 = time.time()
    rc = subprocess.call([sys.executable, "-m", "pytest", "-q", f"--junitxml={report}", *sys.argv[1:]])
    wall = time.time() - t0
    per_file: dict[str, float] = {}
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    fault_loops: list[str] = []
    if report.is_file():
        import xml.etree.ElementTree as ET

        root = ET.parse(report).getroot()
        for suite in root.iter("testsuite"):
            for k in counts:
                counts[k] += int(suite.get(k, 0))
        for prop in root.iter("property"):
            if prop.get("name") == "fault_loop":
                fault_loops.append(prop.get("value", ""))
        for case in root.iter("testcase"):
            parts = (case.get("classname") or "?").split(".")
            f = next((p for p in parts if p.startswith("test_")), parts[-1])
            per_file[f] = per_file.get(f, 0.0) + float(case.get("time", 0))
    print("\n== timing summary ==")
    for name, secs in sorted(per_file.items(), key=lambda kv: -kv[1]):
        print(f"  {secs:8.1f}s  {name}")
    print(f"  {wall:8.1f}s  total wall time (pytest incl. session fixtures)")
    if fault_loops:
        print("== fault loops ==")
        for line in fault_loops:
            print(f"  {line}")
    print(json.dumps({"pytest_exit": rc, **counts}))
    if rc == 5 or counts["tests"] == 0:
        print("make test: no tests ran - failing", file=sys.stderr)
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
