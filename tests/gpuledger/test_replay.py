"""`gpuledger replay` end to end: the real broker, the real worker (a child of the
replay command), real embedded ClickHouse.

One recorded history (a small GPU fleet plus the control scenario, as in
tests/streams/test_faults.py) is published once. A live worker processes it until
caught up (``Run.wait_done``: ``streams.progress.wait_caught_up``, the definition the
replay uses) and its tables are checksummed. Then `gpuledger replay` runs as a subprocess: a full
replay must rebuild every table identically; a ``--from/--to`` replay must hold only
the range's events while attributing them to releases registered before the range;
the refusals must refuse; and `gpuledger trace` must read the sandbox.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from datetime import datetime, timedelta, timezone

import pytest

from producers._kafka import EventPublisher, ensure_topics
from schemas.topics import TopicCatalogue
from tests.streams.test_faults import T0, Run, fleet

pytestmark = pytest.mark.timeout(900)

PODS = 48
#: The replay's worker settings: quick idle flush and sink batches — and other batch
#: sizes than the live run's (test_faults.ENV), which must not change a single row.
ENV = {"GPULEDGER_STREAMS_PARK_IDLE_FLUSH_S": "1", "GPULEDGER_CLICKHOUSE_BATCH_SECONDS": "0.2"}
#: The range of the range replay: pods 10..29 of the fleet are scheduled in it (pod p at
#: T0 + 10 min + 7p s, its other events up to 5 s later); every release event is before it.
FROM = T0 + timedelta(minutes=10, seconds=7 * 10)
TO = T0 + timedelta(minutes=10, seconds=7 * 30)


#: After the range: fr-2 rolled back from prod while pods of it (fp-14, fp-20, fp-26: scheduled in the
#: range, their GPUs never released) still run there — control 2 in the live store. A replay ending at TO must
#: not know of it (exploratory review: the release directory read it anyway, and the sandbox
#: opened a violation after --to that the range could not have).
ROLLBACK_AT = TO + timedelta(minutes=1)


def rollback():
    from schemas import Identity, ReleaseEvent, Source, make_event_id
    from schemas.release import ReleasePayload

    ident = Identity(release_id="fr-2", model_name="fm2", model_version="2", image_digest=f"sha256:{2:064x}", owner="team-0",
                     environment="prod")
    return ReleaseEvent(event_id=make_event_id("f", ("fr-2", "rollback")), event_type="release.rolled_back", occurred_at=ROLLBACK_AT,
                        observed_at=ROLLBACK_AT, source=Source(collector="test"), identity=ident,
                        payload=ReleasePayload(actor="alice", reason="quality regression", to_environment="prod"))


#: The edge range [EDGE_FROM, EDGE]: after every fleet pod (the last is scheduled at T0 + 10 min + 329 s)
#: and fr-2's rollback, so that workload fleet/Job/edge of release fr-4, started in it, is its latest
#: prod run. At EDGE, with the times real senders give: pod edge-1 is deleted (Kubernetes: whole
#: seconds); 400 us later (Alertmanager sends nanoseconds, Kubernetes' eventTime is MicroTime) an alert on
#: edge-0 fires and fr-4 is rolled back — stored, and read by `audit --to EDGE` and `trace --at EDGE`, at
#: EDGE. After EDGE: edge-1's GPU release (the pod-resources poll, 616 ms later), the alert's resolution.
EDGE = T0 + timedelta(minutes=17)
EDGE_FROM = EDGE - timedelta(minutes=1)
MICRO = timedelta(microseconds=400)


def edge():
    from schemas import AlertEvent, GpuEvent, Identity, ReleaseEvent, SchedulerEvent, Source, make_event_id
    from schemas.alert import AlertPayload
    from schemas.gpu import GpuPayload
    from schemas.release import ReleasePayload
    from schemas.scheduler import SchedulerPayload

    src, digest = Source(collector="test"), f"sha256:{4:064x}"
    out = []
    for name, started in (("edge-0", EDGE - timedelta(seconds=20)), ("edge-1", EDGE - timedelta(seconds=30))):
        pod = Identity(namespace="fleet", pod=name, workload_id="fleet/Job/edge", node="fn0", release_id="fr-4", environment="prod")
        gpu = Identity(namespace="fleet", pod=name, node="fn0", gpu_id=f"GPU-{name.upper()}")
        holds = GpuPayload(node="fn0", namespace="fleet", pod=name, container="main", device_id=f"GPU-{name.upper()}", gpu=f"GPU-{name.upper()}")
        out += [SchedulerEvent(event_id=make_event_id("e", (name, "sched")), event_type="scheduler.scheduled", occurred_at=started,
                               observed_at=started, source=src, identity=pod, payload=SchedulerPayload(object_kind="Pod", image_digests=(digest,))),
                GpuEvent(event_id=make_event_id("e", (name, "gpu")), event_type="gpu.assigned", occurred_at=started + timedelta(seconds=1),
                         observed_at=started, source=src, identity=gpu, payload=holds)]
        if name == "edge-1":
            out += [SchedulerEvent(event_id=make_event_id("e", (name, "del")), event_type="scheduler.deleted", occurred_at=EDGE, observed_at=EDGE,
                                   source=src, identity=pod, payload=SchedulerPayload(object_kind="Pod")),
                    GpuEvent(event_id=make_event_id("e", (name, "rel")), event_type="gpu.released", occurred_at=EDGE + timedelta(milliseconds=616),
                             observed_at=EDGE, source=src, identity=gpu, payload=holds)]
    alert = Identity(alert_fingerprint="fedge", namespace="fleet", pod="edge-0")
    for etype, at in (("alert.firing", EDGE + MICRO), ("alert.resolved", EDGE + timedelta(seconds=30))):
        out.append(AlertEvent(event_id=make_event_id("e", ("fedge", etype)), event_type=etype, occurred_at=at, observed_at=at, source=src,
                              identity=alert, payload=AlertPayload(alertname="Quality", starts_at=EDGE + MICRO,
                                                                    ends_at=at if etype == "alert.resolved" else None)))
    release = Identity(release_id="fr-4", model_name="fm1", model_version="4", image_digest=digest, owner="team-0", environment="prod")
    out.append(ReleaseEvent(event_id=make_event_id("e", ("fr-4", "rollback")), event_type="release.rolled_back", occurred_at=EDGE + MICRO,
                            observed_at=EDGE + MICRO, source=src, identity=release,
                            payload=ReleasePayload(actor="alice", reason="quality regression", to_environment="prod")))
    return out


def at_ms(value: datetime) -> datetime:
    """An event time as the store keeps it (DateTime64(3): cut to the millisecond)."""
    return value.replace(microsecond=value.microsecond // 1000 * 1000)


#: Readers' lines whole (rich folds them at 80 columns without a terminal).
WIDE = {"COLUMNS": "400"}


def iso(value: datetime) -> str:
    return value.isoformat().replace("+00:00", "Z")


@pytest.fixture(scope="module")
def history(kafka_bootstrap):
    cat = TopicCatalogue(prefix=f"replay{uuid.uuid4().hex[:6]}", raw_partitions=4)
    ensure_topics({"bootstrap.servers": kafka_bootstrap}, cat)
    events = [*fleet(PODS), rollback(), *edge()]
    EventPublisher({"bootstrap.servers": kafka_bootstrap}, cat, "test").publish_batch(events)
    # The edge's dead letters (the receiver's, the collectors'): one refused inside the range
    # replay's range, one before it.
    from confluent_kafka import Producer

    from schemas import encode_event
    from schemas.outputs import DeadLetter

    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for name, at in (("inside", FROM + timedelta(seconds=30)), ("before", FROM - timedelta(minutes=5))):
        letter = DeadLetter(reason="validation", error=f"refused {name} the range", stage="receiver", value="{}", failed_at=at)
        producer.produce(cat.deadletter, key=name.encode(), value=encode_event(letter))
    assert producer.flush(30) == 0
    return cat, events


@pytest.fixture(scope="module")
def live(kafka_bootstrap, history, tmp_path_factory):
    """The live run: its app id, store DSN and checksums."""
    cat, events = history
    run = Run(kafka_bootstrap, cat, tmp_path_factory.mktemp("live"), f"{cat.prefix}-live").start()
    run.wait_done(len(events))  # streams.progress.wait_caught_up, the replay's definition of done
    return run, run.stop_and_checksum()


def gpuledger(kafka_bootstrap, cat, tmp_path, *args, live_dsn: str = "chdb:///nonexistent/live", timeout: float = 420,
              extra_env: dict | None = None):
    """Run the CLI with the test's broker and topics; the live store is ``live_dsn``."""
    env = {**os.environ, "GPULEDGER_KAFKA_BOOTSTRAP": kafka_bootstrap, "GPULEDGER_KAFKA_TOPIC_PREFIX": cat.prefix,
           "GPULEDGER_KAFKA_RAW_PARTITIONS": str(cat.raw_partitions), "GPULEDGER_DATA_DIR": str(tmp_path / "data"),
           "GPULEDGER_CLICKHOUSE_DSN": live_dsn, **ENV, **(extra_env or {})}
    return subprocess.run([sys.executable, "-m", "gpuledger.cli", *args], env=env, capture_output=True, text=True, timeout=timeout)


def checksum(dsn: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "sinks.checksum", dsn], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def sql(kafka_bootstrap, cat, tmp_path, dsn: str, query: str) -> list[dict]:
    out = gpuledger(kafka_bootstrap, cat, tmp_path, "sql", query, "--dsn", dsn, "--format", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def full_replay(kafka_bootstrap, history, live, tmp_path_factory):
    cat, _events = history
    tmp = tmp_path_factory.mktemp("full")
    sandbox = f"chdb://{tmp / 'sandbox'}"
    out = gpuledger(kafka_bootstrap, cat, tmp, "replay", "--into", sandbox, "--app-id", f"{cat.prefix}-full", "--timeout", "300",
                    live_dsn=live[0].dsn)
    return out, sandbox, tmp


def test_a_full_replay_rebuilds_the_live_tables_identically(history, live, full_replay):
    cat, events = history
    out, sandbox, tmp = full_replay
    assert out.returncode == 0, out.stderr + out.stdout
    assert f"{len(events)} events on the raw topics" in out.stderr
    assert f"worker log: {tmp / 'data' / 'replays' / (cat.prefix + '-full') / 'worker.log'}" in out.stderr
    assert f"replayed {len(events)} raw records in " in out.stdout and f": {len(events)} in range, 0 out of range" in out.stdout, out.stdout
    assert f"gpuledger.correlated_events\t{len(events)} rows" in out.stdout
    sums = checksum(sandbox)
    assert sums == live[1]
    # rows as readers see them: without the withdrawn violations' tombstones, whose number depends on
    # the run's processing order (five replays of one history printed five counts)
    assert f"gpuledger.violations\t{sums['violations'][0]} rows" in out.stdout, out.stdout


def test_trace_reads_the_sandbox(kafka_bootstrap, history, full_replay, tmp_path):
    cat, _ = history
    _, sandbox, _ = full_replay
    pod_at = T0 + timedelta(minutes=10, seconds=7 * 5 + 3)  # pod fp-5 holds its GPU
    out = gpuledger(kafka_bootstrap, cat, tmp_path, "trace", "--pod", "fleet/fp-5", "--at", iso(pod_at), "--dsn", sandbox)
    assert out.returncode == 0, out.stderr + out.stdout
    assert "release fr-5" in out.stdout and "pod fleet/fp-5" in out.stdout


def test_a_range_replay_holds_only_the_range_and_attributes_to_earlier_releases(kafka_bootstrap, history, live, tmp_path):
    cat, events = history
    sandbox = f"chdb://{tmp_path / 'sandbox'}"
    out = gpuledger(kafka_bootstrap, cat, tmp_path, "replay", "--into", sandbox, "--app-id", f"{cat.prefix}-range",
                    "--from", iso(FROM), "--to", iso(TO), "--timeout", "300", live_dsn=live[0].dsn)
    assert out.returncode == 0, out.stderr + out.stdout
    in_range = [e for e in events if FROM <= e.occurred_at <= TO]  # closed: pod fp-30's scheduling sits on TO
    assert in_range and not any(e.event_type.startswith("release.") for e in in_range)
    assert f"{len(in_range)} in range, {len(events) - len(in_range)} out of range" in out.stdout
    span = ("SELECT count() AS n, countIf(occurred_at >= toDateTime64('{f}', 3, 'UTC') AND occurred_at <= toDateTime64('{t}', 3, 'UTC')) AS inside "
            "FROM gpuledger.{table} FINAL")
    for table in ("correlated_events", "raw_events"):
        rows = sql(kafka_bootstrap, cat, tmp_path, sandbox, span.format(table=table, f=FROM.strftime("%F %T"), t=TO.strftime("%F %T")))
        assert rows == [{"n": len(in_range), "inside": len(in_range)}], table
    # No release event is in the range, yet the range's pods are attributed to their releases
    # (label or image digest): the release directory read the whole release topic.
    scheduled = sql(kafka_bootstrap, cat, tmp_path, sandbox,
                    "SELECT pod, release_id FROM gpuledger.correlated_events FINAL WHERE event_type = 'scheduler.scheduled'")
    assert len(scheduled) == 21  # fp-10 … fp-30: the one at --to is in the range
    assert all(r["release_id"] == f"fr-{int(r['pod'].split('-')[1]) % 6}" for r in scheduled), scheduled
    assert sql(kafka_bootstrap, cat, tmp_path, sandbox, "SELECT count() AS n FROM gpuledger.release_history FINAL") == [{"n": 0}]
    # the edge's dead letters: those refused in the range (the live store has both)
    letters = "SELECT error FROM gpuledger.dead_letters WHERE stage = 'receiver' ORDER BY error"
    assert sql(kafka_bootstrap, cat, tmp_path, sandbox, letters) == [{"error": "refused inside the range"}]
    assert sql(kafka_bootstrap, cat, tmp_path, live[0].dsn, letters) == [{"error": "refused before the range"}, {"error": "refused inside the range"}]
    # The readers say what the sandbox is (exploratory review: an audit of the range there passed a
    # control the live store fails — its violation opened before --from — and nothing said why).
    said = f"this store is a replay (gpuledger replay, app id {cat.prefix}-range) of the events in [{iso(FROM).replace('Z', '.000Z')}, "
    audit = gpuledger(kafka_bootstrap, cat, tmp_path, "audit", "--dsn", sandbox, "--from", iso(FROM), "--to", iso(TO), "--format", "json")
    assert audit.returncode in (0, 1, 4), audit.stderr
    assert [n for n in json.loads(audit.stdout)["notes"] if n.startswith(said)], audit.stdout
    assert json.loads(gpuledger(kafka_bootstrap, cat, tmp_path, "audit", "--dsn", live[0].dsn, "--from", iso(FROM), "--to", iso(TO),
                                "--format", "json").stdout)["notes"] == []
    tree = gpuledger(kafka_bootstrap, cat, tmp_path, "trace", "--pod", "fleet/fp-12", "--dsn", sandbox)
    assert tree.returncode == 0 and "this store is a replay" in tree.stdout, tree.stderr + tree.stdout
    # Nothing after --to: fr-2's rollback opened control 2 in the live store, not in the sandbox.
    after = ("SELECT control_id, release_id FROM gpuledger.violations FINAL "
             f"WHERE opened_at > toDateTime64('{TO.strftime('%F %T')}', 3, 'UTC') AND NOT startsWith(detail, 'withdrawn:') ORDER BY control_id")
    assert sql(kafka_bootstrap, cat, tmp_path, sandbox, after) == []
    assert {"control_id": 2, "release_id": "fr-2"} in sql(kafka_bootstrap, cat, tmp_path, live[0].dsn, after)


@pytest.fixture(scope="module")
def edge_replay(kafka_bootstrap, history, live, tmp_path_factory):
    """The replay of [EDGE_FROM, EDGE] (``edge``): the output, the sandbox DSN, its tmp dir."""
    cat, _events = history
    tmp = tmp_path_factory.mktemp("edge")
    sandbox = f"chdb://{tmp / 'sandbox'}"
    out = gpuledger(kafka_bootstrap, cat, tmp, "replay", "--into", sandbox, "--app-id", f"{cat.prefix}-edge", "--from", iso(EDGE_FROM),
                    "--to", iso(EDGE), "--timeout", "300", live_dsn=live[0].dsn)
    assert out.returncode == 0, out.stderr + out.stdout
    return out, sandbox


def test_a_range_keeps_the_events_the_store_keeps_at_its_bound(kafka_bootstrap, history, live, edge_replay, tmp_path):
    """Exploratory review: an event at EDGE + 400 us is stored at EDGE (DateTime64(3)), so `audit --to EDGE`
    and `trace --at EDGE` read it on the live store — and `replay --to EDGE`, comparing to the microsecond,
    skipped it: the route stage and the raw sink dropped the alert and fr-4's rollback, and the release
    directory did not apply the rollback (control 2 of the workload still running in prod was not there)."""
    cat, events = history
    out, sandbox = edge_replay
    in_range = [e for e in events if EDGE_FROM <= at_ms(e.occurred_at) <= EDGE]
    assert {e.event_type for e in in_range if e.occurred_at > EDGE} == {"alert.firing", "release.rolled_back"}
    assert f": {len(in_range)} in range, {len(events) - len(in_range)} out of range, 0 dead-lettered" in out.stdout, out.stdout
    # The sandbox's rows are the live store's rows of the range, read with the same bounds.
    rows = ("SELECT event_type, toString(occurred_at) AS at FROM gpuledger.{table} FINAL WHERE occurred_at >= toDateTime64('{f}', 3, 'UTC') "
            "AND occurred_at <= toDateTime64('{t}', 3, 'UTC') ORDER BY occurred_at, event_type")
    for table in ("correlated_events", "raw_events"):
        query = rows.format(table=table, f=EDGE_FROM.strftime("%F %T"), t=EDGE.strftime("%F %T"))
        got = sql(kafka_bootstrap, cat, tmp_path, sandbox, query)
        assert got == sql(kafka_bootstrap, cat, tmp_path, live[0].dsn, query), table
        assert {"event_type": "release.rolled_back", "at": "2026-11-01 06:17:00.000"} in got, (table, got)
    # trace --at EDGE reads the alert and the rollback in both stores
    for dsn in (live[0].dsn, sandbox):
        tree = gpuledger(kafka_bootstrap, cat, tmp_path, "trace", "--alert", "fedge", "--at", iso(EDGE), "--dsn", dsn, extra_env=WIDE)
        assert tree.returncode == 0, tree.stderr
        assert "alert Quality (no severity) firing at 2026-11-01T06:17:00.000Z (fingerprint fedge)" in tree.stdout, tree.stdout
        assert "release fr-4  state=release.rolled_back since 2026-11-01T06:17:00.000Z" in tree.stdout, tree.stdout
    # The release directory applied the rollback: the workload still running in prod after it is control 2's, as live.
    c2 = ("SELECT control_id, release_id, toString(opened_at) AS opened FROM gpuledger.violations FINAL WHERE workload_id = 'fleet/Job/edge' "
          "AND NOT startsWith(detail, 'withdrawn:') ORDER BY control_id")
    assert sql(kafka_bootstrap, cat, tmp_path, sandbox, c2) == [{"control_id": 2, "release_id": "fr-4", "opened": "2026-11-01 06:17:00.000"}]
    assert sql(kafka_bootstrap, cat, tmp_path, live[0].dsn, c2) == sql(kafka_bootstrap, cat, tmp_path, sandbox, c2)


def test_a_sandbox_asked_about_a_time_after_its_end_says_so_before_the_chain(kafka_bootstrap, history, live, edge_replay, tmp_path):
    """Exploratory review: `trace --at` a minute after a range sandbox's end said the alert was firing, its
    release promoted — the live store, resolved and rolled back; only a note at the bottom said the store
    was a replay, and only of what was before its start."""
    cat, _ = history
    _out, sandbox = edge_replay
    later = EDGE + timedelta(minutes=1)
    live_tree = gpuledger(kafka_bootstrap, cat, tmp_path, "trace", "--alert", "fedge", "--at", iso(later), "--dsn", live[0].dsn, extra_env=WIDE)
    assert "alert Quality (no severity) resolved at 2026-11-01T06:17:30.000Z" in live_tree.stdout and "warning" not in live_tree.stdout
    tree = gpuledger(kafka_bootstrap, cat, tmp_path, "trace", "--alert", "fedge", "--at", iso(later), "--dsn", sandbox, extra_env=WIDE)
    assert tree.returncode == 0, tree.stderr
    lines = tree.stdout.splitlines()
    assert lines[0].startswith("alert Quality (no severity) firing at 2026-11-01T06:17:00.000Z"), tree.stdout
    # said at once, under the title, before anything the sandbox answers
    said = ("warning: --at 2026-11-01T06:18:00.000Z is after the end of this replay, 2026-11-01T06:17:00.000Z: events after "
            "2026-11-01T06:17:00.000Z are not in this store, so what follows is as it stood at 2026-11-01T06:17:00.000Z")
    assert lines[1].startswith("├── " + said), tree.stdout
    warnings = json.loads(gpuledger(kafka_bootstrap, cat, tmp_path, "trace", "--alert", "fedge", "--at", iso(later), "--dsn", sandbox,
                                    "--format", "json").stdout)["warnings"]
    assert len(warnings) == 1 and warnings[0].startswith(said.removeprefix("warning: ")), warnings
    # No --at: "now" in the sandbox is its end.
    now = gpuledger(kafka_bootstrap, cat, tmp_path, "trace", "--alert", "fedge", "--dsn", sandbox, extra_env=WIDE)
    assert now.stdout.splitlines()[1].startswith('├── warning: no --at: "now" in this replay is its end, 2026-11-01T06:17:00.000Z'), now.stdout
    # At its end, no warning: the sandbox answers as the live store.
    at_end = gpuledger(kafka_bootstrap, cat, tmp_path, "trace", "--alert", "fedge", "--at", iso(EDGE), "--dsn", sandbox, extra_env=WIDE)
    assert "warning" not in at_end.stdout and "this store is a replay" in at_end.stdout, at_end.stdout
    # audit --to after the end: a note (table and JSON); to its end: none
    audit = gpuledger(kafka_bootstrap, cat, tmp_path, "audit", "--dsn", sandbox, "--from", iso(EDGE_FROM), "--to", iso(later), extra_env=WIDE)
    assert "note: --to 2026-11-01T06:18:00.000Z is after the end of this replay, 2026-11-01T06:17:00.000Z: events after" in audit.stdout, audit.stdout
    notes = json.loads(gpuledger(kafka_bootstrap, cat, tmp_path, "audit", "--dsn", sandbox, "--from", iso(EDGE_FROM), "--to", iso(EDGE),
                                 "--format", "json").stdout)["notes"]
    assert len(notes) == 1 and notes[0].startswith("this store is a replay"), notes


def test_a_range_sandboxs_evidence_says_what_lies_outside_its_range(kafka_bootstrap, history, live, edge_replay, tmp_path):
    """Exploratory review: in a range sandbox control 1 said "no release.approved before queue entry" beside
    a passing verdict (the approval was before --from: not in the sandbox, read by its controls), and control
    3 showed a GPU interval ended at --to by its pod's deletion where the live store said "held" (the GPU's
    release came 616 ms after --to)."""
    cat, _ = history
    _out, sandbox = edge_replay

    def audit(dsn: str) -> dict:
        out = gpuledger(kafka_bootstrap, cat, tmp_path, "audit", "--dsn", dsn, "--from", iso(EDGE_FROM), "--to", iso(EDGE), "--format", "json")
        assert out.returncode in (0, 1), out.stderr + out.stdout
        return json.loads(out.stdout)

    def section(report: dict, control: int) -> list[dict]:
        return next(s["rows"] for s in report["evidence"] if s["control"] == control)

    live_report, sandboxed = audit(live[0].dsn), audit(sandbox)
    edge_live = next(r for r in section(live_report, 1) if r["workload"] == "fleet/Job/edge")
    edge_sandbox = next(r for r in section(sandboxed, 1) if r["workload"] == "fleet/Job/edge")
    assert edge_live["approvals"].startswith("alice") and edge_live["verdict"] == edge_sandbox["verdict"] == "no violation recorded"
    assert edge_sandbox["approvals"] == ("no release.approved before queue entry in this replay: it starts at 2026-11-01T06:16:00.000Z, "
                                         "and an approval before then is not in this store (its controls read every release event, "
                                         "and judged with it)"), edge_sandbox
    gpus = {s["value"].split(" ")[0]: s["value"] for s in section(sandboxed, 3) if s["step"] == "gpu"}
    assert {s["value"] for s in section(live_report, 3) if s["step"] == "gpu"} == {
        "fn0/GPU-EDGE-0 2026-11-01T06:16:41Z → held", "fn0/GPU-EDGE-1 2026-11-01T06:16:31Z → held"}
    assert gpus == {"fn0/GPU-EDGE-0": "fn0/GPU-EDGE-0 2026-11-01T06:16:41Z → held",
                    "fn0/GPU-EDGE-1": "fn0/GPU-EDGE-1 2026-11-01T06:16:31Z → 2026-11-01T06:17:00Z (pod deleted; the GPU's release is not "
                                      "in this replay: after its end, 2026-11-01T06:17:00.000Z, or never)"}, gpus
    # and the trace the same way
    cut = "(pod deleted; the GPU's release is not in this replay: after its end, 2026-11-01T06:17:00.000Z, or never)"
    tree = gpuledger(kafka_bootstrap, cat, tmp_path, "trace", "--pod", "fleet/edge-1", "--at", iso(EDGE), "--dsn", sandbox, extra_env=WIDE)
    assert f"GPU fn0/GPU-EDGE-1  2026-11-01T06:16:31.000Z → 2026-11-01T06:17:00.000Z {cut}" in tree.stdout, tree.stdout
    live_tree = gpuledger(kafka_bootstrap, cat, tmp_path, "trace", "--pod", "fleet/edge-1", "--at", iso(EDGE), "--dsn", live[0].dsn, extra_env=WIDE)
    assert "GPU fn0/GPU-EDGE-1  2026-11-01T06:16:31.000Z → held" in live_tree.stdout, live_tree.stdout


def parked_at_the_end() -> tuple[list, datetime]:
    """A small fleet's history and, after every other event, a stray pod no release describes, with an
    alert on it: their rows stay parked until the idle flush (``GPULEDGER_STREAMS_PARK_IDLE_FLUSH_S``) or
    an event later than their park TTL (the event-time watermark). The history and the stray's time."""
    from schemas import AlertEvent, Identity, SchedulerEvent, make_event_id
    from schemas.alert import AlertPayload
    from schemas.scheduler import SchedulerPayload
    from tests.streams.test_faults import SRC

    history = fleet(6)
    at = max(e.occurred_at for e in history) + timedelta(minutes=1)  # after every other event: nothing moves its watermark on
    stray = Identity(namespace="fleet", pod="stray-0", node="fn0")
    return history + [
        SchedulerEvent(event_id=make_event_id("t", ("stray", "sched")), event_type="scheduler.scheduled", occurred_at=at, observed_at=at,
                       source=SRC, identity=stray, payload=SchedulerPayload(object_kind="Pod", image_digests=(f"sha256:{'e' * 64}",))),
        AlertEvent(event_id=make_event_id("t", ("stray", "q")), event_type="alert.firing", occurred_at=at, observed_at=at, source=SRC,
                   identity=Identity(alert_fingerprint="stray-q", namespace="fleet", pod="stray-0"),
                   payload=AlertPayload(alertname="Quality", starts_at=at)),
    ], at


def test_the_summary_counts_what_the_replay_read_and_says_what_came_while_it_ran(kafka_bootstrap, tmp_path):
    """Exploratory review: "replayed 152 events … 104 in range, 54 out of range" — 158: the route stage counted
    the records published after the replay started (and a record repeating an event is counted as
    often as it came), the total did not. Here two records come while the replay runs, a repeat of
    an event of the history and a later event — the replay cannot finish before the route stage read
    them: the stray's rows stay parked (no idle flush) until the later event moves the watermark."""
    from schemas import Identity, SchedulerEvent, make_event_id
    from schemas.scheduler import SchedulerPayload
    from tests.streams.test_faults import SRC

    cat = TopicCatalogue(prefix=f"late{uuid.uuid4().hex[:6]}", raw_partitions=4)
    ensure_topics({"bootstrap.servers": kafka_bootstrap}, cat)
    events, at = parked_at_the_end()
    publisher = EventPublisher({"bootstrap.servers": kafka_bootstrap}, cat, "test")
    publisher.publish_batch(events)
    repeat = next(e for e in events if e.event_type == "scheduler.scheduled" and e.identity.release_id == "fr-1")
    later = SchedulerEvent(event_id=make_event_id("t", ("late", "sched")), event_type="scheduler.scheduled", occurred_at=at + timedelta(minutes=10),
                           observed_at=at + timedelta(minutes=10), source=SRC,
                           identity=Identity(namespace="fleet", pod="late-0", node="fn1", release_id="fr-1"),
                           payload=SchedulerPayload(object_kind="Pod", image_digests=(f"sha256:{1:064x}",)))
    env = {**os.environ, "GPULEDGER_KAFKA_BOOTSTRAP": kafka_bootstrap, "GPULEDGER_KAFKA_TOPIC_PREFIX": cat.prefix,
           "GPULEDGER_KAFKA_RAW_PARTITIONS": str(cat.raw_partitions), "GPULEDGER_DATA_DIR": str(tmp_path / "data"),
           "GPULEDGER_CLICKHOUSE_DSN": "chdb:///nonexistent/live", **ENV, "GPULEDGER_STREAMS_PARK_IDLE_FLUSH_S": "3600"}
    replay = subprocess.Popen([sys.executable, "-m", "gpuledger.cli", "replay", "--into", f"chdb://{tmp_path / 'sandbox'}", "--app-id",
                               f"{cat.prefix}-late", "--timeout", "300"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # printed once the replay took the raw topics' end offsets (its total), before its worker starts
        header = next((line for line in replay.stderr if "events on the raw topics" in line), "")
        assert f"{len(events)} events on the raw topics" in header, header
        # (one key, one partition: the repeat is read before the later event)
        assert repeat.correlation_key() == later.correlation_key()
        publisher.publish_batch([repeat, later])
        out, err = replay.communicate(timeout=360)
    finally:
        if replay.poll() is None:
            replay.kill()
    assert replay.returncode == 0, header + err + out
    n = len(events)
    assert f"replayed {n + 2} raw records in " in out and f": {n + 2} in range, 0 out of range, 0 dead-lettered\n" in out, out
    assert f"  {n} were on the raw topics when it started, 2 were published while it ran" in out, out
    # rows: the repeated event is one row
    assert f"gpuledger.correlated_events\t{n + 1} rows" in out, out


def test_a_resumed_replay_waits_for_the_rows_its_recovered_state_parked(kafka_bootstrap, tmp_path):
    """A replay stopped once its input was read while rows were still parked (a stray pod no
    release describes, at the end of the history: it waits for the idle flush), then resumed: the
    resumed worker has no input left and its recovered rows go out only on the idle timer —
    health said 0 parked (the count the last batch left, and no batch ran), so the resume called
    the run caught up and stopped it first: rows missing, exit 0."""
    cat = TopicCatalogue(prefix=f"resume{uuid.uuid4().hex[:6]}", raw_partitions=4)
    ensure_topics({"bootstrap.servers": kafka_bootstrap}, cat)
    events, _at = parked_at_the_end()
    EventPublisher({"bootstrap.servers": kafka_bootstrap}, cat, "test").publish_batch(events)
    whole = f"chdb://{tmp_path / 'whole'}"
    out = gpuledger(kafka_bootstrap, cat, tmp_path, "replay", "--into", whole, "--app-id", f"{cat.prefix}-whole", "--timeout", "300")
    assert out.returncode == 0, out.stderr + out.stdout

    sandbox, app_id = f"chdb://{tmp_path / 'sandbox'}", f"{cat.prefix}-resumed"
    stopped = gpuledger(kafka_bootstrap, cat, tmp_path, "replay", "--into", sandbox, "--app-id", app_id, "--timeout", "40",
                        extra_env={"GPULEDGER_STREAMS_PARK_IDLE_FLUSH_S": "3600"})
    assert stopped.returncode == 1, stopped.stderr + stopped.stdout
    assert "0 input record(s) and 0 run record(s) not committed, parked=2," in stopped.stderr, stopped.stderr
    resumed = gpuledger(kafka_bootstrap, cat, tmp_path, "replay", "--resume", "--app-id", app_id, "--into", sandbox, "--timeout", "300",
                        extra_env={"GPULEDGER_STREAMS_PARK_IDLE_FLUSH_S": "10"})  # (the default: the replay's looks come sooner)
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    assert (f"replayed {len(events)} raw records (resumed at {len(events)}; this run's route stage read 0)" in resumed.stdout
            and ": 0 in range, 0 out of range, 0 dead-lettered\n" in resumed.stdout), resumed.stdout
    assert checksum(sandbox) == checksum(whole)


def test_an_app_id_with_committed_offsets_is_refused_without_resume(kafka_bootstrap, history, live, tmp_path):
    cat, _ = history
    run, _ = live
    out = gpuledger(kafka_bootstrap, cat, tmp_path, "replay", "--into", f"chdb://{tmp_path / 'sandbox'}", "--app-id", run.app_id, live_dsn=run.dsn)
    assert out.returncode == 2, out.stderr
    assert f"app id {run.app_id} already has committed offsets" in out.stderr and "--resume" in out.stderr
    assert not (tmp_path / "sandbox").exists()


def test_the_live_store_and_a_used_sandbox_are_refused(kafka_bootstrap, history, live, full_replay, tmp_path):
    cat, _ = history
    run, _ = live
    out = gpuledger(kafka_bootstrap, cat, tmp_path, "replay", "--into", run.dsn, live_dsn=run.dsn)
    assert out.returncode == 2 and "is the live store" in out.stderr, out.stderr
    _, sandbox, _ = full_replay
    out = gpuledger(kafka_bootstrap, cat, tmp_path, "replay", "--into", sandbox, "--app-id", f"{cat.prefix}-again", live_dsn=run.dsn)
    assert out.returncode == 2 and "is not empty" in out.stderr, out.stderr
    out = gpuledger(kafka_bootstrap, cat, tmp_path, "replay", "--into", f"chdb://{tmp_path / 'x'}", "--from", "1h", "--to", "2h")
    assert out.returncode == 2 and "is after --to" in out.stderr, out.stderr


def test_a_sandbox_dsn_of_the_wrong_form_or_a_file_and_an_unwritable_work_dir_are_refused(kafka_bootstrap, history, tmp_path):
    """From an exploratory review: `chdb://tmp/sb` (two slashes) read as a host 'tmp' to
    clickhouse-connect and as a relative path here; the sink retried "database does not exist"
    for ever and the replay sat at 0/N saying nothing. A file as the sandbox did the same; an
    unwritable --work-dir was a traceback."""
    cat, _ = history
    out = gpuledger(kafka_bootstrap, cat, tmp_path, "replay", "--into", "chdb://tmp/rr-sb/twoslash")
    assert out.returncode == 2 and "three slashes" in out.stderr and "'tmp'" in out.stderr, out.stderr
    # The hint is the DSN with its third slash (it was resolved against the working directory).
    assert "did you mean chdb:///tmp/rr-sb/twoslash?" in " ".join(out.stderr.split()), out.stderr
    (tmp_path / "afile").write_text("x")
    out = gpuledger(kafka_bootstrap, cat, tmp_path, "replay", "--into", f"chdb://{tmp_path / 'afile'}")
    assert out.returncode == 2 and "is a file" in out.stderr, out.stderr
    out = gpuledger(kafka_bootstrap, cat, tmp_path, "replay", "--into", f"chdb://{tmp_path / 'sb'}", "--work-dir", "/proc/gpl-work",
                    "--app-id", f"{cat.prefix}-nowork")
    assert out.returncode == 2 and "--work-dir /proc/gpl-work" in out.stderr and "Traceback" not in out.stderr, out.stderr
    out = gpuledger(kafka_bootstrap, cat, tmp_path, "sql", "SELECT 1", "--format", "json",
                    extra_env={"GPULEDGER_CLICKHOUSE_DSN": "chdb://data/clickhouse"})
    assert out.returncode != 0 and "three slashes" in out.stderr, out.stderr


def test_a_sandbox_the_sink_cannot_write_ends_the_replay_naming_why(kafka_bootstrap, history, tmp_path):
    """A database the store refuses (its name): the sink retries its writes for ever, as a live
    worker must through an outage — the replay sat at 0/N, degraded, with no default timeout.
    It ends (exit 1) once the writes have failed STORE_FAILING_FATAL_S without progress, with the
    store's error."""
    cat, _ = history
    out = gpuledger(kafka_bootstrap, cat, tmp_path, "replay", "--into", f"chdb://{tmp_path / 'sb'}", "--database", "pm`x",
                    "--app-id", f"{cat.prefix}-baddb", timeout=300)
    assert out.returncode == 1, out.stderr + out.stdout
    assert "cannot be written" in out.stderr and "pm`x" in out.stderr, out.stderr


def stuck_replay(kafka_bootstrap, cat, tmp_path, app_id: str, **popen) -> subprocess.Popen:
    """`gpuledger replay` into a database the store refuses (pm`x): it never catches up, so its
    worker is running whenever the test signals it."""
    env = {**os.environ, "GPULEDGER_KAFKA_BOOTSTRAP": kafka_bootstrap, "GPULEDGER_KAFKA_TOPIC_PREFIX": cat.prefix,
           "GPULEDGER_KAFKA_RAW_PARTITIONS": str(cat.raw_partitions), "GPULEDGER_DATA_DIR": str(tmp_path / "data"),
           "GPULEDGER_CLICKHOUSE_DSN": "chdb:///nonexistent/live", **ENV}
    return subprocess.Popen([sys.executable, "-m", "gpuledger.cli", "replay", "--into", f"chdb://{tmp_path / 'sb'}", "--database", "pm`x",
                             "--app-id", app_id], env=env, **popen)


def replay_workers(replay: subprocess.Popen) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(replay.pid)], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "gpuledger.cli" in line and "worker" in line]


def wait_for_worker_of(replay: subprocess.Popen) -> list[int]:
    import time

    deadline = time.monotonic() + 120
    while not (pids := replay_workers(replay)) and time.monotonic() < deadline and replay.poll() is None:
        time.sleep(0.2)  # (polling for the child to appear)
    assert pids, "the replay started no worker"
    return pids


def test_a_replay_killed_takes_its_worker_with_it(kafka_bootstrap, history, tmp_path):
    """From an exploratory review's leftovers: a `gpuledger replay` ended by SIGKILL (a CI step's
    timeout, `kill -9`) left its worker running for ever, retrying a sandbox it could not write.
    The worker gets SIGTERM when the replay dies (parent-death signal) and stops."""
    import signal
    import time

    cat, _ = history
    replay = stuck_replay(kafka_bootstrap, cat, tmp_path, f"{cat.prefix}-killed", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        [worker] = wait_for_worker_of(replay)
        replay.send_signal(signal.SIGKILL)
        replay.wait(30)

        def gone() -> bool:
            try:
                os.kill(worker, 0)
            except ProcessLookupError:
                return True
            state = subprocess.run(["ps", "-o", "stat=", "-p", str(worker)], capture_output=True, text=True).stdout.strip()
            return state.startswith("Z") or not state  # exited, not yet reaped by init
        deadline = time.monotonic() + 60
        while not gone() and time.monotonic() < deadline:
            time.sleep(0.2)  # (polling for the worker's exit)
        assert gone(), f"the replay's worker {worker} is still running after the replay was killed"
    finally:
        if replay.poll() is None:
            replay.kill()
        for pid in [*replay_workers(replay), *([worker] if "worker" in locals() else [])]:
            try:
                os.killpg(pid, signal.SIGKILL)  # (its session: the worker and its stages)
            except ProcessLookupError:
                pass


def test_a_sandbox_that_cannot_be_created_is_refused_before_anything_starts(kafka_bootstrap, history, tmp_path):
    """The sink could not create the sandbox (its parent is a file, or under /proc): the replay sat
    at 0 events for ever (then: exit 1 after its sink restarted 3 times, ~25 s, with a traceback),
    and the app id, whose groups had committed offsets by then, was refused on the retry. It is
    refused first (exit 2, one reason), and nothing ran under the app id: it can be used again."""
    cat, _ = history
    (tmp_path / "file").write_text("not a directory")
    for into in (f"chdb://{tmp_path / 'file' / 'sandbox'}", "chdb:///proc/gpl-sandbox"):
        out = gpuledger(kafka_bootstrap, cat, tmp_path, "replay", "--into", into, "--app-id", f"{cat.prefix}-nostore", timeout=120)
        assert out.returncode == 2 and "the sandbox directory" in out.stderr and "cannot be created" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and "worker log" not in out.stderr, out.stderr
    assert not (tmp_path / "data" / "replays" / f"{cat.prefix}-nostore" / "worker.log").exists()


def test_an_unreachable_sandbox_server_is_named_as_the_into_option(kafka_bootstrap, history, tmp_path):
    """`--into http://127.0.0.1:1` said "Check GPULEDGER_CLICKHOUSE_DSN" — the live store's
    setting, which a postmortem must not touch."""
    from gpuledger.dev.process import free_port

    cat, _ = history
    into = f"http://127.0.0.1:{free_port()}"
    out = gpuledger(kafka_bootstrap, cat, tmp_path, "replay", "--into", into, "--app-id", f"{cat.prefix}-noserver", timeout=120)
    assert out.returncode == 1 and f"--into {into}: cannot connect to ClickHouse at {into}" in out.stderr, out.stderr
    assert "GPULEDGER_CLICKHOUSE_DSN" not in out.stderr, out.stderr


def test_sigterm_stops_the_replay_and_its_worker_and_says_how_to_resume(kafka_bootstrap, history, tmp_path):
    """SIGTERM (timeout, systemd, kill) ended a replay with exit 143 and nothing said; its worker
    is now stopped as on Ctrl-C, and the resume command printed."""
    import signal

    cat, _ = history
    app_id = f"{cat.prefix}-termed"
    replay = stuck_replay(kafka_bootstrap, cat, tmp_path, app_id, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pids = wait_for_worker_of(replay)
        replay.send_signal(signal.SIGTERM)
        _, stderr = replay.communicate(timeout=90)
        assert replay.returncode == 143, stderr
        said = " ".join(stderr.split())
        assert f"terminated (SIGTERM); the worker is stopped. Continue with: gpuledger replay --resume --app-id {app_id}" in said, stderr
        assert replay_workers(replay) == [] and subprocess.run(["ps", "-p", str(pids[0])], capture_output=True).returncode != 0, \
            "the replay's worker is still running"
    finally:
        if replay.poll() is None:
            replay.kill()


def test_a_range_with_no_events_ends_with_a_summary_of_empty_tables(kafka_bootstrap, history, tmp_path):
    """Nothing in the range: the sink never created the sandbox's database, and counting its
    rows after catching up was a traceback (UNKNOWN_DATABASE), exit 1."""
    cat, _ = history
    sandbox = f"chdb://{tmp_path / 'sandbox'}"
    out = gpuledger(kafka_bootstrap, cat, tmp_path, "replay", "--into", sandbox, "--app-id", f"{cat.prefix}-quiet",
                    "--from", "2020-01-01T00:00:00Z", "--to", "2020-01-02T00:00:00Z", "--timeout", "300")
    assert out.returncode == 0, out.stderr + out.stdout
    assert "0 in range" in out.stdout and "gpuledger.correlated_events\t0 rows" in out.stdout, out.stdout
    # said so, and the sandbox is an empty store: the audit says NO EVENTS (exit 4), not "no embedded store" (exit 3)
    assert "nothing in the range" in out.stdout and "query it" not in out.stdout, out.stdout
    audit = gpuledger(kafka_bootstrap, cat, tmp_path, "audit", "--dsn", sandbox, "--from", "2020-01-01T00:00:00Z", "--to", "2020-01-02T00:00:00Z")
    assert audit.returncode == 4, audit.stderr + audit.stdout


# --- the options, without a broker ------------------------------------------------------------

def test_a_resume_reading_another_topic_set_is_refused(tmp_path):
    """From an exploratory review: a resume from a shell without GPULEDGER_KAFKA_TOPIC_PREFIX read
    the default topics into the sandbox, exit 0 — two histories mixed."""
    from gpuledger.replay import ReplayPlan, refusals
    from gpuledger.settings import KafkaSettings, Settings

    first = ReplayPlan("pm-1", f"chdb://{tmp_path / 'sb'}", "gpuledger", tmp_path / "pm-1", None, None, False, "incident-topics")
    first.save()
    settings = Settings(data_dir=tmp_path, kafka=KafkaSettings(topic_prefix="gpuledger"))
    again = ReplayPlan("pm-1", first.into, "gpuledger", first.work_dir, None, None, True, settings.kafka.topic_prefix)
    assert refusals(again, settings) == [f"--resume: topic_prefix is gpuledger, but replay pm-1 ran with incident-topics ({first.work_dir / 'replay.json'})"]
    same = ReplayPlan("pm-1", first.into, "gpuledger", first.work_dir, None, None, True, "incident-topics")
    assert refusals(same, Settings(data_dir=tmp_path, kafka=KafkaSettings(topic_prefix="incident-topics"))) == []


def test_what_a_replay_refuses_before_it_starts(tmp_path):
    """A resume with no record of the replay (another --work-dir: it replayed every event into a
    range's sandbox, exit 0; or an app id that never ran: mixed into another replay's sandbox), and
    an app id that is a stage group of the live worker (`live.sinks` joined the live sink's group)."""
    from gpuledger.replay import ReplayPlan, refusals
    from gpuledger.settings import Settings

    settings = Settings(data_dir=tmp_path)
    live = settings.streams.app_id

    def plan(app_id, resume=False, work_dir=None):
        return ReplayPlan(app_id, f"chdb://{tmp_path / 'sb'}", "gpuledger", work_dir or tmp_path / app_id, None, None, resume)

    [problem] = refusals(plan("never-ran", resume=True), settings)
    assert problem.startswith(f"--resume: no record of replay never-ran at {tmp_path / 'never-ran' / 'replay.json'}"), problem
    ran = plan("ran", resume=False)
    ran.save()
    assert refusals(plan("ran", resume=True), settings) == []
    assert refusals(plan("ran", resume=True, work_dir=tmp_path / "elsewhere"), settings)[0].startswith("--resume: no record of replay ran")
    [problem] = refusals(plan("never-ran", resume=True, work_dir=tmp_path / "ran"), settings)  # another replay's work dir
    assert problem.startswith("--resume: app_id is never-ran, but replay never-ran ran with ran"), problem
    for suffix in (".route", ".controls", ".sinks"):
        [problem] = refusals(plan(f"{live}{suffix}"), settings)
        assert f"ends with '{suffix}'" in problem and f"the live worker's group(s) {live}{suffix}" in problem, problem
    [problem] = refusals(plan("other.sinks"), settings)
    assert "the sinks stage group of a run with app id other" in problem, problem
    assert refusals(plan("postmortem.2026-12-05"), settings) == []
    # the range is closed: --from = --to is the one instant (audit reads the same bounds); after it is refused
    at = datetime(2026, 12, 6, 16, 5, 4, tzinfo=timezone.utc)
    instant = ReplayPlan("instant", f"chdb://{tmp_path / 'sb'}", "gpuledger", tmp_path / "instant", at, at, False)
    assert refusals(instant, settings) == []
    backwards = ReplayPlan("backwards", f"chdb://{tmp_path / 'sb'}", "gpuledger", tmp_path / "backwards", at, at - timedelta(seconds=1), False)
    assert refusals(backwards, settings) == ["--from 2026-12-06T16:05:04Z is after --to 2026-12-06T16:05:03Z"]
    # a resume naming a bound the replay ran without: said in words, not as Python's None
    ranged = ReplayPlan("ranged", f"chdb://{tmp_path / 'sb'}", "gpuledger", tmp_path / "ranged", None, at, False)
    ranged.save()
    moved = ReplayPlan("ranged", ranged.into, "gpuledger", ranged.work_dir, at - timedelta(minutes=5), at, True)
    [problem] = refusals(moved, settings)
    assert problem.startswith("--resume: from is 2026-12-06T16:00:04Z, but replay ranged ran with (not given)"), problem


def test_instants_far_outside_the_store_are_refused_not_a_traceback():
    """'1000000d' before now overflowed (OverflowError, exit 1): a refusal (exit 2)."""
    from gpuledger.replay import ReplayRefused, parse_instant

    now = datetime(2026, 11, 30, 14, tzinfo=timezone.utc)
    for text in ("1000000d", "99999999999", "200000d", "0001-01-01T00:00:00Z"):
        with pytest.raises(ReplayRefused, match="--from"):
            parse_instant(text, "--from", now)


def test_times_and_durations_before_now():
    from gpuledger.replay import ReplayRefused, parse_instant

    now = datetime(2026, 11, 30, 14, tzinfo=timezone.utc)
    assert parse_instant("2h", "--from", now) == datetime(2026, 11, 30, 12, tzinfo=timezone.utc)
    assert parse_instant("1h30m", "--from", now) == datetime(2026, 11, 30, 12, 30, tzinfo=timezone.utc)
    assert parse_instant("2026-11-30T13:00:00", "--to", now) == datetime(2026, 11, 30, 13, tzinfo=timezone.utc)
    # a pasted Unix timestamp read as seconds before now replayed from 1973 (exploratory review)
    with pytest.raises(ReplayRefused, match="a bare number"):
        parse_instant("1700000000", "--from", now)
    assert parse_instant("90s", "--from", now) == now - timedelta(seconds=90)
    assert parse_instant("2026-11-30T15:00:00+02:00", "--to", now) == datetime(2026, 11, 30, 13, tzinfo=timezone.utc)
    with pytest.raises(ReplayRefused, match="--from 'yesterday'"):
        parse_instant("yesterday", "--from", now)


def test_the_same_store_is_recognised_however_it_is_spelled(tmp_path):
    from gpuledger.replay import same_store

    assert same_store(f"chdb://{tmp_path}/a/../live", "gpuledger", f"chdb://{tmp_path}/live", "gpuledger")
    assert not same_store(f"chdb://{tmp_path}/sandbox", "gpuledger", f"chdb://{tmp_path}/live", "gpuledger")
    assert same_store("http://u:secret@ch:8123/x", "gpuledger", "http://ch", "gpuledger")
    assert not same_store("http://ch:8123", "postmortem", "http://ch:8123", "gpuledger")
    assert not same_store("https://ch", "gpuledger", "http://ch", "gpuledger")


def test_the_progress_bar_rate_is_the_runs_own_and_settling_shows_no_eta():
    """From an exploratory review: the bar showed rich's estimate over its last samples — 14,000-23,000
    events/s in runs whose summary said 2,300-2,900 (the count moves in steps, a group's commit) —
    and "ETA 0:00:00" while 25,143 records were still queued. The rate is now the summary's: raw
    events done since the worker started; while the run settles there is no ETA."""
    import re
    import time

    from rich.progress import Progress

    from gpuledger.replay import EtaColumn, RateColumn

    bar = Progress()
    task_id = bar.add_task("replay", total=40_000, started=time.monotonic() - 10.0, base=5_000, settling=False)
    bar.update(task_id, completed=25_000)  # 20,000 done in this run's 10 s: 2,000/s; 15,000 left: 7-8 s
    task = bar.tasks[0]
    rate = int(RateColumn().render(task).plain.split()[0].replace(",", ""))
    assert 1_990 <= rate <= 2_000, rate
    eta = re.fullmatch(r"ETA 0:00:0(\d)", EtaColumn().render(task).plain)
    assert eta and int(eta[1]) in (7, 8), EtaColumn().render(task).plain
    bar.update(task_id, completed=5_000)  # nothing done yet in this run (a resume's start)
    assert (RateColumn().render(bar.tasks[0]).plain, EtaColumn().render(bar.tasks[0]).plain) == ("- events/s", "ETA -:--:--")
    bar.update(task_id, completed=40_000, settling=True)
    assert EtaColumn().render(bar.tasks[0]).plain == "ETA -"
