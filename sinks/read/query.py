"""Read-only access to the correlation store, whoever owns it.

- Server DSN: query the server directly.
- Embedded chDB, owned by a running worker: the worker serves read-only queries on
  a loopback port recorded in ``<chdb dir>.owner.json``; ``open_reader`` finds it and
  POSTs there.
- Embedded chDB, not owned: open it directly (this process becomes the owner for
  the duration).
Read-only is enforced by ClickHouse: every reader query runs as
``SELECT * FROM (<query>) SETTINGS readonly=1`` — so only SELECT/WITH queries are
accepted, and ClickHouse itself refuses writes, DDL and table functions that write.
(The per-call ``settings={'readonly': 1}`` of clickhouse-connect's chDB backend is
not usable: it is applied with SET and cannot be reset once the session is read-only.)
Parameters are always bound server-side (``{name:Type}``), never formatted into SQL.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import date, datetime, timezone
from pathlib import Path
from typing import Any

from sinks.clickhouse import StoreConnection, chdb_path, connect, is_embedded
from sinks.errors import SinkError, StoreUnavailable


@dataclass
class QueryResult:
    columns: list[str]
    rows: list[list[Any]]

    def dicts(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, row)) for row in self.rows]


class QueryError(SinkError):
    """The store rejected a query (syntax, read-only violation, unknown column)."""


def readonly_sql(sql: str) -> str:
    body = sql.strip().rstrip(";").strip()
    return f"SELECT * FROM (\n{body}\n) SETTINGS readonly=1"


def jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray)):
        return value.decode("utf-8", "replace")
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def run_readonly(client, sql: str, parameters: dict | None = None) -> QueryResult:
    """Run a reader's query. ``client`` is an open client or a ``StoreConnection`` (the
    worker's lazy store: raises ``StoreUnavailable`` while it cannot connect)."""
    client = StoreConnection.of(client).get()
    try:
        result = client.query(readonly_sql(sql), parameters=parameters or {})
    except Exception as exc:  # noqa: BLE001 - driver errors vary by backend
        raise QueryError(str(exc).splitlines()[0] if str(exc) else repr(exc)) from exc
    return QueryResult(list(result.column_names), [[jsonable(v) for v in row] for row in result.result_rows])


def owner_file(dsn: str) -> Path:
    path = Path(chdb_path(dsn).rstrip("/"))
    return path.with_name(path.name + ".owner.json")


def write_owner(dsn: str, url: str) -> Path:
    path = owner_file(dsn)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pid": os.getpid(), "url": url}))
    return path


def clear_owner(dsn: str) -> None:
    path = owner_file(dsn)
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def current_owner(dsn: str) -> dict | None:
    try:
        state = json.loads(owner_file(dsn).read_text())
        os.kill(int(state["pid"]), 0)
        return state
    except (OSError, ValueError, KeyError):
        return None


class DirectReader:
    def __init__(self, client) -> None:
        self.client = client

    def query(self, sql: str, parameters: dict | None = None) -> QueryResult:
        return run_readonly(self.client, sql, parameters)

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - closing is best effort
            pass


class RemoteReader:
    """Reads through the owning worker's loopback query endpoint."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/") + "/gpuledger/query/"

    def query(self, sql: str, parameters: dict | None = None) -> QueryResult:
        body = json.dumps({"sql": sql, "parameters": jsonable(parameters or {})}).encode()
        req = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                data = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            try:
                detail = json.loads(exc.read()).get("error", "")
            except ValueError:
                detail = ""
            raise QueryError(detail or f"query endpoint answered {exc.code}") from exc
        except OSError as exc:
            raise StoreUnavailable(f"the worker that owns the store does not answer at {self.url}: {exc}") from exc
        return QueryResult(data["columns"], data["rows"])

    def close(self) -> None:
        pass


def open_reader(settings):
    """A read-only reader for the configured store (see module docstring)."""
    from sinks.migrations import migrate

    dsn = settings.clickhouse_dsn
    if is_embedded(dsn):
        owner = current_owner(dsn)
        if owner:
            return RemoteReader(owner["url"])
        client = connect(dsn, settings.clickhouse.database)
        migrate(client, settings.clickhouse.database)
        return DirectReader(client)
    return DirectReader(connect(dsn, settings.clickhouse.database, create=False))
