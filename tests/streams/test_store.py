"""streams/store.py on a real broker: a changelog record per changed state, none for a
state put again unchanged — also after a recovery — and tombstones for deleted keys; big
states in chunks, written again only where they changed, recovered whole and in order."""

from __future__ import annotations

import asyncio
import gc
import logging
import uuid

import orjson
import pytest

from producers._kafka import ensure_specs
from schemas.topics import TopicSpec
from streams.output import BatchOutput
from streams.store import SEP, SUMMARY_HEADER, Chunks, PartitionStore, StateUnavailable, _Layout, decode_chunked, encode_chunked, touched
from tests.fixtures.kafka import read_topic


def _changelog(bootstrap: str) -> str:
    name = f"store-{uuid.uuid4().hex[:8]}.changelog"
    ensure_specs({"bootstrap.servers": bootstrap}, [TopicSpec(name, 2, "key", -1, "compact", "internal")], 1)
    return name


def _setup(bootstrap: str) -> tuple[str, dict, BatchOutput]:
    """A new two-partition changelog, the client config and an output that writes to it."""
    topic = _changelog(bootstrap)
    config = {"bootstrap.servers": bootstrap}
    return topic, config, BatchOutput(config, "store-test", f"{topic}.dead")


def _write(store: PartitionStore, output: BatchOutput, states: dict[tuple[int, str], dict | None]) -> int:
    for (p, key), state in states.items():
        if state is None:
            store.delete(p, key)
        else:
            store.put(p, key, state)
    n = store.write_changes(output)
    asyncio.run(output.flush())
    return n


def test_unchanged_states_are_not_written_again_even_after_recovery(kafka_bootstrap):
    topic, config, output = _setup(kafka_bootstrap)
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
    assert _write(recovered, output, {(1, "b"): {"n": 3}, (0, "a"): {"n": 9}, (0, "pod:x"): {"n": 1}}) == 3
    # what the changelog holds is remembered as ints: the marks are never walked by the garbage
    # collector (with (length, hash) tuples each new mark made the whole dict tracked again)
    gc.collect()
    assert _write(recovered, output, {(0, "a"): {"n": 10}}) == 1 and not gc.is_tracked(recovered._written[0])
    # health counts the keys in memory by kind (the part before ':'), as keys come and go
    assert recovered.health()["kinds"] == {"a": 1, "b": 1, "pod": 1}
    recovered.drop([1])
    assert recovered.health()["kinds"] == {"a": 1, "pod": 1} and recovered.health()["keys"] == 2
    output.close()

    records = read_topic(kafka_bootstrap, topic, min_count=8)
    seen = [(m.partition(), m.key().decode(), orjson.loads(m.value()) if m.value() is not None else None) for m in records]
    assert sorted(seen, key=repr) == sorted([(0, "a", {"n": 1}), (1, "b", {"n": 1}), (1, "b", {"n": 2}), (0, "a", None),
                                             (1, "b", {"n": 3}), (0, "a", {"n": 9}), (0, "pod:x", {"n": 1}),
                                             (0, "a", {"n": 10})], key=repr)



# --- big states in chunks (Chunks) ------------------------------------------------------------

CHUNKS = Chunks({"rows": ("sent",), "links": ()}, volatile={"rows": ("parked",)}, size=4)
#: The entity store's shape (streams.correlate.agents.entity_chunks): two in-place fields per row.
ENTITY_CHUNKS = Chunks({"rows": ("sent",), "links": ()}, volatile={"rows": ("parked", "expired")}, size=4)


def _entity(n_rows: int, n_links: int) -> dict:
    return {"key": "gpu:n1/GPU-1", "interests": ["rid:r1"],
            "rows": {f"e{i}": {"id": f"e{i}", "parked": False, "payload": "x" * i} for i in range(n_rows)},
            "sent": {f"e{i}": [i + 1, ""] for i in range(n_rows)},
            "links": {f"pod:ml/p{i}": {"v": i, "intervals": [{"start": f"t{i}"}]} for i in range(n_links)}}


def _records(bootstrap: str, topic: str, n: int) -> list[tuple[str, object]]:
    return [(m.key().decode(), orjson.loads(m.value()) if m.value() is not None else None) for m in read_topic(bootstrap, topic, min_count=n)]


@pytest.mark.parametrize("shape", [CHUNKS, ENTITY_CHUNKS], ids=["one-in-place-field", "entity-rows"])
def test_a_big_state_is_written_in_chunks_and_only_what_changed_is_written_again(kafka_bootstrap, shape):
    topic, config, output = _setup(kafka_bootstrap)
    store = PartitionStore("t", topic, config, chunks=shape)
    asyncio.run(store.ensure([0, 1]))
    small, big = _entity(3, 2), _entity(10, 5)
    small["key"] = "pod:ml/p1"
    # the small state is one record, as without chunks; the big one: rows 0-3, 4-7 and links 0-3
    # sealed, the rest in its head
    assert _write(store, output, {(1, "pod:ml/p1"): small, (0, "gpu:n1/GPU-1"): big}) == 1 + 4
    first = _records(kafka_bootstrap, topic, 5)
    assert ("pod:ml/p1", small) in first
    chunks = {k.split(SEP)[1]: v for k, v in first if SEP in k}
    assert sorted(chunks) == ["links2", "rows0", "rows1"]
    assert list(chunks["rows1"]["rows"]) == ["e4", "e5", "e6", "e7"] and chunks["rows1"]["sent"]["e5"] == [6, ""]
    [head] = [v for k, v in first if k == "gpu:n1/GPU-1"]
    assert list(head["rows"]) == ["e8", "e9"] and list(head["sent"]) == ["e8", "e9"] and list(head["links"]) == ["pod:ml/p4"]

    # a sealed row parked (in place), a sealed row re-emitted at a higher version, a new row,
    # a replaced link: chunks rows0 and links2 and the head — rows1 is written again only
    # for its new version
    big["rows"]["e1"]["parked"] = True
    big["sent"]["e6"] = [99, ""]
    big["rows"]["e10"] = {"id": "e10", "parked": False, "payload": ""}
    big["links"]["pod:ml/p2"] = {"v": 7, "intervals": [{"start": "t2"}]}
    assert _write(store, output, {(0, "gpu:n1/GPU-1"): big}) == 4
    assert _write(store, output, {(0, "gpu:n1/GPU-1"): big}) == 0  # put again unchanged
    if shape is ENTITY_CHUNKS:  # the second in-place field, changed alone, rewrites its chunk alone
        big["rows"]["e5"]["expired"] = True
        assert _write(store, output, {(0, "gpu:n1/GPU-1"): big}) == 1

    recovered = PartitionStore("t", topic, config, chunks=shape)
    asyncio.run(recovered.ensure([0, 1]))
    state = recovered.get(0, "gpu:n1/GPU-1")
    assert state == big and list(state["rows"]) == list(big["rows"]) and list(state["links"]) == list(big["links"])
    assert recovered.get(1, "pod:ml/p1") == small
    assert _write(recovered, output, {(0, "gpu:n1/GPU-1"): state}) == 0  # what the changelog holds already

    # the oldest rows detached: their chunk is written again without them, or deleted when empty
    for i in range(4):
        del state["rows"][f"e{i}"], state["sent"][f"e{i}"]
    del state["rows"]["e4"], state["sent"]["e4"]
    assert _write(recovered, output, {(0, "gpu:n1/GPU-1"): state}) == 2  # rows0's tombstone, rows1 (the head did not change)
    # and a deleted key takes its chunks with it
    assert _write(recovered, output, {(0, "gpu:n1/GPU-1"): None}) == 3  # rows1, links2, head
    output.close()
    tail = [(k, v) for k, v in _records(kafka_bootstrap, topic, 5 + 4 + 2 + 3) if k.startswith("gpu:")][-5:]
    assert [(k.replace(SEP, "#"), v is None) for k, v in tail] == [
        ("gpu:n1/GPU-1#rows0", True), ("gpu:n1/GPU-1#rows1", False),
        ("gpu:n1/GPU-1#rows1", True), ("gpu:n1/GPU-1#links2", True), ("gpu:n1/GPU-1", True)]
    again = PartitionStore("t", topic, config, chunks=shape)
    asyncio.run(again.ensure([0, 1]))
    assert again.parts == {0: {}, 1: {"pod:ml/p1": small}}


def test_a_collection_is_chunked_only_once_it_holds_seal_from_items():
    """``seal_from``: a small state stays one record (the state itself); once a collection
    holds that many items it is sealed in chunks of ``size``, leaving fewer than ``size``
    open items in the head — what every touch of a big entity re-encodes."""
    shape = Chunks({"rows": ("sent",), "links": ()}, volatile={"rows": ("parked",)}, size=2, seal_from=6)
    state, layout, written = _entity(5, 5), _Layout(), {}

    def write() -> list[str]:
        records = encode_chunked(shape, state["key"], state, layout)
        written.update(records)
        return [k.split(SEP)[1] if SEP in k else "head" for k, _ in records]

    def add_row(i: int) -> None:
        state["rows"][f"e{i}"], state["sent"][f"e{i}"] = {"id": f"e{i}", "parked": False, "payload": ""}, [i + 1, ""]

    assert write() == ["head"] and orjson.loads(written[state["key"]]) == state  # 5 rows, 5 links: below 6
    add_row(5)
    assert write() == ["rows0", "rows1", "rows2", "head"]  # rows reached 6: all sealed; the 5 links stay open
    head = orjson.loads(written[state["key"]])
    assert head["rows"] == {} and head["sent"] == {} and list(head["links"]) == [f"pod:ml/p{i}" for i in range(5)]
    add_row(6)
    assert write() == ["head"]  # one open row: fewer than size
    add_row(7)
    assert write() == ["rows3", "head"]
    assert list(orjson.loads(written[state["key"]])["rows"]) == []
    parts = {k.split(SEP)[1]: v for k, v in written.items() if SEP in k}
    recovered, _layout = decode_chunked(shape, written[state["key"]], parts)
    assert recovered == state and list(recovered["rows"]) == list(state["rows"])
    # without seal_from, the same state is sealed from the first whole chunk on (the default)
    assert [k.split(SEP)[1] for k, _ in encode_chunked(Chunks(shape.fields, shape.volatile, size=2), state["key"], _entity(5, 5), _Layout())
            if SEP in k] == ["rows0", "rows1", "links2", "links3"]


def test_a_journaled_state_is_looked_at_only_in_the_chunks_its_journals_noted(monkeypatch):
    """With ``Chunks.journal``, the store makes a ``Journal`` of the rows and their sent versions
    at a state's first write; later writes look only at the sealed chunks holding an id the
    journals noted — set, deleted, popped, or changed in place and ``touched`` — and write the
    same records as looking at every chunk would. A change in place nobody noted is caught by
    ``VERIFY_JOURNAL`` (on in the tests) rather than left unwritten."""
    import streams.store as store

    journaled = Chunks(ENTITY_CHUNKS.fields, ENTITY_CHUNKS.volatile, size=2, journal=("rows", "sent"))
    plain = Chunks(ENTITY_CHUNKS.fields, ENTITY_CHUNKS.volatile, size=2)
    state, twin = _entity(12, 4), _entity(12, 4)  # twin: plain dicts, every chunk looked at
    layout, twin_layout = _Layout(), _Layout()
    looked: list[int] = []
    token = store._token
    monkeypatch.setattr(store, "_token", lambda chunks, field, st, ids: looked.append(len(ids)) or token(chunks, field, st, ids))

    def write(change=None) -> list[str]:
        if change:
            change(state)
            change(twin)
        looked.clear()
        records = encode_chunked(journaled, state["key"], state, layout)
        seen = list(looked)
        assert records == encode_chunked(plain, twin["key"], twin, twin_layout)  # the same records either way
        looked[:] = seen
        return [k.split(SEP)[1] if SEP in k else "head" for k, _ in records]

    assert write() == ["rows0", "rows1", "rows2", "rows3", "rows4", "rows5", "links6", "links7", "head"]
    assert type(state["rows"]) is store.Journal and type(state["sent"]) is store.Journal and type(state["links"]) is dict
    monkeypatch.setattr(store, "VERIFY_JOURNAL", False)  # the worker's path
    assert write() == [] and looked == [2, 2]  # nothing noted: only the plain links' chunks are looked at
    assert write(lambda st: st["sent"].__setitem__("e3", [40, ""])) == ["rows1"] and looked == [2, 2, 2]

    def park(st: dict) -> None:
        st["rows"]["e0"]["parked"] = True
        store.touched(st["rows"], "e0")
    assert write(park) == ["rows0"]
    assert write(lambda st: st["rows"].__setitem__("e5", {**st["rows"]["e5"], "payload": "new"})) == ["rows2"]
    assert write(lambda st: (st["rows"].pop("e11"), st["sent"].pop("e11"))) == ["rows5"]  # without e11
    # a change in place that nobody noted: not written on the worker's path — the tests' path fails it
    state["rows"]["e7"]["expired"] = True
    assert encode_chunked(journaled, state["key"], state, layout) == []
    monkeypatch.setattr(store, "VERIFY_JOURNAL", True)
    state["rows"]["e8"]["expired"] = True
    with pytest.raises(AssertionError, match="rows3 changed without its journal noting it"):  # e7's, the first found
        encode_chunked(journaled, state["key"], state, layout)


def test_a_state_journaled_whole_is_written_from_its_noted_chunks_alone(monkeypatch):
    """When every chunked collection of a state is journaled (a node/GPU's rows, sent versions
    and — followed by its memo — links), a write on the worker's path takes only the chunks
    sealed or emptied now and those holding a noted id (no other chunk's token is computed, nor
    is any other chunk visited) and writes what looking at every chunk writes: new chunks,
    changed ones, tombstones of emptied ones, the head."""
    import streams.store as store

    journaled = Chunks(ENTITY_CHUNKS.fields, ENTITY_CHUNKS.volatile, size=2, journal=("rows", "sent", "links"))
    plain = Chunks(ENTITY_CHUNKS.fields, ENTITY_CHUNKS.volatile, size=2)
    state, twin = _entity(12, 6), _entity(12, 6)
    layout, twin_layout = _Layout(), _Layout()
    visited: list[str] = []
    token = store._token
    monkeypatch.setattr(store, "_token", lambda chunks, field, st, ids: visited.append(ids[0]) or token(chunks, field, st, ids))

    def write(change=None) -> list[str]:
        if change:
            change(state)
            change(twin)
        monkeypatch.setattr(store, "VERIFY_JOURNAL", False)  # the worker's path
        visited.clear()
        records = encode_chunked(journaled, state["key"], state, layout)
        seen = list(visited)
        monkeypatch.setattr(store, "VERIFY_JOURNAL", True)
        assert records == encode_chunked(plain, twin["key"], twin, twin_layout)  # every chunk looked at
        visited[:] = seen
        return [k.split(SEP)[1] if SEP in k else "head" for k, _ in records]

    assert write() == ["rows0", "rows1", "rows2", "rows3", "rows4", "rows5", "links6", "links7", "links8", "head"]
    assert all(type(state[name]) is store.Journal for name in ("rows", "sent", "links"))
    assert write() == [] and visited == []  # nothing noted: no chunk visited
    assert write(lambda st: st["sent"].__setitem__("e3", [40, ""])) == ["rows1"] and visited == ["e2"]
    assert write(lambda st: st["links"].__setitem__("pod:ml/p4", {"v": 9, "intervals": []})) == ["links8"] and visited == ["pod:ml/p4"]

    def add(st: dict) -> None:
        for i in (12, 13, 14):
            st["rows"][f"e{i}"], st["sent"][f"e{i}"] = {"id": f"e{i}", "parked": False, "payload": ""}, [i + 1, ""]
    assert write(add) == ["rows9", "head"] and visited == ["e12"]  # one chunk sealed, e14 open in the head

    def drop(st: dict) -> None:
        for i in (0, 1):
            st["rows"].pop(f"e{i}"), st["sent"].pop(f"e{i}")
    assert write(drop) == ["rows0"] and visited == []  # emptied: its tombstone, nothing looked at
    assert write() == [] and visited == []


def test_a_big_states_head_holds_the_entries_of_its_open_items_whatever_order_its_companions_have(monkeypatch):
    """The head of a chunked state is built from its open items (``encode_chunked`` finds them
    from the end of each field), not by walking every item the state keeps: its companions'
    entries are those of the open items — also when a companion's entries came in another
    order (a parked row's sent version set after later rows') — and recovery gives the state
    back. A companion entry of an item its field does not hold breaks that rule: the tests'
    verification (``VERIFY_JOURNAL``) fails the write rather than leave the entry out."""
    import streams.store as store

    shape = Chunks(ENTITY_CHUNKS.fields, ENTITY_CHUNKS.volatile, size=2)
    state, layout, written = _entity(7, 3), _Layout(), {}
    state["sent"] = {i: v for i, v in reversed(list(state["sent"].items()))}  # e6 first: another order than the rows'
    written.update(encode_chunked(shape, state["key"], state, layout))
    head = orjson.loads(written[state["key"]])
    assert list(head["rows"]) == ["e6"] and head["sent"] == {"e6": [7, ""]} and list(head["links"]) == ["pod:ml/p2"]
    parts = {k.split(SEP)[1]: v for k, v in written.items() if SEP in k}
    recovered, _layout = decode_chunked(shape, written[state["key"]], parts)
    assert recovered == state
    state["sent"]["gone"] = [1, ""]  # an entry of no row
    monkeypatch.setattr(store, "VERIFY_JOURNAL", True)
    with pytest.raises(AssertionError, match="the head's sent is not the entries outside its sealed chunks"):
        encode_chunked(shape, state["key"], state, layout)


def test_a_crash_between_a_chunk_and_its_head_recovers_the_newer_copy():
    """Chunks are produced before their head, on one partition, by the idempotent producer:
    a crash can leave a chunk written and the head not (the head still holding the chunk's
    rows, at older versions). The recovered state takes the chunk's copy."""
    old = _entity(3, 0)
    old_head = orjson.dumps(old)
    newer = {"rows": {"e0": {**old["rows"]["e0"], "parked": True}, "e1": old["rows"]["e1"], "e2": old["rows"]["e2"],
                      "e3": {"id": "e3", "parked": False, "payload": "new"}},
             "sent": {"e0": [5, ""], "e1": [2, ""], "e2": [3, ""], "e3": [1, ""]}}
    state, _layout = decode_chunked(CHUNKS, old_head, {"rows0": orjson.dumps(newer)})
    assert list(state["rows"]) == ["e0", "e1", "e2", "e3"] and state["rows"]["e0"]["parked"] is True
    assert state["sent"] == {"e0": [5, ""], "e1": [2, ""], "e2": [3, ""], "e3": [1, ""]}


class _Recorded:
    """An output that keeps what a store's ``write_changes`` produced, in order (no broker needed)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, bytes | None]] = []

    def produce(self, topic, key, value, partition=None, headers=None):
        self.records.append((key.decode(), value))


def test_chunks_left_without_a_head_by_a_crash_are_tombstoned_by_the_keys_next_write():
    """A crash during a key's first write, after its chunks and before its head, leaves
    chunk records with no state. The key is built again from its re-processed input and
    may seal fewer chunks; the old ones must not survive under names the new write does
    not overwrite (a later recovery would merge their rows into the state)."""
    first = _entity(16, 0)  # sealed in rows0..rows3 (size 4)
    crashed = [(k, v) for k, v in encode_chunked(CHUNKS, first["key"], first, _Layout()) if SEP in k]  # the head never made it
    assert [k.split(SEP)[1] for k, _ in crashed] == ["rows0", "rows1", "rows2", "rows3"]

    def recover(changelog: dict) -> PartitionStore:
        store = PartitionStore("entities", "unused.changelog", {}, chunks=CHUNKS)  # decoding and writing: no broker
        store.parts[0], store._cold[0], store._layouts[0], _summaries, store._cold_summaries[0] = store._decode(changelog, {})
        return store

    def write(store: PartitionStore, state: dict | None) -> list[tuple[str, bytes | None]]:
        if state is None:
            store.delete(0, first["key"])
        else:
            store.put(0, first["key"], state)
        out = _Recorded()
        store.write_changes(out)
        return out.records

    store = recover(dict(crashed))
    assert store.parts[0] == {}  # no head, no state
    again = _entity(8, 0)  # the re-processed input, cut otherwise: 8 rows
    changelog = dict(crashed)
    changelog.update(write(store, again))
    changelog = {k: v for k, v in changelog.items() if v is not None}  # compaction
    assert sorted(k.split(SEP)[1] for k in changelog if SEP in k) == ["rows4", "rows5"]  # the orphans tombstoned
    assert recover(changelog).parts[0] == {again["key"]: again}

    # a key deleted before it was ever written whole: its orphans go with its tombstone
    assert sorted(write(recover(dict(crashed)), None)) == sorted([(k, None) for k, _ in crashed] + [(first["key"], None)])


# --- cold states (summarize) ----------------------------------------------------------------

def _summary(state: dict) -> list:
    return [state.get("interests", []), sorted(r for r, v in state.get("rows", {}).items() if v.get("parked"))]


@pytest.mark.parametrize("shape", [None, ENTITY_CHUNKS], ids=["whole-states", "entity-chunks"])
def test_a_recovery_keeps_states_encoded_until_asked_for_and_hands_over_their_summaries(kafka_bootstrap, shape):
    """With ``summarize``, a state's record carries its summary in a header: a recovery gives
    ``on_load`` every key's summary — the same as summarizing the decoded state — and keeps
    the states encoded until a batch asks for one. States in chunks, the directory mark and
    records written without a summary (before it existed) are decoded as before."""
    topic, config, output = _setup(kafka_bootstrap)
    states = {(p, f"pod:ml/p{i}"): {"key": f"pod:ml/p{i}", "interests": [f"rid:r{i}"],
                                    "rows": {f"e{i}": {"id": f"e{i}", "parked": i % 2 == 0}}} for i in range(6) for p in [i % 2]}
    old = {(0, "pod:ml/old"): {"key": "pod:ml/old", "interests": ["rid:old"], "rows": {"x": {"id": "x", "parked": True}}}}
    before = PartitionStore("t", topic, config, chunks=shape)  # no summary: as written before summaries existed
    asyncio.run(before.ensure([0, 1]))
    _write(before, output, old)
    writer = PartitionStore("t", topic, config, chunks=shape, summarize=_summary)
    asyncio.run(writer.ensure([0, 1]))
    big = _entity(10, 0) if shape else None
    mark = {(1, "~directory"): {"key": "~directory", "covered": {"r1": 3}}}
    assert _write(writer, output, {**states, **mark, **({(0, big["key"]): big} if big else {})}) == 7 + (3 if big else 0)

    loads = []
    recovered = PartitionStore("t", topic, config, chunks=shape, summarize=_summary, on_load=lambda p, summaries: loads.append((p, summaries)))
    asyncio.run(recovered.ensure([0, 1]))
    everything = {**states, **old, **({(0, big["key"]): big} if big else {})}
    assert sorted(loads, key=lambda x: x[0]) == [(p, {k: _summary(v) for (q, k), v in everything.items() if q == p}) for p in (0, 1)]
    health = recovered.health()
    assert health["keys"] == len(everything) + 1 and health["kinds"] == {"pod": 7, "~directory": 1, **({"gpu": 1} if big else {})}
    assert health["cold"] == 6 and health["decoded_cold"] == 0  # the six with a summary, whole; not the old one, the mark or the big one
    assert recovered.parts[1] == {"~directory": mark[(1, "~directory")]}  # decoded at once: the owner reads it in on_load

    # asked for: decoded once, equal to what was written; written again only when it changed
    assert recovered.get(0, "pod:ml/p2") == states[(0, "pod:ml/p2")] and recovered.health()["cold"] == 5
    assert recovered.get(0, "pod:ml/p2") is recovered.get(0, "pod:ml/p2") and recovered.health()["decoded_cold"] == 1
    assert recovered.get(0, "pod:ml/none") is None
    assert _write(recovered, output, {(0, "pod:ml/p2"): recovered.get(0, "pod:ml/p2")}) == 0
    # put over a cold state (never asked for): unchanged, nothing; changed or deleted, one record each, counted once
    assert _write(recovered, output, {(0, "pod:ml/p0"): orjson.loads(orjson.dumps(states[(0, "pod:ml/p0")]))}) == 0
    assert _write(recovered, output, {(1, "pod:ml/p1"): {"key": "pod:ml/p1", "interests": [], "rows": {}}, (1, "pod:ml/p3"): None}) == 2
    assert recovered.health()["cold"] == 2 and recovered.health()["keys"] == len(everything)  # p4, p5 still cold
    assert recovered.states(1) == {"~directory": mark[(1, "~directory")], "pod:ml/p1": {"key": "pod:ml/p1", "interests": [], "rows": {}},
                                   "pod:ml/p5": states[(1, "pod:ml/p5")]}
    recovered.drop([0, 1])
    assert recovered.health()["keys"] == 0 and recovered.health()["cold"] == 0
    output.close()

    # the summaries went with the records, as headers
    heads = {m.key().decode(): dict(m.headers() or []) for m in read_topic(kafka_bootstrap, topic, min_count=10) if m.value() is not None}
    assert orjson.loads(heads["pod:ml/p4"][SUMMARY_HEADER]) == _summary(states[(0, "pod:ml/p4")])
    assert SUMMARY_HEADER not in heads["~directory"] and SUMMARY_HEADER not in heads["pod:ml/old"]
    if big:  # a head beside sealed chunks is decoded at recovery: no summary to write (nor to keep right)
        assert SUMMARY_HEADER not in heads[big["key"]]

    # a cold record that does not decode: the state is not there — the batch waits (StateUnavailable), the record stays
    output = BatchOutput(config, "store-test", f"{topic}.dead")
    output.produce(topic, b"pod:ml/bad", b"{not json", partition=0, headers=[(SUMMARY_HEADER, b'[[], []]')])
    asyncio.run(output.flush())
    output.close()
    broken = PartitionStore("t", topic, config, chunks=shape, summarize=_summary)
    asyncio.run(broken.ensure([0]))
    with pytest.raises(StateUnavailable, match="pod:ml/bad"):
        broken.get(0, "pod:ml/bad")
    assert broken.health()["read_failures"] == 1 and "pod:ml/bad" in broken._cold[0]


def test_a_batch_whose_state_cannot_be_read_waits_for_it_and_is_never_dead_lettered(kafka_bootstrap, catalogue, settings_for):
    """A changelog that cannot be read (here: its topic does not exist yet) is not the
    input's fault: the batch that needs the state waits, with back-off, and is handled whole
    once the state can be read — no record is dead-lettered, none acked before; the worker's
    health says ``degraded`` meanwhile."""
    from types import SimpleNamespace

    from streams.app import WorkerContext
    from streams.runner import Epoch

    name = f"store-{uuid.uuid4().hex[:8]}.changelog"
    store = PartitionStore("t", name, {"bootstrap.servers": kafka_bootstrap}, read_within_s=0.5)
    handled, dead, acked = [], [], []

    async def handle(events):
        await store.ensure({ev.message.partition for ev in events})
        handled.extend(events)

    async def nothing(*_args):
        return None

    events = [SimpleNamespace(message=SimpleNamespace(topic="in", partition=p, offset=o)) for p in (0, 1) for o in range(3)]
    epoch = Epoch("t", handle, nothing, lambda ev, exc: dead.append((ev, exc)) or nothing(), nothing, interval_s=0.0, hold=None,
                  release=acked.extend)

    ctx = WorkerContext(settings_for(catalogue))
    ctx.epochs["t"] = epoch
    ctx.subscriptions = {"ok": True, "problems": [], "partitions": [0, 1]}
    ctx.directory.ready.set()

    async def scenario():
        assert ctx.health()["status"] == "ok"
        batch = asyncio.ensure_future(epoch.run_batch(events))
        while epoch.health()["waiting_for_state"] < 2:  # failed twice, waiting to try again
            assert not batch.done(), batch.exception()
            await asyncio.sleep(0.05)
        assert store.health()["read_failures"] >= 2 and not handled and not acked
        assert ctx.health()["status"] == "degraded" and ctx.health()["epochs"]["t"]["waiting_for_state"] >= 2
        with pytest.raises(StateUnavailable, match=f"reading {name} partition"):
            await store.ensure([0])
        ensure_specs({"bootstrap.servers": kafka_bootstrap}, [TopicSpec(name, 2, "key", -1, "compact", "internal")], 1)
        await asyncio.wait_for(batch, 60)

    asyncio.run(scenario())
    assert handled == events and acked == events and dead == []
    assert epoch.health()["waiting_for_state"] == 0 and store.health()["read_failures"] == 0 and store.health()["partitions"] == [0, 1]
    assert ctx.health()["status"] == "ok"
    ctx.output.close()


def test_a_partition_revoked_while_it_loads_is_not_kept(kafka_bootstrap):
    """A partition dropped (revoked) while its changelog is being read must not be installed
    when the read ends: by the time it is assigned again another worker may have changed it."""
    topic, config, output = _setup(kafka_bootstrap)
    store = PartitionStore("t", topic, config)
    asyncio.run(store.ensure([0, 1]))
    assert _write(store, output, {(0, "a"): {"n": 1}, (1, "b"): {"n": 1}}) == 2
    output.close()

    async def revoke_while_loading(recovering: PartitionStore) -> None:
        loading = asyncio.create_task(recovering.ensure([0, 1]))
        await asyncio.sleep(0)  # the load is now reading in its thread
        assert not recovering.parts
        recovering.drop([1])
        await loading

    recovering = PartitionStore("t", topic, config)
    asyncio.run(revoke_while_loading(recovering))
    assert recovering.parts == {0: {"a": {"n": 1}}}
    asyncio.run(recovering.ensure([1]))  # assigned again: read again
    assert recovering.parts == {0: {"a": {"n": 1}}, 1: {"b": {"n": 1}}}


@pytest.mark.parametrize("stage", ["correlate", "controls"])
def test_a_failed_batch_reloads_its_state_only_once_every_record_produced_before_is_acknowledged(kafka_bootstrap, catalogue, settings_for, stage):
    """A commit that failed half-way (after ``write_changes``, before its flush) leaves
    changelog records in the producer's queue. The agent's reset acknowledges them before it
    drops the partition's state, so the reload reads a changelog that holds them (a record
    landing after the reload would be missing from the reloaded layout)."""
    from types import SimpleNamespace

    from streams.app import WorkerContext, ensure_run_topics
    from streams.controls.agents import Controller
    from streams.correlate.agents import Correlator
    from streams.correlate.entities import new_entity

    settings = settings_for(catalogue)
    settings.streams.app_id = f"reset-{uuid.uuid4().hex[:6]}"
    ensure_run_topics(settings)
    key = "pod/ml/p1"
    if stage == "correlate":
        state = {**new_entity(key), "interests": ["release/r1"]}
    else:
        state = {"rows": {"r1": {"at": "2026-11-01T08:00:00+00:00"}}, "interests": ["release/r1"]}

    async def run():
        ctx = WorkerContext(settings)
        agent = Correlator(ctx) if stage == "correlate" else Controller(ctx)
        topic = ctx.run.route if stage == "correlate" else ctx.run.controls
        await agent.store.ensure({1})
        agent.store.put(1, key, state)
        written = agent.store.write_changes(ctx.output)  # the commit fails here, before its flush
        queued = len(ctx.output._inflight)
        await agent.reset([SimpleNamespace(message=SimpleNamespace(topic=topic, partition=1))])
        left = len(ctx.output._inflight)
        dropped = 1 not in agent.store.parts
        await agent.store.ensure({1})
        recovered = agent.store.get(1, key)
        ctx.output.close()
        return written, queued, left, dropped, recovered

    written, queued, left, dropped, recovered = asyncio.run(run())
    assert written >= 1 and queued >= written  # records were waiting for their acks when the batch failed
    assert left == 0  # the reset waited for every one
    assert dropped  # and the partition's state was reloaded from the changelog
    assert recovered == state


def _workload_control_key(pods: int) -> tuple[str, dict]:
    """The controls stage's key of a workload of ``pods`` pods (each scheduled and deleted), as the
    worker's functions build it: a link per pod holding its scheduler rows."""
    from streams.controls.policy import Policy
    from streams.controls.rules import ControlEngine
    from tests.streams.harness import Driver, pod_event, release

    events = [release("release.registered", 0, rid="r1"), release("release.approved", 0.1, rid="r1"),
              pod_event("scheduler.admitted", 0.5, pod=None, workload="ml/Deployment/srv", release_id="r1")]
    for i in range(pods):
        events += [pod_event("scheduler.scheduled", 1 + i * 0.01, pod=f"srv-{i}", workload="ml/Deployment/srv", release_id="r1"),
                   pod_event("scheduler.deleted", 1.006 + i * 0.01, pod=f"srv-{i}", workload="ml/Deployment/srv", release_id="r1")]
    driver = Driver().feed(events).flush_parked()
    engine = ControlEngine(driver.directory, Policy())
    engine.feed(driver.rows.values()).run()
    return "wl:ml/Deployment/srv", engine.states["wl:ml/Deployment/srv"]


def _put_through_stage(settings, make, key: str, state: dict) -> tuple[int, int, _Layout | None, object]:
    """Put ``state`` under ``key`` in partition 0 of a new ``make`` (a stage's agent: ``Controller``,
    ``Correlator``) store and write it to the run's changelog: the records written, the output's dead
    letters, the key's chunk layout, the run's topics."""
    from streams.app import WorkerContext

    async def write():
        ctx = WorkerContext(settings)
        agent = make(ctx)
        await agent.store.ensure({0})
        agent.store.put(0, key, state)
        written = agent.store.write_changes(ctx.output)
        await ctx.output.flush()
        ctx.output.close()
        return written, ctx.output.dead_letters, agent.store._layouts[0].get(key), ctx.run

    return asyncio.run(write())


def test_a_workload_control_key_of_over_a_thousand_pods_is_written_and_recovered_whole(kafka_bootstrap, catalogue, settings_for):
    """A workload's control key holds every one of its pods' scheduler rows (a link per pod, ~0.9 KB):
    1,200 pods are over 1 MB. Written as one record it was refused by the broker and dead-lettered, and
    the key started without it after a restart (``benchmarks/state_growth.py``: ~1,080 pods). The
    controls store writes links and violations in chunks (``control_chunks``): every record fits, and
    another Controller recovers the key whole."""
    from streams.app import WorkerContext, ensure_run_topics
    from streams.controls.agents import Controller

    key, state = _workload_control_key(1200)
    assert len(state["links"]) == 1200 and len(orjson.dumps(state)) > 1_000_000
    settings = settings_for(catalogue)
    settings.streams.app_id = f"big-ctl-{uuid.uuid4().hex[:6]}"
    ensure_run_topics(settings)

    async def recover():
        ctx = WorkerContext(settings)
        agent = Controller(ctx)
        await agent.store.ensure({0})
        got = agent.store.get(0, key)
        ctx.output.close()
        return got

    written, dead, _layout, _run = _put_through_stage(settings, Controller, key, state)
    assert dead == 0 and written > 100  # (1,200 links in chunks of 8, and the head)
    recovered = asyncio.run(recover())
    assert recovered == state and list(recovered["links"]) == list(state["links"])


def _crash_after_chunks(bootstrap: str, topic: str, partition: int, key: str, state: dict, chunks: Chunks, layout: _Layout) -> list[str]:
    """Write ``state``'s changed records as ``PartitionStore`` would (chunks, then its head) but lose the
    head — a crash between them — and return the chunk records' names."""
    from confluent_kafka import Producer

    records = encode_chunked(chunks, key, state, layout)
    producer = Producer({"bootstrap.servers": bootstrap})
    names = []
    for name, value in records:
        if SEP in name:
            producer.produce(topic, key=name.encode(), value=value, partition=partition)
            names.append(name)
    assert producer.flush(30) == 0
    return names


def test_a_key_whose_chunks_outlived_its_head_in_a_crash_is_handed_to_its_owner_after_the_load(kafka_bootstrap):
    """A key's chunks are written before its head: a crash between them leaves the newer chunks beside
    the older head. The state decodes whole, but what its owner derived into the head (interests,
    deadlines, sent versions) is the write before's, and the batch delivered again folds nothing new —
    nothing would derive it again. The load hands such keys to the owner (``take_late``: its refresh or
    tick), once; a key whose head came last is not handed over."""
    topic, config, output = _setup(kafka_bootstrap)
    shape = Chunks({"links": (), "emitted": ()}, size=4)
    store = PartitionStore("t", topic, config, chunks=shape)
    asyncio.run(store.ensure([0, 1]))
    crashed = {"key": "wl:ml/big", "interests": ["rid:r1"], "links": {f"pod:ml/p{i}": {"v": 1, "rows": [i]} for i in range(10)}, "emitted": {}}
    fine = {"key": "wl:ml/other", "interests": ["rid:r1"], "links": {f"pod:ml/q{i}": {"v": 1, "rows": [i]} for i in range(10)}, "emitted": {}}
    assert _write(store, output, {(0, crashed["key"]): crashed, (0, fine["key"]): fine}) == 2 * 3  # (two chunks and a head each)
    output.close()
    assert store.take_late() == set()  # (nothing loaded from the changelog yet)

    # The next epoch: a sealed link of each replaced and a new release named in the head; the first
    # key's head is lost in a crash, the second one's written.
    layout = store._layouts[0][crashed["key"]]
    changed = {**crashed, "interests": ["rid:r1", "rid:r2"], "links": {**crashed["links"], "pod:ml/p0": {"v": 2, "rows": [0, 99]}}}
    assert [n.split(SEP)[1] for n in _crash_after_chunks(kafka_bootstrap, topic, 0, crashed["key"], changed, shape, layout)] == ["links0"]
    fine2 = {**fine, "interests": ["rid:r1", "rid:r2"], "links": {**fine["links"], "pod:ml/q0": {"v": 2, "rows": [0, 99]}}}
    output = BatchOutput(config, "store-test", f"{topic}.dead")
    store.put(0, fine["key"], fine2)
    store.write_changes(output)
    asyncio.run(output.flush())
    output.close()

    recovered = PartitionStore("t", topic, config, chunks=shape)
    asyncio.run(recovered.ensure([0, 1]))
    state = recovered.get(0, crashed["key"])
    assert state["links"]["pod:ml/p0"] == {"v": 2, "rows": [0, 99]} and state["interests"] == ["rid:r1"]  # the chunk's, the old head's
    assert recovered.take_late() == {crashed["key"]}
    assert recovered.take_late() == set()  # handed over once


def test_no_snapshot_is_written_of_a_partition_whose_late_keys_were_not_handed_over(kafka_bootstrap, tmp_path):
    """A snapshot holds no record order: a partition loaded from one would not find a key whose
    chunks outlived its head again. So until the owner has taken them (``take_late``), its partition
    is not snapshotted — a restart reads its changelog and finds them again."""
    topic, config, output = _setup(kafka_bootstrap)
    shape = Chunks({"links": (), "emitted": ()}, size=4)
    store = PartitionStore("t", topic, config, chunks=shape)
    asyncio.run(store.ensure([0, 1]))
    state = {"key": "wl:ml/big", "interests": ["rid:r1"], "links": {f"pod:ml/p{i}": {"v": 1, "rows": [i]} for i in range(10)}, "emitted": {}}
    _write(store, output, {(0, state["key"]): state})
    output.close()
    changed = {**state, "interests": ["rid:r1", "rid:r2"], "links": {**state["links"], "pod:ml/p0": {"v": 2, "rows": [0, 99]}}}
    _crash_after_chunks(kafka_bootstrap, topic, 0, state["key"], changed, shape, store._layouts[0][state["key"]])

    output = BatchOutput(config, "store-test", f"{topic}.dead")
    recovered = _snap_store(topic, config, tmp_path, shape)
    recovered.follow(output)
    asyncio.run(recovered.ensure([0, 1]))
    not_saved = recovered.save_snapshots()
    assert set(not_saved) == {0} and "take_late" in not_saved[0]  # partition 1 (nothing late) is
    assert recovered.take_late() == {state["key"]}
    assert recovered.save_snapshots() == {}
    output.close()


@pytest.mark.parametrize("stage", ["correlate", "controls"])
def test_a_key_whose_chunks_outlived_its_head_is_derived_again_after_a_restart(kafka_bootstrap, catalogue, settings_for, stage):
    """Each stage's housekeeping re-derives the keys its store hands over after a load (``take_late``):
    the correlation stage refreshes the entity, the controls stage ticks the key — its interests,
    deadline, sent versions and violations derived again from its rows and links (a crash had left the
    head of the write before)."""
    from streams.app import WorkerContext, ensure_run_topics
    from streams.controls.agents import Controller, control_chunks
    from streams.correlate.agents import Correlator, entity_chunks
    from streams.correlate.entities import new_entity
    from streams.packing import unpack

    if stage == "controls":
        key, state = _workload_control_key(20)
        field, shape, make = "links", control_chunks(8, 16), Controller
    else:
        key = "gpu:n1/GPU-1"
        state = {**new_entity(key), "rows": {f"e{i}": {"id": f"e{i}", "parked": False, "expired": False, "payload": "x"} for i in range(20)}}
        field, shape, make = "rows", entity_chunks(8, 16), Correlator
    settings = settings_for(catalogue)
    settings.streams.app_id = f"late-{stage}-{uuid.uuid4().hex[:6]}"
    ensure_run_topics(settings)

    _written, _dead, layout, run_topics = _put_through_stage(settings, make, key, state)
    first = next(iter(state[field]))
    changed = {**state, field: {**state[field], first: {**state[field][first], "v": 7}}}  # (a sealed item replaced)
    changelog = run_topics.controls_changelog if stage == "controls" else run_topics.entities_changelog
    assert _crash_after_chunks(kafka_bootstrap, changelog, 0, key, changed, shape, layout)

    async def restart():
        ctx = WorkerContext(settings)
        ctx.directory.ready.set()
        agent = make(ctx)
        await agent.store.ensure({0})
        await agent.housekeeping()
        ctx.output.close()
        return agent.stats.get("control_late_chunk_ticks" if stage == "controls" else "late_chunk_refreshes")

    assert asyncio.run(restart()) == 1
    topic = run_topics.controls if stage == "controls" else run_topics.route
    sent = [(k, body) for m in read_topic(kafka_bootstrap, topic, min_count=1) for k, body in unpack(m.value())]
    assert (key, {"k": "tick"} if stage == "controls" else {"k": "refresh"}) in sent


def test_a_rebalance_gives_partitions_up_only_once_every_record_produced_before_is_acknowledged(kafka_bootstrap, catalogue, settings_for):
    """The worker's revocation handler (``streams.app.create_app``) acknowledges what this worker
    produced before it drops the revoked partitions' state — here a changelog record queued by a
    commit that Faust's own wait did not see through — so their next owner reads it."""
    from faust.types import TP

    from streams.app import create_app, ensure_run_topics
    from streams.correlate.entities import new_entity

    settings = settings_for(catalogue)
    settings.streams.app_id = f"revoke-{uuid.uuid4().hex[:6]}"
    ensure_run_topics(settings)
    key = "pod/ml/p1"
    state = new_entity(key)

    async def run():
        app = create_app(settings)
        ctx = app.gpuledger
        store = ctx.correlator.store
        await store.ensure({2})
        store.put(2, key, state)
        written = store.write_changes(ctx.output)
        queued = len(ctx.output._inflight)
        await app.on_partitions_revoked.send({TP(ctx.run.route, 2)})
        left, kept = len(ctx.output._inflight), 2 in store.parts
        records = await asyncio.to_thread(read_topic, kafka_bootstrap, ctx.run.entities_changelog, 1, 10.0, 0.2)
        ctx.output.close()
        return written, queued, left, kept, records

    written, queued, left, kept, records = asyncio.run(run())
    assert written >= 1 and queued >= written
    assert left == 0 and not kept  # acknowledged, then the partition's state dropped
    assert [(m.partition(), m.key().decode()) for m in records] == [(2, key)]


STATE_WAIT_SCRIPT = r"""
import asyncio, sys
from types import SimpleNamespace
import streams.runner
from streams.runner import Epoch
from streams.store import PartitionStore

streams.runner.STATE_WAIT_S = 2.0  # the bound under test (60 s in the worker)
bootstrap, changelog = sys.argv[1], sys.argv[2]
store = PartitionStore("t", changelog, {"bootstrap.servers": bootstrap}, read_within_s=0.2)

async def handle(events):
    await store.ensure({ev.message.partition for ev in events})
    print("HANDLED", flush=True)

async def nothing(*_args):
    return None

def release(events):
    print("ACKED", len(events), flush=True)

events = [SimpleNamespace(message=SimpleNamespace(topic="in", partition=0, offset=o)) for o in range(3)]
epoch = Epoch("t", handle, nothing, lambda ev, exc: print("DEAD", flush=True) or nothing(), nothing, interval_s=0.0, hold=None,
              release=release)
asyncio.run(epoch.run_batch(events))
print("RETURNED", flush=True)
"""


def test_a_batch_that_waits_for_its_state_past_the_bound_ends_the_process_without_acking(kafka_bootstrap):
    """A waiting batch holds its acks, and Faust's rebalance waits for them: the wait is bounded
    (``STATE_WAIT_S``), after which the process exits as a crash would — code 75, nothing
    acked, nothing dead-lettered — and its restart reads the changelog afresh."""
    import subprocess
    import sys

    name = f"store-{uuid.uuid4().hex[:8]}.changelog"  # never created: the state can never be read
    proc = subprocess.run([sys.executable, "-c", STATE_WAIT_SCRIPT, kafka_bootstrap, name], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 75, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert proc.stdout == "", proc.stdout  # not handled, not acked, not dead-lettered, never returned
    assert "a batch's state could not be read for 2s" in proc.stderr and name in proc.stderr, proc.stderr[-2000:]


def test_a_commit_tail_writes_no_changelog_for_a_partition_given_up_while_it_waited(kafka_bootstrap, catalogue, settings_for):
    """A commit is taken (states encoded), its tail then waits for the epoch's outputs; if a
    revocation gives one of its partitions up meanwhile (``store.drop``), the tail writes the
    other partitions' records and none of that one's: it is its next owner's, who recovers
    from what was durable and re-processes the un-acked input."""
    from streams.app import WorkerContext, ensure_run_topics
    from streams.correlate.agents import Correlator
    from streams.correlate.entities import new_entity

    settings = settings_for(catalogue)
    settings.streams.app_id = f"tail-{uuid.uuid4().hex[:6]}"
    ensure_run_topics(settings)
    kept, given_up = "pod/ml/kept", "pod/ml/given-up"

    async def run():
        ctx = WorkerContext(settings)
        corr = Correlator(ctx)
        await corr.store.ensure({0, 1})
        corr.store.put(0, kept, {**new_entity(kept), "interests": ["release/r1"]})
        corr.store.put(1, given_up, {**new_entity(given_up), "interests": ["release/r2"]})
        tail = await ctx.commit_state("correlate", corr.store)  # taken: both encoded
        corr.forget({1})  # the revocation, before the tail ran
        await tail
        ctx.output.close()

    asyncio.run(run())
    topic = settings.kafka.catalogue().run(settings.streams.app_id).entities_changelog
    keys = {(m.partition(), m.key().decode()) for m in read_topic(kafka_bootstrap, topic, min_count=1)}
    assert (0, kept) in keys
    assert not any(key == given_up for _p, key in keys)


@pytest.mark.parametrize("chunked", [False, True])
def test_the_owner_is_told_of_each_state_written_and_only_of_those(chunked):
    """``on_written`` (the entities' ``state_written``: ids let go may be forgotten once written
    twice) is called with every state whose record was just built — not with one put again
    unchanged (no record), nor with a deleted key."""
    told = []
    store = PartitionStore("entities", "unused.changelog", {}, chunks=CHUNKS if chunked else None,
                           on_written=lambda state: told.append(state["key"]))
    store.start_empty([0])
    a, b = _entity(2, 0), {**_entity(2, 0), "key": "gpu:n1/GPU-b"}
    store.put(0, a["key"], a)
    store.put(0, b["key"], b)
    out = _Recorded()
    store.write_changes(out)
    assert sorted(told) == sorted([a["key"], b["key"]]) and len(out.records) >= 2
    told.clear()
    store.put(0, a["key"], a)  # unchanged: no record, not told
    store.delete(0, b["key"])  # a tombstone: no state to tell of
    out = _Recorded()
    store.write_changes(out)
    assert told == [] and [v for _k, v in out.records] == [None]


# --- local snapshots (streams.snapshot) ---------------------------------------------------------

def _snap_store(topic, config, where, shape, loads=None, **kw) -> PartitionStore:
    from streams.snapshot import SnapshotDir

    return PartitionStore("t", topic, config, chunks=shape, summarize=_summary, snapshots=SnapshotDir(where, topic) if where else None,
                          on_load=(lambda p, s: loads.append((p, s))) if loads is not None else None, **kw)


def _everything(store: PartitionStore) -> dict:
    """Every state of the store, decoded, by partition (a fresh copy: decoding warms cold states)."""
    return {p: orjson.loads(orjson.dumps(store.states(p))) for p in sorted(store.parts)}


@pytest.mark.parametrize("shape", [None, ENTITY_CHUNKS], ids=["whole-states", "entity-chunks"])
def test_a_snapshot_stands_for_its_changelog_up_to_its_offset_and_only_the_records_after_it_are_read(kafka_bootstrap, tmp_path, shape):
    """A store's snapshots, written when every state is written and acknowledged, load into the
    same states, summaries and kinds as its changelog read whole — without reading a record of
    it; records written after a snapshot (changed, deleted, chunks sealed and emptied) are read
    on top of it, and that again equals the changelog read whole."""
    topic, config, output = _setup(kafka_bootstrap)
    pods = {(i % 2, f"pod:ml/p{i}"): {"key": f"pod:ml/p{i}", "interests": [f"rid:r{i}"], "rows": {f"e{i}": {"id": f"e{i}", "parked": i % 3 == 0}}}
            for i in range(8)}
    big = _entity(13, 3) if shape else {"key": "gpu:n1/GPU-1", "interests": ["rid:r1"], "rows": {}}
    first = PartitionStore("t", topic, config, chunks=shape, summarize=_summary)
    asyncio.run(first.ensure([0, 1]))
    _write(first, output, {**pods, (0, big["key"]): big, (1, "~directory"): {"key": "~directory", "covered": {"r1": 3}}})

    # A store that recovered them (cold states), changed some (warm, one deleted) and wrote that.
    writer = _snap_store(topic, config, tmp_path, shape)
    writer.follow(output)
    asyncio.run(writer.ensure([0, 1]))
    assert writer.health()["cold"] == (8 if shape else 9)  # a state in chunks is decoded at once
    grown = writer.get(0, big["key"])
    grown["rows"].update({f"n{i}": {"id": f"n{i}", "parked": False} for i in range(5)})
    touched(grown["rows"], "e0")
    _write(writer, output, {(0, big["key"]): grown, (1, "pod:ml/p1"): {"key": "pod:ml/p1", "interests": [], "rows": {}}, (0, "pod:ml/p2"): None})
    assert writer.save_snapshots() == {} and writer.health()["snapshots"]["saved_partitions"] == 2

    loads, whole_loads = [], []
    snapped = _snap_store(topic, config, tmp_path, shape, loads)
    asyncio.run(snapped.ensure([0, 1]))
    whole = _snap_store(topic, config, None, shape, whole_loads)
    asyncio.run(whole.ensure([0, 1]))
    assert snapped.loaded_records == 0 and whole.loaded_records > 0
    assert snapped.health()["snapshots"]["loaded_partitions"] == 2 and snapped.health()["kinds"] == whole.health()["kinds"]
    assert sorted(loads, key=repr) == sorted(whole_loads, key=repr)
    # kept encoded, as a changelog read keeps them — and a state in chunks too, which a changelog read decodes at once
    assert snapped.health()["cold"] == whole.health()["cold"] + (1 if shape else 0) and whole.health()["cold"] > 0
    assert _everything(snapped) == _everything(whole) == _everything(writer)
    assert _write(snapped, output, {(0, big["key"]): snapped.get(0, big["key"])}) == 0  # what the changelog holds already

    # Written after the snapshot: a change, a delete, rows detached (a chunk emptied) and added.
    tail = _snap_store(topic, config, tmp_path, shape)
    asyncio.run(tail.ensure([0, 1]))
    state = tail.get(0, big["key"])
    for i in range(8):
        state["rows"].pop(f"e{i}", None)
        (state.get("sent") or {}).pop(f"e{i}", None)
    state["rows"].update({f"m{i}": {"id": f"m{i}", "parked": True} for i in range(9)})
    written = _write(tail, output, {(0, big["key"]): state, (1, "pod:ml/p3"): None, (0, "pod:ml/p4"): {"key": "pod:ml/p4", "interests": ["x"], "rows": {}}})
    loads, whole_loads = [], []
    after = _snap_store(topic, config, tmp_path, shape, loads)
    asyncio.run(after.ensure([0, 1]))
    whole = _snap_store(topic, config, None, shape, whole_loads)
    asyncio.run(whole.ensure([0, 1]))
    assert after.loaded_records == after.health()["snapshots"]["tail_records"] == written > 0
    assert sorted(loads, key=repr) == sorted(whole_loads, key=repr)
    assert after.health()["cold"] == whole.health()["cold"]  # the state in chunks written after the snapshot: decoded at once
    assert _everything(after) == _everything(whole) == _everything(tail)
    output.close()


def test_a_state_in_chunks_kept_cold_from_a_snapshot_is_written_and_recovered_as_if_decoded(kafka_bootstrap, tmp_path):
    """A snapshot keeps a state in chunks encoded (its head and chunks) with the whole state's
    summary; put or deleted without being asked for, it writes what a decoded one would. A
    chunk written after the snapshot alone (its head unchanged) makes the next load decode the
    state — the snapshot's summary is not the state's any more."""
    topic, config, output = _setup(kafka_bootstrap)
    big = _entity(13, 3)
    first = _snap_store(topic, config, tmp_path, ENTITY_CHUNKS)
    first.follow(output)
    asyncio.run(first.ensure([0, 1]))
    assert _write(first, output, {(0, big["key"]): big, (0, "pod:ml/p0"): {"key": "pod:ml/p0", "interests": [], "rows": {}}}) > 2
    assert first.save_snapshots() == {}

    def from_snapshot(loads=None) -> PartitionStore:
        store = _snap_store(topic, config, tmp_path, ENTITY_CHUNKS, loads)
        store.follow(output)
        asyncio.run(store.ensure([0, 1]))
        return store

    # put again unchanged without being asked for: nothing written; kept cold, a snapshot written from it loads the same
    loads = []
    cold = from_snapshot(loads)
    assert cold.health()["cold"] == 2 and cold.loaded_records == 0 and dict(loads)[0][big["key"]] == _summary(big)
    assert _write(cold, output, {(0, big["key"]): orjson.loads(orjson.dumps(big))}) == 0
    again = from_snapshot()
    assert again.health()["cold"] == 2 and again.save_snapshots() == {} and _everything(from_snapshot()) == _everything(first)

    # a sealed row changed in place: only its chunk is written (the head is the same), and the next load decodes it
    warm = from_snapshot()
    state = warm.get(0, big["key"])
    state["rows"]["e1"]["parked"] = True
    touched(state["rows"], "e1")
    written = _write(warm, output, {(0, big["key"]): state})
    records = _records(kafka_bootstrap, topic, 1)
    assert written == 1 and records[-1][0].startswith(f"{big['key']}{SEP}rows")
    loads, whole_loads = [], []
    after = from_snapshot(loads)
    whole = _snap_store(topic, config, None, ENTITY_CHUNKS, whole_loads)
    asyncio.run(whole.ensure([0, 1]))
    assert after.health()["snapshots"]["tail_records"] == 1 and after.health()["cold"] == 1  # the pod only
    assert sorted(loads, key=repr) == sorted(whole_loads, key=repr) and ["e1"] == dict(loads)[0][big["key"]][1][:1]
    assert _everything(after) == _everything(whole) == _everything(warm)
    # (its chunk after its head: handed to its owner, whose housekeeping takes it — until then no snapshot)
    assert set(after.save_snapshots()) == {0} and after.take_late() == {big["key"]}
    assert after.save_snapshots() == {}

    # put changed without being asked for: what a decoded state's put writes (a row added: its head, no sealed chunk)
    changed = orjson.loads(orjson.dumps(after.get(0, big["key"])))
    changed["rows"]["z1"] = {"id": "z1", "parked": False}
    grown = from_snapshot()
    assert grown.health()["cold"] == 2 and _write(grown, output, {(0, big["key"]): changed}) == 1
    assert _records(kafka_bootstrap, topic, 1)[-1][0] == big["key"]
    whole = _snap_store(topic, config, None, ENTITY_CHUNKS)
    asyncio.run(whole.ensure([0, 1]))
    assert whole.get(0, big["key"]) == changed and grown.save_snapshots() == {}

    # deleted without being asked for: its head and every chunk tombstoned, as for a decoded state
    gone = from_snapshot()
    assert gone.health()["cold"] == 2
    layout = whole._layouts[0][big["key"]]
    assert _write(gone, output, {(0, big["key"]): None}) == len(layout.chunks) + 1
    fresh = _snap_store(topic, config, None, ENTITY_CHUNKS)
    asyncio.run(fresh.ensure([0, 1]))
    assert _everything(fresh) == {0: {"pod:ml/p0": {"key": "pod:ml/p0", "interests": [], "rows": {}}}, 1: {}}
    output.close()


def test_a_snapshot_that_cannot_stand_for_its_changelog_is_not_used_and_says_why(kafka_bootstrap, tmp_path, caplog):
    """Damaged, of another topic of the same name (deleted and created again), past the
    partition's end, or too old to have records after it (a tombstone among them may be
    compacted away): the changelog is read whole, and the reason is in the log and health.
    A file that names a class is refused without running it."""
    from streams.snapshot import SnapshotDir

    topic, config, output = _setup(kafka_bootstrap)
    writer = _snap_store(topic, config, tmp_path, None)
    writer.follow(output)
    asyncio.run(writer.ensure([0, 1]))
    _write(writer, output, {(p, f"pod:ml/p{p}"): {"key": f"pod:ml/p{p}", "interests": [], "rows": {}} for p in (0, 1)})
    assert writer.save_snapshots() == {}
    files = SnapshotDir(tmp_path, topic)
    good = files.path(0).read_bytes()

    def loaded(partition: int = 0) -> PartitionStore:
        store = _snap_store(topic, config, tmp_path, None)
        asyncio.run(store.ensure([partition]))
        assert store.states(partition) == {f"pod:ml/p{partition}": {"key": f"pod:ml/p{partition}", "interests": [], "rows": {}}}
        return store

    assert loaded().health()["snapshots"]["loaded_partitions"] == 1

    def rewritten(**change) -> None:
        snap = files.load(0)
        fields = {"offset": snap.offset, "topic_id": snap.topic_id, "written_at": snap.written_at, **change}
        files.save(0, fields["offset"], fields["topic_id"], [(k, v, snap.summaries.get(k)) for k, v in snap.records.items()],
                   written_at=fields["written_at"])

    cases = [
        (lambda: files.path(0).write_bytes(good.replace(b'"interests":[]', b'"interests":{}')), "damaged", "is damaged (checksum mismatch)"),
        (lambda: files.path(0).write_bytes(good[:-6]), "damaged", "is damaged (it ends early)"),
        (lambda: files.path(0).write_bytes(b"junk"), "not a snapshot", "is not a gpuledger state snapshot"),
        (lambda: rewritten(topic_id="AAAAAAAAAAAAAAAAAAAAAA"), "another topic", "the topic was deleted and created again"),
        (lambda: rewritten(offset=99), "offset outside the partition", "its offset 99 is outside the partition's offsets now (0-1)"),
    ]
    for damage, kind, reason in cases:
        files.path(0).write_bytes(good)
        damage()
        with caplog.at_level(logging.WARNING, logger="streams.store"):
            caplog.clear()
            store = loaded()
        health = store.health()["snapshots"]
        assert health["loaded_partitions"] == 0 and store.loaded_records == 1 and health["read_whole"] == {kind: 1}, health
        assert reason in caplog.text and "reading the partition's changelog whole" in caplog.text, caplog.text

    # old: used while nothing was written after it; not once something was
    files.path(0).write_bytes(good)
    rewritten(written_at=0.0)
    assert loaded().health()["snapshots"]["loaded_partitions"] == 1
    _write(writer, output, {(0, "pod:ml/other"): {"key": "pod:ml/other", "interests": [], "rows": {}}})
    store = _snap_store(topic, config, tmp_path, None)
    asyncio.run(store.ensure([0]))
    assert store.health()["snapshots"]["loaded_partitions"] == 0 and store.loaded_records == 2
    assert store.health()["snapshots"]["read_whole"] == {"too old for the records after it": 1}

    # a class named in the file: refused, never called
    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('ran')",))

    files.save(1, 1, files.load(1).topic_id, [("pod:ml/p1", Boom(), None)])
    store = loaded(1)
    assert store.health()["snapshots"]["loaded_partitions"] == 0 and store.health()["snapshots"]["read_whole"] == {"does not decode": 1}
    output.close()


def test_a_partition_whose_state_is_not_its_changelogs_fold_at_a_known_offset_is_not_snapshotted(kafka_bootstrap, tmp_path):
    """No snapshot of a partition with a state changed and not written, with a record of it in
    flight when it loaded, or whose changelog got another writer's records among this store's;
    the other partitions are written, and a snapshot already there is left as it was."""
    from streams.snapshot import SnapshotDir

    topic, config, output = _setup(kafka_bootstrap)
    store = _snap_store(topic, config, tmp_path, None)
    store.follow(output)
    output.produce(topic, b"pod:ml/early", orjson.dumps({"key": "pod:ml/early"}), partition=1)  # not acknowledged before the load
    asyncio.run(store.ensure([0, 1]))
    asyncio.run(output.flush())
    store.put(0, "pod:ml/dirty", {"key": "pod:ml/dirty", "interests": [], "rows": {}})
    assert store.save_snapshots() == {0: "1 changed state(s) not written to the changelog",
                                      1: "a changelog record of it was still in flight when it was loaded"}
    assert not SnapshotDir(tmp_path, topic).path(0).exists()
    store.write_changes(output)
    asyncio.run(output.flush())
    assert 0 not in store.save_snapshots() and SnapshotDir(tmp_path, topic).path(0).exists()

    other = BatchOutput(config, "another-writer", f"{topic}.dead")
    other.produce(topic, b"pod:ml/theirs", orjson.dumps({"key": "pod:ml/theirs"}), partition=0)
    asyncio.run(other.flush())
    other.close()
    before = SnapshotDir(tmp_path, topic).path(0).read_bytes()
    _write(store, output, {(0, "pod:ml/mine"): {"key": "pod:ml/mine", "interests": [], "rows": {}}})
    assert "another writer" in store.save_snapshots()[0]
    assert SnapshotDir(tmp_path, topic).path(0).read_bytes() == before
    output.close()


def test_a_snapshot_file_round_trips_its_records_across_frames_and_refuses_a_cut_or_foreign_one(tmp_path):
    """``SnapshotDir`` writes records a frame at a time (``FRAME_RECORDS``) and reads them back
    whole — values, summaries, the header — and refuses a file cut anywhere, another
    partition's file, or one whose records are not text keys to bytes."""
    from streams.snapshot import FRAME_RECORDS, SnapshotDir, SnapshotInvalid

    files = SnapshotDir(tmp_path, "t.changelog")
    n = 2 * FRAME_RECORDS + 7
    records = [(f"pod:ml/p{i}", orjson.dumps({"i": i, "pad": "x" * (i % 50)}), orjson.dumps([i]) if i % 3 else None) for i in range(n)]
    size = files.save(2, 4242, "topic-id", iter(records), written_at=123.0)
    assert size == files.path(2).stat().st_size
    snap = files.load(2)
    assert (snap.changelog, snap.partition, snap.offset, snap.topic_id, snap.written_at) == ("t.changelog", 2, 4242, "topic-id", 123.0)
    assert snap.records == {k: v for k, v, _ in records} and snap.summaries == {k: s for k, _, s in records if s is not None}
    assert files.load(0) is None and not list(tmp_path.rglob("*.tmp"))

    good = files.path(2).read_bytes()
    for cut in (len(good) // 3, len(good) - 5, len(good) - 1):
        files.path(2).write_bytes(good[:cut])
        with pytest.raises(SnapshotInvalid) as bad:
            files.load(2)
        assert bad.value.kind == "damaged", (cut, bad.value)
    files.path(2).write_bytes(good)
    files.path(3).write_bytes(good)
    with pytest.raises(SnapshotInvalid, match=r"is of t.changelog\[2\], not t.changelog\[3\]"):
        files.load(3)
    files.save(1, 0, "topic-id", [("k", "not bytes", None)])
    with pytest.raises(SnapshotInvalid, match=r"a record of str -> str \(NoneType\), not str -> bytes"):
        files.load(1)


def test_a_snapshot_is_written_only_of_what_the_changelog_holds(kafka_bootstrap, tmp_path):
    """Found by review, each a state a restart from the snapshot would have had and a whole read
    would not: an epoch commit encoded and never produced (its tail cancelled at the stop), a
    record Kafka refused (dead-lettered), a crash's orphaned chunks (a late head would meet
    placeholders). None of these partitions is snapshotted; and a state its owner changes after
    writing it (``on_written``: the entities' ``gone_w``) is snapshotted as it was written."""
    from producers._kafka import ensure_specs
    from schemas.topics import TopicSpec
    from streams.correlate.entities import state_written
    from streams.output import Deferred
    from streams.snapshot import SnapshotDir

    def pod(i: int, **extra) -> dict:
        return {"key": f"pod:ml/p{i}", "interests": [f"rid:r{i}"], "rows": {}, **extra}

    # an epoch commit taken (write_changes into its Deferred) whose tail never produced it
    topic, config, output = _setup(kafka_bootstrap)
    store = _snap_store(topic, config, tmp_path, None)
    store.follow(output)
    asyncio.run(store.ensure([0, 1]))
    _write(store, output, {(0, "pod:ml/p0"): pod(0, n=1)})
    store.put(0, "pod:ml/p0", pod(0, n=2))
    store.write_changes(Deferred())
    assert store.save_snapshots() == {0: "1 changelog record(s) of it encoded and never written"}
    output.close()

    # a record Kafka refused
    topic, config, _ = _setup(kafka_bootstrap)
    ensure_specs(config, [TopicSpec(f"{topic}.dead", 1, "key", -1, "delete", "output")], 1)
    small = BatchOutput(config, "store-test", f"{topic}.dead", max_message_bytes=100_000)
    store = _snap_store(topic, config, tmp_path, None)
    store.follow(small)
    asyncio.run(store.ensure([0, 1]))
    _write(store, small, {(0, "pod:ml/p0"): pod(0, n=1)})
    _write(store, small, {(0, "pod:ml/p0"): pod(0, n=2, big="x" * 150_000)})
    assert small.dead_letters == 1
    assert store.save_snapshots() == {0: "Kafka refused 1 changelog record(s) of it (dead-lettered): its state is not the changelog's"}
    small.close()

    # a crash's orphans: chunks without their head
    topic, config, output = _setup(kafka_bootstrap)
    first = _entity(16, 0)
    for name, value in encode_chunked(ENTITY_CHUNKS, first["key"], first, _Layout()):
        if SEP in name:
            output.produce(topic, name.encode(), value, partition=0)
    asyncio.run(output.flush())
    store = _snap_store(topic, config, tmp_path, ENTITY_CHUNKS)
    store.follow(output)
    asyncio.run(store.ensure([0, 1]))
    assert store.save_snapshots() == {0: "1 key(s) with a crash's orphaned chunks (their records are not in memory)"}

    # changed after it was written: the record, not the state in memory
    for shape in (None, ENTITY_CHUNKS):
        topic, config, output = _setup(kafka_bootstrap)
        where = tmp_path / ("chunked" if shape else "whole")
        store = _snap_store(topic, config, where, shape, on_written=state_written)
        store.follow(output)
        asyncio.run(store.ensure([0, 1]))
        big = {**_entity(13, 3), "gone_w": [5, 7], "gone_ids": list(range(12))}
        _write(store, output, {(0, big["key"]): big})
        assert store.get(0, big["key"])["gone_w"] == [0, 5]  # in memory, after the write
        assert store.save_snapshots() == {}
        snapped = _snap_store(topic, config, where, shape)
        asyncio.run(snapped.ensure([0]))
        whole = _snap_store(topic, config, None, shape)
        asyncio.run(whole.ensure([0]))
        assert _everything(snapped) == _everything(whole) and _everything(whole)[0][big["key"]]["gone_w"] == [5, 7]
        assert SnapshotDir(where, topic).load(0).offset == whole.health()["recovered_records"]
        output.close()


def test_a_snapshot_of_a_topic_deleted_and_created_again_after_the_load_is_not_written_as_the_new_ones(kafka_bootstrap, tmp_path):
    """The topic id a snapshot carries is the one its partition was loaded from (read at the load,
    not at the save): a changelog deleted and created again while the store held it gets no
    snapshot of the old topic's state under the new topic's id."""
    import time

    from confluent_kafka.admin import AdminClient

    from producers._kafka import ensure_specs
    from schemas.topics import TopicSpec
    from streams.snapshot import SnapshotDir

    topic, config, output = _setup(kafka_bootstrap)
    output.produce(topic, b"pod:ml/old", orjson.dumps({"key": "pod:ml/old"}), partition=0)
    asyncio.run(output.flush())
    store = _snap_store(topic, config, tmp_path, None)
    store.follow(output)
    asyncio.run(store.ensure([0]))
    old_id = store._loaded_at[0][2]
    admin = AdminClient(config)
    admin.delete_topics([topic])[topic].result()
    deadline = time.monotonic() + 30
    while True:  # until the broker lets the name be created again
        try:
            ensure_specs(config, [TopicSpec(topic, 2, "key", -1, "compact", "internal")], 1)
            break
        except Exception:
            assert time.monotonic() < deadline
            time.sleep(0.2)  # polling the broker: a deleted topic's name comes free with no notification
    assert store.save_snapshots() == {}  # nothing wrong with it as of its load...
    assert SnapshotDir(tmp_path, topic).load(0).topic_id == old_id  # ...so it carries the old topic's id
    fresh = _snap_store(topic, config, tmp_path, None)
    asyncio.run(fresh.ensure([0]))
    assert fresh.health()["snapshots"]["read_whole"] == {"another topic": 1} and fresh.states(0) == {}
    output.close()


def test_a_snapshot_holds_the_records_as_written_or_is_not_written(kafka_bootstrap, tmp_path):
    """Found by a second review. A chunk-only write of a state its owner changes after writing it
    (``on_written``) keeps the head it left unchanged, so the partition is still snapshotted — and
    equals the whole read, marks included. A state changed in memory and never put is not its
    record: the partition is not snapshotted. A snapshot discarded for a cold state that does not
    decode is not written again by a clean stop before the restart."""
    from streams.correlate.entities import state_written
    from streams.snapshot import SnapshotDir

    topic, config, output = _setup(kafka_bootstrap)
    first = _snap_store(topic, config, None, ENTITY_CHUNKS, on_written=state_written)
    asyncio.run(first.ensure([0, 1]))
    big = {**_entity(13, 3), "gone_w": [5, 7], "gone_ids": list(range(12))}
    _write(first, output, {(0, big["key"]): big})
    store = _snap_store(topic, config, tmp_path, ENTITY_CHUNKS, on_written=state_written)
    store.follow(output)
    asyncio.run(store.ensure([0, 1]))
    state = store.get(0, big["key"])
    state["rows"]["e1"]["parked"] = True  # a sealed row changed in place: its chunk only
    touched(state["rows"], "e1")
    assert _write(store, output, {(0, big["key"]): state}) == 1
    assert store.save_snapshots() == {}
    snapped = _snap_store(topic, config, tmp_path, ENTITY_CHUNKS)
    asyncio.run(snapped.ensure([0, 1]))
    whole = _snap_store(topic, config, None, ENTITY_CHUNKS)
    asyncio.run(whole.ensure([0, 1]))
    assert snapped.loaded_records == 0 and _everything(snapped) == _everything(whole)
    assert snapped._layouts[0][big["key"]].head == whole._layouts[0][big["key"]].head

    # changed in memory, never put
    gpu = {"key": "gpu:n1/GPU-1", "interests": [], "rows": {}, "links": {}, "sent": {}, "detached": 0}
    _write(store, output, {(1, gpu["key"]): gpu})
    store.get(1, gpu["key"])["detached"] += 1
    not_saved = store.save_snapshots()
    assert list(not_saved) == [1] and "is not its changelog record" in not_saved[1]

    # a snapshot whose cold state does not decode: discarded, and not written again
    topic, config, output = _setup(kafka_bootstrap)
    writer = _snap_store(topic, config, tmp_path, None)
    writer.follow(output)
    asyncio.run(writer.ensure([0, 1]))
    _write(writer, output, {(0, f"pod:ml/p{i}"): {"key": f"pod:ml/p{i}", "interests": [], "rows": {}} for i in range(3)})
    assert writer.save_snapshots() == {}
    files = SnapshotDir(tmp_path, topic)
    snap = files.load(0)
    files.save(0, snap.offset, snap.topic_id, [(k, b"{not json" if k == "pod:ml/p1" else v, snap.summaries.get(k)) for k, v in snap.records.items()],
               written_at=snap.written_at)  # a valid file with a value that is not a state
    reader = _snap_store(topic, config, tmp_path, None)
    reader.follow(output)
    asyncio.run(reader.ensure([0]))
    with pytest.raises(StateUnavailable, match="from its snapshot"):
        reader.get(0, "pod:ml/p1")
    assert not files.path(0).exists()
    assert reader.save_snapshots() == {0: "its snapshot held a state that does not decode (discarded)"} and not files.path(0).exists()
    output.close()


def test_a_cold_state_in_chunks_that_does_not_decode_is_unavailable_and_stays_cold():
    """A cold head and chunks whose bytes are JSON but not a state in chunks (a chunk that is not an
    object) is not there — ``StateUnavailable`` (the batch waits), whether a batch asks for it or
    puts or deletes it unasked — and it stays cold; never a raw error that would dead-letter input."""
    store = PartitionStore("t", "no-such-changelog", {}, chunks=ENTITY_CHUNKS, summarize=_summary)
    store.start_empty([0])
    store._cold[0]["gpu:n1/GPU-1"] = (b'{"key": "gpu:n1/GPU-1", "rows": {}}', {"rows0": b"[1, 2]"})
    for attempt in (lambda: store.get(0, "gpu:n1/GPU-1"), lambda: store.put(0, "gpu:n1/GPU-1", {"key": "gpu:n1/GPU-1"}),
                    lambda: store.delete(0, "gpu:n1/GPU-1")):
        with pytest.raises(StateUnavailable, match="gpu:n1/GPU-1.*does not decode: AttributeError"):
            attempt()
    assert store.health()["cold"] == 1 and store.health()["read_failures"] == 3 and store.parts[0] == {}
