"""The pytest plugin: which backend and dtypes to test, known deviations, exit codes, and the report.

Installing the suite registers nothing with pytest: this plugin is on in the suite's repository (its
root conftest.py) and is asked for by name anywhere else, so an engine's other test runs never see it:

    pytest -p gemma4_conformance.plugin --pyargs gemma4_conformance --backend=myengine

Its hooks touch only the suite's own tests, even in a run that collects others too.  Its options, the
summary and the exit codes (EXIT_CODES below): docs/running.md and the README.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

import pytest
import threadpoolctl
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import InvalidArgument

from gemma4_conformance import adapters, report
from gemma4_conformance.adapters import DTYPES, AdapterError, DeviceError, numpy_backend
from gemma4_conformance.checkpoints import checkpoint, generate
from gemma4_conformance.checkpoints.checkpoint import CheckpointError
from gemma4_conformance.checkpoints.config import ConfigError
from gemma4_conformance.properties import serving
from gemma4_conformance.properties.deviations import (
    Deviations,
    DeviationsError,
    subject,
)
from gemma4_conformance.properties.invariance import broken_claims
from gemma4_conformance.properties.relations import RELATIONS
from gemma4_conformance.properties.table import build
from gemma4_conformance.report.record import Problem, Recorder, UnsupportedSkip
from gemma4_conformance.spec import OP_NAMES

# OpenMP's threads (torch's and its MKL's) spin while they wait for work, by default: on cores that other
# processes share they burn what those need (docs/performance.md).  Waiting passively changes no result.
# Set before a backend loads its OpenMP runtime, which reads it once; a value already set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Its trace-file options (--judge-traces, --record-traces) and their hooks live in their own module.
pytest_plugins = ("gemma4_conformance.judge",)

EXIT_CONFORMANT = 0
EXIT_NOT_CONFORMANT = 1  # pytest's TESTS_FAILED: every failure is an error beyond its budget
EXIT_BROKEN = 6  # an adapter raised or broke the contract, a test errored or a report was lost: incomplete
EXIT_CODES = {
    EXIT_CONFORMANT: "conformant: every test passed or is a listed known deviation",
    EXIT_NOT_CONFORMANT: "not conformant: a result is beyond its budget, breaks a theorem of the spec or breaks an "
                         "invariance the engine claims",
    2: "interrupted (pytest)",
    3: "internal error (pytest)",
    4: "usage error: a bad option, backend, dtype or known-deviations file (pytest)",
    5: "no tests were collected (pytest)",
    EXIT_BROKEN: "broken: an adapter raised or broke the contract, the suite errored, or a report could not be "
                 "written; fix that first",
}

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", derandomize=True, max_examples=12, print_blob=True, **_common)
settings.register_profile("default", max_examples=40, print_blob=True, **_common)
settings.register_profile("thorough", max_examples=400, print_blob=True, **_common)
# The mutation study's: the ci profile's examples, not shrunk (one failing example kills a mutant; the
# smallest one is for a person reading the failure, and shrinking took most of a kill's time).
settings.register_profile("ci-unshrunk", parent=settings.get_profile("ci"),
                          phases=[p for p in Phase if p not in (Phase.shrink, Phase.explain)])
settings.load_profile("default")


def pytest_addoption(parser):
    group = parser.getgroup("gemma4-conformance")
    group.addoption("--backend", default="numpy",
                    help="backend(s) to test, comma-separated: numpy, torch, jax, an entry-point name, "
                         "module:attribute, or all (every installed built-in). Default: numpy.")
    group.addoption("--device", default="cpu",
                    help="where backends that take a device run their ops and forward: cpu, cuda, cuda:N or mps "
                         "for torch's, gpu or gpu:N (cuda is the same) for JAX's; a backend's own [device=...] "
                         "wins. The numpy backend always runs on the CPU. Default: cpu.")
    group.addoption("--dtype", default=",".join(DTYPES),
                    help=f"dtypes to test, comma-separated, among {', '.join(DTYPES)}. Default: all.")
    group.addoption("--ops", default=None,
                    help="the op tests (oracle agreement and the spec's theorems) only for these ops, "
                         "comma-separated; a theorem runs if it relates a listed op. The forward, trace and "
                         "serving tests are not affected (-k deselects them). Default: every op.")
    group.addoption("--case", default=None,
                    help="rerun one case (the JSON printed by a failure) instead of drawing examples")
    group.addoption("--known-deviations", action="append", default=[], metavar="FILE",
                    help="a YAML file of a backend's accepted deviations (backend; op, dtype, reason per "
                         "entry): those tests still run and are reported, but do not fail the run. "
                         "A name instead of a file takes the one the suite ships for that engine "
                         "(gemma4_conformance/deviations/NAME.yaml). Repeat for several backends.")
    group.addoption("--report-html", default="reports/conformance.html",
                    help="where to write the HTML tolerance report (default: reports/conformance.html; "
                         "'' for none)")
    group.addoption("--report-json", default=None,
                    help="also write the run's results as JSON (versioned schema; docs/report.md, from report/schema.py)")
    group.addoption("--weights", default=None,
                    help="a Gemma 4 checkpoint folder (config.json and safetensors) for the full forward; "
                         "default: a checkpoint the suite generates in the real layout")


def _backend_specs(option: str) -> list[str]:
    """The comma-separated specs of ``--backend`` (a comma inside a spec's [options] separates options)."""
    specs, depth, current = [], 0, ""
    for char in option + ",":
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            spec = current.strip()
            specs.extend(adapters.available_builtins() if spec == "all" else [spec] if spec else [])
            current = ""
        else:
            current += char
    if depth or not specs:
        raise pytest.UsageError(f"--backend: {'unbalanced brackets in' if depth else 'no backend in'} {option!r}; expected "
                                f"names, comma-separated, each with options in one trailing bracket: name[key=value,...]")
    return specs


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """A profile Hypothesis does not know is a usage error here, before Hypothesis's own plugin fails on it
    with a traceback as it configures."""
    profile = config.getoption("hypothesis_profile", None)
    if profile is not None:
        try:
            settings.get_profile(profile)
        except InvalidArgument:
            raise pytest.UsageError(f"--hypothesis-profile: unknown {profile!r}; the suite's profiles are ci, default "
                                    f"and thorough (and ci-unshrunk, the mutation study's)") from None


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: the real 12B geometry (about 5 minutes, 24 GB of disk); "
                                       "run with -m slow")
    config.conformance_recorder = Recorder()
    config.conformance_reports = []  # (line, written) per report: where it was written, or why it was not
    dtypes = [d.strip() for d in config.getoption("--dtype").split(",") if d.strip()]
    unknown = sorted(set(dtypes) - set(DTYPES))
    if unknown or not dtypes:
        raise pytest.UsageError(f"--dtype: {f'unknown {unknown}' if unknown else 'none given'}; choose among "
                                f"{', '.join(DTYPES)}")
    config.conformance_dtypes = dtypes
    ops = config.getoption("--ops")
    ops = OP_NAMES if ops is None else tuple(o.strip() for o in ops.split(",") if o.strip())
    unknown = sorted(set(ops) - set(OP_NAMES))
    if unknown or not ops:
        raise pytest.UsageError(f"--ops: {f'unknown {unknown}' if unknown else 'none given'}; the ops are {', '.join(OP_NAMES)}")
    config.conformance_ops = ops
    loaded = {}
    for spec in _backend_specs(config.getoption("--backend")):
        try:
            loaded[spec] = adapters.load(spec, device=config.getoption("--device"))
        except DeviceError as e:
            raise pytest.UsageError(f"--device: {e}") from None
        except AdapterError as e:
            raise pytest.UsageError(f"--backend: {e}") from None
    names = [adapter.name for adapter in loaded.values()]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # results, reports and deviations are keyed by the adapter's name
        raise pytest.UsageError(f"--backend: several backends are named {', '.join(map(repr, twice))}; "
                                f"each adapter of a run needs its own name")
    config.conformance_backends = loaded
    config.conformance_threads = _share_threads(config)
    try:
        config.conformance_deviations = Deviations.load(config.getoption("--known-deviations"))
    except DeviationsError as e:
        raise pytest.UsageError(f"--known-deviations: {e}") from None
    check_options(config)


def check_options(config) -> None:
    """What the options above do not check as they are read: --case, --weights and the report paths.
    A bad value is a usage error (exit 4) naming the option, before any test runs; never a traceback."""
    text = config.getoption("--case")
    config.conformance_case = None
    if text is not None:
        try:
            config.conformance_case = json.loads(text)
        except json.JSONDecodeError as e:
            raise pytest.UsageError(f"--case is not valid JSON ({e}); expected the JSON object a failure printed "
                                    f"after --case=") from None
        if not isinstance(config.conformance_case, dict):
            raise pytest.UsageError(f"--case: expected the JSON object a failure printed after --case=, got "
                                    f"{type(config.conformance_case).__name__} {text[:80]!r}")
    weights = config.getoption("--weights")
    if weights is not None:
        try:
            checkpoint.load(weights)  # the config and the safetensors headers: no tensor is read
        except (CheckpointError, ConfigError) as e:
            raise pytest.UsageError(f"--weights: {e}") from None
    for option in ("--report-html", "--report-json"):
        path = config.getoption(option)
        if path and Path(path).is_dir():
            raise pytest.UsageError(f"--{option[2:]}: {path} is a folder; expected the path of the file to write")


def check_case_fits(config, items) -> None:
    """Each collected test that takes --case can build its inputs from it, so a case of another test or
    a truncated one is a usage error before any test runs, not a KeyError in the middle of the run."""
    case = config.conformance_case
    for item in items:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        try:
            if "op" in params:
                build(params["op"], case, params["dtype"])
            elif "relation" in params:
                # The theorem checked on the suite's numpy backend, which holds every theorem: what a case
                # lacks (a key the theorem reads beside the op's arguments) shows as an exception here.
                RELATIONS[params["relation"]].check(numpy_backend, case, params["dtype"])
            elif "serving_dtype" in params:
                serving.validate(case, generate.small_config()["sliding_window"])
        except Exception as e:  # noqa: BLE001 - whatever the malformed case broke, the user is told
            what = ("a serving schedule" if "serving_dtype" in params else
                    f"a case of {params.get('op') or ' or '.join(RELATIONS[params['relation']].ops)}")
            raise pytest.UsageError(f"--case does not fit {item.nodeid}: expected {what} as a failure of that test "
                                    f"printed it ({type(e).__name__}: {e})") from None


def backend_dtypes(config):
    """(backend spec, adapter, dtype) for every backend under test and every dtype both allow."""
    for spec, adapter in config.conformance_backends.items():
        for dtype in config.conformance_dtypes:
            if dtype in adapter.dtypes:
                yield spec, adapter, dtype


def pytest_generate_tests(metafunc):
    """Parametrise the property tests over backend x dtype x (op or relation), or backend alone."""
    if not _suite_module(metafunc.module):
        return
    if "op" in metafunc.fixturenames and "backend" in metafunc.fixturenames:
        params = [pytest.param(spec, adapter, dtype, op, id=f"{adapter.name}-{dtype}-{op}")
                  for spec, adapter, dtype in backend_dtypes(metafunc.config) for op in metafunc.config.conformance_ops]
        metafunc.parametrize("backend, adapter, dtype, op", params)
    elif "relation" in metafunc.fixturenames:
        params = [pytest.param(spec, adapter, dtype, name, id=f"{adapter.name}-{dtype}-{name}")
                  for spec, adapter, dtype in backend_dtypes(metafunc.config) for name, relation in RELATIONS.items()
                  if set(relation.ops) & set(metafunc.config.conformance_ops)]
        metafunc.parametrize("backend, adapter, dtype, relation", params)
    elif "adapter" in metafunc.fixturenames:
        params = [pytest.param(spec, adapter, id=adapter.name)
                  for spec, adapter in metafunc.config.conformance_backends.items()]
        metafunc.parametrize("backend, adapter", params)


def _share_threads(config) -> dict:
    """Give each process its share of the cores in torch: under pytest-xdist every worker would start a
    thread per core, and threads that outnumber the cores spin against each other.  numpy's BLAS keeps
    its threads: its float32 products change with their number, and a run must report the same with
    and without workers (the oracle's own products run BLAS on one thread anyway).  XLA's CPU threads
    are not limited."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT") or getattr(config.option, "numprocesses", None)
    workers = workers if isinstance(workers, int) or str(workers).isdigit() else 1
    processes = max(1, int(workers))
    threads = max(1, cores // processes)
    torch = sys.modules.get("torch")
    if processes > 1 and hasattr(config, "workerinput") and torch is not None:
        torch.set_num_threads(threads)
    blas = [pool["num_threads"] for pool in threadpoolctl.threadpool_info() if pool.get("user_api") == "blas"]
    return {"cores": cores, "processes": processes, "torch_threads_per_process": threads if torch else None,
            "blas_threads": max(blas, default=None)}


@pytest.fixture(scope="session")
def real_checkpoint(request, tmp_path_factory):
    """The slow tests' checkpoint, written once for the run they share: (path, the --weights given or
    None, seconds spent writing). ``--weights`` when given, else the real 12B geometry generated in
    the real layout (24 GB) in a temporary folder."""
    given = request.config.getoption("--weights")
    if given is not None:
        return given, given, 0.0
    start = time.perf_counter()
    path = generate.write_checkpoint(tmp_path_factory.mktemp("gemma4-12b"), generate.real_config(), seed=0, shards=5)
    return path, None, time.perf_counter() - start


def _suite_module(module) -> bool:
    return module is not None and module.__name__.startswith("gemma4_conformance.")


def in_suite(item) -> bool:
    return _suite_module(getattr(item, "module", None))


@pytest.hookimpl(trylast=True)  # after -k and -m deselect: a --case is checked against the tests that will run
def pytest_collection_modifyitems(config, items):
    """The 12B test runs only when asked for (-m slow); known deviations turn into non-strict xfails."""
    if not config.option.markexpr:
        slow = [item for item in items if in_suite(item) and item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if item not in slow]
    suite = [item for item in items if in_suite(item)]
    if config.conformance_case is not None:
        try:
            check_case_fits(config, suite)
        except pytest.UsageError as e:
            if not hasattr(config, "workerinput"):
                raise
            # A usage error raised in a pytest-xdist worker crashes the run: the worker runs nothing and
            # the controller says it and exits 4.
            config.conformance_usage_error = str(e)
            config.hook.pytest_deselected(items=list(items))
            items[:] = []
            return
    config.conformance_deviations.mark(suite)
    config.conformance_collected = len(suite)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Sort what went wrong: an excused known deviation, or a test that broke (exit 6), apart from
    plain conformance failures."""
    rep = yield
    if not in_suite(item):
        return rep
    recorder = item.config.conformance_recorder
    entry = item.config.conformance_deviations.entry_for(item)
    if entry is not None and rep.when == "call" and rep.passed:
        entry.passed.append(item.nodeid)
    if entry is not None and rep.when == "call" and rep.skipped and hasattr(rep, "wasxfail"):
        entry.excused.append(item.nodeid)
        _, name, dtype, what = subject(item)
        recorder.excused[name, dtype, what] = entry.reason
    elif rep.failed and (rep.when != "call" or call.excinfo is not None and is_broken(call.excinfo.value)):
        recorder.problems.append(Problem(item.nodeid, rep.when, clipped(call.excinfo.exconly())))
    if call.excinfo is not None and call.excinfo.errisinstance(UnsupportedSkip):
        rep.conformance_unsupported = True  # an attribute, so that it travels from an xdist worker
    return rep


def clipped(message: str, limit: int = 2000) -> str:
    """``message`` in at most about ``limit`` characters: its start and its end.  A library that wraps an
    error in its own (jaxlib's "Exception raised in callback: Traceback ...") puts the cause last."""
    if len(message) <= limit:
        return message
    head, tail = limit // 4, limit - limit // 4
    return f"{message[:head]}\n... ({len(message) - head - tail} characters left out) ...\n{message[-tail:]}"


def pytest_report_teststatus(report, config):
    """A test skipped for an op the adapter lacks counts as "unsupported", not "skipped": pytest's -ra
    summary leaves it out (it would say so once per test and dtype), and the plugin's summary names each
    adapter's unsupported ops once."""
    if getattr(report, "conformance_unsupported", False):
        return "unsupported", "u", "UNSUPPORTED"
    return None


def is_broken(error: BaseException) -> bool:
    """Whether a test's exception means the adapter or the suite broke, rather than a result beyond its
    budget. A conformance failure is ``pytest.fail``; anything else, the adapter's ContractViolation
    and the suite's own asserts included, is broken. A group (Hypothesis found several distinct
    errors) is broken if any member is."""
    if isinstance(error, BaseExceptionGroup):
        return any(is_broken(e) for e in error.exceptions)
    return not isinstance(error, pytest.fail.Exception)


def exit_status(config, exitstatus: int) -> int:
    """pytest's status, with 6 for a run that broke or whose report could not be written (it wins over
    1: the verdict is incomplete)."""
    broke = config.conformance_recorder.problems or not all(written for _, written in config.conformance_reports)
    nothing_else = pytest.ExitCode.NO_TESTS_COLLECTED  # every test's input broke (a trace file that is none)
    if int(exitstatus) in (EXIT_CONFORMANT, EXIT_NOT_CONFORMANT, nothing_else) and broke:
        return EXIT_BROKEN
    return int(exitstatus)


def _environment(config) -> dict:
    command = shlex.join(["pytest", *config.invocation_params.args])
    return report.environment(command=command, backends=config.conformance_backends.values(),
                              threads=config.conformance_threads)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Stream the JSON report (report.Stream): a line per finished test of the suite, so that a run killed
    before its end (a job past its deadline that ignores SIGINT) leaves every finished test's verdict.
    Not in pytest-xdist workers: the controller writes the report at the end."""
    outcome = yield
    config = item.config
    path = config.getoption("--report-json")
    if path is None or hasattr(config, "workerinput") or not in_suite(item):
        return outcome
    stream = getattr(config, "conformance_stream", None)
    if stream is None:
        stream = config.conformance_stream = report.Stream(path, _environment(config),
                                                           config.conformance_deviations.entries)
    if stream:
        try:
            stream.update(config.conformance_recorder, item.nodeid)
        except OSError:  # a path that cannot be written: said when the whole report cannot be either
            config.conformance_stream = False
    return outcome


def write_reports(config) -> None:
    """Write the JSON and HTML reports, each on its own, so that one that fails leaves the other."""
    paths = {"JSON": config.getoption("--report-json"), "HTML": config.getoption("--report-html") or None}
    paths = {kind: path for kind, path in paths.items() if path is not None}
    if getattr(config, "conformance_stream", None):
        config.conformance_stream.close()
    doc = None
    for kind, path in paths.items():
        try:
            doc = doc or report.document(config.conformance_recorder, _environment(config),
                                         config.conformance_deviations.entries)
            written = report.dump(doc, path) if kind == "JSON" else report.write_html(path, [doc])
        except Exception as e:  # noqa: BLE001 - the suite's fault or a bad path: said, the run exits 6, nothing lost
            why = f"conformance report: the {kind} report {path} could not be written: {type(e).__name__}: {e}"
            config.conformance_reports.append((why, False))
        else:
            config.conformance_reports.append((f"conformance report: {written}", True))


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the controller merges, reports and decides
        config.workeroutput[WORKER_OUTPUT] = json.dumps(_worker_results(config))
        return
    if getattr(config, "conformance_usage_error", None):
        session.exitstatus = pytest.ExitCode.USAGE_ERROR
        return
    judged = getattr(config, "conformance_collected", 0) or config.conformance_recorder.problems
    if judged and not config.option.collectonly:  # nothing judged and nothing broke: no report
        write_reports(config)
    session.exitstatus = exit_status(config, exitstatus)


# pytest-xdist (pytest -n N): each worker runs some of the tests and sends what it recorded to the
# controller, which merges it, so the summary, the reports and the exit status cover every test.
WORKER_OUTPUT = "gemma4_conformance"


def _worker_results(config) -> dict:
    deviations = [{"matched": e.matched, "excused": e.excused, "passed": e.passed}
                  for e in config.conformance_deviations.entries]
    return {"collected": getattr(config, "conformance_collected", 0), "recorder": config.conformance_recorder.export(),
            "deviations": deviations, "usage_error": getattr(config, "conformance_usage_error", None)}


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown to pytest without it
def pytest_testnodedown(node, error):
    """An xdist worker finished (or died): merge its results; a worker lost is a run that broke."""
    config = node.config
    output = getattr(node, "workeroutput", {}).get(WORKER_OUTPUT)
    if output is not None:
        results = json.loads(output)
        if results["usage_error"]:
            config.conformance_usage_error = results["usage_error"]
        config.conformance_collected = max(getattr(config, "conformance_collected", 0), results["collected"])
        config.conformance_recorder.merge(results["recorder"])
        for entry, state in zip(config.conformance_deviations.entries, results["deviations"]):
            entry.matched[:] = state["matched"]  # every worker collects every test, in the same order
            entry.excused.extend(state["excused"])
            entry.passed.extend(state["passed"])
    if error is not None:
        worker = getattr(node, "gateway", None)
        config.conformance_recorder.problems.append(
            Problem(f"pytest-xdist worker {getattr(worker, 'id', '?')}", "worker", f"the worker went down: {error}"))


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if getattr(config, "conformance_usage_error", None):  # a worker's (pytest says the controller's own)
        terminalreporter.write_line(f"ERROR: {config.conformance_usage_error}", red=True)
        return
    recorder = getattr(config, "conformance_recorder", None)
    if recorder is None or not (getattr(config, "conformance_collected", 0) or recorder.problems):
        return  # not a run of the suite's tests
    deviations = config.conformance_deviations
    if deviations.entries:
        terminalreporter.section("conformance: known deviations")
        for line in deviations.summary():
            terminalreporter.write_line(line, yellow=line.startswith("warning"))
    if recorder.problems:
        terminalreporter.section("conformance: broken (an adapter raised or broke the contract, or the suite errored)")
        for problem in recorder.problems:
            terminalreporter.write_line(f"{problem.test} ({problem.phase}): {problem.message.splitlines()[0]}", red=True)
    terminalreporter.section("conformance: per backend, dtype and op, the example nearest its budget "
                             "(ULPs at the op's scale)")
    for adapter in config.conformance_backends.values():
        terminalreporter.write_line(f"{adapter.name}: {report.device_line(adapter)}")
    for line in recorder.table():
        terminalreporter.write_line(line)
    for line, written in config.conformance_reports:
        terminalreporter.write_line(line, red=not written)
    status = exit_status(config, exitstatus)
    claims = broken_claims(recorder.invariance.values(), recorder.excused)
    claims = f"; broken invariance claims: {', '.join(claims)}" if claims and status == EXIT_NOT_CONFORMANT else ""
    declared = "; ".join(f"{adapter.name}: " + ", ".join(f"{key} {name}" for key, name in sorted(formats.items()))
                         for adapter in config.conformance_backends.values()
                         for formats in [adapters.declared_formats(adapter)] if formats)
    given = f" (given its declared formats: {declared})" if declared and status == EXIT_CONFORMANT else ""
    terminalreporter.write_line(f"conformance exit status {status}: {EXIT_CODES.get(status, 'see pytest')}{claims}"
                                f"{given}")
