"""Measurements of the suite itself (where a run's time goes, how fast the oracles are); tools, not tests."""
