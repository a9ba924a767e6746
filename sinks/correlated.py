"""CorrelatedEventSink: writes correlated events into ``correlated_events``.

Input: batches of ``CorrelatedEvent`` (from the correlated topic). Output: one
columnar insert per batch. Guarantees: the insert is retried with back-off until it
succeeds, so the caller (a Faust agent using ``take_events``) acks the batch's
offsets only after the rows are stored — at-least-once into a ReplacingMergeTree
keyed by (correlation_id, version) is effectively once. While ClickHouse is down,
the caller is blocked here, so consumption stops and nothing is lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from gpuledger.telemetry import ComponentCounters
from schemas.outputs import CorrelatedEvent, DeadLetter
from sinks.errors import StoreUnavailable

log = logging.getLogger(__name__)

IDENTITY_FIELDS = (
    "release_id", "model_name", "model_version", "artifact_digest", "image_digest", "config_digest", "dataset_ref",
    "environment", "workload_id", "pod_uid", "namespace", "pod", "node", "gpu_id", "owner", "data_class", "alert_fingerprint",
)
CORRELATED_COLUMNS = (
    "correlation_id", "version", "event_type", "occurred_at", "attribution", *IDENTITY_FIELDS,
    "release_state", "summary", "source_topic", "source_partition", "source_offset", "payload_json",
)
DEAD_LETTER_COLUMNS = ("reason", "error", "stage", "source_topic", "source_partition", "source_offset", "key", "value", "failed_at")


def correlated_rows(batch: Sequence[CorrelatedEvent]) -> list[list]:
    rows = []
    for ev in batch:
        ident = ev.identity
        rows.append([
            ev.correlation_id, ev.version, ev.event_type, ev.occurred_at, ev.attribution,
            *[getattr(ident, f) or "" for f in IDENTITY_FIELDS],
            ev.release_state or "", ev.summary, ev.source_topic, ev.source_partition, ev.source_offset, ev.payload_json,
        ])
    return rows


def dead_letter_rows(batch: Sequence[DeadLetter]) -> list[list]:
    return [[d.reason, d.error, d.stage, d.source_topic or "", -1 if d.source_partition is None else d.source_partition,
             -1 if d.source_offset is None else d.source_offset, d.key or "", d.value, d.failed_at] for d in batch]


class TableWriter:
    """Columnar batch insert into one table, retried with back-off on failure."""

    def __init__(self, client, database: str, table: str, columns: Sequence[str], component: str,
                 max_backoff_s: float = 10.0) -> None:
        self.client = client
        self.table = f"{database}.{table}"
        self.columns = list(columns)
        self.counters = ComponentCounters(component)
        self.max_backoff_s = max_backoff_s
        self.attempts = 0

    def insert_once(self, rows: list[list]) -> None:
        try:
            self.client.insert(self.table, rows, column_names=self.columns)
        except Exception as exc:  # noqa: BLE001 - driver errors vary by backend
            raise StoreUnavailable(f"insert of {len(rows)} row(s) into {self.table} failed: {exc}") from exc

    async def write(self, rows: list[list]) -> None:
        """Insert the batch, retrying forever with capped exponential back-off."""
        if not rows:
            return
        backoff = 0.2
        started = time.monotonic()
        while True:
            self.attempts += 1
            try:
                # The insert is blocking I/O (HTTP or in-process engine): keep the
                # event loop (and Faust's heartbeats) alive while it runs.
                await asyncio.to_thread(self.insert_once, rows)
                break
            except StoreUnavailable as exc:
                self.counters.add_rejected("store_unavailable", 0)
                log.warning("%s; retrying in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
        self.counters.add_sent(len(rows))
        log.info("inserted %d row(s) into %s in %.0f ms", len(rows), self.table, (time.monotonic() - started) * 1000)
