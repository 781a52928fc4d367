"""Recorded runs judged from their trace files (``--judge-traces``, ``gemma4-conformance judge``): every node
and the forward of each file, as test_forward.py's trace and forward tests judge a run in process.

Parametrised over the files (gemma4_conformance/judge.py), so ``-n`` spreads them over workers; a
file's breaches (recorded.load) are raised after what could be judged is recorded: exit 6.
"""

from __future__ import annotations

import shlex

import pytest

from gemma4_conformance.adapters.contract import ContractViolation
from gemma4_conformance.checkpoints import checkpoint
from gemma4_conformance.composition.graph import composed

from . import recorded as recording
from .forward import baseline_ops, judge_forward, local_errors, reference


@pytest.fixture(scope="session")
def judged_weights(request):
    return checkpoint.load(request.config.getoption("--weights"))


@pytest.fixture(scope="session")
def loaded(judged_weights):
    """Each file's checked contents, loaded once per worker: path -> Recorded."""
    cache = {}

    def load(path):
        if path not in cache:
            cache[path] = recording.load(path, judged_weights)
        return cache[path]
    return load


@pytest.fixture(scope="session")
def references():
    """The float64 reference forward per token list, computed once per worker."""
    return {}


def test_recorded_nodes_match_their_ops(request, trace_file, judged_weights, loaded):
    recorded = loaded(trace_file.path)
    verdict = recording.judge_nodes(recorded, judged_weights)
    verdict.rerun = rerun(trace_file, request.config)
    request.config.conformance_recorder.traces[trace_file.label, recorded.dtype] = verdict
    if recorded.breaches:
        raise ContractViolation("\n".join(recorded.breaches.values()))
    if verdict.failures:
        pytest.fail("\n".join(verdict.failures) + f"\n  rerun: {verdict.rerun}", pytrace=False)


def test_recorded_forward_matches_reference(request, forward_file, judged_weights, loaded, references):
    recorded = loaded(forward_file.path)
    config, tokens, dtype = judged_weights.config, recorded.tokens, recorded.dtype
    breaches = recorded.forward_breaches(config)
    candidate = recorded.candidate(config)
    if candidate is None:
        if breaches:
            raise ContractViolation("\n".join(breaches))
        pytest.skip(f"{forward_file.path} holds no logits: its forward is not judged")
    key = tokens.tobytes()
    if key not in references:
        references[key] = reference(config, judged_weights, tokens, certify=False)[0]
    plain = baseline_ops(recorded.formats)  # rounding as the engine declared it does
    baseline = composed(plain, config, judged_weights, tokens, dtype)
    local = local_errors(candidate, config, judged_weights, tokens, dtype, plain)
    verdict = judge_forward(candidate, baseline, references[key], dtype, local)
    verdict.rerun = rerun(forward_file, request.config)
    request.config.conformance_recorder.forward[forward_file.label, dtype] = verdict
    if breaches:
        raise ContractViolation("\n".join(breaches))
    if verdict.failures:
        pytest.fail("\n".join(verdict.failures) + f"\n  rerun: {verdict.rerun}", pytrace=False)


def rerun(recorded_file, config) -> str:
    return shlex.join(["gemma4-conformance", "judge", recorded_file.path, f"--weights={config.getoption('--weights')}"])
