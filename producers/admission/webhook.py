"""The AdmissionReview endpoint: request body → (HTTP status, response body, decision event).

A function of the body and the release state — but for an object's DRA claims, which its
``claims`` reader fetches from the API server (``producers.admission.claims``): the service
calls ``handle`` in a worker thread then, and the decision reads the release state under its
lock (the follower folds into it on the event loop).

Input: an ``admission.k8s.io/v1`` AdmissionReview for a Pod, batch Job or Kueue Workload.
Output: the AdmissionReview answer — ``allowed``, a 403 ``status`` whose message the API
server shows to whoever created the object, ``warnings`` in warn mode — and the
``admission.decided`` event to record. A body that is not an AdmissionReview (not JSON,
wrong apiVersion/kind, no request.uid, no object, a field of another type than the API server
sends — ``request.kind``, ``userInfo``, ``operation``, or what the decision reads of the object:
``SHAPES``) is answered 400 naming the field, and no decision; an object kind we do not decide
(the configuration should not send us any) is allowed and not recorded. DELETE and CONNECT are
allowed unrecorded (no new GPU work). A server-side dry run (``request.dryRun``: ``kubectl
diff``, ``--dry-run=server``) is decided and answered like the real request, and recorded with
``dry_run`` set: nothing was created, and no reader counts it as enforcement.
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
    # What the API server always sends, in the types it sends them. Another shape is not a review
    # (a hand-made or broken caller): a string request.kind or userInfo was a 500 with a traceback,
    # and a kind without its group an object of no kind we decide — allowed, unrecorded.
    kind = request.get("kind")
    if not isinstance(kind, dict):
        raise BadReview(f"request.kind must be an object (group, version, kind), not {_json_type(kind)}")
    for field in ("group", "kind"):
        if not isinstance(kind.get(field), str):
            raise BadReview(f"request.kind.{field} must be a string (the core group is \"\"), not {_json_type(kind.get(field))}")
    for field, types, what in (("userInfo", dict, "an object"), ("namespace", str, "a string"), ("dryRun", bool, "a boolean")):
        if request.get(field) is not None and not isinstance(request[field], types):
            raise BadReview(f"request.{field} must be {what}, not {_json_type(request[field])}")
    return request


def _json_type(value: Any) -> str:
    """How JSON names the type of a decoded value (for a 400's message)."""
    for types, name in ((type(None), "null"), (bool, "a boolean"), ((int, float), "a number"), (str, "a string"), (list, "a list"), (dict, "an object")):
        if isinstance(value, types):
            return name
    return type(value).__name__


#: The fields of each decided kind that the decision reads, in the JSON types the API server gives
#: them (``object_problem``): a dict is an object of those fields, a one-item list a list of that,
#: ``STRINGS`` a map of strings. A field may be absent or null (its default applies).
STRINGS = "map of strings"
_META = {"name": str, "generateName": str, "namespace": str, "uid": str, "labels": STRINGS, "annotations": STRINGS}
_CONTAINER = {"restartPolicy": str, "resources": {"requests": dict, "limits": dict, "claims": [dict]}}
_POD_SPEC = {"containers": [_CONTAINER], "initContainers": [_CONTAINER], "resourceClaims": [dict]}
_TEMPLATE = {"metadata": _META, "spec": _POD_SPEC}
SHAPES = {
    "Pod": {"metadata": _META, "spec": _POD_SPEC},
    "Job": {"metadata": _META, "spec": {"parallelism": int, "suspend": bool, "template": _TEMPLATE}},
    "Workload": {"metadata": _META, "spec": {"podSets": [{"name": str, "count": int, "template": _TEMPLATE}]}},
}


def object_problem(value: Any, shape: Any, path: str) -> str | None:
    """Where ``value`` (at ``path``) is not of ``shape`` (``SHAPES``), first found: "request.object.spec.podSets
    must be a list, not a string" — read leniently, such a field counted no GPU (a Workload whose podSets is a
    string was allowed as requesting none) or raised (a 500)."""
    if value is None:
        return None
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            return f"{path} must be an object, not {_json_type(value)}"
        return next((p for key, sub in shape.items() if (p := object_problem(value.get(key), sub, f"{path}.{key}"))), None)
    if isinstance(shape, list):
        if not isinstance(value, list):
            return f"{path} must be a list, not {_json_type(value)}"
        for i, item in enumerate(value):
            if item is None:
                return f"{path}[{i}] must not be null"
            if problem := object_problem(item, shape[0], f"{path}[{i}]"):
                return problem
        return None
    if shape is STRINGS:
        if not isinstance(value, dict):
            return f"{path} must be an object, not {_json_type(value)}"
        bad = next((k for k, v in value.items() if not isinstance(v, str)), None)
        return None if bad is None else f"{path}[{bad!r}] must be a string, not {_json_type(value[bad])}"
    if shape is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else f"{path} must be an integer, not {_json_type(value)}"
    return None if isinstance(value, shape) else f"{path} must be {_json_type(shape())}, not {_json_type(value)}"


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
        kind = request["kind"]
        operation = request.get("operation")
        if (kind["group"], kind["kind"]) not in DECIDED_KINDS or operation in ("DELETE", "CONNECT"):
            return 200, _answer(uid, True), None
        obj = request.get("object")
        if not isinstance(obj, dict):
            return 400, {"error": "request.object is missing"}, None
        if operation not in ("CREATE", "UPDATE"):
            return 400, {"error": f"request.operation must be CREATE, UPDATE, DELETE or CONNECT, not {str(operation)[:40]!r}"}, None
        if problem := object_problem(obj, SHAPES[kind["kind"]], "request.object"):
            return 400, {"error": f"request.object cannot be read: {problem}"}, None
        obj = {**obj, "kind": kind["kind"], "metadata": obj.get("metadata") or {}}
        if not obj["metadata"].get("namespace") and request.get("namespace"):
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
