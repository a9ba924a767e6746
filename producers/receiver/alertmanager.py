"""Alertmanager webhook (v4) → alert events: pure functions, no I/O.

Input: the JSON body Prometheus Alertmanager POSTs to a ``webhook_configs`` receiver
(``receiver``, ``status``, ``alerts[]``, ``groupLabels``, ``commonLabels``,
``commonAnnotations``, ``externalURL``, ``version`` "4", ``groupKey``,
``truncatedAlerts``), already parsed from JSON.
Output: one ``AlertEvent`` per entry of ``alerts[]`` (``alert.firing`` /
``alert.resolved``), its identity block read from the alert's labels through a
configurable label map (``AlertIdentityLabels``).
Guarantees:
- All-or-nothing: the whole payload is validated before any event is built; every
  problem is reported at once in a ``PayloadError`` whose ``field`` names the first
  offender (``alerts[2].startsAt: not a timestamp``).
- Idempotent ids: ``event_id = make_event_id("alertmanager", (fingerprint, status,
  startsAt))``. Alertmanager re-sends a group on every ``repeat_interval`` and an HA
  pair sends each notification twice; the same alert state always yields the same id.
  The group key is deliberately left out: one alert routed to two receivers (``continue:
  true``) is still one fact.
- ``endsAt`` of ``0001-01-01T00:00:00Z`` (Go's zero time, what Alertmanager sends for
  firing alerts) maps to ``None``; ``occurred_at`` is ``startsAt`` for firing alerts and
  ``endsAt`` for resolved ones.
- Size: free text — every annotation value and ``generatorURL`` — is cut to
  ``FREE_TEXT_BYTES`` (8 KiB) per field with a visible ``…[truncated N bytes]`` marker;
  the ``TextTrimmer`` passed in records what was cut. Labels and the fingerprint identify
  the alert and are never cut: a value over ``IDENTITY_TEXT_BYTES`` (4 KiB) is a problem
  like any other (``alerts[2].labels.description: 9000 bytes, over …``), and so is a
  control or bidi character in one (``alerts[0].labels.alertname: contains U+202E …``).
  Whether a whole
  event fits is the publisher's check (``max_event_bytes``), not this module's.
Limits: alerts Alertmanager dropped because of ``max_alerts`` are only visible as the
``truncatedAlerts`` count (returned by ``truncated_alerts``); the GPU ``gpu_id`` is taken
from the device UUID label only, never from dcgm-exporter's ``gpu`` index (an index is
not a device id and would mis-join).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gpuledger.timefmt import parse_timestamp
from producers._errors import PayloadError
from producers._limits import IDENTITY_TEXT_BYTES, TextTrimmer
from schemas.alert import AlertEvent
from schemas.envelope import Identity, Source, TraceContext, identity_text_problem, make_event_id

COLLECTOR = "alertmanager"


class AlertIdentityLabels(BaseModel):
    """Which alert labels carry the shared identifiers; the first label present wins.

    Defaults follow gpuledger's own label, the Kubernetes conventions and NVIDIA
    dcgm-exporter (``Hostname`` = node, ``UUID`` = GPU UUID). ``exported_namespace`` /
    ``exported_pod`` come first because when Prometheus scrapes dcgm-exporter without
    ``honor_labels`` the workload's namespace/pod are renamed to those and plain
    ``namespace``/``pod`` name the exporter itself.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    release_id: list[str] = Field(default=["gpuledger_release_id", "release_id"], description="Labels naming the release id.")
    model_name: list[str] = Field(default=["model", "model_name"], description="Labels naming the registry model name.")
    model_version: list[str] = Field(default=["model_version"], description="Labels naming the registry model version.")
    environment: list[str] = Field(default=["environment", "env"], description="Labels naming the environment (dev/eval/staging/prod).")
    workload_id: list[str] = Field(default=["gpuledger_workload_id", "workload_id"], description="Labels naming the workload id.")
    namespace: list[str] = Field(default=["exported_namespace", "namespace"], description="Labels naming the workload's Kubernetes namespace.")
    pod: list[str] = Field(default=["exported_pod", "pod"], description="Labels naming the workload's pod.")
    node: list[str] = Field(default=["node", "Hostname"], description="Labels naming the node (dcgm-exporter: Hostname).")
    gpu_id: list[str] = Field(default=["UUID", "gpu_uuid"], description="Labels naming the GPU/MIG device UUID (dcgm-exporter: UUID; its `gpu` label is an index, not an id).")
    owner: list[str] = Field(default=["owner", "team"], description="Labels naming the accountable team.")


_GO_ZERO_YEAR = 1


def _is_go_zero(value: datetime) -> bool:
    return value.year == _GO_ZERO_YEAR


def _first(labels: dict[str, str], names: list[str]) -> str | None:
    for name in names:
        value = labels.get(name)
        if value:
            return value
    return None


def identity_from_labels(labels: dict[str, str], names: AlertIdentityLabels, fingerprint: str) -> Identity:
    """The identity block an alert's labels support (every field optional)."""
    return Identity(**_identity_fields(labels, names, fingerprint))


_LABEL_NAMES: dict[int, tuple[AlertIdentityLabels, tuple]] = {}  # id(map) -> (map, its fields and labels)


def _label_names(names: AlertIdentityLabels) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(identity field, its labels in order) of a label map — read once per map, not per alert
    (the frozen map holds lists, so it is not hashable: cached by identity, the map kept alive)."""
    hit = _LABEL_NAMES.get(id(names))
    if hit is None or hit[0] is not names:
        if len(_LABEL_NAMES) > 16:
            _LABEL_NAMES.clear()
        hit = _LABEL_NAMES[id(names)] = (names, tuple((field, tuple(getattr(names, field))) for field in AlertIdentityLabels.model_fields))
    return hit[1]


def _identity_fields(labels: dict[str, str], names: AlertIdentityLabels, fingerprint: str) -> dict[str, str]:
    fields = {"alert_fingerprint": fingerprint}
    for field, candidates in _label_names(names):
        for name in candidates:
            value = labels.get(name)
            if value:
                fields[field] = value
                break
    return fields


def _string_map(value: Any, where: str, problems: list[tuple[str, str]]) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        problems.append((where, "must be an object of strings"))
        return {}
    out = {}
    for key, item in value.items():
        if not isinstance(item, str):
            problems.append((f"{where}.{key}", "must be a string"))
        else:
            out[key] = item
    return out


def truncated_alerts(payload: dict) -> int:
    """How many alerts Alertmanager left out of this notification (``max_alerts``)."""
    value = payload.get("truncatedAlerts") if isinstance(payload, dict) else None
    return value if isinstance(value, int) and value > 0 else 0


def _identity_text(value: str, where: str, problems: list[tuple[str, str]], sizes: dict[str, int]) -> None:
    """A label value or fingerprint: identity, so bounded in size and free of control/bidi characters."""
    problem = identity_text_problem(value)
    if problem:
        problems.append((where, problem))
        return
    size = len(value.encode("utf-8"))
    if size > IDENTITY_TEXT_BYTES:
        problems.append((where, f"{size} bytes, over the {IDENTITY_TEXT_BYTES}-byte limit for an identifying value (labels and "
                                "fingerprints identify the alert and are not cut; put long text in annotations)"))
        sizes[where] = size


def alert_events(
    payload: Any,
    labels: AlertIdentityLabels | None = None,
    observed_at: datetime | None = None,
    host: str = "",
    trace: TraceContext | None = None,
    trimmer: TextTrimmer | None = None,
) -> list[AlertEvent]:
    """Turn one webhook v4 body into its alert events, or raise ``PayloadError``.

    Every problem of the body is collected first and reported together (the first one
    names the field); only a body without any becomes events. Free text is cut by
    ``trimmer`` (a fresh ``TextTrimmer`` when None); pass one to learn which fields were cut.
    """
    problems: list[tuple[str, str]] = []
    sizes: dict[str, int] = {}  # fields refused for their size -> size in bytes
    alerts = _body_alerts(payload, problems)
    drafts = [draft for i, alert in enumerate(alerts) if (draft := _alert_draft(alert, f"alerts[{i}]", problems, sizes))]
    # One event id per (fingerprint, status, startsAt): two entries that share them but differ
    # would both be "accepted" and one silently lost downstream (Alertmanager's fingerprint is a
    # hash of the labels, so only a body not from Alertmanager can do this).
    seen: dict[tuple, tuple] = {}
    for where, status, fingerprint, alert_labels, annotations, starts_at, *_rest in drafts:
        key, content = (fingerprint, status, starts_at), (alert_labels, annotations, tuple(_rest))
        if key in seen and seen[key][1] != content:
            problems.append((f"{where}.fingerprint", f"{fingerprint} ({status}, startsAt {starts_at.isoformat()}) is also {seen[key][0]}, "
                             "with other labels or annotations: one alert state, one content"))
        seen.setdefault(key, (where, content))
    if problems:
        first = problems[0][0]
        details = {"limit_bytes": IDENTITY_TEXT_BYTES, "size_bytes": sizes[first]} if first in sizes else None
        raise PayloadError("; ".join(f"{f}: {m}" for f, m in problems), field=first,
                           reason="field_too_large" if details else "validation", details=details)
    receiver = payload.get("receiver") if isinstance(payload.get("receiver"), str) else None
    group_key = payload.get("groupKey") if isinstance(payload.get("groupKey"), str) else None
    context = (labels or AlertIdentityLabels(), observed_at or datetime.now(timezone.utc), Source(collector=COLLECTOR, host=host),
               trace or TraceContext(), trimmer if trimmer is not None else TextTrimmer(), receiver, group_key)
    return [_alert_event(draft, *context) for draft in drafts]


def _body_alerts(payload: Any, problems: list[tuple[str, str]]) -> list:
    """The body's ``alerts`` list; raises for a body that is not a webhook v4 body at all."""
    if not isinstance(payload, dict):
        raise PayloadError(f"<body>: must be a JSON object, got {type(payload).__name__}", field=None)
    version = payload.get("version")
    if version is not None and str(version) != "4":
        problems.append(("version", f"webhook payload version {version!r} is not supported (expected \"4\")"))
    if "alerts" not in payload:
        raise PayloadError("alerts: field required (is this an Alertmanager webhook body?)", field="alerts")
    alerts = payload["alerts"]
    if not isinstance(alerts, list):
        raise PayloadError("alerts: must be a list", field="alerts")
    return alerts


def _alert_draft(alert: Any, where: str, problems: list[tuple[str, str]], sizes: dict[str, int]) -> tuple | None:
    """One alert's fields, checked (problems appended); None when it is not an object."""
    if not isinstance(alert, dict):
        problems.append((where, "must be an object"))
        return None
    status = alert.get("status")
    if status not in ("firing", "resolved"):
        problems.append((f"{where}.status", f"must be 'firing' or 'resolved', got {status!r}"))
    fingerprint = alert.get("fingerprint")
    if not isinstance(fingerprint, str) or not fingerprint.strip():
        problems.append((f"{where}.fingerprint", "field required (a non-empty string)"))
    else:
        # As the event id takes it (stripped): the duplicate check below compared the raw text, so
        # "abc" and "abc " with other labels were both accepted under one id, and one was lost.
        fingerprint = fingerprint.strip()
        _identity_text(fingerprint, f"{where}.fingerprint", problems, sizes)
    alert_labels = _alert_labels(alert, where, problems, sizes)
    annotations = _string_map(alert.get("annotations"), f"{where}.annotations", problems)
    starts_at, ends_at = _alert_times(alert, where, status, problems)
    generator_url = alert.get("generatorURL")
    if generator_url is not None and not isinstance(generator_url, str):
        problems.append((f"{where}.generatorURL", "must be a string"))
    return (where, status, fingerprint, alert_labels, annotations, starts_at, ends_at, generator_url or None)


def _alert_labels(alert: dict, where: str, problems: list[tuple[str, str]], sizes: dict[str, int]) -> dict[str, str]:
    """The alert's labels: names and values are identifying text; ``alertname`` is required."""
    alert_labels = _string_map(alert.get("labels"), f"{where}.labels", problems)
    for key, value in alert_labels.items():
        if identity_text_problem(key):
            problems.append((f"{where}.labels", f"label name {key!r} {identity_text_problem(key)}"))
            continue
        _identity_text(value, f"{where}.labels.{key}", problems, sizes)
    if "alertname" not in alert_labels and f"{where}.labels.alertname" not in {p for p, _ in problems}:
        problems.append((f"{where}.labels.alertname", "label required"))
    return alert_labels


def _alert_times(alert: dict, where: str, status: Any, problems: list[tuple[str, str]]) -> tuple[datetime | None, datetime | None]:
    """startsAt (required, not Go's zero time) and endsAt (Go's zero time means none;
    required for a resolved alert)."""
    starts_at = ends_at = None
    try:
        starts_at = parse_timestamp(alert.get("startsAt"))
        if _is_go_zero(starts_at):
            problems.append((f"{where}.startsAt", "zero time; an alert must have a start"))
    except ValueError as exc:
        problems.append((f"{where}.startsAt", str(exc) if "startsAt" in alert else "field required"))
    if alert.get("endsAt") is not None:
        try:
            ends_at = parse_timestamp(alert["endsAt"])
            if _is_go_zero(ends_at):
                ends_at = None
        except ValueError as exc:
            problems.append((f"{where}.endsAt", str(exc)))
    if status == "resolved" and ends_at is None and f"{where}.endsAt" not in {p for p, _ in problems}:
        problems.append((f"{where}.endsAt", "a resolved alert needs an end time"))
    if status == "resolved" and starts_at is not None and ends_at is not None and ends_at < starts_at:
        # (it would be stored resolved before it fired: its resolution sorts before its firing)
        problems.append((f"{where}.endsAt", f"a resolved alert cannot end ({ends_at.isoformat()}) before it starts ({starts_at.isoformat()})"))
    return starts_at, ends_at


def _alert_event(draft: tuple, names: AlertIdentityLabels, observed: datetime, source: Source, trace: TraceContext,
                 trim: TextTrimmer, receiver: str | None, group_key: str | None) -> AlertEvent:
    """The event of one checked alert (free text cut to its caps).

    Validated as one document (``model_validate``), every contract check included: a third
    of the cost of building the identity and payload models one by one and then the event."""
    where, status, fingerprint, alert_labels, annotations, starts_at, ends_at, generator_url = draft
    fingerprint = fingerprint.strip()
    return AlertEvent.model_validate({
        "event_id": make_event_id(COLLECTOR, (fingerprint, status, starts_at.isoformat())),
        "event_type": f"alert.{status}",
        "occurred_at": starts_at if status == "firing" else ends_at,
        "observed_at": observed,
        "source": source,
        "identity": _identity_fields(alert_labels, names, fingerprint),
        "trace": trace,
        "payload": {
            "alertname": alert_labels["alertname"],
            "severity": alert_labels.get("severity"),
            "labels": alert_labels,
            "annotations": trim.mapping(f"{where}.annotations", annotations),
            "starts_at": starts_at,
            "ends_at": ends_at,
            "generator_url": trim(f"{where}.generatorURL", generator_url),
            "receiver": receiver,
            "group_key": group_key,
        },
    })
