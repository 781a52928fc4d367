"""Invariance verdicts (invariance.py): the same logits whatever the run, the batch or the chunking, and
op by op which kernel is not batch-invariant.  Beside accuracy, never mixed into it: a session may be
accurate and still vary.  A relation the adapter claims (``invariance``) fails the run when it does not
hold; one it does not claim is measured and reported only.

On the serving test's checkpoint and schedules (test_serving.py): a small fixed schedule in each dtype
(invariance.fixed), then drawn schedules in the first dtype tested, as the serving test does (a
sixteenth of the profile's examples: each schedule plays the model several times over), unless the
relation is unclaimed and the fixed schedule already varies.
"""

from __future__ import annotations

import pytest
from hypothesis import currently_in_test_context, given, settings, target

from gemma4_conformance.adapters import DTYPES
from gemma4_conformance.adapters.contract import ContractViolation
from gemma4_conformance.composition.graph import missing_ops
from gemma4_conformance.report.record import UnsupportedSkip
from gemma4_conformance.spec.model import nodes

from .invariance import RELATIONS, InvarianceRecord, Plays, check, claims, fixed, op_invariance
from .judging import rerun_command
from .serving import EXAMPLES_SHARE, SERVING_DTYPES, case_json, normalize, schedules, validate
from .test_serving import documents  # noqa: F401 - the serving test's checkpoint and documents


@pytest.fixture(scope="session")
def plays():
    """The plays the three relations share (invariance.Plays), for the whole run."""
    return Plays()


OP_TOKENS = 11  # a forward past the sliding window (8 on the CI checkpoint), so that its mask cuts


@pytest.mark.parametrize("invariance", RELATIONS)
@pytest.mark.parametrize("invariance_dtype", SERVING_DTYPES)
def test_invariance(request, backend, adapter, invariance_dtype, invariance, documents, plays):  # noqa: F811
    dtype = invariance_dtype
    if dtype not in adapter.dtypes or dtype not in request.config.conformance_dtypes:
        pytest.skip(f"{adapter.name} is not tested in {dtype} here")
    record = request.config.conformance_recorder.invariance.setdefault(
        (adapter.name, dtype, invariance),
        InvarianceRecord(adapter.name, dtype, invariance, claimed=invariance in claims(adapter)))
    missing = missing_ops(adapter)
    if missing and not hasattr(adapter, "session"):
        record.outcome = "unsupported"
        pytest.skip(f"{adapter.name} has no session and does not implement {', '.join(missing)}")

    def one(schedule, traced=False):
        command = rerun_command(request.node, backend, schedule)
        try:
            # Only the difference the record keeps is located: each costs two traced plays, unless the
            # schedule was played traced from the start (the fixed one, the likeliest to differ).
            verdict = check(invariance, adapter, schedule, documents, dtype, plays, locate=not record.message,
                            traced=traced)
        except ContractViolation as e:
            record.outcome, record.message, record.rerun = "errored", str(e), command
            raise ContractViolation(f"{e}\n  schedule: {case_json(schedule)}\n  rerun: {command}") from None
        record.add(verdict)
        if currently_in_test_context():  # a drawn schedule: search towards more differing rows
            target(float(sum(d.rows for d in verdict.differences)), label="differing rows")
        if verdict.differences:
            graph = nodes(documents.config)
            message = verdict.message(invariance, dtype, graph)
            record.varied(message, command, verdict.first(graph))
            if record.claimed:
                pytest.fail(f"{message}\n  {adapter.name} claims it (invariance = {sorted(claims(adapter))})"
                            f"\n  schedule: {case_json(schedule)}\n  rerun: {command}", pytrace=False)

    case = request.config.conformance_case
    if case is not None:
        try:
            schedule = validate(case, documents.window)
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None
        one(schedule)
    else:
        one(normalize(fixed(documents.window), documents.window), traced=True)
        tested = [d for d in SERVING_DTYPES if d in adapter.dtypes and d in request.config.conformance_dtypes]
        # Drawn schedules search for a schedule that breaks the relation: one the adapter does not claim,
        # seen to vary already, is settled (it varies, and never fails the run), so its plays go elsewhere.
        if dtype == tested[0] and record.outcome != "varies":
            @settings(max_examples=max(1, settings.default.max_examples // (2 * EXAMPLES_SHARE)))
            @given(schedules(documents.window))
            def drawn(schedule):
                one(schedule)

            drawn()
    if record.outcome == "not run":
        record.outcome = "held"


@pytest.mark.parametrize("invariance_dtype", DTYPES)
def test_op_batch_invariance(request, backend, adapter, invariance_dtype, documents):  # noqa: F811
    """Each op of a forward at its first nodes, on its rows alone (and the linear family's in blocks)
    against in the whole call: where a session's batch or chunk relation breaks, which kernel does.
    A measurement for the report, never a failure: a session need not pack sequences into one call
    (transformers' runs each alone, batch-invariant over kernels that are not)."""
    dtype = invariance_dtype
    if dtype not in adapter.dtypes or dtype not in request.config.conformance_dtypes:
        pytest.skip(f"{adapter.name} is not tested in {dtype} here")
    missing = missing_ops(adapter)
    if missing:  # the check composes a forward of the adapter's own ops
        raise UnsupportedSkip(f"{adapter.name} does not implement {', '.join(missing)}")
    try:
        records = op_invariance(adapter, documents, dtype, OP_TOKENS)
    except ContractViolation as e:
        raise ContractViolation(f"{e}\n  rerun: {rerun_command(request.node, backend)}") from None
    for r in records:
        request.config.conformance_recorder.op_invariance[r.backend, r.dtype, r.op] = r
    checked = {r.op for r in records}
    assert {"linear", "lm_head", "sliding_gqa", "causal_gqa"} <= checked, \
        f"only {sorted(checked)} were checked: the graph's op names changed?"  # the suite's own check broke
