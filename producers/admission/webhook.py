"""The AdmissionReview endpoint: request body → (HTTP status, response body, decision event).

A function of the body and the release state — but for an object's DRA claims, which its
``claims`` reader fetches from the API server (``producers.admission.claims``): the service
calls ``handle`` in a worker thread then, and the decision reads the release state under its
lock (the follower folds into it on the event loop).

Input: an ``admission.k8s.io/v1`` AdmissionReview for a Pod, batch Job or Kueue Workload.
Output: the AdmissionReview answer — ``allowed``, a 403 ``status`` whose message the API
server shows to whoever created the object, ``warnings`` in warn mode — and the
``admission.decided`` event to record. A body that is not an AdmissionReview (not JSON,
wrong apiVersion/kind, no request.uid, no object) is answered 400 with the reason and no
decision; an object kind we do not decide (the configuration should not send us any) is
allowed and not recorded. DELETE and CONNECT are allowed unrecorded (no new GPU work). A
server-side dry run (``request.dryRun``: ``kubectl diff``, ``--dry-run=server``) is decided and
answered like the real request, and recorded with ``dry_run`` set: nothing was created, and no
reader counts it as enforcement.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

import orjson

from producers._config import ResourceMatcher
from producers.admission.config import STALE_AFTER_S
from producers.admission.events import decision_event
from schemas.admission import AdmissionEvent
from streams.controls.admission import AdmissionState, decide, subject_of
from streams.controls.policy import Policy

API_VERSION = "admission.k8s.io/v1"
DECIDED_KINDS = {("", "Pod"), ("batch", "Job"), ("kueue.x-k8s.io", "Workload")}


class BadReview(ValueError):
    """A body that is not a usable AdmissionReview (answered 400)."""


def parse_review(body: bytes) -> dict:
    try:
        review = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadReview(f"body is not JSON: {exc}") from exc
    if not isinstance(review, dict) or review.get("kind") != "AdmissionReview" or review.get("apiVersion") != API_VERSION:
        raise BadReview(f"expected an {API_VERSION} AdmissionReview")
    request = review.get("request")
    if not isinstance(request, dict) or not isinstance(request.get("uid"), str) or not request["uid"]:
        raise BadReview("request.uid is missing")
    return request


def _answer(uid: str, allowed: bool, message: str | None = None, warnings: list[str] | None = None) -> dict:
    response: dict[str, Any] = {"uid": uid, "allowed": allowed}
    if not allowed:
        response["status"] = {"code": 403, "reason": "Forbidden", "message": message or "denied by gpuledger"}
    if warnings:
        response["warnings"] = warnings
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}


class ReviewHandler:
    """Decides AdmissionReviews against the in-memory release state."""

    def __init__(self, state: AdmissionState, policy: Policy, resources: ResourceMatcher, prefix: str,
                 clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc), host: str | None = None, claims=None,
                 stale_after_s: float = STALE_AFTER_S) -> None:
        self.state, self.policy, self.resources, self.prefix, self.clock, self.host = state, policy, resources, prefix, clock, host
        self.stale_after_s = stale_after_s  # AdmitSettings.stale_after_s
        self.claims = claims  # producers.admission.claims.ClaimReader: the GPUs of DRA claims (reads the API server)
        self.policy_version = policy.fingerprint

    def handle(self, body: bytes, caller: str | None = None,
               namespace_environment: str | None = None) -> tuple[int, dict, Callable[[], AdmissionEvent] | None]:
        """(HTTP status, answer, a function building the decision's event — called off the
        request path by the recorder — or None when there is nothing to record). ``caller``: who
        called, as its client certificate proved it (``x509:<common name>``), None when not proven.
        ``namespace_environment``: the environment the path of the call names (``/validate/prod``):
        the webhook configuration sends only namespaces labelled with it there, so it is the
        namespace's label, which the AdmissionReview does not carry — a floor of the decision's
        environment, mode and fail-closed like the policy's namespace entry. The service answers
        such a path only for a fail-closed environment of the policy (decided fail-closed); its
        approval rule and mode are the policy's for it, as in a namespace the policy maps to it
        (``modes: {prod: warn}`` is warn there)."""
        try:
            request = parse_review(body)
        except BadReview as exc:
            return 400, {"error": str(exc)}, None
        uid = request["uid"]
        kind = request.get("kind") or {}
        operation = request.get("operation")
        if (kind.get("group", ""), kind.get("kind")) not in DECIDED_KINDS or operation in ("DELETE", "CONNECT"):
            return 200, _answer(uid, True), None
        obj = request.get("object")
        if not isinstance(obj, dict):
            return 400, {"error": "request.object is missing"}, None
        obj = {**obj, "kind": kind.get("kind")}
        obj.setdefault("metadata", {})
        if isinstance(obj["metadata"], dict) and not obj["metadata"].get("namespace") and request.get("namespace"):
            obj["metadata"] = {**obj["metadata"], "namespace": request["namespace"]}
        try:
            subject = subject_of(obj, self.resources, self.prefix, claims=self.claims)
        except (ValueError, TypeError, AttributeError) as exc:
            return 400, {"error": f"request.object cannot be read: {exc}"}, None
        if namespace_environment:
            subject = replace(subject, namespace_environment=namespace_environment)
        now = self.clock()
        stale = self.state.stale_note(self.stale_after_s, now.timestamp())
        notes = (stale,) if stale else ()
        try:
            with self.state.lock:  # (the service's worker thread: the follower folds into it on the loop)
                decision = decide(subject, self.state, self.policy, now, gate="webhook", policy_version=self.policy_version)
        except Exception as exc:  # noqa: BLE001 - a decision that fails is fail-closed/-open, never a crash
            decision = decide(subject, None, self.policy, now, gate="webhook", policy_version=self.policy_version)
            decision = replace(decision, message=f"{decision.message} (decision failed: {exc})")
        user = (request.get("userInfo") or {}).get("username")
        dry_run = request.get("dryRun") is True  # decided and recorded, but nothing was created
        host = self.host

        def event() -> AdmissionEvent:
            return decision_event(subject, decision, now, gate="webhook", request_id=uid, operation=operation, user=user, host=host, notes=notes,
                                  caller=caller, dry_run=dry_run)

        # What the recorder's dead letter says of a decision whose event the schema refuses
        # (``DecisionRecorder._build``; called there, off the request path too).
        event.describes = lambda: orjson.dumps({"request_uid": uid, "operation": operation, "dry_run": dry_run, "user": user, "caller": caller,
                                                "object": subject.workload_id, "decision": decision.verdict, "rule": decision.rule,
                                                "message": decision.message}).decode()
        return 200, _answer(uid, decision.allowed, decision.message, [*decision.warnings, *subject.claim_notes, *notes]), event
