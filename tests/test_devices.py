"""Devices and the fused kernels: --device, the usage error for a device that is not there, the math modes
in the report, and the SDPA / F.rms_norm / jax.nn.dot_product_attention backends on the CPU."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemma4_conformance import adapters, report
from gemma4_conformance.adapters import torch_sdpa
from gemma4_conformance.adapters.torch_backend import TorchAdapter
from gemma4_conformance.properties.judging import judge, rerun_command
from gemma4_conformance.properties.table import cases, edge_cases

from .test_plugin import suite

NO_CUDA = torch.cuda.device_count() == 0
ATTENTION = ("causal_gqa", "sliding_gqa", "decode_gqa")
NORMS = ("rmsnorm", "rmsnorm_unit", "rmsnorm_offset", "rmsnorm_gated")
FUSED_OPS = "test_matches_oracle and (gqa] or -rmsnorm] or -rmsnorm_unit] or -rmsnorm_offset] or -rmsnorm_gated])"


def drawn(op: str, dtype: str, n: int = 12) -> list[dict]:
    """``n`` derandomized cases of ``op`` as the suite draws them, after its edge cases."""
    found = list(edge_cases(op))

    @settings(max_examples=n, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def collect(data):
        found.append(data.draw(cases(op, dtype)))

    collect()
    return found


# ----------------------------------------------------------------------------------------- --device


@pytest.mark.parametrize("spec, device", [("torch", "cpu"), ("torch-sdpa", "cpu"), ("jax", "cpu:0"),
                                          ("jax-sdpa", "cpu:0")])
def test_device_cpu_runs_every_built_in_backend_there(spec, device):
    adapter = adapters.load(spec, device="cpu")
    assert adapter.device == device
    assert report.data.backend_environment(adapter)["device"] == device
    for op in ("linear", "causal_gqa", "rmsnorm"):
        for case in edge_cases(op):
            assert judge(adapter, op, case, "float32").passed


def test_a_device_given_as_an_object_is_named_as_text_in_the_summary_and_report():
    """transformers' backend keeps a torch.device; the summary line and the JSON take its name (CI's
    run of --backend=all broke on it in the terminal summary)."""
    adapter = SimpleNamespace(name="placed", dtypes=("float32",), device=torch.device("cpu"))
    assert report.data.backend_environment(adapter)["device"] == "cpu"
    assert report.device_line(adapter) == "cpu"
    json.dumps(report.environment([adapter]))


def test_the_numpy_backend_runs_on_the_cpu_whatever_the_device(tmp_path):
    status, out, doc = suite(tmp_path, "--backend=numpy", "--device=cuda:3", "-k", "test_matches_oracle and -sigmoid]")
    assert status == 0, out[-2000:]
    assert doc["environment"]["backends"]["numpy"]["device"] == "cpu"
    assert "numpy: cpu" in out


@pytest.mark.skipif(not NO_CUDA, reason="this torch sees a CUDA device")
@pytest.mark.parametrize("backend, device, says", [
    ("torch", "cuda", "--device: backend 'torch': cuda not found: torch sees 0 CUDA devices (torch "),
    ("torch-sdpa", "cuda:7", "--device: backend 'torch-sdpa': cuda:7 not found: torch sees 0 CUDA devices"),
    ("jax", "gpu", "--device: backend 'jax': gpu not found: JAX sees 0 gpu devices (all devices: cpu:0"),
    ("torch", "tpu", "--device: backend 'torch': torch cannot use the device 'tpu'"),
    ("torch-sdpa[kernel=cudnn]", "cpu", "--device: backend 'torch-sdpa[kernel=cudnn]': torch's cudnn SDPA kernel "
                                        "runs on CUDA only, not on cpu"),
])
def test_a_device_that_is_not_there_is_a_usage_error_naming_it_and_what_was_found(tmp_path, backend, device, says):
    status, out, doc = suite(tmp_path, f"--backend={backend}", f"--device={device}")
    assert status == 4 and says in out, out[-2000:]
    assert doc is None


def test_a_rerun_command_names_the_device_when_it_is_not_the_cpu():
    class Config:
        device = "cuda:1"
        seed = None

        def getoption(self, name, default=None):
            return {"--device": self.device, "hypothesis_seed": self.seed}.get(name, default)

    class Item:
        module = type("M", (), {"__name__": "gemma4_conformance.properties.test_agreement"})
        name = "test_matches_oracle[torch-float32-linear]"
        config = Config()

    assert rerun_command(Item(), "torch").endswith("--backend=torch --device=cuda:1")
    Item.config.device = "cpu"
    assert "--device" not in rerun_command(Item(), "torch")
    Item.config.seed = 7  # the forward's and serving's tokens are drawn with it; a case holds its own inputs
    assert rerun_command(Item(), "torch").endswith("--backend=torch --hypothesis-seed=7")
    assert "--hypothesis-seed" not in rerun_command(Item(), "torch", case={"args": {}})


# ----------------------------------------------------------------------------------------- math modes


def test_the_report_lists_each_backends_device_and_math_modes(tmp_path):
    status, out, doc = suite(tmp_path, "--backend=torch,torch[tf32=on],jax-sdpa", "--device=cpu",
                             "-k", "test_matches_oracle and -linear]")
    assert status == 0, out[-3000:]
    backends = doc["environment"]["backends"]
    assert set(backends) == {"torch", "torch-tf32-on", "jax-sdpa"}
    eager, tf32 = backends["torch"], backends["torch-tf32-on"]
    assert eager["device"] == tf32["device"] == "cpu" and backends["jax-sdpa"]["device"] == "cpu:0"
    for modes in (eager["math_modes"], tf32["math_modes"]):
        assert {"tf32_matmul", "tf32_cudnn_conv", "float32_matmul_precision",
                "cuda.matmul.allow_bf16_reduced_precision_reduction",
                "cuda.matmul.allow_fp16_reduced_precision_reduction"} <= set(modes)
    assert (eager["math_modes"]["tf32_matmul"], tf32["math_modes"]["tf32_matmul"]) == ("off", "on")
    assert tf32["math_modes_source"] == "forced by the backend's options (tf32=on)"
    assert "the process's settings" in eager["math_modes_source"]
    jax_modes = backends["jax-sdpa"]["math_modes"]
    assert jax_modes["matmul_precision_of_this_backend"] == "highest" and "jax_default_matmul_precision" in jax_modes
    assert "jax.nn.dot_product_attention" in backends["jax-sdpa"]["attention"]
    # The forced mode holds only during the backend's ops: the process's is untouched after the run.
    page = report.render([doc])
    environment = page[page.index('id="environment"'):]
    assert "math: tf32_matmul" in environment and "torch-tf32-on" in environment
    assert all(r["seconds"]["oracle"] > 0 and r["seconds"]["backend"] > 0 for r in doc["results"])


def test_a_jax_backends_environment_gives_the_seconds_it_spent_compiling():
    """jax.monitoring's compile durations, summed: on a GPU most of a jax run's backend time (docs/gpu.md)."""
    adapter = adapters.load("jax")
    before = adapter.environment()["compile_seconds"]
    adapter.softcap(30.0, np.linspace(-3, 3, 11, dtype=np.float32))  # a shape the process has not compiled
    env = adapter.environment()
    assert env["compile_seconds"] > before and isinstance(env["persistent_cache_hits"], int)
    assert env["compilation_cache"] != "off"


def test_forced_math_modes_last_only_as_long_as_the_op():
    before = torch.backends.cuda.matmul.fp32_precision, torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    adapter = adapters.load("torch[tf32=on,reduced=off]")
    seen = {}

    class Spy:
        def linear(self, W, x):
            seen["tf32"] = torch.backends.cuda.matmul.fp32_precision
            seen["reduced"] = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
            return x @ W.T

    adapter.kernels = Spy()
    adapter.linear(np.eye(2, dtype=np.float32), np.ones((1, 2), np.float32))
    assert seen == {"tf32": "tf32", "reduced": False}
    assert (torch.backends.cuda.matmul.fp32_precision,
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction) == before
    env = adapter.environment()
    assert env["math_modes"]["tf32_matmul"] == "on"
    assert env["math_modes"]["cuda.matmul.allow_bf16_reduced_precision_reduction"] is False


@pytest.mark.parametrize("spec, says", [
    ("torch[tf32=yes]", "tf32 is on or off, not 'yes'"),
    ("torch-sdpa[kernel=fast]", "kernel is one of flash, efficient"),
    ("torch-sdpa[mask=float]", "mask is bool or additive"),
    ("jax[precision=fastest]", "precision is inherit or a value of jax_default_matmul_precision"),
    ("jax-sdpa[implementation=triton]", "implementation is xla or cudnn"),
])
def test_a_bad_backend_option_names_it(spec, says):
    with pytest.raises(adapters.AdapterError, match=says):
        adapters.load(spec)


# ----------------------------------------------------------------------------------------- the fused kernels


def test_torch_sdpa_computes_attention_with_sdpa_and_says_which_kernel_ran():
    adapter = adapters.load("torch-sdpa")
    for case in edge_cases("causal_gqa"):
        judge(adapter, "causal_gqa", case, "float32")
    assert adapter.environment()["sdpa_kernels_run"]["float32"]  # SDPA itself ran (the choice was noted)
    forced = adapters.load("torch-sdpa[kernel=math,mask=additive]")
    assert forced.name == "torch-sdpa-kernel-math-mask-additive"
    for case in edge_cases("causal_gqa"):
        assert judge(forced, "causal_gqa", case, "bfloat16").passed
    assert forced.environment()["sdpa_kernels_run"] == {"bfloat16": ["math"]}


class ScaleIgnored(torch_sdpa.SDPA):
    """The bug the scale argument exists to catch: SDPA called without ``scale``, so with 1/sqrt(D)."""

    def _attend(self, scale, visible, q, k, v):
        return super()._attend(1 / np.sqrt(q.shape[-1]), visible, q, k, v)


@pytest.mark.parametrize("op", ATTENTION)
def test_an_sdpa_call_that_ignores_the_scale_is_caught(op):
    right = adapters.load("torch-sdpa")
    wrong = TorchAdapter(ScaleIgnored(), "torch-sdpa with the scale ignored")
    examples = drawn(op, "float32", n=4)
    assert all(judge(right, op, case, "float32").passed for case in examples)
    assert not all(judge(wrong, op, case, "float32").passed for case in examples)


def test_a_row_with_nothing_visible_comes_out_zero_from_every_fused_backend():
    q = np.ones((2, 1, 2, 4), np.float32)
    k = v = np.ones((3, 1, 4), np.float32)
    pos = np.array([0, 2])
    for spec in ("torch-sdpa", "torch-sdpa[mask=additive]", "torch-sdpa[gqa=repeat]", "jax-sdpa"):
        out = adapters.load(spec).sliding_gqa(1.0, 0, pos, q, k, v)  # window 0: no key is visible
        assert np.array_equal(out, np.zeros_like(out)), spec


# CI's `--backend=all` runs both fused backends on every op and dtype; these check the ops they change.


def test_torch_sdpa_passes_its_fused_ops_on_the_cpu(tmp_path):
    status, out, doc = suite(tmp_path, "--backend=torch-sdpa", "--dtype=float32,bfloat16", "-k", FUSED_OPS)
    assert status == 0, out[-3000:]
    judged = {(r["dtype"], r["op"]) for r in doc["results"] if r["outcome"] == "passed"}
    assert judged == {(dt, op) for dt in ("float32", "bfloat16") for op in ATTENTION + NORMS}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_jax_sdpa_passes_its_attention_on_the_cpu_in_bf16_and_fp16_where_jit_breaks_it(dtype):
    adapter = adapters.load("jax-sdpa")
    for op in ATTENTION:
        for case in drawn(op, dtype, n=3):  # the first drawn case is the minimal one: 1 query, 1 key, D = 1
            verdict = judge(adapter, op, case, dtype)
            assert verdict.passed, (op, case, verdict.failures)
    assert "float64" in report.data.backend_environment(adapter)["dtypes_left_out"]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a finding about XLA on the CPU")
def test_finding_jitted_jax_dot_product_attention_raises_on_the_cpu_in_fp16_and_on_1x1x1_in_bf16():
    """Why jax_sdpa.py calls it eagerly (jax 0.10.2). When this fails, JAX fixed it: update jax_sdpa.py and
    docs/gpu.md."""
    def attend(q):
        return jax.nn.dot_product_attention(q, q, q, scale=1.0)

    for dtype, shape, says in ((jnp.float16, (1, 2, 2, 16), "F16_F16_F32"), (jnp.bfloat16, (1, 1, 1, 1), "BF16_BF16_F32")):
        q = jnp.ones(shape, dtype)  # bf16 fails only where the dot is a scalar: one query, one key, head dim 1
        with pytest.raises(Exception, match=says):
            jax.jit(attend)(q).block_until_ready()
        assert np.asarray(attend(q)).shape == q.shape  # eagerly, its fallback to the default precision works


def test_finding_jax_dot_product_attention_softmaxes_float64_in_float32():
    """Why jax-sdpa does not declare float64: its probabilities are float32, hundreds of budgets off or more."""
    adapter = adapters.load("jax-sdpa")
    assert "float64" not in adapter.dtypes
    ratios = [error / allowed for case in drawn("decode_gqa", "float64", n=3)
              for error, allowed in [judge(adapter, "decode_gqa", case, "float64").worst]]
    assert max(ratios) > 100, ratios
