"""streams/store.py on a real broker: a changelog record per changed state, none for a
state put again unchanged — also after a recovery — and tombstones for deleted keys."""

from __future__ import annotations

import asyncio
import uuid

import orjson

from producers._kafka import ensure_specs
from schemas.topics import TopicSpec
from streams.output import BatchOutput
from streams.store import PartitionStore
from tests.fixtures.kafka import read_topic


def _changelog(bootstrap: str) -> str:
    name = f"store-{uuid.uuid4().hex[:8]}.changelog"
    ensure_specs({"bootstrap.servers": bootstrap}, [TopicSpec(name, 2, "key", -1, "compact", "internal")], 1)
    return name


def _write(store: PartitionStore, output: BatchOutput, states: dict[tuple[int, str], dict | None]) -> int:
    for (p, key), state in states.items():
        if state is None:
            store.parts[p].pop(key, None)
            store._dirty[p].add(key)
        else:
            store.put(p, key, state)
    n = store.write_changes(output)
    asyncio.run(output.flush())
    return n


def test_unchanged_states_are_not_written_again_even_after_recovery(kafka_bootstrap):
    topic = _changelog(kafka_bootstrap)
    config = {"bootstrap.servers": kafka_bootstrap}
    output = BatchOutput(config, "store-test", f"{topic}.dead")
    store = PartitionStore("t", topic, config)
    asyncio.run(store.ensure([0, 1]))
    assert _write(store, output, {(0, "a"): {"n": 1}, (1, "b"): {"n": 1}}) == 2
    # a re-evaluated key whose state did not change, and one that did
    assert _write(store, output, {(0, "a"): {"n": 1}, (1, "b"): {"n": 2}}) == 1
    # a deleted key gets its tombstone once; a key deleted that was never written gets none
    assert _write(store, output, {(0, "a"): None, (1, "never"): None}) == 1
    assert store.unchanged_skipped == 2

    recovered = PartitionStore("t", topic, config)
    asyncio.run(recovered.ensure([0, 1]))
    assert recovered.parts == {0: {}, 1: {"b": {"n": 2}}}
    assert _write(recovered, output, {(1, "b"): {"n": 2}}) == 0  # what the changelog holds already
    assert _write(recovered, output, {(1, "b"): {"n": 3}, (0, "a"): {"n": 9}}) == 2
    output.close()

    records = read_topic(kafka_bootstrap, topic, min_count=6)
    seen = [(m.partition(), m.key().decode(), orjson.loads(m.value()) if m.value() is not None else None) for m in records]
    assert sorted(seen, key=repr) == sorted([(0, "a", {"n": 1}), (1, "b", {"n": 1}), (1, "b", {"n": 2}), (0, "a", None),
                                             (1, "b", {"n": 3}), (0, "a", {"n": 9})], key=repr)

