"""A complete third-party adapter: the smallest thing the suite can test.

It implements three ops in float32 and bfloat16; every other op is reported as unsupported.

    pytest --backend=examples.minimal_adapter:MinimalAdapter
"""

import numpy as np


class MinimalAdapter:
    name = "minimal"
    dtypes = ("float32", "bfloat16")

    def sigmoid(self, x):
        wide = x.astype(np.float32)
        return (1 / (1 + np.exp(-wide))).astype(x.dtype)

    def linear(self, W, x):
        # accumulate in float32, round once to the dtype under test
        return (x.astype(np.float32) @ W.astype(np.float32).T).astype(x.dtype)

    def rmsnorm(self, eps, x, w):
        wide = x.astype(np.float32)
        inverse = 1 / np.sqrt(np.mean(wide * wide, axis=-1, keepdims=True) + np.float32(eps))
        return (wide * inverse * w.astype(np.float32)).astype(x.dtype)

