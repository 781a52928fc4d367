"""The judging's batched loops (properties/decision.py) decide as their one-answer loops do."""

import numpy as np
import pytest

from gemma4_conformance.properties import decision
from gemma4_conformance.properties.judging import zeroed_heads

SLACK = 2.0**-40


def _output(seed: int, shape=(3, 2, 4, 8)):
    """An attention output with its radii, scales and allowances: some radii 0, some past the allowance,
    some heads' scales far above their values (zeroing them is admitted), and an inf and a nan among the
    exact values or signed zeros, and an infinite radius, so that heads differ in every flag."""
    rng = np.random.default_rng(seed)
    exact = rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 3, shape)
    exact.flat[rng.integers(exact.size, size=2)] = [np.inf, np.nan] if seed % 3 == 0 else [0.0, -0.0]
    rad = np.where(rng.random(shape) < 0.3, 0.0, np.abs(exact) * 10.0 ** rng.integers(-6, 1, shape))
    rad.flat[rng.integers(exact.size)] = np.inf  # no bound: a nan excess at sign 0 (inf * 0)
    scale = np.abs(exact) * rng.uniform(0.5, 2, shape) * rng.choice([1.0, 2.0**12], (1, *shape[1:3], 1))
    absolute = rng.uniform(0, 1e-2, shape) * (seed % 2)
    return exact, rad, scale, absolute


@pytest.mark.parametrize("seed", range(12))
def test_zeroed_heads_are_judged_as_each_zeroed_answer_alone(seed):
    exact, rad, scale, absolute = _output(seed)
    heads, count = zeroed_heads(exact)
    flat = [np.ascontiguousarray(a).reshape(-1) for a in (exact, rad, scale, absolute)]
    allowed = float(np.random.default_rng(seed).uniform(0.5, 400))
    constants = (allowed, 11, -14, 65504.0, SLACK)
    states = decision.zeroed_heads_admits(heads, count, *flat, *constants)
    unit, judged = flat[2] * 2.0**-10 + 1e-30, np.isfinite(flat[0])
    for sign in (0.0, -1.0, 1.0):
        excess = decision.zeroed_heads_excess(heads, count, flat[0], flat[1], sign, SLACK, flat[3], unit, judged)
        for h in range(count):
            answer = np.where(heads == h, 0.0, flat[0])
            assert tuple(states[h]) == decision.admits(answer, *flat, *constants)
            alone = decision.tier2_excess(answer[None], flat[0], flat[1], sign, SLACK, flat[3], unit, judged)[0]
            assert excess[h] == alone or (np.isnan(excess[h]) and np.isnan(alone))
    assert len({tuple(s) for s in states}) > 1  # the heads differ: the split is exercised
