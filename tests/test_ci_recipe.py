"""The README's CI recipe, followed literally in a fresh virtual environment with the example engine.

examples/engine/ stands in for an engine's repository: its own packages are called `spec` and
`adapters`, its conftest adds an option of its own, and its adapter is registered by entry point.
The recipe's block is read from the README and run as written; only GEMMA4_CONFORMANCE (where the
suite is kept: this checkout) and PYTEST_ADDOPTS (the short `ci` profile) come from outside. It
installs from the package registry, so it takes about a minute.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARKER = "<!-- ci-recipe"


def recipe() -> str:
    """The bash block that follows the ci-recipe marker in the README."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    after = text[text.index(MARKER):]
    return re.search(r"```bash\n(.*?)```", after, re.DOTALL).group(1)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A copy of the example engine and a fresh venv in which the recipe ran: (folder, run, its result)."""
    base = tmp_path_factory.mktemp("ci-recipe")
    folder = base / "engine"
    shutil.copytree(ROOT / "examples" / "engine", folder)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTEST_ADDOPTS")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}", VIRTUAL_ENV=str(venv),
               GEMMA4_CONFORMANCE=ROOT.as_uri(), PYTEST_ADDOPTS="--hypothesis-profile=ci -p no:cacheprovider")

    def run(script: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-e", "-c", script], cwd=folder, env=env, capture_output=True, text=True)

    done = run(recipe())
    return folder, run, done


def gate_command() -> str:
    """The recipe's pytest command alone (the install is done), without the suite's certification of its
    own reference (2.5 minutes, the same as in the recipe's first run, and beside the point of a gate's
    exit status)."""
    return recipe().split("\n", 1)[1].rstrip() + " -k 'not test_reference_is_certified_by_the_oracle'"


def report(folder: Path) -> dict:
    return json.loads((folder / "conformance-report" / "report.json").read_text())


def test_the_recipe_passes_with_its_known_deviation(engine):
    folder, _, done = engine
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    doc = report(folder)
    outcomes = {r["op"]: r["outcome"] for r in doc["results"]}
    assert outcomes["sigmoid"] == outcomes["rmsnorm"] == outcomes["linear"] == "passed"
    assert outcomes["softcap"] == "known deviation"
    assert [d["status"] for d in doc["deviations"]] == ["excused"]
    assert (folder / "conformance-report" / "report.html").stat().st_size > 0
    cases = list(ET.parse(folder / "conformance-report" / "junit.xml").iter("testcase"))
    assert any("toyengine-float32-sigmoid" in c.get("name") for c in cases)
    assert "conformance exit status 0" in done.stdout


def test_the_engine_keeps_its_own_spec_adapters_and_test_runs(engine):
    folder, run, done = engine
    assert done.returncode == 0
    own = run("pytest -q tests")  # the engine's own tests: the suite's plugin stays out of them
    assert own.returncode == 0 and "conformance" not in own.stdout, own.stdout
    assert run("pytest -q tests --backend=numpy").returncode == 4  # no --backend without -p
    where = run('python -c "import spec, adapters; print(spec.__file__, adapters.__file__)"')
    assert where.stdout.split() == [str(folder / "spec" / "__init__.py"), str(folder / "adapters" / "__init__.py")]


def test_an_unlisted_failure_fails_the_gate(engine):
    folder, run, done = engine
    assert done.returncode == 0
    (folder / "conformance" / "deviations.yaml").write_text("backend: toyengine\ndeviations: []\n")
    gate = run(gate_command())
    assert gate.returncode == 1, gate.stdout[-4000:]
    assert {r["op"]: r["outcome"] for r in report(folder)["results"]}["softcap"] == "failed"


def test_a_broken_adapter_is_told_apart_and_the_report_still_written(engine):
    folder, run, done = engine
    assert done.returncode == 0
    kernels = folder / "toyengine" / "kernels.py"  # installed editable: the edit is live
    kernels.write_text(kernels.read_text().replace("    return 1 / (1 + np.exp(-x))",
                                                   "    return (1 / (1 + np.exp(-x))).astype(np.float64)"))
    gate = run(gate_command())
    assert gate.returncode == 6, gate.stdout[-4000:]
    doc = report(folder)
    outcomes = {r["op"]: r["outcome"] for r in doc["results"]}
    assert outcomes["sigmoid"] == "errored" and outcomes["rmsnorm"] == "passed"
    assert any("sigmoid" in p["test"] and "dtype float64" in p["message"] for p in doc["problems"])
