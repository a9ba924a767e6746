"""The kubelet pod-resources socket of each KWOK node, fed from the real cluster's pods.

There is no kubelet here (KWOK fakes pod lifecycles), so the pod-resources gRPC API stays the
double of ``gpuledger.sim.kubelet.FakeKubelet`` — but what it reports comes from the real
control plane: a pod the real scheduler bound to a node, and that KWOK has not finished, holds
devices of that node for each container's ``nvidia.com/gpu`` / ``nvidia.com/mig-<profile>``
limit, as the device plugin would allocate them (first free ids of ``node_devices``, kept for
the pod's life). ``GetAllocatableResources`` lists the node's device ids. The same assignment
feeds the ``DcgmExporter``'s pod mapping (dcgm-exporter reads the same socket), so the
pod-resources collector, Prometheus' alerts and the scheduler collector see one world.

Input: the cluster's pods (a list of ``/api/v1/pods`` every ``interval_s``: the API server is
local, and a list is simpler than a watch with re-lists). Output: one unix socket per node
(``sockets``). Limits: no NUMA affinity beyond GPU index (0-3 → 0, 4-7 → 1); no DRA; a pod
asking more devices than are free gets what is free (the scheduler's capacity check makes
that not happen on these nodes); terminal pods release their devices at once.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from gpuledger.dev.cluster import ClusterError, LocalCluster
from gpuledger.dev.peers import DcgmDevice, DcgmExporter, node_devices
from gpuledger.sim.kubelet import FakeKubelet, container, devices, pod

log = logging.getLogger(__name__)

GPU = "nvidia.com/gpu"
_TERMINAL = ("Succeeded", "Failed")


def _resource(dev: DcgmDevice) -> str:
    return f"nvidia.com/mig-{dev.gpu_instance[1]}" if dev.gpu_instance else GPU


def _numa(dev: DcgmDevice) -> list[int]:
    return [0 if dev.gpu < 4 else 1]


class ClusterKubelets:
    """One ``FakeKubelet`` per node of ``cluster``, kept in step with the pods bound to it."""

    def __init__(self, cluster: LocalCluster, socket_dir: Path, exporter: DcgmExporter | None = None,
                 interval_s: float = 0.5) -> None:
        self.cluster = cluster
        self.exporter = exporter
        self.interval_s = interval_s
        self.devices = {n.name: node_devices(n) for n in cluster.nodes}
        self.sockets = {n.name: Path(socket_dir) / f"{n.name}.sock" for n in cluster.nodes}
        self.kubelets = {name: FakeKubelet(path) for name, path in self.sockets.items()}
        #: (pod uid, container) -> device ids, for as long as the pod is active on its node
        self.assigned: dict[tuple[str, str], list[str]] = {}
        #: device ids the device plugin no longer reports healthy (left out of GetAllocatableResources)
        self.unhealthy: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> ClusterKubelets:
        for name, kubelet in self.kubelets.items():
            kubelet.start()
            self._publish_allocatable(name)
        self.sync()
        self._thread = threading.Thread(target=self._run, name="cluster-kubelets", daemon=True)
        self._thread.start()
        return self

    def _publish_allocatable(self, node: str) -> None:
        self.kubelets[node].set_allocatable([devices(_resource(d), [d.device_id], numa=_numa(d)) for d in self.devices[node]
                                             if d.device_id not in self.unhealthy])

    def mark_unhealthy(self, device_id: str) -> None:
        """The device plugin reports the device unhealthy (a GPU that fell off the bus): it leaves the
        node's allocatable set; a pod holding it keeps it, as on a real node."""
        node = next(n for n, devs in self.devices.items() if any(d.device_id == device_id for d in devs))
        self.unhealthy.add(device_id)
        self._publish_allocatable(node)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sync()
            except ClusterError as exc:  # the API server restarting: try again next round
                log.warning("kubelet doubles not synced: %s", exc)

    def sync(self) -> None:
        """Assign and release devices for the cluster's current pods, then serve the result."""
        items = (self.cluster.request("GET", "/api/v1/pods") or {}).get("items", [])
        active = [p for p in items if p["spec"].get("nodeName") in self.kubelets and p.get("status", {}).get("phase") not in _TERMINAL]
        live = {(p["metadata"]["uid"], c["name"]) for p in active for c in p["spec"]["containers"]}
        for key in [k for k in self.assigned if k not in live]:
            del self.assigned[key]
        by_node: dict[str, list] = {name: [] for name in self.kubelets}
        held: dict[str, tuple[str, str, str]] = {}
        for p in active:
            node, meta = p["spec"]["nodeName"], p["metadata"]
            containers = []
            for c in p["spec"]["containers"]:
                ids = self._allocate(node, (meta["uid"], c["name"]), (c.get("resources") or {}).get("limits") or {})
                for dev_id in ids:
                    held[dev_id] = (meta["namespace"], meta["name"], c["name"])
                by_res: dict[str, list[DcgmDevice]] = {}
                for dev in self.devices[node]:
                    if dev.device_id in ids:
                        by_res.setdefault(_resource(dev), []).append(dev)
                containers.append(container(c["name"], devices=[devices(res, [d.device_id for d in devs], numa=sorted({n for d in devs for n in _numa(d)}))
                                                                for res, devs in by_res.items()]))
            by_node[node].append(pod(meta["namespace"], meta["name"], containers=containers))
        for name, pods in by_node.items():
            self.kubelets[name].set_pods(pods)
        if self.exporter is not None:
            for devs in self.devices.values():
                for dev in devs:
                    if dev.device_id in held:
                        self.exporter.hold(dev.device_id, *held[dev.device_id])
                    else:
                        self.exporter.release(dev.device_id)

    def _allocate(self, node: str, key: tuple[str, str], limits: dict[str, str]) -> list[str]:
        if key in self.assigned:
            return self.assigned[key]
        taken = {d for k, ids in self.assigned.items() for d in ids}
        ids: list[str] = []
        for res, qty in limits.items():
            if res != GPU and not res.startswith("nvidia.com/mig-"):
                continue
            free = [d.device_id for d in self.devices[node] if _resource(d) == res and d.device_id not in taken]
            ids += free[:int(qty)]
        self.assigned[key] = ids
        return ids

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        for kubelet in self.kubelets.values():
            kubelet.stop()

    def __enter__(self) -> ClusterKubelets:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
