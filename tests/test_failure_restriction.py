"""A failing example is reported from the oracle on the least part of the output that holds the
elements its message names, never the whole output (properties/judging.py, issue 33)."""

from __future__ import annotations

import numpy as np
import pytest

from gemma4_conformance import adapters
from gemma4_conformance.adapters.contract import call
from gemma4_conformance.properties import judging
from gemma4_conformance.spec import format_of


def _wrong_linear(dtype, shift):
    rng = np.random.default_rng(1)
    f = format_of(dtype)
    W, x = rng.standard_normal((256, 512)).astype(f.dtype), rng.standard_normal((6, 512)).astype(f.dtype)
    out = call(adapters.load("numpy"), "linear", (W, x), dtype).copy()
    out[2, 100] = shift(out[2, 100])  # one element far off, one a little: the first is the one named
    out[4, 7] = out[4, 7] * (1 + 8 * f.eps) + f.eps
    return (W, x), out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_failure_is_reported_from_a_restriction_with_the_whole_oracles_message(dtype, monkeypatch):
    args, out = _wrong_linear(dtype, lambda v: v * 1.5 + 1)
    whole = judging.assess("linear", args, out, dtype, first_stage=False)
    judged = []
    real = judging._by_oracle
    monkeypatch.setattr(judging, "_by_oracle", lambda entry, part, dtype, got: judged.append(got.size) or
                        real(entry, part, dtype, got))
    verdict = judging.assess("linear", args, out, dtype)
    assert not verdict.passed and verdict.failures == whole.failures
    assert "(2, 100)" in verdict.failures[0]
    assert judged and max(judged) < out.size / 10, f"the oracle judged {judged} of {out.size} outputs"
    assert judging.printed(verdict.max_error) == judging.printed(whole.max_error)


def test_a_nan_is_reported_without_the_oracle(monkeypatch):
    args, out = _wrong_linear("float32", lambda v: np.nan)
    monkeypatch.setattr(judging, "_by_oracle", lambda *a: pytest.fail("the oracle was called"))
    verdict = judging.assess("linear", args, out, "float32")
    assert verdict.failures[0].startswith("NaN in the output at (2, 100)")
