"""Adapters that break (and some that also fail), for the plugin's tests: --backend=tests.faulty:ADAPTERS.<name>,
and sessions that break the serving contract: --backend=tests.faulty:SESSIONS.<name>."""

from types import SimpleNamespace

import numpy as np

from gemma4_conformance.adapters import numpy_backend
from gemma4_conformance.composition.session import Session
from tests.mutants import MutantAdapter


def sigmoid_raises(x):
    raise RuntimeError("kernel not compiled for this shape")


def sigmoid_returns_float64(x):
    return x.astype("float64")


def softmax_raises_on_long_rows_and_is_wrong_on_short(s, visible):
    """Two distinct bugs in one op, which Hypothesis reports together (an exception group)."""
    if s.shape[-1] > 2:
        raise RuntimeError("kernel not compiled for rows longer than 2")
    return np.where(visible, 2 / s.shape[-1], 0).astype(s.dtype)


def decode_gqa_nan_for_short_caches(scale, q, k, v):
    """NaN for caches of 2 to 31 keys, which no edge case has: only a drawn example finds it, and its
    error is infinite (the second tier's, of the NaN)."""
    out = numpy_backend.decode_gqa(scale, q, k, v)
    return np.full_like(out, np.nan) if 1 < k.shape[0] < 32 else out


ADAPTERS = SimpleNamespace(
    **{fn.__name__: MutantAdapter("sigmoid", fn) for fn in (sigmoid_raises, sigmoid_returns_float64)},
    softmax_raises_on_long_rows_and_is_wrong_on_short=MutantAdapter(
        "softmax", softmax_raises_on_long_rows_and_is_wrong_on_short),
    decode_gqa_nan_for_short_caches=MutantAdapter("decode_gqa", decode_gqa_nan_for_short_caches),
)


class LastRowOnly:
    """The numpy backend whose session returns only each sequence's last logit row, [V] (a breach of
    the serving contract: every appended position's row, [n, V], is due)."""

    name = "numpy-last-row-only"
    dtypes = numpy_backend.dtypes

    def __getattr__(self, attribute):
        return getattr(numpy_backend, attribute)

    def session(self, weights, config, dtype, checkpoint=None):
        inner = Session(numpy_backend, weights, config, dtype)
        return SimpleNamespace(step=lambda batch: {seq: rows[-1] for seq, rows in inner.step(batch).items()},
                               release=inner.release)


SESSIONS = SimpleNamespace(last_row_only=LastRowOnly())
