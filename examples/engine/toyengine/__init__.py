"""A toy inference engine: a few float32 kernels."""
