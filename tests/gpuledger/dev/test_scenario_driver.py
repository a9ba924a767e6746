"""What ``gpuledger exercise --cluster real`` refuses before it starts anything (gpuledger/dev/scenario_driver.py).

The runs themselves are in tests/real_cluster/test_exercise.py (the real control plane)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from gpuledger.cli.root import app
from gpuledger.dev.cluster import GpuNode
from gpuledger.dev.scenario_driver import RealClusterError, mlflow_release_template, scenario_nodes
from gpuledger.sim.scenario import load_scenario, parse_scenario


def test_the_scenarios_nodes_become_kwok_nodes_with_their_gpus_and_mig_slices():
    nodes = scenario_nodes(load_scenario("incident-rollback"))
    assert nodes == (GpuNode("n1", mig=(("1g.10gb", 4),), product="NVIDIA-A100-SXM4-80GB"),
                     GpuNode("n2", gpus=4, product="NVIDIA-A100-SXM4-80GB"), GpuNode("n3", gpus=4, product="NVIDIA-A100-SXM4-80GB"))


@pytest.mark.parametrize("name", ["incident-rollback", "retirement", "unapproved-admission"])
def test_the_shipped_release_ids_are_mlflow_versions_under_one_template(name):
    sc = load_scenario(name)
    template = mlflow_release_template(sc)
    assert {template.format(model=r.model, version=r.version) for r in sc.releases.values()} == set(sc.releases)


def _scenario(releases: dict) -> object:
    return parse_scenario({"name": "t", "cluster": {"nodes": 1, "queues": [{"name": "q", "namespace": "ns", "cluster_queue": "cq"}],
                                                    "priority_classes": {"p": 1}},
                           "releases": releases, "timeline": [{"at": 0, "register": {"release": next(iter(releases))}}],
                           "expect": [{"name": "registered", "release": next(iter(releases)), "release_state": "release.registered"}]})


def test_a_release_id_mlflow_cannot_produce_is_refused_naming_it():
    sc = _scenario({"scorer-7": {"model": "scorer", "version": "7", "owner": "o", "image": "r/s:7"}})
    with pytest.raises(RealClusterError, match=r"release scorer-7: .*<model>-v<version>-<suffix> \(here scorer-v7-…\)"):
        mlflow_release_template(sc)
    mixed = _scenario({"a-v1-prod": {"model": "a", "version": "1", "owner": "o", "image": "r/a:1"},
                       "a-v2-eval": {"model": "a", "version": "2", "owner": "o", "image": "r/a:2"}})
    with pytest.raises(RealClusterError, match="releases end in eval, prod"):
        mlflow_release_template(mixed)


def test_an_unknown_cluster_is_a_usage_error():
    out = CliRunner().invoke(app, ["exercise", "incident-rollback", "--cluster", "kind"])
    assert out.exit_code == 2 and "--cluster must be one of sim, real, not 'kind'" in out.output, out.output
