"""The spec's theorems as relations between a backend's own outputs, checked without the oracle.

Each relation draws a case of one op (the same strategies as oracle agreement), builds a second
computation the theorem says must agree with the first, and compares them within the budgets of the
ops involved: when both sides are within b ULPs of the same exact value they are within 2b of each
other; when one side is exact (a copy of v, zero, c) the other must be within b.  A relation names
the ops it needs, so a backend without one of them is skipped, not failed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from gemma4_conformance.adapters import declared_formats
from gemma4_conformance.adapters.contract import call
from gemma4_conformance.spec import CONTRACT, format_of, scale_ulp
from gemma4_conformance.spec.exact import one_blas_thread, widen

from .budget import ACCUMULATION, budget
from .judging import BeyondDeclared, declared_formats_hold, held
from .table import OPS, build, cases


@dataclass(frozen=True)
class Relation:
    name: str
    ops: tuple[str, ...]
    cases: Callable[[str, dict], st.SearchStrategy]  # (dtype, the adapter's declared formats) -> its cases
    check: Callable  # (adapter, case, dtype) -> list of failure messages


def allowance(op: str, dtype: str, args: tuple, reference: np.ndarray) -> np.ndarray:
    """The absolute error the op's budget allows at ``args``, with ``reference`` standing in for the
    exact result in its error model (the scale needs only its magnitude)."""
    ref = np.asarray(reference, dtype=np.float64)
    with one_blas_thread():  # the error models' small products, as the judge runs them
        scale, flush = OPS[op].scale(tuple(widen(a) for a in args), ref, dtype)
    dims, _ = CONTRACT[op].bind(*args)
    allowed = budget(op, dtype).ulps(**dims, **OPS[op].quantities(args))
    return allowed * scale_ulp(np.broadcast_to(scale, ref.shape), dtype) + np.broadcast_to(flush, ref.shape)


def compare(what: str, got, want, tolerance) -> list[str]:
    """Failures where |got - want| > tolerance (exact equality where the tolerance is 0)."""
    got, want, tolerance = np.broadcast_arrays(np.asarray(got, dtype=np.float64),
                                               np.asarray(want, dtype=np.float64), np.asarray(tolerance, dtype=np.float64))
    with np.errstate(invalid="ignore"):  # inf - inf: an overflow on both sides, equal, caught below
        diff = np.abs(got - want)
    bad = ~(diff <= tolerance) & ~(got == want)
    if not bad.any():
        return []
    i = tuple(int(j) for j in np.argwhere(bad)[0])
    return [f"{what}: at {i} {float(got[i])!r} vs {float(want[i])!r}, difference {diff[i]:.3g} > allowed "
            f"{tolerance[i]:.3g} ({int(bad.sum())} of {bad.size} entries)"]


def _f64(a):
    return np.asarray(a, dtype=np.float64)


# RoPE ------------------------------------------------------------------------------------------------

def rope_at_zero_is_identity(adapter, case, dtype):
    args = build("rope", case, dtype)
    pos = np.zeros_like(args[4])
    x = args[5]
    out = call(adapter, "rope", (*args[:4], pos, x), dtype)
    subnormal = np.abs(x.astype(np.float64)) < 2.0 ** format_of(dtype).emin  # may be flushed to zero
    return compare("rope at position 0 vs x", out, x, np.where(subnormal, np.abs(x.astype(np.float64)), 0.0))


def rope_keeps_pair_norms(adapter, case, dtype):
    theta, rot, denom, active, pos, x = args = build("rope", case, dtype)
    out = call(adapter, "rope", args, dtype)
    half = rot // 2
    err = allowance("rope", dtype, args, _f64(out))
    before = np.hypot(_f64(x[..., :half]), _f64(x[..., half:2 * half]))
    after = np.hypot(_f64(out[..., :half]), _f64(out[..., half:2 * half]))
    return compare("norm of each rotated pair, after vs before", after, before,
                   err[..., :half] + err[..., half:2 * half])


@st.composite
def _rope_pairs(draw, dtype):
    case = draw(cases("rope", dtype))
    case["shift"] = draw(st.integers(0, 4096))
    return case


def rope_depends_on_relative_position(adapter, case, dtype):
    """q(m) . k(n) = q(m + t) . k(n + t): rows 0 and 1 of x are q and k."""
    theta, rot, denom, active, pos, x = build("rope", case, dtype)
    if x.shape[0] < 2:
        return []
    qk = x[:2]
    dots, allowed = [], []
    for shift in (0, case["shift"]):
        p = pos[:2] + shift
        args = (theta, rot, denom, active, p, qk)
        out = _f64(call(adapter, "rope", args, dtype))
        err = allowance("rope", dtype, args, out)
        dots.append(out[0] @ out[1])
        allowed.append(np.abs(out[0]) @ err[1] + np.abs(out[1]) @ err[0] + err[0] @ err[1])
    return compare(f"q.k after RoPE at positions {list(pos[:2])} vs shifted by {case['shift']}",
                   dots[1], dots[0], allowed[0] + allowed[1])


def rope_std_is_rope(adapter, case, dtype):
    theta, rot, pos, x = args = build("rope_std", case, dtype)
    a = call(adapter, "rope_std", args, dtype)
    b = call(adapter, "rope", (theta, rot, rot, rot // 2, pos, x), dtype)
    return compare("rope_std vs rope(theta, rot, rot, rot/2)", a, b, 2 * allowance("rope_std", dtype, args, _f64(b)))


# Norms -----------------------------------------------------------------------------------------------

@st.composite
def _scaled(draw, op, dtype):
    case = draw(cases(op, dtype))
    case["log2_alpha"] = draw(st.integers(-4, 4))
    return case


def rmsnorm_is_scale_invariant(adapter, case, dtype):
    """rmsnorm(alpha^2 eps, alpha x, w) = rmsnorm(eps, x, w) for alpha a power of two (exact scaling)."""
    eps, x, w = args = build("rmsnorm", case, dtype)
    alpha = 2.0 ** case["log2_alpha"]
    with np.errstate(over="ignore"):  # alpha x past the dtype's range is a premise failing, checked below
        scaled_x = (x.astype(np.float64) * alpha).astype(x.dtype)
    accumulator = format_of(ACCUMULATION[dtype])
    wide = np.abs(x.astype(np.float64)) * max(alpha, 1.0)
    if (not np.array_equal(scaled_x.astype(np.float64), x.astype(np.float64) * alpha)
            or np.sum(wide * wide, axis=-1).max(initial=0.0) > accumulator.max_finite / 4
            or np.min(np.abs(x[x != 0]).astype(np.float64) * min(alpha, 1.0), initial=1.0) < 2.0 ** accumulator.emin):
        return []  # alpha x (or its squares) left the normal range: the premise of exact scaling fails
    a = call(adapter, "rmsnorm", args, dtype)
    b = call(adapter, "rmsnorm", (eps * alpha**2, scaled_x, w), dtype)
    return compare(f"rmsnorm(alpha^2 eps, alpha x, w) vs rmsnorm(eps, x, w), alpha = {alpha}", b, a,
                   2 * allowance("rmsnorm", dtype, args, _f64(a)))


def rmsnorm_offset_is_rmsnorm_of_one_plus_w(adapter, case, dtype):
    eps, x, w = args = build("rmsnorm_offset", case, dtype)
    one_plus_w = (1 + w.astype(np.float64)).astype(w.dtype)
    if not np.array_equal(one_plus_w.astype(np.float64), 1 + w.astype(np.float64)):
        w = (one_plus_w.astype(np.float64) - 1).astype(w.dtype)  # make 1 + w exact in the dtype
        args = (eps, x, w)
    a = call(adapter, "rmsnorm_offset", args, dtype)
    b = call(adapter, "rmsnorm", (eps, x, one_plus_w), dtype)
    return compare("rmsnorm_offset(w) vs rmsnorm(1 + w)", a, b, 2 * allowance("rmsnorm_offset", dtype, args, _f64(b)))


def rmsnorm_unit_is_rmsnorm_of_ones(adapter, case, dtype):
    eps, x = args = build("rmsnorm_unit", case, dtype)
    a = call(adapter, "rmsnorm_unit", args, dtype)
    b = call(adapter, "rmsnorm", (eps, x, np.ones(x.shape[-1], dtype=x.dtype)), dtype)
    return compare("rmsnorm_unit vs rmsnorm with w = 1", a, b, 2 * allowance("rmsnorm_unit", dtype, args, _f64(b)))


# Basic -----------------------------------------------------------------------------------------------

def fixed_points(adapter, case, dtype):
    """sigmoid(0) = 1/2 and gelu_tanh(0) = 0, exactly: both are exact in every format."""
    zero = np.zeros(3, dtype=format_of(dtype).dtype)
    return (compare("sigmoid(0)", call(adapter, "sigmoid", (zero,), dtype), 0.5, 0.0)
            + compare("gelu_tanh(0)", call(adapter, "gelu_tanh", (zero,), dtype), 0.0, 0.0))


@st.composite
def _softcap_cases(draw, dtype):
    case = draw(cases("softcap", dtype))
    case["args"]["c"] = draw(st.sampled_from([30.0, 50.0, 1.0, 0.5, 20.0]))  # exact in every dtype
    return case


def softcap_is_bounded_and_saturates(adapter, case, dtype):
    c, x = build("softcap", case, dtype)
    out = _f64(call(adapter, "softcap", (c, x), dtype))
    failures = compare("|softcap(c, x)| <= c", np.minimum(np.abs(out), c), np.abs(out), 0.0)
    big = np.array([40 * c, -40 * c, format_of(dtype).max_finite / 2], dtype=format_of(dtype).dtype)
    saturated = call(adapter, "softcap", (c, big), dtype)
    return failures + compare("softcap(c, +-40c) saturates at +-c", saturated, np.sign(_f64(big)) * c,
                              allowance("softcap", dtype, (c, big), np.sign(_f64(big)) * c))


# Linear ----------------------------------------------------------------------------------------------

def _held(op: str, args: tuple, dtype: str, adapter) -> tuple[tuple, tuple] | None:
    """``judging.held``'s (the arguments the adapter receives, the ones it is judged on) where the adapter's
    declared formats hold them, else None."""
    formats = declared_formats(adapter)
    try:
        handed, judged = held(op, args, formats)
    except BeyondDeclared:
        return None
    return (handed, judged) if declared_formats_hold(op, judged, dtype, formats) else None


def gate_up_is_two_linears(adapter, case, dtype):
    """Domain: the inputs the adapter's declared formats hold (none declared: all)."""
    arguments = _held("gate_up", build("gate_up", case, dtype), dtype, adapter)
    if arguments is None:
        return []
    handed, args = arguments
    Wg, Wu, x = handed
    fused = call(adapter, "gate_up", handed, dtype)
    halves = np.concatenate([call(adapter, "linear", (Wg, x), dtype), call(adapter, "linear", (Wu, x), dtype)], -1)
    return compare("gate_up vs [linear(Wg, x) | linear(Wu, x)]", fused, halves,
                   2 * allowance("gate_up", dtype, args, _f64(halves)))


def lm_head_without_cap_is_scaled_linear(adapter, case, dtype):
    """lm_head(mul, none, W, x) = mul * linear(W, x) for mul a power of two (exact scaling).

    Domain: the entries where mul * linear(W, x), widened by both sides' allowances, lies inside the
    dtype's finite range. Outside it the spec's lm_head rounds to +-inf (or may, near the edge) while
    mul times a finite linear does not, so the two sides are not the same value of the dtype. And the
    inputs the adapter's declared formats hold."""
    mul, cap, W, x = build("lm_head", case, dtype)
    mul = 2.0 ** round(np.log2(abs(mul) or 1.0))  # a power of two, so mul * linear is exact
    arguments = _held("lm_head", (mul, None, W, x), dtype, adapter)
    if arguments is None:
        return []
    handed, args = arguments
    W = handed[2]
    a = call(adapter, "lm_head", handed, dtype)
    b = mul * _f64(call(adapter, "linear", (W, x), dtype))
    tolerance = 2 * allowance("lm_head", dtype, args, np.where(np.isfinite(b), b, 0))
    inside = np.abs(b) + tolerance <= format_of(dtype).max_finite
    return compare("lm_head(mul, none) vs mul * linear", np.where(inside, a, 0), np.where(inside, b, 0),
                   np.where(inside, tolerance, 0))


# Attention -------------------------------------------------------------------------------------------

def softmax_is_a_distribution(adapter, case, dtype):
    s, visible = args = build("softmax", case, dtype)
    p = _f64(call(adapter, "softmax", args, dtype))
    err = allowance("softmax", dtype, args, p)
    visible = np.broadcast_to(visible, s.shape)
    total = np.where(visible, p, 0).sum(-1)
    seen = visible.any(-1)
    return (compare("softmax outside the visible set", np.where(visible, 0, p), 0.0, 0.0)
            + compare("softmax sum over the visible set (1, or 0 with nothing visible)", total,
                      seen.astype(float), np.where(visible, err, 0).sum(-1)))


def single_visible_key_returns_its_value(adapter, case, dtype):
    scale, pos, q, k, v = build("causal_gqa", case, dtype)
    args = (scale, np.zeros_like(pos), q, k, v)
    out = call(adapter, "causal_gqa", args, dtype)
    want = np.broadcast_to(_f64(v[0])[None, :, None, :], out.shape)
    return compare("causal attention at position 0 vs v[0]", out, want, allowance("causal_gqa", dtype, args, want))


def decode_is_last_row_of_causal(adapter, case, dtype):
    scale, q, k, v = args = build("decode_gqa", case, dtype)
    L = k.shape[0]
    a = call(adapter, "decode_gqa", args, dtype)
    b = call(adapter, "causal_gqa", (scale, np.array([L - 1]), q[None], k, v), dtype)[0]
    return compare("decode_gqa vs causal_gqa at position L - 1", a, b, 2 * allowance("decode_gqa", dtype, args, _f64(b)))


def wide_window_is_causal(adapter, case, dtype):
    scale, window, pos, q, k, v = build("sliding_gqa", case, dtype)
    wide = (scale, k.shape[0] + window, pos, q, k, v)
    a = call(adapter, "sliding_gqa", wide, dtype)
    b = call(adapter, "causal_gqa", (scale, pos, q, k, v), dtype)
    return compare("sliding_gqa with window >= L vs causal_gqa", a, b, 2 * allowance("sliding_gqa", dtype, wide, _f64(b)))


def window_one_returns_own_value(adapter, case, dtype):
    scale, window, pos, q, k, v = build("sliding_gqa", case, dtype)
    args = (scale, 1, pos, q, k, v)
    out = call(adapter, "sliding_gqa", args, dtype)
    want = np.broadcast_to(_f64(v[pos])[:, :, None, :], out.shape)
    return compare("sliding_gqa with window 1 vs v[pos]", out, want, allowance("sliding_gqa", dtype, args, want))


def _head_mapping(op):
    def check(adapter, case, dtype):
        """Query head c*G + g reads KV head c: changing KV head c changes exactly q[..., c, :, :]'s outputs."""
        args = list(build(op, case, dtype))
        k, v = args[-2], args[-1]
        Hkv = k.shape[1]
        before = _f64(call(adapter, op, tuple(args), dtype))
        c = case.get("head", 0) % Hkv
        # Head c's values all become M > 2 max|v|: its group's outputs become M (the weights sum to 1),
        # at least M/2 away from where they were; every other head's outputs must not move at all.
        M = 2.0 ** np.ceil(np.log2(2 * np.max(np.abs(v.astype(np.float64)), initial=0.0) + 2))
        moved_v = v.copy()
        moved_v[:, c] = M
        args[-1] = moved_v
        after = _f64(call(adapter, op, tuple(args), dtype))
        heads = np.arange(Hkv)
        axis = CONTRACT[op].out.split().index("Hkv")
        others = np.take(after, heads[heads != c], axis=axis), np.take(before, heads[heads != c], axis=axis)
        group_after = np.take(after, [c], axis=axis)
        moved = np.abs(group_after - np.take(before, [c], axis=axis)) >= M / 4
        missed = ~moved & (group_after != 0)  # rows with no visible key stay 0
        return (compare(f"{op}: outputs of query heads not in group {c} after changing KV head {c}", *others, 0.0)
                + compare(f"{op}: query heads of group {c} unaffected by a change of KV head {c}",
                          missed.astype(float), 0.0, 0.0))
    return check


@st.composite
def _with_head(draw, op, dtype):
    case = draw(cases(op, dtype))
    case["head"] = draw(st.integers(0, 15))
    return case


def _drawn(op: str):
    """The op's cases (a product's weights whole blocks of a block weight format the adapter declares)."""
    return lambda dtype, formats: cases(op, dtype, formats)


def _own(strategy, *head):
    """A relation's own cases, ``strategy(*head, dtype)``: without weights, whatever the formats."""
    return lambda dtype, formats: strategy(*head, dtype)


RELATIONS: dict[str, Relation] = {
    r.name: r
    for r in (
        Relation("rope_at_zero_is_identity", ("rope",), _drawn("rope"), rope_at_zero_is_identity),
        Relation("rope_keeps_pair_norms", ("rope",), _drawn("rope"), rope_keeps_pair_norms),
        Relation("rope_depends_on_relative_position", ("rope",), _own(_rope_pairs), rope_depends_on_relative_position),
        Relation("rope_std_is_rope", ("rope", "rope_std"), _drawn("rope_std"), rope_std_is_rope),
        Relation("rmsnorm_is_scale_invariant", ("rmsnorm",), _own(_scaled, "rmsnorm"), rmsnorm_is_scale_invariant),
        Relation("rmsnorm_offset_is_rmsnorm_of_one_plus_w", ("rmsnorm", "rmsnorm_offset"),
                 _drawn("rmsnorm_offset"), rmsnorm_offset_is_rmsnorm_of_one_plus_w),
        Relation("rmsnorm_unit_is_rmsnorm_of_ones", ("rmsnorm", "rmsnorm_unit"),
                 _drawn("rmsnorm_unit"), rmsnorm_unit_is_rmsnorm_of_ones),
        Relation("fixed_points", ("sigmoid", "gelu_tanh"), lambda d, formats: st.just({}), fixed_points),
        Relation("softcap_is_bounded_and_saturates", ("softcap",), _own(_softcap_cases), softcap_is_bounded_and_saturates),
        Relation("gate_up_is_two_linears", ("gate_up", "linear"), _drawn("gate_up"), gate_up_is_two_linears),
        Relation("lm_head_without_cap_is_scaled_linear", ("lm_head", "linear"), _drawn("lm_head"),
                 lm_head_without_cap_is_scaled_linear),
        Relation("softmax_is_a_distribution", ("softmax",), _drawn("softmax"), softmax_is_a_distribution),
        Relation("single_visible_key_returns_its_value", ("causal_gqa",), _drawn("causal_gqa"),
                 single_visible_key_returns_its_value),
        Relation("decode_is_last_row_of_causal", ("decode_gqa", "causal_gqa"), _drawn("decode_gqa"),
                 decode_is_last_row_of_causal),
        Relation("wide_window_is_causal", ("sliding_gqa", "causal_gqa"), _drawn("sliding_gqa"),
                 wide_window_is_causal),
        Relation("window_one_returns_own_value", ("sliding_gqa",), _drawn("sliding_gqa"),
                 window_one_returns_own_value),
        *(Relation(f"gqa_head_mapping_{op}", (op,), _own(_with_head, op), _head_mapping(op))
          for op in ("causal_gqa", "sliding_gqa", "decode_gqa")),
    )
}
