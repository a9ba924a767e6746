"""The thin end-to-end path, for `make demo` until the exercise simulator lands.

Starts the local Kafka broker (unless GPULEDGER_KAFKA_BOOTSTRAP points elsewhere),
creates the topics, starts a worker that owns an embedded ClickHouse store, publishes
a model release (registered, approved, promoted to prod) and a firing quality alert
for it, waits until the correlated rows are queryable, prints the trace, stops
everything it started, and says where the data is.
"""

from __future__ import annotations

import shutil
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from rich.console import Console

from gpuledger.localkafka import LocalKafka
from gpuledger.process import ServiceProcess, wait_for_worker
from producers._kafka import EventPublisher, ensure_topics
from schemas import AlertEvent, Identity, ReleaseEvent, Source, make_event_id
from schemas.alert import AlertPayload
from schemas.release import ReleasePayload
from sinks.read.query import RemoteReader, owner_file
from sinks.read.trace import trace_alert

RELEASE_ID = "fraud-scorer-v7-prod"
FINGERPRINT = "7d1f2a9c3b4e5f60"
MANIFEST = Identity(
    release_id=RELEASE_ID, model_name="fraud-scorer", model_version="7",
    artifact_digest="sha256:" + "a1" * 32, image_digest="sha256:" + "b2" * 32,
    config_digest="sha256:" + "c3" * 32, dataset_ref="s3://datasets/fraud/2026-11", owner="team-risk", environment="prod",
)


def sample_events(now: datetime) -> list:
    src = Source(collector="demo", host="localhost")
    t0 = now - timedelta(minutes=30)
    events = []
    for i, (etype, payload) in enumerate([
        ("release.registered", ReleasePayload(actor="ci-pipeline")),
        ("release.approved", ReleasePayload(actor="alice", approval_id="CHG-1042")),
        ("release.promoted", ReleasePayload(actor="alice", to_environment="prod", approval_id="CHG-1042")),
    ]):
        at = t0 + timedelta(minutes=5 * i)
        events.append(ReleaseEvent(event_id=make_event_id("demo", (RELEASE_ID, etype), at.isoformat()), event_type=etype,
                                   occurred_at=at, observed_at=now, source=src, identity=MANIFEST, payload=payload))
    starts = now - timedelta(minutes=2)
    events.append(AlertEvent(
        event_id=make_event_id("alertmanager", (FINGERPRINT, "firing", starts.isoformat())), event_type="alert.firing",
        occurred_at=starts, observed_at=now, source=src,
        identity=Identity(release_id=RELEASE_ID, alert_fingerprint=FINGERPRINT, namespace="risk", pod="fraud-scorer-7-abc12"),
        payload=AlertPayload(alertname="ModelQualityDegraded", severity="critical", starts_at=starts,
                             labels={"alertname": "ModelQualityDegraded", "gpuledger_release_id": RELEASE_ID},
                             annotations={"summary": "precision@k dropped below 0.82"}),
    ))
    return events


def run_demo(settings, console: Console) -> int:
    from sinks.read.tree import render_tree

    base = Path(settings.data_dir) / "demo"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    dsn = f"chdb://{base / 'clickhouse'}"
    broker = None
    worker = None
    try:
        if settings.kafka.bootstrap:
            bootstrap = settings.kafka.bootstrap
            console.print(f"[bold]kafka[/]  using {bootstrap}")
        else:
            console.print("[bold]kafka[/]  starting the local broker (first run downloads Kafka's jars with Maven)...")
            broker = LocalKafka(base / "kafka", settings.cache_dir).start()
            bootstrap = broker.bootstrap
            console.print(f"[bold]kafka[/]  ready at {bootstrap}")
        settings = settings.model_copy(update={"kafka": settings.kafka.model_copy(update={"bootstrap": bootstrap})})
        ensure_topics({"bootstrap.servers": bootstrap}, settings.kafka.catalogue())
        console.print("[bold]worker[/] starting (Faust + embedded ClickHouse)...")
        env = {"GPULEDGER_KAFKA_BOOTSTRAP": bootstrap, "GPULEDGER_DATA_DIR": str(base), "GPULEDGER_CLICKHOUSE_DSN": dsn,
               "GPULEDGER_STREAMS_APP_ID": "gpuledger-demo"}
        worker = ServiceProcess(["worker"], env, base / "worker.log").start()
        url = wait_for_worker(worker, owner_file(dsn))
        console.print(f"[bold]worker[/] ready, read-only queries at {url}")
        publisher = EventPublisher({"bootstrap.servers": bootstrap}, settings.kafka.catalogue(), "demo")
        events = sample_events(datetime.now(timezone.utc))
        publisher.publish_batch(events)
        console.print(f"[bold]events[/] published {len(events)}: release registered/approved/promoted, quality alert firing")
        reader = RemoteReader(url)
        console.print("[bold]wait[/]   for the pipeline to correlate and store...")
        deadline = time.monotonic() + 120
        result = None
        while time.monotonic() < deadline:
            if not worker.alive():
                console.print(f"[red]the worker died[/]:\n{worker.log_tail()}")
                return 1
            result = trace_alert(reader, settings.clickhouse.database, FINGERPRINT)
            rel = result.get("release") or {}
            if rel.get("artifact_digest") and len(rel.get("lifecycle", [])) == 3:
                break
            time.sleep(0.5)
        else:
            console.print(f"[red]the trace did not complete in time[/]; worker log: {base / 'worker.log'}")
            return 1
        publisher.close()
        console.print(render_tree(result))
        ok = (result["release"]["release_id"] == RELEASE_ID and result["release"]["model_version"] == MANIFEST.model_version
              and result["release"]["artifact_digest"] == MANIFEST.artifact_digest)
        console.print("[green]trace matches the events sent[/]" if ok else "[red]trace does not match the events sent[/]")
        return 0 if ok else 1
    finally:
        if worker:
            console.print("[bold]stop[/]   worker")
            worker.stop()
        if broker:
            console.print("[bold]stop[/]   local Kafka")
            broker.stop()
        console.print(f"[bold]data[/]   {base}  (query it: GPULEDGER_DATA_DIR={base} GPULEDGER_CLICKHOUSE_DSN={dsn} "
                      f"gpuledger sql \"SELECT event_type, release_id, summary FROM gpuledger.correlated_events FINAL\")")
