"""Composition: an adapter's ops put together by the spec's one graph (spec.model.forward) into a
forward, a trace of every node, and a serving session with a real KV cache.

It sits between the adapters and the judging: it imports the spec, the checkpoints' config and the
adapter contract, never the judging, so building a serving path loads no strategy, op table or budget.
"""
