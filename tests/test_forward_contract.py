"""The forward contract: each way an engine's forward can break it is named, never a broadcast error or a
numerical verdict; a forward without hidden states is reported as such."""

from __future__ import annotations

import numpy as np
import pytest

from gemma4_conformance import report
from gemma4_conformance.adapters import numpy_backend
from gemma4_conformance.adapters.contract import ContractViolation
from gemma4_conformance.composition.graph import composed
from gemma4_conformance.plugin import EXIT_BROKEN
from gemma4_conformance.properties.forward import check_finite, judge_forward
from gemma4_conformance.properties.trace import completed, judge_trace
from gemma4_conformance.report.record import Recorder
from tests.forward_breaches import BREACHES, LOGITS_ONLY
from tests.test_plugin import suite
from tests.trace_engines import small_model

DTYPE = "float32"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return small_model(tmp_path_factory.mktemp("contract"))


def breach_message(adapter, model) -> str:
    """What the suite says of ``adapter``'s forward: the forward test's checks, then the trace's replay."""
    weights, tokens, ref = model
    with pytest.raises(ContractViolation) as caught:
        out = composed(adapter, weights.config, weights, tokens, DTYPE, trace=True)
        check_finite(out, ref, f"{adapter.name}'s forward")
        judge_trace(completed(out["trace"], out, weights.config), weights.config, weights, tokens, DTYPE, work=1)
    return str(caught.value)


@pytest.mark.parametrize("adapter, words", BREACHES, ids=[a.name for a, _ in BREACHES])
def test_each_breach_of_the_forward_contract_is_named(adapter, words, model):
    assert words in breach_message(adapter, model)


def test_no_two_breaches_share_a_message(model):
    messages = [breach_message(adapter, model).replace(adapter.name, "ENGINE") for adapter, _ in BREACHES]
    assert len(set(messages)) == len(messages)


def test_the_right_forward_meets_the_contract(model):
    """The breaches' base forward, unedited, passes the same checks, so each breach is what fails."""
    from tests.forward_breaches import Breach
    weights, tokens, ref = model
    out = composed(Breach("none"), weights.config, weights, tokens, DTYPE, trace=True)
    check_finite(out, ref, "none")
    assert len(out["hidden_states"]) == weights.config.num_layers and out["trace"]


def test_a_forward_without_hidden_states_is_reported_as_not_provided(model):
    weights, tokens, ref = model
    candidate = composed(LOGITS_ONLY, weights.config, weights, tokens, DTYPE)
    assert candidate["hidden_states"] is None and candidate["trace"] is None
    verdict = judge_forward(candidate, composed(numpy_backend, weights.config, weights, tokens, DTYPE), ref, DTYPE)
    assert not verdict.failures and verdict.layers == []
    recorder = Recorder()
    recorder.forward[LOGITS_ONLY.name, DTYPE] = verdict
    line = next(line for line in recorder.table() if " forward " in line)
    assert "hidden states not provided" in line and "worst layer" not in line
    page = report.render([report.document(recorder, {"label": "x"})])
    assert "not provided" in page


def test_a_contract_breach_exits_6_with_its_message_once(tmp_path):
    """Through the plugin: the forward test breaks (exit 6) and says what was expected; the trace test,
    which shares the run, skips instead of reporting the same breach again."""
    status, out, doc = suite(tmp_path, "--backend=tests.forward_breaches:ADAPTERS.batch_axis",
                             "-k", "test_forward_matches_reference or test_trace_nodes")
    assert status == EXIT_BROKEN, out[-3000:]
    assert len(doc["problems"]) == 1 and "a batch axis" in doc["problems"][0]["message"], doc["problems"]
    assert "broke the contract" in out and not doc["forward"]


def test_drawn_tokens_hold_the_special_ids_inside_and_follow_the_seed():
    from gemma4_conformance.properties.forward import SPECIAL_IDS, drawn_tokens

    for seed in range(20):
        tokens = drawn_tokens(1000, 24, seed)
        assert len(tokens) == 24 and tokens.min() >= 0 and tokens.max() == 999
        assert all(t in tokens[1:] for t in (*SPECIAL_IDS, 999))
        assert (drawn_tokens(1000, 24, seed) == tokens).all()
    assert not (drawn_tokens(1000, 24, 0) == drawn_tokens(1000, 24, 1)).all()
    assert list(drawn_tokens(1000, 3, 0)[1:]).count(0) == 1  # fewer places than special ids: the first ones
