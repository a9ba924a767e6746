"""`gpuledger worker`: the Faust worker (correlate, judge, store); `gpuledger status`: how it is doing."""

from __future__ import annotations

import json
import logging
from enum import Enum
from typing import Optional

import typer

from gpuledger.cli._common import BootstrapOpt, DsnOpt, console, failing_on, load_settings, print_whole


def worker(bootstrap: Optional[str] = BootstrapOpt, dsn: Optional[str] = DsnOpt,
           app_id: Optional[str] = typer.Option(None, "--app-id", help="Faust app id (consumer group)."),
           web_port: Optional[int] = typer.Option(None, "--web-port", help="Loopback port for health and read-only queries.")) -> None:
    """Run the Faust worker: correlate raw events and sink them into ClickHouse."""
    from gpuledger.settings import SettingsError
    from producers._errors import ProducerError
    from sinks.errors import SinkError
    from streams.app import run_worker
    from streams.controls.policy import PolicyError

    settings = load_settings(bootstrap, dsn, streams={"app_id": app_id, "web_port": web_port})
    # The libraries' level (-v: INFO) is the child processes' too.
    loglevel = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
    with failing_on(PolicyError, SettingsError, code=2), failing_on(ProducerError, SinkError):
        run_worker(settings, loglevel)


class StatusFormat(str, Enum):
    table = "table"
    json = "json"


def worker_url(settings, url: str | None) -> str | None:
    """The worker's web address: ``url``, else the one its sink recorded in the embedded
    store's owner file, else the configured ``GPULEDGER_STREAMS_WEB_PORT`` on loopback."""
    from sinks.clickhouse import is_embedded
    from sinks.read.query import current_owner

    if url:
        return url.rstrip("/")
    dsn = settings.clickhouse_dsn  # (the embedded default when GPULEDGER_CLICKHOUSE_DSN is unset)
    owner = current_owner(dsn) if is_embedded(dsn) else None
    if owner and owner.get("health"):
        return owner["health"]
    port = settings.streams.web_port
    return f"http://127.0.0.1:{port}" if port else None


def status(bootstrap: Optional[str] = BootstrapOpt, dsn: Optional[str] = DsnOpt,
           app_id: Optional[str] = typer.Option(None, "--app-id", help="The worker's app id (default: GPULEDGER_STREAMS_APP_ID)."),
           url: Optional[str] = typer.Option(None, "--url", help="The worker's web address (default: from the embedded store's owner "
                                                                  "file, else 127.0.0.1:GPULEDGER_STREAMS_WEB_PORT)."),
           fmt: StatusFormat = typer.Option(StatusFormat.table, "--format", help="table (for people) or json (for tools).")) -> None:
    """Is the worker well and how far behind is it: its health page and, from Kafka, every consumer group of the run with what it has not committed.

    The health page: status, problems, its processes, the release directory. Exit 0 when the worker says ok and Kafka
    answered, 1 otherwise."""
    from confluent_kafka import KafkaException
    from rich.table import Table

    from producers._errors import KafkaNotConfigured
    from producers._kafka import client_config
    from sinks.read.text import markup
    from streams.progress import RunProgress, worker_health

    settings = load_settings(bootstrap, dsn, streams={"app_id": app_id})
    app = settings.streams.app_id
    base = worker_url(settings, url)
    page = worker_health(base) if base else None
    groups, kafka_error, answered = None, None, False
    try:
        with RunProgress(client_config(settings), settings.kafka.catalogue(), app) as progress:
            groups = progress.group_lag()
    except (KafkaException, KafkaNotConfigured) as exc:  # (none configured: said, not a traceback — the worker's part still shown)
        kafka_error = str(exc)
    except LookupError as exc:  # Kafka answered: the raw topics are not there (wrong prefix, or none created yet)
        kafka_error, answered = str(exc), True
    # The worker found (through the store's owner file, or the port) may run another app id — the
    # live one while a replay's is asked for: its page is not this run's (it was shown as this
    # run's, ok, exit 0). A page without an app id (a worker from before it was there) is taken as is.
    other = page.get("app_id") if page is not None and page.get("app_id") not in (None, app) else None
    ok = page is not None and other is None and page.get("status") == "ok" and kafka_error is None
    if fmt is StatusFormat.json:
        print(json.dumps({"app_id": app, "url": base, "health": None if other else page, "groups": groups, "kafka_error": kafka_error,
                          **({"error": f"the worker at {base} runs app id {other!r}, not {app!r}"} if other else {})}, indent=2))
        raise typer.Exit(0 if ok else 1)
    if base is None:
        console.print(f"worker {markup(app)}: [red]not found[/] (no owner file for the store, GPULEDGER_STREAMS_WEB_PORT unset: pass --url)", soft_wrap=True)
    elif other is not None:
        console.print(f"worker {markup(app)}: [red]not found[/] — the worker at {markup(base)} runs app id {markup(other)} "
                      f"(`gpuledger status --app-id {markup(other)}` shows it)", soft_wrap=True)
    elif page is None:
        console.print(f"worker {markup(app)}: [red]not answering[/] at {markup(base)}", soft_wrap=True)
    else:
        colour = "green" if page.get("status") == "ok" else "yellow"
        console.print(f"worker {markup(app)}: [{colour}]{markup(str(page.get('status')))}[/] at {markup(base)}", soft_wrap=True)
        for problem in [*((page.get("subscriptions") or {}).get("problems") or []), *(page.get("problems") or [])]:
            console.print(f"  problem: {markup(str(problem))}", soft_wrap=True)
        directory = page.get("release_directory") or {}
        confirmed = (f", confirmed current {directory['confirmed_age_s']:.0f} s ago" if directory.get("confirmed_age_s") is not None else "")
        console.print(f"  release directory: {'ready' if directory.get('ready') else 'loading'}, {directory.get('releases', 0):,} releases"
                      f"{confirmed}; parked rows: {(page.get('stats') or {}).get('parked', 0):,}", soft_wrap=True)
        if directory.get("problem"):
            console.print(f"  [yellow]release directory[/]: {markup(str(directory['problem']))}", soft_wrap=True)
        capped = {kind: n for kind, n in ((page.get("stats") or {}).get("capped") or {}).items() if n}
        if capped:  # a state bound bit: exactness ends there (docs/architecture.md, Bounds)
            console.print("  [yellow]state bounds hit[/] since start: " + ", ".join(f"{kind.replace('_', ' ')} {n:,}" for kind, n in sorted(capped.items())), soft_wrap=True)
        procs = Table("process", "pid", "answering", "nice", "restarts", "last exit", "lag (not committed)")
        for name in ("route", "controls", "sink"):
            child = page.get(name) or {}
            lag = child.get("lag") or {}
            procs.add_row(name, str(child.get("pid") or "-"), "yes" if child.get("answering") else "[red]no[/]", str(child.get("nice", "-")),
                          str(child.get("restarts", 0)), str(child.get("last_exit") if child.get("last_exit") is not None else "-"),
                          _lag_text(lag))
        print_whole(procs)
    if kafka_error is not None:
        console.print(f"consumer groups: [red]{'not read' if answered else 'Kafka did not answer'}[/]: {markup(kafka_error)}", soft_wrap=True)
    else:
        table = Table("consumer group", "reads", "partitions", "lag (records not committed)", "never committed")
        for group, g in groups.items():
            topics = g["topics"]
            reads = ", ".join(topics) if len(topics) <= 2 else f"{topics[0]} and {len(topics) - 1} more"
            # A group that committed on no partition may not exist at all (another app id's run, a
            # worker never started): its "lag" is the whole topic — said as such, not as a backlog.
            never = g.get("committed_partitions") == 0 and g["lag"] > 0
            table.add_row(markup(group), markup(reads), str(g["partitions"]),
                          f"[yellow]none committed ({g['lag']:,} records)[/]" if never else f"{g['lag']:,}", str(g["never_committed"]))
        print_whole(table)
    raise typer.Exit(0 if ok else 1)


def _lag_text(lag: dict) -> str:
    """A child's group lag for the status table: its total, or why the total is not the lag — not
    read yet, or statistics that stopped coming (a consumer not polled: a sink holding its batch
    while the store is down showed a lag of 0)."""
    if not lag:
        return "-"
    if lag.get("age_s") is None:
        return "[yellow]not read yet[/]"
    if not lag.get("partitions"):
        return "[yellow]no partition assigned[/]"
    if lag.get("stale"):
        return f"[yellow]{lag['total']:,} ({lag['age_s']:.0f} s old)[/]"
    return f"{lag['total']:,}"


def register(root: typer.Typer) -> None:
    root.command("worker")(worker)
    root.command("status")(status)
