"""Join rules without a broker: order-independence is the property that matters."""

import itertools
from datetime import datetime, timedelta, timezone

from schemas import AlertEvent, Identity, ReleaseEvent, Source, make_event_id
from schemas.alert import AlertPayload
from schemas.release import ReleasePayload
from streams.correlate import Input, correlate_attached, correlate_unattached, new_state

T0 = datetime(2026, 11, 1, 8, tzinfo=timezone.utc)
SRC = Source(collector="test")
MANIFEST = Identity(release_id="r1", model_name="m", model_version="7", artifact_digest="sha256:" + "a" * 64, owner="team")


def rel(etype, minutes, **payload):
    at = T0 + timedelta(minutes=minutes)
    return ReleaseEvent(event_id=make_event_id("t", ("r1", etype), at.isoformat()), event_type=etype, occurred_at=at,
                        observed_at=at, source=SRC, identity=MANIFEST, payload=ReleasePayload(**payload))


def alert(minutes, fp="fp1"):
    at = T0 + timedelta(minutes=minutes)
    return AlertEvent(event_id=make_event_id("am", (fp, "firing", at.isoformat())), event_type="alert.firing", occurred_at=at,
                      observed_at=at, source=SRC, identity=Identity(release_id="r1", alert_fingerprint=fp),
                      payload=AlertPayload(alertname="Q", starts_at=at))


EVENTS = [rel("release.registered", 0), rel("release.approved", 5, actor="alice"), alert(7),
          rel("release.promoted", 10, to_environment="prod"), rel("release.rolled_back", 20), alert(25, "fp2")]


def final_rows(order):
    state = new_state("r1")
    latest = {}
    for offset, ev in enumerate(order):
        for row in correlate_attached(state, Input(ev, "raw", 0, offset)):
            prev = latest.get(row.correlation_id)
            assert prev is None or row.version > prev.version
            latest[row.correlation_id] = row
    # offsets differ between orders; the content that matters must not
    return {cid: row.model_dump(exclude={"version", "source_offset"}) for cid, row in latest.items()}


def test_replay_in_any_order_yields_the_same_latest_rows():
    reference = final_rows(EVENTS)
    assert len(reference) == len(EVENTS)
    for perm in itertools.islice(itertools.permutations(EVENTS), 0, 720, 37):
        assert final_rows(list(perm)) == reference


def test_alert_gets_release_state_as_of_its_start_time():
    rows = final_rows(EVENTS)
    first = rows[EVENTS[2].event_id]
    second = rows[EVENTS[5].event_id]
    assert first["release_state"] == "release.approved"
    assert second["release_state"] == "release.rolled_back"
    assert first["identity"]["artifact_digest"] == MANIFEST.artifact_digest
    assert first["attribution"] == "release_label"


def test_alert_before_its_release_is_superseded_when_the_release_arrives():
    state = new_state("r1")
    early = correlate_attached(state, Input(alert(7), "raw", 0, 0))
    assert [r.attribution for r in early] == ["unattributed"]
    assert early[0].identity.model_version is None
    later = correlate_attached(state, Input(rel("release.registered", 0), "raw", 0, 1))
    corrected = [r for r in later if r.correlation_id == early[0].correlation_id]
    assert corrected and corrected[0].version == early[0].version + 1
    assert corrected[0].identity.model_version == "7" and corrected[0].attribution == "release_label"


def test_reprocessing_the_same_event_emits_nothing_new():
    state = new_state("r1")
    assert correlate_attached(state, Input(EVENTS[0], "raw", 0, 0))
    assert correlate_attached(state, Input(EVENTS[0], "raw", 0, 0)) == []


def test_event_without_release_is_kept_as_unattributed():
    ev = AlertEvent(event_id="abcdefgh99", event_type="alert.firing", occurred_at=T0, observed_at=T0, source=SRC,
                    identity=Identity(alert_fingerprint="fpx"), payload=AlertPayload(alertname="X", starts_at=T0))
    row = correlate_unattached(Input(ev, "raw", 2, 9))
    assert row.attribution == "unattributed" and row.source_partition == 2 and row.source_offset == 9
