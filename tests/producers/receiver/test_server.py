"""producers/receiver/server.py against a real broker: every endpoint, read back from the topics.

The receiver runs in-process (``serve`` on a free 127.0.0.1 port in a background
thread with its own event loop); requests go over real HTTP. Payloads are the
sender-shaped samples under tests/data/. Broker trouble is a dedicated local broker
stopped and restarted on the same port.
"""

from __future__ import annotations

import asyncio
import copy
import http.client
import json
import logging
import tempfile
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import aiohttp
import pytest

from gpuledger.dev.localkafka import LocalKafka
from gpuledger.settings import KafkaSettings, Settings, default_cache_dir
from producers._kafka import EventPublisher, ensure_topics
from producers.receiver.mlflow import DELIVERY_ID_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from producers.receiver.config import ReceiverSettings
from producers.receiver.server import serve
from schemas import decode_event
from schemas.topics import TopicCatalogue
from tests.fixtures.kafka import read_topic

DATA = Path(__file__).resolve().parents[2] / "data"
NOW = datetime.now(timezone.utc).replace(microsecond=0)


class RunningReceiver:
    """``serve`` in a background thread; ``url`` once it listens."""

    def __init__(self, config: ReceiverSettings, publisher: EventPublisher, publish_timeout_s: float = 35.0, policy=None) -> None:
        self.config = config.model_copy(update={"host": "127.0.0.1", "port": 0})
        self.policy = policy
        self.publisher = publisher
        self.publish_timeout_s = publish_timeout_s
        self.url = ""
        self._listening = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._error: BaseException | None = None

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()

            def listening(host: str, port: int) -> None:
                self.url = f"http://{host}:{port}"
                self._listening.set()

            await serve(self.config, self.publisher, self._stop, listening, self.publish_timeout_s, self.policy)

        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - surfaced to the test thread
            self._error = exc
            self._listening.set()

    def __enter__(self) -> RunningReceiver:
        self._thread.start()
        assert self._listening.wait(10), "receiver did not start"
        if self._error:
            raise self._error
        return self

    def __exit__(self, *exc) -> None:
        if self._loop and self._stop:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        self.publisher.close(5)

    def request(self, method: str, path: str, body: bytes | str | None = None, headers: dict | None = None,
                content_type: str | None = "application/json") -> tuple[int, dict]:
        host, port = self.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        hdrs = dict(headers or {})
        if content_type and body is not None:
            hdrs.setdefault("Content-Type", content_type)
        conn.request(method, path, body=body.encode() if isinstance(body, str) else body, headers=hdrs)
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        return resp.status, json.loads(data) if data else {}

    def post(self, path: str, body, **kw) -> tuple[int, dict]:
        if not isinstance(body, (bytes, str)):
            body = json.dumps(body)
        return self.request("POST", path, body, **kw)


@pytest.fixture
def receiver(catalogue, settings_for):
    """Factory: a running receiver on the test catalogue, with optional settings."""
    running: list[RunningReceiver] = []

    def start(**config) -> RunningReceiver:
        settings = settings_for(catalogue)
        rx = RunningReceiver(ReceiverSettings(**config), EventPublisher.from_settings(settings, "receiver"))
        running.append(rx.__enter__())
        return rx

    yield start
    for rx in running:
        rx.__exit__()


def sample(family: str, name: str) -> bytes:
    return (DATA / family / name).read_bytes()


def events_on(bootstrap: str, topic: str, min_count: int, timeout: float = 20.0, settle: float = 0.5) -> list:
    return [(m.key().decode() if m.key() else None, decode_event(m.value())) for m in read_topic(bootstrap, topic, min_count, timeout, settle)]


def release_event(event_type: str = "release.approved", release_id: str = "fraud-detector:7", **extra) -> dict:
    body = {
        "event_id": uuid.uuid4().hex,
        "event_type": event_type,
        "occurred_at": NOW.isoformat(),
        "observed_at": NOW.isoformat(),
        "source": {"collector": "ci", "host": "runner-3"},
        "identity": {"release_id": release_id, "model_name": "fraud-detector", "model_version": "7"},
        "payload": {"actor": "alice@example.com", "approval_id": "CHG-1042"},
    }
    body.update(extra)
    return body


def mlflow_headers(body: bytes, secret: str | None = None, delivery_id: str | None = None) -> dict:
    delivery_id = delivery_id or str(uuid.uuid4())
    ts = str(int(time.time()))
    headers = {DELIVERY_ID_HEADER: delivery_id, TIMESTAMP_HEADER: ts}
    if secret:
        headers[SIGNATURE_HEADER] = sign(secret, delivery_id, ts, body)
    return headers


# --- every endpoint, read back ------------------------------------------------------

def test_alertmanager_webhook_lands_on_the_alert_topic(receiver, catalogue, kafka_bootstrap):
    rx = receiver()
    status, answer = rx.post("/v1/alertmanager", sample("alertmanager", "quality_firing.json"))
    assert status == 200, answer
    assert answer["accepted"] == 2 and answer["truncated_alerts"] == 0
    status, xid = rx.post("/v1/alertmanager", sample("alertmanager", "gpu_xid_firing.json"))
    assert status == 200, xid
    records = events_on(kafka_bootstrap, catalogue.alert, 3)
    assert sorted(e.event_id for _, e in records) == sorted(answer["event_ids"] + xid["event_ids"])
    by_id = {e.event_id: (key, e) for key, e in records}
    key, quality = by_id[answer["event_ids"][0]]
    assert key == "fraud-detector:7" and quality.identity.release_id == "fraud-detector:7"
    key, gpu = by_id[xid["event_ids"][0]]
    assert key == "llm-train/llm-pretrain-worker-2"
    assert gpu.identity.gpu_id == "GPU-8f3c2b1a-6d4e-4f0a-9b7c-2e1d0c9b8a76" and gpu.identity.node == "gpu-node-a3"
    status, health = rx.request("GET", "/healthz")
    assert status == 200 and health["counters"]["alertmanager"]["received"] == 3


def test_same_alert_state_posted_twice_has_one_event_id(receiver, catalogue, kafka_bootstrap):
    rx = receiver()
    body = sample("alertmanager", "quality_resolved.json")
    first = rx.post("/v1/alertmanager", body)[1]["event_ids"]
    ha_copy = json.loads(body)
    ha_copy["receiver"] = "gpuledger-peer"
    second = rx.post("/v1/alertmanager", ha_copy)[1]["event_ids"]
    assert first == second
    records = events_on(kafka_bootstrap, catalogue.alert, 2)
    assert {e.event_id for _, e in records} == set(first)


def test_release_events_single_and_list(receiver, catalogue, kafka_bootstrap):
    rx = receiver()
    one = release_event()
    status, single = rx.post("/v1/releases", one)
    assert status == 200 and len(single["event_ids"]) == 1
    assert single["event_ids"] != [one["event_id"]]  # the receiver computes ids; the caller's is ignored
    batch = [release_event("release.promoted", payload={"to_environment": "prod"}),
             release_event("release.reservation_created", release_id="llm-7b:12",
                           payload={"reservation": {"reservation_id": "rsv-9", "gpus": 16, "pool": "h100"}})]
    status, answer = rx.post("/v1/releases", batch)
    assert status == 200 and answer["accepted"] == 2
    records = events_on(kafka_bootstrap, catalogue.release, 3)
    assert {e.event_id for _, e in records} == {*single["event_ids"], *answer["event_ids"]}
    keys = {e.event_id: key for key, e in records}
    assert keys[answer["event_ids"][1]] == "llm-7b:12"
    # Unauthenticated callers' events are marked so, whatever they claim.
    claimed = release_event(payload={"actor": "alice", "authenticated_by": "token"})
    status, answer = rx.post("/v1/releases", claimed)
    [(_, stored)] = [(k, e) for k, e in events_on(kafka_bootstrap, catalogue.release, 4) if e.event_id == answer["event_ids"][0]]
    assert (stored.payload.actor, stored.payload.authenticated_by) == ("alice", None)


def test_mlflow_webhooks_become_release_events(receiver, catalogue, kafka_bootstrap):
    rx = receiver(mlflow_secret="whsec-s3cr3t")
    published = {}
    for name in ("registered_model_created", "model_version_created", "model_version_tag_set_approved",
                 "model_version_alias_created_prod", "model_version_alias_deleted", "model_version_tag_deleted"):
        body = sample("mlflow", f"{name}.json")
        status, answer = rx.post("/v1/mlflow", body, headers=mlflow_headers(body, "whsec-s3cr3t"))
        assert status == 200, (name, answer)
        published[name] = answer["event_ids"]
    assert published["registered_model_created"] == [] and published["model_version_alias_deleted"] == []
    records = events_on(kafka_bootstrap, catalogue.release, 3)
    types = {e.event_id: e.event_type for _, e in records}
    assert types == {published["model_version_created"][0]: "release.registered",
                     published["model_version_tag_set_approved"][0]: "release.approved",
                     published["model_version_alias_created_prod"][0]: "release.promoted"}
    assert {key for key, _ in records} == {"fraud-detector:7"}


def test_mlflow_alias_moves_that_arrive_out_of_order_are_judged_in_the_order_they_were_made(receiver, catalogue, kafka_bootstrap):
    """MLflow delivers webhooks from a pool of threads: of two moves made back to back, the later
    can arrive first. Judged on arrival, it recorded no previous holder (the real-MLflow test
    `test_alias_moves_made_back_to_back…` failed so on a loaded machine)."""
    import threading
    from datetime import datetime, timedelta, timezone

    rx = receiver(mlflow_secret="whsec-s3cr3t")
    now = datetime.now(timezone.utc)

    def move(version: str, at: datetime) -> bytes:
        return json.dumps({"entity": "model_version_alias", "action": "created", "timestamp": at.isoformat(),
                           "data": {"name": "ranker-ooo", "alias": "prod", "version": version}}).encode()

    # The receiver has read the alias holders (an alias delivery waits for that: two waiting then
    # went on in any order) — another model's move, answered, says so.
    ready = json.dumps({"entity": "model_version_alias", "action": "created", "timestamp": (now - timedelta(minutes=1)).isoformat(),
                        "data": {"name": "ranker-ready", "alias": "prod", "version": "1"}}).encode()
    assert rx.post("/v1/mlflow", ready, headers=mlflow_headers(ready, "whsec-s3cr3t"))[0] == 200
    now = datetime.now(timezone.utc)  # (the moves are made now: MLflow sends them at once)
    first, second = move("1", now), move("2", now + timedelta(milliseconds=50))
    answers: dict[str, tuple] = {}
    late = threading.Thread(target=lambda: answers.__setitem__("first", rx.post("/v1/mlflow", first, headers=mlflow_headers(first, "whsec-s3cr3t"))))
    answers["second"] = None
    early = threading.Thread(target=lambda: answers.__setitem__("second", rx.post("/v1/mlflow", second, headers=mlflow_headers(second, "whsec-s3cr3t"))))
    early.start()  # the later move first …
    time.sleep(0.2)  # (an ordering of two requests, not a wait for a condition: the earlier move arrives 200 ms after the later one)
    late.start()
    early.join(30)
    late.join(30)
    assert answers["first"][0] == 200 and answers["second"][0] == 200, answers
    records = {e.event_id: e for _, e in events_on(kafka_bootstrap, catalogue.release, 3)}
    promoted_2 = records[answers["second"][1]["event_ids"][0]]
    assert (promoted_2.event_type, promoted_2.identity.release_id, promoted_2.payload.superseded_release_id) == \
        ("release.promoted", "ranker-ooo:2", "ranker-ooo:1"), promoted_2


def test_mlflow_redelivery_is_dropped_by_delivery_id(receiver, catalogue, kafka_bootstrap):
    rx = receiver()
    body = sample("mlflow", "model_version_alias_created_prod.json")
    headers = mlflow_headers(body, delivery_id="5e3c7f9a-0000-4000-8000-000000000001")
    status, first = rx.post("/v1/mlflow", body, headers=headers)
    assert status == 200 and first["accepted"] == 1
    status, again = rx.post("/v1/mlflow", body, headers=headers)
    assert status == 200 and again == {"accepted": 0, "event_ids": [], "duplicate_delivery": True}
    assert len(events_on(kafka_bootstrap, catalogue.release, 1)) == 1


def test_health_counters_match_what_reached_kafka(receiver, catalogue, kafka_bootstrap):
    rx = receiver()
    assert rx.post("/v1/alertmanager", sample("alertmanager", "quality_firing.json"))[0] == 200
    assert rx.post("/v1/alertmanager", sample("alertmanager", "gpu_xid_firing.json"))[0] == 200
    assert rx.post("/v1/releases", [release_event(), release_event("release.promoted", payload={"to_environment": "prod"})])[0] == 200
    body = sample("mlflow", "model_version_alias_created_prod.json")
    assert rx.post("/v1/mlflow", body, headers=mlflow_headers(body))[0] == 200
    assert rx.post("/v1/releases", release_event("release.launched"))[0] == 422  # rejected: counted, not sent
    alerts = read_topic(kafka_bootstrap, catalogue.alert, 1)
    releases = read_topic(kafka_bootstrap, catalogue.release, 1)
    counters = rx.request("GET", "/healthz")[1]["counters"]
    assert counters["alertmanager"]["sent"] == len(alerts) == 3
    assert counters["alertmanager"]["bytes_sent"] == sum(len(m.value()) for m in alerts)
    assert counters["releases"]["sent"] + counters["mlflow"]["sent"] == len(releases) == 3
    assert (counters["releases"]["sent"], counters["mlflow"]["sent"]) == (2, 1)
    assert counters["releases"]["rejected"] == 1 and counters["releases"]["received"] == 2


def test_health_and_readiness(receiver):
    rx = receiver()
    assert rx.request("GET", "/healthz")[0] == 200
    assert rx.request("GET", "/readyz") == (200, {"ready": True})
    status, answer = rx.request("GET", "/nope")
    assert status == 404 and answer["error"]


# --- bad input: 4xx naming the field, nothing on the topics ----------------------------

def test_bad_input_is_rejected_and_nothing_is_published(receiver, catalogue, kafka_bootstrap):
    rx = receiver(max_body_bytes=4096)
    good_alerts = json.loads(sample("alertmanager", "quality_firing.json"))
    bad_ts = copy.deepcopy(good_alerts)
    bad_ts["alerts"][1]["startsAt"] = "last tuesday"
    no_alerts = {k: v for k, v in good_alerts.items() if k != "alerts"}
    mlflow_bad = json.loads(sample("mlflow", "model_version_alias_created_prod.json"))
    mlflow_bad["action"] = "archived"
    release_bad_time = release_event(occurred_at="2026-05-04 noon")
    missing_release_id = release_event()
    missing_release_id["identity"] = {"model_name": "fraud-detector"}
    cases = [
        # (path, body, content type, status, field, text)
        ("/v1/alertmanager", "{not json", "application/json", 400, None, "not JSON"),
        ("/v1/alertmanager", json.dumps(good_alerts), "text/plain", 415, "Content-Type", "application/json"),
        ("/v1/alertmanager", json.dumps(good_alerts), None, 415, "Content-Type", "application/json"),
        ("/v1/alertmanager", json.dumps({**good_alerts, "pad": "x" * 5000}), "application/json", 413, None, "limit"),
        ("/v1/alertmanager", json.dumps(no_alerts), "application/json", 422, "alerts", "field required"),
        ("/v1/alertmanager", json.dumps(bad_ts), "application/json", 422, "alerts[1].startsAt", "not a timestamp"),
        ("/v1/releases", json.dumps(release_event("release.launched")), "application/json", 422, "event_type", "unknown event type"),
        ("/v1/releases", json.dumps([release_event(), release_event("alert.firing")]), "application/json", 422, "[1].event_type", "not a release event"),
        ("/v1/releases", json.dumps(release_bad_time), "application/json", 422, "occurred_at", "occurred_at"),
        ("/v1/releases", json.dumps(missing_release_id), "application/json", 422, "identity.release_id", "release_id"),
        ("/v1/releases", json.dumps("release.approved"), "application/json", 422, None, "JSON object"),
        ("/v1/mlflow", json.dumps(mlflow_bad), "application/json", 422, "action", "model_version_alias.archived"),
        ("/v1/mlflow", "[]", "application/json", 422, None, "JSON object"),
    ]
    for path, body, ctype, status, field, text in cases:
        got, answer = rx.post(path, body, content_type=ctype)
        assert (got, answer.get("field")) == (status, field), (path, body[:80], answer)
        assert text in answer["error"], (path, answer)
        if field:
            assert answer["error"].startswith(f"{field}: "), answer
    assert rx.request("GET", "/v1/alertmanager")[0] == 405
    assert events_on(kafka_bootstrap, catalogue.alert, 0, timeout=3) == []
    assert events_on(kafka_bootstrap, catalogue.release, 0, timeout=3) == []
    counters = rx.request("GET", "/healthz")[1]["counters"]
    assert counters["alertmanager"]["rejected.unsupported_media_type"] == 2
    assert counters["alertmanager"]["rejected.too_large"] == 1
    assert counters["releases"]["rejected.unknown_event_type"] == 2


def test_control_and_bidi_characters_in_identity_are_422_naming_the_field(receiver, catalogue, kafka_bootstrap, caplog):
    from tests.fixtures.logs import calm_records

    caplog.set_level(logging.WARNING, logger="producers.receiver.server")
    # As the CLI logs: one template for every refusal showed only a minute's first (review of the change).
    with calm_records("producers.receiver.server") as calm:
        rx = receiver()
        rlo_name = json.loads(sample("alertmanager", "quality_firing.json"))
        rlo_name["alerts"][0]["labels"]["alertname"] = "Gpu\u202eexe.gnp"
        nul_pod = json.loads(sample("alertmanager", "gpu_xid_firing.json"))
        nul_pod["alerts"][0]["labels"]["exported_pod"] = "\x00"
        forged_actor = release_event(payload={"actor": "alice\u202e", "approval_id": "CHG-1"})
        nul_release = release_event(identity={"release_id": "fraud-detector:7\x00"})
        mlflow_rlo = json.loads(sample("mlflow", "model_version_alias_created_prod.json"))
        mlflow_rlo["data"]["name"] = "fraud\u202edetector"
        cases = [
            ("/v1/alertmanager", rlo_name, "alerts[0].labels.alertname", "U+202E (RIGHT-TO-LEFT OVERRIDE)"),
            ("/v1/alertmanager", nul_pod, "alerts[0].labels.exported_pod", "U+0000"),
            ("/v1/releases", forged_actor, "payload.actor", "U+202E"),
            ("/v1/releases", nul_release, "identity.release_id", "U+0000"),
            ("/v1/mlflow", mlflow_rlo, "data.name", "U+202E"),
        ]
        for path, body, field, text in cases:
            status, answer = rx.post(path, body)
            assert (status, answer["field"]) == (422, field), (path, answer)
            assert text in answer["error"] and "\u202e" not in answer["error"] and "\x00" not in answer["error"], answer
        # Each refusal is a WARNING naming the field (a sender does not retry a 4xx: the log is where it shows).
        refused = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "refused" in r.getMessage()]
        assert len(refused) == len(cases) and all("answering 422, refused (" in m and "), to 127.0.0.1: " in m and f"{field}: " in m
                                                  and text in m for m, (_, _, field, text) in zip(refused, cases)), refused
        # Through the repeat filter: each route and reason shows (the two bodies refused alike on one route fold into one).
        shown = {m.split(", to ")[0] for m in (r.getMessage() for r in calm) if "refused" in m}
        assert shown == {m.split(", to ")[0] for m in refused} and len(shown) >= 3, shown
        # Free text may carry them (escaped on output): an annotation with U+202E is accepted.
        rlo_note = json.loads(sample("alertmanager", "quality_firing.json"))
        rlo_note["alerts"][0]["annotations"]["description"] = "look \u202e here"
        assert rx.post("/v1/alertmanager", rlo_note)[0] == 200
        assert len(events_on(kafka_bootstrap, catalogue.alert, 2)) == 2
        assert events_on(kafka_bootstrap, catalogue.release, 0, timeout=3) == []


def test_release_event_from_a_future_schema_version_is_refused_and_dead_lettered(receiver, catalogue, kafka_bootstrap):
    rx = receiver()
    future = release_event(schema_version=99)
    status, answer = rx.post("/v1/releases", [release_event(), future])
    assert (status, answer["field"]) == (422, "[1].schema_version"), answer
    assert (answer["dead_lettered"], answer["schema_version_seen"], answer["supported_schema_version"]) == (1, [99], 1)
    assert events_on(kafka_bootstrap, catalogue.release, 0, timeout=3) == []  # all-or-nothing
    [record] = read_topic(kafka_bootstrap, catalogue.deadletter, 1)
    letter = json.loads(record.value())
    assert letter["reason"] == "unsupported_schema_version" and letter["stage"] == "receiver.releases"
    assert "[schema_version=99 supported=1]" in letter["error"]
    assert json.loads(letter["value"])["event_id"] == future["event_id"]


def test_a_dead_lettered_future_event_carries_what_the_receiver_proved_not_what_the_body_claimed(receiver, catalogue, kafka_bootstrap):
    """A body from a newer schema version is kept for a newer gpuledger to replay — it was kept
    verbatim, with 'authenticated_by: token' and another person's actor as the caller wrote them,
    and nothing named the authenticated sender."""
    forged = release_event(schema_version=99, payload={"actor": "user:alice", "authenticated_by": "token",
                                                        "actor_groups": ["release-managers"], "on_behalf_of": "user:bob"})
    assert receiver().post("/v1/releases", forged)[0] == 422  # a receiver taking anonymous posts
    rx = receiver(releases_bearer_token="ci-token")
    assert rx.post("/v1/releases", forged, headers={"Authorization": "Bearer ci-token"})[0] == 422
    letters = [json.loads(r.value()) for r in read_topic(kafka_bootstrap, catalogue.deadletter, 2)]
    anonymous, proven = sorted(letters, key=lambda letter: "service:releases" in letter["error"])
    assert json.loads(anonymous["value"])["payload"]["authenticated_by"] is None
    assert json.loads(anonymous["value"])["payload"]["actor_groups"] == []
    assert "received from an unauthenticated caller; the body claimed" in anonymous["error"]
    vouched = json.loads(proven["value"])["payload"]
    assert (vouched["actor"], vouched["authenticated_by"], vouched["actor_groups"]) == ("service:releases", "shared-token", [])
    # A delegation nobody checked (_proven would have refused it: 403) is not kept either.
    assert "on_behalf_of" not in vouched and "on_behalf_of" not in json.loads(anonymous["value"])["payload"]
    assert "received from service:releases (shared-token)" in proven["error"]


# --- what cannot travel: 413 / 422 naming the limit, free text cut -----------------------

def test_body_over_max_body_bytes_is_413_naming_the_limit(receiver, catalogue, kafka_bootstrap):
    rx = receiver(max_body_bytes=4096)
    body = json.dumps({**json.loads(sample("alertmanager", "quality_firing.json")), "pad": "x" * 5000})
    status, answer = rx.post("/v1/alertmanager", body)
    assert status == 413, answer
    assert (answer["limit_bytes"], answer["size_bytes"], answer["field"]) == (4096, len(body), None)
    assert "4096-byte limit" in answer["error"]
    assert events_on(kafka_bootstrap, catalogue.alert, 0, timeout=3) == []


def test_event_over_the_event_limit_is_422_naming_it_and_nothing_is_published(receiver, catalogue, kafka_bootstrap):
    rx = receiver()
    limit = rx.publisher.max_event_bytes
    assert limit == 256 * 1024  # the test topics take Kafka's default 1,048,588-byte records
    # Every annotation within its 8 KiB cap, but 40 of them: the event is over the limit.
    alerts = json.loads(sample("alertmanager", "quality_firing.json"))
    alerts["alerts"][1]["annotations"].update({f"note_{i}": "n" * 8000 for i in range(40)})
    status, answer = rx.post("/v1/alertmanager", alerts)
    assert (status, answer["field"], answer["limit_bytes"]) == (422, "alerts[1]", limit), answer
    assert answer["size_bytes"] > limit and answer["event_id"]
    assert answer["error"].startswith("alerts[1]: ") and str(limit) in answer["error"]

    releases = [release_event(), release_event(payload={"reason": "r" * 300_000})]
    status, answer = rx.post("/v1/releases", releases)
    assert (status, answer["field"], answer["limit_bytes"]) == (422, "[1]", limit), answer
    assert answer["event_id"] in answer["error"] and answer["event_id"] != releases[1]["event_id"]  # the receiver's id

    # Labels identify the alert: one over 4 KiB is refused, not cut.
    long_label = json.loads(sample("alertmanager", "quality_firing.json"))
    long_label["alerts"][0]["labels"]["team"] = "t" * 5000
    status, answer = rx.post("/v1/alertmanager", long_label)
    assert (status, answer["field"], answer["limit_bytes"], answer["size_bytes"]) == (422, "alerts[0].labels.team", 4096, 5000), answer

    assert events_on(kafka_bootstrap, catalogue.alert, 0, timeout=3) == []
    assert events_on(kafka_bootstrap, catalogue.release, 0, timeout=3) == []
    counters = rx.request("GET", "/healthz")[1]["counters"]
    assert counters["alertmanager"]["rejected.event_too_large"] == 1 and counters["alertmanager"]["rejected.field_too_large"] == 1
    assert counters["releases"]["rejected.event_too_large"] == 1


def test_huge_annotation_is_cut_with_a_marker_and_the_alert_accepted(receiver, catalogue, kafka_bootstrap):
    rx = receiver()
    body = json.loads(sample("alertmanager", "quality_firing.json"))
    body["alerts"][0]["annotations"]["description"] = "stack trace: " + "d" * 300_000
    body["alerts"][0]["generatorURL"] = "http://prometheus:9090/graph?g0.expr=" + "q" * 20_000
    status, answer = rx.post("/v1/alertmanager", body)
    assert status == 200 and answer["accepted"] == 2, answer
    cut = answer["truncated_fields"]
    assert set(cut) == {"alerts[0].annotations.description", "alerts[0].generatorURL"}
    by_id = {e.event_id: e for _, e in events_on(kafka_bootstrap, catalogue.alert, 2)}
    alert = by_id[answer["event_ids"][0]].payload
    description = alert.annotations["description"]
    assert description.startswith("stack trace: ddd") and len(description.encode()) <= 8 * 1024
    assert description.endswith(f"…[truncated {cut['alerts[0].annotations.description']} bytes]")
    assert alert.generator_url.endswith(f"…[truncated {cut['alerts[0].generatorURL']} bytes]")
    assert alert.annotations["summary"] == "Online accuracy of fraud-detector:7 fell below 0.92"  # short text untouched
    assert by_id[answer["event_ids"][1]].payload.annotations == body["alerts"][1]["annotations"]
    assert rx.request("GET", "/healthz")[1]["counters"]["alertmanager"]["truncated"] == 2


def test_anonymous_callers_claiming_different_actors_get_different_event_ids(receiver, catalogue, kafka_bootstrap):
    """Every unauthenticated event's id was computed for one caller, 'unauthenticated': mallory's
    approval and alice's (same release, approval id and time) had the same id — both answered 200,
    and downstream kept whichever came first."""
    rx = receiver()
    by = {actor: rx.post("/v1/releases", release_event(payload={"actor": actor, "approval_id": "CHG-1"}))[1]["event_ids"][0]
          for actor in ("mallory", "alice")}
    assert by["mallory"] != by["alice"], by
    again = rx.post("/v1/releases", release_event(payload={"actor": "alice", "approval_id": "CHG-1"}))[1]["event_ids"][0]
    assert again == by["alice"]  # a retry is still the same event


def test_auth_per_source(receiver, catalogue, kafka_bootstrap):
    rx = receiver(alertmanager_bearer_token="am-token", releases_bearer_token="ci-token", mlflow_secret="whsec-1")
    alerts = sample("alertmanager", "quality_resolved.json")
    mlflow = sample("mlflow", "model_version_tag_set_approved.json")
    rejected = [
        ("/v1/alertmanager", alerts, {}),
        ("/v1/alertmanager", alerts, {"Authorization": "Bearer wrong"}),
        ("/v1/alertmanager", alerts, {"Authorization": "Basic YW06YW0tdG9rZW4="}),
        ("/v1/alertmanager", alerts, {"Authorization": "Bearer ci-token"}),
        ("/v1/releases", json.dumps(release_event()), {}),
        ("/v1/releases", json.dumps(release_event()), {"Authorization": "Bearer am-token"}),
        ("/v1/mlflow", mlflow, mlflow_headers(mlflow)),  # unsigned
        ("/v1/mlflow", mlflow, mlflow_headers(mlflow, "wrong-secret")),
        ("/v1/mlflow", mlflow.replace(b'"true"', b'"TRUE"'), mlflow_headers(mlflow, "whsec-1")),  # body changed after signing
        ("/v1/mlflow", mlflow, {**mlflow_headers(mlflow, "whsec-1"), "Authorization": "Bearer wrong"}),  # presented and wrong
        ("/v1/alertmanager", alerts, {"Authorization": ""}),  # presented and empty
        ("/v1/releases", json.dumps(release_event()), {"Authorization": " "}),
    ]
    for path, body, headers in rejected:
        status, answer = rx.post(path, body, headers=headers)
        assert status == 401, (path, headers, answer)
        assert answer["field"] in ("Authorization", SIGNATURE_HEADER)
    assert rx.post("/v1/alertmanager", alerts, headers={"Authorization": "Bearer am-token"})[0] == 200
    # The shared token proves service:releases, so an event claiming alice is refused (403) ...
    status, answer = rx.post("/v1/releases", release_event(), headers={"Authorization": "Bearer ci-token"})
    assert (status, answer["field"]) == (403, "payload.actor"), answer
    # ... and one naming no actor is stored as by the proven caller.
    unnamed = release_event(payload={"approval_id": "CHG-1042"})
    assert rx.post("/v1/releases", unnamed, headers={"Authorization": "Bearer ci-token"})[0] == 200
    assert rx.post("/v1/mlflow", mlflow, headers=mlflow_headers(mlflow, "whsec-1"))[0] == 200
    assert len(events_on(kafka_bootstrap, catalogue.alert, 1)) == 1
    stored = events_on(kafka_bootstrap, catalogue.release, 2)
    assert sorted((e.payload.actor, e.payload.authenticated_by) for _, e in stored) == [
        ("service:mlflow/gpuledger", "mlflow-webhook"), ("service:releases", "shared-token")]


def test_settings_report_every_problem(monkeypatch):
    from gpuledger.settings import SettingsError

    monkeypatch.setenv("GPULEDGER_RECEIVER_MLFLOW", json.dumps({"release_id_template": "{model}"}))
    monkeypatch.setenv("GPULEDGER_RECEIVER_ALERT_LABELS__NODE", json.dumps(["kubernetes_node"]))
    with pytest.raises(SettingsError) as info:
        Settings.load(receiver={"port": 70000, "releases_bearer_token": " "})
    text = str(info.value)
    assert "GPULEDGER_RECEIVER_PORT" in text and "GPULEDGER_RECEIVER_RELEASES_BEARER_TOKEN" in text and "RELEASE_ID_TEMPLATE" in text
    monkeypatch.delenv("GPULEDGER_RECEIVER_MLFLOW")
    config = Settings.load(receiver={"port": 9999}).receiver
    assert config.alert_labels.node == ["kubernetes_node"] and config.port == 9999


# --- load: no loss, no duplicates -------------------------------------------------------

def test_concurrent_alert_posts_lose_nothing_and_duplicate_nothing(receiver, catalogue, kafka_bootstrap):
    rx = receiver()
    template = json.loads(sample("alertmanager", "quality_resolved.json"))
    n = 300

    def body(i: int) -> str:
        b = copy.deepcopy(template)
        b["alerts"][0]["fingerprint"] = f"{i:016x}"
        b["alerts"][0]["labels"]["gpuledger_release_id"] = f"fraud-detector:{i % 7}"
        return json.dumps(b)

    async def post_all() -> list[tuple[int, dict]]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=n)) as session:
            async def one(i: int):
                async with session.post(f"{rx.url}/v1/alertmanager", data=body(i), headers={"Content-Type": "application/json"}) as resp:
                    return resp.status, await resp.json()
            return await asyncio.gather(*(one(i) for i in range(n)))

    started = time.monotonic()
    answers = asyncio.run(post_all())
    elapsed = time.monotonic() - started
    assert [s for s, _ in answers] == [200] * n
    accepted = [a["event_ids"][0] for _, a in answers]
    assert len(set(accepted)) == n
    records = events_on(kafka_bootstrap, catalogue.alert, n, timeout=30)
    ids = [e.event_id for _, e in records]
    assert len(ids) == n and set(ids) == set(accepted), f"{len(ids)} records for {n} posts"
    assert elapsed < 20, f"{n} posts took {elapsed:.1f}s"


# --- broker trouble: 503, then recovery ----------------------------------------------

@pytest.fixture
def own_broker():
    """A broker of the test's own, so stopping it bothers no other test."""
    broker = LocalKafka(Path(tempfile.mkdtemp(prefix="gpuledger-rx-kafka-")), default_cache_dir(), log_level="WARN", with_parent=True).start()
    yield broker
    broker.stop()


def test_broker_down_answers_503_then_recovers(own_broker, tmp_path):
    cat = TopicCatalogue(prefix=f"t{uuid.uuid4().hex[:10]}", raw_partitions=2)
    ensure_topics({"bootstrap.servers": own_broker.bootstrap}, cat)
    settings = Settings(data_dir=tmp_path, kafka=KafkaSettings(bootstrap=own_broker.bootstrap, topic_prefix=cat.prefix,
                                                               raw_partitions=2, delivery_timeout_s=1))
    body = sample("alertmanager", "gpu_xid_firing.json")
    with RunningReceiver(ReceiverSettings(), EventPublisher.from_settings(settings, "receiver"), publish_timeout_s=5) as rx:
        assert rx.request("GET", "/readyz")[0] == 200
        own_broker.stop()
        started = time.monotonic()
        status, answer = rx.post("/v1/alertmanager", body)
        assert status == 503, answer
        assert answer["retriable"] is True and "Kafka" in answer["error"]
        assert time.monotonic() - started < 10
        assert rx.request("GET", "/readyz")[0] == 503
        counters = rx.request("GET", "/healthz")[1]["counters"]["alertmanager"]
        assert (counters["sent"], counters["rejected.kafka_unavailable"]) == (0, 1)
        # While the broker is down, the loop still answers other requests at once.
        started = time.monotonic()
        assert rx.request("GET", "/healthz")[0] == 200 and time.monotonic() - started < 1

        restarted = LocalKafka(own_broker.data_dir, own_broker.cache_dir, port=own_broker.port, log_level="WARN", with_parent=True).start()
        try:
            deadline = time.monotonic() + 30
            while True:
                status, answer = rx.post("/v1/alertmanager", body)  # the sender's retry
                if status == 200 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert status == 200, answer
            assert rx.request("GET", "/readyz")[0] == 200
            records = events_on(restarted.bootstrap, cat.alert, 1)
            assert answer["event_ids"][0] in {e.event_id for _, e in records}
        finally:
            restarted.stop()


# --- slow clients: header timeout, connection limit ---------------------------------------

def _closed_within(sock, seconds: float) -> float | None:
    """Seconds until the server closed ``sock`` (recv → b'' or reset), None if it stayed open."""
    import socket

    started = time.monotonic()
    sock.settimeout(0.2)
    while time.monotonic() - started < seconds:
        try:
            data = sock.recv(4096)
        except socket.timeout:
            try:
                sock.send(b"X")  # trickle: a slow-loris keeps sending a byte at a time
            except OSError:
                return time.monotonic() - started
            continue
        except OSError:
            return time.monotonic() - started
        if data == b"" or data.startswith(b"HTTP/1.1 4") or data.startswith(b"HTTP/1.1 5"):
            return time.monotonic() - started
    return None


def test_slow_loris_is_closed_within_the_header_timeout_and_the_limit_holds(receiver):
    import socket

    rx = receiver(header_timeout_s=1.5, max_connections=4)
    host, port = rx.url.removeprefix("http://").split(":")
    loris = socket.create_connection((host, int(port)))
    loris.sendall(b"POST /v1/alertmanager HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Slow: ")
    took = _closed_within(loris, 10)
    assert took is not None and took < 1.5 + 1.0, took
    loris.close()
    # The connection limit: four idle connections held, the fifth is answered 503 and closed.
    idle = [socket.create_connection((host, int(port))) for _ in range(4)]
    # The server accepts in backlog order, so these four are counted before the fifth.
    extra = socket.create_connection((host, int(port)))
    extra.settimeout(5)
    answer = extra.recv(4096)
    assert answer.startswith(b"HTTP/1.1 503") and b"too many connections" in answer, answer
    for s in [extra, *idle]:
        s.close()
    # Once the idle ones are gone, requests are served again.
    deadline = time.monotonic() + 5
    while rx.request("GET", "/healthz")[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rx.request("GET", "/healthz")[0] == 200
