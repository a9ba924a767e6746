"""Per-table content checksums of a correlation store, to compare two stores.

Input: a ClickHouse client and the database holding gpuledger's tables. Output: for
every table the migrations create (``sinks.migrations.table_names``; not the
``schema_migrations`` bookkeeping), ``(row count, order-independent hash)`` of the rows
readers see — ``FINAL`` on ReplacingMergeTree tables, so superseded versions and
re-delivered duplicates do not count — over every column except the volatile ones
(``VOLATILE_COLUMNS``: wall-clock times that differ between two builds of the same
content).
Guarantees: the result depends only on the set of latest rows, not on insert order,
batching or merges, so a replay of the same topics into a fresh store (new app id,
same raw topics) should give identical checksums (``make bench`` checks this).
Limits: a hash, not a diff — it says *which* tables differ, not which rows. It reads
every row of every table once (a full scan per table). On a cluster, pass ``cluster``
to read the ``_dist`` tables.

Also a command, for stores another process must open (one chDB directory per
process): ``python -m sinks.checksum chdb:///path [--database gpuledger] [--exclude COL]``
prints JSON.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable

from sinks.migrations import table_names
from sinks.migrations import table_name as dist_table_name

#: Columns that hold wall-clock values, not event facts: excluded from every checksum.
#: ``inserted_at`` (every table) is ``now64()`` at insert; dead letters' ``failed_at`` is the worker's clock when it rejected the record.
#: Everything else is a function of the input topics: event times, ids, the Kafka
#: topic/partition/offset of the *raw* input, attribution, payloads.
VOLATILE_COLUMNS: dict[str, frozenset[str]] = {
    "*": frozenset({"inserted_at"}),
    "dead_letters": frozenset({"failed_at"}),
}


def volatile_columns(table: str) -> frozenset[str]:
    return VOLATILE_COLUMNS["*"] | VOLATILE_COLUMNS.get(table, frozenset())


#: Rows that are tombstones, not content: a withdrawn violation (re-emitted closed at its
#: opening, ``streams.controls.rules.WITHDRAWN``) exists only in a run that opened it
#: early, a withdrawn allocation (closed at its start, ``schemas.outputs.ALLOCATION_WITHDRAWN``)
#: only in a run that read a later start of its holding first; a run that saw the history in
#: another order never emitted them. Readers skip them too, so the checksum covers what readers
#: see. (Each condition: as it holds for the rows readers keep — applied after ``FINAL``.)
TOMBSTONES: dict[str, str] = {"violations": "NOT startsWith(detail, 'withdrawn: ')", "gpu_allocations": "end_reason != 'withdrawn'"}


def checksum_sql(database: str, table: str, columns: list[str], final: bool, where: str | None = None) -> str:
    """``count()`` and the wrapping sum of one 64-bit hash per row.

    ``tuple(...)`` because ``cityHash64`` of a NULL argument is NULL (a Nullable column
    would blank the row's hash); a wrapping sum rather than ``groupBitXor`` so that two
    identical rows (possible in a non-replacing table) add up instead of cancelling.
    """
    cols = ", ".join(f"`{c}`" for c in columns)
    return (f"SELECT count(), sumWithOverflow(cityHash64(tuple({cols}))) "
            f"FROM `{database}`.`{table}`{' FINAL' if final else ''}{f' WHERE {where}' if where else ''}")


def table_checksums(client, database: str, cluster: str | None = None, exclude: Iterable[str] = ()) -> dict[str, tuple[int, int]]:
    """``{table: (rows, hash)}`` for every gpuledger table present in ``database``.

    ``exclude`` leaves further columns out of every hash — to tell *what* differs, e.g.
    ``("version",)``: the same content reached through a different number of versions."""
    exclude = frozenset(exclude)
    tables = list(table_names())
    engines = dict(client.query(
        "SELECT name, engine FROM system.tables WHERE database = {db:String} AND name IN {names:Array(String)}",
        parameters={"db": database, "names": tables}).result_rows)
    columns: dict[str, list[str]] = {}
    for table, column in client.query(
            "SELECT table, name FROM system.columns WHERE database = {db:String} AND table IN {names:Array(String)} "
            "AND default_kind NOT IN ('ALIAS', 'MATERIALIZED', 'EPHEMERAL') ORDER BY table, position",
            parameters={"db": database, "names": tables}).result_rows:
        if column not in volatile_columns(table) and column not in exclude:
            columns.setdefault(table, []).append(column)
    out: dict[str, tuple[int, int]] = {}
    for table in tables:
        if table not in engines:
            continue
        final = "ReplacingMergeTree" in engines[table]
        rows, digest = client.query(checksum_sql(database, dist_table_name(table, cluster), columns[table], final, TOMBSTONES.get(table))).result_rows[0]
        out[table] = (int(rows), int(digest))
    return out


def differing(a: dict[str, tuple[int, int]], b: dict[str, tuple[int, int]]) -> list[str]:
    """Tables whose checksums differ (or that only one side has)."""
    return sorted(t for t in set(a) | set(b) if a.get(t) != b.get(t))


def main(argv: list[str] | None = None) -> None:
    from sinks.clickhouse import connect

    parser = argparse.ArgumentParser(prog="python -m sinks.checksum", description=__doc__.split("\n\n")[0])
    parser.add_argument("dsn", help="chdb:///path or http(s)://... of the store")
    # The readers' setting by default, as trace and sql take it: a sandbox replayed into another database
    # is read with GPULEDGER_CLICKHOUSE_DATABASE set (docs/operations.md), and this read 'gpuledger' regardless.
    parser.add_argument("--database", default=None, help="the store's database (default: GPULEDGER_CLICKHOUSE_DATABASE, else gpuledger)")
    parser.add_argument("--cluster", default=None)
    parser.add_argument("--exclude", action="append", default=[], help="a further column to leave out (repeatable)")
    args = parser.parse_args(argv)
    if args.database is None:
        from gpuledger.settings import Settings

        args.database = Settings().clickhouse.database
    from sinks.clickhouse import is_embedded
    from sinks.errors import SinkError
    from sinks.read.query import current_owner

    try:
        # A live embedded store is the running worker's (one chDB directory per process): read it
        # through its owner, as trace and sql do (it was chDB's "Cannot lock file" and a traceback).
        owner = current_owner(args.dsn) if is_embedded(args.dsn) else None
        client = _OwnerClient(owner) if owner else connect(args.dsn, args.database, create=False)
        try:
            print(json.dumps(table_checksums(client, args.database, args.cluster, args.exclude)))
        finally:
            client.close()
    except SinkError as exc:
        raise SystemExit(f"error: {exc}") from None


class _OwnerClient:
    """The running worker's read endpoint (``sinks.read.query.RemoteReader``) as the client
    ``table_checksums`` reads with: ``query(sql, parameters=…).result_rows``."""

    def __init__(self, owner: dict) -> None:
        from sinks.read.query import RemoteReader

        self.reader = RemoteReader(owner["url"], owner.get("token", ""), 300.0)

    def query(self, sql: str, parameters: dict | None = None):
        from types import SimpleNamespace

        return SimpleNamespace(result_rows=[tuple(row) for row in self.reader.query(sql, parameters or {}).rows])

    def close(self) -> None:
        pass


if __name__ == "__main__":
    main()
