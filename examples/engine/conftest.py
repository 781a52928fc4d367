"""The engine's own pytest options: they live beside the suite's without a clash."""


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", help="the device the engine's own tests run on")
