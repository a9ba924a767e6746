"""The worker's check that every agent got its partitions after a rebalance (the
health page turns ``degraded`` and names the topic when one did not)."""

from collections import namedtuple

from streams.app import check_assignment

TP = namedtuple("TP", "topic partition")
EXPECTED = {"p.scheduler.v1": 4, "p.app.route.v1": 4, "p.app.controls.v1": 4}


def test_every_agent_topic_with_the_raw_partitions_is_ok():
    got = check_assignment({TP(t, p) for t in EXPECTED for p in (1, 3)}, EXPECTED)
    assert got == {"ok": True, "problems": [], "partitions": [1, 3]}


def test_an_agent_topic_left_out_of_the_assignment_is_named():
    assignment = {TP("p.scheduler.v1", p) for p in range(4)} | {TP("p.app.route.v1", p) for p in range(4)}
    got = check_assignment(assignment, EXPECTED)
    assert not got["ok"]
    assert got["problems"] == ["p.app.controls.v1: partitions [] assigned, expected [0, 1, 2, 3] like p.scheduler.v1"]


def test_no_partition_at_all_is_not_ok():
    assert check_assignment(set(), EXPECTED)["problems"][0] == "no partition of p.scheduler.v1 is assigned to this worker"


def _worker_with_a_route_process(tmp_path):
    from gpuledger.settings import KafkaSettings, Settings
    from streams.app import WorkerContext
    from streams.correlate.route import route_process

    settings = Settings(data_dir=tmp_path, kafka=KafkaSettings(bootstrap="127.0.0.1:9", topic_prefix="p"))
    ctx = WorkerContext(settings)
    ctx.route = route_process(settings)  # not started: its health page is what each case passes
    ctx.subscriptions = {"ok": True, "problems": [], "partitions": [0, 1, 2, 3]}
    return ctx


def test_the_route_process_not_answering_or_without_raw_partitions_degrades_the_worker(tmp_path):
    """The route stage is a child process (streams.correlate.route): the worker's health is
    ``ok`` only when its page answers and shows every raw topic's partitions held."""
    ctx = _worker_with_a_route_process(tmp_path)
    raw = ctx.catalogue.raw_topics
    silent = ctx.health({"route": None})
    assert silent["status"] == "degraded" and silent["route"]["answering"] is False
    assert silent["subscriptions"]["problems"] == ["route stage: not answering"]
    assert ctx.assignment_health({"raw_assigned": None})["problems"] == ["route stage: raw topics not assigned yet"]
    partial = ctx.assignment_health({"raw_assigned": [[t, p] for t in raw[1:] for p in range(4)]})
    assert not partial["ok"] and partial["problems"][0] == f"route stage: no partition of {raw[0]} is assigned to this worker"
    held = ctx.assignment_health({"raw_assigned": [[t, p] for t in raw for p in range(4)]})
    assert held == {"ok": True, "problems": [], "partitions": [0, 1, 2, 3], "raw_partitions": [0, 1, 2, 3]}


def test_a_childs_stats_merge_into_the_workers_summing_what_both_count(tmp_path):
    """Dead letters are counted by the route stage and the correlation stage alike: the page
    shows their sum, and the records produced per topic summed too."""
    ctx = _worker_with_a_route_process(tmp_path)
    ctx.stats.update({"dead_letters": 2, "correlated_in": 10})
    page = {"raw_assigned": [[t, p] for t in ctx.catalogue.raw_topics for p in range(4)], "gc": {"thresholds": [1, 2, 3]},
            "stats": {"dead_letters": 1, "routed": 7, "first_route_batch_at": 12.5, "route_outputs_produced": {"p.app.route.v1": 3}},
            "counters": {"streams.route": {"received": 8}}, "epochs": {"route_events": {"pending": 0, "commits": 2}}}
    health = ctx.health({"route": page})
    stats = health["stats"]
    assert (stats["dead_letters"], stats["correlated_in"], stats["routed"], stats["first_route_batch_at"]) == (3, 10, 7, 12.5)
    assert health["counters"]["streams.route"] == {"received": 8} and health["epochs"]["route_events"]["commits"] == 2
    assert health["route"]["answering"] and health["route"]["gc"] == {"thresholds": [1, 2, 3]} and health["route"]["restarts"] == 0


def test_the_controls_process_not_answering_or_without_its_partitions_degrades_the_worker(tmp_path):
    """The controls stage is a child process too (streams.controls.service): the worker's
    health is ``ok`` only when its page answers and shows the controls topic's partitions held."""
    from streams.controls.service import controls_process

    ctx = _worker_with_a_route_process(tmp_path)
    ctx.controls = controls_process(ctx.settings)  # not started either
    raw = {"raw_assigned": [[t, p] for t in ctx.catalogue.raw_topics for p in range(4)]}
    silent = ctx.health({"route": raw, "controls": None})
    assert silent["status"] == "degraded" and silent["controls"]["answering"] is False
    assert silent["subscriptions"]["problems"] == ["controls stage: not answering"]
    assert ctx.assignment_health(raw, {"controls_assigned": None})["problems"] == ["controls stage: controls topic not assigned yet"]
    half = ctx.assignment_health(raw, {"controls_assigned": [[ctx.run.controls, p] for p in (0, 1)]})
    assert half["ok"] and half["controls_partitions"] == [0, 1]  # a second worker holds the others: the group is the judge
    none = ctx.assignment_health(raw, {"controls_assigned": []})
    assert not none["ok"] and none["problems"] == [f"controls stage: no partition of {ctx.run.controls} is assigned to this worker"]
    page = {"controls_assigned": [[ctx.run.controls, p] for p in range(4)], "stats": {"controls_in": 5, "violations_out": 2},
            "epochs": {"evaluate_controls": {"pending": 0, "commits": 3}}, "stores": {"controls": {"keys": 7}}}
    health = ctx.health({"route": raw, "controls": page})
    assert health["subscriptions"] == {"ok": True, "problems": [], "partitions": [0, 1, 2, 3], "raw_partitions": [0, 1, 2, 3],
                                       "controls_partitions": [0, 1, 2, 3]}
    assert (health["stats"]["controls_in"], health["epochs"]["evaluate_controls"]["commits"], health["stores"]["controls"]) == (5, 3, {"keys": 7})


def test_a_running_child_that_misses_a_health_fetch_is_shown_by_its_recent_page_not_as_gone(tmp_path, monkeypatch):
    """A child's stage serves its page on the loop its batches hold (the controls at niceness 19
    on a busy machine can outlast the 2 s fetch): while the same process runs and answered within
    CHILD_PAGE_GRACE_S, an unanswered fetch shows its last page (``stale_s``) and the worker stays
    ``ok``; after that, or for a process that ended or was started anew, it is not answering."""
    import asyncio
    from types import SimpleNamespace

    from streams import app as worker_app

    ctx = _worker_with_a_route_process(tmp_path)
    page = {"raw_assigned": [[t, p] for t in ctx.catalogue.raw_topics for p in range(4)]}
    clock, answers = [100.0], []
    monkeypatch.setattr(worker_app, "_clock", lambda: clock[0])
    route = SimpleNamespace(url="http://127.0.0.1:1", process=SimpleNamespace(pid=41), running=True, restarts=0, last_exit=None)
    route.alive = lambda: route.running
    route.health = lambda p: {"answering": p is not None}
    ctx.route = route
    ctx.directory.ready.set()

    async def fetch(url):
        return answers.pop(0)

    ctx.health_client = SimpleNamespace(fetch=fetch)

    def health_after(answer, seconds: float) -> dict:
        clock[0] += seconds
        answers.append(answer)
        return ctx.health(asyncio.run(ctx.children_health()))

    assert health_after(page, 0)["status"] == "ok"
    stalled = health_after(None, 4)
    assert stalled["status"] == "ok" and stalled["route"]["stale_s"] == 4.0 and stalled["subscriptions"]["raw_partitions"] == [0, 1, 2, 3]
    gone = health_after(None, 7)  # 11 s since it answered
    assert gone["status"] == "degraded" and gone["subscriptions"]["problems"] == ["route stage: not answering"]
    assert health_after(page, 1)["status"] == "ok"
    route.process = SimpleNamespace(pid=42)  # restarted: the old process's page is not the new one's
    assert health_after(None, 1)["subscriptions"]["problems"] == ["route stage: not answering"]
    assert health_after(page, 1)["status"] == "ok"
    route.running = False  # ended: at once
    assert health_after(None, 1)["status"] == "degraded"
