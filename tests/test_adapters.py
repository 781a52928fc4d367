"""How the suite finds a backend: built-in names, module:attribute paths, and a factory's [options]."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from gemma4_conformance import adapters
from gemma4_conformance.adapters import AdapterError, DeviceError, load, parse
from gemma4_conformance.plugin import _backend_specs


class Tunable:
    """A factory with options, named after them as the contract asks."""

    dtypes = ("float32",)

    def __init__(self, kernel="plain", blocks="64"):
        self.kernel, self.blocks = kernel, int(blocks)
        self.name = f"tunable-{kernel}-{blocks}"


def test_a_spec_without_brackets_has_no_options():
    assert parse("torch") == ("torch", {})
    assert parse("tests.test_adapters:Tunable") == ("tests.test_adapters:Tunable", {})


def test_options_are_parsed_as_strings_in_order():
    assert parse("torch-sdpa[kernel=flash]") == ("torch-sdpa", {"kernel": "flash"})
    assert parse("x:Y[a=1, b = two ,]") == ("x:Y", {"a": "1", "b": "two"})


@pytest.mark.parametrize("spec, says", [
    ("x[a=1", "one trailing bracket"),
    ("x[a=1]y", "one trailing bracket"),
    ("x[a[b]=1]", "one trailing bracket"),
    ("[a=1]", "one trailing bracket"),
    ("x[flash]", "option 'flash' is not key=value"),
    ("x[a=1,a=2]", "option 'a' is given twice"),
])
def test_malformed_options_are_refused_naming_the_spec(spec, says):
    with pytest.raises(AdapterError, match=rf"backend '{__import__('re').escape(spec)}'.*{says}"):
        parse(spec)


def test_a_factory_gets_its_options_as_keywords():
    adapter = load("tests.test_adapters:Tunable[kernel=flash,blocks=128]")
    assert (adapter.kernel, adapter.blocks, adapter.name) == ("flash", 128, "tunable-flash-128")
    assert load("tests.test_adapters:Tunable").name == "tunable-plain-64"


def test_an_unknown_option_names_the_ones_the_factory_takes():
    with pytest.raises(AdapterError, match=r"takes the options kernel, blocks, not tile"):
        load("tests.test_adapters:Tunable[tile=8]")


def test_a_module_or_object_takes_no_options():
    with pytest.raises(AdapterError, match=r"adapter object or module, which takes no options"):
        load("numpy[kernel=x]")


def test_a_builtin_whose_library_is_missing_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(adapters.BUILTINS, "ghost", ("gemma4_conformance.adapters.ghost", "no_such_library_x", "ghost"))
    with pytest.raises(AdapterError, match=r"needs no_such_library_x, which is not installed here "
                                           r"\(pip install 'gemma4-conformance\[ghost\]'\)"):
        load("ghost")
    assert "ghost" not in adapters.available_builtins()


def test_backend_lists_split_on_commas_outside_options():
    assert _backend_specs("numpy, x:Y[a=1,b=2],torch") == ["numpy", "x:Y[a=1,b=2]", "torch"]


def test_load_passes_the_device_to_a_factory_that_takes_one_unless_its_spec_names_one():
    assert adapters.load("tests.test_adapters:Placed", device="cuda:1").device == "cuda:1"
    assert adapters.load("tests.test_adapters:Placed[device=mps]", device="cuda:1").device == "mps"
    assert adapters.load("tests.test_adapters:Placed").device == "cpu"
    assert adapters.load("tests.test_adapters:Tunable", device="cuda:1").name == "tunable-plain-64"  # takes none
    with pytest.raises(DeviceError, match=r"^backend 'tests.test_adapters:Placed\[device=moon\]': no moon here"):
        adapters.load("tests.test_adapters:Placed[device=moon]")


class Placed:
    """A factory that takes a device, as the built-in torch and jax backends do."""

    dtypes = ("float32",)

    def __init__(self, device="cpu"):
        if device == "moon":
            raise DeviceError("no moon here")
        self.device, self.name = device, "placed"


def test_a_builtin_with_its_own_setup_gives_that_advice(monkeypatch):
    monkeypatch.setitem(adapters.BUILTINS, "ghost", ("gemma4_conformance.adapters.ghost", "no_such_library_x", "ghost"))
    monkeypatch.setitem(adapters.SETUP, "ghost", "make a venv of its own, then pip install ghost there")
    with pytest.raises(AdapterError, match=r"not installed here \(make a venv of its own, then pip install ghost"):
        load("ghost")


_NEAR_THE_MAP_LIMIT = """
import mmap, sys
import numpy as np
import gemma4_conformance.adapters.jax_backend as jb
limit = int(open("/proc/sys/vm/max_map_count").read())
jb.MAP_BUDGET.limit = limit - 400 if sys.argv[1] == "on" else None
jb.MAP_BUDGET.every = 1
backend = jb.backend()
# Other maps fill the process to 600 below the kernel's limit, alternating sizes so none merge.
held = [mmap.mmap(-1, 4096 * (1 + i % 2)) for i in range(limit - 600 - jb.MAP_BUDGET.maps())]
for L in (1, 2, 4, 8, 16, 32, 64):  # 63 attention programs hold about 1100 maps
    for H in (1, 2, 4):
        for D in (8, 16, 32):
            q, k = np.ones((L, H, 2, D), np.float32), np.ones((L, H, D), np.float32)
            out = backend.causal_gqa(0.5, np.arange(L), q, k, k)
            assert np.allclose(out, 1, rtol=1e-6, atol=0), "the values are all ones"
print("clears", jb.MAP_BUDGET.clears)
"""


@pytest.mark.skipif(not os.path.exists("/proc/sys/vm/max_map_count"), reason="the map limit is Linux's")
def test_jax_drops_its_programs_before_the_kernels_map_limit_crashes_xla():
    """A thorough jax run crashed (SIGSEGV in XLA's compiler, 'LLVM compilation error: Cannot allocate
    memory') once its compiled programs held all 65530 maps Linux allows; MapBudget prevents it."""
    pytest.importorskip("jax")
    env = {**os.environ, "GEMMA4_CONFORMANCE_JAX_CACHE": ""}
    run = [sys.executable, "-c", _NEAR_THE_MAP_LIMIT]
    guarded = subprocess.run(run + ["on"], capture_output=True, text=True, env=env, timeout=600)
    assert guarded.returncode == 0, guarded.stderr[-2000:]
    assert int(guarded.stdout.split()[-1]) > 0
    unguarded = subprocess.run(run + ["off"], capture_output=True, text=True, env=env, timeout=600)
    # Without MapBudget it must crash here, or this test no longer shows what the guard prevents.
    assert unguarded.returncode != 0 and "Cannot allocate memory" in unguarded.stderr, unguarded.stderr[-2000:]


class Rounding:
    """An adapter declaring where it rounds beyond the dtype under test (``formats``)."""

    name, dtypes = "rounding", ("float32",)

    def __init__(self):
        self.formats = {"activations": "q8_0"}


class DeclaresFromItsWeights:
    """An adapter whose factory takes ``weights`` as its own option and declares what follows from it."""

    name, dtypes = "declares-from-its-weights", ("float32",)

    def __init__(self, weights="q8_0"):
        self.weights = weights
        self.formats = {"weights": weights, "activations": "q8_k" if weights.endswith("_k") else "q8_0"}


def test_a_factory_taking_a_declared_key_gets_it_and_declares_itself():
    adapter = load("tests.test_adapters:DeclaresFromItsWeights[weights=q4_k]")
    assert isinstance(adapter, DeclaresFromItsWeights) and adapter.weights == "q4_k"  # not wrapped
    assert adapters.declared_formats(adapter) == {"weights": "q4_k", "activations": "q8_k"}
    # a key the factory does not take stays the suite's option, added to what the adapter declares
    both = load("tests.test_adapters:DeclaresFromItsWeights[weights=q4_0,kv_cache=fp8_e4m3]")
    assert adapters.declared_formats(both) == {"weights": "q4_0", "activations": "q8_0", "kv_cache": "fp8_e4m3"}


def test_declared_formats_come_from_the_adapter_or_its_options():
    assert adapters.declared_formats(load("tests.test_adapters:Rounding")) == {"activations": "q8_0"}
    assert adapters.declared_formats(load("tests.test_adapters:Rounding[activations=q8_k]")) == {"activations": "q8_k"}
    assert adapters.declared_formats(load("numpy")) == {}
    declared = load("numpy[activations=q8_0,weights=q4_k]")  # any adapter, a module too, takes them in brackets
    assert adapters.declared_formats(declared) == {"activations": "q8_0", "weights": "q4_k"}
    assert declared.name == "numpy" and declared.linear is adapters.numpy_backend.linear
    assert adapters.declared_formats(load("numpy")) == {}  # the module itself is not changed


@pytest.mark.parametrize("spec, says", [
    ("numpy[activations=q5_0]", r"has the option activations='q5_0', an unknown activations format; the known "
                                r"ones are q8_0, q8_k"),
    ("numpy[kv_cache=fp8_e4m2]", r"has the option kv_cache='fp8_e4m2', an unknown kv_cache format; the known "
                                 r"ones are fp8_e4m3, fp8_e5m2"),
    ("numpy[kv_cache=fp8_e4m3@0]", r"has the option kv_cache='fp8_e4m3@0': its scales '0' are not positive normal "
                                   r"float32 numbers"),
    ("numpy[kv_cache=fp8_e4m3@1e39]", r"has the option kv_cache='fp8_e4m3@1e39': its scales '1e39' are not "
                                      r"positive normal"),
    ("numpy[kv_cache=fp8_e4m3@1:2:3]", r"has the option kv_cache='fp8_e4m3@1:2:3': its scales '1:2:3' are not S or "
                                       r"K:V, positive numbers"),
    ("numpy[weights=int3]", r"has the option weights='int3', an unknown weights format; the known ones are q8_0, "
                            r"q4_0, q4_k, q6_k"),
])
def test_an_unknown_declared_format_is_a_usage_error_naming_the_known_ones(spec, says):
    with pytest.raises(AdapterError, match=rf"backend '{__import__('re').escape(spec)}' {says}"):
        load(spec)


def test_a_kv_cache_format_carries_its_scales_rounded_to_float32():
    assert adapters.kv_cache_format("fp8_e4m3") == ("fp8_e4m3", 1.0, 1.0)  # vLLM's scales where none are given
    assert adapters.kv_cache_format("fp8_e5m2@0.5") == ("fp8_e5m2", 0.5, 0.5)
    assert adapters.kv_cache_format("fp8_e4m3@0.1:3") == ("fp8_e4m3", float(np.float32(0.1)), 3.0)
    declared = load("numpy[kv_cache=fp8_e4m3@0.1:3]")
    assert adapters.declared_formats(declared) == {"kv_cache": "fp8_e4m3@0.1:3"}


def test_declared_formats_are_a_dict_of_known_keys(monkeypatch):
    monkeypatch.setattr(Rounding, "__init__", lambda self: setattr(self, "formats", {"kv": "q8_0"}))
    with pytest.raises(AdapterError, match=r"declares formats for 'kv'; the keys are weights, activations, kv_cache"):
        load("tests.test_adapters:Rounding")
    monkeypatch.setattr(Rounding, "__init__", lambda self: setattr(self, "formats", {"activations": "fp8"}))
    with pytest.raises(AdapterError, match=r"declares activations='fp8', an unknown activations format; the known "
                                           r"ones are q8_0, q8_k"):
        load("tests.test_adapters:Rounding")
    monkeypatch.setattr(Rounding, "__init__", lambda self: setattr(self, "formats", ["q8_0"]))
    with pytest.raises(AdapterError, match=r"declares the formats \['q8_0'\]; they are a dict"):
        load("tests.test_adapters:Rounding")
