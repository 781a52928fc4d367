"""The full forward: a backend's run of the whole model against a certified reference and a plain baseline.

* The *reference* is the spec's graph (spec.model.forward) run with the numpy ops in float64, and
  *certified* as it runs: every output of every op call is recomputed by the oracle from the same
  inputs (on the 12B geometry, a sample of the largest calls' outputs), and must lie within that op's
  float64 budget. So the reference is known to the precision its error model states, not assumed.
* The *candidate* is the backend's own ``forward(weights, config, tokens, dtype)`` when it has one,
  else the same graph run with its ops in the dtype under test.
* The *baseline* is the graph run with the suite's numpy ops in the dtype, rounding to it at every
  op boundary: what a plain implementation in that dtype achieves.

Verdict (FlashAttention-style): per layer and for the logits, the candidate's relative error against
the reference may be at most FACTOR times the baseline's, or below an absolute floor of FLOOR unit
roundoffs; its top-1 token must match the reference's wherever the reference's margin exceeds what
the baseline's logit error could flip.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gemma4_conformance.adapters import numpy_backend
from gemma4_conformance.spec import fmt
from gemma4_conformance.spec.model import forward

from .harness import assess, call
from .table import ORACLE_WORK

# How much worse than a plain same-dtype implementation a candidate may be.  Two correct
# implementations' errors are independent random walks of similar size: on the generated 48-layer
# model (2 token seeds, float32 and bfloat16), torch and jax stayed within 1.9 x the baseline's
# error at every layer, while each model-level mistake tested in tests/test_forward_mutants.py is off
# by 10 x or more.  3 separates the two with room on both sides.
FACTOR = 3.0
FLOOR = 8  # unit roundoffs of the dtype: below that, errors are a handful of final roundings
# Oracle work per certified op call (element operations, see table.py): every output of every call of
# the generated model; the 12B geometry's largest calls are sampled.
CERTIFY_WORK = ORACLE_WORK // 10


class AdapterOps:
    """An adapter's ops in one dtype, under the contract's checks: the graph's ops object for backends."""

    def __init__(self, adapter, dtype: str, observe=None):
        self.adapter, self.dtype, self.observe = adapter, dtype, observe
        self.name = adapter.name

    def op(self, node, name, *args):
        out = call(self.adapter, name, args, self.dtype)
        if self.observe is not None:
            self.observe(node, name, args, out)
        return out

    def weight(self, array):
        return np.asarray(array).astype(fmt(self.dtype).dtype)


@dataclass
class Certificate:
    """How the reference's op calls compared with the oracle: calls checked, output elements checked of
    those made, worst error/budget, failures."""

    calls: int = 0
    checked: int = 0
    outputs: int = 0
    worst: float = 0.0
    worst_op: str = ""
    failures: list[str] = field(default_factory=list)

    def __call__(self, node, op, args, out):
        verdict = assess(op, args, out, "float64", seed=self.calls, work=CERTIFY_WORK)
        self.calls += 1
        self.checked += verdict.checked
        self.outputs += out.size
        ratio = verdict.max_error / verdict.budget
        if ratio > self.worst:
            self.worst, self.worst_op = ratio, op
        self.failures.extend(f"call {self.calls} ({node}, {op}): {f}" for f in verdict.failures)


def reference(config, weights, tokens, certify: bool = True):
    """The float64 reference forward and, when ``certify``, its certificate against the oracle."""
    certificate = Certificate() if certify else None
    result = forward(AdapterOps(numpy_backend, "float64", observe=certificate), config, weights, tokens)
    return result, certificate


def composed(adapter, config, weights, tokens, dtype: str) -> dict:
    """The adapter's own forward if it has one, else the spec's graph run with its ops in ``dtype``."""
    if hasattr(adapter, "forward"):
        out = adapter.forward(weights, config.raw, np.asarray(tokens), dtype)
        return {"logits": out["logits"], "hidden_states": out.get("hidden_states")}
    return forward(AdapterOps(adapter, dtype), config, weights, tokens)


def relative_error(x, ref) -> float:
    x, ref = np.asarray(x, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), np.finfo(float).tiny))


def log_softmax(logits):
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


@dataclass
class ForwardVerdict:
    layers: list[tuple[float, float]]  # (candidate, baseline) relative error per layer
    logits: tuple[float, float]
    top1_agreement: float  # fraction of positions whose top-1 token matches the reference
    logprob_gap: tuple[float, float]  # largest |log p - log p_ref| of candidate and baseline
    failures: list[str]
    rerun: str = ""  # the command that reruns the forward test (set by the test, which knows it)


def judge_forward(candidate: dict, baseline: dict, ref: dict, dtype: str) -> ForwardVerdict:
    floor = FLOOR * fmt(dtype).eps
    failures = []
    layers = []
    if candidate.get("hidden_states") is not None:
        for c, b, r in zip(candidate["hidden_states"], baseline["hidden_states"], ref["hidden_states"]):
            layers.append((relative_error(c, r), relative_error(b, r)))
    allowed = [max(FACTOR * eb, floor) for _, eb in layers]
    beyond = [i for i, (ec, _) in enumerate(layers) if not ec <= allowed[i]]
    if beyond:  # one line, not one per layer: a wrong op usually puts every later layer off too
        def layer(i):
            return f"layer {i}: relative error {layers[i][0]:.3g} vs baseline {layers[i][1]:.3g}"

        worst = max(beyond, key=lambda i: layers[i][0] / allowed[i])
        failures.append(f"{len(beyond)} of {len(layers)} layers beyond {FACTOR} x baseline (floor {floor:.3g}); "
                        f"first {layer(beyond[0])}" + (f"; worst {layer(worst)}" if worst != beyond[0] else ""))
    ec, eb = relative_error(candidate["logits"], ref["logits"]), relative_error(baseline["logits"], ref["logits"])
    if not ec <= max(FACTOR * eb, floor):
        failures.append(f"logits: relative error {ec:.3g} > {FACTOR} x baseline {eb:.3g} (floor {floor:.3g})")
    ref_logits = np.asarray(ref["logits"], dtype=np.float64)
    top = np.sort(ref_logits, -1)
    margin = top[:, -1] - top[:, -2]
    slack = FACTOR * np.abs(np.asarray(baseline["logits"], dtype=np.float64) - ref_logits).max(-1) * 2
    agree = np.argmax(np.asarray(candidate["logits"], dtype=np.float64), -1) == np.argmax(ref_logits, -1)
    clear = margin > slack
    if (~agree & clear).any():
        t = int(np.flatnonzero(~agree & clear)[0])
        failures.append(f"top-1 token differs from the reference at position {t}, where the reference's margin "
                        f"{margin[t]:.3g} exceeds twice the baseline's largest logit error ({slack[t]:.3g})")
    ref_lp = log_softmax(ref_logits)
    gap_c = float(np.abs(log_softmax(candidate["logits"]) - ref_lp).max())
    gap_b = float(np.abs(log_softmax(baseline["logits"]) - ref_lp).max())
    if not gap_c <= max(FACTOR * gap_b, floor):
        failures.append(f"largest log-probability gap {gap_c:.3g} > {FACTOR} x baseline {gap_b:.3g}")
    return ForwardVerdict(layers, (ec, eb), float(agree.mean()), (gap_c, gap_b), failures)
