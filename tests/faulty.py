"""Adapters that break rather than fail, for the plugin's tests: --backend=tests.faulty:ADAPTERS.<name>."""

from types import SimpleNamespace

from tests.mutants import MutantAdapter


def sigmoid_raises(x):
    raise RuntimeError("kernel not compiled for this shape")


def sigmoid_returns_float64(x):
    return x.astype("float64")


ADAPTERS = SimpleNamespace(**{fn.__name__: MutantAdapter("sigmoid", fn) for fn in (sigmoid_raises, sigmoid_returns_float64)})
