"""The suite catches wrong backends: every op has realistic mutants, each of which some drawn example
must fail, and adapters that break the contract (raise, wrong shape, wrong dtype) are reported as such.

A mutant is run in the dtype where its bug is a real bug: bf16 accumulation only matters in bf16, an
erf GELU differs from the tanh one by about 1e-3 relatively, which only float32 resolves.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings, target

from gemma4_conformance.adapters import numpy_backend
from gemma4_conformance.adapters.contract import ContractViolation
from gemma4_conformance.properties.judging import BeyondDeclared, case_json, judge
from gemma4_conformance.properties.table import cases, edge_cases
from gemma4_conformance.spec import OP_NAMES
from tests import mutants as m

# Examples drawn per mutant at most; a mutant is usually caught within a few, and the search stops there.
MAX_EXAMPLES = 100
MUTANTS = m.MUTANTS



class _Caught(Exception):
    """Raised at the first example a mutant fails, so that the search ends there (no shrinking)."""


def _failures(adapter, op, case, dtype) -> tuple[list[str], float]:
    try:
        verdict = judge(adapter, op, case, dtype)
    except ContractViolation as e:
        return [str(e)], 0.0
    except BeyondDeclared:  # outside what the adapter's declared formats hold: not judged
        return [], 0.0
    error, allowed = verdict.worst
    return verdict.failures, error / allowed


def first_failure(adapter, op: str, dtype: str) -> tuple[int, dict, str] | None:
    """The first example ``adapter`` fails, the edge cases first as in the suite: how many examples were
    checked up to it, the case, and why; or None."""
    for n, case in enumerate(edge_cases(op), 1):
        failures, _ = _failures(adapter, op, case, dtype)
        if failures:
            return n, case, failures[0]
    drawn = len(edge_cases(op))
    caught: list[tuple[int, dict, str]] = []

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate, Phase.target], suppress_health_check=list(HealthCheck))
    @given(case=cases(op, dtype))
    def search(case):
        nonlocal drawn
        drawn += 1
        failures, fraction = _failures(adapter, op, case, dtype)
        target(fraction, label="error / budget")
        if failures:
            caught.append((drawn, case, failures[0]))
            raise _Caught

    try:
        search()
    except _Caught:
        pass
    return caught[0] if caught else None


def test_every_op_has_a_mutant():
    missing = set(OP_NAMES) - {op for op, _, _ in MUTANTS}
    assert not missing, f"ops without a mutant: {sorted(missing)}"


@pytest.mark.parametrize("op, dtype, mutant", MUTANTS, ids=[f"{f.__name__}-{d}" for _, d, f in MUTANTS])
def test_mutant_is_caught(op, dtype, mutant):
    found = first_failure(m.MutantAdapter(op, mutant, m.DECLARING.get(mutant, numpy_backend)), op, dtype)
    if found is None:
        pytest.fail(f"mutant {mutant.__name__} of {op} survived {MAX_EXAMPLES} examples in {dtype}: "
                    f"no verdict failed and no contract check fired")
    drawn, case, _ = found
    # The failure is the mutant's: the reference passes the example that caught it.
    reference = judge(numpy_backend, op, case, dtype)
    assert reference.passed, (f"the numpy reference fails example {drawn}, which caught {mutant.__name__}, "
                              f"too: {reference.failures[0]}; case {case_json(case)}")


# x [3, 8] and W [5, 8]: a transposed result [5, 3] cannot pass for the contract's [3, 5].
LINEAR_CASE = {"args": {"W": {"shape": [5, 8], "dist": "normal", "log2": 0, "seed": 1},
                        "x": {"shape": [3, 8], "dist": "normal", "log2": 0, "seed": 2}}}


@pytest.mark.parametrize("broken, says", [
    (m.linear_raises, "raised RuntimeError: no kernel for this shape"),
    (m.linear_transposed, "returned shape (5, 3), expected (3, 5)"),
    (m.linear_left_in_float32, "returned dtype float32, expected bfloat16"),
], ids=["raises", "wrong_shape", "wrong_dtype"])
def test_contract_violation_names_the_op_and_the_breach(broken, says):
    adapter = m.MutantAdapter("linear", broken)
    with pytest.raises(ContractViolation) as violation:
        judge(adapter, "linear", LINEAR_CASE, "bfloat16")
    assert f"{adapter.name}.linear in bfloat16 {says}" == str(violation.value)
