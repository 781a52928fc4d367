"""The engines' conformance table (gemma4_conformance/engines.py): a row per engine and dtype from the reports."""

from __future__ import annotations

import importlib.util

from gemma4_conformance import engines
from tests.test_report import make_document


def test_the_table_has_a_row_per_engine_and_dtype_with_each_verdict():
    table = engines.rows([make_document("someengine")], {"someengine": "someengine 1.0"})
    by_dtype = {r["dtype"]: r for r in table}
    assert list(by_dtype) == ["float32", "bfloat16"] and {r["engine"] for r in table} == {"someengine"}
    fp32, bf16 = by_dtype["float32"], by_dtype["bfloat16"]
    assert fp32["ops"] == "2/4, failed: sigmoid, known deviation: softcap" and fp32["theorems"] == "0/1"
    assert fp32["forward"].startswith("failed (logits 1e+02 x baseline)") and fp32["trace"] == "no trace"
    assert fp32["broke"] == 1 and bf16["broke"] == 0  # the float32 sigmoid test broke
    assert bf16["trace"] == "failed: first layers.0.q_norm (rmsnorm) 6.2 > 1.5 ULPs"
    assert bf16["forward"] == "passed (logits 1.2 x baseline)" and bf16["version"] == "someengine 1.0"
    lines = engines.markdown(table).splitlines()
    assert lines[0].startswith("| engine | version | dtype |") and len(lines) == 2 + len(table)


def test_only_registered_and_installed_engines_are_run():
    found = engines.installed()
    assert set(found) <= set(engines.ENGINES)
    assert ("transformers" in found) == (importlib.util.find_spec("transformers") is not None)
