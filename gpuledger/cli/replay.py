"""`gpuledger replay`: the postmortem replay of a time range into a sandbox store (gpuledger/replay.py).

Exit codes: 0 caught up; 1 the worker died, Kafka or the store failed, or ``--timeout``
passed; 2 bad options or a refusal; 130 interrupted (Ctrl-C), 143 terminated (SIGTERM) — in
both the worker is stopped and ``--resume`` continues.
"""

from __future__ import annotations

import signal
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import typer

from gpuledger.cli._common import BootstrapOpt, err, fail, load_settings


def replay(
    into: str = typer.Option(..., "--into", help="The sandbox store: chdb:///path or http(s)://… (never the live store)."),
    start: Optional[str] = typer.Option(None, "--from", help="Replay events that occurred at or after this time: RFC 3339 (no zone means UTC) or a duration before now (2h, 30m, 1d, 1h30m)."),
    end: Optional[str] = typer.Option(None, "--to", help="...and at or before this time (same forms; the range is closed, as audit's --from/--to)."),
    app_id: Optional[str] = typer.Option(None, "--app-id", help="The replay's app id = consumer group and run topics. Default: replay-<UTC timestamp>."),
    resume: bool = typer.Option(False, "--resume", help="Continue the replay of --app-id (its group has committed offsets; its range is reused) instead of refusing."),
    database: Optional[str] = typer.Option(None, "--database", help="Database in the sandbox (default: GPULEDGER_CLICKHOUSE_DATABASE)."),
    work_dir: Optional[Path] = typer.Option(None, "--work-dir", help="The worker's data dir (Faust state, worker.log, replay.json). Default: $GPULEDGER_DATA_DIR/replays/<app id>."),
    timeout: Optional[float] = typer.Option(None, "--timeout", min=1.0, help="Give up (exit 1) after this many seconds without catching up. Default: wait."),
    bootstrap: Optional[str] = BootstrapOpt,
) -> None:
    """Postmortem replay: rebuild a time range's tables from the raw topics into a sandbox store."""
    from gpuledger.replay import (ReplayError, ReplayPlan, ReplayRefused, default_app_id, parse_instant, print_summary, refusals,
                                  run_replay)
    from gpuledger.timefmt import parse_time
    from producers._errors import ProducerError
    from sinks.clickhouse import redact
    from sinks.errors import SinkError

    settings = load_settings(bootstrap)
    now = datetime.now(timezone.utc)
    if resume and not app_id:
        fail("--resume needs the --app-id of the replay to continue", 2)
    from sinks.clickhouse import dsn_problem, is_embedded

    if (problem := dsn_problem(into)):
        fail(f"--into {problem}", 2)
    if is_embedded(into) and (problem := sandbox_dir_problem(into)):
        fail(problem, 2)
    app_id = app_id or default_app_id(now)
    work_dir = work_dir or settings.data_dir / "replays" / app_id
    before = ReplayPlan.recorded(work_dir) if resume else None
    try:
        since = parse_instant(start, "--from", now) if start else settings.streams.replay_from
        until = parse_instant(end, "--to", now) if end else settings.streams.replay_to
    except ReplayRefused as exc:
        fail(str(exc), 2)
    if before and not (start or end):  # resuming: the range the replay started with ("2h" meant then, not now)
        since, until = (parse_time(before[k], f"{work_dir / 'replay.json'}: {k}") if before.get(k) else None for k in ("from", "to"))
    plan = ReplayPlan(app_id, into, database or settings.clickhouse.database, work_dir, since, until, resume, settings.kafka.topic_prefix)
    problems = refusals(plan, settings)
    if problems:
        fail("refusing to replay:\n  " + "\n  ".join(problems), 2)
    # SIGTERM (timeout, systemd, kill) ends the replay as Ctrl-C does: the worker stopped, the resume said.
    signal.signal(signal.SIGTERM, _terminated)
    try:
        result = run_replay(plan, settings, err, timeout)
    except ReplayRefused as exc:
        fail(str(exc), 2)
    except KeyboardInterrupt as exc:
        # Everything the resume must be told again (its record, replay.json, is in the work dir).
        extra = "" if work_dir == settings.data_dir / "replays" / app_id else f" --work-dir {work_dir}"
        extra += "" if plan.database == settings.clickhouse.database else f" --database {plan.database}"
        how = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
        err.print(f"{how}; the worker is stopped. Continue with: gpuledger replay --resume --app-id {plan.app_id} "
                  f"--into {redact(plan.into)}{extra}", highlight=False, soft_wrap=True)
        raise typer.Exit(143 if isinstance(exc, Terminated) else 130)
    except SinkError as exc:
        # (the store named is --into: the sink's own hint names the live store's setting)
        fail(f"--into {redact(plan.into)}: {str(exc).removesuffix(' Check GPULEDGER_CLICKHOUSE_DSN.')}")
    except (ReplayError, ProducerError) as exc:
        fail(str(exc))
    print_summary(plan, result)


class Terminated(KeyboardInterrupt):
    """SIGTERM during a replay, raised where Ctrl-C's KeyboardInterrupt is (and handled as it is)."""


def _terminated(signum, frame) -> None:
    raise Terminated()


def sandbox_dir_problem(into: str) -> str | None:
    """Why the sandbox directory of a chDB ``--into`` cannot be used (None: it can): it is a file, or where it and
    the file the sink writes beside it (its owner file) go, the nearest directory that exists
    must take a new file. Judged without creating anything (a refusal after this one leaves no
    trace). Before, a path under a file or under /proc started the worker, whose sink crashed
    three times with a traceback after ~25 s — and the app id had committed offsets by then,
    refusing a retry."""
    import tempfile

    from sinks.clickhouse import chdb_path

    path = Path(chdb_path(into))
    if path.exists() and not path.is_dir():
        return f"--into {into}: {path} is a file, not a directory for the sandbox store"
    where = path.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    if not where.is_dir():
        return f"--into {into}: the sandbox directory {path} cannot be created: {where} is a file"
    try:
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as exc:
        return f"--into {into}: the sandbox directory {path} cannot be created in {where} ({exc.strerror or exc})"
    return None


def register(root: typer.Typer) -> None:
    root.command("replay")(replay)
