"""Lean's real operations are total, and so are the oracles: ``x / 0 = 0``, ``Real.sqrt`` of a negative
number is 0, ``Real.rpow`` is defined for every base.  On the inputs where that decides the value (a
norm over a zero row or with eps <= 0, inv_freq with denom = 0 or theta <= 0, softcap 0, attention
with nothing visible), each oracle gives what its Lean definition computes, each enclosure declines
or encloses it, and ``--case`` with such an input ends in a verdict through the numpy backend, never
in a traceback.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from gemma4_conformance import spec
from gemma4_conformance.properties.table import build
from tests.test_enclosures import assert_encloses
from tests.test_usage_errors import BASE, server


def values(v):
    return {"values": v}


X = values([[0.0, 0.0, 0.0], [2.0, 2.0, 2.0]])  # a zero row, and a row of mean square 4 and sum of squares 12
W = values([1.0, 2.0, 3.0])
ATTENTION = {"q": values([[[[1.0, 0.5]]]]), "k": values([[[1.0, 0.0]], [[0.5, 1.0]]]),
             "v": values([[[1.0, 2.0]], [[3.0, 4.0]]])}
ZEROS = [[0.0] * 3] * 2

# (op, case, Lean's value), each worked out from the Lean definition with x / 0 = 0 and Real.sqrt a = 0 for a <= 0.
LEAN_VALUES = [
    # Real.sqrt (0 + 0) = 0 on the zero row; Real.sqrt (4 - 3) = 1
    ("rms", {"args": {"eps": -3.0, "x": X}}, [0.0, 1.0]),
    # H = 0: (∑ over nothing) / 0 = 0, so Real.sqrt (0 + 1/4) = 1/2
    ("rms", {"args": {"eps": 0.25, "x": values([[], []])}}, [0.5, 0.5]),
    # 0 / Real.sqrt 0 = 0; 2 / Real.sqrt 4 * w = w
    ("rmsnorm", {"args": {"eps": 0.0, "x": X, "w": W}}, [[0.0] * 3, [1.0, 2.0, 3.0]]),
    ("rmsnorm", {"args": {"eps": -3.0, "x": X, "w": W}}, [[0.0] * 3, [2.0, 4.0, 6.0]]),
    ("rmsnorm_offset", {"args": {"eps": 0.0, "x": X, "w": W}}, [[0.0] * 3, [2.0, 3.0, 4.0]]),
    # Real.sqrt (4 - 4) = 0: the nonzero row divides by 0 too
    ("rmsnorm_unit", {"args": {"eps": -4.0, "x": X}}, ZEROS),
    ("rmsnorm_gated", {"args": {"eps": 0.0, "x": X, "z": values([[5.0] * 3, [0.0] * 3]), "w": W}}, ZEROS),
    # Real.sqrt (12 - 8) = 2
    ("l2norm", {"args": {"eps": -8.0, "x": X}}, [[0.0] * 3, [1.0] * 3]),
    ("l2norm", {"args": {"eps": -20.0, "x": X}}, ZEROS),
    ("softmax", {"args": {"s": values([[1.0, 2.0, 3.0]]), "visible": {"pattern": "none", "seed": 0}}}, [[0.0] * 3]),
    # window 0 sees no key: every weight 0
    ("sliding_gqa", {"args": {"scale": 1.0, "window": 0, "pos": [1], **ATTENTION}}, [[[[0.0, 0.0]]]]),
    # 2i / 0 = 0, theta ^ (-0) = 1 for i < active
    ("inv_freq", {"args": {"theta": 10000.0, "denom": 0, "active": 2, "i": [0, 1, 2]}}, [1.0, 1.0, 0.0]),
    # 0 ^ 0 = 1, 0 ^ y = 0 for y ≠ 0
    ("inv_freq", {"args": {"theta": 0.0, "denom": 4, "active": 2, "i": [0, 1, 2]}}, [1.0, 0.0, 0.0]),
    # (-4) ^ (-i) = 4 ^ (-i) cos (-i π) (Real.rpow_def_of_neg): the integer powers 1, -1/4, 1/16
    ("inv_freq", {"args": {"theta": -4.0, "denom": 2, "active": 3, "i": [0, 1, 2]}}, [1.0, -0.25, 0.0625]),
    # 0 * tanh (x / 0) = 0
    ("softcap", {"args": {"c": 0.0, "x": values([[1.0, -2.0, 0.0]])}}, [[0.0] * 3]),
    ("lm_head", {"args": {"mul": 1.0, "cap": 0.0, "W": values([[1.0, 2.0], [0.0, 1.0]]), "x": values([[1.0, 3.0]])},
                 "cancel": None}, [[0.0, 0.0]]),
]
IDS = [f"{op}-{i}" for i, (op, _, _) in enumerate(LEAN_VALUES)]


@pytest.mark.parametrize("op, case, lean", LEAN_VALUES, ids=IDS)
def test_the_oracle_gives_leans_value(op, case, lean):
    got = spec.round_to(spec.ORACLES[op](*build(op, case, "float64")), "float64")
    assert got.tolist() == lean


def test_rope_with_denom_zero_rotates_every_active_pair_by_the_position():
    """invFreq theta 0 active i = 1 for i < active: the rotation of theta = 1, whose powers are all 1."""
    x = np.arange(1.0, 9.0).reshape(1, 8)
    pos = np.array([3])
    assert (spec.rope(10000.0, 8, 0, 3, pos, x) == spec.rope(1.0, 8, 8, 3, pos, x)).all()


@pytest.mark.parametrize("op, case, lean", [c for c in LEAN_VALUES if c[0] in spec.enclosures.ENCLOSURES],
                         ids=[i for i, c in zip(IDS, LEAN_VALUES) if c[0] in spec.enclosures.ENCLOSURES])
def test_the_enclosure_declines_or_encloses_leans_value(op, case, lean):
    for dtype in ("float32", "float64"):
        assert_encloses(op, build(op, case, dtype), dtype)


@pytest.fixture(scope="module")
def run_case(tmp_path_factory):
    with server(tmp_path_factory.mktemp("totality")) as run:
        yield lambda op, case: run([*BASE, f"--ops={op}", "--dtype=float32", f"--case={json.dumps(case)}",
                                    "-k", "test_matches_oracle"])


@pytest.mark.parametrize("op, case, lean", LEAN_VALUES, ids=IDS)
def test_a_case_there_ends_in_a_verdict(run_case, op, case, lean):
    """Exit 0 (conformant) or 1 (a failure: numpy's float arithmetic gives NaN for 0 / 0), not 6."""
    rc, out = run_case(op, case)
    assert rc in (0, 1) and "Traceback" not in out and "Error" not in out, out[-3000:]
    assert "conformance exit status" in out and f" {op} " in out, out[-3000:]  # the op's row in the summary
