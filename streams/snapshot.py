"""Local snapshots of a stateful stage's partitions: a restart after a clean stop reads its
state from a file instead of its whole changelog.

Input: at a clean stop, each partition's records *as its changelog would hold them if the
state in memory were written now* — key -> record value, and the summary header of the
records that carry one — and the changelog offset they fold (``PartitionStore.save_snapshots``).
Output: one file per changelog partition under ``<data dir>/streams/snapshots/<changelog>/``;
a recovery (``PartitionStore``'s read) starts from the file and reads only the changelog's
records written after that offset (the *tail*: none after a clean stop and restart), merged
as a changelog read merges them.

Why: a recovery read every changelog record of its partitions — ~3 KB per pod the worker ever
saw, ~45,000 records a second here (docs/operations.md, Capacity), most of it librdkafka
decompressing and copying — so a restart's first batch waited seconds per 100,000 entities.
This is what Kafka Streams' checkpoint files and Faust's RocksDB tables do: local state with
the changelog offset it reflects, the changelog still the truth.

When a snapshot is used (``PartitionStore._usable``), else the partition is read whole, as
without one, and the reason is logged and counted in the store's health:
- it decodes and its checksum matches (a torn or damaged file is never half-used);
- it is of this changelog partition and of this very topic (Kafka's topic id: a topic deleted
  and created again starts its offsets over);
- its offset is within the partition's offsets now (low watermark ≤ offset ≤ end);
- if records were written after it (a tail), it is younger than half the changelog's
  ``delete.retention.ms``: a tombstone written after the snapshot may be compacted away
  after that long, and the key it deleted would come back from the snapshot.

When one is written (``PartitionStore.save_snapshots``): only for a partition whose state in
memory is exactly the fold of its changelog up to a known offset — every changed state
written and acknowledged, nothing of the partition in flight, and this worker's writes the
only ones since it loaded the partition (the offsets acknowledged are contiguous after the end
it read) — see ``ChangelogAcks``.

Format: ``MAGIC``, the CRC-32 of the payload (4 bytes, big-endian), the payload: a pickle
(protocol 5) of builtin values only — dicts, str, bytes, ints, floats — read back by an
unpickler that refuses every class (``_BuiltinsOnly``), so a file planted in the data dir can
at worst fail to load. Written to a temporary name and renamed over the old one: a crash while
writing leaves the previous snapshot (the changelog tail covers what it misses). Not fsynced:
a file damaged by a machine crash fails its checksum and the partition is read whole.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

MAGIC = b"gpuledger-snapshot-1\n"
_CRC_BYTES = 4


class SnapshotInvalid(ValueError):
    """A snapshot file that is there but cannot be used: ``kind`` says why in a few words (what
    a store's health counts), the message in full."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class _BuiltinsOnly(pickle.Unpickler):
    """An unpickler for builtin values only: any class or function named in the stream is
    refused (Python's documented way of "restricting globals")."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"a state snapshot holds builtin values only, not {module}.{name}")


@dataclass
class Snapshot:
    """One changelog partition's records as of ``offset`` (every record before it folded in,
    none after)."""

    changelog: str
    partition: int
    offset: int
    topic_id: str
    records: dict[str, bytes] = field(default_factory=dict)  # key -> record value (no tombstones: a deleted key is absent)
    summaries: dict[str, bytes] = field(default_factory=dict)  # key -> its record's summary header, for those that carry one
    written_at: float = field(default_factory=time.time)  # seconds since the epoch

    def age_s(self) -> float:
        return max(0.0, time.time() - self.written_at)


class SnapshotDir:
    """The snapshot files of one changelog (one per partition) under ``root``."""

    def __init__(self, root: Path, changelog: str) -> None:
        self.dir = Path(root) / changelog
        self.changelog = changelog

    def path(self, partition: int) -> Path:
        return self.dir / f"{partition}.snapshot"

    def save(self, snap: Snapshot) -> int:
        """Write ``snap`` (atomically replacing the partition's file); its size in bytes."""
        payload = pickle.dumps({"changelog": snap.changelog, "partition": snap.partition, "offset": snap.offset,
                                "topic_id": snap.topic_id, "written_at": snap.written_at,
                                "records": snap.records, "summaries": snap.summaries}, protocol=5)
        self.dir.mkdir(parents=True, exist_ok=True)
        target = self.path(snap.partition)
        for stale in self.dir.glob(f".{target.name}.*.tmp"):  # a stop cut short while writing (its hard exit) left it
            stale.unlink(missing_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC)
                f.write(zlib.crc32(payload).to_bytes(_CRC_BYTES, "big"))
                f.write(payload)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        return len(MAGIC) + _CRC_BYTES + len(payload)

    def load(self, partition: int) -> Snapshot | None:
        """The partition's snapshot; None if there is none. ``SnapshotInvalid`` for a file that
        does not decode, fails its checksum or is of another changelog partition."""
        path = self.path(partition)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise SnapshotInvalid("unreadable", f"{path} cannot be read: {exc.strerror or exc}") from exc
        if not data.startswith(MAGIC):
            raise SnapshotInvalid("not a snapshot", f"{path} is not a gpuledger state snapshot (or of another format version)")
        body = memoryview(data)[len(MAGIC):]
        crc, payload = int.from_bytes(body[:_CRC_BYTES], "big"), body[_CRC_BYTES:]
        if len(body) < _CRC_BYTES or zlib.crc32(payload) != crc:
            raise SnapshotInvalid("damaged", f"{path} is damaged (checksum mismatch)")
        try:
            d = _BuiltinsOnly(io.BytesIO(payload)).load()
            snap = Snapshot(changelog=d["changelog"], partition=d["partition"], offset=d["offset"], topic_id=d["topic_id"],
                            records=d["records"], summaries=d["summaries"], written_at=d["written_at"])
        except Exception as exc:  # noqa: BLE001 - whatever is wrong with it, it is not used
            raise SnapshotInvalid("does not decode", f"{path} does not decode: {type(exc).__name__}: {exc}") from exc
        if (snap.changelog, snap.partition) != (self.changelog, partition):
            raise SnapshotInvalid("another partition", f"{path} is of {snap.changelog}[{snap.partition}], not {self.changelog}[{partition}]")
        if not (isinstance(snap.offset, int) and isinstance(snap.records, dict) and isinstance(snap.summaries, dict)):
            raise SnapshotInvalid("does not decode", f"{path} does not decode: unexpected contents")
        return snap

    def discard(self, partition: int) -> None:
        self.path(partition).unlink(missing_ok=True)


class ChangelogAcks:
    """What one output producer wrote to one changelog topic, per partition: records produced,
    records acknowledged and the offset after the highest acknowledged one
    (``BatchOutput.track``). A store compares these with what they were when it loaded a
    partition to know whether its state in memory is the fold of the changelog up to a known
    offset (``PartitionStore.save_snapshots``)."""

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()  # acknowledged from whichever thread polls the producer
        self.produced: dict[int, int] = {}
        self.acked: dict[int, int] = {}
        self.next_offset: dict[int, int] = {}

    def on_produce(self, partition: int) -> None:
        with self._lock:
            self.produced[partition] = self.produced.get(partition, 0) + 1

    def on_refused(self, partition: int) -> None:
        """A record Kafka refused (it became a dead letter): not in flight any more, never written."""
        with self._lock:
            self.produced[partition] = self.produced.get(partition, 0) - 1

    def on_ack(self, partition: int, offset: int) -> None:
        with self._lock:
            self.acked[partition] = self.acked.get(partition, 0) + 1
            if offset + 1 > self.next_offset.get(partition, 0):
                self.next_offset[partition] = offset + 1

    def at(self, partition: int) -> tuple[int, int, int]:
        """(produced, acknowledged, offset after the highest acknowledged) of ``partition``."""
        with self._lock:
            return self.produced.get(partition, 0), self.acked.get(partition, 0), self.next_offset.get(partition, 0)
