"""The real alerting and registry peers next to the local cluster: Prometheus, Alertmanager, MLflow.

What runs (each a child process on 127.0.0.1 free ports, config, data and logs in one directory):
- ``DcgmExporter`` (in-process, ``prometheus_client``): a ``/metrics`` page shaped like NVIDIA
  dcgm-exporter's for simulated GPUs — ``DCGM_FI_DEV_XID_ERRORS`` (the last XID, with the
  ``err_code``/``err_msg`` labels dcgm-exporter 3.3+ adds) and a few friends (temperature,
  power, utilisation, framebuffer), one series per GPU, or per GPU instance on a MIG GPU
  (``UUID`` of the *parent* GPU plus ``GPU_I_ID``/``GPU_I_PROFILE``), with ``pod``,
  ``namespace`` and ``container`` while a pod holds the device (dcgm-exporter's
  ``--kubernetes`` pod mapping). There are no GPUs here, so the page is the double; what
  reads it is real.
- **Prometheus** (Debian ``prometheus``) scraping that page every second and evaluating
  ``GpuXidError`` (``DCGM_FI_DEV_XID_ERRORS > 0``) every second, sending to
- **Alertmanager** (Debian ``prometheus-alertmanager``), one route to a ``webhook_configs``
  receiver: the gpuledger receiver's ``/v1/alertmanager`` with
  ``authorization: {type: Bearer, credentials_file: …}`` and ``send_resolved: true``;
  ``group_wait``/``group_interval`` of one second so a test sees a notification quickly.
  The bearer token is a caller of the receiver's credentials file (``write_caller``).
- **MLflow** (PyPI ``mlflow``): ``mlflow server`` on a sqlite backend with the three
  environment variables it needs to deliver webhooks to a plain-HTTP loopback receiver
  (``MLFLOW_WEBHOOK_ALLOWED_SCHEMES``, ``MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS``,
  ``MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY``); ``create_webhook`` registers the receiver's
  ``/v1/mlflow`` through ``MlflowClient`` so MLflow itself signs and sends every delivery.

``AlertingPeers`` and ``MlflowServer`` are context managers with ``start``/``stop`` like
``gpuledger.dev.cluster.LocalCluster``. Limits: one Prometheus and one Alertmanager (no HA
pair, no cluster gossip: ``--cluster.listen-address=``); MLflow with one worker process, so
no webhook secret key is shared between workers anyway; MLflow retries a delivery only
in-process (3 times), so a delivery lost while the receiver is down is lost.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from gpuledger.dev import kubebin
from gpuledger.dev.process import ServiceProcess, free_port

log = logging.getLogger(__name__)

#: The MLflow release the server runs (its own virtualenv in the cache, see ``ensure_mlflow_server``).
MLFLOW_VERSION = "3.17.2"
PROMETHEUS = "prometheus"
ALERTMANAGER = "prometheus-alertmanager"
#: The alert rule Prometheus evaluates (also the alertname receivers see).
XID_ALERT = "GpuXidError"
MLFLOW_WEBHOOK_EVENTS = ("model_version.created", "model_version_tag.set", "model_version_alias.created",
                         "model_version_alias.deleted", "model_version_tag.deleted", "registered_model.created")
_DRIVER_VERSION = "550.127.08"
#: What dcgm-exporter puts in err_msg for the XIDs the scenarios use (NVIDIA's XID catalogue).
XID_MESSAGES = {0: "No Error", 13: "Graphics Engine Exception", 31: "GPU memory page fault", 43: "GPU stopped processing",
                48: "Double Bit ECC Error", 63: "ECC page retirement or row remapping recording event",
                74: "NVLINK Error", 79: "GPU has fallen off the bus", 94: "Contained ECC error", 95: "Uncontained ECC error"}


class PeerError(RuntimeError):
    """A peer could not be found, configured or started."""


# --- the DCGM-exporter-shaped page ---------------------------------------------------------

@dataclass
class DcgmDevice:
    """One series of dcgm-exporter: a whole GPU, or one GPU instance of a MIG GPU."""

    node: str
    gpu: int  # index of the physical GPU on the node (dcgm-exporter's ``gpu`` label)
    uuid: str  # the physical GPU's UUID (also for a GPU instance)
    model_name: str
    gpu_instance: tuple[int, str] | None = None  # (GPU_I_ID, GPU_I_PROFILE) on MIG
    device_id: str = ""  # what the device plugin reports to the kubelet for it (GPU- or MIG- UUID)
    xid: int = 0
    holder: tuple[str, str, str] | None = None  # (namespace, pod, container) while a pod holds it

    def labels(self) -> dict[str, str]:
        out = {"gpu": str(self.gpu), "UUID": self.uuid, "pci_bus_id": f"00000000:{0x10 + self.gpu:02X}:00.0",
               "device": f"nvidia{self.gpu}", "modelName": self.model_name, "Hostname": self.node,
               "DCGM_FI_DRIVER_VERSION": _DRIVER_VERSION}
        if self.gpu_instance:
            out["GPU_I_PROFILE"], out["GPU_I_ID"] = self.gpu_instance[1], str(self.gpu_instance[0])
        if self.holder:
            out["namespace"], out["pod"], out["container"] = self.holder
        return out


def _stable_uuid(*parts: str) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, "gpuledger-local/" + "/".join(parts)))


#: GPU instance ids the driver gives 1g slices of an A100/H100 (nvidia-smi mig -lgi): 7..14.
_FIRST_GI = {"1g": 7, "2g": 3, "3g": 1, "4g": 5, "7g": 0}


def node_devices(node) -> list[DcgmDevice]:
    """The devices of a ``gpuledger.dev.cluster.GpuNode``, with stable UUIDs (same node name, same ids).

    Whole GPUs are ``GPU-<uuid>``; the MIG profiles of a node are slices of as many physical
    GPUs as needed (7 slices of 1g per GPU), each slice ``MIG-<uuid>`` to the device plugin and,
    to dcgm-exporter, its parent's ``UUID`` with ``GPU_I_ID``/``GPU_I_PROFILE``.
    """
    model = node.product.replace("-", " ")  # the node label's form -> nvidia-smi's (modelName)
    out = []
    for i in range(node.gpus):
        gpu_uuid = f"GPU-{_stable_uuid(node.name, 'gpu', str(i))}"
        out.append(DcgmDevice(node.name, i, gpu_uuid, model, device_id=gpu_uuid))
    gpu = node.gpus
    for profile, count in node.mig:
        per_gpu = 7 // int(profile.split("g", 1)[0])
        for k in range(count):
            parent, slot = gpu + k // per_gpu, k % per_gpu
            out.append(DcgmDevice(node.name, parent, f"GPU-{_stable_uuid(node.name, 'gpu', str(parent))}", model,
                                  gpu_instance=(_FIRST_GI.get(profile.split(".", 1)[0], 1) + slot, profile),
                                  device_id=f"MIG-{_stable_uuid(node.name, 'mig', profile, str(k))}"))
        gpu += -(-count // per_gpu)
    return out


class DcgmExporter:
    """``/metrics`` as dcgm-exporter serves it, for ``devices``; ``set_xid``/``hold`` change what it says.

    Built on ``prometheus_client`` (a custom collector on its own registry, its HTTP server) so the
    exposition format is the library's, not ours.
    """

    def __init__(self, devices: Iterable[DcgmDevice], port: int | None = None) -> None:
        self.devices = list(devices)
        self.port = port or free_port()
        self._lock = threading.Lock()
        self._server = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def device(self, device_id: str) -> DcgmDevice:
        """The series of a device plugin id (``GPU-…``/``MIG-…``)."""
        for d in self.devices:
            if d.device_id == device_id:
                return d
        raise PeerError(f"no device {device_id} on this exporter")

    def set_xid(self, device_id: str, xid: int) -> DcgmDevice:
        """The device's last XID (0: none); on a MIG node dcgm-exporter reports it on the instance's series."""
        with self._lock:
            dev = self.device(device_id)
            dev.xid = xid
            return dev

    def hold(self, device_id: str, namespace: str, pod: str, container: str) -> None:
        with self._lock:
            self.device(device_id).holder = (namespace, pod, container)

    def release(self, device_id: str) -> None:
        with self._lock:
            self.device(device_id).holder = None

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        with self._lock:
            series = [(d.labels(), d) for d in self.devices]
        families = [
            ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", lambda d: 41.0),
            ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", lambda d: 312.5 if d.holder else 61.0),
            ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", lambda d: 97.0 if d.holder else 0.0),
            ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", lambda d: 61440.0 if d.holder else 0.0),
            ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", lambda d: 20480.0 if d.holder else 81920.0),
        ]
        for name, doc, value in families:
            fam = GaugeMetricFamily(name, doc, labels=list(series[0][0]) if series else [])
            for labels, dev in series:
                fam.add_sample(name, labels, value(dev))
            yield fam
        xid = GaugeMetricFamily("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.")
        for labels, dev in series:
            xid.add_sample("DCGM_FI_DEV_XID_ERRORS", {**labels, "err_code": str(dev.xid),
                                                      "err_msg": XID_MESSAGES.get(dev.xid, "Unknown Error")}, float(dev.xid))
        yield xid

    def start(self) -> DcgmExporter:
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        self._server, _thread = start_http_server(self.port, addr="127.0.0.1", registry=registry)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> DcgmExporter:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# --- the receiver's credentials file -----------------------------------------------------------

def write_caller(credentials_file: Path, identity: str, endpoints: tuple[str, ...]) -> str:
    """Add a caller with a fresh random token to the receiver's credentials file; returns the token.

    The file holds only the token's SHA-256 (``producers.receiver.auth``); the caller gets the token.
    """
    import yaml  # the file may be the operator's YAML

    credentials_file = Path(credentials_file)
    data = yaml.safe_load(credentials_file.read_text()) if credentials_file.exists() else None
    callers = [c for c in (data or {}).get("callers", []) if c.get("identity") != identity]
    token = secrets.token_hex(32)
    callers.append({"identity": identity, "token_sha256": hashlib.sha256(token.encode()).hexdigest(), "endpoints": list(endpoints)})
    credentials_file.parent.mkdir(parents=True, exist_ok=True)
    credentials_file.write_text(yaml.safe_dump({"callers": callers}))
    os.chmod(credentials_file, 0o600)
    return token


# --- processes -------------------------------------------------------------------------------

def _binary(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise PeerError(f"{name} is not on PATH; install Debian's {package} (apt-get install -y {package})")
    return path


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            return resp.status == 200
    except (OSError, ValueError):
        return False


# Config files are written as JSON, which is YAML: this module imports nothing outside the standard
# library at load time, so `make binaries` can make MLflow's virtualenv before gpuledger's exists.


class _Peers:
    """Child processes started in order, stopped in reverse; ``_wait`` fails fast on a dead child."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir)
        self.procs: dict[str, ServiceProcess] = {}

    def _service(self, name: str, program: list[str], args: list[str], env: dict[str, str] | None = None) -> ServiceProcess:
        proc = ServiceProcess(args, env or {}, self.data_dir / "logs" / f"{name}.log", program=program).start()
        self.procs[name] = proc
        return proc

    def _wait(self, ready: Callable[[], bool], deadline: float, name: str, what: str) -> None:
        while time.monotonic() < deadline:
            proc = self.procs[name]
            if not proc.alive():
                raise PeerError(f"{name} exited with {proc.proc.returncode} while waiting for {what}:\n{proc.log_tail()}")
            if ready():
                return
            time.sleep(0.3)
        raise PeerError(f"timed out waiting for {what}:\n{self.procs[name].log_tail()}")

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            self.procs[name].stop(grace=10)
        self.procs.clear()


class AlertingPeers(_Peers):
    """Prometheus scraping ``exporter`` and evaluating the XID rule, Alertmanager routing to ``receiver_url``.

    ``receiver_url`` is the receiver's base URL (``http://127.0.0.1:P``); ``token`` a caller of
    its credentials file allowed to call ``alertmanager`` (``write_caller``), or None for a receiver
    without credentials (Alertmanager then sends no Authorization header).
    """

    def __init__(self, data_dir: Path, exporter: DcgmExporter, receiver_url: str, token: str | None,
                 evaluation_interval: str = "1s") -> None:
        super().__init__(data_dir)
        self.exporter = exporter
        self.receiver_url = receiver_url.rstrip("/")
        self.token = token
        self.evaluation_interval = evaluation_interval
        self.ports = {name: free_port() for name in ("prometheus", "alertmanager")}

    @property
    def prometheus_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['prometheus']}"

    @property
    def alertmanager_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['alertmanager']}"

    def start(self, timeout: float = 60.0) -> AlertingPeers:
        prometheus, alertmanager = _binary(PROMETHEUS, "prometheus"), _binary(ALERTMANAGER, "prometheus-alertmanager")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + timeout
        try:
            self._start_alertmanager(alertmanager)
            self._wait(lambda: _http_ok(f"{self.alertmanager_url}/-/ready"), deadline, "alertmanager", "Alertmanager /-/ready")
            self._start_prometheus(prometheus)
            self._wait(lambda: _http_ok(f"{self.prometheus_url}/-/ready"), deadline, "prometheus", "Prometheus /-/ready")
        except BaseException:
            self.stop()
            raise
        log.info("Prometheus at %s, Alertmanager at %s -> %s/v1/alertmanager", self.prometheus_url, self.alertmanager_url,
                 self.receiver_url)
        return self

    def _start_alertmanager(self, binary: str) -> None:
        webhook = {"url": f"{self.receiver_url}/v1/alertmanager", "send_resolved": True, "max_alerts": 0}
        if self.token is not None:
            token_file = self.data_dir / "alertmanager-token"
            token_file.write_text(self.token)
            os.chmod(token_file, 0o600)
            webhook["http_config"] = {"authorization": {"type": "Bearer", "credentials_file": str(token_file)}}
        config = {
            "route": {"receiver": "gpuledger", "group_by": ["alertname", "Hostname", "UUID", "GPU_I_ID"],
                      "group_wait": "1s", "group_interval": "1s", "repeat_interval": "4h"},
            "receivers": [{"name": "gpuledger", "webhook_configs": [webhook]}],
        }
        path = self.data_dir / "alertmanager.yml"
        path.write_text(json.dumps(config, indent=2))
        self._service("alertmanager", [binary], [
            f"--config.file={path}", f"--storage.path={self.data_dir / 'alertmanager'}",
            f"--web.listen-address=127.0.0.1:{self.ports['alertmanager']}", "--cluster.listen-address=", "--log.level=info"])

    def _start_prometheus(self, binary: str) -> None:
        rules = {"groups": [{"name": "gpu", "interval": self.evaluation_interval, "rules": [{
            "alert": XID_ALERT, "expr": "DCGM_FI_DEV_XID_ERRORS > 0", "for": "0s", "labels": {"severity": "critical"},
            "annotations": {"summary": "XID {{ $value }} on {{ $labels.Hostname }} GPU {{ $labels.gpu }} ({{ $labels.err_msg }})"}}]}]}
        rules_path = self.data_dir / "prometheus-rules.yml"
        rules_path.write_text(json.dumps(rules, indent=2))
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": self.evaluation_interval},
            "rule_files": [str(rules_path)],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{self.ports['alertmanager']}"]}]}]},
            # dcgm-exporter's own chart scrapes with honor_labels so the pod labels it maps stay the workload's.
            "scrape_configs": [{"job_name": "nvidia-dcgm-exporter", "honor_labels": True,
                                "static_configs": [{"targets": [self.exporter.target]}]}],
        }
        path = self.data_dir / "prometheus.yml"
        path.write_text(json.dumps(config, indent=2))
        self._service("prometheus", [binary], [
            f"--config.file={path}", f"--storage.tsdb.path={self.data_dir / 'prometheus'}",
            f"--web.listen-address=127.0.0.1:{self.ports['prometheus']}", "--log.level=info",
            # Resend firing alerts often: a short-lived test should not wait the default minute.
            "--rules.alert.resend-delay=1s"])

    def __enter__(self) -> AlertingPeers:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def ensure_mlflow_server(cache_dir: Path) -> Path:
    """The ``mlflow`` command of a virtualenv of its own in the cache, made once per pin.

    Not in gpuledger's environment: the server's GraphQL dependency (graphene) wants
    python-dateutil < 3 and the Kubernetes client >= 3, so one environment cannot hold both.
    gpuledger itself needs only the client (``mlflow-skinny``, the ``peers`` extra).
    """
    cache_dir = Path(cache_dir)
    venv = cache_dir / f"mlflow-{MLFLOW_VERSION}"
    binary, done = venv / "bin" / "mlflow", venv / ".installed"
    if done.exists():
        return binary
    with kubebin._locked(cache_dir, "mlflow-venv"):
        if done.exists():  # made by whoever held the lock
            return binary
        # Made in place (a virtualenv's scripts name its absolute path); ``.installed`` marks it complete.
        shutil.rmtree(venv, ignore_errors=True)
        log.info("installing mlflow %s into %s (first time: a minute or two)", MLFLOW_VERSION, venv)
        for cmd in ([sys.executable, "-m", "venv", str(venv)],
                    [str(venv / "bin" / "pip"), "install", "--quiet", f"mlflow=={MLFLOW_VERSION}"]):
            proc = subprocess.run(["nice", "-n", "10", *cmd], capture_output=True, text=True)
            if proc.returncode != 0:
                raise PeerError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
        done.write_text(MLFLOW_VERSION + "\n")
    return binary


class MlflowServer(_Peers):
    """``mlflow server`` on a sqlite store in ``data_dir``; ``client()`` is an ``MlflowClient`` on it."""

    def __init__(self, data_dir: Path, cache_dir: Path | None = None, port: int | None = None,
                 webhook_cache_ttl_s: int = 1) -> None:
        super().__init__(data_dir)
        self.webhook_cache_ttl_s = webhook_cache_ttl_s
        if cache_dir is None:
            from gpuledger.settings import default_cache_dir

            cache_dir = default_cache_dir()
        self.cache_dir = Path(cache_dir)
        self.port = port or free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> MlflowServer:
        from cryptography.fernet import Fernet

        mlflow_bin = ensure_mlflow_server(self.cache_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        key_file = self.data_dir / "webhook-secret.key"
        if not key_file.exists():
            key_file.write_bytes(Fernet.generate_key())
            os.chmod(key_file, 0o600)
        env = {
            # Each of the three is needed (REAL-PEERS.md): MLflow refuses plain-http and loopback targets by
            # default, and without a fixed key each server worker encrypts webhook secrets with its own.
            "MLFLOW_WEBHOOK_ALLOWED_SCHEMES": "http,https",
            "MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS": "true",
            "MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY": key_file.read_text().strip(),
            # The server caches its webhook list per event type (60 s by default) and does not drop
            # the cache when a webhook is created or deleted: a webhook made within a minute of an
            # event of its type is not used for that minute. One second, so that a new webhook
            # (a new test's receiver) takes effect at once.
            "MLFLOW_WEBHOOK_CACHE_TTL": str(self.webhook_cache_ttl_s),
            # Its job runner (a Huey consumer process per job kind, about ten Python processes) serves
            # GenAI jobs only; webhooks are delivered by the server's own threads. Off, the server
            # starts faster and leaves the CPU to the rest of the cluster.
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        }
        self._service("mlflow", [str(mlflow_bin)], [
            "server", "--backend-store-uri", f"sqlite:///{self.data_dir / 'mlflow.db'}",
            "--default-artifact-root", (self.data_dir / "artifacts").as_uri(),
            "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"], env=env)
        try:
            self._wait(lambda: _http_ok(f"{self.url}/health"), time.monotonic() + timeout, "mlflow", "MLflow /health")
        except BaseException:
            self.stop()
            raise
        log.info("MLflow at %s", self.url)
        return self

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.url, registry_uri=self.url)

    def create_webhook(self, receiver_url: str, secret: str, name: str = "gpuledger",
                       events: Iterable[str] = MLFLOW_WEBHOOK_EVENTS):
        """Register the receiver's ``/v1/mlflow`` as a webhook signed with ``secret`` (``MlflowClient.create_webhook``)."""
        return self.client().create_webhook(name=name, url=f"{receiver_url.rstrip('/')}/v1/mlflow", events=list(events),
                                            secret=secret)

    def delete_webhook(self, webhook_id: str) -> None:
        self.client().delete_webhook(webhook_id)

    def __enter__(self) -> MlflowServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# --- the peers of `gpuledger dev cluster up` ------------------------------------------------------

def start_peers(cluster_state: dict, data_dir: Path, cache_dir: Path, receiver_url: str, credentials_file: Path | None = None,
                mlflow_secret: str | None = None) -> tuple[dict, dict[str, int]]:
    """Start, in the background, what ``dev cluster up`` runs beside the cluster: the DCGM page and the
    kubelet doubles (``gpuledger.dev.peerhost``), Prometheus + Alertmanager to ``receiver_url`` and
    MLflow with a webhook to it. ``credentials_file``: the receiver's callers file, to which an
    ``service:alertmanager`` caller is added (else Alertmanager sends no token). Returns (how to
    reach each, pid per process); on failure stops what it started.
    """
    import tempfile

    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    state_path = data_dir / "cluster-state.json"
    state_path.write_text(json.dumps(cluster_state))
    sockets = data_dir / "kubelet"
    if len(str(sockets / "a-node-name-with-room.sock")) > 100:  # sockaddr_un
        sockets = Path(tempfile.mkdtemp(prefix="gpl-kubelet-"))
    metrics_port, control_port = free_port(), free_port()
    started: list = []
    try:
        host = ServiceProcess(["--state", str(state_path), "--metrics-port", str(metrics_port), "--control-port", str(control_port),
                               "--socket-dir", str(sockets)], {}, data_dir / "logs" / "peerhost.log",
                              program=[sys.executable, "-m", "gpuledger.dev.peerhost"]).start()
        started.append(host)
        page = DcgmExporter([], port=metrics_port)  # the page peerhost serves (only its address is used here)
        deadline = time.monotonic() + 60
        while not (_http_ok(page.url) and _http_ok(f"http://127.0.0.1:{control_port}/v1/devices")):
            if not host.alive() or time.monotonic() > deadline:
                raise PeerError(f"the DCGM page and kubelet doubles did not start:\n{host.log_tail()}")
            time.sleep(0.3)
        token = write_caller(credentials_file, "service:alertmanager", ("alertmanager",)) if credentials_file else None
        alerting = AlertingPeers(data_dir / "alerting", page, receiver_url, token).start()
        started.append(alerting)
        mlflow = MlflowServer(data_dir / "mlflow", cache_dir).start()
        started.append(mlflow)
        secret = mlflow_secret or secrets.token_hex(16)
        mlflow.create_webhook(receiver_url, secret)
    except BaseException:
        for part in reversed(started):
            part.stop()
        raise
    info = {"receiver_url": receiver_url, "dcgm_page": page.url, "xid_control": f"http://127.0.0.1:{control_port}/v1/xid",
            "kubelet_sockets": str(sockets), "prometheus": alerting.prometheus_url, "alertmanager": alerting.alertmanager_url,
            "alertmanager_token": f"a caller of {credentials_file}" if credentials_file else None,
            "mlflow": mlflow.url, "mlflow_webhook_secret": secret}
    pids = {"peerhost": host.proc.pid, **{name: p.proc.pid for name, p in alerting.procs.items()}, "mlflow": mlflow.procs["mlflow"].proc.pid}
    return info, pids
