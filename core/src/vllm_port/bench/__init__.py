"""Benchmarks. They are not tests: each prints a table and can write JSON for docs/results/."""
