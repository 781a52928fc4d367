"""The spec's theorems, checked on the backend alone (see relations.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from .harness import case_json
from .relations import RELATIONS


def test_relation_holds(request, backend, adapter, dtype, relation):
    rule = RELATIONS[relation]
    missing = [op for op in rule.ops if not hasattr(adapter, op)]
    if missing:
        pytest.skip(f"{adapter.name} does not implement {', '.join(missing)}")

    def check(case):
        failures = rule.check(adapter, case, dtype)
        if failures:
            pytest.fail("\n".join(failures) + f"\n  rerun: pytest '{request.node.nodeid}' --backend={backend} "
                        f"--case='{case_json(case)}'", pytrace=False)

    if request.config.conformance_case is not None:
        check(request.config.conformance_case)
    else:
        given(st.data())(lambda data: check(data.draw(rule.cases(dtype), label="case")))()
