"""The engine's own pytest options: they live beside the suite's without a clash (an option named like one
of the suite's, such as --backend or --device, would clash: docs/ci.md says what to do then)."""


def pytest_addoption(parser):
    parser.addoption("--engine-device", default="cpu", help="the device the engine's own tests run on")
