"""Every manifest of deploy/k8s/ checked against the Kubernetes object models.

The manifests are the resource files the kustomizations list (base, its components, the
overlays — and whatever a component such as base/admit adds once the base lists it); the
rendered whole is applied to a real API server in tests/real_cluster/test_k8s_deploy.py.

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

import os
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
    ("apps/v1", "StatefulSet"): "V1StatefulSet",
    ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget",
    ("networking.k8s.io/v1", "NetworkPolicy"): "V1NetworkPolicy",
    ("admissionregistration.k8s.io/v1", "ValidatingWebhookConfiguration"): "V1ValidatingWebhookConfiguration",
    ("admissionregistration.k8s.io/v1", "MutatingWebhookConfiguration"): "V1MutatingWebhookConfiguration",
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): "V1ClusterRole",
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): "V1ClusterRoleBinding",
    ("rbac.authorization.k8s.io/v1", "Role"): "V1Role",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "V1RoleBinding",
}
#: Custom resources (no client model): the real API server validates them against their CRD
#: in the server-side dry-run of tests/real_cluster/test_k8s_deploy.py.
CUSTOM_KINDS = {("kueue.x-k8s.io/v1beta1", "AdmissionCheck"), ("kueue.x-k8s.io/v1beta2", "AdmissionCheck")}
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "Namespace", "ValidatingWebhookConfiguration",
                  "MutatingWebhookConfiguration", "AdmissionCheck"}
# Roles every cluster has; a binding may name them without defining them.
BUILTIN_CLUSTER_ROLES = {"cluster-admin", "admin", "edit", "view"}
# The API server takes quantities as numbers too; the client models type them as strings.
QUANTITY_KEYS = {"cpu", "memory", "ephemeral-storage", "sizeLimit"}
SCALARS = {"str": str, "int": int, "float": (int, float), "bool": bool, "bytes": str, "datetime": str, "date": str}


def resource_files(root: Path = K8S_DIR) -> list[Path]:
    """The resource files every kustomization under ``root`` lists (directories followed)."""
    files: set[Path] = set()
    seen: set[Path] = set()

    def walk(directory: Path) -> None:
        if directory in seen:
            return
        seen.add(directory)
        kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
        for entry in kustomization.get("resources") or []:
            target = (directory / entry).resolve()
            if target.is_dir():
                walk(target)
            else:
                files.add(target)

    for kustomization in sorted(root.glob("**/kustomization.yaml")):
        walk(kustomization.parent.resolve())
    return sorted(files)


def load_manifests() -> list[tuple[str, int, dict]]:
    docs = []
    for path in resource_files():
        for index, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                docs.append((str(path.relative_to(K8S_DIR.resolve())), index, doc))
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
    if key in CUSTOM_KINDS:
        pytest.skip(f"{key}: a custom resource, validated by the real API server (tests/real_cluster/test_k8s_deploy.py)")
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
    return [(f, d) for f, _, d in MANIFESTS if d.get("kind") in ("DaemonSet", "Deployment", "StatefulSet")]


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
    volumes = {v["name"] for v in pod.get("volumes", [])} | {c["metadata"]["name"] for c in spec.get("volumeClaimTemplates", [])}
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
    docs = [d for f, _, d in MANIFESTS if f == "base/podresources/daemonset.yaml"]
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
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {e["key"] for term in terms for e in term["matchExpressions"]} == {"nvidia.com/gpu.present", "nvidia.com/gpu.product"}
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert container["command"] == ["gpuledger"]
    from gpuledger.cli import app

    result = CliRunner().invoke(app, [*container["args"], "--help"])
    assert result.exit_code == 0, result.output


def test_both_collectors_count_the_same_gpu_resources():
    """From an exploratory review: the scheduler collector's Deployment set
    GPULEDGER_SCHEDULER_GPU_RESOURCES=nvidia.com/gpu while the pod-resources DaemonSet kept the
    default (MIG slices included): MIG allocations arrived with no workload, queue or preemption
    history. The two lists must be the same (docs/collectors.md)."""
    from producers.kubernetes.config import SchedulerCollectorSettings

    def env_of(path: str, kind: str) -> dict:
        doc = next(d for f, _, d in MANIFESTS if f == path and d["kind"] == kind)
        (container,) = doc["spec"]["template"]["spec"]["containers"]
        return {e["name"]: e.get("value") for e in container.get("env", [])}

    scheduler = env_of("base/scheduler/collector.yaml", "Deployment")
    podresources = env_of("base/podresources/daemonset.yaml", "DaemonSet")
    default = ",".join(SchedulerCollectorSettings().gpu_resources)
    assert default == ",".join(PodResourcesSettings().resources)
    assert (scheduler.get("GPULEDGER_SCHEDULER_GPU_RESOURCES", default)
            == podresources.get("GPULEDGER_PODRESOURCES_RESOURCES", default)), (scheduler, podresources)


# --- every pod of deploy/k8s ----------------------------------------------------------------

#: The one pod that runs as root (the kubelet's pod-resources socket is root-owned).
ROOT_PODS = {"DaemonSet/gpuledger-podresources"}


def _pods():
    return [(f, d) for f, d in _workloads()]


def _pod_ids():
    return [f"{d['kind']}/{d['metadata']['name']}@{f}" for f, d in _pods()]


def _generated_env(name: str) -> dict[str, str]:
    """KEY=VALUE pairs of the configMapGenerator ``name`` (its env files), wherever it is declared."""
    out = {}
    for kustomization in K8S_DIR.glob("**/kustomization.yaml"):
        for gen in yaml.safe_load(kustomization.read_text()).get("configMapGenerator") or []:
            if gen["name"] != name or gen.get("behavior") == "merge":
                continue
            for env_file in gen.get("envs", []):
                for line in (kustomization.parent / env_file).read_text().splitlines():
                    if line.strip() and not line.startswith("#"):
                        key, _, value = line.partition("=")
                        out[key] = value
    return out


def _container_env(container: dict) -> dict[str, str | None]:
    """Every variable a container gets: its generated ConfigMaps' keys, then its own env."""
    env: dict[str, str | None] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            generated = _generated_env(source["configMapRef"]["name"])
            assert generated, f"configMapRef {source['configMapRef']['name']} names no configMapGenerator with env files"
            env.update(generated)
    for e in container.get("env", []):
        env[e["name"]] = e.get("value")
    return env


@pytest.mark.parametrize(("path", "doc"), _pods(), ids=_pod_ids())
def test_every_pod_is_locked_down(path, doc):
    pod = doc["spec"]["template"]["spec"]
    who = f"{doc['kind']}/{doc['metadata']['name']}"
    assert pod.get("enableServiceLinks") is False, f"{who}: Service links would add GPULEDGER_RECEIVER_PORT=tcp://… (not a setting)"
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsNonRoot"] is (who not in ROOT_PODS)
    for c in pod.get("initContainers", []) + pod["containers"]:
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"], who
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"] and c["resources"]["limits"]["memory"], who
        assert c["image"] == "gpuledger", f"{who}: the overlays' images: transformer sets the image; use the name gpuledger"


@pytest.mark.parametrize(("path", "doc"), _pods(), ids=_pod_ids())
def test_every_container_runs_a_command_that_exists_with_settings_it_reads(path, doc):
    from gpuledger.cli import app
    from gpuledger.settings import env_vars

    pod = doc["spec"]["template"]["spec"]
    mounts_of = {c["name"]: [m["mountPath"] for m in c.get("volumeMounts", [])] for c in pod["containers"]}
    for c in pod.get("initContainers", []) + pod["containers"]:
        assert c["command"] == ["gpuledger"]
        result = CliRunner().invoke(app, [*c["args"], "--help"])
        assert result.exit_code == 0, result.output
        env = _container_env(c)
        unknown = sorted(k for k in env if k.startswith("GPULEDGER_") and k not in env_vars())
        assert not unknown, f"{c['name']}: not settings, gpuledger would refuse to start: {unknown}"
        # The root filesystem is read-only: every file or directory a setting names is on a mount.
        for key, value in env.items():
            if key.endswith(("_FILE", "_DIR")) and value:
                assert any(value == m or value.startswith(m.rstrip("/") + "/") for m in mounts_of[c["name"]]), f"{c['name']}: {key}={value} is on no mount"


def test_the_worker_pod_templates_of_the_two_overlays_differ_only_in_the_store():
    embedded = yaml.safe_load((K8S_DIR / "overlays/embedded/worker-statefulset.yaml").read_text())["spec"]["template"]
    server = yaml.safe_load((K8S_DIR / "overlays/clickhouse/worker-deployment.yaml").read_text())["spec"]["template"]
    for template in (embedded, server):
        spec = template["spec"]
        spec.pop("topologySpreadConstraints", None)
        spec["volumes"] = [v for v in spec["volumes"] if v["name"] != "data"]
        (c,) = spec["containers"]
        c["env"] = [e for e in c["env"] if e["name"] != "GPULEDGER_CLICKHOUSE_DSN"]
        c["envFrom"] = [e for e in c["envFrom"] if e.get("secretRef", {}).get("name") != "gpuledger-clickhouse"]
    assert embedded == server


def test_worker_grace_period_covers_its_stop_time():
    from streams.app import STOP_WITHIN_S

    for f, doc in _workloads():
        if doc["metadata"]["name"] == "gpuledger-worker":
            grace = doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            # STOP_WITHIN_S, then the sink's 1 s: SIGKILL must not come first, and a drain is not held up.
            assert STOP_WITHIN_S + 1 < grace <= 2 * STOP_WITHIN_S, f"{f}: {grace}"


def test_embedded_worker_is_the_single_writer_of_its_volume():
    sts = yaml.safe_load((K8S_DIR / "overlays/embedded/worker-statefulset.yaml").read_text())
    assert sts["kind"] == "StatefulSet" and sts["spec"]["replicas"] == 1
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    env = {e["name"]: e.get("value") for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["GPULEDGER_CLICKHOUSE_DSN"] == f"chdb://{env['GPULEDGER_DATA_DIR']}/clickhouse"
    assert "single-writer" in (K8S_DIR / "overlays/embedded/kustomization.yaml").read_text().lower()


def test_receiver_probes_and_service_reach_its_port():
    docs = {(d["kind"], d["metadata"]["name"]): d for _, _, d in MANIFESTS}
    deployment, service = docs[("Deployment", "gpuledger-receiver")], docs[("Service", "gpuledger-receiver")]
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    env = _container_env(c)
    (port,) = c["ports"]
    assert int(env["GPULEDGER_RECEIVER_PORT"]) == port["containerPort"] and env["GPULEDGER_RECEIVER_HOST"] == "0.0.0.0"
    scheme = "HTTPS" if env.get("GPULEDGER_RECEIVER_TLS_CERT_FILE") else "HTTP"
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port["name"], "scheme": scheme}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port["name"], "scheme": scheme}
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
    assert mounts["/etc/gpuledger/tls"]["secret"]["secretName"] == "gpuledger-receiver-tls"
    assert mounts["/etc/gpuledger/credentials"]["secret"]["secretName"] == "gpuledger-receiver-credentials"
    assert not any("subPath" in m for m in c["volumeMounts"]), "a subPath mount never sees the kubelet's updates"


def test_network_policies_select_the_pods_they_protect():
    policies = {d["metadata"]["name"]: d for _, _, d in MANIFESTS if d["kind"] == "NetworkPolicy"}
    receiver = next(d for _, d in _workloads() if d["metadata"]["name"] == "gpuledger-receiver")
    labels = receiver["spec"]["template"]["metadata"]["labels"]
    assert policies["gpuledger-default-deny-ingress"]["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    rec = policies["gpuledger-receiver-ingress"]["spec"]
    assert rec["podSelector"]["matchLabels"].items() <= labels.items()
    (rule,) = rec["ingress"]
    assert [p["port"] for p in rule["ports"]] == [c["ports"][0]["name"] for c in receiver["spec"]["template"]["spec"]["containers"]]
    assert all("namespaceSelector" in peer and "podSelector" not in peer for peer in rule["from"])
    (admit_rule,) = policies["gpuledger-admit-ingress"]["spec"]["ingress"]
    assert all(set(peer) == {"ipBlock"} for peer in admit_rule["from"]), "the API server is no pod: an ipBlock"


def test_base_policy_file_is_a_valid_policy():
    from streams.controls.policy import load_policy

    assert load_policy(K8S_DIR / "base" / "policy.yaml") == load_policy(None)  # as shipped: the built-in default


def test_kustomize_pin_is_the_wrapper_modules():
    from gpuledger.dev import kubebin

    gomod = (kubebin.KUSTOMIZE_MODULE / "go.mod").read_text()
    module, version = kubebin.KUSTOMIZE
    assert f"tool {module}\n" in gomod and f"{module} {version}" in gomod


#: Which settings section a command validates as "about to run" (its required fields checked too).
RUN_SECTIONS = {("collect", "podresources"): "collectors.podresources"}


@pytest.mark.parametrize(("path", "doc"), _pods(), ids=_pod_ids())
def test_every_containers_environment_is_valid_settings(path, doc, monkeypatch):
    """The values, not only the names: what the root loader would say at the container's start."""
    from gpuledger.settings import Settings, SettingsError

    for c in doc["spec"]["template"]["spec"]["containers"]:
        for name in [k for k in os.environ if k.startswith("GPULEDGER_")]:
            monkeypatch.delenv(name)
        env = _container_env(c)
        for e in c.get("env", []):
            if "valueFrom" in e:  # the downward API: a node or pod name
                env[e["name"]] = "gpu-node-1"
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        words = tuple(a for a in c["args"] if not a.startswith("-"))
        try:
            Settings.load(run=RUN_SECTIONS.get(words))
        except SettingsError as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} {c['name']}: {exc}")
