"""Hugging Face transformers' own Gemma 4 text model as a backend: its forward, its trace, its ops, its cache.

``--backend=transformers`` (attention ``sdpa``, transformers' default on CPU) and
``--backend=transformers-eager`` are the two attention implementations of one backend; any setting
can also be given as an option, ``--backend='transformers[attention=eager,device=cuda]'``.  The
adapter's name says the setting (``transformers-sdpa``, ``transformers-eager``), so results,
reports and known deviations tell them apart.  Needs ``pip install 'gemma4-conformance[transformers]'``.

The forward.  ``Gemma4UnifiedForCausalLM`` (model type ``gemma4_unified_text``, the text model of
Gemma 4 12B) is built from the config and given the suite's weights with ``from_pretrained(None,
config=..., state_dict=..., dtype=...)``, so transformers' own loading code (tied embeddings, buffers
kept in float32, the dtype) runs; it is not ``from_pretrained(folder)``, because on the hub's
multimodal layout (tensors under ``model.language_model.``) the causal-LM class maps none of them
and leaves every weight at its random initialisation, with a warning only.  It runs in the dtype
under test on ``device`` and returns:

* ``logits``: the model's, after its final softcap;
* ``hidden_states``: each decoder layer's output, from a forward hook (transformers'
  ``output_hidden_states`` puts the embedding first and the final norm's output last, which is not
  the contract's one output per layer);
* ``trace``: every node of the spec's graph, each the model's own tensor: forward hooks on its
  modules (``embed_tokens``, the norms, ``q/k/v/o_proj``, ``q/k/v_norm``, ``gate_proj`` and
  ``up_proj`` joined gate first as ``gate_up``, ``down_proj``, the decoder layer as ``layer_scalar``,
  ``norm``), forward pre-hooks for the values modules receive but no module returns (the attention
  output is ``o_proj``'s input, ``attention_residual`` is ``pre_feedforward_layernorm``'s, ``geglu``
  is ``down_proj``'s), and two that live inside HF's code rather than in a module: RoPE, whose
  ``apply_rotary_pos_emb`` is wrapped during the run (the wrapper calls it and keeps its result: q's
  then k's in each attention), and ``mlp_residual``, the sum that the decoder layer scales in place
  (``hidden_states *= self.layer_scalar``), taken just before that in-place product by a
  ``TorchFunctionMode`` that copies the tensor the product is about to overwrite.  Nothing is
  recomputed by the adapter.

The ops.  Where transformers defines an op itself the adapter calls that code: ``Gemma4UnifiedRMSNorm``
(``rmsnorm``; ``with_scale=False`` for ``rmsnorm_unit``), the rotary embedding's inverse frequencies
(``compute_default_rope_parameters`` for default RoPE, ``_compute_proportional_rope_parameters`` for
proportional, through the model's ``Gemma4UnifiedTextRotaryEmbedding`` and its cos/sin) and
``apply_rotary_pos_emb`` (``rope``, ``rope_std``, ``inv_freq``), ``ACT2FN["gelu_pytorch_tanh"]``
(``gelu_tanh``, ``gelu_mul`` as its MLP computes it), ``Gemma4UnifiedTextScaledWordEmbedding``
(``embed``), and its attention functions, ``eager_attention_forward`` or the ``sdpa`` one, with masks
from its own mask functions (``causal_mask_function``, ``sliding_window_causal_mask_function``)
through ``sdpa_mask`` / ``eager_mask`` at the op's query positions (``causal_gqa``, ``sliding_gqa``,
``decode_gqa``).  A partial rotation (``rot`` smaller than the head; Gemma 4 always rotates the
whole head) applies HF's RoPE to the rotated coordinates and passes the rest through.  Every other
op (linear, gate_up, lm_head, softcap, residual, softmax, silu, ...) transformers leaves to torch,
and the adapter takes it from the torch backend.  float64 is not declared: HF's norms and RoPE
angles are float32 whatever the model's dtype.

The session (the serving contract of issue 12).  ``session(...)`` loads the model once and keeps one
``DynamicCache`` per sequence (transformers' own cache, sliding-window layers included: built from
the config it keeps ``sliding_window`` keys on sliding layers); ``step`` runs each sequence's new
tokens through the model with its cache, positions coming from the cache as in ``generate``.
Sequences are run one after another, not batched (a batch of ragged sequences would need
transformers' padding and masks, which are not what is under test here).
"""

from __future__ import annotations

import functools
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from transformers import __version__ as transformers_version
from transformers.activations import ACT2FN
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import (
    causal_mask_function,
    eager_mask,
    sdpa_mask,
    sliding_window_causal_mask_function,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gemma4_unified import modeling_gemma4_unified as hf
from transformers.models.gemma4_unified.configuration_gemma4_unified import Gemma4UnifiedTextConfig

from gemma4_conformance.spec import OP_NAMES

from . import torch_backend
from .torch_backend import TORCH_DTYPES, from_numpy, to_numpy

ATTENTION = ("sdpa", "eager")
VERSION = transformers_version


class Adapter:
    """transformers' Gemma 4 (module docstring); ``attention``: ``sdpa`` or ``eager``; ``device``: a torch device."""

    dtypes = ("float32", "bfloat16", "float16")
    version = f"transformers {VERSION}"

    def __init__(self, attention: str = "sdpa", device: str = "cpu"):
        if attention not in ATTENTION:
            raise ValueError(f"attention={attention!r}: transformers' attention implementations tested here are "
                             f"{', '.join(ATTENTION)}")
        try:
            self.device = torch.device(device)
        except RuntimeError as e:
            raise ValueError(f"device={device!r} is not a torch device: {e}") from None
        self.attention = attention
        self.name = f"transformers-{attention}" + ("" if self.device.type == "cpu" else f"-{self.device}")
        self._models: dict = {}
        self._torch = torch_backend.backend(device=str(self.device))
        # Measured on the CPU in float32 and bfloat16 (docs/invariance.md): a run repeats bitwise, and the
        # session runs each sequence in a call of its own, so its partners never change its logits. Chunked
        # prefill changes every product's rows (chunk varies); a GPU was not measured: nothing claimed there.
        self.invariance = frozenset({"run", "batch"}) if self.device.type == "cpu" else frozenset()

    def __getattr__(self, op):
        """An op transformers does not define itself: torch's, as the torch backend computes it."""
        if op not in OP_NAMES:
            raise AttributeError(op)
        return getattr(self._torch, op)

    # ------------------------------------------------------------------------------- the model

    def model(self, weights, config: dict, dtype: str):
        """The causal LM in ``dtype``, built once per checkpoint and dtype (module docstring)."""
        key = (id(weights), dtype)
        if key not in self._models:
            self._models.clear()  # one model at a time: a new checkpoint or dtype replaces it
            hf_config = Gemma4UnifiedTextConfig(**_text_config(config))
            state = {name: _tensor(weights[name]) for name in weights}
            model = hf.Gemma4UnifiedForCausalLM.from_pretrained(
                None, config=hf_config, state_dict=state, dtype=TORCH_DTYPES[dtype],
                attn_implementation=self.attention)
            self._models[key] = model.to(self.device).eval()
        return self._models[key]

    def forward(self, weights, config, tokens, dtype, checkpoint=None):
        model = self.model(weights, config, dtype)
        with torch.no_grad(), Tracer(model) as tracer:
            out = model(torch.as_tensor(np.asarray(tokens), device=self.device)[None], use_cache=False)
        trace = tracer.trace()
        return {"logits": to_numpy(out.logits[0].cpu()), "trace": trace,
                "hidden_states": [trace[f"layers.{i}.layer_scalar"] for i in range(len(model.model.layers))]}

    def session(self, weights, config, dtype, checkpoint=None):
        return Session(self.model(weights, config, dtype), self.device)

    # ------------------------------------------------------------------------------- HF's ops

    def _t(self, a):
        return from_numpy(a).to(self.device)

    def rmsnorm(self, eps, x, w):
        norm = hf.Gemma4UnifiedRMSNorm(x.shape[-1], eps=eps).to(self.device)
        norm.weight = torch.nn.Parameter(self._t(w), requires_grad=False)
        return self._out(norm(self._t(x)))

    def rmsnorm_unit(self, eps, x):
        return self._out(hf.Gemma4UnifiedRMSNorm(x.shape[-1], eps=eps, with_scale=False)(self._t(x)))

    def inv_freq(self, theta, denom, active, i, dtype):
        freq = _rotary(theta, denom, active).full_attention_inv_freq  # HF's buffer: denom / 2 frequencies
        i = torch.as_tensor(np.asarray(i, dtype=np.int64))
        inside = (i >= 0) & (i < len(freq))  # past the head's pairs there is no frequency: 0 (the spec's too)
        out = torch.where(inside, freq[i.clamp(0, len(freq) - 1)], torch.zeros((), dtype=freq.dtype))
        return to_numpy(out.to(TORCH_DTYPES[dtype]))

    def rope(self, theta, rot, denom, active, pos, x):
        half = rot // 2
        if 2 * half > x.shape[-1] or half > denom // 2:
            raise ValueError(f"rope: rot={rot} rotates more than the {x.shape[-1]} coordinates of a head, or has "
                             f"more pairs than the {denom // 2} frequencies of head_dim {denom}")
        x = self._t(x)
        position_ids = torch.as_tensor(np.asarray(pos, dtype=np.int64), device=self.device)
        cos, sin = _rotary(theta, denom, active).to(self.device)(x, position_ids, "full_attention")
        # HF's cos/sin are [..., denom], its denom / 2 frequencies twice; the rotated pairs (i, i + half)
        # take the first `half` of them, twice. unsqueeze_dim=0 gives cos the leading axis of x[None].
        cos, sin = (torch.cat((c[..., :half], c[..., :half]), dim=-1) for c in (cos, sin))
        rotated = hf.apply_rotary_pos_emb(x[None, ..., :2 * half], cos, sin, unsqueeze_dim=0)[0]
        return self._out(torch.cat((rotated, x[..., 2 * half:]), dim=-1))

    def rope_std(self, theta, rot, pos, x):
        return self.rope(theta, rot, rot, rot // 2, pos, x)

    def gelu_tanh(self, x):
        return self._out(ACT2FN["gelu_pytorch_tanh"](self._t(x)))

    def gelu_mul(self, gu):
        gate, up = self._t(gu).chunk(2, dim=-1)
        return self._out(ACT2FN["gelu_pytorch_tanh"](gate) * up)  # Gemma4UnifiedTextMLP: act(gate) * up

    def embed(self, c, E, tokens):
        V, H = E.shape
        module = hf.Gemma4UnifiedTextScaledWordEmbedding(V, H, padding_idx=None, embed_scale=c).to(self.device)
        module.weight = torch.nn.Parameter(self._t(E), requires_grad=False)
        return self._out(module(torch.as_tensor(np.asarray(tokens, dtype=np.int64), device=self.device)))

    def causal_gqa(self, scale, pos, q, k, v):
        return self._attention(scale, pos, q, k, v, causal_mask_function)

    def sliding_gqa(self, scale, window, pos, q, k, v):
        return self._attention(scale, pos, q, k, v, sliding_window_causal_mask_function(window))

    def decode_gqa(self, scale, q, k, v):
        return self._attention(scale, None, q[None], k, v, None)[0]

    def _attention(self, scale, pos, q, k, v, mask_function):
        """HF's attention function on q [S, Hkv, G, D] and k, v [L, Hkv, D], in its layout: query head
        c*G + g of [1, H, S, D] reads KV head c of [1, Hkv, L, D], as its repeat_kv maps them."""
        q, k, v = self._t(q), self._t(k), self._t(v)
        S, Hkv, G, D = q.shape
        L = k.shape[0]
        module = SimpleNamespace(num_key_value_groups=G, head_dim=D, training=False, is_causal=True, layer_idx=0)
        mask = None
        if mask_function is not None:
            positions = torch.as_tensor(np.asarray(pos, dtype=np.int64), device=self.device)

            def at_positions(batch, head, query, key):  # query index s stands at position pos[s]
                return mask_function(batch, head, positions[query], key)

            build = dict(batch_size=1, q_length=S, kv_length=L, mask_function=at_positions, device=self.device)
            mask = sdpa_mask(**build, allow_is_causal_skip=False) if self.attention == "sdpa" else \
                eager_mask(**build, dtype=q.dtype)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.attention, hf.eager_attention_forward)
        out, _ = attend(module, q.reshape(S, Hkv * G, D).transpose(0, 1)[None], k.transpose(0, 1)[None],
                        v.transpose(0, 1)[None], mask, dropout=0.0, scaling=scale)
        return self._out(out[0].reshape(S, Hkv, G, D))

    def _out(self, t):
        return to_numpy(t.detach().cpu())


def eager(device: str = "cpu") -> Adapter:
    """The backend ``transformers-eager``: transformers' eager attention."""
    return Adapter(attention="eager", device=device)


def _text_config(config: dict) -> dict:
    """The text config as Gemma4UnifiedTextConfig takes it, without the dtype keys (the run's dtype is the
    one under test). Its default use_bidirectional_attention="vision" is kept: it changes nothing for text."""
    drop = ("torch_dtype", "dtype", "architectures", "model_type")
    return {k: v for k, v in config.items() if k not in drop}


def _tensor(array) -> torch.Tensor:
    return from_numpy(np.asarray(array))


@functools.lru_cache(maxsize=64)
def _rotary(theta: float, denom: int, active: int) -> hf.Gemma4UnifiedTextRotaryEmbedding:
    """The model's rotary embedding for one RoPE setting: head_dim ``denom``, ``active`` rotated pairs
    (``default`` RoPE when that is every pair, as on Gemma's sliding layers, else ``proportional``, as on
    its full layers), built from a one-layer config so that HF computes the frequencies itself."""
    if 2 * active == denom:
        params = {"rope_type": "default", "rope_theta": theta}
    else:
        factor = 2 * active / denom
        while int(factor * denom // 2) < active:  # HF floors factor * head_dim / 2: never one pair short
            factor = float(np.nextafter(factor, 1.0))
        params = {"rope_type": "proportional", "partial_rotary_factor": factor, "rope_theta": theta}
    config = Gemma4UnifiedTextConfig(num_hidden_layers=1, layer_types=["full_attention"], head_dim=denom,
                                     global_head_dim=denom, rope_parameters={"full_attention": params},
                                     hidden_size=denom, num_attention_heads=1, num_key_value_heads=1)
    rotary = hf.Gemma4UnifiedTextRotaryEmbedding(config)
    got = int((rotary.full_attention_inv_freq != 0).sum())
    if got != active and theta != 1:  # theta 1 makes every frequency 1
        raise ValueError(f"transformers' {params['rope_type']} RoPE gives {got} rotated pairs for head_dim {denom}, "
                         f"not {active}")
    return rotary


# ----------------------------------------------------------------------------------- the trace

class _ScaledInPlace(TorchFunctionMode):
    """Copies the tensor a decoder layer is about to scale in place by its layer scalar (mlp_residual)."""

    def __init__(self, scalars: dict, keep):
        super().__init__()
        self.scalars, self.keep = scalars, keep

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.mul_, torch.Tensor.__imul__) and len(args) == 2 and id(args[1]) in self.scalars:
            self.keep(f"layers.{self.scalars[id(args[1])]}.mlp_residual", args[0])
        return func(*args, **(kwargs or {}))


class Tracer:
    """Hooks on one forward of the model: every graph node's tensor (module docstring)."""

    def __init__(self, model):
        self.model, self.values, self.layer = model, {}, None

    def keep(self, node, tensor):
        self.values[node] = tensor.detach().to("cpu", copy=True)

    def trace(self) -> dict:
        """Node -> numpy array, the batch axis dropped; gate_proj's and up_proj's outputs joined, gate
        first, as the node gate_up."""
        out = {}
        for node, t in self.values.items():
            if node.endswith(".up_proj"):
                continue
            if node.endswith(".gate_proj"):
                layer = node[:-len(".gate_proj")]
                node, t = f"{layer}.gate_up", torch.cat((t, self.values[f"{layer}.up_proj"]), dim=-1)
            out[node] = to_numpy(t[0])
        return out

    def __enter__(self):
        self.stack = ExitStack()
        base = self.model.model

        def output(node):
            return lambda module, args, result: self.keep(node, result[0] if isinstance(result, tuple) else result)

        def argument(node):
            return lambda module, args: self.keep(node, args[0])

        hooks = [base.embed_tokens.register_forward_hook(output("embed")),
                 base.norm.register_forward_hook(output("final_norm"))]
        for i, layer in enumerate(base.layers):
            p, attn, mlp = f"layers.{i}.", layer.self_attn, layer.mlp
            outputs = {"input_layernorm": layer.input_layernorm, "q_proj": attn.q_proj, "q_norm": attn.q_norm,
                       "k_proj": attn.k_proj, "k_norm": attn.k_norm, "v_norm": attn.v_norm, "o_proj": attn.o_proj,
                       "post_attention_layernorm": layer.post_attention_layernorm,
                       "pre_feedforward_layernorm": layer.pre_feedforward_layernorm,
                       "gate_proj": mlp.gate_proj, "up_proj": mlp.up_proj, "down_proj": mlp.down_proj,
                       "post_feedforward_layernorm": layer.post_feedforward_layernorm, "layer_scalar": layer}
            if attn.v_proj is not None:
                outputs["v_proj"] = attn.v_proj
            hooks += [module.register_forward_hook(output(p + name)) for name, module in outputs.items()]
            inputs = {"attention": attn.o_proj, "attention_residual": layer.pre_feedforward_layernorm,
                      "geglu": mlp.down_proj}
            hooks += [module.register_forward_pre_hook(argument(p + name)) for name, module in inputs.items()]
            hooks.append(attn.register_forward_pre_hook(lambda module, args, i=i: setattr(self, "layer", i)))
        for hook in hooks:
            self.stack.callback(hook.remove)
        self.stack.enter_context(self._rope())
        scalars = {id(layer.layer_scalar): i for i, layer in enumerate(base.layers)}
        self.stack.enter_context(_ScaledInPlace(scalars, self.keep))
        return self

    def __exit__(self, *exc):
        self.stack.close()
        return False

    @contextmanager
    def _rope(self):
        """HF's apply_rotary_pos_emb, wrapped: q's result, then k's, in the attention of ``self.layer``."""
        original = hf.apply_rotary_pos_emb

        def traced(x, cos, sin, unsqueeze_dim=1):
            out = original(x, cos, sin, unsqueeze_dim=unsqueeze_dim)
            node = f"layers.{self.layer}.q_rope"
            self.keep(node if node not in self.values else f"layers.{self.layer}.k_rope", out)
            return out

        hf.apply_rotary_pos_emb = traced
        try:
            yield
        finally:
            hf.apply_rotary_pos_emb = original


# ----------------------------------------------------------------------------------- the session

class Session:
    """The serving contract (issue 12) through transformers' DynamicCache, one per sequence."""

    def __init__(self, model, device):
        self.model, self.device, self.caches = model, device, {}

    def step(self, batch: dict) -> dict:
        out = {}
        with torch.no_grad():
            for seq, tokens in batch.items():
                cache = self.caches.setdefault(seq, DynamicCache(config=self.model.config))
                ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64), device=self.device)[None]
                result = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
                out[seq] = to_numpy(result.logits[0].cpu())
        return out

    def traced_step(self, batch: dict) -> tuple[dict, dict]:
        """``step``, and per sequence the trace of its call (the Tracer's hooks on the model)."""
        out, traces = {}, {}
        for seq, tokens in batch.items():
            with Tracer(self.model) as tracer:
                out |= self.step({seq: tokens})
            traces[seq] = tracer.trace()
        return out, traces

    def release(self, seq) -> None:
        self.caches.pop(seq, None)

    def close(self) -> None:
        self.caches.clear()

