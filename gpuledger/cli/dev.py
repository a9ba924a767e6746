"""`gpuledger dev cluster up|down|status`: the local real Kubernetes control plane, KWOK and Kueue, and its peers."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from gpuledger.cli._common import err, fail, load_settings

app = typer.Typer(no_args_is_help=True, help="Development peers run on this machine.")
cluster = typer.Typer(no_args_is_help=True, help="The local real cluster: etcd, kube-apiserver/controller-manager/scheduler, "
                                                 "KWOK GPU nodes and Kueue (docs/real-cluster.md).")
app.add_typer(cluster, name="cluster")


def _print_reach(state: dict) -> None:
    print(f"server      {state['server']}")
    print("versions    " + " ".join(f"{k} {v}" for k, v in state["versions"].items()))
    print(f"logs        {state['data_dir']}/logs")
    print(f"reach it    export KUBECONFIG={state['kubeconfig']}; kubectl get nodes")
    peers = state.get("peers")
    if peers:
        token = f" (bearer token: {peers['alertmanager_token']})" if peers["alertmanager_token"] else " (no bearer token)"
        print(f"DCGM page   {peers['dcgm_page']}  (XIDs: POST {peers['xid_control']} {{\"node\": …, \"index\": …, \"xid\": 79}})")
        print(f"kubelets    pod-resources sockets in {peers['kubelet_sockets']}/<node>.sock")
        print(f"prometheus  {peers['prometheus']}  (rule GpuXidError over the DCGM page)")
        print(f"alertmanager {peers['alertmanager']} → {peers['receiver_url']}/v1/alertmanager{token}")
        print(f"mlflow      {peers['mlflow']}  (webhook → {peers['receiver_url']}/v1/mlflow; "
              f"receiver: GPULEDGER_RECEIVER_MLFLOW_SECRET={peers['mlflow_webhook_secret']})")
    print(state["kubeconfig"])


@cluster.command("up")
def cluster_up(
    peers: bool = typer.Option(True, "--peers/--no-peers", help="Also start the DCGM page and kubelet doubles, Prometheus, "
                                                                "Alertmanager and MLflow, wired to --receiver-url."),
    receiver_url: str = typer.Option("http://127.0.0.1:9095", "--receiver-url", help="The gpuledger receiver Alertmanager and "
                                                                                     "MLflow's webhook deliver to."),
    credentials_file: Optional[Path] = typer.Option(None, "--receiver-credentials", help="The receiver's credentials file: a "
                                                    "service:alertmanager caller is added and Alertmanager sends its token "
                                                    "(default: no token)."),
    mlflow_secret: Optional[str] = typer.Option(None, "--mlflow-secret", help="Secret of MLflow's webhook (the receiver's "
                                                "GPULEDGER_RECEIVER_MLFLOW_SECRET; default: a random one, printed)."),
) -> None:
    """Start the local cluster (and its peers) in the background (the first run builds the binaries: minutes); prints the kubeconfig path last."""
    from gpuledger.dev.cluster import ClusterError, up
    from gpuledger.dev.kubebin import BuildError
    from gpuledger.dev.peers import PeerError

    settings = load_settings(local_broker=False)
    err.print("starting the local cluster (the first run builds Kubernetes, KWOK and Kueue: several minutes)"
              + (" and its peers (MLflow's first start makes its virtualenv)" if peers else "") + "...")
    try:
        state = up(settings.data_dir, settings.cache_dir, peers=peers, receiver_url=receiver_url, credentials_file=credentials_file,
                   mlflow_secret=mlflow_secret)
    except (ClusterError, BuildError, PeerError) as exc:
        fail(str(exc))
    _print_reach(state)


@cluster.command("down")
def cluster_down() -> None:
    """Stop the local cluster (and its peers) started by `dev cluster up`."""
    from gpuledger.dev.cluster import down

    state = down(load_settings(local_broker=False).data_dir)
    print(f"stopped the local cluster at {state['server']}" if state else "no local cluster running")


@cluster.command("status")
def cluster_status() -> None:
    """Say whether the local cluster runs, and how to reach it (exit 3 when it does not)."""
    from gpuledger.dev.cluster import running_cluster

    state = running_cluster(load_settings(local_broker=False).data_dir)
    if not state:
        print("no local cluster running")
        raise typer.Exit(3)
    _print_reach(state)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="dev")
