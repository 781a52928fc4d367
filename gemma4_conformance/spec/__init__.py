"""Arbitrary-precision oracles, one per Lean definition, with the Lean names in snake_case and the
Lean argument order.  Inputs are taken exactly; results are object arrays of mpmath numbers at the
working precision, to be rounded once to a target format with ``round_to``.
"""

from .attention import causal_gqa, decode_gqa, sigmoid_gate, sliding_gqa, softmax
from .basic import gelu_tanh, sigmoid, silu, softcap
from .contract import CONTRACT, OP_NAMES
from . import enclosures
from .exact import DEFAULT_PRECISION, exact, get_precision, precision
from .formats import FORMATS, format_of, round_to, scale_ulp, ulp, ulp_distance
from .linear import embed, gate_up, gelu_mul, linear, lm_head, residual, silu_mul
from .norm import l2norm, rms, rmsnorm, rmsnorm_gated, rmsnorm_offset, rmsnorm_unit
from .rope import inv_freq, rope, rope_std

ORACLES = {name: globals()[name] for name in OP_NAMES}

__all__ = [*OP_NAMES, "ORACLES", "CONTRACT", "OP_NAMES", "DEFAULT_PRECISION", "exact", "get_precision",
           "precision", "FORMATS", "format_of", "round_to", "scale_ulp", "ulp", "ulp_distance"]
