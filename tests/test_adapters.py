"""How the suite finds a backend: built-in names, module:attribute paths, and a factory's [options]."""

from __future__ import annotations

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
