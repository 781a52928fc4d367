"""The full forward: a backend's run of the whole model against a certified float64 reference and a
plain same-dtype baseline (``reference``, ``judge_forward``, ``local_errors``); the candidate's run is
composition.graph's ``composed``, under the forward contract of adapters.contract.

The verdict is explained in docs/verdict.md (the full forward), the contract in docs/adapter.md (the forward).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gemma4_conformance.adapters import numpy_backend
from gemma4_conformance.adapters.contract import ContractViolation
from gemma4_conformance.composition.graph import AdapterOps
from gemma4_conformance.spec import format_of
from gemma4_conformance.spec.model import decoder_layer, forward, head

from .judging import assess
from .table import OPS, ORACLE_WORK

# How much worse than the plain same-dtype baseline a candidate's own error may be (a layer's, or the
# head's): between what correct engines measure and what model-level mistakes make (docs/verdict.md).
FACTOR = 3.0
# An accumulated error is a few layers' own errors amplified along the stream: the own-error factor
# times a draw's luck (3), measured in docs/verdict.md.
ACCUMULATED = FACTOR * 3
FLOOR = 8  # unit roundoffs of the dtype: below that, errors are a handful of final roundings
# Oracle work per certified op call (element operations, see table.py): unbounded, so no sampler draws
# and every output of every call is certified, the 12B geometry's too (docs/measurements.md).
CERTIFY_WORK = 2**62
# The calls a long sequence's reference certifies whole (the entries' ``long_context``); the others' it samples,
# at a sixteenth of an op test's work: float64's products cost the first stage more than the samplers' model
# of the oracle's work counts (docs/measurements.md).
SAMPLED_WORK = ORACLE_WORK // 16
LONG_CONTEXT_OPS = frozenset(name for name, entry in OPS.items() if entry.long_context)


SPECIAL_IDS = (0, 1, 2)  # Gemma's pad, eos and bos


def drawn_tokens(vocab_size: int, n: int, seed: int) -> np.ndarray:
    """``n`` token ids drawn with ``seed``, with the special ids and the largest id each at a drawn
    position past the first: an engine that takes the pad id inside a prompt for padding (renumbering
    the positions after it), or misreads the embedding's last row, then departs from the reference."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab_size, n)
    special = [t for t in (*SPECIAL_IDS, vocab_size - 1) if t < vocab_size][:max(n - 1, 0)]
    tokens[rng.choice(np.arange(1, n), size=len(special), replace=False)] = special
    return tokens


def run_seed(config) -> int:
    """The seed of the tokens a run draws: ``--hypothesis-seed`` where given (a sweep of seeds then draws
    tokens too), else 0; a rerun command carries it."""
    seed = config.getoption("hypothesis_seed", None)
    return int(seed) if seed is not None and str(seed).isdigit() else 0


@dataclass
class Certificate:
    """How the reference's op calls compared with the oracle: calls checked, output elements checked of
    those made, worst error/budget, failures, the ops certified.  ``ops``: the ops whose calls are
    certified whole (None: all); ``sampled``: every other op's calls too, on the outputs the op tests'
    sampler draws for ``SAMPLED_WORK``."""

    ops: frozenset[str] | None = None
    sampled: bool = False
    calls: int = 0
    checked: int = 0
    outputs: int = 0
    worst: float = 0.0
    worst_op: str = ""
    failures: list[str] = field(default_factory=list)
    certified: set[str] = field(default_factory=set)

    def __call__(self, node, op, args, out):
        whole = self.ops is None or op in self.ops
        if not (whole or self.sampled):
            return
        verdict = assess(op, args, out, "float64", seed=self.calls, work=CERTIFY_WORK if whole else SAMPLED_WORK)
        self.calls += 1
        self.certified.add(op)
        self.checked += verdict.checked
        self.outputs += out.size
        ratio = verdict.max_error / verdict.budget
        if ratio > self.worst:
            self.worst, self.worst_op = ratio, op
        self.failures.extend(f"call {self.calls} ({node}, {op}): {f}" for f in verdict.failures)


def reference(config, weights, tokens, certify: bool = True, ops: frozenset[str] | None = None):
    """The float64 reference forward and, when ``certify``, its certificate against the oracle (on the
    calls of ``ops``, all when None)."""
    certificate = Certificate(ops) if certify else None
    result = forward(AdapterOps(numpy_backend, "float64", observe=certificate), config, weights, tokens)
    return result, certificate


def baseline_ops(formats: dict[str, str]):
    """The plain same-dtype baseline's ops for an engine that declares ``formats``: the numpy ops, rounding
    the products' activations, fp8 weights and the KV cache as it declares (a plain engine with those formats: the
    forward's errors are judged against one that rounds as the engine says it does)."""
    rounding = numpy_backend.RoundsAsDeclared(formats)
    return rounding if rounding.rounds else numpy_backend


def check_finite(candidate: dict, ref: dict, where: str) -> None:
    """NaN in the logits or a hidden state where the reference is finite breaks the contract."""
    pairs = [("logits", candidate["logits"], ref["logits"])]
    pairs += [(f"hidden_states[{i}]", c, r) for i, (c, r) in
              enumerate(zip(candidate.get("hidden_states") or [], ref["hidden_states"]))]
    for what, c, r in pairs:
        nan = np.isnan(np.asarray(c, dtype=np.float64)) & np.isfinite(r)
        if nan.any():
            at = tuple(int(i) for i in np.argwhere(nan)[0])
            raise ContractViolation(f"{where}: NaN in {what} at {at} (and {int(nan.sum()) - 1} more) where the "
                                    f"reference is finite")


def local_errors(candidate: dict, config, weights, tokens, dtype: str, baseline=numpy_backend) -> dict | None:
    """Each layer's and the head's own error, the stream reset to the candidate's at every layer.

    Layer i's reference is the graph's layer i in float64 on the candidate's output of layer i - 1,
    and its baseline the same layer in the plain ``dtype`` ops (``baseline``'s) on that same input; layer 0 starts from
    the plain embedding.  The head (final norm and LM head) starts from the candidate's last layer.
    So no error is carried from layer to layer: ``{"layers": [(candidate, baseline)], "logits":
    (candidate, baseline), "logprob_gap": (candidate, baseline)}``, relative errors and largest
    log-probability gaps; None when the candidate gives no hidden states.
    """
    hidden = candidate.get("hidden_states")
    if hidden is None:
        return None
    exact, plain = AdapterOps(numpy_backend, "float64"), AdapterOps(baseline, dtype)
    tokens = np.asarray(tokens, dtype=np.int64)
    positions = np.arange(len(tokens))
    rows, token_rows = np.unique(tokens, return_inverse=True)
    E = weights["model.embed_tokens.weight"]
    x = plain.op("embed", "embed", config.embed_scale, plain.weight(E[rows]), token_rows)
    layers = []
    for layer, out in zip(config.layers, hidden):
        r = decoder_layer(exact, config, weights, layer, np.asarray(x, dtype=np.float64), positions)
        b = decoder_layer(plain, config, weights, layer, x, positions)
        layers.append((relative_error(out, r), relative_error(b, r)))
        x = np.asarray(out).astype(format_of(dtype).dtype)
    r = head(exact, config, weights, np.asarray(x, dtype=np.float64))
    b = head(plain, config, weights, x)
    ref_lp = log_softmax(r)
    gaps = tuple(float(np.abs(log_softmax(z) - ref_lp).max()) for z in (candidate["logits"], b))
    return {"layers": layers, "logits": (relative_error(candidate["logits"], r), relative_error(b, r)),
            "logprob_gap": gaps}


def relative_error(x, ref) -> float:
    x, ref = np.asarray(x, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), np.finfo(float).tiny))


def log_softmax(logits):
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


@dataclass
class ForwardVerdict:
    layers: list[tuple[float, float]]  # (candidate, baseline) accumulated relative error per layer
    logits: tuple[float, float]
    top1_agreement: float  # fraction of positions whose top-1 token matches the reference
    logprob_gap: tuple[float, float]  # largest |log p - log p_ref| of candidate and baseline
    failures: list[str]
    rerun: str = ""  # the command that reruns the forward test (set by the test, which knows it)
    # Each layer's and the head's own error (local_errors); empty / None without hidden states.
    local_layers: list[tuple[float, float]] = field(default_factory=list)
    local_logits: tuple[float, float] | None = None
    local_logprob_gap: tuple[float, float] | None = None


def _beyond(what: str, pairs: list[tuple[float, float]], factor: float, floor: float) -> list[str]:
    """One line for the layers whose (candidate, baseline) errors exceed ``factor`` x baseline: the first
    and the worst (a wrong op usually puts every later layer off too)."""
    allowed = [max(factor * eb, floor) for _, eb in pairs]
    beyond = [i for i, (ec, _) in enumerate(pairs) if not ec <= allowed[i]]
    if not beyond:
        return []

    def layer(i):
        return f"layer {i}: relative error {pairs[i][0]:.3g} vs baseline {pairs[i][1]:.3g}"

    worst = max(beyond, key=lambda i: pairs[i][0] / allowed[i])
    return [f"{len(beyond)} of {len(pairs)} layers' {what} beyond {factor:g} x baseline (floor {floor:.3g}); "
            f"first {layer(beyond[0])}" + (f"; worst {layer(worst)}" if worst != beyond[0] else "")]


def _within(what: str, pair: tuple[float, float], factor: float, floor: float) -> list[str]:
    ec, eb = pair
    return [] if ec <= max(factor * eb, floor) else [f"{what} {ec:.3g} > {factor:g} x baseline {eb:.3g} "
                                                     f"(floor {floor:.3g})"]


def judge_forward(candidate: dict, baseline: dict, ref: dict, dtype: str, local: dict | None = None,
                  accumulated: float = ACCUMULATED) -> ForwardVerdict:
    """The verdict of the module docstring; ``local`` is ``local_errors``' result (None: logits only).
    ``accumulated`` is the allowance over the baseline's accumulated error: ACCUMULATED for one run of
    an engine, more for a candidate that holds the errors of several (the serving path's relation)."""
    floor = FLOOR * format_of(dtype).eps
    failures = []
    layers = []
    if candidate.get("hidden_states") is not None:
        for c, b, r in zip(candidate["hidden_states"], baseline["hidden_states"], ref["hidden_states"]):
            layers.append((relative_error(c, r), relative_error(b, r)))
    if local is not None:
        failures += _beyond("own errors", local["layers"], FACTOR, floor)
        failures += _within("logits from the last layer: own relative error", local["logits"], FACTOR, floor)
        failures += _within("log-probabilities from the last layer: own largest gap", local["logprob_gap"], FACTOR,
                            floor)
    failures += _beyond("accumulated errors", layers, accumulated, floor)
    ec, eb = relative_error(candidate["logits"], ref["logits"]), relative_error(baseline["logits"], ref["logits"])
    failures += _within("logits: accumulated relative error", (ec, eb), accumulated, floor)
    ref_logits = np.asarray(ref["logits"], dtype=np.float64)
    top = np.sort(ref_logits, -1)
    margin = top[:, -1] - top[:, -2]
    slack = accumulated * np.abs(np.asarray(baseline["logits"], dtype=np.float64) - ref_logits).max(-1) * 2
    agree = np.argmax(np.asarray(candidate["logits"], dtype=np.float64), -1) == np.argmax(ref_logits, -1)
    clear = margin > slack
    if (~agree & clear).any():
        t = int(np.flatnonzero(~agree & clear)[0])
        failures.append(f"top-1 token differs from the reference at position {t}, where the reference's margin "
                        f"{margin[t]:.3g} exceeds twice the allowed logit error ({slack[t]:.3g})")
    ref_lp = log_softmax(ref_logits)
    gap_c = float(np.abs(log_softmax(candidate["logits"]) - ref_lp).max())
    gap_b = float(np.abs(log_softmax(baseline["logits"]) - ref_lp).max())
    failures += _within("largest log-probability gap", (gap_c, gap_b), accumulated, floor)
    if local is None:
        return ForwardVerdict(layers, (ec, eb), float(agree.mean()), (gap_c, gap_b), failures)
    return ForwardVerdict(layers, (ec, eb), float(agree.mean()), (gap_c, gap_b), failures,
                          local_layers=list(local["layers"]), local_logits=tuple(local["logits"]),
                          local_logprob_gap=tuple(local["logprob_gap"]))
