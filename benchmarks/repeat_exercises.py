"""Repeatable verdicts: every shipped scenario N times through the real pipeline.

    .venv/bin/python benchmarks/repeat_exercises.py --runs 10 [--scenario NAME ...] [--speed 120] [--bootstrap HOST:PORT]

Each run is ``gpuledger exercise`` (``gpuledger.exercise.run_exercise``: real collectors,
receiver and worker with its own chDB store, a fresh topic prefix) followed by two reads
of that store through the real CLI in a child process (chDB opens one data dir per
process): the violations table (latest versions, withdrawn ones skipped) and the
exercise's evidence table. A run's *signature* is both, normalised so that what a run
cannot repeat — wall-clock times, event and violation ids derived from them — does not
count: timestamps become ``<t>``, hex ids ``<id>``. Prints per scenario how many runs
produced the signature most runs produced (10/10 is the bar), and for the others what
differed. Exit 1 when a scenario is not N/N.

Not part of the test suite (minutes per run; ``tests/streams/controls/test_interleaving.py``
is the suite's fast proof). Without ``--bootstrap`` each run starts and stops its own
local broker. Every child is stopped by the exercise runner before the next run.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from rich.console import Console

from gpuledger.exercise import run_exercise
from gpuledger.settings import KafkaSettings, Settings
from gpuledger.sim.scenario import shipped_scenarios

TIMESTAMP = re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:Z|[+-]\d{2}:\d{2})?")
HEX_ID = re.compile(r"\b[0-9a-f]{12,64}\b")
VIOLATIONS_SQL = ("SELECT control_id, severity, release_id, workload_id, closed_at IS NULL AS open, detail FROM gpuledger.violations FINAL "
                  "WHERE NOT startsWith(detail, 'withdrawn:') ORDER BY control_id, detail")


def normalise(text: str) -> str:
    return HEX_ID.sub("<id>", TIMESTAMP.sub("<t>", str(text)))


def signature(run) -> dict:
    """The run's violation set and evidence table, normalised (module docstring)."""
    if not run.dsn:  # failed before the store existed
        return {"error": run.error, "violations": [], "evidence": []}
    env = {**os.environ, "GPULEDGER_CLICKHOUSE_DSN": run.dsn, "GPULEDGER_DATA_DIR": str(run.data_dir)}
    out = subprocess.run([sys.executable, "-m", "gpuledger.cli", "sql", "--format", "json", VIOLATIONS_SQL], env=env,
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"reading the violations of {run.data_dir} failed: {out.stderr or out.stdout}")
    rows = json.loads(out.stdout)
    rows = rows["rows"] if isinstance(rows, dict) else rows
    violations = sorted(normalise(json.dumps(r, sort_keys=True)) for r in rows)
    evidence = [normalise(f"{r.status} {r.name}: {r.detail}") for r in run.results]
    return {"error": run.error, "violations": violations, "evidence": evidence}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs per scenario")
    parser.add_argument("--scenario", action="append", help="scenario name (repeatable; default: every shipped one)")
    parser.add_argument("--speed", type=float, default=None, help="override each scenario's speed")
    parser.add_argument("--bootstrap", default=None, help="an existing Kafka broker (default: a local one per run)")
    args = parser.parse_args()
    names = args.scenario or sorted(shipped_scenarios())
    worst = True
    with tempfile.TemporaryDirectory(prefix="gpuledger-repeat-") as tmp:
        for name in names:
            sigs = []
            for i in range(args.runs):
                settings = Settings(data_dir=Path(tmp) / f"{name}-{i}", kafka=KafkaSettings(bootstrap=args.bootstrap))
                run = run_exercise(settings, name, Console(file=io.StringIO(), width=200), speed=args.speed)
                sigs.append(json.dumps(signature(run), sort_keys=True))
                print(f"  {name} run {i + 1}/{args.runs}: {len(json.loads(sigs[-1])['violations'])} violation(s), "
                      f"exit {run.exit_code}" + (f", error {run.error}" if run.error else ""), flush=True)
            common, count = Counter(sigs).most_common(1)[0]
            worst = worst and count == args.runs
            print(f"{name}: {count}/{args.runs} runs produced the identical violation set and evidence table", flush=True)
            for i, sig in enumerate(sigs):
                if sig != common:
                    want, got = json.loads(common), json.loads(sig)
                    for part in ("error", "violations", "evidence"):
                        if want[part] != got[part]:
                            print(f"    run {i + 1} {part}: expected {want[part]!r}\n    got {got[part]!r}")
    return 0 if worst else 1


if __name__ == "__main__":
    sys.exit(main())
