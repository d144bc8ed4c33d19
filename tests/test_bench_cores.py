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
