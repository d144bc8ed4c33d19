"""When the watchdog calls the engine stuck (`handoff.TurnTimes.overdue`): a
slow engine is not a stuck one."""

from __future__ import annotations

import pytest

from smg_mlx.engine import handoff
from smg_mlx.engine.handoff import TurnTimes


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(handoff.time, "monotonic", lambda: now[0])
    return now


def test_a_step_may_take_three_times_the_slowest_step_expected_or_seen(clock):
    turns = TurnTimes()
    turns.may_take(10.0)  # the slowest step the scheduler plans
    assert turns.limit(5.0) == 30.0 and turns.limit(45.0) == 45.0  # (the start-up log says it)
    turns.next()
    clock[0] += 29.0
    assert turns.overdue(5.0) is None
    clock[0] += 2.0
    assert turns.overdue(5.0) == (31.0, 30.0, True)
    # A turn that says it will take longer gets three times that.
    turns.started(20.0)
    assert turns.overdue(5.0) is None
    # A slow turn seen raises the limit of those after it.
    clock[0] += 40.0
    turns.next()
    clock[0] += 100.0
    assert turns.overdue(5.0) is None
    assert turns.overdue(400.0) is None  # nor below the least asked for


def test_between_turns_only_a_request_no_turn_took_up_counts(clock):
    turns = TurnTimes()
    turns.next()
    turns.ended()
    clock[0] += 600.0
    assert turns.overdue(5.0) is None  # idle: nothing waits for it
    handed_over = clock[0]
    clock[0] += 6.0
    assert turns.overdue(5.0, handed_over) == (6.0, 5.0, False)
    turns.next()  # it took it up
    turns.ended()
    clock[0] += 60.0
    assert turns.overdue(5.0, handed_over) is None
