"""The vLLM backend's trace hooks on a fake vLLM Gemma 4 module tree (always; needs torch, not vLLM),
and the engine itself where vLLM is installed (in its own environment: adapters/vllm_backend.py).

The fake has vLLM's module names and call order, and, as vLLM does, one rotary embedding and one
activation module shared by every layer, returns (output, bias) from its linear layers, and rotates
q and k in place.  Each module writes what it returns into ``truth`` under (layer, what): the hooks
must give back exactly those values under the graph's node names.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gemma4_conformance.adapters import declared_formats, vllm_backend  # noqa: E402
from gemma4_conformance.checkpoints import generate  # noqa: E402
from gemma4_conformance.checkpoints.config import TextConfig  # noqa: E402
from gemma4_conformance.spec.model import nodes  # noqa: E402

nn = torch.nn
T = 5


class Ctx:
    layer = None


class Op(nn.Module):
    """Multiplies by a constant (and may reshape); records its output as the layer's ``what``."""

    def __init__(self, truth, what, scale, out_features=None, tuple_out=False):
        super().__init__()
        self.truth, self.what, self.scale, self.out, self.tuple_out = truth, what, scale, out_features, tuple_out

    def forward(self, x):
        y = x * self.scale
        if self.out is not None:
            y = torch.cat([y] * (self.out // y.shape[-1] + 1), -1)[..., :self.out] * torch.arange(1, self.out + 1)
        self.truth[(Ctx.layer, self.what)] = y.clone()
        return (y, None) if self.tuple_out else y


class Rotary(nn.Module):
    def __init__(self, truth):
        super().__init__()
        self.truth = truth

    def forward(self, positions, q, k):
        q.mul_(1.5)  # in place, as vLLM's rotary embedding
        k.mul_(0.5)
        self.truth[(Ctx.layer, "q_rope")], self.truth[(Ctx.layer, "k_rope")] = q.clone(), k.clone()
        return q, k


class Attention(nn.Module):
    def __init__(self, truth, layer, cfg, rotary):
        super().__init__()
        H, D, K = cfg.num_heads, layer.head_dim, layer.kv_heads
        self.sizes, self.D = (H * D, K * D, K * D), D
        self.qkv_proj = Op(truth, "qkv", 1.1, sum(self.sizes), tuple_out=True)
        self.q_norm, self.k_norm, self.v_norm = Op(truth, "q_norm", 0.9), Op(truth, "k_norm", 0.8), Op(truth, "v_norm", 0.7)
        self.rotary_emb = rotary
        self.attn = Op(truth, "attention", 1.2)
        self.o_proj = Op(truth, "o_proj", 0.6, cfg.hidden_size, tuple_out=True)

    def forward(self, positions, hidden_states):
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split(self.sizes, -1)
        q = self.q_norm(q.unflatten(-1, (-1, self.D))).flatten(-2)
        k = self.k_norm(k.unflatten(-1, (-1, self.D))).flatten(-2)
        q, k = self.rotary_emb(positions, q, k)
        v = self.v_norm(v.unflatten(-1, (-1, self.D))).flatten(-2)
        out, _ = self.o_proj(self.attn(q + 0 * k.sum() + 0 * v.sum()))
        return out


class MLP(nn.Module):
    def __init__(self, truth, cfg, act):
        super().__init__()
        self.gate_up_proj = Op(truth, "gate_up", 1.3, 2 * cfg.intermediate_size, tuple_out=True)
        self.act_fn = act
        self.down_proj = Op(truth, "down_proj", 0.4, cfg.hidden_size, tuple_out=True)

    def forward(self, x):
        gu, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(self.act_fn(gu))
        return out


class Act(nn.Module):
    def __init__(self, truth):
        super().__init__()
        self.truth = truth

    def forward(self, gu):
        d = gu.shape[-1] // 2
        y = torch.tanh(gu[..., :d]) * gu[..., d:]
        self.truth[(Ctx.layer, "geglu")] = y.clone()
        return y


class Layer(nn.Module):
    def __init__(self, truth, layer, cfg, rotary, act):
        super().__init__()
        self.index, self.truth = layer.index, truth
        self.input_layernorm = Op(truth, "input_layernorm", 1.01)
        self.self_attn = Attention(truth, layer, cfg, rotary)
        self.post_attention_layernorm = Op(truth, "post_attention_layernorm", 0.5)
        self.pre_feedforward_layernorm = Op(truth, "pre_feedforward_layernorm", 1.02)
        self.mlp = MLP(truth, cfg, act)
        self.post_feedforward_layernorm = Op(truth, "post_feedforward_layernorm", 0.3)

    def forward(self, positions, hidden_states, residual):
        Ctx.layer = self.index
        if self.index == 0:
            self.truth[(None, "embed")] = hidden_states.clone()
        x = hidden_states
        h = self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x)))
        x = h + x
        self.truth[(self.index, "attention_residual")] = x.clone()
        x = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))) + x
        x = x * 0.9
        self.truth[(self.index, "layer_scalar")] = x.clone()
        return x, None


class FakeGemma4(nn.Module):
    def __init__(self, cfg, truth, act):
        super().__init__()
        inner = nn.Module()
        rotary = Rotary(truth)  # one object for every layer, as vLLM's get_rope caches it
        inner.layers = nn.ModuleList([Layer(truth, layer, cfg, rotary, act) for layer in cfg.layers])
        inner.norm = Op(truth, "final_norm", 0.95)
        self.model = inner

    def forward(self, x):
        for layer in self.model.layers:
            x, _ = layer(None, x, None)
        Ctx.layer = None
        return self.model.norm(x)


@pytest.fixture
def cfg():
    return TextConfig.from_dict(generate.small_config())


def _forward(model, cfg, truth):
    truth.clear()
    vllm_backend._RECORDING.update(tokens=T, values={})
    with torch.no_grad():
        model(torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(0)))
    recorded = vllm_backend._RECORDING["values"]
    vllm_backend._RECORDING.update(tokens=None, values={})
    return vllm_backend._trace(recorded, cfg)


def _expected(truth, cfg):
    out = {}
    for (i, what), value in truth.items():
        value = value.numpy()
        if what == "qkv":
            layer = cfg.layers[i]
            H, D, K = cfg.num_heads, layer.head_dim, layer.kv_heads
            out[f"layers.{i}.q_proj"], out[f"layers.{i}.k_proj"] = value[..., :H * D], value[..., H * D:H * D + K * D]
            if not layer.k_eq_v:
                out[f"layers.{i}.v_proj"] = value[..., H * D + K * D:]
        else:
            out[what if i is None else f"layers.{i}.{what}"] = value
    return out


def test_the_hooks_give_every_modules_output_under_its_node(cfg):
    truth = {}
    model = FakeGemma4(cfg, truth, Act(truth))
    vllm_backend._install_hooks(model)
    trace, expected = _forward(model, cfg, truth), _expected(truth, cfg)
    assert set(trace) == set(expected)
    assert set(nodes(cfg)) - set(trace) == {f"layers.{layer.index}.mlp_residual" for layer in cfg.layers} | {"logits"}
    for node, value in expected.items():
        np.testing.assert_array_equal(trace[node].reshape(value.shape), value, err_msg=node)


def test_a_second_engine_does_not_double_the_shared_modules_hooks(cfg):
    """vLLM's activation module is one object per process: the hooks of the previous engine must go,
    or every recorded geglu from layer 1 on is the previous layer's."""
    truth = {}
    act = Act(truth)  # shared by both engines
    vllm_backend._install_hooks(FakeGemma4(cfg, truth, act))
    model = FakeGemma4(cfg, truth, act)
    vllm_backend._install_hooks(model)
    trace, expected = _forward(model, cfg, truth), _expected(truth, cfg)
    for i in (0, 1, 47):
        np.testing.assert_array_equal(trace[f"layers.{i}.geglu"], expected[f"layers.{i}.geglu"])


def test_rotated_values_are_copied_when_recorded(cfg):
    """vLLM rotates q and k in place after q_norm and k_norm return them: the recorded norms are the
    values before the rotation."""
    truth = {}
    model = FakeGemma4(cfg, truth, Act(truth))
    vllm_backend._install_hooks(model)
    trace, expected = _forward(model, cfg, truth), _expected(truth, cfg)
    np.testing.assert_array_equal(trace["layers.3.q_norm"], expected["layers.3.q_norm"])
    assert not np.array_equal(trace["layers.3.q_norm"].reshape(T, -1), trace["layers.3.q_rope"].reshape(T, -1))


def test_a_quantized_checkpoint_is_refused_before_vllm_loads_it(tmp_path):
    """vLLM would read a checkpoint's quantized blocks as numbers: refused, naming the formats (whether or not
    vLLM is installed: the check comes first)."""
    folder = generate.write_checkpoint(tmp_path, generate.small_config(), weight_format="q4_k", shards=1)
    adapter = object.__new__(vllm_backend.Vllm)
    with pytest.raises(ValueError, match="stores matrices as q4_k blocks, which vLLM cannot read"):
        adapter._llm(folder, "float32")


def test_an_fp8_kv_cache_is_declared_with_vllms_default_scales():
    adapter = object.__new__(vllm_backend.Vllm)
    for kv, declared in (("auto", {}), ("float16", {}), ("fp8", {"kv_cache": "fp8_e4m3"}),
                         ("fp8_e4m3", {"kv_cache": "fp8_e4m3"}), ("fp8_e5m2", {"kv_cache": "fp8_e5m2"})):
        adapter.kv = kv
        assert declared_formats(adapter) == declared, kv


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason=vllm_backend.SETUP["vllm"])
def test_real_vllm_forward_keeps_the_contract(tmp_path, cfg):
    from gemma4_conformance.checkpoints import checkpoint

    folder = generate.write_checkpoint(tmp_path / "small", generate.small_config(), seed=0)
    weights = checkpoint.load(folder)
    adapter = vllm_backend.Vllm()
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 12)
    out = adapter.forward(weights, weights.config.raw, tokens, "bfloat16", checkpoint=str(folder))
    assert out["logits"].shape == (12, cfg.vocab_size) and np.isfinite(out["logits"]).all()
    assert len(set(nodes(cfg)) - set(out["trace"])) == cfg.num_layers + 1  # the MLP residuals, the logits
    adapter.close()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason=vllm_backend.SETUP["vllm"])
def test_real_vllm_session_reads_its_prefix_cache_and_matches_the_reference(tmp_path, cfg):
    """The serving test's documents (under 40 tokens) are shorter than vLLM's prefix-cache unit on the
    small model (128 tokens: the lcm of its KV groups' block sizes), so there its session is judged on
    vLLM's scheduling alone; here a 300-token sequence stepped past two units reads its cache, and
    every row is judged as the serving test judges a sequence."""
    from gemma4_conformance.adapters import numpy_backend
    from gemma4_conformance.checkpoints import checkpoint
    from gemma4_conformance.composition.graph import composed
    from gemma4_conformance.properties.forward import ACCUMULATED, LONG_CONTEXT_OPS, judge_forward, reference

    folder = generate.write_checkpoint(tmp_path / "small", generate.small_config(), seed=0)
    weights = checkpoint.load(folder)
    adapter = vllm_backend.Vllm()
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 300)
    session = adapter.session(weights, weights.config.raw, "float32", checkpoint=str(folder))
    pieces = [(0, 200), (200, 201), (201, 290), (290, 300)]  # a prefill, a decode step, two chunks
    rows = np.concatenate([session.step({3: tokens[a:b]})[3] for a, b in pieces])
    assert session.cached_tokens == 128 + 128 + 256  # each later step read the blocks the earlier filled
    ref, certificate = reference(weights.config, weights, tokens, ops=LONG_CONTEXT_OPS)
    assert certificate.calls and not certificate.failures, certificate.failures[:3]
    base = composed(numpy_backend, weights.config, weights, tokens, "float32")
    verdict = judge_forward({"logits": rows}, base, ref, "float32", accumulated=ACCUMULATED)
    assert not verdict.failures, verdict.failures
    adapter.close()
