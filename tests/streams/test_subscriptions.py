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
