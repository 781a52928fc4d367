"""The full forward: a backend's run of the whole model against a certified float64 reference and a
plain same-dtype baseline (``reference``, ``composed``, ``judge_forward``, ``local_errors``), and the
forward's contract (``check_output``, which raises ContractViolation saying what was expected).

The verdict is explained in docs/verdict.md (the full forward), the contract in docs/adapter.md (the forward).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import numpy as np

from gemma4_conformance.adapters import numpy_backend
from gemma4_conformance.spec import format_of
from gemma4_conformance.spec.model import decoder_layer, forward, head, nodes

from .judging import ContractViolation, assess, call
from .table import ORACLE_WORK

# How much worse than a plain same-dtype implementation a candidate's own error may be.  A layer's own
# error (the stream reset to the candidate's) is a sum over its ops' roundings and concentrates: on the
# generated 48-layer model (head dims 32/64, token draws 0-3, float32, bfloat16, float16), torch's
# worst layer was 1.13 x the baseline's, jax's 2.1 x (float32: XLA's dot products sum in another
# order, every layer about 1.45 x), the head's logits at most 1.7 x and its log-probability gap 2.4 x
# (jax float16), while each model-level mistake of tests/test_forward_mutants.py is off by 21 x (bf16,
# the wrong proportional-RoPE denominator) to 3e9 x at its worst layer, and the missing final softcap
# by 30 x on the bf16 logits.  3 separates the two with room on both sides.
FACTOR = 3.0
# The accumulated error of one token draw is a few layers' errors amplified along the stream, so its
# ratio to the baseline's is the own-error ratio times a draw's luck: measured up to 2.1 x the median
# own-error ratio (jax float32, draw 3: 3.1 x on the logits, 3.3 x at a layer, where no layer's own
# error exceeds 2.1 x) and 3 x for vLLM's CPU build (4.4 x on one draw, 1.45 x per layer).  So with
# every own error within FACTOR, FACTOR x 3 bounds the accumulated one; it still catches an error that
# is small in each layer but adds up coherently (a biased rounding), which grows with depth.
ACCUMULATED = FACTOR * 3
FLOOR = 8  # unit roundoffs of the dtype: below that, errors are a handful of final roundings
# Oracle work per certified op call (element operations, see table.py): every output of every call of
# the generated model (with its head dims 32/64, ORACLE_WORK // 10 left 1.2% of the outputs unchecked;
# this costs 8% more), while the 12B geometry's largest calls are sampled.
CERTIFY_WORK = ORACLE_WORK // 4
# The calls a long sequence's reference certifies: what it adds to the forward test's certified calls on
# the same checkpoint is positions past the window (rope) and many keys across it (attention); every
# other op acts on each token alone, with the weights and shapes per token that test certifies.  At the
# 12B geometry (1036 tokens, 2 cores), certifying every call took 2.6 min a layer (6 layers measured:
# linear 295 s, the norms 145 s), these about 7 s.
LONG_CONTEXT_OPS = frozenset({"rope", "sliding_gqa", "causal_gqa"})


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
        return np.asarray(array).astype(format_of(self.dtype).dtype)


@dataclass
class Certificate:
    """How the reference's op calls compared with the oracle: calls checked, output elements checked of
    those made, worst error/budget, failures.  ``ops``: the ops whose calls are certified (None: all)."""

    ops: frozenset[str] | None = None
    calls: int = 0
    checked: int = 0
    outputs: int = 0
    worst: float = 0.0
    worst_op: str = ""
    failures: list[str] = field(default_factory=list)

    def __call__(self, node, op, args, out):
        if self.ops is not None and op not in self.ops:
            return
        verdict = assess(op, args, out, "float64", seed=self.calls, work=CERTIFY_WORK)
        self.calls += 1
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


class TraceRecorder:
    """An ops object's observer that keeps every node's output: the trace of a composed forward.  The
    LM head's calls (one per VOCAB_CHUNK columns, all under the node ``logits``) are joined along the
    vocabulary, as an engine's trace of that node would be."""

    def __init__(self):
        self.trace: dict[str, np.ndarray] = {}

    def __call__(self, node, op, args, out):
        if node in self.trace:
            out = np.concatenate([self.trace[node], out], axis=-1)
        self.trace[node] = out


def composed(adapter, config, weights, tokens, dtype: str, trace: bool = False) -> dict:
    """``logits``, ``hidden_states`` (None when not given) and ``trace`` (None when not given): the
    adapter's own forward under the contract's checks if it has one, else the spec's graph run with its
    ops in ``dtype`` (which records the trace when ``trace``)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    if hasattr(adapter, "forward"):
        return check_output(run_forward(adapter, config, weights, tokens, dtype), config, len(tokens), dtype,
                            f"{adapter.name}.forward in {dtype}")
    recorder = TraceRecorder() if trace else None
    out = forward(AdapterOps(adapter, dtype, observe=recorder), config, weights, tokens)
    return {**out, "trace": recorder.trace if trace else None}


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
    """An adapter forward's result checked against the forward contract (module docstring):
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


def local_errors(candidate: dict, config, weights, tokens, dtype: str) -> dict | None:
    """Each layer's and the head's own error, the stream reset to the candidate's at every layer.

    Layer i's reference is the graph's layer i in float64 on the candidate's output of layer i - 1,
    and its baseline the same layer in the plain ``dtype`` ops on that same input; layer 0 starts from
    the plain embedding.  The head (final norm and LM head) starts from the candidate's last layer.
    So no error is carried from layer to layer: ``{"layers": [(candidate, baseline)], "logits":
    (candidate, baseline), "logprob_gap": (candidate, baseline)}``, relative errors and largest
    log-probability gaps; None when the candidate gives no hidden states.
    """
    hidden = candidate.get("hidden_states")
    if hidden is None:
        return None
    exact, plain = AdapterOps(numpy_backend, "float64"), AdapterOps(numpy_backend, dtype)
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
