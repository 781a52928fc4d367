"""The adapter contract, checked at every call: what an op, a forward and a session step must return
(docs/adapter.md).  A breach raises ``ContractViolation``, naming the adapter, the call and what was
expected: the adapter broke, which the run reports apart from conformance failures (exit 6, not 1).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping

import numpy as np

from gemma4_conformance.checkpoints.quantized import QuantizedWeight
from gemma4_conformance.spec import CONTRACT, format_of
from gemma4_conformance.spec.model import nodes


class Unsupported(Exception):
    """The adapter does not implement the op, or refuses these arguments' shapes (a limit it states by
    raising this from the op, with why): a skip, listed in the report with the reason, never an error."""


class Refused(Unsupported):
    """The adapter refused these arguments: it raised ``Unsupported`` from the op (a shape beyond its
    kernel's stated limits)."""


class ContractViolation(Exception):
    """The adapter raised, or returned something other than the contract's array: the adapter broke,
    which is not a conformance failure (the run exits 6, not 1; see the plugin)."""


def call(adapter, op: str, args: tuple, dtype: str) -> np.ndarray:
    """The adapter's result for ``op`` on ``args``, checked for type, dtype and shape.

    The adapter gets copies, so an adapter that writes into its inputs cannot change what the
    oracle sees.
    """
    fn = getattr(adapter, op, None)
    if fn is None:
        raise Unsupported(f"{adapter.name} does not implement {op}")
    where = f"{adapter.name}.{op} in {dtype}"
    # an op without a floating argument (inv_freq) cannot tell the dtype from its inputs: it is told
    kwargs = {} if any(a.kind == "float" for a in CONTRACT[op].args) else {"dtype": dtype}
    try:
        out = fn(*(_copy(a) for a in args), **kwargs)
    except Unsupported as e:
        raise Refused(f"{where}: {e}") from None
    except Exception as e:
        raise ContractViolation(f"{where} raised {type(e).__name__}: {e}") from e
    if not isinstance(out, np.ndarray):
        raise ContractViolation(f"{where} returned {type(out).__name__}, not a numpy array")
    want_dtype = format_of(dtype).dtype
    if out.dtype != want_dtype:
        raise ContractViolation(f"{where} returned dtype {out.dtype}, expected {want_dtype}")
    want_shape = CONTRACT[op].output_shape(*args)
    if out.shape != want_shape:
        raise ContractViolation(f"{where} returned shape {out.shape}, expected {want_shape}")
    return out


def _copy(a):
    if isinstance(a, np.ndarray):
        return a.copy()
    if isinstance(a, QuantizedWeight):
        return dataclasses.replace(a, stored=a.stored.copy())
    return a


def run_forward(adapter, config, weights, tokens, dtype: str):
    """``adapter.forward(weights, config.raw, tokens, dtype, checkpoint=...)``, the checkpoint folder
    passed when the weights come from one and the adapter's forward takes it (adapters written before
    the argument existed take four); an exception is the adapter breaking, named as such."""
    kwargs = {}
    folder = getattr(weights, "path", None)
    if folder is not None and _accepts(adapter.forward, "checkpoint"):
        kwargs["checkpoint"] = str(folder)
    try:
        return adapter.forward(weights, config.raw, tokens.copy(), dtype, **kwargs)
    except ContractViolation:
        raise
    except Exception as e:
        raise ContractViolation(f"{adapter.name}.forward in {dtype} raised {type(e).__name__}: {e}") from e


def _accepts(fn, name: str) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == name or p.kind == p.VAR_KEYWORD for p in parameters)


_WIDER = {"float64": ("float64",), "float32": ("float64", "float32"),
          "bfloat16": ("float64", "float32", "bfloat16"), "float16": ("float64", "float32", "float16")}


def wide_enough(array: np.ndarray, dtype: str) -> bool:
    """Logits in the dtype under test or a wider one, what the forward and serving contracts accept
    (engines often return float32 logits of a bf16 or fp16 run)."""
    return str(array.dtype) in _WIDER[dtype]


def _array(value, what: str, where: str) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise ContractViolation(f"{where}: {what} is {type(value).__name__}, expected a numpy array")
    if value.dtype.kind != "f" and value.dtype != format_of("bfloat16").dtype:
        raise ContractViolation(f"{where}: {what} has dtype {value.dtype}, expected a floating dtype")
    return value


def check_output(out, config, T: int, dtype: str, where: str) -> dict:
    """An adapter forward's result checked against the forward contract (docs/adapter.md):
    ``{"logits", "hidden_states", "trace"}``, the optional ones None when not given."""
    if not isinstance(out, dict) or "logits" not in out:
        got = 'a dict without "logits"' if isinstance(out, dict) else type(out).__name__
        raise ContractViolation(f'{where} returned {got}; expected a dict with "logits" [T, V] and '
                                f'optionally "hidden_states" and "trace"')
    unknown = sorted(set(out) - {"logits", "hidden_states", "trace"})
    if unknown:
        raise ContractViolation(f"{where} returned the unknown key(s) {unknown}; the contract's keys are "
                                '"logits", "hidden_states" and "trace"')
    V, H, L = config.vocab_size, config.hidden_size, config.num_layers
    logits = _array(out["logits"], "logits", where)
    shape = tuple(logits.shape)
    if shape != (T, V):
        if shape == (V,):
            hint = "only one position's logits: every position's are judged"
        elif shape == (1, T, V):
            hint = "a batch axis: return the one sequence's [T, V]"
        elif len(shape) == 2 and shape[0] == T and shape[1] > V:
            hint = f"a vocabulary padded to {shape[1]}: return the first V = {V} columns"
        elif len(shape) == 2 and shape[1] == V and shape[0] < T:
            hint = f"{shape[0]} of the {T} positions"
        else:
            hint = "the wrong shape"
        raise ContractViolation(f"{where} returned logits of shape {shape}: {hint}; expected exactly "
                                f"[T, V] = {[T, V]}")
    if not wide_enough(logits, dtype):
        raise ContractViolation(f"{where} returned logits in {logits.dtype}, narrower than the dtype under test "
                                f"({dtype}); expected {dtype} or wider")
    hidden = out.get("hidden_states")
    if hidden is not None:
        if not isinstance(hidden, (list, tuple)):
            raise ContractViolation(f"{where}: hidden_states is {type(hidden).__name__}, expected a list of "
                                    f"{L} arrays [T, H], one per layer")
        if len(hidden) != L:
            hint = " (the embedding output counted first, as transformers' output_hidden_states does?)" \
                if len(hidden) == L + 1 else ""
            raise ContractViolation(f"{where} returned {len(hidden)} hidden states{hint}; expected one per layer, "
                                    f"{L}, each the layer's output [T, H] = {[T, H]}")
        for i, h in enumerate(hidden):
            h = _array(h, f"hidden_states[{i}]", where)
            if tuple(h.shape) != (T, H):
                raise ContractViolation(f"{where}: hidden_states[{i}] has shape {tuple(h.shape)}; expected the "
                                        f"layer's output [T, H] = {[T, H]}")
        hidden = list(hidden)
    trace = out.get("trace")
    if trace is not None:
        if not isinstance(trace, dict):
            raise ContractViolation(f"{where}: trace is {type(trace).__name__}, expected a dict of graph nodes "
                                    f"(spec.model.nodes) to arrays")
        graph = nodes(config)
        for node, value in trace.items():
            if node not in graph:
                layer = ", ".join(_layer_names(graph))
                raise ContractViolation(f"{where}: trace node {node!r} does not exist in the graph; its nodes are "
                                        f"embed, layers.{{i}}.<{layer}> and final_norm, logits (spec.model.nodes)")
            _array(value, f"trace[{node!r}]", where)
    return {"logits": logits, "hidden_states": hidden, "trace": trace}


def _layer_names(graph) -> list[str]:
    names = []
    for node in graph:
        if node.startswith("layers."):
            name = node.split(".", 2)[2]
            if name not in names:
                names.append(name)
    return names


def check_step(out, batch: Mapping[int, np.ndarray], vocab: int, dtype: str, where: str) -> None:
    """A step's result must be a dict with exactly the stepped ids, each [n, V] in the dtype or wider (as
    the forward contract), no NaN (the reference's logits are finite): anything else breaks the contract."""
    expected = (f"expected a dict with exactly the ids {sorted(batch)}, each a float array [n, {vocab}] in "
                f"{dtype} or wider")
    if not isinstance(out, Mapping):
        raise ContractViolation(f"{where} returned {type(out).__name__}; {expected}")
    if set(out) != set(batch):
        raise ContractViolation(f"{where} returned the ids {sorted(out, key=str)}; {expected}")
    for seq, rows in out.items():
        n = len(batch[seq])
        if not isinstance(rows, np.ndarray):
            raise ContractViolation(f"{where}: sequence {seq}'s logits are {type(rows).__name__}; {expected}")
        if rows.shape != (n, vocab) or not wide_enough(rows, dtype):
            raise ContractViolation(f"{where}: sequence {seq} appended {n} tokens and got logits {rows.dtype} "
                                    f"{list(rows.shape)}; {expected}")
        if np.isnan(rows.astype(np.float64)).any():
            raise ContractViolation(f"{where}: NaN in sequence {seq}'s logits, where the reference is finite")
