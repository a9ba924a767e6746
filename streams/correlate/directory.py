"""ReleaseDirectory: every worker's full, in-memory view of all releases.

Input: the raw release topic, read from the beginning by each worker (no consumer
group: every worker reads every partition). Output: release manifests, lifecycle
history and look-up indexes (release id, image digest, model+version).

Why not a co-partitioned table: scheduler, GPU and alert events are keyed by pod,
node/GPU or fingerprint, and each of them must resolve *some* release. Releases are
few (thousands) and change rarely, so — as with a Kafka Streams GlobalKTable — every
worker holds them all and joins locally, with no repartition per look-up. This is
hand-written rather than Faust's GlobalTable because the join needs secondary
indexes (digest, model+version) and a change hook that re-attributes dependents,
neither of which GlobalTable offers.

Guarantees: the directory's content after reading a history is independent of
read order (fields and states are merged by event time, see ``streams.correlate``).
``ready`` is set once the topic's end offsets at start-up have been read, so the
correlation agent does not attribute against a half-loaded directory.
``follow_release_topic`` with ``retry_s`` (``gpuledger admit``) keeps connecting while Kafka
cannot be reached at start, logging once per state change (``sinks.retry.OutageLog``);
without it (the worker's stages) that failure ends it. Once loaded, the directory is
*confirmed current* every ``CONFIRM_EVERY_S``: the topic's end offsets are asked, and once the
follower has read up to them the directory held every release event Kafka had acknowledged at
the instant they were asked (``confirmed_at``). While the broker is away that instant stops
moving — what ``gpuledger admit`` reports and warns about (a decision on a state that may miss
a later revocation); aiokafka itself rides out the outage and reconnects.
"""

from __future__ import annotations

import asyncio
import logging
import time
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from datetime import datetime

from gpuledger.telemetry import demote
from gpuledger.timefmt import within
from schemas import EventDecodeError, decode_event
from schemas.release import ENDING_EVENTS, LIFECYCLE_EVENTS
from sinks.retry import OutageLog
from streams.correlate.release import apply_release_event, new_state, state_as_of

log = logging.getLogger(__name__)

#: Set while ``follow_release_topic`` retries its connection: aiokafka's client then logs an
#: ERROR for every failed bootstrap, and the follower reports the outage itself, once per state
#: change — so those records are demoted to DEBUG (as ``sinks.clickhouse`` does its drivers').
_retrying: ContextVar[bool] = ContextVar("release_topic_retrying", default=False)

#: Seconds between two confirmations that the directory is current (``follow_release_topic``):
#: one ListOffsets request to the broker each time.
CONFIRM_EVERY_S = 5.0
#: A confirmation's request that has no answer within this long counts as failed (the broker is
#: away: aiokafka would wait for its request timeout, 40 s, while the follower reads nothing).
CONFIRM_TIMEOUT_S = 5.0


class _DemoteWhileRetrying(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not _retrying.get() or record.levelno <= logging.DEBUG:
            return True
        return demote(record, logging.DEBUG)


_DEMOTE = _DemoteWhileRetrying()
for _name in ("aiokafka", "aiokafka.conn"):  # (aiokafka's client logs as "aiokafka")
    logging.getLogger(_name).addFilter(_DEMOTE)


def interests_for(image_digest: str | None = None, model_name: str | None = None, model_version: str | None = None,
                  release_id: str | None = None) -> list[str]:
    """The interest keys a look-up by these identifiers depends on — the one place their
    format lives: an entity waits on them, the directory announces changes by them."""
    keys = []
    if release_id:
        keys.append(f"rid:{release_id}")
    if image_digest:
        keys.append(f"digest:{image_digest}")
    if model_name:
        keys.append(f"modelname:{model_name}")
        if model_version:
            keys.append(f"model:{model_name}:{model_version}")
    return keys


class ReleaseDirectory:
    def __init__(self) -> None:
        self.releases: dict[str, dict] = {}
        self.by_digest: dict[str, set[str]] = defaultdict(set)
        self.by_model: dict[tuple[str, str], set[str]] = defaultdict(set)
        self.by_model_name: dict[str, set[str]] = defaultdict(set)
        self.seen: set[str] = set()
        # Every release that ever had a digest / model (never shrinks): the candidates a
        # look-up consulted, for the version of the rows that look-up attributed.
        self.ever: dict[str, set[str]] = defaultdict(set)
        self.answered: dict[str, set[str]] = defaultdict(set)  # release -> every key of ``ever`` it is in
        self.ready = asyncio.Event()
        # time.time() of the last instant at which the directory held every event of the release
        # topic that Kafka had acknowledged (``follow_release_topic``); None before it loaded.
        self.confirmed_at: float | None = None
        self.confirm_problem: str | None = None  # why the last confirmation failed (cleared by the next one)
        self._counts: tuple[int, dict[str, int]] | None = None  # (len(seen), counts) (``counts``)
        self._times: dict[str, list[str] | None] = {}  # release -> its history's event times (``_history_times``)
        self._merged: dict[tuple[str, ...], tuple[int, list[str]] | None] = {}  # releases -> their summed versions (``versions_at``)

    def freshness(self, now: float | None = None) -> dict:
        """For health pages: loaded or not, when it was last confirmed current
        (``follow_release_topic``) and how long ago, and why confirming fails if it does."""
        from datetime import datetime, timezone

        from gpuledger.timefmt import iso_z

        now = time.time() if now is None else now
        at = self.confirmed_at
        out = {"ready": self.ready.is_set(), "releases": len(self.releases),
               "confirmed_current_at": iso_z(datetime.fromtimestamp(at, timezone.utc), 0) if at is not None else None,
               "confirmed_age_s": round(max(0.0, now - at), 1) if at is not None else None}
        if self.confirm_problem:
            out["problem"] = self.confirm_problem
        return out

    # --- folding events ---------------------------------------------------------
    def apply(self, event) -> list[str]:
        """Fold one release event in; return the interest keys whose answer changed."""
        if event.event_id in self.seen:
            return []
        self.seen.add(event.event_id)
        rid = event.identity.release_id
        state = self.releases.setdefault(rid, new_state(rid))
        before = self.interest_keys(rid)
        self._times.pop(rid, None)  # before the history changes: no stale times even if the fold fails half-way
        self._merged.clear()
        apply_release_event(state, event)
        after = self.interest_keys(rid)
        manifest = self.manifest(rid)
        for key in before - after:
            self._unindex(key, rid)
        self.ever[f"rid:{rid}"].add(rid)
        for key in after:
            self.ever[key].add(rid)
        answered = self.answered[rid]
        answered.add(f"rid:{rid}")
        answered.update(after)
        if manifest.get("image_digest"):
            self.by_digest[manifest["image_digest"]].add(rid)
        if manifest.get("model_name"):
            self.by_model_name[manifest["model_name"]].add(rid)
            if manifest.get("model_version"):
                self.by_model[(manifest["model_name"], manifest["model_version"])].add(rid)
        # Every look-up it ever answered, not only those of its manifest before and after: an event of it
        # changes the counts of each (``candidates_version``, ``after``) — a release re-registered under
        # another model, whose earlier event was read late, changed the old model's look-up and refreshed
        # nobody waiting on it (their rows kept a version below the one the history gives them).
        return sorted(before | after | answered)

    def _unindex(self, key: str, rid: str) -> None:
        kind, _, value = key.partition(":")
        if kind == "digest":
            self.by_digest[value].discard(rid)
        elif kind == "model":
            name, _, version = value.partition(":")
            self.by_model[(name, version)].discard(rid)
        elif kind == "modelname":
            self.by_model_name[value].discard(rid)

    # --- reading ------------------------------------------------------------------
    def interest_keys(self, rid: str) -> set[str]:
        """The keys an unresolved entity may wait on that this release can answer."""
        m = self.manifest(rid)
        return set(interests_for(m.get("image_digest"), m.get("model_name"), m.get("model_version"), rid))

    def known(self, rid: str | None) -> bool:
        return bool(rid) and rid in self.releases and bool(self.releases[rid]["history"])

    # --- versions (see streams.correlate.entities: versions come from history) -----------
    def count(self, rid: str | None) -> int:
        """How many distinct events of the release the directory holds (grows only)."""
        state = self.releases.get(rid) if rid else None
        return state["events"] if state else 0

    def counts(self) -> dict[str, int]:
        """Every release's ``count`` — the same object until the directory sees a new event."""
        if self._counts is None or self._counts[0] != len(self.seen):
            self._counts = (len(self.seen), {rid: state["events"] for rid, state in self.releases.items()})
        return self._counts[1]

    def version_at(self, rid: str | None, at_iso: str | None = None) -> int:
        """A number that grows whenever the release's manifest or (with ``at_iso``) its
        state as of that time can have changed, and only then: a function of the
        release's events, not of the order they arrived in."""
        state = self.releases.get(rid) if rid else None
        if not state or not state["events"]:
            return 0
        n = 1 + state["manifest_version"]
        if at_iso is not None:
            n += state["dropped"] + self._count_as_of(rid, state, at_iso)
        return n

    def _count_as_of(self, rid: str, state: dict, at_iso: str) -> int:
        """How many of the release's history entries are at or before ``at_iso``: by bisection of
        its times (``_history_times``), else by walking them."""
        times = self._history_times(rid, state)
        if times is not None:
            return bisect_right(times, at_iso)
        return sum(1 for entry in state["history"] if entry[0].split("|", 1)[0] <= at_iso)

    #: Fewer releases than this are summed one by one (``versions_at``).
    MERGE_FROM = 4
    #: Release sets whose merged times ``versions_at`` keeps between release events, at most.
    MERGED_MAX = 4096

    def versions_at(self, rids: tuple[str, ...], at_iso: str | None) -> int:
        """``sum(version_at(rid, at_iso) for rid in rids)``, by one bisection: a node/GPU row names
        every release its holders ran before it (``Coverage``), up to every release there is, and
        summing them release by release — a bisection each — per row derived was a tenth of a
        node/GPU refresh after 240,000 events of the bench mix (engine_cpu). The releases' event
        times merged, with the constant parts summed, are kept per set of releases until the next
        release event (the same rows ask with the same set). ``at_iso`` None: the manifests' versions only."""
        if at_iso is None or len(rids) < self.MERGE_FROM:
            return sum(self.version_at(rid, at_iso) for rid in rids)
        merged = self._merged.get(rids, False)
        if merged is False:
            merged = self._merge(rids)
            if len(self._merged) >= self.MERGED_MAX:
                self._merged.clear()
            self._merged[rids] = merged
        if merged is None:  # (a release's times are not in order: one by one, as ``version_at`` walks them)
            return sum(self.version_at(rid, at_iso) for rid in rids)
        base, times = merged
        return base + bisect_right(times, at_iso)

    def _merge(self, rids: tuple[str, ...]) -> tuple[int, list[str]] | None:
        base, times = 0, []
        for rid in rids:
            state = self.releases.get(rid) if rid else None
            if not state or not state["events"]:
                continue
            own = self._history_times(rid, state)
            if own is None:
                return None
            base += 1 + state["manifest_version"] + state["dropped"]
            times += own
        times.sort()
        return base, times

    def _history_times(self, rid: str, state: dict) -> list[str] | None:
        """The event times of the release's history, in its order — kept per release until its
        next event, so ``version_at`` (asked for every release a node/GPU's holders ever ran,
        per row derived) counts by bisection rather than walking the history. None when the
        times are not in order (they are whenever every time carries its UTC offset, as the
        schemas make them): then the walk."""
        if rid not in self._times:
            times = [entry[0].split("|", 1)[0] for entry in state["history"]]
            self._times[rid] = times if all(a <= b for a, b in zip(times, times[1:])) else None
        return self._times[rid]

    def candidates(self, interest: str) -> set[str]:
        """Every release that ever answered ``interest`` (``digest:…``, ``model:…``)."""
        return self.ever.get(interest, set())

    def candidates_version(self, interests) -> int:
        return sum(self.count(rid) for interest in interests for rid in sorted(self.candidates(interest)))

    def after(self, interests, since: str) -> int:
        """Of the look-ups in ``interests`` that more than one release ever answered, how many of
        their candidates' events are not at or before ``since`` (the count less those in the
        history by then: an event the history let go counts as after). Grows with every event of
        such a candidate after ``since``, and as ``since`` moves earlier — what a choice among
        them as of ``since`` depends on beyond ``candidates_version`` (``entities._resolve_facts``)."""
        n = 0
        for interest in interests:
            cands = self.candidates(interest)
            if len(cands) > 1:
                for rid in cands:
                    if (state := self.releases.get(rid)) and state["events"]:
                        n += state["events"] - self._count_as_of(rid, state, since)
        return n

    def manifest(self, rid: str) -> dict:
        state = self.releases.get(rid)
        return {f: v[0] for f, v in state["manifest"].items()} if state else {}

    def state_as_of(self, rid: str, at_iso: str) -> str | None:
        return self._latest_as_of(rid, at_iso)

    def lifecycle_state_as_of(self, rid: str, at_iso: str) -> str | None:
        """The release's latest lifecycle event (``schemas.release.LIFECYCLE_EVENTS``) at ``at_iso``:
        unlike ``state_as_of``, not a reservation or an admin action (an admission override), which
        happen to a release in any state."""
        return self._latest_as_of(rid, at_iso, LIFECYCLE_EVENTS)

    def _latest_as_of(self, rid: str, at_iso: str, kinds: frozenset[str] | None = None) -> str | None:
        """The type of the release's latest history entry at or before ``at_iso`` (of ``kinds``, when given)."""
        state = self.releases.get(rid)
        if not state:
            return None
        if self._history_times(rid, state) is None:
            return state_as_of(state, at_iso, kinds)
        k = self._count_as_of(rid, state, at_iso)
        history = state["history"]
        if kinds is None:  # (the rows' release_state: once per rendered row)
            return history[k - 1][1] if k else None
        return next((history[i][1] for i in reversed(range(k)) if history[i][1] in kinds), None)

    def latest_event(self, rid: str) -> str | None:
        state = self.releases.get(rid)
        return state["history"][-1][1] if state and state["history"] else None

    def environments_named(self, rid: str, until_iso: str | None = None) -> list[str]:
        """Every environment the release's events named — each one's identity ``environment``
        (``fields``) and, in its history, its ``to_environment`` — by ``until_iso`` when given (the
        keys' times compared as text: both UTC ``isoformat``). What ``Policy.approval_environment``
        reads, for admission (all of them) and control 1 (by the workload's admission)."""
        state = self.releases.get(rid)
        if not state:
            return []
        entries = [*state["fields"].get("environment", ()), *((entry[0], entry[3]) for entry in state["history"])]
        return [env for key, env in entries if env and (until_iso is None or key.split("|", 1)[0] <= until_iso)]

    def environments_at(self, rid: str, at_iso: str) -> list[str]:
        """Environments the release was promoted to (and not rolled back from) at a time."""
        state = self.releases.get(rid)
        envs: list[str] = []
        for key, etype, _id, env, _actor in (state["history"] if state else []):
            if key.split("|", 1)[0] > at_iso or not env:
                continue
            if etype == "release.promoted" and env not in envs:
                envs.append(env)
            elif etype in ENDING_EVENTS and env in envs:
                envs.remove(env)
        return envs

    def _pick(self, candidates: Iterable[str], environment: str | None, at_iso: str | None = None) -> str | None:
        """Deterministic choice among candidate releases: same environment first, then — with
        ``at_iso``, a row's own time — the release serving at that time (``_serving_at``); without
        it, the one whose latest event is latest (ties by id)."""
        cands = [c for c in candidates if self.known(c)]
        if environment:
            same_env = [c for c in cands if self.manifest(c).get("environment") == environment]
            cands = same_env or cands
        if not cands:
            return None
        if at_iso is not None:
            return self._serving_at(cands, at_iso)
        return max(cands, key=lambda c: (self.releases[c]["history"][-1][0], c))

    def _serving_at(self, cands: list[str], at_iso: str) -> str:
        """Of releases of one model (or image), the one serving at ``at_iso``: of those with an
        event by then, one whose lifecycle had not ended by then (its latest lifecycle event then is
        no rollback, revocation or retirement) first, then one promoted to an environment it was
        not rolled back from by then (``environments_at``: in service), then the one whose latest
        event by then is latest, then by id — ``trace --model --at``'s order, without its GPU
        holdings (not in the directory). When none had an event by then, the first to have one (the row came before its
        release's first event reached the registry's clock).

        Why: chosen by their latest events overall, an alert naming only its model was attributed
        to the model's newest release — one registered after the alert fired, and, a day later,
        one registered for staging and never promoted, which took every model-only alert of the
        model with it (an exploratory review). The choice is a function of the row's own time and
        the candidates' events, which the row's version counts (``candidates_version``)."""
        best, best_key = None, None
        for c in cands:
            history = self.releases[c]["history"]
            k = self._count_as_of(c, self.releases[c], at_iso)
            if not k:
                continue
            lifecycle = next((history[i][1] for i in reversed(range(k)) if history[i][1] in LIFECYCLE_EVENTS), None)
            key = (lifecycle not in ENDING_EVENTS, bool(self.environments_at(c, at_iso)), history[k - 1][0], c)
            if best_key is None or key > best_key:
                best, best_key = c, key
        if best is None:
            return min(cands, key=lambda c: (self.releases[c]["history"][0][0], c))
        return best

    def by_image_digest(self, digest: str | None, environment: str | None = None, at_iso: str | None = None,
                        model_name: str | None = None, model_version: str | None = None) -> str | None:
        """The release an image digest points to. Several releases can share one image — a serving
        runtime (vLLM, Triton) that loads its model's weights at start: the pod's model labels
        (``model_name``, ``model_version``), when given, narrow them to that model's (then the
        usual pick, ``_pick``); none of them that model's, all of them. Without it, a pod labelled
        ``model=llama`` on the shared runtime image went to whichever release of any model last
        used that image. The narrowing reads the candidates' manifests, which their counts
        (``candidates_version``, both look-ups') cover."""
        if not digest:
            return None
        cands = self.by_digest.get(digest, ())
        if model_name and len(cands) > 1:
            narrowed = [c for c in cands if self._is_model(c, model_name, model_version)]
            cands = narrowed or cands
        return self._pick(cands, environment, at_iso)

    def _is_model(self, rid: str, name: str, version: str | None) -> bool:
        manifest = self.manifest(rid)
        return manifest.get("model_name") == name and (not version or manifest.get("model_version") == version)

    def by_model_version(self, name: str | None, version: str | None, environment: str | None = None,
                         at_iso: str | None = None) -> str | None:
        if not name:
            return None
        if version:
            return self._pick(self.by_model.get((name, version), ()), environment, at_iso)
        return self._pick(self.by_model_name.get(name, ()), environment, at_iso)


async def follow_release_topic(bootstrap: str, topic: str, directory: ReleaseDirectory,
                               on_change: Callable[[list[str]], None], stop: asyncio.Event | None = None,
                               client_config: dict | None = None, signal_initial: bool = True, retry_s: float | None = None,
                               until: datetime | None = None) -> None:
    """Read ``topic`` from the beginning forever into ``directory`` (no consumer group).
    ``client_config``: aiokafka security settings (KafkaSettings.aiokafka_config()).
    ``signal_initial=False``: ``on_change`` hears of changes after the directory is ready
    only, not of the initial load (a caller that knows what it saw before it started).
    ``retry_s``: when no broker can be reached at start, try again every ``retry_s`` seconds
    (until ``stop``) instead of raising — for a caller that serves while not ready (admit);
    other errors (authentication, configuration) still raise. Once connected, aiokafka itself
    rides out a broker that goes away.
    ``until``: the end of a replay's range (``streams.replay_to``): release events after it are
    not applied — the directory reads the whole topic at start, and a rollback after ``--to``
    judged the range's workloads as of it (a control-2 violation after the range's end that
    the live store, which saw the workload stop first, never had). Compared as the route stage
    compares (``gpuledger.timefmt.within``, milliseconds): a release event at ``until`` + 400 us
    is stored at ``until`` and is in the range. Events before the range's start are applied:
    they are what the range's events are attributed to."""
    from aiokafka import AIOKafkaConsumer, TopicPartition
    from aiokafka.errors import KafkaConnectionError

    outage = OutageLog(log, f"connecting to Kafka for the release topic {topic}", recovered="connected") if retry_s else None
    while True:
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None, auto_offset_reset="earliest",
                                    **(client_config or {}))
        token = _retrying.set(outage is not None)
        try:
            await consumer.start()
            break
        except KafkaConnectionError as exc:
            await consumer.stop()  # (a consumer that did not start still holds its client)
            if outage is None:
                raise
            outage.failed(exc)
        finally:
            _retrying.reset(token)
        if stop is None:
            await asyncio.sleep(retry_s)
        else:
            try:
                await asyncio.wait_for(stop.wait(), retry_s)
                return
            except asyncio.TimeoutError:
                pass
    if outage is not None:
        outage.succeeded()
    confirming = OutageLog(log, f"confirming the release directory is current with {topic}", recovered="confirmed again")
    try:
        parts = [TopicPartition(topic, p) for p in (consumer.partitions_for_topic(topic) or set())]
        while not parts:
            await asyncio.sleep(0.5)
            await consumer._client.force_metadata_update()  # topic may be created after we start
            parts = [TopicPartition(topic, p) for p in (consumer.partitions_for_topic(topic) or set())]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        asked = time.time()
        end = await consumer.end_offsets(parts)
        pending: tuple[float, dict] | None = (asked, end)  # (when asked, end offsets) not yet read up to
        next_confirm = time.monotonic() + CONFIRM_EVERY_S
        caught_up = {tp for tp, off in end.items() if off == 0}
        if len(caught_up) == len(parts):
            directory.ready.set()
        while stop is None or not stop.is_set():
            if directory.ready.is_set() and time.monotonic() >= next_confirm:
                next_confirm = time.monotonic() + CONFIRM_EVERY_S
                pending = await _ask_end(consumer, parts, directory, confirming) or pending
            if pending is not None and directory.ready.is_set() and await _read_up_to(consumer, pending[1]):
                directory.confirmed_at = max(directory.confirmed_at or 0.0, pending[0])
                pending = None
            batch = await consumer.getmany(timeout_ms=200, max_records=5000)
            was_ready = directory.ready.is_set()
            changed: set[str] = set()
            for tp, messages in batch.items():
                for msg in messages:
                    try:
                        event = decode_event(msg.value)
                        if within(event.occurred_at, None, until):  # (to the millisecond, as the route stage's range)
                            changed.update(directory.apply(event))
                    except EventDecodeError:
                        pass  # dead-lettered by the routing agent, which reads the same record
                    except Exception:  # noqa: BLE001 - one bad record must not stop the directory
                        log.exception("release directory could not apply %s[%d]@%d", tp.topic, tp.partition, msg.offset)
                    if msg.offset + 1 >= end.get(tp, 0):
                        caught_up.add(tp)
            if not directory.ready.is_set() and len(caught_up) == len(parts):
                directory.ready.set()
                log.info("release directory loaded: %d release(s)", len(directory.releases))
            if changed and directory.ready.is_set() and (was_ready or signal_initial):
                on_change(sorted(changed))
    finally:
        await consumer.stop()


async def _ask_end(consumer, parts: list, directory: ReleaseDirectory, confirming: OutageLog) -> tuple[float, dict] | None:
    """(now, the topic's end offsets), or None when the broker did not answer in time (said
    once per outage, and on ``directory.confirm_problem``)."""
    from aiokafka.errors import KafkaError

    asked = time.time()
    try:
        end = await asyncio.wait_for(consumer.end_offsets(parts), CONFIRM_TIMEOUT_S)
    except (KafkaError, asyncio.TimeoutError, OSError) as exc:
        confirming.failed(exc if str(exc) else TimeoutError(f"no answer from the broker within {CONFIRM_TIMEOUT_S:.0f} s"))
        directory.confirm_problem = confirming.problem()
        return None
    confirming.succeeded()
    directory.confirm_problem = None
    return asked, end


async def _read_up_to(consumer, end: dict) -> bool:
    """Whether the consumer has handed out every record before ``end`` (its positions are the
    next records it will return, not what it prefetched)."""
    async def read() -> bool:
        for tp, offset in end.items():
            if await consumer.position(tp) < offset:
                return False
        return True

    try:  # (a position being reset asks the broker: not answered while it is away)
        return await asyncio.wait_for(read(), CONFIRM_TIMEOUT_S)
    except asyncio.TimeoutError:
        return False
