"""Invariance verdicts: claims, not guesses.  A correct engine that claims nothing never fails on
invariance, one that claims all three and holds them passes, a claim that breaks fails the run
(exit 1) with a rerun command that fails again, an unknown claim is a usage error; the bitwise
comparison and the op-level check find what they must."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from gemma4_conformance.adapters import AdapterError, load
from gemma4_conformance.checkpoints import checkpoint, generate
from gemma4_conformance.plugin import EXIT_CONFORMANT, EXIT_NOT_CONFORMANT
from gemma4_conformance.properties.invariance import (
    Difference,
    InvarianceRecord,
    OpInvariance,
    OpInvarianceRecord,
    Plays,
    Verdict,
    check,
    compare,
    fixed,
)
from gemma4_conformance.report import data, html
from gemma4_conformance.properties import serving
from gemma4_conformance.properties.serving import Documents, play
from gemma4_conformance.report.record import Recorder, invariance_lines
from gemma4_conformance.spec.model import nodes
from tests.invariance_mutants import ADAPTERS, MUTANTS, ROW_BY_ROW
from tests.test_plugin import rerun_elsewhere, suite

ROW_BY_ROW_SPEC = "tests.invariance_mutants:ADAPTERS.row_by_row"


def test_an_engine_that_claims_nothing_never_fails_on_invariance(tmp_path):
    """The numpy session varies with the batch and the chunking (BLAS picks its kernel by M): measured,
    reported, and the run is conformant."""
    status, out, doc = suite(tmp_path, "--backend=tests.invariance_mutants:ADAPTERS.claims_nothing", "-k", "invariance")
    assert status == EXIT_CONFORMANT, out[-3000:]
    entries = {e["relation"]: e for e in doc["invariance"]}
    assert set(entries) == {"run", "batch", "chunk"} and not any(e["claimed"] for e in entries.values())
    assert {e["outcome"] for e in entries.values()} <= {"held", "varies"}
    varies = [e for e in entries.values() if e["outcome"] == "varies"]
    assert varies, "the numpy session is expected to vary somewhere; else this test cannot tell a failure"
    for e in varies:
        assert e["differing"] and e["worst"]["rows"] and e["worst"]["ulps"] > 0 and "--case=" in e["rerun"]
    assert "invariance:batch" in out
    page = (tmp_path / "report.html").read_text()
    assert 'id="invariance"' in page and "varies" in page and "invariance claim" not in page


def test_an_engine_that_claims_all_three_and_holds_them_passes(tmp_path):
    status, out, doc = suite(tmp_path, f"--backend={ROW_BY_ROW_SPEC}", "-k", "invariance")
    assert status == EXIT_CONFORMANT, out[-3000:]
    assert {(e["relation"], e["claimed"], e["outcome"]) for e in doc["invariance"]} == {
        ("run", True, "held"), ("batch", True, "held"), ("chunk", True, "held")}
    assert doc["op_invariance"] and not any(e["differing"] for e in doc["op_invariance"])


def test_a_claim_that_breaks_fails_the_run_and_its_rerun_fails_again(tmp_path):
    mutant = "tests.invariance_mutants:ADAPTERS.keys_in_bf16_when_batch_large"
    status, out, doc = suite(tmp_path, f"--backend={mutant}", "-k", "test_invariance")
    assert status == EXIT_NOT_CONFORMANT, out[-3000:]
    entries = {e["relation"]: e for e in doc["invariance"]}
    assert {r: e["outcome"] for r, e in entries.items()} == {"run": "held", "batch": "failed", "chunk": "held"}
    assert ("breaks an invariance the engine claims; broken invariance claims: keys_in_bf16_when_batch_large "
            "float32 batch") in next(line for line in out.splitlines() if line.startswith("conformance exit status"))
    entry = entries["batch"]
    assert entry["claimed"] and entry["outcome"] == "failed" and entry["worst"]["ulps"] > 1
    assert "batch invariance" in entry["message"] and "rows differ" in entry["message"]
    page = (tmp_path / "report.html").read_text()
    assert "1 invariance claim broken" in page and "batch invariance — claimed, and it does not hold" in page
    done = rerun_elsewhere(tmp_path, entry["rerun"])
    assert done.returncode == EXIT_NOT_CONFORMANT and "claims it" in done.stdout, done.stdout[-3000:]


def test_every_sequence_is_held_to_the_batch_claim(tmp_path):
    """The prompt that joins a decoding sequence takes the decode kernel; the sequence it joins does not
    vary.  Caught by the fixed schedule, in the ci profile."""
    mutant = "tests.invariance_mutants:ADAPTERS.decode_kernel_in_a_mixed_step"
    status, out, doc = suite(tmp_path, f"--backend={mutant}", "--dtype=float32", "--hypothesis-profile=ci",
                             "-k", "test_invariance and batch")
    assert status == EXIT_NOT_CONFORMANT, out[-3000:]
    entry = next(e for e in doc["invariance"] if e["relation"] == "batch")
    assert entry["outcome"] == "failed" and entry["worst"]["sequence"] == 1, entry
    assert "sequence 1, beside its partners against alone" in entry["message"]
    assert "sequence 0" not in entry["message"]
    assert entry["first_node"].startswith("layers.0.attention, ") and "breaks first at layers.0.attention" in out
    assert f"first at {entry['first_node']}" in (tmp_path / "report.html").read_text()


def test_a_known_deviation_excuses_a_broken_claim_with_its_reason(tmp_path):
    mutant = "tests.invariance_mutants:ADAPTERS.decode_kernel_in_a_mixed_step"
    reason = "a mixed step runs the decode kernel; tracked in engine#7"
    status, out, doc = suite(tmp_path, f"--backend={mutant}", "-k", "test_invariance and batch", deviations=(
        f"backend: decode_kernel_in_a_mixed_step\ndeviations:\n  - op: invariance:batch\n    dtype: float32\n"
        f"    reason: {reason}\n"))
    assert status == EXIT_CONFORMANT, out[-3000:]
    entry = next(e for e in doc["invariance"] if e["relation"] == "batch")
    assert (entry["outcome"], entry["deviation"]) == ("known deviation", reason)
    assert "invariance:batch known deviation (claimed)" in out and "broken invariance claims" not in out
    page = (tmp_path / "report.html").read_text()
    assert "batch invariance (claimed)" in page and reason in page and "invariance claim broken" not in page


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    path = generate.write_checkpoint(tmp_path_factory.mktemp("small"), generate.small_config())
    return Documents(checkpoint.load(path), checkpoint=str(path))


def test_a_difference_is_located_at_the_first_node_where_the_traces_part(documents):
    """The mixed-step mutant's second sequence, traced beside its partner and alone: the bits part first at
    the first layer's attention.  A session without traced_step cannot say where."""
    mutant, schedule = ADAPTERS.decode_kernel_in_a_mixed_step, fixed(documents.window)
    verdict = check("batch", mutant, schedule, documents, "float32", Plays(), locate=True)
    [found] = verdict.differences
    assert (found.sequence, found.node) == (1, "layers.0.attention") and 0 < found.node_rows <= found.rows
    assert f"breaks first at layers.0.attention, {found.node_rows} rows (sequence 1)" in verdict.message(
        "batch", "float32", nodes(documents.config))
    tokens = [documents.of(k, s) for k, s in enumerate(schedule["sequences"])]
    rows, _, _, traces = play(mutant, schedule, tokens, documents, "float32", trace=True)
    assert all(np.array_equal(trace["logits"], r) for trace, r in zip(traces, rows))  # each sequence its own rows

    class Untraced:  # an engine's own session, which gives no trace
        def __init__(self, session):
            self.step, self.release = session.step, session.release

    untraced = SimpleNamespace(name=mutant.name, session=lambda *a, **k: Untraced(mutant.session(*a, **k)))
    [found] = check("batch", untraced, schedule, documents, "float32", Plays(), locate=True).differences
    assert (found.sequence, found.node) == (1, "")


def test_a_schedule_played_traced_from_the_start_is_located_without_replaying(documents, monkeypatch):
    """Where a traced step is the plain step (the composed session's), a check played traced from the start
    (the fixed schedule's) names the same node as one that replays both sides traced, and plays no more
    than a check that locates nothing.  An engine's session that does not say its traced steps are plain is
    played plain, and replayed to locate."""
    opened = []
    open_session = serving.open_session
    monkeypatch.setattr(serving, "open_session", lambda *a, **k: opened.append(a) or open_session(*a, **k))
    mutant, schedule = ADAPTERS.decode_kernel_in_a_mixed_step, fixed(documents.window)

    class Engine:  # an engine's own session with traced_step, which does not say it is the plain step
        def __init__(self, session):
            self.step, self.release, self.traced_step = session.step, session.release, session.traced_step

    engine = SimpleNamespace(name=mutant.name, session=lambda *a, **k: Engine(mutant.session(*a, **k)))
    ways = {"plain": {}, "located": {"locate": True}, "traced": {"locate": True, "traced": True}}
    plays = {}
    for adapter in (mutant, engine):
        for way, options in ways.items():
            opened.clear()
            verdict = check("batch", adapter, schedule, documents, "float32", Plays(), **options)
            plays[adapter is engine, way] = len(opened), [(d.sequence, d.node) for d in verdict.differences]
    located = [(1, "layers.0.attention")]
    assert plays[False, "traced"] == (plays[False, "plain"][0], located)
    assert plays[False, "located"] == (plays[False, "plain"][0] + 2, located)
    assert plays[True, "traced"] == plays[True, "located"] == (plays[True, "plain"][0] + 2, located)


def test_each_mutant_breaks_only_under_a_claim():
    assert all(m.invariance and m.invariance < ROW_BY_ROW.invariance for m in MUTANTS)


@pytest.mark.parametrize("claims", [{"batch", "determinism"}, "run"])
def test_an_unknown_claim_is_refused_naming_the_known_ones(claims, monkeypatch):
    monkeypatch.setattr(ROW_BY_ROW, "invariance", claims)
    with pytest.raises(AdapterError, match="claims the invariance .*run, batch, chunk"):
        load(ROW_BY_ROW_SPEC)


def test_an_unknown_claim_is_a_usage_error(tmp_path):
    status, out, _ = suite(tmp_path, "--backend=tests.test_invariance:CLAIMS_TOO_MUCH", "-k", "invariance")
    assert status == 4 and "--backend" in out and "claims the invariance" in out, out[-3000:]


class CLAIMS_TOO_MUCH:  # noqa: N801 - loaded by path above
    name, dtypes, invariance = "too-much", ("float32",), {"run", "bitwise"}


def test_compare_counts_rows_bitwise_and_measures_ulps():
    a = np.zeros((4, 3), np.float32)
    b = a.copy()
    assert compare(a, b, "float32", 0, "") is None
    b[1, 2], b[3, 0] = np.nextafter(np.float32(0), np.float32(1)), -0.0
    found = compare(a, b, "float32", 5, "x")
    assert (found.sequence, found.position, found.rows) == (5, 1, 2)  # -0.0 differs in its bits, by 0 ULPs
    assert found.ulps == 1


def test_a_difference_is_measured_at_the_rows_scale_as_accuracy_is_and_value_by_value():
    """8.2e-6 on a row of logits up to 19.9 is about 4 ULPs at the row's scale (ulp(19.9) = 2^-19), and
    thousands of float32 values apart where it falls near zero."""
    a = np.array([[19.9, 1e-3, -2.0]], np.float32)
    b = a.copy()
    b[0, 1] += np.float32(8.2e-6)
    found = compare(b, a, "float32", 1, "beside its partners against alone")
    assert found.scaled == pytest.approx(8.2e-6 / 2.0 ** -19, rel=1e-2) and found.ulps > 1000
    message = Verdict(3, [found]).message("batch", "float32")
    assert f"by up to 4.3 ULPs at the row's scale ({found.ulps:.3g} value by value)" in message
    record = InvarianceRecord("b", "float32", "batch", claimed=True)
    record.add(Verdict(3, [found]))
    assert "4.3 ULPs at the row's scale" in "\n".join(invariance_lines([record], []))


def test_the_op_check_finds_a_kernel_chosen_by_the_number_of_rows():
    """linear in two K halves from 4 rows: each row alone is the other kernel; 3 rows still the same."""
    ops = OpInvariance(MUTANTS[0], "float32")
    rng = np.random.default_rng(0)
    W, x = rng.standard_normal((16, 64)).astype(np.float32), rng.standard_normal((6, 64)).astype(np.float32)
    ops.op("layers.0.q", "linear", W, x)
    record = ops.records["linear"]
    assert record.differing and record.where.startswith("layers.0.q: rows 0..0 alone against in a call of 6")
    held = OpInvariance(ROW_BY_ROW, "float32")
    held.op("layers.0.q", "linear", W, x)
    assert held.records["linear"].held and held.records["linear"].rows == 6 + 6 + 6


def test_the_op_check_reports_run_variance_as_run_variance_not_batch_dependence():
    """rmsnorm summing in a random order differs from itself on the same rows: not batch dependence."""
    ops = OpInvariance(ADAPTERS.rmsnorm_in_random_order, "float32")
    x = np.random.default_rng(0).standard_normal((6, 256)).astype(np.float32)
    ops.op("layers.0.input_layernorm", "rmsnorm", 1e-6, x, np.ones(256, np.float32))
    record = ops.records["rmsnorm"]
    assert record.held and not record.repeats and record.repeated == 6 and record.unrepeated
    assert record.run_where == "layers.0.input_layernorm: the call of 6 rows repeated"
    lines = invariance_lines([], [record])
    assert not any("not batch-inv." in line for line in lines) and any(
        "varies run to run" in line and "rmsnorm" in line for line in lines), lines


def test_documents_without_the_invariance_keys_still_load_and_merge():
    doc = data.document(Recorder(), env={})
    assert doc["invariance"] == [] and doc["op_invariance"] == []
    old = {k: v for k, v in doc.items() if k not in ("invariance", "op_invariance")}
    assert data.validate(old) is old
    new = {**doc, "op_invariance": [{"backend": "b", "dtype": "float32", "op": "linear", "nodes": 2, "rows": 6,
                                     "differing": 1, "ulps": 3.0, "where": "layers.0.q: rows 0..0 alone"}]}
    assert "Invariance was not tested." in html.render([old])
    assert "linear (3 ULPs; first at layers.0.q: rows 0..0 alone)" in html.render([old, new])
    scaled = {**new, "op_invariance": [{**new["op_invariance"][0], "scaled": 0.5}]}
    assert "linear (0.5 ULPs at the row&#39;s scale, 3 value by value; first at layers.0.q" in html.render([scaled])
    run = {**new, "op_invariance": [{**new["op_invariance"][0], "differing": 0, "repeated": 6, "unrepeated": 4,
                                     "run_where": "layers.0.q: the call of 6 rows repeated"}]}
    assert "varies run to run: linear (4 of 6 rows; first at layers.0.q: the call of 6 rows repeated)" in \
        html.render([run])
    with pytest.raises(data.ReportError, match="invariance"):
        data.validate({**doc, "invariance": [{"backend": "x"}]})


def test_an_xdist_worker_sends_its_invariance_records_and_an_older_one_sends_none():
    worker = Recorder()
    record = InvarianceRecord("b", "float32", "batch", claimed=True, outcome="failed", schedules=2, rows=14,
                              differing=3, worst=Difference(0, 10, 3, 4.0, 1.5e4, "beside its partners against alone",
                                                            {"sequences": []}), message="m", rerun="r")
    worker.invariance["b", "float32", "batch"] = record
    worker.op_invariance["b", "float32", "linear"] = OpInvarianceRecord("b", "float32", "linear", 2, 36, 4, 2.0, 9.0, "w")
    controller = Recorder()
    controller.merge(json.loads(json.dumps(worker.export())))
    assert controller.invariance == worker.invariance and controller.op_invariance == worker.op_invariance
    older = {k: v for k, v in worker.export().items() if k not in ("invariance", "op_invariance")}
    Recorder().merge(older)
