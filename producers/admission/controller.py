"""The Kueue AdmissionCheck controller: a Workload waits in its queue until its release is approved.

Input: Kueue ``AdmissionCheck`` objects whose ``controllerName`` is ours
(``gpuledger.io/release-approval``) and every ``Workload`` (kueue.x-k8s.io/v1beta2, list +
watch, re-listed every ``resync_s``); the release state (``AdmissionState``), whose changes
re-decide the waiting Workloads at once. Output: each such AdmissionCheck marked
``Active``; on every not-yet-admitted Workload whose ``status.admissionChecks`` names one of
them, that check's ``state`` and ``message`` (a merge patch of ``workloads/status`` guarded
by the Workload's resourceVersion) — and an ``admission.decided`` event for every state it sets.

States: allowed (approved, an override, warn or dry-run, an environment without approval)
→ ``Ready``; a release revoked/retired or a Workload with no release identity (neither can
change without a new Workload) → ``Rejected`` (Kueue deactivates it); anything that can
still change (not yet approved, approval without the right, unknown release, state not
loaded) → ``Pending`` with our message: the Workload keeps its place and its quota
reservation and is admitted the moment the approval arrives, with no resubmission.
(``Retry`` would release the quota but requeue with Kueue's back-off, so admission after
the approval would wait for that back-off.)

Nothing is decided before the release state has loaded (``AdmissionState.ready``): the watch
runs and remembers the Workloads, and the first decisions come once the state is loaded — a
re-decide pass over every Workload waiting on us. Before, the Workloads of a fail-open
environment were set ``Ready`` unchecked at every restart (``state-not-loaded``), and an
admitted Workload is never revisited. A Workload is queued for a decision once however
often it changes before the decision runs (the decision reads its latest version).
Limits: admitted Workloads are left alone (a revocation after admission is control 8's
finding, not an eviction); one process per cluster (no leader election).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from producers._config import ResourceMatcher
from producers.admission.config import STALE_AFTER_S
from producers.admission.events import decision_event, decision_message
from streams.controls.admission import PERMANENT_RULES, AdmissionState, Decision, decide, subject_of
from streams.controls.policy import Policy

log = logging.getLogger(__name__)

GROUP, VERSION = "kueue.x-k8s.io", "v1beta2"
#: Seconds between looks at whether the release state has loaded, before the first decision
#: (``AdmissionState.ready`` is the follower's asyncio event: another thread can only look).
STATE_POLL_S = 0.2


def check_state(decision: Decision) -> str:
    if decision.allowed:
        return "Ready"
    return "Rejected" if decision.rule in PERMANENT_RULES else "Pending"


def _admitted(wl: dict) -> bool:
    return any(c.get("type") in ("Admitted", "Finished") and c.get("status") == "True" for c in (wl.get("status") or {}).get("conditions") or [])


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class AdmissionCheckController:
    """List+watch Workloads in a thread; decide and set our checks' states in another."""

    def __init__(self, api: k8s.ApiClient, state: AdmissionState, policy: Policy, resources: ResourceMatcher, prefix: str,
                 record: Callable[[Any], None], controller_name: str, resync_s: float = 30.0, watch_timeout_s: int = 300,
                 host: str | None = None, claims=None, stale_after_s: float = STALE_AFTER_S) -> None:
        self.claims = claims  # producers.admission.claims.ClaimReader: the GPUs of a Workload's DRA claims
        self.stale_after_s = stale_after_s  # AdmitSettings.stale_after_s: a decision's message then says the state may be stale
        self.custom = k8s.CustomObjectsApi(api)
        self.state, self.policy, self.resources, self.prefix, self.record = state, policy, resources, prefix, record
        self.controller_name, self.resync_s, self.watch_timeout_s, self.host = controller_name, resync_s, watch_timeout_s, host
        self.policy_version = policy.fingerprint
        self.checks: set[str] = set()
        self.cache: dict[str, dict] = {}  # namespace/name -> latest Workload seen
        self.work: queue.Queue[str | None] = queue.Queue()
        self._queued: set[str] = set()  # keys in ``work`` not yet taken (each queued once: ``_enqueue``)
        self._queued_lock = threading.Lock()
        self.stop_event = threading.Event()
        self.threads: list[threading.Thread] = []
        self.counters = {"decided": 0, "patched": 0, "conflicts": 0, "errors": 0}

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        for target, name in ((self._watch_loop, "admit-watch"), (self._work_loop, "admit-decide")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self.threads.append(t)

    def stop(self) -> None:
        self.stop_event.set()
        self.work.put(None)
        for t in self.threads:
            t.join(timeout=5)

    def release_changed(self, _keys=None) -> None:
        """The release state changed (or loaded): re-decide every Workload still waiting on us."""
        for key, wl in list(self.cache.items()):
            if not _admitted(wl):
                self._enqueue(key)

    def _enqueue(self, key: str) -> None:
        with self._queued_lock:
            if key in self._queued:
                return  # (already waiting for a decision, which reads the Workload's latest version)
            self._queued.add(key)
        self.work.put(key)

    # -- AdmissionChecks ----------------------------------------------------------------------
    def _sync_checks(self) -> None:
        items = self.custom.list_cluster_custom_object(GROUP, VERSION, "admissionchecks")["items"]
        mine = {ac["metadata"]["name"]: ac for ac in items if (ac.get("spec") or {}).get("controllerName") == self.controller_name}
        self.checks = set(mine)
        for name, ac in mine.items():
            conds = (ac.get("status") or {}).get("conditions") or []
            if any(c.get("type") == "Active" and c.get("status") == "True" for c in conds):
                continue
            active = {"type": "Active", "status": "True", "reason": "Active", "message": "gpuledger admit decides this check",
                      "lastTransitionTime": _now(), "observedGeneration": ac["metadata"].get("generation", 1)}
            others = [c for c in conds if c.get("type") != "Active"]
            self.custom.patch_cluster_custom_object_status(GROUP, VERSION, "admissionchecks", name, {"status": {"conditions": [*others, active]}})
            log.info("admission check %s is active", name)

    # -- Workloads ------------------------------------------------------------------------------
    def _watch_loop(self) -> None:
        delay = 0.5
        while not self.stop_event.is_set():
            try:
                self._sync_checks()
                listed = self.custom.list_cluster_custom_object(GROUP, VERSION, "workloads")
                seen = set()
                for wl in listed.get("items") or []:
                    seen.add(self._remember(wl))
                for key in set(self.cache) - seen:
                    self.cache.pop(key, None)
                rv = (listed.get("metadata") or {}).get("resourceVersion")
                self._watch(rv)
                delay = 0.5
            except Exception as exc:  # noqa: BLE001 - the API server may come and go; back off and re-list
                if self.stop_event.is_set():
                    return
                self.counters["errors"] += 1
                log.warning("admission check controller: %s; retrying in %.1fs", exc, delay)
                self.stop_event.wait(delay)
                delay = min(delay * 2, 30.0)

    def _watch(self, rv: str | None) -> None:
        deadline = time.monotonic() + self.resync_s
        while not self.stop_event.is_set() and time.monotonic() < deadline:
            timeout = max(1, min(self.watch_timeout_s, int(deadline - time.monotonic()) + 1))
            resp = self.custom.list_cluster_custom_object(GROUP, VERSION, "workloads", watch=True, resource_version=rv,
                                                          timeout_seconds=timeout, allow_watch_bookmarks=True, _preload_content=False)
            try:
                for line in iter_resp_lines(resp):
                    if self.stop_event.is_set():
                        return
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    obj = event.get("object") or {}
                    if event.get("type") == "ERROR":
                        return  # 410 and friends: re-list
                    rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                    if event.get("type") == "DELETED":
                        self.cache.pop(self._key(obj), None)
                    elif event.get("type") in ("ADDED", "MODIFIED"):
                        self._remember(obj)
            finally:
                resp.release_conn()

    @staticmethod
    def _key(wl: dict) -> str:
        meta = wl.get("metadata") or {}
        return f"{meta.get('namespace')}/{meta.get('name')}"

    def _remember(self, wl: dict) -> str:
        key = self._key(wl)
        self.cache[key] = wl
        if self._ours(wl) and not _admitted(wl):
            self._enqueue(key)
        return key

    def _ours(self, wl: dict) -> list[dict]:
        return [c for c in (wl.get("status") or {}).get("admissionChecks") or [] if c.get("name") in self.checks]

    # -- deciding ---------------------------------------------------------------------------------
    def _await_state(self) -> bool:
        """Wait until the release state has loaded (True) or the controller is stopped (False)."""
        while not self.state.ready.is_set():
            if self.stop_event.wait(STATE_POLL_S):
                return False
        return True

    def _work_loop(self) -> None:
        # No decision before the release state has loaded: every Workload would be decided
        # ``state-not-loaded``. The Workloads seen meanwhile wait in ``work``; the pass below
        # re-decides every one in the cache that waits on us, whatever the follower signals.
        if not self._await_state():
            return
        log.info("release state loaded: deciding the Workloads waiting on the admission check")
        self.release_changed()
        while not self.stop_event.is_set():
            key = self.work.get()
            if key is None:
                return
            with self._queued_lock:
                self._queued.discard(key)
            wl = self.cache.get(key)
            if wl is None:
                continue
            try:
                self.reconcile(wl)
            except ApiException as exc:
                if exc.status == 409:
                    self.counters["conflicts"] += 1  # a newer Workload is on its way through the watch
                elif exc.status != 404:
                    self.counters["errors"] += 1
                    log.warning("admission check on workload %s not set: %s", key, exc.reason)
            except Exception:  # noqa: BLE001 - one Workload must not stop the controller
                self.counters["errors"] += 1
                log.exception("admission check on workload %s failed", key)

    def reconcile(self, wl: dict) -> str | None:
        """Decide ``wl`` and set our checks' state on it; the state set, or None if unchanged."""
        ours = self._ours(wl)
        if not ours or _admitted(wl):
            return None
        wl = {**wl, "kind": "Workload"}
        subject = subject_of(wl, self.resources, self.prefix, claims=self.claims)
        now = datetime.now(timezone.utc)
        with self.state.lock:
            decision = decide(subject, self.state, self.policy, now, gate="admission-check", policy_version=self.policy_version)
        state = check_state(decision)
        stale = self.state.stale_note(self.stale_after_s)
        notes = (stale,) if stale else ()
        message = decision_message(subject, decision, notes)
        if all(c.get("state") == state and c.get("message") == message for c in ours):
            return None
        checks = [{**c, "state": state, "message": message, "lastTransitionTime": _now() if c.get("state") != state else c.get("lastTransitionTime")}
                  if c.get("name") in self.checks else c for c in (wl.get("status") or {}).get("admissionChecks") or []]
        meta = wl["metadata"]
        self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, meta["namespace"], "workloads", meta["name"],
                                                          {"metadata": {"resourceVersion": meta["resourceVersion"]},
                                                           "status": {"admissionChecks": checks}})
        self.counters["patched"] += 1
        self.counters["decided"] += 1
        # One hold (or one admission) is one fact, however often it is re-decided; the same state and
        # rule after an eviction is another: Kueue resets the check to Pending then, with a new
        # lastTransitionTime (producers.admission.events).
        since = max((c.get("lastTransitionTime") or "" for c in ours), default="")
        self.record(decision_event(subject, decision, now, gate="admission-check", request_id=f"{state}|{decision.rule}|{since}",
                                   operation=state, host=self.host, notes=notes))
        log.info("workload %s: check %s by rule %s", subject.workload_id, state, decision.rule)
        return state
