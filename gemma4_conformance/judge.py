"""The plugin's trace-file options: judge recorded runs (``--judge-traces``), record them (``--record-traces``).

    pytest --judge-traces=run.safetensors --weights=CKPT      judge a trace file (or a folder of them)
    pytest -n 8 --judge-traces=traces/ --weights=CKPT          many files, spread over xdist workers
    pytest --backend=torch --record-traces=traces/             any forward run also writes its trace file
    gemma4-conformance judge traces/*.safetensors --weights=CKPT   the same judging as a command

Judging runs only the suite's recorded-run tests (properties/test_recorded.py), two per file (its
nodes, its forward), so the report, known deviations and exit codes are the plugin's: 0 conformant,
1 not, 6 a broken file (every breach named with its file and node; a file that is not a trace file at
all is one line and judges nothing), 4 a usage error.  A file is
labelled in the report ``ENGINE (FILE NAME)``; a known-deviations entry takes the engine's name.
Registered by plugin.py; its hooks touch only the suite's tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from gemma4_conformance import tracefile
from gemma4_conformance.checkpoints import checkpoint
from gemma4_conformance.report.record import Problem

RECORDED = ("trace_file", "forward_file")  # the recorded-run tests' parameters


@dataclass(frozen=True)
class RecordedFile:
    """A trace file to judge, as collection sees it: the engine and dtype its metadata names, or why it
    is no trace file (``unreadable``: its tests are not collected; the run is broken, exit 6)."""

    path: str
    engine: str
    dtype: str
    unreadable: str = ""

    @property
    def label(self) -> str:
        return f"{self.engine} ({Path(self.path).name})"


def pytest_addoption(parser):
    group = parser.getgroup("gemma4-conformance")
    group.addoption("--judge-traces", action="append", default=[], metavar="FILE",
                    help="judge recorded trace files (docs/trace-file.md) against --weights instead of running a "
                         "backend: each node and the forward, as the trace and forward tests do; a folder means "
                         "its *.safetensors. Repeat for more.")
    group.addoption("--record-traces", default=None, metavar="DIR",
                    help="write each backend's forward run (its trace, logits and layer outputs) as a trace file "
                         "in DIR, to be judged anywhere with --judge-traces or gemma4-conformance judge")


@pytest.hookimpl(trylast=True)  # after the plugin's: it loads the --backend adapters, which judging does not run
def pytest_configure(config):
    config.conformance_recorded = []
    given = config.getoption("--judge-traces")
    if not given:
        return
    config.conformance_backends = {}  # no backend is under test: the report lists none
    weights = config.getoption("--weights")
    if weights is None:
        raise pytest.UsageError("--judge-traces needs --weights: the checkpoint the traces were recorded on")
    try:
        checkpoint.load(weights)
    except checkpoint.CheckpointError as e:
        raise pytest.UsageError(f"--weights: {e}") from None
    files = []
    for value in given:
        path = Path(value)
        if path.is_dir():
            found = sorted(path.glob("*.safetensors"))
            if not found:
                raise pytest.UsageError(f"--judge-traces: the folder {path} holds no *.safetensors file")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise pytest.UsageError(f"--judge-traces: {path} is neither a file nor a folder")
    described = [_described(path) for path in files]
    config.conformance_recorded = [f for f in described if not f.unreadable]
    if not hasattr(config, "workerinput"):  # the controller's: xdist workers would say it once each
        config.conformance_recorder.problems += [Problem("trace file", "read", f.unreadable) for f in described
                                                 if f.unreadable]


def _described(path: Path) -> RecordedFile:
    try:
        meta = tracefile.read(path).metadata
    except tracefile.TraceFileError as e:
        return RecordedFile(str(path), "?", "?", str(e))
    return RecordedFile(str(path), meta.get("engine", "?"), meta.get("dtype", "?"))


RECORDED_TESTS = Path(__file__).resolve().parent / "properties" / "test_recorded.py"


def pytest_ignore_collect(collection_path, config):
    """The recorded-run tests exist only when there are files to judge."""
    if not config.getoption("--judge-traces") and Path(collection_path).resolve() == RECORDED_TESTS:
        return True
    return None


def pytest_generate_tests(metafunc):
    for name in RECORDED:
        if name in metafunc.fixturenames:
            files = metafunc.config.conformance_recorded
            metafunc.parametrize(name, files, ids=[f"{f.label}-{f.dtype}" for f in files])


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Judging files runs only the recorded-run tests (before the plugin counts and marks the suite's)."""
    if not config.getoption("--judge-traces"):
        return
    # (with no readable file, a recorded-run test's parameter is pytest's empty-set marker: left out too)
    other = [item for item in items if getattr(item, "module", None) is not None
             and item.module.__name__.startswith("gemma4_conformance.")
             and not any(isinstance(value, RecordedFile)
                         for value in getattr(getattr(item, "callspec", None), "params", {}).values())]
    if other:
        config.hook.pytest_deselected(items=other)
        items[:] = [item for item in items if item not in other]
