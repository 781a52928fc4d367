"""Candidate backends, and how the suite finds them.

An adapter is any object with:

* ``name``: a short string for reports;
* ``dtypes``: the dtype names it supports, a subset of ``float64``, ``float32``, ``bfloat16``,
  ``float16``;
* one method per op of ``spec.CONTRACT``, with the oracle's name and argument order.  Floating
  arrays arrive as numpy arrays in the dtype under test (``ml_dtypes.bfloat16`` for bf16), integer
  arrays as int64, masks as bool, scalars as Python numbers (``cap`` may be None); the method returns
  a numpy array of the same dtype and the contract's shape.  ``inv_freq`` has no floating input and
  also takes ``dtype=`` (the dtype name).

An op the adapter lacks is *unsupported*: the suite skips it and says so.  A module is a fine adapter
(see ``numpy_backend.py``).

``load(spec)`` resolves, in order: a built-in name (``numpy``, ``torch``, ``jax``); a name registered
by an installed package under the entry-point group ``gemma4_conformance.adapters``; or a module
path, optionally ``module:attribute``.  The object found may be the adapter itself, a class, or a factory, which
is called with no arguments.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from importlib.metadata import entry_points

from gemma4_conformance.spec import FORMATS

BUILTINS = {
    "numpy": "gemma4_conformance.adapters.numpy_backend",
    "torch": "gemma4_conformance.adapters.torch_backend",
    "jax": "gemma4_conformance.adapters.jax_backend",
}
ENTRY_POINT_GROUP = "gemma4_conformance.adapters"
DTYPES = ("float64", "float32", "bfloat16", "float16")


class AdapterError(Exception):
    """An adapter could not be found, imported or built, or does not meet the contract."""


def _resolve(spec: str):
    if spec in BUILTINS:
        return importlib.import_module(BUILTINS[spec])
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == spec]
    if found:
        return found[0].load()
    module_name, _, attribute = spec.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name.split(".")[0] and ":" in spec:
            raise
        known = sorted(BUILTINS) + sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
        raise AdapterError(f"unknown backend {spec!r}: not one of {known}, nor an importable "
                           f"module or module:attribute path ({e})") from None
    for part in filter(None, attribute.split(".")):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AdapterError(f"backend {spec!r}: module {module_name!r} has no attribute {attribute!r}") from None
    return obj


def load(spec: str):
    """The adapter named by ``spec`` (see the module docstring), checked for ``name`` and ``dtypes``."""
    try:
        obj = _resolve(spec)
    except AdapterError:
        raise
    except Exception as e:  # an import error inside the user's module is theirs, but name the backend
        raise AdapterError(f"backend {spec!r} could not be loaded: {type(e).__name__}: {e}") from e
    if inspect.isclass(obj) or (callable(obj) and not inspect.ismodule(obj) and not hasattr(obj, "dtypes")):
        try:
            obj = obj()
        except Exception as e:
            raise AdapterError(f"backend {spec!r}: building the adapter failed: {type(e).__name__}: {e}") from e
    for attribute in ("name", "dtypes"):
        if not hasattr(obj, attribute):
            raise AdapterError(f"backend {spec!r} has no {attribute!r} attribute, which every adapter needs")
    unknown = set(obj.dtypes) - set(DTYPES)
    if unknown:
        raise AdapterError(f"backend {spec!r} declares unknown dtypes {sorted(unknown)}; known: {list(DTYPES)}")
    return obj


def available_builtins() -> list[str]:
    """The built-in backends whose library is installed (what ``--backend=all`` runs)."""
    return [name for name in BUILTINS if importlib.util.find_spec(name) is not None]


assert set(DTYPES) == set(FORMATS)
