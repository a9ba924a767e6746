"""Read-only access to the correlation store, whoever owns it.

- Server DSN: query the server directly.
- Embedded chDB, owned by a running worker: its sink process serves read-only queries
  on a loopback port recorded, with the bearer token each query must carry, in
  ``<chdb dir>.owner.json`` (mode 0600: whoever may read that file may query);
  ``open_reader`` finds it and POSTs there (``sinks/service.py``).
- Embedded chDB, not owned: open it directly (this process becomes the owner for
  the duration) — if it is a store (its ``metadata/`` directory exists): a reader never
  creates one, so a mistyped path is "no embedded store at PATH", not an empty store.
- A client a statement failed on is not used again (``StoreConnection.reading``: chDB left
  a failed statement's streamed rows for the next one).

Read-only is enforced by ClickHouse: every statement a reader sends carries
``readonly=1`` as its own query-level ``SETTINGS`` clause (``readonly_statement``):
- ``SELECT``/``WITH`` run as ``SELECT * FROM (<query>) SETTINGS readonly=1``;
- ``SHOW``, ``DESCRIBE``/``DESC``, ``EXPLAIN`` and ``EXISTS`` — which cannot be a
  subquery — run as ``<statement> SETTINGS readonly=1``, after ClickHouse's own parser
  (``EXPLAIN AST``) has confirmed the statement is one of those;
- anything else is refused before it is sent.
ClickHouse then refuses writes, DDL and table functions (``url()``, ``file()``, ``s3()``).
Three holes in that are closed here, each found on chDB 4.4 (tests/sinks/read/test_query.py):
chDB runs *every* statement of a ``;``-separated text, the later ones outside the
``SETTINGS`` clause — so a text with a ``;`` is sent only after ClickHouse's parser
(``formatQuery``) has confirmed it is one statement; ``DESCRIBE url(...)``/``file(...)``
infers the schema by fetching the source even with ``readonly=1`` — so DESCRIBE of a
table function is refused; and ``INTO OUTFILE`` writes a file even with ``readonly=1`` —
so it is refused.
(The per-call ``settings={'readonly': 1}`` of clickhouse-connect's chDB backend is not
usable: for some statements it is applied with SET, and a read-only session cannot
reset it — the worker's shared client would stay read-only.)
Every reader statement also carries the limits of ``QueryLimits`` (from
``GPULEDGER_CLICKHOUSE_QUERY_*``): ``max_execution_time``, ``max_result_rows`` and
``max_result_bytes`` (``result_overflow_mode='throw'``: a result is complete or an
error, never silently cut) and ``max_threads`` — a responder's runaway query ends with
an error that names the limit instead of holding the store.
Parameters are always bound server-side (``{name:Type}``), never formatted into SQL.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import date, datetime, timezone
from pathlib import Path
from typing import Any

from sinks.clickhouse import StoreConnection, chdb_path, connect, is_embedded, redact
from sinks.errors import SinkError, StoreUnavailable


@dataclass
class QueryResult:
    columns: list[str]
    rows: list[list[Any]]

    def dicts(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, row)) for row in self.rows]


class QueryError(SinkError):
    """The store rejected a query (syntax, read-only violation, unknown column)."""


@dataclass(frozen=True)
class QueryLimits:
    """Per-statement limits of a reader's query (module docstring)."""

    max_seconds: float = 30.0
    max_rows: int = 100_000
    max_bytes: int = 64 << 20
    max_threads: int = 1

    @classmethod
    def of(cls, conf) -> QueryLimits:
        """From ``ClickHouseSettings``."""
        return cls(conf.query_timeout_s, conf.query_max_rows, conf.query_max_bytes, conf.query_max_threads)

    def clause(self) -> str:
        """The SETTINGS items, before ``readonly=1`` (a read-only query may not change
        settings after it)."""
        return (f"max_execution_time={self.max_seconds:g}, max_result_rows={self.max_rows}, max_result_bytes={self.max_bytes}, "
                f"result_overflow_mode='throw', max_threads={self.max_threads}, ")


#: Statements run as a subquery of a read-only SELECT.
SELECT_KEYWORDS = ("SELECT", "WITH")
#: Statements run as they are with ``SETTINGS readonly=1``: the first word, and the prefix
#: of the root node ClickHouse's parser must give them (``EXPLAIN AST``).
STATEMENT_KEYWORDS = {"SHOW": "Show", "DESCRIBE": "Describe", "DESC": "Describe", "EXPLAIN": "Explain", "EXISTS": "Exists"}
READ_STATEMENTS = "SELECT, WITH, SHOW, DESCRIBE, EXPLAIN or EXISTS"


def readonly_sql(sql: str, limits: QueryLimits | None = None) -> str:
    """A SELECT/WITH query as the subquery of a read-only SELECT."""
    body = sql.strip().rstrip(";").strip()
    return f"SELECT * FROM (\n{body}\n) SETTINGS {limits.clause() if limits else ''}readonly=1"


def _skip_comments(sql: str) -> int:
    """Where the first token starts: past whitespace, ``--`` and ``# `` line comments and
    ``/* */`` block comments (nested, as ClickHouse nests them)."""
    i, n = 0, len(sql)
    while i < n:
        if sql[i].isspace():
            i += 1
        elif sql.startswith("--", i) or sql.startswith("# ", i):
            end = sql.find("\n", i)
            i = n if end < 0 else end + 1
        elif sql.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                step = sql[i:i + 2]
                depth += 1 if step == "/*" else -1 if step == "*/" else 0
                i += 2 if step in ("/*", "*/") else 1
        else:
            break
    return i


def _first_word(sql: str) -> tuple[str, int]:
    start = _skip_comments(sql)
    word = re.match(r"[A-Za-z]+", sql[start:])
    return (word.group().upper() if word else sql[start:start + 1]), start


def _query_error(exc: Exception) -> QueryError:
    return QueryError(str(exc).splitlines()[0] if str(exc) else repr(exc))


def _parse(client, text: str, refusal: str = "") -> None:
    """Raise ClickHouse's parser error on ``text`` as a QueryError (after ``refusal``), with the
    position in ``text`` itself: ``formatQuery`` parses the text it is given and runs nothing."""
    try:
        client.query(readonly_sql("SELECT formatQuery({q:String})"), parameters={"q": text})
    except Exception as exc:  # noqa: BLE001 - driver errors vary by backend
        raise QueryError(f"{refusal}{_query_error(exc)}") from exc


def _one_statement(client, text: str) -> None:
    """Refuse ``text`` unless ClickHouse's parser sees exactly one statement in it (a
    ``;`` inside a string or comment is fine; chDB would run a second statement)."""
    if ";" in text:
        _parse(client, text, "one statement at a time: ")


def _check_statement(client, statement: str, keyword: str, parameters: dict) -> None:
    """What ClickHouse's parser makes of a SHOW/DESCRIBE/EXPLAIN/EXISTS statement: it must
    be that kind of statement, not describe a table function, not write a file."""
    if "OUTFILE" in statement.upper():
        raise QueryError("INTO OUTFILE is refused: a reader does not write files (use --format json and redirect)")
    try:
        ast = [row[0] for row in client.query(f"EXPLAIN AST {statement}\nSETTINGS readonly=1", parameters=parameters).result_rows]
    except Exception as exc:  # noqa: BLE001 - driver errors vary by backend
        raise _query_error(exc) from exc
    root = ast[0].split()[0] if ast else ""
    if not root.startswith(STATEMENT_KEYWORDS[keyword]):
        raise QueryError(f"read-only statements only ({READ_STATEMENTS}); ClickHouse parses this one as {root or 'nothing'}")
    function = next((line.split()[1] for line in ast if line.startswith("  Function ")), None)
    if root.startswith("Describe") and function:
        # ClickHouse infers a table function's schema by reading the source, readonly or not.
        raise QueryError(f"DESCRIBE of a table function ({function}) is refused: it reads the source even in read-only mode")


def readonly_statement(client, sql: str, parameters: dict | None = None, limits: QueryLimits | None = None) -> str:
    """The text to send for one reader statement (module docstring); raises ``QueryError``
    for a statement a reader does not run."""
    body = sql.strip().rstrip(";").strip()
    keyword, start = _first_word(body)
    if keyword in SELECT_KEYWORDS or keyword == "(":
        _one_statement(client, body)
        return readonly_sql(body, limits)
    if keyword not in STATEMENT_KEYWORDS:
        if keyword:
            # A typo ("SELEC 1") is ClickHouse's syntax error, not a write refused (a write parses,
            # and is refused below).
            _parse(client, body)
        raise QueryError(f"read-only statements only ({READ_STATEMENTS}); this one starts with {keyword or 'nothing'!r}")
    statement = body[start:]
    _one_statement(client, statement)
    _check_statement(client, statement, keyword, parameters or {})
    return f"{statement}\nSETTINGS {limits.clause() if limits else ''}readonly=1"


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


def run_readonly(client, sql: str, parameters: dict | None = None, limits: QueryLimits | None = QueryLimits()) -> QueryResult:
    """Run a reader's query within ``limits``. ``client`` is an open client or a
    ``StoreConnection`` (the sink's lazy store: raises ``StoreUnavailable`` while it
    cannot connect)."""
    # (a client a statement failed on is not used again: ``StoreConnection.reading``)
    with StoreConnection.of(client).reading() as open_client:
        statement = readonly_statement(open_client, sql, parameters, limits)
        try:
            result = open_client.query(statement, parameters=parameters or {})
        except Exception as exc:  # noqa: BLE001 - driver errors vary by backend
            raise _query_error(exc) from exc
    return QueryResult(list(result.column_names), [[jsonable(v) for v in row] for row in result.result_rows])


def owner_file(dsn: str) -> Path:
    path = Path(chdb_path(dsn).rstrip("/"))
    return path.with_name(path.name + ".owner.json")


def write_owner(dsn: str, url: str, token: str, health: str) -> Path:
    """Record this process as the store's owner: its query URL and bearer token, and the
    worker's health page (``health``), in a file only its user may read (created 0600)."""
    path = owner_file(dsn)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps({"pid": os.getpid(), "url": url, "token": token, "health": health}))
    os.replace(tmp, path)
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
    """Reads through a client of its own: ``client`` is an open client or a ``StoreConnection``
    (``open_reader``'s reopens a client a statement failed on: ``StoreConnection.reading``)."""

    def __init__(self, client, limits: QueryLimits | None = QueryLimits()) -> None:
        self.client, self.limits = client, limits

    def query(self, sql: str, parameters: dict | None = None) -> QueryResult:
        return run_readonly(self.client, sql, parameters, self.limits)

    def close(self) -> None:
        try:
            if isinstance(self.client, StoreConnection):
                if self.client.connected:
                    self.client.get().close()
            else:
                self.client.close()
        except Exception:  # noqa: BLE001 - closing is best effort
            pass


class RemoteReader:
    """Reads through the owning sink's loopback query endpoint (bearer ``token``)."""

    def __init__(self, url: str, token: str = "", timeout_s: float = 40.0) -> None:
        self.url = url.rstrip("/") + "/gpuledger/query/"
        self.token, self.timeout_s = token, timeout_s

    @classmethod
    def from_owner(cls, path: Path, timeout_s: float = 40.0) -> RemoteReader:
        """The reader of the store whose owner file is ``path`` (URL and token)."""
        try:
            owner = json.loads(path.read_text())
            return cls(owner["url"], owner["token"], timeout_s)
        except (OSError, ValueError, KeyError) as exc:
            raise StoreUnavailable(f"no running worker owns the store (owner file {path}: {exc})") from exc

    def query(self, sql: str, parameters: dict | None = None) -> QueryResult:
        body = json.dumps({"sql": sql, "parameters": jsonable(parameters or {})}).encode()
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.token}"}
        req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
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
            return RemoteReader(owner["url"], owner.get("token", ""), settings.clickhouse.query_timeout_s + 10)
        if not (Path(chdb_path(dsn)) / "metadata").is_dir():  # (any directory is not a store: chdb:///tmp was opened, and migrated)
            # (opening it would create an empty store there: a mistyped path read as "no data")
            raise StoreUnavailable(f"no embedded store at {chdb_path(dsn)}: nothing was ever stored there (check "
                                   "GPULEDGER_CLICKHOUSE_DSN / --dsn, or GPULEDGER_DATA_DIR for the default store)")
        database = settings.clickhouse.database
        client = connect(dsn, database)
        # (the tables it reads, if missing; not the retention: a responder's shell without the
        # worker's GPULEDGER_CLICKHOUSE_TTL_DAYS removed the TTL from every event table)
        migrate(client, database, embedded=True, retention=False)
        return DirectReader(StoreConnection.reopening(client, lambda: connect(dsn, database), redact(dsn)), QueryLimits.of(settings.clickhouse))
    database = settings.clickhouse.database
    client = connect(dsn, database, create=False)
    return DirectReader(StoreConnection.reopening(client, lambda: connect(dsn, database, create=False), redact(dsn)),
                        QueryLimits.of(settings.clickhouse))
