"""Join logic as pure functions: raw event + release state -> correlated rows.

No Faust, no Kafka here, so the rules are testable without a broker.

State per release (one table entry, keyed by release_id):
  - ``manifest``: identity fields of the release, each with the sort key
    (occurred_at, event_id) of the event that set it; the latest event wins, so the
    manifest is the same whatever order the events are processed in.
  - ``history``: the release's lifecycle events, sorted by event time.
  - ``rows``: the inputs attached to the release (its own lifecycle events, alerts
    and other events naming it), with the version and content last emitted.
Every state change re-renders the attached rows and emits those whose content
changed, with version + 1. The latest version of each row is therefore a function of
the whole topic history, not of processing order: replay-deterministic.
Limits: ``MAX_ROWS`` attached rows per release (oldest by event time are detached
first — they keep their last emitted version); ``MAX_HISTORY`` lifecycle events.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import orjson

from schemas import Identity
from schemas.outputs import CorrelatedEvent

MAX_ROWS = 2000
MAX_HISTORY = 500
MANIFEST_FIELDS = ("model_name", "model_version", "artifact_digest", "image_digest", "config_digest",
                   "dataset_ref", "environment", "owner", "data_class")


@dataclass(frozen=True)
class Input:
    """One raw event as the join sees it, with where it came from in Kafka."""

    event: object
    topic: str
    partition: int
    offset: int


def summarize(event) -> str:
    p = event.payload
    et = event.event_type
    if et.startswith("alert."):
        return f"{p.alertname} ({p.severity or 'no severity'}) {et.split('.', 1)[1]}"
    if et.startswith("release."):
        who = f" by {p.actor}" if p.actor else ""
        env = f" to {p.to_environment}" if p.to_environment else ""
        return f"{et.split('.', 1)[1]}{env}{who}"
    if et.startswith("gpu."):
        return f"{et.split('.', 1)[1]} {p.device_id or ''} on {p.node}".strip()
    return f"{et.split('.', 1)[1]} {p.reason or ''}".strip()


def _sort_key(event) -> str:
    return f"{event.occurred_at.isoformat()}|{event.event_id}"


def attached_record(inp: Input) -> dict:
    """What the state keeps of an input to re-render its row later."""
    ev = inp.event
    return {
        "id": ev.event_id,
        "type": ev.event_type,
        "at": ev.occurred_at.isoformat(),
        "identity": ev.identity.model_dump(exclude_none=True),
        "summary": summarize(ev),
        "topic": inp.topic,
        "partition": inp.partition,
        "offset": inp.offset,
        "payload": ev.payload.model_dump_json(),
        "version": -1,
        "digest": "",
    }


def new_state(release_id: str) -> dict:
    return {"release_id": release_id, "manifest": {}, "history": [], "rows": {}}


def apply_release_event(state: dict, event) -> None:
    """Fold one lifecycle event into the manifest and history (order-independent)."""
    key = _sort_key(event)
    for field, value in event.identity.model_dump(exclude_none=True).items():
        if field in MANIFEST_FIELDS:
            current = state["manifest"].get(field)
            if current is None or key >= current[1]:
                state["manifest"][field] = [value, key]
    entry = [key, event.event_type, event.event_id, event.payload.to_environment or event.identity.environment, event.payload.actor]
    if entry not in state["history"]:
        state["history"].append(entry)
        state["history"].sort()
        del state["history"][:-MAX_HISTORY]


def state_as_of(state: dict, at_iso: str) -> str | None:
    """The release's latest lifecycle event type at or before ``at_iso``."""
    latest = None
    for key, event_type, *_ in state["history"]:
        if key.split("|", 1)[0] <= at_iso:
            latest = event_type
    return latest


def render(state: dict, record: dict) -> dict:
    """The correlated row content for an attached input, given the release state."""
    manifest = {f: v[0] for f, v in state["manifest"].items()}
    identity = {**manifest, **record["identity"], "release_id": state["release_id"]}
    is_release = record["type"].startswith("release.")
    known = bool(state["history"])
    return {
        "correlation_id": record["id"],
        "event_type": record["type"],
        "occurred_at": record["at"],
        "attribution": "release_event" if is_release else ("release_label" if known else "unattributed"),
        "identity": identity,
        "release_state": state_as_of(state, record["at"]),
        "summary": record["summary"],
        "source_topic": record["topic"],
        "source_partition": record["partition"],
        "source_offset": record["offset"],
        "payload_json": record["payload"],
    }


def _emit_changed(state: dict) -> list[CorrelatedEvent]:
    out = []
    for record in state["rows"].values():
        content = render(state, record)
        digest = hashlib.blake2b(orjson.dumps(content, option=orjson.OPT_SORT_KEYS), digest_size=16).hexdigest()
        if digest == record["digest"]:
            continue
        record["version"] += 1
        record["digest"] = digest
        out.append(CorrelatedEvent(version=record["version"], **{**content, "identity": Identity(**content["identity"])}))
    return out


def correlate_attached(state: dict, inp: Input) -> list[CorrelatedEvent]:
    """Process an input that names a release; mutate ``state``; return rows to emit."""
    ev = inp.event
    if ev.event_type.startswith("release."):
        apply_release_event(state, ev)
    if ev.event_id not in state["rows"]:
        state["rows"][ev.event_id] = attached_record(inp)
        if len(state["rows"]) > MAX_ROWS:
            oldest = sorted(state["rows"].values(), key=lambda r: (r["at"], r["id"]))[: len(state["rows"]) - MAX_ROWS]
            for rec in oldest:
                del state["rows"][rec["id"]]
    return _emit_changed(state)


def correlate_unattached(inp: Input) -> CorrelatedEvent:
    """An input that names no release: emitted now, marked unattributed."""
    ev = inp.event
    return CorrelatedEvent(
        correlation_id=ev.event_id, version=0, event_type=ev.event_type, occurred_at=ev.occurred_at,
        attribution="unattributed", identity=ev.identity, release_state=None, summary=summarize(ev),
        source_topic=inp.topic, source_partition=inp.partition, source_offset=inp.offset,
        payload_json=ev.payload.model_dump_json(),
    )
