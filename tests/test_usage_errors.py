"""Every option and file a user gives is checked before any test runs: a malformed one is one message
naming it, exit 4 (pytest's usage error), and never a traceback.

Hypothesis draws malformed values for each option and file. Each is run as the suite would be, from a
folder outside this checkout; to keep that fast, one long-lived Python process runs them all
(``serve``: pytest.main per command line, the suite imported once).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import traceback
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from gemma4_conformance.adapters import DTYPES, available_builtins
from gemma4_conformance.checkpoints import generate
from gemma4_conformance.properties.relations import _rope_pairs
from gemma4_conformance.properties.table import build
from gemma4_conformance.spec import OP_NAMES

ROOT = Path(__file__).resolve().parent.parent
BASE = ["-p", "gemma4_conformance.plugin", "--pyargs", "gemma4_conformance", "-p", "no:cacheprovider",
        "--backend=numpy", "--ops=sigmoid", "--report-html="]
# Deselects every test, so that a bad value accepted ends the run at once, with exit 5 rather than 4.
NOTHING = "no_test_has_this_name"


def serve() -> None:
    """Read JSON argument lists from stdin, one a line; run pytest on each; answer {rc, out} a line."""
    for line in sys.stdin:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                rc = int(pytest.main(json.loads(line)))
            except BaseException as e:  # noqa: BLE001 - what escaped pytest is what the user would see
                traceback.print_exc()
                rc = -1 if not isinstance(e, SystemExit) else e.code
        sys.__stdout__.write(json.dumps({"rc": rc, "out": out.getvalue()}) + "\n")
        sys.__stdout__.flush()


@contextlib.contextmanager
def server(cwd: Path):
    """A process running ``serve`` in ``cwd``: yields run(argument list) -> (exit status, output)."""
    process = subprocess.Popen([sys.executable, "-c", "from tests.test_usage_errors import serve; serve()"],
                               cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})

    def run(args: list[str]) -> tuple[int, str]:
        process.stdin.write(json.dumps(args) + "\n")
        process.stdin.flush()
        answer = json.loads(process.stdout.readline())
        return answer["rc"], answer["out"]

    try:
        yield run
    finally:
        process.stdin.close()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    with server(tmp_path_factory.mktemp("usage")) as run_args:
        yield lambda *args, select=NOTHING: run_args([*BASE, *args, "-k", select])


def assert_usage_error(rc: int, out: str, *named: str) -> None:
    assert rc == 4, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("ERROR: ")]
    assert len(errors) == 1, out[-3000:]  # one message
    assert all(name in errors[0] for name in named), (named, errors[0])


FUZZ = settings(max_examples=6, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
words = st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), min_size=1, max_size=12)


def test_the_runner_tells_a_good_command_from_a_bad_one(run):
    """The checks below can fail: a valid command is no usage error, and a test that runs is seen."""
    rc, out = run()
    assert rc == 5 and "ERROR" not in out, out[-3000:]  # every test deselected, no usage error
    rc, out = run("--dtype=float32", select="test_matches_oracle")
    assert rc == 0 and "1 passed" in out, out[-3000:]


@FUZZ
@given(st.one_of(
    words.filter(lambda s: not _is_json(s)),  # not JSON
    st.one_of(st.none(), st.booleans(), st.integers(), st.lists(st.integers(), max_size=2), words).map(json.dumps),
    st.dictionaries(words, st.integers() | words, min_size=1, max_size=3).map(json.dumps),  # an object of another kind
    st.fixed_dictionaries({"args": st.dictionaries(words, st.integers() | words, max_size=2)}).map(json.dumps),
))
def test_a_malformed_case(run, case):
    # The case is checked against the tests selected: the agreement test of sigmoid in float32.
    assert_usage_error(*run(f"--case={case}", select="test_matches_oracle and float32"), "--case")


@pytest.mark.parametrize("case, select, expected", [
    ('{"sequences": []}', "test_serving_matches_reference and float32", "a serving schedule"),
    ('{"args": {"x": [1.0]}}', "test_relation_holds and rope_at_zero", "a case of rope"),
    ('{"args": {"x": {"shape": [2], "kind": "normal"}}}', "test_matches_oracle and float32", "a case of sigmoid"),
])
def test_a_case_of_another_test(run, case, select, expected):
    assert_usage_error(*run(f"--case={case}", "--ops=sigmoid,rope", select=select), "--case", expected)


def test_a_theorems_case_without_the_key_the_theorem_reads(run):
    """A case of RoPE fits rope's agreement test, but the theorem of relative positions also reads its shift."""
    # Two rows of x at least: the theorem relates the first two (a query and a key), and has nothing to check in one.
    case = find(_rope_pairs("float32"), lambda c: build("rope", c, "float32")[5].shape[0] >= 2,
                settings=settings(database=None))
    select = "test_relation_holds and float32 and rope_depends_on_relative_position"
    rc, out = run(f"--case={json.dumps(case)}", "--ops=rope", select=select)
    assert rc == 0, out[-3000:]  # as a failure prints it: it runs
    del case["shift"]
    assert_usage_error(*run(f"--case={json.dumps(case)}", "--ops=rope", select=select), "--case", "KeyError: 'shift'")


def _is_json(s: str) -> bool:
    try:
        json.loads(s)
    except ValueError:
        return False
    return True


@FUZZ
@given(st.one_of(
    words.filter(lambda s: s.strip() and s.strip() not in (*available_builtins(), "all") and "," not in s),
    st.sampled_from(["", ",", "torch[", "numpy]", "[", "torch[tf32=on", "numpy,torch[,"]),  # no name, or unbalanced
))
def test_an_unknown_backend(run, name):
    assert_usage_error(*run(f"--backend={name}"), "--backend")


@FUZZ
@given(words.filter(lambda s: s.strip() not in ("ci", "default", "thorough", "ci-unshrunk")))
def test_an_unknown_hypothesis_profile(run, profile):
    assert_usage_error(*run(f"--hypothesis-profile={profile}"), "--hypothesis-profile")


@FUZZ
@given(st.lists(words.filter(lambda s: s.strip() not in DTYPES), min_size=1, max_size=2).map(",".join))
def test_an_unknown_dtype(run, dtypes):
    assert_usage_error(*run(f"--dtype={dtypes}"), "--dtype")


@FUZZ
@given(st.lists(words.filter(lambda s: s.strip() not in OP_NAMES), min_size=1, max_size=2).map(",".join))
def test_an_unknown_op(run, ops):
    assert_usage_error(*run(f"--ops={ops}"), "--ops")


def _config_bytes():
    """A config.json that is not a Gemma 4 text config: bytes that are not UTF-8 or not JSON, JSON
    that is not an object, or an object without the model's fields."""
    return st.one_of(
        st.binary(min_size=1, max_size=40).filter(lambda b: not _is_json_bytes(b)),
        st.one_of(st.none(), st.integers(), st.lists(st.integers(), max_size=2)).map(lambda v: json.dumps(v).encode()),
        st.dictionaries(words, st.integers() | words, max_size=3).map(lambda v: json.dumps(v).encode()),
        st.just(b'{"vocab_size": 10, "hidden_size": "\xff"}'),
    )


def _is_json_bytes(b: bytes) -> bool:
    try:
        json.loads(b.decode("utf-8"))
    except ValueError:
        return False
    return True


@FUZZ
@given(_config_bytes())
def test_a_checkpoint_whose_config_is_malformed(run, tmp_path_factory, config):
    folder = tmp_path_factory.mktemp("weights")
    (folder / "config.json").write_bytes(config)
    assert_usage_error(*run(f"--weights={folder}"), "--weights", str(folder / "config.json"))


def test_weights_that_are_not_a_checkpoint_folder(run, tmp_path):
    assert_usage_error(*run(f"--weights={tmp_path / 'missing'}"), "--weights", str(tmp_path / "missing"))
    assert_usage_error(*run(f"--weights={tmp_path}"), "--weights", str(tmp_path / "config.json"))
    (tmp_path / "file").write_text("{}")
    assert_usage_error(*run(f"--weights={tmp_path / 'file'}"), "--weights", str(tmp_path / "file"))


def test_weights_in_an_unknown_format(run, tmp_path):
    """A checkpoint whose metadata declares a weight format the suite does not know (q3_k for q8_0)."""
    folder = generate.write_checkpoint(tmp_path, generate.small_config(), weight_format="q8_0", shards=1)
    file = folder / "model.safetensors"
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    file.write_bytes(raw[:8] + raw[8:8 + n].replace(b"q8_0", b"q3_k", 1) + raw[8 + n:])
    assert_usage_error(*run(f"--weights={folder}"), "--weights", str(file), "unknown weight format 'q3_k'",
                       "the known formats are q8_0, q4_0, q4_k, q6_k")


@FUZZ
@given(st.one_of(
    st.binary(min_size=1, max_size=40),
    st.one_of(st.none(), st.integers(), words, st.lists(words, max_size=2)).map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"backend": words, "deviations": st.lists(
        st.dictionaries(st.sampled_from(["op", "dtype", "reason", "extra"]), words, max_size=3), min_size=1, max_size=2)})
    .map(lambda v: json.dumps(v).encode()),
))
def test_a_malformed_known_deviations_file(run, tmp_path_factory, content):
    path = tmp_path_factory.mktemp("deviations") / "deviations.yaml"
    path.write_bytes(content)
    rc, out = run(f"--known-deviations={path}")
    if rc != 4 and "ERROR" not in out:  # some bytes are a valid file by chance (a backend and no entries)
        assert rc == 5, out[-3000:]
        return
    assert_usage_error(rc, out, "--known-deviations", str(path))


def test_a_known_deviations_name_that_is_not_shipped(run):
    assert_usage_error(*run("--known-deviations=no-such-engine"), "--known-deviations", "no-such-engine")


def test_a_report_path_that_is_a_folder(run, tmp_path):
    assert_usage_error(*run(f"--report-json={tmp_path}"), "--report-json", str(tmp_path))


def test_a_case_that_does_not_fit_under_xdist(run):
    """Workers collect the tests, so they find the misfit; the controller says it, once, and exits 4."""
    assert_usage_error(*run('--case={"x": 1}', "-n", "2", select="test_matches_oracle and float32"), "--case")
