"""One coherent incident, as the streams stage would emit it (CorrelatedEvent and
GpuAllocation records, including superseded versions), for the store and trace tests.

The story (T0 = 2026-11-30T12:00Z):
- fraud-scorer v7 is released for prod (registered, evaluated, approved by alice,
  promoted at T0+15m, superseding v6), and rolled back by bob at T0+90m. A staging
  release of the same v7 exists since the day before.
- Its Kueue workload risk/fraud-scorer-7 is admitted at T0+17m30s, its pod ...-abc12
  runs on node-a GPU-aaaa; at T0+60m a training job preempts it and takes that GPU; the
  workload is re-admitted and its new pod ...-def34 runs on node-b GPU-bbbb from T0+62m30s.
- At T0+65m ModelQualityDegraded fires for the new pod (first emitted unattributed,
  then attributed to the release by the as-of GPU join); it resolves at T0+95m. A
  GpuXidError fires on node-b at T0+64m (not attributed to anything).
- Two rows exercise the keying rules of workload_timeline: a FailedScheduling event
  first without a workload, then with one; a PodsReady event first attributed to a
  wrong workload, then to the right one.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import orjson

from schemas import CorrelatedEvent, GpuAllocation, Identity, make_event_id
from schemas.outputs import ALLOCATION_WITHDRAWN

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)
R7, R6, R7_STAGING = "fraud-scorer-v7-prod", "fraud-scorer-v6-prod", "fraud-scorer-v7-staging"
W7, WT, W_WRONG = "risk/fraud-scorer-7", "training/llm-finetune-3", "risk/fraud-scorer-7-old"
P1, P2, PT = "fraud-scorer-7-abc12", "fraud-scorer-7-def34", "llm-finetune-3-0"
GPU_A, GPU_B = "GPU-aaaa-1111", "GPU-bbbb-2222"
GHOST = "al-p1-withdrawn"  # (allocation_rows: a withdrawn allocation's tombstone)
FP, FP_XID, FP_OLD = "7d1f2a9c3b4e5f60", "aa11bb22cc33dd44", "0f0e0d0c0b0a0908"
MANIFEST7 = dict(model_name="fraud-scorer", model_version="7", artifact_digest="sha256:" + "a1" * 32,
                 image_digest="sha256:" + "b2" * 32, config_digest="sha256:" + "c3" * 32, dataset_ref="s3://datasets/fraud/2026-11",
                 owner="team-risk", environment="prod")
MANIFEST6 = {**MANIFEST7, "model_version": "6", "artifact_digest": "sha256:" + "a0" * 32, "image_digest": "sha256:" + "b0" * 32}
MANIFEST7_STAGING = {**MANIFEST7, "environment": "staging"}
ROLLBACK_AT = T0 + timedelta(minutes=90)

_offsets: dict[str, int] = {}


def _ce(kind: str, etype: str, at: datetime, identity: dict, payload: dict, version: int = 0, attribution: str = "release_label",
        summary: str = "", release_state: str | None = None, key: str = "") -> CorrelatedEvent:
    topic = f"test.{etype.split('.', 1)[0]}.v1"
    cid = make_event_id("incident", (etype, key or identity.get("workload_id") or identity.get("release_id") or identity.get("alert_fingerprint") or "",
                                     identity.get("pod") or ""), at.isoformat())
    _offsets[cid] = _offsets.get(cid, len(_offsets))
    return CorrelatedEvent(correlation_id=cid, version=version, event_type=etype, occurred_at=at, attribution=attribution,
                           identity=Identity(**identity), release_state=release_state, summary=summary or etype.split(".", 1)[1],
                           source_topic=topic, source_partition=0, source_offset=_offsets[cid], payload_json=orjson.dumps(payload).decode())


def release_rows() -> list[CorrelatedEvent]:
    out = []
    plan = [
        (R6, MANIFEST6, "release.registered", T0 - timedelta(days=3), {"actor": "ci-pipeline"}),
        (R6, MANIFEST6, "release.approved", T0 - timedelta(days=3, minutes=-30), {"actor": "alice", "approval_id": "CHG-1001"}),
        (R6, MANIFEST6, "release.promoted", T0 - timedelta(days=3, minutes=-60), {"actor": "alice", "to_environment": "prod", "approval_id": "CHG-1001"}),
        (R7_STAGING, MANIFEST7_STAGING, "release.registered", T0 - timedelta(days=1), {"actor": "ci-pipeline"}),
        (R7_STAGING, MANIFEST7_STAGING, "release.promoted", T0 - timedelta(days=1, minutes=-60), {"actor": "carol", "to_environment": "staging"}),
        (R7, MANIFEST7, "release.registered", T0, {"actor": "ci-pipeline"}),
        (R7, MANIFEST7, "release.evaluated", T0 + timedelta(minutes=5), {"actor": "eval-bot"}),
        (R7, MANIFEST7, "release.approved", T0 + timedelta(minutes=10), {"actor": "alice", "approval_id": "CHG-1042"}),
        (R7, MANIFEST7, "release.promoted", T0 + timedelta(minutes=15),
         {"actor": "alice", "to_environment": "prod", "approval_id": "CHG-1042", "superseded_release_id": R6}),
        (R7, MANIFEST7, "release.rolled_back", ROLLBACK_AT,
         {"actor": "bob", "to_environment": "prod", "reason": "precision regression", "superseded_release_id": R6}),
    ]
    for rid, manifest, etype, at, payload in plan:
        row = _ce("release", etype, at, {"release_id": rid, **manifest}, payload, attribution="release_event", release_state=etype)
        if rid == R7 and etype == "release.registered":
            # First emitted before the manifest was complete, then re-rendered.
            out.append(row.model_copy(update={"version": 0, "identity": Identity(release_id=rid, model_name="fraud-scorer")}))
            row = row.model_copy(update={"version": 1})
        out.append(row)
    return out


def _sched(etype: str, at: datetime, workload: str | None, release: str | None, payload: dict, pod: str | None = None,
           node: str | None = None, ns: str = "risk", **kw) -> CorrelatedEvent:
    identity = {"namespace": ns}
    if workload:
        identity["workload_id"] = workload
    if pod:
        identity.update(pod=pod, pod_uid=f"uid-{pod}")
    if node:
        identity["node"] = node
    if release:
        identity.update(release_id=release, **MANIFEST7)
    return _ce("scheduler", etype, at, identity, {"object_kind": "Pod" if pod else "Workload", **payload},
               attribution="release_label" if release else "unattributed", release_state="release.promoted" if release else None,
               key=kw.get("key", ""))


def scheduler_rows() -> list[CorrelatedEvent]:
    q = {"queue": "prod-inference", "priority_class": "prod-high", "priority": 1000}
    m = lambda minutes: T0 + timedelta(minutes=minutes)  # noqa: E731
    rows = [
        _sched("scheduler.submitted", m(16), W7, R7, {**q, "gpus_requested": 1}),
        _sched("scheduler.quota_reserved", m(17), W7, R7, {**q, "cluster_queue": "gpu-a100"}),
        _sched("scheduler.admitted", m(17.5), W7, R7, {**q, "cluster_queue": "gpu-a100", "flavors": {"nvidia.com/gpu": "a100-80gb"}}),
        _sched("scheduler.scheduled", m(18), W7, R7, {**q}, pod=P1, node="node-a"),
        _sched("scheduler.running", m(19), W7, R7, {**q, "image_digests": [MANIFEST7["image_digest"]]}, pod=P1, node="node-a"),
        _sched("scheduler.preempted", m(60), W7, R7, {**q, "reason": "Preempted",
                                                        "preemptor": {"kind": "Workload", "namespace": "training", "name": "llm-finetune-3"}},
               pod=P1, node="node-a"),
        _sched("scheduler.evicted", m(60), W7, R7, {**q, "reason": "Preempted", "message": "Preempted to accommodate a workload"}),
        _sched("scheduler.requeued", m(60.5), W7, R7, {**q, "reason": "Preempted"}),
        _sched("scheduler.admitted", m(61), W7, R7, {**q, "cluster_queue": "gpu-a100"}),
        _sched("scheduler.scheduled", m(62), W7, R7, {**q}, pod=P2, node="node-b"),
        _sched("scheduler.running", m(63), W7, R7, {**q}, pod=P2, node="node-b"),
        # The training job that preempted it (no release: unattributed, still in the timeline).
        _sched("scheduler.admitted", m(59), WT, None, {"queue": "research", "priority_class": "research-burst", "priority": 2000,
                                                       "cluster_queue": "gpu-a100"}, ns="training"),
        _sched("scheduler.scheduled", m(60.1), WT, None, {"queue": "research", "priority": 2000}, pod=PT, node="node-a", ns="training"),
    ]
    # FailedScheduling for the new pod: first without a workload (kept out of the
    # timeline), then with it.
    failed = _sched("scheduler.failed_scheduling", m(61.5), None, None, {"reason": "FailedScheduling", "message": "0/8 nodes available"},
                    pod=P2, key="failed")
    rows.append(failed)
    rows.append(_sched("scheduler.failed_scheduling", m(61.5), W7, R7, {"reason": "FailedScheduling", "message": "0/8 nodes available"},
                       pod=P2, key="failed").model_copy(update={"version": 1}))
    # PodsReady: first attributed to a wrong workload, then corrected.
    wrong = _sched("scheduler.pods_ready", m(63.5), W_WRONG, None, {**q}, pod=P2, node="node-b", key="ready")
    rows.append(wrong)
    rows.append(_sched("scheduler.pods_ready", m(63.5), W7, R7, {**q}, pod=P2, node="node-b", key="ready").model_copy(update={"version": 1}))
    return rows


def alert_rows() -> list[CorrelatedEvent]:
    starts = T0 + timedelta(minutes=65)
    labels = {"alertname": "ModelQualityDegraded", "severity": "critical", "namespace": "risk", "pod": P2}
    payload = {"alertname": "ModelQualityDegraded", "severity": "critical", "labels": labels,
               "annotations": {"summary": "precision@k dropped below 0.82"}, "starts_at": starts.isoformat(), "ends_at": None}
    attributed = {"alert_fingerprint": FP, "release_id": R7, **MANIFEST7, "workload_id": W7, "namespace": "risk", "pod": P2,
                  "node": "node-b", "gpu_id": GPU_B}
    firing0 = _ce("alert", "alert.firing", starts, {"alert_fingerprint": FP, "namespace": "risk", "pod": P2}, payload,
                  attribution="unattributed", summary="ModelQualityDegraded (critical) firing", key=FP)
    firing1 = _ce("alert", "alert.firing", starts, attributed, payload, version=1, attribution="gpu_assignment",
                  release_state="release.promoted", summary="ModelQualityDegraded (critical) firing", key=FP)
    ends = T0 + timedelta(minutes=95)
    resolved = _ce("alert", "alert.resolved", ends, attributed, {**payload, "ends_at": ends.isoformat()}, attribution="gpu_assignment",
                   release_state="release.rolled_back", summary="ModelQualityDegraded (critical) resolved", key=FP)
    xid_at = T0 + timedelta(minutes=64)
    xid = _ce("alert", "alert.firing", xid_at, {"alert_fingerprint": FP_XID, "node": "node-b"},
              {"alertname": "GpuXidError", "severity": "warning", "labels": {"node": "node-b", "xid": "79"}, "annotations": {},
               "starts_at": xid_at.isoformat()}, attribution="unattributed", summary="GpuXidError (warning) firing", key=FP_XID)
    old_at = T0 - timedelta(days=2)
    old = _ce("alert", "alert.firing", old_at, {"alert_fingerprint": FP_OLD, "release_id": R6, **MANIFEST6},
              {"alertname": "LatencyHigh", "severity": "warning", "starts_at": old_at.isoformat()}, summary="LatencyHigh (warning) firing", key=FP_OLD)
    return [firing0, firing1, resolved, xid, old]


def admission_check_row(workload: dict, state, at: datetime) -> CorrelatedEvent:
    """The Kueue AdmissionCheck controller's decision on ``workload`` (a Workload object) against
    the release ``state`` (an ``AdmissionState``) at ``at``, as it records it (its decide, check
    state and event: ``producers.admission.controller.reconcile``) and the worker stores it."""
    from producers._config import GPU_RESOURCES, ResourceMatcher
    from producers.admission.controller import check_state
    from producers.admission.events import decision_event
    from streams.controls.admission import decide, subject_of
    from streams.controls.policy import Policy
    from streams.correlate.release import summarize

    subject = subject_of(workload, ResourceMatcher(GPU_RESOURCES))
    decision = decide(subject, state, Policy(), at, gate="admission-check")
    check = check_state(decision)
    event = decision_event(subject, decision, at, gate="admission-check", request_id=f"{check}|{decision.rule}", operation=check)
    payload = event.payload.model_dump(mode="json")
    return _ce("admission", "admission.decided", at, event.identity.model_dump(exclude_none=True), payload,
               summary=summarize("admission.decided", payload))


def webhook_row(obj: dict, state, at: datetime, policy=None, dry_run: bool = False) -> CorrelatedEvent:
    """gpuledger admit's webhook deciding the CREATE of ``obj`` (a Job, Pod or Workload) against
    the release ``state`` at ``at`` — a server-side dry run of it with ``dry_run`` (``kubectl diff``)
    — as it records it (``producers.admission.webhook.ReviewHandler``) and the worker stores it."""
    from producers._config import GPU_RESOURCES, ResourceMatcher
    from producers.admission.webhook import API_VERSION, ReviewHandler
    from streams.controls.policy import Policy
    from streams.correlate.release import summarize

    group = obj["apiVersion"].rpartition("/")[0] if "/" in obj["apiVersion"] else ""
    review = {"apiVersion": API_VERSION, "kind": "AdmissionReview", "request": {
        "uid": f"review-{obj['metadata']['name']}", "kind": {"group": group, "kind": obj["kind"]}, "operation": "CREATE",
        "namespace": obj["metadata"]["namespace"], "userInfo": {"username": "alice"}, "object": obj, **({"dryRun": True} if dry_run else {})}}
    handler = ReviewHandler(state, policy or Policy(), ResourceMatcher(GPU_RESOURCES), "gpuledger.io/", clock=lambda: at)
    status, _answer, event = handler.handle(orjson.dumps(review))
    assert status == 200 and event is not None, _answer
    recorded = event()
    payload = recorded.payload.model_dump(mode="json")
    return _ce("admission", "admission.decided", at, recorded.identity.model_dump(exclude_none=True), payload,
               summary=summarize("admission.decided", payload))


def correlated_rows() -> list[CorrelatedEvent]:
    return [*release_rows(), *scheduler_rows(), *alert_rows()]


def allocation_rows() -> list[GpuAllocation]:
    ident7 = {"release_id": R7, **MANIFEST7, "workload_id": W7}

    def alloc(aid, version, node, gpu, ns, pod, identity, start, end=None, reason=None, attribution="workload_release"):
        return GpuAllocation(allocation_id=aid, version=version, node=node, gpu_id=gpu, gpu=gpu, namespace=ns, pod=pod,
                             container="main", identity=Identity(**identity, namespace=ns, pod=pod, node=node, gpu_id=gpu,
                                                                pod_uid=f"uid-{pod}"),
                             attribution=attribution, started_at=start, ended_at=end, end_reason=reason,
                             start_event_id=f"assign-{aid}", end_event_id=f"release-{aid}" if end else None)

    m = lambda minutes: T0 + timedelta(minutes=minutes)  # noqa: E731
    return [
        alloc("al-p1", 0, "node-a", GPU_A, "risk", P1, ident7, m(18.5)),
        alloc("al-p1", 1, "node-a", GPU_A, "risk", P1, ident7, m(18.5), m(60), "released"),
        alloc("al-p2", 0, "node-b", GPU_B, "risk", P2, {"workload_id": W7}, m(62.5), attribution="unattributed"),
        alloc("al-p2", 1, "node-b", GPU_B, "risk", P2, ident7, m(62.5)),
        alloc("al-pt", 0, "node-a", GPU_A, "training", PT, {"workload_id": WT}, m(60.2), attribution="unattributed"),
        # P1's holding first went out from a later re-report of its assignment (read before the first one), then
        # was withdrawn when the engine read the first (``streams.correlate.entities._withdraw``): a tombstone
        # every reader skips (before, this open interval stayed for ever beside al-p1).
        alloc(GHOST, 0, "node-a", GPU_A, "risk", P1, ident7, m(19)),
        alloc(GHOST, 1, "node-a", GPU_A, "risk", P1, ident7, m(19), m(19), ALLOCATION_WITHDRAWN),
    ]


def latest(records: list) -> dict[str, object]:
    """The reader's view: highest version per row key."""
    out: dict[str, object] = {}
    for r in records:
        key = getattr(r, "correlation_id", None) or r.allocation_id
        if key not in out or r.version >= out[key].version:
            out[key] = r
    return out


def load_store(client, raw_events=()) -> str:
    """A fresh, migrated database holding the incident (and ``raw_events`` in raw_events),
    written through the real sink writers; returns its name."""
    import asyncio
    import uuid

    from sinks.agents import SinkWriters
    from sinks.migrations import migrate

    db = f"t_{uuid.uuid4().hex[:12]}"
    migrate(client, db)
    writers = SinkWriters(client, db)

    async def go():
        await writers.store_correlated(correlated_rows())
        await writers.store_allocations(allocation_rows())
        if raw_events:
            await writers.store_raw([(e.model_dump_json().encode(), "t.raw.v1", 0, i) for i, e in enumerate(raw_events)])
    asyncio.run(go())
    return db



def admission_row(before: timedelta = timedelta(milliseconds=40)) -> CorrelatedEvent:
    """gpuledger admit enforcing: the webhook's allow of W7, ``before`` its submission."""
    from schemas.admission import AdmissionPayload
    from streams.controls.policy import Policy

    submitted = next(r for r in correlated_rows() if r.event_type == "scheduler.submitted" and r.identity.workload_id == W7)
    payload = AdmissionPayload(decision="allow", outcome="allow", rule="approved", message=f"release {R7} is approved for prod",
                               mode="enforce", gate="webhook", object_kind="Workload", object_name="fraud-scorer-7", gpus_requested=1,
                               policy_version=Policy().fingerprint)
    return _ce("admission", "admission.decided", submitted.occurred_at - before,
               {"workload_id": W7, "namespace": "risk", "release_id": R7, "environment": "prod"}, payload.model_dump(mode="json"),
               summary="admission allow by rule approved (webhook, enforce)")
