"""Shared pytest fixtures: real Kafka and real ClickHouse (see tests/fixtures/).

The suite runs on four pytest-xdist workers (``-n 4`` in pyproject.toml): the tests mostly wait
on real peers (brokers, workers, the real cluster; two workers kept 2 cores about two-thirds
busy), so four at a time shorten the wall time on two cores. ``pytest_xdist_make_scheduler``
hands out whole modules (their module-scoped fixtures are built once, on one worker), the
real-cluster modules that share the session's control plane as two units (one control plane per
worker that runs one), and each test that starts a cluster of its own (the real exercises, the
``dev cluster`` CLI) as a unit by itself. The controller starts the one broker all workers
share (``pytest_configure``); ``-n 0`` runs everything in one process as before.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

#: Every entity store in the tests — in-process and in the workers they start — looks at every
#: sealed chunk at every write as well, and fails a write whose chunk changed without its journal
#: saying so (``streams.store.VERIFY_JOURNAL``; the setting ``streams.verify_journal``).
os.environ["GPULEDGER_STREAMS_VERIFY_JOURNAL"] = "1"
import streams.store  # noqa: E402

streams.store.VERIFY_JOURNAL = True

#: xdist's workers start with COLUMNS=80 and LINES=24 in their environment, whatever the controller
#: had; gpuledger's rich consoles fix their width from COLUMNS when the CLI module is imported, so
#: CLI output would wrap at 80 columns under xdist only (a test's COLUMNS=250 then comes too late).
#: The controller passes its own values on (``pytest_configure``); set before anything imports the CLI.
TERMINAL_ENV = "TEST_CONTROLLER_TERMINAL"
if os.environ.get("PYTEST_XDIST_WORKER") and TERMINAL_ENV in os.environ:
    for _name, _value in json.loads(os.environ[TERMINAL_ENV]).items():
        if _value is None:
            os.environ.pop(_name, None)
        else:
            os.environ[_name] = _value

from tests.fixtures.clickhouse import clickhouse_client, clickhouse_db, clickhouse_dsn  # noqa: E402,F401
from tests.fixtures.kafka import SHARED_BOOTSTRAP_ENV, catalogue, kafka_bootstrap, settings_for  # noqa: E402,F401
from tests.fixtures.worker import worker_factory  # noqa: E402,F401


def _xdist_controller(config) -> bool:
    return not hasattr(config, "workerinput") and bool(config.getoption("numprocesses", default=None))


def pytest_configure(config):
    """Under xdist, the controller starts the native broker once and the workers inherit its
    address (``SHARED_BOOTSTRAP_ENV``): one broker for the session, not one per worker."""
    if _xdist_controller(config):
        os.environ[TERMINAL_ENV] = json.dumps({name: os.environ.get(name) for name in ("COLUMNS", "LINES")})
    if not _xdist_controller(config) or os.environ.get("GPULEDGER_KAFKA_BOOTSTRAP") or os.environ.get(SHARED_BOOTSTRAP_ENV):
        return
    from tests.fixtures.kafka import _docker_answers

    if os.environ.get("GPULEDGER_TEST_DOCKER", "1") == "1" and _docker_answers():
        return  # each worker gets testcontainers' broker, as without xdist
    from gpuledger.dev.localkafka import LocalKafka
    from gpuledger.settings import default_cache_dir

    # with_parent: a run killed before its teardown (a timeout, ^C twice) takes its broker with it
    broker = LocalKafka(Path(tempfile.mkdtemp(prefix="gpuledger-kafka-")), default_cache_dir(), with_parent=True)
    broker.__enter__()
    config._gpuledger_shared_broker = broker
    os.environ[SHARED_BOOTSTRAP_ENV] = broker.bootstrap


def pytest_unconfigure(config):
    broker = getattr(config, "_gpuledger_shared_broker", None)
    if broker is not None:
        os.environ.pop(SHARED_BOOTSTRAP_ENV, None)
        broker.__exit__(None, None, None)


def _real_cluster_binaries_built() -> bool:
    """Whether the real cluster's pinned binaries are in the cache already (a warm machine)."""
    from gpuledger.dev import kubebin
    from gpuledger.settings import default_cache_dir

    cache = default_cache_dir()
    tools = [cache / f"{module.rsplit('/', 1)[1]}-{version}" / module.rsplit("/", 1)[1] for module, version in (kubebin.KWOK, kubebin.KUEUE)]
    return all(p.exists() for p in (cache / f"kube-{kubebin.kube_pin()}" / "kube", *tools))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist (-p no:xdist runs without it)
def pytest_xdist_make_scheduler(config, log):
    """Like ``--dist loadfile``, with the units of ``unit_of``. (Not ``--dist
    loadgroup``: xdist 3.8 marks a group by rewriting ``item._nodeid``, which pytest 9.2 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

        def _reschedule(self, node) -> None:
            # A worker runs a test only once it has the next one (the next item decides fixture
            # teardown), so a unit of one test is handed out with the following unit, which waits
            # behind it. Behind a test with a cluster of its own (minutes long) make that the queue's
            # last unit (the short modules; never a real-cluster one, which may wait for a cold
            # build) rather than the next long module.
            work = self.assigned_work.get(node, {})
            pending = [scope for scope, done in work.items() if not all(done.values())]
            if (not node.shutting_down and len(self.workqueue) > 1 and self._pending_of(work) == 1
                    and pending[0].split("::", 1)[0] in OWN_CLUSTER_MODULES):
                short = next((s for s in reversed(self.workqueue) if not s.startswith("tests/real_cluster/")), None)
                if short is not None:
                    self.workqueue.move_to_end(short, last=False)
            super()._reschedule(node)

    return ModuleScheduling(config, log)


#: Real-cluster tests that start a control plane of their own (not the session's ``real_cluster``): each
#: test of these modules is a unit of its own, so that they run beside the tier on other workers.
OWN_CLUSTER_MODULES = ("tests/real_cluster/test_exercise.py", "tests/real_cluster/test_cli.py")
#: The real-cluster modules that share a worker's session control plane, in two units of about equal length
#: (--durations, 2026-12-02: about 4.5 minutes each): each unit's worker starts the session's ``real_cluster``
#: (and ``mlflow_server``, which only the second unit uses), so the two run at once on two workers.
#: A module missing here joins the first unit.
SHARED_CLUSTER_UNITS = (("tests/real_cluster/test_admit.py", "tests/real_cluster/test_cluster.py",
                         "tests/real_cluster/test_k8s_deploy.py", "tests/real_cluster/test_scheduler_collector.py"),
                        ("tests/real_cluster/test_alerting.py", "tests/real_cluster/test_mlflow.py",
                         "tests/real_cluster/test_dra.py", "tests/real_cluster/test_kubelets.py"))


def unit_of(nodeid: str) -> str:
    """The scheduling unit of a test: its module; the real-cluster tier's modules that share the
    session's control plane in the units of ``SHARED_CLUSTER_UNITS``; a test that starts a cluster
    of its own a unit by itself."""
    path = nodeid.split("::", 1)[0]
    if path in OWN_CLUSTER_MODULES:
        return nodeid
    if not path.startswith("tests/real_cluster/"):
        return path
    group = next((i for i, modules in enumerate(SHARED_CLUSTER_UNITS) if path in modules), 0)
    return f"tests/real_cluster/ (shared cluster {group + 1})"


#: The longest modules outside the real-cluster tier (--durations, 2026-12-02), longest first: handed
#: out first, so that no long module starts last and runs on while the other worker idles.
#: A module missing here only runs in collection order; the list is a schedule, not a contract.
LONG_MODULES = ("tests/streams/test_faults.py", "tests/gpuledger/test_exercise.py", "tests/gpuledger/test_replay.py",
                "tests/e2e/test_gpu_identity.py", "tests/streams/test_app.py", "tests/producers/receiver/test_server.py",
                "tests/sinks/test_service.py", "tests/streams/test_controls.py", "tests/gpuledger/dev/test_localkafka.py",
                "tests/producers/kubernetes/test_collector.py", "tests/e2e/test_thin_path.py")


def pytest_collection_modifyitems(session, config, items):
    """The order the scheduler hands out units in. With warm caches the real-cluster tier runs
    first, its two shared units then the tests with a cluster of their own (they start control
    planes and mostly wait on them, so they overlap the rest of the suite on the other workers);
    on a fresh machine it runs last, as .ci/run builds its Go binaries in the background
    meanwhile. Then the long modules, longest first."""
    first = _real_cluster_binaries_built()

    def key(item):
        real = item.get_closest_marker("real_cluster") is not None
        path = item.nodeid.split("::", 1)[0]
        if real:  # the tier's shared units (the longest), then the tests with a cluster of their own
            if path in OWN_CLUSTER_MODULES:
                return (not first, len(SHARED_CLUSTER_UNITS) + OWN_CLUSTER_MODULES.index(path))
            return (not first, next((i for i, modules in enumerate(SHARED_CLUSTER_UNITS) if path in modules), 0))
        return (first, LONG_MODULES.index(path) if path in LONG_MODULES else len(LONG_MODULES))

    items.sort(key=key)
