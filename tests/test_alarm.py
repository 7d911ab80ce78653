"""rlft.alarm.deadline: the user's code in the main thread stopped at its deadline, whatever it does, and an
outer timer (pytest-timeout's) put back with the time it had left."""
from __future__ import annotations

import signal
import threading
import time

import pytest

from rlft.alarm import DeadlinePassed, deadline


def test_a_sleep_and_a_busy_loop_that_swallows_exceptions_are_both_stopped():
    before = signal.getsignal(signal.SIGALRM)
    start = time.monotonic()
    with pytest.raises(DeadlinePassed, match="^the sleeper$"):
        with deadline(0.2, "the sleeper"):
            time.sleep(30)
    assert time.monotonic() - start < 2

    def stubborn():
        while True:
            try:
                sum(range(1000))
            except Exception:  # noqa: BLE001 - what a careless user function does
                pass

    start = time.monotonic()
    with pytest.raises(DeadlinePassed):
        with deadline(0.2, "loop"):
            stubborn()
    assert time.monotonic() - start < 2
    assert signal.getsignal(signal.SIGALRM) is before  # the handler is put back after a deadline passed too


def test_a_block_within_its_deadline_returns_and_leaves_no_timer_behind():
    before = signal.getsignal(signal.SIGALRM)
    outer = signal.getitimer(signal.ITIMER_REAL)[0]
    with deadline(5, "quick"):
        value = 2 + 2
    assert value == 4 and signal.getsignal(signal.SIGALRM) is before
    left = signal.getitimer(signal.ITIMER_REAL)[0]
    # pytest-timeout arms a timer of its own around each test: it is back, with less time left; without one, none.
    assert (left == 0) if outer == 0 else (0 < left <= outer)


def test_an_outer_timer_is_restored_with_its_remaining_time_and_fires_first_where_it_is_earlier():
    fired = []
    old = signal.signal(signal.SIGALRM, lambda *_: fired.append("outer"))
    saved = signal.setitimer(signal.ITIMER_REAL, 3.0)
    try:
        with deadline(1.0, "inner"):
            time.sleep(0.1)
        left = signal.getitimer(signal.ITIMER_REAL)[0]
        assert 2.0 < left < 3.0  # the outer timer's 3 s, less what the block took
        # An outer timer due before the inner deadline bounds the block by itself (its handler runs).
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with deadline(5.0, "inner"):
            time.sleep(0.5)
        assert fired == ["outer"]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if saved[0] > 0:
            signal.setitimer(signal.ITIMER_REAL, saved[0], saved[1])


def test_unbounded_where_no_timer_can_be_armed():
    with deadline(None, "never"):
        time.sleep(0.05)
    out = []

    def in_a_thread():  # SIGALRM reaches only the main thread: the block runs unbounded there
        with deadline(0.01, "thread"):
            time.sleep(0.1)
        out.append("done")

    t = threading.Thread(target=in_a_thread)
    t.start()
    t.join(5)
    assert out == ["done"]
