"""gpuledger admit's decisions (``admission.decided``) as the readers tell them apart.

Shared by ``gpuledger trace`` (``sinks.read.trace``, drawn by ``sinks.read.tree``) and
``gpuledger audit`` (``sinks.read.audit``), so that the two read one decision the same way.

A ``deny`` is not always a refusal. The Kueue AdmissionCheck controller
(producers/admission/controller.py) records ``deny`` (enforce mode) both when it sets its
check ``Rejected`` (a rule no later event can change: ``PERMANENT_RULES`` in
streams/controls/admission.py — Kueue deactivates the Workload) and when it leaves the check
``Pending`` (not approved yet, unknown release, state not loaded): the Workload keeps its place
in its queue and is admitted once what it waits for arrives. The check state it set is the
payload's ``operation``. And the webhook's ``allow`` by ``deferred-to-admission-check`` lets a
Kueue-queued object in for the AdmissionCheck to decide on its Workload: a hand-over, not a
decision that it may run.

A server-side dry run (``kubectl diff``, ``--dry-run=server``, Argo CD's diff) is decided and
recorded like a real request, but nothing was created: ``is_dry_run``, status ``dry-run``. The
readers show it as one and never count it as enforcement, nor as a decision on a real object.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

#: The webhook's rule for an object Kueue queues in a namespace whose gate is the AdmissionCheck.
DEFERRED_RULE = "deferred-to-admission-check"

D = TypeVar("D")


def check_state(payload: dict) -> str | None:
    """The state the AdmissionCheck controller set on its check (the payload's ``operation`` at
    that gate: Ready, Pending, Rejected); None for the webhook, whose operation is the request's
    (CREATE, UPDATE)."""
    return (payload.get("operation") or None) if payload.get("gate") == "admission-check" else None


#: What an older gpuledger admit recorded as a dry run's ``operation`` (before ``dry_run``): "CREATE (dry run)".
_DRY_RUN_OPERATION = " (dry run)"


def is_dry_run(payload: dict) -> bool:
    """The decision answered a server-side dry run (the payload's ``dry_run``; recorded before it
    existed, its ``operation`` ending " (dry run)"): nothing was created."""
    return payload.get("dry_run") is True or str(payload.get("operation") or "").endswith(_DRY_RUN_OPERATION)


def decision_status(decision: str | None, rule: str | None, check: str | None, dry_run: bool = False) -> str:
    """What a decision did: ``dry-run`` (it answered a server-side dry run: nothing was created,
    whatever it said), ``waiting`` (a deny that left the AdmissionCheck ``Pending``), ``denied`` (a
    webhook deny, or a ``Rejected`` check), ``deferred`` (the webhook handing a queued object to the
    AdmissionCheck: ``DEFERRED_RULE``), else ``allowed``."""
    if dry_run:
        return "dry-run"
    if decision != "deny":
        return "deferred" if rule == DEFERRED_RULE else "allowed"
    return "waiting" if check == "Pending" else "denied"


def wait_run(decisions: Sequence[D], status: Callable[[D], str]) -> tuple[D, D] | None:
    """(first, last) of the decisions that hold the workload now — the run of waits its last
    decision ends; each re-decision of a held Workload (a release change, a resync) is another
    wait, and the hold began at the first — when its last decision is a wait, else None."""
    if not decisions or status(decisions[-1]) != "waiting":
        return None
    first = len(decisions) - 1
    while first > 0 and status(decisions[first - 1]) == "waiting":
        first -= 1
    return decisions[first], decisions[-1]
