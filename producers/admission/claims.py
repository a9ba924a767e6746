"""DRA GPUs of an object under admission: what its pod spec gets through ``spec.resourceClaims``.

Input: a pod spec (a Pod's, a Job's or a Kueue Workload pod set's template) and its namespace;
the API server, read for the ResourceClaims and ResourceClaimTemplates the spec names and the
DeviceClasses their requests ask for (``resource.k8s.io`` v1, v1beta2 or v1beta1, whichever it
serves first). Output: ``ClaimGpus`` — the GPU devices requested (``gpus``) and, for each claim
that could not be read, why (``unresolved``).

A request is for GPUs when its DeviceClass names a GPU driver (``GPULEDGER_ADMIT_DRA_DRIVERS``,
the collectors' list) in one of its CEL selectors — as a quoted string: ``device.driver ==
'gpu.nvidia.com'``, ``device.attributes['gpu.nvidia.com'].type`` — which is how drivers ship
their classes; a request with alternatives (``firstAvailable``) is for GPUs when one of them is.
It counts ``count`` devices (``ExactCount``, default 1) or 1 for ``All`` (at least one: how
many the node has is not known before scheduling).

Why here and not only in the scheduler collector: a pod that gets its GPU through a claim
requests no extended resource, and admission saw no GPU in it — it was let through unchecked
(control 1 caught it after the fact). Admission decides before anything runs, so a claim it
cannot read (no API access, the claim not created yet, the API server not answering, a shape
it does not know) counts as one GPU and is named in the answer's warnings: an unreadable
claim is treated as GPU work — as the scheduler collector treats every claim — rather than
let a GPU pod through for want of a lookup.

Limits: a claim's or template's devices are read when the object is admitted; a claim changed
afterwards is not seen again. DeviceClasses are cached for ``CLASS_TTL_S``.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from producers._config import ResourceMatcher
from producers.kubernetes.dra import RESOURCE_GROUP, RESOURCE_VERSIONS

log = logging.getLogger(__name__)

#: Seconds a DeviceClass's verdict (GPU or not) is reused.
CLASS_TTL_S = 60.0
_QUOTED = re.compile(r"""['"]([^'"]+)['"]""")


@dataclass(frozen=True)
class ClaimGpus:
    """GPU devices a pod spec's claims request, and the claims that could not be read (why)."""

    gpus: int = 0
    unresolved: tuple[str, ...] = field(default=())


def claim_refs(pod_spec: Mapping | None) -> list[tuple[str, str, str]]:
    """(entry name, ``resourceclaims`` | ``resourceclaimtemplates``, object name) of each
    ``spec.resourceClaims`` entry; an entry naming neither is skipped."""
    out = []
    for entry in (pod_spec or {}).get("resourceClaims") or []:
        if not isinstance(entry, Mapping):
            continue
        if entry.get("resourceClaimName"):
            out.append((str(entry.get("name") or ""), "resourceclaims", str(entry["resourceClaimName"])))
        elif entry.get("resourceClaimTemplateName"):
            out.append((str(entry.get("name") or ""), "resourceclaimtemplates", str(entry["resourceClaimTemplateName"])))
    return out


def device_requests(claim_spec: Mapping | None) -> list[tuple[tuple[str, ...], int]]:
    """Each device request of a ResourceClaim's spec as (its device class names — one, or the
    alternatives of ``firstAvailable`` — and how many devices it counts), in v1/v1beta2
    (``exactly``) and v1beta1 (on the request itself) shape. ValueError for a request naming
    no device class."""
    out = []
    for request in ((claim_spec or {}).get("devices") or {}).get("requests") or []:
        options = request.get("firstAvailable") or [request.get("exactly") or request]
        classes, count = [], 0
        for option in options:
            name = option.get("deviceClassName")
            if not name:
                raise ValueError(f"device request {request.get('name')!r} names no deviceClassName")
            classes.append(str(name))
            count = max(count, int(option.get("count") or 1) if option.get("allocationMode", "ExactCount") == "ExactCount" else 1)
        out.append((tuple(classes), count))
    return out


def class_is_gpu(device_class: Mapping, drivers: ResourceMatcher) -> bool:
    """Whether a DeviceClass selects devices of a GPU driver: one of its CEL selectors names one."""
    for selector in (device_class.get("spec") or {}).get("selectors") or []:
        expression = ((selector or {}).get("cel") or {}).get("expression") or ""
        if any(drivers(text) for text in _QUOTED.findall(expression)):
            return True
    return False


class ClaimReader:
    """Reads the DRA claims of pod specs from the API server (``api_client``: a
    ``kubernetes.client.ApiClient``; None: every claim is unresolved)."""

    def __init__(self, api_client, drivers: ResourceMatcher, timeout_s: float = 2.0) -> None:
        self.drivers = drivers
        self.timeout_s = timeout_s
        self._custom = None
        self._version: str | None = None
        if api_client is not None:
            from kubernetes import client as k8s

            self._custom = k8s.CustomObjectsApi(api_client)
            self._apis = k8s.ApisApi(api_client)
        self._classes: dict[str, tuple[float, bool]] = {}
        self._lock = threading.Lock()
        self.lookups = 0
        self.unresolved = 0

    def __call__(self, namespace: str, pod_spec: Mapping | None) -> ClaimGpus:
        refs = claim_refs(pod_spec)
        if not refs:
            return ClaimGpus()
        gpus, unresolved = 0, []
        for entry, resource, name in refs:
            try:
                gpus += self._claim_gpus(namespace, resource, name)
            except Exception as exc:  # noqa: BLE001 - whatever failed, the claim counts as a GPU (see the module docstring)
                gpus += 1
                unresolved.append(f"DRA claim {entry!r} ({resource[:-1]} {namespace}/{name}) could not be read, so it counts as a GPU: "
                                  f"{_reason(exc)}")
        self.unresolved += len(unresolved)
        return ClaimGpus(gpus, tuple(unresolved))

    def _claim_gpus(self, namespace: str, resource: str, name: str) -> int:
        if self._custom is None:
            raise LookupError("gpuledger admit has no API access (GPULEDGER_ADMIT_CLAIMS_IN_CLUSTER, GPULEDGER_ADMIT_IN_CLUSTER or GPULEDGER_ADMIT_KUBECONFIG)")
        version = self._served()
        self.lookups += 1
        obj = self._custom.get_namespaced_custom_object(RESOURCE_GROUP, version, namespace, resource, name, _request_timeout=self.timeout_s)
        spec = obj.get("spec") or {}
        if resource == "resourceclaimtemplates":
            spec = spec.get("spec") or {}
        return sum(count for classes, count in device_requests(spec) if any(self._is_gpu(c, version) for c in classes))

    def _is_gpu(self, device_class: str, version: str) -> bool:
        now = time.monotonic()
        with self._lock:
            cached = self._classes.get(device_class)
        if cached is not None and now - cached[0] < CLASS_TTL_S:
            return cached[1]
        obj = self._custom.get_cluster_custom_object(RESOURCE_GROUP, version, "deviceclasses", device_class, _request_timeout=self.timeout_s)
        verdict = class_is_gpu(obj, self.drivers)
        with self._lock:
            self._classes[device_class] = (now, verdict)
        return verdict

    def _served(self) -> str:
        if self._version is None:
            groups = self._apis.get_api_versions(_request_timeout=self.timeout_s)
            served = {g.name: [v.version for v in g.versions or []] for g in groups.groups or []}
            version = next((v for v in RESOURCE_VERSIONS if v in served.get(RESOURCE_GROUP, [])), None)
            if version is None:
                raise LookupError(f"the API server serves no {RESOURCE_GROUP} version gpuledger reads ({', '.join(RESOURCE_VERSIONS)})")
            self._version = version
        return self._version


def _reason(exc: BaseException) -> str:
    status = getattr(exc, "status", None)
    if status is not None:
        return f"the API server answered {status} {getattr(exc, 'reason', '') or ''}".strip()
    return f"{type(exc).__name__}: {exc}" if not isinstance(exc, LookupError) else str(exc)
