"""The report: the JSON document of a run, its schema checks, and the self-contained HTML page."""

from __future__ import annotations

import html
import json
import math
import re
from datetime import datetime
from html.parser import HTMLParser
from types import SimpleNamespace

import pytest

from gemma4_conformance import report
from gemma4_conformance.properties.budget import budget
from gemma4_conformance.properties.deviations import Deviation
from gemma4_conformance.properties.forward import ACCUMULATED
from gemma4_conformance.properties.invariance import Difference, InvarianceRecord, OpInvarianceRecord
from gemma4_conformance.properties.serving import Position, ServingRecord
from gemma4_conformance.properties.trace import NodeVerdict, TraceVerdict
from gemma4_conformance.report import data, schema
from gemma4_conformance.report.__main__ import main
from gemma4_conformance.report.record import OpRecord, Problem, Recorder

ROPE_COMMAND = ("pytest -p gemma4_conformance.plugin --pyargs "
                "'gemma4_conformance.properties.test_agreement::test_matches_oracle[torch-bfloat16-rope]' "
                "--backend=torch '--case={\"args\":{\"x\":{\"seed\":7}}}'")
FORWARD_COMMAND = ("pytest -p gemma4_conformance.plugin --pyargs "
                   "'gemma4_conformance.properties.test_forward::test_forward_matches_reference[torch-float32]' "
                   "--backend=torch")
TRACE_COMMAND = FORWARD_COMMAND.replace("test_forward_matches_reference[torch-float32]",
                                        "test_trace_nodes_match_their_ops[torch-bfloat16]")
Q_NORM_FAILURE = "error 6.2 ULPs at the op's scale > budget 1.5 (1.5) at (3, 0, 7): got 0.5, exact 0.49"
SERVING_COMMAND = ("pytest -p gemma4_conformance.plugin --pyargs "
                   "'gemma4_conformance.properties.test_serving::test_serving_matches_reference[torch-float32]' "
                   "--backend=torch '--case={\"sequences\":[{\"id\":0,\"join\":0,\"chunks\":[5,6],\"decode\":3}]}'")
SCHEDULE = {"sequences": [{"id": 0, "join": 0, "chunks": [5, 6], "decode": 3}]}
HOSTILE = "<script>alert(1)</script>"


def _record(recorder, backend, dtype, op, errors, budget_ulps, outcome, message=""):
    record = recorder(backend, dtype, op)
    for k, e in enumerate(errors):
        case = {"args": {"x": {"seed": k}}}
        record.add(e, budget_ulps, case, f"pytest -p gemma4_conformance.plugin --pyargs 'gemma4_conformance."
                                         f"properties.test_agreement::test_matches_oracle[{backend}-{dtype}-{op}]' "
                                         f"--backend={backend} '--case={json.dumps(case)}'")
    record.outcome, record.message = outcome, message
    return record


def make_recorder(backend: str = "torch") -> Recorder:
    recorder = Recorder()
    rope = _record(recorder, backend, "bfloat16", "rope", [1.0, 2.5, 7.1, 0.5], 4.5, "failed",
                   f"error 7.1 ULPs at the op's scale > budget 4.5 {HOSTILE}")
    rope.worst_command = ROPE_COMMAND.replace("torch", backend)
    _record(recorder, backend, "bfloat16", "softmax", [0.1, 0.4, 0.2], 3.0, "passed")
    _record(recorder, backend, "bfloat16", "linear", [], 0.0, "unsupported")
    _record(recorder, backend, "float32", "rope", [3.0, 3.5], 4.5, "passed")  # headroom 1.29: orange
    _record(recorder, backend, "float32", "silu", [0.0, 0.0], 9.5, "passed")  # exact: infinite headroom
    _record(recorder, backend, "bfloat16", "rmsnorm_unit", [0.3, 0.5], 0.501, "passed")  # one rounding: correctly rounded
    sigmoid = _record(recorder, backend, "float32", "sigmoid", [], 0.0, "errored", "returned float64 for float32 input")
    sigmoid.worst_command = ROPE_COMMAND.replace("torch", backend).replace("bfloat16-rope", "float32-sigmoid")
    _record(recorder, backend, "float32", "softcap", [0.5, 40.0], 9.5, "failed", "error 40 ULPs > budget 9.5")
    recorder.excused[backend, "float32", "softcap"] = "fast tanh, accepted"
    held = recorder.relation(backend, "bfloat16", "softmax_sums_to_one", ("softmax",))
    held.examples, held.outcome = 12, "passed"
    broken = recorder.relation(backend, "float32", "rope_keeps_pair_norms", ("rope",))
    broken.examples, broken.outcome, broken.message = 3, "failed", "pair norm: at (0, 1) 1.5 vs 1.0"
    broken.rerun = ROPE_COMMAND.replace("torch", backend).replace("test_agreement::test_matches_oracle",
                                                                   "test_relations::test_relation_holds")
    recorder.problems.append(Problem(f"test_matches_oracle[{backend}-float32-sigmoid]", "call",
                                     "ContractViolation: sigmoid returned dtype float64, expected float32"))
    layers = [(1e-3 * (1 + i / 4), 1e-3 * (1 + i / 5)) for i in range(6)]
    recorder.forward[backend, "bfloat16"] = SimpleNamespace(layers=layers, logits=(2e-3, 1.6e-3), top1_agreement=1.0,
                                                            logprob_gap=(0.01, 0.008), failures=[], rerun="")
    recorder.forward[backend, "float32"] = SimpleNamespace(
        layers=[(1e-5, 1e-7)] * 3, logits=(1e-5, 1e-7), top1_agreement=0.75, logprob_gap=(0.2, 1e-6),
        failures=["layer 0: relative error 1e-05 > 3.0 x baseline 1e-07 (floor 9.5e-07)"],
        rerun=FORWARD_COMMAND.replace("torch", backend))
    nodes = [NodeVerdict("embed", "embed", "passed", 0.25, 0.5),
             NodeVerdict("layers.0.q_proj", "linear", "passed", 1.0, 4.0),
             NodeVerdict("layers.0.q_norm", "rmsnorm", "failed", 6.2, 1.5, Q_NORM_FAILURE),
             NodeVerdict("layers.0.q_rope", "rope", "passed", 1.2, 4.5),
             NodeVerdict("layers.0.k_proj", "linear", "not traced", message="the engine's trace omits it"),
             NodeVerdict("layers.0.k_norm", "rmsnorm", "inputs not traced",
                         message="its input(s) layers.0.k_proj were not traced"),
             NodeVerdict("layers.1.q_norm", "rmsnorm", "failed", 3.0, 1.5, "error 3 ULPs"),
             NodeVerdict("final_norm", "rmsnorm", "passed", 0.5, 1.5),
             NodeVerdict("logits", "lm_head", "passed", 2.0, 5.0)]
    trace = TraceVerdict("bfloat16", nodes, rerun=TRACE_COMMAND.replace("torch", backend))
    trace.failures.append(f"trace: {trace.summary()}: {Q_NORM_FAILURE}")
    recorder.traces[backend, "bfloat16"] = trace
    passed = recorder.serving[backend, "bfloat16"] = ServingRecord(backend, "bfloat16", "passed", 6, 12, 43, 184)
    passed.worst = Position(0.36, 0.069, 0.064, 1, 26, True, SCHEDULE)
    failed = recorder.serving[backend, "float32"] = ServingRecord(backend, "float32", "failed", 5, 9, 30, 120)
    failed.worst = Position(3e4, 0.06, 1.9e-6, 0, 10, False, SCHEDULE)
    failed.failing, failed.failing_features = 3, {"chunking": 3, "wrap-around": 2, "reuse": 0, "mixed batch": 1}
    failed.case, failed.features = SCHEDULE, ["chunking", "wrap-around"]
    failed.message = "sequence 0 (id 0, 14 tokens, document 0) against the reference: logits: relative error 0.06"
    failed.rerun = SERVING_COMMAND.replace("torch", backend)
    return recorder


def make_deviations(backend: str = "torch") -> list[Deviation]:
    """The known-deviations entries of make_recorder's run: one excused, one stale, one unmatched."""
    excused = Deviation(backend, "softcap", "float32", "fast tanh, accepted", "deviations.yaml",
                        matched=["test_matches_oracle[softcap]"], excused=["test_matches_oracle[softcap]"])
    stale = Deviation(backend, "silu", "float32", "was a fast exp", "deviations.yaml", matched=["test[silu]"],
                      passed=["test[silu]"])
    unmatched = Deviation(backend, "rope", "float16", "fp16 angles", "deviations.yaml")
    return [excused, stale, unmatched]


def make_document(backend: str = "torch", **environment) -> dict:
    return report.document(make_recorder(backend), report.environment(**environment), make_deviations(backend))


@pytest.fixture(scope="module")
def doc():
    return make_document(label="ci")


@pytest.fixture(scope="module")
def page(doc):
    return report.render([doc])


def _result(doc, dtype, op):
    return next(r for r in doc["results"] if (r["dtype"], r["op"]) == (dtype, op))


def _section(page, start, end):
    return page[page.index(f'id="{start}"'):page.index(f'id="{end}"')]


# ----------------------------------------------------------------------------------------- the document

def test_the_document_round_trips_through_strict_json_and_load(doc, tmp_path):
    path = report.dump(doc, tmp_path / "sub" / "run.json")
    text = path.read_text()
    json.loads(text, parse_constant=lambda name: pytest.fail(f"non-standard JSON constant {name}"))
    assert report.load(path) == doc
    assert doc["schema"] == "gemma4-conformance-report" and doc["version"] == report.VERSION == 5


def test_a_result_entry_carries_the_measurements_budget_and_rerun(doc):
    rope = _result(doc, "bfloat16", "rope")
    assert (rope["backend"], rope["outcome"], rope["examples"]) == ("torch", "failed", 4)
    assert rope["worst_ulps"] == rope["max_ulps"] == 7.1 and rope["budget_ulps"] == 4.5
    assert rope["headroom"] == pytest.approx(4.5 / 7.1)
    assert rope["median_ulps"] == pytest.approx(1.75) and 2.5 < rope["p99_ulps"] <= 7.1
    assert rope["budget_formula"] == budget("rope", "bfloat16").formula
    assert rope["error_model"] == budget("rope", "bfloat16").model
    assert rope["worst_case"] == {"args": {"x": {"seed": 2}}}
    assert rope["rerun"] == ROPE_COMMAND and HOSTILE in rope["message"]
    assert rope["histogram"] == [float(f"{e / 4.5:.4g}") for e in (1.0, 2.5, 7.1, 0.5)]  # fractions of the budget
    unsupported = _result(doc, "bfloat16", "linear")
    assert unsupported["outcome"] == "unsupported" and unsupported["examples"] == 0
    assert all(unsupported[k] is None for k in ("max_ulps", "p99_ulps", "median_ulps", "budget_ulps", "headroom"))
    exact = _result(doc, "float32", "silu")
    assert exact["headroom"] == "inf" and report.number(exact["headroom"]) == float("inf")
    # Sorted by dtype in the suite's order, then op in the contract's.
    assert [(r["dtype"], r["op"]) for r in doc["results"]] == [
        ("float32", "sigmoid"), ("float32", "silu"), ("float32", "softcap"), ("float32", "rope"),
        ("bfloat16", "rmsnorm_unit"), ("bfloat16", "rope"), ("bfloat16", "linear"), ("bfloat16", "softmax")]


def test_the_schema_names_every_field_a_document_carries(doc):
    """report/schema.py is where a field is described: a document has no field it lacks, nor lacks one it requires."""
    invariance = InvarianceRecord("torch", "float32", "batch", claimed=True, outcome="failed", schedules=2, rows=14,
                                  differing=3, worst=Difference(0, 10, 3, 4.0, 1.5e4, "against alone", SCHEDULE))
    ops = OpInvarianceRecord("torch", "float32", "linear", 2, 36, 4, 2.0, 9.0, "layers.0.q: rows 0..0 alone")
    doc = {**doc, "invariance": [data.invariance_entry(invariance)], "op_invariance": [data.op_invariance_entry(ops)]}
    doc["partial"] = "read back from a stream"  # only there (report.Stream)
    assert set(doc) == set(schema.DOCUMENT_FIELDS)
    assert set(doc["environment"]) - {"label"} <= set(schema.ENVIRONMENT_FIELDS)  # label: an extra key given
    for key, fields in (("results", schema.RESULT_FIELDS), ("relations", schema.RELATION_FIELDS),
                        ("forward", schema.FORWARD_FIELDS), ("traces", schema.TRACE_FIELDS),
                        ("serving", schema.SERVING_FIELDS), ("invariance", schema.INVARIANCE_FIELDS),
                        ("op_invariance", schema.OP_INVARIANCE_FIELDS), ("problems", schema.PROBLEM_FIELDS),
                        ("deviations", schema.DEVIATION_FIELDS)):
        assert doc[key], key
        required = {name for name, field in fields.items() if field.kind is not None}
        for entry in doc[key]:
            assert required <= set(entry) <= set(fields), key
    for node in doc["traces"][0]["nodes"]:
        assert set(node) == set(schema.NODE_FIELDS)


def test_the_worst_example_is_the_one_nearest_its_budget_not_the_largest_error():
    """Budgets grow with an example's dimensions: 12 ULPs against 100 is better than 3 against 3.5."""
    recorder = Recorder()
    record = recorder("torch", "float64", "lm_head")
    assert record.add(12.0, 100.0, {"k": 1}, "cmd-1") and record.add(3.0, 3.5, {"k": 2}, "cmd-2")
    assert not record.add(1.0, 3.5, {"k": 3}, "cmd-3")
    record.outcome = "passed"
    [entry] = report.document(recorder, {})["results"]
    assert (entry["worst_ulps"], entry["budget_ulps"], entry["rerun"]) == (3.0, 3.5, "cmd-2")
    assert entry["headroom"] == pytest.approx(3.5 / 3) and entry["max_ulps"] == 12.0
    assert entry["histogram"] == [0.12, 0.8571, 0.2857]


def test_a_forward_entry_has_per_layer_errors_and_the_verdict(doc):
    bf16, fp32 = (next(f for f in doc["forward"] if f["dtype"] == d) for d in ("bfloat16", "float32"))
    assert bf16["outcome"] == "passed" and len(bf16["layers"]["candidate"]) == 6 == len(bf16["layers"]["baseline"])
    assert bf16["logits"] == {"candidate": 2e-3, "baseline": 1.6e-3}
    assert bf16["logprob_gap"] == {"candidate": 0.01, "baseline": 0.008} and bf16["top1_agreement"] == 1.0
    assert bf16["rerun"] == "" and fp32["rerun"] == FORWARD_COMMAND
    assert bf16["factor"] == 3.0 and bf16["floor"] > 0
    assert fp32["outcome"] == "failed" and fp32["failures"][0].startswith("layer 0")


def test_a_trace_entry_names_the_first_departing_node_and_counts_nodes_by_layer(doc):
    [entry] = doc["traces"]
    assert (entry["backend"], entry["dtype"], entry["outcome"]) == ("torch", "bfloat16", "failed")
    first = entry["first_departure"]
    assert (first["node"], first["op"], first["layer"], first["error"], first["budget"]) == \
        ("layers.0.q_norm", "rmsnorm", 0, 6.2, 1.5) and first["message"] == Q_NORM_FAILURE
    assert entry["summary"].startswith("first departing node layers.0.q_norm (rmsnorm, bfloat16): 6.2 ULPs > "
                                       "budget 1.5")
    rows = {row["where"]: row for row in entry["layers"]}
    assert list(rows) == ["embed", "layer 0", "layer 1", "final"]
    assert {k: rows["layer 0"][k] for k in ("nodes", "judged", "passed", "failed", "not traced",
                                             "inputs not traced")} == \
        {"nodes": 5, "judged": 3, "passed": 2, "failed": 1, "not traced": 1, "inputs not traced": 1}
    assert rows["layer 0"]["failed_nodes"] == ["q_norm"] and rows["final"]["judged"] == 2
    assert [n["outcome"] for n in entry["nodes"]][4:6] == ["not traced", "inputs not traced"]
    assert entry["nodes"][4]["error"] is None and entry["rerun"] == TRACE_COMMAND


def test_the_trace_section_shows_the_first_departing_node_and_the_grid_by_layer(page):
    section = _section(page, "trace", "serving")
    assert "first departing node <span class=\"mono\">layers.0.q_norm</span>" in section
    assert "layer 0" in section and Q_NORM_FAILURE in html.unescape(section)
    assert TRACE_COMMAND in html.unescape(section)
    grid = section[section.index("tracegrid"):]
    assert grid.count("<tr>") == 1 + 4  # the header, embed, layer 0, layer 1, final
    assert 'class="cell fail"' in grid and 'class="cell notrun"' in grid and 'class="cell unsup"' in grid
    failures = _section(page, "failures", "conformance")
    assert "trace — first departing node layers.0.q_norm" in failures


def test_a_serving_entry_has_what_was_checked_the_worst_row_and_the_failing_features(doc):
    fp32, bf16 = doc["serving"]  # sorted by dtype
    assert (fp32["dtype"], fp32["outcome"], bf16["outcome"]) == ("float32", "failed", "passed")
    assert (bf16["schedules"], bf16["sequences"], bf16["steps"], bf16["tokens"]) == (6, 12, 43, 184)
    assert bf16["worst"] == {"ratio": 0.36, "error": 0.069, "baseline": 0.064, "sequence": 1, "position": 26,
                             "decode": True, "schedule": SCHEDULE}
    assert fp32["failing"] == 3 and fp32["failing_features"]["chunking"] == 3 and fp32["features"] == [
        "chunking", "wrap-around"]
    assert fp32["case"] == SCHEDULE and fp32["rerun"] == SERVING_COMMAND and fp32["factor"] == ACCUMULATED == 9.0
    assert bf16["case"] is None and bf16["rerun"] == "" and bf16["message"] == ""


def test_an_adapter_without_a_session_is_listed_as_not_supporting_the_serving_path():
    recorder = Recorder()
    recorder.serving["minimal", "float32"] = ServingRecord("minimal", "float32", "unsupported")
    [entry] = report.document(recorder, {})["serving"]
    assert entry["outcome"] == "unsupported" and entry["worst"] is None and entry["tokens"] == 0
    page = report.render([report.document(recorder, {})])
    section = _section(page, "serving", "environment")
    assert "minimal" in section and "not supported (no session)" in section
    assert "no session, so no serving path" in _section(page, "conformance", "matrix")
    assert [line for line in recorder.table() if "no session" in line] == [
        "minimal  unsupported: no session, so no serving path"]


def test_the_histogram_is_capped_and_keeps_the_extremes():
    recorder = Recorder()
    _record(recorder, "numpy", "float32", "sigmoid", [i / 100 for i in range(2000)], 30.0, "passed")
    entry = report.document(recorder, {})["results"][0]
    assert len(entry["histogram"]) == 500 and entry["examples"] == 2000
    assert min(entry["histogram"]) == 0.0
    assert max(entry["histogram"]) == 0.6663 == float(f"{entry['max_ulps'] / 30:.4g}")


def test_the_environment_names_suite_libraries_python_cpu_and_date():
    env = report.environment(command="pytest --backend=numpy")
    assert isinstance(env["suite_version"], str) and env["suite_version"]
    assert env["libraries"]["numpy"] and env["libraries"]["mpmath"] and env["libraries"]["hypothesis"]
    assert env["python"][0] == "3" and env["cpu"] and env["platform"]
    assert datetime.fromisoformat(env["date"]).tzinfo is not None
    assert env["command"] == "pytest --backend=numpy"
    json.dumps(env, allow_nan=False)


@pytest.mark.parametrize("mutate, says", [
    (lambda d: d.update(schema="something-else"), "not a gemma4-conformance-report"),
    (lambda d: d.update(version=report.VERSION + 1), f"version {report.VERSION + 1} is newer"),
    (lambda d: d.update(version=report.VERSION - 1), f"version {report.VERSION - 1} is older"),
    (lambda d: d.update(version="1"), '"version" is'),
    (lambda d: d.pop("results"), '"results" is missing'),
    (lambda d: d["results"][1].pop("rerun"), "results[1] lacks the field 'rerun'"),
    (lambda d: d["results"][0].update(outcome="great"), "results[0].outcome is 'great'"),
    (lambda d: d["results"][0].update(max_ulps="lots"), "results[0].max_ulps is 'lots'"),
    (lambda d: d["forward"][0]["logits"].pop("baseline"), "forward[0].logits needs"),
    (lambda d: d["traces"][0]["nodes"][2].update(outcome="wobbly"), "traces[0].nodes[2].outcome is 'wobbly'"),
    (lambda d: d["traces"][0].pop("first_departure"), "traces[0] lacks the field 'first_departure'"),
    (lambda d: d["serving"][1].pop("tokens"), "serving[1] lacks the field 'tokens'"),
    (lambda d: d["serving"][0].update(outcome="fine"), "serving[0].outcome is 'fine'"),
])
def test_load_refuses_a_broken_report_and_names_the_file(doc, tmp_path, mutate, says):
    broken = json.loads(json.dumps(doc))
    mutate(broken)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(broken))
    with pytest.raises(report.ReportError) as e:
        report.load(path)
    assert str(path) in str(e.value) and says in str(e.value)


@pytest.mark.parametrize("text, says", [("{not json", "invalid JSON at line 1"), ("[1, 2]", "top level is list")])
def test_load_refuses_what_is_not_a_report(tmp_path, text, says):
    path = tmp_path / "junk.json"
    path.write_text(text)
    with pytest.raises(report.ReportError, match=re.escape(str(path))) as e:
        report.load(path)
    assert says in str(e.value)
    with pytest.raises(report.ReportError, match="cannot read"):
        report.load(tmp_path / "missing.json")


# ----------------------------------------------------------------------------------------- the page

class _Matrix(HTMLParser):
    """The rows (data-op) and cell classes of the page's conformance matrix."""

    def __init__(self):
        super().__init__()
        self.rows, self.inside = {}, False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table" and attrs.get("id") == "matrix-table":
            self.inside = True
        elif self.inside and tag == "tr" and "data-op" in attrs:
            self.rows[attrs["data-op"]] = []
        elif self.inside and tag == "td" and "cell" in attrs.get("class", "") and self.rows:
            self.rows[list(self.rows)[-1]].append(attrs["class"].split()[1])

    def handle_endtag(self, tag):
        if tag == "table":
            self.inside = False


def matrix(page):
    parser = _Matrix()
    parser.feed(page)
    return parser.rows


def test_the_matrix_has_every_op_coloured_by_headroom(page):
    rows = matrix(page)
    assert set(rows) == {"sigmoid", "silu", "softcap", "rmsnorm_unit", "rope", "linear", "softmax", "forward", "trace",
                         "serving"}
    assert rows["softcap"] == ["known", "none"]
    # Columns: float32 then bfloat16, one backend each.
    assert rows["rope"] == ["warn", "fail"]  # headroom 1.29: near its budget
    # 0.5 ULP against a budget of one rounding (0.501): correctly rounded, neither near failing nor close to budget.
    assert rows["rmsnorm_unit"] == ["none", "cr"] and "correctly rounded" in page
    assert "rmsnorm_unit" not in _section(page, "closest", "histograms")
    assert rows["softmax"] == ["none", "ok"] and rows["linear"] == ["none", "unsup"]
    assert rows["sigmoid"] == ["fail", "none"] and rows["silu"] == ["ok", "none"]
    assert rows["forward"] == ["fail", "ok"] and rows["trace"] == ["none", "fail"]
    assert rows["forward"] == rows["serving"] == ["fail", "ok"]
    assert "7.1 / 4.5" in page


def test_the_failures_section_comes_first_and_names_the_op_and_its_rerun(page):
    failures = _section(page, "failures", "conformance")
    assert page.index('id="failures"') < page.index('id="matrix"')
    assert "rope" in failures and "bfloat16" in failures and "torch" in failures
    assert ROPE_COMMAND not in failures and ROPE_COMMAND in html.unescape(failures)  # escaped, copyable as is
    assert "1.58" in failures  # 7.1 / 4.5: by how much
    assert "sigmoid" in failures and "returned float64" in failures  # errored ops count as failures
    assert "layer 0: relative error" in failures  # and so does a failed forward,
    assert FORWARD_COMMAND in html.unescape(failures)  # with the command that reruns it
    assert "float32-sigmoid]" in html.unescape(failures)  # as the errored op has the case it broke on
    assert "serving path — failed" in failures and "wrap-around" in failures  # a failed serving path,
    assert SERVING_COMMAND in html.unescape(failures)  # with the schedule to rerun
    assert "no rerun command recorded" not in failures
    assert "softmax" not in failures


def test_an_infinite_error_is_shown_as_inf_in_the_failures_table():
    """A NaN output's error is infinite (the second tier's): its ULPs and "x over" say inf."""
    recorder = Recorder()
    _record(recorder, "torch-sdpa", "bfloat16", "decode_gqa", [0.5, float("inf")], 1.5, "failed",
            "NaN in the output at (0, 0, 0) where the exact result is finite")
    failures = _section(report.render([report.document(recorder, report.environment())]), "failures", "conformance")
    [row] = re.findall(r"<tr><td>torch-sdpa</td>.*?</tr>", failures, re.S)
    assert re.findall(r'<td class="num">([^<]*)</td>', row) == ["inf", "1.5", "inf"], row


def test_theorems_known_deviations_and_problems_are_in_the_document(doc):
    relations = {(r["dtype"], r["relation"]): r for r in doc["relations"]}
    held, broken = relations["bfloat16", "softmax_sums_to_one"], relations["float32", "rope_keeps_pair_norms"]
    assert (held["outcome"], held["examples"], held["ops"], held["rerun"]) == ("passed", 12, ["softmax"], "")
    assert broken["outcome"] == "failed" and "pair norm" in broken["message"] and "test_relation_holds" in broken["rerun"]
    softcap = _result(doc, "float32", "softcap")
    assert (softcap["outcome"], softcap["deviation"], softcap["max_ulps"]) == ("known deviation", "fast tanh, accepted", 40.0)
    assert _result(doc, "bfloat16", "rope")["deviation"] == ""
    assert [(d["op"], d["status"]) for d in doc["deviations"]] == [("softcap", "excused"), ("silu", "conforms"),
                                                                  ("rope", "unmatched")]
    assert doc["problems"] == [{"test": "test_matches_oracle[torch-float32-sigmoid]", "phase": "call",
                                "message": "ContractViolation: sigmoid returned dtype float64, expected float32"}]


def test_what_broke_comes_first_then_failures_with_violated_theorems(page):
    broken = _section(page, "broken", "failures")
    assert page.index('id="broken"') < page.index('id="failures"')
    assert "test_matches_oracle[torch-float32-sigmoid]" in broken and "exited 6" in broken
    failures = _section(page, "failures", "deviations")
    assert "rope_keeps_pair_norms" in failures and "pair norm: at (0, 1)" in failures
    assert "test_relations::test_relation_holds" in html.unescape(failures)
    assert "softcap" not in failures  # excused: listed under known deviations instead


def test_known_deviations_show_the_reason_and_the_entries_to_review(page):
    section = _section(page, "deviations", "conformance")
    assert "softcap" in section and "fast tanh, accepted" in section and "40 ULPs against 9.5" in section
    assert "matches no test" in section and "float16" in section  # the unmatched entry
    assert "no longer deviates" in section and "was a fast exp" in section  # the stale one


def test_the_theorem_matrix_shows_held_and_violated(page):
    table = page[page.index('id="theorem-table"'):]
    table = table[:table.index("</table>")]
    cells = dict(re.findall(r'data-relation="(\w+)">.*?<td class="cell (\w+)"', table, re.DOTALL))
    assert "violated" in table and "held" in table
    assert set(cells) == {"softmax_sums_to_one", "rope_keeps_pair_norms"}


def test_the_serving_section_gives_per_backend_and_dtype_what_was_checked_and_the_worst_row(page):
    section = _section(page, "serving", "environment")
    for text in ("184", "43", "position 26 (decode)", "position 10 (prefill chunk)", "0.069 / 0.064",
                 "chunking (3), wrap-around (2), mixed batch (1)"):
        assert text in section, text
    assert "reuse (0)" not in section


def test_the_page_is_self_contained_with_inline_svg_charts(page):
    assert page.count("<svg") == 4  # a histogram per backend x dtype, a forward chart per dtype
    assert not re.search(r"\b(?:src|href)\s*=\s*[\"']?\s*(?:https?:)?//", page, re.IGNORECASE)
    assert "http://" not in page and "https://" not in page
    assert "<link" not in page and "<img" not in page and "<script src" not in page and "@import" not in page


def test_everything_from_the_document_is_escaped(page):
    assert HOSTILE not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_merge_shows_both_backends_side_by_side(doc, tmp_path, capsys):
    torch_path = report.dump(doc, tmp_path / "torch.json")
    jax_path = report.dump(report.document(make_recorder("jax"), report.environment()), tmp_path / "jax.json")
    out = tmp_path / "merged.html"
    assert main(["merge", str(out), str(torch_path), str(jax_path)]) == 0
    assert "2 reports: jax, torch" in capsys.readouterr().out
    page = out.read_text()
    header = page[page.index('id="matrix-table"'):page.index("</thead>", page.index('id="matrix-table"'))]
    assert header.count(">torch</th>") == 2 and header.count(">jax</th>") == 2  # per dtype, side by side
    assert matrix(page)["rope"] == ["warn", "warn", "fail", "fail"]
    failures = _section(page, "failures", "conformance")
    assert ROPE_COMMAND in html.unescape(failures) and ROPE_COMMAND.replace("torch", "jax") in html.unescape(failures)


def test_the_same_backend_from_two_machines_is_told_apart(doc, tmp_path):
    a, b = report.dump(doc, tmp_path / "h100.json"), report.dump(doc, tmp_path / "a100.json")
    out = tmp_path / "page.html"
    assert main(["merge", str(out), str(a), str(b)]) == 0
    page = out.read_text()
    assert "torch · h100" in page and "torch · a100" in page
    same = report.render([doc, doc])  # labelled by their environments: both "ci"
    assert "torch · ci (1)" in same and "torch · ci (2)" in same


def test_a_document_without_a_label_is_named_by_its_backends():
    unlabelled = {**make_document("jax"), "environment": report.environment()}
    both = report.document(make_recorder("jax"), report.environment())
    both["results"] += make_document("torch")["results"]
    subtitle = re.search(r'<p class="muted">\s*(.*?)\n', report.render([unlabelled])).group(1)
    assert subtitle == "jax."
    subtitle = re.search(r'<p class="muted">\s*(.*?)\n', report.render([unlabelled, both])).group(1)
    assert subtitle == "jax; jax, torch."


def test_the_command_names_a_bad_input_file(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "other", "version": 1}))
    assert main(["html", str(tmp_path / "out.html"), str(bad)]) == 2
    assert str(bad) in capsys.readouterr().err
    assert not (tmp_path / "out.html").exists()


def test_each_backends_unsupported_ops_and_serving_are_one_line(page):
    section = _section(page, "conformance", "matrix")
    assert section.count("not implemented") == 1 and "1 op not implemented: linear" in section


def test_a_quantile_that_reaches_an_infinite_error_reads_inf():
    """numpy interpolates towards an inf as inf - inf, NaN: the report's p99 of a result with an infinite
    error is inf, its median the finite errors' where the inf is past it."""
    record = OpRecord("numpy", "float32", "linear", per_example=[1.0, 2.0, 3.0, math.inf])
    assert record.quantile(0.99) == math.inf and record.quantile(0.5) == 2.5
