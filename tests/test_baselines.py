"""The plain arrangements' rounding to bf16 and fp16 (properties/baselines.py) is the casts' there and back."""

import ml_dtypes
import numpy as np
import pytest

from gemma4_conformance.properties.baselines import round_to_dtype


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
