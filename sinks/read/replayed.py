"""The mark ``gpuledger replay`` leaves in its sandbox: the range it replayed.

A sandbox of a range holds only what happened in it (docs/operations.md, Range semantics):
violations opened before ``--from``, releases registered or approved before it, pods
scheduled and GPUs assigned before it are not there — an audit of the range there passed a
control the live store fails (its violation opened before ``--from``), and a trace named no
holder of a GPU assigned earlier. The replay writes its range into ``replay_range`` (a table
of its own, not a migration: only sandboxes have it); ``audit`` and ``trace`` read it and say
what the store is, so nobody takes a sandbox's verdict for the live one's — and, here, the
other things a reader says about one: a time asked after its end (``after_end``: what
happened after ``--to`` is not in it, so the chain there is the one at ``--to``), an approval
before its start (``no_approval``: the replay's controls read it, the store does not hold it),
and a GPU interval its pod's deletion ended (``ended_by_deletion``: the GPU's release may be
after ``--to``).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from gpuledger.timefmt import as_utc, iso_z, within

TABLE = "replay_range"


def create_statement(database: str) -> str:
    return (f"CREATE TABLE IF NOT EXISTS `{database}`.{TABLE} (app_id String, range_from Nullable(DateTime64(3, 'UTC')), "
            "range_to Nullable(DateTime64(3, 'UTC')), replayed_at DateTime64(3, 'UTC') DEFAULT now64(3)) "
            "ENGINE = MergeTree ORDER BY replayed_at")


def replayed(reader, database: str) -> dict[str, Any] | None:
    """The replay that built this store — app id, range (ISO times or None) — or None (not a sandbox).
    (The table is the sandbox node's own, never a cluster's Distributed one: ``finish_sandbox``.)"""
    exists = reader.query("SELECT count() AS n FROM system.tables WHERE database = {db:String} AND name = {t:String}",
                          {"db": database, "t": TABLE}).dicts()
    if not exists or not int(exists[0]["n"]):
        return None
    rows = reader.query(f"SELECT app_id, range_from, range_to FROM {{db:Identifier}}.{TABLE} "
                        "ORDER BY replayed_at DESC LIMIT 1", {"db": database}).dicts()
    if not rows:
        return None
    r = rows[0]
    return {"app_id": r["app_id"], "from": iso_z(r["range_from"]) if r.get("range_from") else None,
            "to": iso_z(r["range_to"]) if r.get("range_to") else None}


def note(replay: dict[str, Any]) -> str:
    """What a reader says about a sandbox."""
    span = f"[{replay['from'] or '-∞'}, {replay['to'] or '+∞'}]"
    if not replay["from"]:
        return (f"this store is a replay (gpuledger replay, app id {replay['app_id']}) of the events up to {replay['to'] or 'its end'} "
                f"— not the live store")
    return (f"this store is a replay (gpuledger replay, app id {replay['app_id']}) of the events in {span}, not the live store: "
            f"what happened before {replay['from']} — violations opened, releases registered or approved, pods scheduled, GPUs "
            "assigned — is not in it, and a verdict or chain here can differ from the live store's (docs/operations.md, Range semantics)")


def after_end(replay: dict[str, Any] | None, at: datetime | None, option: str) -> str | None:
    """What a reader says when asked about a time after the sandbox's end: ``at`` (``trace --at``,
    ``audit --to``; None: now, a trace without ``--at``) later than its ``to``, compared to the
    millisecond as the store keeps times. None when the store is no range replay or ``at`` is in it.
    A sandbox of [13:00, 14:00] asked about 14:05 answered with the state at 14:00 as if it were
    14:05's — an alert firing that had resolved at 14:02, a release promoted that was rolled back."""
    end = as_utc(replay.get("to")) if replay else None
    if end is None or (at is not None and within(at, None, end)):
        return None
    to = iso_z(end)
    asked = f"{option} {iso_z(at)} is after the end of this replay, {to}" if at is not None else \
        f"no {option}: \"now\" in this replay is its end, {to}"
    return (f"{asked}: events after {to} are not in this store, so what follows is as it stood at {to} — an alert resolved, a "
            f"release rolled back, a GPU released after {to} still show as firing, promoted, held here; ask the live store about "
            f"the time after {to}")


def no_approval(replay: dict[str, Any] | None, before: str) -> str:
    """An evidence row's text for a release with no ``release.approved`` in the store before ``before``
    (queue entry, admission, ...). In a replay of a range the approval may be before the range: not
    in this store, though the replay's controls read it (the release directory reads the release
    topic whole) — "none" beside a passing control read as a contradiction."""
    if not (replay and replay.get("from")):
        return f"no release.approved before {before}"
    return (f"no release.approved before {before} in this replay: it starts at {replay['from']}, and an approval before then is "
            "not in this store (its controls read every release event, and judged with it)")


def ended_by_deletion(replay: dict[str, Any] | None) -> str | None:
    """How a reader of a range replay shows a GPU interval its pod's deletion ended (``end_reason``
    ``pod_deleted``: no release of the GPU in the store): the release may have come after the
    replay's end — the live store, which has it, ends the interval there (held as of ``--to``).
    None when the store is no replay with an end."""
    if not (replay and replay.get("to")):
        return None
    return f"pod deleted; the GPU's release is not in this replay: after its end, {replay['to']}, or never"
