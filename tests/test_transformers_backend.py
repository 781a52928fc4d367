"""The transformers backend: its forward's trace is the model's own tensors, a bug in transformers' code
is located by it, its ops run transformers' code, and its session continues a sequence as one prefill."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

from gemma4_conformance.adapters import AdapterError, load  # noqa: E402
from gemma4_conformance.adapters import transformers_backend as backend  # noqa: E402
from gemma4_conformance.composition.graph import composed  # noqa: E402
from gemma4_conformance.properties.judging import judge  # noqa: E402
from gemma4_conformance.properties.trace import completed, judge_trace  # noqa: E402
from gemma4_conformance.spec import format_of  # noqa: E402
from gemma4_conformance.spec.model import nodes  # noqa: E402
from tests.trace_engines import small_model  # noqa: E402

hf = backend.hf


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return small_model(tmp_path_factory.mktemp("transformers"))


def test_the_two_attention_settings_are_two_names_and_others_are_refused():
    assert load("transformers").name == "transformers-sdpa"
    assert load("transformers-eager").name == load("transformers[attention=eager]").name == "transformers-eager"
    with pytest.raises(AdapterError, match="attention='flash'.*sdpa, eager"):
        load("transformers[attention=flash]")


def test_the_trace_is_every_node_as_the_model_computed_it(model):
    weights, tokens, _ = model
    out = composed(load("transformers"), weights.config, weights, tokens, "bfloat16", trace=True)
    trace = out["trace"]
    assert set(nodes(weights.config)) - set(trace) == {"logits"}  # the forward's logits stand for it
    assert all(a.dtype == format_of("bfloat16").dtype for a in trace.values())  # the model's own bf16 tensors
    for i, h in enumerate(out["hidden_states"]):
        np.testing.assert_array_equal(h, trace[f"layers.{i}.layer_scalar"])
    # mlp_residual is the sum the layer scales in place: taken before the product overwrote it.
    scalar = float(np.asarray(weights["model.layers.3.layer_scalar"], dtype=np.float64)[0])
    residual, scaled = (trace[f"layers.3.{n}"].astype(np.float64) for n in ("mlp_residual", "layer_scalar"))
    assert not np.array_equal(residual, scaled)
    np.testing.assert_allclose(residual * scalar, scaled, rtol=2**-8)
    # RoPE, inside the attention module, is q's then k's rotation, not the norms' outputs passed on.
    assert trace["layers.0.q_rope"].shape[-2:] == trace["layers.0.q_norm"].shape[-2:]
    assert not np.array_equal(trace["layers.0.q_rope"], trace["layers.0.q_norm"])
    assert trace["layers.0.k_rope"].shape == trace["layers.0.k_norm"].shape


def _interleaved_rotate_half(x):
    """The classic porting bug: pairs (2i, 2i + 1) rotated where Gemma pairs (i, i + D/2)."""
    import torch
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def test_a_bug_in_transformers_code_is_located_by_the_trace_and_fails_its_op(model, monkeypatch):
    weights, tokens, _ = model
    case = {"args": {"theta": 10000.0, "rot": 8, "denom": 8, "active": 4, "pos": [3, 17],
                     "x": {"shape": [2, 8], "dist": "normal", "log2": 0, "seed": 1}}}
    adapter = load("transformers")
    assert judge(adapter, "rope", case, "float32").passed
    monkeypatch.setattr(hf, "rotate_half", _interleaved_rotate_half)
    assert not judge(adapter, "rope", case, "float32").passed  # the op is transformers' code
    out = composed(load("transformers"), weights.config, weights, tokens, "float32", trace=True)
    verdict = judge_trace(completed(out["trace"], out, weights.config), weights.config, weights, tokens, "float32")
    first = verdict.first_departure
    assert first is not None and (first.node, first.op) == ("layers.0.q_rope", "rope"), verdict.summary()
    assert {n.op for n in verdict.nodes if n.outcome == "failed"} == {"rope"}


@pytest.mark.parametrize("name", ["transformers", "transformers-eager"])
def test_the_session_continues_a_sequence_as_one_prefill(name, model):
    """transformers' DynamicCache through chunks across the window, decode steps past it, a second
    sequence in the same steps and an id used again after release: in float32 the logits agree with one
    call's to float32 roundoff."""
    weights, tokens, _ = model
    adapter = load(name)
    whole = adapter.forward(weights, weights.config.raw, tokens, "float32")["logits"]
    session = adapter.session(weights, weights.config.raw, "float32")
    steps = [session.step({0: tokens[:5]})]
    steps.append(session.step({0: tokens[5:14], 1: tokens[:3]}))
    steps += [session.step({0: tokens[t:t + 1]}) for t in range(14, len(tokens))]
    got = np.concatenate([s[0] for s in steps])
    scale = np.abs(whole).max()
    assert got.shape == whole.shape and np.abs(got - whole).max() <= 1e-5 * scale
    np.testing.assert_allclose(steps[1][1], whole[:3], atol=1e-5 * scale)
    session.release(0)
    np.testing.assert_allclose(session.step({0: tokens[:4]})[0], whole[:4], atol=1e-5 * scale)
    session.close()
