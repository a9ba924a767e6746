"""Settings of ``gpuledger admit``: env ``GPULEDGER_ADMIT_<FIELD>``.

Input: the environment and the command's flags. Output: a validated, frozen view of where
the webhook listens, its certificate, which objects are GPU work, and the AdmissionCheck
controller; every problem is reported at once by the root loader. No I/O here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from producers._config import GPU_DRA_DRIVERS, GPU_RESOURCES, NameList, check_resource_patterns

CONTROLLER_NAME = "gpuledger.io/release-approval"
#: The webhook's path; ``WEBHOOK_PATH/<environment>`` that of the webhook for namespaces labelled
#: ``gpuledger.io/environment=<environment>`` of a fail-closed environment (``producers.admission.manifests``).
WEBHOOK_PATH = "/validate"
#: AdmitSettings.stale_after_s's default.
STALE_AFTER_S = 60.0


class AdmitSettings(BaseSettings):
    """The admission webhook and AdmissionCheck controller (``gpuledger admit``)."""

    model_config = SettingsConfigDict(env_prefix="GPULEDGER_ADMIT_", extra="ignore")

    host: str = Field(default="127.0.0.1", description="Address the HTTPS server listens on (0.0.0.0 in a pod).")
    port: int = Field(default=9443, ge=0, le=65535, description="HTTPS port; 0 picks a free one (printed at start).")
    tls_cert_file: Optional[Path] = Field(default=None, description="PEM serving certificate (chain); unset: a self-signed CA and certificate are generated at start and the CA printed for the webhook's caBundle.")
    tls_key_file: Optional[Path] = Field(default=None, description="PEM private key of tls_cert_file.")
    tls_names: NameList = Field(default=("localhost", "gpuledger-admit", "gpuledger-admit.gpuledger", "gpuledger-admit.gpuledger.svc"),
                                description="DNS names of the generated certificate (127.0.0.1 and the listen address are always in it).")
    client_ca_file: Optional[Path] = Field(default=None, description="PEM CA bundle that authenticates the webhook's caller: when set, `/validate` answers only a caller presenting a client certificate it signed (the API server's, from the kubeconfig of its AdmissionConfiguration: docs/admission.md), and each decision records that certificate's subject as `caller` — the API server that authenticated the creating `user`. Others get 401 and no decision. Unset: any caller is answered, `caller` is empty and `user` is only what the caller said. `/healthz` and `/readyz` never ask for a certificate (probes).")
    client_names: NameList = Field(default=(), description="With client_ca_file: the client certificate's common name or a DNS name of its SANs must be one of these (comma-separated); empty: any certificate client_ca_file signed.")
    ca_out: Optional[Path] = Field(default=None, description="Also write the generated CA certificate (PEM) to this file.")
    kubeconfig: Optional[Path] = Field(default=None, description="kubeconfig of the cluster whose Kueue Workloads the AdmissionCheck controller gates; unset: no controller (webhook only), unless in_cluster.")
    in_cluster: bool = Field(default=False, description="Run the AdmissionCheck controller with the pod's service account (the webhook then reads DRA claims with it too).")
    claims_in_cluster: bool = Field(default=False, description="Read the DRA claims of the objects the webhook decides (ResourceClaims, ResourceClaimTemplates, DeviceClasses: get) with the pod's service account, without running the controller. Without API access a DRA claim counts as one GPU, and the answer says so (docs/admission.md).")
    controller_name: str = Field(default=CONTROLLER_NAME, description="controllerName of the AdmissionChecks this controller serves.")
    label_prefix: str = Field(default="gpuledger.io/", description="Prefix of the labels/annotations naming release-id, environment, model, owner (the scheduler collector's).")
    gpu_resources: NameList = Field(default=GPU_RESOURCES, description="Extended resources that make an object GPU work, comma-separated; a trailing '*' is a prefix (the collectors' default).")
    dra_drivers: NameList = Field(default=GPU_DRA_DRIVERS, description="DRA drivers whose devices are GPUs, comma-separated; a trailing '*' is a prefix (the collectors' default): a DRA claim's request is for GPUs when its DeviceClass's CEL selectors name one of these (producers/admission/claims.py).")
    max_body_bytes: int = Field(default=3 * 1024 * 1024, ge=1024, description="Largest AdmissionReview accepted (the API server sends at most ~3 MiB objects); larger ones get 413.")
    resync_s: float = Field(default=30.0, gt=0, description="How often the controller re-lists Workloads besides watching them (and re-decides the waiting ones).")
    watch_timeout_s: int = Field(default=300, ge=1, description="Server-side timeout of one Workload watch request.")
    publish_batch: int = Field(default=500, ge=1, description="Most decisions published to Kafka in one batch (decisions are published off the request path).")
    stale_after_s: float = Field(default=STALE_AFTER_S, ge=10, description="The release state counts as stale when it could not be confirmed current (the release topic's end offsets asked and read up to, every 5 s: at least 10) for this many seconds — Kafka unreachable after it loaded: decisions go on from the state in memory, and each says since when it could not be confirmed (an AdmissionReview warning, the Workload check's message, the recorded decision's message); `/healthz` says `degraded` with the reason.")
    publish_queue: int = Field(default=100_000, ge=1, description="Decisions waiting for Kafka beyond this are dropped (counted on /healthz; logged at ERROR when drops begin and with their count when publishing resumes): a webhook must answer even when Kafka does not.")

    @field_validator("gpu_resources", "dra_drivers")
    @classmethod
    def _some_resources(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return check_resource_patterns(value)

    @field_validator("label_prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if not value.endswith("/"):
            raise ValueError(f"label_prefix must end with '/', got {value!r}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> AdmitSettings:
        problems = []
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            problems.append("tls_cert_file and tls_key_file go together (give both, or neither for a generated certificate)")
        if self.in_cluster and self.kubeconfig:
            problems.append("in_cluster and kubeconfig exclude each other")
        if self.client_names and self.client_ca_file is None:
            problems.append("client_names needs client_ca_file (the CA whose certificates they name)")
        if self.claims_in_cluster and self.kubeconfig:
            problems.append("claims_in_cluster and kubeconfig exclude each other (with a kubeconfig the claims are read with it)")
        if problems:
            raise ValueError("; ".join(problems))
        return self
