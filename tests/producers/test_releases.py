"""producers/releases.py: the real `gpuledger release …` CLI against a real broker.

Commands run through gpuledger.cli's typer app (CliRunner, in-process) and once through
the installed entry point (subprocess); events are read back from the release topic.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpuledger.cli import app
from gpuledger.dev.process import free_port
from producers.releases import COMMANDS, build_event
from schemas import decode_event
from tests.fixtures.kafka import read_topic

AT = "2026-05-04T09:00:00Z"
REGISTER = ["--release-id", "fraud-detector:7", "--model", "fraud-detector", "--version", "7",
            "--artifact-digest", "sha256:3f79bb7b435b05321651daefd374cdc681dc06faa65e374e38337b88ca046dea"]


@pytest.fixture
def cli(catalogue, kafka_bootstrap, tmp_path):
    """Run `gpuledger <args>` in-process with the test broker and topic prefix."""
    runner = CliRunner(env={"GPULEDGER_KAFKA_BOOTSTRAP": kafka_bootstrap, "GPULEDGER_KAFKA_TOPIC_PREFIX": catalogue.prefix,
                            "GPULEDGER_DATA_DIR": str(tmp_path / "data")})

    def run(*args: str):
        return runner.invoke(app, list(args))

    return run


def released(bootstrap: str, topic: str, count: int, timeout: float = 20.0) -> list:
    return [(m.key().decode(), decode_event(m.value())) for m in read_topic(bootstrap, topic, count, timeout, settle=0.5)]


def flat(text: str) -> str:
    return " ".join(text.split())


def test_register_publishes_and_prints_the_event_id(cli, catalogue, kafka_bootstrap):
    result = cli("release", "register", *REGISTER, "--image-digest", "sha256:b5d3", "--config-digest", "cfg-91",
                 "--dataset", "s3://fraud/2026-04", "--owner", "risk-ml", "--data-class", "pii", "--actor", "ci/pipeline-812",
                 "--tag", "git_sha=4e1f9a", "--at", AT)
    assert result.exit_code == 0, result.output
    event_id = result.stdout.strip()
    ((key, event),) = released(kafka_bootstrap, catalogue.release, 1)
    assert key == "fraud-detector:7"
    assert event.event_id == event_id
    assert event.event_type == "release.registered"
    ident = event.identity
    assert (ident.model_name, ident.model_version, ident.image_digest, ident.config_digest, ident.dataset_ref, ident.owner, ident.data_class) == (
        "fraud-detector", "7", "sha256:b5d3", "cfg-91", "s3://fraud/2026-04", "risk-ml", "pii")
    assert ident.artifact_digest.startswith("sha256:3f79")
    assert event.payload.actor == "ci/pipeline-812" and event.payload.tags == {"git_sha": "4e1f9a"}
    assert event.occurred_at.isoformat() == "2026-05-04T09:00:00+00:00"
    assert event.source.collector == "releases"


def test_every_command_publishes_its_event(cli, catalogue, kafka_bootstrap):
    rid = ["--release-id", "llm-7b:12"]
    admin = ["--actor", "oncall@example.com", "--expires-at", "2026-05-05T09:00:00Z", "--reason", "INC-77"]
    runs = {
        "register": [*REGISTER[2:], "--release-id", "llm-7b:12"],
        "evaluate": [*rid, "--tag", "auc=0.97"],
        "approve": [*rid, "--actor", "alice@example.com", "--approval-id", "CHG-1042"],
        "promote": [*rid, "--env", "prod", "--superseded", "llm-7b:11"],
        "rollback": [*rid, "--env", "prod", "--superseded", "llm-7b:11", "--reason", "latency regression"],
        "revoke": [*rid, "--reason", "licence withdrawn"],
        "retire": rid,
        "reserve": [*rid, "--reservation-id", "rsv-9", "--gpus", "16", "--pool", "h100-pool",
                    "--window-start", "2026-05-04T10:00:00Z", "--window-end", "2026-05-06T10:00:00Z"],
        "unreserve": [*rid, "--reservation-id", "rsv-9"],
        "pause-queue": [*rid, "--target", "cq-train", *admin],
        "isolate-node": [*rid, "--target", "gpu-node-a3", *admin],
        "override-priority": [*rid, "--target", "llm-train/llm-pretrain", *admin],
        "override-admission": [*rid, "--target", "llm-train/Job/llm-pretrain", *admin],
    }
    assert set(runs) == {c.name for c in COMMANDS}
    printed = {}
    for command in COMMANDS:
        result = cli("release", command.name, *runs[command.name], "--at", AT)
        assert result.exit_code == 0, (command.name, result.output)
        printed[result.stdout.strip()] = command.event_type
    events = {e.event_id: e for _, e in released(kafka_bootstrap, catalogue.release, len(COMMANDS))}
    assert {i: e.event_type for i, e in events.items()} == printed
    by_type = {e.event_type: e for e in events.values()}
    assert by_type["release.promoted"].payload.to_environment == "prod"
    assert by_type["release.promoted"].payload.superseded_release_id == "llm-7b:11"
    assert by_type["release.approved"].payload.approval_id == "CHG-1042"
    reservation = by_type["release.reservation_created"].payload.reservation
    assert (reservation.reservation_id, reservation.gpus, reservation.pool) == ("rsv-9", 16, "h100-pool")
    assert reservation.window_end.isoformat() == "2026-05-06T10:00:00+00:00"
    isolated = by_type["release.node_isolated"]
    assert isolated.payload.target == "gpu-node-a3" and isolated.identity.node == "gpu-node-a3"
    assert isolated.payload.actor == "oncall@example.com" and isolated.payload.expires_at is not None
    assert all(e.identity.release_id == "llm-7b:12" for e in events.values())


def test_retry_with_the_same_time_keeps_one_event_id(cli):
    args = ["release", "approve", "--release-id", "fraud-detector:7", "--actor", "alice", "--approval-id", "CHG-1", "--at", AT]
    first, second = cli(*args), cli(*args)
    assert first.exit_code == second.exit_code == 0
    assert first.stdout == second.stdout
    # Another event time is another fact (checked without a third publish).
    options = dict(release_id="fraud-detector:7", actor="alice", approval_id="CHG-1")
    approve = next(c for c in COMMANDS if c.name == "approve")
    assert build_event(approve, {**options, "at": AT}).event_id == first.stdout.strip()
    assert build_event(approve, {**options, "at": "2026-05-04T09:00:01Z"}).event_id != first.stdout.strip()
    # The one time grammar of every flag (gpuledger.timefmt): no zone means UTC, so the same instant keeps the id.
    naive = AT.removesuffix("Z").replace("T", " ")
    assert build_event(approve, {**options, "at": naive}).event_id == first.stdout.strip()


def test_the_same_decision_by_another_actor_at_the_same_time_is_another_event(cli, catalogue, kafka_bootstrap):
    """The documented pipeline gives every step one ``--at``: an approval by CI and alice's
    ratification of it had one id, and the tables kept only the first (control 7 never saw alice's)."""
    approve = ["release", "approve", "--release-id", "fraud-detector:7", "--approval-id", "CHG-1", "--at", AT]
    ci, alice, again = cli(*approve, "--actor", "ci/4711"), cli(*approve, "--actor", "alice"), cli(*approve, "--actor", "alice")
    relayed = cli(*approve, "--actor", "ci/4711", "--on-behalf-of", "alice")
    assert ci.exit_code == alice.exit_code == again.exit_code == relayed.exit_code == 0, (ci.output, relayed.output)
    assert alice.stdout == again.stdout  # a retry is the same fact
    ids = {ci.stdout.strip(), alice.stdout.strip(), relayed.stdout.strip()}
    assert len(ids) == 3
    stored = {e.event_id: (e.payload.actor, e.payload.on_behalf_of) for _, e in released(kafka_bootstrap, catalogue.release, 4)}
    assert set(stored) == ids
    assert sorted(stored.values(), key=str) == sorted([("ci/4711", None), ("alice", None), ("ci/4711", "alice")], key=str)


def test_a_release_id_typed_in_two_spellings_of_one_text_is_one_release_and_one_event(cli, catalogue, kafka_bootstrap):
    """`--release-id "$(printf 'cafe\\u0301:1')"` (a combining accent) and 'caf\\u00e9:1' were two
    releases — a trace of one matched nothing of the other (exploratory review): both are stored
    in NFC, and the same decision at the same time is one event id (a retry, not a second fact)."""
    nfd, nfc = "cafe\u0301:1", "caf\u00e9:1"
    approve = ["release", "approve", "--approval-id", "CHG-1", "--at", AT, "--actor", "jose\u0301"]
    first, second = cli(*approve, "--release-id", nfd), cli(*approve, "--release-id", nfc)
    assert first.exit_code == second.exit_code == 0, (first.output, second.output)
    assert first.stdout == second.stdout
    records = released(kafka_bootstrap, catalogue.release, 2)  # (both published: the tables keep one of an id)
    assert [(key, e.identity.release_id, e.payload.actor, e.event_id) for key, e in records] == \
        [(records[0][0], nfc, "jos\u00e9", first.stdout.strip())] * 2


@pytest.mark.parametrize(("args", "message"), [
    (["register", "--release-id", "r:1"], "release register needs --model, --version, --artifact-digest"),
    (["register"], "release register needs --release-id, --model, --version, --artifact-digest"),
    (["approve", "--release-id", "r:1"], "release approve needs --actor"),
    (["promote", "--release-id", "r:1"], "release promote needs --env"),
    (["reserve", "--release-id", "r:1", "--gpus", "4"], "release reserve needs --reservation-id"),
    (["isolate-node", "--release-id", "r:1"], "release isolate-node needs --target, --actor"),
    (["revoke", "--release-id", "r:1"], "release revoke needs --reason"),
    (["retire", "--release-id", "r:1", "--gpus", "4"], "--gpus do(es) not apply to release retire"),
    (["retire", "--release-id", "r:1", "--at", "yesterday"], "--at: not an RFC 3339 time"),
    (["retire", "--release-id", "r:1", "--at", "2026-05-04T09:00:00 CET"], "--at: not an RFC 3339 time"),
    (["retire", "--release-id", "r:1", "--tag", "novalue"], "--tag: expected KEY=VALUE"),
    (["reserve", "--release-id", "r:1", "--reservation-id", "x", "--gpus", "2", "--window-start", AT, "--window-end", AT],
     "--window-end must be after --window-start"),
    (["reserve", "--release-id", "r:1", "--reservation-id", "x", "--gpus", str(2**32)], "--gpus must be from 0 to 4,294,967,295"),
    (["reserve", "--release-id", "r:1", "--reservation-id", "x", "--gpus", "-1"], "--gpus must be from 0 to 4,294,967,295"),
    (["approve", "--release-id", "r:1", "--actor", "ci>alice"], "--actor: contains '>' at position 2"),
    (["approve", "--release-id", "r:1", "--actor", "ci", "--on-behalf-of", "x>alice"], "--on-behalf-of: contains '>'"),
    # a relay with nobody relaying: stored with a null actor it read "someone for alice" (exploratory review)
    (["promote", "--release-id", "r:1", "--env", "prod", "--on-behalf-of", "alice"], "--on-behalf-of names the person a service acts for: give the service as --actor"),
    # a value the schema refuses: the flag and why, not a pydantic traceback (exploratory review)
    (["approve", "--release-id", "bad\u202eid", "--actor", "alice"], "--release-id: contains U+202E (RIGHT-TO-LEFT OVERRIDE) at position 3"),
    (["promote", "--release-id", "r:1", "--actor", "alice", "--env", "pro\x01d"], "--env: contains U+0001"),
    # a year mistyped: the controls' watermark took it, and every deadline read as passed (exploratory review)
    (["retire", "--release-id", "r:1", "--actor", "bob", "--at", "2062-12-05T10:00:00Z"],
     "--at 2062-12-05T10:00:00Z is in the future (now "),
])
def test_missing_or_wrong_flags_exit_non_zero_naming_them(tmp_path, args, message):
    # Kafka points at a closed port: the command must fail on its flags, before any I/O.
    runner = CliRunner(env={"GPULEDGER_KAFKA_BOOTSTRAP": f"127.0.0.1:{free_port()}", "GPULEDGER_DATA_DIR": str(tmp_path)})
    result = runner.invoke(app, ["release", *args])
    assert result.exit_code == 2, result.output
    assert message in flat(result.stderr)
    assert result.stdout == ""


def test_nothing_is_published_for_rejected_commands(cli, catalogue, kafka_bootstrap):
    assert cli("release", "register", "--release-id", "r:1").exit_code == 2
    assert cli("release", "promote", "--release-id", "r:1").exit_code == 2
    assert read_topic(kafka_bootstrap, catalogue.release, 0, timeout=3, settle=1.0) == []


def test_unreachable_kafka_exits_non_zero(tmp_path):
    runner = CliRunner(env={"GPULEDGER_KAFKA_BOOTSTRAP": f"127.0.0.1:{free_port()}", "GPULEDGER_KAFKA_DELIVERY_TIMEOUT_S": "1",
                            "GPULEDGER_DATA_DIR": str(tmp_path)})
    result = runner.invoke(app, ["release", "retire", "--release-id", "r:1"])
    assert result.exit_code == 1
    assert "release retire for r:1 not published" in flat(result.stderr)


def test_topics_ensure_without_kafka_is_one_clear_error_not_a_traceback_or_a_flood(tmp_path):
    """Found by an exploratory review: with the broker down `gpuledger topics ensure` (and the worker,
    through the same ensure_specs) printed ~580 raw librdkafka lines to stderr, then a traceback —
    a crash-loop under Kubernetes. Now: Kafka's error in one line (librdkafka's own lines go through
    logging, a repeated one once with a count), exit 1."""
    exe = Path(sys.executable).parent / "gpuledger"
    bootstrap = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "GPULEDGER_KAFKA_BOOTSTRAP": bootstrap, "GPULEDGER_DATA_DIR": str(tmp_path)}
    proc = subprocess.run([str(exe), "topics", "ensure"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert f"error: Kafka at {bootstrap}:" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "%3|" not in proc.stderr and len(proc.stderr.splitlines()) < 20, proc.stderr[-3000:]


def test_installed_entry_point(catalogue, kafka_bootstrap, tmp_path):
    exe = Path(sys.executable).parent / "gpuledger"
    env = {**os.environ, "GPULEDGER_KAFKA_BOOTSTRAP": kafka_bootstrap, "GPULEDGER_KAFKA_TOPIC_PREFIX": catalogue.prefix,
           "GPULEDGER_DATA_DIR": str(tmp_path)}
    proc = subprocess.run([str(exe), "release", "promote", "--release-id", "fraud-detector:7", "--env", "staging", "--actor", "ci"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    ((key, event),) = released(kafka_bootstrap, catalogue.release, 1)
    assert event.event_id == proc.stdout.strip() and event.payload.to_environment == "staging"


ALICE = "tok-alice-" + "a" * 40


@pytest.fixture
def alice_receiver(catalogue, settings_for, tmp_path):
    """A real receiver whose credentials file knows alice (groups release-managers, oncall)."""
    import hashlib
    import json

    from producers._kafka import EventPublisher
    from producers.receiver.config import ReceiverSettings
    from tests.producers.receiver.test_server import RunningReceiver

    callers = tmp_path / "callers.yaml"
    callers.write_text(json.dumps({"callers": [{"identity": "user:alice", "groups": ["release-managers", "oncall"],
                                                "token_sha256": hashlib.sha256(ALICE.encode()).hexdigest()}]}))
    with RunningReceiver(ReceiverSettings(credentials_file=str(callers)), EventPublisher.from_settings(settings_for(catalogue), "receiver")) as rx:
        yield rx


def test_through_the_receiver_with_a_token_file_the_event_is_stored_as_the_token_s_identity(alice_receiver, catalogue, kafka_bootstrap, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(ALICE + "\n")
    runner = CliRunner(env={"GPULEDGER_KAFKA_BOOTSTRAP": f"127.0.0.1:{free_port()}",  # never used: the receiver publishes
                            "GPULEDGER_DATA_DIR": str(tmp_path / "data"), "GPULEDGER_RELEASE_RECEIVER_URL": alice_receiver.url,
                            "GPULEDGER_RELEASE_TOKEN_FILE": str(token_file)})
    # No --actor: the token names it. A forged id cannot be chosen either (the receiver computes it).
    result = runner.invoke(app, ["release", "approve", "--release-id", "fraud-detector:7", "--approval-id", "CHG-9", "--at", AT])
    assert result.exit_code == 0, result.output
    assert "(authenticated)" in flat(result.stderr) and "unauthenticated" not in result.stderr
    ((key, event),) = released(kafka_bootstrap, catalogue.release, 1)
    assert key == "fraud-detector:7" and event.event_id == result.stdout.strip()
    p = event.payload
    assert (p.actor, p.authenticated_by, p.actor_groups, p.approval_id) == ("user:alice", "token", ("release-managers", "oncall"), "CHG-9")
    # Another actor than the token's: refused by the receiver (403), exit 2, nothing published.
    other = runner.invoke(app, ["release", "approve", "--release-id", "fraud-detector:7", "--actor", "carol", "--at", AT])
    assert other.exit_code == 2 and "refused the event (403)" in flat(other.stderr) and "may not publish as 'carol'" in flat(other.stderr)
    # A wrong token: 401, exit 2, the token not echoed.
    token_file.write_text("tok-wrong-" + "w" * 40)
    wrong = runner.invoke(app, ["release", "retire", "--release-id", "fraud-detector:7"])
    assert wrong.exit_code == 2 and "refused the event (401)" in flat(wrong.stderr) and "tok-wrong" not in wrong.output
    assert len(read_topic(kafka_bootstrap, catalogue.release, 1, timeout=3, settle=1.0)) == 1


def test_straight_to_kafka_a_decision_is_unauthenticated_and_says_so(cli, catalogue, kafka_bootstrap):
    result = cli("release", "approve", "--release-id", "fraud-detector:7", "--actor", "alice", "--at", AT)
    assert result.exit_code == 0, result.output
    assert "published straight to Kafka, so unauthenticated" in flat(result.stderr)
    ((_, event),) = released(kafka_bootstrap, catalogue.release, 1)
    assert event.payload.actor == "alice" and event.payload.authenticated_by is None and event.payload.actor_groups == ()


@pytest.mark.parametrize(("env", "message"), [
    ({"GPULEDGER_RELEASE_RECEIVER_URL": "http://127.0.0.1:9"}, "GPULEDGER_RELEASE_RECEIVER_URL needs GPULEDGER_RELEASE_TOKEN_FILE"),
    ({"GPULEDGER_RELEASE_TOKEN": "x"}, "a token proves nothing to Kafka"),
    ({"GPULEDGER_RELEASE_RECEIVER_URL": "gpuledger:9095", "GPULEDGER_RELEASE_TOKEN": "x"}, "expected http(s)://host:port"),
])
def test_sender_settings_that_cannot_prove_anything_exit_2(tmp_path, env, message):
    runner = CliRunner(env={"GPULEDGER_KAFKA_BOOTSTRAP": f"127.0.0.1:{free_port()}", "GPULEDGER_DATA_DIR": str(tmp_path), **env})
    result = runner.invoke(app, ["release", "retire", "--release-id", "r:1"])
    assert result.exit_code == 2 and message in flat(result.stderr), result.output


def test_an_unreachable_receiver_exits_1(tmp_path):
    runner = CliRunner(env={"GPULEDGER_DATA_DIR": str(tmp_path), "GPULEDGER_RELEASE_RECEIVER_URL": f"http://127.0.0.1:{free_port()}",
                            "GPULEDGER_RELEASE_TOKEN": ALICE})
    result = runner.invoke(app, ["release", "retire", "--release-id", "r:1"])
    assert result.exit_code == 1 and "release retire for r:1 not published" in flat(result.stderr) and ALICE not in result.output
