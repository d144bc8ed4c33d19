"""The bench pins the systems it compares to the same CPUs, the client to the others."""

import os
import subprocess
import sys

import pytest

from bench import cores

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="pinning needs Linux and two CPUs",
)


@pytest.fixture
def restored(monkeypatch):
    allowed = os.sched_getaffinity(0)
    monkeypatch.setattr(cores, "_placed", None)
    yield allowed
    os.sched_setaffinity(0, allowed)


def test_systems_share_the_chosen_cpus_and_the_client_keeps_the_rest(restored, monkeypatch):
    monkeypatch.setattr(cores, "MIN_CPUS", 2)
    placement = cores.place(1)
    assert placement is not None and len(placement.systems) == 1
    assert os.sched_getaffinity(0) == set(restored) - set(placement.systems)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        cores.pin(child.pid)
        assert os.sched_getaffinity(child.pid) == set(placement.systems)
    finally:
        child.kill()
        child.wait()


def test_nothing_is_pinned_on_a_machine_with_too_few_cpus(restored, monkeypatch):
    monkeypatch.setattr(cores, "MIN_CPUS", len(restored) + 1)
    assert cores.place(1) is None
    assert os.sched_getaffinity(0) == restored


def test_systems_get_a_core_each_and_their_cores_other_cpus_stay_idle(monkeypatch):
    # Eight cores of two CPUs each (i and i + 8), as many VMs number them.
    monkeypatch.setattr(cores, "_siblings", lambda cpu: {cpu % 8, cpu % 8 + 8})
    fastest_first = [0, 8, 10, 11, 13, 7, 3, 12, 4, 6, 15, 2, 1, 5, 14, 9]
    systems, idle = cores._one_per_core(fastest_first, 4, set(range(16)))
    assert systems == (0, 10, 11, 13)  # not 0 and 8: one core
    assert idle == (2, 3, 5, 8)
