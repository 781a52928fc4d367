"""The serving path: schedules of KV-cache decoding, chunked prefill and continuous batching, every
returned logit row against the reference (serving.py).

Always on the generated CI checkpoint (checkpoints.generate.small_config, sliding window 8), where a
schedule wraps every ring several times in a few dozen tokens; the real window (1024) is run by the
slow test below (``pytest -m slow``), on --weights when given.
"""

from __future__ import annotations

import math
import resource
import time

import numpy as np
import pytest
from hypothesis import currently_in_test_context, given, settings, target

from gemma4_conformance.adapters import declared_formats, numpy_backend
from gemma4_conformance.adapters.contract import ContractViolation
from gemma4_conformance.checkpoints import checkpoint, generate
from gemma4_conformance.composition.graph import AdapterOps, missing_ops
from gemma4_conformance.composition.session import open_session
from gemma4_conformance.report.record import UnsupportedSkip
from gemma4_conformance.spec.model import forward

from .forward import ACCUMULATED, LONG_CONTEXT_OPS, Certificate, drawn_tokens, judge_forward, run_seed
from .judging import rerun_command
from .serving import (
    EXAMPLES_SHARE,
    SERVING_DTYPES,
    Documents,
    LogitRows,
    ServingRecord,
    case_json,
    check_step,
    every_feature,
    judge,
    length,
    run,
    schedules,
    validate,
    worst_row,
)


@pytest.fixture(scope="session")
def documents(request, tmp_path_factory):
    path = generate.write_checkpoint(tmp_path_factory.mktemp("gemma4-serving"), generate.small_config(), seed=0)
    return Documents(checkpoint.load(path), checkpoint=str(path), seed=run_seed(request.config))


@pytest.mark.parametrize("serving_dtype", SERVING_DTYPES)
def test_serving_matches_reference(request, backend, adapter, serving_dtype, documents):
    if serving_dtype not in adapter.dtypes or serving_dtype not in request.config.conformance_dtypes:
        pytest.skip(f"{adapter.name} is not tested in {serving_dtype} here")
    record = request.config.conformance_recorder.serving.setdefault(
        (adapter.name, serving_dtype), ServingRecord(adapter.name, serving_dtype))
    missing = missing_ops(adapter)
    if missing and not hasattr(adapter, "session"):
        record.outcome = "unsupported"
        raise UnsupportedSkip(f"{adapter.name} has no session and does not implement {', '.join(missing)}")
    window = documents.window

    def check(schedule):
        command = rerun_command(request.node, backend, schedule)
        try:
            verdict = judge(run(adapter, schedule, documents, serving_dtype), schedule, documents, serving_dtype,
                            declared_formats(adapter))
        except ContractViolation as e:
            record.fail(schedule, window, str(e), command, broke=True)
            raise ContractViolation(f"{e}\n  schedule: {case_json(schedule)}\n  rerun: {command}") from None
        record.add(verdict)
        # A drawn schedule: search towards rows near what is allowed (an infinite ratio fails below, and
        # Hypothesis refuses it as a target).
        if currently_in_test_context() and math.isfinite(verdict.worst.ratio):
            target(verdict.worst.ratio, label="worst row / allowed")
        if verdict.failures:
            record.fail(schedule, window, verdict.failures[0], command)
            pytest.fail("\n".join(verdict.failures) + f"\n  schedule: {case_json(schedule)}\n  rerun: {command}",
                        pytrace=False)

    case = request.config.conformance_case
    if case is not None:
        schedule = validate(case, window)  # a malformed one was refused before the run (plugin.check_case_fits)
        check(schedule)
        record.outcome = "passed"
        return
    check(every_feature(window))  # in every dtype and profile, before any drawn schedule
    tested = [d for d in SERVING_DTYPES if d in adapter.dtypes and d in request.config.conformance_dtypes]
    if serving_dtype == tested[0]:
        # Drawn schedules in the sharpest dtype tested (float32 where there is one): a cache's
        # bookkeeping does not depend on the dtype, and in bfloat16 a wrong key moves the logits by
        # about as much as bf16's own rounding, so most cache bugs hide there (tests/serving_mutants.py).
        @settings(max_examples=max(1, settings.default.max_examples // EXAMPLES_SHARE))
        @given(schedules(window))
        def drawn(schedule):
            check(schedule)

        drawn()
    record.outcome = "passed"


SLOW_DECODE = 4  # decode steps after the prefill
SLOW_RSS_LIMIT = 8 * 2**30


@pytest.mark.slow
def test_serving_at_the_real_12b_geometry(request, backend, adapter, real_checkpoint):
    """The real window (1024) in a session: a prompt prefilled in two chunks, the first ending short of
    the window (by a size that does not divide it), the second past it, so that it wraps every
    sliding ring; then decode steps reading the wrapped rings.  Judged in float32 (where the
    adapter has it: cache bugs do not depend on the dtype, and float32's small baseline error lets
    none hide) on the rows around the wrap, against the certified float64 reference prefill and the
    plain baseline; the weights stream a layer at a time and the process stays under 8 GiB."""
    missing = missing_ops(adapter)
    if missing and not hasattr(adapter, "session"):
        raise UnsupportedSkip(f"{adapter.name} has no session and does not implement {', '.join(missing)}")
    path, given, seconds = real_checkpoint
    timings = {"generation": seconds}
    weights = checkpoint.load(path)
    config = weights.config
    dtype = "float32" if "float32" in adapter.dtypes else "bfloat16"
    window = min(l.window for l in config.layers if l.kind == "sliding")
    chunks = (window - window // 40 - 1, window // 32 + 2)  # (998, 34) at 1024
    schedule = {"sequences": [{"id": 0, "join": 0, "chunks": list(chunks), "decode": SLOW_DECODE}]}
    tokens = drawn_tokens(config.vocab_size, length(schedule["sequences"][0]), run_seed(request.config))
    judged = np.arange(max(0, chunks[0] - 8), len(tokens))  # the first chunk's end, the wrap, the decode steps
    pieces = [(0, chunks[0]), (chunks[0], chunks[1])] + [(sum(chunks) + i, 1) for i in range(SLOW_DECODE)]
    certificate = Certificate(ops=LONG_CONTEXT_OPS, sampled=True)

    def served():
        session, rows = open_session(adapter, weights, config.raw, dtype, str(path)), []
        for t, (start, n) in enumerate(pieces):
            given_tokens = {0: tokens[start:start + n]}
            out = session.step(given_tokens)
            check_step(out, given_tokens, config.vocab_size, dtype, f"{adapter.name} session.step #{t}")
            keep = judged[(judged >= start) & (judged < start + n)] - start
            rows.append(out[0][keep])  # the rest of a [998, 262144] chunk is dropped at once
            del out
        session.release(0)
        if hasattr(session, "close"):
            session.close()
        return np.concatenate(rows)

    stages = {"session": served,
              "reference": lambda: forward(LogitRows(AdapterOps(numpy_backend, "float64", observe=certificate),
                                                     judged), config, weights, tokens)["logits"],
              "baseline": lambda: forward(LogitRows(AdapterOps(numpy_backend, dtype), judged), config, weights,
                                          tokens)["logits"]}
    results = {}
    for stage, compute in stages.items():
        start = time.perf_counter()
        results[stage] = compute()
        timings[stage] = time.perf_counter() - start
    rows, ref, base = results["session"], results["reference"], results["baseline"]
    verdict = judge_forward({"logits": rows}, {"logits": base}, {"logits": ref}, dtype, accumulated=ACCUMULATED)
    record = request.config.conformance_recorder.serving.setdefault(
        (f"{adapter.name} (12B)", dtype), ServingRecord(f"{adapter.name} (12B)", dtype))
    record.schedules, record.sequences, record.steps, record.tokens = 1, 1, len(pieces), len(judged)
    record.worst = worst_row(rows, base, ref, dtype, 0, judged >= sum(chunks))
    record.worst.position += int(judged[0])
    record.worst.schedule = schedule
    command = rerun_command(request.node, backend, weights=given) + " -m slow -s"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"\n12B geometry, a session of {len(tokens)} tokens (window {window}; chunks {chunks}, "
          f"{SLOW_DECODE} decode steps) in {dtype}, {len(judged)} rows judged: "
          + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items())
          + f"; peak RSS {peak / 2**30:.2f} GiB; certified {certificate.calls} op calls of "
          f"{len(certificate.certified)} ops ({', '.join(sorted(LONG_CONTEXT_OPS))} whole, the others sampled; "
          f"{certificate.checked} of {certificate.outputs} outputs checked); worst row "
          f"{record.worst.position}: {record.worst.error:.3g} (baseline {record.worst.baseline:.3g})")
    missed = LONG_CONTEXT_OPS - certificate.certified
    assert not missed, f"no call of {sorted(missed)} certified: the graph's op names changed?"
    assert not certificate.failures, "\n".join(certificate.failures[:10])  # the suite's own reference broke
    if verdict.failures:
        record.fail(schedule, window, verdict.failures[0], command)
        pytest.fail("\n".join(verdict.failures) + f"\n  rerun: {command}", pytrace=False)
    record.outcome = "passed"
    assert peak <= SLOW_RSS_LIMIT, f"peak RSS {peak / 2**30:.2f} GiB > 8 GiB"
