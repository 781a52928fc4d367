"""The spec's theorems, checked on the backend alone (see relations.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gemma4_conformance.adapters import declared_formats
from gemma4_conformance.adapters.contract import Refused
from gemma4_conformance.report.record import UnsupportedSkip

from .judging import rerun_command
from .relations import RELATIONS


def test_relation_holds(request, backend, adapter, dtype, relation):
    rule = RELATIONS[relation]
    record = request.config.conformance_recorder.relation(adapter.name, dtype, relation, rule.ops)
    missing = [op for op in rule.ops if not hasattr(adapter, op)]
    if missing:
        record.outcome = "unsupported"
        raise UnsupportedSkip(f"{adapter.name} does not implement {', '.join(missing)}")

    # The outcome is settled as each example is checked, not from what Hypothesis raises at the end:
    # two distinct bugs come as one exception group. Hypothesis replays each minimal case last, so
    # that is the one kept; a break outweighs a failure.
    def check(case):
        record.examples += 1
        command = rerun_command(request.node, backend, case)
        try:
            failures = rule.check(adapter, case, dtype)
        except Refused as e:  # arguments beyond a limit the adapter states (test_agreement.refusal)
            record.outcome, record.message, record.rerun = "unsupported", f"refused these arguments: {e}", command
            raise UnsupportedSkip(record.message) from None
        except Exception as e:  # the adapter raised, or the suite broke: not a conformance verdict
            record.outcome, record.message, record.rerun = "errored", f"{type(e).__name__}: {e}", command
            raise
        if failures:
            if record.outcome != "errored":
                record.outcome, record.message, record.rerun = "failed", failures[0], command
            pytest.fail("\n".join(failures) + f"\n  rerun: {command}", pytrace=False)

    if request.config.conformance_case is not None:
        check(request.config.conformance_case)
    else:
        cases = rule.cases(dtype, declared_formats(adapter))
        given(st.data())(lambda data: check(data.draw(cases, label="case")))()
    record.outcome = "passed"
