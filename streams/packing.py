"""Packed messages on the internal topics: many (key, body) messages per Kafka record.

Input: ``Packer.add(key, body, source)`` during a batch. Output: at most a few records
per partition per batch on an internal topic (route or controls), each a JSON list
of ``[key, body]`` pairs addressed to the partition that owns ``key``.

Why: every input event used to cost a Kafka record per hop (route, links, control
rows); one worker's profile was dominated by per-record produce and consume work.
A packed record is decoded once and its messages are processed in order, so the
per-key order of messages is the order they were added in, as with one record each.

Partitioning: ``partition_for`` is CRC-32 of the key modulo the partition count. The
records carry explicit partitions (nothing else needs to find them by key), so any
stable hash does; CRC-32 is in C (a pure-Python murmur2 cost ~15 µs a message). A key's
state lives on the same partition number on every internal topic and changelog.
"""

from __future__ import annotations

from collections import defaultdict

import zlib

import orjson

MAX_PACK_BYTES = 256 * 1024


def kind_of(key: str) -> str:
    """The kind of a state key — the part before its first ':' (``pod``, ``wl``, ``gpu``,
    ``rel``, ``alert``, …): one convention for the entity and control keys alike."""
    return key.split(":", 1)[0]


def partition_for(key: str, partitions: int) -> int:
    return zlib.crc32(key.encode()) % partitions


class Packer:
    def __init__(self, topic: str, partitions: int, max_bytes: int = MAX_PACK_BYTES, max_messages: int = 1000) -> None:
        self.topic = topic
        self.partitions = partitions
        self.max_bytes = max_bytes
        self.max_messages = max_messages
        self._parts: dict[int, list[tuple[bytes, tuple | None]]] = defaultdict(list)
        self.messages = 0

    def add(self, key: str, body: dict, source: tuple | None = None) -> int:
        """Queue one message for ``key``; return its partition. ``source`` (topic,
        partition, offset of the input it derives from) names it in a dead letter."""
        p = partition_for(key, self.partitions)
        self._parts[p].append((orjson.dumps([key, body]), source))
        self.messages += 1
        return p

    def pending(self) -> int:
        return sum(len(v) for v in self._parts.values())

    def discard(self) -> None:
        """Forget what is queued (a failed batch is handled again from its input)."""
        self._parts.clear()

    def drain_into(self, output) -> int:
        """Produce the queued messages as packed records; return how many records.

        A message larger than ``max_bytes`` travels alone, so if Kafka refuses it the
        dead letter names that message's source and no other message shares its fate.
        """
        n = 0
        for p, items in sorted(self._parts.items()):
            chunk: list[bytes] = []
            source = None
            size = 0
            for item, src in items:
                if len(item) > self.max_bytes:
                    output.produce(self.topic, None, b"[" + item + b"]", partition=p, source=src)
                    n += 1
                    continue
                if chunk and (size + len(item) > self.max_bytes or len(chunk) >= self.max_messages):
                    output.produce(self.topic, None, b"[" + b",".join(chunk) + b"]", partition=p, source=source)
                    n += 1
                    chunk, size = [], 0
                source = source if chunk else src
                chunk.append(item)
                size += len(item) + 1
            if chunk:
                output.produce(self.topic, None, b"[" + b",".join(chunk) + b"]", partition=p, source=source)
                n += 1
        self._parts.clear()
        return n


def unpack(value: bytes) -> list[tuple[str, dict]]:
    """The (key, body) messages of one packed record, in order."""
    return [(key, body) for key, body in orjson.loads(value)]
