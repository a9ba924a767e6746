"""`gpuledger exercise SCENARIO` and `gpuledger demo`: scripted exercises through the real pipeline (gpuledger/exercise.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from gpuledger.cli._common import console, fail, failing_on, load_settings


def exercise(
    scenario: Optional[str] = typer.Argument(None, help="A shipped scenario (incident-rollback, retirement, unapproved-admission, unapproved-admission-enforced) or a path to a YAML file."),
    speed: Optional[float] = typer.Option(None, "--speed", help="Compress the timeline this many times (default: the scenario's speed)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for names, UIDs and GPU UUIDs (default: the scenario's)."),
    report: Optional[Path] = typer.Option(None, "--report", help="Where to write the HTML report (default <data dir>/exercises/<scenario>/<scenario>.html)."),
    list_: bool = typer.Option(False, "--list", help="List the shipped scenarios and exit."),
    check: bool = typer.Option(False, "--check", help="Only validate the scenario file (and its capacity), then exit."),
    cluster: str = typer.Option("sim", "--cluster", help="sim: the simulated cluster (default); real: the local real control plane "
                                                         "with Kueue, KWOK, Prometheus, Alertmanager and MLflow (docs/exercises.md, 'On the real cluster')."),
) -> None:
    """Run a scripted exercise against a simulated GPU cluster through the real collectors, pipeline and store."""
    from gpuledger.exercise import run_exercise
    from gpuledger.sim.cluster import SimulationError, dry_run
    from gpuledger.sim.scenario import ScenarioError, load_scenario, shipped_scenarios

    if list_:
        for name in shipped_scenarios():
            sc = load_scenario(name)
            console.print(f"[bold]{name}[/]  {sc.description.strip()}", highlight=False)
        return
    if not scenario:
        fail("give a scenario: " + ", ".join(shipped_scenarios()) + " (or a path to a YAML file)", 2)
    if speed is not None and speed <= 0:
        fail("--speed must be greater than 0", 2)
    from gpuledger.exercise import CLUSTERS

    if cluster not in CLUSTERS:
        fail(f"--cluster must be one of {', '.join(CLUSTERS)}, not {cluster!r}", 2)
    with failing_on(ScenarioError, SimulationError, code=2):
        sc = load_scenario(scenario)
        if check:
            dry_run(sc, sc.seed if seed is None else seed)
    if check:
        console.print(f"{sc.name}: valid ({len(sc.timeline)} steps, {len(sc.expect)} expectations)", highlight=False)
        return
    # The exercise starts its own broker unless GPULEDGER_KAFKA_BOOTSTRAP names one: no `kafka up` lookup.
    settings = load_settings(local_broker=False)
    result = run_exercise(settings, sc, console, speed=speed, seed=seed, report_path=report, cluster=cluster)
    raise typer.Exit(result.exit_code)


def demo(keep: bool = typer.Option(False, "--keep", help="Accepted for compatibility: the data dir is always kept for inspection (its path is printed at the end).")) -> None:
    """What `make demo` runs: the incident-rollback exercise (local Kafka, the real collectors, worker and store, a simulated cluster)."""
    from gpuledger.exercise import run_exercise

    settings = load_settings(local_broker=False)
    raise typer.Exit(run_exercise(settings, "incident-rollback", console).exit_code)


def register(root: typer.Typer) -> None:
    root.command("exercise")(exercise)
    root.command("demo")(demo)
