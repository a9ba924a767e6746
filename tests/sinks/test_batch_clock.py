"""When the sink's batch closes (``sinks.agents.BatchClock``), driven with explicit times."""

from __future__ import annotations

import pytest

from sinks.agents import IDLE_FETCH_S, BatchClock

WITHIN, QUIET, IDLE, ROWS = 0.3, 0.1, 1.0, 1000  # (the clock as constructed: not the defaults)


def clock() -> BatchClock:
    return BatchClock(WITHIN, QUIET, IDLE, ROWS, now=0.0)


def test_a_burst_of_correlated_records_closes_the_batch_at_the_first_fetch_that_brings_no_more():
    c = clock()
    assert not c.took(0.6, held=300, hot=0)          # raw events only: no reason to close before the idle window
    assert not c.took(0.7, held=900, hot=600)        # the burst arrives
    assert c.fetch(0.7, 900) == (ROWS - 900, QUIET)
    assert c.took(0.8, held=950, hot=0)              # a quiet fetch: the burst has ended, the batch closes
    assert c.closed == 0.8 and c.first_hot is None


def test_a_burst_split_over_fetches_stays_in_one_batch():
    c = clock()
    assert not c.took(0.7, held=400, hot=400)
    assert not c.took(0.8, held=800, hot=400)        # more of it came: still open
    assert c.took(0.9, held=800, hot=0)


def test_no_sooner_than_within_after_the_previous_batch_closed():
    c = clock()
    assert not c.took(0.1, held=10, hot=10)
    assert not c.took(0.2, held=10, hot=0)           # quiet, but only 0.2 s since the previous batch closed
    assert c.took(0.3, held=10, hot=0)


def test_a_steady_stream_of_correlated_records_closes_when_the_first_has_waited_within():
    c = clock()
    assert not c.took(0.4, held=10, hot=10)          # the first correlated record
    assert not c.took(0.5, held=20, hot=10)
    assert not c.took(0.6, held=30, hot=10)
    assert c.took(0.75, held=40, hot=10)             # it has waited 0.3 s: closed although more keep coming
    assert not c.took(0.85, held=10, hot=10)         # the next batch starts over


def test_without_correlated_records_the_batch_closes_after_the_idle_window():
    c = clock()
    assert not c.took(0.5, held=100, hot=0)
    assert c.fetch(0.95, 100)[1] == pytest.approx(0.05)  # a fetch never waits past the window's end
    assert not c.took(0.95, held=150, hot=0)
    assert c.took(1.0, held=160, hot=0)
    assert c.closed == 1.0


def test_a_full_batch_closes_at_once():
    c = clock()
    assert c.took(0.01, held=ROWS, hot=0)
    assert c.took(0.02, held=ROWS, hot=ROWS)


def test_nothing_held_never_closes_and_never_spins():
    c = clock()
    for now in (0.5, 1.0, 5.0, 60.0):
        assert not c.took(now, held=0, hot=0)
        assert c.fetch(now, 0) == (1, IDLE_FETCH_S)   # one record, waited for: not a loop of short fetches
    # After a long silence a correlated record closes its batch at the first quiet fetch.
    assert not c.took(60.1, held=1, hot=1)
    assert c.took(60.2, held=1, hot=0)


def test_a_fetch_into_a_batch_never_waits_longer_than_quiet():
    c = clock()
    assert c.fetch(0.0, 5) == (ROWS - 5, QUIET)
    c.took(0.1, held=5, hot=5)
    assert c.fetch(0.1, 5) == (ROWS - 5, QUIET)
