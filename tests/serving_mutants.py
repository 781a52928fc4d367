"""Deliberately wrong serving sessions: the built-in session (adapters/session.py) with one cache bug.

Each mutant is the numpy backend's ops with a ``Session`` (or its ``KVCache``) of which one method
is replaced by a realistic mistake of a KV cache.  Load one with
--backend=tests.serving_mutants:ADAPTERS.<name>.

Two facts of a position-masked attention shape them: a ring that merely keeps one key too long, or
returns its keys in another order to a single decoding query, changes nothing (the mask drops the
extra key by its position; softmax is blind to the order of the keys it sums); so the late eviction
is a ring that reads an entry before it is overwritten, and the storage-order read shows in a
prefill chunk after the ring wrapped, where the queries of one chunk see different windows.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from gemma4_conformance.adapters import numpy_backend
from gemma4_conformance.composition.session import KVCache, Session


class EvictionOneEarly(KVCache):
    """The ring hands out window - 2 cached keys: position p - window + 1, still in the window of the
    query at p, is evicted one step early."""

    def ring_span(self, start, window):
        count = min(start, window - 2)
        return start - count, count


class EvictionOneLate(KVCache):
    """The ring reads one entry past the window's cached keys: the entry it takes for position p, not
    yet overwritten, still holds p - window, which should have been evicted; the query at p sees that
    key in its own place, and its own key one position late."""

    def ring_span(self, start, window):
        return start - min(start, window - 1), min(start, window)


class StorageOrder(KVCache):
    """The ring read in storage order (entry 0 first) instead of position order."""

    def ring_order(self, first, count, window):
        return np.sort(super().ring_order(first, count, window))


class WindowOnFullLayers(KVCache):
    """The full layers cached in a ring of the sliding window too: they forget keys older than it."""

    def __init__(self, config, dtype, slots=1):
        super().__init__(config, dtype, slots)
        self.window = next(l.window for l in config.layers if l.kind == "sliding")

    def read_full(self, layer, seg):
        return self.read_ring(layer, seg, self.full[layer.index], self.window)

    def write_full(self, layer, seg, k, v):
        self.write_ring(layer, seg, k, v, self.full[layer.index], self.window)


class RopeTwice(KVCache):
    """Cached keys rotated again when read back: RoPE applied to them twice (at their positions)."""

    ops = None  # the session's ops, set by the session

    def _rotated(self, layer, keys, first):
        rope = (layer.rope_theta, layer.rope_rot, layer.rope_denom, layer.rope_active)
        pos = np.repeat((first + np.arange(len(keys)))[:, None], layer.kv_heads, 1)
        return self.ops.op(f"layers.{layer.index}.k_rope", "rope", *rope, pos, keys)

    def read_ring(self, layer, seg):
        k, v, first = super().read_ring(layer, seg)
        return self._rotated(layer, k, first), v, first

    def read_full(self, layer, seg):
        k, v, first = super().read_full(layer, seg)
        return self._rotated(layer, k, first), v, first


class NotCleared(KVCache):
    """A released slot keeps its contents: the next sequence given it continues the old one's keys."""

    def clear(self, slot):
        pass


class PositionsRestart(Session):
    """Each prefill chunk's positions start at 0 again, as if it were a new prompt: its queries and
    keys are rotated at the wrong positions (masks, which follow the cache, stay right)."""

    class Cache(KVCache):
        def attend(self, layer, positions, k, v):  # the mask by the cache's order, as engines build it
            keys, values, firsts = super().attend(layer, positions, k, v)
            for seg in self.segments:
                firsts[seg.rows] += positions[seg.rows][0] - seg.start
            return keys, values, firsts

    def positions(self, start, n):
        return np.arange(n) if n > 1 else super().positions(start, n)


class SharedRows(Session):
    """The free slot is looked up once per step: sequences that join in the same step share its rows."""

    def assign(self, new):
        free = min(set(range(len(self.slots) + 1)) - set(self.slots.values()))
        for seq in new:
            self.slots[seq] = free
        self.cache.grow(free + 1)


class ServingMutant:
    """The numpy backend's ops, with a session whose cache (or session class) has one bug."""

    dtypes = ("float32", "bfloat16")

    def __init__(self, name, session=Session, cache=None):
        self.name = name
        self.session_class = type(name, (session,), {"Cache": cache or session.Cache})

    def __getattr__(self, attribute):  # the ops: numpy's
        return getattr(numpy_backend, attribute)

    def session(self, weights, config, dtype, checkpoint=None):
        session = self.session_class(numpy_backend, weights, config, dtype)
        if isinstance(session.cache, RopeTwice):
            session.cache.ops = session.ops
        return session


MUTANTS = [
    ServingMutant("eviction_one_early", cache=EvictionOneEarly),
    ServingMutant("eviction_one_late", cache=EvictionOneLate),
    ServingMutant("positions_restart_per_chunk", session=PositionsRestart),
    ServingMutant("released_slot_not_cleared", cache=NotCleared),
    ServingMutant("batch_shares_cache_rows", session=SharedRows),
    ServingMutant("window_on_full_layers", cache=WindowOnFullLayers),
    ServingMutant("rope_on_cached_keys_twice", cache=RopeTwice),
    ServingMutant("ring_read_in_storage_order", cache=StorageOrder),
]

ADAPTERS = SimpleNamespace(**{mutant.name: mutant for mutant in MUTANTS})
