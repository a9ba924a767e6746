"""The one ClickHouse client factory.

One DSN selects the engine: ``chdb:///path`` opens the embedded, in-process chDB
engine through clickhouse-connect's chDB backend; ``http(s)://user:pass@host:port/db``
talks to a server. Only one process may open a chDB directory at a time (a second
gets "Cannot lock file .../status"): the process that writes — the worker — owns it,
and everyone else reads through the owner's loopback query endpoint (see
``sinks/query.py``) or opens it directly when nobody owns it.
"""

from __future__ import annotations

import logging
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
        if "Cannot lock file" in text or "lock" in text.lower() and is_embedded(dsn):
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
