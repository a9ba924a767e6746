"""FakeKubeApi: an in-process stand-in for the Kubernetes API server's read path.

Used by the cluster simulator (``gpuledger.sim.cluster``, ``gpuledger exercise``)
as the cluster's API server, and by the tests (``tests/fixtures/kube_api.py``
re-exports it, with a pytest fixture). It speaks the real HTTP/JSON wire protocol
on 127.0.0.1 (a free port), so the official ``kubernetes`` Python client —
configured with ``Configuration(host=api.url)`` or a kubeconfig naming that URL,
as the scheduler collector is — lists and watches against it exactly as it
would against a cluster::

    with FakeKubeApi(kueue_versions=("v1beta2",)) as api:
        api.create(PODS, make_pod("ml", "train-0", node="gpu-1"))
        v1 = kubernetes.client.CoreV1Api(api.api_client())
        pods = v1.list_pod_for_all_namespaces()

What it emulates
----------------
* Discovery: ``/api``, ``/api/v1``, ``/apis`` (APIGroupList), ``/apis/<group>``,
  ``/apis/<group>/<version>`` (APIResourceList) and ``/version``. Kueue is a
  CRD, so ``kueue_versions`` decides which ``kueue.x-k8s.io`` versions are
  served; with none, the group is absent from ``/apis`` and every kueue path
  answers 404 like a cluster without Kueue installed.
* GET list (cluster-wide and namespaced) and GET of a single object for core
  Pods/Events/Nodes, ``events.k8s.io/v1`` Events and Kueue Workloads (plus
  empty, listable ClusterQueues/LocalQueues/ResourceFlavors/
  WorkloadPriorityClasses so discovery looks like a real Kueue install).
  ``labelSelector`` (=, ==, !=, in, notin, exists, !exists), a per-resource
  allow-list of ``fieldSelector`` fields (=, ==, !=; unknown fields are
  ignored, whereas a real server answers 400), ``limit``/``continue`` with a
  consistent snapshot behind an opaque token.
* Watch (``watch=true``): chunked newline-delimited JSON events, replay of
  history after ``resourceVersion``, synthetic ADDED events when
  ``resourceVersion`` is unset or "0", ``sendInitialEvents``, BOOKMARK events
  (on demand via ``send_bookmark`` and/or every ``bookmark_interval``
  seconds), ``timeoutSeconds``, selector transitions (an object that stops
  matching a selector is reported as DELETED, one that starts matching as
  ADDED), and the 410 "too old resource version" ERROR event after
  ``compact()``.
* Faults: ``fail_next`` (HTTP error Status responses), ``drop_watches``
  (abrupt TCP close or clean end of every open watch stream).
* A request log for assertions (``requests``).

What it does NOT emulate
------------------------
* Writes over HTTP (POST/PUT/PATCH/DELETE answer 405): tests and the simulator
  mutate state through the Python methods ``create``/``update``/``patch``/``delete``.
* Authn/authz, TLS, admission, defaulting, validation, protobuf, Table output,
  subresources (``/status``, ``/log``), legacy ``/watch/`` paths.
* Multi-version storage: core/v1 and events.k8s.io/v1 Events, and Kueue
  v1beta1 and v1beta2 Workloads, are separate stores here, whereas a real
  cluster serves one storage in several versions. Put objects into the
  version(s) the test wants the client to see.
* List ``resourceVersion``/``resourceVersionMatch`` (lists are always served
  from the latest state) and "too large resource version" waits.

Object builders (``make_pod``, ``make_event_v1``, ``make_core_event``,
``make_workload``, ``make_node`` and their small helpers) produce JSON shaped
like what the API server returns, with RFC 3339 timestamps the client can
deserialize into its models.
"""

from __future__ import annotations

import base64
import bisect
import copy
import hashlib
import http
import json
import re
import select
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Mapping, Sequence
from urllib.parse import parse_qs, urlsplit

from gpuledger.timefmt import iso_z, parse_time


# --------------------------------------------------------------------------
# Resource registry
# --------------------------------------------------------------------------

KUEUE_GROUP = "kueue.x-k8s.io"
EVENTS_GROUP = "events.k8s.io"
RESOURCE_GROUP = "resource.k8s.io"  # DRA: ResourceSlices (served as v1, Kubernetes 1.34)

_POD_FIELDS = frozenset({
    "metadata.name", "metadata.namespace", "spec.nodeName", "spec.restartPolicy",
    "spec.schedulerName", "spec.serviceAccountName", "spec.hostNetwork",
    "status.phase", "status.podIP", "status.nominatedNodeName",
})
_CORE_EVENT_FIELDS = frozenset({
    "metadata.name", "metadata.namespace", "involvedObject.kind",
    "involvedObject.namespace", "involvedObject.name", "involvedObject.uid",
    "involvedObject.apiVersion", "involvedObject.resourceVersion",
    "involvedObject.fieldPath", "reason", "reportingComponent", "source", "type",
})
# events.k8s.io/v1 shares storage with core Events; the API server converts
# its field labels (regarding.* / reportingController) to the core ones.
_EVENT_V1_FIELD_ALIASES = {
    **{f"involvedObject.{k}": f"regarding.{k}" for k in
       ("kind", "namespace", "name", "uid", "apiVersion", "resourceVersion", "fieldPath")},
    "reportingComponent": "reportingController",
    "source": "deprecatedSource.component",
}
_EVENT_V1_FIELDS = frozenset(
    {"metadata.name", "metadata.namespace", "reason", "type"}
    | set(_EVENT_V1_FIELD_ALIASES) | set(_EVENT_V1_FIELD_ALIASES.values())
)
_NODE_FIELDS = frozenset({"metadata.name", "spec.unschedulable"})
_CR_FIELDS = frozenset({"metadata.name", "metadata.namespace"})

_ALL_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


@dataclass(frozen=True)
class ResourceType:
    """One served group/version/resource."""

    group: str  # "" for the core group
    version: str
    plural: str
    kind: str
    singular: str
    namespaced: bool
    field_selectors: frozenset = _CR_FIELDS
    field_aliases: Mapping[str, str] = field(default_factory=dict)
    short_names: tuple[str, ...] = ()
    # Built-in types drop kind/apiVersion from list items; CRs keep them.
    builtin: bool = True

    @property
    def key(self) -> str:
        return f"{self.group}/{self.version}/{self.plural}" if self.group else f"{self.version}/{self.plural}"

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


def _kueue_types(version: str) -> list[ResourceType]:
    def rt(plural, kind, singular, namespaced, short=()):
        return ResourceType(KUEUE_GROUP, version, plural, kind, singular, namespaced,
                            short_names=short, builtin=False)
    return [
        rt("workloads", "Workload", "workload", True, ("wl",)),
        rt("clusterqueues", "ClusterQueue", "clusterqueue", False, ("cq",)),
        rt("localqueues", "LocalQueue", "localqueue", True, ("lq", "queue", "queues")),
        rt("resourceflavors", "ResourceFlavor", "resourceflavor", False, ("flavor", "flavors", "rf")),
        rt("workloadpriorityclasses", "WorkloadPriorityClass", "workloadpriorityclass", False),
    ]


KUEUE_VERSIONS_KNOWN = ("v1beta2", "v1beta1")

RESOURCE_TYPES: dict[str, ResourceType] = {
    t.key: t for t in [
        ResourceType("", "v1", "pods", "Pod", "pod", True, _POD_FIELDS, short_names=("po",)),
        ResourceType("", "v1", "events", "Event", "event", True, _CORE_EVENT_FIELDS, short_names=("ev",)),
        ResourceType("", "v1", "nodes", "Node", "node", False, _NODE_FIELDS, short_names=("no",)),
        ResourceType(EVENTS_GROUP, "v1", "events", "Event", "event", True, _EVENT_V1_FIELDS,
                     field_aliases=_EVENT_V1_FIELD_ALIASES, short_names=("ev",)),
        *[t for v in KUEUE_VERSIONS_KNOWN for t in _kueue_types(v)],
        ResourceType(RESOURCE_GROUP, "v1", "resourceslices", "ResourceSlice", "resourceslice", False),
        ResourceType(RESOURCE_GROUP, "v1", "resourceclaims", "ResourceClaim", "resourceclaim", True),
    ]
}

# Resource keys accepted by create/update/patch/delete/get/list_objects.
PODS = "v1/pods"
CORE_EVENTS = "v1/events"
NODES = "v1/nodes"
EVENTS = "events.k8s.io/v1/events"
WORKLOADS_V1BETA2 = "kueue.x-k8s.io/v1beta2/workloads"
WORKLOADS_V1BETA1 = "kueue.x-k8s.io/v1beta1/workloads"
RESOURCE_SLICES = "resource.k8s.io/v1/resourceslices"
RESOURCE_CLAIMS = "resource.k8s.io/v1/resourceclaims"


def workloads(version: str = "v1beta2") -> str:
    """Resource key of Kueue Workloads in ``version``."""
    return f"{KUEUE_GROUP}/{version}/workloads"


# --------------------------------------------------------------------------
# Time helpers
# --------------------------------------------------------------------------

def rfc3339(t: datetime | str | None = None) -> str:
    """metav1.Time wire format: second precision, UTC, 'Z' suffix."""
    if isinstance(t, str):
        return t
    return iso_z(t or datetime.now(timezone.utc), 0)


def rfc3339_micro(t: datetime | str | None = None) -> str:
    """metav1.MicroTime wire format (events.k8s.io eventTime): 6 fractional digits."""
    if isinstance(t, str):
        return t
    return iso_z(t or datetime.now(timezone.utc), 6)


def _as_datetime(t: datetime | str | None) -> datetime:
    if t is None:
        return datetime.now(timezone.utc)
    if isinstance(t, str):
        return parse_time(t)
    return t


def _new_uid() -> str:
    return str(uuid.uuid4())


# --------------------------------------------------------------------------
# Selectors
# --------------------------------------------------------------------------

_SET_TERM = re.compile(r"^\s*([^\s!=(),]+)\s+(in|notin)\s+\(([^()]*)\)\s*$")
_EQ_TERM = re.compile(r"^\s*([^\s!=(),]+)\s*(==|=|!=)\s*([^\s!=(),]*)\s*$")
_EXISTS_TERM = re.compile(r"^\s*(!?)\s*([^\s!=(),]+)\s*$")


def _split_terms(selector: str) -> list[str]:
    """Split on commas that are not inside an ``in (a,b)`` value list."""
    terms, depth, cur = [], 0, []
    for ch in selector:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            terms.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    terms.append("".join(cur))
    return [t for t in terms if t.strip()]


def parse_label_selector(selector: str | None) -> Callable[[Mapping[str, str]], bool]:
    """Compile a label selector string; raises ValueError on bad syntax."""
    preds: list[Callable[[Mapping[str, str]], bool]] = []
    for term in _split_terms(selector or ""):
        if m := _SET_TERM.match(term):
            key, op, vals = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            if op == "in":
                preds.append(lambda l, k=key, vs=vals: k in l and l[k] in vs)
            else:
                preds.append(lambda l, k=key, vs=vals: k not in l or l[k] not in vs)
        elif m := _EQ_TERM.match(term):
            key, op, val = m.groups()
            if op == "!=":
                preds.append(lambda l, k=key, v=val: l.get(k) != v)
            else:
                preds.append(lambda l, k=key, v=val: k in l and l[k] == v)
        elif m := _EXISTS_TERM.match(term):
            neg, key = m.groups()
            preds.append((lambda l, k=key: k not in l) if neg else (lambda l, k=key: k in l))
        else:
            raise ValueError(f"unable to parse requirement: {term!r}")
    return lambda labels: all(p(labels) for p in preds)


def _dotted(obj: Any, path: str) -> str:
    """Field value as the API server's field label sets render it (missing -> "")."""
    cur = obj
    for part in path.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return ""
        cur = cur[part]
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return "" if cur is None else str(cur)


def parse_field_selector(selector: str | None, rt: ResourceType) -> Callable[[Mapping], bool]:
    """Compile a field selector; unsupported fields are ignored (see module doc)."""
    preds: list[Callable[[Mapping], bool]] = []
    for term in _split_terms(selector or ""):
        m = _EQ_TERM.match(term)
        if not m:
            raise ValueError(f"invalid field selector term: {term!r}")
        fld, op, val = m.groups()
        if fld not in rt.field_selectors:
            continue
        path = rt.field_aliases.get(fld, fld)
        if op == "!=":
            preds.append(lambda o, p=path, v=val: _dotted(o, p) != v)
        else:
            preds.append(lambda o, p=path, v=val: _dotted(o, p) == v)
    return lambda obj: all(p(obj) for p in preds)


# --------------------------------------------------------------------------
# Status bodies
# --------------------------------------------------------------------------

_STATUS_REASONS = {
    400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
    405: "MethodNotAllowed", 409: "Conflict", 410: "Expired", 422: "Invalid",
    429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable",
    504: "Timeout",
}
_STATUS_MESSAGES = {
    429: "Too many requests, please try again later.",
    500: "Internal error occurred: injected failure",
    503: "the server is currently unable to handle the request",
    504: "Timeout: request did not complete within the allotted timeout",
}


def status_body(code: int, message: str | None = None, reason: str | None = None,
                details: Mapping[str, Any] | None = None) -> dict:
    """A metav1.Status failure object, as the API server sends for errors."""
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message or _STATUS_MESSAGES.get(code) or http.HTTPStatus(code).phrase,
        "reason": reason or _STATUS_REASONS.get(code, "Unknown"),
        "code": code,
    }
    if details is not None:
        body["details"] = dict(details)
    return body


class _HttpError(Exception):
    def __init__(self, code: int, message: str | None = None, reason: str | None = None,
                 details: Mapping[str, Any] | None = None):
        super().__init__(message)
        self.body = status_body(code, message, reason, details)


def _not_found_path() -> _HttpError:
    # What the real server's NotFound handler answers for unknown URLs.
    return _HttpError(404, "the server could not find the requested resource", details={})


# --------------------------------------------------------------------------
# Store records
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class RecordedRequest:
    """One HTTP request seen by the double (query keeps the first value per key)."""

    method: str
    path: str
    query: dict[str, str]

    @property
    def is_watch(self) -> bool:
        return _truthy(self.query.get("watch"))


@dataclass(frozen=True)
class WatchEvent:
    """One entry of the change history (what ``watch`` replays)."""

    rv: int
    resource: str
    type: str  # ADDED | MODIFIED | DELETED
    object: dict
    previous: dict | None  # state before a MODIFIED/DELETED; drives selector transitions


@dataclass(frozen=True)
class _Failure:
    code: int
    message: str | None
    reason: str | None
    path: str | None
    retry_after: int | None


class _WatchSession:
    def __init__(self, resource: str, namespace: str | None):
        self.resource = resource
        self.namespace = namespace
        self.bookmark_requested = False
        self.drop: str | None = None  # None | "abrupt" | "graceful"


def _truthy(v: str | None) -> bool:
    return (v or "").lower() in ("1", "true", "yes")


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _json_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 merge patch (None deletes a key)."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for k, v in patch.items():
        if v is None:
            result.pop(k, None)
        else:
            result[k] = _json_merge_patch(result.get(k), v)
    return result


# --------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------

#: A label value as the API server validates it (k8s.io/apimachinery/pkg/util/validation
#: IsValidLabelValue): at most 63 characters, alphanumerics and ``-_.``, alphanumeric at both ends.
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


def _check_labels(obj: Mapping) -> None:
    """Refuse label values the real API server refuses (a pod template's labels too), with its message.

    The real one answers 422 for e.g. ``gpuledger.io/release-id: fraud-detector:7`` (found by the
    real-cluster tier: this double used to take it)."""
    template = ((obj.get("spec") or {}).get("template") or {}).get("metadata") or {}
    problems = []
    for where, labels in (("metadata.labels", (obj.get("metadata") or {}).get("labels")), ("spec.template.labels", template.get("labels"))):
        for value in (labels or {}).values():
            if len(str(value)) > 63:
                problems.append(f"{where}: Invalid value: {value!r}: must be no more than 63 characters")
            elif not _LABEL_VALUE.fullmatch(str(value)):
                problems.append(f"{where}: Invalid value: {value!r}: a valid label must be an empty string or consist of alphanumeric "
                                "characters, '-', '_' or '.', and must start and end with an alphanumeric character")
    if problems:
        raise ValueError("; ".join(problems))


class FakeKubeApi:
    """Kubernetes API server double (read/list/watch over HTTP, writes in-process).

    Args:
        kueue_versions: kueue.x-k8s.io versions to serve, preferred first;
            empty means the Kueue CRDs are not installed.
        initial_resource_version: first resourceVersion. Real clusters never
            hand out "0" (it means "any" to a watch), so start well above it.
        default_watch_timeout: seconds a watch without timeoutSeconds stays
            open (the real server picks 30-60 min; tests want short).
        bookmark_interval: if set, watches that allowed bookmarks get a
            BOOKMARK every this many seconds (the real server sends ~1/min).
    """

    def __init__(
        self,
        kueue_versions: Sequence[str] = ("v1beta2", "v1beta1"),
        *,
        initial_resource_version: int = 1000,
        default_watch_timeout: float = 30.0,
        bookmark_interval: float | None = None,
        server_version: tuple[str, str] = ("1", "34"),
    ):
        self.default_watch_timeout = default_watch_timeout
        self.bookmark_interval = bookmark_interval
        self.server_version = server_version
        self._kueue_versions: tuple[str, ...] = ()
        self.set_kueue_versions(kueue_versions)
        #: (group, version, plural) of resources whose version is not served while the group's is
        #: (a CRD version with served: false, the CRD's other kinds still served at it).
        self._unserved: set[tuple[str, str, str]] = set()

        self._cond = threading.Condition(threading.RLock())
        self._objects: dict[tuple[str, str, str], dict] = {}
        self._history: list[WatchEvent] = []
        self._history_rvs: list[int] = []
        self._rv = initial_resource_version
        # Watches from a resourceVersion below this get 410 Expired.
        self._compacted_rv = initial_resource_version
        self._snapshots: dict[str, tuple[int, list[dict]]] = {}
        self._sessions: set[_WatchSession] = set()
        self._failures: list[_Failure] = []
        self._requests: list[RecordedRequest] = []
        self._stopping = False

        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[socket.socket] = set()

    # ------------------------------------------------------------ lifecycle

    def start(self) -> "FakeKubeApi":
        if self._server is not None:
            return self
        self._stopping = False
        self._server = _Server(("127.0.0.1", 0), _make_handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fake-kube-api", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._server.shutdown()
        # Keep-alive connections park handler threads in readline(); closing
        # the sockets releases them (and ends any watch still writing).
        with self._cond:
            conns = list(self._connections)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._server.server_close()
        if self._thread:
            self._thread.join(timeout=5)
        self._server = None
        self._thread = None

    def __enter__(self) -> "FakeKubeApi":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("FakeKubeApi not started")
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client_configuration(self):
        """A ``kubernetes.client.Configuration`` pointing at this server."""
        from kubernetes import client

        # Plain defaults on purpose: code under test should see the client as
        # it is configured in production.
        return client.Configuration(host=self.url)

    def api_client(self):
        """A ``kubernetes.client.ApiClient`` bound to this server."""
        from kubernetes import client

        return client.ApiClient(self.client_configuration())

    # ------------------------------------------------------------ config

    @property
    def kueue_versions(self) -> tuple[str, ...]:
        return self._kueue_versions

    def set_kueue_versions(self, versions: Sequence[str]) -> None:
        """Install/uninstall Kueue CRD versions at runtime (preferred first)."""
        unknown = set(versions) - set(KUEUE_VERSIONS_KNOWN)
        if unknown:
            raise ValueError(f"unknown kueue versions: {sorted(unknown)}")
        self._kueue_versions = tuple(versions)

    def set_served(self, group: str, version: str, plural: str, served: bool) -> None:
        """Serve or stop serving one resource at one version while its group keeps listing the
        version (as `served: false` on one CRD's version does: Workloads at v1beta1 only, the
        other Kueue kinds still at v1beta2)."""
        (self._unserved.discard if served else self._unserved.add)((group, version, plural))

    def _served(self, rt: ResourceType) -> bool:
        if (rt.group, rt.version, rt.plural) in self._unserved:
            return False
        return rt.group != KUEUE_GROUP or rt.version in self._kueue_versions

    # ------------------------------------------------------------ store

    @property
    def resource_version(self) -> str:
        """Current global resourceVersion."""
        with self._cond:
            return str(self._rv)

    @staticmethod
    def _type(resource: str) -> ResourceType:
        try:
            return RESOURCE_TYPES[resource]
        except KeyError:
            raise KeyError(f"unknown resource {resource!r}; known: {sorted(RESOURCE_TYPES)}") from None

    @staticmethod
    def _key(rt: ResourceType, namespace: str | None, name: str) -> tuple[str, str, str]:
        return (rt.key, (namespace or "") if rt.namespaced else "", name)

    def _record(self, resource: str, type_: str, obj: dict, prev: dict | None) -> None:
        ev = WatchEvent(self._rv, resource, type_, copy.deepcopy(obj), copy.deepcopy(prev))
        self._history.append(ev)
        self._history_rvs.append(ev.rv)
        self._cond.notify_all()

    def create(self, resource: str, obj: Mapping) -> dict:
        """Store a new object (ADDED). Fills kind/apiVersion, namespace
        ("default"), uid, creationTimestamp, generation, resourceVersion.
        Label values are checked as the API server checks them (``ValueError``)."""
        rt = self._type(resource)
        obj = copy.deepcopy(dict(obj))
        obj.setdefault("kind", rt.kind)
        obj.setdefault("apiVersion", rt.api_version)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            raise ValueError("metadata.name is required")
        _check_labels(obj)
        if rt.namespaced:
            meta.setdefault("namespace", "default")
        else:
            meta.pop("namespace", None)
        meta.setdefault("uid", _new_uid())
        meta.setdefault("creationTimestamp", rfc3339())
        meta.setdefault("generation", 1)
        with self._cond:
            key = self._key(rt, meta.get("namespace"), meta["name"])
            if key in self._objects:
                raise ValueError(f'{rt.plural} "{meta["name"]}" already exists')
            self._rv += 1
            meta["resourceVersion"] = str(self._rv)
            self._objects[key] = obj
            self._record(resource, "ADDED", obj, None)
            return copy.deepcopy(obj)

    def update(self, resource: str, obj: Mapping) -> dict:
        """Replace an existing object (MODIFIED); bumps resourceVersion, keeps
        uid/creationTimestamp if omitted, bumps generation when spec changes."""
        rt = self._type(resource)
        obj = copy.deepcopy(dict(obj))
        obj.setdefault("kind", rt.kind)
        obj.setdefault("apiVersion", rt.api_version)
        meta = obj.setdefault("metadata", {})
        _check_labels(obj)
        with self._cond:
            key = self._key(rt, meta.get("namespace"), meta.get("name", ""))
            old = self._objects.get(key)
            if old is None:
                raise KeyError(f'{rt.plural} "{meta.get("name")}" not found')
            old_meta = old["metadata"]
            for k in ("uid", "creationTimestamp", "namespace"):
                if k in old_meta:
                    meta.setdefault(k, old_meta[k])
            gen = old_meta.get("generation", 1)
            meta["generation"] = gen + 1 if obj.get("spec") != old.get("spec") else gen
            self._rv += 1
            meta["resourceVersion"] = str(self._rv)
            self._objects[key] = obj
            self._record(resource, "MODIFIED", obj, old)
            return copy.deepcopy(obj)

    def patch(self, resource: str, namespace: str | None, name: str, changes: Mapping) -> dict:
        """JSON merge patch (RFC 7386) of a stored object, then ``update``."""
        rt = self._type(resource)
        with self._cond:
            cur = self._objects.get(self._key(rt, namespace, name))
            if cur is None:
                raise KeyError(f'{rt.plural} "{name}" not found')
            return self.update(resource, _json_merge_patch(cur, changes))

    def delete(self, resource: str, namespace: str | None, name: str) -> dict:
        """Remove an object (DELETED). The event carries the last state with
        a fresh resourceVersion, as the real server's does."""
        rt = self._type(resource)
        with self._cond:
            key = self._key(rt, namespace, name)
            old = self._objects.pop(key, None)
            if old is None:
                raise KeyError(f'{rt.plural} "{name}" not found')
            self._rv += 1
            gone = copy.deepcopy(old)
            gone["metadata"]["resourceVersion"] = str(self._rv)
            self._record(resource, "DELETED", gone, old)
            return copy.deepcopy(gone)

    def get(self, resource: str, namespace: str | None, name: str) -> dict | None:
        rt = self._type(resource)
        with self._cond:
            obj = self._objects.get(self._key(rt, namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def list_objects(self, resource: str, namespace: str | None = None) -> list[dict]:
        """Stored objects of ``resource`` sorted like etcd keys (namespace, name)."""
        rt = self._type(resource)
        with self._cond:
            return [copy.deepcopy(o) for (r, ns, _), o in sorted(self._objects.items())
                    if r == rt.key and (namespace is None or ns == namespace)]

    @property
    def history(self) -> list[WatchEvent]:
        """All recorded changes (including logically compacted ones)."""
        with self._cond:
            return list(self._history)

    def compact(self) -> str:
        """Forget history up to the current resourceVersion: watches that
        start from an older resourceVersion get 410 Expired, and continue
        tokens issued before now expire. Returns the compaction rv."""
        with self._cond:
            self._compacted_rv = self._rv
            # History is kept physically so that already-open watches, which
            # a real server keeps feeding, still see every event.
            return str(self._rv)

    # ------------------------------------------------------------ faults & watches

    def fail_next(self, n: int = 1, status: int = 500, *, message: str | None = None,
                  reason: str | None = None, path: str | None = None,
                  retry_after: int | None = None) -> None:
        """Answer the next ``n`` requests (whose path contains ``path``, if
        given) with an HTTP ``status`` Status body. ``retry_after`` adds a
        Retry-After header (429/503), which urllib3 honours by retrying unless
        retries are disabled."""
        with self._cond:
            self._failures.extend([_Failure(status, message, reason, path, retry_after)] * n)

    def _take_failure(self, path: str) -> _Failure | None:
        with self._cond:
            for i, f in enumerate(self._failures):
                if f.path is None or f.path in path:
                    return self._failures.pop(i)
        return None

    def send_bookmark(self, resource: str | None = None) -> None:
        """Ask every open watch on ``resource`` (all if None) that allowed
        bookmarks to emit a BOOKMARK at the current resourceVersion."""
        with self._cond:
            for s in self._sessions:
                if resource is None or s.resource == resource:
                    s.bookmark_requested = True
            self._cond.notify_all()

    def drop_watches(self, resource: str | None = None, *, graceful: bool = False) -> int:
        """Close open watch streams. ``graceful=False`` aborts the TCP
        connection mid-stream (the client sees a broken chunked response, as on
        a network hiccup or apiserver crash); ``graceful=True`` ends the stream
        cleanly, as on a server-side timeout or shutdown. Returns the number
        of streams closed."""
        with self._cond:
            hit = [s for s in self._sessions if resource is None or s.resource == resource]
            for s in hit:
                s.drop = "graceful" if graceful else "abrupt"
            self._cond.notify_all()
            return len(hit)

    def open_watches(self, resource: str | None = None) -> int:
        with self._cond:
            return sum(1 for s in self._sessions if resource is None or s.resource == resource)

    def wait_for_watches(self, count: int = 1, resource: str | None = None, timeout: float = 5.0) -> None:
        """Block until at least ``count`` watches on ``resource`` are open."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.open_watches(resource) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.open_watches(resource)} open watches, wanted {count}")
                self._cond.wait(left)

    # ------------------------------------------------------------ request log

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._cond:
            return list(self._requests)

    def requests_to(self, path: str, *, watch: bool | None = None) -> list[RecordedRequest]:
        """Logged requests whose path equals ``path`` (optionally only watches
        or only non-watches)."""
        return [r for r in self.requests if r.path == path and (watch is None or r.is_watch == watch)]

    def clear_requests(self) -> None:
        with self._cond:
            self._requests.clear()

    # ------------------------------------------------------------ HTTP side

    def _discovery(self, parts: list[str]) -> dict | None:
        """Discovery documents, or None if ``parts`` is not a discovery path."""
        if parts == ["version"]:
            major, minor = self.server_version
            return {
                "major": major, "minor": minor, "gitVersion": f"v{major}.{minor}.0-fake",
                "gitCommit": "0" * 40, "gitTreeState": "clean",
                "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.24.0",
                "compiler": "gc", "platform": "linux/amd64",
            }
        if parts == ["api"]:
            return {"kind": "APIVersions", "versions": ["v1"],
                    "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0",
                                                    "serverAddress": f"127.0.0.1:{self.port}"}]}
        if parts == ["api", "v1"]:
            return self._resource_list("", "v1")
        if parts == ["apis"]:
            return {"kind": "APIGroupList", "apiVersion": "v1",
                    "groups": [self._group(g) for g in (EVENTS_GROUP, KUEUE_GROUP, RESOURCE_GROUP) if self._group_versions(g)]}
        if len(parts) == 2 and parts[0] == "apis":
            if not self._group_versions(parts[1]):
                raise _not_found_path()
            return self._group(parts[1])
        if len(parts) == 3 and parts[0] == "apis":
            if parts[2] not in self._group_versions(parts[1]):
                raise _not_found_path()
            return self._resource_list(parts[1], parts[2])
        return None

    def _group_versions(self, group: str) -> tuple[str, ...]:
        if group == EVENTS_GROUP:
            return ("v1",)
        if group == KUEUE_GROUP:
            return self._kueue_versions
        if group == RESOURCE_GROUP:
            return ("v1",)
        return ()

    def _group(self, group: str) -> dict:
        versions = [{"groupVersion": f"{group}/{v}", "version": v} for v in self._group_versions(group)]
        return {"kind": "APIGroup", "apiVersion": "v1", "name": group,
                "versions": versions, "preferredVersion": versions[0]}

    def _resource_list(self, group: str, version: str) -> dict:
        resources = []
        for rt in RESOURCE_TYPES.values():
            if rt.group != group or rt.version != version or not self._served(rt):
                continue
            entry = {"name": rt.plural, "singularName": rt.singular, "namespaced": rt.namespaced,
                     "kind": rt.kind, "verbs": _ALL_VERBS}
            if rt.short_names:
                entry["shortNames"] = list(rt.short_names)
            if rt.kind == "Pod":
                entry["categories"] = ["all"]
            resources.append(entry)
            if rt.kind in ("Pod", "Node", "Workload", "ClusterQueue", "LocalQueue"):
                resources.append({"name": f"{rt.plural}/status", "singularName": "",
                                  "namespaced": rt.namespaced, "kind": rt.kind,
                                  "verbs": ["get", "patch", "update"]})
        return {"kind": "APIResourceList", "apiVersion": "v1",
                "groupVersion": f"{group}/{version}" if group else version, "resources": resources}

    def _route(self, path: str) -> tuple[ResourceType, str | None, str | None]:
        """Map a resource URL to (type, namespace, name) or raise 404."""
        parts = [p for p in path.split("/") if p]
        if parts[:2] == ["api", "v1"]:
            group, version, rest = "", "v1", parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 4:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise _not_found_path()
        namespace = None
        if len(rest) >= 3 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        if not 1 <= len(rest) <= 2:
            raise _not_found_path()
        key = f"{group}/{version}/{rest[0]}" if group else f"{version}/{rest[0]}"
        rt = RESOURCE_TYPES.get(key)
        if rt is None or not self._served(rt) or (namespace is not None and not rt.namespaced):
            raise _not_found_path()
        return rt, namespace, (rest[1] if len(rest) == 2 else None)

    def _matchers(self, rt: ResourceType, namespace: str | None, query: Mapping[str, str]):
        try:
            lsel = parse_label_selector(query.get("labelSelector"))
            fsel = parse_field_selector(query.get("fieldSelector"), rt)
        except ValueError as e:
            raise _HttpError(400, str(e)) from None

        def match(obj: Mapping | None) -> bool:
            if obj is None:
                return False
            meta = obj.get("metadata", {})
            if namespace is not None and meta.get("namespace") != namespace:
                return False
            return lsel(meta.get("labels") or {}) and fsel(obj)
        return match

    def _get_one(self, rt: ResourceType, namespace: str | None, name: str) -> dict:
        with self._cond:
            obj = self._objects.get(self._key(rt, namespace, name))
            if obj is None:
                details = {"name": name, "kind": rt.plural}
                if rt.group:
                    details["group"] = rt.group
                raise _HttpError(404, f'{rt.plural}{"." + rt.group if rt.group else ""} "{name}" not found',
                                 details=details)
            return copy.deepcopy(obj)

    def _list(self, rt: ResourceType, namespace: str | None, query: Mapping[str, str]) -> dict:
        match = self._matchers(rt, namespace, query)
        token = query.get("continue")
        with self._cond:
            if token:
                snap = self._snapshots.get(token)
                if snap is None:
                    raise _HttpError(400, f"continue key is not valid: {token}")
                list_rv, items = snap
                if list_rv < self._compacted_rv:
                    raise _HttpError(410, "The provided continue parameter is too old to display a "
                                          "consistent list result. You can start a new list without "
                                          "the continue parameter.", reason="Expired")
            else:
                list_rv = self._rv
                items = [copy.deepcopy(o) for (r, _, _), o in sorted(self._objects.items())
                         if r == rt.key and match(o)]
            limit = int(query.get("limit") or 0)
            meta: dict[str, Any] = {"resourceVersion": str(list_rv)}
            if limit and len(items) > limit:
                page, rest = items[:limit], items[limit:]
                # Opaque to clients; the server-side snapshot gives the
                # consistent-list guarantee of real continue tokens.
                nxt = base64.urlsafe_b64encode(_dumps({"rv": list_rv, "id": _new_uid()})).decode()
                self._snapshots[nxt] = (list_rv, rest)
                meta["continue"] = nxt
                meta["remainingItemCount"] = len(rest)
            else:
                page = items
        if rt.builtin:
            for o in page:
                o.pop("kind", None)
                o.pop("apiVersion", None)
        return {"kind": f"{rt.kind}List", "apiVersion": rt.api_version, "metadata": meta, "items": page}

    def _serve_watch(self, handler: "BaseHTTPRequestHandler", rt: ResourceType,
                     namespace: str | None, query: Mapping[str, str]) -> None:
        match = self._matchers(rt, namespace, query)
        allow_bookmarks = _truthy(query.get("allowWatchBookmarks"))
        send_initial = _truthy(query.get("sendInitialEvents"))
        try:
            timeout = float(query.get("timeoutSeconds") or self.default_watch_timeout)
        except ValueError:
            raise _HttpError(400, "invalid timeoutSeconds") from None
        rv_param = query.get("resourceVersion") or ""

        initial: list[dict] = []
        expired: dict | None = None
        with self._cond:
            if rv_param in ("", "0") or send_initial:
                # Unset/"0" means "current state first": synthetic ADDEDs.
                cursor = self._rv
                initial = [{"type": "ADDED", "object": copy.deepcopy(o)}
                           for (r, _, _), o in sorted(self._objects.items())
                           if r == rt.key and match(o)]
            else:
                try:
                    cursor = int(rv_param)
                except ValueError:
                    raise _HttpError(400, f"invalid resource version: {rv_param}") from None
                if cursor < self._compacted_rv:
                    expired = {"type": "ERROR", "object": status_body(
                        410, f"too old resource version: {cursor} ({self._compacted_rv})", "Expired")}
            session = _WatchSession(rt.key, namespace)
            if expired is None:
                self._sessions.add(session)
                self._cond.notify_all()
            initial_rv = self._rv

        stream = _ChunkedWriter(handler)
        try:
            stream.start()
            if expired is not None:
                # The real server answers 200 and puts the 410 in the stream.
                stream.event(expired)
                stream.end()
                return
            for ev in initial:
                stream.event(ev)
            if send_initial and allow_bookmarks:
                stream.event(self._bookmark(rt, initial_rv, initial_events_end=True))
            self._watch_loop(stream, session, rt, match, cursor, timeout, allow_bookmarks)
        except (OSError, ValueError):
            # Client went away mid-write; nothing to tell it.
            handler.close_connection = True
        finally:
            self._end_session(session)

    def _end_session(self, session: _WatchSession) -> None:
        with self._cond:
            self._sessions.discard(session)
            self._cond.notify_all()

    @staticmethod
    def _bookmark(rt: ResourceType, rv: int, initial_events_end: bool = False) -> dict:
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        if initial_events_end:
            meta["annotations"] = {"k8s.io/initial-events-end": "true"}
        return {"type": "BOOKMARK", "object": {"kind": rt.kind, "apiVersion": rt.api_version, "metadata": meta}}

    def _watch_loop(self, stream: "_ChunkedWriter", session: _WatchSession, rt: ResourceType,
                    match: Callable[[Mapping | None], bool], cursor: int, timeout: float,
                    allow_bookmarks: bool) -> None:
        deadline = time.monotonic() + timeout
        next_periodic = (time.monotonic() + self.bookmark_interval) if self.bookmark_interval else None
        while True:
            with self._cond:
                now = time.monotonic()
                periodic_due = next_periodic is not None and now >= next_periodic
                has_new = self._rv > cursor
                if not (has_new or session.drop or self._stopping or session.bookmark_requested
                        or periodic_due or now >= deadline):
                    wake = min(deadline, next_periodic or deadline)
                    # Short waits so a client that hung up is noticed promptly.
                    self._cond.wait(max(0.0, min(0.1, wake - now)))
                    batch, bookmark_rv, drop = [], None, None
                else:
                    batch = self._events_between(cursor, self._rv, rt, match)
                    cursor = self._rv
                    bookmark_rv = None
                    if session.bookmark_requested or periodic_due:
                        session.bookmark_requested = False
                        if periodic_due:
                            next_periodic = now + self.bookmark_interval
                        if allow_bookmarks:
                            bookmark_rv = cursor
                    drop = session.drop or ("graceful" if self._stopping or now >= deadline else None)
            for ev in batch:
                stream.event(ev)
            if bookmark_rv is not None:
                stream.event(self._bookmark(rt, bookmark_rv))
            if drop:
                # Deregister before the client can observe the end, so that
                # open_watches() is already accurate when its stream returns.
                self._end_session(session)
            if drop == "abrupt":
                stream.abort()
                return
            if drop == "graceful":
                stream.end()
                return
            if not batch and stream.client_gone():
                stream.abort()
                return

    def _events_between(self, after: int, upto: int, rt: ResourceType,
                        match: Callable[[Mapping | None], bool]) -> list[dict]:
        """Watch events for ``rt`` with after < rv <= upto, with selector
        transitions mapped the way the real watch cache maps them."""
        out = []
        lo = bisect.bisect_right(self._history_rvs, after)
        hi = bisect.bisect_right(self._history_rvs, upto)
        for ev in self._history[lo:hi]:
            if ev.resource != rt.key:
                continue
            now_m = match(ev.object) if ev.type != "DELETED" else False
            was_m = match(ev.previous)
            if ev.type == "ADDED":
                type_ = "ADDED" if now_m else None
            elif ev.type == "DELETED":
                type_ = "DELETED" if was_m else None
            elif now_m and was_m:
                type_ = "MODIFIED"
            elif now_m:
                type_ = "ADDED"
            elif was_m:
                type_ = "DELETED"
            else:
                type_ = None
            if type_:
                out.append({"type": type_, "object": copy.deepcopy(ev.object)})
        return out

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        split = urlsplit(handler.path)
        path = split.path.rstrip("/") or "/"
        query = {k: v[0] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
        with self._cond:
            self._requests.append(RecordedRequest(handler.command, path, query))
        try:
            failure = self._take_failure(path)
            if failure:
                extra = {"Retry-After": str(failure.retry_after)} if failure.retry_after is not None else {}
                raise _FailWith(failure.code, status_body(failure.code, failure.message, failure.reason), extra)
            if handler.command != "GET":
                raise _HttpError(405, f"the server does not allow this method on the requested resource "
                                      f"(this fake serves reads only; got {handler.command})")
            parts = [p for p in path.split("/") if p]
            doc = self._discovery(parts)
            if doc is not None:
                _send_json(handler, 200, doc)
                return
            rt, namespace, name = self._route(path)
            if name is not None:
                _send_json(handler, 200, self._get_one(rt, namespace, name))
            elif _truthy(query.get("watch")):
                self._serve_watch(handler, rt, namespace, query)
            else:
                _send_json(handler, 200, self._list(rt, namespace, query))
        except _FailWith as f:
            _send_json(handler, f.code, f.body, f.headers)
        except _HttpError as e:
            _send_json(handler, e.body["code"], e.body)


class _FailWith(Exception):
    def __init__(self, code: int, body: dict, headers: Mapping[str, str]):
        super().__init__(code)
        self.code, self.body, self.headers = code, body, headers


def _send_json(handler: BaseHTTPRequestHandler, code: int, body: Any,
               headers: Mapping[str, str] | None = None) -> None:
    data = _dumps(body)
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    for k, v in (headers or {}).items():
        handler.send_header(k, v)
    handler.end_headers()
    handler.wfile.write(data)


class _ChunkedWriter:
    """Writes a watch response as HTTP/1.1 chunks, one JSON event per chunk."""

    def __init__(self, handler: BaseHTTPRequestHandler):
        self.h = handler

    def start(self) -> None:
        self.h.send_response(200)
        self.h.send_header("Content-Type", "application/json")
        self.h.send_header("Transfer-Encoding", "chunked")
        self.h.send_header("Cache-Control", "no-cache, private")
        self.h.end_headers()
        self.h.wfile.flush()

    def event(self, ev: Mapping) -> None:
        data = _dumps(ev) + b"\n"
        self.h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.h.wfile.flush()

    def end(self) -> None:
        self.h.wfile.write(b"0\r\n\r\n")
        self.h.wfile.flush()

    def abort(self) -> None:
        # No terminating chunk: the client sees a truncated chunked body.
        self.h.close_connection = True
        try:
            self.h.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def client_gone(self) -> bool:
        """True if the peer closed its end (readable with EOF)."""
        sock = self.h.connection
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request, client_address):
        # Connection resets during stop()/drop_watches() are expected noise.
        pass


def _make_handler(api: FakeKubeApi) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # needed for chunked watch responses and keep-alive
        server_version = "fake-kube-apiserver"

        def setup(self):
            super().setup()
            with api._cond:
                api._connections.add(self.connection)

        def finish(self):
            with api._cond:
                api._connections.discard(self.connection)
            try:
                super().finish()
            except OSError:
                pass

        def _dispatch(self):
            # Drain a request body so keep-alive framing stays intact.
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            try:
                api._handle(self)
            except OSError:
                self.close_connection = True

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _dispatch

        def log_message(self, format, *args):  # noqa: A002 - stdlib signature
            pass

    return Handler


# --------------------------------------------------------------------------
# Object builders
# --------------------------------------------------------------------------

_OWNER_API_VERSIONS = {
    "Job": "batch/v1",
    "CronJob": "batch/v1",
    "ReplicaSet": "apps/v1",
    "StatefulSet": "apps/v1",
    "DaemonSet": "apps/v1",
    "JobSet": "jobset.x-k8s.io/v1alpha2",
    "PyTorchJob": "kubeflow.org/v1",
    "TrainJob": "trainer.kubeflow.org/v1alpha1",
    "RayJob": "ray.io/v1",
    "RayCluster": "ray.io/v1",
    "LeaderWorkerSet": "leaderworkerset.x-k8s.io/v1",
    "Workload": "kueue.x-k8s.io/v1beta2",
    "Pod": "v1",
}

def owner_reference(owner: Any) -> dict:
    """ownerReferences entry from (kind, name[, uid[, apiVersion]]) or a dict."""
    if isinstance(owner, Mapping):
        return dict(owner)
    kind, name, *rest = owner
    uid = rest[0] if rest and rest[0] else str(uuid.uuid5(uuid.NAMESPACE_URL, f"{kind}/{name}"))
    api_version = rest[1] if len(rest) > 1 else _OWNER_API_VERSIONS.get(kind, "v1")
    return {"apiVersion": api_version, "kind": kind, "name": name, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}


def object_reference(obj: Mapping, field_path: str | None = None) -> dict:
    """core/v1 ObjectReference to a full object, or pass a reference through.

    A mapping with ``metadata`` is treated as an object; anything else is
    assumed to already be a reference (kind/name/namespace/uid...)."""
    if "metadata" not in obj:
        return dict(obj)
    meta = obj["metadata"]
    ref = {"kind": obj.get("kind", "Pod"), "namespace": meta.get("namespace"), "name": meta["name"],
           "uid": meta.get("uid"), "apiVersion": obj.get("apiVersion", "v1")}
    if meta.get("resourceVersion"):
        ref["resourceVersion"] = meta["resourceVersion"]
    if field_path:
        ref["fieldPath"] = field_path
    return {k: v for k, v in ref.items() if v is not None}


def _digest_of(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


DEFAULT_IMAGE = "docker.io/acme/trainer@sha256:" + _digest_of("docker.io/acme/trainer:1.0")


def image_id_for(image: str) -> str:
    """containerStatuses[].imageID as containerd reports it: repo@sha256:<64 hex>.
    Digest references keep their digest; tags get a stable fake digest."""
    if "@sha256:" in image:
        return image
    repo = image.rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image
    return f"{repo}@sha256:{_digest_of(image)}"


def pod_condition(type_: str, status: str = "True", reason: str | None = None,
                  message: str | None = None, at: datetime | str | None = None) -> dict:
    """status.conditions[] entry of a Pod."""
    c = {"type": type_, "status": status, "lastProbeTime": None, "lastTransitionTime": rfc3339(at)}
    if reason:
        c["reason"] = reason
    if message:
        c["message"] = message
    return c


def disruption_target(reason: str = "PreemptionByScheduler", at: datetime | str | None = None,
                      message: str | None = None, scheduler: str = "default-scheduler") -> dict:
    """DisruptionTarget condition the scheduler / eviction API set on a victim."""
    default_messages = {
        "PreemptionByScheduler": f"{scheduler}: preempting to accommodate a higher priority pod",
        "EvictionByEvictionAPI": "Eviction API: evicting",
        "DeletionByTaintManager": "Taint manager: deleting due to NoExecute taint",
        "TerminationByKubelet": "PodGC: node no longer exists",
    }
    return pod_condition("DisruptionTarget", "True", reason, message or default_messages.get(reason), at)


def _container_state(phase: str, at: str) -> tuple[dict, bool, bool]:
    if phase == "Running":
        return {"running": {"startedAt": at}}, True, True
    if phase == "Succeeded":
        return {"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": at, "finishedAt": at}}, False, False
    if phase == "Failed":
        return {"terminated": {"exitCode": 1, "reason": "Error", "startedAt": at, "finishedAt": at}}, False, False
    return {"waiting": {"reason": "ContainerCreating"}}, False, False


def make_pod(
    ns: str,
    name: str,
    node: str | None = None,
    gpus: int = 1,
    *,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    owner: Any = None,
    image: str = DEFAULT_IMAGE,
    image_id: str | None = None,
    phase: str | None = None,
    conditions: Sequence[Mapping] | None = None,
    priority_class: str | None = None,
    priority: int | None = None,
    uid: str | None = None,
    created: datetime | str | None = None,
    scheduler_name: str = "default-scheduler",
    container_name: str = "main",
    gpu_resource: str = "nvidia.com/gpu",
    nominated_node: str | None = None,
) -> dict:
    """A Pod as the API server returns it.

    ``phase`` defaults to Running when ``node`` is set, else Pending.
    ``conditions`` default to what the kubelet/scheduler would have set for
    that phase (unscheduled Pending pods get PodScheduled=False/Unschedulable);
    pass a list (e.g. with ``disruption_target()``) to override. The GPU
    request is mirrored from the limit, as API-server defaulting does for
    extended resources."""
    phase = phase or ("Running" if node else "Pending")
    ts = rfc3339(created)
    uid = uid or _new_uid()
    # Empty maps are omitted, as the API server's omitempty encoding does.
    meta: dict[str, Any] = {"name": name, "namespace": ns, "uid": uid, "creationTimestamp": ts}
    if labels:
        meta["labels"] = dict(labels)
    if annotations:
        meta["annotations"] = dict(annotations)
    if owner is not None:
        meta["ownerReferences"] = [owner_reference(owner)]
    spec = _pod_spec(node, gpus, gpu_resource, image, container_name, scheduler_name, priority_class, priority)
    if conditions is None:
        conditions = _pod_conditions(node, phase, gpu_resource, ts)
    status: dict[str, Any] = {"phase": phase, "conditions": [dict(c) for c in conditions], "qosClass": "Burstable"}
    if nominated_node:
        status["nominatedNodeName"] = nominated_node
    if node:
        status.update(_placed_pod_status(phase, ts, uid, image, image_id, container_name))
    return {"kind": "Pod", "apiVersion": "v1", "metadata": meta, "spec": spec, "status": status}


def _pod_spec(node: str | None, gpus: int, gpu_resource: str, image: str, container_name: str, scheduler_name: str,
              priority_class: str | None, priority: int | None) -> dict:
    """The spec as the API server stores it (defaults filled in); the GPU request mirrors the limit."""
    resources: dict[str, dict[str, str]] = {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": "16Gi"}}
    if gpus:
        resources["requests"][gpu_resource] = str(gpus)
        resources["limits"][gpu_resource] = str(gpus)
    spec: dict[str, Any] = {
        "containers": [{
            "name": container_name,
            "image": image,
            "resources": resources,
            "terminationMessagePath": "/dev/termination-log",
            "terminationMessagePolicy": "File",
            "imagePullPolicy": "IfNotPresent",
        }],
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 30,
        "dnsPolicy": "ClusterFirst",
        "serviceAccountName": "default",
        "serviceAccount": "default",
        "securityContext": {},
        "schedulerName": scheduler_name,
        "tolerations": [
            {"key": gpu_resource, "operator": "Exists", "effect": "NoSchedule"},
            {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute",
             "tolerationSeconds": 300},
            {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
             "tolerationSeconds": 300},
        ],
        "priority": priority if priority is not None else 0,
        "preemptionPolicy": "PreemptLowerPriority",
        "enableServiceLinks": True,
    }
    if priority_class:
        spec["priorityClassName"] = priority_class
    if node:
        spec["nodeName"] = node
    return spec


def _pod_conditions(node: str | None, phase: str, gpu_resource: str, ts: str) -> list[dict]:
    """What the kubelet/scheduler would have set for that phase (unscheduled Pending pods:
    PodScheduled=False/Unschedulable)."""
    if not node:
        return [pod_condition("PodScheduled", "False", "Unschedulable",
                              f"0/8 nodes are available: 8 Insufficient {gpu_resource}. "
                              "preemption: 0/8 nodes are available: 8 No preemption victims "
                              "found for incoming pod.", ts)]
    ready = "True" if phase == "Running" else "False"
    if phase == "Running":
        not_ready_reason = None
    elif phase in ("Succeeded", "Failed"):
        not_ready_reason = "PodCompleted"
    else:
        not_ready_reason = "ContainersNotReady"
    return [
        pod_condition("PodReadyToStartContainers", "True" if phase != "Pending" else "False", at=ts),
        pod_condition("Initialized", "True", at=ts),
        pod_condition("Ready", ready, not_ready_reason, at=ts),
        pod_condition("ContainersReady", ready, not_ready_reason, at=ts),
        pod_condition("PodScheduled", "True", at=ts),
    ]


def _placed_pod_status(phase: str, ts: str, uid: str, image: str, image_id: str | None, container_name: str) -> dict:
    """The status fields of a pod bound to a node: host, start, its container's state."""
    state, ready_b, started = _container_state(phase, ts)
    status: dict[str, Any] = {
        "hostIP": "10.0.0.10",
        "hostIPs": [{"ip": "10.0.0.10"}],
        "startTime": ts,
        "containerStatuses": [{
            "name": container_name,
            "state": state,
            "lastState": {},
            "ready": ready_b,
            "restartCount": 0,
            "image": image,
            # Not pulled yet while ContainerCreating: the kubelet reports "".
            "imageID": (image_id or image_id_for(image)) if phase != "Pending" else (image_id or ""),
            "started": started,
            **({"containerID": f"containerd://{_digest_of(uid + container_name)}"}
               if phase != "Pending" else {}),
        }],
    }
    if phase == "Running":
        status["podIP"] = "10.244.1.7"
        status["podIPs"] = [{"ip": "10.244.1.7"}]
    return status


_EVENT_ACTIONS = {
    "Scheduled": "Binding",
    "FailedScheduling": "Scheduling",
    "Preempted": "Preempting",
    "NotTriggerScaleUp": "Scheduling",
}


def make_event_v1(
    ns: str,
    name: str,
    regarding_pod: Mapping,
    reason: str,
    note: str,
    type: str = "Normal",  # noqa: A002 - mirrors the API field name
    related: Mapping | None = None,
    event_time: datetime | str | None = None,
    *,
    reporting_controller: str = "default-scheduler",
    reporting_instance: str | None = None,
    action: str | None = None,
    count: int | None = None,
    series: Mapping | None = None,
    uid: str | None = None,
) -> dict:
    """An events.k8s.io/v1 Event, as the scheduler records them.

    ``regarding_pod``/``related`` may be full objects (a reference is derived)
    or ready-made references. ``action`` defaults from ``reason`` (Scheduled ->
    Binding, FailedScheduling -> Scheduling, Preempted -> Preempting).
    ``count`` fills deprecatedCount (what a core/v1-recorded event shows)."""
    et = rfc3339_micro(event_time)
    ev: dict[str, Any] = {
        "kind": "Event",
        "apiVersion": "events.k8s.io/v1",
        "metadata": {"name": name, "namespace": ns, "uid": uid or _new_uid(),
                     "creationTimestamp": rfc3339(_as_datetime(et))},
        "eventTime": et,
        "reportingController": reporting_controller,
        "reportingInstance": reporting_instance or f"{reporting_controller}-control-plane",
        "action": action or _EVENT_ACTIONS.get(reason, reason),
        "reason": reason,
        "regarding": object_reference(regarding_pod),
        "note": note,
        "type": type,
        "deprecatedSource": {},
    }
    if related is not None:
        ev["related"] = object_reference(related)
    if count is not None:
        ev["deprecatedCount"] = count
    if series is not None:
        ev["series"] = dict(series)
    return ev


def make_core_event(
    ns: str,
    name: str,
    involved_object: Mapping,
    reason: str,
    message: str,
    type: str = "Normal",  # noqa: A002 - mirrors the API field name
    *,
    source_component: str = "default-scheduler",
    source_host: str | None = None,
    first_timestamp: datetime | str | None = None,
    last_timestamp: datetime | str | None = None,
    count: int = 1,
    related: Mapping | None = None,
    uid: str | None = None,
) -> dict:
    """A core/v1 Event in the legacy (EventRecorder) shape: source, count,
    firstTimestamp/lastTimestamp, eventTime null."""
    first = rfc3339(first_timestamp)
    ev: dict[str, Any] = {
        "kind": "Event",
        "apiVersion": "v1",
        "metadata": {"name": name, "namespace": ns, "uid": uid or _new_uid(), "creationTimestamp": first},
        "involvedObject": object_reference(involved_object),
        "reason": reason,
        "message": message,
        "source": {"component": source_component, **({"host": source_host} if source_host else {})},
        "firstTimestamp": first,
        "lastTimestamp": rfc3339(last_timestamp) if last_timestamp else first,
        "count": count,
        "type": type,
        "eventTime": None,
        "reportingComponent": "",
        "reportingInstance": "",
    }
    if related is not None:
        ev["related"] = object_reference(related)
    return ev


def workload_condition(type_: str, status: str = "True", reason: str | None = None,
                       message: str = "", at: datetime | str | None = None,
                       observed_generation: int = 1) -> dict:
    """metav1.Condition as Kueue writes them on Workloads (QuotaReserved,
    Admitted, Evicted, Preempted, Requeued, PodsReady, Finished...)."""
    return {"type": type_, "status": status, "reason": reason or type_, "message": message,
            "lastTransitionTime": rfc3339(at), "observedGeneration": observed_generation}


def make_pod_set(name: str = "main", count: int = 1, gpus: int = 1, *, image: str = DEFAULT_IMAGE,
                 gpu_resource: str = "nvidia.com/gpu", min_count: int | None = None,
                 labels: Mapping[str, str] | None = None) -> dict:
    """spec.podSets[] entry of a Workload (template is a PodTemplateSpec)."""
    limits = {gpu_resource: str(gpus)} if gpus else {}
    requests = {"cpu": "4", "memory": "16Gi", **limits}
    ps: dict[str, Any] = {
        "name": name,
        "count": count,
        "template": {
            "metadata": {"labels": dict(labels)} if labels else {},
            "spec": {
                "containers": [{"name": "main", "image": image,
                                "resources": {"requests": requests, "limits": limits}}],
                "restartPolicy": "Never",
            },
        },
    }
    if min_count is not None:
        ps["minCount"] = min_count
    return ps


def pod_set_assignment(name: str = "main", flavors: Mapping[str, str] | None = None,
                       resource_usage: Mapping[str, str] | None = None, count: int = 1) -> dict:
    """status.admission.podSetAssignments[] entry."""
    flavors = dict(flavors or {"nvidia.com/gpu": "a100", "cpu": "default-flavor", "memory": "default-flavor"})
    usage = dict(resource_usage or {"nvidia.com/gpu": str(count), "cpu": str(4 * count),
                                    "memory": f"{16 * count}Gi"})
    return {"name": name, "flavors": flavors, "resourceUsage": usage, "count": count}


def make_workload(
    ns: str,
    name: str,
    queue_name: str = "user-queue",
    priority_class: str | None = None,
    priority: int | None = None,
    pod_sets: Sequence[Mapping] | None = None,
    conditions: Sequence[Mapping] | None = None,
    admission: Mapping | None = None,
    owner: Any = None,
    *,
    version: str = "v1beta2",
    priority_class_kind: str = "WorkloadPriorityClass",
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    active: bool = True,
    uid: str | None = None,
    created: datetime | str | None = None,
) -> dict:
    """A Kueue Workload in ``version`` (v1beta2 or v1beta1).

    The priority class is spelled per version: v1beta2 has
    ``spec.priorityClassRef {group, kind, name}``; v1beta1 has
    ``spec.priorityClassName`` + ``spec.priorityClassSource``.
    ``priority_class_kind`` is WorkloadPriorityClass (kueue.x-k8s.io) or
    PriorityClass (scheduling.k8s.io). ``admission`` is passed through as
    ``status.admission`` ({clusterQueue, podSetAssignments}); build entries
    with ``pod_set_assignment``."""
    if version not in KUEUE_VERSIONS_KNOWN:
        raise ValueError(f"unknown kueue version {version!r}")
    spec: dict[str, Any] = {
        "podSets": [dict(p) for p in (pod_sets or [make_pod_set()])],
        "queueName": queue_name,
        "active": active,
    }
    if priority_class:
        if version == "v1beta2":
            group = KUEUE_GROUP if priority_class_kind == "WorkloadPriorityClass" else "scheduling.k8s.io"
            spec["priorityClassRef"] = {"group": group, "kind": priority_class_kind, "name": priority_class}
        else:
            spec["priorityClassName"] = priority_class
            spec["priorityClassSource"] = ("kueue.x-k8s.io/workloadpriorityclass"
                                           if priority_class_kind == "WorkloadPriorityClass"
                                           else "scheduling.k8s.io/priorityclass")
    if priority is not None:
        spec["priority"] = priority
    meta: dict[str, Any] = {"name": name, "namespace": ns, "uid": uid or _new_uid(),
                            "creationTimestamp": rfc3339(created), "generation": 1}
    labels = dict(labels or {})
    if owner is not None:
        meta["ownerReferences"] = [owner_reference(owner)]
        # Kueue's job reconciler labels the Workload with its owner's uid.
        labels.setdefault("kueue.x-k8s.io/job-uid", meta["ownerReferences"][0]["uid"])
    if labels:
        meta["labels"] = labels
    if annotations:
        meta["annotations"] = dict(annotations)
    status: dict[str, Any] = {}
    if conditions:
        status["conditions"] = [dict(c) for c in conditions]
    if admission is not None:
        status["admission"] = copy.deepcopy(dict(admission))
    obj = {"apiVersion": f"{KUEUE_GROUP}/{version}", "kind": "Workload", "metadata": meta, "spec": spec}
    if status:
        obj["status"] = status
    return obj


def make_node(name: str, gpus: int = 8, *, gpu_product: str = "NVIDIA-A100-SXM4-80GB",
              labels: Mapping[str, str] | None = None, unschedulable: bool = False,
              gpu_resource: str = "nvidia.com/gpu", created: datetime | str | None = None) -> dict:
    """A Ready GPU Node with GPU Feature Discovery style labels."""
    ts = rfc3339(created)
    node_labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                   "nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": gpu_product,
                   "nvidia.com/gpu.count": str(gpus), **(labels or {})}
    capacity = {"cpu": "96", "memory": "1056440916Ki", "pods": "110", gpu_resource: str(gpus)}
    return {
        "kind": "Node", "apiVersion": "v1",
        "metadata": {"name": name, "uid": _new_uid(), "creationTimestamp": ts, "labels": node_labels},
        "spec": {"unschedulable": True} if unschedulable else {},
        "status": {
            "capacity": capacity,
            "allocatable": dict(capacity),
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "kubelet is posting ready status",
                            "lastHeartbeatTime": ts, "lastTransitionTime": ts}],
            "nodeInfo": {"kubeletVersion": "v1.34.0", "containerRuntimeVersion": "containerd://2.0.0",
                         "architecture": "amd64", "operatingSystem": "linux", "osImage": "Ubuntu 24.04 LTS",
                         "kernelVersion": "6.8.0", "kubeProxyVersion": "", "bootID": _new_uid(),
                         "machineID": _digest_of(name)[:32], "systemUUID": _new_uid()},
        },
    }


__all__ = [
    "FakeKubeApi", "RecordedRequest", "WatchEvent", "ResourceType", "RESOURCE_TYPES",
    "PODS", "CORE_EVENTS", "NODES", "EVENTS", "WORKLOADS_V1BETA2", "WORKLOADS_V1BETA1", "workloads",
    "KUEUE_GROUP", "EVENTS_GROUP", "status_body", "parse_label_selector", "parse_field_selector",
    "rfc3339", "rfc3339_micro", "owner_reference", "object_reference", "image_id_for",
    "pod_condition", "disruption_target", "make_pod", "make_event_v1", "make_core_event",
    "workload_condition", "make_pod_set", "pod_set_assignment", "make_workload", "make_node",
    "DEFAULT_IMAGE", "RESOURCE_GROUP", "RESOURCE_SLICES", "RESOURCE_CLAIMS", "make_resource_slice", "dra_gpu_device", "dra_mig_device",
]


def make_resource_slice(node: str, devices: Sequence[Mapping], driver: str = "gpu.nvidia.com", pool: str | None = None,
                        generation: int = 1, created: datetime | str | None = None) -> dict:
    """A resource.k8s.io/v1 ResourceSlice as a DRA kubelet plugin publishes it for its node.

    ``devices``: ``{"name": ..., "attributes": {"uuid": {"string": ...}, ...}}`` entries
    (see ``dra_gpu_device`` / ``dra_mig_device``)."""
    pool = pool or node
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{driver}-{_new_uid()[:5]}", "creationTimestamp": rfc3339(created)},
            "spec": {"driver": driver, "nodeName": node, "pool": {"name": pool, "generation": generation, "resourceSliceCount": 1},
                     "devices": list(devices)}}


def dra_gpu_device(minor: int, uuid: str, product: str = "NVIDIA A100-SXM4-80GB") -> dict:
    """A full GPU as NVIDIA's DRA driver (gpu.nvidia.com) announces it: name gpu-<minor>, type gpu, uuid."""
    return {"name": f"gpu-{minor}", "attributes": {
        "type": {"string": "gpu"}, "uuid": {"string": uuid}, "productName": {"string": product},
        "brand": {"string": "Nvidia"}, "architecture": {"string": "Ampere"}, "cudaComputeCapability": {"version": "8.0.0"},
        "driverVersion": {"version": "550.90.7"}, "index": {"int": minor}, "minor": {"int": minor}},
        "capacity": {"memory": {"value": "80Gi"}}}


def dra_mig_device(parent_minor: int, profile: str, placement: int, uuid: str, parent_uuid: str,
                   product: str = "NVIDIA A100-SXM4-80GB") -> dict:
    """A MIG device as NVIDIA's DRA driver announces it: type mig, uuid, parentUUID, profile."""
    return {"name": f"gpu-{parent_minor}-mig-{profile.replace('.', '')}-{placement}", "attributes": {
        "type": {"string": "mig"}, "uuid": {"string": uuid}, "parentUUID": {"string": parent_uuid},
        "profile": {"string": profile}, "productName": {"string": product}, "brand": {"string": "Nvidia"},
        "architecture": {"string": "Ampere"}, "parentMinor": {"int": parent_minor}},
        "capacity": {"multiprocessors": {"value": "14"}, "memory": {"value": "10Gi"}}}
