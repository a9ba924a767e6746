"""A local real Kubernetes control plane with KWOK GPU nodes and Kueue (development and tests).

What runs (each a child process on 127.0.0.1 free ports, logs and data in one directory):
- **etcd** (Debian ``etcd-server``),
- **kube-apiserver**, **kube-controller-manager** and **kube-scheduler** of the pinned release
  (the multi-call binary of ``gpuledger.dev.kubebin``); serving certs, a CA and the
  service-account key pair are generated at start (``cryptography``), admin access is a
  static token (``tokens.csv``, group system:masters) written into ``kubeconfig``;
  the watch cache is off, so a compaction of etcd gives watchers a real ``410 Gone``;
- **KWOK** managing the Nodes created by ``LocalCluster`` (annotation ``kwok.x-k8s.io/node=fake``)
  with the stages of its module (node initialise/heartbeat, pod create/ready/complete/delete:
  a Job's pod completes after ``pod-complete.stage.kwok.x-k8s.io/delay``; each pod transition
  takes 0.2-1 s unless its ``<stage>.stage.kwok.x-k8s.io/delay`` annotation says otherwise).
  Nodes advertise ``nvidia.com/gpu`` and, on the MIG node, ``nvidia.com/mig-<profile>``
  the way the NVIDIA device plugin does (capacity = allocatable, no GPUs in ``status.images``);
- **Kueue** with its CRDs from the Go module cache, the ``batch/job`` integration, and its
  webhooks (mutating/validating for Kueue's own kinds and batch Jobs, CRD conversion)
  registered with ``url: https://127.0.0.1:<port>/...`` clientConfigs and our CA's bundle
  (there is no Service network). Kueue's visibility API server (an aggregated API behind a
  Service) is disabled; everything else is Kueue's own code.
- A ResourceFlavor, a ClusterQueue and a LocalQueue (``QUEUE`` in ``NAMESPACE``) whose quota
  covers the GPU nodes, so a Job labelled ``kueue.x-k8s.io/queue-name`` is admitted by Kueue.

``LocalCluster`` is a context manager (the pytest fixture); ``up``/``down``/``status`` keep one
running in the background for ``gpuledger dev cluster`` (state in ``<data_dir>/cluster/cluster.json``).
Limits: single etcd member, no kubelet (KWOK fakes pod lifecycles: no containers, no logs,
no exec), no Service network/kube-proxy/DNS, no admission webhooks other than Kueue's.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import secrets
import shutil
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gpuledger.dev import kubebin
from gpuledger.dev.localkafka import stop_pid
from gpuledger.dev.process import ServiceProcess, free_port

log = logging.getLogger(__name__)

NAMESPACE = "ml"
QUEUE = "gpu"
CLUSTER_QUEUE = "gpu-cluster-queue"
FLAVOR = "gpu"
KUEUE_NAMESPACE = "kueue-system"
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_API = f"{KUEUE_GROUP}/v1beta2"
#: Kueue webhooks we register: its own kinds and batch Jobs (the one integration enabled).
_KUEUE_WEBHOOK_PATHS = ("-kueue-x-k8s-io-", "-batch-v1-job")
_KWOK_STAGES = ("node/fast/node-initialize.yaml", "node/heartbeat/node-heartbeat.yaml",
                *(f"pod/general/{n}.yaml" for n in ("pod-create", "pod-init-container-running", "pod-init-container-completed",
                                                    "pod-ready", "pod-complete", "pod-delete")))


#: What a kubelet does with a pod being deleted gracefully that still carries finalizers (a Job's pod has
#: ``batch.kubernetes.io/job-tracking`` until the Job controller sees it finished): it stops the
#: containers and reports the pod Failed (restartPolicy Never), after which the controller drops its
#: finalizer and KWOK's ``pod-delete`` stage removes it. KWOK's stages have no such step, so an evicted
#: Job pod (Eviction API, kubectl drain) stayed Terminating for ever; Kueue's preemption and a Job's
#: deletion do not need it (the Job controller drops the finalizer of pods it deletes itself).
_POD_TERMINATE_STAGE = {
    "apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "Stage", "metadata": {"name": "pod-terminate"},
    "spec": {
        "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
        "selector": {"matchExpressions": [
            {"key": ".metadata.deletionTimestamp", "operator": "Exists"},
            {"key": ".metadata.finalizers", "operator": "Exists"},
            {"key": ".status.phase", "operator": "In", "values": ["Pending", "Running"]}]},
        "weight": 1,
        "delay": {"durationMilliseconds": 200, "jitterDurationMilliseconds": 1000},
        "next": {"delete": False, "statusTemplate": (
            "{{ $now := Now }}\n"
            "containerStatuses:\n"
            "{{ range $index, $item := .spec.containers }}\n"
            "- image: {{ $item.image | Quote }}\n"
            "  name: {{ $item.name | Quote }}\n"
            "  ready: false\n"
            "  restartCount: 0\n"
            "  started: false\n"
            "  state:\n"
            "    terminated:\n"
            "      exitCode: 143\n"
            "      finishedAt: {{ $now | Quote }}\n"
            "      reason: Error\n"
            "      startedAt: {{ $now | Quote }}\n"
            "{{ end }}\n"
            "phase: Failed\n")},
    },
}


class ClusterError(RuntimeError):
    """The local cluster could not be built, started or found."""


@dataclass(frozen=True)
class GpuNode:
    """A KWOK node and the extended resources the NVIDIA device plugin would advertise on it."""

    name: str
    gpus: int = 0
    mig: tuple[tuple[str, int], ...] = ()  # (profile, count): nvidia.com/mig-<profile>
    product: str = "NVIDIA-H100-80GB-HBM3"

    def resources(self) -> dict[str, str]:
        res = {"cpu": "64", "memory": "512Gi", "pods": "110"}
        if self.gpus:
            res["nvidia.com/gpu"] = str(self.gpus)
        for profile, count in self.mig:
            res[f"nvidia.com/mig-{profile}"] = str(count)
        return res


DEFAULT_NODES = (GpuNode("gpu-node-1", gpus=8), GpuNode("gpu-node-2", gpus=8),
                 GpuNode("gpu-node-mig", mig=(("1g.10gb", 7),), product="NVIDIA-A100-SXM4-80GB"))


# --- PKI -------------------------------------------------------------------------------

#: Kueue's internal cert management (open-policy-agent/cert-controller) keeps the certs of this
#: Secret when they verify for its Service name and stay valid past its 90-day lookahead.
KUEUE_CERT_SECRET = "kueue-webhook-server-cert"
#: The common name of the client certificate the API server presents to admission webhooks
#: (``LocalCluster._write_webhook_client``).
WEBHOOK_CLIENT_NAME = "kube-apiserver-webhook-client"
KUEUE_WEBHOOK_DNS = f"kueue-webhook-service.{KUEUE_NAMESPACE}.svc"


def _write_pki(pki: Path) -> None:
    """A CA, one serving cert (127.0.0.1, the apiserver's and Kueue's webhook names) and the SA key pair.

    The CA key is RSA in PKCS#1 and the CA names itself ``kueue-ca``, both because Kueue's cert
    rotator reads and checks the CA of its Secret that way.
    """
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    pki.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
    until = now + dt.timedelta(days=3650)

    def key_pem(key, fmt=serialization.PrivateFormat.PKCS8) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption())

    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kueue-ca"),
                         x509.NameAttribute(NameOID.ORGANIZATION_NAME, "gpuledger-local")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(until)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                       key_encipherment=True, data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectAlternativeName([x509.DNSName("kueue-ca")]), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost"), x509.DNSName("kubernetes"),
             x509.DNSName("kubernetes.default"), x509.DNSName("kubernetes.default.svc"), x509.DNSName(KUEUE_WEBHOOK_DNS)]
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(until)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    sa_key = ec.generate_private_key(ec.SECP256R1())
    (pki / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (pki / "ca.key").write_bytes(key_pem(ca_key, serialization.PrivateFormat.TraditionalOpenSSL))
    (pki / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (pki / "tls.key").write_bytes(key_pem(key))
    (pki / "sa.key").write_bytes(key_pem(sa_key))
    (pki / "sa.pub").write_bytes(sa_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                                  serialization.PublicFormat.SubjectPublicKeyInfo))
    for name in ("ca.key", "tls.key", "sa.key"):
        os.chmod(pki / name, 0o600)


# --- the cluster -----------------------------------------------------------------------

class LocalCluster:
    """The control plane, KWOK and Kueue as child processes; ``kubeconfig`` reaches it as admin."""

    def __init__(self, data_dir: Path, cache_dir: Path | None = None, nodes: tuple[GpuNode, ...] = DEFAULT_NODES,
                 kueue: bool = True) -> None:
        self.data_dir = Path(data_dir)
        if cache_dir is None:
            from gpuledger.settings import default_cache_dir

            cache_dir = default_cache_dir()
        self.cache_dir = Path(cache_dir)
        self.nodes = nodes
        self.with_kueue = kueue
        self.pki = self.data_dir / "pki"
        self.kubeconfig = self.data_dir / "kubeconfig"
        self.token = secrets.token_hex(16)
        self.ports = {name: free_port() for name in ("etcd", "etcd_peer", "apiserver", "controller_manager", "scheduler",
                                                     "kwok", "kueue_webhook", "kueue_metrics", "kueue_health")}
        self.procs: dict[str, ServiceProcess] = {}
        self.webhook_client_ca: Path | None = None  # the CA of the API server's webhook client certificate (start)

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    @property
    def etcd_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['etcd']}"

    # -- start ----------------------------------------------------------------------------

    def start(self, timeout: float = 180.0) -> LocalCluster:
        etcd = shutil.which("etcd")
        if etcd is None:
            raise ClusterError("etcd is not on PATH; install Debian's etcd-server (apt-get install -y etcd-server)")
        bins = {"kube": kubebin.ensure_kube(self.cache_dir), "kwok": kubebin.ensure_go_tool(*kubebin.KWOK, self.cache_dir)}
        if self.with_kueue:
            bins["kueue"] = kubebin.ensure_go_tool(*kubebin.KUEUE, self.cache_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        _write_pki(self.pki)
        self._write_webhook_client()
        (self.data_dir / "tokens.csv").write_text(f"{self.token},admin,admin,system:masters\n")
        self._write_kubeconfig()
        # One start at a time on this machine (a lock file in the cache dir): the API server's bootstrap
        # (RBAC reconciliation, Kueue's CRDs and webhooks) is the heavy part, and four control planes
        # starting at once on 2 cores (the test suite's xdist workers) slowed etcd's requests to seconds,
        # so that kube-controller-manager gave up waiting for a healthy API server and exited.
        # The timeout counts from when this start has the lock.
        with kubebin._locked(self.cache_dir, "cluster-start"):
            deadline = time.monotonic() + timeout
            try:
                self._start_etcd(etcd)
                self._wait(lambda: self._http_ok(f"{self.etcd_url}/health"), deadline, "etcd", "etcd /health")
                self._start_apiserver(bins["kube"])
                self._wait(lambda: self._http_ok(f"{self.server}/readyz", token=True), deadline, "apiserver", "kube-apiserver /readyz")
                self._start_controllers(bins["kube"])
                for name in ("controller_manager", "scheduler"):
                    self._wait(lambda n=name: self._http_ok(f"https://127.0.0.1:{self.ports[n]}/healthz", verify=False), deadline,
                               name, f"{name} /healthz")
                self._start_kwok(bins["kwok"])
                self._create_nodes()
                self._wait(self._nodes_ready, deadline, "kwok", "KWOK nodes Ready")
                self._wait(lambda: self._get(f"/api/v1/namespaces/default/serviceaccounts/default") is not None, deadline,
                           "controller_manager", "the default ServiceAccount (kube-controller-manager)")
                if self.with_kueue:
                    self._start_kueue(bins["kueue"], deadline)
                    self._wait(lambda: self._http_ok(f"http://127.0.0.1:{self.ports['kueue_health']}/readyz"), deadline, "kueue",
                               "Kueue /readyz")
                    self._create_queues(deadline)
            except BaseException:
                self.stop()
                raise
        log.info("local cluster ready at %s (kubeconfig %s)", self.server, self.kubeconfig)
        return self

    def _service(self, name: str, program: list[str], args: list[str], env: dict[str, str] | None = None) -> None:
        proc = ServiceProcess(args, env or {}, self.data_dir / "logs" / f"{name}.log", program=program).start()
        self.procs[name] = proc

    def _start_etcd(self, etcd: str) -> None:
        self._service("etcd", [etcd], [
            f"--data-dir={self.data_dir / 'etcd'}", f"--listen-client-urls={self.etcd_url}", f"--advertise-client-urls={self.etcd_url}",
            f"--listen-peer-urls=http://127.0.0.1:{self.ports['etcd_peer']}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{self.ports['etcd_peer']}",
            f"--initial-cluster=default=http://127.0.0.1:{self.ports['etcd_peer']}", "--log-level=warn"])

    def _write_webhook_client(self) -> None:
        """The client certificate the API server presents to admission webhooks that ask for one
        (``gpuledger admit --client-ca``: ``webhook_client_ca`` signed it; docs/admission.md): an
        AdmissionConfiguration whose ``ValidatingAdmissionWebhook`` kubeconfig gives it for every
        webhook host (``'*'``, the default entry). Kueue's webhooks ask for none, so they get none."""
        from producers.admission.certs import client_certificates

        ca, cert, key = client_certificates(self.pki / "webhook-client", common_name=WEBHOOK_CLIENT_NAME)
        kubeconfig = self.pki / "webhook-client" / "kubeconfig"
        kubeconfig.write_text(json.dumps({"apiVersion": "v1", "kind": "Config", "clusters": [], "contexts": [], "users": [
            {"name": "*", "user": {"client-certificate": str(cert), "client-key": str(key)}}]}))
        (self.data_dir / "admission-config.json").write_text(json.dumps({
            "apiVersion": "apiserver.config.k8s.io/v1", "kind": "AdmissionConfiguration", "plugins": [
                {"name": "ValidatingAdmissionWebhook", "configuration": {
                    "apiVersion": "apiserver.config.k8s.io/v1", "kind": "WebhookAdmissionConfiguration", "kubeConfigFile": str(kubeconfig)}}]}))
        self.webhook_client_ca = ca

    def _start_apiserver(self, kube: Path) -> None:
        pki, kc = self.pki, str(self.kubeconfig)
        self._service("apiserver", [str(kube), "kube-apiserver"], [
            f"--etcd-servers={self.etcd_url}", "--bind-address=127.0.0.1", f"--secure-port={self.ports['apiserver']}",
            "--advertise-address=127.0.0.1", f"--tls-cert-file={pki / 'tls.crt'}", f"--tls-private-key-file={pki / 'tls.key'}",
            f"--client-ca-file={pki / 'ca.crt'}", f"--token-auth-file={self.data_dir / 'tokens.csv'}", "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc", f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}", "--service-cluster-ip-range=10.96.0.0/24",
            f"--admission-control-config-file={self.data_dir / 'admission-config.json'}",
            # Watches read etcd directly: an etcd compaction then yields a real 410 Gone (tests rely on it).
            "--watch-cache=false", "--v=1"])

    def _start_controllers(self, kube: Path) -> None:
        """kube-controller-manager and kube-scheduler, once the API server is ready: the
        controller-manager waits only about 10 s for a healthy API server and then exits, which
        a loaded machine's API server bootstrap (RBAC reconciliation) outlasted in CI."""
        pki, kc = self.pki, str(self.kubeconfig)
        common = [f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
                  "--bind-address=127.0.0.1", "--leader-elect=false", "--v=1"]
        self._service("controller_manager", [str(kube), "kube-controller-manager"], [
            *common, f"--secure-port={self.ports['controller_manager']}", f"--cert-dir={self.data_dir / 'kcm-certs'}",
            f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
            "--use-service-account-credentials=false"])
        self._service("scheduler", [str(kube), "kube-scheduler"], [
            *common, f"--secure-port={self.ports['scheduler']}", f"--cert-dir={self.data_dir / 'scheduler-certs'}"])

    def _start_kwok(self, kwok: Path) -> None:
        stages = kubebin.module_dir(*kubebin.KWOK) / "kustomize" / "stage"
        config = self.data_dir / "kwok-stages.yaml"
        docs = [yaml.safe_load((stages / s).read_text()) for s in _KWOK_STAGES]
        for doc in docs:
            delay = doc["spec"].get("delay")
            if doc["spec"]["resourceRef"]["kind"] == "Pod" and delay:
                # The general stages wait 1-6 s per pod transition; 0.2-1 s keeps tests quick.
                # A pod's <stage>.stage.kwok.x-k8s.io/delay annotations still override it.
                delay.update(durationMilliseconds=200, jitterDurationMilliseconds=1000)
        docs.append(_POD_TERMINATE_STAGE)
        config.write_text(yaml.safe_dump_all(docs))
        self._service("kwok", [str(kwok)], [
            f"--kubeconfig={self.kubeconfig}", f"--config={config}", "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake", "--cidr=10.0.0.1/16", "--node-ip=10.0.0.1",
            f"--server-address=127.0.0.1:{self.ports['kwok']}"])

    def _crd_established(self, name: str) -> bool:
        crd = self._get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}") or {}
        return any(c["type"] == "Established" and c["status"] == "True" for c in (crd.get("status") or {}).get("conditions") or [])

    def _start_kueue(self, kueue: Path, deadline: float) -> None:
        mod = kubebin.module_dir(*kubebin.KUEUE)
        ca_bundle = _b64((self.pki / "ca.crt").read_bytes())
        webhook = f"https://127.0.0.1:{self.ports['kueue_webhook']}"
        self.ensure_namespace(KUEUE_NAMESPACE)
        conversion = {p.name.removeprefix("webhook_in_").removesuffix(".yaml")
                      for p in (mod / "config/components/crd/patches").glob("webhook_in_*.yaml")}
        listed = yaml.safe_load((mod / "config/components/crd/kustomization.yaml").read_text())
        active = {Path(p["path"]).name.removeprefix("webhook_in_").removesuffix(".yaml") for p in listed.get("patches") or []}
        crds: list[str] = []
        for crd_file in sorted((mod / "config/components/crd/bases").glob("*.yaml")):
            crd = yaml.safe_load(crd_file.read_text())
            plural = crd["spec"]["names"]["plural"]
            if plural in conversion & active:
                crd["spec"]["conversion"] = {"strategy": "Webhook", "webhook": {
                    "conversionReviewVersions": ["v1"], "clientConfig": {"url": f"{webhook}/convert", "caBundle": ca_bundle}}}
            self.apply("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
            crds.append(crd["metadata"]["name"])
        # Kueue's informers fail at start on a CRD that is not served yet.
        self._wait(lambda: all(self._crd_established(n) for n in crds), deadline, "apiserver", "Kueue's CRDs Established")
        for doc in yaml.safe_load_all((mod / "config/components/webhook/manifests.yaml").read_text()):
            if not doc:
                continue
            kind = doc["kind"]
            doc["metadata"]["name"] = f"kueue-{doc['metadata']['name']}"
            hooks = []
            for hook in doc["webhooks"]:
                path = hook["clientConfig"]["service"]["path"]
                if any(p in path for p in _KUEUE_WEBHOOK_PATHS):
                    hook["clientConfig"] = {"url": f"{webhook}{path}", "caBundle": ca_bundle}
                    hooks.append(hook)
            doc["webhooks"] = hooks
            plural = "mutatingwebhookconfigurations" if kind == "MutatingWebhookConfiguration" else "validatingwebhookconfigurations"
            self.apply(f"/apis/admissionregistration.k8s.io/v1/{plural}", doc)
        # Kueue's internal cert management keeps the CA bundles of its webhooks and CRDs in sync
        # with its Secret and waits until certDir holds the Secret's certs (in a pod, the kubelet
        # mounts the Secret there; here we copy them). Seeded with our CA and serving cert (which
        # also names 127.0.0.1) it keeps them. (With it off, Kueue 0.17 reads its metrics cert
        # from the fixed path /etc/kueue/metrics/certs.)
        self.apply(f"/api/v1/namespaces/{KUEUE_NAMESPACE}/secrets", {
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": KUEUE_CERT_SECRET, "namespace": KUEUE_NAMESPACE},
            "data": {name: _b64((self.pki / name).read_bytes()) for name in ("ca.crt", "ca.key", "tls.crt", "tls.key")}})
        certs = self.data_dir / "kueue-certs"
        certs.mkdir(exist_ok=True)
        for name in ("ca.crt", "ca.key", "tls.crt", "tls.key"):
            shutil.copy(self.pki / name, certs / name)
        config = {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration", "namespace": KUEUE_NAMESPACE,
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.ports['kueue_health']}"},
            "metrics": {"bindAddress": f"127.0.0.1:{self.ports['kueue_metrics']}"},
            "webhook": {"host": "127.0.0.1", "port": self.ports["kueue_webhook"], "certDir": str(certs)},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": True, "webhookServiceName": "kueue-webhook-service",
                                       "webhookSecretName": KUEUE_CERT_SECRET},
            "integrations": {"frameworks": ["batch/job"]},
            # An aggregated API behind a Service: no Service network here.
            "featureGates": {"VisibilityOnDemand": False},
        }
        path = self.data_dir / "kueue-config.yaml"
        path.write_text(yaml.safe_dump(config))
        self._service("kueue", [str(kueue)], [f"--config={path}", "--zap-log-level=2"], env={"KUBECONFIG": str(self.kubeconfig)})

    # -- objects --------------------------------------------------------------------------

    def _create_nodes(self) -> None:
        for node in self.nodes:
            labels = {"kubernetes.io/hostname": node.name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                      "type": "kwok", "nvidia.com/gpu.product": node.product,
                      "nvidia.com/mig.strategy": "mixed" if node.mig else "none"}
            if node.gpus:
                labels["nvidia.com/gpu.count"] = str(node.gpus)
            body = {"apiVersion": "v1", "kind": "Node",
                    "metadata": {"name": node.name, "labels": labels, "annotations": {KWOK_NODE_ANNOTATION: "fake"}},
                    "status": {"capacity": node.resources(), "allocatable": node.resources()}}
            self.apply("/api/v1/nodes", body)
            # Creation drops .status; KWOK's node stage keeps what is there, so set it now.
            self.request("PATCH", f"/api/v1/nodes/{node.name}/status", {"status": body["status"]},
                         content_type="application/merge-patch+json")

    def _nodes_ready(self) -> bool:
        nodes = (self._get("/api/v1/nodes") or {}).get("items", [])
        ready = {n["metadata"]["name"] for n in nodes
                 if any(c["type"] == "Ready" and c["status"] == "True" for c in n.get("status", {}).get("conditions", []))}
        return all(n.name in ready for n in self.nodes)

    def _create_queues(self, deadline: float) -> None:
        self.ensure_namespace(NAMESPACE)
        totals: dict[str, int] = {"cpu": 0, "memory": 0}
        for node in self.nodes:
            for res, qty in node.resources().items():
                if res == "memory":
                    totals[res] += int(qty.removesuffix("Gi"))
                elif res != "pods":
                    totals[res] = totals.get(res, 0) + int(qty)
        resources = [{"name": r, "nominalQuota": f"{q}Gi" if r == "memory" else str(q)} for r, q in sorted(totals.items())]
        objects = [
            (f"/apis/{KUEUE_API}/resourceflavors", {"apiVersion": KUEUE_API, "kind": "ResourceFlavor", "metadata": {"name": FLAVOR}}),
            (f"/apis/{KUEUE_API}/clusterqueues", {
                "apiVersion": KUEUE_API, "kind": "ClusterQueue", "metadata": {"name": CLUSTER_QUEUE},
                "spec": {"namespaceSelector": {}, "preemption": {"withinClusterQueue": "LowerPriority"},
                         "resourceGroups": [{"coveredResources": [r["name"] for r in resources],
                                             "flavors": [{"name": FLAVOR, "resources": resources}]}]}}),
            (f"/apis/{KUEUE_API}/namespaces/{NAMESPACE}/localqueues", {
                "apiVersion": KUEUE_API, "kind": "LocalQueue", "metadata": {"name": QUEUE, "namespace": NAMESPACE},
                "spec": {"clusterQueue": CLUSTER_QUEUE}}),
        ]
        for path, body in objects:
            # Kueue's webhooks may need a moment after /readyz before the API server reaches them.
            self._wait(lambda p=path, b=body: self._try_apply(p, b), deadline, "kueue", f"creating {body['kind']} {body['metadata']['name']}")

    def _try_apply(self, path: str, body: dict) -> bool:
        try:
            self.apply(path, body)
            return True
        except ClusterError as exc:
            log.debug("%s", exc)
            return False

    def ensure_namespace(self, name: str) -> None:
        self.apply("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})

    # -- HTTP to the API server (stdlib: the official client is overkill for a few POSTs) -----

    def _ssl(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.pki / "ca.crt"))

    def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.server}{path}", data=data, method=method,
                                     headers={"Authorization": f"Bearer {self.token}", "Content-Type": content_type,
                                              "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, context=self._ssl(), timeout=30) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            raise ClusterError(f"{method} {path}: HTTP {exc.code}: {exc.read()[:1000].decode(errors='replace')}") from exc
        except OSError as exc:
            raise ClusterError(f"{method} {path}: {exc}") from exc

    def apply(self, collection: str, body: dict) -> None:
        """Create ``body`` under ``collection``; an existing object of that name is left as it is."""
        try:
            self.request("POST", collection, body)
        except ClusterError as exc:
            if "HTTP 409" not in str(exc):
                raise

    def _get(self, path: str) -> Any:
        try:
            return self.request("GET", path)
        except ClusterError:
            return None

    def _http_ok(self, url: str, token: bool = False, verify: bool = True) -> bool:
        headers = {"Authorization": f"Bearer {self.token}"} if token else {}
        if url.startswith("https:"):
            # kube-controller-manager and kube-scheduler serve /healthz with a self-signed cert of their own.
            ctx = self._ssl() if verify else ssl._create_unverified_context()  # noqa: S323 - loopback health probe
        else:
            ctx = None
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), context=ctx, timeout=5) as resp:
                return resp.status == 200
        except (OSError, ValueError):
            return False

    def _wait(self, ready: Callable[[], bool], deadline: float, component: str, what: str) -> None:
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if not proc.alive():
                    raise ClusterError(f"{name} exited with {proc.proc.returncode} while waiting for {what}:\n{proc.log_tail()}")
            if ready():
                return
            time.sleep(0.5)
        proc = self.procs.get(component)
        raise ClusterError(f"timed out waiting for {what}:\n{proc.log_tail() if proc else ''}")

    def _write_kubeconfig(self) -> None:
        ca = _b64((self.pki / "ca.crt").read_bytes())
        config = {"apiVersion": "v1", "kind": "Config", "current-context": "gpuledger-local",
                  "clusters": [{"name": "gpuledger-local", "cluster": {"server": self.server, "certificate-authority-data": ca}}],
                  "users": [{"name": "admin", "user": {"token": self.token}}],
                  "contexts": [{"name": "gpuledger-local", "context": {"cluster": "gpuledger-local", "user": "admin"}}]}
        self.kubeconfig.write_text(yaml.safe_dump(config))
        os.chmod(self.kubeconfig, 0o600)

    # -- etcd -----------------------------------------------------------------------------

    def compact_etcd(self) -> int:
        """Compact etcd at its current revision (through its gRPC gateway); returns the revision.

        Watches resumed from an older resourceVersion then fail with 410 Gone, as after the
        API server's own periodic compaction.
        """
        def post(path: str, body: dict) -> dict:
            req = urllib.request.Request(f"{self.etcd_url}{path}", data=json.dumps(body).encode(), method="POST")
            with urllib.request.urlopen(req, timeout=10) as resp:
                return json.loads(resp.read())

        revision = int(post("/v3/kv/range", {"key": _b64(b"/"), "limit": 1})["header"]["revision"])
        post("/v3/kv/compaction", {"revision": revision, "physical": True})
        return revision

    # -- stop -----------------------------------------------------------------------------

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            self.procs[name].stop(grace=10)
        self.procs.clear()

    def state(self) -> dict[str, Any]:
        return {"server": self.server, "kubeconfig": str(self.kubeconfig), "data_dir": str(self.data_dir),
                "pids": {name: p.proc.pid for name, p in self.procs.items()}, "ports": self.ports,
                "versions": {"kubernetes": kubebin.KUBE_VERSION, "kwok": kubebin.KWOK[1], "kueue": kubebin.KUEUE[1]}}

    @classmethod
    def attach(cls, state: dict[str, Any], nodes: tuple[GpuNode, ...] = DEFAULT_NODES) -> LocalCluster:
        """The running cluster ``state`` describes (``up``'s cluster.json), for API calls; starts nothing."""
        cluster = cls(Path(state["data_dir"]), Path(state["data_dir"]), nodes=nodes)
        cluster.ports = dict(state["ports"])
        cluster.token = (cluster.data_dir / "tokens.csv").read_text().split(",", 1)[0]
        return cluster

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()


# --- the background cluster of `gpuledger dev cluster up|down|status` -----------------------

def state_file(data_dir: Path) -> Path:
    return Path(data_dir) / "cluster" / "cluster.json"


def running_cluster(data_dir: Path) -> dict | None:
    """The cluster recorded by ``up``, if all its processes are alive."""
    try:
        state = json.loads(state_file(data_dir).read_text())
        for pid in state["pids"].values():
            os.kill(int(pid), 0)
    except (OSError, ValueError, KeyError):
        return None
    return state


def up(data_dir: Path, cache_dir: Path | None = None, peers: bool = True, receiver_url: str = "http://127.0.0.1:9095",
       credentials_file: Path | None = None, mlflow_secret: str | None = None) -> dict:
    """Start the cluster in the background (and, with ``peers``, ``gpuledger.dev.peers.start_peers``
    wired to ``receiver_url``); its state, also written to ``cluster.json``. A running one is returned as is."""
    existing = running_cluster(data_dir)
    if existing:
        return existing
    down(data_dir)  # a half-dead one: stop what is left
    root = Path(data_dir) / "cluster"
    shutil.rmtree(root, ignore_errors=True)
    cluster = LocalCluster(root, cache_dir).start()
    state = cluster.state()
    if peers:
        from gpuledger.dev.peers import start_peers

        try:
            state["peers"], pids = start_peers(state, root / "peers", cluster.cache_dir, receiver_url, credentials_file, mlflow_secret)
        except BaseException:
            cluster.stop()
            raise
        state["pids"].update(pids)
    state_file(data_dir).write_text(json.dumps(state, indent=2))
    return state


def down(data_dir: Path) -> dict | None:
    try:
        state = json.loads(state_file(data_dir).read_text())
    except (OSError, ValueError):
        return None
    for pid in reversed(list(state.get("pids", {}).values())):
        stop_pid(int(pid), timeout=10)
    state_file(data_dir).unlink(missing_ok=True)
    return state
