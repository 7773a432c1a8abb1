"""The measured peak and wall time of each build step (pipelines/core/meter.py), the figures every build records
beside its memory plan."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np

from pipelines.core import meter
from pipelines.process.isolation import run_measured

MIB = 1 << 20


def test_each_step_is_measured_on_its_own_and_children_count_with_the_waiting_parent():
    meter.reset()
    before = meter._status_bytes("VmRSS")
    with meter.step("outer"):
        with meter.step("inner"):
            block = np.ones(200 * MIB // 8)  # 200 MiB touched in the inner step only
            del block
        time.sleep(0.05)
    with meter.step("waits"):
        rc, peak = run_measured([sys.executable, "-c", "import numpy; a = numpy.ones(300 * 2**20 // 8)"],
                                timeout=60, stdout=subprocess.DEVNULL)
    measured, seconds = meter.measured(), meter.seconds()
    assert measured["inner"] >= before + 190 * MIB  # the allocation is the inner step's...
    assert measured["outer"] < before + 100 * MIB  # ...not the enclosing step's (exclusive segments)
    assert rc == 0 and peak > 300 * MIB
    assert measured["waits"] >= peak + before - 50 * MIB  # the child's peak plus this process meanwhile
    assert seconds["outer"] >= 0.05 and set(seconds) == {"inner", "outer", "waits"}
    meter.reset()
    assert meter.measured() == {} and meter.seconds() == {}


def test_a_child_that_outlives_its_timeout_is_killed_and_said_so():
    import pytest

    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_measured([sys.executable, "-c", "import time; time.sleep(60)"], timeout=1, start_new_session=True)
    assert time.monotonic() - t0 < 30
