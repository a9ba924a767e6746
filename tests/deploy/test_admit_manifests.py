"""deploy/k8s/base/admit/: what docs/admission.md promises of the admit component's manifests."""

from __future__ import annotations

from pathlib import Path

import yaml

from producers.admission.manifests import admission_check, rendered_webhook_yaml

ADMIT = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "base" / "admit"


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((ADMIT / name).read_text()) if d]


def test_the_webhook_configuration_is_the_generated_one():
    assert (ADMIT / "webhook.yaml").read_text() == rendered_webhook_yaml(), "run `python -m producers.admission.manifests`"
    hooks = docs("webhook.yaml")[0]["webhooks"]
    assert {(h["rules"][0]["resources"][0], h["failurePolicy"]) for h in hooks} == {
        (r, p) for r in ("pods", "jobs", "workloads") for p in ("Fail", "Ignore")}
    assert all(h["matchConditions"] and h["timeoutSeconds"] <= 10 and h["sideEffects"] == "None" for h in hooks)


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
