"""Error budgets: tolerances.yaml, read and evaluated.

Each op's entry states its error model in words and a budget per dtype, in ULPs of the dtype counted
at the op's scale (see error_models.py).  A budget is an arithmetic formula of the contract's
dimension names (K, H, L, D, ...), of ``ratio`` (u_A / u_D: the unit roundoff of the accumulation
format over that of the dtype under test: 2^-16 for bfloat16, 2^-13 for float16, 1 for float32 and
float64, whose accumulation format is themselves), and of op-specific quantities the error model
names.  Where the formulas come from:

* the final rounding to the dtype costs at most 0.5 ULP of the result;
* every other rounding in the dtype D costs a relative u_D of an intermediate that the scale
  bounds, which is at most 1 ULP at the scale (u_D * s <= ulp_D(s));
* a rounding in the accumulation format costs ``ratio`` ULPs, and a sum of n terms in any order
  costs at most n of them (Higham's gamma_n bound, |error| <= n u_A sum |terms|);
* an elementary function (exp, tanh, pow, cos, sin, rsqrt) evaluated in the accumulation format
  costs ``fn`` = TAU * ratio ULPs (TAU of the accumulation format): vectorised libraries are not
  correctly rounded.
"""

from __future__ import annotations

import ast
import dataclasses
import operator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

from gemma4_conformance.adapters import DECLARED_FORMATS, DTYPES
from gemma4_conformance.spec import CONTRACT, format_of

TOLERANCES_PATH = Path(__file__).with_name("tolerances.yaml")

# The accumulation format of a correct implementation: float32 for the narrow dtypes.
ACCUMULATION = {"float64": "float64", "float32": "float32", "bfloat16": "float32", "float16": "float32"}

# ULPs of its own format that one elementary function (exp, tanh, sin, cos, pow, rsqrt) may err by,
# per accumulation format: above what numpy's, torch's, XLA's and glibc's measure (docs/measurements.md).
TAU = {"float32": 6, "float64": 8}


def tau(dtype: str) -> float:
    """TAU of the dtype's accumulation format, where the model evaluates its elementary functions."""
    return TAU[ACCUMULATION[dtype]]

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(node: ast.AST, names: dict[str, float]) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, names)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return float(node.value)
    if isinstance(node, ast.Name):
        if node.id not in names:
            raise KeyError(node.id)
        return float(names[node.id])
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_evaluate(node.left, names), _evaluate(node.right, names))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "max":
        return max(_evaluate(a, names) for a in node.args)
    raise ValueError(f"unsupported syntax {ast.dump(node)}")


@cache
def _parsed(formula: str) -> ast.Expression:
    """A budget's formula as a syntax tree, parsed once: a run evaluates each thousands of times."""
    return ast.parse(formula, mode="eval")


@dataclass(frozen=True)
class Budget:
    op: str
    dtype: str
    formula: str
    model: str
    # The second tier, where the worst case is not what engines do (attention): a budget of its own
    # model, and how many times the plain same-dtype arrangements' error a candidate may add to it.
    tier2: Budget | None = None
    factor: float = 0.0
    # Declared roundings (an adapter's ``formats``): key -> the model of the term it adds
    declared: dict[str, str] = dataclasses.field(default_factory=dict)

    def ulps(self, **quantities: float) -> float:
        """The budget in ULPs at the scale, for an example's dimensions and quantities."""
        ratio = accumulation_ratio(self.dtype)
        names = {"ratio": ratio, "fn": tau(self.dtype) * ratio, **quantities}
        try:
            return _evaluate(_parsed(self.formula), names)
        except KeyError as e:
            raise KeyError(f"tolerances.yaml: budget of {self.op}/{self.dtype} uses {e}, "
                           f"which this example does not define (has {sorted(names)})") from None


def accumulation_ratio(dtype: str) -> float:
    return format_of(ACCUMULATION[dtype]).eps / format_of(dtype).eps


@cache
def load_budgets(path: Path = TOLERANCES_PATH) -> dict[tuple[str, str], Budget]:
    """Every (op, dtype) budget, checked: every op of the contract, every dtype, formulas that parse."""
    table = yaml.safe_load(path.read_text())
    budgets = {}
    missing = set(CONTRACT) - set(table)
    if missing:
        raise ValueError(f"{path.name}: no budget for ops {sorted(missing)}")
    for op, entry in table.items():
        if op not in CONTRACT:
            raise ValueError(f"{path.name}: {op!r} is not an op of the contract")
        tier2 = entry.get("tier2")
        if tier2 is not None and not isinstance(tier2.get("factor"), (int, float)):
            raise ValueError(f"{path.name}: {op}.tier2 has no numeric 'factor'")
        for dtype in DTYPES:
            second = _budget(path, f"{op}.tier2", op, dtype, tier2) if tier2 is not None else None
            budgets[op, dtype] = dataclasses.replace(_budget(path, op, op, dtype, entry), tier2=second,
                                                     factor=float(tier2["factor"]) if tier2 else 0.0)
    return budgets


def _budget(path: Path, where: str, op: str, dtype: str, entry: dict) -> Budget:
    for key in ("model", "budget"):
        if key not in entry:
            raise ValueError(f"{path.name}: {where} has no {key!r}")
    formula = str(entry["budget"].get(dtype, entry["budget"].get("all", "")))
    if not formula:
        raise ValueError(f"{path.name}: {where} has no budget for {dtype}")
    ast.parse(formula, mode="eval")
    declared = entry.get("declared", {})
    if not isinstance(declared, dict) or set(declared) - set(DECLARED_FORMATS):
        raise ValueError(f"{path.name}: {where}.declared maps keys among {', '.join(DECLARED_FORMATS)} to models")
    return Budget(op, dtype, formula, " ".join(entry["model"].split()),
                  declared={key: " ".join(str(model).split()) for key, model in declared.items()})


def budget(op: str, dtype: str) -> Budget:
    return load_budgets(TOLERANCES_PATH)[op, dtype]
