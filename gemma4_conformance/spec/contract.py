"""The array conventions, written once: every op's arguments (in Lean order), their kinds and shapes.

Oracles, adapters and tests all read this table.  A shape is a space-separated pattern: ``...`` is
any run of leading (row) axes, shared by every argument of the op; a name is a dimension that must
agree wherever it appears; ``2*I`` is twice the dimension ``I``.  The feature axis is always last.

Argument kinds:
  real      a Python real scalar (eps, theta, scale, multipliers), taken exactly
  nat       a Python int >= 0 (rot, denom, active, window)
  cap       None or a Python real (the optional softcap of the LM head)
  float     a floating array in the dtype under test
  index     an integer array (positions, tokens, pair indices)
  mask      a boolean array
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Arg:
    name: str
    kind: str
    shape: str = ""  # only for array kinds


@dataclass(frozen=True)
class OpContract:
    name: str  # snake_case of the Lean name
    lean: str  # the Lean definition's name
    module: str  # the Lean file it comes from
    args: tuple[Arg, ...]
    out: str  # shape pattern of the result
    _matched: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # shapes -> _match

    @property
    def arg_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.args)

    def bind(self, *args) -> tuple[dict[str, int], tuple[int, ...]]:
        """Check the arguments against the contract; return the named dimensions and the row axes."""
        dims, rows, _ = self._checked(args)
        return dict(dims), rows

    def output_shape(self, *args) -> tuple[int, ...]:
        """Check the arguments against the contract and return the result's shape."""
        return self._checked(args)[2]

    def _checked(self, args: tuple) -> tuple[tuple, tuple[int, ...], tuple[int, ...]]:
        """(the named dimensions as items, the row axes, the result's shape); the shapes' part is kept per
        shapes, since a forward calls each op with a few shapes, thousands of times."""
        if len(args) != len(self.args):
            raise TypeError(f"{self.name} takes {len(self.args)} arguments {self.arg_names}, got {len(args)}")
        for spec, value in zip(self.args, args):
            if spec.kind == "index" and np.size(value) and np.min(value) < 0:
                raise ValueError(f"{self.name}: {spec.name} must be >= 0")
        if self.name == "embed" and np.size(args[2]) and np.max(args[2]) >= np.shape(args[1])[0]:
            raise ValueError(f"embed: a token id is >= the vocabulary size {np.shape(args[1])[0]}")
        shapes = tuple(np.shape(value) if spec.kind in ARRAY_KINDS else None for spec, value in zip(self.args, args))
        known = self._matched.get(shapes)
        if known is None:
            known = self._matched[shapes] = self._match(shapes)
        return known

    def _match(self, shapes: tuple) -> tuple[tuple, tuple[int, ...], tuple[int, ...]]:
        dims: dict[str, int] = {}
        batch: list[tuple[int, ...]] = []
        for spec, shape in zip(self.args, shapes):
            if shape is not None:
                _match(self.name, spec, shape, dims, batch)
        rows = batch[0] if batch else ()
        return tuple(dims.items()), rows, _build(self.out, dims, rows)


ARRAY_KINDS = ("float", "index", "mask")


def _dim(token: str, dims: dict[str, int]) -> int | None:
    if token.startswith("2*"):
        base = dims.get(token[2:])
        return None if base is None else 2 * base
    return dims.get(token)


def _match(op: str, spec: Arg, shape: tuple[int, ...], dims: dict[str, int], batch: list) -> None:
    tokens = spec.shape.split()
    leading = tokens[0] == "..." if tokens else False
    named = tokens[1:] if leading else tokens
    where = f"{op}: argument {spec.name} has shape {tuple(shape)}, expected [{spec.shape}]"
    if len(shape) < len(named) or (not leading and len(shape) != len(named)):
        raise ValueError(where)
    tail = shape[len(shape) - len(named):] if named else ()
    for token, n in zip(named, tail):
        known = _dim(token, dims)
        if known is None:
            if token.startswith("2*"):
                if n % 2:
                    raise ValueError(f"{where}: {token} must be even")
                dims[token[2:]] = n // 2
            else:
                dims[token] = n
        elif known != n:
            raise ValueError(f"{where}: {token} = {known} elsewhere")
    if leading:
        rows = tuple(shape[: len(shape) - len(named)])
        if batch and batch[0] != rows:
            raise ValueError(f"{where}: leading axes {rows} differ from {batch[0]} of another argument")
        batch.append(rows)


def _build(pattern: str, dims: dict[str, int], rows: tuple[int, ...]) -> tuple[int, ...]:
    out: list[int] = []
    for token in pattern.split():
        out.extend(rows) if token == "..." else out.append(_dim(token, dims))
    return tuple(out)


def _op(name: str, lean: str, module: str, out: str, *args: Arg) -> OpContract:
    return OpContract(name, lean, module, args, out)


_x = Arg("x", "float", "...")
_xh = Arg("x", "float", "... H")
_w = Arg("w", "float", "H")
_eps = Arg("eps", "real")

CONTRACT: dict[str, OpContract] = {
    c.name: c
    for c in (
        # Basic
        _op("sigmoid", "sigmoid", "Basic", "...", _x),
        _op("silu", "silu", "Basic", "...", _x),
        _op("gelu_tanh", "geluTanh", "Basic", "...", _x),
        _op("softcap", "softcap", "Basic", "...", Arg("c", "real"), _x),
        # Norm
        _op("rms", "rms", "Norm", "...", _eps, _xh),
        _op("rmsnorm", "rmsnorm", "Norm", "... H", _eps, _xh, _w),
        _op("rmsnorm_offset", "rmsnormOffset", "Norm", "... H", _eps, _xh, _w),
        _op("rmsnorm_unit", "rmsnormUnit", "Norm", "... H", _eps, _xh),
        _op("rmsnorm_gated", "rmsnormGated", "Norm", "... H", _eps, _xh, Arg("z", "float", "... H"), _w),
        _op("l2norm", "l2norm", "Norm", "... H", _eps, _xh),
        # Rope
        _op("inv_freq", "invFreq", "Rope", "...",
            Arg("theta", "real"), Arg("denom", "nat"), Arg("active", "nat"), Arg("i", "index", "...")),
        _op("rope", "rope", "Rope", "... D",
            Arg("theta", "real"), Arg("rot", "nat"), Arg("denom", "nat"), Arg("active", "nat"),
            Arg("pos", "index", "..."), Arg("x", "float", "... D")),
        _op("rope_std", "ropeStd", "Rope", "... D",
            Arg("theta", "real"), Arg("rot", "nat"), Arg("pos", "index", "..."), Arg("x", "float", "... D")),
        # Linear
        _op("linear", "linear", "Linear", "... N", Arg("W", "float", "N K"), Arg("x", "float", "... K")),
        _op("gate_up", "gateUp", "Linear", "... 2*I",
            Arg("Wg", "float", "I K"), Arg("Wu", "float", "I K"), Arg("x", "float", "... K")),
        _op("silu_mul", "siluMul", "Linear", "... I", Arg("gu", "float", "... 2*I")),
        _op("gelu_mul", "geluMul", "Linear", "... I", Arg("gu", "float", "... 2*I")),
        _op("residual", "residual", "Linear", "... H", Arg("r", "real"), _xh, Arg("h", "float", "... H")),
        _op("embed", "embed", "Linear", "T H", Arg("c", "real"), Arg("E", "float", "V H"), Arg("tokens", "index", "T")),
        _op("lm_head", "lmHead", "Linear", "... V",
            Arg("mul", "real"), Arg("cap", "cap"), Arg("W", "float", "V H"), _xh),
        # Attention
        _op("softmax", "softmax", "Attention", "... L", Arg("s", "float", "... L"), Arg("visible", "mask", "... L")),
        _op("causal_gqa", "causalGQA", "Attention", "S Hkv G D",
            Arg("scale", "real"), Arg("pos", "index", "S"), Arg("q", "float", "S Hkv G D"),
            Arg("k", "float", "L Hkv D"), Arg("v", "float", "L Hkv D")),
        _op("sliding_gqa", "slidingGQA", "Attention", "S Hkv G D",
            Arg("scale", "real"), Arg("window", "nat"), Arg("pos", "index", "S"), Arg("q", "float", "S Hkv G D"),
            Arg("k", "float", "L Hkv D"), Arg("v", "float", "L Hkv D")),
        _op("decode_gqa", "decodeGQA", "Attention", "Hkv G D",
            Arg("scale", "real"), Arg("q", "float", "Hkv G D"), Arg("k", "float", "L Hkv D"), Arg("v", "float", "L Hkv D")),
        _op("sigmoid_gate", "sigmoidGate", "Attention", "... N", Arg("o", "float", "... N"), Arg("gate", "float", "... N")),
    )
}

OP_NAMES: tuple[str, ...] = tuple(CONTRACT)
