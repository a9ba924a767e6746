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
- it decodes, its checksum matches and its values are of the types a changelog's are (a torn or
  damaged file is never half-used; records that still do not decode as states read the
  partition whole, and a cold state that fails later discards the file before its stage restarts);
- it is of this changelog partition and of this very topic (Kafka's topic id when the partition
  was loaded: a topic deleted and created again starts its offsets over);
- its offset is within the partition's offsets now (low watermark ≤ offset ≤ end);
- if records were written after it (a tail), it is younger than half the changelog's
  ``delete.retention.ms``: a tombstone written after the snapshot may be compacted away
  after that long, and the key it deleted would come back from the snapshot.

When one is written (``PartitionStore.save_snapshots``): only for a partition whose state is
exactly the fold of its changelog up to a known offset — every changed state written and
acknowledged (none encoded and never produced, none refused by Kafka), nothing of the partition
in flight when it loaded, this worker's acknowledged offsets right after the end it loaded at
(another writer's records among them: not written), no crash's orphaned chunks — see
``PartitionStore._position`` and ``ChangelogAcks``; a state its owner changed after writing it
is written as its record (``PartitionStore._record_bytes``).

Format: ``MAGIC``, then frames — each a 4-byte big-endian length and a pickle (protocol 5) of
builtin values only: first the header (a dict: changelog, partition, offset, topic id, when it was
written), then the records in lists of up to ``FRAME_RECORDS`` ``(key, value, summary or None)``
tuples — an empty frame, and the CRC-32 of every byte after ``MAGIC`` before it (4 bytes). Frames
rather than one pickle: a stop writes a partition of any size with one frame's records encoded at a
time, and a start reads it a frame at a time (one pickle of a whole partition doubled its size in
memory at both ends). Read back by an unpickler that refuses every class (``_BuiltinsOnly``), so
a file planted in the data dir can at worst fail to load. Written to a temporary name and renamed
over the old one: a crash while writing leaves the previous snapshot (the changelog tail covers
what it misses), and its temporary file is removed by the next save. Not fsynced: a file damaged
by a machine crash fails its checksum (or ends early) and the partition is read whole.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import threading
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

MAGIC = b"gpuledger-snapshot-2\n"
FRAME_RECORDS = 1000
_LEN = 4  # bytes of a frame's length, and of the CRC


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
        """Seconds since it was written; a time in the future (or not a number) is taken as
        infinitely old: the tail-age check must not pass on a clock it cannot trust."""
        age = time.time() - self.written_at
        return age if age >= -60.0 else float("inf")


class SnapshotDir:
    """The snapshot files of one changelog (one per partition) under ``root``."""

    def __init__(self, root: Path, changelog: str) -> None:
        self.dir = Path(root) / changelog
        self.changelog = changelog

    def path(self, partition: int) -> Path:
        return self.dir / f"{partition}.snapshot"

    def save(self, partition: int, offset: int, topic_id: str, records: Iterable[tuple[str, bytes, bytes | None]],
             written_at: float | None = None) -> int:
        """Write the partition's snapshot as of ``offset`` from ``records`` (key, value, summary
        header or None; consumed as it is written), atomically replacing its file; its size in bytes.
        ``written_at``: now, unless told otherwise (the tests age one)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        target = self.path(partition)
        for stale in self.dir.glob(f".{target.name}.*.tmp"):  # a stop cut short while writing (its hard exit) left it
            stale.unlink(missing_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        crc, size = 0, len(MAGIC)

        def frame(f, value) -> None:
            nonlocal crc, size
            data = pickle.dumps(value, protocol=5)
            head = len(data).to_bytes(_LEN, "big")
            crc = zlib.crc32(data, zlib.crc32(head, crc))
            f.write(head)
            f.write(data)
            size += _LEN + len(data)

        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC)
                frame(f, {"changelog": self.changelog, "partition": partition, "offset": offset, "topic_id": topic_id,
                          "written_at": float(time.time() if written_at is None else written_at)})
                batch: list = []
                for record in records:
                    batch.append(record)
                    if len(batch) == FRAME_RECORDS:
                        frame(f, batch)
                        batch = []
                if batch:
                    frame(f, batch)
                end = (0).to_bytes(_LEN, "big")
                f.write(end)
                f.write(zlib.crc32(end, crc).to_bytes(_LEN, "big"))
                size += 2 * _LEN
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        return size

    def load(self, partition: int) -> Snapshot | None:
        """The partition's snapshot; None if there is none. ``SnapshotInvalid`` for a file that
        does not decode, ends early, fails its checksum or is of another changelog partition."""
        path = self.path(partition)
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise SnapshotInvalid("unreadable", f"{path} cannot be read: {exc.strerror or exc}") from exc
        with f:
            if f.read(len(MAGIC)) != MAGIC:
                raise SnapshotInvalid("not a snapshot", f"{path} is not a gpuledger state snapshot (or of another format version)")
            crc = 0

            def frame() -> bytes:
                nonlocal crc
                head = f.read(_LEN)
                n = int.from_bytes(head, "big") if len(head) == _LEN else -1
                data = f.read(n) if n > 0 else b""
                if n < 0 or len(data) != n:
                    raise SnapshotInvalid("damaged", f"{path} is damaged (it ends early)")
                crc = zlib.crc32(data, zlib.crc32(head, crc))
                return data

            try:
                header = _BuiltinsOnly(io.BytesIO(frame())).load()
                snap = Snapshot(changelog=header["changelog"], partition=header["partition"], offset=header["offset"],
                                topic_id=header["topic_id"], written_at=header["written_at"])
                kinds = (type(snap.changelog), type(snap.partition), type(snap.offset), type(snap.topic_id), type(snap.written_at))
                if kinds != (str, int, int, str, float) or snap.offset < 0:
                    raise TypeError(f"a header of {header!r:.200}")
                records, summaries = snap.records, snap.summaries
                while data := frame():
                    for key, value, summary in _BuiltinsOnly(io.BytesIO(data)).load():
                        if type(key) is not str or type(value) is not bytes or not (summary is None or type(summary) is bytes):
                            raise TypeError(f"a record of {type(key).__name__} -> {type(value).__name__} ({type(summary).__name__}), "
                                            "not str -> bytes (bytes or None)")
                        records[key] = value
                        if summary is not None:
                            summaries[key] = summary
            except SnapshotInvalid:
                raise
            except Exception as exc:  # noqa: BLE001 - whatever is wrong with it, it is not used
                raise SnapshotInvalid("does not decode", f"{path} does not decode: {type(exc).__name__}: {exc}") from exc
            if f.read(_LEN + 1) != crc.to_bytes(_LEN, "big"):
                raise SnapshotInvalid("damaged", f"{path} is damaged (checksum mismatch)")
        if (snap.changelog, snap.partition) != (self.changelog, partition):
            raise SnapshotInvalid("another partition", f"{path} is of {snap.changelog}[{snap.partition}], not {self.changelog}[{partition}]")
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
        self._lock = threading.Lock()  # acknowledged from whichever thread polls the producer
        self.produced: dict[int, int] = {}
        self.acked: dict[int, int] = {}
        self.next_offset: dict[int, int] = {}
        self.refused: dict[int, int] = {}

    def on_produce(self, partition: int) -> None:
        with self._lock:
            self.produced[partition] = self.produced.get(partition, 0) + 1

    def on_refused(self, partition: int) -> None:
        """A record Kafka refused (it became a dead letter): not in flight any more, never written."""
        with self._lock:
            self.produced[partition] = self.produced.get(partition, 0) - 1
            self.refused[partition] = self.refused.get(partition, 0) + 1

    def on_ack(self, partition: int, offset: int) -> None:
        with self._lock:
            self.acked[partition] = self.acked.get(partition, 0) + 1
            if offset + 1 > self.next_offset.get(partition, 0):
                self.next_offset[partition] = offset + 1

    def at(self, partition: int) -> tuple[int, int, int, int]:
        """(produced, acknowledged, offset after the highest acknowledged, refused) of ``partition``."""
        with self._lock:
            return (self.produced.get(partition, 0), self.acked.get(partition, 0), self.next_offset.get(partition, 0),
                    self.refused.get(partition, 0))
