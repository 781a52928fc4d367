"""gemma4-conformance: does an inference engine compute Gemma 4 12B the way the Lean specs say?

The layers, lowest first; each imports only those below it (tests/test_layers.py):

    spec/         the arbitrary-precision oracles, one per Lean definition, and the model graph
    checkpoints/  model configs, checkpoint loading and generation (and tracefile.py, trace files)
    adapters/     the adapter contract and the backends under test: numpy, torch, jax, transformers,
                  llama.cpp, vLLM, or an engine's own
    composition/  an adapter's ops run by the graph: the composed forward, its trace, a serving session
    properties/   the judging: op table, strategies, error models, budgets, forward/trace/serving verdicts
    report/       what a run recorded, and the JSON and HTML reports
    plugin.py     the pytest plugin (with the property tests, properties/test_*.py)

Run it with ``pytest --pyargs gemma4_conformance --backend=NAME`` (see the README and docs/).
"""
