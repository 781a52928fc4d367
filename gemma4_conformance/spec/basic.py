"""Basic: the scalar functions the Lean specs import (definitions from ../shared/gemma-4-12B.md).

Each accepts a scalar or an array and applies elementwise.
"""

from mpmath import mp

from . import real
from .exact import elementwise, oracle


@oracle
def sigmoid(x):
    """``sigmoid x = 1 / (1 + exp(-x))``"""
    return elementwise(lambda t: 1 / (1 + mp.exp(-t)), x)


@oracle
def silu(x):
    """``silu x = x * sigmoid x``"""
    return x * sigmoid(x)


@oracle
def gelu_tanh(x):
    """``geluTanh x = x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))``

    Evaluated as x / (1 + exp(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3), the same real number
    (1 + tanh u = 2 / (1 + exp(-2u))) without the cancellation of 1 + tanh u for x << 0.
    0.044715 is the real decimal constant of the definition, not its binary64 neighbour.
    """
    k = mp.sqrt(2 / mp.pi)
    a = mp.mpf("0.044715")
    return elementwise(lambda t: t / (1 + mp.exp(-2 * k * (t + a * t**3))), x)


@oracle
def softcap(c, x):
    """``softcap c x = c * tanh(x / c)``, Lean's division: c = 0 gives 0."""
    return elementwise(lambda t: c * mp.tanh(real.div(t, c)), x)
