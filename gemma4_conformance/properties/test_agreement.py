"""Oracle agreement: every op of the backend, in every dtype, within its budget of the exact result."""

from __future__ import annotations

import math
from functools import partial

import pytest
from hypothesis import currently_in_test_context, given, reject
from hypothesis import strategies as st
from hypothesis import target

from gemma4_conformance.adapters import declared_formats
from gemma4_conformance.adapters.contract import ContractViolation, Refused, Unsupported
from gemma4_conformance.report.record import MIN_INFORMATIVE, UnsupportedSkip

from .judging import BeyondDeclared, judge, rerun_command
from .strategies import GEMMA_ATTENTION
from .table import OPS, edge_cases, real_size_cases
from .table import cases as drawn_cases

GLOBAL_HEAD_DIM = max(D for _, _, D in GEMMA_ATTENTION)  # Gemma 4's global (full-attention) layers'


def refusal(op: str, case: dict, error: Refused) -> str:
    """The verdict's line on arguments the adapter refused: at Gemma 4's global attention's head dimension,
    that this configuration cannot run it."""
    if OPS[op].attention is not None and case["args"]["q"]["shape"][-1] == GLOBAL_HEAD_DIM:
        return f"cannot run Gemma 4's global attention (head dimension {GLOBAL_HEAD_DIM}): {error}"
    return f"refused these arguments: {error}"


def check(request, backend, adapter, dtype, op, case):
    """Judge one case, record it, and fail with the evidence and the command that reruns it."""
    record = request.config.conformance_recorder(adapter.name, dtype, op)
    command = rerun_command(request.node, backend, case)
    try:
        verdict = judge(adapter, op, case, dtype)
    except Refused as e:  # a limit the adapter states, not a crash: unsupported, with why, and what to rerun
        record.outcome, record.message = "unsupported", refusal(op, case, e)
        record.worst_case, record.worst_command = case, command
        raise UnsupportedSkip(record.message) from None
    except Unsupported as e:
        record.outcome = "unsupported"
        raise UnsupportedSkip(str(e)) from None
    except ContractViolation as e:
        record.broke(str(e), case, command)
        raise ContractViolation(f"{e}\n  rerun: {command}") from None
    except BeyondDeclared as e:  # outside what the declaration covers: not judged, counted
        record.outside += 1
        if currently_in_test_context():
            reject()
        if request.config.conformance_case is not None:
            pytest.skip(f"not judged: {e}")
        return
    error, allowed = verdict.worst
    record.timed(verdict.seconds)
    record.judged(verdict.checked, verdict.by_oracle)
    record.declared(verdict.formats, verdict.declared_dominates)
    worst = record.add(error, allowed, case, command, verdict.informative)
    # A drawn example (not an edge case or a --case rerun) steers the search towards the budget's edge;
    # a non-finite error (a NaN or inf output) fails below, and Hypothesis refuses it as a target.
    if currently_in_test_context() and math.isfinite(error / allowed):
        target(error / allowed, label="error / budget")
    if not verdict.passed:
        record.fail(verdict.failures[0], worst)
        pytest.fail("\n".join(verdict.failures) + f"\n  rerun: {command}", pytrace=False)


def test_matches_oracle(request, backend, adapter, dtype, op):
    case = request.config.conformance_case
    if case is not None:
        check(request, backend, adapter, dtype, op, case)
    else:
        for edge in edge_cases(op) + real_size_cases(op):  # checked in every profile, before any drawn example
            check(request, backend, adapter, dtype, op, edge)

        # The cases for this adapter's formats, named as before: a derandomized profile seeds its draws from
        # the source of ``examples``, whose draws (and the failures they find) stay the same with the formats.
        cases = partial(drawn_cases, formats=declared_formats(adapter))

        @given(st.data())
        def examples(data):
            check(request, backend, adapter, dtype, op, data.draw(cases(op, dtype), label="case"))

        examples()
    record = request.config.conformance_recorder(adapter.name, dtype, op)
    record.outcome = "passed"
    if case is None and record.informative < MIN_INFORMATIVE:
        record.outcome = "not established"
        pytest.skip(f"not established: {record.informative} of {record.examples} examples were informative (an "
                    f"allowance that admits zeros or the sign flipped is no evidence); at least {MIN_INFORMATIVE} needed")
