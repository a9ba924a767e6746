"""sinks/retry.py's call_retrying: the first attempt outside tenacity (no cyclic garbage per
call), a retriable failure retried with the first failure as its first attempt, anything
else passed through at once."""

from __future__ import annotations

import asyncio
import gc

import pytest

from sinks.errors import StoreUnavailable
from sinks.retry import call_retrying


def test_calls_that_succeed_leave_no_cyclic_garbage():
    """The worker calls it for every batch and the sink for every insert: a tenacity retry loop
    per call left ~35 objects of reference cycles each time, which the collector had to find."""
    async def ok() -> int:
        return 7

    async def main() -> int:
        gc.collect()
        gc.disable()
        try:
            results = [await call_retrying(ok, 0.01, 0.05) for _ in range(50)]
            assert results == [7] * 50
            return gc.collect()
        finally:
            gc.enable()

    assert asyncio.run(main()) < 35  # fewer than one retry loop's worth, for 50 calls


def test_a_retriable_failure_is_retried_with_back_off_and_reported_from_the_first():
    attempts: list[int] = []
    slept: list[str] = []

    async def flaky() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise StoreUnavailable(f"down (attempt {len(attempts)})")
        return "stored"

    def before_sleep(state) -> None:
        slept.append(str(state.outcome.exception()))

    assert asyncio.run(call_retrying(flaky, 0.01, 0.05, before_sleep)) == "stored"
    assert len(attempts) == 3 and slept == ["down (attempt 1)", "down (attempt 2)"]


def test_any_other_failure_passes_through_at_once():
    attempts: list[int] = []
    slept: list[object] = []

    async def broken() -> None:
        attempts.append(1)
        raise ValueError("a bug, not an outage")

    with pytest.raises(ValueError, match="a bug"):
        asyncio.run(call_retrying(broken, 0.01, 0.05, slept.append))
    assert attempts == [1] and slept == []
