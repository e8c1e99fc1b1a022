"""Benchmarks: ratios measured in one run, never timed unit tests."""
