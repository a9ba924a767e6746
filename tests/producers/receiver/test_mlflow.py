"""producers/receiver/mlflow.py: MLflow registry deliveries (tests/data/mlflow/) → release events.

Pure functions, no broker: signature checks, de-dup log, the alias/tag mapping. The
HTTP path (401s, duplicate deliveries, topics) is covered in test_receiver.py.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
from multidict import CIMultiDict
from pydantic import ValidationError

from producers._errors import PayloadError
from producers.receiver.mlflow import (
    DELIVERY_ID_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    DeliveryLog,
    MlflowReleaseMapping,
    TEST_PAYLOADS,
    SignatureError,
    TagRule,
    is_test_delivery,
    release_events,
    sign,
    verify_signature,
)
from schemas import decode_event, encode_event

DATA = Path(__file__).resolve().parents[2] / "data" / "mlflow"
SECRET = "whsec-test-4d1f"


def raw(name: str) -> bytes:
    return (DATA / f"{name}.json").read_bytes()


def load(name: str) -> dict:
    return json.loads(raw(name))


def signed_headers(body: bytes, secret: str = SECRET, delivery_id: str = "0f9e5a52-7d8c-4a1b-9a0e-3c2b1d4e5f60", timestamp: int | None = None) -> CIMultiDict:
    ts = str(int(time.time()) if timestamp is None else timestamp)
    return CIMultiDict({"Content-Type": "application/json", DELIVERY_ID_HEADER: delivery_id, TIMESTAMP_HEADER: ts,
                        SIGNATURE_HEADER: sign(secret, delivery_id, ts, body)})


def test_model_version_created_registers_the_release_with_identity_from_tags():
    (event,) = release_events(load("model_version_created"), host="rx-1")
    assert event.event_type == "release.registered"
    assert event.identity.release_id == "fraud-detector:7"
    assert (event.identity.model_name, event.identity.model_version) == ("fraud-detector", "7")
    assert event.identity.artifact_digest == "sha256:3f79bb7b435b05321651daefd374cdc681dc06faa65e374e38337b88ca046dea"
    assert event.identity.image_digest.startswith("sha256:b5d3")
    assert event.identity.owner == "risk-ml"
    assert event.payload.tags["mlflow.source"] == "models:/m-4f1e0c9ab2d34e57a8b6c1d2e3f40516"
    assert event.payload.tags["mlflow.run_id"] == "8c1f2e3d4b5a69788796a5b4c3d2e1f0"
    assert event.payload.reason == "XGBoost, retrained on April data"
    assert event.occurred_at == datetime(2026, 5, 4, 8, 30, 11, 508771, tzinfo=timezone.utc)
    assert event.source.collector == "mlflow"
    assert decode_event(encode_event(event)) == event


def test_alias_on_a_version_promotes_it_to_the_alias_environment():
    (event,) = release_events(load("model_version_alias_created_prod"))
    assert event.event_type == "release.promoted"
    assert event.identity.release_id == "fraud-detector:7"
    assert event.identity.environment == "prod"
    assert event.payload.to_environment == "prod"
    assert event.payload.tags == {"mlflow.alias": "prod"}
    # MLflow does not say which version held the alias before.
    assert event.payload.superseded_release_id is None


def test_approved_tag_approves():
    (event,) = release_events(load("model_version_tag_set_approved"))
    assert event.event_type == "release.approved"
    assert event.payload.tags == {"approved": "true"}


@pytest.mark.parametrize(("key", "value", "event_type"), [
    ("approved", "True", "release.approved"),
    ("evaluated", "true", "release.evaluated"),
    ("retired", "true", "release.retired"),
    ("revoked", "TRUE", "release.revoked"),
    ("approved", "false", None),
    ("stage", "prod", None),
])
def test_tag_rules(key, value, event_type):
    body = load("model_version_tag_set_approved")
    body["data"].update(key=key, value=value)
    events = release_events(body)
    assert [e.event_type for e in events] == ([event_type] if event_type else [])


@pytest.mark.parametrize("name", ["registered_model_created", "model_version_alias_deleted", "model_version_tag_deleted"])
def test_deliveries_without_a_release_fact_map_to_nothing(name):
    assert release_events(load(name)) == []


@pytest.mark.parametrize("kind", sorted(TEST_PAYLOADS))
def test_mlflows_test_delivery_maps_to_nothing(kind):
    """MLflow's "Test webhook" body (tests/real_cluster/test_mlflow.py sends the real one)."""
    body = {"entity": kind[0], "action": kind[1], "timestamp": "2026-12-01T17:10:00.123456+00:00", "data": dict(TEST_PAYLOADS[kind])}
    assert is_test_delivery(body) and release_events(body) == []
    # The same event with any other data is a real one.
    real = {**body, "data": {**body["data"], "name": "fraud-detector"}}
    assert not is_test_delivery(real)


def test_aliases_outside_the_mapping_are_ignored_and_the_mapping_is_configurable():
    body = load("model_version_alias_created_prod")
    body["data"]["alias"] = "blue"
    assert release_events(body) == []
    mapping = MlflowReleaseMapping(
        alias_environments={"blue": "prod"},
        tag_rules=[TagRule(key="gate", value="passed", event_type="release.approved")],
        release_id_template="{workspace}/{model}@v{version}",
        version_created_event=None,
    )
    body["workspace"] = "team-risk"
    (event,) = release_events(body, mapping)
    assert event.identity.release_id == "team-risk/fraud-detector@v7"
    assert event.identity.environment == "prod"
    assert event.payload.tags["mlflow.workspace"] == "team-risk"
    tag = load("model_version_tag_set_approved")
    tag["data"].update(key="gate", value="passed")
    assert [e.event_type for e in release_events(tag, mapping)] == ["release.approved"]
    assert release_events(load("model_version_tag_set_approved"), mapping) == []
    assert release_events(load("model_version_created"), mapping) == []


def test_bad_mapping_is_rejected_with_every_problem():
    with pytest.raises(ValidationError) as info:
        MlflowReleaseMapping(
            release_id_template="{model}",
            identity_tags={"artifact": "artifact_digest"},
            tag_rules=[TagRule(key="ok", event_type="release.approved"), TagRule(key="ok", value="TRUE", event_type="release.revoked")],
        )
    text = str(info.value)
    assert "release_id_template" in text and "identity_tags" in text
    with pytest.raises(ValidationError, match="more than one rule"):
        MlflowReleaseMapping(tag_rules=[TagRule(key="ok", event_type="release.approved"), TagRule(key="ok", value="TRUE", event_type="release.revoked")])
    with pytest.raises(ValidationError, match="placeholder"):
        MlflowReleaseMapping(release_id_template="{model}:{version}:{stage}")


def test_event_ids_are_deterministic_per_delivery_body():
    body = load("model_version_alias_created_prod")
    first = release_events(body, observed_at=datetime(2026, 5, 4, 9, 0, 1, tzinfo=timezone.utc))
    retried = release_events(json.loads(json.dumps(body)), observed_at=datetime(2026, 5, 4, 9, 0, 9, tzinfo=timezone.utc))
    assert first[0].event_id == retried[0].event_id
    later = dict(body, timestamp="2026-06-01T09:00:00.000001+00:00")
    assert release_events(later)[0].event_id != first[0].event_id
    other_alias = json.loads(json.dumps(body))
    other_alias["data"]["alias"] = "staging"
    assert release_events(other_alias)[0].event_id != first[0].event_id


@pytest.mark.parametrize(("mutate", "field", "reason"), [
    (lambda b: b.pop("entity"), "entity", "validation"),
    (lambda b: b.update(action="archived"), "action", "unknown_event_type"),
    (lambda b: b.update(entity="prompt"), "action", "unknown_event_type"),
    (lambda b: b.update(timestamp="yesterday"), "timestamp", "validation"),
    (lambda b: b.update(data=[]), "data", "validation"),
    (lambda b: b["data"].pop("version"), "data.version", "validation"),
    (lambda b: b["data"].update(alias=""), "data.alias", "validation"),
])
def test_bad_deliveries_name_the_field(mutate, field, reason):
    body = load("model_version_alias_created_prod")
    mutate(body)
    with pytest.raises(PayloadError) as info:
        release_events(body)
    assert (info.value.field, info.value.reason) == (field, reason)
    assert str(info.value).startswith(f"{field}: ")


def test_integer_version_is_accepted():
    body = load("model_version_alias_created_prod")
    body["data"]["version"] = 7
    assert release_events(body)[0].identity.release_id == "fraud-detector:7"


def test_signature_matches_mlflow_format():
    # MLflow: "v1," + base64(HMAC-SHA256(secret, f"{delivery_id}.{timestamp}.{payload}")).
    import base64
    import hashlib
    import hmac

    body = raw("model_version_created")
    expected = base64.b64encode(hmac.new(b"s", b"d-1.1700000000." + body, hashlib.sha256).digest()).decode()
    assert sign("s", "d-1", "1700000000", body) == f"v1,{expected}"


def test_verify_signature_accepts_a_good_delivery():
    body = raw("model_version_created")
    verify_signature(SECRET, signed_headers(body), body)
    # Secret rotation style: several space-separated signatures, one valid.
    headers = signed_headers(body)
    headers[SIGNATURE_HEADER] = "v1,AAAA " + headers[SIGNATURE_HEADER]
    verify_signature(SECRET, headers, body)


@pytest.mark.parametrize(("tamper", "field"), [
    (lambda h, b: (h.pop(SIGNATURE_HEADER), b), SIGNATURE_HEADER),
    (lambda h, b: (h.pop(DELIVERY_ID_HEADER), b), DELIVERY_ID_HEADER),
    (lambda h, b: (h.pop(TIMESTAMP_HEADER), b), TIMESTAMP_HEADER),
    (lambda h, b: (h.__setitem__(SIGNATURE_HEADER, sign("other-secret", h[DELIVERY_ID_HEADER], h[TIMESTAMP_HEADER], b)), b), SIGNATURE_HEADER),
    (lambda h, b: (None, b.replace(b'"7"', b'"8"')), SIGNATURE_HEADER),
    (lambda h, b: (h.__setitem__(DELIVERY_ID_HEADER, "another-id"), b), SIGNATURE_HEADER),
    (lambda h, b: (h.__setitem__(TIMESTAMP_HEADER, "1700000000"), b), TIMESTAMP_HEADER),
    (lambda h, b: (h.__setitem__(TIMESTAMP_HEADER, "2026-05-04T09:00:00Z"), b), TIMESTAMP_HEADER),
])
def test_verify_signature_rejects_bad_deliveries(tamper, field):
    body = raw("model_version_created")
    headers = signed_headers(body)
    _, body = tamper(headers, body)
    with pytest.raises(SignatureError) as info:
        verify_signature(SECRET, headers, body)
    assert info.value.status == 401
    assert info.value.field == field


def test_stale_timestamp_passes_when_the_check_is_off():
    body = raw("model_version_created")
    verify_signature(SECRET, signed_headers(body, timestamp=1_700_000_000), body, tolerance_s=0)


def test_delivery_log_is_a_bounded_lru():
    log = DeliveryLog(size=2)
    assert not log.seen("a")
    log.remember("a")
    log.remember("b")
    assert log.seen("a")  # touches a: b is now the oldest
    log.remember("c")
    assert log.seen("a") and log.seen("c") and not log.seen("b")
    assert not log.seen(None)
    off = DeliveryLog(size=0)
    off.remember("a")
    assert not off.seen("a")


def _alias_move(version: str, at: str) -> dict:
    return {"entity": "model_version_alias", "action": "created", "timestamp": at,
            "data": {"name": "fraud-detector", "alias": "prod", "version": version}}


def _signed(event):
    """``event`` as the receiver publishes a signed delivery's (``_stamped``)."""
    from producers.receiver.server import MLFLOW_PROOF

    return event.model_copy(update={"payload": event.payload.model_copy(update={"authenticated_by": MLFLOW_PROOF})})


def test_alias_moves_know_the_previous_holder_and_a_move_back_is_a_rollback():
    from producers.receiver.mlflow import AliasHolders

    holders = AliasHolders()
    moves = [("14", "2026-05-04T09:00:00.100000+00:00", "d1"), ("15", "2026-05-04T09:00:00.400000+00:00", "d2"),
             ("14", "2026-05-04T09:00:00.700000+00:00", "d3")]
    out = []
    for version, at, delivery in moves:
        events = release_events(_alias_move(version, at), delivery_id=delivery, holders=holders)
        for event in events:
            holders.observe(_signed(event))
        out.append([(e.event_type, e.identity.release_id, e.payload.superseded_release_id) for e in events])
    assert out == [
        [("release.promoted", "fraud-detector:14", None)],
        [("release.promoted", "fraud-detector:15", "fraud-detector:14")],
        [("release.rolled_back", "fraud-detector:15", "fraud-detector:14"), ("release.promoted", "fraud-detector:14", "fraud-detector:15")],
    ]
    # Same body, another delivery: another fact (another id); the same delivery again: the same ids.
    again = release_events(_alias_move("14", moves[2][1]), delivery_id="d3", holders=holders)
    other = release_events(_alias_move("14", moves[2][1]), delivery_id="d4", holders=holders)
    first = release_events(_alias_move("14", moves[0][1]), delivery_id="d1", holders=holders)
    assert [e.event_id for e in again] != [e.event_id for e in other]
    assert len({e.event_id for e in first + again}) == 3


def test_only_proven_events_are_alias_moves():
    """A body POSTed to /v1/releases that only said it came from MLflow (source.collector
    'mlflow', an mlflow.alias tag: the caller's to write) was read back as a move at the next
    start, and the next genuine delivery was published as a rollback of the forged holder —
    with a secret set, and (then with a proven actor) with tokens on /v1/mlflow instead."""
    from datetime import datetime

    from producers.receiver.mlflow import AliasHolders
    from producers.receiver.server import MLFLOW_PROOF

    holders = AliasHolders(proven_by=(MLFLOW_PROOF,))
    [forged] = release_events(_alias_move("99", "2026-05-04T09:00:00.100000+00:00"), delivery_id="f1")
    assert forged.source.collector == "mlflow" and forged.payload.tags.get("mlflow.alias") == "prod"
    holders.observe(forged)  # as /v1/releases would have published it: nobody proved it
    later = datetime.fromisoformat("2026-05-04T09:00:01+00:00")
    assert holders.before(None, "fraud-detector", "prod", later) is None
    [signed] = release_events(_alias_move("14", "2026-05-04T09:00:00.200000+00:00"), delivery_id="s1")
    holders.observe(_signed(signed))
    assert holders.before(None, "fraud-detector", "prod", later).version == "14"
    # A move proven otherwise is no move where deliveries are signed (/v1/mlflow takes nothing else).
    [by_token] = release_events(_alias_move("15", "2026-05-04T09:00:00.300000+00:00"), delivery_id="t1")
    holders.observe(by_token.model_copy(update={"payload": by_token.payload.model_copy(update={"authenticated_by": "token"})}))
    assert holders.before(None, "fraud-detector", "prod", later).version == "14"
    token_mode = AliasHolders(proven_by=("token", "oidc", MLFLOW_PROOF))  # no secret, tokens on /v1/mlflow
    token_mode.observe(forged)
    assert token_mode.before(None, "fraud-detector", "prod", later) is None
    token_mode.observe(by_token.model_copy(update={"payload": by_token.payload.model_copy(update={"authenticated_by": "oidc"})}))
    assert token_mode.before(None, "fraud-detector", "prod", later).version == "15"
