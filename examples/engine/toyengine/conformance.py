"""The engine's adapter for gemma4-conformance, registered by the entry point in pyproject.toml."""

import numpy as np

import spec  # the engine's own `spec` and `adapters`, not the suite's
from adapters import kernels_for


class Adapter:
    name = spec.ENGINE
    dtypes = ("float32",)

    def __init__(self):
        self.kernels = kernels_for("cpu")

    def sigmoid(self, x):
        return self.kernels.sigmoid(x)

    def silu(self, x):
        return self.kernels.silu(x)

    def softcap(self, c, x):
        return self.kernels.softcap(c, x)

    def rmsnorm(self, eps, x, w):
        return self.kernels.rmsnorm(eps, x, w)

    def linear(self, W, x):
        return self.kernels.linear(W, x).astype(np.float32)
