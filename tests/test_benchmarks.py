"""The benchmark (benchmarks/split.py) on a tiny configuration, so that it keeps working: every
oracle's throughput, a main job's time split and what its oracle checked (two ops' examples and a
trace), and the before/after table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.split import CATEGORY_TITLES, ELEMENTWISE, THROUGHPUT

ROOT = Path(__file__).resolve().parent.parent


def test_the_split_benchmark_measures_oracles_and_a_main_job_and_compares_two_runs(tmp_path):
    out = tmp_path / "run.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.split", "--backend=numpy", "--profile=ci", "--min-seconds=0",
         "--max-work=1", f"--json={out}", "--", "--dtype=float32", "-k",
         "test_matches_oracle and (-rms] or -sigmoid]) or test_trace_nodes_match_their_ops",
         f"--report-html={tmp_path / 'report.html'}"],
        cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = json.loads(out.read_text())
    assert [row["label"] for row in run["oracles"]] == [label for label, *_ in THROUGHPUT]
    assert all(row["rate"] > 0 for row in run["oracles"])
    [job] = run["jobs"]
    assert job["exit"] == 0 and abs(sum(job["seconds"].values()) - job["wall"]) < 1e-6 * job["wall"] + 1e-3
    # the first stage decides most elements, so the oracle's own time may be none
    assert job["seconds"]["judge"] > 0 and job["seconds"]["backend"] > 0 and job["seconds"]["report"] > 0
    coverage = {(r["backend"], r["op"]): r for r in job["coverage"]}
    assert set(coverage) == {("numpy", "rms"), ("numpy", "sigmoid")}
    assert all(r["examples"] > 0 and r["checked"] == r["outputs"] > 0 for r in coverage.values())
    assert all(0 <= r["by_oracle"] for r in coverage.values())
    # the trace's node calls are its own, not the ops' examples nor the certification's
    assert job["traced"]["calls"] > 0 and 0 < job["traced"]["checked"] <= job["traced"]["outputs"]  # a sample a node
    assert job["certified"]["calls"] == 0 and job["seconds"]["trace"] > 0
    for title in CATEGORY_TITLES.values():
        assert title in done.stdout
    compared = subprocess.run([sys.executable, "-m", "benchmarks.split", "--compare", str(out), str(out)],
                              cwd=ROOT, capture_output=True, text=True)
    assert compared.returncode == 0 and "rms H=3840" in compared.stdout and "wall time" in compared.stdout


def test_the_judging_benchmark_rates_every_op(tmp_path):
    """--judging-only: oracle plus judging per op and dtype, in output elements a second, with the share
    the oracle itself judged."""
    out = tmp_path / "judging.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.split", "--judging-only", "--dtype=bfloat16",
                           "--min-seconds=0", "--max-work=1", f"--json={out}"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["judging"]
    assert [row["label"] for row in rows] == [label for label, *_ in THROUGHPUT + ELEMENTWISE]
    assert all(row["elements_rate"] > 0 and 0 <= row["by_oracle"] <= 1 for row in rows)


def test_judgements_are_recorded_replayed_and_compared(tmp_path):
    """benchmarks/judgements.py: a tiny run's judgements, replayed twice to the same verdicts; a verdict
    changed by hand is counted."""
    calls, first, second = tmp_path / "calls.pkl", tmp_path / "first.json", tmp_path / "second.json"

    def run(*args):
        return subprocess.run([sys.executable, "-m", "benchmarks.judgements", *args], cwd=ROOT, capture_output=True,
                              text=True)

    done = run("record", str(calls), "--", "-p", "gemma4_conformance.plugin", "--pyargs",
               "gemma4_conformance.properties.test_agreement", "--backend=numpy", "--hypothesis-profile=ci",
               "--dtype=float32", "-k", "float32-sigmoid]", "-p", "no:cacheprovider", f"--report-html={tmp_path / 'r.html'}",
               f"--report-json={tmp_path / 'r.json'}")
    assert done.returncode == 0 and "judgements recorded" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    for out in (first, second):
        done = run("replay", str(calls), f"--verdicts={out}")
        assert done.returncode == 0 and "sigmoid" in done.stdout, done.stderr[-3000:]
    rows = json.loads(first.read_text())
    assert rows and all(row["op"] == "sigmoid" and row["passed"] for row in rows)
    done = run("compare", str(first), str(second))
    assert done.returncode == 0 and ", 0 differ as printed" in done.stdout
    rows[0]["passed"] = False
    second.write_text(json.dumps(rows))
    done = run("compare", str(first), str(second))
    assert done.returncode == 1 and ", 1 differ as printed" in done.stdout
