"""producers/admission/webhook.py: AdmissionReview in, answer and decision out (no server)."""

from __future__ import annotations

from datetime import datetime, timezone

import orjson

from producers._config import GPU_RESOURCES, ResourceMatcher
from producers.admission.webhook import ReviewHandler
from streams.controls.admission import AdmissionState
from streams.controls.policy import Admission, Policy


def handler(policy: Policy | None = None) -> ReviewHandler:
    state = AdmissionState()
    state.ready.set()
    return ReviewHandler(state, policy or Policy(), ResourceMatcher(GPU_RESOURCES), "gpuledger.io/", host="h")


def review(kind: dict, obj: dict | None, operation: str = "CREATE", **request) -> bytes:
    return orjson.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                         "request": {"uid": "u1", "kind": kind, "operation": operation, "namespace": "serving", "object": obj, **request}})


POD = {"group": "", "version": "v1", "kind": "Pod"}
GPU_POD = {"metadata": {"name": "p", "labels": {"gpuledger.io/environment": "prod"}},
           "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}


def test_a_deny_is_a_403_status_with_our_message_and_an_event_for_the_recorder():
    status, answer, event = handler().handle(review(POD, GPU_POD, userInfo={"username": "ci"}))
    response = answer["response"]
    assert status == 200 and response["allowed"] is False and response["status"]["code"] == 403
    assert response["status"]["message"].startswith("Pod serving/p requests 1 GPU(s) in prod but names no release")
    decided = event()
    assert (decided.payload.rule, decided.payload.user, decided.identity.namespace, decided.identity.pod) == ("no-release-identity", "ci", "serving", "p")
    assert decided.event_id == handler().handle(review(POD, GPU_POD, userInfo={"username": "ci"}))[2]().event_id  # a re-sent review: one fact


def test_warn_mode_answers_allowed_with_a_warning_that_says_it_is_warn_mode_and_would_be_denied_in_enforce_mode():
    """Found by a review: the warning was the denial's message word for word, so whoever created the
    object read it as a denial, or did not learn that enforcement would refuse it. The warning (and
    the recorded message, which the AdmissionCheck's Ready message also is) now says both first."""
    enforced = handler().handle(review(POD, GPU_POD))[1]["response"]["status"]["message"]
    _, answer, event = handler(Policy(admission=Admission(modes={"prod": "warn"}))).handle(review(POD, GPU_POD))
    assert answer["response"]["allowed"] is True
    assert answer["response"]["warnings"] == ["Allowed only because the admission mode for namespace serving in prod is warn; "
                                              f"in enforce mode this would be denied: {enforced}"], answer
    assert enforced.startswith("Pod serving/p requests 1 GPU(s)") and "warn" not in enforced  # enforce mode's denial is unchanged
    payload = event().payload
    assert (payload.decision, payload.outcome, payload.mode, payload.message) == ("warn", "deny", "warn", answer["response"]["warnings"][0])


def test_dry_run_mode_allows_without_a_warning_and_records_that_it_would_be_denied_in_enforce_mode():
    """Dry-run says nothing to whoever created the object, but the recorded message (which the
    AdmissionCheck's Ready message also is) was the denial's word for word, for a workload let in."""
    enforced = handler().handle(review(POD, GPU_POD))[1]["response"]["status"]["message"]
    _, answer, event = handler(Policy(admission=Admission(modes={"prod": "dry-run"}))).handle(review(POD, GPU_POD))
    assert answer["response"]["allowed"] is True and not answer["response"].get("warnings"), answer
    payload = event().payload
    assert (payload.decision, payload.outcome, payload.mode) == ("allow", "deny", "dry-run")
    assert payload.message == ("Allowed and recorded only: the admission mode for namespace serving in prod is dry-run; "
                               f"in enforce mode this would be denied: {enforced}")


def test_dry_run_requests_are_answered_like_real_ones_and_recorded_as_dry_runs():
    """A server-side dry run (kubectl diff, --dry-run=server) gets the real request's answer, and its
    decision is recorded with ``dry_run`` — not as an operation "CREATE (dry run)" that readers took
    for enforcement — and its own id."""
    status, answer, event = handler().handle(review(POD, GPU_POD, dryRun=True))
    real = handler().handle(review(POD, GPU_POD))
    assert (status, answer) == real[:2] and answer["response"]["allowed"] is False
    decided = event()
    assert (decided.payload.dry_run, decided.payload.operation, decided.payload.rule) == (True, "CREATE", "no-release-identity")
    assert real[2]().payload.dry_run is False and real[2]().event_id != decided.event_id
    assert '"dry_run":true' in event.describes()  # (what a dead letter of it would say)


def test_other_kinds_and_deletes_are_allowed_unrecorded():
    for body in (review({"group": "apps", "version": "v1", "kind": "Deployment"}, {"metadata": {"name": "d"}}),
                 review(POD, None, operation="DELETE")):
        status, answer, event = handler().handle(body)
        assert (status, answer["response"]["allowed"], event) == (200, True, None)


def test_a_pod_whose_dra_claim_cannot_be_read_counts_it_as_a_gpu_and_says_why():
    """Without API access (no kubeconfig, not in a cluster) a DRA claim cannot be read: it counts
    as a GPU — a prod pod naming no release is denied as GPU work — and the answer's warnings name
    the claim; with no reader at all (the old handler) the same pod was not GPU work."""
    from producers._config import GPU_DRA_DRIVERS
    from producers.admission.claims import ClaimReader

    state = AdmissionState()
    state.ready.set()
    reader = ReviewHandler(state, Policy(), ResourceMatcher(GPU_RESOURCES), "gpuledger.io/", host="h",
                           claims=ClaimReader(None, ResourceMatcher(GPU_DRA_DRIVERS)))
    dra_pod = {"metadata": {"name": "p", "labels": {"gpuledger.io/environment": "prod"}},
               "spec": {"containers": [{"name": "c", "resources": {"claims": [{"name": "gpu"}]}}],
                        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]}}
    _, answer, event = reader.handle(review(POD, dra_pod))
    response = answer["response"]
    assert response["allowed"] is False and response["status"]["message"].startswith("Pod serving/p requests 1 GPU(s) in prod but names no release")
    assert response["warnings"] == ["DRA claim 'gpu' (resourceclaimtemplate serving/one-gpu) could not be read, so it counts as a GPU: "
                                    "gpuledger admit has no API access (GPULEDGER_ADMIT_CLAIMS_IN_CLUSTER, GPULEDGER_ADMIT_IN_CLUSTER or "
                                    "GPULEDGER_ADMIT_KUBECONFIG)"]
    # The decided event's evidence says it too: its message is the answer's, then the note, each its own sentence.
    payload = event().payload
    assert (payload.rule, payload.gpus_requested) == ("no-release-identity", 1)
    assert payload.message == f"{response['status']['message']}. {response['warnings'][0]}", payload.message
    assert handler().handle(review(POD, dra_pod))[1]["response"]["allowed"] is True  # no reader: a claim is not counted


def test_the_recorded_message_sets_the_decision_the_claim_notes_and_the_stale_note_apart_as_sentences():
    """Found by a review: the decision's message, the notes on unreadable DRA claims and the stale-state
    note were joined with a space — the AdmissionCheck's message read "approved for prod gpuledger admit
    could not confirm…". Each now ends with a full stop before the next; one that has its own keeps it."""
    from dataclasses import replace

    from producers._config import GPU_DRA_DRIVERS
    from producers.admission.claims import ClaimReader
    from producers.admission.events import decision_message
    from streams.controls.admission import decide, subject_of

    state = AdmissionState()
    state.ready.set()
    state.confirmed_at = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc).timestamp()  # the follower's last confirmation
    reader = ReviewHandler(state, Policy(), ResourceMatcher(GPU_RESOURCES), "gpuledger.io/", host="h", stale_after_s=60,
                           clock=lambda: datetime(2026, 12, 1, 12, 5, tzinfo=timezone.utc), claims=ClaimReader(None, ResourceMatcher(GPU_DRA_DRIVERS)))
    dra_pod = {"metadata": {"name": "p", "labels": {"gpuledger.io/environment": "prod"}},
               "spec": {"containers": [{"name": "c", "resources": {"claims": [{"name": "gpu"}]}}],
                        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]}}
    _, answer, event = reader.handle(review(POD, dra_pod))
    message = event().payload.message
    denial, claim_note, stale_note = answer["response"]["status"]["message"], *answer["response"]["warnings"]
    assert stale_note.startswith("gpuledger admit could not confirm its release state is current since 2026-12-01T12:00:00Z"), stale_note
    assert message == f"{denial}. {claim_note}. {stale_note}", message
    assert "release approved for prod. DRA claim 'gpu'" in message and "GPULEDGER_ADMIT_KUBECONFIG). gpuledger admit could not confirm" in message
    # A part that already ends a sentence is not given a second full stop; a decision alone is unchanged.
    subject = subject_of({**GPU_POD, "kind": "Pod", "metadata": {**GPU_POD["metadata"], "namespace": "serving"}}, ResourceMatcher(GPU_RESOURCES))
    decision = decide(subject, state, Policy())
    assert decision_message(subject, replace(decision, message="denied."), ("a note",)) == "denied. a note"
    assert decision_message(subject, decision) == decision.message


def test_an_identity_annotation_the_event_refuses_is_not_used_and_the_answer_says_so():
    """A release id (or owner) annotation with a control or bidi character in it — an annotation is its
    creator's to write — is not used: the decision is taken without it and says why, in the answer's
    warnings and the recorded message (it read as "names no release", and the event could not be built)."""
    pod = {"metadata": {"name": "p", "labels": {"gpuledger.io/environment": "prod"},
                        "annotations": {"gpuledger.io/release-id": "rel-\u202e1", "gpuledger.io/owner": "fraud\nteam"}},
           "spec": GPU_POD["spec"]}
    _, answer, event = handler().handle(review(POD, pod))
    response = answer["response"]
    assert response["allowed"] is False and response["status"]["message"].startswith("Pod serving/p requests 1 GPU(s) in prod but names no release")
    notes = ["Its gpuledger.io/release-id was not used: contains U+202E (RIGHT-TO-LEFT OVERRIDE) at position 4; identifiers must not carry "
             "control or bidi characters",
             "Its gpuledger.io/owner was not used: contains U+000A (control character) at position 5; identifiers must not carry "
             "control or bidi characters"]
    assert response["warnings"] == notes, response
    decided = event()
    assert (decided.identity.release_id, decided.identity.owner, decided.payload.rule) == (None, None, "no-release-identity")
    assert decided.payload.message == f"{response['status']['message']}. {notes[0]}. {notes[1]}"


def test_an_event_is_built_without_an_identity_value_its_schema_refuses_and_says_which():
    """The last safety net of the record (``producers.admission.events._identity``): a subject whose
    identity holds a value the event refuses — built by a caller other than ``subject_of``, which
    leaves such values out — gives an event without it, its message naming it, not no event."""
    from producers.admission.events import decision_event
    from streams.controls.admission import Subject, decide

    subject = Subject("Pod", "serving", "p", "uid-1", 1, {"owner": "fraud\nteam", "environment": "prod"}, "serving/Pod/p", False)
    state = AdmissionState()
    state.ready.set()
    decided = decide(subject, state, Policy())
    event = decision_event(subject, decided, datetime(2026, 12, 6, tzinfo=timezone.utc), gate="webhook", request_id="r1")
    assert event.identity.owner is None and event.identity.environment == "prod"
    assert event.payload.message == (f"{decided.message}. Not recorded in this event's identity: owner (owner: Value error, contains U+000A "
                                     "(control character) at position 5; identifiers must not carry control or bidi characters)")
