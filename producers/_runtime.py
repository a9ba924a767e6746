"""What every long-running producer shares: one back-off, one state file, one way to stop.

Input: the calls a collector makes to its source and to Kafka; its state as JSON; SIGTERM.
Output/guarantees:
- ``backoff_wait`` / ``call_with_backoff``: the one retry policy (tenacity). The n-th
  consecutive failure waits a random time in [d/2, d], d = min(max_s, initial_s * 2**(n-1))
  — capped exponential with jitter, so collectors that failed together do not retry in
  lockstep. The sleep is the stop event's wait: ``stop()`` ends it at once, and
  ``call_with_backoff`` then raises ``Stopped`` instead of trying again. Errors that are
  not listed as retriable pass through at once.
- ``StateFile``: one JSON file per collector, read once at start and replaced atomically
  (temp file in the same directory, fsync, rename, fsync of the directory), so a crash
  leaves the old or the new content, never a torn one. An unreadable file is moved aside
  (``<name>.corrupt-<epoch>``) and the collector starts empty; deterministic event ids
  make the re-sends that follow harmless.
- ``run_until_signalled``: the lifecycle contract of every long-running component —
  ``run()`` works until ``stop()`` is called, then flushes its producer, saves its state
  and returns; SIGTERM and SIGINT call ``stop()``; the process then exits 0.
Limits: the back-off is per call (``call_with_backoff`` starts from ``initial_s`` each
time): a success resets it. One process, one signal handler: the last
``install_stop_signals`` wins.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_when_event_set, wait_exponential, wait_random_exponential
from tenacity.wait import wait_base

from producers._errors import StateFileError

log = logging.getLogger(__name__)

T = TypeVar("T")


class Stopped(Exception):
    """``stop()`` was called while a call was waiting to be retried: leave without committing."""


# --- back-off ------------------------------------------------------------------------------

def backoff_wait(initial_s: float, max_s: float) -> wait_base:
    """The one back-off: for the n-th consecutive failure, a wait drawn from [d/2, d], d = min(max_s, initial_s * 2**(n-1))."""
    half, cap = initial_s / 2, max_s / 2
    return wait_exponential(multiplier=half, max=cap) + wait_random_exponential(multiplier=half, max=cap)


def retry_delay(state: RetryCallState) -> float:
    """The wait tenacity chose before the next attempt (for log lines)."""
    return state.next_action.sleep if state.next_action else 0.0


def retry_error(state: RetryCallState) -> BaseException | None:
    """The error of the attempt that failed."""
    return state.outcome.exception() if state.outcome else None


def call_with_backoff(fn: Callable[[], T], *, stop: threading.Event, initial_s: float, max_s: float,
                      retry_on: tuple[type[BaseException], ...], on_retry: Callable[[RetryCallState], None] | None = None) -> T:
    """``fn()`` until it returns; ``retry_on`` errors are retried with ``backoff_wait``.

    ``on_retry(state)`` runs before each wait (``retry_error``/``retry_delay`` read it).
    Raises ``Stopped`` when ``stop`` is set before an attempt or while waiting; any other
    error propagates unchanged.
    """

    def attempt() -> T:
        if stop.is_set():
            raise Stopped()
        return fn()

    retrying = Retrying(retry=retry_if_exception_type(retry_on), wait=backoff_wait(initial_s, max_s),
                        stop=stop_when_event_set(stop), sleep=stop.wait, before_sleep=on_retry, reraise=True)
    try:
        return retrying(attempt)
    except retry_on as exc:
        if stop.is_set():
            raise Stopped() from exc
        raise


# --- state file ----------------------------------------------------------------------------

class StateFile:
    """One collector's JSON state: ``read()`` once at start, ``write()`` atomically after each commit.

    ``hint`` is appended to ``StateFileError`` messages (how to make the directory usable).
    """

    def __init__(self, path: Path, hint: str = "the state dir must be writable and survive restarts") -> None:
        self.path = Path(path)
        self.hint = hint

    def check_writable(self) -> None:
        """Fail at start, before any I/O to the source, when the directory cannot hold the file."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StateFileError(f"cannot create state dir {self.path.parent}: {exc} ({self.hint})") from exc
        if not os.access(self.path.parent, os.W_OK):
            raise StateFileError(f"state dir {self.path.parent} is not writable by uid {os.getuid()} ({self.hint})")

    def read(self) -> Any | None:
        """The parsed content; None when there is no file, or when it was unreadable (then it is moved aside)."""
        try:
            raw = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StateFileError(f"cannot read state file {self.path}: {exc} ({self.hint})") from exc
        try:
            return json.loads(raw)
        except ValueError as exc:
            self.quarantine(f"not JSON: {exc}")
            return None

    def quarantine(self, reason: str) -> Path | None:
        """Move an unusable file aside (kept for inspection) and say so; the caller starts empty."""
        aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
        try:
            os.replace(self.path, aside)
        except OSError as exc:
            log.error("state file %s is unusable (%s) and cannot be moved aside (%s); starting empty", self.path, reason, exc)
            return None
        log.error("state file %s is unusable (%s); moved it to %s and starting empty", self.path, reason, aside)
        return aside

    def write(self, data: Any, **dumps: Any) -> None:
        """Replace the file with ``json.dumps(data, **dumps)``: temp file, fsync, rename, fsync of the directory."""
        body = json.dumps(data, **dumps).encode("utf-8")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(body)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)  # the rename itself is durable only once the directory is
            finally:
                os.close(dir_fd)
        except OSError as exc:
            raise StateFileError(f"cannot write state file {self.path}: {exc} ({self.hint})") from exc


# --- lifecycle -------------------------------------------------------------------------------

class LongRunning(Protocol):
    """The lifecycle contract: ``run()`` until ``stop()``, then flush, save and return."""

    def run(self) -> None: ...

    def stop(self) -> None: ...


def install_stop_signals(stop: Callable[[], None]) -> None:
    """SIGTERM and SIGINT call ``stop`` — from a helper thread: the handler runs on the main
    thread, possibly while it holds a stop Event's lock inside ``Event.wait()``, and setting
    that Event from the handler itself could deadlock."""

    def handler(signum: int, _frame: Any) -> None:
        log.info("%s: stopping", signal.Signals(signum).name)
        threading.Thread(target=stop, name="gpuledger-stop", daemon=True).start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def run_until_signalled(component: LongRunning) -> None:
    """Run ``component`` in this (main) thread until SIGTERM/SIGINT; returns once it has flushed."""
    install_stop_signals(component.stop)
    component.run()
