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

Cold states (``summarize``): a restart's read was mostly decoding states no batch would
touch for a while (338 MB of JSON for 85,000 entities after 300,000 bench events). With
``summarize`` each state's record carries ``summarize(state)`` in a header
(``SUMMARY_HEADER``) — what the owner's indexes need of it (interests, parked rows,
deadlines) — and a recovery hands ``on_load`` the summaries and keeps each state as its
record's bytes (``_cold``) until ``get``/``put``/``delete`` asks for it. The summary is
computed from the state the record encodes, so it is exact for a state written whole. A
changelog's head beside sealed chunks carries no summary (a crash between its chunks and its
head could leave a head's summary older than a chunk), so a state in chunks read from the
changelog is decoded at once — as are ``DIRECTORY_MARK`` and a record without the header
(written before it existed), whose summaries are computed from the decoded state. A snapshot
holds the whole state's summary beside its head, exact because the snapshot holds every record
of it: a state in chunks loaded from a snapshot stays cold too (its head and chunks' bytes; they
were most of a restart's decoding), unless a record of it was read after the snapshot.

Big states (``Chunks``): an entity that keeps growing (a node/GPU collects every alert
and every pod that ever held it) would be re-encoded whole, and a whole record written,
every time a batch touches it — work and changelog bytes growing with its history (57 KB
per touch after 100,000 bench events, so ~8 KB of changelog per input event). With
``chunks`` the store writes the items of a state's big collections (entity rows, links)
in *sealed chunks* of ``Chunks.size`` items, each its own changelog record
(``<key>\x1f<field><n>``), written again only when one of its items changed; the newest
items stay in the state's own record (the *head*). A collection is chunked only once it
holds ``Chunks.seal_from`` items, so a small state (a pod's few rows) is still one
record, byte for byte what it was without chunks. A touch then costs the head, the open
items (fewer than ``size`` once the collection is chunked; below ``seal_from`` items, or
back below it after its oldest were detached, up to ``seal_from - 1``) and a cheap
comparison per sealed item. Within an epoch a key's chunks are produced before its
head, on the same partition, by the idempotent producer: a crash leaves a prefix, and a
recovery that finds an item in a chunk and in the head keeps the chunk's (the newer).

Limits: a state must encode below ``max_record_bytes``; callers bound their states
(``streams.correlate.entities._bound``). A state that still does not fit is refused
by Kafka and dead-lettered by the output (counted) — the entity then recovers without
it after a restart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from operator import methodcaller
from types import MappingProxyType

import orjson
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_exponential

from gpuledger import gctune
from sinks.retry import OutageLog
from schemas.topics import CHANGELOG_CONFIG
from streams.packing import kind_of, partition_for
from streams.snapshot import ChangelogAcks, Snapshot, SnapshotDir, SnapshotInvalid

log = logging.getLogger(__name__)


def _digest(value: bytes) -> int:
    """What a changelog record holds, to tell a state put again unchanged — kept in memory
    only, never written, so the interpreter's own hash serves: keyed per process (SipHash,
    64 bits) and 4-5x cheaper than a blake2b digest, which a restart computed for every
    record it read (a tenth of its time) and every epoch commit for every changed state.
    A changed state whose encoding hashes like its last record (and length) would not be
    written: 2^-64 per write.

    One int (the length above the hash's 64 bits), not a (length, hash) tuple: a dict of
    keys to ints is never tracked by the garbage collector, while one of tuples is
    untracked by each collection and tracked again by the next tuple put in it — so the
    collection after every epoch commit (``gctune.freeze``) walked every key of the store's
    marks again, a cost growing with the store (~40 % of that collection at 120,000 bench
    events)."""
    return (len(value) << 64) | (hash(value) & 0xFFFF_FFFF_FFFF_FFFF)


#: A changelog partition's offsets cannot be had *yet* (librdkafka does not flag all of these retriable).
_TRANSIENT = {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, KafkaError.UNKNOWN_TOPIC_OR_PART,
              KafkaError._TRANSPORT, KafkaError._TIMED_OUT}


def _watermarks(consumer: Consumer, tp: TopicPartition, within_s: float = 30.0) -> tuple[int, int]:
    """A changelog partition's offsets — retried for ``within_s`` while its leader moves or is
    not known yet (a just-created topic, a broker restarting); a lasting failure fails the load."""
    retrying = Retrying(retry=retry_if_exception(lambda exc: isinstance(exc, KafkaException)
                                                 and (exc.args[0].retriable() or exc.args[0].code() in _TRANSIENT)),
                        wait=wait_exponential(multiplier=0.05, max=1), stop=stop_after_delay(within_s), reraise=True)
    return retrying(consumer.get_watermark_offsets, tp, timeout=within_s)


#: A snapshot with changelog records written after it is used only this long after it was
#: written: half the changelog's ``delete.retention.ms`` (which the worker sets on it), after
#: which a tombstone among those records may be compacted away (``streams.snapshot``).
SNAPSHOT_TAIL_MAX_AGE_S = int(CHANGELOG_CONFIG["delete.retention.ms"]) / 1000 / 2


class StateUnavailable(RuntimeError):
    """A partition's state could not be read from its changelog (the broker away, the topic
    missing, a record that does not decode). Not the input's fault: the batch that needed
    the state waits and is handled again (``streams.runner``: retriable), never dead-lettered."""

    retriable = True


#: A stateful stage's bookkeeping key, one per partition of its store: the release-directory
#: marks its refreshes covered when the partition's state was last written (the correlation
#: and controls stages: a partition that loads catches up on the releases changed since).
DIRECTORY_MARK = "~directory"


class DirectoryMarks:
    """A stateful stage's ``DIRECTORY_MARK`` bookkeeping.

    The release directory is read whole at every start; taking that load for a change
    re-derived every entity and re-evaluated every control key on every restart (measured:
    36,000 entities and 22,000 control keys, all unchanged, seconds of a restarted worker's
    event loop). Instead each partition's changelog holds the release marks (per release: the
    correlation stage's event count, the controls stage's history digest) whose dependents'
    refreshes had been acknowledged when its state was last written, and a partition that
    loads catches up on the releases whose mark differs (every release, without a mark).

    Per partition, the mark its changelog held when it loaded (``loaded``) until its catch-up
    is acknowledged (``done``); what the last acknowledged refreshes covered (``covered``),
    written into each caught-up partition before an epoch's changelog when it changed (``write``)."""

    def __init__(self) -> None:
        self.marks: dict[int, dict | None] = {}
        self.caught_up: set[int] = set()
        self.covered: dict = {}
        self.written: dict[int, dict] = {}

    def loaded(self, partition: int, marker: dict | None) -> None:
        """``partition`` recovered with ``marker``, its ``DIRECTORY_MARK`` state (None: no mark)."""
        self.marks[partition] = marker.get("covered") if marker else None
        self.forget([partition], keep_mark=True)

    def catch_up(self, current: dict, dependents: Callable[[str], Iterable[str]], partitions: int) -> tuple[list[int], set[str]]:
        """The partitions loaded and not caught up yet, and those of their keys that depend
        (``dependents(release)``) on a release whose mark in ``current`` differs from the
        partition's (on every release, without a mark)."""
        catching = {p: mark for p, mark in self.marks.items() if p not in self.caught_up}
        keys: set[str] = set()
        per_release: dict[str, dict[int, list[str]]] = {}  # release -> its dependents by partition (asked once)
        for p, mark in catching.items():
            for rid, value in current.items():
                if mark is None or mark.get(rid) != value:
                    if rid not in per_release:
                        per_release[rid] = defaultdict(list)
                        for key in dependents(rid):
                            per_release[rid][partition_for(key, partitions)].append(key)
                    keys.update(per_release[rid].get(p, ()))
        return list(catching), keys

    def done(self, partitions, covered: dict) -> None:
        """This round's refreshes (and ``partitions``' catch-ups) are acknowledged: they cover ``covered``."""
        self.covered = covered
        self.caught_up.update(partitions)

    def forget(self, partitions, keep_mark: bool = False) -> None:
        for p in partitions:
            if not keep_mark:
                self.marks.pop(p, None)
            self.caught_up.discard(p)
            self.written.pop(p, None)

    def write(self, store: PartitionStore) -> None:
        for p in self.caught_up & set(store.parts):
            if self.written.get(p) is not self.covered:  # ``covered`` is a new object whenever it changes
                store.put(p, DIRECTORY_MARK, {"key": DIRECTORY_MARK, "covered": dict(self.covered)})
                self.written[p] = self.covered


#: Between a key and its chunk's name: a control character no entity key contains.
SEP = "\x1f"
#: The record header that carries a state's summary (``PartitionStore(summarize=...)``).
SUMMARY_HEADER = "gpuledger.summary"


class Chunks:
    """How a store splits big states (see the module docstring).

    ``fields``: the collections (dicts keyed by item id) to split, each with its
    *companions* — other collections of the state keyed by the same ids, stored with the
    item (an entity row's ``sent`` entry), holding entries of the field's items only (an entry
    goes when its item goes). ``volatile``: per field, the keys of an item
    that may change in place (an entity row's ``parked``/``expired``); anything else about
    an item changes only by replacing the item object. ``size``: items per sealed chunk;
    ``seal_from`` (default ``size``): a collection's items are sealed only once it holds at
    least this many — the open items, re-encoded in the head at every touch, stay fewer
    than ``size`` in a big state, while a small one is not split at all."""

    def __init__(self, fields: dict[str, tuple[str, ...]], volatile: dict[str, tuple[str, ...]] | None = None, size: int = 16,
                 seal_from: int | None = None, journal: tuple[str, ...] = ()) -> None:
        self.fields = fields
        self.volatile = volatile or {}
        self.size = size
        self.seal_from = max(size, seal_from or size)
        #: the collections (fields or companions) the store makes a ``Journal`` of itself when it
        #: writes a state; others are journaled only if whoever owns them made them one
        self.journal = journal


#: The tests set this: every sealed chunk is then looked at (``_token``) at every write as
#: well, and a chunk that changed without its journal saying so fails the write
#: (``GPULEDGER_STREAMS_VERIFY_JOURNAL=1`` sets it in a worker: ``streams.context``).
VERIFY_JOURNAL = False


class Journal(dict):
    """A chunked collection of a state (an entity's rows, their sent versions, its links) that
    notes the ids set, deleted or popped since the store last wrote the state (``journal``),
    so that a write looks only at the sealed chunks holding those ids. An item changed in
    place (an entity row's ``parked``/``expired``) is noted by ``touched``. Encoded (orjson)
    as the plain dict it is.

    Why: without it every sealed chunk of a written state was looked at at every write
    (``_token``, ~5 µs a chunk): a node/GPU entity touched every epoch, its history in dozens of
    chunks, cost the epoch commit — which holds the event loop — more with every alert it ever
    collected (512 GPUs of 48 chunks after 400,000 bench events: 0.19 s per commit to find that
    nothing old had changed; the most of a live commit's pause in ``make bench``)."""

    __slots__ = ("journal",)

    def __init__(self, items=(), /) -> None:
        super().__init__(items)
        self.journal: set = set(getattr(items, "journal", ()))  # rebuilt from a journal: what it noted still stands

    def __setitem__(self, key, value) -> None:
        dict.__setitem__(self, key, value)
        self.journal.add(key)

    def __delitem__(self, key) -> None:
        dict.__delitem__(self, key)
        self.journal.add(key)

    def pop(self, key, *default):
        self.journal.add(key)
        return dict.pop(self, key, *default)

    def popitem(self):
        key, value = dict.popitem(self)
        self.journal.add(key)
        return key, value

    def setdefault(self, key, default=None):
        if key not in self:
            self.journal.add(key)
        return dict.setdefault(self, key, default)

    def update(self, *args, **kwargs) -> None:
        other = dict(*args, **kwargs)
        dict.update(self, other)
        self.journal.update(other)

    def __ior__(self, other):
        self.update(other)
        return self

    def clear(self) -> None:
        self.journal.update(self)
        dict.clear(self)


_NOTHING: Mapping = MappingProxyType({})  # (one shared empty ``_Layout.seen``: most states are never chunked)


def touched(collection, key) -> None:
    """Note that ``collection[key]`` changed in place (a no-op for a plain dict, which the store
    looks at whole)."""
    journal = getattr(collection, "journal", None)
    if journal is not None:
        journal.add(key)


class _Layout:
    """Where a state's items are in the changelog (in memory; rebuilt on recovery)."""

    __slots__ = ("member", "chunks", "tokens", "seen", "head", "next")

    def __init__(self) -> None:
        self.member: dict[str, dict[str, str]] = {}    # field -> item id -> its chunk's tag ("rows3")
        self.chunks: dict[str, list[str]] = {}         # tag -> item ids, in state order
        self.tokens: dict[str, list] = {}              # tag -> what its record was written from
        self.seen: Mapping[str, Journal] = _NOTHING    # collection -> the Journal it was at the last write (cleared then)
        self.head: int | None = None                   # digest of the head record written
        self.next = 0                                  # the next chunk's number


def _token(chunks: Chunks, field: str, state: dict, ids: list[str]) -> list[tuple]:
    """What a chunk's record depends on: its item objects (compared by identity first, so
    this costs no encoding), each in-place field of them and its companions' entries — one
    tuple each, gathered by ``map`` over the ids. Every sealed chunk of a changed state is
    looked at on each write, and a node/GPU entity's are many: built item by item (a tuple
    per item) this was the store's fastest-growing cost as history piled up."""
    items = state[field]
    objs = tuple(map(items.__getitem__, ids))
    token = [objs]
    for name in chunks.volatile.get(field, ()):
        token.append(tuple(map(methodcaller("get", name), objs)))
    for companion in chunks.fields[field]:
        token.append(tuple(map((state.get(companion) or {}).get, ids)))
    return token


def _chunk_value(chunks: Chunks, field: str, state: dict, ids: list[str]) -> bytes:
    items = state[field]
    value = {field: {i: items[i] for i in ids}}
    for c in chunks.fields[field]:
        companion = state.get(c) or {}
        value[c] = {i: companion[i] for i in ids if i in companion}
    return orjson.dumps(value)


def encode_chunked(chunks: Chunks, key: str, state: dict, layout: _Layout, head_out: list | None = None) -> list[tuple[str, bytes | None]]:
    """The records to write for ``state`` (changed chunks, then the head if it changed),
    updating ``layout`` to what they hold."""
    out: list[tuple[str, bytes | None]] = []
    changed: set[str] = set()
    open_ids: dict[str, list[str]] = {}  # field -> its items in no sealed chunk, in state order (the head's)
    for field in chunks.fields:
        items = state.get(field) or {}
        member = layout.member.setdefault(field, {})
        # Items are only ever added at the end (dict order), so the open ones are a tail:
        # found walking back to the first sealed one, not by walking every item.
        open_ = []
        for i in reversed(items):
            if i in member:
                break
            open_.append(i)
        open_.reverse()
        if len(member) + len(open_) != len(items):
            # Items gone (an entity's oldest rows detached): their chunks change.
            for i in [i for i in member if i not in items]:
                tag = member.pop(i)
                layout.chunks[tag].remove(i)
                changed.add(tag)
            open_ = [i for i in items if i not in member]
        # Seal the oldest open items, a chunk at a time, while a whole chunk's worth is open
        # (once the collection is big enough to be chunked at all).
        while len(open_) >= chunks.size and len(items) >= chunks.seal_from:
            tag = f"{field}{layout.next}"
            layout.next += 1
            layout.chunks[tag] = open_[:chunks.size]
            for i in layout.chunks[tag]:
                member[i] = tag
            changed.add(tag)
            open_ = open_[chunks.size:]
        open_ids[field] = open_
    noted = _noted(chunks, state, layout)
    # Every collection journaled: the chunks to look at are the ones sealed or emptied now and
    # those holding a noted id — not every chunk in turn (a node/GPU at its row cap keeps
    # hundreds: walking them cost a write ~0.3 ms of nothing). An empty chunk not emptied now
    # (the orphans of a recovery) is in a layout no journal noted yet (``orphaned``). With
    # ``VERIFY_JOURNAL`` every chunk is looked at, and one written outside that set fails.
    journaled = len(noted) == len(chunks.fields)
    if journaled and not VERIFY_JOURNAL:
        looked = sorted((tag for tag in changed.union(*noted.values()) if tag in layout.chunks), key=_number)
    else:
        looked = list(layout.chunks)
    for tag in looked:
        ids = layout.chunks[tag]
        field = tag.rstrip("0123456789")
        if not ids:
            if VERIFY_JOURNAL and journaled and tag not in changed:
                raise AssertionError(f"{key}{SEP}{tag} is empty but was not emptied by this write (a journaled write would not look at it)")
            del layout.chunks[tag]
            layout.tokens.pop(tag, None)
            out.append((f"{key}{SEP}{tag}", None))
            continue
        skip = tag not in changed and (tags := noted.get(field)) is not None and tag not in tags
        if skip and not VERIFY_JOURNAL:
            continue  # none of its items set, deleted or changed in place since the last write
        token = _token(chunks, field, state, ids)
        if tag not in changed and layout.tokens.get(tag) == token:
            continue
        if skip:
            raise AssertionError(f"{key}{SEP}{tag} changed without its journal noting it (streams.store.Journal, touched)")
        layout.tokens[tag] = token
        out.append((f"{key}{SEP}{tag}", _chunk_value(chunks, field, state, ids)))
    _journal_written(chunks, state, layout)
    head = _head(chunks, state, layout, open_ids)
    value = orjson.dumps(head)
    mark = _digest(value)
    if head_out is not None:
        head_out.append(value)  # (the head's record, written now or unchanged: what the changelog holds for the key)
    if mark != layout.head:
        layout.head = mark
        out.append((key, value))
    return out


def _noted(chunks: Chunks, state: dict, layout: _Layout) -> dict[str, set[str]]:
    """field -> the tags of its sealed chunks an item of which its journals noted since the
    state's last write — for each field whose collection and companions are all the very
    ``Journal`` objects that write left (any other object — a state decoded, a collection
    replaced — is looked at chunk by chunk)."""
    noted: dict[str, set[str]] = {}
    for field, companions in chunks.fields.items():
        ids: set[str] = set()
        for name in (field, *companions):
            collection = state.get(name)
            if collection is None or collection is not layout.seen.get(name):
                break
            ids |= collection.journal
        else:
            member = layout.member.get(field, {})
            noted[field] = {member[i] for i in ids if i in member}
    return noted


def _journal_written(chunks: Chunks, state: dict, layout: _Layout) -> None:
    """After a write: clear the journals it read; make a ``Journal`` of each collection the store
    journals itself (``Chunks.journal``) that is a plain dict (between batches: nobody holds it) —
    in a state with sealed chunks only: a small one (a pod's) is looked at whole at no cost, and
    a journal (a set) for each of a hundred thousand of them would cost memory for nothing."""
    if not layout.chunks:
        layout.seen = _NOTHING
        return
    seen: dict[str, Journal] = {}
    for field, companions in chunks.fields.items():
        for name in (field, *companions):
            collection = state.get(name)
            if type(collection) is dict and name in chunks.journal:
                collection = state[name] = Journal(collection)
            if isinstance(collection, Journal):
                collection.journal.clear()
                seen[name] = collection
    layout.seen = seen


def _head(chunks: Chunks, state: dict, layout: _Layout, open_ids: dict[str, list[str]]) -> dict:
    """The state without its sealed items (the state itself while nothing is sealed): of each
    chunked field and its companions, the entries of ``open_ids`` (the field's items in no
    sealed chunk, as ``encode_chunked`` found them). Built from those rather than by walking
    every item a node/GPU ever kept (its rows, their sent versions, its links: up to
    thousands, at every write — a commit's cost growing with the history). A companion holds
    entries of its field's items only (``entities``: a sent version is set for a row and goes
    with it), so its head entries are those of the open items, in the items' order — as a
    chunk's record orders them."""
    if not layout.chunks:
        return state
    head = dict(state)
    for field, companions in chunks.fields.items():
        ids = open_ids[field]
        for name in (field, *companions):
            if name in state:
                collection = state[name]
                head[name] = {i: collection[i] for i in ids if i in collection}
                if VERIFY_JOURNAL and head[name] != {i: v for i, v in collection.items() if i not in layout.member.get(field, {})}:
                    raise AssertionError(f"{state.get('key')}: the head's {name} is not the entries outside its sealed chunks "
                                         "(an entry of an item that is not in its field?)")
    return head


def _number(tag: str) -> int:
    return int(tag[len(tag.rstrip("0123456789")):])


def orphaned(tags: Iterable[str]) -> _Layout:
    """The layout of a key whose chunk records are in the changelog without a head: a crash
    during the key's first write, after its chunks and before its head. There is no state
    (the head is the state's record), so the key's input is processed again from scratch —
    and its next write may seal fewer chunks (other batch boundaries, rows detached), which
    would leave an old chunk under a name the new head does not overwrite, merged into the
    state by a later recovery. So the orphans are kept as empty chunks: the key's next write
    tombstones them (``encode_chunked`` drops an empty chunk) and numbers its own chunks
    after them."""
    layout = _Layout()
    for tag in sorted(tags, key=_number):
        layout.chunks[tag] = []
        layout.next = max(layout.next, _number(tag) + 1)
    return layout


def decode_chunked(chunks: Chunks, head: bytes, parts: dict[str, bytes]) -> tuple[dict, _Layout]:
    """A state and its layout from its head record and its chunks' (``tag -> value``)."""
    state = orjson.loads(head)
    layout = _Layout()
    layout.head = _digest(head)
    if not parts:
        return state, layout
    sealed: dict[str, dict] = {field: {} for field in chunks.fields}
    companions: dict[str, dict] = {c: {} for cs in chunks.fields.values() for c in cs}

    for tag in sorted(parts, key=_number):
        field = tag.rstrip("0123456789")
        if field not in chunks.fields:
            continue
        value = orjson.loads(parts[tag])
        ids = list(value.get(field, {}))
        sealed[field].update(value.get(field, {}))
        for c in chunks.fields[field]:
            companions[c].update(value.get(c, {}))
        layout.chunks[tag] = ids
        for i in ids:
            layout.member.setdefault(field, {})[i] = tag
        layout.next = max(layout.next, _number(tag) + 1)
    for field, items in sealed.items():
        # Sealed items first (they are the oldest); an item also in the head is a crash's
        # leftover from before it was sealed: the chunk's copy is the newer.
        state[field] = {**items, **{i: v for i, v in (state.get(field) or {}).items() if i not in items}}
        for c in chunks.fields[field]:
            state[c] = {**companions[c], **{i: v for i, v in (state.get(c) or {}).items() if i not in companions[c]}}
    for tag, ids in layout.chunks.items():
        layout.tokens[tag] = _token(chunks, tag.rstrip("0123456789"), state, ids)
    return state, layout


class PartitionStore:
    def __init__(self, name: str, changelog: str, consumer_config: dict, on_load: Callable[[int, dict], None] | None = None,
                 chunks: Chunks | None = None, loading: asyncio.Lock | None = None,
                 summarize: Callable[[dict], object] | None = None, read_within_s: float = 30.0,
                 on_written: Callable[[dict], None] | None = None, snapshots: SnapshotDir | None = None,
                 snapshot_tail_max_age_s: float = SNAPSHOT_TAIL_MAX_AGE_S) -> None:
        self.name = name
        self.read_within_s = read_within_s  # how long a changelog's offsets are asked for before a load fails
        self.outage = OutageLog(log, f"{name} store: reading {changelog}")  # a failing read: logged once per outage
        self.chunks = chunks
        self.changelog = changelog
        self._consumer_config = consumer_config
        self._on_load = on_load
        # ``summarize``: what ``on_load`` needs of a state (its owner's indexes), written in a
        # header of the state's record, so that a recovery hands ``on_load`` the summaries and
        # keeps the states themselves encoded (``_cold``) until a batch asks for one — see
        # "Cold states" in the module docstring. Without it ``on_load`` gets the states.
        self._summarize = summarize
        # ``on_written``: told of every state just encoded for the changelog (after its record
        # was built), so that its owner can let go of what only an unwritten state needed.
        self._on_written = on_written
        self.parts: dict[int, dict[str, dict]] = {}
        # Per loaded partition: key -> its record's bytes (a state in chunks: its head's and its chunks' by
        # tag), a state recovered and not asked for yet.
        self._cold: dict[int, dict[str, bytes | tuple[bytes, dict[str, bytes]]]] = {}
        # ...and the summary header its record carried (a snapshot writes it again: ``save_snapshots``).
        self._cold_summaries: dict[int, dict[str, bytes]] = {}
        # Per loaded partition: the keys whose changelog held a chunk record after their head's last one (``take_late``).
        self._late: dict[int, set[str]] = {}
        self.decoded_cold = 0
        self._dirty: dict[int, set[str]] = defaultdict(set)
        # What the changelog holds for each key (``_digest`` of the record's bytes): a key put
        # again with the same state (re-evaluated, nothing changed) is not written again.
        self._written: dict[int, dict[str, int]] = defaultdict(dict)
        self._layouts: dict[int, dict[str, _Layout]] = defaultdict(dict)  # with ``chunks``: instead of ``_written``
        self.unchanged_skipped = 0
        self.loaded_records = 0
        self._kinds: Counter[str] = Counter()  # keys in memory by kind (health), kept as keys come and go
        self.load_seconds = 0.0
        # When the last load ended (time.monotonic(): one clock for every process on the
        # machine, so make bench can place it in a restart).
        self.last_loaded_at: float | None = None
        # One read at a time — shared by a worker's stores (``loading``), so that the first
        # one asked for (the entities, which a restart's first batch waits for) is not slowed
        # by the other's running beside it. A caller that needs partitions this store is
        # loading waits on the store's own lock, not on the shared one: behind the shared one
        # (first come, first served) a restart's first batch waited for the other store's
        # whole load after its own partitions had arrived.
        self._reading = loading or asyncio.Lock()
        self._loading = asyncio.Lock()
        self._drops: dict[int, int] = defaultdict(int)  # per partition: how often it was dropped
        # Local snapshots (``streams.snapshot``): where they are (None: not used), what the
        # changelog's writes were when each partition loaded (``_loaded_at``: its end offset then
        # and ``ChangelogAcks.at`` then; None when a record of it was in flight), the changelog's
        # topic id (a snapshot of another topic of the same name is not used).
        self.snapshots = snapshots
        self.snapshot_tail_max_age_s = snapshot_tail_max_age_s
        self._acks: ChangelogAcks | None = None
        self._loaded_at: dict[int, tuple | None] = {}  # (end offset, ChangelogAcks.at, topic id) at the load
        self._emitted: dict[int, int] = defaultdict(int)  # changelog records encoded per partition since it loaded
        # Per partition: key -> (record value, summary header) of a state its owner changed after
        # writing it (``on_written`` said so): a snapshot holds what the changelog holds.
        self._record_bytes: dict[int, dict[str, tuple[bytes, bytes | None]]] = defaultdict(dict)
        self._from_snapshot: set[int] = set()  # partitions whose state the last load took from a snapshot
        self._not_saveable: dict[int, str] = {}  # partition -> why no snapshot of it may be written until it loads again
        self.snapshot_stats: dict = {"loaded": 0, "tail_records": 0, "read_whole": Counter(), "read_seconds": 0.0, "saved": 0,
                                     "saved_bytes": 0, "not_saved": {}, "save_seconds": 0.0}

    def follow(self, output) -> None:
        """Count what ``output`` (a ``streams.output.BatchOutput``) writes to this store's changelog
        — what ``save_snapshots`` needs to know that a partition's state is its changelog's fold."""
        self._acks = output.track(self.changelog)

    # --- recovery -----------------------------------------------------------------------
    def prefetch(self, partitions: Iterable[int]) -> asyncio.Future:
        """``ensure(partitions)`` in the background: a stage recovers a new assignment's state
        while it starts, rather than when its first batch needs it. A failure is logged; the
        first batch that needs the state loads it again. A partition revoked before its load
        ends is not kept (``ensure``)."""
        task = asyncio.ensure_future(self.ensure(partitions))
        task.add_done_callback(self._prefetched)
        return task

    def _prefetched(self, task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.warning("%s store: recovering state after the rebalance failed (%s); the first batch that needs it loads it again",
                        self.name, task.exception())

    async def ensure(self, partitions: Iterable[int]) -> None:
        """Load every partition in ``partitions`` that is not in memory yet."""
        if not set(partitions) - set(self.parts):
            return
        async with self._loading:
            missing = sorted(set(partitions) - set(self.parts))
            if missing:
                drops = dict(self._drops)
                async with self._reading:
                    try:
                        loaded = await asyncio.to_thread(self._read, missing)
                    except Exception as exc:  # noqa: BLE001 - whatever failed, the state is not there: the batch must wait
                        failure = StateUnavailable(f"{self.name} store: reading {self.changelog} partition(s) {missing} failed: "
                                                   f"{type(exc).__name__}: {exc}")
                        self.outage.failed(failure)
                        raise failure from exc
                self.outage.succeeded()
                for p in missing:
                    if self._drops.get(p) != drops.get(p):
                        # Revoked while it loaded: what was read may be stale by the time the
                        # partition comes back (another worker wrote to it); load it again then.
                        continue
                    self.parts[p], self._cold[p], marks, summaries, self._cold_summaries[p], self._loaded_at[p], self._late[p] = loaded[p]
                    self._emitted[p] = 0
                    self._record_bytes.pop(p, None)
                    self._not_saveable.pop(p, None)
                    self._kinds.update(kind_of(k) for k in self.parts[p])
                    self._kinds.update(kind_of(k) for k in self._cold[p])
                    if self.chunks is None:
                        self._written[p] = marks
                    else:
                        self._layouts[p] = marks
                    if self._on_load is not None:
                        self._on_load(p, summaries if self._summarize is not None else self.parts[p])

    def _read(self, partitions: list[int]) -> dict[int, tuple]:
        with gctune.bulk(freeze=False):  # the decode below freezes what it loaded
            return self._read_partitions(partitions)

    def _read_partitions(self, partitions: list[int], use_snapshots: bool = True, topic_id: str | None = None) -> dict[int, tuple]:
        """Each partition's decoded states, its cold ones (encoded), what the changelog holds
        for each key (digest, or layout with ``chunks``), the keys' summaries, the cold keys'
        summary headers, where the changelog's writes were when it loaded (``_loaded_at``) and
        the keys with a chunk record after their head's last one (``take_late``). Only a key's last record is read: a changelog's tail is not
        compacted yet and holds many superseded versions of a busy key. With ``snapshots``,
        a partition's usable snapshot (``_usable``) stands for its records up to the
        snapshot's offset, and only the records after it are read (``use_snapshots=False``: the
        fallback read of partitions whose snapshot did not decode, with the load's ``topic_id``)."""
        started = time.monotonic()
        # Whole changelogs, read as fast as they come: larger fetches per partition than a
        # live consumer's 1 MB default (a restart waits for this read).
        consumer = Consumer({**self._consumer_config, "group.id": f"{self.changelog}.restore", "enable.auto.commit": False,
                             "enable.partition.eof": True, "auto.offset.reset": "earliest",
                             "max.partition.fetch.bytes": 16 * 1024 * 1024, "fetch.max.bytes": 64 * 1024 * 1024,
                             "fetch.wait.max.ms": 10,  # at a partition's end: do not wait for records that are not coming
                             "fetch.queue.backoff.ms": 0})  # fetch again as soon as a response is queued (a restart waits)
        raw: dict[int, dict[str, bytes | None]] = {p: {} for p in partitions}
        summaries: dict[int, dict[str, bytes]] = {p: {} for p in partitions}
        late: dict[int, set[str]] = {p: set() for p in partitions}  # (``take_late``)
        loaded_at: dict[int, tuple | None] = {}
        from_snapshot: dict[int, int] = {}
        if use_snapshots:
            topic_id = self._changelog_id() if self.snapshots is not None else None  # (None: not known; no snapshot used or written)
        try:
            ends, starts = {}, {}
            for p in partitions:
                # What this store's output had written to the partition before its end is read:
                # a record still in flight may land after it, unread (the state is then not the
                # fold up to a known offset: no snapshot of it this time).
                acks = self._acks.at(p) if self._acks is not None else None
                low, high = _watermarks(consumer, TopicPartition(self.changelog, p), self.read_within_s)
                loaded_at[p] = (high, acks, topic_id) if acks is not None and acks[0] == acks[1] else None
                start = low
                began = time.monotonic()
                snap = self._usable(p, low, high, topic_id) if self.snapshots is not None and use_snapshots else None
                self.snapshot_stats["read_seconds"] += time.monotonic() - began
                if snap is not None:
                    raw[p], summaries[p] = snap.records, snap.summaries
                    start = from_snapshot[p] = snap.offset
                if high > start:
                    ends[p], starts[p] = high, start
            if ends:
                # From the offset just read, not OFFSET_BEGINNING (that one librdkafka looks up again).
                consumer.assign([TopicPartition(self.changelog, p, starts[p]) for p in ends])
                while ends:
                    # A short timeout: consume() waits its whole timeout unless ``num`` records arrive, and
                    # a partition's last records are fewer (measured: 1.1 s of a 1.6 s load spent waiting).
                    for msg in consumer.consume(100_000, timeout=0.05):
                        p = msg.partition()
                        if msg.error():
                            if msg.error().code() == KafkaError._PARTITION_EOF:
                                ends.pop(p, None)
                                continue
                            raise RuntimeError(f"reading {self.changelog}[{p}] failed: {msg.error()}")
                        key = msg.key().decode()
                        raw[p][key] = msg.value()
                        headers = msg.headers()
                        if headers:
                            summaries[p][key] = dict(headers).get(SUMMARY_HEADER)
                        else:
                            summaries[p].pop(key, None)
                        if self.chunks is not None and SEP in key:
                            # A chunk written after its head's summary (a snapshot's, or a crash's leftover
                            # head): the summary may not be the state's any more — decoded at once (``_decode``).
                            head = key.rpartition(SEP)[0]
                            summaries[p].pop(head, None)
                            late[p].add(head)
                        elif self.chunks is not None:
                            late[p].discard(key)
                        self.loaded_records += 1
                        if p in from_snapshot:
                            self.snapshot_stats["tail_records"] += 1
                        if msg.offset() + 1 >= ends.get(p, 0):
                            ends.pop(p, None)
        finally:
            consumer.close()
        read = time.monotonic()
        out, undecodable = {}, []
        with gctune.bulk(freeze=any(raw.values())):  # a restart's decoded state is garbage-free and long-lived
            for p, records in raw.items():
                try:
                    out[p] = (*self._decode(records, summaries[p]), loaded_at[p], late[p])
                except Exception as exc:
                    if p not in from_snapshot:
                        raise
                    # A snapshot that passed its checks and still does not decode: read the partition whole.
                    self._refused_snapshot(p, "does not decode", f"its records do not decode: {type(exc).__name__}: {exc}")
                    self.snapshots.discard(p)  # (a clean stop writes a new one from the changelog's state)
                    undecodable.append(p)
        for p in undecodable:
            from_snapshot.pop(p)
        inner = self.load_seconds
        if undecodable:
            out.update(self._read_partitions(undecodable, use_snapshots=False, topic_id=topic_id))
        inner = self.load_seconds - inner  # (that read counted its own time)
        self._from_snapshot = (self._from_snapshot - set(partitions)) | set(from_snapshot)
        decoded = time.monotonic() - read
        self.load_seconds += time.monotonic() - started - inner
        self.last_loaded_at = time.monotonic()
        self.snapshot_stats["loaded"] += len(from_snapshot)
        log.info("%s: recovered %d key(s) of partition(s) %s from %s in %.1fs (%.1fs of it decoding)%s", self.name,
                 sum(len(v[0]) + len(v[1]) for v in out.values()), partitions, self.changelog, time.monotonic() - started, decoded,
                 f"; partition(s) {sorted(from_snapshot)} from their snapshots ({self.snapshot_stats['read_seconds']:.1f}s), "
                 "then the changelog after them" if from_snapshot else "")
        return out

    def _usable(self, partition: int, low: int, high: int, topic_id: str | None) -> Snapshot | None:
        """The partition's snapshot if it may stand for its changelog up to its offset (see
        ``streams.snapshot``), else None — the reason logged and counted (``read_whole``)."""
        try:
            snap = self.snapshots.load(partition)
            if snap is None:
                return None
            if topic_id is None:
                raise SnapshotInvalid("topic id unknown", f"the id of the topic {self.changelog} could not be read")
            if snap.topic_id != topic_id:
                raise SnapshotInvalid("another topic", f"it is of another {self.changelog} topic (id {snap.topic_id}, the topic's is {topic_id}): "
                                      "the topic was deleted and created again")
            if not low <= snap.offset <= high:
                raise SnapshotInvalid("offset outside the partition", f"its offset {snap.offset} is outside the partition's offsets now ({low}-{high})")
            if high > snap.offset and snap.age_s() > self.snapshot_tail_max_age_s:
                raise SnapshotInvalid("too old for the records after it", f"records were written after it and it is {snap.age_s() / 3600:.1f} h old: a tombstone among them "
                                      "may have been compacted away")
            return snap
        except SnapshotInvalid as exc:
            kind, reason = exc.kind, str(exc)
        except Exception as exc:  # noqa: BLE001 - whatever failed, the changelog is read whole (as without a snapshot)
            kind, reason = type(exc).__name__, f"{type(exc).__name__}: {exc}"
        self._refused_snapshot(partition, kind, reason)
        return None

    def _refused_snapshot(self, partition: int, kind: str, reason: str) -> None:
        self.snapshot_stats["read_whole"][kind] += 1
        log.warning("%s store: not using the snapshot of %s[%d] (%s); reading the partition's changelog whole",
                    self.name, self.changelog, partition, reason)

    def _changelog_id(self) -> str | None:
        """The changelog topic's id now (Kafka's: a topic deleted and created again gets a new
        one), read at every load — a snapshot is stamped with the id of the topic its partition
        was loaded from; None if it cannot be read (then no snapshot is used or written)."""
        from confluent_kafka import TopicCollection
        from confluent_kafka.admin import AdminClient

        try:
            admin = AdminClient({**self._consumer_config, "logger": logging.getLogger("librdkafka")})  # (bootstrap and security)
            description = admin.describe_topics(TopicCollection([self.changelog]), request_timeout=self.read_within_s)[self.changelog]
            return str(description.result(timeout=self.read_within_s).topic_id)
        except Exception as exc:  # noqa: BLE001 - an optimisation lost, not the state
            log.warning("%s store: the id of %s could not be read (%s); its snapshots are not used or written this time", self.name,
                        self.changelog, exc)
            return None

    def _decode(self, records: dict[str, bytes | None], summaries: dict[str, bytes | None]) -> tuple[dict[str, dict], dict[str, bytes], dict, dict, dict]:
        """(decoded states, cold states, marks, summaries, the cold states' summary headers) of
        one partition's last records.
        A state is left cold when its record carries its summary — its bytes, or a state in chunks
        (whose summary only a snapshot holds) its head's and chunks' bytes; anything else is decoded
        and summarized here."""
        heads: dict[str, bytes] = {}
        parts: dict[str, dict[str, bytes]] = defaultdict(dict)
        for key, value in records.items():
            base, sep, tag = key.rpartition(SEP) if self.chunks is not None else ("", "", "")
            if not sep:
                if value is not None:
                    heads[key] = value
            elif value is not None:
                parts[base][tag] = value
        summarize = self._summarize
        states: dict[str, dict] = {}
        cold: dict[str, bytes | tuple[bytes, dict[str, bytes]]] = {}
        cold_summaries: dict[str, bytes] = {}
        marks: dict = {}
        out_summaries: dict = {}
        for key, head in heads.items():
            key_parts = parts.get(key)
            summarized = summarize is not None and key != DIRECTORY_MARK
            # A state in chunks has a summary only from a snapshot, which writes the whole state's (a changelog's
            # head beside sealed chunks carries none); a chunk read after it dropped it (``_read_partitions``).
            summary = summaries.get(key) if summarized else None
            if summary is not None:
                cold[key] = (head, key_parts) if key_parts else head  # its mark is taken when it is decoded (``_warm``)
                cold_summaries[key] = summary
                out_summaries[key] = orjson.loads(summary)
                continue
            if key_parts:
                states[key], marks[key] = decode_chunked(self.chunks, head, key_parts)
            else:
                states[key], marks[key] = orjson.loads(head), self._mark(head)
            if summarized:
                out_summaries[key] = summarize(states[key])
        for key in parts.keys() - heads.keys():
            marks[key] = orphaned(parts[key])  # no state: tombstoned by the key's next write
        return states, cold, marks, out_summaries, cold_summaries

    def _mark(self, value: bytes):
        """What the store remembers of a key whose changelog record is ``value``: its digest,
        or with ``chunks`` a layout with that head and no sealed chunk."""
        if self.chunks is None:
            return _digest(value)
        layout = _Layout()
        layout.head = _digest(value)
        return layout

    def drops(self) -> dict[int, int]:
        """How often each partition was dropped so far (a write taken before a drop is stale after it)."""
        return dict(self._drops)

    def drop(self, partitions: Iterable[int]) -> None:
        for p in partitions:
            self._drops[p] += 1
            self._late.pop(p, None)
            self._kinds.subtract(kind_of(k) for k in self.parts.pop(p, {}))
            self._kinds.subtract(kind_of(k) for k in self._cold.pop(p, {}))
            self._cold_summaries.pop(p, None)
            self._loaded_at.pop(p, None)
            self._emitted.pop(p, None)
            self._record_bytes.pop(p, None)
            self._not_saveable.pop(p, None)
            self._dirty.pop(p, None)
            self._written.pop(p, None)  # a failed batch drops its partitions: nothing here is trusted past the changelog
            self._layouts.pop(p, None)

    def take_late(self) -> set[str]:
        """The keys of the partitions loaded since the last call whose changelog held a chunk record
        after their head's last record — and forget them. A key's chunks are written before its head
        (``encode_chunked``), so a crash between them leaves the newer chunks beside the older head:
        the state decodes whole (``decode_chunked`` keeps a chunk's copy of an item), but what its
        owner derived into the head at that write (an entity's interests and sent versions, a control
        key's interests, deadline and violations) is the write before's — and the batch delivered
        again folds nothing new (its rows and links are in the chunks already), so nothing would
        derive it again. Its owner re-derives these keys (a refresh, a tick); until it has taken them, no
        snapshot of their partition is written (it holds no record order: loaded from it, they would
        not be found again). A chunk written alone
        (an item sealed earlier replaced, the head unchanged) is found too: its key is re-derived to
        the same outputs, which the versions make harmless."""
        keys: set[str] = set()
        for p in list(self._late):
            keys.update(self._late.pop(p))
        return keys

    # --- access ---------------------------------------------------------------------------
    def start_empty(self, partitions: Iterable[int]) -> None:
        """Take ``partitions`` as loaded with no state (a tool or benchmark without a changelog)."""
        for p in partitions:
            self.parts[p], self._cold[p], self._cold_summaries[p] = {}, {}, {}
            self._loaded_at[p] = None  # not the fold of any changelog offset known here: never snapshotted
            if self.chunks is None:
                self._written[p] = {}
            else:
                self._layouts[p] = {}

    def get(self, partition: int, key: str) -> dict | None:
        state = self.parts[partition].get(key)
        if state is None and self._cold[partition]:
            value = self._cold[partition].get(key)
            if value is not None:
                decoded, layout = self._decode_cold(partition, key, value)
                self._warm(partition, key, layout)
                state = self.parts[partition][key] = decoded
                self.decoded_cold += 1
        return state

    def _decode_cold(self, partition: int, key: str, value: bytes | tuple[bytes, dict[str, bytes]]) -> tuple[dict, object]:
        """A cold state and what its records hold (``_mark``): a whole record, or a head and its
        chunks. One that does not decode is not there: not the input's fault — ``StateUnavailable``
        (the batch waits; a snapshot it came from is discarded, and the restart the wait ends in
        reads the changelog instead); the state stays cold."""
        try:
            if isinstance(value, tuple):
                return decode_chunked(self.chunks, *value)
            return orjson.loads(value), self._mark(value)
        except Exception as exc:  # noqa: BLE001 - whatever is wrong with the bytes (not JSON, a chunk not an object, a tag without a number)
            where = "snapshot" if partition in self._from_snapshot else "changelog"
            if where == "snapshot":
                self.snapshots.discard(partition)
                self._not_saveable[partition] = "its snapshot held a state that does not decode (discarded)"  # not written again
            failure = StateUnavailable(f"{self.name} store: the recovered state of {key!r} ({self.changelog}[{partition}], "
                                       f"from its {where}) does not decode: {type(exc).__name__}: {exc}")
            self.outage.failed(failure)
            raise failure from exc

    def _warm(self, partition: int, key: str, mark=None) -> bytes | tuple | None:
        """Take ``key`` out of the cold states (its record's bytes — a head and its chunks' — or
        None if it is not cold), remembering what its records hold (``mark``, when the caller
        decoded it), as a recovery does for a decoded state."""
        value = self._cold[partition].get(key)
        if value is not None:
            if mark is None:  # put or deleted without being asked for: a chunked state's layout needs its chunks decoded
                mark = self._decode_cold(partition, key, value)[1] if isinstance(value, tuple) else self._mark(value)
            del self._cold[partition][key]
            self._cold_summaries[partition].pop(key, None)
            (self._written if self.chunks is None else self._layouts)[partition][key] = mark
        return value

    def put(self, partition: int, key: str, state: dict) -> None:
        part = self.parts[partition]
        if key not in part and self._warm(partition, key) is None:
            self._kinds[kind_of(key)] += 1
        part[key] = state
        self._dirty[partition].add(key)

    def delete(self, partition: int, key: str) -> None:
        """Forget ``key``: its tombstone is written with the next changes."""
        if self.parts[partition].pop(key, None) is not None or self._warm(partition, key) is not None:
            self._kinds[kind_of(key)] -= 1
        self._dirty[partition].add(key)

    def states(self, partition: int) -> dict[str, dict]:
        """Every state of a loaded partition, decoded (tests, tools: a worker asks by key)."""
        for key in list(self._cold[partition]):
            self.get(partition, key)
        return self.parts[partition]

    def items(self):
        for p in list(self.parts):
            for key, state in list(self.states(p).items()):
                yield p, key, state

    def health(self) -> dict:
        """Keys in memory (and by kind: the part of the key before its first ':'), and what
        recovering them cost: changelog records read, seconds (loads of several partitions at
        once count once), the partitions loaded."""
        return {"keys": len(self), "kinds": {k: n for k, n in sorted(self._kinds.items()) if n > 0}, "partitions": sorted(self.parts),
                "cold": sum(map(len, self._cold.values())), "decoded_cold": self.decoded_cold, "read_failures": self.outage.failed_attempts,
                "recovered_records": self.loaded_records,
                "recovery_seconds": round(self.load_seconds, 3), "last_loaded_at": self.last_loaded_at, "snapshots": self.snapshot_health()}

    def __len__(self) -> int:
        return sum(len(v) for v in self.parts.values()) + sum(len(v) for v in self._cold.values())

    # --- snapshots ----------------------------------------------------------------------------
    def save_snapshots(self, partitions: Iterable[int] | None = None, deadline: float | None = None) -> dict[int, str]:
        """Write a local snapshot (``streams.snapshot``) of each loaded partition — of
        ``partitions``, or all — whose state in memory is the fold of its changelog up to a
        known offset (``_position``); a stage calls this at a clean stop, after its last epoch
        commit. Returns partition -> why it was not written, for those that were not (their
        previous snapshot, if any, stays: it and the changelog after it are still the state).
        ``deadline`` (``time.monotonic()``): no partition is begun after it (a stop's bound)."""
        if self.snapshots is None:
            return {}
        started = time.monotonic()
        not_saved: dict[int, str] = {}
        for p in sorted(list(self.parts) if partitions is None else set(partitions) & set(self.parts)):
            offset, reason = self._position(p)
            if reason is None and deadline is not None and time.monotonic() >= deadline:
                reason = "the stop's time ran out before it"
            if reason is None:
                try:
                    size = self.snapshots.save(p, offset, self._loaded_at[p][2], self._records(p))
                    self.snapshot_stats["saved"] += 1
                    self.snapshot_stats["saved_bytes"] += size
                    continue
                except Exception as exc:  # noqa: BLE001 - a snapshot is an optimisation: the changelog is still the state
                    reason = f"{type(exc).__name__}: {exc}"
            not_saved[p] = reason
        self.snapshot_stats["not_saved"] = not_saved
        self.snapshot_stats["save_seconds"] += time.monotonic() - started
        for p, reason in not_saved.items():
            log.warning("%s store: no snapshot of %s[%d] written (%s); the next start reads it from its changelog", self.name, self.changelog,
                        p, reason)
        log.info("%s store: snapshots of %d partition(s) written in %.1fs", self.name,
                 len(self.parts if partitions is None else set(partitions) & set(self.parts)) - len(not_saved), time.monotonic() - started)
        return not_saved

    def _position(self, partition: int) -> tuple[int | None, str | None]:
        """The changelog offset whose fold the partition's state in memory is, or why it is not
        known: a changed state not written yet, or encoded for the changelog and never written (an
        epoch commit that did not finish), a record refused by Kafka (dead-lettered: the state
        holds what the changelog does not), a record not acknowledged, a record in flight when it
        loaded, a record of another writer among this store's since then (the offsets this store's
        output got are not the ones right after the end it loaded at), a crash's orphaned chunks
        (their records are not in memory), or the topic's id unknown."""
        if partition in self._not_saveable:
            return None, self._not_saveable[partition]
        if self._dirty.get(partition):
            return None, f"{len(self._dirty[partition])} changed state(s) not written to the changelog"
        if self._acks is None:
            return None, "the store does not follow its output's writes (PartitionStore.follow)"
        base = self._loaded_at.get(partition)
        if base is None:
            return None, "a changelog record of it was still in flight when it was loaded"
        high, (_produced0, acked0, _next0, refused0), topic_id = base
        if topic_id is None:
            return None, "the changelog's topic id was not known when it loaded"
        produced, acked, next_offset, refused = self._acks.at(partition)
        if refused != refused0:
            return None, f"Kafka refused {refused - refused0} changelog record(s) of it (dead-lettered): its state is not the changelog's"
        if produced != acked:
            return None, f"{produced - acked} changelog record(s) of it not acknowledged"
        written = acked - acked0
        if written != self._emitted.get(partition, 0):
            return None, f"{self._emitted.get(partition, 0) - written} changelog record(s) of it encoded and never written"
        states, layouts = self.parts[partition], self._layouts.get(partition, {}) if self.chunks is not None else {}
        orphans = sum(1 for key, layout in layouts.items() if key not in states and layout.chunks)
        if orphans:
            return None, f"{orphans} key(s) with a crash's orphaned chunks (their records are not in memory)"
        if self._late.get(partition):
            # (a snapshot holds no record order: loaded from it, these keys would not be handed over again)
            return None, f"{len(self._late[partition])} key(s) with a chunk after their head not handed to their owner yet (take_late)"
        if written == 0:
            return high, None
        if next_offset - high != written:
            return None, (f"its changelog has records of another writer among this store's ({written} written here since it loaded "
                          f"at offset {high}, the last at {next_offset - 1})")
        return next_offset, None

    def _records(self, partition: int) -> Iterator[tuple[str, bytes, bytes | None]]:
        """The partition's records as its changelog would hold them if every state in memory
        were written now, one at a time (key, value, summary header or None): a cold state's own
        record; a state's encoding (and summary), or in chunks its head and its layout's sealed
        chunks — the head as it was written when its owner changed the state after that
        (``_record_bytes``). (A partition with a crash's orphaned chunks is not snapshotted:
        ``_position``.)"""
        cold_summaries = self._cold_summaries.get(partition, {})
        for key, value in self._cold.get(partition, {}).items():
            if isinstance(value, tuple):  # a head and its chunks, as a snapshot held them
                head, parts = value
                yield key, head, cold_summaries.get(key)
                for tag, part in parts.items():
                    yield f"{key}{SEP}{tag}", part, None
            else:
                yield key, value, cold_summaries.get(key)
        layouts = self._layouts.get(partition, {}) if self.chunks is not None else {}
        states, recorded = self.parts[partition], self._record_bytes.get(partition, {})
        marks = self._written.get(partition, {})

        def held(key: str, value: bytes, mark) -> bytes:
            # A state changed in memory and never put (so never written), or a head a crash left
            # older than its chunks, is not what the changelog holds: no snapshot of the partition.
            if _digest(value) != mark:
                raise SnapshotInvalid("not the changelog's", f"the state of {key!r} in memory is not its changelog record "
                                      "(changed without being put, or a crash's leftover head not written again yet)")
            return value

        for key, state in states.items():
            layout = layouts.get(key)
            if key in recorded:  # changed after it was written (``on_written``): the record it was written as
                yield key, *recorded[key]
            elif layout is None or not layout.chunks:
                mark = marks.get(key) if self.chunks is None else (layout.head if layout is not None else None)
                yield key, held(key, orjson.dumps(state), mark), self._summary(key, state)
            else:
                open_ids = {}
                for name in self.chunks.fields:
                    member = layout.member.get(name, {})
                    open_ids[name] = [i for i in (state.get(name) or {}) if i not in member]
                # The whole state's summary (not the changelog head's: it has none), so that the next start keeps it
                # cold — exact, for the snapshot holds every record of it (a chunk after it drops it: ``_read_partitions``).
                yield key, held(key, orjson.dumps(_head(self.chunks, state, layout, open_ids)), layout.head), self._summary(key, state)
            if layout is None or not layout.chunks:
                continue
            for tag, ids in layout.chunks.items():
                if ids:
                    field = tag.rstrip("0123456789")
                    if layout.tokens.get(tag) != _token(self.chunks, field, state, ids):
                        raise SnapshotInvalid("not the changelog's", f"a sealed chunk of {key!r} changed in memory and was not written")
                    yield f"{key}{SEP}{tag}", _chunk_value(self.chunks, field, state, ids), None

    def snapshot_health(self) -> dict:
        stats = self.snapshot_stats
        return {"dir": str(self.snapshots.dir) if self.snapshots else None, "loaded_partitions": stats["loaded"],
                "tail_records": stats["tail_records"], "read_whole": dict(stats["read_whole"]), "read_seconds": round(stats["read_seconds"], 3),
                "saved_partitions": stats["saved"],
                "saved_bytes": stats["saved_bytes"], "not_saved": {str(p): r for p, r in stats["not_saved"].items()},
                "save_seconds": round(stats["save_seconds"], 3)}

    # --- the changelog ----------------------------------------------------------------------
    def _summary(self, key: str, state: dict | None) -> bytes | None:
        """A state's encoded summary (None: the store keeps none, or the key has none)."""
        if self._summarize is None or state is None or key == DIRECTORY_MARK:
            return None
        return orjson.dumps(self._summarize(state))

    def _headers(self, key: str, state: dict | None) -> list[tuple[str, bytes]] | None:
        """The summary header of a state's changelog record when it is written whole (a head beside sealed
        chunks carries none: ``write_changes``; only a snapshot holds such a state's summary, ``_records``)."""
        summary = self._summary(key, state)
        return None if summary is None else [(SUMMARY_HEADER, summary)]

    def write_changes(self, output) -> int:
        """Produce a changelog record for every key changed since the last call (the
        caller flushes ``output``, after the outputs these states imply were acked) — not
        for a key whose state encodes to what its last changelog record holds. If the flush
        fails, the caller's batch fails and ``drop`` forgets the partitions, so a record
        that was not acknowledged is never taken as written."""
        if self.chunks is not None:
            return self._write_chunked(output)
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
                headers = self._headers(key, state)
                output.produce(self.changelog, key.encode(), value, partition=p, headers=headers)
                n += 1
                self._emitted[p] += 1
                self._written_now(p, key, state, value, headers)
        self._dirty.clear()
        return n

    def _written_now(self, partition: int, key: str, state: dict | None, value: bytes | None, headers) -> None:
        """``state``'s record (``value``, its ``headers``; a chunked state's head, written now or
        unchanged) was just encoded: tell the owner (``on_written``) and, when it changes the state
        after that, keep the record for the partition's snapshot (``_records``), which must hold
        what the changelog holds."""
        kept = self._record_bytes.get(partition)
        if state is not None and self._on_written is not None and self._on_written(state):
            self._record_bytes[partition][key] = (value, headers[0][1] if headers else None)
        elif kept:
            kept.pop(key, None)

    def _write_chunked(self, output) -> int:
        n = 0
        for p, keys in self._dirty.items():
            states, layouts = self.parts.get(p, {}), self._layouts[p]
            for key in keys:
                state = states.get(key)
                if state is None:
                    layout = layouts.pop(key, None)
                    if layout is None:
                        self.unchanged_skipped += 1
                        continue
                    records = [(f"{key}{SEP}{tag}", None) for tag in layout.chunks] + [(key, None)]
                else:
                    head_now: list = []
                    records = encode_chunked(self.chunks, key, state, layouts.setdefault(key, _Layout()), head_now)
                    if not records:
                        self.unchanged_skipped += 1
                        continue
                whole = state is not None and not layouts[key].chunks  # a head with sealed chunks is decoded at recovery: no summary
                head, head_headers = None, None
                for name, value in records:
                    headers = self._headers(key, state) if name == key and whole else None
                    output.produce(self.changelog, name.encode(), value, partition=p, headers=headers)
                    n += 1
                    self._emitted[p] += 1
                    if name == key:
                        head, head_headers = value, headers
                if head is None and state is not None:  # the head did not change: its record is the one just encoded
                    head = head_now[0]
                self._written_now(p, key, state, head, head_headers)
        self._dirty.clear()
        return n
