"""The mutation study: run the suite against every mutant and print the kill matrix.

    python -m tests.mutation_study [--profile ci-unshrunk] [--only NAME ...] [--jobs N]

Each op mutant (tests/mutants.py) runs the suite's agreement and relation tests for its op in its
dtype (``--ops``: ``-k op`` would also match the mutant's name, which begins with the op, and run every op); each model-level mutant (tests/forward_mutants.py) runs the full-forward tests, on a quantized
checkpoint the study writes for those that read its blocks (their dequantization is the bug); each serving
mutant (tests/serving_mutants.py, a session with one cache bug) runs the serving test in float32,
whose small baseline error lets no cache bug hide (in bfloat16 some stay under bf16's own); each
invariance mutant (tests/invariance_mutants.py, a batch-, chunk- or run-invariant engine with one bug
that breaks what it claims) runs the invariance tests in float32 (bf16 keys are no change in bf16).  Every run
stops at its first failure (pytest -x), so a mutant costs seconds.  The matrix lists each mutant,
the test that killed it and the time it took; the exit status is 1 if any mutant survived.  The runs
are independent processes, ``--jobs`` of them at once (default: one per core), each forked from this
one after it has imported the suite: importing it is most of what a fresh interpreter would spend on
a mutant.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

import gemma4_conformance.plugin  # noqa: F401 - imported once, before the forks
from gemma4_conformance.checkpoints import generate
from tests import forward_mutants, invariance_mutants, mutants, serving_mutants

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Run:
    mutant: str
    target: str  # the op, "forward", "serving" or "invariance"
    dtype: str
    backend: str
    selection: tuple[str, ...]


def runs(checkpoints: Path) -> list[Run]:
    """Every mutant's run; ``checkpoints``: the folder holding a quantized checkpoint per weight format
    (``write_checkpoints``), for the forward mutants that read one."""
    table = [Run(m.__name__, op, dtype, f"tests.mutants:ADAPTERS.{m.__name__}",
                 ("gemma4_conformance/properties/test_agreement.py", "gemma4_conformance/properties/test_relations.py",
                  f"--ops={op}"))
             for op, dtype, m in mutants.MUTANTS]
    table += [Run(m.name, "forward", "float32,bfloat16", f"tests.forward_mutants:ADAPTERS.{m.name}",
                  ("gemma4_conformance/properties/test_forward.py", "-k", "test_forward_matches_reference"))
              for m in forward_mutants.MUTANTS]
    table += [Run(m.name, "forward", "float32", f"tests.forward_mutants:ADAPTERS.{m.name}",
                  ("gemma4_conformance/properties/test_forward.py", "-k", "test_forward_matches_reference",
                   f"--weights={checkpoints / weight_format}"))
              for m, weight_format in forward_mutants.QUANTIZED]
    table += [Run(m.name, "serving", "float32", f"tests.serving_mutants:ADAPTERS.{m.name}",
                  ("gemma4_conformance/properties/test_serving.py",))
              for m in serving_mutants.MUTANTS]
    table += [Run(m.name, "invariance", "float32", f"tests.invariance_mutants:ADAPTERS.{m.name}",
                  ("gemma4_conformance/properties/test_invariance.py",))
              for m in invariance_mutants.MUTANTS]
    return table


def write_checkpoints(folder: Path, table: list[Run]) -> None:
    """The generated model written in each weight format a run of ``table`` reads, under ``folder``."""
    for weight_format in {f for m, f in forward_mutants.QUANTIZED if any(r.mutant == m.name for r in table)}:
        generate.write_checkpoint(folder / weight_format, generate.small_config(), weight_format=weight_format)


def start(run: Run, profile: str, folder: Path) -> int:
    """Fork a process that runs the suite against ``run``'s mutant, its output and JUnit XML in ``folder``;
    its pid.  No thread runs here, so the fork copies no lock another thread holds."""
    args = [*run.selection, f"--backend={run.backend}", f"--dtype={run.dtype}", f"--hypothesis-profile={profile}",
            "-x", "-q", "-p", "no:cacheprovider", "--report-html=", f"--junitxml={folder / 'junit.xml'}"]
    pid = os.fork()
    if pid == 0:  # the child: pytest's exit status, whatever happens
        status = 3
        try:
            output = os.open(folder / "output.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(output, 1)
            os.dup2(output, 2)
            os.chdir(ROOT)
            status = int(pytest.main(args))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    return pid


def verdict(folder: Path) -> tuple[list[str], str]:
    """The tests that failed for a mutant (the first, with -x), and pytest's last line (which says whether
    a survivor passed or the run broke)."""
    report = folder / "junit.xml"
    killers = []
    if report.exists():  # a failed test killed it; an error (the suite or the adapter broke) did not
        killers = [case.get("name") for case in ET.parse(report).iter("testcase") if case.find("failure") is not None]
    lines = (folder / "output.txt").read_text(errors="replace").strip().splitlines()
    return killers, (lines or [""])[-1]


def kills(table: list[Run], profile: str, jobs: int):
    """Each run's killers, seconds and last line, in the table's order as soon as it is known, ``jobs`` runs at
    a time."""
    with tempfile.TemporaryDirectory() as root:
        folders = [Path(root) / str(i) for i in range(len(table))]
        queue, running, done, given = iter(range(len(table))), {}, {}, 0
        while given < len(table):
            while len(running) < jobs and (i := next(queue, None)) is not None:
                folders[i].mkdir()
                running[start(table[i], profile, folders[i])] = (i, time.perf_counter())
            pid, _ = os.wait()
            i, began = running.pop(pid)
            done[i] = (*verdict(folders[i]), time.perf_counter() - began)
            while given in done:
                killers, last, seconds = done.pop(given)
                yield killers, seconds, last
                given += 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="ci-unshrunk",
                        help="Hypothesis profile (default: ci-unshrunk, the ci profile's examples without shrinking)")
    parser.add_argument("--only", nargs="*", help="mutant names to run (default: all)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="mutants run at once (default: cores)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as checkpoints:
        table = [r for r in runs(Path(checkpoints)) if not args.only or r.mutant in args.only]
        write_checkpoints(Path(checkpoints), table)
        return study(table, args)


def study(table: list[Run], args) -> int:
    """Run ``table``'s mutants, print the kill matrix; 1 if any survived."""
    width = max(len(r.mutant) for r in table)
    print(f"{'mutant':<{width}}  {'op':<14} {'dtype':<16} {'seconds':>7}  killed by")
    survivors, total = [], time.perf_counter()
    for run, (killers, seconds, last) in zip(table, kills(table, args.profile, max(args.jobs, 1))):
        said = ", ".join(killers) if killers else f"SURVIVED ({last})"
        print(f"{run.mutant:<{width}}  {run.target:<14} {run.dtype:<16} {seconds:>7.1f}  {said}", flush=True)
        if not killers:
            survivors.append(run.mutant)
    killed = len(table) - len(survivors)
    print(f"\nkill rate {killed}/{len(table)} = {killed / len(table):.0%} in the {args.profile} profile, "
          f"{time.perf_counter() - total:.0f} s" + (f"; survivors: {', '.join(survivors)}" if survivors else ""))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
