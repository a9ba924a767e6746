"""A decision as an ``admission.decided`` event (pure).

Event id: ``make_event_id("admit", (gate, kind, namespace, name, uid, operation), request)``
(a dry run's ``operation`` there followed by " (dry run)", as older records' was), where
``request`` is the AdmissionReview's ``request.uid`` (a re-sent review is the same fact) or,
for the AdmissionCheck controller, the check state it set, the rule and when the check's state
it read began (``state|rule|lastTransitionTime``, ``operation`` the state): one
Workload put in one state by one rule within one episode of its check is one fact, however
often it is re-listed or the controller restarts — also when only the message changed (a
stale-state note added or gone: not recorded again; the Workload's check message shows the
latest). An episode ends when the check's state changes: Kueue resets it to Pending, with a new
lastTransitionTime, when it evicts the Workload, so a Workload held Pending, let in by an
override, evicted and held again records its second hold too (with ``state|rule`` alone it had
the first one's id: the store kept one row, and the override's Ready read as its last decision).
Within one Pending episode, a return to a rule it was held by before is still that first fact.
"""

from __future__ import annotations

import socket
from datetime import datetime

from schemas.admission import AdmissionEvent, AdmissionPayload
from schemas.envelope import Identity, Source, make_event_id
from streams.controls.admission import Decision, Subject

COLLECTOR = "admit"
_IDENTITY = ("model_name", "model_version", "owner", "data_class")
#: Characters of a decision's message kept (the AdmissionCheck's message is cut the same).
MAX_MESSAGE = 32_000


def decision_message(subject: Subject, decision: Decision, notes: tuple[str, ...] = ()) -> str:
    """The decision's message followed by the notes on the subject's DRA claims that could not be
    read (each counted as a GPU) and ``notes`` (the state's ``AdmissionState.stale_note``): what
    the AdmissionCheck controller sets on the Workload, and what the ``admission.decided`` event
    records for either gate (the webhook returns those notes as AdmissionReview warnings) — so
    the evidence says why ``gpus_requested`` may count a claim that holds no GPU, and that the
    release state decided on could not be confirmed current.

    Each part is its own sentence, ending with a full stop before the next (one already ending
    with one keeps it): joined with a space they ran together ("approved for prod gpuledger admit
    could not confirm…"), and "; " would not set them apart either — a decision's message uses
    semicolons itself. The last part keeps its own ending, so a message with no notes is the
    decision's message as it is."""
    parts = [part.strip() for part in (decision.message, *subject.claim_notes, *notes) if part and part.strip()]
    ended = [part if part.endswith((".", "!", "?")) else f"{part}." for part in parts[:-1]]
    return " ".join((*ended, *parts[-1:]))[:MAX_MESSAGE]


def decision_event(subject: Subject, decision: Decision, at: datetime, *, gate: str, request_id: str, operation: str | None = None,
                   user: str | None = None, host: str | None = None, notes: tuple[str, ...] = (), caller: str | None = None,
                   dry_run: bool = False) -> AdmissionEvent:
    ident = {k: v for k, v in subject.identity.items() if k in _IDENTITY}
    pod = subject.name if subject.kind == "Pod" else None
    identity, refused = _identity(dict(release_id=decision.release_id, environment=decision.environment, namespace=subject.namespace or None,
                                       workload_id=subject.workload_id, pod=pod, pod_uid=subject.uid if pod else None, **ident))
    notes = (*notes, refused) if refused else notes
    payload = AdmissionPayload(
        decision=decision.verdict, outcome=decision.outcome, rule=decision.rule, message=decision_message(subject, decision, notes), mode=decision.mode,
        gate=gate,
        object_kind=subject.kind, object_name=subject.name or "-", object_uid=subject.uid, operation=operation, dry_run=dry_run, user=user,
        caller=caller,
        gpus_requested=max(subject.gpus, 0), release_state=decision.release_state, fail_closed=decision.fail_closed,
        policy_version=decision.policy_version, directory_version=decision.directory_version,
        override_event_id=decision.override_event_id, evidence=decision.evidence)
    # (a dry run's id as before it had a field of its own: apart from the real request's, whatever the request uid)
    keyed = f"{operation} (dry run)" if dry_run else operation
    eid = make_event_id(COLLECTOR, (gate, subject.kind, subject.namespace, subject.name, subject.uid, keyed), request_id)
    return AdmissionEvent(event_id=eid, event_type="admission.decided", occurred_at=at, observed_at=at,
                          source=Source(collector=COLLECTOR, host=host or socket.gethostname()), identity=identity, payload=payload)


def _identity(fields: dict) -> tuple[Identity, str | None]:
    """The decision's identity, and a note naming the fields left out of it: a value the event
    refuses (a line break in a ``gpuledger.io/owner`` annotation — a label or annotation is its
    creator's to write) is not recorded, and the decision is, saying so. Before, the event could
    not be built at all and the decision went unrecorded (``DecisionRecorder``)."""
    from pydantic import ValidationError

    try:
        return Identity(**fields), None
    except ValidationError as exc:
        errors = [e for e in exc.errors() if e.get("loc")]
        refused = sorted({str(e["loc"][0]) for e in errors})
        if not errors or any(name not in fields for name in refused):
            raise
        kept = {k: v for k, v in fields.items() if k not in refused}
        why = "; ".join(f"{e['loc'][0]}: {e['msg']}" for e in errors)
        return Identity(**kept), f"Not recorded in this event's identity: {', '.join(refused)} ({why})"
