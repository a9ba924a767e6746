"""sinks/correlated.py (+ the SinkWriters of sinks/agents.py) against real ClickHouse:
family routing, typed columns, re-delivery, and retry while the store is unreachable."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from gpuledger.dev.process import free_port
from sinks.agents import SinkWriters
from sinks.errors import ROW_REJECTED_CODES
from sinks.clickhouse import StoreConnection, connect
from sinks.errors import StoreUnavailable
from sinks.migrations import MIGRATIONS, migrate
from tests.sinks import incident as inc

REPO = Path(__file__).resolve().parents[2]


def _count(client, db: str, table: str, where: str = "1") -> int:
    return client.query(f"SELECT count() FROM `{db}`.{table} FINAL WHERE {where}").result_rows[0][0]


def _expected_counts() -> dict[str, int]:
    rows = list(inc.latest(inc.correlated_rows()).values())
    return {
        "correlated_events": len(rows),
        "release_history": sum(r.event_type.startswith("release.") for r in rows),
        # By (workload, time, id): the row re-attributed from a wrong workload stays behind
        # under the old key; readers drop it (test_trace), the table keeps it.
        "workload_timeline": sum(r.event_type.startswith("scheduler.") and bool(r.identity.workload_id) for r in rows) + 1,
        "enriched_alerts": sum(r.event_type.startswith("alert.") for r in rows),
        "gpu_allocations": len(inc.latest(inc.allocation_rows())),
    }


def _store(writers: SinkWriters) -> None:
    async def go():
        await writers.store_correlated(inc.correlated_rows())
        await writers.store_allocations(inc.allocation_rows())
    asyncio.run(go())


def test_rows_go_to_their_family_tables_and_redelivery_changes_nothing(clickhouse_client, clickhouse_db):
    migrate(clickhouse_client, clickhouse_db)
    writers = SinkWriters(clickhouse_client, clickhouse_db)
    _store(writers)
    expected = _expected_counts()
    counts = {t: _count(clickhouse_client, clickhouse_db, t) for t in expected}
    assert counts == expected
    # Re-delivery: the same batches again, and the superseded versions once more on their own.
    _store(writers)
    asyncio.run(writers.store_correlated([r for r in inc.correlated_rows() if r.version == 0]))
    assert {t: _count(clickhouse_client, clickhouse_db, t) for t in expected} == expected
    # A scheduler row without a workload stays out of the timeline (it is in correlated_events).
    failed = clickhouse_client.query(
        f"SELECT workload_id, version FROM `{clickhouse_db}`.workload_timeline FINAL WHERE event_type = 'scheduler.failed_scheduling'").result_rows
    assert failed == [(inc.W7, 1)]
    # The highest version wins, whatever order versions were inserted in.
    fp_rows = clickhouse_client.query(
        f"SELECT event_type, version, release_id, workload_id, node, gpu_id FROM `{clickhouse_db}`.enriched_alerts FINAL "
        "WHERE alert_fingerprint = {fp:String} ORDER BY occurred_at", parameters={"fp": inc.FP}).result_rows
    assert fp_rows == [("alert.firing", 1, inc.R7, inc.W7, "node-b", inc.GPU_B), ("alert.resolved", 0, inc.R7, inc.W7, "node-b", inc.GPU_B)]


def test_payload_fields_become_typed_columns(clickhouse_client, clickhouse_db):
    migrate(clickhouse_client, clickhouse_db)
    _store(SinkWriters(clickhouse_client, clickhouse_db))
    db = clickhouse_db
    promoted = clickhouse_client.query(
        f"SELECT actor, approval_id, to_environment, superseded_release_id, artifact_digest, owner FROM `{db}`.release_history FINAL "
        "WHERE release_id = {r:String} AND event_type = 'release.promoted'", parameters={"r": inc.R7}).result_rows
    assert promoted == [("alice", "CHG-1042", "prod", inc.R6, inc.MANIFEST7["artifact_digest"], "team-risk")]
    registered = clickhouse_client.query(
        f"SELECT version, model_version, image_digest FROM `{db}`.release_history FINAL WHERE release_id = {{r:String}} "
        "AND event_type = 'release.registered'", parameters={"r": inc.R7}).result_rows
    assert registered == [(1, "7", inc.MANIFEST7["image_digest"])]  # the re-rendered manifest superseded the partial one
    pre = clickhouse_client.query(
        f"SELECT preemptor_kind, preemptor_namespace, preemptor_name, reason, priority, queue FROM `{db}`.workload_timeline FINAL "
        "WHERE event_type = 'scheduler.preempted'").result_rows
    assert pre == [("Workload", "training", "llm-finetune-3", "Preempted", 1000, "prod-inference")]
    admitted = clickhouse_client.query(
        f"SELECT flavors, cluster_queue FROM `{db}`.workload_timeline FINAL WHERE workload_id = {{w:String}} "
        "AND event_type = 'scheduler.admitted' ORDER BY occurred_at LIMIT 1", parameters={"w": inc.W7}).result_rows
    assert admitted == [({"nvidia.com/gpu": "a100-80gb"}, "gpu-a100")]
    alert = clickhouse_client.query(
        f"SELECT alertname, severity, labels['pod'], annotations['summary'], ends_at FROM `{db}`.enriched_alerts FINAL "
        "WHERE alert_fingerprint = {fp:String} AND event_type = 'alert.firing'", parameters={"fp": inc.FP}).result_rows
    assert alert == [("ModelQualityDegraded", "critical", inc.P2, "precision@k dropped below 0.82", None)]


def test_writer_waits_for_an_unreachable_server_and_loses_nothing(clickhouse_client, clickhouse_db):
    """ClickHouse unreachable (a real HTTP connection refused), then reachable: the
    writer's connection factory is asked again until it gets a client."""
    dead = f"http://127.0.0.1:{free_port()}/"
    attempts: list[str] = []

    def factory():
        attempts.append("try")
        if len(attempts) <= 3:
            return connect(dead, clickhouse_db)  # raises StoreUnavailable: connection refused
        return clickhouse_client

    store = StoreConnection(factory, on_connect=lambda c: migrate(c, clickhouse_db), description="flaky")
    writers = SinkWriters(store, clickhouse_db, initial_backoff_s=0.05, max_backoff_s=0.1)
    started = time.monotonic()
    _store(writers)
    assert time.monotonic() - started < 10
    assert store.connect_attempts == 4
    assert writers.writers["correlated_events"].failures == 3
    assert writers.writers["correlated_events"].rows_written == len(inc.correlated_rows())
    expected = _expected_counts()
    assert {t: _count(clickhouse_client, clickhouse_db, t) for t in expected} == expected


def test_connect_reports_a_refused_server_as_unavailable():
    try:
        connect(f"http://127.0.0.1:{free_port()}/", "x")
    except StoreUnavailable as exc:
        assert "127.0.0.1" in str(exc) and "GPULEDGER_CLICKHOUSE_DSN" in str(exc)
    else:
        raise AssertionError("connect to a closed port succeeded")


_HOLDER = textwrap.dedent("""
    import sys, time
    from sinks.clickhouse import connect
    client = connect(sys.argv[1], "hold")
    print("held", flush=True)
    sys.stdin.read()  # hold the directory until the test closes our stdin
""")

_WRITER = textwrap.dedent("""
    import asyncio, json, logging, sys
    from sinks.agents import SinkWriters
    from sinks.clickhouse import migrated_store
    from tests.sinks import incident as inc
    dsn, db = sys.argv[1], "gpuledger"
    lines = []

    class Lines(logging.Handler):
        def emit(self, record):
            lines.append([record.levelname, record.getMessage()])
            if record.levelno == logging.WARNING and len(lines) == 1:
                print("refused", flush=True)  # the test releases the directory now

    logging.getLogger("sinks.clickhouse").addHandler(Lines())
    logging.getLogger("sinks.clickhouse").setLevel(logging.INFO)
    store = migrated_store(dsn, db)  # as a worker starting while another process holds the store
    writers = SinkWriters(store, db, initial_backoff_s=0.1, max_backoff_s=0.2)
    asyncio.run(writers.store_correlated(inc.correlated_rows()))
    client = store.get()
    count = client.query(f"SELECT count() FROM {db}.correlated_events FINAL").result_rows[0][0]
    versions = [v for (v,) in client.query(f"SELECT version FROM {db}.schema_migrations FINAL").result_rows]
    print(json.dumps({"lines": lines, "count": count, "attempts": store.connect_attempts, "versions": versions}), flush=True)
""")


def test_writer_waits_while_another_process_owns_the_chdb_directory(tmp_path):
    """The honest embedded case: another process holds the chDB directory (StoreLocked)
    when the worker's lazy store first connects; the writer retries, logging one line
    for the whole wait, then migrates and writes everything once the owner lets go."""
    dsn = f"chdb://{tmp_path / 'store'}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, dsn], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        writer = subprocess.Popen([sys.executable, "-c", _WRITER, dsn], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = writer.stdout.readline().split()
        assert first == ["refused"], (first, writer.stderr.read() if writer.poll() is not None else "")
        holder.stdin.close()  # the owner exits and releases the directory
        holder.wait(timeout=30)
        out, err = writer.communicate(timeout=60)
        assert writer.returncode == 0, err[-3000:]
        result = json.loads(out.strip().splitlines()[-1])
        assert result["count"] == len(inc.latest(inc.correlated_rows()))
        assert sorted(result["versions"]) == [m.version for m in MIGRATIONS]  # migrated on the first successful connect
        levels = [level for level, _ in result["lines"]]
        assert levels == ["WARNING", "INFO"], result["lines"]  # however many attempts the wait took
        assert "owned by another process" in result["lines"][0][1]  # StoreLocked
        assert f"after {result['attempts']} attempts" in result["lines"][1][1] and result["attempts"] >= 2
    finally:
        if holder.poll() is None:
            holder.kill()


def _record(**changes) -> dict:
    record = {"correlation_id": "c-null", "version": 3, "event_type": "scheduler.scheduled", "occurred_at": "2026-11-01T00:01:41+00:00",
              "attribution": "unattributed", "identity": {"namespace": "ml", "pod": "p-null", "release_id": None},
              "release_state": None, "summary": None, "source_topic": "raw", "source_partition": 0, "source_offset": 7}
    record.update(changes)
    return {k: v for k, v in record.items() if v is not _MISSING}


_MISSING = object()


def test_the_store_reads_records_with_null_fields_as_defaults_and_refuses_one_without_a_required_field_by_name(
        clickhouse_client, clickhouse_db):
    """The sink hands the worker's JSON to the store as it is, a record per row: a null field reads
    as its default (summary '', payload_json '{}', release_state ''), a null or absent identity
    field as '' (and an identity absent, null or not an object as an empty one). A record without a
    required field — or with one null, of the wrong type or past its type's range (a negative or
    2^64 version, a partition past UInt32, an unreadable time), which reads as absent — or that is
    not one JSON object is refused on its own by the constraint named after it; the rest of its
    batch is stored."""
    import orjson

    from sinks.writer import RecordSource

    migrate(clickhouse_client, clickhouse_db)
    required = {"correlation_id": "has_correlation_id", "version": "has_version", "event_type": "has_event_type",
                "occurred_at": "has_occurred_at", "attribution": "has_attribution", "source_topic": "has_source",
                "source_offset": "has_source"}
    good = [orjson.dumps(_record()), orjson.dumps(_record(correlation_id="c-other", identity={}, payload_json=None)),
            orjson.dumps(_record(correlation_id="c-no-identity", identity=_MISSING)),
            orjson.dumps(_record(correlation_id="c-null-identity", identity=None)),
            orjson.dumps(_record(correlation_id="c-ident", identity="not an object"))]
    bad = [(orjson.dumps(_record(**{"correlation_id": f"c-no-{field}", field: _MISSING})), 469, f"`{name}`") for field, name in required.items()]
    bad += [(orjson.dumps(_record(correlation_id="c-null-version", version=None)), 469, "`has_version`"),
            (orjson.dumps(_record(correlation_id="c-neg", version=-1)), 469, "`has_version`"),
            (orjson.dumps(_record(correlation_id="c-huge", version=1)).replace(b'"version":1', b'"version":18446744073709551616'), 469,
             "`has_version`"),
            (orjson.dumps(_record(correlation_id="c-part", source_partition=2 ** 33)), 469, "`has_source`"),
            (orjson.dumps(_record(correlation_id="c-time", occurred_at="yesterday")), 469, "`has_occurred_at`"),
            (b"[1, 2]", 469, "`is_a_json_object`"), (orjson.dumps(_record(correlation_id="c-two")) * 2, 469, "`is_a_json_object`")]
    batch = [good[0], *(value for value, _code, _text in bad), *good[1:]]
    sources = [RecordSource("t.correlated.v1", 0, i, None, value) for i, value in enumerate(batch)]
    rejected = asyncio.run(SinkWriters(clickhouse_client, clickhouse_db).store_correlated(batch, sources))

    stored = clickhouse_client.query(
        f"SELECT correlation_id, summary, payload_json, release_state, release_id, pod FROM `{clickhouse_db}`.correlated_events FINAL "
        "ORDER BY correlation_id").result_rows
    assert stored == [("c-ident", "", "{}", "", "", ""), ("c-no-identity", "", "{}", "", "", ""), ("c-null", "", "{}", "", "", "p-null"),
                      ("c-null-identity", "", "{}", "", "", ""), ("c-other", "", "{}", "", "", "")]
    assert [r.source.offset for r in rejected] == list(range(1, len(bad) + 1))
    assert all(r.stage == "sinks.correlated_events" and r.hint for r in rejected)
    for r, (_value, code, text) in zip(rejected, bad):
        assert r.code == code and text in r.error, (code, text, r.error)


def test_payload_fields_of_every_family_become_typed_columns_as_the_store_reads_them(clickhouse_client, clickhouse_db):
    """The typed columns the intake's views take from each payload, past the incident's: a
    reservation and its window, tags, an expiry; an admission decision with no reason (read as
    decision:rule); gpus requested, digests, a victim, labels; an alert with no start (its event
    time) and an end. A number where text is expected reads as its text; a payload that is not
    JSON, or a row of another family, leaves the typed columns empty."""
    import orjson

    migrate(clickhouse_client, clickhouse_db)

    def rec(cid: str, event_type: str, identity: dict, payload) -> bytes:
        return orjson.dumps(_record(correlation_id=cid, event_type=event_type, identity=identity,
                                    payload_json=payload if isinstance(payload, str) else orjson.dumps(payload).decode()))

    batch = [
        rec("r1", "release.reservation_created", {"release_id": "rel-1", "model_name": "m", "owner": "team"},
            {"actor": "alice", "reservation": {"reservation_id": "res-1", "gpus": 8, "pool": "a100", "window_start": "2026-11-01T00:00:00Z",
                                               "window_end": "2026-11-02T00:00:00+02:00"},
             "tags": {"ticket": "T-1", "n": 5}, "expires_at": "2026-12-01T00:00:00Z", "target": 42}),
        rec("r2", "release.registered", {"release_id": "rel-2"}, "not json"),
        rec("a1", "admission.decided", {"workload_id": "ml/Job/j1", "release_id": "rel-1"}, {"decision": "deny", "outcome": "deny", "rule": "no-approval"}),
        rec("w1", "scheduler.submitted", {"workload_id": "ml/Job/j1"},
            {"object_kind": "Workload", "queue": "q", "priority": 7, "gpus_requested": 4, "image_digests": ["sha256:1", "sha256:2"],
             "victim": {"kind": "Workload", "namespace": "ml", "name": "other"}, "labels": {"team": "a"}, "reason": "Pending"}),
        rec("w2", "scheduler.scheduled", {"pod": "no-workload"}, {"reason": "x"}),
        rec("f1", "alert.resolved", {"alert_fingerprint": "fp-1"},
            {"alertname": "Quality", "severity": "warning", "ends_at": "2026-11-01T00:05:00Z", "labels": {"pod": "p"},
             "annotations": {"summary": "s"}, "generator_url": "http://g", "receiver": "team", "group_key": "{}:{}"}),
    ]
    assert asyncio.run(SinkWriters(clickhouse_client, clickhouse_db).store_correlated(batch)) == []
    db = clickhouse_db
    q = clickhouse_client.query
    assert q(f"SELECT correlation_id, actor, reservation_id, reservation_gpus, reservation_pool, toString(reservation_window_start), "
             f"toString(reservation_window_end), tags, toString(expires_at), target, model_name, owner FROM `{db}`.release_history FINAL "
             "ORDER BY correlation_id").result_rows == [
        ("r1", "alice", "res-1", 8, "a100", "2026-11-01 00:00:00.000", "2026-11-01 22:00:00.000", {"ticket": "T-1", "n": "5"},
         "2026-12-01 00:00:00.000", "42", "m", "team"),
        ("r2", "", "", None, "", None, None, {}, None, "", "", "")]
    assert q(f"SELECT correlation_id, reason, object_kind, queue, priority, gpus_requested, image_digests, victim_kind, victim_name, "
             f"labels FROM `{db}`.workload_timeline FINAL ORDER BY correlation_id").result_rows == [
        ("a1", "deny:no-approval", "", "", None, None, [], "", "", {}),
        ("w1", "Pending", "Workload", "q", 7, 4, ["sha256:1", "sha256:2"], "Workload", "other", {"team": "a"})]
    assert q(f"SELECT alert_fingerprint, alertname, severity, toString(starts_at), toString(ends_at), labels, annotations, generator_url, "
             f"receiver, group_key FROM `{db}`.enriched_alerts FINAL").result_rows == [
        ("fp-1", "Quality", "warning", "2026-11-01 00:01:41.000", "2026-11-01 00:05:00.000", {"pod": "p"}, {"summary": "s"},
         "http://g", "team", "{}:{}")]
    assert q(f"SELECT count() FROM `{db}`.correlated_events FINAL").result_rows == [(len(batch),)]
    # A count past its column's range refuses the record, naming the column; the rest is stored.
    huge = rec("w-huge", "scheduler.submitted", {"workload_id": "ml/Job/j2"}, {"gpus_requested": 2 ** 33})
    rejected = asyncio.run(SinkWriters(clickhouse_client, clickhouse_db).store_correlated([huge, rec("w3", "scheduler.submitted", {"workload_id": "ml/Job/j3"}, {})]))
    assert [(r.stage, r.code) for r in rejected] == [("sinks.workload_timeline", 395)]
    assert "gpus_requested: out of the range of UInt32" in rejected[0].error
    assert q(f"SELECT correlation_id FROM `{db}`.workload_timeline FINAL WHERE correlation_id IN ('w-huge', 'w3')").result_rows == [("w3",)]


def test_a_record_is_one_row_whatever_it_holds_and_what_cannot_be_one_is_refused(clickhouse_client, clickhouse_db):
    """Each record is the one string of a row of the insert (``RowBinary``): an empty record, one of
    two objects, the start of an object (then a good record, then the end of it: ``JSONEachRow`` read
    the three as one row, and the good one vanished), one that would close its row and open another
    in a text format (``]\n[``) are each refused, and the good ones stored — a record spanning lines
    too; one nested past the parser's depth is refused, not held for ever; a
    count past Int64 is refused naming its column; a record that quotes a view's name in its parse
    error keeps the intake's stage."""
    import orjson

    from sinks.writer import RecordSource

    migrate(clickhouse_client, clickhouse_db)
    good = [orjson.dumps(_record(correlation_id=f"e{i}")) for i in range(3)]
    opening = orjson.dumps(_record(correlation_id="open"))[:-1] + b',"extra":['
    deep = orjson.dumps(_record(correlation_id="deep"))[:-1] + b',"x":' + b"[" * 5000 + b"]" * 5000 + b"}"
    huge = orjson.dumps(_record(correlation_id="huge", event_type="release.reservation_created", identity={"release_id": "r"},
                                payload_json='{"reservation": {"gpus": 18446744073709551615}}'))
    spoof = b'{"correlation_id": "spoof", "x": "while pushing to view db.violations_mv", oops}'
    batch = [good[0], b"", b" \n", orjson.dumps(_record(correlation_id="two-lines")).replace(b",", b",\n", 1), opening, good[1], b"]}",
             deep, huge, spoof, good[2], good[0] + good[1], orjson.dumps(_record(correlation_id="inj-1")) + b"]\n[" + orjson.dumps(
                 _record(correlation_id="inj-2"))]
    sources = [RecordSource("t.correlated.v1", 1, 10 + i, None, v) for i, v in enumerate(batch)]
    handed = []

    async def on_rejected(row):
        handed.append(row)

    writers = SinkWriters(clickhouse_client, clickhouse_db, on_rejected=on_rejected, max_backoff_s=0.05, initial_backoff_s=0.01)
    rejected = asyncio.run(writers.store_correlated(batch, sources))
    by_offset = {r.source.offset: r for r in rejected}
    assert sorted(by_offset) == [11, 12, 14, 16, 17, 18, 19, 21, 22] and handed == rejected
    for o in (11, 12, 14, 16, 19, 21, 22):  # not one JSON object, each a row of its own
        assert by_offset[o].code in ROW_REJECTED_CODES and by_offset[o].stage == "sinks.correlated_events", by_offset[o].error
    assert by_offset[17].code in ROW_REJECTED_CODES  # too deep: refused, as a row
    assert by_offset[18].stage == "sinks.release_history" and "reservation_gpus: out of the range of UInt32" in by_offset[18].error
    assert writers.writers["correlated_events"].failures == 0  # nothing held as if the store were down
    assert by_offset[11].dead_letter().reason == "store_rejected"
    assert clickhouse_client.query(f"SELECT correlation_id FROM `{clickhouse_db}`.correlated_events FINAL ORDER BY 1").result_rows == [
        ("e0",), ("e1",), ("e2",), ("two-lines",)]


def test_range_checks_hold_where_the_server_evaluates_every_branch(clickhouse_client, clickhouse_db):
    """The intake's range checks do not rely on ``if`` being lazy (a server profile may set
    ``short_circuit_function_evaluation = 'disable'``): a count in range is stored, one out of it
    refused; a refused record without a source is dead-lettered as the record itself."""
    import orjson

    from sinks.writer import TableWriter

    migrate(clickhouse_client, clickhouse_db)
    writer = TableWriter(clickhouse_client, clickhouse_db, "correlated_intake", ("record",), "sinks.correlated_events", records=True,
                         insert_settings={"short_circuit_function_evaluation": "disable"}, initial_backoff_s=0.01, max_backoff_s=0.05)
    ok = orjson.dumps(_record(correlation_id="w4", event_type="scheduler.submitted", identity={"workload_id": "w"},
                              payload_json='{"gpus_requested": 4}'))
    bad = orjson.dumps(_record(correlation_id="w-neg", event_type="scheduler.submitted", identity={"workload_id": "w"},
                               payload_json='{"gpus_requested": -4}'))
    rejected = asyncio.run(writer.write([[ok], [bad]]))
    assert [orjson.loads(r.row[0])["correlation_id"] for r in rejected] == ["w-neg"] and rejected[0].code == 395
    assert rejected[0].dead_letter().value == bad.decode()
    assert clickhouse_client.query(f"SELECT correlation_id, gpus_requested FROM `{clickhouse_db}`.workload_timeline FINAL").result_rows == [
        ("w4", 4)]



def _realter_views(client, db: str, table: str):
    """Re-issue, one at a time, the query of each of ``table``'s materialized views (``ALTER TABLE …
    MODIFY QUERY``, unchanged), yielding each after it was altered: the order ClickHouse runs a table's
    views in is not their creation order once one is altered (chDB 26.9: it varied between stores and
    between processes)."""
    [views] = client.query("SELECT dependencies_table FROM system.tables WHERE database = {db:String} AND name = {t:String}",
                           parameters={"db": db, "t": table}).result_rows[0]
    for view in views:
        query = client.query("SELECT as_select FROM system.tables WHERE database = {db:String} AND name = {v:String}",
                             parameters={"db": db, "v": view}).result_rows[0][0]
        client.command(f"ALTER TABLE `{db}`.`{view}` MODIFY QUERY {query}")
        yield view


def test_a_refused_record_leaves_no_row_in_any_table_whatever_order_the_views_run_in(clickhouse_client):
    """A record the store refuses — a count out of its column's range (a reservation of -5 GPUs, 2^33
    GPUs requested), a version out of range, an unreadable time, a record that is not an object — is
    refused before any view of the correlated family sees it, so no table keeps a row of it,
    whichever order ClickHouse runs the family's views in. That order is not the views' creation
    order once a view is altered (``ALTER TABLE … MODIFY QUERY``, as a migration does): in fresh
    stores, each view re-issued in turn, it varied, and a record refused by release_history's view
    (the range checks were the views' own before migration 6) kept its correlated_events row whenever
    that view ran first — in most stores, within their four alters. Every round's good records, one
    per family, are stored in every table they belong in."""
    import orjson

    from sinks.agents import CORRELATED_FAMILY
    from sinks.writer import RecordSource

    def rec(cid: str, event_type: str, identity: dict, payload: dict, **fields) -> bytes:
        return orjson.dumps(_record(correlation_id=cid, event_type=event_type, identity=identity, payload_json=orjson.dumps(payload).decode(),
                                    **fields))

    bad = [rec("bad-reservation", "release.reservation_created", {"release_id": "rel-1"}, {"reservation": {"gpus": -5}}),
           rec("bad-gpus", "scheduler.submitted", {"workload_id": "ml/Job/j1", "pod": "p"}, {"gpus_requested": 2 ** 33}),
           rec("bad-version", "release.registered", {"release_id": "rel-1"}, {}, version=-1),
           rec("bad-time", "alert.firing", {"alert_fingerprint": "fp-1"}, {}, occurred_at="yesterday"),
           b'["release.registered"]']
    good = [rec("good-release", "release.reservation_created", {"release_id": "rel-1"}, {"reservation": {"gpus": 5}}),
            rec("good-scheduler", "scheduler.submitted", {"workload_id": "ml/Job/j1"}, {"gpus_requested": 4}),
            rec("good-alert", "alert.firing", {"alert_fingerprint": "fp-1"}, {})]
    expected = {"correlated_events": ["good-alert", "good-release", "good-scheduler"], "release_history": ["good-release"],
                "workload_timeline": ["good-scheduler"], "enriched_alerts": ["good-alert"]}
    batch = bad + good
    sources = [RecordSource("t.correlated.v1", 0, offset, None, value) for offset, value in enumerate(batch)]
    for store in range(6):
        db = f"t_views_{os.getpid()}_{store}_{time.monotonic_ns()}"
        clickhouse_client.command(f"CREATE DATABASE `{db}`")
        try:
            migrate(clickhouse_client, db)
            for altered in _realter_views(clickhouse_client, db, "correlated_fields"):
                for table in CORRELATED_FAMILY:
                    clickhouse_client.command(f"TRUNCATE TABLE `{db}`.{table}")
                rejected = asyncio.run(SinkWriters(clickhouse_client, db).store_correlated(batch, sources))
                assert sorted(r.source.offset for r in rejected) == list(range(len(bad))), [r.error for r in rejected]
                stored = {table: sorted(cid for (cid,) in clickhouse_client.query(f"SELECT correlation_id FROM `{db}`.{table}").result_rows)
                          for table in CORRELATED_FAMILY}
                assert stored == expected, (f"store {store}, after altering {altered}", stored)
        finally:
            clickhouse_client.command(f"DROP DATABASE IF EXISTS `{db}`")
