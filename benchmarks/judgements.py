"""The judge on the very inputs a job drew: record every judgement (``judging.assess``) a run makes,
replay them with any checkout of the suite, and compare the verdicts.  A tool, not a timed test.

    python -m benchmarks.judgements record calls.pkl -- --backend=torch --hypothesis-seed=1
    python -m benchmarks.judgements replay calls.pkl --verdicts after.json
    PYTHONPATH=<other checkout> python -m benchmarks.judgements replay calls.pkl --verdicts before.json
    python -m benchmarks.judgements compare before.json after.json

``record`` runs pytest in this process with the arguments after ``--`` and pickles each call's
arguments and the backend's output (the torch main job's 4212 judgements take 1.4 GB: its real-size
examples).  ``replay`` judges them again, one after another, and prints the CPU seconds per op and
dtype; ``--verdicts`` keeps each verdict as the report prints it (pass, error and budget to four
digits, the trivial answers admitted, the first failure) and its error in full.  ``compare`` counts
the verdicts that differ between two replays, and how far the unprinted digits of the errors moved.
The split of a whole job is ``benchmarks.split``'s.
"""

from __future__ import annotations

import argparse
import inspect
import json
import pickle
import sys
import time
from collections import defaultdict

import pytest


class Recorder:
    """A pytest plugin that keeps the arguments of every ``judging.assess`` call."""

    def __init__(self):
        from gemma4_conformance.properties import judging

        self.calls, self.judging, self.assess = [], judging, judging.assess
        signature = inspect.signature(judging.assess)

        def recorded(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()  # every argument by position: (op, args, out, dtype, ...)
            self.calls.append(bound.args)
            return self.assess(*args, **kwargs)

        judging.assess = recorded

    def pytest_unconfigure(self):
        self.judging.assess = self.assess


def record(path: str, pytest_args: list[str]) -> int:
    recorder = Recorder()
    status = pytest.main(pytest_args, plugins=[recorder])
    with open(path, "wb") as f:
        pickle.dump(recorder.calls, f, protocol=pickle.HIGHEST_PROTOCOL)
    print(f"{len(recorder.calls)} judgements recorded in {path}")
    return int(status)


def replay(path: str, ops: set[str] | None, dtypes: set[str] | None, verdicts: str | None) -> None:
    from gemma4_conformance.properties.judging import assess, printed

    with open(path, "rb") as f:
        calls = [c for c in pickle.load(f) if (ops is None or c[0] in ops) and (dtypes is None or c[3] in dtypes)]
    if calls:
        assess(*calls[0])  # once untimed: loading compiled code
    seconds, counts, rows = defaultdict(float), defaultdict(int), []
    start = time.process_time()
    for call in calls:
        before = time.process_time()
        verdict = assess(*call)
        seconds[call[0], call[3]] += time.process_time() - before
        counts[call[0], call[3]] += 1
        error, budget = verdict.worst
        rows.append({"op": call[0], "dtype": call[3], "passed": verdict.passed, "error": printed(error),
                     "budget": printed(budget), "admitted": verdict.admitted, "failure": verdict.failures[:1],
                     "full_error": float(error)})
    total = time.process_time() - start
    if verdicts:
        with open(verdicts, "w") as f:
            json.dump(rows, f)
    print(f"{len(calls)} judgements in {total:.2f} CPU s")
    for key in sorted(seconds, key=seconds.get, reverse=True):
        print(f"  {key[0]:<15} {key[1]:<9} {seconds[key]:>7.2f} s  {counts[key]:>5} calls  "
              f"{1e3 * seconds[key] / counts[key]:>8.2f} ms a call")


def compare(before: str, after: str) -> int:
    with open(before) as f, open(after) as g:
        a, b = json.load(f), json.load(g)
    if len(a) != len(b):
        print(f"{len(a)} and {len(b)} verdicts: not replays of the same recording")
        return 1
    keys = ("op", "dtype", "passed", "error", "budget", "admitted", "failure")
    differ = [(x, y) for x, y in zip(a, b) if any(x[k] != y[k] for k in keys)]
    drift = max((abs(x["full_error"] - y["full_error"]) / abs(x["full_error"]) for x, y in zip(a, b)
                 if x["full_error"] not in (0, y["full_error"])), default=0.0)
    for x, y in differ[:10]:
        print(f"  {x['op']} {x['dtype']}: {({k: x[k] for k in keys})} -> {({k: y[k] for k in keys})}")
    print(f"{len(a)} verdicts, {len(differ)} differ as printed; the errors' unprinted digits moved by at most "
          f"{drift:.2g} of themselves")
    return 1 if differ else 0


def main() -> int:
    argv = sys.argv[1:]
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.judgements", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("record").add_argument("calls")
    play = sub.add_parser("replay")
    play.add_argument("calls")
    play.add_argument("--ops", help="these ops only (comma-separated)")
    play.add_argument("--dtypes", help="these dtypes only (comma-separated)")
    play.add_argument("--verdicts", help="write the verdicts here (for compare)")
    both = sub.add_parser("compare")
    both.add_argument("before")
    both.add_argument("after")
    args = parser.parse_args(argv)
    if args.command == "record":
        return record(args.calls, pytest_args)
    if args.command == "replay":
        replay(args.calls, set(args.ops.split(",")) if args.ops else None,
               set(args.dtypes.split(",")) if args.dtypes else None, args.verdicts)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
