"""FakeKubelet: an in-process stand-in for the kubelet PodResources v1 gRPC API.

Used by the cluster simulator (``gpuledger.sim.cluster`` serves one per simulated
node, and the real ``gpuledger collect podresources`` polls it) and by the tests
(``tests/fixtures/kubelet.py`` re-exports it). It serves the real
``v1.PodResourcesLister`` service (stubs generated from
producers/podresources/proto/podresources_v1.proto) on a unix socket, just as the kubelet
serves /var/lib/kubelet/pod-resources/kubelet.sock, so client code talks to it
over a genuine gRPC channel.

Behaviour that matters to clients and can be toggled:

* ``get_implemented = False`` makes ``Get`` answer UNIMPLEMENTED, which is what
  gRPC returns from a kubelet that predates ``Get`` (< 1.27).
* ``get_gate_disabled = True`` mimics a newer kubelet with the
  KubeletPodResourcesGet feature gate off: the kubelet returns a plain Go error,
  so the client sees UNKNOWN "PodResources API Get method disabled".
* ``exhaust_next(n)`` makes the next ``n`` calls (any method) fail with
  RESOURCE_EXHAUSTED "rejected by rate limit", exactly like the kubelet's
  rate-limiting interceptor.
* ``rate_limit(qps, burst)`` puts the kubelet's own limiter in front of every
  method: one token bucket for all clients together, full at start, refilled
  at ``qps``, a call without a token refused at once with RESOURCE_EXHAUSTED
  (pkg/kubelet/apis/podresources/grpc/ratelimit.go: ``rate.NewLimiter(qps,
  burst)`` and ``Allow()``; the kubelet's defaults are 100 and 10,
  ``DEFAULT_QPS`` / ``DEFAULT_BURST``). ``clock`` lets a test step time itself.
* ``restart()`` is a kubelet restart as pkg/kubelet (v1.34) does it: the socket is
  re-created, and the API is served at once (cmd/kubelet/app/server.go ``startKubelet``
  starts ``ListenAndServePodResources`` beside the kubelet's main loop), before the
  kubelet has its pods or its devices. ``List`` and ``Get`` show no pod until
  ``sync_pods()`` (the API server's pods arrived); ``GetAllocatableResources`` lists no
  device of a resource until ``register_plugin(resource)`` (the device manager restores
  only the resource names from its checkpoint, with no healthy device —
  devicemanager ``ManagerImpl.readCheckpoint`` — and ``GetAllocatableDevices`` lists
  the devices the plugin sent through ListAndWatch after it registered again). What
  ``set_pods`` / ``set_allocatable`` set is kept: it is what the node really runs.
* ``Get`` for an unknown pod answers ``not_found_code`` (default NOT_FOUND).
  NOTE: the real kubelet returns a plain Go error here too, i.e. UNKNOWN with
  "pod <name> in namespace <ns> not found"; set ``not_found_code =
  grpc.StatusCode.UNKNOWN`` to reproduce that exactly. Robust clients should
  handle both.

Builders ``pod()``, ``container()``, ``devices()``, ``dynamic_resource()`` and
``claim_resource()`` make the protos terse to write in tests::

    with FakeKubelet(sock) as kubelet:
        kubelet.set_pods([
            pod("ml", "trainer-0", containers=[
                container("main", devices=[
                    devices("nvidia.com/gpu", ["GPU-8f1c...::2"], numa=[0]),
                ]),
            ]),
        ])
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent import futures
from typing import Iterable, Mapping, Sequence, Union

import grpc

from producers.podresources.proto import podresources_v1_pb2 as pb
from producers.podresources.proto import podresources_v1_pb2_grpc as pb_grpc

# Same messages the kubelet (and grpc-go) use, so client error handling can
# match on them. Sources: pkg/kubelet/apis/podresources/grpc/ratelimit.go and
# pkg/kubelet/apis/podresources/server_v1.go in kubernetes/kubernetes.
RATE_LIMIT_MESSAGE = "rejected by rate limit"
GET_DISABLED_MESSAGE = "PodResources API Get method disabled"
GET_UNKNOWN_METHOD_MESSAGE = "unknown method Get for service v1.PodResourcesLister"
# The kubelet's limiter of this API (ratelimit.go DefaultQPS, DefaultBurstTokens).
DEFAULT_QPS = 100.0
DEFAULT_BURST = 10

# sockaddr_un.sun_path is 108 bytes on Linux including the NUL terminator;
# gRPC fails obscurely on longer paths, so check up front.
_MAX_UNIX_PATH = 107

PodLike = Union[pb.PodResources, Mapping]


# --------------------------------------------------------------------------
# Proto builders
# --------------------------------------------------------------------------

def _topology(numa: Iterable[int] | None) -> pb.TopologyInfo | None:
    if numa is None:
        return None
    return pb.TopologyInfo(nodes=[pb.NUMANode(ID=int(n)) for n in numa])


def devices(
    resource_name: str,
    ids: Sequence[str],
    numa: Iterable[int] | None = None,
) -> pb.ContainerDevices:
    """A device-plugin allocation: ``resource_name`` with opaque ``ids``.

    ``numa=None`` leaves ``topology`` unset, which is what the kubelet sends
    for plugins that do not report NUMA affinity.
    """
    msg = pb.ContainerDevices(resource_name=resource_name, device_ids=list(ids))
    topology = _topology(numa)
    if topology is not None:
        msg.topology.CopyFrom(topology)
    return msg


def claim_resource(
    driver_name: str,
    pool_name: str,
    device_name: str,
    cdi_devices: Iterable[str] = (),
) -> pb.ClaimResource:
    """One DRA-allocated device (driver/pool/device triplet plus CDI names)."""
    return pb.ClaimResource(
        driver_name=driver_name,
        pool_name=pool_name,
        device_name=device_name,
        cdi_devices=[pb.CDIDevice(name=n) for n in cdi_devices],
    )


def dynamic_resource(
    claim_name: str,
    claim_namespace: str,
    claim_resources: Iterable[pb.ClaimResource] = (),
) -> pb.DynamicResource:
    """A DRA ResourceClaim as reported on a container."""
    return pb.DynamicResource(
        claim_name=claim_name,
        claim_namespace=claim_namespace,
        claim_resources=list(claim_resources),
    )


def container(
    name: str,
    devices: Iterable[pb.ContainerDevices | Mapping] = (),
    cpu_ids: Iterable[int] = (),
    memory: Iterable[pb.ContainerMemory] = (),
    dynamic_resources: Iterable[pb.DynamicResource] = (),
) -> pb.ContainerResources:
    """A container's resources; ``devices`` items may be protos or dicts."""
    return pb.ContainerResources(
        name=name,
        devices=[_coerce_devices(d) for d in devices],
        cpu_ids=list(cpu_ids),
        memory=list(memory),
        dynamic_resources=list(dynamic_resources),
    )


def pod(
    namespace: str,
    name: str,
    containers: Iterable[pb.ContainerResources | Mapping] = (),
) -> pb.PodResources:
    """A pod's resources; ``containers`` items may be protos or dicts."""
    return pb.PodResources(
        namespace=namespace,
        name=name,
        containers=[_coerce_container(c) for c in containers],
    )


# Dict forms mirror the builder signatures, e.g.
#   {"namespace": "ml", "name": "p", "containers": [
#       {"name": "c", "devices": [
#           {"resource_name": "nvidia.com/gpu", "ids": ["GPU-1"], "numa": [0]}]}]}
# "device_ids" is accepted as an alias of "ids" to match the proto field name.

def _coerce_devices(d: pb.ContainerDevices | Mapping) -> pb.ContainerDevices:
    if isinstance(d, pb.ContainerDevices):
        return d
    ids = d["ids"] if "ids" in d else d.get("device_ids", ())
    return devices(d["resource_name"], ids, numa=d.get("numa"))


def _coerce_container(c: pb.ContainerResources | Mapping) -> pb.ContainerResources:
    if isinstance(c, pb.ContainerResources):
        return c
    return container(**c)


def _coerce_pod(p: PodLike) -> pb.PodResources:
    if isinstance(p, pb.PodResources):
        return p
    return pod(**p)


# --------------------------------------------------------------------------
# Rate limiting
# --------------------------------------------------------------------------

class TokenBucket:
    """Go's ``rate.Limiter`` as the kubelet uses it: ``allow()`` only, never waiting.

    Starts with ``burst`` tokens, earns ``qps`` per second of ``clock`` up to ``burst``,
    and a call takes one token or is refused. Written out rather than taken from a
    library: none of the project's dependencies has one, and Go's semantics (a full
    bucket at start, refusal without queueing) are what the double must reproduce.
    Not thread-safe by itself: the kubelet double calls it under its lock.
    """

    def __init__(self, qps: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        if qps <= 0 or burst < 1:
            raise ValueError(f"qps must be > 0 and burst >= 1, not {qps} and {burst}")
        self.qps, self.burst, self._clock = float(qps), int(burst), clock
        self._tokens = float(burst)
        self._at = clock()

    def allow(self) -> bool:
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + max(0.0, now - self._at) * self.qps)
        self._at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True


# --------------------------------------------------------------------------
# Servicer and server
# --------------------------------------------------------------------------

class _Servicer(pb_grpc.PodResourcesListerServicer):
    """Translates RPCs into reads of the owning FakeKubelet's state."""

    def __init__(self, kubelet: "FakeKubelet") -> None:
        self._kubelet = kubelet

    def List(self, request, context):
        self._kubelet._admit("List", context)
        with self._kubelet._lock:
            # Building the response copies the protos, so later set_pods()
            # calls cannot race with serialization on the gRPC thread.
            return pb.ListPodResourcesResponse(pod_resources=self._kubelet._listed_pods())

    def GetAllocatableResources(self, request, context):
        self._kubelet._admit("GetAllocatableResources", context)
        with self._kubelet._lock:
            registered = self._kubelet._registered
            return pb.AllocatableResourcesResponse(
                devices=[d for d in self._kubelet._alloc_devices if registered is None or d.resource_name in registered],
                cpu_ids=self._kubelet._alloc_cpu_ids,
                memory=self._kubelet._alloc_memory,
            )

    def Get(self, request, context):
        self._kubelet._admit("Get", context)
        with self._kubelet._lock:
            implemented = self._kubelet._get_implemented
            gate_disabled = self._kubelet._get_gate_disabled
            not_found_code = self._kubelet._not_found_code
            found = next(
                (
                    p for p in self._kubelet._listed_pods()
                    if p.name == request.pod_name
                    and p.namespace == request.pod_namespace
                ),
                None,
            )
            response = None if found is None else pb.GetPodResourcesResponse(pod_resources=found)
        if not implemented:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, GET_UNKNOWN_METHOD_MESSAGE)
        if gate_disabled:
            context.abort(grpc.StatusCode.UNKNOWN, GET_DISABLED_MESSAGE)
        if response is None:
            context.abort(
                not_found_code,
                f"pod {request.pod_name} in namespace {request.pod_namespace} not found",
            )
        return response


class FakeKubelet:
    """In-process PodResources v1 server on a unix socket; see module docstring.

    All mutable state is guarded by one lock, so tests may reconfigure the
    fake while a client is polling it from another thread.
    """

    METHODS = ("List", "GetAllocatableResources", "Get")

    def __init__(self, socket_path: str | os.PathLike, *, max_workers: int = 4) -> None:
        self.socket_path = os.fspath(socket_path)
        if len(self.socket_path.encode()) > _MAX_UNIX_PATH:
            raise ValueError(
                f"unix socket path is {len(self.socket_path.encode())} bytes; "
                f"the limit is {_MAX_UNIX_PATH}: {self.socket_path}"
            )
        self._max_workers = max_workers
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None
        self._pods: list[pb.PodResources] = []
        self._alloc_devices: list[pb.ContainerDevices] = []
        self._alloc_cpu_ids: list[int] = []
        self._alloc_memory: list[pb.ContainerMemory] = []
        #: False from restart() until sync_pods(): the kubelet has not yet had its pods from the API server.
        self._pods_synced = True
        #: Resources whose device plugin registered since restart(); None: all (no restart).
        self._registered: set[str] | None = None
        self._get_implemented = True
        self._get_gate_disabled = False
        self._not_found_code = grpc.StatusCode.NOT_FOUND
        self._exhausted_remaining = 0
        self._limiter: TokenBucket | None = None
        self._calls: Counter[str] = Counter()
        self._refused: Counter[str] = Counter()

    # -- lifecycle ---------------------------------------------------------

    @property
    def address(self) -> str:
        """gRPC target for ``grpc.insecure_channel``."""
        return "unix://" + self.socket_path

    def start(self) -> "FakeKubelet":
        if self._server is not None:
            raise RuntimeError("FakeKubelet already started")
        # A stale socket file from a crashed run would make bind() fail.
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self._max_workers))
        pb_grpc.add_PodResourcesListerServicer_to_server(_Servicer(self), server)
        if server.add_insecure_port(self.address) == 0:
            raise RuntimeError(f"could not bind {self.address}")
        server.start()
        self._server = server
        return self

    def stop(self, grace: float | None = None) -> None:
        """Stop serving (idempotent); in-flight RPCs get ``grace`` seconds."""
        server, self._server = self._server, None
        if server is None:
            return
        server.stop(grace).wait()
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)

    def restart(self) -> None:
        """Restart as the kubelet does (see module docstring): a re-created socket, served at
        once, with no pods until ``sync_pods()`` and no allocatable device of a resource until
        ``register_plugin(resource)``."""
        self.stop()
        with self._lock:
            self._pods_synced = False
            self._registered = set()
        self.start()

    def sync_pods(self) -> None:
        """The restarted kubelet has had its pods from the API server: List and Get show them."""
        with self._lock:
            self._pods_synced = True

    def register_plugin(self, *resources: str) -> None:
        """The device plugin of ``resources`` registered again and sent its devices (ListAndWatch):
        GetAllocatableResources lists them."""
        with self._lock:
            if self._registered is not None:
                self._registered.update(resources)

    def _listed_pods(self) -> list[pb.PodResources]:
        """The pods List and Get see (call under the lock)."""
        return self._pods if self._pods_synced else []

    def __enter__(self) -> "FakeKubelet":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # -- state -------------------------------------------------------------

    def set_pods(self, pods: Iterable[PodLike]) -> None:
        """Replace the pods reported by List/Get (protos or builder dicts)."""
        coerced = [_coerce_pod(p) for p in pods]
        # Copy so the caller mutating its protos later cannot change what the
        # fake serves behind the lock's back.
        snapshot = []
        for p in coerced:
            c = pb.PodResources()
            c.CopyFrom(p)
            snapshot.append(c)
        with self._lock:
            self._pods = snapshot

    def set_allocatable(
        self,
        devices: Iterable[pb.ContainerDevices | Mapping],
        cpu_ids: Iterable[int] = (),
        memory: Iterable[pb.ContainerMemory] = (),
    ) -> None:
        """Replace what GetAllocatableResources reports."""
        devs = [_coerce_devices(d) for d in devices]
        response = pb.AllocatableResourcesResponse(
            devices=devs, cpu_ids=list(cpu_ids), memory=list(memory)
        )  # built once to deep-copy everything
        with self._lock:
            self._alloc_devices = list(response.devices)
            self._alloc_cpu_ids = list(response.cpu_ids)
            self._alloc_memory = list(response.memory)

    @property
    def get_implemented(self) -> bool:
        with self._lock:
            return self._get_implemented

    @get_implemented.setter
    def get_implemented(self, value: bool) -> None:
        with self._lock:
            self._get_implemented = bool(value)

    @property
    def get_gate_disabled(self) -> bool:
        with self._lock:
            return self._get_gate_disabled

    @get_gate_disabled.setter
    def get_gate_disabled(self, value: bool) -> None:
        with self._lock:
            self._get_gate_disabled = bool(value)

    @property
    def not_found_code(self) -> grpc.StatusCode:
        with self._lock:
            return self._not_found_code

    @not_found_code.setter
    def not_found_code(self, code: grpc.StatusCode) -> None:
        with self._lock:
            self._not_found_code = code

    def exhaust_next(self, n: int) -> None:
        """Fail the next ``n`` calls (any method) with RESOURCE_EXHAUSTED."""
        if n < 0:
            raise ValueError("n must be >= 0")
        with self._lock:
            self._exhausted_remaining = n

    def rate_limit(self, qps: float | None = DEFAULT_QPS, burst: int = DEFAULT_BURST,
                   clock: Callable[[], float] = time.monotonic) -> None:
        """Limit all calls together as the kubelet does (see module docstring); ``qps=None`` turns it off."""
        with self._lock:
            self._limiter = None if qps is None else TokenBucket(qps, burst, clock)

    # -- call accounting ---------------------------------------------------

    @property
    def calls(self) -> dict[str, int]:
        """Calls received per method, including ones that were rejected."""
        with self._lock:
            return {m: self._calls[m] for m in self.METHODS}

    def call_count(self, method: str) -> int:
        if method not in self.METHODS:
            raise KeyError(method)
        with self._lock:
            return self._calls[method]

    def refused_count(self, method: str) -> int:
        """Calls of ``method`` refused with RESOURCE_EXHAUSTED (``exhaust_next`` or the rate limit)."""
        if method not in self.METHODS:
            raise KeyError(method)
        with self._lock:
            return self._refused[method]

    def reset_calls(self) -> None:
        with self._lock:
            self._calls.clear()
            self._refused.clear()

    def _admit(self, method: str, context: grpc.ServicerContext) -> None:
        """Count the call, then apply rate limiting before any method logic,
        mirroring the kubelet, whose limiter is a server interceptor."""
        with self._lock:
            self._calls[method] += 1
            limited = self._exhausted_remaining > 0
            if limited:
                self._exhausted_remaining -= 1
            elif self._limiter is not None:
                limited = not self._limiter.allow()
            if limited:
                self._refused[method] += 1
        if limited:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, RATE_LIMIT_MESSAGE)
