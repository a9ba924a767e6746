"""`gpuledger admit`: the validating admission webhook and Kueue AdmissionCheck controller (control 1 as prevention)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Optional

import typer

from gpuledger.cli._common import BootstrapOpt, err, failing_on, load_settings, run_component


def admit(
    host: Optional[str] = typer.Option(None, "--host", help="Listen address (default GPULEDGER_ADMIT_HOST or 127.0.0.1)."),
    port: Optional[int] = typer.Option(None, "--port", help="HTTPS port (default GPULEDGER_ADMIT_PORT or 9443; 0 = any free port)."),
    tls_cert: Optional[Path] = typer.Option(None, "--tls-cert", help="PEM serving certificate; unset: a self-signed one is generated and its CA printed."),
    tls_key: Optional[Path] = typer.Option(None, "--tls-key", help="PEM key of --tls-cert."),
    kubeconfig: Optional[Path] = typer.Option(None, "--kubeconfig", help="Run the Kueue AdmissionCheck controller against this cluster."),
    in_cluster: bool = typer.Option(False, "--in-cluster", help="Run the AdmissionCheck controller with the pod's service account."),
    claims_in_cluster: bool = typer.Option(False, "--claims-in-cluster", help="Read DRA claims with the pod's service account (no controller)."),
    ca_out: Optional[Path] = typer.Option(None, "--ca-out", help="Also write the generated CA (PEM) to this file."),
    client_ca: Optional[Path] = typer.Option(None, "--client-ca", help="PEM CA of the callers' client certificates: /validate then answers only a caller it authenticates (the API server), and decisions record it (GPULEDGER_ADMIT_CLIENT_CA_FILE)."),
    bootstrap: Optional[str] = BootstrapOpt,
) -> None:
    """Decide, before queue entry, whether GPU work may start: webhook + AdmissionCheck controller."""
    from kubernetes.config.config_exception import ConfigException

    from producers._errors import ProducerError
    from producers._kafka import EventPublisher, resolve_bootstrap
    from producers.admission.service import AdmitService
    from streams.controls.policy import PolicyError

    settings = load_settings(bootstrap, admit={"host": host, "port": port, "tls_cert_file": tls_cert, "tls_key_file": tls_key, "client_ca_file": client_ca,
                                               "kubeconfig": kubeconfig, "in_cluster": in_cluster or None,
                                               "claims_in_cluster": claims_in_cluster or None, "ca_out": ca_out})
    with failing_on(PolicyError, code=2):
        policy = settings.policy.load()
    with failing_on(ProducerError):
        publisher = EventPublisher.from_settings(settings, "admit")
    cfg = settings.admit
    api = None
    if cfg.kubeconfig or cfg.in_cluster or cfg.claims_in_cluster:
        from kubernetes import client as k8s
        from kubernetes import config as k8s_config

        conf = k8s.Configuration()
        with failing_on(ConfigException, OSError, prefix="admit: kubeconfig: "):
            if cfg.in_cluster or cfg.claims_in_cluster:
                k8s_config.load_incluster_config(client_configuration=conf)
            else:
                k8s_config.load_kube_config(config_file=str(cfg.kubeconfig), client_configuration=conf)
        api = k8s.ApiClient(conf)

    controller = bool(cfg.kubeconfig or cfg.in_cluster)  # (claims_in_cluster: API access for the claims only)

    def listening(bound_host: str, bound_port: int, ca_pem: bytes | None) -> None:
        err.print(f"gpuledger admit listening on https://{bound_host}:{bound_port}/validate"
                  + (" with the AdmissionCheck controller" if controller else "")
                  + (", reading DRA claims from the API server" if api else ", without API access (a DRA claim counts as a GPU)"), highlight=False)
        if ca_pem:
            err.print(f"caBundle: {base64.b64encode(ca_pem).decode()}", highlight=False, soft_wrap=True)

    service = AdmitService(cfg, policy, publisher, resolve_bootstrap(settings), settings.kafka.catalogue().release,
                           settings.kafka.aiokafka_config(), api, listening, run_controller=controller)
    run_component(service, "admit")


def register(root: typer.Typer) -> None:
    root.command("admit")(admit)
