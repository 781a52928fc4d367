"""The commands the README and the docs show are checked, so that they cannot rot.

Every command of every ```bash block in README.md and docs/*.md (continuation lines joined, `&&`
chains split, each with its comment) is checked by what it runs:

* ``pytest ...``: collected, not run (``--collect-only``), from the repository root: its options
  must exist and its backends, dtypes, ops, devices and files be valid, or pytest's usage error fails
  it. A backend or device this machine lacks (an engine not installed, no GPU) is the one usage error
  allowed, as the command is right where they are.
* ``python -m MODULE ...`` and scripts: each ``--option`` the line names, its comment included, must
  be in the program's ``--help``.
* ``pip install``: each extra it names must be one of pyproject.toml's.

The CI recipe's block is left to tests/test_ci_recipe.py, which runs it in a fresh environment.
Setting up an environment (``python3 -m venv``, ``. activate``, ``pip uninstall``) is not checked.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from gemma4_conformance.report import schema
from gemma4_conformance.spec import CONTRACT, OP_NAMES
from tests.test_usage_errors import server

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CI_RECIPE = "<!-- ci-recipe"
SCHEMA_START, SCHEMA_END = "<!-- schema: generated", "<!-- end schema -->"  # docs/report.md's generated part
SETUP = ("python3 -m venv", ". ", "pip uninstall")
# The usage errors of a command that is right on a machine with that engine or device.
ELSEWHERE = re.compile(r"which is not installed here|sees 0 \w+ devices|JAX sees 0")


def commands() -> list[tuple[str, str]]:
    """(where, command line with its comment) of every command in a bash block outside the CI recipe."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for block in re.finditer(r"```bash\n(.*?)```", text, re.DOTALL):
            if text[:block.start()].rstrip().rsplit("\n", 1)[-1].startswith(CI_RECIPE):
                continue
            for line in block.group(1).replace("\\\n", " ").splitlines():
                for command in line.split(" && "):
                    if command.strip():
                        found.append((f"{page.relative_to(ROOT)}: {command.strip()[:60]}", command.strip()))
    return found


COMMANDS = commands()


def split(command: str) -> tuple[list[str], str]:
    """The command's words and its comment."""
    words = shlex.split(command, comments=True)
    comment = command.split(" #", 1)[1] if " #" in command else ""
    return words, comment


def test_the_pages_show_commands_of_every_kind():
    kinds = {split(c)[0][0] for _, c in COMMANDS}
    assert {"pytest", "python", "pip"} <= kinds, kinds
    assert len(COMMANDS) > 15


@pytest.fixture(scope="module")
def collect():
    with server(ROOT) as run:
        yield run


@pytest.mark.parametrize("where, command", [c for c in COMMANDS if split(c[1])[0][0] == "pytest"],
                         ids=[w for w, c in COMMANDS if split(c)[0][0] == "pytest"])
def test_a_pytest_command_collects(collect, where, command):
    words, _ = split(command)
    rc, out = collect([*words[1:], "--collect-only", "-q", "-p", "no:cacheprovider"])
    if rc == 4 and ELSEWHERE.search(out):
        return
    assert rc == 0 and "Traceback" not in out, f"{where}\n{out[-3000:]}"


@pytest.mark.parametrize("where, command", [c for c in COMMANDS if split(c[1])[0][0] not in ("pytest", "pip")
                                            and not c[1].startswith(SETUP)],
                         ids=[w for w, c in COMMANDS if split(c)[0][0] not in ("pytest", "pip")
                              and not c.startswith(SETUP)])
def test_a_programs_options_are_in_its_help(where, command):
    words, comment = split(command)
    program = words[:3] if words[:2] == ["python", "-m"] else words[:1]
    assert program != words[:1] or (ROOT / words[0]).is_file(), f"{where}: an unknown kind of command"
    done = subprocess.run([*([sys.executable] + program[1:] if program[0] == "python" else program), "--help"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", " ".join(words[len(program):]) + " " + comment))
    assert named, f"{where}: no option to check"
    missing = sorted(o for o in named if o not in done.stdout)
    assert not missing, f"{where}: {missing} not in its --help"


EXTRAS = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


@pytest.mark.parametrize("where, command", [c for c in COMMANDS if c[1].startswith("pip install")],
                         ids=[w for w, c in COMMANDS if c.startswith("pip install")])
def test_a_pip_install_names_existing_extras(where, command):
    words, _ = split(command)
    assert "-e" in words or any(w.startswith("gemma4-conformance") for w in words), where
    named = {e for w in words for group in re.findall(r"\.\[([^]]*)\]", w) for e in group.split(",")}
    assert named <= EXTRAS, f"{where}: unknown extras {sorted(named - EXTRAS)}"


def test_the_readme_shows_the_commands_ci_runs():
    """The README's install and its command for the project's own tests are .ci/run's."""
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    own_tests = next(line for line in ci.splitlines() if line.startswith("pytest tests "))
    assert f"```bash\n{own_tests}\n```" in readme
    assert 'pip install --quiet -e ".[all]"' in ci and 'pip install -e ".[all]"' in readme
    assert re.search(r"^mkdocs build --strict\b", ci, re.MULTILINE)


def test_the_readmes_list_of_ops_is_the_contracts():
    listed = re.findall(r"`(\w+)\(([\w, ]*)\)`", (ROOT / "README.md").read_text())
    assert listed == [(op, ", ".join(a.name for a in CONTRACT[op].args)) for op in OP_NAMES]


def test_the_report_pages_schema_is_generated_from_the_schemas_fields():
    text = (ROOT / "docs" / "report.md").read_text(encoding="utf-8")
    start = text.index("\n", text.index(SCHEMA_START)) + 1
    assert text[start:text.index(SCHEMA_END)] == schema.markdown(), (
        "docs/report.md's schema is stale: replace the text between its schema markers with the output of "
        "python -c 'from gemma4_conformance.report.schema import markdown; print(markdown(), end=\"\")'")
