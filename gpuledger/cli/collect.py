"""`gpuledger collect scheduler|podresources`: run a collector — publish an external system's facts to Kafka."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from gpuledger.cli._common import BootstrapOpt, failing_on, load_settings, run_component

app = typer.Typer(no_args_is_help=True, help="Run a collector: publish an external system's facts to Kafka.")


@app.callback()
def _collect() -> None:
    """Run a collector: publish an external system's facts to Kafka."""
    # A callback keeps `collect` a group even with one collector; typer would collapse it otherwise.


@app.command("scheduler")
def collect_scheduler(
    kubeconfig: Optional[Path] = typer.Option(None, "--kubeconfig", help="kubeconfig file (default: GPULEDGER_SCHEDULER_KUBECONFIG, else in-cluster in a pod, else ~/.kube/config)."),
    in_cluster: bool = typer.Option(False, "--in-cluster", help="Use the pod's service account."),
    context: Optional[str] = typer.Option(None, "--context", help="kubeconfig context (default: current)."),
    namespace: Optional[str] = typer.Option(None, "--namespace", help="Watch one namespace only (default: all)."),
    state_dir: Optional[Path] = typer.Option(None, "--state-dir", help="Where the published-state file lives (default: <data dir>/scheduler-collector)."),
    gpu_resource: Optional[list[str]] = typer.Option(None, "--gpu-resource", help="Extended resource that makes a pod a GPU pod, a trailing * makes it a prefix; repeat it (default: the GPU resource list shared with collect podresources)."),
    once: bool = typer.Option(False, "--once", help="List and publish once, then exit (no watches)."),
    bootstrap: Optional[str] = BootstrapOpt,
) -> None:
    """Publish Pod, Event and Kueue Workload transitions from the Kubernetes API."""
    from producers._errors import ProducerError
    from producers._kafka import EventPublisher
    from producers.kubernetes.collector import COMPONENT, SchedulerCollector, build_api_client

    settings = load_settings(bootstrap, collectors={"scheduler": {
        "kubeconfig": kubeconfig, "in_cluster": in_cluster or None, "context": context, "namespace": namespace, "state_dir": state_dir,
        "gpu_resources": tuple(gpu_resource) if gpu_resource else None}})
    sched = settings.collectors.scheduler
    with failing_on(ProducerError):
        api_client = build_api_client(sched)
        publisher = EventPublisher.from_settings(settings, COMPONENT)
        collector = SchedulerCollector(sched, publisher, api_client, sched.state_dir or Path(settings.data_dir) / "scheduler-collector")
    if not once:
        run_component(collector, "scheduler collector")
        return
    try:
        with failing_on(ProducerError):
            n = collector.run_once()
    finally:
        collector.close()
    print(f"published {n} event(s)")


@app.command("podresources")
def collect_podresources(
    socket: Optional[Path] = typer.Option(None, "--socket", help="Kubelet pod-resources socket (default: GPULEDGER_PODRESOURCES_SOCKET, else /var/lib/kubelet/pod-resources/kubelet.sock)."),
    node: Optional[str] = typer.Option(None, "--node", help="This node's name (default: GPULEDGER_PODRESOURCES_NODE)."),
    interval: Optional[float] = typer.Option(None, "--interval", help="Seconds between polls (default 10)."),
    state_dir: Optional[Path] = typer.Option(None, "--state-dir", help="Where the last published snapshot lives (default /var/lib/gpuledger)."),
    resource: Optional[list[str]] = typer.Option(None, "--resource", help="Resource name to publish; repeat it; a trailing '*' makes a prefix."),
    bootstrap: Optional[str] = BootstrapOpt,
) -> None:
    """Publish a node's GPU assignments from the kubelet's pod-resources API."""
    from producers._errors import ProducerError
    from producers._kafka import EventPublisher
    from producers.podresources.collector import COLLECTOR, PodResourcesCollector

    settings = load_settings(bootstrap, run="collectors.podresources", collectors={"podresources": {
        "socket": socket, "node": node, "interval_s": interval, "state_dir": state_dir,
        "resources": tuple(resource) if resource else None}})
    with failing_on(ProducerError):
        publisher = EventPublisher.from_settings(settings, COLLECTOR)
        collector = PodResourcesCollector(settings.collectors.podresources, publisher)
    run_component(collector, "pod-resources collector")


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="collect")
