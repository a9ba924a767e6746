"""The worker's child processes (its sink, its route stage): start, supervise, stop — and
what a child does to follow its parent.

``gpuledger worker`` runs three processes: the Faust worker (the stateful stages), the
route stage (``streams.correlate.route``) and the sink (``sinks.service``). Each child
serves a health page on a loopback port that the worker's ``/gpuledger/health/`` merges
(``HealthClient``), is restarted when it ends (``ChildProcess.restart_if_dead``: not
more often than every few seconds, so a child that cannot start does not spin), stops on
SIGTERM between batches, and stops by itself when the worker is gone (a kill -9 of the
worker ends its children too, each after the batch in hand). In the child:
``child_main`` (logging, garbage collector, its loop) and ``stop_requested``.

Why processes and not threads: every stage is Python, and one interpreter runs one
stage's Python at a time (the GIL) — a stage in its own process has its own core.
``multiprocessing`` (spawn) gives the child the worker's settings object as it is.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Callable, Coroutine

log = logging.getLogger(__name__)


class ChildProcess:
    """The worker's handle on one child: ``target(settings, port, *args)`` runs in it and
    serves its health page at ``url``."""

    def __init__(self, name: str, target: Callable, settings, args: tuple = (), stop_s: float = 5.0) -> None:
        from gpuledger.dev.process import free_port

        self.name, self.target, self.settings, self.args, self.stop_s = name, target, settings, args, stop_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: multiprocessing.Process | None = None
        self.restarts = 0
        self.last_exit: int | None = None
        self._started_at = 0.0
        self._stopping = False

    def start(self) -> None:
        settings = self.settings
        if self.restarts and settings.streams.fault:
            # Fault injection (GPULEDGER_STREAMS_FAULT) ends the first process only: a restarted
            # child counting again from zero would crash at the same point for ever.
            settings = settings.model_copy(update={"streams": settings.streams.model_copy(update={"fault": None})})
        # spawn, not fork: the worker's threads (librdkafka, Faust) must not be copied.
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(target=self.target, args=(settings, self.port, *self.args), name=f"gpuledger-{self.name}", daemon=False)
        self.process.start()
        self._started_at = time.monotonic()
        log.info("%s process %d started (health at %s)", self.name, self.process.pid, self.url)

    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def restart_if_dead(self) -> bool:
        """Start a new child if the last one ended; True when it did. Not more often than
        every few seconds (a child that cannot start must not spin)."""
        if self._stopping or self.process is None or self.alive():
            return False
        self.last_exit = self.process.exitcode
        if time.monotonic() - self._started_at < min(30.0, 2.0 * 2 ** min(self.restarts, 4)):
            return False
        log.error("%s process %d exited with %s; starting a new one", self.name, self.process.pid, self.process.exitcode)
        self.restarts += 1
        self.start()
        return True

    def health(self, page: dict | None) -> dict:
        """What the worker's health page says of this child (``page``: its own health page,
        None when it did not answer)."""
        return {"answering": page is not None, "url": self.url, "pid": self.process.pid if self.process else None,
                "nice": self._nice(), "restarts": self.restarts, "last_exit": self.last_exit}

    def _nice(self) -> int | None:
        """The child's niceness as the kernel has it (None when it is not running)."""
        try:
            return os.getpriority(os.PRIO_PROCESS, self.process.pid) if self.alive() else None
        except OSError:
            return None

    def signal_stop(self) -> None:
        """Ask the child to stop (SIGTERM); ``stop`` waits for it."""
        self._stopping = True
        if self.process is not None and self.process.exitcode is None and self.process.pid:
            try:
                os.kill(self.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def stop(self, within_s: float | None = None) -> None:
        within_s = self.stop_s if within_s is None else within_s
        if self.process is None or self.process.exitcode is not None:
            return
        self.signal_stop()
        self.process.join(within_s)
        if self.process.exitcode is None:
            log.warning("%s process %d did not stop within %.0fs; killing it (its batch was not committed)", self.name, self.process.pid, within_s)
            self.process.kill()
            self.process.join(2.0)


def stop_requested(what: str) -> asyncio.Event:
    """In a child's running loop: an event set on SIGTERM/SIGINT, or when the parent process
    is gone (its sentinel becomes ready: a kill -9 of the worker)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    parent = multiprocessing.parent_process()
    if parent is not None:
        def wait() -> None:
            multiprocessing.connection.wait([parent.sentinel])
            log.warning("the worker that started this %s is gone; stopping", what)
            loop.call_soon_threadsafe(stop.set)

        threading.Thread(target=wait, name="parent-watch", daemon=True).start()
    return stop


def child_main(tag: str, loglevel: str, main: Coroutine, nice: int = 0, gc_young: int | None = None) -> None:
    """A child process's entry: its priority lowered by ``nice`` (before any thread starts,
    so every thread of the child has it: Linux keeps a niceness per thread, and a new thread
    takes its creator's), its log lines tagged ``[tag]``, calm logging, the tuned garbage
    collector (young threshold ``gc_young``, default ``gctune.GEN0``), then ``main`` until it returns."""
    from gpuledger import gctune
    from gpuledger.telemetry import calm_logging, log_format, log_levels

    logging.basicConfig(format=log_format(tag))
    log_levels(logging.getLevelName(loglevel.upper()))  # (the worker's -v: the libraries' lines too)
    if nice:
        os.nice(nice)
        log.info("running at niceness %d", os.getpriority(os.PRIO_PROCESS, 0))
    calm_logging()
    gctune.tune(gc_young or gctune.GEN0)
    asyncio.run(main)


class HealthClient:
    """The worker's reader of its children's health pages: one HTTP session for the life of
    the worker (the worker's own page asks every child on each request)."""

    def __init__(self, timeout_s: float = 2.0) -> None:
        self.timeout_s = timeout_s
        self._session = None

    async def fetch(self, url: str) -> dict | None:
        """The page at ``url``/gpuledger/health/, or None when it does not answer in time."""
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        try:
            async with self._session.get(f"{url}/gpuledger/health/") as resp:
                return await resp.json() if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None
