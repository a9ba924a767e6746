"""The ValidatingWebhookConfiguration of ``gpuledger admit``, built in one place.

``deploy/k8s/base/admit/webhook.yaml`` is this function's output for the in-cluster Service
(a test keeps them equal), and the real-cluster tests register it with a ``url`` instead.

Per kind (Pods, batch Jobs, Kueue Workloads) a webhook per environment in ``fail_closed`` for the
namespaces labelled ``gpuledger.io/environment`` with it (``failurePolicy: Fail``: with the webhook
down, the API server refuses their GPU work), whose path names it (``/validate/prod``: the
AdmissionReview carries no namespace labels, and so admit decides such a namespace's work in at
least that environment, mapped in the policy or not), and one for every other namespace
(``failurePolicy: Ignore``: allowed, and control 1 still reports it after admission; path ``/validate``).
``matchConditions`` send only objects requesting a GPU resource (the collectors' list,
``producers._config.GPU_RESOURCES``, as CEL) or naming a DRA claim (``spec.resourceClaims``: the
webhook reads the claim's device class — ``producers.admission.claims``), so CPU work never
waits on us; namespaces
labelled ``gpuledger.io/admit: disabled`` (a namespace label, the platform's to set — not an
object's: a workload's creator could opt it out) and the kube-system / gpuledger namespaces
are never sent. Operations: CREATE only (GPU requests of a Pod are immutable; a Job's pod
template too).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

from producers._config import GPU_RESOURCES
from producers.admission.config import WEBHOOK_PATH

ENV_LABEL = "gpuledger.io/environment"
OPT_OUT_LABEL = "gpuledger.io/admit"
EXCLUDED_NAMESPACES = ("kube-system", "gpuledger")
KINDS = (  # (short name, API group, version, resource, path to the pod specs in CEL)
    ("pods", "", "v1", "pods", "pod"),
    ("jobs", "batch", "v1", "jobs", "job"),
    ("workloads", "kueue.x-k8s.io", "*", "workloads", "workload"),
)


def gpu_resource_cel(var: str, resources: Iterable[str] = GPU_RESOURCES) -> str:
    """CEL: ``var`` (a resource name) is one of ``resources`` (a trailing '*' is a prefix)."""
    parts = [f"{var}.startsWith('{r[:-1]}')" if r.endswith("*") else f"{var} == '{r}'" for r in resources]
    return "(" + " || ".join(parts) + ")"


def _containers_cel(spec: str, resources: Iterable[str]) -> str:
    gpu = gpu_resource_cel("r", resources)
    one = (f"has(c.resources) && ((has(c.resources.limits) && c.resources.limits.exists(r, {gpu})) || "
           f"(has(c.resources.requests) && c.resources.requests.exists(r, {gpu})))")
    return (f"{spec}.containers.exists(c, {one}) || "
            f"(has({spec}.initContainers) && {spec}.initContainers.exists(c, {one})) || "
            f"(has({spec}.resourceClaims) && size({spec}.resourceClaims) > 0)")


def gpu_match_expression(kind: str, resources: Iterable[str] = GPU_RESOURCES) -> str:
    resources = tuple(resources)
    if kind == "pod":
        return _containers_cel("object.spec", resources)
    if kind == "job":
        return _containers_cel("object.spec.template.spec", resources)
    return f"object.spec.podSets.exists(ps, {_containers_cel('ps.template.spec', resources)})"


def _dns_label(name: str) -> str:
    """An environment's name as a part of a webhook's name (a DNS subdomain: lower case, no '_')."""
    return name.lower().replace("_", "-")


def webhook_configuration(client_config_for: dict, *, name: str = "gpuledger-admit", fail_closed: Iterable[str] = ("prod",),
                          resources: Iterable[str] = GPU_RESOURCES, timeout_seconds: int = 5,
                          extra_namespace_match: list[dict] | None = None) -> dict:
    """The ValidatingWebhookConfiguration; ``client_config_for`` is its ``clientConfig`` without
    the path (``{"service": {...}}`` or ``{"url": "https://host:port"}``, plus ``caBundle``)."""
    fail_closed = list(fail_closed)
    excluded = {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": list(EXCLUDED_NAMESPACES)}
    opted_out = {"key": OPT_OUT_LABEL, "operator": "NotIn", "values": ["disabled"]}
    hooks = []
    # Per fail-closed environment its own webhook and path (``/validate/prod``): the AdmissionReview
    # carries no namespace labels, so the path is how admit learns the namespace's environment.
    groups = [(env_name, [env_name]) for env_name in fail_closed] + [(None, fail_closed)]
    names = {env_name: _dns_label(env_name) for env_name in fail_closed}
    if len(set(names.values())) < len(names):
        raise ValueError(f"fail_closed environments {fail_closed} give one webhook name twice (lower-cased, '_' as '-')")
    for short, group, version, resource, cel_kind in KINDS:
        for closed_env, values in groups:
            closed = closed_env is not None
            # (with no fail-closed environment, the fail-open webhook selects by label not at all: NotIn [] is invalid)
            env = [{"key": ENV_LABEL, "operator": "In" if closed else "NotIn", "values": values}] if values else []
            path = WEBHOOK_PATH + (f"/{closed_env}" if closed else "")
            if "url" in client_config_for:
                client = {**client_config_for, "url": client_config_for["url"].rstrip("/") + path}
            else:
                client = {**client_config_for, "service": {**client_config_for["service"], "path": path}}
            # (the one fail-closed environment's webhooks keep the name they had before it had a path)
            tag = ("fail-closed." if len(fail_closed) == 1 else f"fail-closed.{names[closed_env]}.") if closed else ""
            hooks.append(copy.deepcopy({
                "name": f"{short}.{tag}admit.gpuledger.io",
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",  # the decision event is gpuledger's record, not a change to the cluster
                "clientConfig": client,
                "rules": [{"apiGroups": [group], "apiVersions": [version], "resources": [resource], "operations": ["CREATE"],
                           "scope": "Namespaced"}],
                "failurePolicy": "Fail" if closed else "Ignore",
                "matchPolicy": "Equivalent",
                "timeoutSeconds": timeout_seconds,
                # The opt-out is a namespace's only: an objectSelector on gpuledger.io/admit let any Pod or Job
                # labelled 'disabled' by its creator skip the webhook — in prod, past the fail-closed one too.
                "namespaceSelector": {"matchExpressions": [excluded, opted_out, *env, *(extra_namespace_match or [])]},
                "matchConditions": [{"name": "requests-gpu", "expression": gpu_match_expression(cel_kind, resources)}],
            }))
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration", "metadata": {"name": name},
            "webhooks": hooks}


def rendered_webhook_yaml() -> str:
    """deploy/k8s/base/admit/webhook.yaml: the configuration for the in-cluster Service."""
    import yaml

    cfg = webhook_configuration({"service": {"name": "gpuledger-admit", "namespace": "gpuledger", "port": 443}})
    cfg["metadata"]["annotations"] = {"cert-manager.io/inject-ca-from": "gpuledger/gpuledger-admit-tls"}
    cfg["metadata"]["labels"] = {"app.kubernetes.io/name": "gpuledger", "app.kubernetes.io/component": "admit",
                                 "app.kubernetes.io/part-of": "gpuledger"}
    return WEBHOOK_YAML_HEADER + yaml.safe_dump(cfg, sort_keys=False, width=200)


WEBHOOK_YAML_HEADER = """# Generated by `python -m producers.admission.manifests` (a test keeps them equal):
# per kind (Pods, Jobs, Kueue Workloads) a fail-closed webhook for namespaces labelled
# gpuledger.io/environment=prod (failurePolicy: Fail; path /validate/prod, which tells admit the
# namespace's environment) and a fail-open one for the rest (Ignore; /validate); only objects requesting a GPU resource or naming a DRA claim are sent (matchConditions, CEL);
# namespaces labelled gpuledger.io/admit=disabled, kube-system and gpuledger never (no object
# opt-out: a workload's creator writes its labels).
# The caBundle is injected by cert-manager from the gpuledger-admit-tls Certificate.
"""


def admission_check(name: str = "gpuledger-release-approval", controller_name: str = "gpuledger.io/release-approval") -> dict:
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "AdmissionCheck", "metadata": {"name": name},
            "spec": {"controllerName": controller_name}}


if __name__ == "__main__":
    from pathlib import Path

    target = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "base" / "admit" / "webhook.yaml"
    target.write_text(rendered_webhook_yaml())
    print(f"wrote {target}")
