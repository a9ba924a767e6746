"""A scripted exercise through the real pipeline (``gpuledger exercise SCENARIO``, ``gpuledger demo``).

Input: a scenario (``deploy/exercises/<name>.yaml`` or a path; format in
docs/exercises.md), ``--speed`` (timeline compression) and ``--seed`` (names and UUIDs).
What it runs, all real and unchanged: a Kafka broker (the local one it starts, unless
``GPULEDGER_KAFKA_BOOTSTRAP`` names one), the catalogue's topics, ``gpuledger
worker`` (its own embedded ClickHouse under the exercise's data dir, or the
configured ClickHouse server), ``gpuledger receive``, ``gpuledger collect
scheduler`` against the simulated API server and one ``gpuledger collect
podresources`` per simulated node — each a child process (``ServiceProcess``) with
``GPULEDGER_*`` settings in its environment and its log under
``<data dir>/exercises/<scenario>/logs/``. The simulated cluster
(``gpuledger.sim.cluster``) is the only source: API server, kubelet sockets and
webhooks into the receiver. With ``cluster="real"`` (``--cluster real``) the source is the local
real control plane instead: ``gpuledger.dev.cluster.LocalCluster`` with the scenario's nodes, its
kubelet doubles, the DCGM-shaped page, Prometheus, Alertmanager and MLflow, played by
``gpuledger.dev.scenario_driver.RealClusterDriver`` (same interface as ``SimCluster``).
Output: progress on the console, the pass/fail table of the scenario's expected
evidence (read back through ``sinks.read.trace`` from the worker's store), the incident
trace, an HTML report (``sinks.read.report``), and exit code 0 only if no check failed.
Guarantees: everything it started is stopped on the way out, success or not
(Ctrl-C included); the data dir is kept so the store can be queried afterwards.
On a broker it did not start, topics get a prefix unique to the run, so runs never
read each other's events.
Limits: event times are on the compressed clock — see docs/exercises.md ("Time").
With a ClickHouse server DSN several runs share one database.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gpuledger.dev.process import ServiceError, ServiceProcess, free_port
from gpuledger.sim.cluster import SimCluster, SimulationError, StepRecord, Surfaces, dry_run
from gpuledger.sim.evidence import CheckResult, evaluate, summary
from gpuledger.sim.scenario import Scenario, ScenarioError, load_scenario

#: Seconds between two kubelet polls of the simulated nodes' collectors.
POLL_INTERVAL_S = 0.3
#: Least wall-clock time between two steps at different scenario times, so that
#: collectors observe each state (an allocation must exist before the alert on it).
MIN_STEP_GAP_S = max(1.0, 2.5 * POLL_INTERVAL_S)
DRAIN_TIMEOUT_S = 120.0
SETTLE_S = 1.5
CHECK_RETRY_S = 20.0
_UNIX_PATH_MAX = 100
#: Where an exercise runs: the simulator (default) or the local real control plane (gpuledger.dev.scenario_driver).
CLUSTERS = ("sim", "real")
#: The receiver's MLflow webhook secret in a --cluster real run.
MLFLOW_SECRET = "whsec-exercise"


class ExerciseError(RuntimeError):
    """The exercise could not run (a service died, the pipeline did not drain)."""


@dataclass
class ExerciseRun:
    """What an exercise did and found."""

    scenario: Scenario
    seed: int
    speed: float
    data_dir: Path
    dsn: str = ""
    report_path: Path | None = None
    records: list[StepRecord] = field(default_factory=list)
    results: list[CheckResult] = field(default_factory=list)
    trace: dict | None = None
    error: str | None = None
    drained_s: float | None = None
    cluster: SimCluster | None = None  # the simulated cluster (its identifiers, for tools and tests)
    services_left: list[str] = field(default_factory=list)  # children still alive after the stop (should be none)

    @property
    def exit_code(self) -> int:
        return 1 if self.error or any(r.status == "FAIL" for r in self.results) else 0


def _short_socket_dir(preferred: Path) -> tuple[Path, bool]:
    """A directory whose socket paths fit sockaddr_un; (dir, is_temporary)."""
    if len(str(preferred / "nodename-with-room.sock")) <= _UNIX_PATH_MAX:
        return preferred, False
    return Path(tempfile.mkdtemp(prefix="gpl-sim-")), True


def _get_json(url: str, timeout: float = 2.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


class ExerciseRunner:
    """Runs one scenario end to end (module docstring); ``run()`` returns an ``ExerciseRun``."""

    def __init__(self, settings, scenario: Scenario, console: Console, *, speed: float | None = None, seed: int | None = None,
                 report_path: Path | None = None, data_dir: Path | None = None, cluster: str = "sim") -> None:
        if cluster not in CLUSTERS:
            raise ExerciseError(f"unknown cluster {cluster!r}: one of {', '.join(CLUSTERS)}")
        self.real = cluster == "real"
        self.settings = settings
        self.scenario = scenario
        self.console = console
        self.speed = speed or scenario.speed
        self.seed = scenario.seed if seed is None else seed
        self.base = Path(data_dir) if data_dir else Path(settings.data_dir) / "exercises" / scenario.name
        self.report_path = Path(report_path) if report_path else self.base / f"{scenario.name}.html"
        self.services: list[tuple[str, ServiceProcess]] = []
        self.run_id = uuid.uuid4().hex[:8]

    # -- small helpers ----------------------------------------------------------------------------

    def _write_policy(self, sc: Scenario) -> Path:
        """The worker's policy: the configured file (or the default) with the scenario's
        overrides, every duration compressed by the speed like the timeline."""
        from streams.controls.policy import Policy, dump_policy, load_policy

        policy = load_policy(self.settings.policy.file)
        if sc.policy:
            policy = Policy.model_validate(_merge(policy.model_dump(), sc.policy))
        path = self.base / "policy.yaml"
        path.write_text(dump_policy(policy.compressed(self.speed)))
        return path

    def say(self, tag: str, text: str) -> None:
        self.console.print(f"[bold]{tag:<8}[/] {text}", highlight=False)

    def to_wall(self, scenario_seconds: float) -> float:
        return scenario_seconds / self.speed

    def _start(self, name: str, args: list[str], env: dict[str, str]) -> ServiceProcess:
        service = ServiceProcess(args, env, self.base / "logs" / f"{name}.log").start()
        self.services.append((name, service))
        return service

    def _check_alive(self) -> None:
        for name, service in self.services:
            if not service.alive():
                raise ExerciseError(f"{name} exited with {service.proc.returncode}; last lines of {service.log_path}:\n{service.log_tail(25)}")

    def _wait(self, what: str, ready, timeout: float = 60.0, service: ServiceProcess | None = None):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                value = ready()
            except (OSError, ValueError, KeyError):
                value = None
            if value:
                return value
            time.sleep(0.2)
        tail = f":\n{service.log_tail(25)}" if service else ""
        raise ExerciseError(f"{what} not ready within {timeout:.0f}s{tail}")

    # -- the run ------------------------------------------------------------------------------------

    def run(self) -> ExerciseRun:
        """Start everything, play the timeline, drain, check, report; stop everything."""
        sc = self.scenario
        run = ExerciseRun(sc, self.seed, self.speed, self.base, report_path=self.report_path)
        self._broker = self._surfaces = self._temp_sockets = None
        self._real: list = []  # --cluster real: what to stop, in reverse order
        try:
            dry_run(sc, self.seed)  # capacity and placements, before anything starts
            shutil.rmtree(self.base, ignore_errors=True)
            (self.base / "logs").mkdir(parents=True)
            self._announce()
            bootstrap, catalogue, client = self._kafka()
            configured = self.settings.clickhouse.dsn
            dsn = configured if configured and not configured.startswith("chdb:") else f"chdb://{self.base / 'clickhouse'}"
            run.dsn = dsn
            sim, kubeconfig = self._real_cluster() if self.real else self._cluster()
            run.cluster = sim
            env = self._services_env(bootstrap, catalogue, dsn)
            worker_url = self._start_worker(env, dsn)
            self._start_receiver(env, sim)
            self._start_collectors(env, sim, kubeconfig)
            if sc.enforce:
                sim.admit = self._start_admit(env)
            run.records = self._play(sim)
            run.drained_s = self._drain(worker_url, client, catalogue, env["GPULEDGER_STREAMS_APP_ID"])
            reader = self._reader(dsn)
            run.results = self._check(sim, reader)
            self._print_results(run.results)
            run.trace = self._report(sim, reader, run)
        except (ScenarioError, SimulationError, ExerciseError, ServiceError) as exc:
            run.error = str(exc)
            self.console.print(f"[bold red]exercise failed:[/] {exc}", highlight=False)
        except Exception as exc:  # noqa: BLE001 - say what broke, then still stop everything below
            run.error = f"{type(exc).__name__}: {exc}"
            self.console.print(f"[bold red]exercise failed:[/] {run.error}", highlight=False)
        finally:
            run.services_left = self._stop_all(self._surfaces, self._broker)
            self._stop_real()
            if self._temp_sockets:
                shutil.rmtree(self._temp_sockets, ignore_errors=True)
            self._say_where(run)
        return run

    def _announce(self) -> None:
        sc = self.scenario
        span = sc.duration
        self.say("exercise", f"{sc.name} (seed {self.seed}, speed {self.speed:g}×: {span / 60:.0f} scenario minutes in "
                             f"~{max(self.to_wall(span), MIN_STEP_GAP_S * len({s.at for s in sc.timeline})):.0f}s)")
        if sc.description:
            self.console.print(f"         [dim]{sc.description.strip()}[/]", highlight=False)

    def _kafka(self):
        """The configured broker (topics under a prefix of this run) or a local one; the
        run's topics created. Returns (bootstrap, catalogue, client config)."""
        from producers._kafka import ensure_topics
        from schemas.topics import TopicCatalogue

        kconf = self.settings.kafka
        if kconf.bootstrap:
            bootstrap = kconf.bootstrap
            prefix = f"{kconf.topic_prefix}-ex-{self.scenario.name}-{self.run_id}"
            self.say("kafka", f"using {bootstrap} (topics {prefix}.*)")
        else:
            from gpuledger.dev.localkafka import LocalKafka

            self.say("kafka", "starting the local broker (the first run downloads Kafka's jars with Maven)...")
            self._broker = LocalKafka(self.base / "kafka", self.settings.cache_dir).start()
            bootstrap, prefix = self._broker.bootstrap, kconf.topic_prefix
            self.say("kafka", f"ready at {bootstrap}")
        catalogue = TopicCatalogue(prefix=prefix, raw_partitions=kconf.raw_partitions, replication_factor=kconf.replication_factor)
        client = {"bootstrap.servers": bootstrap, **kconf.client_config()}
        ensure_topics(client, catalogue)
        return bootstrap, catalogue, client

    def _cluster(self) -> tuple[SimCluster, Path]:
        """The simulated cluster's surfaces (API server, kubelet sockets) and its kubeconfig."""
        sc = self.scenario
        socket_dir, is_temp = _short_socket_dir(self.base / "kubelet")
        self._temp_sockets = socket_dir if is_temp else None
        surfaces = self._surfaces = Surfaces([n.name for n in sc.cluster.nodes], socket_dir).start()
        sim = SimCluster(sc, self.seed, surfaces, seconds_to_wall=self.to_wall)
        sim.setup(datetime.now(timezone.utc))
        kubeconfig = self.base / "sim-kubeconfig.json"
        kubeconfig.write_text(json.dumps(surfaces.kubeconfig(), indent=2))
        self.say("cluster", f"{sim.describe()}; API server {surfaces.api.url}, kubelet sockets in {socket_dir}")
        return sim, kubeconfig

    def _real_cluster(self):
        """--cluster real: the local control plane with the scenario's nodes, its kubelet doubles, the
        DCGM-shaped page and MLflow (started beside the cluster); the driver set up on them."""
        import threading

        from gpuledger.dev.cluster import LocalCluster
        from gpuledger.dev.kubelets import ClusterKubelets
        from gpuledger.dev.peers import DcgmExporter, MlflowServer, node_devices
        from gpuledger.dev.scenario_driver import RealClusterDriver, mlflow_release_template, scenario_nodes

        sc = self.scenario
        mlflow_release_template(sc)  # a scenario the registry cannot name fails before anything starts
        nodes = scenario_nodes(sc)
        mlflow = MlflowServer(self.base / "mlflow", self.settings.cache_dir)
        failed: list[BaseException] = []

        def start_mlflow() -> None:
            try:
                mlflow.start()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, in the runner's thread
                failed.append(exc)

        self.say("cluster", "starting the local real cluster (etcd, kube-apiserver, controller-manager, scheduler, KWOK, Kueue) "
                            "and MLflow; a first run builds the binaries (minutes)...")
        thread = threading.Thread(target=start_mlflow, name="mlflow-start", daemon=True)
        thread.start()
        try:
            cluster = LocalCluster(self.base / "cluster", self.settings.cache_dir, nodes=nodes).start()
        finally:
            thread.join()
            self._real.append(mlflow)
        self._real.append(cluster)
        if failed:
            raise ExerciseError(f"MLflow did not start: {failed[0]}")
        socket_dir, is_temp = _short_socket_dir(self.base / "kubelet")
        self._temp_sockets = socket_dir if is_temp else None
        socket_dir.mkdir(parents=True, exist_ok=True)
        exporter = DcgmExporter([d for n in nodes for d in node_devices(n)]).start()
        self._real.append(exporter)
        # No pod mapping on the page (dcgm-exporter without --kubernetes), as the simulator's XID alerts carry
        # no pod labels: the alert is attributed by the as-of GPU join, the path the scenarios check.
        kubelets = ClusterKubelets(cluster, socket_dir).start()
        self._real.append(kubelets)
        sim = RealClusterDriver(sc, self.seed, cluster, kubelets, exporter, mlflow, seconds_to_wall=self.to_wall)
        sim.setup(datetime.now(timezone.utc))
        self.say("cluster", f"{sim.describe()}; API server {cluster.server} (kubeconfig {cluster.kubeconfig}), MLflow {mlflow.url}, "
                            f"DCGM page {exporter.url}, kubelet sockets in {socket_dir}")
        return sim, cluster.kubeconfig

    def _start_real_peers(self, sim, receiver_url: str) -> None:
        """Prometheus and Alertmanager to the receiver; MLflow's webhook to it (after the registry was seeded)."""
        from gpuledger.dev.peers import AlertingPeers

        alerting = AlertingPeers(self.base / "alerting", sim.exporter, receiver_url, self._alertmanager_token).start()
        self._real.append(alerting)
        sim.receiver_url, sim.alertmanager_url = receiver_url, alerting.alertmanager_url
        sim.mlflow.create_webhook(receiver_url, MLFLOW_SECRET)
        self.say("start", f"Prometheus {alerting.prometheus_url} → Alertmanager {alerting.alertmanager_url} → receiver; "
                          f"MLflow webhook → {receiver_url}/v1/mlflow")

    def _stop_real(self) -> None:
        if self._real:
            self.say("stop", "Prometheus, Alertmanager, kubelet doubles, DCGM page, local cluster, MLflow")
        while self._real:
            part = self._real.pop()
            try:
                part.stop()
            except Exception as exc:  # noqa: BLE001 - keep stopping the rest
                self.console.print(f"         [yellow]stopping {type(part).__name__} failed: {exc}[/]", highlight=False)

    def _services_env(self, bootstrap: str, catalogue, dsn: str) -> dict[str, str]:
        kconf = self.settings.kafka
        return {
            "GPULEDGER_KAFKA_BOOTSTRAP": bootstrap, "GPULEDGER_KAFKA_TOPIC_PREFIX": catalogue.prefix,
            "GPULEDGER_KAFKA_RAW_PARTITIONS": str(kconf.raw_partitions), "GPULEDGER_DATA_DIR": str(self.base),
            "GPULEDGER_CLICKHOUSE_DSN": dsn, "GPULEDGER_CLICKHOUSE_BATCH_SECONDS": "0.3",
            "GPULEDGER_STREAMS_APP_ID": f"{catalogue.prefix}-exercise", "GPULEDGER_STREAMS_WEB_PORT": str(free_port()),
            # Exercise timelines are short: flush rows that wait for an identity after 2 s of quiet.
            "GPULEDGER_STREAMS_PARK_IDLE_FLUSH_S": "2",
            "GPULEDGER_POLICY_FILE": str(self._write_policy(self.scenario)),
        }

    def _start_worker(self, env: dict[str, str], dsn: str) -> str:
        """Start the worker; its health URL once it says ok."""
        self.say("start", "worker (Faust + " + ("embedded ClickHouse" if dsn.startswith("chdb:") else "ClickHouse server") + ")...")
        worker = self._start("worker", ["-v", "worker"], env)
        worker_url = f"http://127.0.0.1:{env['GPULEDGER_STREAMS_WEB_PORT']}"
        self._wait("the worker", lambda: _get_json(f"{worker_url}/gpuledger/health/").get("status") == "ok", 120, worker)
        self.say("start", f"worker ready, health at {worker_url}/gpuledger/health/")
        return worker_url

    def _start_receiver(self, env: dict[str, str], sim) -> None:
        if self.real:
            from gpuledger.dev.peers import write_caller

            credentials = self.base / "receiver-callers.yaml"
            self._alertmanager_token = write_caller(credentials, "service:alertmanager", ("alertmanager",))
            # Release events of the scenario's people come without a credential (recorded as unauthenticated,
            # as on the simulator); Alertmanager proves itself; MLflow signs its deliveries.
            env = {**env, "GPULEDGER_RECEIVER_CREDENTIALS_FILE": str(credentials), "GPULEDGER_RECEIVER_MLFLOW_SECRET": MLFLOW_SECRET,
                   "GPULEDGER_RECEIVER_MLFLOW__RELEASE_ID_TEMPLATE": sim.mlflow_template}
        receiver = self._start("receiver", ["-v", "receive", "--port", "0"], env)
        url = self._wait("the receiver", lambda: (m := re.search(r"listening on (http://\S+)", receiver.log_path.read_text(errors="replace"))) and m.group(1),
                         60, receiver)
        self._wait("the receiver's Kafka connection", lambda: _get_json(f"{url}/readyz").get("ready"), 60, receiver)
        if self.real:
            self._start_real_peers(sim, url)
        else:
            self._surfaces.receiver_url = url
        self.say("start", f"receiver at {url} (Alertmanager and release webhooks)")

    def _start_admit(self, env: dict[str, str]):
        """gpuledger admit (its webhook; the scenario's policy) and the function the simulated
        API server calls with each Workload at creation: (allowed, message)."""
        import ssl
        import urllib.request
        import uuid

        ca = self.base / "admit-ca.crt"
        admit = self._start("admit", ["-v", "admit", "--port", "0", "--ca-out", str(ca)], env)
        url = self._wait("gpuledger admit", lambda: (m := re.search(r"listening on (https://[0-9.]+:\d+)", admit.log_path.read_text(errors="replace")))
                         and m.group(1), 60, admit)
        context = ssl.create_default_context(cafile=str(ca))

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"{url}/readyz", context=context, timeout=2) as resp:
                    return resp.status == 200
            except OSError:
                return False

        self._wait("gpuledger admit's release state", ready, 60, admit)
        self.say("start", f"gpuledger admit at {url}/validate: every workload is submitted through its webhook")

        def review(obj: dict) -> tuple[bool, str]:
            body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
                "uid": str(uuid.uuid4()), "kind": {"group": "kueue.x-k8s.io", "version": "v1beta2", "kind": "Workload"},
                "operation": "CREATE", "namespace": obj["metadata"]["namespace"], "userInfo": {"username": "exercise"},
                "object": obj}}).encode()
            request = urllib.request.Request(f"{url}/validate", data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, context=context, timeout=10) as resp:
                answer = json.loads(resp.read())["response"]
            return answer["allowed"], (answer.get("status") or {}).get("message", "")

        return review

    def _start_collectors(self, env: dict[str, str], sim: SimCluster, kubeconfig: Path) -> None:
        """The scheduler collector (watches open) and one pod-resources collector per node (polled once)."""
        surfaces, state = self._surfaces, self.base / "state"
        gpu_args = [a for r in sim.gpu_resources for a in ("--gpu-resource", r)]
        sched_env = {**env, "GPULEDGER_SCHEDULER_HOST": "sim-scheduler-collector", "GPULEDGER_SCHEDULER_BACKOFF_INITIAL_S": "0.2",
                     "GPULEDGER_SCHEDULER_STATE_FLUSH_INTERVAL_S": "0"}
        sched = self._start("scheduler-collector", ["-v", "collect", "scheduler", "--kubeconfig", str(kubeconfig), "--state-dir", str(state),
                                                    *gpu_args], sched_env)
        if self.real:
            # The real API server does not count watches: the collector logs each one it opens (Kueue's last).
            self._wait("the scheduler collector's watches", lambda: "kueue: watching" in sched.log_path.read_text(errors="replace"), 120, sched)
            kubelets = sim.kubelets.kubelets
        else:
            self._wait("the scheduler collector's watches", lambda: surfaces.api.open_watches() >= 3, 60, sched)
            kubelets = surfaces.kubelets
        self.say("start", "scheduler collector watching pods, events and Kueue workloads")
        res_args = [a for r in sim.gpu_resources for a in ("--resource", r)]
        for node, kubelet in kubelets.items():
            self._start(f"podresources-{node}", ["-v", "collect", "podresources", "--socket", str(kubelet.socket_path), "--node", node,
                                                 "--interval", str(POLL_INTERVAL_S), "--state-dir", str(state), *res_args], env)
        for node, kubelet in kubelets.items():
            self._wait(f"the pod-resources collector of {node}", lambda k=kubelet: k.call_count("List") >= 1, 60)
        self.say("start", f"pod-resources collectors polling {', '.join(kubelets)} every {POLL_INTERVAL_S:g}s")

    def _reader(self, dsn: str):
        from sinks.read.query import DirectReader, RemoteReader, owner_file

        if dsn.startswith("chdb:"):
            return RemoteReader.from_owner(owner_file(dsn))
        from sinks.clickhouse import StoreConnection, connect

        database = self.settings.clickhouse.database
        return DirectReader(StoreConnection.reopening(connect(dsn, database, create=False), lambda: connect(dsn, database, create=False)))

    def _play(self, sim: SimCluster) -> list[StepRecord]:
        sc = self.scenario
        start_mono = time.monotonic()
        start_wall = datetime.now(timezone.utc)
        sim.started_at = start_wall
        offset = 0.0
        prev_at = None
        self.say("timeline", f"{len(sc.timeline)} steps")
        for i, step in enumerate(sc.timeline):
            wanted = self.to_wall(step.at)
            if prev_at is not None and step.at > prev_at:
                gap = max(self.to_wall(step.at - prev_at), MIN_STEP_GAP_S) if self.real else MIN_STEP_GAP_S
                wanted = max(wanted, offset + gap)
            offset = max(offset, wanted)
            prev_at = step.at
            while (left := start_mono + offset - time.monotonic()) > 0:
                self._check_alive()
                time.sleep(min(left, 0.25))
            self._check_alive()
            record = sim.apply(step, i, start_wall + timedelta(seconds=offset))
            if self.real:
                # A real step takes effect when the real systems have carried it out (seconds, MLflow's
                # deliveries up to ~10 s on a loaded machine): the scenario's gap to the next step counts
                # from then, so that a grace period the timeline leaves still passes before it.
                offset = max(offset, time.monotonic() - start_mono)
            minutes, seconds = divmod(int(step.at), 60)
            note = f"  [dim]— {step.note}[/]" if step.note else ""
            self.console.print(f"  [cyan]{minutes:>3}m{seconds:02d}s[/] {record.summary}{note}", highlight=False)
        return sim.records

    def _drain(self, worker_url: str, client: dict, catalogue, app_id: str) -> float:
        """Wait until every raw event was routed and stored, correlation and sinks are quiet,
        and the controls have evaluated everything and their violations are stored: the
        worker's group has committed the whole controls topic (the hop every control input
        and forward takes), so a violation check does not race the controls stage."""
        from confluent_kafka import Consumer, TopicPartition

        time.sleep(3 * POLL_INTERVAL_S + 0.5)  # the last kubelet change reaches its collector
        started = time.monotonic()
        consumer = Consumer({**client, "group.id": f"gpuledger-exercise-drain-{self.run_id}", "enable.auto.commit": False})
        from streams.progress import worker_groups

        # The group that reads the controls topic (the controls process's); only asked for its
        # committed offsets, never subscribes, so it does not join it.
        controls_group = next(group for group, topics in worker_groups(catalogue, app_id).items() if catalogue.run(app_id).controls in topics)
        worker_group = Consumer({**client, "group.id": controls_group, "enable.auto.commit": False})
        try:
            parts = []
            for topic in catalogue.raw_topics:
                md = consumer.list_topics(topic, timeout=10)
                parts += [TopicPartition(topic, p) for p in md.topics[topic].partitions]
            controls_topic = catalogue.run(app_id).controls
            md = consumer.list_topics(controls_topic, timeout=10)
            control_parts = [TopicPartition(controls_topic, p) for p in md.topics[controls_topic].partitions]

            def controls_lag() -> int:
                ends = [consumer.get_watermark_offsets(tp, timeout=5, cached=False)[1] for tp in control_parts]
                done = [max(tp.offset, 0) for tp in worker_group.committed(control_parts, timeout=5)]
                return sum(e - d for e, d in zip(ends, done))

            last_sig, stable_since, last_print = None, time.monotonic(), 0.0
            self.say("drain", "waiting for the pipeline to correlate and store everything...")
            while time.monotonic() - started < DRAIN_TIMEOUT_S:
                self._check_alive()
                total = sum(consumer.get_watermark_offsets(tp, timeout=5, cached=False)[1] for tp in parts)
                stats = _get_json(f"{worker_url}/gpuledger/health/")["stats"]
                stored_raw = stats.get("raw_stored", 0) + stats.get("raw_skipped", 0)
                lag = controls_lag()
                sig = (total, stats.get("routed", 0), stored_raw, stats.get("correlated_in", 0), stats.get("correlated_out", 0),
                       stats.get("stored", 0), stats.get("allocations_stored", 0), stats.get("parked", 0), stats.get("controls_in", 0),
                       stats.get("violations_out", 0), stats.get("violations_stored", 0), lag)
                if sig != last_sig:
                    last_sig, stable_since = sig, time.monotonic()
                # Every raw event routed, folded by the correlation agent (it waits for the
                # release directory first), every correlated row stored, nothing parked.
                caught_up = (stats.get("routed", 0) >= total and stored_raw >= total and stats.get("correlated_in", 0) >= total
                             and stats.get("stored", 0) >= stats.get("correlated_out", 0) and stats.get("parked", 0) == 0
                             and lag == 0 and stats.get("violations_stored", 0) >= stats.get("violations_out", 0))
                now = time.monotonic()
                if now - last_print >= 2.0:
                    last_print = now
                    self.console.print(f"           raw events {stats.get('routed', 0)}/{total} routed, {stored_raw} stored; "
                                       f"{stats.get('correlated_out', 0)} correlated rows, {stats.get('stored', 0)} stored, "
                                       f"{stats.get('allocations_stored', 0)} allocation rows; {stats.get('parked', 0)} parked; "
                                       f"controls {lag} behind, {stats.get('violations_out', 0)} violation records, "
                                       f"{stats.get('violations_stored', 0)} stored", highlight=False)
                if caught_up and now - stable_since >= SETTLE_S:
                    took = now - started
                    self.say("drain", f"done in {took:.1f}s: {total} raw events, {stats.get('stored', 0)} correlated rows stored, "
                                      f"{stats.get('dead_letters', 0)} dead letters")
                    return took
                time.sleep(0.3)
        finally:
            consumer.close()
            worker_group.close()
        raise ExerciseError(f"the pipeline did not drain within {DRAIN_TIMEOUT_S:.0f}s (last stats {last_sig}); logs in {self.base / 'logs'}")

    def _check(self, sim: SimCluster, reader) -> list[CheckResult]:
        db = self.settings.clickhouse.database
        cluster = self.settings.clickhouse.cluster
        deadline = time.monotonic() + CHECK_RETRY_S
        while True:
            results = [evaluate(exp, sim, reader, db, self.to_wall, cluster)[0] for exp in self.scenario.expect]
            if all(r.status != "FAIL" for r in results) or time.monotonic() > deadline:
                return results
            # A late re-attribution (a higher row version) can still be on its way.
            time.sleep(1.0)

    def _print_results(self, results: list[CheckResult]) -> None:
        table = Table(title=f"expected evidence: {self.scenario.name}", title_justify="left", show_lines=False)
        table.add_column("#", justify="right")
        table.add_column("result")
        table.add_column("expectation")
        table.add_column("read back (gpuledger trace)", overflow="fold")
        colour = {"PASS": "green", "FAIL": "bold red", "PENDING": "yellow"}
        for i, r in enumerate(results, 1):
            table.add_row(str(i), f"[{colour[r.status]}]{r.status}[/]", r.name, f"[dim]{r.entry}[/]  {r.detail}")
        self.console.print(table)
        counts = summary(results)
        self.say("result", f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['PENDING']} pending")

    def _report(self, sim: SimCluster, reader, run: ExerciseRun) -> dict | None:
        from gpuledger.sim.evidence import resolve_ref
        from sinks.read.report import collect_report_data, render_html
        from sinks.read.trace import trace
        from sinks.read.tree import render_tree, tree_text

        named = self.scenario.report_entry()
        if named is None:
            self.say("report", "none: the scenario names no release and no expectation an entry point (give report.trace)")
            return None
        entry = resolve_ref(*named, sim)
        db = self.settings.clickhouse.database
        result = trace(reader, db, *entry, cluster=self.settings.clickhouse.cluster)
        self.say("trace", f"gpuledger trace --{entry[0]} {entry[1]}")
        tree = render_tree(result)
        self.console.print(tree, highlight=False)
        data = collect_report_data(reader, db, result, nodes=list(sim.nodes), since=sim.started_at - timedelta(seconds=1),
                                   cluster=self.settings.clickhouse.cluster)
        html = render_html(result, data, title=f"gpuledger exercise: {self.scenario.name}", lanes=sim.lanes(), chain_text=tree_text(tree),
                           checks=[r.__dict__ for r in run.results],
                           steps=[{"at": r.at, "offset": self.scenario.timeline[r.index].at, "kind": r.kind, "summary": r.summary,
                                   "note": r.note} for r in sim.records],
                           description=self.scenario.description)
        self.report_path.parent.mkdir(parents=True, exist_ok=True)
        self.report_path.write_text(html)
        self.say("report", f"{self.report_path}  (one self-contained HTML file)")
        return result

    def _stop_all(self, surfaces: Surfaces | None, broker) -> list[str]:
        """Stop every child (collectors first: they flush to Kafka; the worker last); names of any left alive."""
        order = sorted(self.services, key=lambda s: (s[0] == "worker", s[0] == "receiver"))
        if order:
            self.say("stop", ", ".join(name for name, _ in order))
        for name, service in order:
            code = service.stop(grace=15)
            if code not in (0, None, -15, 143):
                self.console.print(f"         [yellow]{name} exited with {code}[/] (log {service.log_path})", highlight=False)
        left = [name for name, service in order if service.alive()]
        self.services = []
        if surfaces:
            surfaces.stop()
        if broker:
            self.say("stop", "local Kafka")
            broker.stop()
        return left

    def _say_where(self, run: ExerciseRun) -> None:
        if not run.dsn:
            return
        self.say("data", f"{self.base}  (logs in {self.base / 'logs'})")
        if run.dsn.startswith("chdb:"):
            self.console.print(f"         query it: GPULEDGER_CLICKHOUSE_DSN={run.dsn} gpuledger sql "
                               "\"SELECT event_type, release_id, node, gpu_id, summary FROM gpuledger.correlated_events FINAL ORDER BY occurred_at\"",
                               highlight=False, soft_wrap=True)
        else:
            self.console.print(f"         in the ClickHouse server at {run.dsn.split('@')[-1]} (database {self.settings.clickhouse.database})",
                               highlight=False)


def _merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def run_exercise(settings, scenario: str | Path | Scenario, console: Console, *, speed: float | None = None, seed: int | None = None,
                 report_path: Path | None = None, data_dir: Path | None = None, cluster: str = "sim") -> ExerciseRun:
    """Load (unless given) and run one scenario; see ``ExerciseRunner``. Raises ScenarioError for a bad file."""
    sc = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
    return ExerciseRunner(settings, sc, console, speed=speed, seed=seed, report_path=report_path, data_dir=data_dir, cluster=cluster).run()
