"""DRA GPUs of an object under admission: what its pod spec gets through ``spec.resourceClaims``.

Input: a pod spec (a Pod's, a Job's or a Kueue Workload pod set's template) and its namespace;
the API server, read for the ResourceClaims and ResourceClaimTemplates the spec names and the
DeviceClasses their requests ask for (``resource.k8s.io`` v1, v1beta2 or v1beta1, whichever it
serves first). Output: ``ClaimGpus`` — the GPU devices requested (``gpus``) and, for each claim
that could not be read, why (``unresolved``).

A request is for GPUs unless what selects its devices says otherwise. Its DeviceClass's CEL
selectors and the request's own are read together: one that names a GPU driver
(``GPULEDGER_ADMIT_DRA_DRIVERS``, the collectors' list) as a quoted string — ``device.driver ==
'gpu.nvidia.com'``, ``device.attributes['gpu.nvidia.com'].type`` — makes it a GPU request;
otherwise one that pins ``device.driver == '<another driver>'`` (a NIC's class) makes it not;
anything else (a class with no selectors: every device; one selecting by attributes only) counts
as GPU. A request with alternatives (``firstAvailable``) counts its GPU alternatives' largest
``count``; a request counts ``count`` devices (``ExactCount``, default 1) or 1 for ``All`` (at
least one: how many the node has is not known before scheduling); an ``adminAccess`` request
(monitoring devices already in use, in namespaces the cluster admin labelled for it) counts none.

Why here and not only in the scheduler collector: a pod that gets its GPU through a claim
requests no extended resource, and admission saw no GPU in it — it was let through unchecked
(control 1 caught it after the fact). Admission decides before anything runs, so a claim it
cannot read (no API access, the claim not created yet, the API server not answering, a shape
it does not know) counts as one GPU and is named in the answer's warnings: an unreadable
claim is treated as GPU work — as the scheduler collector treats every claim — rather than
let a GPU pod through for want of a lookup.

Time: the API server waits 5 s for the webhook, then applies its failure policy (outside prod:
let the pod in, unchecked). So an object's lookups share one budget (``BUDGET_S``), each call
is bounded by what is left of it and retried never (its own client: the Kubernetes client's
default retries made one unanswered call 8 s), a failed API discovery is not asked again for
``FAILURE_TTL_S``, and DeviceClasses are cached for ``CLASS_TTL_S``.

Limits: a claim's devices are read when the object is admitted — a ResourceClaim deleted and
created again under the same name with another class after its pod was admitted is not seen
(pods created by a Job, a Deployment or a Kueue Workload are decided one by one, each with the
claims it names then; control 1 judges what the pod then held). Extended resources backed by
DRA (``deviceclass.resource.kubernetes.io/<class>``, Kubernetes' alpha KEP-5004) are not read.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from producers._config import ResourceMatcher
from producers.kubernetes.dra import RESOURCE_GROUP, RESOURCE_VERSIONS

log = logging.getLogger(__name__)

#: Seconds a DeviceClass's verdict (GPU or not) is reused.
CLASS_TTL_S = 60.0
#: Seconds all of one object's lookups may take (the API server gives the webhook 5), each call
#: at most ``CALL_TIMEOUT_S`` of it.
BUDGET_S = 3.0
CALL_TIMEOUT_S = 1.5
#: Seconds a failed API discovery is not asked again (every claim of every object would).
FAILURE_TTL_S = 5.0
#: Seconds the served resource.k8s.io version is reused (an upgrade may drop it).
VERSION_TTL_S = 600.0
_QUOTED = re.compile(r"""['"]([^'"]+)['"]""")
_PINNED = re.compile(r"""device\.driver\s*==\s*['"]([^'"]+)['"]""")


@dataclass(frozen=True)
class ClaimGpus:
    """GPU devices a pod spec's claims request, and the claims that could not be read (why)."""

    gpus: int = 0
    unresolved: tuple[str, ...] = field(default=())


def claim_refs(pod_spec: Mapping | None) -> list[tuple[str, str, str]]:
    """(entry name, ``resourceclaims`` | ``resourceclaimtemplates``, object name) of each
    ``spec.resourceClaims`` entry; one naming neither (an older Kubernetes' ``source:`` shape)
    has resource ``""`` (it cannot be read: it counts as a GPU)."""
    out = []
    for entry in (pod_spec or {}).get("resourceClaims") or []:
        if not isinstance(entry, Mapping):
            continue
        name = str(entry.get("name") or "")
        if entry.get("resourceClaimName"):
            out.append((name, "resourceclaims", str(entry["resourceClaimName"])))
        elif entry.get("resourceClaimTemplateName"):
            out.append((name, "resourceclaimtemplates", str(entry["resourceClaimTemplateName"])))
        else:
            out.append((name, "", ""))
    return out


@dataclass(frozen=True)
class Alternative:
    """One way a device request may be met: a device class, how many devices, the request's own
    CEL selectors, and whether it is admin access."""

    device_class: str
    count: int
    selectors: tuple[str, ...] = ()
    admin: bool = False


def device_requests(claim_spec: Mapping | None) -> list[list[Alternative]]:
    """Each device request of a ResourceClaim's spec as its alternatives (one, or those of
    ``firstAvailable``), in v1/v1beta2 (``exactly``) and v1beta1 (on the request itself) shape.
    ValueError for a request naming no device class."""
    out = []
    for request in ((claim_spec or {}).get("devices") or {}).get("requests") or []:
        options = request.get("firstAvailable") or [request.get("exactly") or request]
        alternatives = []
        for option in options:
            name = option.get("deviceClassName")
            if not name:
                raise ValueError(f"device request {request.get('name')!r} names no deviceClassName")
            count = int(option.get("count") or 1) if option.get("allocationMode", "ExactCount") == "ExactCount" else 1
            alternatives.append(Alternative(str(name), count, _expressions(option.get("selectors")), bool(option.get("adminAccess"))))
        out.append(alternatives)
    return out


def selects_gpus(expressions: Iterable[str], drivers: ResourceMatcher) -> bool:
    """Whether devices selected by these CEL expressions (a class's and a request's) may be GPUs:
    one names a GPU driver, or none pins ``device.driver`` to another (see the module docstring)."""
    expressions = list(expressions)
    if any(drivers(text) for expression in expressions for text in _QUOTED.findall(expression)):
        return True
    return not any(_PINNED.search(expression) for expression in expressions)


def _expressions(selectors) -> tuple[str, ...]:
    """The CEL expressions of a list of device selectors (a DeviceClass's or a request's)."""
    return tuple(((sel or {}).get("cel") or {}).get("expression") or "" for sel in selectors or [])


def class_selectors(device_class: Mapping) -> tuple[str, ...]:
    return _expressions((device_class.get("spec") or {}).get("selectors"))


def class_is_gpu(device_class: Mapping, drivers: ResourceMatcher) -> bool:
    """Whether a DeviceClass (its selectors alone) may select GPUs (``selects_gpus``)."""
    return selects_gpus(class_selectors(device_class), drivers)


class ClaimReader:
    """Reads the DRA claims of pod specs from the API server (``api_client``: a
    ``kubernetes.client.ApiClient``, whose configuration is copied without retries; None: every
    claim is unresolved). Called from the webhook's worker threads and the controller's thread."""

    def __init__(self, api_client, drivers: ResourceMatcher, budget_s: float = BUDGET_S) -> None:
        self.drivers = drivers
        self.budget_s = budget_s
        self._custom = self._apis = None
        self._version: tuple[float, str] | None = None  # (when, version)
        self._discovery_failed: tuple[float, str] | None = None  # (when, why)
        if api_client is not None:
            import copy

            from kubernetes import client as k8s

            conf = copy.deepcopy(api_client.configuration)
            conf.retries = False  # one attempt per call: the request's budget bounds them all (module docstring)
            client = k8s.ApiClient(conf)
            self._custom, self._apis = k8s.CustomObjectsApi(client), k8s.ApisApi(client)
        self._classes: dict[str, tuple[float, tuple[str, ...]]] = {}  # class -> (when, its selectors)
        self._lock = threading.Lock()
        self.lookups = 0
        self.unresolved = 0

    def __call__(self, namespace: str, pod_spec: Mapping | None) -> ClaimGpus:
        refs = claim_refs(pod_spec)
        if not refs:
            return ClaimGpus()
        deadline = time.monotonic() + self.budget_s
        gpus, unresolved = 0, []
        for entry, resource, name in refs:
            try:
                gpus += self._claim_gpus(namespace, resource, name, deadline)
            except Exception as exc:  # noqa: BLE001 - whatever failed, the claim counts as a GPU (see the module docstring)
                gpus += 1
                what = f"{resource[:-1]} {namespace}/{name}" if resource else "naming neither resourceClaimName nor resourceClaimTemplateName"
                unresolved.append(f"DRA claim {entry!r} ({what}) could not be read, so it counts as a GPU: {_reason(exc)}")
        with self._lock:
            self.unresolved += len(unresolved)
        return ClaimGpus(gpus, tuple(unresolved))

    def _timeout(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left < 0.05:
            raise LookupError(f"out of time (the object's claims may take {self.budget_s:g} s in all)")
        return min(CALL_TIMEOUT_S, left)

    def _claim_gpus(self, namespace: str, resource: str, name: str, deadline: float) -> int:
        if not resource:
            raise LookupError("an entry of a shape gpuledger does not read")
        if self._custom is None:
            raise LookupError("gpuledger admit has no API access (GPULEDGER_ADMIT_CLAIMS_IN_CLUSTER, GPULEDGER_ADMIT_IN_CLUSTER or "
                              "GPULEDGER_ADMIT_KUBECONFIG)")
        version = self._served(deadline)
        with self._lock:
            self.lookups += 1
        obj = self._custom.get_namespaced_custom_object(RESOURCE_GROUP, version, namespace, resource, name,
                                                        _request_timeout=self._timeout(deadline))
        spec = obj.get("spec") or {}
        if resource == "resourceclaimtemplates":
            spec = spec.get("spec") or {}
        total = 0
        for alternatives in device_requests(spec):
            gpu = [alt.count for alt in alternatives
                   if not alt.admin and selects_gpus((*self._class(alt.device_class, version, deadline), *alt.selectors), self.drivers)]
            total += max(gpu, default=0)
        return total

    def _class(self, device_class: str, version: str, deadline: float) -> tuple[str, ...]:
        now = time.monotonic()
        with self._lock:
            cached = self._classes.get(device_class)
        if cached is not None and now - cached[0] < CLASS_TTL_S:
            return cached[1]
        obj = self._custom.get_cluster_custom_object(RESOURCE_GROUP, version, "deviceclasses", device_class,
                                                     _request_timeout=self._timeout(deadline))
        selectors = class_selectors(obj)
        with self._lock:
            self._classes[device_class] = (now, selectors)
        return selectors

    def _served(self, deadline: float) -> str:
        now = time.monotonic()
        with self._lock:
            version, failed = self._version, self._discovery_failed
        if version is not None and now - version[0] < VERSION_TTL_S:
            return version[1]
        if failed is not None and now - failed[0] < FAILURE_TTL_S:
            raise LookupError(f"the API server's resource groups could not be read {now - failed[0]:.0f} s ago ({failed[1]})")
        try:
            groups = self._apis.get_api_versions(_request_timeout=self._timeout(deadline))
        except Exception as exc:
            with self._lock:
                self._discovery_failed = (now, _reason(exc))
            raise
        served = {g.name: [v.version for v in g.versions or []] for g in groups.groups or []}
        found = next((v for v in RESOURCE_VERSIONS if v in served.get(RESOURCE_GROUP, [])), None)
        if found is None:
            raise LookupError(f"the API server serves no {RESOURCE_GROUP} version gpuledger reads ({', '.join(RESOURCE_VERSIONS)})")
        with self._lock:
            self._version, self._discovery_failed = (now, found), None
        return found


def _reason(exc: BaseException) -> str:
    """A short reason (the API server's status, else the error's type and first words: urllib3's
    retry errors run to hundreds of characters, and the API server shows warnings to users)."""
    status = getattr(exc, "status", None)
    if status is not None:
        return f"the API server answered {status} {getattr(exc, 'reason', '') or ''}".strip()
    if isinstance(exc, LookupError):
        return str(exc)
    text = str(exc)
    return f"{type(exc).__name__}: {text[:120]}{'…' if len(text) > 120 else ''}"
