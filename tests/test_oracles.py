"""The oracles themselves: their error is measured by evaluating each at p and 2p bits (precision
doubling), and the closed forms and identities of the Lean definitions hold."""

import numpy as np
import pytest
from mpmath import mp, mpf

from gemma4_conformance import spec
from gemma4_conformance.spec import CONTRACT, OP_NAMES, ORACLES

PRECISIONS = (53, 64, 128)
SLACK_BITS = 10


def normal(seed, shape, scale=1.0):
    return np.random.default_rng(seed).standard_normal(shape) * scale


# --- inputs for precision doubling: named cases per op, each a function returning the arguments ----

EXTREMES = np.array([0.0, 5e-324, -5e-324, 1e-300, -1e-300, 1e-30, -1e-30, 0.5, -0.5, 3.0, -3.0,
                     30.0, -30.0, 80.0, -80.0, 1e300, -1e300])
# geluTanh's negative tail (1 + tanh u cancelling for u << 0) is its own case.
GELU_EXTREMES = np.array([0.0, 5e-324, -5e-324, 1e-300, -1e-300, 1e-30, -1e-30, 0.5, -0.5, 3.0,
                          30.0, 80.0, 1e300])
# Even without that cancellation, exp(-2u) with u = sqrt(2/pi) (x + 0.044715 x^3) rounded loses log2|2u| bits:
# 7 at x = -12, 14 at x = -80 (where geluTanh is e^-36000, zero in every format), so the tail stops at -12.
GELU_NEGATIVE_TAIL = np.array([-3.0, -4.0, -5.0, -8.0, -10.0, -12.0])


def norm_rows(seed):
    """Rows of width 8: ordinary, near zero (where eps matters), zero, tiny, huge against tiny, subnormal."""
    return np.stack([normal(seed, 8), normal(seed + 1, 8, 1e-7), np.zeros(8), normal(seed + 2, 8, 1e-150),
                     np.array([1e150, 1e-150, -1e150, 3.0, -1e-300, 1e150, 0.0, 1.0]), np.full(8, 5e-324)])


OFFSET_W = np.array([-1.0, -1.0 + 2.0**-40, -(2.0**-60), 0.5, 2.0, -3.0, 1e-30, 0.0])  # 1 + w cancels


def norm_cases(op_args):
    """The same row families at eps from 1e-12 to 1e-1; ``op_args(eps, rows)`` builds the arguments."""
    cases = {"random": lambda: op_args(1e-6, normal(10, (3, 8)))}
    for eps in (1e-12, 1e-6, 1e-1):
        cases[f"near-zero rows eps={eps:g}"] = lambda eps=eps: op_args(eps, norm_rows(11))
    return cases


def orthonormal(seed, n):
    return np.linalg.qr(normal(seed, (n, n)))[0]


def nearly_orthogonal(seed):
    """Rows of x and of W from one orthonormal basis, scaled by 2^60: terms near 2^120 whose dot
    products cancel to about 2^67."""
    Q = orthonormal(seed, 8) * 2.0**60
    return Q[:3], Q[3:]


# Row t of x against row t of W gives the terms 4^a, 4^b, -4^b in Lean's order: a small term, then two
# huge ones that cancel, so the sum is 4^a.  The spreads 2(b - a) = 140 and 260 bits lie between 2p and
# 4p for every p in PRECISIONS.
SPREAD_X = np.array([[2.0**-20, 2.0**50, 2.0**50], [2.0**-50, 2.0**80, 2.0**80]])
SPREAD_W = np.array([[2.0**-20, 2.0**50, -(2.0**50)], [2.0**-50, 2.0**80, -(2.0**80)]])


def gate_up_nearly_orthogonal(seed):
    x, W = nearly_orthogonal(seed)
    return W[:2], W[2:4], x


def gqa(seed, S, L, large_logits):
    """q [S, 2, 2, 4], k and v [L, 2, 4]; with large_logits, |q . k| near 1e5 with near ties between keys."""
    q, k, v = normal(seed, (S, 2, 2, 4)), normal(seed + 1, (L, 2, 4)), normal(seed + 2, (L, 2, 4))
    if large_logits:
        q = q * 200
        k = normal(seed + 3, (1, 2, 4), 200) + k * 1e-3
    return q, k, v


def decode_inputs(qkv):
    q, k, v = qkv
    return q[0], k, v


SPREAD = "exponent spread 2p..4p"
LARGE_POSITIONS = "positions up to 262144"
LARGE_LOGITS = "logits near 1e5"
NEGATIVE_TAIL = "negative tail"

CASES = {
    "sigmoid": {"random": lambda: (normal(1, 16),), "extremes": lambda: (EXTREMES,)},
    "silu": {"random": lambda: (normal(2, 16),), "extremes": lambda: (EXTREMES,)},
    "gelu_tanh": {"random": lambda: (normal(3, 16),), "extremes": lambda: (GELU_EXTREMES,),
                  NEGATIVE_TAIL: lambda: (GELU_NEGATIVE_TAIL,)},
    "softcap": {"random": lambda: (30.0, normal(4, 16, 50)),
                "extremes": lambda: (30.0, np.concatenate([EXTREMES, [29.9, -29.9, 1e4, -1e4, 1.7e308]]))},
    "rms": norm_cases(lambda eps, x: (eps, x)),
    "rmsnorm": norm_cases(lambda eps, x: (eps, x, normal(20, 8))),
    "rmsnorm_offset": norm_cases(lambda eps, x: (eps, x, OFFSET_W)),
    "rmsnorm_unit": norm_cases(lambda eps, x: (eps, x)),
    "rmsnorm_gated": norm_cases(lambda eps, x: (eps, x, np.resize(EXTREMES[6:], x.shape), normal(21, 8))),
    "l2norm": norm_cases(lambda eps, x: (eps, x)),
    "inv_freq": {"sliding layers": lambda: (1e4, 256, 128, np.arange(130)),
                 "proportional": lambda: (1e6, 512, 64, np.arange(0, 256, 3)),
                 "denominator 1": lambda: (1e4, 1, 3, np.arange(5))},
    "rope": {"random": lambda: (1e4, 8, 8, 4, np.array([0, 1, 7, 63]), normal(30, (4, 8))),
             "partial proportional": lambda: (1e6, 8, 16, 2, np.array([0, 3, 100, 500]), normal(31, (4, 10))),
             LARGE_POSITIONS: lambda: (1e4, 8, 256, 4, np.array([262144, 262143, 131071, 99999]),
                                       normal(32, (4, 8)))},
    "rope_std": {"random": lambda: (1e4, 8, np.array([0, 1, 7, 63]), normal(33, (4, 8))),
                 "partial": lambda: (1e4, 4, np.array([0, 2, 50, 500]), normal(34, (4, 8))),
                 LARGE_POSITIONS: lambda: (1e4, 32, np.array([262144, 262143, 131071, 99999]),
                                           normal(35, (4, 32)))},
    "linear": {"random": lambda: (normal(40, (5, 8)), normal(41, (3, 8))),
               "huge nearly orthogonal rows": lambda: nearly_orthogonal(42)[::-1],
               SPREAD: lambda: (SPREAD_W, SPREAD_X)},
    "gate_up": {"random": lambda: (normal(43, (4, 8)), normal(44, (4, 8)), normal(45, (3, 8))),
                "huge nearly orthogonal rows": lambda: gate_up_nearly_orthogonal(46),
                SPREAD: lambda: (SPREAD_W, SPREAD_W[::-1], SPREAD_X)},
    "silu_mul": {"random": lambda: (normal(50, (3, 8)),),
                 "extremes": lambda: (np.concatenate([EXTREMES, normal(51, EXTREMES.size, 1e3)])[None],)},
    "gelu_mul": {"random": lambda: (normal(52, (3, 8)),),
                 "extremes": lambda: (np.concatenate([GELU_EXTREMES, normal(53, GELU_EXTREMES.size)])[None],),
                 NEGATIVE_TAIL: lambda: (np.concatenate([GELU_NEGATIVE_TAIL,
                                                         normal(54, GELU_NEGATIVE_TAIL.size)])[None],)},
    "residual": {"random": lambda: (1.0, normal(55, (3, 8)), normal(56, (3, 8))),
                 # row 0: x = fl(-0.7 h) leaves a residual far below |x|; row 1: 0.7 * 2^k is exact,
                 # so x + 0.7 h = 0 exactly
                 "cancellation": lambda: (0.7, np.stack([-(0.7 * normal(57, 8)), -(0.7 * 2.0 ** np.arange(-4, 4))]),
                                          np.stack([normal(57, 8), 2.0 ** np.arange(-4, 4)]))},
    "embed": {"random": lambda: (float(np.sqrt(3840)), normal(60, (6, 4)), np.array([0, 5, 2, 2])),
              "extremes": lambda: (62.0, np.array([[1e300, -1e-300, 5e-324, 0.0], [-1e-30, 1e30, 3.0, -0.5]]),
                                   np.array([1, 0, 1]))},
    "lm_head": {"random no cap": lambda: (1.0, None, normal(61, (6, 8)), normal(62, (3, 8))),
                "random cap 30": lambda: (1.0, 30.0, normal(63, (6, 8), 10), normal(64, (3, 8))),
                "huge nearly orthogonal rows": lambda: (0.5, None, *nearly_orthogonal(65)[::-1]),
                SPREAD: lambda: (1.0, None, SPREAD_W, SPREAD_X)},
    "softmax": {"random": lambda: (normal(70, (4, 6), 3),
                                   np.array([[1] * 6, [1, 0, 1, 1, 0, 1], [0] * 6, [0, 0, 1, 0, 0, 0]], dtype=bool)),
                "logits 1e4 and masks": lambda: (
                    np.array([[1e4, -1e4, 0.0, 1e4 - 1, 5.0, -5.0]] * 4),
                    np.array([[1] * 6, [0, 1, 1, 0, 1, 1], [0] * 6, [0, 1, 0, 0, 0, 0]], dtype=bool))},
    # scale 0.7 has a full 53-bit significand, so scale * (q . k) is rounded at every p
    "causal_gqa": {"random": lambda: (0.7, np.array([0, 2, 4]), *gqa(80, 3, 5, False)),
                   LARGE_LOGITS: lambda: (0.7, np.array([0, 2, 4]), *gqa(81, 3, 5, True))},
    "sliding_gqa": {"random": lambda: (0.7, 2, np.array([0, 2, 4]), *gqa(82, 3, 5, False)),
                    LARGE_LOGITS: lambda: (0.7, 3, np.array([0, 2, 4]), *gqa(83, 3, 5, True))},
    "decode_gqa": {"random": lambda: (0.7, *decode_inputs(gqa(84, 1, 5, False))),
                   LARGE_LOGITS: lambda: (0.7, *decode_inputs(gqa(85, 1, 5, True)))},
    "sigmoid_gate": {"random": lambda: (normal(86, (3, 8)), normal(87, (3, 8))),
                     "extremes": lambda: (normal(88, EXTREMES.size), EXTREMES)},
}


# --- the scale each op's error is measured against -------------------------------------------------

def own_magnitude(args, value):
    """The other ops round each step once with no cancellation after a rounding (a dot product is one
    rounding of the exact sum), so the error is relative to the value itself.  Their zeros come from
    an exact zero (x = 0, a masked key, i >= active, 1 + w = 0, an exactly cancelling dot product) that
    both precisions see, so a zero at one precision must be a zero at the other."""
    return np.abs(value)


def residual_scale(args, value):
    """x + fl(r h) is rounded twice, so when x and r h cancel the error is relative to |x| + |r h|."""
    r, x, h = args
    return np.abs(x) + np.abs(r * h)


def rope_scale(args, value):
    """x cos a - y sin a can cancel: the error is relative to the norm of the rotated pair (x, y)."""
    rot, x = args[1], args[-1]
    half = rot // 2
    scale = np.abs(x)
    pair = np.hypot(x[..., :half], x[..., half:2 * half])
    scale[..., :half] = pair
    scale[..., half:2 * half] = pair
    return scale


def attention_scale(args, value):
    """The output is a convex combination of the values, so its error is bounded by max_l |v l c d|."""
    v_max = np.abs(args[-1]).max(axis=0)
    return v_max[:, None, :] if value.ndim == 3 else v_max[None, :, None, :]


SCALES = {"residual": residual_scale, "rope": rope_scale, "rope_std": rope_scale,
          "causal_gqa": attention_scale, "sliding_gqa": attention_scale, "decode_gqa": attention_scale}


def assert_agree(lo, hi, scale, bits, what):
    """|lo - hi| <= 2^-bits * scale elementwise; where the scale is 0, lo and hi must be equal."""
    scale = np.broadcast_to(np.asarray(scale, dtype=object), np.shape(hi)).ravel()
    lo, hi = np.asarray(lo, dtype=object).ravel(), np.asarray(hi, dtype=object).ravel()
    bad = []
    for i, (a, b, s) in enumerate(zip(lo, hi, scale)):
        if a == b:
            continue
        err = abs(a - b)  # correctly rounded to mpmath's ambient precision, plenty for a bound
        if not (s > 0 and err <= mp.ldexp(s, -bits)):
            agreement = mp.nstr(-mp.log(err / s, 2), 4) if s > 0 else "none (scale 0)"
            bad.append(f"element {i}: {mp.nstr(a, 12)} vs {mp.nstr(b, 12)}, agree to {agreement} bits")
    assert not bad, f"{what}: fewer than {bits} bits of agreement\n" + "\n".join(bad[:10])


def precision_doubling_params():
    for op in OP_NAMES:
        for case in CASES.get(op, {"(no inputs)": None}):
            for p in PRECISIONS:
                yield pytest.param(op, case, p, id=f"{op}-{case}-p{p}")


def test_every_op_in_the_contract_has_precision_doubling_inputs():
    assert set(CASES) == set(CONTRACT) == set(ORACLES)


@pytest.mark.parametrize("op, case, p", list(precision_doubling_params()))
def test_oracle_at_p_bits_agrees_with_2p_bits_to_p_minus_10(op, case, p):
    assert case in CASES.get(op, {}), f"{op} has no precision-doubling inputs in CASES"
    args = CASES[op][case]()
    with spec.precision(p):
        lo = ORACLES[op](*args)
    with spec.precision(2 * p):
        hi = ORACLES[op](*args)
    assert np.shape(hi) == np.shape(lo) == CONTRACT[op].output_shape(*args)
    scale = SCALES.get(op, own_magnitude)(args, hi)
    assert_agree(lo, hi, scale, p - SLACK_BITS, f"{op} [{case}] at {p} vs {2 * p} bits")


# --- closed forms and identities ---------------------------------------------------------------------
# "exactly": equal as mpf numbers, because both sides do the same roundings (or none).
# "to working precision": within a few units of 2^-p, p = spec.get_precision().

def working_precision():
    """Arithmetic in a test at the oracles' precision, to repeat the oracle's own roundings."""
    return mp.workprec(spec.get_precision())


def assert_identical(a, b):
    a, b = np.asarray(a, dtype=object), np.asarray(b, dtype=object)
    assert a.shape == b.shape
    assert all(x == y for x, y in zip(a.ravel(), b.ravel())), "not exactly equal"


def test_sigmoid_at_zero_is_exactly_one_half():
    assert spec.sigmoid(np.array([0.0]))[0] == mpf(0.5)


def test_gelu_tanh_at_zero_is_exactly_zero():
    assert spec.gelu_tanh(np.array([0.0]))[0] == 0


def test_silu_is_exactly_x_times_sigmoid():
    x = np.concatenate([normal(100, 8), EXTREMES])
    with working_precision():
        assert_identical(spec.silu(x), spec.exact(x) * spec.sigmoid(x))


def test_softcap_stays_strictly_inside_the_cap_and_reaches_it_for_huge_inputs():
    c, p = 30.0, spec.get_precision()
    # |x| / c <= 20: c - |softcap| = c (1 - tanh 20) > c 2^-57, far above the working precision.
    moderate = np.concatenate([np.linspace(-600, 600, 41), [1e-30, -5e-324]])
    assert all(-c < y < c for y in spec.softcap(c, moderate))  # abs() would round to mpmath's ambient 53 bits
    # The limit c (1 - 2 e^(-2|x|/c)) is within c 2^-p of +-c for these x: at working precision it is +-c.
    huge = np.array([1e4, -1e4, 1e30, -1e30, 1.7e308, -1.7e308])
    for x, y in zip(huge, spec.softcap(c, huge)):
        assert -c <= y <= c and abs(y - np.sign(x) * c) <= mp.ldexp(c, -p)


def test_rope_at_position_zero_is_exactly_the_identity():
    x = normal(101, (3, 10))
    zeros = np.zeros(3, dtype=np.int64)
    assert_identical(spec.rope(1e6, 8, 16, 2, zeros, x), spec.exact(x))
    assert_identical(spec.rope_std(1e4, 10, zeros, x), spec.exact(x))


def test_rope_preserves_the_norm_of_each_rotated_pair_to_working_precision():
    rot, half, p = 8, 4, spec.get_precision()
    x = normal(102, (4, 10))
    pos = np.array([1, 1000, 65537, 262144])
    y = spec.rope(1e4, rot, rot, half, pos, x)
    with mp.workprec(4 * p):
        for t in range(4):
            for i in range(half):
                before = mpf(x[t, i]) ** 2 + mpf(x[t, i + half]) ** 2
                after = y[t, i] ** 2 + y[t, i + half] ** 2
                assert abs(after - before) <= mp.ldexp(before, 4 - p)
    assert_identical(y[:, rot:], spec.exact(x[:, rot:]))


def test_rope_std_is_exactly_rope_with_denominator_rot_and_every_pair_active():
    x, pos = normal(103, (3, 12)), np.array([0, 5, 4096])
    for rot in (4, 8, 12):
        assert_identical(spec.rope_std(1e4, rot, pos, x), spec.rope(1e4, rot, rot, rot // 2, pos, x))


def test_inv_freq_is_exactly_one_at_zero_and_zero_from_active_on():
    f = spec.inv_freq(1e6, 512, 64, np.arange(256))
    assert f[0] == 1
    assert all(v == 0 for v in f[64:])
    assert all(0 < v < 1 for v in f[1:64])


def test_softmax_sums_to_one_over_the_visible_set_and_is_exactly_zero_elsewhere():
    p = spec.get_precision()
    s = np.concatenate([normal(104, (6, 7), 4), [[1e4, -1e4, 0.0, 1e4, -3.0, 2.0, 1e4 - 0.5]]])
    visible = np.random.default_rng(105).random((7, 7)) < 0.5
    visible[0], visible[1] = True, False  # one row sees everything; one sees nothing, so it is all zeros
    out = spec.softmax(s, visible)
    for row, mask in zip(out, visible):
        assert all(v == 0 for v in row[~mask])
        if mask.any():
            assert all(v > 0 for v in row[mask])
            with mp.workprec(4 * p):
                assert abs(mp.fsum(row[mask]) - 1) <= mp.ldexp(1, 4 - p)


def test_a_single_visible_key_returns_exactly_its_value():
    q, k, v = gqa(106, 3, 5, False)
    causal = spec.causal_gqa(0.5, np.array([0, 0, 0]), q, k, v)
    for s in range(3):
        for g in range(2):
            assert_identical(causal[s, :, g], spec.exact(v[0]))
    pos = np.array([0, 3, 4])
    window_one = spec.sliding_gqa(0.5, 1, pos, q, k, v)
    for s in range(3):
        for g in range(2):
            assert_identical(window_one[s, :, g], spec.exact(v[pos[s]]))


def test_decode_is_exactly_the_last_row_of_causal_with_positions_arange():
    q, k, v = gqa(107, 5, 5, False)
    causal = spec.causal_gqa(0.25, np.arange(5), q, k, v)
    assert_identical(spec.decode_gqa(0.25, q[-1], k, v), causal[-1])


@pytest.mark.parametrize("window", [5, 6, 100])
def test_sliding_with_a_window_of_at_least_L_is_exactly_causal(window):
    q, k, v = gqa(108, 3, 5, False)
    pos = np.array([0, 2, 4])
    assert_identical(spec.sliding_gqa(0.5, window, pos, q, k, v), spec.causal_gqa(0.5, pos, q, k, v))


@pytest.mark.parametrize("changed_input", ["k", "v"])
@pytest.mark.parametrize("op", ["causal_gqa", "sliding_gqa", "decode_gqa"])
def test_query_head_c_g_reads_only_kv_head_c(op, changed_input):
    S, Hkv, G, D, L, changed = 2, 3, 2, 4, 4, 1
    q, kv = normal(109, (S, Hkv, G, D)), {"k": normal(110, (L, Hkv, D)), "v": normal(111, (L, Hkv, D))}
    kv2 = dict(kv)
    kv2[changed_input] = kv[changed_input].copy()
    kv2[changed_input][:, changed] = normal(112, (L, D))
    lead = {"causal_gqa": (0.5, np.array([1, 3])), "sliding_gqa": (0.5, 2, np.array([1, 3])),
            "decode_gqa": (0.5,)}[op]
    query = q[0] if op == "decode_gqa" else q
    before, after = ORACLES[op](*lead, query, kv["k"], kv["v"]), ORACLES[op](*lead, query, kv2["k"], kv2["v"])
    head_axis = 0 if op == "decode_gqa" else 1
    for c in range(Hkv):
        b, a = np.take(before, c, axis=head_axis), np.take(after, c, axis=head_axis)
        if c == changed:
            for g in range(G):  # every query head c*G + g of the changed KV head moves
                assert any(x != y for x, y in zip(np.take(b, g, axis=-2).ravel(), np.take(a, g, axis=-2).ravel()))
        else:
            assert_identical(a, b)


def test_rmsnorm_offset_is_exactly_rmsnorm_of_one_plus_w():
    x = norm_rows(114)
    w = np.round(normal(115, 8) * 256) / 256  # 1 + w is a float64, so both sides multiply by the same number
    assert_identical(spec.rmsnorm_offset(1e-6, x, w), spec.rmsnorm(1e-6, x, 1 + w))


def test_rmsnorm_unit_is_exactly_rmsnorm_with_unit_weight():
    x = norm_rows(116)
    assert_identical(spec.rmsnorm_unit(1e-6, x), spec.rmsnorm(1e-6, x, np.ones(8)))


def test_gate_up_halves_are_exactly_the_two_linears():
    Wg, Wu, x = normal(117, (3, 8)), normal(118, (3, 8)), normal(119, (2, 8))
    gu = spec.gate_up(Wg, Wu, x)
    assert_identical(gu[..., :3], spec.linear(Wg, x))
    assert_identical(gu[..., 3:], spec.linear(Wu, x))


def test_lm_head_is_exactly_mul_times_linear_then_the_optional_softcap():
    W, x, mul = normal(120, (6, 8), 8), normal(121, (2, 8)), 0.7
    with working_precision():
        logits = mul * spec.linear(W, x)
    assert_identical(spec.lm_head(mul, None, W, x), logits)
    assert_identical(spec.lm_head(mul, 30.0, W, x), spec.softcap(30.0, logits))
