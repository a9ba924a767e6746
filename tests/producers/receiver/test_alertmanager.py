"""producers/receiver/alertmanager.py: webhook v4 bodies (tests/data/alertmanager/) → alert events.

Pure functions, no broker: the HTTP path and the topics are covered in test_receiver.py.
"""

from __future__ import annotations

import copy
import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

from producers._errors import PayloadError
from producers.receiver.alertmanager import AlertIdentityLabels, alert_events, truncated_alerts
from schemas import decode_event, encode_event

DATA = Path(__file__).resolve().parents[2] / "data" / "alertmanager"
T_OBSERVED = datetime(2026, 5, 4, 12, 0, tzinfo=timezone.utc)  # after every fixture's startsAt/endsAt (EventBase: not after it was observed)


def load(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def test_quality_alerts_carry_release_identity_from_labels():
    events = alert_events(load("quality_firing.json"), observed_at=T_OBSERVED, host="rx-1")
    assert [e.event_type for e in events] == ["alert.firing", "alert.firing"]
    first = events[0]
    assert first.identity.release_id == "fraud-detector:7"
    assert first.identity.model_name == "fraud-detector"
    assert first.identity.model_version == "7"
    assert first.identity.environment == "prod"
    assert (first.identity.namespace, first.identity.pod) == ("fraud", "fraud-detector-7-5c9d8b7f6d-x2x4q")
    assert first.identity.owner == "risk-ml"
    assert first.identity.alert_fingerprint == "5b8a4f0e9c21d7a3"
    assert first.correlation_key() == "fraud-detector:7"
    # Go's nanoseconds are truncated to microseconds; the zero endsAt of a firing alert is None.
    assert first.payload.starts_at == datetime(2026, 5, 4, 9, 12, 31, 417383, tzinfo=timezone.utc)
    assert first.occurred_at == first.payload.starts_at
    assert first.payload.ends_at is None
    assert first.payload.alertname == "ModelAccuracyDrop"
    assert first.payload.severity == "critical"
    assert first.payload.receiver == "gpuledger"
    assert first.payload.group_key == '{}/{severity="critical"}:{alertname="ModelAccuracyDrop"}'
    assert first.payload.annotations["runbook_url"].startswith("https://")
    assert first.payload.generator_url.startswith("http://prometheus-k8s-0:9090/graph")
    assert first.source.collector == "alertmanager" and first.source.host == "rx-1"
    assert first.observed_at == T_OBSERVED
    assert len({e.event_id for e in events}) == 2
    # What goes on the wire decodes back to the same event (the contract holds).
    assert decode_event(encode_event(first)) == first


def test_resolved_alert_occurs_at_its_end():
    (event,) = alert_events(load("quality_resolved.json"))
    assert event.event_type == "alert.resolved"
    assert event.payload.ends_at == datetime(2026, 5, 4, 9, 47, 1, 20000, tzinfo=timezone.utc)
    assert event.occurred_at == event.payload.ends_at


def test_dcgm_exporter_labels_map_to_node_gpu_and_the_workload_pod():
    (event,) = alert_events(load("gpu_xid_firing.json"))
    ident = event.identity
    assert ident.node == "gpu-node-a3"  # dcgm-exporter's Hostname label
    assert ident.gpu_id == "GPU-8f3c2b1a-6d4e-4f0a-9b7c-2e1d0c9b8a76"  # UUID, not the `gpu` index
    # Scraped without honor_labels: exported_* is the workload, namespace/pod the exporter.
    assert (ident.namespace, ident.pod) == ("llm-train", "llm-pretrain-worker-2")
    assert ident.release_id is None
    assert event.correlation_key() == "llm-train/llm-pretrain-worker-2"
    assert event.payload.labels["gpu"] == "3"


def test_label_names_are_configurable():
    body = load("gpu_xid_firing.json")
    body["alerts"][0]["labels"]["app_release"] = "llm-7b:12"
    names = AlertIdentityLabels(release_id=["app_release"], namespace=["namespace"], pod=["pod"], node=["instance"], gpu_id=["gpu"])
    (event,) = alert_events(body, names)
    assert event.identity.release_id == "llm-7b:12"
    assert (event.identity.namespace, event.identity.pod) == ("gpu-operator", "nvidia-dcgm-exporter-7xk2p")
    assert event.identity.node == "10.42.3.17:9400"
    assert event.identity.gpu_id == "3"


def test_same_alert_state_yields_the_same_event_id():
    body = load("quality_firing.json")
    first = alert_events(body, observed_at=T_OBSERVED)
    # Alertmanager re-sends the group later, and its HA peer sends it too (other receiver
    # name, other group key when routed twice): same alert state, same ids.
    resent = copy.deepcopy(body)
    resent["receiver"] = "gpuledger-ha"
    resent["groupKey"] = '{}/{team="risk"}:{alertname="ModelAccuracyDrop"}'
    resent["alerts"][0]["startsAt"] = "2026-05-04T09:12:31.417383Z"  # same instant, other precision
    again = alert_events(resent, observed_at=datetime(2026, 5, 4, 9, 20, tzinfo=timezone.utc))
    assert [e.event_id for e in again] == [e.event_id for e in first]
    # A new state of the same series is a new fact.
    (resolved,) = alert_events(load("quality_resolved.json"))
    assert resolved.event_id != first[0].event_id
    refired = copy.deepcopy(body)
    refired["alerts"][0]["startsAt"] = "2026-05-04T10:00:00Z"
    assert alert_events(refired)[0].event_id != first[0].event_id


def test_truncated_alerts_are_reported():
    body = load("quality_firing.json")
    assert truncated_alerts(body) == 0
    body["truncatedAlerts"] = 12
    assert truncated_alerts(body) == 12


def _broken(mutate) -> dict:
    body = load("quality_firing.json")
    mutate(body)
    return body


@pytest.mark.parametrize(("mutate", "field", "text"), [
    (lambda b: b.pop("alerts"), "alerts", "field required"),
    (lambda b: b.update(alerts={"a": 1}), "alerts", "must be a list"),
    (lambda b: b.update(version="3"), "version", "not supported"),
    (lambda b: b["alerts"][1].update(startsAt="yesterday"), "alerts[1].startsAt", "not a timestamp"),
    (lambda b: b["alerts"][1].update(startsAt="2026-05-04T09:12:31"), "alerts[1].startsAt", "not a timestamp"),
    (lambda b: b["alerts"][1].pop("startsAt"), "alerts[1].startsAt", "field required"),
    (lambda b: b["alerts"][0].update(endsAt="soon"), "alerts[0].endsAt", "not a timestamp"),
    (lambda b: b["alerts"][0].update(status="pending"), "alerts[0].status", "'firing' or 'resolved'"),
    (lambda b: b["alerts"][0].pop("fingerprint"), "alerts[0].fingerprint", "field required"),
    (lambda b: b["alerts"][0]["labels"].pop("alertname"), "alerts[0].labels.alertname", "label required"),
    (lambda b: b["alerts"][0]["labels"].update(gpu=3), "alerts[0].labels.gpu", "must be a string"),
    (lambda b: b["alerts"][0].update(status="resolved"), "alerts[0].endsAt", "needs an end time"),
    (lambda b: b["alerts"][0].update(status="resolved", endsAt="2000-01-01T00:00:00Z"), "alerts[0].endsAt", "cannot end"),
    (lambda b: b["alerts"].append("x"), "alerts[2]", "must be an object"),
    (lambda b: b["alerts"].append({**b["alerts"][0], "labels": {**b["alerts"][0]["labels"], "extra": "x"}}), "alerts[2].fingerprint",
     "with other labels or annotations"),
    # The same fingerprint with a space: one event id (it is stripped), so the same state and one content
    # (review: both were accepted under one id, and one was lost downstream).
    (lambda b: b["alerts"].append({**b["alerts"][0], "fingerprint": b["alerts"][0]["fingerprint"] + " ",
                                   "labels": {**b["alerts"][0]["labels"], "extra": "x"}}), "alerts[2].fingerprint",
     "with other labels or annotations"),
])
def test_bad_payloads_name_the_field(mutate, field, text):
    with pytest.raises(PayloadError) as info:
        alert_events(_broken(mutate))
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    assert text in str(info.value)
    assert info.value.status == 422


def test_every_problem_is_reported_at_once_and_nothing_is_built():
    def mutate(b):
        b["alerts"][0]["startsAt"] = "nope"
        b["alerts"][1]["status"] = "weird"
    with pytest.raises(PayloadError) as info:
        alert_events(_broken(mutate))
    assert "alerts[0].startsAt" in str(info.value) and "alerts[1].status" in str(info.value)


def test_non_object_body_is_rejected():
    with pytest.raises(PayloadError, match="must be a JSON object"):
        alert_events([{"alerts": []}])


@pytest.mark.parametrize("name", ["gpu_xid_firing.json", "quality_firing.json", "quality_resolved.json"])
def test_events_are_contract_events_a_decoder_reads_back_unchanged(name):
    # alert_events validates each event as one document; what it returns is exactly what the
    # contract's decoder makes of the encoded record (nothing unchecked or left unnormalised).
    for event in alert_events(load(name), observed_at=T_OBSERVED, host="rx-1"):
        assert decode_event(encode_event(event)) == event


def test_a_second_label_map_is_used_as_given():
    # The label map of each call is the one read (the per-map lookup table is cached by map).
    body = load("gpu_xid_firing.json")
    default = alert_events(body, observed_at=T_OBSERVED)[0]
    custom = alert_events(body, AlertIdentityLabels(node=["no-such-label"]), observed_at=T_OBSERVED)[0]
    assert default.identity.node is not None
    assert custom.identity.node is None
    assert custom.identity.gpu_id == default.identity.gpu_id
