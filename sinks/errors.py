"""Errors of the sinks package, and which insert failures are retriable vs rejected.

A failed insert is one of two things, and the writer (``sinks/writer.py``) treats them
differently:

- **Retriable** (``StoreUnavailable``, ``StoreLocked``): the store cannot take the rows
  *now*. The writer backs off and retries forever, holding the batch's offsets.
- **Rejected** (``RowsRejected``): the store will never take these rows as they are.
  The writer bisects the batch, stores the good rows, and hands each bad row on as a
  dead letter (``store_rejected``) so the table keeps advancing.

How ``classify_insert_error`` decides (clickhouse-connect ``Error`` subclasses carry the
server's numeric ``code``; older drivers only say ``Code: N`` in the message, parsed too):

Rejected — deterministic errors about the data, the same on every try:
  * client-side serialization of a value into its column type. clickhouse-connect
    builds the Native block locally (HTTP and chDB alike), so a wrong-typed or
    out-of-range value fails *before* ClickHouse sees it, as ``DataError`` without a
    code ("Unable to create native array for column `x`", a negative into ``UInt32``,
    ``None`` into a non-Nullable column, a list into a ``Map``) or as a plain
    ``TypeError``/``ValueError``/``AttributeError``/``IndexError``/``KeyError``/
    ``OverflowError``/``struct.error`` from the serializers (a str into ``DateTime64``,
    an int into ``String``, a row with too few values). Checked on chDB 4.4 /
    clickhouse-connect 1.12: none of these carry a code.
  * server codes about a value (``ROW_REJECTED_CODES``): parse failures (6, 25–27, 38,
    41, 72, 376, 441, 467, 632, 675, 676), TYPE_MISMATCH 53, ARGUMENT_OUT_OF_BOUND 69,
    CANNOT_CONVERT_TYPE 70, INCORRECT_DATA 117, TOO_LARGE_STRING_SIZE 131,
    SIZES_OF_ARRAYS_DONT_MATCH 190, VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE 321,
    CANNOT_INSERT_NULL_IN_ORDINARY_COLUMN 349, DECIMAL_OVERFLOW 407,
    VIOLATED_CONSTRAINT 469, UNKNOWN_ELEMENT_OF_ENUM 691. The writer bisects to the
    rows that cause them.
  * the column set does not match the table (``BATCH_REJECTED_CODES``: unknown column
    16 / 8 / 10, column count 7 / 20, and the driver's client-side "Unrecognized
    column"): every row of the batch fails alike, so the whole batch is rejected at
    once, without bisecting. The dead letters keep the records for a replay after
    ``gpuledger db migrate``.

Retriable — everything else, including codes not listed here: a row is only ever
dead-lettered for an error known to be about the row. Named for the record
(``RETRIABLE_CODES``): transport failures without a code (connection refused/reset,
timeouts: ``OperationalError``, ``OSError``), HTTP statuses without a ClickHouse code
(a proxy's 502/503/504), overload and server state (TIMEOUT_EXCEEDED 159, TOO_SLOW 160,
TOO_MANY_SIMULTANEOUS_QUERIES 202, MEMORY_LIMIT_EXCEEDED 241, TOO_MANY_PARTS 252,
NOT_ENOUGH_SPACE 243, TABLE_IS_READ_ONLY 242, Keeper/replica/quorum errors, …), and the
schema not being there yet (UNKNOWN_TABLE 60, UNKNOWN_DATABASE 81: nothing about the
rows is wrong; holding them until migrations ran loses nothing) and credentials
(AUTHENTICATION_FAILED 516, ACCESS_DENIED 497: a configuration fix, not the rows'
fault). A chDB directory locked by another process is ``StoreLocked``, raised when
connecting (``sinks/clickhouse.py``).
"""

from __future__ import annotations

import re
import struct

from clickhouse_connect.driver import exceptions as ch_exc


class SinkError(RuntimeError):
    """Base error of the sinks package."""

    retriable = False


class StoreUnavailable(SinkError):
    """ClickHouse did not answer or cannot take writes right now; try again later."""

    retriable = True


class StoreLocked(StoreUnavailable):
    """The embedded chDB directory is owned by another process; try again once it lets go."""


class RowsRejected(SinkError):
    """ClickHouse (or the driver, serializing for it) refused the rows for their content.

    ``detail`` is the driver's or ClickHouse's own message; ``code`` the ClickHouse error
    code when the server answered (None for a client-side serialization error);
    ``whole_batch`` is true when the error is about the column set rather than a value,
    so every row would fail alike.
    """

    retriable = False

    def __init__(self, message: str, *, detail: str = "", code: int | None = None, hint: str = "",
                 whole_batch: bool = False) -> None:
        super().__init__(message)
        self.detail = detail or message
        self.code = code
        self.hint = hint
        self.whole_batch = whole_batch

    def with_detail(self, more: str) -> RowsRejected:
        """The same rejection with ``more`` appended to its detail (e.g. the column)."""
        return RowsRejected(f"{self} ({more})", detail=f"{self.detail} ({more})", code=self.code, hint=self.hint,
                            whole_batch=self.whole_batch)


#: Server codes about one row's values (the writer bisects to the rows).
ROW_REJECTED_CODES: dict[int, str] = {
    6: "CANNOT_PARSE_TEXT", 25: "CANNOT_PARSE_ESCAPE_SEQUENCE", 26: "CANNOT_PARSE_QUOTED_STRING",
    27: "CANNOT_PARSE_INPUT_ASSERTION_FAILED", 38: "CANNOT_PARSE_DATE", 41: "CANNOT_PARSE_DATETIME", 53: "TYPE_MISMATCH",
    69: "ARGUMENT_OUT_OF_BOUND", 70: "CANNOT_CONVERT_TYPE", 72: "CANNOT_PARSE_NUMBER", 117: "INCORRECT_DATA",
    131: "TOO_LARGE_STRING_SIZE", 190: "SIZES_OF_ARRAYS_DONT_MATCH", 321: "VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE",
    349: "CANNOT_INSERT_NULL_IN_ORDINARY_COLUMN", 376: "CANNOT_PARSE_UUID",
    306: "TOO_DEEP_RECURSION",  # a record nested past the parser's depth limit
    395: "FUNCTION_THROW_IF_VALUE_IS_NON_ZERO",  # a view of the correlated intake refusing a value (sinks/migrations.py, _uint32)
    407: "DECIMAL_OVERFLOW",
    441: "CANNOT_PARSE_DOMAIN_VALUE_FROM_STRING", 467: "CANNOT_PARSE_BOOL", 469: "VIOLATED_CONSTRAINT",
    632: "UNEXPECTED_DATA_AFTER_PARSED_VALUE", 675: "CANNOT_PARSE_IPV4", 676: "CANNOT_PARSE_IPV6",
    691: "UNKNOWN_ELEMENT_OF_ENUM",
}

#: Server codes about the column set: every row of the batch fails alike.
BATCH_REJECTED_CODES: dict[int, str] = {
    7: "INCORRECT_NUMBER_OF_COLUMNS", 8: "THERE_IS_NO_COLUMN", 10: "NOT_FOUND_COLUMN_IN_BLOCK", 16: "NO_SUCH_COLUMN_IN_TABLE",
    20: "NUMBER_OF_COLUMNS_DOESNT_MATCH",
}

#: Codes known to be transient or about the store's state, not the rows. Documentation
#: and hints only: any code not rejected above is retried.
RETRIABLE_CODES: dict[int, str] = {
    32: "ATTEMPT_TO_READ_AFTER_EOF", 60: "UNKNOWN_TABLE", 81: "UNKNOWN_DATABASE", 95: "CANNOT_READ_FROM_SOCKET",
    96: "CANNOT_WRITE_TO_SOCKET", 159: "TIMEOUT_EXCEEDED", 160: "TOO_SLOW", 164: "READONLY", 173: "CANNOT_ALLOCATE_MEMORY",
    202: "TOO_MANY_SIMULTANEOUS_QUERIES", 203: "NO_FREE_CONNECTION", 209: "SOCKET_TIMEOUT", 210: "NETWORK_ERROR",
    225: "NO_ZOOKEEPER", 236: "ABORTED", 241: "MEMORY_LIMIT_EXCEEDED", 242: "TABLE_IS_READ_ONLY", 243: "NOT_ENOUGH_SPACE",
    244: "UNEXPECTED_ZOOKEEPER_ERROR", 252: "TOO_MANY_PARTS", 279: "ALL_CONNECTION_TRIES_FAILED",
    285: "TOO_FEW_LIVE_REPLICAS", 286: "UNSATISFIED_QUORUM_FOR_PREVIOUS_WRITE", 319: "UNKNOWN_STATUS_OF_INSERT",
    364: "RECEIVED_ERROR_TOO_MANY_REQUESTS", 394: "QUERY_WAS_CANCELLED", 425: "SYSTEM_ERROR", 439: "CANNOT_SCHEDULE_TASK",
    497: "ACCESS_DENIED", 516: "AUTHENTICATION_FAILED", 574: "DISTRIBUTED_TOO_MANY_PENDING_BYTES",
    999: "KEEPER_EXCEPTION", 1000: "POCO_EXCEPTION",
}

_SCHEMA_MISSING = {60, 81}
_CREDENTIALS = {497, 516}

#: What the driver's serializers raise for a value that does not fit its column type.
_SERIALIZATION_ERRORS = (TypeError, ValueError, AttributeError, IndexError, KeyError, OverflowError, struct.error)

_CODE_RE = re.compile(r"\bCode:\s*(\d+)")

ROW_HINT = ("a value does not fit its column's type or range: fix what produces it (or widen the column in a new "
            "migration), then replay the record from its source offset")
BATCH_HINT = ("the writer's columns and the table's differ: run `gpuledger db migrate` or deploy the writer that "
              "matches the schema, then replay the dead letters from their source offsets")


def error_code(exc: BaseException) -> int | None:
    """The ClickHouse error code of a driver error, if it has one."""
    code = getattr(exc, "code", None)
    if isinstance(code, int):
        return code
    match = _CODE_RE.search(str(exc))
    return int(match.group(1)) if match else None


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def classify_insert_error(exc: BaseException, table: str, rows: int, serialization_failed: bool = False) -> SinkError:
    """The sink error for a failed insert of ``rows`` row(s) into ``table``.

    ``serialization_failed``: the driver reported that it could not serialize a column
    (it logs that before raising), which makes the error about the data whatever its type.
    """
    if isinstance(exc, SinkError):
        return exc
    code = error_code(exc)
    text = first_line(exc)
    what = f"insert of {rows} row(s) into {table}"
    if code in ROW_REJECTED_CODES:
        return RowsRejected(f"{what} rejected: {text}", detail=text, code=code, hint=ROW_HINT)
    if code in BATCH_REJECTED_CODES or (code is None and isinstance(exc, ch_exc.ProgrammingError)
                                        and "Unrecognized column" in text):
        return RowsRejected(f"{what} rejected: {text}", detail=text, code=code, hint=BATCH_HINT, whole_batch=True)
    if code is None and (serialization_failed or isinstance(exc, ch_exc.DataError)
                         or (isinstance(exc, _SERIALIZATION_ERRORS) and not isinstance(exc, ch_exc.ClickHouseError))):
        detail = f"{type(exc).__name__} serializing for ClickHouse: {text}"
        return RowsRejected(f"{what} rejected: {detail}", detail=detail, hint=ROW_HINT)
    if code in _SCHEMA_MISSING:
        hint = "the schema is not there: the worker migrates on connect; otherwise run `gpuledger db migrate`"
    elif code in _CREDENTIALS:
        hint = "check the user and password in GPULEDGER_CLICKHOUSE_DSN"
    elif code is not None and code not in RETRIABLE_CODES:
        hint = f"unclassified ClickHouse code {code}: held (only errors known to be about the rows are dead-lettered)"
    else:
        hint = "transient: holding the batch and retrying"
    return StoreUnavailable(f"{what} failed ({hint}): {text}")
