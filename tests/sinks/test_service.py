"""sinks/service.py: the sink process of a real worker (real broker, its own chDB).

The store's query endpoint is a service, not a backdoor: it answers only with the
owner file's token, the owner file is readable by its user alone, a runaway query ends
at its limit while the sink keeps storing, and Faust's own pages are off.
"""

from __future__ import annotations

import json
import stat
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime, timedelta, timezone

import pytest

from gpuledger.dev.process import pid_running
from gpuledger.settings import Settings
from producers._kafka import EventPublisher
from schemas import Identity, ReleaseEvent, Source, make_event_id
from schemas.release import ReleasePayload
from sinks.errors import SinkError
from sinks.read.query import QueryError, RemoteReader, owner_file
from tests.fixtures.waiting import poll


def _releases(tag: str, n: int) -> list[ReleaseEvent]:
    at = datetime.now(timezone.utc) - timedelta(hours=1)
    src = Source(collector="test", host="h")
    return [ReleaseEvent(event_id=make_event_id("test", (tag, str(i))), event_type="release.registered", occurred_at=at, observed_at=at,
                         source=src, identity=Identity(release_id=f"{tag}-{i}", model_name=tag), payload=ReleasePayload(actor="ci"))
            for i in range(n)]


def _post(url: str, body: dict, token: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token is not None else {})}
    req = urllib.request.Request(f"{url}/gpuledger/query/", data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _raw_count(reader: RemoteReader, tag: str) -> int:
    try:
        return reader.query("SELECT count() AS n FROM gpuledger.raw_events FINAL WHERE release_id LIKE {p:String}",
                            {"p": f"{tag}-%"}).dicts()[0]["n"]
    except SinkError:
        return -1


def test_queries_need_the_owner_files_token_which_only_its_user_can_read(kafka_bootstrap, catalogue, worker_factory):
    worker = worker_factory(catalogue)
    path = owner_file(worker.dsn)
    owner = json.loads(path.read_text())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    pub = EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, "test")
    pub.publish_batch(_releases("tok", 3))
    pub.close()
    poll(lambda: _raw_count(worker.reader, "tok") == 3, "3 raw rows", 60)

    sql = {"sql": "SELECT count() AS n FROM gpuledger.raw_events WHERE release_id LIKE 'tok-%'"}
    assert _post(owner["url"], sql, None)[0] == 401
    status, body = _post(owner["url"], sql, "not-the-token")
    assert status == 401 and "token" in body["error"]
    assert _post(owner["url"], sql, owner["token"]) == (200, {"columns": ["n"], "rows": [[3]]})
    # The documented checksum of a live store reads it through its owner too (it was chDB's
    # "Cannot lock file" and a traceback while the worker ran).
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "sinks.checksum", worker.dsn], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert json.loads(done.stdout)["raw_events"][0] == 3, done.stdout
    # Faust's own pages (tables, router, graph) are not served by the worker.
    for page in ("/table/", "/router/", "/graph/"):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{worker.url}{page}", timeout=5)
        assert err.value.code == 404, page


def test_a_runaway_query_ends_at_its_limit_while_the_sink_keeps_storing(kafka_bootstrap, catalogue, worker_factory):
    worker = worker_factory(catalogue, extra_env={"GPULEDGER_CLICKHOUSE_QUERY_TIMEOUT_S": "8"})
    poll(lambda: _raw_count(worker.reader, "run") == 0, "the store to answer", 60)
    outcome: dict = {}

    def runaway() -> None:
        started = time.monotonic()
        try:
            worker.reader.query("SELECT count() FROM numbers(1000000000000)")
        except QueryError as exc:
            outcome["error"] = str(exc)
        outcome["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=runaway)
    thread.start()
    pub = EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, "test")
    pub.publish_batch(_releases("run", 200))
    pub.close()
    stored_during = None
    while thread.is_alive():
        if _raw_count(worker.reader, "run") == 200:
            stored_during = True
            break
        time.sleep(0.2)
    thread.join(60)
    assert stored_during, f"the sink stored nothing new while the runaway query ran: {outcome}"
    assert "TIMEOUT_EXCEEDED" in outcome["error"] or "Timeout exceeded" in outcome["error"], outcome
    assert outcome["seconds"] < 30, outcome


def test_a_query_after_one_stopped_at_the_row_limit_gets_its_own_rows_only(kafka_bootstrap, catalogue, worker_factory):
    """Through the owner's query endpoint (what `gpuledger sql` and `trace` use while a worker
    runs): a statement stopped at the row limit left rows on the readers' shared client, and the
    next one answered 200 with them in front of its own (3 times in 8)."""
    worker = worker_factory(catalogue)
    poll(lambda: _raw_count(worker.reader, "lim") == 0, "the store to answer", 60)
    for i in range(6):
        with pytest.raises(QueryError, match="max rows"):
            worker.reader.query("SELECT number FROM system.numbers LIMIT 100001")
        assert worker.reader.query("SELECT {i:UInt8} AS i, count() AS n FROM system.one", {"i": i}).rows == [[i, 1]]


def _health(url: str) -> dict:
    try:
        with urllib.request.urlopen(f"{url}/gpuledger/health/", timeout=5) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return {}


def _nice_of_threads(pid: int) -> dict[int, tuple[int, str]]:
    """thread id -> (its niceness as the kernel has it, its name): /proc/PID/task/TID/stat field 19, comm."""
    import os

    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as stat_file, open(f"/proc/{pid}/task/{tid}/comm") as comm:
            out[int(tid)] = (int(stat_file.read().rsplit(")", 1)[1].split()[16]), comm.read().strip())
    return out


def test_the_sink_and_its_store_engine_run_below_the_workers_priority(kafka_bootstrap, catalogue, worker_factory):
    import os

    ours = os.getpriority(os.PRIO_PROCESS, 0)
    lowered = min(19, ours + Settings().streams.sink_nice)
    worker = worker_factory(catalogue)
    pub = EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, "test")
    pub.publish_batch(_releases("nice", 3))
    pub.close()
    poll(lambda: _raw_count(worker.reader, "nice") == 3, "rows stored", 90)  # the store engine's threads are running
    sink = json.loads(owner_file(worker.dsn).read_text())["pid"]
    threads = _nice_of_threads(sink)
    by_name: dict[str, set[int]] = {}
    for nice, name in threads.values():
        by_name.setdefault(name, set()).add(nice)
    # The interpreter's (the main thread's id is the pid), librdkafka's and the engine's working
    # threads (inserts, merges) — all but the engine's memory sampler, whose two threads ClickHouse
    # itself raises to -20 (it can as root: CI runs as root). Such a thread can be read before it
    # names itself, under the name of the thread that started it (Linux gives a new thread its
    # creator's name; seen on CI as a "BgSchPool" at -20 next to a "MemoryWorker" still at the
    # inherited niceness), so the check is by niceness: every thread at ours, or one of at most two
    # at ClickHouse's -20 — and the threads that do our work named and at ours.
    assert threads[sink][0] == lowered and {"rdk:main", "MergeMutate", "ThreadPool"} <= set(by_name), by_name
    # (the whole map as text: pytest's repr of it is cut, and a thread seen once on CI — "Move",
    # the engine's part-move pool — must say which niceness it had)
    listing = str(sorted(by_name.items()))
    assert {nice for nice, _name in threads.values()} <= {lowered, -20}, listing
    assert sum(1 for nice, _name in threads.values() if nice == -20) <= 2, listing
    assert all(by_name[name] == {lowered} for name in ("python3", "rdk:main", "MergeMutate", "ThreadPool") if name in by_name), listing
    assert {nice for nice, _name in _nice_of_threads(worker.service.proc.pid).values()} == {ours}
    page = _health(worker.url)
    assert page["sink"]["nice"] == lowered and page["sink"]["pid"] == sink, page["sink"]
    assert page["route"]["nice"] == ours, page["route"]


def test_a_killed_sink_is_restarted_and_a_killed_worker_takes_its_sink_along(kafka_bootstrap, catalogue, worker_factory):
    import os
    import signal

    worker = worker_factory(catalogue)
    first = json.loads(owner_file(worker.dsn).read_text())["pid"]
    assert first != worker.service.proc.pid and pid_running(first)
    os.kill(first, signal.SIGKILL)
    poll(lambda: (h := _health(worker.url)).get("sink", {}).get("restarts") == 1 and h["sink"]["answering"], "the sink restarted", 90)
    second = json.loads(owner_file(worker.dsn).read_text())["pid"]
    assert second != first and pid_running(second)
    pub = EventPublisher({"bootstrap.servers": kafka_bootstrap}, catalogue, "test")
    pub.publish_batch(_releases("again", 5))
    pub.close()
    reader = RemoteReader.from_owner(owner_file(worker.dsn))
    poll(lambda: _raw_count(reader, "again") == 5, "rows stored by the restarted sink", 90)

    worker.service.proc.kill()  # kill -9 of the worker
    worker.service.proc.wait(10)
    poll(lambda: not pid_running(second), "the orphaned sink to exit", 30)
