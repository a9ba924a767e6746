"""The lifecycle contract every long-running component follows (producers/_runtime.py).

Each component runs as the real `gpuledger` process: it starts, works until SIGTERM, then
flushes its producer, saves its state and exits 0 — within 10 s. One parametrized test
checks all of them against their sources: the scheduler collector against the API-server
double, the pod-resources collector against the kubelet double, the receiver with a real
webhook delivery, the worker with published events and gpuledger admit with an AdmissionReview. What "saved and flushed" means is
checked from outside: the state file holds what was published, the records are on the topic.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import pytest

from gpuledger.dev.process import ServiceProcess
from producers._kafka import EventPublisher
from schemas import decode_event
from tests.fixtures.kafka import read_topic
from tests.fixtures.kube_api import PODS, FakeKubeApi, make_pod
from tests.fixtures.kubelet import FakeKubelet, container, devices, pod
from tests.fixtures.sample_events import FINGERPRINT, sample_events

STOP_WITHIN_S = 10.0
NODE = "gpu-node-1"
GPU_A = "GPU-8f1c2d3e-4a5b-6c7d-8e9f-0a1b2c3d4e5f"
GPU_B = "GPU-1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901"
T0 = datetime(2026, 11, 30, 10, 0, 0, tzinfo=timezone.utc)
ALERT = Path(__file__).resolve().parent / "data" / "alertmanager" / "quality_firing.json"


@dataclass
class Component:
    """One long-running component: how it runs, when it is busy, and what must hold after SIGTERM."""

    service: ServiceProcess
    busy: Callable[[], None]
    saved_and_flushed: Callable[[], None]


def wait_until(predicate: Callable[[], object], what: str, service: ServiceProcess, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert service.alive(), f"{what}: the process died:\n{service.log_tail()}"
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what} not within {timeout:.0f}s:\n{service.log_tail()}")


def events(bootstrap: str, topic: str, min_count: int) -> list:
    return [decode_event(m.value()) for m in read_topic(bootstrap, topic, min_count=min_count, timeout=20, settle=0.5)]


def base_env(kafka_bootstrap: str, catalogue, data: Path) -> dict[str, str]:
    return {"GPULEDGER_KAFKA_BOOTSTRAP": kafka_bootstrap, "GPULEDGER_KAFKA_TOPIC_PREFIX": catalogue.prefix,
            "GPULEDGER_KAFKA_RAW_PARTITIONS": str(catalogue.raw_partitions), "GPULEDGER_DATA_DIR": str(data)}


def scheduler_collector(stack: ExitStack, kafka_bootstrap: str, catalogue, tmp_path: Path) -> Component:
    api = stack.enter_context(FakeKubeApi())
    first = api.create(PODS, make_pod("ml", "train-0", node="gpu-1", created=T0))
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": api.url}}], "users": [{"name": "u", "user": {}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}}]}))
    state = tmp_path / "scheduler-state"
    # State writes held back for an hour: only the stop can have written the last batch.
    env = {**base_env(kafka_bootstrap, catalogue, tmp_path / "data"), "GPULEDGER_SCHEDULER_BACKOFF_INITIAL_S": "0.05",
           "GPULEDGER_SCHEDULER_STATE_FLUSH_INTERVAL_S": "3600"}
    service = ServiceProcess(["-v", "collect", "scheduler", "--kubeconfig", str(kubeconfig), "--state-dir", str(state)], env,
                             tmp_path / "scheduler.log")
    uids = [first["metadata"]["uid"]]

    def busy() -> None:
        wait_until(lambda: api.open_watches(PODS) >= 1, "the pod watch", service)
        uids.append(api.create(PODS, make_pod("ml", "train-1", created=T0))["metadata"]["uid"])
        wait_until(lambda: {e.identity.pod for e in events(kafka_bootstrap, catalogue.scheduler, 2)} == {"train-0", "train-1"},
                   "both pods' events on the topic", service)

    def saved_and_flushed() -> None:
        objects = json.loads((state / "scheduler-state.json").read_text())["objects"]
        assert set(uids) <= set(objects), objects
        assert {e.identity.pod for e in events(kafka_bootstrap, catalogue.scheduler, 2)} == {"train-0", "train-1"}

    return Component(service, busy, saved_and_flushed)


def podresources_collector(stack: ExitStack, kafka_bootstrap: str, catalogue, tmp_path: Path) -> Component:
    sockets = Path(tempfile.mkdtemp(prefix="gllc-", dir="/tmp"))  # unix socket paths must stay short
    stack.callback(shutil.rmtree, sockets, True)
    kubelet = stack.enter_context(FakeKubelet(sockets / "kubelet.sock"))
    kubelet.set_pods([pod("ml", "trainer-0", containers=[container("main", devices=[devices("nvidia.com/gpu", [GPU_A])])])])
    state = tmp_path / "podresources-state"
    service = ServiceProcess(["-v", "collect", "podresources", "--socket", str(sockets / "kubelet.sock"), "--node", NODE, "--interval", "0.1",
                              "--state-dir", str(state)], base_env(kafka_bootstrap, catalogue, tmp_path / "data"), tmp_path / "podresources.log")

    def assigned() -> set[str]:
        return {e.payload.device_id for e in events(kafka_bootstrap, catalogue.gpu, 1) if e.event_type == "gpu.assigned"}

    def busy() -> None:
        wait_until(lambda: assigned() == {GPU_A}, "the first assignment on the topic", service)
        kubelet.set_pods([pod("ml", "trainer-0", containers=[container("main", devices=[devices("nvidia.com/gpu", [GPU_A, GPU_B])])])])
        wait_until(lambda: assigned() == {GPU_A, GPU_B}, "the second assignment on the topic", service)

    def saved_and_flushed() -> None:
        snapshot = json.loads((state / f"podresources-{NODE}.json").read_text())
        assert sorted(a["device_id"] for a in snapshot["assignments"]) == sorted([GPU_A, GPU_B])
        assert assigned() == {GPU_A, GPU_B}

    return Component(service, busy, saved_and_flushed)


def receiver(stack: ExitStack, kafka_bootstrap: str, catalogue, tmp_path: Path) -> Component:
    service = ServiceProcess(["-v", "receive", "--port", "0"], base_env(kafka_bootstrap, catalogue, tmp_path / "data"), tmp_path / "receiver.log")

    def busy() -> None:
        url = wait_until(lambda: (m := re.search(r"listening on (http://\S+)", service.log_path.read_text(errors="replace"))) and m.group(1),
                         "the receiver's address", service)
        request = urllib.request.Request(f"{url}/v1/alertmanager", data=ALERT.read_bytes(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as resp:
            assert resp.status == 200 and json.loads(resp.read())["accepted"] >= 1

    def saved_and_flushed() -> None:
        assert events(kafka_bootstrap, catalogue.alert, 1)  # acknowledged before the 200, still there

    return Component(service, busy, saved_and_flushed)


def worker(stack: ExitStack, kafka_bootstrap: str, catalogue, tmp_path: Path) -> Component:
    data = tmp_path / "worker" / "data"  # not there yet, nor its parent: the worker creates both
    app_id = f"{catalogue.prefix}-lifecycle"
    env = {**base_env(kafka_bootstrap, catalogue, data), "GPULEDGER_CLICKHOUSE_DSN": f"chdb://{data / 'clickhouse'}",
           "GPULEDGER_CLICKHOUSE_BATCH_SECONDS": "0.3", "GPULEDGER_STREAMS_APP_ID": app_id}
    service = ServiceProcess(["-v", "worker"], env, tmp_path / "worker.log")
    correlated = catalogue.run(app_id).correlated

    def busy() -> None:
        from gpuledger.dev.process import wait_for_worker
        from sinks.read.query import RemoteReader, owner_file

        wait_for_worker(service, owner_file(env["GPULEDGER_CLICKHOUSE_DSN"]))
        publisher = EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, "lifecycle-test")
        publisher.publish_batch(sample_events(datetime.now(timezone.utc)))
        publisher.close()
        reader = RemoteReader.from_owner(owner_file(env["GPULEDGER_CLICKHOUSE_DSN"]))
        wait_until(lambda: reader.query("SELECT count() AS n FROM gpuledger.correlated_events FINAL WHERE alert_fingerprint = {fp:String}",
                                        {"fp": FINGERPRINT}).dicts()[0]["n"], "the alert's correlated row stored", service, 120)

    def saved_and_flushed() -> None:
        # Every output is acknowledged before its input batch is: the correlated rows are all there.
        assert len(read_topic(kafka_bootstrap, correlated, min_count=4, timeout=20, settle=0.5)) >= 4

    return Component(service, busy, saved_and_flushed)


def admit(stack: ExitStack, kafka_bootstrap: str, catalogue, tmp_path: Path) -> Component:
    import ssl

    ca = tmp_path / "admit-ca.crt"
    service = ServiceProcess(["-v", "admit", "--port", "0", "--ca-out", str(ca)], base_env(kafka_bootstrap, catalogue, tmp_path / "data"),
                             tmp_path / "admit.log")
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "lifecycle-1", "kind": {"group": "", "version": "v1", "kind": "Pod"}, "operation": "CREATE", "namespace": "ml",
        "object": {"metadata": {"name": "train-0", "labels": {"gpuledger.io/environment": "prod"}},
                   "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}}}

    def busy() -> None:
        url = wait_until(lambda: (m := re.search(r"listening on (https://[0-9.]+:\d+)", service.log_path.read_text(errors="replace"))) and m.group(1),
                         "gpuledger admit's address", service)
        context = ssl.create_default_context(cafile=str(ca))

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"{url}/readyz", timeout=5, context=context) as resp:
                    return resp.status == 200
            except OSError:
                return False

        wait_until(ready, "gpuledger admit's release state (readyz)", service)
        request = urllib.request.Request(f"{url}/validate", data=json.dumps(review).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30, context=context) as resp:
            assert json.loads(resp.read())["response"]["allowed"] is False

    def saved_and_flushed() -> None:
        # Decisions are published off the request path; the stop publishes what was still queued.
        decided = [e for e in events(kafka_bootstrap, catalogue.scheduler, 1) if e.event_type == "admission.decided"]
        assert [(e.identity.pod, e.payload.rule) for e in decided] == [("train-0", "no-release-identity")]

    return Component(service, busy, saved_and_flushed)


COMPONENTS = {"scheduler-collector": scheduler_collector, "podresources-collector": podresources_collector, "receiver": receiver,
              "worker": worker, "admit": admit}


@pytest.mark.parametrize("name", list(COMPONENTS))
def test_runs_until_sigterm_then_flushes_saves_and_exits_0(name, kafka_bootstrap, catalogue, tmp_path):
    with ExitStack() as stack:
        component = COMPONENTS[name](stack, kafka_bootstrap, catalogue, tmp_path)
        service = component.service.start()
        stack.callback(service.kill)  # whatever happens, nothing is left running
        component.busy()
        started = time.monotonic()
        code = service.stop(grace=STOP_WITHIN_S)
        took = time.monotonic() - started
        assert code == 0, f"{name} exited {code} after SIGTERM ({took:.1f}s):\n{service.log_tail()}"
        assert took < STOP_WITHIN_S
        component.saved_and_flushed()


def test_the_receiver_logs_a_kafka_outage_once_not_per_attempt(catalogue, tmp_path):
    """Found by an exploratory review: while Kafka was down the receiver logged every attempt —
    librdkafka's reconnects, its own 503s, the MLflow alias reader's retries every second — while
    the worker logged a repeated line once a minute with a count. Every command now does (the CLI's
    root installs gpuledger.telemetry.calm_logging). Two requests answered 503 over ~15 s here."""
    from gpuledger.dev.process import free_port

    env = {**base_env(f"127.0.0.1:{free_port()}", catalogue, tmp_path / "data"), "GPULEDGER_KAFKA_DELIVERY_TIMEOUT_S": "2"}
    service = ServiceProcess(["-v", "receive", "--port", "0"], env, tmp_path / "receiver.log").start()
    try:
        url = wait_until(lambda: (m := re.search(r"listening on (http://\S+)", service.log_path.read_text(errors="replace"))) and m.group(1),
                         "the receiver's address", service)
        for _ in range(2):
            request = urllib.request.Request(f"{url}/v1/alertmanager", data=ALERT.read_bytes(), headers={"Content-Type": "application/json"})
            try:
                urllib.request.urlopen(request, timeout=60)
            except urllib.error.HTTPError as exc:
                assert exc.code == 503, exc
            else:
                raise AssertionError("a receiver without Kafka answered 2xx")
        log = service.log_path.read_text(errors="replace")
        assert log.count("answering 503") == 1, log
        assert log.count("cannot read MLflow alias holders") == 1, log  # (it retries every second)
    finally:
        service.stop(grace=10)


def test_the_worker_stopped_during_a_kafka_outage_exits_0_in_time_without_a_traceback(catalogue, tmp_path):
    """Found by an exploratory review: SIGTERM while the broker was away stopped the worker in
    time but printed "Exception in thread ... asyncio.exceptions.CancelledError" with a 30-line
    traceback — aiokafka's fetcher close re-raising the cancellation of a fetch sleeping on its
    retry back-off (streams.transport.ConsumerThread). A broker of the test's own, stopped under
    a worker that has stored its input; then SIGTERM."""
    from gpuledger.dev.localkafka import LocalKafka
    from gpuledger.dev.process import wait_for_worker
    from gpuledger.settings import default_cache_dir
    from producers._kafka import ensure_topics
    from sinks.read.query import owner_file
    from streams.progress import worker_health

    with ExitStack() as stack:
        broker = stack.enter_context(LocalKafka(tmp_path / "kafka", default_cache_dir(), with_parent=True))
        ensure_topics({"bootstrap.servers": broker.bootstrap}, catalogue)
        comp = worker(stack, broker.bootstrap, catalogue, tmp_path)
        service = comp.service.start()
        stack.callback(service.kill)
        comp.busy()
        url = wait_for_worker(service, owner_file(f"chdb://{tmp_path / 'worker' / 'data' / 'clickhouse'}"))
        broker.stop()
        # the worker has seen the outage: its health page no longer says ok
        wait_until(lambda: (page := worker_health(url)) is not None and page.get("status") != "ok", "the worker degraded", service, 60)
        started = time.monotonic()
        code = service.stop(grace=STOP_WITHIN_S)
        took = time.monotonic() - started
        log = service.log_path.read_text(errors="replace")
        assert code == 0 and took < STOP_WITHIN_S, f"exit {code} after {took:.1f}s:\n{service.log_tail()}"
        assert "Traceback" not in log and "Exception in thread" not in log, log[-6000:]
