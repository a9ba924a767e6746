"""deploy/k8s/base/admit/: what docs/admission.md promises of the admit component's manifests."""

from __future__ import annotations

from pathlib import Path

import yaml

from producers.admission.manifests import admission_check, rendered_webhook_yaml, webhook_configuration

ADMIT = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "base" / "admit"


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((ADMIT / name).read_text()) if d]


def test_the_webhook_configuration_is_the_generated_one():
    assert (ADMIT / "webhook.yaml").read_text() == rendered_webhook_yaml(), "run `python -m producers.admission.manifests`"
    hooks = docs("webhook.yaml")[0]["webhooks"]
    assert {(h["rules"][0]["resources"][0], h["failurePolicy"]) for h in hooks} == {
        (r, p) for r in ("pods", "jobs", "workloads") for p in ("Fail", "Ignore")}
    assert all(h["matchConditions"] and h["timeoutSeconds"] <= 10 and h["sideEffects"] == "None" for h in hooks)


def test_each_fail_closed_environment_has_its_own_path_and_the_rest_share_the_fail_open_one():
    """The path tells admit the namespace's environment (the AdmissionReview does not): every
    namespace labelled with a fail-closed environment reaches exactly one webhook of its kind,
    whose path names it; every other namespace the fail-open one's /validate."""
    hooks = webhook_configuration({"url": "https://127.0.0.1:9443"}, fail_closed=("staging", "prod"))["webhooks"]
    pods = {h["name"]: h for h in hooks if h["rules"][0]["resources"] == ["pods"]}
    assert {name: (h["clientConfig"]["url"], h["failurePolicy"]) for name, h in pods.items()} == {
        "pods.fail-closed.staging.admit.gpuledger.io": ("https://127.0.0.1:9443/validate/staging", "Fail"),
        "pods.fail-closed.prod.admit.gpuledger.io": ("https://127.0.0.1:9443/validate/prod", "Fail"),
        "pods.admit.gpuledger.io": ("https://127.0.0.1:9443/validate", "Ignore")}
    selects = {name: next(e for e in h["namespaceSelector"]["matchExpressions"] if e["key"] == "gpuledger.io/environment")
               for name, h in pods.items()}
    assert [(e["operator"], e["values"]) for e in selects.values()] == [("In", ["staging"]), ("In", ["prod"]), ("NotIn", ["staging", "prod"])]
    (service,) = [h["clientConfig"]["service"]["path"] for h in docs("webhook.yaml")[0]["webhooks"]
                  if h["name"] == "pods.fail-closed.admit.gpuledger.io"]
    assert service == "/validate/prod"
    # An environment's name that is no DNS label part is made one in the webhook's name (the path keeps it).
    hooks = webhook_configuration({"url": "https://127.0.0.1:9443"}, fail_closed=("Prod_EU", "prod"))["webhooks"]
    assert {h["name"] for h in hooks if h["name"].startswith("pods.")} == {
        "pods.fail-closed.prod-eu.admit.gpuledger.io", "pods.fail-closed.prod.admit.gpuledger.io", "pods.admit.gpuledger.io"}
    assert "https://127.0.0.1:9443/validate/Prod_EU" in {h["clientConfig"]["url"] for h in hooks}
    # No fail-closed environment: one fail-open webhook per kind, selecting by no environment label (NotIn [] is invalid).
    (only,) = [h for h in webhook_configuration({"url": "https://127.0.0.1:9443"}, fail_closed=())["webhooks"] if h["name"].startswith("pods.")]
    assert only["failurePolicy"] == "Ignore" and all(e["key"] != "gpuledger.io/environment" for e in only["namespaceSelector"]["matchExpressions"])


def test_the_kustomization_lists_every_file_and_the_admission_check_is_ours():
    listed = docs("kustomization.yaml")[0]["resources"]
    assert sorted(listed) == sorted(p.name for p in ADMIT.glob("*.yaml") if p.name != "kustomization.yaml")
    (check,) = docs("admissioncheck.yaml")
    assert check["spec"] == admission_check()["spec"] and check["apiVersion"] == "kueue.x-k8s.io/v1beta2"


def test_rbac_is_least_privilege():
    def grants(name: str) -> set:
        role = next(d for d in docs("rbac.yaml") if d["kind"] == "ClusterRole" and d["metadata"]["name"] == name)
        return {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}

    # Both read one object at a time, by name, of the DRA claims they decide and their device classes.
    claims = {("resource.k8s.io", r, "get") for r in ("resourceclaims", "resourceclaimtemplates", "deviceclasses")}
    assert grants("gpuledger-admit-controller") == {("kueue.x-k8s.io", "workloads", v) for v in ("get", "list", "watch")} | {
        ("kueue.x-k8s.io", "admissionchecks", v) for v in ("get", "list", "watch")} | {
        ("kueue.x-k8s.io", "workloads/status", "patch"), ("kueue.x-k8s.io", "admissionchecks/status", "patch")} | claims
    assert grants("gpuledger-admit") == claims
    bindings = {d["roleRef"]["name"]: [s["name"] for s in d["subjects"]] for d in docs("rbac.yaml") if d["kind"] == "ClusterRoleBinding"}
    assert bindings == {"gpuledger-admit": ["gpuledger-admit"], "gpuledger-admit-controller": ["gpuledger-admit-controller"]}
    webhook = next(d for d in docs("deployment.yaml") if d["metadata"]["name"] == "gpuledger-admit")
    assert webhook["spec"]["template"]["spec"]["automountServiceAccountToken"] is True
    assert "--claims-in-cluster" in webhook["spec"]["template"]["spec"]["containers"][0]["args"]
