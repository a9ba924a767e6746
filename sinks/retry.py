"""The sinks' one back-off policy and their calm failure log.

``store_retrying`` is the only retry loop of the package (tenacity's ``AsyncRetrying``):
retriable sink errors (``SinkError.retriable``) are retried forever with capped
exponential back-off and full jitter, sleeping with ``asyncio.sleep`` so the event loop
(and Faust's heartbeats) keep running; any other exception — a rejection, a
cancellation — passes through at once. ``call_retrying`` is how a hot path uses it: the
call is tried once on its own, and only a retriable failure builds the retry loop.

``OutageLog`` turns a stream of failed attempts into a few lines: one WARNING when a
component starts failing (with the error), at most one WARNING summary per
``summary_every_s`` while it goes on (attempts so far, time, last error), and one INFO
when it recovers ("... reachable again after N attempts, X s"). During an outage the
log grows by a line a minute per component, not a line per attempt.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tenacity import AsyncRetrying, retry_if_exception, stop_never, wait_random_exponential

from sinks.errors import first_line

T = TypeVar("T")


def _retriable(exc: BaseException) -> bool:
    return bool(getattr(exc, "retriable", False))


def store_retrying(initial_backoff_s: float, max_backoff_s: float, before_sleep: Callable | None = None) -> AsyncRetrying:
    """Retry retriable sink errors forever: waits drawn uniformly from
    [initial, min(initial * 2**attempt, max)] ("full jitter", so writers that failed
    together do not retry in lockstep)."""
    return AsyncRetrying(
        retry=retry_if_exception(_retriable),
        wait=wait_random_exponential(multiplier=initial_backoff_s, min=initial_backoff_s, max=max_backoff_s),
        stop=stop_never,
        before_sleep=before_sleep,
        reraise=True,
    )


async def call_retrying(call: Callable[[], Awaitable[T]], initial_backoff_s: float, max_backoff_s: float,
                        before_sleep: Callable | None = None) -> T:
    """``await call()``, retried as ``store_retrying`` retries when it fails for a retriable reason.

    The first attempt runs outside tenacity: an ``AsyncRetrying`` and its attempt state are
    a web of reference cycles (~35 objects: closures over the retrying object, a
    ``concurrent.futures.Future`` with its lock and condition), and building one per batch
    or per insert left that much cyclic garbage behind every time — most of what a worker's
    garbage collections ever found (``gpuledger.gctune``). On a retriable failure the retry
    loop starts with that failure as its first attempt (its ``before_sleep``, its back-off),
    exactly as if tenacity had made the call."""
    try:
        return await call()
    except Exception as exc:  # noqa: BLE001 - sorted just below, as the retry loop would
        if not _retriable(exc):
            raise
        first: BaseException | None = exc
    async for attempt in store_retrying(initial_backoff_s, max_backoff_s, before_sleep):
        with attempt:
            if first is not None:
                failed, first = first, None
                raise failed
            return await call()
    raise AssertionError("unreachable: store_retrying retries forever")  # pragma: no cover


class OutageLog:
    """State-change logging for one component's attempts (a table's writes, a connection).

    Call ``failed(exc)`` after each failed attempt and ``succeeded()`` after each
    successful one. ``clock`` is injectable so the summary interval can be tested
    without waiting a minute.
    """

    def __init__(self, logger: logging.Logger, subject: str, summary_every_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, recovered: str = "store reachable again") -> None:
        self.log = logger
        self.subject = subject
        self.recovered = recovered  # the recovery line's words (not every component is a store)
        self.summary_every_s = summary_every_s
        self.clock = clock
        self.failed_attempts = 0  # in the current outage
        self.outages = 0
        self._since = 0.0
        self._last_line = 0.0
        self.last_error = ""

    @property
    def failing(self) -> bool:
        return self.failed_attempts > 0

    def problem(self) -> str | None:
        """What a health page says while failing (None otherwise): since when, how many attempts, the last error."""
        if not self.failed_attempts:
            return None
        return (f"{self.subject} failing for {self.clock() - self._since:.0f} s ({self.failed_attempts} attempt(s)), "
                f"last error: {self.last_error}")

    def failed(self, exc: BaseException) -> None:
        now = self.clock()
        self.last_error = first_line(exc)
        self.failed_attempts += 1
        if self.failed_attempts == 1:
            self.outages += 1
            self._since = self._last_line = now
            self.log.warning("%s failing, retrying with back-off: %s", self.subject, first_line(exc))
        elif now - self._last_line >= self.summary_every_s:
            self._last_line = now
            self.log.warning("%s still failing: %d attempts in %.0f s, last error: %s", self.subject, self.failed_attempts,
                             now - self._since, first_line(exc))

    def succeeded(self) -> bool:
        """Record a success; True when it ended an outage (the recovery line was logged)."""
        if not self.failed_attempts:
            return False
        self.log.info("%s: %s after %d attempts, %.1f s", self.subject, self.recovered, self.failed_attempts + 1,
                      self.clock() - self._since)
        self.failed_attempts = 0
        return True
