"""Attention.lean: masked softmax and grouped-query attention.

``q [S, Hkv, G, D]``, ``k, v [L, Hkv, D]``: query head ``c*G + g`` is ``q[:, c, g]`` and reads KV
head ``c``; ``pos [S]`` is the position of each query, and key ``l`` sits at position ``l``.
"""

import numpy as np
from mpmath import mp, mpf
from mpmath.libmp import mpf_mul

from .basic import sigmoid
from .exact import dot, oracle


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
    """The body shared by causalGQA and slidingGQA; ``visible(s, l)`` is the mask of query s.

    The logits are kept exact (exp of a rounded logit s would lose log2 |s| bits).

    .. code-block:: lean

        fun s c g d =>
          let logit : Fin L → ℝ := fun l => scale * ∑ e, q s c g e * k l c e
          ∑ l, softmax logit (visible s) l * v l c d
    """
    S, Hkv, G, D = q.shape
    L = k.shape[0]
    out = np.empty(q.shape, dtype=object)
    for c in range(Hkv):
        keys = [list(k[l, c]) for l in range(L)]
        values = [list(v[:, c, d]) for d in range(D)]
        for s in range(S):
            mask = np.array([visible(s, l) for l in range(L)], dtype=bool)
            for g in range(G):
                query = list(q[s, c, g])
                logit = np.array([mp.make_mpf(mpf_mul(mpf(scale)._mpf_, dot(query, keys[l], rounded=False)._mpf_))
                                  for l in range(L)], dtype=object)
                p = list(softmax(logit, mask))
                for d in range(D):
                    out[s, c, g, d] = dot(p, values[d])
    return out


@oracle
def causal_gqa(scale, pos, q, k, v):
    """``causalGQA scale pos q k v``: key ``l`` is visible to query ``s`` when ``l ≤ pos s``."""
    pos = [int(p) for p in np.asarray(pos)]
    return _gqa(scale, lambda s, l: l <= pos[s], q, k, v)


@oracle
def sliding_gqa(scale, window, pos, q, k, v):
    """``slidingGQA scale window pos q k v``: query at position ``p`` sees keys ``l`` with ``p - w < l ≤ p``.

    The Lean mask is ``l.val ≤ pos s ∧ pos s < l.val + window``.
    """
    pos = [int(p) for p in np.asarray(pos)]
    return _gqa(scale, lambda s, l: l <= pos[s] and pos[s] < l + window, q, k, v)


@oracle
def decode_gqa(scale, q, k, v):
    """``decodeGQA scale q k v := fun c g d => causalGQA (S := 1) scale (fun _ => L - 1) (fun _ => q) k v 0 c g d``"""
    L = k.shape[0]
    return causal_gqa(scale, np.array([L - 1]), q[None], k, v)[0]


@oracle
def sigmoid_gate(o, gate):
    """``sigmoidGate o gate := fun t i => o t i * sigmoid (gate t i)``"""
    return o * sigmoid(gate)
