"""``jax-sdpa[implementation=cudnn]`` on a CPU, for the plugin's tests (--backend=tests.cudnn_on_cpu:ADAPTER):
the adapter as it is, over a ``jax.nn.dot_product_attention`` that checks cuDNN's head dimensions as jax
0.11.2 did on an H200 (NotImplementedError past 256 or off multiples of 8) and computes XLA's result."""

from types import SimpleNamespace

from gemma4_conformance.adapters import jax_sdpa

_xla = jax_sdpa.jax.nn.dot_product_attention


def _cudnn(query, key, value, *, implementation, **options):
    head_dim = query.shape[-1]
    if head_dim > 256 or head_dim % 8:
        raise NotImplementedError(f"The head dim must be <= 256 and a multiple of 8, but got {head_dim}.")
    return _xla(query, key, value, implementation="xla", **options)


jax_sdpa.jax = SimpleNamespace(nn=SimpleNamespace(dot_product_attention=_cudnn))
ADAPTER = jax_sdpa.backend("cpu", implementation="cudnn")
