"""The pytest plugin: which backend and dtypes to test, Hypothesis profiles, and the run's summary.

    pytest --backend=torch                    every op of torch in every dtype it supports
    pytest --backend=all --dtype=bfloat16     every installed built-in backend, bf16 only
    pytest --backend=mypkg.engine:Adapter     an adapter object, class or factory by path
    pytest --hypothesis-profile=thorough      more examples (profiles: ci, default, thorough)
    pytest --weights=/path/to/gemma-4-12B     the full forward on real weights
    pytest ... --case='<json>'                rerun exactly one failing case (printed on failure)
"""

from __future__ import annotations

import json
import shlex

import pytest
from hypothesis import HealthCheck, settings

import adapters
import report
from adapters import DTYPES, AdapterError
from properties.record import Recorder

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", derandomize=True, max_examples=12, print_blob=True, **_common)
settings.register_profile("default", max_examples=40, print_blob=True, **_common)
settings.register_profile("thorough", max_examples=400, print_blob=True, **_common)
settings.load_profile("default")


def pytest_addoption(parser):
    group = parser.getgroup("gemma4-conformance")
    group.addoption("--backend", default="numpy",
                    help="backend(s) to test, comma-separated: numpy, torch, jax, an entry-point name, "
                         "module:attribute, or all (every installed built-in). Default: numpy.")
    group.addoption("--dtype", default=",".join(DTYPES),
                    help=f"dtypes to test, comma-separated, among {', '.join(DTYPES)}. Default: all.")
    group.addoption("--case", default=None,
                    help="rerun one case (the JSON printed by a failure) instead of drawing examples")
    group.addoption("--report-html", default="reports/conformance.html",
                    help="where to write the HTML tolerance report (default: reports/conformance.html; "
                         "'' for none)")
    group.addoption("--report-json", default=None,
                    help="also write the run's results as JSON (versioned schema; see report/data.py)")
    group.addoption("--weights", default=None,
                    help="a Gemma 4 checkpoint folder (config.json and safetensors) for the full forward; "
                         "default: a checkpoint the suite generates in the real layout")


def _backend_specs(option: str) -> list[str]:
    specs = []
    for spec in (s.strip() for s in option.split(",") if s.strip()):
        specs.extend(adapters.available_builtins() if spec == "all" else [spec])
    return specs


def pytest_configure(config):
    config.conformance_recorder = Recorder()
    dtypes = [d.strip() for d in config.getoption("--dtype").split(",") if d.strip()]
    unknown = sorted(set(dtypes) - set(DTYPES))
    if unknown:
        raise pytest.UsageError(f"--dtype: unknown {unknown}; choose among {', '.join(DTYPES)}")
    config.conformance_dtypes = dtypes
    loaded = {}
    for spec in _backend_specs(config.getoption("--backend")):
        try:
            loaded[spec] = adapters.load(spec)
        except AdapterError as e:
            raise pytest.UsageError(f"--backend: {e}") from None
    config.conformance_backends = loaded
    case = config.getoption("--case")
    if case is not None:
        try:
            config.conformance_case = json.loads(case)
        except json.JSONDecodeError as e:
            raise pytest.UsageError(f"--case is not valid JSON: {e}") from None
    else:
        config.conformance_case = None


def backend_dtypes(config):
    """(backend spec, adapter, dtype) for every backend under test and every dtype both allow."""
    for spec, adapter in config.conformance_backends.items():
        for dtype in config.conformance_dtypes:
            if dtype in adapter.dtypes:
                yield spec, adapter, dtype


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    recorder = getattr(config, "conformance_recorder", None)
    if recorder is None or not (recorder.records or recorder.forward):
        return
    terminalreporter.section("conformance: largest error per backend, dtype and op (ULPs at the op's scale)")
    for line in recorder.table():
        terminalreporter.write_line(line)
    written = report.save(recorder, html=config.getoption("--report-html") or None,
                          json=config.getoption("--report-json"),
                          command=shlex.join(["pytest", *config.invocation_params.args]))
    for path in written:
        terminalreporter.write_line(f"conformance report: {path}")
