"""How far a worker run is through its input, and when it has caught up.

Input: the broker — committed offsets of the run's consumer groups and the topics'
offsets — and the worker's health page (``/gpuledger/health/``). Output:
``RunProgress`` (done / total records of the raw topics) and ``wait_caught_up``, the
one definition of "this run has processed everything published before we asked",
used by ``gpuledger replay`` and the tests that compare whole runs.

A worker run reads through four consumer groups (``worker_groups``): the route stage's
(``<app id>.route``: the raw topics), the Faust agent's (the app id: the internal route
hop), the controls stage's (``<app id>.controls``: the internal controls hop) and the sink loop's (``<app id>.sinks``: raw topics, dead letters and
the run's outputs). Caught up, all of:
  - on every catalogue topic a group reads (the raw topics, the edge dead-letter topic)
    its committed offset reached the end offset captured when the ``RunProgress`` was
    made;
  - on every run topic a group reads it has no lag;
  - the worker's health says ``status`` ok and ``stats.parked`` 0;
and that twice in a row, a second apart: between two looks a housekeeping pass (idle
flush of parked rows, a release change re-attributing its dependents) may put new
messages on the internal topics. "Done" counts a raw record once every group reading it has it.

Limits: records published after the snapshot are processed but not waited for. Which
group reads what is written here, not derived from the code that subscribes
(``streams/app.py:create_app``); ``tests/streams/test_progress.py`` checks the two
agree. Retention-trimmed partitions count from their first retained offset.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_exponential

from schemas.topics import TopicCatalogue

#: Seconds between two looks; two consecutive caught-up looks end the wait.
LOOK_INTERVAL_S = 1.0

#: Errors of a look that the next look may not meet (a new topic without a leader yet,
#: a coordinator loading, a slow broker); librdkafka does not flag all of them retriable.
TRANSIENT = frozenset({
    KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError.NOT_COORDINATOR,
    KafkaError.REQUEST_TIMED_OUT, KafkaError._TIMED_OUT, KafkaError._TRANSPORT,
    # A look at a topic created a moment ago: "Leader epoch is newer than broker epoch".
    KafkaError.UNKNOWN_LEADER_EPOCH, KafkaError.FENCED_LEADER_EPOCH,
})


def worker_groups(catalogue: TopicCatalogue, app_id: str) -> dict[str, tuple[str, ...]]:
    """Consumer group -> the topics it reads, for one worker run. Not the enriched alerts
    (read by alert routers, not the worker) nor the changelogs (read by assignment when a
    partition loads, never committed)."""
    run = catalogue.run(app_id)
    return {
        app_id: (run.route,),
        f"{app_id}.route": tuple(catalogue.raw_topics),
        f"{app_id}.controls": (run.controls,),
        f"{app_id}.sinks": (*catalogue.raw_topics, catalogue.deadletter, run.correlated, run.allocations, run.violations, run.deadletter),
    }


@dataclass(frozen=True)
class Look:
    """One look at a run: raw records done of total, lag left anywhere, the health."""

    done: int
    total: int
    inputs_left: int
    run_lag: int
    parked: int | None
    status: str | None
    #: Per consumer group that reads the raw topics (``<app id>.route``, ``<app id>.sinks``): the raw
    #: records it has committed — ``done`` is their minimum, so one group's late commit holds it.
    done_by: dict = field(default_factory=dict)

    @property
    def caught_up(self) -> bool:
        return self.inputs_left == 0 and self.run_lag == 0 and self.parked == 0 and self.status == "ok"

    def describe(self) -> str:
        return (f"{self.done}/{self.total} raw records committed, {self.inputs_left} input record(s) and {self.run_lag} run "
                f"record(s) not committed, parked={self.parked}, health={self.status or 'not answering'}")


#: A group coordinator moving or loading, or a request that timed out: asking again may succeed.
_TRANSIENT = frozenset({KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError.COORDINATOR_NOT_AVAILABLE,
                        KafkaError.REQUEST_TIMED_OUT, KafkaError._TIMED_OUT, KafkaError._TRANSPORT, KafkaError._WAIT_COORD})


def _retriable(exc: BaseException, codes: frozenset = _TRANSIENT) -> bool:
    """A Kafka error flagged retriable, or one of ``codes`` (a look's: ``TRANSIENT``)."""
    if not (isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError)):
        return False
    return exc.args[0].retriable() or exc.args[0].code() in codes


class RunProgress:
    """The committed offsets of one run's groups against its input as it stood at creation.

    Committed offsets are read with one consumer per group that never subscribes (so it
    never joins the group), not with ``AdminClient.list_consumer_group_offsets``: that
    call crashes the process when the coordinator answers NOT_COORDINATOR
    (librdkafka#5040, met here on fresh groups). Close it when done (or use ``with``).
    """

    def __init__(self, client_config: dict, catalogue: TopicCatalogue, app_id: str, timeout: float = 10.0) -> None:
        self.app_id = app_id
        self.timeout = timeout
        # (librdkafka's lines through Python logging, where the CLI keeps one per state change:
        # without a logger each reconnect attempt went to stderr — hundreds for one `status`)
        client_config = {**client_config, "logger": logging.getLogger("librdkafka")}
        self.admin = AdminClient(client_config)
        self.groups = worker_groups(catalogue, app_id)
        self.consumers = {group: Consumer({**client_config, "group.id": group, "enable.auto.commit": False}) for group in self.groups}
        self.raw = set(catalogue.raw_topics)
        self.inputs = {catalogue.deadletter, *catalogue.raw_topics}  # the shared topics: their end is fixed at start
        partitions = self._partitions(self.inputs)
        missing = self.raw - {tp.topic for tp in partitions}
        if missing:
            self.close()
            raise LookupError(f"raw topic(s) {', '.join(sorted(missing))} do not exist (wrong GPULEDGER_KAFKA_TOPIC_PREFIX?)")
        self.first = self._offsets(partitions, OffsetSpec.earliest())
        self.targets = self._offsets(partitions, OffsetSpec.latest())
        self.total = sum(end - self.first[tp] for tp, end in self.targets.items() if tp[0] in self.raw)

    def _partitions(self, topics) -> list[TopicPartition]:
        meta = self.admin.list_topics(timeout=self.timeout).topics
        return [TopicPartition(t, p) for t in sorted(topics) if t in meta for p in sorted(meta[t].partitions)]

    def _offsets(self, partitions: list[TopicPartition], spec) -> dict[tuple[str, int], int]:
        """The partitions' offsets of ``spec``, asked again for up to ``timeout`` seconds while the
        broker answers with an error the next request may not meet (``TRANSIENT``): right after a
        broker restart it said "Leader epoch is newer than broker epoch" for a few seconds, and a
        ``status`` or ``replay`` started then ended with that error (an exploratory chaos review)."""
        if not partitions:
            return {}

        def ask() -> dict[tuple[str, int], int]:
            futures = self.admin.list_offsets({tp: spec for tp in partitions}, request_timeout=self.timeout)
            return {(tp.topic, tp.partition): fut.result().offset for tp, fut in futures.items()}

        return self._retrying(lambda exc: _retriable(exc, TRANSIENT))(ask)

    def _retrying(self, retriable: Callable[[BaseException], bool]) -> Retrying:
        """Calls asked again while ``retriable`` says so, for up to ``timeout`` seconds."""
        return Retrying(retry=retry_if_exception(retriable), stop=stop_after_delay(self.timeout),
                        wait=wait_exponential(multiplier=0.1, max=1.0), reraise=True)

    def committed(self) -> dict[str, dict[tuple[str, int], int]]:
        """Group -> its committed offsets on the topics it reads (empty for a new group).

        A group's coordinator that is moving or still loading (``NOT_COORDINATOR``,
        ``COORDINATOR_LOAD_IN_PROGRESS``: a fresh broker's first groups, a broker failover) is
        asked again for up to ``timeout`` seconds: a replay on a just-started broker ended at once
        with "Failed to get committed offsets: Broker: Not coordinator"."""
        meta = self.admin.list_topics(timeout=self.timeout).topics
        out = {}
        for group, topics in self.groups.items():
            parts = [TopicPartition(t, p) for t in topics if t in meta for p in sorted(meta[t].partitions)]
            got = self._committed(group, parts) if parts else []
            out[group] = {(tp.topic, tp.partition): tp.offset for tp in got if tp.offset >= 0}
        return out

    def _committed(self, group: str, parts: list[TopicPartition]) -> list[TopicPartition]:
        return self._retrying(_retriable)(self.consumers[group].committed, parts, timeout=self.timeout)

    def look(self, health: dict | None) -> Look:
        committed = self.committed()
        run_parts = self._partitions({t for topics in self.groups.values() for t in topics} - self.inputs)
        first = {**self.first, **self._offsets(run_parts, OffsetSpec.earliest())}
        ends = self._offsets(run_parts, OffsetSpec.latest())
        done = left = lag = 0
        done_by: dict[str, int] = {}
        for tp, end in self.targets.items():
            at = {group: max(offsets.get(tp, 0), first[tp]) for group, offsets in committed.items() if tp[0] in self.groups[group]}
            left += sum(max(end - a, 0) for a in at.values())
            if tp[0] in self.raw:
                done += min(min(at.values()), end) - first[tp]
                for group, a in at.items():
                    done_by[group] = done_by.get(group, 0) + min(a, end) - first[tp]
        for tp, end in ends.items():
            lag += sum(_behind(end, offsets, tp, first) for group, offsets in committed.items() if tp[0] in self.groups[group])
        stats = (health or {}).get("stats", {})
        return Look(done, self.total, left, lag, stats.get("parked"), (health or {}).get("status"), done_by)

    def raw_read(self, group: str, since: dict[tuple[str, int], int] | None = None) -> tuple[int, int]:
        """(records of the raw topics ``group`` has committed beyond ``since`` — its committed offsets at
        an earlier time, None: from the first retained record —, how many of them were published after
        this progress was created, beyond ``total``'s end offsets): what a run read, counted as Kafka
        counts it, where the stage's own counters also count records published while it ran, and
        start afresh when its process is restarted."""
        committed = self.committed().get(group, {})
        read = late = 0
        for tp, end in self.targets.items():
            if tp[0] not in self.raw:
                continue
            at = max(committed.get(tp, 0), self.first[tp])
            read += max(at - max((since or {}).get(tp, 0), self.first[tp]), 0)
            late += max(at - max(end, (since or {}).get(tp, 0)), 0)
        return read, late

    def group_lag(self) -> dict[str, dict]:
        """Per consumer group of the run, now: the topics it reads, their ``partitions``, the
        ``lag`` (records between each partition's end and the group's committed offset — from
        the first retained record where it never committed, as the group would read it) and
        ``never_committed``, the partitions holding records the group has not committed on, and
        ``committed_partitions``, those it has (0: the group never committed — it may not exist)."""
        committed = self.committed()
        parts = self._partitions({t for topics in self.groups.values() for t in topics})
        first = {**self.first, **self._offsets([tp for tp in parts if (tp.topic, tp.partition) not in self.first], OffsetSpec.earliest())}
        ends = self._offsets(parts, OffsetSpec.latest())
        out = {}
        for group, topics in self.groups.items():
            mine = [tp for tp in ends if tp[0] in topics]
            offsets = committed.get(group, {})
            out[group] = {
                "topics": list(topics), "partitions": len(mine),
                "lag": sum(_behind(ends[tp], offsets, tp, first) for tp in mine),
                "never_committed": sum(1 for tp in mine if tp not in offsets and ends[tp] > first[tp]),
                "committed_partitions": sum(1 for tp in mine if tp in offsets),
            }
        return out

    def close(self) -> None:
        for consumer in self.consumers.values():
            consumer.close()

    def __enter__(self) -> RunProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _behind(end: int, offsets: dict[tuple[str, int], int], tp: tuple[str, int], first: dict[tuple[str, int], int]) -> int:
    """Records of partition ``tp`` up to ``end`` that a group has not committed: from its committed
    offset (``offsets``), or from the first retained record where it never committed or its
    offset was trimmed away (``first``) — where the group reads from."""
    return max(end - max(offsets.get(tp, 0), first[tp]), 0)


def worker_health(url: str, timeout: float = 5.0) -> dict | None:
    """The worker's health page at ``url`` (its loopback web address), None while it does not answer."""
    try:
        with urllib.request.urlopen(f"{url}/gpuledger/health/", timeout=timeout) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def wait_caught_up(progress: RunProgress, health: Callable[[], dict | None], timeout: float | None = None,
                   on_look: Callable[[Look], None] | None = None, interval: float = LOOK_INTERVAL_S) -> Look:
    """Look every ``interval`` seconds until two consecutive looks are caught up; return
    the last. ``health()`` returns the worker's health page (None while it does not
    answer; it may raise to abort, e.g. when the worker died). ``on_look`` sees every
    look (a progress bar). Raises ``TimeoutError`` naming what was left after ``timeout``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    calm, look = 0, None
    while True:
        try:
            look, problem = progress.look(health()), None
        except KafkaException as exc:
            # Topics the worker just created have no leader for a moment: such a look is
            # not caught up, the next one may be. What retrying cannot fix ends the wait.
            error = exc.args[0]
            if not (error.retriable() or error.code() in TRANSIENT):
                raise
            problem = error.str()
        if problem is None and on_look is not None:
            on_look(look)
        calm = calm + 1 if problem is None and look.caught_up else 0
        if calm >= 2:
            return look
        if deadline is not None and time.monotonic() >= deadline:
            left = problem or look.describe()
            raise TimeoutError(f"run {progress.app_id} not caught up after {timeout:.0f}s: {left}")
        time.sleep(interval)
