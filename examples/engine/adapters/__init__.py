"""The engine's own hardware adapters (a name the conformance suite must not shadow)."""

from toyengine import kernels


def kernels_for(device: str):
    if device != "cpu":
        raise ValueError(f"toyengine runs on the cpu only, not {device}")
    return kernels
