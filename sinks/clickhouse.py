"""The one ClickHouse client factory.

One DSN selects the engine: ``chdb:///path`` opens the embedded, in-process chDB
engine through clickhouse-connect's chDB backend; ``http(s)://user:pass@host:port/db``
talks to a server. Only one process may open a chDB directory at a time (a second
gets "Cannot lock file .../status"): the process that writes — the worker — owns it,
and everyone else reads through the owner's loopback query endpoint (see
``sinks/read/query.py``) or opens it directly when nobody owns it.

``StoreConnection`` is the lazy form the sink writers use: it connects on first use
and, while the store cannot be reached (server down, chDB directory locked by another
process), raises ``StoreUnavailable``/``StoreLocked`` so the writer backs off and asks
again — the same on both kinds of DSN. Connect failures are logged per state change
(``sinks/retry.py``: one WARNING, a summary a minute, one INFO on recovery).
``migrated_store`` is the worker's form: lazy, migrating each new client before use, so
a worker starts while ClickHouse is down and catches up when it returns.

The drivers log every failed attempt themselves (urllib3's "Retrying ...",
clickhouse-connect's "Unexpected Http Driver Exception", and an ERROR with a traceback
for a value it cannot serialize). Inside a sink call or a connection attempt (``driver_call``)
those records are demoted to DEBUG (shown only with DEBUG logging on) — the sink reports the
failure itself, once per state change, and ``connect`` raises it with the DSN to check — and a
serialization failure is remembered so the writer can name the column.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import clickhouse_connect
from clickhouse_connect.driver.client import Client

from gpuledger.telemetry import demote
from sinks.errors import StoreLocked, StoreUnavailable
from sinks.migrations import migrate
from sinks.retry import OutageLog

log = logging.getLogger(__name__)

#: Driver loggers that report each failed attempt (see the module header).
DRIVER_LOGGERS = ("urllib3.connectionpool", "clickhouse_connect.driver._backend.http_sync",
                  "clickhouse_connect.driver.httpclient", "clickhouse_connect.driver.transform")


@dataclass
class DriverReport:
    """What the driver said during one sink call: the column it could not serialize."""

    serialization_failed: bool = False
    column: str = ""


class _SinkCallFilter(logging.Filter):
    """Demote driver records to DEBUG while the current thread is inside ``driver_call``."""

    def __init__(self) -> None:
        super().__init__()
        self.local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        report: DriverReport | None = getattr(self.local, "report", None)
        if report is None:
            return True
        if record.name.endswith(".transform") and str(record.msg).startswith("Error serializing column"):
            report.serialization_failed = True
            args = record.args if isinstance(record.args, tuple) else ()
            report.column = f"column `{args[0]}` of type {args[1]}" if len(args) >= 2 else ""
        if record.levelno > logging.DEBUG:
            record.exc_info = record.exc_text = None  # the traceback is the sink's to report
        return demote(record, logging.DEBUG)  # (dropped unless its logger is on at DEBUG)


_FILTER = _SinkCallFilter()
for _name in DRIVER_LOGGERS:
    logging.getLogger(_name).addFilter(_FILTER)


@contextmanager
def driver_call() -> Iterator[DriverReport]:
    """Run driver calls of a sink in this block (one thread): their per-attempt log records
    are demoted to DEBUG, and a serialization failure is reported back."""
    outer = getattr(_FILTER.local, "report", None)
    report = DriverReport()
    _FILTER.local.report = report
    try:
        yield report
    finally:
        _FILTER.local.report = outer


def is_embedded(dsn: str) -> bool:
    return dsn.startswith("chdb:")


def dsn_problem(dsn: str) -> str | None:
    """What is wrong with a store DSN's form (None: nothing), before anything connects.

    A chDB DSN is ``chdb://`` and an absolute path — three slashes. ``chdb://tmp/sb`` read as a
    host ``tmp`` with the path ``/sb`` to clickhouse-connect and as the relative path ``tmp/sb``
    here (``chdb_path``): the sink then retried "database does not exist" for ever and a replay
    into it sat at 0 events, saying nothing (exploratory review)."""
    if not dsn.startswith(("chdb://", "http://", "https://")):
        return f"must be chdb:///absolute/path or http(s)://host:port, got {dsn.split(':', 1)[0]!r}"
    if dsn.startswith("chdb://"):
        parts = urlsplit(dsn)
        if parts.netloc:
            return (f"{dsn!r}: a chdb DSN is chdb:// followed by an absolute path (three slashes, chdb:///dir); this one reads "
                    f"as a host {parts.netloc!r} — did you mean chdb:///{parts.netloc}{parts.path}?")
        if not parts.path.strip("/"):
            return f"{dsn!r}: no directory after chdb://"
    return None


def chdb_path(dsn: str) -> str:
    """Filesystem path of a chdb:///path DSN."""
    parts = urlsplit(dsn)
    return (parts.netloc + parts.path) if parts.netloc and parts.netloc != "" else parts.path


def _locked_by_another_process(path: str) -> bool:
    """True when another process holds the chDB directory's status-file lock.

    chDB reports a locked directory only on stderr ("Cannot lock file .../status");
    the exception says "Error initializing EmbeddedServer". Probe the lock instead of
    guessing from the text.
    """
    status = Path(path) / "status"
    try:
        with open(status, "rb") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
            fcntl.flock(handle, fcntl.LOCK_UN)
            return False
    except OSError:
        return False


def connect(dsn: str, database: str, create: bool = True) -> Client:
    """Open a client on ``dsn`` and make sure ``database`` exists.

    gpuledger's own queries always qualify table names with the database; ``database``
    is also made the client's default so that a statement a person types unqualified
    (``gpuledger sql "SHOW TABLES"``, ``DESCRIBE correlated_events``) reads gpuledger's
    tables — on the worker's client too, which serves the loopback query endpoint.
    """
    try:
        # The drivers' own records of the failed attempt (urllib3's "Retrying ...") are demoted:
        # the StoreUnavailable raised here says it once, with the DSN to check (a CLI command
        # printed two library WARNING lines above its error).
        with driver_call():
            if is_embedded(dsn):
                client = clickhouse_connect.get_client(dsn=dsn)
            else:
                client = clickhouse_connect.get_client(dsn=dsn, connect_timeout=5, send_receive_timeout=60)
    except Exception as exc:  # noqa: BLE001 - the drivers raise a zoo of types
        text = str(exc)
        if is_embedded(dsn) and ("Cannot lock file" in text or _locked_by_another_process(chdb_path(dsn))):
            raise StoreLocked(f"the embedded store {chdb_path(dsn)} is owned by another process (a running worker?): {text}") from exc
        raise StoreUnavailable(f"cannot connect to ClickHouse at {redact(dsn)}: {text}. Check GPULEDGER_CLICKHOUSE_DSN.") from exc
    if create:
        client.command(f"CREATE DATABASE IF NOT EXISTS `{database}`")
    client.database = database
    return client


def redact(dsn: str) -> str:
    """DSN without its password, for messages and logs."""
    parts = urlsplit(dsn)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return parts._replace(netloc=netloc).geturl()
    return dsn


class StoreConnection:
    """A client obtained lazily from a factory, shared by the writers of one process.

    ``get()`` returns the client, connecting first if needed; while the factory fails
    it raises (``StoreUnavailable`` or ``StoreLocked``) and the next ``get()`` tries
    again. ``on_connect`` runs once per new client (migrations, TTL) and counts as part
    of connecting. A client, once obtained, is kept: clickhouse-connect's HTTP client
    reconnects per request by itself, and a chDB handle cannot go away under us.
    """

    def __init__(self, factory: Callable[[], Client], on_connect: Callable[[Client], None] | None = None,
                 description: str = "ClickHouse", summary_every_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._factory = factory
        self._on_connect = on_connect
        self._client: Client | None = None
        self._lock = threading.Lock()
        self._reading_lock = threading.Lock()  # (``reading``)
        self._reopens = True  # False for ``of``'s wrappers: their factory could only hand the same client back
        self.description = description
        self.connect_attempts = 0
        self.outage = OutageLog(log, f"connecting to {description}", summary_every_s, clock)

    @classmethod
    def from_dsn(cls, dsn: str, database: str, on_connect: Callable[[Client], None] | None = None) -> StoreConnection:
        return cls(lambda: connect(dsn, database), on_connect, redact(dsn))

    @classmethod
    def of(cls, client_or_connection) -> StoreConnection:
        """Wrap an already open client (or pass a StoreConnection through)."""
        if isinstance(client_or_connection, StoreConnection):
            return client_or_connection
        conn = cls(lambda: client_or_connection, description="an open client")
        conn._client, conn._reopens = client_or_connection, False
        return conn

    @classmethod
    def reopening(cls, client: Client, factory: Callable[[], Client], description: str = "ClickHouse") -> StoreConnection:
        """An open ``client``, replaced by ``factory``'s next one once ``reading`` discards it."""
        conn = cls(factory, description=description)
        conn._client = client
        return conn

    @property
    def connected(self) -> bool:
        return self._client is not None

    @contextmanager
    def reading(self) -> Iterator[Client]:
        """The client, for one reader's statements: one statement at a time per connection, and a
        client a statement failed on is closed and not handed out again (the next ``get`` opens
        another), unless this connection only wraps an open client (``of``).

        Why: chDB's streamed results (clickhouse-connect's chDB backend) outlive a statement that
        failed part-way — one stopped at the readers' row limit left ~65,000 rows of its result
        on the connection, and the next statement on it returned them before its own, as
        success. Measured: every time, on a client of its own; through the worker's query
        endpoint, 3 times in 8. A statement at a time, because one that began after the failure
        and before the discard would read the leftovers; chDB runs one client's statements one at
        a time anyway, so nothing is lost."""
        with self._reading_lock:
            client = self.get()
            try:
                yield client
            except BaseException:
                self.discard(client)
                raise

    def discard(self, client: Client) -> None:
        """Close ``client`` and let the next ``get`` open another (a no-op for ``of``'s wrappers,
        whose factory could only hand the same client back)."""
        with self._lock:
            if self._client is not client or not self._reopens:
                return
            self._client = None
        try:
            client.close()
        except Exception:  # noqa: BLE001 - closing is best effort: the client is not used again
            log.debug("closing a discarded client failed", exc_info=True)

    def get(self) -> Client:
        with self._lock:
            if self._client is not None:
                return self._client
            self.connect_attempts += 1
            try:
                with driver_call():
                    client = self._factory()
                    if self._on_connect is not None:
                        self._on_connect(client)
            except StoreUnavailable as exc:  # StoreLocked too
                self.outage.failed(exc)
                raise
            except Exception as exc:  # noqa: BLE001 - a factory may raise driver errors directly
                self.outage.failed(exc)
                raise StoreUnavailable(f"cannot connect to {self.description}: {exc}") from exc
            self._client = client
            if not self.outage.succeeded():
                log.info("connected to %s", self.description)
            return client


def migrated_store(dsn: str, database: str, cluster: str | None = None, ttl_days: int | None = None) -> StoreConnection:
    """The worker's store: a lazy ``StoreConnection`` on ``dsn`` that runs the migrations
    and applies the retention TTL on every new client before anyone uses it.

    Nothing is opened here, so a worker can start while ClickHouse is down (or the chDB
    directory is held): the first write connects, migrates, and the writers catch up.
    """
    def on_connect(client: Client) -> None:
        # (also applies or removes the TTL, and sets the embedded store's packed parts and wider merges)
        migrate(client, database, cluster, ttl_days, embedded=is_embedded(dsn))

    return StoreConnection.from_dsn(dsn, database, on_connect=on_connect)
