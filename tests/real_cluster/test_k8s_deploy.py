"""deploy/k8s applied to the real API server: each overlay rendered by the pinned kustomize,
every object server-side applied in dry-run and then for real, its pods scheduled on KWOK's GPU
nodes, Pod Security ``restricted`` met by every pod but the pod-resources collector's, and
every ServiceAccount's access checked with SubjectAccessReviews both ways.

The test covers whatever the rendered overlay holds: a component added to the base (such as
``base/admit``) is applied, dry-run and scheduled with the rest without a change here. Only
its ServiceAccount needs a row in ``RBAC`` — the test fails, naming it, until it has one.

What is applied is the README's "Pointing it at a real cluster": its overlay (``readme_overlay``:
the image by digest, the Kafka settings merged into the base's ConfigMap) on each of our
overlays, moved into a namespace of the test's own; the Secrets its ``kubectl create secret``
lines name (``user_secrets``); and storage for the embedded worker's claim, which a
provisioner would give (this cluster has none).
Limits: no kubelet, so no container runs (KWOK marks pods Running and Ready) and probes are
not exercised; NetworkPolicies are accepted by the API server but nothing enforces them (no CNI).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes import dynamic
from kubernetes.client.rest import ApiException

from gpuledger.dev import kubebin
from gpuledger.dev.cluster import KWOK_NODE_ANNOTATION
from producers.receiver.auth import Caller
from tests.real_cluster.conftest import REAL_CLUSTER, unique, wait_for

pytestmark = REAL_CLUSTER

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ROOT / "deploy" / "k8s" / "overlays"
README = ROOT / "README.md"
FIELD_MANAGER = "gpuledger-deploy-test"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")
#: Applied first (others live in them or are their instances) and last (webhook configurations
#: would intercept the objects applied after them).
FIRST_KINDS = ("Namespace", "CustomResourceDefinition")
LAST_KINDS = ("ValidatingWebhookConfiguration", "MutatingWebhookConfiguration")


# --- what each ServiceAccount may do -------------------------------------------------------

@dataclass(frozen=True)
class Access:
    """One SubjectAccessReview: ``verb`` on ``resource`` (``pods``, ``pods/status``,
    ``workloads.kueue.x-k8s.io``, ``workloads.kueue.x-k8s.io/status``) in ``where``:
    ``cluster`` (all namespaces), ``own`` (the deploy namespace) or ``other`` (another one)."""

    verb: str
    resource: str
    where: str = "cluster"

    def attributes(self, own: str) -> dict:
        name, _, sub = self.resource.partition("/")
        plural, _, group = name.partition(".")
        attrs = {"verb": self.verb, "group": group, "resource": plural, "subresource": sub}
        if self.where != "cluster":
            attrs["namespace"] = own if self.where == "own" else "default"
        return attrs


@dataclass(frozen=True)
class Expect:
    allowed: tuple[Access, ...]  # what the component needs: every grant of its RBAC is one of these
    denied: tuple[Access, ...]   # a neighbouring verb or resource it must not get


_READ = ("get", "list", "watch")
#: Every ServiceAccount deploy/k8s renders, with its expectations. Add a row with a component.
RBAC: dict[str, Expect] = {
    # Watches GPU pods, their Events, Kueue Workloads and DRA slices and claims cluster-wide (docs/collectors.md, RBAC).
    "gpuledger-scheduler": Expect(
        allowed=tuple(Access(v, r) for r in ("pods", "events", "events.events.k8s.io", "workloads.kueue.x-k8s.io",
                                             "resourceslices.resource.k8s.io", "resourceclaims.resource.k8s.io") for v in _READ),
        denied=(Access("create", "pods"), Access("delete", "pods"), Access("patch", "pods/status"), Access("get", "pods/log"),
                Access("get", "secrets"), Access("list", "configmaps"), Access("list", "nodes"),
                Access("update", "workloads.kueue.x-k8s.io"), Access("patch", "workloads.kueue.x-k8s.io/status"),
                Access("list", "clusterqueues.kueue.x-k8s.io"), Access("create", "events"),
                Access("patch", "resourceclaims.resource.k8s.io/status"), Access("create", "resourceclaims.resource.k8s.io"),
                Access("list", "resourceclaimtemplates.resource.k8s.io"), Access("create", "resourceslices.resource.k8s.io"))),
    # Talks to its node's kubelet only: no API access at all.
    "gpuledger-podresources": Expect(allowed=(), denied=(Access("get", "pods"), Access("list", "nodes"), Access("get", "secrets", "own"))),
    # Kafka only: no API access; not even the Secrets it mounts (the kubelet reads those).
    "gpuledger-receiver": Expect(allowed=(), denied=(Access("get", "secrets", "own"), Access("list", "pods", "own"),
                                                     Access("get", "configmaps", "own"))),
    "gpuledger-worker": Expect(allowed=(), denied=(Access("get", "configmaps", "own"), Access("get", "secrets", "own"),
                                                   Access("list", "pods"))),
    # The admission webhook decides from Kafka's release state, and reads DRA claims and device classes (get only).
    "gpuledger-admit": Expect(allowed=tuple(Access("get", f"{r}.resource.k8s.io") for r in ("resourceclaims", "resourceclaimtemplates", "deviceclasses")),
                              denied=(Access("get", "workloads.kueue.x-k8s.io"), Access("get", "secrets", "own"), Access("list", "pods"),
                                      Access("list", "resourceclaims.resource.k8s.io"), Access("get", "pods"),
                                      Access("create", "resourceclaims.resource.k8s.io"))),
    # The Kueue AdmissionCheck controller: reads Workloads and AdmissionChecks, writes only their status.
    "gpuledger-admit-controller": Expect(
        allowed=(*(Access(v, r) for r in ("workloads.kueue.x-k8s.io", "admissionchecks.kueue.x-k8s.io") for v in _READ),
                 Access("patch", "workloads.kueue.x-k8s.io/status"), Access("patch", "admissionchecks.kueue.x-k8s.io/status"),
                 *(Access("get", f"{r}.resource.k8s.io") for r in ("resourceclaims", "resourceclaimtemplates", "deviceclasses"))),
        denied=(Access("update", "workloads.kueue.x-k8s.io"), Access("patch", "workloads.kueue.x-k8s.io"),
                Access("delete", "workloads.kueue.x-k8s.io"), Access("patch", "clusterqueues.kueue.x-k8s.io/status"),
                Access("patch", "pods"), Access("get", "secrets", "own"))),
}


# --- rendering and applying -----------------------------------------------------------------

@pytest.fixture(scope="module")
def kustomize(real_cluster) -> Path:
    return kubebin.ensure_kustomize(real_cluster.cache_dir)


def readme_overlay() -> dict:
    """The kustomization the README has the user write (``cat > my-gpuledger/kustomization.yaml``)."""
    text = README.read_text()
    start = text.index("cat > my-gpuledger/kustomization.yaml <<'YAML'\n")
    body = text[text.index("\n", start) + 1:]
    return yaml.safe_load(body[:body.index("\nYAML\n")])


def readme_secrets() -> set[str]:
    """The Secrets the README's ``kubectl … create secret`` lines name."""
    return {line.split("create secret ", 1)[1].split()[1] for line in README.read_text().splitlines()
            if line.startswith("kubectl ") and "create secret " in line}


def render(kustomize: Path, overlay: str, namespace: str, work: Path) -> list[dict]:
    """``kustomize build`` of the README's overlay on ``overlay``, moved into ``namespace``."""
    user = readme_overlay()
    (base,) = user["resources"]
    assert base.startswith("../deploy/k8s/overlays/"), base
    work.mkdir(parents=True, exist_ok=True)
    (work / "kustomization.yaml").write_text(yaml.safe_dump({
        **user, "namespace": namespace, "resources": [os.path.relpath(OVERLAYS / overlay, work)]}))
    proc = subprocess.run([str(kustomize), "build", str(work)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def apply_order(docs: list[dict]) -> list[dict]:
    rank = {k: 0 for k in FIRST_KINDS} | {k: 2 for k in LAST_KINDS}
    return sorted(docs, key=lambda d: rank.get(d["kind"], 1))


def ref(doc: dict) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


def server_side_apply(dyn: dynamic.DynamicClient, doc: dict, dry_run: bool) -> dict:
    resource = dyn.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
    try:
        out = dyn.server_side_apply(resource, body=doc, namespace=doc["metadata"].get("namespace"), field_manager=FIELD_MANAGER,
                                    force_conflicts=True, dry_run="All" if dry_run else None)
    except ApiException as exc:
        raise AssertionError(f"{'dry-run ' if dry_run else ''}apply of {ref(doc)} refused: {exc.status} {exc.body}") from exc
    return out.to_dict()


def exists(dyn: dynamic.DynamicClient, doc: dict) -> bool:
    resource = dyn.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
    try:
        dyn.get(resource, name=doc["metadata"]["name"], namespace=doc["metadata"].get("namespace"))
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


# --- what a user provides ---------------------------------------------------------------------

def required_secrets(docs: list[dict]) -> set[str]:
    """Secrets the pods cannot start without (volumes, and envFrom/env refs not marked optional)."""
    names = set()
    for doc in docs:
        if doc["kind"] not in WORKLOAD_KINDS:
            continue
        pod = doc["spec"]["template"]["spec"]
        names |= {v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v and not v["secret"].get("optional")}
        for c in pod.get("initContainers", []) + pod["containers"]:
            names |= {e["secretRef"]["name"] for e in c.get("envFrom", []) if "secretRef" in e and not e["secretRef"].get("optional")}
            names |= {e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env", [])
                      if "secretKeyRef" in e.get("valueFrom", {}) and not e["valueFrom"]["secretKeyRef"].get("optional")}
    return names


def user_secrets(cluster) -> dict[str, dict]:
    """The Secrets the README tells a user to create, as a user would fill them in."""
    callers = {"callers": [
        {"identity": "service:alertmanager", "token_sha256": "a" * 64, "endpoints": ["alertmanager"]},
        {"identity": "service:ci-gitlab", "groups": ["ci"], "token_sha256": "b" * 64, "endpoints": ["releases"]}]}
    for caller in callers["callers"]:
        Caller(**caller)  # the receiver's own model: the file is one the receiver would load
    return {
        "gpuledger-receiver-tls": {"type": "kubernetes.io/tls", "stringData": {
            "tls.crt": (cluster.pki / "tls.crt").read_text(), "tls.key": (cluster.pki / "tls.key").read_text()}},
        "gpuledger-receiver-credentials": {"type": "Opaque", "stringData": {"credentials.yaml": yaml.safe_dump(callers)}},
        "gpuledger-admit-tls": {"type": "kubernetes.io/tls", "stringData": {
            "tls.crt": (cluster.pki / "tls.crt").read_text(), "tls.key": (cluster.pki / "tls.key").read_text()}},
        "gpuledger-clickhouse": {"type": "Opaque", "stringData": {
            "GPULEDGER_CLICKHOUSE_DSN": "https://gpuledger:secret@clickhouse.example:8443/gpuledger"}},
    }


def storage_for_claims(core: k8s.CoreV1Api, docs: list[dict], namespace: str) -> list[str]:
    """One PersistentVolume pre-bound to each claim a StatefulSet will make (the cluster's
    storage provisioner would do this; this cluster has none)."""
    made = []
    for doc in docs:
        if doc["kind"] != "StatefulSet":
            continue
        for template in doc["spec"].get("volumeClaimTemplates", []):
            for ordinal in range(doc["spec"].get("replicas", 1)):
                claim = f"{template['metadata']['name']}-{doc['metadata']['name']}-{ordinal}"
                pv = f"{namespace}-{claim}"
                core.create_persistent_volume({
                    "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
                    "spec": {"capacity": {"storage": template["spec"]["resources"]["requests"]["storage"]},
                             "accessModes": template["spec"]["accessModes"], "persistentVolumeReclaimPolicy": "Retain",
                             "hostPath": {"path": f"/var/lib/gpuledger-test/{pv}"},
                             "claimRef": {"namespace": namespace, "name": claim}}})
                made.append(pv)
    return made


# --- checks -------------------------------------------------------------------------------------

def kwok_nodes(core: k8s.CoreV1Api) -> set[str]:
    return {n.metadata.name for n in core.list_node().items if (n.metadata.annotations or {}).get(KWOK_NODE_ANNOTATION) == "fake"}


def workload_counts(apps: k8s.AppsV1Api, docs: list[dict], namespace: str) -> dict[str, tuple[int, int]]:
    """(ready pods, wanted pods) per workload."""
    counts = {}
    for doc in docs:
        name, kind = doc["metadata"]["name"], doc["kind"]
        if kind == "Deployment":
            s = apps.read_namespaced_deployment_status(name, namespace).status
            counts[ref(doc)] = (s.ready_replicas or 0, doc["spec"].get("replicas", 1))
        elif kind == "StatefulSet":
            s = apps.read_namespaced_stateful_set_status(name, namespace).status
            counts[ref(doc)] = (s.ready_replicas or 0, doc["spec"].get("replicas", 1))
        elif kind == "DaemonSet":
            s = apps.read_namespaced_daemon_set_status(name, namespace).status
            counts[ref(doc)] = (s.number_ready or 0, s.desired_number_scheduled or 0)
    return counts


def wait_ready(apps: k8s.AppsV1Api, docs: list[dict], namespace: str, timeout: float) -> dict[str, tuple[int, int]]:
    """The counts once every workload has all its pods (at least one) ready; the last counts in the failure."""
    seen: dict[str, tuple[int, int]] = {}

    def ready():
        seen.update(workload_counts(apps, docs, namespace))
        return all(r == w and w > 0 for r, w in seen.values()) and dict(seen)

    try:
        return wait_for(ready, timeout, f"every workload in {namespace} ready")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; (ready, wanted) per workload: {seen}") from None


def pod_spec(doc: dict) -> dict:
    """A workload's pod spec as its controller creates it (a StatefulSet adds its claims as volumes)."""
    spec = dict(doc["spec"]["template"]["spec"])
    claims = [{"name": c["metadata"]["name"], "persistentVolumeClaim": {"claimName": f"{c['metadata']['name']}-{doc['metadata']['name']}-0"}}
              for c in doc["spec"].get("volumeClaimTemplates", [])]
    return {**spec, "volumes": [*spec.get("volumes", []), *claims]}


def access_allowed(authz: k8s.AuthorizationV1Api, namespace: str, account: str, access: Access) -> bool:
    review = authz.create_subject_access_review({
        "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
        "spec": {"user": f"system:serviceaccount:{namespace}:{account}",
                 "groups": ["system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"],
                 "resourceAttributes": access.attributes(namespace)}})
    return bool(review.status.allowed)


def granted(docs: list[dict], namespace: str, account: str) -> set[tuple[str, str, str]]:
    """(verb, resource as Access names it, where) of every rule bound to ``account`` in the render."""
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d for d in docs if d["kind"] in ("Role", "ClusterRole")}
    out = set()
    for binding in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        if not any(s["kind"] == "ServiceAccount" and s["name"] == account and s.get("namespace", namespace) == namespace
                   for s in binding.get("subjects", [])):
            continue
        where = "cluster" if binding["kind"] == "ClusterRoleBinding" else "own"
        role_ns = None if binding["roleRef"]["kind"] == "ClusterRole" else binding["metadata"]["namespace"]
        role = roles[(binding["roleRef"]["kind"], role_ns, binding["roleRef"]["name"])]
        for rule in role["rules"]:
            for group in rule.get("apiGroups", []):
                for resource in rule.get("resources", []):
                    name = resource if not group else (f"{resource.split('/')[0]}.{group}" + (f"/{resource.split('/', 1)[1]}" if "/" in resource else ""))
                    out |= {(verb, name, where) for verb in rule["verbs"]}
    return out


# --- the test -------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", sorted(p.name for p in OVERLAYS.iterdir() if (p / "kustomization.yaml").exists()))
def test_overlay_applies_schedules_and_grants_exactly_what_each_component_needs(overlay, real_cluster, kube, kustomize, tmp_path):
    namespace = unique(f"gl-{overlay}")
    docs = apply_order(render(kustomize, overlay, namespace, tmp_path / overlay))
    dyn = dynamic.DynamicClient(kube)
    core, apps, authz = k8s.CoreV1Api(kube), k8s.AppsV1Api(kube), k8s.AuthorizationV1Api(kube)
    assert [d["kind"] for d in docs].count("Namespace") == 1 and docs[0]["metadata"]["name"] == namespace
    workloads = [d for d in docs if d["kind"] in WORKLOAD_KINDS]
    accounts = sorted(d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount")
    # By the API server's own mapping: kustomize sets a namespace on kinds it does not know
    # to be cluster-scoped (the AdmissionCheck, a custom resource).
    cluster_scoped = [d for d in docs if d["kind"] != "Namespace"
                      and not dyn.resources.get(api_version=d["apiVersion"], kind=d["kind"]).namespaced]
    volumes: list[str] = []
    try:
        # 1. Server-side dry-run of every object: the namespace first (the others need it to exist,
        # so it is then created for real), then the rest, which the dry-run leaves unpersisted.
        server_side_apply(dyn, docs[0], dry_run=True)
        assert not exists(dyn, docs[0]), "a dry-run persisted the namespace"
        server_side_apply(dyn, docs[0], dry_run=False)
        dry = {ref(d): server_side_apply(dyn, d, dry_run=True) for d in docs[1:]}
        assert all(out["metadata"]["name"] for out in dry.values())
        assert not [ref(d) for d in docs[1:] if exists(dyn, d)], "a dry-run persisted objects"

        # 2. What the user provides, then every object for real.
        secrets = user_secrets(real_cluster)
        missing = required_secrets(docs) - (set(secrets) & readme_secrets())
        assert not missing, f"{overlay} needs Secrets the README does not have the user create: {missing}"
        assert {c["image"] for d in workloads for c in d["spec"]["template"]["spec"]["containers"]} == \
            {f"{user_image['newName']}@{user_image['digest']}" for user_image in readme_overlay()["images"]}
        for name in sorted(required_secrets(docs)):
            core.create_namespaced_secret(namespace, {"apiVersion": "v1", "kind": "Secret",
                                                      "metadata": {"name": name, "namespace": namespace}, **secrets[name]})
        volumes = storage_for_claims(core, docs, namespace)
        # Webhook configurations go last, after the checks below: once they exist the API server
        # calls their webhooks for the pods those checks create, and this cluster has no Service
        # network to reach a webhook behind a Service.
        hooks = [d for d in docs if d["kind"] in LAST_KINDS]
        for doc in docs[1:]:
            if doc["kind"] not in LAST_KINDS:
                server_side_apply(dyn, doc, dry_run=False)
        assert all(exists(dyn, d) for d in docs if d["kind"] not in LAST_KINDS)

        # 3. Every pod scheduled on a KWOK node and Ready (the DaemonSet: one per GPU node).
        counts = wait_ready(apps, workloads, namespace, 120)
        gpu_nodes = kwok_nodes(core)
        daemonsets = [ref(d) for d in workloads if d["kind"] == "DaemonSet"]
        assert all(counts[d][1] == len(gpu_nodes) for d in daemonsets), counts
        pods = core.list_namespaced_pod(namespace).items
        assert len(pods) == sum(wanted for _, wanted in counts.values())
        assert {p.spec.node_name for p in pods} <= gpu_nodes and all(p.status.phase == "Running" for p in pods)
        if "DaemonSet/gpuledger-podresources" in counts:
            assert {p.spec.node_name for p in pods if p.metadata.name.startswith("gpuledger-podresources-")} == gpu_nodes

        # 4. Pod Security "restricted" admits every pod template but the pod-resources collector's:
        # the namespace enforces it for a moment, and each template is created as a Pod in dry-run.
        core.patch_namespace(namespace, {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}})
        refused = {}
        for doc in workloads:
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": unique("pss"), "namespace": namespace},
                   "spec": pod_spec(doc)}
            try:
                core.create_namespaced_pod(namespace, pod, dry_run="All")
            except ApiException as exc:
                assert exc.status == 403, exc.body
                refused[ref(doc)] = exc.body
        core.patch_namespace(namespace, {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "privileged"}}})
        assert set(refused) == {"DaemonSet/gpuledger-podresources"}, refused
        assert "runAsNonRoot" in refused["DaemonSet/gpuledger-podresources"] and "hostPath" in refused["DaemonSet/gpuledger-podresources"]

        # 5. Each ServiceAccount: allowed what its component needs, denied its neighbours, and
        # granted nothing the table does not name.
        unlisted = sorted(set(accounts) - set(RBAC))
        assert not unlisted, f"ServiceAccounts without expectations: {unlisted}; add them to RBAC in {__file__}"
        wrong = []
        for account in accounts:
            expect = RBAC[account]
            assert expect.denied, f"{account}: give it at least one denied neighbour"
            wrong += [f"{account} may not {a}" for a in expect.allowed if not access_allowed(authz, namespace, account, a)]
            wrong += [f"{account} may {a}" for a in expect.denied if access_allowed(authz, namespace, account, a)]
            extra = granted(docs, namespace, account) - {(a.verb, a.resource, a.where) for a in expect.allowed}
            wrong += [f"{account} is granted {g} which RBAC does not expect" for g in sorted(extra)]
        assert not wrong, "\n".join(wrong)

        for doc in hooks:
            server_side_apply(dyn, doc, dry_run=False)
        assert all(exists(dyn, d) for d in hooks)
    finally:
        for doc in reversed(cluster_scoped):  # webhook configurations first
            resource = dyn.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
            try:
                dyn.delete(resource, name=doc["metadata"]["name"])
            except ApiException:
                pass
        # Gone before the next overlay's dry-run looks: Kueue's finalizer holds a deleted
        # AdmissionCheck until it has noticed that no ClusterQueue uses it.
        wait_for(lambda: not [d for d in cluster_scoped if exists(dyn, d)], 60, "the cluster-scoped objects to be deleted")
        try:
            core.delete_namespace(namespace)
        except ApiException:
            pass
        for pv in volumes:
            try:
                core.delete_persistent_volume(pv)
            except ApiException:
                pass
