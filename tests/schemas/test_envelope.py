"""The event contract: ids, time, strictness, and the codec's error messages."""

from datetime import datetime, timedelta, timezone

import orjson
import pytest
from pydantic import ValidationError

from schemas import AlertEvent, EventDecodeError, Identity, ReleaseEvent, Source, decode_event, encode_event, make_event_id
from schemas.jsonschema import render_all, JSON_DIR


def release_event(**over):
    base = dict(event_id=make_event_id("cli", ("r1", "release.approved"), "1"), event_type="release.approved",
                occurred_at=datetime(2026, 1, 1, 12, tzinfo=timezone(timedelta(hours=2))),
                observed_at=datetime(2026, 1, 1, 10, 0, 5, tzinfo=timezone.utc), source=Source(collector="cli"),
                identity=Identity(release_id="r1", model_name="m", model_version="3"))
    base.update(over)
    return ReleaseEvent(**base)


def test_event_id_is_deterministic_and_sensitive_to_each_part():
    a = make_event_id("alertmanager", ("fp", "firing", "2026-01-01T00:00:00Z"))
    assert a == make_event_id("alertmanager", ("fp", "firing", "2026-01-01T00:00:00Z"))
    assert a != make_event_id("alertmanager", ("fp", "resolved", "2026-01-01T00:00:00Z"))
    assert a != make_event_id("kubernetes", ("fp", "firing", "2026-01-01T00:00:00Z"))
    assert a != make_event_id("alertmanager", ("fp", "firing", "2026-01-01T00:00:00Z"), "v2")
    assert len(a) == 32


def test_times_are_normalised_to_utc_and_naive_times_rejected():
    ev = release_event()
    assert ev.occurred_at == datetime(2026, 1, 1, 10, tzinfo=timezone.utc)
    assert ev.occurred_at.utcoffset() == timedelta(0)
    with pytest.raises(ValidationError, match="occurred_at"):
        release_event(occurred_at=datetime(2026, 1, 1, 12))


def test_an_event_cannot_have_happened_long_after_it_was_observed():
    """``--at 2062-…`` (a year mistyped) was accepted, and the controls' event-time watermark took it:
    every deadline read as passed from then on. 15 minutes of clock skew are allowed; the worker's
    route stage decodes with the same rule (its dead letter names it)."""
    observed = datetime(2026, 1, 1, 10, 0, 5, tzinfo=timezone.utc)
    assert release_event(occurred_at=observed + timedelta(minutes=15)).occurred_at == observed + timedelta(minutes=15)
    with pytest.raises(ValidationError, match=r"occurred_at 2062-12-05T10:00:00\+00:00 is 36 years after observed_at 2026-01-01T10:00:05\+00:00: "
                                              r"an event cannot have happened more than 15 min after it was observed"):
        release_event(occurred_at=datetime(2062, 12, 5, 10, tzinfo=timezone.utc))
    with pytest.raises(ValidationError, match="is 16 min after observed_at"):
        release_event(occurred_at=observed + timedelta(minutes=16))
    raw = orjson.loads(encode_event(release_event()))
    raw["occurred_at"] = "2026-01-04T10:00:00Z"
    with pytest.raises(EventDecodeError, match="is 2 days after observed_at"):
        decode_event(orjson.dumps(raw))


def test_models_are_frozen_and_reject_unknown_fields():
    ev = release_event()
    with pytest.raises(ValidationError):
        ev.event_type = "release.retired"
    with pytest.raises(ValidationError, match="surprise"):
        Identity(release_id="r", surprise="x")


def test_round_trip_through_the_codec():
    ev = release_event()
    assert decode_event(encode_event(ev)) == ev


@pytest.mark.parametrize(
    "raw, reason, field",
    [
        (b"\x00not json", "not_json", "not JSON"),
        (b"[1,2]", "not_object", "JSON object"),
        (b'{"event_type": "release.exploded"}', "unknown_event_type", "event_type"),
        (b'{"event_id": "abcdefgh1", "event_type": "alert.firing", "occurred_at": "yesterday"}', "validation", "occurred_at"),
    ],
)
def test_decode_errors_name_the_problem(raw, reason, field):
    with pytest.raises(EventDecodeError) as info:
        decode_event(raw)
    assert info.value.reason == reason
    assert field in str(info.value)


@pytest.mark.parametrize("as_bytes", [True, False])
def test_an_envelope_from_a_future_schema_version_is_not_read_as_the_current_one(as_bytes):
    data = release_event().model_dump(mode="json") | {"schema_version": 99}
    with pytest.raises(EventDecodeError) as info:
        decode_event(orjson.dumps(data) if as_bytes else data)
    assert info.value.reason == "unsupported_schema_version"
    assert "[schema_version=99 supported=1]" in str(info.value)


def test_missing_identifier_is_rejected_with_its_name():
    data = release_event().model_dump(mode="json")
    data["identity"] = {"model_name": "m"}
    with pytest.raises(EventDecodeError, match="identity.release_id is required"):
        decode_event(data)


def test_wrong_type_names_the_field():
    data = release_event().model_dump(mode="json")
    data["payload"] = {"reservation": {"reservation_id": "x", "gpus": "many"}}
    with pytest.raises(EventDecodeError, match="payload.reservation.gpus"):
        decode_event(data)


def test_correlation_key_prefers_release_then_workload_then_pod():
    assert release_event().correlation_key() == "r1"
    alert = AlertEvent.model_validate({
        "event_id": "abcdefgh12", "event_type": "alert.firing", "occurred_at": "2026-01-01T00:00:00Z",
        "observed_at": "2026-01-01T00:00:00Z", "source": {"collector": "am"},
        "identity": {"alert_fingerprint": "fp1", "namespace": "ns", "pod": "p"},
        "payload": {"alertname": "X", "starts_at": "2026-01-01T00:00:00Z"},
    })
    assert alert.correlation_key() == "ns/p"


def test_committed_json_schemas_match_the_models():
    rendered = render_all()
    for name, text in rendered.items():
        path = JSON_DIR / name
        assert path.exists(), f"{name} missing: run `gpuledger schemas generate`"
        assert path.read_text() == text, f"{name} drifted from the models: run `gpuledger schemas generate`"


@pytest.mark.parametrize("bad", ["\x00", "team\u202eevil", "a\x1b[31m", "line\u2028break", "zero\u200bwidth"])
def test_identifiers_refuse_control_and_bidi_characters_free_text_keeps_them(bad):
    with pytest.raises(ValidationError, match=r"identity\.pod[\s\S]*identifiers must not carry control or bidi"):
        ReleaseEvent.model_validate(release_event().model_dump(mode="json") | {"identity": {"release_id": "r", "pod": bad}})
    with pytest.raises(EventDecodeError, match="payload.actor"):
        decode_event(release_event().model_dump(mode="json") | {"payload": {"actor": bad}})
    kept = ReleaseEvent.model_validate(release_event().model_dump(mode="json") | {"payload": {"reason": f"why {bad} not"}})
    assert bad in kept.payload.reason
    assert Identity(pod="caf\u00e9-\u4e2d\u6587").pod == "caf\u00e9-\u4e2d\u6587"  # non-ASCII letters are fine


NFD, NFC = "cafe\u0301:1", "caf\u00e9:1"  # one text: 'café:1' with a combining accent, and precomposed


def test_identifiers_are_one_spelling_of_their_text_nfc_and_ascii_ids_are_unchanged():
    """'cafe' + U+0301 and 'caf' + U+00E9 were two releases (exploratory review): an identifier is
    stored in NFC, and an event id is hashed from its key's NFC. ASCII and NFC keys keep their ids
    (pinned: the ids every stored event has)."""
    assert NFD != NFC
    via_nfd = decode_event(release_event().model_dump(mode="json") | {"identity": {"release_id": NFD, "model_name": "m\u0301"},
                                                                      "payload": {"actor": "jose\u0301", "approval_id": "CHG-\u00e9"}})
    assert (via_nfd.identity.release_id, via_nfd.identity.model_name) == (NFC, "\u1e3f")  # (m + U+0301 composes to U+1E3F)
    assert (via_nfd.payload.actor, via_nfd.payload.approval_id) == ("jos\u00e9", "CHG-\u00e9")
    assert Identity(release_id=NFC) == Identity(release_id=NFD)
    assert make_event_id("cli", (NFD, "release.approved"), "1") == make_event_id("cli", (NFC, "release.approved"), "1")
    assert make_event_id("cli", ("r:1", "release.approved", None), "2026-05-04T09:00:00+00:00") == "c02ea47e7df79cff2c35b201087881f2"
    assert make_event_id("mlflow", (NFC, "x"), "d") == "6db34adce662fa4ede97034137a2e218"
    # Compatibility characters are other text (no NFKC folding); a combining mark alone is still allowed.
    assert Identity(release_id="\ufb01le").release_id == "\ufb01le" and Identity(release_id="\u0301x").release_id == "\u0301x"


def _scheduler(payload: dict) -> dict:
    return {"event_id": "abcdefgh12", "event_type": "scheduler.admitted", "occurred_at": "2026-01-01T00:00:00Z",
            "observed_at": "2026-01-01T00:00:00Z", "source": {"collector": "kueue"},
            "identity": {"workload_id": "team-a/wl-1"}, "payload": {"object_kind": "Workload", **payload}}


@pytest.mark.parametrize("payload, field", [
    ({"priority": 2**70}, "payload.priority"),            # Kubernetes priorities are int32
    ({"priority": -(2**31) - 1}, "payload.priority"),
    ({"gpus_requested": 2**32}, "payload.gpus_requested"),  # stored as UInt32
    ({"pod_sets": {"main": 2**40}}, "payload.pod_sets.main"),
])
def test_integers_past_their_range_are_refused_with_the_field_named(payload, field):
    # A number past 64 bits went through validation as a Python int and came out of the
    # route stage's JSON decoder as a float (2**70 -> 1.1805916207174113e+21): the stored
    # payload changed without a word. The contract bounds every integer to what it is.
    with pytest.raises(EventDecodeError) as info:
        decode_event(_scheduler(payload))
    assert info.value.reason == "validation"
    assert field in str(info.value)


def test_what_the_kubelet_and_device_plugins_report_passes():
    # Linux reports NUMA node -1 for a device without NUMA affinity (non-NUMA hosts, VMs), and a
    # device plugin may pass it on; the kubelet's ids are int64. A share index is any int64.
    data = {"event_id": "abcdefgh12", "event_type": "gpu.assigned", "occurred_at": "2026-01-01T00:00:00Z",
            "observed_at": "2026-01-01T00:00:00Z", "source": {"collector": "podresources"},
            "identity": {"node": "n1", "namespace": "ml", "pod": "p"},
            "payload": {"node": "n1", "namespace": "ml", "pod": "p", "device_id": "GPU-1::7", "numa_nodes": [-1, 2**63 - 1], "share": 2**40}}
    event = decode_event(data)
    assert (event.payload.numa_nodes, event.payload.share) == ((-1, 2**63 - 1), 2**40)
    with pytest.raises(EventDecodeError, match="payload.numa_nodes.0"):
        decode_event({**data, "payload": {**data["payload"], "numa_nodes": [2**63]}})


@pytest.mark.parametrize("event_type, drop, names", [
    ("gpu.assigned", ("namespace", "pod"), "namespace, pod"),
    ("gpu.released", ("device_id",), "device_id"),
    ("gpu.device", ("device_id",), "device_id"),
])
def test_a_gpu_event_without_what_names_its_entity_is_refused(event_type, drop, names):
    """Found by a review: a gpu.assigned/released naming no pod passed, and the route stage folded
    assignments from every node into one made-up entity, pod "None/None" (a device without its id into
    "gpu:<node>/None"); refused, it is dead-lettered with the reason."""
    data = {"event_id": "abcdefgh12", "event_type": event_type, "occurred_at": "2026-01-01T00:00:00Z",
            "observed_at": "2026-01-01T00:00:00Z", "source": {"collector": "podresources"}, "identity": {"node": "n1"},
            "payload": {"node": "n1", "namespace": "ml", "pod": "p", "device_id": "GPU-1"}}
    decode_event(data)  # whole, it passes
    with pytest.raises(EventDecodeError, match=f"needs payload.*{names}"):
        decode_event({**data, "payload": {k: v for k, v in data["payload"].items() if k not in drop}})
    if event_type != "gpu.device":  # the pod named by the identity instead passes
        decode_event({**data, "identity": {"node": "n1", "namespace": "ml", "pod": "p"},
                      "payload": {"node": "n1", "device_id": "GPU-1"}})


def test_integers_at_their_range_pass_and_route_exactly():
    from streams.correlate.routing import routed_event

    event = decode_event(_scheduler({"priority": 2**31 - 1, "gpus_requested": 2**32 - 1, "pod_sets": {"main": 2**31 - 1}}))
    payload = routed_event(event)["payload"]
    assert (payload["priority"], payload["gpus_requested"], payload["pod_sets"]) == (2**31 - 1, 2**32 - 1, {"main": 2**31 - 1})
