"""sinks/read/query.py against the real store: what `gpuledger sql` runs for a person
(SHOW, DESCRIBE, EXPLAIN, EXISTS — issue 13 item 14) and what it still refuses, with
read-only enforced by ClickHouse. Each hole named in the module docstring has a test
that writes (or fetches) on the code before it was closed."""

from __future__ import annotations

import http.server
import json
import re
import threading
import uuid

import pytest
from typer.testing import CliRunner

from gpuledger.cli import app as cli_app
from sinks.clickhouse import connect
from sinks.migrations import migrate
from sinks.read.query import DirectReader, QueryError


@pytest.fixture(scope="module")
def db(clickhouse_client) -> str:
    name = f"t_{uuid.uuid4().hex[:12]}"
    migrate(clickhouse_client, name)
    return name


@pytest.fixture(scope="module")
def reader(clickhouse_dsn, db):
    """A reader whose client has the store's database as its default (as open_reader's has)."""
    client = connect(clickhouse_dsn, db)
    yield DirectReader(client)
    client.close()


@pytest.fixture(scope="module")
def env(clickhouse_dsn, db, tmp_path_factory):
    return {"GPULEDGER_CLICKHOUSE_DSN": clickhouse_dsn, "GPULEDGER_CLICKHOUSE_DATABASE": db,
            "GPULEDGER_DATA_DIR": str(tmp_path_factory.mktemp("sql")), "COLUMNS": "200"}


@pytest.fixture
def http_source():
    """A local HTTP server serving a CSV, counting the requests it gets."""
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"a,b\n1,2\n")

        do_HEAD = do_GET

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/x.csv", hits
    server.shutdown()


def sql(env, *args):
    return CliRunner().invoke(cli_app, ["sql", *args], env=env)


def test_show_describe_explain_and_exists_work_for_a_person(env, reader, db):
    tables = {r["name"] for r in reader.query("SELECT name FROM system.tables WHERE database = {db:String}", {"db": db}).dicts()}
    out = sql(env, "SHOW TABLES", "--format", "json")
    assert out.exit_code == 0, out.output
    assert {r["name"] for r in json.loads(out.stdout)} == tables >= {"correlated_events", "release_history", "gpu_allocations", "violations"}

    out = sql(env, "DESCRIBE correlated_events", "--format", "json")
    assert out.exit_code == 0, out.output
    columns = {r["name"]: r["type"] for r in json.loads(out.stdout)}
    assert columns["correlation_id"] == "String" and columns["version"] == "UInt64" and "payload_json" in columns

    out = sql(env, "EXPLAIN SELECT count() FROM correlated_events WHERE release_id = 'r'")
    assert out.exit_code == 0, out.output
    assert "explain" in out.stdout and "Read" in out.stdout  # the plan: how the (empty) table is read

    for statement, column in (("EXISTS TABLE dead_letters", "result"), ("SHOW CREATE TABLE violations", "statement"),
                              ("desc TABLE raw_events", "name"), ("EXPLAIN AST SELECT 1", "explain"),
                              ("-- a comment; then\n/* a /* nested */ one */ SHOW DATABASES;", "name"),
                              ("SELECT ';' AS s -- a ; in a comment", "s"), ("(SELECT 1 AS s) UNION ALL (SELECT 2)", "s")):
        assert reader.query(statement).columns[0] == column, statement


def test_the_table_never_cuts_a_value(env):
    """Found by an exploratory review: the table cut values to the terminal's width with "…" — 80
    columns when piped — and a responder copies fingerprints and GPU UUIDs from it into `trace`."""
    gpu = "GPU-2bf89582-3ba0-4251-9a12-0123456789ab"
    statement = f"SELECT '{'e42cfeb2ea49ab6e' * 2}' AS alert_fingerprint, 'fraud-scorer-v6-prod' AS release_id, '{gpu}' AS gpu_id"
    for columns in ("80", "40"):
        out = sql({**env, "COLUMNS": columns}, statement)
        assert out.exit_code == 0, out.output
        row = next(line for line in out.stdout.splitlines() if gpu[:8] in line)
        assert "…" not in out.stdout and f"│ {'e42cfeb2ea49ab6e' * 2} │ fraud-scorer-v6-prod │ {gpu} │" in row, out.stdout
    narrow = sql({**env, "COLUMNS": "200"}, "SELECT 1 AS n")
    assert max(len(line) for line in narrow.stdout.splitlines()) < 20, narrow.stdout  # no wider than it needs


def test_writes_ddl_and_table_functions_are_still_refused(reader, http_source):
    url, hits = http_source
    with pytest.raises(QueryError, match="read-only statements only"):
        reader.query("INSERT INTO dead_letters (reason) VALUES ('x')")
    for statement in ("DROP TABLE dead_letters", "CREATE TABLE x (a Int8) ENGINE = Memory", "SET readonly = 0",
                      "ALTER TABLE dead_letters DELETE WHERE 1", "OPTIMIZE TABLE dead_letters FINAL"):
        with pytest.raises(QueryError):
            reader.query(statement)
    with pytest.raises(QueryError, match="(?i)readonly"):
        reader.query(f"SELECT * FROM url('{url}', CSV)")
    with pytest.raises(QueryError, match="(?i)readonly"):
        reader.query(f"EXPLAIN SELECT * FROM url('{url}', CSV)")
    with pytest.raises(QueryError, match="(?i)readonly"):
        reader.query("SHOW TABLES SETTINGS readonly = 0")
    assert reader.query("SELECT count() AS n FROM dead_letters").dicts() == [{"n": 0}]
    assert hits == []


def test_a_second_statement_never_runs(reader, db, tmp_path):
    # chDB runs every statement of a ;-separated text; the wrapped SELECT alone let this through.
    pwned = tmp_path / "pwned.csv"
    for statement in (f"SELECT 1); CREATE TABLE {db}.pwned (a Int8) ENGINE = Memory; SELECT (1",
                      f"SHOW TABLES; CREATE TABLE {db}.pwned (a Int8) ENGINE = Memory",
                      f"EXPLAIN SELECT 1; INSERT INTO FUNCTION file('{pwned}', CSV, 'a Int8') SELECT 1"):
        with pytest.raises(QueryError, match="one statement at a time"):
            reader.query(statement)
    assert reader.query("EXISTS TABLE pwned").rows == [[0]] and not pwned.exists()


def test_describe_of_a_table_function_is_refused_before_it_fetches(reader, http_source):
    url, hits = http_source
    for statement in (f"DESCRIBE url('{url}', CSV)", f"/* /* nested */ SHOW */ DESC TABLE url('{url}', CSV)"):
        with pytest.raises(QueryError, match="table function"):
            reader.query(statement)
    with pytest.raises(QueryError, match="(?i)readonly"):
        reader.query(f"DESCRIBE (SELECT * FROM url('{url}', CSV))")
    assert hits == []


def test_into_outfile_is_refused(reader, tmp_path):
    for statement in (f"SHOW TABLES INTO OUTFILE '{tmp_path / 'a'}'", f"EXPLAIN SELECT 1 INTO OUTFILE '{tmp_path / 'b'}'",
                      f"SELECT 1 INTO OUTFILE '{tmp_path / 'c'}'"):
        with pytest.raises(QueryError):
            reader.query(statement)
    assert list(tmp_path.iterdir()) == []


def test_a_refused_statement_leaves_the_shared_client_writable(clickhouse_client, db):
    # The reader's statements carry readonly=1 themselves: the session never becomes read-only.
    shared = DirectReader(clickhouse_client)
    for statement in ("SHOW TABLES", "INSERT INTO x VALUES (1)", "SHOW TABLES; DROP TABLE x", f"DESCRIBE {db}.violations"):
        try:
            shared.query(statement)
        except QueryError:
            pass
    clickhouse_client.command(f"CREATE TABLE `{db}`.still_writable (a Int8) ENGINE = Memory")
    assert clickhouse_client.command(f"EXISTS TABLE `{db}`.still_writable") == 1


def test_a_statement_after_one_stopped_at_the_row_limit_gets_its_own_rows_only(clickhouse_dsn, db, monkeypatch):
    """chDB streams a result: one stopped part-way at the readers' row limit left ~65,000 of its
    rows on the client, and the next statement returned them before its own, as success."""
    from gpuledger.settings import Settings
    from sinks.read.query import open_reader

    monkeypatch.setenv("GPULEDGER_CLICKHOUSE_DSN", clickhouse_dsn)
    monkeypatch.setenv("GPULEDGER_CLICKHOUSE_DATABASE", db)
    reader = open_reader(Settings())
    try:
        for i in range(3):
            with pytest.raises(QueryError, match="max rows"):
                reader.query("SELECT number FROM system.numbers LIMIT 100001")
            assert reader.query("SELECT {i:UInt8} AS i, count() AS n FROM system.one", {"i": i}).rows == [[i, 1]]
            with pytest.raises(QueryError, match="max rows"):
                reader.query("SELECT number FROM system.numbers LIMIT 100001")
            assert reader.query(f"SELECT count() AS n FROM {db}.violations").rows == [[0]]
    finally:
        reader.close()


def test_a_null_reads_as_null_not_as_pythons_none(env):
    """From an exploratory review: `sql` printed SQL's NULL as `None` (and a string 'None' the same)."""
    out = sql(env, "SELECT NULL AS nothing, 'None' AS text")
    assert out.exit_code == 0, out.output
    assert re.search(r"│\s*NULL\s*│\s*None\s*│", out.stdout), out.stdout
    assert json.loads(sql(env, "SELECT NULL AS nothing", "--format", "json").stdout) == [{"nothing": None}]


@pytest.mark.parametrize("command", [["sql", "SELECT 1"], ["trace", "--release", "r"], ["audit"]])
def test_a_server_that_does_not_answer_is_one_error_line_not_the_drivers_retries(command, tmp_path):
    """From an exploratory review: a DSN nobody answers printed urllib3's 'Retrying ...' and
    clickhouse-connect's 'Unexpected Http Driver Exception' WARNINGs above the command's error."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:  # a port nobody listens on (bound, never listening, closed)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "GPULEDGER_CLICKHOUSE_DSN": f"http://127.0.0.1:{port}", "GPULEDGER_DATA_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "gpuledger.cli", *command], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"cannot connect to ClickHouse at http://127.0.0.1:{port}" in done.stderr + done.stdout, done.stderr
    assert "Retrying" not in done.stderr and "Unexpected Http Driver Exception" not in done.stderr, done.stderr


def test_a_typo_is_the_parsers_syntax_error_not_a_refused_write(reader, env):
    """From an exploratory review: `sql "SELEC 1"` was refused as "not a read-only statement
    (starts with 'SELEC')" — a person reads that they tried to write."""
    with pytest.raises(QueryError, match="(?i)syntax error") as typo:
        reader.query("SELEC 1")
    assert "read-only statements only" not in str(typo.value)
    out = sql(env, "SELEC 1")
    assert out.exit_code != 0 and "Syntax error" in out.output and "read-only statements only" not in out.output, out.output
    # A write that parses is still refused as one.
    with pytest.raises(QueryError, match="read-only statements only"):
        reader.query("INSERT INTO dead_letters (reason) VALUES ('x')")
    assert reader.query("SELECT count() AS n FROM dead_letters").dicts() == [{"n": 0}]
