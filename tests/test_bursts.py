"""An idle worker starts a burst of requests together; a running batch never waits.

The burst windows here are long (hundreds of ms against a few ms per step of
the tiny model) so that whether a request was held shows plainly.
"""

from __future__ import annotations

import threading
import time

import pytest

from smg_mlx.cli import build_parser, check_serve_args
from smg_mlx.engine.handoff import Inbox

from helpers import generate, prompt, request


class Stream(threading.Thread):
    """One streamed request in the background: when it was sent, when its first
    token came, and its tokens."""

    def __init__(self, stub, ids: list[int], max_tokens: int = 8) -> None:
        super().__init__(daemon=True)
        self._call = lambda: stub.Generate(
            request(ids, max_tokens=max_tokens, ignore_eos=True), timeout=60
        )
        self.sent_at = self.first_token_at = self.ended_at = 0.0
        self.tokens: list[int] = []
        self.start()

    def run(self) -> None:
        self.sent_at = time.monotonic()
        for response in self._call():
            if response.HasField("chunk"):
                if not self.tokens:
                    self.first_token_at = time.monotonic()
                self.tokens.extend(response.chunk.token_ids)
        self.ended_at = time.monotonic()

    def ttft(self) -> float:
        return self.first_token_at - self.sent_at

    def result(self) -> list[int]:
        self.join(60)
        assert not self.is_alive()
        return self.tokens


def test_an_idle_worker_starts_requests_that_arrive_together_as_one_group(start_worker, model_dir):
    # A window well past the 0.1 s between them: a busy machine may start the
    # second's thread late.
    w = start_worker(model_dir, burst_window_seconds=1.0)
    # Idle: its engine has waited for a request since start (what comes during
    # its first turn after the warm-up is taken as it comes; a busy machine may
    # delay that turn past a request sent at once).
    time.sleep(0.5)
    first = Stream(w.stub, prompt(6, 1))
    time.sleep(0.1)
    second = Stream(w.stub, prompt(6, 2))
    assert len(first.result()) == 8 and len(second.result()) == 8
    # The first waited for the second (sent 0.1 s later) to start with it.
    assert first.first_token_at > second.sent_at


def test_a_trickle_of_requests_holds_the_first_for_five_windows_at_most(start_worker, model_dir):
    # Each request comes within a window of the last, and the prefill group
    # never fills: the first still starts once five windows have passed.
    w = start_worker(model_dir, burst_window_seconds=0.2, prefill_batch_size=32)
    streams = []
    for i in range(10):
        streams.append(Stream(w.stub, prompt(6, i)))
        time.sleep(0.15)
    for s in streams:
        assert len(s.result()) == 8
    assert streams[0].first_token_at < streams[-1].sent_at  # 1.35 s after the first


def test_a_running_batch_takes_new_requests_at_the_next_step(start_worker, model_dir):
    w = start_worker(model_dir, burst_window_seconds=0.5)
    running = Stream(w.stub, prompt(6, 1), max_tokens=300)
    while not running.tokens:
        time.sleep(0.01)
    joining = Stream(w.stub, prompt(6, 2))
    assert len(joining.result()) == 8
    assert joining.ttft() < 0.5  # not held for a window
    assert len(running.result()) == 300
    assert joining.first_token_at < running.ended_at  # it did join a running batch


def test_the_next_request_after_one_that_ended_is_not_held(start_worker, model_dir):
    # A client's next turn: one request ended, one replaces it, nothing else
    # to wait for.
    w = start_worker(model_dir, burst_window_seconds=0.5)
    generate(w.stub, prompt(6, 1), max_tokens=4)
    next_turn = Stream(w.stub, prompt(6, 2))
    assert len(next_turn.result()) == 8
    assert next_turn.ttft() < 0.5


def test_requests_held_for_the_rest_of_a_burst_are_let_in_with_an_abort():
    # An abort may name a request still held: it must meet the request, or the
    # request would run once let in.
    inbox = Inbox()
    held = object()
    inbox.submit(held)
    assert inbox.take(hold=True) == ([], set())
    assert inbox.wait(0)  # still there: the engine loop does not sleep on it
    inbox.abort([7])
    assert inbox.take(hold=True) == ([held], {7})


def test_work_finished_elsewhere_does_not_end_the_wait_for_the_rest_of_a_burst():
    # (The disk tier opening as the first request came ended the wait: the
    # burst started apart.)
    inbox = Inbox()
    inbox.submit(object())
    waited: list[int] = []
    waiter = threading.Thread(target=lambda: waited.append(inbox.wait_for_more(1, 30)))
    waiter.start()
    inbox.wake()
    waiter.join(0.3)
    assert waiter.is_alive()
    inbox.submit(object())
    waiter.join(5)
    assert waited == [2]


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "60001", "1e13"])
def test_burst_window_flag_refuses_what_no_wait_can_be(value, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--demo", "--burst-window-ms", value])
    err = capsys.readouterr().err
    assert "--burst-window-ms: expected a number of milliseconds from 0 to 60000" in err


def test_a_burst_window_of_a_minute_is_taken():
    args = build_parser().parse_args(["serve", "--demo", "--burst-window-ms", "60000"])
    assert args.burst_window_ms == 60000


def test_a_burst_wait_the_watchdog_would_take_for_a_stuck_engine_is_refused(capsys):
    """A request held for its burst counts, to the watchdog, as not taken up: a
    window whose whole wait (five) reaches the watchdog would fail the worker on
    its first request, and a supervisor would restart it in a loop."""

    def serve(*flags: str):
        args = build_parser().parse_args(["serve", "--demo", *flags])
        check_serve_args(args.serve_parser, args)
        return args

    with pytest.raises(SystemExit) as exit_:
        serve("--burst-window-ms", "10000", "--watchdog-seconds", "3")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "a request may wait 5 windows (50 s) for the rest of its burst" in err
    assert "give a window up to 300 ms" in err
    # Twice the wait within the watchdog, or no watchdog: taken.
    assert serve("--burst-window-ms", "300", "--watchdog-seconds", "3").burst_window_ms == 300
    assert serve("--burst-window-ms", "60000", "--watchdog-seconds", "0").burst_window_ms == 60000
