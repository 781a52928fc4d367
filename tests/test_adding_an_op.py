"""docs/adding-an-op.md done at runtime: an elementwise tanh added by its oracle and contract line, one
entry and one budget is judged like every op: a correct implementation passes, a wrong one fails."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from mpmath import mp

from gemma4_conformance import spec
from gemma4_conformance.properties import budget, error_models, strategies, table
from gemma4_conformance.properties.judging import judge
from gemma4_conformance.spec.contract import Arg, OpContract
from gemma4_conformance.spec.exact import elementwise, oracle


@oracle
def tanh(x):
    """``tanh x = Real.tanh x``"""
    return elementwise(mp.tanh, x)


TANH_BUDGET = """
tanh:
  model: tanh(x) evaluated in A (fn) and rounded to D (0.5), relative to the result. Scale |y|.
  budget: {all: "0.5 + fn"}
"""


@pytest.fixture
def with_tanh(monkeypatch, tmp_path):
    """The registries with tanh added as the page adds it: spec (contract and oracle), the op table and
    tolerances.yaml."""
    monkeypatch.setitem(spec.CONTRACT, "tanh", OpContract("tanh", "tanh", "Basic", (Arg("x", "float", "..."),), "..."))
    monkeypatch.setitem(spec.ORACLES, "tanh", tanh)
    monkeypatch.setitem(table.OPS, "tanh", table.entry("tanh", error_models.exact_magnitude, table.elementwise,
                                                       strategies.elementwise))
    tolerances = tmp_path / "tolerances.yaml"
    tolerances.write_text(budget.TOLERANCES_PATH.read_text() + TANH_BUDGET)
    monkeypatch.setattr(budget, "TOLERANCES_PATH", tolerances)


class Engine:
    """An engine with only tanh, computed in float32 as engines do for the narrow dtypes."""

    name = "tanh-engine"

    def __init__(self, fn):
        self.fn = fn

    def tanh(self, x):
        return self.fn(x.astype(np.float32)).astype(x.dtype)


def cancelling(x):
    """tanh x = (e^2x - 1) / (e^2x + 1): e^2x - 1 cancels for small |x|."""
    e = np.exp(2 * x)
    return (e - 1) / (e + 1)


SMALL = {"args": {"x": {"values": [[1e-3, -2e-4, 0.25, -0.5]]}}}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_correct_tanh_passes(with_tanh, dtype):
    engine = Engine(np.tanh)
    assert judge(engine, "tanh", SMALL, dtype).passed

    @settings(max_examples=15, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=table.cases("tanh", dtype))
    def drawn(case):
        verdict = judge(engine, "tanh", case, dtype)
        assert verdict.passed, verdict.failures

    drawn()


def test_a_cancelling_tanh_fails(with_tanh):
    verdict = judge(Engine(cancelling), "tanh", SMALL, "float32")
    assert not verdict.passed and "ULPs at the op's scale > budget 6.5 (0.5 + fn)" in verdict.failures[0]
