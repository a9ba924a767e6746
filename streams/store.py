"""PartitionStore: per-partition key → state, kept by the agent itself, with a
compacted changelog written only after the outputs the state implies.

Input: the states an agent computes for the keys of one batch (``put``). Output: one
changelog record per changed key (``write_changes``), on the changelog partition of
the input partition the key lives on; a tombstone for a deleted key.

Why not a Faust Table: a Table writes its changelog on its own schedule, so a crash
can leave a state in the changelog whose outputs never reached Kafka — and state
that says "already emitted" never emits again (measured: GPU alerts stored with the
wrong pod, for ever). Here the agent orders the writes itself:

    outputs produced → outputs acknowledged → changelog produced → acknowledged →
    batch acked (offsets committed later by Faust)

so the durable state is never newer than the durable outputs. A crash at any instant
re-processes input against a state that is not newer than its outputs; the folds are
idempotent and the versions come from history, so re-processing emits the same rows.

Recovery: a partition's state is read from its changelog partition (beginning → end
offset at the time of loading) the first time a batch touches that partition after
it was assigned; ``drop`` forgets partitions on revocation.

Limits: a state must encode below ``max_record_bytes``; callers bound their states
(``streams.correlate.entities._bound``). A state that still does not fit is refused
by Kafka and dead-lettered by the output (counted) — the entity then recovers without
it after a restart.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable

import orjson
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

log = logging.getLogger(__name__)


def _digest(value: bytes) -> bytes:
    return hashlib.blake2b(value, digest_size=16).digest()


class PartitionStore:
    def __init__(self, name: str, changelog: str, consumer_config: dict, on_load: Callable[[int, dict], None] | None = None) -> None:
        self.name = name
        self.changelog = changelog
        self._consumer_config = consumer_config
        self._on_load = on_load
        self.parts: dict[int, dict[str, dict]] = {}
        self._dirty: dict[int, set[str]] = defaultdict(set)
        # What the changelog holds for each key (a 128-bit digest of the record's bytes): a
        # key put again with the same state (re-evaluated, nothing changed) is not written again.
        self._written: dict[int, dict[str, bytes]] = defaultdict(dict)
        self.unchanged_skipped = 0
        self.loaded_records = 0
        self.load_seconds = 0.0
        self._loading = asyncio.Lock()

    # --- recovery -----------------------------------------------------------------------
    async def ensure(self, partitions: Iterable[int]) -> None:
        """Load every partition in ``partitions`` that is not in memory yet."""
        if not set(partitions) - set(self.parts):
            return
        async with self._loading:
            missing = sorted(set(partitions) - set(self.parts))
            if missing:
                loaded = await asyncio.to_thread(self._read, missing)
                for p in missing:
                    self.parts[p] = loaded.get(p, {})
                    self._written[p] = {key: _digest(orjson.dumps(state)) for key, state in self.parts[p].items()}
                    if self._on_load is not None:
                        self._on_load(p, self.parts[p])

    def _read(self, partitions: list[int]) -> dict[int, dict[str, dict]]:
        started = time.monotonic()
        consumer = Consumer({**self._consumer_config, "group.id": f"{self.changelog}.restore", "enable.auto.commit": False,
                             "enable.partition.eof": True, "auto.offset.reset": "earliest"})
        out: dict[int, dict[str, dict]] = {p: {} for p in partitions}
        try:
            ends = {}
            for p in partitions:
                low, high = consumer.get_watermark_offsets(TopicPartition(self.changelog, p), timeout=30)
                if high > low:
                    ends[p] = high
            if ends:
                consumer.assign([TopicPartition(self.changelog, p, OFFSET_BEGINNING) for p in ends])
                while ends:
                    for msg in consumer.consume(1000, timeout=1.0):
                        p = msg.partition()
                        if msg.error():
                            if msg.error().code() == KafkaError._PARTITION_EOF:
                                ends.pop(p, None)
                                continue
                            raise RuntimeError(f"reading {self.changelog}[{p}] failed: {msg.error()}")
                        key = msg.key().decode()
                        if msg.value() is None:
                            out[p].pop(key, None)
                        else:
                            out[p][key] = orjson.loads(msg.value())
                        self.loaded_records += 1
                        if msg.offset() + 1 >= ends.get(p, 0):
                            ends.pop(p, None)
        finally:
            consumer.close()
        self.load_seconds += time.monotonic() - started
        log.info("%s: recovered %d key(s) of partition(s) %s from %s in %.1fs", self.name, sum(len(v) for v in out.values()),
                 partitions, self.changelog, time.monotonic() - started)
        return out

    def drop(self, partitions: Iterable[int]) -> None:
        for p in partitions:
            self.parts.pop(p, None)
            self._dirty.pop(p, None)
            self._written.pop(p, None)  # a failed batch drops its partitions: nothing here is trusted past the changelog

    # --- access ---------------------------------------------------------------------------
    def get(self, partition: int, key: str) -> dict | None:
        return self.parts[partition].get(key)

    def put(self, partition: int, key: str, state: dict) -> None:
        self.parts[partition][key] = state
        self._dirty[partition].add(key)

    def items(self):
        for p, states in list(self.parts.items()):
            for key, state in list(states.items()):
                yield p, key, state

    def __len__(self) -> int:
        return sum(len(v) for v in self.parts.values())

    # --- the changelog ----------------------------------------------------------------------
    def write_changes(self, output) -> int:
        """Produce a changelog record for every key changed since the last call (the
        caller flushes ``output``, after the outputs these states imply were acked) — not
        for a key whose state encodes to what its last changelog record holds. If the flush
        fails, the caller's batch fails and ``drop`` forgets the partitions, so a record
        that was not acknowledged is never taken as written."""
        n = 0
        for p, keys in self._dirty.items():
            states, written = self.parts.get(p, {}), self._written[p]
            for key in keys:
                state = states.get(key)
                value = orjson.dumps(state) if state is not None else None
                mark = _digest(value) if value is not None else None
                if written.get(key) == mark and (mark is not None or key not in written):
                    self.unchanged_skipped += 1
                    continue
                if mark is None:
                    written.pop(key, None)
                else:
                    written[key] = mark
                output.produce(self.changelog, key.encode(), value, partition=p)
                n += 1
        self._dirty.clear()
        return n
