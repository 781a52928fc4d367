"""Running one example: call the backend under the contract's checks, then judge it against the oracle."""

from __future__ import annotations

import ctypes
import json
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache, partial

import numpy as np
from mpmath import mp, mpf

from gemma4_conformance.adapters import declared_formats
from gemma4_conformance.adapters.contract import call
from gemma4_conformance.checkpoints.quantized import WEIGHT_FORMATS, QuantizedWeight
from gemma4_conformance.spec import CONTRACT, enclosures, format_of, get_precision, precision, round_to, scale_ulp
from gemma4_conformance.spec.compiled import nan_max
from gemma4_conformance.spec.exact import one_blas_thread, shared, sharing, widen, widened
from gemma4_conformance.spec.formats import abs_error

from . import decision, table
from .budget import budget
from .error_models import visible_sums
from .table import OPS, ORACLE_WORK, WEIGHTS, build, held_block


def _flat(a) -> np.ndarray:
    """A floating array as the compiled loops take it: float64, contiguous, flat."""
    return np.ascontiguousarray(a, dtype=np.float64).reshape(-1)


def _widened(args, op: str):
    """Floating arrays in float64 (exact), for the error model's scale, once per assessment (so that its
    error models share what they compute from them, ``spec.exact.shared``); the weights of a product (W,
    Wg, Wu) stay as they are: their error models read them a block at a time (``spec.exact.products``),
    where a float64 copy of a real-size W would be its size again four times over (470 MB at 15360 x 3840)."""
    return shared("widened arguments", args, lambda: tuple(a if name in WEIGHTS else widened(a)
                                                           for a, name in zip(args, CONTRACT[op].arg_names)))


@dataclass
class BaselineTier:
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
    tier2: BaselineTier | None = None
    admitted: list[str] = field(default_factory=list)  # trivially wrong answers the allowance admits
    checked: int = 0  # output elements compared with the oracle (all, unless the op's sampler drew some)
    by_oracle: int = 0  # of those, how many the first stage (spec.enclosures) left to the oracle
    # where the first stage's bounds leave the largest error's printed digits open (none: they are settled)
    contenders: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    # where the first stage's bounds leave open which elements a failure's message names (none: settled)
    named: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    # Wall seconds of the backend's call (its transfers to and from its device apart, when it counts
    # them in ``transfer_seconds``) and of the oracle's judgement (exact result, scale, comparison).
    seconds: dict[str, float] = field(default_factory=dict)
    # The declared formats whose terms this op's allowance holds (key -> format), and at the element with
    # the largest error the share of its allowance that those terms are.
    formats: dict[str, str] = field(default_factory=dict)
    declared_share: float = 0.0

    @property
    def declared_dominates(self) -> bool:
        """Whether the declared terms are most of the allowance where the error is largest."""
        return self.declared_share > 0.5

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
    (a case may set its own oracle work with ``"work"``, in table.py's element operations), within the
    allowance that the adapter's declared formats add to (``declared_formats``)."""
    formats = declared_formats(adapter)
    handed, args = held(op, build(op, case, dtype), formats)
    moved = getattr(adapter, "transfer_seconds", 0.0)
    start = time.perf_counter()
    out = call(adapter, op, handed, dtype)
    backend = time.perf_counter() - start
    transfer = getattr(adapter, "transfer_seconds", 0.0) - moved
    start = time.perf_counter()
    verdict = assess(op, args, out, dtype, seed, case.get("work", ORACLE_WORK), formats=formats)
    verdict.seconds = {"backend": backend - transfer, "transfer": transfer, "oracle": time.perf_counter() - start}
    return verdict


def held(op: str, args: tuple, formats: dict[str, str]) -> tuple[tuple, tuple]:
    """(the arguments an adapter receives, the ones it is judged on).  An adapter that declares a block
    weight format (``table.held_block``) holds its products' weights in it: it receives each W rounded to
    the format, as a QuantizedWeight, and is judged on the values the blocks hold, exactly.  Those travel
    as float32 where float32 holds them (q8_0, q4_0, q6_k and int4 values always do, some q4_k ones do
    not), for the first stage's BLAS enclosure (spec.exact.dots_enclosure), float64 otherwise.  Weights the
    format cannot hold (rows that are not whole blocks, a block whose scale is past fp16's range, an inf or a
    NaN) raise BeyondDeclared."""
    if held_block(op, formats) is None:
        return args, args
    handed, exact = [], []
    for a, name in zip(args, CONTRACT[op].arg_names):
        if name in WEIGHTS:
            fmt = WEIGHT_FORMATS[formats["weights"]]
            if not fmt.fits(np.shape(a)):  # an edge case or a --case rerun; the drawn cases fit (table.cases)
                raise BeyondDeclared(f"the declared weights format {fmt.name} stores {fmt.stores}, not {name} of "
                                     f"shape {list(np.shape(a))}")
            with np.errstate(all="ignore"):
                weight = QuantizedWeight.of(fmt.name, a)
                values = weight.values()
            if not np.isfinite(values).all():
                raise BeyondDeclared(f"the declared weights format {weight.format} cannot hold {name} (a block's "
                                     f"scale is past the range it is held in, or a value is not finite)")
            narrow = values.astype(np.float32)
            a = narrow if np.array_equal(narrow, values) else values
            handed.append(weight)
        else:
            handed.append(a)
        exact.append(a)
    return tuple(handed), tuple(exact)


FALLBACK_SHARE = 0.5  # past this share of undecided elements the oracle judges the whole example
# The largest error is settled by the oracle where at most this share of the elements, or this many, could
# be it; past
# it (float64 outputs whose errors all sit near one ULP) the first stage's value stands, within its bounds.
CONTENDER_SHARE, CONTENDERS = 0.05, 64
RESOLUTION = 1e-6  # ULPs: errors below it print as 0 in the comparison of the two stages' largest errors


def assess(op: str, args: tuple, out: np.ndarray, dtype: str, seed: int = 0, work: int = ORACLE_WORK,
           first_stage: bool = True, fallback: bool = True, formats: dict[str, str] | None = None) -> Verdict:
    """Compare ``out``, an implementation's result for ``op`` on ``args``, with the oracle: all of it,
    or the part the op's sampler draws when the whole would cost more than ``work``.

    Ziv's strategy: the op's enclosure (spec.enclosures) decides every element it can; the oracle
    judges the least part of the output (rows, features, queries, heads) that holds the rest, or the
    whole example where the enclosure decides less than half of it, where a tier-2 or informativeness
    decision is too close to call, and wherever the example fails (so a failure's message is the
    oracle's).  ``first_stage=False`` is the oracle alone; ``fallback=False`` the enclosure alone (for
    the tests that show the two are needed together).  ``formats``: where the implementation declares
    it rounds beyond ``dtype`` (adapters.DECLARED_FORMATS); each declared rounding the op has a term for
    grows the scale by what it moves it by and adds its term to the absolute allowance; inputs a
    declared format cannot hold raise BeyondDeclared.
    """
    entry = OPS[op]
    with one_blas_thread(), sharing():
        declared = _declared_terms(entry, args, dtype, formats or {})
        return _assess(entry, args, out, dtype, seed, work, first_stage, fallback, declared)


class BeyondDeclared(Exception):
    """Inputs that a declared format cannot hold (a block scale past fp16's range, a KV cache value past
    fp8's): its term has no bound there, and the example is outside what the declaration covers."""


def declared_formats_hold(op: str, args: tuple, dtype: str, formats: dict[str, str]) -> bool:
    """Whether the declared ``formats`` hold ``args`` (BeyondDeclared where they cannot): what lies
    beyond them is outside every verdict on a declaring engine, the relations' too."""
    if not formats:  # an adapter that declares nothing: nothing to compute
        return True
    try:
        with one_blas_thread():
            _declared_terms(OPS[op], args, dtype, formats)
    except BeyondDeclared:
        return False
    return True


def _declared_terms(entry, args, dtype, formats: dict[str, str]):
    """(formats, the scale's increase, the terms, the second tier's scale increase and terms) summed per
    output element over the declared roundings ``entry`` has terms for, on the whole output; None where
    there are none.  A term function gives the first two, and the last two where the op has a second
    tier (they are the first two where it gives none)."""
    declared = {key: name for key, name in formats.items() if key in entry.declared}
    if not declared:
        return None
    wide = tuple(widen(a) for a in args)  # the declared terms' products take W whole
    with np.errstate(invalid="ignore", over="ignore"):  # an unbounded element: inf, or inf times 0
        terms = {key: _term(entry, key, wide, dtype, declared) for key in declared}
    terms = {key: tuple(term) for key, term in terms.items() if term is not None}  # a format without a term
    if not terms:
        return None
    declared = {key: declared[key] for key in terms}
    for key, parts in terms.items():
        if not all(np.isfinite(part).all() for part in parts):
            raise BeyondDeclared(f"the declared {key} format {declared[key]} cannot hold these inputs (they are "
                                 f"past its range, or a scale is past the range it is held in), so its rounding "
                                 f"has no bound here")
    parts = [parts if len(parts) == 4 else parts * 2 for parts in terms.values()]
    return (declared, *(sum(part[i] for part in parts) for i in range(4)))


def _term(entry, key, wide, dtype, declared):
    """One declared rounding's (scale's increase, term), or None: rounded weights meet the rounded
    activations, so their term reads the activations' format."""
    if key == "weights":
        return entry.declared[key](wide, dtype, declared[key], declared.get("activations"))
    return entry.declared[key](wide, dtype, declared[key])


def _assess(entry, args, out, dtype, seed, work, first_stage, fallback, declared) -> Verdict:
    op = entry.name
    sub_args, index = entry.sample(op, args, np.random.default_rng(seed), work)
    got = np.asarray(out[index])
    if first_stage and declared is None and entry.row_wise and entry.enclosure is not None:
        settled = _judged_in_blocks(entry, sub_args, got, dtype)
        if settled is not None:
            return settled
    stage = _enclosed(entry, sub_args, dtype, got) if first_stage and entry.enclosure is not None else None
    if declared is not None:
        declared = declared[0], *(np.asarray(part)[index] for part in declared[1:])
    verdict_of = partial(_judge, declared=declared)
    if stage is not None:
        verdict, undecided = verdict_of(entry, sub_args, got, dtype, index, stage)
        verdict.by_oracle = int(undecided.sum())
        if not fallback:
            return verdict
        if not verdict.passed and entry.restrict is not None and entry.tier2 is None and got.ndim:  # 0-d: whole
            failed = _failure_from_restriction(verdict_of, entry, sub_args, got, dtype, index, stage, verdict)
            if failed is not None:
                return failed
            verdict, undecided = verdict_of(entry, sub_args, got, dtype, index, stage)  # as far as it is settled
            verdict.by_oracle = int(undecided.sum())
        if not undecided.any() and verdict.passed:
            # The largest error as the report prints it: the oracle settles the elements that could be it.
            undecided = verdict.contenders
            if not undecided.any() or undecided.sum() > max(CONTENDERS, CONTENDER_SHARE * undecided.size):
                return verdict
        if entry.restrict is not None and verdict.passed and undecided.mean() <= FALLBACK_SHARE:
            part, where = entry.restrict(op, sub_args, undecided)
            stage.settle(where, _by_oracle(entry, part, dtype, got[where]))
            settled, still = verdict_of(entry, sub_args, got, dtype, index, stage)
            if settled.passed and not still.any():
                settled.by_oracle = verdict.by_oracle + int(undecided.sum())
                return settled
    verdict, _ = verdict_of(entry, sub_args, got, dtype, index, _by_oracle(entry, sub_args, dtype, got))
    verdict.by_oracle = got.size
    return verdict


FAILURE_ROUNDS = 4  # restrictions tried before a failing example goes to the oracle whole


def _failure_from_restriction(verdict_of, entry, args, got, dtype, index, stage, verdict) -> Verdict | None:
    """A failing example's verdict with the oracle's values at every element its messages could name
    (``Verdict.named``), the oracle judging the least part of the output that holds them, whatever the
    output's size; None where, those settled, the example passes.  An op with a second tier is left to
    the whole oracle: that tier's errors are a maximum over every element."""
    settled = np.zeros(got.shape, dtype=bool)
    for _ in range(FAILURE_ROUNDS):
        named = verdict.named & ~settled if verdict.named.size else settled
        if not named.any():
            verdict.by_oracle = int(settled.sum())
            return verdict
        part, where = entry.restrict(entry.name, args, named)
        stage.settle(where, _by_oracle(entry, part, dtype, got[where]))
        settled[where] = True
        verdict, _ = verdict_of(entry, args, got, dtype, index, stage)
        if verdict.passed:
            return None
    return None


BLOCK = 1 << 17  # output elements a row-wise op's judging holds at a time: few enough that its arrays stay in the
# CPU's cache, enough that the Python between blocks is a small part of their time


@cache
def _keep_freed_memory() -> None:
    """Asks glibc's malloc, where it is the allocator, to serve arrays of up to 32 MB from its heap and to
    keep up to 128 MB of it freed instead of handing it back to the kernel.  Each block's arrays are freed
    and made again for the next; memory handed back comes back as fresh pages, each a page fault, and at
    blocks of ``BLOCK`` outputs its own heuristic hands them back whenever the output is not much larger
    than a block.  It changes where memory comes from, never a value."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # None: not glibc's (macOS), nothing to ask
    if mallopt is not None:
        mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        mallopt(-1, 128 << 20)  # M_TRIM_THRESHOLD


def _judged_in_blocks(entry, args, got, dtype) -> Verdict | None:
    """``_judge``'s verdict on a row-wise op's output from its enclosure, made ``BLOCK`` outputs at a
    time (the enclosure, the error model and ``decision.verdict_units`` on each block's rows, in arrays
    that stay in the cache; the whole output's are never made), where the verdict needs no more: every
    output finite, every element decided within its budget, none at a zero scale, the largest error's
    printed digits and the trivial answers (zeros, the sign flipped) settled.  None otherwise, and where
    the enclosure works in long double (a float64 target's, but for the double-word enclosures of
    ``enclosures.DOUBLE_WORD``): the whole output's judging decides, from the start.  The blocks' results
    fold as the loop's over the whole output would (a sum, maxima, the first element over its budget, and
    and or), element by element the same numbers."""
    work = enclosures.work_type(format_of(dtype).precision)
    if work is not np.float64 and entry.name not in enclosures.DOUBLE_WORD:
        return None
    _keep_freed_memory()
    _, _, allowed, constants = _allowance(entry, args, dtype)
    lead = table.row_axes(entry.name, args)
    rows = int(np.prod(lead, dtype=np.int64))
    per_row = got.size // rows if rows else 1
    outputs = got.reshape(rows, per_row)
    ulps, undecided = np.empty(got.size), np.empty(got.size, dtype=bool)
    not_finite, uncertain, least, most = 0, False, -np.inf, -np.inf
    zeros, flipped = (True, True, False), (True, True, False)
    for start, stop, part in table.row_blocks(entry.name, args, max(1, BLOCK // max(per_row, 1))):
        with sharing(apart=True), np.errstate(all="ignore"):
            got64 = widen(outputs[start:stop])
            if not np.isfinite(got64).all():
                return None
            try:
                mid, rad = entry.enclosure(*part, work=work)
            except enclosures.NotEnclosed:
                return None
            mid, mid_low = mid if isinstance(mid, enclosures.DoubleWord) else (mid, np.zeros(0))
            exact64 = np.asarray(mid, dtype=np.float64).reshape((stop - start,) + got.shape[len(lead):])
            scale, absolute = entry.scale(tuple(a if name in WEIGHTS else widened(a)
                                                for a, name in zip(part, CONTRACT[entry.name].arg_names)),
                                          exact64, dtype)
            scale = np.broadcast_to(scale, exact64.shape)
            absolute = np.full(1, absolute) if np.ndim(absolute) == 0 else np.broadcast_to(absolute, exact64.shape)
            block = slice(start * per_row, stop * per_row)
            (block_not_finite, zero_first, worst, block_least, block_most, block_uncertain, block_zeros,
             block_flipped) = decision.verdict_units(_flat(got64), _flat(exact64), _flat(rad), _flat(mid_low),
                                                     *(np.zeros(0),) * 3,
                                                     _flat(scale), _flat(absolute), *(np.zeros(0, dtype=bool),) * 2,
                                                     *constants, ulps[block], np.zeros(0), undecided[block])
        if zero_first >= 0 or worst >= 0 or undecided[block].any():
            return None
        not_finite += block_not_finite
        uncertain |= block_uncertain
        least, most = nan_max(least, block_least), nan_max(most, block_most)
        zeros = (zeros[0] and block_zeros[0], zeros[1] and block_zeros[1], zeros[2] or block_zeros[2])
        flipped = (flipped[0] and block_flipped[0], flipped[1] and block_flipped[1], flipped[2] or block_flipped[2])
    if uncertain and printed(least) != printed(most):
        return None
    admitted = []
    for name, (admits, surely, surely_not) in (("zeros", zeros), ("the sign flipped", flipped)):
        if uncertain and not (surely if admits else surely_not):
            return None
        if admits:
            admitted.append(name)
    errors = ulps[np.isfinite(ulps)] if not_finite else ulps
    return Verdict(entry.name, dtype, allowed, errors, [], None, admitted, checked=got.size)


def _allowance(entry, args, dtype):
    """(the op's budget, its quantities, the ULPs it allows on ``args``, ``decision.verdict_units``'
    constants)."""
    dims, _ = CONTRACT[entry.name].bind(*args)
    b = budget(entry.name, dtype)
    quantities = {**dims, **entry.quantities(args)}
    allowed = b.ulps(**quantities)
    f = format_of(dtype)
    return b, quantities, allowed, (float(allowed), f.precision, f.emin, float(f.max_finite), _SLACK)


class _Stage:
    """What the judging knows of the exact result, per output element: the nearest float64
    ``exact64`` (within ``rad`` of the exact value; 0 where it is the oracle's rounding), the error
    |got - exact| (``error``, within [``error_low``, ``error_high``]), and the correctly rounded
    result in the dtype where a verdict reads it (``rounded``).

    A float64 or double-word enclosure's stage keeps ``enclosure`` (got, mid, rad, the double word's low
    part or nothing) instead of the bounds: the verdict's loop makes them as it goes, and they become
    arrays when first read (``settle``)."""

    _BOUNDS = ("rad", "error", "error_low", "error_high")

    def __init__(self, exact64, rad, error, error_low, error_high, rounded, enclosure=None):
        self.exact64, self.enclosure = exact64, enclosure
        if enclosure is None:
            self.rad, self.error, self.error_low, self.error_high = rad, error, error_low, error_high
        self._rounded = rounded  # mask -> the correctly rounded values there, nan where not decided

    def __getattr__(self, name):  # the bounds of an enclosure's stage, made when first read
        if name not in self._BOUNDS or self.__dict__.get("enclosure") is None:
            raise AttributeError(name)
        got, mid, rad, low = self.enclosure
        for key, bound in zip(self._BOUNDS, decision.stage_bounds(_flat(got), _flat(mid), _flat(low), _flat(rad),
                                                                  _SLACK)):
            setattr(self, key, bound.reshape(mid.shape))
        self.enclosure = None
        return getattr(self, name)

    def rounded(self, mask):
        return self._rounded(mask)

    def settle(self, where, other: "_Stage") -> None:
        """Take ``other``'s knowledge (the oracle's, of the part ``where``)."""
        for name in ("exact64", "rad", "error", "error_low", "error_high"):
            getattr(self, name)[where] = getattr(other, name)
        first = self._rounded

        def rounded(mask):
            out = first(mask)
            inner = mask[where]
            if inner.any():
                part = out[where]
                part[inner] = other.rounded(inner)[inner]
                out[where] = part
            return out

        self._rounded = rounded


_SLACK = 2.0**-40  # relative: what the float64 arithmetic of a verdict may move its numbers by


def _enclosed(entry, args, dtype, got) -> _Stage | None:
    """The first stage's knowledge, or None where the enclosure does not take the arguments."""
    f = format_of(dtype)
    work = enclosures.work_type(f.precision)
    try:
        with np.errstate(all="ignore"):
            mid, rad = entry.enclosure(*args, work=work)
    except enclosures.NotEnclosed:
        return None
    if isinstance(mid, enclosures.DoubleWord):
        return _double_word_stage(got, *mid, rad, f.dtype)
    mid = np.asarray(mid, dtype=work).reshape(got.shape)
    rad = np.asarray(rad, dtype=work).reshape(got.shape)
    if work is np.float64:
        exact64 = mid
        enclosure = (got, mid, rad, np.zeros(0))
    else:  # long double: its rounding to float64 adds to the radius
        rad = np.where(np.isnan(rad) | ~np.isfinite(mid), np.inf, rad)
        with np.errstate(all="ignore"):
            exact64 = mid.astype(np.float64)
            difference = np.abs(got.astype(np.float64).astype(work) - mid)
            error = difference.astype(np.float64)
            error_high = ((difference + rad) * work(1 + _SLACK)).astype(np.float64)
            error_low = (np.maximum(difference - rad, 0) * work(1 - _SLACK)).astype(np.float64)
            exact_rad = (rad + np.abs(mid - exact64.astype(work))).astype(np.float64) * (1 + _SLACK)
            exact_rad = np.where(np.isfinite(exact_rad), exact_rad, np.inf)
        enclosure = None

    def rounded(mask):
        out = np.full(mask.shape, np.nan)
        if mask.any():
            m, r = mid[mask], rad[mask]
            r = np.where(np.isnan(r) | ~np.isfinite(m), np.inf, r)
            with np.errstate(all="ignore"):
                low, high = ((m + sign * r).astype(f.dtype).astype(np.float64) for sign in (-1, 1))
            out[mask] = np.where((low == high) & np.isfinite(r), low, np.nan)
        return out

    if enclosure is not None:
        return _Stage(exact64, None, None, None, None, rounded, enclosure)
    return _Stage(exact64, exact_rad, error, error_low, error_high, rounded)


def _double_word_stage(got, high, low, rad, dtype) -> _Stage:
    """A double-word enclosure's knowledge: exact64 is ``high``; the correctly rounded result is read from
    both ends, each moved outward past its own rounding (high plus the end's rounded low part, nudged
    outward by one of its ULPs, rounds as the end would, or more outward)."""
    high, low, rad = (np.asarray(a, dtype=np.float64).reshape(got.shape) for a in (high, low, rad))

    def rounded(mask):
        out = np.full(mask.shape, np.nan)
        if mask.any():
            h, l, r = high[mask], low[mask], rad[mask]
            r = np.where(np.isnan(r) | ~np.isfinite(h), np.inf, r)
            with np.errstate(all="ignore"):
                below, above = h + np.nextafter(l - r, -np.inf), h + np.nextafter(l + r, np.inf)
                below, above = (end.astype(dtype).astype(np.float64) for end in (below, above))
            out[mask] = np.where((below == above) & np.isfinite(r), below, np.nan)
        return out

    return _Stage(high, None, None, None, None, rounded, (got, high, rad, low))


def _by_oracle(entry, args, dtype, got) -> _Stage:
    """The oracle's knowledge: exact, and the correctly rounded results in the dtype (``correctly_rounded``).
    The error models' float64 value is the working precision's rounded once more: they size a budget."""
    exact = np.asarray(entry.oracle(*args), dtype=object).reshape(got.shape)
    exact64 = round_to(exact, "float64")
    got64 = got.astype(np.float64)
    finite = np.isfinite(got64)
    error = np.where(finite, abs_error(np.where(finite, got64, 0.0), exact), 0.0)

    def rounded(mask):
        out = np.full(got.shape, np.nan)
        out[mask] = correctly_rounded(entry.oracle, args, exact, dtype, mask)[1][mask].astype(np.float64)
        return out

    return _Stage(exact64, np.zeros(got.shape), error, error, error, rounded)


# The oracles compute at the working precision; a result within 2^(GUARD - precision) of it, relative,
# rounds alike or the precision doubles (the oracles' few roundings at 128 bits stay far inside that).
GUARD = 16
MAX_PRECISION = 1024


def correctly_rounded(oracle, args, exact, dtype, mask=None):
    """(exact, exact rounded once to ``dtype``): where the oracle's value is too near a rounding boundary
    of ``dtype`` to tell which way the exact result rounds, it is computed again at twice the
    precision, until both ends of its error interval round alike (Ziv's loop), or the value no longer
    changes (an exact tie) or the precision reaches MAX_PRECISION."""
    mask = np.ones(exact.shape, dtype=bool) if mask is None else mask
    if not mask.any():
        return exact, np.zeros(exact.shape, dtype=format_of(dtype).dtype)
    bits = get_precision()
    while True:
        values = exact[mask]
        with mp.workprec(2 * bits):  # the interval's ends exactly
            slack = mpf(2) ** (GUARD - bits)
            low = round_to(np.array([v - abs(v) * slack for v in values], dtype=object), dtype)
            high = round_to(np.array([v + abs(v) * slack for v in values], dtype=object), dtype)
        nearest = round_to(values, dtype)
        alike = (low.astype(np.float64) == high.astype(np.float64)) | ~np.array([bool(mp.isfinite(v)) for v in values], dtype=bool)
        out = np.zeros(exact.shape, dtype=format_of(dtype).dtype)
        out[mask] = nearest
        if alike.all() or bits >= MAX_PRECISION:
            return exact, out
        bits *= 2
        with precision(bits):
            sharper = np.asarray(oracle(*args), dtype=object).reshape(exact.shape)
        if all(a == b for a, b in zip(sharper[mask][~alike], values[~alike])):  # the tie is exact
            return exact, out
        exact = sharper


def _judge(entry, args, got, dtype, index, stage: _Stage, declared=None) -> tuple[Verdict, np.ndarray]:
    """The verdict on ``got`` from what ``stage`` knows, and the elements whose pass it cannot certify
    (all of them where a decision about the whole example is too close to call).

    Per element (``decision.verdict_units``, one compiled loop): the ULPs at the scale, with the
    absolute allowance folded into the unit (error <= budget * unit).  The error models read the exact
    result only as |exact| in the scale (1-Lipschitz): the unit at the ends of its enclosure bounds the
    ULPs.  An element is undecided where its bounds straddle the budget or a zero scale.  ``declared``:
    ``_declared_terms``'s (formats, the scale's increase, the terms, the second tier's): each tier's scale
    grows by its increase, its absolute allowance by its terms."""
    op = entry.name
    exact64 = stage.exact64
    scale, absolute = entry.scale(_widened(args, op), exact64, dtype)
    if declared is not None:
        scale = scale + declared[1].reshape(np.shape(exact64))
        absolute = absolute + declared[2].reshape(np.shape(exact64))
    # one absolute allowance for every element goes to the compiled loop as it is
    flat_absolute = np.full(1, absolute, dtype=np.float64) if np.ndim(absolute) == 0 else None
    scale, absolute = (np.broadcast_to(a, got.shape) for a in (scale, absolute))
    flat_absolute = _flat(absolute) if flat_absolute is None else flat_absolute

    b, quantities, allowed, constants = _allowance(entry, args, dtype)
    f = format_of(dtype)

    got64 = widen(got)
    failures = []
    right_inf = undecided_in = np.zeros(0, dtype=bool)
    if not np.isfinite(got64).all():
        # The correctly rounded result, where a verdict reads it: an inf of the backend. A result that
        # rounds to +-inf in the dtype (overflow) is right when the backend gives that inf, and so is an
        # inf of the exact result's sign where the modelled arrangement's intermediate may overflow.
        finite = np.isfinite(got64)
        expected = stage.rounded(~finite)
        undecided_in = ~finite & np.isnan(expected) & ~np.isnan(got64)
        right_inf = np.isinf(got64) & (got64 == expected)
        term = 0.0 if declared is None else declared[2].reshape(np.shape(exact64))
        # a declared rounding moves the result by up to its term, past the dtype's range where it is near
        may = np.abs(exact64) + term >= float(f.max_finite) + float(scale_ulp(f.max_finite, dtype)) / 2
        if entry.overflows is not None:
            may = may | entry.overflows(_widened(args, op), exact64, dtype, term)
        if entry.overflows is not None or declared is not None:
            may = np.broadcast_to(may, got.shape)
            signed = np.isinf(got64) & may & (np.sign(got64) == np.sign(exact64))
            undecided_in |= signed & ~right_inf & (np.abs(exact64) <= stage.rad)
            right_inf |= signed
        nan = np.isnan(got64)
        if nan.any():
            failures.append(f"NaN in the output at {_first(nan)} where the exact result is finite")
        overflow = np.isinf(got64) & np.isfinite(expected) & ~right_inf
        if overflow.any():
            failures.append(f"inf at {_coords(index, overflow)} where the exact result rounds to "
                            f"{float(expected[overflow][0])!r} in {dtype}")
        right_inf, undecided_in = right_inf.reshape(-1), undecided_in.reshape(-1)
    flat_scale = _flat(scale)
    if stage.enclosure is not None:
        _, mid, mid_rad, mid_low = stage.enclosure
        knowledge = (_flat(mid), _flat(mid_rad), _flat(mid_low), *(np.zeros(0),) * 3)
    else:
        knowledge = tuple(_flat(a) for a in (exact64, stage.rad, np.zeros(0), stage.error, stage.error_low,
                                             stage.error_high))

    def units(ulps_high):
        """The loop's outputs (``ulps_high`` where its array is given) and its other results."""
        ulps, undecided = np.empty(got.shape), np.empty(got.shape, dtype=bool)
        results = decision.verdict_units(_flat(got64), *knowledge, flat_scale, flat_absolute, right_inf,
                                         undecided_in, *constants, ulps.reshape(-1), ulps_high.reshape(-1),
                                         undecided.reshape(-1))
        return ulps, undecided, results

    ulps, undecided, (not_finite, zero_first, worst, least, most, uncertain, zeros, flipped) = units(np.zeros(0))

    if zero_first >= 0:
        where = np.unravel_index(zero_first, got.shape)
        failures.append(f"{float(got64[where])!r} at {_coords(index, where)} where the exact result is 0 "
                        f"(a masked or exactly-zero output must be exactly 0)")
    if worst >= 0:
        worst = np.unravel_index(worst, got.shape)
        mask = np.zeros(got.shape, dtype=bool)
        mask[worst] = True
        expected_worst = stage.rounded(mask)[worst]
        failures.append(
            f"error {ulps[worst]:.4g} ULPs at the op's scale > budget {allowed:.4g} ({b.formula}) at "
            f"{_coords(index, worst)}: got {float(got64[worst])!r}, exact {float(exact64[worst])!r} "
            f"(correctly rounded {float(expected_worst)!r}), scale {float(scale[worst]):.6g}")
    whole = False  # a decision about the whole example too close to call

    def decided(state) -> bool:
        """Whether an answer is within the allowance: (all within, all surely within, any surely beyond);
        where the enclosure leaves it open, the whole example goes to the oracle."""
        nonlocal whole
        admits, surely, surely_not = (bool(v) for v in state)
        if uncertain and not (surely if admits else surely_not):
            whole = True
        return admits

    def tier1_admits(name, answer):
        if name in known:
            return decided(known[name])
        return decided(decision.admits(_flat(answer()), _flat(exact64), _flat(stage.rad), flat_scale, flat_absolute,
                                       *constants))

    known = {"zeros": zeros, "the sign flipped": flipped}
    tier2 = tier2_admits = None
    if b.tier2 is not None:
        t_scale, t_absolute = entry.tier2(_widened(args, op), exact64, dtype)
        if declared is not None:
            t_scale = t_scale + declared[3].reshape(np.shape(exact64))
            t_absolute = t_absolute + declared[4].reshape(np.shape(exact64))
        plains, reordered = shared("plain arrangements", (*args, dtype), lambda: entry.baselines(args, dtype))
        t_scale, t_absolute = (np.broadcast_to(a, got.shape) for a in (t_scale, t_absolute))
        # rows with nothing visible (scale 0): tier 1 holds them to exactly 0
        tier = (_flat(exact64), _flat(stage.rad), _flat(t_absolute), _flat(scale_ulp(t_scale, dtype)),
                np.ascontiguousarray(t_scale > 0).reshape(-1))
        # a candidate, or a trivial answer, may have summed the logits in another order than the plain ones
        answers_tier = tier if reordered is None else (*tier[:2], _flat(t_absolute + reordered), *tier[3:])

        def beyond_each(answers, sign=0, at=answers_tier) -> list[float]:
            """The largest error of each answer in ULPs at the tier's scale beyond its absolute allowance."""
            stacked = np.stack([_flat(answer) for answer in answers])
            exact, rad, absolute, unit, judged = at
            return decision.tier2_excess(stacked, exact, rad, float(sign), _SLACK, absolute, unit, judged).tolist()

        def beyond(answer, sign=0) -> float:
            return beyond_each([answer], sign)[0]

        baseline = max(beyond_each(plains, at=tier))
        candidate = np.where(np.isfinite(got64), got64, np.inf)
        tier2 = BaselineTier(beyond(candidate), baseline, b.tier2.ulps(**quantities) + b.factor * baseline)
        if uncertain and tier2.error <= tier2.allowed:
            lowest = b.tier2.ulps(**quantities) + b.factor * max(beyond_each(plains, -1, tier))
            if beyond(candidate, +1) > lowest * (1 - _SLACK):
                whole = True
        if tier2.error > tier2.allowed:
            failures.append(
                f"error {tier2.error:.4g} ULPs at the second tier's scale (sum_l p_l |v_l|, beyond its absolute "
                f"allowance{'' if reordered is None else ' and what summing logits in another order moves'}) > "
                f"{tier2.allowed:.4g} = {b.tier2.formula} + {b.factor:g} x {baseline:.4g}, the largest "
                f"error of the plain {dtype} arrangements on these inputs")

        def tier2_admits(answer):
            nonlocal whole
            admits = beyond(answer) <= tier2.allowed
            if uncertain and admits != (beyond(answer, -1) <= tier2.allowed) or \
                    uncertain and admits != (beyond(answer, +1) <= tier2.allowed):
                whole = True
            return admits

    admitted = [name for name, answer in trivial_answers(op, args, exact64).items()
                if tier1_admits(name, answer) and (tier2_admits is None or tier2_admits(answer()))]
    if OPS[op].attention is not None:  # each query head zeroed: all heads' answers in one pass
        heads, count = zeroed_heads(exact64)
        states = decision.zeroed_heads_admits(heads, count, _flat(exact64), _flat(stage.rad), flat_scale, flat_absolute,
                                              *constants)
        if tier2 is not None:
            excess = {sign: decision.zeroed_heads_excess(heads, count, *answers_tier[:2], float(sign), _SLACK,
                                                         *answers_tier[2:])
                      for sign in (0, -1, 1)}
        for h in range(count):
            if not decided(states[h]):
                continue
            if tier2 is not None:
                admits = excess[0][h] <= tier2.allowed
                if uncertain and any(admits != (excess[sign][h] <= tier2.allowed) for sign in (-1, 1)):
                    whole = True
                if not admits:
                    continue
            admitted.append(f"query head {h} zeroed")
    errors = ulps[np.isfinite(ulps)] if not_finite else ulps.ravel()
    verdict = Verdict(op, dtype, allowed, errors, failures, tier2, admitted, checked=got.size)
    if declared is not None:
        verdict.formats = dict(declared[0])
        if ulps.size:
            worst_element = np.unravel_index(np.argmax(np.where(np.isfinite(ulps), ulps, -1.0)), got.shape)
            term = declared[2].reshape(got.shape)[worst_element]
            whole_allowance = allowed * scale_ulp(scale[worst_element], dtype) + absolute[worst_element]
            verdict.declared_share = float(term / whole_allowance) if whole_allowance > 0 else 0.0
    if failures:  # an undecided inf, every element whose error could be the largest one over the budget, and
        # all of them where a decision about the whole example is too close to call
        ulps_high = np.empty(got.shape)
        units(ulps_high)
        finite, rad = np.isfinite(got64), stage.rad
        zero_scale = (scale == 0) & (absolute == 0) & finite & (stage.error != 0)
        over = finite & (ulps > allowed) & ~zero_scale
        with np.errstate(all="ignore"):
            ulps_low = stage.error_low / (scale_ulp(scale + rad, dtype) + absolute / allowed)
        largest = np.max(np.where(over, ulps_low, -np.inf), initial=-np.inf)
        verdict.named = whole | (undecided & ~finite) | (finite & ~zero_scale & (over | undecided) & over.any()
                                                         & (ulps_high >= largest) & (rad > 0))
    if uncertain and printed(least) != printed(most):  # the elements whose error could be the largest
        judged = np.isfinite(got64) & ~right_inf.reshape(got.shape) if right_inf.size else np.isfinite(got64)
        ulps_high = np.empty(got.shape)
        units(ulps_high)
        verdict.contenders = judged & (ulps_high >= least)
    if whole:
        undecided[...] = True
    return verdict, undecided


def printed(ulps: float) -> str:
    """An error as the report keeps it: 4 significant digits, 0 below RESOLUTION."""
    return f"{ulps:.4g}" if not ulps < RESOLUTION else "0"


def trivial_answers(op: str, args: tuple, exact: np.ndarray) -> dict[str, Callable[[], np.ndarray]]:
    """Wrong answers an allowance must exclude for an example to count as evidence, each made when asked
    (the verdict's compiled loop judges the first two without them): zeros and the sign flipped for
    every op; for attention also the uniform average of the visible values (q.k ignored), and each query
    head zeroed (``zeroed_heads``)."""
    answers = {"zeros": lambda: np.zeros_like(exact), "the sign flipped": lambda: -exact}
    inputs = OPS[op].attention
    if inputs is not None:
        scale, visible, q, k, v = inputs(args)
        counts = visible.sum(-1)
        mean = visible_sums(visible, widen(v)) / np.maximum(counts, 1)[:, None, None]
        uniform = np.broadcast_to(mean[:, :, None, :], q.shape)
        answers["uniform weights (q.k ignored)"] = partial(inputs.output, uniform)
    return answers


def zeroed_heads(exact: np.ndarray) -> tuple[np.ndarray, int]:
    """The query head c G + g of each element of an attention output [S, Hkv, G, D] (decode's [Hkv, G, D]),
    flat, and how many there are: the trivial answers "query head h zeroed" are ``exact`` with head h's
    elements 0 (decision.zeroed_heads_admits judges them all in one pass)."""
    Hkv, G, D = exact.shape[-3:]
    heads = np.broadcast_to(np.arange(Hkv * G).reshape(Hkv, G, 1), exact.shape)
    return np.ascontiguousarray(heads).reshape(-1), Hkv * G


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
    seed = item.config.getoption("hypothesis_seed", None)
    if case is None and seed is not None:  # the forward's and serving's tokens are drawn with it
        command.append(f"--hypothesis-seed={seed}")
    return shlex.join(command)
