"""`gpuledger dev cluster up|down|status`: the local real Kubernetes control plane, KWOK and Kueue."""

from __future__ import annotations

import typer

from gpuledger.cli._common import err, fail, load_settings

app = typer.Typer(no_args_is_help=True, help="Development peers run on this machine.")
cluster = typer.Typer(no_args_is_help=True, help="The local real cluster: etcd, kube-apiserver/controller-manager/scheduler, "
                                                 "KWOK GPU nodes and Kueue (docs/real-cluster.md).")
app.add_typer(cluster, name="cluster")


def _print_reach(state: dict) -> None:
    print(f"server      {state['server']}")
    print(f"versions    " + " ".join(f"{k} {v}" for k, v in state["versions"].items()))
    print(f"logs        {state['data_dir']}/logs")
    print(f"reach it    export KUBECONFIG={state['kubeconfig']}; kubectl get nodes")
    print(state["kubeconfig"])


@cluster.command("up")
def cluster_up() -> None:
    """Start the local cluster in the background (the first run builds the binaries: minutes); prints the kubeconfig path last."""
    from gpuledger.dev.cluster import ClusterError, up
    from gpuledger.dev.kubebin import BuildError

    settings = load_settings(local_broker=False)
    err.print("starting the local cluster (the first run builds Kubernetes, KWOK and Kueue: several minutes)...")
    try:
        state = up(settings.data_dir, settings.cache_dir)
    except (ClusterError, BuildError) as exc:
        fail(str(exc))
    _print_reach(state)


@cluster.command("down")
def cluster_down() -> None:
    """Stop the local cluster started by `dev cluster up`."""
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
