"""Every manifest under deploy/k8s/ checked against the Kubernetes object models.

Generic part: each YAML document is mapped (apiVersion, kind) -> the official
``kubernetes`` client model, every key is checked against the model's
``attribute_map`` recursively (an unknown or misspelled field fails, which
``kubectl apply`` would only warn about or silently drop), and the document is then
deserialised into the model, which enforces required fields and types. Cross-object
checks: selectors match their pod template, volume mounts name a volume, the
ServiceAccount a workload runs as and the roles and accounts a binding names exist.

Specific part: the pod-resources DaemonSet keeps the promises docs/collectors.md makes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from kubernetes.client import ApiClient
from kubernetes.client import models as k8s_models
from typer.testing import CliRunner

from producers.podresources.config import PodResourcesSettings

K8S_DIR = Path(__file__).resolve().parents[2] / "deploy" / "k8s"

MODELS = {
    ("v1", "ServiceAccount"): "V1ServiceAccount",
    ("v1", "ConfigMap"): "V1ConfigMap",
    ("v1", "Service"): "V1Service",
    ("v1", "Secret"): "V1Secret",
    ("v1", "Namespace"): "V1Namespace",
    ("apps/v1", "DaemonSet"): "V1DaemonSet",
    ("apps/v1", "Deployment"): "V1Deployment",
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): "V1ClusterRole",
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): "V1ClusterRoleBinding",
    ("rbac.authorization.k8s.io/v1", "Role"): "V1Role",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "V1RoleBinding",
    ("admissionregistration.k8s.io/v1", "ValidatingWebhookConfiguration"): "V1ValidatingWebhookConfiguration",
}
# Kinds the official client has no model for (custom resources, kustomize's own files):
# not checked here; each has its own test (tests/deploy/test_admit_manifests.py).
NOT_MODELLED = {("kueue.x-k8s.io/v1beta2", "AdmissionCheck"), ("kustomize.config.k8s.io/v1beta1", "Kustomization")}
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "Namespace", "ValidatingWebhookConfiguration"}
# Roles every cluster has; a binding may name them without defining them.
BUILTIN_CLUSTER_ROLES = {"cluster-admin", "admin", "edit", "view"}
# The API server takes quantities as numbers too; the client models type them as strings.
QUANTITY_KEYS = {"cpu", "memory", "ephemeral-storage", "sizeLimit"}
SCALARS = {"str": str, "int": int, "float": (int, float), "bool": bool, "bytes": str, "datetime": str, "date": str}


def load_manifests() -> list[tuple[str, int, dict]]:
    docs = []
    for path in sorted([*K8S_DIR.glob("**/*.yaml"), *K8S_DIR.glob("**/*.yml")]):
        for index, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None and (doc.get("apiVersion"), doc.get("kind")) not in NOT_MODELLED:
                docs.append((str(path.relative_to(K8S_DIR)), index, doc))
    return docs


MANIFESTS = load_manifests()


def _ids() -> list[str]:
    return [f"{f}#{i}:{d.get('kind')}/{(d.get('metadata') or {}).get('name')}" for f, i, d in MANIFESTS]


def field_problems(data, type_name: str, path: str) -> list[str]:
    """Keys unknown to the model, and scalars of the wrong type, anywhere below ``data``."""
    if type_name == "object":
        return []
    if m := re.fullmatch(r"(?:List\[|list\[)(.+)\]", type_name):
        if not isinstance(data, list):
            return [f"{path}: expected a list, got {type(data).__name__}"]
        return [p for i, item in enumerate(data) for p in field_problems(item, m[1], f"{path}[{i}]")]
    if m := re.fullmatch(r"(?:Dict\[|dict\()str, (.+)[\])]", type_name):
        if not isinstance(data, dict):
            return [f"{path}: expected a mapping, got {type(data).__name__}"]
        return [p for k, v in data.items() for p in field_problems(v, m[1], f"{path}.{k}")]
    if type_name in SCALARS:
        expected = SCALARS[type_name]
        leaf = path.rsplit(".", 1)[-1]
        if type_name == "str" and leaf in QUANTITY_KEYS and isinstance(data, (int, float)) and not isinstance(data, bool):
            return []
        if isinstance(data, bool) and type_name != "bool" or not isinstance(data, expected):
            return [f"{path}: expected {type_name}, got {type(data).__name__} {data!r}"]
        return []
    model = getattr(k8s_models, type_name)
    if not isinstance(data, dict):
        return [f"{path}: expected a {type_name} mapping, got {type(data).__name__}"]
    by_json = {json_key: attr for attr, json_key in model.attribute_map.items()}
    problems = []
    for key, value in data.items():
        if key not in by_json:
            problems.append(f"{path}.{key}: unknown field of {type_name}")
        elif value is not None:
            problems.extend(field_problems(value, model.openapi_types[by_json[key]], f"{path}.{key}"))
    return problems


def test_there_are_manifests():
    assert MANIFESTS, f"no YAML under {K8S_DIR}"


def test_the_checker_catches_typos_and_wrong_types():
    doc = yaml.safe_load("""
    apiVersion: apps/v1
    kind: DaemonSet
    metadata: {name: x}
    spec:
      selector: {matchLabels: {a: b}}
      template:
        metadata: {labels: {a: b}}
        spec:
          nodeSelector: {nvidia.com/gpu.present: true}
          containers:
            - name: c
              image: i
              env: [{name: N, value: 10}]
              volumeMount: []
              resources: {limits: {memory: 1}}
    """)
    problems = field_problems(doc, "V1DaemonSet", "DaemonSet")
    assert sorted(problems) == [
        "DaemonSet.spec.template.spec.containers[0].env[0].value: expected str, got int 10",
        "DaemonSet.spec.template.spec.containers[0].volumeMount: unknown field of V1Container",
        "DaemonSet.spec.template.spec.nodeSelector.nvidia.com/gpu.present: expected str, got bool True",
    ]  # the numeric memory quantity is accepted, as the API server does


@pytest.mark.parametrize(("path", "index", "doc"), MANIFESTS, ids=_ids())
def test_manifest_matches_the_kubernetes_model(path, index, doc):
    key = (doc.get("apiVersion"), doc.get("kind"))
    assert key in MODELS, f"{path}#{index}: {key} is not a supported kind; add its model to MODELS"
    assert (doc.get("metadata") or {}).get("name"), f"{path}#{index}: metadata.name is required"
    problems = field_problems(doc, MODELS[key], doc["kind"])
    assert not problems, f"{path}#{index}:\n  " + "\n  ".join(problems)
    # Deserialising enforces what the key walk cannot: required fields, strict types.
    ApiClient()._ApiClient__deserialize(_quantities_as_strings(doc), MODELS[key])


def _quantities_as_strings(data, key: str = ""):
    """Numeric quantities (``memory: 1``) as the strings the client models insist on."""
    if isinstance(data, dict):
        return {k: _quantities_as_strings(v, k) for k, v in data.items()}
    if isinstance(data, list):
        return [_quantities_as_strings(v) for v in data]
    if key in QUANTITY_KEYS and isinstance(data, (int, float)) and not isinstance(data, bool):
        return str(data)
    return data


def _workloads():
    return [(f, d) for f, _, d in MANIFESTS if d.get("kind") in ("DaemonSet", "Deployment")]


def _namespace(doc) -> str | None:
    return None if doc["kind"] in CLUSTER_SCOPED else doc["metadata"].get("namespace", "default")


def _defined(kind: str) -> set[tuple[str | None, str]]:
    return {(_namespace(d), d["metadata"]["name"]) for _, _, d in MANIFESTS if d.get("kind") == kind}


@pytest.mark.parametrize(("path", "doc"), _workloads(), ids=[f"{f}:{d['metadata']['name']}" for f, d in _workloads()])
def test_workload_references_resolve(path, doc):
    spec = doc["spec"]
    pod_labels = spec["template"]["metadata"].get("labels", {})
    for label, value in spec["selector"].get("matchLabels", {}).items():
        assert pod_labels.get(label) == value, f"{path}: selector {label}={value} does not match the pod template"
    pod = spec["template"]["spec"]
    volumes = {v["name"] for v in pod.get("volumes", [])}
    for c in pod.get("initContainers", []) + pod["containers"]:
        for mount in c.get("volumeMounts", []):
            assert mount["name"] in volumes, f"{path}: container {c['name']} mounts undefined volume {mount['name']}"
    account = pod.get("serviceAccountName")
    if account and account != "default":
        assert (_namespace(doc), account) in _defined("ServiceAccount"), f"{path}: ServiceAccount {account} is not defined in deploy/k8s"


def _bindings():
    return [(f, d) for f, _, d in MANIFESTS if d.get("kind") in ("RoleBinding", "ClusterRoleBinding")]


@pytest.mark.parametrize(("path", "doc"), _bindings(), ids=[f"{f}:{d['metadata']['name']}" for f, d in _bindings()])
def test_binding_references_resolve(path, doc):
    ref = doc["roleRef"]
    if ref["kind"] == "ClusterRole":
        assert ref["name"] in BUILTIN_CLUSTER_ROLES or (None, ref["name"]) in _defined("ClusterRole"), f"{path}: ClusterRole {ref['name']} undefined"
    else:
        assert (_namespace(doc), ref["name"]) in _defined("Role"), f"{path}: Role {ref['name']} undefined in {_namespace(doc)}"
    for subject in doc.get("subjects", []):
        if subject["kind"] == "ServiceAccount":
            assert (subject.get("namespace", _namespace(doc)), subject["name"]) in _defined("ServiceAccount"), \
                f"{path}: ServiceAccount {subject['name']} is not defined in deploy/k8s"


# --- the pod-resources DaemonSet ------------------------------------------------------------

def _podresources() -> tuple[dict, dict]:
    docs = [d for f, _, d in MANIFESTS if f == "podresources-daemonset.yaml"]
    daemonset = next(d for d in docs if d["kind"] == "DaemonSet")
    account = next(d for d in docs if d["kind"] == "ServiceAccount")
    return daemonset, account


def test_podresources_daemonset_mounts_the_socket_directory_read_write():
    daemonset, _ = _podresources()
    pod = daemonset["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    (container,) = pod["containers"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    mount = mounts["/var/lib/kubelet/pod-resources"]
    assert volumes[mount["name"]]["hostPath"] == {"path": "/var/lib/kubelet/pod-resources", "type": "Directory"}
    assert not mount.get("readOnly", False), "the kubelet requires write access to its socket"
    env = {e["name"]: e for e in container["env"]}
    assert env["GPULEDGER_PODRESOURCES_SOCKET"]["value"] == "/var/lib/kubelet/pod-resources/kubelet.sock"
    state = mounts[env["GPULEDGER_PODRESOURCES_STATE_DIR"]["value"]]
    assert "hostPath" in volumes[state["name"]], "the snapshot must survive the pod"


def test_podresources_daemonset_env_and_args_are_what_the_collector_reads():
    daemonset, account = _podresources()
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["GPULEDGER_PODRESOURCES_NODE"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    known = {f"GPULEDGER_PODRESOURCES_{name.upper()}" for name in PodResourcesSettings.model_fields}
    unknown = {name for name in env if name.startswith("GPULEDGER_PODRESOURCES_")} - known
    assert not unknown, f"env vars the collector does not read: {unknown}"
    # No API server access: no token anywhere, no binding to the account.
    assert pod["automountServiceAccountToken"] is False and account["automountServiceAccountToken"] is False
    assert not [d for _, d in _bindings() for s in d.get("subjects", []) if s.get("name") == account["metadata"]["name"]]
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False and container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert pod["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert container["command"] == ["gpuledger"]
    from gpuledger.cli import app

    result = CliRunner().invoke(app, [*container["args"], "--help"])
    assert result.exit_code == 0, result.output
