"""One row per op: what the suite knows about an op lives in its entry in properties/table.py.

The composition, the judging, the report, the plugin, the adapter contract and the enclosures read an
entry's fields (or the contract's); none of them asks which op it holds
by comparing its name with a literal one (``op == "gate_up"``, ``op in ("causal_gqa", "sliding_gqa")``)
or with a module's tuple of such names.
"""

from __future__ import annotations

import ast
from pathlib import Path

from gemma4_conformance.spec import OP_NAMES

PACKAGE = Path(__file__).resolve().parent.parent / "gemma4_conformance"
# Everything above the adapters (which implement ops by name), and the adapter contract and the enclosures.
CHECKED = [*sorted((PACKAGE / "properties").glob("*.py")), *sorted((PACKAGE / "composition").glob("*.py")),
           *sorted((PACKAGE / "report").glob("*.py")), PACKAGE / "plugin.py", PACKAGE / "judge.py",
           PACKAGE / "engines.py", PACKAGE / "adapters" / "contract.py", PACKAGE / "spec" / "enclosures.py"]
TABLE = PACKAGE / "properties" / "table.py"
# Comparisons with an op's name that are not about an op: a trace node named like the op it runs.
NOT_AN_OP = {("trace.py", 'self.node == "embed"'), ("html.py", 'n["node"] == "embed"'), ("html.py", 'where == "embed"')}


def _names_ops(node, constants) -> bool:
    """Whether ``node`` is an op's name as a literal, a display of them, or a module constant holding them."""
    if isinstance(node, ast.Constant):
        return node.value in OP_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_ops(e, constants) for e in node.elts)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("frozenset", "set", "tuple"):
        return any(_names_ops(a, constants) for a in node.args)
    return isinstance(node, ast.Name) and node.id in constants


def op_name_branches(path: Path) -> list[str]:
    """``file:line: source`` of every comparison of something with an op's literal name in ``path``."""
    text = path.read_text()
    tree = ast.parse(text, str(path))
    where = path.relative_to(PACKAGE.parent) if path.is_relative_to(PACKAGE.parent) else path
    constants = set()
    for statement in tree.body:  # module constants that hold op names, such as ATTENTION = ("causal_gqa", ...)
        if isinstance(statement, ast.Assign) and _names_ops(statement.value, set()):
            constants |= {t.id for t in statement.targets if isinstance(t, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare) or not any(isinstance(o, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                        for o in node.ops):
            continue
        source = ast.get_source_segment(text, node)
        if any(_names_ops(side, constants) for side in (node.left, *node.comparators)) and \
                (path.name, source) not in NOT_AN_OP:
            found.append(f"{where}:{node.lineno}: {source}")
    return found


def test_no_op_name_branch_outside_the_table():
    found = [branch for path in CHECKED if path != TABLE for branch in op_name_branches(path)]
    assert not found, "op-specific code belongs in the op's entry (properties/table.py):\n" + "\n".join(found)


def test_the_check_finds_a_branch(tmp_path):
    module = tmp_path / "module.py"
    module.write_text('PAIR = ("linear", "gate_up")\n\ndef f(op, name):\n    if op == "gate_up":\n        pass\n'
                      '    return name in PAIR or op != "softmax_of_nothing"\n')
    assert [b.split(": ", 1)[1] for b in op_name_branches(module)] == ['op == "gate_up"', "name in PAIR"]
