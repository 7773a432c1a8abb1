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


def test_work_credited_to_a_step_gives_its_rate_over_its_own_time():
    """A step's rate is its work over its own wall time: a nested step's time and work stay the nested step's."""
    meter.reset()
    meter.work(flop=1e9)  # outside any step: nowhere to credit it
    with meter.step("reference"):
        time.sleep(0.1)
        meter.work(flop=3e9)
        meter.work(flop=1e9)  # work adds up
        with meter.step("validate"):
            time.sleep(0.5)
            meter.work(nbytes=5e6)
    with meter.step("publish"):
        time.sleep(0.01)
    rates, seconds = meter.rates(), meter.seconds()
    assert set(rates) == {"reference", "validate"}  # publish did no counted work
    assert rates["reference"]["flop"] == 4e9 and "bytes" not in rates["reference"]
    assert rates["validate"] == {"bytes": 5e6, "bytes_per_s": rates["validate"]["bytes_per_s"]}
    # over the step's own time: the reference's 0.1 s, not the 0.6 s it spanned with the validation in it (a loaded
    # host may add some to either)
    assert 4e9 / 0.4 < rates["reference"]["flop_per_s"] <= 4e9 / 0.1 and seconds["reference"] < seconds["validate"]
    assert rates["validate"]["bytes_per_s"] <= 5e6 / 0.5
    meter.reset()
    assert meter.rates() == {}
