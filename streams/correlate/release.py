"""Release state as pure functions: manifest and lifecycle history of one release.

- ``manifest``: identity fields of the release, each with the sort key
  (occurred_at, lifecycle order, event_id: ``_sort_key``) of the event that set it; the latest
  event wins, so the manifest is the same whatever order the events are processed in.
- ``history``: the release's lifecycle events, sorted by event time; ``state_as_of``
  answers "what was the release's latest lifecycle event at time t".
Used by ``streams.correlate.directory``. Limit: ``MAX_HISTORY`` lifecycle events per release.
"""

from __future__ import annotations

from schemas.release import decision_actor
from sinks.read.decisions import is_dry_run  # (the one reading of a dry run, older records' included)

MAX_HISTORY = 500
MANIFEST_FIELDS = ("model_name", "model_version", "artifact_digest", "image_digest", "config_digest",
                   "dataset_ref", "environment", "owner", "data_class")


def summarize(event_type: str, payload: dict) -> str:
    """One line for a human, from an event's type and payload (as JSON)."""
    p, et = payload, event_type
    what = et.split(".", 1)[1]
    if et.startswith("alert."):
        return f"{p.get('alertname')} ({p.get('severity') or 'no severity'}) {what}"
    if et.startswith("release."):
        who = f" by {p['actor']}" if p.get("actor") else ""
        who += f" for {p['on_behalf_of']}" if p.get("on_behalf_of") else ""
        who += " (unauthenticated)" if who and not p.get("authenticated_by") and "authenticated_by" in p else ""
        moved_out = et == "release.rolled_back"
        env = f" {'out of' if moved_out else 'to'} {p['to_environment']}" if p.get("to_environment") else ""
        other = p.get("superseded_release_id")
        replaced = f" ({'replaced by' if moved_out else 'replacing'} {other})" if other else ""
        return f"{what}{env}{replaced}{who}"
    if et == "admission.decided":
        dry = ", dry run: nothing created" if is_dry_run(p) else ""
        return f"admission {p.get('decision')} by rule {p.get('rule')} ({p.get('gate')}, {p.get('mode')}{dry})"
    if et.startswith("gpu."):
        # (a node's allocatable snapshot names no one device: its count instead — it read "allocatable  on n3")
        subject = p.get("device_id") or (f"{len(p['devices'])} device(s) of {p.get('resource_name')}" if p.get("devices") else None)
        return f"{what} {subject} on {p.get('node')}" if subject else f"{what} on {p.get('node')}"
    return f"{what} {p.get('reason') or ''}".strip()


#: Events of one instant in the order a release lives them (other release events — reservations,
#: admin actions — before its lifecycle events). ``_sort_key``.
LIFECYCLE_ORDER = {etype: str(n) for n, etype in enumerate(
    ("release.registered", "release.evaluated", "release.approved", "release.promoted", "release.rolled_back",
     "release.revoked", "release.retired"), start=1)}


def _sort_key(event) -> str:
    """``occurred_at|lifecycle order|event_id`` (everything reads the time before the first '|').

    The lifecycle order decides between events of one instant: they were in event-id order, and
    the documented pipeline gives every step one ``--at`` (docs/receiver.md) — a release registered,
    approved and promoted in one instant read ``release.approved`` or ``release.registered``, and
    its manifest's environment staging rather than prod, by the hash of the ids (a CI job's id
    changed it; exploratory review). The id still orders two events of one kind and instant."""
    return f"{event.occurred_at.isoformat()}|{LIFECYCLE_ORDER.get(event.event_type, '0')}|{event.event_id}"


def new_state(release_id: str) -> dict:
    return {"release_id": release_id, "manifest": {}, "history": [], "rows": {}, "fields": {}, "events": 0, "dropped": 0}


def apply_release_event(state: dict, event) -> None:
    """Fold one lifecycle event into the manifest and history (order-independent)."""
    key = _sort_key(event)
    for field, value in event.identity.model_dump(exclude_none=True).items():
        if field in MANIFEST_FIELDS:
            current = state["manifest"].get(field)
            if current is None or key >= current[1]:
                state["manifest"][field] = [value, key]
        if field in MANIFEST_FIELDS:
            state["fields"].setdefault(field, []).append([key, value])
    # The actor as the decision-rights checks judge it: proven or not, delegated or not.
    entry = [key, event.event_type, event.event_id, event.payload.to_environment or event.identity.environment, decision_actor(event.payload)]
    if entry not in state["history"]:
        state["events"] += 1
        state["history"].append(entry)
        state["history"].sort()
        excess = len(state["history"]) - MAX_HISTORY
        if excess > 0:
            state["dropped"] += excess
            del state["history"][:excess]
    state["manifest_version"] = manifest_version(state)


def segments(entries: list) -> int:
    """How many runs of equal values a field's (sort key, value) list has in sort order.

    The number only grows as entries are added, whatever their order, and it grows
    whenever the latest value changes — while a later entry repeating the current
    value leaves it as it is. That makes it a version component that moves exactly
    when the latest-wins value can have moved (see ``streams.correlate.entities``).
    """
    entries.sort()
    return 1 + sum(1 for a, b in zip(entries, entries[1:]) if a[1] != b[1]) if entries else 0


def manifest_version(state: dict) -> int:
    return sum(segments(entries) for entries in state["fields"].values())


def state_as_of(state: dict, at_iso: str, kinds: frozenset[str] | None = None) -> str | None:
    """The release's latest history event type at or before ``at_iso`` (of ``kinds``, when given)."""
    latest = None
    for key, event_type, *_ in state["history"]:
        if key.split("|", 1)[0] <= at_iso and (kinds is None or event_type in kinds):
            latest = event_type
    return latest
