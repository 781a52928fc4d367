"""A correct engine that is run-, batch- and chunk-invariant by construction, and its invariance mutants.

``ROW_BY_ROW`` is the numpy backend and its session with the three kernels whose sums follow the
shape of a call computed one row at a time: ``linear``, ``gate_up`` and ``lm_head`` a product of one
row with the weights (the same gemv whatever the number of rows), attention one query at a time over
exactly the keys up to it, its softmax summed in order (numpy's pairwise sum splits by the length, so
padded keys would move it).  Every other op is elementwise or reduces within a row.  It claims all
three relations, and holds them.

Each mutant is that engine with one realistic invariance bug, claiming the relation it breaks; load
one with --backend=tests.invariance_mutants:ADAPTERS.<name>.
"""

from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np

from gemma4_conformance.adapters import numpy_backend
from gemma4_conformance.composition.session import KVCache, Session


def _rows(product):
    """An op of the linear family computed row by row: each row's sums never see the other rows."""
    def op(*args):
        *head, x = args
        flat = x.reshape(-1, x.shape[-1])
        return np.stack([product(*head, row[None])[0] for row in flat]).reshape(*x.shape[:-1], -1)
    return op


def _softmax_in_order(s, visible):
    m = np.max(s, axis=-1, keepdims=True, where=visible, initial=-np.inf)
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.where(visible, np.exp(s - m), 0)
    total = np.add.accumulate(e, axis=-1)[..., -1:]  # in key order: trailing masked keys add exact zeros
    return e / np.where(total > 0, total, 1)


def _query_by_query(scale, visible, q, k, v):
    """numpy_backend._gqa one query row at a time, over the keys up to its last visible one."""
    out = np.zeros(q.shape, q.dtype)
    for s in range(len(q)):
        seen = int(np.flatnonzero(visible[s]).max()) + 1 if visible[s].any() else 1
        logits = scale * np.einsum("cgd,lcd->cgl", q[s], k[:seen])
        p = _softmax_in_order(logits, visible[s, None, None, :seen])
        out[s] = np.einsum("cgl,lcd->cgd", p, v[:seen])
    return out


def _attention(kernel):
    """causal_gqa and sliding_gqa over ``kernel(scale, visible, q, k, v)``, as numpy_backend builds them."""
    def causal_gqa(scale, pos, q, k, v):
        return kernel(scale, np.arange(len(k)) <= pos[:, None], q, k, v)

    def sliding_gqa(scale, window, pos, q, k, v):
        l, p = np.arange(len(k)), pos[:, None]
        return kernel(scale, (l <= p) & (p < l + window), q, k, v)

    return {"causal_gqa": causal_gqa, "sliding_gqa": sliding_gqa}


def _linear(W, x):
    return x @ W.T


def _gate_up(Wg, Wu, x):
    return np.concatenate([_linear(Wg, x), _linear(Wu, x)], axis=-1)


def _lm_head(mul, cap, W, x):
    logits = mul * _linear(W, x)
    return logits if cap is None else numpy_backend.softcap.wide(cap, logits)


def _op(fn, name):
    """``fn`` as an op of the contract named ``name`` (widened to float32, rounded once, as numpy's)."""
    def op(*args):
        return fn(*args)
    op.__name__ = name
    return numpy_backend._op(op)


class Engine:
    """The numpy backend with the row-by-row kernels (or the ``kernels`` given, by op name) and a
    session of ``session_class``; ``invariance``: what it claims."""

    dtypes = ("float32", "bfloat16")

    def __init__(self, name, invariance, session_class=Session, **kernels):
        ops = {"linear": _rows(_linear), "gate_up": _rows(_gate_up), "lm_head": _rows(_lm_head),
               **_attention(_query_by_query), **kernels}
        self.name, self.invariance, self.session_class = name, frozenset(invariance), session_class
        for op, fn in ops.items():
            setattr(self, op, _op(fn, op))

    def __getattr__(self, attribute):  # every other op: numpy's
        return getattr(numpy_backend, attribute)

    def session(self, weights, config, dtype, checkpoint=None):
        return self.session_class(self, weights, config, dtype)


# ----------------------------------------------------------------------------------------- mutants

SPLIT_K_ROWS = 4  # the mutant's split-K kernel takes over from this many rows


def _split_k_by_m(W, x):
    """Split-K chosen by the batch size, as a GEMM library picks its kernel by M: from SPLIT_K_ROWS
    rows the K axis is summed in two halves, each rounded to float32, then added."""
    if len(x.reshape(-1, x.shape[-1])) < SPLIT_K_ROWS:
        return _rows(_linear)(W, x)
    half = x.shape[-1] // 2
    return (x[..., :half] @ W[:, :half].T).astype(np.float32) + (x[..., half:] @ W[:, half:].T).astype(np.float32)


def _permuted_sum(W, x):
    """Atomic adds in whatever order the threads finish: the K axis summed in a fresh random order."""
    order = np.random.default_rng().permutation(x.shape[-1])
    products = x[..., None, order] * W[:, order]
    return np.add.accumulate(products, axis=-1)[..., -1]


def _rmsnorm_in_random_order(eps, x, w):
    """The sum of squares in a fresh random order per call, as atomic adds finish."""
    order = np.random.default_rng().permutation(x.shape[-1])
    mean = np.add.accumulate(x[..., order] ** 2, axis=-1)[..., -1:] / x.shape[-1]
    return x / np.sqrt(mean + eps) * w


def _prefill_kernel(scale, visible, q, k, v):
    """One query (a decode step) the row kernel; several (a prefill chunk) numpy's batched kernel."""
    return (_query_by_query if len(q) == 1 else numpy_backend._gqa)(scale, visible, q, k, v)


def _split_kv(scale, visible, q, k, v):
    """Flash-decoding: each query's keys in two halves, each half's softmax partials (its maximum, sum
    and weighted values) in float32, merged by rescaling to the larger maximum."""
    out = np.zeros(q.shape, q.dtype)
    for s in range(len(q)):
        seen = int(np.flatnonzero(visible[s]).max()) + 1
        merged = []
        for keys in (slice(0, (seen + 1) // 2), slice((seen + 1) // 2, seen)):
            logits = scale * np.einsum("cgd,lcd->cgl", q[s], k[keys])
            shown = visible[s, None, None, keys]
            m = np.max(logits, axis=-1, keepdims=True, where=shown, initial=-np.inf)
            with np.errstate(invalid="ignore"):
                e = np.where(shown, np.exp(logits - m), 0)
            merged.append((m, e.sum(-1, keepdims=True), np.einsum("cgl,lcd->cgd", e, v[keys])))
        top = np.maximum(merged[0][0], merged[1][0])
        scales = [np.exp(m - top) for m, _, _ in merged]
        total = sum(w * part for w, (_, part, _) in zip(scales, merged))
        out[s] = sum(w * o for w, (_, _, o) in zip(scales, merged)) / total
    return out


def _decode_kernel(scale, visible, q, k, v):
    """One query (a decode step) split-KV, several (a prefill chunk) the row kernel."""
    return (_split_kv if len(q) == 1 else _query_by_query)(scale, visible, q, k, v)


class LargeBatchBf16Keys(KVCache):
    """Keys stored in bfloat16 when a step holds several sequences (a memory-saving mode that kicks in
    under load), in the dtype otherwise."""

    def attend(self, layer, positions, k, v):
        if len(self.segments) > 1:
            k = k.astype(ml_dtypes.bfloat16).astype(k.dtype)
        return super().attend(layer, positions, k, v)


class Bf16KeysSession(Session):
    Cache = LargeBatchBf16Keys


class MixedStepSession(Session):
    """A step that mixes a decode (a piece of one token) with a prefill chunk runs every query through
    the decode kernel (split-KV): a prompt that joins while another sequence decodes differs from
    itself alone, the sequence decoding does not."""

    def __init__(self, adapter, *args):
        super().__init__(adapter, *args)
        self.adapter = adapter

    def step(self, batch):
        sizes = {len(t) for t in batch.values()}
        self.ops.adapter = MIXED_STEP_KERNELS if 1 in sizes and len(sizes) > 1 else self.adapter
        return super().step(batch)


MUTANTS = [
    Engine("split_k_chosen_by_batch_size", {"batch"}, linear=_split_k_by_m),
    Engine("prefill_attention_kernel_not_decode", {"chunk"}, **_attention(_prefill_kernel)),
    Engine("nondeterministic_sum_order", {"run"}, linear=_permuted_sum),
    Engine("rmsnorm_in_random_order", {"run"}, rmsnorm=_rmsnorm_in_random_order),
    Engine("keys_in_bf16_when_batch_large", {"batch"}, session_class=Bf16KeysSession),
    Engine("decode_kernel_in_a_mixed_step", {"batch"}, session_class=MixedStepSession,
           **_attention(_decode_kernel)),
]
MIXED_STEP_KERNELS = Engine("split_kv", (), **_attention(_split_kv))
ROW_BY_ROW = Engine("row_by_row", {"run", "batch", "chunk"})


class ClaimsNothing:
    """The numpy backend and its session as they are, claiming nothing (numpy claims "run")."""

    name, dtypes, invariance = "numpy-claims-nothing", numpy_backend.dtypes, frozenset()

    def __getattr__(self, attribute):
        return getattr(numpy_backend, attribute)


ADAPTERS = SimpleNamespace(**{engine.name: engine for engine in [ROW_BY_ROW, *MUTANTS]},
                           claims_nothing=ClaimsNothing())
