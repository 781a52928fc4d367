"""The engine's own model spec (a name the conformance suite must not shadow)."""

ENGINE = "toyengine"
ACCUMULATOR = "float32"
