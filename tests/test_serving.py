"""The serving path: the built-in session's cache, the schedules, the contract checks, and the verdict
against each cache bug of tests/serving_mutants.py; and the serving test in the gate (exit codes,
unsupported adapters, rerun commands)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings

from gemma4_conformance.adapters import numpy_backend
from gemma4_conformance.adapters.contract import ContractViolation
from gemma4_conformance.checkpoints import checkpoint, generate
from gemma4_conformance.checkpoints.config import TextConfig
from gemma4_conformance.composition.graph import missing_ops
from gemma4_conformance.composition.session import KVCache, Segment, bucket
from gemma4_conformance.plugin import EXIT_BROKEN, EXIT_NOT_CONFORMANT
from gemma4_conformance.properties.forward import ACCUMULATED, relative_error
from gemma4_conformance.properties.serving import (
    DOCUMENTS,
    FEATURES,
    MAX_STEPS,
    Documents,
    check_step,
    document_length,
    every_feature,
    features,
    judge,
    length,
    normalize,
    run,
    schedules,
    steps,
    validate,
)
from tests.mutants import ADAPTERS as OP_MUTANTS
from tests.serving_mutants import MUTANTS
from tests.test_plugin import rerun_elsewhere, suite

CONFIG = TextConfig.from_dict(generate.small_config())
WINDOW = CONFIG.layers[0].window


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    path = generate.write_checkpoint(tmp_path_factory.mktemp("small"), generate.small_config())
    return Documents(checkpoint.load(path), checkpoint=str(path))


def _chunk(layer, start, n):
    """Keys and values whose every coordinate is the token's position (values negated)."""
    k = np.broadcast_to((start + np.arange(n, dtype=np.float64))[:, None, None], (n, layer.kv_heads, layer.head_dim))
    return k.copy(), -k


def test_a_sliding_layer_keeps_a_ring_of_window_entries_read_back_in_position_order():
    layer = next(l for l in CONFIG.layers if l.kind == "sliding")
    cache, start = KVCache(CONFIG, np.float64, slots=2), 0
    for n in (5, 6, 3, 7, 1, 1, 12):  # chunks that do not divide the window, decode steps, one longer than it
        k, v = _chunk(layer, start, n)
        cache.begin([Segment(0, 1, start, slice(0, n))])
        keys, values, first = cache.attend(layer, start + np.arange(n), k, v)
        oldest = max(0, start - (WINDOW - 1))  # the first query sees the window - 1 keys before it
        np.testing.assert_array_equal(keys.arrays[0][:, 0, 0], np.arange(oldest, start + n))
        np.testing.assert_array_equal(values.arrays[0][:, -1, -1], -np.arange(oldest, start + n))
        assert (first == oldest).all()
        cache.advance()
        start += n
        ring = cache.rings[layer.index][0][1, :, 0, 0]
        assert ring.shape == (WINDOW,)  # the ring never grows: entry p % window holds position p
        held = np.arange(max(0, start - WINDOW), start)
        np.testing.assert_array_equal(ring[held % WINDOW], held)
    assert cache.lengths.tolist() == [0, start] and not cache.rings[layer.index][0][0].any()  # slot 0 untouched
    cache.clear(1)
    cache.begin([Segment(0, 1, 0, slice(0, 1))])
    keys, _, _ = cache.attend(layer, np.arange(1), *_chunk(layer, 0, 1))
    assert len(keys.arrays[0]) == 1  # a cleared slot starts empty


def test_a_full_layer_keeps_every_key_of_a_sequence():
    layer = next(l for l in CONFIG.layers if l.kind == "full")
    cache, start = KVCache(CONFIG, np.float64, slots=1), 0
    for n in (9, 20, 1, 7):  # past the buffer's first size (16): it doubles
        cache.begin([Segment(0, 0, start, slice(0, n))])
        keys, _, first = cache.attend(layer, start + np.arange(n), *_chunk(layer, start, n))
        np.testing.assert_array_equal(keys.arrays[0][:, 0, 0], np.arange(start + n))
        assert (first == 0).all()
        cache.advance()
        start += n


def test_buckets_are_powers_of_two_at_least_the_size():
    assert [bucket(n) for n in (1, 2, 3, 8, 9, 1000, 1025)] == [1, 2, 4, 8, 16, 1024, 2048]


def test_a_float64_session_continues_the_reference_to_rounding(documents):
    """The built-in session in float64 gives the reference prefill's logits at every position."""
    schedule = every_feature(WINDOW)
    result = run(numpy_backend, schedule, documents, "float64")
    for k, s in enumerate(schedule["sequences"]):
        ref = documents.reference(k)[:length(s)]
        assert relative_error(result.stepped[k], ref) < 1e-12 and relative_error(result.prefilled[k], ref) < 1e-12


def test_the_correct_session_passes_and_each_cache_bug_fails_in_float32(documents):
    schedule = every_feature(WINDOW)
    for dtype in ("float32", "bfloat16"):
        verdict = judge(run(numpy_backend, schedule, documents, dtype), schedule, documents, dtype)
        assert not verdict.failures and verdict.worst.ratio < 1, (dtype, verdict.failures)
    for mutant in MUTANTS:
        verdict = judge(run(mutant, schedule, documents, "float32"), schedule, documents, "float32")
        assert verdict.failures and verdict.worst.ratio > 100, mutant.name


def test_an_adapter_with_ops_only_is_served_by_its_ops_composed(documents):
    """An adapter without a session is judged on the serving path, its own ops composed with a real
    KV cache as the forward composes them: a wrong op then fails the serving verdict too."""
    schedule = every_feature(WINDOW)
    assert not hasattr(numpy_backend, "session")
    verdict = judge(run(numpy_backend, schedule, documents, "float32"), schedule, documents, "float32")
    assert not verdict.failures
    wrong = OP_MUTANTS.rmsnorm_weight_as_one_plus_w  # the model's norms scale by 1 + w
    assert not hasattr(wrong, "session") and missing_ops(wrong) == []
    verdict = judge(run(wrong, schedule, documents, "float32"), schedule, documents, "float32")
    assert verdict.failures


# Drawn by the default profile's seed 1: the correct numpy session departed from its own one-call prefill
# by 3.1 x the baseline's error (both its runs round differently) where the relation once allowed 3 x.
# How far it departs depends on the machine's BLAS kernels (1.3 x on another machine), so the test below
# also builds the departure the relation must allow, whatever the machine.
TWO_ROUNDINGS = {"sequences": [{"id": 0, "join": 0, "chunks": [1, 12, 11], "decode": 0},
                               {"id": 0, "join": 3, "chunks": [15, 5], "decode": 0},
                               {"id": 6, "join": 2, "chunks": [7, 11, 2], "decode": 2},
                               {"id": 6, "join": 7, "chunks": [14], "decode": 0},
                               {"id": 1, "join": 0, "chunks": [6, 14, 12], "decode": 0},
                               {"id": 0, "join": 5, "chunks": [2, 10], "decode": 0}]}


def test_the_relation_to_the_sessions_own_prefill_allows_the_errors_of_both_runs(documents):
    """The numpy session on that schedule passes; and two runs each within ACCUMULATED x the baseline's error
    of the exact logits, off in opposite directions, depart from each other by nearly 2 x ACCUMULATED, which
    the relation allows (one at ACCUMULATED would not)."""
    result = run(numpy_backend, TWO_ROUNDINGS, documents, "float32")
    verdict = judge(result, TWO_ROUNDINGS, documents, "float32")
    assert not verdict.failures, verdict.failures
    share = 0.9 * ACCUMULATED
    stepped, prefilled, departures = [], [], []
    for k, rows in enumerate(result.stepped):
        ref, base = (documents.reference(k % DOCUMENTS)[:len(rows)],
                     documents.baseline(k % DOCUMENTS, "float32")[:len(rows)])
        stepped.append(ref + share * (base - ref))
        prefilled.append(ref - share * (base - ref))
        departures.append(relative_error(ref + stepped[-1] - prefilled[-1], ref) / relative_error(base, ref))
    assert min(departures) > ACCUMULATED
    opposite = dataclasses.replace(result, stepped=stepped, prefilled=prefilled)
    verdict = judge(opposite, TWO_ROUNDINGS, documents, "float32")
    assert not verdict.failures, verdict.failures


@settings(max_examples=200)
@given(schedules(WINDOW))
def test_a_drawn_schedule_runs_as_printed(schedule):
    assert normalize(json.loads(json.dumps(schedule)), WINDOW) == schedule == validate(schedule, WINDOW)
    plan = steps(schedule)
    assert 1 <= len(plan) <= MAX_STEPS and all(batch for batch, _ in plan)
    owner, pieces = {}, {}  # live id -> the sequence holding it
    for batch, released in plan:
        for seq, p in batch.items():
            if p.start == 0:  # a sequence starts: its id is free (never used, or released)
                assert seq not in owner
                owner[seq] = p.sequence
            assert owner[seq] == p.sequence
            pieces.setdefault(p.sequence, []).append(p)
        for seq in released:
            del owner[seq]
    assert not owner  # every sequence is released after its last step
    for k, s in enumerate(schedule["sequences"]):
        starts = [p.start for p in pieces[k]]
        assert starts == [sum(p.n for p in pieces[k][:i]) for i in range(len(starts))]  # contiguous, in order
        assert sum(p.n for p in pieces[k]) == length(s) <= document_length(WINDOW)
        assert [p.decode for p in pieces[k]] == [False] * len(s["chunks"]) + [True] * s["decode"]
    ids = [s["id"] for s in schedule["sequences"]]
    assert ("reuse" in features(schedule, WINDOW)) == (len(set(ids)) < len(ids))


def test_a_reused_id_starts_after_its_release():
    schedule = normalize({"sequences": [{"id": 3, "join": 0, "chunks": [4], "decode": 2},
                                        {"id": 3, "join": 1, "chunks": [2], "decode": 0}]}, WINDOW)
    assert schedule["sequences"][1]["join"] == 3
    assert [sorted(batch) for batch, _ in steps(schedule)] == [[3]] * 4
    assert [released for _, released in steps(schedule)] == [[], [], [3], [3]]


def test_the_schedule_checked_first_has_every_feature():
    assert features(every_feature(WINDOW), WINDOW) == list(FEATURES)
    assert features({"sequences": [{"id": 0, "join": 0, "chunks": [3], "decode": 1}]}, WINDOW) == []


@pytest.mark.parametrize("case, says", [
    ([1, 2], "no non-empty list 'sequences'"),
    ({"sequences": [{"id": 0, "join": 0, "chunks": [2]}]}, "needs exactly id, join, chunks and decode"),
    ({"sequences": [{"id": 0, "join": 0, "chunks": [0], "decode": 1}]}, "chunks a non-empty list of sizes >= 1"),
    ({"sequences": [{"id": -1, "join": 0, "chunks": [2], "decode": 1}]}, "integers >= 0"),
])
def test_a_malformed_schedule_is_refused_saying_what_a_schedule_is(case, says):
    with pytest.raises(ValueError, match="--case is not a serving schedule") as e:
        validate(case, WINDOW)
    assert says in str(e.value) and '"chunks": [5, 3]' in str(e.value)


V = CONFIG.vocab_size
BATCH = {0: np.arange(3), 2: np.arange(1)}


def _rows(n, width=V, dtype=np.float32):
    return np.zeros((n, width), dtype)


@pytest.mark.parametrize("out, says", [
    ([_rows(3), _rows(1)], "returned list"),
    ({0: _rows(3)}, "returned the ids [0]"),
    ({0: _rows(3), 2: _rows(1), 5: _rows(1)}, "returned the ids [0, 2, 5]"),
    ({0: _rows(3)[-1], 2: _rows(1)}, f"sequence 0 appended 3 tokens and got logits float32 [{V}]"),
    ({0: _rows(3)[None], 2: _rows(1)}, f"got logits float32 [1, 3, {V}]"),
    ({0: _rows(3, V + 16), 2: _rows(1)}, f"got logits float32 [3, {V + 16}]"),  # a padded vocabulary
    ({0: _rows(3, dtype=np.float16), 2: _rows(1)}, f"got logits float16 [3, {V}]"),  # narrower
    ({0: _rows(3).tolist(), 2: _rows(1)}, "sequence 0's logits are list"),
    ({0: np.full((3, V), np.nan, np.float32), 2: _rows(1)}, "NaN in sequence 0's logits"),
])
def test_a_step_result_that_breaks_the_contract_says_what_was_expected(out, says):
    with pytest.raises(ContractViolation) as e:
        check_step(out, BATCH, V, "float32", "engine session.step #4")
    message = str(e.value)
    assert message.startswith("engine session.step #4") and says in message
    if "NaN" not in says:
        assert f"expected a dict with exactly the ids [0, 2], each a float array [n, {V}] in float32 or wider" in message


def test_a_step_may_give_logits_wider_than_the_dtype():
    """As the forward contract: float32 logits of a bf16 run (vLLM's), float64 of a float32 one."""
    check_step({0: _rows(3), 2: _rows(1)}, BATCH, V, "bfloat16", "engine session.step #4")
    check_step({0: _rows(3, dtype=np.float64), 2: _rows(1, dtype=np.float64)}, BATCH, V, "float32", "step")


def test_the_serving_path_in_the_gate(tmp_path):
    """One run, three backends: a cache bug fails (its rerun exits 1), a session returning [V] breaks
    the contract (exit 6, its rerun too), an adapter without a session is listed as unsupported."""
    mutant, faulty = "tests.serving_mutants:ADAPTERS.eviction_one_early", "tests.faulty:SESSIONS.last_row_only"
    status, out, doc = suite(tmp_path, f"--backend={mutant},{faulty},examples.minimal_adapter:MinimalAdapter",
                             "-k", "test_serving")
    assert status == EXIT_BROKEN, out[-3000:]
    serving = {e["backend"]: e for e in doc["serving"]}
    assert {name: e["outcome"] for name, e in serving.items()} == {
        "eviction_one_early": "failed", "numpy-last-row-only": "errored", "minimal": "unsupported"}
    failed, broke = serving["eviction_one_early"], serving["numpy-last-row-only"]
    assert failed["case"] == every_feature(WINDOW) and failed["features"] == list(FEATURES) and failed["failing"] == 1
    assert "against the reference" in failed["message"] and failed["worst"]["ratio"] > 100
    assert f"got logits float32 [{V}]; expected a dict with exactly the ids" in broke["message"]
    assert [p["test"].split("[")[1] for p in doc["problems"]] == ["numpy-last-row-only-float32]"]
    assert "minimal  unsupported: no session, so no serving path" in out  # one line for the adapter
    for entry, exit_status in ((failed, EXIT_NOT_CONFORMANT), (broke, EXIT_BROKEN)):
        assert "--case=" in entry["rerun"]
        done = rerun_elsewhere(tmp_path, entry["rerun"])
        assert done.returncode == exit_status and "schedule: {" in done.stdout, done.stdout[-3000:]
