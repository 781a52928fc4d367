"""The full 48-layer forward: every backend and dtype against the certified reference and the plain baseline,
and, where the backend's run gives a trace, every node of it on its own (properties/trace.py).

By default on a checkpoint the suite generates in the real layout (checkpoints.generate.small_config:
every feature of the 12B model at a size CI affords); with ``--weights PATH`` on a real checkpoint.
"""

from __future__ import annotations

import resource
import time

import numpy as np
import pytest

from gemma4_conformance.adapters import declared_formats
from gemma4_conformance.adapters.contract import ContractViolation
from gemma4_conformance.checkpoints import checkpoint, generate
from gemma4_conformance.composition.graph import composed, missing_ops
from gemma4_conformance.report.record import UnsupportedSkip

from .forward import baseline_ops, check_finite, drawn_tokens, judge_forward, local_errors, reference, run_seed
from .judging import rerun_command
from .recorded import record
from .trace import completed, judge_trace

FORWARD_DTYPES = ("float32", "bfloat16", "float16")
TOKENS = 24  # more than the generated model's sliding window, so the window is exercised


@pytest.fixture(scope="session")
def model(request, tmp_path_factory):
    """The checkpoint under test, its tokens, and the float64 reference forward (certified by the
    test below, which costs more than the reference alone)."""
    path = request.config.getoption("--weights")
    if path is None:
        path = generate.write_checkpoint(tmp_path_factory.mktemp("gemma4-small"), generate.small_config(), seed=0)
    weights = checkpoint.load(path)
    tokens = drawn_tokens(weights.config.vocab_size, TOKENS, run_seed(request.config))
    ref, _ = reference(weights.config, weights, tokens, certify=False)
    return weights, tokens, ref


def test_reference_is_certified_by_the_oracle(model):
    weights, tokens, ref = model
    certified, certificate = reference(weights.config, weights, tokens)
    assert certificate.calls > 0
    assert certificate.checked == certificate.outputs, "every output of every op call is certified"
    assert not certificate.failures, "\n".join(certificate.failures[:10])
    np.testing.assert_array_equal(certified["logits"], ref["logits"])


@pytest.fixture(scope="session")
def runs(model):
    """Each backend's forward in each dtype, run once for the forward and the trace tests: (backend
    name, dtype) -> its checked output, or the ContractViolation it broke with."""
    return {}


def candidate_run(request, adapter, dtype: str, model, runs) -> dict:
    """The backend's forward in ``dtype`` (with its trace), run once per session; a contract breach is
    raised by the test that ran it and makes the other skip, so one breach is reported once."""
    if dtype not in adapter.dtypes or dtype not in request.config.conformance_dtypes:
        pytest.skip(f"{adapter.name} is not tested in {dtype} here")
    missing = missing_ops(adapter)
    if missing and not hasattr(adapter, "forward"):
        raise UnsupportedSkip(f"{adapter.name} has no forward and does not implement {', '.join(missing)}")
    key = (adapter.name, dtype)
    if key in runs:
        if isinstance(runs[key], ContractViolation):
            pytest.skip(f"{adapter.name}'s forward in {dtype} broke the contract: {runs[key]}")
        return runs[key]
    weights, tokens, ref = model
    try:
        out = composed(adapter, weights.config, weights, tokens, dtype, trace=True)
        check_finite(out, ref, f"{adapter.name}'s forward in {dtype}")
    except ContractViolation as e:
        runs[key] = e
        raise
    runs[key] = out
    folder = request.config.getoption("--record-traces")
    if folder is not None:  # judged here and, from the file, anywhere (judge.py)
        record(folder, adapter, dtype, weights, tokens, out)
    return out


@pytest.mark.parametrize("forward_dtype", FORWARD_DTYPES)
def test_forward_matches_reference(request, backend, adapter, forward_dtype, model, runs):
    candidate = candidate_run(request, adapter, forward_dtype, model, runs)
    weights, tokens, ref = model
    plain = baseline_ops(declared_formats(adapter))  # rounding as the engine declares it does
    baseline = composed(plain, weights.config, weights, tokens, forward_dtype)
    local = local_errors(candidate, weights.config, weights, tokens, forward_dtype, plain)
    verdict = judge_forward(candidate, baseline, ref, forward_dtype, local)
    # Deterministic (the generated checkpoint and the tokens are seeded), so the test's id reruns it.
    verdict.rerun = rerun_command(request.node, backend, weights=request.config.getoption("--weights"))
    request.config.conformance_recorder.forward[adapter.name, forward_dtype] = verdict
    if verdict.failures:
        pytest.fail("\n".join(verdict.failures) + f"\n  rerun: {verdict.rerun}", pytrace=False)


@pytest.mark.parametrize("trace_dtype", FORWARD_DTYPES)
def test_trace_nodes_match_their_ops(request, backend, adapter, trace_dtype, model, runs):
    """Every node the backend's run traced, judged on the backend's own inputs to it against its op's
    budget (with the terms of its declared formats, as its op tests): the first failing node says which
    op, in which layer, departs."""
    candidate = candidate_run(request, adapter, trace_dtype, model, runs)
    if candidate["trace"] is None:
        pytest.skip(f"{adapter.name}'s forward returns no trace, so no node can be judged on its own")
    weights, tokens, _ = model
    verdict = judge_trace(completed(candidate["trace"], candidate, weights.config), weights.config, weights,
                          tokens, trace_dtype, where=f"{adapter.name}'s trace in {trace_dtype}",
                          formats=declared_formats(adapter))
    verdict.rerun = rerun_command(request.node, backend, weights=request.config.getoption("--weights"))
    request.config.conformance_recorder.traces[adapter.name, trace_dtype] = verdict
    if verdict.failures:
        pytest.fail("\n".join(verdict.failures) + f"\n  rerun: {verdict.rerun}", pytrace=False)


SLOW_TOKENS = 8
RSS_LIMIT = 8 * 2**30


@pytest.mark.slow
def test_forward_at_the_real_12b_geometry(request, backend, adapter, real_checkpoint):
    """The real 12B geometry for a few tokens, streaming: the weights are mapped and read one layer at a
    time, the vocabulary in chunks, and the process stays under 8 GiB (run alone: the peak is the
    process's).  Generated in the real layout unless ``--weights`` names real weights (the plugin's
    ``real_checkpoint``, shared with the serving path's slow test)."""
    path, given, seconds = real_checkpoint
    timings = {"generation": seconds}
    weights = checkpoint.load(path)
    tokens = drawn_tokens(weights.config.vocab_size, SLOW_TOKENS, run_seed(request.config))
    dtype = "bfloat16"
    plain = baseline_ops(declared_formats(adapter))
    stages = {"reference": lambda: reference(weights.config, weights, tokens),
              "backend": lambda: composed(adapter, weights.config, weights, tokens, dtype),
              "baseline": lambda: composed(plain, weights.config, weights, tokens, dtype)}
    results = {}
    for stage, run in stages.items():
        start = time.perf_counter()
        results[stage] = run()
        timings[stage] = time.perf_counter() - start
    (ref, certificate), candidate, baseline = results["reference"], results["backend"], results["baseline"]
    verdict = judge_forward(candidate, baseline, ref, dtype, local_errors(candidate, weights.config, weights, tokens, dtype, plain))
    verdict.rerun = rerun_command(request.node, backend, weights=given) + " -m slow -s"
    request.config.conformance_recorder.forward[f"{adapter.name} (12B)", dtype] = verdict
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"\n12B geometry, {SLOW_TOKENS} tokens: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items())
          + f"; peak RSS {peak / 2**30:.2f} GiB; certified op calls {certificate.calls}")
    assert not certificate.failures, "\n".join(certificate.failures[:10])  # the suite's own reference broke
    if verdict.failures:
        pytest.fail("\n".join(verdict.failures) + f"\n  rerun: {verdict.rerun}", pytrace=False)
    assert peak <= RSS_LIMIT, f"peak RSS {peak / 2**30:.2f} GiB > 8 GiB"
