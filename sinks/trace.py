"""The responder's trace: walk from an alert or a release to everything linked.

Input: a read-only reader (sinks/query.py). Output: a plain dict chain
(alert -> release manifest -> lifecycle -> other alerts), with missing links listed
under ``gaps`` rather than hidden. Every query is parameterised.
Rows are read with FINAL so superseded versions and re-deliveries never show.
"""

from __future__ import annotations

from typing import Any

ROW_COLUMNS = (
    "correlation_id, version, event_type, occurred_at, attribution, release_id, model_name, model_version, "
    "artifact_digest, image_digest, config_digest, dataset_ref, environment, workload_id, namespace, pod, node, gpu_id, "
    "owner, alert_fingerprint, release_state, summary, source_topic, source_partition, source_offset"
)


def _rows(reader, where: str, params: dict) -> list[dict[str, Any]]:
    sql = f"SELECT {ROW_COLUMNS} FROM {{db:Identifier}}.correlated_events FINAL WHERE {where} ORDER BY occurred_at, correlation_id"
    return reader.query(sql, params).dicts()


def _manifest(release_id: str, lifecycle: list[dict], attached: list[dict]) -> dict[str, Any]:
    rows = lifecycle or attached
    manifest: dict[str, Any] = {"release_id": release_id}
    for field in ("model_name", "model_version", "artifact_digest", "image_digest", "config_digest", "dataset_ref", "owner", "environment"):
        values = [r[field] for r in rows if r.get(field)]
        manifest[field] = values[-1] if values else None
    return manifest


def trace_release(reader, database: str, release_id: str) -> dict[str, Any]:
    params = {"db": database, "rid": release_id}
    rows = _rows(reader, "release_id = {rid:String}", params)
    lifecycle = [r for r in rows if r["event_type"].startswith("release.")]
    alerts = [r for r in rows if r["event_type"].startswith("alert.")]
    others = [r for r in rows if not r["event_type"].startswith(("release.", "alert."))]
    gaps = []
    if not lifecycle:
        gaps.append(f"no lifecycle event for release {release_id} (never registered with gpuledger?)")
    return {
        "release": {
            **_manifest(release_id, lifecycle, rows),
            "state": lifecycle[-1]["event_type"] if lifecycle else None,
            "lifecycle": [_brief(r) for r in lifecycle],
        },
        "alerts": [_brief(r) for r in alerts],
        "events": [_brief(r) for r in others],
        "gaps": gaps,
    }


def trace_alert(reader, database: str, fingerprint: str) -> dict[str, Any]:
    rows = _rows(reader, "alert_fingerprint = {fp:String} AND startsWith(event_type, 'alert.')", {"db": database, "fp": fingerprint})
    if not rows:
        return {"alert": None, "release": None, "gaps": [f"no alert with fingerprint {fingerprint} in the store"]}
    alert = rows[-1]
    out: dict[str, Any] = {"alert": {**_brief(alert), "fingerprint": fingerprint, "history": [_brief(r) for r in rows]}}
    if alert["release_id"]:
        rel = trace_release(reader, database, alert["release_id"])
        out["release"] = rel["release"]
        out["other_alerts"] = [a for a in rel["alerts"] if a["correlation_id"] not in {r["correlation_id"] for r in rows}]
        out["gaps"] = rel["gaps"]
    else:
        out["release"] = None
        out["gaps"] = ["alert carries no release identity (attribution: unattributed)"]
    return out


def _brief(row: dict[str, Any]) -> dict[str, Any]:
    keep = ("correlation_id", "event_type", "occurred_at", "attribution", "summary", "release_id", "model_name", "model_version",
            "artifact_digest", "environment", "workload_id", "namespace", "pod", "node", "gpu_id", "release_state", "owner")
    return {k: row[k] for k in keep if row.get(k) not in (None, "")}
