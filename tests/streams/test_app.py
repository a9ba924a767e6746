"""The correlation topology through the real pipeline: real broker, real Faust
workers (separate processes), real ClickHouse. Expected rows come from the same
scenario run through the in-memory driver (tests/streams/harness.py), whose rules
are checked on their own in test_entities.py."""

from __future__ import annotations

import json
import re
import time

from producers._kafka import EventPublisher
from schemas import CorrelatedEvent
from tests.fixtures.kafka import read_topic
from tests.streams.harness import Driver
from tests.streams.test_entities import SCENARIO

FAST = {"GPULEDGER_STREAMS_PARK_IDLE_FLUSH_S": "2"}
COLUMNS = "correlation_id, attribution, release_id, workload_id, pod, node, gpu_id, model_version, release_state"


def expected() -> dict[str, dict]:
    rows = Driver().feed(SCENARIO).flush_parked().rows
    return {cid: {"correlation_id": cid, "attribution": r.attribution, "release_id": r.identity.release_id or "",
                  "workload_id": r.identity.workload_id or "", "pod": r.identity.pod or "", "node": r.identity.node or "",
                  "gpu_id": r.identity.gpu_id or "", "model_version": r.identity.model_version or "", "release_state": r.release_state or ""}
            for cid, r in rows.items()}


def stored(reader) -> dict[str, dict]:
    return {r["correlation_id"]: r for r in reader.query(f"SELECT {COLUMNS} FROM gpuledger.correlated_events FINAL").dicts()}


def wait_for(reader, want: dict, timeout: float = 90.0) -> dict:
    deadline = time.monotonic() + timeout
    got = {}
    while time.monotonic() < deadline:
        got = stored(reader)
        if got == want:
            return got
        time.sleep(0.5)
    missing = set(want) - set(got)
    wrong = {k: (got[k], want[k]) for k in set(want) & set(got) if got[k] != want[k]}
    raise AssertionError(f"store never matched: missing={missing} extra={set(got) - set(want)} wrong={wrong}")


def publish(bootstrap, cat, events):
    EventPublisher({"bootstrap.servers": bootstrap}, cat, "test").publish_batch(events)


def test_scenario_matches_the_join_rules_and_replay_from_zero_equals_live(kafka_bootstrap, catalogue, worker_factory):
    want = expected()
    live = worker_factory(catalogue, extra_env=FAST)
    # alerts and GPU events first, releases last: the order a replay often sees
    publish(kafka_bootstrap, catalogue, [e for e in SCENARIO if not e.event_type.startswith("release.")])
    publish(kafka_bootstrap, catalogue, [e for e in SCENARIO if e.event_type.startswith("release.")])
    wait_for(live.reader, want)
    allocs = live.reader.query("SELECT count() AS n FROM gpuledger.correlated_events FINAL WHERE attribution = 'gpu_assignment'").dicts()
    assert allocs[0]["n"] == 2
    # Everything read is committed: each child's group lag (health ``lag``) comes down to 0.
    run = catalogue.run(f"{catalogue.prefix}-app")
    lag = wait_lag_zero(live.url, known={"controls": run.controls, "sink": run.correlated})
    assert {p.rsplit("[", 1)[0] for p, v in lag["controls"]["partitions"].items() if v is not None} == {run.controls}
    assert {p.rsplit("[", 1)[0] for p, v in lag["route"]["partitions"].items() if v is not None} <= set(catalogue.raw_topics)
    assert run.correlated in {p.rsplit("[", 1)[0] for p, v in lag["sink"]["partitions"].items() if v is not None}
    # ... and `gpuledger status` says so, from the health page and from Kafka's committed offsets.
    # (The Faust group commits on its own second-long timer, and housekeeping may route a
    # message meanwhile: looked at until every group has committed everything.)
    groups = {g: (0, 0) for g in (f"{catalogue.prefix}-app", f"{catalogue.prefix}-app.route", f"{catalogue.prefix}-app.controls",
                                  f"{catalogue.prefix}-app.sinks")}
    deadline, got = time.monotonic() + 30, {}
    while time.monotonic() < deadline:
        status = status_of(kafka_bootstrap, catalogue, live, "--format", "json")
        assert status.exit_code == 0, status.output
        got = json.loads(status.stdout)
        if {g: (v["lag"], v["never_committed"]) for g, v in got["groups"].items()} == groups:
            break
        time.sleep(0.5)
    assert {g: (v["lag"], v["never_committed"]) for g, v in got["groups"].items()} == groups, got["groups"]
    assert got["health"]["status"] == "ok" and got["url"] == live.url
    table = status_of(kafka_bootstrap, catalogue, live)
    assert table.exit_code == 0 and f"worker {catalogue.prefix}-app: ok" in table.stdout, table.output
    assert all(f"{catalogue.prefix}-app.{g}" in table.stdout for g in ("route", "controls", "sinks")), table.stdout
    assert got["health"]["app_id"] == f"{catalogue.prefix}-app"
    # Another run's app id (a replay's) finds this worker through the store's owner file: not its
    # worker (it was shown as the replay's, ok, exit 0) — exit 1, naming whose worker it is.
    other = status_of(kafka_bootstrap, catalogue, live, "--app-id", f"{catalogue.prefix}-replay")
    assert other.exit_code == 1 and (f"worker {catalogue.prefix}-replay: not found — the worker at {live.url} runs app id "
                                     f"{catalogue.prefix}-app") in other.stdout, other.output
    other = json.loads(status_of(kafka_bootstrap, catalogue, live, "--app-id", f"{catalogue.prefix}-replay", "--format", "json").stdout)
    assert other["health"] is None and f"runs app id '{catalogue.prefix}-app'" in other["error"], other
    # A fresh consumer group + fresh store replays the topics from offset zero.
    replay = worker_factory(catalogue, app_id=f"{catalogue.prefix}-replay", extra_env=FAST)
    assert wait_for(replay.reader, want) == stored(live.reader)


def test_worker_killed_mid_stream_recovers_without_duplicates_or_gaps(kafka_bootstrap, catalogue, worker_factory, tmp_path):
    want = expected()
    data = tmp_path / "crashy"
    first = worker_factory(catalogue, data_dir=data, extra_env=FAST)
    half = len(SCENARIO) // 2
    publish(kafka_bootstrap, catalogue, SCENARIO[:half])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not stored(first.reader):
        time.sleep(0.3)
    assert stored(first.reader), "nothing stored before the crash"
    first.service.kill()
    publish(kafka_bootstrap, catalogue, SCENARIO[half:])
    second = worker_factory(catalogue, data_dir=data, extra_env=FAST)  # same group, same store
    wait_for(second.reader, want)
    ids = second.reader.query("SELECT count() AS n, uniqExact(correlation_id) AS u FROM gpuledger.correlated_events FINAL").dicts()[0]
    assert ids["n"] == ids["u"] == len(want)


def test_two_workers_in_one_group_produce_what_one_produces(kafka_bootstrap, catalogue, worker_factory):
    want = expected()
    app_id = f"{catalogue.prefix}-pair"
    worker_factory(catalogue, app_id=app_id, extra_env=FAST)
    worker_factory(catalogue, app_id=app_id, extra_env=FAST)
    publish(kafka_bootstrap, catalogue, SCENARIO)
    deadline = time.monotonic() + 90
    latest: dict[str, CorrelatedEvent] = {}
    while time.monotonic() < deadline:
        latest = {}
        for msg in read_topic(kafka_bootstrap, catalogue.run(app_id).correlated, min_count=len(want), timeout=10, settle=1.5):
            row = CorrelatedEvent.model_validate_json(msg.value())
            if row.correlation_id not in latest or row.version > latest[row.correlation_id].version:
                latest[row.correlation_id] = row
        got = {cid: {"correlation_id": cid, "attribution": r.attribution, "release_id": r.identity.release_id or "",
                     "workload_id": r.identity.workload_id or "", "pod": r.identity.pod or "", "node": r.identity.node or "",
                     "gpu_id": r.identity.gpu_id or "", "model_version": r.identity.model_version or "",
                     "release_state": r.release_state or ""} for cid, r in latest.items()}
        if got == want:
            return
        time.sleep(1)
    raise AssertionError(f"union of two workers' outputs differs: {set(want) ^ set(latest)}")


def test_a_clean_stop_commits_the_open_epochs_and_leaves_without_the_hard_stop(kafka_bootstrap, catalogue, worker_factory):
    """SIGTERM while every stage holds an uncommitted epoch (a 60 s commit interval keeps the
    timer out of it): the epochs commit during Faust's own stop, which waits for its streams'
    acks, so the worker stops before its hard-stop timer and every group of the run has
    committed everything it read (docs/operations.md, Worker)."""
    from confluent_kafka.admin import OffsetSpec

    from streams.progress import RunProgress

    want = expected()
    live = worker_factory(catalogue, extra_env={**FAST, "GPULEDGER_STREAMS_COMMIT_INTERVAL_S": "60"})
    publish(kafka_bootstrap, catalogue, SCENARIO)
    wait_for(live.reader, want)
    wait_quiet(live.url)  # nothing left in flight between the stages: what is open is the epochs
    assert live.service.stop(grace=30) == 0
    log = live.service.log_tail(400)
    assert "stop did not finish" not in log, log
    app_id = f"{catalogue.prefix}-app"
    run = catalogue.run(app_id)
    with RunProgress({"bootstrap.servers": kafka_bootstrap}, catalogue, app_id) as progress:
        look = progress.look(None)
        groups = progress.committed()
        # the Faust agent's group and the controls process's: what their epochs acked
        committed = {**groups[app_id], **groups[f"{app_id}.controls"]}
        ends = progress._offsets(progress._partitions({run.route, run.controls}), OffsetSpec.latest())
    assert look.done == look.total and look.inputs_left == 0, look.describe()
    assert {tp: committed.get(tp, 0) for tp in ends} == ends and any(ends.values()), ends


def test_the_worker_says_without_v_that_it_started_where_it_answers_and_that_it_stopped_in_one_line_format(kafka_bootstrap, catalogue,
                                                                                                            worker_factory):
    """`gpuledger worker` without -v: an operator reads that it started (its health address, Kafka,
    the store), each child process's own start, and that it stopped — every line of every process
    in one format that names its process — and none of the libraries' INFO lines (Faust's
    "[^--Consumer]: Starting...", aiokafka's group rounds), which -v adds (docs/operations.md, Logs)."""
    import re

    app_id = f"{catalogue.prefix}-app"
    quiet = worker_factory(catalogue, verbose=False)
    publish(kafka_bootstrap, catalogue, SCENARIO)
    wait_for(quiet.reader, expected())
    assert quiet.service.stop(grace=30) == 0
    log = quiet.service.log_tail(400)
    lines = [line for line in log.splitlines() if line.strip()]
    shape = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\] \[\d+\] \[(INFO|WARNING|ERROR|CRITICAL)\] \[(worker|route|controls|sink)\] [\w.]+: ")
    assert lines and all(shape.match(line) for line in lines), "\n".join(line for line in lines if not shape.match(line))
    assert re.search(rf"\[worker\] streams\.app: worker {re.escape(app_id)} starting: health at {re.escape(quiet.url)}, "
                     rf"Kafka at {re.escape(kafka_bootstrap)}, store {re.escape(quiet.dsn)}$", log, re.M), log
    assert re.search(r"\[route\] streams\.intake: route stage: \d+ partition\(s\) assigned", log), log
    assert re.search(r"\[controls\] streams\.intake: controls stage: \d+ partition\(s\) assigned", log), log
    assert "[sink] gpuledger.child: running at niceness" in log, log
    assert lines[-1].endswith(f"[worker] streams.app: worker {app_id} stopped"), lines[-3:]
    assert not [line for line in lines if re.search(r"\] (faust|mode|aiokafka)\.", line) and "[INFO]" in line], log
    # a healthy start on a fresh group: aiokafka's "GroupCoordinatorNotAvailableError" is not an ERROR here
    assert not [line for line in lines if "[ERROR]" in line or "[CRITICAL]" in line], log

    loud = worker_factory(catalogue, app_id=f"{app_id}-v")  # -v (the fixture's default)
    assert loud.service.stop(grace=30) == 0
    log = loud.service.log_tail(400)
    assert "[INFO] [worker] faust.worker: [^Worker]: Starting..." in log, log
    assert re.search(r"\[INFO\] \[(controls|route)\] aiokafka\.", log) or "[INFO] [worker] aiokafka." in log, log


def status_of(bootstrap, cat, worker, *args):
    from typer.testing import CliRunner

    from gpuledger.cli import app as cli_app

    env = {"GPULEDGER_KAFKA_BOOTSTRAP": bootstrap, "GPULEDGER_KAFKA_TOPIC_PREFIX": cat.prefix,
           "GPULEDGER_KAFKA_RAW_PARTITIONS": str(cat.raw_partitions), "GPULEDGER_CLICKHOUSE_DSN": worker.dsn,
           "GPULEDGER_DATA_DIR": str(worker.data_dir), "GPULEDGER_STREAMS_APP_ID": f"{cat.prefix}-app", "COLUMNS": "200"}
    return CliRunner().invoke(cli_app, ["status", *args], env=env)


def test_status_of_a_worker_that_does_not_answer_exits_1_and_still_shows_the_groups(kafka_bootstrap, catalogue, tmp_path):
    """No worker at the address: `gpuledger status` says so, exits 1, and the run's groups
    come from Kafka all the same (nothing committed: the published records are their lag)."""
    from gpuledger.dev.process import free_port

    publish(kafka_bootstrap, catalogue, SCENARIO[:5])
    nobody = type("W", (), {"dsn": f"chdb://{tmp_path / 'clickhouse'}", "data_dir": tmp_path})
    out = status_of(kafka_bootstrap, catalogue, nobody, "--url", f"http://127.0.0.1:{free_port()}", "--format", "json")
    assert out.exit_code == 1, out.output
    got = json.loads(out.stdout)
    assert got["health"] is None and got["kafka_error"] is None
    assert got["groups"][f"{catalogue.prefix}-app.route"]["lag"] == 5
    assert got["groups"][f"{catalogue.prefix}-app.sinks"]["lag"] == 5  # the raw topics; the run's own are empty
    table = status_of(kafka_bootstrap, catalogue, nobody, "--url", "http://127.0.0.1:1")
    assert table.exit_code == 1 and "not answering at http://127.0.0.1:1" in table.stdout, table.output
    # A group that committed nothing (here: no worker ever ran) is not shown as a backlog of 5.
    assert re.search(rf"{re.escape(catalogue.prefix)}-app\.route .*none committed \(5 records\)", table.stdout), table.output
    # Piped (80 columns): every group name whole, on its line (they were cut "gpuledger.ro…").
    from typer.testing import CliRunner as _Runner

    from gpuledger.cli import app as _cli

    narrow = _Runner().invoke(_cli, ["status", "--url", "http://127.0.0.1:1"], env={
        "GPULEDGER_KAFKA_BOOTSTRAP": kafka_bootstrap, "GPULEDGER_KAFKA_TOPIC_PREFIX": catalogue.prefix,
        "GPULEDGER_KAFKA_RAW_PARTITIONS": str(catalogue.raw_partitions), "GPULEDGER_CLICKHOUSE_DSN": nobody.dsn,
        "GPULEDGER_DATA_DIR": str(tmp_path), "GPULEDGER_STREAMS_APP_ID": f"{catalogue.prefix}-app", "COLUMNS": "80"})
    for group in (f"{catalogue.prefix}-app.route", f"{catalogue.prefix}-app.sinks"):
        assert re.search(rf"{re.escape(group)} .*none committed", narrow.stdout), narrow.stdout
    assert f"{catalogue.prefix}-app.controls " in narrow.stdout, narrow.stdout
    assert "…" not in narrow.stdout, narrow.stdout
    # No Kafka configured at all (a review's responder after an exercise stopped its broker): the
    # worker's part and a line saying so, not a traceback.
    from typer.testing import CliRunner

    from gpuledger.cli import app as cli_app

    bare = CliRunner().invoke(cli_app, ["status", "--url", "http://127.0.0.1:1", "--format", "json"],
                              env={"GPULEDGER_KAFKA_BOOTSTRAP": None, "GPULEDGER_DATA_DIR": str(tmp_path / "nokafka"), "COLUMNS": "200",
                                   "HOME": str(tmp_path / "home")})
    assert bare.exit_code == 1 and (bare.exception is None or isinstance(bare.exception, SystemExit)), bare.output
    assert json.loads(bare.stdout)["kafka_error"].startswith("no Kafka to talk to"), bare.output
    # Topics that do not exist (another prefix): Kafka answered, and the table says what is missing
    # (it said "Kafka did not answer").
    elsewhere = catalogue.model_copy(update={"prefix": f"{catalogue.prefix}-nosuch"})
    missing = status_of(kafka_bootstrap, elsewhere, nobody, "--url", "http://127.0.0.1:1")
    assert missing.exit_code == 1 and "consumer groups: not read: raw topic(s)" in missing.stdout, missing.output
    assert "did not answer" not in missing.stdout, missing.output


def test_a_store_that_is_down_makes_the_worker_degraded_and_says_why(kafka_bootstrap, catalogue, tmp_path):
    """Found by an exploratory review: with its ClickHouse server down the worker's page said "ok"
    and `gpuledger status` exited 0 with a sink lag of 0 — the sink held its batch (retrying) and
    polled nothing more, so its consumer's statistics, where the lag comes from, stopped."""
    from gpuledger.dev.process import ServiceProcess, free_port
    from streams.progress import worker_health

    port = free_port()
    dead = f"http://127.0.0.1:{free_port()}/"
    env = {"GPULEDGER_KAFKA_BOOTSTRAP": kafka_bootstrap, "GPULEDGER_KAFKA_TOPIC_PREFIX": catalogue.prefix,
           "GPULEDGER_KAFKA_RAW_PARTITIONS": str(catalogue.raw_partitions), "GPULEDGER_DATA_DIR": str(tmp_path),
           "GPULEDGER_CLICKHOUSE_DSN": dead, "GPULEDGER_STREAMS_WEB_PORT": str(port), "GPULEDGER_STREAMS_APP_ID": f"{catalogue.prefix}-app"}
    service = ServiceProcess(["-v", "worker"], env, tmp_path / "worker.log").start()
    try:
        publish(kafka_bootstrap, catalogue, SCENARIO[:5])
        url, deadline, page = f"http://127.0.0.1:{port}", time.monotonic() + 90, {}
        while time.monotonic() < deadline:
            page = worker_health(url) or {}
            if any("writes into" in p for p in page.get("problems") or []):
                break
            assert service.alive(), service.log_tail()
            time.sleep(0.5)
        assert page.get("status") == "degraded", page
        assert any(p.startswith("sink: writes into") and "failing for" in p for p in page["problems"]), page.get("problems")
        assert page["sink"]["problems"] and page["stats"]["stored"] == 0
        nobody = type("W", (), {"dsn": dead, "data_dir": tmp_path})
        out = status_of(kafka_bootstrap, catalogue, nobody, "--url", url)
        assert out.exit_code == 1 and "problem: sink: writes into" in out.stdout, out.output
    finally:
        service.stop(grace=10)


def test_status_on_the_default_store_without_an_address_says_who_does_not_answer(kafka_bootstrap, catalogue, tmp_path):
    """No GPULEDGER_CLICKHOUSE_DSN (the embedded default) and no --url: `gpuledger status` looked
    for the owner file through a DSN of None and crashed with a traceback."""
    from typer.testing import CliRunner

    from gpuledger.cli import app as cli_app
    from gpuledger.dev.process import free_port

    port = free_port()
    env = {"GPULEDGER_KAFKA_BOOTSTRAP": kafka_bootstrap, "GPULEDGER_KAFKA_TOPIC_PREFIX": catalogue.prefix,
           "GPULEDGER_KAFKA_RAW_PARTITIONS": str(catalogue.raw_partitions), "GPULEDGER_CLICKHOUSE_DSN": None,
           "GPULEDGER_DATA_DIR": str(tmp_path), "GPULEDGER_STREAMS_APP_ID": f"{catalogue.prefix}-app",
           "GPULEDGER_STREAMS_WEB_PORT": str(port), "COLUMNS": "200"}
    out = CliRunner().invoke(cli_app, ["status"], env=env)
    assert out.exit_code == 1 and (out.exception is None or isinstance(out.exception, SystemExit)), out.output
    assert f"not answering at http://127.0.0.1:{port}" in out.stdout, out.output


def wait_lag_zero(url: str, timeout: float = 60.0, known: dict[str, str] | None = None) -> dict:
    """Until the route, controls and sink processes each report a group lag of 0 on a
    partition they know the lag of (librdkafka's statistics: every 5 s) — for ``known``
    (child -> topic), on a partition of that topic (the sink's consumers report apart: its
    raw topics' lag was known before its correlated topic's, on a loaded CI machine); their ``lag``."""
    from streams.progress import worker_health

    def knows(v: dict, topic: str | None) -> bool:
        return any(n is not None and (topic is None or p.rsplit("[", 1)[0] == topic) for p, n in v.get("partitions", {}).items())

    deadline, lag = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        page = worker_health(url) or {}
        lag = {name: (page.get(name) or {}).get("lag") or {} for name in ("route", "controls", "sink")}
        if all(v.get("total") == 0 and knows(v, (known or {}).get(name)) for name, v in lag.items()):
            return lag
        time.sleep(0.5)
    raise AssertionError(f"the children's lag never came down to 0: {lag}")


def wait_quiet(url: str, quiet_s: float = 2.0, timeout: float = 60.0) -> None:
    """Until the worker's counters have not moved for ``quiet_s``."""
    import json
    import urllib.request

    keys = ("routed", "correlated_in", "correlated_out", "controls_in", "violations_out", "stored")
    deadline, last, since = time.monotonic() + timeout, None, time.monotonic()
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{url}/gpuledger/health/", timeout=5) as resp:
            stats = json.loads(resp.read())["stats"]
        now = tuple(stats.get(k) for k in keys)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.2)
    raise AssertionError(f"the worker never went quiet: {dict(zip(keys, last or ()))}")
