"""Running one example: call the backend under the contract's checks, then judge it against the oracle."""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass, field

import numpy as np

from gemma4_conformance.spec import CONTRACT, fmt, round_to, scale_ulp
from gemma4_conformance.spec.formats import abs_error
from gemma4_conformance.spec.exact import widen

from .budget import budget
from .strategies import build
from .error_models import attention_inputs
from .table import OPS, ORACLE_WORK


class Unsupported(Exception):
    """The adapter does not implement the op (a skip, listed in the report, never an error)."""


class ContractViolation(Exception):
    """The adapter raised, or returned something other than the contract's array: the adapter broke,
    which is not a conformance failure (the run exits 6, not 1; see the plugin)."""


def call(adapter, op: str, args: tuple, dtype: str) -> np.ndarray:
    """The adapter's result for ``op`` on ``args``, checked for type, dtype and shape.

    The adapter gets copies, so an adapter that writes into its inputs cannot change what the
    oracle sees.
    """
    fn = getattr(adapter, op, None)
    if fn is None:
        raise Unsupported(f"{adapter.name} does not implement {op}")
    where = f"{adapter.name}.{op} in {dtype}"
    kwargs = {"dtype": dtype} if op == "inv_freq" else {}
    try:
        out = fn(*(a.copy() if isinstance(a, np.ndarray) else a for a in args), **kwargs)
    except Exception as e:
        raise ContractViolation(f"{where} raised {type(e).__name__}: {e}") from e
    if not isinstance(out, np.ndarray):
        raise ContractViolation(f"{where} returned {type(out).__name__}, not a numpy array")
    want_dtype = fmt(dtype).dtype
    if out.dtype != want_dtype:
        raise ContractViolation(f"{where} returned dtype {out.dtype}, expected {want_dtype}")
    want_shape = CONTRACT[op].output_shape(*args)
    if out.shape != want_shape:
        raise ContractViolation(f"{where} returned shape {out.shape}, expected {want_shape}")
    return out


def _widened(args):
    """Floating arrays in float64 (exact), for the error model's scale."""
    return tuple(widen(a) for a in args)


@dataclass
class Tier2:
    """The second tier of an example: the candidate's error and the plain arrangements' largest, in
    ULPs at the tier's scale beyond its absolute allowance, and what the candidate is allowed."""

    error: float
    baseline: float
    allowed: float


@dataclass
class Verdict:
    """One example's outcome: its largest error in ULPs at the op's scale, against its budget (and the
    second tier's, where the op has one), and whether the allowance excludes trivially wrong answers."""

    op: str
    dtype: str
    budget: float
    errors: np.ndarray  # ULPs at the scale, per checked coordinate
    failures: list[str] = field(default_factory=list)
    tier2: Tier2 | None = None
    admitted: list[str] = field(default_factory=list)  # trivially wrong answers the allowance admits
    checked: int = 0  # output elements compared with the oracle (all, unless the op's sampler drew some)
    # Wall seconds of the backend's call (its transfers to and from its device apart, when it counts
    # them in ``transfer_seconds``) and of the oracle's judgement (exact result, scale, comparison).
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def max_error(self) -> float:
        return float(np.max(self.errors)) if self.errors.size else 0.0

    @property
    def worst(self) -> tuple[float, float]:
        """(error, budget) of the tier with the least headroom: what the report calls this example's error."""
        if self.tier2 is not None and self.tier2.error * self.budget > self.max_error * self.tier2.allowed:
            return self.tier2.error, self.tier2.allowed
        return self.max_error, self.budget

    @property
    def informative(self) -> bool:
        """Evidence: every trivially wrong answer (zeros, the sign flipped, ...) would have failed."""
        return not self.admitted

    @property
    def passed(self) -> bool:
        return not self.failures


def judge(adapter, op: str, case: dict, dtype: str, seed: int = 0) -> Verdict:
    """Run ``case`` on the backend and compare its output (or the sampler's part of it) with the oracle
    (a case may set its own oracle work with ``"work"``, in table.py's element operations)."""
    args = build(op, case, dtype)
    moved = getattr(adapter, "transfer_seconds", 0.0)
    start = time.perf_counter()
    out = call(adapter, op, args, dtype)
    backend = time.perf_counter() - start
    transfer = getattr(adapter, "transfer_seconds", 0.0) - moved
    start = time.perf_counter()
    verdict = assess(op, args, out, dtype, seed, case.get("work", ORACLE_WORK))
    verdict.seconds = {"backend": backend - transfer, "transfer": transfer, "oracle": time.perf_counter() - start}
    return verdict


def assess(op: str, args: tuple, out: np.ndarray, dtype: str, seed: int = 0, work: int = ORACLE_WORK) -> Verdict:
    """Compare ``out``, an implementation's result for ``op`` on ``args``, with the oracle: all of it,
    or the part the op's sampler draws when the whole would cost more than ``work``."""
    entry = OPS[op]
    sub_args, index = entry.sample(op, args, np.random.default_rng(seed), work)
    got = np.asarray(out[index])
    exact = np.asarray(entry.oracle(*sub_args), dtype=object).reshape(got.shape)
    exact64 = round_to(exact, "float64")
    scale, absolute = (np.broadcast_to(a, got.shape) for a in entry.scale(_widened(sub_args), exact64, dtype))

    dims, _ = CONTRACT[op].bind(*sub_args)
    b = budget(op, dtype)
    quantities = {**dims, **entry.quantities(sub_args)}
    allowed = b.ulps(**quantities)

    got64 = got.astype(np.float64)
    finite = np.isfinite(got64)
    # The correctly rounded result, where a verdict reads it: an inf of the backend, and the worst element.
    expected = np.full(got.shape, np.nan)
    expected[~finite] = round_to(exact[~finite], dtype).astype(np.float64)
    error = np.where(finite, abs_error(np.where(finite, got64, 0.0), exact), 0.0)
    # ULPs at the scale, with the absolute allowance folded into the unit: error <= budget * unit.
    unit = scale_ulp(scale, dtype) + absolute / allowed
    ulps = np.where(finite, error / unit, np.inf)
    # A result that rounds to +-inf in the dtype (overflow) is right when the backend gives that inf, and
    # so is an inf of the exact result's sign where the modelled arrangement's intermediate may overflow.
    right_inf = np.isinf(got64) & (got64 == expected)
    if entry.overflows is not None:
        may = np.broadcast_to(entry.overflows(_widened(sub_args), exact64, dtype), got.shape)
        right_inf |= np.isinf(got64) & may & (np.sign(got64) == np.sign(exact64))
    ulps = np.where(right_inf, 0.0, ulps)

    failures = []
    nan = np.isnan(out.astype(np.float64))
    if nan.any():
        failures.append(f"NaN in the output at {_first(nan)} where the exact result is finite")
    overflow = np.isinf(got64) & np.isfinite(expected) & ~right_inf
    if overflow.any():
        failures.append(f"inf at {_coords(index, overflow)} where the exact result rounds to "
                        f"{expected[overflow][0]!r} in {dtype}")
    zero_scale = (scale == 0) & (absolute == 0) & finite & (error != 0)
    if zero_scale.any():
        failures.append(f"{got64[zero_scale][0]!r} at {_coords(index, zero_scale)} where the exact result is 0 "
                        f"(a masked or exactly-zero output must be exactly 0)")
    over = finite & (ulps > allowed) & ~zero_scale
    if over.any():
        worst = np.unravel_index(np.argmax(np.where(over, ulps, -1)), ulps.shape)
        expected[worst] = round_to(exact[worst], dtype).astype(np.float64)
        failures.append(
            f"error {ulps[worst]:.4g} ULPs at the op's scale > budget {allowed:.4g} ({b.formula}) at "
            f"{_coords(index, worst)}: got {got64[worst]!r}, exact {float(exact64[worst])!r} "
            f"(correctly rounded {expected[worst]!r}), scale {float(scale[worst]):.6g}")
    tier1_allowance = allowed * scale_ulp(scale, dtype) + absolute

    def tier1_admits(answer):
        return bool(np.all(np.abs(answer - exact64) <= tier1_allowance))

    tier2 = tier2_admits = None
    if b.tier2 is not None:
        t_scale, t_absolute = (np.broadcast_to(a, got.shape) for a in entry.tier2(_widened(sub_args), exact64, dtype))
        t_unit = scale_ulp(t_scale, dtype)
        judged = t_scale > 0  # rows with nothing visible: tier 1 holds them to exactly 0

        def beyond(answer):
            """The largest error of ``answer`` in ULPs at the tier's scale beyond its absolute allowance."""
            excess = np.maximum(np.abs(answer - exact64) - t_absolute, 0.0) / t_unit
            return float(np.max(np.where(judged, excess, 0.0), initial=0.0))

        baseline = max(beyond(plain) for plain in entry.plain(op, sub_args, dtype))
        tier2 = Tier2(beyond(np.where(finite, got64, np.inf)), baseline,
                      b.tier2.ulps(**quantities) + b.factor * baseline)
        if tier2.error > tier2.allowed:
            failures.append(
                f"error {tier2.error:.4g} ULPs at the second tier's scale (sum_l p_l |v_l|, beyond its absolute "
                f"allowance) > {tier2.allowed:.4g} = {b.tier2.formula} + {b.factor:g} x {baseline:.4g}, the largest "
                f"error of the plain {dtype} arrangements on these inputs")

        def tier2_admits(answer):
            return beyond(answer) <= tier2.allowed

    admitted = [name for name, answer in trivial_answers(op, sub_args, exact64).items()
                if tier1_admits(answer) and (tier2_admits is None or tier2_admits(answer))]
    finite_ulps = ulps[np.isfinite(ulps)]
    return Verdict(op, dtype, allowed, finite_ulps.ravel(), failures, tier2, admitted, checked=got.size)


def trivial_answers(op: str, args: tuple, exact: np.ndarray) -> dict[str, np.ndarray]:
    """Wrong answers an allowance must exclude for an example to count as evidence: zeros and the sign
    flipped for every op; for attention also the uniform average of the visible values (q.k ignored)
    and each query head zeroed."""
    answers = {"zeros": np.zeros_like(exact), "the sign flipped": -exact}
    if op in ("causal_gqa", "sliding_gqa", "decode_gqa"):
        scale, visible, q, k, v = attention_inputs(op, args)
        counts = visible.sum(-1)
        mean = np.einsum("sl,lcd->scd", visible.astype(float), widen(v)) / np.maximum(counts, 1)[:, None, None]
        uniform = np.broadcast_to(mean[:, :, None, :], q.shape)
        answers["uniform weights (q.k ignored)"] = uniform[0] if op == "decode_gqa" else uniform
        heads = exact.reshape(-1, *exact.shape[-3:]) if op != "decode_gqa" else exact[None]
        for c, g in np.ndindex(*heads.shape[1:3]):
            zeroed = heads.copy()
            zeroed[:, c, g] = 0.0
            answers[f"query head {c * heads.shape[2] + g} zeroed"] = zeroed.reshape(exact.shape)
    return answers


def _first(mask: np.ndarray):
    return tuple(int(i) for i in np.argwhere(mask)[0])


def _coords(index, where) -> str:
    """The coordinate of the backend's output that a sampled position refers to."""
    position = where if isinstance(where, tuple) else _first(where)
    position = tuple(int(i) for i in position)
    if len(index) == 0 or index[0] is Ellipsis:
        return str(position)
    grids = np.broadcast_arrays(*index)
    k = grids[0].ndim
    return str(tuple(int(g[position[:k]]) for g in grids) + position[k:])


def case_json(case: dict) -> str:
    return json.dumps(case, separators=(",", ":"))


def rerun_command(item, backend: str, case: dict | None = None, weights: str | None = None) -> str:
    """The command that reruns exactly this test (and ``case``, or the checkpoint at ``weights``): by
    module path, so it works from any folder where the suite is installed, an engine's repository included."""
    command = ["pytest", "-p", "gemma4_conformance.plugin", "--pyargs", f"{item.module.__name__}::{item.name}",
               f"--backend={backend}"]
    device = item.config.getoption("--device")
    if device != "cpu":
        command.append(f"--device={device}")
    if case is not None:
        command.append(f"--case={case_json(case)}")
    if weights is not None:
        command.append(f"--weights={weights}")
    return shlex.join(command)
