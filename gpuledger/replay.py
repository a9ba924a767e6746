"""`gpuledger replay`: the postmortem replay — rebuild the projections of a time range
from the raw topics into a sandbox store.

Input: the raw topics (the system of record), read from their first offset; a sandbox
DSN (``chdb:///path`` or ``http(s)://…``); optionally an event-time range. Output: the
sandbox store, holding what the worker builds from that history — then ``gpuledger
trace`` / ``audit`` run on it with ``GPULEDGER_CLICKHOUSE_DSN`` pointed there.

How: the real worker runs as a child process (``gpuledger.dev.process.ServiceProcess``)
under the replay's own app id — its own consumer group and run topics, so it reads
no other run's outputs (DESIGN.md: a replay is its own world) — with the sandbox as
its store, the replay's directory as its data dir (Faust state, ``worker.log``) and
the range as ``GPULEDGER_STREAMS_REPLAY_FROM/TO`` (the route stage and the raw sink
skip events outside it; the release directory reads every release regardless).
Every other setting is inherited. Progress: raw records committed by the replay's
group of the end offsets at start; done when caught up (``streams.progress``), then
the worker gets SIGTERM and a summary is printed.

Guarantees: a replay starts from zero — an app id whose group has committed offsets
is refused unless ``--resume``, and so are the live worker's app id, the live store
and a sandbox that already holds rows. Exit codes: 0 caught up; 1 the worker died,
Kafka or the store failed, or ``--timeout`` passed; 2 bad options or a refusal;
130 interrupted (the worker is stopped; ``--resume`` continues).

The command itself (options, exit codes) is ``gpuledger/cli/replay.py``; this module
holds no CLI code.

Limits: entity state from before ``--from`` (pods scheduled earlier, GPUs assigned
earlier) is not known to the replay — only releases are; start earlier for that.
Records published after the replay started are processed but not waited for.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from urllib.parse import urlsplit

from confluent_kafka import KafkaException
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn
from rich.text import Text

from gpuledger.timefmt import STORE_TIMES, TIME_EXAMPLE, DurationOutOfRange, TimeFormatError, TimeOutOfRange, parse_duration, parse_time
from sinks.clickhouse import chdb_path, is_embedded, redact


class ReplayError(RuntimeError):
    """A replay that cannot start or did not finish; the message says why (exit 1)."""


class ReplayRefused(ReplayError):
    """Options a replay must not run with (exit 2)."""


# --- options --------------------------------------------------------------------------------

def parse_instant(text: str, option: str, now: datetime) -> datetime:
    """An RFC 3339 time (no zone means UTC) or a duration before ``now`` ('2h', '30m', '1d', '1h30m'),
    both in the grammar of ``gpuledger.timefmt``. A bare number is refused: as seconds before now a
    pasted Unix timestamp (``1700000000``) replayed from 1973, accepted without a word."""
    if text.strip().replace(".", "", 1).isdigit():
        raise ReplayRefused(f"{option} {text!r}: a bare number — a duration before now needs its unit (90s, 2h, 1d) and a time is "
                            f"RFC 3339 ({TIME_EXAMPLE}); a Unix timestamp is neither")
    try:
        ago = parse_duration(text)
    except DurationOutOfRange:  # longer than a timedelta holds: before year 1, so before the store's earliest time
        ago = timedelta.max
    except TimeFormatError:
        ago = None
    if ago is not None:
        try:
            instant = now - ago
        except OverflowError:
            instant = None
        if instant is None or instant < STORE_TIMES[0]:
            raise ReplayRefused(f"{option} {text!r}: a duration before now reaching before {STORE_TIMES[0]:%Y-%m-%d} "
                                "(the earliest time the store keeps)")
        return instant
    try:
        return parse_time(text, option)
    except TimeOutOfRange as exc:
        raise ReplayRefused(str(exc)) from None
    except TimeFormatError:
        raise ReplayRefused(f"{option} {text!r}: neither an RFC 3339 time ({TIME_EXAMPLE}) nor a duration before now (2h, 30m, 1d, 1h30m)") from None


def default_app_id(now: datetime) -> str:
    return f"replay-{now.astimezone(timezone.utc):%Y%m%dT%H%M%SZ}"


def same_store(dsn_a: str, db_a: str, dsn_b: str, db_b: str) -> bool:
    """Whether two (DSN, database) pairs name the same store: the same chDB directory, or
    the same server (scheme, host, port; credentials and URL path do not matter) and database."""
    if is_embedded(dsn_a) != is_embedded(dsn_b):
        return False
    if is_embedded(dsn_a):
        return Path(chdb_path(dsn_a)).resolve() == Path(chdb_path(dsn_b)).resolve()
    a, b = urlsplit(dsn_a), urlsplit(dsn_b)
    default = {"http": 8123, "https": 8443}
    return (a.scheme, a.hostname, a.port or default.get(a.scheme)) == (b.scheme, b.hostname, b.port or default.get(b.scheme)) and db_a == db_b


@dataclass(frozen=True)
class ReplayPlan:
    """What one replay does, decided before any I/O."""

    app_id: str
    into: str
    database: str
    work_dir: Path
    since: datetime | None
    until: datetime | None
    resume: bool
    topic_prefix: str = ""  # the raw topics' prefix (GPULEDGER_KAFKA_TOPIC_PREFIX): a resume must read the same ones

    @property
    def log_path(self) -> Path:
        return self.work_dir / "worker.log"

    def save(self) -> Path:
        """Record the plan beside the log (``replay.json``), so ``--resume`` replays the same range."""
        path = self.work_dir / "replay.json"
        self.work_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.record(), indent=2))
        return path

    def record(self) -> dict:
        return {"app_id": self.app_id, "into": redact(self.into), "database": self.database, "topic_prefix": self.topic_prefix,
                "from": _iso(self.since) if self.since else None, "to": _iso(self.until) if self.until else None}

    @staticmethod
    def recorded(work_dir: Path) -> dict | None:
        """The plan a previous run of this replay recorded (None: none)."""
        try:
            return json.loads((work_dir / "replay.json").read_text())
        except (OSError, ValueError):
            return None

    def range_text(self) -> str:
        if not (self.since or self.until):
            return "every event"
        return f"events with occurred_at in [{_iso(self.since) if self.since else '-∞'}, {_iso(self.until) if self.until else '+∞'}]"


def _iso(value: datetime) -> str:
    return value.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


def _given(value) -> str:
    """A recorded plan value as a person reads it: a range bound not given is "(not given)", not None."""
    return "(not given)" if value is None else str(value)


def refusals(plan: ReplayPlan, settings) -> list[str]:
    """What forbids this plan, from the settings and the replay's own record (no Kafka, no store)."""
    problems = []
    before = ReplayPlan.recorded(plan.work_dir) if plan.resume else None
    if plan.resume and before is None:
        # Without it the range would silently be every event, and the sandbox check is skipped:
        # a resume with another --work-dir replayed everything into a range's sandbox, exit 0.
        problems.append(f"--resume: no record of replay {plan.app_id} at {plan.work_dir / 'replay.json'} — pass the --work-dir "
                        "it ran with (the interrupted run printed its resume command), or start a new replay without --resume")
    if before:
        # (the topic prefix too: a resume from a shell without GPULEDGER_KAFKA_TOPIC_PREFIX read the default
        # topics into the sandbox, exit 0 — two histories mixed; a record older than it has none to compare)
        for key, value in plan.record().items():
            if key == "topic_prefix" and key not in before:
                continue
            if before.get(key) != value:
                problems.append(f"--resume: {key} is {_given(value)}, but replay {plan.app_id} ran with {_given(before.get(key))} "
                                f"({plan.work_dir / 'replay.json'})")
    if same_store(plan.into, plan.database, settings.clickhouse_dsn, settings.clickhouse.database):
        problems.append(f"--into {redact(plan.into)} is the live store (GPULEDGER_CLICKHOUSE_DSN, database {settings.clickhouse.database}): "
                        "a replay writes into a sandbox — give another chdb:///path or server database")
    if plan.app_id == settings.streams.app_id:
        problems.append(f"--app-id {plan.app_id} is the live worker's app id (GPULEDGER_STREAMS_APP_ID): its worker would join the live consumer group")
    if plan.since and plan.until and plan.since > plan.until:  # (equal: the closed range of one instant, as audit reads it)
        problems.append(f"--from {_iso(plan.since)} is after --to {_iso(plan.until)}")
    catalogue = settings.kafka.catalogue()
    try:
        catalogue.run(plan.app_id)
    except ValueError:
        problems.append(f"--app-id {plan.app_id!r}: use letters, digits, '.', '_' and '-' (it names topics)")
        return problems
    from streams.progress import worker_groups

    # A worker's stages read in the groups <app id>.route, .controls, .sinks: an app id ending so
    # is another run's stage group (`--app-id live.sinks` joined the live sink's group — the
    # replay never caught up, and the live stage ran degraded meanwhile).
    stage = next((suffix for suffix in STAGE_GROUP_SUFFIXES if plan.app_id.endswith(suffix)), None)
    if stage and plan.app_id != settings.streams.app_id:
        shared = sorted(set(worker_groups(catalogue, plan.app_id)) & set(worker_groups(catalogue, settings.streams.app_id)))
        whose = (f"the live worker's group(s) {', '.join(shared)} (GPULEDGER_STREAMS_APP_ID {settings.streams.app_id})" if shared
                 else f"the {stage[1:]} stage group of a run with app id {plan.app_id[:-len(stage)]}")
        problems.append(f"--app-id {plan.app_id} ends with {stage!r}: its worker would read in {whose} — choose another")
    return problems


#: A replay gives up when one of its worker's stages has been restarted this often without the
#: replay making progress in between (``_replay_with``).
CHILD_RESTARTS_FATAL = 3

#: A replay gives up when its sink's writes into the sandbox have been failing (the sink's health
#: ``problems``) this long without the replay making progress: a sandbox that cannot be written
#: (a database the server refuses to create, a read-only path) is retried by the sink for ever —
#: a live worker must hold its batch through a store outage — and the replay sat at 0, degraded,
#: until its ``--timeout`` (none by default) said only "not caught up".
STORE_FAILING_FATAL_S = 60.0

#: The suffixes of a worker's stage consumer groups (``streams.progress.worker_groups``).
STAGE_GROUP_SUFFIXES = (".route", ".controls", ".sinks")


def sandbox_in_use(dsn: str, database: str) -> str | None:
    """Why the sandbox is not empty (None: it is). A chDB directory is judged without
    opening it (this process must not hold the lock the worker needs): it must not
    exist yet or be empty. A server database must hold no rows."""
    from sinks.clickhouse import connect
    from sinks.read.query import current_owner

    if is_embedded(dsn):
        path = Path(chdb_path(dsn))
        owner = current_owner(dsn)
        if owner:
            return f"the embedded store {path} is open in process {owner['pid']}"
        return f"the directory {path} is not empty" if path.is_dir() and any(path.iterdir()) else None
    client = connect(dsn, database, create=False)
    try:
        rows = client.query("SELECT sum(total_rows) FROM system.tables WHERE database = {db:String}", parameters={"db": database}).result_rows
        held = int(rows[0][0] or 0)
        return f"database {database} holds {held} row(s)" if held else None
    finally:
        client.close()


def finish_sandbox(plan: ReplayPlan, cluster: str | None = None) -> None:
    """After the worker stopped: the sandbox made a store the readers open — migrated even when
    nothing in the range was stored (the sink never created it, and `audit` on it said "no
    embedded store", exit 3, where an empty range is NO EVENTS, exit 4) — and marked with the
    range it holds (``sinks.read.replayed``: `audit` and `trace` say it is a replay of that range)."""
    from sinks.clickhouse import connect
    from sinks.migrations import migrate
    from sinks.read.replayed import TABLE, create_statement

    client = connect(plan.into, plan.database)
    try:
        migrate(client, plan.database, cluster, embedded=is_embedded(plan.into))
        client.command(create_statement(plan.database))
        client.command(f"TRUNCATE TABLE `{plan.database}`.{TABLE}")  # one replay per sandbox (a resume: the same range again)
        client.insert(f"{plan.database}.{TABLE}", [[plan.app_id, plan.since, plan.until]], column_names=["app_id", "range_from", "range_to"])
    finally:
        client.close()


def table_rows(dsn: str, database: str, cluster: str | None = None) -> tuple[dict[str, int], dict[str, int]]:
    """Rows per gpuledger table as readers see them (FINAL on the replacing tables, without the
    tombstones of withdrawn violations and allocations, as ``sinks.checksum`` counts them: how many a run writes
    depends on the order it saw the history in — five replays of one history printed five
    counts), and per table the tombstones left out."""
    from sinks.checksum import TOMBSTONES
    from sinks.clickhouse import connect
    from sinks.migrations import table_name, table_names

    # (every name below is qualified: the client's own database need not exist — when nothing in
    # the range was stored, the sink never created it: that was a traceback after catching up)
    client = connect(dsn, "system", create=False)
    try:
        engines = dict(client.query("SELECT name, engine FROM system.tables WHERE database = {db:String}", parameters={"db": database}).result_rows)
        if not engines:
            return {table: 0 for table in table_names()}, {}
        out, tombstones = {}, {}
        for table in table_names():
            if table in engines:
                final = " FINAL" if "ReplacingMergeTree" in engines[table] else ""
                kept = TOMBSTONES.get(table)
                count = f"countIf({kept}), count() - countIf({kept})" if kept else "count(), 0"
                n, withdrawn = client.query(f"SELECT {count} FROM `{database}`.`{table_name(table, cluster)}`{final}").result_rows[0]
                out[table] = int(n)
                if kept:
                    tombstones[table] = int(withdrawn)
        return out, tombstones
    finally:
        client.close()


# --- the run --------------------------------------------------------------------------------

def _rate(task) -> float | None:
    """Raw events done per second since the worker started (``task.fields``: ``started``, its
    monotonic time, and ``base``, what was done then — a resume's start) — the summary's own
    measure. Not rich's estimate over its last samples: ``done`` moves in steps (a group's
    commit), and a step over a few samples read as 14,000-23,000 events/s in runs that
    averaged 2,300-2,900."""
    started, base = task.fields.get("started"), task.fields.get("base")
    if started is None or base is None or task.completed <= base:
        return None
    return (task.completed - base) / max(time.monotonic() - started, 1e-3)


class RateColumn(ProgressColumn):
    """Raw events per second since the worker started (``_rate``)."""

    def render(self, task) -> Text:
        rate = _rate(task)
        return Text(f"{rate:,.0f} events/s" if rate else "- events/s", style="progress.data.speed")


class EtaColumn(ProgressColumn):
    """Time left at that rate; while the run settles (every raw record read, outputs still in
    flight: ``task.fields["settling"]``) no ETA — the records left are not raw events, and
    "0:00:00" read as done."""

    def render(self, task) -> Text:
        rate = _rate(task)
        if task.fields.get("settling"):
            return Text("ETA -", style="progress.remaining")
        if not rate or task.total is None:
            return Text("ETA -:--:--", style="progress.remaining")
        left = int(max(task.total - task.completed, 0) / rate)
        return Text(f"ETA {left // 3600}:{left // 60 % 60:02d}:{left % 60:02d}", style="progress.remaining")


@dataclass
class ReplayResult:
    events: int
    events_now: int  # replayed by this invocation (less than ``events`` when resumed)
    health: dict
    rows: dict[str, int]
    elapsed_s: float
    worker_exit: int | None
    withdrawn: dict[str, int]  # per table: the tombstones of withdrawn violations and allocations, left out of ``rows``
    #: Raw records the route stage read in this run, as its group's committed offsets count them (None:
    #: Kafka did not say), and how many of them were published after the replay started.
    read: int | None = None
    late: int = 0


def run_replay(plan: ReplayPlan, settings, console: Console, timeout: float | None = None) -> ReplayResult:
    """Start the worker on the plan, show progress until caught up, stop it, count the rows."""
    from producers._kafka import client_config, resolve_bootstrap
    from streams.progress import RunProgress

    try:
        with RunProgress(client_config(settings), settings.kafka.catalogue(), plan.app_id) as progress:
            return _replay_with(progress, plan, settings, console, timeout)
    except LookupError as exc:
        raise ReplayError(str(exc)) from exc
    except KafkaException as exc:
        raise ReplayError(f"Kafka at {resolve_bootstrap(settings)}: {exc.args[0].str()}") from exc


def _replay_with(progress, plan: ReplayPlan, settings, console: Console, timeout: float | None) -> ReplayResult:
    from gpuledger.dev.process import ServiceProcess, free_port
    from producers._kafka import resolve_bootstrap
    from streams.progress import wait_caught_up, worker_health

    committed = {group: offsets for group, offsets in progress.committed().items() if offsets}
    if committed and not plan.resume:
        raise ReplayRefused(f"app id {plan.app_id} already has committed offsets (consumer group(s) {', '.join(committed)}; a replay starts "
                            "from zero): pass --resume to continue that replay, or choose another --app-id")
    if not plan.resume:
        in_use = sandbox_in_use(plan.into, plan.database)
        if in_use:
            raise ReplayRefused(f"the sandbox {redact(plan.into)} is not empty ({in_use}): replay into an empty one "
                                "(or pass --resume with the --app-id of the replay that filled it)")
    try:
        plan.save()
    except OSError as exc:
        raise ReplayRefused(f"--work-dir {plan.work_dir}: the replay's record (replay.json) and worker state cannot be written there: "
                            f"{exc.strerror or exc}") from exc
    port = free_port()
    env = {
        "GPULEDGER_KAFKA_BOOTSTRAP": resolve_bootstrap(settings),  # the child's data dir has no record of the local broker
        "GPULEDGER_DATA_DIR": str(plan.work_dir),
        "GPULEDGER_CACHE_DIR": str(settings.cache_dir),
        "GPULEDGER_CLICKHOUSE_DSN": plan.into,
        "GPULEDGER_CLICKHOUSE_DATABASE": plan.database,
        "GPULEDGER_STREAMS_APP_ID": plan.app_id,
        "GPULEDGER_STREAMS_WEB_PORT": str(port),
    }
    env.update({f"GPULEDGER_STREAMS_REPLAY_{name}": _iso(value) for name, value in (("FROM", plan.since), ("TO", plan.until)) if value})
    service = ServiceProcess(["-v", "worker"], env, plan.log_path, with_parent=True)  # a replay killed takes its worker with it
    for name, value in (("FROM", plan.since), ("TO", plan.until)):
        if value is None:
            service.env.pop(f"GPULEDGER_STREAMS_REPLAY_{name}", None)  # an inherited range is not this replay's
    url = f"http://127.0.0.1:{port}"
    last: dict = {}
    # Each stage's restart count when the replay last made progress: a stage restarted
    # CHILD_RESTARTS_FATAL times *since* ends it (a long replay whose stages recovered now and
    # then over hours is not failing).
    restarts_at_progress: dict[str, int] = {}
    progress_seen: list[int] = []
    store_failing_since: list[float] = []  # when the sink's writes were first seen failing since the last progress

    def health() -> dict | None:
        if not service.alive():
            raise ReplayError(f"the replay worker exited with {service.proc.returncode} (log {plan.log_path}):\n{service.log_tail()}")
        answer = worker_health(url)
        last.update(answer or {})
        # A stage that keeps failing (the sandbox cannot be created: the sink exited and was
        # restarted every ~10 s) would hold the replay at 0 for ever, degraded, saying nothing.
        failing = {name: page for name in ("route", "controls", "sink")
                   if isinstance(page := (answer or {}).get(name), dict)
                   and (page.get("restarts") or 0) - restarts_at_progress.get(name, 0) >= CHILD_RESTARTS_FATAL}
        if failing:
            said = ", ".join(f"{name} restarted {page['restarts']} times (last exit {page.get('last_exit')})" for name, page in failing.items())
            raise ReplayError(f"the replay worker's {said} (log {plan.log_path}):\n{service.log_tail()}")
        sink = (answer or {}).get("sink")
        problems = sink.get("problems") if isinstance(sink, dict) else None
        if not problems:
            store_failing_since.clear()
        else:
            store_failing_since[:] = store_failing_since or [time.monotonic()]
            if time.monotonic() - store_failing_since[0] >= STORE_FAILING_FATAL_S:
                raise ReplayError(f"the sandbox {redact(plan.into)} (database {plan.database}) cannot be written — "
                                  + "; ".join(problems) + f" (log {plan.log_path})")
        return answer

    console.print(f"replay [bold]{plan.app_id}[/]: {progress.total} events on the raw topics ({escape(plan.range_text())}) "
                  f"→ {redact(plan.into)} (database {plan.database})", highlight=False, soft_wrap=True)
    console.print(f"worker log: {plan.log_path}", highlight=False, soft_wrap=True)
    bar = Progress(TextColumn("{task.description}"), BarColumn(bar_width=24), MofNCompleteColumn(), TextColumn("events"), RateColumn(),
                   EtaColumn(), TextColumn("{task.fields[state]}"), console=console)
    task = bar.add_task("replay", total=progress.total, state="starting", started=None, base=None, settling=False)
    first_done: list[int] = []
    stages = {f"{plan.app_id}.route": "routed", f"{plan.app_id}.sinks": "stored"}

    def show(look) -> None:
        first_done[:] = first_done or [look.done]
        if progress_seen != [look.done]:  # progress: count the stages' restarts (and the store's failing) from here
            progress_seen[:] = [look.done]
            store_failing_since.clear()
            restarts_at_progress.update({name: page.get("restarts") or 0 for name in ("route", "controls", "sink")
                                         if isinstance(page := last.get(name), dict)})
        # Each raw-reading group's own count when they differ: the bar is their minimum, and a group
        # that commits late held it at 0 while the other had stored thousands.
        apart = ", ".join(f"{word} {look.done_by[group]:,}" for group, word in stages.items() if group in look.done_by) \
            if len(set(look.done_by.values())) > 1 else ""
        settling = look.inputs_left == 0
        state = ("worker starting" if look.status is None else
                 f"settling: {look.run_lag:,} queued, "
                 f"{'state loading' if look.parked is None else f'{look.parked:,} parked'}" if settling else apart)
        bar.update(task, completed=look.done, state=state, base=first_done[0], started=started, settling=settling)

    started = time.monotonic()
    service.start()
    try:
        with bar:
            look = wait_caught_up(progress, health, timeout=timeout, on_look=show)
    except TimeoutError as exc:
        service.stop(grace=30)
        raise ReplayError(f"{exc} (log {plan.log_path})") from exc
    except BaseException:
        service.stop(grace=30)
        raise
    elapsed = time.monotonic() - started
    code = service.stop(grace=60)
    try:  # (after the stop: the route stage committed what it counted)
        read, late = progress.raw_read(f"{plan.app_id}.route", committed.get(f"{plan.app_id}.route"))
    except KafkaException:
        read, late = None, 0  # (the summary then gives the stage's counts alone: the sandbox is done)
    finish_sandbox(plan, settings.clickhouse.cluster)
    rows, withdrawn = table_rows(plan.into, plan.database, settings.clickhouse.cluster)
    return ReplayResult(look.done, look.done - first_done[0], last, rows, elapsed, code, withdrawn, read, late)


def print_summary(plan: ReplayPlan, result: ReplayResult) -> None:
    """The result on stdout: what was replayed, how fast, the rows per table, where to look next.

    The first line counts raw records, as the route stage read them (its group's committed offsets):
    in range, out of range and dead-lettered add up to them. They are the records on the raw topics
    when the replay started (the bar's total) plus those published while it ran, said apart — the
    line counted the latter in its split but not in its total (152 replayed: 104 in range, 54 out).
    The tables count rows: an event whose record came twice (a re-sent alert, one id) is one row."""
    stats = result.health.get("stats", {})
    resumed = plan.resume
    split = (stats.get("routed", 0), stats.get("out_of_range", 0), stats.get("dead_letters", 0))
    read = result.read if result.read is not None else sum(split)
    rate = read / result.elapsed_s if result.elapsed_s > 0 else 0.0
    # (resumed: every group of the replay had committed its own share before; this run's route stage
    # counts what it read itself)
    head = (f"replayed {result.events + result.late} raw records (resumed at {result.events - result.events_now}; this run's route "
            f"stage read {read})" if resumed else f"replayed {read} raw records")
    counted = ("" if sum(split) == read else
               f"; the route stage's counts cover {sum(split)} (a stage restarted during the replay counts afresh, and again "
               "what it reads again)")
    print(f"{head} in {result.elapsed_s:.1f}s ({rate:,.0f} records/s): {split[0]} in range, {split[1]} out of range, {split[2]} "
          f"dead-lettered{counted}")
    if result.late:
        print(f"  {read - result.late} {'were' if read - result.late != 1 else 'was'} on the raw topics when it started, {result.late} "
              f"{'were' if result.late != 1 else 'was'} published while it ran (read, not waited for: use --to for a fixed end)")
    print("rows in the sandbox, as readers see them (an event whose record came twice — a re-sent alert — is one row):")
    for table, n in result.rows.items():
        withdrawn = result.withdrawn.get(table)
        print(f"  {plan.database}.{table}\t{n} rows" + (f" (+{withdrawn} withdrawn, which readers skip: their number depends on the "
                                                          "order the run saw the history in)" if withdrawn else ""))
    if result.worker_exit not in (0, None):
        print(f"warning: the worker exited with {result.worker_exit} after catching up (log {plan.log_path})")
    print(f"worker log: {plan.log_path}")
    if not stats.get("routed", 0) and not resumed:
        print(f"nothing in the range: no event of the raw topics occurred in {plan.range_text().removeprefix('events with occurred_at in ')} — "
              "the sandbox is an empty store (an audit of it says NO EVENTS)")
        return
    print(f"query it: GPULEDGER_CLICKHOUSE_DSN={redact(plan.into)} GPULEDGER_CLICKHOUSE_DATABASE={plan.database} "
          "gpuledger trace --alert FP --at T  (or: gpuledger audit --from T --to T)")
