"""The op table: one entry per op, from which the agreement tests, the budgets and the report follow.

An entry ties an op to its oracle (spec), its input strategy (strategies.cases), its error model's
scale (error_models), its budget (tolerances.yaml) and its *sampler*, which picks the output
coordinates the oracle computes when the full output would be slow: the oracle runs at about two
million multiply-adds a second, so large outputs are checked on a drawn subset of rows, columns,
queries or heads, small ones in full.  Adding an op is adding an entry here, a case strategy and a
budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gemma4_conformance import spec

from . import budget, error_models, plain

# The oracle work an example may cost, in multiply-adds (about 0.05 s of mpmath).
ORACLE_WORK = 100_000


def _pick(rng, n: int, keep: int) -> np.ndarray:
    return np.sort(rng.choice(n, size=min(n, max(1, keep)), replace=False))


def rows(per_row: Callable[[tuple], int]):
    """Sample rows (the leading axes flattened) of a row-wise op whose arguments share them."""

    def sample(op, args, rng, work=ORACLE_WORK):
        contract = spec.CONTRACT[op]
        _, lead = contract.bind(*args)
        n = int(np.prod(lead, dtype=np.int64))
        keep = _pick(rng, n, work // max(1, per_row(args)))
        if len(keep) == n:
            return args, (Ellipsis,)
        sub = []
        for a, value in zip(contract.args, args):
            if a.kind in ("float", "index", "mask") and a.shape.startswith("..."):
                value = np.asarray(value)
                value = value.reshape((n,) + value.shape[len(lead):])[keep]
            sub.append(value)
        index = np.unravel_index(keep, lead) if lead else ()
        return tuple(sub), tuple(index)

    return sample


def _last(args):
    return np.shape(args[-1])[-1]


def matrix(op, args, rng, work=ORACLE_WORK):
    """linear, lm_head and gate_up: a subset of rows of x and of output features n."""
    *head, x = args
    weights = [i for i, a in enumerate(head) if isinstance(a, np.ndarray)]
    N, K = head[weights[0]].shape
    lead = x.shape[:-1]
    n_rows = int(np.prod(lead, dtype=np.int64))
    keep_rows = _pick(rng, n_rows, max(1, work // (K * min(N, 8))))
    keep_n = _pick(rng, N, max(1, work // (K * len(keep_rows) * len(weights))))
    sub = list(head)
    for i in weights:
        sub[i] = head[i][keep_n]
    sub.append(x.reshape(n_rows, K)[keep_rows] if lead else x)
    columns = keep_n if op != "gate_up" else np.concatenate([keep_n, keep_n + N])
    row_index = np.unravel_index(keep_rows, lead) if lead else ()
    if row_index:
        index = tuple(r[:, None] for r in row_index) + (columns[None, :],)
    else:
        index = (columns,)
    return tuple(sub), index


def attention(op, args, rng, work=ORACLE_WORK):
    """causal and sliding GQA: a subset of queries and KV heads (each query keeps its position)."""
    *head, pos, q, k, v = args
    S, Hkv, G, D = q.shape
    L = k.shape[0]
    keep_s = _pick(rng, S, work // (2 * L * D * G * Hkv) or 1)
    keep_c = _pick(rng, Hkv, work // (2 * L * D * G * len(keep_s)) or 1)
    sub = (*head, np.asarray(pos)[keep_s], q[keep_s][:, keep_c], k[:, keep_c], v[:, keep_c])
    return sub, np.ix_(keep_s, keep_c, np.arange(G), np.arange(D))


def decode(op, args, rng, work=ORACLE_WORK):
    scale, q, k, v = args
    Hkv, G, D = q.shape
    L = k.shape[0]
    keep_c = _pick(rng, Hkv, work // (2 * L * D * G) or 1)
    return (scale, q[keep_c], k[:, keep_c], v[:, keep_c]), np.ix_(keep_c, np.arange(G), np.arange(D))


def embed(op, args, rng, work=ORACLE_WORK):
    c, E, tokens = args
    keep = _pick(rng, len(tokens), work // E.shape[1])
    return (c, E, np.asarray(tokens)[keep]), (keep,)


def whole(op, args, rng, work=ORACLE_WORK):
    return args, (Ellipsis,)


@dataclass(frozen=True)
class OpEntry:
    name: str
    oracle: Callable
    scale: Callable  # error_models: (args as float64, exact as float64, dtype) -> (scale, absolute) per element
    sample: Callable  # (op, args, rng, work) -> (sub-args, index into the backend's output)
    quantities: Callable = lambda args: {}  # budget names beyond the contract's dimensions
    tier2: Callable | None = None  # the second tier's error model, where tolerances.yaml gives one
    plain: Callable | None = None  # (op, args, dtype) -> the plain same-dtype arrangements' outputs


def _entry(name, scale, sample, quantities=None, tier2=None):
    return OpEntry(name, getattr(spec, name), scale, sample, quantities or (lambda args: {}), tier2,
                   plain.arrangements if tier2 is not None else None)


_elementwise = rows(lambda args: 8 * _last(args) if np.ndim(args[-1]) else 8)
_norm = rows(lambda args: 4 * _last(args))

OPS: dict[str, OpEntry] = {
    e.name: e
    for e in (
        _entry("sigmoid", error_models.exact_magnitude, _elementwise),
        _entry("silu", error_models.silu, _elementwise),
        _entry("gelu_tanh", error_models.gelu_tanh, _elementwise),
        _entry("softcap", error_models.softcap, _elementwise),
        _entry("rms", error_models.rms, _norm),
        _entry("rmsnorm", error_models.rmsnorm, _norm),
        _entry("rmsnorm_offset", error_models.rmsnorm_offset, _norm),
        _entry("rmsnorm_unit", error_models.rmsnorm_unit, _norm),
        _entry("rmsnorm_gated", error_models.rmsnorm_gated, _norm),
        _entry("l2norm", error_models.l2norm, _norm),
        _entry("inv_freq", error_models.inv_freq, whole),
        _entry("rope", error_models.rope, rows(lambda args: 40 * _last(args))),
        _entry("rope_std", error_models.rope, rows(lambda args: 40 * _last(args))),
        _entry("linear", error_models.inner_products, matrix),
        _entry("gate_up", error_models.inner_products, matrix),
        _entry("silu_mul", error_models.silu_mul, _elementwise),
        _entry("gelu_mul", error_models.gelu_mul, _elementwise),
        _entry("residual", error_models.residual, _elementwise),
        _entry("embed", error_models.exact_magnitude, embed),
        _entry("lm_head", error_models.lm_head, matrix, lambda args: {"capped": float(args[1] is not None)}),
        _entry("softmax", error_models.softmax, rows(lambda args: 4 * _last(args))),
        _entry("causal_gqa", error_models.causal_gqa, attention, tier2=error_models.causal_gqa_in_accumulation),
        _entry("sliding_gqa", error_models.sliding_gqa, attention, tier2=error_models.sliding_gqa_in_accumulation),
        _entry("decode_gqa", error_models.decode_gqa, decode, tier2=error_models.decode_gqa_in_accumulation),
        _entry("sigmoid_gate", error_models.sigmoid_gate, _elementwise),
    )
}

assert set(OPS) == set(spec.OP_NAMES), "every op of the contract needs an entry"
assert all((e.tier2 is not None) == (budget.budget(e.name, "float32").tier2 is not None) for e in OPS.values()), \
    "an op has a second tier exactly where tolerances.yaml gives one"
