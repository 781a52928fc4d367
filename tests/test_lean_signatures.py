"""Every oracle, contract entry and enclosure has the name and argument order of the Lean definition
it transcribes, read from the Lean specs that ship with the suite (``gemma4_conformance/spec/lean``),
as array-api-tests derives its signatures from the standard's stubs.

The rule, once for every op: a Lean ``def``'s explicit binders ``(a b : T)`` are the Python
arguments, in order; its implicit ``{S L : ℕ}``, strict-implicit ``⦃…⦄`` and instance ``[…]``
binders are not passed (Lean infers them: the dimensions from the arrays' shapes, decidability of a
mask from the mask).  The Python name is the Lean name in snake_case.

The parser is a few lines of bracket matching over the one form these files use (``def name binders*
: type :=``), not a library: no Lean parser on PyPI is worth a dependency for that (the real one is
Lean itself, which the suite does not need to run).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from importlib.resources import files
from pathlib import Path

import pytest

from gemma4_conformance.spec import CONTRACT, ORACLES, enclosures

LEAN = Path(str(files("gemma4_conformance.spec") / "lean"))
SHARED_LEAN = Path("/work/shared/lean")  # where the specs come from, on the machines that have it
SHARED_FACTS = Path("/work/shared/gemma-4-12B.md")

# The one unavoidable exception: the specs import a Basic module that is not available (the facts
# page, gemma-4-12B.md, gives its definitions as equations: ``test_basic_matches_the_facts_page``).
NOT_IN_LEAN_FILES = {"Basic"}


@dataclasses.dataclass(frozen=True)
class LeanDef:
    name: str  # as Lean spells it
    module: str  # the file's stem
    explicit: tuple[str, ...]  # the explicit binders' names, in order


_CLOSERS = {"(": ")", "{": "}", "[": "]", "⦃": "⦄"}


def _strip_comments(text: str) -> str:
    """Lean without its comments: ``-- …`` to the end of the line, ``/- … -/`` (nesting, docstrings too)."""
    out, depth, i = [], 0, 0
    while i < len(text):
        if text.startswith("/-", i):
            depth, i = depth + 1, i + 2
        elif depth and text.startswith("-/", i):
            depth, i = depth - 1, i + 2
        elif depth:
            i += 1
        elif text.startswith("--", i):
            i = text.find("\n", i) if "\n" in text[i:] else len(text)
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _binders(text: str, i: int) -> tuple[list[tuple[str, str]], int]:
    """The binders from ``text[i]`` on, as (opener, content), up to the ``:`` of the type or ``:=``."""
    binders = []
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text) or text[i] not in _CLOSERS:
            return binders, i
        opener, depth, start = text[i], 0, i
        while True:  # to the matching closer, over any brackets nested in the binder's type
            if text[i] in _CLOSERS:
                depth += 1
            elif text[i] in _CLOSERS.values():
                depth -= 1
                if depth == 0:
                    break
            i += 1
        binders.append((opener, text[start + 1:i]))
        i += 1


def _names(content: str) -> tuple[str, ...]:
    """The names a ``(a b : T)`` binder introduces."""
    return tuple(content.split(":", 1)[0].split())


def parse_lean(text: str, module: str) -> list[LeanDef]:
    """The ``def``s of one Lean file.  A ``variable`` with an explicit binder would add an argument to
    the defs that use it, which this parser does not track: such a file is rejected, not misread."""
    text = _strip_comments(text)
    for match in re.finditer(r"\bvariable\b", text):
        explicit = [content for opener, content in _binders(text, match.end())[0] if opener == "("]
        if explicit:
            raise ValueError(f"{module}.lean: an explicit section variable ({explicit[0]}) is not supported")
    defs = []
    for match in re.finditer(r"\bdef\s+([^\s({\[⦃:]+)", text):
        binders, _ = _binders(text, match.end())
        explicit = tuple(name for opener, content in binders if opener == "(" for name in _names(content))
        defs.append(LeanDef(match.group(1).rsplit(".", 1)[-1], module, explicit))
    return defs


def lean_defs(folder: Path = LEAN) -> dict[str, LeanDef]:
    """Every definition of the Lean files in ``folder``, by Lean name."""
    return {d.name: d for path in sorted(folder.glob("*.lean")) for d in parse_lean(path.read_text(), path.stem)}


def snake_case(lean_name: str) -> str:
    """causalGQA -> causal_gqa, rmsnormOffset -> rmsnorm_offset."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", lean_name).lower()


def positional(fn) -> tuple[str, ...]:
    """The names of ``fn``'s positional parameters (an enclosure's keyword-only ``work`` apart)."""
    return tuple(p.name for p in inspect.signature(fn).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def signature_mismatches(defs: dict[str, LeanDef], contract=CONTRACT, oracles=ORACLES,
                         enclosed=enclosures.ENCLOSURES) -> list[str]:
    """Where the contract, the oracles or the enclosures differ from the Lean definitions: one line each,
    naming the op and both argument lists."""
    problems = []
    by_python_name = {snake_case(name): d for name, d in defs.items()}
    for name in sorted(set(by_python_name) - set(contract)):
        problems.append(f"{name}: the Lean {by_python_name[name].name} ({by_python_name[name].module}.lean) "
                        f"has no contract entry")
    for name, entry in contract.items():
        if entry.module in NOT_IN_LEAN_FILES:
            continue
        lean = by_python_name.get(name)
        if lean is None:
            problems.append(f"{name}: no Lean definition {entry.lean} in the Lean files")
            continue
        if (entry.lean, entry.module) != (lean.name, lean.module):
            problems.append(f"{name}: the contract names the Lean {entry.module}.{entry.lean}, "
                            f"the definition is {lean.module}.{lean.name}")
        want = lean.explicit
        found = {"the contract": entry.arg_names}
        if name not in oracles:
            problems.append(f"{name}: no oracle")
        else:
            found["the oracle"] = positional(oracles[name])
            if oracles[name].__name__ != name:
                problems.append(f"{name}: the oracle is named {oracles[name].__name__}")
        if name in enclosed:
            found["the enclosure"] = positional(enclosed[name])
        for what, got in found.items():
            if got != want:
                problems.append(f"{name}: {what} takes ({', '.join(got)}), the Lean {lean.name} takes "
                                f"({', '.join(want)})")
    return problems


def test_lean_files_ship_with_the_package():
    assert sorted(p.name for p in LEAN.glob("*.lean")) == ["Attention.lean", "Linear.lean", "Norm.lean", "Rope.lean"]


def test_every_op_has_the_lean_signature():
    defs = lean_defs()
    assert len(defs) == len([n for n, c in CONTRACT.items() if c.module not in NOT_IN_LEAN_FILES])
    assert signature_mismatches(defs) == []


def test_the_rule_drops_implicit_and_instance_binders():
    """softmax's ``{L}`` and ``[DecidablePred visible]``, causalGQA's five dimensions: not arguments."""
    defs = lean_defs()
    assert defs["softmax"].explicit == ("s", "visible")
    assert defs["causalGQA"].explicit == ("scale", "pos", "q", "k", "v")
    assert defs["invFreq"].explicit == ("theta", "denom", "active", "i")


def _swapped(fn, a: str, b: str):
    """A stand-in for ``fn`` whose parameters ``a`` and ``b`` trade places."""
    parameters = list(inspect.signature(fn).parameters.values())
    i, j = (next(k for k, p in enumerate(parameters) if p.name == n) for n in (a, b))
    parameters[i], parameters[j] = parameters[j], parameters[i]

    def stand_in(*args, **kwargs):
        raise AssertionError("never called")

    stand_in.__name__ = fn.__name__
    stand_in.__signature__ = inspect.Signature(parameters)
    return stand_in


def test_a_swapped_oracle_argument_is_reported():
    oracles = {**ORACLES, "rmsnorm": _swapped(ORACLES["rmsnorm"], "x", "w")}
    assert signature_mismatches(lean_defs(), oracles=oracles) == [
        "rmsnorm: the oracle takes (eps, w, x), the Lean rmsnorm takes (eps, x, w)"]


def test_a_swapped_contract_argument_is_reported():
    entry = CONTRACT["rope"]
    args = list(entry.args)
    args[2], args[3] = args[3], args[2]  # denom and active
    contract = {**CONTRACT, "rope": dataclasses.replace(entry, args=tuple(args))}
    assert signature_mismatches(lean_defs(), contract=contract) == [
        "rope: the contract takes (theta, rot, active, denom, pos, x), the Lean rope takes "
        "(theta, rot, denom, active, pos, x)"]


def test_a_swapped_enclosure_argument_is_reported():
    enclosed = {**enclosures.ENCLOSURES, "causal_gqa": _swapped(enclosures.causal_gqa, "k", "v")}
    assert signature_mismatches(lean_defs(), enclosed=enclosed) == [
        "causal_gqa: the enclosure takes (scale, pos, q, v, k), the Lean causalGQA takes (scale, pos, q, k, v)"]


def test_a_swapped_lean_argument_is_reported(tmp_path):
    """The other way round: the Lean text changes (an edit of the spec), the Python does not."""
    for path in LEAN.glob("*.lean"):
        (tmp_path / path.name).write_text(path.read_text())
    norm = tmp_path / "Norm.lean"
    norm.write_text(norm.read_text().replace("def l2norm (eps : ℝ) (x : ι → Fin H → ℝ)",
                                             "def l2norm (x : ι → Fin H → ℝ) (eps : ℝ)"))
    problems = signature_mismatches(lean_defs(tmp_path))
    assert problems and all(p.startswith("l2norm: ") and "takes (eps, x), the Lean l2norm takes (x, eps)" in p
                            for p in problems), problems


def test_a_lean_definition_without_an_op_is_reported(tmp_path):
    (tmp_path / "Extra.lean").write_text("noncomputable def fooBar {N : ℕ} (a : ℝ) (x : Fin N → ℝ) : ℝ := a\n")
    assert signature_mismatches(lean_defs(tmp_path))[0] == \
        "foo_bar: the Lean fooBar (Extra.lean) has no contract entry"


def test_an_explicit_section_variable_is_rejected():
    with pytest.raises(ValueError, match="explicit section variable"):
        parse_lean("variable (eps : ℝ)\nnoncomputable def f (x : ℝ) : ℝ := x\n", "Toy")


@pytest.mark.skipif(not SHARED_LEAN.is_dir(), reason=f"{SHARED_LEAN} (the specs' source) is not on this machine")
def test_shipped_specs_equal_their_source():
    shipped = {p.name: p.read_bytes() for p in LEAN.glob("*.lean")}
    source = {p.name: p.read_bytes() for p in SHARED_LEAN.glob("*.lean")}
    assert shipped == source, f"gemma4_conformance/spec/lean differs from {SHARED_LEAN}: copy it again"


@pytest.mark.skipif(not SHARED_FACTS.is_file(), reason=f"{SHARED_FACTS} is not on this machine")
def test_basic_matches_the_facts_page():
    """Basic's ops, absent from the Lean files, against their equations ``- `name args = …` ``."""
    section = SHARED_FACTS.read_text().split("## Basic", 1)[1].split("\n## ", 1)[0]
    equations = dict(re.findall(r"^- `(\w+)((?: \w+)*) =", section, re.MULTILINE))
    basic = {name: entry for name, entry in CONTRACT.items() if entry.module in NOT_IN_LEAN_FILES}
    assert sorted(equations) == sorted(entry.lean for entry in basic.values())
    for name, entry in basic.items():
        want = tuple(equations[entry.lean].split())
        assert (snake_case(entry.lean), entry.arg_names, positional(ORACLES[name])) == (name, want, want)
        if name in enclosures.ENCLOSURES:
            assert positional(enclosures.ENCLOSURES[name]) == want
