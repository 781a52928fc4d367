"""Parametrisation of the property tests over backend x dtype x (op or relation)."""

from __future__ import annotations

import pytest

from conftest import backend_dtypes
from properties.relations import RELATIONS
from spec import OP_NAMES


def pytest_generate_tests(metafunc):
    if "op" in metafunc.fixturenames and "backend" in metafunc.fixturenames:
        params = [pytest.param(spec, adapter, dtype, op, id=f"{adapter.name}-{dtype}-{op}")
                  for spec, adapter, dtype in backend_dtypes(metafunc.config) for op in OP_NAMES]
        metafunc.parametrize("backend, adapter, dtype, op", params)
    elif "relation" in metafunc.fixturenames:
        params = [pytest.param(spec, adapter, dtype, name, id=f"{adapter.name}-{dtype}-{name}")
                  for spec, adapter, dtype in backend_dtypes(metafunc.config) for name in RELATIONS]
        metafunc.parametrize("backend, adapter, dtype, relation", params)
    elif "adapter" in metafunc.fixturenames:
        params = [pytest.param(spec, adapter, id=adapter.name)
                  for spec, adapter in metafunc.config.conformance_backends.items()]
        metafunc.parametrize("backend, adapter", params)
