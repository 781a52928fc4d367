"""The op table: one entry per op, from which the agreement tests, the budgets and the report follow.

An entry holds everything the suite knows about an op: its oracle (spec; its contract is the entry of
the same name in spec.CONTRACT, below the adapters, which check their calls against it), its cases (a
Hypothesis strategy, edge cases, real-size cases and the preparation of its arguments: strategies,
real_size), its error model's scale (error_models), its budget (tolerances.yaml, by the op's name) and
its *sampler*, which picks the output coordinates the oracle computes.  Code outside the table reads
an entry's fields and never asks which op it holds (tests/test_op_table.py).

Every drawn example, every real-size example and every op call of the generated model's forward is
checked on its whole output: a sampler draws a subset (of rows, output features, queries or KV
heads) only when the whole would cost more than ``work``, which happens for the 12B geometry's
forward and for large ``--case`` inputs.

What an oracle costs is counted in *element operations* of about a microsecond or two each: one
mpmath operation at the working precision, or judging one output element (rounding the exact
result twice, its error and the error model's scale).  Exact sums cost far less: they are integer
matrix products (spec.exact.dots), a fiftieth of an element operation per weight.  Adding an op is
one entry here, one oracle and one budget (docs/adding-an-op.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from gemma4_conformance import spec
from gemma4_conformance.checkpoints.quantized import WEIGHT_FORMATS, WeightFormat
from gemma4_conformance.spec import enclosures

from . import baselines, budget, error_models, real_size, strategies

# The oracle work one example may cost, in element operations: the largest real-size example (a
# 15360 x 3840 weight, or 4096 keys at 16 query heads) whole, about two seconds.
ORACLE_WORK = 2_000_000
WEIGHT = 1 / 50  # element operations per weight of an exact product
JUDGE = 4  # per output element: the oracle's own arithmetic and judging it


def _pick(rng, n: int, keep: int) -> np.ndarray:
    if keep >= n:  # no draw: a permutation of a whole output costs more than judging it
        return np.arange(n)
    return np.sort(rng.choice(n, size=max(1, keep), replace=False))


def rows(per_row: Callable[[tuple], float]):
    """Sample rows (the leading axes flattened) of a row-wise op whose arguments share them."""

    def sample(op, args, rng, work=ORACLE_WORK):
        _, lead = spec.CONTRACT[op].bind(*args)
        n = int(np.prod(lead, dtype=np.int64))
        keep = int(work // max(1, per_row(args)))
        return (args, (Ellipsis,)) if keep >= n else _rows(op, args, _pick(rng, n, keep))

    return sample


def _rows(op, args, keep):
    _, lead = spec.CONTRACT[op].bind(*args)
    n = int(np.prod(lead, dtype=np.int64))
    if len(keep) == n:
        return args, (Ellipsis,)
    index = np.unravel_index(keep, lead) if lead else ()
    return _row_args(op, args, keep), tuple(index)


def row_axes(op, args) -> tuple[int, ...]:
    """The axes that index a row-wise op's rows: the contract's row axes ("..."), or an embedding's tokens
    (its contract names them T; each output row reads its own token's row of the table)."""
    return np.shape(args[2]) if op == "embed" else spec.CONTRACT[op].bind(*args)[1]


def _row_args(op, args, rows) -> tuple:
    """The arguments of a row-wise op for ``rows`` (indices or a slice) of its leading axes, flattened."""
    contract = spec.CONTRACT[op]
    lead = row_axes(op, args)
    n = int(np.prod(lead, dtype=np.int64))
    if op == "embed":  # the tokens, with only the rows of the table they read
        return _embed(args, np.arange(n)[rows])[0]
    sub = []
    for a, value in zip(contract.args, args):
        if a.kind in ("float", "index", "mask") and a.shape.startswith("..."):
            value = np.asarray(value)
            value = value.reshape((n,) + value.shape[len(lead):])[rows]
        sub.append(value)
    return tuple(sub)


def row_blocks(op, args, step: int):
    """(first row, end row, the arguments of those rows) of a row-wise op, ``step`` rows at a time (the
    leading axes flattened; each block's arrays are views of the arguments)."""
    lead = row_axes(op, args)
    n = int(np.prod(lead, dtype=np.int64))
    for start in range(0, n, step):
        stop = min(n, start + step)
        yield start, stop, _row_args(op, args, slice(start, stop))


def restrict_rows(op, args, mask):
    """The rows holding an element of ``mask`` (over the op's output)."""
    _, lead = spec.CONTRACT[op].bind(*args)
    n = int(np.prod(lead, dtype=np.int64))
    return _rows(op, args, np.flatnonzero(mask.reshape(n, -1).any(axis=1)))


def _last(args):
    return np.shape(args[-1])[-1]


def matrix(op, args, rng, work=ORACLE_WORK):
    """linear, lm_head and gate_up: a subset of output features n (each costs its K weights and an
    output per row of x) and then, if even one feature is too much, of the rows of x."""
    *head, x = args
    weights = [i for i, a in enumerate(head) if isinstance(a, np.ndarray)]
    N, K = head[weights[0]].shape
    n_rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    keep_n = _pick(rng, N, int(work // (len(weights) * (K * WEIGHT + JUDGE * n_rows))))
    if len(keep_n) == N:
        return args, (Ellipsis,)
    keep_rows = _pick(rng, n_rows, int(work // (len(weights) * len(keep_n) * JUDGE)))
    return _matrix(op, args, keep_n, keep_rows)


def _matrix(op, args, keep_n, keep_rows):
    *head, x = args
    weights = [i for i, a in enumerate(head) if isinstance(a, np.ndarray)]
    N, K = head[weights[0]].shape
    lead = x.shape[:-1]
    n_rows = int(np.prod(lead, dtype=np.int64))
    if len(keep_n) == N and len(keep_rows) == n_rows:
        return args, (Ellipsis,)
    sub = list(head)
    for i in weights:
        sub[i] = head[i][keep_n]
    sub.append(x.reshape(n_rows, K)[keep_rows] if lead else x)
    columns = np.concatenate([keep_n + i * N for i in range(len(weights))])  # gate_up: both halves
    row_index = np.unravel_index(keep_rows, lead) if lead else ()
    if row_index:
        index = tuple(r[:, None] for r in row_index) + (columns[None, :],)
    else:
        index = (columns,)
    return tuple(sub), index


def restrict_matrix(op, args, mask):
    """The output features and rows holding an element of ``mask``."""
    x = args[-1]
    cells = mask.reshape(int(np.prod(x.shape[:-1], dtype=np.int64)), -1)
    weights = sum(isinstance(a, np.ndarray) for a in args[:-1])
    cells = np.logical_or.reduce(np.split(cells, weights, axis=1))  # gate_up: either half
    return _matrix(op, args, np.flatnonzero(cells.any(axis=0)), np.flatnonzero(cells.any(axis=1)))


def _per_query_head(L, D):
    """One query head against L keys: an exp and a share of the softmax per key, D outputs."""
    return JUDGE * (L + D)


def attention(op, args, rng, work=ORACLE_WORK):
    """causal and sliding GQA: a subset of queries and KV heads (each query keeps its position)."""
    *head, pos, q, k, v = args
    S, Hkv, G, D = q.shape
    L = k.shape[0]
    keep_s = _pick(rng, S, int(work // (Hkv * G * _per_query_head(L, D))))
    keep_c = _pick(rng, Hkv, int(work // (len(keep_s) * G * _per_query_head(L, D))))
    return _attention(args, keep_s, keep_c)


def _attention(args, keep_s, keep_c, keep_g=None, keep_d=None):
    """The queries keep_s of the KV heads keep_c, and of those the query heads keep_g and the value
    features keep_d (all where None): an output feature reads only its own column of v."""
    *head, pos, q, k, v = args
    S, Hkv, G, D = q.shape
    keep_g = np.arange(G) if keep_g is None else keep_g
    keep_d = np.arange(D) if keep_d is None else keep_d
    if (len(keep_s), len(keep_c), len(keep_g), len(keep_d)) == (S, Hkv, G, D):
        return args, (Ellipsis,)
    sub = (*head, np.asarray(pos)[keep_s], q[np.ix_(keep_s, keep_c, keep_g)], k[:, keep_c],
           v[:, keep_c][..., keep_d])
    return sub, np.ix_(keep_s, keep_c, keep_g, keep_d)


def _marked(mask, axis):
    """The indices along ``axis`` that hold an element of ``mask``."""
    return np.flatnonzero(mask.any(axis=tuple(a for a in range(mask.ndim) if a != axis)))


def restrict_attention(op, args, mask):
    """The queries, KV heads, query heads and value features holding an element of ``mask``."""
    return _attention(args, *(_marked(mask, axis) for axis in range(4)))


def decode(op, args, rng, work=ORACLE_WORK):
    scale, q, k, v = args
    Hkv, G, D = q.shape
    L = k.shape[0]
    return _decode(args, _pick(rng, Hkv, int(work // (G * _per_query_head(L, D)))))


def _decode(args, keep_c, keep_g=None, keep_d=None):
    scale, q, k, v = args
    Hkv, G, D = q.shape
    keep_g = np.arange(G) if keep_g is None else keep_g
    keep_d = np.arange(D) if keep_d is None else keep_d
    if (len(keep_c), len(keep_g), len(keep_d)) == (Hkv, G, D):
        return args, (Ellipsis,)
    return (scale, q[np.ix_(keep_c, keep_g)], k[:, keep_c], v[:, keep_c][..., keep_d]), np.ix_(keep_c, keep_g, keep_d)


def restrict_decode(op, args, mask):
    return _decode(args, *(_marked(mask, axis) for axis in range(3)))


def embed(op, args, rng, work=ORACLE_WORK):
    c, E, tokens = args
    return _embed(args, _pick(rng, len(tokens), int(work // (JUDGE * E.shape[1]))))


def _embed(args, keep):
    """The tokens ``keep`` with only the rows of E they read (the oracle takes each entry of E exactly)."""
    c, E, tokens = args
    tokens = np.asarray(tokens)
    rows, read = np.unique(tokens[keep], return_inverse=True)
    if len(keep) == len(tokens) and len(rows) == len(E):
        return args, (Ellipsis,)
    return (c, np.asarray(E)[rows], read.reshape(-1)), (keep,)


def restrict_embed(op, args, mask):
    return _embed(args, np.flatnonzero(mask.any(axis=1)))


def whole(op, args, rng, work=ORACLE_WORK):
    return args, (Ellipsis,)


@dataclass(frozen=True)
class OpEntry:
    name: str
    oracle: Callable
    scale: Callable  # error_models: (args as float64, exact as float64, dtype) -> (scale, absolute) per element
    sample: Callable  # (op, args, rng, work) -> (sub-args, index into the backend's output)
    cases: Callable  # (dtype, op) -> the Hypothesis strategy of the op's cases (strategies)
    edge_cases: Callable = strategies.no_edges  # op -> the cases every run checks before drawing any
    real_size_cases: Callable = real_size.none  # op -> the cases at the real model's dimensions
    # (case, arguments by name, format) -> None: what a case's own keys (cancel, offset) do to its
    # arguments, in place
    prepare: Callable | None = None
    quantities: Callable = lambda args: {}  # budget names beyond the contract's dimensions
    tier2: Callable | None = None  # the second tier's error model, where tolerances.yaml gives one
    baselines: Callable | None = None  # (args, dtype) -> the plain same-dtype arrangements' outputs
    # (args as float64, exact as float64, dtype) -> where the modelled arrangement's intermediate may
    # overflow although the exact result is finite: an inf of the exact result's sign is accepted there
    overflows: Callable | None = None
    # The judging's first stage: (args, work=) -> (mid, rad) enclosing the oracle's result
    # (spec.enclosures), None where the oracle judges every element.
    enclosure: Callable | None = None
    # (op, args, mask over the output) -> (sub-args, index): the least part of the sampler's kind that
    # holds the masked elements, for the oracle to judge what the first stage could not.
    restrict: Callable | None = None
    # Declared roundings (an adapter's ``formats``): key -> (args as float64, dtype, format) -> (the
    # scale's increase, the term added to the absolute allowance) per output element, or None for a format
    # without a term; ``weights`` also gets the declared activations' format (error_models,
    # tolerances.yaml's ``declared``)
    declared: dict[str, Callable] = field(default_factory=dict)
    attention: error_models.AttentionInputs | None = None  # an attention op's arguments as queries
    blocks: tuple[int, ...] = ()  # row blocks (M) whose batch invariance is checked beside 1 and all rows
    # The op reads positions or keys across a sequence (the graph's rope and prefill attention), so a long
    # sequence's reference certifies its calls whole; every other op acts on each token alone, with the
    # weights and shapes per token that the forward test certifies whole, and there it samples their calls.
    long_context: bool = False

    @property
    def row_wise(self) -> bool:
        """Each output row depends on its own rows of the arguments alone (``row_blocks`` splits it), an
        embedding's on its own token's row of the table."""
        return self.restrict in (restrict_rows, restrict_embed)

    @property
    def prefill(self) -> bool:
        """Attention of queries at positions ``pos`` over keys 0..L-1: its arguments end (pos, q, k, v)."""
        return self.attention is not None and not self.attention.one_query


def entry(name, scale, sample, cases, quantities=None, tier2=None, **fields):
    """The op's entry: its oracle and first stage by its name, and the restriction its sampler's kind has."""
    restrict = {matrix: restrict_matrix, attention: restrict_attention, decode: restrict_decode,
                embed: restrict_embed, whole: None}.get(sample, restrict_rows)
    plain = partial(baselines.arrangements, fields["attention"]) if tier2 is not None else None
    return OpEntry(name, spec.ORACLES[name], scale, sample, cases, quantities=quantities or (lambda args: {}),
                   tier2=tier2, baselines=plain, enclosure=enclosures.ENCLOSURES.get(name), restrict=restrict,
                   **fields)


elementwise = rows(lambda args: JUDGE * (_last(args) if np.ndim(args[-1]) else 1))
norm = rows(lambda args: JUDGE * _last(args))
rope = rows(lambda args: 3 * JUDGE * _last(args))  # a cos and a sin at the angle's guard precision
ROW_BLOCKS = (3, 8)  # matrix products: kernels tile their rows in blocks

_norm_cases = {"edge_cases": strategies.norm_edges, "real_size_cases": real_size.norm}

OPS: dict[str, OpEntry] = {
    e.name: e
    for e in (
        entry("sigmoid", error_models.exact_magnitude, elementwise, strategies.elementwise),
        entry("silu", error_models.silu, elementwise, strategies.elementwise),
        entry("gelu_tanh", error_models.gelu_tanh, elementwise, strategies.elementwise,
              edge_cases=strategies.gelu_edges),
        entry("softcap", error_models.softcap, elementwise, partial(strategies.elementwise, capped=True)),
        entry("rms", error_models.rms, norm, strategies.norm, **_norm_cases),
        entry("rmsnorm", error_models.rmsnorm, norm, strategies.norm, **_norm_cases),
        entry("rmsnorm_offset", error_models.rmsnorm_offset, norm, strategies.norm, **_norm_cases),
        entry("rmsnorm_unit", error_models.rmsnorm_unit, norm, strategies.norm, **_norm_cases),
        entry("rmsnorm_gated", error_models.rmsnorm_gated, norm, strategies.norm, **_norm_cases),
        entry("l2norm", error_models.l2norm, norm, strategies.norm, **_norm_cases),
        entry("inv_freq", error_models.inv_freq, whole, strategies.inv_freq),
        entry("rope", error_models.rope, rope, strategies.rope, long_context=True),
        entry("rope_std", error_models.rope, rope, strategies.rope),
        entry("linear", error_models.inner_products, matrix, strategies.linear, edge_cases=strategies.linear_edges,
              real_size_cases=real_size.linear, prepare=strategies.cancel_dot, blocks=ROW_BLOCKS,
              declared={"activations": error_models.declared_activations, "weights": error_models.declared_weights}),
        entry("gate_up", error_models.inner_products, matrix, strategies.linear, edge_cases=strategies.linear_edges,
              real_size_cases=real_size.gate_up, prepare=strategies.cancel_dot, blocks=ROW_BLOCKS,
              declared={"activations": error_models.declared_activations, "weights": error_models.declared_weights}),
        entry("silu_mul", error_models.silu_mul, elementwise, partial(strategies.elementwise, halves=True)),
        entry("gelu_mul", error_models.gelu_mul, elementwise, partial(strategies.elementwise, halves=True),
              edge_cases=partial(strategies.gelu_edges, halves=True)),
        entry("residual", error_models.residual, elementwise, strategies.residual, prepare=strategies.cancel_residual),
        entry("embed", error_models.exact_magnitude, embed, strategies.embed),
        entry("lm_head", error_models.lm_head, matrix, partial(strategies.linear, head=True),
              lambda args: {"capped": float(args[1] is not None)}, overflows=error_models.lm_head_logit_overflows,
              edge_cases=partial(strategies.linear_edges, head=True), real_size_cases=real_size.lm_head,
              prepare=strategies.cancel_dot, blocks=ROW_BLOCKS,
              declared={"activations": error_models.lm_head_declared_activations,
                        "weights": error_models.lm_head_declared_weights}),
        entry("softmax", error_models.softmax, norm, strategies.softmax, edge_cases=strategies.softmax_edges,
              real_size_cases=real_size.softmax, prepare=strategies.offset_logits),
        entry("causal_gqa", error_models.causal_gqa, attention, strategies.attention,
              tier2=error_models.causal_gqa_in_accumulation, attention=error_models.CAUSAL,
              edge_cases=strategies.attention_edges, real_size_cases=real_size.full_attention,
              prepare=strategies.offset_attention, long_context=True,
              declared={"kv_cache": error_models.causal_gqa_kv_cache}),
        entry("sliding_gqa", error_models.sliding_gqa, attention, strategies.attention,
              tier2=error_models.sliding_gqa_in_accumulation, attention=error_models.SLIDING,
              edge_cases=strategies.attention_edges, real_size_cases=real_size.sliding_attention,
              prepare=strategies.offset_attention, long_context=True,
              declared={"kv_cache": error_models.sliding_gqa_kv_cache}),
        entry("decode_gqa", error_models.decode_gqa, decode, strategies.attention,
              tier2=error_models.decode_gqa_in_accumulation, attention=error_models.DECODE,
              edge_cases=strategies.attention_edges, real_size_cases=real_size.full_attention,
              prepare=strategies.offset_attention, declared={"kv_cache": error_models.decode_gqa_kv_cache}),
        entry("sigmoid_gate", error_models.sigmoid_gate, elementwise, strategies.elementwise),
    )
}

assert set(OPS) == set(spec.OP_NAMES), "every op of the contract needs an entry"
assert all((e.tier2 is not None) == (budget.budget(e.name, "float32").tier2 is not None) for e in OPS.values()), \
    "an op has a second tier exactly where tolerances.yaml gives one"
assert all(set(e.declared) == set(budget.budget(e.name, "float32").declared) for e in OPS.values()), \
    "an op has a declared term exactly where tolerances.yaml derives one"


WEIGHTS = frozenset({"W", "Wg", "Wu"})  # a product's weights: what a declared weight format holds


def held_block(op: str, formats: dict[str, str]) -> int | None:
    """The values per block of the block weight format (q8_0, ..., int4) that ``formats`` declare, where
    ``op`` has weights: an adapter that declares one holds its weights in it, and the op tests hand them so
    (judging.held).  None otherwise: fp8 weights are rounded from the dtype by the adapter itself, a
    rounding their declared term bounds."""
    fmt = block_format(formats)
    if fmt is None or not WEIGHTS & set(spec.CONTRACT[op].arg_names):
        return None
    return fmt.block


def block_format(formats: dict[str, str]) -> WeightFormat | None:
    """The block weight format ``formats`` declare (the weights the adapter holds), or None."""
    fmt = WEIGHT_FORMATS.get(formats.get("weights"))
    return fmt if isinstance(fmt, WeightFormat) else None


def cases(op: str, dtype: str, formats: dict[str, str] | None = None):
    """The Hypothesis strategy of ``op``'s cases in ``dtype``, its weights' rows whole blocks of the block
    weight format ``formats`` declare, if any."""
    block = held_block(op, formats or {})
    return OPS[op].cases(dtype, op) if block is None else OPS[op].cases(dtype, op, block=block)


def edge_cases(op: str) -> list[dict]:
    return OPS[op].edge_cases(op)


def real_size_cases(op: str) -> list[dict]:
    return OPS[op].real_size_cases(op)


def build(op: str, case: dict, dtype: str) -> tuple:
    """The op's arguments in Lean order, floating arrays in ``dtype``, from a case."""
    values = strategies.arguments(op, case, dtype)
    if OPS[op].prepare is not None:
        OPS[op].prepare(case, values, spec.format_of(dtype))
    return tuple(values[a.name] for a in spec.CONTRACT[op].args)
