"""The plain arrangements (properties/baselines.py): their rounding to bf16 and fp16 is the casts' there and
back, and what another order of summing their logits moves them by is bounded."""

from functools import partial

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemma4_conformance.properties.baselines import _sums, moved_logits, round_to_dtype
from gemma4_conformance.properties.error_models import head_logits, masked_softmax, moved_logits_term
from gemma4_conformance.spec import format_of


def _float32_bits(low_bits: int, low_values) -> np.ndarray:
    """Every float32 whose bits below ``low_bits`` are one of ``low_values``: each sign, exponent and upper
    significand, with the ties, their neighbours and the extremes of the bits a rounding drops."""
    high = np.arange(1 << (32 - low_bits), dtype=np.uint64) << np.uint64(low_bits)
    return (high[:, None] | np.array(low_values, dtype=np.uint64)[None, :]).astype(np.uint32).reshape(-1)


@pytest.mark.parametrize("dtype, target, dropped", [("bfloat16", ml_dtypes.bfloat16, 16), ("float16", np.float16, 13)])
def test_rounding_to_a_16_bit_format_is_the_cast_there_and_back(dtype, target, dropped):
    tie = 1 << (dropped - 1)
    x = _float32_bits(dropped, [0, 1, tie - 1, tie, tie + 1, (1 << dropped) - 1]).view(np.float32)
    with np.errstate(all="ignore"):
        cast = x.astype(target).astype(np.float32)
    rounded = round_to_dtype(x, dtype)
    same = (rounded.view(np.uint32) == cast.view(np.uint32)) | (np.isnan(rounded) & np.isnan(cast))
    assert same.all(), f"{np.count_nonzero(~same)} differ, first {x[~same][0]!r}: {rounded[~same][0]!r}, " \
                       f"cast {cast[~same][0]!r}"


def test_rounding_refuses_what_it_would_round_twice():
    with pytest.raises(TypeError, match="float64"):
        round_to_dtype(np.ones(3), "bfloat16")


def _offset_attention(data, dtype):
    """q [1, 1, 2, D], k [L, 1, D] of D and the scale, their logits moved by about an offset (q_0 = 8, as
    the attention cases do) to where D's spacing is widest among the cases'."""
    D, L = data.draw(st.sampled_from([2, 16, 256])), data.draw(st.integers(1, 6))
    scale = data.draw(st.sampled_from([1.0, 0.0625, 0.3, 2.0]))  # the cases draw no negative scale
    offset = data.draw(st.sampled_from([0.0, 64.0, -100.0, 100.0]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    q, k = rng.normal(0, 0.35, (1, 1, 2, D)), rng.uniform(-0.35, 0.35, (L, 1, D))
    q[..., 0], k[..., 0] = 8.0, offset / (8 * scale)
    narrow = format_of(dtype).dtype
    return scale, q.astype(narrow).astype(np.float32), k.astype(narrow).astype(np.float32)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_another_order_of_the_dot_products_moves_no_logit_beyond_its_bound(data):
    """Summed in float32 forward, backward, in a drawn order or pairwise, each arrangement's logits stay
    within moved_logits of those of BLAS's order."""
    dtype = data.draw(st.sampled_from(["bfloat16", "float16"]))
    scale, q, k = _offset_attention(data, dtype)
    round_d = partial(round_to_dtype, dtype=dtype)
    sums = _sums(scale, q, k, round_d, np.dtype(np.float32))
    visible = np.ones((1, k.shape[0]), dtype=bool)
    magnitudes = abs(scale) * head_logits(np.abs(q).astype(np.float64), np.abs(k).astype(np.float64))
    dots = head_logits(q.astype(np.float64), k.astype(np.float64))
    moved = moved_logits(sums, scale, visible, magnitudes, dots, dtype)
    order = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))).permutation(q.shape[-1])
    for at, (blas, logit, (q_, k_)) in sums.items():
        terms = q_[:, :, :, None, :] * k_.transpose(1, 0, 2)[None, :, None]  # [S, Hkv, G, L, D], exact in float32
        for summed in (np.cumsum(terms, axis=-1)[..., -1], np.cumsum(terms[..., ::-1], axis=-1)[..., -1],
                       np.cumsum(terms[..., order], axis=-1)[..., -1], np.sum(terms, axis=-1)):
            assert summed.dtype == np.float32
            apart = np.abs(logit(summed).astype(np.float64) - logit(blas))
            assert (apart <= moved[at]).all(), (at, apart.max(), moved[at][apart > moved[at]])


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_moved_logits_term_bounds_how_far_moved_logits_move_the_output(data):
    """|o(s + delta) - o(s)| <= moved_logits_term for |delta_l| <= d_l, the signs drawn or the worst for
    one feature (delta_l = d_l sign(v_l - o)); the keys masked or not."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    L, D = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 4))
    s = rng.normal(0, data.draw(st.sampled_from([0.1, 3.0, 30.0])), L)
    d = np.where(rng.random(L) < 0.5, 0.0, rng.uniform(0, data.draw(st.sampled_from([0.01, 0.5, 4.0])), L))
    visible = rng.random(L) < 0.8
    v = rng.normal(0, 1, (L, 1, D))
    p, _ = masked_softmax(s[None], visible[None])
    o = p @ v[:, 0]
    span = np.ptp(v[visible, 0], axis=0, keepdims=True) if visible.any() else np.zeros((1, D))
    term = moved_logits_term(p, d[None], v, np.array([0]), o, span)[0]
    worst = int(rng.integers(D))
    for signs in (rng.choice([-1.0, 1.0], L), np.sign(v[:, 0, worst] - o[0, worst]), np.ones(L)):
        p_moved, _ = masked_softmax((s + signs * d)[None], visible[None])
        apart = np.abs(p_moved @ v[:, 0] - o)[0]
        assert (apart <= term * (1 + 1e-9) + 1e-12).all(), (apart, term)
