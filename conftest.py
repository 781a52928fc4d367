# In this repository the suite's pytest plugin is always on (`pytest --backend=torch`); elsewhere it is
# asked for with `-p gemma4_conformance.plugin`, so installing the suite changes no other test run.
pytest_plugins = ["gemma4_conformance.plugin"]
