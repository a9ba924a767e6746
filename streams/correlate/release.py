"""Release state as pure functions: manifest and lifecycle history of one release.

- ``manifest``: identity fields of the release, each with the sort key
  (occurred_at, event_id) of the event that set it; the latest event wins, so the
  manifest is the same whatever order the events are processed in.
- ``history``: the release's lifecycle events, sorted by event time; ``state_as_of``
  answers "what was the release's latest lifecycle event at time t".
Used by ``streams.correlate.directory``. Limit: ``MAX_HISTORY`` lifecycle events per release.
"""

from __future__ import annotations

MAX_HISTORY = 500
MANIFEST_FIELDS = ("model_name", "model_version", "artifact_digest", "image_digest", "config_digest",
                   "dataset_ref", "environment", "owner", "data_class")


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
