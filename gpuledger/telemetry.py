"""OpenTelemetry wiring: one tracer and meter provider, configured from settings.

Exporter ``none`` (default) keeps the API live but exports nothing (spans are still made, so
trace context still travels; metrics use the API's no-op meter); ``console`` prints
spans/metrics; ``otlp`` (or any endpoint set) ships them over OTLP/HTTP.
W3C trace context travels in Kafka headers (``traceparent``/``tracestate``), so one
span tree covers an event's trip from collector to sink.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from opentelemetry import metrics, trace
from opentelemetry.propagate import extract, inject
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

log = logging.getLogger(__name__)
_configured = False


def setup_telemetry(settings) -> None:
    """Install providers once per process from a ``TelemetrySettings``."""
    global _configured
    if _configured:
        return
    _configured = True
    exporter = "otlp" if settings.endpoint else settings.exporter
    resource = Resource.create({"service.name": settings.service_name})
    tracer_provider = TracerProvider(resource=resource)
    readers = []
    if exporter == "console":
        tracer_provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter(), export_interval_millis=60000))
    elif exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        base = (settings.endpoint or "http://127.0.0.1:4318").rstrip("/")
        tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{base}/v1/traces")))
        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=f"{base}/v1/metrics")))
    trace.set_tracer_provider(tracer_provider)
    if readers:
        metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=readers))
    # else (exporter none): the API's no-op meter. An SDK provider without a reader keeps no
    # measurement, yet costs each Counter.add 4-8 us (the receiver adds 5 per request: ~8 % of
    # its event loop in py-spy); ComponentCounters.totals still count for the health pages.


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def meter(name: str) -> metrics.Meter:
    return metrics.get_meter(name)


class ComponentCounters:
    """The counters every component emits (events received/sent/rejected, bytes)."""

    def __init__(self, component: str) -> None:
        m = meter(component)
        self.component = component
        self.received = m.create_counter("gpuledger.events.received", description="Events received")
        self.sent = m.create_counter("gpuledger.events.sent", description="Events sent downstream")
        self.rejected = m.create_counter("gpuledger.events.rejected", description="Events rejected, by reason")
        self.bytes_sent = m.create_counter("gpuledger.bytes.sent", unit="By", description="Bytes sent downstream")
        self.truncated = m.create_counter("gpuledger.fields.truncated", description="Free-text fields cut to their size cap")
        self.refused = m.create_counter("gpuledger.fields.refused",
                                        description="Identity values left out of an event that was kept (a label or annotation the schema refuses)")
        self._attrs = {"component": component}
        # Local mirror for health endpoints and tests that read counters back.
        self.totals: dict[str, int] = {"received": 0, "sent": 0, "rejected": 0, "bytes_sent": 0, "truncated": 0, "refused": 0}

    def add_received(self, n: int = 1) -> None:
        self.received.add(n, self._attrs)
        self.totals["received"] += n

    def add_sent(self, n: int = 1, nbytes: int = 0) -> None:
        self.sent.add(n, self._attrs)
        self.totals["sent"] += n
        if nbytes:
            self.bytes_sent.add(nbytes, self._attrs)
            self.totals["bytes_sent"] += nbytes

    def add_truncated(self, n: int = 1) -> None:
        """``n`` free-text fields were cut to fit (the event itself was kept)."""
        self.truncated.add(n, self._attrs)
        self.totals["truncated"] += n

    def add_refused(self, field: str, n: int = 1) -> None:
        """``n`` identity values of ``field`` were left out (the event itself was kept)."""
        self.refused.add(n, {**self._attrs, "field": field})
        self.totals["refused"] += n

    def add_rejected(self, reason: str, n: int = 1) -> None:
        self.rejected.add(n, {**self._attrs, "reason": reason})
        self.totals["rejected"] += n
        key = f"rejected.{reason}"
        self.totals[key] = self.totals.get(key, 0) + n


def inject_headers() -> list[tuple[str, bytes]]:
    """Current span's W3C context as Kafka headers."""
    carrier: dict[str, str] = {}
    inject(carrier)
    return [(k, v.encode()) for k, v in carrier.items()]


def context_from_headers(headers: Iterable[tuple[str, bytes]] | Mapping[str, bytes] | None):
    """Extract a W3C context from Kafka headers (list of pairs or a mapping)."""
    if not headers:
        return extract({})
    items = headers.items() if isinstance(headers, Mapping) else headers
    carrier = {k: (v.decode() if isinstance(v, (bytes, bytearray)) else str(v)) for k, v in items if v is not None}
    return extract(carrier)


#: The packages whose own INFO lines a long-running command (``SERVICE_COMMANDS``) prints
#: without ``-v``: what it started, which partitions it was given, what it recovered, how it
#: stopped — an operator's first question of a service is whether it is up. The libraries
#: under them (Faust, mode, aiokafka, librdkafka through ``librdkafka``) stay at WARNING
#: unless ``-v``: their INFO is a line per internal service start and group round.
OWN_LOGGERS = ("gpuledger", "streams", "sinks", "producers", "schemas")

#: The commands that run until stopped and log their own INFO lines without -v. Not `receive`: it
#: says where it listens on its own, and its INFO lines are one per request (two, with the
#: publisher's), a cost at thousands of requests a second; `-v` shows them.
SERVICE_COMMANDS = frozenset({"worker", "admit", "collect"})


def log_format(tag: str) -> str:
    """The one line format of every gpuledger process: the worker and its child processes
    (``[route]``, ``[controls]``, ``[sink]``) share one stream, so each line says which
    process wrote it — ``[time] [pid] [LEVEL] [tag] logger: message``."""
    return f"[%(asctime)s] [%(process)d] [%(levelname)s] [{tag}] %(name)s: %(message)s"


def demote(record: logging.LogRecord, level: int) -> bool:
    """Lower ``record`` to ``level`` and say whether to keep it: only where its logger is enabled at
    that level — the logger let it through at its own level, and a handler without a level prints
    whatever reaches it (a filter's return value)."""
    if record.levelno > level:
        record.levelno, record.levelname = level, logging.getLevelName(level)
    return logging.getLogger(record.name).isEnabledFor(level)


class Demote(logging.Filter):
    """Lower a library's records that name one of ``conditions`` to ``level``, keeping them
    only where their logger is enabled at it: a condition the library retries by itself and
    gpuledger reports in its own terms (the health page), not an error to page anyone for."""

    def __init__(self, level: int, *conditions: str) -> None:
        super().__init__()
        self.level, self.conditions = level, conditions

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno <= self.level or not any(c in record.getMessage() for c in self.conditions):
            return True
        return demote(record, self.level)


#: Library records demoted in every gpuledger process (``log_levels``). aiokafka logs an ERROR
#: when a group's coordinator is not available yet — every first start of a group (its offsets
#: partition's coordinator loading) — and retries until it is; a worker that never gets its
#: partitions says so on its health page (``no partition … assigned``) and in `gpuledger status`.
DEMOTED = {"aiokafka.consumer.group_coordinator": Demote(logging.INFO, "GroupCoordinatorNotAvailableError")}


def log_levels(level: int, service: bool = True) -> None:
    """The root logger at ``level`` (WARNING, or INFO with ``-v``), for a service its own
    loggers (``OWN_LOGGERS``) at INFO at least, and the libraries' ``DEMOTED`` records lowered."""
    logging.getLogger().setLevel(level)
    if service:
        for name in OWN_LOGGERS:
            logging.getLogger(name).setLevel(min(level, logging.INFO))
    for name, demote in DEMOTED.items():
        if demote not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(demote)


class RepeatFilter(logging.Filter):
    """Let a repeated log line (same logger, level and message template) through once,
    then at most once per ``every_s`` with how many were held back in between.

    Why: during a broker outage the Kafka clients log every reconnect attempt (measured:
    thousands of ERROR lines a second); one line per state change and a count is what an
    operator can read. Only WARNING and above are filtered; the first line always passes.

    The count goes on the next line that passes, which may come long after the held ones (the
    next outage): it says when they were — "[repeated N more time(s) between 14:16:39 and
    14:17:09]", the wall-clock times of the first and last held — not "in the last 60s" (read
    minutes after an outage, that placed it when the note was written).
    """

    def __init__(self, every_s: float = 60.0, clock=None, wall=None) -> None:
        super().__init__()
        import time

        self.every_s = every_s
        self._clock = clock or time.monotonic
        self._wall = wall or time.time
        self._seen: dict[tuple, list] = {}  # key -> [when it last passed, held since, first held, last held]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.levelno, str(record.msg))
        now = self._clock()
        seen = self._seen.get(key)
        if seen is None or now - seen[0] >= self.every_s:
            self._seen[key] = [now, 0, None, None]
            if seen and seen[1]:
                record.msg = f"{record.msg} [repeated {seen[1]} more time(s) between {_clock_text(seen[2])} and {_clock_text(seen[3])}]"
            if len(self._seen) > 10_000:
                self._seen.clear()
            return True
        wall = self._wall()
        seen[1] += 1
        seen[2] = wall if seen[2] is None else seen[2]
        seen[3] = wall
        return False


def _clock_text(epoch_s: float) -> str:
    """A held line's time as the log's own lines show times (local, to the second)."""
    import time

    return time.strftime("%H:%M:%S", time.localtime(epoch_s))


def calm_logging(every_s: float = 60.0, handlers: list[logging.Handler] | None = None) -> RepeatFilter:
    """Install ``RepeatFilter`` on ``handlers`` — by default every handler of the root logger
    (idempotent)."""
    handlers = logging.getLogger().handlers if handlers is None else handlers
    for handler in handlers:
        for existing in handler.filters:
            if isinstance(existing, RepeatFilter):
                return existing
    flt = RepeatFilter(every_s)
    for handler in handlers:
        handler.addFilter(flt)
    return flt
