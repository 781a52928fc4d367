"""gemma4-conformance: does an inference engine compute Gemma 4 12B the way the Lean specs say?

    spec/        the arbitrary-precision oracles, one per Lean definition, and the model graph
    adapters/    the backends under test (numpy, torch, jax, or an engine's own)
    properties/  the property tests: oracle agreement, the spec's theorems, the full forward
    checkpoints/ model configs, checkpoint loading and generation
    report/      the JSON and HTML tolerance reports

Run it with ``pytest --pyargs gemma4_conformance --backend=NAME`` (see the README and docs/).
"""
