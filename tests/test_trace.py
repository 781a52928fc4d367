"""Per-node verdicts from a trace (properties/trace.py): a correct engine passes every node, a wrong op is
named first with its layer, and an untraced node is reported as such without blaming another."""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest

from gemma4_conformance.adapters import declared_formats, load, numpy_backend
from gemma4_conformance.checkpoints import checkpoint, generate
from gemma4_conformance.checkpoints.quantized import QuantizedWeight
from gemma4_conformance.composition.graph import AdapterOps, TraceRecorder, composed
from gemma4_conformance.report.data import trace_entry
from gemma4_conformance.properties.trace import (
    FAILED,
    INPUTS_NOT_TRACED,
    NOT_TRACED,
    PASSED,
    Call,
    TraceVerdict,
    _judge,
    completed,
    judge_trace,
    replay,
)
from gemma4_conformance.spec import format_of
from gemma4_conformance.spec.model import forward
from tests.quantized_engines import DECLARED, FP8_DECLARED, FP8_FORMATS, KV_DECLARED, Q8_0_WEIGHTS
from tests.trace_engines import WRONG_OPS, OneWrongNode, small_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return small_model(tmp_path_factory.mktemp("trace"))


def trace_of(adapter, model, dtype, config=None):
    weights, tokens, _ = model
    config = config or weights.config
    out = composed(adapter, config, weights, tokens, dtype, trace=True)
    return completed(out["trace"], out, config)


def outcomes(verdict) -> dict:
    return {n.node: n.outcome for n in verdict.nodes}


BACKENDS = ["numpy"] + [name for name in ("torch",) if importlib.util.find_spec(name)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_correct_engines_trace_passes_every_node(backend, model):
    weights, tokens, _ = model
    verdict = judge_trace(trace_of(load(backend), model, "bfloat16"), weights.config, weights, tokens, "bfloat16")
    assert set(outcomes(verdict).values()) == {PASSED}, verdict.summary()
    assert len(verdict.nodes) == len({n.node for n in verdict.nodes}) > 200 and not verdict.failures


@pytest.mark.parametrize("engine, dtype, eps, first, op", WRONG_OPS, ids=[e[0].name for e in WRONG_OPS])
def test_a_wrong_op_is_named_first_with_its_layer(engine, dtype, eps, first, op, model):
    weights, tokens, _ = model
    config = weights.config if eps is None else dataclasses.replace(weights.config, eps=eps)
    verdict = judge_trace(trace_of(engine, model, dtype, config), config, weights, tokens, dtype)
    departure = verdict.first_departure
    assert departure is not None and (departure.node, departure.op) == (first, op), verdict.summary()
    assert departure.layer == 0 and departure.error > departure.budget
    # Each node is judged on the engine's own inputs, so the error does not compound into other ops.
    assert {n.op for n in verdict.nodes if n.outcome == FAILED} == {op}
    assert verdict.failures and first in verdict.failures[0]


def _q_norm_one_plus_w(eps, x, w):
    return numpy_backend.rmsnorm_offset(eps, x, w)


WRONG_NODE = "layers.3.q_norm"


def test_one_wrong_node_is_the_only_one_that_fails(model):
    weights, tokens, _ = model
    out = OneWrongNode(WRONG_NODE, _q_norm_one_plus_w).run(weights.config, weights, tokens, "bfloat16")
    verdict = judge_trace(completed(out["trace"], out, weights.config), weights.config, weights, tokens, "bfloat16")
    assert [n.node for n in verdict.nodes if n.outcome == FAILED] == [WRONG_NODE]


@pytest.mark.parametrize("wrong", [False, True], ids=["correct engine", "the untraced node wrong"])
def test_an_untraced_node_is_reported_and_never_blamed_on_its_consumers(wrong, model):
    """Without layers.3.q_norm in the trace, q_rope's input is unknown: judging it on a stand-in would
    blame it for q_norm's error, so it is not judged; every other node is, on the engine's own values."""
    weights, tokens, _ = model
    if wrong:
        out = OneWrongNode(WRONG_NODE, _q_norm_one_plus_w).run(weights.config, weights, tokens, "bfloat16")
        trace = completed(out["trace"], out, weights.config)
    else:
        trace = trace_of(numpy_backend, model, "bfloat16")
    del trace[WRONG_NODE]
    verdict = judge_trace(trace, weights.config, weights, tokens, "bfloat16")
    got = outcomes(verdict)
    assert got.pop(WRONG_NODE) == NOT_TRACED
    assert got.pop("layers.3.q_rope") == INPUTS_NOT_TRACED
    assert set(got.values()) == {PASSED}, verdict.summary()  # the wrong q_norm is blamed on nothing
    assert verdict.first_departure is None and "1 not traced, 1 with inputs not traced" in verdict.summary()


def test_the_lm_heads_chunks_are_one_node(model, monkeypatch):
    """The graph calls the LM head once per VOCAB_CHUNK columns, all as node "logits": the replay slices
    the traced [T, V] by columns and the node is judged once, on every chunk."""
    from gemma4_conformance.spec import model as graph
    monkeypatch.setattr(graph, "VOCAB_CHUNK", 200)  # 512 = 200 + 200 + 112
    weights, tokens, _ = model
    full = trace_of(numpy_backend, model, "float32")
    assert full["logits"].shape == (len(tokens), weights.config.vocab_size)
    last = f"layers.{weights.config.num_layers - 1}.layer_scalar"
    trace = {node: full[node] for node in (last, "final_norm", "logits")}  # only the head is judged
    broken = dict(trace, logits=trace["logits"].copy())
    broken["logits"][:, 400:] += 1.0  # the last chunk
    verdicts = [judge_trace(t, weights.config, weights, tokens, "float32", work=50_000) for t in (trace, broken)]
    assert [outcomes(v)["logits"] for v in verdicts] == [PASSED, FAILED]
    assert [n.node for n in verdicts[1].nodes].count("logits") == 1
    assert verdicts[1].first_departure.node == "logits"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_declared_activation_rounding_is_judged_by_its_term_and_an_undeclared_one_fails(dtype, model):
    """The engine that rounds its products' x to q8_0 blocks (tests/quantized_engines.py) passes every
    node given its declaration, the linear family's nodes with the declared term (issue 36, item 3); the
    same trace without the declaration departs at the first product, layer 0's q_proj."""
    weights, tokens, _ = model
    trace = trace_of(DECLARED, model, dtype)
    given = judge_trace(trace, weights.config, weights, tokens, dtype, formats=declared_formats(DECLARED))
    assert set(outcomes(given).values()) == {PASSED}, given.summary()
    products = {n.node for n in given.nodes if n.op in ("linear", "gate_up", "lm_head")}
    assert products and {n.node for n in given.nodes if n.formats} == products
    assert {n.given for n in given.nodes if n.node in products} == {"given its declared formats: activations q8_0"}
    assert given.summary().endswith("given its declared formats: activations q8_0"), given.summary()
    reported = {n["node"]: n["given"] for n in trace_entry(DECLARED.name, dtype, given)["nodes"]}
    assert {node for node, text in reported.items() if text} == products
    undeclared = judge_trace(trace, weights.config, weights, tokens, dtype)
    departure = undeclared.first_departure
    assert departure is not None and (departure.node, departure.op) == ("layers.0.q_proj", "linear"), \
        undeclared.summary()
    assert not departure.given and {n.op for n in undeclared.nodes if n.outcome == FAILED} <= \
        {"linear", "gate_up", "lm_head"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_declared_kv_cache_in_fp8_is_judged_by_its_term_and_an_undeclared_one_fails(dtype, model):
    """The engine whose attention reads k and v from an fp8 e4m3 cache with scales (tests/quantized_engines.py)
    passes every node given its declaration, each attention node informatively, with the KV cache's term;
    without the declaration it departs at layer 0's attention."""
    weights, tokens, _ = model
    trace = trace_of(KV_DECLARED, model, dtype)
    given = judge_trace(trace, weights.config, weights, tokens, dtype, formats=declared_formats(KV_DECLARED))
    assert set(outcomes(given).values()) == {PASSED}, given.summary()
    attention = {n.node for n in given.nodes if n.op in ("causal_gqa", "sliding_gqa")}
    assert attention and {n.node for n in given.nodes if n.formats} == attention
    assert all(n.informative for n in given.nodes if n.node in attention)
    assert given.summary().endswith("given its declared formats: kv_cache fp8_e4m3@1.5:0.75"), given.summary()
    departure = judge_trace(trace, weights.config, weights, tokens, dtype).first_departure
    assert departure is not None and departure.node == "layers.0.attention", departure


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_fp8_engine_s_trace_passes_given_its_declared_formats_and_departs_without(dtype, model):
    """x per token and W per output channel in e4m3 with dynamic scales (tests/quantized_engines.py): every
    node passes given both declarations; without them the trace departs at layer 0's q_proj."""
    weights, tokens, _ = model
    trace = trace_of(FP8_DECLARED, model, dtype)
    given = judge_trace(trace, weights.config, weights, tokens, dtype, formats=FP8_FORMATS)
    assert set(outcomes(given).values()) == {PASSED}, given.summary()
    assert "given its declared formats: activations fp8_e4m3_token, weights fp8_e4m3_channel" in given.summary()
    departure = judge_trace(trace, weights.config, weights, tokens, dtype).first_departure
    assert departure is not None and departure.node == "layers.0.q_proj"


def test_a_node_whose_inputs_its_declared_format_cannot_hold_fails_saying_so():
    """A block scale past fp16's range has no declared bound (judging.BeyondDeclared): in the trace the node
    fails with that reason, rather than the trace stopping or the node being judged without the term."""
    x = np.full((1, 32), 127 * 70000.0, dtype=np.float32)
    W = np.ones((2, 32), dtype=np.float32)
    with np.errstate(over="ignore"):  # the engine's q8_0 scale overflows fp16: what the node is judged on
        out = DECLARED.linear(W, x)
    call = Call("layers.0.q_proj", "linear", (W, x), out, True, ())
    node = _judge(call, "float32", 0, 1000, {"activations": "q8_0"})
    assert node.outcome == FAILED and node.error is None
    assert "the declared activations format q8_0 cannot hold these inputs" in node.message
    summary = TraceVerdict("float32", [node]).summary()
    assert summary.startswith("first departing node layers.0.q_proj (linear, float32)"), summary


class HoldsBlocks(AdapterOps):
    """The graph's ops for an engine holding a q8_0 checkpoint's matrices in their blocks: its products take
    W as a QuantizedWeight of the exact values (q8_0's blocks are quantized again without loss: each
    block's largest q is 127), the other ops take their arrays in the dtype."""

    def weight(self, array):
        return np.asarray(array)  # float64 for a quantized tensor: its exact values

    def call(self, name, *args):
        held = name in ("linear", "gate_up", "lm_head")
        dtype = format_of(self.dtype).dtype
        args = [QuantizedWeight.of("q8_0", a) if held and isinstance(a, np.ndarray) and a.dtype == np.float64
                else a.astype(dtype) if isinstance(a, np.ndarray) and a.dtype == np.float64 else a for a in args]
        return super().call(name, *args)


def test_an_engine_holding_block_weights_is_judged_on_their_exact_values_in_its_trace(tmp_path):
    """Issue 36, item 2: the trace of an engine that declares a block weight format is judged on the
    checkpoint's exact quantized W (float32 here, where q8_0's 19 bits fit), not on W rounded to the dtype
    under test as the op contract hands it to an engine that declares none; every node passes in bfloat16."""
    config = generate.small_config()
    config.update(num_hidden_layers=6, layer_types=config["layer_types"][:6])
    weights = checkpoint.load(generate.write_checkpoint(tmp_path, config, weight_format="q8_0"))
    tokens = np.random.default_rng(0).integers(0, weights.config.vocab_size, 12)
    recorder = TraceRecorder()
    out = forward(HoldsBlocks(Q8_0_WEIGHTS, "bfloat16", observe=recorder), weights.config, weights, tokens)
    trace = completed(recorder.trace, out, weights.config)
    given = judge_trace(trace, weights.config, weights, tokens, "bfloat16", formats=declared_formats(Q8_0_WEIGHTS))
    assert set(outcomes(given).values()) == {PASSED}, given.summary()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert name in weights.weight_formats
    for exact, want in ((True, np.asarray(weights[name], dtype=np.float32)),
                        (False, np.asarray(weights[name]).astype(format_of("bfloat16").dtype))):
        (q_proj,) = [c for c in replay(trace, weights.config, weights, tokens, "bfloat16", exact_weights=exact)
                     if c.node == "layers.0.q_proj"]
        W = q_proj.args[0]
        assert W.dtype == want.dtype and np.array_equal(W, want)
    assert not np.array_equal(np.asarray(weights[name]), np.asarray(weights[name]).astype(format_of("bfloat16").dtype))
