"""producers/_runtime.py: the one back-off, the one state file, the stop handling every collector shares."""

from __future__ import annotations

import threading
import time

import pytest
from tenacity import RetryCallState

from producers._errors import PublishError, StateFileError
from producers._runtime import StateFile, Stopped, backoff_wait, call_with_backoff


def _delay(wait, failures: int) -> float:
    state = RetryCallState(None, None, (), {})
    state.attempt_number = failures
    return wait(state)


def test_backoff_is_capped_exponential_with_jitter():
    wait = backoff_wait(1.0, 8.0)
    delays = [_delay(wait, n + 1) for n in range(6)]
    for n, delay in enumerate(delays):
        ceiling = min(8.0, 2.0 ** n)
        assert ceiling / 2 <= delay <= ceiling
    assert len(set(delays)) == len(delays)  # jittered
    assert _delay(wait, 1) <= 1.0  # a new streak starts again from the initial delay


def test_call_with_backoff_retries_what_is_retriable_and_nothing_else():
    stop = threading.Event()
    calls, waits = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise PublishError("broker down")
        return "acked"

    assert call_with_backoff(flaky, stop=stop, initial_s=0.01, max_s=0.02, retry_on=(PublishError,),
                             on_retry=lambda st: waits.append(st.attempt_number)) == "acked"
    assert len(calls) == 3 and waits == [1, 2]
    with pytest.raises(ValueError):
        call_with_backoff(lambda: int("x"), stop=stop, initial_s=0.01, max_s=0.02, retry_on=(PublishError,))


def test_stop_ends_the_wait_at_once_and_commits_nothing():
    stop = threading.Event()

    def down():
        raise PublishError("broker down")

    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    with pytest.raises(Stopped):
        call_with_backoff(down, stop=stop, initial_s=30.0, max_s=60.0, retry_on=(PublishError,))
    assert time.monotonic() - started < 5  # not the 15-30 s back-off
    with pytest.raises(Stopped):
        call_with_backoff(lambda: "never called", stop=stop, initial_s=1, max_s=1, retry_on=(PublishError,))


def test_state_file_is_replaced_atomically_and_an_unreadable_one_is_moved_aside(tmp_path):
    state = StateFile(tmp_path / "state" / "collector.json")
    assert state.read() is None
    state.write({"format": 1, "objects": {"a": 1}}, indent=1)
    assert state.read() == {"format": 1, "objects": {"a": 1}}
    assert [p.name for p in state.path.parent.iterdir()] == ["collector.json"]  # no temp file left behind
    state.path.write_text("{ truncated")
    assert state.read() is None
    assert any(p.name.startswith("collector.json.corrupt-") for p in state.path.parent.iterdir())
    blocked = StateFile(tmp_path / "file-not-dir" / "x.json")
    (tmp_path / "file-not-dir").write_text("")
    with pytest.raises(StateFileError, match="cannot"):
        blocked.write({})
    with pytest.raises(StateFileError):
        blocked.check_writable()
