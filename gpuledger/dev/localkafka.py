"""A real, single-node Apache Kafka broker (KRaft) for local runs and tests.

Docker is not available everywhere, so the broker runs from Kafka's own jars:
``ensure_jars`` fetches them from Maven Central with ``mvn`` (deploy/local/pom.xml)
into a cache outside the repo; ``LocalKafka`` formats a data dir, starts
``kafka.Kafka`` on 127.0.0.1 on free ports with its log in a file, and waits until a
metadata request succeeds (failing with the log tail if it does not).
``gpuledger kafka up`` records the running broker in ``<data_dir>/kafka/broker.json``
so other commands find it when ``GPULEDGER_KAFKA_BOOTSTRAP`` is unset.
Limits: one broker, PLAINTEXT on loopback, replication factor 1 — a development and
test peer, not a production cluster.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

from gpuledger.dev.process import bindable, free_port, with_parent_command

log = logging.getLogger(__name__)

KAFKA_VERSION = "3.9.1"
REPO_ROOT = Path(__file__).resolve().parents[2]
POM = REPO_ROOT / "deploy" / "local" / "pom.xml"
#: The local broker's log cleaner: the most bytes per second it reads and writes, on average
#: (``log.cleaner.io.max.bytes.per.second``; see ``LocalKafka._write_config``).
CLEANER_BYTES_PER_S = 16 * 1024 * 1024


class LocalKafkaError(RuntimeError):
    """The local broker could not be fetched, started or found."""


def ensure_jars(cache_dir: Path, version: str = KAFKA_VERSION) -> Path:
    """Return the directory of Kafka's jars, fetching them with Maven once."""
    lib = cache_dir / f"kafka-{version}" / "lib"
    marker = lib / ".complete"
    if marker.exists():
        return lib
    if shutil.which("mvn") is None:
        raise LocalKafkaError("Maven (mvn) is not on PATH; it is needed once to fetch Kafka's jars from Maven Central")
    if shutil.which("java") is None:
        raise LocalKafkaError("java is not on PATH; the local Kafka broker needs Java 17+")
    lib.mkdir(parents=True, exist_ok=True)
    cmd = [
        "mvn", "-q", "-B", "-f", str(POM), "dependency:copy-dependencies",
        f"-Dkafka.version={version}", f"-DoutputDirectory={lib}", "-DincludeScope=runtime",
    ]
    log.info("fetching Kafka %s jars with Maven into %s", version, lib)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not any(lib.glob("kafka_2.13-*.jar")):
        raise LocalKafkaError(f"mvn failed to fetch Kafka {version} jars (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    marker.write_text(version)
    return lib


_LOG4J2 = """\
status = warn
appender.out.type = Console
appender.out.name = out
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = {level}
rootLogger.appenderRef.out.ref = out
logger.kafka.name = kafka
logger.kafka.level = {level}
logger.state.name = state.change.logger
logger.state.level = warn
"""


class LocalKafka:
    """Context manager around one broker process. ``bootstrap`` is ``127.0.0.1:PORT``."""

    def __init__(self, data_dir: Path, cache_dir: Path, port: int | None = None, log_level: str = "INFO",
                 sasl_users: dict[str, str] | None = None, with_parent: bool = False) -> None:
        """``sasl_users`` (user -> password) makes the client listener SASL_PLAINTEXT with
        the PLAIN mechanism, to test clients against an authenticating broker.
        ``with_parent``: the broker ends when the thread that started it ends, however that
        ends (a test run killed before its teardown left its broker running for hours);
        not for ``gpuledger kafka up``, whose broker outlives the command."""
        self.sasl_users = sasl_users
        self.with_parent = with_parent
        self.data_dir = Path(data_dir)
        self.cache_dir = Path(cache_dir)
        self.port = port or free_port()
        self.controller_port = free_port()
        self.log_level = log_level
        self.log_file = self.data_dir / "broker.log"
        self.proc: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _write_config(self) -> Path:
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@127.0.0.1:{self.controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self.data_dir / "logs"),
            "offsets.topic.replication.factor": "1",
            # 50 partitions (the default) make the first consumer group slow to start.
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "4",
            "group.initial.rebalance.delay.ms": "0",
            "num.partitions": "1",
            # Topics come from the catalogue (co-partitioning matters); Faust creates
            # its own internal topics through the admin API.
            "auto.create.topics.enable": "false",
            "log.retention.check.interval.ms": "60000",
            # The log cleaner (the changelogs are compacted: schemas.topics.CHANGELOG_CONFIG) on the
            # worker's cores, throttled so that a compaction pass is spread out rather than a burst:
            # unthrottled, the first pass of make bench's latency run (~30 s in, as the changelog
            # segments roll) took 0.15 of a core for five seconds beside the JIT compiling it — the
            # one ten-second bucket whose p99 stood out in run after run. Under sustained load a
            # throttled cleaner lets more of a partition get dirty before it passes, and each pass
            # then rewrites less per superseded byte: its CPU stays bounded, the changelog a little larger.
            "log.cleaner.io.max.bytes.per.second": str(CLEANER_BYTES_PER_S),
        }
        if self.sasl_users:
            admin_user, admin_pw = next(iter(self.sasl_users.items()))
            users = " ".join(f'user_{u}="{pw}"' for u, pw in self.sasl_users.items())
            props.update({
                "listeners": f"SASL_PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
                "advertised.listeners": f"SASL_PLAINTEXT://127.0.0.1:{self.port}",
                "listener.security.protocol.map": "SASL_PLAINTEXT:SASL_PLAINTEXT,CONTROLLER:PLAINTEXT",
                "inter.broker.listener.name": "SASL_PLAINTEXT",
                "sasl.enabled.mechanisms": "PLAIN",
                "sasl.mechanism.inter.broker.protocol": "PLAIN",
                "listener.name.sasl_plaintext.plain.sasl.jaas.config":
                    f'org.apache.kafka.common.security.plain.PlainLoginModule required username="{admin_user}" password="{admin_pw}" {users};',
            })
        path = self.data_dir / "server.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        (self.data_dir / "log4j2.properties").write_text(_LOG4J2.format(level=self.log_level))
        return path

    def _java(self, lib: Path, main: str, *args: str) -> list[str]:
        return [
            "java", "-Xms128m", "-Xmx512m", "-XX:+UseSerialGC", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.properties'}",
            "-cp", f"{lib}/*", main, *args,
        ]

    def start(self, timeout: float = 90.0) -> LocalKafka:
        lib = ensure_jars(self.cache_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self._write_config()
        if not (self.data_dir / "logs" / "meta.properties").exists():
            cluster_id = uuid.uuid4().hex[:22]
            fmt = subprocess.run(self._java(lib, "kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(config), "--ignore-formatted"),
                                 capture_output=True, text=True)
            if fmt.returncode != 0:
                raise LocalKafkaError(f"formatting Kafka storage failed:\n{fmt.stdout[-2000:]}{fmt.stderr[-2000:]}")
        logf = open(self.log_file, "ab")
        command = self._java(lib, "kafka.Kafka", str(config))
        self.proc = subprocess.Popen(with_parent_command(command) if self.with_parent else command, stdout=logf, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        logf.close()
        self._wait_ready(timeout)
        log.info("local Kafka %s ready at %s (pid %s, log %s)", KAFKA_VERSION, self.bootstrap, self.proc.pid, self.log_file)
        return self

    def _wait_ready(self, timeout: float) -> None:
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0, "logger": logging.getLogger("librdkafka.silent"),
                             **self.client_security()})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise LocalKafkaError(f"Kafka broker exited with {self.proc.returncode} during start-up:\n{self.log_tail()}")
            try:
                md = admin.list_topics(timeout=2)
                if md.brokers:
                    return
            except Exception:  # noqa: BLE001 - any failure here just means "not ready yet"
                pass
            time.sleep(0.5)
        self.stop()
        raise LocalKafkaError(f"Kafka broker at {self.bootstrap} did not answer a metadata request within {timeout:.0f}s:\n{self.log_tail()}")

    def client_security(self) -> dict[str, str]:
        """librdkafka settings a client needs to talk to this broker."""
        if not self.sasl_users:
            return {}
        user, pw = next(iter(self.sasl_users.items()))
        return {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN", "sasl.username": user, "sasl.password": pw}

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no broker log)"

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None:
            return
        stop_pid(self.proc.pid, timeout)
        try:
            self.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None

    def __enter__(self) -> LocalKafka:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_pid(pid: int, timeout: float = 20.0) -> None:
    """SIGTERM a broker's process group, then SIGKILL it if it lingers."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            # Reap if it is our child; a zombie would otherwise look alive.
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    return
            except ChildProcessError:
                pass
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# --- the background broker of `gpuledger kafka up|down|status` -------------------

def state_file(data_dir: Path) -> Path:
    return Path(data_dir) / "kafka" / "broker.json"


def running_broker(data_dir: Path) -> dict | None:
    """The broker recorded by ``kafka up``, if its process is still alive."""
    path = state_file(data_dir)
    try:
        state = json.loads(path.read_text())
        os.kill(int(state["pid"]), 0)
    except (OSError, ValueError, KeyError):
        return None
    return state


def port_file(data_dir: Path) -> Path:
    """The port the data dir's broker last listened on (kept by ``down``)."""
    return Path(data_dir) / "kafka" / "port"


def _last_port(data_dir: Path) -> int | None:
    """The port of the data dir's last broker, when nothing listens on it now."""
    try:
        port = int(port_file(data_dir).read_text().strip())
    except (OSError, ValueError):
        return None
    return port if bindable(port) else None


def up(data_dir: Path, cache_dir: Path) -> dict:
    """Start the data dir's background broker (or return the running one) — on the port its last
    one listened on when that is free: a worker, receiver or collector reads the bootstrap once
    at start, and a broker restarted (``kafka down; kafka up``) on a new port left them dialling
    the old one until they were restarted; on the same port they reconnect by themselves."""
    existing = running_broker(data_dir)
    if existing:
        return existing
    broker = LocalKafka(Path(data_dir) / "kafka", cache_dir, port=_last_port(data_dir)).start()
    state = {"pid": broker.proc.pid, "bootstrap": broker.bootstrap, "log": str(broker.log_file), "version": KAFKA_VERSION}
    state_file(data_dir).write_text(json.dumps(state))
    port_file(data_dir).write_text(str(broker.port))
    return state


def down(data_dir: Path) -> dict | None:
    state = running_broker(data_dir)
    if state:
        stop_pid(int(state["pid"]))
    state_file(data_dir).unlink(missing_ok=True)
    return state
