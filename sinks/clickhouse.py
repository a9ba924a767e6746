"""The one ClickHouse client factory.

One DSN selects the engine: ``chdb:///path`` opens the embedded, in-process chDB
engine through clickhouse-connect's chDB backend; ``http(s)://user:pass@host:port/db``
talks to a server. Only one process may open a chDB directory at a time (a second
gets "Cannot lock file .../status"): the process that writes — the worker — owns it,
and everyone else reads through the owner's loopback query endpoint (see
``sinks/query.py``) or opens it directly when nobody owns it.

``StoreConnection`` is the lazy form the sink writers use: it connects on first use
and, while the store cannot be reached (server down, chDB directory locked by another
process), raises ``StoreUnavailable``/``StoreLocked`` so the writer backs off and asks
again — the same on both kinds of DSN.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import clickhouse_connect
from clickhouse_connect.driver.client import Client

from sinks.errors import StoreLocked, StoreUnavailable

log = logging.getLogger(__name__)


def is_embedded(dsn: str) -> bool:
    return dsn.startswith("chdb:")


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

    gpuledger always qualifies table names with the database, so the client's own
    default database does not matter (chDB's backend has no per-client default).
    """
    try:
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
                 description: str = "ClickHouse") -> None:
        self._factory = factory
        self._on_connect = on_connect
        self._client: Client | None = None
        self._lock = threading.Lock()
        self.description = description
        self.connect_attempts = 0

    @classmethod
    def from_dsn(cls, dsn: str, database: str, on_connect: Callable[[Client], None] | None = None) -> StoreConnection:
        return cls(lambda: connect(dsn, database), on_connect, redact(dsn))

    @classmethod
    def of(cls, client_or_connection) -> StoreConnection:
        """Wrap an already open client (or pass a StoreConnection through)."""
        if isinstance(client_or_connection, StoreConnection):
            return client_or_connection
        conn = cls(lambda: client_or_connection, description="an open client")
        conn._client = client_or_connection
        return conn

    @property
    def connected(self) -> bool:
        return self._client is not None

    def get(self) -> Client:
        with self._lock:
            if self._client is not None:
                return self._client
            self.connect_attempts += 1
            try:
                client = self._factory()
                if self._on_connect is not None:
                    self._on_connect(client)
            except (StoreUnavailable, StoreLocked):
                raise
            except Exception as exc:  # noqa: BLE001 - a factory may raise driver errors directly
                raise StoreUnavailable(f"cannot connect to {self.description}: {exc}") from exc
            self._client = client
            log.info("connected to %s", self.description)
            return client
