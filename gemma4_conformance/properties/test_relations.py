"""The spec's theorems, checked on the backend alone (see relations.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from .harness import rerun_command
from .relations import RELATIONS


def test_relation_holds(request, backend, adapter, dtype, relation):
    rule = RELATIONS[relation]
    record = request.config.conformance_recorder.relation(adapter.name, dtype, relation, rule.ops)
    missing = [op for op in rule.ops if not hasattr(adapter, op)]
    if missing:
        record.outcome = "unsupported"
        pytest.skip(f"{adapter.name} does not implement {', '.join(missing)}")

    def check(case):
        record.examples += 1
        record.rerun = rerun_command(request.node, backend, case)  # kept if the adapter raises on it
        failures = rule.check(adapter, case, dtype)
        if failures:  # Hypothesis replays the minimal failing case last, so that is the one kept
            record.message = failures[0]
            pytest.fail("\n".join(failures) + f"\n  rerun: {record.rerun}", pytrace=False)

    try:
        if request.config.conformance_case is not None:
            check(request.config.conformance_case)
        else:
            given(st.data())(lambda data: check(data.draw(rule.cases(dtype), label="case")))()
    except pytest.fail.Exception:
        record.outcome = "failed"
        raise
    except Exception as e:  # the adapter raised, or the suite broke: not a conformance verdict
        record.outcome, record.message = "errored", f"{type(e).__name__}: {e}"
        raise
    record.outcome, record.rerun = "passed", ""
