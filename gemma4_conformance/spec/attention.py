"""Attention.lean: masked softmax and grouped-query attention.

``q [S, Hkv, G, D]``, ``k, v [L, Hkv, D]``: query head ``c*G + g`` is ``q[:, c, g]`` and reads KV
head ``c``; ``pos [S]`` is the position of each query, and key ``l`` sits at position ``l``.
"""

import numpy as np
from mpmath import mp

from .basic import sigmoid
from .exact import dots, oracle


@oracle
def softmax(s, visible):
    """``softmax s visible``: ``s [..., L]``, ``visible`` boolean ``[..., L]``.

    .. code-block:: lean

        fun l => if visible l then
          Real.exp (s l) / ∑ m ∈ Finset.univ.filter visible, Real.exp (s m) else 0

    A row with nothing visible is all zeros.
    """
    visible = np.broadcast_to(np.asarray(visible, dtype=bool), s.shape)
    n = int(np.prod(s.shape[:-1], dtype=np.int64))
    rows, masks = s.reshape(n, s.shape[-1]), visible.reshape(n, s.shape[-1])
    out = np.full(rows.shape, mp.zero, dtype=object)
    for r, (row, mask) in enumerate(zip(rows, masks)):
        exps = {l: mp.exp(row[l]) for l in np.flatnonzero(mask)}
        total = mp.fsum(exps.values())
        for l, e in exps.items():
            out[r, l] = e / total
    return out.reshape(s.shape)


def _gqa(scale, visible, q, k, v):
    """The body shared by causalGQA and slidingGQA; ``visible [S, L]`` is each query's mask.

    The logits are kept exact (exp of a rounded logit s would lose log2 |s| bits).

    .. code-block:: lean

        fun s c g d =>
          let logit : Fin L → ℝ := fun l => scale * ∑ e, q s c g e * k l c e
          ∑ l, softmax logit (visible s) l * v l c d
    """
    seen = visible.any(axis=0)  # a key no query sees has weight 0 in every sum: leave it out
    k, v, visible = k[seen], v[seen], visible[:, seen]
    out = np.empty(q.shape[:-1] + v.shape[-1:], dtype=object)  # d reads v's column d only: a caller may
    # pass only the columns of v it needs
    for c in range(q.shape[1]):
        logit = dots(q[:, c], k[:, c], scale=scale, rounded=False)  # [S, G, L]
        out[:, c] = dots(softmax(logit, visible[:, None, :]), v[:, c].T)
    return out


def _keys_and_positions(pos, k):
    """Each key's position ``l`` as a row [1, L] and each query's ``pos s`` as a column [S, 1]."""
    return np.arange(k.shape[0])[None, :], np.asarray(pos, dtype=np.int64)[:, None]


@oracle(summed=("q", "k", "v"))
def causal_gqa(scale, pos, q, k, v):
    """``causalGQA scale pos q k v``: key ``l`` is visible to query ``s`` when ``l ≤ pos s``."""
    l, p = _keys_and_positions(pos, k)
    return _gqa(scale, l <= p, q, k, v)


@oracle(summed=("q", "k", "v"))
def sliding_gqa(scale, window, pos, q, k, v):
    """``slidingGQA scale window pos q k v``: query at position ``p`` sees keys ``l`` with ``p - w < l ≤ p``.

    The Lean mask is ``l.val ≤ pos s ∧ pos s < l.val + window``.
    """
    l, p = _keys_and_positions(pos, k)
    return _gqa(scale, (l <= p) & (p < l + window), q, k, v)


@oracle(summed=("q", "k", "v"))
def decode_gqa(scale, q, k, v):
    """``decodeGQA scale q k v := fun c g d => causalGQA (S := 1) scale (fun _ => L - 1) (fun _ => q) k v 0 c g d``"""
    L = k.shape[0]
    return causal_gqa(scale, np.array([L - 1]), q[None], k, v)[0]


@oracle
def sigmoid_gate(o, gate):
    """``sigmoidGate o gate := fun t i => o t i * sigmoid (gate t i)``"""
    return o * sigmoid(gate)
