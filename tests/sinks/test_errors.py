"""sinks/errors.py: the retriable/rejected split, checked against what the real engine
and driver raise (no hand-made exceptions)."""

from __future__ import annotations

from datetime import datetime, timezone

import clickhouse_connect
import pytest

from gpuledger.dev.process import free_port
from sinks.errors import (
    BATCH_REJECTED_CODES,
    RETRIABLE_CODES,
    ROW_REJECTED_CODES,
    RowsRejected,
    StoreLocked,
    StoreUnavailable,
    classify_insert_error,
)

COLUMNS = ["id", "name", "at", "tags"]
GOOD = [1, "a", datetime(2026, 12, 1, tzinfo=timezone.utc), {"k": "v"}]


@pytest.fixture
def table(clickhouse_client, clickhouse_db) -> str:
    name = f"{clickhouse_db}.typed"
    clickhouse_client.command(f"CREATE TABLE {name} (id UInt32, name String, at DateTime64(3, 'UTC'), tags Map(String, String)) "
                              "ENGINE = MergeTree ORDER BY id")
    return name


def _insert_error(client, table: str, rows: list, columns=COLUMNS) -> BaseException:
    try:
        client.insert(table, rows, column_names=columns)
    except Exception as exc:  # noqa: BLE001 - the point is to see what the driver raises
        return exc
    raise AssertionError(f"ClickHouse accepted {rows!r}")


def test_the_code_tables_name_the_engines_own_codes(clickhouse_client):
    """Every code listed is the engine's, under the name the list gives it (a typo in a
    number would silently change what is retried)."""
    engine = dict(clickhouse_client.query("SELECT code, name FROM system.errors SETTINGS system_events_show_zero_values = 1").result_rows)
    for listed in (ROW_REJECTED_CODES, BATCH_REJECTED_CODES, RETRIABLE_CODES):
        assert {code: engine.get(code) for code in listed} == listed
    assert not set(ROW_REJECTED_CODES) & set(RETRIABLE_CODES) and not set(BATCH_REJECTED_CODES) & set(RETRIABLE_CODES)


@pytest.mark.parametrize(("bad", "why"), [
    ([None, "a", GOOD[2], {}], "None into a non-Nullable UInt32"),
    ([-1, "a", GOOD[2], {}], "negative into UInt32"),
    ([2 ** 40, "a", GOOD[2], {}], "out of UInt32's range"),
    ([1, "a", "yesterday", {}], "a str into DateTime64"),
    ([1, 5, GOOD[2], {}], "an int into String"),
    ([1, "a", GOOD[2], [1, 2]], "a list into a Map"),
    ([1, "a"], "a row with too few values"),
])
def test_values_the_driver_cannot_serialize_are_rejected(clickhouse_client, table, bad, why):
    exc = _insert_error(clickhouse_client, table, [GOOD, bad])
    error = classify_insert_error(exc, table, 2)
    assert isinstance(error, RowsRejected) and not error.retriable, (why, exc)
    assert not error.whole_batch and error.code is None and "replay" in error.hint
    assert clickhouse_client.query(f"SELECT count() FROM {table}").result_rows == [(0,)], "a rejected insert stored nothing"


def test_a_server_side_rejection_carries_its_code(clickhouse_client, clickhouse_db):
    table = f"{clickhouse_db}.bounded"
    clickhouse_client.command(f"CREATE TABLE {table} (id UInt32, gpus UInt32, CONSTRAINT gpus_fit CHECK gpus <= 64) "
                              "ENGINE = MergeTree ORDER BY id")
    error = classify_insert_error(_insert_error(clickhouse_client, table, [[1, 8], [2, 1000]], ["id", "gpus"]), table, 2)
    assert isinstance(error, RowsRejected) and error.code == 469 and "VIOLATED_CONSTRAINT" in error.detail


def test_an_unknown_column_rejects_the_whole_batch(clickhouse_client, table):
    error = classify_insert_error(_insert_error(clickhouse_client, table, [[1, 2]], ["id", "no_such_column"]), table, 1)
    assert isinstance(error, RowsRejected) and error.whole_batch and "db migrate" in error.hint


def test_a_missing_table_is_held_not_rejected(clickhouse_client, clickhouse_db):
    """The rows are fine; the schema is not there yet (the worker migrates on connect)."""
    exc = _insert_error(clickhouse_client, f"{clickhouse_db}.not_yet", [[1]], ["id"])
    error = classify_insert_error(exc, f"{clickhouse_db}.not_yet", 1)
    assert isinstance(error, StoreUnavailable) and error.retriable and "Code: 60" in str(error) and "migrate" in str(error)


def test_a_refused_connection_is_retriable():
    try:
        clickhouse_connect.get_client(dsn=f"http://127.0.0.1:{free_port()}/", connect_timeout=2)
    except Exception as exc:  # noqa: BLE001 - whatever the driver raises for a refused connection
        error = classify_insert_error(exc, "db.t", 3)
    else:
        raise AssertionError("a closed port answered")
    assert isinstance(error, StoreUnavailable) and error.retriable
    assert issubclass(StoreLocked, StoreUnavailable) and StoreLocked.retriable
