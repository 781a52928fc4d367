"""pytest-xdist: ``pytest -n 2`` gives the result set, exit status, summary and report of a serial run.

Each xdist worker runs some of the tests and sends what it recorded to the controller, which merges
it before writing the summary and the reports and deciding the exit status (plugin.py).  The runs
use the derandomized ``ci`` profile, so both draw the same examples.
"""

from __future__ import annotations

import json

import pytest

from gemma4_conformance import report
from gemma4_conformance.plugin import EXIT_NOT_CONFORMANT
from gemma4_conformance.report.record import OpRecord, Problem, Recorder, RelationRecord

from .test_plugin import suite

EPS_MISSING = "tests.mutants:ADAPTERS.rms_eps_missing"  # rms beyond budget in float32: excused below
SIGMOID = "tests.mutants:ADAPTERS.sigmoid_tanh_form_without_half_angle"  # sigmoid beyond budget in float32
SELECT = ("(test_matches_oracle and (-rms] or -sigmoid] or -softmax])) or fixed_points "
          "or test_forward_matches_reference")
DEVIATIONS = f"""
backend: {EPS_MISSING}
deviations:
  - {{op: rms, dtype: float32, reason: eps dropped on purpose}}
  - {{op: sigmoid, dtype: float32, reason: was a fast exp}}
"""


def result_set(doc) -> dict:
    """What a run concluded, without where and how it ran (its folder holds the deviations file) or how
    long each op took (its ``seconds``)."""
    deviations = [{k: v for k, v in d.items() if k != "file"} for d in doc["deviations"]]
    results = [{k: v for k, v in r.items() if k != "seconds"} for r in doc["results"]]
    return {**{key: doc[key] for key in ("relations", "forward", "problems")}, "results": results,
            "deviations": deviations}


def summary(out: str, where) -> list[str]:
    """The conformance sections of the terminal summary, up to the exit status, without the report paths."""
    lines = out[out.index("conformance: known deviations"):].replace(str(where), "<run folder>").splitlines()
    end = next(i for i, line in enumerate(lines) if line.startswith("conformance exit status"))
    return [line for line in lines[:end + 1] if not line.startswith("conformance report:")]


@pytest.fixture(scope="module")
def serial_and_parallel(tmp_path_factory):
    runs = {}
    for workers in ("0", "2"):
        where = tmp_path_factory.mktemp(f"n{workers}")
        runs[workers] = (where, *suite(where, f"--backend={EPS_MISSING},{SIGMOID}", "-k", SELECT, "-n", workers,
                                       deviations=DEVIATIONS))
    return runs


def test_two_workers_give_the_serial_runs_results_exit_status_summary_and_report(serial_and_parallel):
    (where0, status0, out0, doc0), (where2, status2, out2, doc2) = serial_and_parallel["0"], serial_and_parallel["2"]
    assert "2 workers" in out2, out2[-3000:]
    assert status0 == status2 == EXIT_NOT_CONFORMANT, out2[-3000:]
    assert result_set(doc2) == result_set(doc0)
    assert summary(out2, where2) == summary(out0, where0)
    # and the result set is the whole run's: both backends' ops, the theorem, both forwards, the deviations
    assert len(doc0["results"]) == 6 and len(doc0["relations"]) == 2 and len(doc0["forward"]) == 2
    assert sorted(d["status"] for d in doc0["deviations"]) == ["conforms", "excused"]
    outcomes = {(r["backend"].split()[-1], r["op"]): r["outcome"] for r in doc0["results"]}
    assert outcomes["sigmoid_tanh_form_without_half_angle", "sigmoid"] == "failed"
    assert outcomes["rms_eps_missing", "rms"] == "known deviation"


def test_the_html_report_is_written_once_by_the_controller_with_every_result(serial_and_parallel):
    _, _, out, doc = serial_and_parallel["2"]
    assert out.count("conformance report:") == 2  # the JSON and the HTML, not one per worker
    assert all(r["examples"] > 0 for r in doc["results"])


def test_a_recorders_export_merges_back_into_an_equal_recorder():
    recorder = Recorder()
    record = recorder("torch", "bfloat16", "rms")
    record.add(0.4, 1.0, {"args": {}}, "pytest ...")
    record.fail("error 3 ULPs", worst=True)
    recorder.relation("torch", "bfloat16", "fixed_points", ("sigmoid", "gelu_tanh")).outcome = "passed"
    recorder.excused["torch", "bfloat16", "rms"] = "accepted"
    recorder.problems.append(Problem("test_x", "call", "raised"))
    merged = Recorder()
    merged.merge(json.loads(json.dumps(recorder.export())))
    assert merged.records == {("torch", "bfloat16", "rms"): record}
    assert isinstance(merged.records["torch", "bfloat16", "rms"], OpRecord)
    assert merged.relations == recorder.relations and isinstance(next(iter(merged.relations.values())), RelationRecord)
    assert merged.excused == recorder.excused and merged.problems == recorder.problems
    assert merged.table() == recorder.table()


def test_a_merged_export_gives_the_same_report_document_traces_and_serving_included():
    from .test_report import make_recorder  # a recorder with every kind of verdict the report shows

    recorder = make_recorder()
    recorder.forward.clear()  # stand-ins there; the real ForwardVerdict's round trip is the test above
    merged = Recorder()
    merged.merge(json.loads(json.dumps(recorder.export())))
    assert merged.traces and merged.serving
    env = {"label": "fixed"}
    assert report.document(merged, env) == report.document(recorder, env)
