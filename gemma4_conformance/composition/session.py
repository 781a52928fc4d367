"""The composed serving path: the spec's graph continued from a real KV cache, with any adapter's ops.

    session = open_session(numpy_backend, weights, config, "bfloat16")  # any adapter with the graph's ops
    logits = session.step({0: prompt_chunk, 1: np.array([token])})       # {0: [n, V], 1: [1, V]} in bfloat16
    session.release(1)                                                    # id 1 may start again, empty
    logits, traces = session.traced_step({0: chunk})                      # and traces[0]: node -> its rows

This is the serving contract (docs/adapter.md), implemented once for every adapter without a session
of its own, as the forward composes the ops of one without a forward:
``Session(adapter, ...)`` runs ``spec.model.forward`` with the adapter's ops (``AdapterOps``, under
the contract's checks) and a ``KVCache`` as the graph's ``cache``, so the serving path is the same
graph as the forward, never a second copy of it per backend.

* One step packs every sequence's new tokens into one call of the graph, each sequence's tokens at
  the positions that continue it; every op but attention treats rows independently, so a prefill
  chunk of one sequence and decode steps of others share one call, as in continuous batching.
  The rows are padded to a power of two (``bucket``) so that a jitted backend sees few shapes.
* Attention runs per sequence: the cache hands the graph each sequence's keys and values (a
  ``Segments``) and each query row the position of its sequence's first key, and the session's ops
  call the adapter's attention op once per sequence with that sequence's rows.
* The cache has one slot per live sequence (the lowest free slot; a released slot is cleared and
  reused).  Per sliding layer a slot is a ring of ``window`` entries, the key of position p stored
  at p % window and read back in position order; per full layer a slot grows with the sequence.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from gemma4_conformance.adapters.contract import ContractViolation
from gemma4_conformance.checkpoints.config import TextConfig
from gemma4_conformance.spec import format_of
from gemma4_conformance.spec.model import forward

from .graph import AdapterOps, TraceRecorder

RESIDENT_BYTES = 1 << 30  # weights up to this size are read into memory once; a larger checkpoint streams


@dataclass
class Segments:
    """Per-sequence arrays of one packed step: ``arrays[i]`` belongs to the query rows ``rows[i]``."""

    arrays: list
    rows: list


@dataclass
class Segment:
    """One sequence's part of a step: its cache slot, its length before the step, its packed rows."""

    seq: int
    slot: int
    start: int
    rows: slice


def bucket(n: int) -> int:
    """The padded size of n rows: the next power of two, so that a backend that compiles per shape
    (jax) compiles a handful of shapes for a whole run, not one per step."""
    return 1 << max(0, n - 1).bit_length()


def _pad(a: np.ndarray, n: int, value=0) -> np.ndarray:
    return np.concatenate([a, np.full((n - len(a), *a.shape[1:]), value, a.dtype)]) if n > len(a) else a


class SessionOps(AdapterOps):
    """An adapter's ops for a packed step: attention over a ``Segments`` runs once per sequence.

    Each sequence's queries and keys are padded to ``bucket`` sizes: padded keys sit after every
    query's position, where causality hides them; padded queries repeat the last position and their
    rows are dropped.
    """

    def op(self, node, name, *args):
        if isinstance(args[-1], Segments):  # attention over the cache: its keys and values per sequence
            *head, positions, q, keys, values = args
            out = np.zeros(q.shape, q.dtype)  # padding rows, which belong to no sequence, stay 0
            for rows, k, v in zip(keys.rows, keys.arrays, values.arrays):
                S, L = rows.stop - rows.start, bucket(len(k))
                pos = _pad(positions[rows], bucket(S), positions[rows.stop - 1])
                out[rows] = self.call(name, *head, pos, _pad(q[rows], bucket(S)), _pad(k, L), _pad(v, L))[:S]
            return self.observed(node, name, args, out)
        return super().op(node, name, *args)


class KVCache:
    """Keys and values of every live sequence, per layer and slot (the graph's ``cache``).

    ``begin(segments)`` says which slot each sequence of the next call uses and how long it already
    is; the graph then calls ``attend`` once per layer with the call's new keys and values.
    """

    def __init__(self, config: TextConfig, dtype, slots: int = 1):
        self.config, self.dtype = config, np.dtype(dtype)
        self.rings = {l.index: self._zeros(slots, l.window, l) for l in config.layers if l.kind == "sliding"}
        self.full = {l.index: self._zeros(slots, 16, l) for l in config.layers if l.kind == "full"}
        self.lengths = np.zeros(slots, np.int64)  # tokens each slot holds
        self.segments: list[Segment] = []

    def _zeros(self, slots, length, layer):
        shape = (slots, length, layer.kv_heads, layer.head_dim)
        return np.zeros(shape, self.dtype), np.zeros(shape, self.dtype)

    def grow(self, slots: int) -> None:
        """Room for at least ``slots`` sequences."""
        def grown(k, v):
            extra = np.zeros((slots - len(k), *k.shape[1:]), self.dtype)
            return np.concatenate([k, extra]), np.concatenate([v, extra])

        if slots > len(self.lengths):
            self.rings = {i: grown(*kv) for i, kv in self.rings.items()}
            self.full = {i: grown(*kv) for i, kv in self.full.items()}
            self.lengths = np.concatenate([self.lengths, np.zeros(slots - len(self.lengths), np.int64)])

    def clear(self, slot: int) -> None:
        """Forget a released sequence: its slot starts empty for the next one (what it stored is
        never read again, as reads stop at the slot's length)."""
        self.lengths[slot] = 0

    def begin(self, segments: list[Segment]) -> None:
        """The next call's sequences: their slots, lengths before the call and packed rows."""
        self.segments = segments

    def advance(self) -> None:
        """The call is done: each of its sequences now holds its new tokens too."""
        for seg in self.segments:
            self.lengths[seg.slot] = seg.start + seg.rows.stop - seg.rows.start

    def attend(self, layer, positions, k, v):
        """Store this call's keys and values; return each sequence's visible keys and values in
        position order (``Segments``) and, per query row, the position of its sequence's first key."""
        keys, values, rows = [], [], []
        firsts = np.empty(len(positions), np.int64)
        sliding = layer.kind == "sliding"
        read, write = (self.read_ring, self.write_ring) if sliding else (self.read_full, self.write_full)
        for seg in self.segments:
            past_k, past_v, first = read(layer, seg)
            write(layer, seg, k[seg.rows], v[seg.rows])
            keys.append(np.concatenate([past_k, k[seg.rows]]))
            values.append(np.concatenate([past_v, v[seg.rows]]))
            rows.append(seg.rows)
            firsts[seg.rows] = first
        return Segments(keys, rows), Segments(values, rows), firsts

    # A sliding layer: a ring of `window` entries per slot.

    def ring_span(self, start: int, window: int) -> tuple[int, int]:
        """(first position, count) of the cached keys a chunk starting at ``start`` may see: the
        window - 1 before it (its first query sees those and itself)."""
        count = min(start, window - 1)
        return start - count, count

    def ring_order(self, first: int, count: int, window: int) -> np.ndarray:
        """The ring entries of positions first, first + 1, ...: position order, wrapping around."""
        return (first + np.arange(count)) % window

    def read_ring(self, layer, seg, store=None, window=None):
        """The keys and values a query of ``seg`` may see in a ring (default: the layer's own) of ``window``
        entries (default: the layer's), in position order, and the position of the first."""
        ring_k, ring_v = self.rings[layer.index] if store is None else store
        window = layer.window if window is None else window
        first, count = self.ring_span(seg.start, window)
        entries = self.ring_order(first, count, window)
        return ring_k[seg.slot, entries], ring_v[seg.slot, entries], first

    def write_ring(self, layer, seg, k, v, store=None, window=None):
        """Position p goes to entry p % window, evicting p - window; of a chunk longer than the window
        only its last ``window`` keys are kept."""
        ring_k, ring_v = self.rings[layer.index] if store is None else store
        window = layer.window if window is None else window
        keep = min(len(k), window)
        entries = (seg.start + np.arange(len(k) - keep, len(k))) % window
        ring_k[seg.slot, entries] = k[len(k) - keep:]
        ring_v[seg.slot, entries] = v[len(k) - keep:]

    # A full layer: every key of the sequence, in a buffer that doubles when full.

    def read_full(self, layer, seg):
        full_k, full_v = self.full[layer.index]
        return full_k[seg.slot, :seg.start], full_v[seg.slot, :seg.start], 0

    def write_full(self, layer, seg, k, v):
        full_k, full_v = self.full[layer.index]
        end = seg.start + len(k)
        if end > full_k.shape[1]:
            size = max(end, 2 * full_k.shape[1])
            pad = [(0, 0), (0, size - full_k.shape[1]), (0, 0), (0, 0)]
            self.full[layer.index] = full_k, full_v = np.pad(full_k, pad), np.pad(full_v, pad)
        full_k[seg.slot, seg.start:end] = k
        full_v[seg.slot, seg.start:end] = v


class SessionError(ValueError):
    """A step or release the serving contract does not allow (bad ids, tokens or shapes)."""


class Session:
    """The serving contract for an adapter's ops: ``step``, ``release``, ``close`` (module docstring)."""

    Cache = KVCache
    # traced_step is step with an observer on the same ops: the same logits, bit for bit, at the same cost
    # (so the invariance check may play traced from the start instead of replaying to locate).
    traced_steps_are_plain = True

    def __init__(self, adapter, weights: Mapping, config, dtype: str):
        self.config = config if isinstance(config, TextConfig) else TextConfig.from_dict(config)
        self.dtype = dtype
        self.ops = SessionOps(adapter, dtype)
        self.weights = _resident(weights, dtype)
        self.cache = self.Cache(self.config, format_of(dtype).dtype)
        self.slots: dict[int, int] = {}  # live sequence id -> its cache slot

    def positions(self, start: int, n: int) -> np.ndarray:
        """Where a sequence's n new tokens sit: right after its ``start`` cached ones."""
        return start + np.arange(n)

    def assign(self, new: list[int]) -> None:
        """A slot for each sequence that starts now: the lowest free one."""
        for seq in new:
            self.slots[seq] = min(set(range(len(self.slots) + 1)) - set(self.slots.values()))
        self.cache.grow(max(self.slots.values(), default=0) + 1)

    def step(self, batch: Mapping) -> dict:
        tokens = self._check(batch)
        self.assign([seq for seq in tokens if seq not in self.slots])
        segments, offset = [], 0
        for seq, t in tokens.items():
            slot = self.slots[seq]
            segments.append(Segment(seq, slot, int(self.cache.lengths[slot]), slice(offset, offset + len(t))))
            offset += len(t)
        positions = np.concatenate([self.positions(s.start, s.rows.stop - s.rows.start) for s in segments])
        rows = bucket(offset)  # padding rows: token 0 at position 0, in no sequence
        self.cache.begin(segments)
        logits = forward(self.ops, self.config, self.weights, _pad(np.concatenate(list(tokens.values())), rows),
                         _pad(positions, rows), cache=self.cache)["logits"]
        self.cache.advance()
        return {s.seq: logits[s.rows] for s in segments}

    def traced_step(self, batch: Mapping) -> tuple[dict, dict]:
        """``step``, and per sequence the trace of its rows in this step: node -> that node's output rows."""
        recorder = TraceRecorder()
        self.ops.observe = recorder
        try:
            logits = self.step(batch)
        finally:
            self.ops.observe = None
        return logits, {s.seq: {node: out[s.rows] for node, out in recorder.trace.items()} for s in self.cache.segments}

    def release(self, seq: int) -> None:
        if seq not in self.slots:
            raise SessionError(f"release({seq!r}): no live sequence has that id")
        self.cache.clear(self.slots.pop(seq))

    def close(self) -> None:
        """Free the cache; the session takes no more steps."""
        self.slots.clear()
        self.cache = None

    def _check(self, batch) -> dict[int, np.ndarray]:
        if not isinstance(batch, Mapping):
            raise SessionError(f"step() takes a dict of sequence id -> tokens, got {type(batch).__name__}")
        if not batch:
            raise SessionError("step() got no sequences: a step appends tokens to one sequence at least")
        out = {}
        for seq, t in batch.items():
            t = np.asarray(t)
            if isinstance(seq, bool) or not isinstance(seq, (int, np.integer)):
                raise SessionError(f"step(): sequence id {seq!r} is not an int")
            if t.ndim != 1 or len(t) == 0 or t.dtype.kind not in "iu":
                raise SessionError(f"step(): sequence {seq}'s tokens must be a non-empty 1-D int array, got "
                                   f"{t.dtype} {list(t.shape)}")
            if t.min() < 0 or t.max() >= self.config.vocab_size:
                raise SessionError(f"step(): sequence {seq} has a token outside [0, {self.config.vocab_size})")
            out[int(seq)] = t.astype(np.int64)
        return out


def _resident(weights: Mapping, dtype: str) -> Mapping:
    """The weights read into memory once, in the dtype the ops take them in, when they are small (a lazily
    mapped checkpoint would map every tensor again, and cast it, at every step); a large checkpoint keeps
    streaming a layer at a time."""
    if sum(np.asarray(weights[name]).nbytes for name in weights) > RESIDENT_BYTES:
        return weights
    return {name: np.asarray(weights[name]).astype(format_of(dtype).dtype) for name in weights}


def open_session(adapter, weights: Mapping, config, dtype: str, checkpoint: str | None = None):
    """A serving session of ``adapter``: its own (``adapter.session``, an engine's) where it has one,
    else its ops composed with a real KV cache (``Session``).  An exception is the adapter breaking."""
    if not hasattr(adapter, "session"):
        return Session(adapter, weights, config, dtype)
    try:
        return adapter.session(weights, config, dtype, checkpoint=checkpoint)
    except Exception as e:
        raise ContractViolation(f"{adapter.name}.session(...) in {dtype} raised {type(e).__name__}: {e}") from e
